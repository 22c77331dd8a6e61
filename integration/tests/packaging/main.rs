//! The packaging tier: what ships besides the code: statically linked
//! binaries, the example configurations (each executed unchanged), and the
//! cluster manifests (checked against the API's types, the agent and the
//! image). One module per former test file.

mod conf_examples;
mod manifest;
mod static_binaries;
