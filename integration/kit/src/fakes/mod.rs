//! Stand-ins for what a node talks to, run by the tests themselves: a
//! Kubernetes API server (`api_server`), a private containerd with its
//! CRI plugin and a kubelet's calls (`containerd`), and ztunnel on the
//! agent's ZDS socket (`ztunnel`).

pub mod api_server;
pub mod containerd;
pub mod ztunnel;
