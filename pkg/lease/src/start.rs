//! Starting a lease service on demand: a plugin process whose data
//! directory has no service starts `host-local serve` there, detached
//! (see [`start_detached`]), and the started service cuts its ties to the
//! runtime first thing ([`detach_from_starter`]).

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::socket::{self, open_lock_file, trusted_socket_dir};

/// How long a service that a plugin started serves without a request
/// before it exits.
pub const IDLE_EXIT: Duration = Duration::from_secs(300);
/// How long a plugin waits for a service it started to listen.
const START_PATIENCE: Duration = Duration::from_secs(3);
/// A started service's log is emptied when it starts beyond this size.
const LOG_LIMIT: u64 = 1 << 20;

/// The service's stderr: `.service.log`, appended to and cut when over
/// [`LOG_LIMIT`]; opened without blocking, and nothing but a regular file
/// (a FIFO there would hold every call of the data directory behind the
/// start lock). Something else there leaves the service without a log.
fn service_log(path: &Path) -> std::io::Result<std::process::Stdio> {
    let opened = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | cni::small_file::OPEN_FLAGS)
        .open(path);
    let log = match opened {
        Ok(log) if log.metadata()?.is_file() => log,
        Ok(_) | Err(_) => {
            log::warn!(
                "{} is not a regular file: the lease service logs nothing",
                path.display()
            );
            return Ok(std::process::Stdio::null());
        }
    };
    if log.metadata()?.len() > LOG_LIMIT {
        log.set_len(0)?;
    }
    Ok(log.into())
}

/// Starts `exe serve` on `socket` (a data directory's own, logging to
/// `.service.log` beside it) unless a
/// service already listens there, and waits until it does. Plugins that
/// race to start one take turns on `<socket>.start`: the first starts it,
/// the others find it listening. The service gets no descriptor of the
/// caller's (its stdio is /dev/null and its log file; it closes anything
/// else it inherits and leaves the caller's session), so a runtime reading
/// the plugin's output to the end is never held up by it; it exits after
/// [`IDLE_EXIT`] without a request.
pub fn start_detached(exe: &Path, socket: &Path, deadline: Instant) -> io::Result<()> {
    let (dir, _) = socket::split(socket)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    trusted_socket_dir(dir)?;
    let mut turn_path = socket.as_os_str().to_owned();
    turn_path.push(".start");
    let turn = open_lock_file(Path::new(&turn_path))?;
    turn.lock()?;
    if socket::connect(socket).is_ok() {
        return Ok(());
    }
    let log_path = dir.join(".service.log");
    let log = service_log(&log_path)?;
    let mut child = std::process::Command::new(exe)
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .arg("--idle-exit")
        .arg(IDLE_EXIT.as_secs().to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()?;
    let until = deadline.min(Instant::now() + START_PATIENCE);
    loop {
        if socket::connect(socket).is_ok() {
            log::info!(
                "started the lease service {} on {} (log: {})",
                child.id(),
                socket.display(),
                log_path.display()
            );
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            return Err(io::Error::other(format!(
                "the lease service it started exited ({status}); see {}",
                log_path.display()
            )));
        }
        if Instant::now() >= until {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the lease service it started is not listening on {}",
                    socket.display()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The other half of [`start_detached`], run by the service it starts
/// before it opens anything: leaves the starter's session, so signals to
/// the runtime's terminal or process group do not reach it, and closes
/// every descriptor above stderr, so it holds none of the runtime's pipes
/// (a runtime reads a plugin's output until every writer has closed it,
/// and may let the plugin inherit more than its stdio).
pub fn detach_from_starter() -> io::Result<()> {
    // Fails only for a process group leader, which a spawned child is not.
    let _ = nix::unistd::setsid();
    let inherited: Vec<std::os::fd::RawFd> = std::fs::read_dir("/proc/self/fd")?
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    for fd in inherited {
        // Closing by number is sound only because nothing of this process
        // owns a descriptor yet (see the docs); the listing's own one is
        // closed already, and closing it again fails harmlessly.
        let _ = nix::unistd::close(fd);
    }
    Ok(())
}
