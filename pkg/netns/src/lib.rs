//! Network namespaces.
//!
//! A namespace switch (`setns`) applies to the calling thread only, and
//! every socket, child process or thread created meanwhile stays in the
//! namespace it was created in. So the suite enters a namespace in exactly
//! one way: [`NetNs::enter`] returns a guard that switches the current thread
//! back when dropped, even on `?` or panic, and that cannot leave the thread
//! (it is `!Send`). Nothing async may hold it across an await.
//!
//! `unsafe`: one block, the child's private mount view (`pre_exec`, see
//! `hide_file_in_child`), with its SAFETY comment, allowed there alone.
//! Besides the node agent's one `set_var`, this is the suite's only
//! `unsafe` code: every other shipping crate root forbids it (checked by
//! the packaging tests).

#![deny(unsafe_code)]

use std::fs::File;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::sched::{CloneFlags, setns};
use nix::sys::statfs::fstatfs;

mod mount;

pub use mount::hide_file_in_child;

/// `NSFS_MAGIC`: the filesystem behind `/proc/<pid>/ns/*` and their bind
/// mounts under `/run/netns`.
const NSFS_MAGIC: i64 = 0x6e73_6673;

/// The namespace of the calling thread. `/proc/self` would name the main
/// thread's.
const THREAD_NETNS: &str = "/proc/thread-self/ns/net";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("failed to open netns {path:?}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path:?} is not a network namespace")]
    NotNetns { path: PathBuf },
    #[error("failed to enter netns {path:?}: {source}")]
    Enter {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
}

