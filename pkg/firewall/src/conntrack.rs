//! Removing conntrack entries over ctnetlink, in-process: a flow that
//! conntrack already maps keeps its translation however the rules change,
//! so a UDP flow to a mapped port keeps reaching the old destination until
//! its entry goes. The calling thread's network namespace is affected.
//!
//! Also what the NetworkPolicy agent cuts when a verdict narrows: the
//! flows a dump returns, with both tuples, and their removal.
//!
//! The dump request, the entries it returns (tuples, addresses, ports) and
//! the delete requests are `netlink-packet-netfilter`'s conntrack messages;
//! the socket and reply loop are [`nfnl`]'s. Nothing is encoded by hand.
//! The one attribute the crate does not name, `CTA_ZONE`, it keeps as an
//! opaque attribute that is sent back as it came.

use std::net::IpAddr;

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, Nla};
use netlink_packet_netfilter::conntrack::{ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Tuple};
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};

use crate::nfnl::{self, ENOENT};
use crate::{Error, Family, Result};

/// A zone keeps entries of equal tuples apart (not named by the crate).
const CTA_ZONE: u16 = 18;

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

fn proto_family(family: Family) -> NetfilterProtoFamily {
    match family {
        Family::V4 => NetfilterProtoFamily::IPv4,
        Family::V6 => NetfilterProtoFamily::IPv6,
    }
}

fn family_of(proto_family: NetfilterProtoFamily) -> Option<Family> {
    match proto_family {
        NetfilterProtoFamily::IPv4 => Some(Family::V4),
        NetfilterProtoFamily::IPv6 => Some(Family::V6),
        _ => None,
    }
}

/// One end pair of a tuple: addresses and ports (none for port-less
/// protocols such as ICMP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ends {
    pub source: Option<IpAddr>,
    pub destination: Option<IpAddr>,
    pub source_port: u16,
    pub destination_port: u16,
}

/// A tracked flow, as a dump reads it: its original direction (as the
/// first packet came, before any translation) and its reply direction (as
/// the answers come: a DNATed flow's replies come from the real
/// destination).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flow {
    pub family: Family,
    pub protocol: u8,
    pub original: Ends,
    pub reply: Ends,
    /// The attributes that name the entry to the kernel again.
    key: Vec<ConntrackAttribute>,
}

