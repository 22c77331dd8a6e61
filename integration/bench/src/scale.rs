//! `make bench-cluster`, the cluster half: the node agent at thousands of
//! Nodes and the masquerade chain every new connection leaving a pod
//! walks, on the real cluster (`integration/cluster/cluster.sh`, brought up
//! with a pod range holding that many node CIDRs).
//!
//! Nodes without kubelets are Node objects the API server holds (pod
//! CIDRs, InternalIPs on the node network, no `kubernetes.io/os` label, so
//! no DaemonSet pod); the agents of the real nodes follow them as they
//! follow any Node. One more agent, started by the bench, runs in a node
//! namespace of its own on the node network (everything a node has but a
//! kubelet), as the Node `<prefix>-0`: its start, its routes and its work
//! are timed and counted from outside, never reported by the agent.
//! Floors are measured beside it: a LIST of the same Nodes, one
//! `ip -batch` of the same routes, the API's own create round trip.

use std::collections::VecDeque;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::bench_cluster::{
    Api, BenchNode, FakeNodes, LIMIT, PREFIX, PolicyOptions, cpu_ms, daemonset_agents, fake_node,
    lines_as_read, memory_mib,
};
use crate::connect::{connect_times, pod_netns};
use crate::measure::{ms, quantile};
use crate::outcome::{Row, ScaleOutcome};
use crate::sandbox::BurstOptions;
use test_kit::Netns;
use test_kit::cluster::{Cluster, Namespace};
use test_kit::node_agent::egress_returns;

#[derive(Debug, Clone)]
pub struct ScaleOptions {
    pub nodes: usize,
    pub additions: usize,
    pub no_op_updates: usize,
    pub connects: usize,
}

/// Lines `ip monitor route` prints in a namespace, each with when it was
/// read.
struct RouteMonitor {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
}

