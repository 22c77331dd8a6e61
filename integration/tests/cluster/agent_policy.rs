//! NetworkPolicy enforced by the agent from what the API server holds:
//! pods added through the conflist the agent wrote, their Pod objects
//! (with the addresses their ADD gave them) and policies on the API test
//! server; connections pass or not as the policies say, follow their
//! changes, stay judged while no agent runs, and nothing is left after
//! uninstall.

use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{
    Agent, block_rules_policy, host_bin, host_conflist, host_policy_socket, lab_node, node_object, uplink,
};
use test_kit::probe::{Held, Probe};
use test_kit::{Netns, Node, Run, require_root, wait_for};

use crate::common::{sample, scrape};

const TOKEN: &str = "policy-token";
const PORT: u16 = 5432;
/// Where pods' echo servers listen, for connections held open.
const ECHO_PORT: u16 = 7000;
const POLICY_ON: (&str, &str) = ("NETWORK_POLICY", "true");
const APPLIED: &str = "cni_suite_policy_syncs_total{result=\"success\"}";
const ENFORCED_ADDS: &str = "cni_suite_policy_admissions_total{answer=\"enforced\"}";

struct Pods<'a> {
    node: &'a Node,
    probe: Probe,
    pods: Vec<(String, Netns, String)>,
}

impl<'a> Pods<'a> {
    /// Pods of namespace `shop` added through the agent's conflist, each
    /// labelled `app: <name>`, as a kubelet adds them: the Pod object on
    /// `server` first, then the ADD naming it, then the address in its
    /// status.
    fn add(node: &'a Node, server: &ApiServer, names: &[&str]) -> Pods<'a> {
        let mut pods = Pods {
            node,
            probe: Probe::new(),
            pods: Vec::new(),
        };
        for name in names {
            let ip = pods.start(server, name, name);
            server.add_pod("shop", name, pod_object("shop", name, name, Some(&ip)));
        }
        pods
    }

    /// A pod of `shop` labelled `app: <app>`: its Pod object and its ADD,
    /// the status not yet posted, so the agent learns the address from the
    /// ADD alone. Its address.
    fn start(&mut self, server: &ApiServer, name: &str, app: &str) -> String {
        self.start_in(server, "shop", name, app)
            .unwrap_or_else(|run| panic!("{run:?}"))
    }

    /// [`Pods::start`] in `namespace`; the ADD's run when it fails.
    fn start_in(
        &mut self,
        server: &ApiServer,
        namespace: &str,
        name: &str,
        app: &str,
    ) -> Result<String, Run> {
        self.start_traced(server, namespace, name, app).map(|(ip, _)| ip)
    }

    /// [`Pods::start_in`], with the ADD's run when it succeeds too (what
    /// the plugins said on stderr).
    fn start_traced(
        &mut self,
        server: &ApiServer,
        namespace: &str,
        name: &str,
        app: &str,
    ) -> Result<(String, Run), Run> {
        server.add_pod(namespace, name, pod_object(namespace, name, app, None));
        let bin = host_bin(self.node);
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}");
        let env = [
            ("CNI_PATH", bin.to_str().expect("UTF-8")),
            ("CNI_ARGS", args.as_str()),
        ];
        let ns = self.node.pod(name);
        let add = self
            .node
            .cnictl_env(&["--json", "add", "cni-suite", ns.path_str()], &env);
        if add.code != Some(0) {
            return Err(add);
        }
        let result = add.json();
        let cidr = result["ips"][0]["address"].as_str().expect("an address");
        let ip = cidr.split('/').next().unwrap_or_default().to_owned();
        self.pods.push(((*name).to_owned(), ns, ip.clone()));
        Ok((ip, add))
    }

