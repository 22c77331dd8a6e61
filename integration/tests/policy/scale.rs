//! A policy touching a thousand pods: as peers (a few real, the rest
//! addresses nobody holds, in the pods' subnet and others), and as the
//! local pods it selects. One transaction applies it, the kernel holds
//! one set element per address, real connections are judged by it, and
//! a pod coming or going is one element per set, not a rebuild.

use std::net::IpAddr;
use std::time::Instant;

use netpol::model::{PodView, Policy};
use netpol::{Compiled, Snapshot};
use serde_json::Value;

use crate::kernel::{Cluster, DB_PORT, db_from_web};

const PEERS: usize = 1000;

/// A pod of the snapshot only: labelled `app`, on `node`, at `ips`.
fn paper_pod(name: String, app: &str, node: &str, ips: Vec<IpAddr>) -> PodView {
    PodView {
        namespace: "shop".into(),
        name,
        node: Some(node.into()),
        labels: [("app".to_owned(), app.to_owned())].into(),
        ips,
        ports: vec![],
    }
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

/// The `i`th paper peer's addresses: the first 150 in the real pods'
/// subnets (above what host-local hands out here), the rest in subnets
/// no pod is in.
fn peer_ips(i: usize) -> Vec<IpAddr> {
    if i < 150 {
        vec![ip(&format!("10.77.0.{}", 100 + i)), ip(&format!("fd77::1:{i:x}"))]
    } else {
        let (high, low) = (i / 200, i % 200 + 1);
        vec![
            ip(&format!("10.88.{high}.{low}")),
            ip(&format!("fd88::{high:x}:{low:x}")),
        ]
    }
}

/// The local paper pods' addresses, in yet another subnet.
fn local_ips(i: usize) -> Vec<IpAddr> {
    let (high, low) = (i / 200, i % 200 + 1);
    vec![
        ip(&format!("10.99.{high}.{low}")),
        ip(&format!("fd99::{high:x}:{low:x}")),
    ]
}

/// How many elements the set or map `name` of the policy's table holds.
fn elements(cluster: &Cluster, kind: &str, name: &str) -> usize {
    let listed = cluster.nft(&["-j", "list", kind, "inet", netpol::TABLE, name]);
    let doc: Value = serde_json::from_str(&listed).expect("nft's JSON");
    doc["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item.get(kind))
        .map(|set| set["elem"].as_array().map_or(0, Vec::len))
        .sum()
}

fn compile(pods: &[PodView], policies: Vec<Policy>) -> Compiled {
    let snapshot = Snapshot {
        pods: pods.to_vec(),
        namespaces: vec![],
        policies,
    };
    netpol::compile(&snapshot, "n1")
}

/// The ops of the transaction, a line each.
fn apply_timed(cluster: &Cluster, compiled: &Compiled, what: &str) -> String {
    let started = Instant::now();
    let (_, ops) = cluster.on_node(|| netpol::apply(compiled)).expect("apply");
    eprintln!("{what}: applied in {:?} ({} ops)", started.elapsed(), ops.len());
    ops.iter().map(|op| format!("{op}\n")).collect()
}

/// A self set's element: the address twice.
fn pair(ip: std::net::IpAddr) -> firewall::ruleset::Element {
    use firewall::ruleset::{Element, Value};
    Element::key(Value::concat(&[Value::address(ip), Value::address(ip)]))
}

#[test]
fn a_policy_over_a_thousand_pods_is_one_transaction_and_a_pod_more_or_less_is_one_element() {
    test_kit::require_root();
    let cluster = Cluster::new(&[("web", "web"), ("web2", "web"), ("db", "db"), ("other", "other")]);
    let _db = cluster.listen("db");
    let _web = cluster.listen("web");
    let mut pods: Vec<PodView> = cluster.pods.iter().map(|(_, view)| view.clone()).collect();
    let real_peers = pods.iter().filter(|p| p.labels["app"] == "web").count();
    for i in 0..PEERS - real_peers {
        pods.push(paper_pod(format!("web-{i}"), "web", "n2", peer_ips(i)));
    }

    // Peers: db takes web's thousand.
    let compiled = compile(&pods, vec![db_from_web()]);
    // One rule's peers, in the shared sets of pods' addresses.
    let set = "peers";
    assert_eq!(compiled.peer_sets.len(), 1, "{:?}", compiled.peer_sets.keys());
    assert!(!apply_timed(&cluster, &compiled, "1000 peers").is_empty());
    for family in ["v4", "v6"] {
        assert_eq!(
            elements(&cluster, "set", &format!("{set}-{family}")),
            PEERS,
            "{set}-{family}"
        );
    }
    for v6 in [false, true] {
        assert!(cluster.connects("web", "db", DB_PORT, v6), "web (v6: {v6})");
        assert!(cluster.connects("web2", "db", DB_PORT, v6), "web2 (v6: {v6})");
        assert!(!cluster.connects("other", "db", DB_PORT, v6), "other (v6: {v6})");
    }
    assert!(cluster.connects("other", "web", DB_PORT, false), "web is open");

    // One peer more: one element, planned against what the kernel holds.
    pods.push(paper_pod("web-new".into(), "web", "n2", vec![ip("10.88.200.1")]));
    let compiled = compile(&pods, vec![db_from_web()]);
    let script = apply_timed(&cluster, &compiled, "a peer more");
    // The address beside the rule's tag: 10.88.200.1 is 0a58c801.
    assert_eq!(script.lines().count(), 1, "{script}");
    assert!(script.starts_with("add element peers-v4 { 0a58c801"), "{script}");
    assert_eq!(elements(&cluster, "set", &format!("{set}-v4")), PEERS + 1);
    assert_eq!(elements(&cluster, "set", &format!("{set}-v6")), PEERS);
    assert_eq!(
        apply_timed(&cluster, &compiled, "again"),
        "",
        "nothing left to do"
    );

    // Selected: a thousand local pods are db (the real one among them).
    for i in 0..PEERS - 1 {
        pods.push(paper_pod(format!("db-{i}"), "db", "n1", local_ips(i)));
    }
    let compiled = compile(&pods, vec![db_from_web()]);
    assert_eq!(compiled.lists.len(), 1, "one list for all of them");
    apply_timed(&cluster, &compiled, "1000 local pods selected");
    for family in ["v4", "v6"] {
        assert_eq!(elements(&cluster, "map", &format!("ingress-{family}")), PEERS);
        assert_eq!(elements(&cluster, "set", &format!("self-{family}")), PEERS);
    }
    assert!(cluster.connects("web", "db", DB_PORT, false));
    assert!(!cluster.connects("other", "db", DB_PORT, false));
    assert!(!cluster.connects("other", "db", DB_PORT, true));
    // One of them gone: its address leaves each map and self set.
    let gone = pods.pop().expect("a paper db");
    let compiled = compile(&pods, vec![db_from_web()]);
    let script = apply_timed(&cluster, &compiled, "a local pod less");
    let mut lines: Vec<&str> = script.lines().collect();
    lines.sort_unstable();
    let (v4, v6) = (gone.ips[0], gone.ips[1]);
    assert_eq!(
        lines,
        [
            format!("delete element ingress-v4 {{ {v4} }}"),
            format!("delete element ingress-v6 {{ {v6} }}"),
            format!("delete element self-v4 {{ {} }}", pair(v4)),
            format!("delete element self-v6 {{ {} }}", pair(v6)),
        ],
        "{script}"
    );
    assert_eq!(elements(&cluster, "map", "ingress-v4"), PEERS - 1);

    // The policy gone: no chain, no set, no map entry of it; then the
    // table with it.
    apply_timed(&cluster, &compile(&pods, vec![]), "the policy gone");
    let table = cluster.nft(&["list", "table", "inet", netpol::TABLE]);
    assert!(!table.contains("chain in-"), "{table}");
    assert_eq!(elements(&cluster, "set", "peers-v4"), 0, "{table}");
    for family in ["v4", "v6"] {
        assert_eq!(elements(&cluster, "map", &format!("ingress-{family}")), 0);
        assert_eq!(elements(&cluster, "set", &format!("self-{family}")), 0);
    }
    assert!(cluster.connects("other", "db", DB_PORT, false), "open again");
    cluster.on_node(netpol::remove).expect("remove");
    assert!(!cluster.nft(&["list", "tables"]).contains(netpol::TABLE));
}
