//! This node's network configuration: the suite's bridge with host-local
//! over the node's pod CIDRs, then the chained plugins, written where the
//! runtime reads it. Run by the Node watch.

use std::path::{Path, PathBuf};

use ipnetwork::IpNetwork;
use serde_json::{Value, json};

use crate::cluster::node::Nodes;
use crate::error::Error;
use crate::health::Health;
use crate::metrics::{InstallResult, Metrics};
use crate::settings::Settings;
use crate::{changes, conf_dir};

/// What the file is made of besides the Nodes and the chained plugins.
#[derive(Debug, Clone)]
pub struct Options {
    /// This node's name: its Node's pod CIDRs are the file's.
    pub node_name: String,
    /// Where the file is written (`CNI_CONF_DIR`/`CNI_CONF_NAME`).
    pub path: PathBuf,
    /// The network's name in it.
    pub network_name: String,
    /// The pods' bridge.
    pub bridge: String,
    /// host-local's `dataDir`.
    pub lease_dir: PathBuf,
    /// Where the runtime finds plugins (whether portmap is installed).
    pub cni_bin_dir: PathBuf,
    /// The agent's socket for the plugins' log records
    /// (`PLUGIN_LOG_SOCKET`), named in every entry.
    pub log_socket: Option<PathBuf>,
    /// The agent's NetworkPolicy gate (`POLICY_SOCKET` when it enforces
    /// policy), named in the bridge's entry.
    pub policy_socket: Option<PathBuf>,
}

impl Options {
    pub fn from_settings(settings: &Settings) -> Options {
        Options {
            node_name: settings.node_name.clone(),
            path: settings.conflist_path(),
            network_name: settings.network_name.clone(),
            bridge: settings.bridge.clone(),
            lease_dir: settings.lease_dir.clone(),
            cni_bin_dir: settings.cni_bin_dir.clone(),
            log_socket: settings.plugin_log_socket(),
            policy_socket: settings.policy_socket(),
        }
    }
}

/// The conflist controller: its options, the plugins chained after the
/// bridge and where it counts its writes.
#[derive(Debug)]
pub struct Conflist {
    options: Options,
    chained: Chain,
    metrics: Metrics,
}

impl Conflist {
    pub fn new(options: Options, chained: Chain, metrics: Metrics) -> Conflist {
        Conflist {
            options,
            chained,
            metrics,
        }
    }

    /// Writes this node's configuration if its content changed; a failure
    /// is logged and counted (as Istio's installer counts a configuration
    /// it could not write), and the agent is not ready until a run
    /// succeeds.
    pub async fn run(&self, nodes: &Nodes, health: &Health) {
        if let Err(e) = self.write_own(nodes, health).await {
            log::error!("{e}");
            self.metrics.installed(InstallResult::CreateCniConfigFailure);
            health.set_configured(false);
        }
    }

    /// Writes this node's configuration if its content changed.
    async fn write_own(&self, nodes: &Nodes, health: &Health) -> Result<(), Error> {
        let options = &self.options;
        let Some(own) = nodes.get(&options.node_name) else {
            health.set_configured(false);
            log::warn!(
                "node {} is not among the Nodes; waiting for it",
                options.node_name
            );
            return Ok(());
        };
        if own.pod_cidrs.is_empty() {
            health.set_configured(false);
            log::warn!("node {} has no pod CIDR yet; waiting for one", own.name);
            return Ok(());
        }
        let internal_ips = own.internal_ips.clone();
        let mtu = changes::blocking(move || Ok(uplink_mtu(&internal_ips))).await?;
        let network = NodeNetwork {
            pod_cidrs: own.pod_cidrs.clone(),
            mtu,
        };
        let content = render(options, &network, &self.chained.plugins(&options.cni_bin_dir));
        let path = &options.path;
        if conf_dir::write_if_changed(path, &content)? {
            self.metrics.conflist_written();
            log::info!(
                "wrote {} for pod CIDRs {:?}, MTU {mtu}",
                path.display(),
                network
                    .pod_cidrs
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
            );
        }
        health.set_configured(true);
        Ok(())
    }
}

