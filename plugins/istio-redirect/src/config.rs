//! The plugin entry: Istio's own fields (so an install switches by changing
//! `type`), and ours. Unknown fields are ignored; a field with a wrong value
//! is a code 7 error that names it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::rules::ambient::InPodBackend;
use crate::rules::apply::IptablesFlavour;
use cni::keys::{self, Shape, plain};
use cni::{Error, NetConf, Result};

use crate::annotations::Proxy;
use crate::enrolment::{EnablementSelector, Enrolment};

/// Where Istio's install puts the plugin's kubeconfig.
pub const DEFAULT_RUN_DIR: &str = "/var/run/istio-cni";
pub const KUBECONFIG_FILE: &str = "istio-cni-kubeconfig";

/// Istio's `Config` (with `types.NetConf` embedded), and our own keys.
pub const KEYS: Shape = Shape::Struct(&[
    keys::NET_CONF,
    &[
        keys::IPAM_TYPE,
        plain("plugin_log_level"),
        plain("cni_agent_run_dir"),
        plain("ambient_enabled"),
        keys::field("enablement_selectors", crate::enrolment::SELECTORS),
        plain("exclude_namespaces"),
        plain("pod_namespace"),
        plain("native_nftables"),
        plain("kubeconfig"),
        plain("proxy_uid"),
        plain("proxy_gid"),
        plain("dns_capture"),
        plain("dual_stack"),
        plain("invalid_drop"),
        keys::field("redirect", Shape::Map(&Shape::Any)),
        plain("iptables_backend"),
        plain("api_attempts"),
        plain("api_retry_delay_ms"),
        plain("api_deadline_ms"),
    ],
]);

/// Ambient mode's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Ambient {
    /// `enablement_selectors`: Istio's defaults when the entry has none.
    pub enrolment: Enrolment,
    /// Where the node agent takes pod events.
    pub pod_event_socket: PathBuf,
}

/// What the node agent reads of an entry it writes, as the plugin reads
/// it: where the plugin sends its pod events, and which pods it enrols
/// (the agent decides again from its own cache, with the same selectors
/// and the same namespaces left alone).
#[derive(Debug, Clone, PartialEq)]
pub struct EntryAmbient {
    pub ambient: Ambient,
    pub exclude_namespaces: Vec<String>,
    /// How the in-pod rules are written: `native_nftables`, else iptables
    /// in the entry's `iptables_backend`.
    pub backend: InPodBackend,
}

/// `entry`'s ambient mode, None when it does not enable it; a value the
/// plugin would refuse is refused here too, in its words.
pub fn ambient_of_entry(entry: &serde_json::Value) -> Result<Option<EntryAmbient>> {
    let mut doc = serde_json::json!({"cniVersion": "1.0.0", "name": "entry"});
    if let (Some(doc), Some(entry)) = (doc.as_object_mut(), entry.as_object()) {
        for (key, value) in entry {
            doc.entry(key.clone()).or_insert_with(|| value.clone());
        }
    }
    keys::fold(&mut doc, &KEYS);
    let config = IstioConfig::load(&NetConf::read(doc)?)?;
    let backend = match config.native_nftables {
        true => InPodBackend::Nftables,
        false => InPodBackend::Iptables(config.iptables_flavour),
    };
    Ok(config.ambient.map(|ambient| EntryAmbient {
        ambient,
        exclude_namespaces: config.exclude_namespaces,
        backend,
    }))
}

