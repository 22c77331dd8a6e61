//! The verbs on one network's leases: allocate, release, check, GC, and the
//! free-address test STATUS needs. Every lookup goes through an index (by
//! address, or by attachment); only GC, listing and export read every lease.
//!
//! This layer sits between the store (sled alone) and its callers, and is
//! where the reference plugin's files meet the leases: [`with_network`]
//! imports them before every operation, and every verb that releases
//! removes an imported lease's file, once, through [`release_leases`] or
//! [`gc`].

use std::collections::HashSet;
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use cni::conf::GcAttachment;
use serde::Serialize;

use crate::Error;
use crate::reference::{self, FileRemoval};
use crate::store::{Change, Lease, Network, Stores, now};
use ipam_config::range::{RangeSet, place_requested};

/// Runs `op` on a network under its lock (see [`Stores::with_network`]),
/// once the reference plugin's files are imported if their directory
/// changed: no operation can hand out an address a reference file holds.
pub fn with_network<T>(
    stores: &Stores,
    data_dir: &Path,
    network: &str,
    op: impl FnOnce(&Network) -> Result<T, Error>,
) -> Result<T, Error> {
    stores.with_network(data_dir, network, |net| {
        reference::import_if_changed(net)?;
        op(net)
    })
}

/// An address handed to an attachment, with what the result needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub ip: IpAddr,
    pub prefix: u8,
    pub gateway: IpAddr,
}

fn allocation_in(set: &RangeSet, ip: IpAddr) -> Option<Allocation> {
    let range = set.range_for(ip)?;
    Some(Allocation {
        ip,
        prefix: range.subnet.prefix(),
        gateway: range.gateway,
    })
}

/// The leases of an attachment, counting the reference's ID-only leases of
/// that container as its own (as the reference's `GetByID` does).
fn held_by(net: &Network, container_id: &str, ifname: &str) -> Result<Vec<Lease>, Error> {
    let mut held = net.leases_of(container_id, ifname)?;
    if !ifname.is_empty() {
        held.extend(net.leases_of(container_id, "")?);
    }
    Ok(held)
}

