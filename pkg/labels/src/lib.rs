//! Kubernetes label selectors (`metav1.LabelSelector`) over a label map:
//! every `matchLabels` pair and every expression must hold, and an empty
//! selector selects everything. The NetworkPolicy compiler reads them from
//! the API's objects, Istio's ambient enrolment from its plugin entry
//! (`enablement_selectors`); both match with this one type.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::Deserialize;

pub type Labels = BTreeMap<String, String>;

/// A label selector as JSON carries it (`matchLabels`,
/// `matchExpressions`), before it is checked.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default)]
    pub match_labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub match_expressions: Option<Vec<Expression>>,
}

/// One `matchExpressions` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Expression {
    #[serde(default)]
    pub key: String,
    #[serde(default)]
    pub operator: String,
    #[serde(default)]
    pub values: Option<Vec<String>>,
}

/// A checked selector. One built leniently from an expression that cannot
/// be read (an unknown operator) selects nothing, as the API server
/// refuses such an object anyway.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    requirements: Vec<Requirement>,
    unreadable: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

impl Requirement {
    /// As `metav1.LabelSelectorAsSelector` reads an expression: In and
    /// NotIn need values, Exists and DoesNotExist take none.
    fn read(expression: &Expression) -> Result<Requirement, String> {
        let key = expression.key.clone();
        let values = expression.values.clone().unwrap_or_default();
        let operator = expression.operator.as_str();
        match (operator, values.is_empty()) {
            ("In", false) => Ok(Requirement::In(key, values)),
            ("NotIn", false) => Ok(Requirement::NotIn(key, values)),
            ("Exists", true) => Ok(Requirement::Exists(key)),
            ("DoesNotExist", true) => Ok(Requirement::DoesNotExist(key)),
            ("In" | "NotIn", true) => Err(format!("key {key:?}: operator {operator} needs values")),
            ("Exists" | "DoesNotExist", false) => {
                Err(format!("key {key:?}: operator {operator} takes no values"))
            }
            _ => Err(format!("key {key:?}: unknown operator {operator:?}")),
        }
    }
}

impl Selector {
    /// Checked as the API server and Istio's agent check one: an
    /// expression that cannot be read is an error naming it.
    pub fn parse(selector: &LabelSelector) -> Result<Selector, String> {
        let mut requirements = match_labels(selector);
        for expression in selector.match_expressions.iter().flatten() {
            requirements.push(Requirement::read(expression)?);
        }
        Ok(Selector {
            requirements,
            unreadable: false,
        })
    }

    /// From an object the API server accepted: what cannot be read
    /// selects nothing rather than failing the object's reader.
    pub fn lenient(selector: &LabelSelector) -> Selector {
        Selector::parse(selector).unwrap_or(Selector {
            requirements: Vec::new(),
            unreadable: true,
        })
    }

    /// `matchLabels` only, for tests and callers that build selectors.
    pub fn labels(pairs: &[(&str, &str)]) -> Selector {
        Selector {
            requirements: pairs
                .iter()
                .map(|(k, v)| Requirement::In((*k).into(), vec![(*v).into()]))
                .collect(),
            unreadable: false,
        }
    }

    pub fn matches(&self, labels: &Labels) -> bool {
        !self.unreadable
            && self.requirements.iter().all(|r| match r {
                Requirement::In(k, values) => labels.get(k).is_some_and(|v| values.contains(v)),
                Requirement::NotIn(k, values) => labels.get(k).is_none_or(|v| !values.contains(v)),
                Requirement::Exists(k) => labels.contains_key(k),
                Requirement::DoesNotExist(k) => !labels.contains_key(k),
            })
    }
}

fn match_labels(selector: &LabelSelector) -> Vec<Requirement> {
    selector
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| Requirement::In(k.clone(), vec![v.clone()]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selector(json: &str) -> Result<Selector, String> {
        Selector::parse(&serde_json::from_str(json).expect("a selector's JSON"))
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect()
    }

    #[test]
    fn every_requirement_must_hold_and_empty_selects_everything() {
        let everything = selector("{}").expect("valid");
        assert!(everything.matches(&Labels::new()) && everything.matches(&labels(&[("app", "web")])));
        let s = selector(
            r#"{"matchLabels": {"app": "web"}, "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "mode", "operator": "NotIn", "values": ["none"]},
                {"key": "team", "operator": "Exists"},
                {"key": "legacy", "operator": "DoesNotExist"}]}"#,
        )
        .expect("valid");
        let base = [("app", "web"), ("tier", "b"), ("team", "x")];
        assert!(s.matches(&labels(&base)));
        assert!(!s.matches(&labels(&[("app", "db"), ("tier", "b"), ("team", "x")])));
        assert!(!s.matches(&labels(&[("app", "web"), ("tier", "c"), ("team", "x")])));
        assert!(!s.matches(&labels(&[("app", "web"), ("tier", "b")])));
        let mut with = labels(&base);
        with.insert("mode".into(), "none".into());
        assert!(!s.matches(&with), "NotIn a value it has");
        with.insert("mode".into(), "ambient".into());
        assert!(s.matches(&with), "NotIn: another value");
        with.insert("legacy".into(), String::new());
        assert!(!s.matches(&with), "DoesNotExist: there, even empty");
    }

    #[test]
    fn what_the_api_server_refuses_is_an_error_or_selects_nothing() {
        for (json, says) in [
            (
                r#"{"matchExpressions": [{"key": "a", "operator": "Equals", "values": ["x"]}]}"#,
                "unknown operator",
            ),
            (
                r#"{"matchExpressions": [{"key": "a", "operator": "In"}]}"#,
                "needs values",
            ),
            (
                r#"{"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}"#,
                "takes no values",
            ),
        ] {
            let err = selector(json).expect_err(json);
            assert!(err.contains(says), "{err}");
            let lenient = Selector::lenient(&serde_json::from_str(json).expect("JSON"));
            assert!(!lenient.matches(&labels(&[("a", "x")])) && !lenient.matches(&Labels::new()));
        }
    }
}
