//! Running the iptables and nft tools, found on PATH or in the usual sbin
//! directories (runtimes do not always pass a PATH that has them).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};

use crate::{Error, Result};

const FALLBACK_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];

/// The full path of `program`, if it exists. Looked up once per process:
/// one ADD asks for the same tool several times (to refuse early, to pick
/// the backend, to run it), and each walk stats every PATH entry.
pub fn find(program: &str) -> Option<PathBuf> {
    static FOUND: OnceLock<Mutex<HashMap<String, Option<PathBuf>>>> = OnceLock::new();
    let mut found = FOUND
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    found
        .entry(program.to_owned())
        .or_insert_with(|| search_path(program))
        .clone()
}

fn search_path(program: &str) -> Option<PathBuf> {
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
    let failed = |source: std::io::Error| Error::Exec {
        program: program.to_owned(),
        source,
    };
    let binary = find(program).ok_or_else(|| Error::NotFound {
        program: program.to_owned(),
    })?;
    let mut command = Command::new(&binary);
    command
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if without_nss {
        netns::hide_file_in_child(&mut command, Path::new("/etc/nsswitch.conf"));
    }
    let mut child = command.spawn().map_err(failed)?;
    // Rulesets are small; the tools read all of stdin before answering. A
    // tool that quits before reading it (a broken pipe here) is waited for
    // all the same: its own reason is the one worth reporting.
    let written = child
        .stdin
        .take()
        .map(|mut pipe| pipe.write_all(stdin.as_bytes()))
        .transpose();
    let output = child.wait_with_output().map_err(failed)?;
    if !output.status.success() {
        return Err(Error::Failed {
            program: program.to_owned(),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    written.map_err(failed)?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
