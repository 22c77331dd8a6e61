//! What the kernel dumps, back into the model (rules and elements read
//! from their attributes by hand, tables, chains and sets through the
//! netfilter crate): a rule written from an
//! [`Expr`] list decodes to the same list, and anything this model does
//! not write (someone else's rule, an inverted lookup) decodes to
//! [`Expr::Foreign`], equal to nothing a caller renders.

use std::collections::{BTreeMap, BTreeSet};

use netlink_packet_netfilter::nftables::{
    ChainAttribute, ChainMessage, Hook as HookAttribute, HookNumber, InetHookNumber, SetAttribute, SetFlags,
    SetMessage, Verdict as VerdictCode, VerdictAttribute,
};

use super::encode::{CT_DREG, CT_KEY};
use super::{
    AnonymousSet, BaseChain, Compare, Element, Expr, Field, Hook, Key, ReadChain, Rule, Set, SetKind, SetRef,
    TYPE_BITS, Value, Verdict, key_len,
};
use crate::Result;

/// A set as listed, before its elements are read.
#[derive(Debug, Clone)]
pub(crate) struct DumpedSet {
    pub name: String,
    flags: SetFlags,
    /// None: a key type this model does not write.
    key: Option<Key>,
    /// How many elements the kernel holds (rbtree end markers included),
    /// where it says (`NFTA_SET_COUNT`, Linux 6.x).
    pub count: Option<u32>,
}

impl DumpedSet {
    /// The named set, None for an anonymous one.
    pub fn as_named(&self) -> Option<Set> {
        if self.flags.contains(SetFlags::Anonymous) {
            return None;
        }
        let kind = if self.flags.contains(SetFlags::Map) {
            SetKind::VerdictMap
        } else if self.flags.contains(SetFlags::Interval) {
            SetKind::Intervals
        } else {
            SetKind::Plain
        };
        Some(Set {
            name: self.name.clone(),
            key: self.key.clone().unwrap_or_default(),
            kind,
        })
    }

    pub fn anonymous(&self, elements: BTreeSet<Element>) -> AnonymousSet {
        AnonymousSet {
            key: self.key.clone().unwrap_or_default(),
            elements,
        }
    }

    /// Intervals as the rbtree keeps them: a first key, an end marker.
    fn has_end_markers(&self) -> bool {
        self.flags.contains(SetFlags::Interval) && !self.flags.contains(SetFlags::Concat)
    }
}

fn field_of(type_id: u32) -> Option<Field> {
    [
        Field::Ipv4,
        Field::Ipv6,
        Field::InetProto,
        Field::InetService,
        Field::Icmpv6Type,
        Field::Text,
        Field::Mark,
    ]
    .into_iter()
    .find(|f| f.type_id() == type_id)
}

/// The fields of a key type id (nft's: 6 bits a field), checked against
/// the key's length.
fn key_of(mut type_id: u32, len: u32) -> Option<Key> {
    let mut fields = Vec::new();
    while type_id != 0 {
        fields.push(field_of(type_id & ((1 << TYPE_BITS) - 1))?);
        type_id >>= TYPE_BITS;
    }
    fields.reverse();
    (!fields.is_empty() && key_len(&fields) == len as usize).then_some(fields)
}

pub(crate) fn set(message: &SetMessage, table: &str) -> Option<DumpedSet> {
    let (mut name, mut flags, mut key_type, mut len, mut in_table) = (None, SetFlags::empty(), 0, 0, false);
    let mut count = None;
    for attribute in &message.attributes {
        match attribute {
            SetAttribute::Count(n) => count = Some(*n),
            SetAttribute::Table(t) => in_table = t == table,
            SetAttribute::Name(n) => name = Some(n.clone()),
            SetAttribute::Flags(f) => flags = *f,
            SetAttribute::KeyType(t) => key_type = *t,
            SetAttribute::KeyLen(l) => len = *l,
            _ => {}
        }
    }
    in_table.then_some(())?;
    Some(DumpedSet {
        name: name?,
        flags,
        key: key_of(key_type, len),
        count,
    })
}

