//! `portmap`: chained after the plugin that gives the pod its addresses;
//! publishes the pod's `containerPort`s on the node's `hostPort`s.

#![forbid(unsafe_code)]

mod config;
mod plugin;
mod records;

use std::process::ExitCode;

fn main() -> ExitCode {
    cni::skel::run(&plugin::Portmap)
}
