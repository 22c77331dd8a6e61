//! `make bench`: the suite against Debian's reference plugins
//! (/usr/lib/cni) in one run, the same configuration shape, alternating
//! call by call so machine noise hits both. Each suite gets its own node
//! namespace (bridge, masquerade, IPAM data) and pod namespaces; plugins are
//! executed directly as libcni executes them.
//!
//! It fails on any failed call, duplicate address or leak in either suite,
//! never on a timing.

pub mod measure;
pub mod report;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use netns::NetNs;
use serde_json::{Value, json};

use crate::{LeaseService, Netns, Node, bin_dir};
use measure::{Call, exec, median, ms, process_cpu, quantile};

const REFERENCE_DIR: &str = "/usr/lib/cni";

#[derive(Debug, Clone)]
pub struct Options {
    pub pods: usize,
    pub repeats: usize,
    pub full_leases: usize,
    pub out: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    Ours,
    Reference,
}

impl Side {
    pub fn label(self) -> &'static str {
        match self {
            Side::Ours => "ours",
            Side::Reference => "reference",
        }
    }
}

/// Everything one run measured and found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Per repeat: metric → side → value (ms).
    pub repeats: Vec<BTreeMap<String, BTreeMap<Side, f64>>>,
    /// Per-call wall times (ms) by phase and side, over all repeats, for
    /// the chart.
    pub samples: BTreeMap<String, BTreeMap<Side, Vec<f64>>>,
    pub problems: Vec<String>,
    /// (what was run, the profiler's report), for the markdown report.
    pub profiles: Vec<(String, String)>,
}

impl Outcome {
    fn record(&mut self, metric: &str, side: Side, value: f64) {
        self.repeats
            .last_mut()
            .expect("a repeat is running")
            .entry(metric.to_owned())
            .or_default()
            .insert(side, value);
    }

    fn sample(&mut self, phase: &str, side: Side, calls: &[Call]) {
        self.samples
            .entry(phase.to_owned())
            .or_default()
            .entry(side)
            .or_default()
            .extend(calls.iter().map(|c| ms(c.wall)));
    }

    fn problem(&mut self, text: String) {
        eprintln!("bench: {text}");
        self.problems.push(text);
    }

    /// Median over the repeats of each metric and side.
    pub fn medians(&self) -> BTreeMap<String, BTreeMap<Side, f64>> {
        let mut all: BTreeMap<String, BTreeMap<Side, Vec<f64>>> = BTreeMap::new();
        for repeat in &self.repeats {
            for (metric, sides) in repeat {
                for (side, value) in sides {
                    all.entry(metric.clone())
                        .or_default()
                        .entry(*side)
                        .or_default()
                        .push(*value);
                }
            }
        }
        all.into_iter()
            .map(|(metric, sides)| (metric, sides.into_iter().map(|(s, v)| (s, median(&v))).collect()))
            .collect()
    }
}

/// One suite's node: its namespace, bridge, subnet, IPAM data and, for
/// ours, host-local's lease service (the shipped setup).
#[derive(Debug)]
pub struct Suite {
    pub side: Side,
    bins: PathBuf,
    node: Node,
    ns: NetNs,
    network: String,
    bridge: String,
    subnet: String,
    service: Option<LeaseService>,
}

impl Suite {
    fn new(side: Side, network: &str, bridge: &str, subnet: &str) -> Self {
        let node = Node::new();
        let ns = NetNs::open(node.netns.path()).expect("node netns");
        let (bins, service) = match side {
            Side::Ours => {
                let bins = bin_dir();
                let service =
                    LeaseService::start(&bins.join("host-local"), node.path("host-local.sock"), &[]);
                (bins, Some(service))
            }
            Side::Reference => (PathBuf::from(REFERENCE_DIR), None),
        };
        Suite {
            side,
            bins,
            node,
            ns,
            network: network.to_owned(),
            bridge: bridge.to_owned(),
            subnet: subnet.to_owned(),
            service,
        }
    }

    fn data_dir(&self) -> PathBuf {
        self.node.path("ipam")
    }

    fn ipam(&self) -> Value {
        let mut ipam = json!({"type": "host-local", "ranges": [[{"subnet": self.subnet}]],
                              "dataDir": self.data_dir().to_str().expect("UTF-8")});
        if let Some(service) = &self.service {
            ipam["socket"] = json!(service.socket.to_str().expect("UTF-8"));
        }
        ipam
    }

    fn bridge_conf(&self, prev: Option<&Value>) -> String {
        self.bridge_value(prev).to_string()
    }

