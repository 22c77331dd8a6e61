//! Every verdict in the kernel: pods on one node's bridge (bridged frames
//! through `br_netfilter`, as on a real node), a policy compiled and
//! applied in the node's namespace, and connections that pass or not.

use std::net::IpAddr;

use netpol::model::{Peer, PodView, Policy, PortSpec, Protocol, Rule, Selector};
use netpol::{Compiled, Snapshot};
use serde_json::{Value, json};
use test_kit::probe::{Listener, Probe};
use test_kit::{Netns, Node};

pub(crate) const NETWORK: &str = "policy-net";
pub(crate) const DB_PORT: u16 = 5432;
pub(crate) const OTHER_PORT: u16 = 5433;

pub(crate) struct Cluster {
    pub(crate) node: Node,
    pub(crate) probe: Probe,
    pub(crate) pods: Vec<(Netns, PodView)>,
}

impl Cluster {
    /// A node whose bridge network has both families, and `pods` (name,
    /// app label) on it.
    pub(crate) fn new(pods: &[(&str, &str)]) -> Cluster {
        Cluster::with_bridge(pods, &json!({}))
    }

    /// Like [`Cluster::new`], with `options` added to the bridge plugin's
    /// configuration (`hairpinMode`, `isDefaultGateway`).
    pub(crate) fn with_bridge(pods: &[(&str, &str)], options: &Value) -> Cluster {
        let node = Node::new();
        let mut list = json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [{
            "type": "bridge", "bridge": "polbr0", "isGateway": true,
            "ipam": {"type": "host-local", "socket": "",
                     "ranges": [[{"subnet": "10.77.0.0/24"}], [{"subnet": "fd77::/64"}]],
                     "dataDir": node.path("ipam").to_str().expect("UTF-8")}}]});
        for (key, value) in options.as_object().into_iter().flatten() {
            list["plugins"][0][key] = value.clone();
        }
        node.write_conf("10-policy.conflist", &list);
        // Pods on one bridge are judged only if their frames reach the
        // IP hooks (the agent turns these on).
        for name in ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables"] {
            let value = node
                .run("cat", &[&format!("/proc/sys/net/bridge/{name}")])
                .success()
                .stdout;
            assert_eq!(value.trim(), "1", "{name} in the node");
        }
        let pods = pods
            .iter()
            .map(|(name, app)| {
                let ns = node.pod(name);
                let result = node
                    .cnictl(&["--json", "add", NETWORK, ns.path_str()])
                    .success()
                    .json();
                let view = PodView {
                    namespace: "shop".into(),
                    name: (*name).into(),
                    node: Some("n1".into()),
                    labels: [("app".to_owned(), (*app).to_owned())].into(),
                    ips: addresses(&result),
                    ports: vec![],
                };
                (ns, view)
            })
            .collect();
        Cluster {
            node,
            probe: Probe::new(),
            pods,
        }
    }

    pub(crate) fn pod(&self, name: &str) -> &(Netns, PodView) {
        self.pods
            .iter()
            .find(|(_, view)| view.name == name)
            .expect("a pod of that name")
    }

    pub(crate) fn address(&self, name: &str, v6: bool) -> String {
        let (_, view) = self.pod(name);
        view.ips
            .iter()
            .find(|ip| ip.is_ipv6() == v6)
            .expect("an address of that family")
            .to_string()
    }

    pub(crate) fn listen(&self, name: &str) -> Listener {
        self.probe.listen(&self.pod(name).0, &[DB_PORT, OTHER_PORT])
    }

    /// Whether a TCP connection from pod `from` to pod `to` on `port` is
    /// accepted (a dropped SYN times out in 2 s).
    pub(crate) fn connects(&self, from: &str, to: &str, port: u16, v6: bool) -> bool {
        let host = self.address(to, v6);
        self.probe
            .connect(&self.pod(from).0, None, &host, port, None)
            .ok()
    }

    /// Whether pod `from` reaches pod `to` at `to`'s IPv6 link-local
    /// address, which no policy names.
    fn connects_link_local(&self, from: &str, to: &str) -> bool {
        let shown = self
            .pod(to)
            .0
            .ip(&["-6", "-o", "addr", "show", "dev", "eth0", "scope", "link"])
            .success()
            .stdout;
        let address = shown
            .split_whitespace()
            .skip_while(|word| *word != "inet6")
            .nth(1)
            .and_then(|cidr| cidr.split('/').next())
            .expect("a link-local address")
            .to_owned();
        let host = format!("{address}%eth0");
        self.probe
            .connect(&self.pod(from).0, None, &host, DB_PORT, None)
            .ok()
    }

    /// Whether the node itself reaches pod `to` (kubelet's probes).
    fn node_connects(&self, to: &str) -> bool {
        let host = self.address(to, false);
        self.probe
            .connect(&self.node.netns, None, &host, DB_PORT, None)
            .ok()
    }

    pub(crate) fn compile(&self, policies: Vec<Policy>) -> Compiled {
        let snapshot = Snapshot {
            pods: self.pods.iter().map(|(_, view)| view.clone()).collect(),
            namespaces: vec![],
            policies,
        };
        netpol::compile(&snapshot, "n1")
    }

    /// Runs `f` in the node's namespace, through the one RAII helper.
    pub(crate) fn on_node<T>(&self, f: impl FnOnce() -> T) -> T {
        netns::NetNs::open(self.node.netns.path())
            .expect("the node's namespace")
            .run(f)
            .expect("enter the node's namespace")
    }

    /// The policies applied; the ops of the transaction, a line each.
    pub(crate) fn enforce(&self, policies: Vec<Policy>) -> String {
        let compiled = self.compile(policies);
        let (_, ops) = self.on_node(|| netpol::apply(&compiled)).expect("apply");
        ops.iter().map(|op| format!("{op}\n")).collect()
    }

    pub(crate) fn nft(&self, args: &[&str]) -> String {
        let mut full = vec!["netns", "exec", self.node.netns.name(), "nft"];
        full.extend_from_slice(args);
        test_kit::run("ip", &full).success().stdout
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (ns, _) in &self.pods {
            let _ = self.node.cnictl(&["del", NETWORK, ns.path_str()]);
        }
    }
}

