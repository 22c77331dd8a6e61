//! Per-container masquerade, rule for rule as the reference bridge makes it
//! (so rules made by either are found and removed by the other):
//!
//! ```text
//! *nat
//! :CNI-<24 hex of sha512(network + containerID)> - [0:0]
//! -A CNI-… -d <pod subnet> -m comment --comment "name: \"<net>\" id: \"<id>\"" -j ACCEPT
//! -A CNI-… ! -d 224.0.0.0/4 -m comment --comment "…" -j MASQUERADE
//! -A POSTROUTING -s <pod ip>/32 -m comment --comment "…" -j CNI-…
//! COMMIT
//! ```
//!
//! The chain is named from the network and container alone, so DEL finds
//! everything without knowing the pod's addresses (runtimes send DEL with
//! an empty netns, and CRI's last DEL carries no prevResult).

use std::collections::{BTreeMap, BTreeSet};

use ipnetwork::IpNetwork;
use sha2::{Digest, Sha512};

use crate::{Family, Result, exec};

/// iptables chain names are at most 28 characters.
const MAX_CHAIN: usize = 28;

/// libcni utils' `FormatChainName`.
pub fn chain_name(network: &str, container_id: &str) -> String {
    let digest = Sha512::digest(format!("{network}{container_id}").as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let mut name = format!("CNI-{hex}");
    name.truncate(MAX_CHAIN);
    name
}

/// The comment every rule carries.
pub fn comment(network: &str, container_id: &str) -> String {
    format!("name: \"{network}\" id: \"{container_id}\"")
}

/// iptables-restore quoting: double quotes, with `"` and `\` escaped.
fn quote(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
}

fn network_of(net: &IpNetwork) -> String {
    format!("{}/{}", net.network(), net.prefix())
}

/// The `iptables-restore --noflush` input that sets up masquerade for the
/// addresses of one family. Declaring the chain empties it if it exists, so
/// the chain's rules are exactly these.
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

/// The nat table as `iptables-save -t nat` prints it: chains, and each
/// chain's rules as their `-A` lines.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatTable {
    pub chains: BTreeSet<String>,
    pub rules: Vec<(String, String)>,
}

impl NatTable {
    pub fn parse(save: &str) -> Self {
        let mut table = NatTable::default();
        let mut in_nat = false;
        for line in save.lines() {
            if let Some(name) = line.strip_prefix('*') {
                in_nat = name.trim() == "nat";
            } else if !in_nat {
                continue;
            } else if let Some(decl) = line.strip_prefix(':') {
                if let Some(chain) = decl.split_whitespace().next() {
                    table.chains.insert(chain.to_owned());
                }
            } else if let Some((chain, _)) = line.strip_prefix("-A ").and_then(|rule| rule.split_once(' ')) {
                table.rules.push((chain.to_owned(), line.to_owned()));
            }
        }
        table
    }

    /// Rules of `chain`.
    pub fn rules_of<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.rules
            .iter()
            .filter(move |(c, _)| c == chain)
            .map(|(_, line)| line.as_str())
    }

    /// POSTROUTING rules jumping to `chain` (whatever their match: the
    /// reference once wrote `-s ip/prefix`).
    fn jumps_to<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.rules_of("POSTROUTING")
            .filter(move |line| line.ends_with(&format!(" -j {chain}")))
    }

    /// The CNI chains of `network` and the container each belongs to, read
    /// from their comments.
    pub fn containers_of(&self, network: &str) -> BTreeMap<String, String> {
        let prefix = format!("--comment \"name: \\\"{network}\\\" id: \\\"");
        self.rules
            .iter()
            .filter(|(chain, _)| chain.starts_with("CNI-") && self.chains.contains(chain))
            .filter_map(|(chain, line)| {
                let rest = &line[line.find(&prefix)? + prefix.len()..];
                let id = &rest[..rest.find("\\\"")?];
                Some((chain.clone(), id.to_owned()))
            })
            .collect()
    }
}

/// The input that removes `chains` and every POSTROUTING jump to them, or
/// nothing when none of it exists.
pub fn render_teardown(table: &NatTable, chains: &[String]) -> Option<String> {
    let mut out = String::from("*nat\n");
    let mut any = false;
    for chain in chains {
        for jump in table.jumps_to(chain) {
            out.push_str(&jump.replacen("-A ", "-D ", 1));
            out.push('\n');
            any = true;
        }
    }
    for chain in chains.iter().filter(|c| table.chains.contains(*c)) {
        out.push_str(&format!("-F {chain}\n-X {chain}\n"));
        any = true;
    }
    out.push_str("COMMIT\n");
    any.then_some(out)
}

