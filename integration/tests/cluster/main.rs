//! The cluster tier: the node agent against the Kubernetes API test server
//! (`node_agent`, its metrics against what happened on its node:
//! `agent_metrics`, the plugins' log records in its log: `agent_logs`, NetworkPolicy from
//! the API server's objects: `agent_policy`, its gate, open files and
//! the xtables lock at their limits: `agent_limits`),
//! Istio's CNI alone beside another network
//! (`istio_only`), three nodes wired by their agents (`cluster_lab`, `make
//! demo-cluster`), and the suite on a real Kubernetes (`real_cluster`, and
//! Istio's CNI alone beside a kindnetd stand-in there: `real_istio_only`;
//! ignored but by `make cluster-test`, which brings that cluster up). One
//! module per former test file.

mod agent_limits;
mod agent_logs;
mod agent_metrics;
mod agent_policy;
mod cluster_lab;
mod istio_only;
mod node_agent;
mod real_cluster;
mod real_istio_only;
