//! nf_tables over netlink from inside the process, so the per-pod path
//! needs no `iptables-save` or `nft list` process (3–10 ms each): does a
//! chain exist, and what comments do a chain's rules carry; and, for the
//! node agent's uninstall (whose image has no `nft`), which tables and
//! chains exist and the deletion of an empty chain or table. They see what
//! iptables-nft and nft write; x_tables (iptables-legacy) needs its own
//! tools. The calling thread's network namespace is asked.

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::{Error, Result};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_NEWRULE: u16 = 6;
const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP: u16 = 0x300;
/// On a delete: refuse (EBUSY) rather than take the contents along.
const NLM_F_NONREC: u16 = 0x100;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
/// Only base chains have one.
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_RULE_USERDATA: u16 = 7;
/// nftnl's user-data type for a rule comment.
const NFTNL_UDATA_RULE_COMMENT: u8 = 0;
pub const ENOENT: i32 = 2;
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
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn push_attr(buf: &mut Vec<u8>, kind: u16, text: &str) {
    let len = 4 + text.len() + 1;
    buf.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(text.as_bytes());
    buf.push(0);
    buf.resize(buf.len() + align4(len) - len, 0);
}

fn request(message: u16, flags: u16, family: TableFamily, attrs: &[(u16, &str)]) -> Vec<u8> {
    let mut encoded = Vec::new();
    for (kind, text) in attrs {
        push_attr(&mut encoded, *kind, text);
    }
    subsystem_request(NFNL_SUBSYS_NFTABLES, message, flags, family as u8, &encoded)
}

/// A netfilter netlink request of `subsystem`: header, nfgenmsg for
/// `family` (an NFPROTO_* value), then the encoded attributes.
pub fn subsystem_request(subsystem: u16, message: u16, flags: u16, family: u8, attrs: &[u8]) -> Vec<u8> {
    let mut buf = vec![0u8; 16];
    buf.push(family);
    buf.push(0); // NFNETLINK_V0
    buf.extend_from_slice(&[0, 0]); // res_id
    buf.extend_from_slice(attrs);
    let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
    buf[0..4].copy_from_slice(&len.to_ne_bytes());
    buf[4..6].copy_from_slice(&((subsystem << 8) | message).to_ne_bytes());
    buf[6..8].copy_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
    buf[8..12].copy_from_slice(&1u32.to_ne_bytes());
    buf
}

fn io_error(what: &str, e: &std::io::Error) -> Error {
    Error::Invalid(format!("netfilter {what}: {e}"))
}

