//! portmap: host ports reach pods (TCP and UDP, both families, with and
//! without hostIP, hairpin, from a neighbour and from the node's own
//! 127.0.0.1), the reference's iptables layout rule for rule, ours and
//! Debian's 1.1.1 replacing each other, conntrack flushed on DEL, every DEL
//! and GC path leaving nothing, and upstream's nftables layout.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use test_kit::probe::{Listener, Probe};
use test_kit::{Netns, Node, Run, bin, files_under, mkfifo, run_in, spawn_in, wait_for};

const REFERENCE: &str = "/usr/lib/cni/portmap";
const NETWORK: &str = "pm";
const NODE_V4: &str = "192.0.2.1";
const NODE_V6: &str = "2001:db8:7::1";
/// A second node address: mappings bound to NODE_V4 must not answer here.
const OTHER_NODE_V4: &str = "198.51.100.1";

/// A node with a client namespace on a link of its own, as a machine on the
/// node's network.
struct Site {
    node: Node,
    client: Netns,
    probe: Probe,
}

impl Site {
    fn new() -> Self {
        let node = Node::new();
        let client = Netns::new("client");
        node.netns.ip(&["link", "set", "lo", "up"]).success();
        node.netns.veth_to("cl0", &client);
        for (ns, link, addresses) in [
            (
                &node.netns,
                "cl0",
                [
                    format!("{NODE_V4}/24"),
                    format!("{OTHER_NODE_V4}/24"),
                    format!("{NODE_V6}/64"),
                ],
            ),
            (
                &client,
                "eth0",
                [
                    "192.0.2.2/24".into(),
                    "198.51.100.2/24".into(),
                    "2001:db8:7::2/64".into(),
                ],
            ),
        ] {
            for address in &addresses {
                let mut args = vec!["addr", "add", address.as_str(), "dev", link];
                if address.contains(':') {
                    args.push("nodad");
                }
                ns.ip(&args).success();
            }
            ns.ip(&["link", "set", link, "up"]).success();
        }
        client.ip(&["link", "set", "lo", "up"]).success();
        Site {
            node,
            client,
            probe: Probe::new(),
        }
    }

    fn conflist(&self, bridge: &str, subnet: u8, mut portmap: Value) -> Value {
        portmap["stateDir"] = json!(self.node.path("portmap").to_str().expect("UTF-8"));
        json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": bridge, "isGateway": true, "ipMasq": true, "hairpinMode": true,
             "ipam": {"type": "host-local", "socket": "",
                      "dataDir": self.node.path("ipam").to_str().expect("UTF-8"),
                      "ranges": [[{"subnet": format!("10.{subnet}.0.0/24")}], [{"subnet": format!("fd{subnet}::/64")}]],
                      "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}},
            portmap]})
    }

    fn run(&self, args: &[&str], mappings: &Value) -> Run {
        let cap_args = json!({"portMappings": mappings}).to_string();
        self.node.cnictl_env(args, &[("CAP_ARGS", &cap_args)])
    }

    fn add(&self, pod: &Netns, mappings: &Value) -> Value {
        pod.ip(&["link", "set", "lo", "up"]).success();
        self.run(&["--json", "add", NETWORK, pod.path_str()], mappings)
            .success()
            .json()
    }

    fn del(&self, pod: &Netns, mappings: &Value) {
        self.run(&["del", NETWORK, pod.path_str()], mappings).success();
    }

    /// The nat rules of both families and the nftables ruleset.
    fn rules(&self) -> String {
        let mut all = String::new();
        for tool in ["iptables-save", "ip6tables-save"] {
            all.push_str(&self.node.run(tool, &["-t", "nat"]).success().stdout);
        }
        all + &self.node.run("nft", &["list", "ruleset"]).success().stdout
    }

    /// What a pod's mappings may leave: its chain, the jumps to it, rules
    /// naming it.
    fn leftovers(&self, container_id: &str) -> Vec<String> {
        self.leftovers_in(NETWORK, container_id)
    }

    fn leftovers_in(&self, network: &str, container_id: &str) -> Vec<String> {
        let chain = dnat_chain(network, container_id);
        self.rules()
            .lines()
            .filter(|l| l.contains(&chain) || l.contains(&format!("\"{container_id}\"")))
            .filter(|l| !l.starts_with('#'))
            .map(str::to_owned)
            .collect()
    }
}

