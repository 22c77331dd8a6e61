//! Istio's chained install, done by the agent (`ISTIO_CHAINED`): the
//! node's primary network configuration gets `istio-redirect` as its last
//! plugin, whoever wrote that file, and gets it back whenever another
//! agent rewrites the file.
//!
//! As Istio's installer does it: the primary file is the first valid
//! `.conf` or `.conflist` of the directory in name order (or the one
//! named by `ISTIO_CNI_CONF_FILE`, followed to the `.conflist` a wrap
//! made of it); an older entry of ours is replaced; a bare `.conf` is
//! wrapped into a `.conflist` written beside it, and the `.conf` removed;
//! the file is replaced atomically and keeps its mode. Unlike Istio's
//! installer, the wrap keeps the `.conf`'s network name: runtimes ran the
//! `.conf` as a list of that name, and host-local keys leases by it, so
//! Istio's `k8s-pod-network` hands new pods addresses from an empty lease
//! store while running pods hold them. Every file chained, and every
//! `.conf` wrapped with its bytes, is recorded on the node
//! ([`crate::record`]) before it is changed; uninstall takes the entry out
//! of each and puts a wrapped `.conf` back as it was.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::atomic::{mode_of, read_text, replace_file};
use crate::conf_dir::{render_text, without_log_socket, write_if_changed};
use crate::error::Error;
use crate::record::Wrapped;

/// The plugin type of our entry; entries of that type are ours to replace.
const TYPE: &str = "istio-redirect";

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

/// Whether the runtime reads `path` as a list (`.conflist`); a `.conf`
/// or `.json` it reads as a single plugin and runs as a list of one, as
/// containerd's and CRI-O's libcni do.
fn is_list(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "conflist")
}

/// A configuration file's content, if it is a valid one: a list with
/// plugins, or a single plugin with a type.
fn parse(path: &Path) -> Option<Value> {
    let value: Value = serde_json::from_str(&read_text(path).ok()?).ok()?;
    let valid = match path.extension()?.to_str()? {
        "conflist" => value["plugins"].as_array().is_some_and(|p| !p.is_empty()),
        "conf" | "json" => value["type"].is_string(),
        _ => false,
    };
    valid.then_some(value)
}

/// Where a change to the configuration at `path` is written: through a
/// link to the file it names (the link is someone's way of keeping the
/// configuration elsewhere, and must keep pointing there), else `path`.
fn write_target(path: &Path) -> PathBuf {
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    is_link
        .then(|| std::fs::canonicalize(path).ok())
        .flatten()
        .unwrap_or_else(|| path.to_path_buf())
}

/// The primary configuration of `dir`: `named`, else the first valid
/// `.conf`/`.conflist`/`.json` in name order but `skip` (the agent's own
/// file in Istio's owned mode), empty and invalid files skipped, as
/// libcni skips them; Istio's installer overlooks `.json`, which runtimes
/// load. A named bare file that a wrap replaced is followed to its
/// `.conflist`, as Istio's installer follows it.
pub fn primary(dir: &Path, named: Option<&str>, skip: Option<&Path>) -> Option<PathBuf> {
    if let Some(name) = named {
        let path = dir.join(name);
        if parse(&path).is_some() {
            return Some(path);
        }
        let list = path.with_extension("conflist");
        return (!is_list(&path) && parse(&list).is_some()).then_some(list);
    }
    crate::conf_dir::files(dir)
        .into_iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with('.'))
        })
        .filter(|p| Some(p.as_path()) != skip)
        .find(|p| parse(p).is_some())
}

/// The file the runtime uses: the first valid one in name order.
pub fn runtimes_choice(dir: &Path) -> Option<PathBuf> {
    primary(dir, None, None)
}

/// Whether `path` ends with exactly `entry` and has no other of ours.
pub fn in_place(path: &Path, entry: &Value) -> bool {
    parse(path).is_some_and(|conf| {
        let plugins = conf["plugins"].as_array().cloned().unwrap_or_default();
        plugins.last() == Some(entry) && plugins.iter().filter(|p| p["type"] == TYPE).count() == 1
    })
}

