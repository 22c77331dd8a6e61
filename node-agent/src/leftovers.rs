//! What the suite leaves in a node's nat tables once no one uses it, and
//! its removal, for the node agent's uninstall: portmap's shared chains
//! (`CNI-HOSTPORT-DNAT`, `-SETMARK`, `-MASQ` and the jumps to them, which
//! the reference keeps forever) once no pod's chain is left, upstream
//! portmap's `cni_hostport` table once it holds no container's rule, and
//! the nat base chains and table iptables-nft made for the first rule
//! there (the agent's masquerade, portmap's jumps) once they are empty.
//!
//! What goes is judged against a [`Snapshot`] taken before the suite
//! changed anything: what was there before stays, even when empty. Both
//! iptables flavours are looked at (a runtime's portmap uses whichever its
//! PATH has, not the agent's), each with its own multi-binary; the nf_tables
//! parts (base chains, tables) are read and deleted in-process, since the
//! agent's image has no `nft`. x_tables cannot drop a table, only its user
//! chains.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use firewall::iptables::SavedTable;
use firewall::nfnl::{self, Deleted};
use firewall::{Error, Family, Result, exec};
use portmap::rules::iptables::{DNAT_CHAIN, MASQ_CHAIN, SETMARK_CHAIN};
use portmap::rules::nft as hostport_nft;

use crate::changes::XTABLES_WAIT;

/// The chains portmap makes once for every pod of the node.
const SHARED_CHAINS: [&str; 3] = [DNAT_CHAIN, SETMARK_CHAIN, MASQ_CHAIN];
/// A pod's own chains (`CNI-SN-` from releases before 0.7): while one is
/// left, the shared chains are in use.
const POD_CHAIN_PREFIXES: [&str; 2] = ["CNI-DN-", "CNI-SN-"];

/// The nat tables of one family, as they were.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tables {
    /// The chains, base and user, of iptables-nft's nat table (nf_tables'
    /// `ip nat` or `ip6 nat`); None when there was no such table.
    #[serde(default)]
    pub nft_nat: Option<BTreeSet<String>>,
    /// The chains of iptables-legacy's nat table; None when x_tables had
    /// not loaded it (or no tool could read it).
    #[serde(default)]
    pub legacy_nat: Option<BTreeSet<String>>,
    /// Whether upstream portmap's table `cni_hostport` existed.
    #[serde(default)]
    pub cni_hostport: bool,
}

/// The node's nat tables before the suite changed anything.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    #[serde(default)]
    pub ip: Tables,
    #[serde(default)]
    pub ip6: Tables,
}

impl Snapshot {
    pub fn of(&self, family: Family) -> &Tables {
        match family {
            Family::V4 => &self.ip,
            Family::V6 => &self.ip6,
        }
    }
}

/// One iptables flavour, run through its multi-binary so that both are
/// reached whichever one PATH's `iptables` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavour {
    Nft,
    Legacy,
}

impl Flavour {
    const ALL: [Flavour; 2] = [Flavour::Nft, Flavour::Legacy];

    fn multi(self) -> &'static str {
        match self {
            Flavour::Nft => "xtables-nft-multi",
            Flavour::Legacy => "xtables-legacy-multi",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Flavour::Nft => "iptables-nft",
            Flavour::Legacy => "iptables-legacy",
        }
    }

    fn read(self, family: Family) -> Result<SavedTable> {
        exec::run(self.multi(), &[family.save(), "-t", "nat"], "").map(|text| SavedTable::parse(&text, "nat"))
    }

    fn restore(self, family: Family, input: &str) -> Result<()> {
        exec::run(
            self.multi(),
            &[family.restore(), "--noflush", XTABLES_WAIT],
            input,
        )
        .map(drop)
    }

    /// The chains of this flavour's nat table, or None where it has none.
    /// Never loads x_tables' table: reading it would make it.
    fn nat_chains(self, family: Family) -> Result<Option<BTreeSet<String>>> {
        match self {
            Flavour::Nft => Ok(nfnl::chains(family.nf_table_family(), "nat")?
                .map(|chains| chains.into_iter().map(|chain| chain.name).collect())),
            Flavour::Legacy if legacy_nat_loaded(family) && exec::find(self.multi()).is_some() => {
                Ok(Some(self.read(family)?.chains))
            }
            Flavour::Legacy => Ok(None),
        }
    }
}

