//! Traffic through a Service is judged by its real endpoint: kube-proxy's
//! DNAT (and its masquerade of a pod reaching itself) in the node, before
//! the `forward` hook the policy holds, and a pod isolated for ingress
//! still reaching itself through its Service, hairpinned by its bridge
//! port (the `self-v4`/`self-v6` sets: `saddr . daddr`, its own address
//! twice).

use netpol::model::{Peer, Policy, PortSpec, Protocol, Rule};

use crate::kernel::{Cluster, DB_PORT, app, db_from_web, deny_all};

const SERVICE_PORT: u16 = 80;

fn service(v6: bool) -> &'static str {
    if v6 { "fd96::10" } else { "10.96.0.10" }
}

/// kube-proxy's iptables rules for one Service of one endpoint, `db`:
/// DNAT in `PREROUTING`, the endpoint's own traffic marked 0x4000 and
/// masqueraded in `POSTROUTING` (the hairpin).
fn kube_proxy(cluster: &Cluster, v6: bool) {
    let endpoint = cluster.address("db", v6);
    let (host, destination) = if v6 {
        (format!("{endpoint}/128"), format!("[{endpoint}]:{DB_PORT}"))
    } else {
        (format!("{endpoint}/32"), format!("{endpoint}:{DB_PORT}"))
    };
    let service = format!("{}/{}", service(v6), if v6 { 128 } else { 32 });
    let rules = format!(
        "*nat
:KUBE-SERVICES - [0:0]
:KUBE-SEP-DB - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A OUTPUT -j KUBE-SERVICES
-A POSTROUTING -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -j MASQUERADE
-A KUBE-SERVICES -d {service} -p tcp -m tcp --dport {SERVICE_PORT} -j KUBE-SEP-DB
-A KUBE-SEP-DB -s {host} -j KUBE-MARK-MASQ
-A KUBE-SEP-DB -p tcp -m tcp -j DNAT --to-destination {destination}
COMMIT
"
    );
    let restore = if v6 {
        "ip6tables-restore"
    } else {
        "iptables-restore"
    };
    test_kit::run_in(
        cluster.node.netns.path(),
        std::path::Path::new(restore),
        &["--noflush"],
        &[],
        &rules,
    )
    .success();
}

/// Whether pod `from` connects to the Service.
fn through_service(cluster: &Cluster, from: &str, v6: bool) -> bool {
    cluster
        .probe
        .connect(&cluster.pod(from).0, None, service(v6), SERVICE_PORT, None)
        .ok()
}

/// `web` may reach `db` on the database port, and nothing else.
fn web_only_to_db() -> Policy {
    Policy {
        namespace: "shop".into(),
        name: "web-to-db".into(),
        pod_selector: app("web"),
        ingress: None,
        egress: Some(vec![Rule {
            peers: Some(vec![Peer::Pods {
                pods: Some(app("db")),
                namespaces: None,
            }]),
            ports: vec![PortSpec::Range(Protocol::Tcp, DB_PORT, DB_PORT)],
        }]),
    }
}

#[test]
fn a_service_is_judged_by_its_endpoint_and_a_pod_isolated_for_ingress_reaches_itself_through_it() {
    test_kit::require_root();
    let cluster = Cluster::with_bridge(
        &[("web", "web"), ("db", "db"), ("other", "other")],
        &serde_json::json!({"hairpinMode": true, "isDefaultGateway": true}),
    );
    let _db = cluster.listen("db");
    // The node's own listener: what web's egress, isolated, cannot reach.
    let _node = cluster.probe.listen(&cluster.node.netns, &[DB_PORT]);
    let ports = {
        let shown = cluster
            .node
            .run("bridge", &["-d", "-o", "link", "show", "master", "polbr0"])
            .success()
            .stdout;
        assert_eq!(
            shown.matches("hairpin on").count(),
            3,
            "every pod's port hairpins: {shown}"
        );
        shown
    };
    // The pods reach the Service through their gateway, the bridge: its
    // IPv6 address answers neighbour solicitations once out of DAD.
    test_kit::wait_for(
        "the bridge's IPv6 address out of DAD",
        std::time::Duration::from_secs(10),
        || {
            let tentative = cluster
                .node
                .netns
                .ip(&["-6", "addr", "show", "dev", "polbr0", "tentative"])
                .success()
                .stdout;
            tentative.trim().is_empty()
        },
    );
    for v6 in [false, true] {
        kube_proxy(&cluster, v6);
        for pod in ["web", "other", "db"] {
            assert!(
                through_service(&cluster, pod, v6),
                "{pod} reaches the Service before any policy (v6: {v6}): {ports}"
            );
        }
    }

    // db: from web only, and default deny on top; web: to db only.
    cluster.enforce(vec![db_from_web(), deny_all(true, false), web_only_to_db()]);
    for v6 in [false, true] {
        // (a) web's egress names no Service address and db's ingress no
        // Service port: both are judged after the DNAT.
        assert!(
            through_service(&cluster, "web", v6),
            "web through the Service (v6: {v6})"
        );
        let gateway = if v6 { "fd77::1" } else { "10.77.0.1" };
        let to_node = |pod: &str| {
            cluster
                .probe
                .connect(&cluster.pod(pod).0, None, gateway, DB_PORT, None)
                .ok()
        };
        assert!(!to_node("web"), "web's egress is isolated (v6: {v6})");
        assert!(to_node("other"), "other's is not (v6: {v6})");
        // (b) The Service is no way around db's ingress.
        assert!(
            !through_service(&cluster, "other", v6),
            "other through the Service (v6: {v6})"
        );
        assert!(!cluster.connects("other", "db", DB_PORT, v6));
        // (c) db, isolated for ingress, reaches itself.
        assert!(
            through_service(&cluster, "db", v6),
            "db through its own Service (v6: {v6})"
        );
    }

    // That is the self sets' doing: without db's pair the hairpin is
    // judged like any peer, and refused; the next pass puts it back.
    for v6 in [false, true] {
        let db = cluster.address("db", v6);
        let set = if v6 { "self-v6" } else { "self-v4" };
        cluster.nft(&[
            "delete",
            "element",
            "inet",
            netpol::TABLE,
            set,
            &format!("{{ {db} . {db} }}"),
        ]);
        assert!(
            !through_service(&cluster, "db", v6),
            "db's hairpin without its {set} pair"
        );
        assert!(through_service(&cluster, "web", v6), "web unaffected (v6: {v6})");
        let script = cluster.enforce(vec![db_from_web(), deny_all(true, false), web_only_to_db()]);
        let ip: std::net::IpAddr = db.parse().expect("an address");
        let pair = firewall::ruleset::Element::key(firewall::ruleset::Value::concat(&[
            firewall::ruleset::Value::address(ip),
            firewall::ruleset::Value::address(ip),
        ]));
        assert_eq!(
            script.trim(),
            format!("add element {set} {{ {pair} }}"),
            "the pair put back, and nothing else"
        );
        assert!(
            through_service(&cluster, "db", v6),
            "db's hairpin again (v6: {v6})"
        );
    }
    cluster.on_node(netpol::remove).expect("remove");
}
