//! `make bench-cluster`'s NetworkPolicy phase, on the real cluster: how
//! long a policy takes to hold on every node, what a new connection pays
//! for policy, and what the agents and the kernel hold, at 10 and at 1000
//! policies over thousands of pods.
//!
//! Most pods are Pod objects bound to kubelet-less bench Nodes that exist
//! (1.20's PodGC deletes the pods of Nodes that do not), their addresses
//! written through `pods/status`, as a kubelet writes them; they tolerate
//! every taint, so the node lifecycle controller never evicts them. Real
//! pods on every real node are the probes: a target that a default deny
//! isolates, and a client beside it. A policy allowing the client is
//! created and each node's time to let the client in is timed by a
//! connection attempt every few ms from that client (never by the
//! agents' logs); then it is deleted and the time until the client is
//! shut out again is timed the same way.

use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use crate::bench_cluster::{
    Api, BenchNode, FakeNodes, LIMIT, PREFIX, PolicyOptions, cpu_ms, daemonset_agents, fake_node,
    lines_as_read, memory_mib,
};
use crate::connect::{connect_times, pod_netns};
use crate::measure::{ms, quantile, wait_until_quiet};
use crate::outcome::ScaleOutcome;
use test_kit::Netns;
use test_kit::cluster::{AGNHOST, Cluster, Namespace, PAUSE};

/// Pods per bench Node: a /24 holds them.
const PODS_PER_NODE: usize = 250;
/// Label groups among the bench pods, 100 pods each at 5000.
const GROUPS: usize = 50;
/// Where every real pod's netexec listens.
const PORT: u16 = 8080;
/// One connection attempt's limit: a dropped SYN is a refusal after
/// this, so enforcement is seen to within it.
const ATTEMPT: Duration = Duration::from_millis(5);
/// A probe must fail this many times in a row to count as shut out, so
/// one slow answer on a busy node is not taken for a drop.
const FAILS_TO_CLOSE: usize = 3;
/// How long a probe tries before it gives up.
const PROBE_LIMIT: Duration = Duration::from_secs(60);

/// The `index`th bench pod: its object, its node's index and addresses.
fn bench_pod(index: usize) -> (Value, Value) {
    let node = 1 + index / PODS_PER_NODE;
    let slot = 2 + index % PODS_PER_NODE;
    let (high, low) = (225 + node / 256, node % 256);
    let v4 = format!("10.{high}.{low}.{slot}");
    let v6 = format!("fd00:10:224:{:x}::{slot:x}", 0x1000 + node);
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": format!("bench-{index}"), "labels": {
            "group": format!("g{}", index % GROUPS),
            "tier": format!("t{}", index % 7),
        }},
        "spec": {
            "nodeName": format!("{PREFIX}-{node}"),
            "automountServiceAccountToken": false,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "c", "image": PAUSE,
                            "ports": [{"name": "http", "containerPort": PORT}]}],
        },
    });
    let status = json!({"status": {
        "phase": "Running",
        "podIP": v4,
        "podIPs": [{"ip": v4}, {"ip": v6}],
    }});
    (pod, status)
}

fn policy(name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name},
        "spec": spec,
    })
}

fn role(value: &str) -> Value {
    json!({"matchLabels": {"role": value}})
}

/// The probe targets' own deny: isolated, nothing allowed.
fn deny_probe_targets() -> Value {
    policy(
        "deny-probe-targets",
        json!({"podSelector": role("probe-target"), "policyTypes": ["Ingress"]}),
    )
}

/// The timed change: the probe clients let in to the targets beside them.
fn allow_probes(trial: usize) -> Value {
    policy(
        &format!("allow-probes-{trial}"),
        json!({
            "podSelector": role("probe-target"),
            "ingress": [{"from": [{"podSelector": role("probe-client")}],
                         "ports": [{"protocol": "TCP", "port": PORT}]}],
        }),
    )
}

/// The connection bench's server let in from its client.
fn allow_connections() -> Value {
    policy(
        "allow-connections",
        json!({
            "podSelector": role("conn-server"),
            "ingress": [{"from": [{"podSelector": role("conn-client")}],
                         "ports": [{"protocol": "TCP", "port": PORT}]}],
        }),
    )
}

