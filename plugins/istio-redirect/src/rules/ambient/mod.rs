//! Istio's ambient in-pod redirection: what Istio's node agent programs
//! inside an enrolled pod's network namespace so that the pod's TCP goes
//! through ztunnel's listeners in that same namespace (outbound to 15001,
//! inbound plaintext to 15006, HBONE straight to 15008, DNS to 15053), and
//! ztunnel's own marked packets pass untouched.
//!
//! Rendering is pure, as for the sidecar capture: [`InPod`] settings and an
//! address family in, the canonical `iptables-save` form out, so a pod's
//! rules compare line for line with what the kernel lists.
//!
//! The marks must match ztunnel's: it marks its own sockets with
//! [`INPOD_MARK`] (its `PACKET_MARK`), and connections it accepted keep
//! [`INPOD_TPROXY_MARK`] as a connmark, routed back through table
//! [`INBOUND_ROUTE_TABLE`].

use std::net::{Ipv4Addr, Ipv6Addr};

use firewall::Family;
use netlink::Netlink;
use netlink::route::FwmarkRule;
use netns::NetNs;

use super::Outcome;
use super::apply::{IptablesFlavour, apply, flavour_for, remove};
use super::nft::apply_nft;
use super::render::{Builder, IstioRules};

/// ztunnel's outbound listener in the pod.
pub const ZTUNNEL_OUTBOUND_PORT: u16 = 15001;
/// ztunnel's inbound plaintext listener.
pub const ZTUNNEL_INBOUND_PLAINTEXT_PORT: u16 = 15006;
/// ztunnel's inbound HBONE listener: reached directly, never redirected.
pub const ZTUNNEL_INBOUND_PORT: u16 = 15008;
/// ztunnel's DNS proxy.
pub const ZTUNNEL_DNS_PORT: u16 = 15053;
/// The mark ztunnel puts on its own packets (Istio's `InpodMark`, 1337).
pub const INPOD_MARK: u32 = 0x539;
/// The connmark of connections ztunnel accepted (Istio's `InpodTProxyMark`).
pub const INPOD_TPROXY_MARK: u32 = 0x111;
/// The bits of the mark both use.
pub const INPOD_MASK: u32 = 0xfff;
/// The masks of the connmark restore.
pub const INPOD_RESTORE_MASK: u32 = 0xffff_ffff;
/// The routing table that delivers [`INPOD_TPROXY_MARK`]ed packets locally.
pub const INBOUND_ROUTE_TABLE: u32 = 100;
/// The priority of the `ip rule` that selects [`INBOUND_ROUTE_TABLE`].
pub const INPOD_RULE_PRIORITY: u32 = 32764;
/// The source the node gives kubelet's probes of enrolled pods, so the pod
/// can tell them from other node traffic (Istio's `HOST_PROBE_SNAT_IP`).
pub const PROBE_SNAT_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 127);
/// Its IPv6 twin (`HOST_PROBE_SNAT_IPV6`).
pub const PROBE_SNAT_V6: Ipv6Addr =
    Ipv6Addr::new(0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff);

const PRERT: &str = "ISTIO_PRERT";
const OUTPUT: &str = "ISTIO_OUTPUT";

/// What a pod's annotations say about its own redirection (Istio's
/// pod-level traffic overrides); the default is no say at all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodOverrides {
    /// `ambient.istio.io/bypass-inbound-capture`: inbound traffic is not
    /// redirected (for ingress-type pods); outbound still is.
    pub bypass_inbound: bool,
    /// `ambient.istio.io/dns-capture`; `None` follows the node's setting.
    pub dns_capture: Option<bool>,
    /// `istio.io/reroute-virtual-interfaces`: inbound TCP arriving on these
    /// is treated as the pod's own outbound (KubeVirt, DinD).
    pub virtual_interfaces: Vec<String>,
}

/// Everything that shapes one pod's in-pod rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InPod {
    pub redirect_dns: bool,
    pub bypass_inbound: bool,
    pub virtual_interfaces: Vec<String>,
    pub probe_snat_v4: Ipv4Addr,
    pub probe_snat_v6: Ipv6Addr,
}

