//! The istio-redirect plugin: chained last, it programs Istio's sidecar
//! traffic capture inside the pod's network namespace, so pods need no
//! privileged `istio-init` container. The capture rules are its own
//! ([`rules`]; the node agent's repair asks them whether a pod is
//! captured); `firewall` (the crate) gives it the mechanism.

#![forbid(unsafe_code)]

mod annotations;
mod config;
pub mod enrolment;
mod plugin;
mod pod;
mod pod_lookup;
pub mod rules;

pub use annotations::ambient_overrides;
pub use config::{Ambient, EntryAmbient, ambient_of_entry};
pub use plugin::IstioRedirect;
