//! The bridge plugin's verbs.

use std::net::IpAddr;

use cni::conf::NetConf;
use cni::error::plugin_codes;
use cni::result::{Interface, IpConfig, Route};
use cni::{Attachment, CniResult, Command, Error, Plugin, Request, Result, fault};
use firewall::Family;

use crate::spoofcheck;
use ipnetwork::IpNetwork;
use netlink::{Link, Netlink};
use netns::NetNs;
use podnet::{check_failed, combine, firewall_error, netlink_error, state_error};

use crate::config::BridgeConfig;
use crate::host;
use crate::lease;
use crate::pod::{self, Gateways};
use crate::rules;
use crate::undo::Undo;

/// Index of the container interface in the result (bridge, host veth,
/// container), as the reference numbers them.
const CONTAINER_INTERFACE: usize = 2;

#[derive(Debug)]
pub struct Bridge;

/// The runtime removes a pod's namespace when it gives up on the pod. The
/// handle this ADD holds keeps the namespace alive, so the work would
/// succeed into a namespace nobody can reach and hold its lease until a
/// DEL; checked last, so such an ADD fails and undoes itself instead.
fn still_at_its_path(pod_ns: &NetNs, sandbox: &str) -> Result<()> {
    match NetNs::open(sandbox) {
        Ok(now) if now.same_as(pod_ns) => Ok(()),
        _ => Err(Error::invalid_env(format!(
            "the network namespace {sandbox} vanished during ADD"
        ))),
    }
}

/// What the L3 part of ADD programs, computed from the IPAM result before
/// anything is changed (the reference's `calcGateways`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L3Plan {
    /// The result's IPs: on the container interface, with gateways.
    pub ips: Vec<IpConfig>,
    /// The result's routes: IPAM's, plus default routes for
    /// `isDefaultGateway`.
    pub routes: Vec<Route>,
    /// Per family, the gateway routes without one go through.
    pub gateways: Gateways,
    /// Addresses for the bridge when it is the gateway.
    pub bridge_addresses: Vec<IpNetwork>,
}

fn first_address(net: IpNetwork) -> IpAddr {
    match net.network() {
        IpAddr::V4(a) => IpAddr::V4((u32::from(a) + 1).into()),
        IpAddr::V6(a) => IpAddr::V6((u128::from(a) + 1).into()),
    }
}

pub fn plan_l3(cfg: &BridgeConfig, ipam: &CniResult) -> L3Plan {
    let mut plan = L3Plan {
        ips: Vec::with_capacity(ipam.ips.len()),
        routes: ipam.routes.clone(),
        gateways: Gateways::default(),
        bridge_addresses: Vec::new(),
    };
    for ip in &ipam.ips {
        let v4 = ip.address.is_ipv4();
        let gateway = ip
            .gateway
            .or_else(|| cfg.is_gateway.then(|| first_address(ip.address)));
        if cfg.is_default_gateway {
            let default_dst: IpNetwork = if v4 { "0.0.0.0/0" } else { "::/0" }
                .parse()
                .unwrap_or(ip.address);
            let has_default = plan.routes.iter().any(|r| r.dst == default_dst && r.gw.is_some());
            if !has_default && gateway.is_some() {
                plan.routes.push(Route::new(default_dst, gateway));
            }
        }
        if let Some(gw) = gateway {
            let slot = if v4 {
                &mut plan.gateways.v4
            } else {
                &mut plan.gateways.v6
            };
            slot.get_or_insert(gw);
            if cfg.is_gateway
                && let Ok(on_bridge) = IpNetwork::new(gw, ip.address.prefix())
            {
                plan.bridge_addresses.push(on_bridge);
            }
        }
        plan.ips.push(IpConfig {
            address: ip.address,
            gateway,
            interface: Some(CONTAINER_INTERFACE),
        });
    }
    plan
}

