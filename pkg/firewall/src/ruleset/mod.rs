//! One nf_tables table as data, changed by one netlink batch from inside
//! the process and read back the same way: no `nft` process, so a change
//! costs what it changes. `nft` 1.0.6 reads the elements of every interval
//! set (anonymous ones included) of the table before any `add element`:
//! at 3000 of them each transaction took 0.4 s here, however small.
//!
//! The model is what the kernel holds, at the level a caller renders it:
//! sets with typed keys ([`Field`]), elements as key bytes ([`Value`]),
//! rules as expressions ([`Expr`]) laid out as `nft` lays out the same rule,
//! so `nft list` prints what the caller meant. A rule read back decodes to
//! the same [`Rule`] it was written as, so a caller compares content, not
//! rule counts. The calling thread's network namespace is changed.
//!
//! - [`commit`]: [`Op`]s as one transaction: all or nothing, every message's
//!   error reported with the op it came from.
//! - [`read`]: the table's chains with their rules, and its named sets
//!   with their elements.
//! - [`elements`]: one set's elements (the plugins' cheap question).

mod decode;
mod encode;
mod socket;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use crate::nfnl::ENOENT;
pub use crate::nfnl::{Deleted, TableFamily};
use crate::{Error, Result};

/// One field of a set's key, as nft types it (the type ids are nft's, so
/// `nft list` prints the elements as what they are).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Field {
    Ipv4,
    Ipv6,
    /// A transport protocol number (`meta l4proto`).
    InetProto,
    /// A port (`th dport`), big-endian.
    InetService,
    Icmpv6Type,
    /// Text of up to 64 bytes, NUL-padded (nft's `string`).
    Text,
    /// A packet mark's 32 bits; also what `nft` shows a number no packet
    /// carries as, which a rule loads itself ([`Expr::Immediate`]): `nft`
    /// 1.0.6 aborts listing a set keyed by an `integer` it was not told the
    /// length of (`concat_expr_msort_value: Assertion ilen > 0`).
    Mark,
}

impl Field {
    /// nft's datatype id (`TYPE_*` in its `datatype.h`).
    fn type_id(self) -> u32 {
        match self {
            Field::Ipv4 => 7,
            Field::Ipv6 => 8,
            Field::InetProto => 12,
            Field::InetService => 13,
            Field::Icmpv6Type => 29,
            Field::Text => 5,
            Field::Mark => 19,
        }
    }

    /// Bytes of the field's value.
    pub fn size(self) -> usize {
        match self {
            Field::Ipv4 => 4,
            Field::Ipv6 => 16,
            Field::InetProto | Field::Icmpv6Type => 1,
            Field::InetService => 2,
            Field::Text => TEXT_LEN,
            Field::Mark => 4,
        }
    }
}

/// The longest key the kernel takes (`NFT_DATA_VALUE_MAXLEN`).
pub const TEXT_LEN: usize = 64;

/// A key's fields: one, or a concatenation (`a . b`).
pub type Key = Vec<Field>;

/// nft's bits per field in a concatenation's type id.
const TYPE_BITS: u32 = 6;

fn key_type(key: &[Field]) -> u32 {
    key.iter().fold(0, |id, f| (id << TYPE_BITS) | f.type_id())
}

/// A concatenation's fields each take whole 32-bit registers.
fn padded(len: usize) -> usize {
    len.div_ceil(4) * 4
}

fn key_len(key: &[Field]) -> usize {
    match key {
        [one] => one.size(),
        fields => fields.iter().map(|f| padded(f.size())).sum(),
    }
}

/// A key's value as the kernel compares it: network byte order, each field
/// of a concatenation padded to 32 bits.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Value(pub Vec<u8>);

impl Value {
    pub fn address(ip: IpAddr) -> Value {
        match ip {
            IpAddr::V4(ip) => Value(ip.octets().to_vec()),
            IpAddr::V6(ip) => Value(ip.octets().to_vec()),
        }
    }

