//! The nftables backend: our own table, the iptables layout's shape in
//! nftables, every rule commented so a pod's rules are found without its
//! addresses.
//!
//! ```text
//! table inet cni_firewall {
//!   chain admin { }
//!   chain forward {
//!     type filter hook forward priority filter; policy accept;
//!     jump isolation_stage_1 comment "CNI firewall plugin rules (ingressPolicy: same-bridge)"
//!     jump admin comment "CNI firewall plugin admin overrides"
//!     ip daddr <pod> ct state established,related accept comment "<pod's comment>"
//!     ip saddr <pod> accept comment "<pod's comment>"
//!   }
//!   chain isolation_stage_1 { iifname "<br>" oifname != "<br>" jump isolation_stage_2 comment "same-bridge: <br>" }
//!   chain isolation_stage_2 { oifname "<br>" drop comment "same-bridge: <br>" }
//! }
//! ```
//!
//! The pod's comment starts with the instance hash the bridge's nftables
//! masquerade uses (`<16 hex of the network>-<16 hex of ifname:container>`),
//! then the address and readable names. An nftables `accept` ends only the
//! base chain it is in: a drop in another table's forward hook (a node's
//! own `inet filter` with `policy drop`) still drops, which is how
//! nftables works; such a node lets the pods through in that table, or
//! uses the iptables backend. A `drop` (the isolation) is final everywhere.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::backend::{FirewallBackend, Pod, PodRules};
use super::chain_dump::{self, Rule};
use firewall::nfnl::TableFamily;
use firewall::nft::{fit_comment, instance_hash, network_hash};
use firewall::{Error, Result, exec};

pub const TABLE: &str = "cni_firewall";
const FORWARD: &str = "forward";
const ADMIN: &str = "admin";
const STAGE_1: &str = "isolation_stage_1";
const STAGE_2: &str = "isolation_stage_2";
const ADMIN_COMMENT: &str = "CNI firewall plugin admin overrides";
const ISOLATION_COMMENT: &str = "CNI firewall plugin rules (ingressPolicy: same-bridge)";

impl Pod<'_> {
    /// What every comment of the pod starts with.
    pub fn key(&self) -> String {
        format!("{},", instance_hash(self.network, self.ifname, self.container_id))
    }

    /// The comment of the pod's rules for `ip`.
    pub fn comment(&self, ip: IpAddr) -> String {
        let strip = |s: &str| s.replace(['"', '\\'], "");
        let text = format!(
            "{} ip: {ip}, net: {}, if: {}, id: {}",
            self.key(),
            strip(self.network),
            strip(self.ifname),
            strip(self.container_id)
        );
        fit_comment(text)
    }
}

fn bridge_comment(bridge: &str) -> String {
    format!("same-bridge: {bridge}")
}

/// What the table holds: each chain's rules, `None` for a chain (or the
/// table) that does not exist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    pub forward: Option<Vec<Rule>>,
    pub admin: bool,
    pub stage_1: Option<Vec<Rule>>,
    pub stage_2: Option<Vec<Rule>>,
}

fn count(rules: &Option<Vec<Rule>>, comment: &str) -> usize {
    rules
        .iter()
        .flatten()
        .filter(|r| r.comment.as_deref() == Some(comment))
        .count()
}

fn has(rules: &Option<Vec<Rule>>, comment: &str) -> bool {
    count(rules, comment) > 0
}

impl Table {
    /// Handles of the `forward` rules whose comment satisfies `wanted`.
    fn handles(&self, wanted: impl Fn(&str) -> bool) -> Vec<u64> {
        self.forward
            .iter()
            .flatten()
            .filter(|r| r.comment.as_deref().is_some_and(&wanted))
            .map(|r| r.handle)
            .collect()
    }
}

/// Reads the table in-process: one netlink dump per chain.
pub fn read(isolation: bool) -> Result<Table> {
    let dump = |chain| chain_dump::dump(TableFamily::Inet, TABLE, chain);
    let forward = dump(FORWARD)?;
    if forward.is_none() && !isolation {
        return Ok(Table::default());
    }
    Ok(Table {
        forward,
        admin: dump(ADMIN)?.is_some(),
        stage_1: if isolation { dump(STAGE_1)? } else { None },
        stage_2: if isolation { dump(STAGE_2)? } else { None },
    })
}

fn unique(ips: &[IpAddr]) -> Vec<IpAddr> {
    let mut seen = BTreeSet::new();
    ips.iter().copied().filter(|ip| seen.insert(*ip)).collect()
}

fn pod_rules(pod: &Pod, ip: IpAddr) -> [String; 2] {
    let family = if ip.is_ipv4() { "ip" } else { "ip6" };
    let comment = pod.comment(ip);
    [
        format!("{family} daddr {ip} ct state established,related accept comment \"{comment}\""),
        format!("{family} saddr {ip} accept comment \"{comment}\""),
    ]
}

