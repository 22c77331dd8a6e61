//! The NetworkPolicy tier: policies compiled by the `netpol` crate and
//! held in a node namespace's nftables, judged by real connections
//! between pods the built bridge plugin wired.

mod blocks;
mod hairpin;
mod kernel;
mod scale;
mod sctp;
