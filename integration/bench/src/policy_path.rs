//! Where a NetworkPolicy verdict is made, and what that costs each new
//! connection on this kernel (`--only policy-path`). Two pods on one
//! node's bridge (the suite's bridge and host-local, through cnictl), a
//! listener in one accepting and closing, the other connecting and
//! closing, every connect timed; in five variants taking turns round by
//! round, so each meets the machine's same moments:
//!
//! 1. `br_netfilter off`: the node's `bridge-nf-call-ip(6)tables` at 0
//!    (per network namespace on this kernel), no rules: bridged frames
//!    never reach the IP hooks. The floor.
//! 2. `br_netfilter on`: at 1, no table at all: what `br_netfilter` costs.
//! 3. `conntrack on, no policy`: at 1, a table of one forward chain whose
//!    one rule is the first of ours (`ct state established,related
//!    accept`): conntrack (and defragmentation) switched on in the node
//!    and nothing judged, so variant 4 against it is the verdict's own
//!    share and it against variant 2 conntrack's.
//! 4. `in-kernel verdict (ours)`: at 1, the agent's table compiled and
//!    applied by the `netpol` crate as the agent does, a policy selecting
//!    the server pod and allowing the client on the port: each new
//!    connection walks its verdict map and allow chain.
//! 5. `NFQUEUE round trip`: at 1, no table of ours, the design of
//!    kube-network-policies (kindnetd's): an iptables rule sends a
//!    connection's first packet (conntrack `NEW`) to queue 100, a reader in
//!    the node's namespace ([`crate::nfqueue`]) answers accept at once, the
//!    rest of the connection bypasses it. The reader must have answered
//!    one packet per connection, or the phase fails.
//!
//! The node's conntrack table is emptied before each turn: after it, the
//! first two variants must have left no entry there and the others one
//! per connection at least, or the phase fails. Everything lives in the
//! node's and the pods' namespaces, deleted with them even when the phase
//! fails; the machine's own namespace is checked unchanged.
//!
//! Figures are in µs (a connect here takes tens of them): each variant
//! against variants 3, 2 and 1, and the p50 each adds to a connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::process::{Child, ChildStdout};

use netpol::model::{Peer, PodView, Policy, PortSpec, Protocol, Rule, Selector};
use serde_json::json;
use test_kit::{Netns, Node};

use crate::measure::median;
use crate::outcome::Outcome;
use crate::setup::Side;

/// The phase's name for `--only`.
pub const PHASE: &str = "policy-path";

/// Metrics: the first variant named is ours' column, the second the
/// reference's, so the ratio column reads as their quotient.
pub const BR_NETFILTER_METRIC: &str = "policy path connect µs, br_netfilter on, no rules / off";
pub const CONNTRACK_METRIC: &str =
    "policy path connect µs, conntrack on, no policy / br_netfilter on, no rules";
pub const OURS_CONNTRACK_METRIC: &str =
    "policy path connect µs, in-kernel verdict (ours) / conntrack on, no policy";
pub const NFQUEUE_CONNTRACK_METRIC: &str =
    "policy path connect µs, NFQUEUE round trip / conntrack on, no policy";
pub const OURS_METRIC: &str = "policy path connect µs, in-kernel verdict (ours) / br_netfilter on, no rules";
pub const NFQUEUE_METRIC: &str = "policy path connect µs, NFQUEUE round trip / br_netfilter on, no rules";
pub const OURS_OFF_METRIC: &str = "policy path connect µs, in-kernel verdict (ours) / br_netfilter off";
pub const NFQUEUE_OFF_METRIC: &str = "policy path connect µs, NFQUEUE round trip / br_netfilter off";
/// Per repeat, p50 minus the p50 of br_netfilter on with no rules.
pub const ADDED_METRIC: &str = "policy path µs added per connection (p50 above br_netfilter on, no rules), in-kernel verdict (ours) / NFQUEUE round trip";
/// Per repeat, p50 minus the p50 of conntrack on with no policy: the
/// verdict's own share.
pub const ADDED_VERDICT_METRIC: &str = "policy path µs added per connection (p50 above conntrack on, no policy), in-kernel verdict (ours) / NFQUEUE round trip";
/// Per repeat, p50 with conntrack on minus without, br_netfilter on and
/// no policy either way.
pub const ADDED_CONNTRACK_METRIC: &str =
    "policy path µs added per connection by conntrack (p50 conntrack on − br_netfilter on, no rules)";
