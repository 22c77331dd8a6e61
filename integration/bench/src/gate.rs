//! What the NetworkPolicy gate costs a new pod's ADD, and whether policy
//! elsewhere makes it cost more (`--only gate`). The node agent runs
//! against the API test server in a node's namespace, as the cluster tests
//! run it. A pod of namespace `quiet`, whose policy denies all ingress, is
//! added with cnictl through the agent's conflist (its bridge entry names
//! the gate: the ADD waits until the kernel holds the pod's isolation)
//! and, beside it in the same turns, through the same conflist without
//! `policySocket` (no gate: the floor). The turns hold 0, 1000 and 5000
//! ipBlock rules in namespace `noisy` (one policy selecting a pod there,
//! rule `i` admitting `10.<100+i/256>.<i%256>.0/24` but its `.7` on a TCP
//! port of its own), in an order that moves round by round.
//!
//! Each turn creates its policy and deletes it at its end, each change
//! timed until a probe from another pod to the noisy pod is dropped or let
//! in (the agent writes a change in one transaction) and until the agent's
//! pass over it is done (its pass counter moved: until then it answers no
//! ADD); a gated and an ungated ADD start [`BESIDE_DELAY`] after each
//! change, while the agent makes it. Before every other timed ADD the Pod
//! object is on the server and the agent has taken it in, as on a node
//! where the kubelet starts a sandbox well after both saw the Pod;
//! afterwards the pod is deleted, the object too, and the agent's pass
//! over that awaited. An ADD's CPU is its processes' and the agent's over
//! the call.
//!
//! The phase fails when one of those other gated ADDs is not confirmed
//! (the agent's `enforced` answers do not grow by one, or the plugins say
//! "not confirmed"), when a connection made right after a gated ADD is not
//! dropped or one after an ungated ADD is not let in (the probe could not
//! tell), or when a call fails or leaves a veth. An ADD beside a change
//! that is not confirmed is what its row counts, not a failure.
//!
//! Everything is in the node's and the pods' namespaces and the node's
//! directory, removed when the phase ends, fails, or is stopped by SIGTERM
//! or SIGINT ([`crate::stop::stopping`], looked at before each step).

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use netns::NetNs;
use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{
    agent_env, block_rules_policy, free_port, host_bin, host_conflist, lab_node, node_object, probe, ready,
    uplink,
};
use test_kit::{Netns, Node};

use crate::measure::{Call, exec, ms, process_cpu};
use crate::outcome::Outcome;
use crate::policy_path::Helper;
use crate::setup::Side;
use crate::stop::stopping;

/// The phase's name for `--only`.
pub const PHASE: &str = "gate";

/// What every row of the phase starts with.
pub const PREFIX: &str = "gate";

/// What the rows of its ADDs start with: made alone, and made while the
/// agent changes the other namespace's policy.
pub const ADD_PREFIX: &str = "gate ADD,";
pub const BESIDE_PREFIX: &str = "gate ADD started";

/// The rule counts of namespace `noisy`, one turn each per round.
pub const RULE_COUNTS: [usize; 3] = [0, 1000, 5000];

/// Rounds per repeat.
const ROUNDS: usize = 2;

/// Gated ADDs (and as many ungated) per turn, at most; fewer with fewer
/// `--pods`.
const MAX_ADDS_PER_TURN: usize = 10;

const TOKEN: &str = "gate-bench-token";
const NODE: &str = "n1";
/// Where the probes' listeners are.
const PORT: u16 = 5432;
/// A probe's connect that has no answer by then was dropped: a connect
/// between pods of one bridge takes well under a millisecond. Waiting for
/// a pod to be let in, each probe still dropped costs this much, so those
/// wait less (a slow answer then only costs another probe).
const PROBE_WAIT: Duration = Duration::from_millis(50);
const LET_IN_PROBE_WAIT: Duration = Duration::from_millis(20);
/// The longest the agent may take to start, to take a Pod in, or to write
/// or lift a policy, before the phase gives up.
const AGENT_LIMIT: Duration = Duration::from_secs(30);
const WRITE_LIMIT: Duration = Duration::from_secs(180);

/// How long after a change of the noisy policy the ADD beside it starts:
/// the agent gathers changes for 50 ms before its pass, so by then it is
/// over the change (an ADD sooner could be answered by a pass of its own
/// before the change's).
const BESIDE_DELAY: Duration = Duration::from_millis(100);

