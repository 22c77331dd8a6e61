//! What cnictl prints: a short summary by default, raw JSON with `--json`.
//! Results and JSON errors go to stdout, everything else to stderr.

use std::io::Write;

use cni::{CniResult, Code};
use serde_json::{Value, json};

use crate::runner::{Failure, IpamKind, Report};

fn out(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush());
}

pub fn print_report(report: &Report, as_json: bool) {
    if as_json {
        let doc = match report {
            Report::Added { result, .. } => result.clone(),
            Report::Ipam { doc, .. } => doc.clone(),
            Report::Checked {
                network,
                attachment,
                skipped,
            } => {
                json!({"network": network, "attachment": attachment, "checked": !skipped})
            }
            Report::Deleted { network, attachment } => {
                json!({"network": network, "attachment": attachment, "deleted": true})
            }
            Report::Status {
                network,
                cni_version,
                asked,
            } => {
                json!({"network": network, "cniVersion": cni_version, "ready": true, "asked": asked})
            }
            Report::Collected {
                network,
                valid,
                deleted,
            } => {
                json!({"network": network, "valid": valid, "deleted": deleted})
            }
        };
        out(&format!("{}\n", cni::skel::to_pretty_json(&doc)));
        return;
    }
    out(&summary(report));
}

fn summary(report: &Report) -> String {
    match report {
        Report::Ipam { command, doc } => ipam_summary(*command, doc),
        Report::Added {
            network,
            attachment,
            netns,
            result,
        } => {
            let mut text = format!(
                "added {}/{} to network {network} in {netns}\n",
                attachment.container_id, attachment.ifname
            );
            match CniResult::from_value(result) {
                Ok(parsed) => text.push_str(&describe(&parsed)),
                Err(_) => text.push_str(&format!("{result}\n")),
            }
            text
        }
        Report::Checked {
            network,
            attachment,
            skipped: false,
        } => {
            format!(
                "{}/{} on network {network}: ok\n",
                attachment.container_id, attachment.ifname
            )
        }
        Report::Checked {
            network,
            skipped: true,
            ..
        } => {
            format!("network {network} disables CHECK; nothing checked\n")
        }
        Report::Deleted { network, attachment } => {
            format!(
                "deleted {}/{} from network {network}\n",
                attachment.container_id, attachment.ifname
            )
        }
        Report::Status {
            network, asked: true, ..
        } => format!("network {network}: ready\n"),
        Report::Status {
            network,
            cni_version,
            asked: false,
        } => format!("network {network}: cniVersion {cni_version:?} has no STATUS; plugins not asked\n"),
        Report::Collected {
            network,
            valid,
            deleted,
        } => {
            let mut text = String::new();
            for a in deleted {
                text.push_str(&format!(
                    "deleted stale attachment {}/{}\n",
                    a.container_id, a.ifname
                ));
            }
            text.push_str(&format!(
                "network {network}: garbage collected, {} valid attachment(s) kept, {} deleted\n",
                valid.len(),
                deleted.len()
            ));
            text
        }
    }
}

fn lease_line(lease: &Value) -> String {
    let field = |k: &str| lease[k].as_str().unwrap_or_default().to_owned();
    let ifname = if field("ifname").is_empty() {
        "-".to_owned()
    } else {
        field("ifname")
    };
    format!(
        "{:<39} {:<64} {:<15} {} {}\n",
        field("ip"),
        field("containerID"),
        ifname,
        field("allocated"),
        field("source")
    )
}

fn ipam_summary(command: IpamKind, doc: &Value) -> String {
    let listed = |key: &str| doc[key].as_array().cloned().unwrap_or_default();
    match command {
        IpamKind::List => {
            let leases = doc.as_array().cloned().unwrap_or_default();
            let mut text = format!(
                "{:<39} {:<64} {:<15} {} {}\n",
                "IP", "CONTAINER ID", "IFNAME", "ALLOCATED", "SOURCE"
            );
            text.extend(leases.iter().map(lease_line));
            text.push_str(&format!("{} lease(s)\n", leases.len()));
            text
        }
        IpamKind::Release | IpamKind::Gc => {
            let released = listed("released");
            let mut text: String = released
                .iter()
                .map(|l| format!("released {}", lease_line(l)))
                .collect();
            text.push_str(&format!("{} lease(s) released\n", released.len()));
            for error in listed("errors") {
                text.push_str(&format!("not released: {}\n", error.as_str().unwrap_or_default()));
            }
            text
        }
        IpamKind::Import => {
            let imported = listed("imported");
            let mut text: String = imported
                .iter()
                .map(|l| format!("imported {}", lease_line(l)))
                .collect();
            text.push_str(&format!("{} lease(s) imported\n", imported.len()));
            for conflict in listed("conflicts") {
                text.push_str(&format!(
                    "kept the database's owner for {}\n",
                    conflict.as_str().unwrap_or_default()
                ));
            }
            text
        }
        // A backup is only useful as JSON.
        IpamKind::Export => format!("{}\n", cni::skel::to_pretty_json(doc)),
    }
}

/// A result in a few lines: interfaces with their addresses, routes, DNS.
fn describe(result: &CniResult) -> String {
    let mut text = String::new();
    for (index, iface) in result.interfaces.iter().enumerate() {
        let place = if iface.sandbox.is_empty() { "host" } else { "pod" };
        text.push_str(&format!("  interface {} ({place})", iface.name));
        if !iface.mac.is_empty() {
            text.push_str(&format!(" mac {}", iface.mac));
        }
        text.push('\n');
        for ip in result.ips.iter().filter(|ip| ip.interface == Some(index)) {
            text.push_str(&format!("    {}{}\n", ip.address, gateway(ip.gateway)));
        }
    }
    for ip in result
        .ips
        .iter()
        .filter(|ip| ip.interface.is_none_or(|i| i >= result.interfaces.len()))
    {
        text.push_str(&format!("  address {}{}\n", ip.address, gateway(ip.gateway)));
    }
    for route in &result.routes {
        text.push_str(&format!("  route {}", route.dst));
        if let Some(gw) = route.gw {
            text.push_str(&format!(" via {gw}"));
        }
        text.push('\n');
    }
    if !result.dns.nameservers.is_empty() {
        text.push_str(&format!("  dns {}\n", result.dns.nameservers.join(" ")));
    }
    text
}

fn gateway(gw: Option<std::net::IpAddr>) -> String {
    gw.map(|g| format!(" gateway {g}")).unwrap_or_default()
}

/// The CNI error behind a failure: a plugin's own, as it printed it, or
/// one built from the runtime-side problem with the closest spec code.
fn as_cni_error(error: &libcni::Error) -> cni::Error {
    if let Some(e) = error.cni_error() {
        return e.clone();
    }
    let code = match error {
        libcni::Error::Config(_) | libcni::Error::NotFound { .. } => Code::InvalidConfig,
        libcni::Error::Cache(_) => Code::Io,
        _ => Code::Internal,
    };
    cni::Error::new(code, error.to_string())
}

pub fn print_failure(failure: &Failure, as_json: bool) {
    let cni_error = as_cni_error(&failure.error);
    let _ = writeln!(std::io::stderr(), "cnictl: {}", failure.error);
    if as_json {
        let version = failure.cni_version.parse().unwrap_or(cni::Version::LATEST);
        let mut doc: Value = cni_error.to_json(version);
        if !failure.cni_version.is_empty() {
            doc["cniVersion"] = Value::String(failure.cni_version.clone());
        }
        out(&format!("{}\n", cni::skel::to_pretty_json(&doc)));
    }
}
