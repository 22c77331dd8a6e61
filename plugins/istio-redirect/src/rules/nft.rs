//! Istio's native nftables capture (`native_nftables`, Istio 1.27+): the
//! same decisions as the iptables rules, laid out as Istio lays them out in
//! its own `inet istio-proxy-nat`, `istio-proxy-mangle` and
//! `istio-proxy-raw` tables (both families in one table, rules in the order
//! Istio emits them), applied to the pod in one `nft -f` transaction.
//!
//! The first attempt `create`s the tables, so it fails as a whole when the
//! pod already has them; only then is the pod read. Comparing is done on
//! the kernel's own listing: the rules are loaded into a scratch namespace
//! and both listings compared, so nft's rewriting (`skuid` printed as
//! `meta skuid`, `/32` dropped, implied protocol matches folded) can never
//! make equal rules look different.

use std::collections::BTreeMap;

use firewall::{Error, Family, Result, exec, nfnl};
use ipnetwork::IpNetwork;
use netns::NetNs;

use super::backend::{CaptureBackend, Outcome};
use super::redirect::{
    DNS_PORT, INBOUND_PORT, Mode, OUTBOUND_PORT, Redirect, Selection, TPROXY_MARK, TUNNEL_PORT, cidr,
};

const NAT: &str = "istio-proxy-nat";
const MANGLE: &str = "istio-proxy-mangle";
const RAW: &str = "istio-proxy-raw";

pub(crate) type ChainDecl = (&'static str, Option<&'static str>);

/// Every chain a table may have, in the order Istio declares them; base
/// chains carry their hook.
const NAT_CHAINS: &[ChainDecl] = &[
    ("prerouting", Some("type nat hook prerouting priority -100 ;")),
    ("output", Some("type nat hook output priority -100 ;")),
    ("istio-inbound", None),
    ("istio-redirect", None),
    ("istio-in-redirect", None),
    ("istio-output", None),
    ("istio-output-dns", None),
];
const MANGLE_CHAINS: &[ChainDecl] = &[
    ("prerouting", Some("type filter hook prerouting priority -150 ;")),
    // A route chain: a mark set on output re-routes the packet, which the
    // TPROXY mark needs.
    ("output", Some("type route hook output priority -150 ;")),
    ("istio-divert", None),
    ("istio-tproxy", None),
    ("istio-inbound", None),
    ("istio-drop", None),
];
const RAW_CHAINS: &[ChainDecl] = &[
    ("prerouting", Some("type filter hook prerouting priority -300 ;")),
    ("output", Some("type filter hook output priority -300 ;")),
    ("istio-inbound", None),
    ("istio-output-dns", None),
];

/// One table's rules in the order they were made; `Some(index)` marks an
/// insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Table {
    name: &'static str,
    chains: &'static [ChainDecl],
    /// Every chain declared, used or not (Istio's ambient tables), rather
    /// than only those that get rules (its sidecar tables).
    declare_all: bool,
    rules: Vec<(&'static str, Option<usize>, String)>,
}

impl Table {
    fn new(name: &'static str, chains: &'static [ChainDecl]) -> Self {
        Table {
            name,
            chains,
            declare_all: false,
            rules: Vec::new(),
        }
    }

    /// A table whose chains are all declared whenever it has a rule.
    pub(crate) fn with_all_chains(name: &'static str, chains: &'static [ChainDecl]) -> Self {
        Table {
            declare_all: true,
            ..Table::new(name, chains)
        }
    }

    pub(crate) fn append(&mut self, chain: &'static str, rule: impl Into<String>) {
        self.rules.push((chain, None, rule.into()));
    }

    fn insert(&mut self, chain: &'static str, index: usize, rule: impl Into<String>) {
        self.rules.push((chain, Some(index), rule.into()));
    }

    /// Chain declarations and rule commands: only chains that get rules are
    /// declared (unless all are), and an insert at or past the chain's current end becomes
    /// an append (nft refuses an index that names no rule).
    fn commands(&self) -> Vec<String> {
        let t = self.name;
        let mut out: Vec<String> = self
            .chains
            .iter()
            .filter(|(chain, _)| self.declare_all || self.rules.iter().any(|(c, _, _)| c == chain))
            .map(|(chain, hook)| match hook {
                Some(hook) => format!("add chain inet {t} {chain} {{ {hook} }}"),
                None => format!("add chain inet {t} {chain}"),
            })
            .collect();
        let mut lengths: BTreeMap<&str, usize> = BTreeMap::new();
        for (chain, index, rule) in &self.rules {
            let length = lengths.entry(chain).or_default();
            out.push(match index {
                Some(i) if *i < *length => format!("insert rule inet {t} {chain} index {i} {rule}"),
                _ => format!("add rule inet {t} {chain} {rule}"),
            });
            *length += 1;
        }
        out
    }
}

