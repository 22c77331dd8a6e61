//! Removing conntrack entries over ctnetlink, in-process: a flow that
//! conntrack already maps keeps its translation however the rules change,
//! so a UDP flow to a mapped port keeps reaching the old destination until
//! its entry goes. The calling thread's network namespace is affected.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::nfnl::{self, ENOENT, NLM_F_ACK, NLM_F_DUMP};
use crate::{Error, Family, Result};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_DST_PORT: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;

/// Which entries to remove: those of `protocol` whose original destination
/// port is `port` and, when `reply_source` is given, whose replies come
/// from that address (the flows translated to one pod).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filter {
    pub family: Family,
    pub protocol: u8,
    pub port: u16,
    pub reply_source: Option<IpAddr>,
}

fn nfproto(family: Family) -> u8 {
    match family {
        Family::V4 => 2,
        Family::V6 => 10,
    }
}

/// What an entry is keyed by, as read from a dump.
#[derive(Debug, Default, PartialEq, Eq)]
struct Entry {
    protocol: u8,
    port: u16,
    reply_source: Option<IpAddr>,
    /// The raw attributes that name the entry to the kernel again.
    key: Vec<u8>,
}

fn nested(value: &[u8]) -> Vec<(u16, &[u8])> {
    nfnl::attributes_from(value, 0)
}

fn find(attrs: &[(u16, &[u8])], kind: u16) -> Option<Vec<u8>> {
    attrs.iter().find(|(k, _)| *k == kind).map(|(_, v)| v.to_vec())
}

fn source_of(ip_attrs: &[(u16, &[u8])]) -> Option<IpAddr> {
    ip_attrs
        .iter()
        .find_map(|(kind, value)| match (*kind, value.len()) {
            (CTA_IP_V4_SRC, 4) => Some(IpAddr::V4(Ipv4Addr::new(value[0], value[1], value[2], value[3]))),
            (CTA_IP_V6_SRC, 16) => <[u8; 16]>::try_from(*value)
                .ok()
                .map(|b| IpAddr::V6(Ipv6Addr::from(b))),
            _ => None,
        })
}

/// Re-encodes an attribute as the kernel sent it, for a delete request.
fn encode(kind: u16, value: &[u8], out: &mut Vec<u8>) {
    let len = 4 + value.len();
    out.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len() + ((len + 3) & !3) - len, 0);
}

fn parse_entry(payload: &[u8]) -> Option<Entry> {
    let attrs = nfnl::attributes_from(payload, 4);
    let orig = attrs.iter().find(|(k, _)| *k == CTA_TUPLE_ORIG)?.1;
    let proto = nested(orig)
        .iter()
        .find(|(k, _)| *k == CTA_TUPLE_PROTO)?
        .1
        .to_vec();
    let proto = nested(&proto);
    let protocol = *find(&proto, CTA_PROTO_NUM)?.first()?;
    let port = find(&proto, CTA_PROTO_DST_PORT)
        .and_then(|b| <[u8; 2]>::try_from(b.as_slice()).ok())
        .map(u16::from_be_bytes)
        .unwrap_or(0);
    let reply_source = attrs
        .iter()
        .find(|(k, _)| *k == CTA_TUPLE_REPLY)
        .and_then(|(_, reply)| {
            let ip = nested(reply).iter().find(|(k, _)| *k == CTA_TUPLE_IP)?.1.to_vec();
            source_of(&nested(&ip))
        });
    // The original tuple names the entry; a zone keeps entries of equal
    // tuples apart, so it goes with it.
    let mut key = Vec::new();
    encode(CTA_TUPLE_ORIG | NLA_F_NESTED, orig, &mut key);
    if let Some(zone) = find(&attrs, CTA_ZONE) {
        encode(CTA_ZONE, &zone, &mut key);
    }
    Some(Entry {
        protocol,
        port,
        reply_source,
        key,
    })
}

impl Filter {
    fn matches(&self, entry: &Entry) -> bool {
        entry.protocol == self.protocol
            && entry.port == self.port
            && self.reply_source.is_none_or(|ip| entry.reply_source == Some(ip))
    }
}

/// The flows this network namespace tracks now (its own count, read
/// through the calling thread's /proc/thread-self).
fn tracked_flows() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/net/stat/nf_conntrack")
        .ok()
        .and_then(|text| {
            let line = text.lines().nth(1)?;
            u64::from_str_radix(line.split_whitespace().next()?, 16).ok()
        })
}

