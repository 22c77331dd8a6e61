//! `make bench-cluster`, the sandbox half: bursts of pods over the real
//! cluster's nodes, through the suite as its manifest installs it and
//! through Debian's reference plugins as kindnetd wires them (`ptp`,
//! `host-local` with its `dataDir` under `/run`, `portmap`, a conflist per
//! node from its pod CIDRs; the routes between nodes stay as they are),
//! alternating burst by burst on the same nodes. Between them, the floor:
//! a burst of `hostNetwork` pods, whose sandboxes call no plugin at all.
//!
//! Per pod, from outside both: containerd's own RunPodSandbox time, read
//! from its log (the call's first line to the one naming the sandbox it
//! returns), and the time from the pod's create request to the bench
//! seeing it Running through a watch. Which plugins served each burst is
//! checked on the nodes (their veths and the reference's lease files),
//! never assumed.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};

use crate::measure::{interrupt, quantile, wait_until_quiet};
use crate::outcome::ScaleOutcome;
use test_kit::cluster::{Cluster, Namespace, try_poll};

/// The conflist the suite's agent writes.
const SUITE_CONFLIST: &str = "10-cni-suite.conflist";
/// The conflist kindnetd writes.
const KINDNET_CONFLIST: &str = "10-kindnet.conflist";
/// What a kind node image holds in /opt/cni/bin, from Debian's package.
const REFERENCE_PLUGINS: [&str; 4] = ["host-local", "loopback", "portmap", "ptp"];
const REFERENCE_DIR: &str = "/usr/lib/cni";
/// kindnetd's `dataDir` (a tmpfs), and its network's name.
const KINDNET_DATA_DIR: &str = "/run/cni-ipam-state";
const KINDNET_NAME: &str = "kindnet";
/// The suite's bridge on a node.
const SUITE_BRIDGE: &str = "cni0";
/// Creates in flight at once: a burst, as a Deployment's scale-up or a
/// Job's fan-out sends them.
const PARALLEL_CREATES: usize = 25;
/// How long any one step may take.
const LIMIT: Duration = Duration::from_secs(300);
/// How long a burst waits for the machine to settle after the last.
const QUIET_LIMIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct BurstOptions {
    /// Pods per burst, over every node.
    pub pods: usize,
    /// Bursts per network; the order alternates round by round.
    pub rounds: usize,
}

// What wires the pods of a burst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Wiring {
    Suite,
    Reference,
    /// The floor: `hostNetwork` pods, whose sandboxes call no CNI plugin
    /// (on whichever network is installed).
    HostNetwork,
}

impl Wiring {
    fn label(self) -> &'static str {
        match self {
            Wiring::Suite => "suite",
            Wiring::Reference => "reference",
            Wiring::HostNetwork => "hostnetwork",
        }
    }
}

/// Per pod, in milliseconds.
#[derive(Debug, Default)]
struct Samples {
    sandbox: Vec<f64>,
    running: Vec<f64>,
    /// Per plugin binary, each run's exec to exit, as the kernel saw it.
    plugins: BTreeMap<String, Vec<f64>>,
}