/// The reference's name for a pod's chain, computed with coreutils so the
/// test does not share the code under test: `CNI-DN-` and the start of
/// sha512(network + container ID).
fn dnat_chain(network: &str, container_id: &str) -> String {
    let hash = test_kit::run(
        "sh",
        &[
            "-c",
            "printf %s \"$1\" | sha512sum | cut -c1-21",
            "sh",
            &format!("{network}{container_id}"),
        ],
    )
    .success()
    .stdout;
    format!("CNI-DN-{}", hash.trim())
}

fn mappings() -> Value {
    json!([
        {"hostPort": 18080, "containerPort": 8080, "protocol": "tcp"},
        {"HostPort": 18053, "ContainerPort": 5353, "Protocol": "udp", "HostIP": ""},
        {"hostPort": 18443, "containerPort": 8080, "protocol": "tcp", "hostIP": NODE_V4},
    ])
}

fn count(listener: &Listener, line: &str) -> usize {
    listener.lines().iter().filter(|l| *l == line).count()
}

fn wait_count(listener: &Listener, line: &str, wanted: usize) {
    wait_for(&format!("{wanted} × {line:?}"), Duration::from_secs(5), || {
        count(listener, line) >= wanted
    });
    assert_eq!(count(listener, line), wanted, "{line}: {:?}", listener.all());
}

fn pod_address(result: &Value, v4: bool) -> String {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str())
        .find(|a| a.contains('.') == v4)
        .and_then(|a| a.split('/').next())
        .unwrap_or_else(|| panic!("no address in {result}"))
        .to_owned()
}

/// Everything a pod's published ports must do, in one backend.
fn traffic_reaches_pods_through_host_ports(backend: &str, bridge: &str, subnet: u8) {
    let site = Site::new();
    let list = site.conflist(
        bridge,
        subnet,
        json!({"type": "portmap", "backend": backend, "capabilities": {"portMappings": true}}),
    );
    site.node.write_conf("10-pm.conflist", &list);
    let (pod, neighbour) = (site.node.pod("pod"), site.node.pod("neighbour"));
    let result = site.add(&pod, &mappings());
    site.add(&neighbour, &json!([]));
    let (v4, v6) = (pod_address(&result, true), pod_address(&result, false));
    let listener = site
        .probe
        .listen_on(&pod, &["8080".to_owned(), "udp:5353".to_owned()]);
    let tcp4 = format!("tcp 8080 {v4}:8080");
    let tcp6 = format!("tcp 8080 [{v6}]:8080");

    // From a machine on the node's network, both families, TCP and UDP.
    site.probe
        .connect(&site.client, None, NODE_V4, 18080, None)
        .success();
    wait_count(&listener, &tcp4, 1);
    // The bridge's IPv6 gateway answers neighbour solicitations only once
    // its duplicate address detection is over.
    wait_for("the bridge's IPv6 address", Duration::from_secs(5), || {
        let tentative = site
            .node
            .netns
            .ip(&["-6", "addr", "show", "dev", bridge, "tentative"]);
        tentative.stdout.trim().is_empty()
    });
    site.probe
        .connect(&site.client, None, NODE_V6, 18080, None)
        .success();
    wait_count(&listener, &tcp6, 1);
    site.probe.udp(&site.client, NODE_V4, 18053).success();
    wait_count(&listener, "udp 5353", 1);
    site.probe.udp(&site.client, NODE_V6, 18053).success();
    wait_count(&listener, "udp 5353", 2);
    // hostIP: that address only, and only its family.
    site.probe
        .connect(&site.client, None, NODE_V4, 18443, None)
        .success();
    wait_count(&listener, &tcp4, 2);
    site.probe
        .connect(&site.client, None, OTHER_NODE_V4, 18443, None)
        .failure();
    site.probe
        .connect(&site.client, None, NODE_V6, 18443, None)
        .failure();
    // Hairpin: the pod through its own host port; a neighbour on the bridge.
    site.probe.connect(&pod, None, NODE_V4, 18080, None).success();
    wait_count(&listener, &tcp4, 3);
    site.probe
        .connect(&neighbour, None, NODE_V4, 18080, None)
        .success();
    wait_count(&listener, &tcp4, 4);
    site.probe
        .connect(&neighbour, None, NODE_V6, 18080, None)
        .success();
    wait_count(&listener, &tcp6, 2);
    // The node itself, through 127.0.0.1 (route_localnet on the bridge).
    site.probe
        .connect(&site.node.netns, None, "127.0.0.1", 18080, None)
        .success();
    wait_count(&listener, &tcp4, 5);
    let localnet = site
        .node
        .run(
            "cat",
            &[&format!("/proc/sys/net/ipv4/conf/{bridge}/route_localnet")],
        )
        .success();
    assert_eq!(localnet.stdout.trim(), "1");

    site.run(&["check", NETWORK, pod.path_str()], &mappings())
        .success();
    let container_id = test_kit::cnitool_container_id(pod.path_str());
    site.del(&pod, &mappings());
    site.del(&neighbour, &json!([]));
    site.probe
        .connect(&site.client, None, NODE_V4, 18080, None)
        .failure();
    let left = site.leftovers(&container_id);
    assert!(left.is_empty(), "{backend}: left behind: {left:#?}");
}

