//! The glue every plugin of the suite needs between the CNI protocol and
//! the kernel, written once so that a namespace, a netlink or a firewall
//! failure reads the same (code and message) whichever plugin reports it.

#![forbid(unsafe_code)]

mod errors;
mod namespace;
pub mod state_file;

pub use errors::{check_failed, combine, firewall_error, netlink_error, state_error};
pub use namespace::{netns_path, open_netns, open_netns_unless_gone, open_pod_netns};
