//! Masquerade with iptables, per network subnet: the first pod of a subnet
//! creates
//!
//! ```text
//! *nat
//! -N CNI-NET-<20 hex of sha512(network:subnet)>
//! -A CNI-NET-… -d <subnet> -m comment --comment "name: \"<net>\" subnet: \"<subnet>\"" -j ACCEPT
//! -A CNI-NET-… ! -d 224.0.0.0/4 -m comment --comment "…" -j MASQUERADE
//! -A POSTROUTING -s <subnet> -m comment --comment "…" -j CNI-NET-…
//! COMMIT
//! ```
//!
//! and every later pod only asks, in-process, whether the chain exists. DEL
//! changes nothing: deleting in nf_tables waits for the kernel (13–21 ms per
//! transaction here), and a pod's DEL needs no rule removed. GC removes a
//! network's chains once none of its attachments is valid.
//!
//! The reference plugin instead writes one chain per container
//! (`CNI-<24 hex of sha512(network + containerID)>`, same rules, jumped to
//! from `-s <pod ip>/32`). Those chains, made by the reference or by a node
//! that ran it before, are still found by name and removed by DEL and GC.

use std::collections::{BTreeMap, BTreeSet};

use ipnetwork::IpNetwork;
use sha2::{Digest, Sha512};

use firewall::iptables::{self, SavedTable, network_of, prefixed_chain_name, quote, restore, uses_nf_tables};
use firewall::{Family, Result, exec, nfnl};

use super::backend::MasqueradeBackend;

/// libcni utils' `FormatChainName`.
pub fn chain_name(network: &str, container_id: &str) -> String {
    prefixed_chain_name("", network, container_id)
}

/// The comment every rule carries.
pub fn comment(network: &str, container_id: &str) -> String {
    format!("name: \"{network}\" id: \"{container_id}\"")
}

/// `CNI-NET-<20 hex of sha512(network:subnet)>`: the chain that
/// masquerades one subnet of one network.
pub fn network_chain(network: &str, subnet: &IpNetwork) -> String {
    let digest = Sha512::digest(format!("{network}:{}", network_of(subnet)).as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let mut name = format!("CNI-NET-{hex}");
    name.truncate(firewall::MAX_CHAIN_NAME);
    name
}

fn network_comment(network: &str, subnet: &IpNetwork) -> String {
    format!("name: \"{network}\" subnet: \"{}\"", network_of(subnet))
}

/// The reference plugin's per-container rules for the addresses of one
/// family (what a node switched from it holds; the bench's floor).
pub fn render_setup(family: Family, network: &str, container_id: &str, addresses: &[IpNetwork]) -> String {
    let chain = chain_name(network, container_id);
    let comment = quote(&comment(network, container_id));
    let mine: Vec<&IpNetwork> = addresses.iter().filter(|a| Family::of(a) == family).collect();
    let mut out = format!("*nat\n:{chain} - [0:0]\n");
    let mut subnets = BTreeSet::new();
    for address in &mine {
        if subnets.insert(network_of(address)) {
            out.push_str(&format!(
                "-A {chain} -d {} -m comment --comment {comment} -j ACCEPT\n",
                network_of(address)
            ));
        }
    }
    out.push_str(&format!(
        "-A {chain} ! -d {} -m comment --comment {comment} -j MASQUERADE\n",
        family.multicast()
    ));
    for address in &mine {
        out.push_str(&format!(
            "-A POSTROUTING -s {}/{} -m comment --comment {comment} -j {chain}\n",
            address.ip(),
            family.host_prefix()
        ));
    }
    out.push_str("COMMIT\n");
    out
}

/// The input that writes a subnet's chain whole and, `with_jump`, its
/// POSTROUTING jump (left out when the jump is there: callers hold the
/// node's lock, so none is doubled).
pub fn render_network_setup(family: Family, network: &str, subnet: &IpNetwork, with_jump: bool) -> String {
    let chain = network_chain(network, subnet);
    let comment = quote(&network_comment(network, subnet));
    let subnet = network_of(subnet);
    // `:chain` creates the chain, or empties the one there: its rules are
    // written whole, never doubled.
    let jump = if with_jump {
        format!("-A POSTROUTING -s {subnet} -m comment --comment {comment} -j {chain}\n")
    } else {
        String::new()
    };
    format!(
        "*nat\n:{chain} - [0:0]\n\
         -A {chain} -d {subnet} -m comment --comment {comment} -j ACCEPT\n\
         -A {chain} ! -d {} -m comment --comment {comment} -j MASQUERADE\n\
         {jump}COMMIT\n",
        family.multicast()
    )
}

/// The CNI chains of `network` in the nat table and the container each
/// belongs to, read from their comments.
pub fn containers_of(table: &SavedTable, network: &str) -> BTreeMap<String, String> {
    let prefix = format!("--comment \"name: \\\"{network}\\\" id: \\\"");
    table
        .rules
        .iter()
        .filter(|(chain, _)| chain.starts_with("CNI-") && table.chains.contains(chain))
        .filter_map(|(chain, line)| {
            let rest = &line[line.find(&prefix)? + prefix.len()..];
            let id = &rest[..rest.find("\\\"")?];
            Some((chain.clone(), id.to_owned()))
        })
        .collect()
}

/// The subnet chains of `network` in the nat table, found by their
/// comments.
pub fn network_chains_of(table: &SavedTable, network: &str) -> BTreeSet<String> {
    let prefix = format!("--comment \"name: \\\"{network}\\\" subnet: ");
    // Named by the rules inside a chain or, for a chain someone has
    // flushed, by the jump to it.
    table
        .rules
        .iter()
        .filter(|(_, line)| line.contains(&prefix))
        .filter_map(|(chain, line)| {
            let target = line.rsplit_once(" -j ").map(|(_, t)| t.trim());
            [Some(chain.as_str()), target]
                .into_iter()
                .flatten()
                .find(|c| c.starts_with("CNI-NET-"))
                .map(str::to_owned)
        })
        .collect()
}

fn subnets_of(addresses: &[IpNetwork]) -> BTreeSet<IpNetwork> {
    addresses
        .iter()
        .filter_map(|a| IpNetwork::new(a.network(), a.prefix()).ok())
        .collect()
}

/// What a subnet's masquerade lacks: nothing (`None`), or its chain's
/// rules and, when `jump` says so, the POSTROUTING jump.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Gap {
    jump: bool,
}

