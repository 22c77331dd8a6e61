//! A traffic probe for tests: listeners that record every connection (with
//! its `SO_ORIGINAL_DST`) and one-shot TCP/UDP clients, in any namespace and
//! as any uid. The script is Python's standard library only.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use tempfile::TempDir;

use crate::{Netns, Run, run_as, run_in, spawn_in, wait_for};

/// Debian's own interpreter: `python3` on PATH may be another one.
const PYTHON: &str = "/usr/bin/python3";
const PROBE: &str = include_str!("../../tools/capture_probe.py");

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
