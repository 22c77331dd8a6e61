//! The firewall plugin end to end: its iptables layout against Debian's
//! reference binary line for line, real forwarded traffic on a node whose
//! FORWARD policy drops, bridge isolation, and every way a pod's rules go
//! away. Plugins run inside a "node" namespace; the machine's own is never
//! touched.

use std::path::Path;

use serde_json::{Value, json};
use test_kit::{Netns, Node, Run, run_in, run_with_binds, spawn_in};

const REFERENCE: &str = "/usr/lib/cni/firewall";
const NETWORK: &str = "fwnet";

/// `iptables-save -t filter` of both families, without its `#` lines and
/// with every chain's counters zeroed.
fn filter_tables(node: &Node) -> String {
    let mut out = String::new();
    for tool in ["iptables-save", "ip6tables-save"] {
        let saved = node.run(tool, &["-t", "filter"]).success().stdout;
        for line in saved.lines().filter(|l| !l.starts_with('#')) {
            let line = match line.strip_prefix(':').and_then(|l| l.rsplit_once(' ')) {
                Some((chain, _counters)) => format!(":{chain} [0:0]"),
                None => line.to_owned(),
            };
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

/// What a node holds after the first ADD and every pod's DEL: the two
/// chains and two jumps the reference also leaves.
fn base_layout(v6: bool) -> String {
    let table = |admin_jump: bool| {
        let mut t = String::from(
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n\
             :CNI-ADMIN - [0:0]\n:CNI-FORWARD - [0:0]\n\
             -A FORWARD -m comment --comment \"CNI firewall plugin rules\" -j CNI-FORWARD\n",
        );
        if admin_jump {
            t.push_str(
                "-A CNI-FORWARD -m comment --comment \"CNI firewall plugin admin overrides\" -j CNI-ADMIN\n",
            );
        }
        t.push_str("COMMIT\n");
        t
    };
    let v6_table = if v6 {
        table(true)
    } else {
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n".to_owned()
    };
    format!("{}{v6_table}", table(true))
}

fn prev_result(bridge: &str, ips: &[&str]) -> Value {
    let ips: Vec<Value> = ips
        .iter()
        .map(|a| json!({"address": a, "interface": 2}))
        .collect();
    json!({"cniVersion": "1.0.0",
        "interfaces": [{"name": bridge, "mac": "02:00:00:00:00:01"}, {"name": "veth1234"},
                       {"name": "eth0", "sandbox": "/run/netns/x"}],
        "ips": ips, "dns": {}})
}

fn plugin_conf(extra: Value, prev: Option<Value>) -> String {
    let mut conf = json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "firewall"});
    if let (Some(c), Value::Object(e)) = (conf.as_object_mut(), extra) {
        c.extend(e);
        if let Some(prev) = prev {
            c.insert("prevResult".into(), prev);
        }
    }
    conf.to_string()
}

/// Executes a firewall binary in `node` as a runtime would.
fn exec(node: &Node, binary: &Path, command: &str, container: &str, netns: &str, stdin: &str) -> Run {
    let env = [
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", container),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/usr/lib/cni"),
    ];
    run_in(node.netns.path(), binary, &[], &env, stdin)
}

fn ours() -> std::path::PathBuf {
    test_kit::bin("firewall")
}

