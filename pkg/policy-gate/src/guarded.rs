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

/// Whether `namespace` is recorded as having a policy. No table (no agent
/// enforces policy on this node, or it was uninstalled) or no set is no.
pub fn has_policy(namespace: &str) -> firewall::Result<bool> {
    let Some(key) = Value::text(namespace) else {
        // Longer than any namespace's name can be.
        return Ok(false);
    };
    Ok(ruleset::elements(TableFamily::Inet, TABLE, SET)?
        .is_some_and(|names| names.iter().any(|e| e.key == key)))
}
