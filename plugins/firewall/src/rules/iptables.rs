//! The reference plugin's iptables layout, in the filter table:
//!
//! ```text
//! -A FORWARD -m comment --comment "CNI firewall plugin rules" -j CNI-FORWARD
//! -A CNI-FORWARD -m comment --comment "CNI firewall plugin admin overrides" -j CNI-ADMIN
//! -A CNI-FORWARD -d <pod>/32 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
//! -A CNI-FORWARD -s <pod>/32 -j ACCEPT
//! ```
//!
//! The two jumps are inserted first in their chains, the pod rules
//! appended, each only when it is not there yet, as the reference does
//! with `iptables -C` before every `-I` and `-A`. The `same-bridge` ingress
//! policy adds, per bridge,
//!
//! ```text
//! -A FORWARD -m comment --comment "CNI firewall plugin rules (ingressPolicy: same-bridge)" -j CNI-ISOLATION-STAGE-1
//! -A CNI-ISOLATION-STAGE-1 -i <br> ! -o <br> -m comment --comment "…" -j CNI-ISOLATION-STAGE-2
//! -A CNI-ISOLATION-STAGE-1 -m comment --comment "…" -j RETURN
//! -A CNI-ISOLATION-STAGE-2 -o <br> -m comment --comment "…" -j DROP
//! -A CNI-ISOLATION-STAGE-2 -m comment --comment "…" -j RETURN
//! ```
//!
//! (bridge rules inserted first, RETURNs appended), which no DEL removes:
//! other pods may still use the bridge. A DEL removes only the pod's two
//! rules per address; the chains and jumps stay, as with the reference.

use std::net::IpAddr;

use super::backend::{FirewallBackend, PodRules};
use super::chain_dump;
use firewall::iptables::{SavedTable, quote, restore, uses_nf_tables};
use firewall::nfnl::{Deleted, TableFamily};
use firewall::ruleset;
use firewall::{Family, Result};

pub const FORWARD_CHAIN: &str = "CNI-FORWARD";
pub const DEFAULT_ADMIN_CHAIN: &str = "CNI-ADMIN";
pub const STAGE_1: &str = "CNI-ISOLATION-STAGE-1";
pub const STAGE_2: &str = "CNI-ISOLATION-STAGE-2";

const RULES_COMMENT: &str = "CNI firewall plugin rules";
const ADMIN_COMMENT: &str = "CNI firewall plugin admin overrides";
const SAME_BRIDGE_COMMENT: &str = "CNI firewall plugin rules (ingressPolicy: same-bridge)";
/// Later upstream releases comment the rules every bridge shares so; a
/// node they ran on already has them.
const SHARED_COMMENT_LATER: &str = "CNI firewall plugin rules (ingressPolicy: same-bridge|isolated)";

/// What one configuration asks for in a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout<'a> {
    /// `iptablesAdminChainName`.
    pub admin: &'a str,
    /// The bridge to isolate (`ingressPolicy: same-bridge`).
    pub bridge: Option<&'a str>,
}

/// Whether `chain` has any of `specs`.
fn has_any(filter: &SavedTable, chain: &str, specs: &[String]) -> bool {
    specs.iter().any(|spec| filter.has(chain, spec))
}

fn commented(matches: &str, comment: &str, target: &str) -> String {
    let matches = if matches.is_empty() {
        String::new()
    } else {
        format!("{matches} ")
    };
    format!("{matches}-m comment --comment {} -j {target}", quote(comment))
}

/// FORWARD's jump to `CNI-FORWARD`.
pub fn base_jump() -> String {
    commented("", RULES_COMMENT, FORWARD_CHAIN)
}

/// `CNI-FORWARD`'s jump to the admin chain, first in it.
pub fn admin_jump(admin: &str) -> String {
    commented("", ADMIN_COMMENT, admin)
}

/// A pod address's two rules: replies to connections it opened, and
/// everything it sends.
pub fn pod_rules(ip: IpAddr) -> [String; 2] {
    let host = if ip.is_ipv4() { 32 } else { 128 };
    [
        format!("-d {ip}/{host} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"),
        format!("-s {ip}/{host} -j ACCEPT"),
    ]
}

