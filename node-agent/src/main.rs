//! `cni-node-agent`: run by a DaemonSet on every node; writes the node's
//! CNI configuration from its Node object and keeps it current, answers
//! health probes, and on SIGTERM stops (removing what it wrote when told
//! to uninstall). See docs/ARCHITECTURE.md, "The node agent".

use std::process::ExitCode;

use clap::Parser;
use k8s_openapi::api::core::v1::Node;

mod cluster;
mod conflist;
mod health;
mod logging;
mod nodes;
mod routes;
mod settings;

use settings::Settings;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Setting(String),
    #[error("{0}")]
    Io(String),
    #[error("{0}")]
    Watch(String),
    #[error("the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

fn main() -> ExitCode {
    let settings = Settings::parse();
    logging::init();
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
    let health = health::Health::default();
    let _probes = health::serve(settings.health_listen, health.clone()).await?;
    let client = kube::Client::try_from(cluster::config(&settings.service_account_dir)?)?;
    let api: kube::Api<Node> = kube::Api::all(client);
    log::info!(
        "node {}: writing {} from its Node object",
        settings.node_name,
        settings.conflist_path().display()
    );
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Error::Io(format!("cannot handle SIGTERM: {e}")))?;
    let outcome = tokio::select! {
        outcome = nodes::follow(api, settings.clone(), health) => outcome,
        _ = terminate.recv() => {
            log::info!("SIGTERM: stopping");
            Ok(())
        }
        _ = tokio::signal::ctrl_c() => Ok(()),
    };
    if settings.uninstall_on_stop {
        let removing = tokio::task::spawn_blocking(routes::remove_all).await;
        match removing {
            Ok(Ok(count)) => log::info!("removed {count} routes"),
            Ok(Err(e)) => log::error!("{e}"),
            Err(e) => log::error!("routes: {e}"),
        }
        uninstall(&settings);
    }
    outcome
}

/// Leaves the node as it was before the agent came: what the agent wrote
/// is removed, nothing else.
fn uninstall(settings: &Settings) {
    let path = settings.conflist_path();
    match conflist::remove_own(&path, &settings.network_name) {
        Ok(true) => log::info!("removed {}", path.display()),
        Ok(false) => {}
        Err(e) => log::error!("{e}"),
    }
}
