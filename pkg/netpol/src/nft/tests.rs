use super::*;
use crate::compile::{Compiled, Snapshot, compile};
use crate::model::{Peer, PodView, Policy, PortSpec, Protocol, Rule as PolicyRule, Selector};

fn pod(name: &str, node: &str, ip: &str, app: &str) -> PodView {
    PodView {
        namespace: "a".into(),
        name: name.into(),
        node: Some(node.into()),
        labels: [("app".to_owned(), app.to_owned())].into(),
        ips: vec![ip.parse().expect("test data parses")],
        ports: vec![],
    }
}

fn web_peers() -> Peer {
    Peer::Pods {
        pods: Some(Selector::labels(&[("app", "web")])),
        namespaces: None,
    }
}

fn web_to_db(pods: Vec<PodView>) -> Compiled {
    let rule = PolicyRule {
        peers: Some(vec![web_peers()]),
        ports: vec![PortSpec::Range(Protocol::Tcp, 5432, 5432)],
    };
    db_taking(rule, pods)
}

/// The db pods take what `rule` allows.
fn db_taking(rule: PolicyRule, pods: Vec<PodView>) -> Compiled {
    let policy = Policy {
        namespace: "a".into(),
        name: "db".into(),
        pod_selector: Selector::labels(&[("app", "db")]),
        ingress: Some(vec![rule]),
        egress: None,
    };
    let snapshot = Snapshot {
        pods,
        namespaces: vec![],
        policies: vec![policy],
    };
    compile(&snapshot, "n1")
}

fn db_pods() -> Vec<PodView> {
    vec![
        pod("db", "n1", "10.0.1.3", "db"),
        pod("web", "n2", "10.0.2.2", "web"),
    ]
}

/// The ops as nft's words, one a line.
fn shown(ops: &[Op]) -> Vec<String> {
    ops.iter().map(ToString::to_string).collect()
}

fn position(ops: &[String], start: &str) -> usize {
    ops.iter()
        .position(|op| op.starts_with(start))
        .unwrap_or_else(|| panic!("{start:?} not in:\n{}", ops.join("\n")))
}

fn rules_of<'a>(ops: &'a [Op], chain: &str) -> Vec<&'a Rule> {
    ops.iter()
        .filter_map(|op| match op {
            Op::AddRule { chain: c, rule } if c == chain => Some(rule),
            _ => None,
        })
        .collect()
}

