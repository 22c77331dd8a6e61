//! The pod side: the container end of the veth, its addresses, sysctls and
//! routes, set through a netlink socket opened inside the pod's namespace
//! (sysctls are written from inside it).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use cni::result::Route;
use cni::{Error, Result};
use ipnetwork::IpNetwork;
use netlink::{Link, Netlink, RouteInfo, sysctl};
use netns::NetNs;
use podnet::{netlink_error, state_error};

/// IPv6 DAD (only when `enabledad`) gets this long before ADD gives up.
const DAD_PATIENCE: Duration = Duration::from_secs(5);

/// One gateway per family, used for routes that name none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gateways {
    pub v4: Option<IpAddr>,
    pub v6: Option<IpAddr>,
}

impl Gateways {
    pub fn for_family(&self, v4: bool) -> Option<IpAddr> {
        if v4 { self.v4 } else { self.v6 }
    }
}

fn pod_sysctl(ns: &NetNs, key: &str, value: &str) -> Result<()> {
    sysctl::write_in(ns, key, value).map_err(|e| Error::io(format!("failed to set {key}: {e}")))
}

/// Addresses, sysctls, link up, DAD when enabled, then routes.
pub fn configure(
    ns: &NetNs,
    nl: &Netlink,
    link: &Link,
    addresses: &[IpNetwork],
    routes: &[Route],
    gateways: Gateways,
    enable_dad: bool,
) -> Result<()> {
    let name = &link.name;
    let has_v6 = addresses.iter().any(IpNetwork::is_ipv6);
    if addresses.iter().any(IpNetwork::is_ipv4) {
        pod_sysctl(ns, &format!("net/ipv4/conf/{name}/arp_notify"), "1")?;
    }
    if has_v6 {
        pod_sysctl(ns, &format!("net/ipv6/conf/{name}/disable_ipv6"), "0")?;
        // Without DAD, addresses are usable at once: no waiting in ADD.
        pod_sysctl(
            ns,
            &format!("net/ipv6/conf/{name}/accept_dad"),
            if enable_dad { "1" } else { "0" },
        )?;
        if enable_dad {
            let _ = sysctl::write_in(ns, &format!("net/ipv6/conf/{name}/enhanced_dad"), "1");
        }
        let _ = sysctl::write_in(ns, &format!("net/ipv6/conf/{name}/keep_addr_on_down"), "1");
    }
    for address in addresses {
        nl.add_address(link, *address)
            .map_err(|e| netlink_error(e).context(format!("failed to add IP addr {address} to {name:?}")))?;
    }
    nl.set_up(link).map_err(netlink_error)?;
    if has_v6 && enable_dad {
        wait_for_dad(nl, link)?;
    }
    for route in routes {
        let gw = route.gw.or_else(|| gateways.for_family(route.dst.is_ipv4()));
        let mut info = RouteInfo::new(route.dst, gw, link.index);
        info.priority = (route.priority != 0).then_some(route.priority);
        if let Some(table) = route.table {
            info.table = table;
        }
        info.scope = route.scope.unwrap_or(0);
        nl.add_route(&info)
            .map_err(|e| netlink_error(e).context(format!("failed to add route {}", route.dst)))?;
    }
    Ok(())
}

fn wait_for_dad(nl: &Netlink, link: &Link) -> Result<()> {
    let started = Instant::now();
    loop {
        let states = nl.address_states(link).map_err(netlink_error)?;
        if let Some(failed) = states.iter().find(|s| s.dad_failed) {
            return Err(state_error(format!(
                "{} failed duplicate address detection",
                failed.address
            )));
        }
        if !states.iter().any(|s| s.tentative) {
            return Ok(());
        }
        if started.elapsed() > DAD_PATIENCE {
            return Err(state_error(
                "timed out waiting for IPv6 duplicate address detection",
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