/// Runs the bursts and adds their rows (or what went wrong) to `out`. The
/// suite is installed again afterwards, whatever happened.
pub fn run(cluster: &'static Cluster, options: &BurstOptions, out: &mut ScaleOutcome) {
    let namespace = Namespace::new(cluster, "sandbox-bench");
    let restore = SuiteRestored {
        cluster,
        namespace: &namespace,
    };
    let mut samples: BTreeMap<Wiring, Samples> = BTreeMap::new();
    if let Err(e) = bursts(cluster, &namespace, options, &mut samples, out) {
        out.problem(format!("sandbox bursts: {e}"));
    }
    drop(restore);
    drop(namespace);
    let (Some(ours), Some(reference), Some(floor)) = (
        samples.get(&Wiring::Suite),
        samples.get(&Wiring::Reference),
        samples.get(&Wiring::HostNetwork),
    ) else {
        return;
    };
    let compared = "reference (ptp, host-local in /run, portmap)";
    for (what, ours, reference, floor, goals) in [
        (
            "sandbox creation (containerd RunPodSandbox",
            &ours.sandbox,
            &reference.sandbox,
            &floor.sandbox,
            [Some(0.8), Some(1.0), None],
        ),
        (
            "pod create → Running (watched",
            &ours.running,
            &reference.running,
            &floor.running,
            [None, Some(1.0), None],
        ),
    ] {
        let quantiles = [("p50", 0.5), ("p99", 0.99), ("max", 1.0)];
        for ((name, q), goal) in quantiles.into_iter().zip(goals) {
            let (mine, theirs) = (quantile(ours, q), quantile(reference, q));
            out.row(
                &format!("{what}, ms, {} pods each) {name}", ours.len()),
                mine,
                Some((compared, theirs)),
                &goal.map_or(String::new(), |g| format!("≤ {g}×")),
                goal.map(|g| mine <= g * theirs),
            );
        }
        // The network's share, roughly: the same quantile less the floor's
        // (a difference of quantiles, not the quantile of a difference).
        for (name, q) in &quantiles[..2] {
            let base = quantile(floor, *q);
            out.row(
                &format!("{what}) {name} less the hostNetwork burst's ({base:.0} ms)"),
                quantile(ours, *q) - base,
                Some((compared, quantile(reference, *q) - base)),
                "",
                None,
            );
        }
    }
    // Where the network's part goes: each plugin's run during the bursts,
    // the suite's bridge against the reference's ptp.
    for (mine, theirs) in [
        ("bridge", "ptp"),
        ("host-local", "host-local"),
        ("loopback", "loopback"),
        ("portmap", "portmap"),
    ] {
        let (Some(ours), Some(reference)) = (ours.plugins.get(mine), reference.plugins.get(theirs)) else {
            continue;
        };
        for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
            out.row(
                &format!(
                    "{mine} exec → exit during a burst (ms, {} and {} runs) {name}",
                    ours.len(),
                    reference.len()
                ),
                quantile(ours, q),
                Some((&format!("reference {theirs}"), quantile(reference, q))),
                "",
                None,
            );
        }
    }
}

fn bursts(
    cluster: &'static Cluster,
    namespace: &Namespace,
    options: &BurstOptions,
    samples: &mut BTreeMap<Wiring, Samples>,
    out: &mut ScaleOutcome,
) -> Result<(), String> {
    for round in 0..options.rounds {
        let order = if round % 2 == 0 {
            [Wiring::Suite, Wiring::HostNetwork, Wiring::Reference]
        } else {
            [Wiring::Reference, Wiring::HostNetwork, Wiring::Suite]
        };
        for wiring in order {
            switch_to(cluster, wiring)?;
            let label = format!("{}-{round}", wiring.label());
            wait_until_quiet(QUIET_LIMIT);
            let baseline = all_veths(cluster)?;
            let burst = burst(cluster, namespace, wiring, &label, &baseline, options.pods, out);
            // Cleared even after a failed burst: the next wiring must not
            // tear down this one's pods.
            let cleared = clear(cluster, namespace, wiring, &label, &baseline);
            let burst = match (burst, cleared) {
                (Ok(burst), Ok(())) => burst,
                (Err(e), Ok(())) | (Ok(_), Err(e)) => return Err(e),
                (Err(e), Err(also)) => return Err(format!("{e}; then {also}")),
            };
            let entry = samples.entry(wiring).or_default();
            entry.sandbox.extend(burst.sandbox);
            entry.running.extend(burst.running);
            for (plugin, walls) in burst.plugins {
                entry.plugins.entry(plugin).or_default().extend(walls);
            }
        }
    }
    Ok(())
}

fn machine_dir(cluster: &Cluster, node: &str) -> PathBuf {
    cluster.dir().join("machines").join(node)
}

/// Writes `contents` to `path` through a temporary file renamed over it,
/// as the agents do, so containerd never reads half a file.
fn replace_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let temporary = path.with_extension("bench-tmp");
    std::fs::write(&temporary, contents)
        .and_then(|()| std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(mode)))
        .and_then(|()| std::fs::rename(&temporary, path))
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn remove_if_present(path: &Path) -> Result<(), String> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("{}: {e}", path.display())),
        _ => Ok(()),
    }
}