    fn bridge_value(&self, prev: Option<&Value>) -> Value {
        let mut conf = json!({"cniVersion": "1.0.0", "name": self.network, "type": "bridge",
            "bridge": self.bridge, "isGateway": true, "ipMasq": true, "ipam": self.ipam()});
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        conf
    }

    /// A bridge DEL. Ours runs at `logLevel` debug into a file of the
    /// call's own, read back into the call's stderr: the bridge says there
    /// how long the kernel took to delete the veth (the floor of the call,
    /// see [`kernel_deletion_ms`]).
    fn bridge_del(&self, id: &str, netns: &str, prev: &Value) -> Call {
        let mut conf = self.bridge_value(Some(prev));
        let log = (self.side == Side::Ours).then(|| self.node.path(&format!("del-{id}.log")));
        if let Some(log) = &log {
            conf["logLevel"] = json!("debug");
            conf["logFile"] = json!(log.to_str().expect("UTF-8"));
        }
        let mut call = self.call("bridge", "DEL", id, netns, &conf.to_string());
        if let Some(log) = log {
            call.stderr
                .push_str(&std::fs::read_to_string(&log).unwrap_or_default());
            let _ = std::fs::remove_file(&log);
        }
        call
    }

    fn ipam_conf(&self) -> String {
        json!({"cniVersion": "1.0.0", "name": self.network, "ipam": self.ipam()}).to_string()
    }

    fn env<'a>(&'a self, command: &'a str, id: &'a str, netns: &'a str) -> [(&'a str, &'a str); 5] {
        [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", id),
            ("CNI_NETNS", netns),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", self.bins.to_str().expect("UTF-8")),
        ]
    }

    fn call(&self, plugin: &str, command: &str, id: &str, netns: &str, stdin: &str) -> Call {
        let env = self.env(command, id, netns);
        exec(&self.ns, &self.bins.join(plugin), &[], &env, stdin)
    }

    /// bridge `command` under `profiler args -o <file> --`: the call and
    /// what the profiler wrote.
    fn profiled(
        &self,
        profiler: &Path,
        args: &[&str],
        command: &str,
        netns: &str,
        prev: Option<&Value>,
    ) -> (Call, String) {
        let report = tempfile::NamedTempFile::new().expect("temporary file");
        let plugin = self.bins.join("bridge");
        let mut full = args.to_vec();
        full.extend([
            "-o",
            report.path().to_str().expect("UTF-8"),
            "--",
            plugin.to_str().expect("UTF-8"),
        ]);
        let env = self.env(command, "profiled", netns);
        let call = exec(&self.ns, profiler, &full, &env, &self.bridge_conf(prev));
        let text = std::fs::read_to_string(report.path()).unwrap_or_default();
        (call, text)
    }

    /// `run`, with the lease service's CPU while it ran added to the
    /// call's own: for a phase whose calls of several kinds follow each
    /// other, where a share per phase would not say whose it was.
    fn with_service_cpu(&self, run: impl FnOnce() -> Call) -> Call {
        let before = self.service_cpu();
        let mut call = run();
        call.cpu += self.service_cpu().saturating_sub(before);
        call
    }

    fn service_cpu(&self) -> Duration {
        self.service
            .as_ref()
            .and_then(LeaseService::pid)
            .map_or(Duration::ZERO, process_cpu)
    }

    /// What attachments left behind once all are deleted.
    fn leftovers(&self) -> Vec<String> {
        let mut left = self.node.veths();
        left.extend(self.node.container_nat_chains());
        let leases_dir = self.data_dir().join(&self.network);
        match self.side {
            Side::Reference => {
                if let Ok(entries) = std::fs::read_dir(&leases_dir) {
                    left.extend(
                        entries
                            .flatten()
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .filter(|n| n != "lock" && !n.starts_with("last_reserved_ip"))
                            .map(|n| format!("lease file {n}")),
                    );
                }
            }
            Side::Ours => {
                let socket = self
                    .service
                    .as_ref()
                    .map(|s| s.socket.to_str().expect("UTF-8").to_owned());
                left.extend(
                    self.node
                        .lease_records(&self.network, &self.data_dir(), socket.as_deref().unwrap_or(""))
                        .iter()
                        .map(|l| format!("lease {l}")),
                );
            }
        }
        left
    }
}

fn ips_of(result: &Value) -> Vec<String> {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str().map(str::to_owned))
        .collect()
}

fn duplicates(addresses: &[String]) -> Vec<String> {
    let mut seen = BTreeSet::new();
    addresses.iter().filter(|a| !seen.insert(*a)).cloned().collect()
}