    /// A connection from `from` to `to`'s echo server, kept open.
    fn hold(&self, from: &str, to: &str) -> Option<Held> {
        let (_, ns, _) = self.get(from);
        let (_, _, ip) = self.get(to);
        self.probe.hold(ns, ip, ECHO_PORT)
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

fn pod_object(namespace: &str, name: &str, app: &str, ip: Option<&str>) -> Value {
    let status = match ip {
        Some(ip) => json!({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}),
        None => json!({"phase": "Pending"}),
    };
    json!({
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{name}"), "labels": {"app": app}},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x",
                 "ports": [{"name": "db", "containerPort": PORT, "protocol": "TCP"}]}]},
        "status": status,
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

/// The API test server of `node`, with its Node `n1` and the namespace
/// `shop`, labelled `team: x`.
fn api_server(node: &Node) -> ApiServer {
    uplink(node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    server.apply_namespace(json!({"metadata": {"name": "shop", "labels": {"team": "x"}}}));
    server
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
    let server = api_server(&node);
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

/// `client` pods may send nothing.
fn clients_send_nothing() -> Value {
    json!({
        "metadata": {"name": "clients-send-nothing", "namespace": "shop"},
        "spec": {"podSelector": {"matchLabels": {"app": "client"}}, "policyTypes": ["Egress"]},
    })
}

#[test]
fn a_new_pod_is_judged_from_its_first_packet_and_without_an_agent_its_add_goes_on() {
    require_root();
    let node = lab_node();
    let server = api_server(&node);
    server.apply_network_policy(clients_send_nothing());
    let mut agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &[POLICY_ON]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    let conflist = std::fs::read_to_string(host_conflist(&node)).expect("the conflist");
    assert!(conflist.contains("\"policySocket\""), "{conflist}");
    wait_for("a sync", Duration::from_secs(20), || {
        applied(&node, &agent) >= 1.0
    });
    let mut pods = Pods::add(&node, &server, &["db"]);
    let _listener = pods.probe.listen(&pods.get("db").1, &[PORT]);

    // Their statuses never come: their ADDs alone told the agent.
    pods.start(&server, "client-1", "client");
    assert!(
        !pods.connects("client-1", "db"),
        "the first connection of a pod the policy selects is refused"
    );
    pods.start(&server, "free", "free");
    assert!(
        pods.connects("free", "db"),
        "a pod no policy selects is open at once"
    );
    assert_eq!(sample(&scrape(&node, &agent).1, ENFORCED_ADDS), Some(3.0));

    // With no agent, a pod of a namespace with a policy is not started
    // open: its ADD fails (try again later) and is undone; the others keep
    // their policy, and a pod of a namespace without policies starts.
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    let links = || {
        node.run("ip", &["-o", "link"])
            .success()
            .stdout
            .matches("veth")
            .count()
    };
    let before = links();
    let started = std::time::Instant::now();
    let refused = pods
        .start_in(&server, "shop", "client-late", "client")
        .expect_err("no agent confirms it, and shop has a policy");
    eprintln!("an ADD refused for want of an agent took {:?}", started.elapsed());
    assert!(
        refused.stdout.contains("\"code\": 11")
            && refused.stdout.contains("namespace shop has NetworkPolicies"),
        "{refused:?}"
    );
    assert_eq!(links(), before, "undone");
    assert!(!pods.connects("client-1", "db"), "the others keep their policy");
    server.apply_namespace(json!({"metadata": {"name": "lobby"}}));
    pods.start_in(&server, "lobby", "visitor", "visitor")
        .expect("no policy in lobby: it starts");
    assert!(pods.connects("visitor", "db"), "open, as no policy selects it");

    // The runtime retries once an agent answers.
    let agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &[POLICY_ON]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    wait_for("a sync", Duration::from_secs(20), || {
        applied(&node, &agent) >= 1.0
    });
    node.pod("client-late");
    let late = pods.start(&server, "client-late", "client");
    assert!(!late.is_empty());
    assert!(
        !pods.connects("client-late", "db"),
        "refused from its first connection"
    );
    drop(agent);
}

#[test]
fn a_connection_the_policy_denies_once_a_pod_is_isolated_is_cut_even_one_made_while_no_agent_ran() {
    require_root();
    let node = lab_node();
    let (server, mut agent) = shop(&node);
    let pods = Pods::add(&node, &server, &["web", "db", "other"]);
    // db streams to its clients: once a connection is cut, its next
    // segment must not take the connection up again the other way.
    let _echo = pods.probe.echo_pushing(&pods.get("db").1, ECHO_PORT);
    let mut from_web = pods.hold("web", "db").expect("web connects");
    let mut from_other = pods.hold("other", "db").expect("other connects");
    assert!(from_web.echoes() && from_other.echoes(), "open before any policy");

    // db isolated while the agent runs: web's connection is allowed and
    // kept (its NAT and state untouched), other's is cut.
    server.apply_network_policy(json!({
        "metadata": {"name": "db-from-web", "namespace": "shop"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "db"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}],
        },
    }));
    wait_for("other refused", Duration::from_secs(15), || {
        pods.hold("other", "db").is_none()
    });
    assert!(
        !from_other.echoes(),
        "the connection made before the policy is cut"
    );
    assert!(from_web.echoes(), "an allowed one goes on");

    // The policy gone, a connection made; then, while no agent runs, the
    // policy comes back: the connection passes until an agent is back,
    // and is cut then.
    server.delete_network_policy("shop", "db-from-web");
    wait_for("other allowed", Duration::from_secs(15), || {
        pods.hold("other", "db").is_some()
    });
    let mut during = pods.hold("other", "db").expect("other connects");
    assert!(during.echoes());
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    server.apply_network_policy(json!({
        "metadata": {"name": "db-from-web", "namespace": "shop"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "db"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}],
        },
    }));
    assert!(during.echoes(), "no agent: nothing changes the kernel");
    let mut agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &[POLICY_ON]);
    wait_for("other refused again", Duration::from_secs(20), || {
        pods.hold("other", "db").is_none()
    });
    assert!(!during.echoes(), "cut once the agent is back");
    std::thread::sleep(Duration::from_millis(500));
    assert!(!during.echoes(), "and stays cut");
    assert!(from_web.echoes(), "web's connection lived through all of it");
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("connections the policy now denies"), "{log}");
}

