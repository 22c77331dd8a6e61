//! Unix sockets of the lease path, on both sides: a socket is used only in
//! a directory that nobody but root and this user can change
//! ([`ipam_config::trust`]), and only with a peer that is root or this user.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use ipam_config::trust::{Refusal, trusted_dir, trusted_owner};

/// Longest path `sun_path` holds, its terminating NUL aside.
const SUN_PATH_MAX: usize = 107;

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

/// A socket path's directory (`.` for a bare name) and file name.
pub(crate) fn split(socket: &Path) -> io::Result<(&Path, &OsStr)> {
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

fn peer(stream: &UnixStream) -> Result<nix::sys::socket::UnixCredentials, Refusal> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    getsockopt(stream, PeerCredentials).map_err(|e| Refusal::Untrusted(e.to_string()))
}

/// Whether the process at the other end is root or this user.
pub fn peer_trusted(stream: &UnixStream) -> Result<(), Refusal> {
    let cred = peer(stream)?;
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

/// The pid of the process at the other end, as this pid namespace sees it.
pub fn peer_pid(stream: &UnixStream) -> Option<i32> {
    peer(stream).ok().map(|cred| cred.pid())
}

/// The (device, inode) of the binary the process at the other end runs,
/// when this process can see it (same pid namespace, allowed to read it).
pub fn peer_binary(stream: &UnixStream) -> Option<(u64, u64)> {
    let pid = peer(stream).ok()?.pid();
    let meta = std::fs::metadata(format!("/proc/{pid}/exe")).ok()?;
    Some((meta.dev(), meta.ino()))
}

/// Connects without waiting: a listener whose queue is full (stopped, or
/// swamped) is absent for now rather than a wait with no end.
fn connect_now(address: &Path) -> io::Result<UnixStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, socket};
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    let connected = nix::sys::socket::connect(fd.as_raw_fd(), &UnixAddr::new(address)?);
    match connected {
        Ok(()) => {}
        Err(nix::errno::Errno::EAGAIN) => {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "its queue of connections is full",
            ));
        }
        Err(e) => return Err(e.into()),
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Connects to `socket` only if its directory and then its listener are
/// trusted (see [`trusted_dir`] and [`peer_trusted`]).
pub fn connect(socket: &Path) -> Result<UnixStream, Refusal> {
    let (dir, name) = split(socket).map_err(Refusal::Absent)?;
    let dir = trusted_dir(dir)?;
    let (address, _dir_handle) = addressable(&dir, name).map_err(Refusal::Absent)?;
    let stream = connect_now(&address).map_err(Refusal::Absent)?;
    peer_trusted(&stream)?;
    Ok(stream)
}

/// Whether this very process listens on `socket`.
pub fn listened_on_by_this_process(socket: &Path) -> bool {
    connect(socket)
        .ok()
        .and_then(|stream| peer(&stream).ok())
        .is_some_and(|cred| u32::try_from(cred.pid()).is_ok_and(|pid| pid == std::process::id()))
}

/// Binds a listening socket at `socket`, mode 0600, replacing whatever file
/// is there: the caller holds the lock that makes it the one service for
/// that path. Refused in a directory others can change. Returns the
/// listener and the socket's path with symlinks resolved, where it stays
/// whatever later happens to a symlink on the way.
pub fn bind_replacing(socket: &Path) -> io::Result<(UnixListener, PathBuf)> {
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
    Ok((listener, dir.join(name)))
}

/// A file by device and inode.
pub type FileId = (u64, u64);

/// The (device, inode) of the file at `path`, not following a symlink.
pub fn inode(path: &Path) -> Option<FileId> {
    let (dir, name) = split(path).ok()?;
    let (address, _dir_handle) = addressable(dir, name).ok()?;
    std::fs::symlink_metadata(address)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// A lock file of the service (created 0600, never through a symlink).
pub(crate) fn open_lock_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

fn refused_dir(dir: &Path, why: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("refusing to listen in {}: {why}", dir.display()),
    )
}

/// The socket's directory with symlinks resolved, if trusted (see
/// [`crate::trust::trusted_dir`]).
pub(crate) fn trusted_socket_dir(dir: &Path) -> io::Result<PathBuf> {
    trusted_dir(dir).map_err(|refusal| match refusal {
        Refusal::Absent(e) => e,
        Refusal::Untrusted(why) => refused_dir(dir, why),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockets_beyond_sun_path_are_bound_and_reached() {
        let root = tempfile::tempdir().expect("tempdir");
        let deep = root.path().join("d".repeat(100)).join("e".repeat(100));
        std::fs::create_dir_all(&deep).expect("mkdir");
        let socket = deep.join("service.sock");
        assert!(socket.as_os_str().len() > SUN_PATH_MAX);
        let (listener, bound) = bind_replacing(&socket).expect("bind");
        assert_eq!(bound, socket);
        let stream = connect(&socket).expect("connect");
        assert!(listened_on_by_this_process(&socket));
        let (accepted, _) = listener.accept().expect("accept");
        drop((stream, accepted));
        assert!(inode(&socket).is_some());
        // Bound again over the old file: the caller holds the path's lock.
        let again = bind_replacing(&socket).expect("rebind");
        drop(again);
    }
}

#[cfg(test)]
mod queue_tests {
    use super::*;

    /// A listener that accepts nothing (a stopped service) with its queue
    /// full: connecting fails at once instead of waiting without end.
    #[test]
    fn a_full_queue_is_absent_at_once() {
        use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen, socket};
        let root = tempfile::tempdir().expect("tempdir");
        let path = root.path().join("stopped.sock");
        let listener = socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .expect("socket");
        bind(listener.as_raw_fd(), &UnixAddr::new(&path).expect("address")).expect("bind");
        listen(&listener, Backlog::new(1).expect("backlog")).expect("listen");
        let started = std::time::Instant::now();
        let mut held = Vec::new();
        let refusal = loop {
            match connect(&path) {
                Ok(stream) => held.push(stream),
                Err(refusal) => break refusal,
            }
            assert!(held.len() < 100, "the queue never filled");
        };
        assert!(
            matches!(refusal, Refusal::Absent(ref e) if e.kind() == io::ErrorKind::WouldBlock),
            "{refusal}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }
}
