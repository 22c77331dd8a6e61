//! Which records hold an address, so that a DEL keeping the rules of an
//! address another attachment still has reads only the records of its own
//! addresses, not every record on the node (a DEL read them all before its
//! `iptables-restore`). Beside the records, in hidden directories of the
//! state directory (no network name starts with a dot, and scans of
//! records pass them over), written and read as the records are
//! (`podnet::state_file`: never through a link):
//!
//! - `.holders-<ip>/<claim>`: one small file per record and address,
//!   naming the record (`{"network","record"}`); the claim's file name
//!   is derived from the record's, so its own writer finds and removes it
//!   without reading it. Removed with the record; the directory with its
//!   last claim.
//! - `.indexed-<network>/<record>`: one empty file per record whose claims
//!   are written. A record without one (written by a release before the
//!   index, or by one put back for a while) is indexed by the next DEL or
//!   GC, under the node's lock.
//!
//! A claim is only a pointer: the record it names is read, and holds the
//! address only if it says so. ADD writes the claims, then the record,
//! then its mark; DEL removes the record first. So a kill -9 anywhere
//! leaves at most claims or a mark of a record that is not there (read as
//! nothing), never a record with neither, which another DEL would miss.

use std::collections::BTreeSet;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use podnet::state_file::{self, Unreadable};
use serde::{Deserialize, Serialize};

/// A claim's contents: the record that holds the address, as
/// `<stateDir>/<network>/<record>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    pub network: String,
    pub record: String,
}

#[derive(Debug, Clone)]
pub struct AddressIndex {
    state_dir: PathBuf,
}

/// What the name of each address's directory starts with.
const HOLDERS_PREFIX: &str = ".holders-";

/// How many times a claim is written when its directory goes meanwhile
/// (a DEL removed it as it emptied).
const WRITE_ATTEMPTS: usize = 3;

impl AddressIndex {
    pub fn new(state_dir: &Path) -> Self {
        AddressIndex {
            state_dir: state_dir.to_owned(),
        }
    }

    fn holders_dir(ip: IpAddr) -> String {
        format!("{HOLDERS_PREFIX}{ip}")
    }

    fn marks_dir(network: &str) -> String {
        format!(".indexed-{network}")
    }

    /// The file name of the claim of `network`'s record `record`.
    pub fn claim_name(network: &str, record: &str) -> String {
        state_file::name_for(&format!("{network}:{record}"))
    }

    /// Records that `network`'s `record` holds `ip`.
    pub fn claim(&self, ip: IpAddr, network: &str, record: &str) -> io::Result<()> {
        let claim = Claim {
            network: network.to_owned(),
            record: record.to_owned(),
        };
        let bytes = serde_json::to_vec(&claim).map_err(io::Error::other)?;
        let (dir, name) = (Self::holders_dir(ip), Self::claim_name(network, record));
        let mut attempt = 1;
        loop {
            match state_file::write_whole(&self.state_dir, &dir, &name, &bytes) {
                Err(e) if e.kind() == io::ErrorKind::NotFound && attempt < WRITE_ATTEMPTS => attempt += 1,
                written => return written,
            }
        }
    }

    /// Removes the claim of `network`'s `record` on `ip`, and the address's
    /// directory when that was its last.
    pub fn unclaim(&self, ip: IpAddr, network: &str, record: &str) -> io::Result<()> {
        let dir = Self::holders_dir(ip);
        state_file::remove_if_present(&self.state_dir, &dir, &Self::claim_name(network, record))?;
        state_file::remove_dir_if_empty(&self.state_dir, &dir)
    }

    /// Removes the claims of `network`'s `record` on every address: for a
    /// DEL that knows none of its addresses (an ADD killed after its
    /// claims, before its record). Lists the addresses' directories, reads
    /// no claim.
    pub fn unclaim_everywhere(&self, network: &str, record: &str) -> io::Result<()> {
        let name = Self::claim_name(network, record);
        for dir in state_file::directories_named(&self.state_dir, HOLDERS_PREFIX)? {
            state_file::remove_if_present(&self.state_dir, &dir, &name)?;
            state_file::remove_dir_if_empty(&self.state_dir, &dir)?;
        }
        Ok(())
    }

