//! Istio's repair controller, done by the agent (`ISTIO_REPAIR`, with
//! `ISTIO_CHAINED`): a pod scheduled before istio-redirect was chained
//! started without capture, and its `istio-validation` init container
//! keeps failing with exit code 126. The agent watches its node's pods and,
//! for each such pod, programs the capture in its running network
//! namespace (by running the chained plugin there, as the runtime would
//! have), or deletes it so it is created again through the chain, or
//! labels it `cni.istio.io/uninitialized=true` for someone else to act on.
//! Each outcome is recorded as an Event on the pod. A repair counts only
//! when the pod holds capture rules afterwards: a plugin that passes the
//! pod through (an excluded namespace, say) leaves it crash-looping, and
//! that is reported and retried as a failure is.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event as KubeEvent, Pod};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::watcher::Event;
use netns::NetNs;
use serde_json::{Value, json};

use crate::cluster::pods::PodEvents;
use crate::cluster::watched::{Key as _, Watched};
use crate::error::Error;
use crate::metrics::{Metrics, Outcome};
use crate::settings::{RepairMode as Mode, Settings};

/// The Events' reason, as Istio's controller names them.
fn event_reason(mode: Mode) -> &'static str {
    match mode {
        Mode::Delete => "DeleteBrokenPod",
        Mode::Label => "LabelBrokenPod",
        Mode::Repair | Mode::Off => "RepairBrokenPod",
    }
}

/// The injector's annotation: only injected pods are looked at.
const SIDECAR_STATUS: &str = "sidecar.istio.io/status";
/// The Events' source.
const COMPONENT: &str = "cni-suite-repair";
/// How often pods still broken are tried again when nothing about them
/// changes (a pod in back-off changes only at its next restart).
const RETRY: Duration = Duration::from_secs(10);
/// How long one pod's action may take.
const ACTION_LIMIT: Duration = Duration::from_secs(30);

/// What makes a pod broken: its validation container, not exited 0 now,
/// last terminated with this exit code (0: any) and message (empty: any).
#[derive(Debug, Clone)]
pub struct Criteria {
    pub init_container: String,
    pub exit_code: i32,
    pub termination_message: String,
}

impl Criteria {
    /// Istio's test, field for field: the current state is checked first
    /// so that a pod whose validation has since passed is never touched.
    pub fn is_broken(&self, pod: &Pod) -> bool {
        let annotated = pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(SIDECAR_STATUS));
        if !annotated {
            return false;
        }
        let statuses = pod
            .status
            .as_ref()
            .and_then(|s| s.init_container_statuses.as_ref());
        statuses.into_iter().flatten().any(|container| {
            if !self.init_container.is_empty() && container.name != self.init_container {
                return false;
            }
            let now = container.state.as_ref().and_then(|s| s.terminated.as_ref());
            if now.is_some_and(|t| t.exit_code == 0 || t.reason.as_deref() == Some("Completed")) {
                return false;
            }
            container
                .last_state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .is_some_and(|last| {
                    (self.exit_code == 0 || last.exit_code == self.exit_code)
                        && (self.termination_message.is_empty()
                            || last.message.as_deref().map(str::trim) == Some(&self.termination_message))
                })
        })
    }
}

/// `key=value` of `ISTIO_REPAIR_LABEL`.
pub fn label(setting: &str) -> Result<(String, String), Error> {
    match setting.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(Error::Setting(format!(
            "ISTIO_REPAIR_LABEL must be key=value, not {setting:?}"
        ))),
    }
}

/// What the repair acts on, and how.
#[derive(Debug, Clone)]
pub struct Options {
    /// This node's name: only its pods are looked at.
    pub node_name: String,
    /// Where the chained plugin is run from.
    pub cni_bin_dir: PathBuf,
    /// The network's name the plugin is told.
    pub network_name: String,
    pub mode: Mode,
    pub criteria: Criteria,
    /// `ISTIO_REPAIR_LABEL`'s key and value.
    pub label: (String, String),
}

