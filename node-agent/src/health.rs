//! `/healthz` (the process answers) and `/readyz` (the binaries are
//! installed, the Nodes listed, this node's configuration, the routes to
//! the other nodes and the masquerade in place, and the NetworkPolicy
//! gate listening where one is configured), over plain HTTP for the
//! kubelet's probes; and `/metrics` beside them, for Prometheus
//! ([`crate::metrics`]). At most [`MOST_CONNECTIONS`] are answered at once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::error::Error;
use crate::metrics::{self, Metrics};

#[derive(Debug, Clone, Default)]
pub struct Health {
    installed: Arc<AtomicBool>,
    listed: Arc<AtomicBool>,
    configured: Arc<AtomicBool>,
    routed: Arc<AtomicBool>,
    masqueraded: Arc<AtomicBool>,
    /// Istio's entry is in the primary configuration (true when that mode
    /// is off).
    chained: Arc<AtomicBool>,
    /// A NetworkPolicy gate is configured and does not listen: new pods'
    /// ADDs are unconfirmed (refused in a namespace with a policy).
    gate_down: Arc<AtomicBool>,
}

impl Health {
    pub fn set_installed(&self, done: bool) {
        self.installed.store(done, Ordering::SeqCst);
    }

    pub fn set_chained(&self, done: bool) {
        self.chained.store(done, Ordering::SeqCst);
    }

    pub fn set_masqueraded(&self, done: bool) {
        self.masqueraded.store(done, Ordering::SeqCst);
    }

    pub fn set_listed(&self, done: bool) {
        self.listed.store(done, Ordering::SeqCst);
    }

    pub fn set_configured(&self, done: bool) {
        self.configured.store(done, Ordering::SeqCst);
    }

    pub fn set_routed(&self, done: bool) {
        self.routed.store(done, Ordering::SeqCst);
    }

    /// Whether the configured NetworkPolicy gate listens (never called
    /// without one).
    pub fn set_gate_listening(&self, listening: bool) {
        self.gate_down.store(!listening, Ordering::SeqCst);
    }

    /// Istio's CNI alone (`OWN_NETWORK=false`): the node's network is
    /// another's, so nothing of it is waited for.
    pub fn set_network_not_ours(&self) {
        for part in [&self.listed, &self.configured, &self.routed, &self.masqueraded] {
            part.store(true, Ordering::SeqCst);
        }
    }

    /// Why the agent is not ready, if it is not.
    pub fn not_ready(&self) -> Option<&'static str> {
        if !self.installed.load(Ordering::SeqCst) {
            Some("the plugin binaries are not in place")
        } else if !self.listed.load(Ordering::SeqCst) {
            Some("the Nodes are not listed and watched")
        } else if !self.configured.load(Ordering::SeqCst) {
            Some("this node's CNI configuration is not in place")
        } else if !self.routed.load(Ordering::SeqCst) {
            Some("the routes to the other nodes' pods are not in place")
        } else if !self.masqueraded.load(Ordering::SeqCst) {
            Some("the masquerade of traffic leaving the cluster is not in place")
        } else if !self.chained.load(Ordering::SeqCst) {
            Some("istio-redirect is not chained into the node's primary CNI configuration")
        } else if self.gate_down.load(Ordering::SeqCst) {
            Some("the NetworkPolicy gate does not listen on POLICY_SOCKET (the agent's log says why)")
        } else {
            None
        }
    }
}

/// The most connections answered at once: the kubelet's probes and a
/// few scrapers need a handful. One more is accepted and closed at once,
/// unanswered, so clients that connect and send nothing (each may hold
/// its connection for [`HEAD_WAIT`]) can take neither the agent's
/// descriptors nor the kernel's accept queue, and a prober past the cap is
/// told at once rather than left queued behind them.
pub const MOST_CONNECTIONS: usize = 64;

/// How long a client may take to send its request's head.
const HEAD_WAIT: Duration = Duration::from_secs(5);

