//! Istio's CNI alone (`OWN_NETWORK=false`, `deploy/istio-cni.yaml`) beside
//! another network's configuration, against the API test server: kindnet's
//! (ptp, with Debian's reference plugins the node already holds),
//! minikube's (bridge, portmap, firewall), a Calico-shaped list (file
//! handling only: no calico binary here) and a bare `.conf`; Istio's owned
//! mode, with its primary removed and brought back; an upgrade that leaves
//! everything to the next agent; the readiness taint.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{
    Agent, host_bin, host_conflist, host_leases, host_log_socket, kind_node, kindnet_conflist, lab_node,
    node_object,
};
use test_kit::{Node, require_root, wait_for};

use crate::common::{ENVOY_REDIRECT, bare_conf, bin_dir_snapshot, plugin_types, sample};

const TOKEN: &str = "istio-token";

/// The entry the tests' agents chain: a static capture, so a pod set up
/// by cnictl (no Kubernetes arguments) is captured.
const ENTRY: &str = r#"{"type":"istio-redirect","redirect":{"interceptionMode":"REDIRECT"}}"#;

fn kindnet_path(node: &Node) -> PathBuf {
    node.conf_dir().join("10-kindnet.conflist")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("JSON")
}

/// Istio's agent alone on Node n1, with `extra` settings.
fn istio_agent(node: &Node, server: &ApiServer, extra: &[(&str, &str)]) -> Agent {
    let mut settings = vec![
        ("OWN_NETWORK", "false"),
        ("ISTIO_CHAINED", "true"),
        ("ISTIO_PLUGIN_CONFIG", ENTRY),
    ];
    settings.extend_from_slice(extra);
    Agent::start(node, "n1", server, "127.0.0.1", TOKEN, &settings)
}

fn server_of(node: &Node) -> ApiServer {
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    server
}

/// What the suite's own network would have left on the node: none of it may
/// be there.
fn assert_no_network_of_its_own(node: &Node, log: &str) {
    assert!(!host_conflist(node).exists(), "its own conflist written: {log}");
    assert!(!host_leases(node).exists(), "a lease directory made: {log}");
    let routes = node.netns.ip(&["route", "show", "proto", "201"]).success().stdout;
    assert_eq!(routes.trim(), "", "routes of its own: {log}");
    let nat = node.run("iptables-save", &["-t", "nat"]).success().stdout;
    assert!(
        !nat.contains("CNI-SUITE"),
        "a masquerade of its own: {nat}\n{log}"
    );
}

#[test]
fn istio_alone_chains_into_kindnets_file_captures_its_pods_and_uninstall_leaves_the_node_as_it_was() {
    require_root();
    let node = kind_node();
    let kindnet_file = kindnet_path(&node);
    std::fs::write(&kindnet_file, kindnet_conflist(&node).to_string()).expect("kindnet's file");
    let bin = host_bin(&node);
    let before = bin_dir_snapshot(&bin);
    let server = server_of(&node);
    let mut agent = istio_agent(&node, &server, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    assert_eq!(plugin_types(&kindnet_file), ["ptp", "portmap", "istio-redirect"]);
    // istio-redirect alone installed; kindnet's plugins untouched.
    let installed = bin_dir_snapshot(&bin);
    let added: Vec<&String> = installed.keys().filter(|k| !before.contains_key(*k)).collect();
    assert!(
        added
            .iter()
            .all(|k| *k == "istio-redirect" || k.starts_with(".cni-suite")),
        "{added:?}"
    );
    for (name, what) in &before {
        assert_eq!(installed.get(name), Some(what), "{name} changed");
    }

    // A pod set up through kindnet's chain, as the runtime runs it: ptp and
    // host-local from the node, then istio-redirect.
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    let result = node
        .cnictl_env(&["--json", "add", "kindnet", pod.path_str()], &cni_path)
        .success()
        .json();
    let address = result["ips"][0]["address"].as_str().expect("an address");
    assert!(address.starts_with("10.244.1."), "{result}");
    let rules = pod.nat_rules("iptables-save");
    assert!(rules.contains(ENVOY_REDIRECT), "{rules}");
    node.cnictl_env(&["del", "kindnet", pod.path_str()], &cni_path)
        .success();

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_no_network_of_its_own(&node, &log);
    assert_eq!(
        read_json(&kindnet_file),
        kindnet_conflist(&node),
        "only our entry removed: {log}"
    );
    assert_eq!(
        bin_dir_snapshot(&bin),
        before,
        "the bin directory as it was: {log}"
    );
    assert!(!node.path("run/istio-cni/istio-cni-kubeconfig").exists(), "{log}");
}

/// A primary configuration of another shape: its file name, content, and
/// the file the entry goes into.
struct Shape {
    file: &'static str,
    content: String,
    chained_into: &'static str,
    types: &'static [&'static str],
}

