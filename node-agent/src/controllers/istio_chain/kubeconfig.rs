//! The kubeconfig istio-redirect reads pods with, for runtimes that do not
//! hand it the pod's annotations: the API server as the agent reaches it,
//! the service account's CA and token. Mode 0600, outside the shared CNI
//! conf directory (as Istio keeps it since 2024), and written again when
//! the kubelet rotates the token or the CA changes.

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;

use base64::Engine;
use serde_json::{Value, json};

use crate::atomic::read_text;
use crate::error::Error;

/// The kubeconfig for the service account in `account_dir` (JSON, which
/// every kubeconfig reader takes as YAML).
pub fn render(server: &str, account_dir: &Path) -> Result<Value, Error> {
    let read = |name: &str| {
        let path = account_dir.join(name);
        read_text(&path).map_err(|e| Error::read(&path, e))
    };
    let ca = base64::engine::general_purpose::STANDARD.encode(read("ca.crt")?);
    let token = read("token")?.trim().to_owned();
    Ok(json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": "istio-cni", "user": {"token": token}}],
        "contexts": [{"name": "istio-cni-context", "context": {"cluster": "local", "user": "istio-cni"}}],
        "current-context": "istio-cni-context",
    }))
}

/// Writes `content` to `path` (mode 0600, through a file beside it
/// renamed over it) unless it already holds it; true when it wrote.
pub fn write_if_changed(path: &Path, content: &Value) -> Result<bool, Error> {
    let text = serde_json::to_string_pretty(content)?;
    let failed = |e: std::io::Error| Error::file("write", path, e);
    let private = std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o777 == 0o600);
    if private && read_text(path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(failed)?;
    crate::atomic::replace_file(path, text.as_bytes(), 0o600)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_private_and_again_only_when_the_token_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let account = dir.path().join("sa");
        std::fs::create_dir(&account).expect("mkdir");
        std::fs::write(account.join("ca.crt"), "CA").expect("ca");
        std::fs::write(account.join("token"), "one\n").expect("token");
        let path = dir.path().join("run/istio-cni/istio-cni-kubeconfig");
        let first = render("https://10.96.0.1:443", &account).expect("render");
        assert_eq!(first["users"][0]["user"]["token"], "one");
        assert_eq!(
            first["clusters"][0]["cluster"]["certificate-authority-data"],
            "Q0E="
        );
        assert!(write_if_changed(&path, &first).expect("write"));
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!write_if_changed(&path, &first).expect("same"));
        std::fs::write(account.join("token"), "two").expect("rotated");
        let second = render("https://10.96.0.1:443", &account).expect("render");
        assert!(write_if_changed(&path, &second).expect("rotated"));
        let read: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("JSON");
        assert_eq!(read["users"][0]["user"]["token"], "two");
    }
}
