//! The packaging tier: what ships besides the code: statically linked
//! binaries, the example configurations (each executed unchanged), the
//! cluster manifests (checked against the API's types, the agent and the
//! image), every shipping crate root's stance on `unsafe`, and the docs'
//! map of the workspace and its links. A module per topic; what they read of the
//! workspace in `common`.

mod common;
mod conf_examples;
mod doc_links;
mod docs_map;
mod manifest;
mod static_binaries;
mod unsafe_code;