const APPLIED: &str = "cni_suite_policy_syncs_total{result=\"success\"}";
const ENFORCED: &str = "cni_suite_policy_admissions_total{answer=\"enforced\"}";

/// Per-call: the gated ADD (ours) against the ungated one (the
/// reference's column).
pub fn add_metric(rules: usize) -> String {
    format!("{ADD_PREFIX} {rules} ipBlock rules in another namespace")
}

/// A change of the noisy policy: its create (the rules written) or its
/// delete (lifted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Written,
    Lifted,
}

pub const CHANGES: [Change; 2] = [Change::Written, Change::Lifted];

impl Change {
    fn label(self) -> &'static str {
        match self {
            Change::Written => "written",
            Change::Lifted => "lifted",
        }
    }

    /// What the probe sees once the kernel holds the change.
    fn probe_sees(self) -> &'static str {
        match self {
            Change::Written => "policy created → probe dropped",
            Change::Lifted => "policy deleted → probe let in",
        }
    }
}

/// The change as a probe from another pod sees it.
pub fn change_metric(change: Change, rules: usize) -> String {
    format!(
        "{PREFIX}: {rules} ipBlock rules {} ({})",
        change.label(),
        change.probe_sees()
    )
}

/// The change until the agent's pass over it is done (its pass counter
/// moved): until then it makes no other change, and answers no ADD.
pub fn change_pass_metric(change: Change, rules: usize) -> String {
    format!(
        "{PREFIX}: {rules} ipBlock rules {} (until the agent's pass is done)",
        change.label()
    )
}

/// Per call: a gated ADD started while the agent makes the change (ours),
/// beside an ungated one started with it (the reference's column).
pub fn beside_metric(change: Change, rules: usize) -> String {
    format!(
        "{BESIDE_PREFIX} {} ms after another namespace's {rules} ipBlock rules are {}",
        BESIDE_DELAY.as_millis(),
        change.label()
    )
}

/// Once per repeat: the gated ADDs of [`beside_metric`] not confirmed.
pub fn unconfirmed_metric(change: Change, rules: usize) -> String {
    format!(
        "{PREFIX}: gated ADDs not confirmed per repeat, of {ROUNDS} started {} ms after {rules} ipBlock rules \
         are {}",
        BESIDE_DELAY.as_millis(),
        change.label()
    )
}

/// Once per repeat: the largest table change (ops) the agent logged while
/// a gated ADD waited.
pub fn waited_ops_metric(rules: usize) -> String {
    format!("{PREFIX}: largest table change a gated ADD waited on (ops), {rules} ipBlock rules")
}

/// Once per repeat: the ops of the transaction that wrote the policy.
pub fn written_ops_metric(rules: usize) -> String {
    format!("{PREFIX}: table change writing {rules} ipBlock rules (ops)")
}

/// The agent, its log kept line by line as it writes it (a pipe left
/// unread would stop it once full).
struct GateAgent {
    child: Child,
    health: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl GateAgent {
    fn start(node: &Node, server: &ApiServer) -> GateAgent {
        let health = free_port(node);
        let env = agent_env(
            node,
            NODE,
            server,
            "127.0.0.1",
            TOKEN,
            health,
            &[("NETWORK_POLICY", "true")],
        );
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut child =
            test_kit::spawn_in(node.netns.path(), &test_kit::bin("cni-node-agent"), &[], &env, "");
        drop(child.stdout.take());
        let log = Arc::new(Mutex::new(Vec::new()));
        if let Some(stderr) = child.stderr.take() {
            let keeping = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    keeping.lock().unwrap_or_else(PoisonError::into_inner).push(line);
                }
            });
        }
        GateAgent { child, health, log }
    }

    /// One sample of its `/metrics`.
    fn metric(&self, node: &Node, series: &str) -> Option<f64> {
        let (code, body) = probe(node, self.health, "/metrics")?;
        if code != 200 {
            return None;
        }
        body.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    fn cpu(&self) -> Duration {
        process_cpu(self.child.id())
    }

    /// The ops of each table change it logged between `from` and `to`
    /// (its lines' UTC timestamps, which sort as text).
    fn table_changes(&self, from: &str, to: &str) -> Vec<usize> {
        let log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        log.iter()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|line| {
                let time = line["time"].as_str().unwrap_or_default();
                from <= time && time <= to
            })
            .filter_map(|line| {
                let ops = line["msg"]
                    .as_str()?
                    .strip_prefix("NetworkPolicy: the table changed (")?;
                ops.strip_suffix(" ops)")?.parse().ok()
            })
            .collect()
    }

    /// Its last lines, for a problem's text.
    fn last_lines(&self) -> String {
        let log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        log[log.len().saturating_sub(10)..].join("\n")
    }
}

