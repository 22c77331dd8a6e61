//! Structured logs: one JSON object per line on stderr (`time`, `level`,
//! `msg`, `target`), which the container runtime collects; the plugins'
//! records the agent receives (`controllers::plugin_logs`) are lines of
//! the same kind, with their labels as fields of their own.

use std::io::Write;

use agent_wire::log::Record;
use serde_json::{Value, json};

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
        write_line(&json!({
            "time": cni::log::utc_timestamp(std::time::SystemTime::now()),
            "level": record.level().as_str().to_ascii_lowercase(),
            "msg": record.args().to_string(),
            "target": record.target(),
        }));
    }

    fn flush(&self) {}
}

pub fn init() {
    if log::set_logger(&JsonLines).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}

/// One line, written whole: the lock keeps other threads' lines out of it.
fn write_line(line: &Value) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// A plugin's record as one of the agent's lines: at the plugin's level
/// (its configuration chose what it sends), with the time it was logged,
/// `target` `plugin`, and its labels both in the message and as fields, so
/// that `kubectl logs` reads as the plugin's log and a filter can pick a
/// pod's lines.
pub fn plugin_record(record: &Record) {
    let mut line = json!({
        "time": record.time,
        "level": record.level,
        "msg": plugin_message(record),
        "target": "plugin",
        "plugin": record.plugin,
        "pid": record.pid,
    });
    let labels = [
        ("verb", record.verb.clone()),
        ("pod", pod_of(record).unwrap_or_default()),
        ("containerID", record.container_id.clone()),
    ];
    for (key, value) in labels {
        if !value.is_empty() {
            line[key] = json!(value);
        }
    }
    write_line(&line);
}

/// `plugin bridge ADD default/web-1 (container 1a2b3c4d5e6f): ok,
/// 10.244.1.5/24`: what a reader of the agent's log needs to tell one
/// pod's ADD from another's; what the record lacks is left out.
pub fn plugin_message(record: &Record) -> String {
    let mut text = format!("plugin {}", record.plugin);
    if !record.verb.is_empty() {
        text = format!("{text} {}", record.verb);
    }
    if let Some(pod) = pod_of(record) {
        text = format!("{text} {pod}");
    }
    if !record.container_id.is_empty() {
        // As runtimes print container IDs: the first 12 characters.
        let short: String = record.container_id.chars().take(12).collect();
        text = format!("{text} (container {short})");
    }
    format!("{text}: {}", record.msg)
}

/// `namespace/name`, when the record names the pod.
fn pod_of(record: &Record) -> Option<String> {
    (!record.pod_namespace.is_empty() || !record.pod_name.is_empty())
        .then(|| format!("{}/{}", record.pod_namespace, record.pod_name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(verb: &str, namespace: &str, name: &str, container: &str) -> Record {
        Record {
            time: "2026-11-22T04:01:43.123Z".into(),
            level: "info".into(),
            plugin: "istio-redirect".into(),
            pid: 7,
            verb: verb.into(),
            container_id: container.into(),
            pod_namespace: namespace.into(),
            pod_name: name.into(),
            msg: "ok, 10.244.1.5/24".into(),
        }
    }

    #[test]
    fn a_plugins_record_names_the_pod_and_its_container() {
        assert_eq!(
            plugin_message(&record(
                "ADD",
                "default",
                "web-1",
                "1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d"
            )),
            "plugin istio-redirect ADD default/web-1 (container 1a2b3c4d5e6f): ok, 10.244.1.5/24"
        );
        assert_eq!(
            plugin_message(&record("DEL", "", "", "cnitool-0123")),
            "plugin istio-redirect DEL (container cnitool-0123): ok, 10.244.1.5/24"
        );
        assert_eq!(
            plugin_message(&record("", "", "", "")),
            "plugin istio-redirect: ok, 10.244.1.5/24"
        );
    }
}
