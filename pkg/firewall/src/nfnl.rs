//! nf_tables over netlink from inside the process, so the per-pod path
//! needs no `iptables-save` or `nft list` process (3–10 ms each): does a
//! chain exist, and what comments do a chain's rules carry; and, for the
//! node agent's uninstall (whose image has no `nft`), which tables and
//! chains exist and the deletion of an empty chain or table. They see what
//! iptables-nft and nft write; x_tables (iptables-legacy) needs its own
//! tools. The calling thread's network namespace is asked.
//!
//! Messages are built and read with `netlink-packet-netfilter` (nfgenmsg,
//! table, chain and rule messages and their attributes, the batch begin
//! and end markers) framed by `netlink-packet-core` (netlink header, ACKs,
//! errors, the end of a dump); the socket is `netlink-sys`'s. What is
//! still read by hand here, because the crate hands it over as raw bytes:
//!
//! - [`rule_comment`] (used by [`rule_comments`] and
//!   [`handles_with_comment`]): the comment inside a rule's user data. The
//!   kernel keeps `NFTA_RULE_USERDATA` opaque and the crate gives it as
//!   bytes (`RuleAttribute::UserData`); the type-length-value list inside
//!   (one-byte type and length, `NFTNL_UDATA_RULE_COMMENT` = 0) is
//!   libnftnl's format, which no netlink crate models.
//! - [`value_of`]: the value of an attribute the crate does not know (an
//!   `xt` match's name and info, a `counter`), which it keeps as a
//!   `DefaultNla` whose value has no getter; the crate's own `emit_value`
//!   writes it out.
//!
//! [`rules_mentioning`] searches each rule attribute's value as the crate
//! writes it back out (`emit_value`), the same bytes the kernel sent: the
//! text it looks for may be an iptables comment match's info, nft's user
//! data or a jump's target chain.

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_NONREC, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla,
};
use netlink_packet_netfilter::nftables::{
    ChainAttribute, ChainMessage, NfTablesMessage, RuleAttribute, RuleMessage, TableAttribute, TableMessage,
};
use netlink_packet_netfilter::none::ControlMessage;
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily, NetfilterSubsystem,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::{Error, Result};

/// nftnl's user-data type for a rule comment.
pub(crate) const NFTNL_UDATA_RULE_COMMENT: u8 = 0;
pub(crate) const ENOENT: i32 = 2;
const EBUSY: i32 = 16;

/// The nf_tables family of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFamily {
    Inet = 1,
    Ip = 2,
    Bridge = 7,
    Ip6 = 10,
}

impl TableFamily {
    /// As nft names it.
    pub fn keyword(self) -> &'static str {
        match self {
            TableFamily::Inet => "inet",
            TableFamily::Ip => "ip",
            TableFamily::Bridge => "bridge",
            TableFamily::Ip6 => "ip6",
        }
    }

    pub(crate) fn proto_family(self) -> NetfilterProtoFamily {
        NetfilterProtoFamily::from(self as u8)
    }
}

/// One request as the kernel reads it: the netlink header (a request with
/// `flags`, numbered `sequence`), the nfgenmsg (`family`, `res_id`), then
/// `body`.
pub(crate) fn serialize(
    body: impl Into<NetfilterMessageInner>,
    family: NetfilterProtoFamily,
    res_id: u16,
    flags: u16,
    sequence: u32,
) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags;
    header.sequence_number = sequence;
    let body = NetfilterMessage::new(NetfilterHeader::new(family, 0, res_id), body);
    let mut message = NetlinkMessage::new(header, NetlinkPayload::from(body));
    // Sets the length and type from the body, so the buffer below fits.
    message.finalize();
    let mut bytes = vec![0; message.buffer_len()];
    message.serialize(&mut bytes);
    bytes
}

/// An nf_tables request of `family`.
fn request(body: NfTablesMessage, flags: u16, family: TableFamily) -> Vec<u8> {
    serialize(body, family.proto_family(), 0, flags, 1)
}

fn io_error(what: &str, e: &std::io::Error) -> Error {
    Error::Invalid(format!("netfilter {what}: {e}"))
}

