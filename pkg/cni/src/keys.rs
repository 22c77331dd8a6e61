//! Configuration keys matched as Go's `encoding/json` matches them where
//! the reference plugins decode a document into a struct: a key names the
//! field whose JSON name it equals exactly, else the first field (in the
//! struct's order) whose name it equals without regard to case; when two
//! keys name one field, the later one wins. So `"IPMasq": true`,
//! `"isgateway": true` or `"RuntimeConfig": {"MAC": …}` work as they do
//! with the reference. Maps (capabilities, annotations, sysctls) keep their
//! keys exactly, and keys no field names are left alone (unless `null`:
//! see below).
//!
//! A [`Shape`] describes the structs the reference decodes into; [`fold`]
//! renames each key of a document to the name of the field it matches, so
//! everything after reads the canonical names.
//!
//! `null` is an absent key there: Go's decoder leaves a field as it was for
//! it (a slice, map, pointer or interface becomes nil, which is what an
//! absent key leaves too), so [`fold`] drops every struct member and map
//! entry that is `null`, and [`get`] passes over them. Two differences
//! remain, both rare: a `null` after an earlier key for the same nilable
//! field makes it nil in Go, where the earlier value stays here; and a field
//! whose Go type decodes itself (`types.IPNet`: a range's `subnet`, a
//! route's `dst`, a result's `address`) is handed the `null` and fails
//! there, where it reads as absent here, which is itself an error for all
//! of them but the legacy `ipam.subnet` (read as "no legacy range", as its
//! `""` already is).

use serde_json::{Map, Value};

/// How the reference decodes one value.
#[derive(Debug, Clone, Copy)]
pub enum Shape {
    /// Kept as it is (a scalar, or what no struct decodes).
    Any,
    /// A struct: its fields, in groups (Go's embedded structs first).
    Struct(&'static [&'static [Field]]),
    /// A list of values of one shape.
    List(&'static Shape),
    /// A map: keys exact, values of one shape.
    Map(&'static Shape),
}

/// A field: its JSON name and how its value is decoded.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    pub key: &'static str,
    pub shape: Shape,
}

/// A field of shape `shape`.
pub const fn field(key: &'static str, shape: Shape) -> Field {
    Field { key, shape }
}

/// A field whose value no struct decodes.
pub const fn plain(key: &'static str) -> Field {
    Field {
        key,
        shape: Shape::Any,
    }
}

/// Go's `bytes.EqualFold` on field names: equal rune by rune under Unicode
/// simple case folding (`K`, `k` and the Kelvin sign are one letter, as
/// are `S`, `s` and `ſ`), never by full case mapping (`ß` is not `ss`).
fn equal_fold(a: &str, b: &str) -> bool {
    a.chars().count() == b.chars().count()
        && a.chars()
            .zip(b.chars())
            .all(|(x, y)| fold_rune(x) == fold_rune(y))
}

/// One rune's representative under simple folding: its upper case, then
/// that one's lower case, each only where the mapping is a single rune.
fn fold_rune(c: char) -> char {
    fn single(mut mapped: impl Iterator<Item = char>, original: char) -> char {
        match (mapped.next(), mapped.next()) {
            (Some(one), None) => one,
            _ => original,
        }
    }
    let upper = single(c.to_uppercase(), c);
    single(upper.to_lowercase(), upper)
}

impl Shape {
    fn fields(&self) -> impl Iterator<Item = &'static Field> {
        let groups: &'static [&'static [Field]] = match self {
            Shape::Struct(groups) => groups,
            _ => &[],
        };
        groups.iter().flat_map(|group| group.iter())
    }

    /// The field `key` names: exact first, then without regard to case.
    fn field_for(&self, key: &str) -> Option<&'static Field> {
        self.fields()
            .find(|f| f.key == key)
            .or_else(|| self.fields().find(|f| equal_fold(f.key, key)))
    }
}

