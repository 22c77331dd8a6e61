//! What the cluster bench's phases find, row by row: the scale phase and
//! the sandbox bursts both write into one [`ScaleOutcome`], which the
//! table, the JSON record and the exit status are made from.

/// One line of the table: ours against what it is compared with.
#[derive(Debug, Clone)]
pub struct Row {
    pub metric: String,
    pub ours: f64,
    /// The floor, the reference or the small cluster, and which.
    pub other: Option<(String, f64)>,
    pub goal: String,
    pub met: Option<bool>,
}

#[derive(Debug, Default)]
pub struct ScaleOutcome {
    pub rows: Vec<Row>,
    pub problems: Vec<String>,
}

impl ScaleOutcome {
    pub(crate) fn row(
        &mut self,
        metric: &str,
        ours: f64,
        other: Option<(&str, f64)>,
        goal: &str,
        met: Option<bool>,
    ) {
        eprintln!(
            "bench: {metric}: {ours:.2}{}",
            other.map_or(String::new(), |(n, v)| format!(" ({n} {v:.2})"))
        );
        self.rows.push(Row {
            metric: metric.to_owned(),
            ours,
            other: other.map(|(name, value)| (name.to_owned(), value)),
            goal: goal.to_owned(),
            met,
        });
    }

    pub(crate) fn problem(&mut self, text: String) {
        eprintln!("bench: {text}");
        self.problems.push(text);
    }
}