/// Sends `request` and hands every netfilter reply message to `each` until
/// the kernel is done: an ACK, an error, or the end of a dump. A negative
/// errno from the kernel is returned as `Err`; a reply the crate cannot
/// parse is an error of its own.
pub(crate) fn converse(
    what: &str,
    request: &[u8],
    mut each: impl FnMut(NetfilterMessage),
) -> Result<std::result::Result<(), i32>> {
    let mut socket = Socket::new(NETLINK_NETFILTER).map_err(|e| io_error(what, &e))?;
    socket.bind_auto().map_err(|e| io_error(what, &e))?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(|e| io_error(what, &e))?;
    socket.send(request, 0).map_err(|e| io_error(what, &e))?;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = socket
            .recv(&mut &mut buf[..], 0)
            .map_err(|e| io_error(what, &e))?;
        let mut at = 0;
        while at < n {
            // Parses one message; its header says where the next begins.
            let message = NetlinkMessage::<NetfilterMessage>::deserialize(&buf[at..n])
                .map_err(|e| Error::Invalid(format!("netfilter {what}: a reply: {e}")))?;
            let len = message.header.length as usize;
            match message.payload {
                NetlinkPayload::Error(error) => {
                    return Ok(error.code.map_or(Ok(()), |code| Err(-code.get())));
                }
                NetlinkPayload::Done(_) => return Ok(Ok(())),
                NetlinkPayload::InnerMessage(message) => each(message),
                _ => {}
            }
            // Netlink aligns each message to 4 bytes.
            at += (len + 3) & !3;
        }
    }
}

/// The nf_tables message in a reply, if it is one.
fn nftables(message: NetfilterMessage) -> Option<NfTablesMessage> {
    match message.inner {
        NetfilterMessageInner::NfTables(message) => Some(message),
        _ => None,
    }
}

/// Whether `chain` exists in `table` (a missing table means no).
pub fn chain_exists(family: TableFamily, table: &str, chain: &str) -> Result<bool> {
    let message = request(
        NfTablesMessage::GetChain(ChainMessage {
            attributes: vec![
                ChainAttribute::Table(table.to_owned()),
                ChainAttribute::Name(chain.to_owned()),
            ],
        }),
        NLM_F_ACK,
        family,
    );
    match converse("chain lookup", &message, |_| {})? {
        Ok(()) => Ok(true),
        Err(ENOENT) => Ok(false),
        Err(errno) => Err(failed("chain lookup", &format!("{table}/{chain}"), errno)),
    }
}

/// The rules of `chain` in order, as the kernel dumps them; None when the
/// kernel answers that the table or chain does not exist (a dump of a
/// missing chain is usually just empty: ask [`chain_exists`] to tell).
pub fn rules(family: TableFamily, table: &str, chain: &str) -> Result<Option<Vec<RuleMessage>>> {
    let message = request(
        NfTablesMessage::GetRule(RuleMessage {
            attributes: vec![
                RuleAttribute::Table(table.to_owned()),
                RuleAttribute::Chain(chain.to_owned()),
            ],
        }),
        NLM_F_DUMP,
        family,
    );
    let mut rules = Vec::new();
    let outcome = converse("rule listing", &message, |message| {
        if let Some(NfTablesMessage::NewRule(rule)) = nftables(message) {
            // Older kernels ignore the chain filter of a dump.
            let in_chain = rule
                .attributes
                .iter()
                .any(|a| matches!(a, RuleAttribute::Chain(name) if name == chain));
            if in_chain {
                rules.push(rule);
            }
        }
    })?;
    match outcome {
        Ok(()) => Ok(Some(rules)),
        Err(ENOENT) => Ok(None),
        Err(errno) => Err(failed("rule listing", &format!("{table}/{chain}"), errno)),
    }
}

/// The rules of `chain`, none when the chain or its table does not exist.
fn rules_or_none(family: TableFamily, table: &str, chain: &str) -> Result<Vec<RuleMessage>> {
    Ok(rules(family, table, chain)?.unwrap_or_default())
}

/// The comment in nftnl's type-length-value list (a rule's user data).
pub(crate) fn comment_in(userdata: &[u8]) -> Option<String> {
    let mut at = 0;
    while at + 2 <= userdata.len() {
        let (kind, len) = (userdata[at], userdata[at + 1] as usize);
        let value = userdata.get(at + 2..at + 2 + len)?;
        if kind == NFTNL_UDATA_RULE_COMMENT {
            return Some(text_of(value));
        }
        at += 2 + len;
    }
    None
}

