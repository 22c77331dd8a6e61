//! What the plugins' log socket costs an ADD (`--only logsock`): the
//! chain the node agent writes (its own renderer: the bridge with
//! host-local, then portmap), run as libcni runs a list, with the
//! arguments a kubelet's runtime passes, in four variants taking turns
//! pod by pod on one node: every entry naming a socket a reader drains as
//! the agent does; naming a socket bound and never read, its queue full,
//! so each record the socket was for goes to stderr instead; and naming
//! none, twice: the first is the reference of the other three, the second
//! (the control) shows how far the same chain's figures drift from
//! themselves in the run, the resolution of the other rows' ratios.
//!
//! A 5% bound on p99 needs many calls: of 150 calls p99 is the second
//! largest, and the same code's p99 ratio swung between 0.93 and 1.19
//! over seven runs. So this phase makes [`CALLS_PER_POD`] calls per
//! variant for each pod the other phases make, in node-sized batches (a
//! bridge holds at most 1024 ports; a node runs about 110 pods). Even so
//! the control's p99 ratio is only as steady as the machine: on a 2-core
//! VM whose stalls of 50–100 ms slow ten calls in a row (spawning
//! `/bin/true` shows them too), it spanned 0.88–1.16 at 6,000 calls per
//! variant, where p50 and p95 stay within 2%.

use std::io::ErrorKind;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use agent_wire::log::Record;
use node_agent::controllers::conflist::{self, NodeNetwork};
use node_agent::controllers::plugin_logs::{self, PluginLogs};
use serde_json::{Value, json};
use test_kit::Netns;

use crate::measure::{Call, exec};
use crate::outcome::{Outcome, check_calls};
use crate::setup::Side;
use crate::suite::{Suite, check_leaks, interleaved};

/// The chain's ADD with a socket the agent reads, against none.
pub const LISTENED_METRIC: &str = "log socket chain ADD";
/// The chain's ADD with a socket nobody reads, against none.
pub const UNREAD_METRIC: &str = "log socket unread chain ADD";
/// The chain's ADD naming no socket, against itself.
pub const CONTROL_METRIC: &str = "log socket control chain ADD";

/// Calls per variant for each pod of `--pods`.
pub const CALLS_PER_POD: usize = 30;

/// Pods per variant on the node at once.
const BATCH: usize = 25;

/// How long the kernel may take to tear a batch's namespaces down.
const TEARDOWN: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Listened,
    Unread,
    Without,
    Control,
}

const VARIANTS: [Variant; 4] = [
    Variant::Listened,
    Variant::Unread,
    Variant::Without,
    Variant::Control,
];

/// What the agent's reader got: ADD outcomes, and records of host-local.
#[derive(Debug, Default)]
struct Read {
    add_outcomes: AtomicUsize,
    of_host_local: AtomicUsize,
}

/// The agent's own reader of the socket, each record made into the
/// agent's line (written nowhere: the agent's stderr is the runtime's
/// pipe, not the bench's to measure), and counted.
fn agents_reader(path: &Path) -> (PluginLogs, Arc<Read>) {
    let read = Arc::new(Read::default());
    let counting = read.clone();
    let options = plugin_logs::Options {
        socket: Some(path.to_path_buf()),
    };
    let sink = Box::new(move |record: &Record| {
        std::hint::black_box(node_agent::logging::plugin_message(record));
        if record.verb == "ADD" && record.level == "info" && record.msg.starts_with("ok") {
            counting.add_outcomes.fetch_add(1, Ordering::Relaxed);
        }
        if record.plugin == "host-local" {
            counting.of_host_local.fetch_add(1, Ordering::Relaxed);
        }
    });
    let reader = plugin_logs::start_with(&options, sink).expect("the agent's reader");
    (reader, read)
}

/// A socket bound at `path`, the bench's own, in place of the one the
/// phase's round before left there.
fn bind_afresh(path: &Path) -> UnixDatagram {
    let _ = std::fs::remove_file(path);
    UnixDatagram::bind(path).unwrap_or_else(|e| panic!("bind {}: {e}", path.display()))
}

/// A socket bound and never read, its queue filled: every send to it is
/// refused at once (`EAGAIN`).
fn unread_socket(path: &Path) -> UnixDatagram {
    let listener = bind_afresh(path);
    let sender = UnixDatagram::unbound().expect("socket");
    sender.set_nonblocking(true).expect("nonblocking");
    loop {
        match sender.send_to(b"{}", path) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return listener,
            Err(e) => panic!("filling the unread socket's queue: {e}"),
        }
    }
}

