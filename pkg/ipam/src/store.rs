//! The lease store: one sled database per network under
//! `<dataDir>/.sled/<network>/`, used only while holding an exclusive flock
//! on `<dataDir>/<network>/lock`, the same file the reference plugin locks.
//!
//! sled never waits for its own lock, and many plugin processes run at once,
//! so every use goes: take the flock (blocking), open sled (or reuse the
//! copy the lease service keeps open), run the operation (the verbs' layer,
//! [`crate::pool::with_network`], first imports the reference plugin's files
//! if their directory changed) as one transaction, `flush()`, close (direct
//! use only), release the flock. The reply is printed only after that, so a
//! lease that was answered is on disk.
//!
//! One exception, in the lease service only: a change that only removes
//! leases (a DEL, a GC) is answered once committed and made durable right
//! after the answer ([`Stores::make_releases_durable`]). A disk's flush has
//! a tail of hundreds of milliseconds on a busy or virtual disk (measured:
//! 140-470 ms `sync_file_range` in the service behind the slowest DELs),
//! and a DEL waited for it. A crash or a failed flush in that window only
//! leaves the lease held, as before the DEL: GC or a repeated DEL frees it;
//! a service that stops waits until none is owed ([`releases_owed`]).
//! A change that adds a lease is never answered before it is on disk.
//!
//! The store is sled alone: it never reads the reference plugin's files,
//! and keeps what the importer records of them as opaque bytes.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::net::IpAddr;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sled::Transactional;

use cni::fault;
use ipam_config::paths::{Paths, io_error, private_dir, real_dir, trust_store};

use crate::Error;

/// A lease: one address held by one attachment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub ip: IpAddr,
    #[serde(rename = "containerID")]
    pub container_id: String,
    /// Empty for leases imported from the reference's ID-only files.
    pub ifname: String,
    /// Seconds since the epoch.
    pub allocated: u64,
    /// Imported from the reference plugin's directory, whose file the
    /// verbs' layer removes when the lease is released so nothing can bring
    /// it back.
    #[serde(default)]
    pub from_reference: bool,
    /// The network namespace (CNI_NETNS) the lease was handed to. None for
    /// leases recorded before it was kept, and for imported ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct LeaseRecord {
    #[serde(rename = "c")]
    container_id: String,
    #[serde(rename = "i")]
    ifname: String,
    #[serde(rename = "t")]
    allocated: u64,
    #[serde(rename = "r", default)]
    from_reference: bool,
    #[serde(rename = "n", default, skip_serializing_if = "Option::is_none")]
    netns: Option<String>,
}

pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn ip_key(ip: IpAddr) -> Vec<u8> {
    match ip.to_canonical() {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn ip_from_key(key: &[u8]) -> Option<IpAddr> {
    match key.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(key).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(key).ok()?)),
        _ => None,
    }
}

/// `containerID \0 ifname \0`: the prefix of an attachment's index entries.
fn owner_prefix(container_id: &str, ifname: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(container_id.len() + ifname.len() + 2);
    key.extend_from_slice(container_id.as_bytes());
    key.push(0);
    key.extend_from_slice(ifname.as_bytes());
    key.push(0);
    key
}

fn owner_key(lease: &Lease) -> Vec<u8> {
    let mut key = owner_prefix(&lease.container_id, &lease.ifname);
    key.extend_from_slice(&ip_key(lease.ip));
    key
}

const LAST_RESERVED: &str = "last_reserved/";
const REFERENCE_MTIME: &str = "reference_mtime";
/// Committed changes, mirrored by the witness file (see `check_generation`).
const GENERATION: &str = "generation";

fn store_error(what: &str) -> impl Fn(sled::Error) -> Error + '_ {
    move |e| Error::Store(format!("{what}: {e}"))
}

/// Opens a file of the store, never through a symlink.
fn open_nofollow(path: &Path, options: &mut OpenOptions) -> std::io::Result<File> {
    // Without blocking: a FIFO put in the store's place must answer at
    // once, not hold the network's lock for ever.
    options
        .custom_flags(nix::libc::O_NOFOLLOW | cni::small_file::OPEN_FLAGS)
        .open(path)
}

