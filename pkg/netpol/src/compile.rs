//! NetworkPolicy's semantics, computed for one node's pods: for each pod
//! address a policy isolates, in each direction, the list of what is
//! allowed, with peers as address sets named after the rule they come
//! from (so a pod coming or going changes set elements, not rules).
//!
//! As Kubernetes defines it: a pod no policy selects in a direction is
//! open in it; a selected pod is allowed what any selecting policy's rule
//! allows; a named port is the number the pod it belongs to gives it (the
//! selected pod's for ingress, each destination pod's for egress).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use crate::model::{NamespaceView, Peer, PodView, Policy, PortSpec, Protocol, Rule, Selector};
use crate::ranges::{self, Interval};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    pub fn label(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// The version of how a list is rendered into a chain (`nft`): changing
/// the rendering changes it, so chains are never reused across versions.
pub const RENDERING: &str = "netpol-chain-4";

/// Peer sets of pods' addresses are named after their rule: a pod coming
/// or going is one element. Address blocks, fixed by a policy's text, are
/// named after the blocks of their whole policy (`blocks-<policy's
/// blocks>-<the rule's>`): a policy whose blocks change makes sets of
/// other names, so a kernel set of one policy's blocks is written whole
/// and removed whole, never changed in place (removing thousands of
/// intervals one by one held the node's nf_tables for seconds).
pub const POD_SET_PREFIX: &str = "pods-";
pub const BLOCK_SET_PREFIX: &str = "blocks-";

/// Ports of one protocol, first to last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    pub protocol: Protocol,
    pub first: u16,
    pub last: u16,
}

/// One thing a pod is allowed: from (ingress) or to (egress) the peers in
/// any of some sets (`None`: anyone), on some ports (`None`: any, any
/// protocol).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Allow {
    pub peers: Option<Vec<String>>,
    pub ports: Option<BTreeSet<PortRange>>,
}

/// What a set of pods is allowed in one direction; the same for every pod
/// it applies to, so pods selected alike share one.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AllowList {
    pub direction: Direction,
    pub allows: BTreeSet<Allow>,
}

impl AllowList {
    /// A name that is the same for the same content: `in-`/`eg-` and 16
    /// hex digits.
    pub fn chain_name(&self) -> String {
        let mut text = String::from(self.direction.label());
        for allow in &self.allows {
            let _ = write!(text, "|{:?}|", allow.peers);
            for p in allow.ports.iter().flatten() {
                let _ = write!(text, "{}:{}-{},", p.protocol.keyword(), p.first, p.last);
            }
        }
        let prefix = match self.direction {
            Direction::Ingress => "in",
            Direction::Egress => "eg",
        };
        // The rendering's version is in the name too: a chain rendered
        // otherwise by a newer agent is another chain.
        format!(
            "{prefix}-{}",
            firewall::nft::short_hash(&format!("{RENDERING}|{text}"))
        )
    }
}

/// The kernel state one node's policy needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Compiled {
    /// Per direction, each isolated local pod address and its list's
    /// chain name.
    pub isolated: BTreeMap<Direction, BTreeMap<IpAddr, String>>,
    /// The lists, by chain name.
    pub lists: BTreeMap<String, AllowList>,
    /// Peer sets by name: merged intervals of both families (single
    /// addresses in a set named [`POD_SET_PREFIX`]…).
    pub peer_sets: BTreeMap<String, Vec<Interval>>,
    /// The namespaces that have a policy: a pod started in one while no
    /// agent answers its ADD could be isolated, so its ADD fails.
    pub guarded: BTreeSet<String>,
}

/// Everything policy is computed from.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub pods: Vec<PodView>,
    pub namespaces: Vec<NamespaceView>,
    pub policies: Vec<Policy>,
}