/// The IPv4 address on a pod's eth0, as the kernel has it.
fn pod_address(pod: &Netns) -> Option<String> {
    let shown = pod.ip(&["-4", "-o", "addr", "show", "eth0"]).stdout;
    shown
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .map(str::to_owned)
}

fn pods(n: usize, role: &str) -> Vec<Netns> {
    (0..n).map(|_| Netns::new(role)).collect()
}

fn cpu_ms(calls: &[Call], extra: Duration) -> Vec<f64> {
    let share = if calls.is_empty() {
        0.0
    } else {
        ms(extra) / calls.len() as f64
    };
    calls.iter().map(|c| ms(c.cpu) + share).collect()
}

fn walls(calls: &[Call]) -> Vec<f64> {
    calls.iter().map(|c| ms(c.wall)).collect()
}

/// Ours' excess over the floor: the median of per-call differences, each
/// of our calls against the floor call measured beside it.
fn record_excess(out: &mut Outcome, name: &str, ours: &[f64], floor: &[f64]) {
    let excess: Vec<f64> = ours.iter().zip(floor).map(|(o, f)| o - f).collect();
    out.record(&format!("{name} above floor"), Side::Ours, median(&excess));
}

/// What the bridge logged at debug as the kernel's time for deleting the
/// veth in this DEL.
fn kernel_deletion_ms(call: &Call) -> Option<f64> {
    let (_, rest) = call.stderr.split_once("the kernel took ")?;
    rest.split_whitespace().next()?.parse().ok()
}

/// A bridge DEL's floor is one process start plus the veth deletion, whose
/// kernel time alone swings by tens of milliseconds from call to call
/// (scheduler ticks of RCU grace periods). So each of our DELs is split
/// into the deletion it waited for (its own, as logged) and everything
/// else; [`judge_floors`] sets the latter against a process start.
fn record_deletion_split(out: &mut Outcome, name: &str, dels: &[Call]) {
    let mut deletion = Vec::with_capacity(dels.len());
    let mut outside = Vec::with_capacity(dels.len());
    for call in dels {
        match kernel_deletion_ms(call) {
            Some(kernel) => {
                deletion.push(kernel);
                outside.push(ms(call.wall) - kernel);
            }
            None => out.problem(format!(
                "{name} (ours) logged no veth deletion: {}",
                call.stderr.trim()
            )),
        }
    }
    out.record(&format!("{name} kernel deletion"), Side::Ours, median(&deletion));
    out.record(
        &format!("{name} outside the deletion"),
        Side::Ours,
        median(&outside),
    );
}

/// The DEL wall targets' floor excess: what ours spends outside the veth
/// deletion minus one process start (`floor exec /bin/true`), this round.
fn judge_floors(out: &mut Outcome) {
    let current = out.repeats.last().expect("a repeat is running");
    let ours = |metric: &str| current.get(metric).and_then(|m| m.get(&Side::Ours)).copied();
    let Some(start) = ours("floor exec /bin/true") else {
        return;
    };
    let excess: Vec<(String, f64)> = ["seq DEL", "full chain DEL"]
        .iter()
        .filter_map(|name| {
            let outside = ours(&format!("{name} outside the deletion"))?;
            Some((format!("{name} above floor"), outside - start))
        })
        .collect();
    for (metric, value) in excess {
        out.record(&metric, Side::Ours, value);
    }
}

fn check_calls(out: &mut Outcome, what: &str, side: Side, calls: &[Call]) {
    for call in calls.iter().filter(|c| !c.ok) {
        out.problem(format!(
            "{what} ({}) failed: {}{}",
            side.label(),
            call.stdout.trim(),
            call.stderr.trim()
        ));
    }
}

fn check_leaks(out: &mut Outcome, what: &str, suite: &Suite) {
    let left = suite.leftovers();
    if !left.is_empty() {
        out.problem(format!("{what} ({}) left behind: {left:?}", suite.side.label()));
    }
}

fn record_latencies(out: &mut Outcome, name: &str, side: Side, calls: &[Call], cpu_extra: Duration) {
    let wall = walls(calls);
    out.record(&format!("{name} p50"), side, quantile(&wall, 0.5));
    out.record(&format!("{name} p95"), side, quantile(&wall, 0.95));
    out.record(&format!("{name} max"), side, quantile(&wall, 1.0));
    out.record(
        &format!("{name} cpu p50"),
        side,
        median(&cpu_ms(calls, cpu_extra)),
    );
    if !cpu_extra.is_zero() && !calls.is_empty() {
        // The lease service's share, already in the CPU row: shown apart
        // so a change in the CPU row says which process it came from.
        out.record(
            &format!("{name} cpu service share"),
            side,
            ms(cpu_extra) / calls.len() as f64,
        );
    }
    out.sample(name, side, calls);
}

