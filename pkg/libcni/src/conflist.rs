//! Network configuration lists, loaded and version-selected as libcni does.

use std::cmp::Ordering;
use std::fs;
use std::path::{Path, PathBuf};

use cni::env::validate_network_name;
use cni::exec::validate_plugin_type;
use cni::small_file::{self, Links};
use serde_json::{Map, Value};

use crate::{Error, Result};

/// The newest spec version this runtime speaks; `cniVersions` entries above
/// it are skipped, as libcni skips those above its own.
const RUNTIME_VERSION: cni::Version = cni::Version::LATEST;

#[derive(Debug, Clone, PartialEq)]
pub struct NetworkConfigList {
    pub name: String,
    /// The version chosen from `cniVersion` and `cniVersions`; what every
    /// plugin receives. Empty when the file names none (plugins read that as
    /// 0.1.0).
    pub cni_version: String,
    pub disable_check: bool,
    pub disable_gc: bool,
    pub plugins: Vec<PluginConf>,
    /// The file's bytes, stored base64 in the result cache as libcni does.
    pub bytes: Vec<u8>,
}

/// One plugin entry of a list, kept as the JSON object it is.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginConf {
    pub plugin_type: String,
    pub raw: Map<String, Value>,
}

impl PluginConf {
    /// Whether the entry declares `name` (libcni reads an entry's
    /// `capabilities` and `type` through Go's `types.NetConf`, so in any
    /// case; the capability names themselves are map keys, exact).
    pub fn capability(&self, name: &str) -> bool {
        cni::keys::get(&self.raw, "capabilities")
            .and_then(|c| c.get(name))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }
}

fn list_error(msg: impl std::fmt::Display) -> Error {
    Error::Config(format!("error parsing configuration list: {msg}"))
}

/// `MAJOR.MINOR.PATCH` with numeric parts, enough to order spec versions.
fn parse_semver(s: &str) -> Option<(u64, u64, u64)> {
    let mut parts = s.split('.').map(|p| p.parse::<u64>().ok());
    let version = (parts.next()??, parts.next()??, parts.next()??);
    parts.next().is_none().then_some(version)
}

/// Compares two spec versions; an empty one counts as 0.1.0, as plugins read
/// it.
pub fn compare_versions(a: &str, b: &str) -> Option<Ordering> {
    let parse = |s: &str| {
        if s.is_empty() {
            Some((0, 1, 0))
        } else {
            parse_semver(s)
        }
    };
    Some(parse(a)?.cmp(&parse(b)?))
}

/// `version >= floor`; unparsable versions answer false.
pub fn version_at_least(version: &str, floor: cni::Version) -> bool {
    compare_versions(version, floor.as_str()).is_some_and(|o| o != Ordering::Less)
}

fn read_bool(list: &Map<String, Value>, key: &str) -> Result<bool> {
    match list.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(true),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(false),
        Some(Value::String(s)) => Err(list_error(format!("invalid {key} value {s:?}"))),
        Some(other) => Err(list_error(format!("invalid {key} type {other}"))),
    }
}

/// libcni ≥ 1.2: the highest of `cniVersions` ∪ {`cniVersion`} that this
/// runtime speaks.
fn select_version(list: &Map<String, Value>) -> Result<String> {
    let declared = match list.get("cniVersion") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => return Err(list_error(format!("invalid cniVersion {other}"))),
    };
    let Some(versions) = list.get("cniVersions") else {
        return Ok(declared);
    };
    let Value::Array(entries) = versions else {
        return Err(list_error("invalid type for cniVersions"));
    };
    let mut candidates = Vec::with_capacity(entries.len() + 1);
    for (i, entry) in entries.iter().enumerate() {
        let Value::String(v) = entry else {
            return Err(list_error(format!("invalid type for cniVersions index {i}")));
        };
        candidates.push((v.clone(), format!("invalid cniVersions entry {v} at index {i}")));
    }
    if !declared.is_empty() {
        candidates.push((declared.clone(), format!("invalid cniVersion {declared}")));
    }
    let mut usable = Vec::new();
    for (v, complaint) in candidates {
        match compare_versions(&v, RUNTIME_VERSION.as_str()) {
            None => return Err(list_error(complaint)),
            Some(Ordering::Greater) => {}
            Some(_) => usable.push(v),
        }
    }
    usable.sort_by(|a, b| compare_versions(a, b).unwrap_or(Ordering::Equal));
    Ok(usable.pop().unwrap_or(declared))
}

