//! Helpers the cluster tier's test modules share: no test module imports
//! another.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};
use test_kit::Node;
use test_kit::cluster::{AGNHOST, Cluster, Namespace, condition_of, deploy_dir, poll};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{Agent, host_conflist};

pub(crate) const TOKEN: &str = "agent-token";

/// Istio's capture in a pod: its outbound TCP redirected to Envoy's port.
pub(crate) const ENVOY_REDIRECT: &str = "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001";

/// containerd's default capabilities and the two the DaemonSet adds.
pub(crate) const CONTAINER_CAPABILITIES: &str = "+chown,+dac_override,+fsetid,+fowner,+mknod,+net_raw,+setgid,+setuid,\
     +setfcap,+setpcap,+net_bind_service,+sys_chroot,+kill,+audit_write,+net_admin";

/// A process standing for a pod's pause container: what makes its
/// namespace show in /proc. Killed when dropped.
pub(crate) struct Pause(std::process::Child);

impl Pause {
    /// As the pause image runs it: uid and gid 65535, another user than
    /// the agent's.
    /// Returns once the process is in the pod's namespace (nsenter has
    /// entered it), so /proc shows it there.
    pub(crate) fn start(pod: &test_kit::Netns) -> Pause {
        use std::os::unix::fs::MetadataExt;
        let pause = Pause(test_kit::spawn_in(
            pod.path(),
            Path::new("setpriv"),
            &[
                "--reuid=65535",
                "--regid=65535",
                "--clear-groups",
                "/bin/sleep",
                "600",
            ],
            &[],
            "",
        ));
        let pod_inode = std::fs::metadata(pod.path()).expect("the pod's namespace").ino();
        let inside = format!("/proc/{}/ns/net", pause.0.id());
        test_kit::wait_for("the pause process in its pod", Duration::from_secs(5), || {
            std::fs::metadata(&inside).is_ok_and(|meta| meta.ino() == pod_inode)
        });
        pause
    }
}

impl Drop for Pause {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The agent of Node n1, reaching the API server on the node's loopback.
pub(crate) fn agent_of_n1(node: &Node, server: &ApiServer, token: &str, extra: &[(&str, &str)]) -> Agent {
    Agent::start(node, "n1", server, "127.0.0.1", token, extra)
}

pub(crate) fn conflist(node: &Node) -> PathBuf {
    host_conflist(node)
}

pub(crate) fn read_conflist(node: &Node) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(conflist(node)).ok()?).ok()
}

/// Every entry of `dir`, recursively, never through a link: its kind, inode,
/// link count and mode, and a link's target or a digest of a file's content.
pub(crate) fn bin_dir_snapshot(dir: &Path) -> std::collections::BTreeMap<String, String> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    use std::os::unix::fs::MetadataExt;
    let mut out = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("ls").flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let metadata = std::fs::symlink_metadata(&path).expect("lstat");
        let what = if metadata.is_symlink() {
            format!(
                "link -> {}",
                std::fs::read_link(&path).expect("readlink").display()
            )
        } else if metadata.is_dir() {
            out.extend(
                bin_dir_snapshot(&path)
                    .into_iter()
                    .map(|(inner, what)| (format!("{name}/{inner}"), what)),
            );
            "directory".to_owned()
        } else {
            let mut digest = DefaultHasher::new();
            std::fs::read(&path).expect("read").hash(&mut digest);
            format!("file {:016x}", digest.finish())
        };
        let inode = format!(
            "inode {} links {} mode {:o}",
            metadata.ino(),
            metadata.nlink(),
            metadata.mode()
        );
        out.insert(name, format!("{what}, {inode}"));
    }
    out
}

/// kindnet's conflist, as kindnetd writes it.
pub(crate) fn kindnet_conflist() -> Value {
    json!({"cniVersion": "0.3.1", "name": "kindnet", "plugins": [
        {"type": "ptp", "ipMasq": false, "mtu": 1500, "ipam": {"type": "host-local",
         "dataDir": "/run/cni-ipam-state", "ranges": [[{"subnet": "10.244.1.0/24"}]],
         "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": true}}
    ]})
}

pub(crate) fn plugin_types(path: &std::path::Path) -> Vec<String> {
    plugin_types_in(&std::fs::read_to_string(path).unwrap_or_default())
}

