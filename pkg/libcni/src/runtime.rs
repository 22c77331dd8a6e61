//! Running a network configuration list against an attachment, the way
//! libcni does: the same stdin (name, cniVersion, prevResult and
//! runtimeConfig injected), the same environment, the same order and the
//! same result cache.

use std::ffi::OsString;
use std::path::PathBuf;

use cni::conf::{GcAttachment, LEGACY_ATTACHMENTS_KEY, VALID_ATTACHMENTS_KEY};
use cni::env::{
    CNI_ARGS, CNI_COMMAND, CNI_CONTAINERID, CNI_IFNAME, CNI_NETNS, CNI_PATH, Command, validate_container_id,
    validate_interface_name,
};
use cni::{CniResult, Version};
use serde_json::{Map, Value};

use crate::cache::{CACHE_KIND, CachedAttachment, ResultCache};
use crate::conflist::{NetworkConfigList, PluginConf, version_at_least};
use crate::{Error, Result};

/// What the runtime knows about one attachment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RuntimeConf {
    pub container_id: String,
    /// May be empty for DEL, as some runtimes send it.
    pub netns: String,
    pub ifname: String,
    /// CNI_ARGS pairs.
    pub args: Vec<(String, String)>,
    /// Capability arguments, handed to plugins that declare the capability.
    pub capability_args: Map<String, Value>,
}

impl RuntimeConf {
    fn validate(&self) -> Result<()> {
        validate_container_id(&self.container_id).map_err(Error::Invalid)?;
        validate_interface_name(&self.ifname).map_err(Error::Invalid)
    }

    fn from_cache(entry: &CachedAttachment) -> Self {
        RuntimeConf {
            container_id: entry.container_id.clone(),
            netns: entry.netns.clone(),
            ifname: entry.ifname.clone(),
            args: entry
                .cni_args
                .iter()
                .map(|[k, v]| (k.clone(), v.clone()))
                .collect(),
            capability_args: entry.capability_args.clone(),
        }
    }
}

/// What a GC pass did: the stale attachments it deleted, and every failure
/// it went on past.
#[derive(Debug, Default)]
pub struct GcOutcome {
    pub deleted: Vec<GcAttachment>,
    pub errors: Vec<Error>,
}

/// The runtime: where plugins are found and where results are cached.
#[derive(Debug, Clone)]
pub struct CniConfig {
    pub path: Vec<PathBuf>,
    pub cache: ResultCache,
}

impl CniConfig {
    pub fn new(path: Vec<PathBuf>, cache_dir: impl Into<PathBuf>) -> Self {
        CniConfig {
            path,
            cache: ResultCache::new(cache_dir.into()),
        }
    }

    /// ADD through every plugin in order; the last result is cached and
    /// returned.
    pub fn add_network_list(&self, list: &NetworkConfigList, rt: &RuntimeConf) -> Result<Value> {
        rt.validate()?;
        let mut result: Option<Value> = None;
        for plugin in &list.plugins {
            let stdin = plugin_request(list, plugin, result.as_ref(), Some(rt), &[]);
            let stdout = self.exec(plugin, Command::Add, &stdin, Some(rt))?;
            let printed: Value = serde_json::from_slice(&stdout).map_err(|e| Error::Plugin {
                plugin_type: plugin.plugin_type.clone(),
                verb: "add",
                source: cni::Error::decoding(format!("failed to parse result: {e}")),
            })?;
            result = Some(in_list_version(printed, &list.cni_version));
        }
        let result = result.ok_or_else(|| Error::Config("the list has no plugins".into()))?;
        self.cache.store(&CachedAttachment {
            kind: CACHE_KIND.into(),
            container_id: rt.container_id.clone(),
            config: list.bytes.clone(),
            ifname: rt.ifname.clone(),
            network_name: list.name.clone(),
            netns: rt.netns.clone(),
            cni_args: rt.args.iter().map(|(k, v)| [k.clone(), v.clone()]).collect(),
            capability_args: rt.capability_args.clone(),
            result: Some(result.clone()),
        })?;
        Ok(result)
    }

