//! The agent's metrics, served on `/metrics` beside the probes
//! ([`crate::health`]) in the OpenMetrics text format Prometheus scrapes.
//! Named after Istio's CNI agent where it has one (`istio_cni_*`, its labels
//! and values), so its dashboards work; `cni_suite_*` otherwise. The
//! controllers count what they do through a [`Metrics`] handle; what the
//! lease service answered is asked of the service on each scrape (it counts
//! that itself, see `lease::served`). node-agent/README.md lists them all.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet, text};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::settings::RepairMode;

/// The content type of what [`Metrics::scrape`] writes: the OpenMetrics
/// text format of `prometheus_client::encoding::text`.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long a scrape waits for the lease service's counts: well inside
/// Prometheus' default scrape timeout (10 s), and far more than a service
/// that answers takes (it only copies its counts).
const LEASE_COUNTS_LIMIT: Duration = Duration::from_secs(1);

/// A label and its value.
type Label = (&'static str, &'static str);

/// How one install step ended, as Istio's installer labels
/// `istio_cni_installs_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstallResult {
    Success,
    /// The plugin binaries could not be installed.
    CopyBinariesFailure,
    /// istio-redirect's kubeconfig could not be written.
    CreateKubeconfigFailure,
    /// The agent's conflist, or Istio's entry in the primary
    /// configuration, could not be written.
    CreateCniConfigFailure,
}

impl InstallResult {
    const ALL: [InstallResult; 4] = [
        InstallResult::Success,
        InstallResult::CopyBinariesFailure,
        InstallResult::CreateKubeconfigFailure,
        InstallResult::CreateCniConfigFailure,
    ];

    fn label(self) -> &'static str {
        match self {
            InstallResult::Success => "SUCCESS",
            InstallResult::CopyBinariesFailure => "COPY_BINARIES_FAILURE",
            InstallResult::CreateKubeconfigFailure => "CREATE_KUBECONFIG_FAILURE",
            InstallResult::CreateCniConfigFailure => "CREATE_CNI_CONFIG_FAILURE",
        }
    }
}

/// How a reconciliation or a repair ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
}

impl Outcome {
    /// Of a sync (`cni_suite_*_syncs_total`).
    fn sync_label(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Failure => "failure",
        }
    }

    /// Of a repair, as Istio's repair controller labels it.
    fn repair_label(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Failure => "fail",
        }
    }
}

/// The handle the controllers count through; clones share the counts.
#[derive(Debug, Clone)]
pub struct Metrics {
    families: Arc<Families>,
}

#[derive(Debug)]
struct Families {
    registry: Registry,
    installs: Family<[Label; 1], Counter>,
    install_ready: Gauge,
    conflist_writes: Counter,
    chain_reinserts: Counter,
    route_syncs: Family<[Label; 1], Counter>,
    egress_syncs: Family<[Label; 1], Counter>,
    policy_syncs: Family<[Label; 1], Counter>,
    policy_admissions: Family<[Label; 1], Counter>,
    policy_gate_up: Gauge,
    /// Whether a NetworkPolicy gate is configured: without one,
    /// `policy_gate_up` is not exposed at all.
    policy_gate_configured: AtomicBool,
    repairs: Family<[Label; 2], Counter>,
    plugin_requests: Family<[Label; 1], Counter>,
    ztunnel_connected: Gauge,
    pods_in_mesh: Gauge,
    zds_acks: Family<[Label; 1], Counter>,
    zds_ack_seconds: Histogram,
    /// Where the lease service whose counts are shown listens: the lease
    /// directory's socket, whoever started the service there.
    lease_socket: Option<PathBuf>,
}