impl Options {
    /// Fails on an `ISTIO_REPAIR_LABEL` that is not key=value.
    pub fn from_settings(settings: &Settings) -> Result<Options, Error> {
        Ok(Options {
            node_name: settings.node_name.clone(),
            cni_bin_dir: settings.cni_bin_dir.clone(),
            network_name: settings.network_name.clone(),
            mode: settings.istio_repair,
            criteria: Criteria {
                init_container: settings.istio_repair_init_container.clone(),
                exit_code: settings.istio_repair_exit_code,
                termination_message: settings.istio_repair_termination_message.trim().to_owned(),
            },
            label: label(&settings.istio_repair_label)?,
        })
    }
}

type Key = (String, String);

/// The controller's state: its node's pods and what it did to them.
struct Controller {
    client: kube::Client,
    options: Options,
    /// istio-redirect's chain entry, run against a pod to repair it.
    entry: Value,
    /// What was done, by pod UID and resourceVersion. A repair is done
    /// once per UID: the pod keeps failing until its next restart, and
    /// programming it again would change nothing. A deletion or a label
    /// is not sent twice for one version.
    acted: HashMap<Key, (String, String)>,
    /// The last failure per pod, so one that keeps failing is reported
    /// once, not every retry.
    failures: HashMap<Key, String>,
    /// Where every outcome is counted, each retry's failure too, as
    /// Istio's repair controller counts them.
    metrics: Metrics,
}

/// Follows this node's pods (`pods`, read from the agent's one Pod
/// watch) until the task is aborted or the watch ends; `entry` is
/// istio-redirect's chain entry.
pub async fn run(
    client: kube::Client,
    options: Options,
    entry: Value,
    metrics: Metrics,
    mut pods: PodEvents,
) {
    let mode = options.mode;
    let mut controller = Controller {
        client,
        options,
        entry,
        acted: HashMap::new(),
        failures: HashMap::new(),
        metrics,
    };
    // Whole pods: whether one is broken is read from its container statuses.
    let mut known: Watched<Key, Pod> = Watched::default();
    let mut retry = tokio::time::interval(RETRY);
    log::info!(
        "repairing pods of node {} whose {} failed ({mode:?})",
        controller.options.node_name,
        controller.options.criteria.init_container
    );
    loop {
        let event = tokio::select! {
            event = pods.next() => match event {
                Some(event) => event,
                None => {
                    log::error!("the Pod watch ended: no more repairs");
                    return;
                }
            },
            _ = retry.tick() => {
                for pod in known.known().values() {
                    controller.reconcile(pod).await;
                }
                continue;
            }
        };
        if !known.take(&event, |pod| Some(pod.clone())) {
            continue;
        }
        match &*event {
            Event::InitDone => {
                controller.forget_except(known.known());
                for pod in known.known().values() {
                    controller.reconcile(pod).await;
                }
            }
            Event::Apply(pod) => controller.reconcile(pod).await,
            Event::Delete(_) => controller.forget_except(known.known()),
            Event::Init | Event::InitApply(_) => {}
        }
    }
}

impl Controller {
    /// Drops what is remembered about pods no longer there.
    fn forget_except(&mut self, pods: &BTreeMap<Key, Pod>) {
        self.acted.retain(|key, _| pods.contains_key(key));
        self.failures.retain(|key, _| pods.contains_key(key));
    }

