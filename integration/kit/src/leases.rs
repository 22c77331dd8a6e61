//! host-local's leases seen from outside: a node with a data directory,
//! configurations as a bridge passes them, and what `cnictl ipam` lists.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::{LeaseService, Node, Run};

pub const NETWORK: &str = "hl-net";

/// A node with a data directory and, optionally, a lease service.
#[derive(Debug)]
pub struct Ipam {
    pub node: Node,
    pub data_dir: PathBuf,
    pub socket: String,
}

impl Ipam {
    /// Plugin processes open the database themselves ("socket": "").
    pub fn direct() -> Self {
        let node = Node::new();
        let data_dir = node.path("data");
        Ipam {
            node,
            data_dir,
            socket: String::new(),
        }
    }

    pub fn with_service(service: &LeaseService, node: Node) -> Self {
        Ipam::with_socket(node, &service.socket)
    }

    pub fn with_socket(node: Node, socket: &Path) -> Self {
        let data_dir = node.path("data");
        Ipam {
            node,
            data_dir,
            socket: socket.to_str().expect("UTF-8 path").to_owned(),
        }
    }

    pub fn data_dir(&self) -> &str {
        self.data_dir.to_str().expect("UTF-8 path")
    }

    /// A configuration as a bridge would pass it, host-local in `ipam`.
    pub fn conf(&self, version: &str, ipam: Value) -> String {
        let mut section = json!({"type": "host-local", "dataDir": self.data_dir(), "socket": self.socket});
        if let (Some(target), Value::Object(extra)) = (section.as_object_mut(), ipam) {
            target.extend(extra);
        }
        json!({"cniVersion": version, "name": NETWORK, "type": "bridge", "ipam": section}).to_string()
    }

    pub fn run(&self, command: &str, id: &str, conf: &str, extra_env: &[(&str, &str)]) -> Run {
        let mut env = BTreeMap::from([
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", id),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", "/var/run/netns/unused"),
            ("CNI_PATH", "/nonexistent"),
        ]);
        env.extend(extra_env.iter().copied());
        if matches!(command, "GC" | "STATUS") {
            env.retain(|k, _| !matches!(*k, "CNI_CONTAINERID" | "CNI_IFNAME" | "CNI_NETNS"));
        }
        self.node.exec_plugin("host-local", &env, conf)
    }

    pub fn add(&self, id: &str, conf: &str) -> Value {
        self.run("ADD", id, conf, &[]).success().json()
    }

    /// `cnictl ipam ls --json`, through the service when there is one.
    pub fn leases(&self) -> Vec<Value> {
        self.node.lease_records(NETWORK, &self.data_dir, &self.socket)
    }

    pub fn leased_ips(&self) -> BTreeSet<String> {
        self.leases()
            .iter()
            .map(|l| l["ip"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

pub fn v4_conf(ipam: &Ipam, version: &str, subnet: &str) -> String {
    ipam.conf(version, json!({"subnet": subnet}))
}

/// Every address of a result's `ips`, as it has them (`a.b.c.d/len`).
pub fn addresses(result: &Value) -> Vec<String> {
    result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["address"].as_str().map(str::to_owned))
        .collect()
}

pub fn address(result: &Value) -> String {
    result["ips"][0]["address"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// A small tmpfs mounted for one test, unmounted when dropped (even when
/// the test fails).
#[derive(Debug)]
pub struct SmallFs {
    pub path: PathBuf,
}

impl SmallFs {
    pub fn mount(path: PathBuf, size: &str) -> Self {
        fs::create_dir_all(&path).expect("mkdir");
        crate::run(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
                path.to_str().expect("UTF-8"),
            ],
        )
        .success();
        SmallFs { path }
    }

    pub fn remount(&self, options: &str) {
        crate::run(
            "mount",
            &[
                "-o",
                &format!("remount,{options}"),
                self.path.to_str().expect("UTF-8"),
            ],
        )
        .success();
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .args(["-l", self.path.to_str().unwrap_or_default()])
            .status();
    }
}