/// The floor of a bridge DEL: one process (`ip link del`) deleting a pod's
/// interface, in the state a bridge ADD leaves it (set up here by our
/// bridge on a node of its own; the reference's ADD leaves the same kernel
/// state). The kernel unregisters the veth pair within that one call (RCU
/// grace periods under RTNL); no plugin can answer before it. Measured
/// inside the phases it bounds, call by call beside the suites' DELs, so
/// that machine noise hits floor and suites alike.
struct VethFloor {
    suite: Suite,
    attached: usize,
}

struct FloorPod {
    pod: Netns,
    id: String,
    result: Value,
}

impl VethFloor {
    fn new() -> Self {
        VethFloor {
            suite: Suite::new(Side::Ours, "bench-floor", "cnifloor0", "10.77.0.0/16"),
            attached: 0,
        }
    }

    fn attach(&mut self, out: &mut Outcome) -> FloorPod {
        let pod = Netns::new("floor");
        let id = format!("floor-{}", self.attached);
        self.attached += 1;
        let add = self.suite.call(
            "bridge",
            "ADD",
            &id,
            pod.path_str(),
            &self.suite.bridge_conf(None),
        );
        check_calls(out, "floor ADD", Side::Ours, std::slice::from_ref(&add));
        let result = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
        FloorPod { pod, id, result }
    }

    /// Times `ip link del` of the pod's interface, then releases the rest
    /// (lease, cache) with a DEL that is not timed.
    fn delete(&self, out: &mut Outcome, floor: &FloorPod) -> Call {
        let ns = NetNs::open(floor.pod.path()).expect("pod netns");
        let call = exec(&ns, Path::new("ip"), &["link", "del", "eth0"], &[], "");
        let conf = self.suite.bridge_conf(Some(&floor.result));
        let cleanup = self
            .suite
            .call("bridge", "DEL", &floor.id, floor.pod.path_str(), &conf);
        check_calls(out, "floor DEL", Side::Ours, std::slice::from_ref(&cleanup));
        call
    }

    fn record(&self, out: &mut Outcome, name: &str, calls: &[Call]) {
        check_calls(out, name, Side::Ours, calls);
        out.record(name, Side::Ours, median(&walls(calls)));
        out.record(
            &format!("{name} cpu"),
            Side::Ours,
            median(&cpu_ms(calls, Duration::ZERO)),
        );
        check_leaks(out, name, &self.suite);
    }
}

/// Call order for `n` calls per suite, alternating which suite goes first
/// so machine noise hits both alike: (call index, suite index).
fn interleaved(n: usize, suites: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).flat_map(move |i| (0..suites).map(move |k| (i, (i + k) % suites)))
}

/// Pods added one by one so they accumulate, then deleted one by one;
/// the suites alternate call by call.
fn seq(out: &mut Outcome, suites: &[Suite], n: usize) {
    let pods: Vec<Vec<Netns>> = suites.iter().map(|_| pods(n, "seq")).collect();
    let mut results: Vec<Vec<Value>> = vec![Vec::new(); suites.len()];
    let mut adds: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    let mut dels: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    let mut floor = VethFloor::new();
    let mut floor_pods = Vec::with_capacity(n);
    let cpu_before: Vec<Duration> = suites.iter().map(Suite::service_cpu).collect();
    for (i, s) in interleaved(n, suites.len()) {
        if s == 0 {
            floor_pods.push(floor.attach(out));
        }
        let call = suites[s].call(
            "bridge",
            "ADD",
            &format!("seq-{i}"),
            pods[s][i].path_str(),
            &suites[s].bridge_conf(None),
        );
        results[s].push(serde_json::from_str(&call.stdout).unwrap_or(Value::Null));
        adds[s].push(call);
    }
    let cpu_mid: Vec<Duration> = suites.iter().map(Suite::service_cpu).collect();
    let mut floor_dels = Vec::with_capacity(n);
    for (i, s) in interleaved(n, suites.len()) {
        dels[s].push(suites[s].bridge_del(&format!("seq-{i}"), pods[s][i].path_str(), &results[s][i]));
        if s == 0 {
            floor_dels.push(floor.delete(out, &floor_pods[i]));
        }
    }
    let cpu_after: Vec<Duration> = suites.iter().map(Suite::service_cpu).collect();
    floor.record(out, "floor veth delete", &floor_dels);
    for (s, suite) in suites.iter().enumerate() {
        check_calls(out, "seq ADD", suite.side, &adds[s]);
        check_calls(out, "seq DEL", suite.side, &dels[s]);
        let addresses: Vec<String> = results[s].iter().flat_map(ips_of).collect();
        let dup = duplicates(&addresses);
        if !dup.is_empty() {
            out.problem(format!(
                "seq ({}) duplicate addresses: {dup:?}",
                suite.side.label()
            ));
        }
        record_latencies(out, "seq ADD", suite.side, &adds[s], cpu_mid[s] - cpu_before[s]);
        record_latencies(out, "seq DEL", suite.side, &dels[s], cpu_after[s] - cpu_mid[s]);
        if suite.side == Side::Ours {
            record_deletion_split(out, "seq DEL", &dels[s]);
            record_excess(
                out,
                "seq DEL cpu p50",
                &cpu_ms(&dels[s], cpu_after[s] - cpu_mid[s]),
                &cpu_ms(&floor_dels, Duration::ZERO),
            );
        }
        check_leaks(out, "seq", suite);
    }
}

