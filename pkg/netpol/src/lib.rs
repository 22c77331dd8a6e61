//! Kubernetes NetworkPolicy enforced in the kernel: the policy semantics
//! computed for one node's pods ([`compile`]), held in one nftables table
//! of sets, verdict maps and chains ([`nft`]), changed by one netlink
//! transaction per change against what the kernel holds ([`apply`]), and
//! the connections a narrowed verdict no longer allows cut
//! ([`conntrack`]). No packet leaves the kernel for a verdict, and the
//! table outlives the agent.

#![forbid(unsafe_code)]

pub mod compile;
pub mod conntrack;
mod error;
pub mod model;
pub mod nft;
pub mod ranges;

use firewall::nfnl::Deleted;
use firewall::ruleset::{self, Op, TableFamily};

pub use compile::{Compiled, Direction, Snapshot, compile};
pub use error::{Error, Result};
pub use nft::{Current, TABLE};

/// What the table in the calling thread's network namespace holds now
/// (an absent table holds nothing).
pub fn current() -> Result<Current> {
    Ok(ruleset::read(TableFamily::Inet, TABLE)?
        .map(|table| Current::of(&table))
        .unwrap_or_default())
}

/// Makes the table hold `compiled`, in one transaction against what it
/// holds now. Returns what the table held before and the ops it ran (none:
/// nothing differed). When the kernel refuses that transaction (someone
/// made the table into what no plan changes back: a base chain hooked
/// otherwise, a set of ours of another type, a map of theirs jumping to
/// a chain of ours), the table is made again, in one transaction with its
/// removal, so no packet meets it half made.
pub fn apply(compiled: &Compiled) -> Result<(Current, Vec<Op>)> {
    let current = current()?;
    let ops = nft::plan(&current, compiled);
    match ruleset::commit(TableFamily::Inet, TABLE, &ops) {
        Ok(()) => Ok((current, ops)),
        Err(firewall::Error::Refused { .. }) if current.exists => {
            let ops: Vec<Op> = std::iter::once(Op::DeleteTable)
                .chain(nft::plan(&Current::default(), compiled))
                .collect();
            ruleset::commit(TableFamily::Inet, TABLE, &ops)?;
            Ok((current, ops))
        }
        Err(e) => Err(e.into()),
    }
}

/// Makes the table hold `compiled` where an [`apply`] of `previous` left
/// it, planned against that without reading the table: at thousands of
/// elements reading costs more than the change. A transaction the kernel
/// refuses (the table is not what `previous` left) is planned again
/// against a reading; a change someone made that the transaction does not
/// meet stays until the next [`apply`].
pub fn apply_after(previous: &Compiled, compiled: &Compiled) -> Result<(Current, Vec<Op>)> {
    let assumed = Current::held_after(previous);
    let ops = nft::plan(&assumed, compiled);
    match ruleset::commit(TableFamily::Inet, TABLE, &ops) {
        Ok(()) => Ok((assumed, ops)),
        Err(_) => apply(compiled),
    }
}

/// Removes the table and with it every verdict.
pub fn remove() -> Result<()> {
    match firewall::nfnl::delete_table(TableFamily::Inet, TABLE)? {
        Deleted::Removed | Deleted::Absent | Deleted::InUse => Ok(()),
    }
}
