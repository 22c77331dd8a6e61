//! Which namespaces have a NetworkPolicy, as the node agent keeps them in
//! the kernel beside the policy: a set of names in its table, written in
//! the same transaction as the verdicts. It outlives the agent as the
//! table does, so a pod's ADD can tell while no agent answers whether the
//! pod might be isolated (any policy of its namespace might select it).

use firewall::ruleset::{self, TableFamily, Value};

/// The agent's NetworkPolicy table, in the `inet` family.
pub const TABLE: &str = "cni-suite-netpol";

/// Its set of the names of the namespaces that have a policy.
pub const SET: &str = "guarded-namespaces";

/// Whether `namespace` is recorded as having a policy, or may have one.
/// No table is no (no agent enforces policy on this node, or it was
/// uninstalled). A table without the set is yes: an older agent's, which
/// recorded nothing, or one someone changed; whether the pod would be
/// isolated cannot be told.
pub fn has_policy(namespace: &str) -> firewall::Result<bool> {
    let Some(key) = Value::text(namespace) else {
        // Longer than any namespace's name can be.
        return Ok(false);
    };
    match ruleset::elements(TableFamily::Inet, TABLE, SET)? {
        Some(names) => Ok(names.iter().any(|e| e.key == key)),
        None => firewall::nfnl::table_exists(TableFamily::Inet, TABLE),
    }
}

#[cfg(test)]
mod tests {
    use firewall::ruleset::{Element, Field, Op, Set, SetKind};

    use super::*;

    #[test]
    fn a_namespace_is_guarded_when_recorded_or_when_the_table_cannot_say() {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root");
                assert!(!has_policy("shop").expect("read"), "no table: no agent enforces");
                ruleset::commit(TableFamily::Inet, TABLE, &[Op::AddTable]).expect("a table");
                assert!(has_policy("shop").expect("read"), "a table that records nothing");
                let set = Set {
                    name: SET.to_owned(),
                    key: vec![Field::Text],
                    kind: SetKind::Plain,
                };
                let shop = Value::text("shop").expect("fits");
                ruleset::commit(
                    TableFamily::Inet,
                    TABLE,
                    &[
                        Op::AddSet(set.clone()),
                        Op::AddElements {
                            set,
                            elements: vec![Element::key(shop)],
                        },
                    ],
                )
                .expect("the set");
                assert!(has_policy("shop").expect("read"));
                assert!(!has_policy("lobby").expect("read"));
                assert!(
                    !has_policy(&"x".repeat(64)).expect("read"),
                    "no namespace is that long"
                );
            })
            .join()
            .expect("the test's thread");
        });
    }
}