/// What `snapshot`'s policies ask of the pods on `node`.
pub fn compile(snapshot: &Snapshot, node: &str) -> Compiled {
    let namespaces: BTreeMap<&str, &NamespaceView> =
        snapshot.namespaces.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut per_pod: BTreeMap<(Direction, usize), BTreeSet<Allow>> = BTreeMap::new();
    let mut peer_sets: BTreeMap<String, Vec<Interval>> = BTreeMap::new();
    // Found once: a node holds a few dozen of the cluster's pods.
    let local: Vec<usize> = snapshot
        .pods
        .iter()
        .enumerate()
        .filter(|(_, pod)| pod.node.as_deref() == Some(node))
        .map(|(i, _)| i)
        .collect();
    for policy in &snapshot.policies {
        let targets: Vec<usize> = local
            .iter()
            .copied()
            .filter(|&i| {
                let pod = &snapshot.pods[i];
                pod.namespace == policy.namespace && policy.pod_selector.matches(&pod.labels)
            })
            .collect();
        if targets.is_empty() {
            continue;
        }
        let generation = blocks_generation(policy);
        for (direction, rules) in [
            (Direction::Ingress, &policy.ingress),
            (Direction::Egress, &policy.egress),
        ] {
            let Some(rules) = rules else { continue };
            for &target in &targets {
                per_pod.entry((direction, target)).or_default();
            }
            for (index, rule) in rules.iter().enumerate() {
                let origin = format!(
                    "{}/{}/{}/{index}",
                    policy.namespace,
                    policy.name,
                    direction.label()
                );
                let peers = RulePeers::resolve(rule, policy, snapshot, &namespaces);
                for &target in &targets {
                    let mut sets = PeerSets {
                        origin: &origin,
                        generation: &generation,
                        sets: &mut peer_sets,
                    };
                    let allows = allows_of(rule, direction, &peers, &snapshot.pods[target], &mut sets);
                    per_pod.entry((direction, target)).or_default().extend(allows);
                }
            }
        }
    }
    let mut compiled = Compiled {
        peer_sets,
        guarded: snapshot.policies.iter().map(|p| p.namespace.clone()).collect(),
        ..Compiled::default()
    };
    for ((direction, target), allows) in per_pod {
        if snapshot.pods[target].ips.is_empty() {
            // Nothing to judge yet: no chain nobody jumps to.
            continue;
        }
        let list = AllowList { direction, allows };
        let name = list.chain_name();
        for ip in &snapshot.pods[target].ips {
            compiled
                .isolated
                .entry(direction)
                .or_default()
                .insert(*ip, name.clone());
        }
        compiled.lists.insert(name, list);
    }
    compiled
}

/// A rule's peers: every peer (`None` in `Rule::peers`), or the pods its
/// selectors match and its address blocks.
enum RulePeers<'a> {
    Anyone(Vec<&'a PodView>),
    Some {
        pods: Vec<&'a PodView>,
        blocks: Vec<Interval>,
        /// Whether the rule has a pod or namespace selector, and an
        /// address block: what sets it gets depends on its text only,
        /// never on which pods exist.
        selects_pods: bool,
        has_blocks: bool,
    },
}

impl<'a> RulePeers<'a> {
    fn resolve(
        rule: &Rule,
        policy: &Policy,
        snapshot: &'a Snapshot,
        namespaces: &BTreeMap<&str, &NamespaceView>,
    ) -> RulePeers<'a> {
        let Some(peers) = &rule.peers else {
            // Every address: for a named port, the pods that name it.
            return RulePeers::Anyone(snapshot.pods.iter().collect());
        };
        let mut pods = Vec::new();
        let mut blocks = Vec::new();
        let mut selects_pods = false;
        let mut has_blocks = false;
        for peer in peers {
            match peer {
                Peer::Block { cidr, except } => {
                    has_blocks = true;
                    blocks.extend(ranges::block(*cidr, except));
                }
                Peer::Pods {
                    pods: pod_selector,
                    namespaces: namespace_selector,
                } => {
                    selects_pods = true;
                    pods.extend(snapshot.pods.iter().filter(|pod| {
                        let namespace_ok = match namespace_selector {
                            None => pod.namespace == policy.namespace,
                            Some(selector) => namespaces
                                .get(pod.namespace.as_str())
                                .is_some_and(|n| selector.matches(&n.labels)),
                        };
                        namespace_ok
                            && pod_selector
                                .as_ref()
                                .is_none_or(|s: &Selector| s.matches(&pod.labels))
                    }));
                }
            }
        }
        RulePeers::Some {
            pods,
            blocks,
            selects_pods,
            has_blocks,
        }
    }

    fn pods(&self) -> &[&'a PodView] {
        match self {
            RulePeers::Anyone(pods) | RulePeers::Some { pods, .. } => pods,
        }
    }
}

