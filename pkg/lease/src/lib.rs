//! host-local's lease path: how a call of host-local, of the bridge, of
//! `cnictl ipam` or of the node agent reaches the leases, with no store of
//! its own (the store is `ipam`'s, wired in by host-local as a
//! [`server::Handler`]).
//!
//! - [`wire`]: what is asked ([`Call`]) and, private, how it travels.
//! - [`client`]: the one path a call takes ([`ask`] along a [`Route`]).
//! - [`server`]: the service process, generic over what answers, and
//!   [`start`]: starting one on demand, detached.
//! - [`served`]: what a service has answered, counted by the service and
//!   asked for by the node agent ([`client::served`]).
//! - [`socket`]: which sockets and peers are trusted (the directories:
//!   [`ipam_config::trust`]).

#![forbid(unsafe_code)]

pub mod client;
pub mod served;
pub mod server;
pub mod socket;
pub mod start;
pub mod wire;

use std::path::Path;

pub use client::{PATIENCE, Route, ask};
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
