//! Command-line shape. Environment variables are cnitool's, so scripts
//! written for it keep working.

use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "cnictl",
    version,
    about = "Run CNI network configurations against network namespaces (cnitool-compatible)"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Verb,
}

#[derive(Debug, Args)]
pub struct Global {
    /// Directory of .conflist/.conf/.json network configurations.
    #[arg(long, global = true, env = "NETCONFPATH", default_value = "/etc/cni/net.d")]
    pub conf_dir: PathBuf,
    /// Colon-separated directories to find plugin binaries in.
    #[arg(long, global = true, env = "CNI_PATH", default_value = "/opt/cni/bin")]
    pub cni_path: String,
    /// libcni's cache directory; results live in <dir>/results.
    #[arg(long, global = true, default_value = libcni::cache::DEFAULT_CACHE_DIR)]
    pub cache_dir: PathBuf,
    /// Print raw JSON (the CNI result, or the CNI error) instead of a summary.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum Verb {
    /// Add the network to a namespace (ADD through the chain; rolled back with DEL on failure).
    Add(Attach),
    /// Check an attachment made by `add` (CHECK through the chain, cniVersion 0.4.0 and later).
    Check(Attach),
    /// Remove the network from a namespace (DEL in reverse order, with the cached result).
    Del(Attach),
    /// Ask every plugin whether it can take ADDs (cniVersion 1.1.0 and later).
    Status {
        /// Network name, as in the configuration's `name`.
        network: String,
    },
    /// Delete stale attachments of a network, then GC every plugin with the valid ones.
    Gc(Gc),
    /// Inspect or repair host-local's leases (through its lease service when one runs).
    Ipam(Ipam),
}

#[derive(Debug, Args)]
pub struct Ipam {
    /// host-local's dataDir.
    #[arg(long, global = true, default_value = ipam_config::lease_settings::DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// A lease service to ask before the data directory's own
    /// (<dataDir>/.sled/.service.sock), which is asked whenever one runs.
    #[arg(long, global = true, env = "HOST_LOCAL_SOCKET")]
    pub socket: Option<String>,
    #[command(subcommand)]
    pub command: IpamCommand,
}

#[derive(Debug, Subcommand)]
pub enum IpamCommand {
    /// List the leases: address, container ID, interface, when allocated.
    Ls { network: String },
    /// Release one address, or what a container (interface) holds.
    #[command(group(ArgGroup::new("what").required(true).args(["ip", "container_id"])))]
    Release {
        network: String,
        #[arg(long)]
        ip: Option<std::net::IpAddr>,
        #[arg(long)]
        container_id: Option<String>,
        #[arg(long, requires = "container_id")]
        ifname: Option<String>,
    },
    /// Release every lease whose attachment is not listed.
    Gc {
        network: String,
        /// Attachments still in use, as CONTAINER_ID/IFNAME.
        #[arg(long, required = true, num_args = 1.., value_name = "ID/IFNAME")]
        valid: Vec<String>,
    },
    /// Print every lease and the round-robin positions as JSON (a backup).
    Export { network: String },
    /// Import leases written by the reference host-local (files named by address).
    Import {
        network: String,
        #[arg(long, value_name = "DIR")]
        from_reference_dir: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct Attach {
    /// Network name, as in the configuration's `name`.
    pub network: String,
    /// Path of the network namespace (e.g. /var/run/netns/pod1).
    pub netns: PathBuf,
    /// Interface name inside the namespace.
    #[arg(short = 'i', long, env = "CNI_IFNAME", default_value = "eth0")]
    pub ifname: String,
    /// Container ID; by default cnitool's: "cnitool-" + 20 hex digits of sha512(netns path).
    #[arg(long)]
    pub container_id: Option<String>,
    /// CNI_ARGS pairs, K=V;K=V.
    #[arg(long, env = "CNI_ARGS", default_value = "")]
    pub args: String,
    /// Capability arguments as a JSON object, e.g. {"portMappings":[...]}.
    #[arg(long, env = "CAP_ARGS")]
    pub cap_args: Option<String>,
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("selector").required(true).args(["valid", "prune_missing_netns", "all"])))]
pub struct Gc {
    /// Network name, as in the configuration's `name`.
    pub network: String,
    /// Attachments still in use, as CONTAINER_ID/IFNAME; every other cached attachment is deleted.
    #[arg(long, num_args = 1.., value_name = "ID/IFNAME")]
    pub valid: Vec<String>,
    /// Valid = the cached attachments whose network namespace still exists.
    #[arg(long)]
    pub prune_missing_netns: bool,
    /// Nothing is valid: delete every cached attachment and release everything the plugins hold.
    #[arg(long)]
    pub all: bool,
}
