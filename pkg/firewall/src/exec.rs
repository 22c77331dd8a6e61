//! Running the iptables and nft tools, found on PATH or in the usual sbin
//! directories (runtimes do not always pass a PATH that has them).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::{Error, Result};

const FALLBACK_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];

/// The full path of `program`, if it exists.
pub fn find(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(FALLBACK_DIRS.iter().map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// Runs `program args` with `stdin`, returning its stdout.
pub fn run(program: &str, args: &[&str], stdin: &str) -> Result<String> {
    run_with(program, args, stdin, &[], false)
}

/// Like [`run`], with extra environment, and optionally in a private mount
/// namespace where `/etc/nsswitch.conf` is empty: iptables' owner match
/// looks users up even for numeric ids, and on nodes whose NSS reaches the
/// network (OS Login, LDAP) that stalls pod start for a minute (Istio
/// #48416). If the sandbox cannot be made, the tool runs anyway.
pub fn run_with(
    program: &str,
    args: &[&str],
    stdin: &str,
    env: &[(&str, &str)],
    without_nss: bool,
) -> Result<String> {
    let failed = |reason: String| Error::Command {
        program: program.to_owned(),
        reason,
    };
    let binary = find(program).ok_or_else(|| failed("not found on PATH".into()))?;
    let mut command = Command::new(&binary);
    command
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if without_nss {
        sandbox::hide_nss(&mut command);
    }
    let mut child = command.spawn().map_err(|e| failed(e.to_string()))?;
    if let Some(mut pipe) = child.stdin.take() {
        // Rulesets are small; the tools read all of stdin before answering.
        pipe.write_all(stdin.as_bytes())
            .map_err(|e| failed(e.to_string()))?;
    }
    let output = child.wait_with_output().map_err(|e| failed(e.to_string()))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        Err(failed(format!("{} ({})", stderr.trim(), output.status)))
    }
}

mod sandbox {
    use std::ffi::CString;
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    pub fn hide_nss(command: &mut Command) {
        let (Ok(root), Ok(null), Ok(nsswitch)) = (
            CString::new("/"),
            CString::new("/dev/null"),
            CString::new("/etc/nsswitch.conf"),
        ) else {
            return;
        };
        // SAFETY: runs in the forked child before exec and only makes raw
        // syscalls (unshare, mount) on strings prepared before the fork: no
        // allocation, no locks. Failures are ignored on purpose: the tool
        // then runs with the normal NSS configuration.
        unsafe {
            command.pre_exec(move || {
                if libc::unshare(libc::CLONE_NEWNS) == 0 {
                    let private = libc::MS_REC | libc::MS_PRIVATE;
                    let flags = std::ptr::null();
                    if libc::mount(std::ptr::null(), root.as_ptr(), std::ptr::null(), private, flags) == 0 {
                        libc::mount(
                            null.as_ptr(),
                            nsswitch.as_ptr(),
                            std::ptr::null(),
                            libc::MS_BIND,
                            flags,
                        );
                    }
                }
                Ok(())
            });
        }
    }
}
