//! host-local end to end: the built binary executed as a runtime (or the
//! bridge) executes it, with and without its lease service, against real
//! sled databases, next to Debian's reference host-local.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;
use std::sync::Barrier;
use std::time::Duration;

use serde_json::{Value, json};
use test_kit::leases::{Ipam, NETWORK, SmallFs, address, v4_conf};
use test_kit::{LeaseService, Node, Run, bin, fault_bin, finish, spawn_in, wait_for};

#[test]
fn results_in_every_version_with_routes_dns_and_dual_stack() {
    let ipam = Ipam::direct();
    let resolv = ipam.node.path("resolv.conf");
    fs::write(
        &resolv,
        "nameserver 10.96.0.10\nsearch svc.cluster.local\noptions ndots:5\n",
    )
    .expect("write");
    for (i, version) in ["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
        .into_iter()
        .enumerate()
    {
        let conf = ipam.conf(
            version,
            json!({"ranges": [[{"subnet": "10.20.0.0/24"}], [{"subnet": "fd20::/64"}]],
                   "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0", "gw": "fd20::1"}],
                   "resolvConf": resolv}),
        );
        let doc = ipam.add(&format!("c{i}"), &conf);
        assert_eq!(doc["cniVersion"], version);
        assert_eq!(
            doc["dns"],
            json!({"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"], "options": ["ndots:5"]})
        );
        let (v4, v6) = (format!("10.20.0.{}/24", i + 2), format!("fd20::{}/64", i + 2));
        match version {
            "0.1.0" | "0.2.0" => {
                assert_eq!(
                    doc["ip4"],
                    json!({"ip": v4, "gateway": "10.20.0.1", "routes": [{"dst": "0.0.0.0/0"}]}),
                    "{doc}"
                );
                assert_eq!(
                    doc["ip6"],
                    json!({"ip": v6, "gateway": "fd20::1", "routes": [{"dst": "::/0", "gw": "fd20::1"}]})
                );
            }
            "0.3.0" | "0.3.1" | "0.4.0" => {
                assert_eq!(
                    doc["ips"],
                    json!([
                    {"version": "4", "address": v4, "gateway": "10.20.0.1"},
                    {"version": "6", "address": v6, "gateway": "fd20::1"}]),
                    "{doc}"
                );
                assert!(doc.get("interfaces").is_none(), "IPAM results have no interfaces");
            }
            _ => assert_eq!(
                doc["ips"],
                json!([
                {"address": v4, "gateway": "10.20.0.1"}, {"address": v6, "gateway": "fd20::1"}]),
                "{doc}"
            ),
        }
    }
}

#[test]
fn configuration_errors_carry_the_reference_messages() {
    let ipam = Ipam::direct();
    let cases = [
        (
            json!({"cniVersion": "1.0.0", "name": NETWORK}).to_string(),
            "IPAM config missing 'ipam' key",
        ),
        (ipam.conf("1.0.0", json!({})), "no IP ranges specified"),
        (
            ipam.conf("1.0.0", json!({"subnet": "10.0.0.0/31"})),
            "invalid range set 0: Network 10.0.0.0/31 too small to allocate from",
        ),
        (
            ipam.conf("1.0.0", json!({"subnet": "10.0.0.9/24"})),
            "invalid range set 0: Network has host bits set. For a subnet mask of length 24 the network address is 10.0.0.0",
        ),
        (
            ipam.conf(
                "1.0.0",
                json!({"ranges": [[{"subnet": "10.0.0.0/16"}], [{"subnet": "10.0.1.0/24"}]]}),
            ),
            "range set 0 overlaps with 1",
        ),
        (
            ipam.conf(
                "0.2.0",
                json!({"ranges": [[{"subnet": "10.0.0.0/24"}], [{"subnet": "10.1.0.0/24"}]]}),
            ),
            "CNI version 0.2.0 does not support more than 1 address per family",
        ),
        (
            ipam.conf("1.0.0", json!({"subnet": "10.0.0.0/24", "gateway": "10.9.0.1"})),
            "invalid range set 0: gateway 10.9.0.1 not in network 10.0.0.0/24",
        ),
    ];
    for (conf, msg) in cases {
        let failed = ipam.run("ADD", "c1", &conf, &[]).failure();
        let err = failed.json();
        assert_eq!(
            (err["code"].as_u64(), err["msg"].as_str()),
            (Some(7), Some(msg)),
            "{failed:?}"
        );
    }
    let unreadable = ipam.conf(
        "1.0.0",
        json!({"subnet": "10.0.0.0/24", "resolvConf": "/nonexistent/resolv.conf"}),
    );
    let failed = ipam.run("ADD", "c1", &unreadable, &[]).failure().json();
    assert_eq!(failed["code"], 5, "{failed}");
    assert!(
        !ipam.data_dir.join(".sled").exists(),
        "no failed ADD opened a database"
    );
}

#[test]
fn requested_addresses_follow_conventions_precedence() {
    let ipam = Ipam::direct();
    let conf_with = |runtime: Value, args: Value| {
        let mut doc: Value = serde_json::from_str(&v4_conf(&ipam, "1.0.0", "10.30.0.0/24")).expect("json");
        doc["runtimeConfig"] = runtime;
        doc["args"] = json!({"cni": args});
        doc.to_string()
    };
    let all = conf_with(json!({"ips": ["10.30.0.9/24"]}), json!({"ips": ["10.30.0.8"]}));
    let run = ipam
        .run(
            "ADD",
            "a",
            &all,
            &[("CNI_ARGS", "IgnoreUnknown=1;IP=10.30.0.7;K8S_POD_NAME=p")],
        )
        .success();
    assert_eq!(address(&run.json()), "10.30.0.9/24", "runtimeConfig.ips wins");
    let args = conf_with(json!({}), json!({"ips": ["10.30.0.8"]}));
    let run = ipam
        .run("ADD", "b", &args, &[("CNI_ARGS", "IP=10.30.0.7")])
        .success();
    assert_eq!(address(&run.json()), "10.30.0.8/24", "args.cni.ips over CNI_ARGS");
    let plain = conf_with(json!({}), json!({}));
    let run = ipam
        .run("ADD", "c", &plain, &[("CNI_ARGS", "IP=10.30.0.7")])
        .success();
    assert_eq!(address(&run.json()), "10.30.0.7/24");
    let strict = ipam
        .run("ADD", "d", &plain, &[("CNI_ARGS", "IP=10.30.0.6;K8S_POD_NAME=p")])
        .failure();
    let err = strict.json();
    assert_eq!(err["code"], 4, "{strict:?}");
    assert!(
        err["msg"]
            .as_str()
            .is_some_and(|m| m.starts_with("ARGS: unknown args")),
        "{err}"
    );
    let taken = ipam
        .run("ADD", "e", &plain, &[("CNI_ARGS", "IP=10.30.0.7")])
        .failure();
    assert_eq!(
        taken.json()["msg"],
        "failed to allocate for range 0: requested IP address 10.30.0.7 is not available in range set 10.30.0.1-10.30.0.254"
    );
}