#[test]
fn the_iptables_layout_is_the_references_line_for_line() {
    let (theirs_node, ours_node) = (Node::new(), Node::new());
    let pod = Netns::new("fwpod");
    let state = ours_node.path("fw-state");
    let state = state.to_str().expect("UTF-8");
    let steps: Vec<(&str, &str, Value, Option<Value>)> = vec![
        (
            "ADD",
            "c1",
            json!({}),
            Some(prev_result("cnifw0", &["10.77.0.5/24", "fd77::5/64"])),
        ),
        (
            "ADD",
            "c2",
            json!({"iptablesAdminChainName": "MY-ADMIN"}),
            Some(prev_result("cnifw0", &["10.77.0.6/24"])),
        ),
        (
            "ADD",
            "c3",
            json!({"ingressPolicy": "same-bridge"}),
            Some(prev_result("cnifw0", &["10.77.0.7/24"])),
        ),
        (
            "ADD",
            "c4",
            json!({"ingressPolicy": "same-bridge", "backend": "iptables"}),
            Some(prev_result("cnifw1", &["10.78.0.7/24", "fd78::7/64"])),
        ),
        (
            "ADD",
            "c1",
            json!({}),
            Some(prev_result("cnifw0", &["10.77.0.5/24", "fd77::5/64"])),
        ),
        (
            "DEL",
            "c2",
            json!({"iptablesAdminChainName": "MY-ADMIN"}),
            Some(prev_result("cnifw0", &["10.77.0.6/24"])),
        ),
        (
            "DEL",
            "c1",
            json!({}),
            Some(prev_result("cnifw0", &["10.77.0.5/24", "fd77::5/64"])),
        ),
    ];
    for (command, container, extra, prev) in steps {
        let mut extra = extra;
        extra["stateDir"] = json!(state);
        let stdin = plugin_conf(extra, prev);
        let theirs = exec(
            &theirs_node,
            Path::new(REFERENCE),
            command,
            container,
            pod.path_str(),
            &stdin,
        )
        .success();
        let mine = exec(&ours_node, &ours(), command, container, pod.path_str(), &stdin).success();
        if command == "ADD" {
            assert_eq!(
                mine.json(),
                theirs.json(),
                "{command} {container}: results differ"
            );
        }
        assert_eq!(
            filter_tables(&ours_node),
            filter_tables(&theirs_node),
            "after {command} {container}"
        );
    }
    // Each removes what the other added: the nodes can switch plugins.
    for (container, extra, prev) in [
        (
            "c3",
            json!({"ingressPolicy": "same-bridge"}),
            prev_result("cnifw0", &["10.77.0.7/24"]),
        ),
        (
            "c4",
            json!({"ingressPolicy": "same-bridge"}),
            prev_result("cnifw1", &["10.78.0.7/24", "fd78::7/64"]),
        ),
    ] {
        let stdin = plugin_conf(extra, Some(prev));
        exec(&theirs_node, &ours(), "DEL", container, pod.path_str(), &stdin).success();
        exec(
            &ours_node,
            Path::new(REFERENCE),
            "DEL",
            container,
            pod.path_str(),
            &stdin,
        )
        .success();
        assert_eq!(
            filter_tables(&ours_node),
            filter_tables(&theirs_node),
            "after DEL {container}"
        );
    }
    let left = filter_tables(&ours_node);
    assert!(
        !left.contains("-A CNI-FORWARD -d") && !left.contains("-A CNI-FORWARD -s"),
        "{left}"
    );
}

/// A node whose FORWARD policy drops, one bridge network, and an
/// "outside" namespace routed through the node.
struct Lab {
    node: Node,
    outside: Netns,
}

impl Lab {
    fn new() -> Self {
        let node = Node::new();
        let outside = Netns::new("outside");
        node.netns.veth_to("out0", &outside);
        node.netns
            .ip(&["addr", "add", "192.168.77.1/24", "dev", "out0"])
            .success();
        node.netns.ip(&["link", "set", "out0", "up"]).success();
        outside
            .ip(&["addr", "add", "192.168.77.2/24", "dev", "eth0"])
            .success();
        outside.ip(&["link", "set", "eth0", "up"]).success();
        outside
            .ip(&["route", "add", "10.0.0.0/8", "via", "192.168.77.1"])
            .success();
        node.run("sysctl", &["-qw", "net.ipv4.ip_forward=1"]).success();
        node.run("iptables", &["-P", "FORWARD", "DROP"]).success();
        Lab { node, outside }
    }

    /// Writes `name`'s conflist: a bridge on `bridge` over `subnet`, then
    /// the firewall with `firewall` (none when `None`).
    fn network(&self, name: &str, bridge: &str, subnet: &str, firewall: Option<Value>) {
        let data_dir = self.node.path("ipam");
        let state = self.node.path("fw-state");
        let mut plugins = vec![json!({"type": "bridge", "bridge": bridge, "isGateway": true,
            "isDefaultGateway": true,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]],
                     "dataDir": data_dir.to_str().expect("UTF-8"), "socket": ""}})];
        if let Some(Value::Object(extra)) = firewall {
            let mut entry = json!({"type": "firewall", "stateDir": state.to_str().expect("UTF-8")});
            if let Some(e) = entry.as_object_mut() {
                e.extend(extra);
            }
            plugins.push(entry);
        }
        self.node.write_conf(
            &format!("10-{name}.conflist"),
            &json!({"cniVersion": "1.1.0", "name": name, "plugins": plugins}),
        );
    }

    fn add(&self, network: &str, pod: &Netns) -> String {
        let result = self
            .node
            .cnictl(&["--json", "add", network, pod.path_str()])
            .success()
            .json();
        let address = result["ips"][0]["address"].as_str().unwrap_or_default();
        address.split('/').next().unwrap_or_default().to_owned()
    }

    fn del(&self, network: &str, pod: &Netns) {
        self.node.cnictl(&["del", network, pod.path_str()]).success();
    }

    fn ping(from: &Netns, to: &str) -> Run {
        run_in(
            from.path(),
            Path::new("busybox"),
            &["ping", "-c", "1", "-W", "1", to],
            &[],
            "",
        )
    }

    fn filter(&self) -> String {
        filter_tables(&self.node)
    }
}

