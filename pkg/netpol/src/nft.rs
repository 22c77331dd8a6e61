//! The kernel side: one `inet` table holding every verdict.
//!
//! - a verdict map per direction and family from an isolated local pod's
//!   address to a jump into its allow list's chain;
//! - an allow list's chain: one rule per allow, matching the peer set and
//!   the ports, that returns; then `drop`;
//! - peer sets named after the rule they come from, so a pod coming or
//!   going changes elements only: pods' addresses in plain sets, address
//!   blocks in interval sets (an `add element` to a plain set does not
//!   make `nft` read every interval set's elements first);
//! - base chains on `forward` (pod to pod, routed or bridged through
//!   `br_netfilter`, after kube-proxy's DNAT) and `input` (pod to node):
//!   packets of established connections pass, then the destination's
//!   ingress list, then the source's egress list. The node's own traffic
//!   to its pods (`output`) is never judged: kubelet's probes pass.
//!
//! A change is one `nft -f` transaction computed against what the kernel
//! holds ([`Current`]): elements added and removed, chains added before
//! map entries jump to them and removed after, so no packet ever sees a
//! half-applied state, and an agent that restarts reconciles the table it
//! left instead of rebuilding it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde_json::Value;

use crate::compile::{Allow, AllowList, BLOCK_SET_PREFIX, Compiled, Direction};
use crate::ranges::{Family, Interval};
use crate::{Error, Result};

/// The table's name, in the `inet` family.
pub const TABLE: &str = "cni-suite-netpol";

/// The comment every base rule carries: base chains whose rules do not all
/// carry this one are rewritten (a newer agent's base rules).
const BASE_TAG: &str = "cni-suite netpol v1";

const BASE_CHAINS: [&str; 2] = ["forward", "input"];

/// The sets of a local pod's own address twice (`addr . addr`), per
/// family: a pod reaching itself (through its Service, hairpinned) is
/// always allowed, as Kubernetes' e2e tests expect.
const SELF_SETS: [&str; 2] = ["self-v4", "self-v6"];

fn self_set(family: Family) -> &'static str {
    match family {
        Family::V4 => SELF_SETS[0],
        Family::V6 => SELF_SETS[1],
    }
}

fn map_name(direction: Direction, family: Family) -> String {
    let family = match family {
        Family::V4 => "v4",
        Family::V6 => "v6",
    };
    format!("{}-{family}", direction.label())
}

fn set_name(base: &str, family: Family) -> String {
    match family {
        Family::V4 => format!("{base}-v4"),
        Family::V6 => format!("{base}-v6"),
    }
}

const FAMILIES: [Family; 2] = [Family::V4, Family::V6];
const DIRECTIONS: [Direction; 2] = [Direction::Ingress, Direction::Egress];

fn address_type(family: Family) -> &'static str {
    match family {
        Family::V4 => "ipv4_addr",
        Family::V6 => "ipv6_addr",
    }
}

fn ip_keyword(family: Family) -> &'static str {
    match family {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    }
}

/// What the table holds in the kernel, as far as changes need it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Current {
    pub exists: bool,
    /// Base chains whose rules are all this version's.
    pub base_current: BTreeSet<String>,
    /// Chains other than the base ones, with how many rules each holds.
    pub chains: BTreeMap<String, usize>,
    /// Peer sets by name, with their elements.
    pub sets: BTreeMap<String, BTreeSet<Interval>>,
    /// The addresses in each family's set of a pod's own traffic.
    pub selves: BTreeMap<String, BTreeSet<IpAddr>>,
    /// Maps by name: address to the chain it jumps to.
    pub maps: BTreeMap<String, BTreeMap<IpAddr, String>>,
}

