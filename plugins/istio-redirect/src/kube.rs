//! The pod from the Kubernetes API, retried with a bounded backoff (Istio:
//! 30 attempts, 1 s apart). A pod that cannot be read fails ADD: a pod must
//! never start without its capture (fail closed, Istio #17583).

use cni::{Error, Result};
use serde_json::Value;

use crate::config::IstioConfig;

pub fn get_pod(cfg: &IstioConfig, namespace: &str, name: &str) -> Result<Value> {
    let client = kube::Client::from_kubeconfig(&cfg.kubeconfig)
        .map_err(|e| Error::try_again_later(format!("cannot build a Kubernetes client: {e}")))?;
    let mut last = String::new();
    for attempt in 1..=cfg.api_attempts {
        match client.get_pod(namespace, name) {
            Ok(pod) => return Ok(pod),
            Err(e) => {
                log::warn!(
                    "attempt {attempt}/{}: get pod {namespace}/{name}: {e}",
                    cfg.api_attempts
                );
                last = e.to_string();
            }
        }
        if attempt < cfg.api_attempts {
            std::thread::sleep(cfg.api_retry_delay);
        }
    }
    Err(Error::try_again_later(format!(
        "failed to get pod {namespace}/{name} from {} after {} attempts: {last}",
        client.server_url(),
        cfg.api_attempts
    )))
}
