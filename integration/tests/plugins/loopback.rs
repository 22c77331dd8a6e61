//! loopback and cnictl end to end: real namespaces, the built binaries
//! executed the way a runtime executes them.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use test_kit::{Node, cnitool_container_id};

const VERSIONS: [&str; 7] = ["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

fn loopback_list(node: &Node, version: &str) {
    node.write_conf(
        "10-lo.conflist",
        &json!({"cniVersion": version, "name": "lo-net", "plugins": [{"type": "loopback"}]}),
    );
}

fn assert_result_shape(version: &str, doc: &Value, netns: &str) {
    assert_eq!(doc["cniVersion"], version);
    assert_eq!(
        doc["dns"],
        json!({}),
        "{version}: dns is printed empty, as Go does"
    );
    match version {
        "0.1.0" | "0.2.0" => {
            assert_eq!(doc["ip4"], json!({"ip": "127.0.0.1/8"}), "{version}: {doc}");
            assert_eq!(doc["ip6"], json!({"ip": "::1/128"}), "{version}: {doc}");
            assert!(
                doc.get("interfaces").is_none() && doc.get("ips").is_none(),
                "{doc}"
            );
        }
        _ => {
            assert_eq!(
                doc["interfaces"],
                json!([{"name": "lo", "mac": "00:00:00:00:00:00", "sandbox": netns}])
            );
            let tagged = matches!(version, "0.3.0" | "0.3.1" | "0.4.0");
            let expected = |v: &str, address: &str| {
                if tagged {
                    json!({"version": v, "interface": 0, "address": address})
                } else {
                    json!({"interface": 0, "address": address})
                }
            };
            assert_eq!(
                doc["ips"],
                json!([expected("4", "127.0.0.1/8"), expected("6", "::1/128")]),
                "{version}"
            );
        }
    }
}

#[test]
fn add_check_del_in_every_version() {
    for version in VERSIONS {
        let node = Node::new();
        let pod = node.pod("pod");
        loopback_list(&node, version);
        assert!(!pod.link_is_up("lo"), "a new namespace starts with lo down");

        let added = node
            .cnictl(&["--json", "add", "lo-net", pod.path_str()])
            .success();
        assert_result_shape(version, &added.json(), pod.path_str());
        assert!(pod.link_is_up("lo"), "{version}: ADD sets lo up");
        let id = cnitool_container_id(pod.path_str());
        let cached = node
            .cache_entry("lo-net", &id, "eth0")
            .expect("ADD caches its result");
        assert_eq!(cached["result"], added.json());

        let check = node.cnictl(&["check", "lo-net", pod.path_str()]);
        if matches!(version, "0.4.0" | "1.0.0" | "1.1.0") {
            check.success();
        } else {
            let failed = check.failure();
            assert!(
                failed.stderr.contains("does not support the CHECK command"),
                "{failed:?}"
            );
        }

        node.cnictl(&["del", "lo-net", pod.path_str()]).success();
        assert!(!pod.link_is_up("lo"), "{version}: DEL sets lo down");
        assert!(
            node.cache_entry("lo-net", &id, "eth0").is_none(),
            "DEL removes the cache entry"
        );
        node.cnictl(&["del", "lo-net", pod.path_str()]).success();
    }
}

#[test]
fn check_fails_once_lo_is_down() {
    let node = Node::new();
    let pod = node.pod("pod");
    loopback_list(&node, "1.0.0");
    node.cnictl(&["add", "lo-net", pod.path_str()]).success();
    pod.ip(&["link", "set", "lo", "down"]).success();
    let failed = node
        .cnictl(&["--json", "check", "lo-net", pod.path_str()])
        .failure();
    let err = failed.json();
    assert_eq!(err["code"], 100, "{failed:?}");
    assert!(
        err["msg"]
            .as_str()
            .is_some_and(|m| m.ends_with("loopback interface is down")),
        "{err}"
    );
}

#[test]
fn del_succeeds_once_the_namespace_is_gone() {
    let node = Node::new();
    let pod = node.pod("pod");
    let path = pod.path_str().to_owned();
    loopback_list(&node, "1.1.0");
    node.cnictl(&["add", "lo-net", &path]).success();
    pod.delete();
    node.cnictl(&["del", "lo-net", &path]).success();
    let id = cnitool_container_id(&path);
    assert!(node.cache_entry("lo-net", &id, "eth0").is_none());
}

fn plugin_env<'a>(command: &'a str, netns: &'a str) -> BTreeMap<&'a str, &'a str> {
    BTreeMap::from([
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", "ctr-1"),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "lo"),
        ("CNI_PATH", "/nonexistent"),
    ])
}

#[test]
fn del_with_an_empty_netns_succeeds() {
    let node = Node::new();
    let conf = json!({"cniVersion": "1.0.0", "name": "lo-net", "type": "loopback"}).to_string();
    let run = node
        .exec_plugin("loopback", &plugin_env("DEL", ""), &conf)
        .success();
    assert_eq!(run.stdout, "", "DEL prints nothing on success");
}

