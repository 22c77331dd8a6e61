//! The faults tier: the chain killed at random moments and at every named
//! fault point (`crash`), and sixteen workers churning pods (`soak`; `make
//! soak` runs both longer). One module per former test file.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

mod crash;
mod soak;

/// The soak and the crash tests were two test binaries, so they never ran
/// at the same time: the soak's sixteen workers never loaded the machine
/// under a crash test, whose kill windows are calibrated on the chain's
/// speed just before its campaign. They still never overlap: the soak
/// holds this for writing, each crash test for reading (crash tests run
/// beside each other, as they did in their own binary).
static SOAK: RwLock<()> = RwLock::new(());

/// Held by the soak for its whole run: no crash test runs meanwhile.
fn alone() -> RwLockWriteGuard<'static, ()> {
    SOAK.write().unwrap_or_else(PoisonError::into_inner)
}

/// Held by each crash test: the soak does not run meanwhile.
fn beside_crash_tests() -> RwLockReadGuard<'static, ()> {
    SOAK.read().unwrap_or_else(PoisonError::into_inner)
}
