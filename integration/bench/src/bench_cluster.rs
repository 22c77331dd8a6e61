//! What the cluster bench's phases share (the scale phase and the
//! NetworkPolicy phase alike): the bench Nodes without kubelets and the
//! namespace that stands for Node 0, the API as that namespace reaches it,
//! what the agents cost as procfs tells it, and the NetworkPolicy phase's
//! options, which the run's JSON record holds beside the others.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use netns::NetNs;
use serde_json::{Value, json};
use test_kit::Netns;
use test_kit::cluster::Cluster;

#[derive(Debug, Clone)]
pub struct PolicyOptions {
    /// Pod objects on bench Nodes.
    pub pods: usize,
    /// Policy counts the changes are timed at, smallest first.
    pub sizes: Vec<usize>,
    /// Policies created (and deleted) one at a time at each size.
    pub trials: usize,
    /// New connections timed per variant.
    pub connects: usize,
}

/// The label every Node the bench makes carries (and nothing else does).
pub(crate) const FAKE_LABEL: &str = "cni-bench";
/// The bench Nodes' names: `<prefix>-<index>`; index 0 is the bench's agent.
pub(crate) const PREFIX: &str = "bench";
/// How long any one wait may last.
pub(crate) const LIMIT: Duration = Duration::from_secs(300);

/// The `index`th bench Node's pod CIDRs and InternalIPs, inside the
/// cluster's pod ranges (`10.224.0.0/11`, `fd00:10:224::/48`, after the
/// real nodes' CIDRs) and the node network (`172.18.0.0/16`).
pub(crate) fn fake_node(index: usize, node_net4: &str, node_net6: &str) -> Value {
    let (high, low) = (225 + index / 256, index % 256);
    let cidrs = [
        format!("10.{high}.{low}.0/24"),
        format!("fd00:10:224:{:x}::/64", 0x1000 + index),
    ];
    let ips = [
        format!("{node_net4}.{}.{}", 20 + index / 250, 1 + index % 250),
        format!("{node_net6}:1:{index:x}"),
    ];
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": format!("{PREFIX}-{index}"), "labels": {FAKE_LABEL: "fake"}},
        "spec": {"podCIDR": cidrs[0], "podCIDRs": cidrs},
        "status": {"addresses": [
            {"type": "InternalIP", "address": ips[0]},
            {"type": "InternalIP", "address": ips[1]},
        ]},
    })
}

/// A namespace on the node network with the addresses of bench Node 0:
/// a node with no kubelet, where the bench's agent and API client run.
pub(crate) struct BenchNode {
    pub(crate) netns: Netns,
    handle: NetNs,
    /// The node network's IPv4 /16 and IPv6 /64 prefixes, as `172.18` and
    /// `fc00:f853:ccd:e793:`.
    pub(crate) net4: String,
    pub(crate) net6: String,
}

impl BenchNode {
    pub(crate) fn new(cluster: &Cluster) -> Self {
        let networks = cluster.fact("NODE_NETWORKS");
        let (v4, v6) = networks
            .split_once(',')
            .expect("NODE_NETWORKS holds both families");
        let net4 = v4
            .trim_end_matches(".0/16")
            .rsplit_once('.')
            .map_or(v4, |(head, _)| head)
            .to_owned();
        let net6 = v6.trim_end_matches(":/64").to_owned();
        let netns = Netns::new("scale");
        let underlay = cluster.underlay_netns();
        let peer = "v-cnibench";
        let _ = test_kit::run("ip", &["-n", underlay, "link", "del", peer]);
        test_kit::veth_between(underlay, peer, &netns);
        test_kit::run(
            "ip",
            &["-n", underlay, "link", "set", peer, "master", "br0", "up"],
        )
        .success();
        let own = fake_node(0, &net4, &net6);
        let addresses = &own["status"]["addresses"];
        netns.ip(&["link", "set", "lo", "up"]).success();
        netns
            .ip(&[
                "addr",
                "add",
                &format!("{}/16", addresses[0]["address"].as_str().unwrap_or_default()),
                "dev",
                "eth0",
            ])
            .success();
        netns
            .ip(&[
                "addr",
                "add",
                &format!("{}/64", addresses[1]["address"].as_str().unwrap_or_default()),
                "dev",
                "eth0",
                "nodad",
            ])
            .success();
        netns.ip(&["link", "set", "eth0", "up"]).success();
        let handle = NetNs::open(netns.path()).expect("open the bench node's namespace");
        BenchNode {
            netns,
            handle,
            net4,
            net6,
        }
    }
}

/// The cluster's API as the bench node reaches it (the control plane's
/// address, no relay): a current-thread runtime whose every call runs
/// with this thread inside the bench node's namespace, so every socket it
/// opens is there.
pub(crate) struct Api {
    runtime: tokio::runtime::Runtime,
    client: kube::Client,
    netns: NetNs,
}

