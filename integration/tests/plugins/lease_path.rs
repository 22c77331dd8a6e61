//! The one lease path under faults: a full disk under the lease service,
//! sockets of other users, the service holding a network while other
//! clients come, the service killed inside a burst or stopped by a signal,
//! and one attachment added from two pods. Each test names the behaviour
//! it keeps.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_kit::leases::{Ipam, NETWORK, SmallFs, address, v4_conf};
use test_kit::{LeaseService, Node, bin, fault_bin, finish, spawn_in, wait_for};

/// The address without its prefix length, as `cnictl ipam ls` lists it.
fn bare(address: &str) -> String {
    address.split('/').next().unwrap_or_default().to_owned()
}

fn leased(ipam: &Ipam) -> BTreeMap<String, String> {
    by_container(&ipam.leases())
}

/// containerID → address of lease records as `cnictl ipam ls` lists them.
fn by_container(records: &[serde_json::Value]) -> BTreeMap<String, String> {
    records
        .iter()
        .map(|l| {
            (
                l["containerID"].as_str().unwrap_or_default().to_owned(),
                l["ip"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// The data directory fills while the service answers ADDs. Nothing is
/// answered that is not on disk: not the failed ADD, not its repetition
/// while the disk is still full, and after a restart no other pod gets an
/// answered address. Once space returns the next call works, without a
/// restart.
#[test]
fn a_full_disk_under_the_service_answers_nothing_that_is_not_on_disk() {
    let node = Node::new();
    let small = SmallFs::mount(node.path("small"), "4m");
    let socket = node.path("hl.sock");
    let mut service = LeaseService::start(&bin("host-local"), socket.clone(), &[]);
    let mut ipam = Ipam::with_service(&service, node);
    ipam.data_dir = small.path.join("data");
    let conf = v4_conf(&ipam, "1.0.0", "10.66.0.0/24");
    let mut answered: BTreeMap<String, String> = BTreeMap::new();
    answered.insert("open".into(), bare(&address(&ipam.add("open", &conf))));

    // The service holds the database open; the rest of the disk fills.
    let filler = small.path.join("filler");
    let mut file = fs::File::create(&filler).expect("create");
    let block = vec![0u8; 4096];
    while std::io::Write::write_all(&mut file, &block).is_ok() {}
    drop(file);

    let mut refused = None;
    for i in 0..200 {
        let id = format!("c{i}");
        let run = ipam.run("ADD", &id, &conf, &[]);
        if !run.ok() {
            refused = Some((id, run.json()));
            break;
        }
        answered.insert(id, bare(&address(&run.json())));
    }
    let (failed, error) = refused.expect("a full disk refuses some ADD");
    assert_eq!(error["code"], 5, "{error}");
    assert!(
        error["msg"]
            .as_str()
            .is_some_and(|m| m.contains("No space left on device")),
        "{error}"
    );

    // The runtime repeats the failed ADD while the disk is still full.
    let again = ipam.run("ADD", &failed, &conf, &[]);
    if again.ok() {
        answered.insert(failed.clone(), bare(&address(&again.json())));
    }

    fs::remove_file(&filler).expect("rm");
    let after = ipam.add("after-space", &conf);
    answered.insert("after-space".into(), bare(&address(&after)));

    service.kill();
    let _restarted = LeaseService::start(&bin("host-local"), socket, &[]);
    let fresh = bare(&address(&ipam.add("after-restart", &conf)));
    assert!(
        !answered.values().any(|ip| *ip == fresh),
        "{fresh} was answered before the restart and handed out again"
    );
    let held = leased(&ipam);
    for (id, ip) in &answered {
        assert_eq!(
            held.get(id),
            Some(ip),
            "{id} was answered {ip}; on disk: {held:?}"
        );
    }
}

/// A DEL through the lease service is answered before its release is
/// flushed. The service killed in that window: the DEL's caller already
/// has its answer, the restarted service opens the database (the witness
/// only lags, so nothing is refused as damaged), every address answered to
/// an ADD is still held, and a release the kill lost is done by the
/// runtime's repeated DEL.
#[test]
fn a_service_killed_after_answering_a_release_loses_no_add() {
    let node = Node::new();
    let socket = node.path("hl.sock");
    let ready = node.path("release-answered");
    let pause = [
        ("CNI_SUITE_FAULT_PAUSE", "host-local:release-answered"),
        ("CNI_SUITE_FAULT_READY", ready.to_str().expect("UTF-8")),
    ];
    let mut service = LeaseService::start(&fault_bin(), socket.clone(), &pause);
    let ipam = Ipam::with_service(&service, node);
    let conf = v4_conf(&ipam, "1.0.0", "10.61.0.0/24");
    let kept = bare(&address(&ipam.add("kept", &conf)));
    let gone = bare(&address(&ipam.add("gone", &conf)));
    let del = ipam.run("DEL", "gone", &conf, &[]);
    assert!(del.ok(), "the DEL is answered before the flush: {del:?}");
    wait_for(
        "the service to stop between answering the release and flushing it",
        Duration::from_secs(10),
        || ready.exists(),
    );
    service.kill();

    let _restarted = LeaseService::start(&bin("host-local"), socket, &[]);
    let held = leased(&ipam);
    assert_eq!(held.get("kept"), Some(&kept), "{held:?}");
    if let Some(ip) = held.get("gone") {
        assert_eq!(*ip, gone, "a lost release leaves the lease as it was: {held:?}");
    }
    ipam.run("DEL", "gone", &conf, &[]).success();
    let next = bare(&address(&ipam.add("next", &conf)));
    let held = leased(&ipam);
    assert!(!held.contains_key("gone"), "{held:?}");
    assert_eq!(held.get("kept"), Some(&kept), "{held:?}");
    assert_ne!(next, kept);
}

/// containerID → address, read by opening the database directly (`cnictl
/// ipam ls --socket ""`, which asks the data directory's service only while
/// one listens there).
fn leased_directly(ipam: &Ipam) -> BTreeMap<String, String> {
    by_container(&ipam.node.lease_records(NETWORK, &ipam.data_dir, ""))
}

/// What a node agent's stop does: SIGTERM to its lease service right after
/// a DEL was answered, while the release may still be waiting for its
/// flush. The service exits 0 at once, its socket gone, saying why; the
/// database, opened directly and then by a new service, has the DEL's
/// release and every ADD.
#[test]
fn a_sigterm_right_after_a_del_is_answered_loses_no_lease_and_no_release() {
    let node = Node::new();
    let socket = node.path("data").join(".sled/.service.sock");
    let service = LeaseService::start(&bin("host-local"), socket.clone(), &[]);
    let ipam = Ipam::with_socket(node, &socket);
    let conf = v4_conf(&ipam, "1.0.0", "10.73.0.0/24");
    let mut held: BTreeMap<String, String> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|id| (id.to_owned(), bare(&address(&ipam.add(id, &conf)))))
        .collect();
    let del = ipam.run("DEL", "b", &conf, &[]);
    service.signal(libc::SIGTERM);
    assert!(del.ok(), "{del:?}");
    held.remove("b");

    let (status, log) = service.exit_within(Duration::from_secs(5));
    assert!(status.success(), "{status}; it logged:\n{log}");
    assert!(log.contains("stopped (SIGTERM)"), "{log}");
    assert!(!socket.exists(), "its socket is removed");
    assert_eq!(leased_directly(&ipam), held, "opened directly");

    let _again = LeaseService::start(&bin("host-local"), socket.clone(), &[]);
    assert_eq!(leased(&ipam), held, "through a new service");
    let next = bare(&address(&ipam.add("e", &conf)));
    assert!(!held.values().any(|ip| *ip == next), "{next} handed out twice");
}

/// SIGTERM while a DEL's answer is out and its flush not done (the service
/// held between the two at `host-local:release-answered`): it stops
/// listening at once, but exits only after the flush, with status 0, and
/// the release is on disk.
#[test]
fn a_sigterm_waits_for_an_answered_release_to_be_flushed() {
    let node = Node::new();
    let socket = node.path("data").join(".sled/.service.sock");
    let (ready, resume) = (node.path("release-answered"), node.path("resume"));
    let pause = [
        ("CNI_SUITE_FAULT_PAUSE", "host-local:release-answered"),
        ("CNI_SUITE_FAULT_READY", ready.to_str().expect("UTF-8")),
        ("CNI_SUITE_FAULT_RESUME", resume.to_str().expect("UTF-8")),
    ];
    let mut service = LeaseService::start(&fault_bin(), socket.clone(), &pause);
    let ipam = Ipam::with_socket(node, &socket);
    let conf = v4_conf(&ipam, "1.0.0", "10.74.0.0/24");
    let kept = bare(&address(&ipam.add("kept", &conf)));
    ipam.add("gone", &conf);
    ipam.run("DEL", "gone", &conf, &[]).success();
    wait_for(
        "the service to hold between answering the release and flushing it",
        Duration::from_secs(10),
        || ready.exists(),
    );

    service.signal(libc::SIGTERM);
    wait_for("its socket to be removed", Duration::from_secs(2), || {
        !socket.exists()
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(service.running(), "it exited with a release not on disk");
    fs::write(&resume, "").expect("resume");

    let (status, log) = service.exit_within(Duration::from_secs(10));
    assert!(status.success(), "{status}; it logged:\n{log}");
    assert!(
        log.contains("stopped (SIGTERM)") && log.contains("every release it answered on disk"),
        "{log}"
    );
    let held = leased_directly(&ipam);
    assert_eq!(
        held,
        BTreeMap::from([("kept".to_owned(), kept)]),
        "the DEL's release is on disk"
    );
}

/// SIGTERM or SIGINT to a service with nothing to do, whether run by an
/// operator or started by a plugin (`--idle-exit`, detached): it exits 0
/// well within its one-second watch of its sockets, its socket removed.
#[test]
fn a_signal_stops_an_idle_service_at_once() {
    for (signal, name, args) in [
        (libc::SIGTERM, "SIGTERM", &[][..]),
        (libc::SIGINT, "SIGINT", &[][..]),
        (libc::SIGTERM, "SIGTERM", &["--idle-exit", "300"][..]),
    ] {
        let node = Node::new();
        let socket = node.path("hl.sock");
        let service = LeaseService::start_with(&bin("host-local"), socket.clone(), args, &[]);
        let signalled = Instant::now();
        service.signal(signal);
        let (status, log) = service.exit_within(Duration::from_secs(5));
        let took = signalled.elapsed();
        assert!(status.success(), "{name} {args:?}: {status}; it logged:\n{log}");
        assert!(took < Duration::from_millis(900), "{name} {args:?}: {took:?}");
        assert!(log.contains(&format!("stopped ({name})")), "{log}");
        assert!(!socket.exists(), "{name} {args:?}: its socket is removed");
    }
}

/// A Unix socket server run as `nobody`, writing what each connection sent
/// to a log and answering every request with 10.99.99.99.
struct ForeignServer {
    child: Child,
    log: PathBuf,
}

const FOREIGN_SERVER: &str = r#"
import socket, sys
path, log = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX)
s.bind(path)
s.listen(16)
open(log + ".ready", "w").close()
while True:
    c, _ = s.accept()
    c.settimeout(2)
    data = b""
    try:
        while True:
            chunk = c.recv(65536)
            if not chunk:
                break
            data += chunk
    except Exception:
        pass
    with open(log, "ab") as f:
        f.write(b"connection:" + data + b"\n")
    try:
        c.sendall(b'{"document":{"cniVersion":"1.0.0","ips":[{"address":"10.99.99.99/24"}]}}')
    except Exception:
        pass
    c.close()
"#;

const NOBODY: u32 = 65534;

/// A directory everybody may write into, outside the node's private one.
fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("cnit-open-")
        .tempdir()
        .expect("tempdir");
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).expect("chmod");
    dir
}

impl ForeignServer {
    fn start(socket: &Path, log: PathBuf) -> Self {
        let child = Command::new("setpriv")
            .args([
                format!("--reuid={NOBODY}"),
                format!("--regid={NOBODY}"),
                "--clear-groups".into(),
                "/usr/bin/python3".into(),
                "-c".into(),
                FOREIGN_SERVER.into(),
            ])
            .arg(socket)
            .arg(&log)
            .stdin(Stdio::null())
            .spawn()
            .expect("python3 as nobody");
        let ready = PathBuf::from(format!("{}.ready", log.display()));
        wait_for("the foreign server", Duration::from_secs(10), || ready.exists());
        ForeignServer { child, log }
    }

    fn received(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ForeignServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Another user's process that creates the socket first, in a directory
/// everybody can write or moved into root's own, is never sent a request
/// and its answer is never printed: the ADD is served from root's store.
/// The service refuses to listen where others can write.
#[test]
fn a_socket_of_another_user_is_never_sent_a_request() {
    let node = Node::new();
    let open = open_dir();
    let in_open_dir = open.path().join("hl.sock");
    let in_open_dir_server = ForeignServer::start(&in_open_dir, open.path().join("open.log"));

    // The same kind of server, its socket then moved into a directory only
    // root can write: the directory is fine, the peer is not.
    let staged = open.path().join("staged.sock");
    let moved_server = ForeignServer::start(&staged, open.path().join("moved.log"));
    let private = node.path("private");
    fs::create_dir(&private).expect("mkdir");
    let moved = private.join("hl.sock");
    fs::rename(&staged, &moved).expect("mv the socket");

    for (socket, server, subnet) in [
        (&in_open_dir, &in_open_dir_server, "10.67.1.0/24"),
        (&moved, &moved_server, "10.67.2.0/24"),
    ] {
        let ipam = Ipam::with_socket(Node::new(), socket);
        let conf = v4_conf(&ipam, "1.0.0", subnet);
        let result = ipam.add("pod", &conf);
        assert!(
            address(&result).starts_with(&subnet[..7]),
            "answered by {}: {result}",
            socket.display()
        );
        assert_eq!(
            leased(&ipam).get("pod").map(String::as_str),
            Some(bare(&address(&result)).as_str())
        );
        let received = server.received();
        assert!(
            !received.contains("CNI_COMMAND"),
            "{} was sent the request: {received}",
            socket.display()
        );
    }
    assert!(
        moved_server.received().starts_with("connection:\n"),
        "the moved socket was connected to and dropped at the peer check: {:?}",
        moved_server.received()
    );

    let refused = Command::new(bin("host-local"))
        .args(["serve", "--socket"])
        .arg(open.path().join("service.sock"))
        .output()
        .expect("host-local serve");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("writable by other users"), "{stderr}");
    assert!(!open.path().join("service.sock").exists());
}

fn with_ipam(conf: &str, change: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
    let mut doc: Value = serde_json::from_str(conf).expect("JSON");
    if let Some(section) = doc["ipam"].as_object_mut() {
        change(section);
    }
    doc.to_string()
}

/// While the service holds a network, no other client fails with code 11:
/// a configuration without the service or naming another socket, the data
/// directory spelled another way, `cnictl ipam --socket ""`, and a deleted
/// socket file are all served, through the service in charge of the data
/// directory.
#[test]
fn while_the_service_holds_a_network_every_other_client_is_served() {
    let node = Node::new();
    let service = LeaseService::start(&bin("host-local"), node.path("hl.sock"), &[]);
    let ipam = Ipam::with_service(&service, node);
    let conf = v4_conf(&ipam, "1.0.0", "10.68.0.0/24");
    let mut held = BTreeSet::new();
    held.insert(address(&ipam.add("through-the-service", &conf)));

    let link = ipam.node.path("data-link");
    std::os::unix::fs::symlink(&ipam.data_dir, &link).expect("symlink");
    let dotted = ipam.data_dir.join("..").join("data");
    let other_socket = ipam.node.path("other.sock");
    let variants: [(&str, String); 5] = [
        (
            "no-service",
            with_ipam(&conf, |s| drop(s.insert("socket".into(), json!("")))),
        ),
        (
            "other-socket",
            with_ipam(&conf, |s| drop(s.insert("socket".into(), json!(other_socket)))),
        ),
        (
            "symlinked",
            with_ipam(&conf, |s| drop(s.insert("dataDir".into(), json!(link)))),
        ),
        (
            "dotted",
            with_ipam(&conf, |s| drop(s.insert("dataDir".into(), json!(dotted)))),
        ),
        (
            "symlinked-no-service",
            with_ipam(&conf, |s| {
                s.insert("dataDir".into(), json!(link));
                s.insert("socket".into(), json!(""));
            }),
        ),
    ];
    for (id, conf) in &variants {
        let run = ipam.run("ADD", id, conf, &[]);
        assert!(run.ok(), "{id}: {run:?}");
        assert!(held.insert(address(&run.json())), "{id}: a duplicate address");
    }
    let direct = ipam.node.lease_records(NETWORK, &ipam.data_dir, "");
    assert_eq!(
        direct.len(),
        held.len(),
        "cnictl ipam ls --socket \"\": {direct:?}"
    );

    fs::remove_file(&service.socket).expect("rm the service's socket");
    let run = ipam.run("ADD", "socket-deleted", &conf, &[]);
    assert!(run.ok(), "{run:?}");
    assert!(held.insert(address(&run.json())));
    for (id, conf) in &variants {
        ipam.run("DEL", id, conf, &[]).success();
    }
    assert_eq!(leased(&ipam).len(), 2, "{:?}", leased(&ipam));
}

/// kill -9 of the service and its restart inside a burst of 50 ADDs: every
/// ADD succeeds, with distinct addresses, all of them held. Three rounds:
/// the moments that made ADDs fail (a client fallen back to the database
/// while the restarted service took it) come in most rounds, not all.
#[test]
fn a_service_killed_and_restarted_inside_a_burst_fails_no_add() {
    const BURST: usize = 50;
    const ROUNDS: usize = 3;
    let node = Node::new();
    let socket = node.path("hl.sock");
    let mut service = LeaseService::start(&bin("host-local"), socket.clone(), &[]);
    let ipam = Ipam::with_service(&service, node);
    let conf = v4_conf(&ipam, "1.0.0", "10.69.0.0/24");
    let mut addresses = BTreeSet::new();
    for round in 0..ROUNDS {
        // Warm: the service has the database open when the burst starts.
        addresses.insert(address(&ipam.add(&format!("warm-{round}"), &conf)));
        let spawn = |i: usize| {
            let id = format!("burst-{round}-{i}");
            let env = [
                ("CNI_COMMAND", "ADD"),
                ("CNI_CONTAINERID", id.as_str()),
                ("CNI_IFNAME", "eth0"),
                ("CNI_NETNS", "/var/run/netns/unused"),
                ("CNI_PATH", "/nonexistent"),
            ];
            (
                id.clone(),
                spawn_in(ipam.node.netns.path(), &bin("host-local"), &[], &env, &conf),
            )
        };
        // The ADDs come a millisecond apart; the service dies after the
        // tenth has started and is back after the twenty-fifth, while the
        // ADDs in between have fallen back to the database or wait for its
        // lock.
        let mut running = Vec::new();
        for i in 0..BURST {
            running.push(spawn(i));
            std::thread::sleep(Duration::from_millis(1));
            if i == 10 {
                service.kill();
            }
            if i == 25 {
                service = LeaseService::start(&bin("host-local"), socket.clone(), &[]);
            }
        }
        let runs: Vec<_> = running
            .into_iter()
            .map(|(id, child)| finish(&id, child))
            .collect();
        let failed: Vec<_> = runs.iter().filter(|r| !r.ok()).collect();
        assert!(
            failed.is_empty(),
            "round {round}: {} ADDs failed: {failed:?}",
            failed.len()
        );
        for run in &runs {
            assert!(
                addresses.insert(address(&run.json())),
                "a duplicate address: {run:?}"
            );
        }
    }
    assert_eq!(leased(&ipam).len(), ROUNDS * (BURST + 1));
}

/// One (containerID, ifname) added from a second pod is refused as the
/// reference refuses a duplicate allocation; the DEL a runtime sends for
/// that refused ADD leaves the first pod its address; a repeat from the
/// first pod is answered; the first pod's own DEL frees it. Both without
/// and through the service.
#[test]
fn an_attachment_added_from_a_second_pod_is_refused_and_its_del_frees_nothing() {
    for through_service in [false, true] {
        let node = Node::new();
        let service =
            through_service.then(|| LeaseService::start(&bin("host-local"), node.path("hl.sock"), &[]));
        let ipam = match &service {
            Some(service) => Ipam::with_service(service, node),
            None => Ipam::direct(),
        };
        let conf = v4_conf(&ipam, "1.0.0", "10.70.0.0/24");
        let (pod_a, pod_b) = (ipam.node.pod("pod-a"), ipam.node.pod("pod-b"));
        let run = |command: &str, pod: &test_kit::Netns| {
            ipam.run(command, "shared", &conf, &[("CNI_NETNS", pod.path_str())])
        };
        let first = address(&run("ADD", &pod_a).success().json());
        assert_eq!(
            address(&run("ADD", &pod_a).success().json()),
            first,
            "a runtime's retry"
        );
        let refused = run("ADD", &pod_b).failure().json();
        let expected = format!(
            "failed to allocate for range 0: {} has been allocated to shared, duplicate allocation is not allowed",
            bare(&first)
        );
        assert_eq!(refused["msg"], expected.as_str(), "{refused}");
        run("DEL", &pod_b).success();
        assert_eq!(
            leased(&ipam).get("shared"),
            Some(&bare(&first)),
            "pod A lost its address"
        );
        assert_ne!(address(&ipam.add("another", &conf)), first);
        run("DEL", &pod_a).success();
        assert_eq!(leased(&ipam).get("shared"), None);
    }
}

/// A data directory another user owns (or could change) is refused before
/// anything is written: a symlink planted in it, in place of the witness
/// directory or of sled's own files, would steer root's writes into
/// root's own files.
#[test]
fn a_store_another_user_can_change_is_not_used() {
    let node = Node::new();
    let victim = node.path("victim");
    fs::create_dir(&victim).expect("mkdir");
    fs::write(victim.join(NETWORK), "ROOT-OWNED").expect("write");
    fs::write(victim.join("db"), "ROOT-OWNED").expect("write");
    // What another user planted in the `.sled` they own, as (what, the
    // symlink's place under `.sled`, where it leads).
    let plants = [
        ("witness directory", ".generations".to_owned(), victim.clone()),
        ("sled's log", format!("{NETWORK}/db"), victim.join("db")),
    ];
    for (what, place, target) in plants {
        let mut ipam = Ipam::direct();
        let owned = ipam.node.path("theirs");
        let link = owned.join(".sled").join(place);
        fs::create_dir_all(link.parent().expect("parent")).expect("mkdir");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        for path in [owned.clone(), owned.join(".sled")] {
            std::os::unix::fs::chown(&path, Some(NOBODY), Some(NOBODY)).expect("chown");
        }
        ipam.data_dir = owned;
        let conf = v4_conf(&ipam, "1.0.0", "10.71.0.0/24");
        let refused = ipam.run("ADD", "pod", &conf, &[]).failure().json();
        assert_eq!(refused["code"], 5, "{what}: {refused}");
        assert!(
            refused["msg"].as_str().is_some_and(|m| m.contains("is not used")),
            "{what}: {refused}"
        );
        for file in [NETWORK, "db"] {
            assert_eq!(
                fs::read_to_string(victim.join(file)).expect("read"),
                "ROOT-OWNED",
                "{what}"
            );
        }
    }
}

/// A service started on a data directory's own socket keeps listening on
/// it as it was, instead of binding it again and again.
#[test]
fn a_service_started_on_the_data_directorys_socket_keeps_it() {
    let node = Node::new();
    let data_dir = node.path("data");
    let socket = data_dir.join(".sled").join(".service.sock");
    let service = LeaseService::start(&bin("host-local"), socket.clone(), &[]);
    let ipam = Ipam::with_service(&service, node);
    let conf = v4_conf(&ipam, "1.0.0", "10.72.0.0/24");
    ipam.add("a", &conf);
    let bound = fs::symlink_metadata(&socket)
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .expect("socket");
    std::thread::sleep(Duration::from_millis(2500));
    let now = fs::symlink_metadata(&socket)
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .expect("socket");
    assert_eq!(bound, now, "the socket was bound again");
    ipam.add("b", &conf);
}