/// Whether x_tables has this network namespace's nat table of `family`.
fn legacy_nat_loaded(family: Family) -> bool {
    let names = match family {
        Family::V4 => "ip_tables_names",
        Family::V6 => "ip6_tables_names",
    };
    std::fs::read_to_string(format!("/proc/thread-self/net/{names}"))
        .is_ok_and(|text| text.lines().any(|line| line.trim() == "nat"))
}

fn tables(family: Family) -> Result<Tables> {
    Ok(Tables {
        nft_nat: Flavour::Nft.nat_chains(family)?,
        legacy_nat: Flavour::Legacy.nat_chains(family)?,
        cni_hostport: nfnl::table_exists(family.nf_table_family(), hostport_nft::TABLE)?,
    })
}

/// The node's nat tables now, read without changing anything.
pub fn snapshot() -> Result<Snapshot> {
    let _alone = lock_node()?;
    Ok(Snapshot {
        ip: tables(Family::V4)?,
        ip6: tables(Family::V6)?,
    })
}

/// portmap's ADDs, DELs and GCs hold the node's lock (the network
/// namespace's own), so no pod's chain appears while the shared ones go.
fn lock_node() -> Result<netns::NetNsLock> {
    netns::NetNs::current()
        .map_err(|e| Error::Invalid(e.to_string()))?
        .lock()
        .map_err(|e| Error::Invalid(format!("cannot lock the node's network namespace: {e}")))
}

/// portmap's shared chains of a nat table holding `now` that go: those not
/// there `before`, once no pod's chain is left.
pub fn unused_hostport_chains(now: &BTreeSet<String>, before: &BTreeSet<String>) -> Vec<String> {
    let pods_left = now
        .iter()
        .any(|chain| POD_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)));
    if pods_left {
        return Vec::new();
    }
    SHARED_CHAINS
        .iter()
        .filter(|chain| now.contains(**chain) && !before.contains(**chain))
        .map(|chain| (*chain).to_owned())
        .collect()
}

/// The iptables-restore input that removes `chains` and every rule of
/// another chain that jumps or goes to one of them, or None when none of
/// them exists.
pub fn render_removal(table: &SavedTable, chains: &[String]) -> Option<String> {
    let gone: BTreeSet<&str> = chains
        .iter()
        .map(String::as_str)
        .filter(|chain| table.chains.contains(*chain))
        .collect();
    if gone.is_empty() {
        return None;
    }
    let mut out = String::from("*nat\n");
    for (chain, rule) in &table.rules {
        let target = rule
            .rsplit_once(" -j ")
            .or_else(|| rule.rsplit_once(" -g "))
            .map(|(_, target)| target.trim());
        if !gone.contains(chain.as_str()) && target.is_some_and(|t| gone.contains(t)) {
            out.push_str(&rule.replacen("-A ", "-D ", 1));
            out.push('\n');
        }
    }
    for chain in &gone {
        out.push_str(&format!("-F {chain}\n"));
    }
    for chain in &gone {
        out.push_str(&format!("-X {chain}\n"));
    }
    out.push_str("COMMIT\n");
    Some(out)
}

/// The base chains among `now` that were not there `before`: those that
/// go once they are empty.
pub fn new_base_chains(now: &[nfnl::Chain], before: &BTreeSet<String>) -> Vec<String> {
    now.iter()
        .filter(|chain| chain.base && !before.contains(&chain.name))
        .map(|chain| chain.name.clone())
        .collect()
}

/// What [`remove_unused`] did: each thing removed, and each failure (the
/// other steps were still tried).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Removal {
    pub removed: Vec<String>,
    pub failed: Vec<String>,
}

impl Removal {
    fn note(&mut self, step: Result<Vec<String>>) {
        match step {
            Ok(removed) => self.removed.extend(removed),
            Err(e) => self.failed.push(e.to_string()),
        }
    }
}