/// kindnetd's conflist for a node with these pod CIDRs and MTU, with one
/// departure: each range starts in its upper half, so the reference never
/// hands out an address the suite leased to a pod still running (its own
/// data directory knows nothing of the suite's).
fn kindnet_conflist(pod_cidrs: &[String], mtu: u32) -> Value {
    let ranges: Vec<Value> = pod_cidrs
        .iter()
        .map(|cidr| match upper_half(cidr) {
            Some(start) => json!([{"subnet": cidr, "rangeStart": start}]),
            None => json!([{"subnet": cidr}]),
        })
        .collect();
    let routes: Vec<Value> = pod_cidrs
        .iter()
        .map(|cidr| json!({"dst": if cidr.contains(':') { "::/0" } else { "0.0.0.0/0" }}))
        .collect();
    json!({
        "cniVersion": "0.3.1",
        "name": KINDNET_NAME,
        "plugins": [
            {"type": "ptp", "ipMasq": false, "mtu": mtu,
             "ipam": {"type": "host-local", "dataDir": KINDNET_DATA_DIR, "routes": routes, "ranges": ranges}},
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ]
    })
}

/// The first address of the upper half of `cidr`.
fn upper_half(cidr: &str) -> Option<String> {
    let network: ipnetwork::IpNetwork = cidr.parse().ok()?;
    let host_bits = u32::from(if network.is_ipv4() { 32u8 } else { 128 } - network.prefix());
    let half = 1u128.checked_shl(host_bits.checked_sub(1)?)?;
    Some(match network.network() {
        std::net::IpAddr::V4(base) => {
            std::net::Ipv4Addr::from(u32::from(base).checked_add(u32::try_from(half).ok()?)?).to_string()
        }
        std::net::IpAddr::V6(base) => {
            std::net::Ipv6Addr::from(u128::from(base).checked_add(half)?).to_string()
        }
    })
}

fn pod_cidrs(cluster: &Cluster, node: &str) -> Vec<String> {
    cluster.get_json(&["node", node])["spec"]["podCIDRs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|cidr| cidr.as_str().map(str::to_owned))
        .collect()
}

/// Makes `wiring` the one containerd calls on every node, with no
/// moment where a node has no network configuration.
fn switch_to(cluster: &Cluster, wiring: Wiring) -> Result<(), String> {
    match wiring {
        Wiring::Reference => {
            // The agent first: it would put its binaries back.
            cluster.delete_agents()?;
            for node in cluster.nodes() {
                let machine = machine_dir(cluster, &node);
                for plugin in REFERENCE_PLUGINS {
                    let binary = std::fs::read(Path::new(REFERENCE_DIR).join(plugin))
                        .map_err(|e| format!("{REFERENCE_DIR}/{plugin}: {e}"))?;
                    replace_file(&machine.join("cni-bin").join(plugin), &binary, 0o755)?;
                }
                let mtu = cluster
                    .on_node(&node, &["cat", "/sys/class/net/eth0/mtu"])
                    .stdout
                    .trim()
                    .parse()
                    .map_err(|e| format!("{node}'s eth0 MTU: {e}"))?;
                let conflist = kindnet_conflist(&pod_cidrs(cluster, &node), mtu);
                let text = serde_json::to_string_pretty(&conflist).map_err(|e| e.to_string())?;
                // Leases a failed run left behind would be counted as this run's.
                cluster.on_node(
                    &node,
                    &["rm", "-rf", &format!("{KINDNET_DATA_DIR}/{KINDNET_NAME}")],
                );
                replace_file(
                    &machine.join("cni-conf").join(KINDNET_CONFLIST),
                    text.as_bytes(),
                    0o644,
                )?;
                remove_if_present(&machine.join("cni-conf").join(SUITE_CONFLIST))?;
            }
        }
        Wiring::Suite => {
            // The suite's file sorts before kindnet's: it is in use from
            // the moment the agent writes it.
            install_suite(cluster)?;
            for node in cluster.nodes() {
                remove_if_present(
                    &machine_dir(cluster, &node)
                        .join("cni-conf")
                        .join(KINDNET_CONFLIST),
                )?;
            }
        }
        Wiring::HostNetwork => return Ok(()),
    }
    // containerd reloads its configuration on the directory's events.
    std::thread::sleep(Duration::from_secs(2));
    Ok(())
}

/// The base manifest applied (only the DaemonSet was deleted) and its
/// rollout done; then every agent's conflist in place.
fn install_suite(cluster: &Cluster) -> Result<(), String> {
    cluster.apply_manifest("cni-suite.yaml")?;
    try_poll(
        "the suite's conflist on every node",
        LIMIT,
        Duration::from_millis(200),
        || {
            let missing: Vec<String> = cluster
                .nodes()
                .into_iter()
                .filter(|node| {
                    !machine_dir(cluster, node)
                        .join("cni-conf")
                        .join(SUITE_CONFLIST)
                        .is_file()
                })
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("missing on {missing:?}"))
            }
        },
    )
    .map(drop)
}

