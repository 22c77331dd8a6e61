//! The verbs. Each family of the pod's addresses gets one transaction in
//! the configured backend; DEL and GC look in both backends, so a node
//! whose configuration changed backend loses nothing.

use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::rules::{self, Forward, Mapping, Pod, PortMapper, Protocol, Settings, iptables, nft};
use cni::error::{Code, plugin_codes};
use cni::keys::Shape;
use cni::{Attachment, CniResult, Error, Plugin, Request, Result};
use firewall::conntrack::{self, Filter};
use firewall::{Backend, Family};
use ipnetwork::IpNetwork;
use netlink::Netlink;
use netns::{NetNs, NetNsLock};
use podnet::{check_failed, combine, firewall_error, netlink_error};

use crate::config::{KEYS, PortmapConfig};
use crate::records::{self, Namespace, Record};

#[derive(Debug)]
pub struct Portmap;

/// The node namespace's lock: our ADDs, DELs and GCs of a node never
/// interleave their reads and writes of the shared chains.
fn lock_node() -> Result<NetNsLock> {
    NetNs::current()
        .map_err(|e| Error::io(e.to_string()))?
        .lock()
        .map_err(|e| Error::io(format!("cannot lock the node's network namespace: {e}")))
}

/// The pod's address of each family, as the reference picks them: the
/// first of each family that is on the sandbox interface `ifname` (or on
/// no interface in particular).
fn pod_addresses(result: &CniResult, ifname: &str) -> Vec<IpNetwork> {
    let mut picked: Vec<IpNetwork> = Vec::new();
    for ip in &result.ips {
        if picked.iter().any(|p| p.is_ipv4() == ip.address.is_ipv4()) {
            continue;
        }
        let elsewhere = ip
            .interface
            .and_then(|i| result.interfaces.get(i))
            .is_some_and(|iface| iface.name != ifname || iface.sandbox.is_empty());
        if !elsewhere {
            picked.push(ip.address);
        }
    }
    picked
}

fn pod<'a>(req: &'a Request, att: &'a Attachment, address: IpNetwork) -> Pod<'a> {
    Pod {
        network: &req.conf.name,
        container_id: &att.container_id,
        address,
    }
}

/// The configured backend: the one place the configuration picks it.
fn mapper(backend: Backend) -> &'static dyn PortMapper {
    match backend {
        Backend::Iptables => &iptables::Iptables,
        Backend::Nftables => &nft::Nftables,
    }
}

/// The reference's ADD-time cleanup: every UDP flow to a mapped port of the
/// family, so that a flow that reached someone else (an earlier pod, a
/// host-network server) now reaches this pod.
fn flush_udp_flows(family: Family, mappings: &[Mapping]) {
    let filters: Vec<Filter> = mappings
        .iter()
        .filter(|m| m.protocol == Protocol::Udp && m.applies_to(family))
        .map(|m| Filter {
            family,
            protocol: Protocol::Udp.number(),
            port: m.host_port,
            reply_source: None,
        })
        .collect();
    if let Err(e) = conntrack::delete(&filters) {
        log::warn!("failed to delete stale UDP conntrack entries: {e}");
    }
}

/// After a DEL or GC: every flow still translated to a removed mapping,
/// UDP, TCP and SCTP alike, so that its next packet meets today's rules
/// (the reference leaves them to reach a dead pod).
fn flush_removed_flows(forwards: &[Forward]) {
    let filters: Vec<Filter> = forwards
        .iter()
        .map(|f| Filter {
            family: rules::family_of(f.pod_ip),
            protocol: f.protocol.number(),
            port: f.host_port,
            reply_source: Some(f.pod_ip),
        })
        .collect();
    if let Err(e) = conntrack::delete(&filters) {
        log::warn!("failed to delete conntrack entries of removed mappings: {e}");
    }
}

/// Traffic from the node's own 127.0.0.1 to a hostPort leaves through the
/// interface toward the pod; without `route_localnet` there, the kernel
/// drops it as martian.
fn enable_route_localnet(pod_ip: IpAddr) -> Result<()> {
    let nl = Netlink::connect().map_err(netlink_error)?;
    if let Some(link) = nl.interface_toward(pod_ip).map_err(netlink_error)? {
        netlink::sysctl::write(&format!("net/ipv4/conf/{}/route_localnet", link.name), "1")
            .map_err(|e| Error::io(format!("unable to enable route_localnet: {e}")))?;
    }
    Ok(())
}

