//! The ZDS server (`pkg/zds`): ztunnel connects to the agent's
//! `SOCK_SEQPACKET` socket (`ZTUNNEL_UDS_ADDRESS`) and says hello; the
//! agent sends it the snapshot (an add with the pod's netns for each pod in
//! the mesh, a keep for one whose netns it has not open), the snapshot's
//! end, and then each pod added or deleted, every request awaiting its ack
//! within [`ACK_WAIT`].
//!
//! Adds go to the newest connection and deletes to every one, as Istio's:
//! a ztunnel that replaces another connects first and gets the whole
//! snapshot, the old one keeps serving its pods until it drains, and a pod
//! gone must leave both. Each connection has one task that alone writes
//! and reads its socket, since an ack answers only the request before it;
//! a connection that breaks the protocol, answers late or hangs up is
//! closed, and only it.
//!
//! The pods in the mesh and the connections are kept under one lock: a
//! pod is in the mesh from the moment its add is queued, so a ztunnel
//! that connects meanwhile finds it in its snapshot, and a snapshot is
//! queued in the same moment its connection becomes the newest, so no add
//! goes to an older one after it.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use netns::NetNs;
use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use zds::{PacketError, Version, WorkloadInfo, WorkloadRequest, WorkloadResponse, ZdsHello};

use crate::metrics::Metrics;
use crate::run_socket::{self, Bound, Place};

/// The most ztunnel may take to say hello, and to ack one request: inside
/// the plugin's own wait (`agent_wire::pod_event::WAIT`, 5 s, Istio's), so
/// an ADD hears why it failed rather than a timeout of its own.
pub const ACK_WAIT: Duration = Duration::from_secs(4);

/// The least time between two accepted connections (Istio's: 5 a second),
/// so a ztunnel reconnecting in a loop cannot keep the agent sending
/// snapshots.
const ACCEPT_INTERVAL: Duration = Duration::from_millis(200);

/// Why a pod is not in the mesh.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZdsError {
    /// Istio's words, so a search finds both.
    #[error("no ztunnel connection")]
    NoConnection,
    #[error("ztunnel refused the pod: {0}")]
    Refused(String),
    #[error("the ztunnel connection ended before it acked the pod: {0}")]
    Lost(String),
}

/// The pods in the mesh and ztunnel's connections; clones share them.
#[derive(Debug, Clone)]
pub struct Zds {
    shared: Arc<Mutex<Shared>>,
    metrics: Metrics,
}

#[derive(Debug, Default)]
struct Shared {
    /// By pod UID.
    workloads: BTreeMap<String, Workload>,
    /// Oldest first: the last is where adds go.
    connections: Vec<Connection>,
    next_connection: u64,
    next_generation: u64,
}

#[derive(Debug, Clone)]
struct Workload {
    info: WorkloadInfo,
    /// None: in the mesh, its netns not open here (a keep in snapshots).
    netns: Option<Arc<NetNs>>,
    /// Which add put it there: a failed add takes out only its own, never
    /// a later one for the same pod (a runtime's retry of its sandbox).
    generation: u64,
}

#[derive(Debug)]
struct Connection {
    id: u64,
    queue: mpsc::UnboundedSender<Job>,
}

/// One request for a connection's task, and where its outcome goes.
#[derive(Debug)]
struct Job {
    request: WorkloadRequest,
    netns: Option<Arc<NetNs>>,
    /// None: the outcome is only logged (snapshots, deletes).
    outcome: Option<oneshot::Sender<Result<(), ZdsError>>>,
    uid: String,
    /// When whoever waits for the outcome gives up: a job still queued
    /// then is answered without being sent.
    deadline: Option<Instant>,
}

