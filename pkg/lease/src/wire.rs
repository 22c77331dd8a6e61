//! What is asked of the leases ([`Call`]) and, private to this crate, how
//! a call and its answer travel on a service's socket: the client writes
//! one JSON request and shuts its side down; the service answers with one
//! JSON response and closes.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use cni::conf::GcAttachment;
use cni::skel::Reply;
use cni::{Code, Command, Error as CniError, Version};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use ipam_config::lease_settings::LeaseSettings;

/// The CNI variables a plugin call carries.
const FORWARDED_ENV: [&str; 7] = [
    "CNI_COMMAND",
    "CNI_CONTAINERID",
    "CNI_NETNS",
    "CNI_IFNAME",
    "CNI_ARGS",
    "CNI_PATH",
    "CNI_NETNS_OVERRIDE",
];

/// An operator's command on one network's leases (`cnictl ipam ...`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase")]
pub enum AdminOp {
    List,
    ReleaseIp {
        ip: IpAddr,
    },
    ReleaseContainer {
        #[serde(rename = "containerID")]
        container_id: String,
        ifname: Option<String>,
    },
    Gc {
        valid: Vec<GcAttachment>,
    },
    Export,
    ImportReference {
        dir: PathBuf,
    },
}

/// What is asked of the leases.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum Call {
    /// A host-local invocation: its CNI_* variables and stdin; answered
    /// with what the plugin would have printed.
    Plugin {
        env: BTreeMap<String, String>,
        stdin: String,
    },
    /// An operator's command.
    Admin {
        #[serde(rename = "dataDir")]
        data_dir: PathBuf,
        network: String,
        #[serde(flatten)]
        op: AdminOp,
    },
}

impl Call {
    /// host-local's `command` as this process would execute it: the
    /// CNI_* variables of this process that a plugin reads, with
    /// CNI_COMMAND set to `command`, and `stdin`.
    pub fn plugin_from_env(command: Command, stdin: &[u8]) -> Self {
        let mut env = Call::plugin_env(|name| std::env::var(name).ok());
        env.insert("CNI_COMMAND".into(), command.as_str().into());
        Call::plugin(env, stdin)
    }

    /// The CNI_* variables a plugin call carries, read through `var`.
    pub fn plugin_env(var: impl Fn(&str) -> Option<String>) -> BTreeMap<String, String> {
        FORWARDED_ENV
            .iter()
            .filter_map(|name| Some(((*name).to_owned(), var(name)?)))
            .collect()
    }

    pub fn plugin(env: BTreeMap<String, String>, stdin: &[u8]) -> Self {
        Call::Plugin {
            env,
            stdin: String::from_utf8_lossy(stdin).into_owned(),
        }
    }

    pub fn admin(data_dir: PathBuf, network: String, op: AdminOp) -> Self {
        Call::Admin {
            data_dir,
            network,
            op,
        }
    }

    /// The data directory the call is about, as its sender spelled it.
    pub fn data_dir(&self) -> Option<PathBuf> {
        match self {
            Call::Plugin { stdin, .. } => LeaseSettings::read(stdin.as_bytes()).map(|s| s.data_dir),
            Call::Admin { data_dir, .. } => Some(data_dir.clone()),
        }
    }
}

/// An operator command's outcome as the lease path answers it.
pub fn admin_reply(outcome: Result<Value, CniError>) -> Reply {
    match outcome {
        Ok(document) => Reply::Document(document),
        Err(e) => Reply::Failed(e, Version::LATEST),
    }
}

/// Code 11: the leases were held elsewhere; asking again may succeed.
pub fn is_busy(reply: &Reply) -> bool {
    matches!(reply, Reply::Failed(e, _) if e.has_code(Code::TryAgainLater))
}

/// A call on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Request {
    #[serde(flatten)]
    pub(crate) call: Call,
    /// Passed on by a process that found the data directory in another
    /// service's charge; never passed on again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) forwarded: bool,
}

