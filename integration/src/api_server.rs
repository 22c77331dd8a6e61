//! A stand-in for the Kubernetes API server (none can run here): HTTPS on
//! 127.0.0.1 inside a test's node namespace, with its own CA, checking a
//! bearer token and serving pod objects.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rcgen::{CertificateParams, DnType, IsCa, KeyPair};
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::Value;

/// Pods by (namespace, name).
pub type Pods = Arc<Mutex<BTreeMap<(String, String), Value>>>;

#[derive(Debug)]
pub struct ApiServer {
    pub port: u16,
    pub ca_pem: String,
    pub pods: Pods,
    requests: Arc<AtomicUsize>,
}

impl ApiServer {
    /// Serves in the namespace at `netns` (its lo must be up) until the test
    /// process ends.
    pub fn start(netns: &Path, token: &str) -> Self {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "test cluster CA");
        let ca = ca_params.self_signed(&ca_key).expect("CA cert");
        let server_key = KeyPair::generate().expect("server key");
        let server_params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .expect("server params");
        let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
        let server_cert = server_params
            .signed_by(&server_key, &issuer)
            .expect("server cert");
        let config = ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocols")
            .with_no_client_auth()
            .with_single_cert(
                vec![CertificateDer::from(server_cert.der().to_vec())],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server_key.serialize_der())),
            )
            .expect("server config");
        let config = Arc::new(config);

        let ns = netns::NetNs::open(netns).expect("node netns");
        let listener = ns
            .run(|| TcpListener::bind("127.0.0.1:0"))
            .expect("enter")
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let pods: Pods = Arc::default();
        let requests = Arc::new(AtomicUsize::new(0));
        let (served, counter, token) = (Arc::clone(&pods), Arc::clone(&requests), token.to_owned());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                counter.fetch_add(1, Ordering::SeqCst);
                let connection = rustls::ServerConnection::new(Arc::clone(&config)).expect("tls");
                let mut tls = rustls::StreamOwned::new(connection, stream);
                let _ = answer(&mut tls, &served, &token);
            }
        });
        ApiServer {
            port,
            ca_pem: ca.pem(),
            pods,
            requests,
        }
    }

    pub fn add_pod(&self, namespace: &str, name: &str, pod: Value) {
        self.pods
            .lock()
            .expect("pods")
            .insert((namespace.to_owned(), name.to_owned()), pod);
    }

    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// A kubeconfig for this server: `host` is how the plugin names it.
    pub fn kubeconfig(&self, dir: &Path, host: &str, token: &str) -> PathBuf {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority-data: {ca}\n    server: https://{host}:{}\n  name: local\n\
             contexts:\n- context:\n    cluster: local\n    user: istio-cni\n  name: istio-cni-context\ncurrent-context: istio-cni-context\n\
             users:\n- name: istio-cni\n  user:\n    token: {token}\n",
            self.port
        );
        let path = dir.join("istio-cni-kubeconfig");
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }
}

fn answer<T: std::io::Read + Write>(tls: &mut T, pods: &Pods, token: &str) -> std::io::Result<()> {
    let mut request_line = String::new();
    let mut authorized = false;
    {
        let mut reader = BufReader::new(&mut *tls);
        reader.read_line(&mut request_line)?;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header)? == 0 || header == "\r\n" {
                break;
            }
            let bearer = format!("Bearer {token}");
            if header.to_ascii_lowercase().starts_with("authorization:")
                && header.trim_end().ends_with(&bearer)
            {
                authorized = true;
            }
        }
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (status, body) = if !authorized {
        (
            401,
            r#"{"kind":"Status","message":"Unauthorized","code":401}"#.to_owned(),
        )
    } else if let ["api", "v1", "namespaces", ns, "pods", name] = parts.as_slice() {
        match pods
            .lock()
            .expect("pods")
            .get(&((*ns).to_owned(), (*name).to_owned()))
        {
            Some(pod) => (200, pod.to_string()),
            None => (
                404,
                format!(r#"{{"kind":"Status","message":"pods \"{name}\" not found","code":404}}"#),
            ),
        }
    } else {
        (
            404,
            r#"{"kind":"Status","message":"not found","code":404}"#.to_owned(),
        )
    };
    let reason = match status {
        200 => "OK",
        401 => "Unauthorized",
        _ => "Not Found",
    };
    // Chunked, as the real API server answers.
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    tls.write_all(response.as_bytes())?;
    tls.flush()
}