/// The plugin types of a configuration's text (empty when it is not JSON).
pub(crate) fn plugin_types_in(text: &str) -> Vec<String> {
    let conf: Value = serde_json::from_str(text).unwrap_or_default();
    conf["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["type"].as_str().map(str::to_owned))
        .collect()
}

/// A bare `.conf` as an operator writes it, with spacing no JSON writer
/// reproduces: the bridge `br-wrap` over 10.22.0.0/24, leases under `leases`.
pub(crate) fn bare_conf(leases: &Path) -> String {
    format!(
        "{{ \"cniVersion\": \"0.4.0\",  \"name\": \"mynet\", \"type\": \"bridge\", \"bridge\": \"br-wrap\",\n  \
         \"isGateway\": true, \"ipam\": {{\"type\": \"host-local\", \"subnet\": \"10.22.0.0/24\",\n  \
         \"dataDir\": \"{}\"}} }}\n",
        leases.display()
    )
}

/// GET /metrics of `agent`: the Content-Type and the body.
pub(crate) fn scrape(node: &Node, agent: &Agent) -> (String, String) {
    let ns = netns::NetNs::open(node.netns.path()).expect("netns");
    let mut stream = ns
        .run(|| TcpStream::connect(("127.0.0.1", agent.health)))
        .expect("enter")
        .expect("connect");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("request");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("response");
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    let content_type = head
        .lines()
        .find_map(|line| line.strip_prefix("Content-Type: "))
        .expect("a Content-Type")
        .to_owned();
    (content_type, body.to_owned())
}

/// The value of the sample `series` (a name with its labels, as the
/// exposition writes them), if there is one.
pub(crate) fn sample(exposition: &str, series: &str) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.parse().ok()
    })
}

// The suite on a real Kubernetes (`real_cluster`, `real_istio_only`).

/// What installing the suite changed, observed once by whichever test
/// comes first.
#[derive(Debug)]
pub(crate) struct Install {
    /// Each node's Ready condition message before the apply.
    pub(crate) not_ready_before: Vec<(String, String)>,
    pub(crate) ready_after: Duration,
    /// Each node's `node_state` before the apply.
    pub(crate) state_before: Vec<(String, BTreeSet<String>)>,
}

/// `args` run on `node`, each line of its output prefixed with `what: `.
pub(crate) fn node_lines(cluster: &Cluster, node: &str, what: &str, args: &[&str]) -> Vec<String> {
    let run = cluster.on_node(node, args).success();
    run.stdout.lines().map(|line| format!("{what}: {line}")).collect()
}

/// iptables-nft's own tables, which iptables-save already shows.
pub(crate) const IPTABLES_TABLES: [&str; 5] = ["filter", "nat", "mangle", "raw", "security"];

/// Every firewall rule on the node, without counters or comments:
/// iptables-save and ip6tables-save, then every other nftables table (the
/// suite's nft backends) as `nft -s list ruleset` prints it.
pub(crate) fn firewall_rules(cluster: &Cluster, node: &str) -> Vec<String> {
    let mut lines = node_lines(cluster, node, "rule", &["iptables-save"]);
    lines.extend(node_lines(cluster, node, "rule", &["ip6tables-save"]));
    let mut lines: Vec<String> = lines
        .into_iter()
        .filter(|line| !line.starts_with("rule: #"))
        .map(|line| match line.strip_prefix("rule: :") {
            // a chain's policy line: its packet and byte counters go
            Some(rest) => format!("rule: :{}", rest.split(" [").next().unwrap_or(rest)),
            None => line,
        })
        .collect();
    let ruleset = cluster.on_node(node, &["nft", "-s", "list", "ruleset"]).success();
    let mut table = String::new();
    for line in ruleset.stdout.lines() {
        if let Some(header) = line.strip_prefix("table ") {
            table = header.trim_end_matches(" {").to_owned();
        }
        let iptables_own = table
            .split_whitespace()
            .nth(1)
            .is_some_and(|name| IPTABLES_TABLES.contains(&name))
            && (table.starts_with("ip ") || table.starts_with("ip6 "));
        if !iptables_own {
            lines.push(format!("nft: {table}: {}", line.trim()));
        }
    }
    lines
}

