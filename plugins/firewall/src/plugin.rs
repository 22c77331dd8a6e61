//! The verbs. Rules go into the namespace the plugin runs in (the node's),
//! like the reference's; the node's lock keeps two plugins from both
//! finding a jump missing and adding it twice.

use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::rules::{FirewallBackend, IngressPolicy, Pod, PodRules, iptables, nft};
use cni::{Attachment, CniResult, Code, Error, Plugin, Request, Result};
use firewall::{Backend, Family};
use netlink::Netlink;
use netns::{NetNs, NetNsLock};
use podnet::{check_failed, combine, firewall_error, netlink_error};

use crate::config::FirewallConfig;
use crate::state::{Owner, Record, Store};

#[derive(Debug)]
pub struct Firewall;

const FAMILIES: [Family; 2] = [Family::V4, Family::V6];

fn family_of(ip: &IpAddr) -> Family {
    if ip.is_ipv4() { Family::V4 } else { Family::V6 }
}

fn of_family(ips: &[IpAddr], family: Family) -> Vec<IpAddr> {
    ips.iter().copied().filter(|ip| family_of(ip) == family).collect()
}

fn addresses(result: &CniResult) -> Vec<IpAddr> {
    result.ips.iter().map(|c| c.address.ip()).collect()
}

/// prevResult, which ADD and CHECK cannot do without.
fn prev_result(req: &Request) -> Result<CniResult> {
    req.conf
        .prev_result()?
        .ok_or_else(|| Error::invalid_config("missing prevResult from earlier plugin"))
}

/// The bridge to isolate: the first interface of prevResult, which the
/// bridge plugin lists first, as the reference takes it.
fn isolated_bridge(cfg: &FirewallConfig, result: &CniResult) -> Result<Option<String>> {
    if cfg.ingress_policy != IngressPolicy::SameBridge {
        return Ok(None);
    }
    let Some(first) = result.interfaces.first() else {
        return Err(Error::invalid_config(
            "interface needs to be set for ingress policy \"same-bridge\", make sure to chain \"firewall\" plugin with \"bridge\"",
        ));
    };
    let name = first.name.as_str();
    if name.is_empty() {
        return Err(Error::invalid_config("got empty bridge name"));
    }
    // What iptables-restore input and nft can carry as a word.
    if name.len() > 15
        || !name
            .chars()
            .all(|c| c.is_ascii_graphic() && !"\"'\\/".contains(c))
    {
        return Err(Error::invalid_config(format!(
            "invalid bridge name {name:?} in prevResult"
        )));
    }
    Ok(Some(name.to_owned()))
}

fn node_lock() -> Result<(NetNs, NetNsLock)> {
    let ns = NetNs::current().map_err(|e| Error::io(format!("opening the node's namespace: {e}")))?;
    let lock = ns
        .lock()
        .map_err(|e| Error::io(format!("locking the node's namespace: {e}")))?;
    Ok((ns, lock))
}

fn pod<'a>(req: &'a Request, att: &'a Attachment) -> Pod<'a> {
    Pod {
        network: &req.conf.name,
        container_id: &att.container_id,
        ifname: &att.ifname,
    }
}

/// The configured backend: the one place the configuration picks it.
fn backend(cfg: &FirewallConfig) -> &'static dyn FirewallBackend {
    match cfg.backend {
        Backend::Iptables => &iptables::Iptables,
        Backend::Nftables => &nft::Nftables,
    }
}

fn pod_rules<'a>(
    cfg: &'a FirewallConfig,
    req: &'a Request,
    att: &'a Attachment,
    ips: &'a [IpAddr],
    bridge: Option<&'a str>,
) -> PodRules<'a> {
    PodRules {
        pod: pod(req, att),
        ips,
        admin_chain: &cfg.admin_chain,
        bridge,
    }
}

fn state_error(e: std::io::Error) -> Error {
    Error::io(format!("firewall state: {e}"))
}

/// The pod interface's addresses, read in its namespace, for a DEL with
/// neither prevResult nor a record (a pod the reference plugin added, its
/// result cache lost).
fn addresses_in_pod(att: &Attachment) -> Vec<IpAddr> {
    let Some(Ok(Some(ns))) = att.netns.as_deref().map(podnet::open_netns_unless_gone) else {
        return Vec::new();
    };
    let read = || -> Result<Vec<IpAddr>> {
        let nl = Netlink::connect_in(&ns).map_err(netlink_error)?;
        let Some(link) = nl.link_by_name(&att.ifname).map_err(netlink_error)? else {
            return Ok(Vec::new());
        };
        Ok(nl
            .addresses(&link)
            .map_err(netlink_error)?
            .into_iter()
            .map(|a| a.ip())
            .filter(|ip| {
                !ip.is_loopback() && !matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
            })
            .collect())
    };
    read().unwrap_or_else(|e| {
        log::warn!("reading the pod's addresses: {}", e.msg);
        Vec::new()
    })
}

/// Removes the iptables pod rules of `ips`, except for addresses another
/// recorded attachment still has.
fn del_iptables(store: &Store, owner: &Owner, ips: &[IpAddr]) -> Result<()> {
    let in_use = store.held_by_others(owner, ips).map_err(|e| {
        Error::io(format!(
            "rules kept: cannot tell whether another attachment holds these addresses: {e}"
        ))
    })?;
    let mine: Vec<IpAddr> = ips.iter().copied().filter(|ip| !in_use.contains(ip)).collect();
    let mut failures = Vec::new();
    for family in FAMILIES {
        let ips = of_family(&mine, family);
        if ips.is_empty() || !firewall::iptables::available(family) {
            continue;
        }
        if let Err(e) = iptables::del(family, &ips) {
            failures.push(firewall_error(e));
        }
    }
    combine(failures)
}