/// Binds `address` now (so a port in use fails the start) and answers
/// probes and scrapes until the process ends.
pub async fn serve(
    address: SocketAddr,
    health: Health,
    metrics: Metrics,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let listener = match TcpListener::bind(address).await {
        // `[::]` also answers IPv4, and is what an IPv6-only node's kubelet
        // probes; on a kernel without IPv6 it cannot be bound.
        Err(_) if address.ip() == std::net::Ipv6Addr::UNSPECIFIED => {
            let v4 = SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, address.port()));
            TcpListener::bind(v4).await
        }
        bound => bound,
    }
    .map_err(|source| Error::Listen { address, source })?;
    Ok(tokio::spawn(answer_on(
        listener,
        health,
        metrics,
        MOST_CONNECTIONS,
        HEAD_WAIT,
    )))
}

/// Answers on `listener`, at most `most` connections at once, each
/// given `head_wait` to send its request.
async fn answer_on(
    listener: TcpListener,
    health: Health,
    metrics: Metrics,
    most: usize,
    head_wait: Duration,
) {
    let open = Arc::new(Semaphore::new(most));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors, say: not a reason to spin.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            // Past the cap: closed unanswered (see MOST_CONNECTIONS).
            drop(stream);
            continue;
        };
        let (health, metrics) = (health.clone(), metrics.clone());
        tokio::spawn(async move {
            answer(stream, &health, metrics, head_wait).await;
            drop(permit);
        });
    }
}

/// Reads one request and answers it.
async fn answer(mut stream: tokio::net::TcpStream, health: &Health, metrics: Metrics, head_wait: Duration) {
    let read = tokio::time::timeout(head_wait, read_head(&mut stream)).await;
    let Ok(Ok(head)) = read else {
        return;
    };
    let line = String::from_utf8_lossy(&head);
    let target = line.split_whitespace().nth(1).unwrap_or_default();
    let path = target.split('?').next().unwrap_or_default();
    let plain = "text/plain";
    let (code, body, content_type) = match path {
        "/healthz" => (200, "ok".to_owned(), plain),
        "/readyz" => match health.not_ready() {
            None => (200, "ok".to_owned(), plain),
            Some(reason) => (503, reason.to_owned(), plain),
        },
        "/metrics" => {
            let ready = health.not_ready().is_none();
            // It asks the lease service over a blocking socket.
            match tokio::task::spawn_blocking(move || metrics.scrape(ready)).await {
                Ok(exposition) => (200, exposition, metrics::CONTENT_TYPE),
                Err(e) => (500, e.to_string(), plain),
            }
        }
        _ => (404, "not found".to_owned(), plain),
    };
    let reason = match code {
        200 => "OK",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Not Found",
    };
    let response = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
}

/// The request up to its blank line (at most 4 KiB): answering before all
/// of it is read would reset the connection under the prober.
async fn read_head(stream: &mut tokio::net::TcpStream) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut buffer = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 4096 {
        let read = stream.read(&mut buffer).await?;
        if read == 0 {
            break;
        }
        head.extend_from_slice(&buffer[..read]);
    }
    Ok(head)
}

#[cfg(test)]
mod tests {
    use tokio::net::TcpStream;

    use super::*;

    /// What `path` is answered with: the whole response, empty when the
    /// connection is closed unanswered.
    async fn get(address: SocketAddr, path: &str) -> String {
        let mut stream = TcpStream::connect(address).await.expect("connect");
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
        // Refused connections may be reset before or after the request.
        let _ = stream.write_all(request.as_bytes()).await;
        let mut response = Vec::new();
        let _ = stream.read_to_end(&mut response).await;
        String::from_utf8_lossy(&response).into_owned()
    }

    #[tokio::test]
    async fn past_the_cap_a_connection_is_closed_unanswered_until_one_answered_ends() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        // Idle clients keep their places for as long as the test runs.
        let head_wait = Duration::from_secs(600);
        tokio::spawn(answer_on(
            listener,
            Health::default(),
            Metrics::new(None),
            2,
            head_wait,
        ));
        let first_idle = TcpStream::connect(address).await.expect("connect");
        let _second_idle = TcpStream::connect(address).await.expect("connect");
        assert_eq!(get(address, "/healthz").await, "", "a third is closed unanswered");

        drop(first_idle);
        // Its place is free once the agent has seen it go (the bound
        // only keeps a broken cap from hanging the test).
        let answered = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let response = get(address, "/healthz").await;
                if !response.is_empty() {
                    break response;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("answered once a place is free");
        assert!(answered.starts_with("HTTP/1.1 200 OK\r\n"), "{answered}");
        assert!(answered.ends_with("\r\n\r\nok"), "{answered}");
    }
}