/// Puts the suite back on drop (after a failure or a panic too): the
/// cluster half that follows, and anyone using the cluster afterwards,
/// expect it. A burst's pods left by a failure are torn down first, by the
/// network that set them up. Never panics (it runs while unwinding).
struct SuiteRestored<'a> {
    cluster: &'static Cluster,
    namespace: &'a Namespace,
}

impl Drop for SuiteRestored<'_> {
    fn drop(&mut self) {
        let (cluster, namespace) = (self.cluster, self.namespace);
        let restored = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            namespace.kubectl(&["delete", "pods", "--all", "--wait=false"]);
            try_poll(
                "the bench's containers to be gone",
                LIMIT,
                Duration::from_secs(1),
                || {
                    for node in cluster.nodes() {
                        let left = containers_of(cluster, &node, &namespace.name)?;
                        if left > 0 {
                            return Err(format!("{node}: {left} containers left"));
                        }
                    }
                    Ok(())
                },
            )?;
            switch_to(cluster, Wiring::Suite)
        }));
        match restored {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("bench: the suite could not be installed again: {e}"),
            Err(_) => eprintln!("bench: the suite could not be installed again (see the panic above)"),
        }
    }
}

/// One pod of a burst: the pause image as its only container, no
/// service-account volume (nothing but the sandbox and one container).
fn burst_pod(name: &str, label: &str, host_network: bool) -> Result<Pod, String> {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"burst": label}},
        "spec": {
            "hostNetwork": host_network,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "pause", "image": test_kit::cluster::PAUSE, "imagePullPolicy": "Never"}],
        }
    }))
    .map_err(|e| e.to_string())
}

/// A node's veths: how many, and how many of them hang on the suite's
/// bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Veths {
    total: usize,
    bridged: usize,
}

/// Every node's veths, by node.
fn all_veths(cluster: &Cluster) -> Result<BTreeMap<String, Veths>, String> {
    cluster
        .nodes()
        .into_iter()
        .map(|node| Ok((node.clone(), veths(cluster, &node)?)))
        .collect()
}

fn veths(cluster: &Cluster, node: &str) -> Result<Veths, String> {
    let links = cluster.on_node(node, &["ip", "-o", "link", "show", "type", "veth"]);
    if !links.ok() {
        return Err(format!("{links:?}"));
    }
    let lines: Vec<&str> = links.stdout.lines().collect();
    let bridged = lines
        .iter()
        .filter(|line| line.contains(&format!(" master {SUITE_BRIDGE} ")))
        .count();
    Ok(Veths {
        total: lines.len(),
        bridged,
    })
}

/// The addresses the reference's host-local holds on a node (one file
/// each in its data directory).
fn reference_leases(cluster: &Cluster, node: &str) -> usize {
    let listing = cluster.on_node(node, &["ls", "-1", &format!("{KINDNET_DATA_DIR}/{KINDNET_NAME}")]);
    listing
        .stdout
        .lines()
        .filter(|name| name.parse::<IpAddr>().is_ok())
        .count()
}

