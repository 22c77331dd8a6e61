//! Unix sockets of the lease path, on both sides: a socket is used only in
//! a directory that nobody but root and this user can change, and only with
//! a peer that is root or this user.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Component, Path, PathBuf};

/// Longest path `sun_path` holds, its terminating NUL aside.
const SUN_PATH_MAX: usize = 107;

/// Why a socket path is not to be used.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Nothing is there to talk to (or the directory does not exist).
    #[error("{0}")]
    Absent(io::Error),
    /// Something is there that this process must not trust.
    #[error("{0}")]
    Untrusted(String),
}

fn trusted_owner(uid: u32) -> bool {
    uid == 0 || uid == nix::unistd::geteuid().as_raw()
}

/// `dir` with symlinks resolved, when nobody but root and this user can
/// change what it holds: it and every directory above it belong to root or
/// this user, it is writable by nobody else, and the directories above are
/// writable by others only with the sticky bit (as /tmp), which keeps them
/// from renaming what they do not own.
pub fn trusted_dir(dir: &Path) -> Result<PathBuf, Refusal> {
    let resolved = std::fs::canonicalize(dir).map_err(Refusal::Absent)?;
    let mut walked = PathBuf::new();
    let mut components = resolved.components().peekable();
    while let Some(component) = components.next() {
        walked.push(component);
        if !matches!(component, Component::RootDir | Component::Normal(_)) {
            continue;
        }
        let meta = std::fs::metadata(&walked).map_err(Refusal::Absent)?;
        let mode = meta.mode();
        let others_write = mode & 0o022 != 0;
        let sticky = mode & 0o1000 != 0;
        let last = components.peek().is_none();
        if !trusted_owner(meta.uid()) {
            return Err(Refusal::Untrusted(format!(
                "{} belongs to uid {}, not to root or this user",
                walked.display(),
                meta.uid()
            )));
        }
        if others_write && (last || !sticky) {
            return Err(Refusal::Untrusted(format!(
                "{} is writable by other users (mode {:o})",
                walked.display(),
                mode & 0o7777
            )));
        }
    }
    Ok(resolved)
}

/// A path to `name` in `dir` that fits `sun_path`: the path itself, or
/// `/proc/self/fd/<dir>/<name>` through a descriptor of the directory (kept
/// open in the returned file while the path is used).
fn addressable(dir: &Path, name: &OsStr) -> io::Result<(PathBuf, Option<File>)> {
    let full = dir.join(name);
    if full.as_os_str().len() <= SUN_PATH_MAX {
        return Ok((full, None));
    }
    let handle = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_PATH | nix::libc::O_DIRECTORY)
        .open(dir)?;
    let short = PathBuf::from(format!("/proc/self/fd/{}", handle.as_raw_fd())).join(name);
    Ok((short, Some(handle)))
}

fn split(socket: &Path) -> io::Result<(&Path, &OsStr)> {
    match (socket.parent(), socket.file_name()) {
        (Some(dir), Some(name)) => Ok((
            if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            },
            name,
        )),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} names no socket file", socket.display()),
        )),
    }
}

/// Whether the process at the other end is root or this user.
pub fn peer_trusted(stream: &UnixStream) -> Result<(), Refusal> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let cred = getsockopt(stream, PeerCredentials).map_err(|e| Refusal::Untrusted(e.to_string()))?;
    if trusted_owner(cred.uid()) {
        Ok(())
    } else {
        Err(Refusal::Untrusted(format!(
            "the process listening there (pid {}) runs as uid {}, not as root or this user",
            cred.pid(),
            cred.uid()
        )))
    }
}

/// Connects to `socket` only if its directory and then its listener are
/// trusted (see [`trusted_dir`] and [`peer_trusted`]).
pub fn connect(socket: &Path) -> Result<UnixStream, Refusal> {
    let (dir, name) = split(socket).map_err(Refusal::Absent)?;
    let dir = trusted_dir(dir)?;
    let (address, _dir_handle) = addressable(&dir, name).map_err(Refusal::Absent)?;
    let stream = UnixStream::connect(&address).map_err(Refusal::Absent)?;
    peer_trusted(&stream)?;
    Ok(stream)
}

/// Binds a listening socket at `socket`, mode 0600, replacing whatever file
/// is there: the caller holds the lock that makes it the one service for
/// that path. Refused in a directory others can change.
pub fn bind_replacing(socket: &Path) -> io::Result<UnixListener> {
    let (dir, name) = split(socket)?;
    let dir = trusted_dir(dir).map_err(|refusal| match refusal {
        Refusal::Absent(e) => e,
        Refusal::Untrusted(why) => io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("refusing to listen on {}: {why}", socket.display()),
        ),
    })?;
    let (address, _dir_handle) = addressable(&dir, name)?;
    match std::fs::remove_file(&address) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(&address)?;
    std::fs::set_permissions(&address, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// The (device, inode) of the file at `path`, not following a symlink.
pub fn inode(path: &Path) -> Option<(u64, u64)> {
    let (dir, name) = split(path).ok()?;
    let (address, _dir_handle) = addressable(dir, name).ok()?;
    std::fs::symlink_metadata(address)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

#[cfg(test)]
mod tests {
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
        assert!(matches!(
            trusted_dir(&root.path().join("missing")),
            Err(Refusal::Absent(_))
        ));
    }

    #[test]
    fn sockets_beyond_sun_path_are_bound_and_reached() {
        let root = tempfile::tempdir().expect("tempdir");
        let deep = root.path().join("d".repeat(100)).join("e".repeat(100));
        std::fs::create_dir_all(&deep).expect("mkdir");
        let socket = deep.join("service.sock");
        assert!(socket.as_os_str().len() > SUN_PATH_MAX);
        let listener = bind_replacing(&socket).expect("bind");
        let stream = connect(&socket).expect("connect");
        let (accepted, _) = listener.accept().expect("accept");
        drop((stream, accepted));
        assert!(inode(&socket).is_some());
        // Bound again over the old file: the caller holds the path's lock.
        let again = bind_replacing(&socket).expect("rebind");
        drop(again);
    }
}