/// Removes the agent's conflist; whether there was one of its own.
pub fn remove(options: &Options) -> bool {
    let path = &options.path;
    match remove_own(path, &options.network_name) {
        Ok(true) => {
            log::info!("removed {}", path.display());
            true
        }
        Ok(false) => false,
        Err(e) => {
            log::error!("{e}");
            false
        }
    }
}

/// What the file says, from the node's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeNetwork {
    pub pod_cidrs: Vec<IpNetwork>,
    pub mtu: u32,
}

/// The configuration list. The bridge masquerades nothing: traffic
/// between pods of different nodes keeps its source address, and what
/// leaves the cluster is the agent's own rule set's to masquerade.
pub fn render(options: &Options, network: &NodeNetwork, chained: &[Value]) -> Value {
    let ranges: Vec<Value> = network
        .pod_cidrs
        .iter()
        .map(|cidr| json!([{"subnet": cidr.to_string()}]))
        .collect();
    let routes: Vec<Value> = network
        .pod_cidrs
        .iter()
        .map(|cidr| match cidr {
            IpNetwork::V4(_) => json!({"dst": "0.0.0.0/0"}),
            IpNetwork::V6(_) => json!({"dst": "::/0"}),
        })
        .collect();
    let mut bridge = json!({
        "type": "bridge",
        "bridge": options.bridge,
        "isGateway": true,
        "ipMasq": false,
        "hairpinMode": true,
        "mtu": network.mtu,
        "ipam": {
            "type": "host-local",
            "ranges": ranges,
            "routes": routes,
            "dataDir": options.lease_dir,
        },
    });
    if let Some(socket) = &options.policy_socket {
        bridge[cni::conf::POLICY_SOCKET_KEY] = json!(socket);
    }
    let mut plugins = vec![bridge];
    plugins.extend(chained.iter().cloned());
    if let Some(socket) = &options.log_socket {
        for plugin in &mut plugins {
            conf_dir::with_log_socket(plugin, socket);
        }
    }
    json!({
        "cniVersion": "1.0.0",
        "name": options.network_name,
        "plugins": plugins,
    })
}

/// The plugins chained after the bridge: `CNI_CHAINED_PLUGINS` when set,
/// else `portmap` when the bin directory has one; then Istio's entry when
/// the agent chains it. Decided at every write from what is installed, not
/// once at the start: the first conflist of a fresh node then names the
/// portmap the agent has just installed, and a restart changes nothing.
#[derive(Debug, Clone)]
pub struct Chain {
    configured: Option<Vec<Value>>,
    istio: Option<Value>,
}

impl Chain {
    /// Checks `CNI_CHAINED_PLUGINS` (a wrong one fails the start before
    /// anything is changed).
    pub fn new(chained_plugins: Option<&str>, istio: Option<Value>) -> Result<Chain, Error> {
        let configured = match chained_plugins {
            None => None,
            Some(text) => {
                let value: Value = serde_json::from_str(text)
                    .map_err(|e| Error::Setting(format!("CNI_CHAINED_PLUGINS is not JSON: {e}")))?;
                match value {
                    Value::Array(plugins) if plugins.iter().all(|p| p["type"].is_string()) => Some(plugins),
                    _ => {
                        return Err(Error::Setting(
                            "CNI_CHAINED_PLUGINS must be an array of plugin configurations, each with a \"type\""
                                .into(),
                        ));
                    }
                }
            }
        };
        Ok(Chain { configured, istio })
    }

    /// The plugins after the bridge, given what `bin_dir` holds now.
    pub fn plugins(&self, bin_dir: &Path) -> Vec<Value> {
        let mut plugins = match &self.configured {
            Some(plugins) => plugins.clone(),
            None if bin_dir.join("portmap").is_file() => vec![json!({
                "type": "portmap",
                "capabilities": {"portMappings": true},
            })],
            None => Vec::new(),
        };
        plugins.extend(self.istio.clone());
        plugins
    }
}

