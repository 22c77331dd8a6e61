//! The CNI error: a spec code, a short message and optional details, printed
//! as one JSON document on stdout.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::version::Version;

/// Well-known error codes from the spec, plus the Go libraries' extras that
/// runtimes already understand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Unknown = 0,
    IncompatibleVersion = 1,
    UnsupportedField = 2,
    UnknownContainer = 3,
    InvalidEnvironment = 4,
    Io = 5,
    Decoding = 6,
    InvalidConfig = 7,
    /// Go's `ErrInvalidNetNS`: CNI_NETNS is the plugin's own namespace.
    InvalidNetns = 8,
    TryAgainLater = 11,
    /// STATUS: the plugin cannot take ADDs.
    NotAvailable = 50,
    /// STATUS: not available, and existing containers may be affected.
    LimitedConnectivity = 51,
    /// libcni's code for failures that carry no CNI error of their own.
    Internal = 999,
}

/// The suite's own codes (100 and up), shared by its plugins so that one
/// code means one thing across the suite.
pub mod plugin_codes {
    /// CHECK found the attachment differing from what ADD set up.
    pub const CHECK_FAILED: u32 = 100;
    /// The kernel refused a netlink request.
    pub const NETLINK: u32 = 101;
    /// The namespace or interface is not in the state the plugin needs.
    pub const INTERFACE_STATE: u32 = 102;
    /// IPAM cannot hand out an address as asked (pool exhausted, requested
    /// address taken or outside the ranges).
    pub const ADDRESS_UNAVAILABLE: u32 = 103;
    /// iptables or nft refused a ruleset.
    pub const FIREWALL: u32 = 104;
    /// A host port (protocol, host IP) is published for a pod that still
    /// runs.
    pub const HOST_PORT_TAKEN: u32 = 105;
}

/// A CNI error as the protocol carries it. `code` is a plain number because
/// plugins use their own codes from 100 up and a delegate may return any.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Error {
    pub code: u32,
    pub msg: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub details: String,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(code: Code, msg: impl Into<String>) -> Self {
        Error {
            code: code as u32,
            msg: msg.into(),
            details: String::new(),
        }
    }

    /// A plugin-specific error; codes below 100 are reserved by the spec and
    /// are moved into the plugin range.
    pub fn plugin(code: u32, msg: impl Into<String>) -> Self {
        Error {
            code: code.max(100),
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    pub fn incompatible_version(msg: impl Into<String>) -> Self {
        Error::new(Code::IncompatibleVersion, msg)
    }

    pub fn unsupported_field(field: &str, value: &str) -> Self {
        Error::new(
            Code::UnsupportedField,
            format!("unsupported field {field:?} with value {value:?}"),
        )
    }

    pub fn invalid_env(msg: impl Into<String>) -> Self {
        Error::new(Code::InvalidEnvironment, msg)
    }

    pub fn io(msg: impl Into<String>) -> Self {
        Error::new(Code::Io, msg)
    }

    pub fn decoding(msg: impl Into<String>) -> Self {
        Error::new(Code::Decoding, msg)
    }

    pub fn invalid_config(msg: impl Into<String>) -> Self {
        Error::new(Code::InvalidConfig, msg)
    }

    pub fn try_again_later(msg: impl Into<String>) -> Self {
        Error::new(Code::TryAgainLater, msg)
    }

    pub fn internal(msg: impl Into<String>) -> Self {
        Error::new(Code::Internal, msg)
    }

    /// Adds what was being done in front of the message, keeping the code.
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.msg = format!("{what}: {}", self.msg);
        self
    }

    pub fn has_code(&self, code: Code) -> bool {
        self.code == code as u32
    }

    /// The document printed on stdout: `{"cniVersion","code","msg","details"}`.
    pub fn to_json(&self, version: Version) -> Value {
        let mut doc = serde_json::json!({
            "cniVersion": version.as_str(),
            "code": self.code,
            "msg": self.msg,
        });
        if !self.details.is_empty() {
            doc["details"] = Value::String(self.details.clone());
        }
        doc
    }

    /// Reads an error a plugin printed, if the bytes are one.
    pub fn from_plugin_output(stdout: &[u8]) -> Option<Self> {
        let err: Error = serde_json::from_slice(stdout).ok()?;
        Some(err)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.msg)?;
        if !self.details.is_empty() {
            write!(f, ": {}", self.details)?;
        }
        write!(f, " (CNI error code {})", self.code)
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_carries_version_code_msg_and_details_only_when_set() {
        let e = Error::invalid_env("required env variables [CNI_NETNS] missing");
        assert_eq!(
            e.to_json(Version::V0_4_0),
            serde_json::json!({"cniVersion":"0.4.0","code":4,"msg":"required env variables [CNI_NETNS] missing"})
        );
        let e = Error::new(Code::IncompatibleVersion, "incompatible CNI versions")
            .with_details("config is \"9.9.9\"");
        assert_eq!(e.to_json(Version::V1_1_0)["details"], "config is \"9.9.9\"");
    }

    #[test]
    fn plugin_codes_stay_out_of_the_reserved_range() {
        assert_eq!(Error::plugin(7, "x").code, 100);
        assert_eq!(Error::plugin(120, "x").code, 120);
    }

    #[test]
    fn reads_errors_printed_by_other_plugins() {
        let e = Error::from_plugin_output(br#"{"code":11,"msg":"busy","details":"d"}"#)
            .expect("an error document");
        assert!(e.has_code(Code::TryAgainLater));
        assert_eq!(e.details, "d");
        assert!(Error::from_plugin_output(b"not json").is_none());
        assert!(Error::from_plugin_output(br#"{"cniVersion":"1.0.0"}"#).is_none());
    }
}
