//! The reference plugin's iptables layout, in the nat table of each family:
//!
//! ```text
//! -A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
//! -A OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
//! -A POSTROUTING -m comment --comment "CNI portfwd requiring masquerade" -j CNI-HOSTPORT-MASQ   (first)
//! -A CNI-HOSTPORT-DNAT -p tcp -m comment --comment "dnat name: \"<net>\" id: \"<id>\"" -m multiport --dports 8080,9090 -j CNI-DN-<hash>
//! -A CNI-DN-<hash> -s <pod subnet> -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK   (hairpin)
//! -A CNI-DN-<hash> -s 127.0.0.1/32 -p tcp -m tcp --dport 8080 -j CNI-HOSTPORT-SETMARK  (IPv4 localhost)
//! -A CNI-DN-<hash> -p tcp -m tcp --dport 8080 -j DNAT --to-destination <pod>:80
//! -A CNI-HOSTPORT-SETMARK -m comment --comment "CNI portfwd masquerade mark" -j MARK --set-xmark 0x2000/0x2000
//! -A CNI-HOSTPORT-MASQ -m mark --mark 0x2000/0x2000 -j MASQUERADE
//! ```
//!
//! Rules are rendered in `iptables-save`'s own form, so what is written can
//! be compared with what is read. Each ADD and DEL is one
//! `iptables-restore --noflush` per family; what already exists is asked
//! in-process with iptables-nft, read with `iptables-save` otherwise.

use std::collections::BTreeSet;
use std::net::IpAddr;

use firewall::iptables::{self, SavedTable, network_of, quote};
use firewall::{Family, Result, nfnl};

use super::{DEFAULT_MARK_BIT, Forward, Mapping, Pod, PortMapper, Protocol, Settings, ip_port};

pub const DNAT_CHAIN: &str = "CNI-HOSTPORT-DNAT";
pub const SETMARK_CHAIN: &str = "CNI-HOSTPORT-SETMARK";
pub const MASQ_CHAIN: &str = "CNI-HOSTPORT-MASQ";
/// Where releases before 0.7 jumped to a per-container `CNI-SN-` chain;
/// still looked for on DEL, as the reference does.
pub const OLD_SNAT_CHAIN: &str = "CNI-HOSTPORT-SNAT";

const MASQ_JUMP_COMMENT: &str = "CNI portfwd requiring masquerade";
const SETMARK_COMMENT: &str = "CNI portfwd masquerade mark";
/// multiport takes at most 15 ports per rule.
const MULTIPORT_MAX: usize = 15;
/// iptables' comment limit.
const COMMENT_MAX: usize = 255;

/// The pod's own chain.
pub fn container_chain(network: &str, container_id: &str) -> String {
    iptables::prefixed_chain_name("DN-", network, container_id)
}

fn old_snat_chain(network: &str, container_id: &str) -> String {
    iptables::prefixed_chain_name("SN-", network, container_id)
}

/// The comment on a pod's jump rules; the reference cuts it at 253 bytes
/// and adds "...".
pub fn comment(network: &str, container_id: &str) -> String {
    let mut text = format!("dnat name: \"{network}\" id: \"{container_id}\"");
    if text.len() > COMMENT_MAX {
        let mut cut = COMMENT_MAX - 2;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str("...");
    }
    text
}

fn local_jump(entry: &str) -> String {
    format!("-A {entry} -m addrtype --dst-type LOCAL -j {DNAT_CHAIN}")
}

fn masq_jump() -> String {
    format!(
        "-A POSTROUTING -m comment --comment {} -j {MASQ_CHAIN}",
        quote(MASQ_JUMP_COMMENT)
    )
}

fn setmark_rule(settings: &Settings) -> String {
    format!(
        "-A {SETMARK_CHAIN} -m comment --comment {} -j MARK --set-xmark {}",
        quote(SETMARK_COMMENT),
        settings.mark()
    )
}

fn masq_rule(settings: &Settings) -> String {
    format!("-A {MASQ_CHAIN} -m mark --mark {} -j MASQUERADE", settings.mark())
}

