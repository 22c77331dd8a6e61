//! Istio's own listings (its plugin's testdata goldens, loaded into an empty
//! netns and dumped with `iptables-save`, as recorded in the project's
//! reference notes), compared rule for rule and in order.

use std::collections::BTreeMap;

use ipnetwork::IpNetwork;

use super::*;

/// `-A` lines and declared ISTIO chains per table of an `iptables-save`
/// text (indented here).
fn parse(save: &str) -> BTreeMap<String, (Vec<String>, Vec<String>)> {
    let unindented: String = save.lines().map(|line| format!("{}\n", line.trim())).collect();
    firewall::iptables::SavedTable::parse_all(&unindented)
        .into_iter()
        .map(|(name, table)| {
            let rules = table.rules.into_iter().map(|(_, line)| line).collect();
            let chains = table
                .chains
                .into_iter()
                .filter(|c| c.starts_with("ISTIO"))
                .collect();
            (name, (rules, chains))
        })
        .collect()
}

fn rendered(redirect: &Redirect, family: Family) -> BTreeMap<String, (Vec<String>, Vec<String>)> {
    tables_of(render(redirect, family))
}

/// Rules and declared chains per table, as [`parse`] gives a listing's.
fn tables_of(rules: IstioRules) -> BTreeMap<String, (Vec<String>, Vec<String>)> {
    rules
        .tables
        .into_iter()
        .map(|t| {
            (
                t.name.to_owned(),
                (t.rules, t.chains.into_iter().map(str::to_owned).collect()),
            )
        })
        .collect()
}

/// `rules` against an `iptables-save` listing: every table's chains and
/// rules in order, and no table the listing lacks.
pub(super) fn assert_listing(rules: IstioRules, golden: &str) {
    let want = parse(golden);
    let got = tables_of(rules);
    for (table, (rules, chains)) in &want {
        let (got_rules, got_chains) = got.get(table).cloned().unwrap_or_default();
        assert_eq!(&got_chains, chains, "chains of {table}");
        assert_eq!(&got_rules, rules, "rules of {table}\n got: {got_rules:#?}");
    }
    let extra: Vec<&String> = got.keys().filter(|t| !want.contains_key(*t)).collect();
    assert!(extra.is_empty(), "tables not in the golden: {extra:?}");
}

fn assert_golden(redirect: &Redirect, family: Family, golden: &str) {
    assert_listing(render(redirect, family), golden);
}

const NAT_HEADER: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:ISTIO_INBOUND - [0:0]\n:ISTIO_IN_REDIRECT - [0:0]\n:ISTIO_OUTPUT - [0:0]\n:ISTIO_REDIRECT - [0:0]\n";

/// `ISTIO_OUTPUT` of a default pod (11 rules), for an owner id pair.
fn default_output(uid: u32, gid: u32) -> String {
    format!(
        "-A ISTIO_OUTPUT -p tcp -m tcp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -p udp -m udp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m tcp ! --dport 15008 -m owner --uid-owner {uid} -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner {uid} -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner {uid} -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m tcp ! --dport 15008 -m owner --gid-owner {gid} -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner {gid} -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner {gid} -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
"
    )
}

fn basic(uid: u32, gid: u32) -> String {
    format!(
        "{NAT_HEADER}-A PREROUTING -p tcp -j ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp -m tcp --dport 15008 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15020 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15021 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15090 -j RETURN
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
{}-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
COMMIT
",
        default_output(uid, gid)
    )
}

fn nets(list: &[&str]) -> Vec<IpNetwork> {
    list.iter().map(|s| s.parse().expect("cidr")).collect()
}

#[test]
fn default_redirect_basic_golden() {
    assert_golden(&Redirect::default(), Family::V4, &basic(1337, 1337));
}

#[test]
fn custom_uid_and_gid_golden() {
    let r = Redirect {
        proxy_uid: 1000670000,
        proxy_gid: 1000670001,
        ..Redirect::default()
    };
    assert_golden(&r, Family::V4, &basic(1000670000, 1000670001));
}