#[test]
fn host_ports_reach_pods_with_iptables() {
    traffic_reaches_pods_through_host_ports("iptables", "cnipm0", 61);
}

#[test]
fn host_ports_reach_pods_with_nftables() {
    traffic_reaches_pods_through_host_ports("nftables", "cnipm1", 62);
}

/// A chained plugin's input, as libcni builds it for portmap.
fn portmap_input(version: &str, extra: Value, mappings: Option<Value>, prev: bool) -> String {
    let mut doc = json!({"cniVersion": version, "name": NETWORK, "type": "portmap",
                         "capabilities": {"portMappings": true}});
    if let Some(mappings) = mappings {
        doc["runtimeConfig"] = json!({"portMappings": mappings});
    }
    if prev {
        doc["prevResult"] = json!({"cniVersion": version,
            "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/x"}],
            "ips": [{"version": "4", "address": "10.63.0.5/24", "interface": 0},
                    {"version": "6", "address": "fd63::5/64", "interface": 0}]});
        if version.starts_with('1') {
            for ip in doc["prevResult"]["ips"].as_array_mut().into_iter().flatten() {
                ip.as_object_mut().map(|o| o.remove("version"));
            }
        }
    }
    for (key, value) in extra.as_object().into_iter().flatten() {
        doc[key] = value.clone();
    }
    doc.to_string()
}

fn exec(node: &Node, plugin: &Path, command: &str, container_id: &str, netns: &str, stdin: &str) -> Run {
    run_in(
        node.netns.path(),
        plugin,
        &[],
        &[
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", container_id),
            ("CNI_NETNS", netns),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/nonexistent"),
        ],
        stdin,
    )
}

fn saved(node: &Node) -> String {
    let mut all = String::new();
    for tool in ["iptables-save", "ip6tables-save"] {
        let text = node.run(tool, &["-t", "nat"]).success().stdout;
        all.extend(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| format!("{l}\n")),
        );
    }
    all
}