fn ends_of(tuple: &[Tuple]) -> (Option<u8>, Ends) {
    let mut ends = Ends::default();
    let mut protocol = None;
    for part in tuple {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(address) => ends.source = Some(*address),
                        IPTuple::DestinationAddress(address) => ends.destination = Some(*address),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(proto) => {
                for p in proto {
                    match p {
                        ProtoTuple::Protocol(number) => protocol = Some(u8::from(*number)),
                        ProtoTuple::SourcePort(port) => ends.source_port = *port,
                        ProtoTuple::DestinationPort(port) => ends.destination_port = *port,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (protocol, ends)
}

fn parse_flow(family: Family, attributes: &[ConntrackAttribute]) -> Option<Flow> {
    let orig = attributes.iter().find_map(|a| match a {
        ConntrackAttribute::CtaTupleOrig(tuple) => Some(tuple),
        _ => None,
    })?;
    let (protocol, original) = ends_of(orig);
    let reply = attributes
        .iter()
        .find_map(|a| match a {
            ConntrackAttribute::CtaTupleReply(tuple) => Some(ends_of(tuple).1),
            _ => None,
        })
        .unwrap_or_default();
    // The original tuple names the entry; a zone keeps entries of equal
    // tuples apart, so it goes with it.
    let zone = attributes
        .iter()
        .find(|a| matches!(a, ConntrackAttribute::Other(_)) && a.kind() == CTA_ZONE);
    let key = std::iter::once(ConntrackAttribute::CtaTupleOrig(orig.clone()))
        .chain(zone.cloned())
        .collect();
    Some(Flow {
        family,
        protocol: protocol?,
        original,
        reply,
        key,
    })
}

impl Filter {
    fn matches(&self, flow: &Flow) -> bool {
        flow.family == self.family
            && flow.protocol == self.protocol
            && flow.original.destination_port == self.port
            && self.reply_source.is_none_or(|ip| flow.reply.source == Some(ip))
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

/// A dumped entry: its family and attributes.
fn dumped_entry(message: NetfilterMessage) -> Option<(Family, Vec<ConntrackAttribute>)> {
    let family = family_of(message.header.family)?;
    match message.inner {
        NetfilterMessageInner::Conntrack(ConntrackMessage::New(attributes)) => Some((family, attributes)),
        _ => None,
    }
}

/// Every flow of the calling thread's network namespace, both families:
/// one dump (it walks the node's whole conntrack table, 10 ms with 262144
/// buckets, whatever the namespace holds), none when it tracks nothing.
pub fn flows() -> Result<Vec<Flow>> {
    if tracked_flows() == Some(0) {
        return Ok(Vec::new());
    }
    // AF_UNSPEC: the entries of both families.
    let dump = nfnl::serialize(
        ConntrackMessage::Get(vec![]),
        NetfilterProtoFamily::Unspec,
        0,
        NLM_F_DUMP,
        1,
    );
    let mut flows = Vec::new();
    let outcome = nfnl::converse("conntrack dump", &dump, |message| {
        if let Some((family, attributes)) = dumped_entry(message)
            && let Some(flow) = parse_flow(family, &attributes)
        {
            flows.push(flow);
        }
    })?;
    outcome.map_err(|errno| os_error("conntrack dump", errno))?;
    Ok(flows)
}

/// Removes `flows`' entries; returns how many went. An entry that expired
/// meanwhile is not an error.
pub fn remove<'a>(flows: impl IntoIterator<Item = &'a Flow>) -> Result<usize> {
    let mut removed = 0;
    for flow in flows {
        let request = nfnl::serialize(
            ConntrackMessage::Delete(flow.key.clone()),
            proto_family(flow.family),
            0,
            NLM_F_ACK,
            1,
        );
        match nfnl::converse("conntrack delete", &request, |_| {})? {
            Ok(()) => removed += 1,
            Err(ENOENT) => {}
            Err(errno) => return Err(os_error("conntrack delete", errno)),
        }
    }
    Ok(removed)
}

/// Removes the entries `filters` match; returns how many went.
pub fn delete(filters: &[Filter]) -> Result<usize> {
    if filters.is_empty() {
        return Ok(0);
    }
    let flows = flows()?;
    remove(
        flows
            .iter()
            .filter(|flow| filters.iter().any(|f| f.matches(flow))),
    )
}

fn os_error(what: &str, errno: i32) -> Error {
    Error::Invalid(format!("{what}: {}", std::io::Error::from_raw_os_error(errno)))
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, UdpSocket};

    use netlink_packet_core::{DefaultNla, NetlinkMessage, NetlinkPayload};
    use netlink_packet_netfilter::conntrack::Protocol;

    use super::*;
    use crate::nfnl::tests::{read_u16, run};

    const IPCTNL_MSG_CT_DELETE: u16 = 2;

    fn tuple(source: [u8; 4], protocol: u8, port: u16) -> Vec<Tuple> {
        vec![
            Tuple::Ip(vec![
                IPTuple::SourceAddress(IpAddr::from(source)),
                IPTuple::DestinationAddress(IpAddr::from([10, 0, 0, 1])),
            ]),
            Tuple::Proto(vec![
                ProtoTuple::Protocol(Protocol::from(protocol)),
                ProtoTuple::SourcePort(40000),
                ProtoTuple::DestinationPort(port),
            ]),
        ]
    }

    /// An entry as a dump returns it, through the crate's bytes and back.
    fn dumped(protocol: u8, port: u16, reply_src: [u8; 4]) -> Vec<ConntrackAttribute> {
        let sent = nfnl::serialize(
            ConntrackMessage::New(vec![
                ConntrackAttribute::CtaTupleOrig(tuple([10, 0, 0, 9], protocol, port)),
                ConntrackAttribute::CtaTupleReply(tuple(reply_src, protocol, 40000)),
                ConntrackAttribute::CtaTimeout(30),
                ConntrackAttribute::Other(DefaultNla::new(CTA_ZONE, 7u16.to_be_bytes().to_vec())),
            ]),
            NetfilterProtoFamily::IPv4,
            0,
            0,
            1,
        );
        let message = NetlinkMessage::<NetfilterMessage>::deserialize(&sent).expect("parses");
        let NetlinkPayload::InnerMessage(message) = message.payload else {
            panic!("not a netfilter message");
        };
        let (family, attributes) = dumped_entry(message).expect("an entry");
        assert_eq!(family, Family::V4);
        attributes
    }

    #[test]
    fn an_entry_is_read_and_named_by_its_original_tuple_and_zone() {
        let attributes = dumped(17, 8081, [10, 244, 0, 5]);
        let entry = parse_flow(Family::V4, &attributes).expect("parsed");
        assert_eq!((entry.protocol, entry.original.destination_port), (17, 8081));
        assert_eq!(entry.original.source, Some("10.0.0.9".parse().expect("ip")));
        assert_eq!(entry.reply.source, Some("10.244.0.5".parse().expect("ip")));
        assert_eq!(entry.key, [attributes[0].clone(), attributes[3].clone()]);
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

    #[test]
    fn a_delete_names_the_entry_as_the_kernel_sent_it() {
        let entry = parse_flow(Family::V4, &dumped(17, 8081, [10, 244, 0, 5])).expect("parsed");
        let request = nfnl::serialize(
            ConntrackMessage::Delete(entry.key),
            proto_family(Family::V4),
            0,
            NLM_F_ACK,
            1,
        );
        assert_eq!(read_u16(&request, 4), (1 << 8) | IPCTNL_MSG_CT_DELETE);
        assert_eq!(request[16], 2, "NFPROTO_IPV4");
        // CTA_TUPLE_ORIG, nested, then CTA_ZONE: 2 bytes, big-endian.
        assert_eq!(read_u16(&request, 22), 0x8000 | 1);
        let zone_at = 20 + usize::from(read_u16(&request, 20));
        assert_eq!(
            (read_u16(&request, zone_at), read_u16(&request, zone_at + 2)),
            (6, CTA_ZONE)
        );
        assert_eq!(&request[zone_at + 4..zone_at + 6], &[0, 7]);
        assert_eq!(request.len(), zone_at + 8);
    }

    /// A UDP flow to 127.0.0.1 in a namespace of its own, tracked because
    /// a rule there uses conntrack: the delete removes the one the filter
    /// names and leaves the other.
    #[test]
    fn deletes_a_real_entry_and_leaves_the_others() {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                run("ip", &["link", "set", "lo", "up"]);
                // Conntrack hooks a namespace only once a rule needs it.
                run(
                    "nft",
                    &["add table ip t; add chain ip t out { type filter hook output priority 0; }; add rule ip t out ct state new counter"],
                );
                let listener = |port| UdpSocket::bind((Ipv4Addr::LOCALHOST, port)).expect("bound");
                let (kept, doomed) = (listener(0), listener(0));
                let port = |socket: &UdpSocket| socket.local_addr().expect("address").port();
                let client = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).expect("bound");
                for server in [&kept, &doomed] {
                    client.send_to(b"x", server.local_addr().expect("address")).expect("sent");
                }
                let filter = |port| Filter {
                    family: Family::V4,
                    protocol: 17,
                    port,
                    reply_source: Some(IpAddr::from(Ipv4Addr::LOCALHOST)),
                };
                assert_eq!(tracked_flows(), Some(2), "both flows tracked");
                assert_eq!(delete(&[filter(port(&doomed))]).expect("deleted"), 1);
                assert_eq!(tracked_flows(), Some(1));
                assert_eq!(delete(&[filter(port(&doomed))]).expect("asked"), 0, "gone");
                let elsewhere = Filter {
                    reply_source: Some("10.0.0.1".parse().expect("ip")),
                    ..filter(port(&kept))
                };
                assert_eq!(delete(&[elsewhere]).expect("asked"), 0, "replies come from 127.0.0.1");
                assert_eq!(delete(&[filter(port(&kept))]).expect("deleted"), 1);
                assert_eq!(delete(&[filter(port(&kept))]).expect("asked"), 0, "none tracked");
            });
        });
    }
}
