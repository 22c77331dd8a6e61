//! `CNI_ARGS`: `K=V;K=V` pairs handed to every plugin of a chain.
//!
//! Keys are case-sensitive (Go matches them against struct field names:
//! `IP`, `MAC`, `IgnoreUnknown`). A plugin that reads CNI_ARGS refuses keys it
//! does not know unless `IgnoreUnknown=1|true` is present, as Go's
//! `LoadArgs` does; a plugin that reads none of them never looks.

use crate::error::{Error, Result};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    pairs: Vec<(String, String)>,
    ignore_unknown: bool,
}

const IGNORE_UNKNOWN: &str = "IgnoreUnknown";

impl CniArgs {
    /// Parses the variable. Empty segments (a trailing `;`) are skipped; a
    /// segment without `=` or with an empty key is an error naming it. Values
    /// may contain `=`.
    pub fn parse(raw: &str) -> Result<Self> {
        let mut args = CniArgs::default();
        for segment in raw.split(';').filter(|s| !s.is_empty()) {
            let Some((key, value)) = segment.split_once('=') else {
                return Err(invalid_pair(segment));
            };
            if key.is_empty() {
                return Err(invalid_pair(segment));
            }
            if key == IGNORE_UNKNOWN {
                args.ignore_unknown = parse_bool(value).ok_or_else(|| {
                    Error::invalid_env(format!(
                        "ARGS: error parsing value of pair {segment:?}: boolean unmarshal error: invalid input {value}"
                    ))
                })?;
            }
            args.pairs.push((key.to_owned(), value.to_owned()));
        }
        Ok(args)
    }

    /// The value of `key`; the last one wins when a key repeats, as in Go.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn pairs(&self) -> &[(String, String)] {
        &self.pairs
    }

    pub fn ignore_unknown(&self) -> bool {
        self.ignore_unknown
    }

    /// Refuses keys outside `known` (and `IgnoreUnknown`) unless unknown keys
    /// are to be ignored. Call it in plugins that read CNI_ARGS.
    pub fn expect_only(&self, known: &[&str]) -> Result<()> {
        if self.ignore_unknown {
            return Ok(());
        }
        let unknown: Vec<String> = self
            .pairs
            .iter()
            .filter(|(k, _)| k != IGNORE_UNKNOWN && !known.contains(&k.as_str()))
            .map(|(k, v)| format!("{:?}", format!("{k}={v}")))
            .collect();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(Error::invalid_env(format!(
                "ARGS: unknown args [{}]",
                unknown.join(" ")
            )))
        }
    }

    /// The variable's text for a child process.
    pub fn to_env_string(&self) -> String {
        format_pairs(&self.pairs)
    }
}

/// The last value of `key` in CNI_ARGS as given, reading what can be read:
/// a malformed segment is skipped, never refused. For labels only (the
/// pod a log record is about), which must not fail a call whose plugin
/// reads no argument; a plugin's own arguments go through
/// [`CniArgs::parse`], which refuses them.
pub fn lenient_value<'a>(raw: &'a str, key: &str) -> Option<&'a str> {
    raw.split(';')
        .filter_map(|segment| segment.split_once('='))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| v)
        .next_back()
}

