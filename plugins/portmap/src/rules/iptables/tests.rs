use super::*;

fn mapping(host_port: u16, container_port: u16, protocol: Protocol, host_ip: Option<&str>) -> Mapping {
    Mapping {
        host_port,
        container_port,
        protocol,
        host_ip: host_ip.map(|ip| ip.parse().expect("ip")),
    }
}

fn pod(address: &str) -> Pod<'static> {
    Pod {
        network: "kind",
        container_id: "abc",
        address: address.parse().expect("address"),
    }
}

/// Debian's portmap 1.1.1, run with these mappings for container `abc` of
/// network `kind` at 10.244.0.5/24, left this in `iptables-save -t nat`.
const REFERENCE_V4: &str = r#"*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:CNI-DN-38ea5875bb7798993064a - [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
:CNI-HOSTPORT-MASQ - [0:0]
:CNI-HOSTPORT-SETMARK - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A POSTROUTING -m comment --comment "CNI portfwd requiring masquerade" -j CNI-HOSTPORT-MASQ
-A CNI-DN-38ea5875bb7798993064a -s 10.244.0.0/24 -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-38ea5875bb7798993064a -s 127.0.0.1/32 -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-38ea5875bb7798993064a -p tcp -m tcp --dport 8080 -j DNAT --to-destination 10.244.0.5:80
-A CNI-DN-38ea5875bb7798993064a -s 10.244.0.0/24 -d 10.0.0.1/32 -p udp -m udp --dport 8081 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-38ea5875bb7798993064a -s 127.0.0.1/32 -d 10.0.0.1/32 -p udp -m udp --dport 8081 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-38ea5875bb7798993064a -d 10.0.0.1/32 -p udp -m udp --dport 8081 -j DNAT --to-destination 10.244.0.5:81
-A CNI-DN-38ea5875bb7798993064a -s 10.244.0.0/24 -p tcp -m tcp --dport 9090 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-38ea5875bb7798993064a -s 127.0.0.1/32 -p tcp -m tcp --dport 9090 -j CNI-HOSTPORT-SETMARK
-A CNI-DN-38ea5875bb7798993064a -p tcp -m tcp --dport 9090 -j DNAT --to-destination 10.244.0.5:90
-A CNI-HOSTPORT-DNAT -p tcp -m comment --comment "dnat name: \"kind\" id: \"abc\"" -m multiport --dports 8080,9090 -j CNI-DN-38ea5875bb7798993064a
-A CNI-HOSTPORT-DNAT -p udp -m comment --comment "dnat name: \"kind\" id: \"abc\"" -m multiport --dports 8081 -j CNI-DN-38ea5875bb7798993064a
-A CNI-HOSTPORT-MASQ -m mark --mark 0x2000/0x2000 -j MASQUERADE
-A CNI-HOSTPORT-SETMARK -m comment --comment "CNI portfwd masquerade mark" -j MARK --set-xmark 0x2000/0x2000
COMMIT
"#;

fn reference_mappings() -> Vec<Mapping> {
    vec![
        mapping(8080, 80, Protocol::Tcp, None),
        mapping(8081, 81, Protocol::Udp, Some("10.0.0.1")),
        mapping(9090, 90, Protocol::Tcp, None),
    ]
}

#[test]
fn every_rule_is_rendered_as_the_reference_leaves_it() {
    let settings = Settings::default();
    let pod = pod("10.244.0.5/24");
    let mappings = reference_mappings();
    let table = SavedTable::parse(REFERENCE_V4, "nat");
    let present = Present::read(&table, &settings, &container_chain("kind", "abc"));
    assert!(present.dnat_chain && present.prerouting_jump && present.output_jump);
    assert!(present.setmark_rule && present.masq_rule && present.masq_jump);
    assert_eq!(present.container_jumps.len(), 2);
    assert!(missing(&table, &pod, &settings, &mappings).is_empty());
    let input = render_add(&Present::default(), &pod, &settings, &mappings);
    let input = input.replace("-I POSTROUTING 1 ", "-A POSTROUTING ");
    let written: BTreeSet<&str> = input.lines().filter(|l| l.starts_with("-A ")).collect();
    let reference: BTreeSet<&str> = REFERENCE_V4.lines().filter(|l| l.starts_with("-A ")).collect();
    assert_eq!(written, reference);
}

#[test]
fn a_repeated_add_replaces_the_pods_jumps_and_adds_nothing_shared() {
    let settings = Settings::default();
    let pod = pod("10.244.0.5/24");
    let table = SavedTable::parse(REFERENCE_V4, "nat");
    let present = Present::read(&table, &settings, &container_chain("kind", "abc"));
    let input = render_add(
        &present,
        &pod,
        &settings,
        &[mapping(8080, 80, Protocol::Tcp, None)],
    );
    assert_eq!(
        input
            .lines()
            .filter(|l| l.starts_with("-D CNI-HOSTPORT-DNAT"))
            .count(),
        2
    );
    assert!(!input.contains("-N "));
    assert!(!input.contains("PREROUTING") && !input.contains("POSTROUTING"));
    assert_eq!(
        input
            .lines()
            .filter(|l| l.starts_with("-A CNI-HOSTPORT-DNAT"))
            .count(),
        1
    );
}