#[test]
fn exhaustion_status_and_release() {
    let ipam = Ipam::direct();
    let conf = v4_conf(&ipam, "1.1.0", "10.40.0.0/29");
    for id in ["a", "b", "c", "d", "e"] {
        ipam.add(id, &conf);
    }
    let full = ipam.run("ADD", "f", &conf, &[]).failure().json();
    assert_eq!(full["code"], 103);
    assert_eq!(
        full["msg"],
        "failed to allocate for range 0: no IP addresses available in range set: 10.40.0.1-10.40.0.6"
    );
    // Answered 0, as the reference v1.9.1 answers: containerd 2.1+ takes
    // any STATUS error for NetworkReady=false, and the node's pods would
    // be evicted for a range that only refuses new ones. Logged.
    let status = ipam.run("STATUS", "", &conf, &[]).success();
    assert!(
        status
            .stderr
            .contains("no IP addresses available in range set: 10.40.0.1-10.40.0.6"),
        "{status:?}"
    );
    ipam.run("DEL", "c", &conf, &[]).success();
    let status = ipam.run("STATUS", "", &conf, &[]).success();
    assert!(!status.stderr.contains("no IP addresses"), "{status:?}");
    assert_eq!(address(&ipam.add("f", &conf)), "10.40.0.4/29");
}

/// The same through a lease service, whose log is the request's
/// `logFile`; and STATUS still fails where no ADD can work.
#[test]
fn status_on_a_full_range_answers_0_through_the_service_and_fails_without_a_store() {
    let node = Node::new();
    let service = LeaseService::start(&bin("host-local"), node.path("hl.sock"), &[]);
    let ipam = Ipam::with_service(&service, node);
    let log_file = ipam.node.path("status.log");
    let mut conf: Value = serde_json::from_str(&v4_conf(&ipam, "1.1.0", "10.41.0.0/30")).expect("JSON");
    conf["logFile"] = json!(log_file.to_str().expect("UTF-8"));
    let conf = conf.to_string();
    // A /30 holds one address besides its gateway.
    ipam.add("a", &conf);
    assert_eq!(ipam.run("ADD", "b", &conf, &[]).failure().json()["code"], 103);
    ipam.run("STATUS", "", &conf, &[]).success();
    let logged = fs::read_to_string(&log_file).unwrap_or_default();
    assert!(
        logged.contains("STATUS: no IP addresses available in range set: 10.41.0.1-10.41.0.2"),
        "{logged}"
    );

    let blocked = ipam.node.path("blocked");
    fs::write(&blocked, "").expect("write");
    let unusable = ipam.conf(
        "1.1.0",
        json!({"subnet": "10.41.0.0/30", "dataDir": blocked.join("data").to_str().expect("UTF-8")}),
    );
    let refused = ipam.run("STATUS", "", &unusable, &[]).failure().json();
    assert_ne!(refused["code"], 0, "{refused}");
    assert_eq!(
        ipam.run("ADD", "c", &unusable, &[]).failure().json()["code"],
        refused["code"],
        "STATUS fails as an ADD would"
    );
}

