//! Running another plugin binary the way libcni does: found by `type` on
//! CNI_PATH, the caller's environment plus the CNI_* overrides, the
//! configuration on stdin, a result or a CNI error on its stdout.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command as Process, Output, Stdio};
use std::thread;
use std::time::Duration;

use crate::env::{CNI_COMMAND, Command};
use crate::error::{Error, Result};
use crate::result::CniResult;

/// How often a spawn failing with ETXTBSY (the binary is being replaced) is
/// retried, as libcni does.
const TEXT_FILE_BUSY_RETRIES: u32 = 5;

/// Refuses a plugin `type` that could name anything but a file directly in a
/// CNI_PATH directory.
pub fn validate_plugin_type(plugin_type: &str) -> Result<()> {
    if plugin_type.is_empty() {
        return Err(Error::invalid_config("plugin type is empty"));
    }
    if plugin_type.contains('/') || plugin_type.contains("..") || plugin_type.contains('\0') {
        return Err(Error::invalid_config(format!(
            "invalid plugin type {plugin_type:?}: it must be a file name without '/' or '..'"
        )));
    }
    Ok(())
}

/// The first executable regular file named `plugin_type` in `search_path`.
pub fn find_plugin(plugin_type: &str, search_path: &[PathBuf]) -> Result<PathBuf> {
    validate_plugin_type(plugin_type)?;
    if search_path.is_empty() {
        return Err(Error::invalid_env(format!(
            "cannot find plugin {plugin_type:?}: CNI_PATH is empty"
        )));
    }
    search_path
        .iter()
        .map(|dir| dir.join(plugin_type))
        .find(|candidate| is_executable_file(candidate))
        .ok_or_else(|| {
            let dirs: Vec<String> = search_path.iter().map(|d| d.display().to_string()).collect();
            Error::invalid_config(format!(
                "failed to find plugin {plugin_type:?} in path [{}]",
                dirs.join(" ")
            ))
        })
}

