//! A node with nothing but the binaries and a configuration without a
//! `socket` key: host-local starts its data directory's lease service
//! itself, once however many plugins race, detached from the runtime; the
//! bridge then asks that service instead of executing host-local, only
//! because it runs the very host-local CNI_PATH finds; an idle service
//! exits.

use std::collections::BTreeSet;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use test_kit::leases::{Ipam, address};
use test_kit::{Node, bin, bin_dir, finish, services_under, spawn_in, wait_for};

/// host-local's configuration with no `socket` key, as users write it.
fn drop_in_conf(ipam: &Ipam, subnet: &str) -> String {
    json!({"cniVersion": "1.0.0", "name": "dropin", "type": "bridge",
           "ipam": {"type": "host-local", "subnet": subnet, "dataDir": ipam.data_dir()}})
    .to_string()
}

fn add_env(id: &str) -> [(&str, &str); 5] {
    [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", id),
        ("CNI_IFNAME", "eth0"),
        ("CNI_NETNS", "/var/run/netns/unused"),
        ("CNI_PATH", "/nonexistent"),
    ]
}

/// Twenty ADDs at once on a node where nothing runs: one service is
/// started, every ADD is answered with its own address.
#[test]
fn with_only_the_binaries_one_service_is_started_however_many_race() {
    let ipam = Ipam::direct();
    let conf = drop_in_conf(&ipam, "10.73.0.0/24");
    let children: Vec<_> = (0..20)
        .map(|i| {
            let id = format!("race-{i}");
            (
                id.clone(),
                spawn_in(
                    ipam.node.netns.path(),
                    &bin("host-local"),
                    &[],
                    &add_env(&id),
                    &conf,
                ),
            )
        })
        .collect();
    let mut addresses = BTreeSet::new();
    for (id, child) in children {
        let run = finish(&id, child).success();
        assert!(addresses.insert(address(&run.json())), "a duplicate address");
    }
    let services = services_under(&ipam.data_dir);
    assert_eq!(services.len(), 1, "services started: {services:?}");
    let log = fs::read_to_string(ipam.data_dir.join(".sled/.service.log")).unwrap_or_default();
    assert!(
        log.contains("listening on"),
        "the service logs where an operator finds it: {log:?}"
    );
}

/// A runtime reads a plugin's output until every writer has closed it.
/// The service host-local starts keeps none of it, not even a descriptor
/// the runtime let the plugin inherit (here fd 9, stdout's pipe again).
#[test]
fn a_started_service_holds_none_of_the_runtimes_pipes() {
    let ipam = Ipam::direct();
    let conf = drop_in_conf(&ipam, "10.74.0.0/24");
    // The runtime's pipes, made here so their inodes are known: the
    // service may hold pipes of its own (its stop and signal pipes), never
    // one of these.
    let (mut stdout, stdout_writer) = std::io::pipe().expect("pipe");
    let (mut stderr, stderr_writer) = std::io::pipe().expect("pipe");
    let runtime_pipes: BTreeSet<String> = [stdout.as_raw_fd(), stderr.as_raw_fd()]
        .iter()
        .map(|fd| {
            let inode = fs::metadata(format!("/proc/self/fd/{fd}")).expect("stat").ino();
            format!("pipe:[{inode}]")
        })
        .collect();
    let started = Instant::now();
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", ipam.node.netns.path().display()))
        .args(["--", "sh", "-c", "exec 9>&1; exec \"$0\""])
        .arg(bin("host-local"))
        .envs(add_env("piped"))
        .stdin(Stdio::piped())
        .stdout(stdout_writer)
        .stderr(stderr_writer)
        .spawn()
        .expect("spawn");
    if let Some(mut stdin) = child.stdin.take() {
        std::io::Write::write_all(&mut stdin, conf.as_bytes()).expect("stdin");
    }
    // As a runtime does: read the output to its end, when every writer
    // has closed it.
    let mut errors = String::new();
    std::io::Read::read_to_end(&mut stdout, &mut Vec::new()).expect("stdout");
    std::io::Read::read_to_string(&mut stderr, &mut errors).expect("stderr");
    let status = child.wait().expect("wait");
    let took = started.elapsed();
    assert!(status.success(), "{errors}");
    assert!(
        took < Duration::from_secs(10),
        "the output ended only after {took:?}"
    );
    let services = services_under(&ipam.data_dir);
    assert_eq!(services.len(), 1, "the service still runs");
    let pipes: Vec<String> = fs::read_dir(format!("/proc/{}/fd", services[0]))
        .expect("its descriptors")
        .flatten()
        .filter_map(|fd| fs::read_link(fd.path()).ok())
        .map(|target| target.display().to_string())
        .filter(|target| runtime_pipes.contains(target))
        .collect();
    assert!(
        pipes.is_empty(),
        "the service holds the runtime's pipes: {pipes:?}"
    );
    let session = |pid: u32| {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        stat.rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().nth(3))
            .map(str::to_owned)
    };
    assert_eq!(
        session(services[0]),
        Some(services[0].to_string()),
        "its own session"
    );
}