    async fn reconcile(&mut self, pod: &Pod) {
        let Some(key) = Key::of(&pod.metadata) else {
            return;
        };
        if pod.metadata.deletion_timestamp.is_some() || !self.options.criteria.is_broken(pod) {
            self.failures.remove(&key);
            return;
        }
        let uid = pod_uid(pod);
        let version = pod.metadata.resource_version.clone().unwrap_or_default();
        let done_before = self.acted.get(&key);
        let action = async {
            match self.options.mode {
                Mode::Off => None,
                Mode::Repair if done_before.is_some_and(|(done, _)| *done == uid) => None,
                Mode::Repair => Some(self.repair(pod).await.and_then(Capture::programmed)),
                _ if done_before == Some(&(uid.clone(), version.clone())) => None,
                Mode::Delete => Some(self.delete(pod, &key).await.map(|()| "deleted")),
                Mode::Label => {
                    let labels = pod.metadata.labels.as_ref();
                    let labelled = labels.is_some_and(|l| l.contains_key(&self.options.label.0));
                    if labelled {
                        None
                    } else {
                        Some(self.add_label(&key).await.map(|()| "labeled"))
                    }
                }
            }
        };
        // A server that never answers holds one pod's turn, not the
        // controller.
        let outcome = match tokio::time::timeout(ACTION_LIMIT, action).await {
            Ok(None) => return,
            Ok(Some(outcome)) => outcome,
            Err(_) => Err(Error::Io(format!("no outcome within {ACTION_LIMIT:?}"))),
        };
        let reason = event_reason(self.options.mode);
        let (namespace, name) = &key;
        let counted = if outcome.is_ok() {
            Outcome::Success
        } else {
            Outcome::Failure
        };
        self.metrics.repaired(self.options.mode, counted);
        match outcome {
            Ok(done) => {
                self.failures.remove(&key);
                self.acted.insert(key.clone(), (uid, version));
                log::info!(
                    "pod {namespace}/{name}: its {} failed; {done}",
                    self.options.criteria.init_container
                );
                self.record(pod, "Normal", reason, &format!("pod detected as broken, {done}"))
                    .await;
            }
            Err(e) => {
                let text = e.to_string();
                if self.failures.get(&key) != Some(&text) {
                    log::error!("pod {namespace}/{name} is broken and could not be handled: {text}");
                    self.record(
                        pod,
                        "Warning",
                        reason,
                        &format!("pod detected as broken, but: {text}"),
                    )
                    .await;
                    self.failures.insert(key, text);
                }
            }
        }
    }

    /// Runs istio-redirect's ADD in the pod's namespace, as the runtime
    /// would have run it through the chain had it been there.
    async fn repair(&self, pod: &Pod) -> Result<Capture, Error> {
        let ips = pod_ips(pod);
        if ips.is_empty() {
            return Err(Error::Io("the pod has no IP yet".into()));
        }
        let request = RepairRequest {
            plugin: self.options.cni_bin_dir.join("istio-redirect"),
            bin_dir: self.options.cni_bin_dir.clone(),
            stdin: with_decisions_logged(plugin_config(&self.entry, &self.options.network_name, pod)),
            args: kubernetes_args(pod),
            container_id: pod_uid(pod),
            ips,
        };
        tokio::task::spawn_blocking(move || request.run())
            .await
            .map_err(Error::task("repairing"))?
    }

