//! The network configuration a plugin reads on stdin: the keys every plugin
//! shares, and the runtime-generated conventions (`runtimeConfig`,
//! `args.cni`, the GC attachment list) read on demand, so a plugin only fails
//! on a convention it actually uses.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use ipnetwork::IpNetwork;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::env::validate_network_name;
use crate::error::{Error, Result};
use crate::result::{CniResult, Dns};
use crate::version::Version;

/// GC's list of attachments that are still in use. libcni sends both keys.
pub const VALID_ATTACHMENTS_KEY: &str = "cni.dev/valid-attachments";
pub const LEGACY_ATTACHMENTS_KEY: &str = "cni.dev/attachments";
/// The capability and runtimeConfig key under which containerd and CRI-O pass
/// the pod's annotations.
pub const POD_ANNOTATIONS_KEY: &str = "io.kubernetes.cri.pod-annotations";
/// The suite's own key naming the Unix datagram socket a plugin also sends
/// its log records to (the node agent's; the wire is `agent_wire::log`). The
/// reference plugins ignore a key they do not know, so an entry carrying
/// it works with them unchanged.
pub const LOG_SOCKET_KEY: &str = "logSocket";
/// The suite's own key naming the node agent's NetworkPolicy gate, a Unix
/// stream socket an ADD waits on until the agent holds the pod's policy in
/// the kernel (`agent_wire::policy`). Ignored by the reference
/// plugins, as [`LOG_SOCKET_KEY`] is.
pub const POLICY_SOCKET_KEY: &str = "policySocket";

/// The keys every plugin configuration shares.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    pub cni_version: Version,
    pub name: String,
    pub plugin_type: String,
    pub capabilities: BTreeMap<String, bool>,
    pub ipam: Option<IpamConf>,
    pub dns: Option<Dns>,
    pub runtime_config: RuntimeConfig,
    pub args: ConfArgs,
    pub prev_result: Option<Value>,
    pub log_file: Option<PathBuf>,
    pub log_level: Option<String>,
    /// [`LOG_SOCKET_KEY`]: see [`log_socket`].
    pub log_socket: Option<PathBuf>,
    /// [`POLICY_SOCKET_KEY`], matched as `logSocket` is.
    pub policy_socket: Option<PathBuf>,
    raw: Value,
}

/// The `ipam` section: its `type` names the IPAM plugin; the rest is that
/// plugin's business.
#[derive(Debug, Clone, PartialEq)]
pub struct IpamConf {
    pub plugin_type: String,
    pub raw: Value,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SharedKeys {
    #[serde(default, rename = "type")]
    plugin_type: String,
    #[serde(default)]
    capabilities: BTreeMap<String, bool>,
    #[serde(default)]
    ipam: Option<Value>,
    #[serde(default)]
    dns: Option<Dns>,
    #[serde(default)]
    runtime_config: Option<Map<String, Value>>,
    #[serde(default)]
    args: Option<Map<String, Value>>,
    #[serde(default)]
    prev_result: Option<Value>,
    #[serde(default)]
    log_file: Option<PathBuf>,
    #[serde(default)]
    log_level: Option<String>,
}

/// Parses stdin into a JSON object: anything else is a decoding error (6).
pub fn parse_document(stdin: &[u8]) -> Result<Value> {
    let value: Value = serde_json::from_slice(stdin)
        .map_err(|e| Error::decoding(format!("error unmarshalling network config: {e}")))?;
    if !value.is_object() {
        return Err(Error::decoding(
            "error unmarshalling network config: not a JSON object",
        ));
    }
    Ok(value)
}

/// The configuration's version: absent means 0.1.0 (libcni); a value outside
/// the supported set is error 1 with libcni's details.
pub fn config_version(doc: &Value) -> Result<Version> {
    match doc.get("cniVersion") {
        None | Some(Value::Null) => Ok(Version::IMPLIED),
        Some(Value::String(s)) if s.is_empty() => Ok(Version::IMPLIED),
        Some(Value::String(s)) => s.parse().map_err(|_| {
            let supported: Vec<String> = Version::ALL.iter().map(|v| format!("{:?}", v.as_str())).collect();
            Error::incompatible_version("incompatible CNI versions").with_details(format!(
                "config is {s:?}, plugin supports [{}]",
                supported.join(" ")
            ))
        }),
        Some(other) => Err(Error::decoding(format!(
            "error unmarshalling network config: cniVersion must be a string, got {other}"
        ))),
    }
}

/// The socket `logSocket` names, matched as Go's decoder would match a
/// field of that name (any case, the last key, `null` absent); an empty
/// string names none. Not a string is invalid configuration (7), as a
/// wrong `logFile` is.
pub fn log_socket(doc: &Value) -> Result<Option<PathBuf>> {
    socket_named(doc, LOG_SOCKET_KEY)
}

/// The socket the key `key` names, matched as [`log_socket`]'s is.
fn socket_named(doc: &Value, key: &str) -> Result<Option<PathBuf>> {
    let Some(map) = doc.as_object() else {
        return Ok(None);
    };
    match crate::keys::get(map, key) {
        None => Ok(None),
        Some(Value::String(path)) if path.is_empty() => Ok(None),
        Some(Value::String(path)) => Ok(Some(PathBuf::from(path))),
        Some(other) => Err(Error::invalid_config(format!(
            "invalid network configuration: {key} must be a string, got {other}"
        ))),
    }
}

impl NetConf {
    /// [`NetConf::from_document`] at the version the document names.
    pub fn read(doc: Value) -> Result<Self> {
        let version = config_version(&doc)?;
        NetConf::from_document(doc, version)
    }

