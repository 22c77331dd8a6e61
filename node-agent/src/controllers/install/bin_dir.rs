//! The suite's plugin binaries, copied from where the agent runs (its
//! image) into the host's CNI bin directory.
//!
//! A binary is written beside its place and renamed over it, so a runtime
//! executing the plugin at that moment runs either the old file or the new
//! one, never half of one; and only when its content differs. What the
//! agent writes is recorded by content hash in `.cni-suite/installed.json`
//! in the bin directory (a dot-directory the runtime never executes from):
//! a regular file at a plugin's place whose hash is not recorded is
//! someone else's (kind and minikube nodes ship upstream `host-local`,
//! `loopback`, `portmap`), and so is any symbolic link (the agent writes
//! regular files only; k3s's plugins are relative links to one multicall
//! binary), dangling or not. Before replacing it the agent keeps it aside
//! under `.cni-suite/replaced/` as a second name of the same inode, the
//! link itself for a link, and uninstall renames it back: names, link
//! targets, content and modes end as they were. Nothing is ever looked at
//! through a link, and only regular files are read, opened so that a FIFO
//! cannot block the agent. A place holding anything else (a directory, a
//! FIFO, a device) is refused: it is no plugin, and moving it could break
//! whoever put it there. A file the agent did not write is never removed,
//! nor one a configuration in the conf directory still names.
//!
//! The record is written before the rename, and keeps every hash the agent
//! may have put at a place until the rename is done: killed between the
//! two, the next start still recognises both its old and its new binary as
//! its own, and never keeps one of its own aside as the original.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use cni::small_file;
use nix::fcntl::{AT_FDCWD, AtFlags};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::atomic::{TEMPORARY, read_text, replace_file, sync_dir};
use crate::error::Error;
use crate::record::STATE_DIR;

const RECORD: &str = "installed.json";
const REPLACED: &str = "replaced";

/// Which binary hashes the agent wrote at each plugin's place.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    installed: BTreeMap<String, BTreeSet<String>>,
}

/// The host's bin directory as the agent manages it.
#[derive(Debug, Clone)]
pub struct BinDir {
    dir: PathBuf,
}

/// What one installation did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Installed {
    /// Plugins written (new or changed).
    pub written: Vec<String>,
    /// Of those, the ones whose previous file (not the agent's) was kept aside.
    pub kept_aside: Vec<String>,
}

/// What one uninstallation did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Uninstalled {
    pub restored: Vec<String>,
    pub removed: Vec<String>,
    /// Files at a plugin's place that someone changed after the agent wrote
    /// them: left alone.
    pub left: Vec<String>,
    /// Binaries with no original that a configuration still names: left,
    /// and still recorded, so a later uninstall tries again.
    pub still_named: Vec<String>,
    /// Places that could not be undone (each with why); the others were.
    pub failed: Vec<String>,
}

/// What is at a path, looked at without following a link.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    Absent,
    /// A regular file, by the SHA-256 of its content.
    File(String),
    /// A symbolic link, dangling or not: never the agent's.
    Link,
    /// Anything else, by its kind.
    Other(&'static str),
}

/// How uninstall left one plugin's place.
enum Undone {
    Restored,
    Removed,
    StillNamed,
    /// Someone else's file is there now.
    Left,
    /// Nothing is there, and nothing was kept aside.
    Gone,
}

/// Whether anything, a dangling link included, has the name `path`.
fn is_there(path: &Path) -> Result<bool, Error> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::file("look at", path, e)),
    }
}

/// What is at `path`; a regular file is hashed. Nothing is opened but a
/// regular file, and that without following a link or blocking (it is
/// checked again once open: what replaced it since is never read).
fn look(path: &Path) -> Result<Found, Error> {
    let metadata = match fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Found::Absent),
        Err(e) => return Err(Error::file("look at", path, e)),
    };
    if metadata.file_type().is_symlink() {
        return Ok(Found::Link);
    }
    if let Some(kind) = small_file::not_regular(&metadata) {
        return Ok(Found::Other(kind));
    }
    let opened = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | small_file::OPEN_FLAGS)
        .open(path);
    let mut file = match opened {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Found::Absent),
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => return Ok(Found::Link),
        Err(e) => return Err(Error::file("read", path, e)),
    };
    let metadata = file.metadata().map_err(|e| Error::file("read", path, e))?;
    if let Some(kind) = small_file::not_regular(&metadata) {
        return Ok(Found::Other(kind));
    }
    let mut hasher = Sha256::new();
    io::copy(&mut file, &mut hasher).map_err(|e| Error::file("read", path, e))?;
    Ok(Found::File(hex(&hasher.finalize())))
}

