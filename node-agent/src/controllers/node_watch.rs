//! The cluster's Nodes as the agent follows them: one watch on all Nodes
//! (this node's for its configuration, the others' for routes), kept as
//! [`Watched`] keeps a kind; after every change,
//! and every [`RESYNC`], the controllers made from the Nodes (the
//! conflist, the routes, the masquerade) bring the node in line, in that
//! order.

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

use crate::changes::RESYNC;
use crate::cluster::node::{NodeInfo, Nodes};
use crate::cluster::pod_range::{self, PodRange};
use crate::cluster::watched::Watched;
use crate::controllers::conflist::Conflist;
use crate::controllers::egress::Egress;
use crate::controllers::routes::Routes;
use crate::error::Error;
use crate::health::Health;

/// The controllers the Node watch runs, each with its own options and
/// what its last run put in place.
#[derive(Debug)]
pub struct Controllers {
    pub conflist: Conflist,
    pub routes: Routes,
    pub egress: Egress,
}

impl Controllers {
    /// Forgets what the last sync put in place, so that the next one
    /// checks everything again.
    fn forget(&mut self) {
        self.routes.forget();
        self.egress.forget();
    }

    /// Brings the conflist, the routes and the masquerade in line with `nodes`.
    async fn sync(&mut self, pod_range: &PodRange, nodes: &Nodes, health: &Health) {
        self.conflist.run(nodes, health).await;
        self.routes.run(nodes, health).await;
        self.egress.run(pod_range, nodes, health).await;
    }
}

/// Follows every Node until the stream ends (it does not: errors are
/// retried with backoff), running the controllers whenever what they are
/// made of changes.
pub async fn run(client: kube::Client, mut controllers: Controllers, health: Health) -> Result<(), Error> {
    let api: Api<Node> = Api::all(client.clone());
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    // Most updates are heartbeats, conditions and taints: what the agent
    // reads is the same, no change, and nothing is looked at (no netlink,
    // no iptables, no file) until the resync.
    let mut nodes: Watched<String, NodeInfo> = Watched::default();
    let mut pod_range = pod_range::Reader::new(client.clone(), controllers.egress.range_is_set());
    let mut resync = tokio::time::interval(RESYNC);
    loop {
        let event = tokio::select! {
            event = stream.next() => match event {
                Some(event) => event,
                None => break,
            },
            _ = resync.tick() => {
                // Someone may have deleted a route, a rule or the file:
                // put them back even when no Node changed.
                // While the watch is down or relisting, from the last
                // list the agent had.
                controllers.forget();
                if nodes.listed_once() {
                    let range = pod_range.current().await;
                    controllers.sync(range, nodes.known(), &health).await;
                }
                continue;
            }
        };
        // Ready only while the watch is in place: not while it relists
        // or fails.
        health.set_listed(matches!(
            event,
            Ok(Event::InitDone | Event::Apply(_) | Event::Delete(_))
        ));
        match event {
            Ok(event) if nodes.take(&event, NodeInfo::from_node) => {
                controllers
                    .sync(pod_range.current().await, nodes.known(), &health)
                    .await;
            }
            Ok(_) => {}
            Err(e) => log::warn!("watching Nodes: {e}; retrying"),
        }
    }
    Err(Error::Watch("the Node watch ended".into()))
}
