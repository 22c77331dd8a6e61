//! One deadline for a whole request: what is left of it, and whether an
//! I/O error is a socket timeout set from it.

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// What is left before `deadline`, or [`Error::Timeout`].
pub(crate) fn left(deadline: Instant) -> Result<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or(Error::Timeout)
}

pub(crate) fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock)
}
