//! The kernel side: one `inet` table holding every verdict.
//!
//! - a verdict map per direction and family from an isolated local pod's
//!   address to a jump into its allow list's chain;
//! - an allow list's chain: one rule per allow, matching the peer set and
//!   the ports, that returns; then `drop`;
//! - pod peers in one set a family shared by every rule, whatever their
//!   number (`addr . tag`, a hash), where the tag is the rule's peer
//!   set's (a 64-bit hash of its name) and the rule loads its own tag
//!   beside the packet's address: a pod coming or going is an element per
//!   rule naming it. The kernel finds a set by name walking the table's
//!   sets, so a set per rule made every change cost the number of rules:
//!   5000 rules' sets took 16 s to write and each later change 80 ms here;
//! - a policy's address blocks in one interval set a family of its own
//!   (`first-last . tag`), named after its content, written and deleted
//!   whole: removing 10,000 intervals from a shared set one by one held
//!   the node's nf_tables lock 5 to 7 s;
//! - base chains on `forward` (pod to pod, routed or bridged through
//!   `br_netfilter`, after kube-proxy's DNAT) and `input` (pod to node):
//!   packets of established connections pass, TCP new to conntrack
//!   without SYN to or from an isolated pod drops, then the destination's
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

use crate::compile::{Allow, AllowList, BLOCK_SET_PREFIX, Compiled, Direction, POD_SET_PREFIX};
use crate::ranges::{Family, Interval};

/// The table's name, in the `inet` family.
pub const TABLE: &str = agent_wire::policy::guarded::TABLE;

/// The set of the names of the namespaces that have a NetworkPolicy.
pub const GUARDED_NAMESPACES: &str = agent_wire::policy::guarded::SET;

/// The comment every base rule carries, for whoever lists the table.
const BASE_TAG: &str = "cni-suite netpol v3";

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

/// What a peer set holds: pods' addresses or address blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum PeerKind {
    Pods,
    Blocks,
}

fn peer_kind(base: &str) -> PeerKind {
    if base.starts_with(BLOCK_SET_PREFIX) {
        PeerKind::Blocks
    } else {
        PeerKind::Pods
    }
}

/// The kernel set of the peer set `base` in `family`: pods' addresses of
/// every rule in one (`peers-v4`), each policy's blocks in one of its own
/// named after them (`blocks-<policy's blocks>-v4`, see
/// `compile::BLOCK_SET_PREFIX`).
fn peers_set(base: &str, family: Family) -> Set {
    let suffix = match family {
        Family::V4 => "v4",
        Family::V6 => "v6",
    };
    let (name, kind) = match peer_kind(base) {
        PeerKind::Pods => (format!("peers-{suffix}"), SetKind::Plain),
        PeerKind::Blocks => {
            // `blocks-<generation>-<rule's blocks>`: the generation names it.
            let generation = base
                .strip_prefix(BLOCK_SET_PREFIX)
                .and_then(|rest| rest.split('-').next())
                .unwrap_or_default();
            (
                format!("{BLOCK_SET_PREFIX}{generation}-{suffix}"),
                SetKind::Intervals,
            )
        }
    };
    Set {
        name,
        // The tag as two marks: what `nft` lists it as without aborting.
        key: vec![address_field(family), Field::Mark, Field::Mark],
        kind,
    }
}

/// Whether `set` is one [`peers_set`] makes (read back: ours to keep).
fn is_peers_set(set: &Set) -> bool {
    let (stem, family) = match (set.name.strip_suffix("-v4"), set.name.strip_suffix("-v6")) {
        (Some(stem), _) => (stem, Family::V4),
        (_, Some(stem)) => (stem, Family::V6),
        _ => return false,
    };
    // A peer set whose kernel set this would be.
    let base = match stem.strip_prefix(BLOCK_SET_PREFIX) {
        Some(generation) => format!("{BLOCK_SET_PREFIX}{generation}-"),
        None if stem == "peers" => POD_SET_PREFIX.to_owned(),
        None => return false,
    };
    *set == peers_set(&base, family)
}