/// Removes a pod's mappings in both backends and both families; goes on
/// past failures.
fn remove_everywhere(
    settings: &Settings,
    mappings: &[Mapping],
    network: &str,
    container_id: &str,
    addresses: &[IpNetwork],
) -> (Vec<Forward>, Vec<Error>) {
    let mut forwards = Vec::new();
    let mut failures = Vec::new();
    let known = |family: Family| {
        addresses
            .iter()
            .find(|a| Family::of(a) == family)
            .filter(|_| !mappings.is_empty())
            .map(|a| (mappings, a.ip()))
    };
    for family in [Family::V4, Family::V6] {
        if firewall::iptables::available(family) {
            match iptables::remove(family, settings, network, container_id, known(family)) {
                Ok(found) => forwards.extend(found),
                Err(e) => failures.push(firewall_error(e)),
            }
        }
        if firewall::exec::find("nft").is_some() {
            match nft::remove(family, container_id, known(family)) {
                Ok(found) => forwards.extend(found),
                Err(e) => failures.push(firewall_error(e)),
            }
        }
    }
    (forwards, failures)
}

/// Two pods on one host port: refused while the holder's network
/// namespace still exists (its record's path opens the same namespace);
/// a holder that is gone without a DEL has its mappings removed, so the
/// new pod gets the traffic. (The reference adds both; the holder's jump
/// comes first, so the old, possibly dead, pod keeps the port.) Holders
/// without a record (the reference's) are not seen.
fn settle_conflicts(cfg: &PortmapConfig, network: &str, container_id: &str, node: &Namespace) -> Result<()> {
    let holders = Record::all(&cfg.state_dir, node).map_err(|e| {
        Error::io(format!(
            "cannot tell which host ports are held: a record in {} is unreadable: {e}",
            cfg.state_dir.display()
        ))
    })?;
    for holder in holders {
        if holder.network == network && holder.container_id == container_id {
            continue;
        }
        let Some(clash) = holder
            .mappings
            .iter()
            .find(|held| cfg.mappings.iter().any(|m| held.overlaps(m)))
        else {
            continue;
        };
        let port = format!("{}/{}", clash.host_port, clash.protocol);
        if holder.pod.alive() {
            return Err(Error::plugin(
                plugin_codes::HOST_PORT_TAKEN,
                format!(
                    "host port {port} is published for container {} of network {:?}, whose network namespace {} still exists",
                    holder.container_id,
                    holder.network,
                    holder.pod.path.display()
                ),
            ));
        }
        log::warn!(
            "host port {port} was published for container {} of network {:?}, whose network namespace is gone: removing its mappings",
            holder.container_id,
            holder.network
        );
        let (forwards, failures) =
            remove_everywhere(&cfg.settings, &[], &holder.network, &holder.container_id, &[]);
        flush_removed_flows(&forwards);
        combine(failures)?;
        records::remove(&cfg.state_dir, &holder.network, &holder.container_id).map_err(|e| {
            Error::io(format!(
                "cannot remove the record of {}: {e}",
                holder.container_id
            ))
        })?;
    }
    Ok(())
}

impl Plugin for Portmap {
    const NAME: &'static str = "portmap";
    const KEYS: Shape = KEYS;
    const LOG_SOCKET: Option<cni::log::OpenSink> = Some(agent_wire::log::open);

    fn add(&self, req: &Request, att: &Attachment) -> Result<CniResult> {
        let cfg = PortmapConfig::load(&req.conf)?;
        let Some(result) = req.conf.prev_result()? else {
            return Err(Error::invalid_config("must be called as chained plugin"));
        };
        if cfg.mappings.is_empty() {
            return Ok(result);
        }
        let _lock = lock_node()?;
        let node =
            Namespace::current().map_err(|e| Error::io(format!("cannot read the node's namespace: {e}")))?;
        settle_conflicts(&cfg, &req.conf.name, &att.container_id, &node)?;
        for address in pod_addresses(&result, &att.ifname) {
            let pod = pod(req, att, address);
            mapper(cfg.backend)
                .add(&pod, &cfg.settings, &cfg.mappings)
                .map_err(|e| firewall_error(e).context("unable to set up port mappings"))?;
            flush_udp_flows(pod.family(), &cfg.mappings);
            if cfg.settings.snat && address.is_ipv4() {
                enable_route_localnet(address.ip())?;
            }
        }
        // Without its record, a later pod on the same port is let in as
        // the reference lets it: worth a warning, not a failed pod.
        let recorded = att
            .netns
            .as_deref()
            .ok_or_else(|| std::io::Error::other("no network namespace"))
            .and_then(Namespace::of)
            .and_then(|pod| {
                Record::new(&req.conf.name, &att.container_id, node, pod, &cfg.mappings).save(&cfg.state_dir)
            });
        if let Err(e) = recorded {
            log::warn!("cannot record the mappings of {}: {e}", att.container_id);
        }
        Ok(result)
    }

