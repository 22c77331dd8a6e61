//! What the plugin knows about a pod, from the Kubernetes API or from the
//! annotations the runtime passes, and Istio's rules for leaving it alone.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::annotations::{self, INJECT, INTERCEPTION_MODE, Proxy, STATUS, go_bool};
use crate::enrolment::Candidate;

pub const PROXY_CONTAINER: &str = "istio-proxy";
pub const INIT_CONTAINER: &str = "istio-init";

/// The `istio-proxy` container as far as capture is concerned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProxyContainer {
    /// Env vars with literal values (`valueFrom` is ignored, as Istio does).
    pub env: BTreeMap<String, String>,
    pub args: Vec<String>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodInfo {
    pub annotations: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    /// Init containers and containers.
    pub containers: Vec<String>,
    pub proxy: Option<ProxyContainer>,
    /// `spec.hostNetwork` (the API only: a runtime runs no CNI for such a
    /// pod).
    pub host_network: bool,
    /// Env and ids came from the plugin's defaults, not the pod spec.
    from_annotations: bool,
}

/// An object's `metadata.labels` (a pod's, a namespace's).
pub fn labels_of(object: &Value) -> BTreeMap<String, String> {
    string_map(&object["metadata"]["labels"])
}

fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

impl PodInfo {
    /// From the runtime's `io.kubernetes.cri.pod-annotations`. The containers
    /// come from the injector's `sidecar.istio.io/status`; an injected pod
    /// without `interceptionMode` is a gateway (the CNI-mode sidecar template
    /// always writes it, the gateway template never does).
    pub fn from_annotations(annotations: BTreeMap<String, String>) -> Result<Self, String> {
        let mut containers = Vec::new();
        if let Some(status) = annotations.get(STATUS) {
            let doc: Value =
                serde_json::from_str(status).map_err(|e| format!("invalid annotation {STATUS}: {e}"))?;
            for key in ["initContainers", "containers"] {
                containers.extend(
                    doc[key]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|c| c.as_str().map(str::to_owned)),
                );
            }
        }
        let proxy = containers.iter().any(|c| c == PROXY_CONTAINER).then(|| {
            let kind = if annotations.contains_key(INTERCEPTION_MODE) {
                "sidecar"
            } else {
                "router"
            };
            ProxyContainer {
                args: vec!["proxy".into(), kind.into()],
                ..ProxyContainer::default()
            }
        });
        Ok(PodInfo {
            annotations,
            labels: BTreeMap::new(),
            containers,
            proxy,
            host_network: false,
            from_annotations: true,
        })
    }

    /// From a pod object as the API serves it.
    pub fn from_api(pod: &Value) -> Self {
        let spec = &pod["spec"];
        let mut containers = Vec::new();
        let mut proxy = None;
        for list in ["initContainers", "containers"] {
            for container in spec[list].as_array().into_iter().flatten() {
                let name = container["name"].as_str().unwrap_or_default();
                containers.push(name.to_owned());
                if name == PROXY_CONTAINER {
                    let env = container["env"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|e| {
                            Some((e["name"].as_str()?.to_owned(), e["value"].as_str()?.to_owned()))
                        })
                        .collect();
                    let args = container["args"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|a| a.as_str().map(str::to_owned))
                        .collect();
                    let security = &container["securityContext"];
                    let id = |key: &str| security[key].as_u64().and_then(|v| u32::try_from(v).ok());
                    proxy = Some(ProxyContainer {
                        env,
                        args,
                        uid: id("runAsUser"),
                        gid: id("runAsGroup"),
                    });
                }
            }
        }
        PodInfo {
            annotations: string_map(&pod["metadata"]["annotations"]),
            labels: labels_of(pod),
            containers,
            proxy,
            host_network: spec["hostNetwork"].as_bool().unwrap_or(false),
            from_annotations: false,
        }
    }

    /// What ambient's enrolment reads of the pod.
    pub fn candidate(&self) -> Candidate<'_> {
        Candidate::new(&self.labels, &self.annotations, self.host_network)
    }

    /// Istio's reasons to leave a pod alone (after its own pod, missing
    /// Kubernetes arguments and excluded namespaces, which come first).
    pub fn skip_reason(&self) -> Option<&'static str> {
        if self.containers.iter().any(|c| c == INIT_CONTAINER) {
            return Some("it has an istio-init container");
        }
        let Some(proxy) = &self.proxy else {
            return Some("it has no istio-proxy container");
        };
        if proxy.env.get("DISABLE_ENVOY").and_then(|v| go_bool(v)) == Some(true) {
            return Some("its proxy has DISABLE_ENVOY set");
        }
        if proxy.args.first().map(String::as_str) == Some("proxy")
            && proxy.args.get(1).is_some_and(|kind| kind != "sidecar")
        {
            return Some("its proxy is not a sidecar");
        }
        let inject = self.labels.get(INJECT).or_else(|| self.annotations.get(INJECT));
        if inject.and_then(|v| go_bool(v)) == Some(false) {
            return Some("sidecar.istio.io/inject is false");
        }
        if !self.annotations.contains_key(STATUS) {
            return Some("it was not injected (no sidecar.istio.io/status)");
        }
        None
    }

    /// The proxy's ids and switches: from its container spec, or the
    /// plugin's defaults when only annotations were available.
    pub fn proxy_settings(&self, defaults: &Proxy) -> Proxy {
        let from_env = |key: &str, default: bool| {
            if self.from_annotations {
                return default;
            }
            self.proxy
                .as_ref()
                .and_then(|p| p.env.get(key))
                .and_then(|v| go_bool(v))
                .unwrap_or(default)
        };
        let container = self.proxy.as_ref().filter(|_| !self.from_annotations);
        Proxy {
            uid: container.and_then(|p| p.uid).unwrap_or(defaults.uid),
            gid: container.and_then(|p| p.gid).unwrap_or(defaults.gid),
            dns_capture: from_env("ISTIO_META_DNS_CAPTURE", defaults.dns_capture),
            dual_stack: from_env("ISTIO_DUAL_STACK", defaults.dual_stack),
            invalid_drop: from_env("INVALID_DROP", defaults.invalid_drop),
        }
    }

    pub fn redirect(&self, defaults: &Proxy) -> Result<crate::rules::Redirect, String> {
        annotations::redirect(&self.annotations, self.proxy_settings(defaults))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::annotations::ann;

    const STATUS_JSON: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":["istio-envoy"],"imagePullSecrets":null,"revision":"default"}"#;

    #[test]
    fn an_injected_sidecar_from_annotations() {
        let pod = PodInfo::from_annotations(ann(&[(STATUS, STATUS_JSON), (INTERCEPTION_MODE, "REDIRECT")]))
            .expect("valid");
        assert_eq!(pod.skip_reason(), None);
        assert_eq!(pod.containers, ["istio-validation", "istio-proxy"]);
        let proxy = pod.proxy_settings(&Proxy {
            uid: 1000,
            dns_capture: true,
            ..Proxy::default()
        });
        assert_eq!(
            (proxy.uid, proxy.dns_capture),
            (1000, true),
            "annotations cannot carry these: the defaults apply"
        );
    }

    #[test]
    fn skip_rules_from_annotations() {
        let gateway = PodInfo::from_annotations(ann(&[(STATUS, STATUS_JSON)])).expect("valid");
        assert_eq!(gateway.skip_reason(), Some("its proxy is not a sidecar"));
        let init = PodInfo::from_annotations(ann(&[
            (
                STATUS,
                r#"{"initContainers":["istio-init"],"containers":["istio-proxy"]}"#,
            ),
            (INTERCEPTION_MODE, "REDIRECT"),
        ]))
        .expect("valid");
        assert_eq!(init.skip_reason(), Some("it has an istio-init container"));
        let plain = PodInfo::from_annotations(BTreeMap::new()).expect("valid");
        assert_eq!(plain.skip_reason(), Some("it has no istio-proxy container"));
        let off = PodInfo::from_annotations(ann(&[
            (STATUS, STATUS_JSON),
            (INTERCEPTION_MODE, "REDIRECT"),
            (INJECT, "false"),
        ]))
        .expect("valid");
        assert_eq!(off.skip_reason(), Some("sidecar.istio.io/inject is false"));
        assert!(PodInfo::from_annotations(ann(&[(STATUS, "{")])).is_err());
    }

    fn api_pod(proxy: Value, extra_annotations: Value) -> Value {
        let mut annotations = json!({STATUS: STATUS_JSON});
        if let (Some(a), Value::Object(e)) = (annotations.as_object_mut(), extra_annotations) {
            a.extend(e);
        }
        json!({"metadata": {"name": "web-0", "namespace": "default", "annotations": annotations, "labels": {"app": "web"}},
               "spec": {"initContainers": [{"name": "istio-validation"}], "containers": [{"name": "app"}, proxy]}})
    }

    #[test]
    fn pods_from_the_api() {
        let proxy = json!({"name": "istio-proxy", "args": ["proxy", "sidecar"],
            "env": [{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"}, {"name": "POD_NAME", "valueFrom": {}}],
            "securityContext": {"runAsUser": 1000670000, "runAsGroup": 1000670001}});
        let pod = PodInfo::from_api(&api_pod(proxy, json!({})));
        assert_eq!(pod.skip_reason(), None);
        let settings = pod.proxy_settings(&Proxy::default());
        assert_eq!(
            (settings.uid, settings.gid, settings.dns_capture),
            (1000670000, 1000670001, true)
        );

        let router = PodInfo::from_api(&api_pod(
            json!({"name": "istio-proxy", "args": ["proxy", "router"]}),
            json!({}),
        ));
        assert_eq!(router.skip_reason(), Some("its proxy is not a sidecar"));
        let proxyless = PodInfo::from_api(&api_pod(
            json!({"name": "istio-proxy", "env": [{"name": "DISABLE_ENVOY", "value": "true"}]}),
            json!({}),
        ));
        assert_eq!(proxyless.skip_reason(), Some("its proxy has DISABLE_ENVOY set"));
        let mut labelled = api_pod(json!({"name": "istio-proxy"}), json!({INJECT: "true"}));
        labelled["metadata"]["labels"][INJECT] = json!("false");
        assert_eq!(
            PodInfo::from_api(&labelled).skip_reason(),
            Some("sidecar.istio.io/inject is false"),
            "the label wins"
        );
    }
}