fn shapes(node: &Node) -> Vec<Shape> {
    let minikube = json!({"cniVersion": "0.4.0", "name": "bridge", "plugins": [
        {"type": "bridge", "bridge": "bridge", "addIf": "true", "isDefaultGateway": true, "forceAddress": false,
         "ipMasq": true, "hairpinMode": true, "ipam": {"type": "host-local", "subnet": "10.244.0.0/16"}},
        {"type": "portmap", "capabilities": {"portMappings": true}},
        {"type": "firewall"}
    ]});
    let calico = json!({"name": "k8s-pod-network", "cniVersion": "0.3.1", "plugins": [
        {"type": "calico", "log_level": "info", "datastore_type": "kubernetes", "nodename": "n1", "mtu": 0,
         "ipam": {"type": "calico-ipam"}, "policy": {"type": "k8s"},
         "kubernetes": {"kubeconfig": "/etc/cni/net.d/calico-kubeconfig"}},
        {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}},
        {"type": "bandwidth", "capabilities": {"bandwidth": true}}
    ]});
    vec![
        Shape {
            file: "1-k8s.conflist",
            content: minikube.to_string(),
            chained_into: "1-k8s.conflist",
            types: &["bridge", "portmap", "firewall", "istio-redirect"],
        },
        Shape {
            file: "10-calico.conflist",
            content: serde_json::to_string_pretty(&calico).expect("JSON"),
            chained_into: "10-calico.conflist",
            types: &["calico", "portmap", "bandwidth", "istio-redirect"],
        },
        Shape {
            file: "10-mynet.conf",
            content: bare_conf(&node.path("mynet-leases")),
            chained_into: "10-mynet.conflist",
            types: &["bridge", "istio-redirect"],
        },
    ]
}

#[test]
fn istio_alone_chains_minikubes_calicos_and_a_bare_conf_keeping_their_names_and_puts_each_back() {
    require_root();
    for index in 0..3 {
        let node = lab_node();
        let shape = shapes(&node).swap_remove(index);
        let primary = node.conf_dir().join(shape.file);
        std::fs::write(&primary, &shape.content).expect("the primary");
        let original: Value = serde_json::from_str(&shape.content).expect("JSON");
        let server = server_of(&node);
        let mut agent = istio_agent(&node, &server, &[("UNINSTALL_ON_STOP", "true")]);
        wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
        let chained = node.conf_dir().join(shape.chained_into);
        assert_eq!(plugin_types(&chained), shape.types, "{}", shape.file);
        let list = read_json(&chained);
        assert_eq!(
            list["name"], original["name"],
            "{}: the network keeps its name",
            shape.file
        );
        assert_eq!(list["cniVersion"], original["cniVersion"], "{}", shape.file);

        let (status, log) = agent.stop();
        assert!(status.success(), "{log}");
        assert_no_network_of_its_own(&node, &log);
        if shape.chained_into == shape.file {
            assert_eq!(read_json(&primary), original, "{}: {log}", shape.file);
        } else {
            // The wrap undone: the bare file back byte for byte.
            assert_eq!(
                std::fs::read_to_string(&primary).expect("put back"),
                shape.content,
                "{log}"
            );
            assert!(!chained.exists(), "{log}");
        }
    }
}

