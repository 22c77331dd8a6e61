//! Plugin logging: never stdout. Records go to stderr (which libcni passes on
//! to the runtime's log) or, when the configuration names one, to `logFile`;
//! and, when it names the node agent's socket (`logSocket`), also there,
//! through the [`Sink`] the plugin opens for it ([`OpenSink`],
//! [`crate::skel::Plugin::LOG_SOCKET`]; the wire itself is the
//! `agent-wire` crate's, which this crate does not know).
//!
//! The socket has a level of its own: `info` (or the configuration's
//! `logLevel` when that asks for more), so the agent's log shows every
//! verb's outcome ([`outcome`]) while stderr stays at `warn`. stderr or
//! `logFile` keep their level and get the records they always got, and
//! also each record the socket was to carry but did not take (nobody
//! listens, or the listener's queue is full): nothing logged for the
//! agent is lost when the agent is not there.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use log::{Level, LevelFilter, Log, Metadata, Record};

use crate::env::Invocation;
use crate::error::{Error, Result};

/// One record for the agent's socket: its labels and its message.
#[derive(Debug)]
pub struct Entry<'a> {
    /// The plugin's binary name.
    pub plugin: &'a str,
    pub level: Level,
    pub invocation: &'a Invocation,
    /// When the plugin logged it, `2026-11-22T04:01:43.123Z`.
    pub time: String,
    pub msg: String,
}

/// The sending end of the agent's socket: sends one record, encoded as
/// its wire has it, without waiting. Whether the listener took it: what
/// it did not take (nobody listens, its queue is full) goes to stderr or
/// `logFile` instead.
pub trait Sink: Send {
    fn send(&mut self, entry: Entry<'_>) -> bool;
}

/// Opens the sending end to the socket at a path, as the plugin has it
/// (see [`crate::skel::Plugin::LOG_SOCKET`]).
pub type OpenSink = fn(&Path) -> Box<dyn Sink>;

/// The agent's socket a process sends to: its path and its sending end.
struct Socket {
    path: PathBuf,
    sink: Box<dyn Sink>,
}

struct Logger {
    state: Mutex<State>,
}

struct State {
    plugin: &'static str,
    /// The process's own level (records of other threads in a service).
    level: LevelFilter,
    file: Option<File>,
    /// The one invocation a plugin process serves, once its configuration
    /// is read (see [`begin`]): the labels of its socket records and of
    /// its [`outcome`].
    invocation: Option<Invocation>,
    /// The agent's socket, when the configuration names one.
    socket: Option<Socket>,
}

impl State {
    /// The most verbose level any destination takes.
    fn widest(&self) -> LevelFilter {
        match self.socket {
            Some(_) => self.level.max(SOCKET_LEVEL),
            None => self.level,
        }
    }

    /// Whether the socket is to carry a record of `level`.
    fn socket_takes(&self, level: Level) -> bool {
        self.socket.is_some() && level <= self.level.max(SOCKET_LEVEL)
    }

    /// Sends a record to the socket; whether it took it.
    fn send(&mut self, level: Level, msg: String) -> bool {
        let (Some(socket), Some(invocation)) = (self.socket.as_mut(), self.invocation.as_ref()) else {
            return false;
        };
        socket.sink.send(Entry {
            plugin: self.plugin,
            level,
            invocation,
            time: utc_timestamp(SystemTime::now()),
            msg,
        })
    }
}

/// The least the socket takes whatever `logLevel` says: the outcome of
/// every verb.
const SOCKET_LEVEL: LevelFilter = LevelFilter::Info;

static LOGGER: Logger = Logger {
    state: Mutex::new(State {
        plugin: "cni",
        level: LevelFilter::Warn,
        file: None,
        invocation: None,
        socket: None,
    }),
};

/// Set by a process that serves many requests: see [`keep_own_settings`].
static OWN_SETTINGS: AtomicBool = AtomicBool::new(false);

/// One request's `logLevel` and `logFile` in a process serving many.
struct RequestLog {
    level: Option<LevelFilter>,
    file: Option<File>,
}

thread_local! {
    static REQUEST: RefCell<Option<RequestLog>> = const { RefCell::new(None) };
}

/// Installs the logger at `warn` on stderr. Safe to call more than once.
pub fn init(plugin: &'static str) {
    if let Ok(mut state) = LOGGER.state.lock() {
        state.plugin = plugin;
    }
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(LevelFilter::Warn);
    }
}

