//! The one rule ambient mode puts on the node (Istio's host probe rule):
//! the node's own TCP to an enrolled pod (kubelet's probes) leaves with
//! the source [`PROBE_SNAT_V4`] (or its IPv6 twin), so the pod's in-pod
//! rules let it reach the app instead of ztunnel's inbound port. The
//! enrolled pods' addresses are a set the rule matches, each element
//! commented with its pod's UID, as Istio keeps them:
//!
//! - iptables (`ISTIO_POSTRT`, jumped to first from nat `POSTROUTING`,
//!   matching any local socket) with ipsets `istio-inpod-probes-v4`/`-v6`;
//! - native nftables: `inet istio-ambient-nat`'s `postrouting`, matching
//!   kubelet's UID, with the sets in that table.
//!
//! Each call runs `ipset`, `iptables-restore` or `nft` in the calling
//! thread's network namespace (the node's): run off the async threads.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use firewall::iptables::{self, SavedTable};
use firewall::{Family, exec, nfnl};
use istio_redirect::rules::ambient::{PROBE_SNAT_V4, PROBE_SNAT_V6};

use crate::changes::XTABLES_WAIT;

/// Istio's chain in the node's nat table.
pub const CHAIN: &str = "ISTIO_POSTRT";
/// Istio's table for the rule and its sets, with native nftables.
pub const TABLE: &str = "istio-ambient-nat";
const SET_COMMENT: &str = "UUID of the pods that are part of ambient mesh";

/// The set of enrolled pods' addresses of `family` (Istio's `ProbeIPSet`).
pub fn set_name(family: Family) -> &'static str {
    match family {
        Family::V4 => "istio-inpod-probes-v4",
        Family::V6 => "istio-inpod-probes-v6",
    }
}

fn snat_address(family: Family) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(PROBE_SNAT_V4),
        Family::V6 => IpAddr::V6(PROBE_SNAT_V6),
    }
}

fn family_of(ip: &IpAddr) -> Family {
    if ip.is_ipv4() { Family::V4 } else { Family::V6 }
}

/// The chain's rule for `family` as `iptables-save` prints it.
pub fn iptables_rule(family: Family) -> String {
    format!(
        "-A {CHAIN} -p tcp -m owner --socket-exists -m set --match-set {} dst -j SNAT --to-source {}",
        set_name(family),
        snat_address(family)
    )
}

const JUMP: &str = "-A POSTROUTING -j ISTIO_POSTRT";

/// The `iptables-restore --noflush` input that puts the chain in place in
/// `table` (the node's nat for `family`): its rule, and the one jump to it
/// first in POSTROUTING; None when it is so already.
pub fn iptables_input(family: Family, table: &SavedTable) -> Option<String> {
    let rule = iptables_rule(family);
    let postrouting: Vec<&str> = table.rules_of("POSTROUTING").collect();
    let in_place = table.chains.contains(CHAIN)
        && table.rules_of(CHAIN).collect::<Vec<_>>() == [rule.as_str()]
        && postrouting.first() == Some(&JUMP)
        && postrouting.iter().filter(|r| **r == JUMP).count() == 1;
    if in_place {
        return None;
    }
    // `:chain` creates the chain or empties it.
    let mut out = format!("*nat\n:{CHAIN} - [0:0]\n");
    for _ in postrouting.iter().filter(|r| **r == JUMP) {
        out.push_str("-D POSTROUTING -j ISTIO_POSTRT\n");
    }
    out.push_str(&format!("-I POSTROUTING 1 -j {CHAIN}\n{rule}\nCOMMIT\n"));
    Some(out)
}