/// Refuses what is not a regular file where the store keeps one.
fn regular(path: &Path, file: File) -> std::io::Result<File> {
    if file.metadata()?.is_file() {
        Ok(file)
    } else {
        Err(std::io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )))
    }
}

/// Whether another open of the database holds sled's lock on it: the
/// exclusive flock sled takes on `<db_dir>/db` without waiting (a lease
/// service keeps it for as long as it keeps the database open).
fn held_by_another_process(db_dir: &Path) -> bool {
    let Ok(file) = open_nofollow(&db_dir.join("db"), OpenOptions::new().read(true)) else {
        return false;
    };
    matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock))
}

/// sled opens its own files (`db`, `conf`, `snap.*`) blocking and following
/// links: anything but a regular file there is refused first.
fn check_sled_files(db_dir: &Path) -> Result<(), Error> {
    let Ok(entries) = std::fs::read_dir(db_dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let sleds = name == "db" || name == "conf" || name.starts_with("snap.");
        if sleds && !entry.file_type().is_ok_and(|t| t.is_file()) {
            return Err(Error::Store(format!(
                "{} is not a regular file: the lease database is not opened",
                entry.path().display()
            )));
        }
    }
    Ok(())
}

/// The witness's number: None when there is no witness or it cannot be
/// parsed (a torn or zeroed sector only lags). A witness that exists but
/// cannot be opened (a symlink, an unreadable file) fails the call: the
/// damage check it serves would silently be off.
fn read_witness(paths: &Paths) -> Result<Option<u64>, Error> {
    let path = paths.witness();
    if let Some(dir) = path.parent()
        && std::fs::symlink_metadata(dir).is_ok()
    {
        real_dir(dir)?;
    }
    let text = match open_nofollow(&path, OpenOptions::new().read(true)).and_then(|file| regular(&path, file))
    {
        Ok(mut file) => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut file, &mut text).map_err(io_error("cannot read", &path))?;
            text
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return adopt_legacy_witness(paths),
        Err(e) => return Err(io_error("cannot open the generation witness", &path)(e)),
    };
    Ok(text.trim().parse::<u64>().ok())
}

/// A store written before the `.generations` directory keeps its damage
/// detection: its witness is copied to the new place and removed from the
/// old one, which then no longer shadows a network of that name. Only a
/// regular file is taken; a directory there is that network's database.
fn adopt_legacy_witness(paths: &Paths) -> Result<Option<u64>, Error> {
    let legacy = paths.legacy_witness();
    let is_witness = std::fs::symlink_metadata(&legacy).is_ok_and(|m| m.file_type().is_file());
    if !is_witness {
        return Ok(None);
    }
    let generation = std::fs::read_to_string(&legacy)
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok());
    if let Some(generation) = generation {
        write_witness(paths, generation)?;
    }
    std::fs::remove_file(&legacy).map_err(io_error("cannot remove the old witness", &legacy))?;
    log::info!(
        "moved the generation witness {} to {}",
        legacy.display(),
        paths.witness().display()
    );
    Ok(generation)
}

/// sled treats what it cannot read back as a torn write and recovers to the
/// last good point, silently: a damaged file comes back with fewer leases,
/// or none, and its addresses would be handed out again. Every committed
/// change bumps a generation inside the database and the witness file keeps
/// a copy; a database behind its witness has lost changes and is refused.
/// The witness is written without fsync after sled's own flush: after a
/// crash it can only lag, never lead, so it never refuses a good database.
fn check_generation(paths: &Paths, net: &Network) -> Result<(), Error> {
    match read_witness(paths)? {
        Some(witnessed) if witnessed > net.generation.get() => Err(damaged(
            paths,
            &format!(
                "it holds {} committed changes, {witnessed} were made",
                net.generation.get()
            ),
        )),
        _ => Ok(()),
    }
}

