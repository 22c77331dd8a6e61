//! The verbs, over libcni.

use std::path::{Component, Path, PathBuf};

use cni::conf::GcAttachment;
use libcni::{CniConfig, NetworkConfigList, RuntimeConf};
use serde_json::{Map, Value};
use sha2::{Digest, Sha512};

use crate::cli::{Attach, Cli, Gc, Ipam, IpamCommand, Verb};

/// What a successful command reports.
#[derive(Debug)]
pub enum Report {
    Added {
        network: String,
        attachment: GcAttachment,
        netns: String,
        result: Value,
    },
    Checked {
        network: String,
        attachment: GcAttachment,
        skipped: bool,
    },
    Deleted {
        network: String,
        attachment: GcAttachment,
    },
    Status {
        network: String,
        cni_version: String,
        asked: bool,
    },
    Collected {
        network: String,
        valid: Vec<GcAttachment>,
        deleted: Vec<GcAttachment>,
    },
    /// A `cnictl ipam` command and what it returned.
    Ipam { command: IpamKind, doc: Value },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpamKind {
    List,
    Release,
    Gc,
    Export,
    Import,
}

/// Why a command failed, with the CNI version to print a JSON error in.
#[derive(Debug)]
pub struct Failure {
    pub error: libcni::Error,
    pub cni_version: String,
}

impl Failure {
    fn new(error: libcni::Error, list: Option<&NetworkConfigList>) -> Self {
        Failure {
            error,
            cni_version: list.map(|l| l.cni_version.clone()).unwrap_or_default(),
        }
    }
}

fn usage(msg: impl Into<String>) -> Failure {
    Failure::new(libcni::Error::Invalid(cni::Error::invalid_config(msg)), None)
}

pub fn run(cli: &Cli) -> Result<Report, Failure> {
    if let Verb::Ipam(ipam) = &cli.command {
        return run_ipam(ipam);
    }
    let config = CniConfig::new(cni::env::split_path(&cli.global.cni_path), &cli.global.cache_dir);
    let network = match &cli.command {
        Verb::Add(a) | Verb::Check(a) | Verb::Del(a) => &a.network,
        Verb::Status { network } => network,
        Verb::Gc(g) => &g.network,
        Verb::Ipam(_) => unreachable!("handled above"),
    };
    let list = match (
        NetworkConfigList::load(&cli.global.conf_dir, network),
        &cli.command,
    ) {
        (Ok(list), _) => list,
        // As CRI-O does: an attachment whose configuration file is gone (its
        // CNI uninstalled, the pod still there) is deleted with the
        // configuration libcni cached when it was added.
        (Err(not_found @ libcni::Error::NotFound { .. }), Verb::Del(attach)) => {
            cached_list(&config, network, attach)?.ok_or_else(|| Failure::new(not_found, None))?
        }
        (Err(e), _) => return Err(Failure::new(e, None)),
    };
    let fail = |e| Failure::new(e, Some(&list));
    match &cli.command {
        Verb::Add(attach) => {
            let rt = runtime_conf(attach)?;
            match config.add_network_list(&list, &rt) {
                Ok(result) => Ok(Report::Added {
                    network: list.name.clone(),
                    attachment: attachment_of(&rt),
                    netns: rt.netns.clone(),
                    result,
                }),
                Err(add_error) => {
                    // Like a runtime, undo what the chain did before failing,
                    // so a failed add leaves nothing behind.
                    if !matches!(add_error, libcni::Error::Invalid(_))
                        && let Err(del_error) = config.del_network_list(&list, &rt)
                    {
                        eprintln!("cnictl: rollback after failed add also failed: {del_error}");
                    }
                    Err(fail(add_error))
                }
            }
        }
        Verb::Check(attach) => {
            let rt = runtime_conf(attach)?;
            config.check_network_list(&list, &rt).map_err(fail)?;
            Ok(Report::Checked {
                network: list.name.clone(),
                attachment: attachment_of(&rt),
                skipped: list.disable_check,
            })
        }
        Verb::Del(attach) => {
            let rt = runtime_conf(attach)?;
            config.del_network_list(&list, &rt).map_err(fail)?;
            Ok(Report::Deleted {
                network: list.name.clone(),
                attachment: attachment_of(&rt),
            })
        }
        Verb::Status { .. } => {
            let asked = config.status_network_list(&list).map_err(fail)?;
            Ok(Report::Status {
                network: list.name.clone(),
                cni_version: list.cni_version.clone(),
                asked,
            })
        }
        Verb::Ipam(_) => unreachable!("handled above"),
        Verb::Gc(gc) => {
            let valid = valid_attachments(gc, &config, &list).map_err(fail)?;
            let outcome = config.gc_network_list(&list, &valid).map_err(fail)?;
            if !outcome.errors.is_empty() {
                for deleted in &outcome.deleted {
                    eprintln!(
                        "cnictl: deleted stale attachment {}/{}",
                        deleted.container_id, deleted.ifname
                    );
                }
                return Err(fail(libcni::Error::Many(outcome.errors)));
            }
            Ok(Report::Collected {
                network: list.name.clone(),
                valid,
                deleted: outcome.deleted,
            })
        }
    }
}

/// `cnictl ipam`: along the one lease path (`lease::ask`), where "here"
/// opens the database directly under the network's lock.
fn run_ipam(args: &Ipam) -> Result<Report, Failure> {
    use cni::skel::Reply;
    use ipam_config::lease_settings::SocketSetting;
    use lease::{AdminOp, Call, Route};
    let fail = |e: cni::Error| Failure::new(libcni::Error::Invalid(e), None);
    let (kind, network, op) = match &args.command {
        IpamCommand::Ls { network } => (IpamKind::List, network, AdminOp::List),
        IpamCommand::Release {
            network,
            ip: Some(ip),
            ..
        } => (IpamKind::Release, network, AdminOp::ReleaseIp { ip: *ip }),
        IpamCommand::Release {
            network,
            container_id,
            ifname,
            ..
        } => (
            IpamKind::Release,
            network,
            AdminOp::ReleaseContainer {
                container_id: container_id.clone().unwrap_or_default(),
                ifname: ifname.clone(),
            },
        ),
        IpamCommand::Gc { network, valid } => {
            let valid = parse_valid(valid).map_err(|e| Failure::new(e, None))?;
            (IpamKind::Gc, network, AdminOp::Gc { valid })
        }
        IpamCommand::Export { network } => (IpamKind::Export, network, AdminOp::Export),
        IpamCommand::Import {
            network,
            from_reference_dir,
        } => {
            let dir =
                std::path::absolute(from_reference_dir).map_err(|e| fail(cni::Error::io(e.to_string())))?;
            (IpamKind::Import, network, AdminOp::ImportReference { dir })
        }
    };
    let data_dir = std::path::absolute(&args.data_dir).map_err(|e| fail(cni::Error::io(e.to_string())))?;
    let call = Call::admin(data_dir.clone(), network.clone(), op.clone());
    let route = Route::new(&SocketSetting::parse(args.socket.as_deref()), &data_dir);
    let reply = lease::ask(&route, &call, &|_: &Call| {
        let stores = ipam::store::Stores::direct();
        lease::admin_reply(ipam::admin::run(&stores, &data_dir, network, &op).map_err(Into::into))
    });
    let doc = match reply {
        Reply::Failed(e, _) => return Err(fail(e)),
        Reply::Document(doc) => doc,
        Reply::Done | Reply::About(_) => Value::Null,
    };
    Ok(Report::Ipam { command: kind, doc })
}

fn attachment_of(rt: &RuntimeConf) -> GcAttachment {
    GcAttachment {
        container_id: rt.container_id.clone(),
        ifname: rt.ifname.clone(),
    }
}

/// The configuration list cached with `attach`'s result, if any.
fn cached_list(
    config: &CniConfig,
    network: &str,
    attach: &Attach,
) -> Result<Option<NetworkConfigList>, Failure> {
    let rt = runtime_conf(attach)?;
    let cached = config
        .cache
        .load(network, &rt.container_id, &rt.ifname)
        .map_err(|e| Failure::new(e, None))?;
    cached
        .map(|entry| NetworkConfigList::from_bytes(&entry.config).map_err(|e| Failure::new(e, None)))
        .transpose()
}

fn runtime_conf(attach: &Attach) -> Result<RuntimeConf, Failure> {
    let netns = absolute_clean(&attach.netns).map_err(|e| usage(format!("netns path: {e}")))?;
    let container_id = attach
        .container_id
        .clone()
        .unwrap_or_else(|| cnitool_container_id(&netns));
    let args = cni::CniArgs::parse(&attach.args)
        .map_err(|e| Failure::new(libcni::Error::Invalid(e), None))?
        .pairs()
        .to_vec();
    let capability_args = match attach.cap_args.as_deref().filter(|s| !s.is_empty()) {
        None => Map::new(),
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => map,
            Ok(_) => return Err(usage("CAP_ARGS must be a JSON object")),
            Err(e) => return Err(usage(format!("CAP_ARGS is not valid JSON: {e}"))),
        },
    };
    Ok(RuntimeConf {
        container_id,
        netns,
        ifname: attach.ifname.clone(),
        args,
        capability_args,
    })
}

