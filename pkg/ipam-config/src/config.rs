//! host-local's configuration: the reference plugin's keys, defaults,
//! checks and messages, plus where requested addresses come from.

use std::net::IpAddr;
use std::path::PathBuf;

use cni::conf::IpRequest;
use cni::keys::{self, Shape, field, plain};
use cni::result::{Dns, Route};
use cni::{CniArgs, NetConf, Version};
use serde::Deserialize;
use serde_json::Value;

use crate::Error;
use crate::range::{RangeConf, RangeSet};

use crate::lease_settings::{DEFAULT_DATA_DIR, SocketSetting};

/// The reference's `Range`: a range set's entries, and the legacy keys of
/// `ipam` itself (Go embeds it in `IPAMConfig`).
const RANGE: &[keys::Field] = &[
    plain("rangeStart"),
    plain("rangeEnd"),
    plain("subnet"),
    plain("gateway"),
];

/// The reference's `IPAMConfig`, and ours: `socket`.
pub const IPAM: keys::Field = field(
    "ipam",
    Shape::Struct(&[
        RANGE,
        &[
            plain("Name"),
            plain("type"),
            field("routes", Shape::List(&keys::ROUTE)),
            plain("dataDir"),
            plain("resolvConf"),
            field("ranges", Shape::List(&Shape::List(&Shape::Struct(&[RANGE])))),
            plain("socket"),
        ],
    ]),
);

/// `runtimeConfig.ipRanges`.
pub const IP_RANGES: keys::Field = field("ipRanges", Shape::List(&Shape::List(&Shape::Struct(&[RANGE]))));

/// host-local's configuration as the reference's `Net` decodes it, with
/// the keys every plugin shares.
pub const KEYS: Shape = Shape::Struct(&[
    keys::NET_CONF,
    &[
        IPAM,
        field("runtimeConfig", Shape::Struct(&[&[IP_RANGES, plain("ips")]])),
        field(
            "args",
            Shape::Struct(&[&[field("cni", Shape::Struct(&[&[plain("ips")]]))]]),
        ),
    ],
]);

/// The `ipam` section and the network keys host-local reads, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct IpamConfig {
    pub network: String,
    pub cni_version: Version,
    /// Runtime `ipRanges` first, then the legacy top-level range, then
    /// `ranges`, as the reference orders them.
    pub range_sets: Vec<RangeSet>,
    pub routes: Vec<Route>,
    pub data_dir: PathBuf,
    /// The lease service the operator named, if any (`socket`).
    pub socket: SocketSetting,
    pub resolv_conf: Option<PathBuf>,
    /// Requested addresses from the first source that names any.
    pub requested: Vec<IpAddr>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct IpamSection {
    #[serde(flatten)]
    legacy: RangeConf,
    #[serde(default)]
    ranges: Vec<Vec<RangeConf>>,
    #[serde(default)]
    routes: Vec<Route>,
    #[serde(default)]
    data_dir: String,
    #[serde(default)]
    resolv_conf: String,
    #[serde(default)]
    socket: Option<String>,
}

fn config_error(msg: impl Into<String>) -> Error {
    Error::Config(msg.into())
}

