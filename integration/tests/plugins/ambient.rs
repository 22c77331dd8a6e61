//! Istio's ambient mode. The in-pod redirection, programmed as the node
//! agent programs it (`istio_redirect::rules::ambient::program`, called
//! from outside the pod) in pods the bridge made: the kernel's routing read
//! back, and real TCP/UDP showing which of ztunnel's ports each connection
//! lands on, with listeners standing in for ztunnel's. And istio-redirect's
//! ADD in ambient mode: enrolment from the API's labels, and the pod event
//! to a node agent standing in on Istio's wire.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use agent_wire::pod_event::{self, PodEvent};
use firewall::Family;
use istio_redirect::enrolment::DATAPLANE_MODE;
use istio_redirect::rules::Outcome;
use istio_redirect::rules::ambient::{
    INPOD_MARK, InPod, InPodBackend, PROBE_SNAT_V4, PodOverrides, program, unprogram,
};
use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::probe::{Probe, sorted};
use test_kit::{Netns, Node, run_in};

use crate::common::{Exec, addressed_pod, entry, error_code, k8s_args, passed_through};

const NETWORK: &str = "ambient";
const BRIDGE: &str = "cniambient0";

/// The node's network (both families), and `pods` added to it in order:
/// the first gets .2, the next .3.
fn node_with(pods: &[&str]) -> (Node, Vec<Netns>) {
    let node = Node::new();
    node.write_conf(
        "10-ambient.conflist",
        &json!({"cniVersion": "1.0.0", "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": true,
             "ipam": {"type": "host-local", "socket": "",
                      "dataDir": node.path("ipam").to_str().expect("UTF-8"),
                      "ranges": [[{"subnet": "10.60.0.0/24"}], [{"subnet": "fd60::/64"}]],
                      "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}}]}),
    );
    let pods = pods
        .iter()
        .map(|role| {
            let pod = node.pod(role);
            pod.ip(&["link", "set", "lo", "up"]).success();
            node.cnictl(&["--json", "add", NETWORK, pod.path_str()]).success();
            pod
        })
        .collect();
    (node, pods)
}

const IPTABLES: InPodBackend = InPodBackend::Iptables(None);
const NFTABLES: InPodBackend = InPodBackend::Nftables;

fn enrol(pod: &Netns, overrides: &PodOverrides, backend: InPodBackend) -> Vec<(String, Outcome)> {
    let ns = netns::NetNs::open(pod.path()).expect("the pod's namespace");
    program(
        &ns,
        &InPod::new(true, overrides),
        &[Family::V4, Family::V6],
        backend,
    )
    .expect("in-pod rules")
}

/// What each transaction of one enrolment did: one per family with
/// iptables, one with nftables.
fn outcomes(backend: InPodBackend, outcome: Outcome) -> Vec<(String, Outcome)> {
    match backend {
        InPodBackend::Nftables => vec![("nftables".into(), outcome)],
        InPodBackend::Iptables(_) => vec![("V4".into(), outcome), ("V6".into(), outcome)],
    }
}

/// The rules are where the backend writes them, and only there.
fn assert_layout(pod: &Netns, backend: InPodBackend) {
    let rules = istio_rules(pod);
    let in_tables = rules
        .iter()
        .any(|l| l.starts_with("table inet istio-ambient-nat"));
    let in_chains = rules.iter().any(|l| l.contains("ISTIO_OUTPUT"));
    assert_eq!(
        (in_tables, in_chains),
        (backend == NFTABLES, backend != NFTABLES),
        "{rules:?}"
    );
}

#[test]
fn an_enrolled_pods_traffic_lands_on_ztunnels_ports() {
    traffic_lands_on_ztunnels_ports(IPTABLES);
}

#[test]
fn an_enrolled_pods_traffic_lands_on_ztunnels_ports_with_native_nftables() {
    traffic_lands_on_ztunnels_ports(NFTABLES);
}

fn traffic_lands_on_ztunnels_ports(backend: InPodBackend) {
    let probe = Probe::new();
    let (node, pods) = node_with(&["other", "app"]);
    let (other, app) = (&pods[0], &pods[1]);
    assert_eq!(
        enrol(app, &PodOverrides::default(), backend),
        outcomes(backend, Outcome::Applied)
    );
    // Enrolled again (the agent restarted, the same event twice): nothing changes.
    assert_eq!(
        enrol(app, &PodOverrides::default(), backend),
        outcomes(backend, Outcome::Unchanged)
    );
    assert_layout(app, backend);
    for family in ["-4", "-6"] {
        let rules = app.ip(&[family, "rule"]).success().stdout;
        // Once, though programmed twice.
        let inpod = "32764:\tfrom all fwmark 0x111/0xfff lookup 100";
        assert_eq!(rules.matches(inpod).count(), 1, "{rules}");
        let table = app
            .ip(&[family, "route", "show", "table", "100"])
            .success()
            .stdout;
        assert!(table.contains("local default dev lo"), "{table}");
    }

    let app_rx = probe.listen(app, &[15001, 15006, 15008, 15053, 8080, 8081]);
    let other_rx = probe.listen_on(other, &["8080".into(), "udp:53".into()]);
    let connect = |from: &Netns, host: &str, port: u16| {
        probe.connect(from, None, host, port, None).success();
    };
    // Outbound goes to ztunnel's 15001 with its destination kept.
    connect(app, "10.60.0.2", 8080);
    app_rx.wait_for("tcp 15001 10.60.0.2:8080");
    connect(app, "fd60::2", 8080);
    app_rx.wait_for("tcp 15001 [fd60::2]:8080");
    // ztunnel's own (marked) connections go out untouched.
    probe.connect_marked(app, INPOD_MARK, "10.60.0.2", 8080).success();
    other_rx.wait_for("tcp 8080 10.60.0.2:8080");
    // The pod reaching itself, by loopback or by its own address, stays local.
    connect(app, "127.0.0.1", 8080);
    app_rx.wait_for("tcp 8080 127.0.0.1:8080");
    connect(app, "10.60.0.3", 8080);
    app_rx.wait_for("tcp 8080 10.60.0.3:8080");
    // DNS over UDP and TCP goes to ztunnel's DNS proxy.
    probe.udp(app, "10.60.0.2", 53).success();
    app_rx.wait_for("udp 15053");
    connect(app, "10.60.0.2", 53);
    app_rx.wait_for("tcp 15053 10.60.0.2:53");
    // Inbound lands on 15006, except HBONE, which ztunnel serves on 15008.
    connect(other, "10.60.0.3", 8080);
    app_rx.wait_for("tcp 15006 10.60.0.3:8080");
    connect(other, "fd60::3", 8080);
    app_rx.wait_for("tcp 15006 [fd60::3]:8080");
    connect(other, "10.60.0.3", 15008);
    app_rx.wait_for("tcp 15008 10.60.0.3:15008");
    // A kubelet probe, SNATed on the node to Istio's probe address,
    // reaches the app itself (from anywhere else it would land on 15006).
    let probe_source = PROBE_SNAT_V4.to_string();
    node.netns
        .ip(&["addr", "add", &format!("{probe_source}/32"), "dev", BRIDGE])
        .success();
    probe
        .connect(&node.netns, None, "10.60.0.3", 8081, Some(&probe_source))
        .success();
    app_rx.wait_for("tcp 8081 10.60.0.3:8081");

    assert_eq!(
        app_rx.all(),
        sorted(&[
            "tcp 15001 10.60.0.2:8080",
            "tcp 15001 [fd60::2]:8080",
            "tcp 8080 127.0.0.1:8080",
            "tcp 8080 10.60.0.3:8080",
            "udp 15053",
            "tcp 15053 10.60.0.2:53",
            "tcp 15006 10.60.0.3:8080",
            "tcp 15006 [fd60::3]:8080",
            "tcp 15008 10.60.0.3:15008",
            "tcp 8081 10.60.0.3:8081",
        ])
    );
    assert_eq!(other_rx.all(), ["tcp 8080 10.60.0.2:8080"]);
}

#[test]
fn a_pods_overrides_leave_inbound_and_dns_alone() {
    for backend in [IPTABLES, NFTABLES] {
        overrides_leave_inbound_and_dns_alone(backend);
    }
}

fn overrides_leave_inbound_and_dns_alone(backend: InPodBackend) {
    let probe = Probe::new();
    let (_node, pods) = node_with(&["other", "gateway"]);
    let (other, gateway) = (&pods[0], &pods[1]);
    let overrides = PodOverrides {
        bypass_inbound: true,
        dns_capture: Some(false),
        ..PodOverrides::default()
    };
    enrol(gateway, &overrides, backend);
    let gateway_rx = probe.listen(gateway, &[15001, 15006, 8080]);
    let other_rx = probe.listen_on(other, &["udp:53".into()]);
    probe.connect(other, None, "10.60.0.3", 8080, None).success();
    gateway_rx.wait_for("tcp 8080 10.60.0.3:8080");
    probe.udp(gateway, "10.60.0.2", 53).success();
    other_rx.wait_for("udp 53");
    // Outbound is still ztunnel's.
    probe.connect(gateway, None, "10.60.0.2", 8080, None).success();
    gateway_rx.wait_for("tcp 15001 10.60.0.2:8080");
    assert_eq!(
        gateway_rx.all(),
        sorted(&["tcp 8080 10.60.0.3:8080", "tcp 15001 10.60.0.2:8080"])
    );
}

#[test]
fn a_pod_that_leaves_the_mesh_has_its_traffic_back_and_nothing_of_ztunnels_left() {
    for backend in [IPTABLES, NFTABLES] {
        leaves_the_mesh(backend);
    }
}

fn leaves_the_mesh(backend: InPodBackend) {
    let probe = Probe::new();
    let (_node, pods) = node_with(&["other", "app"]);
    let (other, app) = (&pods[0], &pods[1]);
    let before: Vec<String> = ["-4", "-6"]
        .iter()
        .map(|family| app.ip(&[family, "rule"]).success().stdout)
        .collect();
    enrol(app, &PodOverrides::default(), backend);
    let ns = netns::NetNs::open(app.path()).expect("the pod's namespace");
    let families = [Family::V4, Family::V6];
    assert!(unprogram(&ns, &families, None).expect("removed"));
    assert!(
        !unprogram(&ns, &families, None).expect("again"),
        "nothing left the second time"
    );
    assert!(istio_rules(app).is_empty(), "{:?}", istio_rules(app));
    for (family, before) in ["-4", "-6"].iter().zip(&before) {
        assert_eq!(&app.ip(&[family, "rule"]).success().stdout, before);
        let table = app
            .ip(&[family, "route", "show", "table", "100"])
            .success()
            .stdout;
        assert!(table.trim().is_empty(), "{table}");
    }
    let app_rx = probe.listen(app, &[15001, 15006, 8080]);
    let other_rx = probe.listen(other, &[8080]);
    probe.connect(app, None, "10.60.0.2", 8080, None).success();
    other_rx.wait_for("tcp 8080 10.60.0.2:8080");
    probe.connect(other, None, "10.60.0.3", 8080, None).success();
    app_rx.wait_for("tcp 8080 10.60.0.3:8080");
    assert_eq!(app_rx.all(), ["tcp 8080 10.60.0.3:8080"]);
}

// --- the plugin's pod event (ambient mode) ---------------------------------

/// A node agent standing in on `pluginevent.sock`: it reads each request
/// as Istio's agent does (HTTP, Istio's event JSON), keeps the event and
/// answers with the status and body it is set to.
struct StandInAgent {
    socket: PathBuf,
    events: Arc<Mutex<Vec<PodEvent>>>,
    answer: Arc<Mutex<(u16, String)>>,
}

impl StandInAgent {
    fn start(run_dir: &Path) -> Self {
        let socket = run_dir.join(pod_event::SOCKET_NAME);
        let listener = UnixListener::bind(&socket).expect("bind the pod event socket");
        let events = Arc::new(Mutex::new(Vec::new()));
        let answer = Arc::new(Mutex::new((200, String::new())));
        let (kept, answering) = (events.clone(), answer.clone());
        std::thread::spawn(move || {
            for mut stream in listener.incoming().flatten() {
                let Some(body) = request_body(&mut stream) else {
                    continue;
                };
                let event: PodEvent = serde_json::from_slice(&body).expect("Istio's event JSON");
                kept.lock().expect("events").push(event);
                let (status, reason) = answering.lock().expect("answer").clone();
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\r\n{reason}",
                    reason.len()
                );
            }
        });
        StandInAgent {
            socket,
            events,
            answer,
        }
    }

    fn answer(&self, status: u16, reason: &str) {
        *self.answer.lock().expect("answer") = (status, reason.to_owned());
    }

    fn events(&self) -> Vec<PodEvent> {
        self.events.lock().expect("events").clone()
    }
}

impl Drop for StandInAgent {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// An HTTP request's body, by its Content-Length.
fn request_body(stream: &mut UnixStream) -> Option<Vec<u8>> {
    let mut raw = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_lowercase();
            assert!(head.starts_with("post /cmdadd http/1.1\r\n"), "{head}");
            let length: usize = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length:"))
                .and_then(|value| value.trim().parse().ok())
                .expect("a Content-Length");
            if raw.len() >= end + 4 + length {
                return Some(raw[end + 4..end + 4 + length].to_vec());
            }
        }
        let read = stream.read(&mut chunk).ok()?;
        if read == 0 {
            return None;
        }
        raw.extend_from_slice(&chunk[..read]);
    }
}

fn api_pod(namespace: &str, name: &str, labels: Value, annotations: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
           "spec": {"containers": [{"name": "app"}]}})
}