/// A peer set's tag: 64 bits of a hash of its name (at 10,000 rules the
/// chance two share one is below 10^-11).
pub type Tag = [u8; 8];

fn tag_of(base: &str) -> Tag {
    firewall::nft::short_digest(base)
}

/// A kernel peer set and the tagged members `compiled` wants in it.
pub(crate) struct WantedPeers {
    set: Set,
    kind: PeerKind,
    pub(crate) members: BTreeSet<(Tag, Interval)>,
}

/// What `compiled` wants in each kernel peer set, by name: the pods' sets
/// of both families always, a policy's block set where it has blocks.
pub(crate) fn wanted_peers(compiled: &Compiled) -> BTreeMap<String, WantedPeers> {
    let mut sets = BTreeMap::new();
    for family in FAMILIES {
        let set = peers_set(POD_SET_PREFIX, family);
        sets.insert(
            set.name.clone(),
            WantedPeers {
                set,
                kind: PeerKind::Pods,
                members: BTreeSet::new(),
            },
        );
    }
    for (base, members) in &compiled.peer_sets {
        let (kind, tag) = (peer_kind(base), tag_of(base));
        for member in members {
            let set = peers_set(base, member.family);
            sets.entry(set.name.clone())
                .or_insert_with(|| WantedPeers {
                    set,
                    kind,
                    members: BTreeSet::new(),
                })
                .members
                .insert((tag, *member));
        }
    }
    sets
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

/// A shared peer set's element: the address (or first address) and the
/// tag, and the last address of a block.
fn tagged_member(element: &Element) -> Option<(Tag, Interval)> {
    let split = |value: &Value| -> Option<(IpAddr, Tag)> {
        let at = value.0.len().checked_sub(8)?;
        let address = address_of(&Value(value.0[..at].to_vec()))?;
        Some((address, value.0[at..].try_into().ok()?))
    };
    let (first, tag) = split(&element.key)?;
    let last = match &element.last {
        Some(last) => split(last)?.0,
        None => first,
    };
    Some((tag, Interval::parse(&format!("{first}-{last}"))?))
}

fn tagged_element(kind: PeerKind, (tag, interval): &(Tag, Interval)) -> Element {
    let tag = Value(tag.to_vec());
    let first = Value::concat(&[value_of(interval.family, interval.first), tag.clone()]);
    match kind {
        PeerKind::Pods => Element::key(first),
        PeerKind::Blocks => Element::interval(
            first,
            Value::concat(&[value_of(interval.family, interval.last), tag]),
        ),
    }
}

fn pair(ip: IpAddr) -> Element {
    Element::key(Value::concat(&[Value::address(ip), Value::address(ip)]))
}

/// A chain of an allow list, as a [`Current`] knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chain {
    /// Read from the kernel: compared rule by rule with what it should be.
    Rules(Vec<Rule>),
    /// Written by a plan: its name is a hash of its allow list and the
    /// rendering, so it holds what that list renders to, and a pass need
    /// not render every chain again (at 5000 rules, 24 ms a pass).
    AsNamed,
}

/// What the table holds in the kernel, as far as changes need it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Current {
    pub exists: bool,
    /// Base chains hooked as this agent hooks them, with their rules.
    pub base_chains: BTreeMap<String, Vec<Rule>>,
    /// Chains other than the base ones: their rules as read, or, for a
    /// chain a plan wrote, none ([`Chain::AsNamed`]).
    pub chains: BTreeMap<String, Chain>,
    /// The shared peer sets by name, with their tagged members.
    pub peers: BTreeMap<String, BTreeSet<(Tag, Interval)>>,
    /// Sets of an earlier rendering or of someone else: removed once no
    /// chain refers to them.
    pub stale_sets: BTreeSet<String>,
    /// The addresses in each family's set of a pod's own traffic.
    pub selves: BTreeMap<String, BTreeSet<IpAddr>>,
    /// Maps by name: address to the chain it jumps to.
    pub maps: BTreeMap<String, BTreeMap<IpAddr, String>>,
    /// The namespaces recorded as having a policy; None without the set.
    pub guarded: Option<BTreeSet<String>>,
}

