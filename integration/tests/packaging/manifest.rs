//! `deploy/cni-suite.yaml`, `deploy/cni-suite-istio.yaml` and
//! `deploy/istio-cni.yaml`, checked without a server: every document
//! round-trips through its `k8s-openapi` type without losing a field, what
//! each tells the agent is what the agent and the image understand, the
//! Istio one is the base with Istio mode's additions and nothing else, and
//! the Istio-only one shares no object name with the base. (`make
//! validate-manifest` also runs `kubernetes-validate` from PyPI, which
//! bundles the API's schemas, over all three, and fails when a rendered one
//! is not what `deploy/render.py` renders now.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use test_kit::{bin, run};

const BASE: &str = "cni-suite.yaml";
/// `make manifests` renders it from the base (`deploy/render.py`).
const ISTIO: &str = "cni-suite-istio.yaml";
/// Istio's CNI alone, beside another network (`deploy/render.py` too).
const ISTIO_ONLY: &str = "istio-cni.yaml";
/// Every check but the last two runs on all.
const MANIFESTS: [&str; 3] = [BASE, ISTIO, ISTIO_ONLY];

/// What Istio mode adds to the base, all of it.
const ISTIO_SETTINGS: [(&str, &str); 2] = [("ISTIO_CHAINED", "true"), ("AMBIENT_ENABLED", "false")];
/// Ambient mode's host directory, mounted last: ztunnel's socket (pods'
/// namespaces are opened through the host's root, no mount needed).
const AMBIENT_MOUNT: &str = "/var/run/ztunnel";
const ISTIO_CAPABILITIES: [&str; 2] = ["SYS_ADMIN", "SYS_PTRACE"];
fn istio_rules() -> Value {
    json!([
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete", "patch"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    ])
}

fn manifest(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(file)
}

/// Every YAML document of a manifest as JSON (Debian's python3-yaml
/// parses it; the suite has no YAML crate).
fn documents(file: &str) -> Vec<Value> {
    let parsed = run(
        "python3",
        &[
            "-c",
            "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
            manifest(file).to_str().expect("UTF-8"),
        ],
    )
    .success();
    serde_json::from_str(&parsed.stdout).expect("JSON")
}

fn round_trip<T: DeserializeOwned + Serialize>(file: &str, document: &Value) -> T {
    let typed: T = serde_json::from_value(document.clone()).unwrap_or_else(|e| {
        panic!(
            "{file}: {} is not a valid {}: {e}",
            document["metadata"]["name"], document["kind"]
        )
    });
    let back = serde_json::to_value(&typed).expect("serialize");
    assert_eq!(&back, document, "{file}: a field was lost or changed");
    typed
}

fn of_kind<'a>(documents: &'a [Value], kind: &str) -> &'a Value {
    documents
        .iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

fn of_kind_mut<'a>(documents: &'a mut [Value], kind: &str) -> &'a mut Value {
    documents
        .iter_mut()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

/// A setting's value: the ConfigMap's, else the default `--help` shows
/// on the line after its `[env: ...]`.
fn setting(settings: &BTreeMap<String, String>, help: &str, key: &str) -> String {
    if let Some(value) = settings.get(key) {
        return value.clone();
    }
    let env = format!("[env: {key}=");
    help.lines()
        .skip_while(|line| !line.contains(&env))
        .nth(1)
        .and_then(|line| line.trim().strip_prefix("[default: "))
        .and_then(|line| line.strip_suffix(']'))
        .unwrap_or_else(|| panic!("{key} is not set and has no default"))
        .to_owned()
}