/// Our own chains for marking and masquerading, unless another chain
/// marks.
fn owns_masquerade(settings: &Settings) -> bool {
    settings.snat && settings.external_set_mark_chain.is_none()
}

/// A condition's words for iptables-restore, which splits on blanks and
/// honours double quotes.
fn restore_words(words: &[String]) -> String {
    words
        .iter()
        .map(|w| {
            if w.is_empty() || w.contains(|c: char| c.is_whitespace() || c == '"') {
                quote(w)
            } else {
                w.clone()
            }
        })
        .map(|w| format!(" {w}"))
        .collect()
}

/// The jumps from `CNI-HOSTPORT-DNAT` to the pod's chain: one per protocol
/// and 15 ports, for every mapping (the reference does not filter these by
/// family), protocols in name order.
pub fn jump_rules(
    family: Family,
    settings: &Settings,
    network: &str,
    container_id: &str,
    mappings: &[Mapping],
) -> Vec<String> {
    let chain = container_chain(network, container_id);
    let comment = quote(&comment(network, container_id));
    let conditions = restore_words(settings.conditions(family));
    let protocols: BTreeSet<Protocol> = mappings.iter().map(|m| m.protocol).collect();
    let mut rules = Vec::new();
    for protocol in protocols {
        let ports: Vec<String> = mappings
            .iter()
            .filter(|m| m.protocol == protocol)
            .map(|m| m.host_port.to_string())
            .collect();
        for group in ports.chunks(MULTIPORT_MAX) {
            rules.push(format!(
                "-A {DNAT_CHAIN} -p {} -m comment --comment {comment} -m multiport --dports {}{conditions} -j {chain}",
                protocol.name(),
                group.join(",")
            ));
        }
    }
    rules
}

/// The rules of the pod's chain: per mapping of this family, the hairpin
/// and localhost marks (with `snat`), then the DNAT.
pub fn chain_rules(pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Vec<String> {
    let family = pod.family();
    let chain = container_chain(pod.network, pod.container_id);
    let set_mark = settings
        .external_set_mark_chain
        .as_deref()
        .unwrap_or(SETMARK_CHAIN);
    let mut rules = Vec::new();
    for mapping in mappings.iter().filter(|m| m.applies_to(family)) {
        let destination = mapping
            .destination()
            .map(|ip| format!(" -d {ip}/{}", family.host_prefix()))
            .unwrap_or_default();
        let name = mapping.protocol.name();
        let port = format!(" -p {name} -m {name} --dport {}", mapping.host_port);
        if settings.snat {
            // iptables-save leaves out a source of 0.0.0.0/0 or ::/0.
            let hairpin = if settings.masq_all {
                String::new()
            } else {
                format!(" -s {}", network_of(&pod.address))
            };
            rules.push(format!("-A {chain}{hairpin}{destination}{port} -j {set_mark}"));
            if family == Family::V4 && !settings.masq_all {
                rules.push(format!(
                    "-A {chain} -s 127.0.0.1/32{destination}{port} -j {set_mark}"
                ));
            }
        }
        rules.push(format!(
            "-A {chain}{destination}{port} -j DNAT --to-destination {}",
            ip_port(pod.address.ip(), mapping.container_port)
        ));
    }
    rules
}

/// What of the layout a family's nat table already has.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Present {
    pub dnat_chain: bool,
    pub prerouting_jump: bool,
    pub output_jump: bool,
    pub setmark_chain: bool,
    pub setmark_rule: bool,
    pub masq_chain: bool,
    pub masq_rule: bool,
    pub masq_jump: bool,
    pub container_chain: bool,
    /// The jumps to the pod's chain there already (a repeated ADD), as
    /// `iptables-save` prints them.
    pub container_jumps: Vec<String>,
}

