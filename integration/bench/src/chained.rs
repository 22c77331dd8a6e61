//! Plugins chained after the bridge (portmap, firewall), ours against the
//! reference, each DEL of ours beside the floor of one iptables-restore.

use std::path::Path;
use std::time::Duration;

use serde_json::json;

use crate::measure::{Call, exec};
use crate::outcome::{Outcome, check_calls};
use crate::setup::{Setup, Side};
use crate::suite::{SETTLE, Suite, interleaved};

/// A portmap entry of a chain after bridge, with two mappings (TCP and
/// UDP) and the pod's IPv4 address from the previous result.
/// The address of bench pod `pod` of a chained plugin's phase.
fn chained_pod_address(pod: usize) -> String {
    format!("10.77.{}.{}", pod / 250, pod % 250 + 2)
}

fn chained_prev_result(pod: usize) -> serde_json::Value {
    json!({"cniVersion": "1.0.0",
        "interfaces": [{"name": "cni0"}, {"name": "eth0", "sandbox": "/var/run/netns/bench"}],
        "ips": [{"address": format!("{}/16", chained_pod_address(pod)), "interface": 1}]})
}

fn portmap_conf(network: &str, pod: usize) -> String {
    json!({"cniVersion": "1.0.0", "name": network, "type": "portmap",
        "capabilities": {"portMappings": true},
        "runtimeConfig": {"portMappings": [
            {"hostPort": 18080, "containerPort": 8080, "protocol": "tcp"},
            {"hostPort": 18053, "containerPort": 53, "protocol": "udp"}]},
        "prevResult": chained_prev_result(pod)})
    .to_string()
}

fn firewall_conf(network: &str, pod: usize) -> String {
    json!({"cniVersion": "1.0.0", "name": network, "type": "firewall",
        "prevResult": chained_prev_result(pod)})
    .to_string()
}

/// A plugin chained after the bridge, measured as the runtime calls it.
pub(crate) struct ChainedPhase<'a> {
    plugin: &'a str,
    conf: fn(&str, usize) -> String,
    /// `iptables-restore --noflush` input deleting what the plugin made for
    /// container `id` of `network`, pod number `pod`, read from the node.
    teardown: fn(&Suite, &str, &str, usize) -> String,
    /// What the DELs left in the node.
    leftovers: fn(&Suite) -> Vec<String>,
}

/// A chained plugin's ADD and DEL, ours and Debian's, alternating, each in
/// its own node. Beside each of our DELs, the floor: one
/// `iptables-restore` deleting the same rules of another container (its
/// input rendered beforehand, outside the timing). The node tracks a flow,
/// as a node with traffic does, so cleanups of conntrack run.
pub(crate) fn chained(out: &mut Outcome, suites: &[Suite], n: usize, phase: &ChainedPhase) {
    let (add_name, del_name) = (format!("{} ADD", phase.plugin), format!("{} DEL", phase.plugin));
    let floor_name = format!("{del_name} floor");
    let mut adds: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    let mut dels: Vec<Vec<Call>> = vec![Vec::new(); suites.len()];
    let mut floors = Vec::new();
    for suite in suites {
        suite.node.netns.ip(&["link", "set", "lo", "up"]).success();
        let flow =
            "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))";
        suite.node.run("/usr/bin/python3", &["-c", flow]).success();
    }
    for (i, s) in interleaved(n, suites.len()) {
        let suite = &suites[s];
        let network = format!("{}-{}", suite.network, phase.plugin);
        let conf = (phase.conf)(&network, i);
        let id = format!("{}-{i}", phase.plugin);
        adds[s].push(suite.call(phase.plugin, "ADD", &id, "/var/run/netns/bench", &conf));
        if suite.side() == Side::Ours {
            let floor_id = format!("{}-floor-{i}", phase.plugin);
            let floor_conf = (phase.conf)(&network, i + n);
            let made = suite.call(
                phase.plugin,
                "ADD",
                &floor_id,
                "/var/run/netns/bench",
                &floor_conf,
            );
            assert!(made.ok, "{} ADD for the floor: {}", phase.plugin, made.stderr);
            let teardown = (phase.teardown)(suite, &network, &floor_id, i + n);
            std::thread::sleep(SETTLE);
            floors.push(exec(
                &suite.ns,
                Path::new("/usr/sbin/iptables-restore"),
                &["--noflush"],
                &[],
                &teardown,
            ));
        }
        std::thread::sleep(SETTLE);
        dels[s].push(suite.call(phase.plugin, "DEL", &id, "/var/run/netns/bench", &conf));
    }
    for (s, suite) in suites.iter().enumerate() {
        check_calls(out, &add_name, suite.setup, &adds[s]);
        check_calls(out, &del_name, suite.setup, &dels[s]);
        out.sample(&add_name, suite.side(), &adds[s], Duration::ZERO);
        out.sample(&del_name, suite.side(), &dels[s], Duration::ZERO);
        let left = (phase.leftovers)(suite);
        if !left.is_empty() {
            out.problem(format!(
                "{} ({}) left {left:?}",
                phase.plugin,
                suite.setup.label()
            ));
        }
    }
    check_calls(out, &floor_name, Setup::DropIn, &floors);
    out.sample(&floor_name, Side::Ours, &floors, Duration::ZERO);
}

pub(crate) const PORTMAP_PHASE: ChainedPhase = ChainedPhase {
    plugin: "portmap",
    conf: portmap_conf,
    teardown: |suite, network, id, _| {
        let saved = suite.node.run("iptables-save", &["-t", "nat"]).success().stdout;
        let table = firewall::iptables::SavedTable::parse(&saved, "nat");
        portmap::rules::iptables::render_remove(&table, network, id).expect("rules to remove")
    },
    leftovers: |suite| {
        let chains = suite.node.nat_chains().into_iter();
        chains.filter(|c| c.starts_with("CNI-DN-")).collect()
    },
};

pub(crate) const FIREWALL_PHASE: ChainedPhase = ChainedPhase {
    plugin: "firewall",
    conf: firewall_conf,
    teardown: |suite, _, _, pod| {
        let saved = suite
            .node
            .run("iptables-save", &["-t", "filter"])
            .success()
            .stdout;
        let filter = firewall::iptables::SavedTable::parse(&saved, "filter");
        let ip = chained_pod_address(pod).parse().expect("address");
        firewall_plugin::rules::iptables::render_del(&filter, &[ip]).expect("rules to remove")
    },
    leftovers: |suite| {
        let saved = suite
            .node
            .run("iptables-save", &["-t", "filter"])
            .success()
            .stdout;
        saved
            .lines()
            .filter(|l| l.contains("10.77."))
            .map(str::to_owned)
            .collect()
    },
};