/// `n` calls released together; the wall time from release to the last
/// reply, and every call.
fn burst_calls(
    suite: &Suite,
    n: usize,
    command: &str,
    pods: &[Netns],
    results: &[Value],
) -> (Duration, Vec<Call>) {
    let barrier = Arc::new(Barrier::new(n + 1));
    let (wall, calls) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let barrier = Arc::clone(&barrier);
                let pod = pods[i].path_str().to_owned();
                let conf = suite.bridge_conf(results.get(i).filter(|v| !v.is_null()));
                scope.spawn(move || {
                    barrier.wait();
                    let call = suite.call("bridge", command, &format!("burst-{i}"), &pod, &conf);
                    (Instant::now(), call)
                })
            })
            .collect();
        barrier.wait();
        let released = Instant::now();
        let done: Vec<(Instant, Call)> = handles
            .into_iter()
            .map(|h| h.join().expect("burst thread"))
            .collect();
        let last = done.iter().map(|(t, _)| *t).max().unwrap_or(released);
        (
            last - released,
            done.into_iter().map(|(_, c)| c).collect::<Vec<_>>(),
        )
    });
    (wall, calls)
}

fn burst(out: &mut Outcome, suites: &[Suite], n: usize, round: usize) {
    for k in 0..suites.len() {
        let suite = &suites[(round + k) % suites.len()];
        let pods = pods(n, "burst");
        let cpu_before = suite.service_cpu();
        let (add_wall, adds) = burst_calls(suite, n, "ADD", &pods, &[]);
        let cpu_mid = suite.service_cpu();
        check_calls(out, "burst ADD", suite.side, &adds);
        let results: Vec<Value> = adds
            .iter()
            .map(|c| serde_json::from_str(&c.stdout).unwrap_or(Value::Null))
            .collect();
        let in_results: Vec<String> = results.iter().flat_map(ips_of).collect();
        let in_pods: Vec<String> = pods.iter().filter_map(pod_address).collect();
        for (where_, list) in [("results", &in_results), ("pods", &in_pods)] {
            let dup = duplicates(list);
            if !dup.is_empty() {
                out.problem(format!(
                    "burst ({}) duplicate addresses in {where_}: {dup:?}",
                    suite.side.label()
                ));
            }
        }
        let (del_wall, dels) = burst_calls(suite, n, "DEL", &pods, &results);
        let cpu_after = suite.service_cpu();
        check_calls(out, "burst DEL", suite.side, &dels);
        out.record("burst ADD wall", suite.side, ms(add_wall));
        out.record("burst DEL wall", suite.side, ms(del_wall));
        let add_cpu: f64 = cpu_ms(&adds, cpu_mid - cpu_before).iter().sum::<f64>() / n as f64;
        let del_cpu: f64 = cpu_ms(&dels, cpu_after - cpu_mid).iter().sum::<f64>() / n as f64;
        out.record("burst ADD cpu/call", suite.side, add_cpu);
        out.record("burst DEL cpu/call", suite.side, del_cpu);
        check_leaks(out, "burst", suite);
    }
}

/// The reference's lease files for the first `count` addresses of the
/// /16 after its gateway, as its plugin writes them, and its round-robin
/// position after the last one.
fn write_reference_leases(data_dir: &Path, network: &str, subnet: &str, count: usize) {
    let dir = data_dir.join(network);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let base: std::net::Ipv4Addr = subnet
        .split('/')
        .next()
        .and_then(|a| a.parse().ok())
        .expect("subnet");
    let base = u32::from(base);
    let mut last = String::new();
    for i in 0..count {
        let ip = std::net::Ipv4Addr::from(base + 2 + u32::try_from(i).expect("count"));
        last = ip.to_string();
        std::fs::write(dir.join(&last), format!("full-{i}\r\neth0")).expect("write lease");
    }
    std::fs::write(dir.join("last_reserved_ip.0"), last).expect("write last reserved");
}

