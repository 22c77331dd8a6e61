//! A stand-in for the Kubernetes API server (none can run here): HTTPS
//! inside a test's namespace, with its own CA, checking a bearer token, and
//! serving pods and nodes (and the namespaces and NetworkPolicies policy
//! reads) the way the real one does for the calls the suite
//! makes: GET of one object, LIST with a `resourceVersion`, WATCH streams of
//! ADDED/MODIFIED/DELETED events and BOOKMARKs from a version, an expired
//! version answered with HTTP 200 and an ERROR event carrying a 410
//! `Expired` Status, 401 for a bad token; DELETE of a pod with UID and
//! resourceVersion preconditions (409 Conflict when one fails), JSON merge
//! PATCH of a pod or its `status` subresource and of a Node (its
//! resourceVersion a precondition), and POST of Events. Tests
//! change the objects, expire old versions, drop open watches, and read
//! back every write request.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rcgen::{CertificateParams, DnType, IsCa, KeyPair};
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde_json::{Value, json};

/// How often an open watch sends a BOOKMARK (the real server: about a
/// minute; short here so tests see them).
const BOOKMARK_EVERY: Duration = Duration::from_millis(500);

/// One change, as a watch replays it.
#[derive(Debug, Clone)]
struct Change {
    version: u64,
    kind: Kind,
    event: &'static str,
    object: Value,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Pod,
    Node,
    Namespace,
    NetworkPolicy,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Node => "Node",
            Kind::Namespace => "Namespace",
            Kind::NetworkPolicy => "NetworkPolicy",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "networking.k8s.io/v1",
            _ => "v1",
        }
    }
}

#[derive(Debug, Default)]
struct State {
    version: u64,
    pods: BTreeMap<(String, String), Value>,
    nodes: BTreeMap<String, Value>,
    namespaces: BTreeMap<String, Value>,
    network_policies: BTreeMap<(String, String), Value>,
    changes: Vec<Change>,
    /// Watches from a version below this are answered 410 Expired.
    oldest_watchable: u64,
    /// Bumped to end every open watch abruptly.
    drops: u64,
    lists: usize,
    /// Of those, the LISTs of Pods: one per Pod watch of a client.
    pod_lists: usize,
    writes: Vec<Written>,
    events: Vec<Value>,
}

/// A request that changed something (or tried to), as the client sent it.
#[derive(Debug, Clone)]
pub struct Written {
    pub method: String,
    /// The path without the query.
    pub path: String,
    pub content_type: String,
    pub body: Value,
    /// The answer's status code.
    pub code: u16,
}

impl State {
    /// The objects of `kind` that the request's selector takes.
    fn objects(&self, kind: Kind, target: &Target) -> Vec<Value> {
        let all: Vec<&Value> = match kind {
            Kind::Node => self.nodes.values().collect(),
            Kind::Pod => self.pods.values().collect(),
            Kind::Namespace => self.namespaces.values().collect(),
            Kind::NetworkPolicy => self.network_policies.values().collect(),
        };
        all.into_iter().filter(|o| target.selects(o)).cloned().collect()
    }
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records the change for watches and wakes them.
    fn publish(&self, mut state: MutexGuard<'_, State>, kind: Kind, event: &'static str, object: Value) {
        let version = state.version;
        state.changes.push(Change {
            version,
            kind,
            event,
            object,
        });
        drop(state);
        self.changed.notify_all();
    }
}

#[derive(Debug)]
pub struct ApiServer {
    pub port: u16,
    pub address: SocketAddr,
    pub ca_pem: String,
    shared: Arc<Shared>,
    requests: Arc<AtomicUsize>,
}

impl ApiServer {
    /// LIST requests served so far (a watcher lists again after a 410).
    pub fn lists(&self) -> usize {
        self.shared.lock().lists
    }

    /// Of those, the LISTs of Pods.
    pub fn pod_lists(&self) -> usize {
        self.shared.lock().pod_lists
    }
}

