//! `make bench`: the suite and Debian's reference plugins side by side in
//! one run. Prints the table of medians and ratios, writes the report and
//! chart under `--out`, and ends with one JSON line holding every figure.
//! Exits non-zero on any failure, duplicate address or leak, never on a
//! timing.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use integration::bench::{self, Options, report};

fn usage() -> ! {
    eprintln!("usage: cni-bench [--pods N] [--repeats N] [--full-leases N] [--out DIR]");
    std::process::exit(2)
}

fn parse() -> Options {
    let mut options = Options {
        pods: 50,
        repeats: 3,
        full_leases: 60000,
        out: PathBuf::from("bench-results"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_else(|| usage());
        let number = || value.parse::<usize>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--pods" => options.pods = number().max(1),
            "--repeats" => options.repeats = number().max(1),
            "--full-leases" => options.full_leases = number().min(65000),
            "--out" => options.out = PathBuf::from(&value),
            _ => usage(),
        }
    }
    options
}

fn machine() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get);
    format!("Linux {}, {cpus} CPUs", kernel.trim())
}

fn main() -> ExitCode {
    let options = parse();
    integration::require_root();
    let outcome = bench::run(&options);
    let medians = outcome.medians();
    let mut stdout = std::io::stdout().lock();
    let _ = write!(stdout, "{}", report::table(&medians));
    std::fs::create_dir_all(&options.out).expect("create the results folder");
    std::fs::write(options.out.join("latency.svg"), report::svg(&outcome)).expect("write the chart");
    std::fs::write(
        options.out.join("report.md"),
        report::markdown(&options, &outcome, &medians, &machine()),
    )
    .expect("write the report");
    let _ = writeln!(stdout, "report: {}", options.out.join("report.md").display());
    let _ = writeln!(stdout, "{}", report::json_line(&options, &outcome, &medians));
    if outcome.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("bench: {} problem(s), see above", outcome.problems.len());
        ExitCode::FAILURE
    }
}
