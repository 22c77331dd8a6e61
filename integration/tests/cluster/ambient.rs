//! Istio's ambient mode with the agent as Istio's node agent, against the
//! API test server and a ztunnel standing in on the ZDS socket
//! (`test_kit::fakes::ztunnel`): an enrolled pod's ADD, run through the
//! agent's conflist as a runtime runs it, returns only once the in-pod
//! rules are in its namespace and ztunnel acked that very namespace; it
//! fails closed without ztunnel; real connections land on ztunnel's ports;
//! a second ztunnel gets the snapshot, and a deleted pod leaves both; the
//! node's own connections (kubelet's probes) reach an enrolled pod's app,
//! through Istio's host rule, in iptables and in native nftables.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::fakes::ztunnel::{Ztunnel, netns_inode};
use test_kit::node_agent::{Agent, AgentFixture, ReadyNode, host_bin, lab_node};
use test_kit::probe::Probe;
use test_kit::{Netns, Node, Run, require_root, run_in};

use crate::common::{Pause, sample, scrape};

const TOKEN: &str = "ambient-token";
const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";

fn pod_object(namespace: &str, name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace, "uid": format!("u-{name}"), "labels": labels},
           "spec": {"nodeName": "n1", "serviceAccountName": "web", "containers": [{"name": "app"}]},
           "status": {"phase": "Pending"}})
}

/// The pod's ADD through the agent's conflist, as kubelet's runtime runs
/// it: its namespace and the run.
fn add(node: &Node, namespace: &str, name: &str) -> (Netns, Run) {
    let bin = host_bin(node);
    let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}");
    let env = [
        ("CNI_PATH", bin.to_str().expect("UTF-8")),
        ("CNI_ARGS", args.as_str()),
    ];
    let pod = node.pod(name);
    pod.ip(&["link", "set", "lo", "up"]).success();
    let run = node.cnictl_env(&["--json", "add", "cni-suite", pod.path_str()], &env);
    (pod, run)
}

fn address(run: Run) -> String {
    let result = run.success().json();
    let cidr = result["ips"][0]["address"].as_str().expect("an address");
    cidr.split('/').next().unwrap_or_default().to_owned()
}

/// The agent's settings in ambient mode, its ZDS socket at `zds`.
fn ambient_settings(zds: &str) -> Vec<(&str, &str)> {
    vec![
        ("ISTIO_CHAINED", "true"),
        ("AMBIENT_ENABLED", "true"),
        ("ZTUNNEL_UDS_ADDRESS", zds),
    ]
}

/// The node's probe set's elements as `address uid` lines, in the backend
/// the agent writes.
fn probe_set(node: &Node, native_nftables: bool) -> Vec<String> {
    let (program, args): (&str, &[&str]) = if native_nftables {
        (
            "nft",
            &[
                "-j",
                "list",
                "set",
                "inet",
                "istio-ambient-nat",
                "istio-inpod-probes-v4",
            ],
        )
    } else {
        ("ipset", &["list", "istio-inpod-probes-v4", "-output", "save"])
    };
    let listed = run_in(node.netns.path(), Path::new(program), args, &[], "")
        .success()
        .stdout;
    if native_nftables {
        let doc: Value = serde_json::from_str(&listed).expect("nft's JSON");
        let sets = doc["nftables"].as_array().into_iter().flatten();
        sets.filter_map(|item| item["set"]["elem"].as_array())
            .flatten()
            .map(|e| {
                format!(
                    "{} {}",
                    e["elem"]["val"].as_str().unwrap_or_default(),
                    e["elem"]["comment"].as_str().unwrap_or_default()
                )
            })
            .collect()
    } else {
        listed
            .lines()
            .filter_map(|line| line.strip_prefix("add istio-inpod-probes-v4 "))
            .map(|rest| rest.replace("comment ", "").replace('"', ""))
            .collect()
    }
}

