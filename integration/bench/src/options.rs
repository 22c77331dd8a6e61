//! What a `cni-bench` run is asked to do: its command line's options and
//! the phases `--only` can name.

use std::path::PathBuf;

use crate::{ambient, gate, policy_path};

#[derive(Debug, Clone)]
pub struct Options {
    pub pods: usize,
    pub repeats: usize,
    pub full_leases: usize,
    pub out: PathBuf,
    /// One phase of [`PHASES`] alone (no profiles), to work on it.
    pub only: Option<String>,
}

/// The phases of a round, as `--only` names them.
pub const PHASES: [&str; 14] = [
    "seq",
    "burst",
    "full",
    "loopback",
    "portmap",
    "firewall",
    "istio",
    "rechain",
    "logsock",
    "floors",
    "cri",
    policy_path::PHASE,
    gate::PHASE,
    ambient::PHASE,
];