impl Request {
    pub(crate) fn new(call: Call) -> Self {
        Request {
            call,
            forwarded: false,
        }
    }
}

/// A question to the service itself, about no lease: never a [`Call`],
/// which the lease path may answer anywhere along its route (the caller's
/// own process included), while only the service that is asked knows what
/// it has served. Answered by [`crate::server`], not its handler, and
/// never passed on. A service of a version without it answers that the
/// request is unreadable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub(crate) enum ServiceQuery {
    /// What it has answered since it started ([`crate::served::Served`]).
    Served,
}

/// An answer on the wire: a [`Reply`] without its about text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Response {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    document: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<CniError>,
    #[serde(default, rename = "cniVersion", skip_serializing_if = "Option::is_none")]
    version: Option<Version>,
}

impl From<Reply> for Response {
    fn from(reply: Reply) -> Self {
        let (document, error, version) = match reply {
            Reply::Document(doc) => (Some(doc), None, None),
            Reply::Done | Reply::About(_) => (None, None, None),
            Reply::Failed(e, v) => (None, Some(e), Some(v)),
        };
        Response {
            document,
            error,
            version,
        }
    }
}

impl From<Response> for Reply {
    fn from(response: Response) -> Self {
        match (response.error, response.document) {
            (Some(e), _) => Reply::Failed(e, response.version.unwrap_or(Version::LATEST)),
            (None, Some(doc)) => Reply::Document(doc),
            (None, None) => Reply::Done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_survive_the_wire() {
        let cases = [
            Reply::Document(serde_json::json!({"cniVersion":"1.0.0"})),
            Reply::Done,
            Reply::Failed(CniError::try_again_later("busy"), Version::V0_4_0),
        ];
        for reply in cases {
            let wire = serde_json::to_vec(&Response::from(reply.clone())).expect("encode");
            let back: Response = serde_json::from_slice(&wire).expect("decode");
            assert_eq!(Reply::from(back), reply);
        }
    }

    #[test]
    fn requests_survive_the_wire() {
        let req = Request::new(Call::admin("/d".into(), "n".into(), AdminOp::List));
        let wire = serde_json::to_string(&req).expect("encode");
        assert!(!wire.contains("forwarded"), "{wire}");
        assert_eq!(serde_json::from_str::<Request>(&wire).expect("decode"), req);
        let plugin = Request {
            forwarded: true,
            ..Request::new(Call::plugin(
                BTreeMap::from([("CNI_COMMAND".into(), "ADD".into())]),
                b"{}",
            ))
        };
        let wire = serde_json::to_string(&plugin).expect("encode");
        assert_eq!(serde_json::from_str::<Request>(&wire).expect("decode"), plugin);
        // What versions before `forwarded` sent.
        let old = r#"{"kind":"admin","dataDir":"/d","network":"n","op":"list"}"#;
        assert_eq!(serde_json::from_str::<Request>(old).expect("decode"), req);
    }

    #[test]
    fn a_service_query_is_no_call_and_no_call_is_a_service_query() {
        let wire = serde_json::to_string(&ServiceQuery::Served).expect("encode");
        assert_eq!(wire, r#"{"kind":"served"}"#);
        assert!(serde_json::from_str::<Request>(&wire).is_err());
        let call = serde_json::to_string(&Request::new(Call::admin("/d".into(), "n".into(), AdminOp::List)))
            .expect("encode");
        assert!(serde_json::from_str::<ServiceQuery>(&call).is_err());
    }

    #[test]
    fn a_plugin_call_carries_the_cni_variables_only() {
        let env = Call::plugin_env(|name| match name {
            "CNI_COMMAND" | "CNI_NETNS" => Some(format!("{name}-value")),
            _ => None,
        });
        assert_eq!(env.keys().collect::<Vec<_>>(), ["CNI_COMMAND", "CNI_NETNS"]);
    }
}
