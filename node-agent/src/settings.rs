//! What the agent is told: command-line flags, each also read from the
//! environment a DaemonSet sets, and the modes they choose between. At
//! the bottom of the crate: it imports nothing of it. Each controller
//! takes from it only what it needs, as its `Options`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::Parser;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "cni-node-agent",
    version,
    about = "Writes this node's CNI configuration from its Node object and keeps it current"
)]
pub struct Settings {
    /// This node's name (the downward API's spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// Where the runtime reads network configurations.
    #[arg(long, env = "CNI_CONF_DIR", default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,

    /// The file written there.
    #[arg(long, env = "CNI_CONF_NAME", default_value = "10-cni-suite.conflist")]
    pub conflist_name: String,

    /// The network's name in that file.
    #[arg(long, env = "CNI_NETWORK_NAME", default_value = "cni-suite")]
    pub network_name: String,

    /// The node's bridge for pods.
    #[arg(long, env = "CNI_BRIDGE", default_value = "cni0")]
    pub bridge: String,

    /// Where host-local keeps the leases: under /run, so a reboot frees
    /// every lease (on disk, leases of pods gone with the reboot stay).
    #[arg(long, env = "CNI_LEASE_DIR", default_value = "/run/cni-suite/ipam")]
    pub lease_dir: PathBuf,

    /// Plugins chained after the bridge, as a JSON array of plugin
    /// configurations; unset: `portmap` when the CNI bin directory has one.
    #[arg(long, env = "CNI_CHAINED_PLUGINS")]
    pub chained_plugins: Option<String>,

    /// Where the runtime finds plugin binaries.
    #[arg(long, env = "CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,

    /// Where the suite's binaries are in the agent's image; unset: the
    /// directory of the agent's own executable.
    #[arg(long, env = "CNI_SOURCE_BIN_DIR")]
    pub source_bin_dir: Option<PathBuf>,

    /// The plugins installed from there into the CNI bin directory
    /// (comma-separated; empty: install nothing); unset: the whole suite,
    /// or istio-redirect alone with OWN_NETWORK=false.
    #[arg(long, env = "CNI_INSTALL_PLUGINS", value_delimiter = ',')]
    pub install_plugins: Option<Vec<String>>,

    /// Whether the agent is the cluster's network: its conflist from the
    /// Node's pod CIDRs, the routes between nodes, the masquerade and the
    /// lease service. false: Istio's CNI only, beside whatever network the
    /// node has (needs ISTIO_CHAINED): istio-redirect chained into that
    /// network's configuration, nothing else of the node changed.
    #[arg(long, env = "OWN_NETWORK", default_value_t = true, action = clap::ArgAction::Set)]
    pub own_network: bool,

    /// The cluster's pod range: traffic from this node's pods to it keeps
    /// its source address, the rest is masqueraded (comma-separated CIDRs;
    /// unset: every Node's pod CIDRs, merged into the fewest prefixes that
    /// hold exactly them).
    #[arg(long, env = "CLUSTER_CIDRS", value_delimiter = ',')]
    pub cluster_cidrs: Vec<ipnetwork::IpNetwork>,

    /// Run host-local's lease service for the lease directory, so no ADD
    /// waits for one to start.
    #[arg(long, env = "LEASE_SERVICE", default_value_t = true, action = clap::ArgAction::Set)]
    pub lease_service: bool,

    /// Enforce the cluster's NetworkPolicies for this node's pods, in the
    /// kernel (with OWN_NETWORK: Istio's CNI alone enforces none).
    #[arg(long, env = "NETWORK_POLICY", default_value_t = true, action = clap::ArgAction::Set)]
    pub network_policy: bool,

    /// Which iptables the rules go through when the agent's image carries
    /// both (`auto`: the node's kubelet's, see `iptables_mode`).
    #[arg(long, env = "IPTABLES_MODE", value_enum, default_value = "auto")]
    pub iptables_mode: IptablesMode,

    /// Istio's chained install: istio-redirect appended last to the node's
    /// primary configuration, and put back when another agent rewrites it.
    #[arg(long, env = "ISTIO_CHAINED")]
    pub istio_chained: bool,