/// The error for a database that lost what it had committed, with the way
/// out. Nothing is handed out from it: its missing leases would be
/// duplicated. The database is set aside under a dot-name, which no network
/// can have.
fn damaged(paths: &Paths, detail: &str) -> Error {
    let db = paths.db_dir.display();
    let aside = paths.sled_dir().join(".damaged");
    Error::Store(format!(
        "the lease database {db} is damaged ({detail}); leases may be missing, so no address is \
         handed out. To start over, stop the lease service and run \
         `mkdir -p {aside} && mv {db} {aside}/$(date +%s) && rm -f {}`: \
         the next call creates an empty database and imports the reference plugin's files in {} \
         again; addresses of running pods are then unknown to IPAM until they are deleted or re-added",
        paths.witness().display(),
        paths.reference_dir.display(),
        aside = aside.display(),
    ))
}

/// Records `generation` after a flush; a witness that cannot be written
/// fails the call (damage detection would be off without a word).
/// Overwritten in place at a fixed width: one write into one sector, where
/// a new file renamed over the old cost the lease service a third of its
/// CPU per call (an inode created, the old one evicted and its blocks
/// discarded). After a crash the sector holds the old number or the new
/// one; anything unreadable counts as no witness, which only lags.
fn write_witness(paths: &Paths, generation: u64) -> Result<(), Error> {
    let witness = paths.witness();
    let write = || {
        open_nofollow(
            &witness,
            OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600),
        )
        .and_then(|file| file.write_all_at(format!("{generation:020}\n").as_bytes(), 0))
    };
    let written = match write() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(dir) = witness.parent() {
                private_dir(dir)?;
            }
            write()
        }
        other => other,
    };
    written.map_err(|e| {
        Error::Store(format!(
            "cannot record generation {generation} in {}: {e}",
            witness.display()
        ))
    })
}

/// Flushes what `net` committed and records its generation: sled's
/// flush first, so the witness never leads.
fn make_durable(paths: &Paths, db: &sled::Db, net: &Network) -> Result<(), Error> {
    db.flush().map_err(store_error("flush"))?;
    write_witness(paths, net.generation.get())
}

thread_local! {
    /// Networks whose releases this thread committed and answered before
    /// flushing them (see the module docs).
    static RELEASES_TO_FLUSH: RefCell<Vec<Paths>> = const { RefCell::new(Vec::new()) };
}

/// The entries of every thread's `RELEASES_TO_FLUSH`, in all: what a
/// stopping service checks is none (see [`releases_owed`]).
static RELEASES_OWED: AtomicUsize = AtomicUsize::new(0);

/// Releases that some thread of this process answered and has not yet
/// tried to make durable (counted once per thread and network). A lease
/// service that stops waits for it to be zero: a release still owed when
/// the process ends is lost (its lease stays held until GC or a repeated
/// DEL frees it).
pub fn releases_owed() -> usize {
    RELEASES_OWED.load(Ordering::Acquire)
}

/// The flock on a network's `lock` file; released when dropped.
struct NetworkLock {
    _file: File,
}

impl NetworkLock {
    fn acquire(paths: &Paths) -> Result<Self, Error> {
        let path = paths.lock_file();
        let file = open_nofollow(
            &path,
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600),
        )
        .map_err(io_error("cannot open", &path))?;
        file.lock().map_err(io_error("cannot lock", &path))?;
        Ok(NetworkLock { _file: file })
    }
}

/// sled frees the pages a write replaces through crossbeam's global epoch
/// collector, a few bags whenever some thread pins, so the tens of
/// thousands an import replaces were paid for by the lease service's next
/// few hundred calls, on any network (perf: a small network's calls cost
/// three times as much after a 60000-lease import). Draining here pays
/// once, inside the call that imported (see [`Network::note_bulk_write`]). Each round frees at most a few
/// bags; rounds on an empty queue cost next to nothing.
fn release_replaced_pages() {
    const ROUNDS: usize = 1 << 14;
    for _ in 0..ROUNDS {
        crossbeam_epoch::pin().flush();
    }
}

/// Called by a resident store before it first opens a database under a
/// `.sled` directory: the lease service takes charge of that data directory
/// there, or answers [`Error::Busy`] when another process has it.
pub type ClaimHook = Box<dyn Fn(&Path) -> Result<(), Error> + Send + Sync>;

/// A data directory's `.sled` however it is spelled (symlinks, `..`,
/// `/var/run` for `/run`, bind mounts): its device and inode.
type DirIdentity = (u64, u64);

