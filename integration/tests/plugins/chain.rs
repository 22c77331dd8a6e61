//! cnictl runs a chain the way libcni does: what each plugin receives on
//! stdin and in its environment, the order of DEL, the cached result, CHECK's
//! switch and the rollback of a failed ADD. A recording plugin (a shell
//! script on CNI_PATH) sits in the chain next to the real loopback.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use test_kit::{Node, bin_dir, cnitool_container_id};

const RECORDER: &str = r#"#!/bin/sh
set -e
calls="$(dirname "$0")/calls"
mkdir -p "$calls"
n=$(ls "$calls" | grep -c '\.stdin$' || true)
id=$(printf '%03d' "$n")
cat > "$calls/$id.stdin"
lo=$(nsenter --net="$CNI_NETNS" ip -o link show lo 2>/dev/null | grep -o '<[^>]*>' || echo none)
printf '%s\n' "$CNI_COMMAND" "$CNI_CONTAINERID" "$CNI_IFNAME" "$CNI_ARGS" "$lo" > "$calls/$id.env"
if [ "$CNI_COMMAND" = ADD ] && grep -q '"fail":true' "$calls/$id.stdin"; then
  echo '{"code":150,"msg":"recorder asked to fail"}'
  exit 1
fi
if [ "$CNI_COMMAND" = ADD ]; then
  echo '{"cniVersion":"1.0.0","ips":[{"address":"10.1.2.3/24","gateway":"10.1.2.1"}],"dns":{}}'
fi
"#;

/// One recorded invocation.
#[derive(Debug)]
struct Call {
    command: String,
    container_id: String,
    ifname: String,
    cni_args: String,
    /// The pod's lo flags when the plugin ran.
    lo_flags: String,
    stdin: Value,
}

struct Recorder {
    dir: PathBuf,
}

impl Recorder {
    fn install(node: &Node) -> Self {
        let dir = node.path("fakes");
        fs::create_dir_all(&dir).expect("mkdir");
        let script = dir.join("recorder");
        fs::write(&script, RECORDER).expect("write recorder");
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).expect("chmod");
        Recorder { dir }
    }

    /// CNI_PATH with the recorder first, then the suite.
    fn cni_path(&self) -> String {
        format!("{}:{}", self.dir.display(), bin_dir().display())
    }

    fn calls(&self) -> Vec<Call> {
        let calls = self.dir.join("calls");
        let mut ids: Vec<String> = fs::read_dir(&calls)
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.file_name().to_str()?.strip_suffix(".stdin").map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        ids.iter().map(|id| read_call(&calls, id)).collect()
    }
}

fn read_call(dir: &Path, id: &str) -> Call {
    let env = fs::read_to_string(dir.join(format!("{id}.env"))).expect("env recorded");
    let mut lines = env.lines().map(str::to_owned);
    let mut next = || lines.next().unwrap_or_default();
    let (command, container_id, ifname, cni_args, lo_flags) = (next(), next(), next(), next(), next());
    let stdin = serde_json::from_slice(&fs::read(dir.join(format!("{id}.stdin"))).expect("stdin recorded"))
        .expect("the plugin got JSON on stdin");
    Call {
        command,
        container_id,
        ifname,
        cni_args,
        lo_flags,
        stdin,
    }
}

fn chain(node: &Node, version: &str, disable_check: bool, recorder_extra: Value) {
    let mut recorder = json!({"type": "recorder", "custom": 1,
        "capabilities": {"portMappings": true, "mac": false}});
    if let (Some(target), Value::Object(extra)) = (recorder.as_object_mut(), recorder_extra) {
        target.extend(extra);
    }
    node.write_conf(
        "10-chain.conflist",
        &json!({"cniVersion": version, "name": "chain", "disableCheck": disable_check,
                "plugins": [{"type": "loopback"}, recorder]}),
    );
}

const CAP_ARGS: &str =
    r#"{"portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"tcp"}],"mac":"c2:00:00:00:00:01"}"#;
const CNI_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAME=web-0";

