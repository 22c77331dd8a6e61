//! `istio-redirect`: chained last, programs Istio's sidecar traffic capture
//! inside the pod's network namespace, so pods need no privileged
//! `istio-init` container.

#![forbid(unsafe_code)]

mod annotations;
mod config;
mod plugin;
mod pod;
mod pod_lookup;

use std::process::ExitCode;

fn main() -> ExitCode {
    cni::skel::run(&plugin::IstioRedirect)
}