/// The `index`th of the policies that make up the size: every tenth
/// isolates the probe targets further, allowing one group of bench pods
/// on a port of its own (a peer set of 100 addresses per family on every
/// real node); the others select bench pods only, with pod, namespace
/// and `ipBlock` peers and a named port, as a cluster's policies do. None
/// selects the connection bench's pods.
fn background(index: usize) -> Value {
    let group = |offset: usize| json!({"matchLabels": {"group": format!("g{}", (index + offset) % GROUPS)}});
    let spec = if index.is_multiple_of(10) {
        json!({
            "podSelector": role("probe-target"),
            "ingress": [{"from": [{"podSelector": group(0)}],
                         "ports": [{"protocol": "TCP", "port": 9000 + index % 100}]}],
        })
    } else {
        json!({
            "podSelector": group(0),
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{
                "from": [
                    {"podSelector": {"matchLabels": {"tier": format!("t{}", index % 7)}}},
                    {"namespaceSelector": {}, "podSelector": group(1)},
                ],
                "ports": [{"protocol": "TCP", "port": 8000 + index % 10}, {"port": "http"}],
            }],
            "egress": [{
                "to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": [format!("10.{}.0.0/16", 225 + index % 2)]}},
                       {"podSelector": group(2)}],
            }],
        })
    };
    policy(&format!("background-{index}"), spec)
}

/// What one real node's probe pods are.
struct ProbePair {
    node: String,
    client: Netns,
    target: String,
}

/// A connection attempt every [`ATTEMPT`] from a probe client until it
/// gets in (`open`) or is shut out [`FAILS_TO_CLOSE`] times in a row,
/// with when each line it printed was read.
struct Probe {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
}

impl Probe {
    /// Starts one and waits for its first attempt, which must find the
    /// other state.
    fn start(pair: &ProbePair, until_open: bool) -> Result<Probe, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let want = if until_open { "open" } else { "closed" };
        let mut child = test_kit::spawn_in(
            pair.client.path(),
            &exe,
            &["--probe", &pair.target, want],
            &[],
            "",
        );
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err("the probe has no stdout".into());
        };
        let probe = Probe {
            child,
            lines: lines_as_read(stdout),
        };
        let (_, first) = probe.next(&pair.node)?;
        let before = if until_open {
            "started closed"
        } else {
            "started open"
        };
        if first != before {
            return Err(format!("a probe on {} to {want}: {first}", pair.node));
        }
        Ok(probe)
    }

    fn next(&self, node: &str) -> Result<(Instant, String), String> {
        self.lines
            .recv_timeout(PROBE_LIMIT + Duration::from_secs(5))
            .map_err(|_| format!("the probe on {node} said nothing"))
    }

    /// When it reached its state.
    fn reached(self, node: &str) -> Result<Instant, String> {
        let (at, line) = self.next(node)?;
        if line == "reached" {
            Ok(at)
        } else {
            Err(format!("the probe on {node}: {line}"))
        }
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `cluster-bench --probe ADDRESS:PORT open|closed`, run inside a probe
/// client's namespace: prints `started open|closed` after its first
/// attempt, then `reached` once the target is in the state asked for.
pub fn probe(target: &str, want: &str) -> Result<(), String> {
    use std::io::Write;
    let address: std::net::SocketAddr = target.parse().map_err(|e| format!("{target}: {e}"))?;
    let until_open = match want {
        "open" => true,
        "closed" => false,
        _ => return Err(format!("{want}: open or closed")),
    };
    let attempt = || std::net::TcpStream::connect_timeout(&address, ATTEMPT).is_ok();
    let mut out = std::io::stdout().lock();
    let first = attempt();
    let said = if first { "started open" } else { "started closed" };
    writeln!(out, "{said}")
        .and_then(|()| out.flush())
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut fails = usize::from(!first);
    while started.elapsed() < PROBE_LIMIT {
        if attempt() {
            if until_open {
                return writeln!(out, "reached").map_err(|e| e.to_string());
            }
            fails = 0;
            // A new connection each ms at most: the target's accept loop
            // is not the thing timed.
            std::thread::sleep(Duration::from_millis(1));
        } else {
            fails += 1;
            if !until_open && fails >= FAILS_TO_CLOSE {
                return writeln!(out, "reached").map_err(|e| e.to_string());
            }
        }
    }
    writeln!(out, "still not {want} after {PROBE_LIMIT:?}").map_err(|e| e.to_string())
}

/// The NFQUEUE the anchor's design sends new connections through.
const QUEUE: &str = "4242";

/// The anchor's design on the connection bench's server node: new
/// connections to the server go through an NFQUEUE whose reader (this
/// bench, on the node) accepts every packet; removed on drop.
struct Queued<'a> {
    cluster: &'a Cluster,
    node: String,
    rule: Vec<String>,
    reader: Child,
    lines: mpsc::Receiver<(Instant, String)>,
    inserted: bool,
}

