//! The kernel side: one `inet` table holding every verdict.
//!
//! - a verdict map per direction and family from an isolated local pod's
//!   address to a jump into its allow list's chain;
//! - an allow list's chain: one rule per allow, matching the peer set and
//!   the ports, that returns; then `drop`;
//! - peer sets: pods' addresses in plain sets named after the rule they
//!   come from (a pod coming or going is one element), address blocks in
//!   interval sets named after their content (a policy's text fixes them);
//! - base chains on `forward` (pod to pod, routed or bridged through
//!   `br_netfilter`, after kube-proxy's DNAT) and `input` (pod to node):
//!   packets of established connections pass, then the destination's
//!   ingress list, then the source's egress list. The node's own traffic
//!   to its pods (`output`) is never judged: kubelet's probes pass;
//! - the namespaces that have a policy ([`GUARDED_NAMESPACES`]), which a
//!   new pod's ADD reads when no agent answers it.
//!
//! A change is one netlink transaction ([`firewall::ruleset`]) planned
//! against what the kernel holds ([`Current`]): elements added and
//! removed, chains added before map entries jump to them and removed
//! after, so no packet ever sees a half-applied state, and an agent that
//! restarts reconciles the table it left instead of rebuilding it. Chains
//! are compared rule by rule with what they should hold, so a rule someone
//! changed is written again.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use firewall::ruleset::{
    self, AnonymousSet, BaseChain, Compare, Element, Expr, Field, Hook, Op, Rule, Set, SetKind, SetRef,
    Value, Verdict,
};

use crate::compile::{Allow, AllowList, BLOCK_SET_PREFIX, Compiled, Direction};
use crate::ranges::{Family, Interval};

/// The table's name, in the `inet` family.
pub const TABLE: &str = policy_gate::guarded::TABLE;

/// The set of the names of the namespaces that have a NetworkPolicy.
pub const GUARDED_NAMESPACES: &str = policy_gate::guarded::SET;

/// The comment every base rule carries, for whoever lists the table.
const BASE_TAG: &str = "cni-suite netpol v2";

const BASE_CHAINS: [(&str, Hook); 2] = [("forward", Hook::Forward), ("input", Hook::Input)];

/// The sets of a local pod's own address twice (`addr . addr`), per
/// family: a pod reaching itself (through its Service, hairpinned) is
/// always allowed, as Kubernetes' e2e tests expect.
const SELF_SETS: [&str; 2] = ["self-v4", "self-v6"];

fn self_set(family: Family) -> &'static str {
    match family {
        Family::V4 => SELF_SETS[0],
        Family::V6 => SELF_SETS[1],
    }
}

fn map_name(direction: Direction, family: Family) -> String {
    let family = match family {
        Family::V4 => "v4",
        Family::V6 => "v6",
    };
    format!("{}-{family}", direction.label())
}

/// The map an isolated address's entry is in.
pub(crate) fn map_of(direction: Direction, ip: IpAddr) -> String {
    map_name(direction, Family::of(ip))
}

/// The members `compiled` wants in the peer set of the kernel named
/// `name` (a family's half of one of its peer sets); none for a set it
/// does not want.
pub(crate) fn peer_set_members(compiled: &Compiled, name: &str) -> BTreeSet<Interval> {
    let (base, family) = match (name.strip_suffix("-v4"), name.strip_suffix("-v6")) {
        (Some(base), _) => (base, Family::V4),
        (_, Some(base)) => (base, Family::V6),
        _ => return BTreeSet::new(),
    };
    compiled
        .peer_sets
        .get(base)
        .into_iter()
        .flatten()
        .filter(|i| i.family == family)
        .copied()
        .collect()
}

fn set_name(base: &str, family: Family) -> String {
    match family {
        Family::V4 => format!("{base}-v4"),
        Family::V6 => format!("{base}-v6"),
    }
}

const FAMILIES: [Family; 2] = [Family::V4, Family::V6];
const DIRECTIONS: [Direction; 2] = [Direction::Ingress, Direction::Egress];

