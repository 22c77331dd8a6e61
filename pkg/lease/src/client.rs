//! The one lease path: how a request of host-local, of the bridge or of
//! `cnictl ipam` reaches the leases, and what happens when a service on the
//! way is absent, busy, restarting or dies mid-request.
//!
//! A request is tried at its [`Route`]'s places in order:
//! - a plugin process or `cnictl`: the service an operator named with
//!   `socket`, if any, then the service in charge of the data directory
//!   (`<dataDir>/.sled/.service.sock`, whoever started it: a plugin, the
//!   node agent or systemd), then this process, opening the database
//!   itself;
//! - a lease service: itself, then the service in charge of the data
//!   directory when that is another one.
//!
//! A place that is absent, not trusted ([`crate::socket`]) or whose queue
//! of connections is full is skipped. A service that took the request and
//! died, or gave no answer in time, is skipped too: every verb is safe to
//! repeat (an ADD from the same namespace gets the lease it already holds).
//! An answer of code 11 (the database is held elsewhere) moves on to the
//! next place; after the last one the round starts again after a short
//! pause. Any other answer is final. One deadline, [`PATIENCE`], bounds
//! the whole request: every wait for a service's answer ends with it, and
//! once it has passed, the last answer of code 11 is given. A request
//! passed to the data directory's service is marked forwarded and is never
//! passed on again. A relative `dataDir` means the runtime's working
//! directory, which no service shares: such requests are only run here.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cni::skel::Reply;

use crate::served::Served;
use crate::socket::{self, FileId};
use crate::wire::{Call, Request, Response, ServiceQuery, is_busy};
use ipam_config::lease_settings::{LeaseSettings, SocketSetting, data_dir_socket};
use ipam_config::trust::Refusal;

/// How long a request may take along the lease path, waits for answers and
/// for a database held elsewhere included: far more than a burst of ADDs
/// queued on a network's lock or a 60000-lease import takes (seconds), and
/// well below the two minutes a kubelet gives a runtime call. A service
/// that stopped (SIGSTOP) or hangs costs a request this much, not more.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Why a service did not answer a request.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// Nothing listens there.
    #[error("no lease service at {path}: {reason}")]
    Unreachable { path: PathBuf, reason: String },
    /// Something listens there that must not be sent a request.
    #[error("not using the lease service at {path}: {reason}")]
    Untrusted { path: PathBuf, reason: String },
    /// A service listens there, not run from the binary the caller would
    /// otherwise execute.
    #[error("not using the lease service at {path}: it is not run from the host-local in CNI_PATH")]
    OtherBinary { path: PathBuf },
    /// The service took the request but gave no whole answer (it died, or
    /// timed out). Whether the operation happened is unknown.
    #[error("lease service at {path} gave no answer: {reason}")]
    Broken { path: PathBuf, reason: String },
}

/// A service to try, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ServicePlace {
    socket: PathBuf,
    /// The request is passed on to it (it is the data directory's own).
    forwarded: bool,
    /// The binary that starts a service there when none listens.
    start: Option<PathBuf>,
    /// Used only if its process runs this binary.
    binary: Option<FileId>,
}

impl ServicePlace {
    fn new(socket: PathBuf, forwarded: bool) -> Self {
        ServicePlace {
            socket,
            forwarded,
            start: None,
            binary: None,
        }
    }
}

/// Sends one call to the service at `socket` and returns its answer,
/// giving up after [`PATIENCE`]: for tests of a service, which want to
/// know why one did not answer.
#[cfg(test)]
pub(crate) fn forward(socket: &Path, call: &Call) -> Result<Reply, CallError> {
    forward_until(
        &ServicePlace::new(socket.to_path_buf(), false),
        &Request::new(call.clone()),
        Instant::now() + PATIENCE,
    )
    .map(Reply::from)
}

/// What the service at `socket` has answered since it started, asked
/// directly (no other place is tried, no service started), under the same
/// trust as every call ([`crate::socket`]), waiting at most `within`: for
/// the node agent's metrics, read on each scrape.
pub fn served(socket: &Path, within: Duration) -> Result<Served, CallError> {
    let place = ServicePlace::new(socket.to_path_buf(), false);
    let unreadable = |reason: String| CallError::Broken {
        path: socket.to_path_buf(),
        reason,
    };
    match Reply::from(forward_until(
        &place,
        &ServiceQuery::Served,
        Instant::now() + within,
    )?) {
        Reply::Document(document) => {
            serde_json::from_value(document).map_err(|e| unreadable(format!("unreadable counts: {e}")))
        }
        // One of a version that counts nothing says it cannot read the question.
        Reply::Failed(e, _) => Err(unreadable(e.msg)),
        Reply::Done | Reply::About(_) => Err(unreadable("no counts in its answer".into())),
    }
}