    pub fn byte(value: u8) -> Value {
        Value(vec![value])
    }

    pub fn port(port: u16) -> Value {
        Value(port.to_be_bytes().to_vec())
    }

    /// `text`'s bytes, NUL-padded; None when longer than a key may be.
    pub fn text(text: &str) -> Option<Value> {
        let bytes = text.as_bytes();
        (bytes.len() < TEXT_LEN).then(|| {
            let mut value = bytes.to_vec();
            value.resize(TEXT_LEN, 0);
            Value(value)
        })
    }

    /// The fields' values side by side, each padded to 32 bits.
    pub fn concat(values: &[Value]) -> Value {
        let mut bytes = Vec::new();
        for value in values {
            bytes.extend_from_slice(&value.0);
            bytes.resize(padded(bytes.len()), 0);
        }
        Value(bytes)
    }

    /// The value one greater, or None past the largest: the end marker of
    /// an interval, which the kernel's interval sets keep one past it.
    fn successor(&self) -> Option<Value> {
        let mut bytes = self.0.clone();
        for byte in bytes.iter_mut().rev() {
            if *byte == u8::MAX {
                *byte = 0;
            } else {
                *byte += 1;
                return Some(Value(bytes));
            }
        }
        None
    }

    /// The value one less (the last of an interval from its end marker).
    fn predecessor(&self) -> Option<Value> {
        let mut bytes = self.0.clone();
        for byte in bytes.iter_mut().rev() {
            if *byte == 0 {
                *byte = u8::MAX;
            } else {
                *byte -= 1;
                return Some(Value(bytes));
            }
        }
        None
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.len() {
            4 => {
                let octets: [u8; 4] = self.0[..].try_into().map_err(|_| fmt::Error)?;
                write!(f, "{}", std::net::Ipv4Addr::from(octets))
            }
            16 => {
                let octets: [u8; 16] = self.0[..].try_into().map_err(|_| fmt::Error)?;
                write!(f, "{}", std::net::Ipv6Addr::from(octets))
            }
            _ => {
                for byte in &self.0 {
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
        }
    }
}

/// What a rule or a verdict map's element decides.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    Accept,
    Drop,
    Return,
    Jump(String),
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Accept => f.write_str("accept"),
            Verdict::Drop => f.write_str("drop"),
            Verdict::Return => f.write_str("return"),
            Verdict::Jump(chain) => write!(f, "jump {chain}"),
        }
    }
}

/// One element: a key, or an interval from `key` to `last` (an interval
/// set's); with its verdict in a verdict map.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Element {
    pub key: Value,
    pub last: Option<Value>,
    pub verdict: Option<Verdict>,
}

impl Element {
    pub fn key(key: Value) -> Element {
        Element {
            key,
            last: None,
            verdict: None,
        }
    }

    pub fn interval(first: Value, last: Value) -> Element {
        Element {
            key: first,
            last: Some(last),
            verdict: None,
        }
    }

    pub fn jump(key: Value, chain: &str) -> Element {
        Element {
            key,
            last: None,
            verdict: Some(Verdict::Jump(chain.to_owned())),
        }
    }
}

impl fmt::Display for Element {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.key)?;
        if let Some(last) = &self.last {
            write!(f, "-{last}")?;
        }
        if let Some(verdict) = &self.verdict {
            write!(f, " : {verdict}")?;
        }
        Ok(())
    }
}

/// What a named set is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetKind {
    /// Keys (a hash).
    Plain,
    /// Intervals of one field (the kernel's rbtree).
    Intervals,
    /// Keys to verdicts (`vmap`).
    VerdictMap,
}

/// A named set or map.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Set {
    pub name: String,
    pub key: Key,
    pub kind: SetKind,
}

impl Set {
    /// Intervals of a concatenation: the kernel's pipapo, an element's
    /// first and last key in one element (an interval of one field is the
    /// rbtree's: a first key, and an end marker past its last).
    fn concat_intervals(&self) -> bool {
        self.kind == SetKind::Intervals && self.key.len() > 1
    }
}

