//! Named pause points for crash tests, compiled in only with the
//! `fault-injection` feature, which release builds never enable (the
//! Makefile builds separate test binaries with it). With
//! `CNI_SUITE_FAULT_PAUSE=<point>`, the process that reaches the point
//! writes its name to the file named by `CNI_SUITE_FAULT_READY` and waits
//! there to be killed, or, with `CNI_SUITE_FAULT_RESUME=<file>`, until that
//! file exists (for changing the world under a running plugin).

/// Every point, in the order an ADD (then a DEL) reaches them. The crash
/// tests kill the chain at each.
pub const POINTS: [&str; 16] = [
    // host-local: the network's lock held and sled open; the transaction
    // committed but not flushed.
    "host-local:locked",
    "host-local:committed",
    // the lease service: a release answered, not yet flushed.
    "host-local:release-answered",
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
    // istio-redirect ADD: the pod decided on, nothing programmed; the
    // first family's rules in place, the second's not; every rule in place,
    // lo's ::6 and the TPROXY routes not yet.
    "istio-redirect:decided",
    "istio-redirect:first-family",
    "istio-redirect:programmed",
    // firewall ADD: the record's address claims written, not the record;
    // the record written, not its mark. DEL: the rules gone, the record
    // not; the record gone, not its claims and mark.
    "firewall:claimed",
    "firewall:recorded",
    "firewall:del-rules-removed",
    "firewall:del-unrecorded",
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
    let resume = std::env::var_os("CNI_SUITE_FAULT_RESUME").map(std::path::PathBuf::from);
    loop {
        match &resume {
            Some(file) if file.exists() => return,
            Some(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
            None => std::thread::sleep(std::time::Duration::from_secs(3600)),
        }
    }
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn pause(_point: &str) {}
