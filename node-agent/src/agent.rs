//! The agent's lifecycle: [`Agent::start`] brings the controllers up in
//! their order and hands back the [`Running`] agent; [`Running::stop`]
//! takes it down in the order [`STOP`] or [`UNINSTALL`] states, the one
//! place either order is written.
//!
//! A controller that runs as a task of its own is one entry in
//! [`Running::tasks`]; one that puts something on the node that uninstall
//! takes away is also one [`Step`] in [`UNINSTALL`].

use tokio::task::JoinHandle;

use crate::cluster::pods::PodWatch;
use crate::controllers::conflist::{self, Conflist};
use crate::controllers::egress::{self, Egress};
use crate::controllers::install::{self, Installer};
use crate::controllers::lease_service::{self, LeaseDir, LeaseService};
use crate::controllers::plugin_logs::{self, PluginLogs};
use crate::controllers::routes::{self, Routes};
use crate::controllers::{ambient, istio_chain, network_policy, node_watch, readiness_taint, repair};
use crate::error::Error;
use crate::health::{self, Health};
use crate::metrics::Metrics;
use crate::record::Record;
use crate::settings::{RepairMode, Settings};
use crate::{atomic, changes, cluster, uninstall};

/// One thing a stop does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Every controller task ends (the Node watch among them).
    EndTasks,
    /// A change already on a blocking thread (a task's end cannot cancel
    /// it) finishes first; none starts after.
    FenceChanges,
    /// Istio's entry leaves the node's configuration.
    UnchainIstio,
    /// Ambient mode's rule on the node for kubelet's probes, and its sets.
    RemoveProbeRule,
    /// First of the node's things, so no new pod is set up while the rest
    /// goes (a pod set up meanwhile would start a lease service of its own).
    RemoveConflist,
    StopLeaseService,
    RemovePolicyTable,
    /// Before uninstall may remove the run directory its socket is in.
    StopPluginLogs,
    RemoveRoutes,
    RemoveMasquerade,
    /// After the masquerade, whose jumps kept nat base chains in use.
    RemoveUnusedFirewall,
    /// The one a plugin started while no agent ran.
    StopLeftoverLeaseService,
    /// When pods still hold leases, the steps after this one stay undone:
    /// their DELs need the record, the bridge and the plugins.
    RemoveLeaseDir,
    /// The record of the node's nat tables, unless what it found unused
    /// could not all go (the next uninstall of this boot tries again).
    ForgetFirewall,
    /// Only a bridge the agent's conflist named: another of that name may
    /// be another network's.
    RemoveBridge,
    /// Those no configuration on the node names any more, the node's own
    /// put back.
    RemoveBinaries,
}

/// A stop that leaves the node as it is: the next agent takes over what
/// this one put there (the policy table stays in the kernel and is
/// reconciled).
pub const STOP: &[Step] = &[Step::EndTasks, Step::StopLeaseService, Step::StopPluginLogs];

/// A stop that leaves the node as it was before the agent came
/// (`UNINSTALL_ON_STOP`), in an order that keeps pods' DELs working. Each
/// step is tried whatever the one before it did.
pub const UNINSTALL: &[Step] = &[
    Step::EndTasks,
    Step::FenceChanges,
    Step::UnchainIstio,
    Step::RemoveProbeRule,
    Step::RemoveConflist,
    Step::StopLeaseService,
    Step::RemovePolicyTable,
    Step::StopPluginLogs,
    Step::RemoveRoutes,
    Step::RemoveMasquerade,
    Step::RemoveUnusedFirewall,
    Step::StopLeftoverLeaseService,
    Step::RemoveLeaseDir,
    Step::ForgetFirewall,
    Step::RemoveBridge,
    Step::RemoveBinaries,
];

impl Step {
    /// Whether the step is the agent's where it runs beside the node's
    /// own network (Istio's CNI only): that network's conflist, routes,
    /// rules, leases and bridge are not the agent's to remove.
    fn beside_another_network(self) -> bool {
        matches!(
            self,
            Step::EndTasks
                | Step::FenceChanges
                | Step::UnchainIstio
                | Step::RemoveProbeRule
                | Step::StopPluginLogs
                | Step::RemoveBinaries
        )
    }
}

/// The agent before its start.
#[derive(Debug)]
pub struct Agent;

