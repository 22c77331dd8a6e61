//! NetworkPolicy for this node's pods, every verdict in the kernel
//! (`netpol`): one watch each on Pods, Namespaces and NetworkPolicies of
//! the whole cluster (a selector may name any namespace's pods), each kept
//! as a map that a restarted watch's relist replaces whole. After a change
//! that policy reads (most Pod updates are status conditions: nothing it
//! reads), and every [`RESYNC`], the policy is computed for this node's
//! pods and the table brought in line by one `nft` transaction.
//!
//! Nothing is applied before all three watches have listed once: the table
//! an agent left at its stop (it stays in the kernel) keeps every pod's
//! policy until the new agent knows the whole state, and is then
//! reconciled, not rebuilt. A pod started while no agent runs is in no
//! map: open, as under kube-network-policies until its address is known.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{Stream, StreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use netpol::model::{NamespaceView, PodView, Policy};

use crate::changes::{self, RESYNC};
use crate::error::Error;
use crate::metrics::{Metrics, Outcome};
use crate::settings::Settings;

/// How long changes arriving together are gathered into one transaction
/// (a Deployment's pods, a namespace's policies applied at once).
const GATHER: Duration = Duration::from_millis(50);

#[derive(Debug, Clone)]
pub struct Options {
    /// This node's name: policy is enforced for its pods.
    pub node_name: String,
}

impl Options {
    /// `None` when the setting is off or the agent is not the node's
    /// network (Istio's CNI alone enforces no policy).
    pub fn from_settings(settings: &Settings) -> Option<Options> {
        (settings.own_network && settings.network_policy).then(|| Options {
            node_name: settings.node_name.clone(),
        })
    }
}

/// One watched kind, as policy reads it: objects by namespace and name.
struct Watched<V> {
    known: BTreeMap<(String, String), V>,
    relisted: Option<BTreeMap<(String, String), V>>,
    listed_once: bool,
}

impl<V: PartialEq> Watched<V> {
    fn new() -> Self {
        Watched {
            known: BTreeMap::new(),
            relisted: None,
            listed_once: false,
        }
    }

    /// Takes one event in; whether what policy reads changed.
    fn take<K: kube::Resource>(
        &mut self,
        event: Result<Event<K>, watcher::Error>,
        view: impl Fn(&K) -> Option<V>,
        what: &str,
    ) -> bool {
        let key = |object: &K| {
            let meta = object.meta();
            (
                meta.namespace.clone().unwrap_or_default(),
                meta.name.clone().unwrap_or_default(),
            )
        };
        match event {
            Ok(Event::Init) => {
                self.relisted = Some(BTreeMap::new());
                false
            }
            Ok(Event::InitApply(object)) => {
                if let (Some(list), Some(v)) = (self.relisted.as_mut(), view(&object)) {
                    list.insert(key(&object), v);
                }
                false
            }
            Ok(Event::InitDone) => {
                self.known = self.relisted.take().unwrap_or_default();
                self.listed_once = true;
                true
            }
            Ok(Event::Apply(object)) => {
                let k = key(&object);
                match view(&object) {
                    Some(v) if self.known.get(&k) == Some(&v) => false,
                    Some(v) => {
                        self.known.insert(k, v);
                        true
                    }
                    // A pod that finished or has no address (yet): no
                    // longer selected, no longer a peer.
                    None => self.known.remove(&k).is_some(),
                }
            }
            Ok(Event::Delete(object)) => self.known.remove(&key(&object)).is_some(),
            Err(e) => {
                log::warn!("watching {what}: {e}; retrying");
                false
            }
        }
    }
}

/// An event of one of the three watches (a Pod is large: boxed).
enum Watch {
    Pod(Box<Result<Event<Pod>, watcher::Error>>),
    Namespace(Result<Event<Namespace>, watcher::Error>),
    Policy(Result<Event<NetworkPolicy>, watcher::Error>),
}

/// What the three watches know.
struct Cluster {
    pods: Watched<PodView>,
    namespaces: Watched<NamespaceView>,
    policies: Watched<Policy>,
}