fn interface(link: &Link, sandbox: Option<&str>) -> Interface {
    Interface {
        name: link.name.clone(),
        mac: link.mac.clone(),
        sandbox: sandbox.unwrap_or_default().to_owned(),
        ..Interface::default()
    }
}

/// The `dns` key, when set, replaces what IPAM returned.
fn configured_dns(conf: &NetConf) -> Option<cni::result::Dns> {
    conf.dns.clone().filter(|dns| !dns.is_empty())
}

/// Waits, when the entry names the node agent's NetworkPolicy gate, until
/// the agent holds the pod's policy in the kernel; a pod the agent cannot
/// confirm and a policy may isolate is refused (try again later), and its
/// ADD undone, rather than started open (`agent_wire::policy`).
fn admitted_by_policy(req: &Request, result: &CniResult) -> Result<()> {
    let Some(socket) = req.conf.policy_socket.as_deref() else {
        return Ok(());
    };
    // The agent is told the addresses printed (0.1.0 and 0.2.0 print one
    // per family), once the result is known to print.
    let version = req.conf.cni_version;
    result.to_value(version)?;
    let invocation = cni::env::Invocation::of(&req.env);
    agent_wire::policy::admit(socket, &invocation, result.printed_addresses(version))
        .map_err(Error::try_again_later)
}

impl Plugin for Bridge {
    const NAME: &'static str = "bridge";
    const KEYS: cni::keys::Shape = crate::config::KEYS;
    const LOG_SOCKET: Option<cni::log::OpenSink> = Some(agent_wire::log::open);

