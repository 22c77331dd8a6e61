//! A small, blocking Kubernetes API client for CNI plugins: one GET per
//! call, TLS checked against the cluster CA from the kubeconfig, bearer
//! token or client certificate, and name resolution that never touches NSS
//! (the binaries are static; glibc's NSS modules cannot be loaded there).

#![forbid(unsafe_code)]

mod config;
mod deadline;
mod error;
mod http;
pub mod resolve;

use std::path::Path;
use std::time::Instant;

pub use config::Credentials;
pub use error::{Error, Result};
use serde_json::Value;

/// A client for one API server, as a kubeconfig describes it.
#[derive(Debug, Clone)]
pub struct Client {
    server: http::Server,
    credentials: Credentials,
}

impl Client {
    pub fn from_kubeconfig(path: &Path) -> Result<Self> {
        let loaded = config::load(path)?;
        Ok(Client {
            server: http::Server::new(&loaded.server, &loaded.ca_pem, &loaded.credentials)?,
            credentials: loaded.credentials,
        })
    }

    /// `GET path`, answered by `deadline` (name resolution included); any
    /// status but 200 is an error carrying the status.
    pub fn get_json(&self, path: &str, deadline: Instant) -> Result<Value> {
        let (status, body) = self
            .server
            .get(path, self.credentials.token.as_deref(), deadline)?;
        let text = String::from_utf8_lossy(&body);
        if status != 200 {
            let message = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|v| v["message"].as_str().map(str::to_owned))
                .unwrap_or_else(|| text.trim().chars().take(200).collect());
            return Err(Error::Status {
                status,
                body: message,
            });
        }
        serde_json::from_slice(&body).map_err(|e| Error::Protocol(e.to_string()))
    }

    pub fn get_pod(&self, namespace: &str, name: &str, deadline: Instant) -> Result<Value> {
        self.get_json(&format!("/api/v1/namespaces/{namespace}/pods/{name}"), deadline)
    }

    pub fn get_namespace(&self, name: &str, deadline: Instant) -> Result<Value> {
        self.get_json(&format!("/api/v1/namespaces/{name}"), deadline)
    }

    pub fn server_url(&self) -> &str {
        self.server.url()
    }
}