/// A started agent: what its stop needs.
#[derive(Debug)]
pub struct Running {
    settings: Settings,
    /// Answers probes until the process ends.
    _probes: JoinHandle<()>,
    plugin_logs: Option<PluginLogs>,
    installer: Installer,
    record: Record,
    istio: Option<istio_chain::Options>,
    lease_service: Option<LeaseService>,
    /// The controllers running as tasks of their own, in start order.
    tasks: Vec<JoinHandle<()>>,
    /// The Node watch, when the node's network is the agent's: its end is
    /// the agent's failure.
    network: Option<JoinHandle<Result<(), Error>>>,
}

/// What the steps before found, for those after.
#[derive(Debug, Default)]
struct Teardown {
    conflist_was_ours: bool,
    firewall_failed: bool,
}

impl Agent {
    /// Starts every controller, in order; a start that cannot work fails
    /// before the node is changed where it can be told.
    pub async fn start(settings: Settings) -> Result<Running, Error> {
        let health = Health::default();
        // The lease service's counts are asked where the lease directory's
        // service listens, whoever started it.
        let metrics = Metrics::new(
            settings
                .own_network
                .then(|| ipam_config::lease_settings::data_dir_socket(&settings.lease_dir)),
        );
        let probes = health::serve(settings.health_listen, health.clone(), metrics.clone()).await?;
        // Settings that cannot work fail the start before anything is changed.
        settings.check().map_err(Error::Setting)?;
        // Before any entry names the socket: the first pod's records reach it.
        let plugin_logs = plugin_logs::start(&plugin_logs::Options::from_settings(&settings));
        let client = kube::Client::try_from(cluster::client::config(&settings.service_account_dir)?)?;
        let repair_options = repair::Options::from_settings(&settings)?;
        let istio = if settings.istio_chained {
            Some(istio_chain::Options::from_settings(&settings)?)
        } else {
            health.set_chained(true);
            None
        };
        let istio_entry = istio.as_ref().map(|istio| istio.entry.clone());
        // The agent's own file carries Istio's entry too, so where that file
        // is the primary one the two never rewrite each other.
        let chain = conflist::Chain::new(settings.chained_plugins.as_deref(), istio_entry.clone())?;
        let record = Record::new(&settings.cni_bin_dir);
        let installer = Installer::new(install::Options::from_settings(&settings), metrics.clone());
        // What an agent killed while writing left beside a configuration.
        atomic::sweep(&settings.cni_conf_dir);
        // Before the first change: what the nat tables held before the suite
        // came on this boot stays at uninstall (a restarted agent keeps the
        // first agent's record). Istio's CNI alone changes no nat table.
        if settings.own_network {
            uninstall::remember_firewall(&record).await;
        }
        // Before the conflist exists, so the runtime never calls a plugin that
        // is not there yet; a start that cannot install fails.
        installer.install(&health).await?;
        let lease_service = (settings.own_network && settings.lease_service)
            .then(|| lease_service::run(&lease_service::Options::from_settings(&settings)));
        let mut tasks = vec![tokio::spawn(installer.clone().run(
            health.clone(),
            lease_service.as_ref().map(LeaseService::restarter),
        ))];
        let mut pod_watch = PodWatch::default();
        if let Some(entry) = istio_entry.filter(|_| repair_options.mode != RepairMode::Off) {
            let pods = pod_watch.pods_of(&repair_options.node_name);
            tasks.push(tokio::spawn(repair::run(
                client.clone(),
                repair_options,
                entry,
                metrics.clone(),
                pods,
            )));
        }
        let ambient_options = match &istio {
            Some(istio) => ambient::Options::from_settings(&settings, &istio.entry)?,
            None => None,
        };
        if let Some(options) = ambient_options {
            let pods = pod_watch.pods_of(&options.node_name);
            tasks.push(tokio::spawn(ambient::run(
                client.clone(),
                options,
                pods,
                metrics.clone(),
            )));
        }
        if let Some(istio) = istio.clone() {
            tasks.push(tokio::spawn(istio_chain::run(
                istio,
                record.clone(),
                health.clone(),
                metrics.clone(),
            )));
        }
        if let Some(options) = readiness_taint::Options::from_settings(&settings) {
            tasks.push(tokio::spawn(readiness_taint::run(
                client.clone(),
                options,
                health.clone(),
            )));
        }
        if let Some(options) = network_policy::Options::from_settings(&settings) {
            // Bound before the conflist names it, as the log socket is.
            let gate = settings
                .policy_socket()
                .map(|path| network_policy::Gate::new(path, health.clone(), metrics.clone()));
            tasks.push(tokio::spawn(network_policy::run(
                client.clone(),
                options,
                gate,
                metrics.clone(),
                pod_watch.every_pod(),
            )));
        }
        // After its readers, so none misses the first list.
        if let Some(watching) = pod_watch.run(client.clone()) {
            tasks.push(tokio::spawn(watching));
        }
        let network = if settings.own_network {
            log::info!(
                "node {}: writing {} from its Node object",
                settings.node_name,
                settings.conflist_path().display()
            );
            let controllers = node_watch::Controllers {
                conflist: Conflist::new(
                    conflist::Options::from_settings(&settings),
                    chain,
                    metrics.clone(),
                ),
                routes: Routes::new(routes::Options::from_settings(&settings), metrics.clone()),
                egress: Egress::new(egress::Options::from_settings(&settings), metrics),
            };
            Some(tokio::spawn(node_watch::run(client, controllers, health)))
        } else {
            log::info!(
                "node {}: Istio's CNI only, beside the node's own network",
                settings.node_name
            );
            health.set_network_not_ours();
            None
        };
        Ok(Running {
            settings,
            _probes: probes,
            plugin_logs,
            installer,
            record,
            istio,
            lease_service,
            tasks,
            network,
        })
    }
}

