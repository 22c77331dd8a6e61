//! The small files a plugin keeps per container beside its rules, so that
//! a DEL without prevResult or a GC knows what was written:
//! `<stateDir>/<network>/<name>` (under /run: tmpfs, gone at reboot with
//! every network namespace).
//!
//! Anyone with root on the node may have put something else there, and
//! the readers hold the node's lock (portmap, firewall and the bridge's
//! masquerade share it). So nothing is read or written through a link:
//! the state directory and each network's directory are opened with
//! `O_DIRECTORY | O_NOFOLLOW`, and every file in them relative to that
//! descriptor (the path down to the state directory is the
//! administrator's and is followed, as `/var/run` must lead to `/run`).
//! A state directory or network directory that is a link is refused for
//! writing and holds nothing of ours for reading and removal. Files are
//! read as [`cni::small_file`] reads them: a regular file, opened without
//! following a link and without blocking, up to [`MAX_SIZE`].

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::Path;

use cni::small_file::{self, Links};
use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, OFlag, openat, renameat};
use nix::sys::stat::{Mode, mkdirat};
use nix::unistd::{UnlinkatFlags, unlinkat};
use sha2::{Digest, Sha256};

pub use cni::small_file::{MAX_SIZE, Unreadable};

/// One file found in a state directory, with what reading it gave.
#[derive(Debug)]
pub struct Entry {
    pub network: String,
    pub name: String,
    pub contents: Result<Vec<u8>, Unreadable>,
}

/// Writes `bytes` as `<state_dir>/<network>/<name>` under a temporary name
/// in the same directory, then renames it into place: a reader, or a kill
/// -9 halfway, never leaves half a file behind. Temporary names start with
/// `.`. The directories are created when missing; one that is a link (or
/// not a directory) is an error, never written through.
pub fn write_whole(state_dir: &Path, network: &str, name: &str, bytes: &[u8]) -> io::Result<()> {
    check_component(network)?;
    check_component(name)?;
    std::fs::create_dir_all(state_dir)?;
    let top = open_dir_at(None, state_dir).map_err(|e| refused(state_dir, e))?;
    match mkdirat(&top, network, Mode::from_bits_truncate(0o755)) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(e) => return Err(e.into()),
    }
    let dir =
        open_dir_at(Some(&top), Path::new(network)).map_err(|e| refused(&state_dir.join(network), e))?;
    // Not named after the record: a record's name may be as long as a
    // file name can be. One plugin process writes one record at a time.
    let temporary = format!(".tmp.{}", std::process::id());
    // One killed with this pid before left its file: ours now.
    match unlinkat(&dir, temporary.as_str(), UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(e.into()),
    }
    let created = openat(
        &dir,
        temporary.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )?;
    let written = File::from(created)
        .write_all(bytes)
        .and_then(|()| renameat(&dir, temporary.as_str(), &dir, name).map_err(io::Error::from));
    if written.is_err() {
        let _ = unlinkat(&dir, temporary.as_str(), UnlinkatFlags::NoRemoveDir);
    }
    written
}

