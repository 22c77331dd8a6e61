//! Routes between nodes: to every other Node's pod CIDRs via its
//! InternalIP of the same family, as kindnetd sets them. The agent's
//! routes carry their own protocol number, so after a restart it knows
//! which routes it made, and it replaces or deletes only those: those no
//! Node asks for any more are removed, and one with a wrong gateway is
//! replaced. A destination someone else's route holds is left to it, and a
//! pod CIDR that would take the node's own traffic (one holding an address
//! of the node, a subnet on one of its links, one whose Node's InternalIP
//! is the node's own) gets no route: a cluster range overlapping the node
//! network must not cut the node off its LAN and its API server. Run by
//! the Node watch.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use ipnetwork::IpNetwork;
use netlink::{Netlink, RouteInfo};

use crate::changes;
use crate::cluster::node::Nodes;
use crate::error::Error;
use crate::health::Health;
use crate::metrics::{Metrics, Outcome};
use crate::settings::Settings;

/// The `rtm_protocol` of the agent's routes (`ip route show proto 201`);
/// unassigned in iproute2's `rt_protos`.
pub const PROTOCOL: u8 = 201;

/// `RT_SCOPE_LINK`: the scope of an IPv4 route to a subnet on a link, as
/// the kernel makes for an address's prefix.
const SCOPE_LINK: u8 = 253;

/// `RTPROT_KERNEL`: who made the route to an address's prefix (IPv6 ones
/// have no link scope).
const PROTOCOL_KERNEL: u8 = 2;

/// Where the route to one of another Node's pod CIDRs goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Via {
    pub node: String,
    pub gateway: IpAddr,
}

/// Why a pod CIDR of another Node gets no route.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// It overlaps this pod CIDR of this node's.
    OverlapsOwn(IpNetwork),
    /// Its Node has no InternalIP of its family to route through.
    NoAddressOfFamily,
    /// This Node, first by name, has the same pod CIDR: a cluster's IPAM
    /// never hands one out twice, so one of the two is wrong, and the
    /// route goes to the first.
    SameAs(String),
    /// It holds this address of the node: the route would take the
    /// node's own subnet.
    HoldsAddress(IpAddr),
    /// Its Node's InternalIP is this address of the node's own.
    GatewayIsOwn(IpAddr),
    /// It is a subnet on one of the node's links.
    OnLink,
    /// A route someone else made (this `rtm_protocol`) goes there.
    Taken { protocol: u8 },
    /// A route someone else made appeared there as the agent added its own.
    Appeared,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::OverlapsOwn(own) => write!(f, "it overlaps this node's pod CIDR {own}"),
            Reason::NoAddressOfFamily => write!(f, "the Node has no InternalIP of its family"),
            Reason::SameAs(node) => write!(f, "node {node} has the same pod CIDR"),
            Reason::HoldsAddress(ip) => write!(f, "it holds {ip}, an address of this node"),
            Reason::GatewayIsOwn(ip) => {
                write!(f, "the Node's InternalIP {ip} is an address of this node")
            }
            Reason::OnLink => write!(f, "it is a subnet on a link of this node"),
            Reason::Taken { protocol } => {
                write!(f, "a route someone else made goes there (proto {protocol})")
            }
            Reason::Appeared => write!(f, "a route someone else made appeared there"),
        }
    }
}

/// A pod CIDR the agent gives no route, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Skip {
    pub node: String,
    pub cidr: IpNetwork,
    pub reason: Reason,
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "node {}: no route to pod CIDR {}: {}",
            self.node, self.cidr, self.reason
        )
    }
}

/// The pod CIDRs given no route, each warned about once while it stays
/// so: Node heartbeats sync every few seconds. Kept across resyncs.
#[derive(Debug, Default)]
pub struct Skips {
    /// What the last reconciliation found in the way.
    pub found: BTreeSet<Skip>,
    warned: BTreeSet<Skip>,
}

