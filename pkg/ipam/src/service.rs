//! The node-local lease service (`host-local serve`): one long-lived process
//! that keeps every network's database open, so an ADD does not pay sled's
//! start-up (about 10 ms) in each plugin process. It takes the same per-
//! network lock for every operation as a direct invocation does, so both
//! paths can be used side by side, and flushes before it answers.
//!
//! Protocol: the client connects to a Unix socket (mode 0600, root only),
//! writes one JSON request and shuts its side down; the service answers with
//! one JSON response and closes. A plugin request carries the invocation's
//! CNI_* variables and stdin; the service runs the same verb code a direct
//! invocation would and returns what it would have printed.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::Duration;

use cni::skel::Reply;
use cni::{Error as CniError, Version};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::admin::{self, AdminOp};
use crate::store::Stores;

/// How long a client waits for an answer (a busy network's lock may be
/// held by a burst of ADDs).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the service waits for a client to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_REQUEST: u64 = 16 << 20;

/// The CNI variables a plugin request forwards.
pub const FORWARDED_ENV: [&str; 7] = [
    "CNI_COMMAND",
    "CNI_CONTAINERID",
    "CNI_NETNS",
    "CNI_IFNAME",
    "CNI_ARGS",
    "CNI_PATH",
    "CNI_NETNS_OVERRIDE",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Request {
    Plugin {
        env: BTreeMap<String, String>,
        stdin: String,
    },
    Admin {
        #[serde(rename = "dataDir")]
        data_dir: PathBuf,
        network: String,
        #[serde(flatten)]
        op: AdminOp,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<CniError>,
    #[serde(default, rename = "cniVersion", skip_serializing_if = "Option::is_none")]
    pub version: Option<Version>,
}

impl Response {
    pub fn from_reply(reply: Reply) -> Self {
        match reply {
            Reply::Document(doc) => Response {
                document: Some(doc),
                error: None,
                version: None,
            },
            Reply::Done | Reply::About(_) => Response {
                document: None,
                error: None,
                version: None,
            },
            Reply::Failed(e, v) => Response {
                document: None,
                error: Some(e),
                version: Some(v),
            },
        }
    }

    pub fn into_reply(self) -> Reply {
        match (self.error, self.document) {
            (Some(e), _) => Reply::Failed(e, self.version.unwrap_or(Version::LATEST)),
            (None, Some(doc)) => Reply::Document(doc),
            (None, None) => Reply::Done,
        }
    }

    fn admin(outcome: Result<Value, crate::Error>) -> Self {
        match outcome {
            Ok(doc) => Response {
                document: Some(doc),
                error: None,
                version: None,
            },
            Err(e) => Response {
                document: None,
                error: Some(e.into()),
                version: None,
            },
        }
    }
}

/// Why a call did not produce an answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// Nothing listens there: use the database directly.
    #[error("lease service unreachable at {path}: {source}")]
    Unreachable {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The service took the request but gave no whole answer (it died, or
    /// timed out). Whether the operation happened is unknown; every verb is
    /// safe to repeat.
    #[error("lease service at {path} gave no answer: {reason}")]
    Broken { path: PathBuf, reason: String },
}

/// Sends one request to the service at `socket`.
pub fn call(socket: &Path, request: &Request) -> Result<Response, CallError> {
    let broken = |reason: String| CallError::Broken {
        path: socket.to_path_buf(),
        reason,
    };
    let mut stream = UnixStream::connect(socket).map_err(|source| CallError::Unreachable {
        path: socket.to_path_buf(),
        source,
    })?;
    let body = serde_json::to_vec(request).map_err(|e| broken(e.to_string()))?;
    stream
        .set_read_timeout(Some(CLIENT_TIMEOUT))
        .and_then(|()| stream.write_all(&body))
        .and_then(|()| stream.shutdown(std::net::Shutdown::Write))
        .map_err(|e| broken(e.to_string()))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .map_err(|e| broken(e.to_string()))?;
    serde_json::from_slice(&answer).map_err(|e| broken(format!("unreadable answer: {e}")))
}

/// Binds the service socket: its directory 0700, the socket 0600. A socket
/// file nobody answers on is left from a previous run and replaced; one
/// that answers means a service already runs.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("a lease service already listens on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// What the service runs for a plugin request: the plugin's own dispatch.
pub type PluginHandler = dyn Fn(&BTreeMap<String, String>, Vec<u8>) -> Reply + Send + Sync;

/// Serves until the listener fails. Each connection is answered on a
/// thread of its own, as many at once as clients come; a thread that has
/// answered waits for the next connection instead of exiting, because a new
/// thread starts with an empty heap and first takes over what exited ones
/// left, which with a large network's pages cached cost more than the call.
pub fn serve(listener: UnixListener, stores: Arc<Stores>, plugin: Arc<PluginHandler>) -> io::Result<()> {
    let workers = Workers::new(stores, plugin);
    for connection in listener.incoming() {
        match connection {
            Ok(stream) => workers.dispatch(stream),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// How many answering threads may wait for work; a burst's others end.
const MAX_IDLE_WORKERS: usize = 16;

/// Threads that answer connections and then wait for the next one.
struct Workers {
    stores: Arc<Stores>,
    plugin: Arc<PluginHandler>,
    queue: mpsc::Sender<UnixStream>,
    waiting: Arc<Mutex<mpsc::Receiver<UnixStream>>>,
    /// Threads waiting for a connection that nobody has been handed yet.
    /// Only `dispatch` takes from it, so a connection sent while it is
    /// above zero never waits behind a call in progress.
    idle: Arc<AtomicUsize>,
}

impl Workers {
    fn new(stores: Arc<Stores>, plugin: Arc<PluginHandler>) -> Self {
        let (queue, waiting) = mpsc::channel();
        Workers {
            stores,
            plugin,
            queue,
            waiting: Arc::new(Mutex::new(waiting)),
            idle: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn dispatch(&self, mut stream: UnixStream) {
        let claimed = self
            .idle
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if claimed {
            match self.queue.send(stream) {
                Ok(()) => return,
                Err(mpsc::SendError(unsent)) => stream = unsent,
            }
        }
        let (stores, plugin) = (Arc::clone(&self.stores), Arc::clone(&self.plugin));
        let (waiting, idle) = (Arc::clone(&self.waiting), Arc::clone(&self.idle));
        std::thread::spawn(move || {
            let mut next = Some(stream);
            while let Some(mut stream) = next.take() {
                if let Err(e) = answer(&mut stream, &stores, plugin.as_ref()) {
                    log::warn!("lease service: {e}");
                }
                // Counted idle before the client sees the connection close,
                // so its next call finds this thread rather than a new one;
                // past `MAX_IDLE_WORKERS` (after a burst) the thread ends.
                let stays = idle
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        (n < MAX_IDLE_WORKERS).then_some(n + 1)
                    })
                    .is_ok();
                drop(stream);
                if !stays {
                    break;
                }
                next = waiting.lock().unwrap_or_else(PoisonError::into_inner).recv().ok();
            }
        });
    }
}

/// Only root, or the service's own user, may talk to it; the socket's mode
/// says so too, this holds even if the mode is changed.
fn peer_allowed(stream: &UnixStream) -> bool {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let own = nix::unistd::geteuid().as_raw();
    getsockopt(stream, PeerCredentials).is_ok_and(|cred| cred.uid() == 0 || cred.uid() == own)
}

fn answer(stream: &mut UnixStream, stores: &Stores, plugin: &PluginHandler) -> io::Result<()> {
    if !peer_allowed(stream) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "refused a client that is not root",
        ));
    }
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    let mut body = Vec::new();
    stream.take(MAX_REQUEST).read_to_end(&mut body)?;
    if body.is_empty() {
        // A connection that says nothing is a liveness probe.
        return Ok(());
    }
    let response = match serde_json::from_slice::<Request>(&body) {
        Ok(Request::Plugin { env, stdin }) => Response::from_reply(plugin(&env, stdin.into_bytes())),
        Ok(Request::Admin {
            data_dir,
            network,
            op,
        }) => Response::admin(admin::run(stores, &data_dir, &network, &op)),
        Err(e) => Response::admin(Err(crate::Error::Config(format!("unreadable request: {e}")))),
    };
    let bytes = serde_json::to_vec(&response).map_err(io::Error::other)?;
    stream.write_all(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_survive_the_wire() {
        let cases = [
            Reply::Document(serde_json::json!({"cniVersion":"1.0.0"})),
            Reply::Done,
            Reply::Failed(CniError::try_again_later("busy"), Version::V0_4_0),
        ];
        for reply in cases {
            let wire = serde_json::to_vec(&Response::from_reply(reply.clone())).expect("encode");
            let back: Response = serde_json::from_slice(&wire).expect("decode");
            assert_eq!(back.into_reply(), reply);
        }
    }

    #[test]
    fn requests_survive_the_wire() {
        let req = Request::Admin {
            data_dir: "/d".into(),
            network: "n".into(),
            op: AdminOp::List,
        };
        let wire = serde_json::to_string(&req).expect("encode");
        assert_eq!(serde_json::from_str::<Request>(&wire).expect("decode"), req);
        let plugin = Request::Plugin {
            env: BTreeMap::from([("CNI_COMMAND".into(), "ADD".into())]),
            stdin: "{}".into(),
        };
        let wire = serde_json::to_string(&plugin).expect("encode");
        assert_eq!(serde_json::from_str::<Request>(&wire).expect("decode"), plugin);
    }

    /// A service whose plugin answers with the id of the thread it ran on,
    /// once `together` calls have reached it.
    fn thread_reporting_service(dir: &Path, together: usize) -> PathBuf {
        let socket = dir.join("svc.sock");
        let listener = bind(&socket).expect("bind");
        let all_in = std::sync::Barrier::new(together);
        let plugin: Arc<PluginHandler> = Arc::new(move |_env: &BTreeMap<String, String>, _stdin: Vec<u8>| {
            all_in.wait();
            Reply::Document(serde_json::json!({"thread": format!("{:?}", std::thread::current().id())}))
        });
        std::thread::spawn(move || serve(listener, Arc::new(Stores::resident()), plugin));
        socket
    }

    fn thread_of(socket: &Path) -> String {
        let request = Request::Plugin {
            env: BTreeMap::new(),
            stdin: String::new(),
        };
        let document = call(socket, &request)
            .expect("answer")
            .document
            .expect("document");
        document["thread"].as_str().expect("thread").to_owned()
    }

    #[test]
    fn threads_are_reused_and_a_silent_client_holds_up_nobody() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = thread_reporting_service(dir.path(), 1);
        // Connected, never finishing its request: one thread waits on it.
        let _silent = UnixStream::connect(&socket).expect("connect");
        let sequential: std::collections::BTreeSet<String> = (0..20).map(|_| thread_of(&socket)).collect();
        assert_eq!(
            sequential.len(),
            1,
            "one thread answers calls that come one by one: {sequential:?}"
        );
    }

    fn burst(socket: &Path, calls: usize) -> std::collections::BTreeSet<String> {
        std::thread::scope(|scope| {
            let calls: Vec<_> = (0..calls).map(|_| scope.spawn(|| thread_of(socket))).collect();
            calls.into_iter().map(|c| c.join().expect("call")).collect()
        })
    }

    #[test]
    fn a_burst_is_answered_at_once_and_leaves_sixteen_threads_waiting() {
        const BURST: usize = 40;
        let dir = tempfile::tempdir().expect("tempdir");
        // Every call waits until all of the burst have reached the plugin,
        // so the burst is only answered if each gets a thread at once.
        let socket = thread_reporting_service(dir.path(), BURST);
        let first = burst(&socket, BURST);
        assert_eq!(first.len(), BURST);
        let second = burst(&socket, BURST);
        assert_eq!(second.len(), BURST);
        assert_eq!(first.intersection(&second).count(), MAX_IDLE_WORKERS);
    }

    #[test]
    fn an_absent_service_is_unreachable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = call(
            &dir.path().join("none.sock"),
            &Request::Admin {
                data_dir: "/d".into(),
                network: "n".into(),
                op: AdminOp::List,
            },
        )
        .expect_err("nobody listens");
        assert!(matches!(err, CallError::Unreachable { .. }));
    }
}
