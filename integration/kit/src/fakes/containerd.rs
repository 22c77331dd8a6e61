//! Debian's containerd for tests: a daemon of the test's own (private root,
//! state, socket and configuration) started in the node namespace, images
//! built locally from busybox-static, and `ctr` run the way a user runs it.
//! Everything it creates on the machine is removed when it is dropped.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use std::collections::HashMap;

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    PodSandboxConfig, PodSandboxMetadata, PodSandboxStatusRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StopPodSandboxRequest,
};
use serde_json::Value;
use tempfile::TempDir;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::{Node, Run, bin_dir, command_with_binds, run, run_in, run_with_binds, wait_for};

/// The sandbox image the tests build from busybox-static and import.
pub const PAUSE: &str = "localhost/pause:cni";

/// containerd's own state outside `--root`/`--state` (shim sockets, runc's
/// root) lands under /run/containerd; one daemon at a time keeps the
/// cleanup of that directory safe.
static EXCLUSIVE: Mutex<()> = Mutex::new(());

/// Where go-cni inside `ctr` looks, fixed: conflists and plugins.
const CNI_CONF_DIR: &str = "/etc/cni/net.d";
const CNI_BIN_DIR: &str = "/opt/cni/bin";
const RUN_DIR: &str = "/run/containerd";

/// The CRI plugin's settings (kubelet's runtime).
#[derive(Debug, Clone)]
pub struct Cri {
    pub conf_dir: PathBuf,
    pub bin_dir: PathBuf,
    pub sandbox_image: String,
}

#[derive(Debug)]
pub struct Containerd {
    dir: TempDir,
    daemon: Option<Child>,
    /// Directories this harness created on the machine, removed on drop.
    created: Vec<PathBuf>,
    _exclusive: MutexGuard<'static, ()>,
}

/// Creates `path` (and missing parents); returns the topmost directory it
/// had to create, if any.
fn create_dir_noting(path: &Path) -> Option<PathBuf> {
    let mut top = None;
    for ancestor in path.ancestors() {
        if ancestor.exists() {
            break;
        }
        top = Some(ancestor.to_path_buf());
    }
    fs::create_dir_all(path).expect("mkdir");
    top
}