impl Skips {
    /// Warns about the skips of `wanted` and [`Skips::found`] not warned
    /// about yet, and forgets those that no longer apply, so one coming
    /// back is warned about again.
    pub fn warn_new(&mut self, wanted: BTreeSet<Skip>) {
        for skip in self.news(wanted) {
            log::warn!("{skip}");
        }
    }

    fn news(&mut self, wanted: BTreeSet<Skip>) -> Vec<Skip> {
        let now: BTreeSet<Skip> = wanted.into_iter().chain(self.found.iter().cloned()).collect();
        let news = now.difference(&self.warned).cloned().collect();
        self.warned = now;
        news
    }
}

/// What the routes are made of besides the Nodes.
#[derive(Debug, Clone)]
pub struct Options {
    /// This node's name: every other Node's pod CIDRs are routed.
    pub node_name: String,
}

impl Options {
    pub fn from_settings(settings: &Settings) -> Options {
        Options {
            node_name: settings.node_name.clone(),
        }
    }
}

/// The routes controller: its options, what its last run put in place
/// (so a run that would change none of it costs nothing) and the pod
/// CIDRs given no route.
#[derive(Debug)]
pub struct Routes {
    options: Options,
    routed: Option<BTreeMap<IpNetwork, Via>>,
    skips: Skips,
    metrics: Metrics,
}

impl Routes {
    pub fn new(options: Options, metrics: Metrics) -> Routes {
        Routes {
            options,
            routed: None,
            skips: Skips::default(),
            metrics,
        }
    }

    /// Forgets what is in place: the next run checks it all again. The
    /// skips are kept, so none is warned about twice.
    pub fn forget(&mut self) {
        self.routed = None;
    }

    /// Brings the routes in line with `nodes`.
    pub async fn run(&mut self, nodes: &Nodes, health: &Health) {
        let wanted = wanted(&self.options.node_name, nodes);
        if self.routed.as_ref() != Some(&wanted.routes) {
            // What the last reconciliation left in place, when it all went in:
            // then only the difference is applied.
            let before = self.routed.take();
            let target = wanted.routes;
            let applied = changes::blocking(move || {
                changes::change(|| {
                    let changes = match before.as_ref().and_then(|before| apply_changes(before, &target)) {
                        Some(changes) => (changes?, true),
                        None => (reconcile(&target)?, false),
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
                        self.skips.found.retain(|skip| target.contains_key(&skip.cidr));
                        self.skips.found.extend(changes.skipped);
                    } else {
                        self.skips.found = changes.skipped;
                    }
                    if changes.failed.is_empty() {
                        self.routed = Some(target);
                        self.metrics.route_synced(Outcome::Success);
                        health.set_routed(true);
                    } else {
                        log::error!("{}", failure(&changes.failed));
                        self.metrics.route_synced(Outcome::Failure);
                        health.set_routed(false);
                    }
                }
                Err(e) => {
                    log::error!("{e}");
                    self.metrics.route_synced(Outcome::Failure);
                    health.set_routed(false);
                }
            }
        }
        self.skips.warn_new(wanted.skipped);
    }
}

/// What the Nodes ask of the routing table, before it is read.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Wanted {
    pub routes: BTreeMap<IpNetwork, Via>,
    pub skipped: BTreeSet<Skip>,
}

/// Routes to every other Node's pod CIDRs, but none overlapping this
/// node's own range or without an InternalIP of the family.
pub fn wanted(own: &str, nodes: &Nodes) -> Wanted {
    let own_cidrs: Vec<IpNetwork> = nodes.get(own).map(|n| n.pod_cidrs.clone()).unwrap_or_default();
    let mut wanted = Wanted::default();
    for node in nodes.values().filter(|n| n.name != own) {
        for cidr in &node.pod_cidrs {
            let skip = |reason| Skip {
                node: node.name.clone(),
                cidr: *cidr,
                reason,
            };
            if let Some(mine) = own_cidrs.iter().find(|mine| overlap(**mine, *cidr)) {
                wanted.skipped.insert(skip(Reason::OverlapsOwn(*mine)));
                continue;
            }
            if let Some(first) = wanted.routes.get(cidr) {
                wanted.skipped.insert(skip(Reason::SameAs(first.node.clone())));
                continue;
            }
            match node.internal_ips.iter().find(|ip| ip.is_ipv4() == cidr.is_ipv4()) {
                Some(gateway) => {
                    let via = Via {
                        node: node.name.clone(),
                        gateway: *gateway,
                    };
                    wanted.routes.insert(*cidr, via);
                }
                None => {
                    wanted.skipped.insert(skip(Reason::NoAddressOfFamily));
                }
            }
        }
    }
    wanted
}

/// Whether two networks share an address: one holds the other's first.
fn overlap(a: IpNetwork, b: IpNetwork) -> bool {
    a.contains(b.network()) || b.contains(a.network())
}

/// What one reconciliation changed, left alone, and failed to change.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub set: Vec<(IpNetwork, IpAddr)>,
    pub removed: Vec<IpNetwork>,
    /// Connected subnets whose route an earlier agent had taken over, put
    /// back as the kernel makes them.
    pub restored: Vec<IpNetwork>,
    /// The wanted routes found in the way of the node's own or of someone
    /// else's.
    pub skipped: BTreeSet<Skip>,
    /// What the kernel refused (a gateway that is not on-link), one entry
    /// a route.
    pub failed: Vec<String>,
}

