//! host-local's lease service for the lease directory the conflist names,
//! run by the agent from the host-local it installed: without it, the
//! first ADD after the service's idle exit pays for starting one. The
//! service listens where host-local looks first for a configuration with
//! no `socket` key (`<dataDir>/.sled/.service.sock`), and it runs the very
//! file the runtime executes, which is what lets the bridge ask it
//! directly instead of executing host-local
//! (docs/decisions/008-zero-setup.md).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

use crate::error::Error;

/// How long the service gets to answer what it accepted and flush after
/// SIGTERM before it is killed: beyond its own bound on that wait.
const STOP_PATIENCE: Duration = lease::PATIENCE.saturating_add(Duration::from_secs(5));
/// The wait before starting it again after it exited.
const RESTART_DELAY: Duration = Duration::from_secs(1);
/// A service that exits sooner than this after its start is started again
/// only after ten restart delays.
const QUICK_EXIT: Duration = Duration::from_secs(5);

/// The running supervisor: ask it to restart the service (a new host-local
/// was installed) or to stop it.
#[derive(Debug)]
pub struct LeaseService {
    orders: watch::Sender<Order>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    Run(u64),
    Stop,
}

impl LeaseService {
    /// Starts `<bin_dir>/host-local serve` for `lease_dir` and keeps it
    /// running: when it exits it is started again, and while another
    /// service answers on its socket none is started.
    pub fn start(bin_dir: &Path, lease_dir: &Path) -> LeaseService {
        let (orders, mut received) = watch::channel(Order::Run(0));
        let exe = bin_dir.join("host-local");
        let socket = ipam_config::lease_settings::data_dir_socket(lease_dir);
        let task = tokio::spawn(async move {
            let mut said_taken = false;
            loop {
                // A service a plugin started (or an earlier agent's, left
                // by a SIGKILL) serves there: the agent's would only fail
                // to take the place. It takes over once that one exits.
                if lease::is_served(&socket) {
                    if !said_taken {
                        log::info!(
                            "another lease service serves {}; starting one when it exits",
                            socket.display()
                        );
                        said_taken = true;
                    }
                    if wait_or_stop(&mut received, RESTART_DELAY * 5).await {
                        return;
                    }
                    continue;
                }
                said_taken = false;
                let mut child = match spawn(&exe, &socket) {
                    Ok(child) => child,
                    Err(e) => {
                        log::error!("cannot start the lease service {}: {e}", exe.display());
                        if wait_or_stop(&mut received, RESTART_DELAY * 10).await {
                            return;
                        }
                        continue;
                    }
                };
                log::info!(
                    "lease service {} on {}",
                    child.id().unwrap_or_default(),
                    socket.display()
                );
                let started = tokio::time::Instant::now();
                tokio::select! {
                    status = child.wait() => {
                        match status {
                            Ok(status) => log::warn!("the lease service exited ({status}); starting it again"),
                            Err(e) => log::warn!("the lease service: {e}"),
                        }
                        // One that fails at once is not restarted in a
                        // tight loop.
                        let delay = if started.elapsed() < QUICK_EXIT { RESTART_DELAY * 10 } else { RESTART_DELAY };
                        if wait_or_stop(&mut received, delay).await {
                            return;
                        }
                    }
                    order = changed(&mut received) => {
                        stop(&mut child).await;
                        if order == Order::Stop {
                            return;
                        }
                    }
                }
            }
        });
        LeaseService { orders, task }
    }

    /// What restarts the service from elsewhere.
    pub fn restarter(&self) -> Restarter {
        Restarter(self.orders.clone())
    }

    /// Stops the service (SIGTERM: it answers what it accepted and makes
    /// every answered change durable) and waits for it.
    pub async fn stop(self) {
        let _ = self.orders.send(Order::Stop);
        let _ = self.task.await;
    }
}

/// Restarts the lease service: a new host-local was installed.
#[derive(Debug, Clone)]
pub struct Restarter(watch::Sender<Order>);

impl Restarter {
    pub fn restart(&self) {
        self.0.send_modify(|order| {
            if let Order::Run(generation) = order {
                *generation += 1;
            }
        });
    }
}

/// Stops a lease service that still listens on the lease directory's
/// socket once the agent's own has stopped: one a plugin started, or the
/// child of an earlier agent that was killed with SIGKILL (nothing stops
/// that one otherwise: it has no idle exit). Only a root process named
/// `host-local` is signalled. True when there was one.
pub fn stop_remaining(lease_dir: &Path) -> Result<bool, Error> {
    let socket = ipam_config::lease_settings::data_dir_socket(lease_dir);
    let Some(pid) = lease::serving_pid(&socket) else {
        return Ok(false);
    };
    if pid == 0 {
        return Err(Error::Io(format!(
            "{} is served by a process outside the agent's pid namespace: left running (the agent needs the host's, hostPID)",
            socket.display()
        )));
    }
    // Its name, not its executable: reading /proc/<pid>/exe needs ptrace
    // access, which a process with more capabilities than the agent (one
    // the runtime started) refuses, and names a replaced file "(deleted)".
    // The socket's trust check already made sure it runs as root.
    let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if name.trim_end() != "host-local" {
        return Err(Error::Io(format!(
            "{} is served by pid {pid} ({}), not host-local: left running",
            socket.display(),
            name.trim_end()
        )));
    }
    let target = nix::unistd::Pid::from_raw(pid);
    let _ = nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGTERM);
    // Its socket goes first; the process ends once what it answered is
    // on disk.
    let deadline = std::time::Instant::now() + STOP_PATIENCE;
    while running(pid) {
        if std::time::Instant::now() > deadline {
            log::warn!("the lease service {pid} did not stop within {STOP_PATIENCE:?}; killing it");
            let _ = nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGKILL);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(true)
}

