//! The harness for end-to-end tests: every test gets its own "node" network
//! namespace (playing the host) and pod namespaces, runs the built plugin
//! binaries inside the node namespace the way a runtime does, and removes all
//! of it when the test ends, passes or panics. The machine's own root
//! namespace is never touched.
//!
//! Tests need root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and fail loudly without it.
//!
//! Besides: the lease helpers (`leases`), a traffic probe (`probe`), the
//! node agent's harness (`node_agent`), the real cluster's handle
//! (`cluster`), and stand-ins for what a node talks to (`fakes`).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fmt;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::Value;
use tempfile::TempDir;

pub mod cluster;
pub mod fakes;
pub mod leases;
pub mod node_agent;
pub mod probe;

/// Where `ip netns` keeps its namespace files.
const NETNS_DIR: &str = "/run/netns";
/// Every namespace the harness makes starts with this, then the owning pid.
const PREFIX: &str = "cnit";

static SEQUENCE: AtomicU32 = AtomicU32::new(0);
static SWEEP: Once = Once::new();

/// The directory holding the binaries under test: `CNI_SUITE_BIN_DIR`, else
/// the static release build `make build` produces.
pub fn bin_dir() -> PathBuf {
    let dir = std::env::var_os("CNI_SUITE_BIN_DIR").map_or_else(
        || {
            let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
            workspace.join("target").join(host_triple()).join("release")
        },
        PathBuf::from,
    );
    assert!(
        dir.join("cnictl").is_file(),
        "no built binaries in {}: run `make build` first, or set CNI_SUITE_BIN_DIR",
        dir.display()
    );
    dir
}

fn host_triple() -> String {
    let out = Command::new("rustc").arg("-vV").output().expect("rustc -vV runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .map(str::to_owned)
        .expect("rustc -vV prints the host triple")
}

pub fn bin(name: &str) -> PathBuf {
    bin_dir().join(name)
}

/// Fails the test, with the reason, unless it runs as root.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "integration tests create network namespaces, veths and firewall rules and must run as root \
         (e.g. `sudo make test`); they are never skipped"
    );
}

