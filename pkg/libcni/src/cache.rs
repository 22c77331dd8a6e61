//! libcni's result cache: `<cacheDir>/results/<network>-<containerID>-<ifname>`
//! holding a `cniCacheV1` document, directory 0700 and file 0600. Go's
//! cnitool, containerd and `cnictl` all read and write the same files, so an
//! attachment added by one can be checked or deleted by another.

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use cni::small_file::{self, Links, Unreadable};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Error, Result};

pub const CACHE_KIND: &str = "cniCacheV1";
/// libcni's default `CacheDir`.
pub const DEFAULT_CACHE_DIR: &str = "/var/lib/cni";

/// One cached attachment, field for field as libcni writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachedAttachment {
    pub kind: String,
    #[serde(rename = "containerId")]
    pub container_id: String,
    /// The network configuration list's bytes (base64 in the file, like a
    /// Go `[]byte`).
    #[serde(with = "base64_bytes")]
    pub config: Vec<u8>,
    #[serde(rename = "ifName")]
    pub ifname: String,
    #[serde(rename = "networkName")]
    pub network_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub netns: String,
    #[serde(rename = "cniArgs", default, skip_serializing_if = "Vec::is_empty")]
    pub cni_args: Vec<[String; 2]>,
    #[serde(rename = "capabilityArgs", default, skip_serializing_if = "Map::is_empty")]
    pub capability_args: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
}

/// `unlink(2)`'s answer for a directory (`EISDIR`).
const UNLINK_OF_A_DIRECTORY: i32 = 21;
impl CachedAttachment {
    /// The namespace the attachment lives in: the `netns` libcni 1.2+
    /// records, else the `sandbox` of the attachment's interface in the
    /// cached result (libcni 1.1 and containerd 1.6 write no `netns`).
    pub fn sandbox(&self) -> Option<&str> {
        if !self.netns.is_empty() {
            return Some(&self.netns);
        }
        let interfaces = self.result.as_ref()?.get("interfaces")?.as_array()?;
        fn sandbox_of(interface: &Value) -> Option<&str> {
            interface
                .get("sandbox")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        }
        interfaces
            .iter()
            .find(|i| i.get("name").and_then(Value::as_str) == Some(self.ifname.as_str()))
            .and_then(sandbox_of)
            .or_else(|| interfaces.iter().find_map(sandbox_of))
    }
}

mod base64_bytes {
    use super::{Engine, STANDARD};
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = Option::<String>::deserialize(d)?.unwrap_or_default();
        STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}

/// Staging files of an entry are `.<entry>.<pid>.tmp`: hidden, and never
/// read as entries.
fn staging_prefix(entry: &Path) -> String {
    format!(
        ".{}.",
        entry.file_name().and_then(|n| n.to_str()).unwrap_or("entry")
    )
}

/// An entry holds a configuration list (base64: a third larger than the
/// list, itself at most [`small_file::MAX_SIZE`]) and a result.
const ENTRY_LIMIT: u64 = 2 * small_file::MAX_SIZE;

/// An entry's bytes: a regular file only, never through a link (every
/// runtime renames a regular file into place) and never blocking on
/// something else put there (a FIFO would hang a DEL for ever).
fn read_entry(path: &Path) -> Result<Vec<u8>, Unreadable> {
    small_file::read(path, Links::Refuse, ENTRY_LIMIT).map(|contents| contents.bytes)
}

/// The cache under one `CacheDir`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultCache {
    results: PathBuf,
}

impl ResultCache {
    pub fn new(cache_dir: impl AsRef<Path>) -> Self {
        ResultCache {
            results: cache_dir.as_ref().join("results"),
        }
    }

    pub fn path_of(&self, network: &str, container_id: &str, ifname: &str) -> PathBuf {
        self.results.join(format!("{network}-{container_id}-{ifname}"))
    }

