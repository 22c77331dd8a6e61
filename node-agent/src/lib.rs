//! The node agent `cni-node-agent` as a library; `main.rs` is its binary.
//! See docs/ARCHITECTURE.md, "The node agent".

pub mod atomic;
pub mod changes;
pub mod cluster;
pub mod conf_dir;
pub mod conflist;
pub mod error;
pub mod health;
pub mod install;
pub mod iptables_mode;
pub mod istio_chain;
pub mod istio_install;
pub mod istio_kubeconfig;
pub mod lease;
pub mod logging;
pub mod nodes;
pub mod pod_netns;
pub mod record;
pub mod repair;
pub mod routes;
pub mod settings;
