//! IPAM for the bridge. Normally the IPAM plugin is executed, as the spec
//! says. When the configuration names host-local's lease service
//! (`"ipam": {"type": "host-local", "socket": "<path>"}`), the bridge sends
//! the service the request the host-local process would have forwarded, and
//! saves that process (about 1 ms and a fork per call). A service that does
//! not answer falls back to executing host-local.

use std::collections::BTreeMap;

use cni::exec::delegate;
use cni::skel::{NoConfig, Reply};
use cni::{CniResult, Command, Request, Result};
use ipam::service::{self, FORWARDED_ENV};
use serde_json::Value;

const HOST_LOCAL: &str = "host-local";

/// The service socket, when the configuration sets one explicitly (an unset
/// `socket` keeps the spec's exec: the host-local in CNI_PATH may not be
/// ours).
fn service_socket(ipam_type: &str, stdin: &[u8]) -> Option<String> {
    if ipam_type != HOST_LOCAL {
        return None;
    }
    let doc: Value = serde_json::from_slice(stdin).ok()?;
    doc["ipam"]["socket"]
        .as_str()
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
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
/// The service gets the variables this process would pass to host-local:
/// its own, with CNI_COMMAND set.
pub fn call(ipam_type: &str, command: Command, req: &Request<NoConfig>) -> Result<Vec<u8>> {
    if let Some(socket) = service_socket(ipam_type, &req.stdin) {
        let mut env: BTreeMap<String, String> = FORWARDED_ENV
            .iter()
            .filter_map(|k| Some(((*k).to_owned(), std::env::var(k).ok()?)))
            .collect();
        env.insert("CNI_COMMAND".into(), command.as_str().into());
        let request = service::Request::Plugin {
            env,
            stdin: String::from_utf8_lossy(&req.stdin).into_owned(),
        };
        match service::call(std::path::Path::new(&socket), &request) {
            Ok(response) => {
                return match response.into_reply() {
                    Reply::Document(doc) => Ok(doc.to_string().into_bytes()),
                    Reply::Done | Reply::About(_) => Ok(Vec::new()),
                    Reply::Failed(e, _) => Err(e),
                };
            }
            Err(e) => log::debug!("{e}; executing {HOST_LOCAL}"),
        }
    }
    delegate(ipam_type, command, &req.stdin, &req.env.path)
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
        assert_eq!(service_socket("host-local", with).as_deref(), Some("/run/x.sock"));
        assert_eq!(service_socket("dhcp", with), None);
        assert_eq!(
            service_socket("host-local", br#"{"ipam": {"type": "host-local"}}"#),
            None
        );
        assert_eq!(service_socket("host-local", br#"{"ipam": {"socket": ""}}"#), None);
    }
}
