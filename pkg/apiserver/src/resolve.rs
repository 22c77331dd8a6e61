//! Host name resolution without NSS: IP literals, then `/etc/hosts`, then
//! plain DNS to the servers in `/etc/resolv.conf` (with its search
//! domains): over UDP from a socket connected to the server asked (the
//! kernel drops datagrams from anyone else), with a random query id, and
//! over TCP when the answer was truncated. A static glibc binary cannot
//! load NSS modules, so `getaddrinfo` is never used.

use std::hash::{BuildHasher, Hasher};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use crate::deadline::{is_timeout, left};
use crate::error::{Error, Result};

const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
const TYPE_A: u16 = 1;
const TYPE_AAAA: u16 = 28;

/// The addresses of `host`, each with `port`, found before `deadline`.
pub fn resolve(host: &str, port: u16, deadline: Instant) -> Result<Vec<SocketAddr>> {
    let hosts = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
    let resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    resolve_with(host, port, &hosts, &resolv, deadline)
}

pub fn resolve_with(
    host: &str,
    port: u16,
    hosts: &str,
    resolv: &str,
    deadline: Instant,
) -> Result<Vec<SocketAddr>> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let from_hosts = lookup_hosts(hosts, host);
    if !from_hosts.is_empty() {
        return Ok(from_hosts
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect());
    }
    let config = ResolvConf::parse(resolv);
    for name in config.candidates(host) {
        for server in &config.nameservers {
            let server = SocketAddr::new(*server, 53);
            let mut found = Vec::new();
            for qtype in [TYPE_A, TYPE_AAAA] {
                match query(server, &name, qtype, deadline) {
                    Ok(ips) => found.extend(ips),
                    Err(Error::Timeout) => return Err(Error::Timeout),
                    Err(_) => {}
                }
            }
            if !found.is_empty() {
                return Ok(found.into_iter().map(|ip| SocketAddr::new(ip, port)).collect());
            }
        }
    }
    Err(Error::Resolve(host.to_owned()))
}

/// Addresses `/etc/hosts` gives `name` (case-insensitive, aliases too).
pub fn lookup_hosts(hosts: &str, name: &str) -> Vec<IpAddr> {
    hosts
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let ip: IpAddr = fields.next()?.parse().ok()?;
            fields.any(|alias| alias.eq_ignore_ascii_case(name)).then_some(ip)
        })
        .collect()
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct ResolvConf {
    pub nameservers: Vec<IpAddr>,
    pub search: Vec<String>,
    pub ndots: usize,
}

impl ResolvConf {
    pub fn parse(text: &str) -> Self {
        let mut conf = ResolvConf {
            ndots: 1,
            ..ResolvConf::default()
        };
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            match fields.as_slice() {
                ["nameserver", ip, ..] => conf.nameservers.extend(ip.parse::<IpAddr>().ok()),
                ["search", domains @ ..] | ["domain", domains @ ..] => {
                    conf.search = domains.iter().map(|d| (*d).to_owned()).collect();
                }
                ["options", options @ ..] => {
                    for option in options {
                        if let Some(n) = option.strip_prefix("ndots:").and_then(|n| n.parse().ok()) {
                            conf.ndots = n;
                        }
                    }
                }
                _ => {}
            }
        }
        if conf.nameservers.is_empty() {
            conf.nameservers.push(IpAddr::from([127, 0, 0, 1]));
        }
        conf
    }

    /// Names to ask for, in resolver order.
    pub fn candidates(&self, host: &str) -> Vec<String> {
        let host = host.trim_end_matches('.');
        let searched: Vec<String> = self.search.iter().map(|d| format!("{host}.{d}")).collect();
        if host.matches('.').count() >= self.ndots {
            std::iter::once(host.to_owned()).chain(searched).collect()
        } else {
            searched
                .into_iter()
                .chain(std::iter::once(host.to_owned()))
                .collect()
        }
    }
}

