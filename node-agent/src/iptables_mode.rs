//! Which iptables the agent's rules go through, when its image carries
//! both: the node's kube-proxy and kubelet use either iptables-legacy or
//! iptables-nft, and rules in the other one would be ignored by nobody but
//! still be in a second, unseen table set. The image holds each flavour's
//! `iptables-save`/`-restore` (and `ip6tables-…`) in a directory of its own
//! under [`FLAVOURS`]; the chosen one goes first on `PATH`, before any
//! thread exists, and every command the agent runs finds it there.
//!
//! `auto` decides as Kubernetes' iptables-wrapper does: the flavour whose
//! mangle table has kubelet's `KUBE-IPTABLES-HINT` (or `KUBE-KUBELET-CANARY`)
//! chain, else the one holding more rules, nft on a tie. Run on a host
//! without that directory (by hand, in tests), the agent leaves `PATH`
//! alone and uses the host's `iptables`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::settings::IptablesMode as Mode;

/// Where the image keeps `nft/` and `legacy/`.
pub const FLAVOURS: &str = "/opt/cni-suite/iptables";

/// What one flavour's tables hold.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Seen {
    kubelet_hint: bool,
    rules: usize,
}

fn seen(dir: &Path) -> Seen {
    let mut seen = Seen::default();
    for save in ["iptables-save", "ip6tables-save"] {
        let Ok(output) = Command::new(dir.join(save)).output() else {
            continue;
        };
        let text = String::from_utf8_lossy(&output.stdout);
        seen.rules += text.lines().filter(|line| line.starts_with("-A ")).count();
        seen.kubelet_hint |= text.lines().any(|line| {
            line.starts_with(":KUBE-IPTABLES-HINT ") || line.starts_with(":KUBE-KUBELET-CANARY ")
        });
    }
    seen
}

/// The flavour to use, from what each holds.
fn choose(nft: Seen, legacy: Seen) -> &'static str {
    match (nft.kubelet_hint, legacy.kubelet_hint) {
        (true, false) => "nft",
        (false, true) => "legacy",
        _ if legacy.rules > nft.rules => "legacy",
        _ => "nft",
    }
}

/// Puts the chosen flavour's directory first on `PATH`; returns it, or
/// None when the image carries no flavours (or `mode` names one it lacks).
///
/// Must run before any other thread exists (it edits the environment).
pub fn select(mode: Mode) -> Option<PathBuf> {
    let base = Path::new(FLAVOURS);
    let (nft, legacy) = (base.join("nft"), base.join("legacy"));
    if !nft.is_dir() || !legacy.is_dir() {
        return None;
    }
    let chosen = match mode {
        Mode::Nft => nft,
        Mode::Legacy => legacy,
        Mode::Auto => base.join(choose(seen(&nft), seen(&legacy))),
    };
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![chosen.clone()];
    dirs.extend(std::env::split_paths(&path));
    let joined = std::env::join_paths(dirs).ok()?;
    // SAFETY: called from main before the runtime or any thread starts, so
    // nothing reads the environment concurrently.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("PATH", joined)
    };
    Some(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubelets_hint_decides_then_the_number_of_rules() {
        let none = Seen::default();
        let hinted = Seen {
            kubelet_hint: true,
            rules: 0,
        };
        let busy = Seen {
            kubelet_hint: false,
            rules: 40,
        };
        assert_eq!(choose(none, none), "nft");
        assert_eq!(choose(none, hinted), "legacy");
        assert_eq!(choose(hinted, busy), "nft");
        assert_eq!(choose(none, busy), "legacy");
        assert_eq!(choose(busy, busy), "nft");
    }
}
