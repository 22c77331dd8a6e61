//! `make bench-cluster`: bursts of pods through the suite and through the
//! reference plugins in kindnetd's shape, the node agent at thousands of
//! Nodes and the masquerade chain at 3 and at thousands, on the running
//! real cluster
//! (`integration/cluster/cluster.sh up` with a pod range that holds that
//! many node CIDRs; the make target brings it up and down). Prints the
//! table, writes `cluster.md` and `cluster.json` under `--out`; exits
//! non-zero when a step fails, never on a timing.
//!
//! `cluster-bench --update-readme docs/bench/README.md --from docs/bench/cluster.json`
//! regenerates docs/bench/README.md's cluster table from a run's JSON; a second
//! `--from` adds a phase run alone afterwards (`--only policy`).
//! `cluster-bench --connect ADDRESS:PORT COUNT` is the bench itself, run
//! inside a pod's namespace: COUNT new connections, each one's time.
//! `cluster-bench --probe ADDRESS:PORT open|closed`, also run inside a
//! pod's namespace, tries to connect every few ms until the answer turns.
//! `cluster-bench --nfqueue-reader QUEUE`, run on a node, accepts every
//! packet of an NFQUEUE (the anchor's design, see `nfqueue`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use cni_bench::bench_cluster::PolicyOptions;
use cni_bench::connect;
use cni_bench::outcome::ScaleOutcome;
use cni_bench::policy_scale;
use cni_bench::report;
use cni_bench::sandbox::{self, BurstOptions};
use cni_bench::scale::{self, ScaleOptions};
use test_kit::cluster::Cluster;

const README_BEGIN: &str = "<!-- cluster-bench-table:begin -->";
const README_END: &str = "<!-- cluster-bench-table:end -->";

/// The cluster's pod ranges must hold every bench Node's CIDRs.
const WIDE_POD_CIDRS: &str = "10.224.0.0/11,fd00:10:224::/48";

fn usage() -> ! {
    eprintln!(
        "usage: cluster-bench [--only sandbox|scale|policy] [--burst-pods N] [--burst-rounds N]\n                     [--nodes N] [--additions N] [--no-op-updates N] [--connects N]\n                     [--policy-pods N] [--policy-sizes N,N] [--policy-trials N] [--out DIR]\n       \
         cluster-bench --update-readme docs/bench/README.md --from RUN.json [--from RUN.json]\n       \
         cluster-bench --connect ADDRESS:PORT COUNT\n       \
         cluster-bench --probe ADDRESS:PORT open|closed\n       \
         cluster-bench --nfqueue-reader QUEUE"
    );
    std::process::exit(2)
}

fn machine() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get);
    format!("Linux {}, {cpus} CPUs", kernel.trim())
}

/// The phases a run's JSON holds (runs before the field: the first two).
fn phases_of(doc: &serde_json::Value) -> Vec<String> {
    doc["phases"].as_array().map_or_else(
        || vec!["sandbox".to_owned(), "scale".to_owned()],
        |phases| {
            phases
                .iter()
                .filter_map(|p| p.as_str().map(str::to_owned))
                .collect()
        },
    )
}

/// How a run was made, for the README: its file and its sizes.
fn describe(path: &Path, doc: &serde_json::Value) -> String {
    let phases = phases_of(doc);
    let mut parts = Vec::new();
    if phases.iter().any(|p| p == "sandbox") {
        parts.push(format!(
            "{} bursts of {} pods per network, alternating",
            doc["burst_rounds"], doc["burst_pods"]
        ));
    }
    if phases.iter().any(|p| p == "scale") {
        parts.push(format!(
            "{} bench Nodes, {} added one at a time, {} no-op status updates, {} connections per path and size",
            doc["nodes"], doc["additions"], doc["no_op_updates"], doc["connects"]
        ));
    }
    if phases.iter().any(|p| p == "policy") {
        parts.push(format!(
            "NetworkPolicy: {} bench pods, {} policies created and deleted one at a time at each of {} policies, {} connections per variant",
            doc["policy_pods"], doc["policy_trials"], doc["policy_sizes"], doc["connects"]
        ));
    }
    parts.push(doc["machine"].as_str().unwrap_or("").to_owned());
    let shown = path.display();
    format!("[{shown}]({shown}) ({})", parts.join("; "))
}

/// The README's cluster table from one run's JSON or more (a phase run
/// alone afterwards); a run whose phases an earlier one holds is left out.
fn update_readme(readme: &Path, runs: &[PathBuf]) -> Result<(), String> {
    let mut covered: Vec<String> = Vec::new();
    let (mut rows, mut sources) = (Vec::new(), Vec::new());
    for from in runs {
        let run = std::fs::read_to_string(from).map_err(|e| format!("{}: {e}", from.display()))?;
        let doc: serde_json::Value =
            serde_json::from_str(&run).map_err(|e| format!("{}: {e}", from.display()))?;
        let phases = phases_of(&doc);
        if phases.iter().all(|p| covered.contains(p)) {
            eprintln!(
                "cluster-bench: {} holds no phase the runs before it lack; left out",
                from.display()
            );
            continue;
        }
        covered.extend(phases);
        rows.extend(scale::rows_from_json(&doc)?);
        sources.push(describe(from, &doc));
    }
    let intro = format!(
        "Generated by `make bench-readme` from {}.\n\n",
        sources.join(" and ")
    );
    let text = std::fs::read_to_string(readme).map_err(|e| format!("{}: {e}", readme.display()))?;
    let updated = report::replace_between(
        &text,
        README_BEGIN,
        README_END,
        &(intro + &scale::markdown_table(&rows)),
    )?;
    std::fs::write(readme, updated).map_err(|e| format!("{}: {e}", readme.display()))
}

