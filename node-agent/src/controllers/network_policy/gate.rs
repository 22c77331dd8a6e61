//! The NetworkPolicy gate's socket (`POLICY_SOCKET`, the bridge entry's
//! `policySocket`; see `agent_wire::policy`): a pod's ADD tells the agent
//! the addresses it gave the pod and waits until the kernel holds the
//! pod's policy. Each connection carries one [`Admission`] in and one
//! [`Answer`] out; the controller decides the answer, this side only
//! reads, hands over and writes back, each within a bound, so a plugin
//! that never sends or never reads costs one small task for a few
//! seconds and no more.
//!
//! A gate that cannot listen (something left at the path that is not a
//! former agent's socket: a file, a directory, a link, another user's
//! socket) leaves that in place, keeps the agent not ready and
//! `cni_suite_policy_gate_up` at 0, and tries again every [`LOOK_AGAIN`];
//! a listening gate looks as often whether its socket is still there, and
//! binds again when someone removed it. One a newer agent of a rollout
//! replaced is left to that agent.

use std::io;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use agent_wire::policy::{Admission, Answer, MAX_LINE, WAIT};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};

use crate::health::Health;
use crate::metrics::Metrics;
use crate::run_socket::{self, Bound, Place};

/// The most a plugin may take to send its line once connected.
const READ_WAIT: Duration = Duration::from_secs(1);

/// How often a gate that cannot listen tries again, and a listening one
/// looks whether its socket is still at its path.
const LOOK_AGAIN: Duration = Duration::from_secs(5);

/// An admission and where its answer goes.
#[derive(Debug)]
pub struct Asked {
    pub admission: Admission,
    pub answer: oneshot::Sender<Answer>,
}

/// The gate's socket, listened on once the controller runs, or the
/// attempts to bind it.
#[derive(Debug)]
pub struct Gate {
    path: PathBuf,
    listening: Option<Listening>,
    /// Whether a socket of the agent's user at the path may be replaced:
    /// at start (a former agent's, or the one of the agent this one
    /// replaces in a rollout), no longer once another took the place of
    /// this agent's (two agents would take it from each other in turn).
    may_replace: bool,
    next_look: Instant,
    /// Why it does not listen, said when it first shows.
    problem: Option<String>,
    health: Health,
    metrics: Metrics,
}

#[derive(Debug)]
struct Listening {
    listener: UnixListener,
    bound: Bound,
}

impl Gate {
    /// Binds the socket at `path` now (see `run_socket::bind`), or says
    /// why it cannot and tries again as the controller runs: meanwhile
    /// the bridge's ADD finds no one listening, and fails when its
    /// namespace has a policy; a pod of another namespace starts open
    /// until the API server reports its addresses.
    pub fn new(path: PathBuf, health: Health, metrics: Metrics) -> Gate {
        let mut gate = Gate {
            path,
            listening: None,
            may_replace: true,
            next_look: Instant::now(),
            problem: None,
            health,
            metrics,
        };
        gate.bind();
        gate
    }

