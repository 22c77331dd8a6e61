//! Every crate the suite ships forbids `unsafe` at its root, or denies it
//! there and says why in a crate doc line starting "`unsafe`:" (the blocks
//! that need it are then allowed one by one, which the compiler checks).

use crate::common::{roots, shipping_members, workspace};

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
    let root = workspace();
    let shipping = shipping_members(&root);
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
