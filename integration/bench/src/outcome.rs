//! What the phases find. `cni-bench`'s phases write into one [`Outcome`]
//! (per-call samples, per-repeat figures, problems, profiles), which its
//! tables, chart, report and JSON line are made from; the cluster bench's
//! phases (scale, policy, sandbox bursts) into one [`ScaleOutcome`], row by
//! row, which its table, JSON record and exit status are made from.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::measure::{Call, median, ms, quantile};
use crate::setup::{Setup, Side};

/// Per-call values of one metric, pooled over every repeat.
pub type Pooled = BTreeMap<String, BTreeMap<Side, Vec<f64>>>;

/// Everything one run measured and found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Figures measured once per repeat (a burst's wall time, a floor):
    /// per repeat, metric → side → value (ms).
    pub repeats: Vec<BTreeMap<String, BTreeMap<Side, f64>>>,
    /// Per-call wall times (ms) by metric and side, over all repeats.
    pub samples: Pooled,
    /// Per-call CPU times (ms), likewise.
    pub cpu: Pooled,
    pub problems: Vec<String>,
    /// (what was run, the profiler's report), for the markdown report.
    pub profiles: Vec<(String, String)>,
}

/// The quantiles reported for every per-call metric, pooled.
pub const QUANTILES: [(&str, f64); 4] = [("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("max", 1.0)];

impl Outcome {
    pub(crate) fn record(&mut self, metric: &str, side: Side, value: f64) {
        self.repeats
            .last_mut()
            .expect("a repeat is running")
            .entry(metric.to_owned())
            .or_default()
            .insert(side, value);
    }

    /// Calls of `metric`, their CPU with `cpu_extra` (a service's CPU over
    /// them) shared out evenly.
    pub(crate) fn sample(&mut self, metric: &str, side: Side, calls: &[Call], cpu_extra: Duration) {
        self.samples
            .entry(metric.to_owned())
            .or_default()
            .entry(side)
            .or_default()
            .extend(walls(calls));
        self.cpu
            .entry(metric.to_owned())
            .or_default()
            .entry(side)
            .or_default()
            .extend(cpu_ms(calls, cpu_extra));
    }

    /// Values of `metric` measured otherwise than as calls (a probe's
    /// times), pooled as calls are.
    pub(crate) fn pool(&mut self, metric: &str, side: Side, values: &[f64]) {
        self.samples
            .entry(metric.to_owned())
            .or_default()
            .entry(side)
            .or_default()
            .extend_from_slice(values);
    }

    pub(crate) fn problem(&mut self, text: String) {
        eprintln!("bench: {text}");
        self.problems.push(text);
    }

    /// Every figure: the median over the repeats of each once-per-repeat
    /// metric, and for each per-call metric its pooled quantiles and CPU
    /// median (`<metric> p50`, `… p95`, `… p99`, `… max`, `… cpu p50`).
    pub fn figures(&self) -> BTreeMap<String, BTreeMap<Side, f64>> {
        let mut all: BTreeMap<String, BTreeMap<Side, Vec<f64>>> = BTreeMap::new();
        for repeat in &self.repeats {
            for (metric, sides) in repeat {
                for (side, value) in sides {
                    all.entry(metric.clone())
                        .or_default()
                        .entry(*side)
                        .or_default()
                        .push(*value);
                }
            }
        }
        let mut figures: BTreeMap<String, BTreeMap<Side, f64>> = all
            .into_iter()
            .map(|(metric, sides)| (metric, sides.into_iter().map(|(s, v)| (s, median(&v))).collect()))
            .collect();
        for (metric, sides) in &self.samples {
            for (side, values) in sides {
                for (name, q) in QUANTILES {
                    figures
                        .entry(format!("{metric} {name}"))
                        .or_default()
                        .insert(*side, quantile(values, q));
                }
            }
        }
        for (metric, sides) in &self.cpu {
            for (side, values) in sides {
                figures
                    .entry(format!("{metric} cpu p50"))
                    .or_default()
                    .insert(*side, median(values));
            }
        }
        figures
    }
}

pub(crate) fn cpu_ms(calls: &[Call], extra: Duration) -> Vec<f64> {
    let share = if calls.is_empty() {
        0.0
    } else {
        ms(extra) / calls.len() as f64
    };
    calls.iter().map(|c| ms(c.cpu) + share).collect()
}

pub(crate) fn walls(calls: &[Call]) -> Vec<f64> {
    calls.iter().map(|c| ms(c.wall)).collect()
}

pub(crate) fn check_calls(out: &mut Outcome, what: &str, setup: Setup, calls: &[Call]) {
    for call in calls.iter().filter(|c| !c.ok) {
        out.problem(format!(
            "{what} ({}) failed: {}{}",
            setup.label(),
            call.stdout.trim(),
            call.stderr.trim()
        ));
    }
}

/// One line of the table: ours against what it is compared with.
#[derive(Debug, Clone)]
pub struct Row {
    pub metric: String,
    pub ours: f64,
    /// The floor, the reference or the small cluster, and which.
    pub other: Option<(String, f64)>,
    pub goal: String,
    pub met: Option<bool>,
}

#[derive(Debug, Default)]
pub struct ScaleOutcome {
    pub rows: Vec<Row>,
    pub problems: Vec<String>,
}

impl ScaleOutcome {
    pub(crate) fn row(
        &mut self,
        metric: &str,
        ours: f64,
        other: Option<(&str, f64)>,
        goal: &str,
        met: Option<bool>,
    ) {
        eprintln!(
            "bench: {metric}: {ours:.2}{}",
            other.map_or(String::new(), |(n, v)| format!(" ({n} {v:.2})"))
        );
        self.rows.push(Row {
            metric: metric.to_owned(),
            ours,
            other: other.map(|(name, value)| (name.to_owned(), value)),
            goal: goal.to_owned(),
            met,
        });
    }

    pub(crate) fn problem(&mut self, text: String) {
        eprintln!("bench: {text}");
        self.problems.push(text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_pool_every_call_and_take_medians_of_repeats() {
        let mut out = Outcome::default();
        let call = |ms: u64| Call {
            wall: Duration::from_millis(ms),
            cpu: Duration::from_millis(1),
            ok: true,
            stdout: String::new(),
            stderr: String::new(),
        };
        for (round, (walls, burst)) in [(vec![1, 2, 3], 10.0), (vec![4, 100], 30.0), (vec![5], 20.0)]
            .into_iter()
            .enumerate()
        {
            out.repeats.push(BTreeMap::new());
            let calls: Vec<Call> = walls.into_iter().map(call).collect();
            out.sample(
                "seq ADD",
                Side::Ours,
                &calls,
                Duration::from_millis(u64::try_from(round).expect("round")),
            );
            out.record("burst ADD wall", Side::Ours, burst);
        }
        let figures = out.figures();
        let ours = |m: &str| figures[m][&Side::Ours];
        assert_eq!(ours("seq ADD p50"), 3.0);
        assert_eq!(
            ours("seq ADD max"),
            100.0,
            "the maximum over all calls, not a median of maxima"
        );
        assert_eq!(ours("burst ADD wall"), 20.0);
        assert!(ours("seq ADD cpu p50") >= 1.0);
    }
}
