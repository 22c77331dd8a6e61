//! `loopback`: sets `lo` up in the pod's network namespace.

mod loopback;

use std::process::ExitCode;

fn main() -> ExitCode {
    cni::skel::run(&loopback::Loopback)
}