impl ApiServer {
    /// Serves on 127.0.0.1 in the namespace at `netns` (its lo must be up)
    /// until the test process ends.
    pub fn start(netns: &Path, token: &str) -> Self {
        ApiServer::start_at(netns, "127.0.0.1", token)
    }

    /// Serves on `ip` (an address of that namespace) with a certificate
    /// for it.
    pub fn start_at(netns: &Path, ip: &str, token: &str) -> Self {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "test cluster CA");
        let ca = ca_params.self_signed(&ca_key).expect("CA cert");
        let server_key = KeyPair::generate().expect("server key");
        let names = vec!["localhost".to_owned(), "127.0.0.1".to_owned(), ip.to_owned()];
        let server_params = CertificateParams::new(names).expect("server params");
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
            .run(|| TcpListener::bind((ip, 0)))
            .expect("enter")
            .expect("bind");
        let address = listener.local_addr().expect("addr");
        let shared = Arc::new(Shared::default());
        let requests = Arc::new(AtomicUsize::new(0));
        let (served, counter, token) = (Arc::clone(&shared), Arc::clone(&requests), token.to_owned());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                counter.fetch_add(1, Ordering::SeqCst);
                let (config, shared, token) = (Arc::clone(&config), Arc::clone(&served), token.clone());
                std::thread::spawn(move || {
                    let connection = rustls::ServerConnection::new(config).expect("tls");
                    let mut tls = rustls::StreamOwned::new(connection, stream);
                    let _ = answer(&mut tls, &shared, &token);
                });
            }
        });
        ApiServer {
            port: address.port(),
            address,
            ca_pem: ca.pem(),
            shared,
            requests,
        }
    }

    pub fn add_pod(&self, namespace: &str, name: &str, pod: Value) {
        let mut state = self.shared.lock();
        let key = (namespace.to_owned(), name.to_owned());
        let event = if state.pods.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let pod = stamp(&mut state, Kind::Pod, pod);
        state.pods.insert(key, pod.clone());
        self.shared.publish(state, Kind::Pod, event, pod);
    }

    /// Deletes a pod at once, as a delete with a zero grace period does.
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        let (code, _) = delete_pod(&self.shared, namespace, name, &Value::Null);
        assert!(
            code == 200 || code == 404,
            "deleting pod {namespace}/{name}: {code}"
        );
    }

    /// The pod as the server holds it now.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.shared
            .lock()
            .pods
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The Node as the server holds it now.
    pub fn node(&self, name: &str) -> Option<Value> {
        self.shared.lock().nodes.get(name).cloned()
    }

    /// Every DELETE, PATCH and POST received, in order.
    pub fn writes(&self) -> Vec<Written> {
        self.shared.lock().writes.clone()
    }

    /// The Events clients created.
    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().events.clone()
    }

    /// Creates or replaces the Node `node["metadata"]["name"]`.
    pub fn apply_node(&self, node: Value) {
        let name = node["metadata"]["name"]
            .as_str()
            .expect("a node's name")
            .to_owned();
        let mut state = self.shared.lock();
        let event = if state.nodes.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let node = stamp(&mut state, Kind::Node, node);
        state.nodes.insert(name, node.clone());
        self.shared.publish(state, Kind::Node, event, node);
    }

    pub fn delete_node(&self, name: &str) {
        let mut state = self.shared.lock();
        if let Some(node) = state.nodes.remove(name) {
            let node = stamp(&mut state, Kind::Node, node);
            self.shared.publish(state, Kind::Node, "DELETED", node);
        }
    }

    /// Creates or replaces the Namespace `namespace["metadata"]["name"]`.
    pub fn apply_namespace(&self, namespace: Value) {
        let name = namespace["metadata"]["name"]
            .as_str()
            .expect("a namespace's name")
            .to_owned();
        self.upsert(Kind::Namespace, name, namespace, |state| &mut state.namespaces);
    }

    /// Creates or replaces a NetworkPolicy (by its namespace and name).
    pub fn apply_network_policy(&self, policy: Value) {
        let key = (
            policy["metadata"]["namespace"]
                .as_str()
                .expect("a namespace")
                .to_owned(),
            policy["metadata"]["name"].as_str().expect("a name").to_owned(),
        );
        self.upsert(Kind::NetworkPolicy, key, policy, |state| {
            &mut state.network_policies
        });
    }

    /// Stores `object` of `kind` under `key` in the map `of` picks, as
    /// ADDED or MODIFIED.
    fn upsert<K: Ord>(
        &self,
        kind: Kind,
        key: K,
        object: Value,
        of: impl Fn(&mut State) -> &mut BTreeMap<K, Value>,
    ) {
        let mut state = self.shared.lock();
        let event = if of(&mut state).contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let object = stamp(&mut state, kind, object);
        of(&mut state).insert(key, object.clone());
        self.shared.publish(state, kind, event, object);
    }

    pub fn delete_network_policy(&self, namespace: &str, name: &str) {
        let mut state = self.shared.lock();
        if let Some(policy) = state
            .network_policies
            .remove(&(namespace.to_owned(), name.to_owned()))
        {
            let policy = stamp(&mut state, Kind::NetworkPolicy, policy);
            self.shared.publish(state, Kind::NetworkPolicy, "DELETED", policy);
        }
    }

    /// Forgets the history: a watch from any version seen so far is
    /// answered 410 Expired, as after the real server's compaction.
    pub fn expire_history(&self) {
        let mut state = self.shared.lock();
        state.oldest_watchable = state.version + 1;
        state.changes.clear();
    }

    /// Ends every open watch without a word, as a dropped connection does.
    pub fn drop_watches(&self) {
        self.shared.lock().drops += 1;
        self.shared.changed.notify_all();
    }

    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// `https://<address>`.
    pub fn url(&self) -> String {
        format!("https://{}", self.address)
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

    /// A service account directory as the kubelet mounts it (`token`,
    /// `ca.crt`, `namespace`) under `dir`.
    pub fn service_account(&self, dir: &Path, token: &str) -> PathBuf {
        let path = dir.join("serviceaccount");
        std::fs::create_dir_all(&path).expect("mkdir");
        std::fs::write(path.join("token"), token).expect("token");
        std::fs::write(path.join("ca.crt"), &self.ca_pem).expect("ca");
        std::fs::write(path.join("namespace"), "kube-system").expect("namespace");
        path
    }
}

