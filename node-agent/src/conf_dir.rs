//! The CNI configuration directory as a runtime reads it. Other agents
//! and operators own what is in it, so files are read with
//! [`crate::atomic::read_text`]: regular files only, never blocking. And
//! a configuration as the agent writes one there (its own conflist, a
//! file it chains Istio's entry into): whole, and only when it changes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::atomic::{mode_of, read_text, replace_file};
use crate::error::Error;

/// The extensions libcni loads network configurations from.
pub const EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];
/// The configuration files of `dir` libcni would consider, in name order.
pub fn files(dir: &Path) -> Vec<PathBuf> {
    libcni::conflist::conf_files(dir, &EXTENSIONS).unwrap_or_default()
}

/// Every plugin type any configuration file of `dir` names, at any depth
/// (a list's plugins, their `ipam`, a meta plugin's delegates): a binary
/// named here may still be executed by the runtime. Unreadable files name
/// nothing.
pub fn named_plugins(dir: &Path) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for path in files(dir) {
        if let Some(conf) = read_text(&path)
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok())
        {
            collect_types(&conf, &mut names);
        }
    }
    names
}

/// Names the agent's socket in a plugin's entry as `logSocket`, unless the
/// entry names one (an operator's `CNI_CHAINED_PLUGINS` or
/// `ISTIO_PLUGIN_CONFIG` may, `""` for none). A plugin other than the
/// suite's ignores the key, as the reference plugins ignore every key they
/// do not know.
pub fn with_log_socket(plugin: &mut Value, socket: &Path) {
    if let Some(entry) = plugin.as_object_mut()
        && !entry.contains_key(cni::conf::LOG_SOCKET_KEY)
    {
        entry.insert(cni::conf::LOG_SOCKET_KEY.to_owned(), json!(socket));
    }
}

/// `entry` without the `logSocket` the agent names in it: how entries of
/// releases that named none compare with this one's.
pub fn without_log_socket(entry: &Value) -> Value {
    let mut entry = entry.clone();
    if let Some(map) = entry.as_object_mut() {
        map.shift_remove(cni::conf::LOG_SOCKET_KEY);
    }
    entry
}

/// A configuration as the agent writes it: pretty JSON, one final newline.
pub fn render_text(content: &Value) -> Result<String, Error> {
    serde_json::to_string_pretty(content)
        .map(|text| format!("{text}\n"))
        .map_err(Error::Json)
}

/// Writes `content` to `path` unless it already holds exactly that: a
/// file beside it (with the mode of the file it replaces), synced, then
/// renamed over it, so the runtime never reads half a configuration.
/// Returns whether it wrote.
pub fn write_if_changed(path: &Path, content: &Value) -> Result<bool, Error> {
    let text = render_text(content)?;
    if read_text(path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    let dir = path
        .parent()
        .ok_or_else(|| Error::Io(format!("{} has no directory", path.display())))?;
    std::fs::create_dir_all(dir).map_err(|e| Error::file("create", dir, e))?;
    let mode = mode_of(path).unwrap_or(0o644);
    replace_file(path, text.as_bytes(), mode)?;
    Ok(true)
}

fn collect_types(value: &Value, names: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) => {
            for (key, inner) in map {
                match inner {
                    Value::String(name) if key == "type" => {
                        names.insert(name.clone());
                    }
                    _ => collect_types(inner, names),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| collect_types(item, names)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_named_anywhere_in_any_configuration_is_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).expect("write");
        write(
            "10-kindnet.conflist",
            r#"{"name":"kindnet","plugins":[{"type":"ptp","ipam":{"type":"host-local"}},{"type":"istio-redirect"}]}"#,
        );
        write(
            "20-x.conf",
            r#"{"name":"x","type":"bridge","delegate":{"type":"macvlan"}}"#,
        );
        write("30-y.json", r#"{"name":"y","type":"vlan"}"#);
        write("40-ignored.txt", r#"{"type":"ignored"}"#);
        write("50-broken.conf", "{");
        nix::unistd::mkfifo(&dir.path().join("60-fifo.conf"), nix::sys::stat::Mode::S_IRWXU).expect("fifo");
        let names: Vec<String> = named_plugins(dir.path()).into_iter().collect();
        assert_eq!(
            names,
            ["bridge", "host-local", "istio-redirect", "macvlan", "ptp", "vlan"]
        );
    }
}