/// The comment nft keeps in `rule`'s user data, if any.
pub fn rule_comment(rule: &RuleMessage) -> Option<String> {
    rule.attributes.iter().find_map(|a| match a {
        RuleAttribute::UserData(userdata) => comment_in(userdata),
        _ => None,
    })
}

/// `rule`'s handle.
fn handle_of(rule: &RuleMessage) -> Option<u64> {
    rule.attributes.iter().find_map(|a| match a {
        RuleAttribute::Handle(handle) => Some(*handle),
        _ => None,
    })
}

/// An attribute's value as the kernel laid it out (without its header):
/// the one way to read a `DefaultNla`, which keeps its value private.
pub fn value_of(attribute: &impl Nla) -> Vec<u8> {
    let mut value = vec![0; attribute.value_len()];
    attribute.emit_value(&mut value);
    value
}

/// The comments of the rules in `chain` that keep one in their user data
/// (nft's `comment`).
pub fn rule_comments(family: TableFamily, table: &str, chain: &str) -> Result<Vec<String>> {
    Ok(rules_or_none(family, table, chain)?
        .iter()
        .filter_map(rule_comment)
        .collect())
}

/// How many rules `chain` has.
pub fn rule_count(family: TableFamily, table: &str, chain: &str) -> Result<usize> {
    Ok(rules_or_none(family, table, chain)?.len())
}

/// The handles of the rules of `chain` whose comment (nft's user data) is
/// exactly `comment`, for deleting them by handle.
pub fn handles_with_comment(
    family: TableFamily,
    table: &str,
    chain: &str,
    comment: &str,
) -> Result<Vec<u64>> {
    Ok(rules_or_none(family, table, chain)?
        .iter()
        .filter(|rule| rule_comment(rule).is_some_and(|c| c == comment))
        .filter_map(handle_of)
        .collect())
}

/// How many rules of `chain` carry `text` anywhere in their attributes: a
/// comment iptables-nft keeps in its `comment` match (which nft does not
/// show), one nft keeps in the rule's user data, or a jump's target.
pub fn rules_mentioning(family: TableFamily, table: &str, chain: &str, text: &str) -> Result<usize> {
    let needle = text.as_bytes();
    let mentions = |rule: &&RuleMessage| {
        !needle.is_empty()
            && rule
                .attributes
                .iter()
                .any(|a| value_of(a).windows(needle.len()).any(|w| w == needle))
    };
    Ok(rules_or_none(family, table, chain)?
        .iter()
        .filter(mentions)
        .count())
}

fn failed(what: &str, object: &str, errno: i32) -> Error {
    Error::Invalid(format!(
        "nf_tables {what} {object}: {}",
        std::io::Error::from_raw_os_error(errno)
    ))
}

/// A NUL-terminated string's text.
fn text_of(value: &[u8]) -> String {
    String::from_utf8_lossy(value.split(|b| *b == 0).next().unwrap_or_default()).into_owned()
}

/// Whether `table` exists.
pub fn table_exists(family: TableFamily, table: &str) -> Result<bool> {
    let message = request(
        NfTablesMessage::GetTable(TableMessage {
            attributes: vec![TableAttribute::Name(table.to_owned())],
        }),
        NLM_F_ACK,
        family,
    );
    match converse("table lookup", &message, |_| {})? {
        Ok(()) => Ok(true),
        Err(ENOENT) => Ok(false),
        Err(errno) => Err(failed("table lookup", table, errno)),
    }
}

/// One chain of a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    /// Hooked into the stack (iptables' built-in chains), not only jumped to.
    pub base: bool,
}

/// `chain` if it belongs to `table`.
fn chain_of(chain: &ChainMessage, table: &str) -> Option<Chain> {
    let mut in_table = false;
    let (mut name, mut base) = (None, false);
    for attribute in &chain.attributes {
        match attribute {
            ChainAttribute::Table(t) => in_table = t == table,
            ChainAttribute::Name(n) => name = Some(n.clone()),
            // Only base chains have one.
            ChainAttribute::Hook(_) => base = true,
            _ => {}
        }
    }
    Some(Chain { name: name?, base }).filter(|_| in_table)
}

