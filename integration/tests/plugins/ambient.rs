//! Istio's ambient in-pod redirection, programmed as the node agent
//! programs it (`istio_redirect::rules::ambient::program`, called from
//! outside the pod) in pods the bridge made: the kernel's routing read
//! back, and real TCP/UDP showing which of ztunnel's ports each connection
//! lands on, with listeners standing in for ztunnel's.

use firewall::Family;
use istio_redirect::rules::Outcome;
use istio_redirect::rules::ambient::{INPOD_MARK, InPod, PROBE_SNAT_V4, PodOverrides, program};
use serde_json::json;
use test_kit::probe::{Probe, sorted};
use test_kit::{Netns, Node};

const NETWORK: &str = "ambient";
const BRIDGE: &str = "cniambient0";

/// The node's network (both families), and `pods` added to it in order:
/// the first gets .2, the next .3.
fn node_with(pods: &[&str]) -> (Node, Vec<Netns>) {
    let node = Node::new();
    node.write_conf(
        "10-ambient.conflist",
        &json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": true,
             "ipam": {"type": "host-local", "socket": "",
                      "dataDir": node.path("ipam").to_str().expect("UTF-8"),
                      "ranges": [[{"subnet": "10.60.0.0/24"}], [{"subnet": "fd60::/64"}]],
                      "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}}]}),
    );
    let pods = pods
        .iter()
        .map(|role| {
            let pod = node.pod(role);
            pod.ip(&["link", "set", "lo", "up"]).success();
            node.cnictl(&["--json", "add", NETWORK, pod.path_str()]).success();
            pod
        })
        .collect();
    (node, pods)
}

fn enrol(pod: &Netns, overrides: &PodOverrides) -> Vec<(Family, Outcome)> {
    let ns = netns::NetNs::open(pod.path()).expect("the pod's namespace");
    program(&ns, &InPod::new(true, overrides), &[Family::V4, Family::V6], None).expect("in-pod rules")
}

#[test]
fn an_enrolled_pods_traffic_lands_on_ztunnels_ports() {
    let probe = Probe::new();
    let (node, pods) = node_with(&["other", "app"]);
    let (other, app) = (&pods[0], &pods[1]);
    let applied = [(Family::V4, Outcome::Applied), (Family::V6, Outcome::Applied)];
    assert_eq!(enrol(app, &PodOverrides::default()), applied);
    // Enrolled again (the agent restarted, the same event twice): nothing changes.
    let unchanged = [(Family::V4, Outcome::Unchanged), (Family::V6, Outcome::Unchanged)];
    assert_eq!(enrol(app, &PodOverrides::default()), unchanged);
    for family in ["-4", "-6"] {
        let rules = app.ip(&[family, "rule"]).success().stdout;
        // Once, though programmed twice.
        let inpod = "32764:\tfrom all fwmark 0x111/0xfff lookup 100";
        assert_eq!(rules.matches(inpod).count(), 1, "{rules}");
        let table = app
            .ip(&[family, "route", "show", "table", "100"])
            .success()
            .stdout;
        assert!(table.contains("local default dev lo"), "{table}");
    }

    let app_rx = probe.listen(app, &[15001, 15006, 15008, 15053, 8080, 8081]);
    let other_rx = probe.listen_on(other, &["8080".into(), "udp:53".into()]);
    let connect = |from: &Netns, host: &str, port: u16| {
        probe.connect(from, None, host, port, None).success();
    };
    // Outbound goes to ztunnel's 15001 with its destination kept.
    connect(app, "10.60.0.2", 8080);
    app_rx.wait_for("tcp 15001 10.60.0.2:8080");
    connect(app, "fd60::2", 8080);
    app_rx.wait_for("tcp 15001 [fd60::2]:8080");
    // ztunnel's own (marked) connections go out untouched.
    probe.connect_marked(app, INPOD_MARK, "10.60.0.2", 8080).success();
    other_rx.wait_for("tcp 8080 10.60.0.2:8080");
    // The pod reaching itself, by loopback or by its own address, stays local.
    connect(app, "127.0.0.1", 8080);
    app_rx.wait_for("tcp 8080 127.0.0.1:8080");
    connect(app, "10.60.0.3", 8080);
    app_rx.wait_for("tcp 8080 10.60.0.3:8080");
    // DNS over UDP and TCP goes to ztunnel's DNS proxy.
    probe.udp(app, "10.60.0.2", 53).success();
    app_rx.wait_for("udp 15053");
    connect(app, "10.60.0.2", 53);
    app_rx.wait_for("tcp 15053 10.60.0.2:53");
    // Inbound lands on 15006, except HBONE, which ztunnel serves on 15008.
    connect(other, "10.60.0.3", 8080);
    app_rx.wait_for("tcp 15006 10.60.0.3:8080");
    connect(other, "fd60::3", 8080);
    app_rx.wait_for("tcp 15006 [fd60::3]:8080");
    connect(other, "10.60.0.3", 15008);
    app_rx.wait_for("tcp 15008 10.60.0.3:15008");
    // A kubelet probe, SNATed on the node to Istio's probe address,
    // reaches the app itself (from anywhere else it would land on 15006).
    let probe_source = PROBE_SNAT_V4.to_string();
    node.netns
        .ip(&["addr", "add", &format!("{probe_source}/32"), "dev", BRIDGE])
        .success();
    probe
        .connect(&node.netns, None, "10.60.0.3", 8081, Some(&probe_source))
        .success();
    app_rx.wait_for("tcp 8081 10.60.0.3:8081");

    assert_eq!(
        app_rx.all(),
        sorted(&[
            "tcp 15001 10.60.0.2:8080",
            "tcp 15001 [fd60::2]:8080",
            "tcp 8080 127.0.0.1:8080",
            "tcp 8080 10.60.0.3:8080",
            "udp 15053",
            "tcp 15053 10.60.0.2:53",
            "tcp 15006 10.60.0.3:8080",
            "tcp 15006 [fd60::3]:8080",
            "tcp 15008 10.60.0.3:15008",
            "tcp 8081 10.60.0.3:8081",
        ])
    );
    assert_eq!(other_rx.all(), ["tcp 8080 10.60.0.2:8080"]);
}

#[test]
fn a_pods_overrides_leave_inbound_and_dns_alone() {
    let probe = Probe::new();
    let (_node, pods) = node_with(&["other", "gateway"]);
    let (other, gateway) = (&pods[0], &pods[1]);
    let overrides = PodOverrides {
        bypass_inbound: true,
        dns_capture: Some(false),
        ..PodOverrides::default()
    };
    enrol(gateway, &overrides);
    let gateway_rx = probe.listen(gateway, &[15001, 15006, 8080]);
    let other_rx = probe.listen_on(other, &["udp:53".into()]);
    probe.connect(other, None, "10.60.0.3", 8080, None).success();
    gateway_rx.wait_for("tcp 8080 10.60.0.3:8080");
    probe.udp(gateway, "10.60.0.2", 53).success();
    other_rx.wait_for("udp 53");
    // Outbound is still ztunnel's.
    probe.connect(gateway, None, "10.60.0.2", 8080, None).success();
    gateway_rx.wait_for("tcp 15001 10.60.0.2:8080");
    assert_eq!(
        gateway_rx.all(),
        sorted(&["tcp 8080 10.60.0.3:8080", "tcp 15001 10.60.0.2:8080"])
    );
}