impl Metrics {
    /// The agent's metric families, every count at zero; the lease
    /// service's counts are asked at `lease_socket` on each scrape (none:
    /// not asked).
    pub fn new(lease_socket: Option<PathBuf>) -> Metrics {
        let mut registry = Registry::default();
        let installs = Family::<[Label; 1], Counter>::default();
        registry.register(
            "istio_cni_installs",
            "Installs by result: the binaries installed (at start, and each resync that put one back), \
             or which step failed",
            installs.clone(),
        );
        let install_ready = Gauge::default();
        registry.register(
            "istio_cni_install_ready",
            "Whether the agent is ready (1) or not (0), as /readyz answers",
            install_ready.clone(),
        );
        let conflist_writes = Counter::default();
        registry.register(
            "cni_suite_conflist_writes",
            "Writes of the agent's conflist (only when its content changes)",
            conflist_writes.clone(),
        );
        let chain_reinserts = Counter::default();
        registry.register(
            "cni_suite_chain_reinserts",
            "Writes of istio-redirect into a primary configuration that lacked it",
            chain_reinserts.clone(),
        );
        let route_syncs = Family::<[Label; 1], Counter>::default();
        registry.register(
            "cni_suite_route_syncs",
            "Reconciliations of the routes to other nodes' pods, by result",
            route_syncs.clone(),
        );
        let egress_syncs = Family::<[Label; 1], Counter>::default();
        registry.register(
            "cni_suite_egress_syncs",
            "Reconciliations of the masquerade of traffic leaving the cluster, by result",
            egress_syncs.clone(),
        );
        let policy_syncs = Family::<[Label; 1], Counter>::default();
        registry.register(
            "cni_suite_policy_syncs",
            "Reconciliations of the NetworkPolicy table with the Pods, Namespaces and policies, by result",
            policy_syncs.clone(),
        );
        let policy_admissions = Family::<[Label; 1], Counter>::default();
        registry.register(
            "cni_suite_policy_admissions",
            "New pods' ADDs answered by the NetworkPolicy gate, by answer (enforced: the kernel held the pod's policy before the ADD returned)",
            policy_admissions.clone(),
        );
        let repairs = Family::<[Label; 2], Counter>::default();
        registry.register(
            "istio_cni_repair_pods_repaired",
            "Broken pods handled by the repair controller, by mode (type) and result",
            repairs.clone(),
        );
        let plugin_requests = Family::<[Label; 1], Counter>::default();
        registry.register(
            "istio_cni_plugin_requests",
            "Ambient pod events from the plugin, by the HTTP status they were answered with (200: in the mesh)",
            plugin_requests.clone(),
        );
        let ztunnel_connected = Gauge::default();
        registry.register(
            "ztunnel_connected",
            "ztunnel connections to the ZDS socket (2 while one hands over to the next)",
            ztunnel_connected.clone(),
        );
        let pods_in_mesh = Gauge::default();
        registry.register(
            "cni_suite_ambient_pods_enrolled",
            "This node's pods in ambient mode's mesh",
            pods_in_mesh.clone(),
        );
        let zds_acks = Family::<[Label; 1], Counter>::default();
        registry.register(
            "cni_suite_zds_acks",
            "ztunnel's answers to pods' adds, by result (acked, or refused or lost)",
            zds_acks.clone(),
        );
        let zds_ack_seconds = Histogram::new([0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0]);
        registry.register_with_unit(
            "cni_suite_zds_ack",
            "From a pod's add queued for ztunnel to its answer",
            Unit::Seconds,
            zds_ack_seconds.clone(),
        );
        // Zero from the start, so that a rate over the first failure sees
        // it rise.
        for result in InstallResult::ALL {
            installs.get_or_create_owned(&[("result", result.label())]);
        }
        for outcome in [Outcome::Success, Outcome::Failure] {
            route_syncs.get_or_create_owned(&[("result", outcome.sync_label())]);
            egress_syncs.get_or_create_owned(&[("result", outcome.sync_label())]);
            policy_syncs.get_or_create_owned(&[("result", outcome.sync_label())]);
        }
        for answer in ["enforced", "not_enforced"] {
            policy_admissions.get_or_create_owned(&[("answer", answer)]);
        }
        for result in ["acked", "failed"] {
            zds_acks.get_or_create_owned(&[("result", result)]);
        }
        Metrics {
            families: Arc::new(Families {
                registry,
                installs,
                install_ready,
                conflist_writes,
                chain_reinserts,
                route_syncs,
                egress_syncs,
                policy_syncs,
                policy_admissions,
                policy_gate_up: Gauge::default(),
                policy_gate_configured: AtomicBool::new(false),
                repairs,
                plugin_requests,
                ztunnel_connected,
                pods_in_mesh,
                zds_acks,
                zds_ack_seconds,
                lease_socket,
            }),
        }
    }

    pub fn installed(&self, result: InstallResult) {
        self.families
            .installs
            .get_or_create(&[("result", result.label())])
            .inc();
    }

    pub fn conflist_written(&self) {
        self.families.conflist_writes.inc();
    }

    pub fn chain_reinserted(&self) {
        self.families.chain_reinserts.inc();
    }

    pub fn route_synced(&self, outcome: Outcome) {
        self.families
            .route_syncs
            .get_or_create(&[("result", outcome.sync_label())])
            .inc();
    }

