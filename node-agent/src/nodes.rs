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
use serde_json::Value;

use crate::Error;
use crate::conflist::{self, NodeNetwork};
use crate::health::Health;
use crate::routes;
use crate::settings::Settings;

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
pub async fn follow(api: Api<Node>, settings: Settings, health: Health) -> Result<(), Error> {
    let chained = conflist::chained_plugins(&settings)?;
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut nodes: BTreeMap<String, NodeInfo> = BTreeMap::new();
    let mut relisted: Option<BTreeMap<String, NodeInfo>> = None;
    let mut written: Option<Value> = None;
    let mut routed: Option<BTreeMap<IpNetwork, IpAddr>> = None;
    let mut resync = tokio::time::interval(RESYNC);
    loop {
        let event = tokio::select! {
            event = stream.next() => match event {
                Some(event) => event,
                None => break,
            },
            _ = resync.tick() => {
                // Someone may have deleted a route or the file: put them
                // back even when no Node changed.
                routed = None;
                written = None;
                if relisted.is_none() && health.listed() {
                    sync(&settings, &nodes, &chained, &mut written, &mut routed, &health).await;
                }
                continue;
            }
        };
        match event {
            Ok(Event::Init) => relisted = Some(BTreeMap::new()),
            Ok(Event::InitApply(node)) => {
                if let (Some(list), Some(info)) = (relisted.as_mut(), NodeInfo::from_node(&node)) {
                    list.insert(info.name.clone(), info);
                }
            }
            Ok(Event::InitDone) => {
                nodes = relisted.take().unwrap_or_default();
                health.set_listed(true);
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
        sync(&settings, &nodes, &chained, &mut written, &mut routed, &health).await;
    }
    Err(Error::Watch("the Node watch ended".into()))
}

/// How often the file and the routes are checked with no Node changing.
const RESYNC: std::time::Duration = std::time::Duration::from_secs(30);

/// Brings the conflist and the routes in line with `nodes`.
async fn sync(
    settings: &Settings,
    nodes: &BTreeMap<String, NodeInfo>,
    chained: &[Value],
    written: &mut Option<Value>,
    routed: &mut Option<BTreeMap<IpNetwork, IpAddr>>,
    health: &Health,
) {
    if let Err(e) = write_own(settings, nodes, chained, written, health).await {
        log::error!("{e}");
        health.set_configured(false);
    }
    let wanted = routes::wanted(&settings.node_name, nodes);
    if routed.as_ref() == Some(&wanted) {
        return;
    }
    let target = wanted.clone();
    match tokio::task::spawn_blocking(move || routes::reconcile(&target)).await {
        Ok(Ok(changes)) => {
            for (dst, gateway) in &changes.set {
                log::info!("route {dst} via {gateway}");
            }
            for dst in &changes.removed {
                log::info!("removed the route to {dst}");
            }
            *routed = Some(wanted);
            health.set_routed(true);
        }
        Ok(Err(e)) => {
            log::error!("{e}");
            *routed = None;
            health.set_routed(false);
        }
        Err(e) => {
            log::error!("routes: {e}");
            *routed = None;
            health.set_routed(false);
        }
    }
}

/// Writes this node's configuration if its content changed.
async fn write_own(
    settings: &Settings,
    nodes: &BTreeMap<String, NodeInfo>,
    chained: &[Value],
    written: &mut Option<Value>,
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
    let mtu = tokio::task::spawn_blocking(move || conflist::uplink_mtu(&internal_ips))
        .await
        .map_err(|e| Error::Io(format!("looking up the uplink's MTU: {e}")))?;
    let network = NodeNetwork {
        pod_cidrs: own.pod_cidrs.clone(),
        mtu,
    };
    let content = conflist::render(settings, &network, chained);
    if written.as_ref() != Some(&content) || !settings.conflist_path().exists() {
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
        *written = Some(content);
    }
    health.set_configured(true);
    Ok(())
}