fn verdict(attributes: &[VerdictAttribute]) -> Option<Verdict> {
    let code = attributes.iter().find_map(|a| match a {
        VerdictAttribute::Code(code) => Some(*code),
        _ => None,
    })?;
    let chain = attributes.iter().find_map(|a| match a {
        VerdictAttribute::Chain(chain) => Some(chain.clone()),
        _ => None,
    });
    match (u32::from(code), chain) {
        (0, None) => Some(Verdict::Drop),
        (1, None) => Some(Verdict::Accept),
        (_, None) if code == VerdictCode::Return => Some(Verdict::Return),
        (_, Some(chain)) if code == VerdictCode::Jump => Some(Verdict::Jump(chain)),
        _ => None,
    }
}

/// The attributes in `bytes`: kind (flags cleared) and value.
fn attributes(mut bytes: &[u8]) -> Result<Vec<(u16, &[u8])>> {
    let mut found = Vec::new();
    while bytes.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([bytes[0], bytes[1]]));
        let kind = u16::from_ne_bytes([bytes[2], bytes[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > bytes.len() {
            return Err(super::invalid("an attribute cut short"));
        }
        found.push((kind, &bytes[4..len]));
        // Each attribute is padded to 4 bytes; the last one may not be.
        bytes = &bytes[(len.div_ceil(4) * 4).min(bytes.len())..];
    }
    Ok(found)
}

/// An attribute's type without `NLA_F_NESTED` and `NLA_F_NET_BYTEORDER`.
const NLA_TYPE_MASK: u16 = 0x3fff;
const ELEM_LIST_ELEMENTS: u16 = 3;
const LIST_ELEM: u16 = 1;
const ELEM_KEY: u16 = 1;
const ELEM_DATA: u16 = 2;
const ELEM_FLAGS: u16 = 3;
const ELEM_KEY_END: u16 = 10;
const DATA_VALUE: u16 = 1;
const DATA_VERDICT: u16 = 2;
const VERDICT_CODE: u16 = 1;
const VERDICT_CHAIN: u16 = 2;
const ELEM_INTERVAL_END: u32 = 1;

/// One element as dumped.
pub(crate) struct DumpedElement {
    pub key: Value,
    last: Option<Value>,
    verdict: Option<Verdict>,
    pub end_marker: bool,
}

fn data_value(bytes: &[u8]) -> Result<Option<Value>> {
    Ok(attributes(bytes)?
        .into_iter()
        .find(|(kind, _)| *kind == DATA_VALUE)
        .map(|(_, value)| Value(value.to_vec())))
}

fn data_verdict(bytes: &[u8]) -> Result<Option<Verdict>> {
    let Some((_, nested)) = attributes(bytes)?
        .into_iter()
        .find(|(kind, _)| *kind == DATA_VERDICT)
    else {
        return Ok(None);
    };
    let (mut code, mut chain) = (None, None);
    for (kind, value) in attributes(nested)? {
        match kind {
            VERDICT_CODE => code = be32(value),
            VERDICT_CHAIN => {
                chain = Some(
                    String::from_utf8_lossy(value.split(|b| *b == 0).next().unwrap_or_default()).into_owned(),
                )
            }
            _ => {}
        }
    }
    let mut list = vec![];
    if let Some(code) = code {
        list.push(VerdictAttribute::Code(VerdictCode::from(code)));
    }
    if let Some(chain) = chain {
        list.push(VerdictAttribute::Chain(chain));
    }
    Ok(verdict(&list))
}

/// The elements of one element dump message's attributes.
pub(crate) fn element_attributes(bytes: &[u8]) -> Result<Vec<DumpedElement>> {
    let mut found = Vec::new();
    for (kind, list) in attributes(bytes)? {
        if kind != ELEM_LIST_ELEMENTS {
            continue;
        }
        for (kind, element) in attributes(list)? {
            if kind != LIST_ELEM {
                continue;
            }
            let (mut key, mut last, mut verdict_of, mut end_marker) = (None, None, None, false);
            for (kind, value) in attributes(element)? {
                match kind {
                    ELEM_KEY => key = data_value(value)?,
                    ELEM_KEY_END => last = data_value(value)?,
                    ELEM_DATA => verdict_of = data_verdict(value)?,
                    ELEM_FLAGS => end_marker = be32(value).is_some_and(|f| f & ELEM_INTERVAL_END != 0),
                    _ => {}
                }
            }
            let key = key.ok_or_else(|| super::invalid("an element without a key"))?;
            found.push(DumpedElement {
                key,
                last,
                verdict: verdict_of,
                end_marker,
            });
        }
    }
    Ok(found)
}

/// A set's elements from its dump.
pub(crate) fn elements(set: &DumpedSet, dumped: Vec<DumpedElement>) -> Result<BTreeSet<Element>> {
    if !set.has_end_markers() {
        return Ok(dumped
            .into_iter()
            .map(|e| Element {
                key: e.key,
                last: e.last,
                verdict: e.verdict,
            })
            .collect());
    }
    let mut keys: Vec<(Value, bool)> = dumped.into_iter().map(|e| (e.key, e.end_marker)).collect();
    // Ascending, an end marker before a first key equal to it (an
    // interval right after another).
    keys.sort_by(|(a, a_end), (b, b_end)| a.cmp(b).then(b_end.cmp(a_end)));
    let mut elements = BTreeSet::new();
    let mut open: Option<Value> = None;
    for (key, end) in keys {
        match (end, open.take()) {
            (true, Some(first)) => {
                let last = key.predecessor().unwrap_or_else(|| key.clone());
                elements.insert(Element::interval(first, last));
            }
            // nft's marker before the first interval.
            (true, None) => {}
            (false, previous) => {
                if let Some(first) = previous {
                    elements.insert(Element::interval(first, key.clone()));
                }
                open = Some(key);
            }
        }
    }
    if let Some(first) = open {
        let last = Value(vec![u8::MAX; first.0.len()]);
        elements.insert(Element::interval(first, last));
    }
    Ok(elements)
}

pub(crate) fn chain(message: &ChainMessage, table: &str) -> Option<(String, ReadChain)> {
    let (mut name, mut in_table, mut hook, mut priority, mut policy, mut kind) =
        (None, false, None, None, None, None);
    for attribute in &message.attributes {
        match attribute {
            ChainAttribute::Table(t) => in_table = t == table,
            ChainAttribute::Name(n) => name = Some(n.clone()),
            ChainAttribute::Hook(hooks) => {
                for h in hooks {
                    match h {
                        HookAttribute::Number(number) => hook = Some(*number),
                        HookAttribute::Priority(p) => priority = Some(*p),
                        _ => {}
                    }
                }
            }
            ChainAttribute::Policy(p) => policy = Some(*p),
            ChainAttribute::Type(t) => kind = Some(t.clone()),
            _ => {}
        }
    }
    in_table.then_some(())?;
    let base = match (hook, priority, policy, kind.as_deref()) {
        (Some(HookNumber::Inet(number)), Some(0), Some(1), Some("filter")) => match number {
            InetHookNumber::LocalIn => Some(BaseChain { hook: Hook::Input }),
            InetHookNumber::Forward => Some(BaseChain { hook: Hook::Forward }),
            _ => None,
        },
        _ => None,
    };
    Some((
        name?,
        ReadChain {
            base,
            hooked: hook.is_some(),
            rules: Vec::new(),
        },
    ))
}

fn foreign(what: &str) -> Expr {
    Expr::Foreign(what.to_owned())
}

fn be32(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(bytes.try_into().ok()?))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes.split(|b| *b == 0).next().unwrap_or_default()).into_owned()
}