fn identity(dir: &Path) -> Result<DirIdentity, Error> {
    let meta = std::fs::metadata(dir).map_err(io_error("cannot read", dir))?;
    Ok((meta.dev(), meta.ino()))
}

/// Opens databases for operations: once per operation for a plugin process,
/// once for good for the lease service.
pub struct Stores {
    keep_open: bool,
    open: Mutex<HashMap<(DirIdentity, String), sled::Db>>,
    claim: Option<ClaimHook>,
    claimed: Mutex<HashSet<DirIdentity>>,
}

impl std::fmt::Debug for Stores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stores")
            .field("keep_open", &self.keep_open)
            .finish_non_exhaustive()
    }
}

impl Stores {
    /// For one short-lived process: each operation opens and closes.
    pub fn direct() -> Self {
        Stores::new(false, None)
    }

    /// For the lease service: databases stay open between operations.
    /// `claim` runs once per data directory before its first database opens.
    pub fn resident(claim: Option<ClaimHook>) -> Self {
        Stores::new(true, claim)
    }

    fn new(keep_open: bool, claim: Option<ClaimHook>) -> Self {
        // Everything this process creates (sled's files among them) is the
        // owner's alone.
        nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
        Stores {
            keep_open,
            open: Mutex::new(HashMap::new()),
            claim,
            claimed: Mutex::new(HashSet::new()),
        }
    }

    /// Runs `op` on a network with exclusive access (see the module docs).
    /// A resident database that failed to read, write or flush is closed,
    /// so the next call sees what is on disk, not what only memory holds.
    /// Not public: every operation from outside goes through
    /// [`crate::pool::with_network`], which imports the reference plugin's
    /// files first, so none can hand out an address only they record.
    pub(crate) fn with_network<T>(
        &self,
        data_dir: &Path,
        network: &str,
        op: impl FnOnce(&Network) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let paths = Paths::new(data_dir, network)?;
        let open_key = identity(paths.sled_dir())
            .ok()
            .map(|dir| (dir, paths.network.clone()))
            .filter(|key| self.lock_open().contains_key(key));
        if open_key.is_none() {
            // A call the store refuses makes none of its directories.
            paths.check_place()?;
        }
        private_dir(&paths.reference_dir)?;
        private_dir(paths.sled_dir())?;
        let key = match open_key {
            Some(key) => key,
            None => (identity(paths.sled_dir())?, paths.network.clone()),
        };
        if !self.lock_open().contains_key(&key) {
            // Once trusted, nobody else can change these directories, so a
            // database kept open needs no second look.
            trust_store(&paths)?;
        }
        let _lock = NetworkLock::acquire(&paths)?;
        // Looked up under the lock: a storage error closes a database
        // under the lock too.
        let db = self.open(&paths, &key)?;
        let outcome = self.run_locked(&paths, &db, op);
        if !self.keep_open {
            drop(db);
            wait_until_closed(&paths.db_dir);
        } else if outcome.as_ref().is_err_and(Error::is_storage_failure) {
            self.lock_open().remove(&key);
            drop(db);
            wait_until_closed(&paths.db_dir);
            log::warn!(
                "closed {} after a storage error; the next call reopens it from disk",
                paths.db_dir.display()
            );
        }
        outcome
    }

