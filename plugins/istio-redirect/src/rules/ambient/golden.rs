//! Istio's own in-pod listings: each of its `cni/pkg/iptables/testdata`
//! goldens for the in-pod rules (its master of 2026-08) loaded into an empty
//! namespace with `iptables-restore` and dumped with `iptables-save`
//! (`testdata/*.save`; the IPv6 one with the real probe address where
//! Istio's test puts a random one), compared table by table, chain by
//! chain and rule by rule in order.

use super::*;
use crate::rules::golden::assert_listing;

fn assert_golden(in_pod: &InPod, family: Family, golden: &str) {
    assert_listing(render_in_pod(in_pod, family), golden);
}

/// Istio's test cases: the node's DNS capture, then the pod's overrides.
fn case(node_dns: bool, pod: PodOverrides) -> InPod {
    InPod::new(node_dns, &pod)
}

fn virtual_interfaces() -> Vec<String> {
    vec!["fake1s0f0".into(), "fake1s0f1".into()]
}

#[test]
fn default_with_dns_capture() {
    let golden = include_str!("testdata/default.save");
    assert_golden(&case(true, PodOverrides::default()), Family::V4, golden);
}

#[test]
fn default_ipv6() {
    let golden = include_str!("testdata/default_ipv6.save");
    assert_golden(&case(true, PodOverrides::default()), Family::V6, golden);
}

#[test]
fn bypass_inbound_capture() {
    let pod = PodOverrides {
        bypass_inbound: true,
        ..PodOverrides::default()
    };
    assert_golden(
        &case(false, pod),
        Family::V4,
        include_str!("testdata/ingress.save"),
    );
}

#[test]
fn virtual_interfaces_rerouted_with_and_without_inbound() {
    for (bypass_inbound, golden) in [
        (false, include_str!("testdata/virtual_interfaces.save")),
        (true, include_str!("testdata/ingress_and_virtual_interfaces.save")),
    ] {
        let pod = PodOverrides {
            bypass_inbound,
            virtual_interfaces: virtual_interfaces(),
            ..PodOverrides::default()
        };
        assert_golden(&case(false, pod), Family::V4, golden);
    }
}

#[test]
fn the_pods_dns_setting_wins_over_the_nodes() {
    let on = PodOverrides {
        dns_capture: Some(true),
        ..PodOverrides::default()
    };
    let golden = include_str!("testdata/dns_pod_enabled_and_off_globally.save");
    assert_golden(&case(false, on), Family::V4, golden);
    let off = PodOverrides {
        dns_capture: Some(false),
        ..PodOverrides::default()
    };
    let golden = include_str!("testdata/dns_pod_disabled_and_on_globally.save");
    assert_golden(&case(true, off), Family::V4, golden);
}
