//! Istio's annotations → capture settings, with the plugin's defaults and
//! traps kept: inbound exclusions always get 15020, 15021 and 15090; a
//! user's `excludeOutboundPorts` replaces the 15020 default; an invalid value
//! fails ADD (the pod must not start half-captured).

use std::collections::BTreeMap;

use crate::rules::ambient::PodOverrides;
use crate::rules::{ALWAYS_EXCLUDED_INBOUND, Mode, Redirect, STATUS_PORT, Selection};
use ipnetwork::IpNetwork;

pub const INTERCEPTION_MODE: &str = "sidecar.istio.io/interceptionMode";
pub const INCLUDE_OUTBOUND_CIDRS: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
pub const EXCLUDE_OUTBOUND_CIDRS: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
pub const INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
pub const EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
pub const INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
pub const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
pub const EXCLUDE_INTERFACES: &str = "traffic.sidecar.istio.io/excludeInterfaces";
pub const REROUTE_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";
pub const KUBEVIRT_INTERFACES: &str = "traffic.sidecar.istio.io/kubevirtInterfaces";
pub const STATUS: &str = "sidecar.istio.io/status";
pub const INJECT: &str = "sidecar.istio.io/inject";
pub const BYPASS_INBOUND_CAPTURE: &str = "ambient.istio.io/bypass-inbound-capture";
pub const DNS_CAPTURE: &str = "ambient.istio.io/dns-capture";

/// The static `redirect` object's keys: annotation names without prefixes.
pub fn from_static(settings: &BTreeMap<String, String>) -> Result<BTreeMap<String, String>, String> {
    let mut annotations = BTreeMap::new();
    for (key, value) in settings {
        let full = [
            INTERCEPTION_MODE,
            INCLUDE_OUTBOUND_CIDRS,
            EXCLUDE_OUTBOUND_CIDRS,
            INCLUDE_INBOUND_PORTS,
            EXCLUDE_INBOUND_PORTS,
            INCLUDE_OUTBOUND_PORTS,
            EXCLUDE_OUTBOUND_PORTS,
            EXCLUDE_INTERFACES,
            REROUTE_INTERFACES,
        ]
        .into_iter()
        .find(|name| {
            name.rsplit('/').next() == Some(key.as_str())
                || (key == "rerouteVirtualInterfaces" && *name == REROUTE_INTERFACES)
        })
        .ok_or_else(|| format!("unknown redirect setting {key:?}"))?;
        annotations.insert(full.to_owned(), value.clone());
    }
    Ok(annotations)
}

/// What the pod's proxy container says (or the plugin's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proxy {
    pub uid: u32,
    pub gid: u32,
    pub dns_capture: bool,
    pub dual_stack: bool,
    pub invalid_drop: bool,
}

impl Default for Proxy {
    /// Istio's defaults: uid and gid 1337, every switch off.
    fn default() -> Self {
        Proxy {
            uid: 1337,
            gid: 1337,
            dns_capture: false,
            dual_stack: false,
            invalid_drop: false,
        }
    }
}

fn invalid(name: &str, value: &str, why: impl std::fmt::Display) -> String {
    format!("invalid annotation {name}={value:?}: {why}")
}

