//! Istio's chained install as the agent runs it (`ISTIO_CHAINED`): a
//! loop that keeps istio-redirect last in the file the runtime uses and
//! the plugin's kubeconfig current, recording every file it changes on the
//! node before it changes it; and the uninstall that takes the entry out
//! of every file it ever went into. The file operations themselves are
//! `files`', the kubeconfig's `kubeconfig`'s.

pub mod files;
pub mod kubeconfig;

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::json;

use crate::cluster::client::server_url;
use crate::error::Error;
use crate::health::Health;
use crate::metrics::{InstallResult, Metrics};
use crate::record::{NodeRecord, Record};
use crate::settings::Settings;
use crate::{changes, conf_dir};

/// Istio's entry and where it goes.
#[derive(Debug, Clone)]
pub struct Options {
    /// istio-redirect's entry: `ISTIO_PLUGIN_CONFIG`, else the default
    /// (see [`files::entry`]), naming the kubeconfig unless it names one.
    pub entry: serde_json::Value,
    /// The CNI conf directory.
    pub cni_conf_dir: PathBuf,
    /// The primary configuration's file name (`ISTIO_CNI_CONF_FILE`);
    /// unset: the first valid one.
    pub conf_file: Option<String>,
    /// The agent's own conflist.
    pub own_conflist: PathBuf,
    /// The kubeconfig written for istio-redirect (`ISTIO_KUBECONFIG`).
    pub kubeconfig: PathBuf,
    /// The service account the kubeconfig is made from.
    pub service_account_dir: PathBuf,
}

impl Options {
    /// Fails on an `ISTIO_PLUGIN_CONFIG` that is not istio-redirect's entry.
    pub fn from_settings(settings: &Settings) -> Result<Options, Error> {
        let mut entry = files::entry(settings.istio_plugin_config.as_deref())?;
        if entry.get("kubeconfig").is_none() {
            entry["kubeconfig"] = json!(settings.istio_kubeconfig);
        }
        Ok(Options {
            entry,
            cni_conf_dir: settings.cni_conf_dir.clone(),
            conf_file: settings.istio_cni_conf_file.clone(),
            own_conflist: settings.conflist_path(),
            kubeconfig: settings.istio_kubeconfig.clone(),
            service_account_dir: settings.service_account_dir.clone(),
        })
    }
}

/// How often the primary configuration is checked for Istio's entry: an
/// agent that rewrites the file has it back within this.
const CHAIN_CHECK: std::time::Duration = std::time::Duration::from_millis(500);

/// Why a check did not leave the entry in place.
#[derive(Debug)]
enum Unchained {
    /// Nothing to chain into yet (the agent's own conflist, or any
    /// configuration; no failure: Istio's installer waits for one too), or
    /// no change allowed any more (uninstall has begun).
    Waiting(Error),
    /// istio-redirect's kubeconfig could not be written.
    Kubeconfig(Error),
    /// The entry could not be put into the primary configuration.
    Config(Error),
}

impl std::fmt::Display for Unchained {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unchained::Waiting(e) | Unchained::Kubeconfig(e) | Unchained::Config(e) => e.fmt(f),
        }
    }
}

/// Keeps istio-redirect last in the node's primary configuration (waiting
/// for one when the directory has none yet) and its kubeconfig current.
/// A problem is logged when it first shows, not every check; a failure is
/// counted at every check, as Istio's installer counts every failed
/// attempt.
pub async fn run(options: Options, record: Record, health: Health, metrics: Metrics) {
    warn_of_earlier_wraps(&options);
    let mut every = tokio::time::interval(CHAIN_CHECK);
    let mut last_problem: Option<String> = None;
    // Files known to be in the record, so that a check finding the entry
    // in place costs no lock and no read of the record.
    let mut recorded = BTreeSet::new();
    loop {
        every.tick().await;
        let (options, record, counting) = (options.clone(), record.clone(), metrics.clone());
        let checking = tokio::task::spawn_blocking(move || {
            let checked = changes::change(|| Ok(chain_once(&options, &record, &mut recorded, &counting)))
                .unwrap_or_else(|stopped| Err(Unchained::Waiting(stopped)));
            (checked, recorded)
        })
        .await;
        let checked = match checking {
            Ok((checked, known)) => {
                recorded = known;
                checked
            }
            Err(e) => {
                recorded = BTreeSet::new();
                Err(Unchained::Config(Error::Task {
                    what: "chaining",
                    source: e,
                }))
            }
        };
        match checked {
            Ok(done) => {
                for change in done {
                    log::info!("{change}");
                }
                health.set_chained(true);
                last_problem = None;
            }
            Err(problem) => {
                match &problem {
                    Unchained::Waiting(_) => {}
                    Unchained::Kubeconfig(_) => metrics.installed(InstallResult::CreateKubeconfigFailure),
                    Unchained::Config(_) => metrics.installed(InstallResult::CreateCniConfigFailure),
                }
                health.set_chained(false);
                let text = problem.to_string();
                if last_problem.as_ref() != Some(&text) {
                    log::warn!("{text}");
                    last_problem = Some(text);
                }
            }
        }
    }
}

/// Tells of lists an earlier release wrapped under Istio's name: that
/// rename cannot be undone without splitting the node's leases again (pods
/// set up since hold theirs under the new name), so the list keeps it.
fn warn_of_earlier_wraps(options: &Options) {
    for path in conf_dir::files(&options.cni_conf_dir) {
        if let Some(original) = files::renamed_by_an_earlier_wrap(&path) {
            log::warn!(
                "{} was wrapped by an earlier release under the network name k8s-pod-network: \
                 pods set up since hold leases apart from pods set up before as {original:?}, \
                 and may share addresses with them until those are gone",
                path.display()
            );
        }
    }
}

