//! One result model for every spec version, read from any version's shape and
//! printed in exactly the shape of the version the configuration asks for.
//!
//! The conversion rules are libcni's: 0.1/0.2 keep the first address of each
//! family and the routes of families that have one; 0.3/0.4 add
//! `ips[].version`; 1.x drops it and carries the newer route and interface
//! fields. Go prints `"dns":{}` in every version, and so do we.

use std::net::IpAddr;

use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Code, Error, Result};
use crate::version::{ResultShape, Version};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniResult {
    pub interfaces: Vec<Interface>,
    pub ips: Vec<IpConfig>,
    pub routes: Vec<Route>,
    pub dns: Dns,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtu: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sandbox: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub socket_path: String,
    #[serde(default, rename = "pciID", skip_serializing_if = "String::is_empty")]
    pub pci_id: String,
}

/// An address given to an interface. `address` keeps its host bits
/// (`10.1.0.5/16`), as the spec's `ips[].address` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpConfig {
    pub address: IpNetwork,
    pub gateway: Option<IpAddr>,
    /// Index into `interfaces`; IPAM results leave it out.
    pub interface: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    #[serde(with = "cidr")]
    pub dst: IpNetwork,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtu: u32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub advmss: u32,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<u8>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dns {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nameservers: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub domain: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Dns {
    pub fn is_empty(&self) -> bool {
        *self == Dns::default()
    }
}

impl Route {
    pub fn new(dst: IpNetwork, gw: Option<IpAddr>) -> Self {
        Route {
            dst,
            gw,
            mtu: 0,
            advmss: 0,
            priority: 0,
            table: None,
            scope: None,
        }
    }

    /// The route as versions before 1.0 can carry it.
    fn without_newer_fields(&self) -> Self {
        Route::new(self.dst, self.gw)
    }
}

impl Interface {
    fn without_newer_fields(&self) -> Self {
        Interface {
            name: self.name.clone(),
            mac: self.mac.clone(),
            sandbox: self.sandbox.clone(),
            ..Interface::default()
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// CIDR strings that must carry a prefix, as Go's `ParseCIDR` requires.
mod cidr {
    use ipnetwork::IpNetwork;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn parse(s: &str) -> Result<IpNetwork, String> {
        if !s.contains('/') {
            return Err(format!("invalid CIDR address: {s}"));
        }
        s.parse().map_err(|_| format!("invalid CIDR address: {s}"))
    }

    pub fn serialize<S: Serializer>(net: &IpNetwork, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(net)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<IpNetwork, D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(serde::de::Error::custom)
    }
}

pub use cidr::parse as parse_cidr;

/// Everything any version may put in a result; which fields are present tells
/// the shape, so a `prevResult` is read correctly whatever version wrote it.
#[derive(Deserialize)]
struct WireResult {
    #[serde(default)]
    interfaces: Vec<Interface>,
    // 0.3.0's spec text called the list `ip`; Go reads `ips` for it too.
    #[serde(default, alias = "ip")]
    ips: Vec<WireIp>,
    #[serde(default)]
    routes: Vec<Route>,
    #[serde(default)]
    dns: Option<Dns>,
    #[serde(default)]
    ip4: Option<LegacyIp>,
    #[serde(default)]
    ip6: Option<LegacyIp>,
}

#[derive(Deserialize, Serialize)]
struct WireIp {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interface: Option<usize>,
    #[serde(with = "cidr")]
    address: IpNetwork,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gateway: Option<IpAddr>,
}

#[derive(Deserialize, Serialize)]
struct LegacyIp {
    #[serde(with = "cidr")]
    ip: IpNetwork,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gateway: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    routes: Vec<Route>,
}

#[derive(Serialize)]
struct LegacyDoc<'a> {
    #[serde(rename = "cniVersion")]
    cni_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    ip4: Option<LegacyIp>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ip6: Option<LegacyIp>,
    dns: &'a Dns,
}

#[derive(Serialize)]
struct ModernDoc<'a> {
    #[serde(rename = "cniVersion")]
    cni_version: &'static str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    interfaces: Vec<Interface>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    ips: Vec<WireIp>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    routes: Vec<Route>,
    dns: &'a Dns,
}

fn family_tag(addr: IpAddr) -> &'static str {
    if addr.is_ipv4() { "4" } else { "6" }
}

impl CniResult {
    /// Reads a result of any version (a `prevResult`, a delegate's output, a
    /// cached result).
    pub fn from_value(value: &Value) -> Result<Self> {
        if !value.is_object() {
            return Err(Error::decoding("result is not a JSON object"));
        }
        let wire = WireResult::deserialize(value)
            .map_err(|e| Error::decoding(format!("failed to parse result: {e}")))?;
        let mut result = CniResult {
            interfaces: wire.interfaces,
            routes: wire.routes,
            dns: wire.dns.unwrap_or_default(),
            ips: Vec::with_capacity(wire.ips.len()),
        };
        for ip in wire.ips {
            if let Some(tag) = ip.version.as_deref()
                && tag != family_tag(ip.address.ip())
            {
                return Err(Error::decoding(format!(
                    "failed to parse result: address {} is not IPv{tag}",
                    ip.address
                )));
            }
            result.ips.push(IpConfig {
                address: ip.address,
                gateway: ip.gateway,
                interface: ip.interface,
            });
        }
        for legacy in [wire.ip4, wire.ip6].into_iter().flatten() {
            result.ips.push(IpConfig {
                address: legacy.ip,
                gateway: legacy.gateway,
                interface: None,
            });
            result.routes.extend(legacy.routes);
        }
        Ok(result)
    }

    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| Error::decoding(format!("failed to parse result: {e}")))?;
        CniResult::from_value(&value)
    }

    /// The result as the given version lays it out.
    pub fn to_value(&self, version: Version) -> Result<Value> {
        let doc = match version.result_shape() {
            ResultShape::Legacy => serde_json::to_value(self.legacy_doc(version)?),
            ResultShape::Versioned => serde_json::to_value(self.modern_doc(version, true)),
            ResultShape::Current => serde_json::to_value(self.modern_doc(version, false)),
        };
        doc.map_err(|e| Error::internal(format!("failed to encode result: {e}")))
    }

    /// The addresses `to_value(version)` prints: 0.1.0 and 0.2.0 carry
    /// the first of each family only.
    pub fn printed_addresses(&self, version: Version) -> Vec<std::net::IpAddr> {
        let all = self.ips.iter().map(|ip| ip.address.ip());
        match version.result_shape() {
            ResultShape::Legacy => [true, false]
                .into_iter()
                .filter_map(|v4| all.clone().find(|ip| ip.is_ipv4() == v4))
                .collect(),
            ResultShape::Versioned | ResultShape::Current => all.collect(),
        }
    }

    fn legacy_doc(&self, version: Version) -> Result<LegacyDoc<'_>> {
        let first_of = |v4: bool| {
            self.ips
                .iter()
                .find(|ip| ip.address.is_ipv4() == v4)
                .map(|ip| LegacyIp {
                    ip: ip.address,
                    gateway: ip.gateway,
                    routes: self
                        .routes
                        .iter()
                        .filter(|r| r.dst.is_ipv4() == v4)
                        .map(Route::without_newer_fields)
                        .collect(),
                })
        };
        let (ip4, ip6) = (first_of(true), first_of(false));
        // An empty result (a chained plugin with nothing before it) is
        // printed as such; only content that 0.1/0.2 cannot carry fails.
        let empty = self.interfaces.is_empty() && self.routes.is_empty();
        if ip4.is_none() && ip6.is_none() && !empty {
            return Err(Error::new(
                Code::IncompatibleVersion,
                "cannot convert: no valid IP addresses",
            ));
        }
        Ok(LegacyDoc {
            cni_version: version.as_str(),
            ip4,
            ip6,
            dns: &self.dns,
        })
    }

    fn modern_doc(&self, version: Version, with_ip_version: bool) -> ModernDoc<'_> {
        let ips = self
            .ips
            .iter()
            .map(|ip| WireIp {
                version: with_ip_version.then(|| family_tag(ip.address.ip()).to_owned()),
                interface: ip.interface,
                address: ip.address,
                gateway: ip.gateway,
            })
            .collect();
        let (interfaces, routes) = if with_ip_version {
            (
                self.interfaces
                    .iter()
                    .map(Interface::without_newer_fields)
                    .collect(),
                self.routes.iter().map(Route::without_newer_fields).collect(),
            )
        } else {
            (self.interfaces.clone(), self.routes.clone())
        };
        ModernDoc {
            cni_version: version.as_str(),
            interfaces,
            ips,
            routes,
            dns: &self.dns,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn net(s: &str) -> IpNetwork {
        s.parse().expect("valid CIDR in test")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("valid IP in test")
    }

    fn dual_stack() -> CniResult {
        CniResult {
            interfaces: vec![
                Interface {
                    name: "cni0".into(),
                    mac: "0a:58:0a:01:00:01".into(),
                    ..Interface::default()
                },
                Interface {
                    name: "eth0".into(),
                    mac: "0a:58:0a:01:00:05".into(),
                    mtu: 1450,
                    sandbox: "/var/run/netns/pod".into(),
                    ..Interface::default()
                },
            ],
            ips: vec![
                IpConfig {
                    address: net("10.1.0.5/16"),
                    gateway: Some(ip("10.1.0.1")),
                    interface: Some(1),
                },
                IpConfig {
                    address: net("10.2.0.5/16"),
                    gateway: None,
                    interface: Some(1),
                },
                IpConfig {
                    address: net("fd00::5/64"),
                    gateway: Some(ip("fd00::1")),
                    interface: Some(1),
                },
            ],
            routes: vec![
                Route {
                    mtu: 1400,
                    table: Some(100),
                    scope: Some(0),
                    priority: 10,
                    advmss: 1300,
                    ..Route::new(net("0.0.0.0/0"), Some(ip("10.1.0.1")))
                },
                Route::new(net("::/0"), None),
            ],
            dns: Dns {
                nameservers: vec!["10.1.0.1".into()],
                search: vec!["svc.cluster.local".into()],
                ..Dns::default()
            },
        }
    }

    #[test]
    fn current_shape_has_no_ip_version_and_keeps_new_fields() {
        for v in [Version::V1_0_0, Version::V1_1_0] {
            let doc = dual_stack().to_value(v).expect("converts");
            assert_eq!(doc["cniVersion"], v.as_str());
            assert!(doc["ips"][0].get("version").is_none());
            assert_eq!(doc["ips"][0]["interface"], 1);
            assert_eq!(doc["routes"][0]["mtu"], 1400);
            assert_eq!(doc["routes"][0]["table"], 100);
            assert_eq!(doc["routes"][0]["scope"], 0);
            assert_eq!(doc["interfaces"][1]["mtu"], 1450);
            assert!(doc["routes"][1].get("gw").is_none());
            assert_eq!(doc["dns"]["search"][0], "svc.cluster.local");
        }
    }

    #[test]
    fn versioned_shape_tags_families_and_drops_new_fields() {
        for v in [Version::V0_3_0, Version::V0_3_1, Version::V0_4_0] {
            let doc = dual_stack().to_value(v).expect("converts");
            assert_eq!(doc["ips"][0]["version"], "4");
            assert_eq!(doc["ips"][2]["version"], "6");
            assert_eq!(
                doc["routes"][0],
                json!({"dst":"0.0.0.0/0","gw":"10.1.0.1"}),
                "mtu/table/scope are lost below 1.0.0"
            );
            assert!(doc["interfaces"][1].get("mtu").is_none());
            assert!(doc.get("ip").is_none(), "0.3.0 is printed with `ips`, as Go does");
        }
    }

    #[test]
    fn legacy_shape_keeps_first_address_per_family_and_its_routes() {
        let doc = dual_stack().to_value(Version::V0_2_0).expect("converts");
        assert_eq!(
            doc,
            json!({
                "cniVersion": "0.2.0",
                "ip4": {"ip": "10.1.0.5/16", "gateway": "10.1.0.1",
                        "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.0.1"}]},
                "ip6": {"ip": "fd00::5/64", "gateway": "fd00::1",
                        "routes": [{"dst": "::/0"}]},
                "dns": {"nameservers": ["10.1.0.1"], "search": ["svc.cluster.local"]}
            })
        );
    }

    #[test]
    fn legacy_drops_routes_of_a_family_without_address() {
        let mut r = dual_stack();
        r.ips.retain(|i| i.address.is_ipv4());
        let doc = r.to_value(Version::V0_1_0).expect("converts");
        assert!(doc.get("ip6").is_none());
        assert_eq!(doc["ip4"]["routes"].as_array().map(Vec::len), Some(1));
    }

    #[test]
    fn legacy_without_any_address_is_libcnis_error() {
        let r = CniResult {
            interfaces: vec![Interface {
                name: "lo".into(),
                ..Interface::default()
            }],
            ..CniResult::default()
        };
        let err = r.to_value(Version::V0_2_0).expect_err("cannot convert");
        assert_eq!(err.msg, "cannot convert: no valid IP addresses");
        assert!(err.has_code(Code::IncompatibleVersion));
        assert!(r.to_value(Version::V0_3_1).is_ok());
    }

    #[test]
    fn an_empty_result_prints_in_every_version() {
        for v in Version::ALL {
            let doc = CniResult::default().to_value(v).expect("converts");
            assert_eq!(doc, json!({"cniVersion": v.as_str(), "dns": {}}), "{v}");
        }
    }

    #[test]
    fn empty_dns_is_printed_as_an_empty_object_in_every_version() {
        let r = CniResult {
            ips: vec![IpConfig {
                address: net("10.0.0.2/24"),
                gateway: None,
                interface: None,
            }],
            ..CniResult::default()
        };
        for v in Version::ALL {
            assert_eq!(r.to_value(v).expect("converts")["dns"], json!({}), "{v}");
        }
    }

    #[test]
    fn modern_round_trips_are_lossless() {
        let original = dual_stack();
        for v in [Version::V1_0_0, Version::V1_1_0] {
            let back = CniResult::from_value(&original.to_value(v).expect("converts")).expect("parses");
            assert_eq!(back, original, "{v}");
        }
    }

    #[test]
    fn versioned_round_trip_loses_only_the_newer_fields() {
        let original = dual_stack();
        let back =
            CniResult::from_value(&original.to_value(Version::V0_4_0).expect("converts")).expect("parses");
        assert_eq!(back.ips, original.ips);
        assert_eq!(back.dns, original.dns);
        assert_eq!(back.routes[0], original.routes[0].without_newer_fields());
        assert_eq!(back.interfaces[1].mtu, 0);
        assert_eq!(back.interfaces[1].sandbox, "/var/run/netns/pod");
    }

    #[test]
    fn legacy_round_trip_keeps_one_address_per_family() {
        let back = CniResult::from_value(&dual_stack().to_value(Version::V0_2_0).expect("converts"))
            .expect("parses");
        let addrs: Vec<String> = back.ips.iter().map(|i| i.address.to_string()).collect();
        assert_eq!(addrs, ["10.1.0.5/16", "fd00::5/64"]);
        assert!(back.interfaces.is_empty());
        assert!(back.ips.iter().all(|i| i.interface.is_none()));
        let dsts: Vec<String> = back.routes.iter().map(|r| r.dst.to_string()).collect();
        assert_eq!(dsts, ["0.0.0.0/0", "::/0"]);
    }

    #[test]
    fn reads_legacy_input_into_modern_output() {
        let legacy = json!({
            "cniVersion": "0.2.0",
            "ip4": {"ip": "10.1.0.5/16", "gateway": "10.1.0.1",
                    "routes": [{"dst": "0.0.0.0/0"}]},
            "ip6": {"ip": "fd00::5/64", "routes": [{"dst": "::/0", "gw": "fd00::1"}]},
            "dns": {}
        });
        let r = CniResult::from_value(&legacy).expect("parses");
        assert_eq!(
            r.to_value(Version::V0_3_1).expect("converts"),
            json!({
                "cniVersion": "0.3.1",
                "ips": [
                    {"version": "4", "address": "10.1.0.5/16", "gateway": "10.1.0.1"},
                    {"version": "6", "address": "fd00::5/64"}
                ],
                "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0", "gw": "fd00::1"}],
                "dns": {}
            })
        );
    }

    #[test]
    fn reads_the_0_3_0_spelling_of_ips() {
        let r = CniResult::from_value(
            &json!({"cniVersion":"0.3.0","ip":[{"version":"4","address":"10.0.0.2/24"}]}),
        )
        .expect("parses");
        assert_eq!(r.ips.len(), 1);
    }

    #[test]
    fn rejects_malformed_results() {
        for bad in [
            json!([]),
            json!({"ips":[{"address":"10.0.0.2"}]}),
            json!({"ips":[{"version":"6","address":"10.0.0.2/24"}]}),
            json!({"ip4":{"ip":"nonsense/8"}}),
            json!({"routes":[{"dst":"0.0.0.0/0","gw":"x"}]}),
        ] {
            let err = CniResult::from_value(&bad).expect_err("must be refused");
            assert!(err.has_code(Code::Decoding), "{bad}: {err}");
        }
    }
}
