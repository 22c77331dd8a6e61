//! Istio's ambient mode, the agent's side: an enrolled pod's ADD (the
//! istio-redirect entry with `ambient_enabled`) sends its event to
//! [`plugin_events`]; the agent checks the pod again against its own cache
//! (the plugin asked the API server; the cache may lag, so it looks up to
//! [`LOOKUPS`] times, [`LOOKUP_PAUSE`] apart, as Istio's agent does),
//! programs the in-pod redirection inside the pod's namespace
//! (`istio_redirect::rules::ambient`, on a blocking thread through the one
//! netns helper), hands ztunnel the namespace over ZDS ([`zds_server`])
//! and answers only once ztunnel acked: the pod is in the mesh from its
//! first packet, or its ADD fails and the runtime retries.
//!
//! A pod deleted, or finished, leaves the mesh (a delete to every ztunnel);
//! its rules go with its namespace. DEL sends nothing, as Istio's.

pub mod plugin_events;
pub mod records;
pub mod zds_server;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use firewall::Family;
use futures::StreamExt;
use istio_redirect::enrolment::{Candidate, Enrolment};
use istio_redirect::rules::ambient::{InPod, program};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use labels::Labels;
use netns::NetNs;
use serde_json::Value;
use tokio::sync::mpsc;
use zds::WorkloadInfo;

use self::plugin_events::{Event, PluginEvents};
use self::records::Records;
use self::zds_server::{Listener, Zds};
use crate::cluster::pods::PodEvents;
use crate::cluster::watched::Watched;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::run_socket::LOOK_AGAIN;
use crate::settings::Settings;

/// How often a pod event's pod is looked for in the cache, and the pause
/// between looks (Istio's agent: 10 × 10 ms).
pub const LOOKUPS: u32 = 10;
pub const LOOKUP_PAUSE: Duration = Duration::from_millis(10);

/// What ambient mode needs of the settings and of Istio's entry.
#[derive(Debug, Clone)]
pub struct Options {
    pub node_name: String,
    /// Where the plugin sends its pod events: the entry's
    /// `cni_agent_run_dir`, as the plugin reads it.
    pub pod_event_socket: PathBuf,
    pub ztunnel_socket: PathBuf,
    /// The entry's selectors, as the plugin reads them.
    pub enrolment: Enrolment,
    pub exclude_namespaces: Vec<String>,
    /// DNS to ztunnel's proxy unless a pod says otherwise.
    pub dns_capture: bool,
    /// IPv6 rules for pods with IPv6 addresses.
    pub ipv6: bool,
}

impl Options {
    /// Where the pods' records are: beside the pod event socket.
    fn records_dir(&self) -> PathBuf {
        let run_dir = self.pod_event_socket.parent().unwrap_or(Path::new("/"));
        run_dir.join("ambient-pods")
    }

    /// None unless Istio's entry (`entry`, as the agent writes it) enables
    /// ambient mode.
    pub fn from_settings(settings: &Settings, entry: &Value) -> Result<Option<Options>, Error> {
        let read = istio_redirect::ambient_of_entry(entry)
            .map_err(|e| Error::Setting(format!("Istio's entry in ambient mode: {}", e.msg)))?;
        Ok(read.map(|read| Options {
            node_name: settings.node_name.clone(),
            pod_event_socket: read.ambient.pod_event_socket,
            ztunnel_socket: settings.ztunnel_uds_address.clone(),
            enrolment: read.ambient.enrolment,
            exclude_namespaces: read.exclude_namespaces,
            dns_capture: settings.ambient_dns_capture,
            ipv6: settings.ambient_ipv6,
        }))
    }
}

/// What the controller reads of a pod of this node; None for one that
/// finished (it leaves the mesh).
#[derive(Debug, Clone, PartialEq)]
struct PodFacts {
    uid: String,
    labels: Labels,
    annotations: BTreeMap<String, String>,
    host_network: bool,
    service_account: String,
    /// As its status reports them: how an agent that restarted finds the
    /// pod's namespace.
    ips: Vec<IpAddr>,
}