/// What the suite installs and uninstalls on a node: the CNI bin and conf
/// directories (names and contents), links, routes, and every firewall rule
/// but the kubelet's and kube-proxy's (their chains are KUBE-*). Sorted
/// lines, without counters.
pub(crate) fn node_state(cluster: &Cluster, node: &str) -> BTreeSet<String> {
    let listing = |dir: &str| format!("cd {dir} && sha256sum * .[!.]* 2>/dev/null; ls -la");
    let mut lines = node_lines(cluster, node, "bin", &["sh", "-c", &listing("/opt/cni/bin")]);
    lines.extend(node_lines(
        cluster,
        node,
        "conf",
        &["sh", "-c", &listing("/etc/cni/net.d")],
    ));
    lines.extend(node_lines(cluster, node, "link", &["ip", "-o", "link", "show"]));
    lines.extend(node_lines(
        cluster,
        node,
        "route",
        &["ip", "-4", "route", "show", "table", "all"],
    ));
    lines.extend(node_lines(
        cluster,
        node,
        "route",
        &["ip", "-6", "route", "show", "table", "all"],
    ));
    lines.extend(firewall_rules(cluster, node));
    lines
        .into_iter()
        .filter(|line| !line.contains("KUBE-"))
        // The kernel's own routes for local and anycast addresses: the
        // subnet-router anycast ones come with IPv6 forwarding, which the
        // bridge plugin turns on for its gateway and, like the reference
        // bridge, leaves on (a kind node has it on from the start).
        .filter(|line| !(line.contains(" table local ") && line.contains(" proto kernel ")))
        // `ls -la`'s sizes and times of the directories themselves change
        // with every write; the files are compared by content above.
        .filter(|line| !(line.ends_with(" .") || line.ends_with(" ..") || line.contains(": total ")))
        .map(|line| match line.strip_prefix("link: ") {
            // index and name, flags, master: not the counters or qdisc state
            Some(rest) => format!("link: {}", rest.split(" mtu ").next().unwrap_or(rest)),
            None => line,
        })
        .collect()
}

/// Applies `deploy/cni-suite.yaml` unchanged (once) and waits until every
/// node is Ready.
pub(crate) fn installed() -> &'static Install {
    static INSTALL: OnceLock<Install> = OnceLock::new();
    INSTALL.get_or_init(|| {
        let cluster = Cluster::get();
        let mut not_ready_before = Vec::new();
        let state_before = cluster
            .nodes()
            .into_iter()
            .map(|n| {
                let state = node_state(cluster, &n);
                (n, state)
            })
            .collect();
        for node in cluster.nodes() {
            let (status, message) = ready_condition(cluster, &node);
            if status != "True" {
                not_ready_before.push((node, message));
            }
        }
        cluster
            .kubectl(&[
                "apply",
                "-f",
                &deploy_dir().join("cni-suite.yaml").to_string_lossy(),
            ])
            .success();
        let ready_after = poll(
            "every node Ready",
            Duration::from_secs(180),
            Duration::from_millis(200),
            || cluster.every_node_ready(),
        );
        eprintln!("suite applied: every node Ready after {ready_after:?}");
        Install {
            not_ready_before,
            ready_after,
            state_before,
        }
    })
}

/// (status, message) of the node's Ready condition.
pub(crate) fn ready_condition(cluster: &Cluster, node: &str) -> (String, String) {
    condition_of(&cluster.get_json(&["node", node]), "Ready")
}

/// Waits until no namespace is still terminating (earlier tests'
/// namespaces are deleted without waiting) and no deleted pod's sandbox is
/// still being torn down.
pub(crate) fn settled(cluster: &Cluster) {
    poll(
        "earlier tests' namespaces to be gone",
        Duration::from_secs(180),
        Duration::from_secs(1),
        || {
            let namespaces = cluster.kubectl(&["get", "namespaces", "--no-headers"]).success();
            let terminating: Vec<&str> = namespaces
                .stdout
                .lines()
                .filter(|l| l.contains("Terminating"))
                .collect();
            if terminating.is_empty() {
                Ok(())
            } else {
                Err(format!("{terminating:?}"))
            }
        },
    );
    torn_down(cluster);
}

pub(crate) fn pause_deployment(name: &str, replicas: usize, host_port: Option<u16>) -> String {
    let ports = host_port.map_or_else(String::new, |port| {
        format!("        ports: [{{containerPort: 8080, hostPort: {port}}}]\n")
    });
    format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}}}\nspec:\n  replicas: {replicas}\n  \
         selector: {{matchLabels: {{app: {name}}}}}\n  template:\n    metadata: {{labels: {{app: {name}}}}}\n    \
         spec:\n      topologySpreadConstraints:\n      - {{maxSkew: 1, topologyKey: kubernetes.io/hostname, \
         whenUnsatisfiable: DoNotSchedule, labelSelector: {{matchLabels: {{app: {name}}}}}}}\n      \
         terminationGracePeriodSeconds: 0\n      containers:\n      - name: pause\n        image: k8s.gcr.io/pause:3.2\n{ports}"
    )
}

