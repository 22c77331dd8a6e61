//! Stopping a run on SIGTERM or SIGINT at the next step that looks, so
//! what it made is removed as at its end.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by SIGTERM or SIGINT once [`stop_on_signals`] ran.
static STOP: AtomicBool = AtomicBool::new(false);

/// From now on SIGTERM and SIGINT ask the run to stop instead of ending
/// the process: what the bench made (namespaces, processes, directories)
/// is then removed as at a run's end.
pub fn stop_on_signals() -> std::io::Result<()> {
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, &STOP)?;
    }
    Ok(())
}

/// Whether a signal asked the run to stop.
pub fn stopping() -> bool {
    STOP.load(Ordering::SeqCst)
}
