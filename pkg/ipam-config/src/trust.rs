//! Which directories the lease store and its sockets may use: only those
//! nobody but root and this user can change. Root's plugin writing into, or
//! sending requests through, a directory another user controls would let
//! that user steer root's writes (a symlink to a root-owned file) or its
//! answers (a socket of their own).

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

/// Why a directory or a socket is not to be used.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Nothing is there to talk to (or the directory does not exist).
    #[error("{0}")]
    Absent(io::Error),
    /// Something is there that this process must not trust.
    #[error("{0}")]
    Untrusted(String),
}

pub fn trusted_owner(uid: u32) -> bool {
    uid == 0 || uid == nix::unistd::geteuid().as_raw()
}

/// `dir` with symlinks resolved, when nobody but root and this user can
/// change what it holds: it and every directory above it belong to root or
/// this user, it is writable by nobody else, and the directories above are
/// writable by others only with the sticky bit (as /tmp), which keeps them
/// from renaming what they do not own.
pub fn trusted_dir(dir: &Path) -> Result<PathBuf, Refusal> {
    walk(dir, false)
}

/// `dir` with symlinks resolved, when a directory this user creates in it
/// would pass [`trusted_dir`]: `dir` is then one of the directories above,
/// writable by others only with the sticky bit.
pub fn trusted_parent(dir: &Path) -> Result<PathBuf, Refusal> {
    walk(dir, true)
}

fn walk(dir: &Path, is_parent: bool) -> Result<PathBuf, Refusal> {
    let resolved = std::fs::canonicalize(dir).map_err(Refusal::Absent)?;
    let mut walked = PathBuf::new();
    let mut components = resolved.components().peekable();
    while let Some(component) = components.next() {
        walked.push(component);
        if !matches!(component, Component::RootDir | Component::Normal(_)) {
            continue;
        }
        let meta = std::fs::metadata(&walked).map_err(Refusal::Absent)?;
        let last = !is_parent && components.peek().is_none();
        judge(&walked, &meta, last)?;
    }
    Ok(resolved)
}

/// [`trusted_dir`]'s last step alone: a directory (`meta`, at `dir`) in a
/// directory already found trusted as a parent ([`trusted_parent`]).
pub fn trusted_child(dir: &Path, meta: &std::fs::Metadata) -> Result<(), Refusal> {
    judge(dir, meta, true)
}

/// One directory of a walk: owned by root or this user, and writable by
/// others only when it is above the last one and sticky.
fn judge(dir: &Path, meta: &std::fs::Metadata, last: bool) -> Result<(), Refusal> {
    let mode = meta.mode();
    let others_write = mode & 0o022 != 0;
    let sticky = mode & 0o1000 != 0;
    if !trusted_owner(meta.uid()) {
        return Err(Refusal::Untrusted(format!(
            "{} belongs to uid {}, not to root or this user",
            dir.display(),
            meta.uid()
        )));
    }
    if others_write && (last || !sticky) {
        return Err(Refusal::Untrusted(format!(
            "{} is writable by other users (mode {:o})",
            dir.display(),
            mode & 0o7777
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn a_directory_others_can_write_is_not_trusted() {
        let root = tempfile::tempdir().expect("tempdir");
        let open = root.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(matches!(trusted_dir(&open), Err(Refusal::Untrusted(_))));
        // Sticky, as /tmp: fine above, not as the socket's own directory.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        assert!(matches!(trusted_dir(&open), Err(Refusal::Untrusted(_))));
        assert!(
            trusted_parent(&open).is_ok(),
            "a directory of one's own may be made in it"
        );
        let inner = open.join("inner");
        std::fs::create_dir(&inner).expect("mkdir");
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        assert_eq!(
            trusted_dir(&inner).expect("trusted"),
            inner.canonicalize().expect("real")
        );
        // Writable by others without the sticky bit: the inner directory
        // could be renamed away and replaced.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(matches!(trusted_dir(&inner), Err(Refusal::Untrusted(_))));
        assert!(matches!(trusted_parent(&open), Err(Refusal::Untrusted(_))));
        assert!(matches!(
            trusted_dir(&root.path().join("missing")),
            Err(Refusal::Absent(_))
        ));
    }
}
