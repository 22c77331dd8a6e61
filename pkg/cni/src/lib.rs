//! The CNI protocol as every plugin and runtime of the suite speaks it.
//!
//! - [`env`]: the `CNI_*` variables per verb; [`args`]: `CNI_ARGS`.
//! - [`conf`]: the configuration on stdin and the runtime conventions.
//! - [`version`] and [`result`]: versions and the one result model printed in
//!   each version's shape.
//! - [`error`]: the spec's error document and codes.
//! - [`skel`]: the plugin skeleton; [`exec`]: running other plugins.
//! - [`log`]: logging to stderr or a configured file, never stdout, and to
//!   the node agent's socket when the configuration names one (through
//!   the sending end the plugin gives it; the wire is `agent-wire`'s).
//! - [`small_file`]: reading a small file where others may put anything.

#![forbid(unsafe_code)]

pub mod args;
pub mod conf;
pub mod env;
pub mod error;
pub mod exec;
pub mod fault;
pub mod keys;
pub mod log;
pub mod result;
pub mod skel;
pub mod small_file;
pub mod version;

pub use args::CniArgs;
pub use conf::NetConf;
pub use env::{Command, Environment};
pub use error::{Code, Error, Result};
pub use result::CniResult;
pub use skel::{Attachment, Plugin, Request};
pub use version::Version;
