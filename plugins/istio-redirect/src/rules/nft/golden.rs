//! Istio's own native-nftables goldens (tools/istio-nftables capture
//! testdata), compared line for line with what we render for the same
//! settings. Istio's tests start from an empty configuration: no inbound
//! capture, no outbound ranges, no port exclusions, uid and gid 1337.
//! Older goldens omit the `flush table` line Istio now writes after each
//! `add table`; `istio` puts it back. The newer goldens (and the project's
//! Istio notes) declare the mangle output chain `type route`, which the
//! TPROXY mark set on output needs to re-route; older ones say `type filter`.

use super::*;

fn istio(dump: &str) -> String {
    let mut out = String::new();
    let lines: Vec<&str> = dump.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    for (i, line) in lines.iter().enumerate() {
        out.push_str(line);
        out.push('\n');
        if let Some(table) = line.strip_prefix("add table ") {
            let flush = format!("flush table {table}");
            if lines.get(i + 1) != Some(&flush.as_str()) {
                out.push_str(&flush);
                out.push('\n');
            }
        }
    }
    out
}

fn istio_test_config() -> Redirect {
    Redirect {
        include_cidrs: Selection::Only(Vec::new()),
        include_inbound_ports: Selection::Only(Vec::new()),
        exclude_inbound_ports: Vec::new(),
        exclude_outbound_ports: Vec::new(),
        ..Redirect::default()
    }
}

fn assert_golden(redirect: &Redirect, ipv6: bool, golden: &str) {
    let got = render_nft(redirect, ipv6).istio_transaction();
    let want = istio(golden);
    assert_eq!(got, want, "\n--- got\n{got}\n--- want\n{want}");
}

const NAT_BASICS: &str = "
add chain inet istio-proxy-nat istio-inbound
add chain inet istio-proxy-nat istio-redirect
add chain inet istio-proxy-nat istio-in-redirect
add chain inet istio-proxy-nat istio-output
";

/// The uid/gid part of istio-output for 1337 without DNS capture.
const OWNERS: &str = "
add rule inet istio-proxy-nat istio-output oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != 15008 skuid 1337 jump istio-in-redirect
add rule inet istio-proxy-nat istio-output oifname lo skuid != 1337 return
add rule inet istio-proxy-nat istio-output skuid 1337 return
add rule inet istio-proxy-nat istio-output oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != 15008 skgid 1337 jump istio-in-redirect
add rule inet istio-proxy-nat istio-output oifname lo skgid != 1337 return
add rule inet istio-proxy-nat istio-output skgid 1337 return
";

const CHAIN_RULES: &str = "
add rule inet istio-proxy-nat istio-inbound meta l4proto tcp tcp dport 15008 return
add rule inet istio-proxy-nat istio-redirect meta l4proto tcp redirect to :15001
add rule inet istio-proxy-nat istio-in-redirect meta l4proto tcp redirect to :15006
";

fn empty_nat(extra_output: &str) -> String {
    format!(
        "add table inet istio-proxy-nat
add chain inet istio-proxy-nat output {{ type nat hook output priority -100 ; }}
{NAT_BASICS}{CHAIN_RULES}
add rule inet istio-proxy-nat output jump istio-output
add rule inet istio-proxy-nat istio-output oifname lo ip saddr 127.0.0.6/32 return
{OWNERS}
add rule inet istio-proxy-nat istio-output ip daddr 127.0.0.1/32 return
{extra_output}"
    )
}

#[test]
fn empty_golden() {
    assert_golden(&istio_test_config(), false, &empty_nat(""));
}

#[test]
fn ipnets_golden() {
    let r = Redirect {
        include_cidrs: Selection::Only(vec!["10.0.0.0/8".parse().expect("cidr")]),
        ..istio_test_config()
    };
    assert_golden(
        &r,
        false,
        &empty_nat("add rule inet istio-proxy-nat istio-output ip daddr 10.0.0.0/8 jump istio-redirect"),
    );
}

