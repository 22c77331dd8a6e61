//! bridge + host-local end to end: real namespaces, veths, routes and
//! firewall rules, the built binaries run through cnictl or directly as
//! libcni runs them, next to Debian's reference plugins.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Barrier;

use serde_json::{Value, json};
use test_kit::{LeaseService, Netns, Node, Run, bin, bin_dir, cnitool_container_id, run_in};

const NETWORK: &str = "br-net";

struct Net {
    node: Node,
}

impl Net {
    fn new() -> Self {
        Net { node: Node::new() }
    }

    /// A veth pair whose one end takes `name`, where a bridge is expected.
    fn occupy_with_a_veth(&self, name: &str) {
        let peer = format!("{name}p");
        self.node
            .netns
            .ip(&["link", "add", name, "type", "veth", "peer", "name", &peer])
            .success();
    }

    /// Writes the conflist: a bridge entry (with `bridge` options merged in)
    /// and host-local IPAM over `ranges`.
    fn conf(&self, version: &str, bridge: Value, ranges: Value) -> Value {
        let mut entry = json!({"type": "bridge", "bridge": "cnitest0",
            "ipam": {"type": "host-local", "ranges": ranges,
                     "dataDir": self.node.path("ipam").to_str().expect("UTF-8"), "socket": ""}});
        if let (Some(e), Value::Object(extra)) = (entry.as_object_mut(), bridge) {
            e.extend(extra);
        }
        let list = json!({"cniVersion": version, "name": NETWORK, "plugins": [entry]});
        self.node.write_conf("10-bridge.conflist", &list);
        list
    }

    fn v4(&self, bridge: Value) -> Value {
        self.conf("1.0.0", bridge, json!([[{"subnet": "10.42.0.0/24"}]]))
    }

    fn add(&self, pod: &Netns) -> Value {
        self.node
            .cnictl(&["--json", "add", NETWORK, pod.path_str()])
            .success()
            .json()
    }

    fn del(&self, pod_path: &str) {
        self.node.cnictl(&["del", NETWORK, pod_path]).success();
    }

    fn ping(&self, from: &Netns, to: &str) -> Run {
        let ping = if to.contains(':') { "ping6" } else { "ping" };
        run_in(
            from.path(),
            std::path::Path::new("busybox"),
            &[ping, "-c", "1", "-W", "2", to],
            &[],
            "",
        )
    }

    fn nat_rules(&self) -> String {
        let v4 = self.node.run("iptables-save", &["-t", "nat"]).success().stdout;
        let v6 = self.node.run("ip6tables-save", &["-t", "nat"]).success().stdout;
        format!("{v4}{v6}")
    }

    fn nft_rules(&self) -> String {
        self.node.run("nft", &["list", "ruleset"]).success().stdout
    }

    /// The masquerade of `subnet` in `backend`'s listing: its chain's
    /// rules and the jump to it, sorted.
    fn masquerade_of(&self, subnet: &str, backend: &str) -> Vec<String> {
        let mut lines: Vec<String> = if backend == "iptables" {
            let chain = subnet_chain(subnet);
            let nat = self.node.run("iptables-save", &["-t", "nat"]).success().stdout;
            nat.lines()
                .filter(|l| l.starts_with("-A ") && l.contains(&chain))
                .map(str::to_owned)
                .collect()
        } else {
            self.nft_rules()
                .lines()
                .filter(|l| l.contains(subnet) && (l.contains(" jump net-") || l.contains("masquerade")))
                .map(|l| l.trim().to_owned())
                .collect()
        };
        lines.sort();
        lines
    }

    fn host_veths(&self) -> Vec<String> {
        let links = self
            .node
            .netns
            .ip(&["-o", "link", "show", "type", "veth"])
            .success()
            .stdout;
        links
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_owned())
            .collect()
    }

    fn leases(&self) -> usize {
        self.node
            .lease_records(NETWORK, &self.node.path("ipam"), "")
            .len()
    }

    /// Nothing of any attachment is left: no veth, no per-container chain
    /// or nft rule, no lease. (A network's subnet masquerade stays, like
    /// its bridge, until GC finds no valid attachment.)
    fn assert_clean(&self) {
        assert!(
            self.host_veths().is_empty(),
            "veths left: {:?}",
            self.host_veths()
        );
        let nat = self.nat_rules();
        assert!(
            !nat.lines()
                .any(|l| l.starts_with(":CNI-") && !l.starts_with(":CNI-NET-")),
            "per-container masquerade chains left:\n{nat}"
        );
        let nft = self.nft_rules();
        assert!(
            !nft.lines()
                .any(|l| l.contains("masquerade comment") && l.contains(", id: ")),
            "per-container nft masquerade rules left:\n{nft}"
        );
        assert_eq!(self.leases(), 0, "leases left");
    }

    /// The subnet masquerade of the network, in both backends.
    fn subnet_masquerade(&self) -> usize {
        let nat = self.nat_rules();
        let nft = self.nft_rules();
        nat.lines().filter(|l| l.starts_with(":CNI-NET-")).count()
            + nft.lines().filter(|l| l.contains(" jump net-")).count()
    }
}