/// The node after every pod is gone: the base layout, with the node's
/// DROP policy.
fn base_with_drop() -> String {
    base_layout(false).replacen(":FORWARD ACCEPT", ":FORWARD DROP", 1)
}

#[test]
fn a_pod_reaches_outside_through_a_dropping_forward_only_with_the_firewall() {
    let lab = Lab::new();
    lab.network(NETWORK, "cnifw0", "10.77.0.0/24", None);
    let pod = lab.node.pod("p");
    lab.add(NETWORK, &pod);
    Lab::ping(&pod, "192.168.77.2").failure();
    lab.del(NETWORK, &pod);

    lab.network(NETWORK, "cnifw0", "10.77.0.0/24", Some(json!({})));
    let ip = lab.add(NETWORK, &pod);
    Lab::ping(&pod, "192.168.77.2").success();
    Lab::ping(&lab.outside, &ip).failure();
    lab.node.cnictl(&["check", NETWORK, pod.path_str()]).success();
    // Someone flushes the chain: CHECK says so.
    lab.node.run("iptables", &["-F", "CNI-FORWARD"]).success();
    let failed = lab
        .node
        .cnictl(&["--json", "check", NETWORK, pod.path_str()])
        .failure()
        .json();
    assert_eq!(failed["code"], 100, "{failed}");
    lab.del(NETWORK, &pod);
    // And the pod is cut off again.
    let again = lab.node.pod("q");
    lab.network(NETWORK, "cnifw0", "10.77.0.0/24", None);
    lab.add(NETWORK, &again);
    Lab::ping(&again, "192.168.77.2").failure();
    lab.del(NETWORK, &again);
}

#[test]
fn same_bridge_isolates_bridges_and_keeps_pods_of_one_bridge_together() {
    let lab = Lab::new();
    for (name, bridge, subnet) in [
        ("neta", "cnifwa", "10.61.0.0/24"),
        ("netb", "cnifwb", "10.62.0.0/24"),
    ] {
        lab.network(name, bridge, subnet, Some(json!({})));
    }
    let (a1, b1) = (lab.node.pod("a1"), lab.node.pod("b1"));
    let ip_a1 = lab.add("neta", &a1);
    let ip_b1 = lab.add("netb", &b1);
    Lab::ping(&a1, &ip_b1).success();

    for (name, bridge, subnet) in [
        ("neta", "cnifwa", "10.61.0.0/24"),
        ("netb", "cnifwb", "10.62.0.0/24"),
    ] {
        lab.network(
            name,
            bridge,
            subnet,
            Some(json!({"ingressPolicy": "same-bridge"})),
        );
    }
    let (a2, b2) = (lab.node.pod("a2"), lab.node.pod("b2"));
    let ip_a2 = lab.add("neta", &a2);
    let ip_b2 = lab.add("netb", &b2);
    Lab::ping(&a2, &ip_a1).success();
    Lab::ping(&b2, &ip_b1).success();
    for (from, to) in [(&a1, &ip_b1), (&a2, &ip_b2), (&b2, &ip_a2), (&b1, &ip_a1)] {
        Lab::ping(from, to).failure();
    }
    Lab::ping(&a2, "192.168.77.2").success();
    lab.node.cnictl(&["check", "neta", a2.path_str()]).success();
    for (network, pod) in [("neta", &a1), ("netb", &b1), ("neta", &a2), ("netb", &b2)] {
        lab.del(network, pod);
    }
    let left = lab.filter();
    assert!(
        !left.contains("-A CNI-FORWARD -d") && !left.contains("-A CNI-FORWARD -s"),
        "{left}"
    );
    assert!(
        left.contains("-A CNI-ISOLATION-STAGE-2 -o cnifwb"),
        "bridges keep their isolation: {left}"
    );
}

