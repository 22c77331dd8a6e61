//! containerd's CRI as kubelet drives it, with minikube's bridge
//! conflist: RunPodSandbox through ours and through the reference.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{Value, json};
use test_kit::fakes::containerd::{Containerd, Cri, Kubelet, PAUSE};
use test_kit::{Node, bin_dir};

use crate::measure::ms;
use crate::outcome::Outcome;
use crate::setup::{REFERENCE_DIR, Setup, Side};

/// Pods per side and round in the CRI phase (each costs a pause container).
const CRI_PODS: usize = 30;

/// minikube's `--cni=bridge` network as it writes it to
/// `/etc/cni/net.d/1-k8s.conflist` (its `addIf`, which the bridge ignores,
/// included): host-local keeps its leases in its default `dataDir`,
/// `/var/lib/cni/networks`, on disk.
fn minikube_bridge_conflist() -> Value {
    json!({"cniVersion": "0.4.0", "name": "bridge", "plugins": [
        {"type": "bridge", "bridge": "bridge", "addIf": "true", "isDefaultGateway": true,
         "forceAddress": false, "ipMasq": true, "hairpinMode": true,
         "ipam": {"type": "host-local", "subnet": "10.244.0.0/16"}},
        {"type": "portmap", "capabilities": {"portMappings": true}},
        {"type": "firewall"}]})
}

/// The addresses the reference's host-local still holds under `dir` (a
/// file named after each).
fn reference_lease_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.parse::<std::net::IpAddr>().is_ok())
        .map(|name| format!("lease file {name}"))
        .collect()
}

/// containerd's CRI as kubelet drives it, with minikube's conflist:
/// RunPodSandbox per pod, through ours and through the reference, with the
/// same containerd build, one daemon at a time; beside each pod a
/// `hostNetwork` sandbox on the same daemon, which calls no CNI plugin:
/// what a pod costs besides its network. containerd sees the node's
/// directory as `/var/lib`, so the default `dataDir` is on this machine's
/// disk and the node's own.
pub(crate) fn cri(out: &mut Outcome, pods: usize, round: usize) {
    let n = pods.min(CRI_PODS);
    let sides = [
        (Side::Ours, bin_dir()),
        (Side::Reference, PathBuf::from(REFERENCE_DIR)),
    ];
    for k in 0..sides.len() {
        let (side, bins) = &sides[(round + k) % sides.len()];
        let setup = if *side == Side::Ours {
            Setup::DropIn
        } else {
            Setup::Reference
        };
        let node = Node::new();
        let data_dir = node.var_lib().join("cni/networks");
        node.write_conf("1-k8s.conflist", &minikube_bridge_conflist());
        let settings = Cri {
            conf_dir: node.conf_dir(),
            bin_dir: bins.clone(),
            sandbox_image: PAUSE.into(),
        };
        let containerd = Containerd::start(&node, Some(&settings));
        containerd.import_busybox(&node, "k8s.io", PAUSE, &["/bin/sleep", "2147483647"]);
        let mut kubelet = Kubelet::connect(containerd.address());
        let mut sandboxes = Vec::new();
        let (mut networked, mut host) = (Vec::new(), Vec::new());
        for i in 0..=n {
            for host_network in [false, true] {
                let name = format!("{}-{i}", if host_network { "host" } else { "pod" });
                let started = Instant::now();
                let run = if host_network {
                    kubelet.run_host_network_pod("default", &name)
                } else {
                    kubelet.run_pod("default", &name, &[])
                };
                let wall = ms(started.elapsed());
                let id = run.map_err(|e| {
                    out.problem(format!("cri ({}) RunPodSandbox {name}: {e}", setup.label()));
                });
                if let Ok(id) = id {
                    sandboxes.push(id);
                    // The first pod of the node makes its bridge (and ours
                    // starts the lease service): reported apart.
                    match (i, host_network) {
                        (0, false) => out.record("cri first RunPodSandbox", *side, wall),
                        (_, false) => networked.push(wall),
                        (_, true) => host.push(wall),
                    }
                }
            }
        }
        for id in &sandboxes {
            kubelet.stop_and_remove(id);
        }
        for (metric, walls) in [
            ("cri RunPodSandbox", networked),
            ("cri RunPodSandbox hostNetwork", host),
        ] {
            out.samples
                .entry(metric.to_owned())
                .or_default()
                .entry(*side)
                .or_default()
                .extend(walls);
        }
        let mut left = node.veths();
        left.extend(node.container_nat_chains());
        left.extend(
            node.cache_entries()
                .into_iter()
                .map(|e| format!("cache entry {e}")),
        );
        if setup == Setup::DropIn {
            let leases = node.lease_records("bridge", &data_dir, "");
            left.extend(leases.iter().map(|l| format!("lease {l}")));
        } else {
            left.extend(reference_lease_files(&data_dir.join("bridge")));
        }
        if !left.is_empty() {
            out.problem(format!("cri ({}) left behind: {left:?}", setup.label()));
        }
        drop(kubelet);
        drop(containerd);
    }
}