fn address_of(result: &Value, index: usize) -> String {
    result["ips"][index]["address"]
        .as_str()
        .unwrap_or_default()
        .split('/')
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn two_pods_talk_over_the_bridge_in_every_family() {
    let net = Net::new();
    net.conf(
        "1.1.0",
        json!({"isGateway": true}),
        json!([[{"subnet": "10.42.0.0/24"}], [{"subnet": "fd42::/64"}]]),
    );
    let (a, b) = (net.node.pod("a"), net.node.pod("b"));
    let (ra, rb) = (net.add(&a), net.add(&b));
    for index in [0, 1] {
        net.ping(&a, &address_of(&rb, index)).success();
        net.ping(&b, &address_of(&ra, index)).success();
    }
    net.ping(&a, "10.42.0.1").success();
    net.ping(&a, "fd42::1").success();
    net.del(a.path_str());
    net.del(b.path_str());
    net.assert_clean();
    assert!(
        net.node.netns.ip(&["link", "show", "cnitest0"]).ok(),
        "the bridge stays, as with the reference"
    );
}

#[test]
fn results_in_every_version() {
    for version in ["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let net = Net::new();
        net.conf(
            version,
            json!({"isGateway": true}),
            json!([[{"subnet": "10.43.0.0/24"}]]),
        );
        let pod = net.node.pod("pod");
        let doc = net.add(&pod);
        assert_eq!(doc["cniVersion"], version);
        match version {
            "0.1.0" | "0.2.0" => {
                assert_eq!(
                    doc["ip4"],
                    json!({"ip": "10.43.0.2/24", "gateway": "10.43.0.1"}),
                    "{doc}"
                );
                assert!(doc.get("interfaces").is_none());
            }
            _ => {
                let names: Vec<&str> = doc["interfaces"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|i| i["name"].as_str())
                    .collect();
                assert_eq!(names.len(), 3);
                assert_eq!((names[0], names[2]), ("cnitest0", "eth0"));
                assert!(names[1].starts_with("veth") && names[1].len() == 12, "{names:?}");
                assert_eq!(doc["interfaces"][2]["sandbox"], pod.path_str());
                assert!(doc["interfaces"][0].get("sandbox").is_none());
                let mac = pod.ip(&["-o", "link", "show", "eth0"]).success().stdout;
                assert!(
                    mac.contains(doc["interfaces"][2]["mac"].as_str().unwrap_or("?")),
                    "{mac}"
                );
                assert_eq!(doc["ips"][0]["interface"], 2);
                assert_eq!(doc["ips"][0]["gateway"], "10.43.0.1");
                assert_eq!(
                    doc["ips"][0].get("version").is_some(),
                    matches!(version, "0.3.0" | "0.3.1" | "0.4.0")
                );
            }
        }
        net.del(pod.path_str());
        net.assert_clean();
    }
}

#[test]
fn masquerade_with_iptables_and_nftables_and_nothing_left_after_del() {
    for backend in ["iptables", "nftables"] {
        let net = Net::new();
        net.conf(
            "1.1.0",
            json!({"isGateway": true, "ipMasq": true, "ipMasqBackend": backend}),
            json!([[{"subnet": "10.44.0.0/24"}], [{"subnet": "fd44::/64"}]]),
        );
        let (a, b) = (net.node.pod("a"), net.node.pod("b"));
        let (id_a, id_b) = (
            cnitool_container_id(a.path_str()),
            cnitool_container_id(b.path_str()),
        );
        net.add(&a);
        net.add(&b);
        match backend {
            "iptables" => {
                let nat = net.nat_rules();
                let chain = subnet_chain("10.44.0.0/24");
                let comment =
                    format!("-m comment --comment \"name: \\\"{NETWORK}\\\" subnet: \\\"10.44.0.0/24\\\"\"");
                assert!(
                    nat.contains(&format!("-A POSTROUTING -s 10.44.0.0/24 {comment} -j {chain}")),
                    "{nat}"
                );
                assert!(
                    nat.contains(&format!("-A {chain} -d 10.44.0.0/24 {comment} -j ACCEPT")),
                    "{nat}"
                );
                assert!(
                    nat.contains(&format!("-A {chain} ! -d 224.0.0.0/4 {comment} -j MASQUERADE")),
                    "{nat}"
                );
                assert_eq!(
                    nat.matches("-A POSTROUTING").count(),
                    2,
                    "one jump per subnet, not per pod: {nat}"
                );
                assert!(nat.contains(&format!("-A POSTROUTING -s fd44::/64 -m comment --comment \"name: \\\"{NETWORK}\\\" subnet: \\\"fd44::/64\\\"\" -j {}", subnet_chain("fd44::/64"))), "{nat}");
                assert!(nat.contains("! -d ff00::/8"), "{nat}");
            }
            _ => {
                let nft = net.nft_rules();
                assert!(nft.contains("table inet cni_plugins_masquerade"), "{nft}");
                assert!(nft.contains("ip saddr 10.44.0.0/24 jump net-"), "{nft}");
                assert!(nft.contains("ip daddr != 10.44.0.0/24 masquerade"), "{nft}");
                assert!(nft.contains("ip6 saddr fd44::/64 jump net-"), "{nft}");
                assert!(nft.contains("ip6 daddr != fd44::/64 masquerade"), "{nft}");
                assert_eq!(nft.matches(" jump net-").count(), 2, "{nft}");
                assert!(!net.nat_rules().contains("CNI-"));
            }
        }
        net.node.cnictl(&["check", NETWORK, a.path_str()]).success();
        // DEL as `ctr run --rm` sends it: empty netns, after the pod is gone.
        let b_path = b.path_str().to_owned();
        drop(b);
        net.node.cnictl_env(&["del", NETWORK, &b_path], &[]).success();
        assert!(
            !net.nat_rules().contains(&id_b) && !net.nft_rules().contains(&format!("id: {id_b}")),
            "b's rules are gone"
        );
        direct_del_with_empty_netns(&net, &id_a);
        // Then CRI's second DEL for the same pod: no netns, no prevResult.
        direct_del_with_empty_netns(&net, &id_a);
        net.node.cnictl(&["del", NETWORK, a.path_str()]).success();
        net.assert_clean();
        assert_eq!(
            net.subnet_masquerade(),
            2,
            "the subnets' masquerade stays for the network's next pod, like the bridge"
        );
        net.node.cnictl(&["gc", NETWORK, "--all"]).success();
        assert_eq!(net.subnet_masquerade(), 0, "GC removes it once nothing is valid");
        // The next pod sets it up again.
        let c = net.node.pod("c");
        net.add(&c);
        assert_eq!(net.subnet_masquerade(), 2);
        net.node.cnictl(&["del", NETWORK, c.path_str()]).success();
        net.assert_clean();
    }
}

#[test]
fn every_add_repairs_the_subnet_masquerade_and_starts_no_process_when_complete() {
    for backend in ["iptables", "nftables"] {
        let net = Net::new();
        net.conf(
            "1.1.0",
            json!({"isGateway": true, "ipMasq": true, "ipMasqBackend": backend}),
            json!([[{"subnet": "10.45.0.0/24"}]]),
        );
        net.add(&net.node.pod("first"));
        let complete = net.masquerade_of("10.45.0.0/24", backend);
        assert_eq!(
            complete.len(),
            if backend == "iptables" { 3 } else { 2 },
            "{complete:?}"
        );
        let chain = subnet_chain("10.45.0.0/24");
        let damage: Vec<Vec<&str>> = match backend {
            "iptables" => vec![
                vec!["iptables", "-t", "nat", "-F", "POSTROUTING"],
                vec!["iptables", "-t", "nat", "-F"],
                vec!["iptables", "-t", "nat", "-D", &chain, "1"],
            ],
            _ => vec![
                vec![
                    "nft",
                    "flush",
                    "chain",
                    "inet",
                    "cni_plugins_masquerade",
                    "masq_checks",
                ],
                vec!["nft", "flush", "table", "inet", "cni_plugins_masquerade"],
                vec![
                    "nft",
                    "flush",
                    "chain",
                    "inet",
                    "cni_plugins_masquerade",
                    "postrouting",
                ],
            ],
        };
        let listing = || format!("{}{}", net.nat_rules(), net.nft_rules());
        let intact = listing();
        for (round, command) in damage.iter().enumerate() {
            let damaged = net.node.run(command[0], &command[1..]);
            assert!(damaged.ok(), "{damaged:?}");
            assert_ne!(listing(), intact, "`{}` changed nothing", command.join(" "));
            net.add(&net.node.pod(&format!("after-{round}")));
            assert_eq!(
                net.masquerade_of("10.45.0.0/24", backend),
                complete,
                "{backend}: the ADD after `{}` left it complete, once",
                command.join(" ")
            );
            if backend == "nftables" {
                let nft = net.nft_rules();
                assert!(nft.contains("goto masq_checks"), "{nft}");
            }
        }
        // Nothing missing: the ADD starts no process but host-local's.
        let pod = net.node.pod("quiet");
        let cache = net.node.cache_dir();
        let conf = net.node.conf_dir();
        let bins = test_kit::bin_dir();
        let (traced, programs) = test_kit::run_traced(
            net.node.netns.path(),
            &bin("cnictl"),
            &[
                "--cache-dir",
                cache.to_str().expect("UTF-8"),
                "add",
                NETWORK,
                pod.path_str(),
            ],
            &[
                ("NETCONFPATH", conf.to_str().expect("UTF-8")),
                ("CNI_PATH", bins.to_str().expect("UTF-8")),
            ],
            "",
        );
        assert!(traced.ok(), "{traced:?}");
        assert!(
            programs
                .iter()
                .all(|p| ["cnictl", "bridge", "host-local"].contains(&p.as_str())),
            "{programs:?}"
        );
        assert_eq!(net.masquerade_of("10.45.0.0/24", backend), complete);
    }
}

/// `CNI-NET-` + 20 hex of sha512("<network>:<subnet>"), computed with
/// coreutils.
fn subnet_chain(subnet: &str) -> String {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("printf %s \"$1\" | sha512sum | cut -c1-20")
        .arg("sh")
        .arg(format!("{NETWORK}:{subnet}"))
        .output()
        .expect("sha512sum");
    format!("CNI-NET-{}", String::from_utf8_lossy(&out.stdout).trim())
}

fn firewall_chain(container_id: &str) -> String {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("printf %s \"$1\" | sha512sum | cut -c1-24")
        .arg("sh")
        .arg(format!("{NETWORK}{container_id}"))
        .output()
        .expect("sha512sum");
    format!("CNI-{}", String::from_utf8_lossy(&out.stdout).trim())
}

/// DEL executed as libcni does it, with `CNI_NETNS=""` and no prevResult.
fn direct_del_with_empty_netns(net: &Net, container_id: &str) {
    let list: Value = serde_json::from_str(
        &std::fs::read_to_string(net.node.conf_dir().join("10-bridge.conflist")).expect("conflist"),
    )
    .expect("json");
    let mut conf = list["plugins"][0].clone();
    conf["name"] = json!(NETWORK);
    conf["cniVersion"] = list["cniVersion"].clone();
    let bins = bin_dir();
    let env = BTreeMap::from([
        ("CNI_COMMAND", "DEL"),
        ("CNI_CONTAINERID", container_id),
        ("CNI_NETNS", ""),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", bins.to_str().expect("UTF-8")),
    ]);
    let run = net.node.exec_plugin("bridge", &env, &conf.to_string()).success();
    assert_eq!(run.stdout, "");
    assert!(
        !net.nat_rules().contains(container_id),
        "rules of {container_id} left"
    );
}

#[test]
fn fifty_parallel_adds_from_a_cold_bridge_then_fifty_dels() {
    parallel_adds_from_a_cold_bridge_then_dels(50);
}

/// The whole chain (cnictl → bridge → host-local, each opening the lease
/// database itself) two hundred times at once on one network.
#[test]
fn two_hundred_parallel_adds_through_the_chain_then_two_hundred_dels() {
    parallel_adds_from_a_cold_bridge_then_dels(200);
}

/// `count` ADDs released together, then as many DELs: no failure, no
/// address twice (in the results or in the pods), one masquerade jump,
/// nothing left.
fn parallel_adds_from_a_cold_bridge_then_dels(count: usize) {
    let net = Net::new();
    net.v4(json!({"isGateway": true, "ipMasq": true}));
    let pods: Vec<Netns> = (0..count).map(|i| net.node.pod(&format!("p{i}"))).collect();
    let barrier = Barrier::new(pods.len());
    let run_all = |command: &str| -> Vec<Run> {
        std::thread::scope(|s| {
            let handles: Vec<_> = pods
                .iter()
                .map(|pod| {
                    let (barrier, node) = (&barrier, &net.node);
                    s.spawn(move || {
                        barrier.wait();
                        node.cnictl(&["--json", command, NETWORK, pod.path_str()])
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).collect()
        })
    };
    let added: Vec<Value> = run_all("add").into_iter().map(|r| r.success().json()).collect();
    let in_results: BTreeSet<String> = added.iter().map(|r| address_of(r, 0)).collect();
    assert_eq!(in_results.len(), count, "no duplicate address in the results");
    let in_pods: BTreeSet<String> = pods
        .iter()
        .map(|p| {
            let shown = p.ip(&["-4", "-o", "addr", "show", "eth0"]).success().stdout;
            shown
                .split_whitespace()
                .skip_while(|w| *w != "inet")
                .nth(1)
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(
        in_pods.len(),
        count,
        "no duplicate address in the pods: {in_pods:?}"
    );
    net.ping(&pods[0], &address_of(&added[count - 1], 0)).success();
    assert_eq!(
        net.nat_rules().matches("-A POSTROUTING").count(),
        1,
        "{count} pods, one masquerade jump for their subnet"
    );
    for run in run_all("del") {
        run.success();
    }
    net.assert_clean();
}

#[test]
fn a_failure_after_ipam_releases_the_lease_and_removes_the_veth() {
    let net = Net::new();
    // A route the kernel refuses (its gateway is unreachable) fails ADD
    // after IPAM handed out an address.
    net.conf("1.0.0", json!({}), json!([[{"subnet": "10.45.0.0/24"}]]));
    let mut list: Value = serde_json::from_str(
        &std::fs::read_to_string(net.node.conf_dir().join("10-bridge.conflist")).expect("read"),
    )
    .expect("json");
    list["plugins"][0]["ipam"]["routes"] = json!([{"dst": "192.168.50.0/24", "gw": "172.31.255.1"}]);
    net.node.write_conf("10-bridge.conflist", &list);
    let pod = net.node.pod("pod");
    let failed = net
        .node
        .cnictl(&["--json", "add", NETWORK, pod.path_str()])
        .failure();
    assert_eq!(failed.json()["code"], 101, "{failed:?}");
    assert!(
        !pod.ip(&["link", "show", "eth0"]).ok(),
        "the pod has no eth0 left"
    );
    net.assert_clean();
}

/// IPAM runs beside the making of the links; an ADD that fails before it
/// takes the lease (here the bridge's name is taken by a veth) releases
/// what IPAM handed out itself, executed directly with no runtime DEL to
/// clean up after it.
#[test]
fn a_failure_before_the_lease_is_taken_releases_it() {
    let net = Net::new();
    net.occupy_with_a_veth("notabridge");
    let list = net.v4(json!({"bridge": "notabridge"}));
    let mut conf = list["plugins"][0].clone();
    conf["cniVersion"] = list["cniVersion"].clone();
    conf["name"] = list["name"].clone();
    let pod = net.node.pod("pod");
    let bins = bin_dir();
    let env = BTreeMap::from([
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "early-failure"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_NETNS", pod.path_str()),
        ("CNI_PATH", bins.to_str().expect("UTF-8")),
    ]);
    let failed = net.node.exec_plugin("bridge", &env, &conf.to_string()).failure();
    assert!(
        failed.json()["msg"]
            .as_str()
            .is_some_and(|m| m.contains("not a bridge")),
        "{failed:?}"
    );
    assert_eq!(net.leases(), 0, "the lease IPAM handed out is released");
    net.node.netns.ip(&["link", "del", "notabridge"]).success();
}

#[test]
fn l2_only_dns_override_mtu_and_mac() {
    let net = Net::new();
    let list = json!({"cniVersion": "1.1.0", "name": NETWORK, "plugins": [{
        "type": "bridge", "bridge": "cnitest0", "mtu": 1400, "ipam": {},
        "dns": {"nameservers": ["10.0.0.53"]}, "capabilities": {"mac": true}}]});
    net.node.write_conf("10-bridge.conflist", &list);
    let pod = net.node.pod("pod");
    let doc = net
        .node
        .cnictl_env(
            &["--json", "add", NETWORK, pod.path_str()],
            &[("CAP_ARGS", r#"{"mac":"c2:11:22:33:44:55"}"#)],
        )
        .success()
        .json();
    assert!(doc.get("ips").is_none(), "L2 only: no addresses");
    assert_eq!(doc["dns"]["nameservers"], json!(["10.0.0.53"]));
    assert_eq!(doc["interfaces"][2]["mac"], "c2:11:22:33:44:55");
    let shown = pod.ip(&["-o", "link", "show", "eth0"]).success().stdout;
    assert!(
        shown.contains("mtu 1400") && shown.contains("c2:11:22:33:44:55") && shown.contains("UP"),
        "{shown}"
    );
    net.node.cnictl(&["check", NETWORK, pod.path_str()]).success();
    net.del(pod.path_str());
    assert!(net.host_veths().is_empty());
}

#[test]
fn disabled_container_interface_stays_down() {
    let net = Net::new();
    net.node.write_conf(
        "10-bridge.conflist",
        &json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [{"type": "bridge", "bridge": "cnitest0", "disableContainerInterface": true}]}),
    );
    let pod = net.node.pod("pod");
    net.add(&pod);
    assert!(!pod.link_is_up("eth0"));
    let bad = json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [{"type": "bridge", "disableContainerInterface": true, "ipam": {"type": "host-local", "subnet": "10.9.0.0/24"}}]});
    net.node.write_conf("10-bridge.conflist", &bad);
    let err = net
        .node
        .cnictl(&["--json", "add", NETWORK, net.node.pod("third").path_str()])
        .failure()
        .json();
    assert_eq!(
        err["msg"],
        "cannot use IPAM when DisableContainerInterface flag is set"
    );
}

#[test]
fn hairpin_promisc_isolation_and_their_conflict() {
    let net = Net::new();
    net.v4(json!({"hairpinMode": true, "portIsolation": true}));
    let pod = net.node.pod("pod");
    let doc = net.add(&pod);
    let veth = doc["interfaces"][1]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let port = net
        .node
        .run("bridge", &["-d", "link", "show", "dev", &veth])
        .success()
        .stdout;
    assert!(port.contains("hairpin on"), "{port}");
    assert!(port.contains("isolated on"), "{port}");
    net.del(pod.path_str());

    let net = Net::new();
    net.v4(json!({"promiscMode": true}));
    let pod = net.node.pod("pod");
    net.add(&pod);
    let bridge = net
        .node
        .netns
        .ip(&["-d", "link", "show", "cnitest0"])
        .success()
        .stdout;
    assert!(
        bridge.contains("PROMISC") || bridge.contains("promiscuity 1"),
        "{bridge}"
    );
    net.node.cnictl(&["check", NETWORK, pod.path_str()]).success();
    net.del(pod.path_str());

    net.v4(json!({"promiscMode": true, "hairpinMode": true}));
    let err = net
        .node
        .cnictl(&["--json", "add", NETWORK, net.node.pod("x").path_str()])
        .failure()
        .json();
    assert_eq!(
        err["msg"],
        "cannot set hairpin mode and promiscuous mode at the same time"
    );
}

#[test]
fn default_gateway_and_routes_with_priority_and_table() {
    let net = Net::new();
    let mut list = net.v4(json!({"isDefaultGateway": true}));
    list["plugins"][0]["ipam"]["routes"] =
        json!([{"dst": "192.168.7.0/24", "priority": 77}, {"dst": "192.168.8.0/24", "table": 100}]);
    net.node.write_conf("10-bridge.conflist", &list);
    let pod = net.node.pod("pod");
    let doc = net.add(&pod);
    let routes = pod.ip(&["route", "show"]).success().stdout;
    assert!(routes.contains("default via 10.42.0.1 dev eth0"), "{routes}");
    assert!(
        routes.contains("192.168.7.0/24 via 10.42.0.1 dev eth0") && routes.contains("metric 77"),
        "{routes}"
    );
    let table = pod.ip(&["route", "show", "table", "100"]).success().stdout;
    assert!(table.contains("192.168.8.0/24 via 10.42.0.1"), "{table}");
    assert!(doc["routes"].as_array().is_some_and(|r| {
        r.iter()
            .any(|r| r["dst"] == "0.0.0.0/0" && r["gw"] == "10.42.0.1")
    }));
    let forward = net
        .node
        .run("cat", &["/proc/sys/net/ipv4/ip_forward"])
        .success()
        .stdout;
    assert_eq!(forward.trim(), "1", "isGateway enables forwarding in the node");
    net.del(pod.path_str());
}

#[test]
fn check_detects_a_removed_address_or_route() {
    let net = Net::new();
    net.v4(json!({"isDefaultGateway": true, "ipMasq": true}));
    let pod = net.node.pod("pod");
    net.add(&pod);
    net.node.cnictl(&["check", NETWORK, pod.path_str()]).success();
    pod.ip(&["route", "del", "default"]).success();
    let err = net
        .node
        .cnictl(&["--json", "check", NETWORK, pod.path_str()])
        .failure()
        .json();
    assert!(
        err["msg"]
            .as_str()
            .is_some_and(|m| m.contains("Failed to match route 0.0.0.0/0")),
        "{err}"
    );
    pod.ip(&["route", "add", "default", "via", "10.42.0.1"]).success();
    net.node.cnictl(&["check", NETWORK, pod.path_str()]).success();
    pod.ip(&["addr", "del", "10.42.0.2/24", "dev", "eth0"]).success();
    let err = net
        .node
        .cnictl(&["--json", "check", NETWORK, pod.path_str()])
        .failure()
        .json();
    assert!(
        err["msg"]
            .as_str()
            .is_some_and(|m| m.contains("Failed to match addr 10.42.0.2/24")),
        "{err}"
    );
    pod.ip(&["addr", "add", "10.42.0.2/24", "dev", "eth0"]).success();
    pod.ip(&["route", "add", "default", "via", "10.42.0.1"]).ok();
    net.node
        .run("iptables", &["-t", "nat", "-F", &subnet_chain("10.42.0.0/24")])
        .success();
    let err = net
        .node
        .cnictl(&["--json", "check", NETWORK, pod.path_str()])
        .failure()
        .json();
    assert!(
        err["msg"]
            .as_str()
            .is_some_and(|m| m.contains("IP masquerade rules missing")),
        "{err}"
    );
    net.del(pod.path_str());
    net.assert_clean();
}

/// The `link/ether` address of `name` in `netns`.
fn mac_of(netns: &Netns, name: &str) -> String {
    let shown = netns.ip(&["-o", "link", "show", name]).success().stdout;
    shown
        .split("link/ether ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no MAC in {shown}"))
        .to_owned()
}

#[test]
fn the_bridge_keeps_its_own_mac_through_add_and_del() {
    let net = Net::new();
    net.v4(json!({"isGateway": true}));
    // A bridge made before by someone else, and one the first ADD makes.
    net.node
        .netns
        .ip(&["link", "add", "cnitest0", "type", "bridge"])
        .success();
    let before = mac_of(&net.node.netns, "cnitest0");
    let (a, b) = (net.node.pod("a"), net.node.pod("b"));
    let (ra, rb) = (net.add(&a), net.add(&b));
    let veths: Vec<String> = net
        .host_veths()
        .iter()
        .map(|veth| mac_of(&net.node.netns, veth))
        .chain([mac_of(&a, "eth0"), mac_of(&b, "eth0")])
        .collect();
    assert_eq!(mac_of(&net.node.netns, "cnitest0"), before);
    assert!(!veths.contains(&before), "{before} is a veth's: {veths:?}");
    assert_eq!(ra["interfaces"][0]["mac"], before.as_str());
    assert_eq!(rb["interfaces"][0]["mac"], before.as_str());
    net.ping(&a, &address_of(&rb, 0)).success();
    net.del(a.path_str());
    net.del(b.path_str());
    assert_eq!(mac_of(&net.node.netns, "cnitest0"), before);

    net.v4(json!({"isGateway": true, "bridge": "cnitest1"}));
    let c = net.node.pod("c");
    let rc = net.add(&c);
    let made = mac_of(&net.node.netns, "cnitest1");
    let veth = rc["interfaces"][1]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert_ne!(made, mac_of(&net.node.netns, &veth));
    assert_ne!(made, mac_of(&c, "eth0"));
    assert_eq!(rc["interfaces"][0]["mac"], made.as_str());
    net.del(c.path_str());
    assert_eq!(mac_of(&net.node.netns, "cnitest1"), made);
    net.assert_clean();
}

#[test]
fn an_existing_interface_or_a_non_bridge_is_refused_before_any_change() {
    let net = Net::new();
    net.v4(json!({}));
    let pod = net.node.pod("pod");
    pod.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", "eth0peer"])
        .success();
    let err = net
        .node
        .cnictl(&["--json", "add", NETWORK, pod.path_str()])
        .failure()
        .json();
    assert_eq!(err["msg"], "container veth name provided (eth0) already exists");
    assert_eq!(net.leases(), 0);
    net.occupy_with_a_veth("notabridge");
    net.v4(json!({"bridge": "notabridge"}));
    let err = net
        .node
        .cnictl(&["--json", "add", NETWORK, net.node.pod("p2").path_str()])
        .failure()
        .json();
    assert_eq!(err["msg"], "\"notabridge\" already exists but is not a bridge");
    net.node.netns.ip(&["link", "del", "notabridge"]).success();
    net.assert_clean();
}

#[test]
fn gc_removes_stale_masquerade_and_leases_and_status_forwards() {
    let net = Net::new();
    net.conf(
        "1.1.0",
        json!({"isGateway": true, "ipMasq": true}),
        json!([[{"subnet": "10.46.0.0/29"}]]),
    );
    let pods: Vec<Netns> = (0..3).map(|i| net.node.pod(&format!("g{i}"))).collect();
    for pod in &pods {
        net.add(pod);
    }
    let keep = cnitool_container_id(pods[0].path_str());
    // Lose the cache of the other two, as after a node reboot: only the
    // plugins' own GC can clean up after them.
    for pod in &pods[1..] {
        let id = cnitool_container_id(pod.path_str());
        std::fs::remove_file(
            net.node
                .cache_dir()
                .join("results")
                .join(format!("{NETWORK}-{id}-eth0")),
        )
        .expect("rm");
    }
    // And a stale container's rules in the reference plugin's layout.
    let stale = firewall_chain("ref-stale");
    let reference_rules = format!(
        "*nat\n:{stale} - [0:0]\n-A {stale} -d 10.46.0.0/29 -m comment --comment \"name: \\\"{NETWORK}\\\" id: \\\"ref-stale\\\"\" -j ACCEPT\n\
         -A POSTROUTING -s 10.46.0.6/32 -m comment --comment \"name: \\\"{NETWORK}\\\" id: \\\"ref-stale\\\"\" -j {stale}\nCOMMIT\n"
    );
    run_in(
        net.node.netns.path(),
        std::path::Path::new("iptables-restore"),
        &["--noflush"],
        &[],
        &reference_rules,
    )
    .success();
    net.node
        .cnictl(&["gc", NETWORK, "--valid", &format!("{keep}/eth0")])
        .success();
    assert_eq!(net.leases(), 1);
    let nat = net.nat_rules();
    assert!(!nat.contains("ref-stale"), "{nat}");
    assert_eq!(
        net.subnet_masquerade(),
        1,
        "a valid attachment keeps the subnet's masquerade"
    );
    for _ in 0..4 {
        net.add(&net.node.pod("fill"));
    }
    let full = net
        .node
        .cnictl(&["--json", "add", NETWORK, net.node.pod("one-too-many").path_str()])
        .failure()
        .json();
    assert_eq!(full["code"], 103, "the ADD tells of the full range: {full}");
    // A full range is no reason to call the node not ready (containerd
    // 2.1+ would evict its pods); the reference v1.9.1 answers 0 too.
    net.node.cnictl(&["status", NETWORK]).success();
    // Forwarded to host-local all the same: its lease store unusable (a
    // file where its data directory goes) fails the bridge's STATUS.
    let blocked = net.node.path("blocked");
    std::fs::write(&blocked, "").expect("write");
    net.conf(
        "1.1.0",
        json!({"ipam": {"type": "host-local", "ranges": [[{"subnet": "10.46.0.0/29"}]],
                        "dataDir": blocked.join("ipam").to_str().expect("UTF-8"), "socket": ""}}),
        json!([[{"subnet": "10.46.0.0/29"}]]),
    );
    net.node.cnictl(&["--json", "status", NETWORK]).failure();
}

#[test]
fn rules_made_by_the_reference_bridge_are_removed_by_ours() {
    let net = Net::new();
    let list = net.v4(json!({"isGateway": true, "ipMasq": true}));
    let pod = net.node.pod("pod");
    let mut conf = list["plugins"][0].clone();
    conf["name"] = json!(NETWORK);
    conf["cniVersion"] = json!("1.0.0");
    let env = BTreeMap::from([
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "ref-ctr"),
        ("CNI_NETNS", pod.path_str()),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/usr/lib/cni"),
    ]);
    let vars: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, *v)).collect();
    run_in(
        net.node.netns.path(),
        std::path::Path::new("/usr/lib/cni/bridge"),
        &[],
        &vars,
        &conf.to_string(),
    )
    .success();
    assert!(net.nat_rules().contains("ref-ctr"));
    // Ours deletes it, with the reference's lease files imported by host-local.
    let mut del = env.clone();
    del.insert("CNI_COMMAND", "DEL");
    del.insert("CNI_NETNS", "");
    let bins = bin_dir();
    del.insert("CNI_PATH", bins.to_str().expect("UTF-8"));
    net.node.exec_plugin("bridge", &del, &conf.to_string()).success();
    assert!(!net.nat_rules().contains("ref-ctr"), "{}", net.nat_rules());
    assert_eq!(
        net.leases(),
        0,
        "the reference's lease was released through the import"
    );
}

