//! The node agent's wires: what goes between a plugin and the agent of
//! its node, each side's types in one place, so the plugin that sends and
//! the agent that reads cannot drift apart. `cni` is the protocol and
//! knows nothing of the agent; this crate builds on it, never the reverse.
//!
//! - [`log`]: the log socket (`logSocket`): one JSON datagram per record,
//!   and the plugin's sending end, which the skeleton opens through
//!   [`cni::skel::Plugin::LOG_SOCKET`].
//! - [`policy`]: the NetworkPolicy gate (`policySocket`): a pod's ADD
//!   waits, bounded, for the kernel to hold its policy; and where the
//!   agent records which namespaces have one ([`policy::guarded`]).
//!
//! The plugin's pod event to the agent (Istio's ambient mode) is to be
//! the third wire, a module of its own beside these.

#![forbid(unsafe_code)]

pub mod log;
pub mod policy;