/// A rule every bridge shares: the 1.1.1 text first, then what later
/// releases write (found, never written).
fn shared(target: &str) -> [String; 2] {
    [
        commented("", SAME_BRIDGE_COMMENT, target),
        commented("", SHARED_COMMENT_LATER, target),
    ]
}

fn stage_1_rule(bridge: &str) -> String {
    commented(
        &format!("-i {bridge} ! -o {bridge}"),
        SAME_BRIDGE_COMMENT,
        STAGE_2,
    )
}

fn stage_2_rule(bridge: &str) -> String {
    commented(&format!("-o {bridge}"), SAME_BRIDGE_COMMENT, "DROP")
}

/// One batch's lines, each change once (a pod may list an address twice).
#[derive(Default)]
struct Batch {
    lines: Vec<String>,
}

impl Batch {
    fn push(&mut self, line: String) {
        if !self.lines.contains(&line) {
            self.lines.push(line);
        }
    }

    fn finish(self) -> Option<String> {
        (!self.lines.is_empty()).then(|| format!("*filter\n{}\nCOMMIT\n", self.lines.join("\n")))
    }
}

/// The input that completes `ips`' rules (all of one family) and, with a
/// bridge, its isolation, in the reference's order; `None` when nothing is
/// missing. Chains are created with `-N`, never declared with `:`, which
/// in a `--noflush` restore would empty a chain someone created meanwhile:
/// `-N` fails the batch instead, and the caller reads again.
pub fn render_add(filter: &SavedTable, layout: &Layout, ips: &[IpAddr]) -> Option<String> {
    if ips.is_empty() {
        return None;
    }
    let mut batch = Batch::default();
    for chain in [FORWARD_CHAIN, layout.admin] {
        if !filter.chains.contains(chain) {
            batch.push(format!("-N {chain}"));
        }
    }
    if !filter.has("FORWARD", &base_jump()) {
        batch.push(format!("-I FORWARD 1 {}", base_jump()));
    }
    if !filter.has(FORWARD_CHAIN, &admin_jump(layout.admin)) {
        batch.push(format!("-I {FORWARD_CHAIN} 1 {}", admin_jump(layout.admin)));
    }
    for ip in ips {
        for rule in pod_rules(*ip) {
            if !filter.has(FORWARD_CHAIN, &rule) {
                batch.push(format!("-A {FORWARD_CHAIN} {rule}"));
            }
        }
    }
    if let Some(bridge) = layout.bridge {
        for chain in [STAGE_1, STAGE_2] {
            if !filter.chains.contains(chain) {
                batch.push(format!("-N {chain}"));
            }
        }
        let jump = shared(STAGE_1);
        if !has_any(filter, "FORWARD", &jump) {
            batch.push(format!("-I FORWARD 1 {}", jump[0]));
        }
        let returns = shared("RETURN");
        for (chain, rule) in [(STAGE_1, stage_1_rule(bridge)), (STAGE_2, stage_2_rule(bridge))] {
            if !filter.has(chain, &rule) {
                batch.push(format!("-I {chain} 1 {rule}"));
            }
            if !has_any(filter, chain, &returns) {
                batch.push(format!("-A {chain} {}", returns[0]));
            }
        }
    }
    batch.finish()
}

/// The input that removes every copy of `ips`' pod rules, or `None` when
/// there are none.
pub fn render_del(filter: &SavedTable, ips: &[IpAddr]) -> Option<String> {
    let mut batch = Batch::default();
    for ip in ips {
        for rule in pod_rules(*ip) {
            // Not `push`: each copy needs its own line.
            for _ in 0..filter.count(FORWARD_CHAIN, &rule) {
                batch.lines.push(format!("-D {FORWARD_CHAIN} {rule}"));
            }
        }
    }
    batch.finish()
}

