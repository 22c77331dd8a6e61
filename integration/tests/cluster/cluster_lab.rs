//! Three nodes, each a network namespace with its own host paths, joined
//! by an underlay bridge, each running the node agent against the API test
//! server: the agents install the suite over the nodes' upstream plugins,
//! write each node's conflist, route between the nodes and masquerade only
//! what leaves the cluster. Pods added through cnictl with those conflists
//! talk across nodes keeping their addresses; a fourth Node is routed to
//! within 2 s; a restarted agent changes nothing; agents stopped with
//! uninstall leave each node as it was.
//!
//! `make demo-cluster` runs this test and shows what it does (`LAB_SAY=1`).

use std::collections::BTreeMap;
use std::net::{IpAddr, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use test_kit::fakes::api_server::ApiServer;
use test_kit::fakes::containerd::Containerd;
use test_kit::node_agent::{
    Agent, agent_routes, egress_returns, host_bin, host_conflist, host_leases, lab_node, node_object,
};
use test_kit::{Netns, Node, bin_dir, require_root, run_in, wait_for};

const TOKEN: &str = "lab-token";
const NETWORK: &str = "cni-suite";
/// The address of the API test server and of the underlay's bridge.
const SERVER: &str = "10.250.0.1";
/// Upstream plugins a kind node ships, installed here from Debian's
/// reference build before the agents come.
const UPSTREAM: [&str; 3] = ["host-local", "loopback", "portmap"];
const REFERENCE_DIR: &str = "/usr/lib/cni";

/// Narrates the lab for `make demo-cluster`.
fn say(text: &str) {
    if std::env::var_os("LAB_SAY").is_some() {
        eprintln!("lab: {text}");
    }
}

struct LabNode {
    name: String,
    node: Node,
    v4: String,
    v6: String,
}

impl LabNode {
    fn pod_cidrs(index: u8) -> [String; 2] {
        [
            format!("10.244.{index}.0/24"),
            format!("fd00:10:244:{index}::/64"),
        ]
    }

    fn object(&self, index: u8) -> Value {
        let [v4, v6] = LabNode::pod_cidrs(index);
        node_object(&self.name, &[&v4, &v6], &[&self.v4, &self.v6])
    }

    /// A pod added through cnictl with the conflist this node's agent
    /// wrote and the plugins it installed: its addresses.
    fn add_pod(&self, pod: &Netns) -> (String, String) {
        let bin = host_bin(&self.node);
        let result = self
            .node
            .cnictl_env(
                &["--json", "add", NETWORK, pod.path_str()],
                &[("CNI_PATH", bin.to_str().expect("UTF-8"))],
            )
            .success()
            .json();
        let address = |v4: bool| {
            result["ips"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|ip| ip["address"].as_str()?.split('/').next())
                .find(|ip| ip.contains(':') != v4)
                .unwrap_or_else(|| panic!("no address of the family in {result}"))
                .to_owned()
        };
        (address(true), address(false))
    }

    fn del_pod(&self, pod: &Netns) {
        let bin = host_bin(&self.node);
        self.node
            .cnictl_env(
                &["del", NETWORK, pod.path_str()],
                &[("CNI_PATH", bin.to_str().expect("UTF-8"))],
            )
            .success();
    }

    fn agent(&self, server: &ApiServer, uninstall: bool) -> Agent {
        let uninstall = if uninstall { "true" } else { "false" };
        Agent::start(
            &self.node,
            &self.name,
            server,
            SERVER,
            TOKEN,
            &[("UNINSTALL_ON_STOP", uninstall)],
        )
    }

    /// What the agent may change on the node: files under its host paths
    /// (with content hashes), routes, nat rules, links.
    fn state(&self) -> BTreeMap<String, String> {
        let mut state = BTreeMap::new();
        for dir in [host_bin(&self.node), self.node.conf_dir()] {
            for (path, hash) in files(&dir) {
                state.insert(format!("file {path}"), hash);
            }
        }
        // The lease database changes as it is used; that it is there is
        // the agent's doing.
        let leases = host_leases(&self.node);
        state.insert(format!("dir {}", leases.display()), leases.exists().to_string());
        for family in ["-4", "-6"] {
            let routes = self.node.netns.ip(&[family, "route", "show"]).success().stdout;
            state.insert(format!("routes {family}"), routes);
        }
        for save in [
            "iptables-save",
            "ip6tables-save",
            "iptables-legacy-save",
            "ip6tables-legacy-save",
        ] {
            let rules: Vec<String> = self
                .node
                .run(save, &["-t", "nat"])
                .success()
                .stdout
                .lines()
                // Rules and chains made by someone; the built-in chains
                // appear once anything loaded the table.
                .filter(|line| line.starts_with("-A ") || (line.starts_with(':') && line.contains(" - ")))
                .map(|line| line.split(" [").next().unwrap_or(line).to_owned())
                .collect();
            state.insert(save.to_owned(), rules.join("\n"));
        }
        // iptables-save prints the built-in chains whether they exist or
        // not; nf_tables shows the nat tables and base chains iptables-nft
        // made for a first rule, which outlive the rule.
        let tables = self.node.run("nft", &["list", "tables"]).success().stdout;
        for table in tables.lines().filter_map(|line| line.strip_prefix("table ")) {
            let Some(family) = table.strip_suffix(" nat") else {
                continue;
            };
            let listed = self
                .node
                .run("nft", &["list", "table", family, "nat"])
                .success()
                .stdout;
            let chains: Vec<&str> = listed
                .lines()
                .filter_map(|line| line.trim().strip_prefix("chain "))
                .map(|chain| chain.trim_end_matches(" {"))
                .collect();
            state.insert(format!("chains of table {table}"), chains.join(" "));
        }
        state.insert("nft tables".into(), tables);
        let links = self.node.netns.ip(&["-o", "link", "show"]).success().stdout;
        let names: Vec<&str> = links.lines().filter_map(|l| l.split(": ").nth(1)).collect();
        state.insert("links".into(), names.join(" "));
        state
    }
}

/// Every directory and regular file under `dir` (recursively, dot-files
/// included), files with the SHA-256 of their content.
fn files(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.insert(path.display().to_string(), "directory".into());
            out.extend(files(&path));
        } else if path.is_file() {
            let hash = test_kit::run("sha256sum", &[path.to_str().expect("UTF-8")])
                .success()
                .stdout;
            out.insert(
                path.display().to_string(),
                hash.split(' ').next().unwrap_or_default().to_owned(),
            );
        }
    }
    out
}