/// Makes the main table hold exactly `wanted` among the agent's routes,
/// but for destinations in the way (see `conflict`): those routes of
/// the agent's no Node asks for removed, wrong ones replaced in one step
/// (never deleted first), missing ones added without replacing a route
/// someone else adds meanwhile. A route that fails is reported in
/// [`Changes::failed`] and the others go on. Runs on a blocking thread
/// (netlink here is blocking), inside [`crate::changes::change`].
pub fn reconcile(wanted: &BTreeMap<IpNetwork, Via>) -> Result<Changes, Error> {
    let nl = Netlink::connect().map_err(netlink_error)?;
    let local = nl.all_addresses().map_err(netlink_error)?;
    let mut table = nl.main_table_routes(true).map_err(netlink_error)?;
    table.extend(nl.main_table_routes(false).map_err(netlink_error)?);
    let plan = plan(wanted, &local, &table);
    let mut changes = Changes {
        skipped: plan.skipped,
        ..Changes::default()
    };
    for route in &plan.delete {
        match nl.del_route(route, PROTOCOL) {
            Ok(()) => changes.removed.push(route.dst),
            Err(e) => changes.failed.push(e.to_string()),
        }
    }
    for (oif, address) in &plan.restore {
        match nl.restore_connected_route(*address, *oif) {
            Ok(()) => changes.restored.push(netlink::route::network_of(*address)),
            Err(e) => changes.failed.push(e.to_string()),
        }
    }
    for (dst, via) in &plan.replace {
        match nl.replace_route(&route_to(*dst, via), PROTOCOL) {
            Ok(()) => changes.set.push((*dst, via.gateway)),
            Err(e) => changes.failed.push(e.to_string()),
        }
    }
    for (dst, via) in plan.create {
        match nl.create_route(&route_to(dst, &via), PROTOCOL) {
            Ok(true) => changes.set.push((dst, via.gateway)),
            Ok(false) => {
                changes.skipped.insert(Skip {
                    node: via.node,
                    cidr: dst,
                    reason: Reason::Appeared,
                });
            }
            Err(e) => changes.failed.push(e.to_string()),
        }
    }
    Ok(changes)
}

