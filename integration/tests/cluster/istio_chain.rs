//! The Istio chain controller: istio-redirect chained into the files the
//! runtime reads, the kubeconfig it reads pods with, and unchaining.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{Agent, AgentFixture, ReadyNode, host_bin, lab_node, node_object, uplink};
use test_kit::{Node, require_root, wait_for};

use crate::common::{
    ENVOY_REDIRECT, TOKEN, agent_of_n1, bare_conf, conflist, kindnet_conflist, plugin_types,
};

#[test]
fn istio_redirect_is_chained_last_into_another_cnis_file_and_put_back() {
    require_root();
    let node = lab_node();
    let kindnet = node.conf_dir().join("10-kindnet.conflist");
    std::fs::write(&kindnet, kindnet_conflist().to_string()).expect("kindnet's file");
    let ReadyNode {
        node: _node,
        server: _server,
        mut agent,
    } = AgentFixture::new(TOKEN)
        .on(node)
        .uplink()
        .settings(&[
            ("ISTIO_CHAINED", "true"),
            // Sorts after kindnet's: kindnet's stays the primary file.
            ("CNI_CONF_NAME", "90-cni-suite.conflist"),
            ("UNINSTALL_ON_STOP", "true"),
        ])
        .start();
    assert_eq!(plugin_types(&kindnet), ["ptp", "portmap", "istio-redirect"]);

    // kindnetd writes its file again: the entry is back within 2 s.
    std::fs::write(&kindnet, kindnet_conflist().to_string()).expect("rewritten");
    wait_for("istio-redirect chained again", Duration::from_secs(2), || {
        plugin_types(&kindnet) == ["ptp", "portmap", "istio-redirect"]
    });

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    let left: Value = serde_json::from_str(&std::fs::read_to_string(&kindnet).expect("kept")).expect("JSON");
    assert_eq!(left, kindnet_conflist(), "only our entry removed: {log}");
}

