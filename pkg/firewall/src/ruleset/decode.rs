//! What the kernel dumps, back into the model: a rule written from an
//! [`Expr`] list decodes to the same list, and anything this model does
//! not write (someone else's rule, an inverted lookup) decodes to
//! [`Expr::Foreign`], equal to nothing a caller renders.

use std::collections::{BTreeMap, BTreeSet};

use netlink_packet_core::Nla;
use netlink_packet_netfilter::nftables::{
    Bitwise, ChainAttribute, ChainMessage, Cmp, DataAttribute, ExpressionAttribute, Expressions,
    Hook as HookAttribute, HookNumber, Immediate, InetHookNumber, ListAttribute, Lookup, Meta, Operator,
    Payload, Register, RuleAttribute, RuleMessage, SetAttribute, SetFlags, SetMessage,
    Verdict as VerdictCode, VerdictAttribute,
};

use super::encode::{CT_DREG, CT_KEY};
use super::{
    AnonymousSet, BaseChain, Compare, Element, Expr, Field, Hook, Key, ReadChain, Rule, Set, SetKind, SetRef,
    TYPE_BITS, Value, Verdict, key_len,
};
use crate::Result;
use crate::nfnl::{rule_comment, value_of};

/// A set as listed, before its elements are read.
#[derive(Debug, Clone)]
pub(crate) struct DumpedSet {
    pub name: String,
    flags: SetFlags,
    /// None: a key type this model does not write.
    key: Option<Key>,
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
    for attribute in &message.attributes {
        match attribute {
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
    })
}

fn value(data: &DataAttribute) -> Option<Value> {
    match data {
        DataAttribute::Value(bytes) => Some(Value(bytes.clone())),
        _ => None,
    }
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
    key: Value,
    last: Option<Value>,
    verdict: Option<Verdict>,
    end_marker: bool,
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

fn register(r: &Register) -> u32 {
    u32::from(*r)
}

fn foreign(what: &str) -> Expr {
    Expr::Foreign(what.to_owned())
}

fn be32(bytes: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(bytes.try_into().ok()?))
}

fn meta(attributes: &[Meta]) -> Expr {
    let (mut key, mut dreg) = (None, None);
    for attribute in attributes {
        match attribute {
            Meta::Key(k) => key = Some(u32::from(*k)),
            Meta::DestinationRegister(r) => dreg = Some(register(r)),
            _ => return foreign("meta"),
        }
    }
    match (key, dreg) {
        (Some(key), Some(dreg)) => Expr::Meta { key, dreg },
        _ => foreign("meta"),
    }
}

fn ct(attributes: &[netlink_packet_core::DefaultNla]) -> Expr {
    let (mut key, mut dreg) = (None, None);
    for attribute in attributes {
        let value = be32(&value_of(attribute));
        match attribute.kind() {
            CT_KEY => key = value,
            CT_DREG => dreg = value,
            _ => return foreign("ct"),
        }
    }
    match (key, dreg) {
        (Some(key), Some(dreg)) => Expr::Ct { key, dreg },
        _ => foreign("ct"),
    }
}

fn payload(attributes: &[Payload]) -> Expr {
    let (mut base, mut offset, mut len, mut dreg) = (None, None, None, None);
    for attribute in attributes {
        match attribute {
            Payload::Base(b) => base = Some(*b),
            Payload::Offset(o) => offset = Some(*o),
            Payload::Len(l) => len = Some(*l),
            Payload::DestinationRegister(r) => dreg = Some(register(r)),
            _ => return foreign("payload"),
        }
    }
    match (base, offset, len, dreg) {
        (Some(base), Some(offset), Some(len), Some(dreg)) => Expr::Payload {
            base,
            offset,
            len,
            dreg,
        },
        _ => foreign("payload"),
    }
}

fn cmp(attributes: &[Cmp]) -> Expr {
    let (mut sreg, mut op, mut data) = (None, None, None);
    for attribute in attributes {
        match attribute {
            Cmp::SourceRegister(r) => sreg = Some(register(r)),
            Cmp::Op(Operator::Equal) => op = Some(Compare::Eq),
            Cmp::Op(Operator::NotEqual) => op = Some(Compare::Neq),
            Cmp::Data(d) => data = value(d),
            _ => return foreign("cmp"),
        }
    }
    match (sreg, op, data) {
        (Some(sreg), Some(op), Some(data)) => Expr::Cmp {
            sreg,
            op,
            data: data.0,
        },
        _ => foreign("cmp"),
    }
}

