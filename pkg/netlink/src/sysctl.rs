//! sysctls under /proc/sys. Those under `net/` belong to the network
//! namespace of the thread that opens the file, so pod-side ones are written
//! inside a [`netns::NetNsGuard`].

use std::io;
use std::path::PathBuf;

use netns::NetNs;

fn path(key: &str) -> PathBuf {
    PathBuf::from("/proc/sys").join(key)
}

pub fn read(key: &str) -> io::Result<String> {
    std::fs::read_to_string(path(key)).map(|s| s.trim().to_owned())
}

/// Writes `value` unless it is already set (a write is not free, and some
/// sysctls are read-only in a namespace while still holding the value).
pub fn write(key: &str, value: &str) -> io::Result<()> {
    if read(key).is_ok_and(|current| current == value) {
        return Ok(());
    }
    std::fs::write(path(key), value)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path(key).display())))
}

/// [`write`] inside `ns`.
pub fn write_in(ns: &NetNs, key: &str, value: &str) -> io::Result<()> {
    let _inside = ns.enter().map_err(io::Error::other)?;
    write(key, value)
}

/// Whether the kernel has IPv6 in the calling thread's namespace.
pub fn has_ipv6() -> bool {
    path("net/ipv6").exists()
}