fn address_field(family: Family) -> Field {
    match family {
        Family::V4 => Field::Ipv4,
        Family::V6 => Field::Ipv6,
    }
}

fn value_of(family: Family, value: u128) -> Value {
    match family {
        // A V4 interval's values are below 2^32 by construction.
        Family::V4 => Value(u32::try_from(value).unwrap_or(u32::MAX).to_be_bytes().to_vec()),
        Family::V6 => Value(value.to_be_bytes().to_vec()),
    }
}

fn address_of(value: &Value) -> Option<IpAddr> {
    match value.0.len() {
        4 => <[u8; 4]>::try_from(&value.0[..]).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(&value.0[..]).ok().map(IpAddr::from),
        _ => None,
    }
}

fn interval_of(element: &Element) -> Option<Interval> {
    let first = address_of(&element.key)?;
    let last = element.last.as_ref().map_or(Some(first), address_of)?;
    Interval::parse(&format!("{first}-{last}"))
}

/// A peer set's element: an address, or an interval in a block set.
fn peer_element(set: &str, interval: &Interval) -> Element {
    let first = value_of(interval.family, interval.first);
    if set.starts_with(BLOCK_SET_PREFIX) {
        Element::interval(first, value_of(interval.family, interval.last))
    } else {
        Element::key(first)
    }
}

fn pair(ip: IpAddr) -> Element {
    Element::key(Value::concat(&[Value::address(ip), Value::address(ip)]))
}

/// What the table holds in the kernel, as far as changes need it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Current {
    pub exists: bool,
    /// Base chains hooked as this agent hooks them, with their rules.
    pub base_chains: BTreeMap<String, Vec<Rule>>,
    /// Chains other than the base ones, with their rules.
    pub chains: BTreeMap<String, Vec<Rule>>,
    /// Peer sets by name, with their elements.
    pub sets: BTreeMap<String, BTreeSet<Interval>>,
    /// The addresses in each family's set of a pod's own traffic.
    pub selves: BTreeMap<String, BTreeSet<IpAddr>>,
    /// Maps by name: address to the chain it jumps to.
    pub maps: BTreeMap<String, BTreeMap<IpAddr, String>>,
    /// The namespaces recorded as having a policy; None without the set.
    pub guarded: Option<BTreeSet<String>>,
}

impl Current {
    /// What `table` (read back) holds.
    pub fn of(table: &ruleset::Table) -> Current {
        let mut current = Current {
            exists: true,
            ..Current::default()
        };
        for (name, chain) in &table.chains {
            let wanted_hook = BASE_CHAINS
                .iter()
                .find(|(base, _)| base == name)
                .map(|(_, hook)| *hook);
            match wanted_hook {
                Some(hook) if chain.base == Some(BaseChain { hook }) => {
                    current.base_chains.insert(name.clone(), chain.rules.clone());
                }
                // Hooked otherwise (or not at all): written again.
                Some(_) => {}
                None => {
                    current.chains.insert(name.clone(), chain.rules.clone());
                }
            }
        }
        for (name, read) in &table.sets {
            let elements = &read.elements;
            if SELF_SETS.contains(&name.as_str()) {
                let addresses = elements
                    .iter()
                    .filter_map(|e| address_of(&Value(e.key.0[..e.key.0.len() / 2].to_vec())))
                    .collect();
                current.selves.insert(name.clone(), addresses);
            } else if name == GUARDED_NAMESPACES {
                let names = elements
                    .iter()
                    .map(|e| {
                        let text = e.key.0.split(|b| *b == 0).next().unwrap_or_default();
                        String::from_utf8_lossy(text).into_owned()
                    })
                    .collect();
                current.guarded = Some(names);
            } else if read.set.kind == SetKind::VerdictMap {
                let entries = elements
                    .iter()
                    .filter_map(|e| {
                        // Another verdict than a jump (someone else's): no
                        // chain's, so it is replaced.
                        let chain = match &e.verdict {
                            Some(Verdict::Jump(chain)) => chain.clone(),
                            _ => String::new(),
                        };
                        Some((address_of(&e.key)?, chain))
                    })
                    .collect();
                current.maps.insert(name.clone(), entries);
            } else {
                current
                    .sets
                    .insert(name.clone(), elements.iter().filter_map(interval_of).collect());
            }
        }
        current
    }

