//! Pods whose enrolment changes while they run: a pod or its namespace
//! labelled into ambient mode puts the pod in the mesh where it runs (its
//! namespace found by its record, else through /proc by its addresses);
//! one labelled out has its in-pod rules taken away first, then leaves
//! ztunnel and loses Istio's mark. Looked at after each change the watches
//! bring and every [`RECHECK`]. A pod joins only while ztunnel is
//! connected (its traffic would otherwise go to ports nothing serves);
//! one that could not join is tried again after [`RETRY`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::cache::{Key, PodFacts, Shared, is_enrolled};
use super::host_probe::HostProbes;
use super::in_pod::{annotate, program_in, unprogram_in};
use super::options::Options;
use super::records::Records;
use super::zds_server::Zds;

/// How often running pods are looked at without a change to bring it.
pub const RECHECK: Duration = Duration::from_secs(5);

/// How long a pod that could not join waits before it is tried again.
pub const RETRY: Duration = Duration::from_secs(30);

/// What a look at the running pods needs, and the pods being handled.
#[derive(Clone)]
pub struct Live {
    pub cache: Shared,
    pub zds: Zds,
    pub options: Arc<Options>,
    pub records: Records,
    pub host: HostProbes,
    pub client: kube::Client,
    handling: Arc<Mutex<Handling>>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("handling", &self.handling)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Handling {
    /// Pods joining or leaving now, by UID.
    busy: BTreeSet<String>,
    /// Pods that could not join, and when they are tried again.
    retry_at: BTreeMap<String, Instant>,
}

/// Which way a pod goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    Join,
    Leave,
}

impl Live {
    pub fn new(
        cache: Shared,
        zds: Zds,
        options: Arc<Options>,
        records: Records,
        host: HostProbes,
        client: kube::Client,
    ) -> Live {
        Live {
            cache,
            zds,
            options,
            records,
            host,
            client,
            handling: Arc::default(),
        }
    }

    fn handling(&self) -> MutexGuard<'_, Handling> {
        self.handling
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts a task for each running pod whose place no longer matches
    /// its enrolment. Pods without addresses are being set up: their ADD
    /// decides.
    pub fn look(&self) {
        let connected = self.zds.connected() > 0;
        let moves: Vec<(Key, PodFacts, Move)> = {
            let cache = self.cache.lock();
            cache
                .pods
                .known()
                .iter()
                .filter_map(|(key, pod)| {
                    let enrolled = is_enrolled(&cache, &self.options, key, pod);
                    let in_mesh = self.zds.in_mesh(&pod.uid);
                    let way = match (enrolled, in_mesh) {
                        (true, false) if connected && !pod.ips.is_empty() => Move::Join,
                        (false, true) => Move::Leave,
                        _ => return None,
                    };
                    Some((key.clone(), pod.clone(), way))
                })
                .collect()
        };
        let now = Instant::now();
        for (key, pod, way) in moves {
            {
                let mut handling = self.handling();
                let waiting = handling.retry_at.get(&pod.uid).is_some_and(|at| *at > now);
                if (way == Move::Join && waiting) || !handling.busy.insert(pod.uid.clone()) {
                    continue;
                }
            }
            let live = self.clone();
            tokio::spawn(async move {
                let joined = match way {
                    Move::Join => live.join(&key, &pod).await,
                    Move::Leave => {
                        live.leave(&key, &pod).await;
                        Ok(())
                    }
                };
                let mut handling = live.handling();
                handling.busy.remove(&pod.uid);
                match joined {
                    Ok(()) => handling.retry_at.remove(&pod.uid),
                    Err(reason) => {
                        log::warn!(
                            "ambient: running pod {}/{} is not in the mesh: {reason}; trying again in {RETRY:?}",
                            key.0,
                            key.1
                        );
                        handling.retry_at.insert(pod.uid.clone(), Instant::now() + RETRY)
                    }
                };
            });
        }
    }

    /// Puts a running pod in the mesh where it runs.
    async fn join(&self, (namespace, name): &Key, pod: &PodFacts) -> Result<(), String> {
        let (options, records, facts) = (Arc::clone(&self.options), self.records.clone(), pod.clone());
        let host = self.host.clone();
        let programmed = tokio::task::spawn_blocking(move || {
            let path = match records.netns_still_of(&facts.uid, &facts.ips) {
                Some(path) => path,
                None => {
                    let (found, unread) = crate::pod_netns::find_all(
                        std::path::Path::new("/proc"),
                        std::slice::from_ref(&facts.ips),
                    )
                    .map_err(|e| e.to_string())?;
                    found.into_iter().flatten().next().ok_or_else(|| {
                        unread.unwrap_or_else(|| format!("no network namespace holds {:?}", facts.ips))
                    })?
                }
            };
            let netns = program_in(&path, &options, &facts, &facts.ips)?;
            host.add(&facts.uid, &facts.ips)
                .map_err(|e| format!("the node's probe sets: {e}"))?;
            Ok::<_, String>(netns)
        })
        .await
        .map_err(|e| format!("finding its namespace: {e}"))??;
        let info = pod.workload(&(namespace.clone(), name.clone()));
        let deadline = Instant::now() + super::ENROL_WAIT;
        if let Err(e) = self.zds.add(&pod.uid, info, Arc::new(programmed), deadline).await {
            if !self.zds.in_mesh(&pod.uid) {
                self.host.remove_now(&pod.uid).await;
            }
            return Err(e.to_string());
        }
        log::info!("ambient: running pod {namespace}/{name} is in the mesh");
        annotate(&self.client, namespace, name, pod, Some("enabled")).await;
        Ok(())
    }

    /// Takes a running pod out of the mesh: its rules first, so its
    /// traffic is never sent to listeners ztunnel has closed.
    async fn leave(&self, (namespace, name): &Key, pod: &PodFacts) {
        if let Some(netns) = self.zds.netns_of(&pod.uid) {
            let options = Arc::clone(&self.options);
            let removed = tokio::task::spawn_blocking(move || unprogram_in(&netns, &options)).await;
            match removed {
                Ok(Ok(())) => {}
                Ok(Err(e)) => log::warn!("ambient: pod {namespace}/{name}: {e}"),
                Err(e) => log::warn!("ambient: pod {namespace}/{name}: removing its rules: {e}"),
            }
        }
        self.zds.remove(&pod.uid);
        self.records.forget(&pod.uid);
        self.host.remove_now(&pod.uid).await;
        log::info!("ambient: pod {namespace}/{name} is no longer enrolled; out of the mesh");
        annotate(&self.client, namespace, name, pod, None).await;
    }
}