fn addresses(result: &Value) -> Vec<IpAddr> {
    result["ips"]
        .as_array()
        .expect("ips")
        .iter()
        .map(|ip| {
            let cidr = ip["address"].as_str().expect("an address");
            cidr.split('/').next().unwrap_or_default().parse().expect("an IP")
        })
        .collect()
}

pub(crate) fn app(name: &str) -> Selector {
    Selector::labels(&[("app", name)])
}

/// `db` takes connections from `web` on the database port only.
pub(crate) fn db_from_web() -> Policy {
    Policy {
        namespace: "shop".into(),
        name: "db-from-web".into(),
        pod_selector: app("db"),
        ingress: Some(vec![Rule {
            peers: Some(vec![Peer::Pods {
                pods: Some(app("web")),
                namespaces: None,
            }]),
            ports: vec![PortSpec::Range(Protocol::Tcp, DB_PORT, DB_PORT)],
        }]),
        egress: None,
    }
}

pub(crate) fn deny_all(ingress: bool, egress: bool) -> Policy {
    Policy {
        namespace: "shop".into(),
        name: "deny".into(),
        pod_selector: Selector::default(),
        ingress: ingress.then(Vec::new),
        egress: egress.then(Vec::new),
    }
}

#[test]
fn ingress_allows_only_what_a_rule_names_in_both_families_and_the_node_always_reaches_its_pods() {
    test_kit::require_root();
    let cluster = Cluster::new(&[("web", "web"), ("db", "db"), ("other", "other")]);
    let _db = cluster.listen("db");
    let _web = cluster.listen("web");
    assert!(
        cluster.connects("other", "db", DB_PORT, false),
        "open before any policy"
    );
    assert!(cluster.connects_link_local("web", "db"), "link-local too");

    cluster.enforce(vec![db_from_web()]);
    for v6 in [false, true] {
        assert!(cluster.connects("web", "db", DB_PORT, v6), "web to db (v6: {v6})");
        assert!(
            !cluster.connects("other", "db", DB_PORT, v6),
            "other to db (v6: {v6})"
        );
    }
    assert!(
        !cluster.connects("web", "db", OTHER_PORT, false),
        "web to db's other port"
    );
    assert!(
        cluster.connects("db", "web", DB_PORT, false),
        "web is selected by no policy: open"
    );
    assert!(cluster.node_connects("db"), "the node reaches its pods");
    assert!(
        !cluster.connects_link_local("web", "db"),
        "a pod's link-local address is no way around its policy"
    );

    // Default deny in the namespace on top: db still takes web (policies
    // add up), web now takes nothing.
    cluster.enforce(vec![db_from_web(), deny_all(true, false)]);
    assert!(cluster.connects("web", "db", DB_PORT, false));
    assert!(!cluster.connects("db", "web", DB_PORT, false));

    // Gone: open again, the table empty of chains.
    cluster.enforce(vec![]);
    assert!(cluster.connects("other", "db", DB_PORT, false));
    let table = cluster.nft(&["list", "table", "inet", netpol::TABLE]);
    assert!(!table.contains("chain in-"), "{table}");
    cluster.on_node(netpol::remove).expect("remove");
    assert!(!cluster.nft(&["list", "tables"]).contains(netpol::TABLE));
}

