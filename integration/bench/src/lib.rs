//! `make bench`: the suite against Debian's reference plugins
//! (/usr/lib/cni) in one run, the same configuration shape, alternating
//! call by call so machine noise hits both. Each suite gets its own node
//! namespace (bridge, masquerade, IPAM data) and pod namespaces; plugins are
//! executed directly as libcni executes them.
//!
//! It fails on any failed call, duplicate address or leak in either suite,
//! never on a timing. `sandbox` and `scale` are `cluster-bench`'s (`make
//! bench-cluster`), on the real cluster.
//!
//! SIGTERM and SIGINT stop a run at the next step that looks
//! ([`stopping`]: between phases, and in the gate phase between its
//! steps), so what it made is removed as at its end; it then fails.
//!
//! The crate holds both programs' phases, one module a job (the map is in
//! `integration/bench/README.md`): `cni-bench`'s run (`rounds`) over its
//! suites ([`suite`]) and phases, and `cluster-bench`'s ([`scale`],
//! [`policy_scale`], [`sandbox`]) over what they share ([`bench_cluster`],
//! [`connect`]).

// `cni-bench`: what a run is asked, how it stops, the suites it runs.
pub mod options;
pub mod outcome;
pub mod setup;
pub mod stop;
pub mod suite;

// `cni-bench`'s phases, and the run that calls them in turn.
mod add_del;
pub mod ambient;
mod chained;
mod cri;
mod floors;
pub mod gate;
pub mod log_socket;
mod mesh;
pub mod policy_path;
mod profile;
mod rounds;

// `cluster-bench`'s phases and what they share.
pub mod bench_cluster;
pub mod connect;
pub mod policy_scale;
pub mod sandbox;
pub mod scale;

// Both programs': timing a call, the kernel's queue, the reports.
pub mod measure;
pub mod nfqueue;
pub mod report;

pub use options::{Options, PHASES};
pub use outcome::{Outcome, Pooled, QUANTILES};
pub use rounds::run;
pub use setup::{SERVICE_PREFIX, STARTED_PREFIX, Setup, Side};
pub use stop::{stop_on_signals, stopping};
pub use suite::Suite;
