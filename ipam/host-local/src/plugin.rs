//! The IPAM verbs, and the plugin process: it sends its invocation along
//! the one lease path (`ipam::client`), which runs it here against the
//! database when no lease service takes it.

use std::collections::BTreeMap;
use std::io::Read;
use std::net::IpAddr;
use std::process::ExitCode;
use std::sync::Arc;

use cni::env::{CNI_COMMAND, EnvSource, ProcessEnv};
use cni::result::IpConfig;
use cni::skel::{Reply, dispatch, emit};
use cni::{Attachment, CniResult, Code, Error, Plugin, Request, Result};
use ipam::client::{self, Route};
use ipam::config::{IpamConfig, parse_resolv_conf};
use ipam::pool;
use ipam::service::{FORWARDED_ENV, Request as LeaseRequest, Response};
use ipam::store::Stores;
use ipnetwork::IpNetwork;

pub struct HostLocal {
    stores: Arc<Stores>,
}

impl HostLocal {
    pub fn new(stores: Arc<Stores>) -> Self {
        HostLocal { stores }
    }

    fn config(req: &Request) -> Result<IpamConfig> {
        IpamConfig::load(&req.conf, &req.env.args()?).map_err(Error::from)
    }

    fn on_network<T>(
        &self,
        cfg: &IpamConfig,
        op: impl FnOnce(&ipam::store::Network) -> Result<T, ipam::Error>,
    ) -> Result<T> {
        pool::with_network(&self.stores, &cfg.data_dir, &cfg.network, op).map_err(Error::from)
    }
}

impl Plugin for HostLocal {
    const NAME: &'static str = "host-local";
    const KEYS: cni::keys::Shape = ipam::config::KEYS;

    fn add(&self, req: &Request, att: &Attachment) -> Result<CniResult> {
        let cfg = HostLocal::config(req)?;
        // Read before anything is leased, so a bad path leaves nothing behind.
        let dns = match &cfg.resolv_conf {
            Some(path) => parse_resolv_conf(
                &std::fs::read_to_string(path)
                    .map_err(|e| Error::io(format!("failed to read resolvConf {}: {e}", path.display())))?,
            ),
            None => Default::default(),
        };
        let allocations = self.on_network(&cfg, |net| {
            pool::allocate(
                net,
                &cfg.range_sets,
                &cfg.requested,
                &att.container_id,
                &att.ifname,
                att.netns.as_deref(),
            )
        })?;
        let ips = allocations
            .into_iter()
            .map(|a| {
                let address = IpNetwork::new(a.ip, a.prefix).map_err(|e| Error::internal(e.to_string()))?;
                Ok(IpConfig {
                    address,
                    gateway: Some(a.gateway),
                    interface: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CniResult {
            ips,
            routes: cfg.routes,
            dns,
            ..CniResult::default()
        })
    }

    fn check(&self, req: &Request, att: &Attachment) -> Result<()> {
        let cfg = HostLocal::config(req)?;
        let reported: Option<Vec<IpAddr>> = req
            .conf
            .prev_result()?
            .map(|prev| prev.ips.iter().map(|ip| ip.address.ip()).collect());
        self.on_network(&cfg, |net| {
            pool::check(
                net,
                &cfg.range_sets,
                &att.container_id,
                &att.ifname,
                reported.as_deref(),
            )
        })
    }

    fn del(&self, req: &Request, att: &Attachment) -> Result<()> {
        let cfg = HostLocal::config(req)?;
        self.on_network(&cfg, |net| {
            pool::release(net, &att.container_id, &att.ifname, att.netns.as_deref())
        })
        .map(drop)
    }

    fn gc(&self, req: &Request) -> Result<()> {
        let cfg = HostLocal::config(req)?;
        let valid = req.conf.gc_valid_attachments()?;
        let report = self.on_network(&cfg, |net| pool::gc(net, &valid))?;
        log::info!("GC released {} lease(s)", report.released.len());
        if report.errors.is_empty() {
            Ok(())
        } else {
            Err(Error::io(format!(
                "GC could not release: {}",
                report.errors.join("; ")
            )))
        }
    }

    fn status(&self, req: &Request) -> Result<()> {
        let cfg = HostLocal::config(req)?;
        match self.on_network(&cfg, |net| pool::exhausted_set(net, &cfg.range_sets))? {
            None => Ok(()),
            Some(index) => Err(Error::new(
                Code::NotAvailable,
                format!(
                    "no IP addresses available in range set: {}",
                    cfg.range_sets[index]
                ),
            )),
        }
    }
}

/// The plugin process. VERSION and the about text need no store; every other
/// verb goes along the lease path, where "here" is this process opening the
/// database itself.
pub fn main() -> ExitCode {
    cni::log::init(HostLocal::NAME);
    let command = ProcessEnv.var(CNI_COMMAND).unwrap_or_default();
    if command.is_empty() || command == "VERSION" {
        let reply = dispatch(
            &HostLocal::new(Arc::new(Stores::direct())),
            &ProcessEnv,
            read_stdin,
        );
        return emit(&reply);
    }
    let stdin = match read_stdin() {
        Ok(bytes) => bytes,
        Err(e) => {
            return emit(&Reply::Failed(
                Error::io(format!("error reading from stdin: {e}")),
                cni::Version::LATEST,
            ));
        }
    };
    let env: BTreeMap<String, String> = FORWARDED_ENV
        .iter()
        .filter_map(|k| Some(((*k).to_owned(), ProcessEnv.var(k)?)))
        .collect();
    let request = LeaseRequest::plugin(env.clone(), &stdin);
    let here = HostLocal::new(Arc::new(Stores::direct()));
    let mut route = Route::of_config(&stdin);
    if reaches_store(&env, &stdin)
        && let Ok(exe) = std::env::current_exe()
    {
        route = route.start_with(exe);
    }
    let response = client::serve(&route, &request, &|_: &LeaseRequest| {
        Response::from_reply(dispatch(&here, &env, || Ok(stdin.clone())))
    });
    emit(&response.into_reply())
}

/// Whether the invocation is valid enough to reach the store: only then
/// may a lease service be started for it. Anything else is answered here
/// with its error and starts nothing (not even in the default data
/// directory a malformed configuration would name).
fn reaches_store(env: &BTreeMap<String, String>, stdin: &[u8]) -> bool {
    let Ok(Some(environment)) = cni::Environment::load(env) else {
        return false;
    };
    let conf = cni::skel::parse_as::<HostLocal>(stdin).and_then(|doc| {
        let version = cni::conf::config_version(&doc)?;
        cni::NetConf::from_document(doc, version)
    });
    conf.is_ok_and(|conf| {
        environment
            .args()
            .is_ok_and(|args| IpamConfig::load(&conf, &args).is_ok())
    })
}

fn read_stdin() -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    std::io::stdin().read_to_end(&mut buf).map(|_| buf)
}