    fn add(&self, req: &Request, att: &Attachment) -> Result<CniResult> {
        let cfg = BridgeConfig::load(&req.conf, &req.env.args()?)?;
        let ipam = cfg
            .ipam_type
            .as_deref()
            .map(|plugin| lease::Ipam::validate(plugin, req))
            .transpose()?;
        let netns_path = podnet::netns_path(att)?;
        let (pod_ns, sandbox) = (podnet::open_netns(netns_path)?, netns_path.display().to_string());
        let host_nl = Netlink::connect().map_err(netlink_error)?;
        let pod_nl = Netlink::connect_in(&pod_ns).map_err(netlink_error)?;
        if pod_nl.link_by_name(&att.ifname).map_err(netlink_error)?.is_some() {
            return Err(state_error(format!(
                "container veth name provided ({}) already exists",
                att.ifname
            )));
        }

        std::thread::scope(|scope| {
            // Started before the links are made (and from this thread, in
            // the node's namespace); taken when the addresses are needed.
            let mut pending = ipam
                .as_ref()
                .map(|ipam| (ipam, lease::Pending::start(scope, ipam, req)));
            // The bridge is shared by every pod of the node and is never undone.
            let bridge = host::pin_mac(&host_nl, host::ensure_bridge(&host_nl, &cfg)?)?;
            let mut undo = Undo::default();
            let host_veth = host::create_veth(&host_nl, &pod_ns, &att.ifname, &bridge, &cfg)?;
            {
                let (nl, veth) = (&host_nl, host_veth.clone());
                undo.push("the veth pair", move || {
                    nl.delete_link(&veth).map_err(|e| e.to_string())
                });
            }
            host::attach_port(&host_nl, &host_veth, &cfg)?;
            fault::pause("bridge:veth");
            let container = pod_nl.require_link(&att.ifname).map_err(netlink_error)?;
            if cfg.macspoofchk {
                let id = spoofcheck::reference_id(&att.container_id, &att.ifname);
                spoofcheck::setup(&host_veth.name, &container.mac, &id)
                    .map_err(|e| firewall_error(e).context("failed to set up MAC spoof checking"))?;
                undo.push("the MAC spoof check", move || {
                    spoofcheck::teardown(&id).map_err(|e| e.to_string())
                });
            }

            let mut result = CniResult::default();
            let mut vlan_interface = None;
            if let Some((ipam, running)) = pending.take() {
                let leased = running.wait()?;
                undo.push("the IPAM lease", || {
                    ipam.call(Command::Del, req).map(drop).map_err(|e| e.to_string())
                });
                fault::pause("bridge:leased");
                if leased.ips.is_empty() {
                    return Err(Error::plugin(
                        plugin_codes::ADDRESS_UNAVAILABLE,
                        "IPAM plugin returned missing IP config",
                    ));
                }
                let plan = plan_l3(&cfg, &leased);
                let addresses: Vec<IpNetwork> = plan.ips.iter().map(|ip| ip.address).collect();
                // The subnet's masquerade (a process and a kernel commit for
                // a node's first pod) beside the pod's addresses and routes,
                // from a thread started here, in the node's namespace.
                let masquerading = cfg.ip_masq.then(|| {
                    let (cfg, network, addresses) = (&cfg, &req.conf.name, addresses.clone());
                    scope.spawn(move || rules::ensure(cfg, network, &addresses))
                });
                pod::configure(
                    &pod_ns,
                    &pod_nl,
                    &container,
                    &addresses,
                    &plan.routes,
                    plan.gateways,
                    cfg.enable_dad,
                )?;
                fault::pause("bridge:configured");
                if cfg.is_gateway {
                    let holder = if cfg.vlan != 0 && !plan.bridge_addresses.is_empty() {
                        let vlan_gateway = host::ensure_vlan_gateway(&host_nl, &bridge, &cfg)?;
                        vlan_interface = Some(vlan_gateway.name.clone());
                        vlan_gateway
                    } else {
                        bridge.clone()
                    };
                    for gateway in &plan.bridge_addresses {
                        host::ensure_gateway_address(&host_nl, &holder, *gateway, cfg.force_address)?;
                    }
                    for v4 in [true, false] {
                        if plan.bridge_addresses.iter().any(|g| g.is_ipv4() == v4) {
                            host::enable_forwarding(v4)?;
                        }
                    }
                }
                if let Some(masquerading) = masquerading {
                    // Shared by the subnet's pods: nothing to undo.
                    masquerading
                        .join()
                        .unwrap_or_else(|_| Err(Error::internal("the masquerade thread panicked")))?;
                    fault::pause("bridge:masqueraded");
                }
                result.ips = plan.ips;
                result.routes = plan.routes;
                result.dns = leased.dns;
            } else if !cfg.disable_container_interface {
                pod_nl.set_up(&container).map_err(netlink_error)?;
            }

            let host_veth = if cfg.disable_container_interface {
                host_nl.require_link(&host_veth.name).map_err(netlink_error)?
            } else {
                host::wait_port_up(&host_nl, &host_veth)?
            };
            result.interfaces = vec![
                interface(&bridge, None),
                interface(&host_veth, None),
                interface(&container, Some(&sandbox)),
            ];
            // The reference lists the VLAN gateway interface fourth.
            if let Some(name) = vlan_interface {
                result.interfaces.push(interface(
                    &host_nl.require_link(&name).map_err(netlink_error)?,
                    None,
                ));
            }
            if let Some(dns) = configured_dns(&req.conf) {
                result.dns = dns;
            }
            still_at_its_path(&pod_ns, &sandbox)?;
            admitted_by_policy(req, &result)?;
            undo.commit();
            Ok(result)
        })
    }

