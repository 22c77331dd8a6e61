//! The agent's limit on open files. Runtimes start a container at a soft
//! `RLIMIT_NOFILE` of 1024 (containerd 2.x, for programs that still use
//! `select(2)`) under a far higher hard limit; the agent holds a
//! descriptor for each watch, health connection, gate connection and
//! child's pipe, and uses no `select(2)`, so it raises its soft limit to
//! the hard one at start, as Go's runtime does for Istio's agent and
//! kindnetd. Its children (nft, iptables, the lease service) inherit it.

use nix::sys::resource::{Resource, getrlimit, setrlimit};

/// Raises the soft limit on open files to the hard one, saying so; a
/// failure is logged and the agent goes on with the limit it has.
pub fn raise_soft_limit() {
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => log::info!("open files: soft limit raised from {soft} to {hard}"),
            Err(e) => log::warn!("open files: cannot raise the soft limit from {soft} to {hard}: {e}"),
        },
        Ok(_) => {}
        Err(e) => log::warn!("open files: cannot read the limit: {e}"),
    }
}
