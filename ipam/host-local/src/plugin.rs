//! The IPAM verbs, and the plugin process: it checks its invocation as far
//! as it can without the store (`ipam_config::checks`), then sends it along
//! the one lease path (`lease::ask`), which runs it here against the
//! database when no lease service takes it.

use std::io::Read;
use std::process::ExitCode;
use std::sync::Arc;

use cni::env::{CNI_COMMAND, EnvSource, ProcessEnv};
use cni::result::IpConfig;
use cni::skel::{Reply, dispatch, emit};
use cni::{Attachment, CniResult, Command, Error, Plugin, Request, Result};
use ipam::pool;
use ipam::store::Stores;
use ipam_config::checks;
use ipam_config::config::IpamConfig;
use ipnetwork::IpNetwork;
use lease::{Call, Route};

pub struct HostLocal {
    stores: Arc<Stores>,
}

impl HostLocal {
    pub fn new(stores: Arc<Stores>) -> Self {
        HostLocal { stores }
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
    const KEYS: cni::keys::Shape = ipam_config::config::KEYS;

    fn add(&self, req: &Request, att: &Attachment) -> Result<CniResult> {
        let checks::Add { cfg, dns } = checks::add(req)?;
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
        let checks::Check { cfg, reported } = checks::check(req)?;
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
        let cfg = checks::configuration(req)?;
        self.on_network(&cfg, |net| {
            pool::release(net, &att.container_id, &att.ifname, att.netns.as_deref())
        })
        .map(drop)
    }

    fn gc(&self, req: &Request) -> Result<()> {
        let checks::Gc { cfg, valid } = checks::gc(req)?;
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

    /// Fails only when no ADD can work: the configuration or the store is
    /// unusable. A full range set answers 0, as the reference v1.9.1 does
    /// (it has no STATUS): containerd 2.1+ turns any STATUS error into
    /// NetworkReady=false, which taints the node not-ready:NoExecute and
    /// evicts its pods, while a full range only refuses new pods (each
    /// ADD says so, code 103) and frees up as they go. Logged here.
    fn status(&self, req: &Request) -> Result<()> {
        let cfg = checks::configuration(req)?;
        if let Some(index) = self.on_network(&cfg, |net| pool::exhausted_set(net, &cfg.range_sets))? {
            log::warn!(
                "STATUS: no IP addresses available in range set: {}; ADDs to it fail until an address is released",
                cfg.range_sets[index]
            );
        }
        Ok(())
    }
}

/// host-local's verbs up to the store ([`checks::before_store`]),
/// dispatched as the verbs are: the environment, the version and the
/// namespace checked by the skeleton, then the verb's own checks. The
/// plugin process runs it first; a call it refuses is answered from there.
struct BeforeStore;

impl Plugin for BeforeStore {
    const NAME: &'static str = HostLocal::NAME;
    const KEYS: cni::keys::Shape = HostLocal::KEYS;
    const LOG_SOCKET: Option<cni::log::OpenSink> = HostLocal::LOG_SOCKET;

    fn add(&self, req: &Request, _: &Attachment) -> Result<CniResult> {
        checks::before_store(Command::Add, req).map(|()| CniResult::default())
    }

    fn check(&self, req: &Request, _: &Attachment) -> Result<()> {
        checks::before_store(Command::Check, req)
    }

    fn del(&self, req: &Request, _: &Attachment) -> Result<()> {
        checks::before_store(Command::Del, req)
    }

    fn gc(&self, req: &Request) -> Result<()> {
        checks::before_store(Command::Gc, req)
    }

    fn status(&self, req: &Request) -> Result<()> {
        checks::before_store(Command::Status, req)
    }
}

/// The plugin process. VERSION and the about text need no store; every other
/// verb is checked here as far as it can be without the store, and only
/// then goes along the lease path, where "here" is this process opening the
/// database itself. A call refused by those checks starts no lease service
/// and asks none (not even in the default data directory a malformed
/// configuration would name).
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
    let env = Call::plugin_env(|name| ProcessEnv.var(name));
    if let refused @ Reply::Failed(..) = dispatch(&BeforeStore, &env, || Ok(stdin.clone())) {
        return emit(&refused);
    }
    let call = Call::plugin(env.clone(), &stdin);
    let here = HostLocal::new(Arc::new(Stores::direct()));
    let mut route = Route::of_config(&stdin);
    if let Ok(exe) = std::env::current_exe() {
        route = route.start_with(exe);
    }
    emit(&lease::ask(&route, &call, &|_: &Call| {
        dispatch(&here, &env, || Ok(stdin.clone()))
    }))
}

fn read_stdin() -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    std::io::stdin().read_to_end(&mut buf).map(|_| buf)
}