#[test]
fn a_pod_added_through_the_chain_the_agent_wrote_has_istios_capture() {
    require_root();
    // A pod with no Kubernetes arguments (cnictl's) is captured by the
    // entry's static `redirect`.
    let entry = r#"{"type":"istio-redirect","redirect":{"interceptionMode":"REDIRECT"}}"#;
    let ReadyNode {
        node,
        server: _server,
        agent: _agent,
    } = AgentFixture::new(TOKEN)
        .uplink()
        .settings(&[("ISTIO_CHAINED", "true"), ("ISTIO_PLUGIN_CONFIG", entry)])
        .start();
    assert_eq!(
        plugin_types(&conflist(&node)),
        ["bridge", "portmap", "istio-redirect"]
    );
    let bin = host_bin(&node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    node.cnictl_env(&["add", "cni-suite", pod.path_str()], &cni_path)
        .success();
    let rules = pod.nat_rules("iptables-save");
    assert!(rules.contains(ENVOY_REDIRECT), "{rules}");
    node.cnictl_env(&["del", "cni-suite", pod.path_str()], &cni_path)
        .success();
}

#[test]
fn with_istio_chaining_on_the_agent_is_ready_only_once_the_entry_is_in() {
    require_root();
    let node = lab_node();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    // The primary file is named, and another CNI has not written it yet.
    let agent = agent_of_n1(
        &node,
        &server,
        TOKEN,
        &[
            ("ISTIO_CHAINED", "true"),
            ("ISTIO_CNI_CONF_FILE", "10-kindnet.conflist"),
        ],
    );
    wait_for("the agent's own conflist", Duration::from_secs(20), || {
        conflist(&node).exists()
    });
    std::thread::sleep(Duration::from_millis(1500));
    let (code, reason) = agent.probe(&node, "/readyz").expect("an answer");
    assert_eq!(code, 503);
    assert!(reason.contains("istio-redirect is not chained"), "{reason}");
    let kindnet = node.conf_dir().join("10-kindnet.conflist");
    std::fs::write(&kindnet, kindnet_conflist().to_string()).expect("kindnet's file");
    wait_for("ready once chained", Duration::from_secs(2), || {
        agent.ready(&node)
    });
    assert_eq!(plugin_types(&kindnet), ["ptp", "portmap", "istio-redirect"]);
}

/// The network a runtime sets pods up with: the name in the first valid
/// file of the conf directory, as containerd and CRI-O pick it.
fn runtime_network(node: &Node) -> String {
    test_kit::conf_files(&node.conf_dir())
        .iter()
        .find_map(|path| {
            let conf: Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
            conf["name"].as_str().map(str::to_owned)
        })
        .expect("a configuration")
}

/// The IPv4 address cnictl's result gives the pod.
fn pod_address(run: test_kit::Run) -> String {
    let result = run.success().json();
    result["ips"][0]["address"]
        .as_str()
        .expect("an address")
        .to_owned()
}

#[test]
fn an_istio_wrap_keeps_the_confs_network_so_new_pods_get_free_addresses_and_uninstall_puts_it_back() {
    require_root();
    let node = lab_node();
    let leases = node.path("mynet-leases");
    let bare = bare_conf(&leases);
    let conf_path = node.conf_dir().join("10-mynet.conf");
    std::fs::write(&conf_path, &bare).expect("the node's own .conf");
    let network = runtime_network(&node);
    // A pod the runtime set up through the .conf before Istio came.
    let first = node.pod("first");
    let first_address = pod_address(node.cnictl_env(&["--json", "add", &network, first.path_str()], &[]));

    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let settings = [
        ("ISTIO_CHAINED", "true"),
        ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8")),
        // Sorts after the .conf: that stays the file the runtime uses.
        ("CNI_CONF_NAME", "90-cni-suite.conflist"),
    ];
    let ReadyNode {
        node,
        server,
        mut agent,
    } = AgentFixture::new(TOKEN)
        .on(node)
        .uplink()
        .settings(&settings)
        .start();
    let list_path = node.conf_dir().join("10-mynet.conflist");
    assert_eq!(plugin_types(&list_path), ["bridge", "istio-redirect"]);
    assert!(!conf_path.exists(), "the .conf is replaced by its list");

    // The next pod, set up through the wrapped list as a runtime does,
    // gets an address no running pod holds.
    let second = node.pod("second");
    let bin = host_bin(&node);
    let second_address = pod_address(node.cnictl_env(
        &["--json", "add", &runtime_network(&node), second.path_str()],
        &[("CNI_PATH", bin.to_str().expect("UTF-8"))],
    ));
    assert_ne!(
        second_address, first_address,
        "two pods on one bridge with one address"
    );
    assert_eq!(
        runtime_network(&node),
        network,
        "the wrap keeps the network's name"
    );

    // Killed, then replaced by an agent that uninstalls: the .conf comes
    // back byte for byte from what the first agent recorded.
    agent.kill();
    let mut settings = settings.to_vec();
    settings.push(("UNINSTALL_ON_STOP", "true"));
    let mut agent = agent_of_n1(&node, &server, TOKEN, &settings);
    wait_for("readiness again", Duration::from_secs(20), || agent.ready(&node));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(
        std::fs::read_to_string(&conf_path).ok().as_deref(),
        Some(bare.as_str()),
        "the .conf put back byte for byte: {log}"
    );
    assert!(!list_path.exists(), "{log}");
}

#[test]
fn istio_cni_conf_file_naming_a_conf_is_followed_to_its_list_until_uninstall() {
    require_root();
    let node = lab_node();
    let conf_path = node.conf_dir().join("10-mynet.conf");
    let bare = bare_conf(&node.path("mynet-leases"));
    std::fs::write(&conf_path, &bare).expect("the node's own .conf");
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let ReadyNode {
        node,
        server: _server,
        mut agent,
    } = AgentFixture::new(TOKEN)
        .on(node)
        .uplink()
        .settings(&[
            ("ISTIO_CHAINED", "true"),
            ("ISTIO_CNI_CONF_FILE", "10-mynet.conf"),
            ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8")),
            ("UNINSTALL_ON_STOP", "true"),
        ])
        .start();
    let list_path = node.conf_dir().join("10-mynet.conflist");
    assert_eq!(plugin_types(&list_path), ["bridge", "istio-redirect"]);
    // Checked every 500 ms: still ready after several checks, and the
    // kubeconfig still follows the token.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(agent.ready(&node), "{:?}", agent.probe(&node, "/readyz"));
    std::fs::write(node.path("serviceaccount/token"), "rotated-token").expect("rotate");
    wait_for(
        "the kubeconfig to follow the token",
        Duration::from_secs(2),
        || std::fs::read_to_string(&kubeconfig).is_ok_and(|text| text.contains("rotated-token")),
    );

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(
        std::fs::read_to_string(&conf_path).ok().as_deref(),
        Some(bare.as_str()),
        "{log}"
    );
    assert!(!list_path.exists(), "{log}");
    assert!(
        !host_bin(&node).join("istio-redirect").exists(),
        "nothing names istio-redirect any more: {log}"
    );
}

#[test]
fn the_agent_chains_the_file_the_runtime_uses_and_unchains_every_file_it_chained() {
    require_root();
    let node = lab_node();
    let kindnet = node.conf_dir().join("10-kindnet.conflist");
    std::fs::write(&kindnet, kindnet_conflist().to_string()).expect("kindnet's file");
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let kubeconfig = ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8"));

    // The agent's own conflist sorts first: that is the file the runtime
    // uses, and kindnet's is never touched.
    let ReadyNode {
        node,
        server,
        mut agent,
    } = AgentFixture::new(TOKEN)
        .on(node)
        .uplink()
        .settings(&[
            ("ISTIO_CHAINED", "true"),
            kubeconfig,
            ("UNINSTALL_ON_STOP", "true"),
        ])
        .start();
    assert_eq!(
        plugin_types(&kindnet),
        ["ptp", "portmap"],
        "kindnet's file untouched"
    );
    assert_eq!(
        plugin_types(&conflist(&node)).last().map(String::as_str),
        Some("istio-redirect")
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(plugin_types(&kindnet), ["ptp", "portmap"], "{log}");
    assert!(!host_bin(&node).join("istio-redirect").exists(), "{log}");

    // Sorting after kindnet's, the agent chains kindnet's file; then an
    // operator's file takes the lead and is chained too. Killed and
    // replaced, the next agent still unchains both.
    let settings = [
        ("ISTIO_CHAINED", "true"),
        kubeconfig,
        ("CNI_CONF_NAME", "90-cni-suite.conflist"),
    ];
    let mut agent = agent_of_n1(&node, &server, TOKEN, &settings);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    assert_eq!(plugin_types(&kindnet), ["ptp", "portmap", "istio-redirect"]);
    let operator = node.conf_dir().join("05-operator.conflist");
    let operators = json!({"cniVersion": "1.0.0", "name": "operator", "plugins": [{"type": "ptp",
        "ipam": {"type": "host-local", "subnet": "10.23.0.0/24"}}]});
    std::fs::write(&operator, operators.to_string()).expect("an operator's file");
    wait_for("the operator's file chained", Duration::from_secs(2), || {
        plugin_types(&operator) == ["ptp", "istio-redirect"]
    });
    agent.kill();
    let mut settings = settings.to_vec();
    settings.push(("UNINSTALL_ON_STOP", "true"));
    let mut agent = agent_of_n1(&node, &server, TOKEN, &settings);
    wait_for("readiness again", Duration::from_secs(20), || agent.ready(&node));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    let read = |path: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).expect("kept")).expect("JSON")
    };
    assert_eq!(read(&kindnet), kindnet_conflist(), "{log}");
    assert_eq!(read(&operator), operators, "{log}");
    assert!(!host_bin(&node).join("istio-redirect").exists(), "{log}");
}

