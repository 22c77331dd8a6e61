//! The Node watch: the API test server against kube-rs (the agent's
//! client), pinning what the agent relies on: list with a resourceVersion,
//! watch events and bookmarks, 410 Expired on an old version, 401 on a bad
//! token, a watch dropped mid-stream; and an agent the server refuses.

use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions, WatchEvent, WatchParams};
use rustls_pki_types::pem::PemObject;
use serde_json::json;
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{lab_node, node_object};
use test_kit::{require_root, wait_for};

use crate::common::{TOKEN, agent_of_n1, read_conflist};

/// A kube-rs client for `server`, run on the calling thread's runtime; the
/// server listens in `node`'s namespace, which the test enters to connect.
fn client(server: &ApiServer, token: &str) -> kube::Client {
    let mut config = kube::Config::new(server.url().parse().expect("url"));
    config.root_cert = Some(
        rustls_pki_types::CertificateDer::pem_slice_iter(server.ca_pem.as_bytes())
            .map(|c| c.expect("pem").to_vec())
            .collect(),
    );
    config.auth_info.token = Some(token.to_owned().into());
    kube::Client::try_from(config).expect("client")
}

/// Runs `test` on a runtime whose threads are inside `netns`.
fn in_netns<T>(netns: &Path, test: impl std::future::Future<Output = T>) -> T {
    let ns = netns::NetNs::open(netns).expect("netns");
    let _inside = ns.enter().expect("enter");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(test)
}

#[test]
fn the_api_test_server_answers_lists_watches_and_errors_as_kube_rs_expects() {
    require_root();
    let node = lab_node();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    in_netns(node.netns.path(), async {
        let nodes: kube::Api<KubeNode> = kube::Api::all(client(&server, TOKEN));
        let list = nodes.list(&ListParams::default()).await.expect("list");
        assert_eq!(list.items.len(), 1);
        let version = list.metadata.resource_version.clone().expect("a list version");
        assert_eq!(version, "1");

        let params = WatchParams::default().timeout(10);
        let mut events = nodes.watch(&params, &version).await.expect("watch").boxed();
        server.apply_node(node_object("n2", &["10.244.2.0/24"], &["10.250.0.12"]));
        server.apply_node(node_object("n2", &["10.244.3.0/24"], &["10.250.0.12"]));
        server.delete_node("n2");
        let mut seen = Vec::new();
        while seen.len() < 4 {
            match events.next().await.expect("an event").expect("a good event") {
                WatchEvent::Added(n) => seen.push(format!("ADDED {}", n.metadata.name.expect("name"))),
                WatchEvent::Modified(n) => seen.push(format!(
                    "MODIFIED {}",
                    n.spec.and_then(|s| s.pod_cidr).expect("cidr")
                )),
                WatchEvent::Deleted(n) => seen.push(format!("DELETED {}", n.metadata.name.expect("name"))),
                WatchEvent::Bookmark(b) => seen.push(format!("BOOKMARK {}", b.metadata.resource_version)),
                WatchEvent::Error(e) => panic!("{e:?}"),
            }
        }
        assert_eq!(
            seen,
            ["ADDED n2", "MODIFIED 10.244.3.0/24", "DELETED n2", "BOOKMARK 4"],
            "changes in order, then a bookmark at the latest version"
        );

        // A dropped connection ends the stream.
        server.drop_watches();
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(Ok(_)) = events.next().await {}
        })
        .await;
        assert!(ended.is_ok(), "the watch ends when its connection drops");

        // After compaction an old version is answered 410 Expired in-band.
        server.expire_history();
        let mut expired = nodes.watch(&params, &version).await.expect("watch").boxed();
        match expired.next().await.expect("an event").expect("an event") {
            WatchEvent::Error(e) => {
                assert_eq!(e.code, 410);
                assert_eq!(e.reason, "Expired");
            }
            other => panic!("expected 410 Expired, got {other:?}"),
        }

        let refused = kube::Api::<KubeNode>::all(client(&server, "wrong"))
            .list(&ListParams::default())
            .await
            .expect_err("a bad token is refused");
        assert!(
            matches!(&refused, kube::Error::Api(status) if status.code == 401),
            "{refused:?}"
        );

        // Pods: a merge patch of the status subresource, and deletes whose
        // preconditions are checked (409 Conflict on a stale version).
        server.add_pod(
            "default",
            "p",
            json!({"metadata": {"name": "p", "namespace": "default", "uid": "u1"}}),
        );
        let pods: kube::Api<Pod> = kube::Api::namespaced(client(&server, TOKEN), "default");
        let labelled = pods
            .patch_status(
                "p",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
            )
            .await
            .expect("patched");
        assert_eq!(labelled.metadata.labels.expect("labels")["a"], "b");
        let stale = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some("u1".into()),
                resource_version: Some("1".into()),
            }),
            ..DeleteParams::default()
        };
        let conflict = pods.delete("p", &stale).await.expect_err("a stale version");
        assert!(
            matches!(&conflict, kube::Error::Api(s) if s.code == 409),
            "{conflict:?}"
        );
        let current = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some("u1".into()),
                resource_version: labelled.metadata.resource_version,
            }),
            ..DeleteParams::default()
        };
        pods.delete("p", &current).await.expect("deleted");
        assert!(server.pod("default", "p").is_none());
    });
}

#[test]
fn an_agent_the_api_server_refuses_is_alive_but_not_ready() {
    require_root();
    let node = lab_node();
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["127.0.0.1"]));
    let mut agent = agent_of_n1(&node, &server, "a stale token", &[]);
    wait_for("the health endpoint", Duration::from_secs(10), || {
        agent.probe(&node, "/healthz").is_some()
    });
    std::thread::sleep(Duration::from_millis(500));
    let Some((code, reason)) = agent.probe(&node, "/readyz") else {
        let (status, log) = agent.stop();
        panic!("no answer from /readyz; the agent: {status:?} {log}");
    };
    assert_eq!(code, 503);
    assert!(reason.contains("not listed"), "{reason}");
    assert!(read_conflist(&node).is_none());
    assert!(server.requests() > 0, "the agent asked and was refused");
}
