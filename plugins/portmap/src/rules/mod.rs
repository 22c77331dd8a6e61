//! Host port mappings (the `portmap` plugin's rules): a pod's
//! `containerPort` published on the node's `hostPort`.
//!
//! Two layouts behind one interface ([`PortMapper`]), each a pure renderer
//! and applied in one transaction per family: [`iptables`], the reference
//! plugin's chains and comments exactly (so ours and the reference's can
//! replace each other on a live node), and [`nft`], upstream's
//! `cni_hostport` tables.

use std::net::IpAddr;

use ipnetwork::IpNetwork;

use firewall::{Error, Family, Result};

pub mod iptables;
pub mod nft;

/// One way of publishing host ports (the reference's `PortMapper`), chosen
/// once from the configuration for ADD, CHECK and STATUS; DEL and GC
/// remove from both, whatever the configuration says now.
pub trait PortMapper {
    /// Publishes `mappings` for one family's pod address.
    fn add(&self, pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Result<()>;

    /// What the pod's rules of that family lack.
    fn missing(&self, pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Result<Vec<String>>;

    /// Whether its tools work on this node.
    fn usable(&self) -> bool;
}

/// The reference's default mark bit: Kubernetes uses 14 and 15, Calico
/// 20–31.
pub const DEFAULT_MARK_BIT: u8 = 13;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    // Declared in the order of their names: the reference sorts the
    // protocols' names when it writes the jump rules.
    Sctp,
    Tcp,
    Udp,
}

impl Protocol {
    /// Kubernetes and containerd send `TCP`/`tcp`; an empty protocol is
    /// Kubernetes' default, TCP.
    pub fn parse(text: &str) -> Result<Self> {
        match text.to_ascii_lowercase().as_str() {
            "" | "tcp" => Ok(Protocol::Tcp),
            "udp" => Ok(Protocol::Udp),
            "sctp" => Ok(Protocol::Sctp),
            other => Err(Error::Invalid(format!(
                "unsupported port mapping protocol {other:?} (tcp, udp or sctp)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }

    /// The IP protocol number, as conntrack keys flows.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }
}

/// One entry of `runtimeConfig.portMappings`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mapping {
    pub host_port: u16,
    pub container_port: u16,
    pub protocol: Protocol,
    pub host_ip: Option<IpAddr>,
}

impl Mapping {
    /// A mapping with a host IP applies only to the pod address of that
    /// IP's family (iptables does not translate across families).
    pub fn applies_to(&self, family: Family) -> bool {
        self.host_ip.is_none_or(|ip| family_of(ip) == family)
    }

    /// The node address the mapping is restricted to: none for `0.0.0.0`
    /// and `::`, which cannot be a destination.
    pub fn destination(&self) -> Option<IpAddr> {
        self.host_ip.filter(|ip| !ip.is_unspecified())
    }
}

pub fn family_of(ip: IpAddr) -> Family {
    if ip.is_ipv4() { Family::V4 } else { Family::V6 }
}

/// The plugin's settings, with the reference's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Masquerade hairpin traffic and traffic from the node's localhost.
    pub snat: bool,
    pub mark_bit: u8,
    /// Someone else's chain marks packets for masquerading (Kubernetes'
    /// `KUBE-MARK-MASQ`); ours are then not created.
    pub external_set_mark_chain: Option<String>,
    pub conditions_v4: Vec<String>,
    pub conditions_v6: Vec<String>,
    /// Masquerade every mapped connection, not only hairpin and localhost.
    pub masq_all: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            snat: true,
            mark_bit: DEFAULT_MARK_BIT,
            external_set_mark_chain: None,
            conditions_v4: Vec::new(),
            conditions_v6: Vec::new(),
            masq_all: false,
        }
    }
}

impl Settings {
    pub fn conditions(&self, family: Family) -> &[String] {
        match family {
            Family::V4 => &self.conditions_v4,
            Family::V6 => &self.conditions_v6,
        }
    }

    /// `0x2000/0x2000` for bit 13, as the reference writes it.
    pub fn mark(&self) -> String {
        let value = 1u32 << self.mark_bit;
        format!("{value:#x}/{value:#x}")
    }
}

/// The pod one family's rules are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pod<'a> {
    pub network: &'a str,
    pub container_id: &'a str,
    /// The pod's address of this family, with its prefix.
    pub address: IpNetwork,
}

impl Pod<'_> {
    pub fn family(&self) -> Family {
        Family::of(&self.address)
    }
}

/// One mapping as the rules of a pod hold it: what conntrack entries of a
/// removed mapping look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Forward {
    pub protocol: Protocol,
    pub host_port: u16,
    pub pod_ip: IpAddr,
    pub pod_port: u16,
}

/// `ip:port`, with IPv6 addresses bracketed.
pub fn ip_port(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    }
}

/// The forwards of `mappings` for a pod.
pub fn forwards(pod: &Pod, mappings: &[Mapping]) -> Vec<Forward> {
    mappings
        .iter()
        .filter(|m| m.applies_to(pod.family()))
        .map(|m| Forward {
            protocol: m.protocol,
            host_port: m.host_port,
            pod_ip: pod.address.ip(),
            pod_port: m.container_port,
        })
        .collect()
}
