use std::collections::BTreeSet;
use std::net::IpAddr;

use super::*;

/// Runs `body` on a thread in a network namespace of its own, gone with it.
fn in_scratch_namespace(body: impl FnOnce() + Send) {
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("unshare(CLONE_NEWNET) needs root");
            body();
        })
        .join()
        .expect("the test's thread");
    });
}

fn nft(args: &[&str], stdin: &str) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("nft")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("nft runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("written");
    let out = child.wait_with_output().expect("nft ends");
    assert!(
        out.status.success(),
        "nft {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

fn addr(text: &str) -> Value {
    Value::address(ip(text))
}

fn spec(name: &str, key: Key, kind: SetKind) -> Set {
    Set {
        name: name.into(),
        key,
        kind,
    }
}

fn set(name: &str, key: Key, kind: SetKind) -> Op {
    Op::AddSet(spec(name, key, kind))
}

fn nfproto(family: u8) -> [Expr; 2] {
    [
        Expr::Meta {
            key: META_NFPROTO,
            dreg: REG_1,
        },
        Expr::Cmp {
            sreg: REG_1,
            op: Compare::Eq,
            data: vec![family],
        },
    ]
}

fn network(offset: u32, len: u32, dreg: u32) -> Expr {
    Expr::Payload {
        base: NETWORK_HEADER,
        offset,
        len,
        dreg,
    }
}

fn lookup(set: &str) -> Expr {
    Expr::Lookup {
        sreg: REG_1,
        set: SetRef::Named(set.into()),
        verdict_map: false,
    }
}

fn rule(chain: &str, exprs: Vec<Expr>, comment: Option<&str>) -> Op {
    Op::AddRule {
        chain: chain.into(),
        rule: Rule {
            exprs,
            comment: comment.map(Into::into),
        },
    }
}

fn port_set(elements: &[(u8, u16, u16)]) -> AnonymousSet {
    AnonymousSet {
        key: vec![Field::InetProto, Field::InetService],
        elements: elements
            .iter()
            .map(|(proto, first, last)| {
                Element::interval(
                    Value::concat(&[Value::byte(*proto), Value::port(*first)]),
                    Value::concat(&[Value::byte(*proto), Value::port(*last)]),
                )
            })
            .collect(),
    }
}

/// The objects of the NetworkPolicy table, one of each kind, as ops.
fn sample_ops() -> Vec<Op> {
    let tag = Some("cni-suite test");
    vec![
        Op::AddTable,
        set("ingress-v4", vec![Field::Ipv4], SetKind::VerdictMap),
        set("self-v4", vec![Field::Ipv4, Field::Ipv4], SetKind::Plain),
        set("pods-a-v4", vec![Field::Ipv4], SetKind::Plain),
        set("blocks-a-v4", vec![Field::Ipv4], SetKind::Intervals),
        set("blocks-a-v6", vec![Field::Ipv6], SetKind::Intervals),
        Op::AddElements {
            set: spec("blocks-a-v4", vec![Field::Ipv4], SetKind::Intervals),
            elements: vec![
                Element::interval(addr("10.0.0.0"), addr("10.0.0.6")),
                Element::interval(addr("10.0.0.8"), addr("10.0.0.255")),
                Element::interval(addr("192.168.0.0"), addr("192.168.255.255")),
            ],
        },
        Op::AddElements {
            set: spec("blocks-a-v6", vec![Field::Ipv6], SetKind::Intervals),
            elements: vec![Element::interval(
                addr("fd00::"),
                addr("fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
            )],
        },
        Op::AddChain {
            name: "in-x".into(),
            base: None,
        },
        rule(
            "in-x",
            [
                nfproto(2).to_vec(),
                vec![
                    network(12, 4, REG_1),
                    lookup("pods-a-v4"),
                    Expr::Meta {
                        key: META_L4PROTO,
                        dreg: REG_1,
                    },
                    Expr::Payload {
                        base: TRANSPORT_HEADER,
                        offset: 2,
                        len: 2,
                        dreg: REG32_01,
                    },
                    Expr::Lookup {
                        sreg: REG_1,
                        set: SetRef::Anonymous(port_set(&[(6, 5432, 5432), (17, 53, 54)])),
                        verdict_map: false,
                    },
                    Expr::Verdict(Verdict::Return),
                ],
            ]
            .concat(),
            None,
        ),
        rule(
            "in-x",
            [
                nfproto(10).to_vec(),
                vec![
                    network(8, 16, REG_1),
                    lookup("blocks-a-v6"),
                    Expr::Verdict(Verdict::Return),
                ],
            ]
            .concat(),
            None,
        ),
        rule("in-x", vec![Expr::Verdict(Verdict::Drop)], None),
        Op::AddElements {
            set: spec("ingress-v4", vec![Field::Ipv4], SetKind::VerdictMap),
            elements: vec![Element::jump(addr("10.0.1.3"), "in-x")],
        },
        Op::AddElements {
            set: spec("self-v4", vec![Field::Ipv4, Field::Ipv4], SetKind::Plain),
            elements: vec![Element::key(Value::concat(&[addr("10.0.1.3"), addr("10.0.1.3")]))],
        },
        Op::AddChain {
            name: "forward".into(),
            base: Some(BaseChain { hook: Hook::Forward }),
        },
        rule(
            "forward",
            vec![
                Expr::Ct {
                    key: CT_STATE,
                    dreg: REG_1,
                },
                Expr::Bitwise {
                    sreg: REG_1,
                    dreg: REG_1,
                    mask: 6u32.to_ne_bytes().to_vec(),
                    xor: vec![0; 4],
                },
                Expr::Cmp {
                    sreg: REG_1,
                    op: Compare::Neq,
                    data: vec![0; 4],
                },
                Expr::Verdict(Verdict::Accept),
            ],
            tag,
        ),
        rule(
            "forward",
            [
                nfproto(2).to_vec(),
                vec![
                    network(12, 4, REG_1),
                    network(16, 4, REG32_01),
                    lookup("self-v4"),
                    Expr::Verdict(Verdict::Accept),
                ],
            ]
            .concat(),
            tag,
        ),
        rule(
            "forward",
            [
                nfproto(2).to_vec(),
                vec![
                    network(16, 4, REG_1),
                    Expr::Lookup {
                        sreg: REG_1,
                        set: SetRef::Named("ingress-v4".into()),
                        verdict_map: true,
                    },
                ],
            ]
            .concat(),
            tag,
        ),
    ]
}

/// The same objects in nft's words.
const SAMPLE_SCRIPT: &str = r#"add table inet u
add map inet u ingress-v4 { type ipv4_addr : verdict; }
add set inet u self-v4 { type ipv4_addr . ipv4_addr; }
add set inet u pods-a-v4 { type ipv4_addr; }
add set inet u blocks-a-v4 { type ipv4_addr; flags interval; }
add set inet u blocks-a-v6 { type ipv6_addr; flags interval; }
add element inet u blocks-a-v4 { 10.0.0.0-10.0.0.6, 10.0.0.8-10.0.0.255, 192.168.0.0/16 }
add element inet u blocks-a-v6 { fd00::/8 }
add chain inet u in-x
add rule inet u in-x ip saddr @pods-a-v4 meta l4proto . th dport { tcp . 5432, udp . 53-54 } return
add rule inet u in-x ip6 saddr @blocks-a-v6 return
add rule inet u in-x drop
add element inet u ingress-v4 { 10.0.1.3 : jump in-x }
add element inet u self-v4 { 10.0.1.3 . 10.0.1.3 }
add chain inet u forward { type filter hook forward priority filter; policy accept; }
add rule inet u forward ct state established,related accept comment "cni-suite test"
add rule inet u forward ip saddr . ip daddr @self-v4 accept comment "cni-suite test"
add rule inet u forward ip daddr vmap @ingress-v4 comment "cni-suite test"
"#;

/// `nft list`'s text of a table, without its name and handles.
fn listing(table: &str) -> String {
    nft(&["list", "table", "inet", table], "").replacen(&format!("table inet {table}"), "table", 1)
}

#[test]
fn what_is_written_lists_as_nft_writes_it_and_reads_back_as_written() {
    in_scratch_namespace(|| {
        commit(TableFamily::Inet, "t", &sample_ops()).expect("committed");
        nft(&["-f", "-"], SAMPLE_SCRIPT);
        assert_eq!(listing("t"), listing("u"));

        let ours = read(TableFamily::Inet, "t").expect("read").expect("a table");
        let theirs = read(TableFamily::Inet, "u").expect("read").expect("a table");
        assert_eq!(ours.sets, theirs.sets);
        assert_eq!(ours.chains["forward"], theirs.chains["forward"]);
        let written: Vec<Rule> = sample_ops()
            .into_iter()
            .filter_map(|op| match op {
                Op::AddRule { chain, rule } if chain == "in-x" => Some(rule),
                _ => None,
            })
            .collect();
        assert_eq!(ours.chains["in-x"].rules, written, "read back as written");
        assert_eq!(
            ours.chains["forward"].base,
            Some(BaseChain { hook: Hook::Forward })
        );
        let blocks = &ours.sets["blocks-a-v6"].elements;
        assert_eq!(blocks.len(), 1);
        assert_eq!(
            elements(TableFamily::Inet, "t", "ingress-v4").expect("read"),
            Some(BTreeSet::from([Element::jump(addr("10.0.1.3"), "in-x")]))
        );
        assert_eq!(elements(TableFamily::Inet, "t", "nothing").expect("read"), None);
        assert_eq!(elements(TableFamily::Inet, "v", "nothing").expect("read"), None);
        assert_eq!(read(TableFamily::Inet, "v").expect("read"), None);
    });
}

#[test]
fn a_refused_op_leaves_the_table_as_it_was_and_is_named() {
    in_scratch_namespace(|| {
        commit(TableFamily::Inet, "t", &sample_ops()).expect("committed");
        let before = read(TableFamily::Inet, "t").expect("read");
        let refused = commit(
            TableFamily::Inet,
            "t",
            &[
                Op::AddElements {
                    set: spec("pods-a-v4", vec![Field::Ipv4], SetKind::Plain),
                    elements: vec![Element::key(addr("10.9.9.9"))],
                },
                Op::DeleteElements {
                    set: spec("pods-a-v4", vec![Field::Ipv4], SetKind::Plain),
                    elements: vec![Element::key(addr("10.8.8.8"))],
                },
            ],
        )
        .expect_err("no such element");
        assert!(
            refused
                .to_string()
                .contains("delete element pods-a-v4 { 10.8.8.8 }"),
            "{refused}"
        );
        assert_eq!(
            read(TableFamily::Inet, "t").expect("read"),
            before,
            "nothing of it applied"
        );
    });
}

#[test]
fn intervals_read_back_whatever_their_neighbours() {
    in_scratch_namespace(|| {
        let intervals = vec![
            Element::interval(addr("0.0.0.0"), addr("0.0.0.0")),
            Element::interval(addr("10.0.0.1"), addr("10.0.0.1")),
            Element::interval(addr("10.0.0.3"), addr("10.0.0.9")),
            Element::interval(addr("250.0.0.0"), addr("255.255.255.255")),
        ];
        commit(
            TableFamily::Inet,
            "t",
            &[
                Op::AddTable,
                set("b", vec![Field::Ipv4], SetKind::Intervals),
                Op::AddElements {
                    set: spec("b", vec![Field::Ipv4], SetKind::Intervals),
                    elements: intervals.clone(),
                },
            ],
        )
        .expect("committed");
        let read_back = elements(TableFamily::Inet, "t", "b")
            .expect("read")
            .expect("a set");
        assert_eq!(read_back, intervals.iter().cloned().collect());
        commit(
            TableFamily::Inet,
            "t",
            &[Op::DeleteElements {
                set: spec("b", vec![Field::Ipv4], SetKind::Intervals),
                elements: intervals[1..3].to_vec(),
            }],
        )
        .expect("deleted");
        let left = elements(TableFamily::Inet, "t", "b")
            .expect("read")
            .expect("a set");
        assert_eq!(left, [intervals[0].clone(), intervals[3].clone()].into());
    });
}

#[test]
fn a_shared_set_of_tagged_intervals_reads_back_and_a_rule_loads_its_tag() {
    in_scratch_namespace(|| {
        let tagged = spec(
            "blocks-v4",
            vec![Field::Ipv4, Field::Mark, Field::Mark],
            SetKind::Intervals,
        );
        let tag = |t: u64| Value(t.to_be_bytes().to_vec());
        let interval = |first: &str, last: &str, t: u64| {
            Element::interval(
                Value::concat(&[addr(first), tag(t)]),
                Value::concat(&[addr(last), tag(t)]),
            )
        };
        let elements = vec![
            interval("10.0.0.0", "10.0.0.6", 1),
            interval("10.0.0.8", "10.0.0.255", 1),
            interval("10.0.0.0", "10.255.255.255", 2),
        ];
        let rule_of_tag = Rule {
            exprs: [
                nfproto(2).to_vec(),
                vec![
                    network(12, 4, REG_1),
                    Expr::Immediate {
                        dreg: REG32_01,
                        data: tag(2).0,
                    },
                    lookup("blocks-v4"),
                    Expr::Verdict(Verdict::Return),
                ],
            ]
            .concat(),
            comment: None,
        };
        commit(
            TableFamily::Inet,
            "t",
            &[
                Op::AddTable,
                Op::AddSet(tagged.clone()),
                Op::AddElements {
                    set: tagged.clone(),
                    elements: elements.clone(),
                },
                Op::AddChain {
                    name: "c".into(),
                    base: None,
                },
                Op::AddRule {
                    chain: "c".into(),
                    rule: rule_of_tag.clone(),
                },
            ],
        )
        .expect("committed");
        let table = read(TableFamily::Inet, "t").expect("read").expect("a table");
        assert_eq!(table.sets["blocks-v4"].set, tagged);
        assert_eq!(
            table.sets["blocks-v4"].elements,
            elements.iter().cloned().collect()
        );
        assert_eq!(table.chains["c"].rules, [rule_of_tag]);
        commit(
            TableFamily::Inet,
            "t",
            &[Op::DeleteElements {
                set: tagged,
                elements: elements[..1].to_vec(),
            }],
        )
        .expect("deleted");
        let left = super::elements(TableFamily::Inet, "t", "blocks-v4")
            .expect("read")
            .expect("a set");
        assert_eq!(left, elements[1..].iter().cloned().collect());
    });
}

#[test]
fn a_batch_of_twenty_thousand_elements_is_one_transaction() {
    in_scratch_namespace(|| {
        let elements_of = |second: u8| -> Vec<Element> {
            (0..20_000u32)
                .map(|i| {
                    let [_, _, c, d] = i.to_be_bytes();
                    Element::key(Value::address(IpAddr::from([10, second, c, d])))
                })
                .collect()
        };
        commit(
            TableFamily::Inet,
            "t",
            &[
                Op::AddTable,
                set("p", vec![Field::Ipv4], SetKind::Plain),
                Op::AddElements {
                    set: spec("p", vec![Field::Ipv4], SetKind::Plain),
                    elements: elements_of(1),
                },
            ],
        )
        .expect("committed");
        let read_back = elements(TableFamily::Inet, "t", "p")
            .expect("read")
            .expect("a set");
        assert_eq!(read_back.len(), 20_000);
        // Half swapped for others in one batch.
        let ops = [
            Op::DeleteElements {
                set: spec("p", vec![Field::Ipv4], SetKind::Plain),
                elements: elements_of(1)[..10_000].to_vec(),
            },
            Op::AddElements {
                set: spec("p", vec![Field::Ipv4], SetKind::Plain),
                elements: elements_of(2),
            },
        ];
        commit(TableFamily::Inet, "t", &ops).expect("committed");
        let read_back = elements(TableFamily::Inet, "t", "p")
            .expect("read")
            .expect("a set");
        assert_eq!(read_back.len(), 30_000);
    });
}
