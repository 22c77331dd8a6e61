//! One suite's node and how the phases call its plugins, as libcni
//! executes them; what a phase left behind; the order the suites take
//! turns in.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use netns::NetNs;
use serde_json::{Value, json};
use test_kit::{LeaseService, Netns, Node, bin_dir, services_under};

use crate::measure::{Call, exec, process_cpu};
use crate::outcome::Outcome;
use crate::setup::{REFERENCE_DIR, Setup, Side};

/// One suite's node: its namespace, bridge, subnet, IPAM data and, for
/// the service setup, host-local's lease service.
#[derive(Debug)]
pub struct Suite {
    pub setup: Setup,
    pub(crate) bins: PathBuf,
    pub(crate) node: Node,
    pub(crate) ns: NetNs,
    pub(crate) network: String,
    pub(crate) bridge: String,
    pub(crate) subnet: String,
    service: Option<LeaseService>,
    /// Pod-like veths made so far for floors, for their names.
    floors: AtomicUsize,
}

impl Suite {
    pub(crate) fn new(setup: Setup, network: &str, bridge: &str, subnet: &str) -> Self {
        let node = Node::new();
        let ns = NetNs::open(node.netns.path()).expect("node netns");
        let (bins, service) = match setup {
            Setup::DropIn => (bin_dir(), None),
            Setup::Service => {
                let bins = bin_dir();
                let service =
                    LeaseService::start(&bins.join("host-local"), node.path("host-local.sock"), &[]);
                (bins, Some(service))
            }
            Setup::Reference => (PathBuf::from(REFERENCE_DIR), None),
        };
        Suite {
            setup,
            bins,
            node,
            ns,
            network: network.to_owned(),
            bridge: bridge.to_owned(),
            subnet: subnet.to_owned(),
            service,
            floors: AtomicUsize::new(0),
        }
    }

    pub fn side(&self) -> Side {
        self.setup.side()
    }

    /// `name` as this suite's metric.
    pub(crate) fn metric(&self, name: &str) -> String {
        format!("{}{name}", self.setup.prefix())
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        self.node.path("ipam")
    }

    fn ipam(&self) -> Value {
        let mut ipam = json!({"type": "host-local", "ranges": [[{"subnet": self.subnet}]],
                              "dataDir": self.data_dir().to_str().expect("UTF-8")});
        if let Some(service) = &self.service {
            ipam["socket"] = json!(service.socket.to_str().expect("UTF-8"));
        }
        ipam
    }

    pub(crate) fn bridge_conf(&self, prev: Option<&Value>) -> String {
        let mut conf = json!({"cniVersion": "1.0.0", "name": self.network, "type": "bridge",
            "bridge": self.bridge, "isGateway": true, "ipMasq": true, "ipam": self.ipam()});
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        conf.to_string()
    }

    pub(crate) fn bridge_del(&self, id: &str, netns: &str, prev: &Value) -> Call {
        self.call("bridge", "DEL", id, netns, &self.bridge_conf(Some(prev)))
    }

    pub(crate) fn ipam_conf(&self) -> String {
        json!({"cniVersion": "1.0.0", "name": self.network, "ipam": self.ipam()}).to_string()
    }

