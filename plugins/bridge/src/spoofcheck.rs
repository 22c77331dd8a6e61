//! MAC spoof checking on the bridge, laid out as the reference does it
//! (so either can remove the other's rules): table `bridge nat`, base chain
//! `PREROUTING` (filter, priority -300), and per attachment a jump on the
//! host port's name to `cni-br-iface-<id>-<ifname>`, which jumps to
//! `…-mac`: the container's MAC returns, everything else is dropped. Every
//! rule is commented `macspoofchk-<id>-<ifname>`.

use serde_json::Value;

use firewall::nfnl::{self, TableFamily};
use firewall::{Error, Result, exec};

const TABLE: &str = "bridge nat";
const BASE: &str = "PREROUTING";

/// `<containerID>-<ifname>`: the reference's `uniqueID`.
pub fn reference_id(container_id: &str, ifname: &str) -> String {
    format!("{container_id}-{ifname}")
}

fn iface_chain(id: &str) -> String {
    format!("cni-br-iface-{id}")
}

fn comment(id: &str) -> String {
    format!("macspoofchk-{id}")
}

/// One transaction: table and chains (created if missing, ours emptied),
/// then the four rules.
pub fn render_setup(host_port: &str, mac: &str, id: &str) -> String {
    let (iface, c) = (iface_chain(id), comment(id));
    format!(
        "add table {TABLE}\n\
         add chain {TABLE} {BASE} {{ type filter hook prerouting priority -300 ; policy accept ; }}\n\
         add chain {TABLE} {iface}\n\
         add chain {TABLE} {iface}-mac\n\
         flush chain {TABLE} {iface}\n\
         flush chain {TABLE} {iface}-mac\n\
         add rule {TABLE} {BASE} iifname \"{host_port}\" jump {iface} comment \"{c}\"\n\
         add rule {TABLE} {iface} jump {iface}-mac comment \"{c}\"\n\
         add rule {TABLE} {iface}-mac ether saddr {mac} return comment \"{c}\"\n\
         add rule {TABLE} {iface}-mac drop comment \"{c}\"\n"
    )
}

/// What `nft -j list table bridge nat` shows of one attachment.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Installed {
    pub base_rule_handles: Vec<u64>,
    pub chains: Vec<String>,
    pub allowed_mac: Option<String>,
}

pub fn parse(json: &str, id: &str) -> Result<Installed> {
    let doc: Value = serde_json::from_str(json).map_err(|e| Error::Invalid(format!("nft -j output: {e}")))?;
    let (iface, c) = (iface_chain(id), comment(id));
    let mut found = Installed::default();
    for item in doc["nftables"].as_array().into_iter().flatten() {
        if let Some(name) = item["chain"]["name"].as_str()
            && (name == iface || name == format!("{iface}-mac"))
        {
            found.chains.push(name.to_owned());
        }
        let rule = &item["rule"];
        if rule["comment"].as_str() != Some(c.as_str()) {
            continue;
        }
        if rule["chain"] == BASE {
            found.base_rule_handles.extend(rule["handle"].as_u64());
        }
        for expr in rule["expr"].as_array().into_iter().flatten() {
            if expr["match"]["left"]["payload"]["field"] == "saddr" {
                found.allowed_mac = expr["match"]["right"].as_str().map(str::to_owned);
            }
        }
    }
    Ok(found)
}

/// Removes the base-chain jump and the two chains; nothing when none exist.
pub fn render_teardown(installed: &Installed) -> Option<String> {
    let mut out = String::new();
    for handle in &installed.base_rule_handles {
        out.push_str(&format!("delete rule {TABLE} {BASE} handle {handle}\n"));
    }
    // The jump chain references the mac chain: delete it first.
    let mut chains = installed.chains.clone();
    chains.sort_by_key(|c| c.ends_with("-mac"));
    for chain in chains {
        out.push_str(&format!(
            "flush chain {TABLE} {chain}\ndelete chain {TABLE} {chain}\n"
        ));
    }
    (!out.is_empty()).then_some(out)
}

