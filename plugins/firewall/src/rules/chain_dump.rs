//! Reading one nf_tables chain in-process: each rule's handle, its comment
//! (nft keeps it in the rule's user data) and, for the shapes the
//! firewall plugin writes with iptables-nft, the rule as `iptables-save`
//! prints it. `iptables-save` costs a process and reads every chain of the
//! table (kube-proxy's included); a dump of one chain is one netlink round
//! trip.
//!
//! The dump and its rules, expressions, registers, verdicts and compare
//! data are `netlink-packet-netfilter`'s types (through
//! [`firewall::nfnl::rules`]). Read by hand here, because nf_tables itself
//! keeps them opaque and so does the crate: an x_tables match's name and
//! info (iptables-nft's `match` expression, `NFTA_MATCH_NAME` and
//! `NFTA_MATCH_INFO`), that is the comment match's text and the conntrack
//! match's flags in `xt_conntrack_mtinfo` (x_tables' structs, not netlink
//! attributes).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use firewall::Result;
use firewall::nfnl::{self, TableFamily};
use netlink_packet_core::Nla;
use netlink_packet_netfilter::nftables::{
    Cmp, DataAttribute, ExpressionAttribute, Expressions, Immediate, ListAttribute, Meta, MetaKey, Operator,
    Payload, RuleAttribute, RuleMessage, Verdict, VerdictAttribute,
};

const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
/// nf_tables' verdicts for the netfilter ones, which the crate leaves
/// unnamed.
const NF_DROP: Verdict = Verdict::Other(0);
const NF_ACCEPT: Verdict = Verdict::Other(1);
/// The attributes of an x_tables `match` expression the crate keeps
/// opaque.
const NFTA_MATCH_NAME: u16 = 1;
const NFTA_MATCH_INFO: u16 = 3;
/// xt_conntrack_mtinfo: `match_flags`, `invert_flags` and `state_mask`
/// (host order) follow eight addresses, two timeouts, a protocol and four
/// ports.
const CONNTRACK_FLAGS_AT: usize = 146;
const XT_CONNTRACK_STATE: u16 = 1;
/// `1 << (IP_CT_ESTABLISHED + 1) | 1 << (IP_CT_RELATED + 1)`.
const STATE_RELATED_ESTABLISHED: u16 = 0b110;

/// One expression of a rule, as far as the plugin's shapes need it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expr {
    Payload { base: u32, offset: u32, len: u32 },
    Meta { key: MetaKey },
    Cmp { op: Operator, data: Vec<u8> },
    Match { name: String, info: Vec<u8> },
    Counter,
    Verdict { code: Verdict, chain: Option<String> },
    Other,
}

/// One rule of a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub handle: u64,
    /// nft's comment (user data); iptables-nft keeps its comments in the
    /// rule's `comment` match instead, which [`Rule::spec`] shows.
    pub comment: Option<String>,
    /// The rule as `iptables-save` prints it after `-A <chain> `, when it
    /// has a shape iptables-nft writes for the plugin's rules.
    pub spec: Option<String>,
}

fn text(value: &[u8]) -> String {
    let end = value.iter().position(|b| *b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end]).into_owned()
}

fn read_payload(attributes: &[Payload]) -> Option<Expr> {
    let (mut base, mut offset, mut len) = (None, None, None);
    for attribute in attributes {
        match attribute {
            Payload::Base(value) => base = Some(*value),
            Payload::Offset(value) => offset = Some(*value),
            Payload::Len(value) => len = Some(*value),
            _ => {}
        }
    }
    Some(Expr::Payload {
        base: base?,
        offset: offset?,
        len: len?,
    })
}

fn read_meta(attributes: &[Meta]) -> Option<Expr> {
    attributes.iter().find_map(|a| match a {
        Meta::Key(key) => Some(Expr::Meta { key: *key }),
        _ => None,
    })
}

fn read_cmp(attributes: &[Cmp]) -> Option<Expr> {
    let op = attributes.iter().find_map(|a| match a {
        Cmp::Op(op) => Some(*op),
        _ => None,
    })?;
    let data = attributes.iter().find_map(|a| match a {
        Cmp::Data(DataAttribute::Value(data)) => Some(data.clone()),
        _ => None,
    })?;
    Some(Expr::Cmp { op, data })
}

fn read_verdict(attributes: &[Immediate]) -> Option<Expr> {
    let verdict = attributes.iter().find_map(|a| match a {
        Immediate::Data(DataAttribute::Verdict(verdict)) => Some(verdict),
        _ => None,
    })?;
    let code = verdict.iter().find_map(|a| match a {
        VerdictAttribute::Code(code) => Some(*code),
        _ => None,
    })?;
    let chain = verdict.iter().find_map(|a| match a {
        VerdictAttribute::Chain(chain) => Some(chain.clone()),
        _ => None,
    });
    Some(Expr::Verdict { code, chain })
}

