//! The parts of a kubeconfig a client needs: the current context's cluster
//! (server, CA) and user (token or client certificate).

use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use cni::small_file::{self, Links, Unreadable};
use serde::Deserialize;

use crate::error::{Error, Result};

#[derive(Deserialize)]
struct KubeConfig {
    #[serde(default)]
    clusters: Vec<NamedCluster>,
    #[serde(default)]
    users: Vec<NamedUser>,
    #[serde(default)]
    contexts: Vec<NamedContext>,
    #[serde(rename = "current-context", default)]
    current_context: Option<String>,
}

#[derive(Deserialize)]
struct NamedCluster {
    name: String,
    cluster: Cluster,
}

#[derive(Deserialize)]
struct NamedContext {
    name: String,
    context: Context,
}

#[derive(Deserialize)]
struct NamedUser {
    name: String,
    user: User,
}

#[derive(Deserialize, Default)]
struct Cluster {
    server: String,
    #[serde(rename = "certificate-authority-data", default)]
    ca_data: Option<String>,
    #[serde(rename = "certificate-authority", default)]
    ca_file: Option<PathBuf>,
}

#[derive(Deserialize)]
struct Context {
    cluster: String,
    user: String,
}

#[derive(Deserialize, Default)]
struct User {
    #[serde(default)]
    token: Option<String>,
    #[serde(rename = "tokenFile", default)]
    token_file: Option<PathBuf>,
    #[serde(rename = "client-certificate-data", default)]
    cert_data: Option<String>,
    #[serde(rename = "client-key-data", default)]
    key_data: Option<String>,
    #[serde(rename = "client-certificate", default)]
    cert_file: Option<PathBuf>,
    #[serde(rename = "client-key", default)]
    key_file: Option<PathBuf>,
}

/// How the client proves who it is.
#[derive(Clone, Default)]
pub struct Credentials {
    pub token: Option<String>,
    /// PEM client certificate chain and key.
    pub client_cert: Option<(Vec<u8>, Vec<u8>)>,
}

/// Says which credentials there are, never what they are, so no `{:?}`
/// can put a token or key in a log.
impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("client_cert", &self.client_cert.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

pub struct Loaded {
    pub server: String,
    pub ca_pem: Vec<u8>,
    pub credentials: Credentials,
}

/// A kubeconfig or a file it names: followed if a link (projected
/// service-account files are links), never blocking on a FIFO put there
/// (the pod's ADD would wait for ever), and small.
fn read_file(path: &Path) -> Result<Vec<u8>, Unreadable> {
    small_file::read(path, Links::Follow, small_file::MAX_SIZE).map(|contents| contents.bytes)
}

pub fn load(path: &Path) -> Result<Loaded> {
    let fail = |reason: String| Error::Config {
        path: path.display().to_string(),
        reason,
    };
    let text = String::from_utf8(read_file(path).map_err(|e| fail(e.to_string()))?)
        .map_err(|e| fail(e.to_string()))?;
    let config: KubeConfig = serde_yaml_ng::from_str(&text).map_err(|e| fail(e.to_string()))?;
    let base = path.parent().unwrap_or(Path::new("/"));
    let context = match &config.current_context {
        Some(name) => Some(
            config
                .contexts
                .iter()
                .find(|c| &c.name == name)
                .ok_or_else(|| fail(format!("no context {name:?}")))?,
        ),
        None => config.contexts.first(),
    };
    let cluster = match context {
        Some(c) => config.clusters.iter().find(|cl| cl.name == c.context.cluster),
        None => config.clusters.first(),
    }
    .ok_or_else(|| fail("no cluster".into()))?;
    let user = match context {
        Some(c) => config
            .users
            .iter()
            .find(|u| u.name == c.context.user)
            .map(|u| &u.user),
        None => config.users.first().map(|u| &u.user),
    };
    let read =
        |file: &PathBuf| read_file(&base.join(file)).map_err(|e| fail(format!("{}: {e}", file.display())));
    let decode = |data: &str| STANDARD.decode(data.trim()).map_err(|e| fail(e.to_string()));
    let cluster = &cluster.cluster;
    let ca_pem = match (&cluster.ca_data, &cluster.ca_file) {
        (Some(data), _) => decode(data)?,
        (None, Some(file)) => read(file)?,
        (None, None) => {
            return Err(fail(
                "no certificate-authority: the server's certificate cannot be checked".into(),
            ));
        }
    };
    let mut credentials = Credentials::default();
    if let Some(user) = user {
        credentials.token = match (&user.token, &user.token_file) {
            (Some(token), _) => Some(token.trim().to_owned()),
            (None, Some(file)) => Some(String::from_utf8_lossy(&read(file)?).trim().to_owned()),
            (None, None) => None,
        };
        let cert = match (&user.cert_data, &user.cert_file) {
            (Some(data), _) => Some(decode(data)?),
            (None, Some(file)) => Some(read(file)?),
            _ => None,
        };
        let key = match (&user.key_data, &user.key_file) {
            (Some(data), _) => Some(decode(data)?),
            (None, Some(file)) => Some(read(file)?),
            _ => None,
        };
        credentials.client_cert = cert.zip(key);
    }
    Ok(Loaded {
        server: cluster.server.clone(),
        ca_pem,
        credentials,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_istios_kubeconfig_shape() {
        let dir = std::env::temp_dir().join(format!("kubeconfig-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("ca.pem"), "CA").expect("write");
        let path = dir.join("kc");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority: ca.pem\n    server: https://10.96.0.1:443\n  name: local\n\
             contexts:\n- context:\n    cluster: local\n    user: istio-cni\n  name: istio-cni-context\ncurrent-context: istio-cni-context\n\
             users:\n- name: istio-cni\n  user:\n    token: abc\n",
        )
        .expect("write");
        let loaded = load(&path).expect("valid");
        assert_eq!(loaded.server, "https://10.96.0.1:443");
        assert_eq!(loaded.ca_pem, b"CA");
        assert_eq!(loaded.credentials.token.as_deref(), Some("abc"));
        assert!(
            !format!("{:?}", loaded.credentials).contains("abc"),
            "never printed"
        );
        std::fs::remove_file(dir.join("ca.pem")).expect("rm");
        let made = std::process::Command::new("mkfifo")
            .arg(dir.join("ca.pem"))
            .status()
            .expect("mkfifo");
        assert!(made.success());
        let refused = load(&path).err().expect("a FIFO as the CA").to_string();
        assert!(refused.contains("FIFO"), "{refused}");
        std::fs::write(&path, "clusters:\n- name: c\n  cluster:\n    server: https://x\n").expect("write");
        assert!(load(&path).is_err(), "a cluster without CA is refused");
        std::fs::remove_dir_all(&dir).ok();
    }
}
