//! The docs' links stay true: every relative Markdown link in every
//! tracked `*.md` file names a file or folder that exists, and README
//! stays short enough to read (its long parts live beside what they
//! describe).

use std::path::Path;
use std::process::Command;

use crate::common::workspace;

/// The tracked Markdown files, as git lists them (build output and
/// untracked bench results aside).
fn markdown_files(root: &Path) -> Vec<String> {
    let out = Command::new("git")
        .args(["ls-files", "-z", "--", "*.md"])
        .current_dir(root)
        .output()
        .expect("git ls-files");
    assert!(out.status.success(), "git ls-files failed");
    String::from_utf8(out.stdout)
        .expect("UTF-8 paths")
        .split('\0')
        .filter(|path| !path.is_empty())
        .filter(|path| !path.starts_with("target/") && !path.contains("fuzz/corpus"))
        .map(str::to_owned)
        .collect()
}

/// The targets of a document's inline links `[text](target)` and images,
/// fenced blocks and code spans aside.
fn link_targets(doc: &str) -> Vec<&str> {
    let mut targets = Vec::new();
    let mut fenced = false;
    for line in doc.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Outside code spans: the even pieces between backticks.
        for piece in line.split('`').step_by(2) {
            let mut rest = piece;
            while let Some((_, after)) = rest.split_once("](") {
                let Some((target, tail)) = after.split_once(')') else {
                    break;
                };
                targets.push(target);
                rest = tail;
            }
        }
    }
    targets
}

/// The path a link target names, or `None` for a web address, mail or
/// an anchor in the same document.
fn local_path(target: &str) -> Option<&str> {
    let target = target.split_whitespace().next()?; // a title aside
    let target = target.trim_start_matches('<').trim_end_matches('>');
    if target.starts_with('#') || target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let path = target.split('#').next().unwrap_or(target);
    (!path.is_empty()).then_some(path)
}

#[test]
fn every_relative_link_in_the_docs_names_something_that_exists() {
    let root = workspace();
    let files = markdown_files(&root);
    assert!(files.iter().any(|f| f == "README.md"), "git lists no README.md");
    let mut broken = Vec::new();
    for file in &files {
        let doc = std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let dir = Path::new(file).parent().unwrap_or(Path::new(""));
        for target in link_targets(&doc) {
            let Some(path) = local_path(target) else {
                continue;
            };
            let resolved = match path.strip_prefix('/') {
                Some(from_root) => root.join(from_root),
                None => root.join(dir).join(path),
            };
            if !resolved.exists() {
                broken.push(format!("{file}: ({target})"));
            }
        }
    }
    assert!(broken.is_empty(), "links to nothing:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_stays_under_600_lines() {
    let readme = std::fs::read_to_string(workspace().join("README.md")).expect("README.md");
    let lines = readme.lines().count();
    assert!(
        lines < 600,
        "README.md has {lines} lines; move a part beside what it describes (docs/, a crate's README) and link it"
    );
}

#[test]
fn the_link_reader_finds_what_it_looks_for() {
    let doc = "see [a](x/a.md) and ![b](b.svg \"title\") and [c](https://e.org)\n\
               `[not](code.md)` [d](y.md#part) [e](#here)\n```\n[no](fenced.md)\n```\n";
    let targets = link_targets(doc);
    assert_eq!(
        targets,
        ["x/a.md", "b.svg \"title\"", "https://e.org", "y.md#part", "#here"]
    );
    let paths: Vec<_> = targets.into_iter().filter_map(local_path).collect();
    assert_eq!(paths, ["x/a.md", "b.svg", "y.md"]);
}
