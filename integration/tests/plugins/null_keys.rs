//! Go's `encoding/json` reads `null` as an absent key (a slice, map,
//! pointer or interface becomes nil, any other field keeps its default) and
//! fails nothing for it, and the reference plugins' own test suites send
//! such documents: the bridge's IPAM section holds `"routes": null`. Every
//! binary, executed as a runtime executes it (CNI_* variables, stdin, inside
//! a node namespace, a fresh pod namespace as CNI_NETNS), answers a
//! configuration with one key `null` exactly as it answers that
//! configuration without the key.

use std::path::Path;

use serde_json::{Value, json};
use test_kit::{Netns, Node, Run, bin, bin_dir, run_in};

/// Keys whose absence means a default place on the machine itself (the
/// data directory, the lease service's socket, the state directory): left
/// set here, and tested null against absent by each crate's unit tests.
const MACHINE_DEFAULTS: [&str; 3] = ["/ipam/dataDir", "/ipam/socket", "/stateDir"];

/// A result as the bridge chained before the others returns it, with every
/// key a result has.
fn prev_result(pod: &str) -> Value {
    json!({"cniVersion": "1.0.0",
        "interfaces": [{"name": "cninull0", "mac": "c2:00:00:00:62:10"},
                       {"name": "eth0", "mac": "c2:00:00:00:62:11", "mtu": 1500, "sandbox": pod}],
        "ips": [{"address": "10.62.1.12/24", "gateway": "10.62.1.1", "interface": 1}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.62.1.1", "mtu": 1400, "advmss": 1300, "priority": 5}],
        "dns": {"nameservers": ["10.62.0.53"], "domain": "cluster.local", "search": ["svc"],
                "options": ["ndots:5"]}})
}

/// host-local's section with every key it reads set.
fn host_local(data_dir: &Path, resolv_conf: &Path) -> Value {
    let range = |net: &str| {
        json!({"subnet": format!("{net}.0/24"), "rangeStart": format!("{net}.10"),
               "rangeEnd": format!("{net}.200"), "gateway": format!("{net}.1")})
    };
    json!({"type": "host-local", "subnet": "10.62.2.0/24", "rangeStart": "10.62.2.10",
        "rangeEnd": "10.62.2.200", "gateway": "10.62.2.1", "Name": "nullwalk",
        "routes": [{"dst": "192.168.62.0/24", "mtu": 1400, "advmss": 1300, "priority": 5}],
        "ranges": [[range("10.62.3")]], "dataDir": data_dir, "resolvConf": resolv_conf,
        "socket": ""})
}

/// Configurations of `binary` that set every key it reads (two for
/// portmap, whose `markMasqBit` and `externalSetMarkChain` exclude each
/// other), each one that ADD accepts. VLAN filtering is left off: not
/// every kernel the tests run on has it. The bridge forces its address: it
/// is the gateway of host-local's three ranges of one family.
fn full_confs(binary: &str, node: &Node, pod: &str) -> Vec<Value> {
    let resolv_conf = node.path("resolv.conf");
    std::fs::write(&resolv_conf, "nameserver 10.62.0.53\nsearch svc\n").expect("resolv.conf");
    let ipam = host_local(&node.path("ipam"), &resolv_conf);
    let dns = json!({"nameservers": ["10.62.0.53"], "domain": "cluster.local", "search": ["svc"],
                     "options": ["ndots:5"]});
    let attachments = json!([{"containerID": "other", "ifname": "eth0"}]);
    let runtime_ranges = json!([[{"subnet": "10.62.1.0/24", "rangeStart": "10.62.1.10",
                                  "rangeEnd": "10.62.1.200", "gateway": "10.62.1.1"}]]);
    let shared = json!({"cniVersion": "1.0.0", "name": "nullwalk", "type": binary,
        "cni.dev/valid-attachments": attachments, "cni.dev/attachments": attachments});
    let with = |own: Value| {
        let mut conf = shared.clone();
        if let (Some(conf), Value::Object(own)) = (conf.as_object_mut(), own) {
            conf.extend(own);
        }
        conf
    };
    match binary {
        "loopback" => vec![with(json!({"dns": dns, "capabilities": {"mac": true},
            "ipam": {"type": "none"}, "prevResult": prev_result(pod)}))],
        "bridge" => vec![with(json!({"bridge": "cninull0", "isGateway": true,
            "isDefaultGateway": true, "forceAddress": true, "ipMasq": true,
            "ipMasqBackend": "iptables", "mtu": 1400, "hairpinMode": false, "promiscMode": false,
            "vlan": 0, "vlanTrunk": [],
            "preserveDefaultVlan": false, "macspoofchk": true, "enabledad": false,
            "disableContainerInterface": false, "portIsolation": false,
            "capabilities": {"mac": true, "ips": true, "ipRanges": true}, "dns": dns,
            "runtimeConfig": {"mac": "c2:00:00:00:62:01", "ips": ["10.62.1.12/24"],
                              "ipRanges": runtime_ranges},
            "args": {"cni": {"mac": "c2:00:00:00:62:02", "ips": ["10.62.1.13"]}},
            "ipam": ipam}))],
        "host-local" => vec![with(json!({"capabilities": {"ips": true, "ipRanges": true},
            "runtimeConfig": {"ips": ["10.62.1.12/24"], "ipRanges": runtime_ranges},
            "args": {"cni": {"ips": ["10.62.1.13"]}}, "ipam": ipam}))],
        "portmap" => {
            let mapping = json!({"hostPort": 18062, "containerPort": 80, "protocol": "tcp",
                                 "hostIP": "10.62.9.1"});
            let common = json!({"snat": true, "masqAll": false, "stateDir": node.path("portmap"),
                "ipam": {"type": "none"}, "capabilities": {"portMappings": true},
                "runtimeConfig": {"portMappings": [mapping]}, "prevResult": prev_result(pod)});
            [
                json!({"backend": "iptables", "externalSetMarkChain": "KUBE-MARK-MASQ",
                       "conditionsV4": ["!", "-d", "10.63.0.0/16"], "conditionsV6": ["!", "-d", "fd63::/64"]}),
                json!({"backend": "nftables", "markMasqBit": 13,
                       "conditionsV4": ["ip", "daddr", "!=", "10.63.0.0/16"]}),
            ]
            .into_iter()
            .map(|backend| {
                let mut conf = with(common.clone());
                if let (Some(conf), Value::Object(backend)) = (conf.as_object_mut(), backend) {
                    conf.extend(backend);
                }
                conf
            })
            .collect()
        }
        "firewall" => vec![with(json!({"backend": "iptables",
            "iptablesAdminChainName": "CNI-NULL-ADMIN", "firewalldZone": "trusted",
            "ingressPolicy": "same-bridge", "stateDir": node.path("firewall"),
            "ipam": {"type": "none"}, "prevResult": prev_result(pod)}))],
        _ => vec![with(
            json!({"plugin_log_level": "info", "cni_agent_run_dir": node.path("istio"),
            "ambient_enabled": false, "enablement_selectors": [],
            "exclude_namespaces": ["kube-system"], "pod_namespace": "istio-system",
            "native_nftables": false, "kubeconfig": node.path("no-kubeconfig"),
            "proxy_uid": 1337, "proxy_gid": 1337, "dns_capture": false, "dual_stack": false,
            "invalid_drop": false, "redirect": {"interceptionMode": "REDIRECT"},
            "api_attempts": 1, "api_retry_delay_ms": 10, "api_deadline_ms": 2000,
            "ipam": {"type": "none"},
            "capabilities": {"io.kubernetes.cri.pod-annotations": true},
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {
                "sidecar.istio.io/status": r#"{"containers":["istio-proxy"]}"#,
                "sidecar.istio.io/interceptionMode": "REDIRECT",
                "traffic.sidecar.istio.io/excludeInboundPorts": "22"}},
            "prevResult": prev_result(pod)}),
        )],
    }
}