/// A line for the gate as a plugin writes it, sent over its socket; the
/// agent's answer.
fn ask_the_gate(node: &Node, pod: &str, ip: &str) -> String {
    let line = json!({"podNamespace": "shop", "podName": pod, "containerID": "forged", "ips": [ip]});
    let socket = host_policy_socket(node);
    node.run(
        "python3",
        &[
            "-c",
            "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); \
             s.sendall(sys.argv[2].encode()+b'\\n'); print(s.makefile().readline())",
            socket.to_str().expect("UTF-8"),
            &line.to_string(),
        ],
    )
    .success()
    .stdout
}

#[test]
fn a_report_for_a_pod_not_bound_here_changes_no_verdict() {
    require_root();
    let node = lab_node();
    let (server, agent) = shop(&node);
    let pods = Pods::add(&node, &server, &["web", "db", "other"]);
    let _listener = pods.probe.listen(&pods.get("db").1, &[PORT]);
    // The real web runs on another node at another address.
    server.add_pod("shop", "web-far", {
        let mut far = pod_object("shop", "web-far", "web", Some("10.244.2.7"));
        far["spec"]["nodeName"] = json!("n2");
        far
    });
    server.apply_network_policy(db_from_web());
    wait_for("other refused", Duration::from_secs(15), || {
        !pods.connects("other", "db")
    });
    let table = || {
        node.run("nft", &["list", "table", "inet", netpol::TABLE])
            .success()
            .stdout
    };
    let before = table();

    // Forged: web-far is not bound here, and "ghost" is no pod at all; one
    // carries other's address (to let it in as web), one db's (to open it).
    let other = pods.get("other").2.clone();
    let db = pods.get("db").2.clone();
    let answer = ask_the_gate(&node, "web-far", &other);
    assert!(answer.contains("notEnforced"), "{answer}");
    let answer = ask_the_gate(&node, "ghost", &db);
    assert!(answer.contains("notEnforced"), "{answer}");
    assert!(!pods.connects("other", "db"), "other is not let in as web");
    assert!(pods.connects("web", "db"), "the real peer keeps its place");
    assert_eq!(table(), before, "no verdict changed");
    drop(agent);
}

