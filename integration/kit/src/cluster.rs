//! The real Kubernetes cluster (`integration/cluster/cluster.sh`, brought up
//! by `make cluster` or `make cluster-test`) as the cluster tier's tests use
//! it: kubectl 1.20.2 against its API server, commands inside its nodes, and
//! objects made from YAML. The tests never bring it up themselves: one
//! cluster is shared by every cluster test of a run.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::Run;

/// The sandbox image the cluster's nodes hold (built by `images.py`).
pub const PAUSE: &str = "k8s.gcr.io/pause:3.2";
/// The e2e image the cluster's nodes hold (built by `images.py`).
pub const AGNHOST: &str = "k8s.gcr.io/e2e-test-images/agnhost:2.21";

/// The suite's DaemonSet (in kube-system) and its pods' name label.
pub const AGENT: &str = "cni-suite-node-agent";

/// Where `cluster.sh` keeps the running cluster unless `CNI_CLUSTER_DIR`
/// says otherwise (the same default as the script's).
const DEFAULT_DIR: &str = "/tmp/cni-suite-cluster";

/// The checkout's `integration/cluster/cluster.sh`.
fn cluster_script_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster/cluster.sh")
}

/// The checkout's `deploy/` directory (the manifests users apply).
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    /// `cluster.sh facts`: its names and ranges, said there once.
    facts: std::collections::BTreeMap<String, String>,
}

/// Tests that change what every node runs (the DaemonSet, the nodes
/// themselves) take it for writing; the others for reading.
static SHARED: RwLock<()> = RwLock::new(());

