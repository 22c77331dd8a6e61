//! The docs' map of the workspace stays the workspace's: every member is
//! in README's layout and in ARCHITECTURE's table of crates, and the
//! number of `unsafe` blocks they state is the number the shipping code
//! holds.

use std::path::Path;

use crate::common::{shipping_members, workspace};

fn read(root: &Path, file: &str) -> String {
    std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// README's layout: the fenced block under `## Layout`.
fn readme_layout(readme: &str) -> &str {
    readme
        .split_once("## Layout")
        .and_then(|(_, rest)| rest.split_once("```"))
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(block, _)| block)
        .expect("README has a layout block under ## Layout")
}

/// The paths README's layout names: each line's first word.
fn layout_paths(layout: &str) -> Vec<&str> {
    layout
        .lines()
        .filter(|line| !line.starts_with(' '))
        .filter_map(|line| line.split_whitespace().next())
        .collect()
}

/// The paths ARCHITECTURE's crate table names: what its first column
/// quotes.
fn table_paths(architecture: &str) -> Vec<String> {
    let table = architecture
        .split_once("## Crates")
        .and_then(|(_, rest)| rest.split_once("\n## "))
        .map(|(table, _)| table)
        .expect("ARCHITECTURE has a ## Crates section");
    table
        .lines()
        .filter_map(|line| line.strip_prefix("| "))
        .filter_map(|line| line.split_once(" |").map(|(first, _)| first))
        .flat_map(|first| first.split('`').skip(1).step_by(2))
        .map(|path| path.trim_end_matches('/').to_owned())
        .collect()
}

#[test]
fn every_member_is_in_the_readme_layout_and_the_architecture_table() {
    let root = workspace();
    let readme = read(&root, "README.md");
    let architecture = read(&root, "docs/ARCHITECTURE.md");
    let layout = layout_paths(readme_layout(&readme));
    let table = table_paths(&architecture);
    let mut missing = Vec::new();
    for member in crate::common::members(&root) {
        if !layout.contains(&member.as_str()) {
            missing.push(format!("README.md's layout lacks {member}"));
        }
        if !table.contains(&member) {
            missing.push(format!("docs/ARCHITECTURE.md's crate table lacks {member}"));
        }
    }
    // And nothing they name is gone.
    for path in layout.iter().copied().chain(table.iter().map(String::as_str)) {
        if !root.join(path).exists() {
            missing.push(format!("the docs name {path}, which is not in the tree"));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// `unsafe` blocks (and `unsafe fn`, `unsafe impl`) in a source file,
/// comments and strings aside as far as this code base writes them.
fn unsafe_uses(text: &str) -> usize {
    text.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .map(|code| {
            // Outside string literals: the even pieces between quotes.
            code.split('"')
                .step_by(2)
                .flat_map(|piece| piece.split(|c: char| !(c.is_alphanumeric() || c == '_')))
                .filter(|word| *word == "unsafe")
                .count()
        })
        .sum()
}

fn rust_files(dir: &Path, into: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, into);
        } else if path.extension().is_some_and(|e| e == "rs") {
            into.push(path);
        }
    }
}

/// The number a doc states right after `marker`, as a word.
fn stated(doc: &str, marker: &str) -> usize {
    let word = doc
        .split_once(marker)
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no {marker:?} in the doc"));
    let words = ["none", "one", "two", "three", "four", "five", "six", "seven"];
    words
        .iter()
        .position(|w| w.eq_ignore_ascii_case(word.trim_matches(|c: char| !c.is_alphanumeric())))
        .unwrap_or_else(|| panic!("{marker:?} is followed by {word:?}, not a number word"))
}

#[test]
fn the_unsafe_blocks_the_docs_count_are_the_ones_the_code_has() {
    let root = workspace();
    let mut files = Vec::new();
    for member in shipping_members(&root) {
        rust_files(&root.join(&member).join("src"), &mut files);
    }
    let mut places = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a source file");
        for _ in 0..unsafe_uses(&text) {
            places.push(file.strip_prefix(&root).unwrap_or(file).display().to_string());
        }
    }
    let readme = read(&root, "README.md");
    let architecture = read(&root, "docs/ARCHITECTURE.md");
    let in_readme = stated(&readme, "**`unsafe` in");
    let in_architecture = stated(&architecture, "**`unsafe` only where said.**");
    assert_eq!(
        (in_readme, in_architecture),
        (places.len(), places.len()),
        "README and ARCHITECTURE count {in_readme} and {in_architecture} unsafe blocks; the code has {places:?}"
    );
}

#[test]
fn the_readers_find_what_they_look_for() {
    assert_eq!(
        unsafe_uses("let x = unsafe { f(\"unsafe\") };\n// unsafe here\nunsafe_code"),
        1
    );
    assert_eq!(stated("a **`unsafe` in three blocks**: b", "**`unsafe` in"), 3);
    assert_eq!(
        layout_paths("pkg/cni    the protocol\n           more text\nnode-agent x\n"),
        ["pkg/cni", "node-agent"]
    );
    assert_eq!(
        table_paths(
            "## Crates\n\n| path | holds |\n|---|---|\n| `plugins/a`, `plugins/b` | x `y` |\n| `cnictl/` | z |\n\n## Next\n| `no` | |"
        ),
        ["plugins/a", "plugins/b", "cnictl"]
    );
}