/// A pod's capture in Istio's native nftables layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftCapture {
    /// Every table of the layout, those these settings leave empty too (a
    /// replacement removes them).
    tables: Vec<Table>,
}

impl NftCapture {
    pub(crate) fn new(tables: Vec<Table>) -> Self {
        NftCapture { tables }
    }

    fn used(&self) -> impl Iterator<Item = &Table> {
        self.tables.iter().filter(|t| !t.rules.is_empty())
    }

    fn names(&self) -> Vec<&'static str> {
        self.tables.iter().map(|t| t.name).collect()
    }

    /// The transaction as Istio writes it: each table added and flushed,
    /// then its chains and rules. Run on a pod that has the tables, it
    /// replaces their rules in one step.
    pub fn istio_transaction(&self) -> String {
        let mut out = String::new();
        for table in self.used() {
            out.push_str(&format!("add table inet {0}\nflush table inet {0}\n", table.name));
            push_lines(&mut out, table.commands());
        }
        out
    }

    /// For a pod without Istio tables: `create` fails if one exists, so a
    /// re-run is noticed instead of silently rewriting.
    pub fn fresh(&self) -> String {
        let mut out = String::new();
        for table in self.used() {
            out.push_str(&format!("create table inet {}\n", table.name));
            push_lines(&mut out, table.commands());
        }
        out
    }

    /// Replaces whatever tables of the layout the pod holds: all removed,
    /// then Istio's transaction, in one step. (Istio's flush alone would
    /// keep chains these settings no longer use, and tables they do not
    /// use at all.)
    pub fn replacement(&self) -> String {
        self.removal() + &self.istio_transaction()
    }

    /// Takes every table of the layout out; none there is no error.
    pub fn removal(&self) -> String {
        self.tables
            .iter()
            .map(|t| format!("add table inet {0}\ndelete table inet {0}\n", t.name))
            .collect()
    }
}

fn push_lines(out: &mut String, lines: Vec<String>) {
    for line in lines {
        out.push_str(&line);
        out.push('\n');
    }
}

