//! Settings → canonical `iptables-save`-form rules, per table and family.

use std::collections::BTreeMap;

use firewall::Family;
use ipnetwork::IpNetwork;

use super::redirect::{
    DNS_PORT, INBOUND_PORT, Mode, OUTBOUND_PORT, Redirect, Selection, TPROXY_MARK, TUNNEL_PORT, cidr,
};

const BUILTIN: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// One table's chains and rules, in the order `iptables-save` prints them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Table {
    pub name: &'static str,
    /// The ISTIO_* chains this table defines.
    pub chains: Vec<&'static str>,
    /// `-A CHAIN ...` lines: built-in chains first (in kernel order), then
    /// the ISTIO_* chains by name.
    pub rules: Vec<String>,
}

/// The capture rules of one family: mangle, nat and raw as needed, tables in
/// the order `iptables-save` prints them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IstioRules {
    pub tables: Vec<Table>,
}

/// Rules collected per chain in the order Istio appends them; `-I` inserts
/// at position 1 are kept apart and put in front.
#[derive(Default)]
pub(super) struct Builder {
    chains: BTreeMap<&'static str, Vec<String>>,
    declared: Vec<&'static str>,
    inserted: BTreeMap<&'static str, Vec<String>>,
}

impl Builder {
    pub(super) fn declare(&mut self, chain: &'static str) {
        if !self.declared.contains(&chain) {
            self.declared.push(chain);
        }
        self.chains.entry(chain).or_default();
    }

    pub(super) fn append(&mut self, chain: &'static str, rule: impl Into<String>) {
        self.chains.entry(chain).or_default().push(rule.into());
    }

    /// `-I chain 1`: the last inserted comes first.
    fn insert_first(&mut self, chain: &'static str, rule: impl Into<String>) {
        self.inserted.entry(chain).or_default().insert(0, rule.into());
    }

    pub(super) fn finish(mut self, name: &'static str) -> Option<Table> {
        for (chain, rules) in std::mem::take(&mut self.inserted) {
            let existing = self.chains.entry(chain).or_default();
            let mut combined = rules;
            combined.append(existing);
            *existing = combined;
        }
        let mut declared = self.declared.clone();
        declared.sort_unstable();
        let builtin_rules = BUILTIN
            .iter()
            .flat_map(|c| self.chains.get(c).into_iter().flatten().map(move |r| (*c, r)));
        let user_rules = declared
            .iter()
            .flat_map(|c| self.chains.get(c).into_iter().flatten().map(move |r| (*c, r)));
        let rules: Vec<String> = builtin_rules
            .chain(user_rules)
            .map(|(c, r)| format!("-A {c} {r}"))
            .collect();
        if rules.is_empty() && declared.is_empty() {
            return None;
        }
        Some(Table {
            name,
            chains: declared,
            rules,
        })
    }
}

struct Addresses {
    /// 127.0.0.1/32 or ::1/128.
    loopback: &'static str,
    /// 127.0.0.6/32 or ::6/128: Envoy's source for inbound forwarding.
    inbound_source: &'static str,
    any: &'static str,
}

fn addresses(family: Family) -> Addresses {
    match family {
        Family::V4 => Addresses {
            loopback: "127.0.0.1/32",
            inbound_source: "127.0.0.6/32",
            any: "0.0.0.0",
        },
        Family::V6 => Addresses {
            loopback: "::1/128",
            inbound_source: "::6/128",
            any: "::",
        },
    }
}

/// An include CIDR that covers loopback makes app-to-loopback traffic
/// capturable, so the "non-proxy on lo → RETURN" rules are left out.
fn includes_loopback(includes: &Option<Vec<IpNetwork>>) -> bool {
    includes.iter().flatten().any(|net| net.ip().is_loopback())
}

