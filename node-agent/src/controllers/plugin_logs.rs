//! The plugins' log records in the agent's log: the plugins the agent's
//! entries name send their records (`logSocket`, see `agent_wire::log`)
//! as datagrams to a Unix socket in the agent's run directory, as Istio's
//! plugin sends its records to its agent's `log.sock`; the agent writes
//! each as one of its own lines (`logging::plugin_record`), so `kubectl
//! logs` of the agent shows every ADD and DEL, its pod and its outcome.
//!
//! The agent looks for records on a tick ([`TICK`]) rather than waiting
//! on the socket: a reader waiting there (tokio's reactor too) is woken
//! by every send, while the plugin that sent still runs; a send to a
//! reader that is not waiting wakes no one. In the `logsock` bench phase
//! (900 calls per variant then) the chain's ADD p50 was 1.032 and 1.049
//! times the same chain without the socket with a waiting reader, and
//! 1.022 twice with this one (1.014 in the full `make bench` run of 1,500
//! calls). A record waits at most 20 ms (a second after a read error).
//! The reader's own work lands on the calls after the one that sent.
//!
//! Bounded by the kernel: a datagram socket queues at most
//! `net.unix.max_dgram_qlen` records (10 by default) before a sender's
//! non-blocking send is refused, and that sender writes the record to its
//! own stderr instead. From idle the queue holds what 20 ms bring (a
//! burst of more than 10 records, 500 a second, sends the rest to
//! stderr); after a look that found records the next comes sooner
//! ([`BUSY_TICK`]), 2,000 records a second. Distributions whose systemd
//! sets `max_dgram_qlen` to 512 hold far more. The agent holds one
//! record's buffer; what is not a record is counted and skipped.

use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use agent_wire::log::{MAX_DATAGRAM, Record};

use crate::logging;
use crate::run_socket;
use crate::settings::Settings;

/// Where the records come in.
#[derive(Debug, Clone)]
pub struct Options {
    /// `PLUGIN_LOG_SOCKET`; None: the plugins log to the runtime only.
    pub socket: Option<PathBuf>,
}

impl Options {
    pub fn from_settings(settings: &Settings) -> Options {
        Options {
            socket: settings.plugin_log_socket(),
        }
    }
}

/// How long the reader sleeps after a look that found nothing: the most
/// a record waits before it is in the agent's log.
pub const TICK: Duration = Duration::from_millis(20);

/// How long it sleeps after a look that found records: the queue's 10
/// records in this time are 2,000 a second.
pub const BUSY_TICK: Duration = Duration::from_millis(5);

/// What becomes of each record read: the agent writes it as its line.
pub type Sink = Box<dyn FnMut(&Record) + Send>;

/// The listener, reading until [`PluginLogs::stop`].
#[derive(Debug)]
pub struct PluginLogs {
    reading: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    bound: Option<run_socket::Bound>,
}

/// Listens on the socket, replacing a socket a former agent left there;
/// None when there is no socket to listen on (unset, or the place holds
/// something else: the plugins' records then stay in the runtime's log,
/// which is no reason to leave the node without its network).
pub fn start(options: &Options) -> Option<PluginLogs> {
    start_with(options, Box::new(logging::plugin_record))
}

/// [`start`], each record handed to `sink` (the bench measures the
/// agent's reader without writing its lines).
pub fn start_with(options: &Options, sink: Sink) -> Option<PluginLogs> {
    let path = options.socket.as_ref()?;
    let bound = run_socket::bind(path, |path| {
        let socket = UnixDatagram::bind(path)?;
        socket.set_nonblocking(true)?;
        Ok(socket)
    });
    let (socket, bound) = match bound {
        Ok(bound) => bound,
        Err(e) => {
            log::error!(
                "cannot listen for the plugins' log records on {}: {e}; they stay in the runtime's log",
                path.display()
            );
            return None;
        }
    };
    log::info!("the plugins' log records: {}", path.display());
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = stop.clone();
    let path = path.clone();
    // A thread of its own, sleeping between looks: a socket registered
    // with tokio's reactor would wake the reactor at every send.
    let reading = std::thread::Builder::new()
        .name("plugin-logs".into())
        .spawn(move || read(&socket, path, &stopping, sink));
    match reading {
        Ok(reading) => Some(PluginLogs {
            reading: Some(reading),
            stop,
            bound: Some(bound),
        }),
        Err(e) => {
            log::error!("cannot start reading the plugins' log records: {e}");
            None
        }
    }
}

impl PluginLogs {
    /// Removes the socket (a plugin from now on logs to its stderr), then
    /// writes what was queued before and stops: waits for at most one
    /// tick (a second after a read error).
    pub fn stop(mut self) {
        drop(self.bound.take());
        self.stop.store(true, Ordering::Release);
        if let Some(reading) = self.reading.take()
            && reading.join().is_err()
        {
            log::error!("reading the plugins' log records panicked");
        }
    }
}

