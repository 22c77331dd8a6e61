//! The bridge plugin: the node bridge, a veth pair into the pod,
//! addresses, routes, and the rules it owns (masquerade off the node,
//! MAC spoof checking); addressing is delegated to an IPAM plugin.

#![forbid(unsafe_code)]

mod config;
mod host;
mod lease;
mod plugin;
mod pod;
pub mod rules;
pub mod spoofcheck;
mod undo;

pub use plugin::Bridge;
