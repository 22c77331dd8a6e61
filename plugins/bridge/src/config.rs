//! The bridge plugin's configuration: every key of the reference plugin,
//! with its defaults, checks and messages.

use std::collections::BTreeSet;

use cni::keys::{self, Shape, field, plain};
use cni::{CniArgs, Error, NetConf, Result};
use firewall::Backend;
use serde::Deserialize;

pub const DEFAULT_BRIDGE: &str = "cni0";

/// The reference's `NetConf` (with `types.NetConf` embedded), and
/// host-local's `ipam`: the bridge checks host-local's configuration before
/// it changes anything, as host-local would read it.
pub const KEYS: Shape = Shape::Struct(&[
    keys::NET_CONF,
    &[
        plain("bridge"),
        plain("isDefaultGateway"),
        plain("forceAddress"),
        plain("isGateway"),
        plain("ipMasq"),
        plain("ipMasqBackend"),
        plain("mtu"),
        plain("hairpinMode"),
        plain("promiscMode"),
        plain("vlan"),
        field(
            "vlanTrunk",
            Shape::List(&Shape::Struct(&[&[plain("minID"), plain("maxID"), plain("id")]])),
        ),
        plain("preserveDefaultVlan"),
        plain("macspoofchk"),
        plain("enabledad"),
        plain("disableContainerInterface"),
        plain("portIsolation"),
        // With host-local's keys of the same sections (see above).
        field(
            "runtimeConfig",
            Shape::Struct(&[&[plain("mac"), ipam_config::config::IP_RANGES, plain("ips")]]),
        ),
        field(
            "args",
            Shape::Struct(&[&[field("cni", Shape::Struct(&[&[plain("mac"), plain("ips")]]))]]),
        ),
        ipam_config::config::IPAM,
    ],
]);

/// A `vlanTrunk` entry: one `id`, or a `minID`..`maxID` range.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct VlanTrunk {
    #[serde(default)]
    pub id: Option<i64>,
    #[serde(default, rename = "minID")]
    pub min_id: Option<i64>,
    #[serde(default, rename = "maxID")]
    pub max_id: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    #[serde(default = "default_bridge")]
    bridge: String,
    #[serde(default, rename = "isGateway")]
    is_gateway: bool,
    #[serde(default, rename = "isDefaultGateway")]
    is_default_gateway: bool,
    #[serde(default)]
    force_address: bool,
    #[serde(default)]
    ip_masq: bool,
    #[serde(default)]
    ip_masq_backend: Option<String>,
    #[serde(default)]
    mtu: u32,
    #[serde(default)]
    hairpin_mode: bool,
    #[serde(default)]
    promisc_mode: bool,
    #[serde(default)]
    vlan: i64,
    #[serde(default)]
    vlan_trunk: Option<Vec<VlanTrunk>>,
    #[serde(default)]
    preserve_default_vlan: bool,
    #[serde(default)]
    macspoofchk: bool,
    #[serde(default)]
    enabledad: bool,
    #[serde(default)]
    disable_container_interface: bool,
    #[serde(default)]
    port_isolation: bool,
}

fn default_bridge() -> String {
    DEFAULT_BRIDGE.to_owned()
}

/// The checked configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgeConfig {
    pub bridge: String,
    pub is_gateway: bool,
    pub is_default_gateway: bool,
    pub force_address: bool,
    pub ip_masq: bool,
    /// Which tool programs masquerade (`ipMasqBackend`).
    pub masq_backend: Backend,
    pub mtu: Option<u32>,
    pub hairpin: bool,
    pub promisc: bool,
    /// Access VLAN (PVID, untagged), 0 for none.
    pub vlan: u16,
    /// Tagged VLANs, sorted, without duplicates.
    pub trunk: Vec<u16>,
    pub preserve_default_vlan: bool,
    pub macspoofchk: bool,
    pub enable_dad: bool,
    pub disable_container_interface: bool,
    pub port_isolation: bool,
    /// The IPAM plugin, when the network is L3.
    pub ipam_type: Option<String>,
    /// The container interface's MAC, if one was asked for.
    pub mac: Option<[u8; 6]>,
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::invalid_config(msg)
}