/// What CHECK misses of `ips`' layout, as readable lines.
pub fn missing(filter: &SavedTable, layout: &Layout, ips: &[IpAddr]) -> Vec<String> {
    if ips.is_empty() {
        return Vec::new();
    }
    let mut missing = Vec::new();
    for chain in [FORWARD_CHAIN, layout.admin] {
        if !filter.chains.contains(chain) {
            missing.push(format!("chain {chain}"));
        }
    }
    let mut expect = |chain: &str, rules: &[String]| {
        if !has_any(filter, chain, rules) {
            missing.push(format!("-A {chain} {}", rules[0]));
        }
    };
    expect("FORWARD", &[base_jump()]);
    expect(FORWARD_CHAIN, &[admin_jump(layout.admin)]);
    for ip in ips {
        for rule in pod_rules(*ip) {
            expect(FORWARD_CHAIN, &[rule]);
        }
    }
    if let Some(bridge) = layout.bridge {
        expect("FORWARD", &shared(STAGE_1));
        expect(STAGE_1, &[stage_1_rule(bridge)]);
        expect(STAGE_1, &shared("RETURN"));
        expect(STAGE_2, &[stage_2_rule(bridge)]);
        expect(STAGE_2, &shared("RETURN"));
    }
    missing
}

/// Reads the chains `layout` involves: one netlink dump per chain with
/// iptables-nft, one `iptables-save -t filter` with iptables-legacy.
pub fn read(family: Family, layout: &Layout) -> Result<SavedTable> {
    if !uses_nf_tables(family) {
        return firewall::iptables::read(family, "filter");
    }
    let table_family = nf_table_family(family);
    let mut chains = vec!["FORWARD", FORWARD_CHAIN, layout.admin];
    if layout.bridge.is_some() {
        chains.extend([STAGE_1, STAGE_2]);
    }
    let mut filter = SavedTable::default();
    for chain in chains {
        let Some(rules) = chain_dump::dump(table_family, "filter", chain)? else {
            continue;
        };
        filter.chains.insert(chain.to_owned());
        for spec in rules.into_iter().filter_map(|rule| rule.spec) {
            filter.push_rule(chain, &spec);
        }
    }
    Ok(filter)
}

/// Applies what `render` makes of a fresh read; when the batch fails
/// (someone outside the node's lock changed the table meanwhile: the
/// reference plugin, another tool) it reads and tries once more. Returns
/// whether anything was written.
fn converge(family: Family, layout: &Layout, render: impl Fn(&SavedTable) -> Option<String>) -> Result<bool> {
    let Some(input) = render(&read(family, layout)?) else {
        return Ok(false);
    };
    if let Err(first) = restore(family, &input) {
        let Some(input) = render(&read(family, layout)?) else {
            return Ok(true);
        };
        restore(family, &input).map_err(|_| first)?;
    }
    Ok(true)
}

/// Leaves `ips`' rules (all of `family`) and the isolation `layout` asks
/// for complete. Returns whether anything was written.
pub fn add(family: Family, layout: &Layout, ips: &[IpAddr]) -> Result<bool> {
    converge(family, layout, |filter| render_add(filter, layout, ips))
}

/// Removes `ips`' pod rules (all of `family`). Returns whether there were
/// any. With iptables-nft, in-process: the handles of their copies read
/// from one dump of `CNI-FORWARD` and deleted in one nf_tables
/// transaction, what `iptables-restore`'s `-D` lines come down to,
/// without starting it (most of a DEL's time, its floor); read once more
/// when one of them went meanwhile. iptables-legacy is restored.
pub fn del(family: Family, ips: &[IpAddr]) -> Result<bool> {
    if !uses_nf_tables(family) {
        let layout = Layout {
            admin: DEFAULT_ADMIN_CHAIN,
            bridge: None,
        };
        return converge(family, &layout, |filter| render_del(filter, ips));
    }
    let table_family = nf_table_family(family);
    let handles = pod_rule_handles(table_family, ips)?;
    if handles.is_empty() {
        return Ok(false);
    }
    if ruleset::delete_rules(table_family, "filter", FORWARD_CHAIN, &handles)? == Deleted::Removed {
        return Ok(true);
    }
    let handles = pod_rule_handles(table_family, ips)?;
    if handles.is_empty() {
        // Deleted meanwhile by someone outside the node's lock.
        return Ok(true);
    }
    match ruleset::delete_rules(table_family, "filter", FORWARD_CHAIN, &handles)? {
        Deleted::Removed => Ok(true),
        Deleted::Absent | Deleted::InUse => Err(firewall::Error::Invalid(format!(
            "the rules of {ips:?} in {FORWARD_CHAIN} kept changing while they were deleted"
        ))),
    }
}