/// Removes what the suite left in the nat tables that no one uses and
/// was not there `before`, holding the node's lock.
pub fn remove_unused(before: &Snapshot) -> Result<Removal> {
    let _alone = lock_node()?;
    let mut removal = Removal::default();
    for family in [Family::V4, Family::V6] {
        let was = before.of(family);
        for flavour in Flavour::ALL {
            let chains_before = match flavour {
                Flavour::Nft => &was.nft_nat,
                Flavour::Legacy => &was.legacy_nat,
            };
            removal.note(remove_hostport_chains(flavour, family, chains_before.as_ref()));
        }
        if !was.cni_hostport {
            removal.note(remove_hostport_table(family));
        }
        // Last: portmap's jumps were in these base chains.
        removal.note(remove_empty_nat(family, was.nft_nat.as_ref()));
    }
    Ok(removal)
}

fn remove_hostport_chains(
    flavour: Flavour,
    family: Family,
    before: Option<&BTreeSet<String>>,
) -> Result<Vec<String>> {
    let Some(now) = flavour.nat_chains(family)? else {
        return Ok(Vec::new());
    };
    let unused = unused_hostport_chains(&now, before.unwrap_or(&BTreeSet::new()));
    if unused.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(input) = render_removal(&flavour.read(family)?, &unused) {
        flavour.restore(family, &input)?;
    }
    let table = family.nf_table_family().keyword();
    Ok(unused
        .iter()
        .map(|chain| format!("{table} nat chain {chain} ({})", flavour.name()))
        .collect())
}

fn remove_hostport_table(family: Family) -> Result<Vec<String>> {
    let table_family = family.nf_table_family();
    if !nfnl::table_exists(table_family, hostport_nft::TABLE)?
        || !hostport_nft::containers(family)?.is_empty()
    {
        return Ok(Vec::new());
    }
    Ok(match nfnl::delete_table(table_family, hostport_nft::TABLE)? {
        Deleted::Removed => vec![format!(
            "table {} {}",
            table_family.keyword(),
            hostport_nft::TABLE
        )],
        Deleted::InUse | Deleted::Absent => Vec::new(),
    })
}

