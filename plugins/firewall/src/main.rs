//! `firewall`: chained after a plugin that gave the pod its addresses
//! (bridge), lets the pod's traffic through the node's FORWARD path even
//! when the node's policy drops, and can isolate bridges from each other.

#![forbid(unsafe_code)]

mod config;
mod plugin;
mod state;

use std::process::ExitCode;

fn main() -> ExitCode {
    cni::skel::run(&plugin::Firewall)
}
