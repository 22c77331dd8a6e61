//! The bridge's ADD and DEL with host-local, ours against the reference:
//! a first pod, pods one by one (`seq`), all at once (`burst`), in a /16
//! whose leases are already held (`full`), and loopback's.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_kit::Netns;
use test_kit::leases::addresses;

use crate::measure::{Call, ms};
use crate::outcome::{Outcome, check_calls, cpu_ms};
use crate::setup::{STARTED_PREFIX, Setup, Side};
use crate::suite::{Suite, check_leaks, interleaved, nth_address, pods};

fn duplicates(addresses: &[String]) -> Vec<String> {
    let mut seen = BTreeSet::new();
    addresses.iter().filter(|a| !seen.insert(*a)).cloned().collect()
}

/// The IPv4 address on a pod's eth0, as the kernel has it.
fn pod_address(pod: &Netns) -> Option<String> {
    let shown = pod.ip(&["-4", "-o", "addr", "show", "eth0"]).stdout;
    shown
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .map(str::to_owned)
}

/// One ADD and DEL per suite before anything is measured: the first pod
/// makes the bridge and the subnet's masquerade in every suite, and in the
/// drop-in setup host-local starts its lease service. Those first ADDs are
/// reported apart (`first ADD`), ours against the reference's own first.
pub(crate) fn warm_up(out: &mut Outcome, suites: &[Suite]) {
    // `make bench` builds right before: the disk is still writing back
    // hundreds of megabytes, and a first ADD, which makes a new lease
    // database durable, waited behind it (76.8 ms against 19.8 in the run
    // before, after a rebuild of this program). A node starting pods has
    // no such build behind it.
    // SAFETY: sync(2) has no preconditions and cannot fail.
    unsafe { libc::sync() };
    for suite in suites {
        let pod = Netns::new("first");
        let add = suite.call("bridge", "ADD", "first", pod.path_str(), &suite.bridge_conf(None));
        let result: Value = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
        let del = suite.bridge_del("first", pod.path_str(), &result);
        check_calls(out, "first ADD and DEL", suite.setup, &[add.clone(), del]);
        if suite.setup == Setup::DropIn && suite.service_pid().is_none() {
            out.problem("the drop-in setup's first ADD started no lease service".into());
        }
        out.record(&suite.metric("first ADD"), suite.side(), ms(add.wall));
    }
}

/// Pods added one by one so they accumulate, then deleted one by one,
/// each DEL beside its floor on the same bridge; the suites alternate
/// call by call.
pub(crate) fn seq(out: &mut Outcome, suites: &[Suite], n: usize) {
    let pods: Vec<Vec<Netns>> = suites.iter().map(|_| pods(n, "seq")).collect();
    let mut results: Vec<Vec<Value>> = vec![Vec::new(); suites.len()];
    let mut adds: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    let mut dels: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    let mut floors: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    let cpu_before: Vec<Duration> = suites.iter().map(Suite::service_cpu).collect();
    for (i, s) in interleaved(n, suites.len()) {
        let suite = &suites[s];
        let (call, started) = suite.noting_start(|| {
            suite.call(
                "bridge",
                "ADD",
                &format!("seq-{i}"),
                pods[s][i].path_str(),
                &suite.bridge_conf(None),
            )
        });
        results[s].push(serde_json::from_str(&call.stdout).unwrap_or(Value::Null));
        check_calls(out, "seq ADD", suite.setup, std::slice::from_ref(&call));
        if started {
            out.record(&format!("{STARTED_PREFIX}seq ADD"), Side::Ours, ms(call.wall));
        } else {
            adds[s].push(call);
        }
    }
    let cpu_mid: Vec<Duration> = suites.iter().map(Suite::service_cpu).collect();
    let mut floor_pods = Vec::new();
    for (i, s) in interleaved(n, suites.len()) {
        let suite = &suites[s];
        let del = || suite.bridge_del(&format!("seq-{i}"), pods[s][i].path_str(), &results[s][i]);
        let (del, floor) = suite.beside_floor(i, del, &mut floor_pods);
        dels[s].push(del);
        floors[s].push(floor);
    }
    drop(floor_pods);
    let cpu_after: Vec<Duration> = suites.iter().map(Suite::service_cpu).collect();
    for (s, suite) in suites.iter().enumerate() {
        check_calls(out, "seq DEL", suite.setup, &dels[s]);
        check_calls(out, "seq DEL floor", suite.setup, &floors[s]);
        let handed_out: Vec<String> = results[s].iter().flat_map(addresses).collect();
        let dup = duplicates(&handed_out);
        if !dup.is_empty() {
            out.problem(format!(
                "seq ({}) duplicate addresses: {dup:?}",
                suite.setup.label()
            ));
        }
        let side = suite.side();
        out.sample(
            &suite.metric("seq ADD"),
            side,
            &adds[s],
            cpu_mid[s] - cpu_before[s],
        );
        out.sample(
            &suite.metric("seq DEL"),
            side,
            &dels[s],
            cpu_after[s] - cpu_mid[s],
        );
        out.sample(&suite.metric("seq DEL floor"), side, &floors[s], Duration::ZERO);
        check_leaks(out, "seq", suite);
    }
}