/// An expression's attributes by kind: each kind once, u32s read as the
/// kernel writes them (big-endian).
struct Attributes<'a>(Vec<(u16, &'a [u8])>);

impl<'a> Attributes<'a> {
    fn of(bytes: &'a [u8]) -> Option<Attributes<'a>> {
        attributes(bytes).ok().map(Attributes)
    }

    fn get(&self, kind: u16) -> Option<&'a [u8]> {
        self.0.iter().find(|(k, _)| *k == kind).map(|(_, v)| *v)
    }

    fn u32(&self, kind: u16) -> Option<u32> {
        self.get(kind).and_then(be32)
    }

    /// Whether every attribute is one of `known` (an attribute this model
    /// does not write makes the expression someone else's).
    fn only(&self, known: &[u16]) -> bool {
        self.0.iter().all(|(k, _)| known.contains(k))
    }
}

// The expressions' attributes (`NFTA_<EXPR>_*` in nf_tables.h).
const META_DREG: u16 = 1;
const META_KEY: u16 = 2;
const PAYLOAD_DREG: u16 = 1;
const PAYLOAD_BASE: u16 = 2;
const PAYLOAD_OFFSET: u16 = 3;
const PAYLOAD_LEN: u16 = 4;
const CMP_SREG: u16 = 1;
const CMP_OP: u16 = 2;
const CMP_DATA: u16 = 3;
const IMMEDIATE_DREG: u16 = 1;
const IMMEDIATE_DATA: u16 = 2;
const LOOKUP_SET: u16 = 1;
const LOOKUP_SREG: u16 = 2;
const LOOKUP_DREG: u16 = 3;
const LOOKUP_SET_ID: u16 = 4;
const LOOKUP_FLAGS: u16 = 5;
const BITWISE_SREG: u16 = 1;
const BITWISE_DREG: u16 = 2;
const BITWISE_LEN: u16 = 3;
const BITWISE_MASK: u16 = 4;
const BITWISE_XOR: u16 = 5;
const BITWISE_OP: u16 = 6;
/// `NFT_CMP_*`.
const CMP_EQ: u32 = 0;
const CMP_NEQ: u32 = 1;
const CMP_LTE: u32 = 3;
const CMP_GTE: u32 = 5;
// A rule's attributes.
const RULE_TABLE: u16 = 1;
const RULE_CHAIN: u16 = 2;
const RULE_EXPRESSIONS: u16 = 4;
const RULE_USERDATA: u16 = 7;
const EXPR_NAME: u16 = 1;
const EXPR_DATA: u16 = 2;

