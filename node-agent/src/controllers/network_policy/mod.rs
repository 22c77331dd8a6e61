//! NetworkPolicy for this node's pods, every verdict in the kernel
//! (`netpol`): one watch each on Pods, Namespaces and NetworkPolicies of
//! the whole cluster (a selector may name any namespace's pods), each kept
//! as a map that a restarted watch's relist replaces whole. After a change
//! that policy reads (most Pod updates are status conditions: nothing it
//! reads), and every [`RESYNC`], the policy is computed for this node's
//! pods and the table brought in line by one nf_tables transaction.
//!
//! A new pod's address reaches the API server only when kubelet posts its
//! status, up to seconds after its containers may have started sending:
//! the bridge's ADD tells the agent first, through the gate (`gate`), and
//! waits until the kernel holds the pod's policy. Once the Pod is known
//! bound to this node, and until its status has them, the addresses its
//! ADD reported are the pod's (an address reported so is no other pod's
//! any more: a sandbox's address freed and given again before the old
//! pod's object is gone). A report for a pod not known here changes
//! nothing: it waits for the Pod object.
//!
//! Nothing is applied before all three watches have listed once: the table
//! an agent left at its stop (it stays in the kernel) keeps every pod's
//! policy until the new agent knows the whole state, and is then
//! reconciled, not rebuilt. A pod whose ADD no agent confirms fails when
//! its namespace has a policy (`agent_wire::policy`); one of another namespace
//! starts open. After a pass that may narrow a local pod's verdict, the
//! connections the policy now denies are cut (`netpol::conntrack`), so
//! what was let through before the pod was isolated does not outlive it.

mod gate;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use netpol::Compiled;
use netpol::model::{NamespaceView, PodView, Policy};
use tokio::sync::{mpsc, oneshot};

use crate::changes::{self, RESYNC};
use crate::cluster::pods::{PodEvent, PodEvents};
use crate::cluster::watched::{Key as _, Watched};
use crate::error::Error;
use crate::metrics::{Metrics, Outcome};
use crate::settings::Settings;

use agent_wire::policy::Answer;
use gate::Asked;

/// Objects are kept by namespace and name.
type Key = (String, String);
pub use gate::Gate;

/// How long changes arriving together are gathered into one transaction
/// (a Deployment's pods, a namespace's policies applied at once).
const GATHER: Duration = Duration::from_millis(50);

/// How long a pod's ADD waits for the agent to see its Pod object (the
/// agent's watch and the kubelet's get it from the same API server: this
/// is for an agent whose watch is behind).
const POD_WAIT: Duration = Duration::from_secs(1);

/// How long addresses an ADD reported stand for the pod when its status
/// never shows them (its sandbox failed after the bridge): long enough for
/// kubelet's next sandbox to report its own.
const ADMITTED_FOR: Duration = Duration::from_secs(120);

/// When a pass that failed runs again.
const RETRY: Duration = Duration::from_secs(1);

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

/// An event of one of the three watches (the Pods' is the agent's one
/// Pod watch, whose errors it logs itself).
enum Watch {
    Pod(PodEvent),
    Namespace(Result<Event<Namespace>, watcher::Error>),
    Policy(Result<Event<NetworkPolicy>, watcher::Error>),
}

/// What the three watches know, and what the gate was told.
struct Cluster {
    /// This node's name: only its pods' reports count.
    node: String,
    pods: Watched<Key, PodView>,
    namespaces: Watched<Key, NamespaceView>,
    policies: Watched<Key, Policy>,
    /// Addresses pods' ADDs reported, by pod, until their status has them
    /// and no other pod's does; with when they are forgotten anyway.
    admitted: BTreeMap<(String, String), (Vec<IpAddr>, Instant)>,
}

impl Cluster {
    fn new(node: &str) -> Cluster {
        Cluster {
            node: node.to_owned(),
            pods: Watched::default(),
            namespaces: Watched::default(),
            policies: Watched::default(),
            admitted: BTreeMap::new(),
        }
    }

    /// Whether the pod is known and bound to this node: only then do the
    /// addresses its ADD reported stand (a report for a pod bound
    /// elsewhere, or for no pod at all, would otherwise take addresses
    /// from the pods whose status holds them).
    fn bound_here(&self, pod: &(String, String)) -> bool {
        self.pods
            .known()
            .get(pod)
            .is_some_and(|p| p.node.as_deref() == Some(self.node.as_str()))
    }