impl IpamConfig {
    /// Reads and checks the configuration. `cni_args` is CNI_ARGS, where
    /// host-local understands `IP` and, like Go's `LoadArgs`, refuses
    /// unknown keys unless `IgnoreUnknown` is set.
    pub fn load(conf: &NetConf, cni_args: &CniArgs) -> Result<Self, Error> {
        let section = match conf.raw().get("ipam") {
            None | Some(Value::Null) => return Err(config_error("IPAM config missing 'ipam' key")),
            Some(v) => IpamSection::deserialize(v)
                .map_err(|e| config_error(format!("invalid ipam configuration: {e}")))?,
        };

        let mut set_confs: Vec<Vec<RangeConf>> = conf
            .runtime_config
            .ip_ranges()
            .map_err(Error::Cni)?
            .into_iter()
            .map(|set| {
                set.into_iter()
                    .map(|r| RangeConf {
                        subnet: r.subnet,
                        range_start: r.range_start,
                        range_end: r.range_end,
                        gateway: r.gateway,
                    })
                    .collect()
            })
            .collect();
        if !section.legacy.subnet.is_empty() {
            set_confs.push(vec![section.legacy.clone()]);
        }
        set_confs.extend(section.ranges);
        if set_confs.is_empty() {
            return Err(config_error("no IP ranges specified"));
        }
        let range_sets = set_confs
            .iter()
            .enumerate()
            .map(|(i, set)| {
                RangeSet::from_conf(set).map_err(|e| config_error(format!("invalid range set {i}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;

        let v4_sets = range_sets.iter().filter(|s| s.is_v4()).count();
        if (v4_sets > 1 || range_sets.len() - v4_sets > 1) && conf.cni_version < Version::V0_3_0 {
            return Err(config_error(format!(
                "CNI version {} does not support more than 1 address per family",
                conf.cni_version
            )));
        }
        for (i, a) in range_sets.iter().enumerate() {
            if let Some(j) = range_sets[i + 1..].iter().position(|b| a.overlaps(b)) {
                return Err(config_error(format!("range set {i} overlaps with {}", i + j + 1)));
            }
        }

        Ok(IpamConfig {
            network: conf.name.clone(),
            cni_version: conf.cni_version,
            range_sets,
            routes: section.routes,
            data_dir: PathBuf::from(if section.data_dir.is_empty() {
                DEFAULT_DATA_DIR
            } else {
                &section.data_dir
            }),
            socket: SocketSetting::parse(section.socket.as_deref()),
            resolv_conf: (!section.resolv_conf.is_empty()).then(|| PathBuf::from(section.resolv_conf)),
            requested: requested_addresses(conf, cni_args)?,
        })
    }
}

/// CONVENTIONS order: `runtimeConfig.ips`, else `args.cni.ips`, else
/// CNI_ARGS `IP=` (a comma-separated list is accepted). The reference merges
/// all three; the first source that names any address wins here. A prefix
/// is ignored: the mask always comes from the range.
fn requested_addresses(conf: &NetConf, cni_args: &CniArgs) -> Result<Vec<IpAddr>, Error> {
    cni_args.expect_only(&["IP"]).map_err(Error::Cni)?;
    let from_runtime = conf.runtime_config.ips().map_err(Error::Cni)?;
    let from_args = conf.args.ips().map_err(Error::Cni)?;
    let from_env = match cni_args.get("IP") {
        None => Vec::new(),
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| IpRequest::parse(s).map_err(|_| config_error(format!("invalid IP {s:?} in CNI_ARGS"))))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let chosen = [from_runtime, from_args, from_env]
        .into_iter()
        .find(|ips| !ips.is_empty())
        .unwrap_or_default();
    let mut requested: Vec<IpAddr> = Vec::with_capacity(chosen.len());
    for ip in chosen.into_iter().map(|r| r.ip.to_canonical()) {
        if !requested.contains(&ip) {
            requested.push(ip);
        }
    }
    Ok(requested)
}

/// The reference's `parseResolvConf`: nameserver, domain, search and
/// options lines; comments and malformed lines are skipped.
pub fn parse_resolv_conf(text: &str) -> Dns {
    let mut dns = Dns::default();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 2 {
            continue;
        }
        let rest = fields[1..].iter().map(|s| (*s).to_owned());
        match fields[0] {
            "nameserver" => dns.nameservers.push(fields[1].to_owned()),
            "domain" => dns.domain = fields[1].to_owned(),
            "search" => dns.search.extend(rest),
            "options" => dns.options.extend(rest),
            _ => {}
        }
    }
    dns
}

#[cfg(test)]
mod tests {
    use crate::lease_settings::LeaseSettings;
    use serde_json::json;

    use super::*;

    fn net_conf(doc: Value) -> NetConf {
        NetConf::read(doc).expect("valid network conf")
    }

    fn load(doc: Value) -> Result<IpamConfig, Error> {
        IpamConfig::load(&net_conf(doc), &CniArgs::default())
    }

    fn load_err(doc: Value) -> String {
        load(doc).expect_err("invalid").to_string()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn defaults() {
        let c = load(
            json!({"cniVersion":"1.0.0","name":"net","ipam":{"type":"host-local","subnet":"10.1.0.0/16"}}),
        )
        .expect("valid");
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/cni/networks"));
        assert_eq!(c.range_sets.len(), 1);
        assert_eq!(c.range_sets[0].0[0].gateway, ip("10.1.0.1"));
        assert!(c.requested.is_empty() && c.routes.is_empty() && c.resolv_conf.is_none());
        assert_eq!(c.socket, SocketSetting::Unset);
    }

    #[test]
    fn runtime_ranges_then_legacy_then_ranges() {
        let c = load(json!({"cniVersion":"1.0.0","name":"net",
            "runtimeConfig":{"ipRanges":[[{"Subnet":"10.3.0.0/24","RangeStart":"","RangeEnd":"","Gateway":""}]]},
            "ipam":{"type":"host-local","subnet":"10.1.0.0/24","gateway":"10.1.0.254",
                    "ranges":[[{"subnet":"10.2.0.0/24"}],[{"subnet":"fd00::/64"}]],
                    "routes":[{"dst":"0.0.0.0/0"},{"dst":"192.168.0.0/16","gw":"10.1.0.254","priority":5}],
                    "dataDir":"/run/ipam","resolvConf":"/etc/resolv.conf","socket":""}}))
        .expect("valid");
        let subnets: Vec<String> = c.range_sets.iter().map(|s| s.0[0].subnet.to_string()).collect();
        assert_eq!(
            subnets,
            ["10.3.0.0/24", "10.1.0.0/24", "10.2.0.0/24", "fd00::/64"]
        );
        assert_eq!(c.range_sets[1].0[0].gateway, ip("10.1.0.254"));
        assert_eq!(c.routes[1].priority, 5);
        assert_eq!(c.data_dir, PathBuf::from("/run/ipam"));
        assert_eq!(c.socket, SocketSetting::Off);
    }

    #[test]
    fn configuration_errors_carry_the_reference_messages() {
        let base = |ipam: Value| json!({"cniVersion":"0.4.0","name":"net","ipam":ipam});
        assert_eq!(
            load_err(json!({"cniVersion":"0.4.0","name":"net"})),
            "IPAM config missing 'ipam' key"
        );
        assert_eq!(
            load_err(base(json!({"type":"host-local"}))),
            "no IP ranges specified"
        );
        assert_eq!(
            load_err(base(json!({"ranges":[[{"subnet":"10.0.0.0/31"}]]}))),
            "invalid range set 0: Network 10.0.0.0/31 too small to allocate from"
        );
        assert_eq!(
            load_err(base(
                json!({"ranges":[[{"subnet":"10.0.0.0/24"},{"subnet":"fd00::/64"}]]})
            )),
            "invalid range set 0: mixed address families"
        );
        assert_eq!(
            load_err(base(json!({"ranges":[[]]}))),
            "invalid range set 0: empty range set"
        );
        assert_eq!(
            load_err(base(
                json!({"ranges":[[{"subnet":"10.0.0.0/16"}],[{"subnet":"10.0.5.0/24"}]]})
            )),
            "range set 0 overlaps with 1"
        );
        assert_eq!(
            load_err(
                json!({"cniVersion":"0.2.0","name":"net","ipam":{"ranges":[[{"subnet":"10.0.0.0/24"}],[{"subnet":"10.1.0.0/24"}]]}})
            ),
            "CNI version 0.2.0 does not support more than 1 address per family"
        );
        assert!(load(json!({"cniVersion":"0.2.0","name":"net","ipam":{"ranges":[[{"subnet":"10.0.0.0/24"}],[{"subnet":"fd00::/64"}]]}})).is_ok(),
            "one address per family is fine before 0.3.0");
        assert!(
            load_err(base(json!({"subnet":"10.0.0.0/24","routes":[{"dst":"nope"}]})))
                .starts_with("invalid ipam configuration")
        );
    }

    #[test]
    fn requested_addresses_follow_conventions_precedence() {
        let doc = |runtime: Value, args: Value| {
            json!({"cniVersion":"1.0.0","name":"net","runtimeConfig":runtime,"args":{"cni":args},
                   "ipam":{"subnet":"10.0.0.0/24"}})
        };
        let requested = |doc: Value, env: &str| {
            IpamConfig::load(&net_conf(doc), &CniArgs::parse(env).expect("args")).map(|c| c.requested)
        };
        let all = doc(json!({"ips":["10.0.0.9/24"]}), json!({"ips":["10.0.0.8"]}));
        assert_eq!(requested(all, "IP=10.0.0.7").expect("valid"), [ip("10.0.0.9")]);
        let args_only = doc(json!({}), json!({"ips":["10.0.0.8"]}));
        assert_eq!(
            requested(args_only, "IP=10.0.0.7").expect("valid"),
            [ip("10.0.0.8")]
        );
        let env_only = doc(json!({}), json!({}));
        assert_eq!(
            requested(env_only.clone(), "IP=10.0.0.7,fd00::7").expect("valid"),
            [ip("10.0.0.7"), ip("fd00::7")]
        );
        let err = requested(env_only.clone(), "IP=10.0.0.7;K8S_POD_NAME=x").expect_err("unknown arg");
        assert!(err.to_string().contains("ARGS: unknown args"), "{err}");
        assert!(requested(env_only.clone(), "IgnoreUnknown=1;IP=10.0.0.7;K8S_POD_NAME=x").is_ok());
        assert!(requested(env_only, "IP=bogus").is_err());
    }

    #[test]
    fn every_key_reads_null_as_absent() {
        let range = |net: &str| {
            json!({"subnet": format!("{net}.0/24"), "rangeStart": format!("{net}.10"),
                   "rangeEnd": format!("{net}.20"), "gateway": format!("{net}.1")})
        };
        let route = json!({"dst": "0.0.0.0/0", "gw": "10.8.0.1", "mtu": 1400, "advmss": 1300,
                           "priority": 5, "table": 100, "scope": 0});
        let ipam = json!({"type": "host-local", "subnet": "10.8.0.0/24", "rangeStart": "10.8.0.10",
            "rangeEnd": "10.8.0.20", "gateway": "10.8.0.1", "Name": "n", "routes": [route],
            "dataDir": "/run/x", "resolvConf": "/etc/resolv.conf", "ranges": [[range("10.7.0")]],
            "socket": "/run/s.sock"});
        let doc = json!({"cniVersion": "1.0.0", "name": "net", "type": "host-local",
            "capabilities": {"ips": true, "ipRanges": true},
            "runtimeConfig": {"ipRanges": [[range("10.9.0")]], "ips": ["10.9.0.12"]},
            "args": {"cni": {"ips": ["10.9.0.13"]}}, "ipam": ipam});
        // What host-local reads: the lease path from stdin as it came, and
        // the configuration as the skeleton folds it.
        let args = CniArgs::parse("IgnoreUnknown=1;IP=10.9.0.14").expect("args");
        let loaded = |doc: &Value| {
            let settings = LeaseSettings::read(doc.to_string().as_bytes());
            let config = cni::skel::read_configuration(doc, &KEYS, |conf| {
                IpamConfig::load(conf, &args).map_err(|e| e.to_string())
            });
            (settings, config)
        };
        let whole = loaded(&doc).1;
        assert!(whole.starts_with("Ok((Ok(") && !whole.contains("Err("), "{whole}");
        cni::keys::assert_null_reads_as_absent(&doc, &KEYS, 30, loaded);
    }

    #[test]
    fn resolv_conf_is_parsed_like_the_reference() {
        let dns = parse_resolv_conf(
            "# comment\n; also\nnameserver 10.96.0.10\nnameserver fd00::10\ndomain example.com\n\
             search a.svc b.svc\noptions ndots:5 edns0\nbogus\n",
        );
        assert_eq!(dns.nameservers, ["10.96.0.10", "fd00::10"]);
        assert_eq!(dns.domain, "example.com");
        assert_eq!(dns.search, ["a.svc", "b.svc"]);
        assert_eq!(dns.options, ["ndots:5", "edns0"]);
    }
}
