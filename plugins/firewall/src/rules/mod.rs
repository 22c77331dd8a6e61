//! The firewall plugin's rules: traffic to and from a pod is accepted in
//! the node's FORWARD path, whatever the node's own policy, and with the
//! `same-bridge` ingress policy pods on one bridge are cut off from pods
//! on another.
//!
//! - [`iptables`]: the reference plugin's layout, rule for rule (chains
//!   `CNI-FORWARD`, the admin chain, `CNI-ISOLATION-STAGE-1/2`, the same
//!   comments and order), so our plugin and Debian's can replace each
//!   other on a node. Its per-pod rules carry no comment there, so what
//!   belongs to a pod is known from its addresses only.
//! - [`nft`]: our own `inet cni_firewall` table, every rule commented, so a
//!   pod's rules are found by their comment.
//!
//! Renderers are pure: they take what the kernel holds (a [`iptables::Filter`]
//! or an [`nft::Table`]) and return one `iptables-restore --noflush` input
//! per family or one `nft -f` transaction, or nothing when nothing is
//! missing. What the kernel holds is read in-process over nfnetlink when
//! the rules live in nf_tables ([`chain_dump`]), so an ADD whose rules are in
//! place, or a DEL with nothing to remove, starts no process.

pub mod backend;
pub mod chain_dump;
pub mod iptables;
pub mod nft;

pub use backend::{FirewallBackend, Pod, PodRules};

/// The `ingressPolicy` values the reference (1.1.1) knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IngressPolicy {
    /// Everything may reach the pod (`""` or `"open"`).
    #[default]
    Open,
    /// Only pods on the pod's own bridge may reach it.
    SameBridge,
}

impl IngressPolicy {
    /// Parses the configuration's value; the error is the reference's.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "" | "open" => Ok(IngressPolicy::Open),
            "same-bridge" => Ok(IngressPolicy::SameBridge),
            other => Err(format!("unknown ingress policy: {other:?}")),
        }
    }
}
