//! The plugins tier: each built plugin binary (and cnictl) executed the way
//! a runtime executes it, inside a node namespace with pod namespaces, next
//! to Debian's reference plugins; its inputs good and bad, its leases and
//! lease service, its rules read back from the kernel. One module per
//! former test file.

mod ambient;
mod bad_input;
mod bridge;
mod chain;
mod common;
mod drop_in;
mod firewall;
mod host_local;
mod istio;
mod lease_path;
mod loopback;
mod null_keys;
mod portmap;
mod reference_chains;