impl Drop for PluginLogs {
    /// Not stopped: the reader ends at its next look.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Reads what is queued at each tick until told to stop, then what is
/// still queued.
fn read(socket: &UnixDatagram, path: PathBuf, stop: &AtomicBool, mut sink: Sink) {
    // One byte more than a record may have: a datagram that fills it was
    // cut, and is not read as a record.
    let mut buf = vec![0; MAX_DATAGRAM + 1];
    let mut skipped = Skipped::new(path);
    loop {
        let stopping = stop.load(Ordering::Acquire);
        let mut found = false;
        let pause = loop {
            match socket.recv(&mut buf) {
                Ok(len) => {
                    take(&buf[..len], &mut skipped, &mut sink);
                    found = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    break if found { BUSY_TICK } else { TICK };
                }
                Err(e) => {
                    log::warn!("reading the plugins' log records: {e}");
                    break Duration::from_secs(1);
                }
            }
        };
        if stopping {
            return;
        }
        std::thread::sleep(pause);
    }
}

/// One datagram: a record goes to the sink, anything else is counted.
fn take(datagram: &[u8], skipped: &mut Skipped, sink: &mut Sink) {
    match (datagram.len() <= MAX_DATAGRAM)
        .then(|| Record::decode(datagram))
        .flatten()
    {
        Some(record) => sink(&record),
        None => {
            skipped.one();
        }
    }
}

/// Datagrams that were no record: counted, and told of at the 1st, 2nd,
/// 4th, 8th... so a sender of garbage cannot flood the log.
#[derive(Debug)]
struct Skipped {
    path: PathBuf,
    count: u64,
}

impl Skipped {
    fn new(path: PathBuf) -> Skipped {
        Skipped { path, count: 0 }
    }

    /// Counts one; whether it was told of.
    fn one(&mut self) -> bool {
        self.count += 1;
        let told = self.count.is_power_of_two();
        if told {
            log::warn!(
                "{} datagram(s) on {} so far were no plugin's log record: skipped",
                self.count,
                self.path.display()
            );
        }
        told
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::path::Path;
    use std::sync::Mutex;
    use std::time::Instant;

    use super::*;

    fn record(msg: &str) -> Vec<u8> {
        let invocation = cni::env::Invocation {
            verb: "ADD".into(),
            ..Default::default()
        };
        Record::new("bridge", log::Level::Info, &invocation, "t".into(), msg.into()).encode()
    }

    #[test]
    fn records_are_read_on_the_next_tick_and_what_is_queued_at_stop_too() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log.sock");
        let read = Arc::new(Mutex::new(Vec::new()));
        let into = read.clone();
        let logs = start_with(
            &Options {
                socket: Some(path.clone()),
            },
            Box::new(move |record| into.lock().expect("lock").push(record.msg.clone())),
        )
        .expect("listening");
        let sender = UnixDatagram::unbound().expect("socket");
        let sent = Instant::now();
        for msg in ["ok 1", "ok 2", "ok 3"] {
            sender.send_to(&record(msg), &path).expect("queued");
        }
        while read.lock().expect("lock").len() < 3 {
            assert!(sent.elapsed() < Duration::from_secs(5), "not read");
            std::thread::sleep(Duration::from_millis(1));
        }
        for msg in ["ok 4", "ok 5"] {
            sender.send_to(&record(msg), &path).expect("queued");
        }
        logs.stop();
        assert_eq!(
            *read.lock().expect("lock"),
            ["ok 1", "ok 2", "ok 3", "ok 4", "ok 5"]
        );
    }

    #[test]
    fn malformed_datagrams_are_counted_and_told_of_ever_more_rarely() {
        let mut skipped = Skipped::new(PathBuf::from("/run/cni-suite/log.sock"));
        let told: Vec<u64> = (1..=20).filter(|_| skipped.one()).collect();
        assert_eq!(told.len(), 5, "1, 2, 4, 8, 16");
        assert_eq!(skipped.count, 20);
        let mut skipped = Skipped::new(PathBuf::from("/x"));
        let mut sink: Sink = Box::new(|record| panic!("no record: {record:?}"));
        for garbage in [&b"not json"[..], b"{}", &vec![b' '; MAX_DATAGRAM + 1]] {
            take(garbage, &mut skipped, &mut sink);
        }
        assert_eq!(skipped.count, 3);
    }

    #[test]
    fn a_former_agents_socket_is_replaced_and_anything_else_left_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("run/log.sock");
        std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        drop(UnixDatagram::bind(&path).expect("a former agent's socket"));
        let logs = start(&Options {
            socket: Some(path.clone()),
        })
        .expect("listening");
        let meta = std::fs::symlink_metadata(&path).expect("bound");
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let sender = UnixDatagram::unbound().expect("socket");
        sender.send_to(b"{}", &path).expect("a reader is there");
        logs.stop();
        assert!(std::fs::symlink_metadata(&path).is_err(), "removed at stop");

        for (what, make) in [
            (
                "a file",
                &(|p: &Path| std::fs::write(p, "someone's")) as &dyn Fn(&Path) -> io::Result<()>,
            ),
            ("a link", &|p: &Path| {
                std::os::unix::fs::symlink("/etc/hostname", p)
            }),
            ("a directory", &|p: &Path| std::fs::create_dir(p)),
        ] {
            make(&path).expect(what);
            assert!(
                start(&Options {
                    socket: Some(path.clone())
                })
                .is_none(),
                "{what}"
            );
            let kept = std::fs::symlink_metadata(&path).expect(what);
            assert!(!kept.file_type().is_socket(), "{what} is left as it is");
            if kept.is_dir() {
                std::fs::remove_dir(&path).expect("rmdir");
            } else {
                std::fs::remove_file(&path).expect("rm");
            }
        }
    }

    #[test]
    fn a_socket_a_newer_agent_bound_since_is_not_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log.sock");
        let options = Options {
            socket: Some(path.clone()),
        };
        let older = start(&options).expect("the older agent");
        let newer = start(&options).expect("the newer agent, replacing it");
        older.stop();
        assert!(
            std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_socket()),
            "the newer agent's socket stays"
        );
        newer.stop();
        assert!(std::fs::symlink_metadata(&path).is_err());
    }
}
