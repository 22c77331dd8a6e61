//! The node agent at the edges of what it is given: a NetworkPolicy gate
//! whose path holds something that is no former agent's socket, a soft
//! limit on open files far under the hard one, more idle health
//! connections than it answers at once, and the xtables lock held by
//! another tool while a masquerade update and a policy pass are both due.

use std::fs::File;
use std::net::TcpStream;
use std::os::unix::fs::{MetadataExt, symlink};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::Duration;

use agent_wire::policy::{Admission, Answer};
use serde_json::{Value, json};
use test_kit::fakes::api_server::ApiServer;
use test_kit::node_agent::{Agent, lab_node, node_object, probe, uplink};
use test_kit::{Node, require_root, wait_for};

use crate::common::{sample, scrape};

const TOKEN: &str = "limits-token";
const POLICY_ON: (&str, &str) = ("NETWORK_POLICY", "true");
const APPLIED: &str = "cni_suite_policy_syncs_total{result=\"success\"}";
const GATE_UP: &str = "cni_suite_policy_gate_up";
const GATE_DOWN: &str = "the NetworkPolicy gate does not listen";
/// How long anything here may take on a loaded machine: a bound on the
/// wait, not a target.
const LIMIT: Duration = Duration::from_secs(60);

/// The API test server of `node`, with its Node `n1` and the namespace
/// `shop`.
fn api_server(node: &Node) -> ApiServer {
    uplink(node);
    let server = ApiServer::start(node.netns.path(), TOKEN);
    server.apply_node(node_object("n1", &["10.244.1.0/24"], &["10.250.0.11"]));
    server.apply_namespace(json!({"metadata": {"name": "shop"}}));
    server
}

/// A running Pod `name` of `shop` on n1 at `ip`, labelled `app: <name>`
/// (no sandbox: policy reads only the object).
fn pod_object(name: &str, ip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"), "labels": {"app": name}},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    })
}

/// What the agent's gate at `socket` answers for `shop/<name>` at `ip`.
fn admitted(socket: &Path, name: &str, ip: &str) -> std::io::Result<Answer> {
    let admission = Admission {
        pod_namespace: "shop".into(),
        pod_name: name.into(),
        container_id: format!("container-{name}"),
        ips: vec![ip.parse().expect("an address")],
    };
    agent_wire::policy::ask(socket, &admission, agent_wire::policy::WAIT)
}

/// What can be in the way at the gate's path, none of it the agent's to
/// remove.
#[derive(Debug, Clone, Copy)]
enum InTheWay {
    File,
    Directory,
    Link,
    AnotherUsersSocket,
}

impl InTheWay {
    /// Puts it at `path`; what must stay to keep it (a listener).
    fn put(self, node: &Node, path: &Path) -> Option<UnixListener> {
        match self {
            InTheWay::File => std::fs::write(path, "left by someone").expect("a file"),
            InTheWay::Directory => std::fs::create_dir(path).expect("a directory"),
            InTheWay::Link => {
                let target = node.path("elsewhere");
                std::fs::write(&target, "someone's").expect("a file");
                symlink(&target, path).expect("a link");
            }
            InTheWay::AnotherUsersSocket => {
                let listener = UnixListener::bind(path).expect("a socket");
                std::os::unix::fs::lchown(path, Some(4242), Some(4242)).expect("chown");
                return Some(listener);
            }
        }
        None
    }

    fn remove(self, path: &Path) {
        match self {
            InTheWay::Directory => std::fs::remove_dir(path),
            _ => std::fs::remove_file(path),
        }
        .expect("removed");
    }
}