/// Whatever Istio rules the pod's kernel holds, in any backend.
fn istio_rules(pod: &Netns) -> Vec<String> {
    let ruleset = run_in(pod.path(), Path::new("nft"), &["list", "ruleset"], &[], "").success();
    ruleset
        .stdout
        .lines()
        .filter(|line| line.contains("ISTIO") || line.contains("istio"))
        .map(str::to_owned)
        .collect()
}

/// A node with an API server standing in, and istio-redirect's entry in
/// ambient mode pointed at it and at a run directory of its own.
fn ambient_node() -> (Node, ApiServer, Value, PathBuf) {
    let node = Node::new();
    node.netns.ip(&["link", "set", "lo", "up"]).success();
    let server = ApiServer::start(node.netns.path(), "s3cret");
    let kubeconfig_dir = node.path("kc");
    std::fs::create_dir_all(&kubeconfig_dir).expect("mkdir");
    let kubeconfig = server.kubeconfig(&kubeconfig_dir, "127.0.0.1", "s3cret");
    let run_dir = node.path("istio-cni");
    std::fs::create_dir_all(&run_dir).expect("mkdir");
    let conf = entry(json!({"kubeconfig": kubeconfig, "ambient_enabled": true,
        "cni_agent_run_dir": run_dir, "api_attempts": 2, "api_retry_delay_ms": 10}));
    (node, server, conf, run_dir)
}