/// Removes `<state_dir>/<network>/<name>`. A file that is not there is
/// fine, and so is a directory on the way that is not one or is a link
/// (someone's file in the way holds no state of ours, and nothing is
/// written through a link): a DEL must not fail for either.
pub fn remove_if_present(state_dir: &Path, network: &str, name: &str) -> io::Result<()> {
    check_component(network)?;
    check_component(name)?;
    let Some(dir) = open_network_dir(state_dir, network)? else {
        return Ok(());
    };
    match unlinkat(&dir, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The bytes of `<state_dir>/<network>/<name>`; [`Unreadable::Absent`]
/// also when a directory on the way is not one or is a link.
pub fn read(state_dir: &Path, network: &str, name: &str) -> Result<Vec<u8>, Unreadable> {
    check_component(network)
        .and_then(|()| check_component(name))
        .map_err(Unreadable::Failed)?;
    match open_network_dir(state_dir, network) {
        Ok(Some(dir)) => read_in(&dir, name),
        Ok(None) => Err(Unreadable::Absent),
        Err(e) => Err(Unreadable::Failed(e)),
    }
}

/// Every file of `network` (temporary ones left out), each with what
/// reading it gave: a caller skips what is not a file of its kind and
/// decides about what it failed to read. Nothing when the directory is
/// not there, not a directory or a link.
pub fn entries(state_dir: &Path, network: &str) -> io::Result<Vec<Entry>> {
    check_component(network)?;
    match open_network_dir(state_dir, network)? {
        Some(dir) => entries_in(dir, network),
        None => Ok(Vec::new()),
    }
}

/// [`entries`] of every network.
pub fn all_entries(state_dir: &Path) -> io::Result<Vec<Entry>> {
    let Some(top) = open_or_none(None, state_dir)? else {
        return Ok(Vec::new());
    };
    let mut all = Vec::new();
    for (network, kind) in names_in(&top)? {
        if kind.is_some_and(|k| k != Type::Directory) {
            continue;
        }
        if let Some(dir) = open_or_none(Some(&top), Path::new(&network))? {
            all.extend(entries_in(dir, &network)?);
        }
    }
    Ok(all)
}

/// The names of the files of `network` (temporary ones left out), none
/// of them read; nothing where [`entries`] finds nothing.
pub fn names(state_dir: &Path, network: &str) -> io::Result<Vec<String>> {
    check_component(network)?;
    match open_network_dir(state_dir, network)? {
        Some(dir) => Ok(names_in(&dir)?.into_iter().map(|(name, _)| name).collect()),
        None => Ok(Vec::new()),
    }
}

/// [`names`] of a directory a caller trusts to be complete (an index):
/// nothing only when a directory is missing; one that is a link or not a
/// directory is an error, never taken for "nothing there".
pub fn trusted_names(state_dir: &Path, network: &str) -> io::Result<Vec<String>> {
    check_component(network)?;
    let Some(top) = open_trusted(None, state_dir, state_dir)? else {
        return Ok(Vec::new());
    };
    match open_trusted(Some(&top), Path::new(network), &state_dir.join(network))? {
        Some(dir) => Ok(names_in(&dir)?.into_iter().map(|(name, _)| name).collect()),
        None => Ok(Vec::new()),
    }
}

/// The networks of `state_dir` whose files [`names`] and [`entries`]
/// would look into (hidden ones, and what is not a directory, left out).
pub fn networks(state_dir: &Path) -> io::Result<Vec<String>> {
    let Some(top) = open_or_none(None, state_dir)? else {
        return Ok(Vec::new());
    };
    Ok(names_in(&top)?
        .into_iter()
        .filter(|(_, kind)| kind.is_none_or(|k| k == Type::Directory))
        .map(|(name, _)| name)
        .collect())
}

/// The directories of `state_dir` whose names start with `prefix`, hidden
/// ones included (a caller's own, beside the networks); nothing when it
/// is missing, not a directory or a link.
pub fn directories_named(state_dir: &Path, prefix: &str) -> io::Result<Vec<String>> {
    let Some(top) = open_or_none(None, state_dir)? else {
        return Ok(Vec::new());
    };
    Ok(all_names_in(&top)?
        .into_iter()
        .filter(|(name, kind)| name.starts_with(prefix) && kind.is_none_or(|k| k == Type::Directory))
        .map(|(name, _)| name)
        .collect())
}

/// Removes `<state_dir>/<network>` if it is an empty directory; one that
/// holds anything, is missing or is not a directory is left. A writer
/// that loses the directory this way finds it gone
/// ([`io::ErrorKind::NotFound`]) and makes it again.
pub fn remove_dir_if_empty(state_dir: &Path, network: &str) -> io::Result<()> {
    check_component(network)?;
    let Some(top) = open_or_none(None, state_dir)? else {
        return Ok(());
    };
    match unlinkat(&top, network, UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT | Errno::ENOTEMPTY | Errno::EEXIST | Errno::ENOTDIR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// [`open_dir_at`] for [`trusted_names`]: `None` only when nothing is
/// there.
fn open_trusted(at: Option<&OwnedFd>, path: &Path, shown: &Path) -> io::Result<Option<OwnedFd>> {
    match open_dir_at(at, path) {
        Ok(dir) => Ok(Some(dir)),
        Err(Errno::ENOENT) => Ok(None),
        Err(Errno::ENOTDIR | Errno::ELOOP) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is a link or not a directory", shown.display()),
        )),
        Err(e) => Err(e.into()),
    }
}

fn entries_in(dir: OwnedFd, network: &str) -> io::Result<Vec<Entry>> {
    Ok(names_in(&dir)?
        .into_iter()
        .map(|(name, _)| Entry {
            network: network.to_owned(),
            contents: read_in(&dir, &name),
            name,
        })
        .collect())
}

/// The names in `dir` that are not hidden (temporary files, `.` and
/// `..`), sorted, with the kind the directory entry tells when it does.
fn names_in(dir: &OwnedFd) -> io::Result<Vec<(String, Option<Type>)>> {
    let mut names = all_names_in(dir)?;
    names.retain(|(name, _)| !name.starts_with('.'));
    Ok(names)
}

/// [`names_in`] with the hidden names (but `.` and `..`).
fn all_names_in(dir: &OwnedFd) -> io::Result<Vec<(String, Option<Type>)>> {
    let mut listing = Dir::from_fd(dir.try_clone()?)?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        let entry = entry?;
        // Not UTF-8: no network or container name of ours.
        let Ok(name) = entry.file_name().to_str() else {
            continue;
        };
        if name != "." && name != ".." {
            names.push((name.to_owned(), entry.file_type()));
        }
    }
    names.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(names)
}

fn read_in(dir: &OwnedFd, name: &str) -> Result<Vec<u8>, Unreadable> {
    let flags = OFlag::O_RDONLY
        | OFlag::O_NOFOLLOW
        | OFlag::O_CLOEXEC
        | OFlag::from_bits_truncate(small_file::OPEN_FLAGS);
    let file =
        openat(dir, name, flags, Mode::empty()).map_err(|e| small_file::unopened(e.into(), Links::Refuse))?;
    small_file::read_opened(File::from(file), MAX_SIZE).map(|contents| contents.bytes)
}

fn open_network_dir(state_dir: &Path, network: &str) -> io::Result<Option<OwnedFd>> {
    match open_or_none(None, state_dir)? {
        Some(top) => open_or_none(Some(&top), Path::new(network)),
        None => Ok(None),
    }
}

/// Opens a directory that must not be a link: from the working
/// directory when `at` is `None`.
fn open_dir_at(at: Option<&OwnedFd>, path: &Path) -> Result<OwnedFd, Errno> {
    let flags =
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    match at {
        Some(dir) => openat(dir, path, flags, Mode::empty()),
        None => openat(AT_FDCWD, path, flags, Mode::empty()),
    }
}

/// [`open_dir_at`], `None` when nothing of ours can be there: missing,
/// not a directory or a link (`ENOTDIR` or `ELOOP`).
fn open_or_none(at: Option<&OwnedFd>, path: &Path) -> io::Result<Option<OwnedFd>> {
    match open_dir_at(at, path) {
        Ok(dir) => Ok(Some(dir)),
        Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Why a directory to write into could not be opened, naming a link as
/// one (`O_DIRECTORY | O_NOFOLLOW` answers `ENOTDIR` for a link to a
/// directory, `ELOOP` for any other).
fn refused(path: &Path, error: Errno) -> io::Error {
    let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let why = match error {
        Errno::ELOOP | Errno::ENOTDIR if link => {
            "is a symbolic link: records are never written through one".to_owned()
        }
        Errno::ENOTDIR => "is not a directory".to_owned(),
        other => io::Error::from(other).to_string(),
    };
    io::Error::other(format!("{} {why}", path.display()))
}

/// One name inside a directory: a `/`, `.` or `..` would reach outside it.
/// The longest file name the kernel takes (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// The file name of the record `key` identifies: the key itself when it
/// can name a file, else `sha256-<hex of the key>` (a container ID has no
/// length limit in libcni). Records carry their identity: a reader checks
/// a record's name against this of what it holds.
pub fn name_for(key: &str) -> String {
    if key.len() <= NAME_MAX && check_component(key).is_ok() {
        return key.to_owned();
    }
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256-{hex}")
}

fn check_component(name: &str) -> io::Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} cannot name a file in a state directory"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    fn mkfifo(path: &Path) {
        nix::unistd::mkfifo(path, Mode::S_IRWXU).expect("mkfifo");
    }

    /// Runs `scan` on another thread: one that blocks fails the test
    /// instead of hanging it.
    fn within<T: Send + 'static>(scan: impl FnOnce() -> T + Send + 'static) -> T {
        let (done, outcome) = mpsc::channel();
        std::thread::spawn(move || {
            // Gone only when the test timed out already.
            let _ = done.send(scan());
        });
        outcome
            .recv_timeout(Duration::from_secs(5))
            .expect("returned without blocking")
    }

    #[test]
    fn a_key_too_long_for_a_file_name_is_recorded_under_its_digest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        // 250 bytes: a name the kernel takes, with no room for a
        // temporary name built on it.
        let long = "c".repeat(250);
        assert_eq!(name_for(&long), long);
        write_whole(&state, "net", &name_for(&long), b"250").expect("written");
        assert_eq!(read(&state, "net", &long).expect("read"), b"250");
        let longer = "c".repeat(300);
        let name = name_for(&longer);
        assert!(name.starts_with("sha256-") && name.len() < NAME_MAX, "{name}");
        assert_ne!(name, name_for(&"c".repeat(301)));
        write_whole(&state, "net", &name, b"300").expect("written");
        assert_eq!(read(&state, "net", &name).expect("read"), b"300");
        assert_eq!(name_for("a/b"), name_for("a/b"), "one name for one key");
        assert!(name_for("a/b").starts_with("sha256-"));
    }

    #[test]
    fn written_whole_and_removed_whatever_stands_in_the_way() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        write_whole(&state, "net", "container", b"one").expect("written");
        write_whole(&state, "net", "container", b"two").expect("replaced");
        assert_eq!(read(&state, "net", "container").expect("read"), b"two");
        let names: Vec<_> = fs::read_dir(state.join("net"))
            .expect("listed")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["container"], "no temporary file is left");
        remove_if_present(&state, "net", "container").expect("removed");
        remove_if_present(&state, "net", "container").expect("removing twice is fine");
        let in_the_way = dir.path().join("a-file");
        fs::write(&in_the_way, "").expect("write");
        remove_if_present(&in_the_way, "net", "container").expect("a file in the way holds nothing");
        assert!(write_whole(&in_the_way, "net", "c", b"x").is_err());
        fs::create_dir_all(state.join("net").join("busy").join("inside")).expect("mkdir");
        assert!(
            remove_if_present(&state, "net", "busy").is_err(),
            "a directory is not removed as a record"
        );
        assert!(write_whole(&state, "..", "c", b"x").is_err());
        assert!(write_whole(&state, "net", "a/b", b"x").is_err());
    }

    #[test]
    fn a_record_replaces_a_link_at_its_name_and_never_writes_through_a_linked_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        let target = dir.path().join("elsewhere");
        fs::create_dir_all(state.join("net")).expect("mkdir");
        fs::create_dir_all(&target).expect("mkdir");
        fs::write(target.join("victim"), "kept").expect("write");
        symlink(target.join("victim"), state.join("net").join("c")).expect("link");
        write_whole(&state, "net", "c", b"record").expect("written");
        assert_eq!(fs::read(target.join("victim")).expect("read"), b"kept");
        assert!(
            fs::symlink_metadata(state.join("net").join("c"))
                .expect("stat")
                .is_file()
        );

        symlink(&target, state.join("linked-net")).expect("link");
        let refused = write_whole(&state, "linked-net", "c", b"x").expect_err("a linked network directory");
        assert!(refused.to_string().contains("symbolic link"), "{refused}");
        let linked_state = dir.path().join("linked-state");
        symlink(&state, &linked_state).expect("link");
        let refused = write_whole(&linked_state, "net", "d", b"x").expect_err("a linked state directory");
        assert!(refused.to_string().contains("symbolic link"), "{refused}");
        assert!(!state.join("net").join("d").exists());
        assert_eq!(
            fs::read_dir(&target).expect("listed").count(),
            1,
            "nothing written through a link"
        );
        remove_if_present(&linked_state, "net", "c").expect("a linked directory holds nothing of ours");
        assert!(
            state.join("net").join("c").exists(),
            "nothing removed through a link"
        );
        assert!(matches!(read(&linked_state, "net", "c"), Err(Unreadable::Absent)));
        assert!(entries(&linked_state, "net").expect("listed").is_empty());
        assert!(all_entries(&linked_state).expect("listed").is_empty());
    }

    #[test]
    fn scans_return_at_once_past_fifos_links_and_oversized_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let state = dir.path().join("state");
        write_whole(&state, "net", "good", b"{}").expect("written");
        let net = state.join("net");
        mkfifo(&net.join("fifo"));
        symlink(net.join("fifo"), net.join("link-to-fifo")).expect("link");
        symlink(net.join("good"), net.join("link-to-good")).expect("link");
        fs::write(
            net.join("huge"),
            vec![b' '; usize::try_from(MAX_SIZE).expect("size") + 1],
        )
        .expect("write");
        fs::write(net.join(".hidden"), "{}").expect("write");
        mkfifo(&state.join("fifo-as-network"));
        symlink(&net, state.join("linked-network")).expect("link");

        let scanned = within({
            let state = state.clone();
            move || all_entries(&state).expect("scanned")
        });
        let seen: Vec<(&str, &str, bool)> = scanned
            .iter()
            .map(|e| (e.network.as_str(), e.name.as_str(), e.contents.is_ok()))
            .collect();
        assert_eq!(
            seen,
            [
                ("net", "fifo", false),
                ("net", "good", true),
                ("net", "huge", false),
                ("net", "link-to-fifo", false),
                ("net", "link-to-good", false),
            ],
            "linked and non-directory networks and hidden files are not looked into"
        );
        assert!(
            scanned
                .iter()
                .filter_map(|e| e.contents.as_ref().err())
                .all(Unreadable::is_not_a_file)
        );
        let one = within({
            let state = state.clone();
            move || read(&state, "net", "link-to-fifo")
        });
        assert!(one.is_err_and(|e| e.is_not_a_file()));
        let one = within(move || read(&state, "net", "fifo"));
        assert!(one.is_err_and(|e| e.is_not_a_file()));
    }
}