#[test]
fn what_is_in_the_gates_way_is_left_the_agent_not_ready_until_it_goes_then_it_listens() {
    require_root();
    for in_the_way in [
        InTheWay::File,
        InTheWay::Directory,
        InTheWay::Link,
        InTheWay::AnotherUsersSocket,
    ] {
        let node = lab_node();
        let server = api_server(&node);
        server.add_pod("shop", "web", pod_object("web", "10.244.1.7"));
        let socket = node.path("run/policy.sock");
        std::fs::create_dir_all(node.path("run")).expect("the run directory");
        let _kept = in_the_way.put(&node, &socket);
        let before = std::fs::symlink_metadata(&socket).expect("in the way");
        let agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &[POLICY_ON]);

        // Everything else in place, the gate alone is missing.
        wait_for(
            &format!("not ready for the gate alone ({in_the_way:?})"),
            LIMIT,
            || {
                agent
                    .probe(&node, "/readyz")
                    .is_some_and(|(code, body)| code == 503 && body.contains(GATE_DOWN))
            },
        );
        let exposition = scrape(&node, &agent).1;
        assert_eq!(sample(&exposition, GATE_UP), Some(0.0), "{exposition}");
        // Policy is enforced meanwhile: only new pods go unconfirmed.
        wait_for("a policy pass", LIMIT, || {
            sample(&scrape(&node, &agent).1, APPLIED).is_some_and(|n| n >= 1.0)
        });
        let now = std::fs::symlink_metadata(&socket).expect("still there");
        assert_eq!(
            (now.ino(), now.uid(), now.file_type()),
            (before.ino(), before.uid(), before.file_type()),
            "{in_the_way:?} left as it is"
        );
        if matches!(in_the_way, InTheWay::Link) {
            let target = std::fs::read_to_string(node.path("elsewhere")).expect("the link's target");
            assert_eq!(target, "someone's");
        }

        // Once it goes, the agent binds the gate and is ready.
        in_the_way.remove(&socket);
        wait_for(&format!("ready once the {in_the_way:?} went"), LIMIT, || {
            agent.ready(&node)
        });
        assert_eq!(sample(&scrape(&node, &agent).1, GATE_UP), Some(1.0));
        assert_eq!(
            admitted(&socket, "web", "10.244.1.7").expect("the gate answers"),
            Answer::Enforced
        );

        // A socket someone removed is bound again.
        std::fs::remove_file(&socket).expect("the agent's socket");
        wait_for("the gate bound again", LIMIT, || {
            admitted(&socket, "web", "10.244.1.7").is_ok_and(|answer| answer == Answer::Enforced)
        });
        assert!(agent.ready(&node));

        // Killed, the agent leaves its socket: the next one's to replace.
        let mut agent = agent;
        agent.kill();
        assert!(
            std::fs::symlink_metadata(&socket).is_ok(),
            "left by the killed agent"
        );
        let agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &[POLICY_ON]);
        wait_for("the next agent ready", LIMIT, || agent.ready(&node));
        assert_eq!(
            admitted(&socket, "web", "10.244.1.7").expect("the gate answers"),
            Answer::Enforced
        );
        drop(agent);
    }
}

/// A process's soft and hard limits on open files.
fn open_file_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .expect("a line for open files");
    let words: Vec<&str> = line.split_whitespace().collect();
    (words[3].to_owned(), words[4].to_owned())
}

fn open_files(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fds").count()
}

#[test]
fn the_soft_open_file_limit_is_raised_to_the_hard_one() {
    require_root();
    let node = lab_node();
    let server = api_server(&node);
    // As containerd 2.x starts a container (1024 soft), lower still,
    // under the hard limit this test has (it may not raise it).
    let (_, hard) = open_file_limits(std::process::id());
    let limits = format!("--nofile=256:{hard}");
    let agent = Agent::start_under(
        &node,
        "n1",
        &server,
        "127.0.0.1",
        TOKEN,
        &[],
        &["prlimit", &limits, "--"],
    );
    wait_for("readiness", LIMIT, || agent.ready(&node));
    assert_eq!(
        open_file_limits(agent.pid().expect("running")),
        (hard.clone(), hard)
    );
}

#[test]
fn idle_health_connections_past_the_cap_are_closed_unanswered_and_hold_no_descriptors() {
    require_root();
    let node = lab_node();
    let server = api_server(&node);
    let agent = Agent::start(&node, "n1", &server, "127.0.0.1", TOKEN, &[]);
    wait_for("readiness", LIMIT, || agent.ready(&node));
    let pid = agent.pid().expect("running");

    // Clients that connect and send nothing, more than the cap (64).
    let before = open_files(pid);
    let ns = netns::NetNs::open(node.netns.path()).expect("netns");
    let idle: Vec<TcpStream> = ns
        .run(|| {
            (0..300)
                .map(|_| TcpStream::connect(("127.0.0.1", agent.health)).expect("connect"))
                .collect()
        })
        .expect("enter");
    assert_eq!(
        probe(&node, agent.health, "/healthz"),
        None,
        "past the cap a connection is closed unanswered"
    );
    let held = open_files(pid);
    assert!(
        held < before + 100,
        "{held} descriptors open with 300 idle clients ({before} before)"
    );
    drop(idle);
    wait_for("answered once they went", LIMIT, || {
        probe(&node, agent.health, "/healthz").is_some_and(|(code, _)| code == 200)
    });
    assert!(agent.ready(&node));
}

