//! ztunnel standing in on the agent's ZDS socket (`pkg/zds`): it connects
//! as ztunnel does (`SOCK_SEQPACKET`, hello first), reads each request,
//! notes what it was and the inode of the netns that came with it (how a
//! test tells the pod's own namespace was handed over), and acks it with
//! what the test says (empty: success). A thread of its own reads; the
//! connection ends when the stand-in is dropped.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::socket::{AddressFamily, Shutdown, SockFlag, SockType, UnixAddr, connect, shutdown, socket};
use zds::{Request, Version, WorkloadRequest, WorkloadResponse, ZdsHello};

/// One request as ztunnel received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// `add`, `keep`, `del` or `snapshot`.
    pub kind: &'static str,
    pub uid: String,
    /// `namespace/name` of an add.
    pub pod: String,
    /// The inode of the netns an add carried.
    pub netns: Option<u64>,
}

/// A connected stand-in.
#[derive(Debug)]
pub struct Ztunnel {
    socket: Arc<OwnedFd>,
    seen: Arc<Mutex<Vec<Seen>>>,
    answer: Arc<Mutex<String>>,
}

/// The inode of the network namespace at `path`, as an add's netns is
/// compared with.
pub fn netns_inode(path: &Path) -> u64 {
    std::fs::metadata(path).expect("a netns").ino()
}

impl Ztunnel {
    /// Connects to the agent at `path` (retrying for up to 10 s while it
    /// is not there yet) and says hello.
    pub fn connect(path: &Path) -> Ztunnel {
        let deadline = Instant::now() + Duration::from_secs(10);
        let socket = loop {
            let socket = socket(
                AddressFamily::Unix,
                SockType::SeqPacket,
                SockFlag::SOCK_CLOEXEC,
                None,
            )
            .expect("a seqpacket socket");
            let address = UnixAddr::new(path).expect("a socket path");
            match connect(socket.as_raw_fd(), &address) {
                Ok(()) => break socket,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("connecting to {}: {e}", path.display()),
            }
        };
        let hello = ZdsHello {
            version: Version::V1 as i32,
        };
        zds::send(socket.as_fd(), &hello, None).expect("hello");
        let stand_in = Ztunnel {
            socket: Arc::new(socket),
            seen: Arc::default(),
            answer: Arc::default(),
        };
        let (socket, seen, answer) = (
            Arc::clone(&stand_in.socket),
            Arc::clone(&stand_in.seen),
            Arc::clone(&stand_in.answer),
        );
        std::thread::spawn(move || {
            while let Ok((request, fds)) = zds::receive::<WorkloadRequest>(socket.as_fd()) {
                let inode = fds.first().map(|fd| fd.inode().expect("the descriptor's inode"));
                let (kind, uid, pod) = match request.payload {
                    Some(Request::Add(add)) => {
                        let info = add.workload_info.unwrap_or_default();
                        ("add", add.uid, format!("{}/{}", info.namespace, info.name))
                    }
                    Some(Request::Keep(keep)) => ("keep", keep.uid, String::new()),
                    Some(Request::Del(del)) => ("del", del.uid, String::new()),
                    Some(Request::SnapshotSent(_)) => ("snapshot", String::new(), String::new()),
                    None => ("empty", String::new(), String::new()),
                };
                seen.lock().expect("seen").push(Seen {
                    kind,
                    uid,
                    pod,
                    netns: inode,
                });
                let error = answer.lock().expect("answer").clone();
                if zds::send(socket.as_fd(), &WorkloadResponse::ack(&error), None).is_err() {
                    break;
                }
            }
        });
        stand_in
    }

    /// What it acks from now on: empty for success, else ztunnel's error.
    pub fn answer(&self, error: &str) {
        *self.answer.lock().expect("answer") = error.to_owned();
    }

    /// Every request so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }

    /// Waits up to 10 s for a request of `kind` for `uid` (any uid for the
    /// snapshot's end).
    pub fn wait_for(&self, kind: &str, uid: &str) -> Seen {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = self
                .seen()
                .into_iter()
                .find(|seen| seen.kind == kind && (kind == "snapshot" || seen.uid == uid));
            if let Some(found) = found {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "no {kind} of {uid:?} in {:?}",
                self.seen()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Ztunnel {
    fn drop(&mut self) {
        // The reading thread holds the socket too: shutting it down ends
        // the connection for the agent and that thread's read.
        let _ = shutdown(self.socket.as_raw_fd(), Shutdown::Both);
    }
}
