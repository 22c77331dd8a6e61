//! Reading one nf_tables chain in-process: each rule's handle, its comment
//! (nft keeps it in the rule's user data) and, for the shapes the
//! firewall plugin writes with iptables-nft, the rule as `iptables-save`
//! prints it. `iptables-save` costs a process and reads every chain of the
//! table (kube-proxy's included); a dump of one chain is one netlink round
//! trip.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use firewall::nfnl::{self, TableFamily};
use firewall::{Error, Result};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_NEWRULE: u16 = 6;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFT_META_IIFNAME: u32 = 6;
const NFT_META_OIFNAME: u32 = 7;
const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;
const NFT_JUMP: i32 = -3;
const NFT_RETURN: i32 = -5;
/// nftnl's user-data type for a rule comment.
const UDATA_COMMENT: u8 = 0;
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
    Meta { key: u32 },
    Cmp { op: u32, data: Vec<u8> },
    Match { name: String, info: Vec<u8> },
    Counter,
    Verdict { code: i32, chain: Option<String> },
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

fn be32(value: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(value.get(..4)?.try_into().ok()?))
}

fn text(value: &[u8]) -> String {
    let end = value.iter().position(|b| *b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end]).into_owned()
}

fn nested(value: &[u8]) -> Vec<(u16, &[u8])> {
    nfnl::attributes_from(value, 0)
}

fn get<'a>(attrs: &[(u16, &'a [u8])], kind: u16) -> Option<&'a [u8]> {
    attrs.iter().find(|(k, _)| *k == kind).map(|(_, v)| *v)
}