/// Whether `pid` runs: not gone, and not a zombie (an orphan handed to
/// an agent that is pid 1 of its container stays one until reaped).
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// What uninstall found in the lease directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseDir {
    Absent,
    Removed,
    /// Leases are held (the node still has pods of this network), or it
    /// holds files that are not host-local's: kept.
    Kept,
}

/// Removes the lease directory once no network in it holds a lease (the
/// node's pods are gone) and it holds nothing but host-local's own files
/// (each network's `lock`, and `.sled`). Its parent goes too when that
/// leaves it empty and it is the default's (`/run/cni-suite`). The leases
/// are listed by `cnictl` from `tools` (the agent links no lease store).
pub fn remove_unused(lease_dir: &Path, tools: &Path) -> Result<LeaseDir, Error> {
    let unreadable = |e: std::io::Error| Error::Io(format!("cannot read {}: {e}", lease_dir.display()));
    let entries = match std::fs::read_dir(lease_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(LeaseDir::Absent),
        Err(e) => return Err(unreadable(e)),
    };
    for entry in entries {
        let entry = entry.map_err(unreadable)?;
        let network = entry.file_name().to_string_lossy().into_owned();
        if network.starts_with('.') {
            continue;
        }
        let only_lock = std::fs::read_dir(entry.path())
            .map(|files| files.flatten().all(|f| f.file_name() == "lock"))
            .unwrap_or(false);
        if !only_lock {
            log::warn!(
                "{} holds {network}, which is not host-local's: kept",
                lease_dir.display()
            );
            return Ok(LeaseDir::Kept);
        }
        if held_leases(tools, lease_dir, &network)? > 0 {
            log::warn!("{} still holds leases of {network}: kept", lease_dir.display());
            return Ok(LeaseDir::Kept);
        }
    }
    std::fs::remove_dir_all(lease_dir)
        .map_err(|e| Error::Io(format!("cannot remove {}: {e}", lease_dir.display())))?;
    if let Some(parent) = lease_dir.parent()
        && parent.file_name().is_some_and(|name| name == "cni-suite")
    {
        let _ = std::fs::remove_dir(parent);
    }
    Ok(LeaseDir::Removed)
}

/// How many leases `network` holds in `lease_dir`: `cnictl ipam ls` with
/// no node service (the agent's own has stopped), opening the store
/// itself under the network's lock, or asking a service that took the
/// data directory meanwhile.
fn held_leases(tools: &Path, lease_dir: &Path, network: &str) -> Result<usize, Error> {
    // The one shipped beside the agent first (its image's), then the one
    // among the binaries it installs from.
    let beside_agent = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("cnictl")));
    let cnictl = beside_agent
        .filter(|path| path.is_file())
        .unwrap_or_else(|| tools.join("cnictl"));
    let listing = |e: String| {
        Error::Io(format!(
            "listing the leases of {network} with {}: {e}",
            cnictl.display()
        ))
    };
    let output = std::process::Command::new(&cnictl)
        .args(["--json", "ipam", "--socket", "", "--data-dir"])
        .arg(lease_dir)
        .args(["ls", "--", network])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| listing(e.to_string()))?;
    if !output.status.success() {
        return Err(listing(format!(
            "{}: {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout).trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let leases: Vec<serde_json::Value> =
        serde_json::from_slice(&output.stdout).map_err(|e| listing(format!("unreadable list: {e}")))?;
    Ok(leases.len())
}

/// Starts the service; what it writes to stderr becomes the agent's log
/// records (target `lease-service`), so the agent's log stays JSON lines.
fn spawn(exe: &PathBuf, socket: &Path) -> std::io::Result<Child> {
    let mut child = Command::new(exe)
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    if let Some(stderr) = child.stderr.take() {
        tokio::spawn(async move {
            // Bytes, not text: a line that is not UTF-8 must not stop the
            // reading, or the pipe fills and the service blocks logging.
            let mut reader = BufReader::new(stderr);
            let mut line = Vec::new();
            while reader
                .read_until(b'\n', &mut line)
                .await
                .is_ok_and(|read| read > 0)
            {
                log::info!(target: "lease-service", "{}", String::from_utf8_lossy(&line).trim_end());
                line.clear();
            }
        });
    }
    Ok(child)
}

/// The next order.
async fn changed(received: &mut watch::Receiver<Order>) -> Order {
    if received.changed().await.is_err() {
        return Order::Stop;
    }
    *received.borrow_and_update()
}

/// Waits `delay`; true when told to stop meanwhile.
async fn wait_or_stop(received: &mut watch::Receiver<Order>, delay: Duration) -> bool {
    tokio::select! {
        () = tokio::time::sleep(delay) => *received.borrow() == Order::Stop,
        order = changed(received) => order == Order::Stop,
    }
}

async fn stop(child: &mut Child) {
    if let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok()) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
    }
    match tokio::time::timeout(STOP_PATIENCE, child.wait()).await {
        Ok(Ok(status)) => log::info!("the lease service stopped ({status})"),
        Ok(Err(e)) => log::warn!("the lease service: {e}"),
        Err(_) => {
            log::warn!("the lease service did not stop within {STOP_PATIENCE:?}; killing it");
            let _ = child.kill().await;
        }
    }
}
