//! The node agent against the API test server, and the test server against
//! kube-rs (the agent's client), pinning what the agent relies on: list
//! with a resourceVersion, watch events and bookmarks, 410 Expired on an
//! old version, 401 on a bad token, a watch dropped mid-stream.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions, WatchEvent, WatchParams};
use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{
    Agent, SUITE, agent_routes, host_bin, host_conflist, host_leases, lab_node, node_object,
};
use test_kit::{Node, require_root, wait_for};

const TOKEN: &str = "agent-token";

/// containerd's default capabilities and the two the DaemonSet adds.
const CONTAINER_CAPABILITIES: &str = "+chown,+dac_override,+fsetid,+fowner,+mknod,+net_raw,+setgid,+setuid,\
     +setfcap,+setpcap,+net_bind_service,+sys_chroot,+kill,+audit_write,+net_admin";

/// A kube-rs client for `server`, run on the calling thread's runtime; the
/// server listens in `node`'s namespace, which the test enters to connect.
fn client(server: &ApiServer, token: &str) -> kube::Client {
    let mut config = kube::Config::new(server.url().parse().expect("url"));
    config.root_cert = Some(
        rustls_pki_types::CertificateDer::pem_slice_iter(server.ca_pem.as_bytes())
            .map(|c| c.expect("pem").to_vec())
            .collect(),
    );
    config.auth_info.token = Some(token.to_owned().into());
    kube::Client::try_from(config).expect("client")
}

/// Runs `test` on a runtime whose threads are inside `netns`.
fn in_netns<T>(netns: &Path, test: impl std::future::Future<Output = T>) -> T {
    let ns = netns::NetNs::open(netns).expect("netns");
    let _inside = ns.enter().expect("enter");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(test)
}

use rustls_pki_types::pem::PemObject;

#[test]
fn the_api_test_server_answers_lists_watches_and_errors_as_kube_rs_expects() {
    require_root();
    let node = lab_node();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    in_netns(node.netns.path(), async {
        let nodes: kube::Api<KubeNode> = kube::Api::all(client(&server, TOKEN));
        let list = nodes.list(&ListParams::default()).await.expect("list");
        assert_eq!(list.items.len(), 1);
        let version = list.metadata.resource_version.clone().expect("a list version");
        assert_eq!(version, "1");

        let params = WatchParams::default().timeout(10);
        let mut events = nodes.watch(&params, &version).await.expect("watch").boxed();
        server.apply_node(node_object("n2", &["10.244.2.0/24"], &["10.250.0.12"]));
        server.apply_node(node_object("n2", &["10.244.3.0/24"], &["10.250.0.12"]));
        server.delete_node("n2");
        let mut seen = Vec::new();
        while seen.len() < 4 {
            match events.next().await.expect("an event").expect("a good event") {
                WatchEvent::Added(n) => seen.push(format!("ADDED {}", n.metadata.name.expect("name"))),
                WatchEvent::Modified(n) => seen.push(format!(
                    "MODIFIED {}",
                    n.spec.and_then(|s| s.pod_cidr).expect("cidr")
                )),
                WatchEvent::Deleted(n) => seen.push(format!("DELETED {}", n.metadata.name.expect("name"))),
                WatchEvent::Bookmark(b) => seen.push(format!("BOOKMARK {}", b.metadata.resource_version)),
                WatchEvent::Error(e) => panic!("{e:?}"),
            }
        }
        assert_eq!(
            seen,
            ["ADDED n2", "MODIFIED 10.244.3.0/24", "DELETED n2", "BOOKMARK 4"],
            "changes in order, then a bookmark at the latest version"
        );

        // A dropped connection ends the stream.
        server.drop_watches();
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(Ok(_)) = events.next().await {}
        })
        .await;
        assert!(ended.is_ok(), "the watch ends when its connection drops");

        // After compaction an old version is answered 410 Expired in-band.
        server.expire_history();
        let mut expired = nodes.watch(&params, &version).await.expect("watch").boxed();
        match expired.next().await.expect("an event").expect("an event") {
            WatchEvent::Error(e) => {
                assert_eq!(e.code, 410);
                assert_eq!(e.reason, "Expired");
            }
            other => panic!("expected 410 Expired, got {other:?}"),
        }

        let refused = kube::Api::<KubeNode>::all(client(&server, "wrong"))
            .list(&ListParams::default())
            .await
            .expect_err("a bad token is refused");
        assert!(
            matches!(&refused, kube::Error::Api(status) if status.code == 401),
            "{refused:?}"
        );

        // Pods: a merge patch of the status subresource, and deletes whose
        // preconditions are checked (409 Conflict on a stale version).
        server.add_pod(
            "default",
            "p",
            json!({"metadata": {"name": "p", "namespace": "default", "uid": "u1"}}),
        );
        let pods: kube::Api<Pod> = kube::Api::namespaced(client(&server, TOKEN), "default");
        let labelled = pods
            .patch_status(
                "p",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
            )
            .await
            .expect("patched");
        assert_eq!(labelled.metadata.labels.expect("labels")["a"], "b");
        let stale = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some("u1".into()),
                resource_version: Some("1".into()),
            }),
            ..DeleteParams::default()
        };
        let conflict = pods.delete("p", &stale).await.expect_err("a stale version");
        assert!(
            matches!(&conflict, kube::Error::Api(s) if s.code == 409),
            "{conflict:?}"
        );
        let current = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some("u1".into()),
                resource_version: labelled.metadata.resource_version,
            }),
            ..DeleteParams::default()
        };
        pods.delete("p", &current).await.expect("deleted");
        assert!(server.pod("default", "p").is_none());
    });
}