/// The JSON pointer of every member of every object in `value`.
fn member_pointers(value: &Value, at: &str) -> Vec<String> {
    match value {
        Value::Object(map) => map
            .iter()
            .flat_map(|(key, inner)| {
                let pointer = format!("{at}/{}", key.replace('~', "~0").replace('/', "~1"));
                let mut here = vec![pointer.clone()];
                here.extend(member_pointers(inner, &pointer));
                here
            })
            .collect(),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .flat_map(|(i, inner)| member_pointers(inner, &format!("{at}/{i}")))
            .collect(),
        _ => Vec::new(),
    }
}

/// `conf` with the member at `pointer` set to `value`, or removed for None.
fn replaced(conf: &Value, pointer: &str, value: Option<Value>) -> Value {
    let mut conf = conf.clone();
    let (parent, key) = pointer.rsplit_once('/').expect("a pointer");
    let key = key.replace("~1", "/").replace("~0", "~");
    let map = conf
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .expect("an object holds the member");
    match value {
        Some(value) => {
            map.insert(key, value);
        }
        None => {
            map.shift_remove(&key);
        }
    }
    conf
}

fn exec(node: &Node, binary: &str, command: &str, container: &str, pod: &Netns, conf: &Value) -> Run {
    let bins = bin_dir();
    let mut env = vec![
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", container),
        ("CNI_NETNS", pod.path_str()),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", bins.to_str().expect("UTF-8")),
    ];
    if binary == "istio-redirect" {
        env.push((
            "CNI_ARGS",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=x",
        ));
    }
    run_in(node.netns.path(), &bin(binary), &[], &env, &conf.to_string())
}

