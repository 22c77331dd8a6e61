//! The runtime side of CNI, compatible with Go's libcni: what `cnictl`
//! uses to run a network configuration list against a namespace.
//!
//! - [`conflist`]: loading `.conflist`/`.conf` files and choosing the version.
//! - [`runtime`]: running a chain (ADD forward, DEL backward, CHECK, GC,
//!   STATUS) the way libcni builds each plugin's stdin and environment.
//! - [`cache`]: libcni's result cache (`<cacheDir>/results/<net>-<id>-<if>`),
//!   so Go tools and `cnictl` can delete each other's attachments.

#![forbid(unsafe_code)]

pub mod cache;
pub mod conflist;
pub mod runtime;

pub use cache::{CachedAttachment, ResultCache};
pub use conflist::{NetworkConfigList, PluginConf};
pub use runtime::{CniConfig, RuntimeConf};

/// What can go wrong on the runtime side.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A plugin of the chain failed; its CNI error (and code) is kept.
    #[error("plugin type={plugin_type:?} failed ({verb}): {source}")]
    Plugin {
        plugin_type: String,
        verb: &'static str,
        #[source]
        source: cni::Error,
    },
    /// A configuration file or list is unusable.
    #[error("{0}")]
    Config(String),
    #[error("no network configuration named {name:?} found in {dir}{skipped}")]
    NotFound {
        name: String,
        dir: String,
        skipped: String,
    },
    /// The request itself is invalid (container ID, interface name, verb not
    /// available in this version).
    #[error("{0}")]
    Invalid(cni::Error),
    #[error("result cache: {0}")]
    Cache(String),
    /// GC went on past failures; all of them.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Many(Vec<Error>),
}

impl Error {
    /// The CNI error behind this one, if a plugin or a check produced it.
    pub fn cni_error(&self) -> Option<&cni::Error> {
        match self {
            Error::Plugin { source, .. } | Error::Invalid(source) => Some(source),
            Error::Many(errors) => errors.iter().find_map(Error::cni_error),
            _ => None,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