fn reference_mappings() -> Value {
    json!([
        {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
        {"hostPort": 8081, "containerPort": 81, "protocol": "udp", "hostIP": "10.0.0.1"},
        {"hostPort": 9090, "containerPort": 90, "protocol": "tcp"},
        {"hostPort": 9132, "containerPort": 132, "protocol": "sctp"},
        {"hostPort": 8082, "containerPort": 82, "protocol": "tcp", "hostIP": "fd00::1"},
    ])
}

#[test]
fn rules_equal_the_references_and_each_removes_the_others() {
    for version in ["0.3.1", "0.4.0", "1.0.0"] {
        let (theirs, ours) = (Node::new(), Node::new());
        let input = portmap_input(version, json!({}), Some(reference_mappings()), true);
        exec(
            &theirs,
            Path::new(REFERENCE),
            "ADD",
            "abc",
            "/var/run/netns/x",
            &input,
        )
        .success();
        let result = exec(&ours, &bin("portmap"), "ADD", "abc", "/var/run/netns/x", &input)
            .success()
            .json();
        let prev: Value = serde_json::from_str::<Value>(&input).expect("json")["prevResult"].clone();
        assert_eq!(result["ips"], prev["ips"], "{version}: the result passes through");
        let rules = saved(&ours);
        assert_eq!(rules, saved(&theirs), "{version}: iptables-save differs");
        assert!(rules.contains("-p sctp -m sctp --dport 9132"), "{rules}");

        // Each CHECKs and DELs the other's rules, the DEL without mappings
        // or prevResult (the reference returns early then: it leaks).
        if version != "0.3.1" {
            exec(
                &theirs,
                &bin("portmap"),
                "CHECK",
                "abc",
                "/var/run/netns/x",
                &input,
            )
            .success();
        }
        let bare = portmap_input(version, json!({}), None, false);
        exec(&theirs, &bin("portmap"), "DEL", "abc", "", &bare).success();
        exec(
            &ours,
            Path::new(REFERENCE),
            "DEL",
            "abc",
            "/var/run/netns/x",
            &input,
        )
        .success();
        for node in [&theirs, &ours] {
            let left = saved(node);
            assert!(
                !left.contains("CNI-DN-") && !left.contains("dnat name"),
                "{version}: {left}"
            );
        }
        exec(&ours, Path::new(REFERENCE), "DEL", "abc", "", &bare).success();
    }
}

#[test]
fn every_del_and_gc_path_leaves_nothing() {
    for backend in ["iptables", "nftables"] {
        let site = Site::new();
        let backend_key = json!({"backend": backend});
        let full = portmap_input("1.0.0", backend_key.clone(), Some(mappings()), true);
        let add = |id: &str| {
            exec(&site.node, &bin("portmap"), "ADD", id, "/var/run/netns/x", &full).success();
            assert!(
                !site.leftovers(id).is_empty(),
                "{backend}: ADD {id} wrote nothing"
            );
        };
        let in_the_way = site.node.path("state-file");
        std::fs::write(&in_the_way, "").expect("a file in the way");
        let paths = [
            ("full", full.clone(), "/var/run/netns/x"),
            (
                "no prevResult",
                portmap_input("1.0.0", backend_key.clone(), Some(mappings()), false),
                "/var/run/netns/x",
            ),
            (
                "no portMappings",
                portmap_input("1.0.0", backend_key.clone(), None, true),
                "/var/run/netns/x",
            ),
            (
                "nothing, empty netns",
                portmap_input("1.0.0", backend_key.clone(), None, false),
                "",
            ),
            // A file where the state directory should be holds no record.
            (
                "a file as stateDir",
                portmap_input(
                    "1.0.0",
                    json!({"backend": backend, "stateDir": in_the_way}),
                    Some(mappings()),
                    true,
                ),
                "/var/run/netns/x",
            ),
            // Another backend configured now: the rules are found anyway.
            (
                "other backend",
                portmap_input("1.0.0", json!({}), None, false),
                "",
            ),
        ];
        for (what, del, netns) in &paths {
            let id = format!("del-{}", what.replace([' ', ','], "-"));
            add(&id);
            exec(&site.node, &bin("portmap"), "DEL", &id, netns, del).success();
            let left = site.leftovers(&id);
            assert!(left.is_empty(), "{backend}, DEL with {what}: {left:#?}");
            exec(&site.node, &bin("portmap"), "DEL", &id, netns, del).success();
        }

        // GC: the valid attachment keeps its rules; the others go, except
        // another network's (nftables' rules name no network: its record
        // does).
        add("kept");
        add("stale");
        let state_dir = site.node.path("portmap");
        let other_pod = site.node.pod("other");
        let mut other: Value = serde_json::from_str(&full).expect("JSON");
        other["name"] = json!("pm-other");
        other["stateDir"] = json!(state_dir);
        let other = other.to_string();
        exec(
            &site.node,
            &bin("portmap"),
            "ADD",
            "other-net",
            other_pod.path_str(),
            &other,
        )
        .success();
        let gc = json!({"cniVersion": "1.1.0", "name": NETWORK, "type": "portmap", "backend": backend,
                        "stateDir": state_dir,
                        "cni.dev/valid-attachments": [{"containerID": "kept", "ifname": "eth0"}]});
        run_in(
            site.node.netns.path(),
            &bin("portmap"),
            &[],
            &[("CNI_COMMAND", "GC"), ("CNI_PATH", "/nonexistent")],
            &gc.to_string(),
        )
        .success();
        assert!(site.leftovers("stale").is_empty(), "{backend}: {}", site.rules());
        assert!(
            !site.leftovers("kept").is_empty(),
            "{backend}: GC removed a valid attachment"
        );
        assert!(
            !site.leftovers_in("pm-other", "other-net").is_empty(),
            "{backend}: GC removed another network's attachment"
        );
        exec(&site.node, &bin("portmap"), "DEL", "kept", "", &full).success();
        exec(&site.node, &bin("portmap"), "DEL", "other-net", "", &other).success();
        for (network, id) in [(NETWORK, "kept"), ("pm-other", "other-net")] {
            let left = site.leftovers_in(network, id);
            assert!(left.is_empty(), "{backend}: {left:#?}");
        }
    }
}

/// A UDP flow that reached the pod goes to the node's own server on the
/// same port once the pod is deleted (containernetworking/plugins#1190:
/// the reference's DEL leaves the conntrack entry, and the flow keeps
/// going to the dead pod). Debian's 1.1.1 is run the same way as a control.
#[test]
fn a_udp_flow_leaves_a_deleted_pod() {
    for (plugin, flushed) in [(bin("portmap"), true), (Path::new(REFERENCE).to_owned(), false)] {
        let site = Site::new();
        let bins = site.node.path("bins");
        std::fs::create_dir(&bins).expect("mkdir");
        for name in ["bridge", "host-local"] {
            std::os::unix::fs::symlink(bin(name), bins.join(name)).expect("symlink");
        }
        std::os::unix::fs::symlink(&plugin, bins.join("portmap")).expect("symlink");
        let list = site.conflist(
            "cnipm2",
            64,
            json!({"type": "portmap", "capabilities": {"portMappings": true}}),
        );
        site.node.write_conf("10-pm.conflist", &list);
        let udp = json!([{"hostPort": 18053, "containerPort": 5353, "protocol": "udp"}]);
        let cap_args = json!({"portMappings": udp}).to_string();
        let bins_path = bins.to_str().expect("UTF-8");
        let env = [("CAP_ARGS", cap_args.as_str()), ("CNI_PATH", bins_path)];
        let pod = site.node.pod("pod");
        pod.ip(&["link", "set", "lo", "up"]).success();
        site.node
            .cnictl_env(&["add", NETWORK, pod.path_str()], &env)
            .success();
        let in_pod = site.probe.listen_on(&pod, &["udp:5353".to_owned()]);
        let on_node = site.probe.listen_on(&site.node.netns, &["udp:18053".to_owned()]);
        site.probe
            .udp_from(&site.client, NODE_V4, 18053, Some(40053))
            .success();
        wait_count(&in_pod, "udp 5353", 1);
        site.node
            .cnictl_env(&["del", NETWORK, pod.path_str()], &env)
            .success();
        site.probe
            .udp_from(&site.client, NODE_V4, 18053, Some(40053))
            .success();
        if flushed {
            wait_count(&on_node, "udp 18053", 1);
        } else {
            std::thread::sleep(Duration::from_millis(500));
            assert_eq!(count(&on_node, "udp 18053"), 0, "the control no longer fails");
        }
    }
}

/// Upstream's nftables layout, as `nft list` prints it.
#[test]
fn the_nftables_layout_is_upstreams() {
    let node = Node::new();
    let input = portmap_input(
        "1.0.0",
        json!({"backend": "nftables"}),
        Some(json!([
            {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
            {"hostPort": 8081, "containerPort": 81, "protocol": "udp", "hostIP": "10.0.0.1"},
        ])),
        true,
    );
    exec(&node, &bin("portmap"), "ADD", "abc", "/var/run/netns/x", &input).success();
    let listing = node
        .run("nft", &["list", "table", "ip", "cni_hostport"])
        .success()
        .stdout;
    let expected = "table ip cni_hostport {
	comment \"CNI portmap plugin\"
	chain hostports {
		tcp dport 8080 dnat to 10.63.0.5:80 comment \"abc\"
		ip daddr 10.0.0.1 udp dport 8081 dnat to 10.63.0.5:81 comment \"abc\"
	}

	chain hostip_hostports {
	}

	chain hostports_all {
		jump hostip_hostports
		jump hostports
	}

	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		fib daddr type local jump hostports_all
	}

	chain output {
		type nat hook output priority -100; policy accept;
		fib daddr type local jump hostports_all
	}

	chain masquerading {
		type nat hook postrouting priority srcnat; policy accept;
		ip saddr 10.63.0.5 ip daddr 10.63.0.5 masquerade comment \"abc\"
		ip saddr 127.0.0.1 ip daddr 10.63.0.5 masquerade comment \"abc\"
	}
}
";
    assert_eq!(listing, expected);
    let v6 = node
        .run("nft", &["list", "table", "ip6", "cni_hostport"])
        .success()
        .stdout;
    assert!(
        v6.contains("tcp dport 8080 dnat to [fd63::5]:80 comment \"abc\"") && !v6.contains("8081"),
        "{v6}"
    );
    exec(&node, &bin("portmap"), "CHECK", "abc", "/var/run/netns/x", &input).success();
    node.run("nft", &["flush", "chain", "ip", "cni_hostport", "hostports"])
        .success();
    let check = exec(&node, &bin("portmap"), "CHECK", "abc", "/var/run/netns/x", &input).failure();
    assert!(check.stdout.contains("rules missing"), "{check:?}");
}

