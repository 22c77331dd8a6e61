//! The reference's `FirewallNetConf` keys, and ours (`stateDir`). A key
//! with a wrong type or value is a code 7 error that names it.

use std::path::PathBuf;

use crate::rules::IngressPolicy;
use crate::rules::iptables::DEFAULT_ADMIN_CHAIN;
use cni::keys::{self, Shape, plain};
use cni::{Error, NetConf, Result};
use firewall::{Backend, MAX_CHAIN_NAME, is_chain_name};
use serde_json::Value;

/// Where each attachment's addresses are recorded: the iptables layout's
/// pod rules carry no comment, so a DEL without prevResult and GC find a
/// pod's rules from here. Under /run, so it goes with the rules at reboot.
pub const DEFAULT_STATE_DIR: &str = "/run/cni/firewall";

/// `FirewallNetConf` (with `types.NetConf` embedded), and our key.
pub const KEYS: Shape = Shape::Struct(&[
    keys::NET_CONF,
    &[
        keys::IPAM_TYPE,
        plain("backend"),
        plain("iptablesAdminChainName"),
        plain("firewalldZone"),
        plain("ingressPolicy"),
        plain("stateDir"),
    ],
]);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirewallConfig {
    pub backend: Backend,
    pub admin_chain: String,
    pub ingress_policy: IngressPolicy,
    pub state_dir: PathBuf,
}

/// `iptables` is the reference's layout, and the default whatever the
/// node has (the reference prefers firewalld, which there is none of
/// here); `nftables` is our `inet cni_firewall` table.
fn backend(text: Option<String>) -> Result<Backend> {
    match text.as_deref() {
        None | Some("") => Ok(Backend::Iptables),
        Some("firewalld") => Err(Error::invalid_config(
            "backend \"firewalld\" is not supported: this plugin has no D-Bus client and no firewalld \
             to talk to; use \"iptables\" (the reference's layout) or \"nftables\"",
        )),
        Some(name) => Backend::named(name).ok_or_else(|| {
            Error::invalid_config(format!(
                "invalid backend {name:?}: expected \"iptables\" or \"nftables\""
            ))
        }),
    }
}

/// An admin chain iptables accepts and restore input can carry.
fn admin_chain(name: Option<String>) -> Result<String> {
    let name = name
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| DEFAULT_ADMIN_CHAIN.to_owned());
    if is_chain_name(&name) {
        Ok(name)
    } else {
        Err(Error::invalid_config(format!(
            "invalid iptablesAdminChainName {name:?}: at most {MAX_CHAIN_NAME} printable characters, no quotes"
        )))
    }
}

impl FirewallConfig {
    pub fn load(conf: &NetConf) -> Result<Self> {
        // Accepted for configurations written for firewalld; nothing here
        // talks to it.
        conf.plugin_key::<String>("firewalldZone")?;
        let ingress_policy =
            IngressPolicy::parse(&conf.plugin_key::<String>("ingressPolicy")?.unwrap_or_default())
                .map_err(Error::invalid_config)?;
        Ok(FirewallConfig {
            backend: backend(conf.plugin_key("backend")?)?,
            admin_chain: admin_chain(conf.plugin_key("iptablesAdminChainName")?)?,
            ingress_policy,
            state_dir: conf
                .plugin_key::<String>("stateDir")?
                .filter(|d| !d.is_empty())
                .map_or_else(|| PathBuf::from(DEFAULT_STATE_DIR), PathBuf::from),
        })
    }