/// The chains of `table`, or None when there is no such table.
pub fn chains(family: TableFamily, table: &str) -> Result<Option<Vec<Chain>>> {
    if !table_exists(family, table)? {
        return Ok(None);
    }
    // The kernel dumps every chain of the family; the table is picked here.
    let message = request(
        NfTablesMessage::GetChain(ChainMessage { attributes: vec![] }),
        NLM_F_DUMP,
        family,
    );
    let mut chains = Vec::new();
    let outcome = converse("chain listing", &message, |message| {
        if let Some(NfTablesMessage::NewChain(chain)) = nftables(message)
            && let Some(chain) = chain_of(&chain, table)
        {
            chains.push(chain);
        }
    })?;
    match outcome {
        Ok(()) | Err(ENOENT) => Ok(Some(chains)),
        Err(errno) => Err(failed("chain listing", table, errno)),
    }
}

/// What a delete did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    Removed,
    /// It still holds something (rules, chains, a jump to it): kept.
    InUse,
    /// It was not there.
    Absent,
}

/// Deletes `chain` of `table` unless it has rules or is jumped to. The
/// kernel decides in the same step (`NLM_F_NONREC`), so a rule someone
/// adds meanwhile is never taken along.
pub fn delete_empty_chain(family: TableFamily, table: &str, chain: &str) -> Result<Deleted> {
    let change = NfTablesMessage::DeleteChain(ChainMessage {
        attributes: vec![
            ChainAttribute::Table(table.to_owned()),
            ChainAttribute::Name(chain.to_owned()),
        ],
    });
    delete(family, change, NLM_F_NONREC, &format!("{table}/{chain}"))
}

fn delete_table_message(table: &str) -> NfTablesMessage {
    NfTablesMessage::DeleteTable(TableMessage {
        attributes: vec![TableAttribute::Name(table.to_owned())],
    })
}

/// Deletes `table` unless it still holds a chain, set or object.
pub fn delete_empty_table(family: TableFamily, table: &str) -> Result<Deleted> {
    delete(family, delete_table_message(table), NLM_F_NONREC, table)
}

/// Deletes `table` with everything in it.
pub fn delete_table(family: TableFamily, table: &str) -> Result<Deleted> {
    delete(family, delete_table_message(table), 0, table)
}

fn delete(family: TableFamily, change: NfTablesMessage, flags: u16, object: &str) -> Result<Deleted> {
    let transaction = batch(change, NLM_F_ACK | flags, family);
    match converse("deletion", &transaction, |_| {})? {
        Ok(()) => Ok(Deleted::Removed),
        Err(EBUSY) => Ok(Deleted::InUse),
        Err(ENOENT) => Ok(Deleted::Absent),
        Err(errno) => Err(failed("deletion of", object, errno)),
    }
}

