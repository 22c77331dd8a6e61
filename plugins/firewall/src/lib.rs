//! The firewall plugin: chained after a plugin that gave the pod its
//! addresses (bridge), it lets the pod's traffic through the node's FORWARD
//! path even when the node's policy drops, and can isolate bridges from
//! each other. The rules are its own ([`rules`]); `firewall` (the crate)
//! gives it the mechanism.

#![forbid(unsafe_code)]

mod address_index;
mod config;
mod plugin;
pub mod rules;
mod state;

pub use plugin::Firewall;
