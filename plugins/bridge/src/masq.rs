//! Masquerade through the configured backend, mapped to CNI errors.

use std::collections::BTreeSet;

use cni::conf::GcAttachment;
use cni::error::plugin_codes;
use cni::{Attachment, Error, Result};
use firewall::{Family, masquerade, nft};
use ipnetwork::IpNetwork;

use crate::config::{BridgeConfig, MasqBackend};

pub fn firewall_error(e: firewall::Error) -> Error {
    Error::plugin(plugin_codes::FIREWALL, e.to_string())
}

pub fn setup(cfg: &BridgeConfig, network: &str, att: &Attachment, addresses: &[IpNetwork]) -> Result<()> {
    match cfg.masq_backend {
        MasqBackend::Iptables => masquerade::setup(network, &att.container_id, addresses),
        MasqBackend::Nftables => nft::setup(network, &att.ifname, &att.container_id, addresses),
    }
    .map_err(|e| firewall_error(e).context("failed to set up IP masquerade"))
}

/// Removes a container's masquerade: from the configured backend, and from
/// the other one only when the configured one had nothing (the
/// configuration may have changed since ADD; the reference always tries
/// both, which costs a read of each on every DEL). `families` are those the
/// pod had, when known.
pub fn teardown(cfg: &BridgeConfig, network: &str, att: &Attachment, families: &[Family]) -> Result<()> {
    let iptables = || masquerade::teardown(network, &att.container_id, families);
    let nftables = || nft::teardown(network, &att.ifname, &att.container_id);
    let outcome = match cfg.masq_backend {
        MasqBackend::Iptables => iptables().and_then(|found| if found { Ok(true) } else { nftables() }),
        MasqBackend::Nftables => nftables().and_then(|found| if found { Ok(true) } else { iptables() }),
    };
    outcome
        .map(drop)
        .map_err(|e| firewall_error(e).context("failed to tear down IP masquerade"))
}

/// CHECK: every rule ADD made is there.
pub fn check(cfg: &BridgeConfig, network: &str, att: &Attachment, addresses: &[IpNetwork]) -> Result<()> {
    let missing: Vec<String> = match cfg.masq_backend {
        MasqBackend::Iptables => {
            let mut missing = Vec::new();
            for family in addresses.iter().map(Family::of).collect::<BTreeSet<_>>() {
                let table = masquerade::read_nat(family).map_err(firewall_error)?;
                missing.extend(masquerade::missing(
                    &table,
                    family,
                    network,
                    &att.container_id,
                    addresses,
                ));
            }
            missing
        }
        MasqBackend::Nftables => {
            nft::missing(network, &att.ifname, &att.container_id, addresses).map_err(firewall_error)?
        }
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

/// GC: the masquerade of this network's attachments that are not valid.
pub fn collect_garbage(network: &str, valid: &[GcAttachment]) -> Result<()> {
    let containers: BTreeSet<String> = valid.iter().map(|a| a.container_id.clone()).collect();
    let attachments: BTreeSet<(String, String)> = valid
        .iter()
        .map(|a| (a.ifname.clone(), a.container_id.clone()))
        .collect();
    masquerade::collect_garbage(network, &containers)
        .and_then(|_| nft::collect_garbage(network, &attachments))
        .map_err(|e| firewall_error(e).context("failed to collect stale IP masquerade rules"))
}
