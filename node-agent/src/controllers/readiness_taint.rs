//! The readiness taint (`READINESS_TAINT`, Istio's `cni.istio.io/not-ready`):
//! a node carrying it gets no pod that does not tolerate it. The agent
//! removes it from its own Node once everything it keeps is in place (its
//! readiness), never before, so pods that need the capture are not
//! scheduled onto a node where the chain is missing; and puts it back
//! (`NoSchedule`) once the agent has stayed not ready (a primary
//! configuration removed, say), so that the node stops getting such pods
//! until it is ready again. Istio leaves the removal to an optional
//! controller of istiod and puts the taint back nowhere; here the agent that
//! knows its chain is in place does both.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Taint};
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

/// How often readiness is looked at: the taint goes within this of the
/// agent turning ready.
const CHECK: Duration = Duration::from_secs(1);
/// Once the Node is as readiness wants it, it is read this seldom, in case
/// its kubelet registers it again with the taint, or someone removes it.
const RECHECK: Duration = Duration::from_secs(30);
/// How long the agent is not ready before the taint is put back: longer
/// than a start takes (the chain a restarted agent finds is in place, and
/// a rollout should not taint every node) and than a primary being
/// rewritten in place is unreadable.
const NOT_READY_GRACE: Duration = Duration::from_secs(5);

/// Whether the Node should carry the taint, given since when the agent has
/// been not ready (None: it is ready); None while that is too short to say.
fn wanted(not_ready_since: Option<Instant>, now: Instant) -> Option<bool> {
    match not_ready_since {
        None => Some(false),
        Some(since) => (now.saturating_duration_since(since) >= NOT_READY_GRACE).then_some(true),
    }
}

/// Keeps the taint on the Node while the agent is not ready (after
/// [`NOT_READY_GRACE`]) and off while it is ready.
pub async fn run(client: kube::Client, options: Options, health: Health) {
    let nodes: Api<Node> = Api::all(client);
    let mut last_problem: Option<String> = None;
    // A start counts as not ready from its beginning.
    let mut not_ready_since = Some(Instant::now());
    // Whether the Node was last found (or made) tainted, and when.
    let mut confirmed: Option<(bool, Instant)> = None;
    loop {
        let now = Instant::now();
        let why = health.not_ready();
        not_ready_since = why.map(|_| not_ready_since.unwrap_or(now));
        let due = wanted(not_ready_since, now).filter(|&tainted| {
            confirmed.is_none_or(|(was, at)| was != tainted || now.duration_since(at) >= RECHECK)
        });
        if let Some(tainted) = due {
            match set(&nodes, &options, tainted).await {
                Ok(changed) => {
                    if changed && tainted {
                        log::warn!(
                            "not ready for {NOT_READY_GRACE:?} ({}): put the taint {}:NoSchedule back on Node {}",
                            why.unwrap_or_default(),
                            options.key,
                            options.node_name
                        );
                    } else if changed {
                        log::info!(
                            "ready: removed the taint {} from Node {}",
                            options.key,
                            options.node_name
                        );
                    }
                    confirmed = Some((tainted, now));
                    last_problem = None;
                }
                Err(e) => {
                    let text = e.to_string();
                    if last_problem.as_ref() != Some(&text) {
                        let doing = if tainted { "putting back" } else { "removing" };
                        log::warn!(
                            "{doing} the taint {} on Node {}: {text}",
                            options.key,
                            options.node_name
                        );
                        last_problem = Some(text);
                    }
                    confirmed = None;
                }
            }
        }
        tokio::time::sleep(CHECK).await;
    }
}

/// Makes the Node carry a taint of the key (`tainted`: one `NoSchedule`,
/// unless one of any effect is there) or none (every one of the key goes);
/// whether it changed the Node. The patch carries the resourceVersion read,
/// so a Node changed meanwhile (another taint added, say) is refused with a
/// conflict and read again rather than overwritten.
async fn set(nodes: &Api<Node>, options: &Options, tainted: bool) -> Result<bool, Error> {
    let node = nodes.get(&options.node_name).await?;
    let taints = node
        .spec
        .as_ref()
        .and_then(|spec| spec.taints.clone())
        .unwrap_or_default();
    let carries = taints.iter().any(|t| t.key == options.key);
    if carries == tainted {
        return Ok(false);
    }
    let mut kept: Vec<Taint> = taints.into_iter().filter(|t| t.key != options.key).collect();
    if tainted {
        kept.push(Taint {
            key: options.key.clone(),
            effect: "NoSchedule".to_owned(),
            ..Taint::default()
        });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_taint_is_wanted_off_when_ready_and_on_only_after_the_grace() {
        let since = Instant::now();
        assert_eq!(wanted(None, since), Some(false));
        assert_eq!(
            wanted(Some(since), since),
            None,
            "not ready just now: a start, a rewrite"
        );
        let almost = since + NOT_READY_GRACE - Duration::from_millis(1);
        assert_eq!(wanted(Some(since), almost), None);
        assert_eq!(wanted(Some(since), since + NOT_READY_GRACE), Some(true));
        // A clock read before `since` (another task's) is no grace passed.
        assert_eq!(wanted(Some(almost), since), None);
    }
}