pub fn read_u16(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Sends `request` and hands every reply message (type, payload after the
/// nlmsghdr) to `each` until the kernel is done: an ACK, an error, or the
/// end of a dump. A negative errno from the kernel is returned as `Err`.
pub fn converse(
    what: &str,
    request: &[u8],
    mut each: impl FnMut(u16, &[u8]),
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
        while at + 16 <= n {
            let len = read_u32(&buf, at) as usize;
            if len < 16 || at + len > n {
                return Err(Error::Invalid(format!("netfilter {what}: a malformed reply")));
            }
            let kind = read_u16(&buf, at + 4);
            let payload = &buf[at + 16..at + len];
            match kind {
                NLMSG_ERROR => {
                    let Some(code) = payload.get(..4) else {
                        return Err(Error::Invalid(format!("netfilter {what}: a truncated error")));
                    };
                    let code = i32::from_ne_bytes([code[0], code[1], code[2], code[3]]);
                    return Ok(if code == 0 { Ok(()) } else { Err(-code) });
                }
                NLMSG_DONE => return Ok(Ok(())),
                _ => each(kind & 0xff, payload),
            }
            at += align4(len);
        }
    }
}

/// Whether `chain` exists in `table` (a missing table means no).
pub fn chain_exists(family: TableFamily, table: &str, chain: &str) -> Result<bool> {
    let message = request(
        NFT_MSG_GETCHAIN,
        NLM_F_ACK,
        family,
        &[(NFTA_CHAIN_TABLE, table), (NFTA_CHAIN_NAME, chain)],
    );
    match converse("chain lookup", &message, |_, _| {})? {
        Ok(()) => Ok(true),
        Err(ENOENT) => Ok(false),
        Err(errno) => Err(Error::Invalid(format!(
            "nf_tables chain lookup {table}/{chain}: {}",
            std::io::Error::from_raw_os_error(errno)
        ))),
    }
}

/// The attributes of a netlink payload after its 4-byte nfgenmsg.
fn attributes(payload: &[u8]) -> Vec<(u16, &[u8])> {
    attributes_from(payload, 4)
}

/// The attributes in `bytes` from `at` on (a nested attribute's value from
/// 0), each as (type without its flags, value).
pub fn attributes_from(bytes: &[u8], mut at: usize) -> Vec<(u16, &[u8])> {
    let payload = bytes;
    let mut out = Vec::new();
    while at + 4 <= payload.len() {
        let len = read_u16(payload, at) as usize;
        if len < 4 || at + len > payload.len() {
            break;
        }
        out.push((read_u16(payload, at + 2) & 0x3fff, &payload[at + 4..at + len]));
        at += align4(len);
    }
    out
}

/// The comment in a rule's user data (nftnl's TLV list), if any.
fn comment_of(userdata: &[u8]) -> Option<String> {
    let mut at = 0;
    while at + 2 <= userdata.len() {
        let (kind, len) = (userdata[at], userdata[at + 1] as usize);
        let value = userdata.get(at + 2..at + 2 + len)?;
        if kind == NFTNL_UDATA_RULE_COMMENT {
            let text = value.split(|b| *b == 0).next().unwrap_or_default();
            return Some(String::from_utf8_lossy(text).into_owned());
        }
        at += 2 + len;
    }
    None
}

/// Hands each rule of `chain` (none when the chain or its table does not
/// exist) to `each` as its attributes.
fn for_each_rule(
    family: TableFamily,
    table: &str,
    chain: &str,
    mut each: impl FnMut(&[(u16, &[u8])]),
) -> Result<()> {
    let message = request(
        NFT_MSG_GETRULE,
        NLM_F_DUMP,
        family,
        &[(NFTA_RULE_TABLE, table), (NFTA_RULE_CHAIN, chain)],
    );
    let outcome = converse("rule listing", &message, |kind, payload| {
        if kind != NFT_MSG_NEWRULE {
            return;
        }
        let attrs = attributes(payload);
        let in_chain = attrs
            .iter()
            .any(|(k, v)| *k == NFTA_RULE_CHAIN && v.split(|b| *b == 0).next() == Some(chain.as_bytes()));
        if in_chain {
            each(&attrs);
        }
    })?;
    match outcome {
        Ok(()) | Err(ENOENT) => Ok(()),
        Err(errno) => Err(Error::Invalid(format!(
            "nf_tables rule listing {table}/{chain}: {}",
            std::io::Error::from_raw_os_error(errno)
        ))),
    }
}

/// The comments of the rules in `chain` that keep one in their user data
/// (nft's `comment`).
pub fn rule_comments(family: TableFamily, table: &str, chain: &str) -> Result<Vec<String>> {
    let mut comments = Vec::new();
    for_each_rule(family, table, chain, |attrs| {
        if let Some(comment) = attrs
            .iter()
            .find(|(k, _)| *k == NFTA_RULE_USERDATA)
            .and_then(|(_, v)| comment_of(v))
        {
            comments.push(comment);
        }
    })?;
    Ok(comments)
}

/// How many rules `chain` has.
pub fn rule_count(family: TableFamily, table: &str, chain: &str) -> Result<usize> {
    let mut count = 0;
    for_each_rule(family, table, chain, |_| count += 1)?;
    Ok(count)
}

/// The handles of the rules of `chain` whose comment (nft's user data) is
/// exactly `comment`, for deleting them by handle.
pub fn handles_with_comment(
    family: TableFamily,
    table: &str,
    chain: &str,
    comment: &str,
) -> Result<Vec<u64>> {
    let mut handles = Vec::new();
    for_each_rule(family, table, chain, |attrs| {
        let commented = attrs
            .iter()
            .find(|(k, _)| *k == NFTA_RULE_USERDATA)
            .and_then(|(_, v)| comment_of(v))
            .is_some_and(|c| c == comment);
        let handle = attrs
            .iter()
            .find(|(k, _)| *k == NFTA_RULE_HANDLE)
            .and_then(|(_, v)| <[u8; 8]>::try_from(*v).ok())
            .map(u64::from_be_bytes);
        if let (true, Some(handle)) = (commented, handle) {
            handles.push(handle);
        }
    })?;
    Ok(handles)
}

/// How many rules of `chain` carry `text` anywhere in their attributes: a
/// comment iptables-nft keeps in its `comment` match (which nft does not
/// show), or one nft keeps in the rule's user data.
pub fn rules_mentioning(family: TableFamily, table: &str, chain: &str, text: &str) -> Result<usize> {
    let needle = text.as_bytes();
    let mut count = 0;
    for_each_rule(family, table, chain, |attrs| {
        let found = attrs
            .iter()
            .any(|(_, value)| !needle.is_empty() && value.windows(needle.len()).any(|w| w == needle));
        count += usize::from(found);
    })?;
    Ok(count)
}

fn failed(what: &str, object: &str, errno: i32) -> Error {
    Error::Invalid(format!(
        "nf_tables {what} {object}: {}",
        std::io::Error::from_raw_os_error(errno)
    ))
}

/// A NUL-terminated string attribute's text.
fn text_of(value: &[u8]) -> String {
    String::from_utf8_lossy(value.split(|b| *b == 0).next().unwrap_or_default()).into_owned()
}

/// Whether `table` exists.
pub fn table_exists(family: TableFamily, table: &str) -> Result<bool> {
    let message = request(NFT_MSG_GETTABLE, NLM_F_ACK, family, &[(NFTA_TABLE_NAME, table)]);
    match converse("table lookup", &message, |_, _| {})? {
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

/// The chains of `table`, or None when there is no such table.
pub fn chains(family: TableFamily, table: &str) -> Result<Option<Vec<Chain>>> {
    if !table_exists(family, table)? {
        return Ok(None);
    }
    // The kernel dumps every chain of the family; the table is picked here.
    let message = request(NFT_MSG_GETCHAIN, NLM_F_DUMP, family, &[]);
    let mut chains = Vec::new();
    let outcome = converse("chain listing", &message, |kind, payload| {
        if kind != NFT_MSG_NEWCHAIN {
            return;
        }
        let attrs = attributes(payload);
        let text = |wanted: u16| attrs.iter().find(|(k, _)| *k == wanted).map(|(_, v)| text_of(v));
        if text(NFTA_CHAIN_TABLE).as_deref() == Some(table)
            && let Some(name) = text(NFTA_CHAIN_NAME)
        {
            let base = attrs.iter().any(|(k, _)| *k == NFTA_CHAIN_HOOK);
            chains.push(Chain { name, base });
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
    delete(
        family,
        NFT_MSG_DELCHAIN,
        NLM_F_NONREC,
        &[(NFTA_CHAIN_TABLE, table), (NFTA_CHAIN_NAME, chain)],
        &format!("{table}/{chain}"),
    )
}

/// Deletes `table` unless it still holds a chain, set or object.
pub fn delete_empty_table(family: TableFamily, table: &str) -> Result<Deleted> {
    delete(
        family,
        NFT_MSG_DELTABLE,
        NLM_F_NONREC,
        &[(NFTA_TABLE_NAME, table)],
        table,
    )
}

/// Deletes `table` with everything in it.
pub fn delete_table(family: TableFamily, table: &str) -> Result<Deleted> {
    delete(family, NFT_MSG_DELTABLE, 0, &[(NFTA_TABLE_NAME, table)], table)
}

fn delete(
    family: TableFamily,
    message: u16,
    flags: u16,
    attrs: &[(u16, &str)],
    object: &str,
) -> Result<Deleted> {
    let transaction = batch(&request(message, NLM_F_ACK | flags, family, attrs));
    match converse("deletion", &transaction, |_, _| {})? {
        Ok(()) => Ok(Deleted::Removed),
        Err(EBUSY) => Ok(Deleted::InUse),
        Err(ENOENT) => Ok(Deleted::Absent),
        Err(errno) => Err(failed("deletion of", object, errno)),
    }
}

/// `message` as one nf_tables transaction: changes are accepted only
/// between a batch's begin and end.
fn batch(message: &[u8]) -> Vec<u8> {
    let marker = |kind: u16, sequence: u32| {
        let mut marker = subsystem_request(0, kind, 0, 0, &[]);
        // res_id: the subsystem the batch is for, in network order.
        marker[18..20].copy_from_slice(&NFNL_SUBSYS_NFTABLES.to_be_bytes());
        marker[8..12].copy_from_slice(&sequence.to_ne_bytes());
        marker
    };
    let mut out = marker(NFNL_MSG_BATCH_BEGIN, 1);
    let start = out.len();
    out.extend_from_slice(message);
    out[start + 8..start + 12].copy_from_slice(&2u32.to_ne_bytes());
    out.extend(marker(NFNL_MSG_BATCH_END, 3));
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn requests_are_laid_out_as_nfnetlink_expects() {
        let r = request(
            NFT_MSG_GETCHAIN,
            NLM_F_ACK,
            TableFamily::Ip,
            &[(NFTA_CHAIN_TABLE, "nat")],
        );
        // 16 header + 4 nfgenmsg + (4 + "nat\0") attribute.
        assert_eq!(r.len(), 28);
        assert_eq!(read_u32(&r, 0), 28);
        assert_eq!(read_u16(&r, 4), (10 << 8) | 4);
        assert_eq!(read_u16(&r, 6), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(r[16], 2, "NFPROTO_IPV4");
        assert_eq!((read_u16(&r, 20), read_u16(&r, 22)), (8, NFTA_CHAIN_TABLE));
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
    fn a_change_travels_alone_in_one_batch() {
        let delete = request(
            NFT_MSG_DELTABLE,
            NLM_F_ACK | NLM_F_NONREC,
            TableFamily::Ip6,
            &[(NFTA_TABLE_NAME, "nat")],
        );
        let sent = batch(&delete);
        assert_eq!(sent.len(), 20 + delete.len() + 20);
        assert_eq!(read_u16(&sent, 4), NFNL_MSG_BATCH_BEGIN);
        assert_eq!(&sent[18..20], &[0, 10], "res_id: nf_tables, network order");
        assert_eq!(read_u16(&sent, 24), (10 << 8) | NFT_MSG_DELTABLE);
        assert_eq!(read_u16(&sent, 26), NLM_F_REQUEST | NLM_F_ACK | NLM_F_NONREC);
        let sequences: Vec<u32> = [0, 20, 20 + delete.len()]
            .iter()
            .map(|at| read_u32(&sent, at + 8))
            .collect();
        assert_eq!(sequences, [1, 2, 3]);
        assert_eq!(read_u16(&sent, 20 + delete.len() + 4), NFNL_MSG_BATCH_END);
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
        assert_eq!(comment_of(&userdata).as_deref(), Some("hello"));
        assert_eq!(comment_of(&[1, 1, 0]), None);
        assert_eq!(comment_of(&[0, 9, 1]), None, "truncated");
    }
}
