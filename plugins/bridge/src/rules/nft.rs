//! Masquerade with nftables, in the reference's nftables table
//! `inet cni_plugins_masquerade` (a `postrouting` nat chain that skips
//! multicast and jumps to `masq_checks`), per network subnet: the first
//! pod of a subnet creates chain `net-<20 hex of sha512(network:subnet)>`
//! holding `daddr != <subnet> masquerade`, and a `masq_checks` rule
//! `saddr <subnet> jump` to it; later pods only find the chain, in-process.
//! DEL changes nothing (nf_tables deletions wait for the kernel); GC
//! removes a network's chains once none of its attachments is valid.
//!
//! The reference writes one `masq_checks` rule per pod address, commented
//! with a hash of (network) and of (ifname, container). Those rules are
//! still found and removed by DEL and GC.
//!
//! Every change is one `nft -f -` transaction.

use std::collections::BTreeSet;

use firewall::iptables::network_of;
use firewall::nfnl::{self, TableFamily};
use firewall::nft::{fit_comment, instance_hash, network_hash};
use firewall::{Error, Family, Result, exec};
use ipnetwork::IpNetwork;
use serde_json::Value;
use sha2::{Digest, Sha512};

use super::backend::MasqueradeBackend;

pub const TABLE: &str = "cni_plugins_masquerade";
const CHECKS: &str = "masq_checks";

/// The rule comment: the instance hash, then a readable (possibly cut)
/// description.
pub fn comment(network: &str, ifname: &str, container_id: &str) -> String {
    let strip = |s: &str| s.replace('"', "");
    let text = format!(
        "{}, net: {}, if: {}, id: {}",
        instance_hash(network, ifname, container_id),
        strip(network),
        strip(ifname),
        strip(container_id)
    );
    fit_comment(text)
}

/// `net-<20 hex of sha512(network:subnet)>`: the chain of one subnet.
pub fn network_chain(network: &str, subnet: &IpNetwork) -> String {
    let digest = Sha512::digest(format!("{network}:{}", network_of(subnet)).as_bytes());
    let hex: String = digest.iter().take(10).map(|b| format!("{b:02x}")).collect();
    format!("net-{hex}")
}

/// `<network hash>-net, net: <network>, subnet: <subnet>`; the `-net`
/// tells it from a pod's `<network hash>-<instance hash>`.
pub fn network_comment(network: &str, subnet: &IpNetwork) -> String {
    fit_comment(format!(
        "{}-net, net: {}, subnet: {}",
        network_hash(network),
        network.replace('"', ""),
        network_of(subnet)
    ))
}

fn is_network_comment(comment: &str) -> bool {
    comment
        .split(", ")
        .next()
        .is_some_and(|key| key.ends_with("-net"))
}

/// A rule as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub chain: String,
    pub handle: u64,
    pub comment: String,
    pub saddr: Option<String>,
}

/// What the table holds now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Masquerade {
    pub table_exists: bool,
    pub postrouting_rules: usize,
    pub chains: BTreeSet<String>,
    /// Rules of every chain but `postrouting`.
    pub rules: Vec<Rule>,
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
            if let Some(name) = item["chain"]["name"].as_str() {
                state.chains.insert(name.to_owned());
            }
            let Some(rule) = item.get("rule") else { continue };
            match rule["chain"].as_str() {
                Some("postrouting") => state.postrouting_rules += 1,
                Some(chain) => state.rules.push(Rule {
                    chain: chain.to_owned(),
                    handle: rule["handle"].as_u64().unwrap_or_default(),
                    comment: rule["comment"].as_str().unwrap_or_default().to_owned(),
                    saddr: saddr_of(rule),
                }),
                None => {}
            }
        }
        Ok(state)
    }

    /// `masq_checks` rules whose comment starts with `prefix`.
    fn with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a Rule> + 'a {
        self.rules
            .iter()
            .filter(move |r| r.chain == CHECKS && r.comment.starts_with(prefix))
    }

    fn base_ready(&self) -> bool {
        self.table_exists && self.postrouting_rules > 0 && self.chains.contains(CHECKS)
    }
}

fn saddr_of(rule: &Value) -> Option<String> {
    rule["expr"].as_array()?.iter().find_map(|e| {
        let m = e.get("match")?;
        (m["left"]["payload"]["field"] == "saddr").then(|| m["right"].as_str().map(str::to_owned))?
    })
}

