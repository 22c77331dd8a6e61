//! The NetworkPolicy gate's socket (`POLICY_SOCKET`, the bridge entry's
//! `policySocket`; see `agent_wire::policy`): a pod's ADD tells the agent
//! the addresses it gave the pod and waits until the kernel holds the
//! pod's policy. Each connection carries one [`Admission`] in and one
//! [`Answer`] out; the controller decides the answer, this side only
//! reads, hands over and writes back, each within a bound, so a plugin
//! that never sends or never reads costs one small task for a few
//! seconds and no more.
//!
//! A gate that cannot listen (see `run_socket::Kept`) keeps the agent not
//! ready and `cni_suite_policy_gate_up` at 0 until it does.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use agent_wire::policy::{Admission, Answer, MAX_LINE, WAIT};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use crate::health::Health;
use crate::metrics::Metrics;
use crate::run_socket::Kept;

/// The most a plugin may take to send its line once connected.
const READ_WAIT: Duration = Duration::from_secs(1);

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
    socket: Kept,
}

impl Gate {
    /// Binds the socket at `path` now (see `run_socket::Kept`), or says
    /// why it cannot and tries again as the controller runs: meanwhile
    /// the bridge's ADD finds no one listening, and fails when its
    /// namespace has a policy; a pod of another namespace starts open
    /// until the API server reports its addresses.
    pub fn new(path: PathBuf, health: Health, metrics: Metrics) -> Gate {
        let said = (
            "NetworkPolicy",
            "new pods' ADDs wait on",
            "a new pod is open until its address reaches the agent",
        );
        let socket = Kept::new(path, said, move |listening| {
            health.set_gate_listening(listening);
            metrics.policy_gate_listening(listening);
        });
        Gate { socket }
    }

    /// The next connection, answered on a task of its own (the controller
    /// has the answer); every `LOOK_AGAIN`, the socket looked at or bound
    /// again instead.
    pub async fn accept(&mut self, asked: &mpsc::Sender<Asked>) {
        if let Some(stream) = self.socket.accept().await {
            tokio::spawn(answer(stream, asked.clone()));
        }
    }

    #[cfg(test)]
    fn look(&mut self) {
        self.socket.look();
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
