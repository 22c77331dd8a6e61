//! The reference host-local's on-disk leases: `<dataDir>/<network>/<ip>`
//! files holding `ID\r\nifname` (or just `ID` before v0.8.0), and
//! `last_reserved_ip.<N>`. On a node switched from the reference plugin they
//! are imported into sled under the shared lock whenever their directory
//! changed, so no running pod loses its address and none of those addresses
//! is handed out again. Afterwards sled alone drives allocation; a file stays
//! until its lease is released, then it is removed with it.
//!
//! Every rule about these files lives here, above the store, which keeps
//! only the leases and, as opaque bytes, the directory's mtime: when to
//! import ([`import_if_changed`], run by [`crate::pool::with_network`]
//! before each operation), importing ([`import_dir`]), and removing a
//! released lease's file ([`FileRemoval`], used by the verbs that release).

use std::fs;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use cni::small_file::{self, Links, Unreadable};
use serde::Serialize;

use crate::Error;
use crate::store::{Change, Lease, Network};

const LAST_RESERVED_PREFIX: &str = "last_reserved_ip.";

/// Far above what the reference writes (a container ID, CRLF, an
/// interface name; or one address).
const FILE_LIMIT: u64 = 4096;

/// The text of a lease or position file and when it was written, read
/// only if it is a regular file of at most [`FILE_LIMIT`] bytes, and never
/// through a symlink ([`cni::small_file`]): the import runs under the
/// network's lock, and anything else (a FIFO, a symlink to /dev/zero or to
/// a file of another user) could hold it for ever or feed it what the
/// reference never wrote. `None` for such a file or none at all; an error
/// when the file could not be read (out of descriptors, an I/O error):
/// then it may hold a live pod's address, and the caller must not go on
/// as if it did not.
fn read_lease_file(path: &Path) -> Result<Option<(String, SystemTime)>, Error> {
    let failed = |e: &dyn std::fmt::Display| Error::Store(format!("cannot read {}: {e}", path.display()));
    let contents = match small_file::read(path, Links::Refuse, FILE_LIMIT) {
        Ok(contents) => contents,
        Err(Unreadable::Absent) => return Ok(None),
        Err(e) if e.is_not_a_file() => return Ok(None),
        Err(e) => return Err(failed(&e)),
    };
    // Not UTF-8: nothing the reference wrote.
    let Ok(text) = String::from_utf8(contents.bytes) else {
        return Ok(None);
    };
    Ok(Some((
        text,
        contents.metadata.modified().map_err(|e| failed(&e))?,
    )))
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
fn dir_mtime(dir: &Path) -> Option<Vec<u8>> {
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
/// import, or since the last release that removed a file (see
/// [`FileRemoval::finish`]).
pub(crate) fn import_if_changed(net: &Network) -> Result<(), Error> {
    let Some(mtime) = dir_mtime(net.reference_dir()) else {
        return Ok(());
    };
    if net.reference_mtime()?.as_deref() == Some(mtime.as_slice()) {
        return Ok(());
    }
    let dir = net.reference_dir().to_path_buf();
    let report = import_dir(net, &dir, Some(mtime))?;
    for conflict in &report.conflicts {
        log::warn!("reference lease not imported: {conflict}");
    }
    if !report.imported.is_empty() {
        net.note_bulk_write();
    }
    Ok(())
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
    let mut change = Change {
        reference_mtime: mtime,
        ..Change::default()
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if let Some(index) = name
            .strip_prefix(LAST_RESERVED_PREFIX)
            .and_then(|n| n.parse::<usize>().ok())
        {
            let hint = read_lease_file(&path)?.and_then(|(t, _)| t.trim().parse::<IpAddr>().ok());
            if let Some(ip) = hint
                && net.last_reserved(index)?.is_none()
            {
                change.last_reserved.push((index, ip.to_canonical()));
            }
            continue;
        }
        let Some(ip) = address_of(&name) else { continue };
        let Some((content, written)) = read_lease_file(&path)? else {
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
    net.apply(&change)?;
    report.imported = change.add;
    Ok(report)
}

/// The reference files of the imported leases one operation releases,
/// each looked for once, before the transaction that releases the leases.
///
/// Before, not after: a file that outlived its released lease would be
/// imported again, as a live lease, by the first import after anything
/// changed the directory (the reference plugin writing another lease, an
/// operator's `touch`), since an import reads every file and only the
/// directory's mtime decides when one runs. Removed first, a crash or a
/// failed commit in between leaves a held lease without its file, which the
/// runtime's repeated DEL or the next GC releases; no address is ever held
/// by a file after its lease is gone.
pub(crate) struct FileRemoval<'a> {
    dir: &'a Path,
    removed_any: bool,
}

impl<'a> FileRemoval<'a> {
    pub(crate) fn new(net: &'a Network) -> Self {
        FileRemoval {
            dir: net.reference_dir(),
            removed_any: false,
        }
    }

    /// Removes the file of `lease` if the lease was imported from this
    /// directory and the file still names its owner (the reference plugin
    /// may have handed the address to another container since). An error
    /// means the file may still be there: the lease must not be released.
    pub(crate) fn remove_file_of(&mut self, lease: &Lease) -> Result<(), Error> {
        if !lease.from_reference {
            return Ok(());
        }
        let path = self.dir.join(lease.ip.to_string());
        let Some((content, _)) = read_lease_file(&path)? else {
            return Ok(());
        };
        if parse_reservation(&content) != (lease.container_id.clone(), lease.ifname.clone()) {
            return Ok(());
        }
        match fs::remove_file(&path) {
            Ok(()) => {
                self.removed_any = true;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::Store(format!("cannot remove {}: {e}", path.display()))),
        }
    }

    /// Ends the removals: what the release's [`Change::reference_mtime`]
    /// records. When files were removed, the directory is synced first, so
    /// a power loss cannot keep the committed release and undo a removal;
    /// and its new mtime is recorded with the release, so our own removals
    /// do not look like the reference plugin's work and cause an import.
    pub(crate) fn finish(self) -> Result<Option<Vec<u8>>, Error> {
        if !self.removed_any {
            return Ok(None);
        }
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW)
            .open(self.dir)
            .and_then(|dir| dir.sync_all())
            .map_err(|e| Error::Store(format!("cannot sync {}: {e}", self.dir.display())))?;
        Ok(dir_mtime(self.dir))
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
