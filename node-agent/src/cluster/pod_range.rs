//! The cluster's pod range as kubeadm (kind, minikube and most clusters)
//! records it: `networking.podSubnet` of the ClusterConfiguration in
//! kube-system's `kubeadm-config` ConfigMap, which kubeadm hands the
//! controller-manager as `--cluster-cidr`. Every Node's pod CIDR is cut
//! from it, so the masquerade chain holds one rule per family whatever
//! the number of Nodes.

use ipnetwork::IpNetwork;
use k8s_openapi::api::core::v1::ConfigMap;

const NAMESPACE: &str = "kube-system";
const CONFIG_MAP: &str = "kubeadm-config";
const KEY: &str = "ClusterConfiguration";

/// What the agent knows of kubeadm's pod range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodRange {
    /// Not read yet, or the last read failed for a reason that may pass.
    Unknown,
    /// The cluster records none the agent may read (not kubeadm, no
    /// podSubnet, or the agent is not allowed to read it).
    Absent,
    Known(Vec<IpNetwork>),
}

impl PodRange {
    pub fn is_unknown(&self) -> bool {
        *self == PodRange::Unknown
    }

    /// The prefixes, none when absent or unknown.
    pub fn prefixes(&self) -> &[IpNetwork] {
        match self {
            PodRange::Known(prefixes) => prefixes,
            PodRange::Unknown | PodRange::Absent => &[],
        }
    }
}

/// The range as the agent's syncs see it: read before the first one and,
/// while the API cannot be reached, again before a later one at most every
/// [`RETRY`] (a new node's agent can start before kube-proxy routes the
/// API's Service address).
pub struct Reader {
    client: kube::Client,
    range: PodRange,
    tried: Option<std::time::Instant>,
}

/// Without the client, which has no `Debug`.
impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("range", &self.range)
            .field("tried", &self.tried)
            .finish_non_exhaustive()
    }
}

/// How often an unknown range is asked for again.
pub const RETRY: std::time::Duration = std::time::Duration::from_secs(5);

impl Reader {
    /// `set`: CLUSTER_CIDRS is given, and the range is never looked for.
    pub fn new(client: kube::Client, set: bool) -> Self {
        let range = if set { PodRange::Absent } else { PodRange::Unknown };
        Reader {
            client,
            range,
            tried: None,
        }
    }

    pub async fn current(&mut self) -> &PodRange {
        let due = self.tried.is_none_or(|at| at.elapsed() >= RETRY);
        if self.range.is_unknown() && due {
            self.tried = Some(std::time::Instant::now());
            self.range = read(self.client.clone()).await;
        }
        &self.range
    }
}

/// Reads the range from the API server, saying what it found.
async fn read(client: kube::Client) -> PodRange {
    let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, NAMESPACE);
    // Never long: every sync of the Node loop waits for it.
    let found = match tokio::time::timeout(RETRY, api.get_opt(CONFIG_MAP)).await {
        Err(_) => {
            log::warn!("reading {NAMESPACE}/{CONFIG_MAP}: no answer in {RETRY:?}; trying again later");
            return PodRange::Unknown;
        }
        Ok(Ok(found)) => found,
        Ok(Err(kube::Error::Api(status))) if status.code == 403 => {
            log::info!("{NAMESPACE}/{CONFIG_MAP} may not be read: the pod range is the Nodes' pod CIDRs");
            return PodRange::Absent;
        }
        Ok(Err(e)) => {
            log::warn!("reading {NAMESPACE}/{CONFIG_MAP}: {e}; trying again later");
            return PodRange::Unknown;
        }
    };
    let configuration = found
        .and_then(|map| map.data)
        .and_then(|mut data| data.remove(KEY));
    let Some(configuration) = configuration else {
        log::info!("no {NAMESPACE}/{CONFIG_MAP} {KEY}: the pod range is the Nodes' pod CIDRs");
        return PodRange::Absent;
    };
    match pod_subnet(&configuration) {
        Ok(prefixes) if !prefixes.is_empty() => {
            log::info!("the cluster's pod range (kubeadm's podSubnet): {prefixes:?}");
            PodRange::Known(prefixes)
        }
        Ok(_) => PodRange::Absent,
        Err(e) => {
            log::warn!("{NAMESPACE}/{CONFIG_MAP}: {e}: the pod range is the Nodes' pod CIDRs");
            PodRange::Absent
        }
    }
}

/// `networking.podSubnet` of a ClusterConfiguration (comma-separated
/// CIDRs, one per family on a dual-stack cluster); none when unset. Read
/// by its line rather than by a YAML parser: kubeadm writes the key once,
/// plainly, and a value it cannot parse leaves the Nodes' CIDRs in charge.
pub fn pod_subnet(configuration: &str) -> Result<Vec<IpNetwork>, String> {
    let Some(value) = configuration
        .lines()
        .find_map(|line| line.trim_start().strip_prefix("podSubnet:"))
    else {
        return Ok(Vec::new());
    };
    let value = value.split(" #").next().unwrap_or_default();
    let value = value.trim().trim_matches(|c| c == '"' || c == '\'');
    value
        .split(',')
        .map(str::trim)
        .filter(|text| !text.is_empty())
        .map(|text| {
            text.parse::<IpNetwork>()
                .map(netlink::route::network_of)
                .map_err(|e| format!("podSubnet {text:?}: {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(prefixes: &[IpNetwork]) -> Vec<String> {
        prefixes.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn kinds_dual_stack_configuration_gives_both_families() {
        let kind = "apiServer:\n  certSANs:\n  - localhost\napiVersion: kubeadm.k8s.io/v1beta2\n\
                    kind: ClusterConfiguration\nnetworking:\n  dnsDomain: cluster.local\n  \
                    podSubnet: 10.244.0.0/16,fd00:10:244::/56\n  serviceSubnet: 10.96.0.0/16,fd00:10:96::/112\n";
        assert_eq!(
            shown(&pod_subnet(kind).expect("parses")),
            ["10.244.0.0/16", "fd00:10:244::/56"]
        );
    }

    #[test]
    fn a_quoted_or_host_bit_value_is_its_network() {
        let text = "networking:\n  podSubnet: \"10.244.1.7/16\" # kind's\n";
        assert_eq!(shown(&pod_subnet(text).expect("parses")), ["10.244.0.0/16"]);
    }

    #[test]
    fn no_pod_subnet_is_none_and_garbage_is_an_error() {
        assert!(
            pod_subnet("networking:\n  serviceSubnet: 10.96.0.0/12\n")
                .expect("parses")
                .is_empty()
        );
        assert!(
            pod_subnet("networking:\n  podSubnet: \"\"\n")
                .expect("parses")
                .is_empty()
        );
        assert!(pod_subnet("networking:\n  podSubnet: 10.244.0.0/33\n").is_err());
    }
}