fn burst(
    cluster: &Cluster,
    namespace: &Namespace,
    wiring: Wiring,
    label: &str,
    baseline: &BTreeMap<String, Veths>,
    pods: usize,
    out: &mut ScaleOutcome,
) -> Result<Samples, String> {
    let mut logs = BTreeMap::new();
    for node in baseline.keys() {
        let log = machine_dir(cluster, node).join("log/containerd.log");
        let offset = std::fs::metadata(&log)
            .map_err(|e| format!("{}: {e}", log.display()))?
            .len();
        logs.insert(node.clone(), (log, offset));
    }
    let started = Instant::now();
    let host_network = wiring == Wiring::HostNetwork;
    let trace = ExecTrace::start();
    let running = create_and_watch(cluster, &namespace.name, label, host_network, pods);
    let plugins = trace.map(ExecTrace::plugin_runs).unwrap_or_default();
    let running = running?;
    eprintln!(
        "bench: {pods} pods Running ({}) in {:?}",
        wiring.label(),
        started.elapsed()
    );

    // Each node served its pods through the wiring said.
    let listed = namespace.pods(&format!("burst={label}"));
    for (node, before) in baseline {
        let here = listed.iter().filter(|pod| &pod.node == node).count();
        let now = veths(cluster, node)?;
        let new_bridged = now.bridged.saturating_sub(before.bridged);
        let new_others = (now.total - now.bridged).saturating_sub(before.total - before.bridged);
        // host-local keeps one file per address: one per family and pod.
        let leases = reference_leases(cluster, node);
        let served = match wiring {
            Wiring::Suite => new_bridged == here && new_others == 0,
            Wiring::Reference => {
                new_bridged == 0 && new_others == here && leases == here * pod_cidrs(cluster, node).len()
            }
            Wiring::HostNetwork => new_bridged == 0 && new_others == 0,
        };
        if !served {
            return Err(format!(
                "{node}: {here} pods of the burst, {new_bridged} new veths on {SUITE_BRIDGE}, {new_others} others, {leases} reference leases: not the {}'s work",
                wiring.label()
            ));
        }
    }

    let mut sandbox = BTreeMap::new();
    for (node, (log, offset)) in &logs {
        let text = read_from(log, *offset)?;
        let (times, failures) = sandbox_times(&text, &namespace.name);
        if failures > 0 {
            out.problem(format!(
                "{node}: {failures} RunPodSandbox call(s) failed through the {}",
                wiring.label()
            ));
        }
        sandbox.extend(times);
    }
    let missing: Vec<&String> = running
        .keys()
        .filter(|name| !sandbox.contains_key(*name))
        .collect();
    if !missing.is_empty() {
        return Err(format!("no RunPodSandbox in containerd's logs for {missing:?}"));
    }
    Ok(Samples {
        sandbox: sandbox.into_values().collect(),
        running: running.into_values().collect(),
        plugins,
    })
}

/// The kernel's own record of every program started and ended on the
/// machine (`perf record` of the `sched_process_exec` and `_exit`
/// tracepoints), kept while a burst runs: each CNI plugin's run from exec
/// to exit, measured beside containerd, never by the plugins.
struct ExecTrace {
    perf: std::process::Child,
    data: tempfile::TempPath,
}

impl ExecTrace {
    /// None (said once) where perf cannot record: the rows are left out.
    fn start() -> Option<ExecTrace> {
        let data = tempfile::NamedTempFile::new().ok()?.into_temp_path();
        let perf = std::process::Command::new("perf")
            .args([
                "record",
                "-q",
                "-a",
                "-e",
                "sched:sched_process_exec",
                "-e",
                "sched:sched_process_exit",
                "-o",
            ])
            .arg(&data)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| eprintln!("bench: no plugin timings (perf: {e})"))
            .ok()?;
        // perf opens its events before the burst starts.
        std::thread::sleep(Duration::from_millis(500));
        Some(ExecTrace { perf, data })
    }

    /// Stops recording; per plugin binary (`/opt/cni/bin/<name>`), each
    /// run's milliseconds.
    fn plugin_runs(mut self) -> BTreeMap<String, Vec<f64>> {
        self.stop();
        let script = std::process::Command::new("perf")
            .args(["script", "-F", "pid,time,event,trace", "-i"])
            .arg(&self.data)
            .stderr(std::process::Stdio::null())
            .output();
        match script {
            Ok(output) => plugin_runs(&String::from_utf8_lossy(&output.stdout)),
            Err(e) => {
                eprintln!("bench: no plugin timings (perf script: {e})");
                BTreeMap::new()
            }
        }
    }

    /// Stops recording, unless the recorder already ended.
    fn stop(&mut self) {
        if matches!(self.perf.try_wait(), Ok(None)) {
            interrupt(&mut self.perf);
        }
    }
}

/// A system-wide recorder never outlives the bench.
impl Drop for ExecTrace {
    fn drop(&mut self) {
        self.stop();
    }
}