impl<'a> Queued<'a> {
    fn start(cluster: &'a Cluster, node: &str, server: &str) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let exe = exe.to_str().ok_or("the bench's path is not UTF-8")?;
        let (address, port) = server.rsplit_once(':').ok_or("server address:port")?;
        let mut reader = cluster.spawn_on_node(node, &[exe, "--nfqueue-reader", QUEUE]);
        let Some(stdout) = reader.stdout.take() else {
            let _ = reader.kill();
            let _ = reader.wait();
            return Err("the NFQUEUE reader has no stdout".into());
        };
        let rule = crate::nfqueue::forward_rule(&["-d", address, "-p", "tcp", "--dport", port], QUEUE);
        let mut queued = Queued {
            cluster,
            node: node.to_owned(),
            rule,
            reader,
            lines: lines_as_read(stdout),
            inserted: false,
        };
        match queued.lines.recv_timeout(Duration::from_secs(10)) {
            Ok((_, line)) if line == "bound" => {}
            other => return Err(format!("the NFQUEUE reader on {node}: {other:?}")),
        }
        let insert = queued.iptables("-I");
        if !insert.ok() {
            return Err(format!("NFQUEUE rule on {node}: {insert:?}"));
        }
        queued.inserted = true;
        Ok(queued)
    }

    fn iptables(&self, action: &str) -> test_kit::Run {
        let mut args = vec!["iptables", action];
        args.extend(self.rule.iter().map(String::as_str));
        self.cluster.on_node(&self.node, &args)
    }

    /// The rule removed and the reader stopped; how many packets it
    /// accepted.
    fn finish(mut self) -> Result<usize, String> {
        self.iptables("-D");
        self.inserted = false;
        drop(self.reader.stdin.take());
        let (_, said) = self
            .lines
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| "the NFQUEUE reader said nothing at its end".to_owned())?;
        said.strip_prefix("seen ")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("the NFQUEUE reader: {said}"))
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.inserted {
            self.iptables("-D");
        }
        let _ = self.reader.kill();
        let _ = self.reader.wait();
    }
}

/// The bench's objects in one namespace, and the API calls on them.
struct Objects<'a> {
    api: &'a Api,
    namespace: &'a str,
}

impl Objects<'_> {
    fn pods(&self) -> kube::Api<Pod> {
        kube::Api::namespaced(self.api.client(), self.namespace)
    }

    fn policies(&self) -> kube::Api<NetworkPolicy> {
        kube::Api::namespaced(self.api.client(), self.namespace)
    }

    fn create_policies(&self, policies: Vec<Value>, parallel: usize) -> Result<(), String> {
        self.api
            .create_all(self.policies(), policies, parallel, "creating a NetworkPolicy")
    }

    fn delete_policy(&self, name: &str) -> Result<(), String> {
        let api = self.policies();
        self.api
            .call(api.delete(name, &DeleteParams::default()))
            .map(|_| ())
            .map_err(|e| format!("deleting {name}: {e}"))
    }

    /// The bench pods, created, then their addresses written as a
    /// kubelet writes them.
    fn create_bench_pods(&self, count: usize) -> Result<(), String> {
        let (pods, statuses): (Vec<Value>, Vec<Value>) = (0..count).map(bench_pod).unzip();
        self.api.create_all(self.pods(), pods, 32, "creating a Pod")?;
        let api = self.pods();
        let updates: Vec<(String, Value)> = statuses
            .into_iter()
            .enumerate()
            .map(|(index, status)| (format!("bench-{index}"), status))
            .collect();
        self.api
            .each(updates, 32, "writing a Pod's status", |(name, status)| {
                let api = api.clone();
                async move {
                    api.patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                        .await
                }
            })
    }

    /// Every policy, and every pod at once (no kubelet will confirm the
    /// bench pods' deletion, so none waits for one).
    fn delete_all(&self) {
        let policies = self.policies();
        let pods = self.pods();
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        self.api.call(async {
            let _ = policies
                .delete_collection(&DeleteParams::default(), &ListParams::default())
                .await;
            let _ = pods.delete_collection(&now, &ListParams::default()).await;
        });
    }
}