pub(crate) fn build_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut packet = Vec::with_capacity(name.len() + 18);
    packet.extend_from_slice(&id.to_be_bytes());
    packet.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.').filter(|l| !l.is_empty()) {
        packet.push(u8::try_from(label.len()).unwrap_or(63).min(63));
        packet.extend_from_slice(&label.as_bytes()[..label.len().min(63)]);
    }
    packet.push(0);
    packet.extend_from_slice(&qtype.to_be_bytes());
    packet.extend_from_slice(&1u16.to_be_bytes());
    packet
}

/// Skips a (possibly compressed) name, returning the offset after it.
fn skip_name(packet: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let len = *packet.get(at)?;
        if len & 0xc0 == 0xc0 {
            return Some(at + 2);
        }
        if len == 0 {
            return Some(at + 1);
        }
        at += 1 + usize::from(len);
    }
}

/// The addresses of a well-formed answer to query `id`, or `None`.
pub(crate) fn parse_answer(packet: &[u8], id: u16, qtype: u16) -> Option<Vec<IpAddr>> {
    let word = |at: usize| Some(u16::from_be_bytes([*packet.get(at)?, *packet.get(at + 1)?]));
    if word(0)? != id || packet.get(2)? & 0x80 == 0 || packet.get(3)? & 0x0f != 0 {
        return None;
    }
    let (questions, answers) = (word(4)?, word(6)?);
    let mut at = 12;
    for _ in 0..questions {
        at = skip_name(packet, at)? + 4;
    }
    let mut found = Vec::new();
    for _ in 0..answers {
        at = skip_name(packet, at)?;
        let (rtype, length) = (word(at)?, usize::from(word(at + 8)?));
        let data = packet.get(at + 10..at + 10 + length)?;
        match (rtype, length) {
            (TYPE_A, 4) if qtype == TYPE_A => found.push(IpAddr::from(<[u8; 4]>::try_from(data).ok()?)),
            (TYPE_AAAA, 16) if qtype == TYPE_AAAA => {
                found.push(IpAddr::from(<[u8; 16]>::try_from(data).ok()?))
            }
            _ => {}
        }
        at += 10 + length;
    }
    Some(found)
}

/// The error code of an answer to query `id` that is an error (NXDOMAIN,
/// SERVFAIL, REFUSED, …): the next name or server is asked at once.
fn refused(packet: &[u8], id: u16) -> Option<u8> {
    let code = *packet.get(3)? & 0x0f;
    (packet.len() >= 12 && packet[..2] == id.to_be_bytes() && packet[2] & 0x80 != 0 && code != 0)
        .then_some(code)
}

/// Whether an answer to query `id` was cut to fit a datagram (TC).
fn truncated(packet: &[u8], id: u16) -> bool {
    packet.len() >= 4 && packet[..2] == id.to_be_bytes() && packet[2] & 0x02 != 0
}

/// A query id nobody off the path can guess (the hasher's keys come from
/// the operating system's random source).
fn random_id() -> u16 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    (hasher.finish() & 0xffff) as u16
}

fn query(server: SocketAddr, name: &str, qtype: u16, deadline: Instant) -> Result<Vec<IpAddr>> {
    let io = |e: std::io::Error| Error::Resolve(format!("{name} via {server}: {e}"));
    let local: SocketAddr = if server.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        ([0u16; 8], 0).into()
    };
    let socket = UdpSocket::bind(local).map_err(io)?;
    socket.connect(server).map_err(io)?;
    let id = random_id();
    let packet = build_query(id, name, qtype);
    socket.send(&packet).map_err(io)?;
    let mut buffer = [0u8; 1500];
    // A datagram that answers something else (a late answer to an earlier
    // query, a forgery) is skipped.
    loop {
        socket
            .set_read_timeout(Some(left(deadline)?.min(QUERY_TIMEOUT)))
            .map_err(io)?;
        let len = match socket.recv(&mut buffer) {
            Ok(len) => len,
            Err(e) if is_timeout(&e) => {
                left(deadline)?;
                return Err(io(e));
            }
            Err(e) => return Err(io(e)),
        };
        if let Some(code) = refused(&buffer[..len], id) {
            return Err(Error::Resolve(format!("{name} via {server}: answer code {code}")));
        }
        if truncated(&buffer[..len], id) {
            return query_tcp(server, &packet, id, qtype, deadline).map_err(|e| match e {
                Error::Timeout => Error::Timeout,
                other => Error::Resolve(format!("{name} via {server} over TCP: {other}")),
            });
        }
        if let Some(found) = parse_answer(&buffer[..len], id, qtype) {
            return Ok(found);
        }
    }
}