/// From `perf script -F pid,time,event,trace` lines: per binary under
/// /opt/cni/bin, each process's milliseconds from its exec to its main
/// thread's exit.
fn plugin_runs(script: &str) -> BTreeMap<String, Vec<f64>> {
    let mut started: BTreeMap<u32, (f64, String)> = BTreeMap::new();
    let mut runs: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for line in script.lines() {
        let mut fields = line.split_whitespace();
        let (Some(pid), Some(time), Some(event)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let (Ok(pid), Ok(time)) = (pid.parse::<u32>(), time.trim_end_matches(':').parse::<f64>()) else {
            continue;
        };
        let value = |key: &str| line.split_whitespace().find_map(|field| field.strip_prefix(key));
        match event {
            "sched:sched_process_exec:" => {
                if let Some(plugin) = value("filename=").and_then(|path| path.strip_prefix("/opt/cni/bin/")) {
                    started.insert(pid, (time, plugin.to_owned()));
                }
            }
            // The exit of the thread whose id is the process's.
            "sched:sched_process_exit:" if value("pid=") == Some(&pid.to_string()) => {
                if let Some((exec, plugin)) = started.remove(&pid) {
                    runs.entry(plugin).or_default().push((time - exec) * 1000.0);
                }
            }
            _ => {}
        }
    }
    runs
}

/// How many containers (sandboxes included) containerd still holds on
/// `node` for pods of `namespace`.
fn containers_of(cluster: &Cluster, node: &str, namespace: &str) -> Result<usize, String> {
    let filter = format!("labels.\"io.kubernetes.pod.namespace\"=={namespace}");
    let listed = cluster.on_node(node, &["ctr", "-n", "k8s.io", "containers", "ls", "-q", &filter]);
    if listed.ok() {
        Ok(listed
            .stdout
            .lines()
            .filter(|line| !line.trim().is_empty())
            .count())
    } else {
        Err(format!("{listed:?}"))
    }
}

fn read_from(log: &Path, offset: u64) -> Result<String, String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut text = String::new();
    file.seek(SeekFrom::Start(offset))
        .and_then(|_| file.read_to_string(&mut text))
        .map_err(|e| format!("{}: {e}", log.display()))?;
    Ok(text)
}

/// Creates `count` pods labelled `burst=<label>`, `PARALLEL_CREATES` in
/// flight, and watches them: per pod, the milliseconds from just before
/// its create request to the watch event that shows it Running.
fn create_and_watch(
    cluster: &Cluster,
    namespace: &str,
    label: &str,
    host_network: bool,
    count: usize,
) -> Result<BTreeMap<String, f64>, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let kubeconfig =
        kube::config::Kubeconfig::read_from(cluster.dir().join("kubeconfig")).map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| e.to_string())?;
        let client = kube::Client::try_from(config).map_err(|e| e.to_string())?;
        let api: kube::Api<Pod> = kube::Api::namespaced(client, namespace);
        let selector = format!("burst={label}");
        let listed = api
            .list_metadata(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| format!("listing the burst's pods: {e}"))?;
        let version = listed.metadata.resource_version.unwrap_or_default();
        let limit = u32::try_from(LIMIT.as_secs()).unwrap_or(u32::MAX);
        let events = api
            .watch(&WatchParams::default().labels(&selector).timeout(limit), &version)
            .await
            .map_err(|e| format!("watching the burst's pods: {e}"))?;

        let creates = futures::stream::iter(0..count)
            .map(|i| {
                let api = api.clone();
                let name = format!("{label}-{i}");
                async move {
                    let pod = burst_pod(&name, label, host_network)?;
                    let sent = Instant::now();
                    api.create(&PostParams::default(), &pod)
                        .await
                        .map_err(|e| format!("creating {name}: {e}"))?;
                    Ok::<_, String>((name, sent))
                }
            })
            .buffer_unordered(PARALLEL_CREATES)
            .try_collect::<BTreeMap<String, Instant>>();
        let watched = async {
            let mut running: BTreeMap<String, Instant> = BTreeMap::new();
            let mut events = std::pin::pin!(events);
            while running.len() < count {
                let Some(event) = events.try_next().await.map_err(|e| format!("the watch: {e}"))? else {
                    return Err(format!(
                        "the watch ended after {LIMIT:?} with {} of {count} pods Running",
                        running.len()
                    ));
                };
                let pod = match event {
                    WatchEvent::Added(pod) | WatchEvent::Modified(pod) => pod,
                    WatchEvent::Error(e) => return Err(format!("the watch: {e}")),
                    WatchEvent::Deleted(_) | WatchEvent::Bookmark(_) => continue,
                };
                let is_running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                if let (true, Some(name)) = (is_running, pod.metadata.name) {
                    running.entry(name).or_insert_with(Instant::now);
                }
            }
            Ok(running)
        };
        // A failed create ends the wait for the others at once.
        let (sent, running) = futures::try_join!(creates, watched)?;
        Ok(running
            .into_iter()
            .filter_map(|(name, seen)| {
                let since = sent.get(&name)?;
                Some((name, seen.duration_since(*since).as_secs_f64() * 1000.0))
            })
            .collect())
    })
}