/// `db` takes connections from the pods of namespaces labelled
/// `team: <team>`.
fn db_from_team(team: &str) -> Value {
    json!({
        "metadata": {"name": "db-from-team", "namespace": "shop"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "db"}},
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": team}}}]}],
        },
    })
}

/// The API test server and the agent of `node`, its first pass made.
fn shop(node: &Node) -> (ApiServer, Agent) {
    let server = api_server(node);
    let agent = Agent::start(node, "n1", &server, "127.0.0.1", TOKEN, &[POLICY_ON]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(node));
    wait_for("a sync", Duration::from_secs(20), || applied(node, &agent) >= 1.0);
    (server, agent)
}

#[test]
fn with_the_api_server_unreachable_for_a_minute_policy_holds_and_new_pods_are_still_judged() {
    require_root();
    let node = lab_node();
    let (server, agent) = shop(&node);
    let mut pods = Pods::add(&node, &server, &["web", "db", "other"]);
    let _listener = pods.probe.listen(&pods.get("db").1, &[PORT]);
    server.apply_network_policy(db_from_web());
    wait_for("other refused", Duration::from_secs(15), || {
        !pods.connects("other", "db")
    });
    // Pods the scheduler placed before the outage: their objects are known.
    let before = applied(&node, &agent);
    server.add_pod("shop", "web-2", pod_object("shop", "web-2", "web", None));
    server.add_pod("shop", "other-2", pod_object("shop", "other-2", "other-2", None));
    // Each Pod the agent takes in sets a pass going (one that changes
    // nothing in the kernel still counts).
    wait_for("the agent saw the new Pods", Duration::from_secs(15), || {
        applied(&node, &agent) >= before + 1.0
    });
    std::thread::sleep(Duration::from_millis(200));

    // Every packet to the API server dropped, its watches cut.
    let port = server.port.to_string();
    node.run("nft", &["add", "table", "inet", "outage"]).success();
    node.run(
        "nft",
        &["add chain inet outage out { type filter hook output priority 0 ; }"],
    )
    .success();
    node.run("nft", &["add rule inet outage out tcp dport", &port, "drop"])
        .success();
    server.drop_watches();
    let outage = std::time::Instant::now();
    let web_2 = pods.start(&server, "web-2", "web");
    let other_2 = pods.start(&server, "other-2", "other-2");
    assert!(
        pods.connects("web-2", "db"),
        "a new pod a rule names is its peer at once"
    );
    assert!(
        !pods.connects("other-2", "db"),
        "and one it does not name is refused"
    );
    // Changed meanwhile, seen once the server is back.
    server.delete_network_policy("shop", "db-from-web");
    while outage.elapsed() < Duration::from_secs(60) {
        assert!(!pods.connects("other", "db"), "the last state holds");
        assert!(pods.connects("web", "db"));
        std::thread::sleep(Duration::from_secs(5));
    }
    node.run("nft", &["delete", "table", "inet", "outage"]).success();
    server.add_pod("shop", "web-2", pod_object("shop", "web-2", "web", Some(&web_2)));
    server.add_pod(
        "shop",
        "other-2",
        pod_object("shop", "other-2", "other-2", Some(&other_2)),
    );
    // The watches come back within their backoff (at most 30 s apart).
    wait_for("the deletion seen", Duration::from_secs(60), || {
        pods.connects("other", "db")
    });
    assert!(pods.connects("other-2", "db"));
    drop(agent);
}

