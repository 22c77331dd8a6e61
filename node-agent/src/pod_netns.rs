//! A running pod's network namespace, found the way Istio's repair finds
//! it: through the host's /proc (the DaemonSet shares the host's pid
//! namespace), as the namespace of a process that holds the pod's address.
//! Runtimes bind-mount namespaces wherever they like, so /proc is the one
//! place every runtime's namespaces show.

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use netlink::Netlink;
use netns::NetNs;

use crate::error::Error;

/// A namespace's identity: the device and inode of its nsfs file.
type NamespaceId = (u64, u64);

fn namespace_id(path: &Path) -> std::io::Result<NamespaceId> {
    std::fs::metadata(path).map(|m| (m.dev(), m.ino()))
}

/// When process `pid` started, in clock ticks since boot (`stat` field 22).
fn start_time(proc_root: &Path, pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(proc_root.join(pid).join("stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count
    // from the last ')'.
    let (_, after_name) = stat.rsplit_once(')')?;
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// `/proc/<pid>/ns/net` of the oldest process whose network namespace has
/// one of `ips`: the pause container's, which outlives the pod's other
/// processes (a failing init container's may be gone a moment later).
/// The agent's own namespace (the host's) is never a pod's.
pub fn find(proc_root: &Path, ips: &[IpAddr]) -> Result<Option<PathBuf>, Error> {
    let (mut found, unread) = find_all(proc_root, &[ips.to_vec()])?;
    match (found.pop().flatten(), unread) {
        (Some(path), _) => Ok(Some(path)),
        (None, Some(unread)) => Err(Error::Io(unread)),
        (None, None) => Ok(None),
    }
}

/// [`find`] for many pods in one scan of /proc (an agent that restarted
/// finds every enrolled pod's at once): for each pod's addresses, in
/// order, the namespace that holds one of them; and, when some were not
/// found and some processes could not be read, what could not.
pub fn find_all(
    proc_root: &Path,
    pods: &[Vec<IpAddr>],
) -> Result<(Vec<Option<PathBuf>>, Option<String>), Error> {
    let mut found = vec![None; pods.len()];
    if pods.is_empty() {
        return Ok((found, None));
    }
    let own = namespace_id(&proc_root.join("self/ns/net"))
        .map_err(|e| Error::read(&proc_root.join("self/ns/net"), e))?;
    let entries = std::fs::read_dir(proc_root).map_err(|e| Error::read(proc_root, e))?;
    // Each namespace once, by its oldest process.
    let mut oldest: HashMap<NamespaceId, (u64, String)> = HashMap::new();
    let (mut unreadable, mut last_error) = (0, String::new());
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else {
            continue;
        };
        let path = entry.path().join("ns/net");
        let id = match namespace_id(&path) {
            Ok(id) if id == own => continue,
            Ok(id) => id,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                unreadable += 1;
                last_error = format!("{}: {e}", path.display());
                continue;
            }
            // Processes come and go during the scan: skip what vanished.
            Err(_) => continue,
        };
        let Some(started) = start_time(proc_root, pid) else {
            continue;
        };
        let current = oldest.entry(id).or_insert_with(|| (started, pid.to_owned()));
        if started < current.0 {
            *current = (started, pid.to_owned());
        }
    }
    let mut candidates: Vec<(u64, String)> = oldest.into_values().collect();
    candidates.sort();
    let mut left = pods.len();
    for (_, pid) in candidates {
        if left == 0 {
            break;
        }
        let path = proc_root.join(&pid).join("ns/net");
        match addresses_in(&path) {
            Ok(held) => {
                for (pod, ips) in pods.iter().enumerate() {
                    if found[pod].is_none() && ips.iter().any(|ip| held.contains(ip)) {
                        found[pod] = Some(path.clone());
                        left -= 1;
                    }
                }
            }
            Err(e) => {
                unreadable += 1;
                last_error = format!("{}: {e}", path.display());
            }
        }
    }
    // Not found where it could look: say where it could not, since that
    // is usually a missing capability (SYS_PTRACE to open another user's
    // namespace, SYS_ADMIN to enter it).
    let unread = (left > 0 && unreadable > 0).then(|| {
        let missing: Vec<&Vec<IpAddr>> = pods
            .iter()
            .zip(&found)
            .filter(|(_, f)| f.is_none())
            .map(|(ips, _)| ips)
            .collect();
        format!(
            "no network namespace this agent could read holds {missing:?}, and {unreadable} processes' could not be read (the last: {last_error})"
        )
    });
    Ok((found, unread))
}

/// Whether the network namespace at `path` holds one of `ips`.
pub fn holds_any(path: &Path, ips: &[IpAddr]) -> Result<bool, String> {
    Ok(addresses_in(path)?.iter().any(|ip| ips.contains(ip)))
}

fn addresses_in(path: &Path) -> Result<Vec<IpAddr>, String> {
    let ns = NetNs::open(path).map_err(|e| e.to_string())?;
    let addresses = Netlink::connect_in(&ns)
        .and_then(|nl| nl.all_addresses())
        .map_err(|e| e.to_string())?;
    Ok(addresses.iter().map(|(_, address)| address.ip()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("42")).expect("mkdir");
        // Fields 1-22 of a real stat line, the name being "a) b".
        std::fs::write(
            dir.path().join("42/stat"),
            "42 (a) b) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 50",
        )
        .expect("stat");
        assert_eq!(start_time(dir.path(), "42"), Some(98765));
        assert_eq!(start_time(dir.path(), "43"), None);
    }
}
