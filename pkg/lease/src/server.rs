//! The node-local lease service's process side (`host-local serve` wires
//! its store in as a [`Handler`]): one long-lived process that keeps every
//! network's database open, so an ADD does not pay the store's start-up
//! in each plugin process. What a call does, and when its work is durable,
//! is the handler's; how calls arrive, on how many threads, and how the
//! service starts, watches its sockets and stops is this module's.
//!
//! Protocol: the client connects to a Unix socket (mode 0600, root only),
//! writes one JSON request and shuts its side down; the service answers with
//! one JSON response and closes (see [`crate::wire`]). A plugin call carries
//! the invocation's CNI_* variables and stdin; the handler runs the same
//! verb code a direct invocation would and returns what it would have
//! printed.
//!
//! Besides the socket it was started on, the service listens in every data
//! directory whose databases it opens, at `<dataDir>/.sled/.service.sock`,
//! holding `<dataDir>/.sled/.service.lock` for as long as it runs: whoever
//! finds a database held there is served through that socket (see
//! [`crate::client`]), and one data directory has one service however its
//! path is spelled.
//!
//! It counts what it answers, by verb and result, with the time each took
//! ([`crate::served`]), whatever its handler, and tells those counts to
//! whoever asks on any of its sockets (the node agent, for its metrics).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cni::skel::Reply;

use crate::client::{self, Route};
use crate::served::{self, Tally};
use crate::socket::{self, open_lock_file, trusted_socket_dir};
use crate::wire::{Call, Request, Response, ServiceQuery};
use ipam_config::lease_settings::data_dir_socket;