impl RouteMonitor {
    fn start(netns: &Netns) -> Self {
        let mut child = Command::new("ip")
            .args(["-n", netns.name(), "monitor", "route"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start ip monitor");
        let lines = lines_as_read(child.stdout.take().expect("its stdout"));
        // It listens once it has bound its socket; a route of its own
        // shows when.
        netns
            .ip(&["route", "add", "blackhole", "198.51.100.1/32"])
            .success();
        let monitor = RouteMonitor { child, lines };
        // `ip monitor` prints it as `blackhole 198.51.100.1 …`.
        if monitor
            .wait_for(&["blackhole 198.51.100.1".to_owned()], Duration::from_secs(5))
            .is_none()
        {
            eprintln!("bench: ip monitor showed no route within 5 s");
        }
        netns
            .ip(&["route", "del", "blackhole", "198.51.100.1/32"])
            .success();
        monitor
    }

    /// When the last of lines starting with each of `prefixes` was read
    /// (None after `limit`).
    fn wait_for(&self, prefixes: &[String], limit: Duration) -> Option<Instant> {
        let deadline = Instant::now() + limit;
        let mut left: Vec<&String> = prefixes.iter().collect();
        loop {
            let time_left = deadline.checked_duration_since(Instant::now())?;
            let (at, line) = self.lines.recv_timeout(time_left).ok()?;
            left.retain(|prefix| !line.starts_with(prefix.as_str()));
            if left.is_empty() {
                return Some(at);
            }
        }
    }
}

impl Drop for RouteMonitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Routes of each family in the namespace of `pid`, counted from procfs
/// (no netlink dump competing with the agent).
fn route_counts(pid: u32) -> (usize, usize) {
    let count = |file: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/net/{file}")).map_or(0, |text| text.lines().count())
    };
    (count("route"), count("ipv6_route"))
}

/// The bench's agent: the release binary in the bench node, as Node 0,
/// with the DaemonSet's service account and every host path its own.
struct BenchAgent {
    child: Child,
    /// Its last lines on stderr, read as it writes them (a full pipe
    /// would stop it).
    said: Arc<Mutex<VecDeque<String>>>,
    _dir: tempfile::TempDir,
}

impl BenchAgent {
    /// Prepares its files, then starts it; returns it and when it was
    /// started (after the preparation, which no DaemonSet pod pays).
    fn start(cluster: &Cluster, node: &BenchNode) -> (Self, Instant) {
        let dir = tempfile::tempdir().expect("a directory for the bench agent");
        let account = dir.path().join("serviceaccount");
        std::fs::create_dir_all(&account).expect("the service account directory");
        for (key, value) in service_account(cluster) {
            std::fs::write(account.join(key), value).expect("write the service account");
        }
        let path = |name: &str| dir.path().join(name).to_str().expect("UTF-8").to_owned();
        for sub in ["conf", "bin", "leases"] {
            std::fs::create_dir_all(dir.path().join(sub)).expect("a host directory");
        }
        let env = [
            ("NODE_NAME", format!("{PREFIX}-0")),
            (
                "KUBERNETES_SERVICE_HOST",
                cluster.fact("CONTROL_PLANE_IP").to_owned(),
            ),
            ("KUBERNETES_SERVICE_PORT", "6443".to_owned()),
            ("SERVICE_ACCOUNT_DIR", path("serviceaccount")),
            ("CNI_CONF_DIR", path("conf")),
            ("CNI_BIN_DIR", path("bin")),
            ("CNI_LEASE_DIR", path("leases")),
            // The default is the host's /run/cni-suite: never the bench's.
            ("PLUGIN_LOG_SOCKET", path("log.sock")),
            ("POLICY_SOCKET", path("policy.sock")),
            ("CNI_INSTALL_PLUGINS", String::new()),
            ("LEASE_SERVICE", "false".to_owned()),
        ];
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let started = Instant::now();
        let mut child =
            test_kit::spawn_in(node.netns.path(), &test_kit::bin("cni-node-agent"), &[], &env, "");
        drop(child.stdout.take());
        let said = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(stderr) = child.stderr.take() {
            let keeping = said.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    let mut kept = keeping.lock().unwrap_or_else(PoisonError::into_inner);
                    if kept.len() == 20 {
                        kept.pop_front();
                    }
                    kept.push_back(line);
                }
            });
        }
        let agent = BenchAgent {
            child,
            said,
            _dir: dir,
        };
        (agent, started)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops it as the kubelet would (SIGTERM) and says its last lines.
    fn stop(&mut self) -> String {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.pid() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let said = self.said.lock().unwrap_or_else(PoisonError::into_inner);
        said.iter().cloned().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for BenchAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The DaemonSet's service account as its pods get it: `token`, `ca.crt`
/// and `namespace` from its token secret (1.20 makes one per account).
fn service_account(cluster: &Cluster) -> Vec<(&'static str, Vec<u8>)> {
    let sa = cluster.get_json(&["-n", "kube-system", "serviceaccount", "cni-suite-node-agent"]);
    let secret_name = sa["secrets"][0]["name"]
        .as_str()
        .expect("the agent's token secret");
    let secret = cluster.get_json(&["-n", "kube-system", "secret", secret_name]);
    ["token", "ca.crt", "namespace"]
        .into_iter()
        .map(|key| {
            let encoded = secret["data"][key].as_str().unwrap_or_default();
            let decoded = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, encoded)
                .expect("base64 in a secret");
            (key, decoded)
        })
        .collect()
}

/// What a process did while traced: netlink messages it sent and programs
/// it ran (`strace -f -p`, every thread).
struct Trace {
    child: Child,
    file: tempfile::NamedTempFile,
}

impl Trace {
    fn attach(pid: u32) -> Self {
        let file = tempfile::NamedTempFile::new().expect("a trace file");
        let child = Command::new("strace")
            .args([
                "-f",
                "-qq",
                "-e",
                "trace=socket,close,sendmsg,sendto,execve",
                "-o",
            ])
            .arg(file.path())
            .args(["-p", &pid.to_string()])
            .stderr(Stdio::null())
            .spawn()
            .expect("start strace");
        // strace prints nothing once attached; a moment is all it needs.
        std::thread::sleep(Duration::from_millis(500));
        Trace { child, file }
    }

    /// (netlink messages sent, programs executed).
    fn detach(mut self) -> (usize, usize) {
        crate::measure::interrupt(&mut self.child);
        let text = std::fs::read_to_string(self.file.path()).unwrap_or_default();
        netlink_and_exec(&text)
    }
}

