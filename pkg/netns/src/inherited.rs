//! File descriptors a process inherits from whoever started it. Taking
//! ownership of a descriptor by number is unsafe in Rust; this crate is the
//! suite's one place for unsafe code, so it lives here.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;

/// systemd socket activation (`sd_listen_fds`): a `.socket` unit binds the
/// socket and starts the service on the first connection, passing the
/// listener as fd 3 with `LISTEN_PID`/`LISTEN_FDS`. Call it first thing in
/// `main`, before any thread exists: it edits the environment.
pub fn systemd_listener() -> Option<UnixListener> {
    const SD_LISTEN_FDS_START: RawFd = 3;
    let for_us = std::env::var("LISTEN_PID").ok()?.parse::<u32>().ok()? == std::process::id();
    let count = std::env::var("LISTEN_FDS").ok()?.parse::<u32>().ok()?;
    // SAFETY: only this process touches its environment, before any thread starts.
    unsafe {
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
        std::env::remove_var("LISTEN_FDNAMES");
    }
    if !for_us || count != 1 {
        return None;
    }
    // SAFETY: the service manager hands fd 3 to this process alone, as a
    // listening socket; nothing else in the process owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(SD_LISTEN_FDS_START) };
    let listener = UnixListener::from(fd);
    // Plugin code never execs, but the fd must not leak if it ever does.
    nix::fcntl::fcntl(
        &listener,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .ok()?;
    Some(listener)
}
