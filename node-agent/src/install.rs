//! The suite's plugin binaries, copied from where the agent runs (its
//! image) into the host's CNI bin directory.
//!
//! A binary is written beside its place and renamed over it, so a runtime
//! executing the plugin at that moment runs either the old file or the new
//! one, never half of one; and only when its content differs. What the
//! agent writes is recorded by content hash in `.cni-suite/installed.json`
//! in the bin directory (a dot-directory the runtime never executes from):
//! a file at a plugin's place whose hash is not recorded is someone else's
//! (kind and minikube nodes ship upstream `host-local`, `loopback`,
//! `portmap`), so before replacing it the agent keeps it aside under
//! `.cni-suite/replaced/`, and uninstall renames it back. A file the agent
//! did not write is never removed.
//!
//! The record is written before the rename, and keeps every hash the agent
//! may have put at a place until the rename is done: killed between the
//! two, the next start still recognises both its old and its new binary as
//! its own, and never keeps one of its own aside as the original.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::Error;
use crate::atomic::{TEMPORARY, replace_file, sync_dir};

/// The agent's own directory inside the bin directory.
const STATE_DIR: &str = ".cni-suite";
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
    /// Places that could not be undone (each with why); the others were.
    pub failed: Vec<String>,
}

fn io_error(what: &str, path: &Path, e: io::Error) -> Error {
    Error::Io(format!("cannot {what} {}: {e}", path.display()))
}

