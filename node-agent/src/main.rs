//! `cni-node-agent`: run by a DaemonSet on every node; installs the
//! suite's plugins, writes the node's CNI configuration from its Node
//! object and keeps it current with the routes to other nodes' pods and
//! the masquerade of traffic leaving the cluster, runs the lease service,
//! answers health probes, and on SIGTERM stops (removing what it put on
//! the node when told to uninstall). See node-agent/README.md.
//!
//! Only the process: the settings parsed, the runtime and the signals;
//! the agent's start and stop are the library's (`node_agent::agent`),
//! what each controller does too (`node_agent`'s top doc lists its layers).

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use node_agent::agent::Agent;
use node_agent::error::Error;
use node_agent::settings::Settings;
use node_agent::{allocator, iptables_mode, logging, open_files};

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
    let uninstall = settings.uninstall_on_stop;
    let mut running = Agent::start(settings).await?;
    let outcome = tokio::select! {
        outcome = running.failed() => outcome,
        () = stopped(&mut terminate) => Ok(()),
    };
    running.stop(uninstall).await;
    outcome
}

/// Until SIGTERM or SIGINT.
async fn stopped(terminate: &mut tokio::signal::unix::Signal) {
    tokio::select! {
        _ = terminate.recv() => log::info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => {}
    }
}
