//! Firewall rules: rendered by pure functions, applied atomically.
//!
//! Each change is one `iptables-restore --noflush` per address family (one
//! process, one kernel transaction) or one `nft -f` transaction, never a
//! process per rule. Commands run in the calling thread's network
//! namespace, like every child process.

#![forbid(unsafe_code)]

pub mod backend;
pub mod conntrack;
pub mod exec;
pub mod iptables;
pub mod nfnl;
pub mod nft;
pub mod ruleset;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tool is neither on PATH nor in the usual sbin directories.
    #[error("{program}: not found on PATH")]
    NotFound { program: String },
    /// The tool could not be started, fed or waited for.
    #[error("{program}: {source}")]
    Exec {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// The tool ran and failed: its exit status and what it said.
    #[error("{program}: {} ({status})", stderr.trim())]
    Failed {
        program: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("{0}")]
    Invalid(String),
    /// The kernel refused a transaction: what it refused, and why.
    #[error("nf_tables refused {what}: {}", std::io::Error::from_raw_os_error(*errno))]
    Refused { what: String, errno: i32 },
}

pub use backend::Backend;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// iptables chain names are at most 28 characters.
pub const MAX_CHAIN_NAME: usize = 28;

/// Whether a chain name from a configuration is one iptables accepts and
/// a restore script carries as one word, so it can change nothing else.
pub fn is_chain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_CHAIN_NAME
        && !name.starts_with(['-', '!'])
        && name
            .chars()
            .all(|c| c.is_ascii_graphic() && c != '"' && c != '\'')
}

/// An address family, which picks the iptables binaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(net: &ipnetwork::IpNetwork) -> Family {
        if net.is_ipv4() { Family::V4 } else { Family::V6 }
    }

    /// The nf_tables family iptables-nft keeps this family's tables in.
    pub fn nf_table_family(self) -> nfnl::TableFamily {
        match self {
            Family::V4 => nfnl::TableFamily::Ip,
            Family::V6 => nfnl::TableFamily::Ip6,
        }
    }

    pub fn restore(self) -> &'static str {
        match self {
            Family::V4 => "iptables-restore",
            Family::V6 => "ip6tables-restore",
        }
    }

    pub fn save(self) -> &'static str {
        match self {
            Family::V4 => "iptables-save",
            Family::V6 => "ip6tables-save",
        }
    }

    /// Multicast traffic stays unmasqueraded, so pods can use it on the
    /// local network.
    pub fn multicast(self) -> &'static str {
        match self {
            Family::V4 => "224.0.0.0/4",
            Family::V6 => "ff00::/8",
        }
    }

    pub fn host_prefix(self) -> u8 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }
}
