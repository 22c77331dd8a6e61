//! The agent's one error type, at the bottom of the crate: every module
//! returns it, none defines its own. A failure of the system or of another
//! crate is kept as the source of a typed variant, with what the agent was
//! doing; the text shown (the agent's log) is the context, then the
//! source's own text. `Setting`, `Io` and `Watch` are the agent's own
//! findings, said in words.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting that cannot work.
    #[error("{0}")]
    Setting(String),
    /// Something on the node is not as the agent needs it.
    #[error("{0}")]
    Io(String),
    /// The agent cannot tell where its own binaries are.
    #[error("cannot tell where the agent runs from; set CNI_SOURCE_BIN_DIR")]
    NoSourceDir,
    /// The Node watch ended.
    #[error("{0}")]
    Watch(String),
    #[error("the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
    /// A file or directory could not be read, written, created, removed…
    #[error("cannot {action} {path}: {source}")]
    File {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// A file the agent reads could not be read.
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// One of the agent's records on the node is not one.
    #[error("{path} is not the agent's record: {source}")]
    Record {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// JSON the agent renders.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("cannot listen on {address} for health probes: {source}")]
    Listen { address: SocketAddr, source: io::Error },
    #[error("cannot handle SIGTERM: {0}")]
    Signal(#[source] io::Error),
    /// Work on a blocking thread or a task of its own ended without an
    /// outcome.
    #[error("{what}: {source}")]
    Task {
        what: &'static str,
        source: tokio::task::JoinError,
    },
    /// The routes could not be read or changed.
    #[error("routes: {0}")]
    Routes(#[source] netlink::Error),
    /// Some routes of a reconciliation failed (one entry a route); the
    /// others went in.
    #[error("routes: {}", .0.join("; "))]
    RoutesFailed(Vec<String>),
    #[error("bridge {name}: {source}")]
    Bridge { name: String, source: netlink::Error },
    /// The masquerade rules could not be put in place.
    #[error("{0}")]
    Masquerade(#[from] firewall::Error),
    /// The nat tables could not be read or cleaned.
    #[error("{what}: {source}")]
    NatTables {
        what: &'static str,
        source: firewall::Error,
    },
}

impl Error {
    /// `cannot <action> <path>: <source>`.
    pub fn file(action: &'static str, path: &Path, source: io::Error) -> Error {
        Error::File {
            action,
            path: path.to_path_buf(),
            source,
        }
    }

    /// `<path>: <source>`.
    pub fn read(path: &Path, source: io::Error) -> Error {
        Error::Read {
            path: path.to_path_buf(),
            source,
        }
    }

    /// `<what>: <source>`, for work on a blocking thread.
    pub fn task(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> Error {
        move |source| Error::Task { what, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The agent's log and the integration tests read these texts: each
    /// typed variant shows what the string it replaced showed.
    #[test]
    fn typed_errors_read_as_the_strings_they_replaced() {
        let missing = || io::Error::from(io::ErrorKind::NotFound);
        let path = Path::new("/etc/cni/net.d/10-cni-suite.conflist");
        assert_eq!(
            Error::file("write", path, missing()).to_string(),
            format!("cannot write {}: {}", path.display(), missing())
        );
        assert_eq!(
            Error::read(path, missing()).to_string(),
            format!("{}: {}", path.display(), missing())
        );
        let not_json = || serde_json::from_str::<serde_json::Value>("{").expect_err("not JSON");
        assert_eq!(
            Error::Record {
                path: path.to_path_buf(),
                source: not_json()
            }
            .to_string(),
            format!("{} is not the agent's record: {}", path.display(), not_json())
        );
        assert_eq!(Error::Json(not_json()).to_string(), not_json().to_string());
        let address: SocketAddr = "[::]:9470".parse().expect("an address");
        assert_eq!(
            Error::Listen {
                address,
                source: missing()
            }
            .to_string(),
            format!("cannot listen on {address} for health probes: {}", missing())
        );
        assert_eq!(
            Error::Signal(missing()).to_string(),
            format!("cannot handle SIGTERM: {}", missing())
        );
        assert_eq!(
            Error::RoutesFailed(vec!["one".into(), "two".into()]).to_string(),
            "routes: one; two"
        );
    }
}
