//! The host side: the bridge, the host end of the veth, the gateway
//! addresses and forwarding. Runs in the namespace the plugin was started in
//! (the node's).

use std::hash::{BuildHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use cni::{Error, Result};
use ipnetwork::IpNetwork;
use netlink::{Link, Netlink, sysctl};
use netns::NetNs;
use podnet::{netlink_error, state_error};

use crate::config::BridgeConfig;

/// Host veth names are `veth` + 8 hex digits; a clash is retried this often.
const NAME_ATTEMPTS: usize = 10;
/// How long to wait for the host port to come up once both ends are up.
const PORT_UP_PATIENCE: Duration = Duration::from_secs(2);

/// The bridge, created if missing (a concurrent creator winning the race is
/// fine), checked to be a bridge, with `accept_ra=0`, promisc as configured,
/// and up.
pub fn ensure_bridge(nl: &Netlink, cfg: &BridgeConfig) -> Result<Link> {
    let name = &cfg.bridge;
    let existing = nl.link_by_name(name).map_err(netlink_error)?;
    let bridge = match existing {
        Some(link) => link,
        None => {
            match nl.create_bridge(name, cfg.mtu, cfg.uses_vlans()) {
                Ok(()) => {}
                Err(e) if e.errno() == Some(netlink::EEXIST) => {}
                Err(e) => return Err(netlink_error(e).context(format!("could not add {name:?}"))),
            }
            nl.require_link(name).map_err(netlink_error)?
        }
    };
    if bridge.kind != "bridge" {
        return Err(state_error(format!(
            "{name:?} already exists but is not a bridge"
        )));
    }
    if cfg.promisc && !bridge.promisc {
        nl.set_promisc(&bridge, true).map_err(netlink_error)?;
    }
    // Router advertisements must not give the node addresses on the pods'
    // bridge; and the gateway address is ours by configuration, so it must
    // answer at once instead of after DAD. (Without IPv6 the keys are
    // missing: nothing to do.)
    let _ = sysctl::write(&format!("net/ipv6/conf/{name}/accept_ra"), "0");
    let _ = sysctl::write(&format!("net/ipv6/conf/{name}/accept_dad"), "0");
    if !bridge.up {
        nl.set_up(&bridge).map_err(netlink_error)?;
    }
    Ok(bridge)
}

fn random_veth_name() -> String {
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("veth{:08x}", random as u32)
}

/// Creates the veth pair: `ifname` directly in the `peer` namespace, the
/// host end under a fresh random name, already a port of `bridge`. Returns
/// the host end.
pub fn create_veth(
    nl: &Netlink,
    peer: &NetNs,
    ifname: &str,
    bridge: &Link,
    cfg: &BridgeConfig,
) -> Result<Link> {
    for _ in 0..NAME_ATTEMPTS {
        let host_name = random_veth_name();
        match nl.create_veth(&host_name, Some(bridge), ifname, peer, cfg.mtu, cfg.mac) {
            Ok(()) => return nl.require_link(&host_name).map_err(netlink_error),
            // The peer's name was checked to be free, so EEXIST is the host name.
            Err(e) if e.errno() == Some(netlink::EEXIST) => continue,
            Err(e) => return Err(netlink_error(e).context("failed to create veth")),
        }
    }
    Err(state_error(format!(
        "failed to find a free veth name after {NAME_ATTEMPTS} attempts"
    )))
}

/// The host end, made a port by [`create_veth`]: `accept_ra=0`, VLANs,
/// port flags, up. Each request waits its turn for the kernel's RTNL lock,
/// which a node making many pods at once queues for (0.5–0.9 s per request
/// measured in a 100-pod burst), so the flags go with `up`.
pub fn attach_port(nl: &Netlink, port: &Link, cfg: &BridgeConfig) -> Result<()> {
    let _ = sysctl::write(&format!("net/ipv6/conf/{}/accept_ra", port.name), "0");
    let plan = cfg.vlan_plan();
    if plan.remove_default {
        nl.del_port_vlan(port, 1, true).map_err(netlink_error)?;
    }
    for (vid, pvid) in plan.add {
        nl.add_port_vlan(port, vid, pvid).map_err(netlink_error)?;
    }
    if cfg.hairpin || cfg.port_isolation {
        nl.set_port_flags_and_up(port, cfg.hairpin, cfg.port_isolation)
    } else {
        nl.set_up(port)
    }
    .map_err(netlink_error)
}

/// Waits, briefly and without fixed sleeps, for the host port to be up
/// (both ends up).
pub fn wait_port_up(nl: &Netlink, port: &Link) -> Result<Link> {
    let started = Instant::now();
    loop {
        let current = nl.require_link(&port.name).map_err(netlink_error)?;
        if current.oper_state == "UP" {
            return Ok(current);
        }
        if started.elapsed() > PORT_UP_PATIENCE {
            return Err(state_error(format!(
                "bridge port in error state: {}",
                current.oper_state.to_lowercase()
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Puts a gateway address on the bridge (the reference's `ensureAddr`):
/// another IPv4 address, or an overlapping IPv6 one, is an error unless
/// `forceAddress` replaces it.
pub fn ensure_gateway_address(nl: &Netlink, bridge: &Link, gateway: IpNetwork, force: bool) -> Result<()> {
    let same_family = nl
        .addresses_of_family(bridge, gateway.is_ipv4())
        .map_err(netlink_error)?;
    let mut already = false;
    for address in &same_family {
        if *address == gateway {
            already = true;
            continue;
        }
        let conflicts = gateway.is_ipv4() || address.contains(gateway.ip()) || gateway.contains(address.ip());
        if conflicts {
            if force {
                nl.del_address(bridge, *address).map_err(netlink_error)?;
            } else {
                return Err(state_error(format!(
                    "{:?} already has an IP address different from {gateway}",
                    bridge.name
                )));
            }
        }
    }
    if !already {
        nl.add_address(bridge, gateway).map_err(|e| {
            netlink_error(e).context(format!("could not add IP address to {:?}", bridge.name))
        })?;
    }
    Ok(())
}

/// Pins the bridge's MAC to the one it has before this ADD attaches a
/// port: a bridge whose address was never set takes its lowest port's, so
/// the node's gateway MAC would become a pod's veth MAC, change as pods
/// come and go, and a bridge made by someone else would change under its
/// neighbours' ARP caches. (The reference pins, for gateways, the address
/// it read before attaching; every bridge is pinned here.) A bridge whose
/// ports all went away before it was pinned has none (all zeros), which
/// the kernel refuses (the reference's "could not set bridge's mac",
/// plugins#620): it gets a locally administered one derived from the
/// node and the bridge's name, so ADDs racing on it all choose the same.
/// Returns the bridge with the address it keeps, which the result shows.
pub fn pin_mac(nl: &Netlink, bridge: Link) -> Result<Link> {
    if already_pinned(&bridge) {
        return Ok(bridge);
    }
    let mac = netlink::ops::parse_mac(&bridge.mac)
        .filter(|m| m.iter().any(|b| *b != 0))
        .unwrap_or_else(|| node_local_mac(&bridge.name));
    nl.set_mac(&bridge, mac)
        .map_err(|e| netlink_error(e).context("could not set bridge's mac"))?;
    Ok(Link {
        mac: netlink::format_mac(&mac),
        ..bridge
    })
}

/// Whether the kernel already keeps `bridge`'s address as set
/// (`addr_assign_type` 3, `NET_ADDR_SET`): setting it again would change
/// nothing but still queue for the RTNL lock on every ADD. Netlink does not
/// report it; sysfs does, for the namespace it was mounted in, so it is
/// believed only where it shows this very link (same index and address).
fn already_pinned(bridge: &Link) -> bool {
    let read = |attribute: &str| {
        std::fs::read_to_string(format!("/sys/class/net/{}/{attribute}", bridge.name))
            .map(|value| value.trim().to_owned())
            .ok()
    };
    read("ifindex") == Some(bridge.index.to_string())
        && read("address").as_ref() == Some(&bridge.mac)
        && read("addr_assign_type").as_deref() == Some("3")
}

/// A unicast, locally administered MAC for `name` on this node.
fn node_local_mac(name: &str) -> [u8; 6] {
    let mut hasher = std::hash::DefaultHasher::new();
    std::fs::read_to_string("/etc/machine-id")
        .unwrap_or_default()
        .hash(&mut hasher);
    name.hash(&mut hasher);
    let bytes = hasher.finish().to_le_bytes();
    [
        (bytes[0] & 0xfc) | 0x02,
        bytes[1],
        bytes[2],
        bytes[3],
        bytes[4],
        bytes[5],
    ]
}

/// The name of the host interface that holds the gateway of an access
/// VLAN: `<bridge>.<vlan>`.
pub fn vlan_gateway_name(bridge: &str, vlan: u16) -> String {
    format!("{bridge}.{vlan}")
}

/// With an access VLAN the gateway cannot sit on the bridge itself: as the
/// reference does, it goes on `<bridge>.<vlan>`, one end of a veth pair in
/// the node's namespace whose other end is a bridge port in that VLAN.
/// Shared by every pod of the VLAN, created once, never undone.
pub fn ensure_vlan_gateway(nl: &Netlink, bridge: &Link, cfg: &BridgeConfig) -> Result<Link> {
    let name = vlan_gateway_name(&bridge.name, cfg.vlan);
    if let Some(existing) = nl.link_by_name(&name).map_err(netlink_error)? {
        return Ok(existing);
    }
    let node = NetNs::current().map_err(|e| Error::io(e.to_string()))?;
    let port = create_veth(
        nl,
        &node,
        &name,
        bridge,
        &BridgeConfig {
            mac: None,
            ..cfg.clone()
        },
    )
    .map_err(|e| e.context(format!("failed to create vlan gateway {name:?}")))?;
    attach_port(nl, &port, cfg)?;
    let gateway = nl.require_link(&name).map_err(netlink_error)?;
    nl.set_up(&gateway).map_err(netlink_error)?;
    nl.require_link(&name).map_err(netlink_error)
}

/// Forwarding for a family, in the node's namespace.
pub fn enable_forwarding(v4: bool) -> Result<()> {
    let key = if v4 {
        "net/ipv4/ip_forward"
    } else {
        "net/ipv6/conf/all/forwarding"
    };
    sysctl::write(key, "1").map_err(|e| Error::io(format!("could not enable forwarding: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vlan_gateway_interfaces_are_named_like_the_reference() {
        assert_eq!(vlan_gateway_name("cni0", 100), "cni0.100");
    }
}
