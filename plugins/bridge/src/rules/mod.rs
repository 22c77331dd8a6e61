//! The bridge's masquerade of what its pods send off the node: two
//! backends behind one interface ([`MasqueradeBackend`]: [`iptables`], the
//! reference's layout, and [`nft`], upstream's nftables table), chosen once
//! from the configuration; the verbs use the configured one first and
//! clean up in both, mapped to CNI errors here.

use std::collections::BTreeSet;

use cni::conf::GcAttachment;
use cni::{Attachment, Error, Result};
use firewall::{Backend, Family};
use ipnetwork::IpNetwork;
use netns::{NetNs, NetNsLock};
use podnet::{check_failed, firewall_error};

use crate::config::BridgeConfig;

pub mod backend;
pub mod iptables;
pub mod nft;

pub use backend::MasqueradeBackend;

/// Every masquerade backend, in the order GC visits them.
pub const MASQUERADE_BACKENDS: [&dyn MasqueradeBackend; 2] = [&iptables::Iptables, &nft::Nftables];

/// The configured backend first, then the other one: the one place the
/// configuration picks a backend.
fn backends(cfg: &BridgeConfig) -> [&'static dyn MasqueradeBackend; 2] {
    match cfg.masq_backend {
        Backend::Iptables => [&iptables::Iptables, &nft::Nftables],
        Backend::Nftables => [&nft::Nftables, &iptables::Iptables],
    }
}

fn configured(cfg: &BridgeConfig) -> &'static dyn MasqueradeBackend {
    backends(cfg)[0]
}

/// The node namespace's lock, held while a network's subnet rules are
/// looked for, created or removed: an ADD never counts on rules that a GC
/// is removing.
fn lock_node() -> Result<NetNsLock> {
    NetNs::current()
        .map_err(|e| Error::io(e.to_string()))?
        .lock()
        .map_err(|e| Error::io(format!("cannot lock the node's network namespace: {e}")))
}

/// Masquerade for the pod's subnets: the first pod of a subnet creates its
/// rules; every later pod only finds them (no process, nothing to undo).
pub fn ensure(cfg: &BridgeConfig, network: &str, addresses: &[IpNetwork]) -> Result<()> {
    let _lock = lock_node()?;
    configured(cfg)
        .ensure_network(network, addresses)
        .map_err(|e| firewall_error(e).context("failed to set up IP masquerade"))
}

/// DEL: the subnet rules stay for the network's other pods; what a pod may
/// own is the reference plugin's per-container rules (a node switched from
/// it), looked for in-process in the configured backend, and in the other
/// one only when the configured one had none. `families` are those the pod
/// had, when known.
pub fn teardown(cfg: &BridgeConfig, network: &str, att: &Attachment, families: &[Family]) -> Result<()> {
    for backend in backends(cfg) {
        let found = backend
            .teardown_container(network, &att.container_id, &att.ifname, families)
            .map_err(|e| firewall_error(e).context("failed to tear down IP masquerade"))?;
        if found {
            break;
        }
    }
    Ok(())
}

/// CHECK: the rules of the pod's subnets are there.
pub fn check(cfg: &BridgeConfig, network: &str, addresses: &[IpNetwork]) -> Result<()> {
    let missing = configured(cfg)
        .missing(network, addresses)
        .map_err(firewall_error)?;
    if missing.is_empty() {
        Ok(())
    } else {
        Err(check_failed(format!(
            "IP masquerade rules missing: {}",
            missing.join("; ")
        )))
    }
}

/// GC: per-container rules (the reference's) of attachments that are not
/// valid, in both backends; and the network's subnet rules once none of
/// its attachments is valid.
pub fn collect_garbage(network: &str, valid: &[GcAttachment]) -> Result<()> {
    let attachments: BTreeSet<(String, String)> = valid
        .iter()
        .map(|a| (a.ifname.clone(), a.container_id.clone()))
        .collect();
    let mut outcome = MASQUERADE_BACKENDS
        .iter()
        .try_for_each(|backend| backend.collect_garbage(network, &attachments));
    if valid.is_empty() {
        let _lock = lock_node()?;
        outcome = outcome.and_then(|()| {
            MASQUERADE_BACKENDS
                .iter()
                .try_for_each(|backend| backend.remove_network(network))
        });
    }
    outcome.map_err(|e| firewall_error(e).context("failed to collect stale IP masquerade rules"))
}