/// The reference's `collectVlanTrunk`, with its messages.
pub fn collect_trunk(trunks: &[VlanTrunk]) -> Result<Vec<u16>> {
    let in_range = |v: i64| (1..=4094).contains(&v);
    let mut vids = BTreeSet::new();
    for trunk in trunks {
        match (trunk.min_id, trunk.max_id) {
            (Some(min), Some(max)) => {
                if !in_range(min) {
                    return Err(invalid("incorrect trunk minID parameter"));
                }
                if !in_range(max) {
                    return Err(invalid("incorrect trunk maxID parameter"));
                }
                if max < min {
                    return Err(invalid("minID is greater than maxID in trunk parameter"));
                }
                vids.extend(min..=max);
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "minID and maxID should be configured simultaneously, minID is missing",
                ));
            }
            (Some(_), None) => {
                return Err(invalid(
                    "minID and maxID should be configured simultaneously, maxID is missing",
                ));
            }
            (None, None) => {}
        }
        if let Some(id) = trunk.id {
            if !in_range(id) {
                return Err(invalid("incorrect trunk id parameter"));
            }
            vids.insert(id);
        }
    }
    Ok(vids.into_iter().filter_map(|v| u16::try_from(v).ok()).collect())
}

impl BridgeConfig {
    pub fn load(conf: &NetConf, args: &CniArgs) -> Result<Self> {
        BridgeConfig::load_with(conf, args, Backend::detect)
    }

    /// `detect` is asked only when `ipMasqBackend` names no backend.
    fn load_with(conf: &NetConf, args: &CniArgs, detect: impl FnOnce() -> Backend) -> Result<Self> {
        let raw: Raw = conf.plugin_config()?;
        if !(0..=4094).contains(&raw.vlan) {
            return Err(invalid(format!(
                "invalid VLAN ID {} (must be between 0 and 4094)",
                raw.vlan
            )));
        }
        let trunk = collect_trunk(raw.vlan_trunk.as_deref().unwrap_or_default())?;
        let masq_backend = match raw.ip_masq_backend.as_deref() {
            None | Some("") => detect(),
            Some(name) => {
                Backend::named(name).ok_or_else(|| invalid(format!("unknown ipmasq backend {name:?}")))?
            }
        };
        let ipam_type = conf
            .ipam
            .as_ref()
            .map(|i| i.plugin_type.clone())
            .filter(|t| !t.is_empty());
        if let Some(plugin_type) = &ipam_type {
            // Checked here so that ADD refuses it before changing anything.
            cni::exec::validate_plugin_type(plugin_type)?;
        }
        if ipam_type.is_some() && raw.disable_container_interface {
            return Err(invalid(
                "cannot use IPAM when DisableContainerInterface flag is set",
            ));
        }
        if raw.hairpin_mode && raw.promisc_mode {
            return Err(invalid(
                "cannot set hairpin mode and promiscuous mode at the same time",
            ));
        }
        cni::env::validate_interface_name(&raw.bridge)
            .map_err(|e| invalid(format!("invalid bridge name {:?}: {}", raw.bridge, e.msg)))?;
        Ok(BridgeConfig {
            bridge: raw.bridge,
            is_gateway: raw.is_gateway || raw.is_default_gateway,
            is_default_gateway: raw.is_default_gateway,
            force_address: raw.force_address,
            ip_masq: raw.ip_masq,
            masq_backend,
            mtu: (raw.mtu != 0).then_some(raw.mtu),
            hairpin: raw.hairpin_mode,
            promisc: raw.promisc_mode,
            vlan: u16::try_from(raw.vlan).unwrap_or_default(),
            trunk,
            preserve_default_vlan: raw.preserve_default_vlan,
            macspoofchk: raw.macspoofchk,
            enable_dad: raw.enabledad,
            disable_container_interface: raw.disable_container_interface,
            port_isolation: raw.port_isolation,
            ipam_type,
            mac: requested_mac(conf, args)?,
        })
    }

    /// Whether the bridge needs VLAN filtering.
    pub fn uses_vlans(&self) -> bool {
        self.vlan != 0 || !self.trunk.is_empty()
    }
}