impl Drop for GateAgent {
    /// Stopped as the kubelet stops it (SIGTERM), killed if it lingers.
    fn drop(&mut self) {
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: kill(2) on the pid of our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The node, its agent and API server, and the agent's conflist twice: as
/// the agent wrote it and less `policySocket`.
struct Bed {
    agent: GateAgent,
    server: ApiServer,
    node_ns: NetNs,
    network: String,
    /// The agent's conf directory, and one with its conflist less
    /// `policySocket`.
    gated_dir: PathBuf,
    open_dir: PathBuf,
    node: Node,
}

/// `quiet` denies all ingress to its pods.
fn deny_ingress() -> Value {
    json!({
        "metadata": {"name": "deny-ingress", "namespace": "quiet"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    })
}

/// A Pod object bound to the node, labelled `app: <app>`, its status
/// holding `ip` if given.
fn pod_object(namespace: &str, name: &str, app: &str, ip: Option<IpAddr>) -> Value {
    let status = match ip {
        Some(ip) => json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}),
        None => json!({"phase": "Pending"}),
    };
    json!({
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{namespace}-{name}"),
                     "labels": {"app": app}},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "x"}]},
        "status": status,
    })
}

/// The first address of an ADD's result.
fn first_address(result: &str) -> Option<IpAddr> {
    let result: Value = serde_json::from_str(result).ok()?;
    result["ips"][0]["address"]
        .as_str()?
        .split('/')
        .next()?
        .parse()
        .ok()
}

