//! `cni-node-agent`: run by a DaemonSet on every node; installs the
//! suite's plugins, writes the node's CNI configuration from its Node
//! object and keeps it current with the routes to other nodes' pods and
//! the masquerade of traffic leaving the cluster, runs the lease service,
//! answers health probes, and on SIGTERM stops (removing what it put on
//! the node when told to uninstall). See node-agent/README.md.
//!
//! Only the wiring: the settings parsed, each controller given its
//! options, started in order and stopped; what each does is the
//! library's (`node_agent`, whose top doc lists its layers).

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use node_agent::controllers::conflist::{self, Conflist};
use node_agent::controllers::egress::{self, Egress};
use node_agent::controllers::lease_service::{self, LeaseService};
use node_agent::controllers::plugin_logs::{self, PluginLogs};
use node_agent::controllers::routes::{self, Routes};
use node_agent::controllers::{install, istio_chain, network_policy, node_watch, readiness_taint, repair};
use node_agent::error::Error;
use node_agent::health::Health;
use node_agent::metrics::Metrics;
use node_agent::record::Record;
use node_agent::settings::{RepairMode, Settings};
use node_agent::{
    allocator, atomic, changes, cluster, health, iptables_mode, logging, open_files, uninstall,
};

fn main() -> ExitCode {
    let settings = Settings::parse();
    logging::init();
    allocator::one_arena();
    open_files::raise_soft_limit();
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
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(Error::Signal)?;
    let health = Health::default();
    // The lease service's counts are asked where the lease directory's
    // service listens, whoever started it.
    let metrics = Metrics::new(
        settings
            .own_network
            .then(|| lease::data_dir_socket(&settings.lease_dir)),
    );
    let _probes = health::serve(settings.health_listen, health.clone(), metrics.clone()).await?;
    // Settings that cannot work fail the start before anything is changed.
    settings.check().map_err(Error::Setting)?;
    // Before any entry names the socket: the first pod's records reach it.
    let plugin_logs = plugin_logs::start(&plugin_logs::Options::from_settings(&settings));
    let client = kube::Client::try_from(cluster::client::config(&settings.service_account_dir)?)?;
    let repair_options = repair::Options::from_settings(&settings)?;
    let istio = if settings.istio_chained {
        Some(istio_chain::Options::from_settings(&settings)?)
    } else {
        health.set_chained(true);
        None
    };
    let istio_entry = istio.as_ref().map(|istio| istio.entry.clone());
    // The agent's own file carries Istio's entry too, so where that file
    // is the primary one the two never rewrite each other.
    let chain = conflist::Chain::new(settings.chained_plugins.as_deref(), istio_entry.clone())?;
    let record = Record::new(&settings.cni_bin_dir);
    let installer = install::Installer::new(install::Options::from_settings(&settings), metrics.clone());
    // What an agent killed while writing left beside a configuration.
    atomic::sweep(&settings.cni_conf_dir);
    // Before the first change: what the nat tables held before the suite
    // came on this boot stays at uninstall (a restarted agent keeps the
    // first agent's record). Istio's CNI alone changes no nat table.
    if settings.own_network {
        uninstall::remember_firewall(&record).await;
    }
    // Before the conflist exists, so the runtime never calls a plugin that
    // is not there yet; a start that cannot install fails.
    installer.install(&health).await?;
    let lease_service = (settings.own_network && settings.lease_service)
        .then(|| lease_service::run(&lease_service::Options::from_settings(&settings)));
    let reinstalling = tokio::spawn(installer.clone().run(
        health.clone(),
        lease_service.as_ref().map(LeaseService::restarter),
    ));
    let repairing = istio_entry
        .as_ref()
        .filter(|_| repair_options.mode != RepairMode::Off)
        .map(|entry| {
            tokio::spawn(repair::run(
                client.clone(),
                repair_options.clone(),
                entry.clone(),
                metrics.clone(),
            ))
        });
    let chaining = istio.clone().map(|istio| {
        tokio::spawn(istio_chain::run(
            istio,
            record.clone(),
            health.clone(),
            metrics.clone(),
        ))
    });
    let keeping_the_taint = readiness_taint::Options::from_settings(&settings)
        .map(|options| tokio::spawn(readiness_taint::run(client.clone(), options, health.clone())));
    // Bound before the conflist names it, as the log socket is.
    let enforcing = network_policy::Options::from_settings(&settings).map(|options| {
        let gate = settings
            .policy_socket()
            .map(|path| network_policy::Gate::new(path, health.clone(), metrics.clone()));
        tokio::spawn(network_policy::run(
            client.clone(),
            options,
            gate,
            metrics.clone(),
        ))
    });
    let outcome = if settings.own_network {
        log::info!(
            "node {}: writing {} from its Node object",
            settings.node_name,
            settings.conflist_path().display()
        );
        let controllers = node_watch::Controllers {
            conflist: Conflist::new(
                conflist::Options::from_settings(&settings),
                chain,
                metrics.clone(),
            ),
            routes: Routes::new(routes::Options::from_settings(&settings), metrics.clone()),
            egress: Egress::new(egress::Options::from_settings(&settings), metrics),
        };
        tokio::select! {
            outcome = node_watch::run(client, controllers, health) => outcome,
            () = stopped(&mut terminate) => Ok(()),
        }
    } else {
        log::info!(
            "node {}: Istio's CNI only, beside the node's own network",
            settings.node_name
        );
        health.set_network_not_ours();
        stopped(&mut terminate).await;
        Ok(())
    };
    reinstalling.abort();
    let _ = reinstalling.await;
    // The policy table stays in the kernel across a restart: the next
    // agent reconciles it.
    for task in [chaining, repairing, keeping_the_taint, enforcing]
        .into_iter()
        .flatten()
    {
        task.abort();
        let _ = task.await;
    }
    if !settings.uninstall_on_stop {
        if let Some(service) = lease_service {
            service.stop().await;
        }
        stop_plugin_logs(plugin_logs).await;
        return outcome;
    }
    // A change already on a blocking thread (SIGTERM cannot cancel it)
    // finishes first; none starts after.
    if let Err(e) = tokio::task::spawn_blocking(changes::stop).await {
        log::error!("uninstalling: {e}");
    }
    if let Some(istio) = &istio {
        istio_chain::unchain(istio, &record);
    }
    let options = uninstall::Options::from_settings(&settings);
    let bin_dir = installer.bin_dir().clone();
    if !settings.own_network {
        stop_plugin_logs(plugin_logs).await;
        let removing = tokio::task::spawn_blocking(move || uninstall::remove_binaries(&options, &bin_dir));
        if let Err(e) = removing.await {
            log::error!("uninstalling: {e}");
        }
        return outcome;
    }
    // The conflist goes first, so no new pod is set up while the rest
    // goes (a pod set up meanwhile would start a lease service of its own).
    let conflist_was_ours = conflist::remove(&conflist::Options::from_settings(&settings));
    if let Some(service) = lease_service {
        service.stop().await;
    }
    if settings.network_policy
        && let Err(e) = tokio::task::spawn_blocking(network_policy::remove).await
    {
        log::error!("uninstalling: {e}");
    }
    // Before uninstall may remove the run directory the socket is in.
    stop_plugin_logs(plugin_logs).await;
    let removing = tokio::task::spawn_blocking(move || uninstall::run(&options, &bin_dir, conflist_was_ours));
    if let Err(e) = removing.await {
        log::error!("uninstalling: {e}");
    }
    outcome
}

async fn stop_plugin_logs(plugin_logs: Option<PluginLogs>) {
    if let Some(plugin_logs) = plugin_logs
        && let Err(e) = tokio::task::spawn_blocking(move || plugin_logs.stop()).await
    {
        log::error!("stopping the plugins' log records: {e}");
    }
}

/// Until SIGTERM or SIGINT.
async fn stopped(terminate: &mut tokio::signal::unix::Signal) {
    tokio::select! {
        _ = terminate.recv() => log::info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => {}
    }
}