    /// What DEL needs, whatever else is wrong with the configuration: a
    /// DEL that fails on a key ADD refused would never let the runtime
    /// forget the container.
    pub fn state_dir_of(conf: &NetConf) -> PathBuf {
        conf.raw()
            .get("stateDir")
            .and_then(Value::as_str)
            .filter(|d| !d.is_empty())
            .map_or_else(|| PathBuf::from(DEFAULT_STATE_DIR), PathBuf::from)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn load(extra: Value) -> Result<FirewallConfig> {
        let mut doc = json!({"cniVersion": "1.0.0", "name": "net", "type": "firewall"});
        if let (Some(d), Value::Object(e)) = (doc.as_object_mut(), extra) {
            d.extend(e);
        }
        cni::keys::fold(&mut doc, &KEYS);
        FirewallConfig::load(&NetConf::from_document(doc, cni::Version::V1_0_0).expect("conf"))
    }

    #[test]
    fn defaults_are_the_references() {
        let c = load(json!({})).expect("valid");
        assert_eq!(c.backend, Backend::Iptables);
        assert_eq!(c.admin_chain, "CNI-ADMIN");
        assert_eq!(c.ingress_policy, IngressPolicy::Open);
        assert_eq!(c.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
        let c = load(json!({"backend": "", "iptablesAdminChainName": "", "ingressPolicy": "open"}))
            .expect("valid");
        assert_eq!(
            (c.backend, c.admin_chain.as_str()),
            (Backend::Iptables, "CNI-ADMIN")
        );
    }

    #[test]
    fn keys_match_as_gos_decoder_matches_them() {
        let c = load(
            json!({"Backend": "nftables", "IPTABLESADMINCHAINNAME": "MY-ADMIN",
            "ingresspolicy": "same-bridge", "FirewalldZone": "trusted", "statedir": "/tmp/x"}),
        )
        .expect("valid");
        assert_eq!(c.backend, Backend::Nftables);
        assert_eq!(c.admin_chain, "MY-ADMIN");
        assert_eq!(c.ingress_policy, IngressPolicy::SameBridge);
        assert_eq!(c.state_dir, PathBuf::from("/tmp/x"));
    }

    /// Everything firewall reads of a configuration, as the skeleton, ADD,
    /// CHECK, DEL and GC read it.
    fn loaded(doc: &Value) -> String {
        cni::skel::read_configuration(doc, &KEYS, |conf| {
            (
                FirewallConfig::load(conf),
                FirewallConfig::state_dir_of(conf),
                conf.prev_result(),
                conf.gc_valid_attachments(),
            )
        })
    }

    #[test]
    fn every_key_reads_null_as_absent() {
        let prev_result = cni::keys::full_prev_result();
        let doc = json!({"cniVersion": "1.0.0", "name": "net", "type": "firewall",
            "backend": "nftables", "iptablesAdminChainName": "MY-ADMIN", "firewalldZone": "trusted",
            "ingressPolicy": "same-bridge", "stateDir": "/run/x", "ipam": {"type": "none"},
            "capabilities": {"x": true}, "prevResult": prev_result,
            "cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]});
        let whole = loaded(&doc);
        assert!(
            whole.starts_with("Ok(((Ok(") && !whole.contains("Err("),
            "{whole}"
        );
        cni::keys::assert_null_reads_as_absent(&doc, &KEYS, 40, loaded);
    }

    #[test]
    fn wrong_values_are_configuration_errors_that_say_why() {
        let err = load(json!({"backend": "firewalld"})).expect_err("no firewalld");
        assert!(err.has_code(cni::Code::InvalidConfig));
        assert!(err.msg.contains("D-Bus"), "{}", err.msg);
        let err = load(json!({"ingressPolicy": "isolated"})).expect_err("not in 1.1.1");
        assert_eq!(err.msg, "unknown ingress policy: \"isolated\"");
        for (bad, key) in [
            (json!({"backend": 5}), "backend"),
            (json!({"backend": "ebtables"}), "backend"),
            (
                json!({"iptablesAdminChainName": "A-CHAIN-NAME-LONGER-THAN-28-CHARS"}),
                "iptablesAdminChainName",
            ),
            (
                json!({"iptablesAdminChainName": "has space"}),
                "iptablesAdminChainName",
            ),
            (json!({"firewalldZone": ["x"]}), "firewalldZone"),
        ] {
            let err = load(bad).expect_err(key);
            assert!(err.has_code(cni::Code::InvalidConfig));
            assert!(err.msg.starts_with(&format!("invalid {key}")), "{}", err.msg);
        }
    }
}
