//! A traffic probe for tests: listeners that record every connection (with
//! its `SO_ORIGINAL_DST`) and one-shot TCP/UDP clients, in any namespace and
//! as any uid. The script is Python's standard library only.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout};
use std::time::Duration;

use tempfile::TempDir;

use crate::{Netns, Run, run_as, run_in, spawn_in, spawn_in_open, wait_for};

/// Debian's own interpreter: `python3` on PATH may be another one.
const PYTHON: &str = "/usr/bin/python3";
const PROBE: &str = include_str!("../../tools/capture_probe.py");

/// `lines` as [`Listener::all`] lists what was recorded: sorted.
pub fn sorted(lines: &[&str]) -> Vec<String> {
    let mut lines: Vec<String> = lines.iter().map(|l| (*l).to_owned()).collect();
    lines.sort();
    lines
}

/// The probe script in a directory every uid can read.
#[derive(Debug)]
pub struct Probe {
    dir: TempDir,
}

impl Default for Probe {
    fn default() -> Self {
        Probe::new()
    }
}

impl Probe {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("cnit-probe-")
            .tempdir_in("/tmp")
            .expect("tempdir");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
        fs::write(dir.path().join("probe.py"), PROBE).expect("write probe");
        Probe { dir }
    }

    fn script(&self) -> PathBuf {
        self.dir.path().join("probe.py")
    }

    fn script_str(&self) -> String {
        self.script().to_str().expect("UTF-8").to_owned()
    }

    /// Listeners in `ns` recording what reaches them: TCP on `ports`, and
    /// UDP on the ports given as `udp:<port>`.
    pub fn listen(&self, ns: &Netns, ports: &[u16]) -> Listener {
        let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
        self.listen_on(ns, &ports)
    }

    /// Like [`Probe::listen`], ports as the script takes them (`8080`,
    /// `udp:5353`).
    pub fn listen_on(&self, ns: &Netns, ports: &[String]) -> Listener {
        let record = self.dir.path().join(format!("{}.log", ns.name()));
        let mut args = vec![
            self.script_str(),
            "listen".into(),
            record.to_str().expect("UTF-8").into(),
        ];
        args.extend(ports.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let child = spawn_in(ns.path(), Path::new(PYTHON), &args, &[], "");
        let listener = Listener { child, record };
        wait_for("the probe listeners", Duration::from_secs(10), || {
            listener.lines().iter().any(|l| l == "ready")
        });
        listener
    }

    /// One TCP connection from `ns` as `uid` (root when `None`), from
    /// `source` if given.
    pub fn connect(&self, ns: &Netns, uid: Option<u32>, host: &str, port: u16, source: Option<&str>) -> Run {
        let script = self.script_str();
        let port = port.to_string();
        let mut args = vec![script.as_str(), "connect", host, &port];
        args.extend(source);
        match uid {
            Some(uid) => run_as(ns.path(), uid, Path::new(PYTHON), &args),
            None => run_in(ns.path(), Path::new(PYTHON), &args, &[], ""),
        }
    }

    /// One TCP connection from `ns` whose packets carry `mark` (SO_MARK),
    /// as a proxy's own sockets do.
    pub fn connect_marked(&self, ns: &Netns, mark: u32, host: &str, port: u16) -> Run {
        let script = self.script_str();
        let (port, mark) = (port.to_string(), format!("{mark:#x}"));
        let args = [script.as_str(), "connect", host, &port];
        run_in(ns.path(), Path::new(PYTHON), &args, &[("PROBE_MARK", &mark)], "")
    }

    /// A TCP echo server in `ns` on `port` that keeps its connections.
    pub fn echo(&self, ns: &Netns, port: u16) -> Echo {
        self.echo_server(ns, port, false)
    }

    /// [`Probe::echo`] that also sends on each connection every 100 ms,
    /// as a server that streams does.
    pub fn echo_pushing(&self, ns: &Netns, port: u16) -> Echo {
        self.echo_server(ns, port, true)
    }

    fn echo_server(&self, ns: &Netns, port: u16, push: bool) -> Echo {
        let script = self.script_str();
        let port = port.to_string();
        let mut args = vec![script.as_str(), "echo", &port];
        if push {
            args.push("push");
        }
        let mut child = spawn_in_open(ns.path(), Path::new(PYTHON), &args, &[]);
        let mut out = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("the echo server's first line");
        assert_eq!(line.trim(), "ready", "the echo server did not start");
        Echo { child }
    }

    /// One TCP connection from `ns` to `host:port` kept open (to an
    /// [`Probe::echo`] server); None when it is not accepted.
    pub fn hold(&self, ns: &Netns, host: &str, port: u16) -> Option<Held> {
        let script = self.script_str();
        let port = port.to_string();
        let mut child = spawn_in_open(ns.path(), Path::new(PYTHON), &[&script, "hold", host, &port], &[]);
        let mut replies = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        let read = replies.read_line(&mut line);
        if read.is_err() || line.trim() != "connected" {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        Some(Held { child, replies })
    }

    pub fn udp(&self, ns: &Netns, host: &str, port: u16) -> Run {
        self.udp_from(ns, host, port, None)
    }

    /// One UDP datagram from `source_port` if given: datagrams from one
    /// source port are one flow to conntrack.
    pub fn udp_from(&self, ns: &Netns, host: &str, port: u16, source_port: Option<u16>) -> Run {
        let script = self.script_str();
        let port = port.to_string();
        let source_port = source_port.map(|p| p.to_string());
        let mut args = vec![script.as_str(), "udp", host, &port];
        args.extend(source_port.as_deref());
        run_in(ns.path(), Path::new(PYTHON), &args, &[], "")
    }
}

/// An echo server; stopped on drop.
#[derive(Debug)]
pub struct Echo {
    child: Child,
}

impl Drop for Echo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A connection held open; closed on drop.
#[derive(Debug)]
pub struct Held {
    child: Child,
    replies: BufReader<ChildStdout>,
}

impl Held {
    /// Whether anything comes back within a second of a line sent now
    /// (what came before is dropped first).
    pub fn echoes(&mut self) -> bool {
        let Some(stdin) = self.child.stdin.as_mut() else {
            return false;
        };
        if stdin.write_all(b"ping\n").and_then(|()| stdin.flush()).is_err() {
            return false;
        }
        let mut line = String::new();
        self.replies.read_line(&mut line).is_ok() && line.trim() == "echoed"
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
pub struct Listener {
    child: Child,
    record: PathBuf,
}

impl Listener {
    pub fn lines(&self) -> Vec<String> {
        fs::read_to_string(&self.record)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    pub fn wait_for(&self, line: &str) {
        wait_for(
            &format!("{line:?} in {}", self.record.display()),
            Duration::from_secs(5),
            || self.lines().iter().any(|l| l == line),
        );
    }

    /// Everything recorded, as a sorted list (without the ready marker).
    pub fn all(&self) -> Vec<String> {
        let mut lines: Vec<String> = self.lines().into_iter().filter(|l| l != "ready").collect();
        lines.sort();
        lines
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
