use std::cell::RefCell;
use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::json;

use super::*;
use crate::result::IpConfig;

#[derive(Deserialize)]
struct FakeConfig {
    #[serde(default)]
    fail_with: Option<u32>,
}

#[derive(Default)]
struct Fake {
    calls: RefCell<Vec<(Command, Option<Attachment>)>>,
}

impl Fake {
    fn record(&self, command: Command, attachment: Option<&Attachment>, req: &Request) -> Result<()> {
        self.calls.borrow_mut().push((command, attachment.cloned()));
        match req.conf.plugin_config::<FakeConfig>()?.fail_with {
            Some(code) => Err(Error::plugin(code, "asked to fail")),
            None => Ok(()),
        }
    }
}

impl Plugin for Fake {
    const NAME: &'static str = "fake";
    const KEYS: Shape = keys::PLAIN_PLUGIN;

    fn add(&self, req: &Request, att: &Attachment) -> Result<CniResult> {
        self.record(Command::Add, Some(att), req)?;
        Ok(CniResult {
            ips: vec![IpConfig {
                address: "10.0.0.2/24".parse().map_err(|_| Error::internal("test"))?,
                gateway: None,
                interface: None,
            }],
            ..CniResult::default()
        })
    }

    fn check(&self, req: &Request, att: &Attachment) -> Result<()> {
        self.record(Command::Check, Some(att), req)
    }

    fn del(&self, req: &Request, att: &Attachment) -> Result<()> {
        self.record(Command::Del, Some(att), req)
    }

    fn gc(&self, req: &Request) -> Result<()> {
        self.record(Command::Gc, None, req)
    }

    fn status(&self, req: &Request) -> Result<()> {
        self.record(Command::Status, None, req)
    }
}

/// A pod netns path that exists and is not ours: another process's would
/// do, but a regular file is enough for the identity check.
fn foreign_netns() -> String {
    "/proc/1/ns/net-does-not-matter".to_owned()
}