impl Current {
    /// Reads the table from `nft -j list table`'s output.
    pub fn parse(listing: &str) -> Result<Current> {
        let doc: Value =
            serde_json::from_str(listing).map_err(|e| Error::Listing(format!("not JSON: {e}")))?;
        let mut current = Current {
            exists: true,
            ..Current::default()
        };
        let mut base_rules: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for item in doc["nftables"].as_array().into_iter().flatten() {
            if let Some(chain) = item.get("chain") {
                let name = text(chain, "name")?;
                if BASE_CHAINS.contains(&name.as_str()) {
                    base_rules.entry(name).or_default();
                } else {
                    current.chains.entry(name).or_default();
                }
            } else if let Some(rule) = item.get("rule") {
                let chain = text(rule, "chain")?;
                if let Some(counts) = base_rules.get_mut(&chain) {
                    counts.0 += 1;
                    if rule["comment"].as_str() == Some(BASE_TAG) {
                        counts.1 += 1;
                    }
                } else {
                    *current.chains.entry(chain).or_default() += 1;
                }
            } else if let Some(set) = item.get("set")
                && let Some(name) = SELF_SETS.iter().find(|n| set["name"] == **n)
            {
                // `addr . addr` pairs, the same address twice.
                let mut addresses = BTreeSet::new();
                for element in set["elem"].as_array().into_iter().flatten() {
                    let first = &element["concat"][0];
                    let address = first
                        .as_str()
                        .and_then(|a| a.parse().ok())
                        .ok_or_else(|| Error::Listing(format!("{name} element {element}")))?;
                    addresses.insert(address);
                }
                current.selves.insert((*name).to_owned(), addresses);
            } else if let Some(set) = item.get("set") {
                let mut elements = BTreeSet::new();
                for element in set["elem"].as_array().into_iter().flatten() {
                    elements.insert(interval(element)?);
                }
                current.sets.insert(text(set, "name")?, elements);
            } else if let Some(map) = item.get("map") {
                let mut entries = BTreeMap::new();
                for pair in map["elem"].as_array().into_iter().flatten() {
                    let key = pair[0]
                        .as_str()
                        .and_then(|k| k.parse().ok())
                        .ok_or_else(|| Error::Listing(format!("map key {}", pair[0])))?;
                    // Another verdict than a jump (someone else's): no
                    // chain's, so it is replaced.
                    let target = pair[1]["jump"]["target"].as_str().unwrap_or_default();
                    entries.insert(key, target.to_owned());
                }
                current.maps.insert(text(map, "name")?, entries);
            }
        }
        current.base_current = base_rules
            .into_iter()
            .filter(|(name, (all, tagged))| all == tagged && *all == base_rules_of(name).len())
            .map(|(name, _)| name)
            .collect();
        Ok(current)
    }
}

impl Current {
    /// What the table holds once [`plan`]'s script for `compiled` has
    /// run: a listing of it, without listing it.
    pub fn held_after(compiled: &Compiled) -> Current {
        let mut maps = BTreeMap::new();
        for direction in DIRECTIONS {
            for family in FAMILIES {
                let entries = compiled
                    .isolated
                    .get(&direction)
                    .into_iter()
                    .flatten()
                    .filter(|(ip, _)| Family::of(**ip) == family)
                    .map(|(ip, chain)| (*ip, chain.clone()))
                    .collect();
                maps.insert(map_name(direction, family), entries);
            }
        }
        Current {
            exists: true,
            base_current: BASE_CHAINS.iter().map(|c| (*c).to_owned()).collect(),
            chains: compiled
                .lists
                .iter()
                .map(|(name, list)| (name.clone(), chain_rules(list).len()))
                .collect(),
            sets: peer_sets_of(compiled),
            selves: FAMILIES
                .iter()
                .map(|f| (self_set(*f).to_owned(), isolated_addresses(compiled, *f)))
                .collect(),
            maps,
        }
    }
}

fn text(item: &Value, key: &str) -> Result<String> {
    item[key]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| Error::Listing(format!("no {key} in {item}")))
}

/// A set element as nft lists it: an address, a prefix, or a range.
fn interval(element: &Value) -> Result<Interval> {
    let parsed = if let Some(address) = element.as_str() {
        Interval::parse(address)
    } else if let Some(prefix) = element.get("prefix") {
        let addr = prefix["addr"].as_str().unwrap_or_default();
        let len = prefix["len"].as_u64().unwrap_or_default();
        Interval::parse(&format!("{addr}/{len}"))
    } else if let Some(range) = element.get("range") {
        let first = range[0].as_str().unwrap_or_default();
        let last = range[1].as_str().unwrap_or_default();
        Interval::parse(&format!("{first}-{last}"))
    } else if let Some(inner) = element.get("elem") {
        return interval(&inner["val"]);
    } else {
        None
    };
    parsed.ok_or_else(|| Error::Listing(format!("set element {element}")))
}

