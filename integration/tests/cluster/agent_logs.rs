//! The plugins' log records in the agent's log: pods added and deleted
//! through the conflist the agent wrote, with the arguments a kubelet's
//! runtime passes, show in the agent's stderr (what `kubectl logs` shows)
//! with their pod, container and outcome; istio-redirect's entry in
//! another network's file names the socket too, replacing the entry an
//! earlier release wrote without it; and a plugin whose log socket nobody
//! reads still answers at once, its records on its own stderr.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{
    Agent, AgentFixture, ReadyNode, host_bin, host_conflist, host_log_socket, kind_node, kindnet_conflist,
    node_object,
};
use test_kit::{Node, require_root, wait_for};

const TOKEN: &str = "agent-token";

/// The agent's lines that are plugins' records.
fn plugin_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|line| line["target"] == "plugin")
        .collect()
}

/// The one line of `plugin`'s `verb` of container `container`.
fn outcome_of<'a>(lines: &'a [Value], plugin: &str, verb: &str, container: &str, log: &str) -> &'a Value {
    let mut found = lines.iter().filter(|line| {
        line["plugin"] == plugin
            && line["verb"] == verb
            && line["containerID"] == container
            && ["ok", "failed"].iter().any(|outcome| {
                line["msg"]
                    .as_str()
                    .is_some_and(|msg| msg.contains(&format!("): {outcome}")))
            })
    });
    let line = found
        .next()
        .unwrap_or_else(|| panic!("no outcome of {plugin} {verb} {container}: {log}"));
    assert!(
        found.next().is_none(),
        "one outcome of {plugin} {verb} {container}: {log}"
    );
    line
}

#[test]
fn the_agents_log_shows_each_add_and_del_with_its_pod_and_outcome() {
    require_root();
    let ReadyNode {
        node,
        server: _server,
        mut agent,
    } = AgentFixture::new(TOKEN).uplink().start();
    let socket = host_log_socket(&node);
    let conflist: Value =
        serde_json::from_str(&std::fs::read_to_string(host_conflist(&node)).expect("conflist"))
            .expect("JSON");
    for plugin in conflist["plugins"].as_array().expect("plugins") {
        assert_eq!(plugin["logSocket"], socket.to_str().expect("UTF-8"), "{plugin}");
    }

    let bin = host_bin(&node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("web");
    let container = "1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b";
    let kubelets = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-1;\
                    K8S_POD_INFRA_CONTAINER_ID=1a2b3c4d5e6f;K8S_POD_UID=u-1";
    let verb = |verb: &str, args: &str, id: &str| {
        node.cnictl_env(
            &[
                "--json",
                verb,
                "cni-suite",
                pod.path_str(),
                "--container-id",
                id,
                "--args",
                args,
            ],
            &cni_path,
        )
    };
    let added = verb("add", kubelets, container).success().json();
    let address = added["ips"][0]["address"]
        .as_str()
        .expect("an address")
        .to_owned();
    verb("del", kubelets, container).success();
    // The bridge refuses an argument it does not know without
    // IgnoreUnknown: the failure reaches the agent with its pod.
    let refused = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-2;SOMETHING=else";
    let failing = "ffffffffffff0000000000000000000000000000000000000000000000000000";
    verb("add", refused, failing).failure();

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    eprintln!("AGENTLOG\n{log}");
    let lines = plugin_lines(&log);
    let add = outcome_of(&lines, "bridge", "ADD", container, &log);
    assert_eq!(add["level"], "info");
    assert_eq!(add["pod"], "default/web-1");
    assert_eq!(
        add["msg"],
        format!("plugin bridge ADD default/web-1 (container 1a2b3c4d5e6f): ok, {address}"),
        "{log}"
    );
    let del = outcome_of(&lines, "bridge", "DEL", container, &log);
    assert_eq!(
        del["msg"], "plugin bridge DEL default/web-1 (container 1a2b3c4d5e6f): ok",
        "{log}"
    );
    // host-local, run by the bridge for its `ipam`, sends nothing: the
    // bridge's record has its addresses (and would have its error).
    assert!(lines.iter().all(|line| line["plugin"] != "host-local"), "{log}");
    // The chained portmap logs its own, its result passed on.
    let portmap = outcome_of(&lines, "portmap", "ADD", container, &log);
    assert!(
        portmap["msg"].as_str().is_some_and(|m| m.ends_with(&address)),
        "{log}"
    );
    let refusal = outcome_of(&lines, "bridge", "ADD", failing, &log);
    assert_eq!(refusal["level"], "error");
    assert_eq!(refusal["pod"], "default/web-2");
    assert!(
        refusal["msg"]
            .as_str()
            .is_some_and(|m| m.contains("(container ffffffffffff): failed: ARGS: unknown args")),
        "{log}"
    );
    assert!(!socket.exists(), "the socket goes with the agent");
}

/// Reads a configuration file.
fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("JSON")
}

