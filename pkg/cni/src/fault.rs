//! Named pause points for crash tests, compiled in only with the
//! `fault-injection` feature, which release builds never enable (the
//! Makefile builds separate test binaries with it). With
//! `CNI_SUITE_FAULT_PAUSE=<point>`, the process that reaches the point
//! writes its name to the file named by `CNI_SUITE_FAULT_READY` and waits
//! there to be killed.

/// Every point, in the order an ADD (then a DEL) reaches them. The crash
/// tests kill the chain at each.
pub const POINTS: [&str; 8] = [
    // host-local: the network's lock held and sled open; the transaction
    // committed but not flushed.
    "host-local:locked",
    "host-local:committed",
    // bridge ADD: the veth made; the lease taken; the pod configured; the
    // masquerade in place (just before the reply).
    "bridge:veth",
    "bridge:leased",
    "bridge:configured",
    "bridge:masqueraded",
    // bridge DEL: the lease released while the veth is still going; the
    // veth gone.
    "bridge:del-released",
    "bridge:del-unlinked",
];

#[cfg(feature = "fault-injection")]
pub fn pause(point: &str) {
    debug_assert!(POINTS.contains(&point), "unlisted fault point {point}");
    if std::env::var("CNI_SUITE_FAULT_PAUSE").as_deref() != Ok(point) {
        return;
    }
    if let Ok(ready) = std::env::var("CNI_SUITE_FAULT_READY") {
        let _ = std::fs::write(ready, point);
    }
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn pause(_point: &str) {}
