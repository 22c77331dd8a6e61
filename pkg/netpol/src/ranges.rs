//! Address intervals of one family: what an nftables interval set holds.
//! A CIDR less its exceptions is a few intervals; a set's elements are
//! kept disjoint, as the kernel refuses overlapping ones, but neighbours
//! stay apart: host-local hands out consecutive addresses, and a pod
//! coming or going must be one element added or deleted, not a range
//! rewritten.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnetwork::IpNetwork;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    fn bits(self) -> u32 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }

    fn address(self, value: u128) -> IpAddr {
        match self {
            // A V4 interval's values are below 2^32 by construction.
            Family::V4 => IpAddr::V4(Ipv4Addr::from(u32::try_from(value).unwrap_or(u32::MAX))),
            Family::V6 => IpAddr::V6(Ipv6Addr::from(value)),
        }
    }
}

fn value(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// First and last address, inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Interval {
    pub family: Family,
    pub first: u128,
    pub last: u128,
}

impl Interval {
    pub fn address(ip: IpAddr) -> Interval {
        let v = value(ip);
        Interval {
            family: Family::of(ip),
            first: v,
            last: v,
        }
    }

    pub fn network(net: IpNetwork) -> Interval {
        let family = Family::of(net.ip());
        let host_bits = family.bits() - u32::from(net.prefix());
        let mask = if host_bits >= 128 {
            u128::MAX
        } else {
            (1u128 << host_bits) - 1
        };
        let first = value(net.ip()) & !mask;
        Interval {
            family,
            first,
            last: first | mask,
        }
    }

    /// Parses nftables' listing of an element: an address, `addr/len`, or
    /// `first-last`.
    pub fn parse(text: &str) -> Option<Interval> {
        if let Some((first, last)) = text.split_once('-') {
            let (first, last): (IpAddr, IpAddr) = (first.parse().ok()?, last.parse().ok()?);
            let family = Family::of(first);
            return (family == Family::of(last) && value(first) <= value(last)).then_some(Interval {
                family,
                first: value(first),
                last: value(last),
            });
        }
        if text.contains('/') {
            return text.parse().ok().map(Interval::network);
        }
        text.parse().ok().map(Interval::address)
    }
}

impl fmt::Display for Interval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let first = self.family.address(self.first);
        if self.first == self.last {
            write!(f, "{first}")
        } else {
            write!(f, "{first}-{}", self.family.address(self.last))
        }
    }
}

/// `intervals` sorted, overlapping ones merged (neighbours kept apart).
pub fn merge(mut intervals: Vec<Interval>) -> Vec<Interval> {
    intervals.sort();
    let mut merged: Vec<Interval> = Vec::with_capacity(intervals.len());
    for next in intervals {
        match merged.last_mut() {
            Some(last) if last.family == next.family && next.first <= last.last => {
                last.last = last.last.max(next.last);
            }
            _ => merged.push(next),
        }
    }
    merged
}

/// `cidr` without `except` (exceptions of the other family or outside it
/// take nothing away).
pub fn block(cidr: IpNetwork, except: &[IpNetwork]) -> Vec<Interval> {
    let mut kept = vec![Interval::network(cidr)];
    for cut in merge(except.iter().map(|e| Interval::network(*e)).collect()) {
        kept = kept.into_iter().flat_map(|piece| subtract(piece, cut)).collect();
    }
    kept
}

fn subtract(piece: Interval, cut: Interval) -> Vec<Interval> {
    if piece.family != cut.family || cut.last < piece.first || cut.first > piece.last {
        return vec![piece];
    }
    let mut left = Vec::new();
    if cut.first > piece.first {
        left.push(Interval {
            last: cut.first - 1,
            ..piece
        });
    }
    if cut.last < piece.last {
        left.push(Interval {
            first: cut.last + 1,
            ..piece
        });
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(intervals: &[Interval]) -> Vec<String> {
        intervals.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_block_less_its_exceptions_is_the_intervals_around_them() {
        let cidr = "10.0.0.0/16".parse().expect("test data parses");
        let except = [
            "10.0.1.0/24".parse().expect("test data parses"),
            "10.0.255.255/32".parse().expect("test data parses"),
        ];
        assert_eq!(
            shown(&block(cidr, &except)),
            ["10.0.0.0-10.0.0.255", "10.0.2.0-10.0.255.254"]
        );
    }

    #[test]
    fn an_exception_covering_the_block_leaves_nothing_and_one_of_the_other_family_nothing_out() {
        let cidr: IpNetwork = "10.1.0.0/24".parse().expect("test data parses");
        assert!(block(cidr, &["10.0.0.0/8".parse().expect("test data parses")]).is_empty());
        assert_eq!(
            shown(&block(cidr, &["fd00::/8".parse().expect("test data parses")])),
            ["10.1.0.0-10.1.0.255"]
        );
    }

    #[test]
    fn whole_spaces_and_host_bits_of_a_cidr() {
        assert_eq!(
            shown(&[Interval::network("0.0.0.0/0".parse().expect("test data parses"))]),
            ["0.0.0.0-255.255.255.255"]
        );
        assert_eq!(
            shown(&[Interval::network("::/0".parse().expect("test data parses"))]),
            ["::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"]
        );
        // Host bits set in the CIDR are the network's, as Kubernetes reads it.
        assert_eq!(
            shown(&[Interval::network(
                "10.0.0.7/30".parse().expect("test data parses")
            )]),
            ["10.0.0.4-10.0.0.7"]
        );
    }

    #[test]
    fn merging_joins_overlaps_but_neither_neighbours_nor_families() {
        let a = |t: &str| Interval::parse(t).expect("present");
        let merged = merge(vec![
            a("10.0.0.5"),
            a("10.0.0.0/30"),
            a("10.0.0.2-10.0.0.4"),
            a("::4"),
            a("0.0.0.4"),
        ]);
        assert_eq!(
            shown(&merged),
            ["0.0.0.4", "10.0.0.0-10.0.0.4", "10.0.0.5", "::4"]
        );
    }

    #[test]
    fn nft_listings_parse_back() {
        for text in ["10.0.0.1", "10.0.0.0-10.0.0.9", "fd00::1-fd00::ff"] {
            assert_eq!(Interval::parse(text).expect("present").to_string(), text);
        }
        assert_eq!(
            Interval::parse("10.0.0.0/24").expect("present").to_string(),
            "10.0.0.0-10.0.0.255"
        );
        assert!(Interval::parse("10.0.0.9-10.0.0.1").is_none());
        assert!(Interval::parse("10.0.0.1-::2").is_none());
    }
}
