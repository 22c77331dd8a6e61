//! The anchor's design, measured on this kernel: kindnetd's NetworkPolicy
//! (kube-network-policies) sends the first packet of each new connection
//! of a selected pod to a userspace queue and waits for its verdict. The
//! bench puts `iptables -j NFQUEUE` on a real node for one pod's new
//! connections and runs this reader there, which accepts every packet at
//! once: what is left is the cost of the round trip itself, with no
//! policy evaluated at all.
//!
//! `cluster-bench --nfqueue-reader QUEUE` (on a cluster's node) and
//! `cni-bench --nfqueue-reader QUEUE` (in the policy-path phase's node
//! namespace): binds QUEUE over `nfnetlink_queue` (metadata only), prints
//! `bound`, accepts every packet until its stdin closes (the bench
//! stopping it, or gone), then prints `seen N`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::socket::{
    self as sock, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

/// The `iptables` FORWARD rule, after its verb, that sends a connection's
/// first packet (conntrack `NEW`) matching `matches` to `queue`, as
/// kube-network-policies does: the rest of the connection bypasses it.
pub fn forward_rule(matches: &[&str], queue: &str) -> Vec<String> {
    let tail = [
        "-m",
        "conntrack",
        "--ctstate",
        "NEW",
        "-j",
        "NFQUEUE",
        "--queue-num",
        queue,
    ];
    std::iter::once("FORWARD")
        .chain(matches.iter().copied())
        .chain(tail)
        .map(str::to_owned)
        .collect()
}

/// `NFNL_SUBSYS_QUEUE`, the message type's high byte.
const SUBSYS_QUEUE: u16 = 3;
const MSG_PACKET: u16 = 0;
const MSG_VERDICT: u16 = 1;
const MSG_CONFIG: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;
/// `NFQA_CFG_CMD`, `NFQA_CFG_PARAMS`.
const CFG_CMD: u16 = 1;
const CFG_PARAMS: u16 = 2;
const CMD_BIND: u8 = 1;
const COPY_META: u8 = 1;
/// `NFQA_PACKET_HDR` in a packet, `NFQA_VERDICT_HDR` in a verdict.
const PACKET_HDR: u16 = 1;
const VERDICT_HDR: u16 = 2;
const NF_ACCEPT: u32 = 1;

/// One netlink message: header, `nfgenmsg` for `queue`, attributes.
fn message(kind: u16, flags: u16, queue: u16, attributes: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut body = vec![libc::AF_UNSPEC as u8, 0];
    body.extend_from_slice(&queue.to_be_bytes());
    for (kind, payload) in attributes {
        let length = 4 + payload.len();
        body.extend_from_slice(&(length as u16).to_ne_bytes());
        body.extend_from_slice(&kind.to_ne_bytes());
        body.extend_from_slice(payload);
        body.resize(body.len().next_multiple_of(4), 0);
    }
    let mut out = Vec::with_capacity(16 + body.len());
    out.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    out.extend_from_slice(&((SUBSYS_QUEUE << 8) | kind).to_ne_bytes());
    out.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend(body);
    out
}

/// Sends a configuration message and reads the kernel's acknowledgement.
fn configure(fd: &OwnedFd, queue: u16, attribute: (u16, Vec<u8>)) -> Result<(), String> {
    let request = message(MSG_CONFIG, NLM_F_ACK, queue, &[attribute]);
    sock::send(fd.as_raw_fd(), &request, MsgFlags::empty()).map_err(|e| format!("nfqueue config: {e}"))?;
    let mut answer = [0u8; 256];
    let read = sock::recv(fd.as_raw_fd(), &mut answer, MsgFlags::empty())
        .map_err(|e| format!("nfqueue ack: {e}"))?;
    let kind = u16::from_ne_bytes([answer[4], answer[5]]);
    let error = i32::from_ne_bytes([answer[16], answer[17], answer[18], answer[19]]);
    if read < 20 || kind != NLMSG_ERROR || error != 0 {
        return Err(format!(
            "nfqueue config refused: {}",
            std::io::Error::from_raw_os_error(-error)
        ));
    }
    Ok(())
}

/// The packet ids in one datagram of queued packets.
fn packet_ids(datagram: &[u8]) -> Vec<u32> {
    let mut ids = Vec::new();
    let mut at = 0;
    while at + 20 <= datagram.len() {
        let length = u32::from_ne_bytes(datagram[at..at + 4].try_into().unwrap_or_default()) as usize;
        let kind = u16::from_ne_bytes([datagram[at + 4], datagram[at + 5]]);
        if length < 20 || at + length > datagram.len() {
            break;
        }
        if kind == (SUBSYS_QUEUE << 8) | MSG_PACKET {
            // Attributes after the 16-byte header and the 4-byte nfgenmsg.
            let mut attribute = at + 20;
            while attribute + 4 <= at + length {
                let size = u16::from_ne_bytes([datagram[attribute], datagram[attribute + 1]]) as usize;
                let kind = u16::from_ne_bytes([datagram[attribute + 2], datagram[attribute + 3]]) & 0x7fff;
                if size < 4 {
                    break;
                }
                if kind == PACKET_HDR && size >= 8 {
                    let id = &datagram[attribute + 4..attribute + 8];
                    ids.push(u32::from_be_bytes(id.try_into().unwrap_or_default()));
                }
                attribute += size.next_multiple_of(4);
            }
        }
        at += length.next_multiple_of(4);
    }
    ids
}

/// The reader: every packet of `queue` accepted as soon as it is read.
pub fn reader(queue: u16) -> Result<(), String> {
    use std::io::Write;
    let fd = sock::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkNetFilter,
    )
    .map_err(|e| format!("netfilter netlink socket: {e}"))?;
    sock::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(|e| format!("bind: {e}"))?;
    configure(&fd, queue, (CFG_CMD, vec![CMD_BIND, 0, 0, 0]))?;
    let mut params = 0u32.to_be_bytes().to_vec();
    params.push(COPY_META);
    configure(&fd, queue, (CFG_PARAMS, params))?;
    // Stops when the bench closes stdin; the socket wakes every 200 ms
    // to look.
    let timeout = nix::sys::time::TimeVal::new(0, 200_000);
    sock::setsockopt(&fd, sock::sockopt::ReceiveTimeout, &timeout).map_err(|e| e.to_string())?;
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = stop.clone();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        stopping.store(true, Ordering::Relaxed);
    });
    let mut out = std::io::stdout().lock();
    writeln!(out, "bound")
        .and_then(|()| out.flush())
        .map_err(|e| e.to_string())?;
    let mut seen = 0usize;
    let mut datagram = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        let read = match sock::recv(fd.as_raw_fd(), &mut datagram, MsgFlags::empty()) {
            Ok(read) => read,
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(format!("nfqueue recv: {e}")),
        };
        for id in packet_ids(&datagram[..read]) {
            let mut verdict = NF_ACCEPT.to_be_bytes().to_vec();
            verdict.extend_from_slice(&id.to_be_bytes());
            let answer = message(MSG_VERDICT, 0, queue, &[(VERDICT_HDR, verdict)]);
            sock::send(fd.as_raw_fd(), &answer, MsgFlags::empty())
                .map_err(|e| format!("nfqueue verdict: {e}"))?;
            seen += 1;
        }
    }
    writeln!(out, "seen {seen}").map_err(|e| e.to_string())
}
