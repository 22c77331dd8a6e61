//! A corpus of malformed inputs run against every plugin binary the way a
//! runtime runs it (CNI_* variables, JSON on stdin, inside a node
//! namespace, a pod namespace as CNI_NETNS): broken JSON, wrong types,
//! huge documents, unknown versions, invalid CIDRs, overlapping ranges,
//! bad CNI_* values, path tricks in names and types, hostile annotations.
//! Every case must answer with exactly one CNI error document on stdout,
//! carrying the expected code, exit 1, never panic, and leave the node,
//! the pod and the data directory as they were.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_kit::{Netns, Node, bin};

/// Codes from the spec: incompatible version, invalid environment, I/O
/// failure, undecodable stdin, invalid configuration.
const VERSION: u64 = 1;
const ENV: u64 = 4;
const IO: u64 = 5;
const DECODE: u64 = 6;
const CONFIG: u64 = 7;

struct Case {
    what: String,
    binary: &'static str,
    /// Variables to set (Some) or remove (None) on top of a valid ADD.
    env: Vec<(&'static str, Option<String>)>,
    stdin: Vec<u8>,
    code: u64,
}

/// A configuration each binary accepts, so that every case differs from a
/// working call by one thing.
fn valid_conf(binary: &str, data_dir: &Path) -> Value {
    let ipam = json!({"type": "host-local", "ranges": [[{"subnet": "10.61.0.0/24"}]],
                      "dataDir": data_dir, "socket": ""});
    match binary {
        "loopback" => json!({"cniVersion": "1.0.0", "name": "corpus", "type": "loopback"}),
        "bridge" => json!({"cniVersion": "1.0.0", "name": "corpus", "type": "bridge",
                           "bridge": "cnibad0", "isGateway": true, "ipMasq": true, "ipam": ipam}),
        "host-local" => json!({"cniVersion": "1.0.0", "name": "corpus", "type": "host-local", "ipam": ipam}),
        "portmap" => json!({"cniVersion": "1.0.0", "name": "corpus", "type": "portmap",
                            "stateDir": data_dir.join("portmap"),
                            "capabilities": {"portMappings": true},
                            "runtimeConfig": {"portMappings": [
                                {"hostPort": 18090, "containerPort": 80, "protocol": "tcp"}]},
                            "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.61.0.2/24"}]}}),
        "firewall" => json!({"cniVersion": "1.0.0", "name": "corpus", "type": "firewall",
                             "stateDir": data_dir.join("firewall"),
                             "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.61.0.2/24"}]}}),
        _ => json!({"cniVersion": "1.0.0", "name": "corpus", "type": "istio-redirect",
                    "kubeconfig": data_dir.join("no-kubeconfig"),
                    "capabilities": {"io.kubernetes.cri.pod-annotations": true},
                    "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {
                        "sidecar.istio.io/status": r#"{"containers":["istio-proxy"]}"#,
                        "sidecar.istio.io/interceptionMode": "REDIRECT"}},
                    "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.61.0.2/24"}]}}),
    }
}

/// `conf` with the member at JSON pointer `pointer` (`~1` for a `/` in a
/// key) set to `value`.
fn with(mut conf: Value, pointer: &str, value: Value) -> Value {
    let (parent, key) = pointer.rsplit_once('/').expect("a pointer");
    let slot = conf.pointer_mut(parent).expect("parent exists");
    slot[key.replace("~1", "/").replace("~0", "~")] = value;
    conf
}

fn bytes(conf: &Value) -> Vec<u8> {
    conf.to_string().into_bytes()
}