/// `serve --idle-exit` (what host-local starts) stops listening, removes
/// its socket and exits once no request has come for that long.
#[test]
fn a_started_service_exits_when_idle() {
    let node = Node::new();
    let socket = node.path("idle.sock");
    let mut service = Command::new(bin("host-local"))
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--idle-exit", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("serve");
    wait_for("the service to listen", Duration::from_secs(10), || {
        socket.exists()
    });
    let ipam = Ipam::with_socket(node, &socket);
    let conf = test_kit::leases::v4_conf(&ipam, "1.0.0", "10.75.0.0/24");
    ipam.add("a", &conf);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = service.try_wait().expect("wait") {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(15), "still running");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "it did not wait to be idle"
    );
    assert!(!socket.exists(), "its socket is removed");
}

/// The bridge asks the started service instead of executing host-local,
/// only when that service runs the very file CNI_PATH finds.
#[test]
fn the_bridge_skips_host_local_only_for_a_service_of_the_same_binary() {
    let node = Node::new();
    let pods = [node.pod("pod-a"), node.pod("pod-b")];
    let data_dir = node.path("ipam");
    let conf = json!({"cniVersion": "1.0.0", "name": "dropin", "type": "bridge", "bridge": "cnidrop0",
                      "ipam": {"type": "host-local", "subnet": "10.76.0.0/24", "dataDir": data_dir}})
    .to_string();
    let bridge = |command: &str, pod: usize, cni_path: &Path| {
        let id = format!("pod-{pod}");
        let env = [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", id.as_str()),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", pods[pod].path_str()),
            ("CNI_PATH", cni_path.to_str().expect("UTF-8")),
        ];
        let (run, execs) = test_kit::run_traced(node.netns.path(), &bin("bridge"), &[], &env, &conf);
        run.success();
        execs.iter().filter(|p| *p == "host-local").count()
    };
    // The first ADD (not traced: strace -f would follow the service it
    // starts and wait for it to exit) executes host-local, which starts
    // the service; the next finds it.
    let bins = bin_dir();
    let first = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "pod-0"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_NETNS", pods[0].path_str()),
        ("CNI_PATH", bins.to_str().expect("UTF-8")),
    ];
    test_kit::run_in(node.netns.path(), &bin("bridge"), &[], &first, &conf).success();
    assert_eq!(services_under(&data_dir).len(), 1);
    assert_eq!(
        bridge("ADD", 1, &bin_dir()),
        0,
        "a service of the same binary answers"
    );
    // Another host-local file in CNI_PATH (a copy, as the reference's would
    // be): the service does not run it, so it is executed.
    let other = node.path("other-bin");
    fs::create_dir(&other).expect("mkdir");
    fs::copy(bin("host-local"), other.join("host-local")).expect("copy");
    assert_eq!(
        bridge("DEL", 1, &other),
        1,
        "a service of another binary is not trusted"
    );
    assert_eq!(bridge("DEL", 0, &bin_dir()), 0);
}

/// An invocation that cannot reach the store (a bad range, unknown
/// CNI_ARGS) is answered with its error and starts no service, in its data
/// directory or the default one.
#[test]
fn an_invalid_invocation_starts_no_service() {
    let ipam = Ipam::direct();
    let bad_range = json!({"cniVersion": "1.0.0", "name": "dropin", "type": "bridge",
                           "ipam": {"type": "host-local", "subnet": "10.77.0.0/31", "dataDir": ipam.data_dir()}})
    .to_string();
    let refused = ipam.run("ADD", "bad", &bad_range, &[]).failure().json();
    assert_eq!(refused["code"], 7, "{refused}");
    let good = drop_in_conf(&ipam, "10.77.0.0/24");
    ipam.run("ADD", "bad-args", &good, &[("CNI_ARGS", "UNKNOWN=1")])
        .failure();
    assert!(services_under(&ipam.data_dir).is_empty());
    assert!(!ipam.data_dir.exists(), "the data directory was created");
}