    /// Reads the shared keys of a document whose version was already
    /// accepted. Wrong types or values are invalid configuration (7).
    pub fn from_document(doc: Value, cni_version: Version) -> Result<Self> {
        let name = match doc.get("name") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(Error::invalid_config(format!(
                    "name must be a string, got {other}"
                )));
            }
        };
        validate_network_name(&name)?;
        let shared = SharedKeys::deserialize(&doc)
            .map_err(|e| Error::invalid_config(format!("invalid network configuration: {e}")))?;
        let ipam = shared.ipam.map(IpamConf::from_value).transpose()?;
        let log_socket = log_socket(&doc)?;
        let policy_socket = socket_named(&doc, POLICY_SOCKET_KEY)?;
        Ok(NetConf {
            cni_version,
            name,
            plugin_type: shared.plugin_type,
            capabilities: shared.capabilities,
            ipam,
            dns: shared.dns,
            runtime_config: RuntimeConfig(shared.runtime_config.unwrap_or_default()),
            args: ConfArgs(shared.args.unwrap_or_default()),
            prev_result: shared.prev_result.filter(|v| !v.is_null()),
            log_file: shared.log_file,
            log_level: shared.log_level,
            log_socket,
            policy_socket,
            raw: doc,
        })
    }

    /// The whole document, for plugin-specific keys.
    pub fn raw(&self) -> &Value {
        &self.raw
    }

    /// Reads the plugin's own keys from the same document.
    pub fn plugin_config<C: DeserializeOwned>(&self) -> Result<C> {
        C::deserialize(&self.raw).map_err(|e| {
            Error::invalid_config(format!(
                "invalid {} configuration: {e}",
                self.plugin_type_or("plugin")
            ))
        })
    }

    /// One of the plugin's own keys, read alone: absent or `null` is
    /// `None`; a value of the wrong type is invalid configuration (7) that
    /// names the key. For plugins that read their keys one by one (as
    /// their references do) rather than as one struct.
    pub fn plugin_key<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        match self.raw.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => T::deserialize(value)
                .map(Some)
                .map_err(|e| Error::invalid_config(format!("invalid {key}: {e}"))),
        }
    }

    fn plugin_type_or<'a>(&'a self, fallback: &'a str) -> &'a str {
        if self.plugin_type.is_empty() {
            fallback
        } else {
            &self.plugin_type
        }
    }

    /// `prevResult`, read whatever version wrote it.
    pub fn prev_result(&self) -> Result<Option<CniResult>> {
        self.prev_result
            .as_ref()
            .map(|v| {
                CniResult::from_value(v)
                    .map_err(|e| Error::invalid_config(format!("invalid prevResult: {}", e.msg)))
            })
            .transpose()
    }

    /// Whether the configuration declares `capability` (so the runtime may
    /// have filled the matching `runtimeConfig` key).
    pub fn has_capability(&self, capability: &str) -> bool {
        self.capabilities.get(capability).copied().unwrap_or(false)
    }

    /// GC's still-valid attachments, from either key. Absent means none is
    /// valid, which is what the spec and libcni mean by it.
    pub fn gc_valid_attachments(&self) -> Result<Vec<GcAttachment>> {
        let list = self
            .raw
            .get(VALID_ATTACHMENTS_KEY)
            .or_else(|| self.raw.get(LEGACY_ATTACHMENTS_KEY));
        match list {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(v) => Vec::<GcAttachment>::deserialize(v)
                .map_err(|e| Error::invalid_config(format!("invalid {VALID_ATTACHMENTS_KEY}: {e}"))),
        }
    }
}