/// The outcome of one executed command.
pub struct Run {
    pub what: String,
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl fmt::Debug for Run {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` exited {:?}\n--- stdout\n{}--- stderr\n{}",
            self.what, self.code, self.stdout, self.stderr
        )
    }
}

impl Run {
    pub(crate) fn from_output(what: String, output: Output) -> Self {
        Run {
            what,
            code: output.status.code(),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }

    pub fn ok(&self) -> bool {
        self.code == Some(0)
    }

    /// Panics with everything the command printed unless it succeeded.
    pub fn success(self) -> Self {
        assert!(self.ok(), "expected success: {self:?}");
        self
    }

    /// Panics with everything the command printed unless it failed.
    pub fn failure(self) -> Self {
        assert!(!self.ok() && self.code.is_some(), "expected a failure: {self:?}");
        self
    }

    /// stdout as exactly one JSON document (nothing before or after it).
    pub fn json(&self) -> Value {
        let mut docs = serde_json::Deserializer::from_str(&self.stdout).into_iter::<Value>();
        let first = docs
            .next()
            .unwrap_or_else(|| panic!("no JSON on stdout: {self:?}"))
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:?}"));
        assert!(
            docs.next().is_none(),
            "more than one document on stdout: {self:?}"
        );
        first
    }
}

/// Runs `program args` inside the namespace at `netns` (via nsenter, which
/// only switches the network namespace) with `env` added, feeding `stdin`.
pub fn run_in(netns: &Path, program: &Path, args: &[&str], env: &[(&str, &str)], stdin: &str) -> Run {
    let what = format!("{} {}", program.display(), args.join(" "));
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    if let Some(mut pipe) = child.stdin.take() {
        use std::io::Write;
        pipe.write_all(stdin.as_bytes()).ok();
    }
    let output = child.wait_with_output().unwrap_or_else(|e| panic!("{what}: {e}"));
    Run::from_output(what, output)
}

/// [`run_in`] under `strace -f`, and the programs it executed, in order
/// (file names of the execs that succeeded: a failed lookup along `PATH`
/// is no execution, nor is an attempt refused with ETXTBSY, which the
/// suite retries, and which a copy just written in this many-threaded
/// test process meets whenever another test forks meanwhile). Anything it starts
/// that outlives it is followed too, so a call that starts a lease service
/// must not be traced.
pub fn run_traced(
    netns: &Path,
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    stdin: &str,
) -> (Run, Vec<String>) {
    let trace = tempfile::NamedTempFile::new().expect("a trace file");
    let trace_path = trace.path().to_str().expect("UTF-8").to_owned();
    let program_text = program.to_str().expect("UTF-8").to_owned();
    let mut full = vec![
        "-f",
        "-qq",
        "-e",
        "trace=execve",
        "-e",
        "status=successful",
        "-o",
        trace_path.as_str(),
        program_text.as_str(),
    ];
    full.extend_from_slice(args);
    let run = run_in(netns, Path::new("strace"), &full, env, stdin);
    let execs = fs::read_to_string(trace.path())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("execve("))
        .filter_map(|l| l.split('"').nth(1))
        .filter_map(|p| p.rsplit('/').next())
        .map(str::to_owned)
        .collect();
    (run, execs)
}

/// Starts `program` inside the namespace at `netns` without waiting for it;
/// its stdout and stderr are piped.
pub fn spawn_in(netns: &Path, program: &Path, args: &[&str], env: &[(&str, &str)], stdin: &str) -> Child {
    let mut child = spawn_in_open(netns, program, args, env);
    if let Some(mut pipe) = child.stdin.take() {
        use std::io::Write;
        pipe.write_all(stdin.as_bytes()).ok();
    }
    child
}

/// [`spawn_in`] with its stdin left open: the child reads it until the
/// caller closes it (a helper told to stop by its end of file, or by the
/// caller's death).
pub fn spawn_in_open(netns: &Path, program: &Path, args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()))
}

/// Runs `program args` inside `netns` as `uid`/`gid` (nsenter's
/// --setuid/--setgid), for owner-matched firewall rules.
pub fn run_as(netns: &Path, uid: u32, program: &Path, args: &[&str]) -> Run {
    let what = format!("(uid {uid}) {} {}", program.display(), args.join(" "));
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg(format!("--setuid={uid}"))
        .arg(format!("--setgid={uid}"))
        .arg("--")
        .arg(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    Run::from_output(what, output)
}

/// Waits for a started command and collects what it printed.
pub fn finish(what: &str, child: Child) -> Run {
    let output = child.wait_with_output().unwrap_or_else(|e| panic!("{what}: {e}"));
    Run::from_output(what.to_owned(), output)
}

/// Waits at most `limit` for a started command: what it printed, or Err
/// with what it printed once killed when it had not returned by then (a
/// blocked plugin must fail a test, not hang the suite).
pub fn finish_within(what: &str, mut child: Child, limit: std::time::Duration) -> Result<Run, Run> {
    let started = std::time::Instant::now();
    while child
        .try_wait()
        .unwrap_or_else(|e| panic!("{what}: {e}"))
        .is_none()
    {
        if started.elapsed() > limit {
            let _ = child.kill();
            return Err(finish(what, child));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ok(finish(what, child))
}

/// `mkfifo <path>`: a FIFO where a test wants one in a plugin's way.
pub fn mkfifo(path: &Path) {
    run("mkfifo", &[path.to_str().expect("UTF-8 path")]).success();
}

/// Every path under `dir`, `dir` itself not included.
pub fn files_under(dir: &Path) -> Vec<String> {
    run("find", &[dir.to_str().expect("UTF-8 path"), "-mindepth", "1"])
        .success()
        .stdout
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The `.conf` and `.conflist` files of `dir`, in the order a runtime
/// reads them (by name).
pub fn conf_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("a conf directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "conf" || e == "conflist"))
        .collect();
    files.sort();
    files
}

/// The suite's plugin binaries.
pub const PLUGINS: [&str; 6] = [
    "loopback",
    "bridge",
    "host-local",
    "istio-redirect",
    "portmap",
    "firewall",
];

/// Waits until `ready()` holds, failing the test after `limit`.
pub fn wait_for(what: &str, limit: std::time::Duration, mut ready: impl FnMut() -> bool) {
    let started = std::time::Instant::now();
    while !ready() {
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// host-local built with the `fault-injection` feature (never a release
/// build): `CNI_SUITE_FAULT_BIN`, else where `make fault-bin` puts it.
pub fn fault_bin() -> PathBuf {
    let path = std::env::var_os("CNI_SUITE_FAULT_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/fault/debug/host-local"),
        PathBuf::from,
    );
    assert!(
        path.is_file(),
        "no fault-injection host-local at {}: run `make fault-bin`, or set CNI_SUITE_FAULT_BIN",
        path.display()
    );
    path
}

/// Go's cnitool (`make cnitool`): `CNI_SUITE_CNITOOL`, else
/// `target/tools/cnitool`.
pub fn cnitool_bin() -> PathBuf {
    let path = std::env::var_os("CNI_SUITE_CNITOOL").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tools/cnitool"),
        PathBuf::from,
    );
    assert!(
        path.is_file(),
        "no cnitool at {}: run `make cnitool`, or set CNI_SUITE_CNITOOL",
        path.display()
    );
    path
}

/// A running `host-local serve`, stopped (SIGKILL) when dropped. What it
/// writes to stderr is kept: returned by [`LeaseService::exit_within`],
/// printed when the test fails while it runs.
#[derive(Debug)]
pub struct LeaseService {
    child: Option<Child>,
    log: Option<std::thread::JoinHandle<String>>,
    pub socket: PathBuf,
}

impl LeaseService {
    /// Starts `binary serve --socket <socket>` with `env` added and waits
    /// until it answers.
    pub fn start(binary: &Path, socket: PathBuf, env: &[(&str, &str)]) -> Self {
        LeaseService::start_with(binary, socket, &[], env)
    }

    /// [`LeaseService::start`] with more arguments after the socket's.
    pub fn start_with(binary: &Path, socket: PathBuf, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(binary)
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {} serve: {e}", binary.display()));
        let log = child.stderr.take().map(|mut pipe| {
            std::thread::spawn(move || {
                let mut text = String::new();
                std::io::Read::read_to_string(&mut pipe, &mut text).ok();
                text
            })
        });
        let service = LeaseService {
            child: Some(child),
            log,
            socket,
        };
        wait_for(
            "the lease service to listen",
            std::time::Duration::from_secs(10),
            || std::os::unix::net::UnixStream::connect(&service.socket).is_ok(),
        );
        service
    }

    /// The service's process, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `signal` to the service.
    pub fn signal(&self, signal: libc::c_int) {
        let pid = self.pid().expect("running");
        let pid = libc::pid_t::try_from(pid).expect("pid");
        // SAFETY: kill(2) on the pid of a child not yet reaped (still ours).
        let sent = unsafe { libc::kill(pid, signal) };
        assert_eq!(sent, 0, "kill: {}", std::io::Error::last_os_error());
    }

    /// Whether it has not exited yet.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| child.try_wait().expect("wait").is_none())
    }

    /// Its exit status and everything it logged, once it exited, which must
    /// be within `limit`.
    pub fn exit_within(mut self, limit: std::time::Duration) -> (std::process::ExitStatus, String) {
        let mut child = self.child.take().expect("running");
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            if started.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "still running {limit:?} after the signal; it logged:\n{}",
                    self.take_log()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        (status, self.take_log())
    }

    fn take_log(&mut self) -> String {
        self.log.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }

    /// Kills the service now, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for LeaseService {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("the lease service logged:\n{}", self.take_log());
        }
    }
}

/// Runs a command on the machine (outside any test namespace).
pub fn run(program: impl AsRef<OsStr>, args: &[&str]) -> Run {
    let program = program.as_ref();
    let what = format!("{} {}", program.to_string_lossy(), args.join(" "));
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    Run::from_output(what, output)
}

/// Removes namespaces left by harness processes that no longer run (a test
/// binary killed before its destructors ran), never those of live ones.
fn sweep_stale_namespaces() {
    let Ok(entries) = fs::read_dir(NETNS_DIR) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let owner = name
            .strip_prefix(&format!("{PREFIX}-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        if let Some(pid) = owner
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            run("ip", &["netns", "del", &name]);
        }
    }
}

/// A named network namespace (`ip netns add`), deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
    path: PathBuf,
}

impl Netns {
    pub fn new(role: &str) -> Self {
        require_root();
        SWEEP.call_once(sweep_stale_namespaces);
        let seq = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let name = format!("{PREFIX}-{}-{seq}-{role}", std::process::id());
        run("ip", &["netns", "add", &name]).success();
        let path = Path::new(NETNS_DIR).join(&name);
        Netns { name, path }
    }

    /// A name for the network namespace of process `pid` (`ip netns
    /// attach`), such as a CRI sandbox's; dropping it removes only the name.
    pub fn attach(role: &str, pid: u32) -> Self {
        require_root();
        let seq = SEQUENCE.fetch_add(1, Ordering::Relaxed);
        let name = format!("{PREFIX}-{}-{seq}-{role}", std::process::id());
        run("ip", &["netns", "attach", &name, &pid.to_string()]).success();
        let path = Path::new(NETNS_DIR).join(&name);
        Netns { name, path }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn path_str(&self) -> &str {
        self.path.to_str().expect("netns paths are UTF-8")
    }

    /// `ip -n <ns> args...`.
    pub fn ip(&self, args: &[&str]) -> Run {
        let mut full = vec!["-n", &self.name];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// The namespace's nat table, as `save` (`iptables-save`,
    /// `iptables-nft-save`, …) prints it.
    pub fn nat_rules(&self, save: &str) -> String {
        run_in(self.path(), Path::new(save), &["-t", "nat"], &[], "")
            .success()
            .stdout
    }

    /// A veth pair: `end` here, its peer `eth0` in `pod`.
    pub fn veth_to(&self, end: &str, pod: &Netns) {
        veth_between(&self.name, end, pod);
    }

    /// Whether `link` is administratively up in this namespace.
    pub fn link_is_up(&self, link: &str) -> bool {
        let shown = self.ip(&["-o", "link", "show", link]).success();
        let flags = shown
            .stdout
            .split('<')
            .nth(1)
            .and_then(|s| s.split('>').next())
            .unwrap_or("");
        flags.split(',').any(|f| f == "UP")
    }

    /// Deletes the namespace now (to test what happens once a pod is gone).
    pub fn delete(self) {}
}

/// A veth pair: `end` in the namespace called `here` (one this process
/// need not own, such as a cluster's underlay), its peer `eth0` in `pod`.
pub fn veth_between(here: &str, end: &str, pod: &Netns) {
    run(
        "ip",
        &[
            "-n",
            here,
            "link",
            "add",
            end,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            pod.name(),
        ],
    )
    .success();
}

impl Drop for Netns {
    fn drop(&mut self) {
        let deleted = Command::new("ip").args(["netns", "del", &self.name]).output();
        if !deleted.is_ok_and(|o| o.status.success()) && self.path.exists() {
            eprintln!("harness: could not delete netns {}", self.name);
        }
    }
}

/// A node: its namespace plays the host; it has its own CNI configuration
/// directory, result cache and data directories under a temporary directory.
#[derive(Debug)]
pub struct Node {
    pub netns: Netns,
    dir: TempDir,
}

impl Default for Node {
    fn default() -> Self {
        Node::new()
    }
}

/// `host-local serve` processes whose `--socket` satisfies `wanted`.
fn services(wanted: impl Fn(u32, &Path) -> bool) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = fs::read(entry.path().join("cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let serves = args.get(1).is_some_and(|a| *a == b"serve");
            let socket = args
                .windows(2)
                .find(|w| w[0] == b"--socket")
                .map(|w| Path::new(std::ffi::OsStr::from_bytes(w[1])));
            (serves && socket.is_some_and(|s| wanted(pid, s))).then_some(pid)
        })
        .collect()
}

/// The pids of `host-local serve` processes whose socket is under `dir`
/// (services a plugin started for a data directory there).
pub fn services_under(dir: &Path) -> Vec<u32> {
    services(|_, socket| socket.starts_with(dir))
}

/// The mount points at or below `dir`, deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut under: Vec<PathBuf> = mounts
        .lines()
        .filter_map(|line| line.split(' ').nth(1))
        .map(PathBuf::from)
        .filter(|point| point.starts_with(dir))
        .collect();
    under.sort_by_key(|point| std::cmp::Reverse(point.components().count()));
    under
}

/// Services a plugin started on this node end with it: those in its
/// network namespace (plugins run there, and so do the services they
/// start, whatever mount namespace they see their data directory in).
/// So does what was mounted under its directory.
impl Drop for Node {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        let Ok(node) = fs::metadata(&self.netns.path) else {
            return;
        };
        let in_node = |pid: u32, _: &Path| {
            fs::metadata(format!("/proc/{pid}/ns/net"))
                .is_ok_and(|ns| ns.ino() == node.ino() && ns.dev() == node.dev())
        };
        for pid in services(in_node) {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        // A filesystem a test mounted under the node's directory (a small
        // tmpfs to fill) may outlive the node when declared before it: its
        // mount would keep the directory from being removed.
        for mount_point in mounts_under(self.dir.path()) {
            let _ = Command::new("umount").arg("-l").arg(&mount_point).status();
        }
    }
}

impl Node {
    pub fn new() -> Self {
        let netns = Netns::new("node");
        let dir = tempfile::Builder::new()
            .prefix("cnit-node-")
            .tempdir()
            .expect("tempdir");
        for sub in ["net.d", "cache"] {
            fs::create_dir(dir.path().join(sub)).expect("mkdir");
        }
        Node { netns, dir }
    }