/// ADD-then-DEL pairs per suite and round in the full phase: one sample
/// per round would leave the median to a single veth deletion's luck.
const FULL_PAIRS: usize = 16;

/// A /16 with the leases already held: one more ADD and DEL, through the
/// chain and IPAM alone, `FULL_PAIRS` times (the count stays at the full
/// mark, each pair releasing what it took).
fn full_round(out: &mut Outcome, suites: &[Suite], round: usize) {
    let mut floor = VethFloor::new();
    let mut fresh = Vec::new();
    for k in 0..suites.len() {
        let suite = &suites[(round + k) % suites.len()];
        let mut calls: BTreeMap<&str, Vec<Call>> = BTreeMap::new();
        let mut floor_beside = Vec::with_capacity(FULL_PAIRS);
        for pair in 0..FULL_PAIRS {
            let pod = Netns::new("full");
            let id = format!("full-extra-{round}-{pair}");
            let add = suite.with_service_cpu(|| {
                suite.call("bridge", "ADD", &id, pod.path_str(), &suite.bridge_conf(None))
            });
            let result: Value = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
            let del = suite.with_service_cpu(|| suite.bridge_del(&id, pod.path_str(), &result));
            let floor_pod = floor.attach(out);
            floor_beside.push(floor.delete(out, &floor_pod));
            let ipam_id = format!("full-ipam-{round}-{pair}");
            let ipam = |command| {
                suite.with_service_cpu(|| {
                    suite.call(
                        "host-local",
                        command,
                        &ipam_id,
                        pod.path_str(),
                        &suite.ipam_conf(),
                    )
                })
            };
            let ipam_add = ipam("ADD");
            let ipam_del = ipam("DEL");
            for (what, call) in [
                ("chain ADD", add),
                ("chain DEL", del),
                ("IPAM ADD", ipam_add),
                ("IPAM DEL", ipam_del),
            ] {
                calls.entry(what).or_default().push(call);
            }
        }
        for (what, calls) in &calls {
            let name = format!("full {what}");
            check_calls(out, &name, suite.side, calls);
            out.record(&name, suite.side, median(&walls(calls)));
            out.record(
                &format!("{name} cpu"),
                suite.side,
                median(&cpu_ms(calls, Duration::ZERO)),
            );
            out.sample(&name, suite.side, calls);
        }
        if suite.side == Side::Ours {
            record_deletion_split(out, "full chain DEL", &calls["chain DEL"]);
            record_excess(
                out,
                "full chain DEL cpu",
                &cpu_ms(&calls["chain DEL"], Duration::ZERO),
                &cpu_ms(&floor_beside, Duration::ZERO),
            );
        }
        fresh.extend(floor_beside);
    }
    floor.record(out, "floor veth delete fresh", &fresh);
}

/// Fresh pods, loopback ADD then DEL.
fn loopback(out: &mut Outcome, suites: &[Suite], n: usize) {
    let conf = json!({"cniVersion": "1.0.0", "name": "lo", "type": "loopback"}).to_string();
    let mut adds: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    let mut dels: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    for (i, s) in interleaved(n, suites.len()) {
        let pod = Netns::new("lo");
        let id = format!("lo-{i}");
        adds[s].push(suites[s].call("loopback", "ADD", &id, pod.path_str(), &conf));
        dels[s].push(suites[s].call("loopback", "DEL", &id, pod.path_str(), &conf));
    }
    for (s, suite) in suites.iter().enumerate() {
        check_calls(out, "loopback ADD", suite.side, &adds[s]);
        check_calls(out, "loopback DEL", suite.side, &dels[s]);
        record_latencies(out, "loopback ADD", suite.side, &adds[s], Duration::ZERO);
        record_latencies(out, "loopback DEL", suite.side, &dels[s], Duration::ZERO);
    }
}

/// A pod as istio-redirect finds it after bridge: lo up, an address.
fn addressed_pod() -> Netns {
    let pod = Netns::new("mesh");
    pod.ip(&["link", "set", "lo", "up"]).success();
    pod.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "peer0"])
        .success();
    pod.ip(&["link", "set", "eth0", "up"]).success();
    pod.ip(&["addr", "add", "10.79.0.2/24", "dev", "eth0"]).success();
    pod
}

