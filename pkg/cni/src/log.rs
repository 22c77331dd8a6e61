//! Plugin logging: never stdout. Records go to stderr (which libcni passes on
//! to the runtime's log) or, when the configuration names one, to `logFile`.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use log::{LevelFilter, Log, Metadata, Record};

use crate::error::{Error, Result};

struct Logger {
    state: Mutex<State>,
}

struct State {
    plugin: &'static str,
    /// The process's own level (records of other threads in a service).
    level: LevelFilter,
    file: Option<File>,
}

static LOGGER: Logger = Logger {
    state: Mutex::new(State {
        plugin: "cni",
        level: LevelFilter::Warn,
        file: None,
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
/// pod's file.
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
    if let Some(level) = level {
        log::set_max_level(level);
    }
    let file = file.and_then(open_log_file);
    if let Ok(mut state) = LOGGER.state.lock() {
        if let Some(level) = level {
            state.level = level;
        }
        if file.is_some() {
            state.file = file;
        }
    }
    Ok(())
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
        let own = self.state.lock().map_or(LevelFilter::Warn, |state| state.level);
        metadata.level() <= level_here(own)
    }

    fn log(&self, record: &Record<'_>) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        if record.level() > level_here(state.level) {
            return;
        }
        let line = format!(
            "{} {:<5} {}[{}]: {}\n",
            utc_timestamp(SystemTime::now()),
            record.level(),
            state.plugin,
            std::process::id(),
            record.args()
        );
        let in_request_file = REQUEST.with(|request| {
            let mut request = request.borrow_mut();
            let file = request.as_mut().and_then(|r| r.file.as_mut());
            file.is_some_and(|f| f.write_all(line.as_bytes()).is_ok())
        });
        if in_request_file {
            return;
        }
        let written = state.file.as_mut().map(|f| f.write_all(line.as_bytes()));
        if !matches!(written, Some(Ok(()))) {
            let _ = std::io::stderr().write_all(line.as_bytes());
        }
    }

    fn flush(&self) {}
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