fn read(id: &str) -> Result<Installed> {
    match exec::run("nft", &["-j", "list", "table", "bridge", "nat"], "") {
        Ok(json) => parse(&json, id),
        // The listing fails without the table: the kernel says whether
        // that is why, else nft's own error stands.
        Err(e @ Error::Failed { .. }) => match nfnl::table_exists(TableFamily::Bridge, "nat") {
            Ok(false) => Ok(Installed::default()),
            _ => Err(e),
        },
        Err(e) => Err(e),
    }
}

pub fn setup(host_port: &str, mac: &str, id: &str) -> Result<()> {
    exec::run("nft", &["-f", "-"], &render_setup(host_port, mac, id)).map(drop)
}

pub fn teardown(id: &str) -> Result<()> {
    if exec::find("nft").is_none() {
        return Ok(());
    }
    match render_teardown(&read(id)?) {
        Some(transaction) => exec::run("nft", &["-f", "-"], &transaction).map(drop),
        None => Ok(()),
    }
}

/// The MAC the rules let through, if they are in place.
pub fn allowed_mac(id: &str) -> Result<Option<String>> {
    let installed = read(id)?;
    Ok(installed
        .allowed_mac
        .filter(|_| !installed.base_rule_handles.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_is_one_transaction_with_the_reference_names() {
        let t = render_setup("veth1234abcd", "0a:58:0a:01:00:05", &reference_id("ctr1", "eth0"));
        assert!(t.contains("add rule bridge nat PREROUTING iifname \"veth1234abcd\" jump cni-br-iface-ctr1-eth0 comment \"macspoofchk-ctr1-eth0\""));
        assert!(
            t.contains("add rule bridge nat cni-br-iface-ctr1-eth0-mac ether saddr 0a:58:0a:01:00:05 return")
        );
        assert!(t.trim_end().ends_with(
            "add rule bridge nat cni-br-iface-ctr1-eth0-mac drop comment \"macspoofchk-ctr1-eth0\""
        ));
    }

    #[test]
    fn teardown_finds_rules_by_comment() {
        let listed = r#"{"nftables": [
          {"chain": {"family": "bridge", "table": "nat", "name": "cni-br-iface-c-eth0-mac", "handle": 3}},
          {"chain": {"family": "bridge", "table": "nat", "name": "cni-br-iface-c-eth0", "handle": 2}},
          {"chain": {"family": "bridge", "table": "nat", "name": "cni-br-iface-other-eth0", "handle": 9}},
          {"rule": {"family": "bridge", "table": "nat", "chain": "PREROUTING", "handle": 5, "comment": "macspoofchk-c-eth0", "expr": []}},
          {"rule": {"family": "bridge", "table": "nat", "chain": "PREROUTING", "handle": 6, "comment": "macspoofchk-other-eth0", "expr": []}},
          {"rule": {"family": "bridge", "table": "nat", "chain": "cni-br-iface-c-eth0-mac", "handle": 7, "comment": "macspoofchk-c-eth0",
            "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ether", "field": "saddr"}}, "right": "0a:00:00:00:00:01"}}, {"return": null}]}}]}"#;
        let found = parse(listed, "c-eth0").expect("parses");
        assert_eq!(found.base_rule_handles, [5]);
        assert_eq!(found.allowed_mac.as_deref(), Some("0a:00:00:00:00:01"));
        let t = render_teardown(&found).expect("something to remove");
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "delete rule bridge nat PREROUTING handle 5");
        assert_eq!(
            lines[2], "delete chain bridge nat cni-br-iface-c-eth0",
            "the jumping chain goes first"
        );
        assert_eq!(lines[4], "delete chain bridge nat cni-br-iface-c-eth0-mac");
        assert!(!t.contains("other"));
        assert_eq!(render_teardown(&Installed::default()), None);
    }
}
