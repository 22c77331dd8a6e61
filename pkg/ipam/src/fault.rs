//! Pause points inside the critical section, for crash tests: compiled in
//! only with the `fault-injection` feature, which release builds never
//! enable. With `IPAM_FAULT_PAUSE=<point>`, the process writes the point's
//! name to the file named by `IPAM_FAULT_READY` and waits there to be killed.

#[cfg(feature = "fault-injection")]
pub fn pause(point: &str) {
    if std::env::var("IPAM_FAULT_PAUSE").as_deref() != Ok(point) {
        return;
    }
    if let Ok(ready) = std::env::var("IPAM_FAULT_READY") {
        let _ = std::fs::write(ready, point);
    }
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn pause(_point: &str) {}
