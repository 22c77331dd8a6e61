//! The node-local lease service (`host-local serve`): one long-lived process
//! that keeps every network's database open, so an ADD does not pay sled's
//! start-up (about 10 ms) in each plugin process. It takes the same per-
//! network lock for every operation as a direct invocation does, so both
//! paths can be used side by side, and flushes before it answers an ADD (a
//! release right after its answer: see [`crate::store`]).
//!
//! Protocol: the client connects to a Unix socket (mode 0600, root only),
//! writes one JSON request and shuts its side down; the service answers with
//! one JSON response and closes. A plugin request carries the invocation's
//! CNI_* variables and stdin; the service runs the same verb code a direct
//! invocation would and returns what it would have printed.
//!
//! Besides the socket it was started on, the service listens in every data
//! directory whose databases it opens, at `<dataDir>/.sled/.service.sock`,
//! holding `<dataDir>/.sled/.service.lock` for as long as it runs: whoever
//! finds a database held there is served through that socket (see
//! [`crate::client`]), and one data directory has one service however its
//! path is spelled.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

use cni::skel::Reply;
use cni::{Code, Error as CniError, Version};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::admin::{self, AdminOp};
use crate::client::{self, Route};
use crate::socket;
use crate::store::{ClaimHook, Stores, sled_dir};

/// How long the service waits for a client to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_REQUEST: u64 = 16 << 20;
/// How often the service checks that its sockets are still where clients
/// look for them.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// The CNI variables a plugin request forwards.
pub const FORWARDED_ENV: [&str; 7] = [
    "CNI_COMMAND",
    "CNI_CONTAINERID",
    "CNI_NETNS",
    "CNI_IFNAME",
    "CNI_ARGS",
    "CNI_PATH",
    "CNI_NETNS_OVERRIDE",
];

