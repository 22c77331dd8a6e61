//! The agent's one Pod watch, shared by the controllers that read Pods:
//! the NetworkPolicy controller reads every pod (a selector may name any
//! namespace's), Istio's repair only this node's. Two watches of the
//! same kind would cost the API server two lists of every pod at each
//! start and relist, and the agent two copies in flight.
//!
//! Each reader gets the events on a queue of its own that never blocks
//! the watch, so a reader that is busy (a repair waiting on the API
//! server, a policy pass) holds back neither the other reader nor the
//! watch; what queues meanwhile is at most what the watch would have
//! delivered anyway. Watch errors are logged here, once; readers see
//! only events.

use std::sync::Arc;

use futures::StreamExt;
use futures::channel::mpsc;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

/// One event of the Pod watch, shared by its readers.
pub type PodEvent = Arc<Event<Pod>>;

/// What a reader receives; it ends when the watch does.
pub type PodEvents = mpsc::UnboundedReceiver<PodEvent>;

/// The readers of the one Pod watch, taken before it starts so none
/// misses the first list.
#[derive(Debug, Default)]
pub struct PodWatch {
    readers: Vec<Reader>,
}

#[derive(Debug)]
struct Reader {
    /// Only the pods bound to this node, or every pod.
    node: Option<String>,
    send: mpsc::UnboundedSender<PodEvent>,
}

impl PodWatch {
    /// Every pod's events.
    pub fn every_pod(&mut self) -> PodEvents {
        self.reader(None)
    }

    /// The events of the pods bound to `node`, and every relist's start
    /// and end.
    pub fn pods_of(&mut self, node: &str) -> PodEvents {
        self.reader(Some(node.to_owned()))
    }

    fn reader(&mut self, node: Option<String>) -> PodEvents {
        let (send, receive) = mpsc::unbounded();
        self.readers.push(Reader { node, send });
        receive
    }

    /// The field selector the watch can ask the API server for: one node's
    /// pods when that is all its readers read.
    fn selector(&self) -> Option<String> {
        let first = self.readers.first()?.node.as_ref()?;
        self.readers
            .iter()
            .all(|reader| reader.node.as_ref() == Some(first))
            .then(|| format!("spec.nodeName={first}"))
    }

    /// Watches until the task is aborted (errors are retried with
    /// backoff); None when nothing reads Pods.
    pub fn run(self, client: kube::Client) -> Option<impl Future<Output = ()> + Send + use<>> {
        if self.readers.is_empty() {
            return None;
        }
        let mut config = watcher::Config::default();
        if let Some(selector) = self.selector() {
            config = config.fields(&selector);
        }
        let mut stream = watcher::watcher(Api::<Pod>::all(client), config)
            .default_backoff()
            .boxed();
        Some(async move {
            while let Some(event) = stream.next().await {
                match event {
                    Ok(event) => self.hand_out(Arc::new(event)),
                    Err(e) => log::warn!("watching Pods: {e}; retrying"),
                }
            }
            log::error!("the Pod watch ended");
        })
    }

    fn hand_out(&self, event: PodEvent) {
        let pod = match &*event {
            Event::InitApply(pod) | Event::Apply(pod) | Event::Delete(pod) => Some(pod),
            Event::Init | Event::InitDone => None,
        };
        let bound_to = pod.and_then(|pod| pod.spec.as_ref()?.node_name.as_deref());
        for reader in &self.readers {
            let reads = match (&reader.node, pod) {
                (Some(node), Some(_)) => bound_to == Some(node.as_str()),
                _ => true,
            };
            // A reader gone (its task ended) reads nothing more.
            if reads {
                let _ = reader.send.unbounded_send(Arc::clone(&event));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::PodSpec;
    use kube::api::ObjectMeta;

    use super::*;

    fn pod(name: &str, node: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("ns".to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(str::to_owned),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    fn received(events: &mut PodEvents) -> Vec<String> {
        let mut seen = Vec::new();
        while let Ok(event) = events.try_recv() {
            seen.push(match &*event {
                Event::Init => "init".to_owned(),
                Event::InitDone => "done".to_owned(),
                Event::InitApply(pod) | Event::Apply(pod) | Event::Delete(pod) => {
                    pod.metadata.name.clone().unwrap_or_default()
                }
            });
        }
        seen
    }

    #[test]
    fn a_node_reader_gets_its_pods_and_every_list_boundary_the_other_every_pod() {
        let mut watch = PodWatch::default();
        let mut every = watch.every_pod();
        let mut mine = watch.pods_of("n1");
        assert_eq!(watch.selector(), None, "one reader reads every pod");
        for event in [
            Event::Init,
            Event::InitApply(pod("here", Some("n1"))),
            Event::InitApply(pod("there", Some("n2"))),
            Event::InitDone,
            Event::Apply(pod("pending", None)),
            Event::Apply(pod("bound", Some("n1"))),
            Event::Delete(pod("here", Some("n1"))),
        ] {
            watch.hand_out(Arc::new(event));
        }
        assert_eq!(
            received(&mut every),
            ["init", "here", "there", "done", "pending", "bound", "here"]
        );
        assert_eq!(received(&mut mine), ["init", "here", "done", "bound", "here"]);
    }

    #[test]
    fn the_api_server_is_asked_for_one_nodes_pods_only_when_that_is_all_that_is_read() {
        let mut watch = PodWatch::default();
        assert!(watch.selector().is_none());
        let _mine = watch.pods_of("n1");
        assert_eq!(watch.selector().as_deref(), Some("spec.nodeName=n1"));
        let _every = watch.every_pod();
        assert!(watch.selector().is_none());
    }

    #[test]
    fn a_reader_gone_does_not_stop_the_others() {
        let mut watch = PodWatch::default();
        drop(watch.every_pod());
        let mut mine = watch.pods_of("n1");
        watch.hand_out(Arc::new(Event::Apply(pod("bound", Some("n1")))));
        assert_eq!(received(&mut mine), ["bound"]);
    }
}
