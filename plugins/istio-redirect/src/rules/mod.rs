//! Istio's sidecar traffic capture, rendered rule for rule as Istio's CNI
//! plugin programs it (`tools/istio-iptables` in CNI mode), in the canonical
//! form `iptables-save` prints, so a pod's rules compare line for line with
//! Istio's listings and a re-run can tell "already there" from "different".
//!
//! Rendering is pure: [`Redirect`] settings and an address family in,
//! `iptables-restore` text out.

pub mod ambient;
pub mod apply;
pub mod backend;
pub mod nft;
mod redirect;
mod render;

pub use backend::{CaptureBackend, Outcome};
pub use redirect::*;

pub use nft::{NftCapture, render_nft};
pub use render::{IstioRules, render};

use firewall::{Family, Result};
use netns::NetNs;

/// Whether `ns` holds Istio's capture, wherever istio-redirect may have
/// programmed it: Istio's native nftables tables, or Istio chains and
/// rules in the iptables flavours it could have used there. IPv4 alone is
/// read: it is programmed whenever anything is, IPv6 only besides it.
pub fn captured(ns: &NetNs) -> Result<bool> {
    if nft::has_istio_tables(ns)? {
        return Ok(true);
    }
    for flavour in apply::readable_flavours(ns, Family::V4)? {
        if apply::read(ns, Family::V4, flavour)?.has_istio() {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod golden;