/// A node whose agent runs in ambient mode, the API server holding
/// namespace `mesh` (labelled for ambient) with pod `web-0`, and `default`
/// with pod `plain`, which is set up. Fields drop in order.
struct AmbientNode {
    agent: Agent,
    /// Enrolled by no selector: it passes through, ztunnel or not.
    plain: Netns,
    plain_ip: String,
    zds_socket: PathBuf,
    server: ApiServer,
    node: Node,
}

/// `n1`'s pod range is `cidr`: addresses no other test's pods hold, since
/// the agent finds a running pod's namespace through /proc by its address
/// (pods of every test's nodes run on this one machine).
fn ambient_node(cidr: &str) -> AmbientNode {
    ambient_node_with(cidr, &[])
}

/// [`ambient_node`], with more settings.
fn ambient_node_with(cidr: &str, more: &[(&str, &str)]) -> AmbientNode {
    let node = lab_node();
    let zds_socket = node.path("run/ztunnel/ztunnel.sock");
    let zds = zds_socket.to_str().expect("UTF-8").to_owned();
    let ReadyNode { agent, server, node } = AgentFixture::new(TOKEN)
        .on(node)
        // The pods' bridge takes its MTU (the loopback's would be refused).
        .uplink()
        .pod_cidr(cidr)
        .settings(&[ambient_settings(&zds), more.to_vec()].concat())
        .start();
    server.apply_namespace(json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "mesh", "labels": {DATAPLANE_MODE: "ambient"}}}));
    server.apply_namespace(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}));
    server.add_pod("default", "plain", pod_object("default", "plain", json!({})));
    server.add_pod(
        "mesh",
        "web-0",
        pod_object("mesh", "web-0", json!({"app": "web"})),
    );
    let (plain, run) = add(&node, "default", "plain");
    AmbientNode {
        agent,
        plain,
        plain_ip: address(run),
        zds_socket,
        server,
        node,
    }
}

