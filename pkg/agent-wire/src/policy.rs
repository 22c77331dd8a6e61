//! The node agent's NetworkPolicy gate (`policySocket`,
//! [`cni::conf::POLICY_SOCKET_KEY`]). A pod's first packet may leave
//! before its address reaches the agent through the API server (kubelet
//! posts `status.podIPs` up to a second or more after the sandbox is up,
//! and the container may connect at once: Kubernetes' own NetworkPolicy
//! tests do). So the plugin whose entry names the socket (the bridge)
//! tells the agent, at the end of a successful ADD, which pod got which
//! addresses, and waits until the agent answers that the kernel holds that
//! pod's policy.
//!
//! The wait is bounded ([`WAIT`]). When the agent does not confirm (none
//! listens: stopped, being upgraded; or it answers that it could not), the
//! ADD fails closed if the pod's namespace has a NetworkPolicy, as the
//! agent records in the kernel beside the policy ([`guarded`]): the pod
//! might be isolated, and it is never started open; the runtime retries
//! the sandbox. A pod of a namespace without policies goes on, open until
//! the agent learns its address, as it would be anyway. What did not go as
//! asked is logged at `warn`, so the agent's log (through `logSocket`) and
//! the runtime's show it.
//!
//! The wire: one JSON line each way over a Unix stream socket ([`Admission`]
//! then [`Answer`]); the agent closes after answering.

pub mod guarded;

use std::io::{self, Write};
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use cni::env::Invocation;

use crate::stream::{Deadline, connect_within, read_until};

/// The most an ADD waits for the agent's answer.
pub const WAIT: Duration = Duration::from_secs(3);

/// The most a line of either side may have: a pod's names are at most 253
/// and 63 bytes, its addresses a few.
pub const MAX_LINE: usize = 4096;

/// What the plugin tells the agent: the pod and the addresses its ADD gave.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Admission {
    pub pod_namespace: String,
    pub pod_name: String,
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ips: Vec<IpAddr>,
}

/// What the agent answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "answer")]
pub enum Answer {
    /// The kernel holds what the policies ask of this pod's addresses
    /// (isolated, or open when no policy selects it).
    Enforced,
    /// Not confirmed: why (the agent has not listed the cluster yet, has
    /// not seen the Pod, or could not change the table).
    NotEnforced { reason: String },
}

/// Tells the agent at `socket` about the pod `invocation` names and waits
/// for its answer. Nothing is asked for a call that names no pod (not a
/// kubelet's runtime) or an ADD that gave no address. An error (why the
/// pod must not start) when the agent does not confirm and the pod's
/// namespace has a policy, or that cannot be known; otherwise what went
/// wrong is logged.
pub fn admit(socket: &Path, invocation: &Invocation, ips: Vec<IpAddr>) -> Result<(), String> {
    if invocation.pod_namespace.is_empty() || invocation.pod_name.is_empty() || ips.is_empty() {
        return Ok(());
    }
    let admission = Admission {
        pod_namespace: invocation.pod_namespace.clone(),
        pod_name: invocation.pod_name.clone(),
        container_id: invocation.container_id.clone(),
        ips,
    };
    let why = match ask(socket, &admission, WAIT) {
        Ok(Answer::Enforced) => return Ok(()),
        Ok(Answer::NotEnforced { reason }) => format!("not confirmed by the node agent: {reason}"),
        Err(e) => format!("not confirmed: {}: {e}", socket.display()),
    };
    let namespace = &admission.pod_namespace;
    match guarded::has_policy(namespace) {
        Ok(false) => {
            log::warn!(
                "NetworkPolicy of this pod {why}; no policy is recorded for namespace {namespace}, so it starts, open until the agent knows its address"
            );
            Ok(())
        }
        Ok(true) => Err(format!(
            "NetworkPolicy of pod {namespace}/{} {why}; namespace {namespace} has NetworkPolicies, so the pod is not started before its policy is in the kernel (the runtime retries)",
            admission.pod_name
        )),
        Err(e) => Err(format!(
            "NetworkPolicy of pod {namespace}/{} {why}; and whether namespace {namespace} has NetworkPolicies cannot be read ({e}), so the pod is not started (the runtime retries)",
            admission.pod_name
        )),
    }
}

