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

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

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
        let entries: Vec<_> = std::fs::read_dir(scratch.path().join("ambient"))
            .expect("made")
            .collect();
        assert!(entries.is_empty(), "{entries:?}");
        assert!(!scratch.path().join("u-1").exists());
    }
}