#[test]
fn removal_finds_every_jump_and_the_forwards_of_a_pod() {
    let table = SavedTable::parse(REFERENCE_V4, "nat");
    let input = render_remove(&table, "kind", "abc").expect("something to remove");
    assert_eq!(input.lines().filter(|l| l.starts_with("-D ")).count(), 2);
    assert!(input.contains("-X CNI-DN-38ea5875bb7798993064a\n"));
    assert_eq!(render_remove(&table, "kind", "other"), None);
    let forwards = forwards_in(&table, &container_chain("kind", "abc"));
    assert_eq!(forwards.len(), 3);
    assert_eq!(forwards[1].protocol, Protocol::Udp);
    assert_eq!((forwards[1].host_port, forwards[1].pod_port), (8081, 81));
    assert_eq!(chains_of(&table, "kind").len(), 1);
    assert!(chains_of(&table, "kin").is_empty());
    let known = render_remove_known(
        Family::V4,
        &Settings::default(),
        "kind",
        "abc",
        &reference_mappings(),
    );
    let deleted: BTreeSet<String> = known
        .lines()
        .filter(|l| l.starts_with("-D "))
        .map(|l| l.replacen("-D ", "-A ", 1))
        .collect();
    let reference: BTreeSet<String> = table
        .jumps_from(DNAT_CHAIN, &container_chain("kind", "abc"))
        .map(str::to_owned)
        .collect();
    assert_eq!(deleted, reference);
}

#[test]
fn ipv6_has_no_localhost_rule_and_skips_ipv4_host_ips() {
    let pod = pod("fd00::5/64");
    let rules = chain_rules(&pod, &Settings::default(), &reference_mappings());
    assert_eq!(rules.len(), 4);
    assert!(rules[0].contains("-s fd00::/64 -p tcp"));
    assert!(rules[1].ends_with("-j DNAT --to-destination [fd00::5]:80"));
    // The jumps still name every protocol, as the reference's do.
    assert_eq!(
        jump_rules(
            Family::V6,
            &Settings::default(),
            "kind",
            "abc",
            &reference_mappings()
        )
        .len(),
        2
    );
}

#[test]
fn settings_change_the_marks_and_the_sources() {
    let pod = pod("10.244.0.5/24");
    let one = [mapping(80, 8080, Protocol::Tcp, Some("0.0.0.0"))];
    let external = Settings {
        external_set_mark_chain: Some("KUBE-MARK-MASQ".into()),
        ..Settings::default()
    };
    let input = render_add(&Present::default(), &pod, &external, &one);
    assert!(input.contains("-j KUBE-MARK-MASQ") && !input.contains(SETMARK_CHAIN));
    assert!(!input.contains(" -d "), "0.0.0.0 is no destination");
    let masq_all = Settings {
        masq_all: true,
        mark_bit: 0,
        ..Settings::default()
    };
    let rules = chain_rules(&pod, &masq_all, &one);
    assert_eq!(rules.len(), 2);
    assert!(!rules[0].contains(" -s "));
    assert_eq!(
        masq_rule(&masq_all),
        "-A CNI-HOSTPORT-MASQ -m mark --mark 0x1/0x1 -j MASQUERADE"
    );
    let no_snat = Settings {
        snat: false,
        ..Settings::default()
    };
    let input = render_add(&Present::default(), &pod, &no_snat, &one);
    assert!(!input.contains("MASQ") && !input.contains("SETMARK"));
}

#[test]
fn ports_go_fifteen_to_a_rule_with_conditions_kept_whole() {
    let many: Vec<Mapping> = (1..=16).map(|p| mapping(p, p, Protocol::Sctp, None)).collect();
    let settings = Settings {
        conditions_v4: vec![
            "-m".into(),
            "comment".into(),
            "--comment".into(),
            "two words".into(),
        ],
        ..Settings::default()
    };
    let jumps = jump_rules(Family::V4, &settings, "kind", "abc", &many);
    assert_eq!(jumps.len(), 2);
    assert!(
        jumps[0]
            .contains("--dports 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 -m comment --comment \"two words\" -j")
    );
    assert!(jumps[1].contains("-p sctp") && jumps[1].contains("--dports 16 "));
}

#[test]
fn chain_names_and_long_comments_are_the_references() {
    assert_eq!(container_chain("kind", "abc"), "CNI-DN-38ea5875bb7798993064a");
    let long = "x".repeat(300);
    let text = comment("kind", &long);
    assert_eq!(text.len(), 256);
    assert!(text.ends_with("..."));
}
