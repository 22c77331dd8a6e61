//! The lease service controller: host-local's lease service for the
//! lease directory, run by the agent as its child and kept running
//! (`service`, which also has what uninstall does to a service left on
//! the directory and to the directory itself).

mod service;

use std::path::PathBuf;

pub use service::{LeaseDir, LeaseService, Restarter, remove_unused, stop_remaining};

use crate::settings::Settings;

/// Which service runs for which directory.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where the host-local run as the service is (the one installed).
    pub cni_bin_dir: PathBuf,
    /// The lease directory the conflist names.
    pub lease_dir: PathBuf,
}

impl Options {
    pub fn from_settings(settings: &Settings) -> Options {
        Options {
            cni_bin_dir: settings.cni_bin_dir.clone(),
            lease_dir: settings.lease_dir.clone(),
        }
    }
}

/// Starts the service and keeps it running until told to stop (see
/// [`LeaseService::start`]).
pub fn run(options: &Options) -> LeaseService {
    LeaseService::start(&options.cni_bin_dir, &options.lease_dir)
}
