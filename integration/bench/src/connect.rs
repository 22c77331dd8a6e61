//! New TCP connections timed from inside a pod: this binary re-executed
//! in the pod's namespace (`--connect`), connecting and closing.

use std::time::{Duration, Instant};

use test_kit::Netns;

use crate::measure::ms;

/// A pod's network namespace, found by its address among the pause
/// processes (every node's pid namespace is a child of this one's).
pub(crate) fn pod_netns(address: &str) -> Option<Netns> {
    let pids: Vec<u32> = std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "pause"))
        .collect();
    pids.into_iter().find_map(|pid| {
        let shown = test_kit::run(
            "nsenter",
            &[&format!("--net=/proc/{pid}/ns/net"), "ip", "-o", "addr"],
        );
        shown
            .stdout
            .contains(&format!(" {address}/"))
            .then(|| Netns::attach("pod", pid))
    })
}

/// New TCP connections from a pod: the connect time of each, in ms,
/// measured by this binary re-executed inside the pod's namespace.
pub(crate) fn connect_times(pod: &Netns, target: &str, count: usize) -> Result<Vec<f64>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let run = test_kit::run_in(
        pod.path(),
        &exe,
        &["--connect", target, &count.to_string()],
        &[],
        "",
    );
    if !run.ok() {
        return Err(format!("connecting from a pod to {target}: {run:?}"));
    }
    Ok(run
        .stdout
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect())
}

/// `cluster-bench --connect ADDRESS:PORT COUNT`: connects and closes
/// COUNT times, printing each connect's time in ms.
pub fn connect_loop(target: &str, count: usize) -> Result<String, String> {
    let address: std::net::SocketAddr = target.parse().map_err(|e| format!("{target}: {e}"))?;
    let mut times = Vec::with_capacity(count);
    for _ in 0..count {
        let started = Instant::now();
        let stream = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(2))
            .map_err(|e| format!("{target}: {e}"))?;
        times.push(format!("{:.4}", ms(started.elapsed())));
        drop(stream);
    }
    Ok(times.join(" "))
}