    pub fn egress_synced(&self, outcome: Outcome) {
        self.families
            .egress_syncs
            .get_or_create(&[("result", outcome.sync_label())])
            .inc();
    }

    pub fn policy_synced(&self, outcome: Outcome) {
        self.families
            .policy_syncs
            .get_or_create(&[("result", outcome.sync_label())])
            .inc();
    }

    /// A new pod's ADD answered by the NetworkPolicy gate.
    pub fn policy_admitted(&self, enforced: bool) {
        let answer = if enforced { "enforced" } else { "not_enforced" };
        self.families
            .policy_admissions
            .get_or_create(&[("answer", answer)])
            .inc();
    }

    /// Whether the configured NetworkPolicy gate listens now.
    pub fn policy_gate_listening(&self, listening: bool) {
        let families = &self.families;
        families.policy_gate_up.set(i64::from(listening));
        families.policy_gate_configured.store(true, Ordering::SeqCst);
    }

    /// A broken pod handled in `mode` (Istio's `type`: its repair modes).
    pub fn repaired(&self, mode: RepairMode, outcome: Outcome) {
        let mode = match mode {
            RepairMode::Repair => "repair",
            RepairMode::Delete => "delete",
            RepairMode::Label => "label",
            RepairMode::Off => "off",
        };
        self.families
            .repairs
            .get_or_create(&[("type", mode), ("result", outcome.repair_label())])
            .inc();
    }

    /// An ambient pod event answered with HTTP `status`.
    pub fn plugin_request(&self, status: u16) {
        let code = match status {
            200 => "200",
            400 => "400",
            404 => "404",
            413 => "413",
            _ => "500",
        };
        self.families
            .plugin_requests
            .get_or_create(&[("response_code", code)])
            .inc();
    }