/// The agent of Node n1, reaching the API server on the node's loopback.
fn agent_of_n1(node: &Node, server: &ApiServer, token: &str, extra: &[(&str, &str)]) -> Agent {
    Agent::start(node, "n1", server, "127.0.0.1", token, extra)
}

fn conflist(node: &Node) -> PathBuf {
    host_conflist(node)
}

fn read_conflist(node: &Node) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(conflist(node)).ok()?).ok()
}

fn subnets(conf: &Value) -> Vec<String> {
    conf["plugins"][0]["ipam"]["ranges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|set| set[0]["subnet"].as_str().unwrap_or_default().to_owned())
        .collect()
}

pub(super) use test_kit::node_agent::uplink;

#[test]
fn the_agent_writes_its_nodes_configuration_and_follows_the_node() {
    require_root();
    let node = lab_node();
    uplink(&node);
    std::fs::write(node.path("net.d/99-operator.conflist"), "{}").expect("an operator's file");
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object(
        "n1",
        &["10.244.1.0/24", "fd00:10:244:1::/64"],
        &["10.250.0.11"],
    ));
    server.apply_node(node_object("n2", &["10.244.2.0/24"], &["10.250.0.12"]));
    let mut agent = agent_of_n1(&node, &server, TOKEN, &[("UNINSTALL_ON_STOP", "true")]);

    wait_for("the agent's conflist", Duration::from_secs(20), || {
        read_conflist(&node).is_some()
    });
    let conf = read_conflist(&node).expect("conflist");
    assert_eq!(subnets(&conf), ["10.244.1.0/24", "fd00:10:244:1::/64"]);
    let bridge = &conf["plugins"][0];
    assert_eq!(bridge["mtu"], 1450, "the uplink's MTU");
    assert_eq!(bridge["ipMasq"], false);
    assert_eq!(
        bridge["ipam"]["dataDir"],
        node.path("leases").to_str().expect("UTF-8")
    );
    assert_eq!(
        plugin_types(&conflist(&node)),
        ["bridge", "portmap"],
        "the portmap the agent installed is chained"
    );
    wait_for("readiness", Duration::from_secs(5), || {
        agent.probe(&node, "/readyz").is_some_and(|(code, _)| code == 200)
    });
    assert_eq!(agent.probe(&node, "/healthz").map(|(code, _)| code), Some(200));

    // The Node changes: the file follows.
    server.apply_node(node_object("n1", &["10.244.7.0/24"], &["10.250.0.11"]));
    wait_for(
        "the new pod CIDR in the conflist",
        Duration::from_secs(10),
        || read_conflist(&node).is_some_and(|c| subnets(&c) == ["10.244.7.0/24"]),
    );

    // The watch is dropped and its version expires while n2 goes away:
    // the agent lists again, its map is replaced by the list (n2's route
    // goes, though it never saw n2's DELETED), and it still follows.
    assert_eq!(agent_routes(&node), ["10.244.2.0/24 via 10.250.0.12"]);
    let lists = server.lists();
    server.expire_history();
    server.drop_watches();
    server.delete_node("n2");
    server.apply_node(node_object("n1", &["10.244.8.0/24"], &["10.250.0.11"]));
    wait_for("the conflist after a relist", Duration::from_secs(20), || {
        read_conflist(&node).is_some_and(|c| subnets(&c) == ["10.244.8.0/24"])
    });
    assert!(server.lists() > lists, "the agent listed again after 410");
    wait_for("n2's route gone after the relist", Duration::from_secs(5), || {
        agent_routes(&node).is_empty()
    });

    let (status, log) = agent.stop();
    assert!(status.success(), "{status:?}: {log}");
    assert!(!conflist(&node).exists(), "uninstalled: {log}");
    assert!(
        node.path("net.d/99-operator.conflist").exists(),
        "an operator's file stays"
    );
    for line in log.lines() {
        let record: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(record["time"].is_string() && record["level"].is_string() && record["msg"].is_string());
    }
}

