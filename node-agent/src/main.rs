//! `cni-node-agent`: run by a DaemonSet on every node; installs the
//! suite's plugins, writes the node's CNI configuration from its Node
//! object and keeps it current with the routes to other nodes' pods and
//! the masquerade of traffic leaving the cluster, runs the lease service,
//! answers health probes, and on SIGTERM stops (removing what it put on
//! the node when told to uninstall). See docs/ARCHITECTURE.md, "The node agent".

use std::process::ExitCode;

use clap::Parser;
use node_agent::error::Error;
use node_agent::settings::{RepairMode, Settings};
use node_agent::{
    atomic, changes, cluster, conf_dir, conflist, health, install, iptables_mode, istio_chain, istio_install,
    lease, logging, nodes, record, repair, routes,
};

fn main() -> ExitCode {
    let settings = Settings::parse();
    logging::init();
    // Before the runtime's threads exist: it edits PATH.
    if let Some(flavour) = iptables_mode::select(settings.iptables_mode) {
        log::info!("iptables: {}", flavour.display());
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            log::error!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(settings: Settings) -> Result<(), Error> {
    // First: a SIGTERM during the start must still stop (and uninstall)
    // cleanly rather than kill the agent halfway.
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::Io(format!("cannot handle SIGTERM: {e}")))?;
    let health = health::Health::default();
    let _probes = health::serve(settings.health_listen, health.clone()).await?;
    // Settings that cannot work fail the start before anything is changed.
    let client = kube::Client::try_from(cluster::client::config(&settings.service_account_dir)?)?;
    let repair_label = repair::label(&settings.istio_repair_label)?;
    let istio_entry = if settings.istio_chained {
        let mut entry = istio_chain::entry(settings.istio_plugin_config.as_deref())?;
        if entry.get("kubeconfig").is_none() {
            entry["kubeconfig"] = serde_json::json!(settings.istio_kubeconfig);
        }
        Some(entry)
    } else {
        health.set_chained(true);
        None
    };
    // The agent's own file carries Istio's entry too, so where that file
    // is the primary one the two never rewrite each other.
    let chain = conflist::Chain::new(&settings, istio_entry.clone())?;
    let record = record::Record::new(&settings.cni_bin_dir);
    let bin_dir = install::BinDir::new(settings.cni_bin_dir.clone());
    // Before the first change: what the nat tables held before the suite
    // came on this boot stays at uninstall (a restarted agent keeps the
    // first agent's record).
    // What an agent killed while writing left beside a configuration.
    atomic::sweep(&settings.cni_conf_dir);
    let remembering = record.clone();
    match tokio::task::spawn_blocking(move || remembering.remember_firewall()).await {
        Ok(Ok(true)) => log::info!("recorded the node's nat tables before the suite's changes"),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => log::warn!("{e}: uninstall will leave the suite's unused nat chains"),
        Err(e) => log::warn!("recording the node's nat tables: {e}"),
    }
    // Before the conflist exists, so the runtime never calls a plugin that
    // is not there yet; a start that cannot install fails.
    install_plugins(&settings, &bin_dir, &health).await?;
    let lease_service = settings
        .lease_service
        .then(|| lease::LeaseService::start(&settings.cni_bin_dir, &settings.lease_dir));
    let reinstalling = tokio::spawn(keep_installed(
        settings.clone(),
        bin_dir.clone(),
        health.clone(),
        lease_service.as_ref().map(lease::LeaseService::restarter),
    ));
    let repairing = istio_entry
        .as_ref()
        .filter(|_| settings.istio_repair != RepairMode::Off)
        .map(|entry| {
            tokio::spawn(repair::follow(
                client.clone(),
                settings.clone(),
                entry.clone(),
                repair_label,
            ))
        });
    let chaining = istio_entry.clone().map(|entry| {
        tokio::spawn(istio_install::keep_chained(
            settings.clone(),
            entry,
            record.clone(),
            health.clone(),
        ))
    });
    log::info!(
        "node {}: writing {} from its Node object",
        settings.node_name,
        settings.conflist_path().display()
    );
    let outcome = tokio::select! {
        outcome = nodes::follow(client, settings.clone(), chain, health) => outcome,
        _ = terminate.recv() => {
            log::info!("SIGTERM: stopping");
            Ok(())
        }
        _ = tokio::signal::ctrl_c() => Ok(()),
    };
    reinstalling.abort();
    let _ = reinstalling.await;
    for task in [chaining, repairing].into_iter().flatten() {
        task.abort();
        let _ = task.await;
    }
    if !settings.uninstall_on_stop {
        if let Some(service) = lease_service {
            service.stop().await;
        }
        return outcome;
    }
    // A change already on a blocking thread (SIGTERM cannot cancel it)
    // finishes first; none starts after.
    if let Err(e) = tokio::task::spawn_blocking(changes::stop).await {
        log::error!("uninstalling: {e}");
    }
    if let Some(entry) = &istio_entry {
        istio_install::unchain(&settings, entry, &record);
    }
    // The conflist goes first, so no new pod is set up while the rest
    // goes (a pod set up meanwhile would start a lease service of its own).
    let conflist_was_ours = remove_conflist(&settings);
    if let Some(service) = lease_service {
        service.stop().await;
    }
    let removing = tokio::task::spawn_blocking(move || uninstall(&settings, &bin_dir, conflist_was_ours));
    if let Err(e) = removing.await {
        log::error!("uninstalling: {e}");
    }
    outcome
}

/// Installs the plugins from the agent's image; the lease service is told
/// to start again from a host-local it replaced.
async fn install_plugins(
    settings: &Settings,
    bin_dir: &install::BinDir,
    health: &health::Health,
) -> Result<install::Installed, Error> {
    let plugins = settings.plugins();
    if plugins.is_empty() {
        health.set_installed(true);
        return Ok(install::Installed::default());
    }
    let source = settings.source_dir()?;
    let bin = bin_dir.clone();
    let outcome = tokio::task::spawn_blocking(move || changes::change(|| bin.install(&source, &plugins)))
        .await
        .map_err(|e| Error::Io(format!("installing: {e}")))?;
    match &outcome {
        Ok(done) => {
            for name in &done.written {
                let aside = if done.kept_aside.contains(name) {
                    " (the node's own kept aside)"
                } else {
                    ""
                };
                log::info!("installed {}{aside}", settings.cni_bin_dir.join(name).display());
            }
            health.set_installed(true);
        }
        Err(_) => health.set_installed(false),
    }
    outcome
}

/// Puts the binaries back when someone removed or changed them, every
/// resync.
async fn keep_installed(
    settings: Settings,
    bin_dir: install::BinDir,
    health: health::Health,
    restart_lease_service: Option<lease::Restarter>,
) {
    let mut every = tokio::time::interval(nodes::RESYNC);
    every.tick().await;
    loop {
        every.tick().await;
        match install_plugins(&settings, &bin_dir, &health).await {
            Ok(done) if done.written.iter().any(|name| name == "host-local") => {
                if let Some(restart) = &restart_lease_service {
                    restart.restart();
                }
            }
            Ok(_) => {}
            Err(e) => log::error!("{e}"),
        }
    }
}

/// Removes the agent's conflist; whether there was one of its own.
fn remove_conflist(settings: &Settings) -> bool {
    let path = settings.conflist_path();
    match conflist::remove_own(&path, &settings.network_name) {
        Ok(true) => {
            log::info!("removed {}", path.display());
            true
        }
        Ok(false) => false,
        Err(e) => {
            log::error!("{e}");
            false
        }
    }
}

/// Leaves the node as it was before the agent came, once its conflist is
/// gone: its routes and rules, the lease service a plugin may have started
/// and the lease directory; then, unless pods are still there (their
/// leases held: their DELs need the plugins and the bridge), the bridge
/// and the binaries, the originals put back. Nothing else is touched, and
/// each step is tried whatever the one before it did.
fn uninstall(settings: &Settings, bin_dir: &install::BinDir, conflist_was_ours: bool) {
    match routes::remove_all() {
        Ok(count) => log::info!("removed {count} routes"),
        Err(e) => log::error!("{e}"),
    }
    match firewall::egress::remove() {
        Ok(families) if !families.is_empty() => log::info!("removed the masquerade rules ({families:?})"),
        Ok(_) => {}
        Err(e) => log::error!("masquerade: {e}"),
    }
    // After the masquerade, whose jumps kept nat base chains in use.
    let record = record::Record::new(&settings.cni_bin_dir);
    let firewall_failed = match record.remove_unused_firewall() {
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
    };
    match lease::stop_remaining(&settings.lease_dir) {
        Ok(true) => log::info!(
            "stopped the lease service left on {}",
            settings.lease_dir.display()
        ),
        Ok(false) => {}
        Err(e) => log::error!("{e}"),
    }
    let leases = lease::remove_unused(&settings.lease_dir).unwrap_or_else(|e| {
        log::error!("{e}");
        lease::LeaseDir::Kept
    });
    match leases {
        lease::LeaseDir::Removed => log::info!("removed {}", settings.lease_dir.display()),
        lease::LeaseDir::Absent => {}
        lease::LeaseDir::Kept => {
            log::warn!("pods still hold leases: the bridge and the plugins stay for their DELs");
            return;
        }
    }
    // No pod is left to publish a host port: the record of the nat tables
    // is done with, unless what it found unused could not all go (the
    // next uninstall of this boot tries again).
    if !firewall_failed && let Err(e) = record.forget_firewall() {
        log::error!("{e}");
    }
    // A bridge of that name the agent's conflist did not name may be
    // another network's.
    if conflist_was_ours {
        match conflist::remove_bridge_if_unused(&settings.bridge) {
            Ok(true) => log::info!("removed the bridge {}", settings.bridge),
            Ok(false) => {}
            Err(e) => log::error!("{e}"),
        }
    }
    // Our own conflist is gone by now: only others' configurations count.
    let still_named = conf_dir::named_plugins(&settings.cni_conf_dir);
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
                    settings.cni_conf_dir.display()
                );
            }
            for failure in &done.failed {
                log::error!("{failure}");
            }
        }
        Err(e) => log::error!("{e}"),
    }
}