fn expression(elem: &[u8]) -> Expr {
    let attrs = nested(elem);
    let name = get(&attrs, NFTA_EXPR_NAME).map(text).unwrap_or_default();
    let data = get(&attrs, NFTA_EXPR_DATA).map(nested).unwrap_or_default();
    let u32_of = |kind| get(&data, kind).and_then(be32);
    let parsed = match name.as_str() {
        "payload" => (|| {
            Some(Expr::Payload {
                base: u32_of(2)?,
                offset: u32_of(3)?,
                len: u32_of(4)?,
            })
        })(),
        "meta" => u32_of(2).map(|key| Expr::Meta { key }),
        "cmp" => (|| {
            let value = nested(get(&data, 3)?);
            Some(Expr::Cmp {
                op: u32_of(2)?,
                data: get(&value, NFTA_DATA_VALUE)?.to_vec(),
            })
        })(),
        "match" => Some(Expr::Match {
            name: get(&data, 1).map(text).unwrap_or_default(),
            info: get(&data, 3).unwrap_or_default().to_vec(),
        }),
        "counter" => Some(Expr::Counter),
        "immediate" => (|| {
            let value = nested(get(&data, 2)?);
            let verdict = nested(get(&value, NFTA_DATA_VERDICT)?);
            let code = i32::from_be_bytes(get(&verdict, NFTA_VERDICT_CODE)?.get(..4)?.try_into().ok()?);
            Some(Expr::Verdict {
                code,
                chain: get(&verdict, NFTA_VERDICT_CHAIN).map(text),
            })
        })(),
        _ => None,
    };
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

fn bang(op: u32) -> Option<&'static str> {
    match op {
        NFT_CMP_EQ => Some(""),
        NFT_CMP_NEQ => Some("! "),
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
                    NFT_META_IIFNAME => iif = Some(format!("{}-i {name}", bang(*op)?)),
                    NFT_META_OIFNAME => oif = Some(format!("{}-o {name}", bang(*op)?)),
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
                    (NFT_RETURN, _) => "RETURN".to_owned(),
                    (NFT_JUMP, Some(chain)) => chain.clone(),
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

/// The comment in a rule's user data (nftnl's TLV list), if any.
fn comment_of(userdata: &[u8]) -> Option<String> {
    let mut at = 0;
    while at + 2 <= userdata.len() {
        let (kind, len) = (userdata[at], userdata[at + 1] as usize);
        let value = userdata.get(at + 2..at + 2 + len)?;
        if kind == UDATA_COMMENT {
            return Some(text(value));
        }
        at += 2 + len;
    }
    None
}

fn rule_of(attrs: &[(u16, &[u8])]) -> Rule {
    let exprs: Vec<Expr> = get(attrs, NFTA_RULE_EXPRESSIONS)
        .map(nested)
        .unwrap_or_default()
        .iter()
        .filter(|(kind, _)| *kind == NFTA_LIST_ELEM)
        .map(|(_, elem)| expression(elem))
        .collect();
    Rule {
        handle: get(attrs, NFTA_RULE_HANDLE)
            .and_then(|v| Some(u64::from_be_bytes(v.get(..8)?.try_into().ok()?)))
            .unwrap_or_default(),
        comment: get(attrs, NFTA_RULE_USERDATA).and_then(comment_of),
        spec: spec_of(&exprs),
    }
}

fn push_text(buf: &mut Vec<u8>, kind: u16, value: &str) {
    let len = 4 + value.len() + 1;
    buf.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(value.as_bytes());
    buf.push(0);
    buf.resize(buf.len() + ((len + 3) & !3) - len, 0);
}

/// The rules of `chain` in order, or `None` when the chain (or its table)
/// does not exist. Asked in the calling thread's network namespace.
pub fn dump(family: TableFamily, table: &str, chain: &str) -> Result<Option<Vec<Rule>>> {
    // A dump of a missing chain is an empty dump, not an error.
    if !nfnl::chain_exists(family, table, chain)? {
        return Ok(None);
    }
    let mut attrs = Vec::new();
    push_text(&mut attrs, NFTA_RULE_TABLE, table);
    push_text(&mut attrs, NFTA_RULE_CHAIN, chain);
    let message = nfnl::subsystem_request(
        NFNL_SUBSYS_NFTABLES,
        NFT_MSG_GETRULE,
        nfnl::NLM_F_DUMP,
        family as u8,
        &attrs,
    );
    let mut rules = Vec::new();
    let outcome = nfnl::converse("rule listing", &message, |kind, payload| {
        if kind != NFT_MSG_NEWRULE {
            return;
        }
        let attrs = nfnl::attributes_from(payload, 4);
        // Older kernels ignore the chain filter of a dump.
        if get(&attrs, NFTA_RULE_CHAIN).map(text).as_deref() == Some(chain) {
            rules.push(rule_of(&attrs));
        }
    })?;
    match outcome {
        Ok(()) => Ok(Some(rules)),
        Err(nfnl::ENOENT) => Ok(None),
        Err(errno) => Err(Error::Invalid(format!(
            "nf_tables rule listing {table}/{chain}: {}",
            std::io::Error::from_raw_os_error(errno)
        ))),
    }
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

    fn cmp(op: u32, data: &[u8]) -> Expr {
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

    fn verdict(code: i32, chain: Option<&str>) -> Expr {
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
            cmp(NFT_CMP_EQ, &[10, 1, 2, 3]),
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
            cmp(NFT_CMP_EQ, &v6),
            Expr::Counter,
            verdict(NF_ACCEPT, None),
        ];
        assert_eq!(spec_of(&src).as_deref(), Some("-s fd00::5/128 -j ACCEPT"));
        let isolation = [
            Expr::Meta {
                key: NFT_META_IIFNAME,
            },
            cmp(NFT_CMP_EQ, b"br0\0"),
            Expr::Meta {
                key: NFT_META_OIFNAME,
            },
            cmp(NFT_CMP_NEQ, b"br0\0"),
            comment("x y"),
            Expr::Counter,
            verdict(NFT_JUMP, Some("CNI-ISOLATION-STAGE-2")),
        ];
        assert_eq!(
            spec_of(&isolation).as_deref(),
            Some(r#"-i br0 ! -o br0 -m comment --comment "x y" -j CNI-ISOLATION-STAGE-2"#)
        );
        let wildcard = [
            Expr::Meta {
                key: NFT_META_OIFNAME,
            },
            cmp(NFT_CMP_EQ, b"br"),
            verdict(NF_DROP, None),
        ];
        assert_eq!(spec_of(&wildcard).as_deref(), Some("-o br+ -j DROP"));
        assert_eq!(
            spec_of(&[comment("r"), verdict(NFT_RETURN, None)]).as_deref(),
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
        assert_eq!(spec_of(&[payload(16, 4), cmp(NFT_CMP_EQ, &[10, 0])]), None);
    }

    #[test]
    fn comments_come_out_of_user_data() {
        let mut userdata = vec![UDATA_COMMENT, 6];
        userdata.extend_from_slice(b"hello\0");
        assert_eq!(comment_of(&userdata).as_deref(), Some("hello"));
        assert_eq!(comment_of(&[1, 1, 0]), None);
    }
}
