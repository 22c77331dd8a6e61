//! The routes controller: routes to every other node's pods.

use std::time::Duration;

use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{agent_routes, lab_node, node_object, uplink};
use test_kit::{Node, require_root, wait_for};

use crate::common::{TOKEN, agent_of_n1};

#[test]
fn the_agent_routes_to_every_other_nodes_pods_and_removes_what_it_made() {
    require_root();
    let node = lab_node();
    uplink(&node);
    node.netns
        .ip(&["addr", "add", "fd00:250::11/64", "dev", "uplink0", "nodad"])
        .success();
    // Left by an earlier agent for a node that is gone: removed at start.
    node.netns
        .ip(&[
            "route",
            "add",
            "10.244.9.0/24",
            "via",
            "10.250.0.19",
            "proto",
            "201",
        ])
        .success();
    // An operator's route the agent did not make and no Node asks for.
    node.netns
        .ip(&["route", "add", "10.99.0.0/24", "via", "10.250.0.99"])
        .success();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    server.apply_node(json!({
        "metadata": {"name": "n2"},
        "spec": {"podCIDR": "10.244.2.0/24", "podCIDRs": ["10.244.2.0/24", "fd00:10:244:2::/64"]},
        "status": {"addresses": [
            {"type": "InternalIP", "address": "10.250.0.12"},
            {"type": "InternalIP", "address": "fd00:250::12"},
        ]},
    }));
    server.apply_node(node_object("n3", &["10.244.3.0/24"], &["10.250.0.13"]));
    let agent = agent_of_n1(&node, &server, TOKEN, &[]);
    let expected = |routes: &[&str]| {
        let mut routes: Vec<String> = routes.iter().map(|r| (*r).to_owned()).collect();
        routes.sort();
        routes
    };
    wait_for("routes to n2 and n3", Duration::from_secs(20), || {
        agent_routes(&node)
            == expected(&[
                "10.244.2.0/24 via 10.250.0.12",
                "10.244.3.0/24 via 10.250.0.13",
                "fd00:10:244:2::/64 via fd00:250::12",
            ])
    });
    wait_for("readiness", Duration::from_secs(5), || {
        agent.probe(&node, "/readyz").is_some_and(|(code, _)| code == 200)
    });

    // n3 moves, a fourth node joins, n2 leaves.
    server.apply_node(node_object("n3", &["10.244.3.0/24"], &["10.250.0.23"]));
    server.apply_node(node_object("n4", &["10.244.4.0/24"], &["10.250.0.14"]));
    server.delete_node("n2");
    wait_for("the routes to follow the Nodes", Duration::from_secs(2), || {
        agent_routes(&node) == expected(&["10.244.3.0/24 via 10.250.0.23", "10.244.4.0/24 via 10.250.0.14"])
    });

    // An operator takes a pod range over with a route of their own: it is
    // left as it is at the next change (the agent's own route with a wrong
    // gateway, as n3's when it moved, is replaced).
    node.netns
        .ip(&["route", "replace", "10.244.4.0/24", "via", "10.250.0.99"])
        .success();
    server.apply_node(node_object("n5", &["10.244.5.0/24"], &["10.250.0.15"]));
    wait_for("n5's route beside the operator's", Duration::from_secs(2), || {
        agent_routes(&node) == expected(&["10.244.3.0/24 via 10.250.0.23", "10.244.5.0/24 via 10.250.0.15"])
    });
    assert_eq!(
        routes_to(&node, "10.244.4.0/24"),
        ["10.244.4.0/24 via 10.250.0.99 dev uplink0"]
    );

    // A routing daemon's route to a pod range, with a metric of its own,
    // before the Node joins: the agent's route (metric 0) would go in
    // beside it and win, so the Node's addition leaves it alone at once,
    // not at the next full resync (30 s on).
    node.netns
        .ip(&[
            "route",
            "add",
            "10.244.8.0/24",
            "via",
            "10.250.0.98",
            "metric",
            "32",
            "proto",
            "bird",
        ])
        .success();
    server.apply_node(node_object("n8", &["10.244.8.0/24"], &["10.250.0.18"]));
    server.apply_node(node_object("n9", &["10.244.9.0/24"], &["10.250.0.19"]));
    wait_for("n9's route, after n8's addition", Duration::from_secs(2), || {
        agent_routes(&node).contains(&"10.244.9.0/24 via 10.250.0.19".to_owned())
    });
    assert_eq!(
        routes_to(&node, "10.244.8.0/24"),
        ["10.244.8.0/24 via 10.250.0.98 dev uplink0 proto bird metric 32"]
    );
    server.delete_node("n8");
    server.delete_node("n9");
    wait_for("n9's route gone", Duration::from_secs(2), || {
        agent_routes(&node) == expected(&["10.244.3.0/24 via 10.250.0.23", "10.244.5.0/24 via 10.250.0.15"])
    });

    // A Node whose InternalIP is not on-link: its route fails, every other
    // change still happens, and the agent is not ready until it is gone.
    server.apply_node(node_object("n6", &["10.244.6.0/24"], &["192.0.2.66"]));
    server.apply_node(node_object("n7", &["10.244.7.0/24"], &["10.250.0.17"]));
    wait_for("n7's route beside n6's failure", Duration::from_secs(2), || {
        agent_routes(&node).contains(&"10.244.7.0/24 via 10.250.0.17".to_owned())
    });
    wait_for("not ready while a route fails", Duration::from_secs(2), || {
        agent.probe(&node, "/readyz").is_some_and(|(code, _)| code == 503)
    });
    server.delete_node("n6");
    server.delete_node("n7");
    wait_for("ready again", Duration::from_secs(2), || {
        agent.probe(&node, "/readyz").is_some_and(|(code, _)| code == 200)
    });
    wait_for("n7's route gone", Duration::from_secs(2), || {
        agent_routes(&node) == expected(&["10.244.3.0/24 via 10.250.0.23", "10.244.5.0/24 via 10.250.0.15"])
    });

    // A restarted agent changes nothing; one stopped with uninstall
    // removes its routes and leaves the operator's.
    drop(agent);
    let before = node.netns.ip(&["route", "show"]).success().stdout;
    let mut agent = agent_of_n1(&node, &server, TOKEN, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("readiness after a restart", Duration::from_secs(20), || {
        agent.probe(&node, "/readyz").is_some_and(|(code, _)| code == 200)
    });
    assert_eq!(node.netns.ip(&["route", "show"]).success().stdout, before);
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(agent_routes(&node).is_empty(), "{log}");
    let left = node.netns.ip(&["route", "show"]).success().stdout;
    assert!(left.contains("10.99.0.0/24 via 10.250.0.99"), "{left}");
    assert!(left.contains("10.244.4.0/24 via 10.250.0.99"), "{left}");
}

/// The node's IPv4 routes to `dst`, as `ip route show` prints them.
fn routes_to(node: &Node, dst: &str) -> Vec<String> {
    let shown = node
        .netns
        .ip(&["-4", "route", "show", "exact", dst])
        .success()
        .stdout;
    shown.lines().map(|line| line.trim_end().to_owned()).collect()
}

/// The lines of an agent's log whose message has `text`.
fn logged(log: &str, text: &str) -> usize {
    log.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|record| record["msg"].as_str().is_some_and(|msg| msg.contains(text)))
        .count()
}

