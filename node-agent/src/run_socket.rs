//! The Unix sockets the agent listens on in its run directory, where the
//! plugins find them (`PLUGIN_LOG_SOCKET`, `POLICY_SOCKET`): bound 0600
//! (plugins run as root; only a peer with write permission on the file can
//! send or connect), a former agent's socket replaced, anything else left
//! alone, and the file removed when the agent is done with it unless a
//! newer agent has bound its own there since.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The socket file this agent bound, removed when dropped unless it is
/// someone else's by then (a newer agent of a rollout binds its own at the
/// same path before this one stops).
#[derive(Debug)]
pub struct Bound {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Drop for Bound {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path).is_ok_and(|meta| {
            meta.file_type().is_socket() && meta.dev() == self.dev && meta.ino() == self.ino
        });
        if ours && let Err(e) = std::fs::remove_file(&self.path) {
            log::warn!("cannot remove {}: {e}", self.path.display());
        }
    }
}

/// Binds a socket at `path` with `bind`. A socket already there is a
/// former agent's and is replaced; anything else (a file, a link, a
/// directory) is left as it is and refused.
pub fn bind<S>(path: &Path, bind: impl FnOnce(&Path) -> io::Result<S>) -> io::Result<(S, Bound)> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "something that is no socket is there, and is left as it is",
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let socket = bind(path)?;
    let meta = std::fs::symlink_metadata(path)?;
    let bound = Bound {
        path: path.to_path_buf(),
        dev: meta.dev(),
        ino: meta.ino(),
    };
    // The directory is root's; the lstat above saw the socket just bound,
    // so the mode goes on it and not through a link put there since.
    if !meta.file_type().is_socket() {
        return Err(io::Error::other("the socket bound is not where it was bound"));
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok((socket, bound))
}