/// An expression the crate knows only by name: an x_tables match, a
/// counter.
fn read_named(name: &str, attributes: &[impl Nla]) -> Option<Expr> {
    let value = |kind| attributes.iter().find(|a| a.kind() == kind).map(nfnl::value_of);
    match name {
        "match" => Some(Expr::Match {
            name: value(NFTA_MATCH_NAME).as_deref().map(text).unwrap_or_default(),
            info: value(NFTA_MATCH_INFO).unwrap_or_default(),
        }),
        "counter" => Some(Expr::Counter),
        _ => None,
    }
}

fn expression(element: &[ExpressionAttribute]) -> Expr {
    let parsed = element.iter().find_map(|a| match a {
        ExpressionAttribute::Data(data) => match data {
            Expressions::Payload(attributes) => read_payload(attributes),
            Expressions::Meta(attributes) => read_meta(attributes),
            Expressions::Cmp(attributes) => read_cmp(attributes),
            Expressions::Immediate(attributes) => read_verdict(attributes),
            Expressions::Other {
                expression_type,
                attributes,
            } => read_named(expression_type, attributes),
            _ => None,
        },
        _ => None,
    });
    parsed.unwrap_or(Expr::Other)
}

fn address(data: &[u8]) -> Option<IpAddr> {
    match data.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(data).ok()?))),
        16 => Some(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(data).ok()?))),
        _ => None,
    }
}

/// An interface name as iptables writes it: the name and its NUL, or
/// (`br+`) only the prefix.
fn interface(data: &[u8]) -> String {
    match data.iter().position(|b| *b == 0) {
        Some(end) => String::from_utf8_lossy(&data[..end]).into_owned(),
        None => format!("{}+", String::from_utf8_lossy(data)),
    }
}

fn bang(op: Operator) -> Option<&'static str> {
    match op {
        Operator::Equal => Some(""),
        Operator::NotEqual => Some("! "),
        _ => None,
    }
}

/// The `iptables-save` text of a rule made of `exprs`, if it is one of
/// the shapes the plugin writes: address and interface matches, comment
/// and conntrack-state matches, and an ACCEPT, DROP, RETURN or jump.
fn spec_of(exprs: &[Expr]) -> Option<String> {
    let (mut src, mut dst, mut iif, mut oif) = (None, None, None, None);
    let mut matches = Vec::new();
    let mut target = None;
    let mut at = 0;
    while at < exprs.len() {
        match (&exprs[at], exprs.get(at + 1)) {
            (Expr::Payload { base, offset, len }, Some(Expr::Cmp { op, data }))
                if *base == NFT_PAYLOAD_NETWORK_HEADER && *len as usize == data.len() =>
            {
                let ip = address(data)?;
                let host = if ip.is_ipv4() { 32 } else { 128 };
                let text = format!("{}{{}} {ip}/{host}", bang(*op)?);
                match (ip.is_ipv4(), offset) {
                    (true, 12) | (false, 8) => src = Some(text.replace("{}", "-s")),
                    (true, 16) | (false, 24) => dst = Some(text.replace("{}", "-d")),
                    _ => return None,
                }
                at += 2;
            }
            (Expr::Meta { key }, Some(Expr::Cmp { op, data })) => {
                let name = interface(data);
                match *key {
                    MetaKey::Iifname => iif = Some(format!("{}-i {name}", bang(*op)?)),
                    MetaKey::Oifname => oif = Some(format!("{}-o {name}", bang(*op)?)),
                    _ => return None,
                }
                at += 2;
            }
            (Expr::Match { name, info }, _) if name == "comment" => {
                matches.push(format!(
                    "-m comment --comment {}",
                    firewall::iptables::quote(&text(info))
                ));
                at += 1;
            }
            (Expr::Match { name, info }, _) if name == "conntrack" => {
                let field = |n: usize| {
                    info.get(CONNTRACK_FLAGS_AT + 2 * n..CONNTRACK_FLAGS_AT + 2 * n + 2)
                        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
                };
                let (flags, invert, state) = (field(0)?, field(1)?, field(2)?);
                if flags != XT_CONNTRACK_STATE || invert != 0 || state != STATE_RELATED_ESTABLISHED {
                    return None;
                }
                matches.push("-m conntrack --ctstate RELATED,ESTABLISHED".to_owned());
                at += 1;
            }
            (Expr::Counter, _) => at += 1,
            (Expr::Verdict { code, chain }, None) => {
                target = Some(match (*code, chain) {
                    (NF_ACCEPT, _) => "ACCEPT".to_owned(),
                    (NF_DROP, _) => "DROP".to_owned(),
                    (Verdict::Return, _) => "RETURN".to_owned(),
                    (Verdict::Jump, Some(chain)) => chain.clone(),
                    _ => return None,
                });
                at += 1;
            }
            _ => return None,
        }
    }
    let parts: Vec<String> = [src, dst, iif, oif]
        .into_iter()
        .flatten()
        .chain(matches)
        .chain(target.map(|t| format!("-j {t}")))
        .collect();
    Some(parts.join(" "))
}