#[test]
fn egress_is_judged_at_the_source_and_replies_of_allowed_connections_flow() {
    test_kit::require_root();
    let cluster = Cluster::new(&[("web", "web"), ("db", "db"), ("other", "other")]);
    let _db = cluster.listen("db");
    let _other = cluster.listen("other");
    let block = |cidr: &str, except: String| Peer::Block {
        cidr: cidr.parse().expect("a CIDR"),
        except: vec![except.parse().expect("a CIDR")],
    };
    let web_to_db = Policy {
        namespace: "shop".into(),
        name: "web-out".into(),
        pod_selector: app("web"),
        ingress: None,
        egress: Some(vec![Rule {
            peers: Some(vec![
                block("10.77.0.0/24", format!("{}/32", cluster.address("other", false))),
                block("fd77::/64", format!("{}/128", cluster.address("other", true))),
            ]),
            ports: vec![PortSpec::All(Protocol::Tcp)],
        }]),
    };
    cluster.enforce(vec![web_to_db]);
    assert!(cluster.connects("web", "db", DB_PORT, false), "inside the block");
    assert!(
        !cluster.connects("web", "other", DB_PORT, false),
        "the block's exception"
    );
    // IPv6 from a pod whose egress is isolated: its neighbour discovery
    // (untracked, no TCP) passes, or nothing would.
    assert!(
        cluster.connects("web", "db", DB_PORT, true),
        "inside the v6 block"
    );
    assert!(
        !cluster.connects("web", "other", DB_PORT, true),
        "the v6 block's exception"
    );
    // db's egress is open and web's ingress too: db reaches web, and web's
    // replies (egress-isolated) flow back.
    let _web = cluster.listen("web");
    assert!(cluster.connects("db", "web", DB_PORT, false));
    cluster.on_node(netpol::remove).expect("remove");
}

#[test]
fn an_agent_that_comes_back_reconciles_the_table_it_left_instead_of_rebuilding_it() {
    test_kit::require_root();
    let cluster = Cluster::new(&[("web", "web"), ("db", "db")]);
    let _db = cluster.listen("db");
    assert!(
        !cluster
            .enforce(vec![db_from_web(), deny_all(true, true)])
            .is_empty()
    );
    // The same state again: nothing to do, nothing run.
    assert_eq!(cluster.enforce(vec![db_from_web(), deny_all(true, true)]), "");
    // Someone removes an entry: the next pass puts back that entry only.
    let db = cluster.address("db", false);
    cluster.nft(&[
        "delete",
        "element",
        "inet",
        netpol::TABLE,
        "ingress-v4",
        &format!("{{ {db} }}"),
    ]);
    let script = cluster.enforce(vec![db_from_web(), deny_all(true, true)]);
    assert_eq!(script.lines().count(), 1, "{script}");
    assert!(
        script.contains(&format!("ingress-v4 {{ {db} : jump in-")),
        "{script}"
    );
    cluster.on_node(netpol::remove).expect("remove");
}

#[test]
fn a_pass_planned_against_what_the_last_one_left_holds_the_same_and_a_refused_one_falls_back_to_a_listing() {
    test_kit::require_root();
    let cluster = Cluster::new(&[("web", "web"), ("db", "db"), ("other", "other")]);
    let _db = cluster.listen("db");
    let open = cluster.compile(vec![]);
    let isolated = cluster.compile(vec![db_from_web()]);
    let held = || cluster.on_node(netpol::current).expect("list the table");

    // What the agent assumes a pass left is what the kernel lists.
    cluster.on_node(|| netpol::apply(&open)).expect("the first pass");
    assert!(held().holds(&open));
    let (_, ops) = cluster
        .on_node(|| netpol::apply_after(&open, &isolated))
        .expect("a pass with no listing");
    assert!(!ops.is_empty());
    assert!(held().holds(&isolated));
    assert!(cluster.connects("web", "db", DB_PORT, false));
    assert!(!cluster.connects("other", "db", DB_PORT, false));

    // Someone deletes the table: the transaction planned against the last
    // pass is refused, and the pass is planned again from a listing.
    cluster.nft(&["delete", "table", "inet", netpol::TABLE]);
    assert!(
        cluster.connects("other", "db", DB_PORT, false),
        "no table, no policy"
    );
    cluster
        .on_node(|| netpol::apply_after(&open, &isolated))
        .expect("the pass again, from a listing");
    assert!(held().holds(&isolated));
    assert!(!cluster.connects("other", "db", DB_PORT, false));
    assert!(cluster.connects("web", "db", DB_PORT, false));
    cluster.on_node(netpol::remove).expect("remove");
}

