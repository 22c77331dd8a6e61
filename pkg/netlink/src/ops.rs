//! Link and address changes: bridges, veth pairs, bridge ports, VLANs.

use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd};

use futures::TryStreamExt;
use ipnetwork::IpNetwork;
use netns::NetNs;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage};
use rtnetlink::packet_route::link::{
    BridgeVlanInfoFlags, InfoData, InfoKind, InfoVeth, LinkAttribute, LinkMessage,
};
use rtnetlink::{LinkBridge, LinkBridgePort, LinkBridgeVlan, LinkMessageBuilder, LinkUnspec};

use crate::{Link, Netlink, Result, link_from, netlink_err};

/// An address with the state DAD cares about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressState {
    pub address: IpNetwork,
    pub tentative: bool,
    pub dad_failed: bool,
}

/// Parses `aa:bb:cc:dd:ee:ff` (any case).
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .ok()?;
    <[u8; 6]>::try_from(bytes).ok()
}

/// The VLAN entries of a bridge port, as `bridge vlan add dev <port> vid
/// <vid> [pvid untagged] master` sends them.
pub fn vlan_add_request(port: u32, vid: u16, pvid_untagged: bool) -> LinkMessage {
    let flags = if pvid_untagged {
        BridgeVlanInfoFlags::Pvid | BridgeVlanInfoFlags::Untagged
    } else {
        BridgeVlanInfoFlags::empty()
    };
    LinkBridgeVlan::new(port).vlan(vid, flags).build()
}

/// The request that removes `vid` (with the given flags) from a port.
pub fn vlan_del_request(port: u32, vid: u16, pvid_untagged: bool) -> LinkMessage {
    vlan_add_request(port, vid, pvid_untagged)
}

/// RTM_DELLINK naming the link instead of indexing it.
fn delete_by_name_request(name: &str) -> LinkMessage {
    let mut message = LinkMessage::default();
    message.attributes.push(LinkAttribute::IfName(name.to_owned()));
    message
}

impl Netlink {
    fn run<T>(
        &self,
        op: String,
        request: impl std::future::Future<Output = Result<T, rtnetlink::Error>>,
    ) -> Result<T> {
        self.runtime.block_on(request).map_err(netlink_err(op))
    }

    pub fn link_by_index(&self, index: u32) -> Result<Option<Link>> {
        let mut request = std::pin::pin!(self.handle.link().get().match_index(index).execute());
        match self.runtime.block_on(request.try_next()) {
            Ok(message) => Ok(message.map(|m| link_from(&m))),
            Err(e) => {
                let err = netlink_err(format!("get link {index}"))(e);
                if err.errno() == Some(crate::ENODEV) {
                    Ok(None)
                } else {
                    Err(err)
                }
            }
        }
    }

    /// Every link of the namespace.
    pub fn links(&self) -> Result<Vec<Link>> {
        let messages: Vec<LinkMessage> = self
            .runtime
            .block_on(self.handle.link().get().execute().try_collect())
            .map_err(netlink_err("list links"))?;
        Ok(messages.iter().map(link_from).collect())
    }

    /// Creates a bridge. Fails with EEXIST if a link of that name exists.
    pub fn create_bridge(&self, name: &str, mtu: Option<u32>, vlan_filtering: bool) -> Result<()> {
        let mut builder = LinkBridge::new(name);
        if let Some(mtu) = mtu {
            builder = builder.mtu(mtu);
        }
        if vlan_filtering {
            builder = builder.vlan_filtering(true);
        }
        self.run(
            format!("create bridge {name:?}"),
            self.handle.link().add(builder.build()).execute(),
        )
    }