/// For a long-lived process answering requests from many configurations
/// (host-local's lease service): from now on a request's `logLevel` and
/// `logFile` apply to the records of that request's thread until its
/// [`RequestScope`] ends, not to the process, or one pod's `logLevel:
/// debug` would send every later request, from any network, into that
/// pod's file. Such a process sends nothing to a `logSocket`: its records
/// are not one invocation's, the plugin process that asked it logs the
/// call's outcome, and the agent's own service's stderr is the agent's
/// log already.
pub fn keep_own_settings() {
    OWN_SETTINGS.store(true, Ordering::Relaxed);
}

/// Ends the calling thread's request settings when dropped (a serving
/// thread takes the next request with the process's own).
#[must_use]
#[derive(Debug)]
pub struct RequestScope(());

impl Drop for RequestScope {
    fn drop(&mut self) {
        REQUEST.with(|request| request.borrow_mut().take());
    }
}

/// Opens a request scope on the calling thread (see [`keep_own_settings`]).
pub fn request_scope() -> RequestScope {
    REQUEST.with(|request| request.borrow_mut().take());
    RequestScope(())
}

fn open_log_file(path: &Path) -> Option<File> {
    match OpenOptions::new().create(true).append(true).open(path) {
        Ok(file) => Some(file),
        Err(e) => {
            log::warn!("cannot open logFile {}: {e}; logging to stderr", path.display());
            None
        }
    }
}

/// Applies the configuration's `logLevel` and `logFile`. An unknown level is
/// a configuration error; a log file that cannot be opened is reported on
/// stderr and logging stays there, since logs must never fail an ADD.
pub fn configure(file: Option<&Path>, level: Option<&str>) -> Result<()> {
    let level = level.map(parse_level).transpose()?;
    if let Some(level) = level
        && level > log::max_level()
    {
        // The `log` macros drop what is above this before any logger sees
        // it; records of threads without the request's level are still
        // held to the process's own in `Logger::log`.
        log::set_max_level(level);
    }
    if OWN_SETTINGS.load(Ordering::Relaxed) {
        let file = file.and_then(open_log_file);
        REQUEST.with(|request| *request.borrow_mut() = Some(RequestLog { level, file }));
        return Ok(());
    }
    let file = file.and_then(open_log_file);
    if let Ok(mut state) = LOGGER.state.lock() {
        if let Some(level) = level {
            state.level = level;
        }
        if file.is_some() {
            state.file = file;
        }
        log::set_max_level(state.widest());
    }
    Ok(())
}

/// Starts the process's one invocation, once its environment is checked
/// and its configuration parsed: its labels, and the agent's socket when
/// the configuration names one (its path, and how the plugin opens it).
/// Nothing in a process with its own settings (see [`keep_own_settings`]).
pub fn begin(invocation: Invocation, socket: Option<(&Path, OpenSink)>) {
    if OWN_SETTINGS.load(Ordering::Relaxed) {
        return;
    }
    let Ok(mut state) = LOGGER.state.lock() else {
        return;
    };
    state.invocation = Some(invocation);
    let same = state.socket.as_ref().map(|s| s.path.as_path()) == socket.map(|(path, _)| path);
    if !same {
        state.socket = socket.map(|(path, open)| Socket {
            path: path.to_owned(),
            sink: open(path),
        });
    }
    log::set_max_level(state.widest());
}