/// The agent's conflist for `suite`'s node, its entries naming `socket`.
fn agent_conflist(suite: &Suite, socket: Option<PathBuf>) -> Value {
    let options = conflist::Options {
        node_name: "bench".into(),
        path: suite.node.path("10-cni-suite.conflist"),
        network_name: suite.network.clone(),
        bridge: suite.bridge.clone(),
        lease_dir: suite.data_dir(),
        cni_bin_dir: suite.bins.clone(),
        log_socket: socket,
        policy_socket: None,
    };
    let network = NodeNetwork {
        pod_cidrs: vec![suite.subnet.parse().expect("a subnet")],
        mtu: 1500,
    };
    let portmap = json!({"type": "portmap", "capabilities": {"portMappings": true}});
    conflist::render(&options, &network, &[portmap])
}

/// One plugin's configuration as libcni hands it over from a list: its
/// entry with the list's name and version, and the result so far.
fn plugin_stdin(list: &Value, entry: &Value, prev: Option<&Value>) -> String {
    let mut conf = entry.clone();
    conf["name"] = list["name"].clone();
    conf["cniVersion"] = list["cniVersion"].clone();
    if let Some(prev) = prev {
        conf["prevResult"] = prev.clone();
    }
    conf.to_string()
}

/// The list run for one verb as libcni runs it: ADD in order, each given
/// the result before it; DEL in reverse, each given the ADD's result. One
/// call whose wall and CPU are the chain's, failing with the first
/// plugin that fails.
fn run_list(
    suite: &Suite,
    list: &Value,
    verb: &str,
    id: &str,
    netns: &str,
    args: &str,
    prev: Option<&Value>,
) -> Call {
    let bins = suite.bins.to_str().expect("UTF-8");
    let env = [
        ("CNI_COMMAND", verb),
        ("CNI_CONTAINERID", id),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", bins),
        ("CNI_ARGS", args),
    ];
    let mut entries: Vec<&Value> = list["plugins"].as_array().expect("plugins").iter().collect();
    if verb == "DEL" {
        entries.reverse();
    }
    let mut chain = Call {
        wall: Duration::ZERO,
        cpu: Duration::ZERO,
        ok: true,
        stdout: String::new(),
        stderr: String::new(),
    };
    let mut result = prev.cloned();
    for entry in entries {
        let plugin = entry["type"].as_str().expect("a type");
        let call = exec(
            &suite.ns,
            &suite.bins.join(plugin),
            &[],
            &env,
            &plugin_stdin(list, entry, result.as_ref()),
        );
        chain.wall += call.wall;
        chain.cpu += call.cpu;
        chain.stderr.push_str(&call.stderr);
        if !call.ok {
            chain.ok = false;
            chain.stdout = call.stdout;
            return chain;
        }
        if verb == "ADD" {
            result = serde_json::from_str(&call.stdout).ok();
            chain.stdout = call.stdout;
        }
    }
    chain
}