#[test]
fn every_document_round_trips_through_its_kubernetes_type() {
    for file in MANIFESTS {
        let documents = documents(file);
        let kinds: Vec<&str> = documents.iter().filter_map(|d| d["kind"].as_str()).collect();
        let mut expected = vec!["ServiceAccount", "ClusterRole", "ClusterRoleBinding"];
        // Only the suite's own network reads kubeadm's pod range.
        if file != ISTIO_ONLY {
            expected.extend(["Role", "RoleBinding"]);
        }
        expected.extend(["ConfigMap", "DaemonSet"]);
        assert_eq!(kinds, expected, "{file}");
        for document in &documents {
            match document["kind"].as_str() {
                Some("ServiceAccount") => drop(round_trip::<ServiceAccount>(file, document)),
                Some("ClusterRole") => drop(round_trip::<ClusterRole>(file, document)),
                Some("ClusterRoleBinding") => drop(round_trip::<ClusterRoleBinding>(file, document)),
                Some("Role") => drop(round_trip::<Role>(file, document)),
                Some("RoleBinding") => drop(round_trip::<RoleBinding>(file, document)),
                Some("ConfigMap") => drop(round_trip::<ConfigMap>(file, document)),
                Some("DaemonSet") => drop(round_trip::<DaemonSet>(file, document)),
                other => panic!("{file}: unexpected kind {other:?}"),
            }
        }
    }
}

