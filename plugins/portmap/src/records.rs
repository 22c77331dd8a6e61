//! What ADD published, per container, so a later ADD can tell whether the
//! pod holding a host port still runs: `<stateDir>/<network>/<containerID>`
//! (`stateDir`, default `/run/cni/portmap`: tmpfs, gone at reboot with
//! every network namespace). A record names the node's network namespace
//! (the rules live there; other nodes' records on one machine are not
//! looked at) and the pod's, by path and by device and inode: the holder
//! runs while that path still opens that namespace.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::rules::{Mapping, Protocol};
use podnet::state_file::{self, Unreadable};
use serde::{Deserialize, Serialize};

pub const DEFAULT_STATE_DIR: &str = "/run/cni/portmap";

/// A namespace as a file: path, device, inode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Namespace {
    pub path: PathBuf,
    pub dev: u64,
    pub ino: u64,
}

impl Namespace {
    pub fn of(path: &Path) -> std::io::Result<Self> {
        let meta = fs::metadata(path)?;
        Ok(Namespace {
            path: path.to_owned(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    /// The calling thread's network namespace.
    pub fn current() -> std::io::Result<Self> {
        let meta = fs::metadata("/proc/thread-self/ns/net")?;
        Ok(Namespace {
            path: PathBuf::from("/proc/thread-self/ns/net"),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    fn same_as(&self, other: &Namespace) -> bool {
        (self.dev, self.ino) == (other.dev, other.ino)
    }

    /// Whether the path still opens the namespace recorded.
    pub fn alive(&self) -> bool {
        Namespace::of(&self.path).is_ok_and(|now| now.same_as(self))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Published {
    pub host_port: u16,
    pub protocol: String,
    pub host_ip: Option<std::net::IpAddr>,
}

impl Published {
    fn of(mapping: &Mapping) -> Self {
        Published {
            host_port: mapping.host_port,
            protocol: mapping.protocol.name().to_owned(),
            host_ip: mapping.host_ip,
        }
    }

    /// Both receive the same packets: same port and protocol, and a host
    /// IP that is unset, unspecified or equal on either side.
    pub fn overlaps(&self, mapping: &Mapping) -> bool {
        let any = |ip: Option<std::net::IpAddr>| ip.is_none_or(|ip| ip.is_unspecified());
        self.host_port == mapping.host_port
            && Protocol::parse(&self.protocol).is_ok_and(|p| p == mapping.protocol)
            && (any(self.host_ip) || any(mapping.host_ip) || self.host_ip == mapping.host_ip)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub network: String,
    pub container_id: String,
    pub node: Namespace,
    pub pod: Namespace,
    pub mappings: Vec<Published>,
}

impl Record {
    pub fn new(
        network: &str,
        container_id: &str,
        node: Namespace,
        pod: Namespace,
        mappings: &[Mapping],
    ) -> Self {
        Record {
            network: network.to_owned(),
            container_id: container_id.to_owned(),
            node,
            pod,
            mappings: mappings.iter().map(Published::of).collect(),
        }
    }

    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        state_file::write_whole(
            dir,
            &self.network,
            &state_file::name_for(&self.container_id),
            &bytes,
        )
    }

    /// The records of this node, every network. What is not a record (a
    /// FIFO, a link, an oversized or malformed file: nothing ADD writes)
    /// is skipped with a log line, so junk in the directory neither fails
    /// nor holds an ADD. A file that may be a record but could not be read
    /// is an error: a host port it holds would go unseen.
    pub fn all(dir: &Path, node: &Namespace) -> std::io::Result<Vec<Record>> {
        let mut records = Vec::new();
        for entry in state_file::all_entries(dir)? {
            let place = || dir.join(&entry.network).join(&entry.name);
            let bytes = match entry.contents {
                Ok(bytes) => bytes,
                Err(Unreadable::Absent) => continue,
                Err(e) if e.is_not_a_file() => {
                    log::warn!("skipping {}: {e}", place().display());
                    continue;
                }
                Err(e) => return Err(std::io::Error::other(format!("{}: {e}", place().display()))),
            };
            match serde_json::from_slice::<Record>(&bytes) {
                Ok(record)
                    if record.network != entry.network
                        || state_file::name_for(&record.container_id) != entry.name =>
                {
                    log::warn!("skipping {}: a record of another place", place().display());
                }
                Ok(record) if record.node.same_as(node) => records.push(record),
                Ok(_) => {}
                Err(e) => log::warn!("skipping {}: not a record: {e}", place().display()),
            }
        }
        Ok(records)
    }
}

/// Removes a container's record; a missing one is fine.
pub fn remove(dir: &Path, network: &str, container_id: &str) -> std::io::Result<()> {
    state_file::remove_if_present(dir, network, &state_file::name_for(container_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(port: u16, protocol: Protocol, host_ip: Option<&str>) -> Mapping {
        Mapping {
            host_port: port,
            container_port: 80,
            protocol,
            host_ip: host_ip.map(|ip| ip.parse().expect("ip")),
        }
    }

    #[test]
    fn mappings_overlap_on_port_protocol_and_any_or_equal_host_ip() {
        let held = Published::of(&mapping(8080, Protocol::Tcp, Some("10.0.0.1")));
        assert!(held.overlaps(&mapping(8080, Protocol::Tcp, None)));
        assert!(held.overlaps(&mapping(8080, Protocol::Tcp, Some("0.0.0.0"))));
        assert!(held.overlaps(&mapping(8080, Protocol::Tcp, Some("10.0.0.1"))));
        assert!(!held.overlaps(&mapping(8080, Protocol::Tcp, Some("10.0.0.2"))));
        assert!(!held.overlaps(&mapping(8080, Protocol::Udp, None)));
        assert!(!held.overlaps(&mapping(8081, Protocol::Tcp, None)));
    }

    #[test]
    fn records_are_kept_per_node_and_tell_a_live_namespace() {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = Namespace::current().expect("own namespace");
        let other_node = Namespace {
            ino: node.ino + 1,
            ..node.clone()
        };
        let pod_file = dir.path().join("pod");
        fs::write(&pod_file, "").expect("write");
        let pod = Namespace::of(&pod_file).expect("stat");
        let maps = [mapping(8080, Protocol::Tcp, None)];
        Record::new("net", "a", node.clone(), pod.clone(), &maps)
            .save(dir.path())
            .expect("saved");
        Record::new("net", "b", other_node, pod.clone(), &maps)
            .save(dir.path())
            .expect("saved");
        let mine = Record::all(dir.path(), &node).expect("read");
        assert_eq!(mine.len(), 1);
        assert_eq!(mine[0].container_id, "a");
        assert!(mine[0].pod.alive());
        fs::remove_file(&pod_file).expect("rm");
        fs::write(&pod_file, "").expect("a new file at the same path");
        assert!(!mine[0].pod.alive() || Namespace::of(&pod_file).is_ok_and(|n| n.ino == pod.ino));
        remove(dir.path(), "net", "a").expect("removed");
        remove(dir.path(), "net", "a").expect("twice");
        assert!(Record::all(dir.path(), &node).expect("read").is_empty());
    }

    #[test]
    fn what_is_not_a_record_is_skipped_at_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = Namespace::current().expect("own namespace");
        let pod = Namespace::current().expect("a namespace");
        let maps = [mapping(8080, Protocol::Tcp, None)];
        let record = Record::new("net", "a", node.clone(), pod, &maps);
        record.save(dir.path()).expect("saved");
        let net = dir.path().join("net");
        let made = std::process::Command::new("mkfifo")
            .arg(net.join("fifo"))
            .status()
            .expect("mkfifo");
        assert!(made.success());
        std::os::unix::fs::symlink(net.join("a"), net.join("link")).expect("link");
        fs::write(net.join("junk"), "{").expect("write");
        let elsewhere = Record {
            container_id: "b".to_owned(),
            ..record.clone()
        };
        fs::write(net.join("moved"), serde_json::to_vec(&elsewhere).expect("JSON")).expect("write");
        let (done, outcome) = std::sync::mpsc::channel();
        let path = dir.path().to_owned();
        std::thread::spawn(move || {
            // Gone only when the test timed out already.
            let _ = done.send(Record::all(&path, &node).map_err(|e| e.to_string()));
        });
        let found = outcome
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("returned without blocking")
            .expect("junk is no error");
        assert_eq!(found, [record]);
    }
}