fn base_rules_of(chain: &str) -> Vec<String> {
    let tag = format!("comment \"{BASE_TAG}\"");
    let mut rules = vec![
        format!("ct state established,related accept {tag}"),
        // Neighbour discovery is untracked: without it an isolated pod
        // resolves no neighbour, not even for what it is allowed.
        format!(
            "icmpv6 type {{ nd-router-solicit, nd-router-advert, nd-neighbor-solicit, \
             nd-neighbor-advert, nd-redirect }} accept {tag}"
        ),
    ];
    if chain == "forward" {
        // Pods' link-local addresses are in no map: between pods they
        // would pass every policy (the node's own link-local traffic, on
        // `input`, is left alone: DHCPv6 and the like use it).
        rules.push(format!(
            "ip6 saddr fe80::/10 meta l4proto {{ tcp, udp, sctp }} drop {tag}"
        ));
        rules.push(format!(
            "ip6 daddr fe80::/10 meta l4proto {{ tcp, udp, sctp }} drop {tag}"
        ));
        for family in FAMILIES {
            let ip = ip_keyword(family);
            rules.push(format!(
                "{ip} saddr . {ip} daddr @{} accept {tag}",
                self_set(family)
            ));
        }
    }
    let directions: &[Direction] = if chain == "forward" {
        &DIRECTIONS
    } else {
        &[Direction::Egress]
    };
    for direction in directions {
        let end = match direction {
            Direction::Ingress => "daddr",
            Direction::Egress => "saddr",
        };
        for family in FAMILIES {
            rules.push(format!(
                "{} {end} vmap @{} {tag}",
                ip_keyword(family),
                map_name(*direction, family)
            ));
        }
    }
    rules
}

/// The rules of an allow list's chain.
fn chain_rules(list: &AllowList) -> Vec<String> {
    let end = match list.direction {
        Direction::Ingress => "saddr",
        Direction::Egress => "daddr",
    };
    let mut rules = Vec::new();
    for Allow { peers, ports } in &list.allows {
        let ports = ports.as_ref().map(|ports| {
            let elements: Vec<String> = ports
                .iter()
                .map(|p| {
                    if p.first == p.last {
                        format!("{} . {}", p.protocol.keyword(), p.first)
                    } else {
                        format!("{} . {}-{}", p.protocol.keyword(), p.first, p.last)
                    }
                })
                .collect();
            format!("meta l4proto . th dport {{ {} }} ", elements.join(", "))
        });
        let ports = ports.unwrap_or_default();
        match peers {
            None => rules.push(format!("{ports}return")),
            Some(sets) => {
                for set in sets {
                    for family in FAMILIES {
                        rules.push(format!(
                            "{} {end} @{} {ports}return",
                            ip_keyword(family),
                            set_name(set, family)
                        ));
                    }
                }
            }
        }
    }
    rules.push("drop".into());
    rules
}

/// Each family's peer set of `compiled`, by name.
fn peer_sets_of(compiled: &Compiled) -> BTreeMap<String, BTreeSet<Interval>> {
    let mut sets = BTreeMap::new();
    for (base, members) in &compiled.peer_sets {
        for family in FAMILIES {
            sets.insert(
                set_name(base, family),
                members.iter().filter(|i| i.family == family).copied().collect(),
            );
        }
    }
    sets
}

/// Every local pod address of `family` isolated in either direction.
fn isolated_addresses(compiled: &Compiled, family: Family) -> BTreeSet<IpAddr> {
    compiled
        .isolated
        .values()
        .flat_map(|addresses| addresses.keys())
        .filter(|ip| Family::of(**ip) == family)
        .copied()
        .collect()
}

fn elements(intervals: impl IntoIterator<Item = Interval>) -> String {
    let shown: Vec<String> = intervals.into_iter().map(|i| i.to_string()).collect();
    shown.join(", ")
}

