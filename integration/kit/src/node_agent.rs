//! The node agent as tests run it: a process in a lab node's namespace,
//! talking to [`crate::fakes::api_server::ApiServer`], with every host path (CNI
//! bin and conf directories, leases, the service account) under the
//! node's temporary directory.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Child;

use serde_json::{Value, json};

use crate::fakes::api_server::ApiServer;
use crate::{Node, bin, spawn_in};

/// A Node object as the API server serves it.
pub fn node_object(name: &str, pod_cidrs: &[&str], internal_ips: &[&str]) -> Value {
    let mut addresses: Vec<Value> = internal_ips
        .iter()
        .map(|ip| json!({"type": "InternalIP", "address": ip}))
        .collect();
    addresses.push(json!({"type": "Hostname", "address": name}));
    json!({
        "metadata": {"name": name},
        "spec": {"podCIDR": pod_cidrs.first(), "podCIDRs": pod_cidrs},
        "status": {"addresses": addresses},
    })
}

/// A NetworkPolicy of `namespace` selecting its pods labelled `app:
/// <app>`, of `rules` ingress rules as a tenant may write thousands: rule
/// `i` admits the block `10.<100 + i/256>.<i%256>.0/24` but its `.7`, on
/// TCP port `10000 + i`.
pub fn block_rules_policy(namespace: &str, name: &str, app: &str, rules: usize) -> Value {
    assert!(rules <= 256 * 156, "blocks of 10.100.0.0 to 10.255.255.0 only");
    let ingress: Vec<Value> = (0..rules)
        .map(|i| {
            let (high, low) = (100 + i / 256, i % 256);
            json!({"from": [{"ipBlock": {"cidr": format!("10.{high}.{low}.0/24"),
                                         "except": [format!("10.{high}.{low}.7/32")]}}],
                   "ports": [{"protocol": "TCP", "port": 10_000 + i}]})
        })
        .collect();
    json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"], "ingress": ingress},
    })
}

/// The uplink of a lab node: a link holding the node's InternalIP
/// (10.250.0.11), with an MTU pods must inherit (a veth: this kernel has
/// no dummy links).
pub fn uplink(node: &Node) {
    node.netns
        .ip(&[
            "link", "add", "uplink0", "mtu", "1450", "type", "veth", "peer", "name", "uplink0p", "mtu",
            "1450",
        ])
        .success();
    node.netns
        .ip(&["addr", "add", "10.250.0.11/24", "dev", "uplink0"])
        .success();
    for link in ["uplink0", "uplink0p"] {
        node.netns.ip(&["link", "set", link, "up"]).success();
    }
}

/// A running agent in a node's namespace, SIGTERMed when dropped. What it
/// logs is read as it comes (a pipe left unread would stop an agent that
/// logs more than the pipe holds) and handed over when it ends.
#[derive(Debug)]
pub struct Agent {
    child: Option<Child>,
    log: Option<std::thread::JoinHandle<String>>,
    pub health: u16,
}

/// The node's CNI bin directory, where its agent installs the plugins.
pub fn host_bin(node: &Node) -> PathBuf {
    node.path("bin")
}

/// The lease directory the agent's conflist names.
pub fn host_leases(node: &Node) -> PathBuf {
    node.path("leases")
}

/// Where the agent reads the plugins' log records (`PLUGIN_LOG_SOCKET`),
/// as the entries it writes name it.
pub fn host_log_socket(node: &Node) -> PathBuf {
    node.path("run/log.sock")
}

/// Where new pods' ADDs wait on the agent's NetworkPolicy gate
/// (`POLICY_SOCKET`).
pub fn host_policy_socket(node: &Node) -> PathBuf {
    node.path("run/policy.sock")
}

/// The conflist the agent writes.
pub fn host_conflist(node: &Node) -> PathBuf {
    node.conf_dir().join("10-cni-suite.conflist")
}

