//! Files on the host, which others share: whole-file replacement for
//! what the agent writes (plugin binaries, conflists, the plugin's
//! kubeconfig, its record), so a reader, the runtime among them, sees the
//! old file or the new one, never half of one; reads that take only a
//! small regular file, never blocking on whatever else is in the way; and
//! the lock two agents on one node take around their changes.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use cni::small_file::{self, Links, Unreadable};

use crate::error::Error;

/// How the files written beside a place end: the runtime skips them (it
/// reads `.conf`, `.conflist`, `.json` and exact plugin names), and
/// `install` sweeps any an agent killed while writing left.
pub const TEMPORARY: &str = ".cni-suite.tmp";

/// Writes `bytes` to `path` through a dot-file beside it (created with
/// `mode`, synced), then renames it over `path` and syncs the directory.
/// The file beside has one name, removed first: one left by a killed
/// agent goes, and a link planted there is replaced, never written
/// through.
pub fn replace_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), Error> {
    let failed = |e: io::Error| Error::file("write", path, e);
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let beside = dir.join(format!(".{name}{TEMPORARY}"));
    match fs::remove_file(&beside) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(failed(e)),
    }
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&beside)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        })
        .and_then(|()| fs::rename(&beside, path));
    if let Err(e) = written {
        let _ = fs::remove_file(&beside);
        return Err(failed(e));
    }
    sync_dir(dir);
    Ok(())
}

/// The text of the file at `path`, when it is a regular file (a link is
/// followed, as libcni follows it) of at most `cni::small_file::MAX_SIZE`
/// bytes, read with the suite's one reader of files others may put there:
/// a FIFO must not hang the agent, whose uninstall waits for the change
/// that reads.
pub fn read_text(path: &Path) -> io::Result<String> {
    let contents = small_file::read(path, Links::Follow, small_file::MAX_SIZE).map_err(|e| match e {
        Unreadable::Absent => io::Error::from(io::ErrorKind::NotFound),
        Unreadable::Failed(e) => e,
        refused => io::Error::other(refused.to_string()),
    })?;
    String::from_utf8(contents.bytes).map_err(io::Error::other)
}

/// Holds an exclusive `flock` on `dir` itself (created if missing) until
/// the returned file is dropped: two agents on one node (a rollout's old
/// and new pod) never interleave their changes. Not reentrant: a second
/// lock of the same directory from this process waits for the first.
pub fn lock_dir(dir: &Path) -> Result<File, Error> {
    let failed = |what: &'static str, e: io::Error| Error::file(what, dir, e);
    fs::create_dir_all(dir).map_err(|e| failed("create", e))?;
    let file = File::open(dir).map_err(|e| failed("open", e))?;
    file.lock().map_err(|e| failed("lock", e))?;
    Ok(file)
}

/// Removes what an agent killed while writing left in `dir`: the files
/// beside a place, which only [`replace_file`] names so.
pub fn sweep(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.ends_with(TEMPORARY) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// The permission bits of the file at `path`, if there is one: a file
/// another agent wrote keeps its mode when the agent replaces it.
pub fn mode_of(path: &Path) -> Option<u32> {
    fs::metadata(path)
        .ok()
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o7777)
}

/// Makes a rename in `dir` durable; a failure only weakens that.
pub fn sync_dir(dir: &Path) {
    if let Ok(dir) = File::open(dir) {
        let _ = dir.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_of_bounded_size_are_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("a.conf");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("fifo");
        assert!(read_text(&fifo).is_err(), "a FIFO is refused without blocking");
        let big = dir.path().join("b.conf");
        std::fs::write(
            &big,
            vec![b' '; usize::try_from(small_file::MAX_SIZE).expect("size") + 1],
        )
        .expect("write");
        assert!(read_text(&big).is_err());
        let real = dir.path().join("c.conf");
        std::fs::write(&real, "{}").expect("write");
        let link = dir.path().join("d.conf");
        std::os::unix::fs::symlink(&real, &link).expect("link");
        assert_eq!(read_text(&link).expect("followed"), "{}");
        assert!(read_text(dir.path()).is_err(), "a directory is no file");
    }
}