/// The transaction that completes the pod's rules for `ips` and, with a
/// bridge, its isolation; `None` when nothing is missing. A pod whose
/// rules are incomplete gets them all again, its old ones deleted.
pub fn render_add(table: &Table, pod: &Pod, ips: &[IpAddr], bridge: Option<&str>) -> Option<String> {
    let t = format!("inet {TABLE}");
    let ips = unique(ips);
    let mut out = Vec::new();
    if table.forward.is_none() {
        out.push(format!("add table {t}"));
        out.push(format!(
            "add chain {t} {FORWARD} {{ type filter hook forward priority filter ; policy accept ; }}"
        ));
    }
    if !table.admin {
        out.push(format!("add chain {t} {ADMIN}"));
    }
    if !has(&table.forward, ADMIN_COMMENT) {
        out.push(format!(
            "insert rule {t} {FORWARD} jump {ADMIN} comment \"{ADMIN_COMMENT}\""
        ));
    }
    let complete = ips.iter().all(|ip| count(&table.forward, &pod.comment(*ip)) == 2)
        && table.handles(|c| c.starts_with(&pod.key())).len() == 2 * ips.len();
    if !complete {
        for handle in table.handles(|c| c.starts_with(&pod.key())) {
            out.push(format!("delete rule {t} {FORWARD} handle {handle}"));
        }
        for ip in &ips {
            out.extend(pod_rules(pod, *ip).map(|rule| format!("add rule {t} {FORWARD} {rule}")));
        }
    }
    if let Some(bridge) = bridge {
        let comment = bridge_comment(bridge);
        if table.stage_1.is_none() {
            out.push(format!("add chain {t} {STAGE_1}"));
        }
        if table.stage_2.is_none() {
            out.push(format!("add chain {t} {STAGE_2}"));
        }
        if !has(&table.forward, ISOLATION_COMMENT) {
            out.push(format!(
                "insert rule {t} {FORWARD} jump {STAGE_1} comment \"{ISOLATION_COMMENT}\""
            ));
        }
        if !has(&table.stage_1, &comment) {
            out.push(format!(
                "add rule {t} {STAGE_1} iifname \"{bridge}\" oifname != \"{bridge}\" jump {STAGE_2} comment \"{comment}\""
            ));
        }
        if !has(&table.stage_2, &comment) {
            out.push(format!(
                "add rule {t} {STAGE_2} oifname \"{bridge}\" drop comment \"{comment}\""
            ));
        }
    }
    (!out.is_empty()).then(|| format!("{}\n", out.join("\n")))
}

fn render_deletes(handles: Vec<u64>) -> Option<String> {
    let lines: Vec<String> = handles
        .into_iter()
        .map(|h| format!("delete rule inet {TABLE} {FORWARD} handle {h}\n"))
        .collect();
    (!lines.is_empty()).then(|| lines.concat())
}

/// The transaction that removes the pod's rules, or `None`.
pub fn render_del(table: &Table, pod: &Pod) -> Option<String> {
    render_deletes(table.handles(|c| c.starts_with(&pod.key())))
}

/// The transaction that removes the rules of `network`'s attachments not
/// in `keep` (`(container ID, ifname)`), or `None`.
pub fn render_gc(table: &Table, network: &str, keep: &BTreeSet<(String, String)>) -> Option<String> {
    let kept: BTreeSet<String> = keep
        .iter()
        .map(|(container_id, ifname)| {
            Pod {
                network,
                container_id,
                ifname,
            }
            .key()
        })
        .collect();
    let prefix = format!("{}-", network_hash(network));
    render_deletes(table.handles(|c| {
        let key = c.split_inclusive(',').next().unwrap_or_default();
        c.starts_with(&prefix) && !kept.contains(key)
    }))
}

/// What CHECK misses.
pub fn missing(table: &Table, pod: &Pod, ips: &[IpAddr], bridge: Option<&str>) -> Vec<String> {
    let mut missing = Vec::new();
    if table.forward.is_none() {
        missing.push(format!("chain inet {TABLE} {FORWARD}"));
    }
    if !table.admin {
        missing.push(format!("chain inet {TABLE} {ADMIN}"));
    }
    if !has(&table.forward, ADMIN_COMMENT) {
        missing.push(format!("jump {ADMIN}"));
    }
    for ip in unique(ips) {
        if count(&table.forward, &pod.comment(ip)) != 2 {
            missing.push(format!("rules of {ip}"));
        }
    }
    if let Some(bridge) = bridge {
        let comment = bridge_comment(bridge);
        for (ok, what) in [
            (has(&table.forward, ISOLATION_COMMENT), format!("jump {STAGE_1}")),
            (
                has(&table.stage_1, &comment),
                format!("{STAGE_1} rule of {bridge}"),
            ),
            (
                has(&table.stage_2, &comment),
                format!("{STAGE_2} rule of {bridge}"),
            ),
        ] {
            if !ok {
                missing.push(what);
            }
        }
    }
    missing
}