#[test]
fn tproxy_golden() {
    let golden = format!(
        "*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:ISTIO_DIVERT - [0:0]
:ISTIO_INBOUND - [0:0]
:ISTIO_TPROXY - [0:0]
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A PREROUTING -p tcp -m mark --mark 0x539 -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A OUTPUT -o lo -p tcp -m mark --mark 0x539 -j RETURN
-A OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m owner --uid-owner 1337 -j MARK --set-xmark 0x53a/0xffffffff
-A OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m owner --gid-owner 1337 -j MARK --set-xmark 0x53a/0xffffffff
-A OUTPUT -p tcp -m connmark --mark 0x539 -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A ISTIO_DIVERT -j MARK --set-xmark 0x539/0xffffffff
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_INBOUND -p tcp -m mark --mark 0x539 -j RETURN
-A ISTIO_INBOUND -s 127.0.0.6/32 -i lo -p tcp -j RETURN
-A ISTIO_INBOUND -i lo -p tcp -m mark ! --mark 0x53a -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15020 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15021 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15090 -j RETURN
-A ISTIO_INBOUND -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp -j ISTIO_TPROXY
-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --on-port 15006 --on-ip 0.0.0.0 --tproxy-mark 0x539/0xffffffff
COMMIT
{NAT_HEADER}-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp -m tcp --dport 15008 -j RETURN
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
{}-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
COMMIT
",
        default_output(1337, 1337)
    );
    assert_golden(
        &Redirect {
            mode: Mode::Tproxy,
            ..Redirect::default()
        },
        Family::V4,
        &golden,
    );
}

#[test]
fn tproxy_in_ipv6_uses_v6_addresses() {
    let rules = render(
        &Redirect {
            mode: Mode::Tproxy,
            ..Redirect::default()
        },
        Family::V6,
    );
    let mangle: Vec<&str> = rules
        .lines()
        .filter(|(t, _)| *t == "mangle")
        .map(|(_, r)| r)
        .collect();
    assert!(mangle.contains(&"-A ISTIO_TPROXY ! -d ::1/128 -p tcp -j TPROXY --on-port 15006 --on-ip :: --tproxy-mark 0x539/0xffffffff"));
    assert!(mangle.contains(&"-A ISTIO_INBOUND -s ::6/128 -i lo -p tcp -j RETURN"));
}

#[test]
fn loopback_include_and_exclude_cidrs_golden() {
    let r = Redirect {
        include_cidrs: Selection::Only(nets(&["127.0.0.0/8"])),
        exclude_cidrs: nets(&["10.0.0.0/8"]),
        ..Redirect::default()
    };
    let output = "-A ISTIO_OUTPUT -p tcp -m tcp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -p udp -m udp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
-A ISTIO_OUTPUT -d 10.0.0.0/8 -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.0/8 -j ISTIO_REDIRECT
";
    let golden = basic(1337, 1337).replace(&default_output(1337, 1337), output);
    assert_golden(&r, Family::V4, &golden);
}

#[test]
fn include_cidr_list_golden() {
    let r = Redirect {
        include_cidrs: Selection::Only(nets(&["10.0.0.0/8", "172.16.0.0/12"])),
        ..Redirect::default()
    };
    let golden = basic(1337, 1337).replace(
        "-A ISTIO_OUTPUT -j ISTIO_REDIRECT\n",
        "-A ISTIO_OUTPUT -d 10.0.0.0/8 -j ISTIO_REDIRECT\n-A ISTIO_OUTPUT -d 172.16.0.0/12 -j ISTIO_REDIRECT\n",
    );
    assert_golden(&r, Family::V4, &golden);
    let v6 = rendered(&r, Family::V6);
    assert!(
        !v6["nat"]
            .0
            .iter()
            .any(|l| l.ends_with("-j ISTIO_REDIRECT") && l.starts_with("-A ISTIO_OUTPUT")),
        "a family without include CIDRs gets no outbound capture"
    );
}

