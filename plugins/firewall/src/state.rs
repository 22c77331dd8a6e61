//! One small file per attachment, `<stateDir>/<network>/<containerID>-<ifname>`,
//! holding the addresses ADD opened the FORWARD path for. The reference's
//! iptables rules name only an address, so without this a DEL that comes
//! without prevResult (and with the pod's namespace gone) or a GC could
//! not tell which rules were the pod's.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use podnet::state_file;
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

impl Store {
    pub fn new(dir: &Path) -> Self {
        Store { dir: dir.to_owned() }
    }

    fn path(&self, network: &str, container_id: &str, ifname: &str) -> PathBuf {
        self.dir.join(network).join(format!("{container_id}-{ifname}"))
    }

    pub fn save(&self, network: &str, record: &Record) -> io::Result<()> {
        let bytes = serde_json::to_vec(record).map_err(io::Error::other)?;
        state_file::write_whole(&self.path(network, &record.container_id, &record.ifname), &bytes)
    }

    pub fn load(&self, network: &str, container_id: &str, ifname: &str) -> Option<Record> {
        let bytes = fs::read(self.path(network, container_id, ifname)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    pub fn remove(&self, network: &str, container_id: &str, ifname: &str) -> io::Result<()> {
        state_file::remove_if_present(&self.path(network, container_id, ifname))
    }

    /// Every record of `network` (unreadable ones skipped).
    pub fn list(&self, network: &str) -> Vec<Record> {
        let Ok(entries) = fs::read_dir(self.dir.join(network)) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .filter_map(|e| serde_json::from_slice(&fs::read(e.path()).ok()?).ok())
            .collect()
    }

    /// The addresses recorded for any attachment of any network but the
    /// ones `except` names (`(network, container ID, ifname)`): rules for
    /// those are still in use. The iptables rules name only an address,
    /// and networks on different bridges may hand out the same one.
    pub fn addresses_in_use(&self, except: &BTreeSet<(String, String, String)>) -> BTreeSet<IpAddr> {
        let Ok(networks) = fs::read_dir(&self.dir) else {
            return BTreeSet::new();
        };
        networks
            .flatten()
            .filter_map(|n| n.file_name().to_str().map(str::to_owned))
            .flat_map(|network| {
                self.list(&network).into_iter().filter(move |r| {
                    !except.contains(&(network.clone(), r.container_id.clone(), r.ifname.clone()))
                })
            })
            .flat_map(|r| r.ips)
            .collect()
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
        let in_use = store.addresses_in_use(&except);
        assert!(
            in_use.contains(&"10.0.0.2".parse().expect("ip")),
            "network b still has it"
        );
        store.remove("a", "c1", "eth0").expect("remove");
        store.remove("a", "c1", "eth0").expect("removing twice is fine");
        assert_eq!(store.load("a", "c1", "eth0"), None);
        assert!(Store::new(&dir.path().join("none")).list("a").is_empty());
    }
}