/// Waits (up to 10 s) for `path` to end with the entry again and says how
/// long it took.
fn back_within(path: &Path, types: &[&str], what: &str) -> Duration {
    let started = Instant::now();
    wait_for(what, Duration::from_secs(10), || plugin_types(path) == types);
    let took = started.elapsed();
    eprintln!("{what}: {took:?}");
    took
}

#[test]
fn istio_alone_puts_its_entry_back_after_rewrites_and_follows_a_file_that_starts_to_sort_first() {
    require_root();
    let node = kind_node();
    let kindnet_file = kindnet_path(&node);
    std::fs::write(&kindnet_file, kindnet_conflist(&node).to_string()).expect("kindnet's file");
    let server = server_of(&node);
    let mut agent = istio_agent(&node, &server, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    let chained = ["ptp", "portmap", "istio-redirect"];

    // kindnetd writes its file in place, then through a renamed temporary.
    std::fs::write(&kindnet_file, kindnet_conflist(&node).to_string()).expect("in place");
    back_within(
        &kindnet_file,
        &chained,
        "the entry back after an in-place rewrite",
    );
    let temporary = node.conf_dir().join(".kindnet.tmp");
    std::fs::write(&temporary, kindnet_conflist(&node).to_string()).expect("temporary");
    std::fs::rename(&temporary, &kindnet_file).expect("renamed over");
    back_within(&kindnet_file, &chained, "the entry back after a rename");

    // Another network's file starts to sort first: the runtime uses it now,
    // and so does the chain.
    let first = node.conf_dir().join("05-cilium.conflist");
    let cilium = json!({"cniVersion": "0.3.1", "name": "cilium", "plugins": [{"type": "cilium-cni"}]});
    std::fs::write(&first, cilium.to_string()).expect("cilium's file");
    back_within(
        &first,
        &["cilium-cni", "istio-redirect"],
        "the entry in the file that sorts first",
    );

    // What /metrics says of it: the first chaining and three put back; no
    // lease family (no lease directory of its own in this mode).
    let (code, exposition) = agent.probe(&node, "/metrics").expect("an answer");
    assert_eq!(code, 200, "{exposition}");
    assert_eq!(
        sample(&exposition, "cni_suite_chain_reinserts_total"),
        Some(4.0),
        "{exposition}"
    );
    assert_eq!(
        sample(&exposition, "istio_cni_install_ready"),
        Some(1.0),
        "{exposition}"
    );
    assert_eq!(
        sample(&exposition, r#"istio_cni_installs_total{result="SUCCESS"}"#),
        Some(1.0),
        "{exposition}"
    );
    assert!(!exposition.contains("cni_suite_lease"), "{exposition}");

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(read_json(&first), cilium, "{log}");
    assert_eq!(read_json(&kindnet_file), kindnet_conflist(&node), "{log}");
}

#[test]
fn istios_owned_mode_writes_its_own_first_file_from_the_primary_and_never_edits_the_primary() {
    require_root();
    let node = kind_node();
    let kindnet_file = kindnet_path(&node);
    std::fs::write(&kindnet_file, kindnet_conflist(&node).to_string()).expect("kindnet's file");
    let kindnet_bytes = std::fs::read(&kindnet_file).expect("read");
    let server = server_of(&node);
    let owned = node.conf_dir().join("02-istio-cni.conflist");
    let settings = [("ISTIO_OWNED_CNI_CONFIG", "true"), ("UNINSTALL_ON_STOP", "true")];
    let mut agent = istio_agent(&node, &server, &settings);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    let mut expected = kindnet_conflist(&node);
    expected["plugins"]
        .as_array_mut()
        .expect("plugins")
        .push(serde_json::from_str(ENTRY).expect("entry"));
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    expected["plugins"][2]["kubeconfig"] = json!(kubeconfig);
    expected["plugins"][2]["logSocket"] = json!(host_log_socket(&node));
    assert_eq!(
        read_json(&owned),
        expected,
        "kindnet's list, name and version, and the entry"
    );
    assert_eq!(
        std::fs::read(&kindnet_file).expect("read"),
        kindnet_bytes,
        "the primary untouched"
    );

    // A pod through the runtime's choice, the owned file (network kindnet).
    let bin = host_bin(&node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    node.cnictl_env(&["add", "kindnet", pod.path_str()], &cni_path)
        .success();
    let rules = pod.nat_rules("iptables-save");
    assert!(rules.contains("-A ISTIO_REDIRECT"), "{rules}");
    node.cnictl_env(&["del", "kindnet", pod.path_str()], &cni_path)
        .success();

    // kindnetd changes its list: the owned file follows.
    let mut changed = kindnet_conflist(&node);
    changed["plugins"][0]["mtu"] = json!(1400);
    std::fs::write(&kindnet_file, changed.to_string()).expect("changed");
    wait_for("the owned file re-copied", Duration::from_secs(10), || {
        read_json(&owned)["plugins"][0]["mtu"] == 1400
    });
    assert_eq!(
        plugin_types(&kindnet_file),
        ["ptp", "portmap"],
        "the primary never edited"
    );

    // A file that sorts before the owned one: the agent says so and is not
    // ready until it is gone.
    let earlier = node.conf_dir().join("01-early.conflist");
    std::fs::write(
        &earlier,
        json!({"cniVersion": "0.3.1", "name": "early", "plugins": [{"type": "ptp"}]}).to_string(),
    )
    .expect("an earlier file");
    wait_for("not ready", Duration::from_secs(10), || !agent.ready(&node));
    let (code, reason) = agent.probe(&node, "/readyz").expect("an answer");
    assert_eq!(code, 503);
    assert!(reason.contains("istio-redirect"), "{reason}");
    std::fs::remove_file(&earlier).expect("rm");
    wait_for("ready again", Duration::from_secs(10), || agent.ready(&node));

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("no longer sorts first"), "the agent said why: {log}");
    assert!(!owned.exists(), "the owned file removed: {log}");
    assert_eq!(read_json(&kindnet_file), changed, "{log}");
    assert!(!bin.join("istio-redirect").exists(), "{log}");
}

#[test]
fn the_owned_mode_never_overwrites_someone_elses_file_of_its_name() {
    require_root();
    let node = kind_node();
    std::fs::write(kindnet_path(&node), kindnet_conflist(&node).to_string()).expect("kindnet's file");
    let theirs = node.conf_dir().join("02-istio-cni.conflist");
    let content = json!({"cniVersion": "0.3.1", "name": "theirs", "plugins": [{"type": "ptp"}]}).to_string();
    std::fs::write(&theirs, &content).expect("someone's file");
    let server = server_of(&node);
    let mut agent = istio_agent(
        &node,
        &server,
        &[("ISTIO_OWNED_CNI_CONFIG", "true"), ("UNINSTALL_ON_STOP", "true")],
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(!agent.ready(&node));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("that is not the agent's is there"), "{log}");
    assert_eq!(std::fs::read_to_string(&theirs).expect("kept"), content, "{log}");
    assert_eq!(plugin_types(&kindnet_path(&node)), ["ptp", "portmap"], "{log}");
}

#[test]
fn switching_to_the_owned_mode_takes_the_entry_out_of_the_primary_and_back() {
    require_root();
    let node = kind_node();
    let kindnet_file = kindnet_path(&node);
    std::fs::write(&kindnet_file, kindnet_conflist(&node).to_string()).expect("kindnet's file");
    let server = server_of(&node);
    let owned = node.conf_dir().join("02-istio-cni.conflist");
    let mut chained = istio_agent(&node, &server, &[]);
    wait_for("readiness", Duration::from_secs(20), || chained.ready(&node));
    assert_eq!(plugin_types(&kindnet_file), ["ptp", "portmap", "istio-redirect"]);
    let (status, log) = chained.stop();
    assert!(status.success(), "{log}");

    let mut owning = istio_agent(&node, &server, &[("ISTIO_OWNED_CNI_CONFIG", "true")]);
    wait_for("the entry out of the primary", Duration::from_secs(20), || {
        owning.ready(&node) && plugin_types(&kindnet_file) == ["ptp", "portmap"]
    });
    assert_eq!(plugin_types(&owned), ["ptp", "portmap", "istio-redirect"]);
    let (status, log) = owning.stop();
    assert!(status.success(), "{log}");

    // And back: the owned file would sort first and be taken for the primary.
    let mut chained = istio_agent(&node, &server, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("chained into the primary again", Duration::from_secs(20), || {
        chained.ready(&node) && !owned.exists()
    });
    assert_eq!(plugin_types(&kindnet_file), ["ptp", "portmap", "istio-redirect"]);
    let (status, log) = chained.stop();
    assert!(status.success(), "{log}");
    assert_eq!(read_json(&kindnet_file), kindnet_conflist(&node), "{log}");
}

#[test]
fn an_agent_stopped_for_an_upgrade_leaves_everything_and_the_next_one_adopts_it() {
    require_root();
    let node = kind_node();
    let kindnet_file = kindnet_path(&node);
    std::fs::write(&kindnet_file, kindnet_conflist(&node).to_string()).expect("kindnet's file");
    let server = server_of(&node);
    let bin = host_bin(&node);
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let mut old = istio_agent(&node, &server, &[]);
    wait_for("readiness", Duration::from_secs(20), || old.ready(&node));
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    node.cnictl_env(&["add", "kindnet", pod.path_str()], &cni_path)
        .success();
    let installed = bin_dir_snapshot(&bin);
    let chained = std::fs::read(&kindnet_file).expect("read");

    // Stopped without the uninstall setting, as a rolling update stops it.
    let (status, log) = old.stop();
    assert!(status.success(), "{log}");
    assert_eq!(bin_dir_snapshot(&bin), installed, "the binary stays: {log}");
    assert_eq!(
        std::fs::read(&kindnet_file).expect("read"),
        chained,
        "the entry stays: {log}"
    );
    assert!(kubeconfig.exists(), "the plugin's kubeconfig stays: {log}");
    // No agent runs: pods still come and go.
    let other = node.pod("other");
    node.cnictl_env(&["add", "kindnet", other.path_str()], &cni_path)
        .success();
    node.cnictl_env(&["del", "kindnet", pod.path_str()], &cni_path)
        .success();

    let mut new = istio_agent(&node, &server, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("readiness", Duration::from_secs(20), || new.ready(&node));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(bin_dir_snapshot(&bin), installed, "adopted, nothing rewritten");
    assert_eq!(
        std::fs::read(&kindnet_file).expect("read"),
        chained,
        "adopted, nothing rewritten"
    );
    node.cnictl_env(&["del", "kindnet", other.path_str()], &cni_path)
        .success();
    let (status, log) = new.stop();
    assert!(status.success(), "{log}");
    assert_eq!(read_json(&kindnet_file), kindnet_conflist(&node), "{log}");
    assert!(!bin.join("istio-redirect").exists(), "{log}");
}

#[test]
fn uninstall_keeps_istio_redirect_while_an_operators_configuration_names_it() {
    require_root();
    let node = kind_node();
    std::fs::write(kindnet_path(&node), kindnet_conflist(&node).to_string()).expect("kindnet's file");
    let operators = node.conf_dir().join("99-operator.conflist");
    let operator = json!({"cniVersion": "1.0.0", "name": "operator", "plugins": [
        {"type": "ptp", "ipam": {"type": "host-local", "subnet": "10.99.0.0/24"}},
        {"type": "istio-redirect", "redirect": {"interceptionMode": "TPROXY"}}
    ]});
    std::fs::write(&operators, operator.to_string()).expect("an operator's list");
    let server = server_of(&node);
    let mut agent = istio_agent(&node, &server, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(host_bin(&node).join("istio-redirect").exists(), "{log}");
    assert!(log.contains("istio-redirect stays: a configuration in"), "{log}");
    assert_eq!(read_json(&operators), operator, "not ours to change: {log}");
    assert_eq!(plugin_types(&kindnet_path(&node)), ["ptp", "portmap"], "{log}");
}

fn taint_keys(server: &ApiServer) -> Vec<String> {
    server.node("n1").expect("the Node")["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["key"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn the_readiness_taint_goes_once_the_chain_is_in_place_and_never_before() {
    require_root();
    let node = kind_node();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    let mut tainted = node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]);
    tainted["spec"]["taints"] = json!([
        {"key": "cni.istio.io/not-ready", "effect": "NoSchedule"},
        {"key": "example.com/other", "value": "x", "effect": "NoExecute"}
    ]);
    server.apply_node(tainted);
    let agent = istio_agent(&node, &server, &[("READINESS_TAINT", "cni.istio.io/not-ready")]);
    // No network on the node yet: nothing to chain into, so not ready and
    // the taint stays.
    std::thread::sleep(Duration::from_secs(3));
    assert!(!agent.ready(&node));
    assert_eq!(
        taint_keys(&server),
        ["cni.istio.io/not-ready", "example.com/other"]
    );
    assert!(
        server.writes().iter().all(|w| !w.path.contains("/nodes/")),
        "no Node written before"
    );

    std::fs::write(kindnet_path(&node), kindnet_conflist(&node).to_string()).expect("kindnet's file");
    wait_for("the taint removed", Duration::from_secs(10), || {
        taint_keys(&server) == ["example.com/other"]
    });
    assert!(agent.ready(&node));
    assert_eq!(
        plugin_types(&kindnet_path(&node)),
        ["ptp", "portmap", "istio-redirect"]
    );
}

const TAINT: &str = "cni.istio.io/not-ready";

/// The Node's taints as `key:effect`.
fn taints(server: &ApiServer) -> Vec<String> {
    server.node("n1").expect("the Node")["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            format!(
                "{}:{}",
                t["key"].as_str().unwrap_or(""),
                t["effect"].as_str().unwrap_or("")
            )
        })
        .collect()
}

/// What the runtime would choose from: the conf directory's files.
fn conf_files(node: &Node) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(node.conf_dir())
        .expect("ls")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn istios_owned_file_goes_while_no_primary_is_left_and_the_taint_comes_back_until_one_is() {
    require_root();
    let node = kind_node();
    let kindnet_file = kindnet_path(&node);
    let kindnet = kindnet_conflist(&node).to_string();
    std::fs::write(&kindnet_file, &kindnet).expect("kindnet's file");
    let server = ApiServer::start(node.netns.path(), TOKEN);
    let mut tainted = node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]);
    tainted["spec"]["taints"] = json!([
        {"key": TAINT, "effect": "NoSchedule"},
        {"key": "example.com/other", "value": "x", "effect": "NoExecute"}
    ]);
    server.apply_node(tainted);
    let owned = node.conf_dir().join("02-istio-cni.conflist");
    // Stopped without uninstall, as a rollout stops it.
    let settings = [("ISTIO_OWNED_CNI_CONFIG", "true"), ("READINESS_TAINT", TAINT)];
    let mut agent = istio_agent(&node, &server, &settings);
    let serving = |agent: &Agent| {
        agent.ready(&node)
            && plugin_types(&owned) == ["ptp", "portmap", "istio-redirect"]
            && read_json(&owned)["name"] == "kindnet"
            && taints(&server) == ["example.com/other:NoExecute"]
    };
    let withdrawn = |agent: &Agent| {
        !agent.ready(&node)
            && conf_files(&node).is_empty()
            && taints(&server) == ["example.com/other:NoExecute", "cni.istio.io/not-ready:NoSchedule"]
    };
    wait_for(
        "ready, the owned file written, the taint gone",
        Duration::from_secs(20),
        || serving(&agent),
    );

    // kindnet's file removed and written again, three times: the owned file
    // goes with it (the runtime has no network to run, as without the
    // agent), the agent is not ready and the node tainted until it is back.
    for round in 0..3 {
        std::fs::remove_file(&kindnet_file).expect("kindnet's file removed");
        wait_for(
            &format!("round {round}: the owned file gone"),
            Duration::from_secs(10),
            || !owned.exists(),
        );
        wait_for(
            &format!("round {round}: not ready, tainted"),
            Duration::from_secs(15),
            || withdrawn(&agent),
        );
        std::fs::write(&kindnet_file, &kindnet).expect("kindnet's file back");
        wait_for(&format!("round {round}: back"), Duration::from_secs(15), || {
            serving(&agent)
        });
    }

    // Killed (kill -9) as soon as the owned file went; restarted while no
    // primary exists: nothing written, not ready, tainted.
    std::fs::remove_file(&kindnet_file).expect("kindnet's file removed");
    wait_for("the owned file gone", Duration::from_secs(10), || !owned.exists());
    agent.kill();
    let mut agent = istio_agent(&node, &server, &settings);
    wait_for("restarted: not ready, tainted", Duration::from_secs(15), || {
        withdrawn(&agent)
    });
    std::fs::write(&kindnet_file, &kindnet).expect("kindnet's file back");
    wait_for("restarted: back", Duration::from_secs(15), || serving(&agent));

    // A rollout (stopped, started again, the primary in place) leaves the
    // owned file and never taints the node: a start is shorter than the
    // grace.
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(owned.exists(), "left for the next agent: {log}");
    let node_writes = || {
        server
            .writes()
            .iter()
            .filter(|w| w.path.contains("/nodes/"))
            .count()
    };
    let written = node_writes();
    let mut agent = istio_agent(&node, &server, &settings);
    wait_for("restarted in a rollout: serving", Duration::from_secs(15), || {
        serving(&agent)
    });
    assert_eq!(node_writes(), written, "the Node written during a rollout");

    // Stopped while the primary exists; the primary goes while no agent
    // runs; the next agent finds the owned file left and takes it away.
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(owned.exists(), "left for the next agent: {log}");
    std::fs::remove_file(&kindnet_file).expect("kindnet's file removed");
    let uninstalling: Vec<(&str, &str)> = settings
        .into_iter()
        .chain([("UNINSTALL_ON_STOP", "true")])
        .collect();
    let mut agent = istio_agent(&node, &server, &uninstalling);
    wait_for(
        "the left file taken away: not ready, tainted",
        Duration::from_secs(15),
        || withdrawn(&agent),
    );
    std::fs::write(&kindnet_file, &kindnet).expect("kindnet's file back");
    wait_for("back once more", Duration::from_secs(15), || serving(&agent));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("no primary CNI configuration is left"),
        "the agent said why: {log}"
    );
    assert_eq!(conf_files(&node), ["10-kindnet.conflist"], "{log}");
    assert_eq!(read_json(&kindnet_file), kindnet_conflist(&node), "{log}");
}