/// The real pods: a probe target and client on every real node, and the
/// connection bench's client and server on two of them.
fn real_pods(namespace: &Namespace, nodes: &[String]) -> Result<(Vec<ProbePair>, Netns, String), String> {
    let pod = |name: &str, role: &str, node: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  labels: {{role: {role}, bench: real}}\nspec:\n  \
             nodeName: {node}\n  containers:\n  - name: netexec\n    image: {AGNHOST}\n    \
             args: [netexec, --http-port={PORT}]\n"
        )
    };
    let mut yaml = Vec::new();
    for (index, node) in nodes.iter().enumerate() {
        yaml.push(pod(&format!("probe-target-{index}"), "probe-target", node));
        yaml.push(pod(&format!("probe-client-{index}"), "probe-client", node));
    }
    let (Some(here), Some(there)) = (nodes.first(), nodes.get(1)) else {
        return Err("fewer than two nodes".into());
    };
    yaml.push(pod("conn-client", "conn-client", here));
    yaml.push(pod("conn-server", "conn-server", there));
    namespace.apply(&yaml.join("---\n"));
    let ready = namespace.ready_pods("bench=real", yaml.len(), Duration::from_secs(180));
    let ip_of = |name: &str| {
        ready
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.ip_like(false).to_owned())
            .ok_or_else(|| format!("no pod {name}"))
    };
    let netns_of = |ip: &str| pod_netns(ip).ok_or_else(|| format!("no pause process holds {ip}"));
    let mut pairs = Vec::new();
    for (index, node) in nodes.iter().enumerate() {
        pairs.push(ProbePair {
            node: node.clone(),
            client: netns_of(&ip_of(&format!("probe-client-{index}"))?)?,
            target: format!("{}:{PORT}", ip_of(&format!("probe-target-{index}"))?),
        });
    }
    let conn_client = netns_of(&ip_of("conn-client")?)?;
    let conn_server = format!("{}:{PORT}", ip_of("conn-server")?);
    Ok((pairs, conn_client, conn_server))
}

/// Every node's probe started, `change` made, and each node's time from
/// the call to its probe reaching the state; with the call's own round
/// trip.
fn timed_change(
    pairs: &[ProbePair],
    until_open: bool,
    change: impl FnOnce() -> Result<(), String>,
) -> Result<(Vec<f64>, f64), String> {
    let probes = pairs
        .iter()
        .map(|pair| Probe::start(pair, until_open))
        .collect::<Result<Vec<_>, _>>()?;
    let sent = Instant::now();
    change()?;
    let answered = ms(sent.elapsed());
    let mut times = Vec::new();
    for (probe, pair) in probes.into_iter().zip(pairs) {
        let at = probe.reached(&pair.node)?;
        times.push(ms(at.saturating_duration_since(sent)));
    }
    Ok((times, answered))
}

/// What one size's changes measured.
#[derive(Default)]
struct Changes {
    /// Per change: the slowest node's time, and every node's.
    created_everywhere: Vec<f64>,
    created_per_node: Vec<f64>,
    deleted_everywhere: Vec<f64>,
    round_trips: Vec<f64>,
    /// The DaemonSet agents' CPU per change, ms per agent.
    cpu_per_change: f64,
}

