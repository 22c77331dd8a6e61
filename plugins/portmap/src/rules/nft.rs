//! Upstream's nftables layout (plugins v1.6 and later), one table per
//! family, `ip cni_hostport` and `ip6 cni_hostport`:
//!
//! ```text
//! table ip cni_hostport {
//!   chain hostports { tcp dport 8080 dnat to 10.244.0.5:80 comment "<container ID>" }
//!   chain hostip_hostports { }   (kept empty: older releases used it)
//!   chain hostports_all { jump hostip_hostports; jump hostports }
//!   chain prerouting { type nat hook prerouting priority dstnat; <conditions> fib daddr type local jump hostports_all }
//!   chain output { type nat hook output priority -100; <conditions> fib daddr type local jump hostports_all }
//!   chain masquerading { type nat hook postrouting priority srcnat;
//!     ip saddr <pod> ip daddr <pod> masquerade comment "<id>"
//!     ip saddr 127.0.0.1 ip daddr <pod> masquerade comment "<id>" }
//! }
//! ```
//!
//! A pod's rules carry its container ID as their comment; they are found
//! (with their handles) in-process and removed in one `nft -f`.

use std::net::IpAddr;

use firewall::{Error, Family, Result, exec, nfnl};

use super::{Forward, Mapping, Pod, PortMapper, Protocol, Settings, ip_port};

pub const TABLE: &str = "cni_hostport";
const HOSTPORTS: &str = "hostports";
const HOSTIP_HOSTPORTS: &str = "hostip_hostports";
const HOSTPORTS_ALL: &str = "hostports_all";
const MASQUERADING: &str = "masquerading";
/// The chains a pod's rules live in.
const POD_CHAINS: [&str; 3] = [HOSTPORTS, HOSTIP_HOSTPORTS, MASQUERADING];

fn table_of(family: Family) -> String {
    format!("{} {TABLE}", address_keyword(family))
}

fn address_keyword(family: Family) -> &'static str {
    match family {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    }
}

/// nft strings cannot hold a double quote.
fn quote(text: &str) -> String {
    format!("\"{}\"", text.replace('"', ""))
}

/// The table's base: created if missing, the hook chains rewritten (their
/// single rule carries the conditions, which may have changed).
fn render_base(family: Family, settings: &Settings) -> String {
    let t = table_of(family);
    let conditions: String = settings
        .conditions(family)
        .iter()
        .map(|c| format!("{c} "))
        .collect();
    let mut out = format!(
        "add table {t} {{ comment \"CNI portmap plugin\" ; }}\n\
         add chain {t} {HOSTPORTS}\n\
         add chain {t} {HOSTIP_HOSTPORTS}\n\
         add chain {t} {HOSTPORTS_ALL}\n\
         flush chain {t} {HOSTPORTS_ALL}\n\
         add rule {t} {HOSTPORTS_ALL} jump {HOSTIP_HOSTPORTS}\n\
         add rule {t} {HOSTPORTS_ALL} jump {HOSTPORTS}\n"
    );
    // nft 1.0 accepts the name `dstnat` for the prerouting hook only; it
    // is -100 on both.
    for (chain, priority) in [("prerouting", "dstnat"), ("output", "-100")] {
        out.push_str(&format!(
            "add chain {t} {chain} {{ type nat hook {chain} priority {priority} ; }}\n\
             flush chain {t} {chain}\n\
             add rule {t} {chain} {conditions}fib daddr type local jump {HOSTPORTS_ALL}\n"
        ));
    }
    if settings.snat {
        out.push_str(&format!(
            "add chain {t} {MASQUERADING} {{ type nat hook postrouting priority srcnat ; }}\n"
        ));
    }
    out
}

