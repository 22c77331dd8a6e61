//! Mixed chains with Debian's reference plugins (containernetworking-plugins
//! 1.1.1 in /usr/lib/cni), before and after ours, in the versions both
//! speak (0.3.1, 0.4.0, 1.0.0; CHECK from 0.4.0).

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use test_kit::leases::addresses;
use test_kit::probe::Probe;
use test_kit::{Netns, Node, bin, run, run_in};

const REFERENCE: &str = "/usr/lib/cni";
const VERSIONS: [&str; 3] = ["0.3.1", "0.4.0", "1.0.0"];
const NETWORK: &str = "mixed";

fn reference(plugin: &str) -> PathBuf {
    Path::new(REFERENCE).join(plugin)
}

/// A plugin directory holding exactly the chosen binaries (symlinks), so a
/// chain can mix two plugins of the same name from different suites.
fn plugin_dir(node: &Node, name: &str, picks: &[(&str, PathBuf)]) -> String {
    let dir = node.path(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for (plugin, target) in picks {
        assert!(target.is_file(), "{} is missing", target.display());
        symlink(target, dir.join(plugin)).expect("symlink");
    }
    dir.to_str().expect("UTF-8").to_owned()
}

fn host_local(node: &Node, ranges: Value) -> Value {
    json!({"type": "host-local", "socket": "", "ranges": ranges,
           "dataDir": node.path("ipam").to_str().expect("UTF-8"),
           "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]})
}

struct Chain<'a> {
    node: &'a Node,
    version: &'a str,
    env: Vec<(&'a str, &'a str)>,
}

impl Chain<'_> {
    fn run(&self, args: &[&str]) -> test_kit::Run {
        self.node.cnictl_env(args, &self.env)
    }

    fn add(&self, pod: &Netns) -> Value {
        pod.ip(&["link", "set", "lo", "up"]).success();
        let result = self
            .run(&["--json", "add", NETWORK, pod.path_str()])
            .success()
            .json();
        assert_eq!(result["cniVersion"], self.version, "{result}");
        result
    }

    fn check(&self, pod: &Netns) {
        if self.version != "0.3.1" {
            self.run(&["check", NETWORK, pod.path_str()]).success();
        }
    }

    fn del(&self, pod: &Netns) {
        self.run(&["del", NETWORK, pod.path_str()]).success();
    }
}

fn host_veth(result: &Value) -> String {
    result["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["name"].as_str())
        .find(|n| n.starts_with("veth"))
        .unwrap_or_else(|| panic!("no host veth in {result}"))
        .to_owned()
}

fn nat_rules(node: &Node) -> String {
    let v4 = node.run("iptables-save", &["-t", "nat"]).success().stdout;
    let v6 = node.run("ip6tables-save", &["-t", "nat"]).success().stdout;
    v4 + &v6
}

#[test]
fn our_bridge_then_reference_portmap_bandwidth_tuning() {
    for version in VERSIONS {
        let node = Node::new();
        let probe = Probe::new();
        let list = json!({"cniVersion": version, "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": "cnimix0", "isGateway": true, "ipMasq": true,
             "ipam": host_local(&node, json!([[{"subnet": "10.52.0.0/24"}], [{"subnet": "fd52::/64"}]]))},
            {"type": "bandwidth", "ingressRate": 8_000_000, "ingressBurst": 80_000},
            {"type": "tuning", "sysctl": {"net.core.somaxconn": "512"}},
            {"type": "portmap", "capabilities": {"portMappings": true}},
        ]});
        node.write_conf("10-mixed.conflist", &list);
        // Our bridge and host-local; the reference's portmap, bandwidth and
        // tuning (the suite ships a portmap of its own, so pick by name).
        let cni_path = plugin_dir(
            &node,
            "bins",
            &[
                ("bridge", bin("bridge")),
                ("host-local", bin("host-local")),
                ("bandwidth", reference("bandwidth")),
                ("tuning", reference("tuning")),
                ("portmap", reference("portmap")),
            ],
        );
        let mappings = r#"{"portMappings":[{"hostPort":18081,"containerPort":8080,"protocol":"tcp"}]}"#;
        let chain = Chain {
            node: &node,
            version,
            env: vec![("CNI_PATH", &cni_path), ("CAP_ARGS", mappings)],
        };
        let pod = node.pod("pod");
        let result = chain.add(&pod);
        assert_eq!(
            addresses(&result),
            ["10.52.0.2/24", "fd52::2/64"],
            "{version}: {result}"
        );

        // portmap: the node's own address, port 18081, reaches the pod's 8080.
        let listener = probe.listen(&pod, &[8080]);
        probe
            .connect(&node.netns, None, "10.52.0.1", 18081, None)
            .success();
        listener.wait_for("tcp 8080 10.52.0.2:8080");
        // bandwidth shapes traffic into the pod on the host end; tuning set
        // the pod's sysctl.
        let veth = host_veth(&result);
        let qdisc = node.netns.ip(&["link", "show", &veth]).success().stdout;
        assert!(qdisc.contains("qdisc tbf"), "{version}: {qdisc}");
        let somaxconn = run_in(
            pod.path(),
            Path::new("cat"),
            &["/proc/sys/net/core/somaxconn"],
            &[],
            "",
        );
        assert_eq!(somaxconn.success().stdout.trim(), "512");

        // CHECK runs in order: bridge, host-local, bandwidth and tuning pass;
        // Debian's portmap then always fails, looking for its IPv4 rules in
        // ip6tables (containernetworking/plugins#819; the same with the
        // reference bridge, checked by hand).
        if version != "0.3.1" {
            let check = chain.run(&["check", NETWORK, pod.path_str()]).failure();
            assert!(
                check
                    .stderr
                    .contains(r#"plugin type="portmap" failed (check): could not check ipv6 dnat"#),
                "{version}: {check:?}"
            );
        }
        chain.del(&pod);
        let nat = nat_rules(&node);
        assert!(!nat.contains("18081"), "{version}: {nat}");
        let left = node.leftovers(NETWORK, &node.path("ipam"));
        assert!(left.is_empty(), "{version}: left behind: {left:#?}");
    }
}

#[test]
fn reference_bridge_with_our_host_local() {
    for version in VERSIONS {
        let node = Node::new();
        let bins = plugin_dir(
            &node,
            "bins",
            &[("bridge", reference("bridge")), ("host-local", bin("host-local"))],
        );
        let list = json!({"cniVersion": version, "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": "cnimix1", "isGateway": true, "ipMasq": true,
             "ipam": host_local(&node, json!([[{"subnet": "10.53.0.0/24"}]]))}]});
        node.write_conf("10-mixed.conflist", &list);
        let chain = Chain {
            node: &node,
            version,
            env: vec![("CNI_PATH", &bins)],
        };
        let (first, second) = (node.pod("a"), node.pod("b"));
        assert_eq!(addresses(&chain.add(&first)), ["10.53.0.2/24"]);
        assert_eq!(addresses(&chain.add(&second)), ["10.53.0.3/24"]);
        let ls = node.leases(NETWORK);
        assert!(ls.contains("10.53.0.2") && ls.contains("10.53.0.3"), "{ls}");
        let ping = run_in(
            first.path(),
            Path::new("busybox"),
            &["ping", "-c", "1", "-W", "2", "10.53.0.3"],
            &[],
            "",
        );
        ping.success();
        chain.check(&first);
        chain.del(&first);
        chain.del(&second);
        assert!(
            !node.leases(NETWORK).contains("10.53.0."),
            "{version}: all released"
        );
    }
}