    /// What the table holds once [`plan`]'s ops for `compiled` have run:
    /// a listing of it, without listing it.
    pub fn held_after(compiled: &Compiled) -> Current {
        let mut maps = BTreeMap::new();
        for direction in DIRECTIONS {
            for family in FAMILIES {
                let entries = compiled
                    .isolated
                    .get(&direction)
                    .into_iter()
                    .flatten()
                    .filter(|(ip, _)| Family::of(**ip) == family)
                    .map(|(ip, chain)| (*ip, chain.clone()))
                    .collect();
                maps.insert(map_name(direction, family), entries);
            }
        }
        Current {
            exists: true,
            base_chains: BASE_CHAINS
                .iter()
                .map(|(name, _)| ((*name).to_owned(), base_rules(name)))
                .collect(),
            chains: compiled
                .lists
                .iter()
                .map(|(name, list)| (name.clone(), chain_rules(list)))
                .collect(),
            sets: peer_sets_of(compiled),
            selves: FAMILIES
                .iter()
                .map(|f| (self_set(*f).to_owned(), isolated_addresses(compiled, *f)))
                .collect(),
            maps,
            guarded: Some(compiled.guarded.clone()),
        }
    }
}

/// `meta nfproto` is `family`: the dependency nft puts before a match on
/// an IPv4 or IPv6 header in an `inet` table.
fn nfproto(family: Family) -> [Expr; 2] {
    let number = match family {
        Family::V4 => 2,
        Family::V6 => 10,
    };
    [
        Expr::Meta {
            key: ruleset::META_NFPROTO,
            dreg: ruleset::REG_1,
        },
        Expr::Cmp {
            sreg: ruleset::REG_1,
            op: Compare::Eq,
            data: vec![number],
        },
    ]
}

/// Which address of the IP header.
#[derive(Clone, Copy)]
enum End {
    Source,
    Destination,
}

/// `ip saddr`, `ip6 daddr` and the like, into `dreg`.
fn address(family: Family, end: End, dreg: u32) -> Expr {
    let (offset, len) = match (family, end) {
        (Family::V4, End::Source) => (12, 4),
        (Family::V4, End::Destination) => (16, 4),
        (Family::V6, End::Source) => (8, 16),
        (Family::V6, End::Destination) => (24, 16),
    };
    Expr::Payload {
        base: ruleset::NETWORK_HEADER,
        offset,
        len,
        dreg,
    }
}

fn lookup(set: SetRef) -> Expr {
    Expr::Lookup {
        sreg: ruleset::REG_1,
        set,
        verdict_map: false,
    }
}

fn l4proto() -> Expr {
    Expr::Meta {
        key: ruleset::META_L4PROTO,
        dreg: ruleset::REG_1,
    }
}

fn tagged(exprs: Vec<Expr>) -> Rule {
    Rule {
        exprs,
        comment: Some(BASE_TAG.to_owned()),
    }
}

/// `meta l4proto { tcp, udp, sctp }`.
fn transport_protocols() -> Expr {
    lookup(SetRef::Anonymous(AnonymousSet {
        key: vec![Field::InetProto],
        elements: [6, 17, 132]
            .into_iter()
            .map(|p| Element::key(Value::byte(p)))
            .collect(),
    }))
}