/// The list a bare `.conf` is run as (libcni's conversion): its version
/// and its network name.
fn wrap(conf: &Value) -> Value {
    let mut list = json!({"name": conf["name"].clone(), "plugins": [conf.clone()]});
    if let Some(version) = conf.get("cniVersion") {
        list["cniVersion"] = version.clone();
    }
    list
}

/// `list` without our entries.
fn without_ours(list: &Value) -> Value {
    let mut rest = list.clone();
    let kept: Vec<Value> = list["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["type"] != TYPE)
        .cloned()
        .collect();
    rest["plugins"] = Value::Array(kept);
    rest
}

/// What chaining a file writes, decided before anything is written so
/// that it can be recorded first.
#[derive(Debug)]
pub struct Plan {
    /// The file that will hold the entry (a bare `.conf`'s list).
    pub target: PathBuf,
    text: String,
    mode: u32,
    /// The bare `.conf` replaced by `target`, as it was.
    pub wrapped: Option<Wrapped>,
}

/// Plans making `path` end with `entry` (replacing entries of ours).
pub fn plan(path: &Path, entry: &Value) -> Result<Plan, Error> {
    let invalid = || Error::Io(format!("{} is no valid CNI configuration", path.display()));
    let text = read_text(path).map_err(|_| invalid())?;
    let mode = mode_of(path).unwrap_or(0o644);
    let (target, wrapped) = if is_list(path) {
        (write_target(path), None)
    } else {
        let wrapped = Wrapped {
            conf: path.to_path_buf(),
            content: text,
            mode,
            link: std::fs::read_link(path).ok(),
        };
        (path.with_extension("conflist"), Some(wrapped))
    };
    Ok(Plan {
        target,
        text: render_text(&with_entry(path, entry)?)?,
        mode,
        wrapped,
    })
}

/// The list the runtime runs for `path` (a bare `.conf` wrapped, keeping
/// its network name), ending with `entry` and with no other entry of
/// ours: what chaining writes into the file, and what Istio's owned mode
/// writes into its own.
pub fn with_entry(path: &Path, entry: &Value) -> Result<Value, Error> {
    let conf =
        parse(path).ok_or_else(|| Error::Io(format!("{} is no valid CNI configuration", path.display())))?;
    let list = if is_list(path) {
        conf
    } else {
        if conf["name"].as_str().is_none_or(str::is_empty) {
            return Err(Error::Io(format!(
                "{} has no network name: wrapping it into a list would rename its network",
                path.display()
            )));
        }
        wrap(&conf)
    };
    let mut chained = without_ours(&list);
    if let Some(plugins) = chained["plugins"].as_array_mut() {
        plugins.push(entry.clone());
    }
    Ok(chained)
}

/// Writes what `plan` says: the list (keeping the mode of the file it
/// replaces, or of the wrapped `.conf`), then removes a wrapped `.conf`.
pub fn apply(plan: &Plan) -> Result<(), Error> {
    let mode = mode_of(&plan.target).unwrap_or(plan.mode);
    replace_file(&plan.target, plan.text.as_bytes(), mode)?;
    if let Some(wrapped) = &plan.wrapped {
        std::fs::remove_file(&wrapped.conf).map_err(|e| Error::file("remove", &wrapped.conf, e))?;
    }
    Ok(())
}

/// Removes our entries from `path`, leaving the rest; whether there were any.
pub fn remove(path: &Path) -> Result<bool, Error> {
    let Some(conf) = parse(path) else {
        return Ok(false);
    };
    if conf["plugins"].as_array().is_none() {
        return Ok(false);
    }
    let rest = without_ours(&conf);
    if rest == conf {
        return Ok(false);
    }
    write_if_changed(&write_target(path), &rest)?;
    Ok(true)
}

/// What taking the entry out of a file did.
#[derive(Debug, PartialEq, Eq)]
pub enum Unchained {
    /// The file held no entry of ours (or is gone).
    Nothing,
    /// Our entry was removed from it.
    Removed,
    /// The list a wrap made was removed and the `.conf` put back.
    PutBack(PathBuf),
}

/// Takes our entry out of `path`. A list the agent wrapped from a bare
/// `.conf` (`wrapped`) that is still just that `.conf` and our entry goes,
/// and the `.conf` comes back byte for byte (unless one is there again);
/// a list someone changed since keeps its other changes.
pub fn unchain(path: &Path, wrapped: Option<&Wrapped>) -> Result<Unchained, Error> {
    if let Some(wrapped) = wrapped.filter(|w| is_just_the_wrap_of(path, w)) {
        if std::fs::symlink_metadata(&wrapped.conf).is_err() {
            put_back(wrapped)?;
        }
        std::fs::remove_file(path).map_err(|e| Error::file("remove", path, e))?;
        return Ok(Unchained::PutBack(wrapped.conf.clone()));
    }
    Ok(if remove(path)? {
        Unchained::Removed
    } else {
        Unchained::Nothing
    })
}

/// The bare file as it was: the link it was, or its bytes and mode.
fn put_back(wrapped: &Wrapped) -> Result<(), Error> {
    match &wrapped.link {
        Some(target) => std::os::unix::fs::symlink(target, &wrapped.conf)
            .map_err(|e| Error::file("put back", &wrapped.conf, e)),
        None => replace_file(&wrapped.conf, wrapped.content.as_bytes(), wrapped.mode),
    }
}

/// Whether `path` holds `entry`, wherever in its list: the files an agent
/// chained it into, whether or not it recorded them (releases before the
/// record did not). Exactly the entry, but for the `logSocket` the agent
/// names in it: releases before that named none.
pub fn holds(path: &Path, entry: &Value) -> bool {
    let ours = without_log_socket(entry);
    parse(path).is_some_and(|conf| {
        conf["plugins"]
            .as_array()
            .is_some_and(|plugins| plugins.iter().any(|p| without_log_socket(p) == ours))
    })
}

/// Whether `path` holds an entry of our type, whatever its settings: an
/// owned file an agent wrote with an earlier `ISTIO_PLUGIN_CONFIG` still
/// does, one someone put in its place does not.
pub fn holds_an_entry_of_ours(path: &Path) -> bool {
    parse(path).is_some_and(|conf| {
        conf["plugins"]
            .as_array()
            .is_some_and(|plugins| plugins.iter().any(|p| p["type"] == TYPE))
    })
}

/// The network name a list was given by a release of the agent that
/// wrapped a bare file into a list named, as Istio names it,
/// `k8s-pod-network`, and the name the bare file had: pods set up since
/// hold leases under the first, pods from before under the second.
pub fn renamed_by_an_earlier_wrap(path: &Path) -> Option<String> {
    let list = parse(path).filter(|_| is_list(path))?;
    let plugins = without_ours(&list)["plugins"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let [only] = plugins.as_slice() else {
        return None;
    };
    let original = only["name"].as_str().filter(|name| !name.is_empty())?;
    (list["name"] == ISTIOS_WRAP_NAME && original != ISTIOS_WRAP_NAME && only.get("plugins").is_none())
        .then(|| original.to_owned())
}

/// The network name Istio's installer (and this agent before) gave a
/// wrapped bare file.
const ISTIOS_WRAP_NAME: &str = "k8s-pod-network";

/// Whether the list at `path` is, but for our entries, the wrap of the
/// recorded `.conf`.
fn is_just_the_wrap_of(path: &Path, wrapped: &Wrapped) -> bool {
    let original = serde_json::from_str::<Value>(&wrapped.content).ok();
    parse(path)
        .zip(original)
        .is_some_and(|(list, original)| without_ours(&list) == wrap(&original))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conf_dir::with_log_socket;
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

    /// Chains `entry` into `path` as the agent does; the file that holds it.
    fn insert(path: &Path, entry: &Value) -> PathBuf {
        let plan = plan(path, entry).expect("plan");
        apply(&plan).expect("apply");
        plan.target
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
            assert_eq!(primary(dir.path(), None, None), Some(path.clone()), "{name}");
            assert!(!in_place(&path, &ours));
            assert_eq!(insert(&path, &ours), path);
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
            insert(&path, &newer);
            assert!(in_place(&path, &newer));
            // So is an entry of a release that named no log socket.
            let mut naming_the_socket = newer.clone();
            with_log_socket(&mut naming_the_socket, Path::new("/run/cni-suite/log.sock"));
            assert!(!in_place(&path, &naming_the_socket), "rewritten on upgrade");
            insert(&path, &naming_the_socket);
            assert!(in_place(&path, &naming_the_socket));
            assert!(remove(&path).expect("remove"));
            assert_eq!(read(&path), original, "the rest of the file unchanged");
            assert!(!remove(&path).expect("nothing left"));
        }
    }

    /// A bare `.conf` as an operator wrote it, with spacing no JSON writer
    /// reproduces.
    const BARE: &str = "{ \"cniVersion\": \"0.4.0\",  \"name\": \"mynet\", \"type\": \"bridge\",\n\
                        \"bridge\": \"cni0\", \"ipam\": {\"type\": \"host-local\", \"subnet\": \"10.22.0.0/16\"} }\n";

    #[test]
    fn a_bare_conf_is_wrapped_keeping_its_network_name_and_put_back_byte_for_byte() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("10-mynet.conf");
        std::fs::write(&path, BARE).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let ours = entry(None).expect("entry");
        let plan = plan(&path, &ours).expect("plan");
        let wrapped = plan.wrapped.clone().expect("a wrap");
        assert_eq!(wrapped.content, BARE);
        apply(&plan).expect("apply");
        let list_path = dir.path().join("10-mynet.conflist");
        assert_eq!(plan.target, list_path);
        assert!(!path.exists(), "the bare .conf is replaced by the list");
        let list = read(&list_path);
        assert_eq!(list["name"], "mynet", "the network keeps its name");
        assert_eq!(list["cniVersion"], "0.4.0");
        let conf: Value = serde_json::from_str(BARE).expect("JSON");
        assert_eq!(list["plugins"], json!([conf, ours]));
        let mode = std::fs::metadata(&list_path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the list keeps the .conf's mode");
        assert_eq!(primary(dir.path(), None, None), Some(list_path.clone()));
        // ISTIO_CNI_CONF_FILE naming the .conf follows it to its list.
        assert_eq!(
            primary(dir.path(), Some("10-mynet.conf"), None),
            Some(list_path.clone())
        );
        assert_eq!(primary(dir.path(), Some("10-other.conf"), None), None);

        assert_eq!(
            unchain(&list_path, Some(&wrapped)).expect("unchain"),
            Unchained::PutBack(path.clone())
        );
        assert_eq!(std::fs::read_to_string(&path).expect("back"), BARE);
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!list_path.exists());
    }

    #[test]
    fn a_wrapped_list_someone_changed_since_only_loses_our_entry() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("10-mynet.conf");
        std::fs::write(&path, BARE).expect("write");
        let ours = entry(None).expect("entry");
        let plan = plan(&path, &ours).expect("plan");
        apply(&plan).expect("apply");
        let mut list = read(&plan.target);
        let plugins = list["plugins"].as_array_mut().expect("plugins");
        plugins.insert(1, json!({"type": "bandwidth"}));
        std::fs::write(&plan.target, list.to_string()).expect("another agent's change");
        assert_eq!(
            unchain(&plan.target, plan.wrapped.as_ref()).expect("unchain"),
            Unchained::Removed
        );
        assert!(!path.exists());
        let types: Vec<Value> = read(&plan.target)["plugins"]
            .as_array()
            .expect("plugins")
            .iter()
            .map(|p| p["type"].clone())
            .collect();
        assert_eq!(types, ["bridge", "bandwidth"]);
    }

    #[test]
    fn a_conf_without_a_network_name_is_not_wrapped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("10-anonymous.conf");
        std::fs::write(&path, r#"{"cniVersion":"1.0.0","type":"bridge"}"#).expect("write");
        assert!(plan(&path, &entry(None).expect("entry")).is_err());
    }

    #[test]
    fn a_json_file_is_a_bare_plugin_the_runtime_runs_and_is_wrapped_like_a_conf() {
        let dir = tempfile::tempdir().expect("tempdir");
        let json_path = dir.path().join("05-other.json");
        std::fs::write(&json_path, BARE).expect("write");
        write(&dir.path().join("10-kindnet.conflist"), &kindnet(), 0o644);
        assert_eq!(primary(dir.path(), None, None), Some(json_path.clone()));
        let plan = plan(&json_path, &entry(None).expect("entry")).expect("plan");
        assert_eq!(plan.target, dir.path().join("05-other.conflist"));
        apply(&plan).expect("apply");
        assert_eq!(
            primary(dir.path(), Some("05-other.json"), None),
            Some(plan.target.clone())
        );
        unchain(&plan.target, plan.wrapped.as_ref()).expect("unchain");
        assert_eq!(std::fs::read_to_string(&json_path).expect("back"), BARE);
    }

    #[test]
    fn links_in_the_conf_directory_keep_pointing_where_they_did() {
        let dir = tempfile::tempdir().expect("tempdir");
        let elsewhere = tempfile::tempdir().expect("tempdir");
        let ours = entry(None).expect("entry");
        // A list kept elsewhere: chained through the link, which stays.
        let real_list = elsewhere.path().join("kindnet.conflist");
        write(&real_list, &kindnet(), 0o644);
        let list_link = dir.path().join("10-kindnet.conflist");
        std::os::unix::fs::symlink(&real_list, &list_link).expect("link");
        let chained = insert(&list_link, &ours);
        assert_eq!(chained, real_list.canonicalize().expect("real"));
        assert!(
            std::fs::symlink_metadata(&list_link)
                .expect("lstat")
                .file_type()
                .is_symlink()
        );
        assert!(in_place(&list_link, &ours));
        assert_eq!(unchain(&list_link, None).expect("unchain"), Unchained::Removed);
        assert!(
            std::fs::symlink_metadata(&list_link)
                .expect("lstat")
                .file_type()
                .is_symlink()
        );
        assert_eq!(read(&real_list), kindnet());
        // A bare file kept elsewhere: wrapped, and put back as the link.
        let real_conf = elsewhere.path().join("mynet.conf");
        std::fs::write(&real_conf, BARE).expect("write");
        let conf_link = dir.path().join("05-mynet.conf");
        std::os::unix::fs::symlink(&real_conf, &conf_link).expect("link");
        let plan = plan(&conf_link, &ours).expect("plan");
        apply(&plan).expect("apply");
        assert_eq!(std::fs::read_to_string(&real_conf).expect("untouched"), BARE);
        assert_eq!(
            unchain(&plan.target, plan.wrapped.as_ref()).expect("unchain"),
            Unchained::PutBack(conf_link.clone())
        );
        assert_eq!(std::fs::read_link(&conf_link).expect("a link again"), real_conf);
    }

    #[test]
    fn lists_holding_the_entry_and_earlier_wraps_are_recognised() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ours = entry(None).expect("entry");
        let path = dir.path().join("10-mynet.conflist");
        let conf: Value = serde_json::from_str(BARE).expect("JSON");
        let istios_wrap = json!({"cniVersion": "0.4.0", "name": "k8s-pod-network", "plugins": [conf, ours]});
        write(&path, &istios_wrap, 0o644);
        assert!(holds(&path, &ours));
        assert!(!holds(&path, &json!({"type": TYPE, "other": true})));
        assert!(holds_an_entry_of_ours(&path));
        // The entry of a release that named no log socket is still ours.
        let mut named = ours.clone();
        with_log_socket(&mut named, Path::new("/run/cni-suite/log.sock"));
        assert!(holds(&path, &named));
        assert_eq!(renamed_by_an_earlier_wrap(&path).as_deref(), Some("mynet"));
        write(&path, &kindnet(), 0o644);
        assert_eq!(renamed_by_an_earlier_wrap(&path), None);
        assert!(!holds_an_entry_of_ours(&path));
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