fn time_changes(objects: &Objects, pairs: &[ProbePair], trials: usize) -> Result<Changes, String> {
    let agents: Vec<u32> = daemonset_agents(0).into_keys().collect();
    let cpu = || agents.iter().map(|&pid| cpu_ms(pid)).sum::<f64>();
    let cpu_before = cpu();
    let mut changes = Changes::default();
    let slowest = |times: &[f64]| times.iter().copied().fold(0.0, f64::max);
    for trial in 0..trials {
        let allow = allow_probes(trial);
        let (created, round_trip) = timed_change(pairs, true, || objects.create_policies(vec![allow], 1))?;
        changes.created_everywhere.push(slowest(&created));
        changes.created_per_node.extend(&created);
        changes.round_trips.push(round_trip);
        let name = format!("allow-probes-{trial}");
        let (deleted, _) = timed_change(pairs, false, || objects.delete_policy(&name))?;
        changes.deleted_everywhere.push(slowest(&deleted));
    }
    changes.cpu_per_change = (cpu() - cpu_before) / (2 * trials.max(1) * agents.len().max(1)) as f64;
    Ok(changes)
}

/// Rules, sets and maps, and their elements, in a node's policy table.
fn table_size(cluster: &Cluster, node: &str) -> (usize, usize, usize) {
    let listed = cluster.on_node(node, &["nft", "-j", "list", "table", "inet", "cni-suite-netpol"]);
    let doc: Value = serde_json::from_str(&listed.stdout).unwrap_or_default();
    let items = doc["nftables"].as_array().cloned().unwrap_or_default();
    let (mut rules, mut sets, mut elements) = (0, 0, 0);
    for item in &items {
        if item.get("rule").is_some() {
            rules += 1;
        }
        for kind in ["set", "map"] {
            if let Some(set) = item.get(kind) {
                sets += 1;
                elements += set["elem"].as_array().map_or(0, Vec::len);
            }
        }
    }
    (rules, sets, elements)
}

/// The largest table among the nodes.
fn largest_table(cluster: &Cluster, nodes: &[String]) -> (usize, usize, usize) {
    nodes
        .iter()
        .map(|node| table_size(cluster, node))
        .max_by_key(|(rules, sets, elements)| rules + sets + elements)
        .unwrap_or_default()
}

/// `count` connect times from the connection bench's client to its
/// server, in rounds of 100.
fn connections(client: &Netns, server: &str, count: usize) -> Result<Vec<f64>, String> {
    let mut times = Vec::with_capacity(count);
    let round = 100.min(count.max(1));
    while times.len() < count {
        times.extend(connect_times(client, server, round)?);
    }
    Ok(times)
}