/// Removes `path` if it holds what this agent writes (the network named
/// `network_name` with the suite's bridge first): never an operator's file.
pub fn remove_own(path: &Path, network_name: &str) -> Result<bool, Error> {
    let Ok(text) = crate::atomic::read_text(path) else {
        return Ok(false);
    };
    let ours = serde_json::from_str::<Value>(&text)
        .is_ok_and(|v| v["name"] == network_name && v["plugins"][0]["type"] == "bridge");
    if !ours {
        return Ok(false);
    }
    std::fs::remove_file(path).map_err(|e| Error::file("remove", path, e))?;
    Ok(true)
}

/// Deletes the pods' bridge the conflist named (made by the bridge plugin
/// on the node's first pod) once no link is its port; true when it did.
/// One with ports is left: pods still use it.
pub fn remove_bridge_if_unused(name: &str) -> Result<bool, Error> {
    let failed = |source: netlink::Error| Error::Bridge {
        name: name.to_owned(),
        source,
    };
    let nl = netlink::Netlink::connect().map_err(failed)?;
    let Some(bridge) = nl.link_by_name(name).map_err(failed)? else {
        return Ok(false);
    };
    if bridge.kind != "bridge" {
        return Ok(false);
    }
    let ports = nl
        .links()
        .map_err(failed)?
        .iter()
        .filter(|link| link.master == Some(bridge.index))
        .count();
    if ports > 0 {
        log::warn!("bridge {name} still has {ports} ports: kept");
        return Ok(false);
    }
    nl.delete_link(&bridge).map_err(failed)?;
    Ok(true)
}

