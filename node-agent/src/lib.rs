//! The node agent `cni-node-agent` as a library; `main.rs`, its binary,
//! only parses the settings and runs the agent ([`agent`]) until a signal. See
//! node-agent/README.md.
//!
//! Layers, each importing only from those below it (and no two modules
//! importing each other):
//!
//! 1. The bottom: [`error`] (the one error type), [`settings`] (every
//!    flag and mode the agent is told) and [`cluster`] (the cluster as the
//!    agent sees it: the API server's client configuration, what it reads
//!    of the Nodes, the cluster's pod range, a watched kind as a
//!    controller keeps it (`watched`) and the one Pod watch its readers
//!    share (`pods`)).
//! 2. The node's shared facilities, used by several controllers:
//!    [`atomic`] (whole-file writes, bounded reads, the bin directory's
//!    lock), [`changes`] (no change once uninstall has begun, uninstall
//!    once the changes in progress are done; the resync period), [`conf_dir`] (the CNI
//!    configuration directory), [`record`] (what the agent changed, kept on
//!    the node), [`health`] (readiness and its probes, and `/metrics`),
//!    [`metrics`] (what the controllers count, and the lease service's
//!    counts, as Prometheus scrapes them), [`run_socket`] (the sockets the
//!    plugins reach the agent on), [`open_files`] (the soft limit on
//!    open files raised to the hard one at start), [`pod_netns`] (a
//!    running pod's network namespace), [`iptables_mode`] (which iptables),
//!    [`leftovers`] (what the suite left in the node's nat tables that no
//!    one uses, recorded and removed) and [`logging`].
//! 3. [`controllers`]: each keeps one thing in line, with a small
//!    `Options` built from the settings and one `run`: the conflist, the
//!    routes and the masquerade (`egress`), run by the Node watch
//!    (`node_watch`); the plugins' install, Istio's chained install
//!    (`istio_chain`), Istio's ambient mode (`ambient`: the plugin's pod
//!    events, the ZDS server), the repair of pods that raced it, the lease
//!    service, and the plugins' log records (`plugin_logs`).
//! 4. [`uninstall`]: what uninstall removes, one function per step.
//! 5. [`agent`]: the lifecycle, the controllers started in order and the
//!    stop and uninstall orders, each stated once.
//!
//! The controllers are a folder of their own, one file each, or a folder
//! where a controller has parts (`ambient/plugin_events.rs` and
//! `zds_server.rs`, `install/bin_dir.rs`, `istio_chain/files.rs`
//! and `kubeconfig.rs`, `lease_service/service.rs`, `egress/rules.rs`), so the layers show
//! in the tree.
//!
//! `unsafe`: two blocks, each run from `main` before its runtime's
//! threads start, and allowed there alone: where `iptables_mode` puts the
//! chosen iptables first on PATH (`std::env::set_var`, sound only before
//! any thread starts), and where `allocator` limits glibc's arenas to one
//! (`mallopt`).

#![deny(unsafe_code)]

pub mod allocator;
pub mod error;
pub mod settings;

pub mod cluster;

pub mod atomic;
pub mod changes;
pub mod conf_dir;
pub mod health;
pub mod iptables_mode;
pub mod leftovers;
pub mod logging;
pub mod metrics;
pub mod open_files;
pub mod pod_netns;
pub mod record;
pub mod run_socket;

pub mod controllers;

pub mod uninstall;

pub mod agent;