    /// The primary configuration's file name in the CNI conf directory;
    /// unset: the first valid `.conf`/`.conflist` in name order.
    #[arg(long, env = "ISTIO_CNI_CONF_FILE")]
    pub istio_cni_conf_file: Option<String>,

    /// Istio's owned configuration (`istioOwnedCNIConfig`): instead of
    /// editing the primary configuration, write a file of the agent's own
    /// that sorts first, holding the primary's plugins and istio-redirect
    /// (with OWN_NETWORK=false).
    #[arg(long, env = "ISTIO_OWNED_CNI_CONFIG")]
    pub istio_owned_cni_config: bool,

    /// That file's name in the CNI conf directory.
    #[arg(
        long,
        env = "ISTIO_OWNED_CNI_CONF_FILENAME",
        default_value = "02-istio-cni.conflist"
    )]
    pub istio_owned_cni_conf_filename: String,

    /// istio-redirect's entry, as a JSON object; unset: the pod
    /// annotations capability, skipping kube-system and istio-system.
    #[arg(long, env = "ISTIO_PLUGIN_CONFIG")]
    pub istio_plugin_config: Option<String>,

    /// Istio's ambient mode (Istio's `AMBIENT_ENABLED`; needs
    /// ISTIO_CHAINED): istio-redirect's entry gets `ambient_enabled` (and,
    /// unless it names one, `cni_agent_run_dir`: the kubeconfig's
    /// directory), and the agent serves enrolled pods' events there and
    /// ztunnel at ZTUNNEL_UDS_ADDRESS. An entry of ISTIO_PLUGIN_CONFIG that
    /// enables ambient mode itself turns it on as well.
    #[arg(long, env = "AMBIENT_ENABLED")]
    pub ambient_enabled: bool,

    /// Istio's native nftables (Istio's `NATIVE_NFTABLES`; with
    /// ISTIO_CHAINED): istio-redirect's entry gets `native_nftables`
    /// unless it says otherwise, so sidecar pods' capture is in Istio's
    /// `inet istio-proxy-*` tables, and in ambient mode enrolled pods' rules
    /// in `inet istio-ambient-*` and the node's probe rule in `inet
    /// istio-ambient-nat`. The entry's own `native_nftables` decides both.
    #[arg(long, env = "NATIVE_NFTABLES")]
    pub native_nftables: bool,

    /// The ZDS socket ztunnel connects to (ztunnel's `INPOD_UDS`).
    #[arg(
        long,
        env = "ZTUNNEL_UDS_ADDRESS",
        default_value = "/var/run/ztunnel/ztunnel.sock"
    )]
    pub ztunnel_uds_address: PathBuf,

    /// In ambient mode, enrolled pods' DNS to ztunnel's proxy unless a pod
    /// says otherwise (`ambient.istio.io/dns-capture`).
    #[arg(long, env = "AMBIENT_DNS_CAPTURE", default_value_t = true, action = clap::ArgAction::Set)]
    pub ambient_dns_capture: bool,

    /// In ambient mode, IPv6 rules too for pods with IPv6 addresses.
    #[arg(long, env = "AMBIENT_IPV6", default_value_t = true, action = clap::ArgAction::Set)]
    pub ambient_ipv6: bool,

    /// The kubeconfig written for istio-redirect (0600, kept current with
    /// the service account's token and CA); its entry names it. The
    /// default is under the DaemonSet's /run/cni-suite mount.
    #[arg(
        long,
        env = "ISTIO_KUBECONFIG",
        default_value = "/run/cni-suite/istio/istio-cni-kubeconfig"
    )]
    pub istio_kubeconfig: PathBuf,

    /// With ISTIO_CHAINED, what is done with this node's injected pods
    /// whose validation init container failed because they started before
    /// the plugin was chained: program their capture where they run
    /// (needs SYS_ADMIN and SYS_PTRACE), delete them, or label them.
    #[arg(long, env = "ISTIO_REPAIR", value_enum, default_value = "repair")]
    pub istio_repair: RepairMode,

    /// The init container that validates the capture.
    #[arg(long, env = "ISTIO_REPAIR_INIT_CONTAINER", default_value = "istio-validation")]
    pub istio_repair_init_container: String,

    /// Its exit code when the capture is missing (0: any).
    #[arg(long, env = "ISTIO_REPAIR_EXIT_CODE", default_value_t = 126)]
    pub istio_repair_exit_code: i32,

    /// Its termination message when the capture is missing (empty: any).
    #[arg(long, env = "ISTIO_REPAIR_TERMINATION_MESSAGE", default_value = "")]
    pub istio_repair_termination_message: String,

    /// The label `ISTIO_REPAIR=label` sets, as key=value.
    #[arg(
        long,
        env = "ISTIO_REPAIR_LABEL",
        default_value = "cni.istio.io/uninitialized=true"
    )]
    pub istio_repair_label: String,

    /// The service account the kubelet mounts (token, ca.crt, namespace).
    #[arg(
        long,
        env = "SERVICE_ACCOUNT_DIR",
        default_value = "/var/run/secrets/kubernetes.io/serviceaccount"
    )]
    pub service_account_dir: PathBuf,

    /// Where `/healthz`, `/readyz` and `/metrics` answer (`[::]`: IPv6 and
    /// IPv4, or IPv4 alone on a kernel without IPv6).
    #[arg(long, env = "HEALTH_LISTEN", default_value = "[::]:9470")]
    pub health_listen: SocketAddr,

    /// A readiness taint the node's kubelet registers it with (Istio's is
    /// `cni.istio.io/not-ready`): removed from this node's Node once the
    /// agent is ready, never before, and put back while it stays not
    /// ready. Unset: no Node is changed.
    #[arg(long, env = "READINESS_TAINT")]
    pub readiness_taint: Option<String>,

    /// On SIGTERM, remove everything the agent put on the node.
    #[arg(long, env = "UNINSTALL_ON_STOP")]
    pub uninstall_on_stop: bool,

    /// The Unix datagram socket the agent reads the plugins' log records
    /// from, named as `logSocket` in every entry it writes (under the
    /// DaemonSet's /run/cni-suite mount: the host's path, which the
    /// plugins see); empty: none.
    #[arg(long, env = "PLUGIN_LOG_SOCKET", default_value = "/run/cni-suite/log.sock")]
    pub plugin_log_socket: String,

    /// With NETWORK_POLICY, the Unix stream socket a pod's ADD waits on
    /// until the agent holds the pod's policy in the kernel, named as
    /// `policySocket` in the bridge's entry (under the DaemonSet's
    /// /run/cni-suite mount); empty: no ADD waits, and a new pod is open
    /// until its address reaches the agent through the API server.
    #[arg(long, env = "POLICY_SOCKET", default_value = "/run/cni-suite/policy.sock")]
    pub policy_socket: String,
}

