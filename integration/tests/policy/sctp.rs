//! SCTP verdicts without SCTP sockets (this kernel has none): raw SCTP
//! INIT packets from one pod to another, seen or not by a raw socket in
//! the receiving pod, and counted by a table of the test's own in the
//! node, before and after the policy's chain.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use netpol::model::{Peer, Policy, PortSpec, Protocol, Rule};
use test_kit::Netns;

use crate::kernel::{Cluster, app};

/// The port the policy opens to SCTP.
const OPEN: u16 = 3868;
/// The port the policy opens to TCP only.
const TCP_ONLY: u16 = 3869;
/// The observing table in the node, not the policy's.
const OBSERVER: &str = "cnit-sctp-observer";

/// CRC32c (Castagnoli, reflected), as SCTP's checksum uses it.
fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for byte in bytes {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// An SCTP packet: the common header (verification tag 0, as an INIT's
/// is) and one INIT chunk whose initiate tag is `tag`, checksummed.
fn init(source_port: u16, port: u16, tag: u32) -> Vec<u8> {
    let mut packet = Vec::with_capacity(32);
    packet.extend_from_slice(&source_port.to_be_bytes());
    packet.extend_from_slice(&port.to_be_bytes());
    packet.extend_from_slice(&0u32.to_be_bytes()); // verification tag
    packet.extend_from_slice(&0u32.to_be_bytes()); // checksum, below
    packet.push(1); // INIT
    packet.push(0); // flags
    packet.extend_from_slice(&20u16.to_be_bytes()); // chunk length
    packet.extend_from_slice(&tag.to_be_bytes()); // initiate tag
    packet.extend_from_slice(&65_535u32.to_be_bytes()); // a_rwnd
    packet.extend_from_slice(&1u16.to_be_bytes()); // outbound streams
    packet.extend_from_slice(&1u16.to_be_bytes()); // inbound streams
    packet.extend_from_slice(&tag.to_be_bytes()); // initial TSN
    // The CRC goes on the wire least significant byte first (RFC 9260,
    // appendix A; the kernel's `cpu_to_le32`).
    let sum = crc32c(&packet);
    packet[8..12].copy_from_slice(&sum.to_le_bytes());
    packet
}

/// A raw socket of protocol SCTP, made in a pod's namespace: it sends
/// what it is given as an SCTP packet and receives every SCTP packet the
/// pod is sent.
struct RawSctp {
    fd: OwnedFd,
    v6: bool,
}

impl RawSctp {
    fn open(ns: &Netns, v6: bool) -> RawSctp {
        let fd = netns::NetNs::open(ns.path())
            .expect("the pod's namespace")
            .run(|| {
                let family = if v6 { libc::AF_INET6 } else { libc::AF_INET };
                // SAFETY: a plain syscall on constant arguments.
                let fd =
                    unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::IPPROTO_SCTP) };
                assert!(fd >= 0, "raw SCTP socket: {}", std::io::Error::last_os_error());
                // SAFETY: a descriptor just opened, owned by nothing else.
                unsafe { OwnedFd::from_raw_fd(fd) }
            })
            .expect("enter the pod's namespace");
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: the option's value is a live `timeval` of the size given.
        let set = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeout).cast(),
                libc::socklen_t::try_from(size_of::<libc::timeval>()).expect("small"),
            )
        };
        assert_eq!(set, 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
        RawSctp { fd, v6 }
    }

    fn send(&self, to: IpAddr, packet: &[u8]) {
        use nix::sys::socket::{MsgFlags, SockaddrIn, SockaddrIn6, sendto};
        let fd = self.fd.as_raw_fd();
        let sent = match to {
            IpAddr::V4(v4) => sendto(
                fd,
                packet,
                &SockaddrIn::from(std::net::SocketAddrV4::new(v4, 0)),
                MsgFlags::empty(),
            ),
            IpAddr::V6(v6) => sendto(
                fd,
                packet,
                &SockaddrIn6::from(std::net::SocketAddrV6::new(v6, 0, 0, 0)),
                MsgFlags::empty(),
            ),
        };
        assert_eq!(sent.ok(), Some(packet.len()), "sendto {to}: {sent:?}");
    }

    /// The (destination port, initiate tag) of every INIT received until
    /// one tagged `last` is, or `limit` passes.
    fn received_until(&self, last: u32, limit: Duration) -> BTreeSet<(u16, u32)> {
        let mut seen = BTreeSet::new();
        let until = Instant::now() + limit;
        let mut buffer = [0u8; 2048];
        while Instant::now() < until {
            // SAFETY: the buffer is live and as long as said.
            let length =
                unsafe { libc::recv(self.fd.as_raw_fd(), buffer.as_mut_ptr().cast(), buffer.len(), 0) };
            let Ok(length) = usize::try_from(length) else {
                continue; // the receive timeout: look at the clock again
            };
            // IPv4 raw sockets receive the IP header too, IPv6 ones not.
            let start = if self.v6 {
                0
            } else {
                usize::from(buffer[0] & 0x0f) * 4
            };
            let sctp = &buffer[start..length];
            if sctp.len() < 32 || sctp[12] != 1 {
                continue;
            }
            let port = u16::from_be_bytes([sctp[2], sctp[3]]);
            let tag = u32::from_be_bytes([sctp[16], sctp[17], sctp[18], sctp[19]]);
            seen.insert((port, tag));
            if tag == last {
                break;
            }
        }
        seen
    }
}

