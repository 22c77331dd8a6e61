//! `/healthz` (the process answers) and `/readyz` (the Nodes are listed
//! and this node's configuration is in place), over plain HTTP for the
//! kubelet's probes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::Error;

#[derive(Debug, Clone, Default)]
pub struct Health {
    listed: Arc<AtomicBool>,
    configured: Arc<AtomicBool>,
}

impl Health {
    pub fn set_listed(&self, done: bool) {
        self.listed.store(done, Ordering::SeqCst);
    }

    pub fn set_configured(&self, done: bool) {
        self.configured.store(done, Ordering::SeqCst);
    }

    /// Why the agent is not ready, if it is not.
    pub fn not_ready(&self) -> Option<&'static str> {
        if !self.listed.load(Ordering::SeqCst) {
            Some("the Nodes are not listed yet")
        } else if !self.configured.load(Ordering::SeqCst) {
            Some("this node's CNI configuration is not in place")
        } else {
            None
        }
    }
}

/// Binds `address` now (so a port in use fails the start) and answers
/// probes until the process ends.
pub async fn serve(address: SocketAddr, health: Health) -> Result<tokio::task::JoinHandle<()>, Error> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|e| Error::Io(format!("cannot listen on {address} for health probes: {e}")))?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let health = health.clone();
            tokio::spawn(async move {
                let mut request = vec![0u8; 1024];
                let read =
                    tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut request)).await;
                let Ok(Ok(length)) = read else {
                    return;
                };
                let line = String::from_utf8_lossy(&request[..length]);
                let path = line.split_whitespace().nth(1).unwrap_or_default();
                let (code, body) = match path {
                    "/healthz" => (200, "ok".to_owned()),
                    "/readyz" => match health.not_ready() {
                        None => (200, "ok".to_owned()),
                        Some(reason) => (503, reason.to_owned()),
                    },
                    _ => (404, "not found".to_owned()),
                };
                let reason = match code {
                    200 => "OK",
                    503 => "Service Unavailable",
                    _ => "Not Found",
                };
                let response = format!(
                    "HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    }))
}
