//! NetworkPolicy enforced by the agent from what the API server holds:
//! pods added through the conflist the agent wrote, their Pod objects
//! (with the addresses their ADD gave them) and policies on the API test
//! server; connections pass or not as the policies say, follow their
//! changes, stay judged while no agent runs, and nothing is left after
//! uninstall.

use std::time::Duration;

use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{Agent, host_bin, lab_node, node_object};
use test_kit::probe::Probe;
use test_kit::{Netns, Node, require_root, wait_for};

use super::agent_metrics::{sample, scrape};
use super::node_agent::{pod_address, uplink};

const TOKEN: &str = "policy-token";
const PORT: u16 = 5432;
const POLICY_ON: (&str, &str) = ("NETWORK_POLICY", "true");
const APPLIED: &str = "cni_suite_policy_syncs_total{result=\"success\"}";

struct Pods<'a> {
    node: &'a Node,
    probe: Probe,
    pods: Vec<(String, Netns, String)>,
}

impl<'a> Pods<'a> {
    /// Pods of namespace `shop` added through the agent's conflist, each
    /// labelled `app: <name>`, their Pod objects on `server`.
    fn add(node: &'a Node, server: &ApiServer, names: &[&str]) -> Pods<'a> {
        let bin = host_bin(node);
        let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
        let pods = names
            .iter()
            .map(|name| {
                let ns = node.pod(name);
                let cidr =
                    pod_address(node.cnictl_env(&["--json", "add", "cni-suite", ns.path_str()], &cni_path));
                let ip = cidr.split('/').next().unwrap_or_default().to_owned();
                server.add_pod("shop", name, pod_object(name, &ip));
                ((*name).to_owned(), ns, ip)
            })
            .collect();
        Pods {
            node,
            probe: Probe::new(),
            pods,
        }
    }

    fn get(&self, name: &str) -> &(String, Netns, String) {
        self.pods
            .iter()
            .find(|(n, _, _)| n == name)
            .expect("a pod of that name")
    }

    fn connects(&self, from: &str, to: &str) -> bool {
        let (_, ns, _) = self.get(from);
        let (_, _, ip) = self.get(to);
        self.probe.connect(ns, None, ip, PORT, None).ok()
    }
}

impl Drop for Pods<'_> {
    fn drop(&mut self) {
        let bin = host_bin(self.node);
        let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
        for (_, ns, _) in &self.pods {
            let _ = self
                .node
                .cnictl_env(&["del", "cni-suite", ns.path_str()], &cni_path);
        }
    }
}

fn pod_object(name: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"), "labels": {"app": name}},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x",
                 "ports": [{"name": "db", "containerPort": PORT, "protocol": "TCP"}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    })
}

/// `db` takes connections from `web` on its port named `db`.
fn db_from_web() -> Value {
    json!({
        "metadata": {"name": "db-from-web", "namespace": "shop"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "db"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}],
                         "ports": [{"port": "db"}]}],
        },
    })
}

fn applied(node: &Node, agent: &Agent) -> f64 {
    sample(&scrape(node, agent).1, APPLIED).unwrap_or_default()
}

fn tables(node: &Node) -> String {
    node.run("nft", &["list", "tables"]).success().stdout
}

#[test]
fn the_agent_enforces_the_api_servers_policies_and_they_hold_while_no_agent_runs() {
    require_root();
    let node = lab_node();
    uplink(&node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    server.apply_namespace(
        json!({"metadata": {"name": "shop", "labels": {"kubernetes.io/metadata.name": "shop"}}}),
    );
    let mut agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &[POLICY_ON]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    let pods = Pods::add(&node, &server, &["web", "db", "other"]);
    let _listener = pods.probe.listen(&pods.get("db").1, &[PORT]);
    assert!(pods.connects("other", "db"), "open before any policy");

    server.apply_network_policy(db_from_web());
    wait_for("other refused", Duration::from_secs(15), || {
        !pods.connects("other", "db")
    });
    assert!(pods.connects("web", "db"), "web is allowed on the port it names");

    // The agent stops for an upgrade: the verdicts stay in the kernel.
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(tables(&node).contains(netpol::TABLE), "{log}");
    assert!(!pods.connects("other", "db"), "still refused with no agent");
    assert!(pods.connects("web", "db"));

    // The next agent reconciles what it finds: nothing to change.
    let mut agent = Agent::start(
        &node,
        "n1",
        &server,
        "127.0.0.1",
        TOKEN,
        &[POLICY_ON, ("UNINSTALL_ON_STOP", "true")],
    );
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    wait_for("a sync", Duration::from_secs(20), || {
        applied(&node, &agent) >= 1.0
    });
    assert!(!pods.connects("other", "db"));

    // The policy goes: open again.
    server.delete_network_policy("shop", "db-from-web");
    wait_for("other allowed", Duration::from_secs(15), || {
        pods.connects("other", "db")
    });

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(
        log.matches("NetworkPolicy: the table changed").count(),
        1,
        "the restarted agent changed nothing until the policy went: {log}"
    );
    assert!(
        !tables(&node).contains(netpol::TABLE),
        "uninstall removes the table: {log}"
    );
}
