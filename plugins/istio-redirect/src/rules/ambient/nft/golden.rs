//! Istio's own native-nftables goldens for the in-pod rules
//! (`cni/pkg/nftables/testdata`, its master of 2026-08; the IPv6 probe
//! address its tests draw at random replaced by the real one), compared
//! line for line with our transaction for the same case: Istio's test
//! cases, each without and with IPv6. Istio's text has a few doubled
//! spaces, which nft ignores; lines are compared with runs of spaces
//! folded.

use super::*;
use crate::rules::ambient::PodOverrides;

fn folded(text: &str) -> String {
    text.lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join("\n")
}

fn assert_golden(node_dns: bool, pod: PodOverrides, ipv6: bool, golden: &str) {
    let got = folded(&render_in_pod_nft(&InPod::new(node_dns, &pod), ipv6).istio_transaction());
    let want = folded(golden);
    assert_eq!(got, want, "\n--- got\n{got}\n--- want\n{want}");
}

fn virtual_interfaces() -> Vec<String> {
    vec!["fake1s0f0".into(), "fake1s0f1".into()]
}

/// Istio's `GetCommonInPodTestCases`: name, the node's DNS capture, the
/// pod's overrides.
fn cases() -> Vec<(&'static str, bool, PodOverrides)> {
    let dns = |on| PodOverrides {
        dns_capture: Some(on),
        ..PodOverrides::default()
    };
    vec![
        ("default", true, PodOverrides::default()),
        (
            "ingress",
            false,
            PodOverrides {
                bypass_inbound: true,
                ..PodOverrides::default()
            },
        ),
        (
            "virtual_interfaces",
            false,
            PodOverrides {
                virtual_interfaces: virtual_interfaces(),
                ..PodOverrides::default()
            },
        ),
        (
            "ingress_and_virtual_interfaces",
            false,
            PodOverrides {
                bypass_inbound: true,
                virtual_interfaces: virtual_interfaces(),
                ..PodOverrides::default()
            },
        ),
        ("dns_pod_enabled_and_off_globally", false, dns(true)),
        ("dns_pod_disabled_and_on_globally", true, dns(false)),
    ]
}

fn golden(name: &str, ipv6: bool) -> &'static str {
    match (name, ipv6) {
        ("default", false) => include_str!("../testdata/nft/default.nft"),
        ("default", true) => include_str!("../testdata/nft/default_ipv6.nft"),
        ("ingress", false) => include_str!("../testdata/nft/ingress.nft"),
        ("ingress", true) => include_str!("../testdata/nft/ingress_ipv6.nft"),
        ("virtual_interfaces", false) => include_str!("../testdata/nft/virtual_interfaces.nft"),
        ("virtual_interfaces", true) => include_str!("../testdata/nft/virtual_interfaces_ipv6.nft"),
        ("ingress_and_virtual_interfaces", false) => {
            include_str!("../testdata/nft/ingress_and_virtual_interfaces.nft")
        }
        ("ingress_and_virtual_interfaces", true) => {
            include_str!("../testdata/nft/ingress_and_virtual_interfaces_ipv6.nft")
        }
        ("dns_pod_enabled_and_off_globally", false) => {
            include_str!("../testdata/nft/dns_pod_enabled_and_off_globally.nft")
        }
        ("dns_pod_enabled_and_off_globally", true) => {
            include_str!("../testdata/nft/dns_pod_enabled_and_off_globally_ipv6.nft")
        }
        ("dns_pod_disabled_and_on_globally", false) => {
            include_str!("../testdata/nft/dns_pod_disabled_and_on_globally.nft")
        }
        ("dns_pod_disabled_and_on_globally", true) => {
            include_str!("../testdata/nft/dns_pod_disabled_and_on_globally_ipv6.nft")
        }
        _ => unreachable!("no golden {name}"),
    }
}

#[test]
fn every_istio_case_in_both_families() {
    for (name, node_dns, pod) in cases() {
        for ipv6 in [false, true] {
            assert_golden(node_dns, pod.clone(), ipv6, golden(name, ipv6));
        }
    }
}

#[test]
fn removal_names_every_table_even_those_these_settings_leave_empty() {
    let removal = render_in_pod_nft(&InPod::new(false, &PodOverrides::default()), false).removal();
    for table in [NAT, MANGLE, RAW] {
        assert!(
            removal.contains(&format!("delete table inet {table}\n")),
            "{removal}"
        );
    }
}