fn plugin_from(index: usize, value: &Value) -> Result<PluginConf> {
    let Value::Object(raw) = value else {
        return Err(Error::Config(format!(
            "failed to parse plugin config {index}: not an object"
        )));
    };
    let plugin_type = match cni::keys::get(raw, "type") {
        Some(Value::String(t)) if !t.is_empty() => t.clone(),
        _ => {
            return Err(Error::Config(format!(
                "failed to parse plugin config {index}: error parsing configuration: missing 'type'"
            )));
        }
    };
    validate_plugin_type(&plugin_type)
        .map_err(|e| Error::Config(format!("failed to parse plugin config {index}: {}", e.msg)))?;
    Ok(PluginConf {
        plugin_type,
        raw: raw.clone(),
    })
}

fn parse_object(bytes: &[u8], what: &str) -> Result<Map<String, Value>> {
    match serde_json::from_slice(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Error::Config(format!("error parsing {what}: not a JSON object"))),
        Err(e) => Err(Error::Config(format!("error parsing {what}: {e}"))),
    }
}

fn network_name(map: &Map<String, Value>, what: &str) -> Result<String> {
    let name = match map.get("name") {
        Some(Value::String(n)) => n.clone(),
        _ => return Err(Error::Config(format!("error parsing {what}: no name"))),
    };
    validate_network_name(&name).map_err(Error::Invalid)?;
    Ok(name)
}

impl NetworkConfigList {
    /// Parses a `.conflist` document.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let list = parse_object(bytes, "configuration list")?;
        let name = network_name(&list, "configuration list")?;
        let cni_version = select_version(&list)?;
        let plugins = match list.get("plugins") {
            None => return Err(list_error("no 'plugins' key")),
            Some(Value::Array(items)) if items.is_empty() => {
                return Err(list_error("no plugins in list"));
            }
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| plugin_from(i, v))
                .collect::<Result<Vec<_>>>()?,
            Some(_) => return Err(list_error("invalid 'plugins' type")),
        };
        Ok(NetworkConfigList {
            name,
            cni_version,
            disable_check: read_bool(&list, "disableCheck")?,
            disable_gc: read_bool(&list, "disableGC")?,
            plugins,
            bytes: bytes.to_vec(),
        })
    }

    /// Wraps a single-plugin `.conf` into a one-plugin list, as libcni's
    /// `ConfListFromConf` does.
    pub fn from_single_conf(bytes: &[u8]) -> Result<Self> {
        let conf = parse_object(bytes, "configuration")?;
        let name = network_name(&conf, "configuration")?;
        let plugin = plugin_from(0, &Value::Object(conf.clone()))?;
        let cni_version = conf
            .get("cniVersion")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let list = serde_json::json!({
            "cniVersion": cni_version,
            "name": name,
            "plugins": [Value::Object(conf)],
        });
        let bytes = serde_json::to_vec(&list).map_err(|e| Error::Config(e.to_string()))?;
        Ok(NetworkConfigList {
            name,
            cni_version,
            disable_check: false,
            disable_gc: false,
            plugins: vec![plugin],
            bytes,
        })
    }

    /// The first list named `name` in `dir`: `.conflist` files first, then
    /// `.conf` and `.json`, each group in file-name order (libcni's
    /// `LoadConfList`). Unreadable files are skipped and named in the
    /// not-found error rather than hiding every other network.
    pub fn load(dir: &Path, name: &str) -> Result<Self> {
        let mut skipped = Vec::new();
        type Parser = fn(&[u8]) -> Result<NetworkConfigList>;
        let groups: [(&[&str], Parser); 2] = [
            (&["conflist"], NetworkConfigList::from_bytes),
            (&["conf", "json"], NetworkConfigList::from_single_conf),
        ];
        for (extensions, parse) in groups {
            for file in conf_files(dir, extensions)? {
                // Followed if a link, as libcni follows it; but never
                // blocking on a FIFO swapped in after the listing.
                let parsed = small_file::read(&file, Links::Follow, small_file::MAX_SIZE)
                    .map_err(|e| Error::Config(e.to_string()))
                    .and_then(|contents| parse(&contents.bytes));
                match parsed {
                    Ok(list) if list.name == name => return Ok(list),
                    Ok(_) => {}
                    Err(e) => skipped.push(format!("{}: {e}", file.display())),
                }
            }
        }
        Err(Error::NotFound {
            name: name.to_owned(),
            dir: dir.display().to_string(),
            skipped: if skipped.is_empty() {
                String::new()
            } else {
                format!(" (skipped unreadable files: {})", skipped.join("; "))
            },
        })
    }
}

