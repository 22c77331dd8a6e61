//! The repair controller: pods that started before the chain, repaired where
//! they run or deleted, and the events reporting it.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{Agent, lab_node, node_object, uplink};
use test_kit::{Node, require_root, wait_for};

use crate::common::{CONTAINER_CAPABILITIES, ENVOY_REDIRECT, Pause, TOKEN, agent_of_n1, kindnet_conflist};

/// A pod as the API server holds it on node `node_name`: injected (the
/// injector's annotations), with its `istio-validation` init container
/// in `validation` state after last ending with `last_exit`.
fn injected_pod(
    name: &str,
    uid: &str,
    node_name: &str,
    ip: &str,
    validation: Value,
    last_exit: i32,
) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "default", "uid": uid, "annotations": {
            "sidecar.istio.io/status": r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#,
            "sidecar.istio.io/interceptionMode": "REDIRECT"}},
        "spec": {"nodeName": node_name,
                 "initContainers": [{"name": "istio-validation"}],
                 "containers": [{"name": "app"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"]}]},
        "status": {"podIP": ip, "podIPs": [{"ip": ip}], "initContainerStatuses": [{
            "name": "istio-validation", "ready": false, "restartCount": 2, "image": "proxyv2", "imageID": "",
            "state": validation,
            "lastState": {"terminated": {"exitCode": last_exit, "reason": "Error"}}}]},
    })
}

fn crash_looping() -> Value {
    json!({"waiting": {"reason": "CrashLoopBackOff"}})
}

fn passed() -> Value {
    json!({"terminated": {"exitCode": 0, "reason": "Completed"}})
}

