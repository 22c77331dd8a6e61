//! What a call to the API server can meet.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubeconfig {path}: {reason}")]
    Config { path: String, reason: String },
    #[error("cannot resolve {0}")]
    Resolve(String),
    #[error("{0}")]
    Connection(String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("the API server answered {status}: {body}")]
    Status { status: u16, body: String },
    #[error("unreadable answer: {0}")]
    Protocol(String),
    #[error("no complete answer before the deadline")]
    Timeout,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
