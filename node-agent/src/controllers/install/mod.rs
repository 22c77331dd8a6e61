//! The install controller: the suite's plugins copied from the agent's
//! image into the host's bin directory before anything else changes (a
//! start that cannot install fails), then put back every resync when
//! someone removed or changed them. How a binary is written, kept aside
//! and restored is `bin_dir`'s.

pub mod bin_dir;

use std::path::PathBuf;

use crate::changes::{self, RESYNC};
use crate::controllers::lease_service::Restarter;
use crate::error::Error;
use crate::health::Health;
use crate::metrics::{InstallResult, Metrics};
use crate::settings::Settings;

use bin_dir::{BinDir, Installed};

/// What is installed, from where, to where.
#[derive(Debug, Clone)]
pub struct Options {
    /// The plugins to install, without empty entries (`CNI_INSTALL_PLUGINS=""`).
    pub plugins: Vec<String>,
    /// Where the binaries to install are (see [`Settings::source_dir`]).
    pub source_dir: Option<PathBuf>,
    /// The host's bin directory.
    pub cni_bin_dir: PathBuf,
}

impl Options {
    pub fn from_settings(settings: &Settings) -> Options {
        Options {
            plugins: settings.plugins_to_install(),
            source_dir: settings.source_dir(),
            cni_bin_dir: settings.cni_bin_dir.clone(),
        }
    }

    /// Where the binaries to install are.
    fn source_dir(&self) -> Result<PathBuf, Error> {
        self.source_dir.clone().ok_or(Error::NoSourceDir)
    }
}

/// The install controller: its options, the bin directory it manages and
/// where it counts its installs.
#[derive(Debug, Clone)]
pub struct Installer {
    options: Options,
    bin_dir: BinDir,
    metrics: Metrics,
}

impl Installer {
    pub fn new(options: Options, metrics: Metrics) -> Installer {
        Installer {
            bin_dir: BinDir::new(options.cni_bin_dir.clone()),
            options,
            metrics,
        }
    }

    /// The bin directory, for uninstall.
    pub fn bin_dir(&self) -> &BinDir {
        &self.bin_dir
    }

    /// Installs the plugins from the agent's image once, at start: counted
    /// as an install whatever it had to write, as Istio's installer counts
    /// its first.
    pub async fn install(&self, health: &Health) -> Result<Installed, Error> {
        let installed = self.install_round(health).await;
        if installed.is_ok() {
            self.metrics.installed(InstallResult::Success);
        }
        installed
    }

    /// Installs the plugins; a failure is counted.
    async fn install_round(&self, health: &Health) -> Result<Installed, Error> {
        let installed = self.copy_binaries(health).await;
        if installed.is_err() {
            self.metrics.installed(InstallResult::CopyBinariesFailure);
        }
        installed
    }

    async fn copy_binaries(&self, health: &Health) -> Result<Installed, Error> {
        let plugins = self.options.plugins.clone();
        if plugins.is_empty() {
            health.set_installed(true);
            return Ok(Installed::default());
        }
        let source = self.options.source_dir()?;
        let bin = self.bin_dir.clone();
        let outcome = tokio::task::spawn_blocking(move || changes::change(|| bin.install(&source, &plugins)))
            .await
            .map_err(Error::task("installing"))?;
        match &outcome {
            Ok(done) => {
                for name in &done.written {
                    let aside = if done.kept_aside.contains(name) {
                        " (the node's own kept aside)"
                    } else {
                        ""
                    };
                    log::info!(
                        "installed {}{aside}",
                        self.options.cni_bin_dir.join(name).display()
                    );
                }
                health.set_installed(true);
            }
            Err(_) => health.set_installed(false),
        }
        outcome
    }

    /// Puts the binaries back when someone removed or changed them, every
    /// resync (counted as an install only when one was put back, as Istio
    /// counts a reinstall after a change); the lease service is told to
    /// start again from a host-local it replaced.
    pub async fn run(self, health: Health, restart_lease_service: Option<Restarter>) {
        let mut every = tokio::time::interval(RESYNC);
        every.tick().await;
        loop {
            every.tick().await;
            match self.install_round(&health).await {
                Ok(done) => {
                    if !done.written.is_empty() {
                        self.metrics.installed(InstallResult::Success);
                    }
                    if done.written.iter().any(|name| name == "host-local")
                        && let Some(restart) = &restart_lease_service
                    {
                        restart.restart();
                    }
                }
                Err(e) => log::error!("{e}"),
            }
        }
    }
}