    /// CHECK through every plugin in order with the cached result, unless
    /// the list disables it. Lists older than 0.4.0 cannot be checked.
    pub fn check_network_list(&self, list: &NetworkConfigList, rt: &RuntimeConf) -> Result<()> {
        rt.validate()?;
        if !version_at_least(&list.cni_version, Version::V0_4_0) {
            return Err(Error::Invalid(cni::Error::incompatible_version(format!(
                "configuration version {:?} does not support the CHECK command",
                list.cni_version
            ))));
        }
        if list.disable_check {
            return Ok(());
        }
        let cached = self.cached_result(list, rt)?;
        for plugin in &list.plugins {
            let stdin = plugin_request(list, plugin, cached.as_ref(), Some(rt), &[]);
            self.exec(plugin, Command::Check, &stdin, Some(rt))?;
        }
        Ok(())
    }

    /// DEL through every plugin in reverse order, with the cached result from
    /// 0.4.0 on; the cache entry goes once every plugin succeeded.
    pub fn del_network_list(&self, list: &NetworkConfigList, rt: &RuntimeConf) -> Result<()> {
        rt.validate()?;
        let cached = if version_at_least(&list.cni_version, Version::V0_4_0) {
            // A damaged cache entry must not make the attachment undeletable.
            self.cached_result(list, rt).unwrap_or_else(|e| {
                eprintln!("warning: {e}; deleting without prevResult");
                None
            })
        } else {
            None
        };
        for plugin in list.plugins.iter().rev() {
            let stdin = plugin_request(list, plugin, cached.as_ref(), Some(rt), &[]);
            self.exec(plugin, Command::Del, &stdin, Some(rt))?;
        }
        self.cache.remove(&list.name, &rt.container_id, &rt.ifname)
    }

    /// GC: DEL every cached attachment of the list that is not in `valid`,
    /// then (1.1.0 on) GC every plugin with `valid`, going on past failures.
    pub fn gc_network_list(&self, list: &NetworkConfigList, valid: &[GcAttachment]) -> Result<GcOutcome> {
        let mut outcome = GcOutcome::default();
        if list.disable_gc {
            return Ok(outcome);
        }
        for entry in self.cache.attachments(&list.name)? {
            let attachment = GcAttachment {
                container_id: entry.container_id.clone(),
                ifname: entry.ifname.clone(),
            };
            if valid.contains(&attachment) {
                continue;
            }
            match self.del_network_list(list, &RuntimeConf::from_cache(&entry)) {
                Ok(()) => outcome.deleted.push(attachment),
                Err(e) => outcome.errors.push(Error::Config(format!(
                    "failed to delete stale attachment {} {}: {e}",
                    attachment.container_id, attachment.ifname
                ))),
            }
        }
        if version_at_least(&list.cni_version, Version::V1_1_0) {
            let valid = serde_json::to_value(valid).map_err(|e| Error::Config(e.to_string()))?;
            let extra = [
                (VALID_ATTACHMENTS_KEY, valid.clone()),
                (LEGACY_ATTACHMENTS_KEY, valid),
            ];
            for plugin in &list.plugins {
                let stdin = plugin_request(list, plugin, None, None, &extra);
                if let Err(e) = self.exec(plugin, Command::Gc, &stdin, None) {
                    outcome.errors.push(e);
                }
            }
        }
        Ok(outcome)
    }

    /// STATUS of every plugin in order, stopping at the first that is not
    /// ready. Returns whether the plugins were asked at all (1.1.0 on).
    pub fn status_network_list(&self, list: &NetworkConfigList) -> Result<bool> {
        if !version_at_least(&list.cni_version, Version::V1_1_0) {
            return Ok(false);
        }
        for plugin in &list.plugins {
            let stdin = plugin_request(list, plugin, None, None, &[]);
            self.exec(plugin, Command::Status, &stdin, None)?;
        }
        Ok(true)
    }

    /// The cached final result of an attachment, in the list's version.
    fn cached_result(&self, list: &NetworkConfigList, rt: &RuntimeConf) -> Result<Option<Value>> {
        let entry = self.cache.load(&list.name, &rt.container_id, &rt.ifname)?;
        Ok(entry
            .and_then(|e| e.result)
            .map(|r| in_list_version(r, &list.cni_version)))
    }