#[test]
fn a_burst_of_500_policy_changes_a_relabelled_namespace_and_a_new_address_are_followed() {
    require_root();
    let node = lab_node();
    let (server, mut agent) = shop(&node);
    let mut pods = Pods::add(&node, &server, &["web", "db", "other"]);
    let _listener = pods.probe.listen(&pods.get("db").1, &[PORT]);
    let before = applied(&node, &agent);

    // 500 changes in two bursts: 250 policies, each admitting web on a
    // port of its own (20000 + i), then each replaced by one admitting a
    // label nobody has; db is isolated on PORT throughout.
    for round in ["web", "nobody"] {
        for i in 0..250 {
            let ports = if round == "web" {
                json!([{"protocol": "TCP", "port": 20000 + i}])
            } else {
                json!([])
            };
            let app = if round == "web" {
                "web".to_owned()
            } else {
                format!("nobody-{i}")
            };
            server.apply_network_policy(json!({
                "metadata": {"name": format!("p{i}"), "namespace": "shop"},
                "spec": {
                    "podSelector": {"matchLabels": {"app": "db"}},
                    "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": app}}}], "ports": ports}],
                },
            }));
        }
        if round == "web" {
            // The first round in the kernel, so its removal is seen.
            wait_for("the first round's ports", Duration::from_secs(30), || {
                let rules = node.run("nft", &["list", "table", "inet", netpol::TABLE]);
                rules.stdout.contains("dport 20")
            });
        }
    }
    wait_for("db isolated", Duration::from_secs(30), || {
        !pods.connects("web", "db")
    });
    std::thread::sleep(Duration::from_secs(1));
    let passes = applied(&node, &agent) - before;
    assert!(passes < 250.0, "{passes} passes for 500 changes: gathered");
    let rules = node
        .run("nft", &["list", "table", "inet", netpol::TABLE])
        .success()
        .stdout;
    assert!(
        !rules.contains("dport 20"),
        "the first round's ports are gone: {rules}"
    );

    // The namespace's label decides.
    server.apply_network_policy(db_from_team("x"));
    wait_for("shop's pods allowed", Duration::from_secs(15), || {
        pods.connects("web", "db") && pods.connects("other", "db")
    });
    server.apply_namespace(json!({"metadata": {"name": "shop", "labels": {"team": "y"}}}));
    wait_for("refused once relabelled", Duration::from_secs(15), || {
        !pods.connects("web", "db")
    });
    server.apply_namespace(json!({"metadata": {"name": "shop", "labels": {"team": "x"}}}));
    wait_for("allowed again", Duration::from_secs(15), || {
        pods.connects("web", "db")
    });

    // web's sandbox is made again with a new address: its ADD tells the
    // agent before its status does, and the old address is nobody's.
    let old = pods.get("web").2.clone();
    let bin = host_bin(&node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let (_, web_ns, _) = pods.get("web");
    node.cnictl_env(&["del", "cni-suite", web_ns.path_str()], &cni_path)
        .success();
    pods.pods.retain(|(name, _, _)| name != "web");
    let new = pods.start(&server, "web", "web");
    assert_ne!(new, old);
    assert!(
        pods.connects("web", "db"),
        "a peer at its new address before its status has it"
    );
    let table = node
        .run("nft", &["list", "table", "inet", netpol::TABLE])
        .success()
        .stdout;
    assert!(
        table.contains(&new) && !table.contains(&format!("{old} ")) && !table.contains(&format!("{old},")),
        "{table}"
    );
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
}

/// The ops of each table change the agent logged (`NetworkPolicy: the
/// table changed (N ops)`), in order, of those whose time `within` keeps
/// (the log's UTC timestamps, which sort as text).
fn table_changes(log: &str, within: impl Fn(&str) -> bool) -> Vec<usize> {
    log.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|line| within(line["time"].as_str().unwrap_or_default()))
        .filter_map(|line| {
            let msg = line["msg"].as_str()?;
            let ops = msg.strip_prefix("NetworkPolicy: the table changed (")?;
            ops.strip_suffix(" ops)")?.parse().ok()
        })
        .collect()
}