/// A directory of iptables-legacy's commands under the names the agent
/// runs (as Debian's alternatives make them), for PATH.
fn legacy_iptables(node: &Node) -> String {
    let dir = node.path("legacy");
    std::fs::create_dir(&dir).expect("a directory");
    for family in ["iptables", "ip6tables"] {
        for verb in ["save", "restore"] {
            symlink(
                format!("/usr/sbin/{family}-legacy-{verb}"),
                dir.join(format!("{family}-{verb}")),
            )
            .expect("a link");
        }
    }
    let path = std::env::var("PATH").unwrap_or_default();
    format!("{}:{path}", dir.display())
}

/// Whether a child of `pid` is an `iptables-restore` (its name cut to 15
/// characters by the kernel).
fn restoring(pid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let Some((name, rest)) = stat.split_once(") ") else {
            return false;
        };
        let parent = rest.split_whitespace().nth(1).unwrap_or_default();
        name.ends_with("(iptables-restor") && parent == pid.to_string()
    })
}

/// The xtables lock at `path`, held as iptables-legacy holds it.
fn hold_xtables_lock(path: &Path) -> File {
    let lock = File::create(path).expect("the lock file");
    lock.lock().expect("flock");
    lock
}

fn nat_rules(node: &Node) -> String {
    node.run("iptables-legacy-save", &["-t", "nat"]).success().stdout
}

#[test]
fn with_the_xtables_lock_held_by_another_tool_policy_passes_go_on_and_uninstall_ends() {
    require_root();
    let node = lab_node();
    let server = api_server(&node);
    server.add_pod("shop", "db", pod_object("db", "10.244.1.50"));
    let path = legacy_iptables(&node);
    let lock_path = node.path("xtables.lock");
    let lock_file = lock_path.to_str().expect("UTF-8");
    let mut agent = Agent::start(
        &node,
        "n1",
        &server,
        "127.0.0.1",
        TOKEN,
        &[
            POLICY_ON,
            ("PATH", path.as_str()),
            // The node's own lock: the machine's is other tools' to take.
            ("XTABLES_LOCKFILE", lock_file),
            ("UNINSTALL_ON_STOP", "true"),
        ],
    );
    wait_for("readiness", LIMIT, || agent.ready(&node));
    wait_for("a policy pass", LIMIT, || {
        sample(&scrape(&node, &agent).1, APPLIED).is_some_and(|n| n >= 1.0)
    });
    assert!(
        nat_rules(&node).contains("-A CNI-SUITE-EGRESS"),
        "masqueraded through iptables-legacy"
    );
    let pid = agent.pid().expect("running");

    // Another tool holds the lock while a new Node changes the masquerade.
    let lock = hold_xtables_lock(&lock_path);
    server.apply_node(node_object("n2", &["10.244.2.0/24"], &["10.250.0.12"]));
    wait_for("the masquerade update waiting for the lock", LIMIT, || {
        restoring(pid)
    });
    // db isolated: a pass that changes the table.
    server.apply_network_policy(json!({
        "metadata": {"name": "db-alone", "namespace": "shop"},
        "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"]},
    }));
    wait_for("the policy in the kernel", LIMIT, || {
        node.run("nft", &["list", "table", "inet", netpol::TABLE])
            .stdout
            .contains("10.244.1.50")
    });
    wait_for("the masquerade update given up", LIMIT, || {
        sample(
            &scrape(&node, &agent).1,
            "cni_suite_egress_syncs_total{result=\"failure\"}",
        )
        .is_some_and(|n| n >= 1.0)
    });

    // Once the lock is free, the next change of the Nodes puts it in.
    drop(lock);
    server.apply_node(node_object("n3", &["10.244.5.0/24"], &["10.250.0.13"]));
    wait_for("the masquerade updated", LIMIT, || {
        nat_rules(&node).contains("-A CNI-SUITE-EGRESS -d 10.244.2.0/24")
    });
    wait_for("ready again", LIMIT, || agent.ready(&node));

    // A lock held forever does not keep uninstall waiting forever.
    let _forever = hold_xtables_lock(&lock_path);
    server.apply_node(node_object("n4", &["10.244.7.0/24"], &["10.250.0.14"]));
    wait_for("the masquerade update waiting for the lock", LIMIT, || {
        restoring(pid)
    });
    let pid = pid.to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    let (status, log) = agent
        .exited(Duration::from_secs(60))
        .expect("the agent ends with the lock still held");
    assert!(status.success(), "{log}");
    assert!(
        log.contains("xtables lock"),
        "the masquerade's failure said: {log}"
    );
}