/// The settings the agent of Node `name` runs with in `node`: reaching
/// `server` at `server_host` with its service account (written now),
/// answering health checks and metrics on `health` of the node's loopback,
/// every host path under the node's directory; `extra` adds or overrides
/// settings (the last of a name wins).
pub fn agent_env(
    node: &Node,
    name: &str,
    server: &ApiServer,
    server_host: &str,
    token: &str,
    health: u16,
    extra: &[(&str, &str)],
) -> Vec<(String, String)> {
    let account = server.service_account(&node.path(""), token);
    let path = |path: PathBuf| path.to_str().expect("UTF-8").to_owned();
    let mut env = vec![
        ("NODE_NAME", name.to_owned()),
        ("KUBERNETES_SERVICE_HOST", server_host.to_owned()),
        ("KUBERNETES_SERVICE_PORT", server.port.to_string()),
        ("SERVICE_ACCOUNT_DIR", path(account)),
        ("CNI_CONF_DIR", path(node.conf_dir())),
        ("CNI_LEASE_DIR", path(host_leases(node))),
        ("CNI_BIN_DIR", path(host_bin(node))),
        ("HEALTH_LISTEN", format!("127.0.0.1:{health}")),
        // The default is the host's /run/cni-suite: never a test's.
        (
            "ISTIO_KUBECONFIG",
            path(node.path("run/istio-cni/istio-cni-kubeconfig")),
        ),
        ("PLUGIN_LOG_SOCKET", path(host_log_socket(node))),
        ("POLICY_SOCKET", path(host_policy_socket(node))),
        // Off but where a test turns it on: its watches are the policy
        // tests' to count.
        ("NETWORK_POLICY", "false".to_owned()),
    ];
    env.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
    env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

impl Agent {
    /// Starts the agent of Node `name` in `node`, reaching `server` at
    /// `server_host`; `extra` adds or overrides settings.
    pub fn start(
        node: &Node,
        name: &str,
        server: &ApiServer,
        server_host: &str,
        token: &str,
        extra: &[(&str, &str)],
    ) -> Agent {
        Agent::start_under(node, name, server, server_host, token, extra, &[])
    }

    /// [`Agent::start`], run through `wrapper` (a command and its
    /// arguments, the agent's path appended), as `setpriv` to give it a
    /// container's capabilities only.
    pub fn start_under(
        node: &Node,
        name: &str,
        server: &ApiServer,
        server_host: &str,
        token: &str,
        extra: &[(&str, &str)],
        wrapper: &[&str],
    ) -> Agent {
        let health = free_port(node);
        let env = agent_env(node, name, server, server_host, token, health, extra);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let agent = bin("cni-node-agent");
        let child = match wrapper.split_first() {
            None => spawn_in(node.netns.path(), &agent, &[], &env, ""),
            Some((program, args)) => {
                let mut args = args.to_vec();
                args.push(agent.to_str().expect("UTF-8"));
                spawn_in(node.netns.path(), std::path::Path::new(program), &args, &env, "")
            }
        };
        let mut child = child;
        let log = child.stderr.take().map(|mut stderr| {
            std::thread::spawn(move || {
                let mut text = Vec::new();
                let _ = std::io::Read::read_to_end(&mut stderr, &mut text);
                String::from_utf8_lossy(&text).into_owned()
            })
        });
        Agent {
            child: Some(child),
            log,
            health,
        }
    }

    /// GET `path` of the health endpoint: status code and body.
    pub fn probe(&self, node: &Node, path: &str) -> Option<(u16, String)> {
        probe(node, self.health, path)
    }

    pub fn ready(&self, node: &Node) -> bool {
        ready(node, self.health)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL: nothing of the agent's stop runs.
    pub fn kill(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().expect("kill");
        child.wait().expect("wait");
    }

    /// Waits up to `limit` for the agent to exit by itself: its exit status
    /// and what it logged, or None (it is still running).
    pub fn exited(&mut self, limit: std::time::Duration) -> Option<(std::process::ExitStatus, String)> {
        let started = std::time::Instant::now();
        let child = self.child.as_mut().expect("running");
        while child.try_wait().expect("wait").is_none() {
            if started.elapsed() > limit {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let status = self.child.take().expect("running").wait().expect("wait");
        Some((status, self.logged()))
    }

    /// SIGTERM, then the exit status and what it logged.
    pub fn stop(&mut self) -> (std::process::ExitStatus, String) {
        let mut child = self.child.take().expect("running");
        let pid = child.id().to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
        let status = child.wait().expect("wait");
        (status, self.logged())
    }

    /// Everything it logged, once it has exited.
    fn logged(&mut self) -> String {
        self.log
            .take()
            .map(|reader| reader.join().unwrap_or_default())
            .unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
        }
    }
}

/// GET `path` of an agent's health endpoint on `port` of the node's
/// loopback: status code and body.
pub fn probe(node: &Node, port: u16, path: &str) -> Option<(u16, String)> {
    let ns = netns::NetNs::open(node.netns.path()).expect("netns");
    let mut stream = ns
        .run(|| TcpStream::connect(("127.0.0.1", port)))
        .expect("enter")
        .ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, text.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned()))
}

/// Whether the agent answering on `port` is ready.
pub fn ready(node: &Node, port: u16) -> bool {
    probe(node, port, "/readyz").is_some_and(|(code, _)| code == 200)
}

pub fn free_port(node: &Node) -> u16 {
    let ns = netns::NetNs::open(node.netns.path()).expect("netns");
    ns.run(|| std::net::TcpListener::bind("127.0.0.1:0"))
        .expect("enter")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A node whose loopback is up (the API test server and the probes use
/// it).
pub fn lab_node() -> Node {
    let node = Node::new();
    node.netns.ip(&["link", "set", "lo", "up"]).success();
    node
}

/// A lab node as kind's image makes one: Debian's reference plugins kindnet
/// uses (ptp, host-local, portmap, loopback) in its bin directory.
pub fn kind_node() -> Node {
    let node = lab_node();
    let bin = host_bin(&node);
    std::fs::create_dir_all(&bin).expect("bin dir");
    for plugin in ["ptp", "host-local", "portmap", "loopback"] {
        std::fs::copy(
            std::path::Path::new("/usr/lib/cni").join(plugin),
            bin.join(plugin),
        )
        .expect("a reference plugin");
    }
    node
}

/// kindnet's conflist as kindnetd writes it (`10-kindnet.conflist`), its
/// leases under the node's directory rather than the host's /run.
pub fn kindnet_conflist(node: &Node) -> Value {
    json!({"cniVersion": "0.3.1", "name": "kindnet", "plugins": [
        {"type": "ptp", "ipMasq": false, "mtu": 1500, "ipam": {"type": "host-local",
         "dataDir": node.path("kindnet-ipam"), "ranges": [[{"subnet": "10.244.1.0/24"}]],
         "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": true}}
    ]})
}

/// `ip [-6] route show proto 201` in the node: the agent's routes, as
/// `<dst> via <gateway>`, sorted.
pub fn agent_routes(node: &Node) -> Vec<String> {
    let mut routes = Vec::new();
    for family in ["-4", "-6"] {
        let shown = node
            .netns
            .ip(&[family, "route", "show", "proto", "201"])
            .success()
            .stdout;
        routes.extend(shown.lines().map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            format!(
                "{} via {}",
                words.first().unwrap_or(&""),
                words.get(2).unwrap_or(&"")
            )
        }));
    }
    routes.sort();
    routes
}

/// The destinations the agent's masquerade chain returns for as the
/// cluster's pods, from `iptables-save -t nat` (or ip6tables-save) output.
pub fn egress_returns(nat_rules: &str) -> Vec<String> {
    nat_rules
        .lines()
        .filter(|l| l.starts_with("-A CNI-SUITE-EGRESS -d ") && l.contains("to pods of the cluster"))
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_owned))
        .collect()
}