/// The same query over TCP: each message after its two-byte length.
fn query_tcp(
    server: SocketAddr,
    packet: &[u8],
    id: u16,
    qtype: u16,
    deadline: Instant,
) -> Result<Vec<IpAddr>> {
    // Only the deadline's end is a timeout for the caller; TCP/53 that is
    // blocked or slow is this server failing.
    let io = |e: std::io::Error| {
        if is_timeout(&e) && left(deadline).is_err() {
            Error::Timeout
        } else {
            Error::Connection(e.to_string())
        }
    };
    let mut stream = TcpStream::connect_timeout(&server, left(deadline)?.min(QUERY_TIMEOUT)).map_err(io)?;
    let length = u16::try_from(packet.len()).map_err(|_| Error::Protocol("query too long".into()))?;
    stream.set_write_timeout(Some(left(deadline)?)).map_err(io)?;
    stream.write_all(&length.to_be_bytes()).map_err(io)?;
    stream.write_all(packet).map_err(io)?;
    let mut read = |buf: &mut [u8]| -> Result<()> {
        stream.set_read_timeout(Some(left(deadline)?)).map_err(io)?;
        stream.read_exact(buf).map_err(io)
    };
    let mut length = [0u8; 2];
    read(&mut length)?;
    let mut answer = vec![0u8; usize::from(u16::from_be_bytes(length))];
    read(&mut answer)?;
    parse_answer(&answer, id, qtype).ok_or_else(|| Error::Protocol("bad answer over TCP".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_and_hosts() {
        assert_eq!(
            resolve_with("10.96.0.1", 443, "", "", soon()).expect("ip"),
            [SocketAddr::from(([10, 96, 0, 1], 443))]
        );
        assert_eq!(
            resolve_with("[::1]", 6443, "", "", soon()).expect("ip")[0].port(),
            6443
        );
        let hosts = "127.0.0.1 localhost\n# 10.0.0.9 commented\n10.0.0.7 api.example api # alias\n";
        assert_eq!(lookup_hosts(hosts, "API"), [IpAddr::from([10, 0, 0, 7])]);
        assert!(lookup_hosts(hosts, "commented").is_empty());
        assert_eq!(
            resolve_with("localhost", 1, hosts, "", soon()).expect("hosts")[0].ip(),
            IpAddr::from([127, 0, 0, 1])
        );
    }

    #[test]
    fn resolv_conf_and_search_order() {
        let c = ResolvConf::parse("nameserver 10.96.0.10\nsearch default.svc svc\noptions ndots:5 edns0\n");
        assert_eq!(c.nameservers, [IpAddr::from([10, 96, 0, 10])]);
        assert_eq!(c.ndots, 5);
        assert_eq!(
            c.candidates("kubernetes"),
            ["kubernetes.default.svc", "kubernetes.svc", "kubernetes"]
        );
        let plain = ResolvConf::parse("");
        assert_eq!(plain.candidates("api.example.com"), ["api.example.com"]);
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    /// An answer to `query` giving one address of its type.
    fn answer_to(query: &[u8]) -> Vec<u8> {
        let len = query.len();
        let qtype = u16::from_be_bytes([query[len - 4], query[len - 3]]);
        let mut answer = query.to_vec();
        answer[2] |= 0x80;
        answer[6..8].copy_from_slice(&1u16.to_be_bytes());
        answer.extend_from_slice(&[0xc0, 12]);
        answer.extend_from_slice(&qtype.to_be_bytes());
        answer.extend_from_slice(&[0, 1, 0, 0, 0, 60]);
        if qtype == TYPE_A {
            answer.extend_from_slice(&[0, 4, 10, 1, 2, 3]);
        } else {
            answer.extend_from_slice(&[0, 16]);
            answer.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        }
        answer
    }

    #[test]
    fn dns_over_udp_against_a_local_responder() {
        let server = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let address = server.local_addr().expect("addr");
        let responder = std::thread::spawn(move || {
            let mut ids = Vec::new();
            for _ in 0..2 {
                let mut buf = [0u8; 512];
                let (len, peer) = server.recv_from(&mut buf).expect("query");
                ids.push([buf[0], buf[1]]);
                // A forged answer first (another id), then the real one.
                let mut forged = answer_to(&buf[..len]);
                forged[0] ^= 0xff;
                let last = forged.len() - 1;
                forged[last] = 66;
                server.send_to(&forged, peer).expect("forged");
                server.send_to(&answer_to(&buf[..len]), peer).expect("answer");
            }
            ids
        });
        let v4 = query(address, "api.test", TYPE_A, soon()).expect("A");
        let v6 = query(address, "api.test", TYPE_AAAA, soon()).expect("AAAA");
        let ids = responder.join().expect("responder");
        assert_eq!(v4, [IpAddr::from([10, 1, 2, 3])]);
        assert_eq!(v6, ["fd00::1".parse::<IpAddr>().expect("ip")]);
        assert_ne!(ids[0], ids[1], "query ids are not derived from the pid");
    }

    #[test]
    fn a_truncated_answer_is_asked_again_over_tcp() {
        let udp = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let address = udp.local_addr().expect("addr");
        let tcp = std::net::TcpListener::bind(address).expect("tcp on the same port");
        let responder = std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            let (len, peer) = udp.recv_from(&mut buf).expect("query");
            let mut cut = buf[..len].to_vec();
            cut[2] |= 0x82;
            udp.send_to(&cut, peer).expect("truncated");
            let (mut stream, _) = tcp.accept().expect("tcp query");
            let mut length = [0u8; 2];
            stream.read_exact(&mut length).expect("length");
            let mut query = vec![0u8; usize::from(u16::from_be_bytes(length))];
            stream.read_exact(&mut query).expect("query");
            let answer = answer_to(&query);
            let length = u16::try_from(answer.len()).expect("short");
            stream.write_all(&length.to_be_bytes()).expect("write");
            stream.write_all(&answer).expect("write");
        });
        let found = query(address, "api.test", TYPE_A, soon()).expect("over TCP");
        responder.join().expect("responder");
        assert_eq!(found, [IpAddr::from([10, 1, 2, 3])]);
    }

    #[test]
    fn an_error_answer_moves_on_at_once() {
        let server = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let address = server.local_addr().expect("addr");
        let responder = std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            let (len, peer) = server.recv_from(&mut buf).expect("query");
            let mut nxdomain = buf[..len].to_vec();
            nxdomain[2] |= 0x80;
            nxdomain[3] = (nxdomain[3] & 0xf0) | 3;
            server.send_to(&nxdomain, peer).expect("answer");
        });
        let started = Instant::now();
        let err = query(address, "nope.test", TYPE_A, soon()).expect_err("NXDOMAIN");
        responder.join().expect("responder");
        assert!(
            matches!(&err, Error::Resolve(text) if text.contains("answer code 3")),
            "{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_server_that_never_answers_costs_no_more_than_the_deadline() {
        let silent = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let address = silent.local_addr().expect("addr");
        let started = Instant::now();
        let err =
            query(address, "api.test", TYPE_A, started + Duration::from_millis(300)).expect_err("silent");
        assert!(matches!(err, Error::Timeout), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
}
