//! What ambient mode needs of the settings and of Istio's entry.

use std::path::{Path, PathBuf};

use istio_redirect::enrolment::Enrolment;
use istio_redirect::rules::ambient::InPodBackend;
use serde_json::Value;

use crate::error::Error;
use crate::settings::Settings;

/// What ambient mode needs of the settings and of Istio's entry.
#[derive(Debug, Clone)]
pub struct Options {
    pub node_name: String,
    /// Where the plugin sends its pod events: the entry's
    /// `cni_agent_run_dir`, as the plugin reads it.
    pub pod_event_socket: PathBuf,
    pub ztunnel_socket: PathBuf,
    /// The entry's selectors, as the plugin reads them.
    pub enrolment: Enrolment,
    pub exclude_namespaces: Vec<String>,
    /// DNS to ztunnel's proxy unless a pod says otherwise.
    pub dns_capture: bool,
    /// IPv6 rules for pods with IPv6 addresses.
    pub ipv6: bool,
    /// How the in-pod rules are written, as the entry says.
    pub backend: InPodBackend,
}

impl Options {
    /// Where the pods' records are: beside the pod event socket.
    pub fn records_dir(&self) -> PathBuf {
        let run_dir = self.pod_event_socket.parent().unwrap_or(Path::new("/"));
        run_dir.join("ambient-pods")
    }

    /// None unless Istio's entry (`entry`, as the agent writes it) enables
    /// ambient mode.
    pub fn from_settings(settings: &Settings, entry: &Value) -> Result<Option<Options>, Error> {
        let read = istio_redirect::ambient_of_entry(entry)
            .map_err(|e| Error::Setting(format!("Istio's entry in ambient mode: {}", e.msg)))?;
        Ok(read.map(|read| Options {
            node_name: settings.node_name.clone(),
            pod_event_socket: read.ambient.pod_event_socket,
            ztunnel_socket: settings.ztunnel_uds_address.clone(),
            enrolment: read.ambient.enrolment,
            exclude_namespaces: read.exclude_namespaces,
            dns_capture: settings.ambient_dns_capture,
            ipv6: settings.ambient_ipv6,
            backend: read.backend,
        }))
    }
}