#[derive(Debug, Clone, PartialEq)]
pub struct IstioConfig {
    pub log_level: Option<String>,
    pub kubeconfig: PathBuf,
    /// `ambient_enabled`: enrolled pods go to the node agent (Istio's
    /// ambient mode) instead of getting a sidecar's capture.
    pub ambient: Option<Ambient>,
    pub exclude_namespaces: Vec<String>,
    pub pod_namespace: Option<String>,
    pub native_nftables: bool,
    /// What annotations cannot carry, used when the pod comes from
    /// annotations (the API gives the real values).
    pub proxy: Proxy,
    /// Settings for pods without Kubernetes arguments (cnitool, plain
    /// containerd): annotation names without their prefixes.
    pub redirect: Option<BTreeMap<String, String>>,
    /// `iptables_backend`: the operator's flavour; None detects it.
    pub iptables_flavour: Option<IptablesFlavour>,
    pub api_attempts: u32,
    pub api_retry_delay: Duration,
    /// One limit for the whole pod lookup, retries included: below
    /// kubelet's 2-minute runtime request timeout, with the rest of the
    /// chain's time to spare.
    pub api_deadline: Duration,
}

impl IstioConfig {
    pub fn load(conf: &NetConf) -> Result<Self> {
        let run_dir: String = conf
            .plugin_key("cni_agent_run_dir")?
            .unwrap_or_else(|| DEFAULT_RUN_DIR.to_owned());
        let run_dir = PathBuf::from(run_dir);
        let kubeconfig = conf
            .plugin_key::<String>("kubeconfig")?
            .map(PathBuf::from)
            .unwrap_or_else(|| run_dir.join(KUBECONFIG_FILE));
        let enrolment = match conf.plugin_key::<Vec<EnablementSelector>>("enablement_selectors")? {
            Some(selectors) => Enrolment::from_selectors(&selectors)
                .map_err(|e| Error::invalid_config(format!("invalid enablement_selectors: {e}")))?,
            None => Enrolment::istio_default(),
        };
        let defaults = Proxy::default();
        let iptables_flavour = match conf.plugin_key::<String>("iptables_backend")? {
            Some(text) => IptablesFlavour::parse(&text)
                .map_err(|e| Error::invalid_config(format!("invalid iptables_backend: {e}")))?,
            None => None,
        };
        Ok(IstioConfig {
            log_level: conf.plugin_key("plugin_log_level")?,
            kubeconfig,
            ambient: conf
                .plugin_key("ambient_enabled")?
                .unwrap_or(false)
                .then(|| Ambient {
                    enrolment,
                    pod_event_socket: run_dir.join(agent_wire::pod_event::SOCKET_NAME),
                }),
            exclude_namespaces: conf.plugin_key("exclude_namespaces")?.unwrap_or_default(),
            pod_namespace: conf
                .plugin_key::<String>("pod_namespace")?
                .filter(|s| !s.is_empty()),
            native_nftables: conf.plugin_key("native_nftables")?.unwrap_or(false),
            proxy: Proxy {
                uid: conf.plugin_key("proxy_uid")?.unwrap_or(defaults.uid),
                gid: conf.plugin_key("proxy_gid")?.unwrap_or(defaults.gid),
                dns_capture: conf.plugin_key("dns_capture")?.unwrap_or(defaults.dns_capture),
                dual_stack: conf.plugin_key("dual_stack")?.unwrap_or(defaults.dual_stack),
                invalid_drop: conf.plugin_key("invalid_drop")?.unwrap_or(defaults.invalid_drop),
            },
            redirect: conf.plugin_key("redirect")?,
            iptables_flavour,
            api_attempts: conf.plugin_key::<u32>("api_attempts")?.unwrap_or(30).max(1),
            api_retry_delay: Duration::from_millis(conf.plugin_key("api_retry_delay_ms")?.unwrap_or(1000)),
            api_deadline: Duration::from_millis(
                conf.plugin_key::<u64>("api_deadline_ms")?
                    .unwrap_or(60_000)
                    .max(1),
            ),
        })
    }

