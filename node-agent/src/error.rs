//! The agent's one error type, at the bottom of the crate: every module
//! returns it, none defines its own.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Setting(String),
    #[error("{0}")]
    Io(String),
    #[error("{0}")]
    Watch(String),
    #[error("the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}
