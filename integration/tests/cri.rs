//! containerd's CRI plugin driven over CRI v1 gRPC the way kubelet drives
//! it: pod sandboxes get their network from our conflist (bridge +
//! host-local + istio-redirect), with the pod's annotations reaching
//! istio-redirect through the runtime and no API server anywhere.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use integration::containerd::{Containerd, Cri};
use integration::{Node, bin_dir, run_in};
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    PodSandboxConfig, PodSandboxMetadata, PodSandboxStatusRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StopPodSandboxRequest,
};
use serde_json::{Value, json};
use tonic::transport::{Channel, Endpoint, Uri};

const NETWORK: &str = "k8s-pod-network";
const PAUSE: &str = "localhost/pause:cni";
const STATUS: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":["istio-envoy"],"revision":"default"}"#;

/// kubelet's side of the conversation, blocking.
struct Kubelet {
    runtime: tokio::runtime::Runtime,
    client: RuntimeServiceClient<Channel>,
}

impl Kubelet {
    fn connect(socket: PathBuf) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let channel = runtime
            .block_on(
                Endpoint::try_from("http://[::]:50051")
                    .expect("endpoint")
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let socket = socket.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(
                                tokio::net::UnixStream::connect(socket).await?,
                            ))
                        }
                    })),
            )
            .expect("connect to containerd's CRI");
        Kubelet {
            runtime,
            client: RuntimeServiceClient::new(channel),
        }
    }

    fn run_pod(
        &mut self,
        namespace: &str,
        name: &str,
        annotations: &[(&str, &str)],
    ) -> Result<String, Box<tonic::Status>> {
        let config = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{namespace}-{name}"),
                namespace: namespace.into(),
                attempt: 0,
            }),
            hostname: name.into(),
            annotations: annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            labels: HashMap::from([("app".to_owned(), name.to_owned())]),
            ..PodSandboxConfig::default()
        };
        let request = RunPodSandboxRequest {
            config: Some(config),
            runtime_handler: String::new(),
        };
        let client = &mut self.client;
        self.runtime
            .block_on(client.run_pod_sandbox(request))
            .map(|r| r.into_inner().pod_sandbox_id)
            .map_err(Box::new)
    }

    /// The pod's IP as CRI reports it, and its sandbox process.
    fn status(&mut self, id: &str) -> (String, u32) {
        let request = PodSandboxStatusRequest {
            pod_sandbox_id: id.into(),
            verbose: true,
        };
        let client = &mut self.client;
        let status = self
            .runtime
            .block_on(client.pod_sandbox_status(request))
            .expect("PodSandboxStatus")
            .into_inner();
        let ip = status
            .status
            .and_then(|s| s.network)
            .map(|n| n.ip)
            .unwrap_or_default();
        let info: Value =
            serde_json::from_str(status.info.get("info").map_or("{}", String::as_str)).expect("info JSON");
        let pid = info["pid"]
            .as_u64()
            .and_then(|p| u32::try_from(p).ok())
            .expect("sandbox pid");
        (ip, pid)
    }

    fn stop_and_remove(&mut self, id: &str) {
        let client = &mut self.client;
        self.runtime
            .block_on(client.stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: id.into(),
            }))
            .expect("StopPodSandbox");
        self.runtime
            .block_on(client.remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: id.into(),
            }))
            .expect("RemovePodSandbox");
    }
}

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
    let cri = Cri {
        conf_dir: node.conf_dir(),
        bin_dir: bin_dir(),
        sandbox_image: PAUSE.into(),
    };
    let containerd = Containerd::start(&node, Some(&cri));
    containerd.import_busybox(&node, "k8s.io", PAUSE, &["/bin/sleep", "2147483647"]);
    let mut kubelet = Kubelet::connect(containerd.address());
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
