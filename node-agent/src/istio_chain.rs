//! Istio's chained install, done by the agent (`ISTIO_CHAINED`): the
//! node's primary network configuration gets `istio-redirect` as its last
//! plugin, whoever wrote that file, and gets it back whenever another
//! agent rewrites the file.
//!
//! As Istio's installer does it: the primary file is the first valid
//! `.conf` or `.conflist` of the directory in name order (or the one
//! named by `ISTIO_CNI_CONF_FILE`); an older entry of ours is replaced; a
//! bare `.conf` is wrapped into a `.conflist` (network `k8s-pod-network`)
//! written beside it, and the `.conf` removed; the file is replaced
//! atomically and keeps its mode; uninstall removes only our entry.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::Error;
use crate::conflist::write_if_changed;

/// The plugin type of our entry; entries of that type are ours to replace.
const TYPE: &str = "istio-redirect";
/// The network a wrapped bare `.conf` is given, as Istio names it.
const WRAPPED_NAME: &str = "k8s-pod-network";

/// The entry appended: `ISTIO_PLUGIN_CONFIG`, else the capability that
/// hands the plugin the pod's annotations, skipping the control plane's
/// namespaces.
pub fn entry(setting: Option<&str>) -> Result<Value, Error> {
    let Some(text) = setting else {
        return Ok(json!({
            "type": TYPE,
            "capabilities": {"io.kubernetes.cri.pod-annotations": true},
            "exclude_namespaces": ["kube-system", "istio-system"],
        }));
    };
    let value: Value = serde_json::from_str(text)
        .map_err(|e| Error::Setting(format!("ISTIO_PLUGIN_CONFIG is not JSON: {e}")))?;
    if value["type"] != TYPE {
        return Err(Error::Setting(format!(
            "ISTIO_PLUGIN_CONFIG must be an object whose \"type\" is \"{TYPE}\""
        )));
    }
    Ok(value)
}

/// A configuration file's content, if it is a valid one: a list with
/// plugins, or a single plugin with a type.
fn parse(path: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(path).ok()?;
    let value: Value = serde_json::from_str(&text).ok()?;
    let valid = match path.extension()?.to_str()? {
        "conflist" => value["plugins"].as_array().is_some_and(|p| !p.is_empty()),
        "conf" => value["type"].is_string(),
        _ => false,
    };
    valid.then_some(value)
}

/// The primary configuration of `dir`: `named`, else the first valid
/// `.conf`/`.conflist` in name order (empty and invalid files skipped, as
/// Istio's installer and libcni skip them).
pub fn primary(dir: &Path, named: Option<&str>) -> Option<PathBuf> {
    if let Some(name) = named {
        let path = dir.join(name);
        return parse(&path).is_some().then_some(path);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with('.'))
        })
        .collect();
    files.sort();
    files.into_iter().find(|p| parse(p).is_some())
}

/// Whether `path` ends with exactly `entry` and has no other of ours.
pub fn in_place(path: &Path, entry: &Value) -> bool {
    parse(path).is_some_and(|conf| {
        let plugins = conf["plugins"].as_array().cloned().unwrap_or_default();
        plugins.last() == Some(entry) && plugins.iter().filter(|p| p["type"] == TYPE).count() == 1
    })
}

/// Makes `path` end with `entry` (replacing entries of ours); returns the
/// file that now holds it (a bare `.conf` becomes a `.conflist`).
pub fn insert(path: &Path, entry: &Value) -> Result<PathBuf, Error> {
    let conf =
        parse(path).ok_or_else(|| Error::Io(format!("{} is no valid CNI configuration", path.display())))?;
    let is_list = path.extension().is_some_and(|e| e == "conflist");
    let (mut list, target) = if is_list {
        (conf, path.to_path_buf())
    } else {
        let wrapped = json!({
            "cniVersion": conf["cniVersion"].clone(),
            "name": WRAPPED_NAME,
            "plugins": [conf],
        });
        (wrapped, path.with_extension("conflist"))
    };
    let mut plugins: Vec<Value> = list["plugins"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p["type"] != TYPE)
        .collect();
    plugins.push(entry.clone());
    list["plugins"] = Value::Array(plugins);
    write_if_changed(&target, &list)?;
    if !is_list {
        std::fs::remove_file(path)
            .map_err(|e| Error::Io(format!("cannot remove {}: {e}", path.display())))?;
    }
    Ok(target)
}