    /// Writes the entry atomically (temporary file, then rename), so a
    /// reader never sees half a document.
    pub fn store(&self, entry: &CachedAttachment) -> Result<()> {
        let cache_err = |e: std::io::Error| Error::Cache(format!("{}: {e}", self.results.display()));
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.results)
            .map_err(cache_err)?;
        let target = self.path_of(&entry.network_name, &entry.container_id, &entry.ifname);
        let staging = target.with_file_name(format!("{}{}.tmp", staging_prefix(&target), std::process::id()));
        let bytes = serde_json::to_vec(entry).map_err(|e| Error::Cache(e.to_string()))?;
        // Created anew (O_EXCL never follows a link): whatever a killed
        // writer with this pid, or anyone, left at the name goes first.
        let _ = fs::remove_file(&staging);
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&staging)
            .and_then(|mut f| f.write_all(&bytes))
            .and_then(|()| fs::rename(&staging, &target));
        if written.is_err() {
            let _ = fs::remove_file(&staging);
        }
        written.map_err(cache_err)
    }

    /// The entry for an attachment, if one is cached and readable.
    pub fn load(&self, network: &str, container_id: &str, ifname: &str) -> Result<Option<CachedAttachment>> {
        let path = self.path_of(network, container_id, ifname);
        let bytes = match read_entry(&path) {
            Ok(bytes) => bytes,
            Err(Unreadable::Absent) => return Ok(None),
            Err(e) => return Err(Error::Cache(format!("{}: {e}", path.display()))),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::Cache(format!("{}: {e}", path.display())))
    }

    /// Removes the entry, and the staging files of writers of the same
    /// entry that were killed between writing and renaming.
    pub fn remove(&self, network: &str, container_id: &str, ifname: &str) -> Result<()> {
        let path = self.path_of(network, container_id, ifname);
        let prefix = staging_prefix(&path);
        for stale in fs::read_dir(&self.results).into_iter().flatten().flatten() {
            let name = stale.file_name();
            let name = name.to_string_lossy();
            let pid = name
                .strip_prefix(prefix.as_str())
                .and_then(|rest| rest.strip_suffix(".tmp"));
            if pid.is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())) {
                let _ = fs::remove_file(stale.path());
            }
        }
        // Go's os.Remove, as libcni removes it: an empty directory in the
        // entry's place goes too, so a DEL is not refused for ever.
        let removed = fs::remove_file(&path).or_else(|e| match e.raw_os_error() {
            Some(UNLINK_OF_A_DIRECTORY) => fs::remove_dir(&path),
            _ => Err(e),
        });
        match removed {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::Cache(format!("{}: {e}", path.display())))
            }
            _ => Ok(()),
        }
    }

    /// Every readable `cniCacheV1` entry of `network`, in file-name order;
    /// other files are skipped, as libcni's `GetCachedAttachments` does
    /// (a FIFO or a link among them at once).
    pub fn attachments(&self, network: &str) -> Result<Vec<CachedAttachment>> {
        let entries = match fs::read_dir(&self.results) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::Cache(format!("{}: {e}", self.results.display()))),
        };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        Ok(paths
            .iter()
            .filter_map(|p| read_entry(p).ok())
            .filter_map(|bytes| serde_json::from_slice::<CachedAttachment>(&bytes).ok())
            .filter(|a| a.kind == CACHE_KIND && !a.ifname.is_empty() && a.network_name == network)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use serde_json::json;

    use super::*;

    fn entry(id: &str, network: &str) -> CachedAttachment {
        CachedAttachment {
            kind: CACHE_KIND.into(),
            container_id: id.into(),
            config: br#"{"name":"net"}"#.to_vec(),
            ifname: "eth0".into(),
            network_name: network.into(),
            netns: "/var/run/netns/p".into(),
            cni_args: vec![["IgnoreUnknown".into(), "1".into()]],
            capability_args: Map::new(),
            result: Some(json!({"cniVersion":"1.0.0","ips":[{"address":"10.0.0.2/24"}]})),
        }
    }

    #[test]
    fn removing_an_entry_sweeps_its_killed_writers_staging_files_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ResultCache::new(dir.path());
        cache.store(&entry("c1", "net")).expect("stored");
        let results = dir.path().join("results");
        fs::write(results.join(".net-c1-eth0.4242.tmp"), "{").expect("a killed writer's file");
        fs::write(results.join(".net-c2-eth0.4243.tmp"), "{").expect("another entry's");
        fs::write(results.join(".net-c1-eth0.x-y.4244.tmp"), "{").expect("container c1-eth0.x's");
        cache.remove("net", "c1", "eth0").expect("removed");
        let mut left: Vec<String> = fs::read_dir(&results)
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, [".net-c1-eth0.x-y.4244.tmp", ".net-c2-eth0.4243.tmp"]);
    }

    #[test]
    fn writes_libcnis_layout_and_modes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ResultCache::new(dir.path());
        cache.store(&entry("c1", "net")).expect("stored");
        let file = dir.path().join("results/net-c1-eth0");
        let doc: Value = serde_json::from_slice(&fs::read(&file).expect("read")).expect("json");
        assert_eq!(doc["kind"], "cniCacheV1");
        assert_eq!(doc["containerId"], "c1");
        assert_eq!(doc["ifName"], "eth0");
        assert_eq!(doc["networkName"], "net");
        assert_eq!(doc["config"], STANDARD.encode(br#"{"name":"net"}"#));
        assert_eq!(doc["cniArgs"], json!([["IgnoreUnknown", "1"]]));
        assert!(
            doc.get("capabilityArgs").is_none(),
            "empty maps are omitted as in Go"
        );
        let mode = |p: &Path| fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode(&file), 0o600);
        assert_eq!(mode(&dir.path().join("results")), 0o700);
    }

    #[test]
    fn an_empty_directory_in_an_entrys_place_is_removed_as_go_removes_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ResultCache::new(dir.path());
        let place = dir.path().join("results/net-c1-eth0");
        fs::create_dir_all(&place).expect("an empty directory");
        cache
            .remove("net", "c1", "eth0")
            .expect("removed, as os.Remove does");
        assert!(!place.exists());
        fs::create_dir_all(place.join("full")).expect("a directory with something in it");
        assert!(cache.remove("net", "c1", "eth0").is_err(), "not emptied");
    }

    #[test]
    fn reads_back_and_removes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ResultCache::new(dir.path());
        assert_eq!(cache.load("net", "c1", "eth0").expect("no error"), None);
        cache.store(&entry("c1", "net")).expect("stored");
        assert_eq!(
            cache.load("net", "c1", "eth0").expect("read"),
            Some(entry("c1", "net"))
        );
        cache.remove("net", "c1", "eth0").expect("removed");
        cache.remove("net", "c1", "eth0").expect("removing twice is fine");
        assert_eq!(cache.load("net", "c1", "eth0").expect("no error"), None);
    }

    #[test]
    fn reads_an_entry_written_by_go() {
        // The shape Go's libcni 1.1 writes (field order, base64 config).
        let go = json!({
            "kind":"cniCacheV1","containerId":"cnitool-77383ca0a0715733ca6f",
            "config":"eyJuYW1lIjoibmV0In0=","ifName":"eth0","networkName":"net",
            "netns":"/var/run/netns/p",
            "result":{"cniVersion":"1.0.0","interfaces":[{"name":"lo","mac":"00:00:00:00:00:00","sandbox":"/var/run/netns/p"}],"ips":[{"interface":0,"address":"127.0.0.1/8"}],"dns":{}}
        });
        let dir = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(dir.path().join("results")).expect("mkdir");
        fs::write(
            dir.path().join("results/net-cnitool-77383ca0a0715733ca6f-eth0"),
            go.to_string(),
        )
        .expect("write");
        let cache = ResultCache::new(dir.path());
        let got = cache
            .load("net", "cnitool-77383ca0a0715733ca6f", "eth0")
            .expect("read")
            .expect("present");
        assert_eq!(got.config, br#"{"name":"net"}"#);
        assert!(got.cni_args.is_empty());
        assert_eq!(cache.attachments("net").expect("list").len(), 1);
    }

    #[test]
    fn the_sandbox_comes_from_netns_else_from_the_result() {
        let mut e = entry("a", "net");
        e.netns = String::new();
        e.result = Some(json!({"cniVersion": "1.0.0", "interfaces": [
            {"name": "cni0"}, {"name": "veth1"}, {"name": "eth0", "sandbox": "/proc/42/ns/net"}]}));
        assert_eq!(
            e.sandbox(),
            Some("/proc/42/ns/net"),
            "containerd 1.6 / libcni 1.1 entries"
        );
        e.netns = "/var/run/netns/p".into();
        assert_eq!(e.sandbox(), Some("/var/run/netns/p"));
        e.netns = String::new();
        e.result = Some(json!({"cniVersion": "0.2.0", "ip4": {"ip": "10.0.0.2/24"}}));
        assert_eq!(e.sandbox(), None, "nothing to tell");
    }

    #[test]
    fn lists_only_this_networks_v1_entries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ResultCache::new(dir.path());
        cache.store(&entry("b", "net")).expect("stored");
        cache.store(&entry("a", "net")).expect("stored");
        cache.store(&entry("c", "other")).expect("stored");
        fs::write(dir.path().join("results/garbage"), "{").expect("write");
        fs::write(dir.path().join("results/net-old-eth0"), r#"{"kind":"old"}"#).expect("write");
        let ids: Vec<String> = cache
            .attachments("net")
            .expect("list")
            .into_iter()
            .map(|a| a.container_id)
            .collect();
        assert_eq!(ids, ["a", "b"]);
    }

    #[test]
    fn a_fifo_or_a_link_in_the_cache_is_no_entry_and_never_blocks_or_is_written_through() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cache = ResultCache::new(dir.path());
        cache.store(&entry("a", "net")).expect("stored");
        let results = dir.path().join("results");
        let made = std::process::Command::new("mkfifo")
            .arg(results.join("net-fifo-eth0"))
            .status()
            .expect("mkfifo");
        assert!(made.success());
        std::os::unix::fs::symlink(results.join("net-a-eth0"), results.join("net-link-eth0")).expect("link");
        let victim = dir.path().join("victim");
        fs::write(&victim, "kept").expect("write");
        let staging = results.join(format!(".net-b-eth0.{}.tmp", std::process::id()));
        std::os::unix::fs::symlink(&victim, &staging).expect("link");
        let (done, outcome) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let found = (
                cache.load("net", "fifo", "eth0").map_err(|e| e.to_string()),
                cache.load("net", "link", "eth0").map_err(|e| e.to_string()),
                cache
                    .attachments("net")
                    .map(|a| a.len())
                    .map_err(|e| e.to_string()),
                cache.store(&entry("b", "net")).map_err(|e| e.to_string()),
            );
            // Gone only when the test timed out already.
            let _ = done.send(found);
        });
        let (fifo, link, listed, stored) = outcome
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("returned without blocking");
        assert!(fifo.expect_err("a FIFO").contains("FIFO"));
        assert!(link.expect_err("a link").contains("symbolic link"));
        assert_eq!(listed, Ok(1), "only the real entry");
        stored.expect("stored");
        assert_eq!(fs::read(&victim).expect("read"), b"kept", "not written through");
    }
}