/// `K=V;K=V`, the form CNI_ARGS takes in a child's environment.
pub fn format_pairs(pairs: &[(String, String)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(";")
}

fn invalid_pair(segment: &str) -> Error {
    Error::invalid_env(format!("invalid CNI_ARGS pair {segment:?}"))
}

/// Go's `UnmarshallableBool`: `1`/`true` and `0`/`false`, any case.
fn parse_bool(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" => Some(true),
        "0" | "false" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;

    #[test]
    fn parses_pairs_and_keeps_case() {
        let a = CniArgs::parse("IP=10.0.0.5;K8S_POD_NAME=web-0;mac=x").expect("valid");
        assert_eq!(a.get("IP"), Some("10.0.0.5"));
        assert_eq!(a.get("ip"), None, "keys are case-sensitive as in Go");
        assert_eq!(a.get("K8S_POD_NAME"), Some("web-0"));
        assert_eq!(a.pairs().len(), 3);
        assert!(!a.ignore_unknown());
    }

    #[test]
    fn empty_and_trailing_segments_are_skipped() {
        assert_eq!(CniArgs::parse("").expect("valid"), CniArgs::default());
        let a = CniArgs::parse("A=1;;B=2;").expect("valid");
        assert_eq!(a.to_env_string(), "A=1;B=2");
    }

    #[test]
    fn values_may_contain_equals_signs() {
        let a = CniArgs::parse("TOKEN=abc==").expect("valid");
        assert_eq!(a.get("TOKEN"), Some("abc=="));
    }

    #[test]
    fn last_repeated_key_wins() {
        let a = CniArgs::parse("IP=10.0.0.1;IP=10.0.0.2").expect("valid");
        assert_eq!(a.get("IP"), Some("10.0.0.2"));
    }

    #[test]
    fn malformed_pairs_are_invalid_environment() {
        for bad in ["novalue", "=v", "A=1;junk"] {
            let err = CniArgs::parse(bad).expect_err("must fail");
            assert!(err.has_code(Code::InvalidEnvironment), "{bad}");
            assert!(err.msg.contains("invalid CNI_ARGS pair"), "{}", err.msg);
        }
    }

    #[test]
    fn lenient_values_skip_what_cannot_be_read() {
        let raw = "junk;K8S_POD_NAMESPACE=default;=x;K8S_POD_NAME=web-0;K8S_POD_NAME=web-1;;";
        assert!(CniArgs::parse(raw).is_err(), "refused where arguments are read");
        assert_eq!(lenient_value(raw, "K8S_POD_NAMESPACE"), Some("default"));
        assert_eq!(lenient_value(raw, "K8S_POD_NAME"), Some("web-1"), "the last wins");
        assert_eq!(lenient_value(raw, "k8s_pod_name"), None, "case-sensitive");
        assert_eq!(lenient_value("", "K8S_POD_NAME"), None);
    }

    #[test]
    fn ignore_unknown_accepts_go_booleans_only() {
        for yes in ["1", "true", "TRUE", "True"] {
            assert!(
                CniArgs::parse(&format!("IgnoreUnknown={yes}"))
                    .expect("valid")
                    .ignore_unknown()
            );
        }
        for no in ["0", "false"] {
            assert!(
                !CniArgs::parse(&format!("IgnoreUnknown={no}"))
                    .expect("valid")
                    .ignore_unknown()
            );
        }
        let err = CniArgs::parse("IgnoreUnknown=yes").expect_err("not a Go bool");
        assert!(err.has_code(Code::InvalidEnvironment));
        assert!(
            !CniArgs::parse("ignoreunknown=1").expect("valid").ignore_unknown(),
            "the key is case-sensitive"
        );
    }

    #[test]
    fn unknown_keys_are_refused_unless_ignored() {
        let a = CniArgs::parse("IP=10.0.0.5;FOO=bar;K8S_POD_NAME=p").expect("valid");
        let err = a.expect_only(&["IP"]).expect_err("unknown keys");
        assert_eq!(err.msg, r#"ARGS: unknown args ["FOO=bar" "K8S_POD_NAME=p"]"#);
        assert!(err.has_code(Code::InvalidEnvironment));
        assert!(a.expect_only(&["IP", "FOO", "K8S_POD_NAME"]).is_ok());
        let ignored = CniArgs::parse("IgnoreUnknown=1;FOO=bar").expect("valid");
        assert!(ignored.expect_only(&[]).is_ok());
        let declared = CniArgs::parse("IgnoreUnknown=0;IP=1.2.3.4").expect("valid");
        assert!(
            declared.expect_only(&["IP"]).is_ok(),
            "IgnoreUnknown is always known"
        );
    }
}
