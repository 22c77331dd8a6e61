//! Where each pod the agent put in the mesh has its network namespace, one
//! file per pod UID holding the path the runtime gave (`CNI_NETNS`), in a
//! directory of the agent's own under its run directory. An agent that
//! restarts opens the namespace there first, and checks it still holds
//! one of the pod's addresses; /proc's scan (`pod_netns`) is the fallback
//! for a pod without one, and can be fooled where two namespaces hold one
//! address (two nodes' pods on one machine), which a record cannot.
//!
//! Under /run, so a reboot, which takes every namespace with it, takes the
//! records too.

use std::net::IpAddr;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use netns::NetNs;

use crate::atomic;

/// The records' directory.
#[derive(Debug, Clone)]
pub struct Records {
    dir: PathBuf,
}

impl Records {
    pub fn new(dir: PathBuf) -> Records {
        Records { dir }
    }

    /// The file of `uid`; None for a UID that is no plain name (the API
    /// server's are RFC 4122 text), which is never made a path.
    fn file(&self, uid: &str) -> Option<PathBuf> {
        let plain = !uid.is_empty() && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        plain.then(|| self.dir.join(uid))
    }

    /// Notes that the pod of `uid` has its namespace at `netns`. Blocks.
    pub fn remember(&self, uid: &str, netns: &Path) {
        let Some(file) = self.file(uid) else {
            return;
        };
        let made = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                atomic::replace_file(&file, netns.as_os_str().as_encoded_bytes(), 0o600)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = made {
            log::warn!("ambient: cannot note where pod {uid}'s namespace is: {e}");
        }
    }

    /// Where the pod of `uid` had its namespace, if noted. Blocks.
    pub fn netns_of(&self, uid: &str) -> Option<PathBuf> {
        let text = atomic::read_text(&self.file(uid)?).ok()?;
        Some(PathBuf::from(text))
    }

    /// Where the pod of `uid` has its namespace, if noted and it is still
    /// the pod's: one of its addresses `ips` there, or, for a pod whose
    /// addresses kubelet has not posted yet, a namespace that is not the
    /// agent's own. Blocks.
    pub fn netns_still_of(&self, uid: &str, ips: &[IpAddr]) -> Option<PathBuf> {
        let path = self.netns_of(uid)?;
        let still = if ips.is_empty() {
            match (NetNs::open(&path), NetNs::current()) {
                (Ok(recorded), Ok(own)) => !recorded.same_as(&own),
                _ => false,
            }
        } else {
            crate::pod_netns::holds_any(&path, ips).unwrap_or(false)
        };
        still.then_some(path)
    }

    /// Forgets every pod but those of `keep` (pods gone while no agent
    /// ran). Blocks.
    pub fn prune(&self, keep: &std::collections::BTreeSet<String>) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let kept = name.to_str().is_some_and(|uid| keep.contains(uid));
            if !kept && entry.file_type().is_ok_and(|t| t.is_file()) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// Forgets the pod of `uid`. Blocks.
    pub fn forget(&self, uid: &str) {
        if let Some(file) = self.file(uid) {
            let _ = std::fs::remove_file(file);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_namespace_is_noted_read_back_and_forgotten_and_no_uid_becomes_a_path_of_its_own() {
        let scratch = tempfile::tempdir().expect("tempdir");
        let records = Records::new(scratch.path().join("ambient"));
        assert_eq!(records.netns_of("u-1"), None);
        records.remember("u-1", Path::new("/var/run/netns/cni-1"));
        assert_eq!(
            records.netns_of("u-1"),
            Some(PathBuf::from("/var/run/netns/cni-1"))
        );
        records.forget("u-1");
        assert_eq!(records.netns_of("u-1"), None);
        for odd in ["../u-1", "", "a/b", "."] {
            records.remember(odd, Path::new("/x"));
            assert_eq!(records.netns_of(odd), None);
        }
        records.remember("u-2", Path::new("/var/run/netns/cni-2"));
        records.remember("u-3", Path::new("/var/run/netns/cni-3"));
        records.prune(&["u-3".to_owned()].into());
        assert_eq!(records.netns_of("u-2"), None, "gone while no agent ran");
        assert!(records.netns_of("u-3").is_some());
        records.forget("u-3");
        let entries: Vec<_> = std::fs::read_dir(scratch.path().join("ambient"))
            .expect("made")
            .collect();
        assert!(entries.is_empty(), "{entries:?}");
        assert!(!scratch.path().join("u-1").exists());
    }
}
