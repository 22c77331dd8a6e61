//! `host-local`: the CNI IPAM plugin, and (`host-local serve`) the node-local
//! lease service that keeps its databases open.

#![forbid(unsafe_code)]

mod plugin;
mod serve;

use std::process::ExitCode;

/// The lease service lives long and keeps sled's page cache of every
/// network in its heap; under glibc's allocator each call then spent about
/// a third of its CPU in `_int_malloc` walking fragmented bins (perf, 60000
/// leases), twice the cost at 10 leases.
/// Transparent huge pages off (`no_thp`): mimalloc asked the kernel for them on
/// its arenas, and zeroing 2 MiB pages on first touch made opening a new sled
/// database take 4–98 ms instead of 1 ms (the first pod of a node paid it).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    match args.next() {
        Some(first) if first == "serve" => serve::main(args),
        _ => plugin::main(),
    }
}