#[test]
fn add_then_del_feed_each_plugin_what_libcni_would() {
    let node = Node::new();
    let pod = node.pod("pod");
    let recorder = Recorder::install(&node);
    chain(&node, "1.0.0", false, json!({}));
    let path = recorder.cni_path();
    let env = [
        ("CNI_PATH", path.as_str()),
        ("CAP_ARGS", CAP_ARGS),
        ("CNI_ARGS", CNI_ARGS),
    ];

    let added = node
        .cnictl_env(&["--json", "add", "chain", pod.path_str()], &env)
        .success()
        .json();
    assert_eq!(
        added,
        json!({"cniVersion": "1.0.0", "ips": [{"address": "10.1.2.3/24", "gateway": "10.1.2.1"}], "dns": {}}),
        "the last plugin's result is the chain's"
    );
    let id = cnitool_container_id(pod.path_str());
    let calls = recorder.calls();
    assert_eq!(calls.len(), 1);
    let add = &calls[0];
    assert_eq!(
        (
            add.command.as_str(),
            add.container_id.as_str(),
            add.ifname.as_str()
        ),
        ("ADD", id.as_str(), "eth0")
    );
    assert_eq!(add.cni_args, CNI_ARGS);
    assert_eq!(add.stdin["name"], "chain");
    assert_eq!(add.stdin["cniVersion"], "1.0.0");
    assert_eq!(add.stdin["custom"], 1, "plugin keys are passed through");
    assert_eq!(
        add.stdin["runtimeConfig"],
        json!({"portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]}),
        "only declared capabilities reach runtimeConfig"
    );
    assert_eq!(
        add.stdin["prevResult"]["interfaces"][0]["name"], "lo",
        "loopback's result is the prevResult"
    );
    assert_eq!(add.stdin["prevResult"]["ips"][0]["address"], "127.0.0.1/8");

    node.cnictl_env(&["check", "chain", pod.path_str()], &env)
        .success();
    let check = &recorder.calls()[1];
    assert_eq!(check.command, "CHECK");
    assert_eq!(check.stdin["prevResult"], added, "CHECK gets the cached result");

    node.cnictl_env(&["del", "chain", pod.path_str()], &env).success();
    let del = &recorder.calls()[2];
    assert_eq!(del.command, "DEL");
    assert_eq!(del.stdin["prevResult"], added, "DEL gets the cached result");
    assert!(
        del.lo_flags.contains("UP"),
        "DEL runs in reverse order: the recorder before loopback ({del:?})"
    );
    assert!(!pod.link_is_up("lo"), "then loopback's DEL");
    assert_eq!(del.cni_args, CNI_ARGS);
}

#[test]
fn check_is_skipped_when_the_list_disables_it() {
    let node = Node::new();
    let pod = node.pod("pod");
    let recorder = Recorder::install(&node);
    chain(&node, "1.1.0", true, json!({}));
    let path = recorder.cni_path();
    let env = [("CNI_PATH", path.as_str())];
    node.cnictl_env(&["add", "chain", pod.path_str()], &env).success();
    pod.ip(&["link", "set", "lo", "down"]).success();
    node.cnictl_env(&["check", "chain", pod.path_str()], &env)
        .success();
    let commands: Vec<String> = recorder.calls().into_iter().map(|c| c.command).collect();
    assert_eq!(commands, ["ADD"], "no plugin was asked to CHECK");
}

#[test]
fn a_failed_add_is_rolled_back_through_the_whole_chain() {
    let node = Node::new();
    let pod = node.pod("pod");
    let recorder = Recorder::install(&node);
    chain(&node, "0.4.0", false, json!({"fail": true}));
    let path = recorder.cni_path();
    let failed = node
        .cnictl_env(
            &["--json", "add", "chain", pod.path_str()],
            &[("CNI_PATH", path.as_str())],
        )
        .failure();
    let err = failed.json();
    assert_eq!(err["code"], 150, "the plugin's own code is kept: {failed:?}");
    assert_eq!(err["cniVersion"], "0.4.0");
    let commands: Vec<String> = recorder.calls().into_iter().map(|c| c.command).collect();
    assert_eq!(commands, ["ADD", "DEL"]);
    assert!(!pod.link_is_up("lo"), "loopback's ADD was undone");
    let id = cnitool_container_id(pod.path_str());
    assert!(
        node.cache_entry("chain", &id, "eth0").is_none(),
        "nothing is cached for a failed ADD"
    );
}

#[test]
fn gc_reaches_every_plugin_with_both_attachment_keys() {
    let node = Node::new();
    let pod = node.pod("pod");
    let recorder = Recorder::install(&node);
    chain(&node, "1.1.0", false, json!({}));
    let path = recorder.cni_path();
    let env = [("CNI_PATH", path.as_str())];
    node.cnictl_env(&["add", "chain", pod.path_str()], &env).success();
    let id = cnitool_container_id(pod.path_str());
    let valid = format!("{id}/eth0");
    node.cnictl_env(&["gc", "chain", "--valid", &valid], &env)
        .success();
    let gc = recorder.calls().pop().expect("a GC call");
    assert_eq!(gc.command, "GC");
    let expected = json!([{"containerID": id, "ifname": "eth0"}]);
    assert_eq!(gc.stdin["cni.dev/valid-attachments"], expected);
    assert_eq!(gc.stdin["cni.dev/attachments"], expected);
    assert_eq!(
        (gc.container_id.as_str(), gc.ifname.as_str()),
        ("", ""),
        "GC is not about one attachment"
    );
    assert!(pod.link_is_up("lo"), "a valid attachment is kept");
}
