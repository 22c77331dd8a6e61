//! IPAM for the bridge. Normally the IPAM plugin is executed, as the spec
//! says. When the configuration names host-local's lease service
//! (`"ipam": {"type": "host-local", "socket": "<path>"}`), the bridge sends
//! the request a host-local process would have sent along the one lease
//! path (`ipam::client`), with executing host-local as its last place, and
//! saves that process (about 1 ms and a fork per call) whenever a service
//! answers. Without a named socket it always executes: the host-local in
//! CNI_PATH may be the reference's, and two stores would hand out the same
//! addresses.

use std::cell::RefCell;
use std::collections::BTreeMap;

use cni::exec::delegate;
use cni::skel::{NoConfig, Reply};
use cni::{CniResult, Command, Request, Result};
use ipam::client::{self, Route};
use ipam::config::{LeaseSettings, SocketSetting};
use ipam::service::{FORWARDED_ENV, Request as LeaseRequest, Response};

const HOST_LOCAL: &str = "host-local";

/// The lease settings, when the configuration names host-local's service
/// explicitly.
fn named_service(ipam_type: &str, stdin: &[u8]) -> Option<LeaseSettings> {
    if ipam_type != HOST_LOCAL {
        return None;
    }
    LeaseSettings::read(stdin).filter(|s| matches!(s.socket, SocketSetting::Named(_)))
}

/// host-local's configuration, checked in-process before ADD changes
/// anything: a bad range or CNI_ARGS then leaves no bridge or veth behind,
/// with host-local's own error. Other IPAM plugins check theirs when they
/// run (dhcp needs the pod's interface to exist first).
pub fn validate(ipam_type: Option<&str>, req: &Request<NoConfig>) -> Result<()> {
    if ipam_type == Some(HOST_LOCAL) {
        ipam::config::IpamConfig::load(&req.conf, &req.env.args)?;
    }
    Ok(())
}

/// Runs `command` on the IPAM plugin; returns what it printed.
/// A service gets the variables this process would pass to host-local:
/// its own, with CNI_COMMAND set.
pub fn call(ipam_type: &str, command: Command, req: &Request<NoConfig>) -> Result<Vec<u8>> {
    let execute = || delegate(ipam_type, command, &req.stdin, &req.env.path);
    let Some(settings) = named_service(ipam_type, &req.stdin) else {
        return execute();
    };
    let mut env: BTreeMap<String, String> = FORWARDED_ENV
        .iter()
        .filter_map(|k| Some(((*k).to_owned(), std::env::var(k).ok()?)))
        .collect();
    env.insert("CNI_COMMAND".into(), command.as_str().into());
    let request = LeaseRequest::plugin(env, &req.stdin);
    let route = Route::new(&settings.socket, &settings.data_dir);
    // What an executed host-local printed, passed on as it is.
    let executed = RefCell::new(None);
    let response = client::serve(&route, &request, &|_: &LeaseRequest| match execute() {
        Ok(stdout) => {
            executed.replace(Some(stdout));
            Response::from_reply(Reply::Done)
        }
        Err(e) => Response::from_reply(Reply::Failed(e, cni::Version::LATEST)),
    });
    if let Some(stdout) = executed.take()
        && response.error.is_none()
    {
        return Ok(stdout);
    }
    match response.into_reply() {
        Reply::Document(doc) => Ok(doc.to_string().into_bytes()),
        Reply::Done | Reply::About(_) => Ok(Vec::new()),
        Reply::Failed(e, _) => Err(e),
    }
}

/// ADD: the IPAM result, read whatever version it was printed in.
pub fn add(ipam_type: &str, req: &Request<NoConfig>) -> Result<CniResult> {
    let stdout = call(ipam_type, Command::Add, req)?;
    CniResult::from_slice(&stdout).map_err(|e| e.context(format!("result of {ipam_type}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_explicit_host_local_socket_skips_the_process() {
        let with = br#"{"ipam": {"type": "host-local", "socket": "/run/x.sock"}}"#;
        assert_eq!(
            named_service("host-local", with).map(|s| s.socket),
            Some(SocketSetting::Named("/run/x.sock".into()))
        );
        assert_eq!(named_service("dhcp", with), None);
        assert_eq!(
            named_service("host-local", br#"{"ipam": {"type": "host-local"}}"#),
            None
        );
        assert_eq!(named_service("host-local", br#"{"ipam": {"socket": ""}}"#), None);
    }
}
