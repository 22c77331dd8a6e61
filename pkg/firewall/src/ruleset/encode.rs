//! The model as nf_tables messages (`netlink-packet-netfilter`'s types),
//! laid out as `nft` lays out the same objects: what `nft --debug=netlink`
//! prints for a rule is what is sent for it.

use netlink_packet_core::{DefaultNla, NLA_F_NESTED, NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE};
use netlink_packet_netfilter::nftables::{
    Bitwise, ChainAttribute, ChainMessage, Cmp, DataAttribute, Expressions, Hook as HookAttribute,
    HookNumber, Immediate, InetHookNumber, ListAttribute, Lookup, Meta, MetaKey, NfTablesMessage, Operator,
    Payload, Register, RuleAttribute, RuleMessage, SetAttribute, SetDescription, SetElementAttribute,
    SetElementFlags, SetElementList, SetElementMessage, SetFlags, SetMessage, TableAttribute, TableMessage,
    Verdict as VerdictCode, VerdictAttribute,
};
use netlink_packet_netfilter::none::ControlMessage;
use netlink_packet_netfilter::{NetfilterProtoFamily, NetfilterSubsystem};

use super::{AnonymousSet, BaseChain, Compare, Element, Expr, Op, Rule, Set, SetKind, SetRef, Verdict};
use super::{TableFamily, key_len, key_type};
use crate::Result;
use crate::nfnl::serialize;

/// `NFT_DATA_VERDICT`: a verdict map's data type.
const DATA_VERDICT: u32 = 0xffff_ff00;
/// `sizeof(struct nft_verdict)`, what the kernel reports as a verdict
/// map's data length (and nft sends).
const VERDICT_LEN: u32 = 16;
/// `NF_DROP`, `NF_ACCEPT`.
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
/// `NFTA_LIST_ELEM`, `NFTA_SET_FIELD_LEN`, `NFTA_DATA_VALUE`.
const LIST_ELEM: u16 = 1;
const SET_FIELD_LEN: u16 = 1;
const DATA_VALUE: u16 = 1;
/// `ct` attributes (the crate does not model the expression).
pub(super) const CT_DREG: u16 = 1;
pub(super) const CT_KEY: u16 = 2;
/// How a rule's own sets are named: as `nft` names them, with a number
/// of this batch's own rather than `%d` for the kernel to number, which
/// costs it a scan of every set of the table per set (16 s for 10,000
/// anonymous sets in one batch here).
const ANONYMOUS_PREFIX: &str = "__set";
/// Elements per message: a message's nested attributes are at most 64 KiB
/// (a `u16` length), and an IPv6 interval takes about 60 bytes.
const ELEMENTS_PER_MESSAGE: usize = 512;

/// The batch: its begin marker, the messages with their sequence numbers
/// from 1, the end marker; only the last message asks for an ACK, every
/// failing one is answered with its error anyway.
pub(super) struct Batch {
    pub bytes: Vec<u8>,
    /// The op each sequence number (from 1) came from.
    pub ops_by_sequence: Vec<usize>,
    pub descriptions: Vec<String>,
}

struct Encoder<'a> {
    family: TableFamily,
    table: &'a str,
    messages: Vec<(NfTablesMessage, u16, usize)>,
    next_set_id: u32,
    /// This batch's mark in its anonymous sets' names: no set of an
    /// earlier batch has it.
    batch_mark: String,
}

pub(super) fn batch(family: TableFamily, table: &str, ops: &[Op]) -> Result<Batch> {
    let mut encoder = Encoder {
        family,
        table,
        messages: Vec::new(),
        next_set_id: 1,
        batch_mark: batch_mark(),
    };
    for (index, op) in ops.iter().enumerate() {
        encoder.op(index, op)?;
    }
    let subsystem = u16::from(u8::from(NetfilterSubsystem::NfTables));
    let marker = |marker: ControlMessage, sequence: u32| {
        serialize(marker, NetfilterProtoFamily::Unspec, subsystem, 0, sequence)
    };
    let last = encoder.messages.len();
    let mut bytes = marker(ControlMessage::BatchBegin, 0);
    let mut ops_by_sequence = Vec::with_capacity(last);
    for (at, (message, flags, op)) in encoder.messages.into_iter().enumerate() {
        let sequence = u32::try_from(at + 1).map_err(|_| super::invalid("too many messages in one batch"))?;
        let flags = if at + 1 == last { flags | NLM_F_ACK } else { flags };
        bytes.extend(serialize(
            message,
            encoder.family.proto_family(),
            0,
            flags,
            sequence,
        ));
        ops_by_sequence.push(op);
    }
    bytes.extend(marker(
        ControlMessage::BatchEnd,
        u32::try_from(last + 1).unwrap_or(u32::MAX),
    ));
    Ok(Batch {
        bytes,
        ops_by_sequence,
        descriptions: ops.iter().map(ToString::to_string).collect(),
    })
}

