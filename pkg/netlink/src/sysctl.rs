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

/// Sets `key` to `value`. A refused write is fine when the value is
/// already there (some sysctls are read-only in a namespace while holding
/// it). Most keys are written without reading first: the write alone is
/// one procfs lookup, and their handlers act only on a change. Those whose
/// handlers take the RTNL lock on every write are read first, since an
/// unneeded write would queue behind every veth being made on the node.
pub fn write(key: &str, value: &str) -> io::Result<()> {
    let already = || read(key).is_ok_and(|current| current == value);
    if takes_rtnl(key) && already() {
        return Ok(());
    }
    std::fs::write(path(key), value).or_else(|e| {
        if already() {
            Ok(())
        } else {
            Err(io::Error::new(e.kind(), format!("{}: {e}", path(key).display())))
        }
    })
}

/// IPv6's `disable_ipv6` and `forwarding` handlers take RTNL (retrying the
/// syscall while another holds it) even when the value does not change;
/// IPv4's `ip_forward` only on a change, but it is node-wide and written by
/// every ADD.
fn takes_rtnl(key: &str) -> bool {
    key.ends_with("/disable_ipv6") || key.ends_with("/forwarding") || key.ends_with("/ip_forward")
}

/// [`write`] inside `ns`.
pub fn write_in(ns: &NetNs, key: &str, value: &str) -> io::Result<()> {
    let _inside = ns.enter().map_err(io::Error::other)?;
    write(key, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_keys_whose_handlers_lock_are_read_first() {
        assert!(takes_rtnl("net/ipv6/conf/eth0/disable_ipv6"));
        assert!(takes_rtnl("net/ipv6/conf/all/forwarding"));
        assert!(takes_rtnl("net/ipv4/ip_forward"));
        assert!(!takes_rtnl("net/ipv6/conf/eth0/accept_dad"));
        assert!(!takes_rtnl("net/ipv4/conf/eth0/arp_notify"));
    }
}
