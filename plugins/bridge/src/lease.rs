//! IPAM for the bridge. Normally the IPAM plugin is executed, as the spec
//! says. For host-local, the bridge sends the request a host-local process
//! would have sent along the one lease path (`lease::ask`), with
//! executing host-local as its last place, and saves that process (about
//! 1 ms and a fork per call) whenever a service answers, but only when it
//! is certain the service is the host-local it would execute: the one in
//! CNI_PATH may be the reference's, and two stores would hand out the same
//! addresses. Certain means the configuration names the service
//! (`"socket": "<path>"`: the operator says so), or, with no `socket` key,
//! the service's process runs the very file CNI_PATH finds. `"socket": ""`
//! always executes. host-local's configuration is parsed and checked once
//! in this process ([`Ipam`]) and that value carried to each call of it.

use std::cell::RefCell;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use cni::exec::{delegate, find_plugin};
use cni::skel::Reply;
use cni::{CniResult, Command, Request, Result};
use ipam_config::checks;
use ipam_config::config::IpamConfig;
use ipam_config::lease_settings::SocketSetting;
use lease::{Call, Route};

const HOST_LOCAL: &str = "host-local";

/// The lease path for a checked host-local configuration, when a service
/// may answer instead of the host-local process (see the module docs).
fn lease_route(cfg: &IpamConfig, cni_path: &[PathBuf]) -> Option<Route> {
    let route = Route::new(&cfg.socket, &cfg.data_dir);
    match cfg.socket {
        SocketSetting::Named(_) => Some(route),
        SocketSetting::Off => None,
        SocketSetting::Unset => {
            let binary = std::fs::metadata(find_plugin(HOST_LOCAL, cni_path).ok()?).ok()?;
            Some(route.run_by((binary.dev(), binary.ino())))
        }
    }
}

/// The bridge's IPAM plugin for one invocation, with host-local's
/// configuration checked once and carried to each call of it.
pub struct Ipam<'a> {
    plugin: &'a str,
    /// host-local's configuration as its checks passed it; None for
    /// another plugin, or for a call those checks refused (host-local is
    /// then executed and answers it, as it answers one without a service).
    host_local: Option<IpamConfig>,
}

impl<'a> Ipam<'a> {
    /// For ADD, checked in-process before ADD changes anything
    /// (`checks::add`: the configuration, CNI_ARGS, the network's name as a
    /// file name, resolvConf, requested addresses against the ranges): a
    /// bad range or CNI_ARGS then leaves no bridge or veth behind, with
    /// host-local's own error. Where the store's directories are is left to
    /// the host-local that runs: the one in CNI_PATH may be the
    /// reference's, which keeps none of ours. Other IPAM plugins check
    /// theirs when they run (dhcp needs the pod's interface to exist
    /// first).
    pub fn validate(plugin: &'a str, req: &Request) -> Result<Self> {
        let host_local = match plugin {
            HOST_LOCAL => Some(checks::add(req)?.cfg),
            _ => None,
        };
        Ok(Ipam { plugin, host_local })
    }

    /// For any other verb: a configuration host-local refuses is its to
    /// answer.
    fn for_verb(plugin: &'a str, command: Command, req: &Request) -> Self {
        let host_local = match plugin {
            HOST_LOCAL => match checks::verb(command, req) {
                Ok(cfg) => Some(cfg),
                Err(refused) => {
                    log::debug!("host-local answers this {} itself: {refused}", command.as_str());
                    None
                }
            },
            _ => None,
        };
        Ipam { plugin, host_local }
    }

    /// Runs `command` on the IPAM plugin; returns what it printed. A
    /// service gets the variables this process would pass to host-local:
    /// its own, with CNI_COMMAND set. A call whose store directories
    /// host-local would refuse (`checks::store_place`) asks no service.
    pub fn call(&self, command: Command, req: &Request) -> Result<Vec<u8>> {
        let execute = || delegate(self.plugin, command, &req.stdin, &req.env.path);
        let Some(cfg) = &self.host_local else {
            return execute();
        };
        let Some(route) = lease_route(cfg, &req.env.path) else {
            return execute();
        };
        if let Err(refused) = checks::store_place(cfg) {
            log::debug!("host-local answers this {} itself: {refused}", command.as_str());
            return execute();
        }
        ask(&route, command, req, &execute)
    }

