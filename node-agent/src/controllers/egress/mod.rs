//! The masquerade of traffic leaving the cluster: only what this node's
//! pods send outside the cluster's pod range is masqueraded, so pod-to-pod
//! traffic between nodes keeps its source address. The range is
//! `CLUSTER_CIDRS` when set, else kubeadm's and the Nodes' pod CIDRs,
//! merged; the rules are in [`rules`]. Run by the Node watch.

use std::net::IpAddr;

use ipnetwork::IpNetwork;

pub mod rules;

use crate::changes;
use crate::cluster::node::Nodes;
use crate::cluster::pod_range::PodRange;
use crate::error::Error;
use crate::health::Health;
use crate::metrics::{Metrics, Outcome};
use crate::settings::Settings;

/// What the masquerade is made of besides the Nodes.
#[derive(Debug, Clone)]
pub struct Options {
    /// This node's name: its pod CIDRs are the masqueraded sources.
    pub node_name: String,
    /// `CLUSTER_CIDRS`; empty: from kubeadm's range and the Nodes.
    pub cluster_cidrs: Vec<IpNetwork>,
}

impl Options {
    pub fn from_settings(settings: &Settings) -> Options {
        Options {
            node_name: settings.node_name.clone(),
            cluster_cidrs: settings.cluster_cidrs.clone(),
        }
    }
}

/// The masquerade controller: its options and what its last run put in
/// place, so a run that would change none of it (most Node updates are
/// status heartbeats) costs nothing.
#[derive(Debug)]
pub struct Egress {
    options: Options,
    /// This node's pod CIDRs and the cluster's, as masqueraded.
    masqueraded: Option<(Vec<IpNetwork>, Vec<IpNetwork>)>,
    metrics: Metrics,
}

impl Egress {
    pub fn new(options: Options, metrics: Metrics) -> Egress {
        Egress {
            options,
            masqueraded: None,
            metrics,
        }
    }

    /// Whether the cluster's range is set (`CLUSTER_CIDRS`), so kubeadm's
    /// is never looked for.
    pub fn range_is_set(&self) -> bool {
        !self.options.cluster_cidrs.is_empty()
    }

    /// Forgets what is in place: the next run checks it all again.
    pub fn forget(&mut self) {
        self.masqueraded = None;
    }

    /// Brings the masquerade in line with `nodes` and kubeadm's range.
    pub async fn run(&mut self, pod_range: &PodRange, nodes: &Nodes, health: &Health) {
        let masquerade = (
            nodes
                .get(&self.options.node_name)
                .map(|n| n.pod_cidrs.clone())
                .unwrap_or_default(),
            cluster_range(&self.options, pod_range, nodes),
        );
        if self.masqueraded.as_ref() == Some(&masquerade) {
            return;
        }
        let (sources, cluster) = masquerade.clone();
        match changes::blocking(move || {
            changes::change(|| rules::apply(&sources, &cluster).map_err(Error::Masquerade))
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
                self.masqueraded = Some(masquerade);
                self.metrics.egress_synced(Outcome::Success);
                health.set_masqueraded(true);
            }
            Err(e) => {
                log::error!("masquerade: {e}");
                self.masqueraded = None;
                self.metrics.egress_synced(Outcome::Failure);
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
fn cluster_range(options: &Options, pod_range: &PodRange, nodes: &Nodes) -> Vec<IpNetwork> {
    if !options.cluster_cidrs.is_empty() {
        return options.cluster_cidrs.clone();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::node::NodeInfo;

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
    fn cluster(count: u32) -> Nodes {
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

    fn options() -> Options {
        let settings = <Settings as clap::Parser>::try_parse_from(["cni-node-agent", "--node-name", "n"])
            .expect("settings");
        Options::from_settings(&settings)
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
            shown(&cluster_range(&options(), &PodRange::Absent, &cluster(3))),
            [
                "10.0.0.0/23",
                "10.0.2.0/24",
                "fd00:10:244::/63",
                "fd00:10:244:2::/64"
            ]
        );
        assert_eq!(
            shown(&cluster_range(&options(), &PodRange::Absent, &cluster(4))),
            ["10.0.0.0/22", "fd00:10:244::/62"]
        );
        // 5000 = 4096 + 512 + 256 + 128 + 8: five prefixes per family.
        assert_eq!(
            shown(&cluster_range(&options(), &PodRange::Absent, &cluster(5000))),
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
                shown(&cluster_range(&options(), &kubeadm, &cluster(count))),
                ["10.0.0.0/11", "fd00:10:244::/48"]
            );
        }
        // A CIDR set by hand outside the range still keeps pods' addresses.
        let mut nodes = cluster(3);
        nodes.extend([node(9, &["192.168.7.0/24"])]);
        assert_eq!(
            shown(&cluster_range(&options(), &kubeadm, &nodes)),
            ["10.0.0.0/11", "192.168.7.0/24", "fd00:10:244::/48"]
        );
        // A podSubnet over the nodes' own LAN is not trusted: the Nodes'
        // CIDRs alone for that family.
        let mut on_lan = cluster(3);
        if let Some(info) = on_lan.get_mut("node-1") {
            info.internal_ips = vec!["10.0.200.1".parse().expect("an address")];
        }
        assert_eq!(
            shown(&cluster_range(&options(), &kubeadm, &on_lan)),
            ["10.0.0.0/23", "10.0.2.0/24", "fd00:10:244::/48"]
        );
        // Unknown yet: the Nodes' own, as without kubeadm.
        assert_eq!(
            cluster_range(&options(), &PodRange::Unknown, &cluster(4)),
            cluster_range(&options(), &PodRange::Absent, &cluster(4))
        );
    }

    #[test]
    fn a_set_range_wins() {
        let mut options = options();
        options.cluster_cidrs = vec!["10.244.0.0/16".parse().expect("a CIDR")];
        assert_eq!(
            shown(&cluster_range(&options, &PodRange::Absent, &cluster(3))),
            ["10.244.0.0/16"]
        );
    }
}
