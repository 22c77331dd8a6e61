//! The cluster tier: the node agent against the Kubernetes API test server,
//! one module per controller of `node-agent/src/controllers/` (the Node
//! watch and the test server against kube-rs: `node_watch`, the
//! configuration it writes: `conflist`, its routes: `routes`, the lease
//! service: `lease_service`, what uninstalling removes and keeps:
//! `uninstall`, Istio's chain: `istio_chain`, pods repaired: `repair`, Istio's ambient mode with ztunnel standing in:
//! `ambient`), its
//! metrics against what happened on its node: `agent_metrics`, the plugins'
//! log records in its log: `agent_logs`, NetworkPolicy from the API
//! server's objects: `agent_policy`, its gate, open files and the xtables
//! lock at their limits: `agent_limits`), Istio's CNI alone beside another
//! network (`istio_only`), three nodes wired by their agents
//! (`cluster_lab`, `make demo-cluster`), and the suite on a real Kubernetes
//! (`real_cluster`, and Istio's CNI alone beside a kindnetd stand-in there:
//! `real_istio_only`; ignored but by `make cluster-test`, which brings that
//! cluster up). Helpers the modules share are in `common`: no test module
//! imports another.

mod agent_limits;
mod agent_logs;
mod agent_metrics;
mod agent_policy;
mod ambient;
mod cluster_lab;
mod common;
mod conflist;
mod istio_chain;
mod istio_only;
mod lease_service;
mod node_watch;
mod real_cluster;
mod real_istio_only;
mod repair;
mod routes;
mod uninstall;