#[test]
fn five_thousand_block_rules_in_one_namespace_leave_a_new_pod_elsewhere_confirmed_and_refusing_its_first_syn()
{
    require_root();
    let node = lab_node();
    let (server, mut agent) = shop(&node);
    for name in ["noisy", "quiet", "lobby"] {
        server.apply_namespace(json!({"metadata": {"name": name, "labels": {"team": name}}}));
    }
    let mut pods = Pods {
        node: &node,
        probe: Probe::new(),
        pods: Vec::new(),
    };
    for (namespace, name) in [("noisy", "noisy"), ("lobby", "client")] {
        let ip = pods
            .start_in(&server, namespace, name, name)
            .unwrap_or_else(|run| panic!("{run:?}"));
        server.add_pod(namespace, name, pod_object(namespace, name, name, Some(&ip)));
    }
    let _noisy = pods.probe.listen(&pods.get("noisy").1, &[PORT]);
    assert!(pods.connects("client", "noisy"), "open before its policy");

    // One policy of 5000 ipBlock rules selecting the noisy pod, in the
    // kernel: its last rule's port listed, the pod isolated.
    let rules = 5000;
    let before = applied(&node, &agent);
    let created = Instant::now();
    server.apply_network_policy(block_rules_policy("noisy", "blocks", "noisy", rules));
    let last_port = format!("dport {}", 10_000 + rules - 1);
    wait_for("the 5000 rules in the kernel", Duration::from_secs(120), || {
        applied(&node, &agent) > before
            && node
                .run("nft", &["list", "table", "inet", netpol::TABLE])
                .stdout
                .contains(&last_port)
    });
    eprintln!(
        "{rules} ipBlock rules: created -> listed by nft in {:?}",
        created.elapsed()
    );
    assert!(
        !pods.connects("client", "noisy"),
        "noisy is isolated, and client is in no block"
    );

    // Another namespace denies all ingress, recorded as the ADD reads it.
    server.apply_network_policy(json!({
        "metadata": {"name": "deny-ingress", "namespace": "quiet"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    }));
    let on_node = netns::NetNs::open(node.netns.path()).expect("the node's namespace");
    wait_for("quiet recorded as guarded", Duration::from_secs(30), || {
        on_node
            .run(|| agent_wire::policy::guarded::has_policy("quiet"))
            .expect("enter the node's namespace")
            .unwrap_or(false)
    });

    // A new pod there: confirmed by its gate, and a connection made right
    // after its ADD, before any status is posted, dropped.
    let enforced = sample(&scrape(&node, &agent).1, ENFORCED_ADDS).unwrap_or_default();
    let from = cni::log::utc_timestamp(SystemTime::now());
    let started = Instant::now();
    let (ip, add) = pods
        .start_traced(&server, "quiet", "new", "new")
        .unwrap_or_else(|run| panic!("{run:?}"));
    let took = started.elapsed();
    let to = cni::log::utc_timestamp(SystemTime::now());
    let _listener = pods.probe.listen(&pods.get("new").1, &[PORT]);
    let first = pods.probe.connect(&pods.get("client").1, None, &ip, PORT, None);
    eprintln!("the new pod's ADD through the gate took {took:?}");
    assert!(
        !first.ok() && first.stdout.contains("timed out"),
        "dropped from its first SYN (not refused by a closed port): {first:?}"
    );
    assert_eq!(
        sample(&scrape(&node, &agent).1, ENFORCED_ADDS),
        Some(enforced + 1.0),
        "the gate confirmed the ADD"
    );
    assert!(!add.stderr.contains("not confirmed"), "{add:?}");

    // The pass the ADD waited on changed a few elements, not noisy's
    // rules.
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(!log.contains("not confirmed"), "{log}");
    let while_waiting = table_changes(&log, |time| (from.as_str()..=to.as_str()).contains(&time));
    let largest = table_changes(&log, |_| true).into_iter().max().unwrap_or(0);
    eprintln!("table changes while the ADD waited: {while_waiting:?} ops; the run's largest: {largest} ops");
    assert!(
        largest >= rules,
        "the write of the {rules} rules is in the log: {log}"
    );
    assert!(
        !while_waiting.is_empty() && while_waiting.iter().all(|ops| *ops < 100),
        "the ADD waited on a pass of a few ops: {while_waiting:?}"
    );
}