    /// Creates a veth pair whose end `host_name` is in this connection's
    /// namespace, enslaved to `master` when given (in the same request: one
    /// RTNL turn fewer), and whose peer `peer_name` is created directly in
    /// `peer_ns`, so the pod-side name never exists in the host namespace.
    pub fn create_veth(
        &self,
        host_name: &str,
        master: Option<&Link>,
        peer_name: &str,
        peer_ns: &NetNs,
        mtu: Option<u32>,
        peer_mac: Option<[u8; 6]>,
    ) -> Result<()> {
        let mut peer = LinkMessageBuilder::<LinkUnspec>::new()
            .name(peer_name.to_owned())
            .setns_by_fd(peer_ns.as_fd().as_raw_fd());
        let mut host =
            LinkMessageBuilder::<LinkUnspec>::new_with_info_kind(InfoKind::Veth).name(host_name.to_owned());
        if let Some(mtu) = mtu {
            peer = peer.mtu(mtu);
            host = host.mtu(mtu);
        }
        if let Some(mac) = peer_mac {
            peer = peer.address(mac.to_vec());
        }
        if let Some(master) = master {
            host = host.controller(master.index);
        }
        let message = host
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer.build())))
            .build();
        self.run(
            format!("create veth {host_name:?}"),
            self.handle.link().add(message).execute(),
        )
    }

    /// Deletes a link; one already gone is not an error.
    pub fn delete_link(&self, link: &Link) -> Result<()> {
        match self.run(
            format!("delete link {:?}", link.name),
            self.handle.link().del(link.index).execute(),
        ) {
            Err(e) if e.errno() == Some(crate::ENODEV) => Ok(()),
            other => other,
        }
    }

    /// Deletes the link called `name` in one request (the kernel looks the
    /// name up), without asking for it first. Returns whether there was one.
    pub fn delete_link_named(&self, name: &str) -> Result<bool> {
        let request =
            rtnetlink::LinkDelRequest::new_with_message(self.handle.clone(), delete_by_name_request(name));
        match self.run(format!("delete link {name:?}"), request.execute()) {
            Ok(()) => Ok(true),
            Err(e) if e.errno() == Some(crate::ENODEV) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn set(&self, link: &Link, what: &str, message: LinkMessage) -> Result<()> {
        self.run(
            format!("set {what} of {:?}", link.name),
            self.handle.link().set(message).execute(),
        )
    }

    pub fn set_promisc(&self, link: &Link, on: bool) -> Result<()> {
        self.set(
            link,
            "promisc",
            LinkUnspec::new_with_index(link.index).promiscuous(on).build(),
        )
    }

    pub fn set_mac(&self, link: &Link, mac: [u8; 6]) -> Result<()> {
        self.set(
            link,
            "address",
            LinkUnspec::new_with_index(link.index)
                .address(mac.to_vec())
                .build(),
        )
    }

    /// Bridge-port flags of an enslaved link (`bridge link set ... hairpin
    /// ... isolated ...`) and the link up, in one request (one RTNL turn).
    pub fn set_port_flags_and_up(&self, port: &Link, hairpin: bool, isolated: bool) -> Result<()> {
        let message = LinkBridgePort::new(port.index)
            .hairpin(hairpin)
            .isolated(isolated)
            .up();
        self.run(
            format!("set bridge port flags of {:?} and up", port.name),
            self.handle.link().set_port(message.build()).execute(),
        )
    }

    pub fn add_port_vlan(&self, port: &Link, vid: u16, pvid_untagged: bool) -> Result<()> {
        let message = vlan_add_request(port.index, vid, pvid_untagged);
        self.run(
            format!("add VLAN {vid} to {:?}", port.name),
            self.handle.link().set(message).execute(),
        )
    }

    pub fn del_port_vlan(&self, port: &Link, vid: u16, pvid_untagged: bool) -> Result<()> {
        let message = vlan_del_request(port.index, vid, pvid_untagged);
        self.run(
            format!("remove VLAN {vid} from {:?}", port.name),
            self.handle.link().del_with_message(message).execute(),
        )
    }

    /// Adds an address; one already present is not an error.
    pub fn add_address(&self, link: &Link, address: IpNetwork) -> Result<()> {
        let request = self
            .handle
            .address()
            .add(link.index, address.ip(), address.prefix())
            .execute();
        match self.run(format!("add {address} to {:?}", link.name), request) {
            Err(e) if e.errno() == Some(crate::EEXIST) => Ok(()),
            other => other,
        }
    }

    pub fn del_address(&self, link: &Link, address: IpNetwork) -> Result<()> {
        let messages = self.address_messages(link)?;
        for message in messages
            .into_iter()
            .filter(|m| crate::address_from(m) == Some(address))
        {
            match self.run(
                format!("remove {address} from {:?}", link.name),
                self.handle.address().del(message).execute(),
            ) {
                Err(e) if e.errno() == Some(crate::EADDRNOTAVAIL) => {}
                other => other?,
            }
        }
        Ok(())
    }

    fn address_messages(&self, link: &Link) -> Result<Vec<AddressMessage>> {
        let request = self
            .handle
            .address()
            .get()
            .set_link_index_filter(link.index)
            .execute();
        let messages: Vec<AddressMessage> = self
            .runtime
            .block_on(request.try_collect())
            .map_err(netlink_err(format!("list addresses of {:?}", link.name)))?;
        Ok(messages
            .into_iter()
            .filter(|m| m.header.index == link.index)
            .collect())
    }

    /// Addresses with their DAD state.
    pub fn address_states(&self, link: &Link) -> Result<Vec<AddressState>> {
        Ok(self
            .address_messages(link)?
            .iter()
            .filter_map(|m| {
                let address = crate::address_from(m)?;
                let extended = m.attributes.iter().find_map(|a| match a {
                    AddressAttribute::Flags(f) => Some(*f),
                    _ => None,
                });
                let tentative = m.header.flags.contains(AddressHeaderFlags::Tentative)
                    || extended.is_some_and(|f| f.contains(AddressFlags::Tentative));
                let dad_failed = m.header.flags.contains(AddressHeaderFlags::Dadfailed)
                    || extended.is_some_and(|f| f.contains(AddressFlags::Dadfailed));
                Some(AddressState {
                    address,
                    tentative,
                    dad_failed,
                })
            })
            .collect())
    }
}

/// Whether an address is global unicast (what DEL collects to tear down
/// masquerade rules): not loopback, link-local or multicast.
pub fn is_global_unicast(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            !(a.is_loopback()
                || a.is_link_local()
                || a.is_multicast()
                || a.is_unspecified()
                || a.is_broadcast())
        }
        IpAddr::V6(a) => {
            !(a.is_loopback() || a.is_multicast() || a.is_unspecified() || a.is_unicast_link_local())
        }
    }
}

