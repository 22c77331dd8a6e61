//! Masquerade through the configured backend, mapped to CNI errors.

use std::collections::BTreeSet;

use cni::conf::GcAttachment;
use cni::error::plugin_codes;
use cni::{Attachment, Error, Result};
use firewall::{Family, masquerade, nft};
use ipnetwork::IpNetwork;
use netns::{NetNs, NetNsLock};

use crate::config::{BridgeConfig, MasqBackend};

pub fn firewall_error(e: firewall::Error) -> Error {
    Error::plugin(plugin_codes::FIREWALL, e.to_string())
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
    match cfg.masq_backend {
        MasqBackend::Iptables => masquerade::ensure_network(network, addresses),
        MasqBackend::Nftables => nft::ensure_network(network, addresses),
    }
    .map_err(|e| firewall_error(e).context("failed to set up IP masquerade"))
}

/// DEL: the subnet rules stay for the network's other pods; what a pod may
/// own is the reference plugin's per-container rules (a node switched from
/// it), looked for in-process in the configured backend, and in the other
/// one only when the configured one had none. `families` are those the pod
/// had, when known.
pub fn teardown(cfg: &BridgeConfig, network: &str, att: &Attachment, families: &[Family]) -> Result<()> {
    let iptables = || masquerade::teardown_container(network, &att.container_id, families);
    let nftables = || nft::teardown(network, &att.ifname, &att.container_id);
    let outcome = match cfg.masq_backend {
        MasqBackend::Iptables => iptables().and_then(|found| if found { Ok(true) } else { nftables() }),
        MasqBackend::Nftables => nftables().and_then(|found| if found { Ok(true) } else { iptables() }),
    };
    outcome
        .map(drop)
        .map_err(|e| firewall_error(e).context("failed to tear down IP masquerade"))
}

/// CHECK: the rules of the pod's subnets are there.
pub fn check(cfg: &BridgeConfig, network: &str, addresses: &[IpNetwork]) -> Result<()> {
    let missing: Vec<String> = match cfg.masq_backend {
        MasqBackend::Iptables => {
            let mut missing = Vec::new();
            for family in addresses.iter().map(Family::of).collect::<BTreeSet<_>>() {
                let table = masquerade::read_nat(family).map_err(firewall_error)?;
                missing.extend(masquerade::network_missing(&table, family, network, addresses));
            }
            missing
        }
        MasqBackend::Nftables => nft::missing(network, addresses).map_err(firewall_error)?,
    };
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::plugin(
            plugin_codes::CHECK_FAILED,
            format!("IP masquerade rules missing: {}", missing.join("; ")),
        ))
    }
}

/// GC: per-container rules (the reference's) of attachments that are not
/// valid, in both backends; and the network's subnet rules once none of
/// its attachments is valid.
pub fn collect_garbage(network: &str, valid: &[GcAttachment]) -> Result<()> {
    let containers: BTreeSet<String> = valid.iter().map(|a| a.container_id.clone()).collect();
    let attachments: BTreeSet<(String, String)> = valid
        .iter()
        .map(|a| (a.ifname.clone(), a.container_id.clone()))
        .collect();
    let mut outcome = masquerade::collect_garbage(network, &containers)
        .map(drop)
        .and_then(|()| nft::collect_garbage(network, &attachments));
    if valid.is_empty() {
        let _lock = lock_node()?;
        outcome = outcome
            .and_then(|()| masquerade::remove_network(network))
            .and_then(|()| nft::remove_network(network));
    }
    outcome.map_err(|e| firewall_error(e).context("failed to collect stale IP masquerade rules"))
}
