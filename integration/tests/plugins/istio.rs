//! istio-redirect end to end: the built plugin programs real pod namespaces
//! (chained after bridge + host-local through cnictl, or executed directly as
//! libcni does), the kernel's rules are read back and compared with Istio's,
//! and real TCP/UDP traffic shows where each connection lands.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use firewall::Family;
use istio_redirect::rules::{Mode, Redirect, Selection, render, render_nft};
use serde_json::{Value, json};
use tempfile::TempDir;
use test_kit::fakes::api_server::ApiServer;
use test_kit::probe::{Probe, sorted};
use test_kit::{Netns, Node, bin_dir, run_in};

use crate::common::{Exec, NETWORK, add, addressed_pod, entry, error_code, k8s_args, passed_through};

const STATUS: &str = "sidecar.istio.io/status";
const STATUS_JSON: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":["istio-envoy"],"revision":"default"}"#;

// --- rules as the kernel holds them --------------------------------------

/// Rules per (table, chain), in order; user chains with no rules appear
/// with an empty list.
type Chains = BTreeMap<(String, String), Vec<String>>;

/// Parses `iptables-save` output, keeping only Istio's chains and the
/// built-in chains that hold rules.
fn saved_chains(save: &str) -> Chains {
    let mut chains = Chains::new();
    let mut table = String::new();
    for line in save.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.to_owned();
        } else if let Some(decl) = line.strip_prefix(':') {
            let chain = decl.split_whitespace().next().unwrap_or_default();
            if chain.starts_with("ISTIO") {
                chains.entry((table.clone(), chain.to_owned())).or_default();
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let chain = rule.split_whitespace().next().unwrap_or_default().to_owned();
            chains
                .entry((table.clone(), chain))
                .or_default()
                .push(line.to_owned());
        }
    }
    chains
}

/// What Istio's listings say a pod holds for these settings.
fn expected_chains(redirect: &Redirect, family: Family) -> Chains {
    let mut chains = Chains::new();
    let rules = render(redirect, family);
    for (table, rule) in rules.lines() {
        let chain = rule.split_whitespace().nth(1).unwrap_or_default().to_owned();
        chains
            .entry((table.to_owned(), chain))
            .or_default()
            .push(rule.to_owned());
    }
    // Declared chains nothing appends to (ISTIO_INBOUND with inbound off).
    for line in rules.restore_fresh().lines() {
        if let Some(chain) = line.strip_prefix("-N ") {
            let table = rules
                .restore_fresh()
                .lines()
                .take_while(|l| *l != line)
                .filter_map(|l| l.strip_prefix('*'))
                .last()
                .unwrap_or_default()
                .to_owned();
            chains.entry((table, chain.to_owned())).or_default();
        }
    }
    chains
}

fn save_tool(family: Family, backend: &str) -> String {
    let base = match family {
        Family::V4 => "iptables",
        Family::V6 => "ip6tables",
    };
    format!("{base}-{backend}-save")
}

fn pod_chains(pod: &Netns, family: Family, backend: &str) -> Chains {
    let save = run_in(pod.path(), Path::new(&save_tool(family, backend)), &[], &[], "").success();
    saved_chains(&save.stdout)
}

fn assert_holds(pod: &Netns, redirect: &Redirect, families: &[Family], backend: &str) {
    for family in families {
        assert_eq!(
            pod_chains(pod, *family, backend),
            expected_chains(redirect, *family),
            "{family:?} rules in the pod differ from Istio's"
        );
    }
}

// --- what the pod holds --------------------------------------------------

fn no_istio_rules(pod: &Netns) -> bool {
    [Family::V4, Family::V6].iter().all(|f| {
        pod_chains(pod, *f, "nft")
            .keys()
            .all(|(_, chain)| !chain.starts_with("ISTIO"))
    })
}

fn cidr(text: &str) -> ipnetwork::IpNetwork {
    text.parse().expect("CIDR")
}

// --- rules ---------------------------------------------------------------

#[test]
fn the_kernel_holds_exactly_istios_rules() {
    let node = Node::new();
    let base = Redirect {
        dual_stack: true,
        ..Redirect::default()
    };
    let cases: Vec<(Value, Redirect)> = vec![
        (json!({}), base.clone()),
        (
            json!({"interceptionMode": "TPROXY"}),
            Redirect {
                mode: Mode::Tproxy,
                ..base.clone()
            },
        ),
        (
            json!({"excludeOutboundIPRanges": "10.0.0.0/8,fd00::/8", "includeInboundPorts": "8080,9090",
                   "excludeOutboundPorts": "5432", "includeOutboundPorts": "7000", "excludeInterfaces": "net1"}),
            Redirect {
                exclude_cidrs: vec![cidr("10.0.0.0/8"), cidr("fd00::/8")],
                include_inbound_ports: Selection::Only(vec![8080, 9090]),
                exclude_outbound_ports: vec![5432],
                include_outbound_ports: vec![7000],
                exclude_interfaces: vec!["net1".into()],
                ..base.clone()
            },
        ),
        (
            json!({"includeOutboundIPRanges": "10.96.0.0/12", "includeInboundPorts": ""}),
            Redirect {
                include_cidrs: Selection::Only(vec![cidr("10.96.0.0/12")]),
                include_inbound_ports: Selection::Only(vec![]),
                ..base.clone()
            },
        ),
    ];
    for (settings, redirect) in cases {
        for dns_capture in [false, true] {
            let pod = addressed_pod(&node, &["10.60.0.2/24", "fd60::2/64"]);
            let conf = entry(json!({"redirect": settings, "dual_stack": true, "dns_capture": dns_capture}));
            let run = add(&node, &pod, &conf).success();
            assert_eq!(run.json(), passed_through(&conf), "the result passes through");
            let redirect = Redirect {
                dns_capture,
                ..redirect.clone()
            };
            assert_holds(&pod, &redirect, &[Family::V4, Family::V6], "nft");
            assert!(
                pod.ip(&["-6", "addr", "show", "dev", "lo"])
                    .success()
                    .stdout
                    .contains("::6/128"),
                "Envoy's inbound source ::6 is on lo"
            );
            let rules = pod.ip(&["rule"]).success().stdout + &pod.ip(&["-6", "rule"]).success().stdout;
            let tproxy = redirect.mode == Mode::Tproxy;
            assert_eq!(
                rules.matches("fwmark 0x539 lookup 133").count(),
                if tproxy { 2 } else { 0 },
                "{rules}"
            );
            if tproxy {
                for family in ["-4", "-6"] {
                    let table = pod
                        .ip(&[family, "route", "show", "table", "133"])
                        .success()
                        .stdout;
                    assert!(table.starts_with("local default dev lo"), "{table}");
                }
            }
        }
    }
}