/// Looks for a subnet's chain, its two rules and its jump: in-process with
/// iptables-nft (every rule of ours carries the subnet's comment, which
/// iptables-nft keeps in the rule's `comment` match), from `iptables-save`
/// with iptables-legacy.
fn gap_of(family: Family, network: &str, subnet: &IpNetwork) -> Result<Option<Gap>> {
    let chain = network_chain(network, subnet);
    let (rules, jump) = if uses_nf_tables(family) {
        let table_family = family.nf_table_family();
        let comment = network_comment(network, subnet);
        let ours = |chain: &str| nfnl::rules_mentioning(table_family, "nat", chain, &comment);
        (ours(&chain)?, ours("POSTROUTING")? > 0)
    } else {
        let table = iptables::read(family, "nat")?;
        let expected = render_network_setup(family, network, subnet, true);
        let present = |line: &str| table.rules.iter().any(|(_, rule)| rule == line);
        let in_chain = table.rules.iter().filter(|(c, _)| *c == chain).count();
        let lines: Vec<&str> = expected.lines().filter(|l| l.starts_with("-A ")).collect();
        let (own, jump) = lines.split_at(2);
        let complete = own.iter().all(|l| present(l));
        (
            if complete { in_chain } else { 0 },
            jump.iter().all(|l| present(l)),
        )
    };
    Ok((rules != 2 || !jump).then_some(Gap { jump: !jump }))
}

/// The iptables backend.
#[derive(Debug, Clone, Copy)]
pub struct Iptables;

