//! The suite on a real Kubernetes v1.20.2 (`integration/cluster`): kubelets,
//! containerd's CRI, kube-proxy, the controller-manager's pod CIDRs, and the
//! suite installed as users install it, `kubectl apply -f
//! deploy/cni-suite.yaml`. Only real objects: Deployments, Services, pods
//! with hostPorts. `make cluster-test` brings the cluster up, runs these
//! (they are ignored elsewhere: they need that cluster) and tears it down.

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use test_kit::cluster::{AGNHOST, Cluster, Namespace, Pod, host_port, poll};
use test_kit::node_agent::egress_returns;

use crate::common::{
    Reinstalled, agent_of, firewall_rules, gone, injected_pod, installed, node_lines, node_state,
    patch_settings, pause_deployment, ready_condition, rolling_update_with_churn, settled, torn_down,
    validation_failed, validation_runs,
};

const CONFLIST: &str = "/etc/cni/net.d/10-cni-suite.conflist";

/// A Deployment of agnhost's netexec (HTTP 8080, UDP 8081), `replicas`
/// spread evenly over the nodes (or on `node` only).
fn netexec_deployment(name: &str, replicas: usize, node: Option<&str>, host_port: Option<u16>) -> String {
    let placement = match node {
        Some(node) => format!("      nodeSelector: {{kubernetes.io/hostname: {node}}}\n"),
        None => format!(
            "      topologySpreadConstraints:\n      - {{maxSkew: 1, topologyKey: kubernetes.io/hostname, \
             whenUnsatisfiable: DoNotSchedule, labelSelector: {{matchLabels: {{app: {name}}}}}}}\n"
        ),
    };
    let host_port = host_port.map_or_else(String::new, |port| format!(", hostPort: {port}"));
    format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: {name}}}\nspec:\n  replicas: {replicas}\n  \
         selector: {{matchLabels: {{app: {name}}}}}\n  template:\n    metadata: {{labels: {{app: {name}}}}}\n    \
         spec:\n{placement}      terminationGracePeriodSeconds: 1\n      containers:\n      - name: netexec\n        \
         image: {AGNHOST}\n        args: [netexec, --http-port=8080, --udp-port=8081]\n        \
         ports: [{{containerPort: 8080{host_port}}}]\n        readinessProbe: {{httpGet: {{path: /healthz, port: 8080}}, periodSeconds: 1}}\n"
    )
}

/// The address part of netexec's `/clientip` answer (`ip:port`, `[ip]:port`).
fn client_ip(answer: &str) -> String {
    let host = answer.rsplit_once(':').map_or(answer, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']').to_owned()
}

fn one_per_node(pods: &[Pod]) -> Vec<&Pod> {
    let mut seen = BTreeSet::new();
    pods.iter().filter(|p| seen.insert(p.node.clone())).collect()
}

#[test]
#[ignore = "needs the real cluster: make cluster-test"]
fn the_agent_turns_every_node_ready() {
    let cluster = Cluster::get();
    let _shared = cluster.shared();
    let install = installed();
    let nodes = cluster.nodes();
    assert!(nodes.len() >= 3, "the cluster has {nodes:?}");
    // Before the apply: NotReady because no CNI configuration existed.
    assert_eq!(
        install.not_ready_before.len(),
        nodes.len(),
        "every node must be NotReady before the suite is applied (was the suite installed before the tests ran?): {:?}",
        install.not_ready_before
    );
    for (node, message) in &install.not_ready_before {
        assert!(
            message.contains("cni plugin not initialized") || message.contains("NetworkPluginNotReady"),
            "{node} was NotReady for another reason: {message}"
        );
    }
    // After: Ready, each with the agent's conflist.
    for node in &nodes {
        assert_eq!(ready_condition(cluster, node).0, "True", "{node}");
        let conflist = cluster.on_node(node, &["cat", CONFLIST]).success();
        let conflist: Value = serde_json::from_str(&conflist.stdout).expect("conflist is JSON");
        let spec = cluster.get_json(&["node", node]);
        for cidr in spec["spec"]["podCIDRs"].as_array().expect("podCIDRs") {
            assert!(
                conflist.to_string().contains(cidr.as_str().unwrap_or_default()),
                "{node}'s conflist lacks its pod CIDR {cidr}: {conflist}"
            );
        }
    }
    eprintln!("nodes Ready {:?} after the apply", install.ready_after);
}

