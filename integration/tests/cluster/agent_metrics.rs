//! The node agent's `/metrics` against what happened on its node: the
//! agent runs against the API test server, pods are added and deleted
//! through its conflist and the plugins it installed as a runtime does
//! (cnictl), and the figures scraped must be those of what was done,
//! the lease service's included (it counts what it answers and tells the
//! agent on each scrape).

use std::time::Duration;

use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{Agent, AgentFixture, ReadyNode, host_bin, host_leases, lab_node, node_object};
use test_kit::{require_root, wait_for};

use crate::common::{sample, scrape};

const TOKEN: &str = "metrics-token";

/// [`sample`], which must be there.
fn value(exposition: &str, series: &str) -> f64 {
    sample(exposition, series).unwrap_or_else(|| panic!("no {series} in:\n{exposition}"))
}

#[test]
fn the_agents_metrics_count_its_install_syncs_and_the_leases_its_service_answered() {
    require_root();
    // The pods' bridge takes its MTU (the loopback's would be refused).
    let ReadyNode {
        node,
        server: _server,
        agent,
    } = AgentFixture::new(TOKEN).uplink().start();
    // The agent's child serves the lease directory: the pods' leases are
    // its to count.
    wait_for("the lease service", Duration::from_secs(10), || {
        value(&scrape(&node, &agent).1, "cni_suite_lease_service_up") == 1.0
    });

    let (content_type, before) = scrape(&node, &agent);
    assert_eq!(
        content_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(before.ends_with("# EOF\n"), "{before}");
    assert_eq!(
        sample(
            &before,
            r#"cni_suite_lease_requests_total{verb="ADD",result="success"}"#
        ),
        None,
        "nothing asked yet:\n{before}"
    );

    let bin = host_bin(&node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    const PODS: usize = 3;
    let pods: Vec<_> = (0..PODS).map(|_| node.pod("metrics-pod")).collect();
    for pod in &pods {
        node.cnictl_env(&["add", "cni-suite", pod.path_str()], &cni_path)
            .success();
    }
    // One DEL fewer than the ADDs: the counts must tell the verbs apart.
    for pod in &pods[1..] {
        node.cnictl_env(&["del", "cni-suite", pod.path_str()], &cni_path)
            .success();
    }
    let deleted = PODS - 1;

    let (_, after) = scrape(&node, &agent);
    assert_eq!(
        value(&after, r#"istio_cni_installs_total{result="SUCCESS"}"#),
        1.0
    );
    for failure in [
        "COPY_BINARIES_FAILURE",
        "CREATE_KUBECONFIG_FAILURE",
        "CREATE_CNI_CONFIG_FAILURE",
    ] {
        assert_eq!(
            value(
                &after,
                &format!(r#"istio_cni_installs_total{{result="{failure}"}}"#)
            ),
            0.0
        );
    }
    assert_eq!(value(&after, "istio_cni_install_ready"), 1.0);
    assert!(value(&after, "cni_suite_conflist_writes_total") >= 1.0);
    assert_eq!(value(&after, "cni_suite_chain_reinserts_total"), 0.0);
    assert!(value(&after, r#"cni_suite_route_syncs_total{result="success"}"#) >= 1.0);
    assert_eq!(
        value(&after, r#"cni_suite_route_syncs_total{result="failure"}"#),
        0.0
    );
    assert!(value(&after, r#"cni_suite_egress_syncs_total{result="success"}"#) >= 1.0);
    assert_eq!(value(&after, "cni_suite_lease_service_up"), 1.0);
    for (verb, done) in [("ADD", PODS), ("DEL", deleted)] {
        let done = done as f64;
        assert_eq!(
            value(
                &after,
                &format!(r#"cni_suite_lease_requests_total{{verb="{verb}",result="success"}}"#)
            ),
            done,
            "{after}"
        );
        assert_eq!(
            value(
                &after,
                &format!(r#"cni_suite_lease_request_duration_seconds_count{{verb="{verb}"}}"#)
            ),
            done
        );
        assert_eq!(
            value(
                &after,
                &format!(r#"cni_suite_lease_request_duration_seconds_bucket{{le="+Inf",verb="{verb}"}}"#)
            ),
            done
        );
        assert!(
            value(
                &after,
                &format!(r#"cni_suite_lease_request_duration_seconds_sum{{verb="{verb}"}}"#)
            ) > 0.0
        );
    }
    let lease_requests: Vec<&str> = after
        .lines()
        .filter(|line| line.starts_with("cni_suite_lease_requests_total{"))
        .collect();
    assert_eq!(
        lease_requests.len(),
        2,
        "only ADDs and DELs, all answered: {lease_requests:?}"
    );
    node.cnictl_env(&["del", "cni-suite", pods[0].path_str()], &cni_path)
        .success();
    let (_, last) = scrape(&node, &agent);
    assert_eq!(
        value(
            &last,
            r#"cni_suite_lease_requests_total{verb="DEL",result="success"}"#
        ),
        PODS as f64
    );
    let leases = node.leases_in("cni-suite", &host_leases(&node));
    assert!(!leases.contains("10.244.1."), "every lease released: {leases}");
}

/// Another CNI's conflist, sorting before the agent's: the primary file.
fn another_cnis_conflist() -> Value {
    json!({"cniVersion": "0.3.1", "name": "kindnet", "plugins": [
        {"type": "ptp", "ipMasq": false, "ipam": {"type": "host-local",
         "ranges": [[{"subnet": "10.244.1.0/24"}]]}},
        {"type": "portmap", "capabilities": {"portMappings": true}}
    ]})
}

fn last_plugin_type(path: &std::path::Path) -> Option<String> {
    let conf: Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    conf["plugins"].as_array()?.last()?["type"]
        .as_str()
        .map(str::to_owned)
}

#[test]
fn each_time_istio_redirect_is_put_back_into_a_rewritten_primary_file_is_counted() {
    require_root();
    let node = lab_node();
    let primary = node.conf_dir().join("10-kindnet.conflist");
    std::fs::write(&primary, another_cnis_conflist().to_string()).expect("the primary file");
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    let agent = Agent::start(
        &node,
        "n1",
        &server,
        "127.0.0.1",
        TOKEN,
        &[
            ("ISTIO_CHAINED", "true"),
            ("ISTIO_REPAIR", "off"),
            // Sorts after the other CNI's: that one stays the primary file.
            ("CNI_CONF_NAME", "90-cni-suite.conflist"),
        ],
    );
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    let (_, chained) = scrape(&node, &agent);
    assert_eq!(
        value(&chained, "cni_suite_chain_reinserts_total"),
        1.0,
        "chained once"
    );
    for round in 2..=3 {
        // The other CNI writes its file again, without the entry, whole at
        // once (a half-written file would be a failure to count).
        let written = node.conf_dir().join(".kindnet-next");
        std::fs::write(&written, another_cnis_conflist().to_string()).expect("written");
        std::fs::rename(&written, &primary).expect("rewritten");
        wait_for("istio-redirect chained again", Duration::from_secs(5), || {
            last_plugin_type(&primary).as_deref() == Some("istio-redirect")
        });
        wait_for("the re-insert counted", Duration::from_secs(2), || {
            value(&scrape(&node, &agent).1, "cni_suite_chain_reinserts_total") == f64::from(round)
        });
    }
    let (_, last) = scrape(&node, &agent);
    assert_eq!(
        value(
            &last,
            r#"istio_cni_installs_total{result="CREATE_CNI_CONFIG_FAILURE"}"#
        ),
        0.0
    );
    assert_eq!(
        value(
            &last,
            r#"istio_cni_installs_total{result="CREATE_KUBECONFIG_FAILURE"}"#
        ),
        0.0
    );
}
