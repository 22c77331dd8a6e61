//! Firewall rules: rendered by pure functions, applied atomically.
//!
//! Each change is one `iptables-restore --noflush` per address family (one
//! process, one kernel transaction) or one `nft -f` transaction, never a
//! process per rule. Commands run in the calling thread's network
//! namespace, like every child process.

#![forbid(unsafe_code)]

pub mod exec;
pub mod istio;
pub mod masquerade;
pub mod nfnl;
pub mod nft;
pub mod spoofcheck;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{program}: {reason}")]
    Command { program: String, reason: String },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

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