/// The container MAC: `runtimeConfig.mac` over `args.cni.mac` over CNI_ARGS
/// `MAC` (the last the reference applies wins). CNI_ARGS is checked like
/// Go's `LoadArgs`: unknown keys need `IgnoreUnknown`.
fn requested_mac(conf: &NetConf, args: &CniArgs) -> Result<Option<[u8; 6]>> {
    args.expect_only(&["MAC"])?;
    let text = conf
        .runtime_config
        .mac()?
        .or(conf.args.mac()?)
        .or_else(|| args.get("MAC").filter(|m| !m.is_empty()).map(str::to_owned));
    text.map(|t| netlink::ops::parse_mac(&t).ok_or_else(|| invalid(format!("invalid MAC address {t:?}"))))
        .transpose()
}

/// What VLAN changes a new host port gets, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VlanPlan {
    /// Remove VID 1 (the default PVID) from the port.
    pub remove_default: bool,
    /// VIDs to add: `(vid, pvid_untagged)`.
    pub add: Vec<(u16, bool)>,
}

impl BridgeConfig {
    /// As the reference (v1.8+) does it: the access VLAN replaces the
    /// default VID 1 as PVID and untagged unless the default is preserved;
    /// trunk VIDs are tagged; a trunk alone keeps VID 1 as PVID.
    pub fn vlan_plan(&self) -> VlanPlan {
        let mut plan = VlanPlan {
            remove_default: self.vlan != 0 && !self.preserve_default_vlan,
            add: Vec::new(),
        };
        if self.vlan != 0 {
            plan.add.push((self.vlan, true));
        }
        plan.add.extend(
            self.trunk
                .iter()
                .filter(|v| **v != self.vlan)
                .map(|v| (*v, false)),
        );
        plan
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn conf(extra: Value) -> NetConf {
        let mut doc = json!({"cniVersion": "1.0.0", "name": "net", "type": "bridge"});
        if let (Some(d), Value::Object(e)) = (doc.as_object_mut(), extra) {
            d.extend(e);
        }
        NetConf::from_document(doc, cni::Version::V1_0_0).expect("valid network conf")
    }

    /// The node's detection, over the tools `tool_exists` says are here.
    fn installed(tool_exists: impl Fn(&str) -> bool) -> impl FnOnce() -> Backend {
        move || Backend::detect_with(tool_exists)
    }

    fn load(extra: Value) -> Result<BridgeConfig> {
        BridgeConfig::load_with(&conf(extra), &CniArgs::default(), installed(|_| true))
    }

    #[test]
    fn defaults() {
        let c = load(json!({})).expect("valid");
        assert_eq!(c.bridge, "cni0");
        assert!(!c.is_gateway && !c.ip_masq && !c.hairpin && !c.promisc);
        assert_eq!((c.mtu, c.vlan, c.ipam_type.as_deref()), (None, 0, None));
        assert_eq!(c.masq_backend, Backend::Iptables);
        assert_eq!(c.vlan_plan(), VlanPlan::default());
    }

    #[test]
    fn default_gateway_implies_gateway() {
        let c = load(json!({"isDefaultGateway": true})).expect("valid");
        assert!(c.is_gateway && c.is_default_gateway);
    }

    #[test]
    fn masquerade_backend() {
        assert_eq!(
            load(json!({"ipMasqBackend": "nftables"}))
                .expect("valid")
                .masq_backend,
            Backend::Nftables
        );
        let err = load(json!({"ipMasqBackend": "pf"})).expect_err("unknown");
        assert_eq!(err.msg, "unknown ipmasq backend \"pf\"");
        let only_nft =
            BridgeConfig::load_with(&conf(json!({})), &CniArgs::default(), installed(|t| t == "nft"))
                .expect("valid");
        assert_eq!(only_nft.masq_backend, Backend::Nftables);
        let neither = BridgeConfig::load_with(&conf(json!({})), &CniArgs::default(), installed(|_| false))
            .expect("valid");
        assert_eq!(neither.masq_backend, Backend::Iptables);
    }

    #[test]
    fn errors_carry_the_reference_messages() {
        let cases = [
            (
                json!({"vlan": 4095}),
                "invalid VLAN ID 4095 (must be between 0 and 4094)",
            ),
            (
                json!({"vlan": -1}),
                "invalid VLAN ID -1 (must be between 0 and 4094)",
            ),
            (json!({"vlanTrunk": [{"id": 0}]}), "incorrect trunk id parameter"),
            (
                json!({"vlanTrunk": [{"id": 4095}]}),
                "incorrect trunk id parameter",
            ),
            (
                json!({"vlanTrunk": [{"minID": 0, "maxID": 10}]}),
                "incorrect trunk minID parameter",
            ),
            (
                json!({"vlanTrunk": [{"minID": 1, "maxID": 5000}]}),
                "incorrect trunk maxID parameter",
            ),
            (
                json!({"vlanTrunk": [{"minID": 10, "maxID": 5}]}),
                "minID is greater than maxID in trunk parameter",
            ),
            (
                json!({"vlanTrunk": [{"maxID": 5}]}),
                "minID and maxID should be configured simultaneously, minID is missing",
            ),
            (
                json!({"vlanTrunk": [{"minID": 5}]}),
                "minID and maxID should be configured simultaneously, maxID is missing",
            ),
            (
                json!({"hairpinMode": true, "promiscMode": true}),
                "cannot set hairpin mode and promiscuous mode at the same time",
            ),
            (
                json!({"disableContainerInterface": true, "ipam": {"type": "host-local"}}),
                "cannot use IPAM when DisableContainerInterface flag is set",
            ),
        ];
        for (extra, msg) in cases {
            let err = load(extra.clone()).expect_err(msg);
            assert_eq!(err.msg, msg, "{extra}");
            assert!(err.has_code(cni::Code::InvalidConfig));
        }
        assert!(
            load(json!({"mtu": "big"}))
                .expect_err("type")
                .has_code(cni::Code::InvalidConfig)
        );
        assert!(load(json!({"bridge": "much-too-long-bridge-name"})).is_err());
    }

    #[test]
    fn trunks_collect_sorted_unique_vids() {
        let c =
            load(json!({"vlanTrunk": [{"id": 30}, {"minID": 10, "maxID": 12}, {"id": 11}]})).expect("valid");
        assert_eq!(c.trunk, [10, 11, 12, 30]);
        assert!(c.uses_vlans());
        assert!(load(json!({"vlanTrunk": []})).expect("valid").trunk.is_empty());
    }

    #[test]
    fn vlan_plans_follow_the_reference() {
        let access = load(json!({"vlan": 100})).expect("valid");
        assert_eq!(
            access.vlan_plan(),
            VlanPlan {
                remove_default: true,
                add: vec![(100, true)]
            }
        );
        let kept = load(json!({"vlan": 100, "preserveDefaultVlan": true})).expect("valid");
        assert_eq!(
            kept.vlan_plan(),
            VlanPlan {
                remove_default: false,
                add: vec![(100, true)]
            }
        );
        let trunk = load(json!({"vlanTrunk": [{"minID": 200, "maxID": 201}]})).expect("valid");
        assert_eq!(
            trunk.vlan_plan(),
            VlanPlan {
                remove_default: false,
                add: vec![(200, false), (201, false)]
            }
        );
        let both = load(json!({"vlan": 100, "vlanTrunk": [{"id": 100}, {"id": 300}]})).expect("valid");
        assert_eq!(
            both.vlan_plan(),
            VlanPlan {
                remove_default: true,
                add: vec![(100, true), (300, false)]
            }
        );
    }

    /// Every key the bridge reads (host-local's among them), each set.
    fn full_featured() -> Value {
        let range = |net: &str| {
            json!({"subnet": format!("{net}.0/24"), "rangeStart": format!("{net}.10"),
                   "rangeEnd": format!("{net}.20"), "gateway": format!("{net}.1")})
        };
        let route = json!({"dst": "0.0.0.0/0", "gw": "10.8.0.1", "mtu": 1400, "advmss": 1300,
                           "priority": 5, "table": 100, "scope": 0});
        let dns = json!({"nameservers": ["10.0.0.53"], "domain": "d", "search": ["s"], "options": ["o"]});
        let prev_result = json!({"cniVersion": "1.0.0",
            "interfaces": [{"name": "eth0", "mac": "c2:00:00:00:00:01", "mtu": 1400,
                            "sandbox": "/run/netns/p", "socketPath": "/s", "pciID": "0000:00:01.0"}],
            "ips": [{"address": "10.9.0.12/24", "gateway": "10.9.0.1", "interface": 0}],
            "routes": [route], "dns": dns});
        let ipam = json!({"type": "host-local", "subnet": "10.8.0.0/24", "rangeStart": "10.8.0.10",
            "rangeEnd": "10.8.0.20", "gateway": "10.8.0.1", "Name": "n", "routes": [route],
            "dataDir": "/run/x", "resolvConf": "/etc/resolv.conf", "ranges": [[range("10.7.0")]],
            "socket": ""});
        let attachments = json!([{"containerID": "a", "ifname": "eth0"}]);
        json!({"cniVersion": "1.0.0", "name": "net", "type": "bridge", "bridge": "br-full",
            "isDefaultGateway": true, "forceAddress": true, "isGateway": true, "ipMasq": true,
            "ipMasqBackend": "nftables", "mtu": 1400, "hairpinMode": true, "promiscMode": false,
            "vlan": 100, "vlanTrunk": [{"minID": 200, "maxID": 210}, {"id": 300}],
            "preserveDefaultVlan": true, "macspoofchk": true, "enabledad": true,
            "disableContainerInterface": false, "portIsolation": true,
            "capabilities": {"mac": true, "ips": true, "ipRanges": true}, "dns": dns,
            "runtimeConfig": {"mac": "c2:00:00:00:00:01", "ipRanges": [[range("10.9.0")]],
                              "ips": ["10.9.0.12"]},
            "args": {"cni": {"mac": "c2:00:00:00:00:02", "ips": ["10.9.0.13"]}},
            "prevResult": prev_result, "cni.dev/valid-attachments": attachments,
            "cni.dev/attachments": attachments, "ipam": ipam})
    }

    /// Everything the bridge reads of a configuration, as the skeleton,
    /// ADD (host-local's check included), CHECK and GC read it.
    fn loaded(doc: &Value) -> String {
        let args = CniArgs::parse("IgnoreUnknown=1;MAC=c2:00:00:00:00:04;IP=10.9.0.14").expect("args");
        cni::skel::read_configuration(doc, &KEYS, |conf| {
            (
                BridgeConfig::load_with(conf, &args, installed(|_| true)),
                ipam_config::config::IpamConfig::load(conf, &args).map_err(|e| e.to_string()),
                conf.prev_result(),
                conf.gc_valid_attachments(),
            )
        })
    }

    #[test]
    fn every_key_reads_null_as_absent() {
        let doc = full_featured();
        let whole = loaded(&doc);
        assert!(
            whole.starts_with("Ok(((Ok(") && !whole.contains("Err("),
            "{whole}"
        );
        cni::keys::assert_null_reads_as_absent(&doc, &KEYS, 80, loaded);
    }

    #[test]
    fn mac_sources_in_order() {
        let both = conf(
            json!({"runtimeConfig": {"mac": "c2:00:00:00:00:03"}, "args": {"cni": {"mac": "c2:00:00:00:00:02"}}}),
        );
        let args = CniArgs::parse("MAC=c2:00:00:00:00:01").expect("args");
        let c = BridgeConfig::load_with(&both, &args, installed(|_| true)).expect("valid");
        assert_eq!(c.mac, Some([0xc2, 0, 0, 0, 0, 3]));
        let env_only = BridgeConfig::load_with(&conf(json!({})), &args, installed(|_| true)).expect("valid");
        assert_eq!(env_only.mac, Some([0xc2, 0, 0, 0, 0, 1]));
        let bad = BridgeConfig::load_with(
            &conf(json!({"runtimeConfig": {"mac": "nope"}})),
            &CniArgs::default(),
            installed(|_| true),
        );
        assert_eq!(bad.expect_err("bad mac").msg, "invalid MAC address \"nope\"");
        let strict = CniArgs::parse("MAC=c2:00:00:00:00:01;K8S_POD_NAME=x").expect("args");
        assert!(BridgeConfig::load_with(&conf(json!({})), &strict, installed(|_| true)).is_err());
    }
}