impl Present {
    pub fn read(table: &SavedTable, settings: &Settings, chain: &str) -> Self {
        let has = |line: &str| table.rules.iter().any(|(_, rule)| rule == line);
        Present {
            dnat_chain: table.chains.contains(DNAT_CHAIN),
            prerouting_jump: has(&local_jump("PREROUTING")),
            output_jump: has(&local_jump("OUTPUT")),
            setmark_chain: table.chains.contains(SETMARK_CHAIN),
            setmark_rule: has(&setmark_rule(settings)),
            masq_chain: table.chains.contains(MASQ_CHAIN),
            masq_rule: has(&masq_rule(settings)),
            masq_jump: has(&masq_jump()),
            container_chain: table.chains.contains(chain),
            container_jumps: table.jumps_from(DNAT_CHAIN, chain).map(str::to_owned).collect(),
        }
    }

    /// Asked in-process (iptables-nft only): `None` when that cannot
    /// decide, that is when the pod's chain exists already (its jumps must
    /// be read whole to be replaced) or the mark is not the default one
    /// (a rule's mark is not told apart in-process).
    fn probe(family: Family, settings: &Settings, chain: &str) -> Result<Option<Self>> {
        if !iptables::uses_nf_tables(family) || settings.mark_bit != DEFAULT_MARK_BIT {
            return Ok(None);
        }
        let table = family.nf_table_family();
        let exists = |name: &str| nfnl::chain_exists(table, "nat", name);
        let mentions = |name: &str, text: &str| -> Result<bool> {
            Ok(nfnl::rules_mentioning(table, "nat", name, text)? > 0)
        };
        if exists(chain)? {
            return Ok(None);
        }
        let masq_chain = exists(MASQ_CHAIN)?;
        Ok(Some(Present {
            dnat_chain: exists(DNAT_CHAIN)?,
            prerouting_jump: mentions("PREROUTING", DNAT_CHAIN)?,
            output_jump: mentions("OUTPUT", DNAT_CHAIN)?,
            setmark_chain: exists(SETMARK_CHAIN)?,
            setmark_rule: mentions(SETMARK_CHAIN, SETMARK_COMMENT)?,
            masq_chain,
            masq_rule: masq_chain && nfnl::rule_count(table, "nat", MASQ_CHAIN)? > 0,
            masq_jump: mentions("POSTROUTING", MASQ_JUMP_COMMENT)?,
            container_chain: false,
            container_jumps: Vec::new(),
        }))
    }
}