impl Running {
    /// Until the Node watch ends, which is a failure; never where the
    /// node's network is not the agent's.
    pub async fn failed(&mut self) -> Result<(), Error> {
        match self.network.as_mut() {
            Some(network) => match network.await {
                Ok(outcome) => outcome,
                Err(e) => Err(Error::task("the Node watch")(e)),
            },
            None => std::future::pending().await,
        }
    }

    /// Takes the agent down in [`UNINSTALL`]'s order when told to
    /// uninstall, else [`STOP`]'s.
    pub async fn stop(mut self, uninstall: bool) {
        let order = if uninstall { UNINSTALL } else { STOP };
        let options = uninstall::Options::from_settings(&self.settings);
        let mut teardown = Teardown::default();
        for &step in order {
            if !self.settings.own_network && !step.beside_another_network() {
                continue;
            }
            if self.take(step, &options, &mut teardown).await == Flow::Done {
                break;
            }
        }
    }

    async fn take(&mut self, step: Step, options: &uninstall::Options, teardown: &mut Teardown) -> Flow {
        let options = options.clone();
        match step {
            Step::EndTasks => {
                if let Some(network) = self.network.take() {
                    network.abort();
                    let _ = network.await;
                }
                for task in self.tasks.drain(..) {
                    task.abort();
                    let _ = task.await;
                }
            }
            Step::FenceChanges => blocking(changes::stop).await.unwrap_or_default(),
            Step::UnchainIstio => {
                if let Some(istio) = &self.istio {
                    istio_chain::unchain(istio, &self.record);
                }
            }
            Step::RemoveProbeRule => {
                // Only an agent in ambient mode wrote it: Istio's own agent
                // may own one on a node where the suite is the network.
                let ambient = self.istio.as_ref().is_some_and(|istio| {
                    matches!(
                        ambient::Options::from_settings(&self.settings, &istio.entry),
                        Ok(Some(_))
                    )
                });
                if ambient {
                    blocking(uninstall::remove_probe_rule).await.unwrap_or_default();
                }
            }
            Step::RemoveConflist => {
                teardown.conflist_was_ours =
                    conflist::remove(&conflist::Options::from_settings(&self.settings));
            }
            Step::StopLeaseService => {
                if let Some(service) = self.lease_service.take() {
                    service.stop().await;
                }
            }
            Step::RemovePolicyTable => {
                if self.settings.network_policy {
                    blocking(network_policy::remove).await.unwrap_or_default();
                }
            }
            Step::StopPluginLogs => {
                if let Some(plugin_logs) = self.plugin_logs.take() {
                    blocking_as(STOPPING_PLUGIN_LOGS, move || plugin_logs.stop())
                        .await
                        .unwrap_or_default();
                }
            }
            Step::RemoveRoutes => blocking(uninstall::remove_routes).await.unwrap_or_default(),
            Step::RemoveMasquerade => blocking(uninstall::remove_masquerade).await.unwrap_or_default(),
            Step::RemoveUnusedFirewall => {
                let record = self.record.clone();
                teardown.firewall_failed = blocking(move || uninstall::remove_unused_firewall(&record))
                    .await
                    .unwrap_or(true);
            }
            Step::StopLeftoverLeaseService => {
                blocking(move || uninstall::stop_leftover_lease_service(&options))
                    .await
                    .unwrap_or_default();
            }
            Step::RemoveLeaseDir => {
                let leases = blocking(move || uninstall::remove_lease_dir(&options))
                    .await
                    .unwrap_or(LeaseDir::Kept);
                if leases == LeaseDir::Kept {
                    return Flow::Done;
                }
            }
            Step::ForgetFirewall => {
                if !teardown.firewall_failed {
                    let record = self.record.clone();
                    blocking(move || uninstall::forget_firewall(&record))
                        .await
                        .unwrap_or_default();
                }
            }
            Step::RemoveBridge => {
                if teardown.conflist_was_ours {
                    blocking(move || uninstall::remove_bridge(&options))
                        .await
                        .unwrap_or_default();
                }
            }
            Step::RemoveBinaries => {
                let bin_dir = self.installer.bin_dir().clone();
                blocking(move || uninstall::remove_binaries(&options, &bin_dir))
                    .await
                    .unwrap_or_default();
            }
        }
        Flow::Next
    }
}