impl InPod {
    /// A pod's settings: the node's DNS capture unless the pod says
    /// otherwise, and the node's probe source addresses.
    pub fn new(node_dns_capture: bool, pod: &PodOverrides) -> Self {
        InPod {
            redirect_dns: pod.dns_capture.unwrap_or(node_dns_capture),
            bypass_inbound: pod.bypass_inbound,
            virtual_interfaces: pod.virtual_interfaces.clone(),
            probe_snat_v4: PROBE_SNAT_V4,
            probe_snat_v6: PROBE_SNAT_V6,
        }
    }
}

/// The rules Istio's node agent programs in an enrolled pod for one
/// family: mangle and nat always, raw when DNS is captured.
pub fn render_in_pod(in_pod: &InPod, family: Family) -> IstioRules {
    let (loopback, probe) = match family {
        Family::V4 => ("127.0.0.1/32", format!("{}/32", in_pod.probe_snat_v4)),
        Family::V6 => ("::1/128", format!("{}/128", in_pod.probe_snat_v6)),
    };
    let mark = format!("{INPOD_MARK:#x}/{INPOD_MASK:#x}");
    let accepted = format!("{INPOD_TPROXY_MARK:#x}/{INPOD_MASK:#x}");
    let not_ztunnel = format!("-m mark ! --mark {mark}");

    let mut mangle = hooked();
    mangle.append(
        PRERT,
        format!("-m mark --mark {mark} -j CONNMARK --set-xmark {accepted}"),
    );
    mangle.append(
        OUTPUT,
        format!(
            "-m connmark --mark {accepted} -j CONNMARK --restore-mark \
             --nfmask {INPOD_RESTORE_MASK:#x} --ctmask {INPOD_RESTORE_MASK:#x}"
        ),
    );

    let mut nat = hooked();
    for iface in &in_pod.virtual_interfaces {
        nat.append(
            PRERT,
            format!("-i {iface} -p tcp -j REDIRECT --to-ports {ZTUNNEL_OUTBOUND_PORT}"),
        );
        nat.append(PRERT, format!("-i {iface} -p tcp -j RETURN"));
    }
    if !in_pod.bypass_inbound {
        nat.append(PRERT, format!("-s {probe} -p tcp -m tcp -j ACCEPT"));
        nat.append(
            PRERT,
            format!(
                "! -d {loopback} -p tcp -m tcp ! --dport {ZTUNNEL_INBOUND_PORT} {not_ztunnel} \
                 -j REDIRECT --to-ports {ZTUNNEL_INBOUND_PLAINTEXT_PORT}"
            ),
        );
    }
    // The probe's answers leave the pod as they came in.
    nat.append(OUTPUT, format!("-d {probe} -p tcp -m tcp -j ACCEPT"));
    let mut raw = None;
    if in_pod.redirect_dns {
        nat.append(
            OUTPUT,
            format!(
                "! -o lo -p udp {not_ztunnel} -m udp --dport 53 -j REDIRECT --to-ports {ZTUNNEL_DNS_PORT}"
            ),
        );
        nat.append(
            OUTPUT,
            format!(
                "! -d {loopback} -p tcp -m tcp --dport 53 {not_ztunnel} -j REDIRECT --to-ports {ZTUNNEL_DNS_PORT}"
            ),
        );
        // ztunnel's own queries and their answers get a conntrack zone of
        // their own, so they never collide with the pod's (istio#33469).
        let mut zones = hooked();
        zones.append(
            OUTPUT,
            format!("-p udp -m mark --mark {mark} -m udp --dport 53 -j CT --zone 1"),
        );
        zones.append(
            PRERT,
            format!("-p udp {not_ztunnel} -m udp --sport 53 -j CT --zone 1"),
        );
        raw = zones.finish("raw");
    }
    nat.append(OUTPUT, format!("-p tcp -m mark --mark {accepted} -j ACCEPT"));
    // The pod reaching itself over lo by its own address stays local.
    nat.append(OUTPUT, format!("! -d {loopback} -o lo -j ACCEPT"));
    nat.append(
        OUTPUT,
        format!("! -d {loopback} -p tcp {not_ztunnel} -j REDIRECT --to-ports {ZTUNNEL_OUTBOUND_PORT}"),
    );
    IstioRules {
        tables: [mangle.finish("mangle"), nat.finish("nat"), raw]
            .into_iter()
            .flatten()
            .collect(),
    }
}