#[test]
fn macspoofchk_drops_a_spoofed_source_and_goes_with_del() {
    let net = Net::new();
    net.v4(json!({"macspoofchk": true}));
    let (a, b) = (net.node.pod("a"), net.node.pod("b"));
    let ra = net.add(&a);
    let rb = net.add(&b);
    net.ping(&a, &address_of(&rb, 0)).success();
    let nft = net.nft_rules();
    let id_a = cnitool_container_id(a.path_str());
    assert!(nft.contains(&format!("cni-br-iface-{id_a}-eth0")), "{nft}");
    net.node.cnictl(&["check", NETWORK, a.path_str()]).success();

    let own_mac = ra["interfaces"][2]["mac"].as_str().unwrap_or_default().to_owned();
    a.ip(&["link", "set", "eth0", "address", "02:00:00:00:00:99"])
        .success();
    a.ip(&["neigh", "flush", "all"]).success();
    b.ip(&["neigh", "flush", "all"]).success();
    net.ping(&a, &address_of(&rb, 0)).failure();
    let err = net
        .node
        .cnictl(&["--json", "check", NETWORK, a.path_str()])
        .failure()
        .json();
    assert_eq!(err["code"], 100, "{err}");
    a.ip(&["link", "set", "eth0", "address", &own_mac]).success();
    net.ping(&a, &address_of(&rb, 0)).success();

    net.del(a.path_str());
    net.del(b.path_str());
    let nft = net.nft_rules();
    assert!(
        !nft.contains("cni-br-iface") && !nft.contains("macspoofchk"),
        "{nft}"
    );
    net.assert_clean();
}