    fn del(&self, req: &Request, att: &Attachment) -> Result<()> {
        let cfg = BridgeConfig::load(&req.conf, &req.env.args()?)?;
        // Deleting a veth waits for the kernel (about as long as the rest of
        // DEL together), so it runs beside the IPAM and firewall work.
        let link_removal = att.netns.clone().map(|path| {
            let ifname = att.ifname.clone();
            std::thread::spawn(move || remove_container_link(&path, &ifname))
        });
        // Teardown goes on past failures and reports all of them.
        let mut failures: Vec<Error> = Vec::new();
        if let Some(ipam) = &cfg.ipam_type
            && let Err(e) = lease::call(ipam, Command::Del, req)
        {
            failures.push(e);
        }
        fault::pause("bridge:del-released");
        if cfg.ip_masq {
            // The cached result says which families the pod had; CRI's last
            // DEL and `ctr run --rm` may not send it, then both are looked at.
            let known = req.conf.prev_result().ok().flatten().map(|prev| {
                let addresses: Vec<IpNetwork> = prev.ips.iter().map(|ip| ip.address).collect();
                families_of(&addresses)
            });
            let families = known
                .filter(|f| !f.is_empty())
                .unwrap_or_else(|| vec![Family::V4, Family::V6]);
            if let Err(e) = rules::teardown(&cfg, &req.conf.name, att, &families) {
                failures.push(e);
            }
        }
        if cfg.macspoofchk
            && let Err(e) = spoofcheck::teardown(&spoofcheck::reference_id(&att.container_id, &att.ifname))
        {
            failures.push(firewall_error(e).context("failed to tear down MAC spoof checking"));
        }
        if let Some(removal) = link_removal {
            match removal.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failures.insert(0, e),
                Err(_) => failures.insert(0, Error::internal("removing the container interface panicked")),
            }
            fault::pause("bridge:del-unlinked");
        }
        combine(failures)
    }

    fn check(&self, req: &Request, att: &Attachment) -> Result<()> {
        let cfg = BridgeConfig::load(&req.conf, &req.env.args()?)?;
        let netns_path = podnet::netns_path(att)?;
        let (pod_ns, sandbox) = (podnet::open_netns(netns_path)?, netns_path.display().to_string());
        if let Some(ipam) = &cfg.ipam_type {
            lease::call(ipam, Command::Check, req)?;
        }
        let prev = req
            .conf
            .prev_result()?
            .ok_or_else(|| Error::invalid_config("Required prevResult missing"))?;
        let host_nl = Netlink::connect().map_err(netlink_error)?;
        let pod_nl = Netlink::connect_in(&pod_ns).map_err(netlink_error)?;

        let bridge = check_bridge(&host_nl, &cfg, &prev)?;
        let (index, container) = check_container(&pod_nl, &prev, &att.ifname, &sandbox)?;
        let host_veth = container
            .peer_index
            .and_then(|peer| host_nl.link_by_index(peer).ok().flatten())
            .filter(|veth| veth.kind == "veth" && veth.master == Some(bridge.index))
            .filter(|veth| {
                prev.interfaces
                    .iter()
                    .any(|i| i.name == veth.name && i.sandbox.is_empty())
            });
        if host_veth.is_none() {
            return Err(check_failed(format!(
                "CNI veth created for bridge {} was not found",
                cfg.bridge
            )));
        }

        let present = pod_nl.addresses(&container).map_err(netlink_error)?;
        let mine: Vec<IpNetwork> = prev
            .ips
            .iter()
            .filter(|ip| ip.interface == Some(index))
            .map(|ip| ip.address)
            .collect();
        if let Some(gone) = mine.iter().find(|a| !present.contains(a)) {
            return Err(check_failed(format!(
                "Failed to match addr {gone} on interface {}",
                att.ifname
            )));
        }
        for route in &prev.routes {
            let routes = pod_nl.routes(route.dst.is_ipv4()).map_err(netlink_error)?;
            let dst = netlink::route::network_of(route.dst);
            let found = routes.iter().any(|r| {
                r.dst == dst && r.oif == Some(container.index) && (route.gw.is_none() || r.gw == route.gw)
            });
            if !found {
                return Err(check_failed(format!(
                    "Failed to match route {} on interface {}",
                    route.dst, att.ifname
                )));
            }
        }
        if cfg.ip_masq && !mine.is_empty() {
            rules::check(&cfg, &req.conf.name, &mine)?;
        }
        if cfg.macspoofchk {
            let allowed = spoofcheck::allowed_mac(&spoofcheck::reference_id(&att.container_id, &att.ifname))
                .map_err(firewall_error)?;
            if !allowed.is_some_and(|mac| mac.eq_ignore_ascii_case(&container.mac)) {
                return Err(check_failed(format!(
                    "MAC spoof check rules for {} are missing",
                    att.ifname
                )));
            }
        }
        Ok(())
    }

    fn gc(&self, req: &Request) -> Result<()> {
        let cfg = BridgeConfig::load(&req.conf, &req.env.args()?)?;
        let valid = req.conf.gc_valid_attachments()?;
        let mut failures = Vec::new();
        if let Some(ipam) = &cfg.ipam_type
            && let Err(e) = lease::call(ipam, Command::Gc, req)
        {
            failures.push(e);
        }
        // Rules may outlive a configuration that stopped masquerading.
        if let Err(e) = rules::collect_garbage(&req.conf.name, &valid) {
            failures.push(e);
        }
        combine(failures)
    }

    fn status(&self, req: &Request) -> Result<()> {
        let cfg = BridgeConfig::load(&req.conf, &req.env.args()?)?;
        match &cfg.ipam_type {
            Some(ipam) => lease::call(ipam, Command::Status, req).map(drop),
            None => Ok(()),
        }
    }
}