impl Plugin for Firewall {
    const NAME: &'static str = "firewall";
    const KEYS: cni::keys::Shape = crate::config::KEYS;
    const LOG_SOCKET: Option<cni::log::OpenSink> = Some(agent_wire::log::open);

    fn add(&self, req: &Request, att: &Attachment) -> Result<CniResult> {
        let cfg = FirewallConfig::load(&req.conf)?;
        let result = prev_result(req)?;
        let ips = addresses(&result);
        let bridge = isolated_bridge(&cfg, &result)?;
        let store = Store::new(&cfg.state_dir);
        // Recorded first: a DEL after an ADD that failed halfway still
        // finds what it may have written.
        let record = Record {
            container_id: att.container_id.clone(),
            ifname: att.ifname.clone(),
            ips: ips.clone(),
        };
        store.save(&req.conf.name, &record).map_err(state_error)?;
        let _lock = node_lock()?;
        let rules = pod_rules(&cfg, req, att, &ips, bridge.as_deref());
        backend(&cfg).add(&rules).map_err(firewall_error)?;
        Ok(result)
    }

    fn check(&self, req: &Request, att: &Attachment) -> Result<()> {
        let cfg = FirewallConfig::load(&req.conf)?;
        let result = prev_result(req)?;
        let ips = addresses(&result);
        let bridge = isolated_bridge(&cfg, &result)?;
        let rules = pod_rules(&cfg, req, att, &ips, bridge.as_deref());
        let missing = backend(&cfg).check(&rules).map_err(firewall_error)?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(check_failed(format!(
                "firewall rules missing: {}",
                missing.join("; ")
            )))
        }
    }

    /// Removes the pod's rules from both backends, whatever the
    /// configuration says now, with or without prevResult and the pod's
    /// namespace: addresses from prevResult, the record, else the pod.
    fn del(&self, req: &Request, att: &Attachment) -> Result<()> {
        let store = Store::new(&FirewallConfig::state_dir_of(&req.conf));
        let network = req.conf.name.as_str();
        let mut ips: Vec<IpAddr> = match req.conf.prev_result() {
            Ok(result) => result.as_ref().map(addresses).unwrap_or_default(),
            Err(e) => {
                log::warn!("ignoring prevResult: {}", e.msg);
                Vec::new()
            }
        };
        if let Some(record) = store.load(network, &att.container_id, &att.ifname) {
            ips.extend(record.ips);
        }
        if ips.is_empty() {
            ips = addresses_in_pod(att);
        }
        ips.sort();
        ips.dedup();
        let _lock = node_lock()?;
        let owner = (network.to_owned(), att.container_id.clone(), att.ifname.clone());
        let mut failures = Vec::new();
        if let Err(e) = del_iptables(&store, &owner, &ips) {
            failures.push(e);
        }
        if let Err(e) = nft::del(&pod(req, att)) {
            failures.push(firewall_error(e));
        }
        if failures.is_empty() {
            cni::fault::pause("firewall:del-rules-removed");
            // Kept while rules may remain, so the runtime's retry finds them.
            store
                .remove(network, &att.container_id, &att.ifname, &ips)
                .map_err(state_error)?;
        }
        combine(failures)
    }

    /// Removes the rules of the network's attachments the runtime no
    /// longer lists, in both backends.
    fn gc(&self, req: &Request) -> Result<()> {
        let store = Store::new(&FirewallConfig::state_dir_of(&req.conf));
        let network = req.conf.name.as_str();
        let keep: BTreeSet<(String, String)> = req
            .conf
            .gc_valid_attachments()?
            .into_iter()
            .map(|a| (a.container_id, a.ifname))
            .collect();
        let _lock = node_lock()?;
        let mut failures = Vec::new();
        for record in store.list(network) {
            if keep.contains(&(record.container_id.clone(), record.ifname.clone())) {
                continue;
            }
            let owner = (
                network.to_owned(),
                record.container_id.clone(),
                record.ifname.clone(),
            );
            match del_iptables(&store, &owner, &record.ips) {
                Ok(()) => {
                    if let Err(e) = store.remove(network, &record.container_id, &record.ifname, &record.ips) {
                        failures.push(state_error(e));
                    }
                }
                Err(e) => failures.push(e),
            }
        }
        if let Err(e) = nft::gc(network, &keep) {
            failures.push(firewall_error(e));
        }
        combine(failures)
    }

    /// Whether the configured backend's tools work here.
    fn status(&self, req: &Request) -> Result<()> {
        let cfg = FirewallConfig::load(&req.conf)?;
        let probe = match cfg.backend {
            Backend::Iptables => firewall::exec::run(Family::V4.save(), &["-t", "filter"], ""),
            Backend::Nftables => firewall::exec::run("nft", &["list", "tables"], ""),
        };
        probe.map(drop).map_err(|e| {
            Error::new(
                Code::NotAvailable,
                format!("the firewall cannot be programmed: {e}"),
            )
        })
    }
}
