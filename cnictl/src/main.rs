//! `cnictl`: runs a network configuration list against a namespace the way
//! cnitool does, sharing libcni's result cache with it.

#![forbid(unsafe_code)]

mod cli;
mod output;
mod runner;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match runner::run(&cli) {
        Ok(report) => {
            output::print_report(&report, cli.global.json);
            ExitCode::SUCCESS
        }
        Err(failure) => {
            output::print_failure(&failure, cli.global.json);
            ExitCode::FAILURE
        }
    }
}
