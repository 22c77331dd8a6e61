//! `loopback`: sets `lo` up in the pod's network namespace.

#![forbid(unsafe_code)]

mod loopback;

use std::process::ExitCode;

fn main() -> ExitCode {
    cni::skel::run(&loopback::Loopback)
}