/// The allows one rule gives `target` (its peers named by `origin`).
fn allows_of(
    rule: &Rule,
    direction: Direction,
    peers: &RulePeers<'_>,
    target: &PodView,
    sets: &mut PeerSets<'_>,
) -> Vec<Allow> {
    if rule.ports.is_empty() {
        let peers = sets.every_peer(peers);
        return vec![Allow { peers, ports: None }];
    }
    let mut fixed = BTreeSet::new();
    let mut named = Vec::new();
    for spec in &rule.ports {
        match spec {
            PortSpec::All(protocol) => fixed.insert(PortRange {
                protocol: *protocol,
                first: 0,
                last: u16::MAX,
            }),
            PortSpec::Range(protocol, first, last) => fixed.insert(PortRange {
                protocol: *protocol,
                first: *first,
                last: *last,
            }),
            PortSpec::Named(protocol, name) => {
                named.push((*protocol, name));
                false
            }
        };
    }
    let mut allows = Vec::new();
    match direction {
        // The selected pod's own number for the name.
        Direction::Ingress => {
            for (protocol, name) in named {
                if let Some(port) = target.named_port(name, protocol) {
                    fixed.insert(PortRange {
                        protocol,
                        first: port,
                        last: port,
                    });
                }
            }
        }
        // Each destination pod's number: the peers split by it.
        Direction::Egress => {
            for (protocol, name) in named {
                let mut by_port: BTreeMap<u16, Vec<Interval>> = BTreeMap::new();
                for pod in peers.pods() {
                    if let Some(port) = pod.named_port(name, protocol) {
                        by_port
                            .entry(port)
                            .or_default()
                            .extend(pod.ips.iter().map(|ip| Interval::address(*ip)));
                    }
                }
                for (port, members) in by_port {
                    let suffix = format!("/{}/{name}/{port}", protocol.keyword());
                    allows.push(Allow {
                        peers: Some(vec![sets.named(POD_SET_PREFIX, &suffix, members)]),
                        ports: Some(BTreeSet::from([PortRange {
                            protocol,
                            first: port,
                            last: port,
                        }])),
                    });
                }
            }
        }
    }
    if !fixed.is_empty() {
        let peers = sets.every_peer(peers);
        allows.push(Allow {
            peers,
            ports: Some(merge_ports(fixed)),
        });
    }
    allows
}

/// Names a rule's peer sets after the rule (`origin`), so a pod coming or
/// going changes a set's elements and nothing else, and records their
/// members.
struct PeerSets<'s> {
    origin: &'s str,
    /// A hash of the blocks of the rule's whole policy.
    generation: &'s str,
    sets: &'s mut BTreeMap<String, Vec<Interval>>,
}

/// A hash of every address block of `policy`, in order: what names its
/// rules' block sets.
fn blocks_generation(policy: &Policy) -> String {
    let mut text = format!("{}/{}", policy.namespace, policy.name);
    for rules in [&policy.ingress, &policy.egress] {
        text.push('|');
        for rule in rules.iter().flatten() {
            for peer in rule.peers.iter().flatten() {
                if let Peer::Block { cidr, except } = peer {
                    let _ = write!(text, "{cidr}-{except:?};");
                }
            }
            text.push(',');
        }
    }
    firewall::nft::short_hash(&text)
}

