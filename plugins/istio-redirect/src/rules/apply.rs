//! Programming a pod's capture rules: one `iptables-restore --noflush` per
//! family, run inside the pod's network namespace.
//!
//! The first attempt creates the ISTIO chains with `-N`, so it fails as a
//! whole if the pod already has them; only then is the pod's state read. If
//! it already holds exactly these rules nothing changes; if it holds other
//! Istio rules they are replaced in one transaction (Istio's plugin fails
//! there instead).

use std::collections::BTreeMap;

use firewall::iptables::SavedTable;
use firewall::{Error, Family, Result, exec};
use netns::NetNs;

use super::backend::{CaptureBackend, Outcome};
use super::redirect::Redirect;
use super::render::{IstioRules, render};

/// Which iptables flavour programs the pod. Not [`firewall::Backend`]:
/// these are always iptables rules (Istio's nftables are
/// `native_nftables`, [`super::nft`]), and the question is which iptables
/// binary, answered inside each pod's namespace rather than once per
/// process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IptablesFlavour {
    Legacy,
    Nft,
    /// Whatever `iptables-restore` is on the node.
    Default,
}

impl IptablesFlavour {
    /// An operator's override (Istio's `FORCE_IPTABLES_BINARY`); `auto`
    /// (or nothing) means detect.
    pub fn parse(text: &str) -> Result<Option<IptablesFlavour>> {
        match text {
            "" | "auto" => Ok(None),
            "legacy" => Ok(Some(IptablesFlavour::Legacy)),
            "nft" => Ok(Some(IptablesFlavour::Nft)),
            other => Err(Error::Invalid(format!(
                "unknown iptables backend {other:?}: expected auto, legacy or nft"
            ))),
        }
    }

    fn tool(self, family: Family, action: &str) -> String {
        let base = match family {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        };
        match self {
            IptablesFlavour::Legacy => format!("{base}-legacy-{action}"),
            IptablesFlavour::Nft => format!("{base}-nft-{action}"),
            IptablesFlavour::Default => format!("{base}-{action}"),
        }
    }
}

/// Istio's choice, made from inside the pod's namespace (the calling thread
/// must be in it): legacy only where legacy tables already exist there,
/// else iptables-nft when installed, else plain iptables. The legacy test
/// reads `/proc/thread-self/net/ip*_tables_names` instead of running
/// `iptables-legacy-save`: no process on the ADD path.
pub fn detect(family: Family) -> IptablesFlavour {
    if legacy_in_use(family) && exec::find(&IptablesFlavour::Legacy.tool(family, "restore")).is_some() {
        IptablesFlavour::Legacy
    } else if exec::find(&IptablesFlavour::Nft.tool(family, "restore")).is_some() {
        IptablesFlavour::Nft
    } else {
        IptablesFlavour::Default
    }
}

/// Whether the calling thread's namespace has x_tables (iptables-legacy)
/// tables of `family`.
fn legacy_in_use(family: Family) -> bool {
    let names = match family {
        Family::V4 => "ip_tables_names",
        Family::V6 => "ip6_tables_names",
    };
    std::fs::read_to_string(format!("/proc/thread-self/net/{names}"))
        .is_ok_and(|tables| !tables.trim().is_empty())
}

/// The flavours whose tables may hold the rules istio-redirect programmed
/// in `ns` for `family`: whatever [`detect`] or an operator's override
/// could have picked there. Legacy only where its tables exist (programming
/// legacy rules makes them exist); iptables-nft, or plain iptables where
/// iptables-nft is not installed (the agent's image has only the latter).
pub fn readable_flavours(ns: &NetNs, family: Family) -> Result<Vec<IptablesFlavour>> {
    let legacy = ns
        .run(|| legacy_in_use(family))
        .map_err(|e| Error::Invalid(e.to_string()))?;
    Ok(flavours_to_read(legacy, |flavour| {
        exec::find(&flavour.tool(family, "save")).is_some()
    }))
}

fn flavours_to_read(
    legacy_in_use: bool,
    installed: impl Fn(IptablesFlavour) -> bool,
) -> Vec<IptablesFlavour> {
    let mut flavours = Vec::new();
    if legacy_in_use && installed(IptablesFlavour::Legacy) {
        flavours.push(IptablesFlavour::Legacy);
    }
    if installed(IptablesFlavour::Nft) {
        flavours.push(IptablesFlavour::Nft);
    } else if installed(IptablesFlavour::Default) {
        flavours.push(IptablesFlavour::Default);
    }
    flavours
}

