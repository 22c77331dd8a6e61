//! host-local IPAM: what the plugin, its lease service and `cnictl ipam`
//! share.
//!
//! - [`config`]: the reference plugin's keys, checks and messages.
//! - [`checks`]: every check of a verb that needs no lease, run before a
//!   lease service is started or asked and before the store makes anything.
//! - [`range`]: ranges, range sets and the round-robin walk.
//! - [`store`]: the sled database per network and its lock discipline;
//!   sled alone, it never reads the reference plugin's files.
//! - [`pool`]: the way in to a network ([`pool::with_network`]), and
//!   allocate, release, check, GC and STATUS on it.
//! - [`reference`]: the reference plugin's lease files: when to import
//!   them, importing, and removing a released lease's file.
//! - [`admin`] and [`service`]: operator commands and the lease service.
//! - [`client`]: the one path a request takes to the leases, and its policy.
//! - [`trust`] and [`socket`]: which directories, sockets and peers are
//!   trusted.

#![forbid(unsafe_code)]

pub mod admin;
pub mod checks;
pub mod client;
pub mod config;
pub mod pool;
pub mod range;
pub mod reference;
pub mod service;
pub mod socket;
pub mod store;
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
    /// A protocol-level problem (CNI_ARGS, a runtime convention).
    #[error("{}", .0.msg)]
    Cni(cni::Error),
}

impl From<Error> for cni::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Config(msg) => cni::Error::invalid_config(msg),
            Error::Unavailable(msg) => cni::Error::plugin(plugin_codes::ADDRESS_UNAVAILABLE, msg),
            Error::Check(msg) => cni::Error::plugin(plugin_codes::CHECK_FAILED, msg),
            Error::Busy(msg) => cni::Error::try_again_later(msg),
            Error::Store(msg) => cni::Error::io(msg),
            Error::Cni(e) => e,
        }
    }
}