/// The rules Istio's native nftables mode programs for `redirect`; `ipv6`
/// adds the IPv6 rules (Istio's "if supported" rules) to the same tables.
pub fn render_nft(redirect: &Redirect, ipv6: bool) -> NftCapture {
    let mut nat = Table::new(NAT, NAT_CHAINS);
    let mut mangle = Table::new(MANGLE, MANGLE_CHAINS);
    let mut raw = Table::new(RAW, RAW_CHAINS);
    let tproxy = redirect.mode == Mode::Tproxy;
    let owners = [("skuid", redirect.proxy_uid), ("skgid", redirect.proxy_gid)];
    // Include CIDRs split by family; `None` for `*`.
    let includes: Option<(Vec<&IpNetwork>, Vec<&IpNetwork>)> = match &redirect.include_cidrs {
        Selection::All => None,
        Selection::Only(list) => Some(list.iter().partition(|c| c.is_ipv4())),
    };
    let includes_loopback = includes
        .iter()
        .flat_map(|(v4, v6)| v4.iter().chain(v6))
        .any(|net| net.ip().is_loopback());

    for iface in &redirect.exclude_interfaces {
        nat.append("prerouting", format!("iifname {iface} return"));
        nat.append("output", format!("oifname {iface} return"));
    }
    if tproxy {
        for iface in &redirect.exclude_interfaces {
            mangle.append("prerouting", format!("iifname {iface} return"));
            mangle.append("output", format!("oifname {iface} return"));
        }
    }
    for iface in &redirect.reroute_interfaces {
        nat.insert("prerouting", 0, format!("iifname {iface} return"));
    }
    if redirect.invalid_drop {
        mangle.append("prerouting", "meta l4proto tcp ct state invalid jump istio-drop");
        mangle.append("istio-drop", "drop");
    }
    nat.append(
        "istio-inbound",
        format!("meta l4proto tcp tcp dport {TUNNEL_PORT} return"),
    );
    nat.append(
        "istio-redirect",
        format!("meta l4proto tcp redirect to :{OUTBOUND_PORT}"),
    );
    nat.append(
        "istio-in-redirect",
        format!("meta l4proto tcp redirect to :{INBOUND_PORT}"),
    );
    if redirect.captures_inbound() {
        inbound(redirect, ipv6, &mut nat, &mut mangle);
    }

    nat.append("output", "jump istio-output");
    for port in &redirect.exclude_outbound_ports {
        nat.append("istio-output", format!("tcp dport {port} return"));
        nat.append("istio-output", format!("udp dport {port} return"));
    }
    nat.append("istio-output", "oifname lo ip saddr 127.0.0.6/32 return");
    if ipv6 {
        nat.append("istio-output", "oifname lo ip6 saddr ::6/128 return");
    }
    for (key, id) in owners {
        // As in Istio: only the uid rule leaves DNS to the agent, and with
        // DNS capture its loopback RETURN matches the proxy's uid itself.
        let ports = if redirect.dns_capture && key == "skuid" {
            format!("{{ 53, {TUNNEL_PORT} }}")
        } else {
            TUNNEL_PORT.to_string()
        };
        nat.append(
            "istio-output",
            format!("oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 tcp dport != {ports} {key} {id} jump istio-in-redirect"),
        );
        if ipv6 {
            nat.append(
                "istio-output",
                format!("oifname lo meta l4proto tcp ip6 daddr != ::1/128 tcp dport != {ports} {key} {id} jump istio-in-redirect"),
            );
        }
        if !includes_loopback {
            let rule = match (redirect.dns_capture, key) {
                (true, "skuid") => format!("oifname lo meta l4proto tcp tcp dport != 53 {key} {id} return"),
                (true, _) => format!("oifname lo meta l4proto tcp tcp dport != 53 {key} != {id} return"),
                (false, _) => format!("oifname lo {key} != {id} return"),
            };
            nat.append("istio-output", rule);
        }
        nat.append("istio-output", format!("{key} {id} return"));
    }
    if redirect.dns_capture {
        dns(redirect, &mut nat, &mut raw);
    }
    nat.append("istio-output", "ip daddr 127.0.0.1/32 return");
    if ipv6 {
        nat.append("istio-output", "ip6 daddr ::1/128 return");
    }
    for net in redirect.exclude_cidrs.iter().filter(|c| c.is_ipv4()) {
        nat.append("istio-output", format!("ip daddr {} return", cidr(net)));
    }
    if ipv6 {
        for net in redirect.exclude_cidrs.iter().filter(|c| c.is_ipv6()) {
            nat.append("istio-output", format!("ip6 daddr {} return", cidr(net)));
        }
    }
    for port in &redirect.include_outbound_ports {
        nat.append("istio-output", format!("tcp dport {port} jump istio-redirect"));
    }
    match &includes {
        None => {
            nat.append("istio-output", "jump istio-redirect");
            for iface in &redirect.reroute_interfaces {
                nat.insert("prerouting", 0, format!("iifname {iface} jump istio-redirect"));
            }
        }
        Some((v4, v6)) => {
            let v6: &[&IpNetwork] = if ipv6 { v6 } else { &[] };
            for (matcher, nets) in [("ip", v4.as_slice()), ("ip6", v6)] {
                for net in nets {
                    let dst = format!("{matcher} daddr {}", cidr(net));
                    for iface in &redirect.reroute_interfaces {
                        nat.insert(
                            "prerouting",
                            0,
                            format!("iifname {iface} {dst} jump istio-redirect"),
                        );
                    }
                    nat.append("istio-output", format!("{dst} jump istio-redirect"));
                }
            }
        }
    }
    if tproxy {
        tproxy_marks(redirect, ipv6, &mut mangle);
    }
    NftCapture::new(vec![nat, mangle, raw])
}

/// Inbound capture: REDIRECT in nat, or TPROXY in mangle.
fn inbound(redirect: &Redirect, ipv6: bool, nat: &mut Table, mangle: &mut Table) {
    let tproxy = redirect.mode == Mode::Tproxy;
    if tproxy {
        mangle.append("istio-divert", format!("meta mark set {TPROXY_MARK}"));
        mangle.append("istio-divert", "accept");
        mangle.append(
            "istio-tproxy",
            format!("meta l4proto tcp ip daddr != 127.0.0.1/32 tproxy ip to :{INBOUND_PORT} meta mark set {TPROXY_MARK} accept"),
        );
        if ipv6 {
            mangle.append(
                "istio-tproxy",
                format!("meta l4proto tcp ip6 daddr != ::1/128 tproxy ip6 to :{INBOUND_PORT} meta mark set {TPROXY_MARK} accept"),
            );
        }
    }
    let table = if tproxy { mangle } else { nat };
    table.append("prerouting", "meta l4proto tcp jump istio-inbound");
    match &redirect.include_inbound_ports {
        Selection::All => {
            for port in &redirect.exclude_inbound_ports {
                table.append(
                    "istio-inbound",
                    format!("meta l4proto tcp tcp dport {port} return"),
                );
            }
            if tproxy {
                table.append(
                    "istio-inbound",
                    "meta l4proto tcp ct state related,established jump istio-divert",
                );
                table.append("istio-inbound", "meta l4proto tcp jump istio-tproxy");
            } else {
                table.append("istio-inbound", "meta l4proto tcp jump istio-in-redirect");
            }
        }
        Selection::Only(ports) => {
            for port in ports {
                if tproxy {
                    table.append(
                        "istio-inbound",
                        format!(
                            "meta l4proto tcp ct state related,established tcp dport {port} jump istio-divert"
                        ),
                    );
                    table.append(
                        "istio-inbound",
                        format!("meta l4proto tcp tcp dport {port} jump istio-tproxy"),
                    );
                } else {
                    table.append(
                        "istio-inbound",
                        format!("meta l4proto tcp tcp dport {port} jump istio-in-redirect"),
                    );
                }
            }
        }
    }
}