fn rule_of(rule: &RuleMessage) -> Rule {
    let exprs: Vec<Expr> = rule
        .attributes
        .iter()
        .filter_map(|a| match a {
            RuleAttribute::Expressions(list) => Some(list),
            _ => None,
        })
        .flatten()
        .filter_map(|element| match element {
            ListAttribute::Element(attributes) => Some(expression(attributes)),
            _ => None,
        })
        .collect();
    let handle = rule.attributes.iter().find_map(|a| match a {
        RuleAttribute::Handle(handle) => Some(*handle),
        _ => None,
    });
    Rule {
        handle: handle.unwrap_or_default(),
        comment: nfnl::rule_comment(rule),
        spec: spec_of(&exprs),
    }
}

/// The rules of `chain` in order, or `None` when the chain (or its table)
/// does not exist. Asked in the calling thread's network namespace.
pub fn dump(family: TableFamily, table: &str, chain: &str) -> Result<Option<Vec<Rule>>> {
    // A dump of a missing chain is an empty dump, not an error.
    if !nfnl::chain_exists(family, table, chain)? {
        return Ok(None);
    }
    Ok(nfnl::rules(family, table, chain)?.map(|rules| rules.iter().map(rule_of).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(offset: u32, len: u32) -> Expr {
        Expr::Payload {
            base: NFT_PAYLOAD_NETWORK_HEADER,
            offset,
            len,
        }
    }

    fn cmp(op: Operator, data: &[u8]) -> Expr {
        Expr::Cmp {
            op,
            data: data.to_vec(),
        }
    }

    fn comment(text: &str) -> Expr {
        let mut info = text.as_bytes().to_vec();
        info.resize(256, 0);
        Expr::Match {
            name: "comment".into(),
            info,
        }
    }

    fn verdict(code: Verdict, chain: Option<&str>) -> Expr {
        Expr::Verdict {
            code,
            chain: chain.map(str::to_owned),
        }
    }

    #[test]
    fn the_plugins_shapes_read_as_iptables_save_prints_them() {
        let mut conntrack = vec![0u8; 160];
        conntrack[CONNTRACK_FLAGS_AT..CONNTRACK_FLAGS_AT + 2].copy_from_slice(&1u16.to_ne_bytes());
        conntrack[CONNTRACK_FLAGS_AT + 4..CONNTRACK_FLAGS_AT + 6].copy_from_slice(&6u16.to_ne_bytes());
        let dst = [
            payload(16, 4),
            cmp(Operator::Equal, &[10, 1, 2, 3]),
            Expr::Match {
                name: "conntrack".into(),
                info: conntrack.clone(),
            },
            Expr::Counter,
            verdict(NF_ACCEPT, None),
        ];
        assert_eq!(
            spec_of(&dst).as_deref(),
            Some("-d 10.1.2.3/32 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT")
        );
        let mut v6 = [0u8; 16];
        v6[0] = 0xfd;
        v6[15] = 5;
        let src = [
            payload(8, 16),
            cmp(Operator::Equal, &v6),
            Expr::Counter,
            verdict(NF_ACCEPT, None),
        ];
        assert_eq!(spec_of(&src).as_deref(), Some("-s fd00::5/128 -j ACCEPT"));
        let isolation = [
            Expr::Meta {
                key: MetaKey::Iifname,
            },
            cmp(Operator::Equal, b"br0\0"),
            Expr::Meta {
                key: MetaKey::Oifname,
            },
            cmp(Operator::NotEqual, b"br0\0"),
            comment("x y"),
            Expr::Counter,
            verdict(Verdict::Jump, Some("CNI-ISOLATION-STAGE-2")),
        ];
        assert_eq!(
            spec_of(&isolation).as_deref(),
            Some(r#"-i br0 ! -o br0 -m comment --comment "x y" -j CNI-ISOLATION-STAGE-2"#)
        );
        let wildcard = [
            Expr::Meta {
                key: MetaKey::Oifname,
            },
            cmp(Operator::Equal, b"br"),
            verdict(NF_DROP, None),
        ];
        assert_eq!(spec_of(&wildcard).as_deref(), Some("-o br+ -j DROP"));
        assert_eq!(
            spec_of(&[comment("r"), verdict(Verdict::Return, None)]).as_deref(),
            Some(r#"-m comment --comment "r" -j RETURN"#)
        );
        // Other conntrack states, other matches and other targets are
        // somebody else's rules.
        conntrack[CONNTRACK_FLAGS_AT + 4] = 2;
        let other_state = [
            Expr::Match {
                name: "conntrack".into(),
                info: conntrack,
            },
            verdict(NF_ACCEPT, None),
        ];
        assert_eq!(spec_of(&other_state), None);
        assert_eq!(spec_of(&[Expr::Other, verdict(NF_ACCEPT, None)]), None);
        assert_eq!(spec_of(&[payload(16, 4), cmp(Operator::Equal, &[10, 0])]), None);
    }
}