/// The value of `field` in `map` as Go decodes a struct with that one field
/// from it: the last key equal to its name without regard to case whose
/// value is not `null` (see the module docs).
pub fn get<'a>(map: &'a Map<String, Value>, field: &str) -> Option<&'a Value> {
    map.iter()
        .rev()
        .find(|(key, value)| !value.is_null() && equal_fold(key, field))
        .map(|(_, value)| value)
}

/// Renames the keys of `value` to the fields of `shape` they match, all the
/// way down, and drops the members and map entries that are `null`, as Go
/// reads them (see the module docs).
pub fn fold(value: &mut Value, shape: &Shape) {
    match (shape, value) {
        (Shape::Any, _) => {}
        (Shape::List(item), Value::Array(items)) => {
            for value in items {
                fold(value, item);
            }
        }
        (Shape::Map(item), Value::Object(map)) => {
            // Go stores the element's zero value: as good as no entry for
            // the maps read here (capabilities, `redirect`).
            map.retain(|_, value| !value.is_null());
            for value in map.values_mut() {
                fold(value, item);
            }
        }
        (Shape::Struct(_), Value::Object(map)) => {
            let entries = std::mem::take(map);
            let mut folded = Map::with_capacity(entries.len());
            // Also the keys no field names: our own readers may know them.
            for (key, mut value) in entries.into_iter().filter(|(_, value)| !value.is_null()) {
                match shape.field_for(&key) {
                    Some(field) => {
                        fold(&mut value, &field.shape);
                        // A later key naming the same field wins, as in Go.
                        folded.insert(field.key.to_owned(), value);
                    }
                    None => {
                        folded.insert(key, value);
                    }
                }
            }
            *map = folded;
        }
        _ => {}
    }
}

/// One step from a value to the values inside it that a [`Shape`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A struct's field, by its JSON name.
    Field(&'static str),
    /// Each item of a list.
    Item,
    /// Each entry of a map.
    Entry,
}

/// Every path from a value of `shape` to a key it may hold: each struct
/// field and each map's entries, all the way down. Tests walk them to see
/// every key read `null` as it reads the key absent.
pub fn field_paths(shape: &Shape) -> Vec<Vec<Step>> {
    let mut paths = Vec::new();
    collect_paths(shape, &mut Vec::new(), &mut paths);
    paths
}

fn collect_paths(shape: &Shape, prefix: &mut Vec<Step>, paths: &mut Vec<Vec<Step>>) {
    let mut descend = |step: Step, inner: &Shape, is_key: bool| {
        prefix.push(step);
        if is_key {
            paths.push(prefix.clone());
        }
        collect_paths(inner, prefix, paths);
        prefix.pop();
    };
    match shape {
        Shape::Any => {}
        Shape::List(item) => descend(Step::Item, item, false),
        Shape::Map(value) => descend(Step::Entry, value, true),
        Shape::Struct(_) => {
            for field in shape.fields() {
                descend(Step::Field(field.key), &field.shape, true);
            }
        }
    }
}

/// A path as text: `runtimeConfig.portMappings[].hostIP`, `capabilities.*`.
pub fn path_text(path: &[Step]) -> String {
    let mut text = String::new();
    for step in path {
        match step {
            Step::Field(key) => {
                if !text.is_empty() {
                    text.push('.');
                }
                text.push_str(key);
            }
            Step::Item => text.push_str("[]"),
            Step::Entry => text.push_str(".*"),
        }
    }
    text
}

/// For each of `shape`'s [`field_paths`] that reaches into `doc` (whose
/// keys are followed by their exact names): the path, and `doc` with every
/// key the path leads to `null`, then without those keys.
pub fn null_and_absent(doc: &Value, shape: &Shape) -> Vec<(String, Value, Value)> {
    field_paths(shape)
        .iter()
        .filter_map(|path| {
            let null = replaced(doc, path, Some(&Value::Null))?;
            let absent = replaced(doc, path, None)?;
            Some((path_text(path), null, absent))
        })
        .collect()
}