/// DNS capture without known servers (the CNI case): every port-53
/// request to the agent, and conntrack zones that keep the agent's
/// upstream queries apart from the pod's.
fn dns(redirect: &Redirect, nat: &mut Table, raw: &mut Table) {
    raw.append("output", "jump istio-output-dns");
    nat.append("istio-output", "jump istio-output-dns");
    nat.append(
        "istio-output-dns",
        format!("meta l4proto tcp tcp dport 53 redirect to :{DNS_PORT}"),
    );
    nat.append(
        "istio-output-dns",
        format!("udp dport 53 redirect to :{DNS_PORT}"),
    );
    for (key, id) in [("skuid", redirect.proxy_uid), ("skgid", redirect.proxy_gid)] {
        raw.append(
            "istio-output-dns",
            format!("udp dport 53 meta {key} {id} ct zone set 1"),
        );
        raw.append(
            "istio-output-dns",
            format!("udp sport {DNS_PORT} meta {key} {id} ct zone set 2"),
        );
    }
    raw.append("prerouting", "jump istio-inbound");
    raw.append("istio-output-dns", "udp dport 53 ct zone set 2");
    raw.append("istio-inbound", "udp sport 53 ct zone set 1");
}

/// TPROXY's marks: Envoy's outbound-to-inbound traffic marked 1338 so it
/// is not captured again, and the connection mark restored on output.
fn tproxy_marks(redirect: &Redirect, ipv6: bool, mangle: &mut Table) {
    let local_mark = TPROXY_MARK + 1;
    mangle.append(
        "prerouting",
        format!("meta l4proto tcp mark {TPROXY_MARK} ct mark set mark"),
    );
    mangle.append(
        "output",
        format!("oifname lo meta l4proto tcp mark {TPROXY_MARK} return"),
    );
    for (key, id) in [("skuid", redirect.proxy_uid), ("skgid", redirect.proxy_gid)] {
        mangle.append(
            "output",
            format!(
                "oifname lo meta l4proto tcp ip daddr != 127.0.0.1/32 {key} {id} meta mark set {local_mark}"
            ),
        );
        if ipv6 {
            mangle.append(
                "output",
                format!(
                    "oifname lo meta l4proto tcp ip6 daddr != ::1/128 {key} {id} meta mark set {local_mark}"
                ),
            );
        }
    }
    mangle.append(
        "output",
        format!("meta l4proto tcp ct mark {TPROXY_MARK} meta mark set ct mark"),
    );
    mangle.insert(
        "istio-inbound",
        0,
        format!("meta l4proto tcp mark {TPROXY_MARK} return"),
    );
    mangle.insert(
        "istio-inbound",
        1,
        "iifname lo meta l4proto tcp ip saddr 127.0.0.6/32 return",
    );
    if ipv6 {
        mangle.insert(
            "istio-inbound",
            1,
            "iifname lo meta l4proto tcp ip6 saddr ::6/128 return",
        );
    }
    mangle.insert(
        "istio-inbound",
        2,
        format!("iifname lo meta l4proto tcp mark != {local_mark} return"),
    );
}

/// `nft args` inside `ns`, with NSS hidden like the iptables tools.
fn nft(ns: &NetNs, args: &[&str], input: &str) -> Result<String> {
    let _inside = ns.enter().map_err(|e| Error::Invalid(e.to_string()))?;
    exec::run_with("nft", args, input, &[], true)
}