/// Reading nodes, and following pods, namespaces and NetworkPolicies
/// (`NETWORK_POLICY`); in Istio mode also pods and events, for the
/// plugin's lookup and repair.
#[test]
fn the_role_grants_reading_nodes_and_what_policy_reads_and_in_istio_mode_pods_and_events() {
    for file in [BASE, ISTIO] {
        let documents = documents(file);
        let role: ClusterRole = round_trip(file, of_kind(&documents, "ClusterRole"));
        let config = of_kind(&documents, "ConfigMap");
        assert_eq!(config["data"]["NETWORK_POLICY"], "true", "{file}");
        let mut expected = vec![
            json!({"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}),
            json!({"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["list", "watch"]}),
            json!({"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["list", "watch"]}),
        ];
        if file == ISTIO {
            expected.extend(istio_rules().as_array().expect("rules").iter().cloned());
        }
        assert_eq!(
            serde_json::to_value(role.rules.expect("rules")).expect("JSON"),
            Value::Array(expected),
            "{file}"
        );
        // In kube-system, the one ConfigMap holding kubeadm's pod range,
        // read only, bound to the agent's account.
        let role: Role = round_trip(file, of_kind(&documents, "Role"));
        assert_eq!(role.metadata.namespace.as_deref(), Some("kube-system"), "{file}");
        assert_eq!(
            serde_json::to_value(role.rules.expect("rules")).expect("JSON"),
            json!([{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["kubeadm-config"], "verbs": ["get"]}]),
            "{file}"
        );
        let binding: RoleBinding = round_trip(file, of_kind(&documents, "RoleBinding"));
        assert_eq!(binding.role_ref.kind, "Role", "{file}");
        assert_eq!(
            binding.role_ref.name,
            role.metadata.name.expect("a name"),
            "{file}"
        );
        let subjects = binding.subjects.expect("subjects");
        assert_eq!(subjects.len(), 1, "{file}");
        assert_eq!(
            (subjects[0].name.as_str(), subjects[0].namespace.as_deref()),
            ("cni-suite-node-agent", Some("kube-system")),
            "{file}"
        );
    }
}

#[test]
fn the_agent_understands_every_setting_and_its_mounts_hold_its_paths() {
    let help = run(bin("cni-node-agent"), &["--help"]).success().stdout;
    for file in MANIFESTS {
        settings_and_mounts(file, &help);
    }
}

fn settings_and_mounts(file: &str, help: &str) {
    let documents = documents(file);
    let config: ConfigMap = round_trip(file, of_kind(&documents, "ConfigMap"));
    let settings = config.data.expect("data");
    for key in settings.keys() {
        assert!(
            help.contains(&format!("[env: {key}=")),
            "{file}: the agent has no setting {key}"
        );
    }
    let daemon_set: DaemonSet = round_trip(file, of_kind(&documents, "DaemonSet"));
    let pod = daemon_set.spec.expect("spec").template.spec.expect("pod spec");
    assert_eq!(pod.host_network, Some(true));
    let tolerations = pod.tolerations.expect("tolerations");
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none())
    );
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    let container = &pod.containers[0];
    let env: Vec<&str> = container.env.iter().flatten().map(|e| e.name.as_str()).collect();
    assert_eq!(env, ["NODE_NAME"]);
    // Each hostPath is mounted at its own path, so the paths the agent
    // writes into the conflist are the host's.
    let volumes = pod.volumes.expect("volumes");
    let mut mounted = BTreeSet::new();
    for mount in container.volume_mounts.iter().flatten() {
        let volume = volumes
            .iter()
            .find(|v| v.name == mount.name)
            .expect("a volume per mount");
        let host = volume.host_path.as_ref().expect("hostPath");
        assert_eq!(host.path, mount.mount_path, "{}", mount.name);
        mounted.insert(mount.mount_path.clone());
    }
    let mut expected: BTreeSet<String> = [
        "/etc/cni/net.d",
        "/opt/cni/bin",
        "/run/cni-suite",
        "/run/xtables.lock",
    ]
    .map(str::to_owned)
    .into();
    if file != BASE {
        expected.insert(AMBIENT_MOUNT.to_owned());
    }
    assert_eq!(mounted, expected, "{file}");
    // ISTIO_KUBECONFIG's, PLUGIN_LOG_SOCKET's and POLICY_SOCKET's defaults
    // too: none needs a mount of its own, and the plugins reach the
    // sockets at the paths the entries name.
    let mut paths = vec![
        "CNI_BIN_DIR",
        "CNI_CONF_DIR",
        "ISTIO_KUBECONFIG",
        "PLUGIN_LOG_SOCKET",
        "POLICY_SOCKET",
    ];
    if file != ISTIO_ONLY {
        paths.push("CNI_LEASE_DIR");
    }
    for key in paths {
        let path = setting(&settings, help, key);
        assert!(
            mounted.iter().any(|m| Path::new(&path).starts_with(m)),
            "{file}: {key}={path} is on no mount"
        );
    }
    // The image make image builds, and its command.
    // The tag `make image` gives it: the workspace's version.
    let image = format!("cni-suite/node-agent:{}", env!("CARGO_PKG_VERSION"));
    assert_eq!(container.image.as_deref(), Some(image.as_str()));
    assert_eq!(
        container.command.as_deref(),
        Some(&["/opt/cni-suite/bin/cni-node-agent".to_owned()][..])
    );
    let capabilities = container
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.as_ref())
        .and_then(|c| c.add.clone())
        .expect("capabilities");
    let mut expected = vec!["NET_ADMIN", "NET_RAW"];
    if file != BASE {
        expected.extend(ISTIO_CAPABILITIES);
    }
    assert_eq!(capabilities, expected, "{file}");
    let readiness = container
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("probe");
    assert_eq!(readiness.path.as_deref(), Some("/readyz"));
    let port = serde_json::to_value(&readiness.port).expect("port");
    assert!(settings["HEALTH_LISTEN"].ends_with(&format!(":{port}")), "{file}");
    let liveness = container
        .liveness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("probe");
    assert_eq!(
        serde_json::to_value(&liveness.port).expect("port"),
        port,
        "{file}"
    );
}

/// Istio's CNI alone: objects of its own (applying or deleting it never
/// touches the suite's), a health port of its own, its mode's settings,
/// and the grants its mode uses and no other.
#[test]
fn the_istio_only_manifest_is_apart_from_the_suites_and_grants_what_its_mode_uses() {
    let base = documents(BASE);
    let istio_only = documents(ISTIO_ONLY);
    let names = |documents: &[Value]| -> BTreeSet<(String, String)> {
        documents
            .iter()
            .map(|d| {
                let name = d["metadata"]["name"].as_str().expect("a name").to_owned();
                (d["kind"].as_str().expect("a kind").to_owned(), name)
            })
            .collect()
    };
    let shared: Vec<_> = names(&base).intersection(&names(&istio_only)).cloned().collect();
    assert!(shared.is_empty(), "{shared:?}");
    let config: ConfigMap = round_trip(ISTIO_ONLY, of_kind(&istio_only, "ConfigMap"));
    let settings = config.data.expect("data");
    for (key, value) in [
        ("OWN_NETWORK", "false"),
        ("ISTIO_CHAINED", "true"),
        ("CNI_INSTALL_PLUGINS", "istio-redirect"),
        ("READINESS_TAINT", "cni.istio.io/not-ready"),
        ("UNINSTALL_ON_STOP", "false"),
    ] {
        assert_eq!(settings.get(key).map(String::as_str), Some(value), "{key}");
    }
    // Istio's CNI alone enforces no policy: neither the setting nor the
    // grants (the rules below hold no namespaces or NetworkPolicies).
    assert!(!settings.contains_key("NETWORK_POLICY"));
    let base_config: ConfigMap = round_trip(BASE, of_kind(&base, "ConfigMap"));
    assert_ne!(
        settings["HEALTH_LISTEN"],
        base_config.data.expect("data")["HEALTH_LISTEN"],
        "both agents run host-networked on one node while a cluster moves from one to the other"
    );
    let role: ClusterRole = round_trip(ISTIO_ONLY, of_kind(&istio_only, "ClusterRole"));
    let mut expected = istio_rules().as_array().expect("rules").clone();
    // The readiness taint: its own Node read and patched; no Node list.
    expected.push(json!({"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}));
    assert_eq!(
        serde_json::to_value(role.rules.expect("rules")).expect("JSON"),
        Value::Array(expected)
    );
    let binding: ClusterRoleBinding = round_trip(ISTIO_ONLY, of_kind(&istio_only, "ClusterRoleBinding"));
    let subjects = binding.subjects.expect("subjects");
    assert_eq!(
        (subjects[0].name.as_str(), binding.role_ref.name.as_str()),
        ("cni-suite-istio-cni", "cni-suite-istio-cni")
    );
}

/// Undoing exactly Istio mode's additions gives the base back: the same
/// objects under the same names, so applying one file over the other
/// switches modes and changes nothing else.
#[test]
fn the_istio_manifest_is_the_base_plus_istio_mode_and_nothing_else() {
    let base = documents(BASE);
    let mut istio = documents(ISTIO);

    let data = of_kind_mut(&mut istio, "ConfigMap")["data"]
        .as_object_mut()
        .expect("data");
    for (key, value) in ISTIO_SETTINGS {
        assert_eq!(data.remove(key), Some(json!(value)));
    }

    let rules = of_kind_mut(&mut istio, "ClusterRole")["rules"]
        .as_array_mut()
        .expect("rules");
    let added = istio_rules().as_array().expect("rules").len();
    assert!(rules.len() > added, "{rules:?}");
    let extra = rules.split_off(rules.len() - added);
    assert_eq!(Value::Array(extra), istio_rules());

    let capabilities = of_kind_mut(&mut istio, "DaemonSet")
        .pointer_mut("/spec/template/spec/containers/0/securityContext/capabilities/add")
        .and_then(Value::as_array_mut)
        .expect("capabilities");
    assert!(capabilities.len() > ISTIO_CAPABILITIES.len(), "{capabilities:?}");
    let extra = capabilities.split_off(capabilities.len() - ISTIO_CAPABILITIES.len());
    assert_eq!(extra, ISTIO_CAPABILITIES);

    let pod = of_kind_mut(&mut istio, "DaemonSet")
        .pointer_mut("/spec/template/spec")
        .expect("pod spec");
    for list in ["/volumes", "/containers/0/volumeMounts"] {
        let entries = pod
            .pointer_mut(list)
            .and_then(Value::as_array_mut)
            .expect("a list");
        let extra = entries.pop().expect("ambient's mount");
        let path = extra
            .pointer("/mountPath")
            .or_else(|| extra.pointer("/hostPath/path"));
        assert_eq!(path, Some(&json!(AMBIENT_MOUNT)), "{list}");
    }

    assert_eq!(istio, base);
}
