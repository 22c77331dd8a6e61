//! A child process's private view of the filesystem: a mount namespace of
//! its own in which one file is replaced, made between fork and exec so the
//! parent and the machine never see it.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use nix::libc;

/// Makes `command`'s child see `/dev/null` (an empty file) at `file`. If the
/// private mount cannot be made, the child runs with the real file: callers
/// use this to avoid a risk, not to enforce a policy.
pub fn hide_file_in_child(command: &mut Command, file: &Path) {
    let (Ok(root), Ok(null), Ok(target)) = (
        CString::new("/"),
        CString::new("/dev/null"),
        CString::new(file.as_os_str().as_bytes()),
    ) else {
        return;
    };
    // SAFETY: runs in the forked child before exec and only makes raw
    // syscalls (unshare, mount) on strings prepared before the fork: no
    // allocation, no locks. Their results are checked and failures are
    // tolerated on purpose (see above).
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(move || {
            if libc::unshare(libc::CLONE_NEWNS) == 0 {
                let private = libc::MS_REC | libc::MS_PRIVATE;
                let (no_source, no_type, no_data) = (std::ptr::null(), std::ptr::null(), std::ptr::null());
                if libc::mount(no_source, root.as_ptr(), no_type, private, no_data) == 0 {
                    libc::mount(null.as_ptr(), target.as_ptr(), no_type, libc::MS_BIND, no_data);
                }
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_child_sees_an_empty_file_and_the_parent_the_real_one() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "needs root for a mount namespace"
        );
        let file = "/etc/nsswitch.conf";
        let before = std::fs::read(file).expect("readable");
        assert!(!before.is_empty());
        let mut command = Command::new("wc");
        command.args(["-c", file]);
        hide_file_in_child(&mut command, Path::new(file));
        let out = command.output().expect("wc runs");
        assert!(out.status.success());
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("0 {file}"));
        assert_eq!(std::fs::read(file).expect("readable"), before);
    }
}