/// The pod's tables named `tables` as the kernel lists them (empty if
/// none); `-n` keeps ids as numbers, so no user lookup and both listings
/// alike.
fn istio_listing(ns: &NetNs, tables: &[&str]) -> Result<String> {
    let ruleset = nft(ns, &["-n", "list", "ruleset"], "")?;
    let mut out = String::new();
    let mut inside = false;
    for line in ruleset.lines() {
        let name = line
            .strip_prefix("table inet ")
            .and_then(|l| l.strip_suffix(" {"));
        if name.is_some_and(|name| tables.contains(&name)) {
            inside = true;
        }
        if inside {
            out.push_str(line);
            out.push('\n');
            if line == "}" {
                inside = false;
            }
        }
    }
    Ok(out)
}

/// Whether `ns` has one of Istio's tables with a rule in a hooked chain (a
/// capture in effect), asked over netlink: the agent's image has no `nft`.
pub fn has_istio_tables(ns: &NetNs) -> Result<bool> {
    let hooked = [(NAT, NAT_CHAINS), (MANGLE, MANGLE_CHAINS), (RAW, RAW_CHAINS)]
        .into_iter()
        .flat_map(|(table, chains)| {
            chains
                .iter()
                .filter(|(_, hook)| hook.is_some())
                .map(move |(chain, _)| (table, *chain))
        });
    ns.run(|| {
        for (table, chain) in hooked {
            if nfnl::rule_count(nfnl::TableFamily::Inet, table, chain)? > 0 {
                return Ok(true);
            }
        }
        Ok(false)
    })
    .map_err(|e| Error::Invalid(e.to_string()))?
}

/// How the kernel lists `capture`: loaded into a scratch namespace.
fn canonical(capture: &NftCapture) -> Result<String> {
    let scratch = NetNs::scratch().map_err(|e| Error::Invalid(e.to_string()))?;
    nft(&scratch, &["-f", "-"], &capture.fresh())?;
    istio_listing(&scratch, &capture.names())
}

/// Takes `capture`'s tables out of the pod in one transaction; whether
/// any was there.
pub fn remove_nft(ns: &NetNs, capture: &NftCapture) -> Result<bool> {
    let there = !istio_listing(ns, &capture.names())?.is_empty();
    if there {
        nft(ns, &["-f", "-"], &capture.removal())?;
    }
    Ok(there)
}

/// Programs `capture` in the pod (see the module docs).
pub fn apply_nft(ns: &NetNs, capture: &NftCapture) -> Result<Outcome> {
    let first = match nft(ns, &["-f", "-"], &capture.fresh()) {
        Ok(_) => return Ok(Outcome::Applied),
        Err(e) => e,
    };
    let current = istio_listing(ns, &capture.names())?;
    if current.is_empty() {
        return Err(first);
    }
    if current == canonical(capture)? {
        return Ok(Outcome::Unchanged);
    }
    nft(ns, &["-f", "-"], &capture.replacement()).map(|_| Outcome::Replaced)
}

/// Lines of the expected listing that the pod's Istio tables lack, each
/// with its table and chain.
pub fn missing_nft(ns: &NetNs, capture: &NftCapture) -> Result<Vec<String>> {
    let current = labelled(&istio_listing(ns, &capture.names())?);
    Ok(labelled(&canonical(capture)?)
        .into_iter()
        .filter(|line| !current.contains(line))
        .collect())
}

/// Each rule line of a listing prefixed with its table and chain, so equal
/// rules in different chains stay apart.
fn labelled(listing: &str) -> Vec<String> {
    let (mut table, mut chain) = ("", "");
    let mut out = Vec::new();
    for line in listing.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("table ") {
            table = rest.trim_end_matches(" {");
        } else if let Some(rest) = line.strip_prefix("chain ") {
            chain = rest.trim_end_matches(" {");
        } else if !line.is_empty() && line != "}" {
            out.push(format!("{table} {chain}: {line}"));
        }
    }
    out
}

/// Istio's native nftables tables, one transaction for both families.
#[derive(Debug, Clone, Copy)]
pub struct NftablesCapture;

impl CaptureBackend for NftablesCapture {
    fn program(
        &self,
        ns: &NetNs,
        redirect: &Redirect,
        families: &[Family],
    ) -> Result<Vec<(String, Outcome)>> {
        let capture = render_nft(redirect, families.contains(&Family::V6));
        Ok(vec![("nftables".to_owned(), apply_nft(ns, &capture)?)])
    }

    fn missing(&self, ns: &NetNs, redirect: &Redirect, families: &[Family]) -> Result<Vec<String>> {
        missing_nft(ns, &render_nft(redirect, families.contains(&Family::V6)))
    }
}

#[cfg(test)]
mod golden;
