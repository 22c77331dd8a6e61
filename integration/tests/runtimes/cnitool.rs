//! Go's cnitool (libcni 1.1.2, built from Debian's source package) driving
//! the suite: ADD, CHECK and DEL of our conflists against pod namespaces
//! under a node namespace, and a result cache shared with cnictl.

use std::path::Path;

use serde_json::{Value, json};
use test_kit::leases::addresses;
use test_kit::{Netns, Node, Run, cnitool_container_id, run_in};

const VERSION: &str = "1.0.0";

fn cnitool(node: &Node, verb: &str, network: &str, pod: &Netns) -> Run {
    node.cnitool(&[verb, network, pod.path_str()], &[])
}

fn ping(from: &Netns, to: &str) -> Run {
    let ping = if to.contains(':') { "ping6" } else { "ping" };
    run_in(
        from.path(),
        Path::new("busybox"),
        &[ping, "-c", "1", "-W", "2", to],
        &[],
        "",
    )
}

fn bridge_chain(node: &Node, bridge: &str, subnet4: &str, subnet6: &str) -> Value {
    json!({"type": "bridge", "bridge": bridge, "isGateway": true, "ipMasq": true,
           "ipam": {"type": "host-local", "socket": "",
                    "dataDir": node.path("ipam").to_str().expect("UTF-8"),
                    "ranges": [[{"subnet": subnet4}], [{"subnet": subnet6}]],
                    "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}})
}

fn write_list(node: &Node, network: &str, plugins: Vec<Value>) {
    let list = json!({"cniVersion": VERSION, "name": network, "plugins": plugins});
    node.write_conf(&format!("10-{network}.conflist"), &list);
}

fn nothing_left(node: &Node, network: &str) {
    let left = node.leftovers(network, &node.path("ipam"));
    assert!(left.is_empty(), "left behind: {left:#?}");
}

#[test]
fn loopback() {
    let node = Node::new();
    node.write_conf(
        "10-lo.conflist",
        &json!({"cniVersion": VERSION, "name": "lo-net", "plugins": [{"type": "loopback"}]}),
    );
    let pod = node.pod("pod");
    let added = cnitool(&node, "add", "lo-net", &pod).success();
    assert_eq!(added.json()["cniVersion"], VERSION);
    assert!(pod.link_is_up("lo"));
    cnitool(&node, "check", "lo-net", &pod).success();
    cnitool(&node, "del", "lo-net", &pod).success();
    assert!(!pod.link_is_up("lo"));
}

#[test]
fn bridge_and_host_local_pods_talk_and_del_leaves_nothing() {
    let node = Node::new();
    write_list(
        &node,
        "br",
        vec![bridge_chain(&node, "cnitool0", "10.55.0.0/24", "fd55::/64")],
    );
    let (a, b) = (node.pod("a"), node.pod("b"));
    let first = cnitool(&node, "add", "br", &a).success().json();
    let second = cnitool(&node, "add", "br", &b).success().json();
    assert_eq!(addresses(&first), ["10.55.0.2/24", "fd55::2/64"], "{first}");
    assert_eq!(addresses(&second), ["10.55.0.3/24", "fd55::3/64"], "{second}");
    ping(&a, "10.55.0.3").success();
    ping(&b, "fd55::2").success();
    ping(&a, "10.55.0.1").success();
    cnitool(&node, "check", "br", &a).success();
    cnitool(&node, "check", "br", &b).success();
    cnitool(&node, "del", "br", &a).success();
    cnitool(&node, "del", "br", &b).success();
    nothing_left(&node, "br");
}

#[test]
fn the_istio_chain() {
    let node = Node::new();
    write_list(
        &node,
        "mesh",
        vec![
            bridge_chain(&node, "cnitool1", "10.56.0.0/24", "fd56::/64"),
            json!({"type": "istio-redirect", "redirect": {"excludeOutboundPorts": "5432"}}),
        ],
    );
    let pod = node.pod("pod");
    pod.ip(&["link", "set", "lo", "up"]).success();
    let added = cnitool(&node, "add", "mesh", &pod).success().json();
    assert_eq!(addresses(&added), ["10.56.0.2/24", "fd56::2/64"], "{added}");
    let rules = pod.nat_rules("iptables-nft-save");
    assert!(
        rules.contains("-A ISTIO_OUTPUT -p tcp -m tcp --dport 5432 -j RETURN"),
        "{rules}"
    );
    cnitool(&node, "check", "mesh", &pod).success();
    cnitool(&node, "del", "mesh", &pod).success();
    nothing_left(&node, "mesh");
}

#[test]
fn cnitool_and_cnictl_share_the_result_cache() {
    let node = Node::new();
    write_list(
        &node,
        "shared",
        vec![bridge_chain(&node, "cnitool2", "10.57.0.0/24", "fd57::/64")],
    );
    let id_of = |pod: &Netns| cnitool_container_id(pod.path_str());

    // Added by cnitool, checked and deleted by cnictl.
    let pod = node.pod("one");
    cnitool(&node, "add", "shared", &pod).success();
    let cached = node
        .cache_entry("shared", &id_of(&pod), "eth0")
        .expect("cnitool cached the result");
    assert_eq!(cached["kind"], "cniCacheV1");
    node.cnictl(&["check", "shared", pod.path_str()]).success();
    node.cnictl(&["del", "shared", pod.path_str()]).success();
    assert!(node.cache_entry("shared", &id_of(&pod), "eth0").is_none());

    // Added by cnictl, checked and deleted by cnitool.
    let pod = node.pod("two");
    node.cnictl(&["add", "shared", pod.path_str()]).success();
    cnitool(&node, "check", "shared", &pod).success();
    cnitool(&node, "del", "shared", &pod).success();
    nothing_left(&node, "shared");
}