#[test]
fn excluded_cidrs_and_ports_golden() {
    let r = Redirect {
        exclude_cidrs: nets(&["10.96.0.0/12", "169.254.169.254/32"]),
        exclude_outbound_ports: vec![3306, 6379],
        exclude_inbound_ports: vec![8081, 15020, 15021, 15090],
        ..Redirect::default()
    };
    let golden = format!(
        "{NAT_HEADER}-A PREROUTING -p tcp -j ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp -m tcp --dport 15008 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 8081 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15020 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15021 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15090 -j RETURN
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT -p tcp -m tcp --dport 3306 -j RETURN
-A ISTIO_OUTPUT -p udp -m udp --dport 3306 -j RETURN
-A ISTIO_OUTPUT -p tcp -m tcp --dport 6379 -j RETURN
-A ISTIO_OUTPUT -p udp -m udp --dport 6379 -j RETURN
-A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
-A ISTIO_OUTPUT -d 10.96.0.0/12 -j RETURN
-A ISTIO_OUTPUT -d 169.254.169.254/32 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
COMMIT
"
    );
    assert_golden(&r, Family::V4, &golden);
}

#[test]
fn explicit_inbound_ports_golden() {
    let r = Redirect {
        include_inbound_ports: Selection::Only(vec![1111, 2222]),
        exclude_inbound_ports: vec![3333, 4444, 15020, 15021, 15090],
        exclude_outbound_ports: vec![5555, 6666],
        ..Redirect::default()
    };
    let nat = &rendered(&r, Family::V4)["nat"].0;
    let inbound: Vec<&str> = nat
        .iter()
        .filter(|l| l.starts_with("-A ISTIO_INBOUND"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        inbound,
        [
            "-A ISTIO_INBOUND -p tcp -m tcp --dport 15008 -j RETURN",
            "-A ISTIO_INBOUND -p tcp -m tcp --dport 1111 -j ISTIO_IN_REDIRECT",
            "-A ISTIO_INBOUND -p tcp -m tcp --dport 2222 -j ISTIO_IN_REDIRECT",
        ]
    );
    let output: Vec<&str> = nat
        .iter()
        .filter(|l| l.starts_with("-A ISTIO_OUTPUT"))
        .map(String::as_str)
        .take(4)
        .collect();
    assert_eq!(
        output,
        [
            "-A ISTIO_OUTPUT -p tcp -m tcp --dport 5555 -j RETURN",
            "-A ISTIO_OUTPUT -p udp -m udp --dport 5555 -j RETURN",
            "-A ISTIO_OUTPUT -p tcp -m tcp --dport 6666 -j RETURN",
            "-A ISTIO_OUTPUT -p udp -m udp --dport 6666 -j RETURN",
        ]
    );
}

#[test]
fn no_inbound_capture_golden() {
    let r = Redirect {
        include_inbound_ports: Selection::Only(vec![]),
        ..Redirect::default()
    };
    let golden = format!(
        "{NAT_HEADER}-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp -m tcp --dport 15008 -j RETURN
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
{}-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
COMMIT
",
        default_output(1337, 1337)
    );
    assert_golden(&r, Family::V4, &golden);
}

#[test]
fn tproxy_without_inbound_keeps_the_unreferenced_mangle_block() {
    let r = Redirect {
        mode: Mode::Tproxy,
        include_inbound_ports: Selection::Only(vec![]),
        ..Redirect::default()
    };
    let mangle = render(&r, Family::V4)
        .tables
        .into_iter()
        .find(|t| t.name == "mangle")
        .expect("mangle");
    assert_eq!(mangle.chains, ["ISTIO_INBOUND"]);
    assert_eq!(
        mangle.rules,
        [
            "-A PREROUTING -p tcp -m mark --mark 0x539 -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff",
            "-A OUTPUT -o lo -p tcp -m mark --mark 0x539 -j RETURN",
            "-A OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m owner --uid-owner 1337 -j MARK --set-xmark 0x53a/0xffffffff",
            "-A OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m owner --gid-owner 1337 -j MARK --set-xmark 0x53a/0xffffffff",
            "-A OUTPUT -p tcp -m connmark --mark 0x539 -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
            "-A ISTIO_INBOUND -p tcp -m mark --mark 0x539 -j RETURN",
            "-A ISTIO_INBOUND -s 127.0.0.6/32 -i lo -p tcp -j RETURN",
            "-A ISTIO_INBOUND -i lo -p tcp -m mark ! --mark 0x53a -j RETURN",
        ]
    );
}

#[test]
fn dns_capture_golden() {
    let golden = String::from(
        "*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:ISTIO_INBOUND - [0:0]
:ISTIO_OUTPUT_DNS - [0:0]
-A PREROUTING -j ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_INBOUND -p udp -m udp --sport 53 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp -m udp --dport 53 -m owner --uid-owner 1337 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp -m udp --sport 15053 -m owner --uid-owner 1337 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp -m udp --dport 53 -m owner --gid-owner 1337 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp -m udp --sport 15053 -m owner --gid-owner 1337 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp -m udp --dport 53 -j CT --zone 2
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:ISTIO_INBOUND - [0:0]
:ISTIO_IN_REDIRECT - [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_OUTPUT_DNS - [0:0]
:ISTIO_REDIRECT - [0:0]
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp -m tcp --dport 15008 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15020 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15021 -j RETURN
-A ISTIO_INBOUND -p tcp -m tcp --dport 15090 -j RETURN
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT -p tcp -m tcp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -p udp -m udp --dport 15020 -j RETURN
-A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp -m tcp ! --dport 53 -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp -m tcp ! --dport 53 -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
-A ISTIO_OUTPUT_DNS -p tcp -m tcp --dport 53 -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT_DNS -p udp -m udp --dport 53 -j REDIRECT --to-ports 15053
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
COMMIT
"
    );
    assert_golden(
        &Redirect {
            dns_capture: true,
            ..Redirect::default()
        },
        Family::V4,
        &golden,
    );
}

#[test]
fn ipv6_default_golden() {
    let golden = basic(1337, 1337)
        .replace("127.0.0.6/32", "::6/128")
        .replace("127.0.0.1/32", "::1/128");
    assert_golden(&Redirect::default(), Family::V6, &golden);
}

#[test]
fn invalid_drop_golden() {
    let golden = format!(
        "*mangle
:PREROUTING ACCEPT [0:0]
:ISTIO_DROP - [0:0]
-A PREROUTING -m conntrack --ctstate INVALID -j ISTIO_DROP
-A ISTIO_DROP -j DROP
COMMIT
{}",
        basic(1337, 1337)
    );
    assert_golden(
        &Redirect {
            invalid_drop: true,
            ..Redirect::default()
        },
        Family::V4,
        &golden,
    );
}

#[test]
fn excluded_interfaces_come_first() {
    let r = Redirect {
        exclude_interfaces: vec!["not-istio-nic".into()],
        ..Redirect::default()
    };
    let nat = &rendered(&r, Family::V4)["nat"].0;
    assert_eq!(
        &nat[..4],
        [
            "-A PREROUTING -i not-istio-nic -j RETURN",
            "-A PREROUTING -p tcp -j ISTIO_INBOUND",
            "-A OUTPUT -o not-istio-nic -j RETURN",
            "-A OUTPUT -j ISTIO_OUTPUT",
        ]
    );
}

#[test]
fn rerouted_interfaces_are_inserted_in_istios_order() {
    let r = Redirect {
        include_cidrs: Selection::Only(nets(&["10.0.0.0/8"])),
        reroute_interfaces: vec!["eth1".into(), "eth2".into()],
        ..Redirect::default()
    };
    let nat = &rendered(&r, Family::V4)["nat"].0;
    assert_eq!(
        &nat[..5],
        [
            "-A PREROUTING -d 10.0.0.0/8 -i eth2 -j ISTIO_REDIRECT",
            "-A PREROUTING -d 10.0.0.0/8 -i eth1 -j ISTIO_REDIRECT",
            "-A PREROUTING -i eth2 -j RETURN",
            "-A PREROUTING -i eth1 -j RETURN",
            "-A PREROUTING -p tcp -j ISTIO_INBOUND",
        ]
    );
    let all = Redirect {
        reroute_interfaces: vec!["eth1".into()],
        ..Redirect::default()
    };
    assert_eq!(
        rendered(&all, Family::V4)["nat"].0[0],
        "-A PREROUTING -i eth1 -j ISTIO_REDIRECT"
    );
}

#[test]
fn fresh_restore_creates_chains_with_dash_n() {
    let text = render(&Redirect::default(), Family::V4).restore_fresh();
    assert!(text.starts_with(
        "*nat\n-N ISTIO_INBOUND\n-N ISTIO_IN_REDIRECT\n-N ISTIO_OUTPUT\n-N ISTIO_REDIRECT\n-A PREROUTING"
    ));
    assert!(text.ends_with("COMMIT\n"));
}