#[test]
fn every_del_path_and_gc_leave_only_the_base_chains() {
    let lab = Lab::new();
    lab.network(NETWORK, "cnifw0", "10.77.0.0/24", Some(json!({})));
    let pods: Vec<Netns> = (0..5).map(|i| lab.node.pod(&format!("d{i}"))).collect();
    let ids: Vec<String> = pods
        .iter()
        .map(|p| test_kit::cnitool_container_id(p.path_str()))
        .collect();
    let ips: Vec<String> = pods.iter().map(|p| lab.add(NETWORK, p)).collect();
    for ip in &ips {
        assert!(
            lab.filter()
                .contains(&format!("-A CNI-FORWARD -s {ip}/32 -j ACCEPT"))
        );
    }
    let state = lab.node.path("fw-state");
    let conf = |extra: Value| {
        let mut extra = extra;
        extra["stateDir"] = json!(state.to_str().expect("UTF-8"));
        plugin_conf(extra, None)
    };
    // 1. Through the runtime, with the cached prevResult.
    lab.del(NETWORK, &pods[0]);
    // 2. Without prevResult, the namespace already gone (CNI_NETNS empty).
    exec(&lab.node, &ours(), "DEL", &ids[1], "", &conf(json!({}))).success();
    // 3. A pod the reference plugin added: no record, no prevResult; its
    //    addresses are read in its namespace.
    let reference_pod = lab.node.pod("ref");
    lab.node.netns.veth_to("vref", &reference_pod);
    reference_pod
        .ip(&["addr", "add", "10.77.0.200/24", "dev", "eth0"])
        .success();
    let with_prev = plugin_conf(json!({}), Some(prev_result("cnifw0", &["10.77.0.200/24"])));
    exec(
        &lab.node,
        Path::new(REFERENCE),
        "ADD",
        "ref-ctr",
        reference_pod.path_str(),
        &with_prev,
    )
    .success();
    exec(
        &lab.node,
        &ours(),
        "DEL",
        "ref-ctr",
        reference_pod.path_str(),
        &conf(json!({})),
    )
    .success();
    assert!(!lab.filter().contains("10.77.0.200"), "{}", lab.filter());
    // 4. GC: one pod stays valid, the rest go. Their cached results are
    //    lost first (a node reboot), so the runtime cannot DEL them: only
    //    the plugin's GC removes their rules.
    for id in &ids[3..] {
        let cached = lab
            .node
            .cache_dir()
            .join("results")
            .join(format!("{NETWORK}-{id}-eth0"));
        std::fs::remove_file(cached).expect("cached result");
    }
    lab.node
        .cnictl(&["gc", NETWORK, "--valid", &format!("{}/eth0", ids[2])])
        .success();
    let left = lab.filter();
    assert!(left.contains(&format!("-s {}/32", ips[2])), "{left}");
    for ip in [&ips[3], &ips[4]] {
        assert!(!left.contains(&format!("{ip}/32")), "{ip} left: {left}");
    }
    // 5. DEL of a deleted pod, and of one never added, succeed.
    lab.del(NETWORK, &pods[2]);
    exec(&lab.node, &ours(), "DEL", &ids[2], "", &conf(json!({}))).success();
    exec(&lab.node, &ours(), "DEL", "never-added", "", &conf(json!({}))).success();
    // 6. A file where the state directory should be holds no record:
    //    DEL does not fail on it.
    let in_the_way = lab.node.path("fw-state-file");
    std::fs::write(&in_the_way, "").expect("a file in the way");
    let over_file = plugin_conf(json!({"stateDir": in_the_way.to_str().expect("UTF-8")}), None);
    exec(&lab.node, &ours(), "DEL", &ids[0], "", &over_file).success();
    assert_eq!(lab.filter(), base_with_drop());
    let records = std::fs::read_dir(state.join(NETWORK))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(records, 0, "every record goes with its rules");
}

