//! Churn: pods added and deleted through bridge + host-local (through its
//! lease service, the shipped setup) by 16 workers at once, each address
//! checked against every live pod's the moment it is handed out. `make test`
//! runs 300 pods; `make soak` runs 1000 (CNI_SUITE_SOAK_PODS). Bounded in
//! time as well as count.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_kit::{LeaseService, Node, bin, bin_dir};

const NETWORK: &str = "soak-net";
const WORKERS: usize = 16;
const TIME_LIMIT: Duration = Duration::from_secs(600);

fn pods_wanted() -> usize {
    std::env::var("CNI_SUITE_SOAK_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

#[test]
fn churn_by_sixteen_workers_never_duplicates_and_leaves_nothing() {
    let _alone = super::alone();
    let node = Node::new();
    let service = LeaseService::start(&bin("host-local"), node.path("hl.sock"), &[]);
    let data_dir = node.path("ipam");
    let conf = |prev: Option<&Value>| {
        let mut conf = json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "bridge",
            "bridge": "cnisoak0", "isGateway": true, "ipMasq": true,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.66.0.0/24"}]],
                     "dataDir": data_dir, "socket": service.socket}});
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        conf.to_string()
    };
    let wanted = pods_wanted();
    let next = AtomicUsize::new(0);
    let live: Mutex<BTreeMap<String, String>> = Mutex::new(BTreeMap::new());
    let failures: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let started = Instant::now();
    let bins = bin_dir();
    std::thread::scope(|s| {
        for _ in 0..WORKERS {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= wanted || started.elapsed() > TIME_LIMIT {
                        break;
                    }
                    let pod = node.pod("churn");
                    let id = format!("churn-{i}");
                    let env = |command| {
                        BTreeMap::from([
                            ("CNI_COMMAND", command),
                            ("CNI_CONTAINERID", id.as_str()),
                            ("CNI_NETNS", pod.path_str()),
                            ("CNI_IFNAME", "eth0"),
                            ("CNI_PATH", bins.to_str().expect("UTF-8")),
                        ])
                    };
                    let added = node.exec_plugin("bridge", &env("ADD"), &conf(None));
                    if !added.ok() {
                        failures
                            .lock()
                            .expect("lock")
                            .push(format!("{id} ADD: {added:?}"));
                        continue;
                    }
                    let result = added.json();
                    let ip = result["ips"][0]["address"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    if let Some(holder) = live.lock().expect("lock").insert(ip.clone(), id.clone()) {
                        failures
                            .lock()
                            .expect("lock")
                            .push(format!("{ip} handed to {id} while {holder} holds it"));
                    }
                    // The pod holds its address while it lives (here: while
                    // the kernel is asked what eth0 has); it leaves the live
                    // set before DEL starts, since DEL may free it for the
                    // next ADD before it returns.
                    let shown = pod.ip(&["-o", "addr", "show", "eth0"]).stdout;
                    if !shown.contains(&format!(" {ip} ")) {
                        failures
                            .lock()
                            .expect("lock")
                            .push(format!("{id}: eth0 lacks {ip}: {shown}"));
                    }
                    live.lock().expect("lock").remove(&ip);
                    let deleted = node.exec_plugin("bridge", &env("DEL"), &conf(Some(&result)));
                    if !deleted.ok() {
                        failures
                            .lock()
                            .expect("lock")
                            .push(format!("{id} DEL: {deleted:?}"));
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().expect("lock");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let done = next.load(Ordering::Relaxed).min(wanted);
    assert_eq!(done, wanted, "only {done} of {wanted} pods within {TIME_LIMIT:?}");
    eprintln!(
        "soak: {wanted} pods by {WORKERS} workers in {:?}",
        started.elapsed()
    );
    let listed = node.lease_records(NETWORK, &data_dir, service.socket.to_str().expect("UTF-8"));
    assert!(listed.is_empty(), "leases left: {listed:?}");
    assert!(node.veths().is_empty(), "veths left: {:?}", node.veths());
    assert!(node.container_nat_chains().is_empty());
}