    /// Makes the releases this thread answered durable (see the module
    /// docs): per network, under its lock, sled's flush, then the witness.
    /// A flush that fails closes the database, so the next call reads what
    /// is on disk, where those leases are still held.
    pub fn make_releases_durable(&self) {
        for paths in RELEASES_TO_FLUSH.take() {
            if let Err(e) = self.flush_open(&paths) {
                log::warn!(
                    "{}: released leases were answered but could not be made durable: {e}; \
                     the database is read again from disk, where they are still held",
                    paths.db_dir.display()
                );
            }
            RELEASES_OWED.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Whether this thread answered releases not yet on disk.
    pub fn owes_durability(&self) -> bool {
        RELEASES_TO_FLUSH.with_borrow(|owed| !owed.is_empty())
    }

    fn flush_open(&self, paths: &Paths) -> Result<(), Error> {
        let key = (identity(paths.sled_dir())?, paths.network.clone());
        let _lock = NetworkLock::acquire(paths)?;
        // Closed since (a storage error): nothing was held in memory alone.
        let Some(db) = self.lock_open().get(&key).cloned() else {
            return Ok(());
        };
        let outcome = Network::new(&db, paths).and_then(|net| make_durable(paths, &db, &net));
        if outcome.is_err() {
            self.lock_open().remove(&key);
            drop(db);
            wait_until_closed(&paths.db_dir);
        }
        outcome
    }

    fn run_locked<T>(
        &self,
        paths: &Paths,
        db: &sled::Db,
        op: impl FnOnce(&Network) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let net = Network::new(db, paths)?;
        check_generation(paths, &net)?;
        fault::pause("host-local:locked");
        let outcome = op(&net);
        if net.dirty.get() {
            fault::pause("host-local:committed");
            if self.keep_open && !net.added.get() && outcome.is_ok() {
                RELEASES_TO_FLUSH.with_borrow_mut(|owed| {
                    if !owed.contains(paths) {
                        owed.push(paths.clone());
                        RELEASES_OWED.fetch_add(1, Ordering::AcqRel);
                    }
                });
            } else {
                make_durable(paths, db, &net)?;
            }
        }
        if net.bulk_write.get() && self.keep_open {
            release_replaced_pages();
        }
        outcome
    }

    fn lock_open(&self) -> std::sync::MutexGuard<'_, HashMap<(DirIdentity, String), sled::Db>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn open(&self, paths: &Paths, key: &(DirIdentity, String)) -> Result<sled::Db, Error> {
        if let Some(db) = self.lock_open().get(key) {
            return Ok(db.clone());
        }
        self.claim_once(paths.sled_dir(), key.0)?;
        check_sled_files(&paths.db_dir)?;
        discard_unfinished_snapshots(&paths.db_dir);
        let open = || {
            sled::Config::new()
                .path(&paths.db_dir)
                .flush_every_ms(None)
                .cache_capacity(64 << 20)
                .open()
        };
        let db = match open() {
            // sled says a lock was held only in words, and the kernel is
            // asked instead (below); a holder that let go between sled's
            // try and that question is not there to ask: once more.
            Err(sled::Error::Io(_)) if !held_by_another_process(&paths.db_dir) => open(),
            opened => opened,
        }
        .map_err(|e| match e {
            sled::Error::Corruption { .. } => damaged(paths, &e.to_string()),
            sled::Error::Io(_) if held_by_another_process(&paths.db_dir) => Error::Busy(format!(
                "the lease database {} is held by another process (a lease service?)",
                paths.db_dir.display()
            )),
            e => Error::Store(format!("cannot open {}: {e}", paths.db_dir.display())),
        })?;
        if self.keep_open {
            self.lock_open().insert(key.clone(), db.clone());
        }
        Ok(db)
    }

    fn claim_once(&self, sled_dir: &Path, dir: DirIdentity) -> Result<(), Error> {
        let Some(claim) = &self.claim else {
            return Ok(());
        };
        let mut claimed = self
            .claimed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !claimed.contains(&dir) {
            claim(sled_dir)?;
            claimed.insert(dir);
        }
        Ok(())
    }
}

/// sled 0.34 writes a snapshot (it takes one whenever a database closes)
/// to `snap.<lsn>.generating` and renames it once complete, but on open it
/// reads the newest `snap.*` file, `.generating` included: a process killed
/// while writing one leaves a database that no longer opens ("empty/corrupt
/// snapshot file found"). Such a file never became the snapshot, so the
/// database is what it was before the file was started; it is removed
/// before opening, and only while sled's own lock is free (no process has
/// the database open, so none can still be writing it). The network lock,
/// held by the caller, keeps anyone from opening it meanwhile.
fn discard_unfinished_snapshots(db_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(db_dir) else {
        return;
    };
    let unfinished: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("snap.") && n.ends_with(".generating"))
        })
        .collect();
    if unfinished.is_empty() {
        return;
    }
    let Ok(sled_lock) = open_nofollow(&db_dir.join("db"), OpenOptions::new().read(true)) else {
        return;
    };
    if sled_lock.try_lock().is_err() {
        return;
    }
    for path in unfinished {
        log::warn!(
            "removing {}: a snapshot sled never finished writing",
            path.display()
        );
        if let Err(e) = std::fs::remove_file(&path) {
            log::warn!("could not remove {}: {e}", path.display());
        }
    }
}