#[test]
fn the_nftables_backend_keeps_commented_rules_in_its_own_table() {
    let lab = Lab::new();
    lab.node.run("iptables", &["-P", "FORWARD", "ACCEPT"]).success();
    for (name, bridge, subnet) in [
        ("neta", "cnifwa", "10.61.0.0/24"),
        ("netb", "cnifwb", "10.62.0.0/24"),
    ] {
        lab.network(
            name,
            bridge,
            subnet,
            Some(json!({"backend": "nftables", "ingressPolicy": "same-bridge"})),
        );
    }
    let (a1, a2, b1) = (lab.node.pod("a1"), lab.node.pod("a2"), lab.node.pod("b1"));
    let ip_a1 = lab.add("neta", &a1);
    lab.add("neta", &a2);
    let ip_b1 = lab.add("netb", &b1);
    let listing = lab
        .node
        .run("nft", &["list", "table", "inet", "cni_firewall"])
        .success()
        .stdout;
    let id = test_kit::cnitool_container_id(a1.path_str());
    assert!(
        listing.contains(&format!("ip saddr {ip_a1} accept comment"))
            && listing.contains(&format!("id: {id}")),
        "{listing}"
    );
    // A drop is final in nftables: the isolation holds.
    Lab::ping(&a2, &ip_a1).success();
    Lab::ping(&a1, &ip_b1).failure();
    Lab::ping(&b1, &ip_a1).failure();
    lab.node.cnictl(&["check", "neta", a1.path_str()]).success();
    assert!(
        !lab.filter().contains("CNI-FORWARD"),
        "no iptables rules: {}",
        lab.filter()
    );
    lab.del("neta", &a1);
    let listing = lab
        .node
        .run("nft", &["list", "table", "inet", "cni_firewall"])
        .success()
        .stdout;
    assert!(!listing.contains(&format!("{ip_a1} ")), "{listing}");
    lab.node.cnictl(&["gc", "neta", "--all"]).success();
    lab.node.cnictl(&["gc", "netb", "--all"]).success();
    let listing = lab
        .node
        .run("nft", &["list", "table", "inet", "cni_firewall"])
        .success()
        .stdout;
    assert!(
        !listing.contains(" accept comment \""),
        "pod rules left: {listing}"
    );
}

#[test]
fn firewalld_is_refused_and_status_reports_unusable_tools() {
    let lab = Lab::new();
    let pod = lab.node.pod("p");
    let prev = Some(prev_result("cnifw0", &["10.77.0.5/24"]));
    let refused = exec(
        &lab.node,
        &ours(),
        "ADD",
        "c1",
        pod.path_str(),
        &plugin_conf(json!({"backend": "firewalld"}), prev.clone()),
    )
    .failure()
    .json();
    assert_eq!(refused["code"], 7);
    assert!(
        refused["msg"].as_str().unwrap_or_default().contains("D-Bus"),
        "{refused}"
    );
    let missing = exec(
        &lab.node,
        &ours(),
        "ADD",
        "c1",
        pod.path_str(),
        &plugin_conf(json!({}), None),
    )
    .failure()
    .json();
    assert_eq!(missing["msg"], "missing prevResult from earlier plugin");
    let status_conf = json!({"cniVersion": "1.1.0", "name": NETWORK, "type": "firewall"}).to_string();
    let env = [("CNI_COMMAND", "STATUS"), ("CNI_PATH", "/usr/lib/cni")];
    run_in(lab.node.netns.path(), &ours(), &[], &env, &status_conf).success();
    // iptables-save that cannot run: /dev/null over the multi-call binary
    // in a private mount namespace.
    let tool = std::fs::canonicalize("/usr/sbin/iptables-save").expect("iptables-save installed");
    let mut env_vars: Vec<(&str, &str)> = env.to_vec();
    env_vars.push(("PATH", "/usr/sbin:/usr/bin"));
    // run_with_binds feeds no stdin, so a shell pipes the configuration in.
    let script = format!("printf '%s' '{status_conf}' | {}", ours().display());
    let status = run_with_binds(
        &[(Path::new("/dev/null"), tool.as_path())],
        lab.node.netns.path(),
        Path::new("/bin/sh"),
        &["-c", &script],
        &env_vars,
    )
    .failure()
    .json();
    assert_eq!(status["code"], 50, "{status}");
}

/// How long a plugin may take before it counts as hung.
const HUNG_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// [`exec`] of ours, failing the test when it has not returned within
/// [`HUNG_AFTER`] (it is killed then): a blocked plugin must fail the
/// test, not hang the suite.
fn exec_within(node: &Node, command: &str, container: &str, netns: &str, stdin: &str) -> Run {
    let env = [
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", container),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/usr/lib/cni"),
    ];
    let what = format!("firewall {command} {container}");
    let child = spawn_in(node.netns.path(), &ours(), &[], &env, stdin);
    test_kit::finish_within(&what, child, HUNG_AFTER)
        .unwrap_or_else(|run| panic!("{what} did not return within {HUNG_AFTER:?}: {run:?}"))
}

fn with_state_dir(state: &Path, prev: Option<Value>) -> String {
    plugin_conf(json!({"stateDir": state}), prev)
}