/// The handles of every copy of `ips`' pod rules in `CNI-FORWARD`.
fn pod_rule_handles(family: TableFamily, ips: &[IpAddr]) -> Result<Vec<u64>> {
    let wanted: Vec<String> = ips.iter().flat_map(|ip| pod_rules(*ip)).collect();
    let rules = chain_dump::dump(family, "filter", FORWARD_CHAIN)?.unwrap_or_default();
    Ok(rules
        .into_iter()
        .filter(|rule| rule.spec.as_ref().is_some_and(|spec| wanted.contains(spec)))
        .map(|rule| rule.handle)
        .collect())
}

fn nf_table_family(family: Family) -> TableFamily {
    match family {
        Family::V4 => TableFamily::Ip,
        Family::V6 => TableFamily::Ip6,
    }
}

/// What is missing of `ips`' layout in `family`.
pub fn check(family: Family, layout: &Layout, ips: &[IpAddr]) -> Result<Vec<String>> {
    read(family, layout).map(|filter| missing(&filter, layout, ips))
}

/// The reference's layout, one batch per family.
#[derive(Debug, Clone, Copy)]
pub struct Iptables;

/// `ips` of `family`, with the layout `rules` asks for.
fn per_family<'a>(rules: &'a PodRules, family: Family) -> (Layout<'a>, Vec<IpAddr>) {
    let layout = Layout {
        admin: rules.admin_chain,
        bridge: rules.bridge,
    };
    let ips = rules
        .ips
        .iter()
        .copied()
        .filter(|ip| ip.is_ipv4() == (family == Family::V4))
        .collect();
    (layout, ips)
}

impl FirewallBackend for Iptables {
    fn add(&self, rules: &PodRules) -> Result<()> {
        for family in [Family::V4, Family::V6] {
            let (layout, ips) = per_family(rules, family);
            if !ips.is_empty() {
                add(family, &layout, &ips)?;
            }
        }
        Ok(())
    }