impl Zds {
    pub fn new(metrics: Metrics) -> Zds {
        Zds {
            shared: Arc::new(Mutex::new(Shared::default())),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // Nothing under the lock can panic halfway through a change.
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many ztunnels are connected.
    pub fn connected(&self) -> usize {
        self.lock().connections.len()
    }

    /// The UIDs of the pods in the mesh.
    pub fn uids(&self) -> Vec<String> {
        self.lock().workloads.keys().cloned().collect()
    }

    /// The namespace of the pod of `uid`, when it is in the mesh with one.
    pub fn netns_of(&self, uid: &str) -> Option<Arc<NetNs>> {
        self.lock().workloads.get(uid)?.netns.clone()
    }

    /// Whether the pod of `uid` is in the mesh.
    pub fn in_mesh(&self, uid: &str) -> bool {
        self.lock().workloads.contains_key(uid)
    }

    /// Puts the pod in the mesh: its add, with its netns, to the newest
    /// connection, and its ack awaited until `deadline`. Not in the mesh
    /// when that fails, and deleted from every connection, since one that
    /// took the add and did not answer in time may hold it.
    pub async fn add(
        &self,
        uid: &str,
        info: WorkloadInfo,
        netns: Arc<NetNs>,
        deadline: Instant,
    ) -> Result<(), ZdsError> {
        let started = Instant::now();
        let (acked, generation) = {
            let mut shared = self.lock();
            let Some(newest) = shared.connections.last() else {
                return Err(ZdsError::NoConnection);
            };
            let (tell, acked) = oneshot::channel();
            let job = Job {
                request: WorkloadRequest::add(uid, info.clone()),
                netns: Some(Arc::clone(&netns)),
                outcome: Some(tell),
                uid: uid.to_owned(),
                deadline: Some(deadline),
            };
            if newest.queue.send(job).is_err() {
                return Err(ZdsError::NoConnection);
            }
            let generation = shared.insert(uid, info, Some(netns));
            self.metrics.pods_in_mesh(shared.workloads.len());
            (acked, generation)
        };
        let outcome = match tokio::time::timeout_at(deadline.into(), acked).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err(ZdsError::Lost("its task ended".into())),
            Err(_) => Err(ZdsError::Lost("no ack before the plugin's wait ran out".into())),
        };
        self.metrics.zds_acked(outcome.is_ok(), started.elapsed());
        if outcome.is_err() {
            self.remove_added(uid, Some(generation));
        }
        outcome
    }

    /// Puts the pod of `uid` in the mesh without asking anyone: an agent
    /// that restarted does so for each pod it finds enrolled, before
    /// ztunnel can connect, so ztunnel's snapshot names them all. One whose
    /// netns it could not find is a keep there: the ztunnel serving it goes
    /// on serving it.
    pub fn restore(&self, uid: &str, info: WorkloadInfo, netns: Option<Arc<NetNs>>) {
        let mut shared = self.lock();
        shared.insert(uid, info, netns);
        self.metrics.pods_in_mesh(shared.workloads.len());
    }

    /// Takes the pod of `uid` out of the mesh: a delete to every
    /// connection, not awaited (each connection logs what it was answered).
    pub fn remove(&self, uid: &str) {
        self.remove_added(uid, None);
    }

    /// [`Zds::remove`], only when the pod is there from the add of
    /// `generation` (None: whichever).
    fn remove_added(&self, uid: &str, generation: Option<u64>) {
        let mut shared = self.lock();
        let ours = shared
            .workloads
            .get(uid)
            .is_some_and(|w| generation.is_none_or(|g| g == w.generation));
        if !ours && generation.is_some() {
            return;
        }
        shared.workloads.remove(uid);
        self.metrics.pods_in_mesh(shared.workloads.len());
        for connection in &shared.connections {
            let _ = connection.queue.send(Job {
                request: WorkloadRequest::del(uid),
                netns: None,
                outcome: None,
                uid: uid.to_owned(),
                deadline: None,
            });
        }
    }

    /// Binds `path` and accepts ztunnel's connections until the task is
    /// aborted, each served on a task of its own that ends with it. While
    /// it cannot bind, no ztunnel connects and enrolled pods do not start;
    /// it tries again every `look_every`, and as often looks whether the
    /// socket is still there: one someone removed is bound again (the
    /// connections made meanwhile go on), one a newer agent of a rollout
    /// put there is left to it.
    pub async fn listen(self, path: PathBuf, look_every: Duration) {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            match Listener::bind(&path) {
                Ok(listener) => {
                    self.serve(&listener, &mut connections, look_every).await;
                    log::warn!("ambient: {} was removed; binding it again", path.display());
                }
                Err(e) => {
                    log::error!(
                        "ambient: cannot listen on {} for ztunnel: {e}; enrolled pods do not start; \
                         trying again every {look_every:?}",
                        path.display()
                    );
                    tokio::time::sleep(look_every).await;
                }
            }
        }
    }