    /// A new pod namespace.
    pub fn pod(&self, role: &str) -> Netns {
        Netns::new(role)
    }

    pub fn conf_dir(&self) -> PathBuf {
        self.dir.path().join("net.d")
    }

    pub fn cache_dir(&self) -> PathBuf {
        self.dir.path().join("cache")
    }

    /// A scratch path under the node's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn write_conf(&self, file_name: &str, doc: &Value) {
        fs::write(self.conf_dir().join(file_name), doc.to_string()).expect("write conf");
    }

    /// Runs `cnictl args...` inside the node namespace with this node's
    /// configuration directory, result cache and the suite's binaries.
    pub fn cnictl(&self, args: &[&str]) -> Run {
        self.cnictl_env(args, &[])
    }

    pub fn cnictl_env(&self, args: &[&str], env: &[(&str, &str)]) -> Run {
        let cache = self.cache_dir();
        let mut full = vec!["--cache-dir", cache.to_str().expect("UTF-8 path")];
        full.extend_from_slice(args);
        let conf = self.conf_dir();
        let bins = bin_dir();
        let mut all_env = vec![
            ("NETCONFPATH", conf.to_str().expect("UTF-8 path")),
            ("CNI_PATH", bins.to_str().expect("UTF-8 path")),
        ];
        all_env.extend_from_slice(env);
        run_in(self.netns.path(), &bin("cnictl"), &full, &all_env, "")
    }