/// The current state; a missing table is an empty state (nft's listing
/// fails then, and the kernel says whether that is why).
pub fn read() -> Result<Masquerade> {
    match exec::run("nft", &["-j", "list", "table", "inet", TABLE], "") {
        Ok(json) => Masquerade::parse(&json),
        // nft's listing fails without the table: the kernel says whether
        // that is why, else nft's own error stands.
        Err(e @ Error::Failed { .. }) => match nfnl::table_exists(TableFamily::Inet, TABLE) {
            Ok(false) => Ok(Masquerade::default()),
            _ => Err(e),
        },
        Err(e) => Err(e),
    }
}

fn quote(text: &str) -> String {
    format!("\"{}\"", text.replace('"', ""))
}

fn render_base(state: &Masquerade) -> String {
    let t = format!("inet {TABLE}");
    if state.base_ready() {
        return String::new();
    }
    format!(
        "add table {t} {{ comment \"Masquerading for plugins from github.com/containernetworking/plugins\" ; }}\n\
         add chain {t} {CHECKS} {{ comment \"Masquerade traffic from certain IPs to any (non-multicast) IP outside their subnet\" ; }}\n\
         add chain {t} postrouting {{ type nat hook postrouting priority srcnat ; }}\n\
         flush chain {t} postrouting\n\
         add rule {t} postrouting ip daddr == 224.0.0.0/4 return\n\
         add rule {t} postrouting ip6 daddr == ff00::/8 return\n\
         add rule {t} postrouting goto {CHECKS}\n"
    )
}

/// The transaction that writes a subnet's chain whole (the base table and
/// chains when missing) and, `with_jump`, the jump to it from the checks
/// chain (left out when it is there: callers hold the node's lock, so none
/// is doubled).
pub fn render_network_setup(
    state: &Masquerade,
    network: &str,
    subnet: &IpNetwork,
    with_jump: bool,
) -> String {
    let t = format!("inet {TABLE}");
    let chain = network_chain(network, subnet);
    let comment = quote(&network_comment(network, subnet));
    let family = if subnet.is_ipv4() { "ip" } else { "ip6" };
    let subnet = network_of(subnet);
    let jump = if with_jump {
        format!("add rule {t} {CHECKS} {family} saddr {subnet} jump {chain} comment {comment}\n")
    } else {
        String::new()
    };
    format!(
        "{}add chain {t} {chain}\n\
         flush chain {t} {chain}\n\
         add rule {t} {chain} {family} daddr != {subnet} masquerade comment {comment}\n\
         {jump}",
        render_base(state)
    )
}