#[test]
fn del_needs_no_netns_and_tolerates_unknown_containers() {
    let ipam = Ipam::direct();
    let conf = v4_conf(&ipam, "0.4.0", "10.50.0.0/24");
    ipam.add("a", &conf);
    let mut env = BTreeMap::from([
        ("CNI_COMMAND", "DEL"),
        ("CNI_CONTAINERID", "a"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/nonexistent"),
    ]);
    ipam.node.exec_plugin("host-local", &env, &conf).success();
    assert!(ipam.leases().is_empty());
    env.insert("CNI_CONTAINERID", "never-seen");
    ipam.node.exec_plugin("host-local", &env, &conf).success();
    let broken = ipam.conf("0.4.0", json!({"subnet": "10.50.0.0/33"}));
    assert_eq!(
        ipam.node
            .exec_plugin("host-local", &env, &broken)
            .failure()
            .json()["code"],
        7
    );
    let repeated = ipam.add("b", &conf);
    assert_eq!(
        ipam.add("b", &conf),
        repeated,
        "a repeated ADD answers with the same lease"
    );
}

#[test]
fn check_compares_the_lease_with_prev_result() {
    let ipam = Ipam::direct();
    let conf = v4_conf(&ipam, "1.0.0", "10.60.0.0/24");
    let result = ipam.add("a", &conf);
    let with_prev = |prev: &Value| {
        let mut doc: Value = serde_json::from_str(&conf).expect("json");
        doc["prevResult"] = prev.clone();
        doc.to_string()
    };
    ipam.run("CHECK", "a", &with_prev(&result), &[]).success();
    let mut wrong = result.clone();
    wrong["ips"][0]["address"] = json!("10.60.0.99/24");
    let failed = ipam.run("CHECK", "a", &with_prev(&wrong), &[]).failure().json();
    assert_eq!(failed["code"], 100);
    let unknown = ipam.run("CHECK", "zz", &with_prev(&result), &[]).failure().json();
    assert_eq!(
        unknown["msg"],
        "host-local: Failed to find address added by container zz"
    );
}

#[test]
fn gc_with_and_without_valid_attachments() {
    let ipam = Ipam::direct();
    let conf = v4_conf(&ipam, "1.1.0", "10.70.0.0/24");
    for id in ["a", "b", "c"] {
        ipam.add(id, &conf);
    }
    let mut doc: Value = serde_json::from_str(&conf).expect("json");
    doc["cni.dev/valid-attachments"] = json!([{"containerID": "b", "ifname": "eth0"}]);
    ipam.run("GC", "", &doc.to_string(), &[]).success();
    let owners: Vec<Value> = ipam.leases().iter().map(|l| l["containerID"].clone()).collect();
    assert_eq!(owners, [json!("b")]);
    doc.as_object_mut().map(|d| d.remove("cni.dev/valid-attachments"));
    doc["cni.dev/attachments"] = json!([{"containerID": "b", "ifname": "eth0"}]);
    ipam.run("GC", "", &doc.to_string(), &[]).success();
    assert_eq!(ipam.leases().len(), 1, "the legacy key is honoured too");
    ipam.run("GC", "", &conf, &[]).success();
    assert!(ipam.leases().is_empty(), "no list: nothing is valid");
}

/// Starts `count` ADDs (then DELs) at the same moment.
fn burst(ipam: &Ipam, command: &str, count: usize, conf: &str) -> Vec<Run> {
    let barrier = Barrier::new(count);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..count)
            .map(|i| {
                let barrier = &barrier;
                s.spawn(move || {
                    let id = format!("burst-{i}");
                    barrier.wait();
                    ipam.run(command, &id, conf, &[])
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread")).collect()
    })
}

/// 200 ADDs released at once on one network, then 200 DELs: distinct
/// addresses, all of them held, then none.
fn two_hundred_parallel(ipam: &Ipam) {
    const COUNT: usize = 200;
    let conf = v4_conf(ipam, "1.0.0", "10.80.0.0/24");
    let added = burst(ipam, "ADD", COUNT, &conf);
    let addresses: BTreeSet<String> = added.into_iter().map(|r| address(&r.success().json())).collect();
    assert_eq!(addresses.len(), COUNT, "distinct addresses");
    assert_eq!(
        ipam.leased_ips(),
        addresses
            .iter()
            .map(|a| a.trim_end_matches("/24").to_owned())
            .collect()
    );
    for run in burst(ipam, "DEL", COUNT, &conf) {
        run.success();
    }
    assert!(ipam.leases().is_empty(), "parallel DELs leave no lease");
}

#[test]
fn two_hundred_processes_at_once_without_the_service() {
    two_hundred_parallel(&Ipam::direct());
}

#[test]
fn two_hundred_processes_at_once_through_the_service() {
    let node = Node::new();
    let service = LeaseService::start(&bin("host-local"), node.path("hl.sock"), &[]);
    two_hundred_parallel(&Ipam::with_service(&service, node));
}

/// Runs the fault-injection build's ADD until it pauses at `point`, kills
/// it, and returns the ID it used.
fn kill_inside(ipam: &Ipam, point: &str, conf: &str) -> String {
    let name = point.replace(':', "-");
    let ready = ipam.node.path(&format!("ready-{name}"));
    let id = format!("killed-{name}");
    let env = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", id.as_str()),
        ("CNI_IFNAME", "eth0"),
        ("CNI_NETNS", "/var/run/netns/unused"),
        ("CNI_PATH", "/nonexistent"),
        ("CNI_SUITE_FAULT_PAUSE", point),
        ("CNI_SUITE_FAULT_READY", ready.to_str().expect("UTF-8")),
    ];
    let mut child = spawn_in(ipam.node.netns.path(), &fault_bin(), &[], &env, conf);
    wait_for(
        "the ADD to pause inside the lock",
        Duration::from_secs(20),
        || ready.exists(),
    );
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    id
}

fn assert_no_duplicates(ipam: &Ipam) {
    let leases = ipam.leases();
    let distinct: BTreeSet<&str> = leases.iter().filter_map(|l| l["ip"].as_str()).collect();
    assert_eq!(
        distinct.len(),
        leases.len(),
        "an address is leased twice: {leases:?}"
    );
}

#[test]
fn a_process_killed_inside_the_lock_loses_nothing() {
    let ipam = Ipam::direct();
    let conf = v4_conf(&ipam, "1.0.0", "10.90.0.0/24");
    let first = address(&ipam.add("before", &conf));
    for point in ["host-local:locked", "host-local:committed"] {
        let killed = kill_inside(&ipam, point, &conf);
        let after = address(&ipam.add(&format!("after-{}", point.replace(':', "-")), &conf));
        assert_ne!(after, first);
        let leases = ipam.leases();
        assert!(
            leases
                .iter()
                .any(|l| l["containerID"] == "before" && l["ip"] == first.trim_end_matches("/24"))
        );
        if point == "host-local:locked" {
            assert!(
                !leases.iter().any(|l| l["containerID"] == killed.as_str()),
                "nothing was written before the kill"
            );
        }
        assert_no_duplicates(&ipam);
        // The runtime retries the killed ADD: it gets one lease, never two.
        ipam.add(&killed, &conf);
        assert_eq!(
            ipam.leases()
                .iter()
                .filter(|l| l["containerID"] == killed.as_str())
                .count(),
            1
        );
        assert_no_duplicates(&ipam);
    }
}

/// One configuration's `logLevel`/`logFile` hold for its own request in the
/// lease service: adopted by the service, they would send every later
/// request's records, from any network, into that pod's file.
#[test]
fn a_request_does_not_change_where_the_service_logs() {
    let node = Node::new();
    let service = LeaseService::start(&bin("host-local"), node.path("hl.sock"), &[]);
    let ipam = Ipam::with_service(&service, node);
    let log_file = ipam.node.path("pod.log");
    let quiet = v4_conf(&ipam, "1.0.0", "10.31.0.0/24");
    let mut chatty: Value = serde_json::from_str(&quiet).expect("JSON");
    chatty["logLevel"] = json!("debug");
    chatty["logFile"] = json!(log_file.to_str().expect("UTF-8"));
    ipam.add("chatty", &chatty.to_string());
    ipam.add("quiet", &quiet);
    ipam.run("DEL", "quiet", &quiet, &[]).success();
    let logged = fs::read_to_string(&log_file).unwrap_or_default();
    let service_records = format!(
        "host-local[{}]: ADD container=chatty",
        service.pid().expect("running")
    );
    assert!(logged.contains(&service_records), "{logged}");
    assert!(!logged.contains("container=quiet"), "{logged}");
}

#[test]
fn a_service_killed_mid_request_hands_over_to_direct_use() {
    let node = Node::new();
    let ready = node.path("service-paused");
    let mut service = LeaseService::start(
        &fault_bin(),
        node.path("hl.sock"),
        &[
            ("CNI_SUITE_FAULT_PAUSE", "host-local:committed"),
            ("CNI_SUITE_FAULT_READY", ready.to_str().expect("UTF-8")),
        ],
    );
    let ipam = Ipam::with_service(&service, node);
    let conf = v4_conf(&ipam, "1.0.0", "10.91.0.0/24");
    let env = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "pod-a"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_NETNS", "/x"),
        ("CNI_PATH", "/nonexistent"),
    ];
    let client = spawn_in(ipam.node.netns.path(), &bin("host-local"), &[], &env, &conf);
    wait_for(
        "the service to pause inside the lock",
        Duration::from_secs(20),
        || ready.exists(),
    );
    service.kill();
    let run = finish("host-local ADD", client).success();
    assert_eq!(
        address(&run.json()),
        "10.91.0.2/24",
        "the client finished the ADD itself"
    );
    assert_eq!(ipam.leases().len(), 1);
    assert_no_duplicates(&ipam);
}

