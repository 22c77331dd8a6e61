//! The API server as a pod on the host network reaches it: by the address
//! in `KUBERNETES_SERVICE_HOST`/`PORT` (cluster DNS may not work before
//! the network this agent sets up does), trusting the service account's
//! CA, with its token read from the file on every request the client
//! makes (the kubelet rotates it).

use std::path::Path;

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

use crate::error::Error;

/// `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`.
pub fn server_url() -> Result<String, Error> {
    let host = std::env::var("KUBERNETES_SERVICE_HOST")
        .map_err(|_| Error::Setting("KUBERNETES_SERVICE_HOST is not set".into()))?;
    let port = std::env::var("KUBERNETES_SERVICE_PORT")
        .map_err(|_| Error::Setting("KUBERNETES_SERVICE_PORT is not set".into()))?;
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    Ok(format!("https://{host}:{port}"))
}

/// The in-cluster configuration, from the environment and `account_dir`.
pub fn config(account_dir: &Path) -> Result<kube::Config, Error> {
    let server = server_url()?;
    let url: http::Uri = server
        .parse()
        .map_err(|e| Error::Setting(format!("the API server's address {server}: {e}")))?;
    let ca_path = account_dir.join("ca.crt");
    let ca = crate::atomic::read_text(&ca_path).map_err(|e| Error::read(&ca_path, e))?;
    let roots = CertificateDer::pem_slice_iter(ca.as_bytes())
        .map(|cert| cert.map(|der| der.to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Setting(format!("{}: {e}", ca_path.display())))?;
    if roots.is_empty() {
        return Err(Error::Setting(format!(
            "{} holds no certificate",
            ca_path.display()
        )));
    }
    let token = account_dir.join("token");
    if !token.is_file() {
        return Err(Error::Setting(format!(
            "no service account token at {}",
            token.display()
        )));
    }
    let mut config = kube::Config::new(url);
    // A server that accepts and never answers must not hold the agent
    // forever: as long as a watch may last (its timeoutSeconds is 290)
    // and a little more.
    config.read_timeout = Some(std::time::Duration::from_secs(295));
    // The Service address (in-cluster config) answers only once kube-proxy
    // has programmed it, which on a new node can be after the agent starts
    // (kube-proxy first waits for its Node object). A SYN sent before that
    // goes nowhere, and its retransmissions keep the first packet's
    // un-NATed conntrack entry, so only a new connection can succeed: give
    // up on one after 3 s, not kube's 30 (seen on the real cluster: every
    // agent Ready 30 s late).
    config.connect_timeout = Some(std::time::Duration::from_secs(3));
    config.root_cert = Some(roots);
    config.auth_info.token_file = Some(token.display().to_string());
    if let Ok(namespace) = crate::atomic::read_text(&account_dir.join("namespace")) {
        config.default_namespace = namespace.trim().to_owned();
    }
    Ok(config)
}
