//! What Istio's ambient mode costs a pod's ADD, and how long an agent that
//! restarts takes to hand ztunnel its pods (`--only ambient`). The node
//! agent runs in ambient mode against the API test server in a node's
//! namespace, as the cluster tests run it, with the test kit's ztunnel on
//! its ZDS socket. Pods are added with cnictl through the agent's
//! conflist, alternately one of namespace `mesh` (labelled for ambient:
//! its ADD waits for the agent's in-pod rules and ztunnel's ack) and one
//! of `plain` (the same chain, the same API lookups, no enrolment: the
//! reference). Then the enrolled pods run (status posted, a process in
//! each namespace), the agent is killed and started again, and the time
//! from its start to the end of the snapshot the reconnecting ztunnel
//! receives is the restart's row, with how many pods the snapshot named.
//!
//! It fails when an ADD fails, a mesh pod's add does not reach ztunnel
//! with its own namespace, or the snapshot misses a pod. Everything is in
//! the node's namespaces and directory, removed when the phase ends.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use netns::NetNs;
use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::fakes::ztunnel::{Ztunnel, netns_inode};
use test_kit::node_agent::{Agent, host_bin, lab_node, node_object, uplink};
use test_kit::{Netns, Node};

use crate::measure::{Call, exec, ms};
use crate::outcome::{Outcome, check_calls};
use crate::setup::{Setup, Side};

/// The phase's name for `--only`.
pub const PHASE: &str = "ambient";

/// An enrolled pod's ADD, against a pod of the same chain not enrolled.
pub const ADD_METRIC: &str = "ambient enrolled ADD";

/// From the restarted agent's start to the end of ztunnel's snapshot.
pub const RESTART_METRIC: &str = "ambient agent start to snapshot end ms";

/// The pods that snapshot named.
pub const RESTART_PODS_METRIC: &str = "ambient pods in the snapshot";

/// The most pods the restart hands over.
const MAX_RUNNING: usize = 100;

const TOKEN: &str = "ambient-bench-token";
const NODE: &str = "n1";
const CIDR: &str = "10.78.0.0/22";

fn pod_object(namespace: &str, name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace, "uid": format!("u-{namespace}-{name}")},
           "spec": {"nodeName": NODE, "containers": [{"name": "app"}]},
           "status": {"phase": "Pending"}})
}

fn namespace_object(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

/// The agent's settings in ambient mode, its ZDS socket at `zds`.
fn settings(zds: &str) -> [(&str, &str); 4] {
    [
        ("ISTIO_CHAINED", "true"),
        ("AMBIENT_ENABLED", "true"),
        ("ZTUNNEL_UDS_ADDRESS", zds),
        ("NETWORK_POLICY", "false"),
    ]
}

/// A pod added, kept until the phase's end, with the process that makes
/// its namespace show in /proc as a runtime's pods do.
struct Running {
    /// Held for the pod's life: its namespace goes with it.
    _netns: Netns,
    pause: std::process::Child,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.pause.kill();
        let _ = self.pause.wait();
    }
}

/// The node, its agent, the server and ztunnel; drops in that order.
struct Bed {
    ztunnel: Option<Ztunnel>,
    agent: Agent,
    zds: PathBuf,
    node_ns: NetNs,
    server: ApiServer,
    node: Node,
}

