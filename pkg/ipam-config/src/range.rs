//! Ranges and range sets with the reference plugin's defaults, checks and
//! messages, the round-robin walk over the addresses they hand out, and
//! which set a requested address goes to.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnetwork::IpNetwork;
use serde::Deserialize;

use crate::Error;

/// An address as a number, so ranges can be walked and compared; `v4`
/// keeps the family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Addr {
    pub v4: bool,
    pub n: u128,
}

impl Addr {
    pub fn new(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(a) => Addr {
                v4: true,
                n: u128::from(u32::from(a)),
            },
            IpAddr::V6(a) => Addr {
                v4: false,
                n: u128::from(a),
            },
        }
    }

    pub fn ip(self) -> IpAddr {
        if self.v4 {
            // n holds a u32 for v4 by construction.
            IpAddr::V4(Ipv4Addr::from(u32::try_from(self.n).unwrap_or(u32::MAX)))
        } else {
            IpAddr::V6(Ipv6Addr::from(self.n))
        }
    }

    fn max(v4: bool) -> u128 {
        if v4 { u128::from(u32::MAX) } else { u128::MAX }
    }

    /// The next address of the family, wrapping at the top.
    fn next(self) -> Self {
        let n = if self.n == Addr::max(self.v4) {
            0
        } else {
            self.n + 1
        };
        Addr { v4: self.v4, n }
    }
}

/// One range as configured and then completed: every field set, as the
/// reference's `Canonicalize` leaves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    /// The network, without host bits.
    pub subnet: IpNetwork,
    pub range_start: IpAddr,
    pub range_end: IpAddr,
    pub gateway: IpAddr,
}

/// containerd marshals Go zero values, so an unset address arrives as "".
fn empty_as_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<IpAddr>, D::Error> {
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(s) if s.is_empty() => Ok(None),
        Some(s) => s
            .parse::<IpAddr>()
            .map(|ip| Some(ip.to_canonical()))
            .map_err(serde::de::Error::custom),
    }
}

/// A range as written in the configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RangeConf {
    #[serde(default)]
    pub subnet: String,
    #[serde(default, deserialize_with = "empty_as_none")]
    pub range_start: Option<IpAddr>,
    #[serde(default, deserialize_with = "empty_as_none")]
    pub range_end: Option<IpAddr>,
    #[serde(default, deserialize_with = "empty_as_none")]
    pub gateway: Option<IpAddr>,
}

fn bits(v4: bool) -> u8 {
    if v4 { 32 } else { 128 }
}

impl Range {
    /// Completes and checks a configured range with the reference's
    /// defaults: gateway network+1, rangeStart network+1, rangeEnd the last
    /// address (minus the IPv4 broadcast).
    pub fn from_conf(conf: &RangeConf) -> Result<Self, String> {
        let parsed: IpNetwork = conf
            .subnet
            .parse()
            .map_err(|_| format!("invalid CIDR address: {}", conf.subnet))?;
        if !conf.subnet.contains('/') {
            return Err(format!("invalid CIDR address: {}", conf.subnet));
        }
        let ip = Addr::new(parsed.ip());
        let prefix = parsed.prefix();
        let network = Addr {
            v4: ip.v4,
            n: ip.n & mask(ip.v4, prefix),
        };
        if network != ip {
            return Err(format!(
                "Network has host bits set. For a subnet mask of length {prefix} the network address is {}",
                network.ip()
            ));
        }
        let subnet = IpNetwork::new(network.ip(), prefix).map_err(|e| e.to_string())?;
        if prefix > bits(ip.v4) - 2 {
            return Err(format!("Network {subnet} too small to allocate from"));
        }
        let mut range = Range {
            subnet,
            range_start: network.next().ip(),
            range_end: last_address(subnet).ip(),
            gateway: network.next().ip(),
        };
        if let Some(gw) = conf.gateway {
            let gw = gw.to_canonical();
            if !range.in_subnet(gw) {
                return Err(format!("gateway {gw} not in network {subnet}"));
            }
            range.gateway = gw;
        }
        // Each bound is checked against what is already settled, as the
        // reference does; so an end before the start is refused.
        let mut settled = Range {
            range_end: Addr {
                v4: ip.v4,
                n: Addr::max(ip.v4),
            }
            .ip(),
            ..range.clone()
        };
        if let Some(start) = conf.range_start {
            let start = start.to_canonical();
            settled.range_start = network.ip();
            settled.check_in_range(start)?;
            range.range_start = start;
        }
        settled.range_start = range.range_start;
        if let Some(end) = conf.range_end {
            let end = end.to_canonical();
            settled.check_in_range(end)?;
            range.range_end = end;
        }
        Ok(range)
    }

    pub fn is_v4(&self) -> bool {
        self.subnet.is_ipv4()
    }

    fn in_subnet(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.is_v4() && self.subnet.contains(ip)
    }

