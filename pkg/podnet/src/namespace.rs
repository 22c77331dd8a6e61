//! The pod's network namespace, as CNI_NETNS names it.

use std::path::Path;

use cni::{Attachment, Error, Result};
use netns::NetNs;

/// CNI_NETNS, which ADD and CHECK cannot do without.
pub fn netns_path(att: &Attachment) -> Result<&Path> {
    att.netns
        .as_deref()
        .ok_or_else(|| Error::invalid_env("required env variables [CNI_NETNS] missing"))
}

/// A namespace that is gone is the runtime's mistake (an invalid
/// environment), not an I/O failure of the plugin.
pub fn open_netns(path: &Path) -> Result<NetNs> {
    NetNs::open(path).map_err(|e| {
        if e.is_gone() {
            Error::invalid_env(e.to_string())
        } else {
            Error::io(e.to_string())
        }
    })
}

/// The namespace CNI_NETNS names.
pub fn open_pod_netns(att: &Attachment) -> Result<NetNs> {
    open_netns(netns_path(att)?)
}

/// For DEL: a namespace already gone (`None`) leaves nothing to undo in it.
pub fn open_netns_unless_gone(path: &Path) -> Result<Option<NetNs>> {
    match NetNs::open(path) {
        Ok(ns) => Ok(Some(ns)),
        Err(e) if e.is_gone() => Ok(None),
        Err(e) => Err(Error::io(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use cni::error::Code;

    use super::*;

    fn attachment(netns: Option<&str>) -> Attachment {
        Attachment {
            container_id: "ctr".into(),
            ifname: "eth0".into(),
            netns: netns.map(Into::into),
        }
    }

    #[test]
    fn a_missing_cni_netns_is_an_invalid_environment() {
        let err = open_pod_netns(&attachment(None)).expect_err("no netns");
        assert!(err.has_code(Code::InvalidEnvironment));
        assert_eq!(err.msg, "required env variables [CNI_NETNS] missing");
    }

    #[test]
    fn a_vanished_namespace_is_an_invalid_environment_and_nothing_for_del() {
        // An unmounted `/run/netns` entry is a plain file: gone as well.
        for gone in ["/nonexistent/netns", "/proc/self/status"] {
            let err = open_pod_netns(&attachment(Some(gone))).expect_err("gone");
            assert!(err.has_code(Code::InvalidEnvironment), "{err:?}");
            assert!(
                open_netns_unless_gone(Path::new(gone))
                    .expect("gone is fine")
                    .is_none()
            );
        }
    }

    #[test]
    fn the_callers_namespace_opens() {
        assert!(open_netns(Path::new("/proc/self/ns/net")).is_ok());
        assert!(
            open_netns_unless_gone(Path::new("/proc/self/ns/net"))
                .expect("there")
                .is_some()
        );
    }
}