#[test]
fn configuration_is_checked_as_the_reference_checks_it() {
    let node = Node::new();
    for (extra, message) in [
        (json!({"markMasqBit": 32}), "MasqMarkBit must be between 0 and 31"),
        (
            json!({"markMasqBit": 3, "externalSetMarkChain": "X"}),
            "Cannot specify externalSetMarkChain and markMasqBit",
        ),
        (json!({"backend": "ebpf"}), "unrecognized backend \"ebpf\""),
        (
            json!({"backend": "nftables", "conditionsV4": ["-d", "1.2.3.4"]}),
            "nftables backend was requested but configuration contains iptables-specific options [conditionsV4]",
        ),
    ] {
        let input = portmap_input("1.0.0", extra.clone(), Some(mappings()), true);
        let run = exec(&node, &bin("portmap"), "ADD", "abc", "/var/run/netns/x", &input).failure();
        let error = run.json();
        assert_eq!(error["code"], 7, "{extra}: {error}");
        assert!(
            error["msg"].as_str().is_some_and(|m| m.contains(message)),
            "{extra}: {error}"
        );
    }
    let zero = portmap_input(
        "1.0.0",
        json!({}),
        Some(json!([{"hostPort": 0, "containerPort": 80}])),
        true,
    );
    let run = exec(&node, &bin("portmap"), "ADD", "abc", "/var/run/netns/x", &zero).failure();
    assert!(run.stdout.contains("Invalid host port number: 0"), "{run:?}");
    let unchained = portmap_input("1.0.0", json!({}), Some(mappings()), false);
    let run = exec(
        &node,
        &bin("portmap"),
        "ADD",
        "abc",
        "/var/run/netns/x",
        &unchained,
    )
    .failure();
    assert!(run.stdout.contains("must be called as chained plugin"), "{run:?}");
    // No mappings: the previous result passes through, nothing is written.
    let none = portmap_input("1.0.0", json!({}), None, true);
    exec(&node, &bin("portmap"), "ADD", "abc", "/var/run/netns/x", &none).success();
    assert!(!saved(&node).contains("CNI-HOSTPORT"), "{}", saved(&node));
}