/// The packets each counter of the observer counted, by comment.
fn counters(cluster: &Cluster) -> Vec<(String, u64)> {
    let listed = cluster.nft(&["list", "table", "inet", OBSERVER]);
    listed
        .lines()
        .filter_map(|line| {
            let packets = line.split("counter packets ").nth(1)?;
            let packets = packets.split_whitespace().next()?.parse().ok()?;
            let comment = line.split("comment \"").nth(1)?.trim_end_matches('"');
            Some((comment.to_owned(), packets))
        })
        .collect()
}

fn counted(cluster: &Cluster, comment: &str) -> u64 {
    counters(cluster)
        .into_iter()
        .find(|(c, _)| c == comment)
        .map(|(_, packets)| packets)
        .unwrap_or_else(|| panic!("no counter {comment:?} in {:?}", counters(cluster)))
}

/// Counters on `forward` before the policy's chain (priority -10) and
/// after it (10): what left the client and what the policy let through.
fn observe(cluster: &Cluster) {
    let mut script = format!("add table inet {OBSERVER}\n");
    for (chain, priority) in [("before", -10), ("after", 10)] {
        script.push_str(&format!(
            "add chain inet {OBSERVER} {chain} {{ type filter hook forward priority {priority}; policy accept; }}\n"
        ));
        for family in ["ipv4", "ipv6"] {
            for port in [OPEN, TCP_ONLY] {
                script.push_str(&format!(
                    "add rule inet {OBSERVER} {chain} meta nfproto {family} sctp dport {port} \
                     counter comment \"{chain} {family} {port}\"\n"
                ));
            }
        }
    }
    test_kit::run_in(
        cluster.node.netns.path(),
        std::path::Path::new("nft"),
        &["-f", "-"],
        &[],
        &script,
    )
    .success();
}

/// `db` takes SCTP on [`OPEN`] and TCP on [`TCP_ONLY`], both from `web`.
fn sctp_to_db() -> Policy {
    let from_web = || {
        Some(vec![Peer::Pods {
            pods: Some(app("web")),
            namespaces: None,
        }])
    };
    Policy {
        namespace: "shop".into(),
        name: "db-sctp".into(),
        pod_selector: app("db"),
        ingress: Some(vec![
            Rule {
                peers: from_web(),
                ports: vec![PortSpec::Range(Protocol::Sctp, OPEN, OPEN)],
            },
            Rule {
                peers: from_web(),
                ports: vec![PortSpec::Range(Protocol::Tcp, TCP_ONLY, TCP_ONLY)],
            },
        ]),
        egress: None,
    }
}

#[test]
fn crc32c_is_castagnolis() {
    // The check value of CRC-32C.
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
}