/// The pod of DaemonSet `daemon_set` on `node`: (name, ready), once
/// scheduled there.
pub(crate) fn agent_of(cluster: &Cluster, daemon_set: &str, node: &str) -> Option<(String, bool)> {
    let selector = format!("app.kubernetes.io/name={daemon_set}");
    let list = cluster.get_json(&[
        "pods",
        "-n",
        "kube-system",
        "-l",
        &selector,
        "--field-selector",
        &format!("spec.nodeName={node}"),
    ]);
    let pod = list["items"]
        .as_array()?
        .iter()
        .find(|p| p["metadata"]["deletionTimestamp"].is_null())?;
    let ready = condition_of(pod, "Ready").0 == "True";
    Some((pod["metadata"]["name"].as_str()?.to_owned(), ready))
}

/// A Deployment scaled between none and `replicas` pods again and again
/// until `stop`; each wave must come up and go away in time. Returns how
/// many waves ran.
pub(crate) fn churn(ns: &Namespace, replicas: usize, stop: &std::sync::atomic::AtomicBool) -> usize {
    let mut waves = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        ns.kubectl(&["scale", "deployment", "churn", &format!("--replicas={replicas}")])
            .success();
        ns.ready_pods("app=churn", replicas, Duration::from_secs(120));
        ns.kubectl(&["scale", "deployment", "churn", "--replicas=0"])
            .success();
        gone(ns, "app=churn");
        waves += 1;
    }
    waves
}

/// Warning events of the namespace that tell a pod's network failed to be
/// set up or torn down (a sandbox's CNI ADD or DEL: "failed to setup
/// network", "failed to destroy network", "failed to find plugin"). Other
/// warnings are printed, not judged: containerd 1.6 reports FailedKillPod
/// "ttrpc: closed" when the kubelet's two concurrent StopPodSandbox calls
/// race the shim's exit (seen here; the network was torn down and the pod
/// went away).
pub(crate) fn network_failures(ns: &Namespace) -> Vec<String> {
    let events = ns.kubectl(&["get", "events", "-o", "json"]).success().json();
    let mut failures = Vec::new();
    // reason → (how many, the first message)
    let mut others = std::collections::BTreeMap::<String, (usize, String)>::new();
    for event in events["items"].as_array().into_iter().flatten() {
        if event["type"] != "Warning" {
            continue;
        }
        let reason = event["reason"].as_str().unwrap_or_default();
        let message = event["message"].as_str().unwrap_or_default();
        // Whole words: the machines' names start with `cnik`, and a
        // runtime error naming a node's cgroup path is no network failure.
        let lower = message.to_lowercase();
        let words: Vec<&str> = lower.split(|c: char| !c.is_ascii_alphanumeric()).collect();
        if ["network", "cni", "plugin", "networkplugin"].iter().any(|word| {
            words
                .iter()
                .any(|w| w == word || w.strip_suffix('s') == Some(word))
        }) {
            failures.push(format!("{reason}: {message}"));
        } else {
            others
                .entry(reason.to_owned())
                .or_insert_with(|| (0, message.to_owned()))
                .0 += 1;
        }
    }
    if !others.is_empty() {
        eprintln!("other warning events, by reason (count, first message): {others:#?}");
    }
    failures
}

/// A pod as Istio's injector leaves it (CNI mode): the injector's status and
/// interception-mode annotations, an `istio-proxy` sidecar container (here
/// a sleeping busybox given the proxy's `proxy sidecar` arguments), and the
/// `istio-validation` init
/// container, here a busybox script in the spirit of Istio's: it listens on
/// 15001 (the outbound capture port), connects to an address outside, and
/// exits 126 unless the connection was redirected to itself.
pub(crate) fn injected_pod(name: &str) -> String {
    validating_pod(name, true)
}

