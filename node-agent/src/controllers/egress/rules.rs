//! The node agent's masquerade: only traffic from this node's pods that
//! leaves the cluster's pod range, so pod-to-pod traffic between nodes
//! keeps its source address. One chain per family, written whole:
//!
//! ```text
//! *nat
//! :CNI-SUITE-EGRESS - [0:0]
//! -A CNI-SUITE-EGRESS -d <each cluster pod CIDR> -m comment --comment "…" -j RETURN
//! -A CNI-SUITE-EGRESS -d <multicast> -m comment --comment "…" -j RETURN
//! -A CNI-SUITE-EGRESS -m comment --comment "…" -j MASQUERADE
//! -A POSTROUTING -s <each of this node's pod CIDRs> -m comment --comment "…" -j CNI-SUITE-EGRESS
//! COMMIT
//! ```
//!
//! Lines are rendered the way `iptables-save` prints them, so what is in
//! place is compared line by line and nothing runs when it matches; when
//! anything differs the chain and the jumps are written in one
//! `iptables-restore --noflush` per family, waiting for another tool's
//! xtables lock for [`crate::changes::XTABLES_WAIT`] at most.

use std::collections::BTreeSet;

use ipnetwork::IpNetwork;

use firewall::iptables::{self, SavedTable, network_of, quote};
use firewall::{Family, Result, exec};

use crate::changes::XTABLES_WAIT;

/// The agent's chain in the nat table.
pub const CHAIN: &str = "CNI-SUITE-EGRESS";

const INSIDE: &str = "cni-suite node agent: to pods of the cluster";
const MULTICAST: &str = "cni-suite node agent: multicast stays unmasqueraded";
const LEAVING: &str = "cni-suite node agent: leaving the cluster";
// No apostrophe in a comment: iptables-save prints it escaped (`\'`), and
// the rendered lines must equal what it prints.
const FROM_PODS: &str = "cni-suite node agent: from the pods of this node";

/// The rules of the chain and the POSTROUTING jumps for one family.
fn wanted(family: Family, sources: &[IpNetwork], cluster: &[IpNetwork]) -> (Vec<String>, BTreeSet<String>) {
    let of_family = |nets: &[IpNetwork]| -> BTreeSet<String> {
        nets.iter()
            .filter(|n| Family::of(n) == family)
            .map(network_of)
            .collect()
    };
    let mut rules: Vec<String> = of_family(cluster)
        .iter()
        .map(|cidr| {
            format!(
                "-A {CHAIN} -d {cidr} -m comment --comment {} -j RETURN",
                quote(INSIDE)
            )
        })
        .collect();
    rules.push(format!(
        "-A {CHAIN} -d {} -m comment --comment {} -j RETURN",
        family.multicast(),
        quote(MULTICAST)
    ));
    rules.push(format!(
        "-A {CHAIN} -m comment --comment {} -j MASQUERADE",
        quote(LEAVING)
    ));
    let jumps = of_family(sources)
        .iter()
        .map(|cidr| {
            format!(
                "-A POSTROUTING -s {cidr} -m comment --comment {} -j {CHAIN}",
                quote(FROM_PODS)
            )
        })
        .collect();
    (rules, jumps)
}

/// The `iptables-restore --noflush` input that makes `table` hold the
/// agent's chain for traffic from `sources` (this node's pod CIDRs) not
/// bound to `cluster`, or None when it already does. With no source of
/// the family, the chain and its jumps are removed.
pub fn render(
    family: Family,
    table: &SavedTable,
    sources: &[IpNetwork],
    cluster: &[IpNetwork],
) -> Option<String> {
    let (rules, jumps) = wanted(family, sources, cluster);
    if jumps.is_empty() {
        return iptables::render_nat_removal(table, &[CHAIN.to_owned()]);
    }
    let present_rules: Vec<&str> = table.rules_of(CHAIN).collect();
    let present_jumps: BTreeSet<&str> = table.jumps_from("POSTROUTING", CHAIN).collect();
    let in_place = table.chains.contains(CHAIN)
        && present_rules == rules.iter().map(String::as_str).collect::<Vec<_>>()
        && present_jumps == jumps.iter().map(String::as_str).collect();
    if in_place {
        return None;
    }
    // `:chain` creates the chain or empties it: its rules are written whole.
    let mut out = format!("*nat\n:{CHAIN} - [0:0]\n");
    for jump in present_jumps.iter().filter(|j| !jumps.contains(**j)) {
        out.push_str(&jump.replacen("-A ", "-D ", 1));
        out.push('\n');
    }
    for rule in &rules {
        out.push_str(rule);
        out.push('\n');
    }
    for jump in jumps.iter().filter(|j| !present_jumps.contains(j.as_str())) {
        out.push_str(jump);
        out.push('\n');
    }
    out.push_str("COMMIT\n");
    Some(out)
}

