//! Whole-file replacement for what the agent writes on the host (plugin
//! binaries, conflists, the plugin's kubeconfig): a reader, the runtime
//! among them, sees the old file or the new one, never half of one.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::Error;

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
    let failed = |e: io::Error| Error::Io(format!("cannot write {}: {e}", path.display()));
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

/// Makes a rename in `dir` durable; a failure only weakens that.
pub fn sync_dir(dir: &Path) {
    if let Ok(dir) = File::open(dir) {
        let _ = dir.sync_all();
    }
}