fn bitwise(attributes: &[Bitwise]) -> Expr {
    let (mut sreg, mut dreg, mut len, mut mask, mut xor) = (None, None, None, None, None);
    for attribute in attributes {
        match attribute {
            Bitwise::SourceRegister(r) => sreg = Some(register(r)),
            Bitwise::DestinationRegister(r) => dreg = Some(register(r)),
            Bitwise::Length(l) => len = Some(*l as usize),
            Bitwise::Mask(d) => mask = value(d),
            Bitwise::Xor(d) => xor = value(d),
            // The mask-and-xor operation, the only one written.
            Bitwise::Op(0) => {}
            _ => return foreign("bitwise"),
        }
    }
    match (sreg, dreg, len, mask, xor) {
        (Some(sreg), Some(dreg), Some(len), Some(mask), Some(xor)) if mask.0.len() == len => Expr::Bitwise {
            sreg,
            dreg,
            mask: mask.0,
            xor: xor.0,
        },
        _ => foreign("bitwise"),
    }
}

fn lookup(attributes: &[Lookup], anonymous: &BTreeMap<String, AnonymousSet>) -> Expr {
    let (mut set, mut sreg, mut verdict_map) = (None, None, false);
    for attribute in attributes {
        match attribute {
            Lookup::Set(name) => set = Some(name.clone()),
            Lookup::SourceRegister(r) => sreg = Some(register(r)),
            Lookup::DestinationRegister(Register::Verdict) => verdict_map = true,
            Lookup::Flags(0) | Lookup::SetId(_) => {}
            _ => return foreign("lookup"),
        }
    }
    let set = match set {
        Some(name) => match anonymous.get(&name) {
            Some(anonymous) => SetRef::Anonymous(anonymous.clone()),
            None => SetRef::Named(name),
        },
        None => return foreign("lookup"),
    };
    match sreg {
        Some(sreg) => Expr::Lookup {
            sreg,
            set,
            verdict_map,
        },
        None => foreign("lookup"),
    }
}

fn immediate(attributes: &[Immediate]) -> Expr {
    let (mut to_verdict, mut decided) = (false, None);
    for attribute in attributes {
        match attribute {
            Immediate::DestinationRegister(Register::Verdict) => to_verdict = true,
            Immediate::Data(DataAttribute::Verdict(v)) => decided = verdict(v),
            _ => return foreign("immediate"),
        }
    }
    match decided {
        Some(verdict) if to_verdict => Expr::Verdict(verdict),
        _ => foreign("immediate"),
    }
}

fn expression(
    element: &ListAttribute<ExpressionAttribute>,
    anonymous: &BTreeMap<String, AnonymousSet>,
) -> Expr {
    let ListAttribute::Element(attributes) = element else {
        return foreign("?");
    };
    let data = attributes.iter().find_map(|a| match a {
        ExpressionAttribute::Data(data) => Some(data),
        _ => None,
    });
    match data {
        Some(Expressions::Meta(a)) => meta(a),
        Some(Expressions::Payload(a)) => payload(a),
        Some(Expressions::Cmp(a)) => cmp(a),
        Some(Expressions::Bitwise(a)) => bitwise(a),
        Some(Expressions::Lookup(a)) => lookup(a, anonymous),
        Some(Expressions::Immediate(a)) => immediate(a),
        Some(Expressions::Other {
            expression_type,
            attributes,
        }) if expression_type == "ct" => ct(attributes),
        Some(Expressions::Other { expression_type, .. }) => foreign(expression_type),
        _ => foreign("?"),
    }
}

/// A dumped rule of `table`: its chain and the rule.
pub(crate) fn rule(
    message: &RuleMessage,
    table: &str,
    anonymous: &BTreeMap<String, AnonymousSet>,
) -> Option<(String, Rule)> {
    let (mut chain, mut in_table, mut exprs) = (None, false, Vec::new());
    for attribute in &message.attributes {
        match attribute {
            RuleAttribute::Table(t) => in_table = t == table,
            RuleAttribute::Chain(c) => chain = Some(c.clone()),
            RuleAttribute::Expressions(list) => {
                exprs = list.iter().map(|e| expression(e, anonymous)).collect();
            }
            _ => {}
        }
    }
    in_table.then_some(())?;
    Some((
        chain?,
        Rule {
            exprs,
            comment: rule_comment(message),
        },
    ))
}