/// cnitool's container ID: "cnitool-" and the first 10 bytes of the
/// SHA-512 of the absolute netns path, in hex.
pub fn cnitool_container_id(netns: &str) -> String {
    let digest = Sha512::digest(netns.as_bytes());
    let hex: String = digest[..10].iter().map(|b| format!("{b:02x}")).collect();
    format!("cnitool-{hex}")
}

/// Go's `filepath.Abs`: joined to the working directory and cleaned
/// lexically (`.` and `..` resolved without following links), so the
/// container ID matches cnitool's for the same argument.
fn absolute_clean(path: &Path) -> std::io::Result<String> {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    let mut clean = PathBuf::from("/");
    for component in joined.components() {
        match component {
            Component::Normal(part) => clean.push(part),
            Component::ParentDir => {
                clean.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(clean.display().to_string())
}

fn valid_attachments(
    gc: &Gc,
    config: &CniConfig,
    list: &NetworkConfigList,
) -> libcni::Result<Vec<GcAttachment>> {
    if gc.all {
        return Ok(Vec::new());
    }
    if gc.prune_missing_netns {
        return Ok(config
            .cache
            .attachments(&list.name)?
            .into_iter()
            .filter(|entry| match entry.sandbox() {
                Some(netns) => netns_exists(Path::new(netns)),
                None => {
                    // Nothing proves it gone: keep it.
                    eprintln!(
                        "cnictl: {}/{}: the cache records no namespace; kept as valid",
                        entry.container_id, entry.ifname
                    );
                    true
                }
            })
            .map(|entry| GcAttachment {
                container_id: entry.container_id,
                ifname: entry.ifname,
            })
            .collect());
    }
    parse_valid(&gc.valid)
}

/// `CONTAINER_ID/IFNAME` arguments, each checked like the runtime's inputs.
fn parse_valid(texts: &[String]) -> libcni::Result<Vec<GcAttachment>> {
    texts
        .iter()
        .map(|text| {
            let (id, ifname) = text.split_once('/').ok_or_else(|| {
                libcni::Error::Invalid(cni::Error::invalid_config(format!(
                    "--valid {text:?}: expected CONTAINER_ID/IFNAME"
                )))
            })?;
            cni::env::validate_container_id(id).map_err(libcni::Error::Invalid)?;
            cni::env::validate_interface_name(ifname).map_err(libcni::Error::Invalid)?;
            Ok(GcAttachment {
                container_id: id.to_owned(),
                ifname: ifname.to_owned(),
            })
        })
        .collect()
}

/// A namespace path still names a namespace (an unmounted `/run/netns`
/// entry is left as an empty regular file).
fn netns_exists(path: &Path) -> bool {
    netns::NetNs::open(path).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_id_matches_cnitool() {
        // coreutils gives the reference digest.
        let id = cnitool_container_id("/var/run/netns/test");
        assert!(id.starts_with("cnitool-"));
        assert_eq!(id.len(), "cnitool-".len() + 20);
        let out = std::process::Command::new("sh")
            .args(["-c", "printf %s /var/run/netns/test | sha512sum | cut -c1-20"])
            .output()
            .expect("sha512sum runs");
        assert_eq!(
            id,
            format!("cnitool-{}", String::from_utf8_lossy(&out.stdout).trim())
        );
    }

    #[test]
    fn paths_are_made_absolute_and_cleaned_like_go() {
        assert_eq!(
            absolute_clean(Path::new("/var/run/../run/netns/./p")).expect("ok"),
            "/var/run/netns/p"
        );
        assert_eq!(absolute_clean(Path::new("/../x")).expect("ok"), "/x");
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(
            absolute_clean(Path::new("p")).expect("ok"),
            cwd.join("p").display().to_string()
        );
    }
}