/// `n` calls released together; the wall time from release to the last
/// reply, and every call.
fn parallel(n: usize, call: impl Fn(usize) -> Call + Sync) -> (Duration, Vec<Call>) {
    let barrier = Barrier::new(n + 1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let (barrier, call) = (&barrier, &call);
                scope.spawn(move || {
                    barrier.wait();
                    let done = call(i);
                    (Instant::now(), done)
                })
            })
            .collect();
        barrier.wait();
        let released = Instant::now();
        let done: Vec<(Instant, Call)> = handles
            .into_iter()
            .map(|h| h.join().expect("burst thread"))
            .collect();
        let last = done.iter().map(|(t, _)| *t).max().unwrap_or(released);
        (last - released, done.into_iter().map(|(_, c)| c).collect())
    })
}

/// `n` ADDs at once, then `n` DELs at once, then the floor: `n` pod-like
/// veths on the same bridge deleted at once by `n` `ip link del`.
pub(crate) fn burst(out: &mut Outcome, suites: &[Suite], n: usize, round: usize) {
    for k in 0..suites.len() {
        let suite = &suites[(round + k) % suites.len()];
        let pods = pods(n, "burst");
        let cpu_before = suite.service_cpu();
        let (add_wall, adds) = parallel(n, |i| {
            suite.call(
                "bridge",
                "ADD",
                &format!("burst-{i}"),
                pods[i].path_str(),
                &suite.bridge_conf(None),
            )
        });
        let cpu_mid = suite.service_cpu();
        check_calls(out, "burst ADD", suite.setup, &adds);
        let results: Vec<Value> = adds
            .iter()
            .map(|c| serde_json::from_str(&c.stdout).unwrap_or(Value::Null))
            .collect();
        let in_results: Vec<String> = results.iter().flat_map(addresses).collect();
        let in_pods: Vec<String> = pods.iter().filter_map(pod_address).collect();
        for (where_, list) in [("results", &in_results), ("pods", &in_pods)] {
            let dup = duplicates(list);
            if !dup.is_empty() {
                out.problem(format!(
                    "burst ({}) duplicate addresses in {where_}: {dup:?}",
                    suite.setup.label()
                ));
            }
        }
        let (del_wall, dels) = parallel(n, |i| {
            suite.bridge_del(&format!("burst-{i}"), pods[i].path_str(), &results[i])
        });
        let cpu_after = suite.service_cpu();
        check_calls(out, "burst DEL", suite.setup, &dels);
        let floor_pods: Vec<Netns> = (0..n).map(|_| suite.floor_pod()).collect();
        let (floor_wall, floor_calls) = parallel(n, |i| suite.floor_delete(&floor_pods[i]));
        check_calls(out, "burst DEL floor", suite.setup, &floor_calls);
        let side = suite.side();
        out.record(&suite.metric("burst ADD wall"), side, ms(add_wall));
        out.record(&suite.metric("burst DEL wall"), side, ms(del_wall));
        out.record(&suite.metric("burst DEL floor wall"), side, ms(floor_wall));
        let per_call = |calls: &[Call], extra| cpu_ms(calls, extra).iter().sum::<f64>() / n as f64;
        out.record(
            &suite.metric("burst ADD cpu/call"),
            side,
            per_call(&adds, cpu_mid - cpu_before),
        );
        out.record(
            &suite.metric("burst DEL cpu/call"),
            side,
            per_call(&dels, cpu_after - cpu_mid),
        );
        check_leaks(out, "burst", suite);
    }
}