/// `type reason` of the events on `pod`, in order.
fn event_reasons(server: &ApiServer, pod: &str) -> Vec<String> {
    events_of(server, pod)
        .iter()
        .map(|event| event.split(':').next().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn a_pod_that_started_before_the_chain_is_repaired_where_it_runs_and_then_captures_traffic() {
    repaired_where_it_runs(false, false);
}

/// With NetworkPolicy on too, repair reads this node's pods from the
/// agent's one Pod watch, which lists every pod for the policy: the
/// pod on another node is still left alone.
#[test]
fn with_network_policy_on_repair_shares_the_agents_one_pod_watch() {
    repaired_where_it_runs(false, true);
}

/// The same with Istio's CNI alone (`deploy/istio-cni.yaml`), beside
/// kindnet's configuration.
#[test]
fn with_istios_cni_alone_a_pod_that_started_before_the_chain_is_repaired_where_it_runs() {
    repaired_where_it_runs(true, false);
}

fn repaired_where_it_runs(istio_only: bool, network_policy: bool) {
    require_root();
    // Addresses of this variant alone: the agent searches every process of
    // the machine, and the two variants run side by side.
    let subnet = match (istio_only, network_policy) {
        (true, _) => "10.199.21",
        (false, false) => "10.199.7",
        (false, true) => "10.199.23",
    };
    let (host_ip, pod_ip) = (format!("{subnet}.1"), format!("{subnet}.5"));
    let node = lab_node();
    uplink(&node);
    let mut settings = vec![("ISTIO_CHAINED", "true")];
    if network_policy {
        settings.push(("NETWORK_POLICY", "true"));
    }
    if istio_only {
        std::fs::write(
            node.conf_dir().join("10-kindnet.conflist"),
            kindnet_conflist().to_string(),
        )
        .expect("kindnet's file");
        settings.extend([
            ("OWN_NETWORK", "false"),
            ("CNI_INSTALL_PLUGINS", "istio-redirect"),
        ]);
    }
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    // The pod the race left behind: wired, running, and no capture. Its
    // address is this test's alone, since the agent searches every
    // process of the machine.
    let pod = node.pod("racer");
    node.netns.veth_to("racer0", &pod);
    node.netns
        .ip(&["addr", "add", &format!("{host_ip}/24"), "dev", "racer0"])
        .success();
    node.netns.ip(&["link", "set", "racer0", "up"]).success();
    pod.ip(&["addr", "add", &format!("{pod_ip}/24"), "dev", "eth0"])
        .success();
    pod.ip(&["link", "set", "eth0", "up"]).success();
    pod.ip(&["link", "set", "lo", "up"]).success();
    let _pause = Pause::start(&pod);
    assert!(
        !pod.nat_rules("iptables-save").contains("ISTIO"),
        "no capture before the repair"
    );

    server.add_pod(
        "default",
        "racer",
        injected_pod("racer", "uid-racer", "n1", &pod_ip, crash_looping(), 126),
    );
    // Left alone: validation passed now; failed for another reason; on
    // another node.
    for (name, validation, code, node_name) in [
        ("passed", passed(), 126, "n1"),
        ("other-failure", crash_looping(), 1, "n1"),
        ("elsewhere", crash_looping(), 126, "n2"),
    ] {
        server.add_pod(
            "default",
            name,
            injected_pod(
                name,
                &format!("uid-{name}"),
                node_name,
                &format!("{subnet}.9"),
                validation,
                code,
            ),
        );
    }
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    settings.push(("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8")));
    // With the capabilities deploy/cni-suite-istio.yaml and
    // deploy/istio-cni.yaml give it.
    let mut agent = Agent::start_under(
        &node,
        "n1",
        &server,
        "127.0.0.1",
        TOKEN,
        &settings,
        &[
            "setpriv",
            &format!("--bounding-set=-all,{CONTAINER_CAPABILITIES},+sys_admin,+sys_ptrace"),
            "--",
        ],
    );
    wait_for(
        "the capture programmed in the running pod",
        Duration::from_secs(20),
        || pod.nat_rules("iptables-save").contains(ENVOY_REDIRECT),
    );

    // It captures: the app's outbound connection lands on Envoy's port.
    let probe = test_kit::probe::Probe::new();
    let envoy = probe.listen(&pod, &[15001]);
    probe.connect(&pod, None, &host_ip, 8080, None).success();
    envoy.wait_for(&format!("tcp 15001 {host_ip}:8080"));
    assert_eq!(event_reasons(&server, "racer"), ["Normal RepairBrokenPod"]);
    assert_eq!(server.pod_lists(), 1, "one Pod watch, listed once");

    // The kubelet restarts the validation container: the pod changes,
    // and is not programmed again.
    let mut restarted = injected_pod("racer", "uid-racer", "n1", &pod_ip, crash_looping(), 126);
    restarted["status"]["initContainerStatuses"][0]["restartCount"] = json!(3);
    server.add_pod("default", "racer", restarted);
    std::thread::sleep(Duration::from_millis(1500));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(
        log.matches("capture programmed in the running pod").count(),
        1,
        "{log}"
    );
    for left_alone in ["passed", "other-failure", "elsewhere"] {
        assert!(!log.contains(left_alone), "{left_alone} untouched: {log}");
        assert!(event_reasons(&server, left_alone).is_empty());
    }
    assert!(
        server.writes().iter().all(|w| w.method == "POST"),
        "only events written"
    );
}

#[test]
fn broken_pods_are_deleted_with_preconditions_or_labelled_through_status_as_configured() {
    require_root();
    let node = lab_node();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    for (mode, broken) in [("delete", "to-delete"), ("label", "to-label")] {
        server.add_pod(
            "default",
            broken,
            injected_pod(
                broken,
                &format!("uid-{broken}"),
                "n1",
                "10.199.8.5",
                crash_looping(),
                126,
            ),
        );
        server.add_pod(
            "default",
            "healthy",
            injected_pod("healthy", "uid-healthy", "n1", "10.199.8.6", passed(), 126),
        );
        let version = server.pod("default", broken).expect("added")["metadata"]["resourceVersion"].clone();
        let mut agent = agent_of_n1(
            &node,
            &server,
            TOKEN,
            &[("ISTIO_CHAINED", "true"), ("ISTIO_REPAIR", mode)],
        );
        let path = format!("/api/v1/namespaces/default/pods/{broken}");
        if mode == "delete" {
            wait_for("the broken pod deleted", Duration::from_secs(20), || {
                server.pod("default", broken).is_none()
            });
            let deletes: Vec<_> = server
                .writes()
                .into_iter()
                .filter(|w| w.method == "DELETE")
                .collect();
            assert_eq!(deletes.len(), 1, "{deletes:?}");
            assert_eq!(deletes[0].path, path);
            assert_eq!(
                deletes[0].body["preconditions"],
                json!({"uid": format!("uid-{broken}"), "resourceVersion": version}),
            );
        } else {
            wait_for("the broken pod labelled", Duration::from_secs(20), || {
                server.pod("default", broken).expect("kept")["metadata"]["labels"]["cni.istio.io/uninitialized"]
                    == "true"
            });
            std::thread::sleep(Duration::from_millis(1500));
            let patches: Vec<_> = server
                .writes()
                .into_iter()
                .filter(|w| w.method == "PATCH")
                .collect();
            assert_eq!(patches.len(), 1, "labelled once: {patches:?}");
            assert_eq!(patches[0].path, format!("{path}/status"));
            assert_eq!(patches[0].content_type, "application/merge-patch+json");
        }
        let reason = if mode == "delete" {
            "DeleteBrokenPod"
        } else {
            "LabelBrokenPod"
        };
        wait_for("the event", Duration::from_secs(5), || {
            event_reasons(&server, broken) == [format!("Normal {reason}")]
        });
        let healthy = server.pod("default", "healthy").expect("the healthy pod stays");
        assert!(healthy["metadata"]["labels"].is_null(), "{healthy}");
        assert!(event_reasons(&server, "healthy").is_empty());
        let (status, log) = agent.stop();
        assert!(status.success(), "{log}");
    }
}

/// A running pod's namespace wired to the node through `link`, with
/// `pod_ip` (`host_ip` on the node's side, both /24): a pod the race left
/// without capture. Addresses must be the calling test's alone, since the
/// agent searches every process of the machine.
fn running_pod(node: &Node, role: &str, link: &str, host_ip: &str, pod_ip: &str) -> test_kit::Netns {
    let pod = node.pod(role);
    node.netns.veth_to(link, &pod);
    node.netns
        .ip(&["addr", "add", &format!("{host_ip}/24"), "dev", link])
        .success();
    node.netns.ip(&["link", "set", link, "up"]).success();
    pod.ip(&["addr", "add", &format!("{pod_ip}/24"), "dev", "eth0"])
        .success();
    pod.ip(&["link", "set", "eth0", "up"]).success();
    pod.ip(&["link", "set", "lo", "up"]).success();
    pod
}

/// The agent of n1 with Istio chained and repairing, under the
/// capabilities deploy/cni-suite-istio.yaml gives it.
fn repairing_agent(node: &Node, server: &ApiServer, extra: &[(&str, &str)]) -> Agent {
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let mut settings = vec![
        ("ISTIO_CHAINED", "true"),
        ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8")),
    ];
    settings.extend_from_slice(extra);
    Agent::start_under(
        node,
        "n1",
        server,
        "127.0.0.1",
        TOKEN,
        &settings,
        &[
            "setpriv",
            &format!("--bounding-set=-all,{CONTAINER_CAPABILITIES},+sys_admin,+sys_ptrace"),
            "--",
        ],
    )
}

/// `type reason: message` of the events on `pod`, in order.
fn events_of(server: &ApiServer, pod: &str) -> Vec<String> {
    server
        .events()
        .iter()
        .filter(|e| e["involvedObject"]["name"] == pod)
        .map(|e| {
            format!(
                "{} {}: {}",
                e["type"].as_str().unwrap_or("?"),
                e["reason"].as_str().unwrap_or("?"),
                e["message"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

#[test]
fn a_pod_the_plugin_passes_through_is_reported_as_skipped_and_retried() {
    require_root();
    let node = lab_node();
    uplink(&node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    let pod = running_pod(&node, "skipped", "skipped0", "10.199.9.1", "10.199.9.5");
    let pause = Pause::start(&pod);
    // Injected, crash-looping, and in a namespace the default entry
    // excludes: istio-redirect passes it through whoever runs it.
    let mut excluded = injected_pod("skipped", "uid-skipped", "n1", "10.199.9.5", crash_looping(), 126);
    excluded["metadata"]["namespace"] = json!("istio-system");
    server.add_pod("istio-system", "skipped", excluded.clone());
    let mut agent = repairing_agent(&node, &server, &[]);

    wait_for("the pass-through reported", Duration::from_secs(20), || {
        !events_of(&server, "skipped").is_empty()
    });
    let events = events_of(&server, "skipped");
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        events[0].starts_with("Warning RepairBrokenPod: ")
            && events[0].contains("not programmed")
            && events[0].contains("namespace istio-system is excluded"),
        "a skip, with the plugin's reason: {events:?}"
    );
    assert!(
        !pod.nat_rules("iptables-save").contains("ISTIO"),
        "nothing programmed"
    );

    // The kubelet restarts the validation container: the pod is tried
    // again, and the same outcome is not reported twice.
    excluded["status"]["initContainerStatuses"][0]["restartCount"] = json!(3);
    server.add_pod("istio-system", "skipped", excluded);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(events_of(&server, "skipped"), events, "reported once");

    // Left as it is, the pod is still tried every 10 s: once its pause
    // process is gone, the next attempt fails otherwise, and says so.
    drop(pause);
    wait_for("the retry's new outcome", Duration::from_secs(15), || {
        events_of(&server, "skipped").len() == 2
    });
    let retried = events_of(&server, "skipped");
    assert!(
        retried[1].starts_with("Warning RepairBrokenPod: ") && retried[1].contains("10.199.9.5"),
        "{retried:?}"
    );

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(!log.contains("capture programmed"), "{log}");
    assert_eq!(log.matches("the capture was not programmed").count(), 1, "{log}");
    assert!(
        !pod.nat_rules("iptables-save").contains("ISTIO"),
        "nothing programmed"
    );
    assert!(
        server.writes().iter().all(|w| w.method == "POST"),
        "only events written"
    );
}

#[test]
fn a_pod_repaired_into_istios_own_nftables_tables_is_reported_as_captured() {
    require_root();
    let node = lab_node();
    uplink(&node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    let pod = running_pod(&node, "native", "native0", "10.199.10.1", "10.199.10.5");
    let _pause = Pause::start(&pod);
    server.add_pod(
        "default",
        "native",
        injected_pod("native", "uid-native", "n1", "10.199.10.5", crash_looping(), 126),
    );
    let entry = json!({
        "type": "istio-redirect",
        "capabilities": {"io.kubernetes.cri.pod-annotations": true},
        "native_nftables": true,
    })
    .to_string();
    let mut agent = repairing_agent(&node, &server, &[("ISTIO_PLUGIN_CONFIG", &entry)]);

    wait_for("the repair reported", Duration::from_secs(20), || {
        !events_of(&server, "native").is_empty()
    });
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(
        event_reasons(&server, "native"),
        ["Normal RepairBrokenPod"],
        "{:?}\n{log}",
        events_of(&server, "native")
    );
    let tables = test_kit::run_in(pod.path(), Path::new("nft"), &["list", "tables"], &[], "")
        .success()
        .stdout;
    assert!(tables.contains("table inet istio-proxy-nat"), "{tables}");
    assert!(
        !pod.nat_rules("iptables-save").contains("ISTIO"),
        "no iptables rules: {tables}"
    );
}