/// `<dataDir>/.sled/.service.sock`: where the service in charge of a data
/// directory listens.
pub fn data_dir_socket(data_dir: &Path) -> PathBuf {
    sled_dir(data_dir).join(".service.sock")
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum RequestKind {
    Plugin {
        env: BTreeMap<String, String>,
        stdin: String,
    },
    Admin {
        #[serde(rename = "dataDir")]
        data_dir: PathBuf,
        network: String,
        #[serde(flatten)]
        op: AdminOp,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    #[serde(flatten)]
    pub kind: RequestKind,
    /// Passed on by a process that found the data directory in another
    /// service's charge; never passed on again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forwarded: bool,
}

impl Request {
    pub fn plugin(env: BTreeMap<String, String>, stdin: &[u8]) -> Self {
        Request {
            kind: RequestKind::Plugin {
                env,
                stdin: String::from_utf8_lossy(stdin).into_owned(),
            },
            forwarded: false,
        }
    }

    pub fn admin(data_dir: PathBuf, network: String, op: AdminOp) -> Self {
        Request {
            kind: RequestKind::Admin {
                data_dir,
                network,
                op,
            },
            forwarded: false,
        }
    }

    /// The data directory the request is about, as its sender spelled it.
    pub fn data_dir(&self) -> Option<PathBuf> {
        match &self.kind {
            RequestKind::Plugin { stdin, .. } => {
                crate::config::LeaseSettings::read(stdin.as_bytes()).map(|s| s.data_dir)
            }
            RequestKind::Admin { data_dir, .. } => Some(data_dir.clone()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<CniError>,
    #[serde(default, rename = "cniVersion", skip_serializing_if = "Option::is_none")]
    pub version: Option<Version>,
}

impl Response {
    pub fn from_reply(reply: Reply) -> Self {
        match reply {
            Reply::Document(doc) => Response {
                document: Some(doc),
                error: None,
                version: None,
            },
            Reply::Done | Reply::About(_) => Response {
                document: None,
                error: None,
                version: None,
            },
            Reply::Failed(e, v) => Response {
                document: None,
                error: Some(e),
                version: Some(v),
            },
        }
    }

    pub fn into_reply(self) -> Reply {
        match (self.error, self.document) {
            (Some(e), _) => Reply::Failed(e, self.version.unwrap_or(Version::LATEST)),
            (None, Some(doc)) => Reply::Document(doc),
            (None, None) => Reply::Done,
        }
    }

    pub fn admin(outcome: Result<Value, crate::Error>) -> Self {
        match outcome {
            Ok(doc) => Response {
                document: Some(doc),
                error: None,
                version: None,
            },
            Err(e) => Response {
                document: None,
                error: Some(e.into()),
                version: None,
            },
        }
    }

    /// Code 11: the leases were held elsewhere; asking again may succeed.
    pub fn is_busy(&self) -> bool {
        self.error
            .as_ref()
            .is_some_and(|e| e.has_code(Code::TryAgainLater))
    }
}

/// A lock file of the service (created 0600, never through a symlink).
fn open_lock_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// Holds `lock` without waiting; None when another process holds it.
fn try_lock(lock: &Path) -> io::Result<Option<File>> {
    let file = open_lock_file(lock)?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

/// A socket the service bound itself, at its path with symlinks resolved,
/// and the lock that makes this service the one there.
#[derive(Debug)]
struct OwnSocket {
    path: PathBuf,
    inode: Option<(u64, u64)>,
    lock: Arc<File>,
    lock_path: PathBuf,
}

impl OwnSocket {
    /// Whether the lock file at its place is still the one this service
    /// holds (an operator may have removed it, and another service taken
    /// the place).
    fn still_ours(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        let held = self.lock.metadata().map(|m| (m.dev(), m.ino())).ok();
        held.is_some() && socket::inode(&self.lock_path) == held
    }
}

/// A socket the service listens on.
#[derive(Debug)]
pub struct Listening {
    listener: Arc<UnixListener>,
    own: Option<OwnSocket>,
}

/// What a look at one of the service's sockets found.
enum Watch {
    Fine,
    /// Its file was removed or replaced, and it was bound again.
    Rebound(Listening),
    /// Its place has another service's lock now.
    Lost,
}

impl Listening {
    /// A socket someone else bound (see [`passed_by_service_manager`]).
    fn inherited(listener: UnixListener) -> Self {
        Listening {
            listener: Arc::new(listener),
            own: None,
        }
    }

    /// Binds `path`, whose lock `lock` (at `lock_path`) this service holds.
    fn bound(path: &Path, lock: Arc<File>, lock_path: PathBuf) -> io::Result<Self> {
        let (listener, path) = socket::bind_replacing(path)?;
        Ok(Listening {
            listener: Arc::new(listener),
            own: Some(OwnSocket {
                inode: socket::inode(&path),
                path,
                lock,
                lock_path,
            }),
        })
    }

    fn watch(&self) -> Watch {
        let Some(own) = &self.own else {
            return Watch::Fine;
        };
        if socket::inode(&own.path) == own.inode {
            return Watch::Fine;
        }
        if !own.still_ours() {
            log::error!(
                "{} was taken: its lock file {} is not the one this service holds; no longer listening there",
                own.path.display(),
                own.lock_path.display()
            );
            return Watch::Lost;
        }
        log::warn!(
            "{} is gone or replaced; listening there again",
            own.path.display()
        );
        match Listening::bound(&own.path, Arc::clone(&own.lock), own.lock_path.clone()) {
            Ok(fresh) => Watch::Rebound(fresh),
            Err(e) => {
                log::warn!("cannot listen on {} again: {e}", own.path.display());
                Watch::Fine
            }
        }
    }

    /// Removes the socket's file if it is still the one bound here.
    fn remove_own_file(&self) {
        if let Some(own) = &self.own
            && socket::inode(&own.path) == own.inode
        {
            let _ = std::fs::remove_file(&own.path);
        }
    }

    /// Ends the accept loop on this socket.
    fn close(&self) {
        let _ = nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }
}

fn refused_dir(dir: &Path, why: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("refusing to listen in {}: {why}", dir.display()),
    )
}

/// The socket's directory with symlinks resolved, if trusted (see
/// [`crate::trust::trusted_dir`]).
fn trusted_socket_dir(dir: &Path) -> io::Result<PathBuf> {
    crate::trust::trusted_dir(dir).map_err(|refusal| match refusal {
        crate::trust::Refusal::Absent(e) => e,
        crate::trust::Refusal::Untrusted(why) => refused_dir(dir, why),
    })
}

/// Takes the place of the socket at `path`, its directory trusted and
/// symlinks resolved: holds `<path>.lock` for as long as the service runs
/// and binds the socket. None when another service has the place.
fn take_socket(path: &Path) -> io::Result<Option<Listening>> {
    let (dir, name) = socket::split(path)?;
    let socket = trusted_socket_dir(dir)?.join(name);
    let mut lock_path = socket.clone().into_os_string();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let Some(lock) = try_lock(&lock_path)? else {
        return Ok(None);
    };
    // A service of a version without the lock file answers there.
    if socket::connect(&socket).is_ok() {
        return Ok(None);
    }
    Listening::bound(&socket, Arc::new(lock), lock_path).map(Some)
}

/// Binds the service socket at `path`: its directory 0700 and trusted, the
/// socket 0600, and `<path>.lock` held for as long as the service runs, so
/// a second service fails here instead of taking the path from the first.
pub fn bind(path: &Path) -> io::Result<Listening> {
    let (dir, _) = socket::split(path)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    take_socket(path)?.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("a lease service already listens on {}", path.display()),
        )
    })
}

/// How long a service that a plugin started serves without a request
/// before it exits.
pub const IDLE_EXIT: Duration = Duration::from_secs(300);
/// How long a plugin waits for a service it started to listen.
const START_PATIENCE: Duration = Duration::from_secs(3);
/// A started service's log is emptied when it starts beyond this size.
const LOG_LIMIT: u64 = 1 << 20;

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
    let log = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&log_path)?;
    if log.metadata()?.len() > LOG_LIMIT {
        log.set_len(0)?;
    }
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

/// The socket a service manager bound and passed to this process, as
/// systemd's socket activation does (`LISTEN_PID` naming this process,
/// `LISTEN_FDS=1`, the socket at fd 3). `LISTEN_PID` and `LISTEN_FDS` are
/// then removed from the environment, so nothing this process starts takes
/// the socket for its own. None when no socket was passed to this process,
/// or more than one; an error when the one passed is not a listening Unix
/// stream socket. It changes the environment: call it before the process
/// has threads.
pub fn passed_by_service_manager() -> io::Result<Option<Listening>> {
    // listenfd also takes descriptors without a LISTEN_PID (systemfd's
    // convention); a LISTEN_FDS leaked from some other environment must
    // not make the service take whatever its fd 3 is.
    let names_a_process = std::env::var_os("LISTEN_PID").is_some_and(|pid| !pid.is_empty());
    if !names_a_process {
        return Ok(None);
    }
    let mut passed = listenfd::ListenFd::from_env();
    if passed.len() != 1 {
        return Ok(None);
    }
    let Some(listener) = passed.take_unix_listener(0)? else {
        return Ok(None);
    };
    // listenfd checks the family and type only; a socket nobody called
    // listen() on would fail every accept and leave the service deaf.
    if !nix::sys::socket::getsockopt(&listener, nix::sys::socket::sockopt::AcceptConn)? {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the passed socket is not listening",
        ));
    }
    Ok(Some(Listening::inherited(listener)))
}