/// Which iptables the rules go through (`IPTABLES_MODE`; see
/// `iptables_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IptablesMode {
    Auto,
    Nft,
    Legacy,
}

/// What is done with a broken pod (`ISTIO_REPAIR`; see `controllers::repair`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RepairMode {
    /// Program its capture where it runs (Istio's default).
    Repair,
    /// Delete it (UID and resourceVersion preconditions).
    Delete,
    /// Label it through the `pods/status` subresource.
    Label,
    /// Nothing.
    Off,
}

/// The plugins the agent installs when CNI_INSTALL_PLUGINS is unset: the
/// suite for its own network, else only Istio's (a node's other network
/// keeps its own host-local, portmap and the rest).
const SUITE_PLUGINS: [&str; 6] = [
    "bridge",
    "host-local",
    "loopback",
    "istio-redirect",
    "portmap",
    "firewall",
];
const ISTIO_ONLY_PLUGINS: [&str; 1] = ["istio-redirect"];

impl Settings {
    /// The plugins to install, without empty entries
    /// (`CNI_INSTALL_PLUGINS=""` installs nothing).
    pub fn plugins_to_install(&self) -> Vec<String> {
        match &self.install_plugins {
            Some(named) => named
                .iter()
                .map(|name| name.trim().to_owned())
                .filter(|name| !name.is_empty())
                .collect(),
            None if self.own_network => SUITE_PLUGINS.map(String::from).to_vec(),
            None => ISTIO_ONLY_PLUGINS.map(String::from).to_vec(),
        }
    }