    /// The next connection, answered on a task of its own (the controller
    /// has the answer); every [`LOOK_AGAIN`], the socket looked at or
    /// bound again instead.
    pub async fn accept(&mut self, asked: &mpsc::Sender<Asked>) {
        let look = tokio::time::sleep_until(self.next_look.into());
        let accepted = match &self.listening {
            Some(listening) => tokio::select! {
                accepted = listening.listener.accept() => Some(accepted),
                () = look => None,
            },
            None => {
                look.await;
                None
            }
        };
        match accepted {
            Some(Ok((stream, _))) => {
                tokio::spawn(answer(stream, asked.clone()));
            }
            Some(Err(e)) => {
                log::warn!("NetworkPolicy gate: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None => self.look(),
        }
    }

    /// Whether the socket is still there; binds it when it is not.
    fn look(&mut self) {
        let Some(listening) = &self.listening else {
            self.bind();
            return;
        };
        self.next_look = Instant::now() + LOOK_AGAIN;
        match listening.bound.place() {
            Place::Ours => {}
            Place::Empty => {
                log::warn!(
                    "NetworkPolicy: {} was removed; binding it again",
                    self.path.display()
                );
                self.listening = None;
                self.bind();
            }
            Place::Taken => {
                self.may_replace = false;
                self.listening = None;
                self.bind();
            }
        }
    }

    fn bind(&mut self) {
        self.next_look = Instant::now() + LOOK_AGAIN;
        let path = self.path.display();
        let taken = !self.may_replace
            && std::fs::symlink_metadata(&self.path)
                .map_or_else(|e| e.kind() != io::ErrorKind::NotFound, |_| true);
        if taken {
            let problem = format!(
                "{path} is no longer this agent's socket (a newer agent's, or something put there); \
                 it is bound again only once it is gone"
            );
            self.down(problem, log::Level::Warn);
            return;
        }
        let bound = run_socket::bind(&self.path, |path| {
            let listener = std::os::unix::net::UnixListener::bind(path)?;
            listener.set_nonblocking(true)?;
            UnixListener::from_std(listener)
        });
        match bound {
            Ok((listener, bound)) => {
                log::info!("NetworkPolicy: new pods' ADDs wait on {path}");
                self.listening = Some(Listening { listener, bound });
                self.problem = None;
                self.health.set_gate_listening(true);
                self.metrics.policy_gate_listening(true);
            }
            Err(e) => {
                let problem = format!(
                    "cannot listen on {path}: {e}; a new pod is open until its address reaches the agent; \
                     trying again every {LOOK_AGAIN:?}"
                );
                self.down(problem, log::Level::Error);
            }
        }
    }

    /// Not listening, for `problem`: said when it first shows.
    fn down(&mut self, problem: String, level: log::Level) {
        self.health.set_gate_listening(false);
        self.metrics.policy_gate_listening(false);
        if self.problem.as_ref() != Some(&problem) {
            log::log!(level, "NetworkPolicy: {problem}");
            self.problem = Some(problem);
        }
    }
}

/// Reads one admission, hands it to the controller, writes its answer.
async fn answer(stream: UnixStream, asked: mpsc::Sender<Asked>) {
    let (read, mut write) = stream.into_split();
    let admission = match tokio::time::timeout(READ_WAIT, read_admission(read)).await {
        Ok(Ok(admission)) => admission,
        Ok(Err(e)) => {
            log::warn!("NetworkPolicy gate: {e}");
            return;
        }
        Err(_) => {
            log::warn!("NetworkPolicy gate: a plugin connected and sent nothing in {READ_WAIT:?}");
            return;
        }
    };
    let (tx, rx) = oneshot::channel();
    let decided = async {
        asked
            .send(Asked {
                admission,
                answer: tx,
            })
            .await
            .ok()?;
        rx.await.ok()
    };
    let answer = match tokio::time::timeout(WAIT, decided).await {
        Ok(Some(answer)) => answer,
        Ok(None) => Answer::NotEnforced {
            reason: "the agent's NetworkPolicy controller is stopping".into(),
        },
        Err(_) => Answer::NotEnforced {
            reason: format!("no decision in {WAIT:?}"),
        },
    };
    let Ok(mut line) = serde_json::to_vec(&answer) else {
        return;
    };
    line.push(b'\n');
    // A plugin gone by now has logged that it was not confirmed.
    let _ = tokio::time::timeout(READ_WAIT, write.write_all(&line)).await;
}

/// One line, at most [`MAX_LINE`] bytes, as an admission.
async fn read_admission(read: tokio::net::unix::OwnedReadHalf) -> io::Result<Admission> {
    let mut line = Vec::new();
    BufReader::new(read.take(MAX_LINE as u64))
        .read_until(b'\n', &mut line)
        .await?;
    serde_json::from_slice(line.trim_ascii_end())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("not an admission: {e}")))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    use super::*;

    /// Ready in every other way, so only the gate decides.
    fn ready_but_for_the_gate() -> Health {
        let health = Health::default();
        health.set_installed(true);
        health.set_network_not_ours();
        health.set_chained(true);
        health
    }

    fn gate_up(metrics: &Metrics) -> Option<String> {
        metrics
            .scrape(true)
            .lines()
            .find_map(|line| line.strip_prefix("cni_suite_policy_gate_up ").map(str::to_owned))
    }

    #[tokio::test]
    async fn a_file_in_the_way_is_left_as_it_is_and_the_gate_down_until_it_goes() {
        let scratch = tempfile::tempdir().expect("a scratch directory");
        let path = scratch.path().join("policy.sock");
        std::fs::write(&path, "someone's").expect("a file");
        let (health, metrics) = (ready_but_for_the_gate(), Metrics::new(None));
        let mut gate = Gate::new(path.clone(), health.clone(), metrics.clone());
        let reason = health.not_ready().unwrap_or_default();
        assert!(reason.contains("NetworkPolicy gate"), "{reason}");
        assert_eq!(gate_up(&metrics).as_deref(), Some("0"));
        gate.look();
        assert_eq!(std::fs::read_to_string(&path).expect("still there"), "someone's");

        std::fs::remove_file(&path).expect("removed");
        gate.look();
        assert_eq!(health.not_ready(), None);
        assert_eq!(gate_up(&metrics).as_deref(), Some("1"));
        let meta = std::fs::symlink_metadata(&path).expect("bound");
        assert!(meta.file_type().is_socket());
    }

    #[tokio::test]
    async fn a_socket_removed_is_bound_again_and_one_a_newer_agent_bound_left_to_it() {
        let scratch = tempfile::tempdir().expect("a scratch directory");
        let path = scratch.path().join("policy.sock");
        let (health, metrics) = (ready_but_for_the_gate(), Metrics::new(None));
        let mut gate = Gate::new(path.clone(), health.clone(), metrics.clone());
        assert_eq!(health.not_ready(), None);

        std::fs::remove_file(&path).expect("removed");
        gate.look();
        assert!(std::fs::symlink_metadata(&path).is_ok(), "bound again");
        assert_eq!(health.not_ready(), None);

        // A newer agent of a rollout replaces it with its own.
        std::fs::remove_file(&path).expect("removed");
        let newer = std::os::unix::net::UnixListener::bind(&path).expect("the newer agent's");
        let inode = std::fs::symlink_metadata(&path).expect("bound").ino();
        for _ in 0..2 {
            gate.look();
            assert_eq!(std::fs::symlink_metadata(&path).expect("there").ino(), inode);
            assert!(health.not_ready().is_some());
            assert_eq!(gate_up(&metrics).as_deref(), Some("0"));
        }
        drop(newer);
        std::fs::remove_file(&path).expect("the newer agent's, removed at its stop");
        gate.look();
        assert_eq!(health.not_ready(), None, "bound once it went");
    }
}