/// A second name for whatever `from` is: for a link, of the link itself,
/// target unchanged. `std::fs::hard_link` leaves following a link to the
/// platform; `linkat` with no flags never follows one.
fn link_itself(from: &Path, to: &Path) -> io::Result<()> {
    nix::unistd::linkat(AT_FDCWD, from, AT_FDCWD, to, AtFlags::empty()).map_err(io::Error::from)
}

/// Removes the empty directory `dir`; one something else still has files
/// in stays.
fn remove_if_empty(dir: &Path) -> Result<(), Error> {
    match fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::DirectoryNotEmpty
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(Error::file("remove", dir, e)),
    }
}

fn remove_if_there(path: &Path) -> Result<(), Error> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::file("remove", path, e)),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl BinDir {
    pub fn new(dir: PathBuf) -> Self {
        BinDir { dir }
    }

    /// Holds an exclusive `flock` on the bin directory itself (never
    /// removed, unlike the agent's own directory in it): two agents on one
    /// node (a rollout's old and new pod) never interleave their changes.
    fn lock(&self) -> Result<File, Error> {
        crate::atomic::lock_dir(&self.dir)
    }

    /// Removes what an agent killed while writing left beside a place.
    fn sweep(&self) {
        crate::atomic::sweep(&self.dir);
    }

    fn state(&self) -> PathBuf {
        self.dir.join(STATE_DIR)
    }

    fn record_path(&self) -> PathBuf {
        self.state().join(RECORD)
    }

    fn replaced(&self, name: &str) -> PathBuf {
        self.state().join(REPLACED).join(name)
    }

    fn read_record(&self) -> Result<Record, Error> {
        let path = self.record_path();
        match read_text(&path) {
            Ok(text) => serde_json::from_str(&text).map_err(|source| Error::Record {
                path: path.clone(),
                source,
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Record::default()),
            Err(e) => Err(Error::file("read", &path, e)),
        }
    }

    fn write_record(&self, record: &Record) -> Result<(), Error> {
        let state = self.state();
        fs::DirBuilder::new()
            .recursive(true)
            .create(state.join(REPLACED))
            .map_err(|e| Error::file("create", &state, e))?;
        let text = serde_json::to_vec_pretty(record)?;
        replace_file(&self.record_path(), &text, 0o644)
    }

    /// Copies each of `names` from `source` unless the bin directory already
    /// holds the same content there. A place holding neither a regular file
    /// nor a link fails the installation, naming it.
    pub fn install(&self, source: &Path, names: &[String]) -> Result<Installed, Error> {
        let _alone = self.lock()?;
        self.sweep();
        let mut record = self.read_record()?;
        let mut done = Installed::default();
        for name in names {
            if name.is_empty() || name.starts_with('.') || name.contains('/') {
                return Err(Error::Setting(format!("{name:?} is not a plugin's file name")));
            }
            let from = source.join(name);
            let bytes = fs::read(&from).map_err(|e| Error::file("read", &from, e))?;
            let wanted = hex(&Sha256::digest(&bytes));
            let place = self.dir.join(name);
            let ours = record.installed.get(name).cloned().unwrap_or_default();
            let someone_elses = match look(&place)? {
                Found::File(present) if present == wanted => continue,
                Found::File(present) => !ours.contains(&present),
                Found::Link => true,
                Found::Absent => false,
                Found::Other(kind) => {
                    return Err(Error::Io(format!(
                        "{} is {kind}, not a plugin's file: someone else's, so {name} is not installed over it",
                        place.display()
                    )));
                }
            };
            if someone_elses && self.keep_aside(name, &place)? {
                done.kept_aside.push(name.clone());
            }
            record
                .installed
                .entry(name.clone())
                .or_default()
                .insert(wanted.clone());
            self.write_record(&record)?;
            replace_file(&place, &bytes, 0o755)?;
            record.installed.insert(name.clone(), BTreeSet::from([wanted]));
            self.write_record(&record)?;
            done.written.push(name.clone());
        }
        Ok(done)
    }

    /// Keeps what is at `place` (not the agent's: a file, or a link as the
    /// link) as the original to restore: a second name for it, so its place
    /// is never empty. The first original kept stays: a file another
    /// installer put there later and the agent replaced again is not what
    /// the node had before the agent came. Returns whether it kept this one.
    fn keep_aside(&self, name: &str, place: &Path) -> Result<bool, Error> {
        let aside = self.replaced(name);
        let dir = aside.parent().unwrap_or(Path::new("."));
        fs::DirBuilder::new()
            .recursive(true)
            .create(dir)
            .map_err(|e| Error::file("create", dir, e))?;
        match link_itself(place, &aside) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(Error::file("keep aside", place, e)),
        }
        sync_dir(dir);
        Ok(true)
    }

    /// Puts back every original kept aside and removes the rest of what the
    /// agent wrote, where the file at the place is still the agent's and no
    /// configuration names it any more (`still_named`: every plugin type the
    /// conf directory's files name); then its own entries in its directory,
    /// and the directory once nothing else is in it.
    pub fn uninstall(&self, still_named: &BTreeSet<String>) -> Result<Uninstalled, Error> {
        let _alone = self.lock()?;
        self.sweep();
        let record = self.read_record()?;
        let mut done = Uninstalled::default();
        let mut kept = Record::default();
        for (name, ours) in &record.installed {
            let stays = match self.undo(name, ours, still_named) {
                Ok(Undone::Restored) => {
                    done.restored.push(name.clone());
                    false
                }
                Ok(Undone::Removed) => {
                    done.removed.push(name.clone());
                    false
                }
                Ok(Undone::Gone) => false,
                Ok(Undone::StillNamed) => {
                    done.still_named.push(name.clone());
                    true
                }
                // Whoever changed the file may want the original, which
                // stays recorded with it.
                Ok(Undone::Left) => {
                    done.left.push(name.clone());
                    is_there(&self.replaced(name)).unwrap_or(true)
                }
                // Tried again next time.
                Err(e) => {
                    done.failed.push(e.to_string());
                    true
                }
            };
            if stays {
                kept.installed.insert(name.clone(), ours.clone());
            }
        }
        sync_dir(&self.dir);
        if kept.installed.is_empty() {
            self.remove_own_state()?;
        } else {
            self.write_record(&kept)?;
        }
        Ok(done)
    }

    /// Undoes the agent's install of `name`, where the file at its place is
    /// still one it wrote. An original kept aside is put back even when the
    /// agent's file is gone (its name is taken only if still free).
    fn undo(
        &self,
        name: &str,
        ours: &BTreeSet<String>,
        still_named: &BTreeSet<String>,
    ) -> Result<Undone, Error> {
        let place = self.dir.join(name);
        let aside = self.replaced(name);
        let original = is_there(&aside)?;
        match look(&place)? {
            Found::File(present) if ours.contains(&present) => {
                if original {
                    fs::rename(&aside, &place).map_err(|e| Error::file("restore", &place, e))?;
                    Ok(Undone::Restored)
                } else if still_named.contains(name) {
                    Ok(Undone::StillNamed)
                } else {
                    fs::remove_file(&place).map_err(|e| Error::file("remove", &place, e))?;
                    Ok(Undone::Removed)
                }
            }
            Found::Absent if original => {
                link_itself(&aside, &place).map_err(|e| Error::file("restore", &place, e))?;
                fs::remove_file(&aside).map_err(|e| Error::file("remove", &aside, e))?;
                Ok(Undone::Restored)
            }
            Found::Absent => Ok(Undone::Gone),
            Found::File(_) | Found::Link | Found::Other(_) => Ok(Undone::Left),
        }
    }

    /// Removes the agent's record, what a killed agent left beside it and
    /// the emptied `replaced/`; the state directory only once empty, since
    /// other records of the agent's live there too.
    fn remove_own_state(&self) -> Result<(), Error> {
        let state = self.state();
        remove_if_there(&self.record_path())?;
        remove_if_there(&state.join(format!(".{RECORD}{TEMPORARY}")))?;
        remove_if_empty(&state.join(REPLACED))?;
        remove_if_empty(&state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};

    fn put(path: &Path, content: &str) {
        fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        fs::write(path, content).expect("write");
    }

    fn put_with_mode(path: &Path, content: &str, mode: u32) {
        put(path, content);
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
    }

    fn read(path: &Path) -> String {
        fs::read_to_string(path).expect("read")
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(ToString::to_string).collect()
    }

    fn nothing_named() -> BTreeSet<String> {
        BTreeSet::new()
    }

    /// Every entry of `dir`, dot-files included, recursively.
    fn listing(dir: &Path) -> BTreeSet<String> {
        snapshot(dir).into_keys().collect()
    }

    /// Every entry of `dir`, recursively, never through a link: its kind,
    /// inode, link count and mode, and a link's target or a file's content.
    fn snapshot(dir: &Path) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for entry in fs::read_dir(dir).expect("ls").flatten() {
            let path = entry.path();
            let relative = path.strip_prefix(dir).expect("under").display().to_string();
            let metadata = fs::symlink_metadata(&path).expect("lstat");
            let what = if metadata.is_symlink() {
                format!("link -> {}", fs::read_link(&path).expect("readlink").display())
            } else if metadata.is_dir() {
                out.extend(
                    snapshot(&path)
                        .into_iter()
                        .map(|(p, what)| (format!("{relative}/{p}"), what)),
                );
                "directory".to_owned()
            } else if metadata.is_file() {
                format!("file {:?}", read(&path))
            } else {
                "special".to_owned()
            };
            let inode = format!(
                "inode {} links {} mode {:o}",
                metadata.ino(),
                metadata.nlink(),
                metadata.mode()
            );
            out.insert(relative, format!("{what}, {inode}"));
        }
        out
    }

    #[test]
    fn originals_are_kept_aside_and_restored_and_nothing_else_is_touched() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("host-local"), "ours v1 host-local");
        put(&image.join("bridge"), "ours v1 bridge");
        put(&host.join("host-local"), "upstream host-local");
        put(&host.join("ptp"), "upstream ptp");
        let before = snapshot(&host);
        let bin = BinDir::new(host.clone());
        let plugins = names(&["host-local", "bridge"]);

        let first = bin.install(&image, &plugins).expect("install");
        assert_eq!(first.written, plugins);
        assert_eq!(first.kept_aside, names(&["host-local"]));
        assert_eq!(read(&host.join("host-local")), "ours v1 host-local");
        let mode = fs::metadata(host.join("bridge"))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);

        // The same image again writes nothing; a new version replaces ours
        // without taking it for an original.
        assert_eq!(
            bin.install(&image, &plugins).expect("again"),
            Installed::default()
        );
        put(&image.join("host-local"), "ours v2 host-local");
        let upgrade = bin.install(&image, &plugins).expect("upgrade");
        assert_eq!(upgrade.written, names(&["host-local"]));
        assert!(upgrade.kept_aside.is_empty());

        let undone = bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(undone.restored, names(&["host-local"]));
        assert_eq!(undone.removed, names(&["bridge"]));
        assert_eq!(read(&host.join("host-local")), "upstream host-local");
        assert_eq!(snapshot(&host), before);
    }

    #[test]
    fn relative_links_to_a_multicall_binary_and_a_dangling_one_are_put_back_as_links() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        let plugins = names(&["bridge", "firewall", "host-local", "loopback", "portmap"]);
        for name in &plugins {
            put(&image.join(name), &format!("ours {name}"));
        }
        // k3s's layout: every plugin a relative link to one binary.
        put_with_mode(&host.join("cni"), "a multicall binary", 0o755);
        for name in ["host-local", "loopback", "portmap"] {
            symlink("cni", host.join(name)).expect("link");
        }
        symlink("gone", host.join("firewall")).expect("dangling link");
        let before = snapshot(&host);
        let bin = BinDir::new(host.clone());

        let done = bin.install(&image, &plugins).expect("install");
        assert_eq!(done.written, plugins);
        assert_eq!(
            done.kept_aside,
            names(&["firewall", "host-local", "loopback", "portmap"])
        );
        for name in &plugins {
            let place = host.join(name);
            assert!(fs::symlink_metadata(&place).expect("lstat").is_file());
            assert_eq!(read(&place), format!("ours {name}"));
        }
        assert_eq!(read(&host.join("cni")), "a multicall binary");
        assert_eq!(
            fs::read_link(host.join(".cni-suite/replaced/loopback")).expect("kept as a link"),
            Path::new("cni")
        );
        assert_eq!(
            fs::read_link(host.join(".cni-suite/replaced/firewall")).expect("kept as a link"),
            Path::new("gone")
        );

        let undone = bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(
            undone.restored,
            names(&["firewall", "host-local", "loopback", "portmap"])
        );
        assert_eq!(undone.removed, names(&["bridge"]));
        assert_eq!(snapshot(&host), before);
    }

    #[test]
    fn hard_linked_originals_come_back_with_their_inode_mode_and_other_names() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("loopback"), "ours loopback");
        put(&image.join("portmap"), "ours portmap");
        put_with_mode(&host.join("loopback"), "upstream loopback", 0o700);
        put_with_mode(&host.join("portmap"), "upstream portmap", 0o755);
        fs::hard_link(host.join("portmap"), host.join("portmap-v1")).expect("second name");
        let before = snapshot(&host);
        let bin = BinDir::new(host.clone());
        let plugins = names(&["loopback", "portmap"]);

        bin.install(&image, &plugins).expect("install");
        assert_eq!(read(&host.join("portmap-v1")), "upstream portmap");
        bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(snapshot(&host), before);
    }

    #[test]
    fn a_fifo_or_a_directory_at_a_place_is_refused_and_left_as_it_is() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("bridge"), "ours bridge");
        put(&image.join("loopback"), "ours loopback");
        fs::create_dir_all(&host).expect("mkdir");
        nix::unistd::mkfifo(&host.join("bridge"), nix::sys::stat::Mode::S_IRWXU).expect("fifo");
        fs::create_dir(host.join("loopback")).expect("a directory");
        let before = snapshot(&host);
        let bin = BinDir::new(host.clone());

        let refused = bin
            .install(&image, &names(&["bridge"]))
            .expect_err("a FIFO is no plugin")
            .to_string();
        assert!(
            refused.contains(&host.join("bridge").display().to_string()) && refused.contains("FIFO"),
            "{refused}"
        );
        let refused = bin
            .install(&image, &names(&["loopback"]))
            .expect_err("a directory is no plugin")
            .to_string();
        assert!(refused.contains("directory"), "{refused}");
        bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(snapshot(&host), before);
    }

    #[test]
    fn a_binary_a_configuration_still_names_stays_until_none_does() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("firewall"), "ours firewall");
        put(&image.join("loopback"), "ours loopback");
        put(&host.join("loopback"), "upstream loopback");
        let bin = BinDir::new(host.clone());
        bin.install(&image, &names(&["firewall", "loopback"]))
            .expect("install");

        let named: BTreeSet<String> = names(&["firewall", "loopback", "ptp"]).into_iter().collect();
        let first = bin.uninstall(&named).expect("uninstall");
        assert_eq!(first.still_named, names(&["firewall"]));
        assert_eq!(
            first.restored,
            names(&["loopback"]),
            "the original serves the name"
        );
        assert!(first.removed.is_empty());
        assert_eq!(read(&host.join("firewall")), "ours firewall");
        assert_eq!(read(&host.join("loopback")), "upstream loopback");

        let second = bin.uninstall(&nothing_named()).expect("again");
        assert_eq!(second.removed, names(&["firewall"]));
        assert_eq!(listing(&host), BTreeSet::from(["loopback".to_owned()]));
    }

    #[test]
    fn uninstall_removes_only_its_own_entries_from_the_state_directory() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("loopback"), "ours loopback");
        put(&host.join("loopback"), "upstream loopback");
        put(&host.join(".cni-suite/node.json"), "another record");
        let bin = BinDir::new(host.clone());
        bin.install(&image, &names(&["loopback"])).expect("install");
        put(
            &host.join(".cni-suite/.installed.json.cni-suite.tmp"),
            "left by an agent killed while writing",
        );
        bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(
            listing(&host),
            BTreeSet::from(["loopback", ".cni-suite", ".cni-suite/node.json"].map(str::to_owned))
        );
    }

    #[test]
    fn an_original_comes_back_where_the_agents_file_was_deleted() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("portmap"), "ours portmap");
        put(&host.join("cni"), "a multicall binary");
        symlink("cni", host.join("portmap")).expect("link");
        let before = snapshot(&host);
        let bin = BinDir::new(host.clone());
        bin.install(&image, &names(&["portmap"])).expect("install");
        fs::remove_file(host.join("portmap")).expect("rm");
        let undone = bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(undone.restored, names(&["portmap"]));
        assert_eq!(snapshot(&host), before);
    }

    #[test]
    fn a_file_someone_changed_after_the_agent_is_left_with_its_original() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("loopback"), "ours loopback");
        put(&host.join("loopback"), "upstream loopback");
        let bin = BinDir::new(host.clone());
        bin.install(&image, &names(&["loopback"])).expect("install");
        put(&host.join("loopback"), "an operator's loopback");

        let undone = bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(undone.left, names(&["loopback"]));
        assert_eq!(read(&host.join("loopback")), "an operator's loopback");
        assert_eq!(
            read(&host.join(".cni-suite/replaced/loopback")),
            "upstream loopback"
        );
    }

    #[test]
    fn the_first_original_kept_aside_is_the_one_restored() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("loopback"), "ours loopback");
        put(&host.join("loopback"), "upstream loopback");
        put(
            &host.join(".loopback.cni-suite.tmp"),
            "left by an agent killed while writing",
        );
        let bin = BinDir::new(host.clone());
        bin.install(&image, &names(&["loopback"])).expect("install");
        assert!(!host.join(".loopback.cni-suite.tmp").exists());
        // Another installer writes its own; the agent's next round puts
        // the suite's back and keeps the first original.
        put(&host.join("loopback"), "another installer's loopback");
        let again = bin.install(&image, &names(&["loopback"])).expect("again");
        assert_eq!(again.written, names(&["loopback"]));
        assert!(again.kept_aside.is_empty());
        bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(read(&host.join("loopback")), "upstream loopback");
        assert!(!host.join(".cni-suite").exists());
    }

    #[test]
    fn a_place_that_cannot_be_undone_does_not_stop_the_others() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("bridge"), "ours bridge");
        put(&image.join("loopback"), "ours loopback");
        put(&host.join("bridge"), "upstream bridge");
        put(&host.join("loopback"), "upstream loopback");
        let bin = BinDir::new(host.clone());
        bin.install(&image, &names(&["bridge", "loopback"]))
            .expect("install");
        // bridge's original cannot be renamed back: a directory with files
        // now stands where it was kept.
        let aside = host.join(".cni-suite/replaced/bridge");
        fs::remove_file(&aside).expect("rm");
        put(&aside.join("something"), "someone's");
        let undone = bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(undone.failed.len(), 1, "{undone:?}");
        assert_eq!(undone.restored, names(&["loopback"]));
        assert_eq!(read(&host.join("loopback")), "upstream loopback");
        assert_eq!(read(&host.join("bridge")), "ours bridge");
        assert!(
            host.join(".cni-suite/installed.json").exists(),
            "bridge is still recorded"
        );
    }

    #[test]
    fn killed_between_record_and_rename_an_upgrade_keeps_the_true_original() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("host-local"), "ours v1");
        put(&host.join("host-local"), "upstream");
        let bin = BinDir::new(host.clone());
        bin.install(&image, &names(&["host-local"])).expect("v1");
        // What an upgrade killed after recording v2 leaves: v1 at the
        // place, both hashes recorded.
        let mut record = bin.read_record().expect("record");
        let v2 = hex(&Sha256::digest(b"ours v2"));
        record.installed.get_mut("host-local").expect("entry").insert(v2);
        bin.write_record(&record).expect("write");
        put(&image.join("host-local"), "ours v2");

        let upgrade = bin.install(&image, &names(&["host-local"])).expect("v2");
        assert!(upgrade.kept_aside.is_empty());
        bin.uninstall(&nothing_named()).expect("uninstall");
        assert_eq!(read(&host.join("host-local")), "upstream");
    }
}
