//! The bench's outputs: a table of medians and ratios, one JSON line, an
//! SVG chart of the per-call latencies, and a markdown report.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Map, Value, json};

use crate::options::Options;
use crate::outcome::Outcome;
use crate::setup::{SERVICE_PREFIX, STARTED_PREFIX, Side};

/// What a target accepts instead of its ratio, where the design has a
/// floor no plugin can go below.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Floor {
    None,
    /// Ours minus this floor metric (ours' side: measured beside ours, on
    /// the same bridge) at most this many milliseconds.
    Above(&'static str, f64),
    /// Ours at most this multiple of the floor metric.
    Within(&'static str, f64),
}

/// The issue's targets for the drop-in setup: metric, ratio
/// ours/reference, and the floor that may stand in for the ratio.
pub const TARGETS: [(&str, f64, Floor); 30] = [
    ("seq ADD p50", 0.15, Floor::None),
    ("seq ADD p95", 0.5, Floor::None),
    ("seq ADD cpu p50", 0.15, Floor::None),
    ("seq DEL p50", 0.10, Floor::Above("seq DEL floor p50", 2.0)),
    (
        "seq DEL cpu p50",
        0.10,
        Floor::Above("seq DEL floor cpu p50", 2.0),
    ),
    ("burst ADD wall", 0.25, Floor::None),
    (
        "burst DEL wall",
        0.15,
        Floor::Within("burst DEL floor wall", 1.25),
    ),
    ("burst ADD cpu/call", 0.25, Floor::None),
    ("burst DEL cpu/call", 0.15, Floor::None),
    ("full chain ADD p50", 0.02, Floor::None),
    (
        "full chain DEL p50",
        0.02,
        Floor::Above("full chain DEL floor p50", 2.0),
    ),
    ("full IPAM ADD p50", 0.02, Floor::None),
    ("full IPAM DEL p50", 0.02, Floor::None),
    ("full chain ADD cpu p50", 0.02, Floor::None),
    (
        "full chain DEL cpu p50",
        0.02,
        Floor::Above("full chain DEL floor cpu p50", 2.0),
    ),
    ("full IPAM ADD cpu p50", 0.02, Floor::None),
    ("full IPAM DEL cpu p50", 0.02, Floor::None),
    ("loopback ADD p50", 0.6, Floor::None),
    ("loopback ADD cpu p50", 0.6, Floor::None),
    // The first pod of a node: ours starts host-local's lease service and
    // may cost up to the reference's own first ADD; both make the bridge
    // and the subnet's masquerade.
    ("first ADD", 1.0, Floor::None),
    ("service: seq ADD p50", 0.15, Floor::None),
    ("portmap ADD p50", 0.25, Floor::None),
    (
        "portmap DEL p50",
        0.25,
        Floor::Above("portmap DEL floor p50", 2.0),
    ),
    ("firewall ADD p50", 0.25, Floor::None),
    (
        "firewall DEL p50",
        0.25,
        Floor::Above("firewall DEL floor p50", 2.0),
    ),
    // A pod's sandbox through containerd's CRI, minikube's conflist.
    ("cri RunPodSandbox p50", 0.8, Floor::None),
    ("cri RunPodSandbox p99", 1.0, Floor::None),
    // The agent's chain with its entries naming the log socket the agent
    // reads, against the same chain naming none (issue 34).
    ("log socket chain ADD p50", 1.05, Floor::None),
    ("log socket chain ADD p99", 1.05, Floor::None),
    // A new connection judged by the agent's table in the kernel costs
    // what br_netfilter alone costs, within 5%.
    (POLICY_PATH_TARGET, 1.05, Floor::None),
];

/// The policy-path phase's goal: its connect p50 against br_netfilter on
/// with no rules.
const POLICY_PATH_TARGET: &str =
    "policy path connect µs, in-kernel verdict (ours) / br_netfilter on, no rules p50";

/// Istio's CNI alone: istio-redirect back in the primary's file after its
/// network's agent wrote the file again.
pub const RECHAIN_METRIC: &str = "istio chain back after a rewrite";

/// Goals in milliseconds where nothing runs beside ours to hold it
/// against (Istio's own agent cannot run here): ours' figure at most this.
pub const ABSOLUTE_TARGETS: [(&str, f64); 1] = [("istio chain back after a rewrite max", 2000.0)];

/// istio-redirect's rows: its ADD against one bare apply of the same rules.
pub const ISTIO_METRIC: &str = "istio-redirect ADD";
pub const ISTIO_NATIVE_METRIC: &str = "istio-redirect native_nftables ADD";

/// Phases in the chart, top to bottom.
const CHART_PHASES: [&str; 19] = [
    "cri RunPodSandbox",
    "cri RunPodSandbox hostNetwork",
    "seq ADD",
    "service: seq ADD",
    "seq DEL",
    "seq DEL floor",
    "loopback ADD",
    ISTIO_METRIC,
    ISTIO_NATIVE_METRIC,
    "portmap ADD",
    "portmap DEL",
    "portmap DEL floor",
    "firewall ADD",
    "firewall DEL",
    "firewall DEL floor",
    "full chain ADD",
    "full chain DEL",
    "full IPAM ADD",
    "full IPAM DEL",
];

pub type Figures = BTreeMap<String, BTreeMap<Side, f64>>;

fn target(metric: &str) -> Option<(f64, Floor)> {
    TARGETS
        .iter()
        .find(|(m, _, _)| *m == metric)
        .map(|(_, ratio, floor)| (*ratio, *floor))
}

/// Ours' figure of a metric.
fn ours(figures: &Figures, metric: &str) -> Option<f64> {
    figures.get(metric)?.get(&Side::Ours).copied()
}

/// The reference's figure to hold ours' against: its own, or for the
/// service setup's rows the drop-in row's (one reference suite runs
/// beside both), for a call that started the service the phase's p50.
fn reference(figures: &Figures, metric: &str) -> Option<f64> {
    let own = figures.get(metric).and_then(|s| s.get(&Side::Reference)).copied();
    own.or_else(|| {
        let base = metric
            .strip_prefix(SERVICE_PREFIX)
            .map(str::to_owned)
            .or_else(|| metric.strip_prefix(STARTED_PREFIX).map(|m| format!("{m} p50")))?;
        figures.get(&base)?.get(&Side::Reference).copied()
    })
}

fn ratio(figures: &Figures, metric: &str) -> Option<f64> {
    Some(ours(figures, metric)? / reference(figures, metric)?)
}

/// "≤ 0.1 met", "≤ 0.1 met by floor (…)" or "≤ 0.1 not met"; for an
/// absolute goal "≤ 2000 ms met" or "… not met".
pub fn verdict(figures: &Figures, metric: &str) -> Option<String> {
    if let Some((_, limit)) = ABSOLUTE_TARGETS.iter().find(|(m, _)| *m == metric) {
        let met = ours(figures, metric)? <= *limit;
        return Some(format!("≤ {limit} ms {}", if met { "met" } else { "not met" }));
    }
    let (wanted, floor) = target(metric)?;
    if ratio(figures, metric).is_some_and(|r| r <= wanted) {
        return Some(format!("≤ {wanted} met"));
    }
    let value = ours(figures, metric);
    let by_floor = match floor {
        Floor::None => None,
        Floor::Above(name, margin) => {
            let above = value? - ours(figures, name)?;
            (above <= margin).then(|| format!("≤ {wanted} met by floor: {above:.2} ms above `{name}`"))
        }
        Floor::Within(name, factor) => {
            let times = value? / ours(figures, name)?;
            (times <= factor).then(|| format!("≤ {wanted} met by floor: {times:.2} × `{name}`"))
        }
    };
    Some(by_floor.unwrap_or_else(|| format!("≤ {wanted} not met")))
}

/// Whether every target with figures is met (by ratio or floor).
pub fn all_met(figures: &Figures) -> bool {
    TARGETS
        .iter()
        .map(|(metric, _, _)| *metric)
        .chain(ABSOLUTE_TARGETS.iter().map(|(metric, _)| *metric))
        .filter_map(|metric| verdict(figures, metric))
        .all(|v| !v.ends_with("not met"))
}

fn cell(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"))
}

fn display_name(metric: &str) -> String {
    let log_socket = [
        crate::log_socket::LISTENED_METRIC,
        crate::log_socket::UNREAD_METRIC,
        crate::log_socket::CONTROL_METRIC,
    ];
    if metric.starts_with(crate::ambient::ADD_METRIC) {
        format!("{metric} (reference: the same chain, a pod not enrolled)")
    } else if metric.starts_with(crate::gate::ADD_PREFIX) {
        format!("{metric} (reference: the same ADD, no policySocket)")
    } else if metric.starts_with(crate::gate::BESIDE_PREFIX) {
        format!("{metric} (reference: one without policySocket started with it)")
    } else if log_socket.iter().any(|m| metric.starts_with(m)) {
        format!("{metric} (reference: the same chain, no logSocket)")
    } else if metric.starts_with(ISTIO_NATIVE_METRIC) {
        format!("{metric} (reference: one bare nft -f)")
    } else if metric.starts_with(ISTIO_METRIC) {
        format!("{metric} (reference: one bare iptables-restore)")
    } else {
        metric.to_owned()
    }
}

/// Rows: metric, ours, reference, ratio, target.
fn rows<'a>(figures: &Figures, metrics: impl IntoIterator<Item = &'a str>) -> Vec<[String; 5]> {
    metrics
        .into_iter()
        .filter(|m| figures.contains_key(*m))
        .map(|metric| {
            [
                display_name(metric),
                cell(ours(figures, metric)),
                cell(reference(figures, metric)),
                ratio(figures, metric).map_or_else(|| "-".to_owned(), |r| format!("{r:.3}")),
                verdict(figures, metric).unwrap_or_default(),
            ]
        })
        .collect()
}