/// Leases written by Debian's Go host-local.
fn reference_add(ipam: &Ipam, id: &str, conf: &str) -> Value {
    let env = BTreeMap::from([
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", id),
        ("CNI_IFNAME", "eth0"),
        ("CNI_NETNS", "/var/run/netns/unused"),
        ("CNI_PATH", "/usr/lib/cni"),
    ]);
    test_kit::run_in(
        ipam.node.netns.path(),
        Path::new("/usr/lib/cni/host-local"),
        &[],
        &env.into_iter().collect::<Vec<_>>(),
        conf,
    )
    .success()
    .json()
}

#[test]
fn a_node_migrated_from_the_reference_plugin_keeps_its_leases() {
    let ipam = Ipam::direct();
    let conf = v4_conf(&ipam, "1.0.0", "10.100.0.0/28");
    let held: Vec<String> = ["ref-a", "ref-b", "ref-c"]
        .iter()
        .map(|id| address(&reference_add(&ipam, id, &conf)))
        .collect();
    assert_eq!(held, ["10.100.0.2/28", "10.100.0.3/28", "10.100.0.4/28"]);
    let ref_dir = ipam.data_dir.join(NETWORK);
    // A lease in the pre-0.8.0 format (container ID only).
    fs::write(ref_dir.join("10.100.0.9"), "ref-legacy").expect("write");

    let listed = ipam.leases();
    let owners: Vec<(&str, &str)> = listed
        .iter()
        .map(|l| {
            (
                l["ip"].as_str().unwrap_or(""),
                l["containerID"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        owners,
        [
            ("10.100.0.2", "ref-a"),
            ("10.100.0.3", "ref-b"),
            ("10.100.0.4", "ref-c"),
            ("10.100.0.9", "ref-legacy")
        ]
    );
    assert!(listed.iter().all(|l| l["source"] == "reference"));

    assert_eq!(
        address(&ipam.add("new-1", &conf)),
        "10.100.0.5/28",
        "continues after the reference's last reservation"
    );
    assert_eq!(
        address(&ipam.add("ref-b", &conf)),
        "10.100.0.3/28",
        "a migrated pod's repeated ADD gets its address"
    );
    ipam.run("DEL", "ref-a", &conf, &[]).success();
    assert!(
        !ref_dir.join("10.100.0.2").exists(),
        "the released lease's file is gone"
    );
    ipam.run("DEL", "ref-legacy", &conf, &[]).success();
    let remaining: BTreeSet<String> = ipam.leased_ips();
    assert_eq!(
        remaining,
        BTreeSet::from([
            "10.100.0.3".to_owned(),
            "10.100.0.4".to_owned(),
            "10.100.0.5".to_owned()
        ])
    );
    for id in ["n2", "n3", "n4", "n5", "n6", "n7", "n8"] {
        let got = address(&ipam.add(id, &conf));
        assert!(
            !["10.100.0.3/28", "10.100.0.4/28", "10.100.0.5/28"].contains(&got.as_str()),
            "{id} got a held address {got}"
        );
    }
    assert_no_duplicates(&ipam);
    assert!(ref_dir.join("lock").exists(), "both plugins lock the same file");
}

#[test]
fn cnictl_ipam_inspects_and_repairs() {
    let node = Node::new();
    let service = LeaseService::start(&bin("host-local"), node.path("hl.sock"), &[]);
    let ipam = Ipam::with_service(&service, node);
    let conf = v4_conf(&ipam, "1.0.0", "10.110.0.0/24");
    for id in ["a", "b", "c", "d"] {
        ipam.add(id, &conf);
    }
    let cnictl = |args: &[&str]| {
        let mut full = vec![
            "ipam",
            "--data-dir",
            ipam.data_dir(),
            "--socket",
            ipam.socket.as_str(),
        ];
        full.extend_from_slice(args);
        ipam.node.cnictl(&full)
    };
    // As ipam/host-local/README.md says of the layout: the reference's directory and its
    // `lock`, and no per-address file; leases are read with `ls`.
    let mut files: Vec<String> = std::fs::read_dir(std::path::Path::new(ipam.data_dir()).join(NETWORK))
        .expect("the network's directory")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["lock"]);
    let table = cnictl(&["ls", NETWORK]).success();
    assert!(table.stdout.starts_with("IP"), "{table:?}");
    assert!(
        table.stdout.contains("10.110.0.2") && table.stdout.contains("4 lease(s)"),
        "{table:?}"
    );
    let listed = ipam.leases();
    let keys: Vec<&String> = listed[0]
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    for key in ["ip", "containerID", "ifname", "allocated"] {
        assert!(keys.iter().any(|k| k.as_str() == key), "{key} in {keys:?}");
    }
    assert!(
        listed[0]["allocated"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z') && t.contains('T'))
    );

    cnictl(&["release", NETWORK, "--ip", "10.110.0.2"]).success();
    cnictl(&["release", NETWORK, "--container-id", "b", "--ifname", "eth0"]).success();
    assert_eq!(
        ipam.leased_ips(),
        BTreeSet::from(["10.110.0.4".to_owned(), "10.110.0.5".to_owned()])
    );
    cnictl(&["gc", NETWORK]).failure();
    cnictl(&["gc", NETWORK, "--valid", "d/eth0"]).success();
    assert_eq!(ipam.leased_ips(), BTreeSet::from(["10.110.0.5".to_owned()]));

    let export = cnictl(&["export", NETWORK]).success().json();
    assert_eq!(export["network"], NETWORK);
    assert_eq!(export["leases"][0]["containerID"], "d");
    assert_eq!(export["lastReserved"]["0"], "10.110.0.5");

    let backup = ipam.node.path("reference-copy");
    fs::create_dir(&backup).expect("mkdir");
    fs::write(backup.join("10.110.0.77"), "restored\r\neth1").expect("write");
    let imported = cnictl(&[
        "--json",
        "import",
        NETWORK,
        "--from-reference-dir",
        backup.to_str().expect("UTF-8"),
    ])
    .success()
    .json();
    assert_eq!(imported["imported"][0]["ip"], "10.110.0.77");
    assert!(ipam.leased_ips().contains("10.110.0.77"));
    drop(service);
    // Without the service, the same commands open the database directly.
    let direct = Ipam {
        node: ipam.node,
        data_dir: ipam.data_dir.clone(),
        socket: String::new(),
    };
    assert_eq!(direct.leased_ips().len(), 2);
}

/// systemd's socket activation: the socket bound and listened on by
/// another process (whose pid the socket's credentials keep naming), passed
/// to the forked service as fd 3 with LISTEN_FDS and LISTEN_PID naming the
/// service process. The starter prints the service's pid, hands it a
/// SIGTERM and exits when it does.
const SOCKET_ACTIVATE: &str = r#"
import os, signal, socket, sys
path, binary = sys.argv[1], sys.argv[2]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
os.chmod(path, 0o600)
listener.listen(64)
child = os.fork()
if child == 0:
    os.dup2(listener.fileno(), 3)
    os.set_inheritable(3, True)
    env = dict(os.environ, LISTEN_FDS="1", LISTEN_PID=str(os.getpid()))
    os.execve(binary, [binary, "serve"], env)
listener.close()
print(child, flush=True)
signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
os.waitpid(child, 0)
"#;

/// A host-local service started by socket activation at `socket`, stopped
/// (SIGTERM, as systemd stops it) when dropped.
struct Activated {
    starter: std::process::Child,
    service_pid: u32,
}

impl Activated {
    fn start(socket: &Path) -> Self {
        use std::io::BufRead;
        let binary = bin("host-local");
        let mut starter = std::process::Command::new("python3")
            .args([
                "-c",
                SOCKET_ACTIVATE,
                socket.to_str().expect("UTF-8"),
                binary.to_str().expect("UTF-8"),
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("python3 runs");
        let mut line = String::new();
        let stdout = starter.stdout.take().expect("piped");
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the service's pid");
        let service_pid = line.trim().parse().expect("a pid");
        Activated { starter, service_pid }
    }

    /// Stops the service and returns what it logged.
    fn stop(mut self) -> String {
        self.terminate();
        let mut text = String::new();
        if let Some(mut pipe) = self.starter.stderr.take() {
            use std::io::Read;
            pipe.read_to_string(&mut text).ok();
        }
        text
    }

    fn terminate(&mut self) {
        let pid = self.starter.id().to_string();
        let _ = std::process::Command::new("kill").args(["-TERM", &pid]).status();
        let _ = self.starter.wait();
    }

    /// Whether the service process holds `file` open.
    fn holds_open(&self, file: &Path) -> bool {
        fs::read_dir(format!("/proc/{}/fd", self.service_pid))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| fs::read_link(fd.path()).is_ok_and(|target| target == file))
    }
}

impl Drop for Activated {
    fn drop(&mut self) {
        if self.starter.try_wait().ok().flatten().is_none() {
            self.terminate();
        }
    }
}

#[test]
fn the_service_accepts_a_socket_from_the_service_manager() {
    let node = Node::new();
    let socket = node.path("activated.sock");
    let activated = Activated::start(&socket);
    let ipam = Ipam::with_socket(node, &socket);
    let conf = v4_conf(&ipam, "1.0.0", "10.120.0.0/24");
    assert_eq!(address(&ipam.add("a", &conf)), "10.120.0.2/24");
    let stderr = activated.stop();
    assert!(
        stderr.contains("listening on the socket passed by the service manager"),
        "{stderr}"
    );
}

/// The shipped systemd unit listens on the default data directory's own
/// socket: a configuration with no `socket` key (and one with `""`) is
/// served there, by the service holding the database, the socket file
/// systemd made left in place (not taken over, so activation keeps working
/// after the service stops).
#[test]
fn systemds_socket_at_the_data_directory_serves_it() {
    let node = Node::new();
    let data_dir = node.path("data");
    let socket = ipam_config::lease_settings::data_dir_socket(&data_dir);
    let parent = socket.parent().expect("in .sled");
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(parent)
        .expect("systemd's DirectoryMode=0700");
    let activated = Activated::start(&socket);
    let made_by_systemd = fs::symlink_metadata(&socket).expect("the socket").ino();
    let ipam = Ipam {
        node,
        data_dir: data_dir.clone(),
        socket: String::new(),
    };
    let mut unset: Value = serde_json::from_str(&v4_conf(&ipam, "1.0.0", "10.121.0.0/24")).expect("JSON");
    unset["ipam"].as_object_mut().expect("ipam").remove("socket");
    assert_eq!(address(&ipam.add("a", &unset.to_string())), "10.121.0.2/24");
    let db = data_dir.join(".sled").join(NETWORK).join("db");
    assert!(
        activated.holds_open(&db),
        "the activated service keeps {}",
        db.display()
    );
    let off = v4_conf(&ipam, "1.0.0", "10.121.0.0/24");
    assert_eq!(address(&ipam.add("b", &off)), "10.121.0.3/24");
    assert_eq!(
        fs::symlink_metadata(&socket).expect("the socket").ino(),
        made_by_systemd
    );
    let stderr = activated.stop();
    assert!(!stderr.contains("is served by the lease service at"), "{stderr}");
}

/// A database that lost committed leases (here its snapshot is gone and its
/// log truncated, which sled opens as empty without a word) is refused with
/// code 5, its path and the way out, instead of handing out an address
/// that a pod already holds.
#[test]
fn a_damaged_database_is_refused_and_never_reset() {
    let ipam = Ipam::direct();
    let conf = v4_conf(&ipam, "1.0.0", "10.63.0.0/24");
    assert_eq!(address(&ipam.add("c1", &conf)), "10.63.0.2/24");
    assert_eq!(address(&ipam.add("c2", &conf)), "10.63.0.3/24");
    let db = ipam.data_dir.join(".sled").join(NETWORK);
    for entry in fs::read_dir(&db).expect("sled's directory").flatten() {
        if entry.file_name().to_string_lossy().starts_with("snap.") {
            fs::remove_file(entry.path()).expect("rm snapshot");
        }
    }
    fs::File::options()
        .write(true)
        .open(db.join("db"))
        .and_then(|f| f.set_len(0))
        .expect("truncate");
    let refused = ipam.run("ADD", "c3", &conf, &[]).failure().json();
    assert_eq!(refused["code"], 5, "{refused}");
    let msg = refused["msg"].as_str().unwrap_or_default();
    assert!(msg.contains(&format!("{} is damaged", db.display())), "{msg}");
    let aside = ipam.data_dir.join(".sled/.damaged");
    assert!(
        msg.contains(&format!("mkdir -p {} && mv {} ", aside.display(), db.display())),
        "{msg}"
    );
    // DEL and CHECK are refused too: nothing works from a database that
    // forgot what it held.
    ipam.run("DEL", "c1", &conf, &[]).failure();
    // The way out the message gives, then a fresh start.
    fs::create_dir_all(&aside).expect("mkdir");
    fs::rename(&db, aside.join("1")).expect("mv");
    fs::remove_file(ipam.data_dir.join(".sled/.generations").join(NETWORK)).expect("rm");
    assert_eq!(address(&ipam.add("c3", &conf)), "10.63.0.2/24");
}

/// A data directory that is full or read-only: code 5 with the system's
/// reason, nothing half-written, and the next call works once the
/// filesystem is usable again, with no address handed out twice.
#[test]
fn a_full_or_read_only_data_dir_is_an_io_error_and_recovers() {
    let mut ipam = Ipam::direct();
    let small = SmallFs::mount(ipam.node.path("small"), "256k");
    ipam.data_dir = small.path.clone();
    let conf = v4_conf(&ipam, "1.0.0", "10.64.0.0/24");
    let mut held = BTreeSet::new();
    let mut refused = None;
    for i in 0..50 {
        let run = ipam.run("ADD", &format!("c{i}"), &conf, &[]);
        if run.ok() {
            assert!(held.insert(address(&run.json())), "a duplicate address");
        } else {
            refused = Some(run.json());
            break;
        }
    }
    let refused = refused.expect("256 KiB fill up");
    assert_eq!(refused["code"], 5, "{refused}");
    assert!(
        refused["msg"]
            .as_str()
            .is_some_and(|m| m.contains("No space left on device")),
        "{refused}"
    );
    small.remount("size=16m");
    let more = ipam.add("after-full", &conf);
    assert!(
        held.insert(address(&more)),
        "a duplicate address after the disk filled"
    );
    assert_eq!(
        ipam.leased_ips().len(),
        held.len(),
        "what was answered is what is held"
    );

    small.remount("ro");
    let refused = ipam.run("ADD", "while-ro", &conf, &[]).failure().json();
    assert_eq!(refused["code"], 5, "{refused}");
    assert!(
        refused["msg"]
            .as_str()
            .is_some_and(|m| m.contains("Read-only file system")),
        "{refused}"
    );
    small.remount("rw");
    let after = ipam.add("after-ro", &conf);
    assert!(
        held.insert(address(&after)),
        "a duplicate address after read-only"
    );
    assert_eq!(ipam.leased_ips().len(), held.len());
}

/// Where a refused call's data directory is, made before the call.
#[derive(Debug, Clone, Copy)]
enum Place {
    /// Not made yet, as on a new node.
    Fresh,
    /// Below a regular file.
    UnderAFile,
    /// Made, with a regular file where the network's directory goes.
    NetworkIsAFile,
    /// Made, with a symlink to a directory where the network's directory goes.
    NetworkIsALink,
    /// Below a directory every user may write (no sticky bit).
    UnderAnOpenDirectory,
}

impl Place {
    /// Makes the place under `root`; returns the data directory.
    fn make(self, root: &Path, network: &str) -> std::path::PathBuf {
        let data_dir = root.join("data");
        match self {
            Place::Fresh => data_dir,
            Place::UnderAFile => {
                fs::write(root.join("file"), "").expect("write");
                root.join("file/data")
            }
            Place::NetworkIsAFile => {
                fs::create_dir(&data_dir).expect("mkdir");
                fs::write(data_dir.join(network), "").expect("write");
                data_dir
            }
            Place::NetworkIsALink => {
                fs::create_dir_all(root.join("elsewhere")).expect("mkdir");
                fs::create_dir(&data_dir).expect("mkdir");
                std::os::unix::fs::symlink(root.join("elsewhere"), data_dir.join(network)).expect("symlink");
                data_dir
            }
            Place::UnderAnOpenDirectory => {
                let open = root.join("open");
                fs::create_dir(&open).expect("mkdir");
                fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777))
                    .expect("chmod");
                open.join("data")
            }
        }
    }
}

/// Everything under `dir`: each path with its type (links not followed).
fn tree_of(dir: &Path) -> Vec<String> {
    let mut seen = Vec::new();
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        let kind = fs::symlink_metadata(&path).map(|m| m.file_type());
        seen.push(format!("{} {kind:?}", path.display()));
        if kind.is_ok_and(|k| k.is_dir()) {
            seen.extend(tree_of(&path));
        }
    }
    seen.sort();
    seen
}

/// One call host-local refuses without its lease store.
struct Refusal {
    what: &'static str,
    command: &'static str,
    name: String,
    version: &'static str,
    place: Place,
    /// Keys added to the `ipam` section.
    ipam: Value,
    /// Keys added at the top of the configuration.
    top: Value,
    env: Vec<(&'static str, String)>,
    code: u64,
}

impl Refusal {
    fn add(what: &'static str, code: u64) -> Self {
        Refusal {
            what,
            command: "ADD",
            name: "refused".into(),
            version: "1.0.0",
            place: Place::Fresh,
            ipam: json!({}),
            top: json!({}),
            env: Vec::new(),
            code,
        }
    }

    /// The configuration, as users write it: no `socket` key.
    fn conf(&self, binary: &str, data_dir: &Path) -> String {
        let mut ipam = json!({"type": "host-local", "dataDir": data_dir, "subnet": "10.66.0.0/24"});
        let mut conf = json!({"cniVersion": self.version, "name": self.name, "type": binary, "ipam": {}});
        if binary == "bridge" {
            conf["bridge"] = json!("cnirefused0");
        }
        if let (Some(section), Some(extra)) = (ipam.as_object_mut(), self.ipam.as_object()) {
            section.extend(extra.clone());
        }
        conf["ipam"] = ipam;
        if let (Some(top), Some(extra)) = (conf.as_object_mut(), self.top.as_object()) {
            top.extend(extra.clone());
        }
        conf.to_string()
    }
}

fn refusals(node_netns: &str) -> Vec<Refusal> {
    let with = |mut refusal: Refusal, change: &dyn Fn(&mut Refusal)| {
        change(&mut refusal);
        refusal
    };
    let add = Refusal::add;
    vec![
        with(add("a 300-character network name", 5), &|r| {
            r.name = "n".repeat(300)
        }),
        with(add("a 256-character network name", 5), &|r| {
            r.name = "n".repeat(256)
        }),
        with(add("args.cni.ips outside every range", 103), &|r| {
            r.top = json!({"args": {"cni": {"ips": ["10.8.0.5"]}}})
        }),
        with(add("runtimeConfig.ips: the gateway", 103), &|r| {
            r.top = json!({"runtimeConfig": {"ips": ["10.66.0.1"]}})
        }),
        with(add("runtimeConfig.ips: two in one range set", 103), &|r| {
            r.top = json!({"runtimeConfig": {"ips": ["10.66.0.7", "10.66.0.8"]}})
        }),
        with(add("runtimeConfig.ips: not an address", 7), &|r| {
            r.top = json!({"runtimeConfig": {"ips": ["10.66.0.300"]}})
        }),
        with(add("CNI_ARGS IP outside every range", 103), &|r| {
            r.env = vec![("CNI_ARGS", "IgnoreUnknown=1;IP=10.8.0.5".into())]
        }),
        with(add("an unreadable resolvConf", 5), &|r| {
            r.ipam = json!({"resolvConf": "/nonexistent/resolv.conf"})
        }),
        with(add("a data directory below a file", 5), &|r| {
            r.place = Place::UnderAFile
        }),
        with(add("a file where the network's directory goes", 5), &|r| {
            r.place = Place::NetworkIsAFile
        }),
        with(add("a symlink where the network's directory goes", 5), &|r| {
            r.place = Place::NetworkIsALink
        }),
        with(add("a data directory others may change", 5), &|r| {
            r.place = Place::UnderAnOpenDirectory
        }),
        with(add("a range too small", 7), &|r| {
            r.ipam = json!({"subnet": "10.66.0.0/31"})
        }),
        with(
            add("overlapping ranges", 7),
            &|r| r.ipam = json!({"ranges": [[{"subnet": "10.66.0.0/24"}], [{"subnet": "10.66.0.0/25"}]]}),
        ),
        with(add("a gateway outside the subnet", 7), &|r| {
            r.ipam = json!({"gateway": "10.9.9.9"})
        }),
        with(add("an invalid CNI_CONTAINERID", 4), &|r| {
            r.env = vec![("CNI_CONTAINERID", "../x".into())]
        }),
        with(add("an invalid CNI_IFNAME", 4), &|r| {
            r.env = vec![("CNI_IFNAME", "a/b".into())]
        }),
        with(add("CNI_NETNS naming the plugin's own namespace", 8), &|r| {
            r.env = vec![("CNI_NETNS", node_netns.to_owned())]
        }),
        with(add("DEL with a 300-character network name", 5), &|r| {
            r.command = "DEL";
            r.name = "n".repeat(300);
        }),
        with(add("CHECK in version 0.3.1", 1), &|r| {
            r.command = "CHECK";
            r.version = "0.3.1";
        }),
        with(add("CHECK with a malformed prevResult", 7), &|r| {
            r.command = "CHECK";
            r.top = json!({"prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "x"}]}});
        }),
        with(add("GC with a malformed list of attachments", 7), &|r| {
            r.command = "GC";
            r.version = "1.1.0";
            r.top = json!({"cni.dev/valid-attachments": [{"containerID": 5}]});
        }),
        with(add("STATUS in version 1.0.0", 1), &|r| r.command = "STATUS"),
    ]
}

/// Every call host-local refuses without its lease store, made with
/// nothing configured (no `socket` key: the lease path that starts the data
/// directory's service), by host-local itself and, for ADD, by the bridge
/// with host-local as its IPAM: the refusal's code, and nothing changed on
/// the node: no lease service, no directory or file made. Before, a
/// 300-character network name (among others) started the data
/// directory's service and left `.sled/` and the process behind.
#[test]
fn a_refused_call_starts_no_lease_service_and_changes_nothing() {
    let node = Node::new();
    let pod = node.pod("refused-pod");
    let bins = test_kit::bin_dir();
    let mut failures = Vec::new();
    let mut ran = 0;
    for (index, refusal) in refusals(node.netns.path_str()).iter().enumerate() {
        for binary in ["host-local", "bridge"] {
            if binary == "bridge" && refusal.command != "ADD" {
                continue;
            }
            ran += 1;
            let root = node.path(&format!("{binary}-{index}"));
            fs::create_dir(&root).expect("mkdir");
            let data_dir = refusal.place.make(&root, &refusal.name);
            let before = tree_of(&root);
            let mut env = BTreeMap::from([
                ("CNI_COMMAND", refusal.command.to_owned()),
                ("CNI_CONTAINERID", format!("refused-{index}")),
                ("CNI_IFNAME", "eth0".to_owned()),
                ("CNI_NETNS", pod.path_str().to_owned()),
                ("CNI_PATH", bins.to_str().expect("UTF-8").to_owned()),
            ]);
            if matches!(refusal.command, "GC" | "STATUS") {
                env.retain(|k, _| !matches!(*k, "CNI_CONTAINERID" | "CNI_IFNAME" | "CNI_NETNS"));
            }
            env.extend(refusal.env.iter().cloned());
            let env: BTreeMap<&str, &str> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let run = node.exec_plugin(binary, &env, &refusal.conf(binary, &data_dir));
            let answer = if run.ok() {
                Err(format!("succeeded: {}", run.stdout))
            } else {
                let doc = run.json();
                (doc["code"] == refusal.code)
                    .then_some(())
                    .ok_or_else(|| format!("code {} instead of {}: {doc}", doc["code"], refusal.code))
            };
            let services = test_kit::services_under(&root);
            let after = tree_of(&root);
            let outcome = answer.and_then(|()| {
                if !services.is_empty() {
                    Err(format!("lease services {services:?} left running"))
                } else if after != before {
                    Err(format!("the data directory changed: {before:?} -> {after:?}"))
                } else {
                    Ok(())
                }
            });
            if let Err(why) = outcome {
                failures.push(format!("{binary} {}: {}: {why}", refusal.command, refusal.what));
            }
        }
    }
    // The configuration every case departs from works, and goes the way
    // that starts a service: each case is refused for the one thing it
    // changed, on the path where a service would have been started.
    for binary in ["host-local", "bridge"] {
        let root = node.path(&format!("{binary}-accepted"));
        let valid = Refusal::add("nothing", 0);
        let env = BTreeMap::from([
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "accepted"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", pod.path_str()),
            ("CNI_PATH", bins.to_str().expect("UTF-8")),
        ]);
        node.exec_plugin(binary, &env, &valid.conf(binary, &root.join("data")))
            .success();
        assert_eq!(test_kit::services_under(&root).len(), 1, "{binary}");
    }
    assert!(
        failures.is_empty(),
        "{} of {ran} refused calls went wrong:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A FIFO where the lease store keeps a file of its own (the started
/// service's log, the generation witness, sled's database file) answers
/// at once: before, opening it blocked for ever, holding the data
/// directory's start lock or the network's lock, and every later call of
/// the node behind it (only root can put one there: the directories are
/// 0700).
#[test]
fn a_fifo_in_the_lease_stores_place_holds_no_call() {
    const HUNG_AFTER: Duration = Duration::from_secs(10);
    let node = Node::new();
    let pod = node.pod("fifo-pod");
    let network = "fifonet";
    for (index, (place, succeeds)) in [
        (".sled/.service.log", true),
        (".sled/.generations/fifonet", false),
        (".sled/fifonet/db", false),
    ]
    .into_iter()
    .enumerate()
    {
        let data_dir = node.path(&format!("fifo-{index}"));
        let fifo = data_dir.join(place);
        let parent = fifo.parent().expect("parent");
        test_kit::run("install", &["-d", "-m", "0700", parent.to_str().expect("UTF-8")]).success();
        test_kit::run(
            "chmod",
            &["0700", data_dir.join(".sled").to_str().expect("UTF-8")],
        )
        .success();
        test_kit::mkfifo(&fifo);
        let conf = json!({"cniVersion": "1.0.0", "name": network, "type": "host-local",
                          "ipam": {"type": "host-local", "subnet": "10.67.0.0/24", "dataDir": data_dir}})
        .to_string();
        let env = [
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "fifo"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", pod.path_str()),
            ("CNI_PATH", "/nonexistent"),
        ];
        let what = format!("host-local ADD with a FIFO at {place}");
        let child = spawn_in(node.netns.path(), &bin("host-local"), &[], &env, &conf);
        let finished = test_kit::finish_within(&what, child, HUNG_AFTER);
        for pid in test_kit::services_under(&data_dir) {
            let _ = test_kit::run("kill", &["-KILL", &pid.to_string()]);
        }
        let run =
            finished.unwrap_or_else(|run| panic!("{what} did not return within {HUNG_AFTER:?}: {run:?}"));
        assert_eq!(run.ok(), succeeds, "{what}: {run:?}");
        if !succeeds {
            assert!(run.stdout.contains("not a regular file"), "{what}: {run:?}");
        }
    }
}