fn base_rules(chain: &str) -> Vec<Rule> {
    let mut rules = vec![
        // ct state established,related accept
        tagged(vec![
            Expr::Ct {
                key: ruleset::CT_STATE,
                dreg: ruleset::REG_1,
            },
            Expr::Bitwise {
                sreg: ruleset::REG_1,
                dreg: ruleset::REG_1,
                // IP_CT_ESTABLISHED and IP_CT_RELATED's state bits, in the
                // host's order as conntrack keeps them.
                mask: 6u32.to_ne_bytes().to_vec(),
                xor: vec![0; 4],
            },
            Expr::Cmp {
                sreg: ruleset::REG_1,
                op: Compare::Neq,
                data: vec![0; 4],
            },
            Expr::Verdict(Verdict::Accept),
        ]),
        // Neighbour discovery is untracked: without it an isolated pod
        // resolves no neighbour, not even for what it is allowed.
        tagged(
            [
                nfproto(Family::V6).to_vec(),
                vec![
                    l4proto(),
                    Expr::Cmp {
                        sreg: ruleset::REG_1,
                        op: Compare::Eq,
                        data: vec![58],
                    },
                    Expr::Payload {
                        base: ruleset::TRANSPORT_HEADER,
                        offset: 0,
                        len: 1,
                        dreg: ruleset::REG_1,
                    },
                    // nd-router-solicit to nd-redirect.
                    lookup(SetRef::Anonymous(AnonymousSet {
                        key: vec![Field::Icmpv6Type],
                        elements: (133..=137).map(|t| Element::key(Value::byte(t))).collect(),
                    })),
                    Expr::Verdict(Verdict::Accept),
                ],
            ]
            .concat(),
        ),
    ];
    if chain == "forward" {
        // Pods' link-local addresses are in no map: between pods they
        // would pass every policy (the node's own link-local traffic, on
        // `input`, is left alone: DHCPv6 and the like use it).
        for end in [End::Source, End::Destination] {
            let mut fe80 = vec![0u8; 16];
            fe80[..2].copy_from_slice(&[0xfe, 0x80]);
            let mut mask = vec![0u8; 16];
            mask[..2].copy_from_slice(&[0xff, 0xc0]);
            rules.push(tagged(
                [
                    nfproto(Family::V6).to_vec(),
                    vec![
                        address(Family::V6, end, ruleset::REG_1),
                        Expr::Bitwise {
                            sreg: ruleset::REG_1,
                            dreg: ruleset::REG_1,
                            mask,
                            xor: vec![0; 16],
                        },
                        Expr::Cmp {
                            sreg: ruleset::REG_1,
                            op: Compare::Eq,
                            data: fe80,
                        },
                        l4proto(),
                        transport_protocols(),
                        Expr::Verdict(Verdict::Drop),
                    ],
                ]
                .concat(),
            ));
        }
        for family in FAMILIES {
            let second = match family {
                Family::V4 => ruleset::REG32_01,
                Family::V6 => ruleset::REG_2,
            };
            rules.push(tagged(
                [
                    nfproto(family).to_vec(),
                    vec![
                        address(family, End::Source, ruleset::REG_1),
                        address(family, End::Destination, second),
                        lookup(SetRef::Named(self_set(family).to_owned())),
                        Expr::Verdict(Verdict::Accept),
                    ],
                ]
                .concat(),
            ));
        }
    }
    let directions: &[Direction] = if chain == "forward" {
        &DIRECTIONS
    } else {
        &[Direction::Egress]
    };
    for direction in directions {
        let end = match direction {
            Direction::Ingress => End::Destination,
            Direction::Egress => End::Source,
        };
        for family in FAMILIES {
            rules.push(tagged(
                [
                    nfproto(family).to_vec(),
                    vec![
                        address(family, end, ruleset::REG_1),
                        Expr::Lookup {
                            sreg: ruleset::REG_1,
                            set: SetRef::Named(map_name(*direction, family)),
                            verdict_map: true,
                        },
                    ],
                ]
                .concat(),
            ));
        }
    }
    rules
}

/// `meta l4proto . th dport { tcp . 5432, udp . 53-54 }`.
fn ports_match(ports: &BTreeSet<crate::compile::PortRange>) -> Vec<Expr> {
    let elements = ports
        .iter()
        .map(|p| {
            let protocol = Value::byte(p.protocol.number());
            Element::interval(
                Value::concat(&[protocol.clone(), Value::port(p.first)]),
                Value::concat(&[protocol, Value::port(p.last)]),
            )
        })
        .collect();
    vec![
        l4proto(),
        Expr::Payload {
            base: ruleset::TRANSPORT_HEADER,
            offset: 2,
            len: 2,
            dreg: ruleset::REG32_01,
        },
        lookup(SetRef::Anonymous(AnonymousSet {
            key: vec![Field::InetProto, Field::InetService],
            elements,
        })),
    ]
}