/// The reference's lease files for the first `count` addresses of the
/// /16 after its gateway, as its plugin writes them, and its round-robin
/// position after the last one.
fn write_reference_leases(data_dir: &Path, network: &str, subnet: &str, count: usize) {
    let dir = data_dir.join(network);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mut last = String::new();
    for i in 0..count {
        let ip = nth_address(subnet, 2 + i);
        last = ip.to_string();
        std::fs::write(dir.join(&last), format!("full-{i}\r\neth0")).expect("write lease");
    }
    std::fs::write(dir.join("last_reserved_ip.0"), last).expect("write last reserved");
}

/// ADD-then-DEL pairs per suite and round in the full phase: one sample
/// per round would leave the median to a single veth deletion's luck.
const FULL_PAIRS: usize = 16;

/// Whether `address` (a result's `a.b.c.d/len`) is one of the `count`
/// addresses the full phase wrote as the reference's leases.
fn among_written(subnet: &str, count: usize, address: &str) -> bool {
    let Some(ip) = address
        .split('/')
        .next()
        .and_then(|a| a.parse::<std::net::Ipv4Addr>().ok())
    else {
        return false;
    };
    let (first, last) = (
        u32::from(nth_address(subnet, 2)),
        u32::from(nth_address(subnet, 1 + count)),
    );
    (first..=last).contains(&u32::from(ip))
}

/// A /16 with the leases already held: one more ADD and DEL, through the
/// chain and IPAM alone, `FULL_PAIRS` times (the count stays at the full
/// mark, each pair releasing what it took), each chain DEL followed by its
/// floor on the same bridge.
pub(crate) fn full_round(out: &mut Outcome, suites: &[Suite], round: usize, leases: usize) {
    for k in 0..suites.len() {
        let suite = &suites[(round + k) % suites.len()];
        let mut calls: BTreeMap<&str, Vec<Call>> = BTreeMap::new();
        // Every namespace of the round is deleted after it (see beside_floor).
        let mut kept = Vec::new();
        for pair in 0..FULL_PAIRS {
            let pod = Netns::new("full");
            let id = format!("full-extra-{round}-{pair}");
            let add = suite.with_service_cpu(|| {
                suite.call("bridge", "ADD", &id, pod.path_str(), &suite.bridge_conf(None))
            });
            let result: Value = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
            for address in addresses(&result) {
                if among_written(&suite.subnet, leases, &address) {
                    out.problem(format!(
                        "full ({}) handed out {address}, which a written lease holds",
                        suite.setup.label()
                    ));
                }
            }
            let del = || suite.with_service_cpu(|| suite.bridge_del(&id, pod.path_str(), &result));
            let (del, floor_call) = suite.beside_floor(pair, del, &mut kept);
            let ipam_id = format!("full-ipam-{round}-{pair}");
            let ipam = |command| {
                suite.with_service_cpu(|| {
                    suite.call(
                        "host-local",
                        command,
                        &ipam_id,
                        pod.path_str(),
                        &suite.ipam_conf(),
                    )
                })
            };
            let ipam_add = ipam("ADD");
            let ipam_del = ipam("DEL");
            for (what, call) in [
                ("full chain ADD", add),
                ("full chain DEL", del),
                ("full chain DEL floor", floor_call),
                ("full IPAM ADD", ipam_add),
                ("full IPAM DEL", ipam_del),
            ] {
                calls.entry(what).or_default().push(call);
            }
            kept.push(pod);
        }
        drop(kept);
        for (what, calls) in &calls {
            check_calls(out, what, suite.setup, calls);
            out.sample(what, suite.side(), calls, Duration::ZERO);
        }
        // What the pairs took they gave back: the written leases stay.
        let extra: Vec<String> = suite
            .leftovers()
            .into_iter()
            .filter(|l| !l.contains("full-") || l.contains("full-extra") || l.contains("full-ipam"))
            .filter(|l| {
                !l.starts_with("lease file ")
                    || !among_written(&suite.subnet, leases, &l["lease file ".len()..])
            })
            .collect();
        if !extra.is_empty() {
            out.problem(format!("full ({}) left behind: {extra:?}", suite.setup.label()));
        }
    }
}

