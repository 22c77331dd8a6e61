//! SIGKILL at random moments of the full chain's ADD and DEL (cnictl
//! running the bridge, host-local opening its sled database, and
//! istio-redirect, all in one process group, as a runtime's timeout or the
//! OOM killer would take them), a hundred times on one node. After each
//! kill the runtime's next step (a DEL, as containerd sends after a failed
//! ADD, or the retried DEL) must succeed and leave nothing of that pod;
//! pods that got a successful reply keep their leases throughout, and no
//! address is ever handed out twice. Then the same at every named fault
//! point, and a namespace removed under a running ADD.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_kit::{Netns, Node, Run, bin_dir, fault_bin, wait_for};

const NETWORK: &str = "crash-net";
const KILLS: usize = 100;

/// Deterministic kill moments (xorshift64*), so a failure can be replayed.
struct Moments(u64);

impl Moments {
    fn next_delay(&mut self, max: Duration) -> Duration {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        max.mul_f64((r >> 11) as f64 / (1u64 << 53) as f64)
    }
}

struct Chain {
    node: Node,
}

impl Chain {
    fn new() -> Self {
        let node = Node::new();
        Chain { node }
    }

    fn data_dir(&self) -> std::path::PathBuf {
        self.node.path("ipam")
    }

    fn conf(&self, prev: Option<&Value>) -> String {
        let mut conf = json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "bridge",
            "bridge": "cnicrash0", "isGateway": true, "ipMasq": true,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.65.0.0/24"}]],
                     "dataDir": self.data_dir(), "socket": ""}});
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        conf.to_string()
    }

    /// The bridge in its own process group inside the node namespace, so a
    /// kill takes host-local with it.
    fn spawn(&self, command: &str, id: &str, pod: &Netns, prev: Option<&Value>) -> Child {
        self.spawn_from(&bin_dir(), &[], command, id, pod, prev)
    }

    /// The same with the plugins of `plugins` (the fault-injection builds)
    /// and extra variables.
    fn spawn_from(
        &self,
        plugins: &Path,
        extra: &[(&str, &str)],
        command: &str,
        id: &str,
        pod: &Netns,
        prev: Option<&Value>,
    ) -> Child {
        let call = Call {
            command,
            id,
            netns: pod.path_str(),
        };
        self.spawn_plugin(plugins, "bridge", &self.conf(prev), extra, &call)
    }

    /// `plugin` from `plugins` with `conf`, in its own process group inside
    /// the node namespace.
    fn spawn_plugin(
        &self,
        plugins: &Path,
        plugin: &str,
        conf: &str,
        extra: &[(&str, &str)],
        call: &Call,
    ) -> Child {
        use std::io::Write;
        let mut child = self
            .in_node_group(&plugins.join(plugin))
            .envs([
                ("CNI_COMMAND", call.command),
                ("CNI_CONTAINERID", call.id),
                ("CNI_NETNS", call.netns),
                ("CNI_IFNAME", "eth0"),
                ("CNI_PATH", plugins.to_str().expect("UTF-8")),
            ])
            .envs(extra.iter().copied())
            .stdin(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {plugin}: {e}"));
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(conf.as_bytes()).expect("stdin");
        }
        child
    }

    /// `program` inside the node namespace, in a process group of its own
    /// (so a kill takes every process it starts), its output piped.
    fn in_node_group(&self, program: &Path) -> Command {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net={}", self.node.netns.path().display()))
            .arg("--")
            .arg(program)
            .process_group(0)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    /// The full chain as a runtime configures it: the bridge (host-local
    /// opening its database in each process), then istio-redirect.
    fn write_istio_conflist(&self) {
        let bridge: Value = serde_json::from_str(&self.conf(None)).expect("the bridge entry");
        let list = json!({"cniVersion": "1.1.0", "name": NETWORK,
            "plugins": [bridge, {"type": "istio-redirect", "redirect": {}}]});
        self.node.write_conf("10-crash.conflist", &list);
    }

    /// `cnictl VERB` of the conflist for container `id`, in its own process
    /// group inside the node namespace: a kill takes every plugin it runs.
    fn spawn_cnictl(&self, verb: &str, id: &str, pod: &Netns) -> Child {
        self.in_node_group(&bin_dir().join("cnictl"))
            .args(["--cache-dir", self.node.cache_dir().to_str().expect("UTF-8")])
            .args(["--json", verb, "--container-id", id, NETWORK, pod.path_str()])
            .env("NETCONFPATH", self.node.conf_dir())
            .env("CNI_PATH", bin_dir())
            .stdin(Stdio::null())
            .spawn()
            .expect("start cnictl")
    }

    fn cnictl(&self, verb: &str, id: &str, pod: &Netns) -> Run {
        let child = self.spawn_cnictl(verb, id, pod);
        test_kit::finish(&format!("cnictl {verb} {id}"), child)
    }

    /// istio-redirect after the bridge, as the Istio chain runs it: dual
    /// stack, static redirect, logging what it decides.
    fn istio(&self, command: &str, id: &str, pod: &Netns, prev: &Value) -> Run {
        let call = Call {
            command,
            id,
            netns: pod.path_str(),
        };
        let child = self.spawn_plugin(&bin_dir(), "istio-redirect", &istio_conf(prev), &[], &call);
        test_kit::finish(&format!("istio-redirect {command} {id}"), child)
    }

    /// The bridge's ADD, with an IPv6 address added on the pod's eth0 so
    /// that istio-redirect programs both families.
    fn add_dual_stack(&self, id: &str, pod: &Netns) -> Value {
        let added = self.run("ADD", id, pod, None).success().json();
        pod.ip(&["addr", "add", "fd65::5/64", "dev", "eth0", "nodad"])
            .success();
        added
    }

    fn run(&self, command: &str, id: &str, pod: &Netns, prev: Option<&Value>) -> Run {
        let child = self.spawn(command, id, pod, prev);
        test_kit::finish(&format!("bridge {command} {id}"), child)
    }

    /// Kills the process group after `delay` unless it finished; returns
    /// its answer when it finished first.
    fn kill_after(&self, mut child: Child, delay: Duration) -> Option<Run> {
        let deadline = Instant::now() + delay;
        while Instant::now() < deadline {
            if child.try_wait().expect("try_wait").is_some() {
                return Some(test_kit::finish("bridge", child));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        kill_group(child);
        None
    }

    /// The leases after a kill and the runtime's next DEL: that pod has
    /// none, the anchors keep theirs, no address is held twice.
    fn assert_after_recovery(&self, what: &str, id: &str, pod: &Netns, anchors: &BTreeMap<String, String>) {
        let leases = self.leases();
        assert!(!leases.contains_key(id), "{what}: {id} keeps a lease: {leases:?}");
        for (anchor, ip) in anchors {
            assert_eq!(leases.get(anchor), Some(ip), "{what}: an answered lease was lost");
        }
        let mut seen: Vec<&String> = leases.values().collect();
        seen.sort();
        seen.dedup();
        assert_eq!(
            seen.len(),
            leases.len(),
            "{what}: an address held twice: {leases:?}"
        );
        pod.ip(&["link", "show", "eth0"]).failure();
    }

    /// Leases by container ID, read with the database opened afresh.
    fn leases(&self) -> BTreeMap<String, String> {
        self.node
            .lease_records(NETWORK, &self.data_dir(), "")
            .iter()
            .map(|l| {
                (
                    l["containerID"].as_str().unwrap_or_default().to_owned(),
                    l["ip"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    }
}

/// One plugin call's CNI_COMMAND, CNI_CONTAINERID and CNI_NETNS.
struct Call<'a> {
    command: &'a str,
    id: &'a str,
    netns: &'a str,
}

fn istio_conf(prev: &Value) -> String {
    json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "istio-redirect", "dual_stack": true,
           "plugin_log_level": "info", "redirect": {}, "prevResult": prev})
    .to_string()
}

/// SIGKILL to the whole process group, as a runtime's timeout or the OOM
/// killer delivers it.
fn kill_group(mut child: Child) {
    let group = format!("-{}", child.id());
    Command::new("kill")
        .args(["-KILL", "--", &group])
        .status()
        .expect("kill");
    let _ = child.wait();
}

fn address(result: &Value) -> String {
    result["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split('/').next())
        .unwrap_or_default()
        .to_owned()
}

/// Kill moments are drawn from up to the quickest of a few calls measured
/// on this machine just before, so that nearly every kill lands inside its
/// call however fast the chain is (a fixed 50 ms window let fewer than half
/// land once ADD got faster).
const CALIBRATION_CALLS: usize = 5;

#[test]
fn a_hundred_kills_during_add_and_del_leave_nothing_and_lose_nothing() {
    let _no_soak = super::beside_crash_tests();
    let chain = Chain::new();
    chain.write_istio_conflist();
    // Pods that were answered before the campaign: their leases must
    // survive every kill, and nobody else may get their addresses.
    let anchors: Vec<(Netns, String, Value)> = (0..3)
        .map(|i| {
            let pod = chain.node.pod("anchor");
            let id = format!("anchor-{i}");
            let result = chain.cnictl("add", &id, &pod).success().json();
            (pod, id, result)
        })
        .collect();
    let (mut add_times, mut del_times) = (Vec::new(), Vec::new());
    for i in 0..CALIBRATION_CALLS {
        let pod = chain.node.pod("calibration");
        let id = format!("calibration-{i}");
        let started = Instant::now();
        chain.cnictl("add", &id, &pod).success();
        add_times.push(started.elapsed());
        let started = Instant::now();
        chain.cnictl("del", &id, &pod).success();
        del_times.push(started.elapsed());
    }
    let add_window = add_times.into_iter().min().unwrap_or_default();
    let del_window = del_times.into_iter().min().unwrap_or_default();
    let anchor_leases: BTreeMap<String, String> = anchors
        .iter()
        .map(|(_, id, result)| (id.clone(), address(result)))
        .collect();
    // `make soak` runs further seeds (CNI_SUITE_CRASH_SEED); the seed is
    // printed so a failure can be replayed.
    let seed = std::env::var("CNI_SUITE_CRASH_SEED")
        .ok()
        .and_then(|s| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok())
        .unwrap_or(0x00c0_ffee);
    eprintln!("crash campaign seed {seed:#x}, kill windows: ADD {add_window:?}, DEL {del_window:?}");
    let mut moments = Moments(seed);
    let mut killed = [0_usize; 2];
    for i in 0..KILLS {
        let pod = chain.node.pod("victim");
        let id = format!("victim-{i}");
        if i % 2 == 1 {
            chain.cnictl("add", &id, &pod).success();
            let child = chain.spawn_cnictl("del", &id, &pod);
            if chain.kill_after(child, moments.next_delay(del_window)).is_none() {
                killed[1] += 1;
            }
        } else {
            let child = chain.spawn_cnictl("add", &id, &pod);
            match chain.kill_after(child, moments.next_delay(add_window)) {
                None => killed[0] += 1,
                Some(run) if run.ok() => {
                    // A successful reply is a lease on disk.
                    let result = run.json();
                    assert_eq!(chain.leases().get(&id), Some(&address(&result)), "{i}");
                }
                Some(run) => panic!("{i}: ADD failed without being killed: {run:?}"),
            }
        }
        // The runtime's next step: DEL through the chain, with the cached
        // result when the ADD was answered.
        chain.cnictl("del", &id, &pod).success();
        chain.assert_after_recovery(&format!("kill {i}"), &id, &pod, &anchor_leases);
    }
    eprintln!(
        "kills that landed inside the call: ADD {}, DEL {}",
        killed[0], killed[1]
    );
    // Enough kills landed inside the calls, not after them.
    assert!(
        killed[0] >= KILLS / 4 && killed[1] >= KILLS / 4,
        "kills that landed: {killed:?}"
    );
    assert_eq!(
        chain.node.veths().len(),
        anchors.len(),
        "{:?}",
        chain.node.veths()
    );
    for (pod, id, _) in &anchors {
        chain.cnictl("del", id, pod).success();
    }
    let left = chain.node.leftovers(NETWORK, &chain.data_dir());
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(Path::new(&chain.data_dir()).exists());
    // The subnet's masquerade outlives its pods until GC finds none valid.
    chain.node.cnictl(&["gc", NETWORK, "--all"]).success();
    let nat = chain.node.netns.nat_rules("iptables-save");
    assert!(!nat.contains("CNI-"), "masquerade left after GC: {nat}");
}

/// The same, at each named point of the fault-injection builds
/// (`cni::fault::POINTS`, `make fault-bin`): the kill lands exactly there.
#[test]
fn a_kill_at_every_named_point_leaves_nothing_and_loses_nothing() {
    let _no_soak = super::beside_crash_tests();
    let chain = Chain::new();
    let fault_dir = fault_bin()
        .parent()
        .expect("the fault builds' directory")
        .to_path_buf();
    let anchor = chain.node.pod("anchor");
    let anchor_result = chain.run("ADD", "anchor", &anchor, None).success().json();
    let anchors = BTreeMap::from([("anchor".to_owned(), address(&anchor_result))]);
    // A lease service's own point is reached by no plugin process
    // (plugins/lease_path.rs kills the service there).
    for point in cni::fault::POINTS.into_iter().filter(|p| {
        !p.starts_with("istio-redirect:")
            && !p.starts_with("firewall:")
            && *p != "host-local:release-answered"
    }) {
        let pod = chain.node.pod("victim");
        let id = format!("victim-{}", point.replace(':', "-"));
        let ready = chain.node.path(&format!("ready-{id}"));
        let pause = [
            ("CNI_SUITE_FAULT_PAUSE", point),
            ("CNI_SUITE_FAULT_READY", ready.to_str().expect("UTF-8")),
        ];
        let in_del = point.starts_with("bridge:del-");
        let answered = in_del.then(|| chain.run("ADD", &id, &pod, None).success().json());
        let command = if in_del { "DEL" } else { "ADD" };
        let child = chain.spawn_from(&fault_dir, &pause, command, &id, &pod, answered.as_ref());
        wait_for(
            &format!("{command} to reach {point}"),
            Duration::from_secs(20),
            || ready.exists(),
        );
        kill_group(child);
        chain.run("DEL", &id, &pod, answered.as_ref()).success();
        chain.assert_after_recovery(point, &id, &pod, &anchors);
    }
    chain
        .run("DEL", "anchor", &anchor, Some(&anchor_result))
        .success();
    let left = chain.node.leftovers(NETWORK, &chain.data_dir());
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// istio-redirect killed at each of its named points, chained after the
/// bridge: the runtime's DEL of the chain (last plugin first) succeeds and
/// leaves nothing, and the ADD retried in the same namespace converges on
/// exactly the expected rules in both families (a further ADD finds them
/// all in place, CHECK passes).
#[test]
fn a_kill_inside_istio_redirect_is_undone_by_del_and_a_retry_converges() {
    let _no_soak = super::beside_crash_tests();
    let chain = Chain::new();
    let fault_dir = fault_bin()
        .parent()
        .expect("the fault builds' directory")
        .to_path_buf();
    for point in cni::fault::POINTS
        .into_iter()
        .filter(|p| p.starts_with("istio-redirect:"))
    {
        let pod = chain.node.pod("istio-victim");
        let id = format!("victim-{}", point.replace(':', "-"));
        let added = chain.add_dual_stack(&id, &pod);
        let ready = chain.node.path(&format!("ready-{id}"));
        let pause = [
            ("CNI_SUITE_FAULT_PAUSE", point),
            ("CNI_SUITE_FAULT_READY", ready.to_str().expect("UTF-8")),
        ];
        let call = Call {
            command: "ADD",
            id: &id,
            netns: pod.path_str(),
        };
        let child = chain.spawn_plugin(&fault_dir, "istio-redirect", &istio_conf(&added), &pause, &call);
        wait_for(&format!("ADD to reach {point}"), Duration::from_secs(20), || {
            ready.exists()
        });
        kill_group(child);
        chain.istio("DEL", &id, &pod, &added).success();
        chain.run("DEL", &id, &pod, Some(&added)).success();
        chain.assert_after_recovery(point, &id, &pod, &BTreeMap::new());

        let added = chain.add_dual_stack(&id, &pod);
        chain.istio("ADD", &id, &pod, &added).success();
        let again = chain.istio("ADD", &id, &pod, &added).success();
        for family in ["V4", "V6"] {
            assert!(
                again
                    .stderr
                    .contains(&format!("capture rules already in place ({family})")),
                "{point}: {again:?}"
            );
        }
        chain.istio("CHECK", &id, &pod, &added).success();
        chain.istio("DEL", &id, &pod, &added).success();
        chain.run("DEL", &id, &pod, Some(&added)).success();
    }
    let left = chain.node.leftovers(NETWORK, &chain.data_dir());
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The runtime gives up on a pod and removes its namespace while the bridge
/// is still adding it (paused after configuring the pod, then resumed):
/// the ADD fails naming the namespace, and undoes the veth and the lease.
#[test]
fn a_namespace_removed_during_add_fails_it_and_rolls_it_back() {
    let _no_soak = super::beside_crash_tests();
    let chain = Chain::new();
    let fault_dir = fault_bin()
        .parent()
        .expect("the fault builds' directory")
        .to_path_buf();
    let pod = chain.node.pod("vanishing");
    let ready = chain.node.path("ready-vanishing");
    let resume = chain.node.path("resume-vanishing");
    let pause = [
        ("CNI_SUITE_FAULT_PAUSE", "bridge:configured"),
        ("CNI_SUITE_FAULT_READY", ready.to_str().expect("UTF-8")),
        ("CNI_SUITE_FAULT_RESUME", resume.to_str().expect("UTF-8")),
    ];
    let child = chain.spawn_from(&fault_dir, &pause, "ADD", "vanishing", &pod, None);
    wait_for("ADD to configure the pod", Duration::from_secs(20), || {
        ready.exists()
    });
    assert_eq!(chain.leases().len(), 1, "the lease is taken");
    let path = pod.path_str().to_owned();
    drop(pod);
    std::fs::write(&resume, "").expect("resume");
    let failed = test_kit::finish("bridge ADD vanishing", child).failure();
    let err = failed.json();
    assert_eq!(err["code"], 4, "{err}");
    assert!(err["msg"].as_str().unwrap_or_default().contains(&path), "{err}");
    assert!(chain.leases().is_empty(), "the lease is released");
    let left = chain.node.leftovers(NETWORK, &chain.data_dir());
    assert!(left.is_empty(), "left behind: {left:?}");
    // The runtime's DEL afterwards, with the namespace gone, succeeds.
    let call = Call {
        command: "DEL",
        id: "vanishing",
        netns: &path,
    };
    let del = chain.spawn_plugin(&bin_dir(), "bridge", &chain.conf(None), &[], &call);
    test_kit::finish("bridge DEL vanishing", del).success();
}