    fn check(&self, rules: &PodRules) -> Result<Vec<String>> {
        let mut missing = Vec::new();
        for family in [Family::V4, Family::V6] {
            let (layout, ips) = per_family(rules, family);
            if !ips.is_empty() {
                missing.extend(check(family, &layout, &ips)?);
            }
        }
        Ok(missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: Layout = Layout {
        admin: DEFAULT_ADMIN_CHAIN,
        bridge: None,
    };

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    /// What restoring `input` over `filter` leaves, as iptables would.
    fn apply(filter: &SavedTable, input: &str) -> SavedTable {
        let mut out = filter.clone();
        for line in input.lines() {
            let words: Vec<&str> = line.splitn(3, ' ').collect();
            match words.as_slice() {
                ["-N", chain] => assert!(out.chains.insert((*chain).to_owned()), "-N of an existing chain"),
                ["-A", chain, spec] => out.push_rule(chain, spec),
                ["-I", chain, rest] => {
                    let spec = rest.strip_prefix("1 ").expect("inserted first");
                    let at = out
                        .rules
                        .iter()
                        .position(|(c, _)| c == chain)
                        .unwrap_or(out.rules.len());
                    out.rules
                        .insert(at, ((*chain).to_owned(), format!("-A {chain} {spec}")));
                }
                ["-D", chain, spec] => {
                    let at = out
                        .rules
                        .iter()
                        .position(|(c, line)| c == chain && *line == format!("-A {chain} {spec}"))
                        .expect("-D of a rule that is there");
                    out.rules.remove(at);
                }
                ["*filter"] | ["COMMIT"] => {}
                other => panic!("unexpected line {other:?}"),
            }
        }
        out
    }

    #[test]
    fn the_first_pod_gets_the_reference_layout_in_one_batch() {
        let input = render_add(&SavedTable::default(), &OPEN, &[ip("10.88.0.5")]).expect("everything");
        assert_eq!(
            input,
            "*filter\n\
             -N CNI-FORWARD\n\
             -N CNI-ADMIN\n\
             -I FORWARD 1 -m comment --comment \"CNI firewall plugin rules\" -j CNI-FORWARD\n\
             -I CNI-FORWARD 1 -m comment --comment \"CNI firewall plugin admin overrides\" -j CNI-ADMIN\n\
             -A CNI-FORWARD -d 10.88.0.5/32 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
             -A CNI-FORWARD -s 10.88.0.5/32 -j ACCEPT\n\
             COMMIT\n"
        );
        let after = apply(&SavedTable::default(), &input);
        assert_eq!(
            render_add(&after, &OPEN, &[ip("10.88.0.5")]),
            None,
            "a rerun changes nothing"
        );
        assert!(missing(&after, &OPEN, &[ip("10.88.0.5")]).is_empty());
        let second = render_add(&after, &OPEN, &[ip("10.88.0.6")]).expect("the second pod's rules");
        assert_eq!(
            second.lines().filter(|l| l.starts_with("-A CNI-FORWARD")).count(),
            2
        );
        assert!(!second.contains("-N ") && !second.contains("-I "), "{second}");
    }

    #[test]
    fn ipv6_rules_use_host_prefixes_and_the_admin_chain_is_configurable() {
        let layout = Layout {
            admin: "MY-ADMIN",
            bridge: None,
        };
        let input = render_add(&SavedTable::default(), &layout, &[ip("fd00::5")]).expect("everything");
        assert!(input.contains("-N MY-ADMIN\n"));
        assert!(input.contains("--comment \"CNI firewall plugin admin overrides\" -j MY-ADMIN\n"));
        assert!(input.contains("-A CNI-FORWARD -s fd00::5/128 -j ACCEPT\n"));
        assert_eq!(
            render_add(&SavedTable::default(), &layout, &[]),
            None,
            "no address, no rules"
        );
    }

    #[test]
    fn same_bridge_isolation_is_ordered_as_the_reference_orders_it() {
        let a = Layout {
            admin: DEFAULT_ADMIN_CHAIN,
            bridge: Some("cni-a"),
        };
        let b = Layout {
            bridge: Some("cni-b"),
            ..a
        };
        let one = apply(
            &SavedTable::default(),
            &render_add(&SavedTable::default(), &a, &[ip("10.1.0.2")]).expect("a"),
        );
        let two = apply(&one, &render_add(&one, &b, &[ip("10.2.0.2")]).expect("b"));
        let c = "\"CNI firewall plugin rules (ingressPolicy: same-bridge)\"";
        let lines: Vec<String> = two
            .rules
            .iter()
            .filter(|(chain, _)| chain != FORWARD_CHAIN)
            .map(|(_, line)| line.clone())
            .collect();
        assert_eq!(
            lines,
            [
                format!("-A FORWARD -m comment --comment {c} -j CNI-ISOLATION-STAGE-1"),
                "-A FORWARD -m comment --comment \"CNI firewall plugin rules\" -j CNI-FORWARD".to_owned(),
                format!(
                    "-A CNI-ISOLATION-STAGE-1 -i cni-b ! -o cni-b -m comment --comment {c} -j CNI-ISOLATION-STAGE-2"
                ),
                format!(
                    "-A CNI-ISOLATION-STAGE-1 -i cni-a ! -o cni-a -m comment --comment {c} -j CNI-ISOLATION-STAGE-2"
                ),
                format!("-A CNI-ISOLATION-STAGE-1 -m comment --comment {c} -j RETURN"),
                format!("-A CNI-ISOLATION-STAGE-2 -o cni-b -m comment --comment {c} -j DROP"),
                format!("-A CNI-ISOLATION-STAGE-2 -o cni-a -m comment --comment {c} -j DROP"),
                format!("-A CNI-ISOLATION-STAGE-2 -m comment --comment {c} -j RETURN"),
            ]
        );
        assert!(missing(&two, &b, &[ip("10.2.0.2")]).is_empty());
        assert_eq!(render_add(&two, &a, &[ip("10.1.0.2")]), None);
    }

    #[test]
    fn rules_a_later_release_wrote_count_as_there() {
        let later = "\"CNI firewall plugin rules (ingressPolicy: same-bridge|isolated)\"";
        let save = format!(
            "*filter\n:CNI-ISOLATION-STAGE-1 - [0:0]\n:CNI-ISOLATION-STAGE-2 - [0:0]\n\
             -A FORWARD -m comment --comment {later} -j CNI-ISOLATION-STAGE-1\n\
             -A CNI-ISOLATION-STAGE-1 -m comment --comment {later} -j RETURN\n\
             -A CNI-ISOLATION-STAGE-2 -m comment --comment {later} -j RETURN\nCOMMIT\n"
        );
        let layout = Layout {
            admin: DEFAULT_ADMIN_CHAIN,
            bridge: Some("br0"),
        };
        let input = render_add(&SavedTable::parse(&save, "filter"), &layout, &[ip("10.1.0.2")])
            .expect("bridge rules");
        assert!(
            !input.contains("-j RETURN") && !input.contains("-N CNI-ISOLATION"),
            "{input}"
        );
        assert!(!input.contains("-j CNI-ISOLATION-STAGE-1"), "{input}");
    }

    #[test]
    fn del_removes_every_copy_of_the_pods_rules_and_nothing_else() {
        let input =
            render_add(&SavedTable::default(), &OPEN, &[ip("10.88.0.5"), ip("10.88.0.6")]).expect("add");
        let mut filter = apply(&SavedTable::default(), &input);
        let [dst, _] = pod_rules(ip("10.88.0.5"));
        filter.push_rule(FORWARD_CHAIN, &dst);
        let del = render_del(&filter, &[ip("10.88.0.5")]).expect("rules to remove");
        assert_eq!(del.lines().filter(|l| l.starts_with("-D ")).count(), 3);
        let after = apply(&filter, &del);
        assert_eq!(render_del(&after, &[ip("10.88.0.5")]), None);
        assert!(
            missing(&after, &OPEN, &[ip("10.88.0.6")]).is_empty(),
            "the other pod keeps its rules"
        );
        assert_eq!(
            missing(&after, &OPEN, &[ip("10.88.0.5")]).len(),
            2,
            "the jumps and chains stay, as the reference leaves them"
        );
    }

    fn in_new_netns(test: impl FnOnce() + Send) {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                test();
            });
        });
    }

    #[test]
    fn the_in_process_read_is_what_iptables_save_prints() {
        in_new_netns(|| {
            for (family, addresses) in [
                (Family::V4, [ip("10.1.0.2"), ip("192.168.200.7")]),
                (Family::V6, [ip("fd00::2"), ip("fd00:ffff::8")]),
            ] {
                let layout = Layout {
                    admin: "MY-ADMIN",
                    bridge: Some("cni-a"),
                };
                assert!(add(family, &layout, &addresses).expect("first add"));
                assert!(
                    !add(family, &layout, &addresses).expect("rerun"),
                    "nothing missing, nothing run"
                );
                assert!(check(family, &layout, &addresses).expect("check").is_empty());
                let saved = firewall::exec::run(family.save(), &["-t", "filter"], "").expect("save");
                let by_chain = |mut f: SavedTable| {
                    f.rules.sort_by(|a, b| a.0.cmp(&b.0));
                    f.chains.retain(|c| c != "INPUT" && c != "OUTPUT");
                    f
                };
                assert_eq!(
                    by_chain(read(family, &layout).expect("read")),
                    by_chain(SavedTable::parse(&saved, "filter"))
                );
                assert!(del(family, &addresses[..1]).expect("del"));
                assert!(!del(family, &addresses[..1]).expect("del again"));
                assert_eq!(check(family, &layout, &addresses).expect("check").len(), 2);
            }
        });
    }
}