impl IpamConf {
    fn from_value(raw: Value) -> Result<Self> {
        if !raw.is_object() {
            return Err(Error::invalid_config("ipam must be an object"));
        }
        let plugin_type = match raw.get("type") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(Error::invalid_config(format!(
                    "ipam type must be a string, got {other}"
                )));
            }
        };
        Ok(IpamConf { plugin_type, raw })
    }
}

/// One entry of GC's valid-attachment list. A key absent (or `null`) is
/// empty, as in libcni's `GCAttachment`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize, serde::Serialize)]
pub struct GcAttachment {
    #[serde(rename = "containerID", default)]
    pub container_id: String,
    #[serde(rename = "ifname", default)]
    pub ifname: String,
}

/// A requested address: `10.2.2.42`, or with a prefix `10.2.2.42/24`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpRequest {
    pub ip: IpAddr,
    pub prefix: Option<u8>,
}

impl IpRequest {
    pub fn parse(s: &str) -> Result<Self> {
        let invalid = || Error::invalid_config(format!("invalid IP address {s:?}"));
        match s.split_once('/') {
            None => Ok(IpRequest {
                ip: s.parse().map_err(|_| invalid())?,
                prefix: None,
            }),
            Some(_) => {
                let net: IpNetwork = s.parse().map_err(|_| invalid())?;
                Ok(IpRequest {
                    ip: net.ip(),
                    prefix: Some(net.prefix()),
                })
            }
        }
    }
}

/// `runtimeConfig`: what the runtime fills for declared capabilities.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RuntimeConfig(Map<String, Value>);

/// The configuration's `args` section; plugins read `args.cni`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConfArgs(Map<String, Value>);

/// `portMappings` entry. containerd sends Go field names (`HostPort`), the
/// spec camelCase (`hostPort`); Go matches keys without regard to case, and
/// so do we.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PortMapping {
    #[serde(rename = "hostport")]
    pub host_port: u16,
    #[serde(rename = "containerport")]
    pub container_port: u16,
    #[serde(rename = "protocol", default)]
    pub protocol: String,
    #[serde(rename = "hostip", default, deserialize_with = "empty_as_none")]
    pub host_ip: Option<IpAddr>,
}

/// `bandwidth`: rates in bit/s, bursts in bits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Bandwidth {
    #[serde(rename = "ingressrate", default)]
    pub ingress_rate: u64,
    #[serde(rename = "ingressburst", default)]
    pub ingress_burst: u64,
    #[serde(rename = "egressrate", default)]
    pub egress_rate: u64,
    #[serde(rename = "egressburst", default)]
    pub egress_burst: u64,
}

/// The `dns` capability (`servers`/`searches`/`options`), distinct from the
/// result's DNS shape.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct RuntimeDns {
    #[serde(rename = "servers", default)]
    pub servers: Vec<String>,
    #[serde(rename = "searches", default)]
    pub searches: Vec<String>,
    #[serde(rename = "options", default)]
    pub options: Vec<String>,
}