/// The object as the server returns it: its kind and the next version.
fn stamp(state: &mut State, kind: Kind, mut object: Value) -> Value {
    state.version += 1;
    object["apiVersion"] = json!(kind.api_version());
    object["kind"] = json!(kind.name());
    object["metadata"]["resourceVersion"] = json!(state.version.to_string());
    object
}

/// A request's target and what the client asked for.
struct Target {
    parts: Vec<String>,
    query: BTreeMap<String, String>,
}

impl Target {
    fn parse(path: &str) -> Target {
        let (path, query) = path.split_once('?').unwrap_or((path, ""));
        Target {
            parts: path
                .trim_start_matches('/')
                .split('/')
                .map(str::to_owned)
                .collect(),
            query: query
                .split('&')
                .filter_map(|pair| pair.split_once('='))
                .map(|(k, v)| (k.to_owned(), decode(v)))
                .collect(),
        }
    }

    fn watch(&self) -> bool {
        self.query.get("watch").is_some_and(|v| v == "true" || v == "1")
    }

    /// `fieldSelector=metadata.name=x` or `spec.nodeName=x`, the only
    /// selectors the suite uses.
    fn selects(&self, object: &Value) -> bool {
        let Some(selector) = self.query.get("fieldSelector") else {
            return true;
        };
        selector.split(',').all(|term| match term.split_once('=') {
            Some(("metadata.name", name)) => object["metadata"]["name"] == name,
            Some(("spec.nodeName", name)) => object["spec"]["nodeName"] == name,
            _ => false,
        })
    }
}

fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// What a request asked for.
struct Request {
    method: String,
    target: Target,
    path: String,
    content_type: String,
    body: Value,
    authorized: bool,
}