impl Cluster {
    /// Takes one event in; whether what policy reads changed.
    fn take(&mut self, event: Watch) -> bool {
        match event {
            Watch::Pod(event) => self.pods.take(*event, PodView::from_pod, "Pods"),
            Watch::Namespace(event) => {
                self.namespaces
                    .take(event, |n| Some(NamespaceView::from_namespace(n)), "Namespaces")
            }
            Watch::Policy(event) => {
                self.policies
                    .take(event, |p| Some(Policy::from_network_policy(p)), "NetworkPolicies")
            }
        }
    }

    fn listed(&self) -> bool {
        self.pods.listed_once && self.namespaces.listed_once && self.policies.listed_once
    }

    fn snapshot(&self) -> netpol::Snapshot {
        netpol::Snapshot {
            pods: self.pods.known.values().cloned().collect(),
            namespaces: self.namespaces.known.values().cloned().collect(),
            policies: self.policies.known.values().cloned().collect(),
        }
    }
}

fn watch<K>(client: &kube::Client) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + use<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + 'static,
{
    watcher::watcher(Api::<K>::all(client.clone()), watcher::Config::default()).default_backoff()
}

/// Enforces policy until the task is aborted (watch errors are retried
/// with backoff).
pub async fn run(client: kube::Client, options: Options, metrics: Metrics) {
    let mut events = stream::select(
        stream::select(
            watch::<Pod>(&client).map(|event| Watch::Pod(Box::new(event))),
            watch::<Namespace>(&client).map(Watch::Namespace),
        ),
        watch::<NetworkPolicy>(&client).map(Watch::Policy),
    )
    .boxed();
    let mut cluster = Cluster {
        pods: Watched::new(),
        namespaces: Watched::new(),
        policies: Watched::new(),
    };
    let mut resync = tokio::time::interval(RESYNC);
    log::info!(
        "enforcing NetworkPolicy for the pods of node {}",
        options.node_name
    );
    if let Err(e) = changes::blocking(|| {
        bridged_frames_are_judged();
        Ok(())
    })
    .await
    {
        log::error!("{e}");
    }
    loop {
        let mut changed = tokio::select! {
            Some(event) = events.next() => cluster.take(event),
            // Someone may have changed the table: look again.
            _ = resync.tick() => true,
        };
        // What arrives with it goes into the same transaction.
        let gathering = tokio::time::sleep(GATHER);
        tokio::pin!(gathering);
        loop {
            tokio::select! {
                Some(event) = events.next() => changed |= cluster.take(event),
                () = &mut gathering => break,
            }
        }
        if !changed || !cluster.listed() {
            continue;
        }
        let snapshot = cluster.snapshot();
        let node = options.node_name.clone();
        let applied = changes::blocking(move || {
            let compiled = netpol::compile(&snapshot, &node);
            changes::change(|| netpol::apply(&compiled).map_err(|e| Error::Io(format!("NetworkPolicy: {e}"))))
        })
        .await;
        match applied {
            Ok(script) => {
                if !script.is_empty() {
                    log::info!(
                        "NetworkPolicy: the table changed ({} commands)",
                        script.lines().count()
                    );
                }
                metrics.policy_synced(Outcome::Success);
            }
            Err(e) => {
                log::error!("{e}");
                metrics.policy_synced(Outcome::Failure);
            }
        }
    }
}

/// Pods on one bridge talk without routing: their frames reach the
/// `forward` hook only through `br_netfilter` with these on (kube-proxy
/// needs them too, and kubeadm checks them); they are turned on, and their
/// absence said.
fn bridged_frames_are_judged() {
    for name in ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables"] {
        let path = format!("/proc/sys/net/bridge/{name}");
        match std::fs::read_to_string(&path) {
            Ok(value) if value.trim() == "1" => {}
            Ok(_) => match std::fs::write(&path, "1") {
                Ok(()) => log::info!("NetworkPolicy: {name} turned on, so bridged pod traffic is judged"),
                Err(e) => log::error!(
                    "NetworkPolicy: {path}: {e}: pod traffic within the node's bridge is not judged"
                ),
            },
            Err(e) => log::error!(
                "NetworkPolicy: {path}: {e}: br_netfilter is not loaded, pod traffic within the node's bridge is not judged"
            ),
        }
    }
}

/// Removes every verdict (uninstall).
pub fn remove() {
    if let Err(e) = netpol::remove() {
        log::error!("removing the NetworkPolicy table: {e}");
    }
}
