//! Stand-ins for what a node talks to, run by the tests themselves: a
//! Kubernetes API server (`api_server`) and a private containerd with its
//! CRI plugin and a kubelet's calls (`containerd`).

pub mod api_server;
pub mod containerd;
