//! The reference host-local's on-disk leases: `<dataDir>/<network>/<ip>`
//! files holding `ID\r\nifname` (or just `ID` before v0.8.0), and
//! `last_reserved_ip.<N>`. On a node switched from the reference plugin they
//! are imported into sled under the shared lock whenever their directory
//! changed, so no running pod loses its address and none of those addresses
//! is handed out again. Afterwards sled alone drives allocation; a file stays
//! until its lease is released, then it is removed with it.

use std::fs;
use std::io::Read;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::Error;
use crate::store::{Change, Lease, Network};

const LAST_RESERVED_PREFIX: &str = "last_reserved_ip.";

/// Far above what the reference writes (a container ID, CRLF, an
/// interface name; or one address).
const FILE_LIMIT: u64 = 4096;

/// The text of a lease or position file and when it was written, read
/// only if it is a regular file of at most [`FILE_LIMIT`] bytes, and never
/// through a symlink: the import runs under the network's lock, and
/// anything else (a FIFO, a symlink to /dev/zero or to a file of another
/// user) could hold it for ever or feed it what the reference never wrote.
fn read_lease_file(path: &Path) -> Option<(String, SystemTime)> {
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY)
        .open(path)
        .ok()?;
    let metadata = file.metadata().ok()?;
    if !metadata.is_file() || metadata.len() > FILE_LIMIT {
        return None;
    }
    let mut text = String::new();
    file.take(FILE_LIMIT).read_to_string(&mut text).ok()?;
    Some((text, metadata.modified().ok()?))
}

/// What an import did.
#[derive(Debug, Default, Serialize)]
pub struct ImportReport {
    pub imported: Vec<Lease>,
    /// Addresses the files give to another owner than sled does; sled's
    /// owner is kept.
    pub conflicts: Vec<String>,
}

/// The directory's modification time, as stored to notice changes.
pub(crate) fn dir_mtime(dir: &Path) -> Option<Vec<u8>> {
    let modified = fs::metadata(dir).ok()?.modified().ok()?;
    let nanos = modified.duration_since(UNIX_EPOCH).ok()?.as_nanos();
    Some(nanos.to_string().into_bytes())
}

/// `ID\r\nifname`, or the pre-0.8.0 `ID` alone.
pub fn parse_reservation(content: &str) -> (String, String) {
    let mut lines = content.trim().lines().map(str::trim);
    let id = lines.next().unwrap_or_default().to_owned();
    let ifname = lines.next().unwrap_or_default().to_owned();
    (id, ifname)
}

/// A file name as the reference writes it (':' is '_' on Windows).
fn address_of(name: &str) -> Option<IpAddr> {
    name.replace('_', ":")
        .parse::<IpAddr>()
        .ok()
        .map(|ip| ip.to_canonical())
}

/// Imports the reference directory's leases if it changed since the last
/// import; whether any lease was imported.
pub(crate) fn import_if_changed(net: &Network) -> Result<bool, Error> {
    let Some(mtime) = dir_mtime(net.reference_dir()) else {
        return Ok(false);
    };
    if net.reference_mtime()?.as_deref() == Some(mtime.as_slice()) {
        return Ok(false);
    }
    let dir = net.reference_dir().to_path_buf();
    let report = import_dir(net, &dir, Some(mtime))?;
    for conflict in &report.conflicts {
        log::warn!("reference lease not imported: {conflict}");
    }
    Ok(!report.imported.is_empty())
}

/// Imports the reference-format leases in `dir`. Files there are the
/// reference directory's own only when `dir` is it; those are marked so
/// that releasing the lease removes the file.
pub fn import_dir(net: &Network, dir: &Path, mtime: Option<Vec<u8>>) -> Result<ImportReport, Error> {
    let own_files = dir == net.reference_dir();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && own_files => return Ok(ImportReport::default()),
        Err(e) => return Err(Error::Store(format!("cannot read {}: {e}", dir.display()))),
    };
    let mut report = ImportReport::default();
    let mut change = Change::default();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if let Some(index) = name
            .strip_prefix(LAST_RESERVED_PREFIX)
            .and_then(|n| n.parse::<usize>().ok())
        {
            let hint = read_lease_file(&path).and_then(|(t, _)| t.trim().parse::<IpAddr>().ok());
            if let Some(ip) = hint
                && net.last_reserved(index)?.is_none()
            {
                change.last_reserved.push((index, ip.to_canonical()));
            }
            continue;
        }
        let Some(ip) = address_of(&name) else { continue };
        let Some((content, written)) = read_lease_file(&path) else {
            continue;
        };
        let (container_id, ifname) = parse_reservation(&content);
        if container_id.is_empty() {
            continue;
        }
        match net.lease(ip)? {
            Some(held)
                if held.container_id == container_id && (held.ifname == ifname || ifname.is_empty()) => {}
            Some(held) => report.conflicts.push(format!(
                "{ip}: file names {container_id}/{ifname}, the lease database {}/{}",
                held.container_id, held.ifname
            )),
            None => {
                let allocated = written
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or_else(|_| crate::store::now());
                change.add.push(Lease {
                    ip,
                    container_id,
                    ifname,
                    allocated,
                    from_reference: own_files,
                    netns: None,
                });
            }
        }
    }
    net.apply_with_mtime(&change, mtime)?;
    report.imported = change.add;
    Ok(report)
}

/// Removes the reference file of an imported lease if it still names that
/// lease's owner. Returns whether a file was removed.
pub(crate) fn remove_file_of(dir: &Path, lease: &Lease) -> Result<bool, Error> {
    let path = dir.join(lease.ip.to_string());
    let Some((content, _)) = read_lease_file(&path) else {
        return Ok(false);
    };
    if parse_reservation(&content) != (lease.container_id.clone(), lease.ifname.clone()) {
        return Ok(false);
    }
    match fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::Store(format!("cannot remove {}: {e}", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_in_both_formats() {
        assert_eq!(parse_reservation("abc\r\neth0"), ("abc".into(), "eth0".into()));
        assert_eq!(parse_reservation("abc\r\neth0\n"), ("abc".into(), "eth0".into()));
        assert_eq!(parse_reservation("  abc  "), ("abc".into(), String::new()));
    }

    #[test]
    fn file_names_are_addresses() {
        assert_eq!(address_of("10.1.0.5"), Some("10.1.0.5".parse().expect("ip")));
        assert_eq!(address_of("fd00__5"), Some("fd00::5".parse().expect("ip")));
        assert_eq!(address_of("lock"), None);
        assert_eq!(address_of("last_reserved_ip.0"), None);
    }
}