/// What the service runs for a plugin request: the plugin's own dispatch.
pub type PluginHandler = dyn Fn(&BTreeMap<String, String>, Vec<u8>) -> Reply + Send + Sync;

/// The lease service under construction: its data directory sockets are
/// bound by the store (through [`Service::claim_hook`]) while it serves.
#[derive(Debug)]
pub struct Service {
    added: mpsc::Sender<Listening>,
    incoming: mpsc::Receiver<Listening>,
    idle_exit: Option<Duration>,
}

impl Default for Service {
    fn default() -> Self {
        Service::new()
    }
}

impl Service {
    pub fn new() -> Self {
        let (added, incoming) = mpsc::channel();
        Service {
            added,
            incoming,
            idle_exit: None,
        }
    }

    /// Stops listening and returns from [`Service::run`] once no request
    /// has come for `after` (a service a plugin started; one an operator
    /// runs serves for good).
    pub fn exit_when_idle(mut self, after: Duration) -> Self {
        self.idle_exit = Some(after);
        self
    }

    /// For [`Stores::resident`]: takes charge of a data directory before
    /// its first database opens, or answers busy (code 11) naming the
    /// service that has it.
    pub fn claim_hook(&self) -> ClaimHook {
        let added = self.added.clone();
        Box::new(move |sled_dir: &Path| {
            let data_dir = sled_dir.parent().unwrap_or(sled_dir).to_path_buf();
            let socket = data_dir_socket(&data_dir);
            // Started on this very socket (a service a plugin started).
            if socket::listened_on_by_this_process(&socket) {
                return Ok(());
            }
            let unusable = |e: io::Error| {
                crate::Error::Store(format!(
                    "cannot serve the data directory {}: {e}",
                    data_dir.display()
                ))
            };
            let Some(listening) = take_socket(&socket).map_err(unusable)? else {
                return Err(crate::Error::Busy(format!(
                    "the data directory {} is served by the lease service at {}",
                    data_dir.display(),
                    socket.display()
                )));
            };
            log::info!("serving the data directory's socket {}", socket.display());
            added
                .send(listening)
                .map_err(|_| crate::Error::Store("the lease service has stopped".into()))
        })
    }

