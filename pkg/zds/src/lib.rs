//! Istio's ZDS ("ztunnel discovery") protocol: how the node agent tells
//! ztunnel which pods to serve in ambient mode. The agent listens on an
//! `AF_UNIX` `SOCK_SEQPACKET` socket (`/var/run/ztunnel/ztunnel.sock`);
//! ztunnel connects and says [`ZdsHello`]; the agent sends one
//! [`WorkloadRequest`] per packet (an add carrying the pod's netns as
//! `SCM_RIGHTS`, a keep, the snapshot's end, a delete) and waits for each
//! [`WorkloadResponse`] ack, which correlates only by order.
//!
//! [`messages`] are the protocol's (Istio's `pkg/zdsapi/zds.proto`, field
//! for field); [`packet`] is the framing both ends use: the agent's server
//! and the test kit's ztunnel stand-in.

#![forbid(unsafe_code)]

pub mod messages;
pub mod packet;

pub use messages::*;
pub use packet::{MAX_PACKET, PacketError, receive, send};
