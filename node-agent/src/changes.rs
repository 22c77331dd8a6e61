//! One change to the node at a time, and none once uninstall has begun.
//!
//! Installs, route reconciliations and masquerade updates run on blocking
//! threads. When SIGTERM ends the agent's loops, one of them may still be
//! queued or running; without this, it could put back a route, a rule or
//! a binary right after uninstall removed it. Also how often the
//! controllers check again what they keep in place, with nothing changing.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::error::Error;

/// Whether uninstall has begun.
static NODE: Mutex<bool> = Mutex::new(false);

/// Runs `work` alone, unless uninstall has begun.
pub fn change<T>(work: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    let uninstalling = NODE.lock().unwrap_or_else(PoisonError::into_inner);
    if *uninstalling {
        return Err(Error::Io("the agent is uninstalling: no more changes".into()));
    }
    work()
}

/// Waits for the change in progress, if any; none starts after. What
/// uninstall does next cannot be undone by a change still queued.
pub fn stop() {
    let mut uninstalling = NODE.lock().unwrap_or_else(PoisonError::into_inner);
    *uninstalling = true;
}

/// How often the file, the routes and the rules are checked with no Node
/// changing (and the binaries, by the install).
pub const RESYNC: Duration = Duration::from_secs(30);

/// Runs netlink or iptables work off the async threads.
pub async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(Error::task("a blocking task"))?
}
