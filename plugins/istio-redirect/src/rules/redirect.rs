//! What shapes a pod's capture: Istio's ports and marks, and the
//! [`Redirect`] settings read from the configuration and the pod.

use firewall::Family;
use ipnetwork::IpNetwork;

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