/// The iptables-restore input of an ADD: what the shared chains lack, the
/// pod's chain written whole, its jumps replaced. Shared chains are made
/// with `-N`, which fails rather than empties a chain that another plugin
/// made meanwhile.
pub fn render_add(present: &Present, pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> String {
    let family = pod.family();
    let chain = container_chain(pod.network, pod.container_id);
    let mut out = format!("*nat\n:{chain} - [0:0]\n");
    let mut line = |text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    if !present.dnat_chain {
        line(format!("-N {DNAT_CHAIN}"));
    }
    if !present.prerouting_jump {
        line(local_jump("PREROUTING"));
    }
    if !present.output_jump {
        line(local_jump("OUTPUT"));
    }
    if owns_masquerade(settings) {
        if !present.setmark_chain {
            line(format!("-N {SETMARK_CHAIN}"));
        }
        if !present.setmark_rule {
            line(setmark_rule(settings));
        }
        if !present.masq_chain {
            line(format!("-N {MASQ_CHAIN}"));
        }
        if !present.masq_rule {
            line(masq_rule(settings));
        }
        if !present.masq_jump {
            // First in POSTROUTING: the bridge's and ptp's masquerade
            // rules would otherwise take the packet first.
            line(masq_jump().replacen("-A POSTROUTING", "-I POSTROUTING 1", 1));
        }
    }
    for old in &present.container_jumps {
        line(old.replacen("-A ", "-D ", 1));
    }
    for rule in chain_rules(pod, settings, mappings) {
        line(rule);
    }
    for rule in jump_rules(family, settings, pod.network, pod.container_id, mappings) {
        line(rule);
    }
    out.push_str("COMMIT\n");
    out
}

/// Removes the pod's chain and the jumps to it as rendered from its
/// mappings (what the runtime sends again on DEL).
pub fn render_remove_known(
    family: Family,
    settings: &Settings,
    network: &str,
    container_id: &str,
    mappings: &[Mapping],
) -> String {
    let chain = container_chain(network, container_id);
    let mut out = String::from("*nat\n");
    for rule in jump_rules(family, settings, network, container_id, mappings) {
        out.push_str(&rule.replacen("-A ", "-D ", 1));
        out.push('\n');
    }
    out.push_str(&format!("-F {chain}\n-X {chain}\nCOMMIT\n"));
    out
}

/// Removes the pod's chains (and an old release's `CNI-SN-` chain) with
/// every jump to them, as read; `None` when there is nothing.
pub fn render_remove(table: &SavedTable, network: &str, container_id: &str) -> Option<String> {
    let pairs = [
        (DNAT_CHAIN, container_chain(network, container_id)),
        (OLD_SNAT_CHAIN, old_snat_chain(network, container_id)),
    ];
    let mut out = String::from("*nat\n");
    let mut any = false;
    for (entry, chain) in &pairs {
        for jump in table.jumps_from(entry, chain) {
            out.push_str(&jump.replacen("-A ", "-D ", 1));
            out.push('\n');
            any = true;
        }
    }
    for (_, chain) in pairs.iter().filter(|(_, c)| table.chains.contains(c)) {
        out.push_str(&format!("-F {chain}\n-X {chain}\n"));
        any = true;
    }
    out.push_str("COMMIT\n");
    any.then_some(out)
}

/// The forwards a pod's chain holds, read from its DNAT rules.
pub fn forwards_in(table: &SavedTable, chain: &str) -> Vec<Forward> {
    table
        .rules_of(chain)
        .filter_map(|rule| {
            let words: Vec<&str> = rule.split_whitespace().collect();
            let after = |flag: &str| {
                words
                    .iter()
                    .position(|w| *w == flag)
                    .and_then(|i| words.get(i + 1))
            };
            let protocol = Protocol::parse(after("-p")?).ok()?;
            let host_port = after("--dport")?.parse().ok()?;
            let (ip, port) = after("--to-destination")?.rsplit_once(':')?;
            Some(Forward {
                protocol,
                host_port,
                pod_ip: ip
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse::<IpAddr>()
                    .ok()?,
                pod_port: port.parse().ok()?,
            })
        })
        .collect()
}

/// The pod chains of `network`, found by the comments of the jumps to
/// them (a cut comment still names its network).
pub fn chains_of(table: &SavedTable, network: &str) -> BTreeSet<String> {
    let prefix = format!("--comment \"dnat name: \\\"{network}\\\" id: ");
    table
        .rules_of(DNAT_CHAIN)
        .filter(|rule| rule.contains(&prefix))
        .filter_map(|rule| {
            rule.rsplit_once(" -j ")
                .map(|(_, target)| target.trim().to_owned())
        })
        .collect()
}

/// What CHECK finds missing of a pod's rules in one family.
pub fn missing(table: &SavedTable, pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Vec<String> {
    let chain = container_chain(pod.network, pod.container_id);
    let has = |line: &str| table.rules.iter().any(|(_, rule)| rule == line);
    let mut expected = vec![local_jump("PREROUTING"), local_jump("OUTPUT")];
    if owns_masquerade(settings) {
        expected.extend([setmark_rule(settings), masq_rule(settings), masq_jump()]);
    }
    expected.extend(chain_rules(pod, settings, mappings));
    let mut gaps: Vec<String> = expected.into_iter().filter(|rule| !has(rule)).collect();
    if !table.chains.contains(&chain) {
        gaps.insert(0, format!("chain {chain}"));
    }
    let jumps = jump_rules(pod.family(), settings, pod.network, pod.container_id, mappings);
    // Conditions are reordered by iptables-save; the jumps are counted.
    let found = table.jumps_from(DNAT_CHAIN, &chain).count();
    if settings.conditions(pod.family()).is_empty() {
        gaps.extend(jumps.into_iter().filter(|rule| !has(rule)));
    } else if found < jumps.len() {
        gaps.push(format!(
            "{} of {} jumps to {chain}",
            jumps.len() - found,
            jumps.len()
        ));
    }
    gaps
}

/// ADD in one family: one restore, after looking in-process (or with one
/// `iptables-save`) at what is there. A restore that fails because another
/// plugin changed the table meanwhile is tried once more on a fresh read.
pub fn add(pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Result<()> {
    let family = pod.family();
    let chain = container_chain(pod.network, pod.container_id);
    let attempt = || -> Result<()> {
        let present = match Present::probe(family, settings, &chain)? {
            Some(present) => present,
            None => Present::read(&iptables::read(family, "nat")?, settings, &chain),
        };
        iptables::restore(family, &render_add(&present, pod, settings, mappings))
    };
    attempt().or_else(|_| attempt())
}

/// Whether a pod has chains in `family`: in-process with iptables-nft.
fn has_chains(family: Family, network: &str, container_id: &str) -> Result<bool> {
    Ok(
        iptables::chain_exists(family, "nat", &container_chain(network, container_id))?
            || iptables::chain_exists(family, "nat", &old_snat_chain(network, container_id))?,
    )
}

/// DEL in one family: removes the pod's rules and returns the forwards
/// they held. No process runs when the pod has none (iptables-nft). With
/// the mappings and the pod's address known, one restore removes exactly
/// what ADD wrote; otherwise (or when that does not match what is there)
/// the table is read and everything of the pod's removed.
pub fn remove(
    family: Family,
    settings: &Settings,
    network: &str,
    container_id: &str,
    known: Option<(&[Mapping], IpAddr)>,
) -> Result<Vec<Forward>> {
    if iptables::uses_nf_tables(family) && !has_chains(family, network, container_id)? {
        return Ok(Vec::new());
    }
    if let Some((mappings, pod_ip)) = known.filter(|_| iptables::uses_nf_tables(family))
        && iptables::restore(
            family,
            &render_remove_known(family, settings, network, container_id, mappings),
        )
        .is_ok()
    {
        return Ok(mappings
            .iter()
            .filter(|m| m.applies_to(family))
            .map(|m| Forward {
                protocol: m.protocol,
                host_port: m.host_port,
                pod_ip,
                pod_port: m.container_port,
            })
            .collect());
    }
    let table = iptables::read(family, "nat")?;
    let forwards = forwards_in(&table, &container_chain(network, container_id));
    if let Some(input) = render_remove(&table, network, container_id) {
        iptables::restore(family, &input)?;
    }
    Ok(forwards)
}

/// GC in one family: removes the pod chains of `network` whose container
/// is not in `keep`; returns the forwards they held.
pub fn collect_garbage(family: Family, network: &str, keep: &BTreeSet<String>) -> Result<Vec<Forward>> {
    let table = iptables::read(family, "nat")?;
    let kept: BTreeSet<String> = keep.iter().map(|id| container_chain(network, id)).collect();
    let mut input = String::from("*nat\n");
    let mut forwards = Vec::new();
    let mut any = false;
    for chain in chains_of(&table, network) {
        if kept.contains(&chain) {
            continue;
        }
        forwards.extend(forwards_in(&table, &chain));
        for jump in table.jumps_from(DNAT_CHAIN, &chain) {
            input.push_str(&jump.replacen("-A ", "-D ", 1));
            input.push('\n');
        }
        if table.chains.contains(&chain) {
            input.push_str(&format!("-F {chain}\n-X {chain}\n"));
        }
        any = true;
    }
    input.push_str("COMMIT\n");
    if any {
        iptables::restore(family, &input)?;
    }
    Ok(forwards)
}

/// The reference's chains, through iptables-restore.
#[derive(Debug, Clone, Copy)]
pub struct Iptables;

impl PortMapper for Iptables {
    fn add(&self, pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Result<()> {
        add(pod, settings, mappings)
    }

    fn missing(&self, pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Result<Vec<String>> {
        iptables::read(pod.family(), "nat").map(|table| missing(&table, pod, settings, mappings))
    }

    fn usable(&self) -> bool {
        iptables::available(Family::V4)
    }
}

#[cfg(test)]
mod tests;