/// What a runtime sees of an answer: the exit status, and the error's code
/// and message when there is one.
fn outcome(run: &Run) -> String {
    if run.ok() {
        return "exit 0".to_owned();
    }
    let error: Value = serde_json::from_str(&run.stdout).unwrap_or(Value::Null);
    format!(
        "exit {:?}, code {}, msg {}",
        run.code, error["code"], error["msg"]
    )
}

/// ADD in a fresh pod namespace, then DEL of the same configuration: both
/// outcomes.
fn add_then_del(node: &Node, binary: &str, container: &str, conf: &Value) -> (String, String) {
    let pod = node.pod("null");
    pod.ip(&["link", "set", "lo", "up"]).success();
    let added = exec(node, binary, "ADD", container, &pod, conf);
    let deleted = exec(node, binary, "DEL", container, &pod, conf);
    (outcome(&added), outcome(&deleted))
}

#[test]
fn every_key_of_every_binary_answers_null_as_it_answers_the_key_absent() {
    let node = Node::new();
    let placeholder = node.pod("placeholder");
    // Kubernetes' chain, which portmap's `externalSetMarkChain` names.
    for tool in ["iptables", "ip6tables"] {
        node.run(tool, &["-t", "nat", "-N", "KUBE-MARK-MASQ"]).success();
    }
    let mut walked = 0;
    // Keys without which ADD still succeeds: those compare whole runs.
    let mut added = 0;
    let mut differences = Vec::new();
    for binary in test_kit::PLUGINS {
        for (n, full) in full_confs(binary, &node, placeholder.path_str())
            .iter()
            .enumerate()
        {
            let whole = add_then_del(&node, binary, &format!("{binary}-{n}-whole"), full);
            assert_eq!(
                whole,
                ("exit 0".to_owned(), "exit 0".to_owned()),
                "{binary}: the whole configuration {full}"
            );
            for (i, pointer) in member_pointers(full, "").iter().enumerate() {
                if MACHINE_DEFAULTS.contains(&pointer.as_str()) {
                    continue;
                }
                walked += 1;
                let container = format!("{binary}-{n}-{i}");
                let null = add_then_del(
                    &node,
                    binary,
                    &format!("{container}-null"),
                    &replaced(full, pointer, Some(Value::Null)),
                );
                let absent = add_then_del(
                    &node,
                    binary,
                    &format!("{container}-absent"),
                    &replaced(full, pointer, None),
                );
                if absent.0 == "exit 0" {
                    added += 1;
                }
                if null != absent {
                    differences.push(format!(
                        "{binary} {pointer}: null answers {null:?}, absent {absent:?}"
                    ));
                }
            }
        }
    }
    eprintln!("{walked} keys walked, ADD succeeded without {added} of them");
    assert!(
        walked >= 250 && added >= walked / 2,
        "{walked} keys walked, {added} without failing ADD"
    );
    assert!(
        differences.is_empty(),
        "{} of {walked} keys answer null otherwise than absent:\n{}",
        differences.len(),
        differences.join("\n")
    );
}

/// The reference bridge suite's configuration: host-local's `routes` is a
/// nil slice, which Go marshals as `null`.
#[test]
fn bridge_add_and_check_accept_an_ipam_section_with_null_routes() {
    let node = Node::new();
    let pod = node.pod("pod");
    let mut conf = json!({"cniVersion": "1.0.0", "name": "nullroutes", "type": "bridge",
        "bridge": "cninull1", "isGateway": true, "ipMasq": false,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.62.10.0/24"}]],
                 "routes": null, "dataDir": node.path("ipam"), "socket": ""}});
    let added = exec(&node, "bridge", "ADD", "nullroutes", &pod, &conf);
    assert!(added.ok(), "ADD: {added:?}");
    conf["prevResult"] = added.json();
    let checked = exec(&node, "bridge", "CHECK", "nullroutes", &pod, &conf);
    assert!(checked.ok(), "CHECK: {checked:?}");
    let deleted = exec(&node, "bridge", "DEL", "nullroutes", &pod, &conf);
    assert!(deleted.ok(), "DEL: {deleted:?}");
}