#[test]
fn a_table_an_older_agent_left_with_a_peer_set_per_rule_is_taken_over_in_one_pass() {
    test_kit::require_root();
    let cluster = Cluster::new(&[("web", "web"), ("db", "db"), ("other", "other")]);
    let _db = cluster.listen("db");
    // The previous rendering's table: web's addresses in an interval peer
    // set, db's map entries jumping to that rendering's chain.
    cluster.enforce(vec![]);
    let t = format!("inet {}", netpol::TABLE);
    let (old_set, old_chain) = ("peers-00000000000000aa", "in-00000000000000aa");
    let mut script = String::new();
    for (family, ip, key) in [("v4", "ip", "ipv4_addr"), ("v6", "ip6", "ipv6_addr")] {
        let (web, db) = (
            cluster.address("web", family == "v6"),
            cluster.address("db", family == "v6"),
        );
        script += &format!(
            "add set {t} {old_set}-{family} {{ type {key}; flags interval; }}\n\
             add element {t} {old_set}-{family} {{ {web} }}\n\
             add element {t} self-{family} {{ {db} . {db} }}\n"
        );
        if family == "v4" {
            script += &format!("add chain {t} {old_chain}\n");
        }
        script += &format!(
            "add rule {t} {old_chain} {ip} saddr @{old_set}-{family} \
             meta l4proto . th dport {{ tcp . {DB_PORT} }} return\n"
        );
    }
    script += &format!("add rule {t} {old_chain} drop\n");
    for family in ["v4", "v6"] {
        let db = cluster.address("db", family == "v6");
        script += &format!("add element {t} ingress-{family} {{ {db} : jump {old_chain} }}\n");
    }
    let file = tempfile::NamedTempFile::new().expect("a script file");
    std::fs::write(file.path(), &script).expect("write the script");
    cluster.nft(&["-f", &file.path().to_string_lossy()]);
    assert!(cluster.connects("web", "db", DB_PORT, false));
    assert!(
        !cluster.connects("other", "db", DB_PORT, true),
        "the old table holds"
    );

    let compiled = cluster.compile(vec![db_from_web()]);
    let pass = cluster.enforce(vec![db_from_web()]);
    for gone in [
        format!("delete chain {old_chain}"),
        format!("delete set {old_set}-v4"),
        format!("delete set {old_set}-v6"),
    ] {
        assert!(pass.contains(&gone), "{gone:?} not in:\n{pass}");
    }
    assert!(
        cluster
            .on_node(netpol::current)
            .expect("list the table")
            .holds(&compiled)
    );
    let listing = cluster.nft(&["list", "table", "inet", netpol::TABLE]);
    assert!(listing.contains("set peers-v4"), "{listing}");
    assert!(
        !listing.contains(old_set),
        "the older agent's sets are gone: {listing}"
    );
    for v6 in [false, true] {
        assert!(cluster.connects("web", "db", DB_PORT, v6), "web (v6: {v6})");
        assert!(!cluster.connects("other", "db", DB_PORT, v6), "other (v6: {v6})");
    }
    cluster.on_node(netpol::remove).expect("remove");
}

#[test]
fn a_table_someone_made_into_what_no_plan_changes_back_is_made_again_whole() {
    test_kit::require_root();
    let cluster = Cluster::new(&[("web", "web"), ("db", "db"), ("other", "other")]);
    let _db = cluster.listen("db");
    let t = format!("inet {}", netpol::TABLE);
    let isolated = cluster.compile(vec![db_from_web()]);
    for edit in [
        // The base chain hooked at another priority: it cannot be re-hooked.
        vec![
            format!("delete table {t}"),
            format!("add table {t}"),
            format!("add chain {t} forward {{ type filter hook forward priority -10; policy accept; }}"),
        ],
        // A set of ours of another type.
        vec![
            format!("delete table {t}"),
            format!("add table {t}"),
            format!("add set {t} peers-v4 {{ type ipv4_addr; }}"),
        ],
    ] {
        cluster.enforce(vec![db_from_web()]);
        let script = edit.join("\n") + "\n";
        let file = tempfile::NamedTempFile::new().expect("a script file");
        std::fs::write(file.path(), &script).expect("write the script");
        cluster.nft(&["-f", &file.path().to_string_lossy()]);
        let (_, ops) = cluster
            .on_node(|| netpol::apply(&isolated))
            .unwrap_or_else(|e| panic!("made again after {edit:?}: {e}"));
        assert_eq!(ops.first(), Some(&firewall::ruleset::Op::DeleteTable), "{edit:?}");
        assert!(
            cluster.on_node(netpol::current).expect("read").holds(&isolated),
            "{edit:?}"
        );
        assert!(cluster.connects("web", "db", DB_PORT, false), "{edit:?}");
        assert!(!cluster.connects("other", "db", DB_PORT, false), "{edit:?}");
    }
    cluster.on_node(netpol::remove).expect("remove");
}