fn jump_sets(rule: &Rule) -> Vec<String> {
    rule.exprs
        .iter()
        .filter_map(|e| match e {
            Expr::Lookup {
                set: SetRef::Named(name),
                ..
            } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_fresh_table_gets_its_sets_and_chains_before_anything_jumps_to_them() {
    let compiled = web_to_db(db_pods());
    let ops = plan(&Current::default(), &compiled);
    let text = shown(&ops);
    let chain = compiled.lists.keys().next().expect("present");
    assert_eq!(ops[0], Op::AddTable);
    assert!(position(&text, "add element peers-v4") < position(&text, &format!("add chain {chain}")));
    assert!(
        position(&text, &format!("add chain {chain}"))
            < position(&text, "add element ingress-v4 { 10.0.1.3 : jump ")
    );
    assert!(position(&text, "add chain forward (hook Forward)") < position(&text, "add element ingress-v4"));
    let rules = rules_of(&ops, chain);
    assert_eq!(rules.len(), 3, "each family's peer set, then drop");
    assert_eq!(jump_sets(rules[0]), ["peers-v4"]);
    assert!(
        rules[0].exprs.iter().any(
            |e| matches!(e, Expr::Immediate { dreg, data } if *dreg == ruleset::REG32_01 && data.len() == 8)
        ),
        "the rule's own tag beside the address: {:?}",
        rules[0]
    );
    assert_eq!(rules[2].exprs, [Expr::Verdict(Verdict::Drop)]);
    // One port: compared in the rule, no set of its own.
    assert!(
        rules[0].exprs.ends_with(&[
            Expr::Meta {
                key: ruleset::META_L4PROTO,
                dreg: ruleset::REG_1
            },
            Expr::Cmp {
                sreg: ruleset::REG_1,
                op: Compare::Eq,
                data: vec![6]
            },
            Expr::Payload {
                base: ruleset::TRANSPORT_HEADER,
                offset: 2,
                len: 2,
                dreg: ruleset::REG_1
            },
            Expr::Cmp {
                sreg: ruleset::REG_1,
                op: Compare::Eq,
                data: 5432u16.to_be_bytes().to_vec()
            },
            Expr::Verdict(Verdict::Return),
        ]),
        "{:?}",
        rules[0]
    );
    assert!(
        text.contains(&"add element self-v4 { 0a0001030a000103 }".to_owned()),
        "{text:#?}"
    );
    assert!(
        text.iter()
            .any(|op| op.starts_with("add element guarded-namespaces {"))
    );
}

/// The tagged members `ops` add to the shared set `name`.
fn added_to(ops: &[Op], name: &str) -> Vec<Element> {
    ops.iter()
        .filter_map(|op| match op {
            Op::AddElements { set, elements } if set.name == name => Some(elements.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn address_of_member(element: &Element) -> String {
    Value(element.key.0[..element.key.0.len() - 8].to_vec()).to_string()
}

#[test]
fn pods_of_every_rule_share_a_set_a_family_and_a_policys_blocks_have_one_of_their_own_written_whole() {
    let rule = |cidr: &str| PolicyRule {
        peers: Some(vec![
            web_peers(),
            Peer::Block {
                cidr: cidr.parse().expect("test data parses"),
                except: vec![],
            },
        ]),
        ports: vec![],
    };
    let ops = plan(&Current::default(), &db_taking(rule("192.168.0.0/16"), db_pods()));
    let declared: Vec<&Set> = ops
        .iter()
        .filter_map(|op| match op {
            Op::AddSet(set) if set.key.contains(&Field::Mark) => Some(set),
            _ => None,
        })
        .collect();
    let names: Vec<&str> = declared.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(names[1..], ["peers-v4", "peers-v6"]);
    let block_set = names[0].to_owned();
    assert!(
        block_set.starts_with("blocks-") && block_set.ends_with("-v4"),
        "IPv4's only: {block_set}"
    );
    assert!(
        declared
            .iter()
            .all(|s| (s.kind == SetKind::Intervals) == s.name.starts_with("blocks-"))
    );
    let peers = added_to(&ops, "peers-v4");
    assert_eq!(
        peers.iter().map(address_of_member).collect::<Vec<_>>(),
        ["10.0.2.2"]
    );
    let blocks = added_to(&ops, &block_set);
    assert_eq!(blocks.len(), 1);
    assert_eq!(address_of_member(&blocks[0]), "192.168.0.0");
    let last = blocks[0].last.as_ref().expect("an interval");
    assert_eq!(Value(last.0[..4].to_vec()).to_string(), "192.168.255.255");
    assert_ne!(
        &blocks[0].key.0[4..],
        &peers[0].key.0[4..],
        "each rule's set its own tag"
    );
    // Either set lets a peer in: a rule for each set of each family (the
    // block is IPv4's only), and drop.
    let chain = ops
        .iter()
        .find_map(|op| match op {
            Op::AddChain { name, base: None } => Some(name.clone()),
            _ => None,
        })
        .expect("a chain");
    assert_eq!(rules_of(&ops, &chain).len(), 4);

    // Another block: the policy's block set is another, written whole,
    // and the old one removed whole; no interval is deleted one by one.
    let before = db_taking(rule("192.168.0.0/16"), db_pods());
    let after = db_taking(rule("192.169.0.0/16"), db_pods());
    let ops = plan(&Current::held_after(&before), &after);
    let text = shown(&ops);
    assert!(
        !ops.iter()
            .any(|op| matches!(op, Op::DeleteElements { set, .. } if set.kind == SetKind::Intervals)),
        "{text:#?}"
    );
    let deleted = format!("delete set {block_set}");
    assert!(text.contains(&deleted), "{text:#?}");
    assert!(position(&text, "delete chain") < position(&text, &deleted));
}

#[test]
fn what_the_kernel_already_holds_is_left_alone() {
    let compiled = web_to_db(db_pods());
    assert_eq!(plan(&Current::held_after(&compiled), &compiled), []);
}

#[test]
fn a_new_peer_pod_is_one_element_and_a_gone_policy_takes_its_chains_and_sets() {
    let before = web_to_db(db_pods());
    let mut pods = db_pods();
    pods.push(pod("web2", "n3", "10.0.3.3", "web"));
    let after = web_to_db(pods);
    let ops = plan(&Current::held_after(&before), &after);
    assert_eq!(ops.len(), 1, "{:#?}", shown(&ops));
    let added = added_to(&ops, "peers-v4");
    assert_eq!(
        added.iter().map(address_of_member).collect::<Vec<_>>(),
        ["10.0.3.3"]
    );

    let ops = shown(&plan(&Current::held_after(&before), &Compiled::default()));
    let chain = before.lists.keys().next().expect("present");
    assert!(
        position(&ops, "delete element ingress-v4 { 10.0.1.3 }")
            < position(&ops, &format!("delete chain {chain}"))
    );
    assert!(
        !ops.iter().any(|op| op.starts_with("delete set")),
        "shared sets stay: {ops:#?}"
    );
    assert!(
        ops.iter().any(|op| op.starts_with("delete element peers-v4")),
        "{ops:#?}"
    );
    assert!(
        ops.iter()
            .any(|op| op.starts_with("delete element guarded-namespaces"))
    );
}

#[test]
fn a_chain_someone_changed_is_written_again_whatever_its_length() {
    let compiled = web_to_db(db_pods());
    let chain = compiled.lists.keys().next().expect("a chain").clone();
    let mut current = Current::held_after(&compiled);
    // `drop` replaced by `accept`: as many rules as before.
    let mut rules: Vec<Rule> = rules_of(&plan(&Current::default(), &compiled), &chain)
        .into_iter()
        .cloned()
        .collect();
    if let Some(last) = rules.last_mut() {
        last.exprs = vec![Expr::Verdict(Verdict::Accept)];
    }
    current.chains.insert(chain.clone(), Chain::Rules(rules));
    let ops = plan(&current, &compiled);
    assert_eq!(ops[0], Op::FlushChain(chain.clone()), "{:#?}", shown(&ops));
    assert_eq!(
        rules_of(&ops, &chain).last().map(|r| r.exprs.clone()),
        Some(vec![Expr::Verdict(Verdict::Drop)])
    );

    let mut flushed = Current::held_after(&compiled);
    flushed.chains.insert(chain.clone(), Chain::Rules(Vec::new()));
    assert_eq!(plan(&flushed, &compiled)[0], Op::FlushChain(chain));
}

#[test]
fn base_chains_not_as_written_are_rewritten_in_the_same_transaction() {
    let compiled = web_to_db(db_pods());
    let mut current = Current::held_after(&compiled);
    current.base_chains.remove("input");
    let ops = shown(&plan(&current, &compiled));
    assert!(ops.contains(&"flush chain input".to_owned()), "{ops:#?}");
    assert!(!ops.contains(&"flush chain forward".to_owned()));
}

#[test]
fn a_table_read_back_is_what_it_holds() {
    let compiled = web_to_db(db_pods());
    // The table the ops make, as a reading returns it.
    let mut table = ruleset::Table::default();
    for op in plan(&Current::default(), &compiled) {
        match op {
            Op::AddSet(set) => {
                table.sets.insert(
                    set.name.clone(),
                    ruleset::ReadSet {
                        set,
                        elements: BTreeSet::new(),
                    },
                );
            }
            Op::AddElements { set, elements } => {
                if let Some(read) = table.sets.get_mut(&set.name) {
                    read.elements.extend(elements);
                }
            }
            Op::AddChain { name, base } => {
                table.chains.insert(
                    name,
                    ruleset::ReadChain {
                        base,
                        hooked: base.is_some(),
                        rules: Vec::new(),
                    },
                );
            }
            Op::AddRule { chain, rule } => {
                if let Some(read) = table.chains.get_mut(&chain) {
                    read.rules.push(rule);
                }
            }
            _ => {}
        }
    }
    assert!(Current::of(&table).holds(&compiled));
    assert_ne!(Current::of(&table), Current::default());
    assert_eq!(
        Current::of(&table).guarded,
        Some(BTreeSet::from(["a".to_owned()]))
    );
}