/// Applies what changed from `before` (every route of it in place, as the
/// last reconciliation left them) to `after` when that is only routes
/// added or removed: no dump of the table, so a Node joining a 5000-Node
/// cluster costs its own routes, not the table's. A route added is checked
/// against the node's addresses and the route the kernel has to its very
/// destination (one lookup each) as [`reconcile`] checks it, and never
/// replaces or joins a route someone else has there; a removed
/// one is deleted only if the agent added it. None when a gateway changed:
/// that takes the whole [`reconcile`]. Runs on a blocking thread.
pub fn apply_changes(
    before: &BTreeMap<IpNetwork, Via>,
    after: &BTreeMap<IpNetwork, Via>,
) -> Option<Result<Changes, Error>> {
    let (removed, added) = differences(before, after)?;
    Some(apply_additions_and_removals(&removed, &added))
}

/// Routes by destination, borrowed from a map.
type Entries<'a> = Vec<(&'a IpNetwork, &'a Via)>;

/// The routes of `before` not in `after` and those of `after` not in
/// `before`, found in one walk of both (each is sorted by destination);
/// None when a destination's gateway differs.
fn differences<'a>(
    before: &'a BTreeMap<IpNetwork, Via>,
    after: &'a BTreeMap<IpNetwork, Via>,
) -> Option<(Entries<'a>, Entries<'a>)> {
    let (mut removed, mut added) = (Vec::new(), Vec::new());
    let (mut old, mut new) = (before.iter().peekable(), after.iter().peekable());
    loop {
        match (old.peek(), new.peek()) {
            (None, None) => return Some((removed, added)),
            (Some(_), None) => removed.extend(old.by_ref()),
            (None, Some(_)) => added.extend(new.by_ref()),
            (Some((was, was_via)), Some((is, is_via))) => match was.cmp(is) {
                std::cmp::Ordering::Less => removed.extend(old.next()),
                std::cmp::Ordering::Greater => added.extend(new.next()),
                std::cmp::Ordering::Equal => {
                    if was_via.gateway != is_via.gateway {
                        return None;
                    }
                    old.next();
                    new.next();
                }
            },
        }
    }
}

fn apply_additions_and_removals(
    removed: &[(&IpNetwork, &Via)],
    added: &[(&IpNetwork, &Via)],
) -> Result<Changes, Error> {
    let nl = Netlink::connect().map_err(netlink_error)?;
    let mut changes = Changes::default();
    for (dst, via) in removed {
        match nl.del_route(&route_to(**dst, via), PROTOCOL) {
            Ok(()) => changes.removed.push(**dst),
            Err(e) => changes.failed.push(e.to_string()),
        }
    }
    if added.is_empty() {
        return Ok(changes);
    }
    let local: Vec<IpAddr> = nl
        .all_addresses()
        .map_err(netlink_error)?
        .iter()
        .map(|(_, address)| address.ip())
        .collect();
    for (dst, via) in added {
        let skip = |reason| Skip {
            node: via.node.clone(),
            cidr: **dst,
            reason,
        };
        // Someone else's route to the same destination with another metric
        // would let ours in beside it (NLM_F_EXCL refuses only the same
        // metric), so it is looked up first, as the full reconcile's dump
        // would show it.
        let held = match nl.main_route_to(**dst) {
            Ok(held) => held.filter(|(_, protocol)| *protocol != PROTOCOL),
            Err(e) => {
                changes.failed.push(e.to_string());
                continue;
            }
        };
        let held: Vec<(&RouteInfo, u8)> = held.iter().map(|(route, protocol)| (route, *protocol)).collect();
        if let Some(reason) = conflict(**dst, via.gateway, &local, &held) {
            changes.skipped.insert(skip(reason));
            continue;
        }
        match nl.create_route(&route_to(**dst, via), PROTOCOL) {
            Ok(true) => changes.set.push((**dst, via.gateway)),
            Ok(false) => {
                changes.skipped.insert(skip(Reason::Appeared));
            }
            Err(e) => changes.failed.push(e.to_string()),
        }
    }
    Ok(changes)
}

fn route_to(dst: IpNetwork, via: &Via) -> RouteInfo {
    RouteInfo {
        oif: None,
        ..RouteInfo::new(dst, Some(via.gateway), 0)
    }
}