/// Per repeat, p50 with br_netfilter on minus off, no rules either way.
pub const ADDED_BR_NETFILTER_METRIC: &str =
    "policy path µs added per connection by br_netfilter (p50 on − off)";

/// Rounds per repeat; each variant's turn in a round makes
/// [`CONNECTS_PER_POD`] connections for each pod of `--pods`.
const ROUNDS: usize = 10;
pub const CONNECTS_PER_POD: usize = 4;
/// Untimed connections before each turn's: the first of a new process
/// pays for its start and the neighbour lookup.
const WARM_UP: usize = 5;

const NETWORK: &str = "policy-path";
const BRIDGE: &str = "polpath0";
const SUBNET: &str = "10.75.0.0/24";
const PORT: u16 = 5432;
const QUEUE: u16 = 100;
const SYSCTLS: [&str; 2] = ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables"];
/// The table that switches conntrack on and judges nothing.
const CONNTRACK_TABLE: &str = "cni-bench-conntrack";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Off,
    On,
    Conntrack,
    Ours,
    Nfqueue,
}

const VARIANTS: [Variant; 5] = [
    Variant::Off,
    Variant::On,
    Variant::Conntrack,
    Variant::Ours,
    Variant::Nfqueue,
];

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Off => "br_netfilter off",
            Variant::On => "br_netfilter on, no rules",
            Variant::Conntrack => "conntrack on, no policy",
            Variant::Ours => "in-kernel verdict (ours)",
            Variant::Nfqueue => "NFQUEUE round trip",
        }
    }

    /// Whether conntrack tracks the node's forwarded connections.
    fn tracks(self) -> bool {
        !matches!(self, Variant::Off | Variant::On)
    }
}

/// Variant 3's table: the first rule of our forward chain, at our hook
/// and priority, and nothing after it.
fn conntrack_table() -> String {
    format!(
        "table inet {CONNTRACK_TABLE} {{\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tct state established,related accept\n\
         \t}}\n\
         }}\n"
    )
}

/// `iptables verb` with the NFQUEUE rule (see
/// [`crate::nfqueue::forward_rule`]), in the node.
fn queue_rule(node: &Node, iptables: &str, verb: &str) -> test_kit::Run {
    let rule = crate::nfqueue::forward_rule(&[], &QUEUE.to_string());
    let args: Vec<&str> = std::iter::once(verb)
        .chain(rule.iter().map(String::as_str))
        .collect();
    node.run(iptables, &args)
}