/// Deletes the burst's pods and waits until the API lists none and every
/// node is back to its veths from before, holds no reference lease and no
/// container of the namespace: kubelet stops a sandbox once more when its
/// garbage collection (every minute) removes it, and that DEL must reach
/// the network that set it up (ptp fails the DEL of a suite's pod, and
/// kubelet then retries it forever).
fn clear(
    cluster: &Cluster,
    namespace: &Namespace,
    wiring: Wiring,
    label: &str,
    baseline: &BTreeMap<String, Veths>,
) -> Result<(), String> {
    let selector = format!("burst={label}");
    let delete = namespace.kubectl(&["delete", "pods", "-l", &selector, "--wait=false"]);
    if !delete.ok() {
        return Err(format!("{delete:?}"));
    }
    try_poll(
        "the burst's pods, veths and containers to be gone",
        LIMIT,
        Duration::from_millis(500),
        || {
            let left = namespace.kubectl(&["get", "pods", "-l", &selector, "--no-headers"]);
            if !left.ok() || !left.stdout.trim().is_empty() {
                return Err(format!("pods left: {}", left.stdout.lines().count()));
            }
            for (node, before) in baseline {
                let now = veths(cluster, node)?;
                if now.total > before.total {
                    return Err(format!("{node}: {} veths left", now.total - before.total));
                }
                let leases = reference_leases(cluster, node);
                if leases > 0 {
                    return Err(format!("{node}: {leases} reference leases left"));
                }
                // A hostNetwork sandbox's stop calls no plugin.
                let containers = match wiring {
                    Wiring::HostNetwork => 0,
                    _ => containers_of(cluster, node, &namespace.name)?,
                };
                if containers > 0 {
                    return Err(format!("{node}: {containers} containers left"));
                }
            }
            Ok(())
        },
    )
    .map(drop)
}

/// Per pod of `namespace` in a containerd log: the milliseconds of its
/// RunPodSandbox, from the call's first line to the one naming the sandbox
/// it returned (kubelet's last attempt, when it had to try again); and how
/// many calls failed.
fn sandbox_times(log: &str, namespace: &str) -> (BTreeMap<String, f64>, usize) {
    let mut started: BTreeMap<String, Timestamp> = BTreeMap::new();
    let mut times = BTreeMap::new();
    let mut failures = 0;
    for line in log.lines() {
        let Some((at, pod, rest)) = sandbox_line(line, namespace) else {
            continue;
        };
        if rest.contains("returns sandbox id") {
            if let Some(start) = started.remove(&pod) {
                let span = at.duration_since(start);
                times.insert(pod, span.as_secs_f64() * 1000.0);
            }
        } else if rest.contains("failed") {
            failures += 1;
            started.remove(&pod);
        } else {
            started.insert(pod, at);
        }
    }
    (times, failures)
}