/// The `nft -f` script that makes `current` into `compiled`; empty when
/// nothing differs.
pub fn plan(current: &Current, compiled: &Compiled) -> String {
    let mut script = String::new();
    let mut line = |text: String| {
        script.push_str(&text);
        script.push('\n');
    };
    let t = format!("inet {TABLE}");
    if !current.exists {
        line(format!("add table {t}"));
    }
    for direction in DIRECTIONS {
        for family in FAMILIES {
            let name = map_name(direction, family);
            if !current.maps.contains_key(&name) {
                line(format!(
                    "add map {t} {name} {{ type {} : verdict; }}",
                    address_type(family)
                ));
            }
        }
    }
    // A pod's own traffic: every isolated local address, paired with itself.
    for family in FAMILIES {
        let name = self_set(family);
        let wanted = isolated_addresses(compiled, family);
        let have = match current.selves.get(name) {
            Some(have) => have.clone(),
            None => {
                let key = address_type(family);
                line(format!("add set {t} {name} {{ type {key} . {key}; }}"));
                BTreeSet::new()
            }
        };
        let pairs = |ips: Vec<&IpAddr>| -> String {
            ips.iter()
                .map(|ip| format!("{ip} . {ip}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let gone: Vec<&IpAddr> = have.difference(&wanted).collect();
        let new: Vec<&IpAddr> = wanted.difference(&have).collect();
        if !gone.is_empty() {
            line(format!("delete element {t} {name} {{ {} }}", pairs(gone)));
        }
        if !new.is_empty() {
            line(format!("add element {t} {name} {{ {} }}", pairs(new)));
        }
    }
    // Sets: new ones made, the others' elements changed.
    let wanted_sets = peer_sets_of(compiled);
    for (name, wanted) in &wanted_sets {
        let family = if name.ends_with("-v6") {
            Family::V6
        } else {
            Family::V4
        };
        let have = match current.sets.get(name) {
            Some(have) => have.clone(),
            None => {
                let flags = if name.starts_with(BLOCK_SET_PREFIX) {
                    " flags interval;"
                } else {
                    ""
                };
                line(format!(
                    "add set {t} {name} {{ type {};{flags} }}",
                    address_type(family)
                ));
                BTreeSet::new()
            }
        };
        let gone: Vec<Interval> = have.difference(wanted).copied().collect();
        let new: Vec<Interval> = wanted.difference(&have).copied().collect();
        if !gone.is_empty() {
            line(format!("delete element {t} {name} {{ {} }}", elements(gone)));
        }
        if !new.is_empty() {
            line(format!("add element {t} {name} {{ {} }}", elements(new)));
        }
    }
    // Chains, before anything jumps to them; one whose rules someone
    // changed (flushed, or its `drop` deleted) is written again.
    for (name, list) in &compiled.lists {
        let rules = chain_rules(list);
        match current.chains.get(name) {
            Some(count) if *count == rules.len() => continue,
            Some(_) => line(format!("flush chain {t} {name}")),
            None => line(format!("add chain {t} {name}")),
        }
        for rule in rules {
            line(format!("add rule {t} {name} {rule}"));
        }
    }
    // Base chains, once their maps exist.
    for (chain, hook) in [("forward", "forward"), ("input", "input")] {
        if !current.base_current.contains(chain) {
            line(format!(
                "add chain {t} {chain} {{ type filter hook {hook} priority filter; policy accept; }}"
            ));
            line(format!("flush chain {t} {chain}"));
            for rule in base_rules_of(chain) {
                line(format!("add rule {t} {chain} {rule}"));
            }
        }
    }
    // Map entries: the changed and gone removed, then the new added.
    for direction in DIRECTIONS {
        for family in FAMILIES {
            let name = map_name(direction, family);
            let empty = BTreeMap::new();
            let have = current.maps.get(&name).unwrap_or(&empty);
            let wanted: BTreeMap<IpAddr, &String> = compiled
                .isolated
                .get(&direction)
                .into_iter()
                .flatten()
                .filter(|(ip, _)| Family::of(**ip) == family)
                .map(|(ip, chain)| (*ip, chain))
                .collect();
            let gone: Vec<String> = have
                .iter()
                .filter(|(ip, chain)| wanted.get(*ip) != Some(chain))
                .map(|(ip, _)| ip.to_string())
                .collect();
            let new: Vec<String> = wanted
                .iter()
                .filter(|(ip, chain)| have.get(*ip) != Some(**chain))
                .map(|(ip, chain)| format!("{ip} : jump {chain}"))
                .collect();
            if !gone.is_empty() {
                line(format!("delete element {t} {name} {{ {} }}", gone.join(", ")));
            }
            if !new.is_empty() {
                line(format!("add element {t} {name} {{ {} }}", new.join(", ")));
            }
        }
    }
    // Chains and sets nothing refers to any more.
    for name in current.chains.keys().filter(|c| !compiled.lists.contains_key(*c)) {
        line(format!("flush chain {t} {name}"));
        line(format!("delete chain {t} {name}"));
    }
    for name in current.sets.keys().filter(|s| !wanted_sets.contains_key(*s)) {
        line(format!("delete set {t} {name}"));
    }
    script
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{Compiled, Snapshot, compile};
    use crate::model::{Peer, PodView, Policy, PortSpec, Protocol, Rule, Selector};

    fn pod(name: &str, node: &str, ip: &str, app: &str) -> PodView {
        PodView {
            namespace: "a".into(),
            name: name.into(),
            node: Some(node.into()),
            labels: [("app".to_owned(), app.to_owned())].into(),
            ips: vec![ip.parse().expect("test data parses")],
            ports: vec![],
        }
    }

    fn web_peers() -> Peer {
        Peer::Pods {
            pods: Some(Selector::labels(&[("app", "web")])),
            namespaces: None,
        }
    }

    fn web_to_db(pods: Vec<PodView>) -> Compiled {
        let rule = Rule {
            peers: Some(vec![web_peers()]),
            ports: vec![PortSpec::Range(Protocol::Tcp, 5432, 5432)],
        };
        db_taking(rule, pods)
    }

    /// The db pods take what `rule` allows.
    fn db_taking(rule: Rule, pods: Vec<PodView>) -> Compiled {
        let policy = Policy {
            namespace: "a".into(),
            name: "db".into(),
            pod_selector: Selector::labels(&[("app", "db")]),
            ingress: Some(vec![rule]),
            egress: None,
        };
        let snapshot = Snapshot {
            pods,
            namespaces: vec![],
            policies: vec![policy],
        };
        compile(&snapshot, "n1")
    }

    fn db_pods() -> Vec<PodView> {
        vec![
            pod("db", "n1", "10.0.1.3", "db"),
            pod("web", "n2", "10.0.2.2", "web"),
        ]
    }

    #[test]
    fn a_fresh_table_gets_its_sets_and_chains_before_anything_jumps_to_them() {
        let compiled = web_to_db(db_pods());
        let script = plan(&Current::default(), &compiled);
        let position = |text: &str| {
            script
                .find(text)
                .unwrap_or_else(|| panic!("{text:?} not in:\n{script}"))
        };
        let chain = compiled.lists.keys().next().expect("present");
        assert!(position("add table inet cni-suite-netpol") < position("add map"));
        assert!(
            position("add element inet cni-suite-netpol pods-")
                < position(&format!("add chain inet cni-suite-netpol {chain}"))
        );
        assert!(position(&format!("add chain inet cni-suite-netpol {chain}")) < position(": jump"));
        assert!(script.contains("ip saddr @pods-"));
        assert!(script.contains("meta l4proto . th dport { tcp . 5432 } return"));
        assert!(script.contains("add element inet cni-suite-netpol ingress-v4 { 10.0.1.3 : jump "));
        assert!(script.contains("hook forward priority filter"));
    }

    #[test]
    fn pods_go_in_plain_sets_and_address_blocks_in_interval_sets_of_their_own() {
        let rule = Rule {
            peers: Some(vec![
                web_peers(),
                Peer::Block {
                    cidr: "192.168.0.0/16".parse().expect("test data parses"),
                    except: vec![],
                },
            ]),
            ports: vec![],
        };
        let script = plan(&Current::default(), &db_taking(rule, db_pods()));
        let declared = |prefix: &str, family: &str| -> Vec<&str> {
            script
                .lines()
                .filter(|l| l.starts_with(&format!("add set inet {TABLE} {prefix}")))
                .filter(|l| l.contains(family))
                .collect()
        };
        let pod_set = declared("pods-", "-v4 ");
        assert_eq!(pod_set.len(), 1, "{script}");
        assert!(pod_set[0].ends_with("{ type ipv4_addr; }"), "{script}");
        let block_set = declared("blocks-", "-v6 ");
        assert_eq!(block_set.len(), 1, "{script}");
        assert!(
            block_set[0].ends_with("{ type ipv6_addr; flags interval; }"),
            "{script}"
        );
        // Either set lets a peer in: a rule for each, in each family.
        assert_eq!(script.matches(" return\n").count(), 4, "{script}");
        assert!(script.contains("{ 10.0.2.2 }"), "{script}");
        assert!(script.contains("{ 192.168.0.0-192.168.255.255 }"), "{script}");
    }

    #[test]
    fn what_the_kernel_already_holds_is_left_alone() {
        let compiled = web_to_db(db_pods());
        assert_eq!(plan(&Current::held_after(&compiled), &compiled), "");
    }

    #[test]
    fn a_new_peer_pod_is_one_element_and_a_gone_policy_takes_its_chains_and_sets() {
        let before = web_to_db(db_pods());
        let mut pods = db_pods();
        pods.push(pod("web2", "n3", "10.0.3.3", "web"));
        let after = web_to_db(pods);
        let script = plan(&Current::held_after(&before), &after);
        let lines: Vec<&str> = script.lines().collect();
        assert_eq!(lines.len(), 1, "{script}");
        assert!(
            lines[0].starts_with("add element inet cni-suite-netpol pods-")
                && lines[0].ends_with("-v4 { 10.0.3.3 }")
        );

        let script = plan(&Current::held_after(&before), &Compiled::default());
        assert!(
            script.contains("delete element inet cni-suite-netpol ingress-v4 { 10.0.1.3 }"),
            "{script}"
        );
        let chain = before.lists.keys().next().expect("present");
        assert!(
            script.find("ingress-v4 { 10.0.1.3 }").expect("present")
                < script
                    .find(&format!("delete chain inet cni-suite-netpol {chain}"))
                    .expect("present")
        );
        assert_eq!(script.matches("delete set").count(), 2, "{script}");
    }

    #[test]
    fn a_chain_someone_flushed_is_written_again_and_a_pod_is_allowed_itself() {
        let compiled = web_to_db(db_pods());
        let mut current = Current::held_after(&compiled);
        let chain = compiled.lists.keys().next().expect("a chain").clone();
        current.chains.insert(chain.clone(), 0);
        let script = plan(&current, &compiled);
        assert!(
            script.starts_with(&format!("flush chain inet cni-suite-netpol {chain}\n")),
            "{script}"
        );
        assert!(script.contains(" drop\n"), "{script}");

        let script = plan(&Current::default(), &compiled);
        assert!(
            script.contains("add element inet cni-suite-netpol self-v4 { 10.0.1.3 . 10.0.1.3 }"),
            "{script}"
        );
        assert!(script.contains("ip saddr . ip daddr @self-v4 accept"), "{script}");
    }

    #[test]
    fn base_chains_of_another_version_are_rewritten_in_the_same_transaction() {
        let compiled = web_to_db(db_pods());
        let mut current = Current::held_after(&compiled);
        current.base_current.remove("input");
        let script = plan(&current, &compiled);
        assert!(script.contains("flush chain inet cni-suite-netpol input"));
        assert!(!script.contains("flush chain inet cni-suite-netpol forward"));
    }

    #[test]
    fn a_listing_reads_back() {
        let listing = r#"{"nftables": [{"metainfo": {}}, {"table": {"family": "inet", "name": "cni-suite-netpol"}},
          {"chain": {"family": "inet", "table": "cni-suite-netpol", "name": "forward", "hook": "forward"}},
          {"chain": {"family": "inet", "table": "cni-suite-netpol", "name": "in-0011223344556677"}},
          {"set": {"name": "blocks-1-v4", "type": "ipv4_addr", "flags": ["interval"],
                   "elem": ["10.0.0.1", {"prefix": {"addr": "10.1.0.0", "len": 16}}, {"range": ["10.2.0.1", "10.2.0.9"]}]}},
          {"set": {"name": "self-v4", "type": ["ipv4_addr", "ipv4_addr"],
                   "elem": [{"concat": ["10.0.1.3", "10.0.1.3"]}]}},
          {"rule": {"chain": "in-0011223344556677", "comment": null}},
          {"map": {"name": "ingress-v4", "type": "ipv4_addr", "map": "verdict",
                   "elem": [["10.0.1.3", {"jump": {"target": "in-0011223344556677"}}]]}},
          {"rule": {"chain": "forward", "comment": "cni-suite netpol v1"}}]}"#;
        let current = Current::parse(listing).expect("present");
        assert!(current.exists);
        assert_eq!(
            current.chains,
            BTreeMap::from([("in-0011223344556677".to_owned(), 1)])
        );
        let ip: IpAddr = "10.0.1.3".parse().expect("an address");
        assert_eq!(current.selves["self-v4"], BTreeSet::from([ip]));
        // One base rule of five: not this version's.
        assert!(current.base_current.is_empty());
        let set: Vec<String> = current.sets["blocks-1-v4"]
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(set, ["10.0.0.1", "10.1.0.0-10.1.255.255", "10.2.0.1-10.2.0.9"]);
        assert_eq!(
            current.maps["ingress-v4"][&"10.0.1.3".parse::<IpAddr>().expect("an address")],
            "in-0011223344556677"
        );
    }
}