/// The nft transaction that puts the table in place (Istio's, with the
/// sets it makes beforehand): the chain flushed and written again, the
/// sets' elements kept.
pub fn nft_transaction(kubelet_uid: u32, families: &[Family]) -> String {
    let mut out = format!("add table inet {TABLE}\nflush table inet {TABLE}\n");
    for family in families {
        let key = match family {
            Family::V4 => "ipv4_addr",
            Family::V6 => "ipv6_addr",
        };
        out.push_str(&format!(
            "add set inet {TABLE} {} {{ type {key} ; comment \"{SET_COMMENT}\" ; }}\n",
            set_name(*family)
        ));
    }
    out.push_str(&format!(
        "add chain inet {TABLE} postrouting {{ type nat hook postrouting priority 100 ; }}\n"
    ));
    for family in families {
        let ip = match family {
            Family::V4 => "ip",
            Family::V6 => "ip6",
        };
        out.push_str(&format!(
            "add rule inet {TABLE} postrouting meta l4proto tcp skuid {kubelet_uid} {ip} daddr @{} counter snat to {}\n",
            set_name(*family),
            snat_address(*family)
        ));
    }
    out
}

/// kubelet's UID, as Istio finds it: the first process named `kubelet`
/// (or MicroK8s' `kubelite`) whose command line names kubelet, or k3s';
/// None when there is none.
pub fn kubelet_uid(proc: &Path) -> Option<u32> {
    let entries = std::fs::read_dir(proc).ok()?;
    for entry in entries.flatten() {
        let dir = entry.path();
        if !entry
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        let named = match comm.trim_end() {
            "kubelet" | "kubelite" => std::fs::read(dir.join("cmdline")).is_ok_and(|cmdline| {
                String::from_utf8_lossy(&cmdline)
                    .to_lowercase()
                    .contains("kubelet")
            }),
            "k3s" => true,
            _ => false,
        };
        if !named {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).ok()?;
        return status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().next())
            .and_then(|uid| uid.parse().ok());
    }
    None
}

/// How the rule and its sets are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `ISTIO_POSTRT` in the node's iptables, ipsets beside it.
    Iptables,
    /// `inet istio-ambient-nat`, matching kubelet's UID.
    Nftables { kubelet_uid: u32 },
}

/// The rule, its sets, and which pod each address is there for.
#[derive(Debug, Clone)]
pub struct HostProbes {
    backend: Backend,
    families: Vec<Family>,
    /// Pod UID to its addresses in the sets.
    members: Arc<Mutex<BTreeMap<String, Vec<IpAddr>>>>,
}

impl HostProbes {
    pub fn new(backend: Backend, ipv6: bool) -> Self {
        let mut families = vec![Family::V4];
        if ipv6 {
            families.push(Family::V6);
        }
        HostProbes {
            backend,
            families,
            members: Arc::default(),
        }
    }