/// Writes the reference's lease files for `leases` addresses in each full
/// suite and makes one ADD and DEL, so that ours imports them (and starts
/// its service) as a migrated node does before the phase measures; checks
/// that ours really holds them all.
pub(crate) fn prepare_full(out: &mut Outcome, suites: &[Suite], leases: usize) {
    for suite in suites {
        eprintln!(
            "bench: writing {leases} reference-format leases for {}",
            suite.setup.label()
        );
        write_reference_leases(&suite.data_dir(), &suite.network, &suite.subnet, leases);
        let pod = Netns::new("warm");
        let add = suite.call(
            "bridge",
            "ADD",
            "warm-up",
            pod.path_str(),
            &suite.bridge_conf(None),
        );
        let result: Value = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
        let del = suite.bridge_del("warm-up", pod.path_str(), &result);
        check_calls(out, "full warm-up", suite.setup, &[add, del]);
        if suite.setup != Setup::Reference {
            let held = suite.leases().len();
            if held != leases {
                out.problem(format!(
                    "full ({}) holds {held} leases after importing {leases}",
                    suite.setup.label()
                ));
            }
        }
    }
}

/// Fresh pods, loopback ADD then DEL.
pub(crate) fn loopback(out: &mut Outcome, suites: &[Suite], n: usize) {
    let conf = json!({"cniVersion": "1.0.0", "name": "lo", "type": "loopback"}).to_string();
    let mut adds: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    let mut dels: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    for (i, s) in interleaved(n, suites.len()) {
        let pod = Netns::new("lo");
        let id = format!("lo-{i}");
        adds[s].push(suites[s].call("loopback", "ADD", &id, pod.path_str(), &conf));
        dels[s].push(suites[s].call("loopback", "DEL", &id, pod.path_str(), &conf));
    }
    for (s, suite) in suites.iter().enumerate() {
        check_calls(out, "loopback ADD", suite.setup, &adds[s]);
        check_calls(out, "loopback DEL", suite.setup, &dels[s]);
        out.sample("loopback ADD", suite.side(), &adds[s], Duration::ZERO);
        out.sample("loopback DEL", suite.side(), &dels[s], Duration::ZERO);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_written_leases_are_known() {
        assert_eq!(nth_address("10.72.0.0/16", 2).to_string(), "10.72.0.2");
        assert_eq!(nth_address("10.72.0.0/16", 300).to_string(), "10.72.1.44");
        assert!(among_written("10.72.0.0/16", 300, "10.72.0.2/16"));
        assert!(among_written("10.72.0.0/16", 300, "10.72.1.45/16"));
        assert!(!among_written("10.72.0.0/16", 300, "10.72.1.46/16"));
        assert!(!among_written("10.72.0.0/16", 300, "10.72.0.1/16"));
    }
}
