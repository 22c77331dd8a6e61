//! host-local's checks of an invocation that need no lease: the
//! configuration and CNI_ARGS, the network's name as the file name it
//! becomes, requested addresses against the ranges, resolvConf, prevResult,
//! GC's list of attachments, and where the store's directories are or
//! would be made. A call they refuse changes nothing on the node: no lease
//! service is started or asked, no directory is made.
//!
//! The verbs run them first wherever they run (a plugin process, a lease
//! service); the plugin process and the bridge run [`before_store`] before
//! a request goes along the lease path ([`crate::client`]).

use std::net::IpAddr;

use cni::conf::GcAttachment;
use cni::result::Dns;
use cni::{Command, Error, Request, Result};

use cni::small_file::Links;

use crate::config::{IpamConfig, parse_resolv_conf};
use crate::paths::Paths;
use crate::range::place_requested;

/// The configuration, its network's name checked as the file name it
/// becomes under the data directory.
pub fn configuration(req: &Request) -> Result<IpamConfig> {
    let cfg = IpamConfig::load(&req.conf, &req.env.args()?)?;
    Paths::new(&cfg.data_dir, &cfg.network)?;
    Ok(cfg)
}

/// An ADD that may go to the store.
#[derive(Debug)]
pub struct Add {
    pub cfg: IpamConfig,
    pub dns: Dns,
}

/// ADD: the configuration, resolvConf read (as the reference reads it,
/// before any lease), and the requested addresses placed in the ranges.
pub fn add(req: &Request) -> Result<Add> {
    let cfg = configuration(req)?;
    let dns = match &cfg.resolv_conf {
        // A FIFO put there must not hold the ADD.
        Some(path) => parse_resolv_conf(&String::from_utf8_lossy(
            &cni::small_file::read(path, Links::Follow, cni::small_file::MAX_SIZE)
                .map_err(|e| Error::io(format!("failed to read resolvConf {}: {e}", path.display())))?
                .bytes,
        )),
        None => Dns::default(),
    };
    place_requested(&cfg.range_sets, &cfg.requested)?;
    Ok(Add { cfg, dns })
}

/// A CHECK that may go to the store.
#[derive(Debug)]
pub struct Check {
    pub cfg: IpamConfig,
    /// The addresses the runtime was given, when it passes prevResult.
    pub reported: Option<Vec<IpAddr>>,
}

pub fn check(req: &Request) -> Result<Check> {
    let cfg = configuration(req)?;
    let reported = req
        .conf
        .prev_result()?
        .map(|prev| prev.ips.iter().map(|ip| ip.address.ip()).collect());
    Ok(Check { cfg, reported })
}

/// A GC that may go to the store.
#[derive(Debug)]
pub struct Gc {
    pub cfg: IpamConfig,
    pub valid: Vec<GcAttachment>,
}

pub fn gc(req: &Request) -> Result<Gc> {
    let cfg = configuration(req)?;
    let valid = req.conf.gc_valid_attachments()?;
    Ok(Gc { cfg, valid })
}

/// The configuration as `command` checks it before the store: ADD, CHECK
/// and GC with what else they read, DEL, STATUS and VERSION alone.
pub fn verb(command: Command, req: &Request) -> Result<IpamConfig> {
    match command {
        Command::Add => Ok(add(req)?.cfg),
        Command::Check => Ok(check(req)?.cfg),
        Command::Gc => Ok(gc(req)?.cfg),
        Command::Del | Command::Status | Command::Version => configuration(req),
    }
}

/// Where the store's directories are or would be made
/// ([`Paths::check_place`]), for a configuration already checked.
pub fn store_place(cfg: &IpamConfig) -> Result<()> {
    Paths::new(&cfg.data_dir, &cfg.network)?.check_place()?;
    Ok(())
}

/// Everything `command` checks before it needs the store, the store's
/// directories included: what a caller runs before it starts or asks a
/// lease service.
pub fn before_store(command: Command, req: &Request) -> Result<()> {
    if command == Command::Version {
        return Ok(());
    }
    store_place(&verb(command, req)?)
}