const HEADER: [&str; 5] = ["metric (ms)", "ours", "reference", "ratio", "target"];

pub fn table(figures: &Figures) -> String {
    let rows = rows(figures, figures.keys().map(String::as_str));
    let widths: Vec<usize> = (0..5)
        .map(|i| {
            rows.iter()
                .map(|r| r[i].chars().count())
                .chain([HEADER[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    let line = |cells: &[&str]| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let _ = writeln!(out, "{}", line(&HEADER));
    for row in &rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        let _ = writeln!(out, "{}", line(&cells));
    }
    out
}

fn markdown_rows<'a>(figures: &Figures, metrics: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = format!("| {} |\n|---|---:|---:|---:|---|\n", HEADER.join(" | "));
    for row in rows(figures, metrics) {
        let _ = writeln!(out, "| {} |", row.join(" | "));
    }
    out
}

pub fn markdown_table(figures: &Figures) -> String {
    markdown_rows(figures, figures.keys().map(String::as_str))
}

pub fn json_line(options: &Options, outcome: &Outcome, figures: &Figures, machine: &str) -> String {
    let mut metrics = Map::new();
    for metric in figures.keys() {
        metrics.insert(
            metric.clone(),
            json!({"ours": ours(figures, metric), "reference": reference(figures, metric),
                   "ratio": ratio(figures, metric), "target": target(metric).map(|(r, _)| r),
                   "verdict": verdict(figures, metric)}),
        );
    }
    json!({"pods": options.pods, "repeats": options.repeats, "full_leases": options.full_leases,
           "machine": machine, "all_targets_met": all_met(figures),
           "metrics": Value::Object(metrics), "problems": outcome.problems})
    .to_string()
}

/// Reads figures back from a JSON line written by [`json_line`].
pub fn figures_from_json(line: &str) -> Result<(Figures, Value), String> {
    let doc: Value = serde_json::from_str(line.trim()).map_err(|e| format!("not a bench JSON line: {e}"))?;
    let metrics = doc["metrics"].as_object().ok_or("no metrics in the JSON line")?;
    let mut figures = Figures::new();
    for (metric, values) in metrics {
        let sides = figures.entry(metric.clone()).or_default();
        if let Some(v) = values["ours"].as_f64() {
            sides.insert(Side::Ours, v);
        }
        // Only a reference figure of its own: borrowed ones are found again.
        let borrowed = metric.starts_with(SERVICE_PREFIX) || metric.starts_with(STARTED_PREFIX);
        if let (false, Some(v)) = (borrowed, values["reference"].as_f64()) {
            sides.insert(Side::Reference, v);
        }
    }
    Ok((figures, doc))
}

/// docs/bench/README.md's table, from a run's JSON line: the drop-in targets first
/// (what users get), then the same phases with the lease service started
/// by hand, then the tails of every call, pooled over the repeats.
pub fn readme_table(figures: &Figures, doc: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Generated by `make bench-readme` from [run.json](run.json) \
         ({} pods, {} repeats, {} leases in the full phase; {}).\n",
        doc["pods"],
        doc["repeats"],
        doc["full_leases"],
        doc["machine"].as_str().unwrap_or("machine unknown")
    );
    out.push_str("**Drop-in** (plugins in a directory, no `socket` key, nothing started by the bench):\n\n");
    let headline: Vec<&str> = TARGETS
        .iter()
        .map(|(m, _, _)| *m)
        .filter(|m| !m.starts_with(SERVICE_PREFIX))
        .collect();
    out.push_str(&markdown_rows(figures, headline));
    out.push_str("\n**With `host-local serve` started beforehand and named by `socket`** (same run):\n\n");
    let service: Vec<String> = [
        "seq ADD p50",
        "seq ADD p95",
        "seq DEL p50",
        "burst ADD wall",
        "burst DEL wall",
    ]
    .iter()
    .map(|m| format!("{SERVICE_PREFIX}{m}"))
    .collect();
    out.push_str(&markdown_rows(figures, service.iter().map(String::as_str)));
    out.push_str("\n**Tails and floors** (every call of the phase over all repeats, both suites):\n\n");
    let mut tails = Vec::new();
    for phase in [
        "seq ADD",
        "seq DEL",
        "seq DEL floor",
        "full chain ADD",
        "full chain DEL",
        "full chain DEL floor",
        "portmap ADD",
        "portmap DEL",
        "portmap DEL floor",
        "firewall ADD",
        "firewall DEL",
        "firewall DEL floor",
    ] {
        for q in ["p50", "p95", "p99", "max"] {
            tails.push(format!("{phase} {q}"));
        }
    }
    tails.extend([
        "burst DEL floor wall".to_owned(),
        "floor exec /bin/true p50".to_owned(),
    ]);
    out.push_str(&markdown_rows(figures, tails.iter().map(String::as_str)));
    let policy_path: Vec<&String> = figures
        .keys()
        .filter(|m| m.starts_with("policy path") && !m.ends_with(" p95"))
        .collect();
    if !policy_path.is_empty() {
        out.push_str(
            "\n**Where a NetworkPolicy verdict is made** (µs per new TCP connection between two pods on \
             one bridge; ours' column / the reference's, as each row names them):\n\n",
        );
        out.push_str(&markdown_rows(
            figures,
            policy_path.into_iter().map(String::as_str),
        ));
    }
    let gate = gate_rows();
    if gate.iter().any(|m| figures.contains_key(m)) {
        out.push_str(
            "\n**The NetworkPolicy gate** (`cni-bench --only gate`: a bridge ADD through the node agent's \
             conflist for a pod of a default-deny namespace while another namespace holds 0, 1000 or 5000 \
             ipBlock rules, against the same ADD through the conflist without `policySocket`; CPU with the \
             agent's over the call; the agent writing and lifting those rules, as a probe from a pod sees it \
             and until its pass is done, with a gated and an ungated ADD started meanwhile; ms but for the \
             counts):\n\n",
        );
        out.push_str(&markdown_rows(figures, gate.iter().map(String::as_str)));
    }
    out
}

/// The gate phase's rows in docs/bench/README.md, in the order they read best.
fn gate_rows() -> Vec<String> {
    use crate::gate::{
        CHANGES, RULE_COUNTS, add_metric, beside_metric, change_metric, change_pass_metric,
        unconfirmed_metric, waited_ops_metric, written_ops_metric,
    };
    let mut rows = Vec::new();
    for rules in RULE_COUNTS {
        rows.extend(["p50", "p99", "max", "cpu p50"].map(|q| format!("{} {q}", add_metric(rules))));
        rows.push(waited_ops_metric(rules));
    }
    for rules in RULE_COUNTS.into_iter().filter(|r| *r > 0) {
        rows.push(written_ops_metric(rules));
        for change in CHANGES {
            rows.extend(["p50", "max"].map(|q| format!("{} {q}", change_metric(change, rules))));
            rows.extend(["p50", "max"].map(|q| format!("{} {q}", change_pass_metric(change, rules))));
            rows.extend(["p50", "max"].map(|q| format!("{} {q}", beside_metric(change, rules))));
            rows.push(unconfirmed_metric(change, rules));
        }
    }
    rows
}

/// `text` with what lies between the two marker lines replaced.
pub fn replace_between(text: &str, begin: &str, end: &str, with: &str) -> Result<String, String> {
    let start = text.find(begin).ok_or_else(|| format!("no {begin} line"))? + begin.len();
    let stop = text[start..].find(end).ok_or_else(|| format!("no {end} line"))? + start;
    Ok(format!("{}\n{with}{}", &text[..start], &text[stop..]))
}

/// Every call's wall time on a log scale, ours above the reference per
/// phase, the median marked.
pub fn svg(outcome: &Outcome) -> String {
    let (left, width, row, top) = (190.0, 620.0, 22.0, 40.0);
    let (lo, hi) = (0.5_f64.log10(), 5000_f64.log10());
    let x = |v: f64| left + (v.max(0.5).log10() - lo) / (hi - lo) * width;
    let phases: Vec<&str> = CHART_PHASES
        .iter()
        .copied()
        .filter(|p| outcome.samples.contains_key(*p))
        .collect();
    let height = top + row * 2.0 * phases.len() as f64 + 50.0;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"20\" font-size=\"13\">Per-call latency, ms (log scale): ours (blue) vs reference (orange)</text>\n",
        left + width + 20.0
    );
    let axis_y = top + row * 2.0 * phases.len() as f64 + 5.0;
    for tick in [
        0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
    ] {
        let tx = x(tick);
        let _ = writeln!(
            out,
            "<line x1=\"{tx:.1}\" y1=\"{top}\" x2=\"{tx:.1}\" y2=\"{axis_y}\" stroke=\"#ddd\"/>\
             <text x=\"{tx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{tick}</text>",
            axis_y + 14.0
        );
    }
    for (i, phase) in phases.iter().enumerate() {
        let y0 = top + row * 2.0 * i as f64;
        let _ = writeln!(out, "<text x=\"10\" y=\"{:.1}\">{phase}</text>", y0 + row + 4.0);
        for (j, (side, color)) in [(Side::Ours, "#1f77b4"), (Side::Reference, "#ff7f0e")]
            .iter()
            .enumerate()
        {
            let Some(values) = outcome.samples.get(*phase).and_then(|s| s.get(side)) else {
                continue;
            };
            let y = y0 + row * (j as f64 + 0.5);
            for v in values {
                let _ = writeln!(
                    out,
                    "<circle cx=\"{:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{color}\" fill-opacity=\"0.35\"/>",
                    x(*v)
                );
            }
            let m = crate::measure::median(values);
            let _ = writeln!(
                out,
                "<line x1=\"{0:.1}\" y1=\"{1:.1}\" x2=\"{0:.1}\" y2=\"{2:.1}\" stroke=\"{color}\" stroke-width=\"2\"/>",
                x(m),
                y - 8.0,
                y + 8.0
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

/// A profiler's report without its blank lines and, for strace's table,
/// only the rows that matter.
fn summary(text: &str) -> String {
    const STRACE_ROWS: usize = 12;
    let mut rows = 0;
    text.lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with("# started on"))
        .filter(|line| {
            let is_row = line
                .split_whitespace()
                .next()
                .is_some_and(|f| f.parse::<f64>().is_ok())
                && !line.contains("total");
            rows += usize::from(is_row);
            !is_row || rows <= STRACE_ROWS
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn markdown(options: &Options, outcome: &Outcome, figures: &Figures, machine: &str) -> String {
    let mut out = String::from("# make bench\n\n");
    let _ = writeln!(
        out,
        "Command: `make bench` (`cni-bench --pods {} --repeats {} --full-leases {}`). Machine: {machine}.\n",
        options.pods, options.repeats, options.full_leases
    );
    out.push_str(
        "Ours: bridge + host-local, loopback, istio-redirect from `target/<triple>/release`, in two setups. \
         **Drop-in** (the rows without a prefix): the binaries in a directory and a configuration without a \
         `socket` key, nothing started by the bench; host-local starts its data directory's lease service on \
         first use (that call is reported apart, under `started the lease service:`), and the service's CPU \
         is added to ours per call. **Service** (`service:` rows): `host-local serve` started beforehand and \
         named by `socket`. Reference: Debian's containernetworking-plugins in /usr/lib/cni. The whole bench \
         runs in a private mount namespace with a fresh tmpfs on /run, so nothing left on the machine (a \
         socket, a lock) is found. Same configuration shape (bridge with isGateway and ipMasq, host-local over \
         a /16), each suite in its own node namespace, plugins executed directly as libcni does, calls \
         alternating between the suites. The `cri` rows: containerd's CRI driven as kubelet drives it, with \
         minikube's own `1-k8s.conflist` (bridge, portmap, firewall; host-local's default `dataDir`, on disk), \
         beside a `hostNetwork` sandbox on the same daemon, which calls no plugin.\n\n\
         Per-call rows (`p50`, `p95`, `p99`, `max`, `cpu p50`) pool every call of all repeats; once-per-repeat \
         rows (a burst's wall time) are medians of the repeats. Floors are measured in the same run, beside \
         the calls they bound, never taken from our own logs: a `… DEL floor` is one `ip -n <pod> link del \
         eth0` of a pod-like veth (a fresh namespace's eth0 with an address and a default route, its peer up on \
         the same bridge) made right before each DEL of that suite and deleted beside it: each of the two \
         deletions starts 100 ms after the call before it (a veth deletion waits in `rcu_barrier` for the \
         RCU work earlier calls left), and which goes first is drawn from a fixed seed; `burst DEL floor wall` is as \
         many such veths deleted at once by as many `ip` processes. A DEL target counts as met by floor when ours' p50 is within 2 ms \
         of its floor's p50 (a burst: within 1.25 × its floor).\n\n\
         The `policy path` rows time, in µs, each connect of a client pod to a server pod on the same \
         bridge (the suite's bridge and host-local), in five variants taking turns round by round: the \
         node's `br_netfilter` off; on with no rules; on with conntrack switched on and no policy (a table \
         whose forward chain holds only `ct state established,related accept`, the first rule of ours); \
         on with the agent's NetworkPolicy table (a policy selecting the server and allowing the client), \
         applied by the `netpol` crate; on with no table of ours and an iptables rule sending each \
         connection's first packet (conntrack NEW) to NFQUEUE 100, which a userspace reader in the node \
         accepts at once (kube-network-policies' design, without its policy logic). Each row names its two \
         variants as `ours / reference`; `µs added per connection` rows are medians over the repeats of a \
         variant's p50 minus that of the variant they name: against `conntrack on, no policy`, what the \
         verdict itself costs.\n\n\
         The `gate` rows time a bridge ADD (cnictl through the node agent's conflist, the agent running \
         against the API test server in the node's namespace) for a pod of a namespace whose policy denies \
         all ingress: through the NetworkPolicy gate (ours' column: the ADD waits until the kernel holds \
         the pod's isolation) and, in the same turns, through the same conflist without `policySocket` \
         (the reference's column), while another namespace holds one policy of 0, 1000 or 5000 ipBlock \
         rules selecting a pod there; the turns' order moves round by round. Before each ADD the agent \
         has taken the Pod object in; its CPU over the call is added to the call's. Each gated ADD must \
         be confirmed and drop a connection made right after it. `written` and `lifted` rows run from \
         the policy's create or delete until a probe from another pod to the selected pod is dropped or \
         let in, and until the agent's pass over the change is done (its pass counter moved); `ADD \
         started … after` rows are a gated ADD (ours) and an ungated one started together while the agent \
         makes that change, and a count of the gated ones not confirmed; `ops` rows are the agent's \
         logged table changes.\n\n",
    );
    out.push_str(&markdown_table(figures));
    out.push_str("\n![per-call latency](latency.svg)\n\n");
    if !outcome.profiles.is_empty() {
        out.push_str(
            "## Profiles\n\nOne more ADD and DEL per suite, on a node with no other pod, under each profiler \
            (which slows the call; only the shares matter). Ours hands IPAM to host-local's lease service, \
            a separate process not traced here; the reference's figures include every process it starts.\n\n",
        );
        for (title, text) in &outcome.profiles {
            let _ = writeln!(out, "### {title}\n\n```\n{}\n```\n", summary(text));
        }
    }
    if outcome.problems.is_empty() {
        out.push_str("No failure, duplicate address or leak in either suite.\n");
    } else {
        out.push_str("Problems:\n\n");
        for p in &outcome.problems {
            let _ = writeln!(out, "- {p}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(rows: &[(&str, Option<f64>, Option<f64>)]) -> Figures {
        rows.iter()
            .map(|(metric, ours, reference)| {
                let mut sides = BTreeMap::new();
                if let Some(v) = ours {
                    sides.insert(Side::Ours, *v);
                }
                if let Some(v) = reference {
                    sides.insert(Side::Reference, *v);
                }
                ((*metric).to_owned(), sides)
            })
            .collect()
    }

    #[test]
    fn a_ratio_within_target_is_met_whatever_the_floor() {
        let f = figures(&[
            ("seq DEL p50", Some(5.0), Some(80.0)),
            ("seq DEL floor p50", Some(1.0), None),
        ]);
        assert_eq!(verdict(&f, "seq DEL p50").as_deref(), Some("≤ 0.1 met"));
    }

    #[test]
    fn an_absolute_goal_holds_ours_alone_against_its_limit() {
        let metric = "istio chain back after a rewrite max";
        let fast = figures(&[(metric, Some(510.0), None)]);
        assert_eq!(verdict(&fast, metric).as_deref(), Some("≤ 2000 ms met"));
        let slow = figures(&[(metric, Some(2500.0), None)]);
        assert_eq!(verdict(&slow, metric).as_deref(), Some("≤ 2000 ms not met"));
        assert!(!all_met(&slow));
    }

    #[test]
    fn a_missed_ratio_counts_as_met_only_near_its_floor() {
        let near = figures(&[
            ("seq DEL p50", Some(15.5), Some(80.0)),
            ("seq DEL floor p50", Some(14.0), None),
        ]);
        assert_eq!(
            verdict(&near, "seq DEL p50").as_deref(),
            Some("≤ 0.1 met by floor: 1.50 ms above `seq DEL floor p50`")
        );
        let far = figures(&[
            ("seq DEL p50", Some(15.5), Some(80.0)),
            ("seq DEL floor p50", Some(13.0), None),
        ]);
        assert_eq!(verdict(&far, "seq DEL p50").as_deref(), Some("≤ 0.1 not met"));
        let burst = figures(&[
            ("burst DEL wall", Some(120.0), Some(500.0)),
            ("burst DEL floor wall", Some(100.0), None),
        ]);
        assert_eq!(
            verdict(&burst, "burst DEL wall").as_deref(),
            Some("≤ 0.15 met by floor: 1.20 × `burst DEL floor wall`")
        );
        let no_floor = figures(&[("seq ADD p50", Some(10.0), Some(30.0))]);
        assert_eq!(
            verdict(&no_floor, "seq ADD p50").as_deref(),
            Some("≤ 0.15 not met")
        );
        assert!(!all_met(&no_floor));
    }

    #[test]
    fn service_and_start_rows_are_held_against_the_references_own() {
        let f = figures(&[
            ("seq ADD p50", Some(3.0), Some(30.0)),
            ("service: seq ADD p50", Some(3.3), None),
            ("started the lease service: seq ADD", Some(25.0), None),
            ("first ADD", Some(25.0), Some(24.0)),
        ]);
        assert_eq!(reference(&f, "service: seq ADD p50"), Some(30.0));
        assert_eq!(reference(&f, "started the lease service: seq ADD"), Some(30.0));
        assert_eq!(verdict(&f, "first ADD").as_deref(), Some("≤ 1 not met"));
        let line = json_line(
            &Options {
                pods: 1,
                repeats: 1,
                full_leases: 1,
                out: "x".into(),
                only: None,
            },
            &Outcome::default(),
            &f,
            "here",
        );
        let (back, _) = figures_from_json(&line).expect("parse");
        assert_eq!(back, f, "the README is generated from what the run measured");
    }

    #[test]
    fn metrics_without_a_target_have_no_verdict() {
        let f = figures(&[("seq ADD p99", Some(5.0), Some(30.0))]);
        assert_eq!(verdict(&f, "seq ADD p99"), None);
    }

    #[test]
    fn the_readme_keeps_what_surrounds_its_table() {
        let text = "a\n<!-- b -->\nold\n<!-- e -->\nz\n";
        assert_eq!(
            replace_between(text, "<!-- b -->", "<!-- e -->", "new\n").expect("markers"),
            "a\n<!-- b -->\nnew\n<!-- e -->\nz\n"
        );
        assert!(replace_between("none", "<!-- b -->", "<!-- e -->", "x").is_err());
    }
}