impl Containerd {
    /// Starts the daemon inside `node`'s namespace and waits until it answers.
    pub fn start(node: &Node, cri: Option<&Cri>) -> Self {
        let exclusive = EXCLUSIVE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let dir = tempfile::Builder::new()
            .prefix("cnit-containerd-")
            .tempdir()
            .expect("tempdir");
        let mut created = Vec::new();
        if !Path::new(RUN_DIR).exists() {
            created.push(PathBuf::from(RUN_DIR));
        }
        let root = dir.path();
        // Top-level keys first: TOML puts a key after a table inside it.
        let disabled = if cri.is_some() {
            ""
        } else {
            "disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n"
        };
        let mut config = format!(
            "version = 2\nroot = \"{r}/root\"\nstate = \"{r}/state\"\n{disabled}\
             [grpc]\n  address = \"{r}/containerd.sock\"\n\
             [ttrpc]\n  address = \"{r}/containerd.sock.ttrpc\"\n\
             [plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{r}/opt\"\n",
            r = root.display()
        );
        if let Some(cri) = cri {
            // restrict_oom_score_adj: this VM has no CAP_SYS_RESOURCE, and
            // runc fails to lower a sandbox's oom_score_adj without it.
            // netns_mounts_under_state_dir: the sandboxes' namespaces are
            // pinned under this daemon's state, so a test that dies with a
            // sandbox up leaves nothing in the machine's /run/netns.
            config.push_str(&format!(
                "[plugins.\"io.containerd.grpc.v1.cri\"]\n  restrict_oom_score_adj = true\n  netns_mounts_under_state_dir = true\n  sandbox_image = \"{}\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"{}\"\n  conf_dir = \"{}\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"overlayfs\"\n  default_runtime_name = \"runc\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n  SystemdCgroup = false\n",
                cri.sandbox_image,
                cri.bin_dir.display(),
                cri.conf_dir.display()
            ));
        }
        let config_path = root.join("config.toml");
        fs::write(&config_path, config).expect("write config");
        let log = fs::File::create(root.join("containerd.log")).expect("log file");
        // In the node namespace, and with the node's /var/lib: CRI's go-cni
        // caches results in /var/lib/cni, which must not be the machine's.
        let var_lib = node.var_lib();
        let config_arg = config_path.display().to_string();
        let daemon = command_with_binds(
            &[(&var_lib, Path::new("/var/lib"))],
            node.netns.path(),
            Path::new("containerd"),
            &["--config", &config_arg],
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start containerd: {e}"));
        let containerd = Containerd {
            dir,
            daemon: Some(daemon),
            created,
            _exclusive: exclusive,
        };
        let socket = containerd.address();
        wait_for("containerd to listen", Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&socket).is_ok()
        });
        containerd
    }

    pub fn address(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    fn ctr_args<'a>(&'a self, address: &'a str, namespace: &'a str, args: &[&'a str]) -> Vec<&'a str> {
        let mut full = vec!["--address", address, "--namespace", namespace];
        full.extend_from_slice(args);
        full
    }

    /// `ctr` inside the node namespace.
    pub fn ctr(&self, node: &Node, namespace: &str, args: &[&str]) -> Run {
        let address = self.address().display().to_string();
        run_in(
            node.netns.path(),
            Path::new("ctr"),
            &self.ctr_args(&address, namespace, args),
            &[],
            "",
        )
    }

    /// `ctr` as `ctr run --cni` needs it: go-cni inside ctr reads
    /// /etc/cni/net.d, runs plugins from /opt/cni/bin and caches in
    /// /var/lib/cni, all fixed paths; here they are the node's conflists,
    /// the suite's binaries and the node's cache, in ctr's own private
    /// mount namespace.
    pub fn ctr_cni(&mut self, node: &Node, namespace: &str, args: &[&str]) -> Run {
        for mountpoint in [CNI_CONF_DIR, CNI_BIN_DIR] {
            if let Some(top) = create_dir_noting(Path::new(mountpoint)) {
                self.created.push(top);
            }
        }
        let address = self.address().display().to_string();
        let (conf, bins, var_lib) = (node.conf_dir(), bin_dir(), node.var_lib());
        run_with_binds(
            &[
                (&conf, Path::new(CNI_CONF_DIR)),
                (&bins, Path::new(CNI_BIN_DIR)),
                (&var_lib, Path::new("/var/lib")),
            ],
            node.netns.path(),
            Path::new("ctr"),
            &self.ctr_args(&address, namespace, args),
            &[],
        )
    }

    /// Builds a busybox image (see `integration/tools/busybox_oci.py`) whose command is
    /// `cmd` and imports it into `namespace`.
    pub fn import_busybox(&self, node: &Node, namespace: &str, name: &str, cmd: &[&str]) {
        let tar = self
            .dir
            .path()
            .join(format!("{}.tar", name.replace(['/', ':'], "_")));
        let tool = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/busybox_oci.py");
        let mut args = vec![tar.to_str().expect("UTF-8"), name];
        args.extend_from_slice(cmd);
        run(&tool, &args).success();
        self.ctr(
            node,
            namespace,
            &["images", "import", tar.to_str().expect("UTF-8")],
        )
        .success();
    }

    /// Kills the shims that still serve containers of this daemon (a test
    /// that failed half-way) and waits, bounded, until they are gone, so
    /// nothing recreates their state after it is removed.
    fn kill_shims(&self) {
        let address = self.address().display().to_string();
        let shims = || -> Vec<PathBuf> {
            let Ok(entries) = fs::read_dir("/proc") else {
                return Vec::new();
            };
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|proc_dir| {
                    let cmdline = fs::read(proc_dir.join("cmdline")).unwrap_or_default();
                    let cmdline = String::from_utf8_lossy(&cmdline);
                    cmdline.contains("containerd-shim") && cmdline.contains(&address)
                })
                .collect()
        };
        for proc_dir in shims() {
            if let Some(pid) = proc_dir.file_name().and_then(|p| p.to_str()) {
                run("kill", &["-KILL", pid]);
            }
        }
        let started = std::time::Instant::now();
        while !shims().is_empty() && started.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.kill_shims();
        if let Some(mut daemon) = self.daemon.take() {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
        for dir in self.created.iter().rev() {
            let _ = fs::remove_dir_all(dir);
        }
        // The daemon's own mounts (overlay snapshots, shm) under its root.
        let root = self.dir.path().display().to_string();
        let mounts = fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mut ours: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter(|m| m.starts_with(&root))
            .collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for mountpoint in ours {
            run("umount", &["-l", mountpoint]);
        }
    }
}

/// kubelet's side of the conversation over CRI v1 gRPC, blocking.
#[derive(Debug)]
pub struct Kubelet {
    runtime: tokio::runtime::Runtime,
    client: RuntimeServiceClient<Channel>,
}

impl Kubelet {
    pub fn connect(socket: PathBuf) -> Self {
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

    pub fn run_pod(
        &mut self,
        namespace: &str,
        name: &str,
        annotations: &[(&str, &str)],
    ) -> Result<String, Box<tonic::Status>> {
        self.run_sandbox(namespace, name, annotations, &[], false)
    }

    /// A pod whose containers declare `hostPort`s, as kubelet sends them:
    /// the sandbox config's `port_mappings`.
    pub fn run_pod_with_ports(
        &mut self,
        namespace: &str,
        name: &str,
        ports: &[k8s_cri::v1::PortMapping],
    ) -> Result<String, Box<tonic::Status>> {
        self.run_sandbox(namespace, name, &[], ports, false)
    }

    /// A sandbox in the node's network namespace (`hostNetwork: true`): no
    /// CNI call at all, what a pod costs besides its network.
    pub fn run_host_network_pod(
        &mut self,
        namespace: &str,
        name: &str,
    ) -> Result<String, Box<tonic::Status>> {
        self.run_sandbox(namespace, name, &[], &[], true)
    }

    fn run_sandbox(
        &mut self,
        namespace: &str,
        name: &str,
        annotations: &[(&str, &str)],
        port_mappings: &[k8s_cri::v1::PortMapping],
        host_network: bool,
    ) -> Result<String, Box<tonic::Status>> {
        let network = if host_network {
            k8s_cri::v1::NamespaceMode::Node
        } else {
            k8s_cri::v1::NamespaceMode::Pod
        };
        let config = PodSandboxConfig {
            linux: Some(k8s_cri::v1::LinuxPodSandboxConfig {
                security_context: Some(k8s_cri::v1::LinuxSandboxSecurityContext {
                    namespace_options: Some(k8s_cri::v1::NamespaceOption {
                        network: network as i32,
                        ..k8s_cri::v1::NamespaceOption::default()
                    }),
                    ..k8s_cri::v1::LinuxSandboxSecurityContext::default()
                }),
                ..k8s_cri::v1::LinuxPodSandboxConfig::default()
            }),
            metadata: Some(PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{namespace}-{name}"),
                namespace: namespace.into(),
                attempt: 0,
            }),
            // A host-network pod has the node's hostname, as kubelet leaves it.
            hostname: if host_network { String::new() } else { name.into() },
            annotations: annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            labels: HashMap::from([("app".to_owned(), name.to_owned())]),
            port_mappings: port_mappings.to_vec(),
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
    pub fn status(&mut self, id: &str) -> (String, u32) {
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

    pub fn stop_and_remove(&mut self, id: &str) {
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
