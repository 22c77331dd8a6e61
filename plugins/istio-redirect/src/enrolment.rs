//! Which pods Istio's ambient mode enrols: its enablement selectors (a
//! pod selector and a namespace selector, both of which must match, any
//! entry enough), and the pods it never enrols whatever the labels say:
//! those on the host's network (no namespace of their own to redirect
//! in) and those with a sidecar (ztunnel and a sidecar in one pod is not
//! supported). The plugin decides with it before it tells the agent; the
//! agent decides again from its own cache.

use std::collections::BTreeMap;

use cni::keys::{Shape, field, plain};
use labels::{LabelSelector, Labels, Selector};
use serde::Deserialize;

/// The label ambient's default selectors read, on the pod or its
/// namespace.
pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";

/// Istio's Helm default (`ambient.enablementSelectors`): the pod labelled
/// `ambient`, or its namespace labelled so and the pod not labelled `none`.
const ISTIO_DEFAULT: &str = r#"[
    {"podSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}},
    {"podSelector": {"matchExpressions": [{"key": "istio.io/dataplane-mode", "operator": "NotIn", "values": ["none"]}]},
     "namespaceSelector": {"matchLabels": {"istio.io/dataplane-mode": "ambient"}}}
]"#;

/// A `metav1.LabelSelector` as Go's decoder reads it (any case of each
/// key, null as absent).
const LABEL_SELECTOR: Shape = Shape::Struct(&[&[
    field("matchLabels", Shape::Map(&Shape::Any)),
    field(
        "matchExpressions",
        Shape::List(&Shape::Struct(&[&[
            plain("key"),
            plain("operator"),
            plain("values"),
        ]])),
    ),
]]);

/// `enablement_selectors` as Go's decoder reads it.
pub const SELECTORS: Shape = Shape::List(&Shape::Struct(&[&[
    field("podSelector", LABEL_SELECTOR),
    field("namespaceSelector", LABEL_SELECTOR),
]]));

/// One entry of `enablement_selectors`, as Istio's installer writes it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnablementSelector {
    #[serde(default)]
    pub pod_selector: LabelSelector,
    #[serde(default)]
    pub namespace_selector: LabelSelector,
}

/// What enrolment reads of a pod.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    pub labels: &'a Labels,
    pub host_network: bool,
    /// It carries `sidecar.istio.io/status` (the injector ran).
    pub has_sidecar: bool,
}

impl<'a> Candidate<'a> {
    /// A pod's labels, annotations and network: it has a sidecar when the
    /// injector's status annotation is there.
    pub fn new(labels: &'a Labels, annotations: &BTreeMap<String, String>, host_network: bool) -> Self {
        Candidate {
            labels,
            host_network,
            has_sidecar: annotations.contains_key(crate::annotations::STATUS),
        }
    }
}

/// The checked selectors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolment {
    selectors: Vec<(Selector, Selector)>,
}

impl Enrolment {
    /// Istio's default selectors: what an entry without
    /// `enablement_selectors` enrols.
    pub fn istio_default() -> Enrolment {
        let raw: Vec<EnablementSelector> = serde_json::from_str(ISTIO_DEFAULT).unwrap_or_default();
        Enrolment::from_selectors(&raw).unwrap_or(Enrolment {
            selectors: Vec::new(),
        })
    }

    /// The entry's selectors, checked as Istio's agent checks them; an
    /// empty list enrols no pod, as Istio's.
    pub fn from_selectors(raw: &[EnablementSelector]) -> Result<Enrolment, String> {
        let selectors = raw
            .iter()
            .enumerate()
            .map(|(i, entry)| {
                let pods = Selector::parse(&entry.pod_selector)
                    .map_err(|e| format!("entry {i}: podSelector: {e}"))?;
                let namespaces = Selector::parse(&entry.namespace_selector)
                    .map_err(|e| format!("entry {i}: namespaceSelector: {e}"))?;
                Ok((pods, namespaces))
            })
            .collect::<Result<_, String>>()?;
        Ok(Enrolment { selectors })
    }

    /// Whether ambient enrols the pod, in a namespace with these labels.
    pub fn matches(&self, pod: Candidate<'_>, namespace_labels: &Labels) -> bool {
        !pod.host_network
            && !pod.has_sidecar
            && self
                .selectors
                .iter()
                .any(|(pods, namespaces)| pods.matches(pod.labels) && namespaces.matches(namespace_labels))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect()
    }

    fn pod(labels: &Labels) -> Candidate<'_> {
        Candidate {
            labels,
            host_network: false,
            has_sidecar: false,
        }
    }

    #[test]
    fn istios_default_selectors() {
        let enrolment = Enrolment::istio_default();
        let (ambient, none, plain) = (
            labels(&[(DATAPLANE_MODE, "ambient")]),
            labels(&[(DATAPLANE_MODE, "none")]),
            labels(&[("app", "web")]),
        );
        let no_labels = Labels::new();
        assert!(enrolment.matches(pod(&ambient), &no_labels), "the pod's label");
        assert!(enrolment.matches(pod(&plain), &ambient), "the namespace's label");
        assert!(!enrolment.matches(pod(&none), &ambient), "the pod opts out");
        assert!(!enrolment.matches(pod(&plain), &no_labels));
        assert!(!enrolment.matches(pod(&plain), &none));
        let host = Candidate {
            host_network: true,
            ..pod(&ambient)
        };
        let sidecar = Candidate {
            has_sidecar: true,
            ..pod(&ambient)
        };
        assert!(!enrolment.matches(host, &ambient), "never a hostNetwork pod");
        assert!(
            !enrolment.matches(sidecar, &ambient),
            "never a pod with a sidecar"
        );
    }

    #[test]
    fn an_entrys_own_selectors_are_checked_and_an_empty_list_enrols_nothing() {
        let raw: Vec<EnablementSelector> = serde_json::from_str(
            r#"[{"namespaceSelector": {"matchExpressions": [{"key": "mesh", "operator": "Exists"}]}}]"#,
        )
        .expect("JSON");
        let enrolment = Enrolment::from_selectors(&raw).expect("valid");
        let plain = labels(&[("app", "web")]);
        assert!(enrolment.matches(pod(&plain), &labels(&[("mesh", "")])));
        assert!(!enrolment.matches(pod(&plain), &Labels::new()));
        let nothing = Enrolment::from_selectors(&[]).expect("valid");
        assert!(!nothing.matches(pod(&labels(&[(DATAPLANE_MODE, "ambient")])), &Labels::new()));
        let bad: Vec<EnablementSelector> =
            serde_json::from_str(r#"[{}, {"podSelector": {"matchExpressions": [{"key": "a", "operator": "in", "values": ["x"]}]}}]"#)
                .expect("JSON");
        let err = Enrolment::from_selectors(&bad).expect_err("an unknown operator");
        assert!(err.starts_with("entry 1: podSelector: "), "{err}");
    }
}