/// Removes the entries `filters` match; returns how many went. One dump of
/// both families (a dump walks the node's whole conntrack table, 10 ms
/// with 262144 buckets, whatever the namespace holds), none when the
/// namespace tracks nothing. An entry that expired meanwhile is not an
/// error.
pub fn delete(filters: &[Filter]) -> Result<usize> {
    if filters.is_empty() || tracked_flows() == Some(0) {
        return Ok(0);
    }
    let dump = nfnl::subsystem_request(NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_GET, NLM_F_DUMP, 0, &[]);
    let mut doomed = Vec::new();
    let outcome = nfnl::converse("conntrack dump", &dump, |kind, payload| {
        let Some(family) = payload.first().and_then(|f| family_of_nfproto(*f)) else {
            return;
        };
        if kind == IPCTNL_MSG_CT_NEW
            && let Some(entry) = parse_entry(payload)
            && filters.iter().any(|f| f.family == family && f.matches(&entry))
        {
            doomed.push((family, entry.key));
        }
    })?;
    outcome.map_err(|errno| os_error("conntrack dump", errno))?;
    let mut removed = 0;
    for (family, key) in doomed {
        let request = nfnl::subsystem_request(
            NFNL_SUBSYS_CTNETLINK,
            IPCTNL_MSG_CT_DELETE,
            NLM_F_ACK,
            nfproto(family),
            &key,
        );
        match nfnl::converse("conntrack delete", &request, |_, _| {})? {
            Ok(()) => removed += 1,
            Err(ENOENT) => {}
            Err(errno) => return Err(os_error("conntrack delete", errno)),
        }
    }
    Ok(removed)
}

fn family_of_nfproto(value: u8) -> Option<Family> {
    match value {
        2 => Some(Family::V4),
        10 => Some(Family::V6),
        _ => None,
    }
}

fn os_error(what: &str, errno: i32) -> Error {
    Error::Invalid(format!("{what}: {}", std::io::Error::from_raw_os_error(errno)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode(kind, value, &mut out);
        out
    }

    fn entry_message(protocol: u8, port: u16, reply_src: [u8; 4]) -> Vec<u8> {
        let proto = [
            attr(CTA_PROTO_NUM, &[protocol]),
            attr(CTA_PROTO_DST_PORT, &port.to_be_bytes()),
        ]
        .concat();
        let orig = [
            attr(CTA_TUPLE_IP | NLA_F_NESTED, &attr(2, &[10, 0, 0, 1])),
            attr(CTA_TUPLE_PROTO | NLA_F_NESTED, &proto),
        ]
        .concat();
        let reply = attr(CTA_TUPLE_IP | NLA_F_NESTED, &attr(CTA_IP_V4_SRC, &reply_src));
        [
            vec![2, 0, 0, 0],
            attr(CTA_TUPLE_ORIG | NLA_F_NESTED, &orig),
            attr(CTA_TUPLE_REPLY | NLA_F_NESTED, &reply),
            attr(CTA_ZONE, &7u16.to_be_bytes()),
        ]
        .concat()
    }

    #[test]
    fn an_entry_is_read_and_named_by_its_original_tuple_and_zone() {
        let message = entry_message(17, 8081, [10, 244, 0, 5]);
        let entry = parse_entry(&message).expect("parsed");
        assert_eq!((entry.protocol, entry.port), (17, 8081));
        assert_eq!(entry.reply_source, Some("10.244.0.5".parse().expect("ip")));
        let orig_len = usize::from(nfnl::read_u16(&message, 4));
        let zone = attr(CTA_ZONE, &7u16.to_be_bytes());
        assert_eq!(entry.key, [&message[4..4 + orig_len], &zone[..]].concat());
        let pod = |ip: &str| Filter {
            family: Family::V4,
            protocol: 17,
            port: 8081,
            reply_source: Some(ip.parse().expect("ip")),
        };
        assert!(pod("10.244.0.5").matches(&entry));
        assert!(!pod("10.244.0.6").matches(&entry));
        assert!(
            Filter {
                reply_source: None,
                ..pod("10.244.0.6")
            }
            .matches(&entry)
        );
        assert!(
            !Filter {
                port: 8080,
                ..pod("10.244.0.5")
            }
            .matches(&entry)
        );
    }
}
