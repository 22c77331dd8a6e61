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
//! its rules go with its namespace. DEL sends nothing, as Istio's. A pod
//! whose enrolment changes while it runs joins or leaves where it runs
//! ([`live`]).

pub mod cache;
pub mod host_probe;
pub mod in_pod;
pub mod live;
pub mod options;
pub mod plugin_events;
pub mod records;
pub mod zds_server;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use tokio::sync::mpsc;

pub use self::options::Options;

use self::cache::{Key, PodFacts, Shared, is_enrolled};
use self::host_probe::HostProbes;
use self::in_pod::{annotate, program_in};
use self::live::{Live, RECHECK};
use self::plugin_events::{Event, PluginEvents};
use self::records::Records;
use self::zds_server::Zds;
use crate::cluster::pods::PodEvents;
use crate::metrics::Metrics;
use crate::run_socket::LOOK_AGAIN;
use istio_redirect::rules::ambient::InPodBackend;

/// How long the agent works on a pod event: inside the plugin's wait
/// (`agent_wire::pod_event::WAIT`), so the plugin hears the answer, and an
/// add it gave up on is never sent to ztunnel.
pub const ENROL_WAIT: Duration = agent_wire::pod_event::WAIT.saturating_sub(Duration::from_millis(500));

/// How often a pod event's pod is looked for in the cache, and the pause
/// between looks (Istio's agent: 10 × 10 ms).
pub const LOOKUPS: u32 = 10;
pub const LOOKUP_PAUSE: Duration = Duration::from_millis(10);