    /// A directory to stand in for /var/lib in a private mount namespace:
    /// its `cni` is this node's cache (libcni's fixed /var/lib/cni).
    pub fn var_lib(&self) -> PathBuf {
        let var_lib = self.path("var-lib");
        if !var_lib.exists() {
            fs::create_dir(&var_lib).expect("mkdir");
            std::os::unix::fs::symlink(self.cache_dir(), var_lib.join("cni")).expect("symlink");
        }
        var_lib
    }

    /// Runs Go's cnitool inside the node namespace with this node's
    /// configuration directory and the suite's binaries (`env` may override
    /// them). cnitool always keeps its results in /var/lib/cni, so it sees
    /// [`Node::var_lib`] there: it shares the cache with [`Node::cnictl`]
    /// and the machine's /var/lib is never touched.
    pub fn cnitool(&self, args: &[&str], env: &[(&str, &str)]) -> Run {
        let conf = self.conf_dir();
        let bins = bin_dir();
        let mut all_env = vec![
            ("NETCONFPATH", conf.to_str().expect("UTF-8 path")),
            ("CNI_PATH", bins.to_str().expect("UTF-8 path")),
        ];
        all_env.extend_from_slice(env);
        let var_lib = self.var_lib();
        run_with_binds(
            &[(&var_lib, Path::new("/var/lib"))],
            self.netns.path(),
            &cnitool_bin(),
            args,
            &all_env,
        )
    }