/// A process of this bench started in a namespace, reading its stdin
/// until the bench closes it (or dies); killed on drop.
pub(crate) struct Helper {
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Helper {
    /// `cni-bench args` in `netns`, once it said `started`.
    pub(crate) fn start(what: &str, netns: &Path, args: &[&str], started: &str) -> Result<Helper, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = test_kit::spawn_in_open(netns, &exe, args, &[]);
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{what} has no stdout"));
        };
        let mut helper = Helper {
            child,
            stdout: BufReader::new(stdout),
        };
        let mut line = String::new();
        let _ = helper.stdout.read_line(&mut line);
        if line.trim() == started {
            Ok(helper)
        } else {
            let _ = helper.child.kill();
            Err(format!("{what} did not start: {line}{}", helper.stop()))
        }
    }

    /// Closes its stdin, its signal to stop, and returns what it printed
    /// after starting, both streams.
    fn stop(&mut self) -> String {
        drop(self.child.stdin.take());
        let mut printed = String::new();
        let _ = self.stdout.read_to_string(&mut printed);
        if let Some(mut stderr) = self.child.stderr.take() {
            let _ = stderr.read_to_string(&mut printed);
        }
        let _ = self.child.wait();
        printed
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The node, its bridge and the two pods on it, deleted through the
/// plugins on drop (the namespaces by theirs).
struct Bed {
    node: Node,
    client: Netns,
    server: Netns,
    views: Vec<PodView>,
}

impl Bed {
    fn new() -> Bed {
        let node = Node::new();
        let list = json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [{
            "type": "bridge", "bridge": BRIDGE, "isGateway": true,
            "ipam": {"type": "host-local", "socket": "", "ranges": [[{"subnet": SUBNET}]],
                     "dataDir": node.path("ipam").to_str().expect("UTF-8")}}]});
        node.write_conf("10-policy-path.conflist", &list);
        let client = node.pod("polclient");
        let server = node.pod("polserver");
        let views = [("client", &client), ("server", &server)]
            .iter()
            .map(|(app, ns)| {
                let result = node
                    .cnictl(&["--json", "add", NETWORK, ns.path_str()])
                    .success()
                    .json();
                let ips = result["ips"]
                    .as_array()
                    .expect("ips")
                    .iter()
                    .filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok())
                    .collect();
                PodView {
                    namespace: "bench".into(),
                    name: (*app).into(),
                    node: Some("n1".into()),
                    labels: [("app".to_owned(), (*app).to_owned())].into(),
                    ips,
                    ports: vec![],
                }
            })
            .collect();
        Bed {
            node,
            client,
            server,
            views,
        }
    }

    fn server_address(&self) -> Ipv4Addr {
        self.views[1]
            .ips
            .iter()
            .find_map(|ip| match ip {
                IpAddr::V4(v4) => Some(*v4),
                IpAddr::V6(_) => None,
            })
            .expect("the server's IPv4 address")
    }

    /// The agent's table for a policy selecting the server and allowing
    /// the client on the port, compiled as the agent compiles it.
    fn compiled(&self) -> netpol::Compiled {
        let app = |name: &str| Selector::labels(&[("app", name)]);
        let policy = Policy {
            namespace: "bench".into(),
            name: "server-from-client".into(),
            pod_selector: app("server"),
            ingress: Some(vec![Rule {
                peers: Some(vec![Peer::Pods {
                    pods: Some(app("client")),
                    namespaces: None,
                }]),
                ports: vec![PortSpec::Range(Protocol::Tcp, PORT, PORT)],
            }]),
            egress: None,
        };
        let snapshot = netpol::Snapshot {
            pods: self.views.clone(),
            namespaces: vec![],
            policies: vec![policy],
        };
        netpol::compile(&snapshot, "n1")
    }

    /// Runs `f` in the node's namespace, through the RAII helper.
    fn on_node<T>(&self, f: impl FnOnce() -> T) -> T {
        netns::NetNs::open(self.node.netns.path())
            .expect("the node's namespace")
            .run(f)
            .expect("enter the node's namespace")
    }

    /// Sets both sysctls in the node and reads them back there.
    fn br_netfilter(&self, on: bool) -> Result<(), String> {
        let value = if on { "1" } else { "0" };
        for name in SYSCTLS {
            self.node
                .run("sysctl", &["-qw", &format!("net.bridge.{name}={value}")])
                .success();
            let path = format!("/proc/sys/net/bridge/{name}");
            let read = self.node.run("cat", &[&path]).success().stdout;
            if read.trim() != value {
                return Err(format!(
                    "{name} in the node reads {} after writing {value}",
                    read.trim()
                ));
            }
        }
        Ok(())
    }

    /// The node's nftables tables, one line each (iptables-nft's too).
    fn tables(&self) -> Vec<String> {
        let listed = self.node.run("nft", &["list", "tables"]).success().stdout;
        listed
            .lines()
            .map(str::to_owned)
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// Makes the node what `variant` measures, and checks it is.
    fn enter(&self, variant: Variant, compiled: &netpol::Compiled, iptables: &str) -> Result<(), String> {
        self.br_netfilter(variant != Variant::Off)?;
        match variant {
            Variant::Off | Variant::On => {}
            Variant::Conntrack => {
                let script = conntrack_table();
                let added = test_kit::run_in(
                    self.node.netns.path(),
                    Path::new("nft"),
                    &["-f", "-"],
                    &[],
                    &script,
                );
                if !added.ok() {
                    return Err(format!("nft -f: {}", added.stderr.trim()));
                }
            }
            Variant::Ours => {
                self.on_node(|| netpol::apply(compiled))
                    .map_err(|e| format!("applying the table: {e}"))?;
                let table = self
                    .node
                    .run("nft", &["list", "table", "inet", netpol::TABLE])
                    .success()
                    .stdout;
                let server = self.server_address().to_string();
                if !table.contains(&server) {
                    return Err(format!("the table does not name the server {server}:\n{table}"));
                }
            }
            Variant::Nfqueue => {
                let added = queue_rule(&self.node, iptables, "-A");
                if !added.ok() {
                    return Err(format!("{iptables} -A (NFQUEUE): {}", added.stderr.trim()));
                }
            }
        }
        let tables = self.tables();
        let expected = match variant {
            Variant::Off | Variant::On => vec![],
            Variant::Conntrack => vec![format!("table inet {CONNTRACK_TABLE}")],
            Variant::Ours => vec![format!("table inet {}", netpol::TABLE)],
            Variant::Nfqueue if iptables == "iptables" => vec!["table ip filter".to_owned()],
            Variant::Nfqueue => vec![],
        };
        if tables != expected {
            return Err(format!(
                "{}: the node holds {tables:?}, not {expected:?}",
                variant.label()
            ));
        }
        Ok(())
    }

    /// Empties the node's conntrack table, so a turn finds none of the
    /// turns' before it.
    fn forget_connections(&self) -> Result<(), String> {
        let flushed = self.node.run("conntrack", &["-F"]);
        if flushed.ok() {
            Ok(())
        } else {
            Err(format!("conntrack -F in the node: {}", flushed.stderr.trim()))
        }
    }

    /// The node's conntrack entries now (`nf_conntrack_count`).
    fn conntrack_entries(&self) -> Result<usize, String> {
        let read = self
            .node
            .run("cat", &["/proc/sys/net/netfilter/nf_conntrack_count"]);
        read.stdout
            .trim()
            .parse()
            .map_err(|_| format!("nf_conntrack_count in the node: {read:?}"))
    }

    /// Takes away what [`Bed::enter`] added.
    fn leave(&self, variant: Variant, iptables: &str) -> Result<(), String> {
        match variant {
            Variant::Off | Variant::On => Ok(()),
            Variant::Conntrack => {
                let deleted = self
                    .node
                    .run("nft", &["delete", "table", "inet", CONNTRACK_TABLE]);
                if deleted.ok() {
                    Ok(())
                } else {
                    Err(format!("removing the conntrack table: {}", deleted.stderr.trim()))
                }
            }
            Variant::Ours => self
                .on_node(netpol::remove)
                .map_err(|e| format!("removing the table: {e}")),
            Variant::Nfqueue => {
                queue_rule(&self.node, iptables, "-D").success();
                // iptables-nft leaves its table and an empty FORWARD base
                // chain, which every other variant's packets would walk.
                if iptables == "iptables" {
                    self.node
                        .run("nft", &["delete", "table", "ip", "filter"])
                        .success();
                }
                Ok(())
            }
        }
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        for ns in [&self.client, &self.server] {
            let _ = self.node.cnictl(&["del", NETWORK, ns.path_str()]);
        }
    }
}

