//! The `CNI_*` environment of one invocation, checked per verb as the spec
//! lists it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::args::{CniArgs, lenient_value};
use crate::error::{Error, Result};

pub const CNI_COMMAND: &str = "CNI_COMMAND";
pub const CNI_CONTAINERID: &str = "CNI_CONTAINERID";
pub const CNI_NETNS: &str = "CNI_NETNS";
pub const CNI_IFNAME: &str = "CNI_IFNAME";
pub const CNI_ARGS: &str = "CNI_ARGS";
pub const CNI_PATH: &str = "CNI_PATH";
/// Go's escape hatch for the "CNI_NETNS is my own namespace" guard.
pub const CNI_NETNS_OVERRIDE: &str = "CNI_NETNS_OVERRIDE";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    Add,
    Del,
    Check,
    Gc,
    Status,
    Version,
}

impl Command {
    pub const ALL: [Command; 6] = [
        Command::Add,
        Command::Del,
        Command::Check,
        Command::Gc,
        Command::Status,
        Command::Version,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Gc => "GC",
            Command::Status => "STATUS",
            Command::Version => "VERSION",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Command::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// The variables the spec requires for this verb, besides CNI_COMMAND.
    fn required(self) -> &'static [&'static str] {
        match self {
            Command::Add | Command::Check => &[CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME, CNI_PATH],
            Command::Del => &[CNI_CONTAINERID, CNI_IFNAME, CNI_PATH],
            Command::Gc => &[CNI_PATH],
            Command::Status | Command::Version => &[],
        }
    }

    /// Verbs that act on one attachment (container ID + interface).
    pub fn acts_on_attachment(self) -> bool {
        matches!(self, Command::Add | Command::Del | Command::Check)
    }
}

/// Where variables come from: the process, or a map in tests.
pub trait EnvSource {
    fn var(&self, name: &str) -> Option<String>;
}

#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl EnvSource for BTreeMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

/// The checked environment. Fields a verb does not require may be absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    pub command: Command,
    pub container_id: Option<String>,
    pub netns: Option<PathBuf>,
    pub ifname: Option<String>,
    /// CNI_ARGS as given: parsed only by plugins that read it (see
    /// [`Environment::args`]).
    pub raw_args: String,
    pub path: Vec<PathBuf>,
    pub netns_override: bool,
}

impl Environment {
    /// Reads and checks the environment. `Ok(None)` means CNI_COMMAND is not
    /// set at all: the caller prints its about text instead of acting.
    pub fn load(source: &impl EnvSource) -> Result<Option<Self>> {
        let var = |name: &str| source.var(name).filter(|v| !v.is_empty());
        let Some(raw_command) = var(CNI_COMMAND) else {
            return Ok(None);
        };
        let command = Command::parse(&raw_command)
            .ok_or_else(|| Error::invalid_env(format!("unknown CNI_COMMAND: {raw_command}")))?;

        let missing: Vec<&str> = command
            .required()
            .iter()
            .copied()
            .filter(|name| var(name).is_none())
            .collect();
        if !missing.is_empty() {
            return Err(Error::invalid_env(format!(
                "required env variables [{}] missing",
                missing.join(",")
            )));
        }

        let container_id = var(CNI_CONTAINERID);
        if let Some(id) = &container_id {
            validate_container_id(id)?;
        }
        let ifname = var(CNI_IFNAME);
        if let Some(name) = &ifname {
            validate_interface_name(name)?;
        }
        let path = var(CNI_PATH).map(|p| split_path(&p)).unwrap_or_default();
        let netns_override =
            var(CNI_NETNS_OVERRIDE).is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));

        Ok(Some(Environment {
            command,
            container_id,
            netns: var(CNI_NETNS).map(PathBuf::from),
            ifname,
            raw_args: var(CNI_ARGS).unwrap_or_default(),
            path,
            netns_override,
        }))
    }

    /// CNI_ARGS, parsed. Only a plugin that takes arguments from it calls
    /// this: the reference loopback never reads the variable, so a value
    /// it could not parse does not fail it.
    pub fn args(&self) -> Result<CniArgs> {
        CniArgs::parse(&self.raw_args)
    }
}

/// What one invocation's records are about: the verb, the container, and
/// the pod when the runtime names it (Kubernetes' `CNI_ARGS`). The labels
/// of its log records and of what it tells the node agent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Invocation {
    pub verb: String,
    pub container_id: String,
    pub pod_namespace: String,
    pub pod_name: String,
}

impl Invocation {
    /// From the checked environment. The pod is read leniently from
    /// `CNI_ARGS` (see [`lenient_value`]): labels must never fail a call.
    pub fn of(env: &Environment) -> Invocation {
        let arg = |key| lenient_value(&env.raw_args, key).unwrap_or_default().to_owned();
        Invocation {
            verb: env.command.as_str().to_owned(),
            container_id: env.container_id.clone().unwrap_or_default(),
            pod_namespace: arg("K8S_POD_NAMESPACE"),
            pod_name: arg("K8S_POD_NAME"),
        }
    }
}

