//! Which plugins a suite runs (ours, in the drop-in or the service
//! setup, or the reference), and the side of the tables it counts for.

/// Debian's reference plugins, as its package installs them.
pub(crate) const REFERENCE_DIR: &str = "/usr/lib/cni";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    Ours,
    Reference,
}

impl Side {
    pub fn label(self) -> &'static str {
        match self {
            Side::Ours => "ours",
            Side::Reference => "reference",
        }
    }
}

/// Which of our setups a suite runs, or the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    /// Nothing but the binaries and a configuration without a `socket`
    /// key; nothing started by the bench (host-local starts its lease
    /// service itself). What users get; the headline.
    DropIn,
    /// `host-local serve` started beforehand and named by `socket`.
    Service,
    Reference,
}

/// Metric names of the service setup start with this; its reference
/// figures are the drop-in rows' own.
pub const SERVICE_PREFIX: &str = "service: ";
/// A drop-in call that started host-local's lease service is reported
/// apart, under its phase's name after this.
pub const STARTED_PREFIX: &str = "started the lease service: ";

impl Setup {
    pub fn side(self) -> Side {
        match self {
            Setup::DropIn | Setup::Service => Side::Ours,
            Setup::Reference => Side::Reference,
        }
    }

    pub(crate) fn prefix(self) -> &'static str {
        match self {
            Setup::Service => SERVICE_PREFIX,
            Setup::DropIn | Setup::Reference => "",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Setup::DropIn => "ours (drop-in)",
            Setup::Service => "ours (service)",
            Setup::Reference => "reference",
        }
    }
}