/// Counts, in `strace -f` output, sends on netlink sockets (followed from
/// `socket(AF_NETLINK…) = fd` to `close(fd)`) and `execve` calls.
fn netlink_and_exec(trace: &str) -> (usize, usize) {
    let mut netlink: BTreeSet<String> = BTreeSet::new();
    let mut pending_socket: BTreeSet<String> = BTreeSet::new();
    let (mut sends, mut execs) = (0, 0);
    for line in trace.lines() {
        let mut words = line.splitn(2, ' ');
        let (pid, call) = (
            words.next().unwrap_or(""),
            words.next().unwrap_or("").trim_start(),
        );
        let result = line
            .rsplit_once(" = ")
            .map(|(_, r)| r.split_whitespace().next().unwrap_or("").to_owned());
        if call.starts_with("socket(AF_NETLINK") {
            match result {
                Some(fd) if !line.contains("unfinished") => {
                    netlink.insert(fd);
                }
                _ => {
                    pending_socket.insert(pid.to_owned());
                }
            }
        } else if call.starts_with("<... socket resumed>") && pending_socket.remove(pid) {
            if let Some(fd) = result {
                netlink.insert(fd);
            }
        } else if let Some(args) = call.strip_prefix("close(") {
            netlink.remove(args.split(')').next().unwrap_or(""));
        } else if let Some(args) = call
            .strip_prefix("sendmsg(")
            .or_else(|| call.strip_prefix("sendto("))
        {
            if netlink.contains(args.split(',').next().unwrap_or("")) {
                sends += 1;
            }
        } else if call.starts_with("execve(") {
            execs += 1;
        }
    }
    (sends, execs)
}

/// The rules in the agent's masquerade chain on a node (both families),
/// and the pod ranges it returns for.
fn chain_rules(cluster: &Cluster, node: &str) -> (usize, Vec<String>) {
    let mut rules = 0;
    let mut returns = Vec::new();
    for save in ["iptables-save", "ip6tables-save"] {
        let text = cluster.on_node(node, &[save, "-t", "nat"]).success().stdout;
        rules += text
            .lines()
            .filter(|l| l.starts_with("-A CNI-SUITE-EGRESS "))
            .count();
        returns.extend(egress_returns(&text));
    }
    (rules, returns)
}

/// Pods on two nodes and the outside: where new connections are timed.
struct Paths {
    _namespace: Namespace,
    client: Netns,
    other_pod: String,
    outside: String,
    listener: Child,
}

