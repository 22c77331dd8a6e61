//! One small file per attachment, `<stateDir>/<network>/<containerID>:<ifname>`
//! (neither may hold a `:`, so no two attachments share a name; releases
//! before named it `<containerID>-<ifname>`, which two attachments could
//! share, and those records are still read and removed),
//! holding the addresses ADD opened the FORWARD path for. The reference's
//! iptables rules name only an address, so without this a DEL that comes
//! without prevResult (and with the pod's namespace gone) or a GC could
//! not tell which rules were the pod's. Which records hold an address is
//! indexed beside them ([`crate::address_index`]).

use std::collections::BTreeSet;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use podnet::state_file::{self, Unreadable};
use serde::{Deserialize, Serialize};

use crate::address_index::AddressIndex;

/// An attachment: (network, container ID, ifname).
pub type Owner = (String, String, String);

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
    index: AddressIndex,
}

/// Why the index could not answer.
enum Unindexed {
    /// The index itself: a link or a file in its place, no room to write.
    Index(io::Error),
    /// A file that may be a record could not be read: what it holds is
    /// unknown, with or without the index.
    Record(io::Error),
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
        Store {
            dir: dir.to_owned(),
            index: AddressIndex::new(dir),
        }
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

    /// Writes the record with its claims first and its mark last (see
    /// [`crate::address_index`] for why in this order).
    pub fn save(&self, network: &str, record: &Record) -> io::Result<()> {
        let bytes = serde_json::to_vec(record).map_err(io::Error::other)?;
        let name = Store::name(&record.container_id, &record.ifname);
        for ip in &record.ips {
            self.index.claim(*ip, network, &name)?;
        }
        cni::fault::pause("firewall:claimed");
        state_file::write_whole(&self.dir, network, &name, &bytes)?;
        cni::fault::pause("firewall:recorded");
        self.index.mark(network, &name)
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
    /// that name), then their marks and their claims on `ips`.
    pub fn remove(&self, network: &str, container_id: &str, ifname: &str, ips: &[IpAddr]) -> io::Result<()> {
        let name = Store::name(container_id, ifname);
        state_file::remove_if_present(&self.dir, network, &name)?;
        if ips.is_empty() {
            // Claims may be left without their record (an ADD killed
            // between the two), on addresses this DEL does not know.
            self.index.unclaim_everywhere(network, &name)?;
        }
        let mut names = vec![name];
        let earlier = Store::earlier_name(container_id, ifname);
        match self.parse(network, &earlier, state_file::read(&self.dir, network, &earlier)) {
            Read::Record(record) if record.container_id == container_id && record.ifname == ifname => {
                state_file::remove_if_present(&self.dir, network, &earlier)?;
                names.push(earlier);
            }
            _ => {}
        }
        cni::fault::pause("firewall:del-unrecorded");
        for name in &names {
            self.index.unmark(network, name)?;
            for ip in ips {
                self.index.unclaim(*ip, network, name)?;
            }
        }
        Ok(())
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

    /// Those of `ips` that an attachment of any network but `owner` holds:
    /// their rules are still in use. The iptables rules name only an
    /// address, and networks on different bridges may hand out the same
    /// one. Only the records claiming these addresses are read, once every
    /// record is indexed ([`Store::index_unmarked`]); when the index cannot
    /// be used (a link in its place, no room to index an earlier record),
    /// every record is. Called under the node's lock. An error when a
    /// file that may be a record could not be read: its addresses may be
    /// among them.
    pub fn held_by_others(&self, owner: &Owner, ips: &[IpAddr]) -> io::Result<BTreeSet<IpAddr>> {
        match self.held_by_others_indexed(owner, ips) {
            Ok(held) => Ok(held),
            Err(Unindexed::Record(e)) => Err(e),
            Err(Unindexed::Index(e)) => {
                log::warn!("address index unusable ({e}): reading every record");
                let except = BTreeSet::from([owner.clone()]);
                let in_use = self.addresses_in_use(&except)?;
                Ok(ips.iter().copied().filter(|ip| in_use.contains(ip)).collect())
            }
        }
    }

    fn held_by_others_indexed(&self, owner: &Owner, ips: &[IpAddr]) -> Result<BTreeSet<IpAddr>, Unindexed> {
        self.index_unmarked()?;
        let (network, container_id, ifname) = owner;
        let own: BTreeSet<String> = [
            Store::name(container_id, ifname),
            Store::earlier_name(container_id, ifname),
        ]
        .iter()
        .map(|record| AddressIndex::claim_name(network, record))
        .collect();
        let mut held = BTreeSet::new();
        for ip in ips {
            for claim in self.index.claims(*ip, &own).map_err(Unindexed::Index)? {
                let contents = state_file::read(&self.dir, &claim.network, &claim.record);
                match self.parse(&claim.network, &claim.record, contents) {
                    Read::Record(record)
                        if record.ips.contains(ip)
                            && (&claim.network, &record.container_id, &record.ifname)
                                != (network, container_id, ifname) =>
                    {
                        held.insert(*ip);
                        break;
                    }
                    Read::Record(_) | Read::Skipped => {}
                    Read::Failed(e) => return Err(Unindexed::Record(io::Error::other(e))),
                }
            }
        }
        Ok(held)
    }

    /// Indexes every record that has no mark: written before the index
    /// (an upgraded node), by a release put back meanwhile, or by an ADD
    /// killed between its record and its mark. Lists each network's
    /// records and marks; reads only the records without a mark.
    fn index_unmarked(&self) -> Result<(), Unindexed> {
        for network in state_file::networks(&self.dir).map_err(Unindexed::Index)? {
            let marked = self.index.marked(&network).map_err(Unindexed::Index)?;
            let names = state_file::names(&self.dir, &network).map_err(Unindexed::Index)?;
            for name in names.into_iter().filter(|name| !marked.contains(name)) {
                let contents = state_file::read(&self.dir, &network, &name);
                let record = match self.parse(&network, &name, contents) {
                    Read::Record(record) => record,
                    Read::Skipped => continue,
                    Read::Failed(e) => return Err(Unindexed::Record(io::Error::other(e))),
                };
                for ip in &record.ips {
                    self.index.claim(*ip, &network, &name).map_err(Unindexed::Index)?;
                }
                self.index.mark(&network, &name).map_err(Unindexed::Index)?;
            }
        }
        Ok(())
    }

    /// Every address recorded for any attachment of any network but the
    /// ones `except` names, from every record: what [`Store::held_by_others`]
    /// falls back on.
    fn addresses_in_use(&self, except: &BTreeSet<Owner>) -> io::Result<BTreeSet<IpAddr>> {
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

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    fn owner(network: &str, id: &str) -> Owner {
        (network.to_owned(), id.to_owned(), "eth0".to_owned())
    }

    /// A record as releases before the index wrote it: the file alone.
    fn write_unindexed(dir: &Path, network: &str, name: &str, record: &Record) {
        let bytes = serde_json::to_vec(record).expect("JSON");
        state_file::write_whole(dir, network, name, &bytes).expect("written");
    }

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
        store.remove("n", "a", "b-c", &first.ips).expect("remove");
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
        store.remove("n", "a", "b-c", &[]).expect("remove");
        assert_eq!(store.list("n"), std::slice::from_ref(&earlier), "not the other's");
        store.remove("n", "a-b", "c", &earlier.ips).expect("remove");
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
        let ips = [ip("10.0.0.2")];
        store.remove("a", "c1", "eth0", &ips).expect("remove");
        store
            .remove("a", "c1", "eth0", &ips)
            .expect("removing twice is fine");
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

    #[test]
    fn a_del_asks_the_index_and_reads_only_the_records_claiming_its_addresses() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        store.save("a", &record("c1", &["10.0.0.2"])).expect("save");
        store
            .save("b", &record("c2", &["10.0.0.2", "10.0.0.3"]))
            .expect("save");
        store.save("b", &record("c3", &["10.0.0.4"])).expect("save");
        let mine = [ip("10.0.0.2"), ip("10.0.0.4")];
        assert_eq!(
            store.held_by_others(&owner("a", "c1"), &mine).expect("read"),
            BTreeSet::from([ip("10.0.0.2"), ip("10.0.0.4")])
        );
        // c3's record now says 10.0.0.5 behind the index's back: only the
        // index's claims are followed, and the record they name is read,
        // so 10.0.0.4 is free and 10.0.0.5 is no one's.
        write_unindexed(dir.path(), "b", "c3:eth0", &record("c3", &["10.0.0.5"]));
        assert_eq!(
            store
                .held_by_others(&owner("a", "c1"), &[ip("10.0.0.4"), ip("10.0.0.5")])
                .expect("read"),
            BTreeSet::new()
        );
        store
            .remove("b", "c2", "eth0", &[ip("10.0.0.2"), ip("10.0.0.3")])
            .expect("remove");
        assert_eq!(
            store.held_by_others(&owner("a", "c1"), &mine).expect("read"),
            BTreeSet::new()
        );
        assert!(
            !dir.path().join(".holders-10.0.0.3").exists(),
            "its last claim took the directory"
        );
        assert!(
            dir.path().join(".holders-10.0.0.2").is_dir(),
            "c1's claim is left"
        );
    }

    #[test]
    fn records_written_before_the_index_are_indexed_before_it_is_trusted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        write_unindexed(dir.path(), "a", "c1:eth0", &record("c1", &["10.0.0.2"]));
        // The first release's name, in another network, for the same address.
        write_unindexed(
            dir.path(),
            "b",
            "c2-eth0",
            &record("c2", &["10.0.0.2", "fd00::2"]),
        );
        write_unindexed(dir.path(), "b", "c3:eth0", &record("c3", &["10.0.0.9"]));
        std::fs::write(dir.path().join("b").join("junk"), "{").expect("write");
        assert_eq!(
            store
                .held_by_others(&owner("a", "c1"), &[ip("10.0.0.2")])
                .expect("read"),
            BTreeSet::from([ip("10.0.0.2")]),
            "c2 holds it, in another network, under the earlier name"
        );
        assert_eq!(
            store
                .held_by_others(&owner("b", "c2"), &[ip("10.0.0.2"), ip("fd00::2")])
                .expect("read"),
            BTreeSet::from([ip("10.0.0.2")])
        );
        for (network, name) in [("a", "c1:eth0"), ("b", "c2-eth0"), ("b", "c3:eth0")] {
            assert!(
                store.index.marked(network).expect("marks").contains(name),
                "{network}/{name} indexed"
            );
        }
        assert_eq!(
            store.load("b", "c2", "eth0"),
            Some(record("c2", &["10.0.0.2", "fd00::2"]))
        );
        store
            .remove("b", "c2", "eth0", &[ip("10.0.0.2"), ip("fd00::2")])
            .expect("remove");
        assert_eq!(store.load("b", "c2", "eth0"), None);
        assert_eq!(
            store
                .held_by_others(&owner("a", "c1"), &[ip("10.0.0.2")])
                .expect("read"),
            BTreeSet::new()
        );
        assert!(!dir.path().join(".holders-fd00::2").exists());
    }

    /// What a kill -9 leaves between each step of an ADD or a DEL, made by
    /// hand (the crash test kills real processes there).
    #[test]
    fn what_a_kill_leaves_between_steps_never_hides_a_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        store.save("a", &record("c1", &["10.0.0.2"])).expect("save");
        let index = AddressIndex::new(dir.path());
        // An ADD killed after its claims: a claim of no record.
        index.claim(ip("10.0.0.2"), "b", "c2:eth0").expect("claim");
        assert_eq!(
            store
                .held_by_others(&owner("a", "c1"), &[ip("10.0.0.2")])
                .expect("read"),
            BTreeSet::new()
        );
        // ... after its record, before its mark: held.
        write_unindexed(dir.path(), "b", "c2:eth0", &record("c2", &["10.0.0.2"]));
        assert_eq!(
            store
                .held_by_others(&owner("a", "c1"), &[ip("10.0.0.2")])
                .expect("read"),
            BTreeSet::from([ip("10.0.0.2")])
        );
        // A DEL killed after removing the record: its claim and mark left.
        state_file::remove_if_present(dir.path(), "b", "c2:eth0").expect("removed");
        assert!(index.marked("b").expect("marks").contains("c2:eth0"));
        assert_eq!(
            store
                .held_by_others(&owner("a", "c1"), &[ip("10.0.0.2")])
                .expect("read"),
            BTreeSet::new()
        );
        // The retried DEL cleans up what is left.
        store
            .remove("b", "c2", "eth0", &[ip("10.0.0.2")])
            .expect("remove");
        assert!(!index.marked("b").expect("marks").contains("c2:eth0"));
        let own = BTreeSet::from([AddressIndex::claim_name("a", "c1:eth0")]);
        assert!(index.claims(ip("10.0.0.2"), &own).expect("read").is_empty());
    }