/// A table with both Istio chains declared and hooked from PREROUTING and
/// OUTPUT, as every in-pod table is.
fn hooked() -> Builder {
    let mut table = Builder::default();
    table.declare(PRERT);
    table.declare(OUTPUT);
    table.append("PREROUTING", format!("-j {PRERT}"));
    table.append("OUTPUT", format!("-j {OUTPUT}"));
    table
}

/// `ip rule add fwmark 0x111/0xfff pref 32764 lookup 100`: what ztunnel
/// accepted is answered through the table of the local route.
pub const INPOD_RULE: FwmarkRule = FwmarkRule {
    mark: INPOD_TPROXY_MARK,
    mask: Some(INPOD_MASK),
    table: INBOUND_ROUTE_TABLE,
    priority: Some(INPOD_RULE_PRIORITY),
};

#[derive(Debug, thiserror::Error)]
pub enum InPodError {
    #[error("in-pod rules: {0}")]
    Rules(#[from] firewall::Error),
    #[error("in-pod routing: {0}")]
    Routing(#[from] netlink::Error),
}

/// How the in-pod rules are written, chosen once for the node (Istio's
/// `NATIVE_NFTABLES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InPodBackend {
    /// iptables rules, in the flavour forced or else the one the pod has.
    Iptables(Option<IptablesFlavour>),
    /// Istio's `inet istio-ambient-*` tables, both families in one
    /// transaction.
    Nftables,
}

/// Programs `in_pod` in the pod's namespace `ns` for `families`, in
/// Istio's order: the local route, the mark's rule, then the rules (one
/// transaction per family with iptables, one for both with nftables);
/// what each transaction did. Every step is idempotent, so a second
/// enrolment of the pod (an agent restarted, the same event twice)
/// converges instead of failing.
pub fn program(
    ns: &NetNs,
    in_pod: &InPod,
    families: &[Family],
    backend: InPodBackend,
) -> Result<Vec<(String, Outcome)>, InPodError> {
    let nl = Netlink::connect_in(ns)?;
    let lo = nl.require_link("lo")?;
    for family in families {
        let v4 = *family == Family::V4;
        nl.add_local_default_route(v4, &lo, INBOUND_ROUTE_TABLE)?;
        nl.add_fwmark_rule(v4, &INPOD_RULE)?;
    }
    let forced = match backend {
        InPodBackend::Nftables => {
            let tables = nft::render_in_pod_nft(in_pod, families.contains(&Family::V6));
            return Ok(vec![("nftables".to_owned(), apply_nft(ns, &tables)?)]);
        }
        InPodBackend::Iptables(forced) => forced,
    };
    let mut outcomes = Vec::new();
    for family in families {
        let flavour = flavour_for(ns, *family, forced)?;
        outcomes.push((
            format!("{family:?}"),
            apply(ns, *family, &render_in_pod(in_pod, *family), flavour)?,
        ));
    }
    Ok(outcomes)
}

/// Takes the in-pod redirection out of the pod's namespace `ns` (a pod
/// that left the mesh while it runs): each family's Istio iptables rules
/// in one transaction and the nftables tables in another, whichever
/// backend wrote them (a node switched between them converges), then the
/// mark's rule and the local route; whether any rules were there. Like
/// [`program`], it converges.
pub fn unprogram(
    ns: &NetNs,
    families: &[Family],
    forced: Option<IptablesFlavour>,
) -> Result<bool, InPodError> {
    let mut removed = nft::remove_in_pod_tables(ns)?;
    for family in families {
        removed |= remove(ns, *family, flavour_for(ns, *family, forced)?)?;
    }
    let nl = Netlink::connect_in(ns)?;
    let lo = nl.require_link("lo")?;
    for family in families {
        let v4 = *family == Family::V4;
        nl.del_fwmark_rule(v4, &INPOD_RULE)?;
        nl.del_local_default_route(v4, &lo, INBOUND_ROUTE_TABLE)?;
    }
    Ok(removed)
}

pub mod nft;

#[cfg(test)]
mod golden;