#[test]
fn istios_owned_file_follows_the_next_primary_and_goes_when_what_is_left_is_no_configuration() {
    require_root();
    let node = kind_node();
    let server = server_of(&node);
    // kindnet's list kept elsewhere and linked, and a second candidate
    // sorting after it.
    let elsewhere = node.path("elsewhere");
    std::fs::create_dir_all(&elsewhere).expect("mkdir");
    let real_kindnet = elsewhere.join("kindnet.conflist");
    let kindnet = kindnet_conflist(&node).to_string();
    std::fs::write(&real_kindnet, &kindnet).expect("kindnet's file");
    let kindnet_link = kindnet_path(&node);
    std::os::unix::fs::symlink(&real_kindnet, &kindnet_link).expect("link");
    let other = node.conf_dir().join("20-other.conflist");
    let other_list = json!({"cniVersion": "0.3.1", "name": "other", "plugins": [{"type": "ptp"}]});
    std::fs::write(&other, other_list.to_string()).expect("another file");
    let owned = node.conf_dir().join("02-istio-cni.conflist");
    let mut agent = istio_agent(
        &node,
        &server,
        &[("ISTIO_OWNED_CNI_CONFIG", "true"), ("UNINSTALL_ON_STOP", "true")],
    );
    let copying = |agent: &Agent, name: &str| agent.ready(&node) && read_json_or_null(&owned)["name"] == name;
    wait_for("the owned file from kindnet's", Duration::from_secs(20), || {
        copying(&agent, "kindnet")
    });

    // The link left dangling: the next file is the primary.
    std::fs::remove_file(&real_kindnet).expect("rm");
    wait_for(
        "the owned file from the next one",
        Duration::from_secs(10),
        || copying(&agent, "other"),
    );
    assert_eq!(plugin_types(&owned), ["ptp", "istio-redirect"]);
    // That one gone too: only a dangling link is left.
    std::fs::remove_file(&other).expect("rm");
    wait_for("the owned file gone", Duration::from_secs(10), || {
        !owned.exists() && !agent.ready(&node)
    });
    std::fs::write(&real_kindnet, &kindnet).expect("kindnet's file back");
    wait_for(
        "the owned file from kindnet's again",
        Duration::from_secs(10),
        || copying(&agent, "kindnet"),
    );

    // What is left under the primary's name is a directory, then a FIFO:
    // neither is a configuration (and the FIFO never hangs the check).
    std::fs::remove_file(&kindnet_link).expect("rm the link");
    std::fs::create_dir(&kindnet_link).expect("a directory of that name");
    wait_for("gone with a directory left", Duration::from_secs(10), || {
        !owned.exists() && !agent.ready(&node)
    });
    std::fs::remove_dir(&kindnet_link).expect("rmdir");
    std::fs::write(&kindnet_link, &kindnet).expect("kindnet's file");
    wait_for("back", Duration::from_secs(10), || copying(&agent, "kindnet"));
    std::fs::remove_file(&kindnet_link).expect("rm");
    test_kit::run("mkfifo", &[kindnet_link.to_str().expect("UTF-8")]).success();
    wait_for("gone with a FIFO left", Duration::from_secs(10), || {
        !owned.exists() && !agent.ready(&node)
    });
    let (code, reason) = agent.probe(&node, "/readyz").expect("still answering");
    assert_eq!(code, 503, "{reason}");

    // Gone and forgotten: a file someone puts at its name meanwhile is
    // theirs, and is not overwritten once a primary is back.
    let theirs = json!({"cniVersion": "0.3.1", "name": "theirs", "plugins": [{"type": "ptp"}]}).to_string();
    std::fs::write(&owned, &theirs).expect("someone's file");
    std::fs::remove_file(&kindnet_link).expect("rm the FIFO");
    std::fs::write(&kindnet_link, &kindnet).expect("kindnet's file");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(std::fs::read_to_string(&owned).expect("kept"), theirs);
    assert!(!agent.ready(&node));
    std::fs::remove_file(&owned).expect("theirs removed");
    wait_for("back once more", Duration::from_secs(10), || {
        copying(&agent, "kindnet")
    });

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(conf_files(&node), ["10-kindnet.conflist"], "{log}");
    assert_eq!(read_json(&kindnet_link), kindnet_conflist(&node), "{log}");
}

