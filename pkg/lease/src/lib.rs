//! host-local's lease path: how a call of host-local, of the bridge, of
//! `cnictl ipam` or of the node agent reaches the leases, with no store of
//! its own (the store is `ipam`'s, wired in by host-local as a
//! [`server::Handler`]).
//!
//! - [`settings`]: which service and data directory a configuration names.
//! - [`wire`]: what is asked ([`Call`]) and, private, how it travels.
//! - [`client`]: the one path a call takes ([`ask`] along a [`Route`]).
//! - [`server`]: the service process, generic over what answers, and
//!   [`start`]: starting one on demand, detached.
//! - [`served`]: what a service has answered, counted by the service and
//!   asked for by the node agent ([`client::served`]).
//! - [`trust`] and [`socket`]: which directories, sockets and peers are
//!   trusted.

#![forbid(unsafe_code)]

pub mod client;
pub mod served;
pub mod server;
pub mod settings;
pub mod socket;
pub mod start;
pub mod trust;
pub mod wire;

use std::path::Path;

pub use client::{PATIENCE, Route, ask};
pub use settings::{DEFAULT_DATA_DIR, LeaseSettings, SocketSetting, data_dir_socket};
pub use wire::{AdminOp, Call, admin_reply};

/// Who serves at `socket`: the process id of a trusted service listening
/// there (0 when it runs outside this process's pid namespace), None when
/// nothing trusted listens.
pub fn serving_pid(socket: &Path) -> Option<i32> {
    let stream = socket::connect(socket).ok()?;
    socket::peer_pid(&stream)
}

/// Whether a trusted service listens at `socket`.
pub fn is_served(socket: &Path) -> bool {
    socket::connect(socket).is_ok()
}