    /// Accepts on `listener` until its socket file is gone.
    async fn serve(
        &self,
        listener: &Listener,
        connections: &mut tokio::task::JoinSet<()>,
        look_every: Duration,
    ) {
        log::info!("ambient: ztunnel connects to {}", listener.path.display());
        let mut look = tokio::time::interval(look_every);
        loop {
            tokio::select! {
                accepted = listener.listener.accept() => {
                    match accepted {
                        Ok((stream, _)) => {
                            connections.spawn(self.clone().serve_connection(stream));
                        }
                        Err(e) => log::warn!("ambient: accepting ztunnel's connection: {e}"),
                    }
                    tokio::time::sleep(ACCEPT_INTERVAL).await;
                }
                Some(_) = connections.join_next() => {}
                _ = look.tick() => {
                    if listener.bound.place() == Place::Empty {
                        return;
                    }
                }
            }
        }
    }

    async fn serve_connection(self, stream: UnixStream) {
        let hello = match tokio::time::timeout(ACK_WAIT, receive::<ZdsHello>(&stream)).await {
            Ok(Ok(hello)) => hello,
            Ok(Err(e)) => {
                log::warn!("ambient: a ztunnel connection closed before its hello: {e}");
                return;
            }
            Err(_) => {
                log::warn!("ambient: a ztunnel connected and said no hello in {ACK_WAIT:?}");
                return;
            }
        };
        if hello.version != Version::V1 as i32 {
            log::warn!(
                "ambient: a ztunnel speaks ZDS version {}, not 1; closing its connection",
                hello.version
            );
            return;
        }
        let (queue, mut jobs) = mpsc::unbounded_channel();
        let (id, pods) = {
            let mut shared = self.lock();
            let id = shared.next_connection;
            shared.next_connection += 1;
            for (uid, workload) in &shared.workloads {
                let request = match workload.netns {
                    Some(_) => WorkloadRequest::add(uid, workload.info.clone()),
                    None => WorkloadRequest::keep(uid),
                };
                let _ = queue.send(Job {
                    request,
                    netns: workload.netns.clone(),
                    outcome: None,
                    uid: uid.clone(),
                    deadline: None,
                });
            }
            let _ = queue.send(Job {
                request: WorkloadRequest::snapshot_sent(),
                netns: None,
                outcome: None,
                uid: String::new(),
                deadline: None,
            });
            shared.connections.push(Connection { id, queue });
            self.metrics.ztunnels_connected(shared.connections.len());
            (id, shared.workloads.len())
        };
        log::info!("ambient: ztunnel {id} connected; sending it the {pods} pods in the mesh");
        let ended = loop {
            tokio::select! {
                // What ztunnel sent unasked first: taken for an ack, it
                // would answer the next job before ztunnel saw it.
                biased;
                unasked = receive::<WorkloadResponse>(&stream) => {
                    break match unasked {
                        Err(PacketError::Closed) => "it hung up".to_owned(),
                        Err(e) => e.to_string(),
                        Ok(_) => "protocol error: an ack nothing asked for".to_owned(),
                    };
                }
                job = jobs.recv() => {
                    let Some(job) = job else { break "its queue closed".to_owned() };
                    if let Err(e) = self.exchange(&stream, job, id).await {
                        break e;
                    }
                }
            }
        };
        {
            let mut shared = self.lock();
            shared.connections.retain(|connection| connection.id != id);
            self.metrics.ztunnels_connected(shared.connections.len());
        }
        log::info!("ambient: ztunnel {id} disconnected: {ended}");
        jobs.close();
        while let Ok(job) = jobs.try_recv() {
            if let Some(outcome) = job.outcome {
                let _ = outcome.send(Err(ZdsError::Lost(ended.clone())));
            }
        }
    }