fn forward_until(
    place: &ServicePlace,
    request: &impl serde::Serialize,
    deadline: Instant,
) -> Result<Response, CallError> {
    let path = place.socket.clone();
    let mut stream = socket::connect(&place.socket).map_err(|refusal| match refusal {
        Refusal::Absent(e) => CallError::Unreachable {
            path: path.clone(),
            reason: e.to_string(),
        },
        Refusal::Untrusted(reason) => CallError::Untrusted {
            path: path.clone(),
            reason,
        },
    })?;
    if place.binary.is_some() && socket::peer_binary(&stream) != place.binary {
        return Err(CallError::OtherBinary { path });
    }
    let broken = |reason: String| CallError::Broken {
        path: path.clone(),
        reason,
    };
    let body = serde_json::to_vec(request).map_err(|e| broken(e.to_string()))?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(left))
        .and_then(|()| stream.set_write_timeout(Some(left)))
        .and_then(|()| stream.write_all(&body))
        .and_then(|()| stream.shutdown(std::net::Shutdown::Write))
        .map_err(|e| broken(e.to_string()))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .map_err(|e| broken(e.to_string()))?;
    serde_json::from_slice(&answer).map_err(|e| broken(format!("unreadable answer: {e}")))
}

/// Sends `request` to a service place, starting a service there first when
/// none listens and the place says how.
fn ask_place(place: &ServicePlace, request: &Request, deadline: Instant) -> Result<Response, CallError> {
    let passed_on;
    let sent = if place.forwarded {
        passed_on = Request {
            forwarded: true,
            ..request.clone()
        };
        &passed_on
    } else {
        request
    };
    let outcome = forward_until(place, sent, deadline);
    match (&outcome, &place.start) {
        (Err(CallError::Unreachable { .. }), Some(exe)) => {
            match crate::start::start_detached(exe, &place.socket, deadline) {
                Ok(()) => forward_until(place, sent, deadline),
                Err(e) => {
                    log::warn!("cannot start a lease service on {}: {e}", place.socket.display());
                    outcome
                }
            }
        }
        _ => outcome,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Place {
    Service(ServicePlace),
    /// The caller itself.
    Here,
}

/// The places a request is tried at, in order (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    places: Vec<Place>,
    /// No `socket` was configured: the data directory's own service may
    /// be started.
    unset: bool,
}

/// The data directory's own service.
fn in_charge_of(data_dir: &Path) -> Place {
    Place::Service(ServicePlace::new(data_dir_socket(data_dir), true))
}

impl Route {
    /// For a plugin process or `cnictl`: the service `socket` names, then
    /// the data directory's own, then here.
    pub fn new(socket: &SocketSetting, data_dir: &Path) -> Self {
        if !data_dir.is_absolute() {
            return Route::here_only();
        }
        let configured = socket
            .path()
            .map(|socket| Place::Service(ServicePlace::new(socket, false)));
        let mut places: Vec<Place> = configured.into_iter().chain([in_charge_of(data_dir)]).collect();
        places.dedup_by(
            |b, a| matches!((a, b), (Place::Service(x), Place::Service(y)) if x.socket == y.socket),
        );
        places.push(Place::Here);
        Route {
            places,
            unset: *socket == SocketSetting::Unset,
        }
    }

    fn services(&mut self) -> impl Iterator<Item = &mut ServicePlace> {
        self.places.iter_mut().filter_map(|p| match p {
            Place::Service(service) => Some(service),
            Place::Here => None,
        })
    }

    /// With nothing configured, a data directory without a service gets
    /// one, started from `exe` (host-local itself): the setup of a node
    /// that has only the binaries and a configuration.
    pub fn start_with(mut self, exe: PathBuf) -> Self {
        if self.unset
            && let Some(own) = self.services().filter(|s| s.forwarded).last()
        {
            own.start = Some(exe);
        }
        self
    }

    /// Only services run from `binary` are asked: for the bridge, which
    /// would otherwise execute that host-local.
    pub fn run_by(mut self, binary: FileId) -> Self {
        for service in self.services() {
            service.binary = Some(binary);
        }
        self
    }

    /// For a plugin process, from its raw configuration. Unreadable stdin
    /// goes nowhere but here, which answers with the parse error.
    pub fn of_config(stdin: &[u8]) -> Self {
        match LeaseSettings::read(stdin) {
            Some(settings) => Route::new(&settings.socket, &settings.data_dir),
            None => Route::here_only(),
        }
    }

    pub fn here_only() -> Self {
        Route {
            places: vec![Place::Here],
            unset: false,
        }
    }

    /// For a lease service answering `request`: itself first (it may be in
    /// charge), then the data directory's own service unless the request
    /// was already passed on.
    pub(crate) fn at_service(request: &Request) -> Self {
        let mut places = vec![Place::Here];
        if !request.forwarded {
            places.extend(
                request
                    .call
                    .data_dir()
                    .filter(|d| d.is_absolute())
                    .as_deref()
                    .map(in_charge_of),
            );
        }
        Route { places, unset: false }
    }
}

/// Answers `call` along `route`; `here` runs it in this process: the one
/// way any part of the suite asks for leases.
pub fn ask(route: &Route, call: &Call, here: &dyn Fn(&Call) -> Reply) -> Reply {
    serve(route, &Request::new(call.clone()), here)
}

/// Answers `request` along `route` (see [`ask`]).
pub(crate) fn serve(route: &Route, request: &Request, here: &dyn Fn(&Call) -> Reply) -> Reply {
    let deadline = Instant::now() + PATIENCE;
    let mut pause = Duration::from_millis(2);
    loop {
        let mut busy = None;
        for place in &route.places {
            let response = match place {
                Place::Here => here(&request.call),
                Place::Service(_) if Instant::now() >= deadline => continue,
                Place::Service(service) => match ask_place(service, request, deadline) {
                    Ok(response) => Reply::from(response),
                    Err(e @ (CallError::Unreachable { .. } | CallError::OtherBinary { .. })) => {
                        log::debug!("{e}");
                        continue;
                    }
                    Err(e) => {
                        log::warn!("{e}; trying elsewhere");
                        continue;
                    }
                },
            };
            if !is_busy(&response) {
                return response;
            }
            busy = Some(response);
        }
        let now = Instant::now();
        match busy {
            Some(busy) if now + pause >= deadline => return busy,
            Some(Reply::Failed(busy, _)) => log::debug!("{}; asking again in {pause:?}", busy.msg),
            Some(_) | None => {}
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sockets(route: &Route) -> Vec<String> {
        route
            .places
            .iter()
            .map(|p| match p {
                Place::Service(service) => format!(
                    "{}{}{}{}",
                    service.socket.display(),
                    if service.forwarded { "*" } else { "" },
                    if service.start.is_some() { "+" } else { "" },
                    if service.binary.is_some() { "!" } else { "" }
                ),
                Place::Here => "here".into(),
            })
            .collect()
    }

    #[test]
    fn processes_ask_the_named_service_then_the_data_dirs_then_themselves() {
        let unset = Route::new(&SocketSetting::Unset, Path::new("/d"));
        assert_eq!(sockets(&unset), ["/d/.sled/.service.sock*", "here"]);
        let off = Route::new(&SocketSetting::Off, Path::new("/d"));
        assert_eq!(sockets(&off), ["/d/.sled/.service.sock*", "here"]);
        let same = Route::new(
            &SocketSetting::Named("/d/.sled/.service.sock".into()),
            Path::new("/d"),
        );
        assert_eq!(sockets(&same), ["/d/.sled/.service.sock", "here"]);
        let relative = Route::new(&SocketSetting::Off, Path::new("d"));
        assert_eq!(sockets(&relative), ["here"]);
        // Only with nothing configured is the data directory's service
        // started.
        let exe = PathBuf::from("/opt/cni/bin/host-local");
        assert_eq!(
            sockets(&unset.start_with(exe.clone())),
            ["/d/.sled/.service.sock*+", "here"]
        );
        assert_eq!(
            sockets(&off.start_with(exe.clone())),
            ["/d/.sled/.service.sock*", "here"]
        );
        let named = Route::new(&SocketSetting::Named("/s".into()), Path::new("/d"));
        assert_eq!(
            sockets(&named.start_with(exe)),
            ["/s", "/d/.sled/.service.sock*", "here"]
        );
        assert_eq!(sockets(&Route::of_config(b"junk")), ["here"]);
    }

    #[test]
    fn a_service_tries_itself_first_and_passes_a_request_on_once() {
        let request = Request::new(Call::admin("/d".into(), "n".into(), crate::wire::AdminOp::List));
        assert_eq!(
            sockets(&Route::at_service(&request)),
            ["here", "/d/.sled/.service.sock*"]
        );
        let passed_on = Request {
            forwarded: true,
            ..request
        };
        assert_eq!(sockets(&Route::at_service(&passed_on)), ["here"]);
    }

    /// A service that takes a request and never answers (stopped, hung)
    /// costs the request what is left of its deadline, not more.
    #[test]
    fn a_silent_service_is_given_up_at_the_deadline() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("silent.sock");
        let (listener, _) = crate::socket::bind_replacing(&socket).expect("bind");
        let request = Request::new(Call::admin("/d".into(), "n".into(), crate::wire::AdminOp::List));
        let started = Instant::now();
        let place = ServicePlace::new(socket.clone(), false);
        let err =
            forward_until(&place, &request, started + Duration::from_millis(300)).expect_err("no answer");
        assert!(matches!(err, CallError::Broken { .. }), "{err}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(5),
            "{took:?}"
        );
        drop(listener);
    }

    #[test]
    fn busy_answers_are_asked_again_until_one_is_final() {
        let calls = std::cell::Cell::new(0);
        let request = Request::new(Call::admin("/d".into(), "n".into(), crate::wire::AdminOp::List));
        let answer = serve(&Route::here_only(), &request, &|_| {
            calls.set(calls.get() + 1);
            if calls.get() < 4 {
                Reply::Failed(cni::Error::try_again_later("held"), cni::Version::LATEST)
            } else {
                Reply::Document(serde_json::json!([]))
            }
        });
        assert_eq!(calls.get(), 4);
        assert_eq!(answer, Reply::Document(serde_json::json!([])));
    }
}
