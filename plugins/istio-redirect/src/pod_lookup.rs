//! The pod (and, in ambient mode, its namespace) from the Kubernetes API,
//! each GET retried (Istio: 30 attempts, 1 s apart) within one deadline
//! for the whole lookup, name resolution, TLS and every byte of every
//! answer included: a server that never answers, or answers a byte at a
//! time, costs at most `api_deadline_ms`. What cannot be read fails ADD:
//! a pod must never start without its capture (fail closed, Istio #17583).

use std::time::{Duration, Instant};

use cni::{Error, Result};
use serde_json::Value;

use crate::config::IstioConfig;

/// What one attempt may take of the deadline, as Istio's client's timeout
/// per request: a server that hangs one connection (a load balancer
/// failing over) costs one attempt, not the whole lookup.
const ATTEMPT_LIMIT: Duration = Duration::from_secs(10);

/// One lookup's client and deadline.
pub struct Lookup<'a> {
    cfg: &'a IstioConfig,
    client: apiserver::Client,
    deadline: Instant,
}

impl<'a> Lookup<'a> {
    pub fn new(cfg: &'a IstioConfig) -> Result<Self> {
        let deadline = Instant::now() + cfg.api_deadline;
        let client = apiserver::Client::from_kubeconfig(&cfg.kubeconfig)
            .map_err(|e| Error::try_again_later(format!("cannot build a Kubernetes client: {e}")))?;
        Ok(Lookup {
            cfg,
            client,
            deadline,
        })
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Result<Value> {
        self.get(&format!("pod {namespace}/{name}"), |client, deadline| {
            client.get_pod(namespace, name, deadline)
        })
    }

    pub fn namespace(&self, name: &str) -> Result<Value> {
        self.get(&format!("namespace {name}"), |client, deadline| {
            client.get_namespace(name, deadline)
        })
    }

    fn get(
        &self,
        what: &str,
        request: impl Fn(&apiserver::Client, Instant) -> apiserver::Result<Value>,
    ) -> Result<Value> {
        let (cfg, deadline) = (self.cfg, self.deadline);
        let mut last = String::new();
        let mut attempts = 0;
        while attempts < cfg.api_attempts {
            attempts += 1;
            let attempt_deadline = deadline.min(Instant::now() + ATTEMPT_LIMIT);
            match request(&self.client, attempt_deadline) {
                Ok(object) => return Ok(object),
                Err(apiserver::Error::Timeout) if Instant::now() >= deadline => break,
                Err(e) => {
                    log::warn!("attempt {attempts}/{}: get {what}: {e}", cfg.api_attempts);
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
        let server = self.client.server_url();
        if Instant::now() >= deadline {
            let seconds = cfg.api_deadline.as_secs_f64();
            let after = if last.is_empty() {
                String::new()
            } else {
                format!(" (last error: {last})")
            };
            return Err(Error::try_again_later(format!(
                "failed to get {what}: the Kubernetes API server {server} did not answer within {seconds} s (api_deadline_ms), {attempts} attempts{after}"
            )));
        }
        Err(Error::try_again_later(format!(
            "failed to get {what} from {server} after {attempts} attempts: {last}"
        )))
    }
}