/// Whether `nft` is installed.
pub fn available() -> bool {
    exec::find("nft").is_some()
}

fn apply(transaction: &str) -> Result<()> {
    exec::run("nft", &["-f", "-"], transaction).map(drop)
}

/// Applies what `render` makes of a fresh read, reading once more when
/// the transaction fails (a handle deleted meanwhile by another DEL).
fn converge(isolation: bool, render: impl Fn(&Table) -> Option<String>) -> Result<bool> {
    let Some(transaction) = render(&read(isolation)?) else {
        return Ok(false);
    };
    if let Err(first) = apply(&transaction) {
        let Some(transaction) = render(&read(isolation)?) else {
            return Ok(true);
        };
        apply(&transaction).map_err(|_| first)?;
    }
    Ok(true)
}

/// Leaves the pod's rules and the isolation of `bridge` complete.
pub fn add(pod: &Pod, ips: &[IpAddr], bridge: Option<&str>) -> Result<bool> {
    if bridge.is_some_and(|b| b.contains(['"', '\\'])) {
        return Err(Error::Invalid(format!(
            "bridge name {bridge:?} cannot be written in nft"
        )));
    }
    converge(bridge.is_some(), |table| render_add(table, pod, ips, bridge))
}

/// Removes the pod's rules. Returns whether there were any.
pub fn del(pod: &Pod) -> Result<bool> {
    converge(false, |table| render_del(table, pod))
}

/// Removes the rules of `network`'s attachments not in `keep`.
pub fn gc(network: &str, keep: &BTreeSet<(String, String)>) -> Result<bool> {
    converge(false, |table| render_gc(table, network, keep))
}

/// What is missing of the pod's rules.
pub fn check(pod: &Pod, ips: &[IpAddr], bridge: Option<&str>) -> Result<Vec<String>> {
    read(bridge.is_some()).map(|table| missing(&table, pod, ips, bridge))
}

/// Our own `inet cni_firewall` table.
#[derive(Debug, Clone, Copy)]
pub struct Nftables;

impl FirewallBackend for Nftables {
    fn add(&self, rules: &PodRules) -> Result<()> {
        add(&rules.pod, rules.ips, rules.bridge).map(drop)
    }

