//! containerd's CRI plugin driven over CRI v1 gRPC the way kubelet drives
//! it: pod sandboxes get their network from our conflist (bridge +
//! host-local + istio-redirect), with the pod's annotations reaching
//! istio-redirect through the runtime and no API server anywhere; and
//! hostPorts published by portmap from the sandbox config.

use std::path::Path;

use k8s_cri::v1::{PortMapping, Protocol};
use serde_json::json;
use test_kit::fakes::containerd::{Containerd, Cri, Kubelet, PAUSE};
use test_kit::probe::Probe;
use test_kit::{Netns, Node, bin_dir, run_in};

const NETWORK: &str = "k8s-pod-network";
const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":["istio-envoy"],"revision":"default"}"#;

fn capture_rules(pid: u32) -> String {
    let netns = format!("/proc/{pid}/ns/net");
    run_in(
        Path::new(&netns),
        Path::new("iptables-nft-save"),
        &["-t", "nat"],
        &[],
        "",
    )
    .success()
    .stdout
}

/// containerd with its CRI plugin on our binaries and the node's
/// configuration, the sandbox image imported, and kubelet's connection.
fn start_cri(node: &Node) -> (Containerd, Kubelet) {
    let cri = Cri {
        conf_dir: node.conf_dir(),
        bin_dir: bin_dir(),
        sandbox_image: PAUSE.into(),
    };
    let containerd = Containerd::start(node, Some(&cri));
    containerd.import_busybox(node, "k8s.io", PAUSE, &["/bin/sleep", "2147483647"]);
    let kubelet = Kubelet::connect(containerd.address());
    (containerd, kubelet)
}

#[test]
fn pod_sandboxes_through_cri() {
    let node = Node::new();
    node.write_conf(
        "10-mesh.conflist",
        &json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": "cnicri0", "isGateway": true, "ipMasq": true,
             "ipam": {"type": "host-local", "socket": "", "dataDir": node.path("ipam").to_str().expect("UTF-8"),
                      "ranges": [[{"subnet": "10.59.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "istio-redirect", "capabilities": {"io.kubernetes.cri.pod-annotations": true},
             "kubeconfig": node.path("no-kubeconfig").to_str().expect("UTF-8"),
             "exclude_namespaces": ["kube-system"], "api_attempts": 1}]}),
    );
    let (containerd, mut kubelet) = start_cri(&node);
    let annotations = [
        ("sidecar.istio.io/status", STATUS),
        ("sidecar.istio.io/interceptionMode", "REDIRECT"),
        ("traffic.sidecar.istio.io/excludeOutboundPorts", "5432"),
    ];

    let web = kubelet
        .run_pod("default", "web-0", &annotations)
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n--- containerd log\n{}", containerd.log()));
    let (ip, pid) = kubelet.status(&web);
    assert_eq!(ip, "10.59.0.2", "PodSandboxStatus reports our address");
    let rules = capture_rules(pid);
    assert!(
        rules.contains("-A ISTIO_OUTPUT -p tcp -m tcp --dport 5432 -j RETURN"),
        "the annotations reached istio-redirect: {rules}"
    );
    // What containerd passed, as libcni cached it.
    let cached = node
        .cache_entry(NETWORK, &web, "eth0")
        .expect("cached by containerd");
    let args: Vec<(String, String)> = serde_json::from_value(cached["cniArgs"].clone()).expect("cniArgs");
    for expected in [
        ("K8S_POD_NAMESPACE", "default"),
        ("K8S_POD_NAME", "web-0"),
        ("K8S_POD_INFRA_CONTAINER_ID", web.as_str()),
    ] {
        assert!(
            args.iter().any(|(k, v)| k == expected.0 && v == expected.1),
            "{expected:?} in {args:?}"
        );
    }
    assert_eq!(
        cached["capabilityArgs"]["io.kubernetes.cri.pod-annotations"]["sidecar.istio.io/interceptionMode"],
        "REDIRECT"
    );

    // The namespace arrives too: kube-system is excluded.
    let dns = kubelet
        .run_pod("kube-system", "coredns-0", &annotations)
        .expect("RunPodSandbox");
    let (dns_ip, dns_pid) = kubelet.status(&dns);
    assert_eq!(dns_ip, "10.59.0.3");
    assert!(!capture_rules(dns_pid).contains("ISTIO"), "excluded namespace");

    // Two DELs per pod (the second with no netns and no prevResult); then
    // nothing of ours is left.
    kubelet.stop_and_remove(&web);
    kubelet.stop_and_remove(&dns);
    let left = node.leftovers(NETWORK, &node.path("ipam"));
    assert!(left.is_empty(), "left behind: {left:#?}");
}