fn same_content(a: &Path, b: &Path) -> bool {
    std::fs::read(a).is_ok_and(|a| std::fs::read(b).is_ok_and(|b| a == b))
}

/// One veth from the underlay's bridge into `ns` (as `eth0`), with the
/// node's underlay addresses.
fn attach(underlay: &Netns, port: &str, ns: &Netns, v4: &str, v6: &str) {
    underlay.veth_to(port, ns);
    underlay
        .ip(&["link", "set", port, "master", "ul0", "up"])
        .success();
    ns.ip(&["addr", "add", &format!("{v4}/24"), "dev", "eth0"])
        .success();
    ns.ip(&["addr", "add", &format!("{v6}/64"), "dev", "eth0", "nodad"])
        .success();
    ns.ip(&["link", "set", "eth0", "up"]).success();
    ns.ip(&["link", "set", "lo", "up"]).success();
}

fn ping(from: &Netns, to: &str) {
    let ping = if to.contains(':') { "ping6" } else { "ping" };
    let mut last = None;
    for _ in 0..3 {
        let run = run_in(
            from.path(),
            Path::new("busybox"),
            &[ping, "-c", "1", "-W", "2", to],
            &[],
            "",
        );
        if run.ok() {
            return;
        }
        last = Some(run);
    }
    panic!("{} cannot reach {to}: {:?}", from.name(), last);
}

/// Sends UDP datagrams from namespace `from` to `to` in namespace `at`
/// and returns the source address the receiver saw.
fn source_seen(from: &Netns, at: &Path, to: &str) -> IpAddr {
    let to: IpAddr = to.parse().expect("address");
    let receiver_ns = netns::NetNs::open(at).expect("netns");
    let receiver = receiver_ns
        .run(|| UdpSocket::bind((to, 0)))
        .expect("enter")
        .expect("bind");
    receiver
        .set_read_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    let port = receiver.local_addr().expect("addr").port();
    let sender_ns = netns::NetNs::open(from.path()).expect("netns");
    let unspecified: IpAddr = if to.is_ipv4() {
        "0.0.0.0".parse().expect("v4")
    } else {
        "::".parse().expect("v6")
    };
    let sender = sender_ns
        .run(|| UdpSocket::bind((unspecified, 0)))
        .expect("enter")
        .expect("bind");
    let mut buffer = [0u8; 16];
    for _ in 0..5 {
        sender.send_to(b"hello", (to, port)).expect("send");
        if let Ok((_, source)) = receiver.recv_from(&mut buffer) {
            return source.ip();
        }
    }
    panic!("nothing from {} reached {to}", from.name());
}