/// [`read_json`], but Null for a file that is absent or not JSON.
fn read_json_or_null(path: &Path) -> Value {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

#[test]
fn settings_that_contradict_each_other_fail_the_start_before_any_change() {
    require_root();
    let node = kind_node();
    let server = server_of(&node);
    let before = bin_dir_snapshot(&host_bin(&node));
    for settings in [
        vec![("OWN_NETWORK", "false")],
        vec![
            ("OWN_NETWORK", "true"),
            ("ISTIO_CHAINED", "true"),
            ("ISTIO_OWNED_CNI_CONFIG", "true"),
        ],
        vec![
            ("OWN_NETWORK", "false"),
            ("ISTIO_CHAINED", "true"),
            ("ISTIO_OWNED_CNI_CONFIG", "true"),
            ("ISTIO_OWNED_CNI_CONF_FILENAME", "../escape.conflist"),
        ],
    ] {
        let mut agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &settings);
        let (status, log) = agent.exited(Duration::from_secs(20)).expect("the start failed");
        assert!(!status.success(), "{settings:?}: {log}");
        assert_eq!(bin_dir_snapshot(&host_bin(&node)), before, "{settings:?}: {log}");
        assert!(
            std::fs::read_dir(node.conf_dir()).expect("ls").next().is_none(),
            "{log}"
        );
    }
}