/// sled lets go of its own file lock only when its background threads drop
/// their last references, a little after the last handle is dropped. The
/// next process (or the next direct use in this one) must find it free, so
/// the network lock is released only once sled's lock is: taking and
/// dropping it ourselves proves that.
fn wait_until_closed(db_dir: &Path) {
    const PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);
    let Ok(file) = open_nofollow(&db_dir.join("db"), OpenOptions::new().read(true)) else {
        return;
    };
    let started = std::time::Instant::now();
    loop {
        match file.try_lock() {
            Ok(()) => return,
            Err(std::fs::TryLockError::WouldBlock) if started.elapsed() < PATIENCE => {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Err(e) => {
                log::warn!("sled still holds {} after close: {e:?}", db_dir.display());
                return;
            }
        }
    }
}

/// Everything that one operation changes, applied as one transaction.
#[derive(Debug, Default)]
pub struct Change {
    pub add: Vec<Lease>,
    pub remove: Vec<Lease>,
    pub last_reserved: Vec<(usize, IpAddr)>,
    /// Opaque to the store: what [`crate::reference`] records of the
    /// reference plugin's directory to tell when to import it again, kept
    /// in the same transaction as the leases it accounts for.
    pub reference_mtime: Option<Vec<u8>>,
}

impl Change {
    pub fn is_empty(&self) -> bool {
        self.add.is_empty()
            && self.remove.is_empty()
            && self.last_reserved.is_empty()
            && self.reference_mtime.is_none()
    }
}

/// One network's open state, valid while its lock is held.
pub struct Network {
    leases: sled::Tree,
    owners: sled::Tree,
    meta: sled::Tree,
    reference_dir: PathBuf,
    dirty: Cell<bool>,
    /// Whether a committed change added anything: only removals may wait
    /// for durability until after the answer.
    added: Cell<bool>,
    /// See [`Network::note_bulk_write`].
    bulk_write: Cell<bool>,
    /// Committed changes so far (see [`check_generation`]).
    generation: Cell<u64>,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("reference_dir", &self.reference_dir)
            .finish_non_exhaustive()
    }
}