fn meta(a: &Attributes<'_>) -> Option<Expr> {
    a.only(&[META_DREG, META_KEY]).then_some(())?;
    Some(Expr::Meta {
        key: a.u32(META_KEY)?,
        dreg: a.u32(META_DREG)?,
    })
}

fn ct(a: &Attributes<'_>) -> Option<Expr> {
    a.only(&[CT_DREG, CT_KEY]).then_some(())?;
    Some(Expr::Ct {
        key: a.u32(CT_KEY)?,
        dreg: a.u32(CT_DREG)?,
    })
}

fn payload(a: &Attributes<'_>) -> Option<Expr> {
    a.only(&[PAYLOAD_DREG, PAYLOAD_BASE, PAYLOAD_OFFSET, PAYLOAD_LEN])
        .then_some(())?;
    Some(Expr::Payload {
        base: a.u32(PAYLOAD_BASE)?,
        offset: a.u32(PAYLOAD_OFFSET)?,
        len: a.u32(PAYLOAD_LEN)?,
        dreg: a.u32(PAYLOAD_DREG)?,
    })
}

fn cmp(a: &Attributes<'_>) -> Option<Expr> {
    a.only(&[CMP_SREG, CMP_OP, CMP_DATA]).then_some(())?;
    let op = match a.u32(CMP_OP)? {
        CMP_EQ => Compare::Eq,
        CMP_NEQ => Compare::Neq,
        CMP_GTE => Compare::Gte,
        CMP_LTE => Compare::Lte,
        _ => return None,
    };
    Some(Expr::Cmp {
        sreg: a.u32(CMP_SREG)?,
        op,
        data: data_value(a.get(CMP_DATA)?).ok()??.0,
    })
}

