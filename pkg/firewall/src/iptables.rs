//! iptables as a mechanism, for every feature's rules: one reading of
//! `iptables-save` ([`SavedTable`]), one way to apply a batch
//! ([`restore`]), which flavour the node runs ([`uses_nf_tables`], decided
//! once per process), and the quoting and chain naming the reference
//! plugins share.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use ipnetwork::IpNetwork;
use sha2::{Digest, Sha512};

use crate::{Family, Result, exec, nfnl};

/// One table of `iptables-save` output: its chains, and each rule as the
/// chain it is in and its whole `-A <chain> <spec>` line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SavedTable {
    pub chains: BTreeSet<String>,
    pub rules: Vec<(String, String)>,
}

impl SavedTable {
    /// The `*<table>` section of `iptables-save` output.
    pub fn parse(save: &str, table: &str) -> Self {
        SavedTable::parse_all(save).remove(table).unwrap_or_default()
    }

    /// Every table of `iptables-save` output, by name.
    pub fn parse_all(save: &str) -> BTreeMap<String, Self> {
        let mut tables: BTreeMap<String, SavedTable> = BTreeMap::new();
        let mut current = None;
        for line in save.lines() {
            if let Some(name) = line.strip_prefix('*') {
                current = Some(tables.entry(name.trim().to_owned()).or_default());
            } else if let Some(saved) = current.as_deref_mut() {
                if let Some(decl) = line.strip_prefix(':') {
                    if let Some(chain) = decl.split_whitespace().next() {
                        saved.chains.insert(chain.to_owned());
                    }
                } else if let Some(rule) = line.strip_prefix("-A ") {
                    // A rule with no match and no target prints as its
                    // chain alone.
                    let chain = rule.split_once(' ').map_or(rule, |(chain, _)| chain);
                    saved.rules.push((chain.to_owned(), line.to_owned()));
                }
            }
        }
        tables
    }

    /// Adds a rule of `chain` from its spec, as `iptables-save` prints it
    /// after `-A <chain> ` (what a netlink dump renders).
    pub fn push_rule(&mut self, chain: &str, spec: &str) {
        self.rules.push((chain.to_owned(), format!("-A {chain} {spec}")));
    }

    /// The `-A` lines of `chain`.
    pub fn rules_of<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.rules
            .iter()
            .filter(move |(c, _)| c == chain)
            .map(|(_, line)| line.as_str())
    }

    /// The specs of `chain`'s rules: each line after `-A <chain> `.
    pub fn specs_of<'a>(&'a self, chain: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.rules_of(chain)
            .map(move |line| line.get(3 + chain.len() + 1..).unwrap_or_default())
    }

    /// Rules of `from` jumping to `chain`.
    pub fn jumps_from<'a>(&'a self, from: &'a str, chain: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.rules_of(from)
            .filter(move |line| line.ends_with(&format!(" -j {chain}")))
    }

    /// How many rules of `chain` have exactly `spec`.
    pub fn count(&self, chain: &str, spec: &str) -> usize {
        self.specs_of(chain).filter(|s| *s == spec).count()
    }

    pub fn has(&self, chain: &str, spec: &str) -> bool {
        self.count(chain, spec) > 0
    }
}

