//! The reference's `PortMapConf`, key for key, with its checks and
//! messages. Errors are code 7.

use std::path::PathBuf;

use crate::rules::{DEFAULT_MARK_BIT, Mapping, Protocol, Settings};
use cni::keys::{self, Shape, field, plain};
use cni::{Error, NetConf, Result};
use firewall::Backend;
use serde::de::DeserializeOwned;

use crate::records::DEFAULT_STATE_DIR;

const MAPPING: Shape = Shape::Struct(&[&[
    plain("hostPort"),
    plain("containerPort"),
    plain("protocol"),
    plain("hostIP"),
]]);

pub const KEYS: Shape = Shape::Struct(&[
    keys::NET_CONF,
    &[
        keys::IPAM_TYPE,
        plain("backend"),
        plain("snat"),
        plain("conditionsV4"),
        plain("conditionsV6"),
        plain("masqAll"),
        plain("markMasqBit"),
        field(
            "runtimeConfig",
            Shape::Struct(&[&[field("portMappings", Shape::List(&MAPPING))]]),
        ),
        plain("externalSetMarkChain"),
        // Ours: where ADD records what it published (see records).
        plain("stateDir"),
    ],
]);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortmapConfig {
    pub backend: Backend,
    pub settings: Settings,
    pub mappings: Vec<Mapping>,
    pub state_dir: PathBuf,
}

/// One of portmap's keys, its error prefixed as the reference's decoder
/// prefixes it.
fn read<T: DeserializeOwned>(conf: &NetConf, key: &str) -> Result<Option<T>> {
    conf.plugin_key(key)
        .map_err(|e| e.context("failed to parse config"))
}

/// The reference tells an iptables condition (`-d …`, `! -s …`) from an
/// nftables one by its first character.
fn backend_of_conditions(conditions: &[String]) -> Option<Backend> {
    let first = conditions.first().filter(|c| !c.is_empty())?;
    Some(if first.starts_with('-') || first.starts_with('!') {
        Backend::Iptables
    } else {
        Backend::Nftables
    })
}

impl PortmapConfig {
    pub fn load(conf: &NetConf) -> Result<Self> {
        let mark_bit: Option<i64> = read(conf, "markMasqBit")?;
        let external: Option<String> = read(conf, "externalSetMarkChain")?;
        if let Some(chain) = external.as_deref().filter(|c| !firewall::is_chain_name(c)) {
            return Err(Error::invalid_config(format!(
                "invalid externalSetMarkChain {chain:?}: at most {} printable characters, no quotes",
                firewall::MAX_CHAIN_NAME
            )));
        }
        if mark_bit.is_some() && external.is_some() {
            return Err(Error::invalid_config(
                "Cannot specify externalSetMarkChain and markMasqBit",
            ));
        }
        let mark_bit = match mark_bit {
            None => DEFAULT_MARK_BIT,
            Some(bit) => u8::try_from(bit)
                .ok()
                .filter(|b| *b <= 31)
                .ok_or_else(|| Error::invalid_config("MasqMarkBit must be between 0 and 31"))?,
        };
        let conditions_v4: Vec<String> = read(conf, "conditionsV4")?.unwrap_or_default();
        let conditions_v6: Vec<String> = read(conf, "conditionsV6")?.unwrap_or_default();
        // Only an absent key means the node's default: an empty name is
        // refused, unlike the bridge's `ipMasqBackend`.
        let backend = match read::<String>(conf, "backend")?.as_deref() {
            None => Backend::detect(),
            Some(name) => Backend::named(name)
                .ok_or_else(|| Error::invalid_config(format!("unrecognized backend {name:?}")))?,
        };
        let mut wrong = Vec::new();
        if external.is_some() && backend != Backend::Iptables {
            wrong.push("externalSetMarkChain");
        }
        for (key, conditions) in [("conditionsV4", &conditions_v4), ("conditionsV6", &conditions_v6)] {
            if backend_of_conditions(conditions).is_some_and(|b| b != backend) {
                wrong.push(key);
            }
        }
        if !wrong.is_empty() {
            return Err(Error::invalid_config(format!(
                "{} backend was requested but configuration contains {}-specific options [{}]",
                backend.name(),
                backend.other().name(),
                wrong.join(" ")
            )));
        }
        let settings = Settings {
            snat: read(conf, "snat")?.unwrap_or(true),
            mark_bit,
            external_set_mark_chain: external,
            conditions_v4,
            conditions_v6,
            masq_all: read(conf, "masqAll")?.unwrap_or(false),
        };
        Ok(PortmapConfig {
            backend,
            settings,
            mappings: mappings(conf)?,
            state_dir: read::<String>(conf, "stateDir")?
                .filter(|dir| !dir.is_empty())
                .map_or_else(|| PathBuf::from(DEFAULT_STATE_DIR), PathBuf::from),
        })
    }
}

/// `runtimeConfig.portMappings`, checked as the reference checks them.
fn mappings(conf: &NetConf) -> Result<Vec<Mapping>> {
    conf.runtime_config
        .port_mappings()?
        .into_iter()
        .map(|entry| {
            if entry.container_port == 0 {
                return Err(Error::invalid_config("Invalid container port number: 0"));
            }
            if entry.host_port == 0 {
                return Err(Error::invalid_config("Invalid host port number: 0"));
            }
            Ok(Mapping {
                host_port: entry.host_port,
                container_port: entry.container_port,
                protocol: Protocol::parse(&entry.protocol)
                    .map_err(|e| Error::invalid_config(e.to_string()))?,
                host_ip: entry.host_ip,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn full_featured(backend_keys: Value) -> Value {
        let prev_result = cni::keys::full_prev_result();
        let mut doc = json!({"cniVersion": "1.0.0", "name": "net", "type": "portmap",
            "snat": false, "masqAll": true, "stateDir": "/run/x", "ipam": {"type": "none"},
            "capabilities": {"portMappings": true},
            "runtimeConfig": {"portMappings": [
                {"hostPort": 8080, "containerPort": 80, "protocol": "tcp", "hostIP": "10.0.0.1"}]},
            "prevResult": prev_result,
            "cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]});
        if let (Some(doc), Value::Object(keys)) = (doc.as_object_mut(), backend_keys) {
            doc.extend(keys);
        }
        doc
    }

    /// Everything portmap reads of a configuration, as the skeleton, ADD,
    /// CHECK and GC read it.
    fn loaded(doc: &Value) -> String {
        cni::skel::read_configuration(doc, &KEYS, |conf| {
            (
                PortmapConfig::load(conf),
                conf.prev_result(),
                conf.gc_valid_attachments(),
            )
        })
    }

    #[test]
    fn every_key_reads_null_as_absent() {
        // markMasqBit and externalSetMarkChain exclude each other.
        for doc in [
            full_featured(
                json!({"backend": "iptables", "externalSetMarkChain": "KUBE-MARK-MASQ",
                "conditionsV4": ["-d", "10.0.0.0/8"], "conditionsV6": ["!", "-s", "fd00::/8"]}),
            ),
            full_featured(json!({"backend": "nftables", "markMasqBit": 13,
                "conditionsV4": ["ip daddr 10.0.0.0/8"], "conditionsV6": ["ip6 daddr fd00::/8"]})),
        ] {
            let whole = loaded(&doc);
            assert!(
                whole.starts_with("Ok(((Ok(") && !whole.contains("Err("),
                "{whole}"
            );
            cni::keys::assert_null_reads_as_absent(&doc, &KEYS, 40, loaded);
        }
    }
}