    fn members(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<IpAddr>>> {
        self.members.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts the sets and the rule in place (kept as they are when they
    /// already are); the sets' elements are left alone.
    pub fn install(&self) -> Result<(), String> {
        match self.backend {
            Backend::Nftables { kubelet_uid } => {
                nft(&["-f", "-"], &nft_transaction(kubelet_uid, &self.families)).map(drop)
            }
            Backend::Iptables => {
                let sets: String = self
                    .families
                    .iter()
                    .map(|family| {
                        let inet = if *family == Family::V4 { "inet" } else { "inet6" };
                        format!("create {} hash:ip family {inet} comment\n", set_name(*family))
                    })
                    .collect();
                ipset(&["restore", "-exist"], &sets)?;
                for family in &self.families {
                    let table = iptables::read(*family, "nat").map_err(|e| e.to_string())?;
                    if let Some(input) = iptables_input(*family, &table) {
                        exec::run(family.restore(), &["--noflush", XTABLES_WAIT], &input)
                            .map_err(|e| e.to_string())?;
                    }
                }
                Ok(())
            }
        }
    }

    /// The pod `uid`'s addresses in the sets (those of a family the node
    /// does not do are left out).
    pub fn add(&self, uid: &str, ips: &[IpAddr]) -> Result<(), String> {
        let ips: Vec<IpAddr> = ips
            .iter()
            .filter(|ip| self.families.contains(&family_of(ip)))
            .copied()
            .collect();
        self.write(&ips.iter().map(|ip| (*ip, uid.to_owned())).collect(), &[])?;
        self.members().insert(uid.to_owned(), ips);
        Ok(())
    }

    /// The pod `uid`'s addresses out of the sets, but for any another pod
    /// in the mesh holds now (an address reused before the first pod's
    /// delete was seen).
    pub fn remove(&self, uid: &str) {
        let gone: Vec<IpAddr> = {
            let mut members = self.members();
            let Some(ips) = members.remove(uid) else {
                return;
            };
            let held: BTreeSet<IpAddr> = members.values().flatten().copied().collect();
            ips.into_iter().filter(|ip| !held.contains(ip)).collect()
        };
        if let Err(e) = self.write(&BTreeMap::new(), &gone) {
            log::warn!("ambient: taking pod {uid}'s addresses out of the probe sets: {e}");
        }
    }

    /// The pods whose addresses are in the sets.
    pub fn uids(&self) -> Vec<String> {
        self.members().keys().cloned().collect()
    }

    /// [`HostProbes::remove`] on a blocking thread, not waited for (a pod
    /// gone for good: nothing of it comes back to race with it).
    pub fn remove_soon(&self, uid: &str) {
        let (probes, uid) = (self.clone(), uid.to_owned());
        tokio::task::spawn_blocking(move || probes.remove(&uid));
    }

    /// [`HostProbes::remove`] on a blocking thread, awaited (a pod whose
    /// next enrolment must not be undone by this one's removal).
    pub async fn remove_now(&self, uid: &str) {
        let (probes, uid) = (self.clone(), uid.to_owned());
        let _ = tokio::task::spawn_blocking(move || probes.remove(&uid)).await;
    }

    /// Makes the sets hold exactly `members`' addresses (an agent that
    /// restarted: pods gone meanwhile leave, pods restored stay).
    pub fn reconcile(&self, members: BTreeMap<String, Vec<IpAddr>>) -> Result<(), String> {
        let wanted: BTreeMap<IpAddr, String> = members
            .iter()
            .flat_map(|(uid, ips)| ips.iter().map(move |ip| (*ip, uid.clone())))
            .filter(|(ip, _)| self.families.contains(&family_of(ip)))
            .collect();
        let present = self.elements()?;
        let stale: Vec<IpAddr> = present
            .iter()
            .filter(|(ip, uid)| wanted.get(ip) != Some(uid))
            .map(|(ip, _)| *ip)
            .collect();
        let missing: BTreeMap<IpAddr, String> = wanted
            .into_iter()
            .filter(|(ip, uid)| present.get(ip) != Some(uid))
            .collect();
        self.write(&missing, &stale)?;
        *self.members() = members;
        Ok(())
    }

    /// The sets' elements: address and the UID in its comment.
    pub fn elements(&self) -> Result<BTreeMap<IpAddr, String>, String> {
        let mut out = BTreeMap::new();
        for family in &self.families {
            let set = set_name(*family);
            match self.backend {
                Backend::Iptables => {
                    let saved = ipset(&["list", set, "-output", "save"], "")?;
                    out.extend(ipset_elements(set, &saved));
                }
                Backend::Nftables { .. } => {
                    let listed = nft(&["-j", "list", "set", "inet", TABLE, set], "")?;
                    out.extend(nft_elements(&listed)?);
                }
            }
        }
        Ok(out)
    }

    /// Adds `add` (address and pod UID) and deletes `delete`, in one
    /// command.
    fn write(&self, add: &BTreeMap<IpAddr, String>, delete: &[IpAddr]) -> Result<(), String> {
        if add.is_empty() && delete.is_empty() {
            return Ok(());
        }
        match self.backend {
            Backend::Iptables => {
                let mut input = String::new();
                for ip in delete {
                    input.push_str(&format!("del {} {ip}\n", set_name(family_of(ip))));
                }
                for (ip, uid) in add {
                    input.push_str(&format!(
                        "add {} {ip} comment \"{uid}\"\n",
                        set_name(family_of(ip))
                    ));
                }
                ipset(&["restore", "-exist"], &input).map(drop)
            }
            Backend::Nftables { .. } => {
                // A delete of an element not there fails the transaction:
                // only what is there is deleted.
                let present = if delete.is_empty() {
                    BTreeMap::new()
                } else {
                    self.elements()?
                };
                let mut input = String::new();
                for ip in delete.iter().filter(|ip| present.contains_key(ip)) {
                    input.push_str(&format!(
                        "delete element inet {TABLE} {} {{ {ip} }}\n",
                        set_name(family_of(ip))
                    ));
                }
                for (ip, uid) in add {
                    input.push_str(&format!(
                        "add element inet {TABLE} {} {{ {ip} comment \"{uid}\" }}\n",
                        set_name(family_of(ip))
                    ));
                }
                if input.is_empty() {
                    return Ok(());
                }
                nft(&["-f", "-"], &input).map(drop)
            }
        }
    }
}

/// Takes the rule and its sets off the node, in whichever backend wrote
/// them (uninstall); what was removed, named.
pub fn remove_all() -> Result<Vec<String>, String> {
    let mut removed = Vec::new();
    for family in [Family::V4, Family::V6] {
        if !iptables::available(family) {
            continue;
        }
        let table = iptables::read(family, "nat").map_err(|e| e.to_string())?;
        if let Some(input) = iptables::render_nat_removal(&table, &[CHAIN.to_owned()]) {
            exec::run(family.restore(), &["--noflush", XTABLES_WAIT], &input).map_err(|e| e.to_string())?;
            removed.push(format!("{family:?} {CHAIN}"));
        }
    }
    // After the rules that match them.
    if exec::find("ipset").is_some() {
        let sets = ipset(&["list", "-n"], "")?;
        for family in [Family::V4, Family::V6] {
            let set = set_name(family);
            if sets.lines().any(|line| line == set) {
                ipset(&["destroy", set], "")?;
                removed.push(set.to_owned());
            }
        }
    }
    let deleted = nfnl::delete_table(nfnl::TableFamily::Inet, TABLE).map_err(|e| e.to_string())?;
    if deleted == nfnl::Deleted::Removed {
        removed.push(format!("inet {TABLE}"));
    }
    Ok(removed)
}

fn ipset(args: &[&str], input: &str) -> Result<String, String> {
    exec::run("ipset", args, input).map_err(|e| e.to_string())
}

fn nft(args: &[&str], input: &str) -> Result<String, String> {
    exec::run("nft", args, input).map_err(|e| e.to_string())
}

/// The elements of `ipset list <set> -output save`.
fn ipset_elements(set: &str, saved: &str) -> Vec<(IpAddr, String)> {
    saved
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("add ")?.strip_prefix(set)?.strip_prefix(' ')?;
            let (ip, comment) = rest.split_once(' ').unwrap_or((rest, ""));
            let uid = comment
                .strip_prefix("comment \"")
                .and_then(|c| c.strip_suffix('"'))
                .unwrap_or_default();
            Some((ip.parse().ok()?, uid.to_owned()))
        })
        .collect()
}

/// The elements of `nft -j list set`.
fn nft_elements(listed: &str) -> Result<Vec<(IpAddr, String)>, String> {
    let doc: serde_json::Value =
        serde_json::from_str(listed).map_err(|e| format!("nft's listing of a probe set: {e}"))?;
    let mut out = Vec::new();
    let sets = doc["nftables"].as_array().into_iter().flatten();
    for element in sets.filter_map(|item| item["set"]["elem"].as_array()).flatten() {
        // An element with a comment is an object; one without, the address.
        let (value, comment) = match element.get("elem") {
            Some(elem) => (&elem["val"], elem["comment"].as_str().unwrap_or_default()),
            None => (element, ""),
        };
        if let Some(ip) = value.as_str().and_then(|v| v.parse().ok()) {
            out.push((ip, comment.to_owned()));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iptables_rules_are_istios_as_iptables_save_prints_them() {
        // Istio's hostprobe goldens (cni/pkg/iptables/testdata) loaded with
        // iptables-restore and listed with iptables-save.
        for (family, saved) in [
            (Family::V4, include_str!("testdata/hostprobe.save")),
            (Family::V6, include_str!("testdata/hostprobe_ipv6.save")),
        ] {
            let table = SavedTable::parse(saved, "nat");
            assert_eq!(table.rules_of(CHAIN).collect::<Vec<_>>(), [iptables_rule(family)]);
            assert_eq!(
                iptables_input(family, &table),
                None,
                "in place as Istio writes it"
            );
        }
    }

    #[test]
    fn the_jump_is_put_first_once_and_the_chain_written_whole() {
        let saved = "*nat\n:POSTROUTING ACCEPT [0:0]\n:ISTIO_POSTRT - [0:0]\n\
                     -A POSTROUTING -j KUBE-POSTROUTING\n-A POSTROUTING -j ISTIO_POSTRT\n\
                     -A ISTIO_POSTRT -j RETURN\nCOMMIT\n";
        let input = iptables_input(Family::V4, &SavedTable::parse(saved, "nat")).expect("a change");
        assert_eq!(
            input,
            format!(
                "*nat\n:ISTIO_POSTRT - [0:0]\n-D POSTROUTING -j ISTIO_POSTRT\n\
                 -I POSTROUTING 1 -j ISTIO_POSTRT\n{}\nCOMMIT\n",
                iptables_rule(Family::V4)
            )
        );
    }

    #[test]
    fn nft_rules_are_istios_with_the_sets_istio_makes_first() {
        // Istio's nftables hostprobe goldens: our transaction without the
        // sets' declarations, which Istio runs in a transaction before.
        for (families, golden) in [
            (&[Family::V4][..], include_str!("testdata/hostprobe.nft")),
            (
                &[Family::V4, Family::V6][..],
                include_str!("testdata/hostprobe_ipv6.nft"),
            ),
        ] {
            let ours = nft_transaction(1000, families);
            let without_sets: Vec<&str> = ours.lines().filter(|l| !l.starts_with("add set")).collect();
            assert_eq!(without_sets, golden.lines().collect::<Vec<_>>());
            assert_eq!(
                ours.lines().filter(|l| l.starts_with("add set")).count(),
                families.len()
            );
        }
    }

    #[test]
    fn set_listings_are_read_with_their_pods() {
        let saved = "create istio-inpod-probes-v4 hash:ip family inet hashsize 1024 maxelem 65536 comment\n\
                     add istio-inpod-probes-v4 10.1.0.5 comment \"uid-a\"\n\
                     add istio-inpod-probes-v4 10.1.0.6\n";
        assert_eq!(
            ipset_elements("istio-inpod-probes-v4", saved),
            [
                ("10.1.0.5".parse().expect("ip"), "uid-a".to_owned()),
                ("10.1.0.6".parse().expect("ip"), String::new())
            ]
        );
        let listed = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"set": {"family": "inet",
            "name": "istio-inpod-probes-v6", "table": "istio-ambient-nat", "type": "ipv6_addr",
            "elem": [{"elem": {"val": "fd00::5", "comment": "uid-b"}}, "fd00::6"]}}]}"#;
        assert_eq!(
            nft_elements(listed).expect("parsed"),
            [
                ("fd00::5".parse().expect("ip"), "uid-b".to_owned()),
                ("fd00::6".parse().expect("ip"), String::new())
            ]
        );
    }

    #[test]
    fn kubelet_is_found_by_its_name_and_command_line() {
        let proc = tempfile::tempdir().expect("tempdir");
        let process = |pid: &str, comm: &str, cmdline: &[u8], uid: u32| {
            let dir = proc.path().join(pid);
            std::fs::create_dir_all(&dir).expect("mkdir");
            std::fs::write(dir.join("comm"), format!("{comm}\n")).expect("comm");
            std::fs::write(dir.join("cmdline"), cmdline).expect("cmdline");
            std::fs::write(
                dir.join("status"),
                format!("Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"),
            )
            .expect("status");
        };
        process("10", "bash", b"bash\0", 5);
        // Named kubelet, but no kubelet on its command line: not it.
        process("11", "kubelet", b"/bin/sleep\0", 6);
        assert_eq!(kubelet_uid(proc.path()), None);
        process("12", "kubelet", b"/usr/bin/kubelet\0--config=x\0", 1000);
        assert_eq!(kubelet_uid(proc.path()), Some(1000));
    }
}