fn items(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

fn cidrs(name: &str, value: &str) -> Result<Vec<IpNetwork>, String> {
    items(value)
        .map(|item| {
            if !item.contains('/') {
                return Err(invalid(name, value, format!("{item:?} is not a CIDR")));
            }
            item.parse::<IpNetwork>().map_err(|e| invalid(name, value, e))
        })
        .collect()
}

fn ports(name: &str, value: &str) -> Result<Vec<u16>, String> {
    items(value)
        .map(|item| match item.parse::<u16>() {
            Ok(port) if port > 0 => Ok(port),
            _ => Err(invalid(name, value, format!("{item:?} is not a port"))),
        })
        .collect()
}

fn interfaces(name: &str, value: &str) -> Result<Vec<String>, String> {
    items(value)
        .map(|item| {
            cni::env::validate_interface_name(item)
                .map(|()| item.to_owned())
                .map_err(|e| invalid(name, value, e.msg))
        })
        .collect()
}

fn dedup_append(mut list: Vec<u16>, extra: &[u16]) -> Vec<u16> {
    for port in extra {
        if !list.contains(port) {
            list.push(*port);
        }
    }
    let mut seen = Vec::with_capacity(list.len());
    list.retain(|p| {
        if seen.contains(p) {
            false
        } else {
            seen.push(*p);
            true
        }
    });
    list
}

/// The capture settings the plugin derives for a pod.
pub fn redirect(annotations: &BTreeMap<String, String>, proxy: Proxy) -> Result<Redirect, String> {
    let get = |name: &str| annotations.get(name).map(String::as_str);
    let mode = match get(INTERCEPTION_MODE).unwrap_or("REDIRECT") {
        "REDIRECT" => Mode::Redirect,
        "TPROXY" => Mode::Tproxy,
        other => return Err(invalid(INTERCEPTION_MODE, other, "expected REDIRECT or TPROXY")),
    };
    let include_cidrs = match get(INCLUDE_OUTBOUND_CIDRS).unwrap_or("*") {
        "*" => Selection::All,
        list => Selection::Only(cidrs(INCLUDE_OUTBOUND_CIDRS, list)?),
    };
    let excluded = get(EXCLUDE_OUTBOUND_CIDRS).unwrap_or("");
    if items(excluded).any(|i| i == "*") {
        return Err(invalid(
            EXCLUDE_OUTBOUND_CIDRS,
            excluded,
            "a wildcard is not allowed",
        ));
    }
    let include_inbound_ports = match get(INCLUDE_INBOUND_PORTS).unwrap_or("*") {
        "*" => Selection::All,
        list => Selection::Only(ports(INCLUDE_INBOUND_PORTS, list)?),
    };
    let excluded_inbound = ports(EXCLUDE_INBOUND_PORTS, get(EXCLUDE_INBOUND_PORTS).unwrap_or(""))?;
    let exclude_outbound_ports = match get(EXCLUDE_OUTBOUND_PORTS) {
        None => vec![STATUS_PORT],
        Some(list) => ports(EXCLUDE_OUTBOUND_PORTS, list)?,
    };
    let reroute = match get(REROUTE_INTERFACES) {
        Some(list) => interfaces(REROUTE_INTERFACES, list)?,
        None => interfaces(KUBEVIRT_INTERFACES, get(KUBEVIRT_INTERFACES).unwrap_or(""))?,
    };
    Ok(Redirect {
        mode,
        include_cidrs,
        exclude_cidrs: cidrs(EXCLUDE_OUTBOUND_CIDRS, excluded)?,
        include_inbound_ports,
        exclude_inbound_ports: dedup_append(excluded_inbound, &ALWAYS_EXCLUDED_INBOUND),
        include_outbound_ports: ports(INCLUDE_OUTBOUND_PORTS, get(INCLUDE_OUTBOUND_PORTS).unwrap_or(""))?,
        exclude_outbound_ports,
        exclude_interfaces: interfaces(EXCLUDE_INTERFACES, get(EXCLUDE_INTERFACES).unwrap_or(""))?,
        reroute_interfaces: reroute,
        // Istio treats an unset or root proxy user as 1337.
        proxy_uid: if proxy.uid == 0 { 1337 } else { proxy.uid },
        proxy_gid: if proxy.gid == 0 { 1337 } else { proxy.gid },
        dns_capture: proxy.dns_capture,
        invalid_drop: proxy.invalid_drop,
        dual_stack: proxy.dual_stack,
    })
}

/// An ambient pod's annotations → its say over its in-pod rules, as
/// Istio's agent reads them: a boolean Go cannot parse is ignored (logged)
/// rather than failing the pod, and the interface list is split on commas
/// with blanks dropped.
pub fn ambient_overrides(annotations: &BTreeMap<String, String>) -> PodOverrides {
    let flag = |key: &str| {
        let value = annotations.get(key)?;
        let parsed = go_bool(value);
        if parsed.is_none() {
            log::warn!("annotation {key}={value:?} is not a boolean; ignored");
        }
        parsed
    };
    PodOverrides {
        bypass_inbound: flag(BYPASS_INBOUND_CAPTURE).unwrap_or(false),
        dns_capture: flag(DNS_CAPTURE),
        virtual_interfaces: annotations
            .get(REROUTE_INTERFACES)
            .into_iter()
            .flat_map(|list| list.split(','))
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
            .collect(),
    }
}

/// Go's `strconv.ParseBool`, which Istio uses for inject flags and env.
pub fn go_bool(text: &str) -> Option<bool> {
    match text {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// A pod's annotations from `(key, value)` pairs, as the tests of this
/// module and of `pod` write them.
#[cfg(test)]
pub(crate) fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROXY: Proxy = Proxy {
        uid: 1337,
        gid: 1337,
        dns_capture: false,
        dual_stack: false,
        invalid_drop: false,
    };

    #[test]
    fn no_annotations_is_a_default_pod() {
        assert_eq!(
            redirect(&BTreeMap::new(), PROXY).expect("valid"),
            Redirect::default()
        );
    }

    #[test]
    fn inbound_exclusions_always_get_the_agent_ports() {
        let r = redirect(&ann(&[(EXCLUDE_INBOUND_PORTS, "8081,15020")]), PROXY).expect("valid");
        assert_eq!(r.exclude_inbound_ports, [8081, 15020, 15021, 15090]);
    }

    #[test]
    fn a_users_outbound_exclusion_replaces_15020() {
        let r = redirect(&ann(&[(EXCLUDE_OUTBOUND_PORTS, "3306,6379")]), PROXY).expect("valid");
        assert_eq!(r.exclude_outbound_ports, [3306, 6379]);
        let empty = redirect(&ann(&[(EXCLUDE_OUTBOUND_PORTS, "")]), PROXY).expect("valid");
        assert!(empty.exclude_outbound_ports.is_empty());
    }

    #[test]
    fn lists_modes_and_interfaces() {
        let r = redirect(
            &ann(&[
                (INTERCEPTION_MODE, "TPROXY"),
                (INCLUDE_OUTBOUND_CIDRS, "10.0.0.0/8, fd00::/8"),
                (EXCLUDE_OUTBOUND_CIDRS, "10.96.0.0/12"),
                (INCLUDE_INBOUND_PORTS, ""),
                (INCLUDE_OUTBOUND_PORTS, "443"),
                (EXCLUDE_INTERFACES, "eth9"),
                (KUBEVIRT_INTERFACES, "eth1"),
            ]),
            Proxy {
                uid: 0,
                gid: 0,
                ..PROXY
            },
        )
        .expect("valid");
        assert_eq!(r.mode, Mode::Tproxy);
        assert_eq!(
            r.include_cidrs,
            Selection::Only(vec![
                "10.0.0.0/8".parse().expect("c"),
                "fd00::/8".parse().expect("c")
            ])
        );
        assert_eq!(r.include_inbound_ports, Selection::Only(vec![]));
        assert!(!r.captures_inbound());
        assert_eq!(r.include_outbound_ports, [443]);
        assert_eq!(
            r.reroute_interfaces,
            ["eth1"],
            "the deprecated key counts when the new one is absent"
        );
        assert_eq!(
            (r.proxy_uid, r.proxy_gid),
            (1337, 1337),
            "root or unset means 1337"
        );
        let both = redirect(
            &ann(&[(REROUTE_INTERFACES, "eth2"), (KUBEVIRT_INTERFACES, "eth1")]),
            PROXY,
        )
        .expect("valid");
        assert_eq!(both.reroute_interfaces, ["eth2"]);
    }

    #[test]
    fn invalid_values_are_refused_with_the_annotation_named() {
        for (name, value) in [
            (INTERCEPTION_MODE, "NONE"),
            (INCLUDE_OUTBOUND_CIDRS, "10.0.0.0"),
            (INCLUDE_OUTBOUND_CIDRS, "nonsense/8"),
            (EXCLUDE_OUTBOUND_CIDRS, "*"),
            (EXCLUDE_INBOUND_PORTS, "80,x"),
            (INCLUDE_INBOUND_PORTS, "70000"),
            (EXCLUDE_OUTBOUND_PORTS, "0"),
            (EXCLUDE_INTERFACES, "a/b"),
        ] {
            let err = redirect(&ann(&[(name, value)]), PROXY).expect_err(name);
            assert!(err.starts_with(&format!("invalid annotation {name}=")), "{err}");
        }
    }

    #[test]
    fn static_settings_map_to_annotations() {
        let settings: BTreeMap<String, String> = [
            ("interceptionMode", "TPROXY"),
            ("excludeInboundPorts", "8081"),
            ("rerouteVirtualInterfaces", "eth1"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let mapped = from_static(&settings).expect("known keys");
        assert_eq!(mapped.get(INTERCEPTION_MODE).map(String::as_str), Some("TPROXY"));
        assert_eq!(mapped.get(REROUTE_INTERFACES).map(String::as_str), Some("eth1"));
        let unknown: BTreeMap<String, String> = [("bogus".to_owned(), "1".to_owned())].into();
        assert!(from_static(&unknown).is_err());
    }

    #[test]
    fn ambient_overrides_read_as_istio_reads_them() {
        assert_eq!(ambient_overrides(&ann(&[])), PodOverrides::default());
        let read = ambient_overrides(&ann(&[
            (BYPASS_INBOUND_CAPTURE, "True"),
            (DNS_CAPTURE, "0"),
            (REROUTE_INTERFACES, " eth1, ,net2,"),
        ]));
        assert!(read.bypass_inbound);
        assert_eq!(read.dns_capture, Some(false));
        assert_eq!(read.virtual_interfaces, ["eth1", "net2"]);
        let unparsable = ambient_overrides(&ann(&[(BYPASS_INBOUND_CAPTURE, "yes"), (DNS_CAPTURE, "on")]));
        assert_eq!(unparsable, PodOverrides::default());
    }

    #[test]
    fn go_booleans() {
        assert_eq!(go_bool("false"), Some(false));
        assert_eq!(go_bool("T"), Some(true));
        assert_eq!(go_bool("no"), None);
    }
}