/// Deletes the container end (the host end goes with it); a namespace or
/// interface already gone is fine. The kernel's share is logged at debug:
/// it is most of a DEL, varies from call to call by tens of milliseconds
/// (RCU grace periods, in scheduler ticks), and is what an operator asking
/// "why was this DEL slow" needs to see.
fn remove_container_link(netns: &std::path::Path, ifname: &str) -> Result<()> {
    let Some(ns) = podnet::open_netns_unless_gone(netns)? else {
        return Ok(());
    };
    let nl = Netlink::connect_in(&ns).map_err(netlink_error)?;
    let started = std::time::Instant::now();
    if nl.delete_link_named(ifname).map_err(netlink_error)? {
        // `make bench` reads this line: keep its words.
        log::debug!(
            "the kernel took {:.3} ms to delete {ifname}",
            started.elapsed().as_secs_f64() * 1000.0
        );
    }
    Ok(())
}

fn families_of(addresses: &[IpNetwork]) -> Vec<Family> {
    let families: std::collections::BTreeSet<Family> = addresses.iter().map(Family::of).collect();
    families.into_iter().collect()
}

fn check_bridge(nl: &Netlink, cfg: &BridgeConfig, prev: &CniResult) -> Result<Link> {
    let missing = || {
        check_failed(format!(
            "CNI created bridge {} in host namespace was not found",
            cfg.bridge
        ))
    };
    let listed = prev
        .interfaces
        .iter()
        .find(|i| i.name == cfg.bridge && i.sandbox.is_empty())
        .ok_or_else(missing)?;
    let bridge = nl
        .link_by_name(&cfg.bridge)
        .map_err(netlink_error)?
        .ok_or_else(missing)?;
    if bridge.kind != "bridge" {
        return Err(check_failed(format!(
            "Interface {} does not have link type of bridge",
            cfg.bridge
        )));
    }
    if !listed.mac.is_empty() && !listed.mac.eq_ignore_ascii_case(&bridge.mac) {
        return Err(check_failed(format!(
            "Bridge interface {} Mac doesn't match: {}",
            cfg.bridge, listed.mac
        )));
    }
    if cfg.promisc && !bridge.promisc {
        return Err(check_failed(format!(
            "Bridge interface {} is not in promiscuous mode",
            cfg.bridge
        )));
    }
    Ok(bridge)
}

