//! What uninstall (`UNINSTALL_ON_STOP`) removes of the agent's things on
//! the node, one function per step of [`crate::agent::UNINSTALL`] (which
//! states their order), and what that needs recorded before the agent's
//! first change: the node's nat tables. Each step logs what it did and
//! what failed, and never stops the next.

use std::path::PathBuf;

use crate::conf_dir;
use crate::controllers::install::bin_dir::BinDir;
use crate::controllers::lease_service::{self, LeaseDir};
use crate::controllers::{conflist, routes};
use crate::error::Error;
use crate::record::Record;
use crate::settings::Settings;

/// Where the agent's things are on the node.
#[derive(Debug, Clone)]
pub struct Options {
    pub cni_bin_dir: PathBuf,
    pub cni_conf_dir: PathBuf,
    pub lease_dir: PathBuf,
    /// The agent's own binaries (its image's), `cnictl` among them.
    pub tools: Option<PathBuf>,
    pub bridge: String,
}

impl Options {
    pub fn from_settings(settings: &Settings) -> Options {
        Options {
            cni_bin_dir: settings.cni_bin_dir.clone(),
            cni_conf_dir: settings.cni_conf_dir.clone(),
            lease_dir: settings.lease_dir.clone(),
            tools: settings.source_dir(),
            bridge: settings.bridge.clone(),
        }
    }
}

/// Records what the nat tables hold before the suite's changes, unless
/// this boot's are recorded already.
pub async fn remember_firewall(record: &Record) {
    let remembering = record.clone();
    match tokio::task::spawn_blocking(move || remembering.remember_firewall()).await {
        Ok(Ok(true)) => log::info!("recorded the node's nat tables before the suite's changes"),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => log::warn!("{e}: uninstall will leave the suite's unused nat chains"),
        Err(e) => log::warn!("recording the node's nat tables: {e}"),
    }
}

/// The node agent's routes to other nodes' pods.
pub fn remove_routes() {
    match routes::remove_all() {
        Ok(count) => log::info!("removed {count} routes"),
        Err(e) => log::error!("{e}"),
    }
}

/// Ambient mode's rule for kubelet's probes of enrolled pods, and its sets.
pub fn remove_probe_rule() {
    match crate::controllers::ambient::host_probe::remove_all() {
        Ok(removed) if !removed.is_empty() => {
            log::info!("removed ambient mode's probe rule: {}", removed.join(", "))
        }
        Ok(_) => {}
        Err(e) => log::error!("ambient mode's probe rule: {e}"),
    }
}

/// The masquerade of traffic leaving the cluster.
pub fn remove_masquerade() {
    match crate::controllers::egress::rules::remove() {
        Ok(families) if !families.is_empty() => log::info!("removed the masquerade rules ({families:?})"),
        Ok(_) => {}
        Err(e) => log::error!("masquerade: {e}"),
    }
}

/// What the suite left in the nat tables that nothing uses, as the record
/// taken before its first change tells; whether some of it could not go.
pub fn remove_unused_firewall(record: &Record) -> bool {
    match record.remove_unused_firewall() {
        Ok(Some(removal)) => {
            for what in &removal.removed {
                log::info!("removed {what}");
            }
            for failure in &removal.failed {
                log::error!("{failure}");
            }
            !removal.failed.is_empty()
        }
        Ok(None) => {
            log::warn!(
                "no record of the node's nat tables before the suite on this boot: the suite's unused chains and tables stay"
            );
            false
        }
        Err(e) => {
            log::error!("{e}");
            true
        }
    }
}

/// The lease service a plugin started while no agent ran.
pub fn stop_leftover_lease_service(options: &Options) {
    match lease_service::stop_remaining(&options.lease_dir) {
        Ok(true) => log::info!(
            "stopped the lease service left on {}",
            options.lease_dir.display()
        ),
        Ok(false) => {}
        Err(e) => log::error!("{e}"),
    }
}

/// The lease directory, unless pods still hold leases (then it answers
/// [`LeaseDir::Kept`], as it does when the leases cannot be listed).
pub fn remove_lease_dir(options: &Options) -> LeaseDir {
    let leases = options
        .tools
        .clone()
        .ok_or(Error::NoSourceDir)
        .and_then(|tools| lease_service::remove_unused(&options.lease_dir, &tools))
        .unwrap_or_else(|e| {
            log::error!("{e}");
            LeaseDir::Kept
        });
    match leases {
        LeaseDir::Removed => log::info!("removed {}", options.lease_dir.display()),
        LeaseDir::Absent => {}
        LeaseDir::Kept => {
            log::warn!("pods still hold leases: the bridge and the plugins stay for their DELs")
        }
    }
    leases
}

/// The record of the node's nat tables, done with once no pod is left to
/// publish a host port.
pub fn forget_firewall(record: &Record) {
    if let Err(e) = record.forget_firewall() {
        log::error!("{e}");
    }
}

/// The bridge, once no link is its port.
pub fn remove_bridge(options: &Options) {
    match conflist::remove_bridge_if_unused(&options.bridge) {
        Ok(true) => log::info!("removed the bridge {}", options.bridge),
        Ok(false) => {}
        Err(e) => log::error!("{e}"),
    }
}

/// Removes the installed binaries no configuration on the node names any
/// more (ours are gone by now: only others' count), putting the node's
/// own back; a binary still named stays for the DELs of its pods.
pub fn remove_binaries(options: &Options, bin_dir: &BinDir) {
    let still_named = conf_dir::named_plugins(&options.cni_conf_dir);
    match bin_dir.uninstall(&still_named) {
        Ok(done) => {
            for name in &done.restored {
                log::info!("restored the node's own {name}");
            }
            for name in &done.removed {
                log::info!("removed {name}");
            }
            for name in &done.left {
                log::warn!("{name} was changed by someone else since it was installed: left as it is");
            }
            for name in &done.still_named {
                log::warn!(
                    "{name} stays: a configuration in {} still names it",
                    options.cni_conf_dir.display()
                );
            }
            for failure in &done.failed {
                log::error!("{failure}");
            }
        }
        Err(e) => log::error!("{e}"),
    }
}