#[test]
fn drop_invalid_golden() {
    let r = Redirect {
        invalid_drop: true,
        ..istio_test_config()
    };
    let mangle = "
add table inet istio-proxy-mangle
add chain inet istio-proxy-mangle prerouting { type filter hook prerouting priority -150 ; }
add chain inet istio-proxy-mangle istio-drop
add rule inet istio-proxy-mangle prerouting meta l4proto tcp ct state invalid jump istio-drop
add rule inet istio-proxy-mangle istio-drop drop
";
    assert_golden(&r, false, &(empty_nat("") + mangle));
}

#[test]
fn inbound_ports_wildcard_golden() {
    let r = Redirect {
        include_inbound_ports: Selection::All,
        ..istio_test_config()
    };
    let golden = format!(
        "add table inet istio-proxy-nat
add chain inet istio-proxy-nat prerouting {{ type nat hook prerouting priority -100 ; }}
add chain inet istio-proxy-nat output {{ type nat hook output priority -100 ; }}
{NAT_BASICS}{CHAIN_RULES}
add rule inet istio-proxy-nat prerouting meta l4proto tcp jump istio-inbound
add rule inet istio-proxy-nat istio-inbound meta l4proto tcp jump istio-in-redirect
add rule inet istio-proxy-nat output jump istio-output
add rule inet istio-proxy-nat istio-output oifname lo ip saddr 127.0.0.6/32 return
{OWNERS}
add rule inet istio-proxy-nat istio-output ip daddr 127.0.0.1/32 return
"
    );
    assert_golden(&r, false, &golden);
}

#[test]
fn kube_virt_interfaces_golden() {
    let r = Redirect {
        include_cidrs: Selection::All,
        reroute_interfaces: vec!["eth1".into(), "eth2".into()],
        ..istio_test_config()
    };
    let golden = format!(
        "add table inet istio-proxy-nat
add chain inet istio-proxy-nat prerouting {{ type nat hook prerouting priority -100 ; }}
add chain inet istio-proxy-nat output {{ type nat hook output priority -100 ; }}
{NAT_BASICS}
add rule inet istio-proxy-nat prerouting iifname eth1 return
insert rule inet istio-proxy-nat prerouting index 0 iifname eth2 return
{CHAIN_RULES}
add rule inet istio-proxy-nat output jump istio-output
add rule inet istio-proxy-nat istio-output oifname lo ip saddr 127.0.0.6/32 return
{OWNERS}
add rule inet istio-proxy-nat istio-output ip daddr 127.0.0.1/32 return
add rule inet istio-proxy-nat istio-output jump istio-redirect
insert rule inet istio-proxy-nat prerouting index 0 iifname eth1 jump istio-redirect
insert rule inet istio-proxy-nat prerouting index 0 iifname eth2 jump istio-redirect
"
    );
    assert_golden(&r, false, &golden);
}