impl Encoder<'_> {
    fn push(&mut self, message: NfTablesMessage, flags: u16, op: usize) {
        self.messages.push((message, flags, op));
    }

    fn op(&mut self, index: usize, op: &Op) -> Result<()> {
        let table = self.table.to_owned();
        match op {
            Op::AddTable => self.push(
                NfTablesMessage::NewTable(TableMessage {
                    attributes: vec![TableAttribute::Name(table)],
                }),
                NLM_F_CREATE,
                index,
            ),
            Op::DeleteTable => self.push(
                NfTablesMessage::DeleteTable(TableMessage {
                    attributes: vec![TableAttribute::Name(table)],
                }),
                0,
                index,
            ),
            Op::AddChain { name, base } => {
                let mut attributes = vec![ChainAttribute::Table(table), ChainAttribute::Name(name.clone())];
                if let Some(base) = base {
                    attributes.extend(base_chain(*base));
                }
                self.push(
                    NfTablesMessage::NewChain(ChainMessage { attributes }),
                    NLM_F_CREATE,
                    index,
                );
            }
            Op::FlushChain(name) => self.push(
                // A rule deletion naming only the chain empties it.
                NfTablesMessage::DeleteRule(RuleMessage {
                    attributes: vec![RuleAttribute::Table(table), RuleAttribute::Chain(name.clone())],
                }),
                0,
                index,
            ),
            Op::DeleteRule { chain, handle } => self.push(
                NfTablesMessage::DeleteRule(RuleMessage {
                    attributes: vec![
                        RuleAttribute::Table(table),
                        RuleAttribute::Chain(chain.clone()),
                        RuleAttribute::Handle(*handle),
                    ],
                }),
                0,
                index,
            ),
            Op::DeleteChain(name) => self.push(
                NfTablesMessage::DeleteChain(ChainMessage {
                    attributes: vec![ChainAttribute::Table(table), ChainAttribute::Name(name.clone())],
                }),
                0,
                index,
            ),
            Op::AddRule { chain, rule } => self.rule(index, chain, rule)?,
            Op::AddSet(set) => {
                let id = self.set_id();
                self.push(
                    NfTablesMessage::NewSet(SetMessage {
                        attributes: named_set(&table, set, id)?,
                    }),
                    NLM_F_CREATE,
                    index,
                );
            }
            Op::DeleteSet(name) => self.push(
                NfTablesMessage::DeleteSet(SetMessage {
                    attributes: vec![SetAttribute::Table(table), SetAttribute::Name(name.clone())],
                }),
                0,
                index,
            ),
            Op::AddElements { set, elements } | Op::DeleteElements { set, elements } => {
                let adding = matches!(op, Op::AddElements { .. });
                let concat = set.concat_intervals();
                for chunk in elements.chunks(ELEMENTS_PER_MESSAGE) {
                    let message = SetElementMessage {
                        attributes: vec![
                            SetElementList::Table(table.clone()),
                            SetElementList::Set(set.name.clone()),
                            SetElementList::Elements(
                                chunk.iter().flat_map(|e| encoded_element(e, concat)).collect(),
                            ),
                        ],
                    };
                    if adding {
                        self.push(NfTablesMessage::NewSetElement(message), NLM_F_CREATE, index);
                    } else {
                        self.push(NfTablesMessage::DeleteSetElement(message), 0, index);
                    }
                }
            }
        }
        Ok(())
    }

    fn set_id(&mut self) -> u32 {
        let id = self.next_set_id;
        self.next_set_id += 1;
        id
    }

    /// A rule and, before it, the sets it owns with their elements.
    fn rule(&mut self, index: usize, chain: &str, rule: &Rule) -> Result<()> {
        let mut expressions = Vec::with_capacity(rule.exprs.len());
        for expr in &rule.exprs {
            let anonymous = match expr {
                Expr::Lookup {
                    set: SetRef::Anonymous(set),
                    ..
                } => Some(self.anonymous_set(index, set)?),
                _ => None,
            };
            expressions.push(ListAttribute::from(expression(expr, anonymous)?));
        }
        let mut attributes = vec![
            RuleAttribute::Table(self.table.to_owned()),
            RuleAttribute::Chain(chain.to_owned()),
            RuleAttribute::Expressions(expressions),
        ];
        if let Some(comment) = &rule.comment {
            attributes.push(RuleAttribute::UserData(comment_data(comment)));
        }
        self.push(
            NfTablesMessage::NewRule(RuleMessage { attributes }),
            NLM_F_CREATE | NLM_F_APPEND,
            index,
        );
        Ok(())
    }

    fn anonymous_set(&mut self, index: usize, set: &AnonymousSet) -> Result<(u32, String)> {
        let id = self.set_id();
        let name = format!("{ANONYMOUS_PREFIX}{}{id}", self.batch_mark);
        let table = self.table.to_owned();
        let concat = set.key.len() > 1;
        let mut flags = SetFlags::Anonymous | SetFlags::Constant;
        let mut description = vec![SetDescription::Size(count(set.elements.len())?)];
        if set.intervals() {
            flags |= SetFlags::Interval;
            if concat {
                flags |= SetFlags::Concat;
                description.push(concat_description(&set.key));
            }
        }
        self.push(
            NfTablesMessage::NewSet(SetMessage {
                attributes: vec![
                    SetAttribute::Table(table.clone()),
                    SetAttribute::Name(name.clone()),
                    SetAttribute::Flags(flags),
                    SetAttribute::KeyType(key_type(&set.key)),
                    SetAttribute::KeyLen(count(key_len(&set.key))?),
                    SetAttribute::Id(id),
                    SetAttribute::Description(description),
                ],
            }),
            NLM_F_CREATE,
            index,
        );
        let elements: Vec<_> = set.elements.iter().cloned().collect();
        let concat_intervals = concat && set.intervals();
        for chunk in elements.chunks(ELEMENTS_PER_MESSAGE) {
            let encoded = chunk
                .iter()
                .flat_map(|e| encoded_element(e, concat_intervals))
                .collect();
            self.push(
                NfTablesMessage::NewSetElement(SetElementMessage {
                    attributes: vec![
                        SetElementList::Table(table.clone()),
                        SetElementList::Set(name.clone()),
                        SetElementList::SetId(id),
                        SetElementList::Elements(encoded),
                    ],
                }),
                NLM_F_CREATE,
                index,
            );
        }
        Ok((id, name))
    }
}