#[test]
fn istios_entry_in_another_networks_file_names_the_socket_and_replaces_an_earlier_releases() {
    require_root();
    // kindnet's list with Debian's reference plugins, chained by a release
    // whose entry named no log socket.
    let node = kind_node();
    let bin = host_bin(&node);
    let kindnet = kindnet_conflist(&node);
    let entry = r#"{"type":"istio-redirect","redirect":{"interceptionMode":"REDIRECT"}}"#;
    let mut earlier: Value = serde_json::from_str(entry).expect("entry");
    earlier["kubeconfig"] = json!(node.path("run/istio-cni/istio-cni-kubeconfig"));
    let mut chained = kindnet.clone();
    chained["plugins"].as_array_mut().expect("plugins").push(earlier);
    let path = node.conf_dir().join("10-kindnet.conflist");
    std::fs::write(&path, chained.to_string()).expect("kindnet's file");
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    let settings = [
        ("OWN_NETWORK", "false"),
        ("ISTIO_CHAINED", "true"),
        ("ISTIO_PLUGIN_CONFIG", entry),
        ("UNINSTALL_ON_STOP", "true"),
    ];
    let mut agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &settings);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    wait_for("the entry naming the socket", Duration::from_secs(5), || {
        read_json(&path)["plugins"][2]["logSocket"].is_string()
    });
    let plugins = read_json(&path)["plugins"].as_array().cloned().expect("plugins");
    let types: Vec<&Value> = plugins.iter().map(|p| &p["type"]).collect();
    assert_eq!(
        types,
        ["ptp", "portmap", "istio-redirect"],
        "replaced, not doubled"
    );
    assert_eq!(
        plugins[2]["logSocket"],
        host_log_socket(&node).to_str().expect("UTF-8")
    );
    assert!(
        plugins[0].get("logSocket").is_none(),
        "another network's entries are its own"
    );

    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    let container = "cafe0123456789";
    let run = |verb: &str| {
        node.cnictl_env(
            &[verb, "kindnet", pod.path_str(), "--container-id", container],
            &cni_path,
        )
        .success();
    };
    run("add");
    run("del");
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    let lines = plugin_lines(&log);
    let add = outcome_of(&lines, "istio-redirect", "ADD", container, &log);
    assert!(
        add["msg"].as_str().is_some_and(
            |m| m.starts_with("plugin istio-redirect ADD (container cafe01234567): ok, 10.244.1.")
        ),
        "{log}"
    );
    outcome_of(&lines, "istio-redirect", "DEL", container, &log);
    assert_eq!(read_json(&path), kindnet, "uninstall took the entry out: {log}");
}

/// Fills the queue of a socket that is bound and never read.
fn stuck_listener(path: &std::path::Path) -> UnixDatagram {
    let listener = UnixDatagram::bind(path).expect("bind");
    let sender = UnixDatagram::unbound().expect("socket");
    sender.set_nonblocking(true).expect("nonblocking");
    let mut queued = 0;
    loop {
        match sender.send_to(b"{}", path) {
            Ok(_) => queued += 1,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("filling the queue: {e}"),
        }
        assert!(queued < 100_000, "the queue never filled");
    }
    listener
}

#[test]
fn a_plugin_whose_log_socket_nobody_reads_adds_at_once_and_logs_to_stderr() {
    require_root();
    let node = Node::new();
    let stuck = node.path("stuck.sock");
    let _listener = stuck_listener(&stuck);
    let nobody = node.path("nobody.sock");
    let pod = node.pod("pod");
    let env = BTreeMap::from([
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "c1"),
        ("CNI_NETNS", pod.path_str()),
        ("CNI_IFNAME", "lo"),
        ("CNI_PATH", "/nonexistent"),
        ("CNI_ARGS", "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-1"),
    ]);
    for socket in [&stuck, &nobody] {
        let conf = serde_json::json!({"cniVersion": "1.0.0", "name": "lo", "type": "loopback",
                                      "logSocket": socket});
        // A hang detector, not a measurement: a blocking send would never
        // return while nobody reads.
        let started = Instant::now();
        let added = node.exec_plugin("loopback", &env, &conf.to_string());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        let added = added.success();
        let result = added.json();
        assert_eq!(result["interfaces"][0]["name"], "lo", "{}", socket.display());
        assert!(
            added.stderr.contains("INFO  loopback[") && added.stderr.contains("]: ADD ok"),
            "the record the socket did not take is on stderr: {}",
            added.stderr
        );
    }
}
