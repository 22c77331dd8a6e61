//! The lease service the agent runs for host-local, and what is left of it.

use std::time::Duration;

use test_kit::node_agent::{Agent, AgentFixture, ReadyNode, host_bin, host_leases};
use test_kit::{require_root, wait_for};

use crate::common::{CONTAINER_CAPABILITIES, TOKEN};

#[test]
fn a_lease_service_left_by_an_agent_killed_with_sigkill_is_stopped_on_uninstall() {
    require_root();
    let ReadyNode {
        node,
        server,
        agent: mut first,
    } = AgentFixture::new(TOKEN).start();
    let leases = host_leases(&node);
    let services = test_kit::services_under(&leases);
    assert_eq!(services.len(), 1, "the agent runs the lease service");
    first.kill();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        test_kit::services_under(&leases),
        services,
        "a SIGKILLed agent leaves its service running"
    );

    // The next agent finds the place taken, uses that service, and stops
    // it when it uninstalls, with no more capabilities than the
    // DaemonSet's container has (the runtime's defaults, NET_ADMIN and
    // NET_RAW), against a service that has them all.
    let mut second = Agent::start_under(
        &node,
        "n1",
        &server,
        "127.0.0.1",
        TOKEN,
        &[("UNINSTALL_ON_STOP", "true")],
        &[
            "setpriv",
            &format!("--bounding-set=-all,{CONTAINER_CAPABILITIES}"),
            "--",
        ],
    );
    wait_for("readiness", Duration::from_secs(20), || second.ready(&node));
    assert_eq!(test_kit::services_under(&leases), services);
    let (status, log) = second.stop();
    assert!(status.success(), "{log}");
    assert!(test_kit::services_under(&leases).is_empty(), "{log}");
    assert!(!leases.exists(), "{log}");
    let left: Vec<_> = std::fs::read_dir(host_bin(&node))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "nothing of the suite left in the bin directory: {left:?}"
    );
}