/// 16 hex digits no earlier batch used (the clock and the process, hashed
/// by the standard library's randomly keyed hasher).
fn batch_mark() -> String {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    std::time::SystemTime::now().hash(&mut hasher);
    std::process::id().hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

fn count(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| super::invalid(format!("{n} is too many")))
}

/// A netlink attribute's bytes: length, type, value, padded to 4 (the
/// values written here are a few bytes: a field's length).
fn nla(kind: u16, value: &[u8; 4]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut bytes = Vec::with_capacity(len.div_ceil(4) * 4);
    bytes.extend_from_slice(&(len as u16).to_ne_bytes());
    bytes.extend_from_slice(&kind.to_ne_bytes());
    bytes.extend_from_slice(value);
    bytes.resize(len.div_ceil(4) * 4, 0);
    bytes
}

fn base_chain(base: BaseChain) -> Vec<ChainAttribute> {
    let hook = match base.hook {
        super::Hook::Input => InetHookNumber::LocalIn,
        super::Hook::Forward => InetHookNumber::Forward,
    };
    vec![
        ChainAttribute::Hook(vec![
            HookAttribute::Number(HookNumber::Inet(hook)),
            // `priority filter`.
            HookAttribute::Priority(0),
        ]),
        ChainAttribute::Type("filter".to_owned()),
        ChainAttribute::Policy(NF_ACCEPT),
    ]
}

