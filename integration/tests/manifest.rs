//! `deploy/cni-suite.yaml`, checked without a server: every document
//! round-trips through its `k8s-openapi` type without losing a field, and
//! what it tells the agent is what the agent and the image understand.
//! (`make validate-manifest` also runs `kubernetes-validate` from PyPI,
//! which bundles the API's schemas, over it.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use integration::{bin, run};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

fn manifest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/cni-suite.yaml")
}

/// Every YAML document of the manifest as JSON (Debian's python3-yaml
/// parses it; the suite has no YAML crate).
fn documents() -> Vec<Value> {
    let parsed = run(
        "python3",
        &[
            "-c",
            "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
            manifest().to_str().expect("UTF-8"),
        ],
    )
    .success();
    serde_json::from_str(&parsed.stdout).expect("JSON")
}

fn round_trip<T: DeserializeOwned + Serialize>(document: &Value) -> T {
    let typed: T = serde_json::from_value(document.clone()).unwrap_or_else(|e| {
        panic!(
            "{} is not a valid {}: {e}",
            document["metadata"]["name"], document["kind"]
        )
    });
    let back = serde_json::to_value(&typed).expect("serialize");
    assert_eq!(&back, document, "a field was lost or changed");
    typed
}

fn of_kind<'a>(documents: &'a [Value], kind: &str) -> &'a Value {
    documents
        .iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

#[test]
fn every_document_round_trips_through_its_kubernetes_type() {
    let documents = documents();
    let kinds: Vec<&str> = documents.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet"
        ]
    );
    for document in &documents {
        match document["kind"].as_str() {
            Some("ServiceAccount") => drop(round_trip::<ServiceAccount>(document)),
            Some("ClusterRole") => drop(round_trip::<ClusterRole>(document)),
            Some("ClusterRoleBinding") => drop(round_trip::<ClusterRoleBinding>(document)),
            Some("ConfigMap") => drop(round_trip::<ConfigMap>(document)),
            Some("DaemonSet") => drop(round_trip::<DaemonSet>(document)),
            other => panic!("unexpected kind {other:?}"),
        }
    }
}

#[test]
fn the_role_grants_only_reading_nodes() {
    let documents = documents();
    let role: ClusterRole = round_trip(of_kind(&documents, "ClusterRole"));
    let rules = role.rules.expect("rules");
    assert_eq!(rules.len(), 1);
    assert_eq!(rules[0].resources.as_deref(), Some(&["nodes".to_owned()][..]));
    assert_eq!(
        rules[0].verbs,
        ["get", "list", "watch"].map(str::to_owned).to_vec()
    );
}

#[test]
fn the_agent_understands_every_setting_and_its_mounts_hold_its_paths() {
    let documents = documents();
    let config: ConfigMap = round_trip(of_kind(&documents, "ConfigMap"));
    let settings = config.data.expect("data");
    let help = run(bin("cni-node-agent"), &["--help"]).success().stdout;
    for key in settings.keys() {
        assert!(
            help.contains(&format!("[env: {key}=")),
            "the agent has no setting {key}"
        );
    }
    let daemon_set: DaemonSet = round_trip(of_kind(&documents, "DaemonSet"));
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
    assert_eq!(
        mounted,
        [
            "/etc/cni/net.d",
            "/opt/cni/bin",
            "/run/cni-suite",
            "/run/xtables.lock"
        ]
        .map(str::to_owned)
        .into()
    );
    for key in ["CNI_BIN_DIR", "CNI_CONF_DIR", "CNI_LEASE_DIR"] {
        let path = &settings[key];
        assert!(
            mounted.iter().any(|m| Path::new(path).starts_with(m)),
            "{key}={path} is on no mount"
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
    assert_eq!(capabilities, ["NET_ADMIN", "NET_RAW"].map(str::to_owned).to_vec());
    let readiness = container
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("probe");
    assert_eq!(readiness.path.as_deref(), Some("/readyz"));
    assert!(settings["HEALTH_LISTEN"].ends_with(&format!(
        ":{}",
        serde_json::to_value(&readiness.port).expect("port")
    )));
}
