//! One namespace's policy of 5000 address-block rules, and a change
//! elsewhere: the change is the same transaction it is without them (no
//! op of it touches their sets or chain), so its cost does not grow with
//! them, and the pod it isolates refuses a connection from its first SYN.
//! Under `nft` 1.0.6 each transaction read every interval set first: 6 to
//! 8 s a change at 3000 such rules.

use std::time::Instant;

use netpol::model::{Peer, PodView, Policy, PortSpec, Protocol, Rule};
use netpol::{Compiled, Snapshot};

use crate::kernel::{Cluster, DB_PORT, app, deny_all};

const RULES: usize = 5000;

/// `noisy` pods take connections from 5000 address blocks, each a /24
/// less one address, on a port of its own.
fn noisy_blocks() -> Policy {
    let rules = (0..RULES)
        .map(|i| {
            let (high, low) = (100 + i / 256, i % 256);
            Rule {
                peers: Some(vec![Peer::Block {
                    cidr: format!("10.{high}.{low}.0/24").parse().expect("a CIDR"),
                    except: vec![format!("10.{high}.{low}.7/32").parse().expect("a CIDR")],
                }]),
                ports: vec![PortSpec::Range(
                    Protocol::Tcp,
                    10_000 + u16::try_from(i).expect("fits"),
                    10_000 + u16::try_from(i).expect("fits"),
                )],
            }
        })
        .collect();
    Policy {
        namespace: "shop".into(),
        name: "noisy".into(),
        pod_selector: app("noisy"),
        ingress: Some(rules),
        egress: None,
    }
}

/// The cluster's pods with db moved to namespace `quiet`.
fn with_db_in_quiet(cluster: &Cluster, policies: Vec<Policy>) -> Compiled {
    let pods: Vec<PodView> = cluster
        .pods
        .iter()
        .map(|(_, view)| {
            let mut view = view.clone();
            if view.name == "db" {
                view.namespace = "quiet".into();
            }
            view
        })
        .collect();
    netpol::compile(
        &Snapshot {
            pods,
            namespaces: vec![],
            policies,
        },
        "n1",
    )
}

fn quiet_deny() -> Policy {
    Policy {
        namespace: "quiet".into(),
        ..deny_all(true, false)
    }
}

#[test]
fn five_thousand_block_rules_in_one_namespace_leave_a_change_elsewhere_as_it_is_without_them() {
    test_kit::require_root();
    let cluster = Cluster::new(&[("web", "web"), ("db", "db"), ("noisy", "noisy")]);
    let _db = cluster.listen("db");
    let _noisy = cluster.listen("noisy");

    let started = Instant::now();
    let before = with_db_in_quiet(&cluster, vec![noisy_blocks()]);
    let (_, ops) = cluster
        .on_node(|| netpol::apply(&before))
        .expect("the 5000 rules");
    eprintln!("5000 block rules: {} ops in {:?}", ops.len(), started.elapsed());
    let blocks = before
        .peer_sets
        .keys()
        .filter(|s| s.starts_with("blocks-"))
        .count();
    assert_eq!(blocks, RULES, "a set for each rule's block");
    assert!(
        !cluster.connects("web", "noisy", DB_PORT, false),
        "web is in no block"
    );

    // The change elsewhere: db's namespace denies all ingress.
    let after = with_db_in_quiet(&cluster, vec![noisy_blocks(), quiet_deny()]);
    let change = netpol::nft::plan(&netpol::Current::held_after(&before), &after);
    let alone = netpol::nft::plan(
        &netpol::Current::held_after(&with_db_in_quiet(&cluster, vec![])),
        &with_db_in_quiet(&cluster, vec![quiet_deny()]),
    );
    let shown =
        |ops: &[firewall::ruleset::Op]| -> Vec<String> { ops.iter().map(ToString::to_string).collect() };
    // The guarded namespaces differ by shop, whose policy is only in one.
    let without_guarded = |ops: &[firewall::ruleset::Op]| -> Vec<String> {
        shown(ops)
            .into_iter()
            .filter(|op| !op.contains("guarded-namespaces"))
            .collect()
    };
    assert_eq!(
        without_guarded(&change),
        without_guarded(&alone),
        "the same ops with and without the 5000 rules"
    );
    let started = Instant::now();
    let (_, ops) = cluster
        .on_node(|| netpol::apply_after(&before, &after))
        .expect("the change");
    eprintln!(
        "the change beside them: {} ops in {:?}",
        ops.len(),
        started.elapsed()
    );
    assert_eq!(shown(&ops), shown(&change));
    for v6 in [false, true] {
        assert!(
            !cluster.connects("web", "db", DB_PORT, v6),
            "refused from its first SYN (v6: {v6})"
        );
    }
    assert!(
        !cluster.connects("web", "noisy", DB_PORT, false),
        "noisy as it was"
    );

    // What the kernel holds is what the passes assumed, read back whole.
    let started = Instant::now();
    let held = cluster.on_node(netpol::current).expect("read the table");
    eprintln!("reading the table back: {:?}", started.elapsed());
    assert!(held.holds(&after));

    // The 5000 rules lifted: their set goes whole, no interval one by one
    // (deleting 10,000 of them from a shared set held the node's
    // nf_tables for 5 to 7 s).
    let lifted = with_db_in_quiet(&cluster, vec![quiet_deny()]);
    let started = Instant::now();
    let (_, ops) = cluster
        .on_node(|| netpol::apply_after(&after, &lifted))
        .expect("the lift");
    eprintln!(
        "the 5000 rules lifted: {} ops in {:?}",
        ops.len(),
        started.elapsed()
    );
    assert!(
        !ops.iter()
            .any(|op| matches!(op, firewall::ruleset::Op::DeleteElements { set, .. } if set.name.starts_with("blocks-"))),
        "{:?}",
        shown(&ops)
    );
    assert!(shown(&ops).iter().any(|op| op.starts_with("delete set blocks-")));
    assert!(
        cluster
            .on_node(netpol::current)
            .expect("read the table")
            .holds(&lifted)
    );
    assert!(
        cluster.connects("web", "noisy", DB_PORT, false),
        "noisy open again"
    );
    assert!(!cluster.connects("web", "db", DB_PORT, false), "db still refused");
    cluster.on_node(netpol::remove).expect("remove");
}