    /// The veths in the node namespace, one `ip -o link` line each.
    pub fn veths(&self) -> Vec<String> {
        let shown = self
            .netns
            .ip(&["-o", "link", "show", "type", "veth"])
            .success()
            .stdout;
        shown.lines().map(str::to_owned).collect()
    }

    /// Per-container CNI chains (`CNI-<hash>`, `CNI-DN-<hash>`) in the node's
    /// nat tables, both families. Shared chains stay by design: portmap's
    /// `CNI-HOSTPORT-*` and the bridge's per-subnet `CNI-NET-*`.
    pub fn container_nat_chains(&self) -> Vec<String> {
        self.nat_chains()
            .into_iter()
            .filter(|c| !c.starts_with("CNI-HOSTPORT-") && !c.starts_with("CNI-NET-"))
            .collect()
    }

    /// Every CNI chain in the node's nat tables, both families.
    pub fn nat_chains(&self) -> Vec<String> {
        let mut chains = Vec::new();
        for tool in ["iptables-save", "ip6tables-save"] {
            let saved = self.run(tool, &["-t", "nat"]).success().stdout;
            chains.extend(saved.lines().filter_map(|l| {
                let name = l.strip_prefix(':')?.split_whitespace().next()?;
                name.starts_with("CNI-").then(|| name.to_owned())
            }));
        }
        chains
    }