fn corpus(data_dir: &Path) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut add = |binary: &'static str,
                   what: String,
                   env: Vec<(&'static str, Option<String>)>,
                   stdin: Vec<u8>,
                   code| {
        cases.push(Case {
            what,
            binary,
            env,
            stdin,
            code,
        });
    };
    for binary in test_kit::PLUGINS {
        let valid = valid_conf(binary, data_dir);
        let text = valid.to_string();
        // Not JSON, or not a JSON object.
        let mut broken: Vec<(String, Vec<u8>)> = [
            "",
            "{",
            "}",
            "[",
            "null",
            "true",
            "42",
            "\"text\"",
            "[]",
            "not json",
            "{\"cniVersion\":}",
            "{'cniVersion':'1.0.0'}",
            "{\"cniVersion\":\"1.0.0\",}",
            "\u{feff}{}",
        ]
        .iter()
        .map(|s| (format!("stdin {s:?}"), s.as_bytes().to_vec()))
        .collect();
        broken.push(("invalid UTF-8".into(), vec![0xff, 0xfe, b'{', 0x80]));
        broken.push(("NUL bytes".into(), vec![0; 64]));
        broken.push(("nested 100000 deep".into(), "[".repeat(100_000).into_bytes()));
        broken.push(("trailing garbage".into(), format!("{text}}}").into_bytes()));
        for cut in 1..=6 {
            let at = text.len() * cut / 7;
            broken.push((format!("cut at byte {at}"), text.as_bytes()[..at].to_vec()));
        }
        for (what, stdin) in broken {
            add(binary, what, vec![], stdin, DECODE);
        }
        // The fields every plugin reads, with the wrong JSON type.
        // The version is what the skeleton decodes first (code 6, as Go's
        // ConfigDecoder); the rest is configuration (code 7).
        for (field, value, code) in [
            ("cniVersion", json!(1), DECODE),
            ("cniVersion", json!(["1.0.0"]), DECODE),
            ("cniVersion", json!({"v": "1.0.0"}), DECODE),
            ("name", json!(7), CONFIG),
            ("name", json!(["corpus"]), CONFIG),
        ] {
            let conf = with(valid.clone(), &format!("/{field}"), value.clone());
            add(binary, format!("{field} = {value}"), vec![], bytes(&conf), code);
        }
        // Versions nobody speaks.
        for version in [
            "0.5.0",
            "2.0.0",
            "1.1.1",
            "1.0",
            "v1.0.0",
            "1.0.0-rc1",
            "0.0.0",
            "10.0.0",
            " 1.0.0",
        ] {
            let conf = with(valid.clone(), "/cniVersion", json!(version));
            add(
                binary,
                format!("cniVersion {version:?}"),
                vec![],
                bytes(&conf),
                VERSION,
            );
        }
        // A huge document in a version nobody speaks: refused as such, read whole.
        let huge = with(
            with(valid.clone(), "/cniVersion", json!("9.9.9")),
            "/padding",
            json!("x".repeat(16 << 20)),
        );
        add(binary, "16 MiB document".into(), vec![], bytes(&huge), VERSION);
        // Network names that are no names, or paths.
        for name in [
            "", "../x", "a/b", ".hidden", "a b", "-x", "a;b", "$(id)", "a\nb", "..", "/etc", ".", "a\0b",
        ] {
            let conf = with(valid.clone(), "/name", json!(name));
            add(binary, format!("name {name:?}"), vec![], bytes(&conf), CONFIG);
        }
        // The environment.
        let valid_bytes = bytes(&valid);
        let env_cases: Vec<(&'static str, Option<&str>)> = vec![
            ("CNI_COMMAND", Some("FOO")),
            ("CNI_COMMAND", Some("add")),
            ("CNI_COMMAND", Some("ADD;DEL")),
            ("CNI_CONTAINERID", None),
            ("CNI_CONTAINERID", Some("")),
            ("CNI_CONTAINERID", Some("../x")),
            ("CNI_CONTAINERID", Some("a b")),
            ("CNI_CONTAINERID", Some("-x")),
            ("CNI_CONTAINERID", Some("x/y")),
            ("CNI_IFNAME", None),
            ("CNI_IFNAME", Some("")),
            ("CNI_IFNAME", Some("a/b")),
            ("CNI_IFNAME", Some(".")),
            ("CNI_IFNAME", Some("..")),
            ("CNI_IFNAME", Some("sixteen-bytes-xx")),
            ("CNI_IFNAME", Some("a:b")),
            ("CNI_IFNAME", Some("a b")),
            ("CNI_NETNS", None),
            ("CNI_PATH", None),
            ("CNI_PATH", Some("")),
            ("CNI_ARGS", Some("K")),
            ("CNI_ARGS", Some("K=V;Z")),
        ];
        for (key, value) in env_cases {
            // The reference loopback, portmap and firewall never read
            // CNI_ARGS (tests/plugins/loopback.rs).
            if matches!(binary, "loopback" | "portmap" | "firewall") && key == "CNI_ARGS" {
                continue;
            }
            add(
                binary,
                format!("{key}={value:?}"),
                vec![(key, value.map(str::to_owned))],
                valid_bytes.clone(),
                ENV,
            );
        }
        if !matches!(binary, "host-local" | "portmap" | "firewall") {
            // host-local, portmap and firewall work in the node's namespace
            // (as the reference's do), so only the others must notice that
            // the pod's does not exist.
            add(
                binary,
                "CNI_NETNS missing on disk".into(),
                vec![("CNI_NETNS", Some("/nonexistent/netns".into()))],
                valid_bytes.clone(),
                ENV,
            );
        }
    }
    // host-local's configuration, alone and inside the bridge.
    for binary in ["bridge", "host-local"] {
        let valid = valid_conf(binary, data_dir);
        // A name host-local cannot make a directory of (NAME_MAX is 255
        // bytes): refused as making it fails, before anything is made.
        for length in [256, 300, 4096] {
            let conf = with(valid.clone(), "/name", json!("n".repeat(length)));
            add(
                binary,
                format!("name of {length} bytes"),
                vec![],
                bytes(&conf),
                IO,
            );
        }
        for (what, ranges) in [
            ("prefix too long", json!([[{"subnet": "10.0.0.0/33"}]])),
            ("octet out of range", json!([[{"subnet": "300.1.1.1/24"}]])),
            ("IPv6 prefix too long", json!([[{"subnet": "fd00::/129"}]])),
            ("not an address", json!([[{"subnet": "abc"}]])),
            ("empty subnet", json!([[{"subnet": ""}]])),
            ("no prefix", json!([[{"subnet": "10.0.0.1"}]])),
            ("subnet of a number", json!([[{"subnet": 10}]])),
            ("a /32", json!([[{"subnet": "10.0.0.1/32"}]])),
            (
                "rangeStart outside",
                json!([[{"subnet": "10.0.0.0/24", "rangeStart": "10.0.1.5"}]]),
            ),
            (
                "rangeEnd before rangeStart",
                json!([[{"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.50", "rangeEnd": "10.0.0.10"}]]),
            ),
            (
                "gateway outside",
                json!([[{"subnet": "10.0.0.0/24", "gateway": "10.9.9.9"}]]),
            ),
            (
                "overlapping sets",
                json!([[{"subnet": "10.0.0.0/24"}], [{"subnet": "10.0.0.0/25"}]]),
            ),
            (
                "overlapping in one set",
                json!([[{"subnet": "10.0.0.0/24"}, {"subnet": "10.0.0.128/25"}]]),
            ),
            (
                "two families in one set",
                json!([[{"subnet": "10.0.0.0/24"}, {"subnet": "fd00::/64"}]]),
            ),
            ("empty set", json!([[]])),
            ("ranges of a string", json!("10.0.0.0/24")),
            ("no ranges at all", json!([])),
            (
                "ten thousand overlapping sets",
                Value::Array(vec![json!([{"subnet": "10.0.0.0/24"}]); 10_000]),
            ),
        ] {
            let conf = with(valid.clone(), "/ipam/ranges", ranges);
            add(binary, format!("ranges: {what}"), vec![], bytes(&conf), CONFIG);
        }
        for (what, routes) in [
            ("route without dst", json!([{"gw": "10.0.0.1"}])),
            ("route dst not a CIDR", json!([{"dst": "default"}])),
        ] {
            let conf = with(valid.clone(), "/ipam/routes", routes);
            add(binary, format!("routes: {what}"), vec![], bytes(&conf), CONFIG);
        }
    }
    // The bridge's own keys.
    let bridge = valid_conf("bridge", data_dir);
    for (pointer, value) in [
        ("/mtu", json!("x")),
        ("/mtu", json!(-1)),
        ("/vlan", json!(5000)),
        ("/vlan", json!(-1)),
        ("/vlanTrunk", json!([{"minID": 10, "maxID": 5}])),
        ("/vlanTrunk", json!([{"id": 9999}])),
        ("/ipMasqBackend", json!("pf")),
        ("/hairpinMode", json!("yes")),
        ("/bridge", json!("a/b")),
        ("/bridge", json!("x".repeat(20))),
        ("/bridge", json!("")),
        ("/ipam/type", json!("../../bin/sh")),
        ("/ipam/type", json!("/bin/sh")),
        ("/ipam/type", json!("sub/dir")),
        ("/ipam/type", json!("..")),
        ("/args", json!({"cni": {"mac": "zz:zz:zz:zz:zz:zz"}})),
    ] {
        let conf = with(bridge.clone(), pointer, value.clone());
        add(
            "bridge",
            format!("{pointer} = {value}"),
            vec![],
            bytes(&conf),
            CONFIG,
        );
    }
    let promisc_hairpin = with(
        with(bridge.clone(), "/promiscMode", json!(true)),
        "/hairpinMode",
        json!(true),
    );
    add(
        "bridge",
        "promiscMode with hairpinMode".into(),
        vec![],
        bytes(&promisc_hairpin),
        CONFIG,
    );
    // portmap's and firewall's own keys, and hostile mappings.
    let portmap = valid_conf("portmap", data_dir);
    let mapping = "/runtimeConfig/portMappings/0";
    for (pointer, value) in [
        (format!("{mapping}/hostPort"), json!(0)),
        (format!("{mapping}/hostPort"), json!(70000)),
        (format!("{mapping}/containerPort"), json!(-1)),
        (format!("{mapping}/protocol"), json!("icmp")),
        (format!("{mapping}/protocol"), json!("tcp -j ACCEPT")),
        (format!("{mapping}/hostIP"), json!("10.0.0.1;reboot")),
        ("/markMasqBit".into(), json!(32)),
        ("/backend".into(), json!("pf")),
        ("/conditionsV4".into(), json!("-j ACCEPT")),
        ("/externalSetMarkChain".into(), json!("A B")),
        (
            "/prevResult".into(),
            json!({"cniVersion": "1.0.0", "ips": [{"address": "x"}]}),
        ),
    ] {
        let conf = with(portmap.clone(), &pointer, value.clone());
        add(
            "portmap",
            format!("{pointer} = {value}"),
            vec![],
            bytes(&conf),
            CONFIG,
        );
    }
    let firewall = valid_conf("firewall", data_dir);
    for (pointer, value) in [
        ("/backend", json!("pf")),
        ("/backend", json!("firewalld")),
        ("/ingressPolicy", json!("isolated")),
        ("/iptablesAdminChainName", json!("A B")),
        ("/iptablesAdminChainName", json!("x".repeat(40))),
    ] {
        let conf = with(firewall.clone(), pointer, value.clone());
        add(
            "firewall",
            format!("{pointer} = {value}"),
            vec![],
            bytes(&conf),
            CONFIG,
        );
    }
    // Hostile annotations and settings for istio-redirect.
    let mesh = valid_conf("istio-redirect", data_dir);
    let annotations = "/runtimeConfig/io.kubernetes.cri.pod-annotations";
    for (key, value) in [
        ("sidecar.istio.io/interceptionMode", "EVIL"),
        ("traffic.sidecar.istio.io/includeOutboundIPRanges", "999.0.0.0/8"),
        (
            "traffic.sidecar.istio.io/includeOutboundIPRanges",
            "10.0.0.0/8;rm -rf /",
        ),
        ("traffic.sidecar.istio.io/excludeOutboundIPRanges", "$(reboot)"),
        ("traffic.sidecar.istio.io/excludeOutboundPorts", "99999"),
        ("traffic.sidecar.istio.io/excludeOutboundPorts", "1;rm -rf /"),
        ("traffic.sidecar.istio.io/includeInboundPorts", "-1"),
        ("traffic.sidecar.istio.io/excludeInboundPorts", "abc"),
        ("traffic.sidecar.istio.io/excludeInterfaces", "eth0 -j ACCEPT"),
        ("sidecar.istio.io/status", "{not json"),
    ] {
        let pointer = format!("{annotations}/{}", key.replace('/', "~1"));
        let conf = with(mesh.clone(), &pointer, json!(value));
        add(
            "istio-redirect",
            format!("annotation {key}={value:?}"),
            vec![],
            bytes(&conf),
            CONFIG,
        );
    }
    for (key, value) in [
        ("proxy_uid", json!("x")),
        ("proxy_uid", json!(-5)),
        ("iptables_backend", json!("pf")),
        ("exclude_namespaces", json!("kube-system")),
        ("api_attempts", json!("many")),
    ] {
        let conf = with(mesh.clone(), &format!("/{key}"), value.clone());
        add(
            "istio-redirect",
            format!("{key} = {value}"),
            vec![],
            bytes(&conf),
            CONFIG,
        );
    }
    cases
}