    /// The reference's `IPInRange`, with its messages.
    pub fn check_in_range(&self, ip: IpAddr) -> Result<(), String> {
        let ip = ip.to_canonical();
        if ip.is_ipv4() != self.is_v4() {
            return Err(format!(
                "IP {ip} is not the same protocol as subnet {}",
                self.subnet
            ));
        }
        if !self.subnet.contains(ip) {
            return Err(format!("{ip} not in network {}", self.subnet));
        }
        if Addr::new(ip) < Addr::new(self.range_start) {
            return Err(format!(
                "{ip} is in network {} but before start {}",
                self.subnet, self.range_start
            ));
        }
        if Addr::new(ip) > Addr::new(self.range_end) {
            return Err(format!(
                "{ip} is in network {} but after end {}",
                self.subnet, self.range_end
            ));
        }
        Ok(())
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.check_in_range(ip).is_ok()
    }

    /// Whether `ip` may be handed out: in range, and neither the gateway,
    /// the network address nor (IPv4) the broadcast address, even when a
    /// configured start or end would include them.
    pub fn allocatable(&self, ip: IpAddr) -> bool {
        let a = Addr::new(ip);
        self.contains(ip)
            && ip.to_canonical() != self.gateway
            && a != Addr::new(self.subnet.network())
            && !(self.is_v4() && a == Addr::new(self.subnet.broadcast()))
    }

    fn overlaps(&self, other: &Range) -> bool {
        self.is_v4() == other.is_v4()
            && (self.contains(other.range_start)
                || self.contains(other.range_end)
                || other.contains(self.range_start)
                || other.contains(self.range_end))
    }

    /// How many addresses this range can hand out.
    pub fn capacity(&self) -> u128 {
        let (start, end) = (Addr::new(self.range_start).n, Addr::new(self.range_end).n);
        let skipped = [
            Some(self.gateway),
            Some(self.subnet.network()),
            self.is_v4().then(|| self.subnet.broadcast()),
        ]
        .into_iter()
        .flatten()
        .filter(|ip| self.contains(*ip))
        .collect::<std::collections::BTreeSet<_>>()
        .len() as u128;
        (end - start + 1).saturating_sub(skipped)
    }
}

fn mask(v4: bool, prefix: u8) -> u128 {
    let width = u32::from(bits(v4));
    let host_bits = width - u32::from(prefix);
    let all = Addr::max(v4);
    if host_bits >= 128 {
        0
    } else {
        all & !((1u128 << host_bits) - 1)
    }
}

fn last_address(subnet: IpNetwork) -> Addr {
    let v4 = subnet.is_ipv4();
    let network = Addr::new(subnet.network());
    let last = Addr {
        v4,
        n: network.n | (Addr::max(v4) & !mask(v4, subnet.prefix())),
    };
    if v4 { Addr { v4, n: last.n - 1 } } else { last }
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.range_start, self.range_end)
    }
}

/// The ranges one address is taken from; all of one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeSet(pub Vec<Range>);

impl RangeSet {
    /// Completes and checks every range of a configured set.
    pub fn from_conf(confs: &[RangeConf]) -> Result<Self, String> {
        if confs.is_empty() {
            return Err("empty range set".into());
        }
        let ranges = confs
            .iter()
            .map(Range::from_conf)
            .collect::<Result<Vec<_>, _>>()?;
        if ranges.iter().any(|r| r.is_v4() != ranges[0].is_v4()) {
            return Err("mixed address families".into());
        }
        for (i, a) in ranges.iter().enumerate() {
            if let Some(b) = ranges[i + 1..].iter().find(|b| a.overlaps(b)) {
                return Err(format!("subnets {a} and {b} overlap"));
            }
        }
        Ok(RangeSet(ranges))
    }

    pub fn is_v4(&self) -> bool {
        self.0.first().is_some_and(Range::is_v4)
    }

    pub fn range_for(&self, ip: IpAddr) -> Option<&Range> {
        self.0.iter().find(|r| r.contains(ip))
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.range_for(ip).is_some()
    }

    pub fn overlaps(&self, other: &RangeSet) -> bool {
        self.0.iter().any(|a| other.0.iter().any(|b| a.overlaps(b)))
    }

    pub fn capacity(&self) -> u128 {
        self.0.iter().map(Range::capacity).sum()
    }

    /// Every allocatable address once, round-robin: starting after `last`
    /// when it lies in the set (so a crash-looping pod does not get its old
    /// address straight back), else at the first range's start; wrapping
    /// from each range's end to the next range's start.
    pub fn candidates(&self, last: Option<IpAddr>) -> Candidates<'_> {
        let start = last.and_then(|ip| {
            let index = self.0.iter().position(|r| r.contains(ip))?;
            Some((index, Addr::new(ip)))
        });
        let (range, cursor, skip_first) = match start {
            Some((index, addr)) => (index, addr, true),
            None => (0, Addr::new(self.0[0].range_start), false),
        };
        let first = (!skip_first).then_some(cursor);
        Candidates {
            set: self,
            range,
            cursor,
            first,
            skip_first,
            done: false,
        }
    }
}

