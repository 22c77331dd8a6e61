//! The portmap plugin: chained after the plugin that gives the pod its
//! addresses, it publishes the pod's `containerPort`s on the node's
//! `hostPort`s. Its rules are its own ([`rules`]); `firewall` (the crate)
//! gives it the mechanism and conntrack.

#![forbid(unsafe_code)]

mod config;
mod plugin;
mod records;
pub mod rules;

pub use plugin::Portmap;
