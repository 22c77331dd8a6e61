//! Helpers the plugins tier's modules share: istio-redirect executed as
//! libcni executes it (its sidecar capture and its ambient pod event).

use std::collections::BTreeMap;

use serde_json::{Value, json};
use test_kit::{Netns, Node, Run, bin_dir};

pub const NETWORK: &str = "mesh";

/// A pod namespace with lo up and one interface (a veth whose peer stays in
/// the pod) carrying `addresses`, enough for the plugin's family decision.
pub fn addressed_pod(node: &Node, addresses: &[&str]) -> Netns {
    let pod = node.pod("pod");
    pod.ip(&["link", "set", "lo", "up"]).success();
    pod.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "peer0"])
        .success();
    for link in ["eth0", "peer0"] {
        pod.ip(&["link", "set", link, "up"]).success();
    }
    for address in addresses {
        pod.ip(&["addr", "add", address, "dev", "eth0", "nodad"])
            .success();
    }
    pod
}

/// The plugin's entry (1.0.0) with `extra` merged in and a prevResult.
pub fn entry(extra: Value) -> Value {
    let mut doc = json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "istio-redirect",
        "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "x"}],
                       "ips": [{"address": "10.60.0.2/24", "interface": 0}]}});
    if let (Some(d), Value::Object(e)) = (doc.as_object_mut(), extra) {
        d.extend(e);
    }
    doc
}

pub struct Exec<'a> {
    pub command: &'a str,
    pub netns: Option<&'a str>,
    pub args: &'a str,
    pub path: Option<&'a str>,
}

impl<'a> Exec<'a> {
    pub fn new(command: &'a str, pod: &'a Netns) -> Self {
        Exec {
            command,
            netns: Some(pod.path_str()),
            args: "",
            path: None,
        }
    }

    pub fn args(mut self, args: &'a str) -> Self {
        self.args = args;
        self
    }

    pub fn run(&self, node: &Node, conf: &Value) -> Run {
        let bins = bin_dir();
        let mut env = BTreeMap::from([
            ("CNI_COMMAND", self.command),
            ("CNI_CONTAINERID", "istio-test"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", bins.to_str().expect("UTF-8")),
            ("CNI_ARGS", self.args),
        ]);
        if let Some(netns) = self.netns {
            env.insert("CNI_NETNS", netns);
        }
        if let Some(path) = self.path {
            env.insert("PATH", path);
        }
        node.exec_plugin("istio-redirect", &env, &conf.to_string())
    }
}

/// The prevResult as the plugin must print it: unchanged, with the empty
/// `dns` object every reference plugin prints.
pub fn passed_through(conf: &Value) -> Value {
    let mut result = conf["prevResult"].clone();
    result["dns"] = json!({});
    result
}

pub fn add(node: &Node, pod: &Netns, conf: &Value) -> Run {
    Exec::new("ADD", pod).run(node, conf)
}

pub fn k8s_args(namespace: &str, name: &str) -> String {
    format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};K8S_POD_INFRA_CONTAINER_ID=istio-test;K8S_POD_UID=1234"
    )
}

pub fn error_code(run: &Run) -> u64 {
    run.json()["code"]
        .as_u64()
        .unwrap_or_else(|| panic!("no error code: {run:?}"))
}