#[test]
fn reference_bridge_and_host_local_then_our_istio_redirect() {
    for version in VERSIONS {
        let node = Node::new();
        let bins = plugin_dir(
            &node,
            "bins",
            &[
                ("bridge", reference("bridge")),
                ("host-local", reference("host-local")),
                ("istio-redirect", bin("istio-redirect")),
            ],
        );
        let list = json!({"cniVersion": version, "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": "cnimix2", "isGateway": true,
             "ipam": {"type": "host-local", "dataDir": node.path("ref-ipam").to_str().expect("UTF-8"),
                      "ranges": [[{"subnet": "10.54.0.0/24"}]]}},
            {"type": "istio-redirect", "redirect": {"excludeOutboundPorts": "5432"}}]});
        node.write_conf("10-mixed.conflist", &list);
        let chain = Chain {
            node: &node,
            version,
            env: vec![("CNI_PATH", &bins)],
        };
        let pod = node.pod("pod");
        let result = chain.add(&pod);
        assert_eq!(addresses(&result), ["10.54.0.2/24"], "{result}");
        let rules = pod.nat_rules("iptables-nft-save");
        assert!(
            rules.contains("-A ISTIO_OUTPUT -p tcp -m tcp --dport 5432 -j RETURN"),
            "{version}: {rules}"
        );
        chain.check(&pod);
        chain.del(&pod);
        let files = run(
            "ls",
            &[node.path("ref-ipam").join(NETWORK).to_str().expect("UTF-8")],
        )
        .stdout;
        assert!(!files.contains("10.54.0.2"), "{version}: {files}");
    }
}