#[test]
fn sctp_passes_on_the_sctp_port_a_rule_names_only_and_a_tcp_rule_on_a_port_lets_no_sctp_through() {
    test_kit::require_root();
    let cluster = Cluster::new(&[("web", "web"), ("db", "db"), ("other", "other")]);
    observe(&cluster);
    let _tcp = cluster.probe.listen(&cluster.pod("db").0, &[OPEN, TCP_ONLY]);
    let mut tag = 0x5C70_0000u32;
    let mut next_tag = || {
        tag += 1;
        tag
    };

    for v6 in [false, true] {
        let family = if v6 { "ipv6" } else { "ipv4" };
        let db: IpAddr = cluster.address("db", v6).parse().expect("an address");
        let server = RawSctp::open(&cluster.pod("db").0, v6);
        let web = RawSctp::open(&cluster.pod("web").0, v6);
        let other = RawSctp::open(&cluster.pod("other").0, v6);

        // Without a policy both ports are open: the packets are good
        // enough to cross the node (bridge, conntrack) at all.
        cluster.enforce(vec![]);
        let (open, tcp_only) = (next_tag(), next_tag());
        web.send(db, &init(40_000, TCP_ONLY, tcp_only));
        web.send(db, &init(40_000, OPEN, open));
        let seen = server.received_until(open, Duration::from_secs(3));
        assert_eq!(
            seen,
            BTreeSet::from([(TCP_ONLY, tcp_only), (OPEN, open)]),
            "{family}: open before any policy"
        );
        // Valid SCTP to the node's conntrack (checksum and all): tracked,
        // as a packet with a bad checksum would not be.
        let tracked = cluster
            .node
            .run("conntrack", &["-L", "-p", "sctp"])
            .success()
            .stdout;
        let web_address = cluster.address("web", v6);
        assert!(
            tracked
                .lines()
                .any(|flow| flow.contains(&format!("src={web_address} "))
                    && flow.contains(&format!("sport=40000 dport={OPEN} "))),
            "{family}: the INIT's flow in conntrack: {tracked}"
        );

        cluster.enforce(vec![sctp_to_db()]);
        let before = |port: u16| counted(&cluster, &format!("before {family} {port}"));
        let after = |port: u16| counted(&cluster, &format!("after {family} {port}"));
        let counts = [before(OPEN), after(OPEN), before(TCP_ONLY), after(TCP_ONLY)];
        // Refused first, then one allowed: it arrives after the refused
        // would have (one path, in order), so waiting for it is enough.
        let (tcp_only, from_other, open) = (next_tag(), next_tag(), next_tag());
        web.send(db, &init(40_001, TCP_ONLY, tcp_only));
        other.send(db, &init(40_001, OPEN, from_other));
        web.send(db, &init(40_001, OPEN, open));
        let seen = server.received_until(open, Duration::from_secs(3));
        assert_eq!(
            seen,
            BTreeSet::from([(OPEN, open)]),
            "{family}: only web's INIT to the SCTP port arrives (tags: tcp-only port {tcp_only}, \
             other's {from_other}, open {open})"
        );
        // Nothing late either.
        let late = server.received_until(0, Duration::from_millis(500));
        assert!(late.is_empty(), "{family}: {late:?} arrived late");
        // The node saw all three leave and let one through.
        assert_eq!(
            [before(OPEN), after(OPEN), before(TCP_ONLY), after(TCP_ONLY)],
            [counts[0] + 2, counts[1] + 1, counts[2] + 1, counts[3]],
            "{family}: counters before/after the policy, open and tcp-only port: {:?}",
            counters(&cluster)
        );

        // TCP the other way round: the TCP port takes web, the SCTP one
        // no TCP.
        assert!(
            cluster.connects("web", "db", TCP_ONLY, v6),
            "{family}: TCP on the TCP port"
        );
        assert!(
            !cluster.connects("web", "db", OPEN, v6),
            "{family}: no TCP on the SCTP port"
        );
    }
    cluster.on_node(netpol::remove).expect("remove");
}
