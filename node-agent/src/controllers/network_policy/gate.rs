//! The NetworkPolicy gate's socket (`POLICY_SOCKET`, the bridge entry's
//! `policySocket`; see the `policy-gate` crate): a pod's ADD tells the agent
//! the addresses it gave the pod and waits until the kernel holds the
//! pod's policy. Each connection carries one [`Admission`] in and one
//! [`Answer`] out; the controller decides the answer, this side only
//! reads, hands over and writes back, each within a bound, so a plugin
//! that never sends or never reads costs one small task for a few
//! seconds and no more.

use std::io;
use std::path::Path;
use std::time::Duration;

use policy_gate::{Admission, Answer, MAX_LINE, WAIT};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};

use crate::run_socket::{self, Bound};

/// The most a plugin may take to send its line once connected.
const READ_WAIT: Duration = Duration::from_secs(1);

/// An admission and where its answer goes.
#[derive(Debug)]
pub struct Asked {
    pub admission: Admission,
    pub answer: oneshot::Sender<Answer>,
}

/// The bound socket, listened on once the controller runs.
#[derive(Debug)]
pub struct Gate {
    listener: UnixListener,
    _bound: Bound,
}

impl Gate {
    /// Binds the socket (see `run_socket::bind`); None when that cannot
    /// be done: the bridge's ADD then finds no one listening and goes on
    /// at once, and new pods are open until the API server reports their
    /// addresses.
    pub fn bind(path: &Path) -> Option<Gate> {
        let bound = run_socket::bind(path, |path| {
            let listener = std::os::unix::net::UnixListener::bind(path)?;
            listener.set_nonblocking(true)?;
            UnixListener::from_std(listener)
        });
        match bound {
            Ok((listener, bound)) => {
                log::info!("NetworkPolicy: new pods' ADDs wait on {}", path.display());
                Some(Gate {
                    listener,
                    _bound: bound,
                })
            }
            Err(e) => {
                log::error!(
                    "NetworkPolicy: cannot listen on {}: {e}; a new pod is open until its address reaches the agent",
                    path.display()
                );
                None
            }
        }
    }

    /// The next connection, answered on a task of its own (the controller
    /// has the answer).
    pub async fn accept(&self, asked: &mpsc::Sender<Asked>) {
        match self.listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(answer(stream, asked.clone()));
            }
            Err(e) => {
                log::warn!("NetworkPolicy gate: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
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