/// The field lengths pipapo matches a concatenation's intervals by.
fn concat_description(key: &[super::Field]) -> SetDescription {
    SetDescription::Concat(
        key.iter()
            .map(|f| {
                let len = u32::try_from(f.size()).unwrap_or(u32::MAX);
                DefaultNla::new(LIST_ELEM | NLA_F_NESTED, nla(SET_FIELD_LEN, &len.to_be_bytes()))
            })
            .collect(),
    )
}

fn named_set(table: &str, set: &Set, id: u32) -> Result<Vec<SetAttribute>> {
    let mut attributes = vec![
        SetAttribute::Table(table.to_owned()),
        SetAttribute::Name(set.name.clone()),
    ];
    match set.kind {
        SetKind::Plain => {}
        SetKind::Intervals if set.concat_intervals() => {
            attributes.push(SetAttribute::Flags(SetFlags::Interval | SetFlags::Concat));
        }
        SetKind::Intervals => attributes.push(SetAttribute::Flags(SetFlags::Interval)),
        SetKind::VerdictMap => attributes.push(SetAttribute::Flags(SetFlags::Map)),
    }
    attributes.push(SetAttribute::KeyType(key_type(&set.key)));
    attributes.push(SetAttribute::KeyLen(count(key_len(&set.key))?));
    if set.kind == SetKind::VerdictMap {
        attributes.push(SetAttribute::DataType(DATA_VERDICT));
        attributes.push(SetAttribute::DataLen(VERDICT_LEN));
    }
    attributes.push(SetAttribute::Id(id));
    if set.concat_intervals() {
        attributes.push(SetAttribute::Description(vec![concat_description(&set.key)]));
    }
    Ok(attributes)
}

/// An element as its set keeps it: a concatenation's interval in one
/// element, anything else as [`named_set_element`] writes it.
fn encoded_element(element: &Element, concat_intervals: bool) -> Vec<ListAttribute<SetElementAttribute>> {
    if concat_intervals {
        vec![concat_interval_element(element)]
    } else {
        named_set_element(element)
    }
}

fn value(bytes: &[u8]) -> DataAttribute {
    DataAttribute::Value(bytes.to_vec())
}

/// An element of a hash, a verdict map or an interval set (the kernel's
/// rbtree keeps an interval as its first key and, flagged as an end, the
/// key after its last; an interval up to the largest key has no end).
fn named_set_element(element: &Element) -> Vec<ListAttribute<SetElementAttribute>> {
    let mut first = vec![SetElementAttribute::Key(value(&element.key.0))];
    if let Some(verdict) = &element.verdict {
        first.push(SetElementAttribute::Data(DataAttribute::Verdict(
            verdict_attributes(verdict),
        )));
    }
    let mut encoded = vec![ListAttribute::Element(first)];
    if let Some(end) = element.last.as_ref().and_then(super::Value::successor) {
        encoded.push(ListAttribute::Element(vec![
            SetElementAttribute::Key(value(&end.0)),
            SetElementAttribute::Flags(SetElementFlags::IntervalEnd),
        ]));
    }
    encoded
}

/// An element of a concatenation's intervals (the kernel's pipapo): its
/// first and last key in one element.
fn concat_interval_element(element: &Element) -> ListAttribute<SetElementAttribute> {
    let last = element.last.as_ref().unwrap_or(&element.key);
    ListAttribute::Element(vec![
        SetElementAttribute::Key(value(&element.key.0)),
        SetElementAttribute::KeyEnd(vec![DefaultNla::new(DATA_VALUE, last.0.clone())]),
    ])
}