#[test]
fn an_agent_the_api_server_refuses_is_alive_but_not_ready() {
    require_root();
    let node = lab_node();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    let mut agent = agent_of_n1(&node, &server, "a stale token", &[]);
    wait_for("the health endpoint", Duration::from_secs(10), || {
        agent.probe(&node, "/healthz").is_some()
    });
    std::thread::sleep(Duration::from_millis(500));
    let Some((code, reason)) = agent.probe(&node, "/readyz") else {
        let (status, log) = agent.stop();
        panic!("no answer from /readyz; the agent: {status:?} {log}");
    };
    assert_eq!(code, 503);
    assert!(reason.contains("not listed"), "{reason}");
    assert!(read_conflist(&node).is_none());
    assert!(server.requests() > 0, "the agent asked and was refused");
}

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

#[test]
fn a_lease_service_left_by_an_agent_killed_with_sigkill_is_stopped_on_uninstall() {
    require_root();
    let node = lab_node();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    let mut first = agent_of_n1(&node, &server, TOKEN, &[]);
    wait_for("readiness", Duration::from_secs(20), || first.ready(&node));
    let leases = host_leases(&node);
    let services = test_kit::services_under(&leases);
    assert_eq!(services.len(), 1, "the agent runs the lease service");
    first.kill();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        test_kit::services_under(&leases),
        services,
        "a SIGKILLed agent leaves its service running"
    );

    // The next agent finds the place taken, uses that service, and stops
    // it when it uninstalls, with no more capabilities than the
    // DaemonSet's container has (the runtime's defaults, NET_ADMIN and
    // NET_RAW), against a service that has them all.
    let mut second = Agent::start_under(
        &node,
        "n1",
        &server,
        "127.0.0.1",
        TOKEN,
        &[("UNINSTALL_ON_STOP", "true")],
        &[
            "setpriv",
            &format!("--bounding-set=-all,{CONTAINER_CAPABILITIES}"),
            "--",
        ],
    );
    wait_for("readiness", Duration::from_secs(20), || second.ready(&node));
    assert_eq!(test_kit::services_under(&leases), services);
    let (status, log) = second.stop();
    assert!(status.success(), "{log}");
    assert!(test_kit::services_under(&leases).is_empty(), "{log}");
    assert!(!leases.exists(), "{log}");
    let left: Vec<_> = std::fs::read_dir(host_bin(&node))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "nothing of the suite left in the bin directory: {left:?}"
    );
}

