//! One small file per attachment, `<stateDir>/<network>/<containerID>:<ifname>`
//! (neither may hold a `:`, so no two attachments share a name; releases
//! before named it `<containerID>-<ifname>`, which two attachments could
//! share, and those records are still read and removed),
//! holding the addresses ADD opened the FORWARD path for. The reference's
//! iptables rules name only an address, so without this a DEL that comes
//! without prevResult (and with the pod's namespace gone) or a GC could
//! not tell which rules were the pod's.

use std::collections::BTreeSet;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use podnet::state_file::{self, Unreadable};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
    pub ips: Vec<IpAddr>,
}

#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

/// What a record's file gave: teardown carries on past anything else.
enum Read {
    Record(Record),
    /// Not one of ours (a FIFO, a link, an oversized or malformed file)
    /// or gone: logged, skipped.
    Skipped,
    /// A file that may be a record, unread (an I/O error): its addresses
    /// are unknown.
    Failed(String),
}

impl Store {
    pub fn new(dir: &Path) -> Self {
        Store { dir: dir.to_owned() }
    }

    fn name(container_id: &str, ifname: &str) -> String {
        state_file::name_for(&format!("{container_id}:{ifname}"))
    }

    /// The name releases before this one gave the record.
    fn earlier_name(container_id: &str, ifname: &str) -> String {
        format!("{container_id}-{ifname}")
    }

    /// Whether `name` is a name of `record`'s.
    fn names(record: &Record, name: &str) -> bool {
        name == Store::name(&record.container_id, &record.ifname)
            || name == Store::earlier_name(&record.container_id, &record.ifname)
    }

    pub fn save(&self, network: &str, record: &Record) -> io::Result<()> {
        let bytes = serde_json::to_vec(record).map_err(io::Error::other)?;
        state_file::write_whole(
            &self.dir,
            network,
            &Store::name(&record.container_id, &record.ifname),
            &bytes,
        )
    }

    /// The attachment's record, if one can be read (what cannot is logged).
    pub fn load(&self, network: &str, container_id: &str, ifname: &str) -> Option<Record> {
        [
            Store::name(container_id, ifname),
            Store::earlier_name(container_id, ifname),
        ]
        .iter()
        .find_map(|name| {
            match self.parse(network, name, state_file::read(&self.dir, network, name)) {
                Read::Record(record) if record.container_id == container_id && record.ifname == ifname => {
                    Some(record)
                }
                Read::Record(_) | Read::Skipped => None,
                Read::Failed(e) => {
                    log::warn!("{e}");
                    None
                }
            }
        })
    }

    /// Removes the attachment's record, and one an earlier release wrote
    /// for it (only when it is this attachment's: another's may share
    /// that name).
    pub fn remove(&self, network: &str, container_id: &str, ifname: &str) -> io::Result<()> {
        state_file::remove_if_present(&self.dir, network, &Store::name(container_id, ifname))?;
        let earlier = Store::earlier_name(container_id, ifname);
        match self.parse(network, &earlier, state_file::read(&self.dir, network, &earlier)) {
            Read::Record(record) if record.container_id == container_id && record.ifname == ifname => {
                state_file::remove_if_present(&self.dir, network, &earlier)
            }
            _ => Ok(()),
        }
    }

    /// Every record of `network`; what cannot be read is logged and
    /// skipped (its rules stay).
    pub fn list(&self, network: &str) -> Vec<Record> {
        let entries = state_file::entries(&self.dir, network).unwrap_or_else(|e| {
            log::warn!("cannot list {}: {e}", self.dir.join(network).display());
            Vec::new()
        });
        entries
            .into_iter()
            .filter_map(|e| match self.parse(&e.network, &e.name, e.contents) {
                Read::Record(record) => Some(record),
                Read::Skipped => None,
                Read::Failed(e) => {
                    log::warn!("{e}");
                    None
                }
            })
            .collect()
    }

    /// The addresses recorded for any attachment of any network but the
    /// ones `except` names (`(network, container ID, ifname)`): rules for
    /// those are still in use. The iptables rules name only an address,
    /// and networks on different bridges may hand out the same one. An
    /// error when a file that may be a record could not be read: its
    /// addresses may be among them.
    pub fn addresses_in_use(
        &self,
        except: &BTreeSet<(String, String, String)>,
    ) -> io::Result<BTreeSet<IpAddr>> {
        let mut in_use = BTreeSet::new();
        for entry in state_file::all_entries(&self.dir)? {
            let record = match self.parse(&entry.network, &entry.name, entry.contents) {
                Read::Record(record) => record,
                Read::Skipped => continue,
                Read::Failed(e) => return Err(io::Error::other(e)),
            };
            let owner = (entry.network, record.container_id, record.ifname);
            if !except.contains(&owner) {
                in_use.extend(record.ips);
            }
        }
        Ok(in_use)
    }

