//! The shipped binaries run on any node image: statically linked.

use test_kit::{bin_dir, run};

#[test]
fn every_binary_is_statically_linked() {
    for name in test_kit::PLUGINS.into_iter().chain(["cnictl"]) {
        let path = bin_dir().join(name);
        let ldd = run("ldd", &[path.to_str().expect("UTF-8 path")]);
        let said = format!("{}{}", ldd.stdout, ldd.stderr);
        assert!(said.contains("not a dynamic executable"), "{name}: {ldd:?}");
    }
}