/// A pod's tables as `iptables-save` shows them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Saved {
    tables: BTreeMap<String, SavedTable>,
}

const BUILTIN: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// Rules in built-in chains that are Istio's: jumps to its chains, its
/// marks, and the per-interface RETURNs it puts in front.
fn istio_shaped(rule: &str) -> bool {
    let chain = rule.split_whitespace().nth(1).unwrap_or_default();
    if !BUILTIN.contains(&chain) {
        return rule
            .split_whitespace()
            .nth(1)
            .is_some_and(|c| c.starts_with("ISTIO"));
    }
    let words: Vec<&str> = rule.split_whitespace().collect();
    rule.contains(" -j ISTIO")
        || rule.contains("0x539")
        || rule.contains("0x53a")
        || (words.len() == 6 && matches!(words[2], "-i" | "-o") && rule.ends_with("-j RETURN"))
}

impl Saved {
    pub fn parse(save: &str) -> Self {
        Saved {
            tables: SavedTable::parse_all(save),
        }
    }

    fn istio_chains(&self, table: &str) -> Vec<&str> {
        self.tables
            .get(table)
            .map(|table| {
                table
                    .chains
                    .iter()
                    .filter(|c| c.starts_with("ISTIO"))
                    .map(String::as_str)
                    .collect()
            })
            .unwrap_or_default()
    }