#[test]
fn a_prev_result_is_passed_through() {
    let node = Node::new();
    let pod = node.pod("pod");
    let prev = json!({"cniVersion": "0.4.0",
        "interfaces": [{"name": "eth0", "sandbox": pod.path_str()}],
        "ips": [{"version": "4", "interface": 0, "address": "10.9.0.5/24", "gateway": "10.9.0.1"}],
        "dns": {}});
    let conf = json!({"cniVersion": "0.4.0", "name": "lo-net", "type": "loopback", "prevResult": prev});
    let run = node
        .exec_plugin("loopback", &plugin_env("ADD", pod.path_str()), &conf.to_string())
        .success();
    assert_eq!(run.json(), prev);
    assert!(pod.link_is_up("lo"), "lo is set up even when chained");
}

#[test]
fn protocol_errors_are_one_json_document_with_the_spec_code() {
    let node = Node::new();
    let pod = node.pod("pod");
    let netns = pod.path_str();
    let good = json!({"cniVersion": "1.0.0", "name": "lo-net", "type": "loopback"}).to_string();
    let cases: [(BTreeMap<&str, &str>, String, u64, &str); 6] = [
        (
            BTreeMap::from([("CNI_COMMAND", "ADD"), ("CNI_IFNAME", "lo")]),
            good.clone(),
            4,
            "required env variables [CNI_CONTAINERID,CNI_NETNS,CNI_PATH] missing",
        ),
        (plugin_env("ADD", netns), "{not json".into(), 6, ""),
        (
            plugin_env("ADD", netns),
            json!({"cniVersion": "0.5.0", "name": "n"}).to_string(),
            1,
            "incompatible CNI versions",
        ),
        (
            plugin_env("CHECK", netns),
            json!({"cniVersion": "0.3.1", "name": "n"}).to_string(),
            1,
            "config version does not allow CHECK",
        ),
        (
            plugin_env("ADD", netns),
            json!({"cniVersion": "1.0.0"}).to_string(),
            7,
            "missing network name",
        ),
        (
            {
                let mut env = plugin_env("ADD", netns);
                env.insert("CNI_IFNAME", "this-is-far-too-long");
                env
            },
            good.clone(),
            4,
            "interface name is too long",
        ),
    ];
    for (env, stdin, code, msg) in cases {
        let failed = node.exec_plugin("loopback", &env, &stdin).failure();
        let err = failed.json();
        assert_eq!(err["code"], code, "{failed:?}");
        if !msg.is_empty() {
            assert_eq!(err["msg"], msg, "{failed:?}");
        }
        assert!(err["cniVersion"].is_string(), "{err}");
    }
    assert!(!pod.link_is_up("lo"), "no failed invocation changed the pod");
}

#[test]
fn errors_found_before_the_configuration_is_read_speak_its_version() {
    let node = Node::new();
    let pod = node.pod("pod");
    for version in ["0.3.1", "1.0.0"] {
        let conf = json!({"cniVersion": version, "name": "lo-net", "type": "loopback"}).to_string();
        let mut env = plugin_env("ADD", pod.path_str());
        env.insert("CNI_IFNAME", "sixteen-bytes-xx");
        let err = node.exec_plugin("loopback", &env, &conf).failure().json();
        assert_eq!(
            (&err["code"], &err["cniVersion"]),
            (&json!(4), &json!(version)),
            "{err}"
        );
        env.insert("CNI_IFNAME", "lo");
        env.remove("CNI_PATH");
        let err = node.exec_plugin("loopback", &env, &conf).failure().json();
        assert_eq!(err["msg"], "required env variables [CNI_PATH] missing");
        assert_eq!(err["cniVersion"], version, "{err}");
    }
    // Nothing to read a version from: the newest.
    let mut env = plugin_env("ADD", pod.path_str());
    env.insert("CNI_CONTAINERID", "a/b");
    let err = node.exec_plugin("loopback", &env, "{not json").failure().json();
    assert_eq!(
        (&err["code"], &err["cniVersion"]),
        (&json!(4), &json!("1.1.0")),
        "{err}"
    );
    assert!(!pod.link_is_up("lo"));
}

#[test]
fn cni_args_it_does_not_read_do_not_fail_it() {
    let node = Node::new();
    let pod = node.pod("pod");
    let conf = json!({"cniVersion": "1.0.0", "name": "lo-net", "type": "loopback"}).to_string();
    for args in ["none", "K", "=V;;x"] {
        let mut env = plugin_env("ADD", pod.path_str());
        env.insert("CNI_ARGS", args);
        let added = node.exec_plugin("loopback", &env, &conf).success().json();
        let prev = json!({"cniVersion": "1.0.0", "name": "lo-net", "type": "loopback",
                          "prevResult": added});
        for command in ["CHECK", "DEL"] {
            env.insert("CNI_COMMAND", command);
            node.exec_plugin("loopback", &env, &prev.to_string()).success();
        }
    }
}