/// The reference's per-pod transaction (what a node switched from it
/// holds; tests build that state with it).
pub fn render_setup(
    state: &Masquerade,
    network: &str,
    ifname: &str,
    container_id: &str,
    addresses: &[IpNetwork],
) -> String {
    let t = format!("inet {TABLE}");
    let mut out = render_base(state);
    let comment = quote(&comment(network, ifname, container_id));
    for address in addresses {
        let family = if address.is_ipv4() { "ip" } else { "ip6" };
        out.push_str(&format!(
            "add rule {t} {CHECKS} {family} saddr == {} {family} daddr != {} masquerade comment {comment}\n",
            address.ip(),
            network_of(address)
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

fn subnets_of(addresses: &[IpNetwork]) -> BTreeSet<IpNetwork> {
    addresses
        .iter()
        .filter_map(|a| IpNetwork::new(a.network(), a.prefix()).ok())
        .collect()
}

/// Whether a subnet's chain lacks its rule (`Some(_)`) and whether its
/// jump is missing too (`Some(true)`), asked in-process: both carry the
/// subnet's comment.
fn gap_of(network: &str, subnet: &IpNetwork) -> Result<Option<bool>> {
    let comment = network_comment(network, subnet);
    // nft keeps the comment whole in the rule's user data: compared exactly
    // (a subnet's text can be another's prefix: fd00::/12, fd00::/120).
    let ours = |chain: &str| -> Result<usize> {
        Ok(nfnl::rule_comments(TableFamily::Inet, TABLE, chain)?
            .iter()
            .filter(|c| **c == comment)
            .count())
    };
    let jump = ours(CHECKS)? > 0;
    let rules = ours(&network_chain(network, subnet))?;
    // The base chain's `goto masq_checks` (a flushed `postrouting` loses
    // every subnet's masquerade at once); it names the checks chain.
    let base = nfnl::rules_mentioning(TableFamily::Inet, TABLE, "postrouting", CHECKS)? > 0;
    Ok((rules != 1 || !jump || !base).then_some(!jump))
}

/// The nftables backend.
#[derive(Debug, Clone, Copy)]
pub struct Nftables;

impl MasqueradeBackend for Nftables {
    /// As the iptables backend does: created by the first pod of a subnet,
    /// found in-process by every later one, repaired in one transaction by
    /// the first ADD after someone removed part of it.
    fn ensure_network(&self, network: &str, addresses: &[IpNetwork]) -> Result<()> {
        for subnet in subnets_of(addresses) {
            let Some(jump_missing) = gap_of(network, &subnet)? else {
                continue;
            };
            let state = read()?;
            if let Err(e) = apply(&render_network_setup(&state, network, &subnet, jump_missing))
                && gap_of(network, &subnet)?.is_some()
            {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Looked for in-process, so a pod without rules costs no process. One
    /// table serves both families.
    fn teardown_container(
        &self,
        network: &str,
        container_id: &str,
        ifname: &str,
        _families: &[Family],
    ) -> Result<bool> {
        if exec::find("nft").is_none() {
            return Ok(false);
        }
        let instance = instance_hash(network, ifname, container_id);
        let comments = nfnl::rule_comments(TableFamily::Inet, TABLE, CHECKS)?;
        if !comments.iter().any(|c| c.starts_with(&instance)) {
            return Ok(false);
        }
        let state = read()?;
        match render_delete(&state, |_| false, &instance) {
            Some(transaction) => apply(&transaction).map(|()| true),
            None => Ok(false),
        }
    }

    fn collect_garbage(&self, network: &str, keep: &BTreeSet<(String, String)>) -> Result<()> {
        if exec::find("nft").is_none() {
            return Ok(());
        }
        let state = read()?;
        let kept: BTreeSet<String> = keep
            .iter()
            .map(|(ifname, id)| instance_hash(network, ifname, id))
            .collect();
        let keep_rule = |r: &Rule| {
            is_network_comment(&r.comment) || kept.iter().any(|h| r.comment.starts_with(h.as_str()))
        };
        match render_delete(&state, keep_rule, &network_hash(network)) {
            Some(transaction) => apply(&transaction),
            None => Ok(()),
        }
    }

    fn remove_network(&self, network: &str) -> Result<()> {
        if exec::find("nft").is_none() {
            return Ok(());
        }
        let state = read()?;
        let prefix = format!(
            "{}-net, net: {}, subnet: ",
            network_hash(network),
            network.replace('"', "")
        );
        let ours = |r: &&Rule| r.comment.starts_with(&prefix);
        let t = format!("inet {TABLE}");
        let mut transaction = String::new();
        for rule in state.rules.iter().filter(|r| r.chain == CHECKS).filter(ours) {
            transaction.push_str(&format!("delete rule {t} {CHECKS} handle {}\n", rule.handle));
        }
        // Chains named by their rules or, for one someone has flushed, by the
        // subnet in the jump's comment.
        let mut chains: BTreeSet<String> = BTreeSet::new();
        for rule in state.rules.iter().filter(ours) {
            if rule.chain != CHECKS {
                chains.insert(rule.chain.clone());
            } else if let Some(Ok(subnet)) = rule.comment.strip_prefix(&prefix).map(str::parse::<IpNetwork>) {
                let chain = network_chain(network, &subnet);
                if state.chains.contains(&chain) {
                    chains.insert(chain);
                }
            }
        }
        for chain in chains {
            transaction.push_str(&format!("flush chain {t} {chain}\ndelete chain {t} {chain}\n"));
        }
        if transaction.is_empty() {
            Ok(())
        } else {
            apply(&transaction)
        }
    }

    fn missing(&self, network: &str, addresses: &[IpNetwork]) -> Result<Vec<String>> {
        let state = read()?;
        let mut gaps = Vec::new();
        for subnet in subnets_of(addresses) {
            let chain = network_chain(network, &subnet);
            let comment = network_comment(network, &subnet);
            for (where_, what) in [(CHECKS, "jump"), (chain.as_str(), "masquerade")] {
                if !state
                    .rules
                    .iter()
                    .any(|r| r.chain == where_ && r.comment == comment)
                {
                    gaps.push(format!("nft {what} rule for {} in {where_}", network_of(&subnet)));
                }
            }
        }
        Ok(gaps)
    }
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
    fn a_subnet_gets_its_chain_and_jump_and_base_chains_only_when_missing() {
        let subnet: IpNetwork = "10.0.0.0/24".parse().expect("cidr");
        let chain = network_chain("net", &"10.0.0.5/24".parse().expect("cidr"));
        assert_eq!(chain, network_chain("net", &subnet));
        assert_eq!(chain.len(), 24);
        let fresh = render_network_setup(&Masquerade::default(), "net", &subnet, true);
        assert!(fresh.contains("add chain inet cni_plugins_masquerade postrouting { type nat hook postrouting priority srcnat ; }"));
        assert!(fresh.contains(&format!(
            "add chain inet cni_plugins_masquerade {chain}\nflush chain inet cni_plugins_masquerade {chain}\n"
        )));
        assert!(fresh.contains(&format!(
            "add rule inet cni_plugins_masquerade {chain} ip daddr != 10.0.0.0/24 masquerade comment"
        )));
        assert!(fresh.contains(&format!("masq_checks ip saddr 10.0.0.0/24 jump {chain} comment")));
        let ready = Masquerade {
            table_exists: true,
            postrouting_rules: 3,
            chains: [CHECKS.to_owned()].into(),
            rules: vec![],
        };
        let again = render_network_setup(&ready, "net", &subnet, true);
        assert!(!again.contains("postrouting"), "a ready table's base is kept");
        assert_eq!(again.lines().count(), 4);
        assert!(!render_network_setup(&ready, "net", &subnet, false).contains("jump"));
        let v6 = render_network_setup(&ready, "net", &"fd00::/64".parse().expect("cidr"), true);
        assert!(v6.contains("ip6 daddr != fd00::/64 masquerade"));
        let c = network_comment("net", &subnet);
        assert!(is_network_comment(&c), "{c}");
        assert!(!is_network_comment(&comment("net", "eth0", "c1")));
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
        assert_eq!(state.rules[0].saddr.as_deref(), Some("10.0.0.5"));
        assert_eq!(state.rules[0].chain, "masq_checks");
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

    #[test]
    fn pods_share_the_subnet_chain_and_reference_rules_are_removed() {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                let pods: Vec<IpNetwork> = ["10.0.0.5/24", "10.0.0.6/24", "fd00::5/64"]
                    .iter()
                    .map(|a| a.parse().expect("cidr"))
                    .collect();
                Nftables.ensure_network("net", &pods[..1]).expect("first pod");
                Nftables.ensure_network("net", &pods).expect("later pods");
                Nftables.ensure_network("net", &pods).expect("again");
                let state = read().expect("listed");
                assert_eq!(
                    state.with_prefix(&network_hash("net")).count(),
                    2,
                    "one jump per subnet"
                );
                assert!(Nftables.missing("net", &pods).expect("checked").is_empty());
                // A pod the reference plugin set up.
                apply(&render_setup(&state, "net", "eth0", "ref", &pods[..1])).expect("reference rule");
                assert!(
                    !Nftables
                        .teardown_container("net", "ours", "eth0", &[])
                        .expect("nothing to do")
                );
                Nftables
                    .collect_garbage("net", &[("eth0".to_owned(), "ref".to_owned())].into())
                    .expect("gc keeps it");
                assert!(
                    Nftables
                        .teardown_container("net", "ref", "eth0", &[])
                        .expect("removed")
                );
                Nftables.collect_garbage("net", &BTreeSet::new()).expect("gc");
                assert!(
                    Nftables.missing("net", &pods).expect("checked").is_empty(),
                    "GC of pods keeps the subnets"
                );
                Nftables.remove_network("net").expect("removed");
                assert_eq!(Nftables.missing("net", &pods).expect("checked").len(), 4);
                assert!(read().expect("listed").rules.is_empty());
            });
        });
    }
}
