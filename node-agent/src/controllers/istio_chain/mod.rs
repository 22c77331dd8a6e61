//! Istio's chained install as the agent runs it (`ISTIO_CHAINED`): a
//! loop that keeps istio-redirect last in the file the runtime uses (or,
//! in Istio's owned mode, keeps a file of the agent's own that sorts
//! first holding the primary's plugins and istio-redirect) and the
//! plugin's kubeconfig current, recording every file it changes on the
//! node before it changes it; and the uninstall that takes the entry out
//! of every file it ever went into. The file operations themselves are
//! `files`', the kubeconfig's `kubeconfig`'s.

pub mod files;
pub mod kubeconfig;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

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
    /// (see [`files::entry`]), naming the kubeconfig and the agent's log
    /// socket unless it names them.
    pub entry: serde_json::Value,
    /// The CNI conf directory.
    pub cni_conf_dir: PathBuf,
    /// The primary configuration's file name (`ISTIO_CNI_CONF_FILE`);
    /// unset: the first valid one.
    pub conf_file: Option<String>,
    /// The agent's own network's conflist, which the chain waits for (the
    /// runtime may choose it); None with `OWN_NETWORK=false`.
    pub own_conflist: Option<PathBuf>,
    /// Istio's owned mode (`ISTIO_OWNED_CNI_CONFIG`): the file of the
    /// agent's own, beside the primary; None: the entry goes into the
    /// primary.
    pub owned_file: Option<PathBuf>,
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
        if settings.native_nftables && entry.get("native_nftables").is_none() {
            entry["native_nftables"] = json!(true);
        }
        if settings.ambient_enabled {
            entry["ambient_enabled"] = json!(true);
            if entry.get("cni_agent_run_dir").is_none()
                && let Some(dir) = settings.istio_kubeconfig.parent()
            {
                entry["cni_agent_run_dir"] = json!(dir);
            }
        }
        if let Some(socket) = settings.plugin_log_socket() {
            conf_dir::with_log_socket(&mut entry, &socket);
        }
        Ok(Options {
            entry,
            cni_conf_dir: settings.cni_conf_dir.clone(),
            conf_file: settings.istio_cni_conf_file.clone(),
            own_conflist: settings.own_network.then(|| settings.conflist_path()),
            owned_file: settings.istio_owned_cni_config.then(|| {
                settings
                    .cni_conf_dir
                    .join(&settings.istio_owned_cni_conf_filename)
            }),
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
enum NotInPlace {
    /// Nothing to chain into yet (the agent's own conflist, or any
    /// configuration; no failure: Istio's installer waits for one too), or
    /// no change allowed any more (uninstall has begun).
    Waiting(Error),
    /// istio-redirect's kubeconfig could not be written.
    Kubeconfig(Error),
    /// The entry could not be put into the primary configuration (or the
    /// owned file could not be written, or does not sort first).
    Config(Error),
}

impl From<Error> for NotInPlace {
    fn from(e: Error) -> NotInPlace {
        NotInPlace::Config(e)
    }
}

impl std::fmt::Display for NotInPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotInPlace::Waiting(e) | NotInPlace::Kubeconfig(e) | NotInPlace::Config(e) => e.fmt(f),
        }
    }
}

/// What the loop remembers between checks.
#[derive(Debug, Default)]
struct Known {
    /// Files known to be in the record, so that a check finding the entry
    /// in place costs no lock and no read of the record.
    recorded: BTreeSet<PathBuf>,
    /// What the other mode left on the node (an owned file, or entries in
    /// primaries) has been taken away since this agent started.
    other_mode_cleared: bool,
}

