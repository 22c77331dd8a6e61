//! One timed execution the way libcni executes a plugin (fork+exec from a
//! thread inside the node namespace, config on stdin, one reply on
//! stdout), with its wall time and the CPU time of the process and every
//! descendant it waited for (`wait4`'s rusage).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use netns::NetNs;

#[derive(Debug, Clone)]
pub struct Call {
    pub wall: Duration,
    pub cpu: Duration,
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

fn timeval(tv: libc::timeval) -> Duration {
    Duration::from_secs(u64::try_from(tv.tv_sec).unwrap_or(0))
        + Duration::from_micros(u64::try_from(tv.tv_usec).unwrap_or(0))
}

/// Runs `program` with exactly `env` (plus PATH) inside `ns`.
pub fn exec(ns: &NetNs, program: &Path, args: &[&str], env: &[(&str, &str)], stdin: &str) -> Call {
    let _inside = ns.enter().expect("enter the node namespace");
    let started = Instant::now();
    let mut child = Command::new(program)
        .args(args)
        .env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    if let Some(mut pipe) = child.stdin.take() {
        let _ = pipe.write_all(stdin.as_bytes());
    }
    let mut stdout = String::new();
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stdout.take() {
        let _ = pipe.read_to_string(&mut stdout);
    }
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    let pid = libc::pid_t::try_from(child.id()).expect("pid");
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value to be overwritten.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own unreaped child; `status` and `usage` are
    // valid for writes. std's Child is not waited afterwards.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let wall = started.elapsed();
    assert_eq!(reaped, pid, "wait4 {}", program.display());
    std::mem::forget(child);
    Call {
        wall,
        cpu: timeval(usage.ru_utime) + timeval(usage.ru_stime),
        ok: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        stdout,
        stderr,
    }
}

/// CPU time a running process has used so far, all its threads, for a
/// daemon whose work the plugins hand off (host-local's lease service).
/// The process CPU clock is exact, where /proc/<pid>/stat counts ticks of
/// 10 ms, too coarse to share among 50 calls.
pub fn process_cpu(pid: u32) -> Duration {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return Duration::ZERO;
    };
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `clock` is valid for writes.
    if unsafe { libc::clock_getcpuclockid(pid, &mut clock) } != 0 {
        return Duration::ZERO;
    }
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is valid for writes; the clock id came from the kernel.
    if unsafe { libc::clock_gettime(clock, &mut now) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

/// Milliseconds, for reports.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Stops a tracer the bench started (strace, perf) as Ctrl-C would, so
/// it writes out what it holds, and waits for it.
pub fn interrupt(tracer: &mut std::process::Child) {
    if let Ok(pid) = libc::pid_t::try_from(tracer.id()) {
        // SAFETY: kill(2) on the pid of our own child, not yet reaped.
        unsafe { libc::kill(pid, libc::SIGINT) };
    }
    let _ = tracer.wait();
}

/// The machine's (busy, total) CPU time in jiffies, from /proc/stat.
fn cpu_jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let idle = fields.get(3)? + fields.get(4).copied().unwrap_or(0);
    let total: u64 = fields.iter().take(8).sum();
    Some((total - idle, total))
}

/// Waits (at most `limit`) until the machine's CPUs were at least half
/// idle over a whole 5-second window: what an earlier phase left running
/// (a cluster's garbage collection, deletions) must not land in the next
/// phase's figures. Says how long it waited, or that it gave up.
pub fn wait_until_quiet(limit: Duration) {
    let window = Duration::from_secs(5);
    let started = Instant::now();
    while started.elapsed() < limit {
        let before = cpu_jiffies();
        std::thread::sleep(window);
        let (Some((busy0, total0)), Some((busy1, total1))) = (before, cpu_jiffies()) else {
            return;
        };
        let busy = (busy1 - busy0) as f64 / (total1 - total0).max(1) as f64;
        if busy <= 0.5 {
            eprintln!(
                "bench: the machine is quiet ({:.0}% busy) after {:?}",
                busy * 100.0,
                started.elapsed()
            );
            return;
        }
    }
    eprintln!("bench: the machine was still busy after {limit:?}; measuring anyway");
}

/// The `q`-quantile (0..=1) of `values`, nearest rank.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn median(values: &[f64]) -> f64 {
    quantile(values, 0.5)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 0.95), 5.0);
        assert_eq!(quantile(&v, 1.0), 5.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn process_cpu_reads_a_live_process_and_zero_for_none() {
        let spin = Instant::now();
        while spin.elapsed() < Duration::from_millis(20) {
            std::hint::black_box(());
        }
        assert!(process_cpu(std::process::id()) >= Duration::from_millis(10));
        assert_eq!(process_cpu(u32::MAX), Duration::ZERO);
    }
}
