//! The cluster's Nodes as the agent follows them: one watch on all Nodes
//! (this node's for its configuration, the others' for routes), kept as a
//! map that a restarted watch's relist replaces whole; after every change,
//! and every [`RESYNC`], the file and the routes are brought in line.

use std::collections::BTreeMap;
use std::net::IpAddr;

use futures::StreamExt;
use ipnetwork::IpNetwork;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

use crate::Error;
use crate::conflist::{self, NodeNetwork};
use crate::health::Health;
use crate::settings::Settings;
use crate::{changes, routes};

/// What the agent reads from a Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `spec.podCIDRs`, or `spec.podCIDR` when that list is empty (as
    /// kindnetd reads them); unparsable entries are skipped and logged.
    pub pod_cidrs: Vec<IpNetwork>,
    /// `status.addresses` of type InternalIP.
    pub internal_ips: Vec<IpAddr>,
}

impl NodeInfo {
    pub fn from_node(node: &Node) -> Option<NodeInfo> {
        let name = node.metadata.name.clone()?;
        let spec = node.spec.as_ref();
        let listed: Vec<String> = spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default();
        let texts = if listed.is_empty() {
            spec.and_then(|s| s.pod_cidr.clone()).into_iter().collect()
        } else {
            listed
        };
        let pod_cidrs = texts
            .iter()
            .filter_map(|text| match text.parse::<IpNetwork>() {
                Ok(cidr) => Some(netlink::route::network_of(cidr)),
                Err(e) => {
                    log::warn!("node {name}: pod CIDR {text:?} is not a network: {e}");
                    None
                }
            })
            .collect();
        let internal_ips = node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse().ok())
            .collect();
        Some(NodeInfo {
            name,
            pod_cidrs,
            internal_ips,
        })
    }
}

/// Follows every Node until the stream ends (it does not: errors are
/// retried with backoff), writing this node's configuration whenever what
/// it is made of changes.
pub async fn follow(
    api: Api<Node>,
    settings: Settings,
    chained: conflist::Chain,
    health: Health,
) -> Result<(), Error> {
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut nodes: BTreeMap<String, NodeInfo> = BTreeMap::new();
    let mut relisted: Option<BTreeMap<String, NodeInfo>> = None;
    let mut synced = Synced::default();
    let mut skips = routes::Skips::default();
    let mut listed_once = false;
    let mut resync = tokio::time::interval(RESYNC);
    loop {
        let event = tokio::select! {
            event = stream.next() => match event {
                Some(event) => event,
                None => break,
            },
            _ = resync.tick() => {
                // Someone may have deleted a route, a rule or the file:
                // put them back even when no Node changed.
                // While the watch is down or relisting, from the last
                // list the agent had.
                synced = Synced::default();
                if listed_once {
                    sync(&settings, &nodes, &chained, &mut synced, &mut skips, &health).await;
                }
                continue;
            }
        };
        // Ready only while the watch is in place: not while it relists
        // or fails.
        health.set_listed(matches!(
            event,
            Ok(Event::InitDone | Event::Apply(_) | Event::Delete(_))
        ));
        match event {
            Ok(Event::Init) => relisted = Some(BTreeMap::new()),
            Ok(Event::InitApply(node)) => {
                if let (Some(list), Some(info)) = (relisted.as_mut(), NodeInfo::from_node(&node)) {
                    list.insert(info.name.clone(), info);
                }
            }
            Ok(Event::InitDone) => {
                nodes = relisted.take().unwrap_or_default();
                listed_once = true;
            }
            Ok(Event::Apply(node)) => {
                if let Some(info) = NodeInfo::from_node(&node) {
                    nodes.insert(info.name.clone(), info);
                }
            }
            Ok(Event::Delete(node)) => {
                if let Some(name) = node.metadata.name {
                    nodes.remove(&name);
                }
            }
            Err(e) => {
                log::warn!("watching Nodes: {e}; retrying");
                continue;
            }
        }
        if relisted.is_some() {
            continue;
        }
        sync(&settings, &nodes, &chained, &mut synced, &mut skips, &health).await;
    }
    Err(Error::Watch("the Node watch ended".into()))
}

/// How often the file, the routes and the rules are checked with no Node
/// changing.
pub const RESYNC: std::time::Duration = std::time::Duration::from_secs(30);

/// What the last sync put in place, so an event that changes none of it
/// (most Node updates are status heartbeats) costs nothing.
#[derive(Debug, Default)]
struct Synced {
    routed: Option<BTreeMap<IpNetwork, routes::Via>>,
    /// This node's pod CIDRs and the cluster's, as masqueraded.
    masqueraded: Option<(Vec<IpNetwork>, Vec<IpNetwork>)>,
}