/// Logs how the invocation [`begin`] started ended (`ok, <addresses>`,
/// or `failed: <error>`): at `info` for a success, which the agent's
/// socket takes, `error` for a failure. The socket's record has the verb
/// as a label; the line on stderr or in `logFile` starts with it. False,
/// logging nothing, when no invocation began (VERSION, the about text, a
/// call refused before its configuration was read).
pub fn outcome(level: Level, text: &str) -> bool {
    let verb = match LOGGER.state.lock() {
        Ok(state) => state.invocation.as_ref().map(|i| i.verb.clone()),
        Err(_) => None,
    };
    let Some(verb) = verb else {
        return false;
    };
    LOGGER.write(level, text.to_owned(), &format!("{verb} {text}"));
    true
}

fn parse_level(level: &str) -> Result<LevelFilter> {
    match level.to_ascii_lowercase().as_str() {
        "off" | "none" | "panic" => Ok(LevelFilter::Off),
        "error" => Ok(LevelFilter::Error),
        "warn" | "warning" => Ok(LevelFilter::Warn),
        "info" => Ok(LevelFilter::Info),
        "debug" => Ok(LevelFilter::Debug),
        "trace" | "verbose" => Ok(LevelFilter::Trace),
        _ => Err(Error::invalid_config(format!(
            "invalid logLevel {level:?}: expected one of off, error, warn, info, debug, trace"
        ))),
    }
}

/// The level records of the calling thread are held to: its request's, if
/// it serves one that set a level, else the process's own.
fn level_here(own: LevelFilter) -> LevelFilter {
    REQUEST
        .with(|request| request.borrow().as_ref().and_then(|r| r.level))
        .unwrap_or(own)
}

impl Log for Logger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        let Ok(state) = self.state.lock() else {
            return false;
        };
        metadata.level() <= level_here(state.level) || state.socket_takes(metadata.level())
    }

    fn log(&self, record: &Record<'_>) {
        let msg = record.args().to_string();
        self.write(record.level(), msg.clone(), &msg);
    }

    fn flush(&self) {}
}

impl Logger {
    fn write(&self, level: Level, to_socket: String, in_line: &str) {
        if let Ok(mut state) = self.state.lock() {
            state.write(level, to_socket, in_line);
        }
    }
}

impl State {
    /// One record: `to_socket` as the socket's message, `in_line` as the
    /// line's on stderr or in `logFile`, which also gets what the socket
    /// was to carry and did not take.
    fn write(&mut self, level: Level, to_socket: String, in_line: &str) {
        let local = level <= level_here(self.level);
        let for_socket = self.socket_takes(level);
        if !local && !for_socket {
            return;
        }
        let sent = for_socket && self.send(level, to_socket);
        if !local && sent {
            return;
        }
        let line = format!(
            "{} {:<5} {}[{}]: {}\n",
            utc_timestamp(SystemTime::now()),
            level,
            self.plugin,
            std::process::id(),
            in_line
        );
        let in_request_file = REQUEST.with(|request| {
            let mut request = request.borrow_mut();
            let file = request.as_mut().and_then(|r| r.file.as_mut());
            file.is_some_and(|f| f.write_all(line.as_bytes()).is_ok())
        });
        if in_request_file {
            return;
        }
        let written = self.file.as_mut().map(|f| f.write_all(line.as_bytes()));
        if !matches!(written, Some(Ok(()))) {
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }
}

/// `2026-11-22T04:01:43.123Z`, without a date crate.
pub fn utc_timestamp(now: SystemTime) -> String {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's
/// algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn timestamps_are_utc_rfc3339() {
        let t = UNIX_EPOCH + Duration::from_millis(1_795_320_103_123);
        assert_eq!(utc_timestamp(t), "2026-11-22T04:01:43.123Z");
        assert_eq!(utc_timestamp(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(utc_timestamp(leap), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn levels_are_checked() {
        assert_eq!(parse_level("DEBUG").expect("valid"), LevelFilter::Debug);
        assert!(parse_level("chatty").is_err());
    }
}