/// The input that removes `chains` and every POSTROUTING jump to them, or
/// nothing when none of it exists.
pub fn render_nat_removal(table: &SavedTable, chains: &[String]) -> Option<String> {
    let mut out = String::from("*nat\n");
    let mut any = false;
    for chain in chains {
        for jump in table.jumps_from("POSTROUTING", chain) {
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

/// Reads `table` of a family with `iptables-save`.
pub fn read(family: Family, table: &str) -> Result<SavedTable> {
    exec::run(family.save(), &["-t", table], "").map(|text| SavedTable::parse(&text, table))
}

/// Applies an iptables-restore input atomically, without touching other
/// rules, waiting for the xtables lock.
pub fn restore(family: Family, input: &str) -> Result<()> {
    exec::run(family.restore(), &["--noflush", "--wait"], input).map(drop)
}

/// Whether this family's tools are installed.
pub fn available(family: Family) -> bool {
    exec::find(family.restore()).is_some() && exec::find(family.save()).is_some()
}

/// Whether `iptables-restore` here is iptables-nft (rules in nf_tables,
/// which [`nfnl`] can read in-process) rather than iptables-legacy.
/// Decided once per process, from where the alternatives symlinks lead.
pub fn uses_nf_tables(family: Family) -> bool {
    static DECIDED: [OnceLock<bool>; 2] = [OnceLock::new(), OnceLock::new()];
    let slot = match family {
        Family::V4 => &DECIDED[0],
        Family::V6 => &DECIDED[1],
    };
    *slot.get_or_init(|| {
        exec::find(family.restore())
            .and_then(|tool| std::fs::canonicalize(tool).ok())
            .and_then(|real| real.file_name().map(|n| n.to_string_lossy().contains("nft")))
            .unwrap_or(false)
    })
}

/// Whether a chain of `table` exists: asked in-process with iptables-nft,
/// read with `iptables-save` with iptables-legacy.
pub fn chain_exists(family: Family, table: &str, chain: &str) -> Result<bool> {
    if uses_nf_tables(family) {
        nfnl::chain_exists(family.nf_table_family(), table, chain)
    } else {
        Ok(read(family, table)?.chains.contains(chain))
    }
}

/// iptables-restore quoting: double quotes, with `"` and `\` escaped.
pub fn quote(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A network as iptables prints it: its network address and prefix.
pub fn network_of(net: &IpNetwork) -> String {
    format!("{}/{}", net.network(), net.prefix())
}

/// libcni utils' `MustFormatChainNameWithPrefix`: `CNI-<prefix>` and the
/// hex of sha512(network + container ID), 28 characters in all.
pub fn prefixed_chain_name(prefix: &str, network: &str, container_id: &str) -> String {
    let digest = Sha512::digest(format!("{network}{container_id}").as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let mut name = format!("CNI-{prefix}{hex}");
    name.truncate(crate::MAX_CHAIN_NAME);
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_table_of_the_save_is_read() {
        let save = "*nat\n:CNI-X - [0:0]\n-A POSTROUTING -j CNI-X\nCOMMIT\n\
                    *filter\n:FORWARD DROP [0:0]\n:CNI-FORWARD - [0:0]\n\
                    -A CNI-FORWARD -s 10.0.0.1/32 -j ACCEPT\nCOMMIT\n";
        let filter = SavedTable::parse(save, "filter");
        assert!(filter.chains.contains("CNI-FORWARD") && !filter.chains.contains("CNI-X"));
        assert_eq!(
            filter.specs_of("CNI-FORWARD").collect::<Vec<_>>(),
            ["-s 10.0.0.1/32 -j ACCEPT"]
        );
        assert!(filter.has("CNI-FORWARD", "-s 10.0.0.1/32 -j ACCEPT"));
        let nat = SavedTable::parse(save, "nat");
        assert_eq!(
            nat.jumps_from("POSTROUTING", "CNI-X").collect::<Vec<_>>(),
            ["-A POSTROUTING -j CNI-X"]
        );
        let bare = SavedTable::parse("*filter\n:ISTIO_X - [0:0]\n-A ISTIO_X\nCOMMIT\n", "filter");
        assert_eq!(bare.rules_of("ISTIO_X").collect::<Vec<_>>(), ["-A ISTIO_X"]);
        assert_eq!(bare.specs_of("ISTIO_X").collect::<Vec<_>>(), [""]);
        let mut pushed = SavedTable::default();
        pushed.push_rule("CNI-FORWARD", "-s 10.0.0.1/32 -j ACCEPT");
        assert_eq!(pushed.rules, filter.rules);
    }

    #[test]
    fn chain_names_are_libcnis() {
        let name = prefixed_chain_name("DN-", "net", "abc");
        assert!(
            name.starts_with("CNI-DN-") && name.len() == crate::MAX_CHAIN_NAME,
            "{name}"
        );
        assert_eq!(quote(r#"a "b" \c"#), r#""a \"b\" \\c""#);
    }
}