struct Lab {
    /// Held for the lab's lifetime: the nodes' wire.
    _underlay: Netns,
    outside: Netns,
    server: ApiServer,
    nodes: Vec<LabNode>,
}

impl Lab {
    fn new(count: u8) -> Lab {
        let underlay = Netns::new("underlay");
        underlay.ip(&["link", "set", "lo", "up"]).success();
        underlay.ip(&["link", "add", "ul0", "type", "bridge"]).success();
        underlay
            .ip(&["addr", "add", &format!("{SERVER}/24"), "dev", "ul0"])
            .success();
        underlay
            .ip(&["addr", "add", "fd00:250::1/64", "dev", "ul0", "nodad"])
            .success();
        underlay.ip(&["link", "set", "ul0", "up"]).success();
        let outside = Netns::new("outside");
        attach(&underlay, "ul-out", &outside, "10.250.0.200", "fd00:250::200");
        let server = ApiServer::start_at(underlay.path(), SERVER, TOKEN);
        let nodes = (1..=count)
            .map(|index| {
                let node = lab_node();
                let (v4, v6) = (format!("10.250.0.1{index}"), format!("fd00:250::1{index}"));
                attach(&underlay, &format!("ul{index}"), &node.netns, &v4, &v6);
                let bin = host_bin(&node);
                std::fs::create_dir_all(&bin).expect("bin dir");
                for plugin in UPSTREAM {
                    std::fs::copy(Path::new(REFERENCE_DIR).join(plugin), bin.join(plugin))
                        .expect("upstream plugin");
                }
                LabNode {
                    name: format!("n{index}"),
                    node,
                    v4,
                    v6,
                }
            })
            .collect();
        Lab {
            _underlay: underlay,
            outside,
            server,
            nodes,
        }
    }

    /// One pod on every node, added through its agent's conflist, and
    /// its (IPv4, IPv6) addresses.
    fn pod_on_every_node(&self) -> (Vec<Netns>, Vec<(String, String)>) {
        let pods: Vec<Netns> = self
            .nodes
            .iter()
            .map(|n| n.node.pod(&format!("pod-{}", n.name)))
            .collect();
        let addresses = self
            .nodes
            .iter()
            .zip(&pods)
            .map(|(n, pod)| n.add_pod(pod))
            .collect();
        (pods, addresses)
    }

    fn wait_ready(&self, agents: &[Agent]) {
        for (lab_node, agent) in self.nodes.iter().zip(agents) {
            wait_for(
                &format!("{}'s agent ready", lab_node.name),
                Duration::from_secs(30),
                || agent.ready(&lab_node.node),
            );
        }
    }
}