/// A pod with a `hostPort`, as kubelet asks for it (the sandbox config's
/// `port_mappings`), through minikube's chain: bridge, portmap, firewall.
#[test]
fn host_ports_through_cri() {
    let node = Node::new();
    let client = Netns::new("client");
    node.netns.ip(&["link", "set", "lo", "up"]).success();
    node.netns.veth_to("cl0", &client);
    for (ns, link, address) in [
        (&node.netns, "cl0", "192.0.2.1/24"),
        (&client, "eth0", "192.0.2.2/24"),
    ] {
        ns.ip(&["addr", "add", address, "dev", link]).success();
        ns.ip(&["link", "set", link, "up"]).success();
    }
    node.write_conf(
        "10-minikube.conflist",
        &json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": "cnicri1", "isGateway": true, "ipMasq": true, "hairpinMode": true,
             "ipam": {"type": "host-local", "socket": "", "dataDir": node.path("ipam").to_str().expect("UTF-8"),
                      "ranges": [[{"subnet": "10.58.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": true},
             "stateDir": node.path("portmap").to_str().expect("UTF-8")},
            {"type": "firewall", "stateDir": node.path("firewall").to_str().expect("UTF-8")}]}),
    );
    let (containerd, mut kubelet) = start_cri(&node);
    let ports = [
        PortMapping {
            protocol: Protocol::Tcp as i32,
            container_port: 8080,
            host_port: 18085,
            host_ip: String::new(),
        },
        // A containerPort without a hostPort: kubelet sends it, nothing
        // is published.
        PortMapping {
            protocol: Protocol::Tcp as i32,
            container_port: 9090,
            host_port: 0,
            host_ip: String::new(),
        },
    ];
    let web = kubelet
        .run_pod_with_ports("default", "web-0", &ports)
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n--- containerd log\n{}", containerd.log()));
    let (ip, pid) = kubelet.status(&web);
    assert_eq!(ip, "10.58.0.2");
    let cached = node
        .cache_entry(NETWORK, &web, "eth0")
        .expect("cached by containerd");
    assert_eq!(
        cached["capabilityArgs"]["portMappings"],
        json!([{"HostPort": 18085, "ContainerPort": 8080, "Protocol": "tcp", "HostIP": ""}]),
        "what containerd passed"
    );

    let pod = Netns::attach("web", pid);
    let probe = Probe::new();
    let listener = probe.listen(&pod, &[8080]);
    probe.connect(&client, None, "192.0.2.1", 18085, None).success();
    listener.wait_for("tcp 8080 10.58.0.2:8080");
    // The node itself, through localhost (route_localnet and the
    // masquerade portmap adds for it).
    probe
        .connect(&node.netns, None, "127.0.0.1", 18085, None)
        .success();
    // A containerPort without hostPort is not published.
    probe.connect(&client, None, "192.0.2.1", 19090, None).failure();
    drop(listener);
    drop(pod);

    kubelet.stop_and_remove(&web);
    let nat = node.run("iptables-save", &["-t", "nat"]).success().stdout;
    assert!(!nat.contains("18085"), "{nat}");
    let filter = node.run("iptables-save", &["-t", "filter"]).success().stdout;
    assert!(!filter.contains("10.58.0.2"), "{filter}");
    let mut left = node.leftovers(NETWORK, &node.path("ipam"));
    left.retain(|l| !l.contains(" cl0@"));
    assert!(left.is_empty(), "left behind: {left:#?}");
}