struct Answer {
    status: Option<i32>,
    stdout: Vec<u8>,
    stderr: String,
}

fn run(node: &Netns, binary: &str, env: &BTreeMap<&str, String>, stdin: &[u8]) -> Answer {
    let mut child = Command::new("ip")
        .args(["netns", "exec", node.name()])
        .arg(bin(binary))
        .env_clear()
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the plugin");
    let mut pipe = child.stdin.take().expect("stdin");
    let input = stdin.to_vec();
    // A plugin may answer before reading everything; that is fine.
    let writer = std::thread::spawn(move || {
        let _ = pipe.write_all(&input);
    });
    let started = Instant::now();
    let output = child.wait_with_output().expect("wait for the plugin");
    let _ = writer.join();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{binary} took {:?}",
        started.elapsed()
    );
    Answer {
        status: output.status.code(),
        stdout: output.stdout,
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Exactly one JSON document, and nothing else but whitespace.
fn one_document(stdout: &[u8]) -> Result<Value, String> {
    let mut documents = serde_json::Deserializer::from_slice(stdout).into_iter::<Value>();
    let first = documents
        .next()
        .ok_or("no document")?
        .map_err(|e| format!("not JSON: {e}"))?;
    match documents.next() {
        None => Ok(first),
        Some(_) => Err("more than one document".into()),
    }
}

/// What a failed call must not have changed.
fn state(node: &Node, pod: &Netns, data_dir: &Path) -> Vec<String> {
    let mut seen = vec![
        node.netns.ip(&["-o", "link"]).stdout,
        node.netns.ip(&["-o", "addr"]).stdout,
        pod.ip(&["-o", "link"]).stdout,
        pod.ip(&["-o", "addr"]).stdout,
        node.run("iptables-save", &[]).stdout,
        node.run("ip6tables-save", &[]).stdout,
        node.run("nft", &["list", "ruleset"]).stdout,
        pod.ip(&["rule"]).stdout,
    ];
    let mut files: Vec<String> = walk(data_dir);
    files.sort();
    seen.push(files.join("\n"));
    // Counters and timestamps in the iptables dumps are not changes.
    seen.iter()
        .map(|s| {
            s.lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| l.split(" [").next().unwrap_or(l))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect()
}

fn walk(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|e| {
            let path = e.path();
            let mut here = vec![path.display().to_string()];
            if path.is_dir() {
                here.extend(walk(&path));
            }
            here
        })
        .collect()
}

/// A valid ADD's environment, as a runtime sets it.
fn base_env(pod: &Netns, binary: &str) -> BTreeMap<&'static str, String> {
    let mut env: BTreeMap<&str, String> = [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "corpus-1"),
        ("CNI_NETNS", pod.path_str()),
        ("CNI_IFNAME", "eth0"),
        (
            "CNI_PATH",
            bin("loopback").parent().and_then(Path::to_str).expect("UTF-8"),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.to_owned()))
    .collect();
    if binary == "istio-redirect" {
        env.insert(
            "CNI_ARGS",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=x".into(),
        );
    }
    env
}

