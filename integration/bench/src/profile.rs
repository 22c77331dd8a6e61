//! Where a bridge call's time and CPU go, under strace and perf, for the
//! report.

use std::path::{Path, PathBuf};

use serde_json::Value;
use test_kit::Netns;

use crate::outcome::{Outcome, check_calls};
use crate::suite::{Suite, check_leaks};

/// Profilers for the report, each told where to write its summary with
/// `-o`, so the plugin's stdout stays its own.
const PROFILERS: [(&str, &[&str]); 2] = [
    ("strace", &["-c", "-f", "-w"]),
    (
        "perf",
        &[
            "stat",
            "-e",
            "task-clock,context-switches,cpu-migrations,page-faults",
        ],
    ),
];

/// One more ADD and DEL per suite and profiler, for the report: where a
/// call's time and CPU go, child processes included (not the lease
/// service's: another process). A profiler that does not work here (perf
/// without access to counters) is reported as such; a plain DEL
/// afterwards and the leak check keep the suites honest anyway.
pub(crate) fn profile(out: &mut Outcome, suites: &[Suite]) {
    for suite in suites {
        for (tool, args) in PROFILERS {
            let title = |verb: &str| {
                format!(
                    "{} bridge {verb} under `{tool} {}`",
                    suite.setup.label(),
                    args.join(" ")
                )
            };
            let Some(program) = installed(tool) else {
                out.profiles
                    .push((title("ADD and DEL"), format!("{tool} is not installed")));
                continue;
            };
            let pod = Netns::new("profile");
            let (add, add_report) = suite.profiled(&program, args, "ADD", pod.path_str(), None);
            let result: Value = serde_json::from_str(&add.stdout).unwrap_or(Value::Null);
            let (del, del_report) = suite.profiled(&program, args, "DEL", pod.path_str(), Some(&result));
            for (verb, call, report) in [("ADD", add, add_report), ("DEL", del, del_report)] {
                let text = if call.ok {
                    report
                } else {
                    format!(
                        "failed under {tool}: {}{}",
                        call.stdout.trim(),
                        call.stderr.trim()
                    )
                };
                out.profiles.push((title(verb), text));
            }
            let cleanup = suite.call(
                "bridge",
                "DEL",
                "profiled",
                pod.path_str(),
                &suite.bridge_conf(Some(&result)),
            );
            check_calls(
                out,
                "DEL after profiling",
                suite.setup,
                std::slice::from_ref(&cleanup),
            );
        }
        check_leaks(out, "profile", suite);
    }
}

fn installed(tool: &str) -> Option<PathBuf> {
    ["/usr/local/bin", "/usr/bin", "/usr/sbin", "/bin", "/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(tool))
        .find(|path| path.is_file())
}