/// `pods` × [`CALLS_PER_POD`] pods per variant, in batches added in turn,
/// then deleted.
pub fn phase(out: &mut Outcome, suite: &Suite, pods: usize) {
    let listened = suite.node.path("log.sock");
    let unread = suite.node.path("unread.sock");
    let (reader, read) = agents_reader(&listened);
    let _unread = unread_socket(&unread);
    let lists = [
        agent_conflist(suite, Some(listened.clone())),
        agent_conflist(suite, Some(unread)),
        agent_conflist(suite, None),
        agent_conflist(suite, None),
    ];
    let calls = pods * CALLS_PER_POD;
    let mut adds: Vec<Vec<Call>> = vec![Vec::new(); VARIANTS.len()];
    let mut dels = Vec::new();
    for first in (0..calls).step_by(BATCH) {
        let batch = BATCH.min(calls - first);
        let added = add_batch(out, suite, &lists, first, batch);
        // The namespaces go first, as when a node's pods are gone before
        // the runtime's DEL: the kernel then tears their veths down in one
        // batch, where a DEL deleting each from its live namespace waits
        // for the kernel a few tens of milliseconds, most of the phase.
        let mut results: Vec<Vec<(String, Value)>> = Vec::new();
        for (v, batch_adds) in added.into_iter().enumerate() {
            let mut kept = Vec::new();
            for (pod, result, add) in batch_adds {
                kept.push((pod.path_str().to_owned(), result));
                adds[v].push(add);
            }
            results.push(kept);
        }
        for (i, v) in turns(first, batch) {
            let (netns, result) = &results[v][i];
            let id = container_id(v, first + i);
            dels.push(run_list(suite, &lists[v], "DEL", &id, netns, "", Some(result)));
        }
        wait_for_teardown(out, suite);
    }
    // The agent's reader writes what is still queued as it stops.
    reader.stop();
    let received = read.add_outcomes.load(Ordering::Relaxed);
    let of_host_local = read.of_host_local.load(Ordering::Relaxed);
    let plugins = lists[0]["plugins"].as_array().map_or(0, Vec::len);
    for (v, variant) in VARIANTS.iter().enumerate() {
        check_calls(
            out,
            &format!("log socket ADD ({variant:?})"),
            suite.setup,
            &adds[v],
        );
    }
    check_calls(out, "log socket DEL", suite.setup, &dels);
    // What each variant is said to measure, checked: the reader got the
    // outcome of each plugin of the list of every listened ADD, and no
    // more (host-local, run by the bridge, sends none of its own), and
    // the unread socket's records went to stderr.
    if received != calls * plugins {
        out.problem(format!(
            "log socket: the reader got {received} ADD outcomes of {calls} ADDs of {plugins} plugins"
        ));
    }
    if of_host_local != 0 {
        out.problem(format!(
            "log socket: host-local, run by the bridge, sent {of_host_local} records"
        ));
    }
    let unread_on_stderr = adds[1]
        .iter()
        .filter(|c| c.stderr.matches("]: ADD ok").count() == plugins);
    if unread_on_stderr.count() != calls {
        out.problem("log socket: an unread socket's ADD outcome is not on stderr".into());
    }
    let without = &adds[2];
    for (metric, variant) in [(LISTENED_METRIC, 0), (UNREAD_METRIC, 1), (CONTROL_METRIC, 3)] {
        out.sample(metric, Side::Ours, &adds[variant], Duration::ZERO);
        out.sample(metric, Side::Reference, without, Duration::ZERO);
    }
    check_leaks(out, "log socket", suite);
}

/// The variants' turns at the calls `first..first + batch` of the phase:
/// (call index in the batch, variant), taken by the call's number in the
/// phase. The first call of a batch is the slowest of it;
/// turns taken by the number in the batch gave it to the first variant
/// every time, and it alone made that variant's p99 12% above the rest.
fn turns(first: usize, batch: usize) -> impl Iterator<Item = (usize, usize)> {
    interleaved(first + batch, VARIANTS.len())
        .skip(first * VARIANTS.len())
        .map(move |(call, variant)| (call - first, variant))
}

/// Waits until the node has no veth left: the kernel tears deleted
/// namespaces down after they are gone, and calls made meanwhile were the
/// slowest of the phase, whatever their variant.
fn wait_for_teardown(out: &mut Outcome, suite: &Suite) {
    let start = std::time::Instant::now();
    while !suite.node.veths().is_empty() {
        if start.elapsed() > TEARDOWN {
            out.problem(format!("log socket: veths left {TEARDOWN:?} after their pods"));
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn container_id(variant: usize, call: usize) -> String {
    format!("logsock-{variant}-{call}")
}

/// `batch` pods per variant, numbered from `first`, each added in turn:
/// per variant, each pod with its ADD's result and the call.
fn add_batch(
    out: &mut Outcome,
    suite: &Suite,
    lists: &[Value],
    first: usize,
    batch: usize,
) -> Vec<Vec<(Netns, Value, Call)>> {
    let mut pods: Vec<std::vec::IntoIter<Netns>> = lists
        .iter()
        .map(|_| crate::suite::pods(batch, "logsock").into_iter())
        .collect();
    // The first call of a batch is slower than any other: one untimed,
    // naming no socket, goes first.
    let warm = Netns::new("logsock");
    let id = format!("logsock-warm-{first}");
    let add = run_list(suite, &lists[2], "ADD", &id, warm.path_str(), "", None);
    let result: Value = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
    let del = run_list(suite, &lists[2], "DEL", &id, warm.path_str(), "", Some(&result));
    check_calls(out, "log socket untimed ADD and DEL", suite.setup, &[add, del]);
    let mut added: Vec<Vec<(Netns, Value, Call)>> = lists.iter().map(|_| Vec::new()).collect();
    for (i, v) in turns(first, batch) {
        let call = first + i;
        let id = container_id(v, call);
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod-{v}-{call};K8S_POD_INFRA_CONTAINER_ID={id};K8S_POD_UID=u-{v}-{call}"
        );
        let pod = pods[v].next().expect("a pod per call");
        let add = run_list(suite, &lists[v], "ADD", &id, pod.path_str(), &args, None);
        let result = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
        added[v].push((pod, result, add));
    }
    added
}
