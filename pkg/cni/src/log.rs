//! Plugin logging: never stdout. Records go to stderr (which libcni passes on
//! to the runtime's log) or, when the configuration names one, to `logFile`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use log::{LevelFilter, Log, Metadata, Record};

use crate::error::{Error, Result};

struct Logger {
    state: Mutex<State>,
}

struct State {
    plugin: &'static str,
    file: Option<File>,
}

static LOGGER: Logger = Logger {
    state: Mutex::new(State {
        plugin: "cni",
        file: None,
    }),
};

/// Installs the logger at `warn` on stderr. Safe to call more than once.
pub fn init(plugin: &'static str) {
    if let Ok(mut state) = LOGGER.state.lock() {
        state.plugin = plugin;
    }
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(LevelFilter::Warn);
    }
}

/// Applies the configuration's `logLevel` and `logFile`. An unknown level is
/// a configuration error; a log file that cannot be opened is reported on
/// stderr and logging stays there, since logs must never fail an ADD.
pub fn configure(file: Option<&Path>, level: Option<&str>) -> Result<()> {
    if let Some(level) = level {
        log::set_max_level(parse_level(level)?);
    }
    if let Some(path) = file {
        match OpenOptions::new().create(true).append(true).open(path) {
            Ok(f) => {
                if let Ok(mut state) = LOGGER.state.lock() {
                    state.file = Some(f);
                }
            }
            Err(e) => log::warn!("cannot open logFile {}: {e}; logging to stderr", path.display()),
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

impl Log for Logger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let line = format!(
            "{} {:<5} {}[{}]: {}\n",
            utc_timestamp(SystemTime::now()),
            record.level(),
            state.plugin,
            std::process::id(),
            record.args()
        );
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