/// One check of the kubeconfig and of the entry; what it changed. The
/// file chained is recorded on the node before it is changed, so that
/// uninstall finds it whatever happens to the agent in between.
fn chain_once(
    options: &Options,
    record: &Record,
    recorded: &mut BTreeSet<PathBuf>,
    metrics: &Metrics,
) -> Result<Vec<String>, Unchained> {
    let mut done = Vec::new();
    let rendered = server_url()
        .and_then(|server| kubeconfig::render(&server, &options.service_account_dir))
        .map_err(Unchained::Kubeconfig)?;
    if kubeconfig::write_if_changed(&options.kubeconfig, &rendered).map_err(Unchained::Kubeconfig)? {
        done.push(format!("wrote {}", options.kubeconfig.display()));
    }
    chain_entry(options, record, recorded, metrics, done)
}

/// [`chain_once`]'s part on the primary configuration, after the kubeconfig.
fn chain_entry(
    options: &Options,
    record: &Record,
    recorded: &mut BTreeSet<PathBuf>,
    metrics: &Metrics,
    mut done: Vec<String>,
) -> Result<Vec<String>, Unchained> {
    let entry = &options.entry;
    // The file to chain is the one the runtime will use, which the agent's
    // own conflist, once written, may be.
    let own = options.own_conflist.clone();
    if std::fs::symlink_metadata(&own).is_err() {
        return Err(Unchained::Waiting(Error::Io(format!(
            "waiting for {} before choosing the file to chain istio-redirect into",
            own.display()
        ))));
    }
    let primary = files::primary(&options.cni_conf_dir, options.conf_file.as_deref()).ok_or_else(|| {
        Unchained::Waiting(Error::Io(format!(
            "no CNI configuration in {} yet: waiting for one to chain istio-redirect into",
            options.cni_conf_dir.display()
        )))
    })?;
    let failed = Unchained::Config;
    if files::in_place(&primary, entry) {
        if primary != own && !recorded.contains(&primary) {
            record
                .update(|r| r.chained.insert(primary.clone()))
                .map_err(failed)?;
            recorded.insert(primary);
        }
        return Ok(done);
    }
    let plan = files::plan(&primary, entry).map_err(failed)?;
    // A wrap writes the `.conf`'s list beside it: only over a list of the
    // agent's own making, never over someone's file of that name.
    if plan.wrapped.is_some()
        && std::fs::symlink_metadata(&plan.target).is_ok()
        && !record.read().map_err(failed)?.wrapped.contains_key(&plan.target)
    {
        return Err(failed(Error::Io(format!(
            "cannot wrap {} into a list: {} is someone else's",
            primary.display(),
            plan.target.display()
        ))));
    }
    // The agent's own conflist goes whole at uninstall.
    if plan.target != own {
        record
            .update(|r| {
                r.chained.insert(plan.target.clone());
                if let Some(wrapped) = &plan.wrapped {
                    r.wrapped.insert(plan.target.clone(), wrapped.clone());
                }
            })
            .map_err(failed)?;
        recorded.insert(plan.target.clone());
    }
    files::apply(&plan).map_err(failed)?;
    metrics.chain_reinserted();
    done.push(format!("chained istio-redirect into {}", plan.target.display()));
    Ok(done)
}

/// Takes Istio's entry out of every file the agent chained it into (the
/// record's, and the primary one in case the record was lost), putting a
/// wrapped `.conf` back, and removes the plugin's kubeconfig. A file that
/// cannot be undone stays in the record for the next uninstall.
pub fn unchain(options: &Options, record: &Record) {
    let entry = &options.entry;
    match std::fs::remove_file(&options.kubeconfig) {
        Ok(()) => log::info!("removed {}", options.kubeconfig.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => log::error!("cannot remove {}: {e}", options.kubeconfig.display()),
    }
    let recorded = record.read().unwrap_or_else(|e| {
        log::error!("{e}");
        NodeRecord::default()
    });
    let mut files: BTreeSet<PathBuf> = recorded
        .chained
        .iter()
        .chain(recorded.wrapped.keys())
        .cloned()
        .collect();
    files.extend(files::primary(
        &options.cni_conf_dir,
        options.conf_file.as_deref(),
    ));
    // Releases before this one recorded nothing: a file holding exactly
    // the agent's entry was chained by one of them.
    files.extend(
        conf_dir::files(&options.cni_conf_dir)
            .into_iter()
            .filter(|path| files::holds(path, entry)),
    );
    files.remove(&options.own_conflist);
    for path in files {
        match files::unchain(&path, recorded.wrapped.get(&path)) {
            Ok(outcome) => {
                match outcome {
                    files::Unchained::Nothing => {}
                    files::Unchained::Removed => {
                        log::info!("removed istio-redirect from {}", path.display())
                    }
                    files::Unchained::PutBack(conf) => {
                        log::info!("removed {} and put {} back", path.display(), conf.display());
                    }
                }
                let forgotten = record.update(|r| {
                    r.chained.remove(&path);
                    r.wrapped.remove(&path);
                });
                if let Err(e) = forgotten {
                    log::error!("{e}");
                }
            }
            Err(e) => log::error!("{e}"),
        }
    }
}