    fn check(&self, rules: &PodRules) -> Result<Vec<String>> {
        check(&rules.pod, rules.ips, rules.bridge)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: Pod = Pod {
        network: "net",
        container_id: "ctr1",
        ifname: "eth0",
    };

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    fn rule(handle: u64, comment: &str) -> Rule {
        Rule {
            handle,
            comment: Some(comment.to_owned()),
            spec: None,
        }
    }

    /// The table `render_add` of an empty one leaves, handles from 1.
    fn after_add(pod: &Pod, ips: &[IpAddr]) -> Table {
        let mut forward = vec![rule(1, ADMIN_COMMENT)];
        for (n, ip) in unique(ips).into_iter().enumerate() {
            let handle = 2 + 2 * n as u64;
            forward.push(rule(handle, &pod.comment(ip)));
            forward.push(rule(handle + 1, &pod.comment(ip)));
        }
        Table {
            forward: Some(forward),
            admin: true,
            ..Table::default()
        }
    }

    #[test]
    fn the_first_pod_creates_the_table_in_one_transaction() {
        let ips = [ip("10.88.0.5"), ip("fd88::5")];
        let t = render_add(&Table::default(), &POD, &ips, None).expect("everything");
        let c4 = POD.comment(ips[0]);
        assert!(c4.starts_with(&format!(
            "{}, ip: 10.88.0.5, net: net, if: eth0, id: ctr1",
            instance_hash("net", "eth0", "ctr1")
        )));
        assert_eq!(
            t,
            format!(
                "add table inet cni_firewall\n\
                 add chain inet cni_firewall forward {{ type filter hook forward priority filter ; policy accept ; }}\n\
                 add chain inet cni_firewall admin\n\
                 insert rule inet cni_firewall forward jump admin comment \"CNI firewall plugin admin overrides\"\n\
                 add rule inet cni_firewall forward ip daddr 10.88.0.5 ct state established,related accept comment \"{c4}\"\n\
                 add rule inet cni_firewall forward ip saddr 10.88.0.5 accept comment \"{c4}\"\n\
                 add rule inet cni_firewall forward ip6 daddr fd88::5 ct state established,related accept comment \"{c6}\"\n\
                 add rule inet cni_firewall forward ip6 saddr fd88::5 accept comment \"{c6}\"\n",
                c6 = POD.comment(ips[1])
            )
        );
        let table = after_add(&POD, &ips);
        assert_eq!(render_add(&table, &POD, &ips, None), None, "complete: no process");
        assert!(missing(&table, &POD, &ips, None).is_empty());
    }

    #[test]
    fn an_incomplete_pod_is_written_again_and_del_and_gc_find_it_by_comment() {
        let ips = [ip("10.88.0.5")];
        let mut table = after_add(&POD, &ips);
        let other = Pod {
            container_id: "ctr2",
            ..POD
        };
        table
            .forward
            .get_or_insert_default()
            .push(rule(9, &other.comment(ip("10.88.0.6"))));
        table.forward.get_or_insert_default().remove(2);
        assert_eq!(missing(&table, &POD, &ips, None), ["rules of 10.88.0.5"]);
        let again = render_add(&table, &POD, &ips, None).expect("repair");
        assert!(
            again.starts_with("delete rule inet cni_firewall forward handle 2\nadd rule"),
            "{again}"
        );
        assert_eq!(
            render_del(&table, &POD).as_deref(),
            Some("delete rule inet cni_firewall forward handle 2\n")
        );
        let keep: BTreeSet<(String, String)> = [("ctr1".to_owned(), "eth0".to_owned())].into();
        assert_eq!(
            render_gc(&table, "net", &keep).as_deref(),
            Some("delete rule inet cni_firewall forward handle 9\n")
        );
        assert_eq!(render_gc(&table, "other-net", &BTreeSet::new()), None);
        assert_eq!(render_del(&Table::default(), &POD), None);
    }

    #[test]
    fn same_bridge_adds_its_chains_once_per_bridge() {
        let ips = [ip("10.1.0.2")];
        let t = render_add(&Table::default(), &POD, &ips, Some("cni-a")).expect("everything");
        let lines: Vec<&str> = t.lines().collect();
        let admin = lines
            .iter()
            .position(|l| l.contains("jump admin"))
            .expect("admin jump");
        let isolation = lines
            .iter()
            .position(|l| l.contains("jump isolation_stage_1"))
            .expect("jump");
        assert!(admin < isolation, "inserted later, so first in the chain");
        assert!(t.contains(
            "add rule inet cni_firewall isolation_stage_1 iifname \"cni-a\" oifname != \"cni-a\" jump isolation_stage_2 comment \"same-bridge: cni-a\"\n"
        ));
        assert!(t.contains("add rule inet cni_firewall isolation_stage_2 oifname \"cni-a\" drop comment \"same-bridge: cni-a\"\n"));
        let mut table = after_add(&POD, &ips);
        table
            .forward
            .get_or_insert_default()
            .push(rule(20, ISOLATION_COMMENT));
        table.stage_1 = Some(vec![rule(21, "same-bridge: cni-a")]);
        table.stage_2 = Some(vec![rule(22, "same-bridge: cni-a")]);
        assert_eq!(render_add(&table, &POD, &ips, Some("cni-a")), None);
        let b = render_add(&table, &POD, &ips, Some("cni-b")).expect("the other bridge");
        assert_eq!(b.lines().count(), 2, "{b}");
        assert_eq!(missing(&table, &POD, &ips, Some("cni-b")).len(), 2);
    }

    #[test]
    fn long_names_are_cut_to_what_nft_keeps() {
        let id = "c".repeat(64);
        let pod = Pod {
            network: "a-rather-long-network-name",
            container_id: &id,
            ifname: "eth0",
        };
        let comment = pod.comment(ip("fd00:1234:5678:9abc:def0:1234:5678:9abc"));
        assert_eq!(comment.len(), firewall::nft::COMMENT_MAX);
        assert!(comment.starts_with(&pod.key()));
    }

    #[test]
    fn add_check_del_and_gc_against_the_kernel() {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                let other = Pod {
                    container_id: "ctr2",
                    ..POD
                };
                let ips = [ip("10.1.0.2"), ip("fd00::2")];
                assert!(add(&POD, &ips, Some("cni-a")).expect("add"));
                assert!(
                    !add(&POD, &ips, Some("cni-a")).expect("rerun"),
                    "complete: nothing run"
                );
                assert!(add(&other, &[ip("10.1.0.3")], None).expect("add"));
                assert!(check(&POD, &ips, Some("cni-a")).expect("check").is_empty());
                assert!(del(&POD).expect("del"));
                assert!(!del(&POD).expect("del again"));
                assert_eq!(check(&POD, &ips, None).expect("check").len(), 2);
                assert!(check(&other, &[ip("10.1.0.3")], None).expect("check").is_empty());
                assert!(gc("net", &BTreeSet::new()).expect("gc"));
                let table = read(true).expect("read");
                assert_eq!(
                    table.forward.as_ref().map(Vec::len),
                    Some(2),
                    "the two jumps stay"
                );
            });
        });
    }
}