    /// Istio's `plugin_log_level` in our logger's terms.
    pub fn log_level(&self) -> Option<&str> {
        self.log_level.as_deref().map(|level| match level {
            "none" => "off",
            other => other,
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn load(extra: Value) -> Result<IstioConfig> {
        let mut doc = json!({"cniVersion": "1.0.0", "name": "net", "type": "istio-redirect"});
        if let (Some(d), Value::Object(e)) = (doc.as_object_mut(), extra) {
            d.extend(e);
        }
        IstioConfig::load(&NetConf::from_document(doc, cni::Version::V1_0_0).expect("conf"))
    }

    #[test]
    fn the_agent_reads_an_entry_as_the_plugin_reads_it() {
        assert_eq!(
            ambient_of_entry(&json!({"type": "istio-redirect"})).expect("valid"),
            None
        );
        let entry = json!({"type": "istio-redirect", "AMBIENT_ENABLED": true, "cni_agent_run_dir": "/run/x",
            "exclude_namespaces": ["kube-system"], "enablement_selectors": [{"podSelector": {"matchLabels": {"a": "b"}}}]});
        let read = ambient_of_entry(&entry).expect("valid").expect("ambient mode");
        assert_eq!(
            read.ambient.pod_event_socket,
            PathBuf::from("/run/x/pluginevent.sock")
        );
        assert_eq!(read.exclude_namespaces, ["kube-system"]);
        let selected = BTreeMap::from([("a".to_owned(), "b".to_owned())]);
        let candidate = crate::enrolment::Candidate::new(&selected, &BTreeMap::new(), false);
        assert!(read.ambient.enrolment.matches(candidate, &BTreeMap::new()));
        let bad = json!({"type": "istio-redirect", "ambient_enabled": "yes"});
        let refused = ambient_of_entry(&bad).expect_err("not a boolean");
        assert!(refused.to_string().contains("ambient_enabled"), "{refused}");
    }

    #[test]
    fn istios_own_entry_is_accepted() {
        let c = load(json!({"ambient_enabled": false, "cni_agent_run_dir": "/run/istio-cni", "dns": {},
            "enable_ambient_detection_retry": false, "enablement_selectors": [], "exclude_namespaces": ["kube-system"],
            "ipam": {}, "native_nftables": false, "plugin_log_level": "debug", "pod_namespace": "istio-system"}))
        .expect("valid");
        assert_eq!(c.kubeconfig, PathBuf::from("/run/istio-cni/istio-cni-kubeconfig"));
        assert_eq!(c.ambient, None);
        let on = |extra: Value| {
            let mut doc = json!({"ambient_enabled": true, "cni_agent_run_dir": "/run/istio-cni"});
            if let (Some(d), Value::Object(e)) = (doc.as_object_mut(), extra) {
                d.extend(e);
            }
            load(doc).expect("valid").ambient.expect("ambient mode")
        };
        let ambient = on(json!({}));
        assert_eq!(
            ambient.pod_event_socket,
            PathBuf::from("/run/istio-cni/pluginevent.sock")
        );
        assert_eq!(
            ambient.enrolment,
            Enrolment::istio_default(),
            "none given: Istio's defaults"
        );
        assert_eq!(
            on(json!({"enablement_selectors": []})).enrolment,
            Enrolment::from_selectors(&[]).expect("valid"),
            "Istio's own empty list enrols nothing"
        );
        // Go's decoder: any case of each key, down the selectors (as the
        // skeleton folds the keys before the plugin reads them).
        let mut doc = json!({"cniVersion": "1.0.0", "name": "net", "type": "istio-redirect", "ambient_enabled": true,
            "Enablement_Selectors": [{"PodSelector": {"MatchLabels": {"app": "web"}}}]});
        cni::keys::fold(&mut doc, &KEYS);
        let conf = NetConf::from_document(doc, cni::Version::V1_0_0).expect("conf");
        let folded = IstioConfig::load(&conf)
            .expect("valid")
            .ambient
            .expect("ambient mode");
        let expected: Vec<EnablementSelector> =
            serde_json::from_value(json!([{"podSelector": {"matchLabels": {"app": "web"}}}])).expect("JSON");
        assert_eq!(
            folded.enrolment,
            Enrolment::from_selectors(&expected).expect("valid")
        );
        assert_eq!(c.exclude_namespaces, ["kube-system"]);
        assert_eq!(c.pod_namespace.as_deref(), Some("istio-system"));
        assert_eq!(c.log_level(), Some("debug"));
        assert_eq!(c.proxy, Proxy::default());
        assert_eq!((c.api_attempts, c.api_retry_delay), (30, Duration::from_secs(1)));
        assert_eq!(c.api_deadline, Duration::from_secs(60));
    }

    /// Everything istio-redirect reads of a configuration, as the skeleton
    /// and ADD read it.
    fn loaded(doc: &Value) -> String {
        cni::skel::read_configuration(doc, &KEYS, |conf| {
            (
                IstioConfig::load(conf),
                conf.runtime_config.pod_annotations(),
                conf.prev_result(),
            )
        })
    }

    #[test]
    fn every_key_reads_null_as_absent() {
        let prev_result = cni::keys::full_prev_result();
        let istio = json!({"plugin_log_level": "debug", "cni_agent_run_dir": "/run/istio-cni",
            "ambient_enabled": true, "exclude_namespaces": ["kube-system"],
            "enablement_selectors": [{"podSelector": {"matchLabels": {"app": "web"},
                "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]},
                "namespaceSelector": {"matchLabels": {"mesh": "on"}}}],
            "pod_namespace": "istio-system", "native_nftables": true, "kubeconfig": "/etc/kc",
            "proxy_uid": 1000, "proxy_gid": 1000, "dns_capture": true, "dual_stack": true,
            "invalid_drop": true, "redirect": {"interceptionMode": "TPROXY", "excludeInboundPorts": "22"},
            "iptables_backend": "nft", "api_attempts": 3, "api_retry_delay_ms": 10,
            "api_deadline_ms": 1000});
        let mut doc = json!({"cniVersion": "1.0.0", "name": "net", "type": "istio-redirect",
            "ipam": {"type": "none"}, "capabilities": {"io.kubernetes.cri.pod-annotations": true},
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {"sidecar.istio.io/status": "{}"}},
            "prevResult": prev_result});
        if let (Some(doc), Value::Object(istio)) = (doc.as_object_mut(), istio) {
            doc.extend(istio);
        }
        let whole = loaded(&doc);
        assert!(
            whole.starts_with("Ok(((Ok(") && !whole.contains("Err("),
            "{whole}"
        );
        cni::keys::assert_null_reads_as_absent(&doc, &KEYS, 50, loaded);
    }

    #[test]
    fn ours_override_and_errors_name_the_field() {
        let c = load(json!({"kubeconfig": "/etc/kc", "proxy_uid": 1000, "dns_capture": true,
            "redirect": {"interceptionMode": "TPROXY"}, "iptables_backend": "nft", "exclude_namespaces": null}))
        .expect("valid");
        assert_eq!(c.kubeconfig, PathBuf::from("/etc/kc"));
        assert_eq!((c.proxy.uid, c.proxy.dns_capture), (1000, true));
        assert_eq!(c.iptables_flavour, Some(IptablesFlavour::Nft));
        assert!(c.exclude_namespaces.is_empty());
        for (bad, key) in [
            (json!({"proxy_uid": "x"}), "proxy_uid"),
            (json!({"exclude_namespaces": "kube-system"}), "exclude_namespaces"),
            (json!({"redirect": ["x"]}), "redirect"),
            (json!({"iptables_backend": "ebtables"}), "iptables_backend"),
            (json!({"native_nftables": "yes"}), "native_nftables"),
            (json!({"ambient_enabled": "true"}), "ambient_enabled"),
            (
                json!({"enablement_selectors": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]}),
                "enablement_selectors",
            ),
        ] {
            let err = load(bad).expect_err(key);
            assert!(err.has_code(cni::Code::InvalidConfig));
            assert!(err.msg.starts_with(&format!("invalid {key}")), "{}", err.msg);
        }
    }
}