impl Cluster {
    /// The running cluster; panics with how to start one when there is none.
    pub fn get() -> &'static Cluster {
        static CLUSTER: OnceLock<Cluster> = OnceLock::new();
        CLUSTER.get_or_init(|| {
            let dir =
                std::env::var_os("CNI_CLUSTER_DIR").map_or_else(|| PathBuf::from(DEFAULT_DIR), PathBuf::from);
            assert!(
                dir.join("kubeconfig").is_file(),
                "no cluster at {} (make cluster-test brings one up for these tests)",
                dir.display()
            );
            let facts = crate::run(cluster_script_path(), &["facts"]).success().stdout;
            let facts = facts
                .lines()
                .filter_map(|line| line.split_once('='))
                .map(|(key, value)| (key.to_owned(), value.to_owned()))
                .collect();
            Cluster { dir, facts }
        })
    }

    /// Held by a test that only adds its own objects.
    pub fn shared(&self) -> RwLockReadGuard<'static, ()> {
        SHARED.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Held by a test that changes the nodes or the suite's DaemonSet.
    pub fn exclusive(&self) -> RwLockWriteGuard<'static, ()> {
        SHARED.write().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn kubectl_command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(self.dir.join("bin/kubectl"));
        command
            .arg("--kubeconfig")
            .arg(self.dir.join("kubeconfig"))
            .args(args);
        command
    }

    /// `kubectl args` with `stdin` fed to it.
    pub fn kubectl_with_input(&self, args: &[&str], stdin: &str) -> Run {
        let what = format!("kubectl {}", args.join(" "));
        let mut child = self
            .kubectl_command(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(stdin.as_bytes())
            .expect("write kubectl's stdin");
        let output = child.wait_with_output().expect("wait for kubectl");
        Run::from_output(what, output)
    }

    pub fn kubectl(&self, args: &[&str]) -> Run {
        self.kubectl_with_input(args, "")
    }

    /// `kubectl get args -o json`.
    pub fn get_json(&self, args: &[&str]) -> Value {
        let mut full = vec!["get"];
        full.extend_from_slice(args);
        full.extend_from_slice(&["-o", "json"]);
        self.kubectl(&full).success().json()
    }

    /// `kubectl apply -f -` of `yaml`.
    pub fn apply(&self, yaml: &str) {
        self.kubectl_with_input(&["apply", "-f", "-"], yaml).success();
    }

    /// `program args` inside node `node` (all its namespaces).
    pub fn on_node(&self, node: &str, args: &[&str]) -> Run {
        let mut full = vec!["exec", node];
        full.extend_from_slice(args);
        crate::run(cluster_script_path(), &full)
    }

    /// `program args` started inside node `node` (all its namespaces),
    /// its stdin and stdout piped to the caller.
    pub fn spawn_on_node(&self, node: &str, args: &[&str]) -> std::process::Child {
        std::process::Command::new(cluster_script_path())
            .args(["exec", node])
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {args:?} on {node}: {e}"))
    }

    /// One line of `cluster.sh facts` (`CONTROL_PLANE_IP`, `NODE_NETWORKS`, ...).
    pub fn fact(&self, key: &str) -> &str {
        self.facts
            .get(key)
            .unwrap_or_else(|| panic!("cluster.sh facts says nothing of {key}"))
    }

    /// The underlay's network namespace (the nodes' network and the
    /// cluster's outside), a name under /run/netns.
    pub fn underlay_netns(&self) -> &str {
        self.fact("UNDERLAY_NETNS")
    }

    /// The underlay's own addresses (IPv4, IPv6): the cluster's outside,
    /// where traffic leaving the cluster goes.
    pub fn outside_addresses(&self) -> Vec<&str> {
        self.fact("OUTSIDE_ADDRESSES").split(',').collect()
    }

    /// The controller-manager's pod ranges (IPv4, IPv6), as kubeadm's
    /// `kubeadm-config` records them.
    pub fn pod_cidrs(&self) -> Vec<&str> {
        self.fact("POD_CIDRS").split(',').collect()
    }

    /// `cluster.sh args` (`add-node`, `start-kubelet`, ...).
    pub fn run_script(&self, args: &[&str]) -> Run {
        crate::run(cluster_script_path(), args)
    }

    /// `cluster.sh args` with `env` added to its environment.
    pub fn run_script_env(&self, args: &[&str], env: &[(&str, &str)]) -> Run {
        let what = format!("cluster.sh {}", args.join(" "));
        let output = Command::new(cluster_script_path())
            .args(args)
            .envs(env.iter().copied())
            .output()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        Run::from_output(what, output)
    }

    /// `kindnet-standin.sh args`: kindnetd's doing on the nodes, done by
    /// the cluster tooling (its conflist and routes; see the script).
    pub fn kindnet_standin(&self, args: &[&str]) -> Run {
        let script = cluster_script_path().with_file_name("kindnet-standin.sh");
        crate::run(script, args)
    }

    /// Ok when every node's Ready condition is True, else the ones whose is
    /// not (or why the nodes could not be listed). Never panics: guards poll
    /// it while a test unwinds.
    pub fn every_node_ready(&self) -> Result<(), String> {
        // One listing, not a request per node: this is polled.
        let list = self.kubectl(&["get", "nodes", "-o", "json"]);
        if !list.ok() {
            return Err(format!("{list:?}"));
        }
        let nodes: Value = serde_json::from_str(&list.stdout).map_err(|e| format!("{e}: {}", list.stdout))?;
        let waiting: Vec<&str> = nodes["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|node| condition_of(node, "Ready").0 != "True")
            .filter_map(|node| node["metadata"]["name"].as_str())
            .collect();
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(format!("not Ready: {waiting:?}"))
        }
    }

    /// `kubectl apply` of a manifest of `deploy/`, then its DaemonSet's
    /// rollout and every node Ready (3 minutes at most). Never panics:
    /// guards call it while a test unwinds.
    pub fn apply_manifest(&self, file: &str) -> Result<(), String> {
        let manifest = deploy_dir().join(file);
        let apply = self.kubectl(&["apply", "-f", &manifest.to_string_lossy()]);
        let rollout = self.kubectl(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            &format!("daemonset/{AGENT}"),
            "--timeout=180s",
        ]);
        if !apply.ok() || !rollout.ok() {
            return Err(format!("{apply:?}\n{rollout:?}"));
        }
        try_poll(
            &format!("every node Ready after applying {file}"),
            Duration::from_secs(180),
            Duration::from_millis(500),
            || self.every_node_ready(),
        )
        .map(drop)
    }

    /// `kubectl delete` of the base manifest, then its agents gone from
    /// every node. Never panics: a guard calls it while a test unwinds.
    pub fn uninstall(&self) -> Result<(), String> {
        self.delete_manifest("cni-suite.yaml", AGENT)
    }

    /// `kubectl delete` of a manifest of `deploy/` whose DaemonSet is
    /// `daemon_set`, then that DaemonSet's agents gone from every node.
    /// Never panics.
    pub fn delete_manifest(&self, file: &str, daemon_set: &str) -> Result<(), String> {
        let manifest = deploy_dir().join(file);
        self.delete_then_wait_for_agents(&["-f", &manifest.to_string_lossy()], daemon_set)
    }

    /// Only the suite's DaemonSet deleted (the manifest does not uninstall
    /// on stop: every file and route stays), then its agents gone.
    pub fn delete_agents(&self) -> Result<(), String> {
        self.delete_then_wait_for_agents(&["-n", "kube-system", "daemonset", AGENT], AGENT)
    }

    /// `kubectl delete what`, then no pod of `daemon_set` left (2 minutes
    /// at most).
    fn delete_then_wait_for_agents(&self, what: &[&str], daemon_set: &str) -> Result<(), String> {
        let mut args = vec!["delete"];
        args.extend_from_slice(what);
        args.extend_from_slice(&["--wait=true", "--ignore-not-found"]);
        let delete = self.kubectl(&args);
        if !delete.ok() {
            return Err(format!("{delete:?}"));
        }
        let selector = format!("app.kubernetes.io/name={daemon_set}");
        try_poll(
            "the agents to be gone",
            Duration::from_secs(120),
            Duration::from_millis(500),
            || {
                let left = self.kubectl(&[
                    "-n",
                    "kube-system",
                    "get",
                    "pods",
                    "-l",
                    &selector,
                    "--no-headers",
                ]);
                if left.ok() && left.stdout.trim().is_empty() {
                    Ok(())
                } else {
                    Err(format!("{left:?}"))
                }
            },
        )
        .map(drop)
    }

    /// The worker nodes' names as the API server lists them.
    pub fn nodes(&self) -> Vec<String> {
        let list = self.get_json(&["nodes"]);
        let mut names: Vec<String> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|node| node["metadata"]["name"].as_str().map(str::to_owned))
            .collect();
        names.sort();
        names
    }

    /// The node's InternalIPs (IPv4 first, as `--node-ip` gives them).
    pub fn node_ips(&self, node: &str) -> Vec<String> {
        let node = self.get_json(&["node", node]);
        node["status"]["addresses"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["type"] == "InternalIP")
            .filter_map(|a| a["address"].as_str().map(str::to_owned))
            .collect()
    }
}