impl Bed {
    fn new() -> Result<Bed, String> {
        let node = lab_node();
        uplink(&node);
        let server = ApiServer::start(node.netns.path(), TOKEN);
        server.apply_node(node_object(NODE, &[CIDR], &["10.250.0.11"]));
        server.apply_namespace(namespace_object(
            "mesh",
            json!({"istio.io/dataplane-mode": "ambient"}),
        ));
        server.apply_namespace(namespace_object("plain", json!({})));
        let zds = node.path("run/ztunnel/ztunnel.sock");
        let zds_text = zds.to_str().unwrap_or_default().to_owned();
        let agent = Agent::start(&node, NODE, &server, "127.0.0.1", TOKEN, &settings(&zds_text));
        let started = Instant::now();
        while !agent.ready(&node) {
            if started.elapsed() > Duration::from_secs(30) {
                return Err("the agent was not ready in 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let ztunnel = Ztunnel::connect(&zds);
        ztunnel.wait_for("snapshot", "");
        let node_ns = NetNs::open(node.netns.path()).map_err(|e| e.to_string())?;
        Ok(Bed {
            ztunnel: Some(ztunnel),
            agent,
            zds,
            node_ns,
            server,
            node,
        })
    }

    /// The pod's ADD through the agent's conflist, as a kubelet's runtime
    /// runs it.
    fn add(&self, namespace: &str, name: &str) -> (Netns, Call) {
        self.server.add_pod(namespace, name, pod_object(namespace, name));
        let netns = self.node.pod(name);
        netns.ip(&["link", "set", "lo", "up"]).success();
        let bins = host_bin(&self.node);
        let cache = self.node.cache_dir();
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}");
        let env = [
            (
                "NETCONFPATH",
                self.node.conf_dir().to_str().unwrap_or_default().to_owned(),
            ),
            ("CNI_PATH", bins.to_str().unwrap_or_default().to_owned()),
            ("CNI_ARGS", args),
        ];
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let cli = [
            "--cache-dir",
            cache.to_str().unwrap_or_default(),
            "--json",
            "add",
            "cni-suite",
            netns.path_str(),
        ];
        let call = exec(&self.node_ns, &test_kit::bin("cnictl"), &cli, &env, "");
        (netns, call)
    }

    /// The pod as kubelet reports it once it runs, and its pause process.
    fn run(&self, namespace: &str, name: &str, netns: Netns, call: &Call) -> Running {
        let address = serde_json::from_str::<Value>(&call.stdout)
            .ok()
            .and_then(|result| {
                let cidr = result["ips"][0]["address"].as_str()?.to_owned();
                cidr.split('/').next().map(str::to_owned)
            });
        let mut object = pod_object(namespace, name);
        object["status"] = json!({"phase": "Running", "podIP": address, "podIPs": [{"ip": address}]});
        self.server.add_pod(namespace, name, object);
        let pause = test_kit::spawn_in(
            netns.path(),
            std::path::Path::new("/bin/sleep"),
            &["600"],
            &[],
            "",
        );
        Running { _netns: netns, pause }
    }
}

/// Runs the phase: `pods` ADDs of each kind, and the restart with at most
/// [`MAX_RUNNING`] enrolled pods running.
pub fn phase(out: &mut Outcome, pods: usize) {
    let mut bed = match Bed::new() {
        Ok(bed) => bed,
        Err(e) => return out.problem(format!("ambient: {e}")),
    };
    let (mut enrolled, mut plain) = (Vec::new(), Vec::new());
    let mut running = Vec::new();
    let total = (pods * 4).clamp(pods, MAX_RUNNING);
    for i in 0..total {
        let name = format!("web-{i}");
        let (netns, call) = bed.add("mesh", &name);
        let inode = netns_inode(netns.path());
        if call.ok {
            let uid = format!("u-mesh-{name}");
            let seen = bed.ztunnel.as_ref().map(|z| z.wait_for("add", &uid));
            if seen.and_then(|s| s.netns) != Some(inode) {
                out.problem(format!("ambient: {name}'s add did not carry its own namespace"));
            }
            running.push(bed.run("mesh", &name, netns, &call));
        }
        if i < pods {
            enrolled.push(call);
            let (netns, call) = bed.add("plain", &format!("plain-{i}"));
            plain.push(call);
            drop(netns);
        }
    }
    check_calls(out, ADD_METRIC, Setup::DropIn, &enrolled);
    check_calls(out, "ambient plain ADD", Setup::Reference, &plain);
    out.sample(ADD_METRIC, Side::Ours, &enrolled, Duration::ZERO);
    out.sample(ADD_METRIC, Side::Reference, &plain, Duration::ZERO);

    // The agent killed and started again: ztunnel reconnects at once, as
    // ztunnel does, and its first snapshot must name every pod.
    bed.agent.kill();
    drop(bed.ztunnel.take());
    let zds = bed.zds.to_str().unwrap_or_default().to_owned();
    let started = Instant::now();
    bed.agent = Agent::start(&bed.node, NODE, &bed.server, "127.0.0.1", TOKEN, &settings(&zds));
    let ztunnel = Ztunnel::connect(&bed.zds);
    ztunnel.wait_for("snapshot", "");
    let took = started.elapsed();
    let named = ztunnel.seen().iter().filter(|seen| seen.kind == "add").count();
    if named != running.len() {
        out.problem(format!(
            "ambient: the restarted agent's snapshot named {named} of {} pods",
            running.len()
        ));
    }
    out.record(RESTART_METRIC, Side::Ours, ms(took));
    out.record(RESTART_PODS_METRIC, Side::Ours, named as f64);
    bed.ztunnel = Some(ztunnel);
    drop(running);
}