/// The same pod without the injector's annotations: one Istio's plugin
/// leaves alone, so its validation fails with 126.
pub(crate) fn validating_pod(name: &str, injected: bool) -> String {
    let status = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":[],"imagePullSecrets":null,"revision":"default"}"#;
    let validation = "nc -l -p 15001 -e echo captured & \
                      until netstat -ltn | grep -q ':15001 '; do sleep 0.1; done; \
                      answer=$(timeout 3 nc 192.0.2.1 80 </dev/null); kill %1 2>/dev/null; \
                      [ \"$answer\" = captured ] && exit 0; echo 'no capture' >&2; exit 126";
    let annotations = if injected {
        format!(
            "  annotations:\n    sidecar.istio.io/status: '{status}'\n    sidecar.istio.io/interceptionMode: REDIRECT\n"
        )
    } else {
        String::new()
    };
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  labels: {{app: {name}}}\n{annotations}spec:\n  terminationGracePeriodSeconds: 0\n  initContainers:\n  \
         - name: istio-validation\n    image: docker.io/library/busybox:1.29\n    command: [sh, -c, {validation:?}]\n  \
         containers:\n  - name: app\n    image: {AGNHOST}\n    args: [pause]\n  - name: istio-proxy\n    \
         image: docker.io/library/busybox:1.29\n    command: [sh, -c, 'exec sleep 3600']\n    args: [proxy, sidecar]\n    \
         securityContext: {{runAsUser: 1337}}\n"
    )
}

/// The exit codes the pod's `istio-validation` container ended with so far
/// (last and current state) and its restart count.
pub(crate) fn validation_runs(ns: &Namespace, pod: &str) -> (Vec<i64>, u64) {
    let pod = ns.kubectl(&["get", "pod", pod, "-o", "json"]).success().json();
    let status = &pod["status"]["initContainerStatuses"][0];
    let codes = ["lastState", "state"]
        .iter()
        .filter_map(|s| status[s]["terminated"]["exitCode"].as_i64())
        .collect();
    (codes, status["restartCount"].as_u64().unwrap_or(0))
}

/// Waits (2 minutes at most) for the pod's `istio-validation` to have
/// exited with 126: no capture.
pub(crate) fn validation_failed(ns: &Namespace, pod: &str) {
    poll(
        &format!("{pod}'s validation to fail with 126"),
        Duration::from_secs(120),
        Duration::from_secs(1),
        || {
            let (codes, _) = validation_runs(ns, pod);
            if codes.contains(&126) {
                Ok(())
            } else {
                Err(format!("exit codes so far {codes:?}"))
            }
        },
    );
}

/// Merges `data` (a JSON object) into the ConfigMap of an agent's settings;
/// agents started after read it.
pub(crate) fn patch_settings(cluster: &Cluster, config_map: &str, data: &str) {
    cluster
        .kubectl(&[
            "-n",
            "kube-system",
            "patch",
            "configmap",
            config_map,
            "-p",
            &format!(r#"{{"data":{data}}}"#),
        ])
        .success();
}

/// Installs the suite afresh when the uninstall test ends, whichever way:
/// deleted (nothing to do when the test got that far) and applied again,
/// all nodes at once rather than a rollout node by node; agents that were
/// told to uninstall on stop are stopped before the new ones install.
pub(crate) struct Reinstalled;

impl Drop for Reinstalled {
    fn drop(&mut self) {
        let cluster = Cluster::get();
        if let Err(e) = cluster
            .uninstall()
            .and_then(|()| cluster.apply_manifest("cni-suite.yaml"))
        {
            eprintln!("installing the suite again: {e}");
        }
    }
}

/// A rolling update of the DaemonSet `daemon_set` to a new tag of the
/// same image while pods come and go: none fails to start, none is stuck
/// terminating. `reference_plugins`: plugin types of the chain that are
/// Debian's (Istio's CNI beside another network), whose known DEL race
/// with containerd 1.6 is reported, not failed (see
/// [`reference_del_race`]).
pub(crate) fn rolling_update_with_churn(
    cluster: &'static Cluster,
    daemon_set: &str,
    tag: &str,
    reference_plugins: &[&str],
) {
    let nodes = cluster.nodes();
    for node in &nodes {
        cluster
            .on_node(
                node,
                &[
                    "ctr",
                    "-n",
                    "k8s.io",
                    "images",
                    "tag",
                    "--force",
                    "docker.io/cni-suite/node-agent:0.1.0",
                    &format!("docker.io/cni-suite/node-agent:{tag}"),
                ],
            )
            .success();
    }
    let ns = Namespace::new(cluster, "rolling");
    ns.apply(&pause_deployment("churn", 0, None));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let waves = std::thread::scope(|scope| {
        let churner = scope.spawn(|| churn(&ns, 2 * nodes.len(), &stop));
        // Nothing here may panic before `stop` is set, or the churn goes on.
        let set = cluster.kubectl(&[
            "-n",
            "kube-system",
            "set",
            "image",
            &format!("daemonset/{daemon_set}"),
            &format!("node-agent=cni-suite/node-agent:{tag}"),
        ]);
        let status = cluster.kubectl(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            &format!("daemonset/{daemon_set}"),
            "--timeout=300s",
        ]);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let waves = churner
            .join()
            .expect("the churn of pods failed during the rollout");
        set.success();
        status.success();
        waves
    });
    assert!(waves >= 1, "no wave of pods ran during the rollout");
    let (raced, failures): (Vec<String>, Vec<String>) = network_failures(&ns)
        .into_iter()
        .partition(|failure| reference_del_race(failure, reference_plugins));
    if !raced.is_empty() {
        eprintln!(
            "{} DELs of the reference plugins {reference_plugins:?} lost containerd 1.6's race of two \
             StopPodSandbox calls (retried by the kubelet; not the rollout's): {raced:#?}",
            raced.len()
        );
    }
    assert!(
        failures.is_empty(),
        "pods failed during the rollout: {failures:#?}"
    );
    for node in &nodes {
        assert!(
            matches!(agent_of(cluster, daemon_set, node), Some((_, true))),
            "{node}'s new agent is not Ready"
        );
    }
    eprintln!(
        "rolling update to {tag}: {waves} waves of {} pods created and deleted meanwhile",
        2 * nodes.len()
    );
}