/// A `prevResult` holding every key a result's shape names, for the
/// plugins' tests of [`assert_null_reads_as_absent`].
pub fn full_prev_result() -> Value {
    serde_json::json!({"cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "mac": "c2:00:00:00:00:01", "mtu": 1400,
                        "sandbox": "/run/netns/p", "socketPath": "/s", "pciID": "0000:00:01.0"}],
        "ips": [{"address": "10.9.0.12/24", "gateway": "10.9.0.1", "interface": 0}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.9.0.1", "mtu": 1400, "advmss": 1300,
                    "priority": 5, "table": 100, "scope": 0}],
        "dns": {"nameservers": ["10.0.0.53"], "domain": "d", "search": ["s"], "options": ["o"]}})
}

/// For each of `shape`'s keys `doc` holds (at least `at_least` of them),
/// panics unless `loaded` (all a plugin reads of a configuration) gives
/// the same with the key `null` as without it: the per-plugin test that
/// every key reads `null` as Go's decoder does.
pub fn assert_null_reads_as_absent<T: PartialEq + std::fmt::Debug>(
    doc: &Value,
    shape: &Shape,
    at_least: usize,
    loaded: impl Fn(&Value) -> T,
) {
    let variants = null_and_absent(doc, shape);
    assert!(variants.len() >= at_least, "{} paths", variants.len());
    for (path, null, absent) in variants {
        assert_eq!(loaded(&null), loaded(&absent), "{path}");
    }
}

/// `doc` with the keys `path` leads to set to `value` (removed for None);
/// None when no object holds them.
fn replaced(doc: &Value, path: &[Step], value: Option<&Value>) -> Option<Value> {
    let mut doc = doc.clone();
    replace_in(&mut doc, path, value).then_some(doc)
}

fn replace_in(node: &mut Value, path: &[Step], value: Option<&Value>) -> bool {
    let Some((step, rest)) = path.split_first() else {
        return false;
    };
    // Every one of them, not just up to the first reached.
    let each = |inner: &mut dyn Iterator<Item = &mut Value>| {
        inner
            .map(|v| replace_in(v, rest, value))
            .filter(|reached| *reached)
            .count()
            > 0
    };
    match (step, node) {
        (Step::Field(key), Value::Object(map)) if rest.is_empty() => {
            match value {
                Some(v) => {
                    map.insert((*key).to_owned(), v.clone());
                }
                None => {
                    map.shift_remove(*key);
                }
            }
            true
        }
        (Step::Field(key), Value::Object(map)) => map
            .get_mut(*key)
            .is_some_and(|inner| replace_in(inner, rest, value)),
        (Step::Entry, Value::Object(map)) if rest.is_empty() => {
            let reached = !map.is_empty();
            match value {
                Some(v) => map.values_mut().for_each(|entry| *entry = v.clone()),
                None => map.clear(),
            }
            reached
        }
        (Step::Entry, Value::Object(map)) => each(&mut map.values_mut()),
        (Step::Item, Value::Array(items)) => each(&mut items.iter_mut()),
        _ => false,
    }
}

/// `types.Route`.
pub const ROUTE: Shape = Shape::Struct(&[&[
    plain("dst"),
    plain("gw"),
    plain("mtu"),
    plain("advmss"),
    plain("priority"),
    plain("table"),
    plain("scope"),
]]);

/// `types.DNS`.
pub const DNS: Shape = Shape::Struct(&[&[
    plain("nameservers"),
    plain("domain"),
    plain("search"),
    plain("options"),
]]);

/// A result of any version (types020, types040, types100).
pub const RESULT: Shape = Shape::Struct(&[&[
    plain("cniVersion"),
    field(
        "interfaces",
        Shape::List(&Shape::Struct(&[&[
            plain("name"),
            plain("mac"),
            plain("mtu"),
            plain("sandbox"),
            plain("socketPath"),
            plain("pciID"),
        ]])),
    ),
    field(
        "ips",
        Shape::List(&Shape::Struct(&[&[
            plain("version"),
            plain("interface"),
            plain("address"),
            plain("gateway"),
        ]])),
    ),
    field("routes", Shape::List(&ROUTE)),
    field("dns", DNS),
    field("ip4", IP_CONFIG_020),
    field("ip6", IP_CONFIG_020),
]]);

