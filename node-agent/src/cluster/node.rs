//! What the agent reads of the cluster's Nodes: each one's pod CIDRs and
//! InternalIPs, by name. The Node watch keeps it; the conflist, the routes
//! and the masquerade are made from it.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnetwork::IpNetwork;
use k8s_openapi::api::core::v1::Node;

/// What the agent reads from a Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `spec.podCIDRs`, or `spec.podCIDR` when that list is empty (as
    /// kindnetd reads them); unparsable entries are skipped and logged.
    pub pod_cidrs: Vec<IpNetwork>,
    /// `status.addresses` of type InternalIP.
    pub internal_ips: Vec<IpAddr>,
}

impl NodeInfo {
    pub fn from_node(node: &Node) -> Option<NodeInfo> {
        let name = node.metadata.name.clone()?;
        let spec = node.spec.as_ref();
        let listed: Vec<String> = spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default();
        let texts = if listed.is_empty() {
            spec.and_then(|s| s.pod_cidr.clone()).into_iter().collect()
        } else {
            listed
        };
        let pod_cidrs = texts
            .iter()
            .filter_map(|text| match text.parse::<IpNetwork>() {
                Ok(cidr) => Some(netlink::route::network_of(cidr)),
                Err(e) => {
                    log::warn!("node {name}: pod CIDR {text:?} is not a network: {e}");
                    None
                }
            })
            .collect();
        let internal_ips = node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse().ok())
            .collect();
        Some(NodeInfo {
            name,
            pod_cidrs,
            internal_ips,
        })
    }
}

/// Every Node the agent knows of, by name.
pub type Nodes = BTreeMap<String, NodeInfo>;