/// Whether `agent` is ready within `limit`; an agent that is not is
/// killed, so that a hung one cannot hang the test's end.
fn ready_or_killed(agent: &mut Agent, node: &Node, limit: Duration) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if agent.ready(node) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.kill();
    false
}

#[test]
fn fifos_where_the_agent_reads_never_hang_it() {
    require_root();
    let node = lab_node();
    uplink(&node);
    let fifo = |path: &Path| {
        std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        test_kit::mkfifo(path);
    };
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    fifo(&kubeconfig);
    fifo(&node.conf_dir().join("00-fifo.conf"));
    fifo(&conflist(&node));
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    let mut agent = agent_of_n1(
        &node,
        &server,
        TOKEN,
        &[("ISTIO_CHAINED", "true"), ("UNINSTALL_ON_STOP", "true")],
    );
    assert!(
        ready_or_killed(&mut agent, &node, Duration::from_secs(20)),
        "the agent hung on a FIFO"
    );
    assert!(std::fs::metadata(&kubeconfig).expect("written").is_file());
    // Someone puts a FIFO where the agent's conflist was: uninstall still
    // ends.
    std::fs::remove_file(conflist(&node)).expect("rm");
    fifo(&conflist(&node));
    let pid = agent.pid().expect("running");
    let watchdog = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(20));
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    });
    let (status, log) = agent.stop();
    assert!(status.success(), "uninstall hung or failed: {status:?} {log}");
    drop(watchdog);
}