/// The rules Istio's CNI plugin programs for `redirect` in one family.
pub fn render(redirect: &Redirect, family: Family) -> IstioRules {
    let a = addresses(family);
    let includes = redirect.includes_of(family);
    let excludes: Vec<&IpNetwork> = redirect
        .exclude_cidrs
        .iter()
        .filter(|c| Family::of(c) == family)
        .collect();
    let (uid, gid) = (redirect.proxy_uid, redirect.proxy_gid);
    let owners = [("uid", uid), ("gid", gid)];
    let tproxy = redirect.mode == Mode::Tproxy;
    let inbound = redirect.captures_inbound();

    let mut nat = Builder::default();
    for chain in [
        "ISTIO_INBOUND",
        "ISTIO_REDIRECT",
        "ISTIO_IN_REDIRECT",
        "ISTIO_OUTPUT",
    ] {
        nat.declare(chain);
    }
    nat.append(
        "ISTIO_INBOUND",
        format!("-p tcp -m tcp --dport {TUNNEL_PORT} -j RETURN"),
    );
    nat.append(
        "ISTIO_REDIRECT",
        format!("-p tcp -j REDIRECT --to-ports {OUTBOUND_PORT}"),
    );
    nat.append(
        "ISTIO_IN_REDIRECT",
        format!("-p tcp -j REDIRECT --to-ports {INBOUND_PORT}"),
    );

    // Interfaces whose inbound traffic is treated as outbound: each gets a
    // redirect ahead of a RETURN, all inserted at the top of PREROUTING.
    for iface in &redirect.reroute_interfaces {
        nat.insert_first("PREROUTING", format!("-i {iface} -j RETURN"));
    }
    for iface in &redirect.reroute_interfaces {
        match &includes {
            None => nat.insert_first("PREROUTING", format!("-i {iface} -j ISTIO_REDIRECT")),
            Some(nets) => {
                for net in nets {
                    nat.insert_first(
                        "PREROUTING",
                        format!("-d {} -i {iface} -j ISTIO_REDIRECT", cidr(net)),
                    );
                }
            }
        }
    }
    for iface in &redirect.exclude_interfaces {
        nat.append("PREROUTING", format!("-i {iface} -j RETURN"));
        nat.append("OUTPUT", format!("-o {iface} -j RETURN"));
    }

    if inbound && !tproxy {
        nat.append("PREROUTING", "-p tcp -j ISTIO_INBOUND");
        match &redirect.include_inbound_ports {
            Selection::All => {
                for port in &redirect.exclude_inbound_ports {
                    nat.append("ISTIO_INBOUND", format!("-p tcp -m tcp --dport {port} -j RETURN"));
                }
                nat.append("ISTIO_INBOUND", "-p tcp -j ISTIO_IN_REDIRECT");
            }
            Selection::Only(ports) => {
                for port in ports {
                    nat.append(
                        "ISTIO_INBOUND",
                        format!("-p tcp -m tcp --dport {port} -j ISTIO_IN_REDIRECT"),
                    );
                }
            }
        }
    }

    nat.append("OUTPUT", "-j ISTIO_OUTPUT");
    for port in &redirect.exclude_outbound_ports {
        nat.append("ISTIO_OUTPUT", format!("-p tcp -m tcp --dport {port} -j RETURN"));
        nat.append("ISTIO_OUTPUT", format!("-p udp -m udp --dport {port} -j RETURN"));
    }
    nat.append("ISTIO_OUTPUT", format!("-s {} -o lo -j RETURN", a.inbound_source));
    for (kind, id) in owners {
        // Istio narrows only the uid variant of this rule for DNS capture.
        let ports = if redirect.dns_capture && kind == "uid" {
            format!("-m multiport ! --dports 53,{TUNNEL_PORT}")
        } else {
            format!("-m tcp ! --dport {TUNNEL_PORT}")
        };
        nat.append(
            "ISTIO_OUTPUT",
            format!(
                "! -d {} -o lo -p tcp {ports} -m owner --{kind}-owner {id} -j ISTIO_IN_REDIRECT",
                a.loopback
            ),
        );
        if !includes_loopback(&includes) {
            let dns = if redirect.dns_capture {
                "-p tcp -m tcp ! --dport 53 "
            } else {
                ""
            };
            nat.append(
                "ISTIO_OUTPUT",
                format!("-o lo {dns}-m owner ! --{kind}-owner {id} -j RETURN"),
            );
        }
        nat.append("ISTIO_OUTPUT", format!("-m owner --{kind}-owner {id} -j RETURN"));
    }
    if redirect.dns_capture {
        nat.declare("ISTIO_OUTPUT_DNS");
        nat.append("ISTIO_OUTPUT", "-j ISTIO_OUTPUT_DNS");
        nat.append(
            "ISTIO_OUTPUT_DNS",
            format!("-p tcp -m tcp --dport 53 -j REDIRECT --to-ports {DNS_PORT}"),
        );
        nat.append(
            "ISTIO_OUTPUT_DNS",
            format!("-p udp -m udp --dport 53 -j REDIRECT --to-ports {DNS_PORT}"),
        );
    }
    nat.append("ISTIO_OUTPUT", format!("-d {} -j RETURN", a.loopback));
    for net in &excludes {
        nat.append("ISTIO_OUTPUT", format!("-d {} -j RETURN", cidr(net)));
    }
    for port in &redirect.include_outbound_ports {
        nat.append(
            "ISTIO_OUTPUT",
            format!("-p tcp -m tcp --dport {port} -j ISTIO_REDIRECT"),
        );
    }
    match &includes {
        None => nat.append("ISTIO_OUTPUT", "-j ISTIO_REDIRECT"),
        Some(nets) => {
            for net in nets {
                nat.append("ISTIO_OUTPUT", format!("-d {} -j ISTIO_REDIRECT", cidr(net)));
            }
        }
    }

    let mut mangle = Builder::default();
    if tproxy {
        render_tproxy(&mut mangle, redirect, &a);
    }
    if redirect.invalid_drop {
        mangle.declare("ISTIO_DROP");
        mangle.append("PREROUTING", "-m conntrack --ctstate INVALID -j ISTIO_DROP");
        mangle.append("ISTIO_DROP", "-j DROP");
    }

    let mut raw = Builder::default();
    if redirect.dns_capture {
        raw.declare("ISTIO_INBOUND");
        raw.declare("ISTIO_OUTPUT_DNS");
        raw.append("PREROUTING", "-j ISTIO_INBOUND");
        raw.append("OUTPUT", "-j ISTIO_OUTPUT_DNS");
        raw.append("ISTIO_INBOUND", "-p udp -m udp --sport 53 -j CT --zone 1");
        for (kind, id) in owners {
            raw.append(
                "ISTIO_OUTPUT_DNS",
                format!("-p udp -m udp --dport 53 -m owner --{kind}-owner {id} -j CT --zone 1"),
            );
            raw.append(
                "ISTIO_OUTPUT_DNS",
                format!("-p udp -m udp --sport {DNS_PORT} -m owner --{kind}-owner {id} -j CT --zone 2"),
            );
        }
        raw.append("ISTIO_OUTPUT_DNS", "-p udp -m udp --dport 53 -j CT --zone 2");
    }

    IstioRules {
        tables: [mangle.finish("mangle"), nat.finish("nat"), raw.finish("raw")]
            .into_iter()
            .flatten()
            .collect(),
    }
}