#[test]
fn ipv6_follows_istios_rule() {
    let node = Node::new();
    let conf = entry(json!({"redirect": {}}));
    // Without dual stack, the first address decides.
    let v4_first = addressed_pod(&node, &["10.60.0.2/24", "fd60::2/64"]);
    add(&node, &v4_first, &conf).success();
    assert_holds(&v4_first, &Redirect::default(), &[Family::V4], "nft");
    assert!(pod_chains(&v4_first, Family::V6, "nft").is_empty());

    let v6_only = addressed_pod(&node, &["fd60::2/64"]);
    add(&node, &v6_only, &conf).success();
    assert_holds(&v6_only, &Redirect::default(), &[Family::V4, Family::V6], "nft");
}

#[test]
fn a_rerun_is_unchanged_and_other_istio_rules_are_replaced() {
    let node = Node::new();
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    let first = entry(json!({"redirect": {"excludeOutboundPorts": "5432"}, "plugin_log_level": "info"}));
    add(&node, &pod, &first).success();
    let before = run_in(pod.path(), Path::new("iptables-nft-save"), &[], &[], "").success();
    let again = add(&node, &pod, &first).success();
    assert!(again.stderr.contains("already in place"), "{again:?}");
    let after = run_in(pod.path(), Path::new("iptables-nft-save"), &[], &[], "").success();
    assert_eq!(
        saved_chains(&before.stdout),
        saved_chains(&after.stdout),
        "no doubled jumps"
    );

    let second = entry(json!({"redirect": {"excludeOutboundPorts": "6379", "interceptionMode": "TPROXY"}}));
    let replaced = add(&node, &pod, &second).success();
    assert!(replaced.stderr.contains("replaced"), "{replaced:?}");
    let expected = Redirect {
        mode: Mode::Tproxy,
        exclude_outbound_ports: vec![6379],
        ..Redirect::default()
    };
    assert_holds(&pod, &expected, &[Family::V4], "nft");
}

