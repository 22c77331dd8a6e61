//! The loopback plugin's verbs. It always acts on `lo`, whatever CNI_IFNAME
//! says, as the reference plugin does.

use std::path::Path;

use cni::result::{Interface, IpConfig};
use cni::{Attachment, CniResult, Plugin, Request, Result};
use ipnetwork::IpNetwork;
use netlink::{Link, Netlink};
use netns::NetNs;
use podnet::{check_failed, netlink_error, netns_path, open_netns, state_error};

const LOOPBACK: &str = "lo";

pub struct Loopback;

impl Plugin for Loopback {
    const NAME: &'static str = "loopback";
    const KEYS: cni::keys::Shape = cni::keys::PLAIN_PLUGIN;
    const LOG_SOCKET: Option<cni::log::OpenSink> = Some(agent_wire::log::open);

    fn add(&self, req: &Request, attachment: &Attachment) -> Result<CniResult> {
        let sandbox = netns_path(attachment)?;
        // A prevResult that cannot be read must fail before anything changes.
        let prev_result = req.conf.prev_result()?;
        let (netlink, lo) = open_loopback(&open_netns(sandbox)?)?;
        netlink.set_up(&lo).map_err(netlink_error)?;
        let addresses = netlink.addresses(&lo).map_err(netlink_error)?;
        if let Some(foreign) = addresses.iter().find(|a| !a.ip().is_loopback()) {
            return Err(state_error(format!(
                "loopback interface found with non-loopback address {:?}",
                foreign.ip().to_string()
            )));
        }
        // In a chain, the result so far is what the runtime must get back.
        if let Some(prev) = prev_result {
            return Ok(prev);
        }
        Ok(loopback_result(&lo, &addresses, sandbox))
    }

    fn check(&self, _req: &Request, attachment: &Attachment) -> Result<()> {
        let (_, lo) = open_loopback(&open_netns(netns_path(attachment)?)?)?;
        if lo.up {
            Ok(())
        } else {
            Err(check_failed("loopback interface is down"))
        }
    }

    fn del(&self, _req: &Request, attachment: &Attachment) -> Result<()> {
        // Runtimes send DEL with an empty netns, or after the pod's netns is
        // gone; there is nothing left to undo then.
        let Some(path) = attachment.netns.as_deref() else {
            return Ok(());
        };
        let Some(ns) = podnet::open_netns_unless_gone(path)? else {
            return Ok(());
        };
        let netlink = Netlink::connect_in(&ns).map_err(netlink_error)?;
        match netlink.link_by_name(LOOPBACK).map_err(netlink_error)? {
            Some(lo) => netlink.set_down(&lo).map_err(netlink_error),
            None => Ok(()),
        }
    }
}

fn open_loopback(ns: &NetNs) -> Result<(Netlink, Link)> {
    let netlink = Netlink::connect_in(ns).map_err(netlink_error)?;
    let lo = netlink.require_link(LOOPBACK).map_err(netlink_error)?;
    Ok((netlink, lo))
}

/// `lo` with its first IPv4 and first IPv6 address, as the reference
/// reports it.
fn loopback_result(lo: &Link, addresses: &[IpNetwork], netns: &Path) -> CniResult {
    let first = |v4: bool| addresses.iter().find(|a| a.is_ipv4() == v4);
    CniResult {
        interfaces: vec![Interface {
            name: lo.name.clone(),
            mac: lo.mac.clone(),
            sandbox: netns.display().to_string(),
            ..Interface::default()
        }],
        ips: [first(true), first(false)]
            .into_iter()
            .flatten()
            .map(|address| IpConfig {
                address: *address,
                gateway: None,
                interface: Some(0),
            })
            .collect(),
        ..CniResult::default()
    }
}

#[cfg(test)]
mod tests {
    use cni::conf::parse_document;
    use cni::{NetConf, keys};

    use super::*;

    #[test]
    fn every_key_reads_null_as_absent() {
        let doc = parse_document(
            br#"{"cniVersion": "1.0.0", "name": "lo", "type": "loopback",
            "capabilities": {"mac": true}, "dns": {"nameservers": ["10.0.0.53"], "domain": "d",
            "search": ["s"], "options": ["o"]}, "ipam": {"type": "none"}, "logLevel": "debug",
            "prevResult": {"cniVersion": "1.0.0",
              "interfaces": [{"name": "eth0", "mac": "c2:00:00:00:00:01", "mtu": 1500,
                "sandbox": "/run/netns/p", "socketPath": "/s", "pciID": "0000:00:01.0"}],
              "ips": [{"address": "10.0.0.2/24", "gateway": "10.0.0.1", "interface": 0}],
              "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1", "mtu": 1400, "advmss": 1300,
                "priority": 5, "table": 100, "scope": 0}],
              "dns": {"nameservers": ["10.0.0.53"], "domain": "d", "search": ["s"], "options": ["o"]}},
            "cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}],
            "cni.dev/attachments": [{"containerID": "a", "ifname": "eth0"}]}"#,
        )
        .expect("JSON");
        // What loopback reads of a configuration, as the skeleton and ADD
        // read it.
        let loaded = |doc: &_| -> Result<(NetConf, Option<CniResult>)> {
            let mut doc = Clone::clone(doc);
            keys::fold(&mut doc, &Loopback::KEYS);
            let conf = NetConf::read(doc)?;
            let prev_result = conf.prev_result()?;
            Ok((conf, prev_result))
        };
        assert!(loaded(&doc).is_ok_and(|(_, prev)| prev.is_some()));
        cni::keys::assert_null_reads_as_absent(&doc, &Loopback::KEYS, 40, loaded);
    }

    #[test]
    fn result_lists_lo_with_one_address_per_family() {
        let lo = Link {
            index: 1,
            name: "lo".into(),
            up: true,
            mtu: 65536,
            mac: "00:00:00:00:00:00".into(),
            ..Link::default()
        };
        let addrs: Vec<IpNetwork> = ["127.0.0.1/8", "127.0.0.2/8", "::1/128"]
            .iter()
            .map(|s| s.parse().expect("cidr"))
            .collect();
        let r = loopback_result(&lo, &addrs, Path::new("/run/netns/p"));
        assert_eq!(r.interfaces[0].sandbox, "/run/netns/p");
        let shown: Vec<String> = r.ips.iter().map(|i| i.address.to_string()).collect();
        assert_eq!(shown, ["127.0.0.1/8", "::1/128"]);
        assert!(
            r.ips
                .iter()
                .all(|i| i.interface == Some(0) && i.gateway.is_none())
        );
    }
}
