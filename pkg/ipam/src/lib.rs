//! host-local's allocation and its lease store, with no sockets or
//! processes (the lease path is `lease`'s; host-local wires this store into
//! its service).
//!
//! - [`store`]: the sled database per network and its lock discipline;
//!   sled alone, it never reads the reference plugin's files.
//! - [`pool`]: the way in to a network ([`pool::with_network`]), and
//!   allocate, release, check, GC and STATUS on it.
//! - [`reference`]: the reference plugin's lease files: when to import
//!   them, importing, and removing a released lease's file.
//! - [`admin`]: operator commands (`lease::AdminOp`) on a network.
//!
//! Configuration, ranges and the checks made before the store are
//! `ipam_config`'s; its [`Error`] is this crate's too.

#![forbid(unsafe_code)]

pub mod admin;
pub mod pool;
pub mod reference;
pub mod store;

pub use ipam_config::Error;