/// A set that belongs to one rule, written with it and gone with it; its
/// elements never change. Intervals of a concatenation (`tcp . 80-90`)
/// are the kernel's `pipapo`, keys alone a hash.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AnonymousSet {
    pub key: Key,
    pub elements: BTreeSet<Element>,
}

impl AnonymousSet {
    fn intervals(&self) -> bool {
        self.elements.iter().any(|e| e.last.is_some())
    }
}

/// The set a lookup reads.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetRef {
    Named(String),
    Anonymous(AnonymousSet),
}

/// Registers as the kernel numbers them: the verdict, then 16-byte ones,
/// whose 32-bit quarters are numbered from 8.
pub const REG_VERDICT: u32 = 0;
pub const REG_1: u32 = 1;
pub const REG_2: u32 = 2;
/// The second 32-bit quarter of register 1 (a concatenation's second
/// field of 4 bytes or less).
pub const REG32_01: u32 = 9;

/// `meta` keys.
pub const META_NFPROTO: u32 = 15;
pub const META_L4PROTO: u32 = 16;
/// `ct` keys.
pub const CT_STATE: u32 = 0;
/// Payload bases.
pub const NETWORK_HEADER: u32 = 1;
pub const TRANSPORT_HEADER: u32 = 2;

/// Comparisons, of bytes as the kernel compares them (`memcmp`: in
/// network order, `Gte` and `Lte` order ports and addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Compare {
    Eq,
    Neq,
    Gte,
    Lte,
}

/// One step of a rule, as the kernel evaluates it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Expr {
    /// Loads a packet's metadata (`meta nfproto`, `meta l4proto`).
    Meta {
        key: u32,
        dreg: u32,
    },
    /// Loads a conntrack field (`ct state`).
    Ct {
        key: u32,
        dreg: u32,
    },
    /// Loads constant bytes (a key's part no packet carries).
    Immediate {
        dreg: u32,
        data: Vec<u8>,
    },
    /// Loads `len` bytes at `offset` of a header.
    Payload {
        base: u32,
        offset: u32,
        len: u32,
        dreg: u32,
    },
    Cmp {
        sreg: u32,
        op: Compare,
        data: Vec<u8>,
    },
    /// `dreg = (sreg & mask) ^ xor`, over the mask's length.
    Bitwise {
        sreg: u32,
        dreg: u32,
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    /// Whether the key at `sreg` is in `set`; a verdict map's verdict
    /// becomes the rule's.
    Lookup {
        sreg: u32,
        set: SetRef,
        verdict_map: bool,
    },
    /// The rule's verdict.
    Verdict(Verdict),
    /// Read back: an expression this model does not write (someone
    /// else's), named by its kind; equal to nothing a caller renders.
    Foreign(String),
}

/// A rule: its expressions and the comment nft keeps in its user data.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    pub exprs: Vec<Expr>,
    pub comment: Option<String>,
}

/// Where a base chain is hooked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Hook {
    Input = 1,
    Forward = 2,
}

/// A base chain's hook, at priority `filter` (0) and policy accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BaseChain {
    pub hook: Hook,
}

/// One change to the table; [`commit`] runs a list of them as one
/// transaction, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// The table, if it is not there.
    AddTable,
    /// The table with everything in it.
    DeleteTable,
    AddChain {
        name: String,
        base: Option<BaseChain>,
    },
    FlushChain(String),
    DeleteChain(String),
    /// One rule, by the handle a reading gave it.
    DeleteRule {
        chain: String,
        handle: u64,
    },
    /// A rule at the chain's end.
    AddRule {
        chain: String,
        rule: Rule,
    },
    AddSet(Set),
    DeleteSet(String),
    /// Elements of `set` (described as it was made: its kind and key say
    /// how an interval is written).
    AddElements {
        set: Set,
        elements: Vec<Element>,
    },
    DeleteElements {
        set: Set,
        elements: Vec<Element>,
    },
}

