//! No change to the node once uninstall has begun, and uninstall only
//! once the changes in progress are done.
//!
//! Installs, route reconciliations, masquerade updates, Istio's chain
//! checks and NetworkPolicy passes run on blocking threads. When SIGTERM
//! ends the agent's loops, some may still be queued or running; without
//! this, one could put back a route, a rule or a binary right after
//! uninstall removed it.
//!
//! Changes do not wait for each other: what they change is disjoint, and
//! each is kept to one at a time where it must be by its own lock (the
//! bin directory's `flock` for installs and the record, the kernel's
//! nf_tables commit for the policy table and iptables-nft, the xtables
//! lock for iptables-legacy; the Node watch runs routes and masquerade in
//! turn). One lock around them all let a masquerade update waiting for
//! another tool's xtables lock hold back every NetworkPolicy pass; now it
//! holds back only uninstall, and for [`XTABLES_WAIT`] at most.
//!
//! Also how often the controllers check again what they keep in place,
//! with nothing changing.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::error::Error;

/// The node's changes, fenced by uninstall.
static NODE: Fence = Fence::new();

/// Runs `work`, unless uninstall has begun (then it is refused).
pub fn change<T>(work: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    NODE.change(work)
}

/// Waits for every change in progress; none starts after. What
/// uninstall does next cannot be undone by a change still queued.
pub fn stop() {
    NODE.stop();
}

/// How long the agent's `iptables-restore` waits for the xtables lock
/// another tool holds (iptables-legacy; iptables-nft takes no lock), as
/// kubelet and kube-proxy bound theirs (5 s): a change that cannot get it
/// fails and is tried again at the next change or resync, rather than
/// keeping uninstall waiting on whoever holds it.
pub const XTABLES_WAIT: &str = "--wait=5";

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

/// Changes in progress, and whether uninstall has begun.
#[derive(Debug)]
struct Fence {
    state: Mutex<State>,
    /// Signalled when the last change in progress ends.
    idle: Condvar,
}

#[derive(Debug)]
struct State {
    uninstalling: bool,
    in_progress: usize,
}

impl Fence {
    const fn new() -> Fence {
        Fence {
            state: Mutex::new(State {
                uninstalling: false,
                in_progress: 0,
            }),
            idle: Condvar::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn change<T>(&self, work: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
        {
            let mut state = self.state();
            if state.uninstalling {
                return Err(Error::Io("the agent is uninstalling: no more changes".into()));
            }
            state.in_progress += 1;
        }
        // Counted out when `work` returns or panics.
        let _in_progress = InProgress(self);
        work()
    }

    fn stop(&self) {
        let mut state = self.state();
        state.uninstalling = true;
        while state.in_progress > 0 {
            state = self.idle.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// One change in progress, counted out when dropped.
struct InProgress<'a>(&'a Fence);

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.in_progress -= 1;
        if state.in_progress == 0 {
            self.0.idle.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    use super::*;

    /// Long enough for a change that is not held back to be done many
    /// times over; a guard against hanging, not a target.
    const HANG: Duration = Duration::from_secs(30);

    #[test]
    fn a_change_waiting_on_another_tool_holds_back_no_other_change_only_uninstall() {
        let fence = Arc::new(Fence::new());
        // A change stuck in another tool's wait until `release` is sent.
        let (release, stuck_until) = mpsc::channel::<()>();
        let entered = Arc::new(Barrier::new(2));
        let stuck = {
            let (fence, entered) = (fence.clone(), entered.clone());
            std::thread::spawn(move || {
                fence.change(|| {
                    entered.wait();
                    stuck_until.recv().map_err(|e| Error::Io(e.to_string()))
                })
            })
        };
        entered.wait();

        let (done, finished) = mpsc::channel();
        {
            let fence = fence.clone();
            std::thread::spawn(move || done.send(fence.change(|| Ok("policy pass"))));
        }
        let other = finished.recv_timeout(HANG);
        assert!(
            matches!(other, Ok(Ok("policy pass"))),
            "another change ran while the first waited: {other:?}"
        );

        let (stopped, uninstalled) = mpsc::channel();
        {
            let fence = fence.clone();
            std::thread::spawn(move || {
                fence.stop();
                stopped.send(()).ok();
            });
        }
        // Uninstall waits for the stuck change; a change asked for
        // meanwhile is refused, not queued behind it.
        let refused = loop {
            match fence.change(|| Ok(())) {
                Err(refused) => break refused,
                Ok(()) => std::thread::yield_now(),
            }
        };
        assert!(refused.to_string().contains("uninstalling"), "{refused}");
        assert!(
            uninstalled.try_recv().is_err(),
            "uninstall began with a change in progress"
        );
        release.send(()).expect("the stuck change still waits");
        assert!(stuck.join().expect("joined").is_ok());
        uninstalled
            .recv_timeout(HANG)
            .expect("uninstall goes on once the change is done");
    }

    #[test]
    fn a_change_that_panics_is_counted_out() {
        let fence = Arc::new(Fence::new());
        let panicking = fence.clone();
        let panicked = std::thread::spawn(move || {
            panicking.change(|| -> Result<(), Error> { panic!("a change that panics") })
        })
        .join();
        assert!(panicked.is_err());
        fence.stop();
        assert!(fence.change(|| Ok(())).is_err(), "none after stop");
    }
}