    /// Sends one request and awaits its ack; Err (why) when the connection
    /// is to close. A refusal answers the job and keeps the connection.
    async fn exchange(&self, stream: &UnixStream, job: Job, id: u64) -> Result<(), String> {
        if job.deadline.is_some_and(|deadline| deadline <= Instant::now()) {
            if let Some(tell) = job.outcome {
                let _ = tell.send(Err(ZdsError::Lost(
                    "its turn came after the plugin's wait ran out".into(),
                )));
            }
            return Ok(());
        }
        let netns = job.netns.as_deref().map(AsFd::as_fd);
        let answered = tokio::time::timeout(ACK_WAIT, async {
            send(stream, &job.request, netns).await?;
            receive::<WorkloadResponse>(stream).await
        })
        .await;
        let what = describe(&job);
        let failed = match answered {
            Ok(Ok(response)) => {
                let outcome = response.outcome().map_err(ZdsError::Refused);
                if let Err(refused) = &outcome {
                    log::warn!("ambient: ztunnel {id}: {what}: {refused}");
                }
                if let Some(tell) = job.outcome {
                    let _ = tell.send(outcome);
                }
                return Ok(());
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no ack in {ACK_WAIT:?}"),
        };
        if let Some(tell) = job.outcome {
            let _ = tell.send(Err(ZdsError::Lost(failed.clone())));
        }
        Err(format!("{what}: {failed}"))
    }
}

impl Shared {
    /// Puts a pod in the mesh, replacing what was there for it; the
    /// generation of this insert.
    fn insert(&mut self, uid: &str, info: WorkloadInfo, netns: Option<Arc<NetNs>>) -> u64 {
        let generation = self.next_generation;
        self.next_generation += 1;
        self.workloads.insert(
            uid.to_owned(),
            Workload {
                info,
                netns,
                generation,
            },
        );
        generation
    }
}

fn describe(job: &Job) -> String {
    use zds::Request;
    match &job.request.payload {
        Some(Request::Add(_)) => format!("adding pod {}", job.uid),
        Some(Request::Keep(_)) => format!("keeping pod {}", job.uid),
        Some(Request::Del(_)) => format!("deleting pod {}", job.uid),
        Some(Request::SnapshotSent(_)) => "the snapshot's end".to_owned(),
        None => "an empty request".to_owned(),
    }
}

/// One message from the stream, when it comes.
async fn receive<M: prost::Message + Default>(stream: &UnixStream) -> Result<M, PacketError> {
    loop {
        stream.readable().await?;
        match stream.try_io(Interest::READABLE, || into_io(zds::receive::<M>(stream.as_fd()))) {
            Ok(Ok((message, fds))) => {
                if !fds.is_empty() {
                    return Err(PacketError::Protocol(
                        "ztunnel sent descriptors with its message".into(),
                    ));
                }
                return Ok(message);
            }
            Ok(Err(e)) => return Err(e),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(PacketError::Io(e)),
        }
    }
}

/// One message to the stream, with `netns` beside it when given.
async fn send(
    stream: &UnixStream,
    message: &WorkloadRequest,
    netns: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<(), PacketError> {
    loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || {
            into_io(zds::send(stream.as_fd(), message, netns).map(|()| ((), Vec::new())))
        }) {
            Ok(Ok(((), _))) => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(PacketError::Io(e)),
        }
    }
}