/// The pod's policy routing: its rules and table 133, both families.
fn policy_routing(pod: &Netns) -> String {
    ["-4", "-6"]
        .iter()
        .flat_map(|family| {
            [
                pod.ip(&[family, "rule"]).stdout,
                pod.ip(&[family, "route", "show", "table", "133"]).stdout,
            ]
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

#[test]
fn a_rerun_with_another_layout_converges_to_a_fresh_add_of_it() {
    let node = Node::new();
    let tproxy = entry(json!({"redirect": {"interceptionMode": "TPROXY"}}));
    let redirect = entry(json!({"redirect": {"interceptionMode": "REDIRECT"}}));
    let fresh = addressed_pod(&node, &["10.60.0.2/24", "fd60::2/64"]);
    add(&node, &fresh, &redirect).success();
    let rerun = addressed_pod(&node, &["10.60.0.2/24", "fd60::2/64"]);
    add(&node, &rerun, &tproxy).success();
    let routing = policy_routing(&rerun);
    assert!(routing.contains("fwmark 0x539 lookup 133"), "{routing}");
    assert!(routing.contains("local default dev lo"), "{routing}");
    add(&node, &rerun, &redirect).success();
    assert_eq!(policy_routing(&rerun), policy_routing(&fresh));
    for family in [Family::V4, Family::V6] {
        assert_eq!(
            pod_chains(&rerun, family, "nft"),
            pod_chains(&fresh, family, "nft")
        );
    }
    // And back: TPROXY's routing returns, once.
    add(&node, &rerun, &tproxy).success();
    add(&node, &rerun, &tproxy).success();
    assert_eq!(
        policy_routing(&rerun).matches("fwmark 0x539 lookup 133").count(),
        2
    );
}

#[test]
fn check_names_missing_rules() {
    let node = Node::new();
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    let conf = entry(json!({"redirect": {}}));
    add(&node, &pod, &conf).success();
    Exec::new("CHECK", &pod).run(&node, &conf).success();
    run_in(
        pod.path(),
        Path::new("iptables-nft"),
        &["-t", "nat", "-D", "ISTIO_OUTPUT", "-j", "ISTIO_REDIRECT"],
        &[],
        "",
    )
    .success();
    assert_check_names(&node, &pod, &conf, "-A ISTIO_OUTPUT -j ISTIO_REDIRECT");
}

/// CHECK fails with code 100 and names `missing`.
fn assert_check_names(node: &Node, pod: &Netns, conf: &Value, missing: &str) {
    let check = Exec::new("CHECK", pod).run(node, conf).failure();
    assert_eq!(error_code(&check), 100, "{check:?}");
    assert!(
        check.json()["msg"].as_str().unwrap_or_default().contains(missing),
        "{check:?}"
    );
}

#[test]
fn the_legacy_backend_is_used_where_the_pod_already_uses_it() {
    let node = Node::new();
    // Forced; the xtables lock is the pod's, not the node's (which
    // kube-proxy holds for long stretches).
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    let wrappers = Wrappers::new(&["iptables-legacy-restore"], "$XTABLES_LOCKFILE");
    let path = wrappers.path();
    let mut exec = Exec::new("ADD", &pod);
    exec.path = Some(&path);
    exec.run(
        &node,
        &entry(json!({"redirect": {}, "iptables_backend": "legacy"})),
    )
    .success();
    assert_eq!(
        wrappers.seen(),
        [format!("iptables-legacy-restore {}", pod.path_str())]
    );
    assert_holds(&pod, &Redirect::default(), &[Family::V4], "legacy");
    assert!(no_istio_rules(&pod), "nothing through nft");
    // Detected: the pod already has legacy tables.
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    run_in(
        pod.path(),
        Path::new("iptables-legacy"),
        &["-t", "nat", "-L"],
        &[],
        "",
    )
    .success();
    add(&node, &pod, &entry(json!({"redirect": {}}))).success();
    assert_holds(&pod, &Redirect::default(), &[Family::V4], "legacy");
    assert!(no_istio_rules(&pod));
    // native_nftables: Istio's own inet tables, whatever the pod had.
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    run_in(
        pod.path(),
        Path::new("iptables-legacy"),
        &["-t", "nat", "-L"],
        &[],
        "",
    )
    .success();
    add(
        &node,
        &pod,
        &entry(json!({"redirect": {}, "native_nftables": true})),
    )
    .success();
    assert_capture_layout(&pod, true);
    assert!(
        pod_chains(&pod, Family::V4, "legacy")
            .keys()
            .all(|(_, chain)| !chain.starts_with("ISTIO")),
        "nothing through legacy iptables"
    );
}

fn nft_listing(ns: &Netns) -> String {
    run_in(ns.path(), Path::new("nft"), &["-n", "list", "ruleset"], &[], "")
        .success()
        .stdout
}

/// How the kernel lists Istio's own transaction for `redirect`, loaded by
/// nft into an empty namespace.
fn istio_nft_listing(node: &Node, redirect: &Redirect, ipv6: bool) -> String {
    let reference = node.pod("nft-reference");
    let transaction = render_nft(redirect, ipv6).istio_transaction();
    run_in(
        reference.path(),
        Path::new("nft"),
        &["-f", "-"],
        &[],
        &transaction,
    )
    .success();
    nft_listing(&reference)
}

#[test]
fn native_nftables_is_one_transaction_rerun_unchanged_replaced_and_checked() {
    let node = Node::new();
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    let wrappers = Wrappers::new(
        &[
            "nft",
            "iptables-restore",
            "iptables-nft-restore",
            "iptables-legacy-restore",
        ],
        "call",
    );
    let path = wrappers.path();
    let conf = entry(
        json!({"redirect": {"excludeOutboundPorts": "5432"}, "native_nftables": true,
                            "plugin_log_level": "info"}),
    );
    let mut exec = Exec::new("ADD", &pod);
    exec.path = Some(&path);
    exec.run(&node, &conf).success();
    assert_eq!(wrappers.seen(), ["nft call"], "one nft process, no iptables");
    let redirect = Redirect {
        exclude_outbound_ports: vec![5432],
        ..Redirect::default()
    };
    let listing = nft_listing(&pod);
    assert_eq!(listing, istio_nft_listing(&node, &redirect, false));
    assert!(listing.contains("tcp dport 5432 return"), "{listing}");
    assert!(no_istio_rules(&pod), "nothing through iptables-nft");

    let again = add(&node, &pod, &conf).success();
    assert!(again.stderr.contains("already in place"), "{again:?}");
    assert_eq!(nft_listing(&pod), listing, "a re-run changes nothing");

    let tproxy = entry(
        json!({"redirect": {"excludeOutboundPorts": "6379", "interceptionMode": "TPROXY"},
                              "native_nftables": true}),
    );
    let replaced = add(&node, &pod, &tproxy).success();
    assert!(replaced.stderr.contains("replaced"), "{replaced:?}");
    let tproxy_redirect = Redirect {
        mode: Mode::Tproxy,
        exclude_outbound_ports: vec![6379],
        ..Redirect::default()
    };
    assert_eq!(
        nft_listing(&pod),
        istio_nft_listing(&node, &tproxy_redirect, false)
    );
    // Back to REDIRECT: the mangle table TPROXY needed goes.
    add(&node, &pod, &conf).success();
    assert_eq!(nft_listing(&pod), listing);

    Exec::new("CHECK", &pod).run(&node, &conf).success();
    let handles = run_in(
        pod.path(),
        Path::new("nft"),
        &["-a", "list", "chain", "inet", "istio-proxy-nat", "istio-output"],
        &[],
        "",
    )
    .success()
    .stdout;
    let handle = handles
        .lines()
        .find(|l| l.trim().starts_with("jump istio-redirect"))
        .and_then(|l| l.rsplit("handle ").next())
        .unwrap_or_else(|| panic!("no jump to istio-redirect: {handles}"))
        .trim()
        .to_owned();
    run_in(
        pod.path(),
        Path::new("nft"),
        &[
            "delete",
            "rule",
            "inet",
            "istio-proxy-nat",
            "istio-output",
            "handle",
            &handle,
        ],
        &[],
        "",
    )
    .success();
    assert_check_names(
        &node,
        &pod,
        &conf,
        "inet istio-proxy-nat istio-output: jump istio-redirect",
    );
}

/// Wrappers for `tools` first on PATH: each appends "<tool> <what>" (shell
/// words, expanded when it runs) to a record, then runs the real tool.
struct Wrappers {
    dir: TempDir,
}

impl Wrappers {
    fn new(tools: &[&str], what: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let record = dir.path().join("seen");
        for tool in tools {
            let wrapper = dir.path().join(tool);
            let script = format!(
                "#!/bin/sh\necho {tool} {what} >> {}\nexec /usr/sbin/{tool} \"$@\"\n",
                record.display()
            );
            fs::write(&wrapper, script).expect("write wrapper");
            fs::set_permissions(&wrapper, fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        Wrappers { dir }
    }

    fn path(&self) -> String {
        format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", self.dir.path().display())
    }

    fn seen(&self) -> Vec<String> {
        fs::read_to_string(self.dir.path().join("seen"))
            .expect("the wrappers ran")
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

#[test]
fn one_restore_per_family_and_no_nss() {
    // A lookup through NSS inside iptables could load libraries that hang
    // or crash in the pod's namespace; the plugin hides nsswitch.conf from
    // it. Wrappers record every restore and what it saw of that file.
    let node = Node::new();
    let wrappers = Wrappers::new(
        &["iptables-nft-restore", "ip6tables-nft-restore"],
        "$(wc -c < /etc/nsswitch.conf)",
    );
    let path = wrappers.path();
    let pod = addressed_pod(&node, &["10.60.0.2/24", "fd60::2/64"]);
    let mut exec = Exec::new("ADD", &pod);
    exec.path = Some(&path);
    exec.run(
        &node,
        &entry(json!({"redirect": {}, "dual_stack": true, "dns_capture": true})),
    )
    .success();
    assert_eq!(
        wrappers.seen(),
        ["iptables-nft-restore 0", "ip6tables-nft-restore 0"],
        "one restore per family, each with an empty nsswitch.conf"
    );
    let redirect = Redirect {
        dual_stack: true,
        dns_capture: true,
        ..Redirect::default()
    };
    assert_holds(&pod, &redirect, &[Family::V4, Family::V6], "nft");
    assert!(
        fs::metadata("/etc/nsswitch.conf").is_ok_and(|m| m.len() > 0),
        "the machine's own file is untouched"
    );
}

#[test]
fn del_needs_nothing() {
    let node = Node::new();
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    let conf = entry(json!({"redirect": {}}));
    add(&node, &pod, &conf).success();
    let mut bare = json!({"cniVersion": "1.1.0", "name": NETWORK, "type": "istio-redirect"});
    let del = Exec::new("DEL", &pod).run(&node, &bare).success();
    assert_eq!(del.stdout, "");
    let gone = pod.path_str().to_owned();
    pod.delete();
    let mut exec = Exec::new("DEL", &node.netns);
    exec.netns = Some(&gone);
    exec.run(&node, &conf).success();
    exec.netns = None;
    bare["cniVersion"] = json!("0.3.1");
    exec.run(&node, &bare).success();
}

// --- who gets captured ---------------------------------------------------

fn annotated(extra: &[(&str, &str)]) -> Value {
    let mut annotations = json!({STATUS: STATUS_JSON, "sidecar.istio.io/interceptionMode": "REDIRECT"});
    for (k, v) in extra {
        annotations[*k] = json!(v);
    }
    annotations
}

#[test]
fn annotations_from_the_runtime_need_no_api_server() {
    let node = Node::new();
    let kubeconfig = node.path("no-such-kubeconfig");
    let conf = |annotations: Value| {
        entry(
            json!({"kubeconfig": kubeconfig, "capabilities": {"io.kubernetes.cri.pod-annotations": true},
                     "runtimeConfig": {"io.kubernetes.cri.pod-annotations": annotations}}),
        )
    };
    let args = k8s_args("default", "web-0");

    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    let ranges = annotated(&[("traffic.sidecar.istio.io/excludeOutboundIPRanges", "10.96.0.1/32")]);
    Exec::new("ADD", &pod)
        .args(&args)
        .run(&node, &conf(ranges))
        .success();
    let expected = Redirect {
        exclude_cidrs: vec![cidr("10.96.0.1/32")],
        ..Redirect::default()
    };
    assert_holds(&pod, &expected, &[Family::V4], "nft");

    // Not injected, a gateway, opted out: nothing, and still no API call.
    for annotations in [
        json!({}),
        json!({STATUS: STATUS_JSON}),
        annotated(&[("sidecar.istio.io/inject", "false")]),
    ] {
        let pod = addressed_pod(&node, &["10.60.0.2/24"]);
        let conf = conf(annotations);
        let run = Exec::new("ADD", &pod).args(&args).run(&node, &conf).success();
        assert_eq!(run.json(), passed_through(&conf));
        assert!(no_istio_rules(&pod), "{run:?}");
    }

    // An invalid annotation fails the pod, naming it, before any rule.
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    let bad = annotated(&[("traffic.sidecar.istio.io/excludeInboundPorts", "80,x")]);
    let run = Exec::new("ADD", &pod)
        .args(&args)
        .run(&node, &conf(bad))
        .failure();
    assert_eq!(error_code(&run), 7, "{run:?}");
    assert!(
        run.stdout
            .contains("traffic.sidecar.istio.io/excludeInboundPorts"),
        "{run:?}"
    );
    assert!(no_istio_rules(&pod));
}

fn api_pod(name: &str, proxy: Value, annotations: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "default", "annotations": annotations},
           "spec": {"initContainers": [{"name": "istio-validation"}],
                    "containers": [{"name": "app"}, proxy]}})
}

#[test]
fn pods_are_read_from_the_api_server() {
    let node = Node::new();
    node.netns.ip(&["link", "set", "lo", "up"]).success();
    let server = ApiServer::start(node.netns.path(), "s3cret");
    let kubeconfig_in = |dir: &str, host: &str, token: &str| {
        let dir = node.path(dir);
        fs::create_dir_all(&dir).expect("mkdir");
        server.kubeconfig(&dir, host, token)
    };
    let kubeconfig = kubeconfig_in("kc", "localhost", "s3cret");
    let conf = |extra: Value| {
        let mut c = entry(
            json!({"kubeconfig": kubeconfig, "exclude_namespaces": ["kube-system"],
                                 "pod_namespace": "istio-system", "api_attempts": 2, "api_retry_delay_ms": 10}),
        );
        if let (Some(d), Value::Object(e)) = (c.as_object_mut(), extra) {
            d.extend(e);
        }
        c
    };
    let sidecar = json!({"name": "istio-proxy", "args": ["proxy", "sidecar"],
        "env": [{"name": "ISTIO_META_DNS_CAPTURE", "value": "true"}],
        "securityContext": {"runAsUser": 1000670000, "runAsGroup": 1000670001}});
    server.add_pod(
        "default",
        "web-0",
        api_pod("web-0", sidecar, json!({STATUS: STATUS_JSON})),
    );
    server.add_pod(
        "default",
        "gateway-0",
        api_pod(
            "gateway-0",
            json!({"name": "istio-proxy", "args": ["proxy", "router"]}),
            json!({STATUS: STATUS_JSON}),
        ),
    );

    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    Exec::new("ADD", &pod)
        .args(&k8s_args("default", "web-0"))
        .run(&node, &conf(json!({})))
        .success();
    let expected = Redirect {
        proxy_uid: 1000670000,
        proxy_gid: 1000670001,
        dns_capture: true,
        ..Redirect::default()
    };
    assert_holds(&pod, &expected, &[Family::V4], "nft");
    assert_eq!(server.requests(), 1);

    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    Exec::new("ADD", &pod)
        .args(&k8s_args("default", "gateway-0"))
        .run(&node, &conf(json!({})))
        .success();
    assert!(no_istio_rules(&pod), "a gateway is not captured");
    assert_eq!(server.requests(), 2);

    // Excluded namespaces and Istio's own node pods are decided before any
    // request; so are pods without Kubernetes arguments.
    for args in [
        k8s_args("kube-system", "coredns-1"),
        k8s_args("istio-system", "istio-cni-node-x7k2p"),
        String::new(),
    ] {
        let pod = addressed_pod(&node, &["10.60.0.2/24"]);
        Exec::new("ADD", &pod)
            .args(&args)
            .run(&node, &conf(json!({})))
            .success();
        assert!(no_istio_rules(&pod));
    }
    assert_eq!(server.requests(), 2);

    // A pod that cannot be read fails ADD (code 11), after the configured
    // attempts: it must never start uncaptured.
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    let missing = Exec::new("ADD", &pod)
        .args(&k8s_args("default", "nope"))
        .run(&node, &conf(json!({})))
        .failure();
    assert_eq!(error_code(&missing), 11, "{missing:?}");
    assert!(missing.stdout.contains("not found"), "{missing:?}");
    assert_eq!(server.requests(), 4, "two attempts");

    let wrong_token = kubeconfig_in("kc-denied", "127.0.0.1", "tok-wrong-7f3a");
    let denied = Exec::new("ADD", &pod)
        .args(&k8s_args("default", "web-0"))
        .run(&node, &conf(json!({"kubeconfig": wrong_token})))
        .failure();
    assert_eq!(error_code(&denied), 11, "{denied:?}");
    assert!(denied.stdout.contains("401"), "{denied:?}");
    assert!(
        !format!("{}{}", denied.stdout, denied.stderr).contains("tok-wrong-7f3a"),
        "a token never reaches the logs: {denied:?}"
    );

    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead_port = closed.local_addr().expect("addr").port();
    drop(closed);
    let unreachable = kubeconfig_in("kc-unreachable", "localhost", "s3cret");
    let text = fs::read_to_string(&unreachable)
        .expect("kubeconfig")
        .replace(&format!(":{}\n", server.port), &format!(":{dead_port}\n"));
    fs::write(&unreachable, text).expect("write");
    let refused = Exec::new("ADD", &pod)
        .args(&k8s_args("default", "web-0"))
        .run(&node, &conf(json!({"kubeconfig": unreachable})))
        .failure();
    assert_eq!(error_code(&refused), 11, "{refused:?}");
    assert!(no_istio_rules(&pod));
}

#[test]
fn one_deadline_bounds_the_whole_pod_lookup() {
    let node = Node::new();
    node.netns.ip(&["link", "set", "lo", "up"]).success();
    let server = ApiServer::start(node.netns.path(), "s3cret");
    let ns = netns::NetNs::open(node.netns.path()).expect("node netns");
    // One that accepts and never says a thing, and one that begins a TLS
    // record of 16 KiB and sends it a byte every 200 ms.
    let silent = ns
        .run(|| std::net::TcpListener::bind("127.0.0.1:0"))
        .expect("enter")
        .expect("bind");
    let trickling = ns
        .run(|| std::net::TcpListener::bind("127.0.0.1:0"))
        .expect("enter")
        .expect("bind");
    let ports = [silent.local_addr(), trickling.local_addr()].map(|a| a.expect("addr").port());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in silent.incoming().flatten() {
            held.push(stream);
        }
    });
    std::thread::spawn(move || {
        for mut stream in trickling.incoming().flatten() {
            std::thread::spawn(move || {
                use std::io::Write;
                let _ = stream.write_all(&[0x16, 0x03, 0x03, 0x40, 0x00]);
                while stream.write_all(&[0]).is_ok() {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                }
            });
        }
    });
    let dir = node.path("kc");
    fs::create_dir_all(&dir).expect("mkdir");
    let kubeconfig = server.kubeconfig(&dir, "127.0.0.1", "s3cret");
    for port in ports {
        let pointed = node.path(&format!("kc-{port}"));
        let text = fs::read_to_string(&kubeconfig)
            .expect("kubeconfig")
            .replace(&format!(":{}\n", server.port), &format!(":{port}\n"));
        fs::write(&pointed, text).expect("write");
        let conf = entry(
            json!({"kubeconfig": pointed, "api_attempts": 30, "api_retry_delay_ms": 1000,
                                "api_deadline_ms": 1500}),
        );
        let pod = addressed_pod(&node, &["10.60.0.2/24"]);
        let started = std::time::Instant::now();
        let failed = Exec::new("ADD", &pod)
            .args(&k8s_args("default", "web-0"))
            .run(&node, &conf)
            .failure();
        let took = started.elapsed();
        assert_eq!(error_code(&failed), 11, "{failed:?}");
        assert!(
            failed
                .stdout
                .contains("did not answer within 1.5 s (api_deadline_ms)"),
            "{failed:?}"
        );
        assert!(took < std::time::Duration::from_secs(4), "{took:?}");
        assert!(no_istio_rules(&pod), "it still fails closed");
    }
}

// --- traffic -------------------------------------------------------------

/// bridge + host-local, dual stack, with istio-redirect appended when
/// `istio` is given.
fn mesh_conf(node: &Node, version: &str, istio: Option<Value>) -> Value {
    let mut plugins = vec![json!({"type": "bridge", "bridge": "cnimesh0", "isGateway": true,
        "ipam": {"type": "host-local", "socket": "",
                 "dataDir": node.path("ipam").to_str().expect("UTF-8"),
                 "ranges": [[{"subnet": "10.50.0.0/24"}], [{"subnet": "fd50::/64"}]],
                 "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}})];
    if let Some(mut istio) = istio {
        istio["type"] = json!("istio-redirect");
        plugins.push(istio);
    }
    let list = json!({"cniVersion": version, "name": NETWORK, "plugins": plugins});
    node.write_conf("10-mesh.conflist", &list);
    list
}

/// Adds `pod` the way a runtime does: lo first (containerd's loopback
/// network), then the conflist.
fn cnictl_add(node: &Node, pod: &Netns) -> Value {
    pod.ip(&["link", "set", "lo", "up"]).success();
    node.cnictl(&["--json", "add", NETWORK, pod.path_str()])
        .success()
        .json()
}

#[test]
fn traffic_lands_where_istio_sends_it() {
    traffic_lands_where_istio_sends_it_with(false);
}

#[test]
fn traffic_lands_where_istio_sends_it_with_native_nftables() {
    traffic_lands_where_istio_sends_it_with(true);
}

/// With `native_nftables` the capture lives in Istio's own inet tables and
/// nothing goes through iptables.
fn assert_capture_layout(app: &Netns, native_nftables: bool) {
    let tables = run_in(app.path(), Path::new("nft"), &["list", "tables"], &[], "").success();
    assert_eq!(
        tables.stdout.contains("table inet istio-proxy-nat"),
        native_nftables,
        "{tables:?}"
    );
    assert_eq!(no_istio_rules(app), native_nftables);
}

fn traffic_lands_where_istio_sends_it_with(native_nftables: bool) {
    let node = Node::new();
    let probe = Probe::new();
    mesh_conf(&node, "1.1.0", None);
    let other = node.pod("other");
    cnictl_add(&node, &other);
    mesh_conf(
        &node,
        "1.1.0",
        Some(
            json!({"dual_stack": true, "dns_capture": true, "native_nftables": native_nftables,
                    "redirect": {"excludeOutboundIPRanges": "10.50.0.1/32", "excludeOutboundPorts": "9000",
                                 "excludeInboundPorts": "9100"}}),
        ),
    );
    let app = node.pod("app");
    let result = cnictl_add(&node, &app);
    assert_capture_layout(&app, native_nftables);
    let addresses: Vec<&str> = result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str())
        .collect();
    assert_eq!(addresses, ["10.50.0.3/24", "fd50::3/64"], "{result}");

    let app_rx = probe.listen(&app, &[15001, 15006, 8080, 9100, 15008, 15020, 15021, 15090]);
    let other_rx = probe.listen(&other, &[8080, 9000]);
    let node_rx = probe.listen(&node.netns, &[8080]);
    let connect = |ns: &Netns, uid: Option<u32>, host: &str, port: u16| {
        probe.connect(ns, uid, host, port, None).success();
    };

    // Outbound from the app lands on Envoy's 15001, original destination kept.
    connect(&app, None, "10.50.0.2", 8080);
    app_rx.wait_for("tcp 15001 10.50.0.2:8080");
    connect(&app, None, "fd50::2", 8080);
    app_rx.wait_for("tcp 15001 [fd50::2]:8080");
    // The proxy's own traffic goes out untouched.
    connect(&app, Some(1337), "10.50.0.2", 8080);
    other_rx.wait_for("tcp 8080 10.50.0.2:8080");
    // Excluded CIDR and port, and localhost, bypass Envoy.
    connect(&app, None, "10.50.0.1", 8080);
    node_rx.wait_for("tcp 8080 10.50.0.1:8080");
    connect(&app, None, "10.50.0.2", 9000);
    other_rx.wait_for("tcp 9000 10.50.0.2:9000");
    connect(&app, None, "127.0.0.1", 8080);
    app_rx.wait_for("tcp 8080 127.0.0.1:8080");
    // DNS goes to the agent's 15053.
    probe.udp(&app, "10.50.0.2", 53).success();
    app_rx.wait_for("udp 15053");
    // Inbound lands on 15006, except the status port.
    connect(&other, None, "10.50.0.3", 8080);
    app_rx.wait_for("tcp 15006 10.50.0.3:8080");
    connect(&other, None, "fd50::3", 8080);
    app_rx.wait_for("tcp 15006 [fd50::3]:8080");
    for port in [9100, 15008, 15020, 15021, 15090] {
        connect(&other, None, "10.50.0.3", port);
        app_rx.wait_for(&format!("tcp {port} 10.50.0.3:{port}"));
    }
    // Istio's istio-validation probe: as uid 1337 from 127.0.0.1 (::1) to
    // 127.0.0.6:15002 ([::6]:15002), landing on 15006 with 15002 intact.
    probe
        .connect(&app, Some(1337), "127.0.0.6", 15002, Some("127.0.0.1"))
        .success();
    app_rx.wait_for("tcp 15006 127.0.0.6:15002");
    probe
        .connect(&app, Some(1337), "::6", 15002, Some("::1"))
        .success();
    app_rx.wait_for("tcp 15006 [::6]:15002");
    // The proxy calling its own pod address goes through inbound...
    connect(&app, Some(1337), "10.50.0.3", 15002);
    app_rx.wait_for("tcp 15006 10.50.0.3:15002");
    connect(&app, Some(1337), "fd50::3", 15002);
    app_rx.wait_for("tcp 15006 [fd50::3]:15002");
    // ...unless it forwards inbound traffic from 127.0.0.6 / ::6.
    probe
        .connect(&app, Some(1337), "10.50.0.3", 8080, Some("127.0.0.6"))
        .success();
    app_rx.wait_for("tcp 8080 10.50.0.3:8080");
    probe
        .connect(&app, Some(1337), "fd50::3", 8080, Some("::6"))
        .success();
    app_rx.wait_for("tcp 8080 [fd50::3]:8080");

    assert_eq!(
        app_rx.all(),
        sorted(&[
            "tcp 15001 10.50.0.2:8080",
            "tcp 15001 [fd50::2]:8080",
            "tcp 8080 127.0.0.1:8080",
            "udp 15053",
            "tcp 15006 10.50.0.3:8080",
            "tcp 15006 [fd50::3]:8080",
            "tcp 9100 10.50.0.3:9100",
            "tcp 15008 10.50.0.3:15008",
            "tcp 15020 10.50.0.3:15020",
            "tcp 15021 10.50.0.3:15021",
            "tcp 15090 10.50.0.3:15090",
            "tcp 15006 127.0.0.6:15002",
            "tcp 15006 [::6]:15002",
            "tcp 15006 10.50.0.3:15002",
            "tcp 15006 [fd50::3]:15002",
            "tcp 8080 10.50.0.3:8080",
            "tcp 8080 [fd50::3]:8080",
        ])
    );
    assert_eq!(
        other_rx.all(),
        sorted(&["tcp 8080 10.50.0.2:8080", "tcp 9000 10.50.0.2:9000"])
    );
    assert_eq!(node_rx.all(), ["tcp 8080 10.50.0.1:8080"]);
}

#[test]
fn tproxy_delivers_inbound_with_the_original_destination() {
    tproxy_delivers_inbound_with_the_original_destination_with(false);
}

#[test]
fn tproxy_delivers_inbound_with_the_original_destination_with_native_nftables() {
    tproxy_delivers_inbound_with_the_original_destination_with(true);
}

fn tproxy_delivers_inbound_with_the_original_destination_with(native_nftables: bool) {
    let node = Node::new();
    let probe = Probe::new();
    mesh_conf(&node, "1.1.0", None);
    let other = node.pod("other");
    cnictl_add(&node, &other);
    mesh_conf(
        &node,
        "1.1.0",
        Some(json!({"dual_stack": true, "native_nftables": native_nftables,
                    "redirect": {"interceptionMode": "TPROXY"}})),
    );
    let app = node.pod("app");
    cnictl_add(&node, &app);
    assert_capture_layout(&app, native_nftables);
    let app_rx = probe.listen(&app, &[15001, 15006, 8080]);
    let _other_rx = probe.listen(&other, &[8080]);

    probe.connect(&other, None, "10.50.0.3", 8080, None).success();
    app_rx.wait_for("tcp 15006 10.50.0.3:8080");
    probe.connect(&other, None, "fd50::3", 8080, None).success();
    app_rx.wait_for("tcp 15006 [fd50::3]:8080");
    probe.connect(&app, None, "10.50.0.2", 8080, None).success();
    app_rx.wait_for("tcp 15001 10.50.0.2:8080");
    assert_eq!(
        app_rx.all(),
        sorted(&[
            "tcp 15006 10.50.0.3:8080",
            "tcp 15006 [fd50::3]:8080",
            "tcp 15001 10.50.0.2:8080"
        ])
    );
}

// --- chaining ------------------------------------------------------------

#[test]
fn chained_after_bridge_in_every_version() {
    for version in ["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        // The same pod on a node without istio-redirect, for comparison.
        let plain = Node::new();
        let bridge_only = mesh_conf(&plain, version, None);
        let alone = cnictl_add(&plain, &plain.pod("reference"));

        let node = Node::new();
        mesh_conf(&node, version, Some(json!({"redirect": {}})));
        let pod = node.pod("pod");
        let chained = cnictl_add(&node, &pod);
        assert_eq!(chained["cniVersion"], version);
        assert_eq!(
            strip_macs(&chained),
            strip_macs(&alone),
            "{version}: the result passes through unchanged ({bridge_only})"
        );
        assert!(
            !pod_chains(&pod, Family::V4, "nft").is_empty(),
            "{version}: captured"
        );
        if !matches!(version, "0.1.0" | "0.2.0" | "0.3.0" | "0.3.1") {
            node.cnictl(&["check", NETWORK, pod.path_str()]).success();
        }
        node.cnictl(&["del", NETWORK, pod.path_str()]).success();
    }
}

/// A result without what differs between two attachments of one network
/// (veth names and MACs).
fn strip_macs(result: &Value) -> Value {
    let mut result = result.clone();
    if let Some(interfaces) = result["interfaces"].as_array_mut() {
        for interface in interfaces {
            if let Some(i) = interface.as_object_mut() {
                i.remove("mac");
                i.remove("sandbox");
                if i["name"].as_str().is_some_and(|n| n.starts_with("veth")) {
                    i.remove("name");
                }
            }
        }
    }
    result
}

#[test]
fn chained_with_the_reference_plugins_before_and_after() {
    let node = Node::new();
    let bins = bin_dir();
    // Debian's bridge, host-local, tuning and portmap; ours is found last.
    let cni_path = format!("/usr/lib/cni:{}", bins.display());
    let reference_bridge = json!({"type": "bridge", "bridge": "cniref0", "isGateway": true,
        "ipam": {"type": "host-local", "dataDir": node.path("ref-ipam").to_str().expect("UTF-8"),
                 "ranges": [[{"subnet": "10.51.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}});
    let tuning = json!({"type": "tuning", "sysctl": {"net.ipv4.conf.eth0.rp_filter": "2"}});
    let portmap = json!({"type": "portmap", "capabilities": {"portMappings": true}});
    let istio = json!({"type": "istio-redirect", "redirect": {}});
    let mappings = r#"{"portMappings":[{"hostPort":18080,"containerPort":8080,"protocol":"tcp"}]}"#;
    for (i, order) in [
        vec![&reference_bridge, &tuning, &portmap, &istio],
        vec![&reference_bridge, &istio, &tuning, &portmap],
    ]
    .into_iter()
    .enumerate()
    {
        let list = json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": order});
        node.write_conf("10-mesh.conflist", &list);
        let pod = node.pod(&format!("pod{i}"));
        pod.ip(&["link", "set", "lo", "up"]).success();
        let env = [("CNI_PATH", cni_path.as_str()), ("CAP_ARGS", mappings)];
        let added = node
            .cnictl_env(&["--json", "add", NETWORK, pod.path_str()], &env)
            .success()
            .json();
        assert_eq!(
            added["ips"][0]["address"],
            format!("10.51.0.{}/24", i + 2),
            "{added}"
        );
        assert_eq!(added["interfaces"].as_array().map(Vec::len), Some(3), "{added}");
        assert_holds(&pod, &Redirect::default(), &[Family::V4], "nft");
        let nat = node.run("iptables-save", &["-t", "nat"]).success().stdout;
        assert!(nat.contains("--dport 18080"), "portmap ran after us: {nat}");
        // No CHECK here: Debian's portmap fails it on IPv4-only pods
        // (containernetworking/plugins#819), whoever else is in the chain.
        node.cnictl_env(&["del", NETWORK, pod.path_str()], &env).success();
        let nat = node.run("iptables-save", &["-t", "nat"]).success().stdout;
        assert!(!nat.contains("--dport 18080"), "{nat}");
    }
}

#[test]
fn every_verb_in_every_version_without_a_previous_result() {
    let node = Node::new();
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    for version in ["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let conf = json!({"cniVersion": version, "name": NETWORK, "type": "istio-redirect"});
        let added = add(&node, &pod, &conf).success().json();
        let empty = added
            .as_object()
            .map(|o| o.keys().filter(|k| *k != "cniVersion" && *k != "dns").count());
        assert_eq!(added["cniVersion"], version, "{added}");
        assert_eq!(empty, Some(0), "an empty result: {added}");
        Exec::new("DEL", &pod).run(&node, &conf).success();
    }
    let conf = json!({"cniVersion": "1.1.0", "name": NETWORK, "type": "istio-redirect", "redirect": {}});
    add(&node, &pod, &conf).success();
    Exec::new("CHECK", &pod).run(&node, &conf).success();
    for verb in ["GC", "STATUS"] {
        let mut exec = Exec::new(verb, &pod);
        exec.netns = None;
        let mut conf = conf.clone();
        conf["cni.dev/valid-attachments"] = json!([]);
        let run = exec.run(&node, &conf).success();
        assert_eq!(run.stdout, "", "{verb}");
    }
    assert_holds(&pod, &Redirect::default(), &[Family::V4], "nft");

    let bad = json!({"cniVersion": "1.1.0", "name": NETWORK, "type": "istio-redirect", "proxy_uid": "x"});
    let run = add(&node, &pod, &bad).failure();
    assert_eq!(error_code(&run), 7, "{run:?}");
    assert!(
        run.json()["msg"]
            .as_str()
            .is_some_and(|m| m.starts_with("invalid proxy_uid")),
        "{run:?}"
    );
}
