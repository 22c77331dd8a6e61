//! Failures of the layers below as CNI errors: the suite's codes (100 and
//! up) carry the lower layer's message unchanged.

use cni::error::plugin_codes;
use cni::{Error, Result};

pub fn netlink_error(e: netlink::Error) -> Error {
    Error::plugin(plugin_codes::NETLINK, e.to_string())
}

/// A firewall failure (`firewall::Error`, taken by its message so that
/// the plugins without rules do not link the firewall code).
pub fn firewall_error(e: impl std::fmt::Display) -> Error {
    Error::plugin(plugin_codes::FIREWALL, e.to_string())
}

/// The namespace or an interface is not as the plugin needs it.
pub fn state_error(msg: impl Into<String>) -> Error {
    Error::plugin(plugin_codes::INTERFACE_STATE, msg)
}

/// CHECK found the attachment differing from what ADD set up.
pub fn check_failed(msg: impl Into<String>) -> Error {
    Error::plugin(plugin_codes::CHECK_FAILED, msg)
}

/// Teardown goes on past failures and reports them all as one error: the
/// first one's code, every message.
pub fn combine(failures: Vec<Error>) -> Result<()> {
    let mut iter = failures.into_iter();
    let Some(first) = iter.next() else { return Ok(()) };
    let rest: Vec<String> = iter.map(|e| e.msg).collect();
    if rest.is_empty() {
        return Err(first);
    }
    let msg = format!("{}; {}", first.msg, rest.join("; "));
    Err(Error { msg, ..first })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_failures_become_one_error() {
        assert!(combine(vec![]).is_ok());
        let err = combine(vec![Error::io("a"), Error::invalid_config("b")]).expect_err("failed");
        assert_eq!((err.code, err.msg.as_str()), (5, "a; b"));
    }

    #[test]
    fn one_failure_is_kept_whole() {
        let alone = Error::io("a").with_details("why");
        assert_eq!(combine(vec![alone.clone()]), Err(alone));
    }

    #[test]
    fn lower_layers_keep_their_message_under_the_suites_codes() {
        let e = firewall_error("bad rule");
        assert_eq!((e.code, e.msg.as_str()), (plugin_codes::FIREWALL, "bad rule"));
        assert_eq!(state_error("x").code, plugin_codes::INTERFACE_STATE);
        assert_eq!(check_failed("x").code, plugin_codes::CHECK_FAILED);
    }
}