/// TPROXY mode: inbound capture moves to mangle; nat keeps outbound only.
fn render_tproxy(mangle: &mut Builder, redirect: &Redirect, a: &Addresses) {
    let mark = format!("{TPROXY_MARK:#x}");
    let local_mark = format!("{:#x}", TPROXY_MARK + 1);
    mangle.declare("ISTIO_INBOUND");
    for iface in &redirect.exclude_interfaces {
        mangle.append("PREROUTING", format!("-i {iface} -j RETURN"));
    }
    if redirect.captures_inbound() {
        mangle.declare("ISTIO_DIVERT");
        mangle.declare("ISTIO_TPROXY");
        mangle.append("PREROUTING", "-p tcp -j ISTIO_INBOUND");
        mangle.append("ISTIO_DIVERT", format!("-j MARK --set-xmark {mark}/0xffffffff"));
        mangle.append("ISTIO_DIVERT", "-j ACCEPT");
        match &redirect.include_inbound_ports {
            Selection::All => {
                for port in &redirect.exclude_inbound_ports {
                    mangle.append("ISTIO_INBOUND", format!("-p tcp -m tcp --dport {port} -j RETURN"));
                }
                mangle.append(
                    "ISTIO_INBOUND",
                    "-p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT",
                );
                mangle.append("ISTIO_INBOUND", "-p tcp -j ISTIO_TPROXY");
            }
            Selection::Only(ports) => {
                for port in ports {
                    mangle.append(
                        "ISTIO_INBOUND",
                        format!("-p tcp -m tcp --dport {port} -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT"),
                    );
                    mangle.append(
                        "ISTIO_INBOUND",
                        format!("-p tcp -m tcp --dport {port} -j ISTIO_TPROXY"),
                    );
                }
            }
        }
        mangle.append(
            "ISTIO_TPROXY",
            format!(
                "! -d {} -p tcp -j TPROXY --on-port {INBOUND_PORT} --on-ip {} --tproxy-mark {mark}/0xffffffff",
                a.loopback, a.any
            ),
        );
    }
    // Istio inserts these three at the top of ISTIO_INBOUND, even when
    // nothing jumps to it.
    mangle.insert_first(
        "ISTIO_INBOUND",
        format!("-i lo -p tcp -m mark ! --mark {local_mark} -j RETURN"),
    );
    mangle.insert_first(
        "ISTIO_INBOUND",
        format!("-s {} -i lo -p tcp -j RETURN", a.inbound_source),
    );
    mangle.insert_first("ISTIO_INBOUND", format!("-p tcp -m mark --mark {mark} -j RETURN"));
    mangle.append(
        "PREROUTING",
        format!(
            "-p tcp -m mark --mark {mark} -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff"
        ),
    );
    mangle.append("OUTPUT", format!("-o lo -p tcp -m mark --mark {mark} -j RETURN"));
    for (kind, id) in [("uid", redirect.proxy_uid), ("gid", redirect.proxy_gid)] {
        mangle.append(
            "OUTPUT",
            format!("! -d {} -o lo -p tcp -m owner --{kind}-owner {id} -j MARK --set-xmark {local_mark}/0xffffffff", a.loopback),
        );
    }
    mangle.append(
        "OUTPUT",
        format!("-p tcp -m connmark --mark {mark} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff"),
    );
}

impl IstioRules {
    /// Every rule line, with its table: what a pod must hold.
    pub fn lines(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.tables
            .iter()
            .flat_map(|t| t.rules.iter().map(move |r| (t.name, r.as_str())))
    }

    /// The `iptables-restore --noflush` input for a namespace without Istio
    /// chains: `-N` makes the whole batch fail if any already exists, so a
    /// re-run is noticed instead of doubling the jumps.
    pub fn restore_fresh(&self) -> String {
        let mut out = String::new();
        for table in &self.tables {
            out.push_str(&format!("*{}\n", table.name));
            for chain in &table.chains {
                out.push_str(&format!("-N {chain}\n"));
            }
            for rule in &table.rules {
                out.push_str(rule);
                out.push('\n');
            }
            out.push_str("COMMIT\n");
        }
        out
    }
}
