//! The conflist controller: the node's configuration the agent writes from
//! its Node and the plugins it chains.

use std::time::Duration;

use serde_json::Value;
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{AgentFixture, ReadyNode, agent_routes, host_bin, lab_node, node_object, uplink};
use test_kit::{require_root, wait_for};

use crate::common::{TOKEN, agent_of_n1, conflist, plugin_types, read_conflist};

fn subnets(conf: &Value) -> Vec<String> {
    conf["plugins"][0]["ipam"]["ranges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|set| set[0]["subnet"].as_str().unwrap_or_default().to_owned())
        .collect()
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
fn the_first_conflist_chains_the_portmap_the_agent_installs_and_a_restart_changes_nothing() {
    require_root();
    let node = lab_node();
    assert!(
        !host_bin(&node).join("portmap").exists(),
        "a node without portmap"
    );
    let ReadyNode { node, server, agent } = AgentFixture::new(TOKEN).on(node).uplink().start();
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