    /// Settings that contradict each other, found before anything changes.
    pub fn check(&self) -> Result<(), String> {
        if !self.own_network && !self.istio_chained {
            return Err("OWN_NETWORK=false runs Istio's CNI only: it needs ISTIO_CHAINED=true".into());
        }
        if self.istio_owned_cni_config && self.own_network {
            return Err(
                "ISTIO_OWNED_CNI_CONFIG is for OWN_NETWORK=false: the suite's own conflist carries \
                 istio-redirect already"
                    .into(),
            );
        }
        if self.istio_owned_cni_config && !self.istio_chained {
            return Err("ISTIO_OWNED_CNI_CONFIG needs ISTIO_CHAINED=true".into());
        }
        if self.ambient_enabled && !self.istio_chained {
            return Err("AMBIENT_ENABLED needs ISTIO_CHAINED=true: ambient mode is Istio's CNI".into());
        }
        let owned = &self.istio_owned_cni_conf_filename;
        if self.istio_owned_cni_config
            && (owned.contains('/') || !owned.ends_with(".conflist") || owned.starts_with('.'))
        {
            return Err(format!(
                "ISTIO_OWNED_CNI_CONF_FILENAME {owned:?} must be a file name ending in .conflist"
            ));
        }
        for (name, value) in [
            ("PLUGIN_LOG_SOCKET", &self.plugin_log_socket),
            ("POLICY_SOCKET", &self.policy_socket),
            (
                "ZTUNNEL_UDS_ADDRESS",
                &self.ztunnel_uds_address.to_string_lossy().into_owned(),
            ),
        ] {
            if !value.is_empty() && !Path::new(value).is_absolute() {
                return Err(format!(
                    "{name} {value:?} must be an absolute path: plugins run from elsewhere"
                ));
            }
        }
        Ok(())
    }

    /// `POLICY_SOCKET` when the agent enforces NetworkPolicy, unless empty.
    pub fn policy_socket(&self) -> Option<PathBuf> {
        (self.own_network && self.network_policy && !self.policy_socket.is_empty())
            .then(|| PathBuf::from(&self.policy_socket))
    }

    /// `PLUGIN_LOG_SOCKET`, unless empty.
    pub fn plugin_log_socket(&self) -> Option<PathBuf> {
        (!self.plugin_log_socket.is_empty()).then(|| PathBuf::from(&self.plugin_log_socket))
    }

    pub fn conflist_path(&self) -> PathBuf {
        self.cni_conf_dir.join(&self.conflist_name)
    }

    /// Where the agent's own binaries are (what it installs, and `cnictl`):
    /// `CNI_SOURCE_BIN_DIR`, else the directory of its executable; None
    /// when neither tells (see [`crate::error::Error::NoSourceDir`]).
    pub fn source_dir(&self) -> Option<PathBuf> {
        if let Some(dir) = &self.source_bin_dir {
            return Some(dir.clone());
        }
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(PathBuf::from))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(extra: &[&str]) -> Settings {
        let mut args = vec!["cni-node-agent", "--node-name", "n1"];
        args.extend_from_slice(extra);
        Settings::parse_from(args)
    }

    #[test]
    fn the_plugins_log_socket_is_the_run_directorys_unless_emptied() {
        assert_eq!(
            settings(&[]).plugin_log_socket(),
            Some(PathBuf::from("/run/cni-suite/log.sock"))
        );
        assert_eq!(settings(&["--plugin-log-socket", ""]).plugin_log_socket(), None);
        assert!(settings(&["--plugin-log-socket", ""]).check().is_ok());
        let relative = settings(&["--plugin-log-socket", "log.sock"]);
        assert!(relative.check().is_err());
    }

    #[test]
    fn the_policy_socket_is_named_only_where_policy_is_enforced() {
        assert_eq!(
            settings(&[]).policy_socket(),
            Some(PathBuf::from("/run/cni-suite/policy.sock"))
        );
        assert_eq!(settings(&["--network-policy", "false"]).policy_socket(), None);
        assert_eq!(settings(&["--own-network", "false"]).policy_socket(), None);
        assert_eq!(settings(&["--policy-socket", ""]).policy_socket(), None);
        assert!(settings(&["--policy-socket", "policy.sock"]).check().is_err());
    }
}
