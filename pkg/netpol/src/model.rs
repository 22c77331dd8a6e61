//! What NetworkPolicy is computed from: the pods, namespaces and policies
//! the agent watches, reduced to the fields the policy semantics read, and
//! label selectors as Kubernetes matches them.

use std::net::IpAddr;

use ipnetwork::IpNetwork;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

pub use labels::{Labels, Selector};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// The API's name (`TCP` when absent, as the API server defaults it);
    /// `None` for a protocol NetworkPolicy does not know.
    pub fn parse(name: Option<&str>) -> Option<Protocol> {
        match name.unwrap_or("TCP") {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// Its IP protocol number (`meta l4proto`).
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// nftables' keyword.
    pub fn keyword(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

/// A container port with a name, which policies may name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

/// A pod as policy sees it: pods of their own network (not
/// `hostNetwork`) that have not finished (a finished pod's address is free
/// for another). One whose status has no address yet is kept, with none:
/// the node agent learns its addresses from its ADD first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub namespace: String,
    pub name: String,
    pub node: Option<String>,
    pub labels: Labels,
    pub ips: Vec<IpAddr>,
    pub ports: Vec<NamedPort>,
}

/// The addresses a Pod's status gives it (`podIPs`, or `podIP` alone as
/// older kubelets write it).
pub fn status_ips(pod: &Pod) -> Vec<IpAddr> {
    let status = pod.status.as_ref();
    let mut ips: Vec<IpAddr> = status
        .and_then(|s| s.pod_ips.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.ip.parse().ok())
        .collect();
    if ips.is_empty() {
        ips.extend(
            status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse::<IpAddr>().ok()),
        );
    }
    ips
}

impl PodView {
    pub fn from_pod(pod: &Pod) -> Option<PodView> {
        let spec = pod.spec.as_ref()?;
        if spec.host_network == Some(true) {
            return None;
        }
        let status = pod.status.as_ref();
        if matches!(
            status.and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        ) {
            return None;
        }
        let ips = status_ips(pod);
        let ports = spec
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|p| {
                Some(NamedPort {
                    name: p.name.clone()?,
                    protocol: Protocol::parse(p.protocol.as_deref())?,
                    port: u16::try_from(p.container_port).ok()?,
                })
            })
            .collect();
        Some(PodView {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            node: spec.node_name.clone(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            ips,
            ports,
        })
    }

    /// The number a port name stands for in this pod, for `protocol`.
    pub fn named_port(&self, name: &str, protocol: Protocol) -> Option<u16> {
        self.ports
            .iter()
            .find(|p| p.name == name && p.protocol == protocol)
            .map(|p| p.port)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceView {
    pub name: String,
    pub labels: Labels,
}

impl NamespaceView {
    pub fn from_namespace(namespace: &Namespace) -> NamespaceView {
        NamespaceView {
            name: namespace.metadata.name.clone().unwrap_or_default(),
            labels: namespace.metadata.labels.clone().unwrap_or_default(),
        }
    }
}

/// A selector of the API's objects, as [`labels::Selector::lenient`]
/// reads it (the API server accepted it already).
pub fn selector(selector: &LabelSelector) -> Selector {
    let expressions = selector
        .match_expressions
        .iter()
        .flatten()
        .map(|e| labels::Expression {
            key: e.key.clone(),
            operator: e.operator.clone(),
            values: e.values.clone(),
        });
    Selector::lenient(&labels::LabelSelector {
        match_labels: selector.match_labels.clone(),
        match_expressions: Some(expressions.collect()),
    })
}

/// Who a rule allows to talk to or from the selected pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// Pods: by `podSelector` in the policy's namespace, by
    /// `namespaceSelector` (all their pods), or both.
    Pods {
        pods: Option<Selector>,
        namespaces: Option<Selector>,
    },
    /// Addresses: `cidr` but `except`.
    Block { cidr: IpNetwork, except: Vec<IpNetwork> },
}

/// A port a rule allows: one number, a range (`endPort`), a name resolved
/// per pod, or every port of the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortSpec {
    All(Protocol),
    Range(Protocol, u16, u16),
    Named(Protocol, String),
}

/// One ingress or egress rule. `peers: None` allows every peer (an absent
/// or empty `from`/`to`), empty `ports` every port and protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub peers: Option<Vec<Peer>>,
    pub ports: Vec<PortSpec>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub namespace: String,
    pub name: String,
    pub pod_selector: Selector,
    /// `Some` when the policy isolates its pods for ingress: the rules
    /// (none: everything denied).
    pub ingress: Option<Vec<Rule>>,
    pub egress: Option<Vec<Rule>>,
}