/// One exchange with the agent, all of it within `wait`: the connect, the
/// line sent and every read of the answer (an agent that answers a byte
/// at a time, or accepts nothing, costs `wait` and no more).
pub fn ask(socket: &Path, admission: &Admission, wait: Duration) -> io::Result<Answer> {
    let deadline = Deadline::after(wait);
    let mut stream = connect_within(socket, wait)?;
    stream.set_write_timeout(Some(deadline.left()?))?;
    let mut line = serde_json::to_vec(admission).map_err(io::Error::other)?;
    line.push(b'\n');
    stream.write_all(&line)?;
    let answer = read_until(&mut stream, deadline, MAX_LINE, |read| read.contains(&b'\n'))?;
    let first_line = answer.split(|b| *b == b'\n').next().unwrap_or_default();
    serde_json::from_slice(first_line.trim_ascii_end()).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("no answer the plugin reads: {e}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::os::unix::net::UnixListener;
    use std::time::Instant;

    use super::*;

    fn admission() -> Admission {
        Admission {
            pod_namespace: "default".into(),
            pod_name: "client-1".into(),
            container_id: "c1".into(),
            ips: vec!["10.244.1.5".parse().expect("ip"), "fd00::5".parse().expect("ip")],
        }
    }

    #[test]
    fn one_line_each_way() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policy.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let agent = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            let mut line = String::new();
            BufReader::new(&stream).read_line(&mut line).expect("read");
            let asked: Admission = serde_json::from_str(&line).expect("an admission");
            (&stream)
                .write_all(b"{\"answer\":\"enforced\"}\n")
                .expect("answer");
            asked
        });
        let answer = ask(&path, &admission(), WAIT).expect("answered");
        assert_eq!(answer, Answer::Enforced);
        assert_eq!(agent.join().expect("agent"), admission());
        let not: Answer =
            serde_json::from_str(r#"{"answer":"notEnforced","reason":"not listed"}"#).expect("parse");
        assert_eq!(
            not,
            Answer::NotEnforced {
                reason: "not listed".into()
            }
        );
    }

    #[test]
    fn no_agent_is_refused_at_once_and_a_silent_one_is_left_in_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policy.sock");
        let started = Instant::now();
        assert!(ask(&path, &admission(), WAIT).is_err(), "nothing listens");
        drop(UnixListener::bind(&path).expect("bind"));
        assert!(
            ask(&path, &admission(), WAIT).is_err(),
            "a socket nobody listens on"
        );
        assert!(started.elapsed() < Duration::from_millis(500));

        std::fs::remove_file(&path).expect("rm");
        let silent = crate::stream::silent_agent(&path);
        let started = Instant::now();
        let err = ask(&path, &admission(), Duration::from_millis(300)).expect_err("no answer");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
            "{waited:?}: {err}"
        );
        silent.join().expect("silent agent");
    }

    #[test]
    fn an_answer_a_byte_at_a_time_is_left_in_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policy.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let trickling = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            // A space every 100 ms, never a line's end, until the plugin
            // leaves.
            while stream.write_all(b" ").is_ok() {
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let started = Instant::now();
        let err = ask(&path, &admission(), Duration::from_millis(500)).expect_err("no line");
        let waited = started.elapsed();
        assert!(waited < Duration::from_secs(3), "{waited:?}: {err}");
        trickling.join().expect("trickling agent");
    }

    #[test]
    fn an_agent_that_accepts_nothing_is_left_in_time() {
        use nix::sys::socket::{self as sock, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policy.sock");
        let listener = sock::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .expect("socket");
        sock::bind(
            std::os::fd::AsRawFd::as_raw_fd(&listener),
            &UnixAddr::new(&path).expect("address"),
        )
        .expect("bind");
        // The queue full after a connection or two, and nobody accepts.
        sock::listen(&listener, Backlog::new(0).expect("backlog")).expect("listen");
        let started = Instant::now();
        let mut refused = None;
        let mut queued = Vec::new();
        for _ in 0..8 {
            match connect_within(&path, Duration::from_millis(300)) {
                Ok(stream) => queued.push(stream),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let waited = started.elapsed();
        let refused = refused.expect("a full queue refuses a connect");
        assert!(waited < Duration::from_secs(3), "{waited:?}: {refused}");
        let err = ask(&path, &admission(), Duration::from_millis(300)).expect_err("the queue is full");
        assert!(started.elapsed() < Duration::from_secs(5), "{err}");
        drop(queued);
    }
}