/// A containerd line about a RunPodSandbox of a pod in `namespace`: its
/// time, the pod's name and what follows the sandbox's metadata.
fn sandbox_line<'a>(line: &'a str, namespace: &str) -> Option<(Timestamp, String, &'a str)> {
    let (_, after_time) = line.split_once("time=\"")?;
    let (time, _) = after_time.split_once('"')?;
    let (_, metadata) = line.split_once("msg=\"RunPodSandbox for &PodSandboxMetadata{")?;
    let (metadata, rest) = metadata.split_once('}')?;
    let field = |key: &str| {
        metadata
            .split(',')
            .find_map(|part| part.strip_prefix(key)?.strip_prefix(':'))
    };
    if field("Namespace")? != namespace {
        return None;
    }
    Some((time.parse().ok()?, field("Name")?.to_owned(), rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as containerd 1.6.20 wrote them on this cluster.
    const LOG: &str = r#"time="2026-11-27T20:46:55.875244299Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:web-0,Uid:9f0e,Namespace:bench,Attempt:0,}"
time="2026-11-27T20:46:55.900000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:agent,Uid:1,Namespace:kube-system,Attempt:0,}"
time="2026-11-27T20:46:55.910000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:web-1,Uid:2,Namespace:bench,Attempt:0,}"
time="2026-11-27T20:46:56.010000000Z" level=error msg="RunPodSandbox for &PodSandboxMetadata{Name:web-1,Uid:2,Namespace:bench,Attempt:0,} failed, error" error="failed to setup network"
time="2026-11-27T20:46:56.101301076Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:web-0,Uid:9f0e,Namespace:bench,Attempt:0,} returns sandbox id \"7f23\""
time="2026-11-27T20:46:57.000000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:web-1,Uid:2,Namespace:bench,Attempt:0,}"
time="2026-11-27T20:46:57.040000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:web-1,Uid:2,Namespace:bench,Attempt:0,} returns sandbox id \"8a11\""
time="2026-11-27T20:46:57.050000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:agent,Uid:1,Namespace:kube-system,Attempt:0,} returns sandbox id \"9b\""
"#;

    #[test]
    fn a_pods_sandbox_time_runs_from_its_last_attempt_to_the_returned_id() {
        let (times, failures) = sandbox_times(LOG, "bench");
        assert_eq!(failures, 1);
        assert_eq!(times.len(), 2, "{times:?}");
        assert!((times["web-0"] - 226.056_777).abs() < 1e-6, "{times:?}");
        assert!((times["web-1"] - 40.0).abs() < 1e-6, "{times:?}");
    }

    #[test]
    fn a_plugins_run_lasts_from_its_exec_to_its_main_threads_exit() {
        let script =
            " 8612 36201.427963: sched:sched_process_exec: filename=/opt/cni/bin/bridge pid=8612 old_pid=8612
 8614 36201.431765: sched:sched_process_exec: filename=/opt/cni/bin/host-local pid=8614 old_pid=8614
 8614 36201.433000: sched:sched_process_exit: comm=host-local pid=8615 prio=120 group_dead=false
 8614 36201.436765: sched:sched_process_exit: comm=host-local pid=8614 prio=120 group_dead=true
 8620 36201.437000: sched:sched_process_exec: filename=/usr/sbin/iptables pid=8620 old_pid=8620
 8620 36201.438000: sched:sched_process_exit: comm=iptables pid=8620 prio=120 group_dead=true
 8612 36201.440963: sched:sched_process_exit: comm=bridge pid=8612 prio=120 group_dead=true
";
        let runs = plugin_runs(script);
        assert_eq!(runs.keys().collect::<Vec<_>>(), ["bridge", "host-local"]);
        assert!((runs["bridge"][0] - 13.0).abs() < 1e-6, "{runs:?}");
        assert!((runs["host-local"][0] - 5.0).abs() < 1e-6, "{runs:?}");
    }

    #[test]
    fn kindnets_conflist_has_a_range_in_the_upper_half_and_a_default_route_per_family() {
        let conflist = kindnet_conflist(&["10.244.1.0/24".into(), "fd00:10:244:1::/64".into()], 1500);
        let ipam = &conflist["plugins"][0]["ipam"];
        assert_eq!(
            ipam["ranges"],
            json!([
                [{"subnet": "10.244.1.0/24", "rangeStart": "10.244.1.128"}],
                [{"subnet": "fd00:10:244:1::/64", "rangeStart": "fd00:10:244:1:8000::"}]
            ])
        );
        assert_eq!(ipam["routes"], json!([{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]));
        assert_eq!(ipam["dataDir"], "/run/cni-ipam-state");
        assert_eq!(conflist["plugins"][1]["type"], "portmap");
    }
}
