//! The node agent's log socket (`logSocket`, [`cni::conf::LOG_SOCKET_KEY`]):
//! besides stderr or `logFile`, a plugin sends each record as one JSON
//! datagram ([`Record`]) to the Unix datagram socket the key names, where
//! the agent reads them into its own log, as Istio's plugin sends its
//! records to its agent's `log.sock`. Unlike Istio's (HTTP over a stream
//! socket, with a timeout), the send never waits: the socket is
//! non-blocking, so a listener whose queue is full (one that never reads)
//! answers `EAGAIN` at once, and a socket nobody listens on `ENOENT` or
//! `ECONNREFUSED`; that record then goes to stderr or `logFile`. The cost
//! is one `socket()` per process, opened on the first record, and one
//! `sendto` per record.
//!
//! `cni::log` decides what goes to the socket and what to stderr or
//! `logFile`; it reaches the socket only through the [`Sink`] a plugin
//! gives it ([`cni::skel::Plugin::LOG_SOCKET`], set to [`open`]), so the
//! protocol crate knows nothing of this wire.

use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use cni::env::Invocation;
use cni::log::{Entry, Sink};

/// One record as it goes over the socket. Labels the invocation lacks
/// (GC and STATUS have no container; runtimes other than a kubelet's name
/// no pod) are left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// When the plugin logged it, `2026-11-22T04:01:43.123Z`.
    pub time: String,
    /// `error`, `warn`, `info`, `debug` or `trace`.
    pub level: String,
    /// The plugin's binary name.
    pub plugin: String,
    pub pid: u32,
    /// `CNI_COMMAND`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub verb: String,
    /// `CNI_CONTAINERID`.
    #[serde(default, rename = "containerID", skip_serializing_if = "String::is_empty")]
    pub container_id: String,
    /// `K8S_POD_NAMESPACE` of `CNI_ARGS`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_namespace: String,
    /// `K8S_POD_NAME` of `CNI_ARGS`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod_name: String,
    pub msg: String,
}

/// The largest datagram a plugin sends, and so the buffer a reader needs:
/// far below the kernel's limit for a Unix datagram (about the socket's
/// send buffer, 208 KiB by default), so a record is never refused for its
/// size.
pub const MAX_DATAGRAM: usize = 16 * 1024;

/// The most of a label (`CNI_CONTAINERID`, the pod's names) a record
/// carries: the runtime's values are far shorter, anything longer is not
/// theirs.
const MAX_LABEL: usize = 256;

/// The levels a record may carry, as the `log` crate names them.
const LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];

impl Record {
    /// A record of `invocation` by this process.
    pub fn new(
        plugin: &str,
        level: log::Level,
        invocation: &Invocation,
        time: String,
        msg: String,
    ) -> Record {
        let label = |text: &str| truncated(text, MAX_LABEL);
        Record {
            time,
            level: level.as_str().to_ascii_lowercase(),
            plugin: label(plugin),
            pid: std::process::id(),
            verb: label(&invocation.verb),
            container_id: label(&invocation.container_id),
            pod_namespace: label(&invocation.pod_namespace),
            pod_name: label(&invocation.pod_name),
            msg,
        }
    }

    /// The datagram: JSON of at most [`MAX_DATAGRAM`] bytes, the message
    /// shortened (and marked so) when the whole would be longer.
    pub fn encode(&self) -> Vec<u8> {
        let mut record = self.clone();
        let mut keep = record.msg.len();
        loop {
            let bytes = serde_json::to_vec(&record).unwrap_or_default();
            if bytes.len() <= MAX_DATAGRAM || keep == 0 {
                return bytes;
            }
            // Escapes can make the JSON six times the text: halving
            // converges in a few rounds whatever the message holds.
            keep /= 2;
            record.msg = format!("{}…", truncated(&self.msg, keep));
        }
    }

    /// A datagram read back; None unless it is a record (JSON of this
    /// shape with a known level).
    pub fn decode(datagram: &[u8]) -> Option<Record> {
        let record: Record = serde_json::from_slice(datagram).ok()?;
        LEVELS.contains(&record.level.as_str()).then_some(record)
    }

    /// The record's level, as the `log` crate has it.
    pub fn log_level(&self) -> Option<log::Level> {
        self.level.parse().ok()
    }
}