/// How long the agents of `nodes` take to all show `wanted` (None: not
/// within `limit`).
fn every_node_shows(
    nodes: &[LabNode],
    limit: Duration,
    wanted: impl Fn(&LabNode) -> bool,
) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if nodes.iter().all(&wanted) {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// The destinations the agent's masquerade chain on `node` returns for as
/// the cluster's pods, IPv4 then IPv6.
fn cluster_returns(node: &LabNode) -> Vec<String> {
    let mut returns = Vec::new();
    for save in ["iptables-save", "ip6tables-save"] {
        returns.extend(egress_returns(
            &node.node.run(save, &["-t", "nat"]).success().stdout,
        ));
    }
    returns
}

#[test]
fn three_nodes_wired_by_their_agents_talk_keeping_pod_addresses() {
    require_root();
    assert!(
        Path::new(REFERENCE_DIR).join("host-local").exists(),
        "Debian's containernetworking-plugins (make deps) provides the upstream plugins"
    );
    let lab = Lab::new(3);
    let before: Vec<BTreeMap<String, String>> = lab.nodes.iter().map(LabNode::state).collect();
    for (index, lab_node) in lab.nodes.iter().enumerate() {
        lab.server
            .apply_node(lab_node.object(u8::try_from(index + 1).expect("few")));
    }
    say("three nodes on an underlay, the API test server at 10.250.0.1; starting an agent on each");
    // n1's agent is restarted later without uninstalling; the others stop
    // with uninstall at the end.
    let mut agents: Vec<Agent> = lab
        .nodes
        .iter()
        .enumerate()
        .map(|(index, n)| n.agent(&lab.server, index != 0))
        .collect();
    lab.wait_ready(&agents);

    // Installed over the upstream plugins, which are kept aside.
    for lab_node in &lab.nodes {
        let bin = host_bin(&lab_node.node);
        for plugin in test_kit::PLUGINS {
            assert!(
                same_content(&bin.join(plugin), &bin_dir().join(plugin)),
                "{}: {plugin} is the suite's",
                lab_node.name
            );
        }
        for plugin in UPSTREAM {
            assert!(
                same_content(
                    &bin.join(".cni-suite/replaced").join(plugin),
                    &Path::new(REFERENCE_DIR).join(plugin)
                ),
                "{}: the upstream {plugin} is kept aside",
                lab_node.name
            );
        }
        let conf: Value =
            serde_json::from_str(&std::fs::read_to_string(host_conflist(&lab_node.node)).expect("conflist"))
                .expect("JSON");
        let plugins: Vec<&str> = conf["plugins"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["type"].as_str())
            .collect();
        assert_eq!(plugins, ["bridge", "portmap"], "{conf}");
        say(&format!(
            "{}: conflist for {} and {}, plugins installed (upstream host-local, loopback and portmap kept aside)",
            lab_node.name,
            conf["plugins"][0]["ipam"]["ranges"][0][0]["subnet"],
            conf["plugins"][0]["ipam"]["ranges"][1][0]["subnet"]
        ));
    }

    // The agent runs host-local's lease service for the lease directory,
    // from the host-local it installed.
    let socket = host_leases(&lab.nodes[0].node).join(".sled/.service.sock");
    let services = test_kit::services_under(&host_leases(&lab.nodes[0].node));
    assert_eq!(services.len(), 1, "one lease service for {}", socket.display());
    let exe = std::fs::read_link(format!("/proc/{}/exe", services[0])).expect("exe");
    assert_eq!(exe, host_bin(&lab.nodes[0].node).join("host-local"));
    let parent = std::fs::read_to_string(format!("/proc/{}/stat", services[0])).expect("stat");
    let parent: u32 = parent
        .rsplit(") ")
        .next()
        .and_then(|r| r.split(' ').nth(1))
        .and_then(|p| p.parse().ok())
        .expect("ppid");
    assert_eq!(Some(parent), agents[0].pid(), "started by the agent");

    let (pods, addresses) = lab.pod_on_every_node();
    for (lab_node, (v4, v6)) in lab.nodes.iter().zip(&addresses) {
        say(&format!("pod on {} has {v4} and {v6}", lab_node.name));
    }
    for (from, to) in [(0, 1), (1, 2), (2, 0)] {
        ping(&pods[from], &addresses[to].0);
        ping(&pods[from], &addresses[to].1);
        say(&format!(
            "pod on n{} pinged the pod on n{} over IPv4 and IPv6",
            from + 1,
            to + 1
        ));
    }
    // Inside the cluster a packet keeps its pod source address; leaving
    // it, it takes the node's.
    for (pod_address, node_address, family) in [
        (&addresses[0].0, &lab.nodes[0].v4, 0),
        (&addresses[0].1, &lab.nodes[0].v6, 1),
    ] {
        let to_pod = if family == 0 {
            &addresses[1].0
        } else {
            &addresses[1].1
        };
        let seen = source_seen(&pods[0], pods[1].path(), to_pod);
        assert_eq!(seen.to_string(), *pod_address, "no masquerade between pods");
        say(&format!(
            "n2's pod received from {seen}: the sender's pod address"
        ));
        let outside = if family == 0 {
            "10.250.0.200"
        } else {
            "fd00:250::200"
        };
        let seen = source_seen(&pods[0], lab.outside.path(), outside);
        assert_eq!(seen.to_string(), *node_address, "masqueraded leaving the cluster");
        say(&format!(
            "a host outside the cluster received from {seen}: n1's address"
        ));
    }

    // The Nodes' CIDRs merged (10.244.1-3.0/24: 10.244.1.0/24 and
    // 10.244.2.0/23), not a rule per Node.
    assert_eq!(
        cluster_returns(&lab.nodes[0]),
        [
            "10.244.1.0/24",
            "10.244.2.0/23",
            "fd00:10:244:1::/64",
            "fd00:10:244:2::/63"
        ]
    );

    // A fourth Node: every node routes to it within 2 s, and stops when it
    // goes.
    let [n4_v4, n4_v6] = LabNode::pod_cidrs(4);
    lab.server.apply_node(node_object(
        "n4",
        &[&n4_v4, &n4_v6],
        &["10.250.0.14", "fd00:250::14"],
    ));
    let routed = |n: &LabNode| {
        let routes = agent_routes(&n.node);
        routes.contains(&format!("{n4_v4} via 10.250.0.14"))
            && routes.contains(&format!("{n4_v6} via fd00:250::14"))
    };
    let took = every_node_shows(&lab.nodes, Duration::from_secs(2), routed);
    assert!(took.is_some(), "every node routes to n4 within 2 s");
    // Its CIDRs join the merged ones (10.244.4.0/24 has no sibling here).
    let grown = every_node_shows(&lab.nodes, Duration::from_secs(2), |n| {
        cluster_returns(n)
            == [
                "10.244.1.0/24",
                "10.244.2.0/23",
                "10.244.4.0/24",
                "fd00:10:244:1::/64",
                "fd00:10:244:2::/63",
                "fd00:10:244:4::/64",
            ]
    });
    assert!(grown.is_some(), "{:?}", cluster_returns(&lab.nodes[0]));
    say(&format!(
        "a fourth Node: every node routed to its pod CIDRs within {took:?}"
    ));
    lab.server.delete_node("n4");
    let took = every_node_shows(&lab.nodes, Duration::from_secs(2), |n| !routed(n));
    assert!(took.is_some(), "n4's routes gone within 2 s");

    // A restarted agent changes nothing on its node, and pods still talk.
    let settled = lab.nodes[0].state();
    let conflist_inode = std::os::unix::fs::MetadataExt::ino(
        &std::fs::metadata(host_conflist(&lab.nodes[0].node)).expect("stat"),
    );
    let (status, log) = agents[0].stop();
    assert!(status.success(), "{log}");
    agents[0] = lab.nodes[0].agent(&lab.server, true);
    wait_for("n1's agent ready again", Duration::from_secs(30), || {
        agents[0].ready(&lab.nodes[0].node)
    });
    assert_eq!(lab.nodes[0].state(), settled, "a restart changes nothing");
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(
            &std::fs::metadata(host_conflist(&lab.nodes[0].node)).expect("stat")
        ),
        conflist_inode,
        "the conflist is not rewritten"
    );
    ping(&pods[0], &addresses[1].0);
    say("n1's agent restarted: nothing on the node changed, pods still talk");

    // Pods go, then every agent stops with uninstall: each node is as it
    // was before the agents came.
    for (lab_node, pod) in lab.nodes.iter().zip(&pods) {
        lab_node.del_pod(pod);
    }
    for (index, ((lab_node, agent), before)) in lab.nodes.iter().zip(&mut agents).zip(&before).enumerate() {
        let (status, log) = agent.stop();
        assert!(status.success(), "{log}");
        if index == 0 {
            // The restarted agent found everything in place: it wrote,
            // installed and masqueraded nothing (its rules compare equal
            // to what iptables-save prints).
            let running = log.split("SIGTERM").next().unwrap_or_default();
            for change in [
                "masquerading traffic",
                "\"msg\":\"installed",
                "\"msg\":\"wrote",
                "\"msg\":\"route ",
            ] {
                assert!(
                    !running.contains(change),
                    "the restarted agent changed something ({change}): {running}"
                );
            }
        }
        let after = lab_node.state();
        let changed: Vec<(&String, Option<&String>, Option<&String>)> = before
            .keys()
            .chain(after.keys())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .filter(|key| before.get(*key) != after.get(*key))
            .map(|key| (key, before.get(key), after.get(key)))
            .collect();
        assert!(
            changed.is_empty(),
            "{}: changed by the agent: {changed:#?}\n{log}",
            lab_node.name
        );
        assert!(test_kit::services_under(&host_leases(&lab_node.node)).is_empty());
    }
    say("every agent stopped with uninstall: each node is as it was before");
}