    #[test]
    fn a_link_in_the_index_falls_back_on_reading_every_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::new(dir.path());
        store.save("a", &record("c1", &["10.0.0.2"])).expect("save");
        store.save("b", &record("c2", &["10.0.0.2"])).expect("save");
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).expect("mkdir");
        let holders = dir.path().join(".holders-10.0.0.2");
        std::fs::remove_dir_all(&holders).expect("rm");
        std::os::unix::fs::symlink(&elsewhere, &holders).expect("link");
        assert_eq!(
            store
                .held_by_others(&owner("a", "c1"), &[ip("10.0.0.2")])
                .expect("read"),
            BTreeSet::from([ip("10.0.0.2")]),
            "the link is not taken for no claims"
        );
        let marks = dir.path().join(".indexed-b");
        std::fs::remove_dir_all(&marks).expect("rm");
        std::os::unix::fs::symlink(&elsewhere, &marks).expect("link");
        assert_eq!(
            store
                .held_by_others(&owner("a", "c1"), &[ip("10.0.0.3")])
                .expect("read"),
            BTreeSet::new()
        );
        assert!(
            store.save("b", &record("c3", &["10.0.0.3"])).is_err(),
            "never written through a link"
        );
        assert_eq!(std::fs::read_dir(&elsewhere).expect("list").count(), 0);
    }
}