/// Keeps istio-redirect last in the node's primary configuration, or the
/// owned file current (waiting for a primary when the directory has none
/// yet), and its kubeconfig current. A problem is logged when it first
/// shows, not every check; a failure is counted at every check, as
/// Istio's installer counts every failed attempt.
pub async fn run(options: Options, record: Record, health: Health, metrics: Metrics) {
    warn_of_earlier_wraps(&options);
    let mut every = tokio::time::interval(CHAIN_CHECK);
    let mut last_problem: Option<String> = None;
    let mut known = Known::default();
    loop {
        every.tick().await;
        let (options, record, counting) = (options.clone(), record.clone(), metrics.clone());
        let checking = tokio::task::spawn_blocking(move || {
            let checked = changes::change(|| Ok(check_once(&options, &record, &mut known, &counting)))
                .unwrap_or_else(|stopped| Err(NotInPlace::Waiting(stopped)));
            (checked, known)
        })
        .await;
        let checked = match checking {
            Ok((checked, still_known)) => {
                known = still_known;
                checked
            }
            Err(e) => {
                known = Known::default();
                Err(NotInPlace::Config(Error::Task {
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
                    NotInPlace::Waiting(_) => {}
                    NotInPlace::Kubeconfig(_) => metrics.installed(InstallResult::CreateKubeconfigFailure),
                    NotInPlace::Config(_) => metrics.installed(InstallResult::CreateCniConfigFailure),
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

/// One check of the kubeconfig and of the entry (or the owned file);
/// what it changed.
fn check_once(
    options: &Options,
    record: &Record,
    known: &mut Known,
    metrics: &Metrics,
) -> Result<Vec<String>, NotInPlace> {
    let mut done = Vec::new();
    let rendered = server_url()
        .and_then(|server| kubeconfig::render(&server, &options.service_account_dir))
        .map_err(NotInPlace::Kubeconfig)?;
    if kubeconfig::write_if_changed(&options.kubeconfig, &rendered).map_err(NotInPlace::Kubeconfig)? {
        done.push(format!("wrote {}", options.kubeconfig.display()));
    }
    let put_back = match &options.owned_file {
        Some(owned) => write_owned(options, owned, record, known, &mut done)?,
        None => chain_into_primary(options, record, known, &mut done)?,
    };
    if put_back {
        metrics.chain_reinserted();
    }
    Ok(done)
}

/// The file the entry goes with: the primary configuration, once there
/// is one (and, for an agent with its own network, once its conflist is
/// written: the runtime may choose that one).
fn primary_of(options: &Options, skip: Option<&Path>) -> Result<PathBuf, NotInPlace> {
    if let Some(own) = &options.own_conflist
        && std::fs::symlink_metadata(own).is_err()
    {
        return Err(NotInPlace::Waiting(Error::Io(format!(
            "waiting for {} before choosing the file to chain istio-redirect into",
            own.display()
        ))));
    }
    files::primary(&options.cni_conf_dir, options.conf_file.as_deref(), skip).ok_or_else(|| {
        NotInPlace::Waiting(Error::Io(format!(
            "no CNI configuration in {} yet: waiting for one to chain istio-redirect into",
            options.cni_conf_dir.display()
        )))
    })
}

/// Makes the primary end with the entry; whether it had to be put in. The
/// file chained is recorded on the node before it is changed, so that
/// uninstall finds it whatever happens to the agent in between.
fn chain_into_primary(
    options: &Options,
    record: &Record,
    known: &mut Known,
    done: &mut Vec<String>,
) -> Result<bool, NotInPlace> {
    let entry = &options.entry;
    // An owned file an agent in Istio's owned mode left would sort first
    // and be taken for the primary.
    if !known.other_mode_cleared {
        for owned in record.read()?.owned {
            remove_owned(&owned, entry, record, done)?;
        }
        known.other_mode_cleared = true;
    }
    let primary = primary_of(options, None)?;
    if files::in_place(&primary, entry) {
        if options.own_conflist.as_ref() != Some(&primary) && !known.recorded.contains(&primary) {
            record.update(|r| r.chained.insert(primary.clone()))?;
            known.recorded.insert(primary);
        }
        return Ok(false);
    }
    let plan = files::plan(&primary, entry)?;
    // A wrap writes the `.conf`'s list beside it: only over a list of the
    // agent's own making, never over someone's file of that name.
    if plan.wrapped.is_some()
        && std::fs::symlink_metadata(&plan.target).is_ok()
        && !record.read()?.wrapped.contains_key(&plan.target)
    {
        return Err(Error::Io(format!(
            "cannot wrap {} into a list: {} is someone else's",
            primary.display(),
            plan.target.display()
        ))
        .into());
    }
    // The agent's own conflist goes whole at uninstall.
    if options.own_conflist.as_ref() != Some(&plan.target) {
        record.update(|r| {
            r.chained.insert(plan.target.clone());
            if let Some(wrapped) = &plan.wrapped {
                r.wrapped.insert(plan.target.clone(), wrapped.clone());
            }
        })?;
        known.recorded.insert(plan.target.clone());
    }
    files::apply(&plan)?;
    done.push(format!("chained istio-redirect into {}", plan.target.display()));
    Ok(true)
}

/// Istio's owned mode: `owned` holds the primary's list (its name, version
/// and plugins unchanged) ending with the entry, re-copied whenever the
/// primary changes; the primary is never written. Whether it was written.
/// Fails, so the agent is not ready, while another file sorts before
/// `owned` (the runtime would not use it), and while there is no primary
/// (`owned` is then taken away: see [`withdraw_owned`]).
fn write_owned(
    options: &Options,
    owned: &Path,
    record: &Record,
    known: &mut Known,
    done: &mut Vec<String>,
) -> Result<bool, NotInPlace> {
    let entry = &options.entry;
    let primary = match primary_of(options, Some(owned)) {
        Ok(primary) => primary,
        Err(none) => {
            withdraw_owned(owned, entry, record, known)?;
            return Err(none);
        }
    };
    let content = files::with_entry(&primary, entry)?;
    if !known.recorded.contains(owned) {
        // A file of that name the agent never wrote is someone else's.
        let ours = record.update(|r| {
            let known = r.owned.contains(owned);
            let foreign = !known && std::fs::symlink_metadata(owned).is_ok() && !files::holds(owned, entry);
            if !foreign {
                r.owned.insert(owned.to_path_buf());
            }
            !foreign
        })?;
        if !ours {
            return Err(Error::Io(format!(
                "cannot write {}: a file of that name that is not the agent's is there; \
                 set ISTIO_OWNED_CNI_CONF_FILENAME to another name",
                owned.display()
            ))
            .into());
        }
        known.recorded.insert(owned.to_path_buf());
    }
    let written = conf_dir::write_if_changed(owned, &content)?;
    if written {
        done.push(format!(
            "wrote {} from {} and istio-redirect",
            owned.display(),
            primary.display()
        ));
    }
    // Entries an agent in the chained mode put into primaries go once the
    // owned file carries the chain: pods set up meanwhile are captured
    // either way.
    if !known.other_mode_cleared {
        let recorded = record.read()?;
        for path in &recorded.chained {
            unchain_one(path, recorded.wrapped.get(path), record, done);
        }
        known.other_mode_cleared = true;
    }
    match files::runtimes_choice(&options.cni_conf_dir) {
        Some(first) if first == owned => Ok(written),
        first => Err(Error::Io(format!(
            "{} no longer sorts first ({} does): pods set up now are not captured; \
             set ISTIO_OWNED_CNI_CONF_FILENAME to a name that sorts before it",
            owned.display(),
            first.map_or_else(|| "no valid file".to_owned(), |f| f.display().to_string())
        ))
        .into()),
    }
}

/// Takes the owned file away while there is no primary to copy: it sorts
/// first, so a copy of a primary that is gone would have the runtime run
/// that removed network for every new pod, and the node stay NetworkReady
/// and keep getting pods; without it the runtime sees the directory as it
/// would without the agent. It is written again once a primary is back. A
/// file of that name the agent never wrote, or holding no entry of ours
/// (someone's put in its place), stays.
fn withdraw_owned(
    owned: &Path,
    entry: &serde_json::Value,
    record: &Record,
    known: &mut Known,
) -> Result<(), Error> {
    if std::fs::symlink_metadata(owned).is_err() {
        return Ok(());
    }
    let recorded = known.recorded.contains(owned) || record.read()?.owned.contains(owned);
    let ours = files::holds_an_entry_of_ours(owned) && (recorded || files::holds(owned, entry));
    if !ours {
        return Ok(());
    }
    match std::fs::remove_file(owned) {
        Ok(()) => {
            // Logged here: the check fails (no primary), and a failed
            // check's changes are not logged.
            log::warn!(
                "removed {}: no primary CNI configuration is left to copy into it; \
                 written again once one is back",
                owned.display()
            );
        }
        // Another agent of a rollout took it away first.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::file("remove", owned, e)),
    }
    // Forgotten once gone, so that a file someone puts there meanwhile is
    // theirs, not overwritten when a primary is back.
    record.update(|r| r.owned.remove(owned))?;
    known.recorded.remove(owned);
    Ok(())
}

/// Removes an owned file that still holds the entry (someone's file of
/// that name since is left) and forgets it.
fn remove_owned(
    owned: &Path,
    entry: &serde_json::Value,
    record: &Record,
    done: &mut Vec<String>,
) -> Result<(), Error> {
    if files::holds(owned, entry) {
        std::fs::remove_file(owned).map_err(|e| Error::file("remove", owned, e))?;
        done.push(format!("removed {}", owned.display()));
    }
    record.update(|r| r.owned.remove(owned))?;
    Ok(())
}

/// Takes the entry out of one file (putting a wrapped `.conf` back) and
/// forgets it; a file that cannot be undone stays in the record for the
/// next try.
fn unchain_one(
    path: &Path,
    wrapped: Option<&crate::record::Wrapped>,
    record: &Record,
    done: &mut Vec<String>,
) {
    match files::unchain(path, wrapped) {
        Ok(outcome) => {
            match outcome {
                files::Unchained::Nothing => {}
                files::Unchained::Removed => {
                    done.push(format!("removed istio-redirect from {}", path.display()))
                }
                files::Unchained::PutBack(conf) => done.push(format!(
                    "removed {} and put {} back",
                    path.display(),
                    conf.display()
                )),
            }
            let forgotten = record.update(|r| {
                r.chained.remove(path);
                r.wrapped.remove(path);
            });
            if let Err(e) = forgotten {
                log::error!("{e}");
            }
        }
        Err(e) => log::error!("{e}"),
    }
}

/// Takes Istio's entry out of every file the agent chained it into (the
/// record's, and the primary one in case the record was lost), putting a
/// wrapped `.conf` back, removes the owned files and the plugin's
/// kubeconfig. A file that cannot be undone stays in the record for the
/// next uninstall.
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
    let mut done = Vec::new();
    let owned: BTreeSet<PathBuf> = recorded
        .owned
        .iter()
        .chain(&options.owned_file)
        .cloned()
        .collect();
    for path in &owned {
        if let Err(e) = remove_owned(path, entry, record, &mut done) {
            log::error!("{e}");
        }
    }
    let mut files: BTreeSet<PathBuf> = recorded
        .chained
        .iter()
        .chain(recorded.wrapped.keys())
        .cloned()
        .collect();
    files.extend(files::primary(
        &options.cni_conf_dir,
        options.conf_file.as_deref(),
        None,
    ));
    // Releases before this one recorded nothing: a file holding exactly
    // the agent's entry was chained by one of them.
    files.extend(
        conf_dir::files(&options.cni_conf_dir)
            .into_iter()
            .filter(|path| files::holds(path, entry)),
    );
    for path in options.own_conflist.iter().chain(&owned) {
        files.remove(path);
    }
    for path in files {
        unchain_one(&path, recorded.wrapped.get(&path), record, &mut done);
    }
    for change in done {
        log::info!("{change}");
    }
}