/// Regular files in `dir` with one of `extensions`, sorted by name.
pub fn conf_files(dir: &Path, extensions: &[&str]) -> Result<Vec<PathBuf>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::Config(format!("cannot read {}: {e}", dir.display()))),
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| extensions.contains(&e))
        })
        .collect();
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn list(doc: Value) -> Result<NetworkConfigList> {
        NetworkConfigList::from_bytes(doc.to_string().as_bytes())
    }

    #[test]
    fn reads_a_list() {
        let l = list(json!({"cniVersion":"1.0.0","name":"n","disableCheck":"TRUE",
            "plugins":[{"type":"bridge","capabilities":{"mac":true}},{"type":"portmap"}]}))
        .expect("valid");
        assert_eq!(l.cni_version, "1.0.0");
        assert!(l.disable_check);
        assert!(!l.disable_gc);
        assert_eq!(l.plugins.len(), 2);
        assert!(l.plugins[0].capability("mac"));
        assert!(!l.plugins[1].capability("mac"));
    }

    #[test]
    fn entries_are_read_as_go_reads_them_and_the_list_exactly() {
        let l = list(json!({"cniVersion":"1.0.0","name":"n",
            "plugins":[{"Type":"bridge","Capabilities":{"mac":true}}]}))
        .expect("an entry's type and capabilities in any case");
        assert_eq!(l.plugins[0].plugin_type, "bridge");
        assert!(l.plugins[0].capability("mac"));
        assert!(!l.plugins[0].capability("MAC"), "capability names are exact");
        let err = list(json!({"cniVersion":"1.0.0","name":"n","Plugins":[{"type":"bridge"}]}))
            .expect_err("libcni reads `plugins` exactly");
        assert!(err.to_string().contains("plugins"), "{err}");
    }

    #[test]
    fn refuses_broken_lists_with_libcnis_messages() {
        let cases = [
            (json!({"plugins":[{"type":"x"}]}), "no name"),
            (json!({"name":"n"}), "no 'plugins' key"),
            (json!({"name":"n","plugins":[]}), "no plugins in list"),
            (json!({"name":"n","plugins":[{"name":"x"}]}), "missing 'type'"),
            (
                json!({"name":"n","plugins":[{"type":"../x"}]}),
                "invalid plugin type",
            ),
            (
                json!({"name":"n","disableCheck":"maybe","plugins":[{"type":"x"}]}),
                "invalid disableCheck value",
            ),
            (
                json!({"name":"n","cniVersions":"1.0.0","plugins":[{"type":"x"}]}),
                "invalid type for cniVersions",
            ),
            (
                json!({"name":"n","cniVersions":["one"],"plugins":[{"type":"x"}]}),
                "invalid cniVersions entry one at index 0",
            ),
        ];
        for (doc, msg) in cases {
            let err = list(doc.clone()).expect_err("invalid");
            assert!(err.to_string().contains(msg), "{doc}: {err}");
        }
        let err = list(json!({"name":"a b","plugins":[{"type":"x"}]})).expect_err("bad name");
        assert!(matches!(err, Error::Invalid(_)));
    }

    #[test]
    fn picks_the_highest_version_this_runtime_speaks() {
        let pick = |doc: Value| list(doc).expect("valid").cni_version;
        let plugins = json!([{"type":"x"}]);
        assert_eq!(
            pick(json!({"name":"n","cniVersion":"1.0.0","cniVersions":["0.4.0","1.1.0"],"plugins":plugins})),
            "1.1.0"
        );
        assert_eq!(
            pick(json!({"name":"n","cniVersion":"1.0.0","cniVersions":["1.1.0","9.0.0"],"plugins":plugins})),
            "1.1.0"
        );
        assert_eq!(
            pick(json!({"name":"n","cniVersion":"1.0.0","cniVersions":["0.3.1"],"plugins":plugins})),
            "1.0.0"
        );
        assert_eq!(
            pick(json!({"name":"n","cniVersions":["0.3.1","0.4.0"],"plugins":plugins})),
            "0.4.0"
        );
        assert_eq!(pick(json!({"name":"n","plugins":plugins})), "");
    }

    #[test]
    fn version_comparison() {
        assert!(version_at_least("0.4.0", cni::Version::V0_4_0));
        assert!(version_at_least("1.0.0", cni::Version::V0_4_0));
        assert!(!version_at_least("0.3.1", cni::Version::V0_4_0));
        assert!(!version_at_least("", cni::Version::V0_4_0));
        assert!(!version_at_least("x", cni::Version::V0_1_0));
        assert_eq!(compare_versions("0.10.0", "0.9.0"), Some(Ordering::Greater));
    }

    #[test]
    fn wraps_a_single_conf() {
        let l = NetworkConfigList::from_single_conf(
            br#"{"cniVersion":"0.3.1","name":"single","type":"loopback"}"#,
        )
        .expect("valid");
        assert_eq!((l.name.as_str(), l.cni_version.as_str()), ("single", "0.3.1"));
        assert_eq!(l.plugins[0].plugin_type, "loopback");
        let reparsed = NetworkConfigList::from_bytes(&l.bytes).expect("the wrapped bytes are a list");
        assert_eq!(reparsed.plugins, l.plugins);
    }

    #[test]
    fn loads_conflists_first_then_confs_in_name_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let write =
            |name: &str, doc: Value| fs::write(dir.path().join(name), doc.to_string()).expect("write");
        write(
            "20-b.conflist",
            json!({"cniVersion":"1.0.0","name":"net","plugins":[{"type":"second"}]}),
        );
        write(
            "10-a.conflist",
            json!({"cniVersion":"1.0.0","name":"net","plugins":[{"type":"first"}]}),
        );
        write(
            "00-z.conf",
            json!({"cniVersion":"1.0.0","name":"net","type":"conf-loses"}),
        );
        write(
            "05-only.json",
            json!({"cniVersion":"0.4.0","name":"other","type":"from-json"}),
        );
        fs::write(dir.path().join("01-broken.conflist"), "{").expect("write");
        fs::write(dir.path().join("README.txt"), "ignored").expect("write");
        let l = NetworkConfigList::load(dir.path(), "net").expect("found");
        assert_eq!(l.plugins[0].plugin_type, "first");
        let l = NetworkConfigList::load(dir.path(), "other").expect("found");
        assert_eq!(l.plugins[0].plugin_type, "from-json");
        let err = NetworkConfigList::load(dir.path(), "absent").expect_err("absent");
        let msg = err.to_string();
        assert!(msg.contains("no network configuration named \"absent\""), "{msg}");
        assert!(
            msg.contains("01-broken.conflist"),
            "broken files are named: {msg}"
        );
        assert!(NetworkConfigList::load(Path::new("/nonexistent"), "x").is_err());
    }
}