/// The SHA-256 of a file's content, hex; None when it does not exist.
fn hash_of(path: &Path) -> Result<Option<String>, Error> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(hex(&Sha256::digest(&bytes)))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error("read", path, e)),
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
        fs::create_dir_all(&self.dir).map_err(|e| io_error("create", &self.dir, e))?;
        let dir = File::open(&self.dir).map_err(|e| io_error("open", &self.dir, e))?;
        dir.lock().map_err(|e| io_error("lock", &self.dir, e))?;
        Ok(dir)
    }

    /// Removes what an agent killed while writing left beside a place.
    fn sweep(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(TEMPORARY) {
                let _ = fs::remove_file(entry.path());
            }
        }
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
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| Error::Io(format!("{} is not the agent's record: {e}", path.display()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Record::default()),
            Err(e) => Err(io_error("read", &path, e)),
        }
    }

    fn write_record(&self, record: &Record) -> Result<(), Error> {
        let state = self.state();
        fs::DirBuilder::new()
            .recursive(true)
            .create(state.join(REPLACED))
            .map_err(|e| io_error("create", &state, e))?;
        let text = serde_json::to_vec_pretty(record).map_err(|e| Error::Io(e.to_string()))?;
        replace_file(&self.record_path(), &text, 0o644)
    }

    /// Copies each of `names` from `source` unless the bin directory already
    /// holds the same content there.
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
            let bytes = fs::read(&from).map_err(|e| io_error("read", &from, e))?;
            let wanted = hex(&Sha256::digest(&bytes));
            let place = self.dir.join(name);
            let present = hash_of(&place)?;
            if present.as_deref() == Some(wanted.as_str()) {
                continue;
            }
            let ours = record.installed.get(name).cloned().unwrap_or_default();
            if let Some(present) = &present
                && !ours.contains(present)
                && self.keep_aside(name, &place)?
            {
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

    /// Keeps the file at `place` (not the agent's) as the original to
    /// restore: a second name for it, so its place is never empty. The
    /// first original kept stays: a file another installer put there later
    /// and the agent replaced again is not what the node had before the
    /// agent came. Returns whether it kept this one.
    fn keep_aside(&self, name: &str, place: &Path) -> Result<bool, Error> {
        let aside = self.replaced(name);
        let dir = aside.parent().unwrap_or(Path::new("."));
        fs::DirBuilder::new()
            .recursive(true)
            .create(dir)
            .map_err(|e| io_error("create", dir, e))?;
        match fs::hard_link(place, &aside) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(io_error("keep aside", place, e)),
        }
        sync_dir(dir);
        Ok(true)
    }

    /// Puts back every original kept aside and removes the rest of what the
    /// agent wrote, where the file at the place is still the agent's; then
    /// its own directory, once nothing in it is still needed.
    pub fn uninstall(&self) -> Result<Uninstalled, Error> {
        let _alone = self.lock()?;
        self.sweep();
        let record = self.read_record()?;
        let mut done = Uninstalled::default();
        let mut kept = Record::default();
        for (name, ours) in &record.installed {
            let place = self.dir.join(name);
            let aside = self.replaced(name);
            let undone = hash_of(&place).and_then(|present| {
                let still_ours = present.as_ref().is_some_and(|hash| ours.contains(hash));
                if !still_ours {
                    if present.is_some() {
                        done.left.push(name.clone());
                    }
                    return Ok(false);
                }
                if aside.exists() {
                    fs::rename(&aside, &place).map_err(|e| io_error("restore", &place, e))?;
                    done.restored.push(name.clone());
                } else {
                    fs::remove_file(&place).map_err(|e| io_error("remove", &place, e))?;
                    done.removed.push(name.clone());
                }
                Ok(true)
            });
            match undone {
                Ok(true) => {}
                // Whoever changed the file may want the original; a place
                // that could not be undone is tried again next time.
                Ok(false) if !aside.exists() => {}
                Ok(false) => {
                    kept.installed.insert(name.clone(), ours.clone());
                }
                Err(e) => {
                    done.failed.push(e.to_string());
                    kept.installed.insert(name.clone(), ours.clone());
                }
            }
        }
        sync_dir(&self.dir);
        if kept.installed.is_empty() {
            let state = self.state();
            match fs::remove_dir_all(&state) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_error("remove", &state, e)),
            }
        } else {
            self.write_record(&kept)?;
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn put(path: &Path, content: &str) {
        fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        fs::write(path, content).expect("write");
    }

    fn read(path: &Path) -> String {
        fs::read_to_string(path).expect("read")
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(ToString::to_string).collect()
    }

    /// Every entry of `dir`, dot-files included, recursively.
    fn listing(dir: &Path) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for entry in fs::read_dir(dir).expect("ls").flatten() {
            let path = entry.path();
            let relative = path.strip_prefix(dir).expect("under").display().to_string();
            if path.is_dir() {
                out.extend(listing(&path).into_iter().map(|p| format!("{relative}/{p}")));
            }
            out.insert(relative);
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
        let before = listing(&host);
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

        let undone = bin.uninstall().expect("uninstall");
        assert_eq!(undone.restored, names(&["host-local"]));
        assert_eq!(undone.removed, names(&["bridge"]));
        assert_eq!(read(&host.join("host-local")), "upstream host-local");
        assert_eq!(listing(&host), before);
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

        let undone = bin.uninstall().expect("uninstall");
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
        bin.uninstall().expect("uninstall");
        assert_eq!(read(&host.join("loopback")), "upstream loopback");
        assert!(!host.join(".cni-suite").exists());
    }

    #[test]
    fn a_place_that_cannot_be_undone_does_not_stop_the_others() {
        let root = tempfile::tempdir().expect("tempdir");
        let (image, host) = (root.path().join("image"), root.path().join("bin"));
        put(&image.join("bridge"), "ours bridge");
        put(&image.join("loopback"), "ours loopback");
        put(&host.join("loopback"), "upstream loopback");
        let bin = BinDir::new(host.clone());
        bin.install(&image, &names(&["bridge", "loopback"]))
            .expect("install");
        // A directory now stands at bridge's place.
        fs::remove_file(host.join("bridge")).expect("rm");
        fs::create_dir(host.join("bridge")).expect("mkdir");
        let undone = bin.uninstall().expect("uninstall");
        assert_eq!(undone.failed.len(), 1, "{undone:?}");
        assert_eq!(undone.restored, names(&["loopback"]));
        assert_eq!(read(&host.join("loopback")), "upstream loopback");
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
        bin.uninstall().expect("uninstall");
        assert_eq!(read(&host.join("host-local")), "upstream");
    }
}