/// The image `make image` builds (tagged with the workspace's version),
/// as containerd names what the manifest asks for.
fn image() -> String {
    format!("docker.io/cni-suite/node-agent:{}", env!("CARGO_PKG_VERSION"))
}

/// `deploy/image.py` over the binaries under test, into `dir`.
fn build_image(dir: &Path) -> std::path::PathBuf {
    let tar = dir.join("cni-suite-image.tar");
    let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/image.py");
    test_kit::run(
        &tool,
        &[
            tar.to_str().expect("UTF-8"),
            &image(),
            bin_dir().to_str().expect("UTF-8"),
        ],
    )
    .success();
    tar
}

/// The agent of `lab_node` run from the imported image as the DaemonSet
/// runs it: host network, the host's pid namespace, NET_ADMIN and NET_RAW,
/// and the manifest's hostPath mounts (each host path at its own path, so
/// the conflist names paths the runtime on the host finds), the service
/// account where the kubelet mounts it.
fn run_agent_container(containerd: &Containerd, lab: &Lab, lab_node: &LabNode, health: u16) {
    let node = &lab_node.node;
    let account = lab.server.service_account(&node.path(""), TOKEN);
    // The manifest mounts the lease directory's parent (`/run/cni-suite`,
    // which the kubelet creates): the agent removes the directory itself.
    let (bin, conf, leases) = (host_bin(node), node.conf_dir(), host_leases(node));
    std::fs::create_dir_all(&leases).expect("lease dir's parent");
    let xtables_lock = node.path("xtables.lock");
    std::fs::write(&xtables_lock, "").expect("lock file");
    let bind = |src: &Path, dst: &Path, mode: &str| {
        format!(
            "type=bind,src={},dst={},options=rbind:{mode}",
            src.display(),
            dst.display()
        )
    };
    let mounts = [
        bind(&bin, &bin, "rw"),
        bind(&conf, &conf, "rw"),
        bind(&leases, &leases, "rw"),
        bind(&xtables_lock, Path::new("/run/xtables.lock"), "rw"),
        bind(
            &account,
            Path::new("/var/run/secrets/kubernetes.io/serviceaccount"),
            "ro",
        ),
    ];
    let port = lab.server.port.to_string();
    let env = [
        format!("NODE_NAME={}", lab_node.name),
        format!("KUBERNETES_SERVICE_HOST={SERVER}"),
        format!("KUBERNETES_SERVICE_PORT={port}"),
        format!("CNI_BIN_DIR={}", bin.display()),
        format!("CNI_CONF_DIR={}", conf.display()),
        format!("CNI_LEASE_DIR={}", leases.join("ipam").display()),
        // Under the mount standing for the manifest's /run/cni-suite: the
        // plugins, run on the host, send to the path the entries name.
        format!("PLUGIN_LOG_SOCKET={}", leases.join("log.sock").display()),
        format!("POLICY_SOCKET={}", leases.join("policy.sock").display()),
        format!("HEALTH_LISTEN=127.0.0.1:{health}"),
        "UNINSTALL_ON_STOP=true".to_owned(),
    ];
    let log = format!("file://{}", node.path("agent-container.log").display());
    let mut args = vec![
        "run",
        "-d",
        "--net-host",
        "--cap-add",
        "CAP_NET_ADMIN",
        "--cap-add",
        "CAP_NET_RAW",
        "--log-uri",
        &log,
    ];
    for mount in &mounts {
        args.extend(["--mount", mount.as_str()]);
    }
    for pair in &env {
        args.extend(["--env", pair.as_str()]);
    }
    let image = image();
    args.extend([image.as_str(), "node-agent"]);
    containerd.ctr(node, "k8s.io", &args).success();
}