/// Removes our entries from `path`, leaving the rest; whether there were any.
pub fn remove(path: &Path) -> Result<bool, Error> {
    let Some(mut conf) = parse(path) else {
        return Ok(false);
    };
    let Some(plugins) = conf["plugins"].as_array() else {
        return Ok(false);
    };
    let kept: Vec<Value> = plugins.iter().filter(|p| p["type"] != TYPE).cloned().collect();
    if kept.len() == plugins.len() {
        return Ok(false);
    }
    conf["plugins"] = Value::Array(kept);
    write_if_changed(path, &conf)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn kindnet() -> Value {
        json!({"cniVersion": "0.3.1", "name": "kindnet", "plugins": [
            {"type": "ptp", "ipMasq": false, "ipam": {"type": "host-local", "dataDir": "/run/cni-ipam-state",
             "ranges": [[{"subnet": "10.244.1.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}, "mtu": 1500},
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]})
    }

    fn minikube() -> Value {
        json!({"cniVersion": "0.4.0", "name": "bridge", "plugins": [
            {"type": "bridge", "bridge": "bridge", "isDefaultGateway": true, "ipMasq": true, "hairpinMode": true,
             "ipam": {"type": "host-local", "subnet": "10.244.0.0/16"}},
            {"type": "portmap", "capabilities": {"portMappings": true}},
            {"type": "firewall"}
        ]})
    }

    fn write(path: &Path, value: &Value, mode: u32) {
        std::fs::write(path, value.to_string()).expect("write");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    fn read(path: &Path) -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("JSON")
    }

    #[test]
    fn appended_last_to_kindnets_and_minikubes_lists_and_removed_cleanly() {
        let ours = entry(None).expect("entry");
        for (name, original) in [("10-kindnet.conflist", kindnet()), ("1-k8s.conflist", minikube())] {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join(name);
            write(&path, &original, 0o600);
            std::fs::write(dir.path().join("00-empty.conflist"), "").expect("an empty file");
            std::fs::write(dir.path().join("05-broken.conf"), "{").expect("an invalid file");
            assert_eq!(primary(dir.path(), None), Some(path.clone()), "{name}");
            assert!(!in_place(&path, &ours));
            assert_eq!(insert(&path, &ours).expect("insert"), path);
            assert!(in_place(&path, &ours));
            let chained = read(&path);
            let plugins = chained["plugins"].as_array().expect("plugins");
            assert_eq!(
                plugins.len(),
                original["plugins"].as_array().map_or(0, Vec::len) + 1
            );
            assert_eq!(plugins.last(), Some(&ours));
            let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "the file keeps its mode");
            // An older entry of ours is replaced, not doubled.
            let newer = json!({"type": TYPE, "plugin_log_level": "debug"});
            insert(&path, &newer).expect("again");
            assert!(in_place(&path, &newer));
            assert!(remove(&path).expect("remove"));
            assert_eq!(read(&path), original, "the rest of the file unchanged");
            assert!(!remove(&path).expect("nothing left"));
        }
    }

    #[test]
    fn a_bare_conf_is_wrapped_into_a_conflist() {
        let dir = tempfile::tempdir().expect("tempdir");
        let conf = json!({"cniVersion": "0.4.0", "name": "mynet", "type": "bridge", "bridge": "cni0",
                          "ipam": {"type": "host-local", "subnet": "10.22.0.0/16"}});
        let path = dir.path().join("10-mynet.conf");
        write(&path, &conf, 0o644);
        let ours = entry(None).expect("entry");
        let written = insert(&path, &ours).expect("insert");
        assert_eq!(written, dir.path().join("10-mynet.conflist"));
        assert!(!path.exists(), "the bare .conf is replaced by the list");
        let list = read(&written);
        assert_eq!(list["name"], WRAPPED_NAME);
        assert_eq!(list["cniVersion"], "0.4.0");
        assert_eq!(list["plugins"], json!([conf, ours]));
        assert_eq!(primary(dir.path(), None), Some(written));
    }

    #[test]
    fn the_entry_setting_must_be_ours() {
        assert_eq!(entry(None).expect("default")["type"], TYPE);
        let set = entry(Some(
            r#"{"type":"istio-redirect","redirect":{"interceptionMode":"REDIRECT"}}"#,
        ))
        .expect("set");
        assert_eq!(set["redirect"]["interceptionMode"], "REDIRECT");
        for bad in ["[]", "{}", r#"{"type":"portmap"}"#, "not json"] {
            assert!(entry(Some(bad)).is_err(), "{bad}");
        }
    }
}