/// `cni-bench --accept ADDRESS:PORT`: accepts connections and closes
/// them until its stdin closes (the bench stopping it, or gone); says
/// `ready` once listening.
pub fn accept_loop(address: &str) -> Result<(), String> {
    let listener = std::net::TcpListener::bind(address).map_err(|e| format!("{address}: {e}"))?;
    // std listens with a queue of 128: at tens of µs a connection, the
    // client fills it while this process waits for a CPU a few ms, and a
    // SYN dropped for it costs its connection a 1 s retransmission. A
    // second listen(2) raises it (to the namespace's somaxconn at most).
    nix::sys::socket::listen(&listener, nix::sys::socket::Backlog::MAXCONN)
        .map_err(|e| format!("listen: {e}"))?;
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    writeln!(std::io::stdout().lock(), "ready").map_err(|e| e.to_string())?;
    loop {
        // A failed accept (the client gone first) is the client's business.
        if let Ok((stream, _)) = listener.accept() {
            drop(stream);
        }
    }
}

/// The iptables that takes an NFQUEUE rule here: the nft-based frontend,
/// else the legacy one; Err with what each said.
fn queue_frontend(bed: &Bed) -> Result<&'static str, String> {
    let mut errors = Vec::new();
    for iptables in ["iptables", "iptables-legacy"] {
        let added = queue_rule(&bed.node, iptables, "-A");
        if added.ok() {
            let _ = bed.leave(Variant::Nfqueue, iptables);
            return Ok(iptables);
        }
        errors.push(format!("{iptables}: {}", added.stderr.trim()));
    }
    Err(errors.join("; "))
}