/// A lab node with the agent of its Node object `n1` ready: the API test
/// server in the node's namespace serving `n1` (pod CIDR 10.244.1.0/24,
/// InternalIP 10.250.0.11 on the [`uplink`], or the node's loopback without
/// one), and the agent reaching it on the loopback. Fields drop in order:
/// the agent (SIGTERMed), the server, then the node.
#[derive(Debug)]
pub struct ReadyNode {
    pub agent: Agent,
    pub server: ApiServer,
    pub node: Node,
}

/// Builds a [`ReadyNode`]: `AgentFixture::new(token).uplink().settings(&[...]).start()`,
/// or `.on(node)` for a node the test prepared before the agent starts
/// (another network's file written, a pod set up).
#[derive(Debug)]
pub struct AgentFixture<'a> {
    token: &'a str,
    uplink: bool,
    pod_cidr: &'a str,
    settings: Vec<(&'a str, &'a str)>,
    node: Option<Node>,
}

impl<'a> AgentFixture<'a> {
    /// A node without an uplink (`n1`'s InternalIP its loopback), the agent
    /// with the default settings, the service account holding `token`.
    pub fn new(token: &'a str) -> Self {
        AgentFixture {
            token,
            uplink: false,
            pod_cidr: "10.244.1.0/24",
            settings: Vec::new(),
            node: None,
        }
    }

    /// The agent runs on `node`, made by [`lab_node`] and prepared by the
    /// test, rather than on a new one.
    pub fn on(mut self, node: Node) -> Self {
        self.node = Some(node);
        self
    }

    /// The node has its [`uplink`], `n1`'s InternalIP on it.
    pub fn uplink(mut self) -> Self {
        self.uplink = true;
        self
    }

    /// `n1`'s pod CIDR, 10.244.1.0/24 unless a test needs addresses no
    /// other test's pods hold (a pod found through /proc by its address).
    pub fn pod_cidr(mut self, cidr: &'a str) -> Self {
        self.pod_cidr = cidr;
        self
    }

    /// Settings the agent adds or overrides (as [`agent_env`]'s `extra`).
    pub fn settings(mut self, settings: &[(&'a str, &'a str)]) -> Self {
        self.settings.extend_from_slice(settings);
        self
    }

    /// The node, the server with `n1` applied, and the agent, once ready
    /// (within 20 s).
    pub fn start(self) -> ReadyNode {
        let node = self.node.unwrap_or_else(lab_node);
        let internal_ip = if self.uplink {
            uplink(&node);
            "10.250.0.11"
        } else {
            "127.0.0.1"
        };
        let server = ApiServer::start(node.netns.path(), self.token);
        server.apply_node(node_object("n1", &[self.pod_cidr], &[internal_ip]));
        let agent = Agent::start(&node, "n1", &server, "127.0.0.1", self.token, &self.settings);
        crate::wait_for("readiness", std::time::Duration::from_secs(20), || {
            agent.ready(&node)
        });
        ReadyNode { agent, server, node }
    }
}