/// Serves ambient mode until the task is aborted: the pod event socket,
/// the ZDS socket, and the watches that tell which pods are enrolled.
pub async fn run(client: kube::Client, options: Options, mut pods: PodEvents, metrics: Metrics) {
    let options = Arc::new(options);
    let zds = Zds::new(metrics.clone());
    let host = host_probes(&options);
    let mut host_installed = false;
    let records = Records::new(options.records_dir());
    // ztunnel is let in once the pods already in the mesh are known again,
    // so that its first snapshot names them all (one without them would
    // drain them); the ZDS server ends with this task.
    let mut listening = tokio::task::JoinSet::new();
    let cache = Shared::default();
    let mut plugin_events = PluginEvents::new(options.pod_event_socket.clone());
    let (events, mut received) = mpsc::channel::<Event>(64);
    let mut namespaces = watcher::watcher(Api::<Namespace>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .boxed();
    let live = Live::new(
        cache.clone(),
        zds.clone(),
        Arc::clone(&options),
        records.clone(),
        host.clone(),
        client.clone(),
    );
    let mut recheck = tokio::time::interval(RECHECK);
    loop {
        tokio::select! {
            () = plugin_events.accept(&events, &metrics) => {}
            _ = recheck.tick() => {}
            Some(Event { event, answer }) = received.recv() => {
                let (cache, zds, options, records) = (cache.clone(), zds.clone(), Arc::clone(&options), records.clone());
                let host = host.clone();
                let client = client.clone();
                tokio::spawn(async move {
                    let deadline = Instant::now() + ENROL_WAIT;
                    let (namespace, name) = (event.pod_namespace.clone(), event.pod_name.clone());
                    match enrol(event, deadline, &cache, &zds, &options, &records, &host).await {
                        Ok(pod) => {
                            log::info!("ambient: pod {namespace}/{name} is in the mesh");
                            let _ = answer.send(Ok(()));
                            annotate(&client, &namespace, &name, &pod, Some("enabled")).await;
                        }
                        Err(reason) => {
                            log::warn!("ambient: pod {namespace}/{name} is not in the mesh: {reason}");
                            let _ = answer.send(Err(reason));
                        }
                    }
                });
            }
            Some(event) = pods.next() => {
                if cache.lock().pods.take(&event, PodFacts::of) {
                    leave_the_gone(&cache, &zds, &records, &host);
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
        if !host_installed {
            // Without it kubelet's probes of enrolled pods would land on
            // ztunnel's inbound port; tried again each look until it works.
            let installing = host.clone();
            host_installed = match tokio::task::spawn_blocking(move || installing.install()).await {
                Ok(Ok(())) => true,
                Ok(Err(e)) => {
                    log::error!("ambient: the node's probe rule: {e}; trying again");
                    false
                }
                Err(e) => {
                    log::error!("ambient: the node's probe rule: {e}; trying again");
                    false
                }
            };
        }
        if listening.is_empty() && cache.listed() {
            restore(&cache, &zds, &options, &records, &host).await;
            listening.spawn(zds.clone().listen(options.ztunnel_socket.clone(), LOOK_AGAIN));
        }
        if !listening.is_empty() {
            live.look();
        }
    }
}

/// Takes out of the mesh every pod the cache no longer has (deleted,
/// finished, gone while the watch was down).
fn leave_the_gone(cache: &Shared, zds: &Zds, records: &Records, host: &HostProbes) {
    let present = cache.uids();
    for uid in zds.uids() {
        if !present.contains(&uid) {
            log::info!("ambient: pod {uid} is gone; out of the mesh");
            zds.remove(&uid);
            records.forget(&uid);
            host.remove_soon(&uid);
        }
    }
    // A pod whose addresses went in before it failed to join.
    for uid in host.uids() {
        if !present.contains(&uid) {
            host.remove_soon(&uid);
        }
    }
}

/// The node's probe rule in the backend the in-pod rules use; with
/// nftables it matches kubelet's UID (root when no kubelet runs here).
fn host_probes(options: &Options) -> HostProbes {
    let backend = match options.backend {
        InPodBackend::Iptables(_) => host_probe::Backend::Iptables,
        InPodBackend::Nftables => {
            let kubelet_uid = host_probe::kubelet_uid(Path::new("/proc")).unwrap_or_else(|| {
                log::warn!("ambient: no kubelet process found; the probe rule matches root's sockets");
                0
            });
            host_probe::Backend::Nftables { kubelet_uid }
        }
    };
    HostProbes::new(backend, options.ipv6)
}

/// Puts back in the mesh the enrolled pods already running on the node
/// (an agent that restarted, or one that enrols them for the first time):
/// each one's namespace where its record says (`records`), else found
/// through /proc by its addresses (one scan for all of those), its in-pod
/// rules programmed again (they converge: the rules an agent put there
/// stay through its restart), and the pod restored for ztunnel's snapshot;
/// one whose namespace is not found, as a keep.
async fn restore(cache: &Shared, zds: &Zds, options: &Arc<Options>, records: &Records, host: &HostProbes) {
    let enrolled: Vec<(Key, PodFacts)> = {
        let cache = cache.lock();
        cache
            .pods
            .known()
            .iter()
            .filter(|(key, pod)| is_enrolled(&cache, options, key, pod))
            .map(|(key, pod)| (key.clone(), pod.clone()))
            .collect()
    };
    let present = cache.uids();
    let (options, records) = (Arc::clone(options), records.clone());
    let restored = tokio::task::spawn_blocking(move || {
        // Records of pods gone while no agent ran.
        records.prune(&present);
        // A pod without a record and without an address yet (kubelet had
        // not posted it) was never in the mesh.
        let enrolled: Vec<(Key, PodFacts)> = enrolled
            .into_iter()
            .filter(|(_, pod)| !pod.ips.is_empty() || records.netns_of(&pod.uid).is_some())
            .collect();
        let noted: Vec<Option<PathBuf>> = enrolled
            .iter()
            .map(|(_, pod)| records.netns_still_of(&pod.uid, &pod.ips))
            .collect();
        let unnoted: Vec<Vec<IpAddr>> = enrolled
            .iter()
            .zip(&noted)
            .filter(|((_, pod), noted)| noted.is_none() && !pod.ips.is_empty())
            .map(|((_, pod), _)| pod.ips.clone())
            .collect();
        let scan = crate::pod_netns::find_all(Path::new("/proc"), &unnoted).unwrap_or_else(|e| {
            log::warn!("ambient: finding the enrolled pods' namespaces: {e}");
            (vec![None; unnoted.len()], None)
        });
        if let Some(unread) = &scan.1 {
            log::warn!("ambient: finding the enrolled pods' namespaces: {unread}");
        }
        let mut scanned = scan.0.into_iter();
        enrolled
            .into_iter()
            .zip(noted)
            .map(|((key, pod), noted)| {
                let by_record = noted.is_some();
                let path = match noted {
                    Some(path) => Some(path),
                    None if pod.ips.is_empty() => None,
                    None => scanned.next().flatten(),
                };
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
    let mut members = std::collections::BTreeMap::new();
    for ((namespace, name), pod, netns) in restored {
        members.insert(pod.uid.clone(), pod.ips.clone());
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
        zds.restore(&pod.uid, pod.workload(&(namespace, name)), netns.map(Arc::new));
    }
    log::info!(
        "ambient: enrolled pods found in their namespaces: {by_record} by their records, {scanned} through /proc; \
         {kept} kept without"
    );
    // Pods gone while no agent ran leave the probe sets; those restored
    // are in them.
    let reconciling = host.clone();
    match tokio::task::spawn_blocking(move || reconciling.reconcile(members)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => log::warn!("ambient: the probe sets: {e}"),
        Err(e) => log::warn!("ambient: the probe sets: {e}"),
    }
}

/// The pod of a plugin's event in the mesh (the cache's view of it), or
/// why not.
async fn enrol(
    event: agent_wire::pod_event::PodEvent,
    deadline: Instant,
    cache: &Shared,
    zds: &Zds,
    options: &Arc<Options>,
    records: &Records,
    host: &HostProbes,
) -> Result<PodFacts, String> {
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
        let (options, pod, records, host) = (Arc::clone(options), pod.clone(), records.clone(), host.clone());
        let addresses = event.addresses();
        tokio::task::spawn_blocking(move || {
            let path = in_pod::reachable(Path::new(&event.netns), Path::new(in_pod::HOST_ROOT));
            let netns = program_in(&path, &options, &pod, &addresses)?;
            host.add(&pod.uid, &addresses)
                .map_err(|e| format!("the node's probe sets: {e}"))?;
            records.remember(&pod.uid, &path);
            Ok::<_, String>(netns)
        })
    };
    let netns = programmed
        .await
        .map_err(|e| format!("programming the in-pod rules: {e}"))??;
    if let Err(e) = zds
        .add(&pod.uid, pod.workload(&key), Arc::new(netns), deadline)
        .await
    {
        // Unless a later enrolment of the pod holds it now.
        if !zds.in_mesh(&pod.uid) {
            records.forget(&pod.uid);
            host.remove_now(&pod.uid).await;
        }
        return Err(e.to_string());
    }
    // Deleted meanwhile, the watch's delete found it not yet in the mesh.
    if !cache.uids().contains(&pod.uid) {
        zds.remove(&pod.uid);
        records.forget(&pod.uid);
        host.remove_now(&pod.uid).await;
        return Err(format!(
            "pod {namespace}/{name} was deleted while it was put in the mesh"
        ));
    }
    Ok(pod)
}