/// A FIFO and a link to one among firewall's records, and a FIFO where a
/// network's directory would be, hold no DEL (its own record, and every
/// record read under the node's lock for addresses still in use) and no
/// GC, and fail neither. On 9b8b637 the first DEL blocks opening the FIFO
/// for ever.
#[test]
fn special_files_in_the_state_directory_hold_no_del_or_gc() {
    let node = Node::new();
    let pod = node.pod("fwpod");
    let state = node.path("fw-state");
    let add = |id: &str, ip: &str| {
        let prev = prev_result("cnifw0", &[ip]);
        exec_within(
            &node,
            "ADD",
            id,
            pod.path_str(),
            &with_state_dir(&state, Some(prev)),
        )
        .success();
    };
    add("c1", "10.79.0.5/24");
    add("c2", "10.79.0.6/24");
    let records = state.join(NETWORK);
    test_kit::mkfifo(&records.join("fifo-eth0"));
    std::os::unix::fs::symlink(records.join("fifo-eth0"), records.join("linked-eth0")).expect("link");
    test_kit::mkfifo(&state.join("fifo-network"));
    for id in ["fifo", "linked", "c1"] {
        exec_within(&node, "DEL", id, "", &with_state_dir(&state, None)).success();
    }
    assert!(
        !filter_tables(&node).contains("10.79.0.5"),
        "{}",
        filter_tables(&node)
    );
    assert!(
        filter_tables(&node).contains("10.79.0.6"),
        "{}",
        filter_tables(&node)
    );
    let gc = json!({"cniVersion": "1.1.0", "name": NETWORK, "type": "firewall", "stateDir": state,
                    "cni.dev/valid-attachments": []});
    exec_within(&node, "GC", "", "", &gc.to_string()).success();
    assert!(
        !filter_tables(&node).contains("10.79.0.6"),
        "{}",
        filter_tables(&node)
    );
    assert!(
        !records.join("c2-eth0").exists(),
        "GC removed the record with the rules"
    );
}

/// A state directory, or a network's directory in it, that is a link to
/// another directory gets no record written through it: the ADD is
/// refused, naming the link, before any rule is written (a DEL without
/// its record could miss them), and nothing appears where the link points.
/// The runtime's DEL after the failed ADD succeeds. On 9b8b637 the record
/// lands in the link's target.
#[test]
fn no_record_is_written_through_a_linked_state_directory() {
    let node = Node::new();
    let pod = node.pod("fwpod");
    let (elsewhere, also_elsewhere) = (node.path("elsewhere"), node.path("also-elsewhere"));
    std::fs::create_dir_all(&elsewhere).expect("mkdir");
    std::fs::create_dir_all(&also_elsewhere).expect("mkdir");
    let linked_state = node.path("fw-state-link");
    std::os::unix::fs::symlink(&elsewhere, &linked_state).expect("link");
    let state = node.path("fw-state");
    std::fs::create_dir_all(&state).expect("mkdir");
    std::os::unix::fs::symlink(&also_elsewhere, state.join(NETWORK)).expect("link");
    let written = |dir: &Path| test_kit::files_under(dir).join("\n");
    for state_dir in [&linked_state, &state] {
        let prev = prev_result("cnifw0", &["10.79.0.7/24"]);
        let add = exec_within(
            &node,
            "ADD",
            "c1",
            pod.path_str(),
            &with_state_dir(state_dir, Some(prev)),
        );
        assert_eq!(
            written(&elsewhere) + &written(&also_elsewhere),
            "",
            "written through a link: {add:?}"
        );
        let refused = add.failure();
        assert!(refused.stdout.contains("symbolic link"), "{refused:?}");
        assert!(
            !filter_tables(&node).contains("10.79.0.7"),
            "{}",
            filter_tables(&node)
        );
        exec_within(
            &node,
            "DEL",
            "c1",
            pod.path_str(),
            &with_state_dir(state_dir, None),
        )
        .success();
    }
}

