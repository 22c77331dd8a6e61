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
    let failed = |reason: String| Error::Command {
        program: program.to_owned(),
        reason,
    };
    let binary = find(program).ok_or_else(|| failed("not found on PATH".into()))?;
    let mut child = Command::new(&binary)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| failed(e.to_string()))?;
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