impl Policy {
    pub fn from_network_policy(policy: &NetworkPolicy) -> Policy {
        let spec = policy.spec.clone().unwrap_or_default();
        let types = spec.policy_types.clone().unwrap_or_default();
        // Unset `policyTypes` (the API server defaults it, a client may
        // not): Ingress always, Egress when there are egress rules.
        let (ingress_on, egress_on) = if types.is_empty() {
            (true, spec.egress.as_ref().is_some_and(|e| !e.is_empty()))
        } else {
            (
                types.iter().any(|t| t == "Ingress"),
                types.iter().any(|t| t == "Egress"),
            )
        };
        let ingress = ingress_on.then(|| {
            spec.ingress
                .iter()
                .flatten()
                .map(|r: &NetworkPolicyIngressRule| rule(r.from.as_deref(), r.ports.as_deref()))
                .collect()
        });
        let egress = egress_on.then(|| {
            spec.egress
                .iter()
                .flatten()
                .map(|r: &NetworkPolicyEgressRule| rule(r.to.as_deref(), r.ports.as_deref()))
                .collect()
        });
        Policy {
            namespace: policy.metadata.namespace.clone().unwrap_or_default(),
            name: policy.metadata.name.clone().unwrap_or_default(),
            pod_selector: selector(&spec.pod_selector.unwrap_or_default()),
            ingress,
            egress,
        }
    }
}

fn rule(peers: Option<&[NetworkPolicyPeer]>, ports: Option<&[NetworkPolicyPort]>) -> Rule {
    let peers = peers
        .filter(|p| !p.is_empty())
        .map(|peers| peers.iter().filter_map(peer).collect());
    let given = ports.unwrap_or_default();
    let ports: Vec<PortSpec> = given.iter().filter_map(port).collect();
    // Ports none of which can be read allow nothing, not every port (what
    // no ports at all would mean): unreadable input never widens a rule.
    if ports.is_empty() && !given.is_empty() {
        return Rule {
            peers: Some(Vec::new()),
            ports,
        };
    }
    Rule { peers, ports }
}

fn peer(peer: &NetworkPolicyPeer) -> Option<Peer> {
    if let Some(block) = &peer.ip_block {
        // An exception that cannot be read drops the block rather than
        // widen it.
        let except = block
            .except
            .iter()
            .flatten()
            .map(|e| e.parse().ok())
            .collect::<Option<Vec<IpNetwork>>>()?;
        return Some(Peer::Block {
            cidr: block.cidr.parse().ok()?,
            except,
        });
    }
    if peer.pod_selector.is_none() && peer.namespace_selector.is_none() {
        return None;
    }
    Some(Peer::Pods {
        pods: peer.pod_selector.as_ref().map(selector),
        namespaces: peer.namespace_selector.as_ref().map(selector),
    })
}

fn port(port: &NetworkPolicyPort) -> Option<PortSpec> {
    let protocol = Protocol::parse(port.protocol.as_deref())?;
    Some(match &port.port {
        None => PortSpec::All(protocol),
        Some(IntOrString::String(name)) => match name.parse::<u16>() {
            Ok(number) => PortSpec::Range(protocol, number, number),
            Err(_) => PortSpec::Named(protocol, name.clone()),
        },
        Some(IntOrString::Int(number)) => {
            let first = u16::try_from(*number).ok()?;
            let last = port
                .end_port
                .and_then(|end| u16::try_from(end).ok())
                .filter(|end| *end >= first)
                .unwrap_or(first);
            PortSpec::Range(protocol, first, last)
        }
    })
}