/// How long the service waits for a client to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_REQUEST: u64 = 16 << 20;
/// How often the service checks that its sockets are still where clients
/// look for them.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

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
    inode: Option<socket::FileId>,
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

    /// Where it listens, by the socket's own address.
    fn path(&self) -> Option<PathBuf> {
        let address = self.listener.local_addr().ok()?;
        address.as_pathname().map(Path::to_path_buf)
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

    /// Ends the accept loop on this socket: connections already queued on
    /// it are still accepted, new ones are refused.
    fn close(&self) {
        let _ = nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }

    /// Stops serving here for good: a socket of its own is closed and its
    /// file removed. A socket a service manager passed is left as it is
    /// (its accept loop ends when the service stops, see [`accept`]): it is
    /// the manager's too, and shutting it down would refuse every
    /// connection until the manager's socket unit is restarted, instead of
    /// starting the service again on the next one.
    fn stop(&self) {
        if self.own.is_some() {
            self.close();
            self.remove_own_file();
        }
    }
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

/// What a service runs: the calls it answers itself, and the work an
/// answer may leave owed (host-local's: a release answered once committed,
/// made durable right after the answer).
pub trait Handler: Send + Sync {
    /// Answers `call` against this service's own leases.
    fn answer(&self, call: &Call) -> Reply;

    /// Whether the call this thread just answered left work owed; then the
    /// client's connection is closed first and [`Handler::settle`] runs.
    fn owes_after_answer(&self) -> bool {
        false
    }

    /// Does the work this thread's answers left owed.
    fn settle(&self) {}

    /// Work answered and not yet done, across the service: what a stop
    /// waits for (and reports, see [`Stopped::releases_not_durable`]).
    fn owed(&self) -> usize {
        0
    }
}

/// Why a data directory was not taken in charge (see [`Claimer::claim`]).
#[derive(Debug, thiserror::Error)]
pub enum Unclaimed {
    /// Another service has it: ask that one.
    #[error("the data directory {} is served by the lease service at {}", data_dir.display(), socket.display())]
    Busy { data_dir: PathBuf, socket: PathBuf },
    /// Its socket cannot be made.
    #[error("cannot serve the data directory {}: {source}", data_dir.display())]
    Unusable { data_dir: PathBuf, source: io::Error },
    #[error("the lease service has stopped")]
    Stopped,
}

/// Takes charge of data directories for a [`Service`] while it runs.
#[derive(Debug, Clone)]
pub struct Claimer {
    events: mpsc::Sender<Event>,
    /// The file of the socket a service manager passed, once the service
    /// runs: when it is a data directory's socket (systemd's unit listens
    /// on the default data directory's), that directory is already served.
    passed: Arc<OnceLock<socket::FileId>>,
}

impl Claimer {
    /// Takes charge of `data_dir` before its first database opens: listens
    /// on its socket (see [`data_dir_socket`]) from now on, or answers
    /// [`Unclaimed::Busy`] naming the service that has it.
    pub fn claim(&self, data_dir: &Path) -> Result<(), Unclaimed> {
        let socket = data_dir_socket(data_dir);
        // Started on this very socket (a service a plugin or the agent
        // started), or passed it by systemd (whose pid the socket's
        // credentials name, not this process's).
        if socket::listened_on_by_this_process(&socket)
            || self
                .passed
                .get()
                .is_some_and(|passed| socket::inode(&socket) == Some(*passed))
        {
            return Ok(());
        }
        let listening = match take_socket(&socket) {
            Ok(Some(listening)) => listening,
            Ok(None) => {
                return Err(Unclaimed::Busy {
                    data_dir: data_dir.to_path_buf(),
                    socket,
                });
            }
            Err(source) => {
                return Err(Unclaimed::Unusable {
                    data_dir: data_dir.to_path_buf(),
                    source,
                });
            }
        };
        log::info!("serving the data directory's socket {}", socket.display());
        self.events
            .send(Event::Claimed(listening))
            .map_err(|_| Unclaimed::Stopped)
    }
}

/// What the run loop hears besides its watch interval.
#[derive(Debug)]
enum Event {
    /// A data directory's socket the store claimed (see [`Claimer`]).
    Claimed(Listening),
    /// Stop serving, for this reason (see [`Stopper`]).
    Stop(String),
}

/// The lease service under construction: its data directory sockets are
/// bound by the store (through a [`Claimer`]) while it serves.
#[derive(Debug)]
pub struct Service {
    events: mpsc::Sender<Event>,
    passed: Arc<OnceLock<socket::FileId>>,
    incoming: mpsc::Receiver<Event>,
    idle_exit: Option<Duration>,
}

impl Default for Service {
    fn default() -> Self {
        Service::new()
    }
}

/// Asks a running [`Service`] to stop (what `host-local serve` hands its
/// SIGTERM and SIGINT to). Cheap to clone, usable from any thread.
#[derive(Debug, Clone)]
pub struct Stopper(mpsc::Sender<Event>);

impl Stopper {
    /// Makes [`Service::run`] stop serving at once, for `why` (said in
    /// [`Stopped`]); asked before it runs, it stops as soon as it starts.
    /// Asking again, or once it has stopped, does nothing.
    pub fn stop(&self, why: &str) {
        let _ = self.0.send(Event::Stop(why.to_owned()));
    }
}

/// Why [`Service::run`] returned, and what was left undone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stopped {
    /// `no request for 300s` (see [`Service::exit_when_idle`]), or what
    /// was given to [`Stopper::stop`].
    pub why: String,
    /// Connections still being answered when the wait for them ended
    /// ([`client::PATIENCE`]); their clients get no answer and try the
    /// next place.
    pub unanswered: usize,
    /// Releases answered but not made durable by then ([`Handler::owed`]):
    /// lost when the process ends, their leases stay held until GC or a
    /// repeated DEL frees them.
    pub releases_not_durable: usize,
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped ({})", self.why)?;
        if self.unanswered == 0 && self.releases_not_durable == 0 {
            return write!(
                f,
                ": no longer listening, every connection it accepted answered, every release it answered on disk"
            );
        }
        write!(
            f,
            " after waiting {:?}: {} connection(s) still being answered, {} answered release(s) not on disk \
             (their leases stay held until GC or a repeated DEL)",
            client::PATIENCE,
            self.unanswered,
            self.releases_not_durable
        )
    }
}