impl MasqueradeBackend for Iptables {
    /// Every ADD leaves it complete: the first pod of a subnet creates its
    /// chain and jump, and a later one puts back whatever a firewall reload
    /// or `iptables -t nat -F` removed, in one batch. When nothing is
    /// missing no process is started.
    fn ensure_network(&self, network: &str, addresses: &[IpNetwork]) -> Result<()> {
        for subnet in subnets_of(addresses) {
            let family = Family::of(&subnet);
            let Some(gap) = gap_of(family, network, &subnet)? else {
                continue;
            };
            let repair = render_network_setup(family, network, &subnet, gap.jump);
            if let Err(e) = restore(family, &repair) {
                // A plugin outside the node's lock (the reference's) may have
                // made it complete meanwhile.
                if gap_of(family, network, &subnet)?.is_some() {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// The container's own chain, found in-process, so a pod without one
    /// costs no process. The chain's name does not depend on `ifname`.
    fn teardown_container(
        &self,
        network: &str,
        container_id: &str,
        _ifname: &str,
        families: &[Family],
    ) -> Result<bool> {
        let chain = chain_name(network, container_id);
        let mut removed = false;
        for family in families {
            if exec::find(family.save()).is_none() || !iptables::chain_exists(*family, "nat", &chain)? {
                continue;
            }
            let table = iptables::read(*family, "nat")?;
            if let Some(input) = iptables::render_nat_removal(&table, std::slice::from_ref(&chain)) {
                restore(*family, &input)?;
                removed = true;
            }
        }
        Ok(removed)
    }

    /// The reference's chains are named by network and container only, so
    /// a container is kept when any of its interfaces is.
    fn collect_garbage(&self, network: &str, keep: &BTreeSet<(String, String)>) -> Result<()> {
        let containers: BTreeSet<&str> = keep.iter().map(|(_, id)| id.as_str()).collect();
        for family in [Family::V4, Family::V6] {
            if exec::find(family.save()).is_none() {
                continue;
            }
            let table = iptables::read(family, "nat")?;
            let stale: Vec<String> = containers_of(&table, network)
                .into_iter()
                .filter(|(_, id)| !containers.contains(id.as_str()))
                .map(|(chain, _)| chain)
                .collect();
            if let Some(input) = iptables::render_nat_removal(&table, &stale) {
                restore(family, &input)?;
            }
        }
        Ok(())
    }

    fn remove_network(&self, network: &str) -> Result<()> {
        for family in [Family::V4, Family::V6] {
            if exec::find(family.save()).is_none() {
                continue;
            }
            let table = iptables::read(family, "nat")?;
            let chains: Vec<String> = network_chains_of(&table, network).into_iter().collect();
            if let Some(input) = iptables::render_nat_removal(&table, &chains) {
                restore(family, &input)?;
            }
        }
        Ok(())
    }

    /// One `iptables-save -t nat` per family of `addresses`.
    fn missing(&self, network: &str, addresses: &[IpNetwork]) -> Result<Vec<String>> {
        let mut missing = Vec::new();
        for family in addresses.iter().map(Family::of).collect::<BTreeSet<_>>() {
            let table = iptables::read(family, "nat")?;
            missing.extend(network_missing(&table, family, network, addresses));
        }
        Ok(missing)
    }
}

/// What CHECK expects for `addresses`: each subnet's chain and jump.
/// Returns the rules that are missing.
pub fn network_missing(
    table: &SavedTable,
    family: Family,
    network: &str,
    addresses: &[IpNetwork],
) -> Vec<String> {
    let present: BTreeSet<&str> = table.rules.iter().map(|(_, line)| line.as_str()).collect();
    subnets_of(addresses)
        .into_iter()
        .filter(|subnet| Family::of(subnet) == family)
        .flat_map(|subnet| {
            render_network_setup(family, network, &subnet, true)
                .lines()
                .filter(|line| line.starts_with("-A ") && !present.contains(line))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNetwork {
        s.parse().expect("cidr")
    }

    #[test]
    fn chain_names_match_the_reference() {
        // sha512("cni-bridge" + "ctr1"), as Go's utils.FormatChainName cuts it.
        let name = chain_name("cni-bridge", "ctr1");
        assert_eq!(name.len(), 28);
        assert!(name.starts_with("CNI-"));
        let expected = {
            let out = std::process::Command::new("sh")
                .args(["-c", "printf %s cni-bridgectr1 | sha512sum | cut -c1-24"])
                .output()
                .expect("sha512sum");
            format!("CNI-{}", String::from_utf8_lossy(&out.stdout).trim())
        };
        assert_eq!(name, expected);
        assert_ne!(chain_name("cni-bridge", "ctr2"), name);
    }

    #[test]
    fn setup_renders_one_batch_per_family() {
        let addrs = [net("10.88.0.5/16"), net("fd88::5/64")];
        let v4 = render_setup(Family::V4, "cni-bridge", "ctr1", &addrs);
        let chain = chain_name("cni-bridge", "ctr1");
        let c = r#""name: \"cni-bridge\" id: \"ctr1\"""#;
        assert_eq!(
            v4,
            format!(
                "*nat\n:{chain} - [0:0]\n\
                 -A {chain} -d 10.88.0.0/16 -m comment --comment {c} -j ACCEPT\n\
                 -A {chain} ! -d 224.0.0.0/4 -m comment --comment {c} -j MASQUERADE\n\
                 -A POSTROUTING -s 10.88.0.5/32 -m comment --comment {c} -j {chain}\n\
                 COMMIT\n"
            )
        );
        let v6 = render_setup(Family::V6, "cni-bridge", "ctr1", &addrs);
        assert!(v6.contains("-d fd88::/64 -m comment"));
        assert!(v6.contains("! -d ff00::/8"));
        assert!(v6.contains("-A POSTROUTING -s fd88::5/128"));
        assert!(!v6.contains("10.88"));
    }

    #[test]
    fn two_addresses_of_one_family_share_the_chain() {
        let out = render_setup(Family::V4, "n", "c", &[net("10.1.0.5/24"), net("10.2.0.5/24")]);
        let accepts = out.lines().filter(|l| l.ends_with("-j ACCEPT")).count();
        let masq_at = out.lines().position(|l| l.ends_with("-j MASQUERADE"));
        assert_eq!(accepts, 2);
        assert_eq!(masq_at, Some(4), "every ACCEPT comes before the MASQUERADE");
        assert_eq!(out.lines().filter(|l| l.starts_with("-A POSTROUTING")).count(), 2);
    }

    const SAVED: &str = r#"# Generated by iptables-save v1.8.9 (nf_tables)
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:CNI-aaaaaaaaaaaaaaaaaaaaaaaa - [0:0]
:CNI-bbbbbbbbbbbbbbbbbbbbbbbb - [0:0]
-A POSTROUTING -s 10.88.0.5/32 -m comment --comment "name: \"net\" id: \"ctr-a\"" -j CNI-aaaaaaaaaaaaaaaaaaaaaaaa
-A POSTROUTING -s 10.88.0.5/16 -m comment --comment "name: \"net\" id: \"ctr-a\"" -j CNI-aaaaaaaaaaaaaaaaaaaaaaaa
-A POSTROUTING -s 10.88.0.6/32 -m comment --comment "name: \"net\" id: \"ctr-b\"" -j CNI-bbbbbbbbbbbbbbbbbbbbbbbb
-A CNI-aaaaaaaaaaaaaaaaaaaaaaaa -d 10.88.0.0/16 -m comment --comment "name: \"net\" id: \"ctr-a\"" -j ACCEPT
-A CNI-bbbbbbbbbbbbbbbbbbbbbbbb -d 10.88.0.0/16 -m comment --comment "name: \"net\" id: \"ctr-b\"" -j ACCEPT
COMMIT
*filter
:CNI-ignored - [0:0]
COMMIT
"#;

    #[test]
    fn parses_the_nat_table_only() {
        let t = SavedTable::parse(SAVED, "nat");
        assert!(t.chains.contains("CNI-aaaaaaaaaaaaaaaaaaaaaaaa"));
        assert!(!t.chains.contains("CNI-ignored"));
        assert_eq!(t.rules_of("POSTROUTING").count(), 3);
        let owners = containers_of(&t, "net");
        assert_eq!(
            owners.get("CNI-aaaaaaaaaaaaaaaaaaaaaaaa").map(String::as_str),
            Some("ctr-a")
        );
        assert_eq!(owners.len(), 2);
        assert!(containers_of(&t, "other").is_empty());
    }

    #[test]
    fn teardown_removes_every_jump_then_the_chain() {
        let t = SavedTable::parse(SAVED, "nat");
        let input = iptables::render_nat_removal(&t, &["CNI-aaaaaaaaaaaaaaaaaaaaaaaa".into()])
            .expect("something to remove");
        let lines: Vec<&str> = input.lines().collect();
        assert_eq!(lines[0], "*nat");
        assert!(lines[1].starts_with("-D POSTROUTING -s 10.88.0.5/32 "));
        assert!(
            lines[2].starts_with("-D POSTROUTING -s 10.88.0.5/16 "),
            "the legacy form goes too"
        );
        assert_eq!(
            &lines[3..],
            [
                "-F CNI-aaaaaaaaaaaaaaaaaaaaaaaa",
                "-X CNI-aaaaaaaaaaaaaaaaaaaaaaaa",
                "COMMIT"
            ]
        );
        assert!(!input.contains("ctr-b"));
        assert_eq!(
            iptables::render_nat_removal(&t, &["CNI-absent".into()]),
            None,
            "nothing there, nothing to run"
        );
    }

    #[test]
    fn a_subnet_gets_one_chain_and_one_jump() {
        let subnet = net("10.88.0.0/16");
        let chain = network_chain("cni-bridge", &net("10.88.0.5/16"));
        assert_eq!(
            chain,
            network_chain("cni-bridge", &subnet),
            "any address of the subnet names it"
        );
        assert_eq!(chain.len(), 28);
        assert!(chain.starts_with("CNI-NET-"));
        assert_ne!(chain, network_chain("other", &subnet));
        let c = r#""name: \"cni-bridge\" subnet: \"10.88.0.0/16\"""#;
        assert_eq!(
            render_network_setup(Family::V4, "cni-bridge", &subnet, true),
            format!(
                "*nat\n:{chain} - [0:0]\n\
                 -A {chain} -d 10.88.0.0/16 -m comment --comment {c} -j ACCEPT\n\
                 -A {chain} ! -d 224.0.0.0/4 -m comment --comment {c} -j MASQUERADE\n\
                 -A POSTROUTING -s 10.88.0.0/16 -m comment --comment {c} -j {chain}\n\
                 COMMIT\n"
            )
        );
        assert!(render_network_setup(Family::V6, "n", &net("fd88::/64"), true).contains("! -d ff00::/8"));
        assert!(!render_network_setup(Family::V4, "n", &subnet, false).contains("POSTROUTING"));
    }

    #[test]
    fn check_reports_missing_network_rules() {
        let addrs = [net("10.88.0.5/16"), net("10.88.0.6/16")];
        let complete = render_network_setup(Family::V4, "net", &net("10.88.0.0/16"), true);
        let table = SavedTable::parse(&complete, "nat");
        assert!(network_missing(&table, Family::V4, "net", &addrs).is_empty());
        assert_eq!(network_chains_of(&table, "net").len(), 1);
        assert!(network_chains_of(&table, "other").is_empty());
        let flushed: String = complete
            .lines()
            .filter(|l| !l.starts_with("-A CNI-NET-"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            network_chains_of(&SavedTable::parse(&flushed, "nat"), "net"),
            network_chains_of(&table, "net"),
            "a flushed chain is still found by its jump"
        );
        assert!(containers_of(&table, "net").is_empty(), "not a container's chain");
        let without_jump: String = complete
            .lines()
            .filter(|l| !l.starts_with("-A POSTROUTING"))
            .map(|l| format!("{l}\n"))
            .collect();
        let gaps = network_missing(
            &SavedTable::parse(&without_jump, "nat"),
            Family::V4,
            "net",
            &addrs,
        );
        assert_eq!(gaps.len(), 1);
        assert!(gaps[0].starts_with("-A POSTROUTING -s 10.88.0.0/16"));
    }

    fn save() -> SavedTable {
        let out = std::process::Command::new("iptables-save")
            .args(["-t", "nat"])
            .output()
            .expect("iptables-save");
        SavedTable::parse(&String::from_utf8_lossy(&out.stdout), "nat")
    }

    #[test]
    fn pods_share_the_subnet_chain_and_reference_chains_are_removed() {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                let pods = [net("10.88.0.5/16"), net("10.88.0.6/16"), net("fd88::5/64")];
                Iptables.ensure_network("net", &pods[..1]).expect("first pod");
                Iptables.ensure_network("net", &pods).expect("later pods");
                Iptables.ensure_network("net", &pods).expect("again");
                let table = save();
                assert_eq!(
                    table.rules_of("POSTROUTING").count(),
                    1,
                    "one jump for the v4 subnet"
                );
                assert!(network_missing(&table, Family::V4, "net", &pods).is_empty());
                // A pod the reference plugin set up.
                restore(
                    Family::V4,
                    &render_setup(Family::V4, "net", "ref-ctr", &pods[..1]),
                )
                .expect("reference rules");
                assert!(
                    iptables::chain_exists(Family::V4, "nat", &chain_name("net", "ref-ctr")).expect("asked")
                );
                assert!(
                    !Iptables
                        .teardown_container("net", "ours", "eth0", &[Family::V4, Family::V6])
                        .expect("nothing to do")
                );
                assert!(
                    Iptables
                        .teardown_container("net", "ref-ctr", "eth0", &[Family::V4, Family::V6])
                        .expect("removed")
                );
                let table = save();
                assert!(containers_of(&table, "net").is_empty());
                assert_eq!(
                    network_chains_of(&table, "net").len(),
                    1,
                    "the subnet chain stays"
                );
                Iptables.remove_network("net").expect("gc");
                assert!(network_chains_of(&save(), "net").is_empty());
                assert!(save().rules_of("POSTROUTING").next().is_none());
            });
        });
    }
}