    /// A record from what reading `<network>/<name>` gave; one whose
    /// attachment is not the one its name says is not ours.
    fn parse(&self, network: &str, name: &str, contents: Result<Vec<u8>, Unreadable>) -> Read {
        let place = self.dir.join(network).join(name);
        let bytes = match contents {
            Ok(bytes) => bytes,
            Err(Unreadable::Absent) => return Read::Skipped,
            Err(e) if e.is_not_a_file() => {
                log::warn!("skipping {}: {e}", place.display());
                return Read::Skipped;
            }
            Err(e) => return Read::Failed(format!("cannot read {}: {e}", place.display())),
        };
        match serde_json::from_slice::<Record>(&bytes) {
            Ok(record) if Store::names(&record, name) => Read::Record(record),
            Ok(_) => {
                log::warn!("skipping {}: a record of another attachment", place.display());
                Read::Skipped
            }
            Err(e) => {
                log::warn!("skipping {}: not a record: {e}", place.display());
                Read::Skipped
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, ips: &[&str]) -> Record {
        Record {
            container_id: id.to_owned(),
            ifname: "eth0".to_owned(),
            ips: ips.iter().map(|s| s.parse().expect("ip")).collect(),
        }
    }

    #[test]
    fn attachments_whose_ids_and_names_join_alike_keep_their_own_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        let first = Record {
            container_id: "a".into(),
            ifname: "b-c".into(),
            ips: vec!["10.79.0.6".parse().expect("ip")],
        };
        let second = Record {
            container_id: "a-b".into(),
            ifname: "c".into(),
            ips: vec!["10.79.0.5".parse().expect("ip")],
        };
        store.save("n", &first).expect("save");
        store.save("n", &second).expect("save");
        assert_eq!(store.load("n", "a", "b-c"), Some(first.clone()));
        store.remove("n", "a", "b-c").expect("remove");
        assert_eq!(
            store.load("n", "a-b", "c"),
            Some(second.clone()),
            "the other's stays"
        );
        assert_eq!(store.list("n"), [second]);
    }

    #[test]
    fn a_record_an_earlier_release_named_is_read_and_removed_only_for_its_attachment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        let earlier = Record {
            container_id: "a-b".into(),
            ifname: "c".into(),
            ips: vec!["10.79.0.5".parse().expect("ip")],
        };
        let bytes = serde_json::to_vec(&earlier).expect("json");
        state_file::write_whole(dir.path(), "n", "a-b-c", &bytes).expect("as released before");
        assert_eq!(store.load("n", "a-b", "c"), Some(earlier.clone()));
        assert_eq!(store.load("n", "a", "b-c"), None, "a name another shares");
        store.remove("n", "a", "b-c").expect("remove");
        assert_eq!(store.list("n"), [earlier], "not the other's");
        store.remove("n", "a-b", "c").expect("remove");
        assert!(store.list("n").is_empty());
    }

    #[test]
    fn records_are_kept_per_network_and_attachment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        store.save("a", &record("c1", &["10.0.0.2"])).expect("save");
        store
            .save("a", &record("c2", &["10.0.0.3", "fd00::3"]))
            .expect("save");
        store.save("b", &record("c1", &["10.0.0.2"])).expect("save");
        assert_eq!(
            store.load("a", "c2", "eth0"),
            Some(record("c2", &["10.0.0.3", "fd00::3"]))
        );
        assert_eq!(store.list("a").len(), 2);
        let except: BTreeSet<_> = [("a".to_owned(), "c1".to_owned(), "eth0".to_owned())].into();
        let in_use = store.addresses_in_use(&except).expect("read");
        assert!(
            in_use.contains(&"10.0.0.2".parse().expect("ip")),
            "network b still has it"
        );
        store.remove("a", "c1", "eth0").expect("remove");
        store.remove("a", "c1", "eth0").expect("removing twice is fine");
        assert_eq!(store.load("a", "c1", "eth0"), None);
        assert!(Store::new(&dir.path().join("none")).list("a").is_empty());
    }

    #[test]
    fn what_is_not_a_record_is_skipped_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        store.save("a", &record("c1", &["10.0.0.2"])).expect("save");
        let net = dir.path().join("a");
        for fifo in [net.join("fifo-eth0"), dir.path().join("fifo-network")] {
            let made = std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .expect("mkfifo");
            assert!(made.success());
        }
        std::os::unix::fs::symlink(net.join("fifo-eth0"), net.join("linked-eth0")).expect("link");
        std::os::unix::fs::symlink(net.join("c1-eth0"), net.join("c2-eth0")).expect("link");
        std::fs::write(net.join("junk-eth0"), "{").expect("write");
        std::fs::write(
            net.join("c3-eth0"),
            serde_json::to_vec(&record("c4", &["10.0.0.9"])).expect("JSON"),
        )
        .expect("write");
        let (done, outcome) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let found = (
                store.list("a"),
                store.load("a", "fifo", "eth0"),
                store.load("a", "linked", "eth0"),
                store.load("a", "c2", "eth0"),
                store
                    .addresses_in_use(&BTreeSet::new())
                    .map_err(|e| e.to_string()),
            );
            // Gone only when the test timed out already.
            let _ = done.send(found);
        });
        let (list, fifo, linked, link_to_record, in_use) = outcome
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("returned without blocking");
        assert_eq!(list, [record("c1", &["10.0.0.2"])]);
        assert_eq!((fifo, linked, link_to_record), (None, None, None));
        assert_eq!(
            in_use.expect("junk is no error"),
            BTreeSet::from(["10.0.0.2".parse().expect("ip")])
        );
    }
}