    /// Takes one event in; whether what policy reads changed.
    fn take(&mut self, event: Watch) -> bool {
        match event {
            Watch::Pod(event) => {
                if let Event::Delete(pod) = &*event {
                    self.retract(pod);
                }
                let changed = self.pods.take(&event, PodView::from_pod);
                if changed {
                    self.settle_admitted();
                }
                changed
            }
            Watch::Namespace(Ok(event)) => self
                .namespaces
                .take(&event, |n| Some(NamespaceView::from_namespace(n))),
            Watch::Policy(Ok(event)) => self
                .policies
                .take(&event, |p| Some(Policy::from_network_policy(p))),
            Watch::Namespace(Err(e)) => {
                log::warn!("watching Namespaces: {e}; retrying");
                false
            }
            Watch::Policy(Err(e)) => {
                log::warn!("watching NetworkPolicies: {e}; retrying");
                false
            }
        }
    }

    /// The addresses a pod's ADD reported, its own from now on.
    fn admit(&mut self, key: (String, String), mut ips: Vec<IpAddr>) {
        ips.sort();
        self.admitted.insert(key, (ips, Instant::now() + ADMITTED_FOR));
    }

    /// Forgets a deleted Pod's claim when its status had the claimed
    /// addresses or none yet (deleted before its status was written): its
    /// sandbox is gone, and its addresses may be another pod's next. A
    /// claim with other addresses is a later pod's of the same name (a
    /// watch behind the gate), kept until it settles.
    fn retract(&mut self, pod: &Pod) {
        let Some(key) = Key::of(&pod.metadata) else {
            return;
        };
        let mut ips = netpol::model::status_ips(pod);
        ips.sort();
        if self
            .admitted
            .get(&key)
            .is_some_and(|(claimed, _)| ips.is_empty() || *claimed == ips)
        {
            self.admitted.remove(&key);
        }
    }

    /// Forgets what the status has caught up with (the pod's status shows
    /// the addresses and no other pod's still does: a former pod's object
    /// may outlive its sandbox), and what it never will.
    fn settle_admitted(&mut self) {
        if self.admitted.is_empty() {
            return;
        }
        let pods = self.pods.known();
        let mut holders: BTreeMap<IpAddr, usize> = BTreeMap::new();
        for ip in pods.values().flat_map(|pod| &pod.ips) {
            *holders.entry(*ip).or_default() += 1;
        }
        let now = Instant::now();
        self.admitted.retain(|key, (ips, expires)| {
            let caught_up = pods.get(key).is_some_and(|pod| {
                let mut status = pod.ips.clone();
                status.sort();
                status == *ips && ips.iter().all(|ip| holders.get(ip) == Some(&1))
            });
            !caught_up && now < *expires
        });
    }

    fn listed(&self) -> bool {
        self.pods.listed_once() && self.namespaces.listed_once() && self.policies.listed_once()
    }

    fn snapshot(&self) -> netpol::Snapshot {
        let standing: BTreeMap<&(String, String), &Vec<IpAddr>> = self
            .admitted
            .iter()
            .filter(|(key, _)| self.bound_here(key))
            .map(|(key, (ips, _))| (key, ips))
            .collect();
        let claimed: BTreeSet<IpAddr> = standing.values().copied().flatten().copied().collect();
        let pods = self
            .pods
            .known()
            .iter()
            .map(|(key, pod)| {
                let mut pod = pod.clone();
                match standing.get(key) {
                    Some(ips) => pod.ips.clone_from(ips),
                    None => pod.ips.retain(|ip| !claimed.contains(ip)),
                }
                pod
            })
            .collect();
        netpol::Snapshot {
            pods,
            namespaces: self.namespaces.known().values().cloned().collect(),
            policies: self.policies.known().values().cloned().collect(),
        }
    }
}

