//! Kubernetes NetworkPolicy enforced in the kernel: the policy semantics
//! computed for one node's pods ([`compile`]), held in one nftables table
//! of sets, verdict maps and chains ([`nft`]), changed by one transaction
//! per change against what the kernel holds ([`apply`]). No packet
//! leaves the kernel for a verdict, and the table outlives the agent.

#![forbid(unsafe_code)]

pub mod compile;
pub mod model;
pub mod nft;
pub mod ranges;

pub use compile::{Compiled, Direction, Snapshot, compile};
pub use nft::{Current, TABLE};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Nft(#[from] firewall::Error),
    /// `nft -j list` printed something this crate cannot read.
    #[error("nft listing: {0}")]
    Listing(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What the table in the calling thread's network namespace holds now
/// (an absent table holds nothing).
pub fn current() -> Result<Current> {
    match firewall::exec::run("nft", &["-j", "list", "table", "inet", TABLE], "") {
        Ok(listing) => Current::parse(&listing),
        Err(e) if is_absent(&e) => Ok(Current::default()),
        Err(e) => Err(e.into()),
    }
}

/// Makes the table hold `compiled`, in one `nft` transaction against what
/// it holds now. Returns the script it ran (empty: nothing differed).
pub fn apply(compiled: &Compiled) -> Result<String> {
    let script = nft::plan(&current()?, compiled);
    if !script.is_empty() {
        firewall::exec::run("nft", &["-f", "-"], &script)?;
    }
    Ok(script)
}

/// Makes the table hold `compiled` where an [`apply`] of `previous` left
/// it, planned against that without listing the table: at thousands of
/// elements the listing costs more than the change. A transaction the
/// kernel refuses (the table is not what `previous` left) is planned
/// again against a listing; a change someone made that the transaction
/// does not meet stays until the next [`apply`].
pub fn apply_after(previous: &Compiled, compiled: &Compiled) -> Result<String> {
    let script = nft::plan(&Current::held_after(previous), compiled);
    if script.is_empty() {
        return Ok(script);
    }
    match firewall::exec::run("nft", &["-f", "-"], &script) {
        Ok(_) => Ok(script),
        Err(_) => apply(compiled),
    }
}

/// Removes the table and with it every verdict.
pub fn remove() -> Result<()> {
    match firewall::exec::run("nft", &["delete", "table", "inet", TABLE], "") {
        Ok(_) => Ok(()),
        Err(e) if is_absent(&e) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn is_absent(error: &firewall::Error) -> bool {
    matches!(error, firewall::Error::Failed { stderr, .. } if stderr.contains("No such file or directory"))
}