/// Until `done` says yes or `limit` passes (an error then), or the run is
/// stopped.
fn wait(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> Result<(), String> {
    let started = Instant::now();
    while !done() {
        if stopping() {
            return Err("stopped".into());
        }
        if started.elapsed() > limit {
            return Err(format!("no {what} in {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

impl Bed {
    fn new() -> Result<Bed, String> {
        let node = lab_node();
        uplink(&node);
        let node_ns = NetNs::open(node.netns.path()).map_err(|e| format!("the node's namespace: {e}"))?;
        let server = ApiServer::start(node.netns.path(), TOKEN);
        server.apply_node(node_object(NODE, &["10.244.1.0/24"], &["10.250.0.11"]));
        for namespace in ["noisy", "quiet", "lobby"] {
            server.apply_namespace(json!({"metadata": {"name": namespace, "labels": {"team": namespace}}}));
        }
        server.apply_network_policy(deny_ingress());
        let agent = GateAgent::start(&node, &server);
        wait("readiness", AGENT_LIMIT, || ready(&node, agent.health))
            .and_then(|()| {
                wait("first pass", AGENT_LIMIT, || {
                    agent.metric(&node, APPLIED).is_some_and(|n| n >= 1.0)
                })
            })
            .map_err(|e| format!("the agent: {e}: {}", agent.last_lines()))?;

        let file = host_conflist(&node);
        let text = std::fs::read_to_string(&file).map_err(|e| format!("the agent's conflist: {e}"))?;
        let mut conflist: Value =
            serde_json::from_str(&text).map_err(|e| format!("the agent's conflist: {e}"))?;
        let network = conflist["name"].as_str().unwrap_or_default().to_owned();
        let mut gated = false;
        for plugin in conflist["plugins"].as_array_mut().into_iter().flatten() {
            gated |= plugin
                .as_object_mut()
                .and_then(|p| p.remove(cni::conf::POLICY_SOCKET_KEY))
                .is_some();
        }
        if !gated {
            return Err(format!("the agent's conflist names no gate: {text}"));
        }
        let open_dir = node.path("net.d-open");
        std::fs::create_dir_all(&open_dir).map_err(|e| e.to_string())?;
        std::fs::write(
            open_dir.join(file.file_name().unwrap_or_default()),
            conflist.to_string(),
        )
        .map_err(|e| e.to_string())?;
        Ok(Bed {
            agent,
            server,
            node_ns,
            network,
            gated_dir: node.conf_dir(),
            open_dir,
            node,
        })
    }

    /// `cnictl --json VERB` of the bed's network for `netns`, with the
    /// conflist of `conf_dir` and the arguments a kubelet's runtime passes.
    fn cnictl(&self, conf_dir: &Path, verb: &str, netns: &Netns, namespace: &str, name: &str) -> Call {
        let cache = self.node.cache_dir();
        let bins = host_bin(&self.node);
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}");
        let env = [
            ("NETCONFPATH", conf_dir.to_str().unwrap_or_default()),
            ("CNI_PATH", bins.to_str().unwrap_or_default()),
            ("CNI_ARGS", args.as_str()),
        ];
        let cli = [
            "--cache-dir",
            cache.to_str().unwrap_or_default(),
            "--json",
            verb,
            &self.network,
            netns.path_str(),
        ];
        exec(&self.node_ns, &test_kit::bin("cnictl"), &cli, &env, "")
    }

    /// A pod named `name` in `namespace`, added through the conflist of
    /// `conf_dir`: the ADD, and the pod when it succeeded.
    fn add<'a>(
        &'a self,
        conf_dir: &'a Path,
        namespace: &'static str,
        name: &str,
    ) -> (Call, Option<Added<'a>>) {
        let netns = Netns::new("gate");
        let call = self.cnictl(conf_dir, "add", &netns, namespace, name);
        let ip = first_address(&call.stdout).filter(|_| call.ok);
        let added = ip.map(|ip| Added {
            bed: self,
            conf_dir,
            netns,
            namespace,
            name: name.to_owned(),
            ip,
            deleted: false,
        });
        (call, added)
    }

    /// [`Bed::add`] untimed, the Pod object first and its status after,
    /// as a kubelet's; an error when it fails.
    fn add_running(&self, namespace: &'static str, name: &str) -> Result<Added<'_>, String> {
        self.server
            .add_pod(namespace, name, pod_object(namespace, name, name, None));
        let (call, added) = self.add(&self.gated_dir, namespace, name);
        let added = added.ok_or_else(|| format!("the {name} pod's ADD: {}{}", call.stdout, call.stderr))?;
        self.server
            .add_pod(namespace, name, pod_object(namespace, name, name, Some(added.ip)));
        Ok(added)
    }

    fn passes(&self) -> f64 {
        self.agent.metric(&self.node, APPLIED).unwrap_or_default()
    }

    /// Until the agent's pass counter moved beyond `before`.
    fn pass_after(&self, before: f64) -> Result<(), String> {
        wait("pass of the agent", AGENT_LIMIT, || self.passes() > before)
    }
}

/// A pod of the bed, deleted through its conflist when dropped.
struct Added<'a> {
    bed: &'a Bed,
    conf_dir: &'a Path,
    netns: Netns,
    namespace: &'static str,
    name: String,
    ip: IpAddr,
    deleted: bool,
}

impl Added<'_> {
    /// The DEL, now.
    fn delete(mut self) -> Call {
        self.deleted = true;
        self.bed
            .cnictl(self.conf_dir, "del", &self.netns, self.namespace, &self.name)
    }
}

impl Drop for Added<'_> {
    fn drop(&mut self) {
        if !self.deleted {
            let _ = self
                .bed
                .cnictl(self.conf_dir, "del", &self.netns, self.namespace, &self.name);
        }
    }
}

/// The client pod, which probes, and the noisy pod, which the rules
/// select, with a listener.
struct Probes<'a> {
    client: Added<'a>,
    noisy: Added<'a>,
    _listener: Helper,
}

impl<'a> Probes<'a> {
    fn new(bed: &'a Bed) -> Result<Probes<'a>, String> {
        let client = bed.add_running("lobby", "client")?;
        let noisy = bed.add_running("noisy", "noisy")?;
        let listener = Helper::start(
            "the noisy pod's listener",
            noisy.netns.path(),
            &["--accept", &format!("0.0.0.0:{PORT}")],
            "ready",
        )?;
        let probes = Probes {
            client,
            noisy,
            _listener: listener,
        };
        if !probes.lets_in(probes.noisy.ip, PROBE_WAIT)? {
            return Err("the noisy pod drops a connection before any policy selects it".into());
        }
        Ok(probes)
    }

    /// Whether a connection from the client to `ip`'s listener is let in
    /// within `wait` (false: dropped); an error when it is refused (no
    /// listener).
    fn lets_in(&self, ip: IpAddr, wait: Duration) -> Result<bool, String> {
        let target = SocketAddr::new(ip, PORT);
        let connected = NetNs::open(self.client.netns.path())
            .and_then(|ns| ns.run(|| TcpStream::connect_timeout(&target, wait)))
            .map_err(|e| format!("the client's namespace: {e}"))?;
        match connected {
            Ok(_) => Ok(true),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(format!("connecting to {target}: {e}")),
        }
    }

    /// Probes the noisy pod until two probes in a row are `let_in` or not:
    /// when the first of them started.
    fn noisy_until(&self, let_in: bool, limit: Duration) -> Result<Instant, String> {
        let started = Instant::now();
        let mut first = None;
        loop {
            if stopping() {
                return Err("stopped".into());
            }
            if started.elapsed() > limit {
                let state = if let_in { "open" } else { "isolated" };
                return Err(format!("the noisy pod not {state} in {limit:?}"));
            }
            let at = Instant::now();
            let wait = if let_in { LET_IN_PROBE_WAIT } else { PROBE_WAIT };
            if self.lets_in(self.noisy.ip, wait)? == let_in {
                match first {
                    Some(first) => return Ok(first),
                    None => first = Some(at),
                }
            } else {
                first = None;
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// What a repeat's turns measured, by rule count.
#[derive(Default)]
struct Measured {
    gated: Vec<Call>,
    open: Vec<Call>,
    /// By [`CHANGES`]: the probe's times, the agent's passes' times, the
    /// ADDs beside the changes, and how many of those were not confirmed.
    seen: [Vec<f64>; 2],
    passed: [Vec<f64>; 2],
    beside: [Vec<Call>; 2],
    beside_open: [Vec<Call>; 2],
    unconfirmed: [usize; 2],
    waited_ops: usize,
    written_ops: usize,
}

/// [`ROUNDS`] rounds of a turn per rule count, each turn `pods` (at most
/// [`MAX_ADDS_PER_TURN`]) gated ADDs and as many ungated, taking turns.
pub fn phase(out: &mut Outcome, pods: usize) {
    let bed = match Bed::new() {
        Ok(bed) => bed,
        Err(e) => return out.problem(format!("gate: {e}")),
    };
    let mut measured: Vec<Measured> = RULE_COUNTS.iter().map(|_| Measured::default()).collect();
    if let Err(e) = rounds(out, &bed, pods.clamp(1, MAX_ADDS_PER_TURN), &mut measured)
        && !stopping()
    {
        out.problem(format!("gate: {e}"));
    }
    drop(bed);
    for (rules, measured) in RULE_COUNTS.into_iter().zip(&measured) {
        let metric = add_metric(rules);
        out.sample(&metric, Side::Ours, &measured.gated, Duration::ZERO);
        out.sample(&metric, Side::Reference, &measured.open, Duration::ZERO);
        out.record(&waited_ops_metric(rules), Side::Ours, measured.waited_ops as f64);
        if rules == 0 {
            continue;
        }
        out.record(
            &written_ops_metric(rules),
            Side::Ours,
            measured.written_ops as f64,
        );
        for (c, change) in CHANGES.into_iter().enumerate() {
            out.pool(&change_metric(change, rules), Side::Ours, &measured.seen[c]);
            out.pool(
                &change_pass_metric(change, rules),
                Side::Ours,
                &measured.passed[c],
            );
            let beside = &measured.beside[c];
            out.sample(&beside_metric(change, rules), Side::Ours, beside, Duration::ZERO);
            let beside_open = &measured.beside_open[c];
            out.sample(
                &beside_metric(change, rules),
                Side::Reference,
                beside_open,
                Duration::ZERO,
            );
            let unconfirmed = measured.unconfirmed[c] as f64;
            out.record(&unconfirmed_metric(change, rules), Side::Ours, unconfirmed);
        }
    }
}

/// The rounds on `bed`, and the check that their pods left no veth.
fn rounds(out: &mut Outcome, bed: &Bed, per_turn: usize, measured: &mut [Measured]) -> Result<(), String> {
    let probes = Probes::new(bed)?;
    let veths = bed.node.veths().len();
    let mut sequence = 0;
    for round in 0..ROUNDS {
        for k in 0..RULE_COUNTS.len() {
            let size = (round + k) % RULE_COUNTS.len();
            let rules = RULE_COUNTS[size];
            let turn = Turn {
                bed,
                probes: &probes,
                rules,
                round,
            };
            turn.run(out, per_turn, &mut sequence, &mut measured[size])
                .map_err(|e| format!("{rules} rules: {e}"))?;
        }
    }
    let left = bed.node.veths().len().saturating_sub(veths);
    if left > 0 {
        return Err(format!("{left} veths left of the ADDs"));
    }
    Ok(())
}

/// One turn: the noisy policy of `rules` written (none at 0), the ADDs,
/// the policy lifted.
struct Turn<'a> {
    bed: &'a Bed,
    probes: &'a Probes<'a>,
    rules: usize,
    round: usize,
}

impl Turn<'_> {
    fn run(
        &self,
        out: &mut Outcome,
        adds: usize,
        sequence: &mut usize,
        measured: &mut Measured,
    ) -> Result<(), String> {
        if self.rules > 0 {
            let from = cni::log::utc_timestamp(SystemTime::now());
            *sequence += 1;
            self.beside_change(Change::Written, *sequence, measured)?;
            let to = cni::log::utc_timestamp(SystemTime::now());
            let ops = self.bed.agent.table_changes(&from, &to).into_iter().max();
            measured.written_ops = measured.written_ops.max(ops.unwrap_or(0));
        }
        for i in 0..adds {
            let gated_first = (self.round + i).is_multiple_of(2);
            for gated in [gated_first, !gated_first] {
                *sequence += 1;
                let call = self.one_add(out, gated, *sequence, measured)?;
                if gated {
                    measured.gated.push(call);
                } else {
                    measured.open.push(call);
                }
            }
        }
        if self.rules > 0 {
            *sequence += 1;
            self.beside_change(Change::Lifted, *sequence, measured)?;
        }
        Ok(())
    }

    /// The noisy policy created or deleted and, [`BESIDE_DELAY`] later, a
    /// gated ADD of a pod of `quiet` whose object the agent has taken in;
    /// timed until the probe sees the change and until the agent's pass
    /// over it is done.
    fn beside_change(&self, change: Change, sequence: usize, measured: &mut Measured) -> Result<(), String> {
        if stopping() {
            return Err("stopped".into());
        }
        let (bed, rules) = (self.bed, self.rules);
        let names = [true, false].map(|gated| {
            let kind = if gated { "gated" } else { "open" };
            format!("beside-{}-{kind}-{sequence}", change.label())
        });
        let before = bed.passes();
        for name in &names {
            bed.server
                .add_pod("quiet", name, pod_object("quiet", name, "new", None));
        }
        bed.pass_after(before)?;
        let enforced = bed.agent.metric(&bed.node, ENFORCED);
        let before = bed.passes();
        let changed = Instant::now();
        match change {
            Change::Written => bed
                .server
                .apply_network_policy(block_rules_policy("noisy", "blocks", "noisy", rules)),
            Change::Lifted => bed.server.delete_network_policy("noisy", "blocks"),
        }
        let (adds, seen, passed) = std::thread::scope(|scope| {
            let adds = [(&bed.gated_dir, &names[0]), (&bed.open_dir, &names[1])].map(|(dir, name)| {
                scope.spawn(move || {
                    std::thread::sleep(BESIDE_DELAY);
                    bed.add(dir, "quiet", name)
                })
            });
            let passed = scope.spawn(|| {
                wait("pass of the agent", WRITE_LIMIT, || bed.passes() > before).map(|()| Instant::now())
            });
            let seen = self.probes.noisy_until(change == Change::Lifted, WRITE_LIMIT);
            let passed = passed
                .join()
                .unwrap_or_else(|_| Err("the pass's watcher panicked".into()));
            (adds.map(|add| add.join().expect("an ADD's thread")), seen, passed)
        });
        let (seen, passed) = (
            ms(seen?.duration_since(changed)),
            ms(passed?.duration_since(changed)),
        );
        let [(gated, gated_pod), (open, open_pod)] = adds;
        let confirmed = gated.ok
            && !gated.stderr.contains("not confirmed")
            && bed.agent.metric(&bed.node, ENFORCED) == enforced.map(|n| n + 1.0);
        eprintln!(
            "bench: gate: {rules} ipBlock rules {}: probe {seen:.1} ms, the agent's pass {passed:.1} ms; \
             ADDs beside it {:.1} ms{}, without the gate {:.1} ms",
            change.label(),
            ms(gated.wall),
            if confirmed { "" } else { " (not confirmed)" },
            ms(open.wall),
        );
        let c = CHANGES.iter().position(|c| *c == change).unwrap_or_default();
        measured.seen[c].push(seen);
        measured.passed[c].push(passed);
        measured.unconfirmed[c] += usize::from(!confirmed);
        measured.beside[c].push(gated);
        if !open.ok {
            return Err(format!(
                "the ungated ADD beside it: {}{}",
                open.stdout, open.stderr
            ));
        }
        measured.beside_open[c].push(open);
        // Not confirmed in a namespace with a policy, the gated ADD failed
        // and was undone; the pods that started go now.
        for added in [gated_pod, open_pod].into_iter().flatten() {
            let del = added.delete();
            if !del.ok {
                return Err(format!("a DEL beside it: {}{}", del.stdout, del.stderr));
            }
        }
        let before = bed.passes();
        for name in &names {
            bed.server.delete_pod("quiet", name);
        }
        bed.pass_after(before)
    }

    /// A pod of `quiet` added through the gated conflist or the open one
    /// and timed, a connection to it made right after, then the pod
    /// deleted with its object, each awaited by the agent.
    fn one_add(
        &self,
        out: &mut Outcome,
        gated: bool,
        sequence: usize,
        measured: &mut Measured,
    ) -> Result<Call, String> {
        if stopping() {
            return Err("stopped".into());
        }
        let bed = self.bed;
        let name = format!("{}-{sequence}", if gated { "gated" } else { "open" });
        let before = bed.passes();
        bed.server
            .add_pod("quiet", &name, pod_object("quiet", &name, "new", None));
        bed.pass_after(before)?;
        let dir = if gated { &bed.gated_dir } else { &bed.open_dir };
        let enforced = bed.agent.metric(&bed.node, ENFORCED);
        let cpu = bed.agent.cpu();
        let from = cni::log::utc_timestamp(SystemTime::now());
        let (mut call, added) = bed.add(dir, "quiet", &name);
        let to = cni::log::utc_timestamp(SystemTime::now());
        call.cpu += bed.agent.cpu().saturating_sub(cpu);
        let Some(added) = added else {
            return Err(format!("the ADD of {name}: {}{}", call.stdout, call.stderr));
        };
        // Right after the ADD, before any status: a listener, a connection.
        let listener = NetNs::open(added.netns.path())
            .and_then(|ns| ns.run(|| TcpListener::bind(("0.0.0.0", PORT))))
            .map_err(|e| format!("the pod's namespace: {e}"))?
            .map_err(|e| format!("a listener in {name}: {e}"))?;
        let let_in = self.probes.lets_in(added.ip, PROBE_WAIT)?;
        drop(listener);
        if gated {
            let answered = bed.agent.metric(&bed.node, ENFORCED);
            if answered != enforced.map(|n| n + 1.0) {
                out.problem(format!(
                    "gate: {name}'s ADD not confirmed: enforced answers {enforced:?} → {answered:?}"
                ));
            }
            if call.stderr.contains("not confirmed") {
                out.problem(format!("gate: {name}'s ADD: {}", call.stderr.trim()));
            }
            if let_in {
                out.problem(format!("gate: {name} let a connection in right after its ADD"));
            }
            let ops = bed.agent.table_changes(&from, &to).into_iter().max().unwrap_or(0);
            measured.waited_ops = measured.waited_ops.max(ops);
        } else if !let_in {
            out.problem(format!(
                "gate: {name}, added without the gate, dropped a connection: the probe tells nothing"
            ));
        }
        let del = added.delete();
        if !del.ok {
            return Err(format!("the DEL of {name}: {}{}", del.stdout, del.stderr));
        }
        let before = bed.passes();
        bed.server.delete_pod("quiet", &name);
        bed.pass_after(before)?;
        Ok(call)
    }
}
