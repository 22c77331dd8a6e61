//! Structured logs: one JSON object per line on stderr (`time`, `level`,
//! `msg`, `target`), which the container runtime collects.

use std::io::Write;

use serde_json::json;

#[derive(Debug)]
struct JsonLines;

impl log::Log for JsonLines {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let line = json!({
            "time": cni::log::utc_timestamp(std::time::SystemTime::now()),
            "level": record.level().as_str().to_ascii_lowercase(),
            "msg": record.args().to_string(),
            "target": record.target(),
        });
        let _ = writeln!(std::io::stderr().lock(), "{line}");
    }

    fn flush(&self) {}
}

pub fn init() {
    if log::set_logger(&JsonLines).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}