/// Reads the nat table of a family.
pub fn read_nat(family: Family) -> Result<NatTable> {
    exec::run(family.save(), &["-t", "nat"], "").map(|text| NatTable::parse(&text))
}

/// Applies an iptables-restore input atomically, without touching other
/// rules, waiting for the xtables lock.
pub fn restore(family: Family, input: &str) -> Result<()> {
    exec::run(family.restore(), &["--noflush", "--wait"], input).map(drop)
}

/// Sets up masquerade for a container's addresses, one batch per family.
pub fn setup(network: &str, container_id: &str, addresses: &[IpNetwork]) -> Result<()> {
    for family in families(addresses) {
        restore(family, &render_setup(family, network, container_id, addresses))?;
    }
    Ok(())
}

/// Removes a container's masquerade in the given families (both when DEL
/// cannot know which the pod had): one read and, if anything is there, one
/// batch each. Returns whether anything was removed.
pub fn teardown(network: &str, container_id: &str, families: &[Family]) -> Result<bool> {
    let chain = chain_name(network, container_id);
    let mut removed = false;
    for family in families {
        if exec::find(family.save()).is_none() {
            continue;
        }
        let table = read_nat(*family)?;
        if let Some(input) = render_teardown(&table, std::slice::from_ref(&chain)) {
            restore(*family, &input)?;
            removed = true;
        }
    }
    Ok(removed)
}

/// Removes the masquerade of every container of `network` not in `keep`.
/// Returns the containers whose rules were removed.
pub fn collect_garbage(network: &str, keep: &BTreeSet<String>) -> Result<BTreeSet<String>> {
    let mut removed = BTreeSet::new();
    for family in [Family::V4, Family::V6] {
        if exec::find(family.save()).is_none() {
            continue;
        }
        let table = read_nat(family)?;
        let stale: BTreeMap<String, String> = table
            .containers_of(network)
            .into_iter()
            .filter(|(_, id)| !keep.contains(id))
            .collect();
        let chains: Vec<String> = stale.keys().cloned().collect();
        if let Some(input) = render_teardown(&table, &chains) {
            restore(family, &input)?;
            removed.extend(stale.into_values());
        }
    }
    Ok(removed)
}

/// What CHECK expects: the chain with an ACCEPT per subnet and the
/// MASQUERADE rule, and a POSTROUTING jump per address. Returns what is
/// missing.
pub fn missing(
    table: &NatTable,
    family: Family,
    network: &str,
    container_id: &str,
    addresses: &[IpNetwork],
) -> Vec<String> {
    let expected = render_setup(family, network, container_id, addresses);
    let present: BTreeSet<&str> = table.rules.iter().map(|(_, line)| line.as_str()).collect();
    expected
        .lines()
        .filter(|line| line.starts_with("-A "))
        .filter(|line| !present.contains(line))
        .map(str::to_owned)
        .collect()
}

fn families(addresses: &[IpNetwork]) -> BTreeSet<Family> {
    addresses.iter().map(Family::of).collect()
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
        let t = NatTable::parse(SAVED);
        assert!(t.chains.contains("CNI-aaaaaaaaaaaaaaaaaaaaaaaa"));
        assert!(!t.chains.contains("CNI-ignored"));
        assert_eq!(t.rules_of("POSTROUTING").count(), 3);
        let owners = t.containers_of("net");
        assert_eq!(
            owners.get("CNI-aaaaaaaaaaaaaaaaaaaaaaaa").map(String::as_str),
            Some("ctr-a")
        );
        assert_eq!(owners.len(), 2);
        assert!(t.containers_of("other").is_empty());
    }

    #[test]
    fn teardown_removes_every_jump_then_the_chain() {
        let t = NatTable::parse(SAVED);
        let input =
            render_teardown(&t, &["CNI-aaaaaaaaaaaaaaaaaaaaaaaa".into()]).expect("something to remove");
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
            render_teardown(&t, &["CNI-absent".into()]),
            None,
            "nothing there, nothing to run"
        );
    }

    #[test]
    fn check_reports_missing_rules() {
        let addrs = [net("10.88.0.5/16")];
        let chain = chain_name("net", "ctr-x");
        let complete = render_setup(Family::V4, "net", "ctr-x", &addrs);
        let table = NatTable::parse(&complete);
        assert!(missing(&table, Family::V4, "net", "ctr-x", &addrs).is_empty());
        let without_jump: String = complete
            .lines()
            .filter(|l| !l.starts_with("-A POSTROUTING"))
            .map(|l| format!("{l}\n"))
            .collect();
        let gaps = missing(
            &NatTable::parse(&without_jump),
            Family::V4,
            "net",
            "ctr-x",
            &addrs,
        );
        assert_eq!(gaps.len(), 1);
        assert!(gaps[0].ends_with(&format!("-j {chain}")));
    }
}