/// What a reconciliation does to the main table.
#[derive(Debug, Default, PartialEq, Eq)]
struct Plan {
    /// The agent's routes not wanted, or now in the way.
    delete: Vec<RouteInfo>,
    /// Addresses (with their link) whose connected route an agent's route
    /// replaced: releases before 0.2 replaced a route to a pod CIDR whoever
    /// made it, the kernel's route to the node's own subnet included, and
    /// deleting that route would leave the node without its LAN.
    restore: Vec<(u32, IpNetwork)>,
    /// The agent's routes with a wrong gateway.
    replace: Vec<(IpNetwork, Via)>,
    /// Wanted destinations no route goes to.
    create: Vec<(IpNetwork, Via)>,
    skipped: BTreeSet<Skip>,
}

/// The plan for `wanted`, given the node's addresses (each with its link)
/// and its main table (each route with the protocol that added it).
fn plan(
    wanted: &BTreeMap<IpNetwork, Via>,
    addresses: &[(u32, IpNetwork)],
    table: &[(RouteInfo, u8)],
) -> Plan {
    let local: Vec<IpAddr> = addresses.iter().map(|(_, address)| address.ip()).collect();
    let mut ours: BTreeMap<IpNetwork, Vec<Option<IpAddr>>> = BTreeMap::new();
    let mut others: BTreeMap<IpNetwork, Vec<(&RouteInfo, u8)>> = BTreeMap::new();
    for (route, protocol) in table {
        if *protocol == PROTOCOL {
            ours.entry(route.dst).or_default().push(route.gw);
        } else {
            others.entry(route.dst).or_default().push((route, *protocol));
        }
    }
    let mut plan = Plan::default();
    let mut routed = BTreeSet::new();
    for (dst, via) in wanted {
        let held = others.get(dst).map(Vec::as_slice).unwrap_or_default();
        if let Some(reason) = conflict(*dst, via.gateway, &local, held) {
            plan.skipped.insert(Skip {
                node: via.node.clone(),
                cidr: *dst,
                reason,
            });
            continue;
        }
        routed.insert(*dst);
        match ours.get(dst) {
            None => plan.create.push((*dst, via.clone())),
            Some(gateways) if !gateways.contains(&Some(via.gateway)) => {
                plan.replace.push((*dst, via.clone()));
            }
            Some(_) => {}
        }
    }
    let unwanted = table
        .iter()
        .filter(|(route, protocol)| *protocol == PROTOCOL && !routed.contains(&route.dst))
        .map(|(route, _)| route);
    for route in unwanted {
        let connected = addresses
            .iter()
            .find(|(_, address)| netlink::route::network_of(*address) == route.dst);
        match connected {
            Some(&(oif, address)) if !others.contains_key(&route.dst) && route.priority.unwrap_or(0) == 0 => {
                plan.restore.push((oif, address));
            }
            _ => plan.delete.push(route.clone()),
        }
    }
    plan
}

/// Why the route to `dst` via `gateway` must not be in the table, if so:
/// it would take traffic the node sends on its own links, or `held`
/// (routes to `dst` someone else made) goes there. A pod CIDR merely
/// inside a wider subnet of the node's is routed: bare-metal clusters
/// carve pod CIDRs out of the node LAN and need the more specific route.
fn conflict(dst: IpNetwork, gateway: IpAddr, local: &[IpAddr], held: &[(&RouteInfo, u8)]) -> Option<Reason> {
    if let Some(address) = local.iter().find(|ip| dst.contains(**ip)) {
        return Some(Reason::HoldsAddress(*address));
    }
    if local.contains(&gateway) {
        return Some(Reason::GatewayIsOwn(gateway));
    }
    if held.iter().any(|(route, protocol)| on_link(route, *protocol)) {
        return Some(Reason::OnLink);
    }
    held.first()
        .map(|(_, protocol)| Reason::Taken { protocol: *protocol })
}