/// istio-redirect ADD with annotations from runtimeConfig (no API call),
/// next to one bare apply of the same rules into a fresh pod: an
/// `iptables-nft-restore`, or with `native_nftables` one `nft -f`.
fn istio(out: &mut Outcome, ours: &Suite, n: usize, native_nftables: bool) {
    let status = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;
    let conf = json!({"cniVersion": "1.0.0", "name": "mesh", "type": "istio-redirect",
        "native_nftables": native_nftables,
        "capabilities": {"io.kubernetes.cri.pod-annotations": true},
        "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {
            "sidecar.istio.io/status": status, "sidecar.istio.io/interceptionMode": "REDIRECT"}},
        "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.79.0.2/24"}]}})
    .to_string();
    let redirect = firewall::istio::Redirect::default();
    let (metric, tool, tool_args, rules): (&str, &str, &[&str], String) = if native_nftables {
        (
            report::ISTIO_NATIVE_METRIC,
            "/usr/sbin/nft",
            &["-f", "-"],
            firewall::istio::render_nft(&redirect, false).fresh(),
        )
    } else {
        (
            report::ISTIO_METRIC,
            "/usr/sbin/iptables-nft-restore",
            &["--noflush"],
            firewall::istio::render(&redirect, firewall::Family::V4).restore_fresh(),
        )
    };
    let args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=x;K8S_POD_UID=u";
    let bins = ours.bins.to_str().expect("UTF-8");
    let mut adds = Vec::new();
    let mut bare = Vec::new();
    for i in 0..n {
        let pod = addressed_pod();
        let id = format!("mesh-{i}");
        let env = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", id.as_str()),
            ("CNI_NETNS", pod.path_str()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", bins),
            ("CNI_ARGS", args),
        ];
        adds.push(exec(
            &ours.ns,
            &ours.bins.join("istio-redirect"),
            &[],
            &env,
            &conf,
        ));
        let fresh = addressed_pod();
        let fresh_ns = NetNs::open(fresh.path()).expect("pod netns");
        bare.push(exec(&fresh_ns, Path::new(tool), tool_args, &[], &rules));
    }
    check_calls(out, metric, Side::Ours, &adds);
    check_calls(out, &format!("bare {tool}"), Side::Reference, &bare);
    record_latencies(out, metric, Side::Ours, &adds, Duration::ZERO);
    record_latencies(out, metric, Side::Reference, &bare, Duration::ZERO);
}

/// What this machine charges anyone: a process, and one pod's masquerade
/// added and removed with one iptables-restore each.
fn floors(out: &mut Outcome, n: usize) {
    let node = Node::new();
    let ns = NetNs::open(node.netns.path()).expect("node netns");
    let mut trues = Vec::new();
    let mut adds = Vec::new();
    let mut dels = Vec::new();
    for i in 0..n {
        trues.push(exec(&ns, Path::new("/bin/true"), &[], &[], ""));
        let id = format!("floor-{i}");
        let address: ipnetwork::IpNetwork = format!("10.78.0.{}/16", i % 250 + 2).parse().expect("address");
        let setup = firewall::masquerade::render_setup(firewall::Family::V4, "floor", &id, &[address]);
        adds.push(exec(
            &ns,
            Path::new("/usr/sbin/iptables-restore"),
            &["--noflush"],
            &[],
            &setup,
        ));
        let saved = node.run("iptables-save", &["-t", "nat"]).success().stdout;
        let table = firewall::masquerade::NatTable::parse(&saved);
        let chain = firewall::masquerade::chain_name("floor", &id);
        let teardown = firewall::masquerade::render_teardown(&table, &[chain]).expect("rules to remove");
        dels.push(exec(
            &ns,
            Path::new("/usr/sbin/iptables-restore"),
            &["--noflush"],
            &[],
            &teardown,
        ));
    }
    for (name, calls) in [
        ("floor exec /bin/true", &trues),
        ("floor restore add", &adds),
        ("floor restore delete", &dels),
    ] {
        check_calls(out, name, Side::Ours, calls);
        out.record(name, Side::Ours, median(&walls(calls)));
        out.record(
            &format!("{name} cpu"),
            Side::Ours,
            median(&cpu_ms(calls, Duration::ZERO)),
        );
    }
}

/// Profilers for the report, each told where to write its summary with
/// `-o`, so the plugin's stdout stays its own.
const PROFILERS: [(&str, &[&str]); 2] = [
    ("strace", &["-c", "-f", "-w"]),
    (
        "perf",
        &[
            "stat",
            "-e",
            "task-clock,context-switches,cpu-migrations,page-faults",
        ],
    ),
];