impl PeerSets<'_> {
    fn named(&mut self, prefix: &str, suffix: &str, members: Vec<Interval>) -> String {
        let hash = firewall::nft::short_hash(&format!("{}{suffix}", self.origin));
        let name = format!("{prefix}{hash}");
        self.sets
            .entry(name.clone())
            .or_insert_with(|| ranges::merge(members));
        name
    }

    /// The sets of every peer a rule names: `None` for anyone.
    fn every_peer(&mut self, peers: &RulePeers<'_>) -> Option<Vec<String>> {
        let RulePeers::Some {
            pods,
            blocks,
            selects_pods,
            has_blocks,
        } = peers
        else {
            return None;
        };
        let mut names = Vec::new();
        if *selects_pods {
            let addresses = pods
                .iter()
                .flat_map(|p| p.ips.iter().map(|ip| Interval::address(*ip)))
                .collect();
            names.push(self.named(POD_SET_PREFIX, "", addresses));
        }
        if *has_blocks {
            let blocks = ranges::merge(blocks.clone());
            let content: Vec<String> = blocks.iter().map(ToString::to_string).collect();
            let name = format!(
                "{BLOCK_SET_PREFIX}{}-{}",
                self.generation,
                firewall::nft::short_hash(&content.join(","))
            );
            self.sets.entry(name.clone()).or_insert(blocks);
            names.push(name);
        }
        Some(names)
    }
}