/// Brings both families in line; returns the families it changed.
pub fn apply(sources: &[IpNetwork], cluster: &[IpNetwork]) -> Result<Vec<Family>> {
    let mut changed = Vec::new();
    for family in [Family::V4, Family::V6] {
        let has_sources = sources.iter().any(|s| Family::of(s) == family);
        if !has_sources && firewall::exec::find(family.save()).is_none() {
            continue;
        }
        let table = iptables::read(family, "nat")?;
        if let Some(input) = render(family, &table, sources, cluster) {
            exec::run(family.restore(), &["--noflush", XTABLES_WAIT], &input)?;
            changed.push(family);
        }
    }
    Ok(changed)
}

/// Removes the chain and its jumps in both families; returns the families
/// that had any.
pub fn remove() -> Result<Vec<Family>> {
    apply(&[], &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpNetwork> {
        list.iter().map(|s| s.parse().expect("cidr")).collect()
    }

    /// What `iptables-save` prints after `input` ran on an empty nat table.
    fn saved(before: &SavedTable, input: &str) -> SavedTable {
        let mut table = before.clone();
        for line in input.lines() {
            if let Some(chain) = line.strip_prefix(':').and_then(|d| d.split_whitespace().next()) {
                table.chains.insert(chain.to_owned());
                table.rules.retain(|(c, _)| c != chain);
            } else if let Some(rule) = line.strip_prefix("-D ") {
                let line = format!("-A {rule}");
                table.rules.retain(|(_, l)| *l != line);
            } else if let Some(chain) = line.strip_prefix("-X ") {
                table.chains.remove(chain);
            } else if let Some(chain) = line.strip_prefix("-F ") {
                table.rules.retain(|(c, _)| c != chain);
            } else if let Some((chain, _)) = line.strip_prefix("-A ").and_then(|r| r.split_once(' ')) {
                table.rules.push((chain.to_owned(), line.to_owned()));
            }
        }
        table
    }

    #[test]
    fn the_chain_returns_for_the_cluster_and_masquerades_the_rest() {
        let empty = SavedTable::parse("*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n", "nat");
        let sources = nets(&["10.244.1.0/24", "fd00:10:244:1::/64"]);
        let cluster = nets(&["10.244.0.0/24", "10.244.1.0/24", "fd00:10:244::/64"]);
        let input = render(Family::V4, &empty, &sources, &cluster).expect("first");
        assert_eq!(
            input,
            "*nat\n:CNI-SUITE-EGRESS - [0:0]\n\
             -A CNI-SUITE-EGRESS -d 10.244.0.0/24 -m comment --comment \"cni-suite node agent: to pods of the cluster\" -j RETURN\n\
             -A CNI-SUITE-EGRESS -d 10.244.1.0/24 -m comment --comment \"cni-suite node agent: to pods of the cluster\" -j RETURN\n\
             -A CNI-SUITE-EGRESS -d 224.0.0.0/4 -m comment --comment \"cni-suite node agent: multicast stays unmasqueraded\" -j RETURN\n\
             -A CNI-SUITE-EGRESS -m comment --comment \"cni-suite node agent: leaving the cluster\" -j MASQUERADE\n\
             -A POSTROUTING -s 10.244.1.0/24 -m comment --comment \"cni-suite node agent: from the pods of this node\" -j CNI-SUITE-EGRESS\n\
             COMMIT\n"
        );
        let table = saved(&empty, &input);
        assert_eq!(render(Family::V4, &table, &sources, &cluster), None, "in place");

        // A node joins: the chain is rewritten, the jump stays single.
        let grown = nets(&["10.244.0.0/24", "10.244.1.0/24", "10.244.2.0/24"]);
        let input = render(Family::V4, &table, &sources, &grown).expect("grown");
        assert!(!input.contains("POSTROUTING"), "{input}");
        let table = saved(&table, &input);
        assert_eq!(table.rules_of(CHAIN).count(), 5);

        // The node's own range changes: the old jump goes in the same batch.
        let moved = nets(&["10.244.9.0/24"]);
        let input = render(Family::V4, &table, &moved, &grown).expect("moved");
        assert!(input.contains("-D POSTROUTING -s 10.244.1.0/24"), "{input}");
        let table = saved(&table, &input);
        assert_eq!(table.jumps_from("POSTROUTING", CHAIN).count(), 1);

        let input = render(Family::V4, &table, &[], &grown).expect("teardown");
        let table = saved(&table, &input);
        assert!(!table.chains.contains(CHAIN));
        assert_eq!(table.rules, saved(&empty, "").rules);
        assert_eq!(render(Family::V4, &table, &[], &grown), None);
    }
}