#[test]
fn force_address_replaces_a_stale_gateway_address() {
    let net = Net::new();
    net.node
        .netns
        .ip(&["link", "add", "cnitest0", "type", "bridge"])
        .success();
    net.node
        .netns
        .ip(&["addr", "add", "10.99.0.1/24", "dev", "cnitest0"])
        .success();
    net.v4(json!({"isGateway": true}));
    let err = net
        .node
        .cnictl(&["--json", "add", NETWORK, net.node.pod("a").path_str()])
        .failure()
        .json();
    assert_eq!(
        err["msg"],
        "\"cnitest0\" already has an IP address different from 10.42.0.1/24"
    );
    assert_eq!(net.leases(), 0, "the lease was released");
    net.v4(json!({"isGateway": true, "forceAddress": true}));
    let pod = net.node.pod("b");
    net.add(&pod);
    let shown = net
        .node
        .netns
        .ip(&["-4", "-o", "addr", "show", "cnitest0"])
        .success()
        .stdout;
    assert!(
        shown.contains("10.42.0.1/24") && !shown.contains("10.99.0.1"),
        "{shown}"
    );
    net.ping(&pod, "10.42.0.1").success();
}

#[test]
fn ipv6_duplicate_address_detection_only_when_enabled() {
    for enabled in [false, true] {
        let net = Net::new();
        net.conf(
            "1.0.0",
            json!({"isGateway": true, "enabledad": enabled}),
            json!([[{"subnet": "fd45::/64"}]]),
        );
        let pod = net.node.pod("pod");
        let doc = net.add(&pod);
        let accept_dad = run_in(
            pod.path(),
            std::path::Path::new("cat"),
            &["/proc/sys/net/ipv6/conf/eth0/accept_dad"],
            &[],
            "",
        )
        .success()
        .stdout;
        assert_eq!(accept_dad.trim(), if enabled { "1" } else { "0" });
        let shown = pod
            .ip(&["-6", "-o", "addr", "show", "eth0", "scope", "global"])
            .success()
            .stdout;
        assert!(
            !shown.contains("tentative"),
            "ADD returned with a usable address: {shown}"
        );
        net.ping(&pod, "fd45::1").success();
        assert_eq!(address_of(&doc, 0), "fd45::2");
    }
}

