//! The interface both FORWARD backends implement, and what they are given.

use std::net::IpAddr;

use firewall::Result;

/// The attachment a rule belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pod<'a> {
    pub network: &'a str,
    pub container_id: &'a str,
    pub ifname: &'a str,
}

/// One pod's rules as its configuration asks for them.
#[derive(Debug, Clone, Copy)]
pub struct PodRules<'a> {
    pub pod: Pod<'a>,
    /// Its addresses, of both families.
    pub ips: &'a [IpAddr],
    /// `iptablesAdminChainName`.
    pub admin_chain: &'a str,
    /// The bridge to isolate (`ingressPolicy: same-bridge`).
    pub bridge: Option<&'a str>,
}

/// One way of programming the FORWARD path (upstream's `FirewallBackend`),
/// chosen once from the configuration for ADD and CHECK; DEL and GC clean
/// up in both, whatever the configuration says now.
pub trait FirewallBackend {
    /// Leaves the pod's rules complete.
    fn add(&self, rules: &PodRules) -> Result<()>;

    /// What the pod's rules lack.
    fn check(&self, rules: &PodRules) -> Result<Vec<String>>;
}