#[test]
#[ignore = "needs the real cluster: make cluster-test"]
fn pods_talk_on_one_node_and_across_nodes_keeping_their_source() {
    let cluster = Cluster::get();
    let _shared = cluster.shared();
    installed();
    let ns = Namespace::new(cluster, "pod-to-pod");
    ns.apply(&netexec_deployment("netexec", 6, None, None));
    let pods = ns.ready_pods("app=netexec", 6, Duration::from_secs(120));
    let nodes: BTreeSet<&str> = pods.iter().map(|p| p.node.as_str()).collect();
    assert!(nodes.len() >= 3, "pods not spread over the nodes: {pods:?}");
    for client in one_per_node(&pods) {
        for server in pods.iter().filter(|p| p.name != client.name) {
            for ipv6 in [false, true] {
                let url = format!("http://{}/clientip", host_port(server.ip_like(ipv6), 8080));
                let seen = client_ip(&ns.curl(&client.name, &url));
                assert_eq!(
                    seen,
                    client.ip_like(ipv6),
                    "{} ({}) → {} ({}): the server saw another source",
                    client.name,
                    client.node,
                    server.name,
                    server.node
                );
            }
        }
    }
}

/// agnhost's netexec in the underlay's namespace: the world outside the
/// cluster, reporting the source it sees. Killed on drop.
struct Outside(Child);