/// Keys spelled as Go's decoder still matches them (any case, the later of
/// two winning): ours reads them as the reference does.
#[test]
fn keys_in_any_case_work_as_with_the_reference() {
    for suite in ["ours", "reference"] {
        let node = Node::new();
        let pod = node.pod("pod");
        let bins = match suite {
            "ours" => bin("bridge").parent().expect("dir").to_path_buf(),
            _ => PathBuf::from(REFERENCE),
        };
        let conf = json!({"CNIVersion": "1.0.0", "Name": NETWORK, "type": "bridge",
            "Bridge": "cnicase0", "isgateway": true, "IPMasq": false, "ipmasq": true,
            "capabilities": {"mac": true}, "RuntimeConfig": {"MAC": "c2:11:22:33:44:55"},
            "IPAM": {"Type": "host-local", "Socket": "", "Ranges": [[{"Subnet": "10.47.0.0/24"}]],
                     "DataDir": node.path("ipam").to_str().expect("UTF-8")}});
        let env = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "case-1"),
            ("CNI_NETNS", pod.path_str()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", bins.to_str().expect("UTF-8")),
        ];
        let added = run_in(
            node.netns.path(),
            &bins.join("bridge"),
            &[],
            &env,
            &conf.to_string(),
        );
        assert!(added.ok(), "{suite}: {added:?}");
        let result: Value = serde_json::from_str(&added.stdout).expect("a result");
        assert_eq!(result["cniVersion"], "1.0.0", "{suite}");
        assert_eq!(result["ips"][0]["address"], "10.47.0.2/24", "{suite}");
        let bridge = node.netns.ip(&["-o", "addr", "show", "cnicase0"]).stdout;
        assert!(bridge.contains("10.47.0.1/24"), "{suite}: isgateway: {bridge}");
        let eth0 = pod.ip(&["-o", "link", "show", "eth0"]).stdout;
        assert!(
            eth0.contains("c2:11:22:33:44:55"),
            "{suite}: RuntimeConfig.MAC: {eth0}"
        );
        let nat = node.run("iptables-save", &["-t", "nat"]).stdout;
        assert!(
            nat.contains("-j MASQUERADE"),
            "{suite}: the later ipmasq wins: {nat}"
        );
        let del = run_in(
            node.netns.path(),
            &bins.join("bridge"),
            &[],
            &[("CNI_COMMAND", "DEL"), env[1], env[2], env[3], env[4]],
            &conf.to_string(),
        );
        assert!(del.ok(), "{suite}: {del:?}");
    }
}
