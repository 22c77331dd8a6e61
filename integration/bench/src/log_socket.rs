//! What the plugins' log socket costs an ADD (`--only logsock`): the
//! chain the node agent writes (its own renderer: the bridge with
//! host-local, then portmap), run as libcni runs a list, with the
//! arguments a kubelet's runtime passes, in three variants taking turns
//! pod by pod on one node: every entry naming a socket a reader drains as
//! the agent does; naming a socket bound and never read, its queue full,
//! so each record the socket was for goes to stderr instead; and naming
//! none, the reference of both.

use std::io::ErrorKind;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use node_agent::controllers::conflist::{self, NodeNetwork};
use serde_json::{Value, json};
use test_kit::Netns;

use super::measure::{Call, exec};
use super::{Outcome, Side, Suite, check_calls, check_leaks, interleaved};

/// The chain's ADD with a socket the agent reads, against none.
pub const LISTENED_METRIC: &str = "log socket chain ADD";
/// The chain's ADD with a socket nobody reads, against none.
pub const UNREAD_METRIC: &str = "log socket unread chain ADD";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Listened,
    Unread,
    Without,
}

const VARIANTS: [Variant; 3] = [Variant::Listened, Variant::Unread, Variant::Without];

/// A reader draining the socket as the agent does: each datagram decoded
/// and made into the agent's line (written nowhere: the agent's stderr is
/// the runtime's pipe, not the bench's to measure).
struct Reader {
    stop: Arc<AtomicBool>,
    received: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Reader {
    fn start(path: &Path) -> Reader {
        let socket = bind_afresh(path);
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("a read timeout");
        let stop = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicUsize::new(0));
        let (stopping, counting) = (stop.clone(), received.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0; cni::log::socket::MAX_DATAGRAM + 1];
            while !stopping.load(Ordering::Relaxed) {
                let Ok(len) = socket.recv(&mut buf) else {
                    continue;
                };
                if let Some(record) = cni::log::socket::Record::decode(&buf[..len]) {
                    std::hint::black_box(node_agent::logging::plugin_message(&record));
                    counting.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Reader {
            stop,
            received,
            thread: Some(thread),
        }
    }

    fn received(&self) -> usize {
        self.received.load(Ordering::Relaxed)
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
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

/// `n` pods per variant, added in turn, then deleted.
pub fn phase(out: &mut Outcome, suite: &Suite, n: usize) {
    let listened = suite.node.path("log.sock");
    let unread = suite.node.path("unread.sock");
    let reader = Reader::start(&listened);
    let _unread = unread_socket(&unread);
    let lists = [
        agent_conflist(suite, Some(listened.clone())),
        agent_conflist(suite, Some(unread)),
        agent_conflist(suite, None),
    ];
    let pods: Vec<Vec<Netns>> = VARIANTS.iter().map(|_| super::pods(n, "logsock")).collect();
    let mut adds: Vec<Vec<Call>> = vec![Vec::new(); VARIANTS.len()];
    let mut results: Vec<Vec<Value>> = vec![Vec::new(); VARIANTS.len()];
    for (i, v) in interleaved(n, VARIANTS.len()) {
        let id = format!("logsock-{v}-{i}");
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod-{v}-{i};K8S_POD_INFRA_CONTAINER_ID={id};K8S_POD_UID=u-{v}-{i}"
        );
        let add = run_list(suite, &lists[v], "ADD", &id, pods[v][i].path_str(), &args, None);
        results[v].push(serde_json::from_str(&add.stdout).unwrap_or(Value::Null));
        adds[v].push(add);
    }
    let received = reader.received();
    drop(reader);
    let mut dels = Vec::new();
    for (i, v) in interleaved(n, VARIANTS.len()) {
        let id = format!("logsock-{v}-{i}");
        let netns = pods[v][i].path_str();
        dels.push(run_list(
            suite,
            &lists[v],
            "DEL",
            &id,
            netns,
            "",
            Some(&results[v][i]),
        ));
    }
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
    // outcome of every plugin of every listened ADD, and the unread
    // socket's records went to stderr.
    let plugins = lists[0]["plugins"].as_array().map_or(0, Vec::len);
    if received < n * plugins {
        out.problem(format!(
            "log socket: the reader got {received} records of {n} ADDs of {plugins} plugins"
        ));
    }
    let unread_on_stderr = adds[1]
        .iter()
        .filter(|c| c.stderr.matches("]: ADD ok").count() == plugins);
    if unread_on_stderr.count() != n {
        out.problem("log socket: an unread socket's ADD outcome is not on stderr".into());
    }
    let without = &adds[2];
    out.sample(LISTENED_METRIC, Side::Ours, &adds[0], Duration::ZERO);
    out.sample(LISTENED_METRIC, Side::Reference, without, Duration::ZERO);
    out.sample(UNREAD_METRIC, Side::Ours, &adds[1], Duration::ZERO);
    out.sample(UNREAD_METRIC, Side::Reference, without, Duration::ZERO);
    check_leaks(out, "log socket", suite);
}