/// The container interface of the result and its link; returns its index in
/// the result.
fn check_container(nl: &Netlink, prev: &CniResult, ifname: &str, sandbox: &str) -> Result<(usize, Link)> {
    let missing = || check_failed(format!("CNI created interface in container {ifname} not found"));
    let (index, listed) = prev
        .interfaces
        .iter()
        .enumerate()
        .find(|(_, i)| i.name == ifname && i.sandbox == sandbox)
        .ok_or_else(missing)?;
    let link = nl
        .link_by_name(ifname)
        .map_err(netlink_error)?
        .ok_or_else(missing)?;
    if link.kind != "veth" {
        return Err(check_failed(format!(
            "Error: Container interface {ifname} not of type veth"
        )));
    }
    if !listed.mac.is_empty() && !listed.mac.eq_ignore_ascii_case(&link.mac) {
        return Err(check_failed(format!(
            "Interface {ifname} Mac {} doesn't match container Mac: {}",
            listed.mac, link.mac
        )));
    }
    Ok((index, link))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn cfg(extra: serde_json::Value) -> BridgeConfig {
        let mut doc =
            json!({"cniVersion": "1.0.0", "name": "net", "type": "bridge", "ipam": {"type": "host-local"}});
        if let (Some(d), serde_json::Value::Object(e)) = (doc.as_object_mut(), extra) {
            d.extend(e);
        }
        let conf = NetConf::from_document(doc, cni::Version::V1_0_0).expect("conf");
        BridgeConfig::load(&conf, &cni::CniArgs::default()).expect("valid")
    }

    fn leased(json: serde_json::Value) -> CniResult {
        CniResult::from_value(&json).expect("result")
    }

    #[test]
    fn gateway_computed_when_the_bridge_is_the_gateway() {
        let ipam = leased(json!({"ips": [{"address": "10.1.0.5/16"}]}));
        let plain = plan_l3(&cfg(json!({})), &ipam);
        assert_eq!(plain.ips[0].gateway, None);
        assert!(plain.bridge_addresses.is_empty());
        let gw = plan_l3(&cfg(json!({"isGateway": true})), &ipam);
        assert_eq!(gw.ips[0].gateway, Some("10.1.0.1".parse().expect("ip")));
        assert_eq!(gw.ips[0].interface, Some(2));
        assert_eq!(
            gw.bridge_addresses,
            ["10.1.0.1/16".parse::<IpNetwork>().expect("cidr")]
        );
        assert!(gw.routes.is_empty());
    }

    #[test]
    fn default_gateway_adds_default_routes_per_family() {
        let ipam = leased(
            json!({"ips": [{"address": "10.1.0.5/16", "gateway": "10.1.0.254"}, {"address": "fd00::5/64"}],
                                  "routes": [{"dst": "192.168.0.0/16"}]}),
        );
        let plan = plan_l3(&cfg(json!({"isDefaultGateway": true})), &ipam);
        let routes: Vec<(String, Option<String>)> = plan
            .routes
            .iter()
            .map(|r| (r.dst.to_string(), r.gw.map(|g| g.to_string())))
            .collect();
        assert_eq!(
            routes,
            [
                ("192.168.0.0/16".to_owned(), None),
                ("0.0.0.0/0".to_owned(), Some("10.1.0.254".to_owned())),
                ("::/0".to_owned(), Some("fd00::1".to_owned())),
            ]
        );
        assert_eq!(plan.gateways.v4, Some("10.1.0.254".parse().expect("ip")));
    }

    #[test]
    fn an_ipam_default_route_with_a_gateway_is_kept_alone() {
        let ipam = leased(
            json!({"ips": [{"address": "10.1.0.5/16"}], "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.9"}]}),
        );
        let plan = plan_l3(&cfg(json!({"isDefaultGateway": true})), &ipam);
        assert_eq!(plan.routes.len(), 1);
        let without_gw =
            leased(json!({"ips": [{"address": "10.1.0.5/16"}], "routes": [{"dst": "0.0.0.0/0"}]}));
        assert_eq!(
            plan_l3(&cfg(json!({"isDefaultGateway": true})), &without_gw)
                .routes
                .len(),
            2
        );
    }
}