#[test]
fn a_pod_cidr_on_the_nodes_own_subnet_never_takes_or_removes_its_connected_route() {
    require_root();
    let node = lab_node();
    uplink(&node);
    const LAN: &str = "10.250.0.0/24";
    let connected = ["10.250.0.0/24 dev uplink0 proto kernel scope link src 10.250.0.11"];
    // An operator's route to a pod CIDR, there before its Node.
    let operators = ["10.244.4.0/24 via 10.250.0.99 dev uplink0"];
    node.netns
        .ip(&["route", "add", "10.244.4.0/24", "via", "10.250.0.99"])
        .success();
    // As an agent of an earlier release left it: the connected route
    // taken over, via n2. The agent gives it back rather than delete it.
    node.netns
        .ip(&["route", "replace", LAN, "via", "10.250.0.12", "proto", "201"])
        .success();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    // A cluster range overlapping the node network: n2's pod CIDR is the
    // node's LAN, the API server's way.
    let n2 = node_object("n2", &[LAN], &["10.250.0.12"]);
    // A Node that gives this node's address as its own.
    let n3 = node_object("n3", &["10.244.3.0/24"], &["10.250.0.11"]);
    let n4 = node_object("n4", &["10.244.4.0/24"], &["10.250.0.14"]);
    let n5 = node_object("n5", &["10.244.5.0/24"], &["10.250.0.15"]);
    for n in [&n2, &n3, &n4, &n5] {
        server.apply_node(n.clone());
    }
    let mut agent = agent_of_n1(&node, &server, TOKEN, &[("UNINSTALL_ON_STOP", "true")]);
    let n5_route = "10.244.5.0/24 via 10.250.0.15";
    let routed = |route: &str| agent_routes(&node).iter().any(|r| r == route);
    wait_for("n5's route", Duration::from_secs(20), || routed(n5_route));
    let table = || node.netns.ip(&["route", "show"]).success().stdout;
    assert_eq!(agent_routes(&node), [n5_route], "{}", table());
    assert_eq!(routes_to(&node, LAN), connected, "{}", table());
    assert_eq!(routes_to(&node, "10.244.4.0/24"), operators);
    wait_for("readiness", Duration::from_secs(5), || {
        agent.probe(&node, "/readyz").is_some_and(|(code, _)| code == 200)
    });

    // Heartbeats, and changes the agent reconciles for: each skip is told
    // once while it lasts.
    let n6_route = "10.244.6.0/24 via 10.250.0.16";
    for _ in 0..5 {
        for n in [&n2, &n3, &n4] {
            server.apply_node(n.clone());
        }
    }
    server.apply_node(node_object("n6", &["10.244.6.0/24"], &["10.250.0.16"]));
    wait_for("n6's route", Duration::from_secs(5), || routed(n6_route));

    // n2 goes (n6 with it, to know when): the connected route stays.
    server.delete_node("n2");
    server.delete_node("n6");
    wait_for("n6's route gone", Duration::from_secs(5), || {
        agent_routes(&node) == [n5_route]
    });
    assert_eq!(routes_to(&node, LAN), connected, "{}", table());
    // It comes back: told again.
    server.apply_node(n2.clone());
    server.apply_node(node_object("n6", &["10.244.6.0/24"], &["10.250.0.16"]));
    wait_for("n6's route again", Duration::from_secs(5), || routed(n6_route));
    assert_eq!(routes_to(&node, LAN), connected, "{}", table());

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(logged(&log, "no route to pod CIDR 10.250.0.0/24"), 2, "{log}");
    assert_eq!(logged(&log, "no route to pod CIDR 10.244.3.0/24"), 1, "{log}");
    assert_eq!(logged(&log, "no route to pod CIDR 10.244.4.0/24"), 1, "{log}");
    assert!(agent_routes(&node).is_empty(), "{log}");
    assert_eq!(routes_to(&node, LAN), connected, "{}", table());
    assert_eq!(
        routes_to(&node, "10.244.4.0/24"),
        operators,
        "uninstall leaves it"
    );
}