    fn istio_rules(&self, table: &str) -> Vec<&str> {
        self.tables
            .get(table)
            .map(|table| {
                table
                    .rules
                    .iter()
                    .map(|(_, line)| line.as_str())
                    .filter(|r| istio_shaped(r))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn has_istio(&self) -> bool {
        self.tables
            .keys()
            .any(|t| !self.istio_chains(t).is_empty() || !self.istio_rules(t).is_empty())
    }

    /// Whether the pod holds exactly `rules`: same chains, same rules in the
    /// same order, and no other Istio table.
    pub fn holds_exactly(&self, rules: &IstioRules) -> bool {
        let tables: Vec<&str> = self
            .tables
            .keys()
            .map(String::as_str)
            .filter(|t| !self.istio_chains(t).is_empty() || !self.istio_rules(t).is_empty())
            .collect();
        let expected: Vec<&str> = rules.tables.iter().map(|t| t.name).collect();
        let same_tables =
            tables.iter().all(|t| expected.contains(t)) && expected.iter().all(|t| tables.contains(t));
        same_tables
            && rules.tables.iter().all(|t| {
                let mut chains = self.istio_chains(t.name);
                chains.sort_unstable();
                chains == t.chains
                    && self.istio_rules(t.name) == t.rules.iter().map(String::as_str).collect::<Vec<_>>()
            })
    }

    /// Expected rules that are not there.
    pub fn missing<'a>(&self, rules: &'a IstioRules) -> Vec<&'a str> {
        rules
            .lines()
            .filter(|(table, rule)| {
                !self
                    .tables
                    .get(*table)
                    .is_some_and(|present| present.rules.iter().any(|(_, p)| p == rule))
            })
            .map(|(_, rule)| rule)
            .collect()
    }

    /// One transaction that swaps whatever Istio rules the pod has for
    /// `rules`.
    pub fn replacement(&self, rules: &IstioRules) -> String {
        let mut names: std::collections::BTreeSet<&str> = rules.tables.iter().map(|t| t.name).collect();
        names.extend(
            self.tables
                .keys()
                .map(String::as_str)
                .filter(|t| !self.istio_chains(t).is_empty()),
        );
        let mut out = String::new();
        for name in names {
            let wanted = rules.tables.iter().find(|t| t.name == name);
            let wanted_chains: Vec<&str> = wanted.map(|t| t.chains.clone()).unwrap_or_default();
            out.push_str(&format!("*{name}\n"));
            for rule in self
                .istio_rules(name)
                .iter()
                .filter(|r| BUILTIN.contains(&r.split_whitespace().nth(1).unwrap_or_default()))
            {
                out.push_str(&rule.replacen("-A ", "-D ", 1));
                out.push('\n');
            }
            let stale: Vec<&str> = self
                .istio_chains(name)
                .into_iter()
                .filter(|c| !wanted_chains.contains(c))
                .collect();
            for chain in &stale {
                out.push_str(&format!("-F {chain}\n"));
            }
            for chain in &stale {
                out.push_str(&format!("-X {chain}\n"));
            }
            for chain in &wanted_chains {
                out.push_str(&format!(":{chain} - [0:0]\n"));
            }
            for rule in wanted.map(|t| t.rules.as_slice()).unwrap_or_default() {
                out.push_str(rule);
                out.push('\n');
            }
            out.push_str("COMMIT\n");
        }
        out
    }
}

/// Istio scopes the legacy xtables lock to the pod (the node's lock is
/// contended by kube-proxy); iptables-nft takes none.
fn lock_env(flavour: IptablesFlavour, ns: &NetNs) -> Vec<(&'static str, String)> {
    match flavour {
        IptablesFlavour::Legacy => vec![("XTABLES_LOCKFILE", ns.path().display().to_string())],
        _ => Vec::new(),
    }
}

fn run(
    ns: &NetNs,
    program: &str,
    args: &[&str],
    input: &str,
    env: &[(&'static str, String)],
) -> Result<String> {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let _inside = ns.enter().map_err(|e| Error::Invalid(e.to_string()))?;
    exec::run_with(program, args, input, &env, true)
}

fn restore_args(flavour: IptablesFlavour) -> Vec<&'static str> {
    match flavour {
        IptablesFlavour::Legacy => vec!["--noflush", "--wait"],
        _ => vec!["--noflush"],
    }
}

/// Reads the pod's tables.
pub fn read(ns: &NetNs, family: Family, flavour: IptablesFlavour) -> Result<Saved> {
    run(ns, &flavour.tool(family, "save"), &[], "", &lock_env(flavour, ns)).map(|text| Saved::parse(&text))
}

/// Programs `rules` for one family (see the module docs).
pub fn apply(ns: &NetNs, family: Family, rules: &IstioRules, flavour: IptablesFlavour) -> Result<Outcome> {
    let env = lock_env(flavour, ns);
    let restore = flavour.tool(family, "restore");
    let args = restore_args(flavour);
    let first = match run(ns, &restore, &args, &rules.restore_fresh(), &env) {
        Ok(_) => return Ok(Outcome::Applied),
        Err(e) => e,
    };
    let current = read(ns, family, flavour)?;
    if !current.has_istio() {
        return Err(first);
    }
    if current.holds_exactly(rules) {
        return Ok(Outcome::Unchanged);
    }
    run(ns, &restore, &args, &current.replacement(rules), &env).map(|_| Outcome::Replaced)
}

/// Takes every Istio rule out of the pod's tables for one family, in one
/// transaction; whether there was any.
pub fn remove(ns: &NetNs, family: Family, flavour: IptablesFlavour) -> Result<bool> {
    let current = read(ns, family, flavour)?;
    if !current.has_istio() {
        return Ok(false);
    }
    let restore = flavour.tool(family, "restore");
    let none = current.replacement(&IstioRules::default());
    run(
        ns,
        &restore,
        &restore_args(flavour),
        &none,
        &lock_env(flavour, ns),
    )
    .map(|_| true)
}

/// Picks the flavour for a family, entering the pod's namespace to look.
pub fn flavour_for(ns: &NetNs, family: Family, forced: Option<IptablesFlavour>) -> Result<IptablesFlavour> {
    if let Some(flavour) = forced {
        return Ok(flavour);
    }
    ns.run(|| detect(family))
        .map_err(|e| Error::Invalid(e.to_string()))
}

/// Istio's iptables rules, one restore per family.
#[derive(Debug, Clone, Copy)]
pub struct IptablesCapture {
    /// The operator's flavour; None: the one found in the pod.
    pub forced: Option<IptablesFlavour>,
}

impl CaptureBackend for IptablesCapture {
    fn program(
        &self,
        ns: &NetNs,
        redirect: &Redirect,
        families: &[Family],
    ) -> Result<Vec<(String, Outcome)>> {
        let mut outcomes = Vec::new();
        for family in families {
            let flavour = flavour_for(ns, *family, self.forced)?;
            outcomes.push((
                format!("{family:?}"),
                apply(ns, *family, &render(redirect, *family), flavour)?,
            ));
            cni::fault::pause("istio-redirect:first-family");
        }
        Ok(outcomes)
    }

    fn missing(&self, ns: &NetNs, redirect: &Redirect, families: &[Family]) -> Result<Vec<String>> {
        let mut missing = Vec::new();
        for family in families {
            let rules = render(redirect, *family);
            let saved = read(ns, *family, flavour_for(ns, *family, self.forced)?)?;
            missing.extend(saved.missing(&rules).into_iter().map(str::to_owned));
        }
        Ok(missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{Mode, Redirect, render};

    fn saved_from(rules: &IstioRules) -> String {
        let mut out = String::new();
        for t in &rules.tables {
            out.push_str(&format!(
                "*{}\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n",
                t.name
            ));
            for c in &t.chains {
                out.push_str(&format!(":{c} - [0:0]\n"));
            }
            for r in &t.rules {
                out.push_str(r);
                out.push('\n');
            }
            out.push_str("COMMIT\n");
        }
        out
    }

    #[test]
    fn exact_rules_are_recognised() {
        let rules = render(&Redirect::default(), Family::V4);
        let saved = Saved::parse(&saved_from(&rules));
        assert!(saved.has_istio());
        assert!(saved.holds_exactly(&rules));
        assert!(saved.missing(&rules).is_empty());
        let other = render(
            &Redirect {
                dns_capture: true,
                ..Redirect::default()
            },
            Family::V4,
        );
        assert!(!saved.holds_exactly(&other));
        assert!(!saved.missing(&other).is_empty());
        assert!(!Saved::parse("*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n").has_istio());
    }

    #[test]
    fn replacement_swaps_old_istio_rules_in_one_transaction() {
        let old = render(
            &Redirect {
                mode: Mode::Tproxy,
                ..Redirect::default()
            },
            Family::V4,
        );
        let new = render(&Redirect::default(), Family::V4);
        let text = Saved::parse(&saved_from(&old)).replacement(&new);
        // The old mangle table: its jumps go, its chains are emptied and removed.
        let mangle = &text[..text.find("*nat").expect("nat follows")];
        assert!(mangle.starts_with("*mangle\n-D PREROUTING -p tcp -j ISTIO_INBOUND\n"));
        assert!(mangle.contains("-D OUTPUT -o lo -p tcp -m mark --mark 0x539 -j RETURN"));
        assert!(mangle.contains("-F ISTIO_TPROXY\n") && mangle.contains("-X ISTIO_TPROXY\n"));
        // nat: the old OUTPUT jump is removed before the chains are redeclared.
        let nat = &text[text.find("*nat").expect("nat")..];
        assert!(nat.starts_with("*nat\n-D OUTPUT -j ISTIO_OUTPUT\n:ISTIO_INBOUND - [0:0]\n"));
        assert!(nat.contains("-A PREROUTING -p tcp -j ISTIO_INBOUND\n"));
    }

    #[test]
    fn foreign_rules_in_builtin_chains_are_left_alone() {
        assert!(!istio_shaped("-A POSTROUTING -s 10.0.0.0/8 -j MASQUERADE"));
        assert!(istio_shaped("-A PREROUTING -i eth9 -j RETURN"));
        assert!(istio_shaped("-A OUTPUT -j ISTIO_OUTPUT"));
        assert!(istio_shaped("-A ISTIO_OUTPUT -j ISTIO_REDIRECT"));
    }

    #[test]
    fn rules_are_looked_for_wherever_the_plugin_could_have_put_them() {
        let all = |_: IptablesFlavour| true;
        assert_eq!(flavours_to_read(false, all), [IptablesFlavour::Nft]);
        assert_eq!(
            flavours_to_read(true, all),
            [IptablesFlavour::Legacy, IptablesFlavour::Nft]
        );
        let plain_only = |flavour: IptablesFlavour| flavour == IptablesFlavour::Default;
        assert_eq!(flavours_to_read(true, plain_only), [IptablesFlavour::Default]);
        assert!(flavours_to_read(true, |_| false).is_empty());
    }

    #[test]
    fn backend_overrides() {
        assert_eq!(IptablesFlavour::parse("auto").expect("valid"), None);
        assert_eq!(
            IptablesFlavour::parse("legacy").expect("valid"),
            Some(IptablesFlavour::Legacy)
        );
        assert!(IptablesFlavour::parse("nope").is_err());
        assert_eq!(
            IptablesFlavour::Legacy.tool(Family::V6, "restore"),
            "ip6tables-legacy-restore"
        );
        assert_eq!(IptablesFlavour::Default.tool(Family::V4, "save"), "iptables-save");
    }
}
