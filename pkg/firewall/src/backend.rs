//! Which tool programs a plugin's rules, iptables or nftables: the one
//! enum of the two backends the plugins offer, and the one detection the
//! reference plugins make when a configuration names none. Each plugin
//! still reads its own key, with its own default and messages.

use std::sync::OnceLock;

use crate::exec;

/// The two ways the plugins program the node: `iptables-restore` batches
/// (the reference plugins' layouts) or `nft` / nf_tables transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Iptables,
    Nftables,
}

impl Backend {
    /// The backend a configuration names, spelled as the reference plugins
    /// spell it (`iptables`, `nftables`); anything else is the caller's to
    /// refuse, with its own message.
    pub fn named(text: &str) -> Option<Backend> {
        match text {
            "iptables" => Some(Backend::Iptables),
            "nftables" => Some(Backend::Nftables),
            _ => None,
        }
    }

    /// Its name in a configuration and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Iptables => "iptables",
            Backend::Nftables => "nftables",
        }
    }

    /// The other backend: the one DEL and GC also clean up in.
    pub fn other(self) -> Backend {
        match self {
            Backend::Iptables => Backend::Nftables,
            Backend::Nftables => Backend::Iptables,
        }
    }

    /// The reference plugins' default where a configuration names no
    /// backend ([`Backend::detect_with`] over the tools installed here).
    /// Decided once per process: the answer cannot change while a plugin
    /// runs, and each of its verbs may ask.
    pub fn detect() -> Backend {
        static DETECTED: OnceLock<Backend> = OnceLock::new();
        *DETECTED.get_or_init(|| Backend::detect_with(|tool| exec::find(tool).is_some()))
    }

    /// iptables unless `iptables-restore` is missing and `nft` is there, as
    /// upstream's `bridge` and `portmap` decide; `tool_exists` says whether
    /// a tool is installed (the tests give their own).
    pub fn detect_with(tool_exists: impl Fn(&str) -> bool) -> Backend {
        if !tool_exists("iptables-restore") && tool_exists("nft") {
            Backend::Nftables
        } else {
            Backend::Iptables
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iptables_unless_only_nft_is_installed() {
        assert_eq!(Backend::detect_with(|_| true), Backend::Iptables);
        assert_eq!(Backend::detect_with(|_| false), Backend::Iptables);
        assert_eq!(Backend::detect_with(|t| t == "nft"), Backend::Nftables);
        assert_eq!(
            Backend::detect_with(|t| t == "iptables-restore"),
            Backend::Iptables
        );
    }

    #[test]
    fn names_are_the_reference_plugins() {
        for backend in [Backend::Iptables, Backend::Nftables] {
            assert_eq!(Backend::named(backend.name()), Some(backend));
            assert_ne!(backend.other(), backend);
        }
        assert_eq!(Backend::named(""), None);
        assert_eq!(Backend::named("Nftables"), None);
        assert_eq!(Backend::named("firewalld"), None);
    }
}
