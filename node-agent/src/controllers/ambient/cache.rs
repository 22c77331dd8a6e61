//! What the controller keeps of the cluster: this node's pods and every
//! namespace's labels, as the watches left them, shared by the watch loop
//! and the tasks that put pods in the mesh or take them out.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use istio_redirect::enrolment::Candidate;
use k8s_openapi::api::core::v1::Pod;
use labels::Labels;
use zds::WorkloadInfo;

use super::options::Options;
use crate::cluster::watched::Watched;

/// A pod's namespace and name.
pub type Key = (String, String);

/// What the controller reads of a pod of this node; None for one that
/// finished (it leaves the mesh).
#[derive(Debug, Clone, PartialEq)]
pub struct PodFacts {
    pub uid: String,
    pub labels: Labels,
    pub annotations: BTreeMap<String, String>,
    pub host_network: bool,
    pub service_account: String,
    /// As its status reports them: how an agent that restarted finds the
    /// pod's namespace.
    pub ips: Vec<IpAddr>,
}

impl PodFacts {
    /// Who the pod is to ztunnel.
    pub fn workload(&self, (namespace, name): &Key) -> WorkloadInfo {
        WorkloadInfo {
            name: name.clone(),
            namespace: namespace.clone(),
            service_account: self.service_account.clone(),
        }
    }

    pub fn of(pod: &Pod) -> Option<PodFacts> {
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
pub struct Cache {
    pub pods: Watched<(String, String), PodFacts>,
    pub namespaces: Watched<String, Labels>,
}

/// The cache, shared by the watch loop and the pod events' tasks.
#[derive(Debug, Clone, Default)]
pub struct Shared(Arc<Mutex<Cache>>);

impl Shared {
    pub fn lock(&self) -> MutexGuard<'_, Cache> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The UIDs of the pods known.
    pub fn uids(&self) -> BTreeSet<String> {
        self.lock()
            .pods
            .known()
            .values()
            .map(|pod| pod.uid.clone())
            .collect()
    }

    /// Whether both watches have listed once.
    pub fn listed(&self) -> bool {
        let cache = self.lock();
        cache.pods.listed_once() && cache.namespaces.listed_once()
    }
}

/// Whether the pod is enrolled, by the cache's view of it and of its
/// namespace.
pub fn is_enrolled(cache: &Cache, options: &Options, (namespace, _): &Key, pod: &PodFacts) -> bool {
    if options.exclude_namespaces.contains(namespace) {
        return false;
    }
    let Some(namespace_labels) = cache.namespaces.known().get(namespace) else {
        return false;
    };
    let candidate = Candidate::new(&pod.labels, &pod.annotations, pod.host_network);
    options.enrolment.matches(candidate, namespace_labels)
}
