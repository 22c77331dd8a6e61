//! host-local's configuration and everything about an invocation that is
//! judged before a lease is looked at, with no store and no sockets: what
//! the bridge runs in-process before it makes links, and what the store
//! (`ipam`) builds on.
//!
//! - [`config`]: the reference plugin's keys, checks and messages.
//! - [`range`]: ranges, range sets, the round-robin walk, and which set a
//!   requested address goes to.
//! - [`lease_settings`]: which lease service and data directory a
//!   configuration names, read from raw stdin by a caller that routes a
//!   request before it parses it.
//! - [`paths`]: where a network's state lives, and [`trust`]: whether a
//!   directory may be used.
//! - [`checks`]: every check of a verb that needs no lease, run before a
//!   lease service is started or asked and before the store makes anything.

#![forbid(unsafe_code)]

pub mod checks;
pub mod config;
pub mod lease_settings;
pub mod paths;
pub mod range;
pub mod trust;

use cni::error::plugin_codes;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid (the reference's messages).
    #[error("{0}")]
    Config(String),
    /// No address can be handed out as asked.
    #[error("{0}")]
    Unavailable(String),
    /// CHECK found the leases differing from what the runtime holds.
    #[error("{0}")]
    Check(String),
    /// The database is held by another process.
    #[error("{0}")]
    Busy(String),
    /// The database or the lock file failed.
    #[error("{0}")]
    Store(String),
    /// A file or directory of the store could not be made, opened, read
    /// or written: what was done to which path, and the system's error.
    #[error("{what}: {source}")]
    File {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A protocol-level problem (CNI_ARGS, a runtime convention).
    #[error("{}", .0.msg)]
    Cni(#[from] cni::Error),
}

impl Error {
    /// The store itself failed (its database, or one of its files): what
    /// makes a lease service close the database and open it again.
    pub fn is_storage_failure(&self) -> bool {
        matches!(self, Error::Store(_) | Error::File { .. })
    }
}

impl From<Error> for cni::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Config(msg) => cni::Error::invalid_config(msg),
            Error::Unavailable(msg) => cni::Error::plugin(plugin_codes::ADDRESS_UNAVAILABLE, msg),
            Error::Check(msg) => cni::Error::plugin(plugin_codes::CHECK_FAILED, msg),
            Error::Busy(msg) => cni::Error::try_again_later(msg),
            Error::Store(msg) => cni::Error::io(msg),
            e @ Error::File { .. } => cni::Error::io(e.to_string()),
            Error::Cni(e) => e,
        }
    }
}