#[test]
fn an_agent_run_from_the_image_wires_its_node_into_the_cluster() {
    require_root();
    let lab = Lab::new(2);
    let before = lab.nodes[1].state();
    for (index, lab_node) in lab.nodes.iter().enumerate() {
        lab.server
            .apply_node(lab_node.object(u8::try_from(index + 1).expect("few")));
    }
    // n2's kubelet uses iptables-legacy (its hint chain is there): the
    // agent's rules must go there too, not to nf_tables.
    lab.nodes[1]
        .node
        .run("iptables-legacy", &["-t", "mangle", "-N", "KUBE-IPTABLES-HINT"])
        .success();
    let images = tempfile::tempdir().expect("tempdir");
    let tar = build_image(images.path());
    // What `docker load` (minikube's docker runtime) reads: the tagged
    // manifest.json, read here by skopeo's docker-archive transport, which
    // finds the image only by that tag.
    let copied = images.path().join("through-docker-archive");
    test_kit::run(
        "skopeo",
        &[
            "copy",
            "-q",
            &format!(
                "docker-archive:{}:cni-suite/node-agent:{}",
                tar.display(),
                env!("CARGO_PKG_VERSION")
            ),
            &format!("oci:{}:check", copied.display()),
        ],
    )
    .success();
    let containerd = Containerd::start(&lab.nodes[1].node, None);
    containerd
        .ctr(
            &lab.nodes[1].node,
            "k8s.io",
            // As `kind load image-archive` runs it inside a node.
            &[
                "images",
                "import",
                "--all-platforms",
                "--digests",
                "--snapshotter",
                "overlayfs",
                tar.to_str().expect("UTF-8"),
            ],
        )
        .success();
    let listed = containerd
        .ctr(&lab.nodes[1].node, "k8s.io", &["images", "ls", "-q"])
        .success()
        .stdout;
    assert!(
        listed.lines().any(|name| name == image()),
        "imported as {}: {listed}",
        image()
    );

    let mut native = lab.nodes[0].agent(&lab.server, true);
    let health = test_kit::node_agent::free_port(&lab.nodes[1].node);
    run_agent_container(&containerd, &lab, &lab.nodes[1], health);
    let container_log =
        || std::fs::read_to_string(lab.nodes[1].node.path("agent-container.log")).unwrap_or_default();
    let started = Instant::now();
    while !test_kit::node_agent::ready(&lab.nodes[1].node, health) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the agent in its container: {}",
            container_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_for("n1's agent ready", Duration::from_secs(30), || {
        native.ready(&lab.nodes[0].node)
    });

    let n2 = &lab.nodes[1];
    for plugin in test_kit::PLUGINS {
        assert!(
            same_content(&host_bin(&n2.node).join(plugin), &bin_dir().join(plugin)),
            "{plugin}"
        );
    }
    assert!(same_content(
        &host_bin(&n2.node).join(".cni-suite/replaced/host-local"),
        &Path::new(REFERENCE_DIR).join("host-local")
    ));
    assert!(host_conflist(&n2.node).exists());
    assert!(
        container_log().contains("iptables: /opt/cni-suite/iptables/legacy"),
        "{}",
        container_log()
    );
    let legacy = n2
        .node
        .run("iptables-legacy-save", &["-t", "nat"])
        .success()
        .stdout;
    let nft = n2.node.run("iptables-nft-save", &["-t", "nat"]).success().stdout;
    assert!(legacy.contains("-A POSTROUTING -s 10.244.2.0/24"), "{legacy}");
    assert!(!nft.contains("CNI-SUITE-EGRESS"), "{nft}");

    let (pods, addresses) = lab.pod_on_every_node();
    ping(&pods[0], &addresses[1].0);
    ping(&pods[1], &addresses[0].1);
    let outside = source_seen(&pods[1], lab.outside.path(), "10.250.0.200");
    assert_eq!(outside.to_string(), n2.v4, "masqueraded through iptables-legacy");
    for (lab_node, pod) in lab.nodes.iter().zip(&pods) {
        lab_node.del_pod(pod);
    }

    // SIGTERM, as the kubelet stops it: uninstalled from inside the
    // container, the node is as it was.
    containerd
        .ctr(
            &n2.node,
            "k8s.io",
            &["task", "kill", "--signal", "SIGTERM", "node-agent"],
        )
        .success();
    wait_for("the agent's container to stop", Duration::from_secs(40), || {
        containerd
            .ctr(&n2.node, "k8s.io", &["task", "ls"])
            .stdout
            .lines()
            .any(|line| line.starts_with("node-agent") && line.contains("STOPPED"))
    });
    containerd
        .ctr(&n2.node, "k8s.io", &["task", "delete", "node-agent"])
        .success();
    containerd
        .ctr(&n2.node, "k8s.io", &["container", "delete", "node-agent"])
        .success();
    // The kubelet made the hostPath directory (DirectoryOrCreate) and
    // leaves it; the agent left it empty.
    std::fs::remove_dir(host_leases(&n2.node)).expect("the lease directory's parent is left empty");
    assert_eq!(before, n2.state(), "{}", container_log());
    let (status, log) = native.stop();
    assert!(status.success(), "{log}");
}