/// Waits until `node`'s policy table names `address` (or no longer
/// does).
fn wait_for_table(cluster: &Cluster, node: &str, address: &str, present: bool) -> Result<(), String> {
    let deadline = Instant::now() + LIMIT;
    while Instant::now() < deadline {
        let listed = cluster.on_node(node, &["nft", "list", "table", "inet", "cni-suite-netpol"]);
        if listed.stdout.contains(address) == present {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(format!(
        "{node}'s policy table still {} {address}",
        if present { "without" } else { "with" }
    ))
}

pub fn run(cluster: &'static Cluster, options: &PolicyOptions, out: &mut ScaleOutcome) {
    if let Err(e) = policies_at_scale(cluster, options, out) {
        out.problem(e);
    }
}

fn policies_at_scale(
    cluster: &'static Cluster,
    options: &PolicyOptions,
    out: &mut ScaleOutcome,
) -> Result<(), String> {
    wait_until_quiet(Duration::from_secs(180));
    let node = BenchNode::new(cluster);
    let api = Api::new(cluster, &node);
    api.delete_fakes();
    let _fakes = FakeNodes(&api);
    let nodes: Vec<String> = cluster
        .nodes()
        .into_iter()
        .filter(|n| !n.starts_with(PREFIX))
        .collect();
    let namespace = Namespace::new(cluster, "policy-bench");
    let objects = Objects {
        api: &api,
        namespace: &namespace.name,
    };
    let _cleanup = Cleanup(&objects);
    // Pods are refused until the namespace's service account exists.
    test_kit::cluster::poll(
        "the default service account",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            let shown = namespace.kubectl(&["get", "serviceaccount", "default"]);
            if shown.ok() { Ok(()) } else { Err(shown.stderr) }
        },
    );
    let (pairs, conn_client, conn_server) = real_pods(&namespace, &nodes)?;

    let bench_nodes = options.pods.div_ceil(PODS_PER_NODE);
    let fakes: Vec<Value> = (1..=bench_nodes)
        .map(|i| fake_node(i, &node.net4, &node.net6))
        .collect();
    api.create(fakes, 16)?;
    let created = Instant::now();
    objects.create_bench_pods(options.pods)?;
    eprintln!(
        "bench: {} bench pods on {bench_nodes} bench Nodes in {:?}",
        options.pods,
        created.elapsed()
    );

    // New connections with no policy, and with one allowing them,
    // alternating so both see the same moments.
    let server_node = &nodes[1.min(nodes.len() - 1)];
    let server_ip = conn_server
        .rsplit_once(':')
        .map_or(conn_server.as_str(), |(ip, _)| ip);
    let (mut open, mut allowed, mut queued) = (Vec::new(), Vec::new(), Vec::new());
    let rounds = 5;
    for _ in 0..rounds {
        open.extend(connections(
            &conn_client,
            &conn_server,
            options.connects / rounds,
        )?);
        let queue = Queued::start(cluster, server_node, &conn_server)?;
        let before = queued.len();
        queued.extend(connections(
            &conn_client,
            &conn_server,
            options.connects / rounds,
        )?);
        let seen = queue.finish()?;
        if seen < queued.len() - before {
            return Err(format!(
                "the NFQUEUE reader accepted {seen} packets for {} connections",
                queued.len() - before
            ));
        }
        objects.create_policies(vec![allow_connections()], 1)?;
        wait_for_table(cluster, server_node, server_ip, true)?;
        allowed.extend(connections(
            &conn_client,
            &conn_server,
            options.connects / rounds,
        )?);
        objects.delete_policy("allow-connections")?;
        wait_for_table(cluster, server_node, server_ip, false)?;
    }

    // The policy counts, growing.
    objects.create_policies(vec![deny_probe_targets()], 1)?;
    let mut made = 0;
    let mut at_sizes = Vec::new();
    for &size in &options.sizes {
        objects.create_policies((made..size).map(background).collect(), 16)?;
        made = size;
        wait_until_quiet(Duration::from_secs(120));
        // Every node has every policy so far once its probe is shut out.
        for pair in &pairs {
            let settled = Probe::start(pair, false);
            if let Ok(probe) = settled {
                probe.reached(&pair.node)?;
            }
        }
        let changes = time_changes(&objects, &pairs, options.trials)?;
        let table = largest_table(cluster, &nodes);
        at_sizes.push((size, changes, table));
    }
    let agents = daemonset_agents(0);
    // The largest count cannot be deleted and made again round by round;
    // what it puts in the real nodes' kernels can go and come back: the
    // probe targets, the only real pods it selects, are relabelled out of
    // every policy (the tables then hold no chain, set or map entry of
    // them) and back, alternating with the connections.
    let (mut unselected, mut emptied) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        unselected.extend(connections(
            &conn_client,
            &conn_server,
            options.connects / rounds,
        )?);
        relabel_targets(&namespace, &pairs, ("probe-target", "probe-parked"))?;
        emptied.extend(connections(
            &conn_client,
            &conn_server,
            options.connects / rounds,
        )?);
        relabel_targets(&namespace, &pairs, ("probe-parked", "probe-target"))?;
    }

    // The rows.
    let pods = options.pods + 2 * nodes.len() + 2;
    for (size, changes, _) in &at_sizes {
        for (name, q) in [("p50", 0.5), ("p99", 0.99), ("max", 1.0)] {
            out.row(
                &format!(
                    "policy created → enforced on every node {name} (ms, {size} policies, {pods} pods, {} changes, {} nodes)",
                    changes.created_everywhere.len(),
                    nodes.len()
                ),
                quantile(&changes.created_everywhere, q),
                Some(("floor: the create's round trip", quantile(&changes.round_trips, q))),
                "",
                None,
            );
        }
        out.row(
            &format!("policy created → enforced on one node p50 (ms, {size} policies)"),
            quantile(&changes.created_per_node, 0.5),
            None,
            "",
            None,
        );
        for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
            out.row(
                &format!("policy deleted → lifted on every node {name} (ms, {size} policies)"),
                quantile(&changes.deleted_everywhere, q),
                None,
                "",
                None,
            );
        }
        out.row(
            &format!("agent CPU per policy change, per node (ms, {size} policies)"),
            changes.cpu_per_change,
            None,
            "",
            None,
        );
    }
    let largest = options.sizes.last().copied().unwrap_or(0);
    if let (Some((_, _, small)), Some((_, _, large))) = (at_sizes.first(), at_sizes.last()) {
        let smallest = options.sizes.first().copied().unwrap_or(0);
        for (what, at_large, at_small) in [
            ("rules", large.0, small.0),
            ("sets and maps", large.1, small.1),
            ("set and map elements", large.2, small.2),
        ] {
            out.row(
                &format!("policy table {what}, largest node, at {largest} policies"),
                at_large as f64,
                Some((&format!("at {smallest} policies"), at_small as f64)),
                "",
                None,
            );
        }
    }
    if let Some(rss) = agents.values().copied().reduce(f64::max) {
        out.row(
            &format!(
                "largest DaemonSet agent's RSS at {largest} policies over {pods} pods (MiB, {} nodes)",
                agents.len()
            ),
            rss,
            None,
            "≤ 64 MiB",
            Some(rss <= 64.0),
        );
    }
    if let Some(peak) = agents
        .keys()
        .map(|&pid| memory_mib(pid, "VmHWM"))
        .reduce(f64::max)
    {
        out.row(
            "largest DaemonSet agent's peak RSS so far (MiB)",
            peak,
            None,
            "",
            None,
        );
    }
    for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
        out.row(
            &format!(
                "new connection between pods on two nodes {name}, through an NFQUEUE round trip (kindnetd's design; a reader accepting all) (ms, {} each)",
                queued.len()
            ),
            quantile(&queued, q),
            Some(("no policy", quantile(&open, q))),
            "",
            None,
        );
    }
    for (what, times) in [
        ("an NFQUEUE round trip", &queued),
        ("our verdict map, one policy allowing", &allowed),
    ] {
        out.row(
            &format!("per-connection cost of {what}, p50 less no policy's (µs)"),
            (quantile(times, 0.5) - quantile(&open, 0.5)) * 1000.0,
            None,
            "",
            None,
        );
    }
    for (what, times, floor_name, floor_times) in [
        ("one policy allowing them", &allowed, "no policy", &open),
        (
            &format!("{largest} policies, none selecting them") as &str,
            &unselected,
            "the same policies selecting no pod of the real nodes",
            &emptied,
        ),
    ] {
        for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
            let ours = quantile(times, q);
            let floor = quantile(floor_times, q);
            out.row(
                &format!(
                    "new connection between pods on two nodes {name}, {what} (ms, {} each)",
                    times.len()
                ),
                ours,
                Some((floor_name, floor)),
                "≤ 1.05×",
                Some(ours <= 1.05 * floor),
            );
        }
    }
    Ok(())
}

/// The probe targets' `role` label changed `from` one value `to` another,
/// and every node's probe seeing the change: the targets open once no
/// policy selects them, shut out again once the policies do.
fn relabel_targets(
    namespace: &Namespace,
    pairs: &[ProbePair],
    (from, to): (&str, &str),
) -> Result<(), String> {
    let selector = format!("role={from}");
    let label = format!("role={to}");
    let run = namespace.kubectl(&["label", "pod", "-l", &selector, &label, "--overwrite"]);
    if !run.ok() {
        return Err(format!("relabelling the probe targets: {}", run.stderr));
    }
    let until_open = to != "probe-target";
    for pair in pairs {
        // A probe that starts in the state asked for has nothing to wait for.
        if let Ok(probe) = Probe::start(pair, until_open) {
            probe.reached(&pair.node)?;
        }
    }
    Ok(())
}

/// The bench's policies and pods deleted, however the phase ends (before
/// the bench Nodes, whose guard is older).
struct Cleanup<'a>(&'a Objects<'a>);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        self.0.delete_all();
    }
}