/// Two pods on one host port: the second is refused while the first runs;
/// once the first is gone without a DEL (its runtime crashed), the second
/// gets the port and the first's rules go.
#[test]
fn a_host_port_held_by_a_running_pod_is_refused() {
    let site = Site::new();
    let list = site.conflist(
        "cnipm3",
        65,
        json!({"type": "portmap", "capabilities": {"portMappings": true}}),
    );
    site.node.write_conf("10-pm.conflist", &list);
    let port = json!([{"hostPort": 18080, "containerPort": 8080, "protocol": "tcp"}]);
    let (first, second) = (site.node.pod("first"), site.node.pod("second"));
    site.add(&first, &port);
    second.ip(&["link", "set", "lo", "up"]).success();
    let refused = site.run(&["add", NETWORK, second.path_str()], &port).failure();
    let first_id = test_kit::cnitool_container_id(first.path_str());
    assert!(
        refused
            .stderr
            .contains("host port 18080/tcp is published for container")
            && refused.stderr.contains(&first_id)
            && refused.stderr.contains("(CNI error code 105)"),
        "{refused:?}"
    );
    // What a runtime does after a failed ADD.
    site.del(&second, &port);
    // Another protocol is no clash; one host address under the first's
    // wildcard is (its rule would catch that address too), as Kubernetes'
    // scheduler counts hostPort clashes.
    let other = json!([{"hostPort": 18080, "containerPort": 8080, "protocol": "udp"}]);
    site.add(&second, &other);
    site.del(&second, &other);
    let one_address =
        json!([{"hostPort": 18080, "containerPort": 8080, "protocol": "tcp", "hostIP": "198.51.100.9"}]);
    let refused = site
        .run(&["add", NETWORK, second.path_str()], &one_address)
        .failure();
    assert!(refused.stderr.contains("(CNI error code 105)"), "{refused:?}");
    site.del(&second, &one_address);

    // The first pod's namespace goes without a DEL.
    let first_path = first.path_str().to_owned();
    first.delete();
    let result = site.add(&second, &port);
    assert!(site.leftovers(&first_id).is_empty(), "{}", site.rules());
    let listener = site.probe.listen(&second, &[8080]);
    site.probe
        .connect(&site.client, None, NODE_V4, 18080, None)
        .success();
    wait_count(
        &listener,
        &format!("tcp 8080 {}:8080", pod_address(&result, true)),
        1,
    );
    let second_id = test_kit::cnitool_container_id(second.path_str());
    site.del(&second, &port);
    assert!(site.leftovers(&second_id).is_empty(), "{}", site.rules());
    let records = std::fs::read_dir(site.node.path("portmap").join(NETWORK))
        .expect("records")
        .count();
    assert_eq!(records, 0, "a record stayed (the first was {first_path})");
}