fn read_request<T: std::io::Read>(tls: &mut T, token: &str) -> std::io::Result<Request> {
    let mut reader = BufReader::new(tls);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let (mut authorized, mut length, mut content_type) = (false, 0, String::new());
    let bearer = format!("Bearer {token}");
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.to_ascii_lowercase().as_str() {
            "authorization" => authorized |= value == bearer,
            "content-length" => length = value.parse().unwrap_or(0),
            "content-type" => value.clone_into(&mut content_type),
            _ => {}
        }
    }
    let mut body = vec![0; length];
    std::io::Read::read_exact(&mut reader, &mut body)?;
    let mut words = request_line.split_whitespace();
    let method = words.next().unwrap_or_default().to_owned();
    let target_text = words.next().unwrap_or_default();
    Ok(Request {
        method,
        target: Target::parse(target_text),
        path: target_text.split('?').next().unwrap_or_default().to_owned(),
        content_type,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        authorized,
    })
}

fn not_found(what: &str, name: &str) -> (u16, Value) {
    (
        404,
        status(404, "NotFound", &format!("{what} \"{name}\" not found")),
    )
}

fn answer<T: std::io::Read + Write>(tls: &mut T, shared: &Shared, token: &str) -> std::io::Result<()> {
    let request = read_request(tls, token)?;
    if !request.authorized {
        return respond(tls, 401, &status(401, "Unauthorized", "Unauthorized"));
    }
    let target = &request.target;
    let parts: Vec<&str> = target.parts.iter().map(String::as_str).collect();
    let (code, body) = match (request.method.as_str(), parts.as_slice()) {
        ("GET", ["api", "v1", "namespaces", ns, "pods", name]) => {
            match shared.lock().pods.get(&((*ns).to_owned(), (*name).to_owned())) {
                Some(pod) => (200, pod.clone()),
                None => not_found("pods", name),
            }
        }
        ("GET", ["api", "v1", "namespaces", name]) => match shared.lock().namespaces.get(*name) {
            Some(namespace) => (200, namespace.clone()),
            None => not_found("namespaces", name),
        },
        ("GET", ["api", "v1", "nodes", name]) => match shared.lock().nodes.get(*name) {
            Some(node) => (200, node.clone()),
            None => not_found("nodes", name),
        },
        ("GET", ["api", "v1", "nodes"]) if target.watch() => return watch(tls, shared, Kind::Node, target),
        ("GET", ["api", "v1", "pods"]) if target.watch() => return watch(tls, shared, Kind::Pod, target),
        ("GET", ["api", "v1", "nodes"]) => return list(tls, shared, Kind::Node, target),
        ("GET", ["api", "v1", "pods"]) => return list(tls, shared, Kind::Pod, target),
        ("GET", ["api", "v1", "namespaces"]) if target.watch() => {
            return watch(tls, shared, Kind::Namespace, target);
        }
        ("GET", ["api", "v1", "namespaces"]) => return list(tls, shared, Kind::Namespace, target),
        ("GET", ["apis", "networking.k8s.io", "v1", "networkpolicies"]) if target.watch() => {
            return watch(tls, shared, Kind::NetworkPolicy, target);
        }
        ("GET", ["apis", "networking.k8s.io", "v1", "networkpolicies"]) => {
            return list(tls, shared, Kind::NetworkPolicy, target);
        }
        ("DELETE", ["api", "v1", "namespaces", ns, "pods", name]) => {
            delete_pod(shared, ns, name, &request.body)
        }
        (
            "PATCH",
            ["api", "v1", "namespaces", ns, "pods", name]
            | ["api", "v1", "namespaces", ns, "pods", name, "status"],
        ) => patch_pod(shared, ns, name, &request),
        ("PATCH", ["api", "v1", "nodes", name]) => patch_node(shared, name, &request),
        ("POST", ["api", "v1", "namespaces", ns, "events"]) => {
            let mut event = request.body.clone();
            event["metadata"]["namespace"] = json!(ns);
            shared.lock().events.push(event.clone());
            (201, event)
        }
        _ => (404, status(404, "NotFound", "not found")),
    };
    if request.method != "GET" {
        shared.lock().writes.push(Written {
            method: request.method.clone(),
            path: request.path.clone(),
            content_type: request.content_type.clone(),
            body: request.body.clone(),
            code,
        });
    }
    respond(tls, code, &body)
}