impl Current {
    /// Whether the kernel's table, as read, is what `compiled` asks:
    /// nothing to change.
    pub fn holds(&self, compiled: &Compiled) -> bool {
        plan(self, compiled).is_empty()
    }

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
                    current
                        .chains
                        .insert(name.clone(), Chain::Rules(chain.rules.clone()));
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
            } else if is_peers_set(&read.set) {
                current
                    .peers
                    .insert(name.clone(), elements.iter().filter_map(tagged_member).collect());
            } else {
                current.stale_sets.insert(name.clone());
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
                .keys()
                .map(|name| (name.clone(), Chain::AsNamed))
                .collect(),
            peers: wanted_peers(compiled)
                .into_iter()
                .map(|(name, wanted)| (name, wanted.members))
                .collect(),
            stale_sets: BTreeSet::new(),
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

/// `meta l4proto tcp tcp flags & (syn | ack) != syn ct state new`: a TCP
/// packet conntrack sees as new that does not open a connection.
fn tcp_without_a_connection() -> Vec<Expr> {
    vec![
        l4proto(),
        Expr::Cmp {
            sreg: ruleset::REG_1,
            op: Compare::Eq,
            data: vec![6],
        },
        Expr::Payload {
            base: ruleset::TRANSPORT_HEADER,
            offset: 13,
            len: 1,
            dreg: ruleset::REG_1,
        },
        Expr::Bitwise {
            sreg: ruleset::REG_1,
            dreg: ruleset::REG_1,
            // SYN and ACK.
            mask: vec![0x12],
            xor: vec![0],
        },
        Expr::Cmp {
            sreg: ruleset::REG_1,
            op: Compare::Neq,
            data: vec![0x02],
        },
        Expr::Ct {
            key: ruleset::CT_STATE,
            dreg: ruleset::REG_1,
        },
        Expr::Bitwise {
            sreg: ruleset::REG_1,
            dreg: ruleset::REG_1,
            // IP_CT_NEW's state bit, in the host's order.
            mask: 8u32.to_ne_bytes().to_vec(),
            xor: vec![0; 4],
        },
        Expr::Cmp {
            sreg: ruleset::REG_1,
            op: Compare::Neq,
            data: vec![0; 4],
        },
    ]
}

/// The packet's `end` address is an isolated local pod's: in the family's
/// set of a pod's own traffic (`ip saddr . ip saddr @self-v4`).
fn isolated(family: Family, end: End) -> Vec<Expr> {
    let second = match family {
        Family::V4 => ruleset::REG32_01,
        Family::V6 => ruleset::REG_2,
    };
    vec![
        address(family, end, ruleset::REG_1),
        address(family, end, second),
        lookup(SetRef::Named(self_set(family).to_owned())),
    ]
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
        // A TCP packet that opens no connection (not a bare SYN) yet is
        // new to conntrack is one of a connection whose entry went (cut
        // because the policy now denies it): conntrack would take it up
        // as a new connection, in the other direction if the isolated pod
        // sends first, and its peer's packets would pass as replies.
        // Dropped to or from an isolated pod; allowed connections keep
        // their entries.
        for family in FAMILIES {
            for end in [End::Source, End::Destination] {
                rules.push(tagged(
                    [
                        nfproto(family).to_vec(),
                        tcp_without_a_connection(),
                        isolated(family, end),
                        vec![Expr::Verdict(Verdict::Drop)],
                    ]
                    .concat(),
                ));
            }
        }
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

/// `meta l4proto tcp th dport 5432` or `... th dport 80-90`: compared in
/// the rule (no set of its own: the kernel walks a table's sets to find
/// one, so a set per rule would make every change cost the number of
/// rules).
fn port_match(range: &crate::compile::PortRange) -> Vec<Expr> {
    let compare = |op, port: u16| Expr::Cmp {
        sreg: ruleset::REG_1,
        op,
        data: port.to_be_bytes().to_vec(),
    };
    let mut exprs = vec![
        l4proto(),
        Expr::Cmp {
            sreg: ruleset::REG_1,
            op: Compare::Eq,
            data: vec![range.protocol.number()],
        },
        Expr::Payload {
            base: ruleset::TRANSPORT_HEADER,
            offset: 2,
            len: 2,
            dreg: ruleset::REG_1,
        },
    ];
    if range.first == range.last {
        exprs.push(compare(Compare::Eq, range.first));
    } else {
        exprs.push(compare(Compare::Gte, range.first));
        exprs.push(compare(Compare::Lte, range.last));
    }
    exprs
}

/// Whether the peer set `base` has members to match in `family`: pods'
/// sets always (pods come and go), a block's only for the family it has
/// addresses of.
fn has_family(peer_sets: &BTreeMap<String, Vec<Interval>>, base: &str, family: Family) -> bool {
    peer_kind(base) == PeerKind::Pods
        || peer_sets
            .get(base)
            .is_some_and(|members| members.iter().any(|i| i.family == family))
}

/// `ip saddr . <tag> @peers-v4` and the like: the packet's peer address
/// beside the rule's tag, looked up in the shared set.
fn peer_match(base: &str, family: Family, end: End) -> Vec<Expr> {
    let tag_register = match family {
        Family::V4 => ruleset::REG32_01,
        Family::V6 => ruleset::REG_2,
    };
    [
        nfproto(family).to_vec(),
        vec![
            address(family, end, ruleset::REG_1),
            Expr::Immediate {
                dreg: tag_register,
                data: tag_of(base).to_vec(),
            },
            lookup(SetRef::Named(peers_set(base, family).name)),
        ],
    ]
    .concat()
}

/// The rules of an allow list's chain: for each allow, a rule per peer
/// set and family and per port range, that returns; then `drop`.
fn chain_rules(list: &AllowList, peer_sets: &BTreeMap<String, Vec<Interval>>) -> Vec<Rule> {
    let end = match list.direction {
        Direction::Ingress => End::Source,
        Direction::Egress => End::Destination,
    };
    let mut rules = Vec::new();
    let untagged = |exprs: Vec<Expr>| Rule { exprs, comment: None };
    let ret = Expr::Verdict(Verdict::Return);
    for Allow { peers, ports } in &list.allows {
        let ports: Vec<Vec<Expr>> = match ports {
            None => vec![Vec::new()],
            Some(ranges) => ranges.iter().map(port_match).collect(),
        };
        let peers: Vec<Vec<Expr>> = match peers {
            None => vec![Vec::new()],
            Some(sets) => sets
                .iter()
                .flat_map(|set| {
                    FAMILIES
                        .into_iter()
                        .filter(|f| has_family(peer_sets, set, *f))
                        .map(move |family| peer_match(set, family, end))
                })
                .collect(),
        };
        for peer in &peers {
            for port in &ports {
                rules.push(untagged([peer.clone(), port.clone(), vec![ret.clone()]].concat()));
            }
        }
    }
    rules.push(untagged(vec![Expr::Verdict(Verdict::Drop)]));
    rules
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
    set: &Set,
    have: &BTreeSet<T>,
    want: &BTreeSet<T>,
    element: impl Fn(&T) -> Element,
) -> Vec<Op> {
    let gone: Vec<Element> = have.difference(want).map(&element).collect();
    let new: Vec<Element> = want.difference(have).map(&element).collect();
    let mut ops = Vec::new();
    if !gone.is_empty() {
        ops.push(Op::DeleteElements {
            set: set.clone(),
            elements: gone,
        });
    }
    if !new.is_empty() {
        ops.push(Op::AddElements {
            set: set.clone(),
            elements: new,
        });
    }
    ops
}

fn map_set(direction: Direction, family: Family) -> Set {
    Set {
        name: map_name(direction, family),
        key: vec![address_field(family)],
        kind: SetKind::VerdictMap,
    }
}

fn self_pairs(family: Family) -> Set {
    let field = address_field(family);
    Set {
        name: self_set(family).to_owned(),
        key: vec![field, field],
        kind: SetKind::Plain,
    }
}

fn guarded_set() -> Set {
    Set {
        name: GUARDED_NAMESPACES.to_owned(),
        key: vec![Field::Text],
        kind: SetKind::Plain,
    }
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
            if !current.maps.contains_key(&map_name(direction, family)) {
                ops.push(Op::AddSet(map_set(direction, family)));
            }
        }
    }
    // A pod's own traffic: every isolated local address, paired with itself.
    let none = BTreeSet::new();
    for family in FAMILIES {
        let set = self_pairs(family);
        let have = current.selves.get(&set.name).unwrap_or_else(|| {
            ops.push(Op::AddSet(set.clone()));
            &none
        });
        ops.extend(element_changes(
            &set,
            have,
            &isolated_addresses(compiled, family),
            |ip| pair(*ip),
        ));
    }
    let no_names = BTreeSet::new();
    let guarded = current.guarded.as_ref().unwrap_or_else(|| {
        ops.push(Op::AddSet(guarded_set()));
        &no_names
    });
    // A namespace's name is at most 63 bytes: every one fits a key.
    ops.extend(element_changes(
        &guarded_set(),
        guarded,
        &compiled.guarded,
        |name| Element::key(Value::text(name).unwrap_or_else(|| Value(vec![0; ruleset::TEXT_LEN]))),
    ));
    // The peer sets' tagged members (a policy's new block set written
    // whole; one no policy has any more removed at the end, whole).
    let wanted = wanted_peers(compiled);
    let no_members = BTreeSet::new();
    for (name, WantedPeers { set, kind, members }) in &wanted {
        let have = current.peers.get(name).unwrap_or_else(|| {
            ops.push(Op::AddSet(set.clone()));
            &no_members
        });
        ops.extend(element_changes(set, have, members, |member| {
            tagged_element(*kind, member)
        }));
    }
    // Chains, before anything jumps to them; one whose rules someone
    // changed is written again.
    for (name, list) in &compiled.lists {
        let rules = match current.chains.get(name) {
            Some(Chain::AsNamed) => continue,
            Some(Chain::Rules(have)) => {
                let rules = chain_rules(list, &compiled.peer_sets);
                if *have == rules {
                    continue;
                }
                ops.push(Op::FlushChain(name.clone()));
                rules
            }
            None => {
                ops.push(Op::AddChain {
                    name: name.clone(),
                    base: None,
                });
                chain_rules(list, &compiled.peer_sets)
            }
        };
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
            let set = map_set(direction, family);
            let empty = BTreeMap::new();
            let have = current.maps.get(&set.name).unwrap_or(&empty);
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
                    set: set.clone(),
                    elements: gone,
                });
            }
            if !new.is_empty() {
                ops.push(Op::AddElements { set, elements: new });
            }
        }
    }
    // Chains and sets nothing refers to any more.
    for name in current.chains.keys().filter(|c| !compiled.lists.contains_key(*c)) {
        ops.push(Op::FlushChain(name.clone()));
        ops.push(Op::DeleteChain(name.clone()));
    }
    for name in current
        .peers
        .keys()
        .filter(|name| !wanted.contains_key(*name))
        .chain(&current.stale_sets)
    {
        ops.push(Op::DeleteSet(name.clone()));
    }
    ops
}

#[cfg(test)]
mod tests;
