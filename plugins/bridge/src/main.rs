//! `bridge`: the node bridge, a veth pair into the pod, addresses, routes
//! and masquerade; addressing is delegated to an IPAM plugin.

#![forbid(unsafe_code)]

mod config;
mod host;
mod lease;
mod masq;
mod plugin;
mod pod;
mod undo;

use std::process::ExitCode;

fn main() -> ExitCode {
    cni::skel::run(&plugin::Bridge)
}