/// Polls `ready` every `every` until it holds; the time it took. Fails the
/// test after `limit`, with what `ready` last reported.
pub fn poll(
    what: &str,
    limit: Duration,
    every: Duration,
    ready: impl FnMut() -> Result<(), String>,
) -> Duration {
    try_poll(what, limit, every, ready).unwrap_or_else(|e| panic!("{e}"))
}

/// [`poll`] that never panics (for guards that run while a test unwinds):
/// the time it took, or after `limit` what `ready` last reported.
pub fn try_poll(
    what: &str,
    limit: Duration,
    every: Duration,
    mut ready: impl FnMut() -> Result<(), String>,
) -> Result<Duration, String> {
    let started = Instant::now();
    loop {
        match ready() {
            Ok(()) => return Ok(started.elapsed()),
            Err(last) if started.elapsed() >= limit => {
                return Err(format!("timed out after {limit:?} waiting for {what}: {last}"));
            }
            Err(_) => std::thread::sleep(every),
        }
    }
}

/// (status, message) of an API object's condition `kind` (empty when it
/// has none).
pub fn condition_of(object: &Value, kind: &str) -> (String, String) {
    object["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == kind)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["message"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .unwrap_or_default()
}

/// A namespace of one test's objects, deleted (without waiting) on drop.
#[derive(Debug)]
pub struct Namespace {
    cluster: &'static Cluster,
    pub name: String,
}

/// A pod as the API server reports it.
#[derive(Debug, Clone)]
pub struct Pod {
    pub name: String,
    pub node: String,
    /// `status.podIPs`, IPv4 first on this dual-stack cluster.
    pub ips: Vec<String>,
    /// Its Ready condition is True.
    pub ready: bool,
}

impl Pod {
    /// The pod's IPv6 or IPv4 address.
    pub fn ip_like(&self, ipv6: bool) -> &str {
        self.ips
            .iter()
            .find(|ip| ip.contains(':') == ipv6)
            .unwrap_or_else(|| panic!("{} has no IPv{} address", self.name, if ipv6 { 6 } else { 4 }))
    }
}

/// `host:port` for a URL (brackets around IPv6).
pub fn host_port(ip: &str, port: u16) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

impl Namespace {
    /// A fresh namespace named after `test`.
    pub fn new(cluster: &'static Cluster, test: &str) -> Self {
        static COUNT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{test}-{}-{n}", std::process::id()).replace('_', "-");
        cluster.kubectl(&["create", "namespace", &name]).success();
        Namespace { cluster, name }
    }

    /// `kubectl -n <this> args`.
    pub fn kubectl(&self, args: &[&str]) -> Run {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        self.cluster.kubectl(&full)
    }

    pub fn apply(&self, yaml: &str) {
        self.cluster
            .kubectl_with_input(&["-n", &self.name, "apply", "-f", "-"], yaml)
            .success();
    }

    /// Waits until every pod matching `selector` (at least `count`) runs
    /// and is ready; returns them.
    pub fn ready_pods(&self, selector: &str, count: usize, limit: Duration) -> Vec<Pod> {
        let mut pods = Vec::new();
        poll(
            &format!("{count} ready pods {selector} in {}", self.name),
            limit,
            Duration::from_millis(500),
            || {
                pods = self.pods(selector);
                let waiting: Vec<&str> = pods
                    .iter()
                    .filter(|p| !p.ready)
                    .map(|p| p.name.as_str())
                    .collect();
                if pods.len() >= count && waiting.is_empty() {
                    Ok(())
                } else {
                    Err(format!("{} pods, not ready: {waiting:?}", pods.len()))
                }
            },
        );
        pods
    }

    /// The pods matching `selector`.
    pub fn pods(&self, selector: &str) -> Vec<Pod> {
        let list = self
            .kubectl(&["get", "pods", "-l", selector, "-o", "json"])
            .success()
            .json();
        list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|pod| Pod {
                name: pod["metadata"]["name"].as_str().unwrap_or_default().to_owned(),
                node: pod["spec"]["nodeName"].as_str().unwrap_or_default().to_owned(),
                ips: pod["status"]["podIPs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|ip| ip["ip"].as_str().map(str::to_owned))
                    .collect(),
                ready: condition_of(pod, "Ready").0 == "True",
            })
            .collect()
    }

    /// `args` run inside the pod's first container.
    pub fn exec(&self, pod: &str, args: &[&str]) -> Run {
        let mut full = vec!["exec", pod, "--"];
        full.extend_from_slice(args);
        self.kubectl(&full)
    }

    /// The body `curl` gets from `url` inside `pod` (5 s at most), retried
    /// for up to 20 s while the answer is an error: kube-proxy and the
    /// agent converge asynchronously.
    pub fn curl(&self, pod: &str, url: &str) -> String {
        let mut body = String::new();
        poll(
            &format!("{url} from {pod}"),
            Duration::from_secs(20),
            Duration::from_millis(500),
            || {
                let run = self.exec(pod, &["curl", "-sS", "-g", "-m", "5", url]);
                if run.ok() {
                    body = run.stdout.trim().to_owned();
                    Ok(())
                } else {
                    Err(format!("{run:?}"))
                }
            },
        );
        body
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        self.cluster
            .kubectl(&["delete", "namespace", &self.name, "--wait=false"]);
    }
}