#[test]
fn an_enrolled_pods_add_waits_for_the_agent_and_fails_closed_without_it() {
    let (node, server, conf, run_dir) = ambient_node();
    let mode = |value: &str| json!({DATAPLANE_MODE: value});
    server.apply_namespace(json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "mesh", "labels": mode("ambient")}}));
    server.apply_namespace(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}));
    server.add_pod(
        "mesh",
        "web-0",
        api_pod("mesh", "web-0", json!({"app": "web"}), json!({})),
    );
    server.add_pod(
        "mesh",
        "opted-out",
        api_pod("mesh", "opted-out", mode("none"), json!({})),
    );
    server.add_pod(
        "default",
        "labelled",
        api_pod("default", "labelled", mode("ambient"), json!({})),
    );
    server.add_pod(
        "default",
        "plain",
        api_pod("default", "plain", json!({}), json!({})),
    );
    let add = |namespace: &str, name: &str| {
        let pod = addressed_pod(&node, &["10.60.0.2/24"]);
        let run = Exec::new("ADD", &pod)
            .args(&k8s_args(namespace, name))
            .run(&node, &conf);
        (pod, run)
    };

    // No agent: the pod does not start, and says why.
    let (pod, failed) = add("mesh", "web-0");
    let failed = failed.failure();
    assert_eq!(error_code(&failed), 11, "{failed:?}");
    let said = failed.json()["msg"].as_str().unwrap_or_default().to_owned();
    assert!(
        said.contains("pod mesh/web-0 is enrolled in ambient mode")
            && said.contains("failed to send event request")
            && said.contains("not started outside the mesh"),
        "{said}"
    );
    assert!(istio_rules(&pod).is_empty(), "the in-pod rules are the agent's");

    // The agent says no (ztunnel is not connected): Istio's words.
    let agent = StandInAgent::start(&run_dir);
    agent.answer(500, "no ztunnel connection\n");
    let (_, refused) = add("mesh", "web-0");
    let said = refused.failure().json()["msg"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        said.contains("unable to push CNI event (status code 500): no ztunnel connection"),
        "{said}"
    );

    // The agent says yes: the ADD returns the chain's result unchanged, and
    // the event named the pod, its namespace and the chain's addresses.
    agent.answer(200, "");
    let (pod, taken) = add("mesh", "web-0");
    let taken = taken.success();
    assert_eq!(taken.json(), passed_through(&conf));
    let events = agent.events();
    let event = events.last().expect("an event");
    assert_eq!(
        (
            event.netns.as_str(),
            event.pod_namespace.as_str(),
            event.pod_name.as_str()
        ),
        (pod.path_str(), "mesh", "web-0")
    );
    assert_eq!(event.ips.len(), 1);
    assert_eq!(event.ips[0].address.to_string(), "10.60.0.2/24");
    assert_eq!(event.ips[0].interface, Some(0));
    assert!(istio_rules(&pod).is_empty());
    let sent = events.len();

    // The pod's own label enrols it in any namespace; `none` opts it out of
    // its namespace's; a pod neither names passes through untouched.
    add("default", "labelled").1.success();
    assert_eq!(agent.events().len(), sent + 1);
    assert_eq!(agent.events()[sent].pod_name, "labelled");
    for (namespace, name) in [("mesh", "opted-out"), ("default", "plain")] {
        let (pod, run) = add(namespace, name);
        assert_eq!(run.success().json(), passed_through(&conf));
        assert!(istio_rules(&pod).is_empty());
    }
    // DEL tells the agent nothing, as Istio's.
    Exec::new("DEL", &pod)
        .args(&k8s_args("mesh", "web-0"))
        .run(&node, &conf)
        .success();
    assert_eq!(agent.events().len(), sent + 1);
}

