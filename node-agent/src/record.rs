//! What the agent changed on the node outside its own files, recorded on
//! the node so that uninstall undoes it even when the agent that made the
//! change was restarted or killed since: every configuration file it
//! chained istio-redirect into, every file it wrote in Istio's owned
//! mode, and every bare `.conf` it wrapped into a `.conflist` (with the
//! `.conf`'s bytes, to put back); and the node's nat
//! tables as they were before the suite's first change on this boot, so
//! that uninstall removes only what the suite left there.
//!
//! Kept in the bin directory's `.cni-suite/node.json` beside the install
//! record (a hostPath the DaemonSet already mounts; the runtime never reads
//! there). Read and written under the same `flock` on the bin directory as
//! installs, so two agents of a rollout never lose each other's entries.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::atomic::{lock_dir, read_text, replace_file};
use crate::error::Error;

/// The agent's own directory inside the bin directory, which holds this
/// record and the install's (`installed.json`): each removes only its own
/// entries.
pub const STATE_DIR: &str = ".cni-suite";
const FILE: &str = "node.json";

/// The record's content.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Configuration files istio-redirect was chained into.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub chained: BTreeSet<PathBuf>,
    /// Files of the agent's own made in Istio's owned mode (the primary's
    /// plugins and istio-redirect), removed at uninstall or when the mode
    /// is switched off.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub owned: BTreeSet<PathBuf>,
    /// Lists made from a bare `.conf`, by the list's path.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub wrapped: BTreeMap<PathBuf, Wrapped>,
    /// The nat tables before the suite's first change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firewall_before: Option<FirewallBefore>,
}

/// The node's nat tables as the first agent of a boot found them. A
/// reboot empties the kernel's tables, so another boot's is stale.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FirewallBefore {
    pub boot_id: String,
    pub snapshot: crate::leftovers::Snapshot,
}

/// A bare `.conf` as it was before the agent wrapped it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wrapped {
    pub conf: PathBuf,
    /// Its bytes (it was read as UTF-8 JSON).
    pub content: String,
    pub mode: u32,
    /// Where it pointed, when it was a symbolic link: it comes back as the
    /// link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<PathBuf>,
}

impl NodeRecord {
    fn is_empty(&self) -> bool {
        *self == NodeRecord::default()
    }
}

/// The record of the node whose bin directory is `bin_dir`.
#[derive(Debug, Clone)]
pub struct Record {
    bin_dir: PathBuf,
}

impl Record {
    pub fn new(bin_dir: &Path) -> Record {
        Record {
            bin_dir: bin_dir.to_path_buf(),
        }
    }

    fn path(&self) -> PathBuf {
        self.bin_dir.join(STATE_DIR).join(FILE)
    }

    /// The record as it is (empty when there is none).
    pub fn read(&self) -> Result<NodeRecord, Error> {
        let path = self.path();
        match read_text(&path) {
            Ok(text) => serde_json::from_str(&text).map_err(|source| Error::Record {
                path: path.clone(),
                source,
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(NodeRecord::default()),
            Err(e) => Err(Error::file("read", &path, e)),
        }
    }

    /// Applies `change` to the record under the bin directory's lock and
    /// writes it back when it changed (removing the file once empty).
    pub fn update<T>(&self, change: impl FnOnce(&mut NodeRecord) -> T) -> Result<T, Error> {
        let _alone = lock_dir(&self.bin_dir)?;
        let before = self.read()?;
        let mut record = before.clone();
        let outcome = change(&mut record);
        if record != before {
            self.write(&record)?;
        }
        Ok(outcome)
    }

    fn write(&self, record: &NodeRecord) -> Result<(), Error> {
        let path = self.path();
        if record.is_empty() {
            return match std::fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(Error::file("remove", &path, e)),
            };
        }
        let dir = self.bin_dir.join(STATE_DIR);
        std::fs::create_dir_all(&dir).map_err(|e| Error::file("create", &dir, e))?;
        let text = serde_json::to_vec_pretty(record)?;
        replace_file(&path, &text, 0o644)
    }
}

const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// This boot's id.
fn boot_id() -> Result<String, Error> {
    std::fs::read_to_string(BOOT_ID)
        .map(|id| id.trim().to_owned())
        .map_err(|e| Error::file("read", Path::new(BOOT_ID), e))
}

/// Whether `recorded` is this boot's, so it is kept: an agent restarted
/// later in the boot would take the suite's own leftovers for the node's.
fn of_this_boot(recorded: Option<&FirewallBefore>, boot_id: &str) -> bool {
    recorded.is_some_and(|before| before.boot_id == boot_id)
}

/// The firewall's part of the record.
impl Record {
    /// Records the node's nat tables unless this boot's are recorded
    /// already; whether it took them now. Taken under the bin directory's
    /// lock, so two agents of a rollout record one snapshot.
    pub fn remember_firewall(&self) -> Result<bool, Error> {
        let boot_id = boot_id()?;
        self.update(|record| {
            if of_this_boot(record.firewall_before.as_ref(), &boot_id) {
                return Ok(false);
            }
            let snapshot = crate::leftovers::snapshot().map_err(|source| Error::NatTables {
                what: "cannot read the node's nat tables",
                source,
            })?;
            record.firewall_before = Some(FirewallBefore { boot_id, snapshot });
            Ok(true)
        })?
    }