#[cfg(test)]
mod tests {
    use rtnetlink::packet_route::AddressFamily;
    use rtnetlink::packet_route::link::{AfSpecBridge, BridgeVlanInfo};

    use super::*;

    #[test]
    fn macs_parse() {
        assert_eq!(
            parse_mac("0A:58:0a:01:00:05"),
            Some([0x0a, 0x58, 0x0a, 0x01, 0x00, 0x05])
        );
        assert_eq!(parse_mac("0a:58:0a:01:00"), None);
        assert_eq!(parse_mac("zz:58:0a:01:00:05"), None);
    }

    #[test]
    fn a_delete_by_name_carries_the_name_and_no_index() {
        let request = delete_by_name_request("eth0");
        assert_eq!(request.header.index, 0);
        assert_eq!(request.attributes, [LinkAttribute::IfName("eth0".into())]);
    }

    #[test]
    fn vlan_requests_are_bridge_family_setlinks_on_the_port() {
        let pvid = vlan_add_request(7, 100, true);
        assert_eq!(pvid.header.index, 7);
        assert_eq!(pvid.header.interface_family, AddressFamily::Bridge);
        assert!(
            pvid.attributes
                .contains(&LinkAttribute::AfSpecBridge(vec![AfSpecBridge::VlanInfo(
                    BridgeVlanInfo {
                        vid: 100,
                        flags: BridgeVlanInfoFlags::Pvid | BridgeVlanInfoFlags::Untagged,
                    }
                )]))
        );
        let tagged = vlan_add_request(7, 200, false);
        assert!(
            tagged
                .attributes
                .contains(&LinkAttribute::AfSpecBridge(vec![AfSpecBridge::VlanInfo(
                    BridgeVlanInfo {
                        vid: 200,
                        flags: BridgeVlanInfoFlags::empty(),
                    }
                )]))
        );
    }

    #[test]
    fn global_unicast() {
        for ip in ["10.0.0.5", "fd00::5", "2001:db8::1"] {
            assert!(is_global_unicast(ip.parse().expect("ip")), "{ip}");
        }
        for ip in [
            "127.0.0.1",
            "169.254.1.1",
            "fe80::1",
            "::1",
            "224.0.0.1",
            "ff02::1",
        ] {
            assert!(!is_global_unicast(ip.parse().expect("ip")), "{ip}");
        }
    }
}