/// As the real server with a zero grace period: gone at once, after the
/// `preconditions` of the DeleteOptions in `options` hold.
fn delete_pod(shared: &Shared, ns: &str, name: &str, options: &Value) -> (u16, Value) {
    let mut state = shared.lock();
    let key = (ns.to_owned(), name.to_owned());
    let Some(pod) = state.pods.get(&key).cloned() else {
        return not_found("pods", name);
    };
    let preconditions = &options["preconditions"];
    for (field, actual) in [
        ("uid", &pod["metadata"]["uid"]),
        ("resourceVersion", &pod["metadata"]["resourceVersion"]),
    ] {
        let wanted = &preconditions[field];
        if !wanted.is_null() && wanted != actual {
            let message = format!(
                "Precondition failed: {field} in precondition: {wanted}, {field} in object meta: {actual}"
            );
            return (409, status(409, "Conflict", &message));
        }
    }
    state.pods.remove(&key);
    let pod = stamp(&mut state, Kind::Pod, pod);
    shared.publish(state, Kind::Pod, "DELETED", pod.clone());
    (200, pod)
}

/// A JSON merge patch (RFC 7386), the only kind the suite sends.
fn patch_pod(shared: &Shared, ns: &str, name: &str, request: &Request) -> (u16, Value) {
    if request.content_type != "application/merge-patch+json" {
        return (415, status(415, "UnsupportedMediaType", &request.content_type));
    }
    let mut state = shared.lock();
    let key = (ns.to_owned(), name.to_owned());
    let Some(mut pod) = state.pods.get(&key).cloned() else {
        return not_found("pods", name);
    };
    merge(&mut pod, &request.body);
    let pod = stamp(&mut state, Kind::Pod, pod);
    state.pods.insert(key, pod.clone());
    shared.publish(state, Kind::Pod, "MODIFIED", pod.clone());
    (200, pod)
}

/// A JSON merge patch of a Node; a `metadata.resourceVersion` in the patch
/// is a precondition, as the real server makes it (409 when the Node
/// changed since).
fn patch_node(shared: &Shared, name: &str, request: &Request) -> (u16, Value) {
    if request.content_type != "application/merge-patch+json" {
        return (415, status(415, "UnsupportedMediaType", &request.content_type));
    }
    let mut state = shared.lock();
    let Some(mut node) = state.nodes.get(name).cloned() else {
        return not_found("nodes", name);
    };
    let wanted = &request.body["metadata"]["resourceVersion"];
    if !wanted.is_null() && *wanted != node["metadata"]["resourceVersion"] {
        let message = format!(
            "Operation cannot be fulfilled on nodes \"{name}\": the object has been modified; \
             please apply your changes to the latest version and try again"
        );
        return (409, status(409, "Conflict", &message));
    }
    merge(&mut node, &request.body);
    let node = stamp(&mut state, Kind::Node, node);
    state.nodes.insert(name.to_owned(), node.clone());
    shared.publish(state, Kind::Node, "MODIFIED", node.clone());
    (200, node)
}

fn merge(target: &mut Value, patch: &Value) {
    let Some(fields) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    for (key, value) in fields {
        if value.is_null() {
            if let Some(object) = target.as_object_mut() {
                object.remove(key);
            }
        } else {
            merge(&mut target[key.as_str()], value);
        }
    }
}

/// A LIST of `kind`, at the current version.
fn list<T: Write>(tls: &mut T, shared: &Shared, kind: Kind, target: &Target) -> std::io::Result<()> {
    let mut state = shared.lock();
    state.lists += 1;
    if matches!(kind, Kind::Pod) {
        state.pod_lists += 1;
    }
    let list = json!({
        "kind": format!("{}List", kind.name()),
        "apiVersion": kind.api_version(),
        "metadata": {"resourceVersion": state.version.to_string()},
        "items": state.objects(kind, target),
    });
    drop(state);
    respond(tls, 200, &list)
}

