//! The portmap plugin: chained after the plugin that gives the pod its
//! addresses, it publishes the pod's `containerPort`s on the node's
//! `hostPort`s. Its rules are its own ([`mapper`]); `firewall` (the crate)
//! gives it the mechanism and conntrack.

#![forbid(unsafe_code)]

mod config;
pub mod mapper;
mod plugin;
mod records;

pub use plugin::Portmap;