/// How long a plugin may take before it counts as hung.
const HUNG_AFTER: Duration = Duration::from_secs(10);

/// [`exec`] of ours, failing the test when it has not returned within
/// [`HUNG_AFTER`] (it is killed then): a blocked plugin must fail the
/// test, not hang the suite.
fn exec_within(node: &Node, command: &str, container_id: &str, netns: &str, stdin: &str) -> Run {
    let env = [
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", container_id),
        ("CNI_NETNS", netns),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/nonexistent"),
    ];
    let what = format!("portmap {command} {container_id}");
    let child = spawn_in(node.netns.path(), &bin("portmap"), &[], &env, stdin);
    test_kit::finish_within(&what, child, HUNG_AFTER)
        .unwrap_or_else(|run| panic!("{what} did not return within {HUNG_AFTER:?}: {run:?}"))
}

/// A FIFO, a link to one, and other junk in portmap's state directory
/// hold no ADD, DEL or GC (each under the lock every hostPort and firewall
/// pod of the node waits for), fail none, and hide no real record: a
/// second pod on the holder's port is still refused. On 9b8b637 the first
/// ADD blocks opening the FIFO for ever.
#[test]
fn special_files_in_the_state_directory_hold_no_add() {
    let node = Node::new();
    let state = node.path("portmap");
    let records = state.join(NETWORK);
    std::fs::create_dir_all(&records).expect("mkdir");
    mkfifo(&records.join("fifo"));
    std::os::unix::fs::symlink(records.join("fifo"), records.join("linked-fifo")).expect("link");
    std::fs::write(records.join("junk"), "{").expect("write");
    mkfifo(&state.join("fifo-network"));
    let input = portmap_input("1.0.0", json!({"stateDir": state}), Some(mappings()), true);
    let (holder, second) = (node.pod("holder"), node.pod("second"));
    exec_within(&node, "ADD", "holder", holder.path_str(), &input).success();
    let refused = exec_within(&node, "ADD", "second", second.path_str(), &input).failure();
    assert!(
        refused.stdout.contains("host port") && refused.stdout.contains("holder"),
        "the holder's record still counts: {refused:?}"
    );
    exec_within(&node, "DEL", "second", second.path_str(), &input).success();
    let gc = json!({"cniVersion": "1.1.0", "name": NETWORK, "type": "portmap", "stateDir": state,
                    "cni.dev/valid-attachments": [{"containerID": "holder", "ifname": "eth0"}]});
    exec_within(&node, "GC", "", "", &gc.to_string()).success();
    exec_within(&node, "DEL", "holder", holder.path_str(), &input).success();
    assert!(!saved(&node).contains("CNI-DN-"), "{}", saved(&node));
    assert!(!records.join("holder").exists(), "the record went with its rules");
}