/// At most `limit` bytes of `text`, cut at a character's boundary.
fn truncated(text: &str, limit: usize) -> String {
    let mut end = limit.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// The sending end: the path the configuration names, and the process's
/// one socket, opened on the first send.
#[derive(Debug)]
pub struct LogSocket {
    path: PathBuf,
    /// None until the first send; then the socket, or why there is none
    /// (not tried again: a process that cannot make one will not later).
    socket: Option<Result<UnixDatagram, io::ErrorKind>>,
}

impl LogSocket {
    pub fn new(path: impl Into<PathBuf>) -> LogSocket {
        LogSocket {
            path: path.into(),
            socket: None,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends one datagram without waiting. An error means the listener did
    /// not take it: `WouldBlock` (its queue is full), `NotFound` or
    /// `ConnectionRefused` (nobody listens), or any other reason.
    pub fn send(&mut self, datagram: &[u8]) -> io::Result<()> {
        let socket = self
            .socket
            .get_or_insert_with(|| nonblocking_socket().map_err(|e| e.kind()));
        match socket {
            Ok(socket) => socket.send_to(datagram, &self.path).map(drop),
            Err(kind) => Err(io::Error::from(*kind)),
        }
    }
}

impl Sink for LogSocket {
    fn send(&mut self, entry: Entry<'_>) -> bool {
        let record = Record::new(entry.plugin, entry.level, entry.invocation, entry.time, entry.msg);
        LogSocket::send(self, &record.encode()).is_ok()
    }
}

/// The plugin's [`cni::log::OpenSink`]: the sending end to the agent's
/// socket at `path`, opened on its first record.
pub fn open(path: &Path) -> Box<dyn Sink> {
    Box::new(LogSocket::new(path))
}

/// An unbound datagram socket whose sends never wait (`O_NONBLOCK`, what
/// `MSG_DONTWAIT` gives a single send: std has no send with flags, and
/// the crate has no `unsafe` for libc's).
fn nonblocking_socket() -> io::Result<UnixDatagram> {
    let socket = UnixDatagram::unbound()?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// The labels of a pod's ADD (how the environment becomes them is
    /// `cni::env`'s to test).
    fn pod_add() -> Invocation {
        Invocation {
            verb: "ADD".into(),
            container_id: "1a2b3c4d5e6f7a8b".into(),
            pod_namespace: "default".into(),
            pod_name: "web-1".into(),
        }
    }

    fn record(msg: &str) -> Record {
        Record::new(
            "bridge",
            log::Level::Info,
            &pod_add(),
            "2026-11-22T04:01:43.123Z".into(),
            msg.into(),
        )
    }

    #[test]
    fn records_are_json_with_every_label_and_read_back() {
        let sent = record("ok, 10.244.1.5/24");
        let datagram = sent.encode();
        let json: serde_json::Value = serde_json::from_slice(&datagram).expect("JSON");
        assert_eq!(
            json,
            serde_json::json!({"time": "2026-11-22T04:01:43.123Z", "level": "info", "plugin": "bridge",
                "pid": std::process::id(), "verb": "ADD", "containerID": "1a2b3c4d5e6f7a8b",
                "podNamespace": "default", "podName": "web-1", "msg": "ok, 10.244.1.5/24"})
        );
        assert_eq!(Record::decode(&datagram), Some(sent));
        let without_pod = Record::new(
            "host-local",
            log::Level::Warn,
            &Invocation::default(),
            "t".into(),
            "m".into(),
        );
        let json: serde_json::Value = serde_json::from_slice(&without_pod.encode()).expect("JSON");
        assert!(
            json.get("podName").is_none() && json.get("verb").is_none(),
            "{json}"
        );
    }

    #[test]
    fn what_is_not_a_record_is_not_read_as_one() {
        for bad in [
            &b"not json"[..],
            b"{}",
            br#"{"time":"t","level":"loud","plugin":"p","pid":1,"msg":"m"}"#,
            br#"{"time":"t","level":"info","plugin":"p","pid":-1,"msg":"m"}"#,
            b"\xff\xfe",
        ] {
            assert_eq!(Record::decode(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_long_message_is_shortened_to_fit_one_datagram() {
        for text in ["é".repeat(40_000), "\u{1}".repeat(40_000)] {
            let datagram = record(&text).encode();
            assert!(datagram.len() <= MAX_DATAGRAM, "{}", datagram.len());
            let read = Record::decode(&datagram).expect("a record");
            assert!(
                read.msg.ends_with('…') && read.msg.len() > 1000,
                "{}",
                read.msg.len()
            );
        }
    }

    #[test]
    fn a_socket_nobody_listens_on_refuses_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log.sock");
        let mut missing = LogSocket::new(&path);
        assert_eq!(
            missing.send(b"x").expect_err("no socket").kind(),
            io::ErrorKind::NotFound
        );
        // Bound once, its listener gone: the file stays, nobody reads.
        drop(UnixDatagram::bind(&path).expect("bind"));
        assert_eq!(
            missing.send(b"x").expect_err("nobody listens").kind(),
            io::ErrorKind::ConnectionRefused
        );
    }

    #[test]
    fn a_listener_that_never_reads_delays_no_send() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log.sock");
        let listener = UnixDatagram::bind(&path).expect("bind");
        let mut socket = LogSocket::new(&path);
        let datagram = record("ok").encode();
        let mut taken = 0;
        while socket.send(&datagram).is_ok() {
            taken += 1;
            assert!(taken < 100_000, "the queue never filled");
        }
        assert!(taken > 0, "the listener took records until its queue was full");
        // A hang detector, not a measurement: each further send answers at once.
        let started = Instant::now();
        for _ in 0..200 {
            let refused = socket.send(&datagram).expect_err("the queue is full");
            assert_eq!(refused.kind(), io::ErrorKind::WouldBlock);
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        // What was taken is there to read.
        let mut buf = vec![0; MAX_DATAGRAM];
        let n = listener.recv(&mut buf).expect("a record");
        assert_eq!(Record::decode(&buf[..n]).map(|r| r.msg), Some("ok".into()));
    }
}
