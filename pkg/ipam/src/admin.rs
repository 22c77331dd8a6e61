//! Operator commands on a network's leases (`cnictl ipam ...`), run by the
//! lease service or directly.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lease::AdminOp;
use serde_json::{Value, json};

use crate::store::{Lease, Stores};
use crate::{Error, pool, reference};

/// A lease as listed: `ip`, `containerID`, `ifname`, `allocated` (UTC,
/// RFC 3339) and where it came from.
pub fn lease_view(lease: &Lease) -> Value {
    let allocated = UNIX_EPOCH + Duration::from_secs(lease.allocated);
    json!({
        "ip": lease.ip,
        "containerID": lease.container_id,
        "ifname": lease.ifname,
        "allocated": cni::log::utc_timestamp(allocated),
        "source": if lease.from_reference { "reference" } else { "host-local" },
    })
}

fn views(leases: &[Lease]) -> Vec<Value> {
    leases.iter().map(lease_view).collect()
}

pub fn run(stores: &Stores, data_dir: &Path, network: &str, op: &AdminOp) -> Result<Value, Error> {
    pool::with_network(stores, data_dir, network, |net| match op {
        AdminOp::List => Ok(Value::Array(views(&net.leases()?))),
        AdminOp::ReleaseIp { ip } => {
            let released: Vec<Lease> = pool::release_ip(net, *ip)?.into_iter().collect();
            Ok(json!({ "released": views(&released) }))
        }
        AdminOp::ReleaseContainer { container_id, ifname } => {
            let released = match ifname {
                Some(ifname) => pool::release(net, container_id, ifname, None)?,
                None => pool::release_container(net, container_id)?,
            };
            Ok(json!({ "released": views(&released) }))
        }
        AdminOp::Gc { valid } => {
            let report = pool::gc(net, valid)?;
            Ok(json!({ "released": views(&report.released), "errors": report.errors }))
        }
        AdminOp::Export => {
            let last_reserved: serde_json::Map<String, Value> = net
                .last_reserved_all()?
                .into_iter()
                .map(|(set, ip)| (set.to_string(), json!(ip)))
                .collect();
            Ok(json!({
                "network": network,
                "dataDir": data_dir,
                "exported": cni::log::utc_timestamp(SystemTime::now()),
                "leases": views(&net.leases()?),
                "lastReserved": last_reserved,
            }))
        }
        AdminOp::ImportReference { dir } => {
            let report = reference::import_dir(net, dir, None)?;
            Ok(json!({ "imported": views(&report.imported), "conflicts": report.conflicts }))
        }
    })
}