impl PodFacts {
    fn of(pod: &Pod) -> Option<PodFacts> {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            return None;
        }
        let spec = pod.spec.as_ref();
        Some(PodFacts {
            uid: pod.metadata.uid.clone()?,
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            annotations: pod.metadata.annotations.clone().unwrap_or_default(),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            service_account: spec
                .and_then(|s| s.service_account_name.clone())
                .filter(|name| !name.is_empty())
                .unwrap_or_else(|| "default".to_owned()),
            ips: pod
                .status
                .as_ref()
                .and_then(|status| status.pod_ips.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|ip| ip.ip.parse().ok())
                .collect(),
        })
    }
}

/// This node's pods and every namespace's labels, as the watches left them.
#[derive(Debug, Default)]
struct Cache {
    pods: Watched<(String, String), PodFacts>,
    namespaces: Watched<String, Labels>,
}

/// The cache, shared by the watch loop and the pod events' tasks.
#[derive(Debug, Clone, Default)]
struct Shared(Arc<Mutex<Cache>>);

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Cache> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether both watches have listed once.
    fn listed(&self) -> bool {
        let cache = self.lock();
        cache.pods.listed_once() && cache.namespaces.listed_once()
    }
}

/// Serves ambient mode until the task is aborted: the pod event socket,
/// the ZDS socket, and the watches that tell which pods are enrolled.
pub async fn run(client: kube::Client, options: Options, mut pods: PodEvents, metrics: Metrics) {
    let options = Arc::new(options);
    let zds = Zds::new(metrics.clone());
    let records = Records::new(options.records_dir());
    // ztunnel is let in once the pods already in the mesh are known again,
    // so that its first snapshot names them all (one without them would
    // drain them); the ZDS server ends with this task.
    let mut listening = tokio::task::JoinSet::new();
    let cache = Shared::default();
    let mut plugin_events = PluginEvents::new(options.pod_event_socket.clone());
    let (events, mut received) = mpsc::channel::<Event>(64);
    let mut namespaces = watcher::watcher(Api::<Namespace>::all(client), watcher::Config::default())
        .default_backoff()
        .boxed();
    loop {
        tokio::select! {
            () = plugin_events.accept(&events, &metrics) => {}
            Some(Event { event, answer }) = received.recv() => {
                let (cache, zds, options, records) = (cache.clone(), zds.clone(), Arc::clone(&options), records.clone());
                tokio::spawn(async move {
                    let who = format!("{}/{}", event.pod_namespace, event.pod_name);
                    let outcome = enrol(event, &cache, &zds, &options, &records).await;
                    match &outcome {
                        Ok(()) => log::info!("ambient: pod {who} is in the mesh"),
                        Err(reason) => log::warn!("ambient: pod {who} is not in the mesh: {reason}"),
                    }
                    let _ = answer.send(outcome);
                });
            }
            Some(event) = pods.next() => {
                if cache.lock().pods.take(&event, PodFacts::of) {
                    leave_the_gone(&cache, &zds, &records);
                }
            }
            Some(event) = namespaces.next() => match event {
                Ok(event) => {
                    let labels = |ns: &Namespace| Some(ns.metadata.labels.clone().unwrap_or_default());
                    cache.lock().namespaces.take(&event, labels);
                }
                Err(e) => log::warn!("ambient: watching Namespaces: {e}; retrying"),
            },
        }
        if listening.is_empty() && cache.listed() {
            restore(&cache, &zds, &options, &records).await;
            listening.spawn(listen_for_ztunnel(zds.clone(), options.ztunnel_socket.clone()));
        }
    }
}