/// One range of `ipRanges` (the shape of host-local's `ranges`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct IpRange {
    #[serde(rename = "subnet")]
    pub subnet: String,
    #[serde(rename = "rangestart", default, deserialize_with = "empty_as_none")]
    pub range_start: Option<IpAddr>,
    #[serde(rename = "rangeend", default, deserialize_with = "empty_as_none")]
    pub range_end: Option<IpAddr>,
    #[serde(rename = "gateway", default, deserialize_with = "empty_as_none")]
    pub gateway: Option<IpAddr>,
}

/// A label of `args.cni.labels`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Label {
    pub key: String,
    pub value: String,
}

/// containerd marshals Go zero values, so an absent address arrives as "".
fn empty_as_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<IpAddr>, D::Error> {
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(s) if s.is_empty() => Ok(None),
        Some(s) => s.parse().map(Some).map_err(serde::de::Error::custom),
    }
}

/// Lower-cases the keys of every object in `value` down to `depth` levels of
/// nesting (arrays do not count), so Go's case-insensitive field matching can
/// be reproduced with lower-case serde names; leaves out the members that
/// are `null`, which Go's decoder reads as absent (see `keys`).
fn fold_keys(value: &Value, depth: usize) -> Value {
    match value {
        Value::Object(map) if depth > 0 => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.to_ascii_lowercase(), fold_keys(v, depth - 1)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(|v| fold_keys(v, depth)).collect()),
        other => other.clone(),
    }
}

fn read_convention<T: DeserializeOwned>(section: &str, key: &str, value: &Value) -> Result<T> {
    T::deserialize(fold_keys(value, 1))
        .map_err(|e| Error::invalid_config(format!("invalid {section}.{key}: {e}")))
}

fn read_ip_requests(section: &str, value: Option<&Value>) -> Result<Vec<IpRequest>> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let list = Vec::<String>::deserialize(value)
        .map_err(|e| Error::invalid_config(format!("invalid {section}.ips: {e}")))?;
    list.iter()
        .map(|s| IpRequest::parse(s).map_err(|e| e.context(format!("{section}.ips"))))
        .collect()
}

fn read_mac(section: &str, value: Option<&Value>) -> Result<Option<String>> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(Error::invalid_config(format!("invalid {section}.mac: {other}"))),
    }
}

impl RuntimeConfig {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn port_mappings(&self) -> Result<Vec<PortMapping>> {
        self.get("portMappings")
            .map(|v| read_convention("runtimeConfig", "portMappings", v))
            .transpose()
            .map(Option::unwrap_or_default)
    }

    pub fn bandwidth(&self) -> Result<Option<Bandwidth>> {
        self.get("bandwidth")
            .map(|v| read_convention("runtimeConfig", "bandwidth", v))
            .transpose()
    }

    pub fn dns(&self) -> Result<Option<RuntimeDns>> {
        self.get("dns")
            .map(|v| read_convention("runtimeConfig", "dns", v))
            .transpose()
    }

    pub fn ip_ranges(&self) -> Result<Vec<Vec<IpRange>>> {
        self.get("ipRanges")
            .map(|v| read_convention("runtimeConfig", "ipRanges", v))
            .transpose()
            .map(Option::unwrap_or_default)
    }

    pub fn ips(&self) -> Result<Vec<IpRequest>> {
        read_ip_requests("runtimeConfig", self.get("ips"))
    }

    pub fn mac(&self) -> Result<Option<String>> {
        read_mac("runtimeConfig", self.get("mac"))
    }

    /// The pod's annotations as containerd/CRI-O pass them. Keys are the
    /// annotations' own and are not case-folded; one that is `null` is no
    /// annotation.
    pub fn pod_annotations(&self) -> Result<BTreeMap<String, String>> {
        self.get(POD_ANNOTATIONS_KEY)
            .map(|v| {
                BTreeMap::<String, Option<String>>::deserialize(v)
                    .map(|annotations| {
                        annotations
                            .into_iter()
                            .filter_map(|(key, value)| Some((key, value?)))
                            .collect()
                    })
                    .map_err(|e| {
                        Error::invalid_config(format!("invalid runtimeConfig.{POD_ANNOTATIONS_KEY}: {e}"))
                    })
            })
            .transpose()
            .map(Option::unwrap_or_default)
    }
}