    async fn delete(&self, pod: &Pod, (namespace, name): &Key) -> Result<(), Error> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: pod.metadata.uid.clone(),
                resource_version: pod.metadata.resource_version.clone(),
            }),
            ..DeleteParams::default()
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        pods.delete(name, &params).await?;
        Ok(())
    }

    /// Through `pods/status`, which can change a pod's metadata too and is
    /// the smaller grant.
    async fn add_label(&self, (namespace, name): &Key) -> Result<(), Error> {
        let (label, value) = &self.options.label;
        let patch = json!({"metadata": {"labels": {label: value}}});
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// An Event on the pod, as `kubectl describe pod` shows it; failing to
    /// record one is only logged.
    async fn record(&self, pod: &Pod, kind: &str, reason: &str, message: &str) {
        let (Some(namespace), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
            return;
        };
        let now = k8s_openapi::jiff::Timestamp::now();
        let event = json!({
            "metadata": {
                "name": format!("{name}.{:x}", now.as_nanosecond()),
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": namespace,
                "name": name,
                "uid": pod.metadata.uid,
                "resourceVersion": pod.metadata.resource_version,
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": COMPONENT, "host": self.options.node_name},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.options.node_name,
            "firstTimestamp": now.to_string(),
            "lastTimestamp": now.to_string(),
            "count": 1,
        });
        let created = match serde_json::from_value::<KubeEvent>(event) {
            Ok(event) => Api::<KubeEvent>::namespaced(self.client.clone(), namespace)
                .create(&PostParams::default(), &event)
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = created {
            log::warn!("cannot record an event on pod {namespace}/{name}: {e}");
        }
    }
}

fn pod_uid(pod: &Pod) -> String {
    pod.metadata.uid.clone().unwrap_or_default()
}

/// `status.podIPs`, else `status.podIP`.
fn pod_ips(pod: &Pod) -> Vec<IpAddr> {
    let Some(status) = &pod.status else {
        return Vec::new();
    };
    let listed: Vec<&str> = status.pod_ips.iter().flatten().map(|ip| ip.ip.as_str()).collect();
    let texts = if listed.is_empty() {
        status.pod_ip.as_deref().into_iter().collect()
    } else {
        listed
    };
    texts.iter().filter_map(|ip| ip.parse().ok()).collect()
}

/// The arguments a kubelet's runtime passes.
fn kubernetes_args(pod: &Pod) -> String {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let uid = pod_uid(pod);
    format!(
        "K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID={uid};K8S_POD_UID={uid}"
    )
}

/// The entry as libcni hands it to the plugin: with the network's name
/// and version, and the pod's annotations in `runtimeConfig` when the
/// entry declares them as a capability (otherwise the plugin reads the
/// pod itself). Without the agent's log socket: the agent reads this
/// run's records from the plugin's stderr itself (see
/// [`log_plugin_records`]), and would log them twice.
fn plugin_config(entry: &Value, network: &str, pod: &Pod) -> Value {
    let mut config = crate::conf_dir::without_log_socket(entry);
    config["cniVersion"] = json!("1.0.0");
    config["name"] = json!(network);
    if let Some(capabilities) = config.get("capabilities").and_then(Value::as_object) {
        let wanted = capabilities.get(cni::conf::POD_ANNOTATIONS_KEY) == Some(&json!(true));
        if wanted {
            config["runtimeConfig"] = json!({
                cni::conf::POD_ANNOTATIONS_KEY: pod.metadata.annotations.clone().unwrap_or_default(),
            });
        }
    }
    config
}

/// The plugin's entry at a log level where it says why it passes a pod
/// through, which is all the agent reads of its info records. A level it
/// would refuse is left for it to refuse, as the runtime's ADD would.
fn with_decisions_logged(mut config: Value) -> Value {
    let quiet = match config.get("plugin_log_level") {
        None => true,
        Some(level) => level.as_str().is_some_and(|level| {
            matches!(
                level.to_ascii_lowercase().as_str(),
                "off" | "none" | "panic" | "error" | "warn" | "warning"
            )
        }),
    };
    if quiet {
        config["plugin_log_level"] = json!("info");
    }
    config
}

/// What istio-redirect's record of a pass-through says after this, as
/// it logs it: "not capturing: <reason>".
const PASS_THROUGH: &str = "not capturing: ";

/// The reason istio-redirect logged for passing the pod through, if any.
fn pass_through_reason(log: &str) -> Option<&str> {
    log.lines()
        .filter_map(|line| line.split_once(PASS_THROUGH))
        .map(|(_, reason)| reason.trim())
        .next_back()
}

/// Passes the plugin's records on as the agent's own: its warnings and
/// errors as warnings, the rest (info records asked for only to read the
/// reason of a pass-through) at debug.
fn log_plugin_records(plugin: &str, log: &str) {
    for line in log.lines().filter(|line| !line.trim().is_empty()) {
        // "<time> <LEVEL> <plugin>[<pid>]: <message>"
        let level = line.split_whitespace().nth(1).unwrap_or_default();
        if matches!(level, "WARN" | "ERROR") {
            log::warn!("{plugin}: {line}");
        } else {
            log::debug!("{plugin}: {line}");
        }
    }
}

/// What running the plugin left in the pod.
#[derive(Debug, PartialEq, Eq)]
enum Capture {
    Programmed,
    /// No capture rules after a successful ADD: the plugin passed the pod
    /// through, for the reason it logged if it logged one.
    PassedThrough(Option<String>),
}

impl Capture {
    /// A pass-through repairs nothing: the pod keeps crash-looping, so it
    /// is reported and retried as a failure is.
    fn programmed(self) -> Result<&'static str, Error> {
        match self {
            Capture::Programmed => Ok("capture programmed in the running pod"),
            Capture::PassedThrough(reason) => Err(Error::Io(format!(
                "the capture was not programmed: istio-redirect passed the pod through ({})",
                reason.as_deref().unwrap_or("it logged no reason")
            ))),
        }
    }
}

/// One repair, run off the async threads: it scans /proc and enters
/// namespaces.
struct RepairRequest {
    plugin: PathBuf,
    bin_dir: PathBuf,
    stdin: Value,
    args: String,
    container_id: String,
    ips: Vec<IpAddr>,
}

impl RepairRequest {
    /// The plugin's ADD, then the pod's rules read: the plugin succeeds
    /// whether it captures or passes through.
    fn run(self) -> Result<Capture, Error> {
        let netns = crate::pod_netns::find(Path::new("/proc"), &self.ips)?.ok_or_else(|| {
            Error::Io(format!(
                "no process on this node is in a network namespace holding {:?}",
                self.ips
            ))
        })?;
        let log = self.add(&netns)?;
        let in_pod = |e: String| Error::Io(format!("reading the capture rules in {}: {e}", netns.display()));
        let ns = NetNs::open(&netns).map_err(|e| in_pod(e.to_string()))?;
        if istio_redirect::rules::captured(&ns).map_err(|e| in_pod(e.to_string()))? {
            return Ok(Capture::Programmed);
        }
        Ok(Capture::PassedThrough(
            pass_through_reason(&log).map(str::to_owned),
        ))
    }

    /// Runs the plugin as libcni does and returns its log, which the
    /// agent reads instead of passing it on raw (its own log is JSON).
    fn add(&self, netns: &Path) -> Result<String, Error> {
        let failed =
            |e: cni::Error| Error::Io(format!("{} in {}: {e}", self.plugin.display(), netns.display()));
        let env: [(&str, OsString); 6] = [
            ("CNI_COMMAND", "ADD".into()),
            ("CNI_CONTAINERID", self.container_id.clone().into()),
            ("CNI_NETNS", netns.as_os_str().to_owned()),
            ("CNI_IFNAME", "eth0".into()),
            ("CNI_ARGS", self.args.clone().into()),
            ("CNI_PATH", self.bin_dir.clone().into_os_string()),
        ];
        let output =
            cni::exec::run_plugin(&self.plugin, &env, self.stdin.to_string().as_bytes()).map_err(failed)?;
        let log = String::from_utf8_lossy(&output.stderr).into_owned();
        let name = self.plugin.file_name().unwrap_or_default().to_string_lossy();
        log_plugin_records(&name, &log);
        cni::exec::judge(output).map_err(failed)?;
        Ok(log)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn criteria() -> Criteria {
        Criteria {
            init_container: "istio-validation".into(),
            exit_code: 126,
            termination_message: String::new(),
        }
    }

    /// An injected pod whose validation container is in `state` after
    /// last terminating with `last_exit` (and `message`).
    fn pod(state: Value, last_exit: Option<i32>, message: &str) -> Pod {
        let last = last_exit.map_or(
            json!({}),
            |code| json!({"terminated": {"exitCode": code, "reason": "Error", "message": message}}),
        );
        serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "default",
                         "annotations": {SIDECAR_STATUS: "{}"}},
            "status": {"initContainerStatuses": [{
                "name": "istio-validation", "ready": false, "restartCount": 3,
                "image": "proxyv2", "imageID": "",
                "state": state, "lastState": last,
            }]},
        }))
        .expect("a pod")
    }

    fn waiting() -> Value {
        json!({"waiting": {"reason": "CrashLoopBackOff"}})
    }

    #[test]
    fn a_pod_crashlooping_on_the_validation_exit_code_is_broken() {
        assert!(criteria().is_broken(&pod(waiting(), Some(126), "")));
    }

    #[test]
    fn a_pod_whose_validation_passed_now_is_never_broken() {
        let passed = json!({"terminated": {"exitCode": 0, "reason": "Completed"}});
        assert!(!criteria().is_broken(&pod(passed, Some(126), "")));
    }

    #[test]
    fn other_exit_codes_containers_and_unannotated_pods_are_left_alone() {
        assert!(!criteria().is_broken(&pod(waiting(), Some(1), "")));
        assert!(!criteria().is_broken(&pod(waiting(), None, "")));
        let mut unannotated = pod(waiting(), Some(126), "");
        unannotated.metadata.annotations = None;
        assert!(!criteria().is_broken(&unannotated));
        let other = Criteria {
            init_container: "istio-init".into(),
            ..criteria()
        };
        assert!(!other.is_broken(&pod(waiting(), Some(126), "")));
        let any_code = Criteria {
            exit_code: 0,
            ..criteria()
        };
        assert!(any_code.is_broken(&pod(waiting(), Some(1), "")));
    }

    #[test]
    fn a_termination_message_when_set_must_match_trimmed() {
        let with_message = Criteria {
            termination_message: "iptables validation failed".into(),
            ..criteria()
        };
        assert!(with_message.is_broken(&pod(waiting(), Some(126), "iptables validation failed\n")));
        assert!(!with_message.is_broken(&pod(waiting(), Some(126), "something else")));
    }

    #[test]
    fn the_plugin_gets_the_annotations_only_when_its_entry_asks_for_them() {
        let broken = pod(waiting(), Some(126), "");
        let asking = json!({"type": "istio-redirect",
                            "capabilities": {"io.kubernetes.cri.pod-annotations": true}});
        let config = plugin_config(&asking, "k8s-pod-network", &broken);
        assert_eq!(config["name"], "k8s-pod-network");
        assert_eq!(
            config["runtimeConfig"]["io.kubernetes.cri.pod-annotations"][SIDECAR_STATUS],
            "{}"
        );
        let config = plugin_config(
            &json!({"type": "istio-redirect", "logSocket": "/run/cni-suite/log.sock"}),
            "n",
            &broken,
        );
        assert!(config.get("runtimeConfig").is_none());
        assert!(
            config.get("logSocket").is_none(),
            "the agent reads this run's stderr"
        );
    }

    #[test]
    fn the_plugin_is_asked_to_say_why_it_passes_a_pod_through() {
        let quiet = with_decisions_logged(json!({"type": "istio-redirect", "plugin_log_level": "warn"}));
        assert_eq!(quiet["plugin_log_level"], "info");
        assert_eq!(with_decisions_logged(json!({}))["plugin_log_level"], "info");
        let verbose = with_decisions_logged(json!({"plugin_log_level": "DEBUG"}));
        assert_eq!(verbose["plugin_log_level"], "DEBUG");
        let invalid = with_decisions_logged(json!({"plugin_log_level": 3}));
        assert_eq!(invalid["plugin_log_level"], 3);
    }

    #[test]
    fn the_reason_of_a_pass_through_is_read_from_the_plugins_log() {
        let log = "2026-01-02T03:04:05.678Z INFO  istio-redirect[42]: not capturing: namespace istio-system is excluded\n";
        assert_eq!(
            pass_through_reason(log),
            Some("namespace istio-system is excluded")
        );
        assert_eq!(
            pass_through_reason("2026-01-02T03:04:05.678Z WARN  x[1]: other\n"),
            None
        );
        assert_eq!(pass_through_reason(""), None);
    }

    #[test]
    fn a_pass_through_is_a_failure_that_says_why() {
        assert_eq!(
            Capture::Programmed.programmed().expect("a repair"),
            "capture programmed in the running pod"
        );
        let skipped = Capture::PassedThrough(Some("namespace istio-system is excluded".into()))
            .programmed()
            .expect_err("not a repair")
            .to_string();
        assert!(skipped.contains("not programmed"), "{skipped}");
        assert!(
            skipped.contains("namespace istio-system is excluded"),
            "{skipped}"
        );
        let silent = Capture::PassedThrough(None)
            .programmed()
            .expect_err("not a repair");
        assert!(silent.to_string().contains("no reason"), "{silent}");
    }

    #[test]
    fn labels_are_key_equals_value() {
        assert_eq!(
            label("cni.istio.io/uninitialized=true").expect("valid"),
            ("cni.istio.io/uninitialized".into(), "true".into())
        );
        assert!(label("novalue").is_err());
        assert!(label("=x").is_err());
    }
}
