//! `host-local`: the CNI IPAM plugin, and (`host-local serve`) the node-local
//! lease service that keeps its databases open.

#![forbid(unsafe_code)]

mod plugin;
mod serve;

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    match args.next() {
        Some(first) if first == "serve" => serve::main(args),
        _ => plugin::main(),
    }
}