impl Service {
    pub fn new() -> Self {
        let (events, incoming) = mpsc::channel();
        Service {
            events,
            passed: Arc::default(),
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

    /// What stops [`Service::run`] from another thread (a signal's).
    pub fn stopper(&self) -> Stopper {
        Stopper(self.events.clone())
    }

    /// What takes charge of data directories for this service (the
    /// store's hook, called before a data directory's first database
    /// opens).
    pub fn claimer(&self) -> Claimer {
        Claimer {
            events: self.events.clone(),
            passed: Arc::clone(&self.passed),
        }
    }

    /// Serves on `first` and every socket claimed later, until it has been
    /// idle for the time set with [`Service::exit_when_idle`] or a
    /// [`Stopper`] stops it. Either way it then stops the same way: no
    /// socket accepts any more and its own socket files are removed; what
    /// it accepted is answered and every release it answered made durable
    /// (for at most [`client::PATIENCE`]); and it returns why, with what
    /// was left undone. Each connection is
    /// answered on a thread of its own, as many at once as clients come;
    /// a thread that has answered waits for the next connection instead of
    /// exiting, because a new thread starts with an empty heap and first
    /// takes over what exited ones left, which with a large network's
    /// pages cached cost more than the call.
    pub fn run(self, first: Listening, handler: Arc<dyn Handler>) -> io::Result<Stopped> {
        let workers = Arc::new(Workers::new(handler));
        // Closed when the service stops: ends the accept loop of a socket
        // a service manager passed, which is not shut down (see
        // `Listening::stop`).
        let (stopped, stopping) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let stopped = Arc::new(stopped);
        let accepting = |listening: &Listening| {
            let (listener, workers) = (Arc::clone(&listening.listener), Arc::clone(&workers));
            let stopped = listening.own.is_none().then(|| Arc::clone(&stopped));
            std::thread::Builder::new()
                .name("accept".into())
                .spawn(move || accept(&listener, &workers, stopped.as_deref()))
        };
        if first.own.is_none()
            && let Some(passed) = first.path().as_deref().and_then(socket::inode)
        {
            let _ = self.passed.set(passed);
        }
        let mut acceptors = vec![accepting(&first)?];
        let mut watched = vec![first];
        loop {
            acceptors.retain(|acceptor| !acceptor.is_finished());
            match self.incoming.recv_timeout(WATCH_INTERVAL) {
                Ok(Event::Claimed(listening)) => {
                    acceptors.push(accepting(&listening)?);
                    watched.push(listening);
                }
                Ok(Event::Stop(why)) => {
                    drop(stopping);
                    return Ok(self.stop_serving(why, &watched, acceptors, &workers));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let mut lost = Vec::new();
                    for (index, slot) in watched.iter_mut().enumerate() {
                        match slot.watch() {
                            Watch::Fine => {}
                            Watch::Rebound(fresh) => {
                                acceptors.push(accepting(&fresh)?);
                                std::mem::replace(slot, fresh).close();
                            }
                            Watch::Lost => lost.push(index),
                        }
                    }
                    for index in lost.into_iter().rev() {
                        watched.remove(index).close();
                    }
                    if let Some(limit) = self.idle_exit
                        && workers.activity.idle_for().is_some_and(|idle| idle >= limit)
                    {
                        drop(stopping);
                        let why = format!("no request for {limit:?}");
                        return Ok(self.stop_serving(why, &watched, acceptors, &workers));
                    }
                }
                // Never: `self` holds a sender.
                Err(mpsc::RecvTimeoutError::Disconnected) => {}
            }
        }
    }

    /// Stops serving, whether idle or told to: no socket accepts any more
    /// and this service's own socket files are removed (a client then
    /// finds nothing listening and goes on to the next place at once);
    /// connections already accepted, or queued on its sockets, are
    /// answered and the releases they answered made durable, waiting at
    /// most [`client::PATIENCE`]. Sockets the store claimed meanwhile are
    /// closed and removed too. What was left undone is in the answer, for
    /// the caller to say.
    fn stop_serving(
        &self,
        why: String,
        watched: &[Listening],
        acceptors: Vec<JoinHandle<()>>,
        workers: &Workers,
    ) -> Stopped {
        let activity = &workers.activity;
        for listening in watched {
            listening.stop();
        }
        let started = Instant::now();
        let done = || {
            acceptors.iter().all(JoinHandle::is_finished)
                && activity.idle_for().is_some()
                && workers.handler.owed() == 0
        };
        while !done() && started.elapsed() < client::PATIENCE {
            std::thread::sleep(Duration::from_millis(10));
        }
        // Claimed by a connection answered meanwhile; never accepted on.
        while let Ok(event) = self.incoming.try_recv() {
            if let Event::Claimed(late) = event {
                late.stop();
            }
        }
        Stopped {
            why,
            unanswered: activity.answering.load(Ordering::Acquire),
            releases_not_durable: workers.handler.owed(),
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

/// Accepts connections on `listener` and hands them to `workers`, until
/// the socket is shut down (connections queued on it before are still
/// accepted) or, for a socket a service manager passed (`stopped` given),
/// until the service stops: then `stopped` reads end of file, and what is
/// queued on that socket is left to the service the manager starts next.
fn accept(listener: &UnixListener, workers: &Workers, stopped: Option<&OwnedFd>) {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    loop {
        if let Some(stopped) = stopped {
            let mut ready = [
                PollFd::new(listener.as_fd(), PollFlags::POLLIN),
                PollFd::new(stopped.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut ready, PollTimeout::NONE) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    log::warn!("stopped accepting: {e}");
                    return;
                }
            }
            if ready[1].any().unwrap_or(true) {
                log::debug!("stopped accepting on the passed socket");
                return;
            }
        }
        match listener.accept() {
            Ok((stream, _)) => {
                workers.activity.begin();
                workers.dispatch(stream);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // A passed socket may be non-blocking (`NonBlocking=yes` in a
            // systemd socket unit).
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && stopped.is_some() => continue,
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
    handler: Arc<dyn Handler>,
    queue: mpsc::Sender<UnixStream>,
    waiting: Arc<Mutex<mpsc::Receiver<UnixStream>>>,
    /// Threads waiting for a connection that nobody has been handed yet.
    /// Only `dispatch` takes from it, so a connection sent while it is
    /// above zero never waits behind a call in progress.
    idle: Arc<AtomicUsize>,
    activity: Arc<Activity>,
    /// What was answered, for whoever asks ([`ServiceQuery::Served`]).
    tally: Arc<Tally>,
}

impl Workers {
    fn new(handler: Arc<dyn Handler>) -> Self {
        let (queue, waiting) = mpsc::channel();
        Workers {
            handler,
            queue,
            waiting: Arc::new(Mutex::new(waiting)),
            idle: Arc::new(AtomicUsize::new(0)),
            activity: Arc::new(Activity::new()),
            tally: Arc::default(),
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
        let handler = Arc::clone(&self.handler);
        let (waiting, idle) = (Arc::clone(&self.waiting), Arc::clone(&self.idle));
        let activity = Arc::clone(&self.activity);
        let tally = Arc::clone(&self.tally);
        std::thread::spawn(move || {
            let mut next = Some(stream);
            while let Some(mut stream) = next.take() {
                if let Err(e) = answer(&mut stream, handler.as_ref(), &tally) {
                    log::warn!("lease service: {e}");
                }
                if handler.owes_after_answer() {
                    // The client has its answer and goes on while the
                    // owed work (a release's flush) is done.
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                    cni::fault::pause("host-local:release-answered");
                    handler.settle();
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

fn answer(stream: &mut UnixStream, handler: &dyn Handler, tally: &Tally) -> io::Result<()> {
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
    // Timed from a whole request to its answer: the service's share of
    // the client's wait, not the client's pace of sending.
    let received = Instant::now();
    let refused = |msg: String| Reply::Failed(cni::Error::invalid_config(msg), cni::Version::LATEST);
    let (reply, verb) = match serde_json::from_slice::<Request>(&body) {
        Ok(request) if request.call.data_dir().is_some_and(|d| d.is_relative()) => (
            refused(
                "a relative dataDir names the caller's working directory, which the lease service does not share"
                    .into(),
            ),
            Some(served::verb_of(&request.call)),
        ),
        Ok(request) => (
            client::serve(&Route::at_service(&request), &request, &|call: &Call| {
                handler.answer(call)
            }),
            Some(served::verb_of(&request.call)),
        ),
        // Tried only once the body is no call: calls are the common case.
        Err(e) => match serde_json::from_slice::<ServiceQuery>(&body) {
            // Not counted: a scrape is no request for leases.
            Ok(ServiceQuery::Served) => (counts(tally), None),
            Err(_) => (refused(format!("unreadable request: {e}")), Some("unreadable".to_owned())),
        },
    };
    // Counted before the client has its answer, so that whoever it tells
    // next (a test, an operator) finds the request in the counts.
    if let Some(verb) = verb {
        tally.record(verb, served::result_of(&reply), received.elapsed());
    }
    let bytes = serde_json::to_vec(&Response::from(reply)).map_err(io::Error::other)?;
    stream.write_all(&bytes)
}

/// The counts as an answer.
fn counts(tally: &Tally) -> Reply {
    match serde_json::to_value(tally.snapshot()) {
        Ok(document) => Reply::Document(document),
        Err(e) => Reply::Failed(cni::Error::internal(e.to_string()), cni::Version::LATEST),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::client::{CallError, forward};
    use crate::wire::AdminOp;

    /// A handler that answers every call with `F`.
    struct Answers<F>(F);

    impl<F: Fn() -> Reply + Send + Sync> Handler for Answers<F> {
        fn answer(&self, _: &Call) -> Reply {
            (self.0)()
        }
    }

    fn answering(answer: impl Fn() -> Reply + Send + Sync + 'static) -> Arc<dyn Handler> {
        Arc::new(Answers(answer))
    }

    fn plugin_call() -> Call {
        Call::plugin(BTreeMap::new(), b"{}")
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
        let handler = answering(move || {
            all_in.wait();
            Reply::Document(serde_json::json!({"thread": format!("{:?}", std::thread::current().id())}))
        });
        std::thread::spawn(move || Service::new().run(listening, handler));
    }

    fn thread_of(socket: &Path) -> String {
        let Reply::Document(document) = forward(socket, &Call::plugin(BTreeMap::new(), b"")).expect("answer")
        else {
            panic!("no document")
        };
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
        while forward(&socket, &Call::plugin(BTreeMap::new(), b"")).is_err() {
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

    /// Runs `service` on `listening` on a thread of its own; what it
    /// returns comes on the channel.
    fn running(
        service: Service,
        listening: Listening,
        handler: Arc<dyn Handler>,
    ) -> mpsc::Receiver<io::Result<Stopped>> {
        let (done, result) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(service.run(listening, handler));
        });
        result
    }

    fn answers_done() -> Arc<dyn Handler> {
        answering(|| Reply::Done)
    }

    const PROMPTLY: Duration = Duration::from_secs(5);

    #[test]
    fn a_stop_while_idle_removes_the_socket_and_returns_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("svc.sock");
        let service = Service::new();
        let stopper = service.stopper();
        let result = running(service, bind(&socket).expect("bind"), answers_done());
        forward(&socket, &plugin_call()).expect("served");
        let asked = Instant::now();
        stopper.stop("SIGTERM");
        let stopped = result.recv_timeout(PROMPTLY).expect("returned").expect("run");
        // The run loop wakes on the stop, not at its next watch.
        assert!(asked.elapsed() < WATCH_INTERVAL, "{:?}", asked.elapsed());
        assert_eq!(
            stopped,
            Stopped {
                why: "SIGTERM".into(),
                unanswered: 0,
                releases_not_durable: 0
            }
        );
        assert!(!socket.exists(), "its socket is removed");
        stopper.stop("again, once stopped: nothing happens");
    }

    /// What was accepted before the stop is answered before `run` returns;
    /// nothing new is accepted meanwhile.
    #[test]
    fn a_stop_answers_what_was_accepted_first() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("svc.sock");
        let (entered, in_plugin) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let released = Mutex::new(released);
        let plugin = answering(move || {
            let _ = entered.send(());
            let _ = released.lock().expect("lock").recv();
            Reply::Document(serde_json::json!({"answered": true}))
        });
        let service = Service::new();
        let stopper = service.stopper();
        let result = running(service, bind(&socket).expect("bind"), plugin);
        let call = {
            let socket = socket.clone();
            std::thread::spawn(move || forward(&socket, &plugin_call()))
        };
        in_plugin
            .recv_timeout(PROMPTLY)
            .expect("the call reached the plugin");
        stopper.stop("test");
        let started = Instant::now();
        while socket.exists() {
            assert!(started.elapsed() < PROMPTLY, "the socket stayed");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(UnixStream::connect(&socket).is_err(), "still accepting");
        assert!(
            matches!(
                result.recv_timeout(Duration::from_millis(200)),
                Err(mpsc::RecvTimeoutError::Timeout)
            ),
            "returned before answering what it accepted"
        );
        release.send(()).expect("release");
        let answer = call.join().expect("call").expect("answered");
        assert_eq!(answer, Reply::Document(serde_json::json!({"answered": true})));
        let stopped = result.recv_timeout(PROMPTLY).expect("returned").expect("run");
        assert_eq!((stopped.unanswered, stopped.releases_not_durable), (0, 0));
    }

    /// A socket a service manager passed is the manager's too: a stop
    /// leaves it listening, so what comes next waits for the service the
    /// manager starts then.
    #[test]
    fn a_stop_leaves_a_passed_socket_to_its_manager() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("passed.sock");
        let managers = UnixListener::bind(&socket).expect("bind");
        let passed = Listening::inherited(managers.try_clone().expect("dup"));
        let service = Service::new();
        let stopper = service.stopper();
        let result = running(service, passed, answers_done());
        forward(&socket, &plugin_call()).expect("served");
        stopper.stop("test");
        result.recv_timeout(PROMPTLY).expect("returned").expect("run");
        assert!(socket.exists());
        let _next = UnixStream::connect(&socket).expect("still listening");
        managers.accept().expect("queued for the manager");
    }

    /// The idle exit is the same stop.
    #[test]
    fn an_idle_service_stops_the_same_way() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("svc.sock");
        let service = Service::new().exit_when_idle(Duration::from_millis(1));
        let result = running(service, bind(&socket).expect("bind"), answers_done());
        let stopped = result
            .recv_timeout(WATCH_INTERVAL * 2 + PROMPTLY)
            .expect("returned")
            .expect("run");
        assert_eq!(stopped.why, "no request for 1ms");
        assert!(!socket.exists(), "its socket is removed");
    }

    /// Every call answered is counted by verb and result and timed; the
    /// question for the counts, and a liveness probe, are not.
    #[test]
    fn a_service_tells_what_it_answered() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("svc.sock");
        let handler = answering(|| Reply::Failed(cni::Error::invalid_config("no"), cni::Version::LATEST));
        let _result = running(Service::new(), bind(&socket).expect("bind"), handler);
        let within = Duration::from_secs(5);
        assert_eq!(
            crate::client::served(&socket, within).expect("counts"),
            crate::served::Served {
                bounds: crate::served::DURATION_BOUNDS.to_vec(),
                verbs: Vec::new()
            }
        );
        let add = Call::plugin(BTreeMap::from([("CNI_COMMAND".into(), "ADD".into())]), b"{}");
        for _ in 0..3 {
            forward(&socket, &add).expect("answered");
        }
        forward(&socket, &Call::admin("/d".into(), "n".into(), AdminOp::List)).expect("answered");
        assert!(crate::is_served(&socket), "a liveness probe");
        let served = crate::client::served(&socket, within).expect("counts");
        let counted: Vec<(&str, u64, u64)> = served
            .verbs
            .iter()
            .map(|verb| {
                (
                    verb.verb.as_str(),
                    verb.results["failure"],
                    verb.buckets.iter().sum(),
                )
            })
            .collect();
        assert_eq!(counted, [("ADD", 3, 3), ("admin_list", 1, 1)]);
        assert!(served.verbs.iter().all(|verb| verb.seconds > 0.0), "{served:?}");
    }

    #[test]
    fn counts_are_not_asked_of_a_socket_that_is_not_trusted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        let socket = open.join("svc.sock");
        let _result = running(Service::new(), bind(&socket).expect("bind"), answers_done());
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let err = crate::client::served(&socket, Duration::from_secs(5)).expect_err("not asked");
        assert!(matches!(err, CallError::Untrusted { .. }), "{err}");
    }

    #[test]
    fn an_absent_service_is_unreachable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = forward(
            &dir.path().join("none.sock"),
            &Call::admin("/d".into(), "n".into(), AdminOp::List),
        )
        .expect_err("nobody listens");
        assert!(matches!(err, CallError::Unreachable { .. }));
    }
}
