//! One watched kind as a controller keeps it: each object's view (what
//! the controller reads of it, often far less than the object) by key,
//! replaced whole when a restarted watch's relist completes, so an object
//! deleted while the watch was down does not stay. The Node watch, the
//! repair controller and the NetworkPolicy controller each keep theirs so.

use std::collections::BTreeMap;

use kube::api::ObjectMeta;
use kube::runtime::watcher::Event;

/// What a watched map is keyed by: the name (cluster-scoped kinds) or
/// the namespace and the name.
pub trait Key: Ord + Sized {
    fn of(meta: &ObjectMeta) -> Option<Self>;
}

impl Key for String {
    fn of(meta: &ObjectMeta) -> Option<String> {
        meta.name.clone()
    }
}

impl Key for (String, String) {
    fn of(meta: &ObjectMeta) -> Option<(String, String)> {
        Some((meta.namespace.clone().unwrap_or_default(), meta.name.clone()?))
    }
}

/// The views of one kind's objects.
#[derive(Debug)]
pub struct Watched<K, V> {
    known: BTreeMap<K, V>,
    /// While a relist is in progress: what it listed so far.
    relisted: Option<BTreeMap<K, V>>,
    listed_once: bool,
}

impl<K: Key, V: PartialEq> Default for Watched<K, V> {
    fn default() -> Self {
        Watched {
            known: BTreeMap::new(),
            relisted: None,
            listed_once: false,
        }
    }
}

impl<K: Key, V: PartialEq> Watched<K, V> {
    /// Takes one event in; whether what the controller reads changed. An
    /// object whose view is None (a pod that finished, say) is as if
    /// deleted. While a relist is in progress nothing changes: its end
    /// is the change.
    pub fn take<R: kube::Resource>(&mut self, event: &Event<R>, view: impl Fn(&R) -> Option<V>) -> bool {
        match event {
            Event::Init => {
                self.relisted = Some(BTreeMap::new());
                false
            }
            Event::InitApply(object) => {
                if let (Some(list), Some(key), Some(v)) =
                    (self.relisted.as_mut(), K::of(object.meta()), view(object))
                {
                    list.insert(key, v);
                }
                false
            }
            Event::InitDone => {
                self.known = self.relisted.take().unwrap_or_default();
                self.listed_once = true;
                true
            }
            Event::Apply(object) => {
                let Some(key) = K::of(object.meta()) else {
                    return false;
                };
                match view(object) {
                    Some(v) if self.known.get(&key) == Some(&v) => false,
                    Some(v) => {
                        self.known.insert(key, v);
                        true
                    }
                    None => self.known.remove(&key).is_some(),
                }
            }
            Event::Delete(object) => {
                K::of(object.meta()).is_some_and(|key| self.known.remove(&key).is_some())
            }
        }
    }

    /// The views as the last list and the events since left them.
    pub fn known(&self) -> &BTreeMap<K, V> {
        &self.known
    }

    /// Whether a list has completed since the start.
    pub fn listed_once(&self) -> bool {
        self.listed_once
    }
}

/// For the controllers' tests, which set the state rather than replay
/// events.
#[cfg(test)]
impl<K: Key, V: PartialEq> Watched<K, V> {
    pub fn known_mut(&mut self) -> &mut BTreeMap<K, V> {
        &mut self.known
    }

    pub fn mark_listed(&mut self) {
        self.listed_once = true;
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;

    use super::*;

    fn object(name: &str, value: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("ns".to_owned()),
                ..ObjectMeta::default()
            },
            data: Some([("v".to_owned(), value.to_owned())].into()),
            ..ConfigMap::default()
        }
    }

    fn value(map: &ConfigMap) -> Option<String> {
        map.data.as_ref()?.get("v").filter(|v| !v.is_empty()).cloned()
    }

    fn names(watched: &Watched<(String, String), String>) -> Vec<String> {
        watched.known().keys().map(|(_, name)| name.clone()).collect()
    }

    #[test]
    fn a_relist_replaces_the_map_whole_and_only_its_end_is_a_change() {
        let mut watched: Watched<(String, String), String> = Watched::default();
        assert!(!watched.take(&Event::Init, value));
        assert!(!watched.take(&Event::InitApply(object("a", "1")), value));
        assert!(!watched.take(&Event::InitApply(object("b", "1")), value));
        assert!(!watched.listed_once());
        assert!(watched.take(&Event::InitDone, value));
        assert!(watched.listed_once());
        assert_eq!(names(&watched), ["a", "b"]);
        // b was deleted while the watch was down: the relist drops it.
        assert!(!watched.take(&Event::Init, value));
        assert!(!watched.take(&Event::InitApply(object("a", "1")), value));
        assert_eq!(
            names(&watched),
            ["a", "b"],
            "the old map stands until the relist ends"
        );
        assert!(watched.take(&Event::InitDone, value));
        assert_eq!(names(&watched), ["a"]);
    }

    #[test]
    fn an_update_changes_only_when_its_view_does() {
        let mut watched: Watched<(String, String), String> = Watched::default();
        assert!(watched.take(&Event::Apply(object("a", "1")), value));
        assert!(!watched.take(&Event::Apply(object("a", "1")), value));
        assert!(watched.take(&Event::Apply(object("a", "2")), value));
        // No view: as if deleted, and a change only the first time.
        assert!(watched.take(&Event::Apply(object("a", "")), value));
        assert!(!watched.take(&Event::Apply(object("a", "")), value));
        assert!(!watched.take(&Event::Delete(object("a", "2")), value));
        assert!(watched.take(&Event::Apply(object("c", "1")), value));
        assert!(watched.take(&Event::Delete(object("c", "1")), value));
        assert!(watched.known().is_empty());
    }

    #[test]
    fn cluster_scoped_objects_are_keyed_by_name() {
        let mut watched: Watched<String, String> = Watched::default();
        assert!(watched.take(&Event::Apply(object("n1", "1")), value));
        assert_eq!(watched.known().keys().collect::<Vec<_>>(), ["n1"]);
    }
}
