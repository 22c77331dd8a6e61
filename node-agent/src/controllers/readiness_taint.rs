//! The start-up taint (`READINESS_TAINT`, Istio's `cni.istio.io/not-ready`):
//! a node registered with it gets no pod that does not tolerate it; the
//! agent removes it from its own Node once everything it keeps is in place
//! (its readiness), and never before, so pods that need the capture are
//! not scheduled onto a node where the chain is missing. Istio leaves this
//! to an optional controller of istiod; here the agent that knows its
//! chain is in place does it. The taint is only ever removed: an operator
//! (or a re-registering kubelet) adds it.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;

use crate::error::Error;
use crate::health::Health;
use crate::settings::Settings;

/// Which taint, on which Node.
#[derive(Debug, Clone)]
pub struct Options {
    pub node_name: String,
    /// The taint's key; every taint of that key (any effect) goes.
    pub key: String,
}

impl Options {
    /// None when the setting is unset or empty.
    pub fn from_settings(settings: &Settings) -> Option<Options> {
        let key = settings.readiness_taint.as_deref()?.trim();
        (!key.is_empty()).then(|| Options {
            node_name: settings.node_name.clone(),
            key: key.to_owned(),
        })
    }
}

/// How often readiness and the Node are looked at: the taint goes within
/// this of the agent turning ready.
const CHECK: Duration = Duration::from_secs(1);
/// Once removed (or absent), the Node is read this seldom, in case its
/// kubelet registers it again with the taint.
const RECHECK: Duration = Duration::from_secs(30);

/// Removes the taint whenever the agent is ready and the Node carries it.
pub async fn run(client: kube::Client, options: Options, health: Health) {
    let nodes: Api<Node> = Api::all(client);
    let mut last_problem: Option<String> = None;
    loop {
        let wait = if health.not_ready().is_some() {
            CHECK
        } else {
            match remove(&nodes, &options).await {
                Ok(removed) => {
                    if removed {
                        log::info!(
                            "ready: removed the taint {} from Node {}",
                            options.key,
                            options.node_name
                        );
                    }
                    last_problem = None;
                    RECHECK
                }
                Err(e) => {
                    let text = e.to_string();
                    if last_problem.as_ref() != Some(&text) {
                        log::warn!(
                            "removing the taint {} from Node {}: {text}",
                            options.key,
                            options.node_name
                        );
                        last_problem = Some(text);
                    }
                    CHECK
                }
            }
        };
        tokio::time::sleep(wait).await;
    }
}

/// Removes every taint of the key from the Node; whether there was one.
/// The patch carries the resourceVersion read, so a Node changed meanwhile
/// (another taint added, say) is refused with a conflict and read again
/// rather than overwritten.
async fn remove(nodes: &Api<Node>, options: &Options) -> Result<bool, Error> {
    let node = nodes.get(&options.node_name).await?;
    let taints = node
        .spec
        .as_ref()
        .and_then(|spec| spec.taints.clone())
        .unwrap_or_default();
    let kept: Vec<_> = taints.iter().filter(|t| t.key != options.key).cloned().collect();
    if kept.len() == taints.len() {
        return Ok(false);
    }
    let patch = json!({
        "metadata": {"resourceVersion": node.metadata.resource_version},
        "spec": {"taints": kept},
    });
    nodes
        .patch(&options.node_name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(true)
}