/// SYNs `pod`'s kernel has sent again so far (`TcpExt: TCPSynRetrans`).
fn syn_retransmits(pod: &Netns) -> usize {
    let netstat = test_kit::run_in(pod.path(), Path::new("cat"), &["/proc/net/netstat"], &[], "").stdout;
    let mut tcp_ext = netstat.lines().filter(|l| l.starts_with("TcpExt:"));
    let (Some(names), Some(values)) = (tcp_ext.next(), tcp_ext.next()) else {
        return 0;
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(name, _)| *name == "TCPSynRetrans")
        .and_then(|(_, value)| value.parse().ok())
        .unwrap_or(0)
}

/// What the phase must leave as it found it in the machine's own
/// namespace: its br_netfilter sysctls and its nftables tables.
fn root_state() -> Vec<String> {
    let mut state: Vec<String> = SYSCTLS
        .iter()
        .map(|name| std::fs::read_to_string(format!("/proc/sys/net/bridge/{name}")).unwrap_or_default())
        .collect();
    state.push(test_kit::run("nft", &["list", "tables"]).stdout);
    state
}

/// [`ROUNDS`] rounds, each variant's turn `pods` × [`CONNECTS_PER_POD`]
/// timed connections; the figures of the repeat.
pub fn phase(out: &mut Outcome, pods: usize) {
    let root_before = root_state();
    let bed = Bed::new();
    measure(out, &bed, pods);
    drop(bed);
    let root_after = root_state();
    if root_after != root_before {
        out.problem(format!(
            "policy path: the machine's own namespace changed (br_netfilter sysctls, nft tables): \
             {root_before:?} → {root_after:?}"
        ));
    }
}

/// The rounds on `bed`, the checks of what they did, and the figures.
fn measure(out: &mut Outcome, bed: &Bed, pods: usize) {
    let compiled = bed.compiled();
    let iptables = match queue_frontend(bed) {
        Ok(iptables) => iptables,
        Err(e) => {
            return out.problem(format!("policy path: no iptables takes an NFQUEUE rule: {e}"));
        }
    };
    let target = format!("{}:{PORT}", bed.server_address());
    let mut listener = match Helper::start(
        "the listener",
        bed.server.path(),
        &["--accept", &format!("0.0.0.0:{PORT}")],
        "ready",
    ) {
        Ok(listener) => listener,
        Err(e) => return out.problem(format!("policy path: {e}")),
    };
    let mut reader = match Helper::start(
        "the NFQUEUE reader",
        bed.node.netns.path(),
        &["--nfqueue-reader", &QUEUE.to_string()],
        "bound",
    ) {
        Ok(reader) => reader,
        Err(e) => return out.problem(format!("policy path: {e}")),
    };
    let count = pods * CONNECTS_PER_POD;
    let mut times: [Vec<f64>; VARIANTS.len()] = Default::default();
    let mut queued = 0;
    let mut resent = 0;
    for round in 0..ROUNDS {
        for k in 0..VARIANTS.len() {
            let v = (round + k) % VARIANTS.len();
            let variant = VARIANTS[v];
            match turn(bed, variant, &compiled, iptables, &target, count) {
                Ok((ms, retransmitted)) => {
                    times[v].extend(ms);
                    if variant == Variant::Nfqueue {
                        queued += WARM_UP + count;
                        resent += retransmitted;
                    }
                }
                Err(e) => out.problem(format!("policy path ({}): {e}", variant.label())),
            }
        }
    }
    let said = reader.stop();
    let _ = listener.stop();
    let seen: Option<usize> = said
        .lines()
        .find_map(|l| l.strip_prefix("seen "))
        .and_then(|n| n.trim().parse().ok());
    eprintln!(
        "bench: policy path: the NFQUEUE reader accepted {seen:?} packets for {queued} connections \
         and {resent} SYNs sent again"
    );
    if seen != Some(queued + resent) {
        out.problem(format!(
            "policy path: the NFQUEUE reader answered {seen:?} packets for {queued} connections and \
             {resent} SYNs sent again, not one each: {}",
            said.trim()
        ));
    }
    record(out, &times);
}