/// A state directory, or a network's directory in it, that is a link to
/// another directory gets no record written through it: the ADD still
/// publishes the ports (without a record, as when the record cannot be
/// written), and nothing appears where the link points. On 9b8b637 the
/// record lands in the link's target.
#[test]
fn no_record_is_written_through_a_linked_state_directory() {
    let node = Node::new();
    let (elsewhere, also_elsewhere) = (node.path("elsewhere"), node.path("also-elsewhere"));
    std::fs::create_dir_all(&elsewhere).expect("mkdir");
    std::fs::create_dir_all(&also_elsewhere).expect("mkdir");
    let linked_state = node.path("portmap-link");
    std::os::unix::fs::symlink(&elsewhere, &linked_state).expect("link");
    let state = node.path("portmap");
    std::fs::create_dir_all(&state).expect("mkdir");
    std::os::unix::fs::symlink(&also_elsewhere, state.join(NETWORK)).expect("link");
    let pod = node.pod("pod");
    for state_dir in [&linked_state, &state] {
        let input = portmap_input("1.0.0", json!({"stateDir": state_dir}), Some(mappings()), true);
        let added = exec_within(&node, "ADD", "pod", pod.path_str(), &input).success();
        assert!(saved(&node).contains("CNI-DN-"), "{added:?}");
        assert!(
            files_under(&elsewhere).is_empty() && files_under(&also_elsewhere).is_empty(),
            "written through a link: {:?} {:?}",
            files_under(&elsewhere),
            files_under(&also_elsewhere)
        );
        exec_within(&node, "DEL", "pod", pod.path_str(), &input).success();
        assert!(!saved(&node).contains("CNI-DN-"), "{}", saved(&node));
    }
}
