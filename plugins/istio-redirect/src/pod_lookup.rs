//! The pod from the Kubernetes API, retried (Istio: 30 attempts, 1 s
//! apart) within one deadline for the whole lookup, name resolution, TLS
//! and every byte of every answer included: a server that never answers,
//! or answers a byte at a time, costs at most `api_deadline_ms`. A pod that
//! cannot be read fails ADD: a pod must never start without its capture
//! (fail closed, Istio #17583).

use std::time::{Duration, Instant};

use cni::{Error, Result};
use serde_json::Value;

use crate::config::IstioConfig;

/// What one attempt may take of the deadline, as Istio's client's timeout
/// per request: a server that hangs one connection (a load balancer
/// failing over) costs one attempt, not the whole lookup.
const ATTEMPT_LIMIT: Duration = Duration::from_secs(10);

pub fn get_pod(cfg: &IstioConfig, namespace: &str, name: &str) -> Result<Value> {
    let deadline = Instant::now() + cfg.api_deadline;
    let client = apiserver::Client::from_kubeconfig(&cfg.kubeconfig)
        .map_err(|e| Error::try_again_later(format!("cannot build a Kubernetes client: {e}")))?;
    let mut last = String::new();
    let mut attempts = 0;
    while attempts < cfg.api_attempts {
        attempts += 1;
        let attempt_deadline = deadline.min(Instant::now() + ATTEMPT_LIMIT);
        match client.get_pod(namespace, name, attempt_deadline) {
            Ok(pod) => return Ok(pod),
            Err(apiserver::Error::Timeout) if Instant::now() >= deadline => break,
            Err(e) => {
                log::warn!(
                    "attempt {attempts}/{}: get pod {namespace}/{name}: {e}",
                    cfg.api_attempts
                );
                last = e.to_string();
            }
        }
        let pause = cfg
            .api_retry_delay
            .min(deadline.saturating_duration_since(Instant::now()));
        if attempts < cfg.api_attempts {
            std::thread::sleep(pause);
        }
    }
    let server = client.server_url();
    if Instant::now() >= deadline {
        let seconds = cfg.api_deadline.as_secs_f64();
        let after = if last.is_empty() {
            String::new()
        } else {
            format!(" (last error: {last})")
        };
        return Err(Error::try_again_later(format!(
            "failed to get pod {namespace}/{name}: the Kubernetes API server {server} did not answer within {seconds} s (api_deadline_ms), {attempts} attempts{after}"
        )));
    }
    Err(Error::try_again_later(format!(
        "failed to get pod {namespace}/{name} from {server} after {attempts} attempts: {last}"
    )))
}