#[test]
fn vlans_need_bridge_vlan_filtering_in_the_kernel() {
    let net = Net::new();
    let probe = net
        .node
        .netns
        .ip(&["link", "add", "probe0", "type", "bridge", "vlan_filtering", "1"]);
    net.v4(json!({"vlan": 100, "vlanTrunk": [{"id": 200}]}));
    let pod = net.node.pod("pod");
    if probe.ok() {
        net.node.netns.ip(&["link", "del", "probe0"]).success();
        let doc = net.add(&pod);
        let veth = doc["interfaces"][1]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let vlans = net
            .node
            .run("bridge", &["vlan", "show", "dev", &veth])
            .success()
            .stdout;
        assert!(
            vlans.contains("100 PVID Egress Untagged") && vlans.contains("200"),
            "{vlans}"
        );
        assert!(!vlans.contains(" 1 PVID"), "the default VLAN is gone: {vlans}");
        net.del(pod.path_str());
    } else {
        // This kernel (the project's VM) has no bridge VLAN filtering; the
        // ADD must fail with the kernel's answer and leave nothing behind.
        assert!(probe.stderr.contains("Operation not supported"), "{probe:?}");
        let err = net
            .node
            .cnictl(&["--json", "add", NETWORK, pod.path_str()])
            .failure()
            .json();
        assert_eq!(err["code"], 101, "{err}");
        assert!(
            err["msg"]
                .as_str()
                .is_some_and(|m| m.contains("Operation not supported")),
            "{err}"
        );
    }
    net.assert_clean();
}