#[test]
fn an_enrolled_pod_starts_only_in_the_mesh_and_leaves_it_when_deleted() {
    require_root();
    let AmbientNode {
        mut agent,
        plain,
        plain_ip,
        zds_socket,
        server,
        node,
    } = ambient_node_with("10.247.1.0/24", &[("UNINSTALL_ON_STOP", "true")]);

    // No ztunnel: the enrolled pod does not start, in Istio's words.
    let (refused_pod, refused) = add(&node, "mesh", "web-0");
    assert_ne!(refused.code, Some(0), "{refused:?}");
    let said = refused.json()["msg"].as_str().unwrap_or_default().to_owned();
    assert!(
        said.contains("unable to push CNI event (status code 500)") && said.contains("no ztunnel connection"),
        "{said}"
    );
    // As the runtime does with a sandbox whose ADD failed.
    let bin = host_bin(&node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    node.cnictl_env(&["del", "cni-suite", refused_pod.path_str()], &cni_path)
        .success();

    // ztunnel connects: its snapshot is empty; the retried sandbox starts
    // in the mesh, its own namespace handed over.
    let ztunnel = Ztunnel::connect(&zds_socket);
    ztunnel.wait_for("snapshot", "");
    let (web, run) = add(&node, "mesh", "web-0");
    let web_ip = address(run);
    let added = ztunnel.wait_for("add", "u-web-0");
    assert_eq!(added.pod, "mesh/web-0");
    assert_eq!(
        added.netns,
        Some(netns_inode(web.path())),
        "the pod's own namespace"
    );
    // Marked as Istio's agent marks it; the plain pod is not.
    test_kit::wait_for("the pod's annotation", Duration::from_secs(10), || {
        server.pod("mesh", "web-0").expect("the pod")["metadata"]["annotations"]["ambient.istio.io/redirection"]
            == "enabled"
    });
    let plain_object = server.pod("default", "plain").expect("the pod");
    assert!(
        plain_object["metadata"]["annotations"].is_null(),
        "{plain_object}"
    );
    assert!(
        ztunnel.seen().iter().all(|seen| seen.uid != "u-plain"),
        "{:?}",
        ztunnel.seen()
    );

    // Real connections: the pod's own outbound and its inbound land on
    // ztunnel's ports in its namespace; the plain pod's app sees nothing.
    let probe = Probe::new();
    let web_rx = probe.listen(&web, &[15001, 15006, 8080, 8081]);
    let plain_rx = probe.listen(&plain, &[8080]);
    probe.connect(&web, None, &plain_ip, 8080, None).success();
    web_rx.wait_for(&format!("tcp 15001 {plain_ip}:8080"));
    probe.connect(&plain, None, &web_ip, 8080, None).success();
    web_rx.wait_for(&format!("tcp 15006 {web_ip}:8080"));
    assert!(plain_rx.all().is_empty(), "{:?}", plain_rx.all());
    // kubelet's probe: the node's own connection reaches the app itself,
    // SNATed by Istio's host rule (the pod's address in its set by UID).
    assert_eq!(probe_set(&node, false), [format!("{web_ip} u-web-0")]);
    let saved = node.netns.nat_rules("iptables-save");
    assert!(saved.contains("-A POSTROUTING -j ISTIO_POSTRT"), "{saved}");
    probe.connect(&node.netns, None, &web_ip, 8081, None).success();
    web_rx.wait_for(&format!("tcp 8081 {web_ip}:8081"));

    // A second ztunnel (an upgrade's) gets the pod with its namespace in
    // its snapshot; a deleted pod leaves both.
    let next = Ztunnel::connect(&zds_socket);
    next.wait_for("snapshot", "");
    let snapshot = next.seen();
    assert_eq!(snapshot.len(), 2, "{snapshot:?}");
    assert_eq!(
        (snapshot[0].kind, snapshot[0].uid.as_str(), snapshot[0].netns),
        ("add", "u-web-0", added.netns)
    );
    server.delete_pod("mesh", "web-0");
    ztunnel.wait_for("del", "u-web-0");
    next.wait_for("del", "u-web-0");
    test_kit::wait_for(
        "the address out of the probe set",
        Duration::from_secs(10),
        || probe_set(&node, false).is_empty(),
    );

    let (_, metrics) = scrape(&node, &agent);
    for (series, expected) in [
        (r#"istio_cni_plugin_requests_total{response_code="200"}"#, 1.0),
        (r#"istio_cni_plugin_requests_total{response_code="500"}"#, 1.0),
        ("ztunnel_connected", 2.0),
        ("cni_suite_ambient_pods_enrolled", 0.0),
        (r#"cni_suite_zds_acks_total{result="acked"}"#, 1.0),
    ] {
        assert_eq!(sample(&metrics, series), Some(expected), "{series}:\n{metrics}");
    }
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("pod mesh/web-0 is not in the mesh: no ztunnel connection"),
        "{log}"
    );
    assert!(log.contains("pod mesh/web-0 is in the mesh"), "{log}");
    // Uninstalled: Istio's host rule and its sets are gone.
    assert!(!node.netns.nat_rules("iptables-save").contains("ISTIO"), "{log}");
    let sets = run_in(node.netns.path(), Path::new("ipset"), &["list", "-n"], &[], "")
        .success()
        .stdout;
    assert!(sets.trim().is_empty(), "{sets}");
}

#[test]
fn an_agent_killed_and_restarted_lets_no_packet_out_of_the_mesh_and_hands_the_next_ztunnel_its_pods() {
    require_root();
    let AmbientNode {
        mut agent,
        plain,
        plain_ip,
        zds_socket,
        server,
        node,
    } = ambient_node("10.247.2.0/24");
    let ztunnel = Ztunnel::connect(&zds_socket);
    ztunnel.wait_for("snapshot", "");
    let (web, run) = add(&node, "mesh", "web-0");
    let web_ip = address(run);
    let _pause = Pause::start(&web);
    // As kubelet reports the running pod.
    let mut running = pod_object("mesh", "web-0", json!({"app": "web"}));
    running["status"] = json!({"phase": "Running", "podIP": web_ip, "podIPs": [{"ip": web_ip}]});
    server.add_pod("mesh", "web-0", running);
    let inode = ztunnel.wait_for("add", "u-web-0").netns;

    // The pod's app connects out throughout: every connection must land on
    // ztunnel's port in the pod, none reach the other pod's app.
    let probe = Probe::new();
    let web_rx = probe.listen(&web, &[15001]);
    let plain_rx = probe.listen(&plain, &[8080]);
    let stop = AtomicBool::new(false);
    let (tried, next, mut agent) = std::thread::scope(|scope| {
        let connecting = scope.spawn(|| {
            let (mut tried, started) = (0, Instant::now());
            while !stop.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(60) {
                let _ = probe.connect(&web, None, &plain_ip, 8080, None);
                tried += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            tried
        });
        agent.kill();
        drop(ztunnel);
        // No agent: a new enrolled pod does not start.
        server.add_pod(
            "mesh",
            "web-1",
            pod_object("mesh", "web-1", json!({"app": "web"})),
        );
        let (_, refused) = add(&node, "mesh", "web-1");
        assert_ne!(refused.code, Some(0), "{refused:?}");
        let said = refused.json()["msg"].as_str().unwrap_or_default().to_owned();
        assert!(said.contains("failed to send event request"), "{said}");

        let zds = zds_socket.to_str().expect("UTF-8").to_owned();
        let agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &ambient_settings(&zds));
        test_kit::wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
        let next = Ztunnel::connect(&zds_socket);
        next.wait_for("snapshot", "");
        stop.store(true, Ordering::SeqCst);
        (connecting.join().expect("the connecting thread"), next, agent)
    });

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    let snapshot = next.seen();
    assert_eq!(snapshot.len(), 2, "{snapshot:?}\n{log}");
    assert_eq!(
        (snapshot[0].kind, snapshot[0].uid.as_str(), snapshot[0].netns),
        ("add", "u-web-0", inode),
        "the pod found again in its own namespace:\n{log}"
    );
    let escaped = plain_rx.all().len();
    let redirected = web_rx.all().len();
    assert_eq!(escaped, 0, "connections outside the mesh: {:?}", plain_rx.all());
    assert!(redirected > 0 && tried > 0, "{redirected} of {tried}");
    eprintln!("agent restart: {tried} connections, {redirected} to ztunnel's port, {escaped} outside");

    assert!(
        log.contains(
            "enrolled pods found in their namespaces: 1 by their records, 0 through /proc; 0 kept without"
        ),
        "{log}"
    );
}

#[test]
fn a_namespace_labelled_while_its_pod_runs_puts_it_in_the_mesh_there_and_unlabelled_takes_it_out() {
    require_root();
    let AmbientNode {
        agent: _agent,
        plain,
        plain_ip,
        zds_socket,
        server,
        node: _node,
    } = ambient_node("10.247.3.0/24");
    let ztunnel = Ztunnel::connect(&zds_socket);
    ztunnel.wait_for("snapshot", "");
    let _pause = Pause::start(&plain);
    let mut running = pod_object("default", "plain", json!({}));
    running["status"] = json!({"phase": "Running", "podIP": plain_ip, "podIPs": [{"ip": plain_ip}]});
    server.add_pod("default", "plain", running);
    let annotation = || {
        server.pod("default", "plain").expect("the pod")["metadata"]["annotations"]["ambient.istio.io/redirection"]
            .clone()
    };
    let namespace = |labels: Value| json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default", "labels": labels}});

    server.apply_namespace(namespace(json!({DATAPLANE_MODE: "ambient"})));
    let added = ztunnel.wait_for("add", "u-plain");
    assert_eq!(added.pod, "default/plain");
    assert_eq!(added.netns, Some(netns_inode(plain.path())), "where it runs");
    test_kit::wait_for("the mark", Duration::from_secs(10), || annotation() == "enabled");
    let probe = Probe::new();
    let rx = probe.listen(&plain, &[15001, 8080]);
    probe.connect(&plain, None, "10.247.3.1", 8080, None).success();
    rx.wait_for("tcp 15001 10.247.3.1:8080");

    server.apply_namespace(namespace(json!({})));
    ztunnel.wait_for("del", "u-plain");
    test_kit::wait_for("the mark gone", Duration::from_secs(10), || {
        annotation().is_null()
    });
    let rules = plain.nat_rules("iptables-save");
    assert!(!rules.contains("ISTIO"), "{rules}");
    // Its own traffic is its own again.
    probe.connect(&plain, None, &plain_ip, 8080, None).success();
    rx.wait_for(&format!("tcp 8080 {plain_ip}:8080"));
    assert_eq!(
        rx.all(),
        test_kit::probe::sorted(&["tcp 15001 10.247.3.1:8080", &format!("tcp 8080 {plain_ip}:8080")])
    );
}

#[test]
fn native_nftables_puts_the_pods_rules_and_the_nodes_probe_rule_in_istios_tables_and_a_restart_prunes_the_set()
 {
    require_root();
    let AmbientNode {
        mut agent,
        plain,
        plain_ip,
        zds_socket,
        server,
        node,
    } = ambient_node_with("10.247.4.0/24", &[("NATIVE_NFTABLES", "true")]);
    let ztunnel = Ztunnel::connect(&zds_socket);
    ztunnel.wait_for("snapshot", "");
    let (web, run) = add(&node, "mesh", "web-0");
    let web_ip = address(run);
    ztunnel.wait_for("add", "u-web-0");
    let in_pod = run_in(web.path(), Path::new("nft"), &["list", "ruleset"], &[], "")
        .success()
        .stdout;
    assert!(in_pod.contains("table inet istio-ambient-nat"), "{in_pod}");
    assert!(
        !web.nat_rules("iptables-save").contains("ISTIO"),
        "no iptables rules beside"
    );
    assert_eq!(probe_set(&node, true), [format!("{web_ip} u-web-0")]);
    let host = run_in(
        node.netns.path(),
        Path::new("nft"),
        &["list", "table", "inet", "istio-ambient-nat"],
        &[],
        "",
    )
    .success()
    .stdout;
    assert!(host.contains("snat ip to 169.254.7.127"), "{host}");
    assert!(
        !node.netns.nat_rules("iptables-save").contains("ISTIO_POSTRT"),
        "one backend"
    );

    let probe = Probe::new();
    let web_rx = probe.listen(&web, &[15001, 15006, 8081]);
    probe.connect(&web, None, &plain_ip, 8080, None).success();
    web_rx.wait_for(&format!("tcp 15001 {plain_ip}:8080"));
    probe.connect(&plain, None, &web_ip, 8081, None).success();
    web_rx.wait_for(&format!("tcp 15006 {web_ip}:8081"));
    probe.connect(&node.netns, None, &web_ip, 8081, None).success();
    web_rx.wait_for(&format!("tcp 8081 {web_ip}:8081"));

    // The pod is deleted while no agent runs: the next one takes its
    // address out of the set (a later pod may get it).
    agent.kill();
    server.delete_pod("mesh", "web-0");
    let zds = zds_socket.to_str().expect("UTF-8").to_owned();
    let settings = [
        ambient_settings(&zds),
        vec![("NATIVE_NFTABLES", "true"), ("UNINSTALL_ON_STOP", "true")],
    ]
    .concat();
    let mut agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &settings);
    test_kit::wait_for("the set pruned", Duration::from_secs(20), || {
        probe_set(&node, true).is_empty()
    });
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    let tables = run_in(node.netns.path(), Path::new("nft"), &["list", "tables"], &[], "")
        .success()
        .stdout;
    assert!(!tables.contains("istio-ambient"), "uninstalled: {tables}\n{log}");
    drop(plain);
}

// --- the suite as the network under Istio's own ambient agent ---------------

/// Istio's host rule as its agent writes it in iptables mode (its
/// `hostprobe.golden`), and its ipset.
const ISTIO_HOST_IPTABLES: &str = "*nat
-N ISTIO_POSTRT
-I POSTROUTING 1 -j ISTIO_POSTRT
-A ISTIO_POSTRT -m owner --socket-exists -p tcp -m set --match-set istio-inpod-probes-v4 dst -j SNAT --to-source 169.254.7.127
COMMIT
";

/// The same in native nftables mode (its nftables `hostprobe.golden`, with
/// the set it makes first).
const ISTIO_HOST_NFT: &str = "add table inet istio-ambient-nat
flush table inet istio-ambient-nat
add set inet istio-ambient-nat istio-inpod-probes-v4 { type ipv4_addr ; comment \"UUID of the pods that are part of ambient mesh\" ; }
add chain inet istio-ambient-nat postrouting { type nat hook postrouting priority 100 ; }
add rule inet istio-ambient-nat postrouting meta l4proto tcp skuid 0 ip daddr @istio-inpod-probes-v4 counter snat to 169.254.7.127
";

/// What Istio's agent owns on the node, as listed: its chain and jump, its
/// set, its table (counters left out: traffic moves them).
fn istios_on_the_node(node: &Node) -> Vec<String> {
    let run = |program: &str, args: &[&str]| {
        run_in(node.netns.path(), Path::new(program), args, &[], "")
            .success()
            .stdout
    };
    let mut out: Vec<String> = run("iptables-save", &["-t", "nat"])
        .lines()
        .filter(|line| line.contains("ISTIO"))
        .map(str::to_owned)
        .collect();
    out.extend(
        run("ipset", &["list", "istio-inpod-probes-v4", "-output", "save"])
            .lines()
            .map(str::to_owned),
    );
    // Stateless: without the counters traffic moves.
    let table = run("nft", &["-s", "list", "table", "inet", "istio-ambient-nat"]);
    out.extend(table.lines().map(str::to_owned));
    out
}

#[test]
fn the_suite_as_the_network_under_istios_own_ambient_agent_keeps_its_rules_and_judges_probes_and_hbone_as_istio_documents()
 {
    require_root();
    let settings = [("NETWORK_POLICY", "true"), ("UNINSTALL_ON_STOP", "true")];
    let ReadyNode { agent, server, node } = AgentFixture::new(TOKEN)
        .on(lab_node())
        .uplink()
        .pod_cidr("10.247.5.0/24")
        .settings(&settings)
        .start();
    let mut agent = agent;
    server.apply_namespace(json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "mesh", "labels": {DATAPLANE_MODE: "ambient"}}}));
    let running = |name: &str, ip: &str| {
        let mut pod = pod_object("mesh", name, json!({"app": name}));
        pod["status"] = json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]});
        server.add_pod("mesh", name, pod);
    };
    // The bridge's result carries the addresses Istio's plugin sends its
    // agent (its event's `ips`).
    let mut pods = Vec::new();
    for name in ["web", "client"] {
        server.add_pod("mesh", name, pod_object("mesh", name, json!({"app": name})));
        let (pod, run) = add(&node, "mesh", name);
        let ip = address(run);
        running(name, &ip);
        pods.push((pod, ip));
    }
    let [(web, web_ip), (client, _)] = <[(Netns, String); 2]>::try_from(pods).expect("two pods");

    // Istio's agent enrols web: its host rule and set on the node (both
    // of its backends), its in-pod rules in web.
    let in_node = |program: &str, args: &[&str], stdin: &str| {
        run_in(node.netns.path(), Path::new(program), args, &[], stdin).success();
    };
    in_node(
        "ipset",
        &[
            "create",
            "istio-inpod-probes-v4",
            "hash:ip",
            "family",
            "inet",
            "comment",
        ],
        "",
    );
    in_node(
        "ipset",
        &["add", "istio-inpod-probes-v4", &web_ip, "comment", "u-web"],
        "",
    );
    in_node("iptables-restore", &["--noflush"], ISTIO_HOST_IPTABLES);
    in_node("nft", &["-f", "-"], ISTIO_HOST_NFT);
    in_node(
        "nft",
        &[
            "add",
            "element",
            "inet",
            "istio-ambient-nat",
            "istio-inpod-probes-v4",
            &format!("{{ {web_ip} comment \"u-web\" }}"),
        ],
        "",
    );
    let in_pod = || {
        let ns = netns::NetNs::open(web.path()).expect("web's namespace");
        let rules = istio_redirect::rules::ambient::InPod::new(true, &Default::default());
        istio_redirect::rules::ambient::program(
            &ns,
            &rules,
            &[firewall::Family::V4],
            istio_redirect::rules::ambient::InPodBackend::Iptables(None),
        )
        .expect("Istio's in-pod rules")
    };
    in_pod();
    let istios = istios_on_the_node(&node);
    for expected in [
        "-A POSTROUTING -j ISTIO_POSTRT".to_owned(),
        format!("add istio-inpod-probes-v4 {web_ip} comment \"u-web\""),
    ] {
        assert!(istios.contains(&expected), "{expected} in {istios:#?}");
    }
    assert!(
        istios.iter().any(|l| l.contains("snat ip to 169.254.7.127")),
        "{istios:#?}"
    );

    // Default deny for the namespace's ingress.
    server.apply_network_policy(
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "deny", "namespace": "mesh"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}),
    );
    let probe = Probe::new();
    let web_rx = probe.listen(&web, &[15006, 15008, 8081]);
    test_kit::wait_for("the policy enforced", Duration::from_secs(10), || {
        !probe.connect(&client, None, &web_ip, 8081, None).ok()
    });
    // kubelet's probe, SNATed to Istio's probe address, is the node's own:
    // it reaches the app under the default deny.
    probe.connect(&node.netns, None, &web_ip, 8081, None).success();
    web_rx.wait_for(&format!("tcp 8081 {web_ip}:8081"));
    // HBONE is judged like any port: denied, then allowed by a policy that
    // names 15008 (Istio's advice), where ztunnel takes it.
    assert!(!probe.connect(&client, None, &web_ip, 15008, None).ok());
    server.apply_network_policy(
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "hbone", "namespace": "mesh"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                              "ports": [{"protocol": "TCP", "port": 15008}]}]}}),
    );
    test_kit::wait_for("HBONE allowed", Duration::from_secs(10), || {
        probe.connect(&client, None, &web_ip, 15008, None).ok()
    });
    web_rx.wait_for(&format!("tcp 15008 {web_ip}:15008"));
    assert!(
        !probe.connect(&client, None, &web_ip, 8081, None).ok(),
        "only 15008"
    );

    // Pods come and go, the agent restarts: Istio's rules stay as they were.
    server.add_pod("mesh", "later", pod_object("mesh", "later", json!({})));
    let (later, run) = add(&node, "mesh", "later");
    running("later", &address(run));
    agent.kill();
    let mut agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &settings);
    test_kit::wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    let bin = host_bin(&node);
    let env = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    node.cnictl_env(&["del", "cni-suite", later.path_str()], &env)
        .success();
    server.delete_pod("mesh", "later");
    server.delete_network_policy("mesh", "hbone");
    test_kit::wait_for("HBONE denied again", Duration::from_secs(10), || {
        !probe.connect(&client, None, &web_ip, 15008, None).ok()
    });
    assert_eq!(istios_on_the_node(&node), istios);
    assert_eq!(
        in_pod(),
        [("V4".to_owned(), istio_redirect::rules::Outcome::Unchanged)]
    );

    // Uninstalled, the suite leaves them too.
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(istios_on_the_node(&node), istios, "{log}");
}