fn verdict_attributes(verdict: &Verdict) -> Vec<VerdictAttribute> {
    match verdict {
        Verdict::Accept => vec![VerdictAttribute::Code(VerdictCode::Other(NF_ACCEPT))],
        Verdict::Drop => vec![VerdictAttribute::Code(VerdictCode::Other(NF_DROP))],
        Verdict::Return => vec![VerdictAttribute::Code(VerdictCode::Return)],
        Verdict::Jump(chain) => vec![
            VerdictAttribute::Code(VerdictCode::Jump),
            VerdictAttribute::Chain(chain.clone()),
        ],
    }
}

fn comment_data(comment: &str) -> Vec<u8> {
    let text = crate::nft::fit_comment(comment.to_owned());
    let mut data = vec![
        crate::nfnl::NFTNL_UDATA_RULE_COMMENT,
        u8::try_from(text.len() + 1).unwrap_or(u8::MAX),
    ];
    data.extend_from_slice(text.as_bytes());
    data.push(0);
    data
}

fn be32(value: u32) -> Vec<u8> {
    value.to_be_bytes().to_vec()
}

/// One expression; `anonymous` is the id and name of the anonymous set
/// written before it.
fn expression(expr: &Expr, anonymous: Option<(u32, String)>) -> Result<Expressions> {
    Ok(match expr {
        Expr::Meta { key, dreg } => Expressions::Meta(vec![
            Meta::Key(MetaKey::from(*key)),
            Meta::DestinationRegister(Register::from(*dreg)),
        ]),
        Expr::Ct { key, dreg } => Expressions::Other {
            expression_type: "ct".to_owned(),
            attributes: vec![
                DefaultNla::new(CT_DREG, be32(*dreg)),
                DefaultNla::new(CT_KEY, be32(*key)),
            ],
        },
        Expr::Payload {
            base,
            offset,
            len,
            dreg,
        } => Expressions::Payload(vec![
            Payload::DestinationRegister(Register::from(*dreg)),
            Payload::Base(*base),
            Payload::Offset(*offset),
            Payload::Len(*len),
        ]),
        Expr::Cmp { sreg, op, data } => Expressions::Cmp(vec![
            Cmp::SourceRegister(Register::from(*sreg)),
            Cmp::Op(match op {
                Compare::Eq => Operator::Equal,
                Compare::Neq => Operator::NotEqual,
                Compare::Gte => Operator::GreatherThanEqual,
                Compare::Lte => Operator::LessThanEqual,
            }),
            Cmp::Data(value(data)),
        ]),
        Expr::Immediate { dreg, data } => Expressions::Immediate(vec![
            Immediate::DestinationRegister(Register::from(*dreg)),
            Immediate::Data(value(data)),
        ]),
        Expr::Bitwise {
            sreg,
            dreg,
            mask,
            xor,
        } => Expressions::Bitwise(vec![
            Bitwise::SourceRegister(Register::from(*sreg)),
            Bitwise::DestinationRegister(Register::from(*dreg)),
            Bitwise::Length(u32::try_from(mask.len()).unwrap_or(u32::MAX)),
            Bitwise::Mask(value(mask)),
            Bitwise::Xor(value(xor)),
        ]),
        Expr::Lookup {
            sreg,
            set,
            verdict_map,
        } => {
            let mut attributes = Vec::new();
            match (set, anonymous) {
                (SetRef::Named(name), _) => attributes.push(Lookup::Set(name.clone())),
                (SetRef::Anonymous(_), Some((id, name))) => {
                    attributes.push(Lookup::Set(name));
                    attributes.push(Lookup::SetId(id));
                }
                (SetRef::Anonymous(_), None) => return Err(super::invalid("an anonymous set not written")),
            }
            attributes.push(Lookup::SourceRegister(Register::from(*sreg)));
            if *verdict_map {
                attributes.push(Lookup::DestinationRegister(Register::Verdict));
            }
            attributes.push(Lookup::Flags(0));
            Expressions::Lookup(attributes)
        }
        Expr::Verdict(verdict) => Expressions::Immediate(vec![
            Immediate::DestinationRegister(Register::Verdict),
            Immediate::Data(DataAttribute::Verdict(verdict_attributes(verdict))),
        ]),
        Expr::Foreign(kind) => {
            return Err(super::invalid(format!(
                "a `{kind}` expression read back cannot be written"
            )));
        }
    })
}