fn main() -> ExitCode {
    let mut options = ScaleOptions {
        nodes: 5000,
        additions: 100,
        no_op_updates: 2000,
        connects: 1000,
    };
    let mut bursts = BurstOptions { pods: 100, rounds: 2 };
    let mut policies = PolicyOptions {
        pods: 5000,
        sizes: vec![10, 1000],
        trials: 50,
        connects: 1000,
    };
    let mut only: Option<String> = None;
    let mut out = PathBuf::from("bench-results");
    let (mut readme, mut from) = (None, Vec::new());
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--nfqueue-reader") {
        let Some(queue) = args.get(1).and_then(|q| q.parse().ok()) else {
            usage()
        };
        return cni_bench::nfqueue::reader(queue).map_or_else(
            |e| {
                eprintln!("cluster-bench: {e}");
                ExitCode::FAILURE
            },
            |()| ExitCode::SUCCESS,
        );
    }
    if args.first().map(String::as_str) == Some("--probe") {
        let (Some(target), Some(want)) = (args.get(1), args.get(2)) else {
            usage()
        };
        return policy_scale::probe(target, want).map_or_else(
            |e| {
                eprintln!("cluster-bench: {e}");
                ExitCode::FAILURE
            },
            |()| ExitCode::SUCCESS,
        );
    }
    if args.first().map(String::as_str) == Some("--connect") {
        let (Some(target), Some(count)) = (args.get(1), args.get(2).and_then(|c| c.parse().ok())) else {
            usage()
        };
        return match connect::connect_loop(target, count) {
            Ok(times) => {
                let _ = writeln!(std::io::stdout().lock(), "{times}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cluster-bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        let number = || value.parse::<usize>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--nodes" => options.nodes = number().clamp(2, 7000),
            "--additions" => options.additions = number().clamp(1, 1000),
            "--no-op-updates" => options.no_op_updates = number().max(1),
            "--connects" => {
                options.connects = number().max(1);
                policies.connects = options.connects;
            }
            "--burst-pods" => bursts.pods = number().clamp(1, 300),
            "--burst-rounds" => bursts.rounds = number().max(1),
            "--policy-pods" => policies.pods = number().clamp(1, 25000),
            "--policy-sizes" => {
                policies.sizes = value
                    .split(',')
                    .map(|n| n.parse::<usize>().unwrap_or_else(|_| usage()))
                    .collect();
                if policies.sizes.is_empty() || !policies.sizes.is_sorted() {
                    usage()
                }
            }
            "--policy-trials" => policies.trials = number().max(1),
            "--only" if only.is_none() && ["sandbox", "scale", "policy"].contains(&value.as_str()) => {
                only = Some(value.clone());
            }
            "--out" => out = PathBuf::from(&value),
            "--update-readme" => readme = Some(PathBuf::from(&value)),
            "--from" => from.push(PathBuf::from(&value)),
            _ => usage(),
        }
    }
    match (readme, from.is_empty()) {
        (Some(readme), false) => {
            return update_readme(&readme, &from).map_or_else(
                |e| {
                    eprintln!("cluster-bench: {e}");
                    ExitCode::FAILURE
                },
                |()| ExitCode::SUCCESS,
            );
        }
        (None, true) => {}
        _ => usage(),
    }
    // Bench Node i's IPv4 pod CIDR is 10.(225 + i / 256).(i % 256).0/24.
    options.additions = options.additions.min(7900 - options.nodes);
    test_kit::require_root();
    let cluster = Cluster::get();
    let runs = |phase: &str| only.as_deref().is_none_or(|o| o == phase);
    let (run_sandbox, run_scale, run_policy) = (runs("sandbox"), runs("scale"), runs("policy"));
    if (run_scale || run_policy) && cluster.fact("POD_CIDRS") != WIDE_POD_CIDRS {
        eprintln!(
            "cluster-bench: the cluster's pod ranges are {}; bring it up with CNI_CLUSTER_POD_CIDRS={WIDE_POD_CIDRS} (make bench-cluster does)",
            cluster.fact("POD_CIDRS")
        );
        return ExitCode::FAILURE;
    }
    let mut outcome = ScaleOutcome::default();
    // The bursts first: the nodes then route to three Nodes, not 5000.
    if run_sandbox {
        sandbox::run(cluster, &bursts, &mut outcome);
    }
    if run_scale {
        scale::run(cluster, &options, &mut outcome);
    }
    if run_policy {
        policy_scale::run(cluster, &policies, &mut outcome);
    }
    let table = scale::markdown_table(&outcome.rows);
    let mut stdout = std::io::stdout().lock();
    let _ = write!(stdout, "{table}");
    std::fs::create_dir_all(&out).expect("create the results folder");
    let (markdown, json) = scale::outputs(&out);
    let phases: Vec<&str> = [
        ("sandbox", run_sandbox),
        ("scale", run_scale),
        ("policy", run_policy),
    ]
    .into_iter()
    .filter_map(|(name, ran)| ran.then_some(name))
    .collect();
    let doc = scale::json(&options, &bursts, &policies, &phases, &outcome, &machine());
    std::fs::write(&markdown, format!("# cluster-bench\n\n{}\n\n{table}", machine()))
        .expect("write the report");
    std::fs::write(&json, format!("{doc}\n")).expect("write the JSON");
    let _ = writeln!(stdout, "report: {}", markdown.display());
    if outcome.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("cluster-bench: {} problem(s), see above", outcome.problems.len());
        ExitCode::FAILURE
    }
}
