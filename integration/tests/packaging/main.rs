//! The packaging tier: what ships besides the code: statically linked
//! binaries, the example configurations (each executed unchanged), the
//! cluster manifests (checked against the API's types, the agent and the
//! image), and every shipping crate root's stance on `unsafe`. One module
//! per former test file.

mod conf_examples;
mod manifest;
mod static_binaries;
mod unsafe_code;
