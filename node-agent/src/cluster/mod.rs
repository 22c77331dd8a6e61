//! The cluster as the agent sees it, at the bottom of the crate beside
//! the settings and the error type: how it reaches the API server
//! (`client`), what it reads of the Nodes (`node`) and the cluster's pod
//! range as kubeadm records it (`pod_range`), a watched kind as a
//! controller keeps it (`watched`), and the one Pod watch its readers
//! share (`pods`).

pub mod client;
pub mod node;
pub mod pod_range;
pub mod pods;
pub mod watched;
