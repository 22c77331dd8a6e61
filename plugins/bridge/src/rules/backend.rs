//! The interface both masquerade backends implement.

use std::collections::BTreeSet;

use firewall::Family;
use ipnetwork::IpNetwork;

/// One way of programming the bridge's masquerade (iptables or nftables),
/// chosen once by the caller from its configuration, as netavark chooses
/// its firewall driver. Rules are per (network, subnet); the per-container
/// rules are the reference plugin's layout, still removed for nodes that
/// ran it.
pub trait MasqueradeBackend {
    /// Leaves the masquerade of the subnets of `addresses` complete: made
    /// by the first pod of a subnet, found in-process by later ones,
    /// repaired in one batch when something removed part of it. Callers
    /// hold the node's lock, so nothing is doubled.
    fn ensure_network(&self, network: &str, addresses: &[IpNetwork]) -> firewall::Result<()>;

    /// Removes one pod's per-container rules, in `families` where the
    /// layout is per family. Returns whether there were any.
    fn teardown_container(
        &self,
        network: &str,
        container_id: &str,
        ifname: &str,
        families: &[Family],
    ) -> firewall::Result<bool>;

    /// Removes the per-container rules of `network` whose attachment,
    /// `(ifname, container ID)`, is not in `keep`; subnet rules stay.
    fn collect_garbage(&self, network: &str, keep: &BTreeSet<(String, String)>) -> firewall::Result<()>;

    /// Removes `network`'s subnet rules (once none of its attachments is
    /// valid).
    fn remove_network(&self, network: &str) -> firewall::Result<()>;

    /// What CHECK finds missing of the subnet rules for `addresses`.
    fn missing(&self, network: &str, addresses: &[IpNetwork]) -> firewall::Result<Vec<String>>;
}