    fn exec(
        &self,
        plugin: &PluginConf,
        command: Command,
        stdin: &Value,
        rt: Option<&RuntimeConf>,
    ) -> Result<Vec<u8>> {
        let verb = match command {
            Command::Add => "add",
            Command::Del => "delete",
            Command::Check => "check",
            Command::Gc => "gc",
            Command::Status => "status",
            Command::Version => "version",
        };
        let plugin_err = |source| Error::Plugin {
            plugin_type: plugin.plugin_type.clone(),
            verb,
            source,
        };
        let binary = cni::exec::find_plugin(&plugin.plugin_type, &self.path).map_err(plugin_err)?;
        let search_path = std::env::join_paths(&self.path).unwrap_or_default();
        let (container_id, netns, ifname, args) = match rt {
            Some(rt) => (
                rt.container_id.clone(),
                rt.netns.clone(),
                rt.ifname.clone(),
                cni::args::format_pairs(&rt.args),
            ),
            None => Default::default(),
        };
        let env: [(&str, OsString); 6] = [
            (CNI_COMMAND, command.as_str().into()),
            (CNI_CONTAINERID, container_id.into()),
            (CNI_NETNS, netns.into()),
            (CNI_ARGS, args.into()),
            (CNI_IFNAME, ifname.into()),
            (CNI_PATH, search_path),
        ];
        let bytes = serde_json::to_vec(stdin).map_err(|e| Error::Config(e.to_string()))?;
        cni::exec::exec_plugin(&binary, &env, &bytes).map_err(plugin_err)
    }
}

/// One plugin's stdin: its object with the list's name and version, the
/// previous result, the runtimeConfig for its declared capabilities, and any
/// verb-specific keys.
fn plugin_request(
    list: &NetworkConfigList,
    plugin: &PluginConf,
    prev_result: Option<&Value>,
    rt: Option<&RuntimeConf>,
    extra: &[(&str, Value)],
) -> Value {
    let mut conf = plugin.raw.clone();
    conf.insert("name".into(), Value::String(list.name.clone()));
    conf.insert("cniVersion".into(), Value::String(list.cni_version.clone()));
    if let Some(prev) = prev_result {
        conf.insert("prevResult".into(), prev.clone());
    }
    if let Some(rt) = rt {
        let runtime_config: Map<String, Value> = rt
            .capability_args
            .iter()
            .filter(|(capability, _)| plugin.capability(capability))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if !runtime_config.is_empty() {
            conf.insert("runtimeConfig".into(), Value::Object(runtime_config));
        }
    }
    for (key, value) in extra {
        conf.insert((*key).into(), value.clone());
    }
    Value::Object(conf)
}