/// Port ranges of each protocol with overlapping and adjacent ones joined:
/// an anonymous set of ranges refuses overlapping elements (`TCP` with
/// any port beside `TCP 443`, `80` beside `80-90`).
fn merge_ports(ports: BTreeSet<PortRange>) -> BTreeSet<PortRange> {
    let mut merged: Vec<PortRange> = Vec::new();
    for next in ports {
        match merged.last_mut() {
            Some(last)
                if last.protocol == next.protocol && u32::from(next.first) <= u32::from(last.last) + 1 =>
            {
                last.last = last.last.max(next.last);
            }
            _ => merged.push(next),
        }
    }
    merged.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{NamedPort, NamespaceView};

    fn pod(ns: &str, name: &str, node: &str, ip: &str, labels: &[(&str, &str)]) -> PodView {
        PodView {
            namespace: ns.into(),
            name: name.into(),
            node: Some(node.into()),
            labels: labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
            ips: ip
                .split(',')
                .map(|ip| ip.parse().expect("test data parses"))
                .collect(),
            ports: Vec::new(),
        }
    }

    fn namespace(name: &str, labels: &[(&str, &str)]) -> NamespaceView {
        NamespaceView {
            name: name.into(),
            labels: labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
        }
    }

    fn policy(ns: &str, selector: Selector, ingress: Option<Vec<Rule>>, egress: Option<Vec<Rule>>) -> Policy {
        Policy {
            namespace: ns.into(),
            name: "p".into(),
            pod_selector: selector,
            ingress,
            egress,
        }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("test data parses")
    }

    /// An allow as text: the peer set's members and the ports.
    type Shown = (Option<Vec<String>>, Option<Vec<String>>);

    /// The allows of the list `address` jumps to in `direction`, with
    /// peer sets shown as their members.
    fn allowed(compiled: &Compiled, direction: Direction, address: &str) -> Option<Vec<Shown>> {
        let chain = compiled.isolated.get(&direction)?.get(&ip(address))?;
        let list = &compiled.lists[chain];
        let mut allows: Vec<_> = list
            .allows
            .iter()
            .map(|a| {
                let peers = a.peers.as_ref().map(|sets| {
                    sets.iter()
                        .flat_map(|set| compiled.peer_sets[set].iter().map(ToString::to_string))
                        .collect()
                });
                let ports = a.ports.as_ref().map(|ports| {
                    ports
                        .iter()
                        .map(|p| format!("{}:{}-{}", p.protocol.keyword(), p.first, p.last))
                        .collect()
                });
                (peers, ports)
            })
            .collect();
        allows.sort();
        Some(allows)
    }

    fn snapshot(policies: Vec<Policy>) -> Snapshot {
        Snapshot {
            pods: vec![
                pod("a", "web", "n1", "10.0.1.2,fd00::2", &[("app", "web")]),
                pod("a", "db", "n1", "10.0.1.3", &[("app", "db")]),
                pod("a", "far", "n2", "10.0.2.2", &[("app", "web")]),
                pod("b", "client", "n2", "10.0.2.3", &[("app", "client")]),
            ],
            namespaces: vec![namespace("a", &[("team", "x")]), namespace("b", &[("team", "y")])],
            policies,
        }
    }

    #[test]
    fn no_policy_isolates_nothing() {
        let compiled = compile(&snapshot(vec![]), "n1");
        assert!(compiled.isolated.is_empty());
        assert!(compiled.lists.is_empty());
    }

    #[test]
    fn a_pod_without_addresses_yet_gets_no_chain_and_is_no_peer() {
        let mut snap = snapshot(vec![policy(
            "a",
            Selector::default(),
            Some(vec![Rule {
                peers: Some(vec![Peer::Pods {
                    pods: Some(Selector::labels(&[("app", "new")])),
                    namespaces: None,
                }]),
                ports: vec![],
            }]),
            None,
        )]);
        let mut new = pod("a", "new", "n1", "10.0.1.9", &[("app", "new")]);
        new.ips.clear();
        snap.pods.push(new);
        let compiled = compile(&snap, "n1");
        // web and db share the one list; the new pod adds none of its own.
        assert_eq!(compiled.lists.len(), 1);
        assert_eq!(
            compiled.isolated[&Direction::Ingress].len(),
            3,
            "web's two, db's one"
        );
        assert_eq!(
            allowed(&compiled, Direction::Ingress, "10.0.1.3"),
            Some(vec![(Some(vec![]), None)]),
            "its peer set is empty until it has an address"
        );
    }

    #[test]
    fn default_deny_isolates_every_local_pod_of_its_namespace_with_nothing_allowed() {
        let deny = policy("a", Selector::default(), Some(vec![]), None);
        let compiled = compile(&snapshot(vec![deny]), "n1");
        for address in ["10.0.1.2", "fd00::2", "10.0.1.3"] {
            assert_eq!(
                allowed(&compiled, Direction::Ingress, address),
                Some(vec![]),
                "{address}"
            );
        }
        // Only this node's pods, and egress stays open.
        assert_eq!(allowed(&compiled, Direction::Ingress, "10.0.2.2"), None);
        assert!(!compiled.isolated.contains_key(&Direction::Egress));
        // Both pods share one chain.
        assert_eq!(compiled.lists.len(), 1);
    }

    #[test]
    fn pod_and_namespace_selectors_pick_peers_as_kubernetes_does() {
        let rule = |peers| Rule {
            peers: Some(peers),
            ports: vec![],
        };
        let same_ns = rule(vec![Peer::Pods {
            pods: Some(Selector::labels(&[("app", "web")])),
            namespaces: None,
        }]);
        let other_ns = rule(vec![Peer::Pods {
            pods: None,
            namespaces: Some(Selector::labels(&[("team", "y")])),
        }]);
        let both = rule(vec![Peer::Pods {
            pods: Some(Selector::labels(&[("app", "web")])),
            namespaces: Some(Selector::default()),
        }]);
        for (rule, members) in [
            (same_ns, vec!["10.0.1.2", "10.0.2.2", "fd00::2"]),
            (other_ns, vec!["10.0.2.3"]),
            (both, vec!["10.0.1.2", "10.0.2.2", "fd00::2"]),
        ] {
            let p = policy("a", Selector::labels(&[("app", "db")]), Some(vec![rule]), None);
            let compiled = compile(&snapshot(vec![p]), "n1");
            let members: Vec<String> = members.into_iter().map(String::from).collect();
            assert_eq!(
                allowed(&compiled, Direction::Ingress, "10.0.1.3"),
                Some(vec![(Some(members), None)])
            );
        }
    }

    #[test]
    fn rules_of_several_policies_add_up_and_an_empty_from_allows_anyone() {
        let ports = |port| Rule {
            peers: None,
            ports: vec![PortSpec::Range(Protocol::Tcp, port, port)],
        };
        let p1 = policy(
            "a",
            Selector::labels(&[("app", "db")]),
            Some(vec![ports(5432)]),
            None,
        );
        let mut p2 = policy("a", Selector::default(), Some(vec![ports(9100)]), None);
        p2.name = "metrics".into();
        let compiled = compile(&snapshot(vec![p1, p2]), "n1");
        let got = allowed(&compiled, Direction::Ingress, "10.0.1.3").expect("present");
        assert_eq!(
            got,
            vec![
                (None, Some(vec!["tcp:5432-5432".into()])),
                (None, Some(vec!["tcp:9100-9100".into()])),
            ]
        );
        assert_eq!(
            allowed(&compiled, Direction::Ingress, "10.0.1.2").expect("present"),
            vec![(None, Some(vec!["tcp:9100-9100".into()]))]
        );
    }

    #[test]
    fn overlapping_ports_of_a_rule_are_joined_per_protocol() {
        let rule = Rule {
            peers: None,
            ports: vec![
                PortSpec::Range(Protocol::Tcp, 443, 443),
                PortSpec::All(Protocol::Tcp),
                PortSpec::Range(Protocol::Udp, 80, 90),
                PortSpec::Range(Protocol::Udp, 91, 91),
                PortSpec::Range(Protocol::Udp, 85, 85),
                PortSpec::Range(Protocol::Sctp, 9, 9),
            ],
        };
        let p = policy("a", Selector::default(), Some(vec![rule]), None);
        let compiled = compile(&snapshot(vec![p]), "n1");
        assert_eq!(
            allowed(&compiled, Direction::Ingress, "10.0.1.3"),
            Some(vec![(
                None,
                Some(vec!["tcp:0-65535".into(), "udp:80-91".into(), "sctp:9-9".into()])
            )])
        );
    }

    #[test]
    fn ip_blocks_leave_their_exceptions_out() {
        let rule = Rule {
            peers: Some(vec![Peer::Block {
                cidr: "10.0.0.0/16".parse().expect("test data parses"),
                except: vec!["10.0.2.0/24".parse().expect("test data parses")],
            }]),
            ports: vec![PortSpec::All(Protocol::Udp)],
        };
        let p = policy("a", Selector::default(), None, Some(vec![rule]));
        let compiled = compile(&snapshot(vec![p]), "n1");
        assert_eq!(
            allowed(&compiled, Direction::Egress, "10.0.1.3"),
            Some(vec![(
                Some(vec!["10.0.0.0-10.0.1.255".into(), "10.0.3.0-10.0.255.255".into()]),
                Some(vec!["udp:0-65535".into()])
            )])
        );
    }

    #[test]
    fn a_named_port_is_the_selected_pods_own_for_ingress_and_each_destinations_for_egress() {
        let mut snap = snapshot(vec![]);
        let named = |port| {
            vec![NamedPort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port,
            }]
        };
        snap.pods[0].ports = named(8080);
        snap.pods[2].ports = named(9090);
        let rule = Rule {
            peers: None,
            ports: vec![PortSpec::Named(Protocol::Tcp, "http".into())],
        };
        snap.policies = vec![policy(
            "a",
            Selector::default(),
            Some(vec![rule.clone()]),
            Some(vec![rule]),
        )];
        let compiled = compile(&snap, "n1");
        assert_eq!(
            allowed(&compiled, Direction::Ingress, "10.0.1.2"),
            Some(vec![(None, Some(vec!["tcp:8080-8080".into()]))])
        );
        // The db pod has no such port: nothing comes in.
        assert_eq!(allowed(&compiled, Direction::Ingress, "10.0.1.3"), Some(vec![]));
        // Out: to each pod that names it, on its number.
        assert_eq!(
            allowed(&compiled, Direction::Egress, "10.0.1.3"),
            Some(vec![
                (
                    Some(vec!["10.0.1.2".into(), "fd00::2".into()]),
                    Some(vec!["tcp:8080-8080".into()])
                ),
                (Some(vec!["10.0.2.2".into()]), Some(vec!["tcp:9090-9090".into()])),
            ])
        );
    }

    #[test]
    fn a_pod_coming_changes_set_members_not_chain_names() {
        let rule = Rule {
            peers: Some(vec![Peer::Pods {
                pods: Some(Selector::labels(&[("app", "web")])),
                namespaces: None,
            }]),
            ports: vec![PortSpec::Range(Protocol::Tcp, 80, 80)],
        };
        let p = policy("a", Selector::labels(&[("app", "db")]), Some(vec![rule]), None);
        let mut snap = snapshot(vec![p]);
        let before = compile(&snap, "n1");
        snap.pods
            .push(pod("a", "web2", "n3", "10.0.3.9", &[("app", "web")]));
        let after = compile(&snap, "n1");
        assert_eq!(before.isolated, after.isolated);
        assert_eq!(before.lists, after.lists);
        assert_ne!(before.peer_sets, after.peer_sets);
    }
}