impl Api {
    pub(crate) fn new(cluster: &Cluster, node: &BenchNode) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let kubeconfig =
            kube::config::Kubeconfig::read_from(cluster.dir().join("kubeconfig")).expect("the kubeconfig");
        let control_plane = format!("https://{}:6443", cluster.fact("CONTROL_PLANE_IP"));
        let netns = NetNs::open(node.netns.path()).expect("the bench node's namespace");
        let client = node
            .handle
            .run(|| {
                runtime.block_on(async {
                    let mut config = kube::Config::from_custom_kubeconfig(
                        kubeconfig,
                        &kube::config::KubeConfigOptions::default(),
                    )
                    .await
                    .expect("a client configuration");
                    config.cluster_url = control_plane.parse().expect("the control plane's URL");
                    kube::Client::try_from(config).expect("a client")
                })
            })
            .expect("enter the bench node");
        Api {
            runtime,
            client,
            netns,
        }
    }

    /// Runs `work` to its end inside the bench node.
    pub(crate) fn call<T>(&self, work: impl std::future::Future<Output = T>) -> T {
        self.netns
            .run(|| self.runtime.block_on(work))
            .expect("enter the bench node")
    }

    pub(crate) fn client(&self) -> kube::Client {
        self.client.clone()
    }

    pub(crate) fn nodes(&self) -> kube::Api<Node> {
        kube::Api::all(self.client.clone())
    }

    /// Runs `request` for every item, `parallel` in flight; the first
    /// error, said as `what`.
    pub(crate) fn each<T, K, F, Fut>(
        &self,
        items: Vec<T>,
        parallel: usize,
        what: &str,
        request: F,
    ) -> Result<(), String>
    where
        F: Fn(T) -> Fut,
        Fut: std::future::Future<Output = Result<K, kube::Error>>,
    {
        self.call(async {
            let results: Vec<Result<K, kube::Error>> = futures::stream::iter(items)
                .map(request)
                .buffer_unordered(parallel)
                .collect()
                .await;
            results
                .into_iter()
                .find_map(Result::err)
                .map_or(Ok(()), |e| Err(format!("{what}: {e}")))
        })
    }

    /// Creates `nodes` with `parallel` requests in flight.
    pub(crate) fn create(&self, nodes: Vec<Value>, parallel: usize) -> Result<(), String> {
        self.create_all(self.nodes(), nodes, parallel, "creating a Node")
    }

    /// Creates `objects` (of `api`'s kind) with `parallel` requests in
    /// flight; the first error, said as `what`.
    pub(crate) fn create_all<K>(
        &self,
        api: kube::Api<K>,
        objects: Vec<Value>,
        parallel: usize,
        what: &str,
    ) -> Result<(), String>
    where
        K: kube::Resource
            + Clone
            + std::fmt::Debug
            + k8s_openapi::serde::de::DeserializeOwned
            + k8s_openapi::serde::Serialize,
    {
        self.each(objects, parallel, what, |object| {
            let api = api.clone();
            async move {
                let object: K = serde_json::from_value(object).map_err(kube::Error::SerdeError)?;
                api.create(&PostParams::default(), &object).await
            }
        })
    }

    /// Deletes every bench Node; waits until none is listed.
    pub(crate) fn delete_fakes(&self) {
        let api = self.nodes();
        let selector = ListParams::default().labels(&format!("{FAKE_LABEL}=fake"));
        let deadline = Instant::now() + LIMIT;
        while Instant::now() < deadline {
            // Again each time: one call may end before all 5000 are gone.
            self.call(async {
                let _ = api.delete_collection(&DeleteParams::default(), &selector).await;
            });
            let left = self.call(api.list_metadata(&selector.clone().limit(1)));
            if left.is_ok_and(|list| list.items.is_empty()) {
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        eprintln!("bench: bench Nodes still listed after {LIMIT:?}");
    }

    /// A status update the agent has nothing to do with: a condition of
    /// its own whose message changes, as a kubelet's heartbeat changes its
    /// conditions' times.
    pub(crate) fn heartbeat(&self, names: &[String], round: usize, parallel: usize) -> Result<(), String> {
        let api = self.nodes();
        self.each(names.to_vec(), parallel, "a status update", |name| {
            let api = api.clone();
            let patch = json!({"status": {"conditions": [{
                "type": "BenchHeartbeat", "status": "True", "reason": "Bench",
                "message": format!("heartbeat {round}"),
            }]}});
            async move {
                api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch))
                    .await
            }
        })
    }
}

/// A program's output lines, each with when it was read (on a thread of
/// its own, so the program never waits on a full pipe).
pub(crate) fn lines_as_read(
    output: impl std::io::Read + Send + 'static,
) -> mpsc::Receiver<(Instant, String)> {
    let (sender, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(output).lines() {
            let Ok(line) = line else { break };
            if sender.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    lines
}

/// CPU time (user + system, every thread ever, and the programs it ran
/// and waited for) of `pid`, in ms.
pub(crate) fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime, stime, cutime and cstime (its programs, such as
    // iptables-restore) are fields 14 to 17; `after_name` starts at 3.
    let ticks: f64 = fields
        .get(11..15)
        .map_or(0.0, |t| t.iter().filter_map(|v| v.parse::<f64>().ok()).sum());
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks * 1000.0 / per_second.max(1.0)
}

/// A `/proc/<pid>/status` field in MiB (`VmHWM`, `VmRSS`).
pub(crate) fn memory_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .trim_start_matches(':')
                .split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Deletes every bench Node when the bench ends, however it ends.
pub(crate) struct FakeNodes<'a>(pub(crate) &'a Api);

impl Drop for FakeNodes<'_> {
    fn drop(&mut self) {
        self.0.delete_fakes();
    }
}

/// The DaemonSet's agents on the real nodes and their resident memory.
pub(crate) fn daemonset_agents(own: u32) -> BTreeMap<u32, f64> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != own)
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "cni-node-agent")
        })
        .map(|pid| (pid, memory_mib(pid, "VmRSS")))
        .collect()
}