/// Whether a failure is a DEL of one of the reference plugins that lost a
/// race with containerd 1.6: two StopPodSandbox calls of one sandbox
/// overlap and both run the chain's DEL. The second finds what the first
/// removed: eth0 gone (`failed to delete "eth0": no such device`), or the
/// namespace already unmounted, its path no longer nsfs (the node's
/// `/var`, ext4: `unknown FS magic ... ef53`). The Go plugins fail such a
/// DEL; the kubelet retries it and the pod goes (`churn` waits for that).
/// The suite's plugins take both as done (an interface already gone, and
/// `netns::Error::is_gone`), so the rollouts of the suite tolerate none;
/// a failure naming istio-redirect, or a plugin not found, is never one.
pub(crate) fn reference_del_race(failure: &str, reference_plugins: &[&str]) -> bool {
    // The runtime quotes the plugin's type, escaped once more in the event.
    let unquoted = failure.replace(['\\', '"'], "");
    reference_plugins
        .iter()
        .any(|plugin| unquoted.contains(&format!("plugin type={plugin} failed (delete): ")))
}

/// Waits until no pod matching `selector` is left in the namespace.
pub(crate) fn gone(ns: &Namespace, selector: &str) {
    poll(
        &format!("the pods {selector} to be gone"),
        Duration::from_secs(180),
        Duration::from_secs(1),
        || {
            let left = ns
                .kubectl(&["get", "pods", "-l", selector, "--no-headers"])
                .success()
                .stdout;
            if left.trim().is_empty() { Ok(()) } else { Err(left) }
        },
    );
}

/// Waits until every node holds exactly as many attachments of the suite's
/// network (libcni's cached results) as the API server has pods on the pod
/// network there: a pod object is gone before its sandbox's DEL has run.
pub(crate) fn torn_down(cluster: &Cluster) {
    poll(
        "every deleted pod's sandbox to be torn down",
        Duration::from_secs(60),
        Duration::from_millis(500),
        || {
            let pods = cluster.get_json(&["pods", "--all-namespaces"]);
            for node in cluster.nodes() {
                let expected = pods["items"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|p| p["spec"]["nodeName"] == node.as_str() && p["spec"]["hostNetwork"] != true)
                    .count();
                let count = "ls /var/lib/cni/results 2>/dev/null | grep -c '^cni-suite-'; true";
                let attached = cluster.on_node(&node, &["sh", "-c", count]).success().stdout;
                let attached: usize = attached
                    .trim()
                    .parse()
                    .map_err(|e| format!("{node}: {attached:?}: {e}"))?;
                if attached != expected {
                    return Err(format!("{node}: {attached} attachments for {expected} pods"));
                }
            }
            Ok(())
        },
    );
}