#[test]
fn every_binary_answers_every_malformed_input_with_one_cni_error_and_changes_nothing() {
    let node = Node::new();
    let pod = node.pod("pod");
    let data_dir = node.path("data");
    std::fs::create_dir(&data_dir).expect("mkdir");
    let cases = corpus(&data_dir);
    assert!(cases.len() >= 200, "{} cases", cases.len());
    let before = state(&node, &pod, &data_dir);
    let mut failures = Vec::new();
    for case in &cases {
        let mut env = base_env(&pod, case.binary);
        for (key, value) in &case.env {
            match value {
                Some(v) => env.insert(key, v.clone()),
                None => env.remove(key),
            };
        }
        let answer = run(&node.netns, case.binary, &env, &case.stdin);
        let verdict = match one_document(&answer.stdout) {
            _ if answer.stderr.contains("panicked") => Err(format!("panicked: {}", answer.stderr)),
            _ if answer.status != Some(1) => Err(format!("exit status {:?}", answer.status)),
            Err(e) => Err(e),
            Ok(doc) => {
                let well_formed =
                    doc["msg"].as_str().is_some_and(|m| !m.is_empty()) && doc["cniVersion"].is_string();
                if doc["code"] != case.code {
                    Err(format!("code {} instead of {}: {doc}", doc["code"], case.code))
                } else if case.code == ENV && doc["cniVersion"] != "1.0.0" {
                    Err(format!("not the configuration's version: {doc}"))
                } else if !well_formed {
                    Err(format!("not a CNI error document: {doc}"))
                } else {
                    Ok(())
                }
            }
        };
        // Anything a rollback removes is gone when the reply is printed.
        let verdict = verdict.and_then(|()| {
            if state(&node, &pod, &data_dir) == before {
                Ok(())
            } else {
                Err("the machine changed".to_owned())
            }
        });
        if let Err(why) = verdict {
            failures.push(format!(
                "{} / {}: {why}\n  stdout: {}",
                case.binary,
                case.what,
                String::from_utf8_lossy(&answer.stdout)
                    .chars()
                    .take(300)
                    .collect::<String>()
            ));
        }
    }
    // And the configuration every case departs from does work: each case
    // is refused for the one thing it changed.
    for binary in test_kit::PLUGINS {
        let mut env = base_env(&pod, binary);
        let conf = bytes(&valid_conf(binary, &data_dir));
        let added = run(&node.netns, binary, &env, &conf);
        assert_eq!(
            added.status,
            Some(0),
            "{binary}: {}{}",
            String::from_utf8_lossy(&added.stdout),
            added.stderr
        );
        env.insert("CNI_COMMAND", "DEL".into());
        assert_eq!(
            run(&node.netns, binary, &env, &conf).status,
            Some(0),
            "{binary} DEL"
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
