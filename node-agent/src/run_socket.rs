//! The Unix sockets the agent listens on in its run directory, where the
//! plugins find them (`PLUGIN_LOG_SOCKET`, `POLICY_SOCKET`, ambient's pod
//! events and ztunnel's ZDS socket): bound 0600
//! (plugins run as root; only a peer with write permission on the file can
//! send or connect), a former agent's socket (one of this agent's user)
//! replaced, anything else left alone, and the file removed when the agent
//! is done with it unless a newer agent has bound its own there since.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::net::{UnixListener, UnixStream};

/// The socket file this agent bound, removed when dropped unless it is
/// someone else's by then (a newer agent of a rollout binds its own at the
/// same path before this one stops).
#[derive(Debug)]
pub struct Bound {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

/// What a bound socket's path holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// The socket this agent bound.
    Ours,
    /// Nothing: someone removed it.
    Empty,
    /// Something else: a newer agent's socket, or anyone's file.
    Taken,
}

impl Bound {
    pub fn place(&self) -> Place {
        match std::fs::symlink_metadata(&self.path) {
            Ok(meta) if meta.file_type().is_socket() && meta.dev() == self.dev && meta.ino() == self.ino => {
                Place::Ours
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Place::Empty,
            // Unreadable counts as not ours: nothing is removed or claimed.
            _ => Place::Taken,
        }
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        if self.place() == Place::Ours
            && let Err(e) = std::fs::remove_file(&self.path)
        {
            log::warn!("cannot remove {}: {e}", self.path.display());
        }
    }
}

/// Binds a socket at `path` with `bind`. A socket of this agent's user
/// already there is a former agent's and is replaced; anything else (a
/// file, a link, a directory, another user's socket) is left as it is and
/// refused.
pub fn bind<S>(path: &Path, bind: impl FnOnce(&Path) -> io::Result<S>) -> io::Result<(S, Bound)> {
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)?;
        only_ours(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() && meta.uid() == nix::unistd::geteuid().as_raw() => {
            std::fs::remove_file(path)?;
        }
        Ok(meta) if meta.file_type().is_socket() => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "a socket of uid {} is there, no former agent's, and is left as it is",
                    meta.uid()
                ),
            ));
        }
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
    // The directory is only ours to write; the lstat above saw the socket just bound,
    // so the mode goes on it and not through a link put there since.
    if !meta.file_type().is_socket() {
        return Err(io::Error::other("the socket bound is not where it was bound"));
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok((socket, bound))
}

/// Refuses a directory another user owns or may write in: whoever can
/// replace the socket there could answer the plugins in the agent's name
/// (tell a pod's ADD its policy is enforced) or read their logs.
fn only_ours(dir: &Path) -> io::Result<()> {
    let meta = std::fs::metadata(dir)?;
    let euid = nix::unistd::geteuid().as_raw();
    if meta.is_dir() && meta.uid() == euid && meta.mode() & 0o022 == 0 {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "{} is not a directory only uid {euid} may write in (owner {}, mode {:o}); left as it is",
            dir.display(),
            meta.uid(),
            meta.mode() & 0o7777
        ),
    ))
}

/// How often a [`Kept`] socket that cannot listen tries again, and a
/// listening one looks whether its file is still at its path.
pub const LOOK_AGAIN: Duration = Duration::from_secs(5);

/// A stream socket the agent keeps listening at its path for as long as it
/// runs (the NetworkPolicy gate, ambient's pod events). One that cannot
/// listen (something at the path that is not a former agent's socket: a
/// file, a directory, a link, another user's socket) leaves that in place,
/// says so once and tries again every [`LOOK_AGAIN`]; a listening one looks
/// as often whether its file is still there, and binds again when someone
/// removed it. One a newer agent of a rollout replaced is left to that
/// agent.
pub struct Kept {
    path: PathBuf,
    /// Who listens, for the log: "NetworkPolicy", "ambient".
    owner: &'static str,
    /// What the plugins do there, said once it listens.
    serving: &'static str,
    /// What happens while it does not listen, said with the reason.
    meanwhile: &'static str,
    listening: Option<(UnixListener, Bound)>,
    /// Whether a socket of the agent's user at the path may be replaced:
    /// at start (a former agent's, or the one of the agent this one
    /// replaces in a rollout), no longer once another took the place of
    /// this agent's (two agents would take it from each other in turn).
    may_replace: bool,
    next_look: Instant,
    /// Why it does not listen, said when it first shows.
    problem: Option<String>,
    /// Told whether it listens, at each change.
    on_listening: Box<dyn Fn(bool) + Send + Sync>,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kept")
            .field("path", &self.path)
            .field("listening", &self.listening.is_some())
            .finish_non_exhaustive()
    }
}