impl Error {
    /// The namespace no longer exists: its path is gone, or is no longer a
    /// namespace (an unmounted `/run/netns` entry). DEL treats this as done.
    pub fn is_gone(&self) -> bool {
        match self {
            Error::Open { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            Error::NotNetns { .. } => true,
            Error::Enter { .. } => false,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An open handle on a network namespace; keeping it open keeps the
/// namespace alive.
#[derive(Debug)]
pub struct NetNs {
    file: File,
    path: PathBuf,
}

impl NetNs {
    /// Opens `path` and checks that it is a network namespace.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| Error::Open {
            path: path.clone(),
            source,
        })?;
        let is_nsfs = fstatfs(&file).is_ok_and(|fs| fs.filesystem_type().0 == NSFS_MAGIC);
        if !is_nsfs {
            return Err(Error::NotNetns { path });
        }
        Ok(NetNs { file, path })
    }

    /// The namespace the calling thread is in now.
    pub fn current() -> Result<Self> {
        NetNs::open(THREAD_NETNS)
    }

    /// A new, empty namespace that lives as long as the handle: for
    /// loading rules somewhere harmless to see how the kernel stores them.
    /// A short-lived thread unshares so no caller's thread changes
    /// namespace; its path is this process's descriptor for it.
    pub fn scratch() -> Result<Self> {
        let unshared = std::thread::spawn(|| -> std::io::Result<File> {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET)?;
            File::open(THREAD_NETNS)
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the unsharing thread panicked")));
        let path = PathBuf::from("scratch network namespace");
        let file = unshared.map_err(|source| Error::Open { path, source })?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        Ok(NetNs { file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether both handles name the same namespace.
    pub fn same_as(&self, other: &NetNs) -> bool {
        match (self.file.metadata(), other.file.metadata()) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }

    /// Switches the calling thread into this namespace until the guard is
    /// dropped.
    pub fn enter(&self) -> Result<NetNsGuard> {
        let previous = NetNs::current()?;
        setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| Error::Enter {
            path: self.path.clone(),
            source,
        })?;
        Ok(NetNsGuard {
            previous,
            _not_send: PhantomData,
        })
    }

    /// Blocks until this process holds the namespace's exclusive lock: a
    /// `flock` on the namespace itself (its nsfs inode, opened anew so the
    /// lock is this call's alone). Every process that opens the same
    /// namespace, from any path or mount namespace, contends for it, other
    /// namespaces do not, and nothing is left on disk. Released when the
    /// returned value is dropped.
    pub fn lock(&self) -> std::io::Result<NetNsLock> {
        let file = File::open(format!("/proc/self/fd/{}", self.file.as_raw_fd()))?;
        file.lock()?;
        Ok(NetNsLock { _file: file })
    }

    /// Runs `f` inside this namespace on the calling thread.
    pub fn run<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let _guard = self.enter()?;
        Ok(f())
    }
}

impl AsFd for NetNs {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// An exclusive lock on one network namespace; see [`NetNs::lock`].
#[derive(Debug)]
#[must_use = "the lock is released as soon as it is dropped"]
pub struct NetNsLock {
    _file: File,
}

/// While alive, the current thread is inside another namespace.
#[derive(Debug)]
#[must_use = "the thread returns to its namespace as soon as the guard is dropped"]
pub struct NetNsGuard {
    previous: NetNs,
    // setns affects one thread: the guard must be dropped on the thread that
    // entered.
    _not_send: PhantomData<*const ()>,
}

impl Drop for NetNsGuard {
    fn drop(&mut self) {
        if let Err(e) = setns(self.previous.file.as_fd(), CloneFlags::CLONE_NEWNET) {
            // Carrying on would run the rest of the process (rollback, host
            // side changes) in the pod's namespace; stopping is the only safe
            // answer.
            eprintln!("fatal: cannot return to netns {:?}: {e}", self.previous.path);
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_namespace_is_new_and_reopens_by_its_path() {
        let here = NetNs::current().expect("current");
        let scratch = NetNs::scratch().expect("scratch needs root");
        assert!(!scratch.same_as(&here));
        let again = NetNs::open(scratch.path()).expect("its path names it");
        assert!(again.same_as(&scratch));
        assert!(
            NetNs::current().expect("current").same_as(&here),
            "the caller stays put"
        );
    }

    #[test]
    fn refuses_files_that_are_not_namespaces() {
        let err = NetNs::open("/proc/self/status").expect_err("not a netns");
        assert!(matches!(err, Error::NotNetns { .. }));
        assert!(err.is_gone());
        let err = NetNs::open("/nonexistent/netns").expect_err("missing");
        assert!(err.is_gone());
    }

    fn new_private_netns() -> NetNs {
        nix::sched::unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET) needs root");
        NetNs::current().expect("the new namespace")
    }

    fn reopen(ns: &NetNs) -> File {
        File::open(format!("/proc/self/fd/{}", ns.as_fd().as_raw_fd())).expect("reopen")
    }

    #[test]
    fn the_lock_excludes_other_openers_of_the_same_namespace_only() {
        std::thread::scope(|s| {
            s.spawn(|| {
                let node = new_private_netns();
                let other = new_private_netns();
                let held = node.lock().expect("lock");
                assert!(matches!(
                    reopen(&node).try_lock(),
                    Err(std::fs::TryLockError::WouldBlock)
                ));
                assert!(reopen(&other).try_lock().is_ok());
                drop(held);
                assert!(reopen(&node).try_lock().is_ok());
            });
        });
    }

    #[test]
    fn the_guard_returns_the_thread_to_its_namespace() {
        std::thread::scope(|s| {
            s.spawn(|| {
                let pod = new_private_netns();
                let home = new_private_netns();
                assert!(!pod.same_as(&home));
                {
                    let _inside = pod.enter().expect("enter");
                    assert!(NetNs::current().expect("netns").same_as(&pod));
                }
                assert!(NetNs::current().expect("netns").same_as(&home));
                let seen = pod.run(|| NetNs::current().expect("netns")).expect("run");
                assert!(seen.same_as(&pod));
                assert!(NetNs::current().expect("netns").same_as(&home));
                let failed: Result<(), Error> = (|| {
                    let _inside = pod.enter()?;
                    Err(Error::NotNetns {
                        path: "early return".into(),
                    })
                })();
                assert!(failed.is_err());
                assert!(
                    NetNs::current().expect("netns").same_as(&home),
                    "an early return still comes back"
                );
            });
        });
    }

    #[test]
    fn opens_the_current_namespace() {
        let a = NetNs::current().expect("own netns");
        let b = NetNs::open("/proc/self/ns/net").expect("own netns");
        assert!(a.same_as(&b));
    }
}