/// The rules of an allow list's chain.
fn chain_rules(list: &AllowList) -> Vec<Rule> {
    let end = match list.direction {
        Direction::Ingress => End::Source,
        Direction::Egress => End::Destination,
    };
    let mut rules = Vec::new();
    let untagged = |exprs: Vec<Expr>| Rule { exprs, comment: None };
    for Allow { peers, ports } in &list.allows {
        let ports = ports.as_ref().map(ports_match).unwrap_or_default();
        let ret = Expr::Verdict(Verdict::Return);
        match peers {
            None => rules.push(untagged([ports, vec![ret]].concat())),
            Some(sets) => {
                for set in sets {
                    for family in FAMILIES {
                        let peer = [
                            nfproto(family).to_vec(),
                            vec![
                                address(family, end, ruleset::REG_1),
                                lookup(SetRef::Named(set_name(set, family))),
                            ],
                        ]
                        .concat();
                        rules.push(untagged([peer, ports.clone(), vec![ret.clone()]].concat()));
                    }
                }
            }
        }
    }
    rules.push(untagged(vec![Expr::Verdict(Verdict::Drop)]));
    rules
}

/// Each family's peer set of `compiled`, by name.
fn peer_sets_of(compiled: &Compiled) -> BTreeMap<String, BTreeSet<Interval>> {
    let mut sets = BTreeMap::new();
    for (base, members) in &compiled.peer_sets {
        for family in FAMILIES {
            sets.insert(
                set_name(base, family),
                members.iter().filter(|i| i.family == family).copied().collect(),
            );
        }
    }
    sets
}

/// Every local pod address of `family` isolated in either direction.
fn isolated_addresses(compiled: &Compiled, family: Family) -> BTreeSet<IpAddr> {
    compiled
        .isolated
        .values()
        .flat_map(|addresses| addresses.keys())
        .filter(|ip| Family::of(**ip) == family)
        .copied()
        .collect()
}

/// The ops that change `have` into `want` in `set`: deletions first.
fn element_changes<T: Ord>(
    set: &str,
    have: &BTreeSet<T>,
    want: &BTreeSet<T>,
    element: impl Fn(&T) -> Element,
) -> Vec<Op> {
    let gone: Vec<Element> = have.difference(want).map(&element).collect();
    let new: Vec<Element> = want.difference(have).map(&element).collect();
    let mut ops = Vec::new();
    if !gone.is_empty() {
        ops.push(Op::DeleteElements {
            set: set.to_owned(),
            elements: gone,
        });
    }
    if !new.is_empty() {
        ops.push(Op::AddElements {
            set: set.to_owned(),
            elements: new,
        });
    }
    ops
}

fn add_set(name: &str, key: Vec<Field>, kind: SetKind) -> Op {
    Op::AddSet(Set {
        name: name.to_owned(),
        key,
        kind,
    })
}

fn add_rules(ops: &mut Vec<Op>, chain: &str, rules: Vec<Rule>) {
    ops.extend(rules.into_iter().map(|rule| Op::AddRule {
        chain: chain.to_owned(),
        rule,
    }));
}

