//! Every file in conf-examples/ is parsed and executed unchanged: ADD,
//! CHECK where the chain allows it, DEL, through cnictl in a node namespace
//! whose /var/lib (host-local's default dataDir, libcni's cache) is the
//! node's own directory, with Debian's reference plugins after ours where an
//! example names them: those we also have (portmap) when its
//! `_reference_plugins` lists them.

use std::path::{Path, PathBuf};

use serde_json::Value;
use test_kit::{Node, Run, bin, bin_dir, run_with_binds};

fn examples() -> Vec<PathBuf> {
    test_kit::conf_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../conf-examples"))
}

struct Example {
    node: Node,
    doc: Value,
    plugins: Vec<String>,
    /// Plugins run from the reference even where we have our own.
    reference: Vec<String>,
    /// Our binaries but those, then the reference's.
    cni_path: String,
}

impl Example {
    fn load(path: &Path) -> Self {
        let text = std::fs::read_to_string(path).expect("readable");
        let doc: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let entries = doc["plugins"]
            .as_array()
            .cloned()
            .unwrap_or_else(|| vec![doc.clone()]);
        let plugins = entries
            .iter()
            .map(|p| {
                p["type"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{}: a plugin without type", path.display()))
                    .to_owned()
            })
            .collect();
        let node = Node::new();
        std::fs::copy(path, node.conf_dir().join(path.file_name().expect("name"))).expect("copy");
        let reference: Vec<String> = doc["_reference_plugins"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p.as_str().map(str::to_owned))
            .collect();
        let ours = node.path("bins");
        std::fs::create_dir(&ours).expect("mkdir");
        for entry in std::fs::read_dir(bin_dir()).expect("bin dir").flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.path().is_file() && !reference.contains(&name) {
                std::os::unix::fs::symlink(entry.path(), ours.join(&name)).expect("symlink");
            }
        }
        let cni_path = format!("{}:/usr/lib/cni", ours.display());
        Example {
            node,
            doc,
            plugins,
            reference,
            cni_path,
        }
    }

    fn name(&self) -> &str {
        self.doc["name"].as_str().expect("a network name")
    }

    /// What a 1.1 runtime uses: the newest of `cniVersions`, else
    /// `cniVersion` (these files list versions in ascending order).
    fn version(&self) -> &str {
        self.doc["cniVersions"]
            .as_array()
            .and_then(|v| v.last())
            .unwrap_or(&self.doc["cniVersion"])
            .as_str()
            .expect("a cniVersion")
    }

    /// cnictl as a runtime on that node runs it: /var/lib is the node's.
    fn cnictl(&self, args: &[&str]) -> Run {
        let var_lib = self.node.var_lib();
        let conf = self.node.conf_dir();
        let caps = r#"{"portMappings":[{"hostPort":18082,"containerPort":80,"protocol":"tcp"}],"bandwidth":{"ingressRate":8000000,"ingressBurst":80000}}"#;
        run_with_binds(
            &[(&var_lib, Path::new("/var/lib"))],
            self.node.netns.path(),
            &bin("cnictl"),
            args,
            &[
                ("NETCONFPATH", conf.to_str().expect("UTF-8")),
                ("CNI_PATH", &self.cni_path),
                ("CAP_ARGS", caps),
            ],
        )
    }
}

#[test]
fn every_example_runs_as_written() {
    let files = examples();
    assert!(files.len() >= 9, "{files:?}");
    for path in files {
        let example = Example::load(&path);
        let file = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        let pod = example.node.pod("pod");
        pod.ip(&["link", "set", "lo", "up"]).success();
        let added = example.cnictl(&["--json", "add", example.name(), pod.path_str()]);
        assert!(added.ok(), "{file}: {added:?}");
        let result = added.json();
        assert_eq!(result["cniVersion"], example.version(), "{file}: {result}");
        if example.plugins.iter().any(|p| p == "bridge") {
            let eth0 = pod.ip(&["-o", "addr", "show", "eth0"]).success().stdout;
            let first = result["ips"][0]["address"]
                .as_str()
                .unwrap_or_else(|| panic!("{file}: {result}"));
            assert!(eth0.contains(first), "{file}: {first} on eth0: {eth0}");
        }
        if example.plugins.iter().any(|p| p == "istio-redirect") {
            let nat = pod.nat_rules("iptables-nft-save");
            assert!(nat.contains(":ISTIO_OUTPUT"), "{file}: {nat}");
        }
        // Debian's portmap fails every CHECK (containernetworking/plugins#819).
        let checkable = !matches!(example.version(), "0.1.0" | "0.2.0" | "0.3.0" | "0.3.1")
            && !example.reference.iter().any(|p| p == "portmap");
        if checkable {
            let check = example.cnictl(&["check", example.name(), pod.path_str()]);
            assert!(check.ok(), "{file}: {check:?}");
        }
        let del = example.cnictl(&["del", example.name(), pod.path_str()]);
        assert!(del.ok(), "{file}: {del:?}");
        let data_dir = example.node.var_lib().join("cni/networks");
        let left = example.node.leftovers(example.name(), &data_dir);
        assert!(left.is_empty(), "{file}: left behind: {left:#?}");
    }
}
