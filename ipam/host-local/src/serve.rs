//! `host-local serve [--socket PATH] [--idle-exit SECONDS]`: the node-local
//! lease service. Run it once per node (a systemd unit, a DaemonSet, or in
//! the background), or let host-local start one per data directory when
//! nothing is configured (it passes `--idle-exit`); plugin processes and
//! `cnictl ipam` find it at the socket. SIGTERM and SIGINT stop it as its
//! idle exit does: it stops listening, answers what it accepted, makes every
//! release it answered durable, and exits 0 (1 if a release it answered
//! could not be made durable within the wait).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use cni::skel::{Reply, dispatch};
use ipam::store::{ClaimHook, Stores};
use ipam_config::lease_settings::{DEFAULT_DATA_DIR, data_dir_socket};
use lease::Call;
use lease::server::{self, Claimer, Handler, Service, Stopper, Unclaimed};

use crate::plugin::HostLocal;

/// host-local's store behind the lease service: plugin calls run the
/// verbs, operator calls `ipam::admin`; a release answered once committed
/// is made durable right after its answer (see `ipam::store`).
struct Leases {
    plugin: HostLocal,
    stores: Arc<Stores>,
}

impl Handler for Leases {
    fn answer(&self, call: &Call) -> Reply {
        match call {
            Call::Plugin { env, stdin } => {
                let _request_log = cni::log::request_scope();
                dispatch(&self.plugin, env, || Ok(stdin.clone().into_bytes()))
            }
            Call::Admin {
                data_dir,
                network,
                op,
            } => {
                lease::admin_reply(ipam::admin::run(&self.stores, data_dir, network, op).map_err(Into::into))
            }
        }
    }

    fn owes_after_answer(&self) -> bool {
        self.stores.owes_durability()
    }

    fn settle(&self) {
        self.stores.make_releases_durable();
    }

    fn owed(&self) -> usize {
        ipam::store::releases_owed()
    }
}

/// The store's hook before a data directory's first database opens: the
/// service takes charge of that directory, or the call is answered busy
/// (code 11) naming the service that has it.
fn claiming(claimer: Claimer) -> ClaimHook {
    Box::new(move |sled_dir: &Path| {
        let data_dir = sled_dir.parent().unwrap_or(sled_dir);
        claimer.claim(data_dir).map_err(|refused| match refused {
            Unclaimed::Busy { .. } => ipam::Error::Busy(refused.to_string()),
            Unclaimed::Unusable { .. } | Unclaimed::Stopped => ipam::Error::Store(refused.to_string()),
        })
    })
}

const USAGE: &str = "usage: host-local serve [--socket PATH] [--idle-exit SECONDS]\n  \
    --socket     where to listen (default /var/lib/cni/networks/.sled/.service.sock,\n               \
    the default data directory's own socket)\n  \
    --idle-exit  exit after this long without a request, detached from whoever started it";

pub fn main(mut args: impl Iterator<Item = OsString>) -> ExitCode {
    let mut socket = data_dir_socket(Path::new(DEFAULT_DATA_DIR));
    let mut idle_exit = None;
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--socket") => match args.next() {
                Some(path) => socket = PathBuf::from(path),
                None => return usage_error(),
            },
            Some("--idle-exit") => match args.next().and_then(|s| s.to_str()?.parse::<u64>().ok()) {
                Some(seconds) => idle_exit = Some(Duration::from_secs(seconds)),
                None => return usage_error(),
            },
            Some("-h" | "--help") => {
                eprintln!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            _ => return usage_error(),
        }
    }
    if idle_exit.is_some() {
        // Started by a plugin: nothing of the runtime's (its pipes, its
        // session) may stay with this process.
        if let Err(e) = lease::start::detach_from_starter() {
            eprintln!("host-local serve: cannot close inherited descriptors: {e}");
        }
    }
    // Before any thread exists, since it edits the environment; after
    // detaching, since a started service keeps nothing it inherited.
    let passed = server::passed_by_service_manager();
    cni::log::init("host-local");
    cni::log::keep_own_settings();
    let mut service = Service::new();
    if let Some(after) = idle_exit {
        service = service.exit_when_idle(after);
    }
    // After detaching (it closes every inherited descriptor) and after the
    // service manager's socket is taken (fd 3): the signals' pipe is a
    // descriptor of its own. Before anything is bound, so a SIGTERM from
    // now on always stops cleanly.
    if let Err(e) = stop_on_signals(service.stopper()) {
        eprintln!("host-local serve: cannot handle SIGTERM and SIGINT: {e}");
        return ExitCode::FAILURE;
    }
    let stores = Arc::new(Stores::resident(Some(claiming(service.claimer()))));
    let listening = match passed {
        Ok(Some(listening)) => {
            eprintln!("host-local serve: listening on the socket passed by the service manager");
            listening
        }
        Err(e) => {
            eprintln!("host-local serve: cannot use the socket passed by the service manager: {e}");
            return ExitCode::FAILURE;
        }
        Ok(None) => match server::bind(&socket) {
            Ok(listening) => {
                eprintln!("host-local serve: listening on {}", socket.display());
                listening
            }
            Err(e) => {
                eprintln!("host-local serve: cannot listen on {}: {e}", socket.display());
                return ExitCode::FAILURE;
            }
        },
    };
    let leases = Leases {
        plugin: HostLocal::new(Arc::clone(&stores)),
        stores,
    };
    match service.run(listening, Arc::new(leases)) {
        Ok(stopped) => {
            eprintln!("host-local serve: {stopped}");
            // An answered release lost with this process is worth saying
            // in the status too.
            if stopped.releases_not_durable == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("host-local serve: {e}");
            ExitCode::FAILURE
        }
    }
}

/// SIGTERM and SIGINT stop the service (see [`Service::run`]). signal-hook's
/// handler only writes to a pipe; a thread of its own reads it and tells
/// the service, whose run loop wakes at once. A second signal while it
/// stops changes nothing: the stop is bounded already.
fn stop_on_signals(stopper: Stopper) -> std::io::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                let name = signal_hook::low_level::signal_name(signal).unwrap_or("a signal");
                stopper.stop(name);
            }
        })
        .map(drop)
}

fn usage_error() -> ExitCode {
    eprintln!("{USAGE}");
    ExitCode::from(2)
}