#[test]
fn with_the_lease_service_named_the_bridge_asks_it_without_a_host_local_process() {
    let node = Node::new();
    let mut service = LeaseService::start(&bin("host-local"), node.path("hl.sock"), &[]);
    let socket = service.socket.to_str().expect("UTF-8").to_owned();
    let data_dir = node.path("ipam");
    node.write_conf(
        "10-bridge.conflist",
        &json!({"cniVersion": "1.1.0", "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": "cnisvc0", "isGateway": true,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.47.0.0/24"}]],
                      "dataDir": data_dir.to_str().expect("UTF-8"), "socket": socket}}]}),
    );
    // A plugin directory with the bridge alone: ADD can only succeed
    // without executing host-local.
    let lonely = node.path("bridge-only");
    std::fs::create_dir(&lonely).expect("mkdir");
    std::os::unix::fs::symlink(bin("bridge"), lonely.join("bridge")).expect("symlink");
    let only_bridge = [("CNI_PATH", lonely.to_str().expect("UTF-8"))];
    let pod = node.pod("pod");
    let added = node
        .cnictl_env(&["--json", "add", NETWORK, pod.path_str()], &only_bridge)
        .success()
        .json();
    assert_eq!(address_of(&added, 0), "10.47.0.2");
    node.cnictl_env(&["check", NETWORK, pod.path_str()], &only_bridge)
        .success();
    node.cnictl_env(&["status", NETWORK], &only_bridge).success();
    let listed = node
        .cnictl(&[
            "ipam",
            "ls",
            NETWORK,
            "--socket",
            &socket,
            "--data-dir",
            data_dir.to_str().expect("UTF-8"),
        ])
        .success()
        .stdout;
    assert!(listed.contains("10.47.0.2"), "{listed}");
    // Without the service, the spec's way: host-local is executed.
    service.kill();
    let failed = node
        .cnictl_env(&["del", NETWORK, pod.path_str()], &only_bridge)
        .failure();
    assert!(failed.stderr.contains("host-local"), "{failed:?}");
    node.cnictl(&["del", NETWORK, pod.path_str()]).success();
    assert_eq!(node.leases_in(NETWORK, &data_dir).matches("10.47.").count(), 0);
}