/// `CNI_PATH` entries, in order, without empty ones.
pub fn split_path(raw: &str) -> Vec<PathBuf> {
    raw.split(':')
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .collect()
}

/// libcni's `cniValidNameChars`: `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`, used for
/// container IDs and network names.
pub fn is_valid_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

pub fn validate_container_id(id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(Error::new(
            crate::error::Code::UnknownContainer,
            "missing containerID",
        ));
    }
    if !is_valid_name(id) {
        return Err(Error::invalid_env("invalid characters in containerID").with_details(id));
    }
    Ok(())
}

/// The kernel's rules for a link name, as libcni checks them.
pub fn validate_interface_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid_env("interface name is empty"));
    }
    if name.len() > 15 {
        return Err(Error::invalid_env("interface name is too long")
            .with_details("interface name should be less than 16 characters"));
    }
    if name == "." || name == ".." {
        return Err(Error::invalid_env("interface name is . or .."));
    }
    if name.chars().any(|c| c == '/' || c == ':' || c.is_whitespace()) {
        return Err(Error::invalid_env(
            "interface name contains / or : or whitespace characters",
        ));
    }
    Ok(())
}

pub fn validate_network_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid_config("missing network name"));
    }
    if !is_valid_name(name) {
        return Err(Error::invalid_config("invalid characters found in network name").with_details(name));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn loaded(pairs: &[(&str, &str)]) -> Environment {
        Environment::load(&env(pairs)).expect("valid").expect("a command")
    }

    #[test]
    fn an_invocation_names_its_verb_container_and_pod() {
        let add = loaded(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "1a2b3c4d5e6f7a8b"),
            ("CNI_NETNS", "/run/netns/p"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-1;K8S_POD_INFRA_CONTAINER_ID=1a2b",
            ),
        ]);
        assert_eq!(
            Invocation::of(&add),
            Invocation {
                verb: "ADD".into(),
                container_id: "1a2b3c4d5e6f7a8b".into(),
                pod_namespace: "default".into(),
                pod_name: "web-1".into(),
            }
        );
    }

    #[test]
    fn a_malformed_cni_args_still_names_what_it_can() {
        let gc = loaded(&[
            ("CNI_COMMAND", "GC"),
            ("CNI_PATH", "/opt/cni/bin"),
            ("CNI_ARGS", "garbage;K8S_POD_NAME=web-2;=;"),
        ]);
        assert_eq!(
            Invocation::of(&gc),
            Invocation {
                verb: "GC".into(),
                pod_name: "web-2".into(),
                ..Invocation::default()
            }
        );
    }

    fn full(command: &str) -> BTreeMap<String, String> {
        env(&[
            (CNI_COMMAND, command),
            (CNI_CONTAINERID, "abc123"),
            (CNI_NETNS, "/var/run/netns/pod"),
            (CNI_IFNAME, "eth0"),
            (CNI_PATH, "/opt/cni/bin::/usr/lib/cni"),
            (CNI_ARGS, "IgnoreUnknown=1;K8S_POD_NAME=p"),
        ])
    }

    #[test]
    fn no_command_means_about() {
        assert_eq!(Environment::load(&env(&[])).expect("no error"), None);
        assert_eq!(
            Environment::load(&env(&[(CNI_COMMAND, "")])).expect("no error"),
            None
        );
    }

    #[test]
    fn unknown_command_is_invalid_environment() {
        let err = Environment::load(&env(&[(CNI_COMMAND, "add")])).expect_err("lowercase");
        assert!(err.has_code(Code::InvalidEnvironment));
        assert_eq!(err.msg, "unknown CNI_COMMAND: add");
    }

    #[test]
    fn reads_a_full_add() {
        let e = Environment::load(&full("ADD"))
            .expect("valid")
            .expect("a command");
        assert_eq!(e.command, Command::Add);
        assert_eq!(e.container_id.as_deref(), Some("abc123"));
        assert_eq!(
            e.path,
            [PathBuf::from("/opt/cni/bin"), PathBuf::from("/usr/lib/cni")]
        );
        assert_eq!(e.args().expect("valid").get("K8S_POD_NAME"), Some("p"));
        assert!(!e.netns_override);
    }

    #[test]
    fn cni_args_are_parsed_only_when_asked_for() {
        let mut e = full("ADD");
        e.insert(CNI_ARGS.into(), "none".into());
        let loaded = Environment::load(&e).expect("valid").expect("a command");
        let err = loaded.args().expect_err("not a pair");
        assert!(err.has_code(Code::InvalidEnvironment));
        assert_eq!(err.msg, "invalid CNI_ARGS pair \"none\"");
    }

    #[test]
    fn missing_variables_are_named_per_verb() {
        let cases: [(&str, &[&str], &str); 7] = [
            (
                "ADD",
                &[CNI_NETNS, CNI_IFNAME],
                "required env variables [CNI_NETNS,CNI_IFNAME] missing",
            ),
            (
                "CHECK",
                &[CNI_CONTAINERID],
                "required env variables [CNI_CONTAINERID] missing",
            ),
            (
                "DEL",
                &[CNI_IFNAME],
                "required env variables [CNI_IFNAME] missing",
            ),
            ("GC", &[CNI_PATH], "required env variables [CNI_PATH] missing"),
            // As Debian's 1.1.1 skeleton: CNI_PATH for every verb but STATUS.
            ("ADD", &[CNI_PATH], "required env variables [CNI_PATH] missing"),
            ("CHECK", &[CNI_PATH], "required env variables [CNI_PATH] missing"),
            (
                "DEL",
                &[CNI_CONTAINERID, CNI_PATH],
                "required env variables [CNI_CONTAINERID,CNI_PATH] missing",
            ),
        ];
        for (command, drop, msg) in cases {
            let mut e = full(command);
            for name in drop {
                e.insert(name.to_string(), String::new());
            }
            let err = Environment::load(&e).expect_err("missing");
            assert!(err.has_code(Code::InvalidEnvironment), "{command}");
            assert_eq!(err.msg, msg);
        }
    }

    #[test]
    fn del_status_and_version_need_less() {
        let mut del = full("DEL");
        del.remove(CNI_NETNS);
        assert_eq!(Environment::load(&del).expect("valid").expect("cmd").netns, None);
        for verb in ["STATUS", "VERSION"] {
            assert!(
                Environment::load(&env(&[(CNI_COMMAND, verb)]))
                    .expect("valid")
                    .is_some()
            );
        }
        let gc = env(&[(CNI_COMMAND, "GC"), (CNI_PATH, "/opt/cni/bin")]);
        assert!(Environment::load(&gc).expect("valid").is_some());
    }

    #[test]
    fn container_id_follows_libcni_regex() {
        for good in ["a", "A1", "0abc", "pod_1.x-y", "cnitool-0123456789abcdef0123"] {
            assert!(validate_container_id(good).is_ok(), "{good}");
        }
        for bad in ["-a", "_a", ".a", "a/b", "a b", "a:b", "ä"] {
            let err = validate_container_id(bad).expect_err(bad);
            assert!(err.has_code(Code::InvalidEnvironment), "{bad}");
            assert_eq!(err.details, bad);
        }
        let mut e = full("ADD");
        e.insert(CNI_CONTAINERID.into(), "../etc".into());
        assert!(
            Environment::load(&e)
                .expect_err("bad id")
                .msg
                .contains("containerID")
        );
    }

    #[test]
    fn interface_names_follow_the_kernel() {
        for good in ["eth0", "a", "123456789012345", "net1.100", "é"] {
            assert!(validate_interface_name(good).is_ok(), "{good}");
        }
        let cases = [
            ("1234567890123456", "interface name is too long"),
            ("ééééééééé", "interface name is too long"),
            (".", "interface name is . or .."),
            ("..", "interface name is . or .."),
            ("a/b", "interface name contains / or : or whitespace characters"),
            ("a:b", "interface name contains / or : or whitespace characters"),
            ("a b", "interface name contains / or : or whitespace characters"),
            ("a\tb", "interface name contains / or : or whitespace characters"),
        ];
        for (bad, msg) in cases {
            let err = validate_interface_name(bad).expect_err(bad);
            assert!(err.has_code(Code::InvalidEnvironment));
            assert_eq!(err.msg, msg, "{bad}");
        }
    }

    #[test]
    fn netns_override_accepts_go_booleans() {
        for (value, expected) in [
            ("1", true),
            ("true", true),
            ("TRUE", true),
            ("0", false),
            ("yes", false),
        ] {
            let mut e = full("ADD");
            e.insert(CNI_NETNS_OVERRIDE.into(), value.into());
            assert_eq!(
                Environment::load(&e).expect("valid").expect("cmd").netns_override,
                expected
            );
        }
    }

    #[test]
    fn network_names_follow_libcni_regex() {
        assert!(validate_network_name("cni-bridge_1.x").is_ok());
        assert_eq!(
            validate_network_name("").expect_err("empty").msg,
            "missing network name"
        );
        let err = validate_network_name(".hidden").expect_err("dot");
        assert!(err.has_code(Code::InvalidConfig));
        assert_eq!(err.msg, "invalid characters found in network name");
    }
}
