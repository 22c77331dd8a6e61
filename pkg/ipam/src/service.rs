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
use std::sync::Arc;
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

/// Serves until the listener fails: one thread per connection, each
/// answering one request.
pub fn serve(listener: UnixListener, stores: Arc<Stores>, plugin: Arc<PluginHandler>) -> io::Result<()> {
    for connection in listener.incoming() {
        let stream = match connection {
            Ok(stream) => stream,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let (stores, plugin) = (Arc::clone(&stores), Arc::clone(&plugin));
        std::thread::spawn(move || {
            if let Err(e) = answer(stream, &stores, plugin.as_ref()) {
                log::warn!("lease service: {e}");
            }
        });
    }
    Ok(())
}

/// Only root, or the service's own user, may talk to it; the socket's mode
/// says so too, this holds even if the mode is changed.
fn peer_allowed(stream: &UnixStream) -> bool {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let own = nix::unistd::geteuid().as_raw();
    getsockopt(stream, PeerCredentials).is_ok_and(|cred| cred.uid() == 0 || cred.uid() == own)
}

fn answer(mut stream: UnixStream, stores: &Stores, plugin: &PluginHandler) -> io::Result<()> {
    if !peer_allowed(&stream) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "refused a client that is not root",
        ));
    }
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    let mut body = Vec::new();
    (&mut stream).take(MAX_REQUEST).read_to_end(&mut body)?;
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