    pub fn ztunnels_connected(&self, count: usize) {
        self.families
            .ztunnel_connected
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    pub fn pods_in_mesh(&self, count: usize) {
        self.families
            .pods_in_mesh
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// ztunnel's answer to a pod's add, `waited` after it was queued.
    pub fn zds_acked(&self, acked: bool, waited: Duration) {
        let result = if acked { "acked" } else { "failed" };
        let families = &self.families;
        families.zds_acks.get_or_create(&[("result", result)]).inc();
        families.zds_ack_seconds.observe(waited.as_secs_f64());
    }

    /// The exposition of one scrape, `ready` being the agent's readiness
    /// now. Blocks for up to [`LEASE_COUNTS_LIMIT`] asking the lease
    /// service for its counts; when it does not answer they are left out
    /// (not the last ones seen: those may be a service's that has since
    /// gone) and `cni_suite_lease_service_up` says 0.
    pub fn scrape(&self, ready: bool) -> String {
        let families = &self.families;
        families.install_ready.set(i64::from(ready));
        let served = families.lease_socket.as_deref().and_then(|socket| {
            lease::client::served(socket, LEASE_COUNTS_LIMIT)
                .map_err(|e| log::debug!("no counts from the lease service: {e}"))
                .ok()
        });
        // Without a lease directory of its own (Istio's CNI alone) there is
        // no service to report on: no lease family at all, rather than one
        // saying a service is down.
        let mut lease = Registry::default();
        if families.lease_socket.is_some() {
            lease.register_collector(Box::new(LeaseCounts(served)));
        }
        // Likewise no gate family where no gate is configured.
        let mut gate = Registry::default();
        if families.policy_gate_configured.load(Ordering::SeqCst) {
            gate.register(
                "cni_suite_policy_gate_up",
                "Whether the NetworkPolicy gate listens on POLICY_SOCKET (1) or cannot (0): new pods' ADDs are then unconfirmed, refused in a namespace that has a policy",
                families.policy_gate_up.clone(),
            );
        }
        let mut exposition = String::new();
        let written = text::encode_registry(&mut exposition, &families.registry)
            .and_then(|()| text::encode_registry(&mut exposition, &gate))
            .and_then(|()| text::encode_registry(&mut exposition, &lease))
            .and_then(|()| text::encode_eof(&mut exposition));
        if let Err(e) = written {
            // Writing into a String fails only if an encoder does.
            log::error!("encoding the metrics: {e}");
            let _ = writeln!(exposition, "# EOF");
        }
        exposition
    }
}

/// The lease service's counts of one scrape, as metric families.
#[derive(Debug)]
struct LeaseCounts(Option<lease::served::Served>);

impl Collector for LeaseCounts {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let up = ConstGauge::new(i64::from(self.0.is_some()));
        up.encode(encoder.encode_descriptor(
            "cni_suite_lease_service_up",
            "Whether the lease service of the lease directory told its counts on this scrape",
            None,
            up.metric_type(),
        )?)?;
        let Some(served) = &self.0 else {
            return Ok(());
        };
        let mut requests = encoder.encode_descriptor(
            "cni_suite_lease_requests",
            "Requests the lease service answered since it started, by verb and result",
            None,
            MetricType::Counter,
        )?;
        for verb in &served.verbs {
            for (result, count) in &verb.results {
                let labels = [("verb", verb.verb.as_str()), ("result", result.as_str())];
                ConstCounter::new(*count).encode(requests.encode_family(&labels)?)?;
            }
        }
        let mut durations = encoder.encode_descriptor(
            "cni_suite_lease_request_duration",
            "How long the lease service took from a whole request to its answer, by verb",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        let bounds: Vec<f64> = served.bounds.iter().copied().chain([f64::INFINITY]).collect();
        for verb in &served.verbs {
            let buckets: Vec<(f64, u64)> = bounds.iter().copied().zip(verb.buckets.iter().copied()).collect();
            let labels = [("verb", verb.verb.as_str())];
            durations.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
                verb.seconds,
                verb.count(),
                &buckets,
                None,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// The sample lines of `exposition` (no HELP, TYPE or EOF).
    fn samples(exposition: &str) -> Vec<&str> {
        exposition.lines().filter(|line| !line.starts_with('#')).collect()
    }

    #[test]
    fn counts_are_exposed_under_istios_names_and_the_suites() {
        let metrics = Metrics::new(None);
        let counting = metrics.clone();
        counting.installed(InstallResult::Success);
        counting.installed(InstallResult::CopyBinariesFailure);
        counting.installed(InstallResult::Success);
        counting.conflist_written();
        counting.chain_reinserted();
        counting.chain_reinserted();
        counting.route_synced(Outcome::Success);
        counting.egress_synced(Outcome::Failure);
        counting.policy_synced(Outcome::Success);
        counting.policy_synced(Outcome::Success);
        counting.policy_admitted(true);
        counting.repaired(RepairMode::Delete, Outcome::Success);
        counting.repaired(RepairMode::Repair, Outcome::Failure);
        counting.plugin_request(200);
        counting.plugin_request(500);
        counting.plugin_request(200);
        counting.ztunnels_connected(1);
        counting.pods_in_mesh(3);
        counting.zds_acked(true, Duration::from_millis(3));
        let exposition = metrics.scrape(true);
        assert!(exposition.ends_with("# EOF\n"), "{exposition}");
        assert!(
            exposition.contains("# TYPE istio_cni_installs counter\n"),
            "{exposition}"
        );
        let expected = [
            r#"istio_cni_installs_total{result="SUCCESS"} 2"#,
            r#"istio_cni_installs_total{result="COPY_BINARIES_FAILURE"} 1"#,
            r#"istio_cni_installs_total{result="CREATE_KUBECONFIG_FAILURE"} 0"#,
            r#"istio_cni_installs_total{result="CREATE_CNI_CONFIG_FAILURE"} 0"#,
            "istio_cni_install_ready 1",
            "cni_suite_conflist_writes_total 1",
            "cni_suite_chain_reinserts_total 2",
            r#"cni_suite_route_syncs_total{result="success"} 1"#,
            r#"cni_suite_route_syncs_total{result="failure"} 0"#,
            r#"cni_suite_egress_syncs_total{result="success"} 0"#,
            r#"cni_suite_egress_syncs_total{result="failure"} 1"#,
            r#"cni_suite_policy_syncs_total{result="success"} 2"#,
            r#"cni_suite_policy_syncs_total{result="failure"} 0"#,
            r#"cni_suite_policy_admissions_total{answer="enforced"} 1"#,
            r#"cni_suite_policy_admissions_total{answer="not_enforced"} 0"#,
            r#"istio_cni_repair_pods_repaired_total{type="delete",result="success"} 1"#,
            r#"istio_cni_repair_pods_repaired_total{type="repair",result="fail"} 1"#,
            r#"istio_cni_plugin_requests_total{response_code="200"} 2"#,
            r#"istio_cni_plugin_requests_total{response_code="500"} 1"#,
            "ztunnel_connected 1",
            "cni_suite_ambient_pods_enrolled 3",
            r#"cni_suite_zds_acks_total{result="acked"} 1"#,
            r#"cni_suite_zds_acks_total{result="failed"} 0"#,
            "cni_suite_zds_ack_seconds_sum 0.003",
            "cni_suite_zds_ack_seconds_count 1",
        ];
        // The histogram's buckets apart: one holds the ack, by its bound.
        let (buckets, found): (Vec<&str>, Vec<&str>) = samples(&exposition)
            .into_iter()
            .partition(|line| line.contains("_bucket{"));
        assert!(
            buckets.contains(&r#"cni_suite_zds_ack_seconds_bucket{le="0.002"} 0"#)
                && buckets.contains(&r#"cni_suite_zds_ack_seconds_bucket{le="0.005"} 1"#),
            "{buckets:?}"
        );
        for line in expected {
            assert!(found.contains(&line), "{line} not in:\n{exposition}");
        }
        // No lease directory of its own (Istio's CNI alone): no lease family.
        assert_eq!(found.len(), expected.len(), "{exposition}");
        assert!(!exposition.contains("cni_suite_lease"), "{exposition}");
        assert!(samples(&metrics.scrape(false)).contains(&"istio_cni_install_ready 0"));
    }

    #[test]
    fn the_gate_is_reported_only_where_one_is_configured() {
        let metrics = Metrics::new(None);
        assert!(!metrics.scrape(true).contains("cni_suite_policy_gate"));
        metrics.policy_gate_listening(false);
        let exposition = metrics.scrape(true);
        assert!(
            exposition.contains("# TYPE cni_suite_policy_gate_up gauge\n"),
            "{exposition}"
        );
        assert!(samples(&exposition).contains(&"cni_suite_policy_gate_up 0"));
        metrics.policy_gate_listening(true);
        assert!(samples(&metrics.scrape(true)).contains(&"cni_suite_policy_gate_up 1"));
    }

    #[test]
    fn a_lease_service_that_does_not_answer_leaves_its_families_without_samples() {
        let dir = tempfile::tempdir().expect("tempdir");
        let metrics = Metrics::new(Some(dir.path().join("nobody.sock")));
        let exposition = metrics.scrape(true);
        assert!(
            samples(&exposition).contains(&"cni_suite_lease_service_up 0"),
            "{exposition}"
        );
        assert!(!exposition.contains("cni_suite_lease_requests"), "{exposition}");
    }

    #[test]
    fn the_lease_services_counts_become_a_counter_and_a_histogram_per_verb() {
        let mut buckets = vec![0; lease::served::DURATION_BOUNDS.len() + 1];
        buckets[3] = 2;
        buckets[lease::served::DURATION_BOUNDS.len()] = 1;
        let served = lease::served::Served {
            bounds: lease::served::DURATION_BOUNDS.to_vec(),
            verbs: vec![lease::served::VerbServed {
                verb: "ADD".into(),
                results: BTreeMap::from([("success".into(), 2), ("busy".into(), 1)]),
                buckets,
                seconds: 30.5,
            }],
        };
        let mut registry = Registry::default();
        registry.register_collector(Box::new(LeaseCounts(Some(served))));
        let mut exposition = String::new();
        text::encode(&mut exposition, &registry).expect("encoded");
        for line in [
            "# TYPE cni_suite_lease_requests counter",
            "# TYPE cni_suite_lease_request_duration_seconds histogram",
            "# UNIT cni_suite_lease_request_duration_seconds seconds",
            "cni_suite_lease_service_up 1",
            r#"cni_suite_lease_requests_total{verb="ADD",result="busy"} 1"#,
            r#"cni_suite_lease_requests_total{verb="ADD",result="success"} 2"#,
            r#"cni_suite_lease_request_duration_seconds_sum{verb="ADD"} 30.5"#,
            r#"cni_suite_lease_request_duration_seconds_count{verb="ADD"} 3"#,
            r#"cni_suite_lease_request_duration_seconds_bucket{le="0.0025",verb="ADD"} 0"#,
            r#"cni_suite_lease_request_duration_seconds_bucket{le="0.005",verb="ADD"} 2"#,
            r#"cni_suite_lease_request_duration_seconds_bucket{le="30.0",verb="ADD"} 2"#,
            r#"cni_suite_lease_request_duration_seconds_bucket{le="+Inf",verb="ADD"} 3"#,
        ] {
            assert!(
                exposition.lines().any(|found| found == line),
                "{line} not in:\n{exposition}"
            );
        }
    }
}