/// iptables-nft's nat base chains that are empty and were not there
/// `before`, then the table when it was not there and is empty. The
/// kernel refuses either while it holds anything, so a rule someone adds
/// meanwhile keeps it.
fn remove_empty_nat(family: Family, before: Option<&BTreeSet<String>>) -> Result<Vec<String>> {
    let table_family = family.nf_table_family();
    let keyword = table_family.keyword();
    let Some(now) = nfnl::chains(table_family, "nat")? else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for chain in new_base_chains(&now, before.unwrap_or(&BTreeSet::new())) {
        // Checked first too: a kernel older than `NLM_F_NONREC` would take
        // the rules along.
        if nfnl::rule_count(table_family, "nat", &chain)? == 0
            && nfnl::delete_empty_chain(table_family, "nat", &chain)? == Deleted::Removed
        {
            removed.push(format!("{keyword} nat chain {chain} (an empty base chain)"));
        }
    }
    let empty = nfnl::chains(table_family, "nat")?.is_some_and(|chains| chains.is_empty());
    if before.is_none() && empty && nfnl::delete_empty_table(table_family, "nat")? == Deleted::Removed {
        removed.push(format!("table {keyword} nat"));
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(program: &str, args: &[&str]) {
        let status = std::process::Command::new(program)
            .args(args)
            .status()
            .expect("runs");
        assert!(status.success(), "{program} {args:?}");
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    const SHARED: [&str; 3] = ["CNI-HOSTPORT-DNAT", "CNI-HOSTPORT-MASQ", "CNI-HOSTPORT-SETMARK"];

    #[test]
    fn shared_chains_go_once_no_pod_chain_is_left_unless_they_were_there_before() {
        let mut now = set(&SHARED);
        now.insert("POSTROUTING".into());
        let mut gone = unused_hostport_chains(&now, &set(&[]));
        gone.sort();
        assert_eq!(gone, SHARED);
        assert_eq!(
            unused_hostport_chains(&now, &set(&["CNI-HOSTPORT-DNAT", "POSTROUTING"])),
            ["CNI-HOSTPORT-SETMARK", "CNI-HOSTPORT-MASQ"],
            "the node's own stays"
        );
        for pod in ["CNI-DN-0123456789abcdef01234", "CNI-SN-0123456789abcdef01234"] {
            let mut with_pod = now.clone();
            with_pod.insert(pod.into());
            assert!(
                unused_hostport_chains(&with_pod, &set(&[])).is_empty(),
                "{pod} still uses them"
            );
        }
        assert!(unused_hostport_chains(&set(&["KUBE-SERVICES"]), &set(&[])).is_empty());
    }

    #[test]
    fn removal_takes_the_jumps_to_the_chains_and_nothing_else() {
        let table = SavedTable::parse(
            "*nat\n\
             :PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
             :CNI-HOSTPORT-DNAT - [0:0]\n:CNI-HOSTPORT-MASQ - [0:0]\n:CNI-HOSTPORT-SETMARK - [0:0]\n\
             -A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT\n\
             -A OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT\n\
             -A POSTROUTING -m comment --comment \"CNI portfwd requiring masquerade\" -j CNI-HOSTPORT-MASQ\n\
             -A POSTROUTING -s 192.0.2.0/24 -j MASQUERADE\n\
             -A CNI-HOSTPORT-MASQ -m mark --mark 0x2000/0x2000 -j MASQUERADE\n\
             -A CNI-HOSTPORT-SETMARK -m comment --comment \"CNI portfwd masquerade mark\" -j MARK --set-xmark 0x2000/0x2000\n\
             COMMIT\n",
            "nat",
        );
        let chains: Vec<String> = SHARED.iter().map(|c| (*c).to_owned()).collect();
        assert_eq!(
            render_removal(&table, &chains).expect("something to remove"),
            "*nat\n\
             -D PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT\n\
             -D OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT\n\
             -D POSTROUTING -m comment --comment \"CNI portfwd requiring masquerade\" -j CNI-HOSTPORT-MASQ\n\
             -F CNI-HOSTPORT-DNAT\n-F CNI-HOSTPORT-MASQ\n-F CNI-HOSTPORT-SETMARK\n\
             -X CNI-HOSTPORT-DNAT\n-X CNI-HOSTPORT-MASQ\n-X CNI-HOSTPORT-SETMARK\n\
             COMMIT\n"
        );
        let only_dnat = render_removal(&table, &["CNI-HOSTPORT-DNAT".to_owned()]).expect("dnat");
        assert!(!only_dnat.contains("MASQ"), "{only_dnat}");
        assert_eq!(
            render_removal(&SavedTable::default(), &chains),
            None,
            "none of them is there"
        );
    }

    #[test]
    fn only_base_chains_that_were_not_there_before_are_candidates() {
        let chain = |name: &str, base: bool| nfnl::Chain {
            name: name.to_owned(),
            base,
        };
        let now = [
            chain("PREROUTING", true),
            chain("POSTROUTING", true),
            chain("KUBE-POSTROUTING", false),
        ];
        assert_eq!(new_base_chains(&now, &set(&[])), ["PREROUTING", "POSTROUTING"]);
        assert_eq!(
            new_base_chains(&now, &set(&["POSTROUTING", "KUBE-POSTROUTING"])),
            ["PREROUTING"]
        );
    }

    #[test]
    fn a_snapshot_reads_back_and_an_absent_part_is_nothing() {
        let snapshot = Snapshot {
            ip: Tables {
                nft_nat: Some(set(&["POSTROUTING"])),
                legacy_nat: None,
                cni_hostport: true,
            },
            ip6: Tables::default(),
        };
        let text = serde_json::to_string(&snapshot).expect("serialized");
        assert_eq!(
            serde_json::from_str::<Snapshot>(&text).expect("read back"),
            snapshot
        );
        assert_eq!(
            serde_json::from_str::<Snapshot>("{}").expect("empty"),
            Snapshot::default()
        );
    }

    fn ruleset() -> String {
        let output = std::process::Command::new("nft")
            .args(["list", "ruleset"])
            .output()
            .expect("nft runs");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// portmap's layout written by iptables-nft into an empty namespace,
    /// then removed with everything it made; the node's own table stays.
    #[test]
    fn removes_what_was_made_after_the_snapshot_and_keeps_what_was_before() {
        let layout = "*nat\n:CNI-HOSTPORT-DNAT - [0:0]\n:CNI-HOSTPORT-SETMARK - [0:0]\n:CNI-HOSTPORT-MASQ - [0:0]\n\
             -A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT\n\
             -A OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT\n\
             -A POSTROUTING -m comment --comment \"CNI portfwd requiring masquerade\" -j CNI-HOSTPORT-MASQ\n\
             -A CNI-HOSTPORT-MASQ -m mark --mark 0x2000/0x2000 -j MASQUERADE\n\
             COMMIT\n";
        let load = |input: &str| {
            let mut child = std::process::Command::new("iptables-nft-restore")
                .arg("--noflush")
                .stdin(std::process::Stdio::piped())
                .spawn()
                .expect("iptables-nft-restore runs");
            std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), input.as_bytes())
                .expect("written");
            assert!(child.wait().expect("waited").success(), "{input}");
        };
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                let empty = snapshot().expect("snapshot");
                assert_eq!(empty, Snapshot::default());
                load(layout);
                run(
                    "nft",
                    &["add table ip cni_hostport; add chain ip cni_hostport hostports"],
                );
                let removal = remove_unused(&empty).expect("removed");
                assert!(removal.failed.is_empty(), "{removal:?}");
                assert_eq!(ruleset(), "", "{removal:?}");
                assert!(
                    removal.removed.contains(&"table ip nat".to_owned()),
                    "{removal:?}"
                );

                run(
                    "iptables-nft",
                    &[
                        "-t",
                        "nat",
                        "-A",
                        "POSTROUTING",
                        "-s",
                        "192.0.2.0/24",
                        "-j",
                        "MASQUERADE",
                    ],
                );
                let operators = ruleset();
                let before = snapshot().expect("snapshot");
                assert_eq!(before.ip.nft_nat, Some(set(&["POSTROUTING"])));
                load(layout);
                // A pod still has its chain: the shared ones stay for it.
                load("*nat\n:CNI-DN-0123456789abcdef01234 - [0:0]\nCOMMIT\n");
                let removal = remove_unused(&before).expect("removed");
                assert!(removal.removed.is_empty(), "{removal:?}");
                load("*nat\n-X CNI-DN-0123456789abcdef01234\nCOMMIT\n");
                let removal = remove_unused(&before).expect("removed");
                assert!(removal.failed.is_empty(), "{removal:?}");
                assert_eq!(ruleset(), operators, "{removal:?}");
            });
        });
    }

    #[test]
    fn iptables_legacy_loses_the_shared_chains_and_keeps_its_table() {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                let empty = snapshot().expect("snapshot");
                assert_eq!(empty.ip.legacy_nat, None, "not loaded, and not loaded by looking");
                run("iptables-legacy", &["-t", "nat", "-N", "CNI-HOSTPORT-DNAT"]);
                run(
                    "iptables-legacy",
                    &[
                        "-t",
                        "nat",
                        "-A",
                        "OUTPUT",
                        "-m",
                        "addrtype",
                        "--dst-type",
                        "LOCAL",
                        "-j",
                        "CNI-HOSTPORT-DNAT",
                    ],
                );
                run("iptables-legacy", &["-t", "nat", "-N", "OPERATORS"]);
                let removal = remove_unused(&empty).expect("removed");
                assert_eq!(
                    removal.removed,
                    ["ip nat chain CNI-HOSTPORT-DNAT (iptables-legacy)"]
                );
                let left = std::process::Command::new("iptables-legacy-save")
                    .args(["-t", "nat"])
                    .output()
                    .expect("runs");
                let left = String::from_utf8_lossy(&left.stdout);
                assert!(!left.contains("CNI-HOSTPORT"), "{left}");
                assert!(left.contains(":OPERATORS"), "not portmap's: {left}");
                assert_eq!(ruleset(), "", "nothing in nf_tables");
            });
        });
    }
}