/// One variant's turn: the node made what `variant` measures, `WARM_UP`
/// untimed and `count` timed connections, the node put back. The timed
/// connect times in µs, and the SYNs the client sent again.
fn turn(
    bed: &Bed,
    variant: Variant,
    compiled: &netpol::Compiled,
    iptables: &str,
    target: &str,
    count: usize,
) -> Result<(Vec<f64>, usize), String> {
    if let Err(e) = bed
        .enter(variant, compiled, iptables)
        .and_then(|()| bed.forget_connections())
    {
        let _ = bed.leave(variant, iptables);
        return Err(e);
    }
    let retransmitted_before = syn_retransmits(&bed.client);
    let timed = crate::connect::connect_times(&bed.client, target, WARM_UP + count);
    // A SYN sent again (its first one lost) is still conntrack NEW: it
    // goes to the queue again.
    let retransmitted = syn_retransmits(&bed.client).saturating_sub(retransmitted_before);
    // Closed connections stay in conntrack for minutes (TIME_WAIT):
    // every one of the turn's is still there if conntrack saw them, and
    // none if it was off.
    let tracked = bed.conntrack_entries();
    let left = bed.leave(variant, iptables);
    let ms = timed?;
    left?;
    if ms.len() != WARM_UP + count {
        return Err(format!("{} connect times of {}", ms.len(), WARM_UP + count));
    }
    let tracked = tracked?;
    let (as_meant, meant) = if variant.tracks() {
        (tracked >= WARM_UP + count, "on")
    } else {
        (tracked == 0, "off")
    };
    if !as_meant {
        return Err(format!(
            "{tracked} conntrack entries in the node after {} connections, conntrack meant {meant}",
            WARM_UP + count
        ));
    }
    Ok((ms[WARM_UP..].iter().map(|t| t * 1000.0).collect(), retransmitted))
}

fn record(out: &mut Outcome, times: &[Vec<f64>; VARIANTS.len()]) {
    let [off, on, conntrack, ours, nfqueue] = [0, 1, 2, 3, 4].map(|v| times[v].as_slice());
    if times.iter().any(Vec::is_empty) {
        return;
    }
    for (metric, numerator, denominator) in [
        (BR_NETFILTER_METRIC, on, off),
        (CONNTRACK_METRIC, conntrack, on),
        (OURS_CONNTRACK_METRIC, ours, conntrack),
        (NFQUEUE_CONNTRACK_METRIC, nfqueue, conntrack),
        (OURS_METRIC, ours, on),
        (NFQUEUE_METRIC, nfqueue, on),
        (OURS_OFF_METRIC, ours, off),
        (NFQUEUE_OFF_METRIC, nfqueue, off),
    ] {
        out.pool(metric, Side::Ours, numerator);
        out.pool(metric, Side::Reference, denominator);
    }
    let [off, on, conntrack, ours, nfqueue] = [off, on, conntrack, ours, nfqueue].map(median);
    out.record(ADDED_METRIC, Side::Ours, ours - on);
    out.record(ADDED_METRIC, Side::Reference, nfqueue - on);
    out.record(ADDED_VERDICT_METRIC, Side::Ours, ours - conntrack);
    out.record(ADDED_VERDICT_METRIC, Side::Reference, nfqueue - conntrack);
    out.record(ADDED_CONNTRACK_METRIC, Side::Ours, conntrack - on);
    out.record(ADDED_BR_NETFILTER_METRIC, Side::Ours, on - off);
}