/// A result as the list's version lays it out, so the next plugin (and the
/// cache) get the shape they expect whatever the previous plugin printed. A
/// result that cannot be converted, or a version this runtime does not know,
/// is passed on as printed, with libcni's fix-up of a missing cniVersion.
fn in_list_version(mut result: Value, list_version: &str) -> Value {
    let version = if list_version.is_empty() {
        Some(Version::IMPLIED)
    } else {
        list_version.parse::<Version>().ok()
    };
    if let Some(converted) = version.and_then(|v| CniResult::from_value(&result).ok()?.to_value(v).ok()) {
        return converted;
    }
    if let Some(doc) = result.as_object_mut()
        && doc
            .get("cniVersion")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
    {
        doc.insert("cniVersion".into(), Value::String(list_version.to_owned()));
    }
    result
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn list(doc: Value) -> NetworkConfigList {
        NetworkConfigList::from_bytes(doc.to_string().as_bytes()).expect("valid list")
    }

    #[test]
    fn requests_inject_name_version_prev_result_and_declared_capabilities() {
        let l = list(json!({"cniVersion":"1.0.0","name":"net","plugins":[
            {"type":"portmap","capabilities":{"portMappings":true,"mac":false},"runtimeConfig":{"stale":1}},
            {"type":"plain"}]}));
        let mut caps = Map::new();
        caps.insert(
            "portMappings".into(),
            json!([{"hostPort":80,"containerPort":8080}]),
        );
        caps.insert("mac".into(), json!("aa:bb:cc:dd:ee:ff"));
        let rt = RuntimeConf {
            capability_args: caps,
            ..RuntimeConf::default()
        };
        let prev = json!({"cniVersion":"1.0.0"});
        let req = plugin_request(&l, &l.plugins[0], Some(&prev), Some(&rt), &[]);
        assert_eq!(req["name"], "net");
        assert_eq!(req["cniVersion"], "1.0.0");
        assert_eq!(req["prevResult"], prev);
        assert_eq!(
            req["runtimeConfig"],
            json!({"portMappings":[{"hostPort":80,"containerPort":8080}]})
        );
        let plain = plugin_request(&l, &l.plugins[1], None, Some(&rt), &[]);
        assert!(
            plain.get("runtimeConfig").is_none(),
            "no capability, no runtimeConfig"
        );
        assert!(plain.get("prevResult").is_none());
    }

    #[test]
    fn results_are_normalised_to_the_lists_version() {
        let legacy = json!({"cniVersion":"0.2.0","ip4":{"ip":"10.0.0.2/24"},"dns":{}});
        let v = in_list_version(legacy, "0.4.0");
        assert_eq!(v["ips"][0]["version"], "4");
        assert_eq!(v["cniVersion"], "0.4.0");
        let no_ip = json!({"interfaces":[{"name":"lo"}]});
        let kept = in_list_version(no_ip, "0.2.0");
        assert_eq!(
            kept["interfaces"][0]["name"], "lo",
            "unconvertible results pass as printed"
        );
        assert_eq!(kept["cniVersion"], "0.2.0", "with the version filled in");
    }

    #[test]
    fn invalid_attachments_are_refused_before_any_plugin_runs() {
        let cfg = CniConfig::new(vec![PathBuf::from("/nonexistent")], "/nonexistent-cache");
        let l = list(json!({"cniVersion":"1.0.0","name":"net","plugins":[{"type":"x"}]}));
        let rt = RuntimeConf {
            container_id: "bad id".into(),
            ifname: "eth0".into(),
            ..RuntimeConf::default()
        };
        assert!(matches!(cfg.add_network_list(&l, &rt), Err(Error::Invalid(_))));
        let rt = RuntimeConf {
            container_id: "ok".into(),
            ifname: "a/b".into(),
            ..RuntimeConf::default()
        };
        assert!(matches!(cfg.del_network_list(&l, &rt), Err(Error::Invalid(_))));
    }

    #[test]
    fn a_damaged_cache_entry_does_not_block_del() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bins = tempfile::tempdir().expect("tempdir");
        let plugin = bins.path().join("noop");
        std::fs::write(&plugin, "#!/bin/sh\nexit 0\n").expect("write");
        std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        let cfg = CniConfig::new(vec![bins.path().to_path_buf()], dir.path());
        let l = list(json!({"cniVersion":"1.0.0","name":"net","plugins":[{"type":"noop"}]}));
        let rt = RuntimeConf {
            container_id: "c".into(),
            ifname: "eth0".into(),
            ..RuntimeConf::default()
        };
        let entry = cfg.cache.path_of("net", "c", "eth0");
        std::fs::create_dir_all(entry.parent().expect("parent")).expect("mkdir");
        std::fs::write(&entry, "{damaged").expect("write");
        cfg.del_network_list(&l, &rt)
            .expect("DEL goes on without prevResult");
        assert!(!entry.exists(), "and removes the damaged entry");
    }

    #[test]
    fn check_needs_0_4_0() {
        let cfg = CniConfig::new(vec![], "/nonexistent-cache");
        let l = list(json!({"cniVersion":"0.3.1","name":"net","plugins":[{"type":"x"}]}));
        let rt = RuntimeConf {
            container_id: "c".into(),
            ifname: "eth0".into(),
            ..RuntimeConf::default()
        };
        let err = cfg.check_network_list(&l, &rt).expect_err("too old");
        assert!(err.to_string().contains("does not support the CHECK command"));
    }
}