/// The MTU pods get: the uplink's, the link holding one of the node's
/// addresses (`internal_ips`), else the one of the default route, else
/// 1500.
pub fn uplink_mtu(internal_ips: &[std::net::IpAddr]) -> u32 {
    let Ok(nl) = netlink::Netlink::connect() else {
        return 1500;
    };
    let by_address = nl.all_addresses().ok().and_then(|addresses| {
        addresses
            .iter()
            .find(|(_, address)| internal_ips.contains(&address.ip()))
            .map(|(index, _)| *index)
    });
    let by_default_route = || {
        nl.routes(true).ok().and_then(|routes| {
            routes
                .iter()
                .find(|r| r.dst.prefix() == 0 && r.table == netlink::route::MAIN_TABLE)
                .and_then(|r| r.oif)
        })
    };
    by_address
        .or_else(by_default_route)
        .and_then(|index| nl.link_by_index(index).ok().flatten())
        .map_or(1500, |link| link.mtu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conf_dir::write_if_changed;
    use clap::Parser;

    fn settings(extra: &[&str]) -> Settings {
        let mut args = vec![
            "cni-node-agent",
            "--node-name",
            "n1",
            "--cni-bin-dir",
            "/nonexistent",
        ];
        args.extend_from_slice(extra);
        Settings::parse_from(args)
    }

    #[test]
    fn dual_stack_gets_a_range_set_and_a_default_route_per_family() {
        let network = NodeNetwork {
            pod_cidrs: vec![
                "10.244.1.0/24".parse().expect("v4"),
                "fd00:10:244:1::/64".parse().expect("v6"),
            ],
            mtu: 1450,
        };
        let conf = render(
            &Options::from_settings(&settings(&[])),
            &network,
            &[json!({"type": "portmap"})],
        );
        assert_eq!(conf["name"], "cni-suite");
        let bridge = &conf["plugins"][0];
        assert_eq!(bridge["ipMasq"], false);
        assert_eq!(bridge["mtu"], 1450);
        assert_eq!(
            bridge["ipam"]["ranges"],
            json!([[{"subnet": "10.244.1.0/24"}], [{"subnet": "fd00:10:244:1::/64"}]])
        );
        assert_eq!(
            bridge["ipam"]["routes"],
            json!([{"dst": "0.0.0.0/0"}, {"dst": "::/0"}])
        );
        assert_eq!(bridge["ipam"]["dataDir"], "/run/cni-suite/ipam");
        assert_eq!(conf["plugins"][1]["type"], "portmap");
        assert_eq!(bridge["policySocket"], "/run/cni-suite/policy.sock");
        assert!(
            conf["plugins"][1].get("policySocket").is_none(),
            "the bridge's alone"
        );
        let open = render(
            &Options::from_settings(&settings(&["--network-policy", "false"])),
            &network,
            &[],
        );
        assert!(open["plugins"][0].get("policySocket").is_none());
    }

    #[test]
    fn every_entry_names_the_log_socket_unless_it_names_its_own() {
        let network = NodeNetwork {
            pod_cidrs: vec!["10.244.1.0/24".parse().expect("v4")],
            mtu: 1500,
        };
        let chained = [
            json!({"type": "portmap"}),
            json!({"type": "bandwidth", "logSocket": ""}),
            json!({"type": "istio-redirect", "logSocket": "/elsewhere.sock"}),
        ];
        let conf = render(&Options::from_settings(&settings(&[])), &network, &chained);
        let sockets: Vec<&Value> = conf["plugins"]
            .as_array()
            .expect("plugins")
            .iter()
            .map(|p| &p["logSocket"])
            .collect();
        assert_eq!(
            sockets,
            [
                "/run/cni-suite/log.sock",
                "/run/cni-suite/log.sock",
                "",
                "/elsewhere.sock"
            ]
        );
        assert!(
            conf["plugins"][0]["ipam"].get("logSocket").is_none(),
            "host-local reads the bridge's"
        );
        let none = render(
            &Options::from_settings(&settings(&["--plugin-log-socket", ""])),
            &network,
            &chained[..1],
        );
        assert!(none["plugins"][0].get("logSocket").is_none());
        assert!(none["plugins"][1].get("logSocket").is_none());
    }

    #[test]
    fn chained_plugins_must_each_name_a_type() {
        let bin = tempfile::tempdir().expect("tempdir");
        let unset = Chain::new(settings(&[]).chained_plugins.as_deref(), None).expect("unset");
        assert!(unset.plugins(bin.path()).is_empty());
        let set = settings(&["--chained-plugins", r#"[{"type":"portmap","snat":true}]"#]);
        assert_eq!(
            Chain::new(set.chained_plugins.as_deref(), None)
                .expect("set")
                .plugins(bin.path())[0]["snat"],
            true
        );
        for bad in ["{}", "[{}]", "not json", r#"[{"type":1}]"#] {
            assert!(
                Chain::new(
                    settings(&["--chained-plugins", bad]).chained_plugins.as_deref(),
                    None
                )
                .is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn portmap_is_chained_once_it_is_installed_and_istio_last() {
        let bin = tempfile::tempdir().expect("tempdir");
        let istio = json!({"type": "istio-redirect"});
        let chain = Chain::new(settings(&[]).chained_plugins.as_deref(), Some(istio.clone())).expect("chain");
        assert_eq!(chain.plugins(bin.path()), std::slice::from_ref(&istio));
        std::fs::write(bin.path().join("portmap"), "installed").expect("install");
        let types: Vec<Value> = chain
            .plugins(bin.path())
            .iter()
            .map(|p| p["type"].clone())
            .collect();
        assert_eq!(types, ["portmap", "istio-redirect"]);
    }

    #[test]
    fn a_write_replaces_whole_files_and_only_when_they_change() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("net.d/10-x.conflist");
        let first = json!({"name": "cni-suite", "plugins": [{"type": "bridge"}]});
        assert!(write_if_changed(&path, &first).expect("write"));
        assert!(!write_if_changed(&path, &first).expect("same"));
        let second = json!({"name": "cni-suite", "plugins": [{"type": "bridge", "mtu": 1400}]});
        assert!(write_if_changed(&path, &second).expect("changed"));
        let names: Vec<_> = std::fs::read_dir(path.parent().expect("dir"))
            .expect("ls")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "no temporary file left: {names:?}");
        assert!(!remove_own(&path, "another").expect("not ours"));
        assert!(path.exists());
        assert!(remove_own(&path, "cni-suite").expect("ours"));
        assert!(!path.exists());
    }
}