/// A 0.1.0/0.2.0 result's `ip4` or `ip6`.
const IP_CONFIG_020: Shape = Shape::Struct(&[&[
    plain("ip"),
    plain("gateway"),
    field("routes", Shape::List(&ROUTE)),
]]);

/// GC's attachment list entries.
const ATTACHMENT: Shape = Shape::Struct(&[&[plain("containerID"), plain("ifname")]]);

/// `types.NetConf` but its `ipam`: what every reference plugin decodes.
pub const NET_CONF: &[Field] = &[
    plain("cniVersion"),
    plain("name"),
    plain("type"),
    field("capabilities", Shape::Map(&Shape::Any)),
    field("dns", DNS),
    field("prevResult", RESULT),
    field("cni.dev/valid-attachments", Shape::List(&ATTACHMENT)),
    field("cni.dev/attachments", Shape::List(&ATTACHMENT)),
];

/// `types.NetConf`'s `ipam`, as a plugin that delegates decodes it: its
/// `type` (the IPAM plugin reads the rest).
pub const IPAM_TYPE: Field = field("ipam", Shape::Struct(&[&[plain("type")]]));

/// A plugin that decodes nothing beyond `types.NetConf` (loopback).
pub const PLAIN_PLUGIN: Shape = Shape::Struct(&[NET_CONF, &[IPAM_TYPE]]);

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const SHAPE: Shape = Shape::Struct(&[
        NET_CONF,
        &[
            IPAM_TYPE,
            plain("ipMasq"),
            plain("isGateway"),
            plain("isDefaultGateway"),
            field("runtimeConfig", Shape::Struct(&[&[plain("mac")]])),
            field(
                "args",
                Shape::Struct(&[&[field("cni", Shape::Struct(&[&[plain("mac")]]))]]),
            ),
        ],
    ]);

    fn folded(mut doc: Value) -> Value {
        fold(&mut doc, &SHAPE);
        doc
    }

    #[test]
    fn keys_match_fields_without_regard_to_case() {
        let doc = folded(
            json!({"CNIVersion": "1.0.0", "NAME": "n", "IPMasq": true, "isgateway": true,
            "RuntimeConfig": {"MAC": "c2:00:00:00:00:01"}, "Args": {"CNI": {"Mac": "x"}},
            "Capabilities": {"Mac": true}, "unknownKey": 1}),
        );
        assert_eq!(
            doc,
            json!({"cniVersion": "1.0.0", "name": "n", "ipMasq": true, "isGateway": true,
                "runtimeConfig": {"mac": "c2:00:00:00:00:01"}, "args": {"cni": {"mac": "x"}},
                "capabilities": {"Mac": true}, "unknownKey": 1})
        );
    }

    #[test]
    fn the_later_key_wins_and_exact_names_are_preferred() {
        let doc = folded(json!({"ipMasq": false, "IPMASQ": true}));
        assert_eq!(doc, json!({"ipMasq": true}));
        let doc = folded(json!({"IPMASQ": true, "ipMasq": false}));
        assert_eq!(doc, json!({"ipMasq": false}));
        // `isDefaultGateway` is not `isGateway` in any case.
        let doc = folded(json!({"ISDEFAULTGATEWAY": true}));
        assert_eq!(doc, json!({"isDefaultGateway": true}));
    }

    #[test]
    fn results_and_lists_fold_all_the_way_down() {
        let doc = folded(json!({"PrevResult": {"CNIVersion": "1.0.0",
            "IPs": [{"Address": "10.0.0.2/24", "Interface": 0}],
            "Routes": [{"Dst": "0.0.0.0/0", "GW": "10.0.0.1"}],
            "Interfaces": [{"Name": "eth0", "Sandbox": "/x"}]}}));
        assert_eq!(
            doc,
            json!({"prevResult": {"cniVersion": "1.0.0",
                "ips": [{"address": "10.0.0.2/24", "interface": 0}],
                "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}],
                "interfaces": [{"name": "eth0", "sandbox": "/x"}]}})
        );
    }

    #[test]
    fn one_field_is_read_from_its_last_key_in_any_case() {
        let doc = json!({"type": "a", "Type": "b", "other": 1});
        let map = doc.as_object().expect("object");
        assert_eq!(get(map, "type"), Some(&json!("b")));
        assert_eq!(get(map, "missing"), None);
    }

    /// A document holding every key `shape` names, two of each list item
    /// and map entry.
    fn sample(shape: &Shape) -> Value {
        match shape {
            Shape::Any => json!("x"),
            Shape::List(item) => json!([sample(item), sample(item)]),
            Shape::Map(value) => json!({"k": sample(value), "K": sample(value)}),
            Shape::Struct(_) => Value::Object(
                shape
                    .fields()
                    .map(|f| (f.key.to_owned(), sample(&f.shape)))
                    .collect(),
            ),
        }
    }

    fn holds_null(value: &Value) -> bool {
        match value {
            Value::Null => true,
            Value::Array(items) => items.iter().any(holds_null),
            Value::Object(map) => map.values().any(holds_null),
            _ => false,
        }
    }

    #[test]
    fn every_field_path_reads_null_as_absent() {
        for shape in [SHAPE, PLAIN_PLUGIN, RESULT] {
            let doc = sample(&shape);
            let variants = null_and_absent(&doc, &shape);
            assert_eq!(
                variants.len(),
                field_paths(&shape).len(),
                "every path reaches into {doc}"
            );
            for (path, mut null, mut absent) in variants {
                fold(&mut null, &shape);
                fold(&mut absent, &shape);
                assert!(!holds_null(&null), "{path}: {null}");
                assert_eq!(null, absent, "{path}");
            }
        }
    }

    #[test]
    fn field_paths_go_through_structs_lists_and_maps() {
        let paths: Vec<String> = field_paths(&SHAPE).iter().map(|p| path_text(p)).collect();
        for expected in [
            "name",
            "capabilities",
            "capabilities.*",
            "prevResult.ips[].address",
            "prevResult.ip4.routes[].gw",
            "cni.dev/valid-attachments[].containerID",
            "runtimeConfig.mac",
            "args.cni.mac",
            "ipam.type",
        ] {
            assert!(paths.iter().any(|p| p == expected), "{expected} in {paths:?}");
        }
        let doc = json!({"capabilities": {"a": true}, "runtimeConfig": {}});
        let reached: Vec<String> = null_and_absent(&doc, &SHAPE)
            .into_iter()
            .map(|(p, _, _)| p)
            .collect();
        assert!(reached.contains(&"capabilities.*".to_owned()));
        assert!(
            reached.contains(&"runtimeConfig.mac".to_owned()),
            "a key absent from an object"
        );
        assert!(
            !reached.iter().any(|p| p.starts_with("args.")),
            "no object to hold it"
        );
    }

    #[test]
    fn null_leaves_a_field_as_an_earlier_key_set_it_and_unknown_nulls_go() {
        let doc = folded(
            json!({"ipMasq": true, "IPMASQ": null, "logFile": null, "Name": null,
            "capabilities": {"a": true, "b": null}, "PrevResult": null,
            "RuntimeConfig": {"MAC": null}}),
        );
        assert_eq!(
            doc,
            json!({"ipMasq": true, "capabilities": {"a": true}, "runtimeConfig": {}})
        );
        let doc = json!({"type": "a", "Type": null, "name": null});
        let map = doc.as_object().expect("object");
        assert_eq!(get(map, "type"), Some(&json!("a")));
        assert_eq!(get(map, "name"), None);
    }

    #[test]
    fn go_folds_the_kelvin_sign_and_the_long_s() {
        assert!(equal_fold("\u{212a}ey", "key"));
        assert!(equal_fold("\u{17f}ubnet", "SUBNET"));
        assert!(!equal_fold("subnet", "subnets"));
        assert!(!equal_fold("addreß", "address"), "no full case mapping");
        assert!(!equal_fold("runtimeCon\u{fb01}g", "runtimeConfig"));
    }
}