    fn env<'a>(&'a self, command: &'a str, id: &'a str, netns: &'a str) -> [(&'a str, &'a str); 5] {
        [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", id),
            ("CNI_NETNS", netns),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", self.bins.to_str().expect("UTF-8")),
        ]
    }

    pub(crate) fn call(&self, plugin: &str, command: &str, id: &str, netns: &str, stdin: &str) -> Call {
        let env = self.env(command, id, netns);
        exec(&self.ns, &self.bins.join(plugin), &[], &env, stdin)
    }

    /// bridge `command` under `profiler args -o <file> --`: the call and
    /// what the profiler wrote.
    pub(crate) fn profiled(
        &self,
        profiler: &Path,
        args: &[&str],
        command: &str,
        netns: &str,
        prev: Option<&Value>,
    ) -> (Call, String) {
        let report = tempfile::NamedTempFile::new().expect("temporary file");
        let plugin = self.bins.join("bridge");
        let mut full = args.to_vec();
        full.extend([
            "-o",
            report.path().to_str().expect("UTF-8"),
            "--",
            plugin.to_str().expect("UTF-8"),
        ]);
        let env = self.env(command, "profiled", netns);
        let call = exec(&self.ns, profiler, &full, &env, &self.bridge_conf(prev));
        let text = std::fs::read_to_string(report.path()).unwrap_or_default();
        (call, text)
    }

    /// The lease service's process: the one started for the service
    /// setup, the one host-local started for the drop-in setup.
    pub(crate) fn service_pid(&self) -> Option<u32> {
        match self.setup {
            Setup::Service => self.service.as_ref().and_then(LeaseService::pid),
            Setup::DropIn => services_under(&self.data_dir()).first().copied(),
            Setup::Reference => None,
        }
    }

    pub(crate) fn service_cpu(&self) -> Duration {
        self.service_pid().map_or(Duration::ZERO, process_cpu)
    }

    /// `run`, with the lease service's CPU while it ran added to the
    /// call's own: for a phase whose calls of several kinds follow each
    /// other, where a share per phase would not say whose it was.
    pub(crate) fn with_service_cpu(&self, run: impl FnOnce() -> Call) -> Call {
        let before = self.service_cpu();
        let mut call = run();
        call.cpu += self.service_cpu().saturating_sub(before);
        call
    }

    /// `run`, and whether it started the lease service (drop-in only: the
    /// first call on a data directory where none runs).
    pub(crate) fn noting_start(&self, run: impl FnOnce() -> Call) -> (Call, bool) {
        if self.setup != Setup::DropIn || self.service_pid().is_some() {
            return (run(), false);
        }
        let call = run();
        (call, self.service_pid().is_some())
    }

    /// A pod as a bridge ADD leaves it, made with `ip`: a namespace whose
    /// eth0 is one end of a veth pair, up, with an address of the subnet
    /// (from its top, where no lease reaches) and a default route via the
    /// gateway; the other end up on this suite's bridge. The floor of a DEL
    /// is deleting it.
    pub(crate) fn floor_pod(&self) -> Netns {
        let pod = Netns::new("floor");
        let index = self.floors.fetch_add(1, Ordering::Relaxed);
        let host = format!("fl{index}");
        self.node.netns.veth_to(&host, &pod);
        self.node
            .netns
            .ip(&["link", "set", &host, "master", &self.bridge, "up"])
            .success();
        pod.ip(&["link", "set", "eth0", "up"]).success();
        let prefix = self.subnet.split('/').nth(1).unwrap_or("16");
        let address = format!("{}/{prefix}", nth_address(&self.subnet, 0xff00 + index % 250 + 2));
        pod.ip(&["addr", "add", &address, "dev", "eth0"]).success();
        let gateway = nth_address(&self.subnet, 1).to_string();
        pod.ip(&["route", "add", "default", "via", &gateway]).success();
        pod
    }

    /// `del` and the floor beside it: an `ip link del` of a pod-like veth
    /// made right before the two on the same bridge. Deleting a veth waits
    /// in the kernel's `rcu_barrier` (perf: 15 of its 17-25 ms) for every
    /// RCU callback queued before it, so a deletion pays for what the calls
    /// just before it left behind: making a floor pod, another deletion,
    /// another suite's nf_tables teardown. Whoever ran next to what decided
    /// the gap between a DEL and its floor by up to 5 ms either way (the
    /// floor always right after its pod's creation: DEL 5.1 ms above it;
    /// either order right after the creation: 0.6-4.8 ms below). So each of
    /// the two starts on a settled node, [`SETTLE`] after the call before
    /// it, and which goes first is drawn per `turn` from a fixed seed.
    /// Deleting a namespace queues such work too, so the floor's namespace
    /// joins `kept`, deleted by the caller after the phase.
    pub(crate) fn beside_floor(
        &self,
        turn: usize,
        del: impl FnOnce() -> Call,
        kept: &mut Vec<Netns>,
    ) -> (Call, Call) {
        let pod = self.floor_pod();
        let floor = || {
            std::thread::sleep(SETTLE);
            self.floor_delete(&pod)
        };
        let del = || {
            std::thread::sleep(SETTLE);
            del()
        };
        let mut draw = std::hash::DefaultHasher::new();
        (self.setup.label(), turn).hash(&mut draw);
        let calls = if draw.finish().is_multiple_of(2) {
            let del = del();
            (del, floor())
        } else {
            let floor = floor();
            (del(), floor)
        };
        kept.push(pod);
        calls
    }

    /// `ip -n <pod> link del eth0`, timed as one process: what no bridge
    /// DEL can go below (the kernel unregisters the pair in that call).
    pub(crate) fn floor_delete(&self, pod: &Netns) -> Call {
        exec(
            &self.ns,
            Path::new("ip"),
            &["-n", pod.name(), "link", "del", "eth0"],
            &[],
            "",
        )
    }

    /// What attachments left behind once all are deleted.
    pub(crate) fn leftovers(&self) -> Vec<String> {
        let mut left = self.node.veths();
        left.extend(self.node.container_nat_chains());
        match self.setup {
            Setup::Reference => {
                let leases_dir = self.data_dir().join(&self.network);
                if let Ok(entries) = std::fs::read_dir(&leases_dir) {
                    left.extend(
                        entries
                            .flatten()
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .filter(|n| n != "lock" && !n.starts_with("last_reserved_ip"))
                            .map(|n| format!("lease file {n}")),
                    );
                }
            }
            Setup::DropIn | Setup::Service => {
                left.extend(self.leases().iter().map(|l| format!("lease {l}")));
            }
        }
        left
    }

    /// Our leases, as `cnictl ipam ls` lists them (through the service).
    pub(crate) fn leases(&self) -> Vec<Value> {
        let socket = self
            .service
            .as_ref()
            .map(|s| s.socket.to_str().expect("UTF-8").to_owned());
        self.node
            .lease_records(&self.network, &self.data_dir(), socket.as_deref().unwrap_or(""))
    }
}

pub(crate) fn pods(n: usize, role: &str) -> Vec<Netns> {
    (0..n).map(|_| Netns::new(role)).collect()
}

pub(crate) fn check_leaks(out: &mut Outcome, what: &str, suite: &Suite) {
    let left = suite.leftovers();
    if !left.is_empty() {
        out.problem(format!("{what} ({}) left behind: {left:?}", suite.setup.label()));
    }
}

/// Call order for `n` calls per suite, alternating which suite goes first
/// so machine noise hits each alike: (call index, suite index).
pub(crate) fn interleaved(n: usize, suites: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).flat_map(move |i| (0..suites).map(move |k| (i, (i + k) % suites)))
}

/// The `index`th address of an IPv4 subnet.
pub(crate) fn nth_address(subnet: &str, index: usize) -> std::net::Ipv4Addr {
    let base: std::net::Ipv4Addr = subnet
        .split('/')
        .next()
        .and_then(|a| a.parse().ok())
        .expect("subnet");
    std::net::Ipv4Addr::from(u32::from(base) + u32::try_from(index).expect("index"))
}

/// How long the node is left alone before a timed deletion (see
/// [`Suite::beside_floor`]): with 30 ms the gap between a DEL and its floor
/// still moved by 4 ms from run to run, with 100 ms by 0.4.
pub(crate) const SETTLE: Duration = Duration::from_millis(100);