fn is_executable_file(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Executes `binary` with the caller's environment plus `env`, feeding
/// `stdin`. Returns stdout on success; on failure the plugin's CNI error if
/// it printed one, else libcni's `netplugin failed` wrapping of stderr. The
/// child's stderr is passed on to ours so logs are not lost.
pub fn exec_plugin(binary: &Path, env: &[(&str, OsString)], stdin: &[u8]) -> Result<Vec<u8>> {
    let output = run_plugin(binary, env, stdin)?;
    if !output.stderr.is_empty() {
        let _ = std::io::stderr().write_all(&output.stderr);
    }
    judge(output)
}

/// Executes `binary` as [`exec_plugin`] does and returns everything it
/// printed, whatever its exit status: for a caller that reads the plugin's
/// log itself.
pub fn run_plugin(binary: &Path, env: &[(&str, OsString)], stdin: &[u8]) -> Result<Output> {
    let mut attempt = 0;
    let mut child = loop {
        let mut process = Process::new(binary);
        process
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match process.spawn() {
            Ok(child) => break child,
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && attempt < TEXT_FILE_BUSY_RETRIES => {
                attempt += 1;
                thread::sleep(Duration::from_millis(50 * u64::from(attempt)));
            }
            Err(e) => {
                return Err(Error::io(format!("failed to execute {}: {e}", binary.display())));
            }
        }
    };

    // A separate writer keeps a large stdin from deadlocking against a child
    // that fills its stdout first.
    let writer = child.stdin.take().map(|mut pipe| {
        let data = stdin.to_vec();
        thread::spawn(move || {
            // A plugin may exit without reading stdin; that is its business.
            let _ = pipe.write_all(&data);
        })
    });
    let output = child
        .wait_with_output()
        .map_err(|e| Error::io(format!("failed to wait for {}: {e}", binary.display())))?;
    if let Some(writer) = writer {
        let _ = writer.join();
    }
    Ok(output)
}

/// What a plugin's run means, as libcni reads it: its stdout on success;
/// on failure its CNI error if it printed one, else libcni's `netplugin
/// failed` wrapping of its stderr.
pub fn judge(output: Output) -> Result<Vec<u8>> {
    if output.status.success() {
        return Ok(output.stdout);
    }
    if let Some(err) = Error::from_plugin_output(&output.stdout) {
        return Err(err);
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stderr = stderr.trim_end();
    Err(if stderr.is_empty() {
        Error::internal(format!(
            "netplugin failed with no error message: {}",
            output.status
        ))
    } else {
        Error::internal(format!("netplugin failed: {stderr:?}"))
    })
}

/// Runs a delegated plugin (IPAM) for `command`, passing our stdin and
/// environment through with CNI_COMMAND set.
pub fn delegate(
    plugin_type: &str,
    command: Command,
    stdin: &[u8],
    search_path: &[PathBuf],
) -> Result<Vec<u8>> {
    let binary = find_plugin(plugin_type, search_path)?;
    exec_plugin(&binary, &[(CNI_COMMAND, command.as_str().into())], stdin)
}

/// Delegated ADD: the delegate's result, read whatever version it printed.
pub fn delegate_add(plugin_type: &str, stdin: &[u8], search_path: &[PathBuf]) -> Result<CniResult> {
    let stdout = delegate(plugin_type, Command::Add, stdin, search_path)?;
    CniResult::from_slice(&stdout).map_err(|e| e.context(format!("result of {plugin_type}")))
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::error::Code;

    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    #[test]
    fn types_that_could_escape_cni_path_are_refused() {
        for bad in ["../host-local", "..", "a/b", "/bin/sh", "x..y", ""] {
            let err = validate_plugin_type(bad).expect_err(bad);
            assert!(err.has_code(Code::InvalidConfig), "{bad}");
        }
        assert!(validate_plugin_type("host-local").is_ok());
    }

    #[test]
    fn refused_types_are_never_executed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let marker = dir.path().join("ran");
        let sub = dir.path().join("bin");
        fs::create_dir(&sub).expect("mkdir");
        script(dir.path(), "evil", &format!("touch {}", marker.display()));
        let err = delegate("../evil", Command::Add, b"{}", &[sub]).expect_err("refused");
        assert!(err.has_code(Code::InvalidConfig));
        assert!(!marker.exists(), "the binary outside CNI_PATH must not run");
    }

    #[test]
    fn finds_the_first_executable_on_the_path() {
        let a = tempfile::tempdir().expect("tempdir");
        let b = tempfile::tempdir().expect("tempdir");
        fs::write(a.path().join("ipam"), "not executable").expect("write");
        let wanted = script(b.path(), "ipam", "exit 0");
        let found = find_plugin("ipam", &[a.path().into(), b.path().into()]).expect("found");
        assert_eq!(found, wanted);
        let err = find_plugin("missing", &[a.path().into()]).expect_err("absent");
        assert!(
            err.msg.starts_with("failed to find plugin \"missing\" in path ["),
            "{}",
            err.msg
        );
        assert!(
            find_plugin("ipam", &[])
                .expect_err("empty path")
                .has_code(Code::InvalidEnvironment)
        );
    }

    #[test]
    fn passes_stdin_and_command_and_reads_the_result() {
        let dir = tempfile::tempdir().expect("tempdir");
        script(
            dir.path(),
            "echo-ipam",
            r#"read -r conf; [ "$CNI_COMMAND" = ADD ] || exit 3
echo '{"cniVersion":"0.4.0","ips":[{"version":"4","address":"10.0.0.7/24"}],"dns":{}}'"#,
        );
        let result = delegate_add("echo-ipam", b"{\"name\":\"n\"}\n", &[dir.path().into()]).expect("ok");
        assert_eq!(result.ips[0].address.to_string(), "10.0.0.7/24");
    }

    #[test]
    fn a_large_stdin_does_not_deadlock() {
        let dir = tempfile::tempdir().expect("tempdir");
        script(dir.path(), "chatty", "head -c 200000 /dev/zero; cat >/dev/null");
        let big = vec![b' '; 1 << 20];
        let out = delegate("chatty", Command::Del, &big, &[dir.path().into()]).expect("ok");
        assert_eq!(out.len(), 200_000);
    }

    #[test]
    fn failures_carry_the_plugins_error_or_its_stderr() {
        let dir = tempfile::tempdir().expect("tempdir");
        script(
            dir.path(),
            "cni-err",
            r#"echo '{"code":11,"msg":"busy","details":"retry"}'; exit 1"#,
        );
        script(dir.path(), "stderr-err", "echo 'boom' >&2; exit 2");
        script(dir.path(), "silent-err", "exit 3");
        let path = [dir.path().to_path_buf()];
        let err = delegate("cni-err", Command::Add, b"", &path).expect_err("fails");
        assert_eq!(
            (err.code, err.msg.as_str(), err.details.as_str()),
            (11, "busy", "retry")
        );
        let err = delegate("stderr-err", Command::Add, b"", &path).expect_err("fails");
        assert_eq!(err.msg, "netplugin failed: \"boom\"");
        assert!(err.has_code(Code::Internal));
        let err = delegate("silent-err", Command::Add, b"", &path).expect_err("fails");
        assert!(
            err.msg.starts_with("netplugin failed with no error message"),
            "{}",
            err.msg
        );
    }

    #[test]
    fn an_unparsable_result_is_a_decoding_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        script(dir.path(), "garbage", "echo not-json");
        let err = delegate_add("garbage", b"", &[dir.path().into()]).expect_err("garbage");
        assert!(err.has_code(Code::Decoding));
        assert!(err.msg.starts_with("result of garbage"), "{}", err.msg);
    }
}