    /// The claims on `ip`, but those named in `except` (the caller's own,
    /// not read). A claim that is not one (junk, a FIFO, a link) is logged
    /// and passed over; an error when the address's directory is not one
    /// of ours or a claim could not be read: whoever it names is unknown.
    pub fn claims(&self, ip: IpAddr, except: &BTreeSet<String>) -> io::Result<Vec<Claim>> {
        let dir = Self::holders_dir(ip);
        let mut claims = Vec::new();
        for name in state_file::trusted_names(&self.state_dir, &dir)? {
            if except.contains(&name) {
                continue;
            }
            let place = self.state_dir.join(&dir).join(&name);
            let bytes = match state_file::read(&self.state_dir, &dir, &name) {
                Ok(bytes) => bytes,
                Err(Unreadable::Absent) => continue,
                Err(e) if e.is_not_a_file() => {
                    log::warn!("skipping {}: {e}", place.display());
                    continue;
                }
                Err(e) => return Err(io::Error::other(format!("cannot read {}: {e}", place.display()))),
            };
            match serde_json::from_slice::<Claim>(&bytes) {
                Ok(claim) => claims.push(claim),
                Err(e) => log::warn!("skipping {}: not a claim: {e}", place.display()),
            }
        }
        Ok(claims)
    }

    /// Marks `network`'s `record` as having its claims written.
    pub fn mark(&self, network: &str, record: &str) -> io::Result<()> {
        state_file::write_whole(&self.state_dir, &Self::marks_dir(network), record, b"")
    }

    pub fn unmark(&self, network: &str, record: &str) -> io::Result<()> {
        state_file::remove_if_present(&self.state_dir, &Self::marks_dir(network), record)
    }

    /// The records of `network` marked as indexed; an error when the
    /// marks' directory is not one of ours (then no record can be taken
    /// for indexed).
    pub fn marked(&self, network: &str) -> io::Result<BTreeSet<String>> {
        state_file::trusted_names(&self.state_dir, &Self::marks_dir(network))
            .map(|names| names.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    #[test]
    fn claims_are_listed_but_the_callers_own_and_go_with_their_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let index = AddressIndex::new(dir.path());
        index.claim(ip("10.0.0.2"), "a", "c1:eth0").expect("claim");
        index.claim(ip("10.0.0.2"), "b", "c2:eth0").expect("claim");
        index.claim(ip("fd00::2"), "a", "c1:eth0").expect("claim");
        let own = BTreeSet::from([AddressIndex::claim_name("a", "c1:eth0")]);
        assert_eq!(
            index.claims(ip("10.0.0.2"), &own).expect("read"),
            [Claim {
                network: "b".into(),
                record: "c2:eth0".into()
            }]
        );
        assert!(index.claims(ip("10.0.0.3"), &own).expect("none").is_empty());
        index.unclaim(ip("10.0.0.2"), "a", "c1:eth0").expect("unclaim");
        assert!(dir.path().join(".holders-10.0.0.2").is_dir(), "b's claim is left");
        index.unclaim(ip("10.0.0.2"), "b", "c2:eth0").expect("unclaim");
        index
            .unclaim(ip("10.0.0.2"), "b", "c2:eth0")
            .expect("twice is fine");
        assert!(
            !dir.path().join(".holders-10.0.0.2").exists(),
            "gone with its last claim"
        );
        assert_eq!(
            index.claims(ip("fd00::2"), &BTreeSet::new()).expect("read").len(),
            1
        );
    }

    #[test]
    fn a_link_in_the_index_is_an_error_and_junk_is_passed_over() {
        let dir = tempfile::tempdir().expect("tempdir");
        let index = AddressIndex::new(dir.path());
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).expect("mkdir");
        std::os::unix::fs::symlink(&elsewhere, dir.path().join(".holders-10.0.0.9")).expect("link");
        assert!(index.claims(ip("10.0.0.9"), &BTreeSet::new()).is_err());
        assert!(
            index.claim(ip("10.0.0.9"), "a", "c1:eth0").is_err(),
            "never written through"
        );
        assert_eq!(std::fs::read_dir(&elsewhere).expect("list").count(), 0);
        std::os::unix::fs::symlink(&elsewhere, dir.path().join(".indexed-a")).expect("link");
        assert!(index.marked("a").is_err());
        index.claim(ip("10.0.0.2"), "a", "c1:eth0").expect("claim");
        let holders = dir.path().join(".holders-10.0.0.2");
        std::fs::write(holders.join("junk"), "{").expect("write");
        let made = std::process::Command::new("mkfifo")
            .arg(holders.join("fifo"))
            .status()
            .expect("mkfifo");
        assert!(made.success());
        assert_eq!(
            index
                .claims(ip("10.0.0.2"), &BTreeSet::new())
                .expect("read")
                .len(),
            1
        );
    }
}