/// The pod's rules.
pub fn pod_rules(pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Vec<String> {
    let family = pod.family();
    let (t, ip) = (table_of(family), address_keyword(family));
    let comment = quote(pod.container_id);
    let pod_ip = pod.address.ip();
    let mut rules = Vec::new();
    for mapping in mappings.iter().filter(|m| m.applies_to(family)) {
        let destination = mapping
            .destination()
            .map(|d| format!("{ip} daddr {d} "))
            .unwrap_or_default();
        rules.push(format!(
            "add rule {t} {HOSTPORTS} {destination}{} dport {} dnat to {} comment {comment}",
            mapping.protocol.name(),
            mapping.host_port,
            ip_port(pod_ip, mapping.container_port)
        ));
    }
    if settings.snat {
        let source = if settings.masq_all {
            match family {
                Family::V4 => "0.0.0.0/0".to_owned(),
                Family::V6 => "::/0".to_owned(),
            }
        } else {
            pod_ip.to_string()
        };
        rules.push(format!(
            "add rule {t} {MASQUERADING} {ip} saddr {source} {ip} daddr {pod_ip} masquerade comment {comment}"
        ));
        if family == Family::V4 && !settings.masq_all {
            rules.push(format!(
                "add rule {t} {MASQUERADING} {ip} saddr 127.0.0.1 {ip} daddr {pod_ip} masquerade comment {comment}"
            ));
        }
    }
    rules
}

/// The handles of a pod's rules, per chain, asked in-process.
fn pod_handles(family: Family, container_id: &str) -> Result<Vec<(&'static str, u64)>> {
    let mut handles = Vec::new();
    for chain in POD_CHAINS {
        for handle in nfnl::handles_with_comment(family.nf_table_family(), TABLE, chain, container_id)? {
            handles.push((chain, handle));
        }
    }
    Ok(handles)
}

fn render_delete(family: Family, handles: &[(&str, u64)]) -> String {
    let t = table_of(family);
    handles
        .iter()
        .map(|(chain, handle)| format!("delete rule {t} {chain} handle {handle}\n"))
        .collect()
}

/// The transaction of an ADD: the base, the pod's earlier rules removed
/// (a repeated ADD), its rules added.
pub fn render_add(pod: &Pod, settings: &Settings, mappings: &[Mapping], earlier: &[(&str, u64)]) -> String {
    let mut out = render_base(pod.family(), settings);
    out.push_str(&render_delete(pod.family(), earlier));
    for rule in pod_rules(pod, settings, mappings) {
        out.push_str(&rule);
        out.push('\n');
    }
    out
}

fn apply(transaction: &str) -> Result<()> {
    exec::run("nft", &["-f", "-"], transaction).map(drop)
}

/// ADD in one family: one transaction.
pub fn add(pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Result<()> {
    let earlier = pod_handles(pod.family(), pod.container_id)?;
    apply(&render_add(pod, settings, mappings, &earlier))
}

/// The forwards of a pod's rules as nft prints them
/// (`tcp dport 8080 dnat ip to 10.244.0.5:80 comment "<id>"`).
pub fn forwards_in(listing: &str, container_id: &str) -> Vec<Forward> {
    let tag = format!("comment {}", quote(container_id));
    listing
        .lines()
        .filter(|line| line.trim_end().ends_with(&tag))
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let dport = words.iter().position(|w| *w == "dport")?;
            let protocol = Protocol::parse(words.get(dport.checked_sub(1)?)?).ok()?;
            let host_port = words.get(dport + 1)?.parse().ok()?;
            let to = words.iter().position(|w| *w == "to")?;
            let (ip, port) = words.get(to + 1)?.rsplit_once(':')?;
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

/// DEL in one family: the pod's rules, found in-process, removed in one
/// transaction (no process when there are none). Returns their forwards:
/// from the mappings when known, else read from the table.
pub fn remove(
    family: Family,
    container_id: &str,
    known: Option<(&[Mapping], IpAddr)>,
) -> Result<Vec<Forward>> {
    let handles = pod_handles(family, container_id)?;
    if handles.is_empty() {
        return Ok(Vec::new());
    }
    let forwards = match known {
        Some((mappings, pod_ip)) => mappings
            .iter()
            .filter(|m| m.applies_to(family))
            .map(|m| Forward {
                protocol: m.protocol,
                host_port: m.host_port,
                pod_ip,
                pod_port: m.container_port,
            })
            .collect(),
        None => {
            let listing = exec::run(
                "nft",
                &["list", "chain", address_keyword(family), TABLE, HOSTPORTS],
                "",
            )?;
            forwards_in(&listing, container_id)
        }
    };
    apply(&render_delete(family, &handles))?;
    Ok(forwards)
}

/// What CHECK finds missing: fewer of the pod's rules than ADD writes.
pub fn missing(pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Result<Vec<String>> {
    let family = pod.family();
    let expected = pod_rules(pod, settings, mappings);
    let found = pod_handles(family, pod.container_id)?.len();
    if found >= expected.len() {
        return Ok(Vec::new());
    }
    Ok(vec![format!(
        "{} of {} rules of container {} in table {}",
        expected.len() - found,
        expected.len(),
        pod.container_id,
        table_of(family)
    )])
}

/// The container IDs with rules in one family's table.
pub fn containers(family: Family) -> Result<Vec<String>> {
    let mut ids = Vec::new();
    for chain in POD_CHAINS {
        for comment in nfnl::rule_comments(family.nf_table_family(), TABLE, chain)? {
            if !ids.contains(&comment) {
                ids.push(comment);
            }
        }
    }
    Ok(ids)
}

/// Whether the nft tool runs here.
pub fn usable() -> Result<()> {
    exec::find("nft")
        .map(drop)
        .ok_or_else(|| Error::Invalid("nft not found".into()))
}

/// Upstream's `cni_hostport` tables, through nft.
#[derive(Debug, Clone, Copy)]
pub struct Nftables;

impl PortMapper for Nftables {
    fn add(&self, pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Result<()> {
        add(pod, settings, mappings)
    }

    fn missing(&self, pod: &Pod, settings: &Settings, mappings: &[Mapping]) -> Result<Vec<String>> {
        missing(pod, settings, mappings)
    }

    fn usable(&self) -> bool {
        usable().is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_rules_give_back_their_forwards() {
        let listing = "table ip cni_hostport {\n\tchain hostports {\n\
            \t\ttcp dport 8080 dnat ip to 10.244.0.5:80 comment \"abc\"\n\
            \t\tip daddr 10.0.0.1 udp dport 53 dnat ip to 10.244.0.5:5353 comment \"abc\"\n\
            \t\ttcp dport 9 dnat ip to 10.244.0.6:9 comment \"other\"\n\t}\n}\n";
        let got = forwards_in(listing, "abc");
        assert_eq!(got.len(), 2);
        assert_eq!(
            (got[1].protocol, got[1].host_port, got[1].pod_port),
            (Protocol::Udp, 53, 5353)
        );
        let v6 = "\t\ttcp dport 80 dnat ip6 to [fd00::5]:8080 comment \"x\"\n";
        assert_eq!(
            forwards_in(v6, "x")[0].pod_ip,
            "fd00::5".parse::<IpAddr>().expect("ip")
        );
    }
}
