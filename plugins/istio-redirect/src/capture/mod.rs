//! Istio's sidecar traffic capture, rendered rule for rule as Istio's CNI
//! plugin programs it (`tools/istio-iptables` in CNI mode), in the canonical
//! form `iptables-save` prints, so a pod's rules compare line for line with
//! Istio's listings and a re-run can tell "already there" from "different".
//!
//! Rendering is pure: [`Redirect`] settings and an address family in,
//! `iptables-restore` text out.

pub mod apply;
pub mod nft;
mod render;

/// One way of programming a pod's capture, chosen once from the
/// configuration: Istio's iptables rules ([`apply::IptablesCapture`], in
/// the flavour the operator forces or the one found in the pod), or
/// Istio's native nftables tables ([`nft::NftablesCapture`]).
pub trait CaptureBackend {
    /// Programs the capture of `families` in `ns`; what each transaction
    /// did, named.
    fn program(
        &self,
        ns: &NetNs,
        redirect: &Redirect,
        families: &[Family],
    ) -> Result<Vec<(String, apply::Outcome)>>;

    /// The expected rules the pod lacks.
    fn missing(&self, ns: &NetNs, redirect: &Redirect, families: &[Family]) -> Result<Vec<String>>;
}

pub use nft::{NftCapture, render_nft};
pub use render::{IstioRules, render};

use firewall::{Family, Result};
use ipnetwork::IpNetwork;
use netns::NetNs;

/// Envoy's outbound listener.
pub const OUTBOUND_PORT: u16 = 15001;
/// Envoy's inbound listener.
pub const INBOUND_PORT: u16 = 15006;
/// HBONE tunnel port, served by Envoy directly.
pub const TUNNEL_PORT: u16 = 15008;
/// pilot-agent's status port.
pub const STATUS_PORT: u16 = 15020;
/// The agent's DNS proxy.
pub const DNS_PORT: u16 = 15053;
/// Ports never captured inbound, whatever the annotations say.
pub const ALWAYS_EXCLUDED_INBOUND: [u16; 3] = [15020, 15021, 15090];
/// TPROXY mark and routing table.
pub const TPROXY_MARK: u32 = 1337;
pub const TPROXY_TABLE: u32 = 133;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Redirect,
    Tproxy,
}

/// `*`, or an explicit list (possibly empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection<T> {
    All,
    Only(Vec<T>),
}

/// Everything that shapes a pod's capture rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirect {
    pub mode: Mode,
    pub include_cidrs: Selection<IpNetwork>,
    pub exclude_cidrs: Vec<IpNetwork>,
    /// `Only(empty)` disables inbound capture.
    pub include_inbound_ports: Selection<u16>,
    /// Already with 15020, 15021, 15090 appended.
    pub exclude_inbound_ports: Vec<u16>,
    pub include_outbound_ports: Vec<u16>,
    pub exclude_outbound_ports: Vec<u16>,
    pub exclude_interfaces: Vec<String>,
    pub reroute_interfaces: Vec<String>,
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    pub dns_capture: bool,
    pub invalid_drop: bool,
    pub dual_stack: bool,
}

impl Default for Redirect {
    /// A default injected pod.
    fn default() -> Self {
        Redirect {
            mode: Mode::Redirect,
            include_cidrs: Selection::All,
            exclude_cidrs: Vec::new(),
            include_inbound_ports: Selection::All,
            exclude_inbound_ports: ALWAYS_EXCLUDED_INBOUND.to_vec(),
            include_outbound_ports: Vec::new(),
            exclude_outbound_ports: vec![STATUS_PORT],
            exclude_interfaces: Vec::new(),
            reroute_interfaces: Vec::new(),
            proxy_uid: 1337,
            proxy_gid: 1337,
            dns_capture: false,
            invalid_drop: false,
            dual_stack: false,
        }
    }
}

/// A CIDR as iptables-save and nft print it: the network address, never
/// the host bits a user wrote.
pub(crate) fn cidr(net: &IpNetwork) -> String {
    format!("{}/{}", net.network(), net.prefix())
}

impl Redirect {
    pub fn captures_inbound(&self) -> bool {
        !matches!(&self.include_inbound_ports, Selection::Only(ports) if ports.is_empty())
    }

    /// Include CIDRs of one family (`None` for `*`).
    pub(crate) fn includes_of(&self, family: Family) -> Option<Vec<IpNetwork>> {
        match &self.include_cidrs {
            Selection::All => None,
            Selection::Only(list) => Some(list.iter().filter(|c| Family::of(c) == family).copied().collect()),
        }
    }
}

/// Whether `ns` holds Istio's capture, wherever istio-redirect may have
/// programmed it: Istio's native nftables tables, or Istio chains and
/// rules in the iptables flavours it could have used there. IPv4 alone is
/// read: it is programmed whenever anything is, IPv6 only besides it.
pub fn captured(ns: &NetNs) -> Result<bool> {
    if nft::has_istio_tables(ns)? {
        return Ok(true);
    }
    for backend in apply::backends_to_read(ns, Family::V4)? {
        if apply::read(ns, Family::V4, backend)?.has_istio() {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod golden;
