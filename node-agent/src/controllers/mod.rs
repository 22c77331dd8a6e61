//! The controllers: each keeps one thing on the node in line, with a small
//! `Options` (built from the settings, holding only what it needs) and one
//! `run`. Those made from the Nodes (`conflist`, `routes`, `egress`) are
//! run in that order by `node_watch` at every change and resync; the
//! others run as tasks of their own (`install`, `istio_chain`, `network_policy`, `repair`,
//! `readiness_taint`, `lease_service`, `plugin_logs`). A controller may use one below it in this list, never
//! one above: `node_watch` runs the three made from the Nodes, and
//! `install` restarts the lease service.

pub mod node_watch;

pub mod ambient;
pub mod conflist;
pub mod egress;
pub mod install;
pub mod istio_chain;
pub mod network_policy;
pub mod readiness_taint;
pub mod repair;
pub mod routes;

pub mod lease_service;
pub mod plugin_logs;