/// The ops that make `current` into `compiled`, in one transaction's
/// order; none when nothing differs.
pub fn plan(current: &Current, compiled: &Compiled) -> Vec<Op> {
    let mut ops = Vec::new();
    if !current.exists {
        ops.push(Op::AddTable);
    }
    for direction in DIRECTIONS {
        for family in FAMILIES {
            let name = map_name(direction, family);
            if !current.maps.contains_key(&name) {
                ops.push(add_set(&name, vec![address_field(family)], SetKind::VerdictMap));
            }
        }
    }
    // A pod's own traffic: every isolated local address, paired with itself.
    let none = BTreeSet::new();
    for family in FAMILIES {
        let name = self_set(family);
        let have = current.selves.get(name).unwrap_or_else(|| {
            let field = address_field(family);
            ops.push(add_set(name, vec![field, field], SetKind::Plain));
            &none
        });
        ops.extend(element_changes(
            name,
            have,
            &isolated_addresses(compiled, family),
            |ip| pair(*ip),
        ));
    }
    let no_names = BTreeSet::new();
    let guarded = current.guarded.as_ref().unwrap_or_else(|| {
        ops.push(add_set(GUARDED_NAMESPACES, vec![Field::Text], SetKind::Plain));
        &no_names
    });
    // A namespace's name is at most 63 bytes: every one fits a key.
    ops.extend(element_changes(
        GUARDED_NAMESPACES,
        guarded,
        &compiled.guarded,
        |name| Element::key(Value::text(name).unwrap_or_else(|| Value(vec![0; ruleset::TEXT_LEN]))),
    ));
    // Sets: new ones made, the others' elements changed.
    let wanted_sets = peer_sets_of(compiled);
    let no_intervals = BTreeSet::new();
    for (name, wanted) in &wanted_sets {
        let family = if name.ends_with("-v6") {
            Family::V6
        } else {
            Family::V4
        };
        let have = current.sets.get(name).unwrap_or_else(|| {
            let kind = if name.starts_with(BLOCK_SET_PREFIX) {
                SetKind::Intervals
            } else {
                SetKind::Plain
            };
            ops.push(add_set(name, vec![address_field(family)], kind));
            &no_intervals
        });
        ops.extend(element_changes(name, have, wanted, |i| peer_element(name, i)));
    }
    // Chains, before anything jumps to them; one whose rules someone
    // changed is written again.
    for (name, list) in &compiled.lists {
        let rules = chain_rules(list);
        match current.chains.get(name) {
            Some(have) if *have == rules => continue,
            Some(_) => ops.push(Op::FlushChain(name.clone())),
            None => ops.push(Op::AddChain {
                name: name.clone(),
                base: None,
            }),
        }
        add_rules(&mut ops, name, rules);
    }
    // Base chains, once their maps exist.
    for (chain, hook) in BASE_CHAINS {
        let rules = base_rules(chain);
        if current.base_chains.get(chain) == Some(&rules) {
            continue;
        }
        ops.push(Op::AddChain {
            name: chain.to_owned(),
            base: Some(BaseChain { hook }),
        });
        ops.push(Op::FlushChain(chain.to_owned()));
        add_rules(&mut ops, chain, rules);
    }
    // Map entries: the changed and gone removed, then the new added.
    for direction in DIRECTIONS {
        for family in FAMILIES {
            let name = map_name(direction, family);
            let empty = BTreeMap::new();
            let have = current.maps.get(&name).unwrap_or(&empty);
            let wanted: BTreeMap<IpAddr, &String> = compiled
                .isolated
                .get(&direction)
                .into_iter()
                .flatten()
                .filter(|(ip, _)| Family::of(**ip) == family)
                .map(|(ip, chain)| (*ip, chain))
                .collect();
            let gone: Vec<Element> = have
                .iter()
                .filter(|(ip, chain)| wanted.get(*ip) != Some(chain))
                .map(|(ip, _)| Element::key(Value::address(*ip)))
                .collect();
            let new: Vec<Element> = wanted
                .iter()
                .filter(|(ip, chain)| have.get(*ip) != Some(**chain))
                .map(|(ip, chain)| Element::jump(Value::address(*ip), chain))
                .collect();
            if !gone.is_empty() {
                ops.push(Op::DeleteElements {
                    set: name.clone(),
                    elements: gone,
                });
            }
            if !new.is_empty() {
                ops.push(Op::AddElements {
                    set: name,
                    elements: new,
                });
            }
        }
    }
    // Chains and sets nothing refers to any more.
    for name in current.chains.keys().filter(|c| !compiled.lists.contains_key(*c)) {
        ops.push(Op::FlushChain(name.clone()));
        ops.push(Op::DeleteChain(name.clone()));
    }
    for name in current.sets.keys().filter(|s| !wanted_sets.contains_key(*s)) {
        ops.push(Op::DeleteSet(name.clone()));
    }
    ops
}

#[cfg(test)]
mod tests;
