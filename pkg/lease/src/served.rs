//! What a lease service has answered since it started: requests by verb
//! and result, and how long each took, counted by the service itself
//! ([`crate::server`]) whatever its handler, and asked for by the node
//! agent on each scrape of its metrics ([`crate::client::served`]). The
//! service keeps plain counts, not a metrics library's types: what travels
//! is data, and the agent, which exposes them, owns their format.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use cni::Code;
use cni::skel::Reply;
use serde::{Deserialize, Serialize};

use crate::wire::{AdminOp, Call};

/// The upper bounds, in seconds, of the duration histogram's buckets
/// (one more, unbounded, follows). An ADD or a DEL the service answers
/// takes a few milliseconds (docs/decisions/001-lease-service.md), a
/// burst queued on a network's lock or a large import seconds, and no
/// request more than the lease path's deadline, [`crate::PATIENCE`].
pub const DURATION_BOUNDS: [f64; 15] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// What a service has answered since it started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Served {
    /// The histogram's bucket bounds, in seconds ([`DURATION_BOUNDS`] for
    /// this version; sent so that the reader never assumes them).
    pub bounds: Vec<f64>,
    /// By verb, in the verbs' order.
    pub verbs: Vec<VerbServed>,
}

/// What a service has answered of one verb.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VerbServed {
    /// A plugin call's CNI command (`ADD`, `DEL`, `CHECK`, `GC`, `STATUS`,
    /// `VERSION`; `unknown` when it names none), an operator's command
    /// (`admin_list`, `admin_gc`, ...), or `unreadable` for a request the
    /// service could not read.
    pub verb: String,
    /// How many were answered, by result ([`result_of`]).
    pub results: BTreeMap<String, u64>,
    /// How many took at most each bound of [`Served::bounds`] and more
    /// than the one before, then how many took longer than the last: not
    /// cumulative.
    pub buckets: Vec<u64>,
    /// The time all of them took together, in seconds.
    pub seconds: f64,
}

impl VerbServed {
    /// How many were answered.
    pub fn count(&self) -> u64 {
        self.results.values().sum()
    }
}

/// The verb a call is counted under.
pub fn verb_of(call: &Call) -> String {
    match call {
        Call::Plugin { env, .. } => match env.get("CNI_COMMAND").map(String::as_str) {
            Some(command @ ("ADD" | "DEL" | "CHECK" | "GC" | "STATUS" | "VERSION")) => command.to_owned(),
            // Whatever a client put there is not a label value to keep.
            _ => "unknown".to_owned(),
        },
        Call::Admin { op, .. } => match op {
            AdminOp::List => "admin_list",
            AdminOp::ReleaseIp { .. } => "admin_release_ip",
            AdminOp::ReleaseContainer { .. } => "admin_release_container",
            AdminOp::Gc { .. } => "admin_gc",
            AdminOp::Export => "admin_export",
            AdminOp::ImportReference { .. } => "admin_import_reference",
        }
        .to_owned(),
    }
}

/// The result an answer is counted under: `success`, `busy` (code 11: the
/// leases were held elsewhere for the whole deadline) or `failure`.
pub fn result_of(reply: &Reply) -> &'static str {
    match reply {
        Reply::Failed(e, _) if e.has_code(Code::TryAgainLater) => "busy",
        Reply::Failed(..) => "failure",
        Reply::Document(_) | Reply::Done | Reply::About(_) => "success",
    }
}

/// The counts a running service keeps, shared by its answering threads.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    by_verb: Mutex<BTreeMap<String, VerbServed>>,
}

impl Tally {
    /// Counts one answer of `verb` with `result`, which took `took`.
    pub(crate) fn record(&self, verb: String, result: &str, took: Duration) {
        let seconds = took.as_secs_f64();
        let bucket = DURATION_BOUNDS
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(DURATION_BOUNDS.len());
        let mut by_verb = self.by_verb.lock().unwrap_or_else(PoisonError::into_inner);
        let served = by_verb.entry(verb.clone()).or_insert_with(|| VerbServed {
            verb,
            results: BTreeMap::new(),
            buckets: vec![0; DURATION_BOUNDS.len() + 1],
            seconds: 0.0,
        });
        *served.results.entry(result.to_owned()).or_default() += 1;
        served.buckets[bucket] += 1;
        served.seconds += seconds;
    }

    /// What was counted so far.
    pub(crate) fn snapshot(&self) -> Served {
        let by_verb = self.by_verb.lock().unwrap_or_else(PoisonError::into_inner);
        Served {
            bounds: DURATION_BOUNDS.to_vec(),
            verbs: by_verb.values().cloned().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugin(command: &str) -> Call {
        Call::plugin(
            BTreeMap::from([("CNI_COMMAND".to_owned(), command.to_owned())]),
            b"{}",
        )
    }

    #[test]
    fn calls_are_counted_under_their_verb_and_only_known_ones_by_name() {
        assert_eq!(verb_of(&plugin("ADD")), "ADD");
        assert_eq!(verb_of(&plugin("DEL")), "DEL");
        assert_eq!(verb_of(&plugin("add; drop table")), "unknown");
        assert_eq!(verb_of(&Call::plugin(BTreeMap::new(), b"{}")), "unknown");
        let admin = Call::admin("/d".into(), "n".into(), AdminOp::Gc { valid: Vec::new() });
        assert_eq!(verb_of(&admin), "admin_gc");
    }

    #[test]
    fn answers_are_counted_by_result() {
        let version = cni::Version::LATEST;
        assert_eq!(result_of(&Reply::Done), "success");
        assert_eq!(result_of(&Reply::Document(serde_json::json!({}))), "success");
        assert_eq!(
            result_of(&Reply::Failed(cni::Error::try_again_later("held"), version)),
            "busy"
        );
        assert_eq!(
            result_of(&Reply::Failed(cni::Error::invalid_config("no"), version)),
            "failure"
        );
    }

    #[test]
    fn each_answer_lands_in_one_bucket_and_the_sum() {
        let tally = Tally::default();
        tally.record("ADD".into(), "success", Duration::from_micros(300));
        tally.record("ADD".into(), "success", Duration::from_millis(3));
        tally.record("ADD".into(), "failure", Duration::from_millis(3));
        // On a bound: in that bound's bucket, as Prometheus' `le` says.
        tally.record("DEL".into(), "success", Duration::from_millis(1));
        tally.record("DEL".into(), "success", Duration::from_secs(40));
        let served = tally.snapshot();
        assert_eq!(served.bounds, DURATION_BOUNDS);
        let [add, del] = served.verbs.as_slice() else {
            panic!("two verbs: {served:?}")
        };
        assert_eq!((add.verb.as_str(), del.verb.as_str()), ("ADD", "DEL"));
        assert_eq!(
            add.results,
            BTreeMap::from([("failure".to_owned(), 1), ("success".to_owned(), 2)])
        );
        assert_eq!(add.count(), 3);
        let mut add_buckets = vec![0; DURATION_BOUNDS.len() + 1];
        add_buckets[0] = 1;
        add_buckets[3] = 2;
        assert_eq!(add.buckets, add_buckets);
        assert!((add.seconds - 0.0063).abs() < 1e-9, "{}", add.seconds);
        let mut del_buckets = vec![0; DURATION_BOUNDS.len() + 1];
        del_buckets[1] = 1;
        del_buckets[DURATION_BOUNDS.len()] = 1;
        assert_eq!(del.buckets, del_buckets);
        assert_eq!(del.count(), 2);
    }
}