#[test]
fn uninstall_with_pods_left_keeps_what_their_dels_need() {
    require_root();
    let node = lab_node();
    uplink(&node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    let mut agent = agent_of_n1(&node, &server, TOKEN, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    let bin = host_bin(&node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    node.cnictl_env(&["add", "cni-suite", pod.path_str()], &cni_path)
        .success();

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert!(!conflist(&node).exists(), "no new pod is set up: {log}");
    assert!(agent_routes(&node).is_empty());
    for plugin in ["bridge", "host-local"] {
        assert!(
            bin.join(plugin).exists(),
            "{plugin} stays for the pod's DEL: {log}"
        );
    }
    assert!(node.netns.link_is_up("cni0"), "the pod's bridge stays");
    assert!(log.contains("pods still hold leases"), "{log}");

    // The runtime deletes the pod with its cached configuration.
    node.cnictl_env(&["del", "cni-suite", pod.path_str()], &cni_path)
        .success();
    let leases = node.leases_in("cni-suite", &host_leases(&node));
    assert!(
        !leases.contains("10.244.1."),
        "the pod's lease is released: {leases}"
    );
}

/// `nft list ruleset` in the node: every nf_tables table, iptables-nft's
/// included.
fn nft_ruleset(node: &Node) -> String {
    node.run("nft", &["list", "ruleset"]).success().stdout
}

/// portmap's shared chains and the jumps to them, in either iptables
/// flavour of the node.
fn hostport_lines(node: &Node) -> Vec<String> {
    let mut found = Vec::new();
    for save in [
        "iptables-nft-save",
        "ip6tables-nft-save",
        "iptables-legacy-save",
        "ip6tables-legacy-save",
    ] {
        let saved = node.run(save, &["-t", "nat"]).success().stdout;
        found.extend(
            saved
                .lines()
                .filter(|line| line.contains("CNI-HOSTPORT-"))
                .map(|line| format!("{save}: {line}")),
        );
    }
    found
}

/// The agent with uninstall and portmap chained; a dual-stack pod with a
/// hostPort added through its conflist and deleted; the agent stopped.
/// What the agent logged.
fn a_hostport_pod_came_and_went_then_the_agent_uninstalled(node: &Node) -> String {
    uplink(node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object(
        "n1",
        &["10.244.1.0/24", "fd00:10:244:1::/64"],
        &["10.250.0.11"],
    ));
    let mut agent = agent_of_n1(
        node,
        &server,
        TOKEN,
        &[
            ("UNINSTALL_ON_STOP", "true"),
            (
                "CNI_CHAINED_PLUGINS",
                r#"[{"type":"portmap","capabilities":{"portMappings":true}}]"#,
            ),
        ],
    );
    wait_for("readiness", Duration::from_secs(20), || agent.ready(node));
    let bin = host_bin(node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    let mappings = r#"{"portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"tcp"}]}"#;
    node.cnictl_env(
        &["add", "--cap-args", mappings, "cni-suite", pod.path_str()],
        &cni_path,
    )
    .success();
    let chains = node.nat_chains();
    assert!(
        chains.iter().any(|c| c == "CNI-HOSTPORT-DNAT") && chains.iter().any(|c| c.starts_with("CNI-DN-")),
        "the pod's hostPort is published: {chains:?}"
    );
    node.cnictl_env(&["del", "cni-suite", pod.path_str()], &cni_path)
        .success();
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    log
}

#[test]
fn uninstall_removes_the_nat_chains_and_tables_the_suite_created_and_keeps_the_nodes() {
    require_root();
    // A node without nat tables: none is left, nor an empty base chain,
    // nor portmap's shared chains.
    let bare = lab_node();
    assert_eq!(nft_ruleset(&bare), "");
    let log = a_hostport_pod_came_and_went_then_the_agent_uninstalled(&bare);
    assert_eq!(nft_ruleset(&bare), "", "{log}");
    let left = hostport_lines(&bare);
    assert!(left.is_empty(), "{left:?}\n{log}");

    // An operator's masquerade in iptables-nft's nat table: the table and
    // its POSTROUTING stay as they were, the rest goes.
    let operated = lab_node();
    let masquerade = "-t nat -A POSTROUTING -s 192.0.2.0/24 -j MASQUERADE";
    let args: Vec<&str> = masquerade.split(' ').collect();
    operated.run("iptables-nft", &args).success();
    let before = nft_ruleset(&operated);
    let log = a_hostport_pod_came_and_went_then_the_agent_uninstalled(&operated);
    assert_eq!(nft_ruleset(&operated), before, "{log}");
    let left = hostport_lines(&operated);
    assert!(left.is_empty(), "{left:?}\n{log}");
}

/// Every entry of `dir`, recursively, never through a link: its kind, inode,
/// link count and mode, and a link's target or a digest of a file's content.
pub(crate) fn bin_dir_snapshot(dir: &Path) -> std::collections::BTreeMap<String, String> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    use std::os::unix::fs::MetadataExt;
    let mut out = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("ls").flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let metadata = std::fs::symlink_metadata(&path).expect("lstat");
        let what = if metadata.is_symlink() {
            format!(
                "link -> {}",
                std::fs::read_link(&path).expect("readlink").display()
            )
        } else if metadata.is_dir() {
            out.extend(
                bin_dir_snapshot(&path)
                    .into_iter()
                    .map(|(inner, what)| (format!("{name}/{inner}"), what)),
            );
            "directory".to_owned()
        } else {
            let mut digest = DefaultHasher::new();
            std::fs::read(&path).expect("read").hash(&mut digest);
            format!("file {:016x}", digest.finish())
        };
        let inode = format!(
            "inode {} links {} mode {:o}",
            metadata.ino(),
            metadata.nlink(),
            metadata.mode()
        );
        out.insert(name, format!("{what}, {inode}"));
    }
    out
}

/// Whether `place` is a regular file holding the suite's `name`.
fn holds_the_suites(place: &Path, name: &str) -> bool {
    std::fs::symlink_metadata(place).is_ok_and(|m| m.is_file())
        && std::fs::read(place).ok() == std::fs::read(test_kit::bin(name)).ok()
}

#[test]
fn uninstall_puts_a_k3s_style_bin_dir_of_relative_links_back_exactly() {
    use std::os::unix::fs::{PermissionsExt, symlink};
    require_root();
    let node = lab_node();
    let bin = host_bin(&node);
    std::fs::create_dir_all(&bin).expect("mkdir");
    // k3s's layout: the plugins are relative links to one multicall
    // binary; and a link left dangling.
    let multicall = bin.join("cni");
    std::fs::write(&multicall, "#!/bin/sh\nexit 1\n").expect("write");
    std::fs::set_permissions(&multicall, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    for plugin in ["loopback", "portmap", "host-local"] {
        symlink("cni", bin.join(plugin)).expect("link");
    }
    symlink("gone", bin.join("firewall")).expect("dangling link");
    let before = bin_dir_snapshot(&bin);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    let mut agent = agent_of_n1(&node, &server, TOKEN, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    for plugin in SUITE {
        assert!(
            holds_the_suites(&bin.join(plugin), plugin),
            "{plugin} is installed"
        );
    }

    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(
        bin_dir_snapshot(&bin),
        before,
        "the bin directory as before the install: {log}"
    );
}

#[test]
fn uninstall_keeps_a_binary_an_operators_configuration_still_names() {
    require_root();
    let node = lab_node();
    let bin = host_bin(&node);
    let operators = node.conf_dir().join("99-operator.conflist");
    std::fs::write(
        &operators,
        json!({"cniVersion": "1.0.0", "name": "operator", "plugins": [
            {"type": "ptp", "ipam": {"type": "static"}}, {"type": "firewall"}
        ]})
        .to_string(),
    )
    .expect("an operator's conflist");
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    let mut first = agent_of_n1(&node, &server, TOKEN, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("readiness", Duration::from_secs(20), || first.ready(&node));
    assert!(holds_the_suites(&bin.join("firewall"), "firewall"));

    let (status, log) = first.stop();
    assert!(status.success(), "{log}");
    assert!(
        holds_the_suites(&bin.join("firewall"), "firewall"),
        "the operator's conflist still names firewall: {log}"
    );
    assert!(
        log.contains("firewall stays: a configuration in"),
        "the agent says why: {log}"
    );
    assert!(!bin.join("bridge").exists(), "what nothing names goes: {log}");

    // Once nothing names it, the next uninstall removes it.
    std::fs::remove_file(&operators).expect("rm");
    let mut second = agent_of_n1(&node, &server, TOKEN, &[("UNINSTALL_ON_STOP", "true")]);
    wait_for("readiness", Duration::from_secs(20), || second.ready(&node));
    let (status, log) = second.stop();
    assert!(status.success(), "{log}");
    let left: Vec<_> = std::fs::read_dir(&bin)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "nothing of the suite left: {left:?} {log}");
}

/// kindnet's conflist, as kindnetd writes it.
fn kindnet_conflist() -> Value {
    json!({"cniVersion": "0.3.1", "name": "kindnet", "plugins": [
        {"type": "ptp", "ipMasq": false, "mtu": 1500, "ipam": {"type": "host-local",
         "dataDir": "/run/cni-ipam-state", "ranges": [[{"subnet": "10.244.1.0/24"}]],
         "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": true}}
    ]})
}

pub(crate) fn plugin_types(path: &std::path::Path) -> Vec<String> {
    plugin_types_in(&std::fs::read_to_string(path).unwrap_or_default())
}

/// The plugin types of a configuration's text (empty when it is not JSON).
pub(crate) fn plugin_types_in(text: &str) -> Vec<String> {
    let conf: Value = serde_json::from_str(text).unwrap_or_default();
    conf["plugins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["type"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn istio_redirect_is_chained_last_into_another_cnis_file_and_put_back() {
    require_root();
    let node = lab_node();
    uplink(&node);
    let kindnet = node.conf_dir().join("10-kindnet.conflist");
    std::fs::write(&kindnet, kindnet_conflist().to_string()).expect("kindnet's file");
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    let mut agent = agent_of_n1(
        &node,
        &server,
        TOKEN,
        &[
            ("ISTIO_CHAINED", "true"),
            // Sorts after kindnet's: kindnet's stays the primary file.
            ("CNI_CONF_NAME", "90-cni-suite.conflist"),
            ("UNINSTALL_ON_STOP", "true"),
        ],
    );
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
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
    let node = lab_node();
    uplink(&node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    // A pod with no Kubernetes arguments (cnictl's) is captured by the
    // entry's static `redirect`.
    let entry = r#"{"type":"istio-redirect","redirect":{"interceptionMode":"REDIRECT"}}"#;
    let agent = agent_of_n1(
        &node,
        &server,
        TOKEN,
        &[("ISTIO_CHAINED", "true"), ("ISTIO_PLUGIN_CONFIG", entry)],
    );
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    assert_eq!(
        plugin_types(&conflist(&node)),
        ["bridge", "portmap", "istio-redirect"]
    );
    let bin = host_bin(&node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    node.cnictl_env(&["add", "cni-suite", pod.path_str()], &cni_path)
        .success();
    let rules = test_kit::run_in(pod.path(), Path::new("iptables-save"), &["-t", "nat"], &[], "")
        .success()
        .stdout;
    assert!(
        rules.contains("-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001"),
        "{rules}"
    );
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

/// A bare `.conf` as an operator writes it, with spacing no JSON writer
/// reproduces: the bridge `br-wrap` over 10.22.0.0/24, leases under `leases`.
pub(crate) fn bare_conf(leases: &Path) -> String {
    format!(
        "{{ \"cniVersion\": \"0.4.0\",  \"name\": \"mynet\", \"type\": \"bridge\", \"bridge\": \"br-wrap\",\n  \
         \"isGateway\": true, \"ipam\": {{\"type\": \"host-local\", \"subnet\": \"10.22.0.0/24\",\n  \
         \"dataDir\": \"{}\"}} }}\n",
        leases.display()
    )
}

/// The network a runtime sets pods up with: the name in the first valid
/// file of the conf directory, as containerd and CRI-O pick it.
fn runtime_network(node: &Node) -> String {
    let mut files: Vec<PathBuf> = std::fs::read_dir(node.conf_dir())
        .expect("conf dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "conf" || e == "conflist"))
        .collect();
    files.sort();
    files
        .iter()
        .find_map(|path| {
            let conf: Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
            conf["name"].as_str().map(str::to_owned)
        })
        .expect("a configuration")
}

/// The IPv4 address cnictl's result gives the pod.
pub(super) fn pod_address(run: test_kit::Run) -> String {
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
    uplink(&node);
    let leases = node.path("mynet-leases");
    let bare = bare_conf(&leases);
    let conf_path = node.conf_dir().join("10-mynet.conf");
    std::fs::write(&conf_path, &bare).expect("the node's own .conf");
    let network = runtime_network(&node);
    // A pod the runtime set up through the .conf before Istio came.
    let first = node.pod("first");
    let first_address = pod_address(node.cnictl_env(&["--json", "add", &network, first.path_str()], &[]));

    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let settings = [
        ("ISTIO_CHAINED", "true"),
        ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8")),
        // Sorts after the .conf: that stays the file the runtime uses.
        ("CNI_CONF_NAME", "90-cni-suite.conflist"),
    ];
    let mut agent = agent_of_n1(&node, &server, TOKEN, &settings);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
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
    uplink(&node);
    let conf_path = node.conf_dir().join("10-mynet.conf");
    let bare = bare_conf(&node.path("mynet-leases"));
    std::fs::write(&conf_path, &bare).expect("the node's own .conf");
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let mut agent = agent_of_n1(
        &node,
        &server,
        TOKEN,
        &[
            ("ISTIO_CHAINED", "true"),
            ("ISTIO_CNI_CONF_FILE", "10-mynet.conf"),
            ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8")),
            ("UNINSTALL_ON_STOP", "true"),
        ],
    );
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
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
    uplink(&node);
    let kindnet = node.conf_dir().join("10-kindnet.conflist");
    std::fs::write(&kindnet, kindnet_conflist().to_string()).expect("kindnet's file");
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let kubeconfig = ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8"));

    // The agent's own conflist sorts first: that is the file the runtime
    // uses, and kindnet's is never touched.
    let mut agent = agent_of_n1(
        &node,
        &server,
        TOKEN,
        &[
            ("ISTIO_CHAINED", "true"),
            kubeconfig,
            ("UNINSTALL_ON_STOP", "true"),
        ],
    );
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
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
    uplink(&node);
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
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    let mut agent = agent_of_n1(
        &node,
        &server,
        TOKEN,
        &[("ISTIO_CHAINED", "true"), ("UNINSTALL_ON_STOP", "true")],
    );
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    let left: Value = serde_json::from_str(&std::fs::read_to_string(&kindnet).expect("kept")).expect("JSON");
    assert_eq!(left, kindnet_conflist(), "{log}");
    assert!(!host_bin(&node).join("istio-redirect").exists(), "{log}");
}

#[test]
fn the_first_conflist_chains_the_portmap_the_agent_installs_and_a_restart_changes_nothing() {
    require_root();
    let node = lab_node();
    uplink(&node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    assert!(
        !host_bin(&node).join("portmap").exists(),
        "a node without portmap"
    );
    let agent = agent_of_n1(&node, &server, TOKEN, &[]);
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
    assert_eq!(
        plugin_types(&conflist(&node)),
        ["bridge", "portmap"],
        "hostPorts work from the first pod"
    );
    let written = std::fs::read_to_string(conflist(&node)).expect("conflist");
    let inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(conflist(&node)).expect("stat"));
    drop(agent);

    let mut agent = agent_of_n1(&node, &server, TOKEN, &[]);
    wait_for("readiness after a restart", Duration::from_secs(20), || {
        agent.ready(&node)
    });
    std::thread::sleep(Duration::from_millis(500));
    let (status, log) = agent.stop();
    assert!(status.success(), "{log}");
    assert_eq!(
        std::fs::read_to_string(conflist(&node)).expect("conflist"),
        written
    );
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(conflist(&node)).expect("stat")),
        inode,
        "the conflist is not rewritten"
    );
    for change in ["\"msg\":\"installed", "\"msg\":\"wrote"] {
        assert!(
            !log.contains(change),
            "the restarted agent changed something ({change}): {log}"
        );
    }
}

#[test]
fn istio_redirect_reads_pods_with_the_kubeconfig_the_agent_keeps_current() {
    require_root();
    let node = lab_node();
    uplink(&node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    // An injected pod, as the API server serves it.
    server.add_pod(
        "default",
        "web-0",
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "web-0", "namespace": "default", "annotations": {
                   "sidecar.istio.io/status": r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#}},
               "spec": {"initContainers": [{"name": "istio-validation"}],
                        "containers": [{"name": "app"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"]}]}}),
    );
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    let mut agent = agent_of_n1(
        &node,
        &server,
        TOKEN,
        &[
            ("ISTIO_CHAINED", "true"),
            ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8")),
            ("UNINSTALL_ON_STOP", "true"),
        ],
    );
    wait_for("readiness", Duration::from_secs(20), || agent.ready(&node));
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
    let rules = test_kit::run_in(pod.path(), Path::new("iptables-save"), &["-t", "nat"], &[], "")
        .success()
        .stdout;
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

/// A process standing for a pod's pause container: what makes its
/// namespace show in /proc. Killed when dropped.
struct Pause(std::process::Child);

impl Pause {
    /// As the pause image runs it: uid and gid 65535, another user than
    /// the agent's.
    fn start(pod: &test_kit::Netns) -> Pause {
        Pause(test_kit::spawn_in(
            pod.path(),
            Path::new("setpriv"),
            &[
                "--reuid=65535",
                "--regid=65535",
                "--clear-groups",
                "/bin/sleep",
                "600",
            ],
            &[],
            "",
        ))
    }
}

impl Drop for Pause {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn nat_rules(pod: &test_kit::Netns) -> String {
    test_kit::run_in(pod.path(), Path::new("iptables-save"), &["-t", "nat"], &[], "")
        .success()
        .stdout
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
    assert!(!nat_rules(&pod).contains("ISTIO"), "no capture before the repair");

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
        || nat_rules(&pod).contains("-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001"),
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
    assert!(!nat_rules(&pod).contains("ISTIO"), "nothing programmed");

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
    assert!(!nat_rules(&pod).contains("ISTIO"), "nothing programmed");
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
    assert!(!nat_rules(&pod).contains("ISTIO"), "no iptables rules: {tables}");
}