fn bitwise(a: &Attributes<'_>) -> Option<Expr> {
    a.only(&[
        BITWISE_SREG,
        BITWISE_DREG,
        BITWISE_LEN,
        BITWISE_MASK,
        BITWISE_XOR,
        BITWISE_OP,
    ])
    .then_some(())?;
    // The mask-and-xor operation, the only one written.
    (a.u32(BITWISE_OP).unwrap_or(0) == 0).then_some(())?;
    let mask = data_value(a.get(BITWISE_MASK)?).ok()??.0;
    let xor = data_value(a.get(BITWISE_XOR)?).ok()??.0;
    (a.u32(BITWISE_LEN)? as usize == mask.len()).then_some(())?;
    Some(Expr::Bitwise {
        sreg: a.u32(BITWISE_SREG)?,
        dreg: a.u32(BITWISE_DREG)?,
        mask,
        xor,
    })
}

fn lookup(a: &Attributes<'_>, anonymous: &BTreeMap<String, AnonymousSet>) -> Option<Expr> {
    a.only(&[LOOKUP_SET, LOOKUP_SREG, LOOKUP_DREG, LOOKUP_SET_ID, LOOKUP_FLAGS])
        .then_some(())?;
    // An inverted lookup is never written.
    (a.u32(LOOKUP_FLAGS).unwrap_or(0) == 0).then_some(())?;
    let verdict_map = match a.u32(LOOKUP_DREG) {
        None => false,
        Some(super::REG_VERDICT) => true,
        Some(_) => return None,
    };
    let name = text(a.get(LOOKUP_SET)?);
    let set = match anonymous.get(&name) {
        Some(anonymous) => SetRef::Anonymous(anonymous.clone()),
        None => SetRef::Named(name),
    };
    Some(Expr::Lookup {
        sreg: a.u32(LOOKUP_SREG)?,
        set,
        verdict_map,
    })
}

fn immediate(a: &Attributes<'_>) -> Option<Expr> {
    a.only(&[IMMEDIATE_DREG, IMMEDIATE_DATA]).then_some(())?;
    let dreg = a.u32(IMMEDIATE_DREG)?;
    let data = a.get(IMMEDIATE_DATA)?;
    if dreg == super::REG_VERDICT {
        data_verdict(data).ok()?.map(Expr::Verdict)
    } else {
        Some(Expr::Immediate {
            dreg,
            data: data_value(data).ok()??.0,
        })
    }
}

fn expression(bytes: &[u8], anonymous: &BTreeMap<String, AnonymousSet>) -> Expr {
    let Some(expr) = Attributes::of(bytes) else {
        return foreign("?");
    };
    let name = expr.get(EXPR_NAME).map(text).unwrap_or_default();
    let data = expr
        .get(EXPR_DATA)
        .and_then(Attributes::of)
        .unwrap_or(Attributes(Vec::new()));
    let decoded = match name.as_str() {
        "meta" => meta(&data),
        "ct" => ct(&data),
        "payload" => payload(&data),
        "cmp" => cmp(&data),
        "bitwise" => bitwise(&data),
        "lookup" => lookup(&data, anonymous),
        "immediate" => immediate(&data),
        _ => None,
    };
    decoded.unwrap_or_else(|| foreign(&name))
}

/// A dumped rule of `table`, from its attributes: its chain and the rule.
/// Read by hand: the netfilter crate took 150 µs a rule.
pub(crate) fn rule(
    bytes: &[u8],
    table: &str,
    anonymous: &BTreeMap<String, AnonymousSet>,
) -> Option<(String, Rule)> {
    let rule = Attributes::of(bytes)?;
    (text(rule.get(RULE_TABLE)?) == table).then_some(())?;
    let chain = text(rule.get(RULE_CHAIN)?);
    let exprs = match rule.get(RULE_EXPRESSIONS) {
        Some(list) => attributes(list)
            .ok()?
            .into_iter()
            .filter(|(kind, _)| *kind == LIST_ELEM)
            .map(|(_, expr)| expression(expr, anonymous))
            .collect(),
        None => Vec::new(),
    };
    let comment = rule.get(RULE_USERDATA).and_then(crate::nfnl::comment_in);
    Some((chain, Rule { exprs, comment }))
}
