//! Reading a small file from a directory the reader does not fully own:
//! a plugin's state directory, the configuration directory, libcni's
//! result cache, a kubeconfig and the files it names, the reference
//! host-local's leases. Only a regular file is read, opened without
//! blocking and up to a cap. Anything else standing there (a FIFO, a
//! device, a socket, a directory, a link where links are refused, a file
//! over the cap) is refused at once: opening a FIFO that has no writer
//! blocks for ever, and a plugin reading under the node's lock would hold
//! every other pod's ADD behind it; an endless or huge file would hold or
//! exhaust memory. Here, at the bottom of the dependency tree, so that
//! every plugin, libcni, host-local's store and `cnictl` share one reader.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Far above any configuration, record or credential the suite reads.
pub const MAX_SIZE: u64 = 1 << 20;

/// Whether a symbolic link at the file's own name is followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// As libcni and kubectl do: configuration files and projected
    /// credentials are often links.
    Follow,
    /// For files only their writer puts there (records, cache entries,
    /// leases), always regular: a link there is not one of them.
    Refuse,
}

/// Why nothing was read.
#[derive(Debug, thiserror::Error)]
pub enum Unreadable {
    #[error("no such file")]
    Absent,
    #[error("not a regular file but {0}")]
    NotRegular(&'static str),
    #[error("larger than {0} bytes")]
    TooLarge(u64),
    /// The file is there and may be a real one: an I/O error, out of
    /// descriptors, permission denied.
    #[error("{0}")]
    Failed(#[source] io::Error),
}

impl Unreadable {
    /// Something that is not a file of the kind read stands there: a
    /// caller scanning a directory skips it like junk, unlike a file it
    /// failed to read.
    pub fn is_not_a_file(&self) -> bool {
        matches!(self, Unreadable::NotRegular(_) | Unreadable::TooLarge(_))
    }
}

/// What was read, with the file's metadata as it was opened.
#[derive(Debug)]
pub struct Contents {
    pub bytes: Vec<u8>,
    pub metadata: Metadata,
}

/// The flags every open of a file not fully ours takes: `O_NONBLOCK` so a
/// FIFO or a device answers at once, `O_NOCTTY` so a terminal never
/// becomes ours.
pub const OPEN_FLAGS: i32 = libc::O_NONBLOCK | libc::O_NOCTTY;

/// Reads the file at `path` if it is a regular file of at most `limit`
/// bytes.
pub fn read(path: &Path, links: Links, limit: u64) -> Result<Contents, Unreadable> {
    let nofollow = match links {
        Links::Follow => 0,
        Links::Refuse => libc::O_NOFOLLOW,
    };
    // Looked at before it is opened: opening a device can act (a watchdog
    // starts counting); the open below is checked again, for what is
    // swapped in meanwhile.
    let looked = match links {
        Links::Follow => std::fs::metadata(path),
        Links::Refuse => std::fs::symlink_metadata(path),
    };
    if let Ok(metadata) = looked {
        if links == Links::Refuse && metadata.file_type().is_symlink() {
            return Err(Unreadable::NotRegular("a symbolic link"));
        }
        if let Some(kind) = not_regular(&metadata) {
            return Err(Unreadable::NotRegular(kind));
        }
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(OPEN_FLAGS | nofollow)
        .open(path)
        .map_err(|e| unopened(e, links))?;
    read_opened(file, limit)
}

/// The outcome of an open that failed, as [`Unreadable`].
pub fn unopened(error: io::Error, links: Links) -> Unreadable {
    match error.raw_os_error() {
        // A component on the way is not a directory: nothing of this name.
        Some(libc::ENOENT | libc::ENOTDIR) => Unreadable::Absent,
        Some(libc::ELOOP) if links == Links::Refuse => Unreadable::NotRegular("a symbolic link"),
        // What open(2) answers for a socket.
        Some(libc::ENXIO) => Unreadable::NotRegular("a socket or a device without its driver"),
        _ => Unreadable::Failed(error),
    }
}

/// Reads `file`, opened by the caller with [`OPEN_FLAGS`] (and
/// `O_NOFOLLOW` where links are refused), if it is a regular file of at
/// most `limit` bytes. The cap holds even for a file growing meanwhile.
pub fn read_opened(file: File, limit: u64) -> Result<Contents, Unreadable> {
    let metadata = file.metadata().map_err(Unreadable::Failed)?;
    if let Some(kind) = not_regular(&metadata) {
        return Err(Unreadable::NotRegular(kind));
    }
    if metadata.len() > limit {
        return Err(Unreadable::TooLarge(limit));
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(Unreadable::Failed)?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > limit {
        return Err(Unreadable::TooLarge(limit));
    }
    Ok(Contents { bytes, metadata })
}

/// What stands there, when it is not a regular file ("a FIFO", "a
/// directory", ...), for messages that refuse it.
pub fn not_regular(metadata: &Metadata) -> Option<&'static str> {
    let kind = metadata.file_type();
    if kind.is_file() {
        None
    } else if kind.is_fifo() {
        Some("a FIFO")
    } else if kind.is_dir() {
        Some("a directory")
    } else if kind.is_socket() {
        Some("a socket")
    } else if kind.is_char_device() || kind.is_block_device() {
        Some("a device")
    } else {
        Some("a special file")
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    fn mkfifo(path: &Path) {
        let made = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .expect("mkfifo runs");
        assert!(made.success(), "mkfifo {}", path.display());
    }

    /// Runs `read` on another thread: a read that blocks fails the test
    /// instead of hanging it.
    fn read_within(path: &Path, links: Links, limit: u64) -> Result<Contents, Unreadable> {
        let (done, outcome) = mpsc::channel();
        let path = path.to_owned();
        std::thread::spawn(move || {
            // Gone only when the test timed out already.
            let _ = done.send(read(&path, links, limit));
        });
        outcome
            .recv_timeout(Duration::from_secs(5))
            .expect("the read returned without blocking")
    }

    #[test]
    fn only_regular_files_within_the_cap_are_read_and_nothing_blocks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let at = |name: &str| dir.path().join(name);
        std::fs::write(at("file"), "{}").expect("write");
        let file = read_within(&at("file"), Links::Refuse, 2).expect("read");
        assert_eq!(file.bytes, b"{}");
        assert!(file.metadata.is_file());

        mkfifo(&at("fifo"));
        for links in [Links::Follow, Links::Refuse] {
            let refused = read_within(&at("fifo"), links, MAX_SIZE).expect_err("a FIFO");
            assert!(refused.is_not_a_file(), "{refused}");
            assert!(refused.to_string().contains("FIFO"), "{refused}");
        }
        std::os::unix::fs::symlink(at("fifo"), at("link-to-fifo")).expect("link");
        std::os::unix::fs::symlink(at("file"), at("link-to-file")).expect("link");
        assert!(read_within(&at("link-to-fifo"), Links::Follow, MAX_SIZE).is_err_and(|e| e.is_not_a_file()));
        assert!(read_within(&at("link-to-fifo"), Links::Refuse, MAX_SIZE).is_err_and(|e| e.is_not_a_file()));
        assert_eq!(
            read_within(&at("link-to-file"), Links::Follow, 2)
                .expect("followed")
                .bytes,
            b"{}"
        );
        let refused = read_within(&at("link-to-file"), Links::Refuse, 2).expect_err("a link");
        assert!(refused.to_string().contains("symbolic link"), "{refused}");

        let _listening = UnixListener::bind(at("socket")).expect("bind");
        assert!(read_within(&at("socket"), Links::Follow, MAX_SIZE).is_err_and(|e| e.is_not_a_file()));
        assert!(read_within(dir.path(), Links::Follow, MAX_SIZE).is_err_and(|e| e.is_not_a_file()));
        assert!(
            read_within(Path::new("/dev/zero"), Links::Follow, MAX_SIZE).is_err_and(|e| e.is_not_a_file())
        );

        let too_large = read_within(&at("file"), Links::Refuse, 1).expect_err("over the cap");
        assert!(matches!(too_large, Unreadable::TooLarge(1)), "{too_large}");
        assert!(matches!(
            read_within(&at("none"), Links::Refuse, 1),
            Err(Unreadable::Absent)
        ));
        assert!(matches!(
            read_within(&at("file").join("below"), Links::Refuse, 1),
            Err(Unreadable::Absent)
        ));
    }
}
