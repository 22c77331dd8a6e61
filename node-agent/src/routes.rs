//! Routes between nodes: to every other Node's pod CIDRs via its
//! InternalIP of the same family, as kindnetd sets them. The agent's
//! routes carry their own protocol number, so after a restart it knows
//! which routes it made: those no Node asks for any more are removed, and
//! a route to a pod CIDR with a wrong gateway is replaced whoever made it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnetwork::IpNetwork;
use netlink::{Netlink, RouteInfo};

use crate::Error;
use crate::nodes::NodeInfo;

/// The `rtm_protocol` of the agent's routes (`ip route show proto 201`);
/// unassigned in iproute2's `rt_protos`.
pub const PROTOCOL: u8 = 201;

/// What the routing table should hold: destination → gateway.
pub fn wanted(own: &str, nodes: &BTreeMap<String, NodeInfo>) -> BTreeMap<IpNetwork, IpAddr> {
    let own_cidrs: Vec<IpNetwork> = nodes.get(own).map(|n| n.pod_cidrs.clone()).unwrap_or_default();
    let mut routes = BTreeMap::new();
    for node in nodes.values().filter(|n| n.name != own) {
        for cidr in &node.pod_cidrs {
            if own_cidrs.iter().any(|mine| overlap(*mine, *cidr)) {
                log::warn!(
                    "node {}: pod CIDR {cidr} overlaps this node's; no route to it",
                    node.name
                );
                continue;
            }
            let gateway = node.internal_ips.iter().find(|ip| ip.is_ipv4() == cidr.is_ipv4());
            match gateway {
                Some(gateway) => {
                    routes.insert(*cidr, *gateway);
                }
                None => log::warn!(
                    "node {}: no InternalIP of the family of {cidr}; no route to it",
                    node.name
                ),
            }
        }
    }
    routes
}

/// Whether two networks share an address: one holds the other's first.
fn overlap(a: IpNetwork, b: IpNetwork) -> bool {
    a.contains(b.network()) || b.contains(a.network())
}

/// What one reconciliation changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub set: Vec<(IpNetwork, IpAddr)>,
    pub removed: Vec<IpNetwork>,
}

/// Makes the main table hold exactly `wanted` among the agent's routes:
/// those no Node asks for removed, missing or wrong ones replaced in one
/// step (never deleted first). A route that fails (a gateway that is not
/// on-link) is reported and the others go on; the error lists every
/// failure. Runs on a blocking thread (netlink here is blocking), inside
/// [`crate::changes::change`].
pub fn reconcile(wanted: &BTreeMap<IpNetwork, IpAddr>) -> Result<Changes, Error> {
    let nl = Netlink::connect().map_err(netlink_error)?;
    let mut changes = Changes::default();
    let mut failures = Vec::new();
    let mut present: BTreeMap<IpNetwork, Option<IpAddr>> = BTreeMap::new();
    for v4 in [true, false] {
        for route in nl.routes_of_protocol(v4, PROTOCOL).map_err(netlink_error)? {
            if wanted.contains_key(&route.dst) {
                present.insert(route.dst, route.gw);
            } else {
                match nl.del_route(&route, PROTOCOL) {
                    Ok(()) => changes.removed.push(route.dst),
                    Err(e) => failures.push(e.to_string()),
                }
            }
        }
    }
    let table = main_table(&nl, wanted.keys().copied().collect())?;
    for (dst, gateway) in wanted {
        let ours_and_right = present.get(dst) == Some(&Some(*gateway));
        let right_anyway = table.get(dst) == Some(&Some(*gateway));
        if ours_and_right && right_anyway {
            continue;
        }
        let route = RouteInfo {
            oif: None,
            ..RouteInfo::new(*dst, Some(*gateway), 0)
        };
        match nl.replace_route(&route, PROTOCOL) {
            Ok(()) => changes.set.push((*dst, *gateway)),
            Err(e) => failures.push(e.to_string()),
        }
    }
    if failures.is_empty() {
        Ok(changes)
    } else {
        for (dst, gateway) in &changes.set {
            log::info!("route {dst} via {gateway}");
        }
        Err(Error::Io(format!("routes: {}", failures.join("; "))))
    }
}

/// The main table's gateways for `destinations`, whoever made the routes.
fn main_table(
    nl: &Netlink,
    destinations: BTreeSet<IpNetwork>,
) -> Result<BTreeMap<IpNetwork, Option<IpAddr>>, Error> {
    let mut table = BTreeMap::new();
    for v4 in [true, false] {
        for route in nl.routes(v4).map_err(netlink_error)? {
            if route.table == netlink::route::MAIN_TABLE && destinations.contains(&route.dst) {
                table.insert(route.dst, route.gw);
            }
        }
    }
    Ok(table)
}

/// Removes every route the agent made (uninstall).
pub fn remove_all() -> Result<usize, Error> {
    reconcile(&BTreeMap::new()).map(|changes| changes.removed.len())
}

fn netlink_error(e: netlink::Error) -> Error {
    Error::Io(format!("routes: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cidrs: &[&str], ips: &[&str]) -> (String, NodeInfo) {
        (
            name.to_owned(),
            NodeInfo {
                name: name.to_owned(),
                pod_cidrs: cidrs.iter().map(|c| c.parse().expect("cidr")).collect(),
                internal_ips: ips.iter().map(|i| i.parse().expect("ip")).collect(),
            },
        )
    }

    #[test]
    fn every_other_nodes_ranges_go_via_its_address_of_that_family() {
        let nodes = BTreeMap::from([
            node(
                "a",
                &["10.244.0.0/24", "fd00:10:244::/64"],
                &["10.0.0.1", "fd00::1"],
            ),
            node(
                "b",
                &["10.244.1.0/24", "fd00:10:244:1::/64"],
                &["10.0.0.2", "fd00::2"],
            ),
            node("c", &["10.244.2.0/24", "fd00:10:244:2::/64"], &["10.0.0.3"]),
            node("d", &["10.244.0.128/25"], &["10.0.0.4"]),
            node("e", &[], &["10.0.0.5"]),
        ]);
        let routes = wanted("a", &nodes);
        let text: Vec<String> = routes.iter().map(|(d, g)| format!("{d} via {g}")).collect();
        assert_eq!(
            text,
            [
                "10.244.1.0/24 via 10.0.0.2",
                "10.244.2.0/24 via 10.0.0.3",
                "fd00:10:244:1::/64 via fd00::2",
            ],
            "none to itself, none without an address of the family, none overlapping its own range"
        );
    }
}
