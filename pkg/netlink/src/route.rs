//! Routes: listing and adding, with the fields CNI results carry.

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnetwork::IpNetwork;
use rtnetlink::RouteMessageBuilder;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteProtocol, RouteScope, RouteType,
};

use crate::{Link, Netlink, Result, netlink_err};

/// The main routing table's ID.
pub const MAIN_TABLE: u32 = 254;

/// A route as the plugins add and check it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteInfo {
    /// Always a network address (host bits cleared).
    pub dst: IpNetwork,
    pub gw: Option<IpAddr>,
    pub oif: Option<u32>,
    pub table: u32,
    pub priority: Option<u32>,
    pub scope: u8,
}

impl RouteInfo {
    pub fn new(dst: IpNetwork, gw: Option<IpAddr>, oif: u32) -> Self {
        RouteInfo {
            dst: network_of(dst),
            gw,
            oif: Some(oif),
            table: MAIN_TABLE,
            priority: None,
            scope: 0,
        }
    }
}

/// `10.0.0.5/24` → `10.0.0.0/24`: the kernel takes routes to networks.
pub fn network_of(net: IpNetwork) -> IpNetwork {
    IpNetwork::new(net.network(), net.prefix()).unwrap_or(net)
}

fn address(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

fn route_from(message: &RouteMessage) -> Option<RouteInfo> {
    if message.header.kind != RouteType::Unicast {
        return None;
    }
    let v4 = message.header.address_family == rtnetlink::packet_route::AddressFamily::Inet;
    let mut dst = None;
    let mut info = RouteInfo {
        dst: IpNetwork::new(
            if v4 {
                IpAddr::from([0u8; 4])
            } else {
                IpAddr::from([0u8; 16])
            },
            0,
        )
        .ok()?,
        gw: None,
        oif: None,
        table: u32::from(message.header.table),
        priority: None,
        scope: u8::from(message.header.scope),
    };
    for attribute in &message.attributes {
        match attribute {
            RouteAttribute::Destination(a) => dst = address(a),
            RouteAttribute::Gateway(a) => info.gw = address(a),
            RouteAttribute::Oif(index) => info.oif = Some(*index),
            RouteAttribute::Table(table) => info.table = *table,
            RouteAttribute::Priority(p) => info.priority = Some(*p),
            _ => {}
        }
    }
    if let Some(dst) = dst {
        info.dst = IpNetwork::new(dst, message.header.destination_prefix_length).ok()?;
    }
    Some(info)
}

impl Netlink {
    /// Every unicast route of a family, in every table.
    pub fn routes(&self, v4: bool) -> Result<Vec<RouteInfo>> {
        let query = if v4 {
            RouteMessageBuilder::<std::net::Ipv4Addr>::new()
                .table_id(0)
                .build()
        } else {
            RouteMessageBuilder::<std::net::Ipv6Addr>::new()
                .table_id(0)
                .build()
        };
        let messages: Vec<RouteMessage> = self
            .runtime
            .block_on(self.handle.route().get(query).execute().try_collect())
            .map_err(netlink_err("list routes"))?;
        Ok(messages.iter().filter_map(route_from).collect())
    }

    /// The interface the main table sends `ip` out of (its most specific
    /// route with an interface), if any.
    pub fn interface_toward(&self, ip: IpAddr) -> Result<Option<Link>> {
        let best = self
            .routes(ip.is_ipv4())?
            .into_iter()
            .filter(|r| r.table == MAIN_TABLE && r.oif.is_some() && r.dst.contains(ip))
            .max_by_key(|r| r.dst.prefix());
        match best.and_then(|r| r.oif) {
            Some(index) => self.link_by_index(index),
            None => Ok(None),
        }
    }

    /// The main table's route to exactly `dst`, with the protocol that made
    /// it, as the kernel's lookup of `dst`'s network address finds it (`ip
    /// route get fibmatch`): one lock-free request where a dump grows with
    /// the table. It sees a route to `dst` whatever its metric, which
    /// `NLM_F_EXCL` does not (it refuses only the same metric). A more
    /// specific route inside `dst` hides a wider one to `dst` itself.
    pub fn main_route_to(&self, dst: IpNetwork) -> Result<Option<(RouteInfo, u8)>> {
        let dst = network_of(dst);
        let what = format!("look up the route to {dst}");
        let host_prefix = if dst.is_ipv4() { 32 } else { 128 };
        let mut message = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(dst.network(), host_prefix)
            .map_err(|e| crate::Error::InvalidRoute(format!("{what}: {e}")))?
            .build();
        // LookupTable: the reply names the table the route is in, not the
        // one the request named.
        message.header.flags |= RouteFlags::FibMatch | RouteFlags::LookupTable;
        let mut replies = std::pin::pin!(self.handle.route().get(message).execute());
        match self.runtime.block_on(replies.try_next()) {
            Ok(reply) => Ok(reply.and_then(|reply| {
                let route = route_from(&reply).filter(|r| r.dst == dst && r.table == MAIN_TABLE)?;
                Some((route, u8::from(reply.header.protocol)))
            })),
            Err(e) => match netlink_err(what)(e) {
                // No route toward it, or only one that is not unicast (a
                // blackhole, prohibit, throw or unreachable route answers
                // with its type's error), which the table's dump leaves out
                // as well.
                err if matches!(
                    err.errno(),
                    Some(
                        crate::ENETUNREACH
                            | crate::EHOSTUNREACH
                            | crate::EINVAL
                            | crate::EACCES
                            | crate::EAGAIN
                    )
                ) =>
                {
                    Ok(None)
                }
                err => Err(err),
            },
        }
    }

    /// Routes whose output interface is `link`.
    pub fn routes_of(&self, link: &Link, v4: bool) -> Result<Vec<RouteInfo>> {
        Ok(self
            .routes(v4)?
            .into_iter()
            .filter(|r| r.oif == Some(link.index))
            .collect())
    }

    /// Adds a route; the same route already present is not an error.
    pub fn add_route(&self, route: &RouteInfo) -> Result<()> {
        let (what, message) = route_message(route, None)?;
        let request = self.handle.route().add(message).execute();
        match self
            .runtime
            .block_on(request)
            .map_err(netlink_err(format!("add {what}")))
        {
            Err(e) if e.errno() == Some(crate::EEXIST) => Ok(()),
            other => other,
        }
    }

    /// Adds `route` marked as added by `protocol`, replacing the route to
    /// the same destination (same table and priority), whoever added it.
    pub fn replace_route(&self, route: &RouteInfo, protocol: u8) -> Result<()> {
        let (what, message) = route_message(route, Some(protocol))?;
        let request = self.handle.route().add(message).replace().execute();
        self.runtime
            .block_on(request)
            .map_err(netlink_err(format!("replace {what}")))
    }

    /// Deletes `route` if `protocol` added it (the kernel matches the
    /// protocol of a delete request); one already gone is not an error.
    pub fn del_route(&self, route: &RouteInfo, protocol: u8) -> Result<()> {
        let (what, message) = route_message(route, Some(protocol))?;
        let request = self.handle.route().del(message).execute();
        match self
            .runtime
            .block_on(request)
            .map_err(netlink_err(format!("delete {what}")))
        {
            Err(e) if matches!(e.errno(), Some(crate::ESRCH | crate::ENOENT)) => Ok(()),
            other => other,
        }
    }

    /// Every unicast route of a family in the main table, each with the
    /// `rtm_protocol` of whoever added it (`kernel` = 2 for a connected
    /// subnet, `boot` = 3 for `ip route add`).
    pub fn main_table_routes(&self, v4: bool) -> Result<Vec<(RouteInfo, u8)>> {
        let query = if v4 {
            RouteMessageBuilder::<std::net::Ipv4Addr>::new().build()
        } else {
            RouteMessageBuilder::<std::net::Ipv6Addr>::new().build()
        };
        let messages: Vec<RouteMessage> = self
            .runtime
            .block_on(self.handle.route().get(query).execute().try_collect())
            .map_err(netlink_err("list routes"))?;
        Ok(messages
            .iter()
            .filter_map(|m| Some((route_from(m)?, u8::from(m.header.protocol))))
            .filter(|(r, _)| r.table == MAIN_TABLE)
            .collect())
    }

    /// Adds `route` marked as added by `protocol` unless a route to the
    /// same destination (same table and priority) is there, whoever added
    /// it: that one is never replaced. Returns whether it added the route.
    pub fn create_route(&self, route: &RouteInfo, protocol: u8) -> Result<bool> {
        let (what, message) = route_message(route, Some(protocol))?;
        // rtnetlink's add asks NLM_F_CREATE | NLM_F_EXCL.
        let request = self.handle.route().add(message).execute();
        match self
            .runtime
            .block_on(request)
            .map_err(netlink_err(format!("add {what}")))
        {
            Ok(()) => Ok(true),
            Err(e) if e.errno() == Some(crate::EEXIST) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

impl Netlink {
    /// Puts back the route the kernel makes for the subnet of `address`
    /// on link `oif` (`proto kernel scope link src <address>`), replacing
    /// the route to that subnet of the same priority, whoever made it.
    pub fn restore_connected_route(&self, address: IpNetwork, oif: u32) -> Result<()> {
        let subnet = network_of(address);
        let what = format!("the connected route to {subnet}");
        let message = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(subnet.network(), subnet.prefix())
            .and_then(|builder| builder.pref_source(address.ip()))
            .map_err(|e| crate::Error::InvalidRoute(format!("{what}: {e}")))?
            .output_interface(oif)
            .scope(RouteScope::Link)
            .protocol(RouteProtocol::Kernel)
            .table_id(MAIN_TABLE)
            .build();
        let request = self.handle.route().add(message).replace().execute();
        self.runtime
            .block_on(request)
            .map_err(netlink_err(format!("restore {what}")))
    }
}

/// The kernel's message for `route` (marked as `protocol`'s when given),
/// and how errors name it.
fn route_message(route: &RouteInfo, protocol: Option<u8>) -> Result<(String, RouteMessage)> {
    let what = format!("route {} via {:?}", route.dst, route.gw);
    let mut builder = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(route.dst.network(), route.dst.prefix())
        .map_err(|e| crate::Error::InvalidRoute(format!("{what}: {e}")))?;
    if let Some(gw) = route.gw {
        builder = builder
            .gateway(gw)
            .map_err(|e| crate::Error::InvalidRoute(format!("{what}: {e}")))?;
    }
    if let Some(oif) = route.oif {
        builder = builder.output_interface(oif);
    }
    if let Some(priority) = route.priority {
        builder = builder.priority(priority);
    }
    if route.scope != 0 {
        builder = builder.scope(RouteScope::from(route.scope));
    }
    if let Some(protocol) = protocol {
        builder = builder.protocol(RouteProtocol::from(protocol));
    }
    Ok((what, builder.table_id(route.table).build()))
}

/// A policy-routing rule `fwmark <mark>[/<mask>] [pref <priority>] lookup
/// <table>`; without a mask the kernel matches the whole mark, without a
/// priority it picks one below the last rule's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FwmarkRule {
    pub mark: u32,
    pub mask: Option<u32>,
    pub table: u32,
    pub priority: Option<u32>,
}

impl FwmarkRule {
    pub const fn new(mark: u32, table: u32) -> Self {
        FwmarkRule {
            mark,
            mask: None,
            table,
            priority: None,
        }
    }
}

impl std::fmt::Display for FwmarkRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fwmark {:#x}", self.mark)?;
        if let Some(mask) = self.mask {
            write!(f, "/{mask:#x}")?;
        }
        if let Some(priority) = self.priority {
            write!(f, " pref {priority}")?;
        }
        write!(f, " lookup {}", self.table)
    }
}

impl Netlink {
    /// `rule`, as added and as deleted.
    fn fwmark_rule(&self, rule: &FwmarkRule) -> rtnetlink::RuleAddRequest {
        use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute};
        let mut request = self
            .handle
            .rule()
            .add()
            .fw_mark(rule.mark)
            .table_id(rule.table)
            .action(RuleAction::ToTable);
        if let Some(priority) = rule.priority {
            request = request.priority(priority);
        }
        if let Some(mask) = rule.mask {
            request.message_mut().attributes.push(RuleAttribute::FwMask(mask));
        }
        request
    }

    /// `ip [-6] rule add <rule>`; an identical rule already there is not
    /// an error.
    pub fn add_fwmark_rule(&self, v4: bool, rule: &FwmarkRule) -> Result<()> {
        let request = self.fwmark_rule(rule);
        let op = format!("add rule {rule}");
        let outcome = if v4 {
            self.runtime.block_on(request.v4().execute())
        } else {
            self.runtime.block_on(request.v6().execute())
        };
        match outcome.map_err(netlink_err(op)) {
            Err(e) if e.errno() == Some(crate::EEXIST) => Ok(()),
            other => other,
        }
    }

    /// `ip [-4|-6] rule del <rule>`; none there, or a family without
    /// policy routing, is not an error. Returns whether there was one.
    pub fn del_fwmark_rule(&self, v4: bool, rule: &FwmarkRule) -> Result<bool> {
        let request = self.fwmark_rule(rule);
        let message = if v4 {
            request.v4().message_mut().clone()
        } else {
            request.v6().message_mut().clone()
        };
        let op = format!("delete rule {rule}");
        match self
            .runtime
            .block_on(self.handle.rule().del(message).execute())
            .map_err(netlink_err(op))
        {
            Ok(()) => Ok(true),
            Err(e)
                if matches!(
                    e.errno(),
                    Some(crate::ENOENT | crate::EAFNOSUPPORT | crate::EOPNOTSUPP)
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    fn local_default_route(v4: bool, link: &Link, table: u32) -> Result<(String, RouteMessage)> {
        let any: IpAddr = if v4 {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        };
        let what = format!("local route {any}/0 table {table}");
        let message = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(any, 0)
            .map_err(|e| crate::Error::InvalidRoute(format!("{what}: {e}")))?
            .output_interface(link.index)
            .table_id(table)
            .scope(RouteScope::Host)
            .kind(RouteType::Local)
            .build();
        Ok((what, message))
    }

    /// `ip [-6] route add local <any>/0 dev <link> table <table>`.
    pub fn add_local_default_route(&self, v4: bool, link: &Link, table: u32) -> Result<()> {
        let (what, message) = Self::local_default_route(v4, link, table)?;
        match self
            .runtime
            .block_on(self.handle.route().add(message).execute())
            .map_err(netlink_err(format!("add {what}")))
        {
            Err(e) if e.errno() == Some(crate::EEXIST) => Ok(()),
            other => other,
        }
    }

    /// `ip [-6] route del local <any>/0 dev <link> table <table>`; none
    /// there, or a family the kernel does not route, is not an error.
    pub fn del_local_default_route(&self, v4: bool, link: &Link, table: u32) -> Result<()> {
        let (what, message) = Self::local_default_route(v4, link, table)?;
        match self
            .runtime
            .block_on(self.handle.route().del(message).execute())
            .map_err(netlink_err(format!("delete {what}")))
        {
            Err(e)
                if matches!(
                    e.errno(),
                    Some(crate::ESRCH | crate::ENOENT | crate::EAFNOSUPPORT | crate::EOPNOTSUPP)
                ) =>
            {
                Ok(())
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_destinations_are_networks() {
        let r = RouteInfo::new("10.0.0.5/24".parse().expect("cidr"), None, 3);
        assert_eq!(r.dst.to_string(), "10.0.0.0/24");
        assert_eq!(r.table, MAIN_TABLE);
    }
}
