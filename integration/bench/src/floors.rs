//! What this machine charges anyone, whichever plugins: a process, and
//! one iptables-restore.

use std::path::Path;
use std::time::Duration;

use netns::NetNs;
use test_kit::Node;

use crate::measure::exec;
use crate::outcome::{Outcome, check_calls};
use crate::setup::{Setup, Side};

/// What this machine charges anyone: a process, and one pod's masquerade
/// added and removed with one iptables-restore each.
pub(crate) fn floors(out: &mut Outcome, n: usize) {
    let node = Node::new();
    let ns = NetNs::open(node.netns.path()).expect("node netns");
    let mut trues = Vec::new();
    let mut adds = Vec::new();
    let mut dels = Vec::new();
    for i in 0..n {
        trues.push(exec(&ns, Path::new("/bin/true"), &[], &[], ""));
        let id = format!("floor-{i}");
        let address: ipnetwork::IpNetwork = format!("10.78.0.{}/16", i % 250 + 2).parse().expect("address");
        let setup = bridge::rules::iptables::render_setup(firewall::Family::V4, "floor", &id, &[address]);
        adds.push(exec(
            &ns,
            Path::new("/usr/sbin/iptables-restore"),
            &["--noflush"],
            &[],
            &setup,
        ));
        let saved = node.run("iptables-save", &["-t", "nat"]).success().stdout;
        let table = firewall::iptables::SavedTable::parse(&saved, "nat");
        let chain = bridge::rules::iptables::chain_name("floor", &id);
        let teardown = firewall::iptables::render_nat_removal(&table, &[chain]).expect("rules to remove");
        dels.push(exec(
            &ns,
            Path::new("/usr/sbin/iptables-restore"),
            &["--noflush"],
            &[],
            &teardown,
        ));
    }
    for (name, calls) in [
        ("floor exec /bin/true", &trues),
        ("floor restore add", &adds),
        ("floor restore delete", &dels),
    ] {
        check_calls(out, name, Setup::DropIn, calls);
        out.sample(name, Side::Ours, calls, Duration::ZERO);
    }
}
