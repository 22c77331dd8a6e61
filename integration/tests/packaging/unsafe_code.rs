//! Every crate the suite ships forbids `unsafe` at its root, or denies it
//! there and says why in a crate doc line starting "`unsafe`:" (the blocks
//! that need it are then allowed one by one, which the compiler checks).

use std::path::{Path, PathBuf};

/// The workspace's members, from its Cargo.toml.
fn members(root: &Path) -> Vec<String> {
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
fn roots(dir: &Path) -> Vec<PathBuf> {
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

/// What is wrong with a crate root, if anything.
fn judge(text: &str) -> Option<&'static str> {
    if text.contains("#![forbid(unsafe_code)]") {
        return None;
    }
    if !text.contains("#![deny(unsafe_code)]") {
        return Some("neither forbids nor denies unsafe code");
    }
    let says_why = text.lines().any(|line| line.starts_with("//! `unsafe`:"));
    (!says_why).then_some("denies unsafe code without a crate doc line saying why it needs some")
}

#[test]
fn every_shipping_crate_root_forbids_unsafe_or_says_why_not() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf();
    let shipping: Vec<String> = members(&root)
        .into_iter()
        .filter(|member| !member.starts_with("integration"))
        .collect();
    assert!(shipping.len() > 10, "members read: {shipping:?}");
    let mut wrong = Vec::new();
    let mut judged = 0;
    for member in &shipping {
        let crate_roots = roots(&root.join(member));
        assert!(!crate_roots.is_empty(), "{member} has no crate root");
        for file in crate_roots {
            let text = std::fs::read_to_string(&file).expect("crate root");
            judged += 1;
            if let Some(why) = judge(&text) {
                wrong.push(format!("{}: {why}", file.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(judged >= shipping.len());
}

#[test]
fn the_judgement_tells_each_case_apart() {
    assert_eq!(judge("#![forbid(unsafe_code)]\nfn main() {}"), None);
    assert_eq!(
        judge("//! `unsafe`: one block, for a reason.\n#![deny(unsafe_code)]"),
        None
    );
    assert!(judge("#![deny(unsafe_code)]").is_some());
    assert!(judge("fn main() {}").is_some());
}
