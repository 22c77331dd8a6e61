//! A whole `cni-bench` run: the suites made, every phase asked for run
//! round after round, the profiles last.

use std::collections::BTreeMap;

use crate::add_del::{burst, full_round, loopback, prepare_full, seq, warm_up};
use crate::chained::{FIREWALL_PHASE, PORTMAP_PHASE, chained};
use crate::cri::cri;
use crate::floors::floors;
use crate::mesh::{istio, rechain};
use crate::options::Options;
use crate::outcome::Outcome;
use crate::profile::profile;
use crate::setup::Setup;
use crate::stop::stopping;
use crate::suite::Suite;
use crate::{ambient, gate, log_socket, policy_path};

/// Runs every phase `repeats` times. The drop-in setup is the headline;
/// the service setup runs beside it in the sequential and burst phases.
pub fn run(options: &Options) -> Outcome {
    let mut out = Outcome::default();
    let suites = vec![
        Suite::new(Setup::DropIn, "bench-ours", "cnibench0", "10.70.0.0/16"),
        Suite::new(Setup::Reference, "bench-ref", "cnibench1", "10.71.0.0/16"),
        Suite::new(Setup::Service, "bench-svc", "cnibench2", "10.74.0.0/16"),
    ];
    let full_suites = vec![
        Suite::new(Setup::DropIn, "full-ours", "cnifull0", "10.72.0.0/16"),
        Suite::new(Setup::Reference, "full-ref", "cnifull1", "10.73.0.0/16"),
    ];
    let wanted = |phase: &str| !stopping() && options.only.as_deref().is_none_or(|only| only == phase);
    out.repeats.push(BTreeMap::new());
    // First, on a quiet node: writing the full phase's lease files leaves
    // the disk busy for a while.
    warm_up(&mut out, &suites);
    if wanted("full") {
        prepare_full(&mut out, &full_suites, options.full_leases);
    }
    for round in 0..options.repeats {
        if stopping() {
            break;
        }
        eprintln!("bench: round {}/{}", round + 1, options.repeats);
        if round > 0 {
            out.repeats.push(BTreeMap::new());
        }
        if wanted("seq") {
            seq(&mut out, &suites, options.pods);
        }
        if wanted("burst") {
            burst(&mut out, &suites, options.pods, round);
        }
        if wanted("full") {
            full_round(&mut out, &full_suites, round, options.full_leases);
        }
        if wanted("loopback") {
            loopback(&mut out, &suites[..2], options.pods);
        }
        if wanted("portmap") {
            chained(&mut out, &suites[..2], options.pods, &PORTMAP_PHASE);
        }
        if wanted("firewall") {
            chained(&mut out, &suites[..2], options.pods, &FIREWALL_PHASE);
        }
        if wanted("istio") {
            istio(&mut out, &suites[0], options.pods, false);
            istio(&mut out, &suites[0], options.pods, true);
        }
        if wanted("rechain") {
            rechain(&mut out, options.pods.min(40));
        }
        if wanted("logsock") {
            log_socket::phase(&mut out, &suites[0], options.pods);
        }
        if wanted("floors") {
            floors(&mut out, options.pods.min(20));
        }
        if wanted("cri") {
            cri(&mut out, options.pods, round);
        }
        if wanted(policy_path::PHASE) {
            policy_path::phase(&mut out, options.pods);
        }
        if wanted(gate::PHASE) {
            gate::phase(&mut out, options.pods);
        }
        if wanted(ambient::PHASE) {
            ambient::phase(&mut out, options.pods);
        }
    }
    if stopping() {
        out.problem("stopped by a signal before the run's end".into());
    } else if options.only.is_none() {
        profile(&mut out, &suites[..2]);
    }
    out
}