fn env(command: &str) -> BTreeMap<String, String> {
    [
        ("CNI_COMMAND", command.to_owned()),
        ("CNI_CONTAINERID", "ctr1".to_owned()),
        ("CNI_NETNS", foreign_netns()),
        ("CNI_IFNAME", "eth0".to_owned()),
        ("CNI_PATH", "/opt/cni/bin".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

fn run_with(plugin: &Fake, env: &BTreeMap<String, String>, stdin: &str) -> Reply {
    let stdin = stdin.as_bytes().to_vec();
    dispatch(plugin, env, move || Ok(stdin))
}

fn conf(version: &str) -> String {
    json!({"cniVersion": version, "name": "net1", "type": "fake"}).to_string()
}

fn failed(reply: Reply) -> (Error, Version) {
    match reply {
        Reply::Failed(e, v) => (e, v),
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn no_command_prints_the_about_text() {
    let reply = run_with(&Fake::default(), &BTreeMap::new(), "");
    let Reply::About(text) = reply else {
        panic!("expected about text")
    };
    assert!(text.starts_with("CNI fake plugin v"), "{text}");
    assert!(
        text.contains("CNI protocol versions supported: 0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0")
    );
}

#[test]
fn version_answers_with_empty_stdin_and_echoes_a_known_version() {
    let all = json!(["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]);
    let bare = BTreeMap::from([("CNI_COMMAND".to_owned(), "VERSION".to_owned())]);
    assert_eq!(
        run_with(&Fake::default(), &bare, ""),
        Reply::Document(json!({"cniVersion": "1.1.0", "supportedVersions": all}))
    );
    assert_eq!(
        run_with(&Fake::default(), &bare, r#"{"cniVersion":"0.3.1"}"#),
        Reply::Document(json!({"cniVersion": "0.3.1", "supportedVersions": all}))
    );
    assert_eq!(
        run_with(&Fake::default(), &bare, r#"{"cniVersion":"9.0.0"}"#),
        Reply::Document(json!({"cniVersion": "1.1.0", "supportedVersions": all}))
    );
}

#[test]
fn environment_errors_come_first_with_code_4() {
    let mut e = env("ADD");
    e.remove("CNI_NETNS");
    let (err, version) = failed(run_with(&Fake::default(), &e, "not even json"));
    assert!(err.has_code(Code::InvalidEnvironment));
    assert_eq!(err.msg, "required env variables [CNI_NETNS] missing");
    assert_eq!(version, Version::LATEST);
}

#[test]
fn stdin_errors_map_to_decode_and_io() {
    let (err, _) = failed(run_with(&Fake::default(), &env("ADD"), "{oops"));
    assert!(err.has_code(Code::Decoding));
    let reply = dispatch(&Fake::default(), &env("ADD"), || Err(io::Error::other("closed")));
    assert!(failed(reply).0.has_code(Code::Io));
}

#[test]
fn unsupported_versions_are_error_1() {
    let (err, _) = failed(run_with(&Fake::default(), &env("ADD"), &conf("0.5.0")));
    assert!(err.has_code(Code::IncompatibleVersion));
    assert_eq!(err.msg, "incompatible CNI versions");
}

#[test]
fn verbs_are_gated_by_version_like_the_reference_skel() {
    let cases = [
        ("CHECK", "0.3.1", "config version does not allow CHECK"),
        ("CHECK", "0.1.0", "config version does not allow CHECK"),
        ("GC", "1.0.0", "config version does not allow GC"),
        ("STATUS", "0.4.0", "config version does not allow STATUS"),
    ];
    for (verb, version, msg) in cases {
        let plugin = Fake::default();
        let (err, v) = failed(run_with(&plugin, &env(verb), &conf(version)));
        assert!(err.has_code(Code::IncompatibleVersion), "{verb} {version}");
        assert_eq!(err.msg, msg);
        assert_eq!(v.as_str(), version, "the error speaks the config's version");
        assert!(plugin.calls.borrow().is_empty(), "handler must not run");
    }
    for (verb, version) in [
        ("CHECK", "0.4.0"),
        ("CHECK", "1.0.0"),
        ("GC", "1.1.0"),
        ("STATUS", "1.1.0"),
    ] {
        let plugin = Fake::default();
        assert_eq!(
            run_with(&plugin, &env(verb), &conf(version)),
            Reply::Done,
            "{verb} {version}"
        );
        assert_eq!(plugin.calls.borrow().len(), 1);
    }
}

#[test]
fn configuration_errors_are_code_7() {
    let (err, _) = failed(run_with(
        &Fake::default(),
        &env("ADD"),
        r#"{"cniVersion":"1.0.0"}"#,
    ));
    assert!(err.has_code(Code::InvalidConfig));
    assert_eq!(err.msg, "missing network name");
    let bad_plugin_key = r#"{"cniVersion":"1.0.0","name":"n","type":"fake","fail_with":"x"}"#;
    let (err, _) = failed(run_with(&Fake::default(), &env("ADD"), bad_plugin_key));
    assert!(err.has_code(Code::InvalidConfig));
    let bad_level = r#"{"cniVersion":"1.0.0","name":"n","logLevel":"loud"}"#;
    assert!(
        failed(run_with(&Fake::default(), &env("DEL"), bad_level))
            .0
            .has_code(Code::InvalidConfig)
    );
}

#[test]
fn add_result_is_printed_in_the_configs_version() {
    for version in Version::ALL {
        let reply = run_with(&Fake::default(), &env("ADD"), &conf(version.as_str()));
        let Reply::Document(doc) = reply else {
            panic!("{version}: expected a result")
        };
        assert_eq!(doc["cniVersion"], version.as_str());
        match version.result_shape() {
            crate::version::ResultShape::Legacy => assert_eq!(doc["ip4"]["ip"], "10.0.0.2/24"),
            crate::version::ResultShape::Versioned => assert_eq!(doc["ips"][0]["version"], "4"),
            crate::version::ResultShape::Current => assert!(doc["ips"][0].get("version").is_none()),
        }
    }
}

#[test]
fn plugin_errors_keep_their_code_and_speak_the_configs_version() {
    let stdin = r#"{"cniVersion":"0.4.0","name":"n","fail_with":123}"#;
    let (err, version) = failed(run_with(&Fake::default(), &env("DEL"), stdin));
    assert_eq!(err.code, 123);
    assert_eq!(version, Version::V0_4_0);
}

#[test]
fn del_accepts_an_empty_netns() {
    let plugin = Fake::default();
    let mut e = env("DEL");
    e.insert("CNI_NETNS".into(), String::new());
    assert_eq!(run_with(&plugin, &e, &conf("1.0.0")), Reply::Done);
    let calls = plugin.calls.borrow();
    let (_, Some(att)) = &calls[0] else {
        panic!("attachment expected")
    };
    assert_eq!(att.netns, None);
    assert_eq!((att.container_id.as_str(), att.ifname.as_str()), ("ctr1", "eth0"));
}

#[test]
fn the_plugins_own_netns_is_refused_unless_overridden() {
    let plugin = Fake::default();
    let mut e = env("ADD");
    e.insert("CNI_NETNS".into(), "/proc/self/ns/net".into());
    let (err, _) = failed(run_with(&plugin, &e, &conf("1.0.0")));
    assert!(err.has_code(Code::InvalidNetns));
    assert!(
        plugin.calls.borrow().is_empty(),
        "nothing may be done in our own netns"
    );
    e.insert("CNI_NETNS_OVERRIDE".into(), "1".into());
    assert!(matches!(
        run_with(&plugin, &e, &conf("1.0.0")),
        Reply::Document(_)
    ));
}

#[test]
fn go_style_indentation() {
    assert_eq!(
        to_pretty_json(&json!({"a":[1]})),
        "{\n    \"a\": [\n        1\n    ]\n}"
    );
}

#[test]
fn an_outcome_names_the_addresses_of_a_result_of_any_version() {
    assert_eq!(
        succeeded(&json!({"cniVersion": "1.0.0",
            "ips": [{"address": "10.244.1.5/24"}, {"address": "fd00::5/64"}]})),
        "ok, 10.244.1.5/24, fd00::5/64"
    );
    assert_eq!(
        succeeded(&json!({"cniVersion": "0.2.0", "ip4": {"ip": "10.0.0.2/24"}})),
        "ok, 10.0.0.2/24"
    );
    assert_eq!(succeeded(&json!({"cniVersion": "1.0.0"})), "ok");
}