    /// The names of the result cache's entries.
    pub fn cache_entries(&self) -> Vec<String> {
        fs::read_dir(self.cache_dir().join("results"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// What attachments of `network` (leases under `data_dir`) left on
    /// the node: veths, per-container nat chains, leases, cache entries.
    /// Empty when a runtime's deletes cleaned up everything.
    pub fn leftovers(&self, network: &str, data_dir: &Path) -> Vec<String> {
        let mut left: Vec<String> = self.veths();
        left.extend(self.container_nat_chains());
        if data_dir.exists() {
            left.extend(
                self.lease_records(network, data_dir, "")
                    .iter()
                    .map(|lease| format!("lease {lease}")),
            );
        }
        left.extend(
            self.cache_entries()
                .into_iter()
                .map(|e| format!("cache entry {e}")),
        );
        left
    }

    /// `cnictl --json ipam ls`: the leases of `network` whose host-local
    /// `dataDir` is `data_dir`, through the lease service at `socket` (""
    /// opens the database directly).
    pub fn lease_records(&self, network: &str, data_dir: &Path, socket: &str) -> Vec<Value> {
        let data_dir = data_dir.to_str().expect("UTF-8 path");
        let listed = self
            .cnictl(&[
                "--json",
                "ipam",
                "ls",
                network,
                "--socket",
                socket,
                "--data-dir",
                data_dir,
            ])
            .success()
            .json();
        listed.as_array().cloned().unwrap_or_default()
    }

    /// `cnictl ipam ls` of `network` whose host-local `dataDir` is
    /// `data_dir`, opening the database directly.
    pub fn leases_in(&self, network: &str, data_dir: &Path) -> String {
        let data_dir = data_dir.to_str().expect("UTF-8 path");
        self.cnictl(&["ipam", "ls", network, "--socket", "", "--data-dir", data_dir])
            .success()
            .stdout
    }

    /// [`Node::leases_in`] the conventional `dataDir`, the node's `ipam`.
    pub fn leases(&self, network: &str) -> String {
        self.leases_in(network, &self.path("ipam"))
    }

    /// Executes a plugin binary directly, as libcni does, inside the node
    /// namespace: `env` are the CNI_* variables, `stdin` the configuration.
    pub fn exec_plugin(&self, plugin: &str, env: &BTreeMap<&str, &str>, stdin: &str) -> Run {
        let vars: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, *v)).collect();
        run_in(self.netns.path(), &bin(plugin), &[], &vars, stdin)
    }

    /// Runs a command inside the node namespace.
    pub fn run(&self, program: &str, args: &[&str]) -> Run {
        run_in(self.netns.path(), Path::new(program), args, &[], "")
    }

    /// The cached result file of an attachment, if any.
    pub fn cache_entry(&self, network: &str, container_id: &str, ifname: &str) -> Option<Value> {
        let path = self
            .cache_dir()
            .join("results")
            .join(format!("{network}-{container_id}-{ifname}"));
        let bytes = fs::read(path).ok()?;
        serde_json::from_slice(&bytes).ok()
    }
}

/// `program args` inside the namespace at `netns`, in a private mount
/// namespace where each `(source, target)` directory is bind-mounted, for
/// clients with fixed paths (libcni's /var/lib/cni, go-cni's /etc/cni/net.d
/// and /opt/cni/bin). Nothing outside that process and its children sees
/// the mounts.
pub fn command_with_binds(binds: &[(&Path, &Path)], netns: &Path, program: &Path, args: &[&str]) -> Command {
    let script =
        r#"while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 125; shift 2; done; shift; exec "$@""#;
    let mut command = Command::new("unshare");
    command.args([
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        script,
        "sh",
    ]);
    for (source, target) in binds {
        command.arg(source).arg(target);
    }
    command
        .arg("--")
        .arg("nsenter")
        .arg(format!("--net={}", netns.display()))
        .arg("--")
        .arg(program)
        .args(args);
    command
}

/// Runs [`command_with_binds`] with `env` added and collects its output.
pub fn run_with_binds(
    binds: &[(&Path, &Path)],
    netns: &Path,
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Run {
    let what = format!("{} {}", program.display(), args.join(" "));
    let output = command_with_binds(binds, netns, program, args)
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    Run::from_output(what, output)
}

/// cnitool's container ID for a netns path (see `cnictl`), computed with
/// coreutils so the test does not share the code under test.
pub fn cnitool_container_id(netns: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg("printf %s \"$1\" | sha512sum | cut -c1-20")
        .arg("sh")
        .arg(netns)
        .output()
        .expect("sha512sum runs");
    format!("cnitool-{}", String::from_utf8_lossy(&out.stdout).trim())
}