fn head<T: Write>(tls: &mut T, code: u16) -> std::io::Result<()> {
    let reason = match code {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        401 => "Unauthorized",
        409 => "Conflict",
        415 => "Unsupported Media Type",
        _ => "Not Found",
    };
    // Chunked, as the real API server answers; one request per connection.
    write!(
        tls,
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
}

fn chunk<T: Write>(tls: &mut T, body: &str) -> std::io::Result<()> {
    write!(tls, "{:x}\r\n{body}\r\n", body.len())?;
    tls.flush()
}

fn respond<T: Write>(tls: &mut T, code: u16, body: &Value) -> std::io::Result<()> {
    head(tls, code)?;
    chunk(tls, &body.to_string())?;
    tls.write_all(b"0\r\n\r\n")?;
    tls.flush()
}

/// A watch from `resourceVersion` (unset or 0: from now, as the real
/// server's "any" semantics allow after a list): every later change of
/// `kind` that the selector takes, one JSON event per chunk, BOOKMARKs in
/// between, until `timeoutSeconds` or a dropped connection.
fn watch<T: Write>(tls: &mut T, shared: &Shared, kind: Kind, target: &Target) -> std::io::Result<()> {
    let timeout = target
        .query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map_or(Duration::from_secs(300), Duration::from_secs);
    let bookmarks = target
        .query
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let mut state = shared.lock();
    let (mut seen, replay) = match target.query.get("resourceVersion").map(|v| v.parse::<u64>()) {
        // As the real server: the objects that exist now, as ADDED
        // events, then what changes.
        None | Some(Ok(0)) => (state.version, true),
        Some(Ok(version)) => (version, false),
        Some(Err(_)) => {
            drop(state);
            return respond(tls, 400, &status(400, "BadRequest", "invalid resourceVersion"));
        }
    };
    head(tls, 200)?;
    if replay {
        let existing: Vec<String> = state
            .objects(kind, target)
            .into_iter()
            .map(|o| json!({"type": "ADDED", "object": o}).to_string())
            .collect();
        drop(state);
        for event in &existing {
            chunk(tls, &format!("{event}\n"))?;
        }
        state = shared.lock();
    } else if seen < state.oldest_watchable {
        let message = format!("too old resource version: {seen} ({})", state.oldest_watchable);
        let event = json!({"type": "ERROR", "object": status(410, "Expired", &message)});
        drop(state);
        chunk(tls, &format!("{event}\n"))?;
        tls.write_all(b"0\r\n\r\n")?;
        return tls.flush();
    }
    let drops = state.drops;
    let deadline = Instant::now() + timeout;
    let mut next_bookmark = Instant::now() + BOOKMARK_EVERY;
    loop {
        let events: Vec<String> = state
            .changes
            .iter()
            .filter(|c| c.version > seen && c.kind == kind && target.selects(&c.object))
            .map(|c| json!({"type": c.event, "object": c.object}).to_string())
            .collect();
        seen = state.version;
        let now = Instant::now();
        let bookmark = (bookmarks && now >= next_bookmark).then(|| {
            json!({"type": "BOOKMARK", "object": {
                "kind": kind.name(), "apiVersion": "v1",
                "metadata": {"resourceVersion": seen.to_string()},
            }})
            .to_string()
        });
        drop(state);
        for event in events.iter().chain(bookmark.iter()) {
            chunk(tls, &format!("{event}\n"))?;
        }
        if bookmark.is_some() {
            next_bookmark = now + BOOKMARK_EVERY;
        }
        if now >= deadline {
            tls.write_all(b"0\r\n\r\n")?;
            return tls.flush();
        }
        state = shared.lock();
        if state.drops != drops {
            // No terminating chunk: the connection just ends.
            return Ok(());
        }
        if state.version == seen {
            let wait = next_bookmark
                .min(deadline)
                .saturating_duration_since(Instant::now());
            state = shared
                .changed
                .wait_timeout(state, wait.max(Duration::from_millis(1)))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
            if state.drops != drops {
                return Ok(());
            }
        }
    }
}