/// iptables or nft refusing the masquerade (here a PATH whose
/// iptables-restore, ip6tables-restore and nft refuse everything) fails the
/// ADD with the firewall code, and everything the ADD made is undone: the
/// veth, the lease, and nothing is written in either backend.
#[test]
fn a_failing_firewall_fails_the_add_and_rolls_back() {
    for backend in ["iptables", "nftables"] {
        let net = Net::new();
        net.v4(json!({"isGateway": true, "ipMasq": true, "ipMasqBackend": backend}));
        let refusing = net.node.path("refusing-bin");
        std::fs::create_dir(&refusing).expect("mkdir");
        for tool in ["iptables-restore", "ip6tables-restore", "nft"] {
            let script = refusing.join(tool);
            std::fs::write(
                &script,
                "#!/bin/sh\necho \"$0: refused by the test\" >&2\nexit 1\n",
            )
            .expect("write");
            let executable = <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755);
            std::fs::set_permissions(&script, executable).expect("chmod");
        }
        let path = format!(
            "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            refusing.display()
        );
        let pod = net.node.pod("pod");
        let run = net
            .node
            .cnictl_env(&["--json", "add", NETWORK, pod.path_str()], &[("PATH", &path)]);
        assert_refused_and_undone(&net, &pod, run, backend, "refused by the test");
    }
}

