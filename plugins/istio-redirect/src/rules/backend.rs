//! The interface both ways of programming the capture implement.

use firewall::{Family, Result};
use netns::NetNs;

use super::redirect::Redirect;

/// What applying did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    Unchanged,
    Replaced,
}

/// One way of programming a pod's capture, chosen once from the
/// configuration: Istio's iptables rules (`apply::IptablesCapture`, in
/// the flavour the operator forces or the one found in the pod), or
/// Istio's native nftables tables (`nft::NftablesCapture`).
pub trait CaptureBackend {
    /// Programs the capture of `families` in `ns`; what each transaction
    /// did, named.
    fn program(&self, ns: &NetNs, redirect: &Redirect, families: &[Family])
    -> Result<Vec<(String, Outcome)>>;

    /// The expected rules the pod lacks.
    fn missing(&self, ns: &NetNs, redirect: &Redirect, families: &[Family]) -> Result<Vec<String>>;
}