/// Brings the conflist, the routes and the masquerade in line with `nodes`.
async fn sync(
    settings: &Settings,
    nodes: &BTreeMap<String, NodeInfo>,
    chained: &conflist::Chain,
    synced: &mut Synced,
    skips: &mut routes::Skips,
    health: &Health,
) {
    if let Err(e) = write_own(settings, nodes, chained, health).await {
        log::error!("{e}");
        health.set_configured(false);
    }
    let wanted = routes::wanted(&settings.node_name, nodes);
    if synced.routed.as_ref() != Some(&wanted.routes) {
        let target = wanted.routes.clone();
        match blocking(move || changes::change(|| routes::reconcile(&target))).await {
            Ok(changes) => {
                for (dst, gateway) in &changes.set {
                    log::info!("route {dst} via {gateway}");
                }
                for dst in &changes.removed {
                    log::info!("removed the route to {dst}");
                }
                for subnet in &changes.restored {
                    log::warn!(
                        "put back the connected route to {subnet}, which an earlier agent had replaced"
                    );
                }
                skips.found = changes.skipped;
                if changes.failed.is_empty() {
                    synced.routed = Some(wanted.routes);
                    health.set_routed(true);
                } else {
                    log::error!("{}", routes::failure(&changes.failed));
                    synced.routed = None;
                    health.set_routed(false);
                }
            }
            Err(e) => {
                log::error!("{e}");
                synced.routed = None;
                health.set_routed(false);
            }
        }
    }
    skips.warn_new(wanted.skipped);
    let masquerade = (
        nodes
            .get(&settings.node_name)
            .map(|n| n.pod_cidrs.clone())
            .unwrap_or_default(),
        cluster_range(settings, nodes),
    );
    if synced.masqueraded.as_ref() != Some(&masquerade) {
        let (sources, cluster) = masquerade.clone();
        match blocking(move || {
            changes::change(|| {
                firewall::egress::apply(&sources, &cluster).map_err(|e| Error::Io(e.to_string()))
            })
        })
        .await
        {
            Ok(changed) => {
                if !changed.is_empty() {
                    log::info!(
                        "masquerading traffic from {:?} leaving {:?} ({changed:?})",
                        masquerade.0,
                        masquerade.1
                    );
                }
                synced.masqueraded = Some(masquerade);
                health.set_masqueraded(true);
            }
            Err(e) => {
                log::error!("masquerade: {e}");
                synced.masqueraded = None;
                health.set_masqueraded(false);
            }
        }
    }
}

/// The cluster's pod range: as set, else every Node's pod CIDRs.
fn cluster_range(settings: &Settings, nodes: &BTreeMap<String, NodeInfo>) -> Vec<IpNetwork> {
    if !settings.cluster_cidrs.is_empty() {
        return settings.cluster_cidrs.clone();
    }
    let all: std::collections::BTreeSet<IpNetwork> =
        nodes.values().flat_map(|n| n.pod_cidrs.iter().copied()).collect();
    all.into_iter().collect()
}

/// Runs netlink or iptables work off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Io(format!("a blocking task: {e}")))?
}

/// Writes this node's configuration if its content changed.
async fn write_own(
    settings: &Settings,
    nodes: &BTreeMap<String, NodeInfo>,
    chained: &conflist::Chain,
    health: &Health,
) -> Result<(), Error> {
    let Some(own) = nodes.get(&settings.node_name) else {
        health.set_configured(false);
        log::warn!(
            "node {} is not among the Nodes; waiting for it",
            settings.node_name
        );
        return Ok(());
    };
    if own.pod_cidrs.is_empty() {
        health.set_configured(false);
        log::warn!("node {} has no pod CIDR yet; waiting for one", own.name);
        return Ok(());
    }
    let internal_ips = own.internal_ips.clone();
    let mtu = blocking(move || Ok(conflist::uplink_mtu(&internal_ips))).await?;
    let network = NodeNetwork {
        pod_cidrs: own.pod_cidrs.clone(),
        mtu,
    };
    let content = conflist::render(settings, &network, &chained.plugins(&settings.cni_bin_dir));
    let path = settings.conflist_path();
    if conflist::write_if_changed(&path, &content)? {
        log::info!(
            "wrote {} for pod CIDRs {:?}, MTU {mtu}",
            path.display(),
            network
                .pod_cidrs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        );
    }
    health.set_configured(true);
    Ok(())
}