#[test]
fn version_and_about_text() {
    let node = Node::new();
    let version = node
        .exec_plugin("loopback", &BTreeMap::from([("CNI_COMMAND", "VERSION")]), "")
        .success();
    assert_eq!(
        version.json(),
        json!({"cniVersion": "1.1.0", "supportedVersions": VERSIONS})
    );
    let about = node.exec_plugin("loopback", &BTreeMap::new(), "").success();
    assert_eq!(about.stdout, "", "the about text goes to stderr");
    assert!(about.stderr.starts_with("CNI loopback plugin v"), "{about:?}");
    assert!(
        about
            .stderr
            .contains("0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0")
    );
}

#[test]
fn the_plugins_own_namespace_is_never_changed() {
    let node = Node::new();
    node.netns.ip(&["link", "set", "lo", "up"]).success();
    loopback_list(&node, "1.0.0");
    let failed = node
        .cnictl(&["--json", "del", "lo-net", node.netns.path_str()])
        .failure();
    assert_eq!(failed.json()["code"], 8, "{failed:?}");
    assert!(node.netns.link_is_up("lo"), "the node's lo must stay up");
}

#[test]
fn gc_deletes_attachments_that_are_not_valid() {
    let node = Node::new();
    let (keep, stale, gone) = (node.pod("keep"), node.pod("stale"), node.pod("gone"));
    loopback_list(&node, "1.1.0");
    for pod in [&keep, &stale, &gone] {
        node.cnictl(&["add", "lo-net", pod.path_str()]).success();
    }
    let id = |p: &test_kit::Netns| cnitool_container_id(p.path_str());

    node.cnictl(&["gc", "lo-net"]).failure();
    assert!(keep.link_is_up("lo"), "gc without a selector does nothing");

    let valid: Vec<String> = [&keep, &gone].iter().map(|p| format!("{}/eth0", id(p))).collect();
    let mut args = vec!["--json", "gc", "lo-net", "--valid"];
    args.extend(valid.iter().map(String::as_str));
    let report = node.cnictl(&args).success().json();
    assert_eq!(
        report["deleted"],
        json!([{"containerID": id(&stale), "ifname": "eth0"}])
    );
    assert!(!stale.link_is_up("lo"), "the stale attachment was DELed");
    assert!(keep.link_is_up("lo") && gone.link_is_up("lo"));

    let gone_id = id(&gone);
    gone.delete();
    let report = node
        .cnictl(&["--json", "gc", "lo-net", "--prune-missing-netns"])
        .success()
        .json();
    assert_eq!(
        report["deleted"],
        json!([{"containerID": gone_id, "ifname": "eth0"}])
    );
    assert!(node.cache_entry("lo-net", &gone_id, "eth0").is_none());
    assert!(keep.link_is_up("lo"));

    node.cnictl(&["gc", "lo-net", "--all"]).success();
    assert!(!keep.link_is_up("lo"));
    assert!(node.cache_entry("lo-net", &id(&keep), "eth0").is_none());
}

#[test]
fn status_asks_plugins_from_1_1_0_on() {
    let node = Node::new();
    loopback_list(&node, "1.1.0");
    let status = node.cnictl(&["--json", "status", "lo-net"]).success().json();
    assert_eq!(status["asked"], true);
    loopback_list(&node, "1.0.0");
    let status = node.cnictl(&["--json", "status", "lo-net"]).success().json();
    assert_eq!(status["asked"], false);
}

#[test]
fn a_single_plugin_conf_is_wrapped_into_a_list() {
    let node = Node::new();
    let pod = node.pod("pod");
    node.write_conf(
        "10-lo.conf",
        &json!({"cniVersion": "0.3.1", "name": "single", "type": "loopback"}),
    );
    let added = node
        .cnictl(&["--json", "add", "single", pod.path_str()])
        .success();
    assert_eq!(added.json()["ips"][0]["version"], "4");
    node.cnictl(&["del", "single", pod.path_str()]).success();
}

#[test]
fn unknown_networks_and_plugins_fail_cleanly() {
    let node = Node::new();
    let pod = node.pod("pod");
    let failed = node.cnictl(&["add", "nope", pod.path_str()]).failure();
    assert!(
        failed.stderr.contains("no network configuration named \"nope\""),
        "{failed:?}"
    );
    node.write_conf(
        "10-x.conflist",
        &json!({"cniVersion": "1.0.0", "name": "x", "plugins": [{"type": "no-such-plugin"}]}),
    );
    let failed = node.cnictl(&["--json", "add", "x", pod.path_str()]).failure();
    assert_eq!(failed.json()["code"], 7, "{failed:?}");
    assert!(
        failed.stderr.contains("failed to find plugin \"no-such-plugin\""),
        "{failed:?}"
    );
}