/// A packet's outcome as `try_io` needs it: would-block as the I/O error
/// that clears readiness, every other outcome carried inside.
fn into_io<T>(
    outcome: Result<(T, Vec<zds::packet::ReceivedFd>), PacketError>,
) -> io::Result<Result<(T, Vec<zds::packet::ReceivedFd>), PacketError>> {
    match outcome {
        Err(PacketError::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => Err(e),
        other => Ok(other),
    }
}

/// The bound `SOCK_SEQPACKET` socket ztunnel connects to.
#[derive(Debug)]
pub struct Listener {
    listener: UnixListener,
    path: PathBuf,
    bound: Bound,
}

impl Listener {
    /// Binds `path` as the agent's other sockets are bound (see
    /// `run_socket::bind`: a former agent's replaced, anything else left
    /// alone and refused, 0600 in a directory only the agent may write).
    pub fn bind(path: &Path) -> io::Result<Listener> {
        let (listener, bound) = run_socket::bind(path, |path| {
            let socket = nix::sys::socket::socket(
                AddressFamily::Unix,
                SockType::SeqPacket,
                SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
                None,
            )?;
            let address = UnixAddr::new(path)?;
            nix::sys::socket::bind(std::os::fd::AsRawFd::as_raw_fd(&socket), &address)?;
            nix::sys::socket::listen(&socket, Backlog::new(16)?)?;
            // accept(2) is the same for every Unix socket type: std's
            // listener accepts packet connections as streams of packets.
            UnixListener::from_std(std::os::unix::net::UnixListener::from(socket))
        })?;
        Ok(Listener {
            listener,
            path: path.to_path_buf(),
            bound,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::OwnedFd;
    use std::os::unix::fs::MetadataExt;

    use nix::sys::socket::connect;

    use super::*;

    /// ztunnel's end, blocking: connects, says hello, and answers what the
    /// test tells it.
    struct Peer(OwnedFd);

    impl Peer {
        fn connect(path: &Path) -> Peer {
            let socket = nix::sys::socket::socket(
                AddressFamily::Unix,
                SockType::SeqPacket,
                SockFlag::SOCK_CLOEXEC,
                None,
            )
            .expect("socket");
            connect(
                std::os::fd::AsRawFd::as_raw_fd(&socket),
                &UnixAddr::new(path).expect("address"),
            )
            .expect("connect");
            let peer = Peer(socket);
            let hello = ZdsHello {
                version: Version::V1 as i32,
            };
            zds::send(peer.0.as_fd(), &hello, None).expect("hello");
            peer
        }

        /// The next request, and the inode of the netns that came with it.
        fn next(&self) -> (WorkloadRequest, Option<u64>) {
            let (request, fds) = zds::receive::<WorkloadRequest>(self.0.as_fd()).expect("a request");
            let inode = fds.first().map(|fd| fd.inode().expect("the descriptor's inode"));
            (request, inode)
        }

        /// Acks the last request with `error`, then reads the next.
        fn next_after_ack(&self, error: &str) -> (WorkloadRequest, Option<u64>) {
            self.ack(error);
            self.next()
        }

        fn ack(&self, error: &str) {
            zds::send(self.0.as_fd(), &WorkloadResponse::ack(error), None).expect("ack");
        }

        /// Answers the snapshot: each request acked, until its end.
        fn take_snapshot(&self) -> Vec<zds::Request> {
            let mut seen = Vec::new();
            loop {
                let (request, _) = self.next();
                self.ack("");
                match request.payload.expect("a request") {
                    zds::Request::SnapshotSent(_) => return seen,
                    other => seen.push(other),
                }
            }
        }
    }

    /// The plugin's wait, from now.
    fn soon() -> Instant {
        Instant::now() + ACK_WAIT * 2
    }

    fn info(name: &str) -> WorkloadInfo {
        WorkloadInfo {
            name: name.into(),
            namespace: "mesh".into(),
            service_account: "default".into(),
        }
    }

    fn own_netns() -> (Arc<NetNs>, u64) {
        let netns = NetNs::open("/proc/self/ns/net").expect("our netns");
        let inode = std::fs::metadata("/proc/self/ns/net").expect("stat").ino();
        (Arc::new(netns), inode)
    }

    async fn serving() -> (Zds, PathBuf, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ztunnel").join("ztunnel.sock");
        let zds = Zds::new(Metrics::new(None));
        tokio::spawn(zds.clone().listen(path.clone(), Duration::from_millis(100)));
        for _ in 0..100 {
            if path.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (zds, path, dir)
    }

    async fn wait_connected(zds: &Zds, count: usize) {
        for _ in 0..500 {
            if zds.connected() == count {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{} connections, not {count}", zds.connected());
    }

    /// Until `accepted` connections said hello and `open` of them remain.
    async fn wait_accepted(zds: &Zds, accepted: u64, open: usize) {
        for _ in 0..500 {
            if zds.lock().next_connection == accepted && zds.connected() == open {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not {accepted} accepted and {open} open");
    }

    /// The peer's side runs on a thread: it blocks.
    fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> std::thread::JoinHandle<T> {
        std::thread::spawn(f)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_ztunnel_no_pod_enters_the_mesh() {
        let (zds, _path, _dir) = serving().await;
        let (netns, _) = own_netns();
        assert_eq!(
            zds.add("u1", info("a"), netns, soon()).await,
            Err(ZdsError::NoConnection)
        );
        assert!(!zds.in_mesh("u1"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_add_carries_the_pods_netns_and_returns_with_ztunnels_ack() {
        let (zds, path, _dir) = serving().await;
        let (netns, inode) = own_netns();
        let peer = Peer::connect(&path);
        let peer = on_thread(move || {
            assert!(peer.take_snapshot().is_empty());
            let (request, sent) = peer.next();
            peer.ack("");
            let (refused, _) = peer.next();
            peer.ack("no such workload");
            (peer, request, sent, refused)
        });
        wait_connected(&zds, 1).await;
        zds.add("u1", info("a"), Arc::clone(&netns), soon())
            .await
            .expect("acked");
        assert!(zds.in_mesh("u1"));
        let refused = zds.add("u2", info("b"), netns, soon()).await;
        assert_eq!(refused, Err(ZdsError::Refused("no such workload".into())));
        assert!(!zds.in_mesh("u2"));
        let (peer, request, sent, _) = peer.join().expect("peer");
        assert_eq!(request, WorkloadRequest::add("u1", info("a")));
        assert_eq!(sent, Some(inode), "the pod's own netns");
        // The refused add was deleted from the connection, in case.
        let deleted = on_thread(move || peer.next().0).join().expect("peer");
        assert_eq!(deleted, WorkloadRequest::del("u2"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_add_never_takes_out_a_later_one_for_the_same_pod() {
        let (zds, path, _dir) = serving().await;
        let (netns, _) = own_netns();
        let peer = Peer::connect(&path);
        let peer = on_thread(move || {
            peer.take_snapshot();
            let (first, _) = peer.next();
            let (second, _) = peer.next_after_ack("a stale sandbox");
            peer.ack("");
            // Kept open until the agent read the ack.
            (peer, first, second)
        });
        wait_connected(&zds, 1).await;
        let (stale, retried) = tokio::join!(
            zds.add("u1", info("a"), Arc::clone(&netns), soon()),
            zds.add("u1", info("a"), Arc::clone(&netns), soon()),
        );
        assert!(matches!(stale, Err(ZdsError::Refused(_))), "{stale:?}");
        retried.expect("acked");
        assert!(zds.in_mesh("u1"), "the retry's add stands");
        let (_peer, first, second) = peer.join().expect("peer");
        assert_eq!(
            (first, second),
            (
                WorkloadRequest::add("u1", info("a")),
                WorkloadRequest::add("u1", info("a"))
            )
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_add_whose_plugin_gave_up_while_queued_is_never_sent() {
        let (zds, path, _dir) = serving().await;
        let (netns, _) = own_netns();
        let peer = Peer::connect(&path);
        let peer = on_thread(move || {
            peer.take_snapshot();
            let (slow, _) = peer.next();
            std::thread::sleep(Duration::from_millis(600));
            let (next, _) = peer.next_after_ack("");
            peer.ack("");
            (peer, slow, next)
        });
        wait_connected(&zds, 1).await;
        let (slow, late) = tokio::join!(
            zds.add("u1", info("a"), Arc::clone(&netns), soon()),
            zds.add(
                "u2",
                info("b"),
                Arc::clone(&netns),
                Instant::now() + Duration::from_millis(200)
            ),
        );
        slow.expect("acked");
        assert!(matches!(late, Err(ZdsError::Lost(_))), "{late:?}");
        let (_peer, slow, next) = peer.join().expect("peer");
        assert_eq!(slow, WorkloadRequest::add("u1", info("a")));
        assert_eq!(next, WorkloadRequest::del("u2"), "the add of u2 never went");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_ztunnel_gets_the_snapshot_then_the_adds_and_deletes_go_to_both() {
        let (zds, path, _dir) = serving().await;
        let (netns, inode) = own_netns();
        let old = Peer::connect(&path);
        let old = on_thread(move || {
            old.take_snapshot();
            old.next();
            old.ack("");
            old
        });
        wait_connected(&zds, 1).await;
        zds.add("u1", info("a"), Arc::clone(&netns), soon())
            .await
            .expect("acked");
        let old = old.join().expect("old");
        zds.restore("u0", info("kept"), None);

        let new = Peer::connect(&path);
        let new = on_thread(move || {
            let mut snapshot = Vec::new();
            loop {
                let (request, sent) = new.next();
                new.ack("");
                match request.payload.expect("a request") {
                    zds::Request::SnapshotSent(_) => break,
                    other => snapshot.push((other, sent)),
                }
            }
            let (added, _) = new.next();
            new.ack("");
            let (deleted, _) = new.next();
            new.ack("");
            (snapshot, added, deleted)
        });
        wait_connected(&zds, 2).await;
        zds.add("u2", info("b"), Arc::clone(&netns), soon())
            .await
            .expect("the new one acks");
        zds.remove("u1");
        let (snapshot, added, deleted) = new.join().expect("new");
        assert_eq!(
            snapshot,
            [
                (zds::Request::Keep(zds::KeepWorkload { uid: "u0".into() }), None),
                (
                    WorkloadRequest::add("u1", info("a")).payload.expect("add"),
                    Some(inode)
                ),
            ]
        );
        assert_eq!(added, WorkloadRequest::add("u2", info("b")));
        assert_eq!(deleted, WorkloadRequest::del("u1"));
        // The old one hears of the delete, never of the add.
        let (request, _) = old.next();
        assert_eq!(request, WorkloadRequest::del("u1"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ztunnel_that_hangs_up_or_breaks_the_protocol_loses_only_its_connection() {
        let (zds, path, _dir) = serving().await;
        let (netns, _) = own_netns();
        let steady = Peer::connect(&path);
        let steady = on_thread(move || {
            steady.take_snapshot();
            steady
        });
        wait_connected(&zds, 1).await;
        let steady = steady.join().expect("steady");
        // An ack nothing asked for.
        let rude = Peer::connect(&path);
        let rude = on_thread(move || {
            rude.take_snapshot();
            rude.ack("");
            rude
        });
        let _rude = rude.join().expect("rude");
        wait_accepted(&zds, 2, 1).await;
        // One that hangs up in the middle of an add.
        let quitter = Peer::connect(&path);
        let quitter = on_thread(move || {
            quitter.take_snapshot();
            let _ = quitter.next();
            drop(quitter);
        });
        wait_accepted(&zds, 3, 2).await;
        let lost = zds.add("u1", info("a"), Arc::clone(&netns), soon()).await;
        quitter.join().expect("quitter");
        assert!(matches!(lost, Err(ZdsError::Lost(_))), "{lost:?}");
        wait_connected(&zds, 1).await;
        // The steady one heard the lost pod's delete, and takes the next add.
        let steady = on_thread(move || {
            let (deleted, _) = steady.next();
            steady.ack("");
            let (added, _) = steady.next();
            steady.ack("");
            (deleted, added)
        });
        zds.add("u2", info("b"), netns, soon()).await.expect("acked");
        let (deleted, added) = steady.join().expect("steady");
        assert_eq!(deleted, WorkloadRequest::del("u1"));
        assert_eq!(added, WorkloadRequest::add("u2", info("b")));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_socket_someone_removed_is_bound_again_and_its_connections_go_on() {
        let (zds, path, _dir) = serving().await;
        let (netns, _) = own_netns();
        let first = Peer::connect(&path);
        let first = on_thread(move || {
            first.take_snapshot();
            first
        });
        wait_connected(&zds, 1).await;
        let _first = first.join().expect("first");
        std::fs::remove_file(&path).expect("removed");
        let second = on_thread(move || {
            for _ in 0..200 {
                if std::fs::symlink_metadata(&path).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let second = Peer::connect(&path);
            second.take_snapshot();
            let (request, _) = second.next();
            second.ack("");
            (second, request)
        });
        // The first connection went on; the one made at the socket bound
        // again is the newest, and takes the add.
        wait_connected(&zds, 2).await;
        zds.add("u1", info("a"), netns, soon()).await.expect("acked");
        let (_second, request) = second.join().expect("bound again");
        assert_eq!(request, WorkloadRequest::add("u1", info("a")));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ztunnel_that_never_acks_is_closed_within_the_bound() {
        let (zds, path, _dir) = serving().await;
        let (netns, _) = own_netns();
        let silent = Peer::connect(&path);
        let silent = on_thread(move || {
            silent.take_snapshot();
            let _ = silent.next();
            silent
        });
        wait_connected(&zds, 1).await;
        let started = Instant::now();
        let lost = zds.add("u1", info("a"), netns, soon()).await;
        assert!(matches!(lost, Err(ZdsError::Lost(_))), "{lost:?}");
        let waited = started.elapsed();
        assert!(waited >= ACK_WAIT && waited < ACK_WAIT * 2, "{waited:?}");
        wait_connected(&zds, 0).await;
        drop(silent.join());
    }
}
