//! Masquerade with nftables, as the reference's nftables backend lays it
//! out: table `inet cni_plugins_masquerade`, a `postrouting` nat chain that
//! skips multicast and jumps to `masq_checks`, and one rule per address in
//! `masq_checks`, commented with a hash of (network) and of (ifname,
//! container) so DEL and GC find them without knowing the addresses.
//!
//! Every change is one `nft -f -` transaction. ADD only adds (deleting in
//! nf_tables costs far more than adding), so the base chains are written
//! only when they are missing.

use std::collections::BTreeSet;

use ipnetwork::IpNetwork;
use serde_json::Value;
use sha2::{Digest, Sha512};

use crate::{Error, Result, exec};

pub const TABLE: &str = "cni_plugins_masquerade";
const CHECKS: &str = "masq_checks";
/// nftables keeps comments up to this length.
const COMMENT_MAX: usize = 128;

fn hash16(text: &str) -> String {
    Sha512::digest(text.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `<16 hex of sha512(network)>`: the prefix of a network's comments.
pub fn network_hash(network: &str) -> String {
    hash16(network)
}

/// `<network hash>-<16 hex of sha512(ifname:containerID)>`.
pub fn instance_hash(network: &str, ifname: &str, container_id: &str) -> String {
    format!(
        "{}-{}",
        network_hash(network),
        hash16(&format!("{ifname}:{container_id}"))
    )
}

/// The rule comment: the instance hash, then a readable (possibly cut)
/// description.
pub fn comment(network: &str, ifname: &str, container_id: &str) -> String {
    let strip = |s: &str| s.replace('"', "");
    let mut text = format!(
        "{}, net: {}, if: {}, id: {}",
        instance_hash(network, ifname, container_id),
        strip(network),
        strip(ifname),
        strip(container_id)
    );
    if text.len() > COMMENT_MAX {
        let mut cut = COMMENT_MAX;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// A rule of `masq_checks` as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub handle: u64,
    pub comment: String,
    pub saddr: Option<String>,
}

/// What the table holds now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Masquerade {
    pub table_exists: bool,
    pub postrouting_rules: usize,
    pub checks: Vec<Rule>,
}

impl Masquerade {
    /// Reads `nft -j list table inet cni_plugins_masquerade` output.
    pub fn parse(json: &str) -> Result<Self> {
        let doc: Value =
            serde_json::from_str(json).map_err(|e| Error::Invalid(format!("nft -j output: {e}")))?;
        let mut state = Masquerade::default();
        for item in doc["nftables"].as_array().into_iter().flatten() {
            if item.get("table").is_some() {
                state.table_exists = true;
            }
            let Some(rule) = item.get("rule") else { continue };
            match rule["chain"].as_str() {
                Some("postrouting") => state.postrouting_rules += 1,
                Some(CHECKS) => state.checks.push(Rule {
                    handle: rule["handle"].as_u64().unwrap_or_default(),
                    comment: rule["comment"].as_str().unwrap_or_default().to_owned(),
                    saddr: saddr_of(rule),
                }),
                _ => {}
            }
        }
        Ok(state)
    }

    fn with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a Rule> + 'a {
        self.checks.iter().filter(move |r| r.comment.starts_with(prefix))
    }
}

fn saddr_of(rule: &Value) -> Option<String> {
    rule["expr"].as_array()?.iter().find_map(|e| {
        let m = e.get("match")?;
        (m["left"]["payload"]["field"] == "saddr").then(|| m["right"].as_str().map(str::to_owned))?
    })
}

/// The current state; a missing table is an empty state.
pub fn read() -> Result<Masquerade> {
    match exec::run("nft", &["-j", "list", "table", "inet", TABLE], "") {
        Ok(json) => Masquerade::parse(&json),
        Err(Error::Command { reason, .. }) if reason.contains("No such file or directory") => {
            Ok(Masquerade::default())
        }
        Err(e) => Err(e),
    }
}

fn quote(text: &str) -> String {
    format!("\"{}\"", text.replace('"', ""))
}

/// The transaction that gives `addresses` masquerade: base table and chains
/// when missing, stale rules of this instance replaced, one rule per address.
pub fn render_setup(
    state: &Masquerade,
    network: &str,
    ifname: &str,
    container_id: &str,
    addresses: &[IpNetwork],
) -> String {
    let t = format!("inet {TABLE}");
    let mut out = String::new();
    if !state.table_exists || state.postrouting_rules == 0 {
        out.push_str(&format!(
            "add table {t} {{ comment \"Masquerading for plugins from github.com/containernetworking/plugins\" ; }}\n\
             add chain {t} {CHECKS} {{ comment \"Masquerade traffic from certain IPs to any (non-multicast) IP outside their subnet\" ; }}\n\
             add chain {t} postrouting {{ type nat hook postrouting priority srcnat ; }}\n\
             flush chain {t} postrouting\n\
             add rule {t} postrouting ip daddr == 224.0.0.0/4 return\n\
             add rule {t} postrouting ip6 daddr == ff00::/8 return\n\
             add rule {t} postrouting goto {CHECKS}\n"
        ));
    }
    for stale in state.with_prefix(&instance_hash(network, ifname, container_id)) {
        out.push_str(&format!("delete rule {t} {CHECKS} handle {}\n", stale.handle));
    }
    let comment = quote(&comment(network, ifname, container_id));
    for address in addresses {
        let family = if address.is_ipv4() { "ip" } else { "ip6" };
        out.push_str(&format!(
            "add rule {t} {CHECKS} {family} saddr == {} {family} daddr != {}/{} masquerade comment {comment}\n",
            address.ip(),
            address.network(),
            address.prefix()
        ));
    }
    out
}

/// Deletes the rules whose comment starts with `prefix`, except those kept.
fn render_delete(state: &Masquerade, keep: impl Fn(&Rule) -> bool, prefix: &str) -> Option<String> {
    let lines: Vec<String> = state
        .with_prefix(prefix)
        .filter(|r| !keep(r))
        .map(|r| format!("delete rule inet {TABLE} {CHECKS} handle {}\n", r.handle))
        .collect();
    (!lines.is_empty()).then(|| lines.concat())
}

fn apply(transaction: &str) -> Result<()> {
    exec::run("nft", &["-f", "-"], transaction).map(drop)
}

pub fn setup(network: &str, ifname: &str, container_id: &str, addresses: &[IpNetwork]) -> Result<()> {
    let state = read()?;
    apply(&render_setup(&state, network, ifname, container_id, addresses))
}

/// Removes an instance's rules (a machine without nft has none). Returns
/// whether anything was removed.
pub fn teardown(network: &str, ifname: &str, container_id: &str) -> Result<bool> {
    if exec::find("nft").is_none() {
        return Ok(false);
    }
    let state = read()?;
    match render_delete(&state, |_| false, &instance_hash(network, ifname, container_id)) {
        Some(transaction) => apply(&transaction).map(|()| true),
        None => Ok(false),
    }
}

/// Removes the rules of `network` whose (ifname, container) is not kept.
pub fn collect_garbage(network: &str, keep: &BTreeSet<(String, String)>) -> Result<()> {
    if exec::find("nft").is_none() {
        return Ok(());
    }
    let state = read()?;
    let kept: BTreeSet<String> = keep
        .iter()
        .map(|(ifname, id)| instance_hash(network, ifname, id))
        .collect();
    let keep_rule = |r: &Rule| kept.iter().any(|h| r.comment.starts_with(h.as_str()));
    match render_delete(&state, keep_rule, &network_hash(network)) {
        Some(transaction) => apply(&transaction),
        None => Ok(()),
    }
}

/// What CHECK finds missing: an address without its rule.
pub fn missing(
    network: &str,
    ifname: &str,
    container_id: &str,
    addresses: &[IpNetwork],
) -> Result<Vec<String>> {
    let state = read()?;
    let instance = instance_hash(network, ifname, container_id);
    let present: BTreeSet<String> = state
        .with_prefix(&instance)
        .filter_map(|r| r.saddr.clone())
        .collect();
    Ok(addresses
        .iter()
        .map(|a| a.ip().to_string())
        .filter(|ip| !present.contains(ip))
        .map(|ip| format!("nft masquerade rule for {ip}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_hashes_match_the_reference_layout() {
        let c = comment("cni-bridge", "eth0", "ctr1");
        let (hash, rest) = c.split_once(", ").expect("hash first");
        assert_eq!(hash.len(), 33);
        assert_eq!(hash, instance_hash("cni-bridge", "eth0", "ctr1"));
        assert!(hash.starts_with(&network_hash("cni-bridge")));
        assert_eq!(rest, "net: cni-bridge, if: eth0, id: ctr1");
        let long = comment("n", "eth0", &"x".repeat(200));
        assert_eq!(long.len(), 128);
        let out = std::process::Command::new("sh")
            .args(["-c", "printf %s cni-bridge | sha512sum | cut -c1-16"])
            .output()
            .expect("sha512sum");
        assert_eq!(
            network_hash("cni-bridge"),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }

    #[test]
    fn setup_creates_base_chains_only_when_missing() {
        let addrs: Vec<IpNetwork> = vec![
            "10.0.0.5/24".parse().expect("cidr"),
            "fd00::5/64".parse().expect("cidr"),
        ];
        let fresh = render_setup(&Masquerade::default(), "net", "eth0", "c1", &addrs);
        assert!(fresh.contains("add chain inet cni_plugins_masquerade postrouting { type nat hook postrouting priority srcnat ; }"));
        assert!(fresh.contains("ip saddr == 10.0.0.5 ip daddr != 10.0.0.0/24 masquerade comment"));
        assert!(fresh.contains("ip6 saddr == fd00::5 ip6 daddr != fd00::/64 masquerade comment"));
        let ready = Masquerade {
            table_exists: true,
            postrouting_rules: 3,
            checks: vec![],
        };
        let again = render_setup(&ready, "net", "eth0", "c1", &addrs);
        assert!(
            !again.contains("flush"),
            "an ADD on a ready table deletes nothing"
        );
        assert_eq!(again.lines().count(), 2);
    }

    const LISTED: &str = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
      {"table": {"family": "inet", "name": "cni_plugins_masquerade", "handle": 1}},
      {"chain": {"family": "inet", "table": "cni_plugins_masquerade", "name": "postrouting", "handle": 2}},
      {"rule": {"family": "inet", "table": "cni_plugins_masquerade", "chain": "postrouting", "handle": 4, "expr": []}},
      {"rule": {"family": "inet", "table": "cni_plugins_masquerade", "chain": "masq_checks", "handle": 7,
        "comment": "HASH-A, net: n", "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": "10.0.0.5"}}]}},
      {"rule": {"family": "inet", "table": "cni_plugins_masquerade", "chain": "masq_checks", "handle": 8,
        "comment": "HASH-B, net: n", "expr": []}}]}"#;

    #[test]
    fn listing_and_deletion_by_comment_prefix() {
        let state = Masquerade::parse(LISTED).expect("parses");
        assert!(state.table_exists);
        assert_eq!(state.postrouting_rules, 1);
        assert_eq!(state.checks[0].saddr.as_deref(), Some("10.0.0.5"));
        assert_eq!(
            render_delete(&state, |_| false, "HASH-A").as_deref(),
            Some("delete rule inet cni_plugins_masquerade masq_checks handle 7\n")
        );
        assert_eq!(
            render_delete(&state, |r| r.handle == 8, "HASH"),
            Some("delete rule inet cni_plugins_masquerade masq_checks handle 7\n".into())
        );
        assert_eq!(render_delete(&state, |_| false, "NONE"), None);
    }
}
