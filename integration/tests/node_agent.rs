//! The node agent against the API test server, and the test server against
//! kube-rs (the agent's client), pinning what the agent relies on: list
//! with a resourceVersion, watch events and bookmarks, 410 Expired on an
//! old version, 401 on a bad token, a watch dropped mid-stream.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use integration::api_server::ApiServer;
use integration::node_agent::{
    Agent, agent_routes, host_bin, host_conflist, host_leases, lab_node, node_object,
};
use integration::{Node, require_root, wait_for};
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions, WatchEvent, WatchParams};
use serde_json::{Value, json};

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

/// The uplink of the lab's node: a link holding the node's InternalIP,
/// with an MTU pods must inherit (a veth: this kernel has no dummy links).
fn uplink(node: &Node) {
    node.netns
        .ip(&[
            "link", "add", "uplink0", "mtu", "1450", "type", "veth", "peer", "name", "uplink0p", "mtu",
            "1450",
        ])
        .success();
    node.netns
        .ip(&["addr", "add", "10.250.0.11/24", "dev", "uplink0"])
        .success();
    for link in ["uplink0", "uplink0p"] {
        node.netns.ip(&["link", "set", link, "up"]).success();
    }
}

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
        conf["plugins"].as_array().map(Vec::len),
        Some(1),
        "no portmap on this node"
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

    // A route of a pod range with a wrong gateway, whoever made it, is put
    // right at the next change.
    node.netns
        .ip(&["route", "replace", "10.244.4.0/24", "via", "10.250.0.99"])
        .success();
    server.apply_node(node_object("n5", &["10.244.5.0/24"], &["10.250.0.15"]));
    wait_for("the wrong gateway replaced", Duration::from_secs(2), || {
        agent_routes(&node)
            == expected(&[
                "10.244.3.0/24 via 10.250.0.23",
                "10.244.4.0/24 via 10.250.0.14",
                "10.244.5.0/24 via 10.250.0.15",
            ])
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
        agent_routes(&node)
            == expected(&[
                "10.244.3.0/24 via 10.250.0.23",
                "10.244.4.0/24 via 10.250.0.14",
                "10.244.5.0/24 via 10.250.0.15",
            ])
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
    let services = integration::services_under(&leases);
    assert_eq!(services.len(), 1, "the agent runs the lease service");
    first.kill();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        integration::services_under(&leases),
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
    assert_eq!(integration::services_under(&leases), services);
    let (status, log) = second.stop();
    assert!(status.success(), "{log}");
    assert!(integration::services_under(&leases).is_empty(), "{log}");
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

/// kindnet's conflist, as kindnetd writes it.
fn kindnet_conflist() -> Value {
    json!({"cniVersion": "0.3.1", "name": "kindnet", "plugins": [
        {"type": "ptp", "ipMasq": false, "mtu": 1500, "ipam": {"type": "host-local",
         "dataDir": "/run/cni-ipam-state", "ranges": [[{"subnet": "10.244.1.0/24"}]],
         "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": true}}
    ]})
}

fn plugin_types(path: &std::path::Path) -> Vec<String> {
    let conf: Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_default()).unwrap_or_default();
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
    assert_eq!(plugin_types(&conflist(&node)), ["bridge", "istio-redirect"]);
    let bin = host_bin(&node);
    let cni_path = [("CNI_PATH", bin.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    node.cnictl_env(&["add", "cni-suite", pod.path_str()], &cni_path)
        .success();
    let rules = integration::run_in(pod.path(), Path::new("iptables-save"), &["-t", "nat"], &[], "")
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
    let rules = integration::run_in(pod.path(), Path::new("iptables-save"), &["-t", "nat"], &[], "")
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
    fn start(pod: &integration::Netns) -> Pause {
        Pause(integration::spawn_in(
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

fn nat_rules(pod: &integration::Netns) -> String {
    integration::run_in(pod.path(), Path::new("iptables-save"), &["-t", "nat"], &[], "")
        .success()
        .stdout
}

fn event_reasons(server: &ApiServer, pod: &str) -> Vec<String> {
    server
        .events()
        .iter()
        .filter(|e| e["involvedObject"]["name"] == pod)
        .map(|e| {
            format!(
                "{} {}",
                e["type"].as_str().unwrap_or("?"),
                e["reason"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

#[test]
fn a_pod_that_started_before_the_chain_is_repaired_where_it_runs_and_then_captures_traffic() {
    require_root();
    let node = lab_node();
    uplink(&node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    // The pod the race left behind: wired, running, and no capture. Its
    // address is this test's alone, since the agent searches every
    // process of the machine.
    let pod = node.pod("racer");
    node.netns.veth_to("racer0", &pod);
    node.netns
        .ip(&["addr", "add", "10.199.7.1/24", "dev", "racer0"])
        .success();
    node.netns.ip(&["link", "set", "racer0", "up"]).success();
    pod.ip(&["addr", "add", "10.199.7.5/24", "dev", "eth0"]).success();
    pod.ip(&["link", "set", "eth0", "up"]).success();
    pod.ip(&["link", "set", "lo", "up"]).success();
    let _pause = Pause::start(&pod);
    assert!(!nat_rules(&pod).contains("ISTIO"), "no capture before the repair");

    server.add_pod(
        "default",
        "racer",
        injected_pod("racer", "uid-racer", "n1", "10.199.7.5", crash_looping(), 126),
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
                "10.199.7.9",
                validation,
                code,
            ),
        );
    }
    let kubeconfig = node.path("run/istio-cni/istio-cni-kubeconfig");
    // With the capabilities deploy/cni-suite-istio.yaml gives it.
    let mut agent = Agent::start_under(
        &node,
        "n1",
        &server,
        "127.0.0.1",
        TOKEN,
        &[
            ("ISTIO_CHAINED", "true"),
            ("ISTIO_KUBECONFIG", kubeconfig.to_str().expect("UTF-8")),
        ],
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
    let probe = integration::probe::Probe::new();
    let envoy = probe.listen(&pod, &[15001]);
    probe.connect(&pod, None, "10.199.7.1", 8080, None).success();
    envoy.wait_for("tcp 15001 10.199.7.1:8080");
    assert_eq!(event_reasons(&server, "racer"), ["Normal RepairBrokenPod"]);

    // The kubelet restarts the validation container: the pod changes,
    // and is not programmed again.
    let mut restarted = injected_pod("racer", "uid-racer", "n1", "10.199.7.5", crash_looping(), 126);
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
