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
//! - [`pod_event`]: the plugin's pod event (Istio's ambient mode,
//!   Istio's own wire): a pod's ADD waits until the agent has it in the
//!   mesh.

#![forbid(unsafe_code)]

pub mod log;
pub mod pod_event;
pub mod policy;
mod stream;
