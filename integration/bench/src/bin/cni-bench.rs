//! `make bench`: the suite and Debian's reference plugins side by side in
//! one run. Prints the table of figures and ratios, writes the report,
//! chart and `run.json` under `--out`, and ends with the same JSON line.
//! Exits non-zero on any failure, duplicate address or leak, never on a
//! timing. The whole run happens in a private mount namespace with a fresh
//! tmpfs on /run, so a socket or lock left on the machine is never found.
//!
//! SIGTERM or SIGINT stops a run at its next step with everything it made
//! removed, and it fails.
//!
//! `cni-bench --update-readme docs/bench/README.md --from docs/bench/run.json`
//! regenerates docs/bench/README.md's table from a run's JSON line
//! (`make bench-readme` runs it in docs/bench, where the table's link to
//! `run.json` resolves).
//!
//! The policy-path phase runs this same program inside its namespaces:
//! `--connect ADDRESS:PORT COUNT` (timed connections from a pod),
//! `--accept ADDRESS:PORT` (the listener) and `--nfqueue-reader QUEUE`
//! (a userspace verdict for every queued packet); the last two run until
//! their stdin closes.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use cni_bench::{Options, connect, nfqueue, policy_path, report};

/// Set in the re-executed bench, inside its private mount namespace.
const INSIDE: &str = "CNI_BENCH_PRIVATE_RUN";
const README_BEGIN: &str = "<!-- bench-table:begin -->";
const README_END: &str = "<!-- bench-table:end -->";

fn usage() -> ! {
    eprintln!(
        "usage: cni-bench [--pods N] [--repeats N] [--full-leases N] [--only PHASE] [--out DIR]\n       \
         cni-bench --update-readme docs/bench/README.md --from RUN.json\n       \
         cni-bench --connect ADDRESS:PORT COUNT | --accept ADDRESS:PORT | --nfqueue-reader QUEUE"
    );
    std::process::exit(2)
}

enum Mode {
    Run(Options),
    UpdateReadme { readme: PathBuf, from: PathBuf },
}

fn parse() -> Mode {
    let mut options = Options {
        pods: 50,
        repeats: 3,
        full_leases: 60000,
        out: PathBuf::from("bench-results"),
        only: None,
    };
    let (mut readme, mut from) = (None, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        let number = || value.parse::<usize>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--pods" => options.pods = number().max(1),
            "--repeats" => options.repeats = number().max(1),
            "--full-leases" => options.full_leases = number().min(65000),
            "--only" if cni_bench::PHASES.contains(&value.as_str()) => options.only = Some(value.clone()),
            "--out" => options.out = PathBuf::from(&value),
            "--update-readme" => readme = Some(PathBuf::from(&value)),
            "--from" => from = Some(PathBuf::from(&value)),
            _ => usage(),
        }
    }
    match (readme, from) {
        (Some(readme), Some(from)) => Mode::UpdateReadme { readme, from },
        (None, None) => Mode::Run(options),
        _ => usage(),
    }
}

/// The programs the policy-path phase runs in its namespaces, when the
/// arguments name one: its exit status.
fn helper(args: &[String]) -> Option<ExitCode> {
    let argument = |i: usize| args.get(i).map(String::as_str).unwrap_or_else(|| usage());
    let result = match args.first().map(String::as_str)? {
        "--connect" => {
            let count = argument(2).parse().unwrap_or_else(|_| usage());
            connect::connect_loop(argument(1), count)
                .and_then(|times| writeln!(std::io::stdout().lock(), "{times}").map_err(|e| e.to_string()))
        }
        "--accept" => policy_path::accept_loop(argument(1)),
        "--nfqueue-reader" => nfqueue::reader(argument(1).parse().unwrap_or_else(|_| usage())),
        _ => return None,
    };
    Some(result.map_or_else(
        |e| {
            eprintln!("cni-bench: {e}");
            ExitCode::FAILURE
        },
        |()| ExitCode::SUCCESS,
    ))
}

fn machine() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get);
    format!("Linux {}, {cpus} CPUs", kernel.trim())
}

/// Runs this same command again in a private mount namespace whose /run is
/// a fresh tmpfs, and returns its exit status. SIGTERM and SIGINT are
/// passed on to it, so that it stops with everything it made removed
/// (sent to this process alone, they would leave it running).
fn rerun_privately() -> ExitCode {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT]).expect("signal handlers");
    let script = r#"mount -t tmpfs -o mode=0755 cni-bench-run /run && exec "$0" "$@""#;
    let mut inside = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "sh", "-c", script])
        .arg(std::env::current_exe().expect("the bench's own path"))
        .args(std::env::args_os().skip(1))
        .env(INSIDE, "1")
        .spawn()
        .expect("unshare runs");
    let pid = libc::pid_t::try_from(inside.id()).expect("a pid");
    std::thread::spawn(move || {
        for signal in signals.forever() {
            // SAFETY: kill(2) has no memory preconditions; the pid is our
            // child's (unshare, which execs into the run inside), reaped
            // only right before this process exits.
            unsafe { libc::kill(pid, signal) };
        }
    });
    let status = inside.wait().expect("the bench run inside");
    ExitCode::from(u8::try_from(status.code().unwrap_or(1)).unwrap_or(1))
}

fn update_readme(readme: &PathBuf, from: &PathBuf) -> ExitCode {
    let run = std::fs::read_to_string(from).unwrap_or_else(|e| panic!("{}: {e}", from.display()));
    let text = std::fs::read_to_string(readme).unwrap_or_else(|e| panic!("{}: {e}", readme.display()));
    let updated = report::figures_from_json(&run)
        .and_then(|(figures, doc)| {
            report::replace_between(
                &text,
                README_BEGIN,
                README_END,
                &report::readme_table(&figures, &doc),
            )
        })
        .unwrap_or_else(|e| {
            eprintln!("cni-bench: {e}");
            std::process::exit(1)
        });
    std::fs::write(readme, updated).unwrap_or_else(|e| panic!("{}: {e}", readme.display()));
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(status) = helper(&args) {
        return status;
    }
    let options = match parse() {
        Mode::Run(options) => options,
        Mode::UpdateReadme { readme, from } => return update_readme(&readme, &from),
    };
    test_kit::require_root();
    if std::env::var_os(INSIDE).is_none() {
        return rerun_privately();
    }
    cni_bench::stop_on_signals().expect("signal handlers");
    let outcome = cni_bench::run(&options);
    let figures = outcome.figures();
    let machine = machine();
    let mut stdout = std::io::stdout().lock();
    let _ = write!(stdout, "{}", report::table(&figures));
    std::fs::create_dir_all(&options.out).expect("create the results folder");
    std::fs::write(options.out.join("latency.svg"), report::svg(&outcome)).expect("write the chart");
    std::fs::write(
        options.out.join("report.md"),
        report::markdown(&options, &outcome, &figures, &machine),
    )
    .expect("write the report");
    let line = report::json_line(&options, &outcome, &figures, &machine);
    std::fs::write(options.out.join("run.json"), format!("{line}\n")).expect("write run.json");
    let _ = writeln!(stdout, "report: {}", options.out.join("report.md").display());
    let _ = writeln!(stdout, "{line}");
    if outcome.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("bench: {} problem(s), see above", outcome.problems.len());
        ExitCode::FAILURE
    }
}