/// `change` as one nf_tables transaction: changes are accepted only
/// between a batch's begin and end, each marker naming the subsystem the
/// batch is for in its res_id.
fn batch(change: NfTablesMessage, flags: u16, family: TableFamily) -> Vec<u8> {
    let nftables = u16::from(u8::from(NetfilterSubsystem::NfTables));
    let marker = |marker: ControlMessage, sequence: u32| {
        serialize(marker, NetfilterProtoFamily::Unspec, nftables, 0, sequence)
    };
    [
        marker(ControlMessage::BatchBegin, 1),
        serialize(change, family.proto_family(), 0, flags, 2),
        marker(ControlMessage::BatchEnd, 3),
    ]
    .concat()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const NFT_MSG_DELTABLE: u16 = 2;
    const NFT_MSG_GETCHAIN: u16 = 4;
    const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
    const NFNL_MSG_BATCH_END: u16 = 0x11;

    pub(crate) fn read_u16(b: &[u8], at: usize) -> u16 {
        u16::from_ne_bytes([b[at], b[at + 1]])
    }

    fn read_u32(b: &[u8], at: usize) -> u32 {
        u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
    }

    #[test]
    fn requests_are_laid_out_as_nfnetlink_expects() {
        let r = request(
            NfTablesMessage::GetChain(ChainMessage {
                attributes: vec![ChainAttribute::Table("nat".into())],
            }),
            NLM_F_ACK,
            TableFamily::Ip,
        );
        // 16 header + 4 nfgenmsg + (4 + "nat\0") attribute.
        assert_eq!(r.len(), 28);
        assert_eq!(read_u32(&r, 0), 28);
        assert_eq!(read_u16(&r, 4), (10 << 8) | NFT_MSG_GETCHAIN);
        assert_eq!(read_u16(&r, 6), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(r[16], 2, "NFPROTO_IPV4");
        assert_eq!((read_u16(&r, 20), read_u16(&r, 22)), (8, 1), "NFTA_CHAIN_TABLE");
        assert_eq!(&r[24..28], b"nat\0");
    }

    /// Runs a tool that sets a test's tables up; it must succeed.
    pub(crate) fn run(program: &str, args: &[&str]) {
        let status = std::process::Command::new(program)
            .args(args)
            .status()
            .expect("runs");
        assert!(status.success(), "{program} {args:?}");
    }

    #[test]
    fn answers_what_iptables_nft_and_nft_wrote() {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                assert!(
                    !chain_exists(TableFamily::Ip, "nat", "CNI-T").expect("asked"),
                    "no table yet"
                );
                run("iptables-nft", &["-t", "nat", "-N", "CNI-T"]);
                assert!(chain_exists(TableFamily::Ip, "nat", "CNI-T").expect("asked"));
                assert!(!chain_exists(TableFamily::Ip, "nat", "CNI-U").expect("asked"));
                assert!(
                    !chain_exists(TableFamily::Ip6, "nat", "CNI-T").expect("asked"),
                    "per family"
                );
                assert!(
                    rule_comments(TableFamily::Inet, "t", "c")
                        .expect("asked")
                        .is_empty()
                );
                run(
                    "nft",
                    &["add table inet t; add chain inet t c; add chain inet t d"],
                );
                run(
                    "nft",
                    &["add rule inet t c counter comment \"first one\"; add rule inet t c counter"],
                );
                run(
                    "nft",
                    &["add rule inet t d counter comment other; add rule inet t c accept comment second"],
                );
                assert_eq!(
                    rule_comments(TableFamily::Inet, "t", "c").expect("asked"),
                    ["first one", "second"]
                );
                assert!(chain_exists(TableFamily::Inet, "t", "d").expect("asked"));
            });
        });
    }

    #[test]
    fn counts_finds_and_searches_rules() {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                assert_eq!(rule_count(TableFamily::Ip, "nat", "CNI-T").expect("asked"), 0);
                run("iptables-nft", &["-t", "nat", "-N", "CNI-T"]);
                run(
                    "iptables-nft",
                    &["-t", "nat", "-A", "CNI-T", "-m", "comment", "--comment", "kept by x", "-j", "RETURN"],
                );
                run("iptables-nft", &["-t", "nat", "-A", "POSTROUTING", "-j", "CNI-T"]);
                run("iptables-nft", &["-t", "nat", "-A", "POSTROUTING", "-j", "RETURN"]);
                assert_eq!(rule_count(TableFamily::Ip, "nat", "CNI-T").expect("asked"), 1);
                assert_eq!(rule_count(TableFamily::Ip, "nat", "POSTROUTING").expect("asked"), 2);
                let mentioning = |chain, text| rules_mentioning(TableFamily::Ip, "nat", chain, text).expect("asked");
                assert_eq!(mentioning("CNI-T", "kept by x"), 1, "the comment, wherever iptables-nft keeps it");
                assert_eq!(mentioning("POSTROUTING", "CNI-T"), 1, "a jump's target");
                assert_eq!(mentioning("POSTROUTING", "kept by x"), 0);
                assert_eq!(mentioning("CNI-T", ""), 0);
                run(
                    "nft",
                    &["add table inet t; add chain inet t c; add rule inet t c counter comment mine; add rule inet t c counter comment other; add rule inet t c counter comment mine"],
                );
                let handles = handles_with_comment(TableFamily::Inet, "t", "c", "mine").expect("asked");
                assert_eq!(handles.len(), 2);
                let all = rules(TableFamily::Inet, "t", "c").expect("asked").expect("chain");
                let by_handle: Vec<u64> = all
                    .iter()
                    .filter(|r| rule_comment(r).as_deref() == Some("mine"))
                    .filter_map(handle_of)
                    .collect();
                assert_eq!(handles, by_handle);
                assert!(handles_with_comment(TableFamily::Inet, "t", "c", "min").expect("asked").is_empty());
            });
        });
    }

    #[test]
    fn a_change_travels_alone_in_one_batch() {
        let delete = request(
            delete_table_message("nat"),
            NLM_F_ACK | NLM_F_NONREC,
            TableFamily::Ip6,
        );
        let sent = batch(
            delete_table_message("nat"),
            NLM_F_ACK | NLM_F_NONREC,
            TableFamily::Ip6,
        );
        assert_eq!(sent.len(), 20 + delete.len() + 20);
        assert_eq!(read_u16(&sent, 4), NFNL_MSG_BATCH_BEGIN);
        assert_eq!(read_u16(&sent, 6), NLM_F_REQUEST);
        assert_eq!(&sent[18..20], &[0, 10], "res_id: nf_tables, network order");
        assert_eq!(read_u16(&sent, 24), (10 << 8) | NFT_MSG_DELTABLE);
        assert_eq!(read_u16(&sent, 26), NLM_F_REQUEST | NLM_F_ACK | NLM_F_NONREC);
        assert_eq!(sent[36], 10, "NFPROTO_IPV6");
        let sequences: Vec<u32> = [0, 20, 20 + delete.len()]
            .iter()
            .map(|at| read_u32(&sent, at + 8))
            .collect();
        assert_eq!(sequences, [1, 2, 3]);
        assert_eq!(read_u16(&sent, 20 + delete.len() + 4), NFNL_MSG_BATCH_END);
        assert_eq!(
            &sent[20 + 16..20 + delete.len()],
            &delete[16..],
            "the change as asked"
        );
    }

    #[test]
    fn lists_chains_and_deletes_only_what_is_empty() {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                assert_eq!(chains(TableFamily::Ip, "nat").expect("asked"), None);
                assert_eq!(
                    delete_empty_table(TableFamily::Ip, "nat").expect("asked"),
                    Deleted::Absent
                );
                run("iptables-nft", &["-t", "nat", "-N", "CNI-T"]);
                run("iptables-nft", &["-t", "nat", "-A", "POSTROUTING", "-j", "CNI-T"]);
                let listed = chains(TableFamily::Ip, "nat").expect("asked").expect("table");
                let mut named: Vec<(&str, bool)> = listed.iter().map(|c| (c.name.as_str(), c.base)).collect();
                named.sort_unstable();
                assert_eq!(named, [("CNI-T", false), ("POSTROUTING", true)]);
                assert_eq!(
                    chains(TableFamily::Ip6, "nat").expect("asked"),
                    None,
                    "per family"
                );
                let delete = |chain| delete_empty_chain(TableFamily::Ip, "nat", chain).expect("asked");
                assert_eq!(delete("POSTROUTING"), Deleted::InUse, "it has a rule");
                assert_eq!(delete("CNI-T"), Deleted::InUse, "it is jumped to");
                assert_eq!(
                    delete_empty_table(TableFamily::Ip, "nat").expect("asked"),
                    Deleted::InUse
                );
                run("iptables-nft", &["-t", "nat", "-F", "POSTROUTING"]);
                assert_eq!(delete("POSTROUTING"), Deleted::Removed);
                assert_eq!(delete("POSTROUTING"), Deleted::Absent);
                assert_eq!(
                    delete_empty_table(TableFamily::Ip, "nat").expect("asked"),
                    Deleted::InUse,
                    "CNI-T is still there"
                );
                assert_eq!(delete("CNI-T"), Deleted::Removed);
                assert_eq!(
                    delete_empty_table(TableFamily::Ip, "nat").expect("asked"),
                    Deleted::Removed
                );
                assert!(!table_exists(TableFamily::Ip, "nat").expect("asked"));
                run(
                    "nft",
                    &["add table ip t; add chain ip t c; add rule ip t c counter"],
                );
                assert_eq!(
                    delete_table(TableFamily::Ip, "t").expect("asked"),
                    Deleted::Removed,
                    "with its contents"
                );
            });
        });
    }

    #[test]
    fn comments_come_out_of_user_data() {
        let mut userdata = vec![NFTNL_UDATA_RULE_COMMENT, 6];
        userdata.extend_from_slice(b"hello\0");
        let rule = |userdata: &[u8]| RuleMessage {
            attributes: vec![
                RuleAttribute::Handle(4),
                RuleAttribute::UserData(userdata.to_vec()),
            ],
        };
        assert_eq!(rule_comment(&rule(&userdata)).as_deref(), Some("hello"));
        assert_eq!(rule_comment(&rule(&[1, 1, 0])), None);
        assert_eq!(rule_comment(&rule(&[0, 9, 1])), None, "truncated");
        assert_eq!(rule_comment(&RuleMessage { attributes: vec![] }), None);
    }
}