    fn check(&self, req: &Request, att: &Attachment) -> Result<()> {
        let cfg = PortmapConfig::load(&req.conf)?;
        let Some(result) = req.conf.prev_result()? else {
            return Err(Error::invalid_config("Required prevResult missing"));
        };
        if cfg.mappings.is_empty() {
            return Ok(());
        }
        let mut gaps = Vec::new();
        for address in pod_addresses(&result, &att.ifname) {
            let pod = pod(req, att, address);
            let found = mapper(cfg.backend).missing(&pod, &cfg.settings, &cfg.mappings);
            gaps.extend(found.map_err(firewall_error)?);
        }
        if gaps.is_empty() {
            Ok(())
        } else {
            Err(check_failed(format!(
                "port mapping rules missing: {}",
                gaps.join("; ")
            )))
        }
    }

    /// Removes everything of the container whatever the request lacks: the
    /// mappings and the pod's addresses only let it skip reading the
    /// tables.
    fn del(&self, req: &Request, att: &Attachment) -> Result<()> {
        let cfg = PortmapConfig::load(&req.conf)?;
        let addresses = req
            .conf
            .prev_result()
            .ok()
            .flatten()
            .map(|result| pod_addresses(&result, &att.ifname))
            .unwrap_or_default();
        let _lock = lock_node()?;
        let (forwards, mut failures) = remove_everywhere(
            &cfg.settings,
            &cfg.mappings,
            &req.conf.name,
            &att.container_id,
            &addresses,
        );
        flush_removed_flows(&forwards);
        if let Err(e) = records::remove(&cfg.state_dir, &req.conf.name, &att.container_id) {
            failures.push(Error::io(format!(
                "cannot remove the record of {}: {e}",
                att.container_id
            )));
        }
        combine(failures)
    }

    fn gc(&self, req: &Request) -> Result<()> {
        let cfg = PortmapConfig::load(&req.conf)?;
        let keep: BTreeSet<String> = req
            .conf
            .gc_valid_attachments()?
            .into_iter()
            .map(|a| a.container_id)
            .collect();
        let network = &req.conf.name;
        let _lock = lock_node()?;
        let mut failures = Vec::new();
        // Without every record, another network's container could pass
        // for a stale one: its nftables rules and records are left to a
        // later GC.
        let records = match Namespace::current().and_then(|node| Record::all(&cfg.state_dir, &node)) {
            Ok(records) => Some(records),
            Err(e) => {
                failures.push(Error::io(format!(
                    "nftables rules and records not collected: cannot read the records in {}: {e}",
                    cfg.state_dir.display()
                )));
                None
            }
        };
        // The nftables table is shared by every network and a rule's
        // comment is its container ID alone, as upstream writes it: a
        // container recorded in another network is that network's to
        // collect.
        let elsewhere: BTreeSet<&str> = records
            .iter()
            .flatten()
            .filter(|r| r.network != *network)
            .map(|r| r.container_id.as_str())
            .collect();
        let mut forwards = Vec::new();
        for family in [Family::V4, Family::V6] {
            if firewall::iptables::available(family) {
                match iptables::collect_garbage(family, network, &keep) {
                    Ok(found) => forwards.extend(found),
                    Err(e) => failures.push(firewall_error(e)),
                }
            }
            if records.is_none() || firewall::exec::find("nft").is_none() {
                continue;
            }
            match nft::containers(family) {
                Ok(ids) => {
                    let stale = ids
                        .iter()
                        .filter(|id| !keep.contains(*id) && !elsewhere.contains(id.as_str()));
                    for id in stale {
                        match nft::remove(family, id, None) {
                            Ok(found) => forwards.extend(found),
                            Err(e) => failures.push(firewall_error(e)),
                        }
                    }
                }
                Err(e) => failures.push(firewall_error(e)),
            }
        }
        flush_removed_flows(&forwards);
        let stale = records
            .iter()
            .flatten()
            .filter(|r| r.network == *network && !keep.contains(&r.container_id));
        for record in stale {
            if let Err(e) = records::remove(&cfg.state_dir, network, &record.container_id) {
                failures.push(Error::io(format!(
                    "cannot remove the record of {}: {e}",
                    record.container_id
                )));
            }
        }
        combine(failures)
    }

    fn status(&self, req: &Request) -> Result<()> {
        let cfg = PortmapConfig::load(&req.conf)?;
        if mapper(cfg.backend).usable() {
            Ok(())
        } else {
            Err(Error::new(
                Code::NotAvailable,
                "neither iptables-restore and iptables-save nor nft are usable on this node",
            ))
        }
    }
}