#[test]
fn a_pod_with_a_sidecar_is_captured_not_enrolled() {
    let (node, server, conf, run_dir) = ambient_node();
    let agent = StandInAgent::start(&run_dir);
    server.apply_namespace(json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "mesh", "labels": {DATAPLANE_MODE: "ambient"}}}));
    let mut sidecar = api_pod(
        "mesh",
        "web-0",
        json!({}),
        json!({"sidecar.istio.io/status": r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#}),
    );
    sidecar["spec"]["containers"] =
        json!([{"name": "app"}, {"name": "istio-proxy", "args": ["proxy", "sidecar"]}]);
    server.add_pod("mesh", "web-0", sidecar);
    let pod = addressed_pod(&node, &["10.60.0.2/24"]);
    Exec::new("ADD", &pod)
        .args(&k8s_args("mesh", "web-0"))
        .run(&node, &conf)
        .success();
    assert!(
        agent.events().is_empty(),
        "ztunnel and a sidecar in one pod: never"
    );
    let rules = istio_rules(&pod);
    assert!(
        rules.iter().any(|line| line.contains("ISTIO_REDIRECT")),
        "the sidecar's capture: {rules:?}"
    );
    // Two GETs (the pod, its namespace), as Istio's plugin makes: the pod
    // read for enrolment is the one the capture uses.
    assert_eq!(server.requests(), 2);
}