impl Outside {
    fn start(cluster: &Cluster) -> Self {
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", cluster.underlay_netns()))
            .arg(cluster.dir().join("bin/agnhost"))
            .args(["netexec", "--http-port=18080", "--udp-port=18080"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start netexec outside the cluster");
        let mut outside = Outside(child);
        std::thread::sleep(Duration::from_millis(300));
        if let Ok(Some(status)) = outside.0.try_wait() {
            let mut stderr = String::new();
            if let Some(mut pipe) = outside.0.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut pipe, &mut stderr);
            }
            panic!("netexec outside the cluster exited {status}: {stderr}");
        }
        outside
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
#[ignore = "needs the real cluster: make cluster-test"]
fn traffic_leaving_the_cluster_is_masqueraded_to_the_node() {
    let cluster = Cluster::get();
    let _shared = cluster.shared();
    installed();
    let _outside = Outside::start(cluster);
    // One rule per family whatever the Nodes: the controller-manager's
    // range, read from kubeadm's record of it.
    for node in cluster.nodes() {
        let mut returns = Vec::new();
        for save in ["iptables-save", "ip6tables-save"] {
            returns.extend(egress_returns(
                &cluster.on_node(&node, &[save, "-t", "nat"]).success().stdout,
            ));
        }
        assert_eq!(returns, cluster.pod_cidrs(), "{node}'s masquerade chain");
    }
    let ns = Namespace::new(cluster, "egress");
    ns.apply(&netexec_deployment("netexec", 3, None, None));
    let pods = ns.ready_pods("app=netexec", 3, Duration::from_secs(120));
    for pod in one_per_node(&pods) {
        let node_ips = cluster.node_ips(&pod.node);
        for outside in cluster.outside_addresses() {
            let url = format!("http://{}/clientip", host_port(outside, 18080));
            let seen = client_ip(&ns.curl(&pod.name, &url));
            assert!(
                node_ips.contains(&seen),
                "{} on {}: the outside saw {seen}, not one of the node's addresses {node_ips:?}",
                pod.name,
                pod.node
            );
        }
    }
}

#[test]
#[ignore = "needs the real cluster: make cluster-test"]
fn cluster_ip_and_node_port_services_answer_from_another_node() {
    let cluster = Cluster::get();
    let _shared = cluster.shared();
    installed();
    let nodes = cluster.nodes();
    let (backend_node, client_node, third_node) = (&nodes[0], &nodes[1], &nodes[2]);
    let ns = Namespace::new(cluster, "services");
    ns.apply(&netexec_deployment("backend", 2, Some(backend_node), None));
    ns.apply(&netexec_deployment("client", 1, Some(client_node), None));
    ns.apply(
        "apiVersion: v1\nkind: Service\nmetadata: {name: backend}\nspec:\n  type: NodePort\n  \
         ipFamilyPolicy: RequireDualStack\n  selector: {app: backend}\n  \
         ports: [{port: 80, targetPort: 8080, protocol: TCP}]\n",
    );
    let backends = ns.ready_pods("app=backend", 2, Duration::from_secs(120));
    let names: BTreeSet<String> = backends.iter().map(|p| p.name.clone()).collect();
    let client = &ns.ready_pods("app=client", 1, Duration::from_secs(120))[0];
    let service = ns
        .kubectl(&["get", "service", "backend", "-o", "json"])
        .success()
        .json();
    let cluster_ips: Vec<String> = service["spec"]["clusterIPs"]
        .as_array()
        .expect("clusterIPs")
        .iter()
        .filter_map(|ip| ip.as_str().map(str::to_owned))
        .collect();
    assert_eq!(cluster_ips.len(), 2, "a dual-stack Service: {service}");
    let node_port = service["spec"]["ports"][0]["nodePort"]
        .as_u64()
        .expect("nodePort");
    let node_port = u16::try_from(node_port).expect("a port");
    let mut targets: Vec<String> = cluster_ips.iter().map(|ip| host_port(ip, 80)).collect();
    for node in [backend_node, third_node] {
        for ip in cluster.node_ips(node) {
            targets.push(host_port(&ip, node_port));
        }
    }
    for target in targets {
        let answer = ns.curl(&client.name, &format!("http://{target}/hostname"));
        assert!(
            names.contains(&answer),
            "{target} from {} answered {answer:?}, not a backend {names:?}",
            client.node
        );
    }
    // Hairpin: a pod reaching itself through its own Service, whose only
    // backend it is (kube-proxy sends the packet back out of the bridge port
    // it came in by: the bridge's `hairpinMode`).
    ns.apply(
        "apiVersion: v1\nkind: Service\nmetadata: {name: client}\nspec:\n  \
         ipFamilyPolicy: RequireDualStack\n  selector: {app: client}\n  \
         ports: [{port: 80, targetPort: 8080, protocol: TCP}]\n",
    );
    let service = ns
        .kubectl(&["get", "service", "client", "-o", "json"])
        .success()
        .json();
    for ip in service["spec"]["clusterIPs"].as_array().expect("clusterIPs") {
        let ip = ip.as_str().expect("an address");
        let answer = ns.curl(&client.name, &format!("http://{}/hostname", host_port(ip, 80)));
        assert_eq!(answer, client.name, "{ip} from its only backend");
    }
}

#[test]
#[ignore = "needs the real cluster: make cluster-test"]
fn host_port_answers_at_the_node_address_from_another_node() {
    let cluster = Cluster::get();
    let _shared = cluster.shared();
    installed();
    let nodes = cluster.nodes();
    let (server_node, other_node) = (&nodes[2], &nodes[0]);
    let ns = Namespace::new(cluster, "host-port");
    ns.apply(&netexec_deployment(
        "published",
        1,
        Some(server_node),
        Some(18081),
    ));
    let server = &ns.ready_pods("app=published", 1, Duration::from_secs(120))[0];
    for ip in cluster.node_ips(server_node) {
        let url = format!("http://{}/hostname", host_port(&ip, 18081));
        poll(
            &format!("{url} from {other_node}"),
            Duration::from_secs(20),
            Duration::from_millis(500),
            || {
                let run = cluster.on_node(other_node, &["curl", "-sS", "-g", "-m", "5", &url]);
                if run.ok() && run.stdout.trim() == server.name {
                    Ok(())
                } else {
                    Err(format!("{run:?}"))
                }
            },
        );
    }
}

/// What a node holds of the suite's per-pod state and of the pods'
/// networking: veths, leases, libcni's cached results, the suite's state
/// files and every firewall rule. Sorted lines, so two can be compared.
fn pod_footprint(cluster: &Cluster, node: &str) -> BTreeSet<String> {
    // A veth by index and name (its peer and counters say nothing more).
    let mut lines: Vec<String> = node_lines(
        cluster,
        node,
        "veth",
        &["ip", "-o", "link", "show", "type", "veth"],
    )
    .into_iter()
    .map(|line| line.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
    .collect();
    // Either directory may not exist yet on a node that never ran a pod.
    let files = "find /var/lib/cni /run/cni-suite -path '*/.sled' -prune -o -type f -print 2>/dev/null; true";
    lines.extend(node_lines(cluster, node, "state", &["sh", "-c", files]));
    lines.extend(firewall_rules(cluster, node));
    let cnictl = test_kit::bin("cnictl");
    let export = ["ipam", "--data-dir", "/run/cni-suite/ipam", "export", "cni-suite"];
    let mut args = vec![cnictl.to_str().expect("a UTF-8 path")];
    args.extend(export);
    let leases = cluster.on_node(node, &args).success().json();
    for lease in leases["leases"].as_array().into_iter().flatten() {
        lines.push(format!("lease: {} {}", lease["ip"], lease["containerID"]));
    }
    lines.into_iter().collect()
}

/// Every node's `pod_footprint` once it holds still: the same twice, 12 s
/// apart, with every deleted pod torn down. The kubelet of 1.20 can start a
/// new sandbox for a pod whose deletion it has not processed yet, after
/// the API server has dropped the pod (seen here: a sandbox "Attempt:1"
/// of a deleted pod, torn down at the pod worker's next sync, 10 s later).
fn footprints_at_rest(cluster: &Cluster, nodes: &[String]) -> Vec<BTreeSet<String>> {
    let take = || {
        torn_down(cluster);
        nodes
            .iter()
            .map(|n| pod_footprint(cluster, n))
            .collect::<Vec<_>>()
    };
    let mut last = take();
    for _ in 0..10 {
        std::thread::sleep(Duration::from_secs(12));
        let now = take();
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("the nodes' pod state never held still for 12 s");
}

#[test]
#[ignore = "needs the real cluster: make cluster-test"]
fn a_hundred_pods_created_and_deleted_leave_nothing_on_any_node() {
    let cluster = Cluster::get();
    let _exclusive = cluster.exclusive();
    installed();
    settled(cluster);
    let nodes = cluster.nodes();
    let ns = Namespace::new(cluster, "churn");
    // What a node keeps for all pods once the first came (portmap's shared
    // CNI-HOSTPORT-* chains and their jumps, as the reference portmap keeps
    // them; host-local's lock file) is not a pod's: one wave of hostPort
    // pods first, so that the comparison sees only what pods leave.
    ns.apply(&pause_deployment("published", nodes.len(), Some(18090)));
    ns.ready_pods("app=published", nodes.len(), Duration::from_secs(120));
    ns.kubectl(&["delete", "deployment", "published"]).success();
    gone(&ns, "app=published");
    let before = footprints_at_rest(cluster, &nodes);
    // 100 pods: 97 plain, 3 with a hostPort (portmap's rules), one per node.
    ns.apply(&pause_deployment("plain", 97, None));
    ns.apply(&pause_deployment("published", nodes.len(), Some(18090)));
    let started = std::time::Instant::now();
    let plain = ns.ready_pods("app=plain", 97, Duration::from_secs(300));
    let published = ns.ready_pods("app=published", nodes.len(), Duration::from_secs(120));
    eprintln!("100 pods running after {:?}", started.elapsed());
    assert_eq!(plain.len() + published.len(), 97 + nodes.len());
    let during = pod_footprint(cluster, &nodes[0]);
    assert!(
        during.len() > before[0].len(),
        "the pods left no trace on {} to look for",
        nodes[0]
    );
    ns.kubectl(&["delete", "deployment", "--all"]).success();
    gone(&ns, "app");
    for (node, before) in nodes.iter().zip(&before) {
        poll(
            &format!("{node} to hold what it held before the pods"),
            Duration::from_secs(60),
            Duration::from_secs(1),
            || {
                let after = pod_footprint(cluster, node);
                let left: Vec<&String> = after.difference(before).collect();
                let lost: Vec<&String> = before.difference(&after).collect();
                if left.is_empty() && lost.is_empty() {
                    Ok(())
                } else {
                    Err(format!("left behind: {left:#?}\nremoved: {lost:#?}"))
                }
            },
        );
    }
}

/// The suite's agent pod on `node`: (name, ready), once scheduled there.
fn agent_on(cluster: &Cluster, node: &str) -> Option<(String, bool)> {
    agent_of(cluster, test_kit::cluster::AGENT, node)
}

/// `node`'s route to `cidr` (`ip route show`), empty when it has none.
fn route_to(cluster: &Cluster, node: &str, cidr: &str) -> String {
    let family = if cidr.contains(':') { "-6" } else { "-4" };
    cluster
        .on_node(node, &["ip", family, "route", "show", cidr])
        .success()
        .stdout
        .trim()
        .to_owned()
}

/// A node machine added by a test, removed with its Node object on drop.
struct AddedNode(&'static str);

impl Drop for AddedNode {
    fn drop(&mut self) {
        let cluster = Cluster::get();
        cluster.run_script(&["remove-node", self.0]);
        cluster.kubectl(&["delete", "node", self.0, "--ignore-not-found"]);
    }
}

#[test]
#[ignore = "needs the real cluster: make cluster-test"]
fn a_node_joining_later_is_routed_to_and_a_deleted_one_no_longer() {
    let cluster = Cluster::get();
    let _exclusive = cluster.exclusive();
    installed();
    let others = cluster.nodes();
    let name = "late";
    // The guard first: a failed add-node leaves a machine to remove too.
    let added = AddedNode(name);
    cluster.run_script(&["add-node", name, "--no-kubelet"]).success();
    let started = std::time::Instant::now();
    cluster.run_script(&["start-kubelet", name]).success();
    let mut cidrs = Vec::new();
    poll(
        "the late node's pod CIDRs",
        Duration::from_secs(120),
        Duration::from_millis(200),
        || {
            let node = cluster.kubectl(&["get", "node", name, "-o", "json"]);
            if !node.ok() {
                return Err(node.stderr);
            }
            let node = node.json();
            cidrs = node["spec"]["podCIDRs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c.as_str().map(str::to_owned))
                .collect();
            if cidrs.len() == 2 {
                Ok(())
            } else {
                Err(format!("podCIDRs {cidrs:?}"))
            }
        },
    );
    let cidrs_at = started.elapsed();
    let node_ips = cluster.node_ips(name);
    let routed = poll(
        "every other node to route to the late node",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            for other in &others {
                for cidr in &cidrs {
                    let route = route_to(cluster, other, cidr);
                    if !node_ips.iter().any(|ip| route.contains(&format!("via {ip} "))) {
                        return Err(format!(
                            "{other}: route to {cidr} is {route:?}, not via {node_ips:?}"
                        ));
                    }
                }
            }
            Ok(())
        },
    );
    poll(
        "the late node's agent Ready",
        Duration::from_secs(120),
        Duration::from_millis(200),
        || match agent_on(cluster, name) {
            Some((_, true)) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    let agent_ready_at = started.elapsed();
    let conflist_after_ready = poll(
        "the late node's conflist once its agent is Ready",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            let run = cluster.on_node(name, &["cat", CONFLIST]);
            if run.ok() { Ok(()) } else { Err(format!("{run:?}")) }
        },
    );
    eprintln!(
        "late node: pod CIDRs {cidrs_at:?} after its kubelet started; routes on every other node {routed:?} later; \
         agent Ready at {agent_ready_at:?}, conflist {conflist_after_ready:?} after that"
    );
    poll(
        "the late node Ready",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            let (status, message) = ready_condition(cluster, name);
            if status == "True" { Ok(()) } else { Err(message) }
        },
    );
    // Pods there talk to pods on the first node.
    let ns = Namespace::new(cluster, "late-node");
    ns.apply(&netexec_deployment("there", 1, Some(name), None));
    ns.apply(&netexec_deployment("here", 1, Some(&others[0]), None));
    let there = &ns.ready_pods("app=there", 1, Duration::from_secs(120))[0];
    let here = &ns.ready_pods("app=here", 1, Duration::from_secs(120))[0];
    for ipv6 in [false, true] {
        let url = format!("http://{}/hostname", host_port(there.ip_like(ipv6), 8080));
        assert_eq!(ns.curl(&here.name, &url), there.name);
    }
    drop(ns);
    // The machine goes, then its Node object: every other node drops the
    // routes to its pod CIDRs.
    cluster.run_script(&["remove-node", name]).success();
    cluster.kubectl(&["delete", "node", name]).success();
    let unrouted = poll(
        "every other node to drop its routes to the deleted node",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || {
            for other in &others {
                for cidr in &cidrs {
                    let route = route_to(cluster, other, cidr);
                    if !route.is_empty() {
                        return Err(format!("{other} still routes {route}"));
                    }
                }
            }
            Ok(())
        },
    );
    eprintln!("deleted node: routes gone from every other node {unrouted:?} after the delete");
    drop(added);
}

/// One test, not two, because each rollout of the DaemonSet over the nodes
/// costs the cluster tier most of a minute: the rolling update to a new
/// tag is also the restart that the README's uninstall asks for after
/// setting `UNINSTALL_ON_STOP`, and the uninstall's re-apply puts the
/// manifest's tag back without one more rollout.
#[test]
#[ignore = "needs the real cluster: make cluster-test"]
fn the_agent_rolls_to_a_new_tag_failing_no_pod_and_its_uninstall_leaves_every_node_as_before() {
    let cluster = Cluster::get();
    let _exclusive = cluster.exclusive();
    let install = installed();
    settled(cluster);
    // The suite installed afresh afterwards, whichever way this ends: the
    // manifest's tag and settings back on every node (a node added later
    // has only that tag).
    let _reinstall = Reinstalled;
    // As the README tells users; the agents the rolling update starts are
    // the ones that read it.
    patch_settings(
        cluster,
        test_kit::cluster::AGENT,
        r#"{"UNINSTALL_ON_STOP":"true"}"#,
    );
    rolling_update_with_churn(cluster, test_kit::cluster::AGENT, "rolled", &[]);
    settled(cluster);
    cluster.uninstall().expect("the manifest deleted");
    for (node, before) in &install.state_before {
        let after = node_state(cluster, node);
        let left: Vec<&String> = after.difference(before).collect();
        let lost: Vec<&String> = before.difference(&after).collect();
        assert!(
            left.is_empty() && lost.is_empty(),
            "{node} after the uninstall differs from before the apply:\nleft behind: {left:#?}\nremoved: {lost:#?}"
        );
    }
}

/// Applies the base manifest again when a test that switched to Istio's
/// ends, whichever way: the other tests and the e2e specs run on the suite.
struct BaseManifest;

impl Drop for BaseManifest {
    fn drop(&mut self) {
        if let Err(e) = Cluster::get().apply_manifest("cni-suite.yaml") {
            eprintln!("restoring the base manifest: {e}");
        }
    }
}

/// Capture, repair and a rolling update in one test, not three: each switch
/// of manifest and each rollout of the DaemonSet over the nodes costs the
/// cluster tier most of a minute.
#[test]
#[ignore = "needs the real cluster: make cluster-test"]
fn the_istio_manifest_captures_injected_pods_repairs_one_that_lost_the_race_and_rolls_failing_no_pod() {
    let cluster = Cluster::get();
    let _exclusive = cluster.exclusive();
    installed();
    settled(cluster);
    let ns = Namespace::new(cluster, "istio");
    // Started while istio-redirect is not chained: its validation fails.
    ns.apply(&injected_pod("early"));
    validation_failed(&ns, "early");
    let _base = BaseManifest;
    cluster
        .apply_manifest("cni-suite-istio.yaml")
        .expect("the Istio manifest");
    // Created with the chain in place: captured from its first start.
    ns.apply(&injected_pod("late"));
    ns.ready_pods("app=late", 1, Duration::from_secs(120));
    let (codes, restarts) = validation_runs(&ns, "late");
    assert_eq!(
        (codes.as_slice(), restarts),
        (&[0][..], 0),
        "the late pod's validation did not pass at once"
    );
    // The early one is repaired where it runs, then its validation passes.
    let repaired = poll(
        "the early pod to be repaired and Ready",
        Duration::from_secs(240),
        Duration::from_secs(1),
        || {
            let early = ns.pods("app=early");
            if early.len() == 1 && early[0].ready {
                Ok(())
            } else {
                Err(format!("{:?}", validation_runs(&ns, "early")))
            }
        },
    );
    let events = ns
        .kubectl(&[
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=early",
            "-o",
            "json",
        ])
        .success()
        .json();
    // A repair that worked is a Normal event; a failed attempt a Warning.
    let recorded: Vec<(&str, &str)> = events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| Some((e["type"].as_str()?, e["reason"].as_str()?)))
        .collect();
    assert!(
        recorded.contains(&("Normal", "RepairBrokenPod")),
        "no repair recorded on the early pod: {recorded:?}"
    );
    eprintln!("istio: the early pod repaired and Ready {repaired:?} after the late one was");
    drop(ns);
    settled(cluster);
    rolling_update_with_churn(cluster, test_kit::cluster::AGENT, "rolled-istio", &[]);
}