impl Kept {
    /// Binds `path` now, or says why it cannot and tries again as
    /// [`Kept::accept`] is called.
    pub fn new(
        path: PathBuf,
        (owner, serving, meanwhile): (&'static str, &'static str, &'static str),
        on_listening: impl Fn(bool) + Send + Sync + 'static,
    ) -> Kept {
        let mut kept = Kept {
            path,
            owner,
            serving,
            meanwhile,
            listening: None,
            may_replace: true,
            next_look: Instant::now(),
            problem: None,
            on_listening: Box::new(on_listening),
        };
        kept.bind();
        kept
    }

    /// The next connection; None when the socket was looked at (or bound
    /// again) instead, every [`LOOK_AGAIN`].
    pub async fn accept(&mut self) -> Option<UnixStream> {
        let look = tokio::time::sleep_until(self.next_look.into());
        let accepted = match &self.listening {
            Some((listener, _)) => tokio::select! {
                accepted = listener.accept() => Some(accepted),
                () = look => None,
            },
            None => {
                look.await;
                None
            }
        };
        match accepted {
            Some(Ok((stream, _))) => return Some(stream),
            Some(Err(e)) => {
                log::warn!("{}: accepting on {}: {e}", self.owner, self.path.display());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None => self.look(),
        }
        None
    }

    /// Whether the socket is still there; binds it when it is not.
    pub fn look(&mut self) {
        let Some((_, bound)) = &self.listening else {
            self.bind();
            return;
        };
        self.next_look = Instant::now() + LOOK_AGAIN;
        match bound.place() {
            Place::Ours => {}
            Place::Empty => {
                log::warn!(
                    "{}: {} was removed; binding it again",
                    self.owner,
                    self.path.display()
                );
                self.listening = None;
                self.bind();
            }
            Place::Taken => {
                self.may_replace = false;
                self.listening = None;
                self.bind();
            }
        }
    }

    fn bind(&mut self) {
        self.next_look = Instant::now() + LOOK_AGAIN;
        let path = self.path.display();
        let taken = !self.may_replace
            && std::fs::symlink_metadata(&self.path)
                .map_or_else(|e| e.kind() != io::ErrorKind::NotFound, |_| true);
        if taken {
            let problem = format!(
                "{path} is no longer this agent's socket (a newer agent's, or something put there); \
                 it is bound again only once it is gone"
            );
            self.down(problem, log::Level::Warn);
            return;
        }
        let bound = bind(&self.path, |path| {
            let listener = std::os::unix::net::UnixListener::bind(path)?;
            listener.set_nonblocking(true)?;
            UnixListener::from_std(listener)
        });
        match bound {
            Ok(listening) => {
                log::info!("{}: {} {path}", self.owner, self.serving);
                self.listening = Some(listening);
                self.problem = None;
                (self.on_listening)(true);
            }
            Err(e) => {
                let problem = format!(
                    "cannot listen on {path}: {e}; {}; trying again every {LOOK_AGAIN:?}",
                    self.meanwhile
                );
                self.down(problem, log::Level::Error);
            }
        }
    }

    /// Not listening, for `problem`: said when it first shows.
    fn down(&mut self, problem: String, level: log::Level) {
        (self.on_listening)(false);
        if self.problem.as_ref() != Some(&problem) {
            log::log!(level, "{}: {problem}", self.owner);
            self.problem = Some(problem);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener(path: &Path) -> io::Result<std::os::unix::net::UnixListener> {
        std::os::unix::net::UnixListener::bind(path)
    }

    #[test]
    fn another_users_socket_is_left_as_it_is_and_a_former_agents_replaced() {
        let scratch = tempfile::tempdir().expect("a scratch directory");
        let path = scratch.path().join("a.sock");
        let former = listener(&path).expect("a former agent's socket");
        drop(former);
        let (_socket, bound) = bind(&path, listener).expect("replaces a former agent's");
        assert_eq!(bound.place(), Place::Ours);
        drop(bound);

        let _someone = listener(&path).expect("a socket");
        let other = nix::unistd::geteuid().as_raw() + 1;
        std::os::unix::fs::lchown(&path, Some(other), None).expect("chown (tests run as root)");
        let inode = std::fs::symlink_metadata(&path).expect("there").ino();
        let refused = bind(&path, listener).expect_err("another user's socket");
        assert_eq!(refused.kind(), io::ErrorKind::AlreadyExists, "{refused}");
        let meta = std::fs::symlink_metadata(&path).expect("still there");
        assert_eq!((meta.ino(), meta.uid()), (inode, other), "left as it is");
    }

    #[test]
    fn a_directory_others_may_write_in_or_own_is_refused_and_left_as_it_is() {
        let scratch = tempfile::tempdir().expect("a scratch directory");
        let dir = scratch.path().join("run");
        let (_socket, bound) = bind(&dir.join("a.sock"), listener).expect("a directory made here");
        drop(bound);
        assert!(!dir.join("a.sock").exists(), "removed when done");

        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let refused = bind(&dir.join("a.sock"), listener).expect_err("world-writable");
        assert_eq!(refused.kind(), io::ErrorKind::PermissionDenied, "{refused}");
        assert!(!dir.join("a.sock").exists());
        assert_eq!(
            std::fs::metadata(&dir).expect("still there").mode() & 0o777,
            0o777,
            "left as it is"
        );

        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let other = nix::unistd::geteuid().as_raw() + 1;
        std::os::unix::fs::chown(&dir, Some(other), None).expect("chown (tests run as root)");
        let refused = bind(&dir.join("a.sock"), listener).expect_err("another user's");
        assert_eq!(refused.kind(), io::ErrorKind::PermissionDenied, "{refused}");
    }
}