impl fmt::Display for RangeSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&parts.join(","))
    }
}

/// See [`RangeSet::candidates`]. Yields `(address, range index)`.
#[derive(Debug)]
pub struct Candidates<'a> {
    set: &'a RangeSet,
    range: usize,
    cursor: Addr,
    first: Option<Addr>,
    skip_first: bool,
    done: bool,
}

impl Candidates<'_> {
    fn advance(&mut self) {
        let current = &self.set.0[self.range];
        if self.cursor == Addr::new(current.range_end) {
            self.range = (self.range + 1) % self.set.0.len();
            self.cursor = Addr::new(self.set.0[self.range].range_start);
        } else {
            self.cursor = self.cursor.next();
        }
    }
}

impl Iterator for Candidates<'_> {
    type Item = (IpAddr, usize);

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            if self.skip_first {
                // The walk starts after the hint and ends with the hint.
                self.skip_first = false;
                self.advance();
                self.first = Some(self.cursor);
            }
            let here = (self.cursor.ip(), self.range);
            self.advance();
            if Some(self.cursor) == self.first {
                self.done = true;
            }
            if self.set.0[here.1].allocatable(here.0) {
                return Some(here);
            }
        }
        None
    }
}

/// Which requested address each range set hands out, judged from the sets
/// alone, before any lease is looked at (as the reference judges them
/// before its store): each address goes to the first set that contains it
/// and has none yet. The gateway, a set's network or IPv4 broadcast
/// address, or an address no set takes is refused, with the reference's
/// message.
pub fn place_requested(sets: &[RangeSet], requested: &[IpAddr]) -> Result<Vec<Option<IpAddr>>, Error> {
    let mut left: Vec<IpAddr> = requested.to_vec();
    let mut placed = Vec::with_capacity(sets.len());
    for (index, set) in sets.iter().enumerate() {
        let wanted = left
            .iter()
            .position(|ip| set.contains(*ip))
            .map(|i| left.remove(i));
        if let Some(ip) = wanted
            && let Some(range) = set.range_for(ip)
        {
            let fail =
                |msg: String| Error::Unavailable(format!("failed to allocate for range {index}: {msg}"));
            if ip == range.gateway {
                return Err(fail(format!("requested ip {ip} is subnet's gateway")));
            }
            if !range.allocatable(ip) {
                return Err(fail(format!(
                    "requested IP address {ip} is not available in range set {set}"
                )));
            }
        }
        placed.push(wanted);
    }
    if !left.is_empty() {
        let ips: Vec<String> = left.iter().map(ToString::to_string).collect();
        return Err(Error::Unavailable(format!(
            "failed to allocate all requested IPs: {}",
            ips.join(" ")
        )));
    }
    Ok(placed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conf(subnet: &str) -> RangeConf {
        RangeConf {
            subnet: subnet.into(),
            ..RangeConf::default()
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn defaults_match_the_reference() {
        let r = Range::from_conf(&conf("10.1.0.0/16")).expect("valid");
        assert_eq!(
            (r.range_start, r.range_end, r.gateway),
            (ip("10.1.0.1"), ip("10.1.255.254"), ip("10.1.0.1"))
        );
        let r6 = Range::from_conf(&conf("fd00::/64")).expect("valid");
        assert_eq!(
            r6.range_end,
            ip("fd00::ffff:ffff:ffff:ffff"),
            "IPv6 ends at all-ones"
        );
        assert_eq!(r6.to_string(), "fd00::1-fd00::ffff:ffff:ffff:ffff");
    }

    #[test]
    fn invalid_ranges_carry_the_reference_messages() {
        let cases = [
            (
                conf("10.1.0.5/16"),
                "Network has host bits set. For a subnet mask of length 16 the network address is 10.1.0.0",
            ),
            (
                conf("10.1.0.0/31"),
                "Network 10.1.0.0/31 too small to allocate from",
            ),
            (
                conf("10.1.0.0/32"),
                "Network 10.1.0.0/32 too small to allocate from",
            ),
            (
                conf("fd00::/127"),
                "Network fd00::/127 too small to allocate from",
            ),
            (conf("10.1.0.0"), "invalid CIDR address: 10.1.0.0"),
            (
                RangeConf {
                    gateway: Some(ip("10.2.0.1")),
                    ..conf("10.1.0.0/16")
                },
                "gateway 10.2.0.1 not in network 10.1.0.0/16",
            ),
            (
                RangeConf {
                    range_start: Some(ip("10.2.0.1")),
                    ..conf("10.1.0.0/16")
                },
                "10.2.0.1 not in network 10.1.0.0/16",
            ),
            (
                RangeConf {
                    range_end: Some(ip("fd00::1")),
                    ..conf("10.1.0.0/16")
                },
                "IP fd00::1 is not the same protocol as subnet 10.1.0.0/16",
            ),
            (
                RangeConf {
                    range_start: Some(ip("10.1.0.50")),
                    range_end: Some(ip("10.1.0.10")),
                    ..conf("10.1.0.0/16")
                },
                "10.1.0.10 is in network 10.1.0.0/16 but before start 10.1.0.50",
            ),
        ];
        for (c, msg) in cases {
            assert_eq!(Range::from_conf(&c).expect_err(msg), msg);
        }
    }

    #[test]
    fn sets_refuse_mixed_families_and_overlaps() {
        assert_eq!(RangeSet::from_conf(&[]).expect_err("empty"), "empty range set");
        assert_eq!(
            RangeSet::from_conf(&[conf("10.1.0.0/24"), conf("fd00::/64")]).expect_err("mixed"),
            "mixed address families"
        );
        assert_eq!(
            RangeSet::from_conf(&[conf("10.1.0.0/16"), conf("10.1.2.0/24")]).expect_err("overlap"),
            "subnets 10.1.0.1-10.1.255.254 and 10.1.2.1-10.1.2.254 overlap"
        );
        let two = RangeSet::from_conf(&[conf("10.1.0.0/24"), conf("10.2.0.0/24")]).expect("valid");
        assert_eq!(two.to_string(), "10.1.0.1-10.1.0.254,10.2.0.1-10.2.0.254");
    }

    fn walk(set: &RangeSet, last: Option<&str>) -> Vec<String> {
        set.candidates(last.map(ip)).map(|(a, _)| a.to_string()).collect()
    }

    #[test]
    fn round_robin_starts_after_the_last_reservation_and_wraps() {
        let set = RangeSet::from_conf(&[conf("10.0.0.0/29")]).expect("valid");
        // .1 is the gateway, .0 and .7 network and broadcast.
        assert_eq!(
            walk(&set, None),
            ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
        );
        assert_eq!(
            walk(&set, Some("10.0.0.4")),
            ["10.0.0.5", "10.0.0.6", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
        );
        assert_eq!(
            walk(&set, Some("10.0.0.6")),
            ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"]
        );
        assert_eq!(
            walk(&set, Some("192.168.0.1")),
            walk(&set, None),
            "a hint outside the set is ignored"
        );
    }

    #[test]
    fn round_robin_crosses_ranges() {
        let set = RangeSet::from_conf(&[
            RangeConf {
                range_start: Some(ip("10.0.0.5")),
                range_end: Some(ip("10.0.0.6")),
                ..conf("10.0.0.0/24")
            },
            RangeConf {
                range_start: Some(ip("10.9.0.1")),
                range_end: Some(ip("10.9.0.3")),
                ..conf("10.9.0.0/24")
            },
        ])
        .expect("valid");
        // 10.9.0.1 is that range's gateway.
        assert_eq!(
            walk(&set, Some("10.0.0.6")),
            ["10.9.0.2", "10.9.0.3", "10.0.0.5", "10.0.0.6"]
        );
    }

    #[test]
    fn network_and_broadcast_are_never_candidates_even_if_configured() {
        let set = RangeSet::from_conf(&[RangeConf {
            range_start: Some(ip("10.0.0.0")),
            range_end: Some(ip("10.0.0.7")),
            gateway: Some(ip("10.0.0.6")),
            ..conf("10.0.0.0/29")
        }])
        .expect("valid");
        assert_eq!(
            walk(&set, None),
            ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
        );
        assert_eq!(set.capacity(), 5);
    }

    #[test]
    fn a_range_at_the_top_of_the_family_does_not_walk_out() {
        let set = RangeSet::from_conf(&[conf("255.255.255.248/29")]).expect("valid");
        assert_eq!(walk(&set, Some("255.255.255.254")).len(), 5);
        assert!(
            walk(&set, Some("255.255.255.254"))
                .iter()
                .all(|a| a.starts_with("255.255.255."))
        );
        let v6 = RangeSet::from_conf(&[conf("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff8/125")]).expect("valid");
        assert_eq!(
            walk(&v6, None).len(),
            6,
            "all-ones is usable in IPv6, the network address is not"
        );
    }

    #[test]
    fn capacity_counts_what_can_be_handed_out() {
        assert_eq!(
            RangeSet::from_conf(&[conf("10.0.0.0/16")])
                .expect("valid")
                .capacity(),
            65533
        );
        assert_eq!(
            RangeSet::from_conf(&[conf("10.0.0.0/30")])
                .expect("valid")
                .capacity(),
            1
        );
    }
}