/// One more ADD and DEL per suite and profiler, for the report: where a
/// call's time and CPU go, child processes included. A profiler that does
/// not work here (perf without access to counters) is reported as such; a
/// plain DEL afterwards and the leak check keep the suites honest anyway.
fn profile(out: &mut Outcome, suites: &[Suite]) {
    for suite in suites {
        for (tool, args) in PROFILERS {
            let title = |verb: &str| {
                format!(
                    "{} bridge {verb} under `{tool} {}`",
                    suite.side.label(),
                    args.join(" ")
                )
            };
            let Some(program) = installed(tool) else {
                out.profiles
                    .push((title("ADD and DEL"), format!("{tool} is not installed")));
                continue;
            };
            let pod = Netns::new("profile");
            let (add, add_report) = suite.profiled(&program, args, "ADD", pod.path_str(), None);
            let result: Value = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
            let (del, del_report) = suite.profiled(&program, args, "DEL", pod.path_str(), Some(&result));
            for (verb, call, report) in [("ADD", add, add_report), ("DEL", del, del_report)] {
                let text = if call.ok {
                    report
                } else {
                    format!(
                        "failed under {tool}: {}{}",
                        call.stdout.trim(),
                        call.stderr.trim()
                    )
                };
                out.profiles.push((title(verb), text));
            }
            let cleanup = suite.call(
                "bridge",
                "DEL",
                "profiled",
                pod.path_str(),
                &suite.bridge_conf(Some(&result)),
            );
            check_calls(
                out,
                "DEL after profiling",
                suite.side,
                std::slice::from_ref(&cleanup),
            );
        }
        check_leaks(out, "profile", suite);
    }
}

fn installed(tool: &str) -> Option<PathBuf> {
    ["/usr/local/bin", "/usr/bin", "/usr/sbin", "/bin", "/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(tool))
        .find(|path| path.is_file())
}

/// Runs every phase `repeats` times.
pub fn run(options: &Options) -> Outcome {
    let mut out = Outcome::default();
    let suites = vec![
        Suite::new(Side::Ours, "bench-ours", "cnibench0", "10.70.0.0/16"),
        Suite::new(Side::Reference, "bench-ref", "cnibench1", "10.71.0.0/16"),
    ];
    let full_suites = vec![
        Suite::new(Side::Ours, "full-ours", "cnifull0", "10.72.0.0/16"),
        Suite::new(Side::Reference, "full-ref", "cnifull1", "10.73.0.0/16"),
    ];
    for suite in &full_suites {
        eprintln!(
            "bench: writing {} reference-format leases for {}",
            options.full_leases,
            suite.side.label()
        );
        write_reference_leases(
            &suite.data_dir(),
            &suite.network,
            &suite.subnet,
            options.full_leases,
        );
        // Ours imports them on first use, as a migrated node does; that
        // one-time import is not what the phase measures.
        let pod = Netns::new("warm");
        let add = suite.call(
            "bridge",
            "ADD",
            "warm-up",
            pod.path_str(),
            &suite.bridge_conf(None),
        );
        let result: Value = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
        let del = suite.call(
            "bridge",
            "DEL",
            "warm-up",
            pod.path_str(),
            &suite.bridge_conf(Some(&result)),
        );
        check_calls(&mut out, "full warm-up", suite.side, &[add, del]);
    }
    for round in 0..options.repeats {
        eprintln!("bench: round {}/{}", round + 1, options.repeats);
        out.repeats.push(BTreeMap::new());
        seq(&mut out, &suites, options.pods);
        burst(&mut out, &suites, options.pods, round);
        full_round(&mut out, &full_suites, round);
        loopback(&mut out, &suites, options.pods);
        istio(&mut out, &suites[0], options.pods, false);
        istio(&mut out, &suites[0], options.pods, true);
        floors(&mut out, options.pods.min(20));
        judge_floors(&mut out);
    }
    profile(&mut out, &suites);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn del_with(stderr: &str) -> Call {
        Call {
            wall: Duration::from_millis(30),
            cpu: Duration::ZERO,
            ok: true,
            stdout: String::new(),
            stderr: stderr.to_owned(),
        }
    }

    #[test]
    fn the_kernel_deletion_is_read_from_the_bridge_debug_log() {
        let logged = "2026-11-22T22:01:02.003Z DEBUG bridge[7]: DEL container=a ifname=eth0 netns=/x\n\
                      2026-11-22T22:01:02.030Z DEBUG bridge[7]: the kernel took 23.456 ms to delete eth0\n";
        assert_eq!(kernel_deletion_ms(&del_with(logged)), Some(23.456));
        assert_eq!(kernel_deletion_ms(&del_with("")), None);
    }
}