/// Binds the ZDS socket and serves ztunnel there; while it cannot bind, no
/// ztunnel connects and enrolled pods do not start.
async fn listen_for_ztunnel(zds: Zds, path: PathBuf) {
    loop {
        match Listener::bind(&path) {
            Ok(listener) => return zds.serve(listener).await,
            Err(e) => {
                log::error!(
                    "ambient: cannot listen on {} for ztunnel: {e}; enrolled pods do not start; \
                     trying again every {LOOK_AGAIN:?}",
                    path.display()
                );
                tokio::time::sleep(LOOK_AGAIN).await;
            }
        }
    }
}

/// Takes out of the mesh every pod the cache no longer has (deleted,
/// finished, gone while the watch was down).
fn leave_the_gone(cache: &Shared, zds: &Zds, records: &Records) {
    let present: BTreeSet<String> = cache
        .lock()
        .pods
        .known()
        .values()
        .map(|pod| pod.uid.clone())
        .collect();
    for uid in zds.uids() {
        if !present.contains(&uid) {
            log::info!("ambient: pod {uid} is gone; out of the mesh");
            zds.remove(&uid);
            records.forget(&uid);
        }
    }
}

/// Puts back in the mesh the enrolled pods already running on the node
/// (an agent that restarted, or one that enrols them for the first time):
/// each one's namespace where its record says (`records`), else found
/// through /proc by its addresses (one scan for all of those), its in-pod
/// rules programmed again (they converge: the rules an agent put there
/// stay through its restart), and the pod restored for ztunnel's snapshot;
/// one whose namespace is not found, as a keep.
async fn restore(cache: &Shared, zds: &Zds, options: &Arc<Options>, records: &Records) {
    let enrolled: Vec<(Key, PodFacts)> = {
        let cache = cache.lock();
        cache
            .pods
            .known()
            .iter()
            .filter(|(key, pod)| !pod.ips.is_empty() && is_enrolled(&cache, options, key, pod))
            .map(|(key, pod)| (key.clone(), pod.clone()))
            .collect()
    };
    if enrolled.is_empty() {
        return;
    }
    let (options, records) = (Arc::clone(options), records.clone());
    let restored = tokio::task::spawn_blocking(move || {
        let noted: Vec<Option<PathBuf>> = enrolled
            .iter()
            .map(|(_, pod)| {
                records
                    .netns_of(&pod.uid)
                    .filter(|path| crate::pod_netns::holds_any(path, &pod.ips).unwrap_or(false))
            })
            .collect();
        let unnoted: Vec<Vec<IpAddr>> = enrolled
            .iter()
            .zip(&noted)
            .filter(|(_, noted)| noted.is_none())
            .map(|((_, pod), _)| pod.ips.clone())
            .collect();
        let mut scanned = crate::pod_netns::find_all(Path::new("/proc"), &unnoted)
            .unwrap_or_else(|e| {
                log::warn!("ambient: finding the enrolled pods' namespaces: {e}");
                vec![None; unnoted.len()]
            })
            .into_iter();
        enrolled
            .into_iter()
            .zip(noted)
            .map(|((key, pod), noted)| {
                let by_record = noted.is_some();
                let path = noted.or_else(|| scanned.next().flatten());
                let netns = path.and_then(|path| {
                    program_in(&path, &options, &pod, &pod.ips)
                        .map_err(|e| log::warn!("ambient: pod {}/{}: {e}", key.0, key.1))
                        .ok()
                });
                (key, pod, netns.map(|netns| (netns, by_record)))
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    let (mut by_record, mut scanned, mut kept) = (0, 0, 0);
    for ((namespace, name), pod, netns) in restored {
        let netns = match netns {
            Some((netns, true)) => {
                by_record += 1;
                Some(netns)
            }
            Some((netns, false)) => {
                scanned += 1;
                Some(netns)
            }
            None => None,
        };
        if netns.is_none() {
            kept += 1;
            log::warn!(
                "ambient: pod {namespace}/{name}: its namespace was not found; ztunnel is told to keep it as it is"
            );
        }
        let info = WorkloadInfo {
            name,
            namespace,
            service_account: pod.service_account,
        };
        zds.restore(&pod.uid, info, netns.map(Arc::new));
    }
    log::info!(
        "ambient: enrolled pods found in their namespaces: {by_record} by their records, {scanned} through /proc; \
         {kept} kept without"
    );
}

/// A pod's namespace and name.
type Key = (String, String);

/// Whether the pod is enrolled, by the cache's view of it and of its
/// namespace.
fn is_enrolled(cache: &Cache, options: &Options, (namespace, _): &Key, pod: &PodFacts) -> bool {
    if options.exclude_namespaces.contains(namespace) {
        return false;
    }
    let Some(namespace_labels) = cache.namespaces.known().get(namespace) else {
        return false;
    };
    let candidate = Candidate::new(&pod.labels, &pod.annotations, pod.host_network);
    options.enrolment.matches(candidate, namespace_labels)
}

/// Opens the namespace at `path` and programs the pod's in-pod rules
/// there, in the families of `addresses` (IPv4 when there are none; IPv6
/// only when the agent does IPv6). Blocks: run off the async threads.
fn program_in(path: &Path, options: &Options, pod: &PodFacts, addresses: &[IpAddr]) -> Result<NetNs, String> {
    let mut families = Vec::new();
    if addresses.iter().any(IpAddr::is_ipv4) || addresses.is_empty() {
        families.push(Family::V4);
    }
    if options.ipv6 && addresses.iter().any(IpAddr::is_ipv6) {
        families.push(Family::V6);
    }
    let in_pod = InPod::new(
        options.dns_capture,
        &istio_redirect::ambient_overrides(&pod.annotations),
    );
    let netns = NetNs::open(path).map_err(|e| e.to_string())?;
    program(&netns, &in_pod, &families, None).map_err(|e| format!("the in-pod rules: {e}"))?;
    Ok(netns)
}

/// The pod of a plugin's event in the mesh, or why not.
async fn enrol(
    event: agent_wire::pod_event::PodEvent,
    cache: &Shared,
    zds: &Zds,
    options: &Arc<Options>,
    records: &Records,
) -> Result<(), String> {
    let key: Key = (event.pod_namespace.clone(), event.pod_name.clone());
    let (namespace, name) = &key;
    let mut found = None;
    for look in 0..LOOKUPS {
        {
            let cache = cache.lock();
            // Known with its namespace: whether it is enrolled is then the
            // answer.
            if let Some(pod) = cache.pods.known().get(&key)
                && cache.namespaces.known().contains_key(namespace)
            {
                if !is_enrolled(&cache, options, &key, pod) {
                    return Err(format!(
                        "pod {namespace}/{name} is unexpectedly not eligible for ambient enrollment"
                    ));
                }
                found = Some(pod.clone());
                break;
            }
        }
        if look + 1 < LOOKUPS {
            tokio::time::sleep(LOOKUP_PAUSE).await;
        }
    }
    let Some(pod) = found else {
        return Err(format!(
            "failed to get pod {namespace}/{name}: not in the agent's cache of this node's pods"
        ));
    };
    // Before the pod is touched: without ztunnel it cannot be in the mesh.
    if zds.connected() == 0 {
        return Err(zds_server::ZdsError::NoConnection.to_string());
    }
    let programmed = {
        let (options, pod, records) = (Arc::clone(options), pod.clone(), records.clone());
        let addresses = event.addresses();
        tokio::task::spawn_blocking(move || {
            let path = Path::new(&event.netns);
            let netns = program_in(path, &options, &pod, &addresses)?;
            records.remember(&pod.uid, path);
            Ok::<_, String>(netns)
        })
    };
    let netns = programmed
        .await
        .map_err(|e| format!("programming the in-pod rules: {e}"))??;
    let info = WorkloadInfo {
        name: name.clone(),
        namespace: namespace.clone(),
        service_account: pod.service_account,
    };
    let added = zds.add(&pod.uid, info, Arc::new(netns)).await;
    if added.is_err() {
        records.forget(&pod.uid);
    }
    added.map_err(|e| e.to_string())
}
