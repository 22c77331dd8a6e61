use super::*;
use crate::compile::{Snapshot, compile};
use crate::model::{Peer, PodView, Policy, PortSpec, Protocol, Rule, Selector};
use crate::nft::plan;

fn pod(name: &str, ip: &str, app: &str) -> PodView {
    PodView {
        namespace: "a".into(),
        name: name.into(),
        node: Some("n1".into()),
        labels: [("app".to_owned(), app.to_owned())].into(),
        ips: vec![ip.parse().expect("test data parses")],
        ports: vec![],
    }
}

/// The db pods take web's connections on 5432.
fn compiled(pods: Vec<PodView>) -> Compiled {
    let policy = Policy {
        namespace: "a".into(),
        name: "db".into(),
        pod_selector: Selector::labels(&[("app", "db")]),
        ingress: Some(vec![Rule {
            peers: Some(vec![Peer::Pods {
                pods: Some(Selector::labels(&[("app", "web")])),
                namespaces: None,
            }]),
            ports: vec![PortSpec::Range(Protocol::Tcp, 5432, 5432)],
        }]),
        egress: None,
    };
    compile(
        &Snapshot {
            pods,
            namespaces: vec![],
            policies: vec![policy],
        },
        "n1",
    )
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("test data parses")
}

/// What the agent's pass would find narrowed going from `before` (held
/// as written) to `after`.
fn narrowed_from(before: &Compiled, after: &Compiled) -> Narrowed {
    let held = Current::held_after(before);
    narrowed(&held, after, &plan(&held, after))
}

#[test]
fn nothing_changed_narrows_nothing() {
    let both = compiled(vec![pod("db", "10.0.1.3", "db"), pod("web", "10.0.1.2", "web")]);
    assert!(narrowed_from(&both, &both).is_empty());
}

#[test]
fn a_pod_isolated_anew_is_narrowed_alone() {
    let before = compiled(vec![pod("db", "10.0.1.3", "db"), pod("web", "10.0.1.2", "web")]);
    let after = compiled(vec![
        pod("db", "10.0.1.3", "db"),
        pod("web", "10.0.1.2", "web"),
        pod("db2", "10.0.1.4", "db"),
    ]);
    let narrowed = narrowed_from(&before, &after);
    assert_eq!(narrowed.addresses, BTreeSet::from([ip("10.0.1.4")]));
    assert!(!narrowed.every_isolated_pod);
    assert!(!narrowed.covers(&after, ip("10.0.1.3")));
}

#[test]
fn a_peer_gone_from_a_set_narrows_every_isolated_pod() {
    let before = compiled(vec![pod("db", "10.0.1.3", "db"), pod("web", "10.0.1.2", "web")]);
    let after = compiled(vec![pod("db", "10.0.1.3", "db")]);
    let narrowed = narrowed_from(&before, &after);
    assert!(narrowed.every_isolated_pod);
    assert!(narrowed.covers(&after, ip("10.0.1.3")));
    // An open pod's flows are never judged.
    assert!(!narrowed.covers(&after, ip("10.0.1.2")));
}

#[test]
fn a_chain_written_again_narrows_the_pods_that_jump_to_it() {
    let both = compiled(vec![pod("db", "10.0.1.3", "db"), pod("web", "10.0.1.2", "web")]);
    let mut held = Current::held_after(&both);
    let chain = both.lists.keys().next().expect("a chain").clone();
    // Someone emptied it: every connection passed meanwhile.
    held.chains.insert(chain, crate::nft::Chain::Rules(vec![]));
    let narrowed = narrowed(&held, &both, &plan(&held, &both));
    assert_eq!(narrowed.addresses, BTreeSet::from([ip("10.0.1.3")]));
}

#[test]
fn a_table_made_again_narrows_every_isolated_pod() {
    let both = compiled(vec![pod("db", "10.0.1.3", "db")]);
    let held = Current::held_after(&both);
    let ops: Vec<Op> = std::iter::once(Op::DeleteTable)
        .chain(plan(&Current::default(), &both))
        .collect();
    assert!(narrowed(&held, &both, &ops).every_isolated_pod);
}
