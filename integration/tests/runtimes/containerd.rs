//! Debian's containerd 1.6 and runc running real containers on the suite:
//! `ctr run --cni` (go-cni inside ctr) with a private daemon in the node
//! namespace and an image built from busybox-static.

use std::time::Duration;

use serde_json::json;
use test_kit::fakes::containerd::Containerd;
use test_kit::{Node, wait_for};

const NETWORK: &str = "ctrnet";
const IMAGE: &str = "localhost/busybox:cni";
const NAMESPACE: &str = "cnitest";

fn assert_nothing_left(node: &Node, when: &str) {
    let left = node.leftovers(NETWORK, &node.path("ipam"));
    assert!(left.is_empty(), "{when}: left behind: {left:#?}");
}

#[test]
fn ctr_run_with_cni() {
    let node = Node::new();
    // ctr's libcni (1.1) reads cniVersion; cnictl picks 1.1.0 from
    // cniVersions for GC.
    node.write_conf(
        "10-ctr.conflist",
        &json!({"cniVersion": "1.0.0", "cniVersions": ["1.0.0", "1.1.0"], "name": NETWORK, "plugins": [
            {"type": "bridge", "bridge": "cnictr0", "isGateway": true, "ipMasq": true,
             "ipam": {"type": "host-local", "socket": "", "dataDir": node.path("ipam").to_str().expect("UTF-8"),
                      "ranges": [[{"subnet": "10.58.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "loopback"}]}),
    );
    let mut containerd = Containerd::start(&node, None);
    containerd.import_busybox(&node, NAMESPACE, IMAGE, &["/bin/sh"]);
    let fifo = containerd.dir().join("fifo");
    let fifo = fifo.to_str().expect("UTF-8");

    // --rm: ADD when the task starts, DEL (with an empty CNI_NETNS) after
    // it exits.
    let run = containerd.ctr_cni(
        &node,
        NAMESPACE,
        &[
            "run",
            "--rm",
            "--cni",
            "--fifo-dir",
            fifo,
            IMAGE,
            "c1",
            "sh",
            "-c",
            "ip addr show eth0 && ip route && ping -c 1 -W 2 10.58.0.1",
        ],
    );
    assert!(run.ok(), "{run:?}\n--- containerd log\n{}", containerd.log());
    assert!(run.stdout.contains("inet 10.58.0.2/24"), "{run:?}");
    assert!(run.stdout.contains("default via 10.58.0.1"), "{run:?}");
    assert!(run.stdout.contains("1 packets received"), "{run:?}");
    assert_nothing_left(&node, "after ctr run --rm");

    // -d: ctr never calls DEL for it; cnictl gc reclaims it once it is gone.
    containerd
        .ctr_cni(
            &node,
            NAMESPACE,
            &[
                "run",
                "-d",
                "--cni",
                "--fifo-dir",
                fifo,
                IMAGE,
                "c2",
                "sleep",
                "300",
            ],
        )
        .success();
    assert!(
        node.leases(NETWORK).contains("10.58.0.3"),
        "{}",
        node.leases(NETWORK)
    );
    assert_eq!(node.cache_entries(), [format!("{NETWORK}-{NAMESPACE}-c2-eth0")]);
    assert!(
        node.nat_chains().iter().any(|c| c.starts_with("CNI-NET-")),
        "the subnet's masquerade"
    );
    let entry = node.cache_entry(NETWORK, &format!("{NAMESPACE}-c2"), "eth0");
    let gc = node.cnictl(&["gc", NETWORK, "--prune-missing-netns"]).success();
    assert!(
        node.leases(NETWORK).contains("10.58.0.3"),
        "a live container is kept: {entry:?} {gc:?}"
    );

    containerd
        .ctr(&node, NAMESPACE, &["task", "kill", "--signal", "SIGKILL", "c2"])
        .success();
    wait_for("the task to stop", Duration::from_secs(10), || {
        containerd.ctr(&node, NAMESPACE, &["task", "delete", "c2"]).ok()
    });
    containerd
        .ctr(&node, NAMESPACE, &["container", "delete", "c2"])
        .success();
    assert!(
        node.leases(NETWORK).contains("10.58.0.3"),
        "ctr left the lease behind, as it does"
    );
    node.cnictl(&["gc", NETWORK, "--prune-missing-netns"]).success();
    assert_nothing_left(&node, "after cnictl gc");
}