/// Whether a CNI_NETNS recorded with a lease and one given now name the
/// same namespace: the same text, or the same nsfs inode however spelled.
fn same_namespace(recorded: &str, given: &Path) -> bool {
    if Path::new(recorded) == given {
        return true;
    }
    match (std::fs::metadata(recorded), std::fs::metadata(given)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// A lease recorded for a namespace other than `given` that still exists:
/// another live pod holds that address, whatever the request says.
fn held_by_another_pod(lease: &Lease, given: Option<&Path>) -> bool {
    match (&lease.netns, given) {
        (Some(recorded), Some(given)) => {
            !same_namespace(recorded, given) && netns::NetNs::open(recorded).is_ok()
        }
        _ => false,
    }
}

/// One address per range set for (container ID, ifname) in `netns`.
/// Requested addresses go to the set that contains them
/// ([`place_requested`]). An attachment
/// that already holds an address in a set gets it again when it asks from
/// the same namespace (a runtime's repeated ADD is answered), and is
/// refused as the reference refuses any duplicate allocation when it asks
/// from another (two live pods would share the address). Leases recorded
/// without a namespace are answered. All sets are committed together or
/// not at all.
pub fn allocate(
    net: &Network,
    sets: &[RangeSet],
    requested: &[IpAddr],
    container_id: &str,
    ifname: &str,
    netns: Option<&Path>,
) -> Result<Vec<Allocation>, Error> {
    let placed = place_requested(sets, requested)?;
    let held = held_by(net, container_id, ifname)?;
    let mut change = Change::default();
    let mut allocations = Vec::with_capacity(sets.len());
    for ((index, set), wanted) in sets.iter().enumerate().zip(placed) {
        let fail = |msg: String| Error::Unavailable(format!("failed to allocate for range {index}: {msg}"));
        if let Some(lease) = held.iter().find(|l| set.contains(l.ip)) {
            if let Some(ip) = wanted.filter(|ip| *ip != lease.ip) {
                return Err(fail(format!(
                    "{container_id}/{ifname} already holds {} in range set {set}; requested {ip}",
                    lease.ip
                )));
            }
            let same_pod = match (&lease.netns, netns) {
                (Some(recorded), Some(given)) => same_namespace(recorded, given),
                _ => true,
            };
            if !same_pod {
                return Err(fail(format!(
                    "{} has been allocated to {container_id}, duplicate allocation is not allowed",
                    lease.ip
                )));
            }
            allocations.extend(allocation_in(set, lease.ip));
            continue;
        }
        let ip = match wanted {
            Some(ip) => {
                if net.is_taken(ip)? {
                    return Err(fail(format!(
                        "requested IP address {ip} is not available in range set {set}"
                    )));
                }
                ip
            }
            None => first_free(net, set, index)?
                .ok_or_else(|| fail(format!("no IP addresses available in range set: {set}")))?,
        };
        change.add.push(Lease {
            ip,
            container_id: container_id.to_owned(),
            ifname: ifname.to_owned(),
            allocated: now(),
            from_reference: false,
            netns: netns.map(|p| p.to_string_lossy().into_owned()),
        });
        change.last_reserved.push((index, ip));
        allocations.extend(allocation_in(set, ip));
    }
    net.apply(&change)?;
    Ok(allocations)
}

/// The next free address of a set, round-robin from its last reservation.
pub fn first_free(net: &Network, set: &RangeSet, index: usize) -> Result<Option<IpAddr>, Error> {
    for (ip, _) in set.candidates(net.last_reserved(index)?) {
        if !net.is_taken(ip)? {
            return Ok(Some(ip));
        }
    }
    Ok(None)
}

/// Releases what (container ID, ifname) holds, falling back to the
/// container's ID-only leases only when it holds none by name (as the
/// reference's `ReleaseByID` does). Unknown attachments release nothing.
/// A DEL that names `netns` keeps a lease recorded for another namespace
/// that still exists: that pod still uses the address (a runtime cleaning
/// up an ADD refused as a duplicate sends such a DEL).
pub fn release(
    net: &Network,
    container_id: &str,
    ifname: &str,
    netns: Option<&Path>,
) -> Result<Vec<Lease>, Error> {
    let mut leases = net.leases_of(container_id, ifname)?;
    if leases.is_empty() && !ifname.is_empty() {
        leases = net.leases_of(container_id, "")?;
    }
    leases.retain(|lease| {
        let kept = held_by_another_pod(lease, netns);
        if kept {
            log::warn!(
                "kept {} of {container_id}/{ifname}: it was handed to the namespace {}, which still exists, \
                 not to the one this DEL names",
                lease.ip,
                lease.netns.as_deref().unwrap_or_default()
            );
        }
        !kept
    });
    release_leases(net, leases)
}

/// Releases one address, whoever holds it.
pub fn release_ip(net: &Network, ip: IpAddr) -> Result<Option<Lease>, Error> {
    let leases: Vec<Lease> = net.lease(ip)?.into_iter().collect();
    Ok(release_leases(net, leases)?.pop())
}

/// Releases every lease of a container, on any interface.
pub fn release_container(net: &Network, container_id: &str) -> Result<Vec<Lease>, Error> {
    let leases: Vec<Lease> = net
        .leases()?
        .into_iter()
        .filter(|l| l.container_id == container_id)
        .collect();
    release_leases(net, leases)
}

/// Releases `leases` in one transaction, the reference file of each
/// imported one removed first (see [`FileRemoval`]). A file that cannot be
/// removed fails the call and releases nothing.
fn release_leases(net: &Network, leases: Vec<Lease>) -> Result<Vec<Lease>, Error> {
    let mut files = FileRemoval::new(net);
    for lease in &leases {
        files.remove_file_of(lease)?;
    }
    let change = Change {
        reference_mtime: files.finish()?,
        remove: leases,
        ..Change::default()
    };
    net.apply(&change)?;
    Ok(change.remove)
}

/// CHECK: the attachment holds a lease, and when the runtime passes the
/// addresses it was given, they agree with the leases: every held address is
/// among them, and every one of them inside these range sets is held.
pub fn check(
    net: &Network,
    sets: &[RangeSet],
    container_id: &str,
    ifname: &str,
    reported: Option<&[IpAddr]>,
) -> Result<(), Error> {
    let held = held_by(net, container_id, ifname)?;
    if held.is_empty() {
        return Err(Error::Check(format!(
            "host-local: Failed to find address added by container {container_id}"
        )));
    }
    let Some(reported) = reported else { return Ok(()) };
    if let Some(lease) = held.iter().find(|l| !reported.contains(&l.ip)) {
        return Err(Error::Check(format!(
            "host-local: address {} leased to {container_id}/{ifname} is missing from prevResult",
            lease.ip
        )));
    }
    if let Some(ip) = reported
        .iter()
        .filter(|ip| sets.iter().any(|s| s.contains(**ip)))
        .find(|ip| !held.iter().any(|l| l.ip == **ip))
    {
        return Err(Error::Check(format!(
            "host-local: address {ip} in prevResult is not leased to {container_id}/{ifname}"
        )));
    }
    Ok(())
}

/// What a GC pass released, and what it could not.
#[derive(Debug, Default, Serialize)]
pub struct GcReport {
    pub released: Vec<Lease>,
    pub errors: Vec<String>,
}

/// Releases every lease whose attachment is not in `valid` (an ID-only
/// lease stays while its container has any valid attachment). An empty list
/// releases everything. A lease whose reference file cannot be removed is
/// kept and reported; the others are released regardless.
pub fn gc(net: &Network, valid: &[GcAttachment]) -> Result<GcReport, Error> {
    let attachments: HashSet<(&str, &str)> = valid
        .iter()
        .map(|a| (a.container_id.as_str(), a.ifname.as_str()))
        .collect();
    let containers: HashSet<&str> = valid.iter().map(|a| a.container_id.as_str()).collect();
    let mut report = GcReport::default();
    let mut files = FileRemoval::new(net);
    for lease in net.leases()? {
        let kept = attachments.contains(&(lease.container_id.as_str(), lease.ifname.as_str()))
            || (lease.ifname.is_empty() && containers.contains(lease.container_id.as_str()));
        if kept {
            continue;
        }
        if let Err(e) = files.remove_file_of(&lease) {
            report.errors.push(format!("{}: {e}", lease.ip));
            continue;
        }
        report.released.push(lease);
    }
    net.apply(&Change {
        reference_mtime: files.finish()?,
        remove: report.released.clone(),
        ..Change::default()
    })?;
    Ok(report)
}

/// STATUS: the first range set with no free address, if any.
pub fn exhausted_set(net: &Network, sets: &[RangeSet]) -> Result<Option<usize>, Error> {
    for (index, set) in sets.iter().enumerate() {
        if first_free(net, set, index)?.is_none() {
            return Ok(Some(index));
        }
    }
    Ok(None)
}
