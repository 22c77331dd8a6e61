//! A pod's in-pod redirection programmed in its namespace, and Istio's
//! record of it on the pod.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use firewall::Family;
use istio_redirect::rules::ambient::{InPod, InPodBackend, program, unprogram};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{Patch, PatchParams};
use netns::NetNs;

use super::cache::PodFacts;
use super::options::Options;

/// Opens the namespace at `path` and programs the pod's in-pod rules
/// there, in the families of `addresses` (IPv4 when there are none; IPv6
/// only when the agent does IPv6). Blocks: run off the async threads.
pub fn program_in(
    path: &Path,
    options: &Options,
    pod: &PodFacts,
    addresses: &[IpAddr],
) -> Result<NetNs, String> {
    let mut families = Vec::new();
    if addresses.iter().any(IpAddr::is_ipv4) || addresses.is_empty() {
        families.push(Family::V4);
    }
    if options.ipv6 && addresses.iter().any(IpAddr::is_ipv6) {
        families.push(Family::V6);
    }
    let in_pod = InPod::new(
        options.dns_capture,
        &istio_redirect::ambient_overrides(&pod.annotations),
    );
    let netns = NetNs::open(path).map_err(|e| e.to_string())?;
    // The node's own network redirected to ztunnel would cut it off.
    if NetNs::current().is_ok_and(|own| own.same_as(&netns)) {
        return Err(format!("{} is the agent's own network namespace", path.display()));
    }
    program(&netns, &in_pod, &families, options.backend).map_err(|e| format!("the in-pod rules: {e}"))?;
    Ok(netns)
}

/// The host's root as the agent reaches it (the DaemonSet shares the
/// host's pid namespace): a runtime's namespace path (`CNI_NETNS`) is the
/// host's, and the agent's container mounts none of them.
pub const HOST_ROOT: &str = "/proc/1/root";

/// `path` as the agent can open it: itself where it is there (the agent on
/// the host, or in a container that mounts it), else under `host_root`.
pub fn reachable(path: &Path, host_root: &Path) -> PathBuf {
    match path.strip_prefix("/") {
        Ok(relative) if !path.exists() => host_root.join(relative),
        _ => path.to_path_buf(),
    }
}

/// Istio's record on a pod in the mesh (`cni/pkg/util/podutil.go`).
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";

/// Marks the pod in the mesh (`enabled`) as Istio's agent does, for
/// `kubectl` and Istio's tools, or takes the mark away (None) when it left
/// the mesh; a failure is only logged (the pod is where it is either way).
/// Its UID in the patch is a precondition: a pod made again under the name
/// is not marked.
pub async fn annotate(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    pod: &PodFacts,
    mark: Option<&str>,
) {
    if pod.annotations.get(REDIRECTION_ANNOTATION).map(String::as_str) == mark {
        return;
    }
    let patch =
        serde_json::json!({"metadata": {"uid": pod.uid, "annotations": {REDIRECTION_ANNOTATION: mark}}});
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    if let Err(e) = pods
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        log::warn!("ambient: cannot set pod {namespace}/{name}'s {REDIRECTION_ANNOTATION} to {mark:?}: {e}");
    }
}

/// Takes the in-pod redirection out of a pod's namespace, in both
/// families (what is not there is no error). Blocks.
pub fn unprogram_in(netns: &NetNs, options: &Options) -> Result<(), String> {
    let forced = match options.backend {
        InPodBackend::Iptables(forced) => forced,
        InPodBackend::Nftables => None,
    };
    unprogram(netns, &[Family::V4, Family::V6], forced)
        .map(|_| ())
        .map_err(|e| format!("removing the in-pod rules: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_path_the_agent_does_not_see_is_reached_through_the_hosts_root() {
        let host = tempfile::tempdir().expect("tempdir");
        let unseen = Path::new("/var/run/netns/cni-that-is-not-here");
        assert_eq!(
            reachable(unseen, host.path()),
            host.path().join("var/run/netns/cni-that-is-not-here")
        );
        let seen = Path::new("/proc/self/ns/net");
        assert_eq!(
            reachable(seen, host.path()),
            seen,
            "one the agent sees is taken as it is"
        );
        assert_eq!(
            reachable(Path::new("relative"), host.path()),
            Path::new("relative")
        );
    }
}