    /// Serves on `first` and every socket claimed later, for good. Each
    /// connection is answered on a thread of its own, as many at once as
    /// clients come; a thread that has answered waits for the next
    /// connection instead of exiting, because a new thread starts with an
    /// empty heap and first takes over what exited ones left, which with a
    /// large network's pages cached cost more than the call.
    pub fn run(self, first: Listening, stores: Arc<Stores>, plugin: Arc<PluginHandler>) -> io::Result<()> {
        let workers = Arc::new(Workers::new(stores, plugin));
        let activity = Arc::clone(&workers.activity);
        let accepting = |listening: &Listening| {
            let (listener, workers) = (Arc::clone(&listening.listener), Arc::clone(&workers));
            std::thread::Builder::new()
                .name("accept".into())
                .spawn(move || accept(&listener, &workers))
                .map(drop)
        };
        accepting(&first)?;
        let mut watched = vec![first];
        loop {
            match self.incoming.recv_timeout(WATCH_INTERVAL) {
                Ok(listening) => {
                    accepting(&listening)?;
                    watched.push(listening);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let mut lost = Vec::new();
                    for (index, slot) in watched.iter_mut().enumerate() {
                        match slot.watch() {
                            Watch::Fine => {}
                            Watch::Rebound(fresh) => {
                                accepting(&fresh)?;
                                std::mem::replace(slot, fresh).close();
                            }
                            Watch::Lost => lost.push(index),
                        }
                    }
                    for index in lost.into_iter().rev() {
                        watched.remove(index).close();
                    }
                    if let Some(limit) = self.idle_exit
                        && activity.idle_for().is_some_and(|idle| idle >= limit)
                    {
                        log::info!("no request for {limit:?}: exiting");
                        for listening in &watched {
                            listening.close();
                            listening.remove_own_file();
                        }
                        // Connections accepted just before are answered.
                        let started = Instant::now();
                        while activity.idle_for().is_none() && started.elapsed() < client::PATIENCE {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                        return Ok(());
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {}
            }
        }
    }
}

/// Connections being answered, and when the last one was.
#[derive(Debug)]
struct Activity {
    answering: AtomicUsize,
    since: Instant,
    /// Milliseconds from `since` to the end of the last answer.
    last: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            answering: AtomicUsize::new(0),
            since: Instant::now(),
            last: AtomicU64::new(0),
        }
    }

    fn begin(&self) {
        self.answering.fetch_add(1, Ordering::AcqRel);
    }

    fn end(&self) {
        let now = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(now, Ordering::Release);
        self.answering.fetch_sub(1, Ordering::AcqRel);
    }

    /// How long nothing has been answered; None while something is.
    fn idle_for(&self) -> Option<Duration> {
        if self.answering.load(Ordering::Acquire) > 0 {
            return None;
        }
        let last = Duration::from_millis(self.last.load(Ordering::Acquire));
        Some(self.since.elapsed().saturating_sub(last))
    }
}

fn accept(listener: &UnixListener, workers: &Workers) {
    for connection in listener.incoming() {
        match connection {
            Ok(stream) => {
                workers.activity.begin();
                workers.dispatch(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::debug!("stopped accepting: {e}");
                return;
            }
        }
    }
}

/// How many answering threads may wait for work; a burst's others end.
const MAX_IDLE_WORKERS: usize = 16;

/// Threads that answer connections and then wait for the next one.
struct Workers {
    stores: Arc<Stores>,
    plugin: Arc<PluginHandler>,
    queue: mpsc::Sender<UnixStream>,
    waiting: Arc<Mutex<mpsc::Receiver<UnixStream>>>,
    /// Threads waiting for a connection that nobody has been handed yet.
    /// Only `dispatch` takes from it, so a connection sent while it is
    /// above zero never waits behind a call in progress.
    idle: Arc<AtomicUsize>,
    activity: Arc<Activity>,
}

impl Workers {
    fn new(stores: Arc<Stores>, plugin: Arc<PluginHandler>) -> Self {
        let (queue, waiting) = mpsc::channel();
        Workers {
            stores,
            plugin,
            queue,
            waiting: Arc::new(Mutex::new(waiting)),
            idle: Arc::new(AtomicUsize::new(0)),
            activity: Arc::new(Activity::new()),
        }
    }

    fn dispatch(&self, mut stream: UnixStream) {
        let claimed = self
            .idle
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if claimed {
            match self.queue.send(stream) {
                Ok(()) => return,
                Err(mpsc::SendError(unsent)) => stream = unsent,
            }
        }
        let (stores, plugin) = (Arc::clone(&self.stores), Arc::clone(&self.plugin));
        let (waiting, idle) = (Arc::clone(&self.waiting), Arc::clone(&self.idle));
        let activity = Arc::clone(&self.activity);
        std::thread::spawn(move || {
            let mut next = Some(stream);
            while let Some(mut stream) = next.take() {
                if let Err(e) = answer(&mut stream, &stores, plugin.as_ref()) {
                    log::warn!("lease service: {e}");
                }
                if stores.owes_durability() {
                    // The client has its answer and goes on while the
                    // release is flushed (see `ipam::store`).
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                    cni::fault::pause("host-local:release-answered");
                    stores.make_releases_durable();
                }
                activity.end();
                // Counted idle before the client sees the connection close,
                // so its next call finds this thread rather than a new one;
                // past `MAX_IDLE_WORKERS` (after a burst) the thread ends.
                let stays = idle
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        (n < MAX_IDLE_WORKERS).then_some(n + 1)
                    })
                    .is_ok();
                drop(stream);
                if !stays {
                    break;
                }
                next = waiting.lock().unwrap_or_else(PoisonError::into_inner).recv().ok();
            }
        });
    }
}