/// Whether `route` goes to a subnet on one of the node's links.
fn on_link(route: &RouteInfo, protocol: u8) -> bool {
    route.scope == SCOPE_LINK || (protocol == PROTOCOL_KERNEL && route.gw.is_none())
}

/// Removes every route the agent made (uninstall).
pub fn remove_all() -> Result<usize, Error> {
    let changes = reconcile(&BTreeMap::new())?;
    if changes.failed.is_empty() {
        Ok(changes.removed.len())
    } else {
        Err(failure(&changes.failed))
    }
}

/// The error of a reconciliation some routes of which failed.
pub fn failure(failed: &[String]) -> Error {
    Error::RoutesFailed(failed.to_vec())
}

fn netlink_error(e: netlink::Error) -> Error {
    Error::Routes(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::node::NodeInfo;

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

    fn net(text: &str) -> IpNetwork {
        text.parse().expect("cidr")
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("ip")
    }

    fn skips(skipped: &BTreeSet<Skip>) -> Vec<String> {
        skipped.iter().map(ToString::to_string).collect()
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
            node("f", &["10.244.2.0/24"], &["10.0.0.6"]),
        ]);
        let wanted = wanted("a", &nodes);
        let text: Vec<String> = wanted
            .routes
            .iter()
            .map(|(d, via)| format!("{d} via {} of {}", via.gateway, via.node))
            .collect();
        assert_eq!(
            text,
            [
                "10.244.1.0/24 via 10.0.0.2 of b",
                "10.244.2.0/24 via 10.0.0.3 of c",
                "fd00:10:244:1::/64 via fd00::2 of b",
            ],
            "none to itself, none without an address of the family, none overlapping its own range"
        );
        assert_eq!(
            skips(&wanted.skipped),
            [
                "node c: no route to pod CIDR fd00:10:244:2::/64: the Node has no InternalIP of its family",
                "node d: no route to pod CIDR 10.244.0.128/25: it overlaps this node's pod CIDR 10.244.0.0/24",
                "node f: no route to pod CIDR 10.244.2.0/24: node c has the same pod CIDR",
            ]
        );
    }

    fn via(node: &str, gateway: &str) -> Via {
        Via {
            node: node.to_owned(),
            gateway: ip(gateway),
        }
    }

    /// A route of the main table as the kernel lists it.
    fn route(dst: &str, gateway: Option<&str>, scope: u8, protocol: u8) -> (RouteInfo, u8) {
        let mut route = RouteInfo::new(net(dst), gateway.map(ip), 2);
        route.scope = scope;
        (route, protocol)
    }

    /// The node of the lab: 10.250.0.11 on a /24 of link 2, with its
    /// kernel route.
    fn lan() -> (Vec<(u32, IpNetwork)>, (RouteInfo, u8)) {
        (
            vec![(1, net("127.0.0.1/8")), (2, net("10.250.0.11/24"))],
            route("10.250.0.0/24", None, SCOPE_LINK, 2),
        )
    }

    #[test]
    fn a_pod_cidr_holding_an_address_of_the_node_gets_no_route_and_takes_nothing() {
        let (local, connected) = lan();
        let wanted = BTreeMap::from([(net("10.250.0.0/24"), via("n2", "10.250.0.12"))]);
        let plan = plan(&wanted, &local, &[connected]);
        assert_eq!(
            skips(&plan.skipped),
            ["node n2: no route to pod CIDR 10.250.0.0/24: it holds 10.250.0.11, an address of this node"]
        );
        assert_eq!((plan.delete, plan.replace, plan.create), (vec![], vec![], vec![]));
    }

    #[test]
    fn an_agents_route_that_took_the_connected_subnet_gives_it_back() {
        let (local, _) = lan();
        let taken = route("10.250.0.0/24", Some("10.250.0.12"), 0, PROTOCOL);
        let wanted = BTreeMap::from([(net("10.250.0.0/24"), via("n2", "10.250.0.12"))]);
        let taking = plan(&wanted, &local, std::slice::from_ref(&taken));
        assert!(
            taking.delete.is_empty(),
            "never deleted, which would cut the node off its LAN"
        );
        assert_eq!(taking.restore, [(2, net("10.250.0.11/24"))]);
        assert_eq!(taking.skipped.len(), 1);
        // Beside the kernel's own route, the agent's is merely deleted.
        let (_, connected) = lan();
        let beside = plan(&BTreeMap::new(), &local, &[connected, taken.clone()]);
        assert_eq!((beside.delete, beside.restore), (vec![taken.0], vec![]));
    }

    #[test]
    fn a_pod_cidr_equal_to_a_link_route_gets_no_route() {
        let (local, connected) = lan();
        // A subnet reached on a link without an address of the node's.
        let on_link = route("10.251.0.0/24", None, SCOPE_LINK, 4);
        let wanted = BTreeMap::from([(net("10.251.0.0/24"), via("n2", "10.250.0.12"))]);
        let plan = plan(&wanted, &local, &[connected, on_link]);
        assert_eq!(
            skips(&plan.skipped),
            ["node n2: no route to pod CIDR 10.251.0.0/24: it is a subnet on a link of this node"]
        );
        assert!(plan.create.is_empty());
    }

    #[test]
    fn a_pod_cidr_equal_to_an_ipv6_connected_subnet_gets_no_route() {
        let local = vec![(2, net("fd00:250::11/64"))];
        let connected = route("fd00:250:1::/64", None, 0, PROTOCOL_KERNEL);
        let wanted = BTreeMap::from([(net("fd00:250:1::/64"), via("n2", "fd00:250::12"))]);
        let plan = plan(&wanted, &local, &[connected]);
        assert_eq!(
            skips(&plan.skipped),
            ["node n2: no route to pod CIDR fd00:250:1::/64: it is a subnet on a link of this node"]
        );
    }

    #[test]
    fn a_node_whose_internal_ip_is_this_nodes_gets_no_route_and_loses_the_agents() {
        let (local, connected) = lan();
        let stale = route("10.244.3.0/24", Some("10.250.0.13"), 0, PROTOCOL);
        let wanted = BTreeMap::from([(net("10.244.3.0/24"), via("n3", "10.250.0.11"))]);
        let plan = plan(&wanted, &local, &[connected, stale.clone()]);
        assert_eq!(
            skips(&plan.skipped),
            [
                "node n3: no route to pod CIDR 10.244.3.0/24: the Node's InternalIP 10.250.0.11 is an address of this node"
            ]
        );
        assert_eq!(plan.delete, [stale.0]);
        assert!(plan.replace.is_empty() && plan.create.is_empty());
    }

    #[test]
    fn someone_elses_route_to_a_pod_cidr_is_left_as_it_is() {
        let (local, connected) = lan();
        let operators = route("10.244.4.0/24", Some("10.250.0.99"), 0, 3);
        let wanted = BTreeMap::from([(net("10.244.4.0/24"), via("n4", "10.250.0.14"))]);
        let plan = plan(&wanted, &local, &[connected, operators]);
        assert_eq!(
            skips(&plan.skipped),
            ["node n4: no route to pod CIDR 10.244.4.0/24: a route someone else made goes there (proto 3)"]
        );
        assert_eq!((plan.delete, plan.replace, plan.create), (vec![], vec![], vec![]));
    }

    #[test]
    fn a_pod_cidr_carved_out_of_a_wider_node_subnet_is_routed() {
        let local = vec![(2, net("10.250.0.11/16"))];
        let wide = route("10.250.0.0/16", None, SCOPE_LINK, 2);
        let wanted = BTreeMap::from([(net("10.250.5.0/24"), via("n5", "10.250.0.15"))]);
        let plan = plan(&wanted, &local, &[wide]);
        assert_eq!(plan.create, [(net("10.250.5.0/24"), via("n5", "10.250.0.15"))]);
        assert!(plan.skipped.is_empty());
    }

    #[test]
    fn a_skip_is_told_once_while_it_lasts_and_again_when_it_comes_back() {
        let skip = |node: &str, reason| Skip {
            node: node.to_owned(),
            cidr: net("10.250.0.0/24"),
            reason,
        };
        let holds = skip("n2", Reason::HoldsAddress(ip("10.250.0.11")));
        let no_address = skip("n3", Reason::NoAddressOfFamily);
        let mut skips = Skips {
            found: BTreeSet::from([holds.clone()]),
            ..Skips::default()
        };
        let wanted = || BTreeSet::from([no_address.clone()]);
        assert_eq!(skips.news(wanted()), [holds.clone(), no_address.clone()]);
        assert_eq!(skips.news(wanted()), []);
        assert_eq!(skips.news(wanted()), [], "a sync without a reconciliation");
        skips.found.clear();
        assert_eq!(skips.news(wanted()), []);
        skips.found = BTreeSet::from([holds.clone()]);
        assert_eq!(skips.news(BTreeSet::new()), [holds]);
    }

    #[test]
    fn differences_are_additions_and_removals_or_none_when_a_gateway_moved() {
        let map = |entries: &[(&str, &str)]| -> BTreeMap<IpNetwork, Via> {
            entries.iter().map(|(dst, gw)| (net(dst), via("n", gw))).collect()
        };
        let before = map(&[("10.0.1.0/24", "192.168.0.1"), ("10.0.2.0/24", "192.168.0.2")]);
        let after = map(&[("10.0.2.0/24", "192.168.0.2"), ("10.0.3.0/24", "192.168.0.3")]);
        let (removed, added) = differences(&before, &after).expect("no gateway moved");
        assert_eq!(
            removed.iter().map(|(d, _)| d.to_string()).collect::<Vec<_>>(),
            ["10.0.1.0/24"]
        );
        assert_eq!(
            added.iter().map(|(d, _)| d.to_string()).collect::<Vec<_>>(),
            ["10.0.3.0/24"]
        );
        let (removed, added) = differences(&before, &before).expect("nothing moved");
        assert!(removed.is_empty() && added.is_empty());
        let empty = BTreeMap::new();
        let (removed, added) = differences(&empty, &after).expect("all new");
        assert!(removed.is_empty() && added.len() == 2);
        let moved = map(&[("10.0.1.0/24", "192.168.0.9"), ("10.0.2.0/24", "192.168.0.2")]);
        assert!(differences(&before, &moved).is_none());
    }

    #[test]
    fn only_the_agents_routes_are_replaced_or_deleted() {
        let (local, connected) = lan();
        let right = route("10.244.2.0/24", Some("10.250.0.12"), 0, PROTOCOL);
        let wrong = route("10.244.3.0/24", Some("10.250.0.99"), 0, PROTOCOL);
        let unwanted = route("10.244.9.0/24", Some("10.250.0.19"), 0, PROTOCOL);
        let operators = route("10.99.0.0/24", Some("10.250.0.99"), 0, 3);
        let table = [connected, right, wrong, unwanted.clone(), operators];
        let wanted = BTreeMap::from([
            (net("10.244.2.0/24"), via("n2", "10.250.0.12")),
            (net("10.244.3.0/24"), via("n3", "10.250.0.13")),
            (net("10.244.5.0/24"), via("n5", "10.250.0.15")),
        ]);
        let plan = plan(&wanted, &local, &table);
        assert_eq!(
            plan,
            Plan {
                delete: vec![unwanted.0],
                restore: vec![],
                replace: vec![(net("10.244.3.0/24"), via("n3", "10.250.0.13"))],
                create: vec![(net("10.244.5.0/24"), via("n5", "10.250.0.15"))],
                skipped: BTreeSet::new(),
            }
        );
    }
}
