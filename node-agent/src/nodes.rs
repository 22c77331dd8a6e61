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

use crate::cluster::node::NodeInfo;
use crate::cluster::pod_range::{self, PodRange};
use crate::conflist::{self, NodeNetwork};
use crate::error::Error;
use crate::health::Health;
use crate::settings::Settings;
use crate::{changes, conf_dir, routes};

/// Follows every Node until the stream ends (it does not: errors are
/// retried with backoff), writing this node's configuration whenever what
/// it is made of changes.
pub async fn follow(
    client: kube::Client,
    settings: Settings,
    chained: conflist::Chain,
    health: Health,
) -> Result<(), Error> {
    let api: Api<Node> = Api::all(client.clone());
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut nodes: BTreeMap<String, NodeInfo> = BTreeMap::new();
    let mut relisted: Option<BTreeMap<String, NodeInfo>> = None;
    let mut synced = Synced::default();
    let mut skips = routes::Skips::default();
    let mut listed_once = false;
    let mut pod_range = pod_range::Reader::new(client.clone(), !settings.cluster_cidrs.is_empty());
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
                    let range = pod_range.current().await;
                    sync(&settings, range, &nodes, &chained, &mut synced, &mut skips, &health).await;
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
                let Some(info) = NodeInfo::from_node(&node) else {
                    continue;
                };
                // Most updates are heartbeats, conditions and taints: what
                // the agent reads is the same, and nothing is looked at
                // (no netlink, no iptables, no file) until the resync.
                if nodes.get(&info.name) == Some(&info) {
                    continue;
                }
                nodes.insert(info.name.clone(), info);
            }
            Ok(Event::Delete(node)) => {
                let known = node.metadata.name.and_then(|name| nodes.remove(&name));
                if known.is_none() {
                    continue;
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
        sync(
            &settings,
            pod_range.current().await,
            &nodes,
            &chained,
            &mut synced,
            &mut skips,
            &health,
        )
        .await;
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
    pod_range: &PodRange,
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
        // What the last reconciliation left in place, when it all went in:
        // then only the difference is applied.
        let before = synced.routed.take();
        let target = wanted.routes;
        let applied = blocking(move || {
            changes::change(|| {
                let changes = match before
                    .as_ref()
                    .and_then(|before| routes::apply_changes(before, &target))
                {
                    Some(changes) => (changes?, true),
                    None => (routes::reconcile(&target)?, false),
                };
                Ok((changes, target))
            })
        })
        .await;
        match applied {
            Ok(((changes, only_differences), target)) => {
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
                if only_differences {
                    skips.found.retain(|skip| target.contains_key(&skip.cidr));
                    skips.found.extend(changes.skipped);
                } else {
                    skips.found = changes.skipped;
                }
                if changes.failed.is_empty() {
                    synced.routed = Some(target);
                    health.set_routed(true);
                } else {
                    log::error!("{}", routes::failure(&changes.failed));
                    health.set_routed(false);
                }
            }
            Err(e) => {
                log::error!("{e}");
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
        cluster_range(settings, pod_range, nodes),
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

/// The cluster's pod range: as set; else kubeadm's podSubnet and every
/// Node's pod CIDR, merged into the fewest prefixes that hold exactly
/// their addresses (nested ones dropped, sibling halves joined). With
/// kubeadm's range every Node's CIDR is inside it: one rule per family at
/// any size. Without, the controller-manager's CIDRs handed out one after
/// the other merge into a rule per set bit of the Node count (5 at 5000
/// Nodes), not one per Node. Nothing outside the Nodes' CIDRs and the
/// recorded range is ever taken for a pod.
fn cluster_range(
    settings: &Settings,
    pod_range: &PodRange,
    nodes: &BTreeMap<String, NodeInfo>,
) -> Vec<IpNetwork> {
    if !settings.cluster_cidrs.is_empty() {
        return settings.cluster_cidrs.clone();
    }
    // A recorded range holding a Node's address is no pod range (a
    // podSubnet set over the node LAN): pods reaching the nodes and hosts
    // in it must still be masqueraded, so it is not trusted.
    let node_ips: Vec<IpAddr> = nodes
        .values()
        .flat_map(|n| n.internal_ips.iter().copied())
        .collect();
    let recorded: Vec<IpNetwork> = pod_range
        .prefixes()
        .iter()
        .copied()
        .filter(|r| !node_ips.iter().any(|ip| r.contains(*ip)))
        .collect();
    let outside_recorded = |cidr: &&IpNetwork| {
        !recorded
            .iter()
            .any(|r| r.contains(cidr.network()) && r.prefix() <= cidr.prefix())
    };
    let mut range = Vec::new();
    for ipv4 in [true, false] {
        // Only the CIDRs outside kubeadm's range are sorted and merged: at
        // 5000 Nodes, none.
        let cidrs: Vec<IpNetwork> = recorded
            .iter()
            .chain(
                nodes
                    .values()
                    .flat_map(|n| n.pod_cidrs.iter())
                    .filter(outside_recorded),
            )
            .copied()
            .filter(|c| c.is_ipv4() == ipv4)
            .collect();
        range.extend(merged(&cidrs));
    }
    range
}

/// A prefix as (network bits, prefix length) within a family's `width`.
type Prefix = (u128, u32);

/// The fewest prefixes holding exactly the addresses of `cidrs`, all of
/// one family, in address order.
fn merged(cidrs: &[IpNetwork]) -> Vec<IpNetwork> {
    let Some(first) = cidrs.first() else {
        return Vec::new();
    };
    let ipv4 = first.is_ipv4();
    let width: u32 = if ipv4 { 32 } else { 128 };
    let mut prefixes: Vec<Prefix> = cidrs
        .iter()
        .filter(|c| c.is_ipv4() == ipv4)
        .map(|c| {
            let network = match c.network() {
                IpAddr::V4(a) => u128::from(u32::from(a)),
                IpAddr::V6(a) => u128::from(a),
            };
            (network, u32::from(c.prefix()))
        })
        .collect();
    // By address, and a wider prefix before the ones it holds.
    prefixes.sort_unstable();
    prefixes.dedup();
    let holds = |(outer, outer_len): Prefix, (inner, inner_len): Prefix| {
        outer_len <= inner_len && (outer_len == 0 || (outer ^ inner) >> (width - outer_len) == 0)
    };
    // The two halves of one prefix one length shorter.
    let siblings = |(low, low_len): Prefix, (high, high_len): Prefix| {
        low_len == high_len
            && low_len > 0
            && (low >> (width - low_len)) & 1 == 0
            && high == low | (1u128 << (width - low_len))
    };
    let mut kept: Vec<Prefix> = Vec::new();
    for prefix in prefixes {
        if kept.last().is_some_and(|&last| holds(last, prefix)) {
            continue;
        }
        kept.push(prefix);
        while kept.len() >= 2 && siblings(kept[kept.len() - 2], kept[kept.len() - 1]) {
            kept.pop();
            if let Some(low) = kept.last_mut() {
                low.1 -= 1;
            }
        }
    }
    kept.into_iter()
        .filter_map(|(network, length)| {
            let address = if ipv4 {
                IpAddr::V4(std::net::Ipv4Addr::from(u32::try_from(network).ok()?))
            } else {
                IpAddr::V6(std::net::Ipv6Addr::from(network))
            };
            IpNetwork::new(address, u8::try_from(length).ok()?).ok()
        })
        .collect()
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
    if conf_dir::write_if_changed(&path, &content)? {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn node(index: u32, pod_cidrs: &[&str]) -> (String, NodeInfo) {
        let name = format!("node-{index}");
        let info = NodeInfo {
            name: name.clone(),
            pod_cidrs: pod_cidrs.iter().map(|c| c.parse().expect("a CIDR")).collect(),
            internal_ips: Vec::new(),
        };
        (name, info)
    }

    /// Nodes as the controller-manager numbers them from 10.0.0.0/8 and
    /// fd00:10:244::/48 (kind's 10.244.0.0/16 holds only 256 of them).
    fn cluster(count: u32) -> BTreeMap<String, NodeInfo> {
        (0..count)
            .map(|i| {
                node(
                    i,
                    &[
                        &format!("10.{}.{}.0/24", i / 256, i % 256),
                        &format!("fd00:10:244:{i:x}::/64"),
                    ],
                )
            })
            .collect()
    }

    fn settings() -> Settings {
        <Settings as clap::Parser>::try_parse_from(["cni-node-agent", "--node-name", "n"]).expect("settings")
    }

    fn shown(range: &[IpNetwork]) -> Vec<String> {
        range.iter().map(ToString::to_string).collect()
    }

    fn nets(cidrs: &[&str]) -> Vec<IpNetwork> {
        cidrs.iter().map(|c| c.parse().expect("a CIDR")).collect()
    }

    #[test]
    fn the_range_is_a_rule_per_set_bit_of_the_node_count_not_per_node() {
        assert_eq!(
            shown(&cluster_range(&settings(), &PodRange::Absent, &cluster(3))),
            [
                "10.0.0.0/23",
                "10.0.2.0/24",
                "fd00:10:244::/63",
                "fd00:10:244:2::/64"
            ]
        );
        assert_eq!(
            shown(&cluster_range(&settings(), &PodRange::Absent, &cluster(4))),
            ["10.0.0.0/22", "fd00:10:244::/62"]
        );
        // 5000 = 4096 + 512 + 256 + 128 + 8: five prefixes per family.
        assert_eq!(
            shown(&cluster_range(&settings(), &PodRange::Absent, &cluster(5000))),
            [
                "10.0.0.0/12",
                "10.16.0.0/15",
                "10.18.0.0/16",
                "10.19.0.0/17",
                "10.19.128.0/21",
                "fd00:10:244::/52",
                "fd00:10:244:1000::/55",
                "fd00:10:244:1200::/56",
                "fd00:10:244:1300::/57",
                "fd00:10:244:1380::/61",
            ]
        );
    }

    #[test]
    fn nothing_outside_the_cidrs_is_taken_for_a_pod() {
        // Far apart, unaligned or nested: only what they hold.
        assert_eq!(
            shown(&merged(&nets(&["10.200.0.0/24", "10.1.0.0/24"]))),
            ["10.1.0.0/24", "10.200.0.0/24"]
        );
        assert_eq!(
            shown(&merged(&nets(&["10.0.1.0/24", "10.0.2.0/24"]))),
            ["10.0.1.0/24", "10.0.2.0/24"]
        );
        assert_eq!(
            shown(&merged(&nets(&["10.0.0.0/16", "10.0.3.0/24", "10.0.0.0/16"]))),
            ["10.0.0.0/16"]
        );
        assert_eq!(
            shown(&merged(&nets(&["0.0.0.0/1", "128.0.0.0/1"]))),
            ["0.0.0.0/0"]
        );
        assert_eq!(shown(&merged(&nets(&["::/1", "8000::/1"]))), ["::/0"]);
        assert!(merged(&[]).is_empty());
    }

    #[test]
    fn kubeadms_range_holds_every_node_in_one_rule_per_family_and_an_outlier_is_added() {
        let kubeadm = PodRange::Known(nets(&["10.0.0.0/11", "fd00:10:244::/48"]));
        for count in [3, 5000] {
            assert_eq!(
                shown(&cluster_range(&settings(), &kubeadm, &cluster(count))),
                ["10.0.0.0/11", "fd00:10:244::/48"]
            );
        }
        // A CIDR set by hand outside the range still keeps pods' addresses.
        let mut nodes = cluster(3);
        nodes.extend([node(9, &["192.168.7.0/24"])]);
        assert_eq!(
            shown(&cluster_range(&settings(), &kubeadm, &nodes)),
            ["10.0.0.0/11", "192.168.7.0/24", "fd00:10:244::/48"]
        );
        // A podSubnet over the nodes' own LAN is not trusted: the Nodes'
        // CIDRs alone for that family.
        let mut on_lan = cluster(3);
        if let Some(info) = on_lan.get_mut("node-1") {
            info.internal_ips = vec!["10.0.200.1".parse().expect("an address")];
        }
        assert_eq!(
            shown(&cluster_range(&settings(), &kubeadm, &on_lan)),
            ["10.0.0.0/23", "10.0.2.0/24", "fd00:10:244::/48"]
        );
        // Unknown yet: the Nodes' own, as without kubeadm.
        assert_eq!(
            cluster_range(&settings(), &PodRange::Unknown, &cluster(4)),
            cluster_range(&settings(), &PodRange::Absent, &cluster(4))
        );
    }

    #[test]
    fn a_set_range_wins() {
        let mut settings = settings();
        settings.cluster_cidrs = vec!["10.244.0.0/16".parse().expect("a CIDR")];
        assert_eq!(
            shown(&cluster_range(&settings, &PodRange::Absent, &cluster(3))),
            ["10.244.0.0/16"]
        );
    }
}