impl fmt::Display for Op {
    /// nft's words, with elements listed, for logs and test failures.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |elements: &[Element]| {
            elements
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Op::AddTable => f.write_str("add table"),
            Op::DeleteTable => f.write_str("delete table"),
            Op::AddChain { name, base: None } => write!(f, "add chain {name}"),
            Op::AddChain {
                name,
                base: Some(base),
            } => write!(f, "add chain {name} (hook {:?})", base.hook),
            Op::FlushChain(name) => write!(f, "flush chain {name}"),
            Op::DeleteRule { chain, handle } => write!(f, "delete rule {chain} handle {handle}"),
            Op::DeleteChain(name) => write!(f, "delete chain {name}"),
            Op::AddRule { chain, rule } => write!(f, "add rule {chain} {rule:?}"),
            Op::AddSet(set) => write!(f, "add set {} {:?} {:?}", set.name, set.key, set.kind),
            Op::DeleteSet(name) => write!(f, "delete set {name}"),
            Op::AddElements { set, elements } => {
                write!(f, "add element {} {{ {} }}", set.name, list(elements))
            }
            Op::DeleteElements { set, elements } => {
                write!(f, "delete element {} {{ {} }}", set.name, list(elements))
            }
        }
    }
}

/// Runs `ops` on `table` as one transaction: all of them, or none when
/// the kernel refuses one (the error names it).
pub fn commit(family: TableFamily, table: &str, ops: &[Op]) -> Result<()> {
    let batch = encode::batch(family, table, ops)?;
    // Ops that write nothing (no elements to add) ask for no answer.
    if batch.ops_by_sequence.is_empty() {
        return Ok(());
    }
    socket::Conversation::open()?.transact(&batch)
}

/// Deletes the rules `handles` of `chain` in one transaction, as
/// `iptables-nft-restore`'s `-D` lines do once it has found their
/// handles: all of them, or none when one of them is gone meanwhile
/// ([`Deleted::Absent`]: the kernel aborts the batch; read again).
pub fn delete_rules(family: TableFamily, table: &str, chain: &str, handles: &[u64]) -> Result<Deleted> {
    if handles.is_empty() {
        return Ok(Deleted::Absent);
    }
    let ops: Vec<Op> = handles
        .iter()
        .map(|handle| Op::DeleteRule {
            chain: chain.to_owned(),
            handle: *handle,
        })
        .collect();
    match commit(family, table, &ops) {
        Ok(()) => Ok(Deleted::Removed),
        Err(Error::Refused { errno: ENOENT, .. }) => Ok(Deleted::Absent),
        Err(e) => Err(e),
    }
}

/// A chain as read back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadChain {
    /// Its hook, when it is one this model writes (priority `filter`,
    /// policy accept).
    pub base: Option<BaseChain>,
    /// Hooked at all (a base chain, perhaps not as written).
    pub hooked: bool,
    pub rules: Vec<Rule>,
}

/// A named set as read back, with its elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadSet {
    pub set: Set,
    pub elements: BTreeSet<Element>,
}

/// What a table holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    pub chains: BTreeMap<String, ReadChain>,
    pub sets: BTreeMap<String, ReadSet>,
}

/// The table's chains and named sets, None when there is no such table.
pub fn read(family: TableFamily, table: &str) -> Result<Option<Table>> {
    socket::Conversation::open()?.read_table(family, table)
}

/// The elements of one named set; None when the table or set is absent.
pub fn elements(family: TableFamily, table: &str, set: &str) -> Result<Option<BTreeSet<Element>>> {
    let mut conversation = socket::Conversation::open()?;
    match conversation.set(family, table, set)? {
        Some(found) => conversation.elements_of(family, table, &found).map(Some),
        None => Ok(None),
    }
}

fn invalid(what: impl fmt::Display) -> Error {
    Error::Invalid(format!("nf_tables: {what}"))
}

#[cfg(test)]
mod tests;