    /// ADD: the IPAM result, read whatever version it was printed in.
    pub fn add(&self, req: &Request) -> Result<CniResult> {
        let stdout = self.call(Command::Add, req)?;
        CniResult::from_slice(&stdout).map_err(|e| e.context(format!("result of {}", self.plugin)))
    }
}

/// Runs `command` on the IPAM plugin `plugin` (see [`Ipam::call`]).
pub fn call(plugin: &str, command: Command, req: &Request) -> Result<Vec<u8>> {
    Ipam::for_verb(plugin, command, req).call(command, req)
}

/// `command` along `route`, with executing host-local as its last place.
fn ask(
    route: &Route,
    command: Command,
    req: &Request,
    execute: &dyn Fn() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let call = Call::plugin_from_env(command, &req.stdin);
    // What an executed host-local printed, passed on as it is.
    let executed = RefCell::new(None);
    let reply = lease::ask(route, &call, &|_: &Call| match execute() {
        Ok(stdout) => {
            executed.replace(Some(stdout));
            Reply::Done
        }
        Err(e) => Reply::Failed(e, cni::Version::LATEST),
    });
    if let Some(stdout) = executed.take()
        && !matches!(reply, Reply::Failed(..))
    {
        return Ok(stdout);
    }
    match reply {
        Reply::Document(doc) => Ok(doc.to_string().into_bytes()),
        Reply::Done | Reply::About(_) => Ok(Vec::new()),
        Reply::Failed(e, _) => Err(e),
    }
}

/// An IPAM ADD running on a thread of its own while the bridge makes the
/// links: the two wait on different things (the lease service or a
/// process; the kernel), so an ADD costs the longer of them rather than
/// both. A lease that was handed out but never taken (the ADD failed
/// before it needed it) is released when this is dropped.
pub struct Pending<'scope, 'env> {
    ipam: &'env Ipam<'env>,
    req: &'env Request,
    running: Option<std::thread::ScopedJoinHandle<'scope, Result<CniResult>>>,
}

impl<'scope, 'env> Pending<'scope, 'env> {
    pub fn start(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        ipam: &'env Ipam<'env>,
        req: &'env Request,
    ) -> Self {
        Pending {
            ipam,
            req,
            running: Some(scope.spawn(move || ipam.add(req))),
        }
    }

    /// The lease, once IPAM has answered; from here on the caller undoes it.
    pub fn wait(mut self) -> Result<CniResult> {
        let running = self.running.take();
        running.map_or_else(
            || Err(cni::Error::internal("IPAM was already waited for")),
            |handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| Err(cni::Error::internal("the IPAM thread panicked")))
            },
        )
    }
}

impl Drop for Pending<'_, '_> {
    fn drop(&mut self) {
        let Some(handle) = self.running.take() else {
            return;
        };
        if let Ok(Ok(_)) = handle.join()
            && let Err(e) = self.ipam.call(Command::Del, self.req)
        {
            log::warn!("rollback: could not release the IPAM lease: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_answers_for_host_local_only_when_certain() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host_local = dir.path().join(HOST_LOCAL);
        std::fs::write(&host_local, "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&host_local, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        let path = [dir.path().to_path_buf()];
        let route = |ipam: serde_json::Value, cni_path: &[PathBuf]| {
            let mut ipam = ipam;
            ipam["subnet"] = "10.0.0.0/24".into();
            let doc = serde_json::json!({"cniVersion": "1.0.0", "name": "net", "ipam": ipam});
            let conf = cni::NetConf::from_document(doc, cni::Version::V1_0_0).expect("conf");
            let cfg = IpamConfig::load(&conf, &cni::CniArgs::default()).expect("checked");
            lease_route(&cfg, cni_path).map(|r| format!("{r:?}"))
        };
        let named = serde_json::json!({"socket": "/run/x.sock", "dataDir": "/d"});
        let named_route = route(named, &path).expect("named");
        assert!(
            named_route.contains("/run/x.sock") && !named_route.contains("binary: Some"),
            "{named_route}"
        );
        assert_eq!(
            route(serde_json::json!({"socket": "", "dataDir": "/d"}), &path),
            None
        );
        let unset = route(serde_json::json!({"dataDir": "/d"}), &path).expect("unset");
        assert!(
            unset.contains("binary: Some"),
            "only a service run from CNI_PATH's file: {unset}"
        );
        assert_eq!(
            route(serde_json::json!({}), &[]),
            None,
            "no host-local to compare with"
        );
    }
}
