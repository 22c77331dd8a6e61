//! What the packaging tier's modules read of the workspace.

use std::path::{Path, PathBuf};

/// The workspace's root folder.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// The workspace's members, from its Cargo.toml.
pub fn members(root: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("workspace Cargo.toml");
    let list = manifest
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .expect("a members list");
    list.split(',')
        .map(|entry| entry.trim().trim_matches('"').to_owned())
        .filter(|entry| !entry.is_empty())
        .collect()
}

/// A crate's roots: its library, its default binary and every `[[bin]]`.
pub fn roots(dir: &Path) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["src/lib.rs", "src/main.rs"]
        .iter()
        .map(|file| dir.join(file))
        .filter(|path| path.exists())
        .collect();
    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).expect("crate Cargo.toml");
    for line in manifest.lines() {
        if let Some(path) = line
            .trim()
            .strip_prefix("path = \"")
            .and_then(|p| p.strip_suffix('"'))
        {
            let path = dir.join(path);
            if path.extension().is_some_and(|e| e == "rs") && !roots.contains(&path) {
                roots.push(path);
            }
        }
    }
    roots
}

/// The members that ship: all but the tests' harness, bench and tiers.
pub fn shipping_members(root: &Path) -> Vec<String> {
    members(root)
        .into_iter()
        .filter(|member| !member.starts_with("integration"))
        .collect()
}
