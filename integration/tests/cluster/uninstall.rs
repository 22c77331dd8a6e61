//! Uninstall (the install controller undone): what the agent removes from the
//! node, and what it keeps.

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{
    AgentFixture, ReadyNode, agent_routes, host_bin, host_leases, lab_node, node_object, uplink,
};
use test_kit::{Node, require_root, wait_for};

use crate::common::{TOKEN, agent_of_n1, bin_dir_snapshot, conflist};

#[test]
fn uninstall_with_pods_left_keeps_what_their_dels_need() {
    require_root();
    let ReadyNode {
        node,
        server: _server,
        mut agent,
    } = AgentFixture::new(TOKEN)
        .uplink()
        .settings(&[("UNINSTALL_ON_STOP", "true")])
        .start();
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
    let ReadyNode {
        node: _node,
        server: _server,
        mut agent,
    } = AgentFixture::new(TOKEN)
        .on(node)
        .settings(&[("UNINSTALL_ON_STOP", "true")])
        .start();
    for plugin in test_kit::PLUGINS {
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
    let ReadyNode {
        node,
        server,
        agent: mut first,
    } = AgentFixture::new(TOKEN)
        .on(node)
        .settings(&[("UNINSTALL_ON_STOP", "true")])
        .start();
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