#[test]
fn an_entry_an_earlier_release_chained_without_a_record_is_unchained_too() {
    require_root();
    let node = lab_node();
    // What a release before the record left: kindnet's file chained with
    // the agent's entry, the agent's own conflist sorting first.
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let entry = json!({"type": "istio-redirect",
                       "capabilities": {"io.kubernetes.cri.pod-annotations": true},
                       "exclude_namespaces": ["kube-system", "istio-system"],
                       "kubeconfig": kubeconfig});
    let mut chained = kindnet_conflist();
    chained["plugins"].as_array_mut().expect("plugins").push(entry);
    let kindnet = node.conf_dir().join("10-kindnet.conflist");
    std::fs::write(&kindnet, chained.to_string()).expect("kindnet's file");
    let ReadyNode {
        node,
        server: _server,
        mut agent,
    } = AgentFixture::new(TOKEN)
        .on(node)
        .uplink()
        .settings(&[("ISTIO_CHAINED", "true"), ("UNINSTALL_ON_STOP", "true")])
        .start();
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    let left: Value = serde_json::from_str(&std::fs::read_to_string(&kindnet).expect("kept")).expect("JSON");
    assert_eq!(left, kindnet_conflist(), "{log}");
    assert!(!host_bin(&node).join("istio-redirect").exists(), "{log}");
}

#[test]
fn istio_redirect_reads_pods_with_the_kubeconfig_the_agent_keeps_current() {
    require_root();
    let node = lab_node();
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let ReadyNode {
        node,
        server,
        mut agent,
    } = AgentFixture::new(TOKEN)
        .on(node)
        .uplink()
        .settings(&[
            ("ISTIO_CHAINED", "true"),
            ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8")),
            ("UNINSTALL_ON_STOP", "true"),
        ])
        .start();
    // An injected pod, as the API server serves it (read by the plugin).
    server.add_pod(
        "default",
        "web-0",
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "web-0", "namespace": "default", "annotations": {
                   "sidecar.istio.io/status": r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#}},
               "spec": {"initContainers": [{"name": "istio-validation"}],
                        "containers": [{"name": "app"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"]}]}}),
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&kubeconfig).expect("written").permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    assert!(
        !kubeconfig.starts_with(node.conf_dir()),
        "outside the CNI conf directory"
    );

    // cnictl passes the Kubernetes arguments a kubelet's runtime would, and
    // no annotations: the plugin reads the pod through the kubeconfig.
    let bin = host_bin(&node);
    let pod = node.pod("pod");
    let requests = server.requests();
    node.cnictl_env(
        &[
            "add",
            "--args",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=x",
            "cni-suite",
            pod.path_str(),
        ],
        &[("CNI_PATH", bin.to_str().expect("UTF-8"))],
    )
    .success();
    assert!(server.requests() > requests, "the plugin asked the API server");
    let rules = pod.nat_rules("iptables-save");
    assert!(rules.contains("ISTIO_REDIRECT"), "{rules}");

    // The kubelet rotates the token: the kubeconfig follows.
    std::fs::write(node.path("serviceaccount/token"), "rotated-token").expect("rotate");
    wait_for(
        "the kubeconfig to carry the new token",
        Duration::from_secs(2),
        || std::fs::read_to_string(&kubeconfig).is_ok_and(|text| text.contains("rotated-token")),
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(!kubeconfig.exists(), "removed on uninstall: {log}");
}