/// The same with the tools absent: cnictl and the plugins run in a private
/// mount namespace where a tmpfs hides /usr/sbin (and /sbin, its link).
#[test]
fn a_missing_firewall_tool_fails_the_add_and_rolls_back() {
    for backend in ["iptables", "nftables"] {
        let net = Net::new();
        net.v4(json!({"isGateway": true, "ipMasq": true, "ipMasqBackend": backend}));
        let pod = net.node.pod("pod");
        let conf = net.node.conf_dir();
        let bins = bin_dir();
        let cache = net.node.cache_dir();
        let hide = "mount -t tmpfs none /usr/sbin && exec \"$@\"";
        let run = test_kit::run_in(
            net.node.netns.path(),
            std::path::Path::new("unshare"),
            &[
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                hide,
                "sh",
                test_kit::bin("cnictl").to_str().expect("UTF-8"),
                "--cache-dir",
                cache.to_str().expect("UTF-8"),
                "--json",
                "add",
                NETWORK,
                pod.path_str(),
            ],
            &[
                ("NETCONFPATH", conf.to_str().expect("UTF-8")),
                ("CNI_PATH", bins.to_str().expect("UTF-8")),
                ("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            ],
            "",
        );
        assert_refused_and_undone(&net, &pod, run, backend, "not found");
    }
}

/// ADD failed with code 104 naming the masquerade and `reason`, and left
/// no veth, lease or rule.
fn assert_refused_and_undone(net: &Net, pod: &Netns, run: Run, backend: &str, reason: &str) {
    let err = run.failure().json();
    assert_eq!(err["code"], 104, "{backend}: {err}");
    let msg = err["msg"].as_str().unwrap_or_default();
    assert!(
        msg.contains("masquerade") && msg.contains(reason),
        "{backend}: {err}"
    );
    pod.ip(&["link", "show", "eth0"]).failure();
    net.assert_clean();
    assert_eq!(net.subnet_masquerade(), 0, "{backend}: nothing written");
}
