//! The small files a plugin keeps per container beside its rules, so that
//! a DEL without prevResult or a GC knows what was written (under /run:
//! tmpfs, gone at reboot with every network namespace).

use std::fs;
use std::io::{self, Write};
use std::path::Path;

/// Writes `bytes` at `path` under a temporary name in the same directory,
/// then renames it into place: a reader, or a kill -9 halfway, never
/// leaves half a file behind. Temporary names start with `.`.
pub fn write_whole(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let mut file = tempfile::Builder::new().prefix(".tmp-").tempfile_in(dir)?;
    file.write_all(bytes)?;
    file.persist(path).map(drop).map_err(|e| e.error)
}

/// Removes `path`. A file that is not there is fine, and so is a
/// directory on the way that is not one (someone's file in the way
/// holds no state of ours): a DEL must not fail for either.
pub fn remove_if_present(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if !matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory) => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_whole_and_removed_whatever_stands_in_the_way() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("net").join("container");
        write_whole(&path, b"one").expect("written");
        write_whole(&path, b"two").expect("replaced");
        assert_eq!(fs::read(&path).expect("read"), b"two");
        let names: Vec<_> = fs::read_dir(dir.path().join("net"))
            .expect("listed")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["container"], "no temporary file is left");
        remove_if_present(&path).expect("removed");
        remove_if_present(&path).expect("removing twice is fine");
        let in_the_way = dir.path().join("a-file");
        fs::write(&in_the_way, "").expect("write");
        remove_if_present(&in_the_way.join("net").join("container"))
            .expect("a file in the way holds nothing");
        assert!(write_whole(&in_the_way.join("net").join("c"), b"x").is_err());
        let busy = dir.path().join("busy");
        fs::create_dir_all(busy.join("inside")).expect("mkdir");
        assert!(
            remove_if_present(&busy).is_err(),
            "a directory is not removed as a record"
        );
    }
}