impl Paths {
    fn new(cluster: &'static Cluster) -> Result<Self, String> {
        let nodes: Vec<String> = cluster
            .nodes()
            .into_iter()
            .filter(|n| !n.starts_with(PREFIX))
            .collect();
        let (Some(here), Some(there)) = (nodes.first(), nodes.get(1)) else {
            return Err("fewer than two nodes".into());
        };
        let namespace = Namespace::new(cluster, "scale");
        for (name, node) in [("client", here), ("server", there)] {
            namespace.apply(&format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  labels: {{app: scale}}\nspec:\n  \
                 nodeName: {node}\n  containers:\n  - name: netexec\n    image: {}\n    \
                 args: [netexec, --http-port=8080]\n",
                test_kit::cluster::AGNHOST
            ));
        }
        let pods = namespace.ready_pods("app=scale", 2, Duration::from_secs(120));
        let ip_of = |name: &str| {
            pods.iter()
                .find(|p| p.name == name)
                .map(|p| p.ip_like(false).to_owned())
        };
        let client_ip = ip_of("client").ok_or("no client pod")?;
        let server_ip = ip_of("server").ok_or("no server pod")?;
        let client = pod_netns(&client_ip).ok_or_else(|| format!("no pause process holds {client_ip}"))?;
        let outside_ip = cluster.outside_addresses()[0].to_owned();
        let listener = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", cluster.underlay_netns()))
            .arg(cluster.dir().join("bin/agnhost"))
            .args(["netexec", "--http-port=18081"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start a listener outside: {e}"))?;
        let paths = Paths {
            _namespace: namespace,
            client,
            other_pod: format!("{server_ip}:8080"),
            outside: format!("{outside_ip}:18081"),
            listener,
        };
        // Both answer before anything is timed (the listener starting, the
        // node's masquerade going in).
        for target in [&paths.other_pod, &paths.outside] {
            let deadline = Instant::now() + Duration::from_secs(60);
            while let Err(e) = connect_times(&paths.client, target, 1) {
                if Instant::now() > deadline {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }
        Ok(paths)
    }

    /// (to another node's pod, to the outside): connect times in ms,
    /// alternating in rounds so both see the same moments.
    fn measure(&self, count: usize) -> Result<(Vec<f64>, Vec<f64>), String> {
        let (mut pod, mut outside) = (Vec::new(), Vec::new());
        let round = 100.min(count.max(1));
        for _ in 0..count.div_ceil(round) {
            pod.extend(connect_times(&self.client, &self.other_pod, round)?);
            outside.extend(connect_times(&self.client, &self.outside, round)?);
        }
        Ok((pod, outside))
    }
}

impl Drop for Paths {
    fn drop(&mut self) {
        let _ = self.listener.kill();
        let _ = self.listener.wait();
    }
}

/// The chain and new connections at the cluster's size now.
struct EgressAtSize {
    rules: usize,
    returns: Vec<String>,
    to_pod: Vec<f64>,
    to_outside: Vec<f64>,
}

fn egress_at_size(
    cluster: &Cluster,
    paths: &Paths,
    node: &str,
    connects: usize,
) -> Result<EgressAtSize, String> {
    let (rules, returns) = chain_rules(cluster, node);
    let (to_pod, to_outside) = paths.measure(connects)?;
    Ok(EgressAtSize {
        rules,
        returns,
        to_pod,
        to_outside,
    })
}

/// The IPv4 routes of a node's main table.
fn ipv4_routes(cluster: &Cluster, node: &str) -> usize {
    let shown = cluster.on_node(node, &["sh", "-c", "ip -4 route | wc -l"]);
    shown.stdout.trim().parse().unwrap_or(0)
}

/// Waits until the real nodes' agents route to every bench Node, so the
/// bench agent's start is timed on a quiet cluster.
fn wait_for_real_agents(cluster: &Cluster, node: &str, at_least: usize) -> Result<(), String> {
    let deadline = Instant::now() + LIMIT;
    loop {
        let count = ipv4_routes(cluster, node);
        if count >= at_least {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{node} routes {count} IPv4 prefixes after {LIMIT:?}, not {at_least}"
            ));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// The floor of the agent's start: a LIST of the same Nodes (curl, the
/// agent's service account, from the bench node) and one `ip -batch` of the
/// same routes in a fresh namespace on the same kind of link.
fn start_floor(
    cluster: &Cluster,
    node: &BenchNode,
    routes: &[(String, String)],
) -> Result<(f64, f64), String> {
    let token_dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let account: BTreeMap<&str, Vec<u8>> = service_account(cluster).into_iter().collect();
    let decode = |key: &str| account.get(key).cloned().unwrap_or_default();
    let ca = token_dir.path().join("ca.crt");
    std::fs::write(&ca, decode("ca.crt")).map_err(|e| e.to_string())?;
    let token = String::from_utf8(decode("token")).map_err(|e| e.to_string())?;
    // From a file, so the token is in no command line or error message.
    let header = token_dir.path().join("header");
    std::fs::write(&header, format!("Authorization: Bearer {token}\n")).map_err(|e| e.to_string())?;
    let header = format!("@{}", header.display());
    let url = format!("https://{}:6443/api/v1/nodes", cluster.fact("CONTROL_PLANE_IP"));
    let list = test_kit::run_in(
        node.netns.path(),
        Path::new("curl"),
        &[
            "-sS",
            "--http1.1",
            "-o",
            "/dev/null",
            "-w",
            "%{time_total}",
            "--cacert",
            ca.to_str().unwrap_or_default(),
            "-H",
            &header,
            &url,
        ],
        &[],
        "",
    );
    if !list.ok() {
        return Err(format!("the floor's LIST: {list:?}"));
    }
    let list_ms = list.stdout.trim().parse::<f64>().map_err(|e| e.to_string())? * 1000.0;
    let floor = Netns::new("floor");
    // A veth pair inside it (this kernel has no dummy links): eth0 is up
    // with the node's kind of addresses, so every gateway is on its link.
    floor
        .ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "eth1"])
        .success();
    floor.ip(&["link", "set", "eth1", "up"]).success();
    floor
        .ip(&["addr", "add", &format!("{}.250.250/16", node.net4), "dev", "eth0"])
        .success();
    floor
        .ip(&[
            "addr",
            "add",
            &format!("{}:ffff/64", node.net6),
            "dev",
            "eth0",
            "nodad",
        ])
        .success();
    floor.ip(&["link", "set", "eth0", "up"]).success();
    let batch: String = routes
        .iter()
        .map(|(dst, via)| format!("route add {dst} via {via}\n"))
        .collect();
    let file = tempfile::NamedTempFile::new().map_err(|e| e.to_string())?;
    std::fs::write(file.path(), batch).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let added = floor.ip(&["-batch", file.path().to_str().unwrap_or_default()]);
    let batch_ms = ms(started.elapsed());
    if !added.ok() {
        return Err(format!("the floor's ip -batch: {added:?}"));
    }
    Ok((list_ms, batch_ms))
}

/// Every route the bench agent should put in: each other Node's CIDR of a
/// family via its InternalIP of that family.
fn expected_routes(nodes: &[Value], own: &str) -> Vec<(String, String)> {
    let mut routes = Vec::new();
    for node in nodes.iter().filter(|n| n["metadata"]["name"] != own) {
        let ips: Vec<&str> = node["status"]["addresses"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["type"] == "InternalIP")
            .filter_map(|a| a["address"].as_str())
            .collect();
        for cidr in node["spec"]["podCIDRs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            let ipv6 = cidr.contains(':');
            if let Some(ip) = ips.iter().find(|ip| ip.contains(':') == ipv6) {
                routes.push((cidr.to_owned(), (*ip).to_owned()));
            }
        }
    }
    routes
}

/// Runs the scale half and adds its rows (or what went wrong) to `out`.
pub fn run(cluster: &'static Cluster, options: &ScaleOptions, out: &mut ScaleOutcome) {
    if let Err(e) = scale(cluster, options, out) {
        out.problem(e);
    }
}

fn scale(cluster: &'static Cluster, options: &ScaleOptions, out: &mut ScaleOutcome) -> Result<(), String> {
    crate::measure::wait_until_quiet(Duration::from_secs(180));
    let node = BenchNode::new(cluster);
    let api = Api::new(cluster, &node);
    api.delete_fakes();
    let _fakes = FakeNodes(&api);
    let real_nodes: Vec<String> = cluster.nodes();
    let watched = real_nodes.first().ok_or("no node")?.clone();
    let paths = Paths::new(cluster)?;
    let small = egress_at_size(cluster, &paths, &watched, options.connects)?;
    let real_routes = ipv4_routes(cluster, &watched);

    // The bench Nodes, and the real agents done routing to them.
    let fakes: Vec<Value> = (0..options.nodes)
        .map(|i| fake_node(i, &node.net4, &node.net6))
        .collect();
    let created = Instant::now();
    api.create(fakes.clone(), 32)?;
    eprintln!("bench: {} Nodes created in {:?}", fakes.len(), created.elapsed());
    wait_for_real_agents(cluster, &watched, options.nodes + real_routes)?;
    let large = egress_at_size(cluster, &paths, &watched, options.connects)?;
    egress_rows(out, options, &small, &large);

    // The bench agent's start.
    // Counted from procfs every 20 ms, nothing listening meanwhile: a
    // monitor would take each of the routes' notifications.
    let counted = test_kit::run_in(
        node.netns.path(),
        Path::new("sh"),
        &[
            "-c",
            "wc -l < /proc/self/net/route; wc -l < /proc/self/net/ipv6_route",
        ],
        &[],
        "",
    )
    .success();
    let counts: Vec<usize> = counted
        .stdout
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    let baseline = (
        counts.first().copied().unwrap_or(0),
        counts.get(1).copied().unwrap_or(0),
    );
    let mut all_nodes: Vec<Value> = cluster.get_json(&["nodes"])["items"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    all_nodes.retain(|n| n["metadata"]["name"] != "");
    let routes = expected_routes(&all_nodes, &format!("{PREFIX}-0"));
    let wanted_v4 = routes.iter().filter(|(dst, _)| !dst.contains(':')).count();
    let wanted_v6 = routes.len() - wanted_v4;
    let (mut agent, started) = BenchAgent::start(cluster, &node);
    let routed = loop {
        let (v4, v6) = route_counts(agent.pid());
        if v4 >= baseline.0 + wanted_v4 && v6 >= baseline.1 + wanted_v6 {
            break started.elapsed();
        }
        if started.elapsed() > LIMIT {
            let log = agent.stop();
            return Err(format!(
                "the bench agent routed {v4}/{v6} of {wanted_v4}/{wanted_v6} in {LIMIT:?}: {log}"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "bench: the bench agent routed {} prefixes in {routed:?}",
        routes.len()
    );
    let (list_ms, batch_ms) = start_floor(cluster, &node, &routes)?;
    let floor = list_ms + batch_ms;
    out.row(
        &format!(
            "agent start → {} routes ({} Nodes)",
            routes.len(),
            all_nodes.len()
        ),
        ms(routed),
        Some(("floor: LIST + ip -batch", floor)),
        "≤ 2× floor",
        Some(ms(routed) <= 2.0 * floor),
    );
    out.row("floor: LIST of every Node", list_ms, None, "", None);
    out.row("floor: ip -batch of every route", batch_ms, None, "", None);

    let monitor = RouteMonitor::start(&node.netns);

    // Status updates that change nothing the agent reads.
    let names: Vec<String> = (1..=options.no_op_updates.min(options.nodes.saturating_sub(1)).max(1))
        .map(|i| format!("{PREFIX}-{i}"))
        .collect();
    let trace = Trace::attach(agent.pid());
    let cpu_before = cpu_ms(agent.pid());
    let updating = Instant::now();
    api.heartbeat(&names, 1, 16)?;
    // The last events reach the agent after the last response.
    std::thread::sleep(Duration::from_secs(1));
    let cpu_no_op = cpu_ms(agent.pid()) - cpu_before;
    let (sends, execs) = trace.detach();
    eprintln!(
        "bench: {} status updates in {:?}",
        names.len(),
        updating.elapsed()
    );
    out.row(
        &format!(
            "no-op status updates ({}): netlink messages + programs run",
            names.len()
        ),
        (sends + execs) as f64,
        None,
        "0",
        Some(sends + execs == 0),
    );
    out.row(
        "agent CPU per no-op Node event (ms)",
        cpu_no_op / names.len() as f64,
        None,
        "",
        None,
    );

    // Nodes added one at a time.
    let (mut latencies, mut floors) = (Vec::new(), Vec::new());
    let cpu_before = cpu_ms(agent.pid());
    for i in 0..options.additions {
        let index = options.nodes + i;
        let added = fake_node(index, &node.net4, &node.net6);
        let routes: Vec<String> = added["spec"]["podCIDRs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(|cidr| format!("{cidr} via"))
            .collect();
        let sent = Instant::now();
        api.create(vec![added], 1)?;
        let answered = sent.elapsed();
        let Some(routed_at) = monitor.wait_for(&routes, Duration::from_secs(10)) else {
            return Err(format!("no routes {routes:?} on the bench node within 10 s"));
        };
        latencies.push(ms(routed_at.saturating_duration_since(sent)));
        floors.push(ms(answered));
    }
    let cpu_added = cpu_ms(agent.pid()) - cpu_before;
    for (name, q) in [("p50", 0.5), ("p99", 0.99), ("max", 1.0)] {
        let ours = quantile(&latencies, q);
        let goal = if name == "p99" { "≤ 50 ms" } else { "" };
        out.row(
            &format!("Node added → its route {name} (ms, {})", options.additions),
            ours,
            Some(("floor: the create's round trip", quantile(&floors, q))),
            goal,
            (name == "p99").then_some(ours <= 50.0),
        );
    }
    out.row(
        "agent CPU per added Node (ms)",
        cpu_added / options.additions.max(1) as f64,
        None,
        "",
        None,
    );
    let peak = memory_mib(agent.pid(), "VmHWM");
    out.row(
        &format!(
            "agent peak RSS at {} Nodes (MiB)",
            all_nodes.len() + options.additions
        ),
        peak,
        None,
        "≤ 64 MiB",
        Some(peak <= 64.0),
    );
    let daemonset = daemonset_agents(agent.pid());
    if let Some(largest) = daemonset.values().copied().reduce(f64::max) {
        out.row(
            &format!(
                "largest DaemonSet agent's RSS at {} Nodes (MiB, {} nodes)",
                all_nodes.len() + options.additions,
                daemonset.len()
            ),
            largest,
            None,
            "≤ 64 MiB",
            Some(largest <= 64.0),
        );
    }
    drop(monitor);
    let log = agent.stop();
    if !log.is_empty() {
        eprintln!("bench: the bench agent's last words:\n{log}");
    }
    Ok(())
}

fn egress_rows(out: &mut ScaleOutcome, options: &ScaleOptions, small: &EgressAtSize, large: &EgressAtSize) {
    let size = |n: usize| format!("{n} Nodes");
    out.row(
        &format!(
            "masquerade chain rules at {} (returns {:?})",
            size(options.nodes + 3),
            large.returns
        ),
        large.rules as f64,
        Some(("at 3 Nodes", small.rules as f64)),
        "same",
        Some(large.rules == small.rules),
    );
    for (what, at_small, at_large) in [
        (
            "new connection to another node's pod",
            &small.to_pod,
            &large.to_pod,
        ),
        (
            "new connection leaving the cluster",
            &small.to_outside,
            &large.to_outside,
        ),
    ] {
        for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
            out.row(
                &format!("{what} {name} (ms, {} each)", at_large.len()),
                quantile(at_large, q),
                Some(("at 3 Nodes", quantile(at_small, q))),
                "same",
                None,
            );
        }
    }
}

/// The table: ours, what it is compared with, their ratio, the goal.
pub fn markdown_table(rows: &[Row]) -> String {
    let mut table = String::from(
        "| metric | ours | compared with | value | ratio | goal |\n|---|---:|---|---:|---:|---|\n",
    );
    for row in rows {
        let (name, value, ratio) = match &row.other {
            Some((name, value)) => (
                name.as_str(),
                format!("{value:.2}"),
                format!("{:.3}", row.ours / value),
            ),
            None => ("-", "-".to_owned(), "-".to_owned()),
        };
        let verdict = match row.met {
            Some(true) => " met",
            Some(false) => " **not met**",
            None => "",
        };
        table.push_str(&format!(
            "| {} | {:.2} | {name} | {value} | {ratio} | {}{verdict} |\n",
            row.metric, row.ours, row.goal
        ));
    }
    table
}

/// The run as one JSON document: what was asked, where, every row.
pub fn json(
    options: &ScaleOptions,
    bursts: &BurstOptions,
    policies: &PolicyOptions,
    phases: &[&str],
    outcome: &ScaleOutcome,
    machine: &str,
) -> Value {
    json!({
        "machine": machine,
        "phases": phases,
        "burst_pods": bursts.pods,
        "burst_rounds": bursts.rounds,
        "nodes": options.nodes,
        "additions": options.additions,
        "no_op_updates": options.no_op_updates,
        "connects": options.connects,
        "policy_pods": policies.pods,
        "policy_sizes": policies.sizes,
        "policy_trials": policies.trials,
        "rows": outcome.rows.iter().map(|row| json!({
            "metric": row.metric,
            "ours": row.ours,
            "other": row.other.as_ref().map(|(name, value)| json!({"name": name, "value": value})),
            "goal": row.goal,
            "met": row.met,
        })).collect::<Vec<_>>(),
        "problems": outcome.problems,
    })
}

/// The rows of a run's JSON document, for docs/bench/README.md.
pub fn rows_from_json(doc: &Value) -> Result<Vec<Row>, String> {
    let rows = doc["rows"].as_array().ok_or("no rows in the run's JSON")?;
    rows.iter()
        .map(|row| {
            Ok(Row {
                metric: row["metric"].as_str().ok_or("a row without a metric")?.to_owned(),
                ours: row["ours"].as_f64().ok_or("a row without ours")?,
                other: row["other"]["name"]
                    .as_str()
                    .zip(row["other"]["value"].as_f64())
                    .map(|(name, value)| (name.to_owned(), value)),
                goal: row["goal"].as_str().unwrap_or_default().to_owned(),
                met: row["met"].as_bool(),
            })
        })
        .collect()
}

/// Where the report and the JSON go.
pub fn outputs(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("cluster.md"), dir.join("cluster.json"))
}