/// Runs a request against this service's own databases.
fn run_here(request: &Request, stores: &Stores, plugin: &PluginHandler) -> Response {
    match &request.kind {
        RequestKind::Plugin { env, stdin } => Response::from_reply(plugin(env, stdin.clone().into_bytes())),
        RequestKind::Admin {
            data_dir,
            network,
            op,
        } => Response::admin(admin::run(stores, data_dir, network, op)),
    }
}

fn answer(stream: &mut UnixStream, stores: &Stores, plugin: &PluginHandler) -> io::Result<()> {
    // Only root, or the service's own user, may talk to it; the socket's
    // mode says so too, this holds even if the mode is changed.
    socket::peer_trusted(stream)
        .map_err(|refusal| io::Error::new(io::ErrorKind::PermissionDenied, refusal.to_string()))?;
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    let mut body = Vec::new();
    stream.take(MAX_REQUEST).read_to_end(&mut body)?;
    if body.is_empty() {
        // A connection that says nothing is a liveness probe.
        return Ok(());
    }
    let response = match serde_json::from_slice::<Request>(&body) {
        Ok(request) if request.data_dir().is_some_and(|d| d.is_relative()) => {
            Response::admin(Err(crate::Error::Config(
                "a relative dataDir names the caller's working directory, which the lease service does not share"
                    .into(),
            )))
        }
        Ok(request) => client::serve(&Route::at_service(&request), &request, &|request: &Request| {
            run_here(request, stores, plugin)
        }),
        Err(e) => Response::admin(Err(crate::Error::Config(format!("unreadable request: {e}")))),
    };
    let bytes = serde_json::to_vec(&response).map_err(io::Error::other)?;
    stream.write_all(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{CallError, forward};

    #[test]
    fn replies_survive_the_wire() {
        let cases = [
            Reply::Document(serde_json::json!({"cniVersion":"1.0.0"})),
            Reply::Done,
            Reply::Failed(CniError::try_again_later("busy"), Version::V0_4_0),
        ];
        for reply in cases {
            let wire = serde_json::to_vec(&Response::from_reply(reply.clone())).expect("encode");
            let back: Response = serde_json::from_slice(&wire).expect("decode");
            assert_eq!(back.into_reply(), reply);
        }
    }

    #[test]
    fn requests_survive_the_wire() {
        let req = Request::admin("/d".into(), "n".into(), AdminOp::List);
        let wire = serde_json::to_string(&req).expect("encode");
        assert!(!wire.contains("forwarded"), "{wire}");
        assert_eq!(serde_json::from_str::<Request>(&wire).expect("decode"), req);
        let plugin = Request {
            forwarded: true,
            ..Request::plugin(BTreeMap::from([("CNI_COMMAND".into(), "ADD".into())]), b"{}")
        };
        let wire = serde_json::to_string(&plugin).expect("encode");
        assert_eq!(serde_json::from_str::<Request>(&wire).expect("decode"), plugin);
        // What versions before `forwarded` sent.
        let old = r#"{"kind":"admin","dataDir":"/d","network":"n","op":"list"}"#;
        assert_eq!(serde_json::from_str::<Request>(old).expect("decode"), req);
    }

    /// A service whose plugin answers with the id of the thread it ran on,
    /// once `together` calls have reached it.
    fn thread_reporting_service(dir: &Path, together: usize) -> PathBuf {
        let socket = dir.join("svc.sock");
        serve_threads_at(&socket, together);
        socket
    }

    fn serve_threads_at(socket: &Path, together: usize) {
        let listening = bind(socket).expect("bind");
        let all_in = std::sync::Barrier::new(together);
        let plugin: Arc<PluginHandler> = Arc::new(move |_env: &BTreeMap<String, String>, _stdin: Vec<u8>| {
            all_in.wait();
            Reply::Document(serde_json::json!({"thread": format!("{:?}", std::thread::current().id())}))
        });
        std::thread::spawn(move || Service::new().run(listening, Arc::new(Stores::resident(None)), plugin));
    }

    fn thread_of(socket: &Path) -> String {
        let request = Request::plugin(BTreeMap::new(), b"");
        let document = forward(socket, &request)
            .expect("answer")
            .document
            .expect("document");
        document["thread"].as_str().expect("thread").to_owned()
    }

    #[test]
    fn threads_are_reused_and_a_silent_client_holds_up_nobody() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = thread_reporting_service(dir.path(), 1);
        // Connected, never finishing its request: one thread waits on it.
        let _silent = UnixStream::connect(&socket).expect("connect");
        let sequential: std::collections::BTreeSet<String> = (0..20).map(|_| thread_of(&socket)).collect();
        assert_eq!(
            sequential.len(),
            1,
            "one thread answers calls that come one by one: {sequential:?}"
        );
    }

    fn burst(socket: &Path, calls: usize) -> std::collections::BTreeSet<String> {
        std::thread::scope(|scope| {
            let calls: Vec<_> = (0..calls).map(|_| scope.spawn(|| thread_of(socket))).collect();
            calls.into_iter().map(|c| c.join().expect("call")).collect()
        })
    }

    #[test]
    fn a_burst_is_answered_at_once_and_leaves_sixteen_threads_waiting() {
        const BURST: usize = 40;
        let dir = tempfile::tempdir().expect("tempdir");
        // Every call waits until all of the burst have reached the plugin,
        // so the burst is only answered if each gets a thread at once.
        let socket = thread_reporting_service(dir.path(), BURST);
        let first = burst(&socket, BURST);
        assert_eq!(first.len(), BURST);
        let second = burst(&socket, BURST);
        assert_eq!(second.len(), BURST);
        assert_eq!(first.intersection(&second).count(), MAX_IDLE_WORKERS);
    }

    #[test]
    fn a_removed_socket_is_listened_on_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = thread_reporting_service(dir.path(), 1);
        thread_of(&socket);
        std::fs::remove_file(&socket).expect("rm");
        let started = std::time::Instant::now();
        while forward(&socket, &Request::plugin(BTreeMap::new(), b"")).is_err() {
            assert!(started.elapsed() < Duration::from_secs(10), "never bound again");
            std::thread::sleep(Duration::from_millis(20));
        }
        thread_of(&socket);
    }

    /// Bound where the path led when the service started, and bound again
    /// there only while the lock file there is the one it holds: a symlink
    /// re-pointed later, or another service's lock, never makes it take a
    /// place that is not its own.
    #[test]
    fn a_socket_is_bound_again_only_where_it_was_and_while_its_lock_is_ours() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (first, second, link) = (
            dir.path().join("first"),
            dir.path().join("second"),
            dir.path().join("link"),
        );
        std::fs::create_dir(&first).expect("mkdir");
        std::fs::create_dir(&second).expect("mkdir");
        std::os::unix::fs::symlink(&first, &link).expect("symlink");
        serve_threads_at(&link.join("svc.sock"), 1);
        std::fs::remove_file(&link).expect("rm link");
        std::os::unix::fs::symlink(&second, &link).expect("re-point");
        std::fs::remove_file(first.join("svc.sock")).expect("rm socket");
        let started = std::time::Instant::now();
        while !first.join("svc.sock").exists() {
            assert!(started.elapsed() < Duration::from_secs(10), "never bound again");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            !second.join("svc.sock").exists(),
            "bound where the link leads now"
        );

        std::fs::remove_file(first.join("svc.sock.lock")).expect("rm lock");
        std::fs::write(first.join("svc.sock.lock"), "").expect("another lock");
        std::fs::remove_file(first.join("svc.sock")).expect("rm socket");
        std::thread::sleep(WATCH_INTERVAL * 5 / 2);
        assert!(
            !first.join("svc.sock").exists(),
            "bound again under another's lock"
        );
    }

    #[test]
    fn a_second_service_on_one_socket_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = thread_reporting_service(dir.path(), 1);
        let err = bind(&socket).expect_err("the first still runs");
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        thread_of(&socket);
    }

    #[test]
    fn an_absent_service_is_unreachable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = forward(
            &dir.path().join("none.sock"),
            &Request::admin("/d".into(), "n".into(), AdminOp::List),
        )
        .expect_err("nobody listens");
        assert!(matches!(err, CallError::Unreachable { .. }));
    }
}