/// A pod's ADD waiting for its answer.
struct Waiting {
    pod: (String, String),
    /// When it is told the Pod was not seen.
    until: Instant,
    /// Whether a pass over the table ran with its report standing (its
    /// Pod known bound here).
    synced: bool,
    answer: oneshot::Sender<Answer>,
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
/// with backoff), answering the pods' ADDs at `gate`.
pub async fn run(
    client: kube::Client,
    options: Options,
    mut gate: Option<Gate>,
    metrics: Metrics,
    pods: PodEvents,
) {
    let mut events = stream::select(
        stream::select(
            pods.map(Watch::Pod),
            watch::<Namespace>(&client).map(Watch::Namespace),
        ),
        watch::<NetworkPolicy>(&client).map(Watch::Policy),
    )
    .boxed();
    let mut cluster = Cluster::new(&options.node_name);
    let (asking, mut asked) = mpsc::channel::<Asked>(64);
    let mut waiting: Vec<Waiting> = Vec::new();
    let mut applied: Option<Compiled> = None;
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
    // When the next pass over the table is due, and whether it looks at
    // the kernel even if nothing changed here (someone else may have).
    let mut due: Option<Instant> = None;
    let mut verify = false;
    loop {
        let wake = due.into_iter().chain(waiting.iter().map(|w| w.until)).min();
        tokio::select! {
            Some(event) = events.next() => {
                if cluster.take(event) {
                    // What arrives with it goes into the same transaction.
                    due = due.or_else(|| Some(Instant::now() + GATHER));
                }
            }
            () = accept(gate.as_mut(), &asking) => {}
            Some(first) = asked.recv() => {
                // Every ADD already waiting goes into the same pass (a
                // Deployment's pods starting at once).
                let mut next = Some(first);
                while let Some(Asked { admission, answer }) = next {
                    let pod = (admission.pod_namespace, admission.pod_name);
                    cluster.admit(pod.clone(), admission.ips);
                    waiting.push(Waiting {
                        pod,
                        until: Instant::now() + POD_WAIT,
                        synced: false,
                        answer,
                    });
                    next = asked.try_recv().ok();
                }
                due = Some(Instant::now());
            }
            _ = resync.tick() => {
                verify = true;
                due = Some(Instant::now());
            }
            () = sleep_until(wake) => {}
        }
        // A pod's ADD waits on no gathering.
        if !waiting.is_empty() && due.is_some() {
            due = Some(Instant::now());
        }
        let mut failed = None;
        let mut narrowed = netpol::conntrack::Narrowed::default();
        // Before all three watches have listed, nothing is applied: the
        // listing that completes them is a change, and sets a pass due.
        if due.is_some_and(|due| due <= Instant::now()) {
            due = None;
            if cluster.listed() {
                cluster.settle_admitted();
                match sync(&cluster, &mut applied, verify).await {
                    Ok(pass) => {
                        if pass.ops > 0 {
                            log::info!("NetworkPolicy: the table changed ({} ops)", pass.ops);
                        }
                        metrics.policy_synced(Outcome::Success);
                        for w in &mut waiting {
                            w.synced |= cluster.bound_here(&w.pod);
                        }
                        narrowed = pass.narrowed;
                    }
                    Err(e) => {
                        log::error!("{e}");
                        metrics.policy_synced(Outcome::Failure);
                        failed = Some(e.to_string());
                        // Again soon, against a listing: a change that
                        // failed must not wait for the next event.
                        due = Some(Instant::now() + RETRY);
                    }
                }
                verify = false;
            }
        }
        answer_waiting(&mut waiting, &cluster, failed.as_deref(), &metrics);
        // After the answers: a new pod has no connection to cut.
        if !narrowed.is_empty()
            && let Some(compiled) = applied.clone()
        {
            cut_denied(compiled, narrowed).await;
        }
    }
}

/// Removes the tracked connections of this node's isolated pods that the
/// policy now applied denies.
async fn cut_denied(compiled: Compiled, narrowed: netpol::conntrack::Narrowed) {
    let cut = changes::blocking(move || {
        let node = node_addresses();
        netpol::conntrack::cut_denied(&compiled, &narrowed, &node)
            .map_err(|e| Error::Io(format!("NetworkPolicy: {e}")))
    })
    .await;
    match cut {
        Ok(0) => {}
        Ok(n) => log::info!("NetworkPolicy: cut {n} connections the policy now denies"),
        Err(e) => log::error!("{e}"),
    }
}

/// The node's own addresses (the agent runs in its namespace): their
/// connections to its pods leave through `output`, never judged.
fn node_addresses() -> BTreeSet<IpAddr> {
    let Ok(addresses) = nix::ifaddrs::getifaddrs() else {
        return BTreeSet::new();
    };
    addresses
        .filter_map(|a| {
            let address = a.address?;
            address
                .as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| address.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        })
        .collect()
}

/// The gate's next connection; never, without a gate.
async fn accept(gate: Option<&mut Gate>, asking: &mpsc::Sender<Asked>) {
    match gate {
        Some(gate) => gate.accept(asking).await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `wake`; forever without one.
async fn sleep_until(wake: Option<Instant>) {
    match wake {
        Some(wake) => tokio::time::sleep_until(wake.into()).await,
        None => std::future::pending().await,
    }
}

/// What a pass did.
struct Pass {
    /// Ops of the transaction (0: nothing differed).
    ops: usize,
    /// The local pods whose verdict it may have narrowed.
    narrowed: netpol::conntrack::Narrowed,
}

/// One pass: the policy computed for this node's pods and, unless it is
/// what was last applied and the kernel need not be looked at, the table
/// brought in line. What was applied is kept for the next pass.
async fn sync(cluster: &Cluster, applied: &mut Option<Compiled>, verify: bool) -> Result<Pass, Error> {
    let snapshot = cluster.snapshot();
    let node = cluster.node.clone();
    let previous = applied.take();
    let (compiled, pass) = changes::blocking(move || {
        let compiled = netpol::compile(&snapshot, &node);
        if !verify && previous.as_ref() == Some(&compiled) {
            return Ok((
                compiled,
                Pass {
                    ops: 0,
                    narrowed: netpol::conntrack::Narrowed::default(),
                },
            ));
        }
        // The resync reads the kernel's table; other passes trust what
        // the last one left.
        let (before, ops) = changes::change(|| {
            match previous.as_ref().filter(|_| !verify) {
                Some(previous) => netpol::apply_after(previous, &compiled),
                None => netpol::apply(&compiled),
            }
            .map_err(|e| Error::Io(format!("NetworkPolicy: {e}")))
        })?;
        let narrowed = netpol::conntrack::narrowed(&before, &compiled, &ops);
        Ok((
            compiled,
            Pass {
                ops: ops.len(),
                narrowed,
            },
        ))
    })
    .await?;
    *applied = Some(compiled);
    Ok(pass)
}

/// Answers the ADDs that can be answered: enforced once a pass ran with
/// their Pod known; not enforced when the cluster is not listed yet, the
/// pass failed, or the Pod was not seen in time.
fn answer_waiting(waiting: &mut Vec<Waiting>, cluster: &Cluster, failed: Option<&str>, metrics: &Metrics) {
    let now = Instant::now();
    let mut still = Vec::with_capacity(waiting.len());
    for w in waiting.drain(..) {
        let answer = if !cluster.listed() {
            Answer::NotEnforced {
                reason: "the agent has not yet listed the cluster's pods, namespaces and policies".into(),
            }
        } else if let Some(e) = failed {
            Answer::NotEnforced {
                reason: format!("the table could not be changed: {e}"),
            }
        } else if w.synced && cluster.bound_here(&w.pod) {
            // Bound here: a watch that has the Pod but not yet its binding
            // (or a former pod of the name elsewhere) is not enough.
            Answer::Enforced
        } else if now >= w.until {
            Answer::NotEnforced {
                reason: format!(
                    "the agent has not seen the Pod {}/{} on this node",
                    w.pod.0, w.pod.1
                ),
            }
        } else {
            still.push(w);
            continue;
        };
        metrics.policy_admitted(answer == Answer::Enforced);
        // An ADD gone by now has logged that it was not confirmed.
        let _ = w.answer.send(answer);
    }
    *waiting = still;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> (String, String) {
        ("default".into(), name.into())
    }

    fn pod(name: &str, ips: &[&str]) -> PodView {
        PodView {
            namespace: "default".into(),
            name: name.into(),
            node: Some("n1".into()),
            labels: BTreeMap::new(),
            ips: ips.iter().map(|ip| ip.parse().expect("ip")).collect(),
            ports: Vec::new(),
        }
    }

    fn ips_of(snapshot: &netpol::Snapshot, name: &str) -> Vec<String> {
        let pod = snapshot
            .pods
            .iter()
            .find(|p| p.name == name)
            .expect("in the snapshot");
        pod.ips.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn addresses_an_add_reported_are_the_pods_until_its_status_has_them() {
        let mut cluster = Cluster::new("n1");
        cluster.pods.known_mut().insert(key("new"), pod("new", &[]));
        // A former pod whose object outlived its sandbox, and its address.
        cluster
            .pods
            .known_mut()
            .insert(key("old"), pod("old", &["10.244.1.5"]));
        cluster.admit(
            key("new"),
            vec!["fd00::5".parse().expect("ip"), "10.244.1.5".parse().expect("ip")],
        );
        let snapshot = cluster.snapshot();
        assert_eq!(ips_of(&snapshot, "new"), ["10.244.1.5", "fd00::5"]);
        assert!(
            ips_of(&snapshot, "old").is_empty(),
            "the address is the new pod's"
        );

        // A status with one family only has not caught up.
        cluster
            .pods
            .known_mut()
            .insert(key("new"), pod("new", &["10.244.1.5"]));
        cluster.settle_admitted();
        assert_eq!(cluster.admitted.len(), 1);
        cluster
            .pods
            .known_mut()
            .insert(key("new"), pod("new", &["fd00::5", "10.244.1.5"]));
        cluster.settle_admitted();
        assert!(
            !cluster.admitted.is_empty(),
            "the former pod's status still shows the address"
        );
        cluster.pods.known_mut().insert(key("old"), pod("old", &[]));
        cluster.settle_admitted();
        assert!(
            cluster.admitted.is_empty(),
            "the status has them, and no one else's"
        );

        // A report whose status never comes is forgotten in time.
        cluster.admit(key("gone"), vec!["10.244.1.9".parse().expect("ip")]);
        cluster.settle_admitted();
        assert_eq!(cluster.admitted.len(), 1);
        if let Some((_, since)) = cluster.admitted.get_mut(&key("gone")) {
            *since = Instant::now();
        }
        cluster.settle_admitted();
        assert!(cluster.admitted.is_empty());
    }

    #[test]
    fn only_a_report_for_a_pod_bound_here_changes_the_snapshot() {
        let mut cluster = Cluster::new("n1");
        // The real web, on another node, and a pod isolated here.
        let mut web = pod("web", &["10.244.2.7"]);
        web.node = Some("n2".into());
        cluster.pods.known_mut().insert(key("web"), web);
        cluster
            .pods
            .known_mut()
            .insert(key("db"), pod("db", &["10.244.1.9"]));
        let before = cluster.snapshot();

        // A report naming the web bound elsewhere, with an address of ours.
        cluster.admit(key("web"), vec!["10.244.1.77".parse().expect("ip")]);
        // A report for no pod at all, with the isolated pod's address.
        cluster.admit(key("ghost"), vec!["10.244.1.9".parse().expect("ip")]);
        let after = cluster.snapshot();
        assert_eq!(
            ips_of(&after, "web"),
            ["10.244.2.7"],
            "the real web keeps its address"
        );
        assert_eq!(
            ips_of(&after, "db"),
            ["10.244.1.9"],
            "nothing takes the isolated pod's address"
        );
        assert_eq!(after.pods, before.pods);

        // The ghost's object comes, bound here: its report stands now.
        cluster.pods.known_mut().insert(key("ghost"), pod("ghost", &[]));
        let now = cluster.snapshot();
        assert_eq!(ips_of(&now, "ghost"), ["10.244.1.9"]);
        assert!(
            ips_of(&now, "db").is_empty(),
            "a report bound here takes the address"
        );
        assert!(cluster.bound_here(&key("ghost")) && !cluster.bound_here(&key("web")));
    }

    #[test]
    fn a_deleted_pods_claim_goes_with_it_unless_a_later_pod_of_its_name_made_it() {
        use k8s_openapi::api::core::v1::{Pod, PodIP, PodStatus};
        let deleted = |ips: &[&str]| -> PodEvent {
            let mut pod = Pod::default();
            pod.metadata.namespace = Some("a".into());
            pod.metadata.name = Some("web".into());
            pod.status = Some(PodStatus {
                pod_ips: Some(ips.iter().map(|ip| PodIP { ip: (*ip).into() }).collect()),
                ..PodStatus::default()
            });
            std::sync::Arc::new(Event::Delete(pod))
        };
        let mut cluster = Cluster::new("n1");
        let claim = |cluster: &mut Cluster| {
            cluster.admit(
                ("a".into(), "web".into()),
                vec!["10.244.1.5".parse().expect("ip"), "fd00::5".parse().expect("ip")],
            );
        };
        claim(&mut cluster);
        cluster.take(Watch::Pod(deleted(&["10.244.1.4"])));
        assert_eq!(cluster.admitted.len(), 1, "a former pod's deletion");
        cluster.take(Watch::Pod(deleted(&["fd00::5", "10.244.1.5"])));
        assert!(cluster.admitted.is_empty(), "its own deletion");
        claim(&mut cluster);
        cluster.take(Watch::Pod(deleted(&[])));
        assert!(cluster.admitted.is_empty(), "deleted before its status");
    }

    fn waiting(name: &str, synced: bool, until: Instant) -> (Waiting, oneshot::Receiver<Answer>) {
        let (answer, rx) = oneshot::channel();
        let w = Waiting {
            pod: key(name),
            until,
            synced,
            answer,
        };
        (w, rx)
    }

    #[test]
    fn an_add_is_told_enforced_only_after_a_pass_with_its_pod_known() {
        let metrics = Metrics::new(None);
        let later = Instant::now() + POD_WAIT;
        let mut cluster = Cluster::new("n1");
        let (w, mut rx) = waiting("web", true, later);
        let mut list = vec![w];
        answer_waiting(&mut list, &cluster, None, &metrics);
        assert!(
            matches!(rx.try_recv(), Ok(Answer::NotEnforced { .. })),
            "not listed"
        );

        cluster.pods.mark_listed();
        cluster.namespaces.mark_listed();
        cluster.policies.mark_listed();
        cluster
            .pods
            .known_mut()
            .insert(key("web"), pod("web", &["10.244.1.5"]));
        let (unsynced, mut unsynced_rx) = waiting("web", false, later);
        let (unseen, mut unseen_rx) = waiting("unseen", true, later);
        let (synced, mut synced_rx) = waiting("web", true, later);
        let mut list = vec![unsynced, unseen, synced];
        answer_waiting(&mut list, &cluster, None, &metrics);
        assert_eq!(synced_rx.try_recv().ok(), Some(Answer::Enforced));
        assert!(unsynced_rx.try_recv().is_err() && unseen_rx.try_recv().is_err());
        assert_eq!(list.len(), 2, "both wait");

        answer_waiting(&mut list, &cluster, Some("nft: no"), &metrics);
        assert!(
            matches!(unsynced_rx.try_recv(), Ok(Answer::NotEnforced { reason }) if reason.contains("nft: no"))
        );
        assert!(list.is_empty());

        // Known, but bound elsewhere (or not yet bound): not this node's
        // to answer for.
        let mut elsewhere = pod("moved", &["10.244.1.7"]);
        elsewhere.node = Some("n2".into());
        cluster.pods.known_mut().insert(key("moved"), elsewhere);
        let (moved, mut moved_rx) = waiting("moved", true, later);
        let mut list = vec![moved];
        answer_waiting(&mut list, &cluster, None, &metrics);
        assert!(
            moved_rx.try_recv().is_err() && list.len() == 1,
            "waits for its binding"
        );
        if let Some(pod) = cluster.pods.known_mut().get_mut(&key("moved")) {
            pod.node = Some("n1".into());
        }
        answer_waiting(&mut list, &cluster, None, &metrics);
        assert_eq!(moved_rx.try_recv().ok(), Some(Answer::Enforced));

        let (expired, mut expired_rx) = waiting("unseen", true, Instant::now());
        let mut list = vec![expired];
        answer_waiting(&mut list, &cluster, None, &metrics);
        assert!(
            matches!(expired_rx.try_recv(), Ok(Answer::NotEnforced { reason }) if reason.contains("not seen"))
        );
    }
}
