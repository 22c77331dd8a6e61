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

/// For a process that outlives whoever started it (the lease service a
/// plugin starts): leaves the starter's session, so the starter's terminal
/// or process group signals do not reach it, and closes every descriptor
/// above stderr, so it keeps none of the runtime's pipes open (a runtime
/// reads a plugin's output until every writer has closed it). Call it
/// first thing in `main`, before anything of this process is open.
pub fn detach_from_starter() -> std::io::Result<()> {
    // Fails only for a process group leader, which a spawned child is not.
    let _ = nix::unistd::setsid();
    let open: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")?
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    for fd in open {
        // The directory listing's own descriptor is closed by now and
        // fails the check below; every other one was inherited.
        if nix::fcntl::fcntl(
            // SAFETY: only borrowed for the check.
            unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
            nix::fcntl::FcntlArg::F_GETFD,
        )
        .is_err()
        {
            continue;
        }
        // SAFETY: nothing of this process owns it (see the docs): it came
        // from the parent, and dropping the OwnedFd closes it.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    Ok(())
}