    /// Removes what the suite left in the nat tables that no one uses,
    /// keeping what this boot's record says was there before; None when
    /// there is no such record: nothing then tells the node's own from the
    /// suite's, and nothing is removed.
    pub fn remove_unused_firewall(&self) -> Result<Option<crate::leftovers::Removal>, Error> {
        let boot_id = boot_id()?;
        let Some(before) = self
            .read()?
            .firewall_before
            .filter(|before| of_this_boot(Some(before), &boot_id))
        else {
            return Ok(None);
        };
        crate::leftovers::remove_unused(&before.snapshot)
            .map(Some)
            .map_err(|source| Error::NatTables {
                what: "the nat tables",
                source,
            })
    }

    /// Drops the snapshot, once the suite is gone from the node.
    pub fn forget_firewall(&self) -> Result<(), Error> {
        self.update(|record| record.firewall_before = None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_a_new_reader_and_an_empty_record_leaves_no_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let record = Record::new(dir.path());
        assert_eq!(record.read().expect("none yet"), NodeRecord::default());
        record
            .update(|r| r.chained.insert("/etc/cni/net.d/10-kindnet.conflist".into()))
            .expect("update");
        let again = Record::new(dir.path()).read().expect("read");
        assert_eq!(again.chained.len(), 1);
        record.update(|r| r.chained.clear()).expect("cleared");
        assert!(!dir.path().join(STATE_DIR).join(FILE).exists());
    }

    #[test]
    fn a_record_that_is_not_ours_is_an_error_not_an_empty_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join(STATE_DIR)).expect("mkdir");
        std::fs::write(dir.path().join(STATE_DIR).join(FILE), "[1]").expect("write");
        assert!(Record::new(dir.path()).read().is_err());
        assert!(Record::new(dir.path()).update(|_| ()).is_err());
    }

    fn before(boot_id: &str) -> FirewallBefore {
        FirewallBefore {
            boot_id: boot_id.into(),
            snapshot: crate::leftovers::Snapshot::default(),
        }
    }

    #[test]
    fn a_snapshot_of_this_boot_is_kept_and_another_boots_is_taken_again() {
        assert!(of_this_boot(Some(&before("b1")), "b1"));
        assert!(
            !of_this_boot(Some(&before("b0")), "b1"),
            "the kernel's tables were reset"
        );
        assert!(!of_this_boot(None, "b1"));
    }

    #[test]
    fn a_record_without_a_snapshot_reads_and_a_snapshot_keeps_the_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join(STATE_DIR)).expect("mkdir");
        std::fs::write(
            dir.path().join(STATE_DIR).join(FILE),
            r#"{"chained": ["/a.conflist"]}"#,
        )
        .expect("an older agent's record");
        let record = Record::new(dir.path());
        assert_eq!(record.read().expect("read").firewall_before, None);
        record
            .update(|r| r.firewall_before = Some(before("b1")))
            .expect("update");
        record.update(|r| r.chained.clear()).expect("update");
        assert_eq!(
            Record::new(dir.path()).read().expect("read").firewall_before,
            Some(before("b1"))
        );
        record.forget_firewall().expect("forgotten");
        assert!(!dir.path().join(STATE_DIR).join(FILE).exists());
    }
}