#[test]
fn ipv6_virt_interfaces_golden() {
    let r = Redirect {
        include_inbound_ports: Selection::Only(vec![4000, 5000]),
        reroute_interfaces: vec!["eth0".into(), "eth1".into()],
        ..istio_test_config()
    };
    let golden = "add table inet istio-proxy-nat
add chain inet istio-proxy-nat prerouting { type nat hook prerouting priority -100 ; }
add chain inet istio-proxy-nat output { type nat hook output priority -100 ; }
add chain inet istio-proxy-nat istio-inbound
add chain inet istio-proxy-nat istio-redirect
add chain inet istio-proxy-nat istio-in-redirect
add chain inet istio-proxy-nat istio-output
add rule inet istio-proxy-nat prerouting iifname eth0 return
insert rule inet istio-proxy-nat prerouting index 0 iifname eth1 return
add rule inet istio-proxy-nat istio-inbound meta l4proto tcp tcp dport 15008 return
add rule inet istio-proxy-nat istio-redirect meta l4proto tcp redirect to :15001
add rule inet istio-proxy-nat istio-in-redirect meta l4proto tcp redirect to :15006
add rule inet istio-proxy-nat prerouting meta l4proto tcp jump istio-inbound
add rule inet istio-proxy-nat istio-inbound meta l4proto tcp tcp dport 4000 jump istio-in-redirect
add rule inet istio-proxy-nat istio-inbound meta l4proto tcp tcp dport 5000 jump istio-in-redirect
add rule inet istio-proxy-nat output jump istio-output
add rule inet istio-proxy-nat istio-output oifname lo ip saddr 127.0.0.6/32 return
add rule inet istio-proxy-nat istio-output oifname lo ip6 saddr ::6/128 return
add rule inet istio-proxy-nat istio-output oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != 15008 skuid 1337 jump istio-in-redirect
add rule inet istio-proxy-nat istio-output oifname lo meta l4proto tcp ip6 daddr != ::1/128 tcp dport != 15008 skuid 1337 jump istio-in-redirect
add rule inet istio-proxy-nat istio-output oifname lo skuid != 1337 return
add rule inet istio-proxy-nat istio-output skuid 1337 return
add rule inet istio-proxy-nat istio-output oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != 15008 skgid 1337 jump istio-in-redirect
add rule inet istio-proxy-nat istio-output oifname lo meta l4proto tcp ip6 daddr != ::1/128 tcp dport != 15008 skgid 1337 jump istio-in-redirect
add rule inet istio-proxy-nat istio-output oifname lo skgid != 1337 return
add rule inet istio-proxy-nat istio-output skgid 1337 return
add rule inet istio-proxy-nat istio-output ip daddr 127.0.0.1/32 return
add rule inet istio-proxy-nat istio-output ip6 daddr ::1/128 return
";
    assert_golden(&r, true, golden);
}

const TPROXY_MARKS: &str = "
add rule inet istio-proxy-mangle prerouting meta l4proto tcp mark 1337 ct mark set mark
add rule inet istio-proxy-mangle output oifname lo meta l4proto tcp mark 1337 return
add rule inet istio-proxy-mangle output oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 skuid 1337 meta mark set 1338
add rule inet istio-proxy-mangle output oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 skgid 1337 meta mark set 1338
add rule inet istio-proxy-mangle output meta l4proto tcp ct mark 1337 meta mark set ct mark
";

#[test]
fn inbound_ports_empty_tproxy_golden() {
    let r = Redirect {
        mode: Mode::Tproxy,
        ..istio_test_config()
    };
    let mangle = format!(
        "add table inet istio-proxy-mangle
add chain inet istio-proxy-mangle prerouting {{ type filter hook prerouting priority -150 ; }}
add chain inet istio-proxy-mangle output {{ type route hook output priority -150 ; }}
add chain inet istio-proxy-mangle istio-inbound
{TPROXY_MARKS}
add rule inet istio-proxy-mangle istio-inbound meta l4proto tcp mark 1337 return
add rule inet istio-proxy-mangle istio-inbound iifname lo meta l4proto tcp ip saddr 127.0.0.6/32 return
add rule inet istio-proxy-mangle istio-inbound iifname lo meta l4proto tcp mark != 1338 return
"
    );
    assert_golden(&r, false, &(empty_nat("") + &mangle));
}

#[test]
fn inbound_ports_wildcard_tproxy_golden() {
    let r = Redirect {
        mode: Mode::Tproxy,
        include_inbound_ports: Selection::All,
        ..istio_test_config()
    };
    let mangle = format!(
        "add table inet istio-proxy-mangle
add chain inet istio-proxy-mangle prerouting {{ type filter hook prerouting priority -150 ; }}
add chain inet istio-proxy-mangle output {{ type route hook output priority -150 ; }}
add chain inet istio-proxy-mangle istio-divert
add chain inet istio-proxy-mangle istio-tproxy
add chain inet istio-proxy-mangle istio-inbound
add rule inet istio-proxy-mangle istio-divert meta mark set 1337
add rule inet istio-proxy-mangle istio-divert accept
add rule inet istio-proxy-mangle istio-tproxy meta l4proto tcp ip daddr != 127.0.0.1/32 tproxy ip to :15006 meta mark set 1337 accept
add rule inet istio-proxy-mangle prerouting meta l4proto tcp jump istio-inbound
add rule inet istio-proxy-mangle istio-inbound meta l4proto tcp ct state related,established jump istio-divert
add rule inet istio-proxy-mangle istio-inbound meta l4proto tcp jump istio-tproxy
{TPROXY_MARKS}
insert rule inet istio-proxy-mangle istio-inbound index 0 meta l4proto tcp mark 1337 return
insert rule inet istio-proxy-mangle istio-inbound index 1 iifname lo meta l4proto tcp ip saddr 127.0.0.6/32 return
insert rule inet istio-proxy-mangle istio-inbound index 2 iifname lo meta l4proto tcp mark != 1338 return
"
    );
    assert_golden(&r, false, &(empty_nat("") + &mangle));
}