/// Whether the steps after one are to be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Next,
    Done,
}

/// How a failed step is logged: every step but one is uninstall's; the
/// plugins' log socket also stops on a plain stop.
const UNINSTALLING: &str = "uninstalling";
const STOPPING_PLUGIN_LOGS: &str = "stopping the plugins' log records";

/// Runs an uninstall step that blocks on a thread of its own; None
/// (logged) when the thread panicked.
async fn blocking<T: Send + 'static>(step: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    blocking_as(UNINSTALLING, step).await
}

/// [`blocking`], its failure logged as `what`.
async fn blocking_as<T: Send + 'static>(what: &str, step: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    match tokio::task::spawn_blocking(step).await {
        Ok(done) => Some(done),
        Err(e) => {
            log::error!("{what}: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn position(step: Step) -> usize {
        UNINSTALL.iter().position(|&s| s == step).unwrap_or(usize::MAX)
    }

    #[test]
    fn uninstall_removes_the_conflist_before_anything_pods_need() {
        let conflist = position(Step::RemoveConflist);
        for later in [
            Step::StopLeaseService,
            Step::RemoveRoutes,
            Step::RemoveLeaseDir,
            Step::RemoveBridge,
            Step::RemoveBinaries,
        ] {
            assert!(conflist < position(later), "{later:?} before the conflist goes");
        }
        assert!(position(Step::FenceChanges) < conflist);
        assert!(position(Step::EndTasks) < position(Step::FenceChanges));
    }

    #[test]
    fn uninstall_keeps_what_held_leases_need_after_the_lease_check() {
        let leases = position(Step::RemoveLeaseDir);
        for kept in [Step::ForgetFirewall, Step::RemoveBridge, Step::RemoveBinaries] {
            assert!(leases < position(kept), "{kept:?} before the lease check");
        }
        assert!(position(Step::RemoveMasquerade) < position(Step::RemoveUnusedFirewall));
        assert!(position(Step::StopPluginLogs) < leases);
    }

    #[test]
    fn every_step_of_a_plain_stop_is_one_of_uninstall_in_the_same_order() {
        let positions: Vec<usize> = STOP.iter().map(|&step| position(step)).collect();
        assert!(
            positions.windows(2).all(|pair| pair[0] < pair[1]),
            "{positions:?}"
        );
    }

    #[test]
    fn beside_another_network_only_the_agents_own_steps_are_taken() {
        let taken: Vec<Step> = UNINSTALL
            .iter()
            .copied()
            .filter(|step| step.beside_another_network())
            .collect();
        assert_eq!(
            taken,
            [
                Step::EndTasks,
                Step::FenceChanges,
                Step::UnchainIstio,
                Step::RemoveProbeRule,
                Step::StopPluginLogs,
                Step::RemoveBinaries
            ]
        );
    }
}