impl ConfArgs {
    fn cni(&self) -> Option<&Map<String, Value>> {
        self.0.get("cni").and_then(Value::as_object)
    }

    pub fn ips(&self) -> Result<Vec<IpRequest>> {
        read_ip_requests("args.cni", self.cni().and_then(|c| c.get("ips")))
    }

    pub fn mac(&self) -> Result<Option<String>> {
        read_mac("args.cni", self.cni().and_then(|c| c.get("mac")))
    }

    pub fn labels(&self) -> Result<Vec<Label>> {
        match self.cni().and_then(|c| c.get("labels")) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(v) => Vec::<Label>::deserialize(v)
                .map_err(|e| Error::invalid_config(format!("invalid args.cni.labels: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::error::Code;

    fn conf(doc: Value) -> NetConf {
        NetConf::read(doc).expect("valid conf")
    }

    #[test]
    fn stdin_that_is_not_a_json_object_is_a_decoding_error() {
        for bad in [&b""[..], b"{", b"[]", b"\"x\"", b"null"] {
            let err = parse_document(bad).expect_err("not an object");
            assert!(err.has_code(Code::Decoding), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn version_absent_means_0_1_0_and_unknown_is_error_1() {
        assert_eq!(config_version(&json!({})), Ok(Version::V0_1_0));
        assert_eq!(config_version(&json!({"cniVersion":""})), Ok(Version::V0_1_0));
        assert_eq!(
            config_version(&json!({"cniVersion":"0.3.1"})),
            Ok(Version::V0_3_1)
        );
        let err = config_version(&json!({"cniVersion":"2.0.0"})).expect_err("unknown");
        assert!(err.has_code(Code::IncompatibleVersion));
        assert_eq!(err.msg, "incompatible CNI versions");
        assert!(
            err.details
                .starts_with(r#"config is "2.0.0", plugin supports ["0.1.0" "0.2.0""#),
            "{}",
            err.details
        );
        assert!(
            config_version(&json!({"cniVersion":1}))
                .expect_err("number")
                .has_code(Code::Decoding)
        );
    }

    #[test]
    fn name_is_required_and_checked() {
        let missing = NetConf::from_document(json!({"type":"x"}), Version::V1_0_0).expect_err("no name");
        assert!(missing.has_code(Code::InvalidConfig));
        assert_eq!(missing.msg, "missing network name");
        let bad = NetConf::from_document(json!({"name":"a/b"}), Version::V1_0_0).expect_err("bad name");
        assert_eq!(bad.msg, "invalid characters found in network name");
        let typed = NetConf::from_document(json!({"name":3}), Version::V1_0_0).expect_err("number");
        assert!(typed.has_code(Code::InvalidConfig));
    }

    #[test]
    fn shared_keys_are_read() {
        let c = conf(json!({
            "cniVersion": "1.1.0", "name": "net", "type": "bridge",
            "capabilities": {"portMappings": true, "mac": false},
            "ipam": {"type": "host-local", "subnet": "10.0.0.0/24"},
            "dns": {"nameservers": ["10.0.0.1"]},
            "prevResult": {"cniVersion":"1.1.0","ips":[{"address":"10.0.0.2/24"}]},
            "logFile": "/tmp/x.log", "logLevel": "debug",
            "custom": 5
        }));
        assert_eq!(c.plugin_type, "bridge");
        assert!(c.has_capability("portMappings"));
        assert!(!c.has_capability("mac"));
        assert!(!c.has_capability("ips"));
        assert_eq!(
            c.ipam.as_ref().map(|i| i.plugin_type.as_str()),
            Some("host-local")
        );
        assert_eq!(c.dns.as_ref().map(|d| d.nameservers.len()), Some(1));
        assert_eq!(c.prev_result().expect("valid").map(|r| r.ips.len()), Some(1));
        assert_eq!(c.raw()["custom"], 5);
        assert_eq!(c.log_level.as_deref(), Some("debug"));
        assert_eq!(c.log_socket, None);
    }

    #[test]
    fn the_log_socket_is_matched_as_go_matches_a_field() {
        let socket = |doc: Value| conf(doc).log_socket;
        assert_eq!(
            socket(json!({"name": "n", "logSocket": "/run/cni-suite/log.sock"})),
            Some(PathBuf::from("/run/cni-suite/log.sock"))
        );
        assert_eq!(
            socket(json!({"name": "n", "logSocket": "/a", "LOGSOCKET": "/b"})),
            Some(PathBuf::from("/b")),
            "the later key in any case wins"
        );
        assert_eq!(socket(json!({"name": "n", "logSocket": null})), None);
        assert_eq!(socket(json!({"name": "n", "logSocket": ""})), None);
        let err = NetConf::from_document(json!({"name": "n", "logSocket": 1}), Version::V1_0_0)
            .expect_err("not a string");
        assert!(err.has_code(Code::InvalidConfig), "{err}");
    }

    #[test]
    fn the_policy_socket_is_matched_as_the_log_socket_is() {
        let socket = |doc: Value| conf(doc).policy_socket;
        assert_eq!(
            socket(json!({"name": "n", "policySocket": "/a", "POLICYSOCKET": "/b"})),
            Some(PathBuf::from("/b"))
        );
        assert_eq!(socket(json!({"name": "n", "policySocket": null})), None);
        assert_eq!(socket(json!({"name": "n", "policySocket": ""})), None);
        assert_eq!(socket(json!({"name": "n", "logSocket": "/a"})), None);
        let err = NetConf::from_document(json!({"name": "n", "policySocket": []}), Version::V1_0_0)
            .expect_err("not a string");
        assert!(err.has_code(Code::InvalidConfig), "{err}");
    }

    #[test]
    fn wrong_types_of_shared_keys_are_invalid_config() {
        for bad in [
            json!({"name":"n","capabilities":{"x":"yes"}}),
            json!({"name":"n","ipam":"host-local"}),
            json!({"name":"n","ipam":{"type":1}}),
            json!({"name":"n","dns":{"nameservers":"1.1.1.1"}}),
            json!({"name":"n","runtimeConfig":[]}),
        ] {
            let err = NetConf::from_document(bad.clone(), Version::V1_0_0).expect_err("invalid");
            assert!(err.has_code(Code::InvalidConfig), "{bad}: {err}");
        }
        let c = conf(json!({"name":"n","prevResult":{"ips":"x"}}));
        assert!(
            c.prev_result()
                .expect_err("bad prevResult")
                .has_code(Code::InvalidConfig)
        );
    }

    #[test]
    fn plugin_keys_are_read_from_the_same_document() {
        #[derive(Debug, Deserialize)]
        struct Mine {
            #[serde(default)]
            bridge: String,
            mtu: Option<u32>,
        }
        let c = conf(json!({"name":"n","type":"bridge","bridge":"br0","mtu":1400}));
        let mine: Mine = c.plugin_config().expect("valid");
        assert_eq!((mine.bridge.as_str(), mine.mtu), ("br0", Some(1400)));
        let c = conf(json!({"name":"n","type":"bridge","mtu":"big"}));
        let err = c.plugin_config::<Mine>().expect_err("wrong type");
        assert!(err.has_code(Code::InvalidConfig));
        assert!(err.msg.starts_with("invalid bridge configuration"), "{}", err.msg);
    }

    #[test]
    fn one_plugin_key_is_read_alone() {
        let c = conf(json!({"name":"n","type":"firewall","backend":"nftables","stateDir":null,"mtu":"big"}));
        assert_eq!(
            c.plugin_key::<String>("backend").expect("valid").as_deref(),
            Some("nftables")
        );
        assert_eq!(c.plugin_key::<String>("stateDir").expect("null"), None);
        assert_eq!(c.plugin_key::<String>("absent").expect("absent"), None);
        let err = c.plugin_key::<u32>("mtu").expect_err("wrong type");
        assert!(err.has_code(Code::InvalidConfig));
        assert_eq!(err.msg, "invalid mtu: invalid type: string \"big\", expected u32");
    }

    #[test]
    fn runtime_config_accepts_spec_and_containerd_spellings() {
        let spec = conf(json!({"name":"n","runtimeConfig":{
            "portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"tcp"}],
            "dns":{"servers":["10.96.0.10"],"searches":["svc"],"options":["ndots:5"]},
            "bandwidth":{"ingressRate":1000,"egressBurst":2000}
        }}));
        let containerd = conf(json!({"name":"n","runtimeConfig":{
            "portMappings":[{"HostPort":8080,"ContainerPort":80,"Protocol":"tcp","HostIP":""}],
            "dns":{"Servers":["10.96.0.10"],"Searches":["svc"],"Options":["ndots:5"]},
            "bandwidth":{"IngressRate":1000,"IngressBurst":0,"EgressRate":0,"EgressBurst":2000}
        }}));
        for c in [&spec, &containerd] {
            let pm = c.runtime_config.port_mappings().expect("valid");
            assert_eq!(
                pm,
                [PortMapping {
                    host_port: 8080,
                    container_port: 80,
                    protocol: "tcp".into(),
                    host_ip: None
                }]
            );
            let dns = c.runtime_config.dns().expect("valid").expect("present");
            assert_eq!(dns.servers, ["10.96.0.10"]);
            assert_eq!(dns.options, ["ndots:5"]);
            let bw = c.runtime_config.bandwidth().expect("valid").expect("present");
            assert_eq!((bw.ingress_rate, bw.egress_burst), (1000, 2000));
        }
    }

    #[test]
    fn runtime_ip_ranges_mac_ips_and_annotations() {
        let c = conf(json!({"name":"n","runtimeConfig":{
            "ipRanges":[[{"Subnet":"10.1.0.0/16","RangeStart":"","RangeEnd":"","Gateway":""}],
                        [{"subnet":"fd00::/64","rangeStart":"fd00::10","gateway":"fd00::1"}]],
            "ips":["10.1.0.5/16","fd00::5"],
            "mac":"c2:11:22:33:44:55",
            "io.kubernetes.cri.pod-annotations":{"sidecar.istio.io/status":"{}","Mixed.Case/Key":"v"}
        }}));
        let ranges = c.runtime_config.ip_ranges().expect("valid");
        assert_eq!(ranges[0][0].subnet, "10.1.0.0/16");
        assert_eq!(ranges[0][0].range_start, None);
        assert_eq!(ranges[1][0].gateway, Some("fd00::1".parse().expect("ip")));
        let ips = c.runtime_config.ips().expect("valid");
        assert_eq!(ips[0].prefix, Some(16));
        assert_eq!(
            ips[1],
            IpRequest {
                ip: "fd00::5".parse().expect("ip"),
                prefix: None
            }
        );
        assert_eq!(
            c.runtime_config.mac().expect("valid").as_deref(),
            Some("c2:11:22:33:44:55")
        );
        let ann = c.runtime_config.pod_annotations().expect("valid");
        assert_eq!(
            ann.get("Mixed.Case/Key").map(String::as_str),
            Some("v"),
            "annotation keys keep their case"
        );
    }

    #[test]
    fn a_broken_convention_fails_only_when_read() {
        let c = conf(json!({"name":"n","runtimeConfig":{"portMappings":"nope","ips":["x"]}}));
        assert!(c.runtime_config.bandwidth().expect("absent is fine").is_none());
        assert!(
            c.runtime_config
                .port_mappings()
                .expect_err("bad")
                .has_code(Code::InvalidConfig)
        );
        let err = c.runtime_config.ips().expect_err("bad ip");
        assert!(err.msg.contains("runtimeConfig.ips"), "{}", err.msg);
    }

    #[test]
    fn args_cni_ips_mac_and_labels() {
        let c = conf(json!({"name":"n","args":{"cni":{
            "ips":["10.2.2.42/24"],"mac":"aa:bb:cc:dd:ee:ff",
            "labels":[{"key":"app","value":"web"}]},
            "other":{"ignored":true}}}));
        assert_eq!(
            c.args.ips().expect("valid")[0].ip,
            "10.2.2.42".parse::<IpAddr>().expect("ip")
        );
        assert_eq!(c.args.mac().expect("valid").as_deref(), Some("aa:bb:cc:dd:ee:ff"));
        assert_eq!(c.args.labels().expect("valid")[0].value, "web");
        let none = conf(json!({"name":"n"}));
        assert!(none.args.ips().expect("valid").is_empty());
    }

    #[test]
    fn gc_attachments_from_either_key() {
        let both = conf(json!({"name":"n",
            "cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}],
            "cni.dev/attachments":[{"containerID":"b","ifname":"eth0"}]}));
        assert_eq!(both.gc_valid_attachments().expect("valid")[0].container_id, "a");
        let legacy = conf(json!({"name":"n","cni.dev/attachments":[{"containerID":"b","ifname":"net1"}]}));
        assert_eq!(
            legacy.gc_valid_attachments().expect("valid"),
            [GcAttachment {
                container_id: "b".into(),
                ifname: "net1".into()
            }]
        );
        assert!(
            conf(json!({"name":"n"}))
                .gc_valid_attachments()
                .expect("valid")
                .is_empty()
        );
        let bad = conf(json!({"name":"n","cni.dev/valid-attachments":{"x":1}}));
        assert!(
            bad.gc_valid_attachments()
                .expect_err("bad")
                .has_code(Code::InvalidConfig)
        );
    }

    #[test]
    fn null_members_of_conventions_read_as_absent() {
        // Folded as a plugin that describes no runtimeConfig member (the
        // conventions then see the nulls) but the GC list.
        let mut doc = json!({"name":"n","runtimeConfig":{
            "portMappings":[{"HostPort":8080,"ContainerPort":80,"Protocol":null,"HostIP":null}],
            "bandwidth":{"ingressRate":1000,"egressBurst":null},
            "dns":{"servers":null,"searches":["svc"]},
            "ipRanges":[[{"subnet":"10.1.0.0/16","rangeStart":null,"gateway":null}]],
            "io.kubernetes.cri.pod-annotations":{"a":"1","b":null}},
            "cni.dev/valid-attachments":[{"containerID":"a","ifname":null},{"containerID":"b"}]});
        crate::keys::fold(&mut doc, &crate::keys::PLAIN_PLUGIN);
        let with_nulls = conf(doc);
        let rc = &with_nulls.runtime_config;
        assert_eq!(
            rc.port_mappings().expect("valid"),
            [PortMapping {
                host_port: 8080,
                container_port: 80,
                protocol: String::new(),
                host_ip: None
            }]
        );
        assert_eq!(rc.bandwidth().expect("valid").map(|b| b.egress_burst), Some(0));
        assert_eq!(rc.dns().expect("valid").map(|d| d.servers.len()), Some(0));
        assert_eq!(rc.ip_ranges().expect("valid")[0][0].range_start, None);
        let annotations = rc.pod_annotations().expect("valid");
        assert_eq!(annotations.keys().collect::<Vec<_>>(), ["a"]);
        let valid = with_nulls.gc_valid_attachments().expect("valid");
        assert_eq!((valid[0].ifname.as_str(), valid[1].ifname.as_str()), ("", ""));
    }

    #[test]
    fn ip_requests_with_and_without_prefix() {
        assert_eq!(IpRequest::parse("10.0.0.1").expect("ip").prefix, None);
        assert_eq!(
            IpRequest::parse("10.0.0.1/24").expect("cidr").ip,
            "10.0.0.1".parse::<IpAddr>().expect("ip")
        );
        assert!(IpRequest::parse("10.0.0.1/33").is_err());
        assert!(IpRequest::parse("host").is_err());
    }
}