/// Our DEL of `container` in `node`, as a runtime without the pod's
/// namespace or its cached result runs it (CNI_NETNS empty, no
/// prevResult), with `binds` mounted over files for its run alone.
fn del_with_binds(node: &Node, binds: &[(&Path, &Path)], container: &str, conf: &str) -> Run {
    let env = [
        ("CNI_COMMAND", "DEL"),
        ("CNI_CONTAINERID", container),
        ("CNI_NETNS", ""),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/usr/lib/cni"),
        ("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
    ];
    // run_with_binds feeds no stdin, so a shell pipes the configuration in.
    let script = format!("printf '%s' '{conf}' | {}", ours().display());
    run_with_binds(
        binds,
        node.netns.path(),
        Path::new("/bin/sh"),
        &["-c", &script],
        &env,
    )
}

/// Every file under `dir` that is not a directory (records, claims,
/// marks; the directories may stay, as the network's always did).
fn regular_files_under(dir: &Path) -> Vec<String> {
    test_kit::files_under(dir)
        .into_iter()
        .filter(|path| !Path::new(path).is_dir())
        .collect()
}

/// The pod rules of `ip` in the node's filter table.
fn has_rules_of(node: &Node, ip: &str) -> bool {
    filter_tables(node).contains(&format!("-s {ip}/32 -j ACCEPT"))
}

/// A DEL keeps the rules of an address another record holds without
/// reading every record on the node: only the records claiming its own
/// addresses. A record of another address that cannot be read (EACCES: a
/// write-only sysctl mounted over it) no longer stops a DEL; one claiming
/// the DEL's own address still keeps its rules. On 092f8cd every DEL read
/// every record and failed on that one, its rules left.
#[test]
fn a_del_reads_only_the_records_claiming_its_addresses() {
    let node = Node::new();
    let pod = node.pod("fwpod");
    let state = node.path("fw-state");
    let add = |network: &str, id: &str, ip: &str| {
        let mut conf: Value =
            serde_json::from_str(&with_state_dir(&state, Some(prev_result("cnifw0", &[ip])))).expect("JSON");
        conf["name"] = json!(network);
        exec_within(&node, "ADD", id, pod.path_str(), &conf.to_string()).success();
    };
    add(NETWORK, "c1", "10.79.1.5/24");
    add(NETWORK, "c2", "10.79.1.6/24");
    add("fwnet-b", "c3", "10.79.1.6/24");
    let unreadable = Path::new("/proc/sys/vm/drop_caches");
    let c2_record = state.join(NETWORK).join("c2:eth0");
    let binds = [(unreadable, c2_record.as_path())];
    let conf = with_state_dir(&state, None);
    del_with_binds(&node, &binds, "c1", &conf).success();
    assert!(!has_rules_of(&node, "10.79.1.5"), "{}", filter_tables(&node));
    let mut other_network: Value = serde_json::from_str(&conf).expect("JSON");
    other_network["name"] = json!("fwnet-b");
    let other_network = other_network.to_string();
    let kept = del_with_binds(&node, &binds, "c3", &other_network).failure();
    assert!(kept.stdout.contains("rules kept"), "{kept:?}");
    assert!(has_rules_of(&node, "10.79.1.6"), "{}", filter_tables(&node));
    exec_within(&node, "DEL", "c3", "", &other_network).success();
    assert!(has_rules_of(&node, "10.79.1.6"), "c2 still holds it");
    exec_within(&node, "DEL", "c2", "", &conf).success();
    assert!(!has_rules_of(&node, "10.79.1.6"), "{}", filter_tables(&node));
    assert_eq!(
        regular_files_under(&state),
        Vec::<String>::new(),
        "records and their index go with the rules"
    );
}

/// Records written by the release before the index (092f8cd, and the
/// first release's `<id>-<ifname>` name), with the rules its ADD made (the
/// reference's layout, made here by the reference plugin): after the
/// upgrade each DEL, without prevResult or namespace, still finds its
/// addresses and keeps those another network's old record holds, and the
/// old records are indexed on the way (`.indexed-<network>`).
#[test]
fn records_written_before_the_index_keep_working_after_an_upgrade() {
    let node = Node::new();
    let pod = node.pod("fwpod");
    let state = node.path("fw-state");
    let old_record = |network: &str, name: &str, id: &str, ip: &str| {
        let dir = state.join(network);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let record = format!(r#"{{"containerID":"{id}","ifname":"eth0","ips":["{ip}"]}}"#);
        std::fs::write(dir.join(name), record).expect("write");
        let mut conf: Value = serde_json::from_str(&plugin_conf(
            json!({}),
            Some(prev_result("cnifw0", &[&format!("{ip}/24")])),
        ))
        .expect("JSON");
        conf["name"] = json!(network);
        exec(
            &node,
            Path::new(REFERENCE),
            "ADD",
            id,
            pod.path_str(),
            &conf.to_string(),
        )
        .success();
    };
    old_record("old-a", "a1:eth0", "a1", "10.79.2.5");
    old_record("old-b", "b1-eth0", "b1", "10.79.2.5");
    old_record("old-b", "b2:eth0", "b2", "10.79.2.6");
    let conf = |network: &str| {
        let mut conf: Value = serde_json::from_str(&with_state_dir(&state, None)).expect("JSON");
        conf["name"] = json!(network);
        conf.to_string()
    };
    exec_within(&node, "DEL", "a1", "", &conf("old-a")).success();
    assert!(
        has_rules_of(&node, "10.79.2.5"),
        "b1 holds it: {}",
        filter_tables(&node)
    );
    assert!(!state.join("old-a").join("a1:eth0").exists());
    let indexed: Vec<String> = std::fs::read_dir(state.join(".indexed-old-b"))
        .map(|dir| {
            dir.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        indexed.contains(&"b1-eth0".to_owned()) && indexed.contains(&"b2:eth0".to_owned()),
        "the old records are indexed: {indexed:?}"
    );
    exec_within(&node, "DEL", "b1", "", &conf("old-b")).success();
    assert!(!has_rules_of(&node, "10.79.2.5"), "{}", filter_tables(&node));
    exec_within(&node, "DEL", "b2", "", &conf("old-b")).success();
    assert!(!has_rules_of(&node, "10.79.2.6"), "{}", filter_tables(&node));
    assert_eq!(regular_files_under(&state), Vec::<String>::new());
}

/// The firewall killed (-9) at each of its named points (`cni::fault`,
/// `make fault-bin`) while another network's pod holds the same address:
/// whatever the kill left, the next DEL of either removes the rules once
/// no one holds the address, and the runtime's DEL of the killed call
/// succeeds. Nothing is left behind.
#[test]
fn a_kill_between_the_steps_never_leaves_a_del_unable_to_remove_rules() {
    let node = Node::new();
    let pod = node.pod("fwpod");
    let state = node.path("fw-state");
    let faulty = test_kit::fault_bin()
        .parent()
        .expect("the fault builds' directory")
        .join("firewall");
    let conf = |network: &str, ip: Option<&str>| {
        let prev = ip.map(|ip| prev_result("cnifw0", &[&format!("{ip}/24")]));
        let mut conf: Value = serde_json::from_str(&with_state_dir(&state, prev)).expect("JSON");
        conf["name"] = json!(network);
        conf.to_string()
    };
    let killed_at = |point: &str, command: &str, id: &str, stdin: &str| {
        let ready = node.path(&format!("ready-{id}"));
        let env = [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", id),
            ("CNI_NETNS", pod.path_str()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/usr/lib/cni"),
            ("CNI_SUITE_FAULT_PAUSE", point),
            ("CNI_SUITE_FAULT_READY", ready.to_str().expect("UTF-8")),
        ];
        let mut child = spawn_in(node.netns.path(), &faulty, &[], &env, stdin);
        test_kit::wait_for(
            &format!("{command} to reach {point}"),
            std::time::Duration::from_secs(20),
            || ready.exists(),
        );
        child.kill().expect("kill -9");
        child.wait().expect("reaped");
    };
    for (n, point) in [
        "firewall:claimed",
        "firewall:recorded",
        "firewall:del-rules-removed",
        "firewall:del-unrecorded",
    ]
    .into_iter()
    .enumerate()
    {
        let ip = format!("10.79.3.{}", n + 5);
        let (victim, holder) = (format!("victim-{n}"), format!("holder-{n}"));
        exec_within(
            &node,
            "ADD",
            &holder,
            pod.path_str(),
            &conf("fw-holders", Some(&ip)),
        )
        .success();
        if point.starts_with("firewall:del-") {
            exec_within(&node, "ADD", &victim, pod.path_str(), &conf(NETWORK, Some(&ip))).success();
            killed_at(point, "DEL", &victim, &conf(NETWORK, Some(&ip)));
        } else {
            killed_at(point, "ADD", &victim, &conf(NETWORK, Some(&ip)));
        }
        // The holder goes first: its DEL keeps the rules only while the
        // victim's record (not a claim alone) still holds the address.
        exec_within(&node, "DEL", &holder, "", &conf("fw-holders", None)).success();
        let victim_recorded = matches!(point, "firewall:recorded" | "firewall:del-rules-removed");
        assert_eq!(
            has_rules_of(&node, &ip),
            victim_recorded,
            "after a kill at {point}: {}",
            filter_tables(&node)
        );
        // The runtime's DEL of the killed call: no cached result after a
        // failed ADD, the one it holds for a DEL.
        let prev = point.starts_with("firewall:del-").then_some(ip.as_str());
        exec_within(&node, "DEL", &victim, "", &conf(NETWORK, prev)).success();
        assert!(
            !has_rules_of(&node, &ip),
            "after a kill at {point}: {}",
            filter_tables(&node)
        );
    }
    assert_eq!(regular_files_under(&state), Vec::<String>::new(), "nothing left");
}