#[test]
fn a_default_injected_pod_with_dns_capture_follows_istios_capture_all_rules() {
    let r = Redirect {
        dns_capture: true,
        ..Redirect::default()
    };
    let text = render_nft(&r, false).istio_transaction();
    let expected_in_order = [
        "add rule inet istio-proxy-nat istio-inbound meta l4proto tcp tcp dport 15020 return",
        "add rule inet istio-proxy-nat istio-inbound meta l4proto tcp jump istio-in-redirect",
        "add rule inet istio-proxy-nat istio-output tcp dport 15020 return",
        "add rule inet istio-proxy-nat istio-output udp dport 15020 return",
        "add rule inet istio-proxy-nat istio-output oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != { 53, 15008 } skuid 1337 jump istio-in-redirect",
        "add rule inet istio-proxy-nat istio-output oifname lo meta l4proto tcp tcp dport != 53 skuid 1337 return",
        "add rule inet istio-proxy-nat istio-output oifname lo meta l4proto tcp tcp dport != 53 skgid != 1337 return",
        "add rule inet istio-proxy-nat istio-output jump istio-output-dns",
        "add rule inet istio-proxy-nat istio-output-dns meta l4proto tcp tcp dport 53 redirect to :15053",
        "add rule inet istio-proxy-nat istio-output-dns udp dport 53 redirect to :15053",
        "add rule inet istio-proxy-nat istio-output ip daddr 127.0.0.1/32 return",
        "add rule inet istio-proxy-nat istio-output jump istio-redirect",
        "add rule inet istio-proxy-raw output jump istio-output-dns",
        "add rule inet istio-proxy-raw istio-output-dns udp dport 53 meta skuid 1337 ct zone set 1",
        "add rule inet istio-proxy-raw istio-output-dns udp sport 15053 meta skgid 1337 ct zone set 2",
        "add rule inet istio-proxy-raw prerouting jump istio-inbound",
        "add rule inet istio-proxy-raw istio-output-dns udp dport 53 ct zone set 2",
        "add rule inet istio-proxy-raw istio-inbound udp sport 53 ct zone set 1",
    ];
    let mut from = 0;
    for rule in expected_in_order {
        let at = text[from..]
            .find(&format!("{rule}\n"))
            .unwrap_or_else(|| panic!("missing or out of order: {rule}\n{text}"));
        from += at + rule.len();
    }
}

#[test]
fn fresh_creates_and_replacement_starts_from_nothing() {
    let capture = render_nft(&Redirect::default(), false);
    let fresh = capture.fresh();
    assert!(
        fresh.starts_with("create table inet istio-proxy-nat\n"),
        "{fresh}"
    );
    assert!(!fresh.contains("flush"), "{fresh}");
    let replacement = capture.replacement();
    assert!(
        replacement.starts_with(
            "add table inet istio-proxy-nat\ndelete table inet istio-proxy-nat\nadd table inet istio-proxy-mangle\ndelete table inet istio-proxy-mangle\nadd table inet istio-proxy-raw\ndelete table inet istio-proxy-raw\nadd table inet istio-proxy-nat\nflush table inet istio-proxy-nat\n"
        ),
        "{replacement}"
    );
}