impl Network {
    fn new(db: &sled::Db, paths: &Paths) -> Result<Self, Error> {
        let tree = |name: &str| db.open_tree(name).map_err(store_error("open tree"));
        let meta = tree("meta")?;
        let generation = meta
            .get(GENERATION)
            .map_err(store_error("read meta"))?
            .and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok())
            .map_or(0, u64::from_be_bytes);
        Ok(Network {
            leases: tree("leases")?,
            owners: tree("owners")?,
            meta,
            reference_dir: paths.reference_dir.clone(),
            dirty: Cell::new(false),
            added: Cell::new(false),
            bulk_write: Cell::new(false),
            generation: Cell::new(generation),
        })
    }

    /// `<dataDir>/<network>`, where the shared lock lives; the store reads
    /// nothing else there.
    pub fn reference_dir(&self) -> &Path {
        &self.reference_dir
    }

    /// Tells the store that this operation may have replaced many pages
    /// (it imported leases): a resident store frees them before the call
    /// returns (see [`release_replaced_pages`]).
    pub(crate) fn note_bulk_write(&self) {
        self.bulk_write.set(true);
    }

    fn decode(ip: IpAddr, bytes: &[u8]) -> Result<Lease, Error> {
        let record: LeaseRecord = serde_json::from_slice(bytes)
            .map_err(|e| Error::Store(format!("damaged lease for {ip}: {e}")))?;
        Ok(Lease {
            ip,
            container_id: record.container_id,
            ifname: record.ifname,
            allocated: record.allocated,
            from_reference: record.from_reference,
            netns: record.netns,
        })
    }

    pub fn lease(&self, ip: IpAddr) -> Result<Option<Lease>, Error> {
        let ip = ip.to_canonical();
        match self.leases.get(ip_key(ip)).map_err(store_error("read lease"))? {
            Some(bytes) => Network::decode(ip, &bytes).map(Some),
            None => Ok(None),
        }
    }

    pub fn is_taken(&self, ip: IpAddr) -> Result<bool, Error> {
        self.leases
            .contains_key(ip_key(ip))
            .map_err(store_error("read lease"))
    }

    /// The leases of exactly (container ID, ifname), through the index.
    pub fn leases_of(&self, container_id: &str, ifname: &str) -> Result<Vec<Lease>, Error> {
        let prefix = owner_prefix(container_id, ifname);
        let mut found = Vec::new();
        for entry in self.owners.scan_prefix(&prefix) {
            let (key, _) = entry.map_err(store_error("read index"))?;
            if let Some(lease) = ip_from_key(&key[prefix.len()..])
                .map(|ip| self.lease(ip))
                .transpose()?
                .flatten()
            {
                found.push(lease);
            }
        }
        Ok(found)
    }

    /// Every lease, in address order. For GC, listing and export only.
    pub fn leases(&self) -> Result<Vec<Lease>, Error> {
        self.leases
            .iter()
            .map(|entry| {
                let (key, value) = entry.map_err(store_error("read leases"))?;
                let ip = ip_from_key(&key).ok_or_else(|| Error::Store("damaged lease key".into()))?;
                Network::decode(ip, &value)
            })
            .collect()
    }

    pub fn last_reserved(&self, set: usize) -> Result<Option<IpAddr>, Error> {
        let value = self
            .meta
            .get(format!("{LAST_RESERVED}{set}"))
            .map_err(store_error("read meta"))?;
        Ok(value.and_then(|v| ip_from_key(&v)))
    }

    pub fn last_reserved_all(&self) -> Result<Vec<(usize, IpAddr)>, Error> {
        self.meta
            .scan_prefix(LAST_RESERVED)
            .map(|entry| {
                let (key, value) = entry.map_err(store_error("read meta"))?;
                let index = std::str::from_utf8(&key[LAST_RESERVED.len()..])
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| Error::Store("damaged meta key".into()))?;
                let ip = ip_from_key(&value).ok_or_else(|| Error::Store("damaged meta value".into()))?;
                Ok((index, ip))
            })
            .collect()
    }

    /// The last [`Change::reference_mtime`] committed.
    pub(crate) fn reference_mtime(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(self
            .meta
            .get(REFERENCE_MTIME)
            .map_err(store_error("read meta"))?
            .map(|v| v.to_vec()))
    }

    /// Applies a change as one transaction.
    pub fn apply(&self, change: &Change) -> Result<(), Error> {
        if change.is_empty() {
            return Ok(());
        }
        let records: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> = change
            .add
            .iter()
            .map(|l| {
                let record = LeaseRecord {
                    container_id: l.container_id.clone(),
                    ifname: l.ifname.clone(),
                    allocated: l.allocated,
                    from_reference: l.from_reference,
                    netns: l.netns.clone(),
                };
                let value = serde_json::to_vec(&record).map_err(|e| Error::Store(e.to_string()))?;
                Ok((ip_key(l.ip), owner_key(l), value))
            })
            .collect::<Result<_, Error>>()?;
        let next_generation = self.generation.get() + 1;
        (&self.leases, &self.owners, &self.meta)
            .transaction(|(leases, owners, meta)| {
                for lease in &change.remove {
                    leases.remove(ip_key(lease.ip))?;
                    owners.remove(owner_key(lease))?;
                }
                for (ip, owner, value) in &records {
                    leases.insert(ip.as_slice(), value.as_slice())?;
                    owners.insert(owner.as_slice(), &[][..])?;
                }
                for (set, ip) in &change.last_reserved {
                    meta.insert(format!("{LAST_RESERVED}{set}").as_bytes(), ip_key(*ip))?;
                }
                if let Some(m) = &change.reference_mtime {
                    meta.insert(REFERENCE_MTIME, m.as_slice())?;
                }
                meta.insert(GENERATION, &next_generation.to_be_bytes())?;
                Ok(())
            })
            .map_err(|e: sled::transaction::TransactionError<()>| Error::Store(format!("commit: {e:?}")))?;
        self.generation.set(next_generation);
        self.dirty.set(true);
        if !change.add.is_empty() || !change.last_reserved.is_empty() {
            self.added.set(true);
        }
        Ok(())
    }
}
