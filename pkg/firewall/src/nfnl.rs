//! Two nf_tables questions asked over netlink from inside the process, so
//! the per-pod path needs no `iptables-save` or `nft list` process (3–10 ms
//! each): does a chain exist, and what comments do a chain's rules carry.
//! They see what iptables-nft and nft write; x_tables (iptables-legacy)
//! needs its own tools. The calling thread's network namespace is asked.

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::{Error, Result};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_NEWRULE: u16 = 6;
const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
pub(crate) const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_RULE_USERDATA: u16 = 7;
/// nftnl's user-data type for a rule comment.
const NFTNL_UDATA_RULE_COMMENT: u8 = 0;
pub(crate) const ENOENT: i32 = 2;

/// The nf_tables family of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFamily {
    Inet = 1,
    Ip = 2,
    Ip6 = 10,
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
pub(crate) fn subsystem_request(
    subsystem: u16,
    message: u16,
    flags: u16,
    family: u8,
    attrs: &[u8],
) -> Vec<u8> {
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

pub(crate) fn read_u16(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Sends `request` and hands every reply message (type, payload after the
/// nlmsghdr) to `each` until the kernel is done: an ACK, an error, or the
/// end of a dump. A negative errno from the kernel is returned as `Err`.
pub(crate) fn converse(
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
pub(crate) fn attributes_from(bytes: &[u8], mut at: usize) -> Vec<(u16, &[u8])> {
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

#[cfg(test)]
mod tests {
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

    fn run(program: &str, args: &[&str]) {
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
    fn comments_come_out_of_user_data() {
        let mut userdata = vec![NFTNL_UDATA_RULE_COMMENT, 6];
        userdata.extend_from_slice(b"hello\0");
        assert_eq!(comment_of(&userdata).as_deref(), Some("hello"));
        assert_eq!(comment_of(&[1, 1, 0]), None);
        assert_eq!(comment_of(&[0, 9, 1]), None, "truncated");
    }
}
