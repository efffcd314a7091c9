//! PipeDream's published layer profiles (`graph.txt`): parsing, the chain pipec plans over,
//! and what crosses a cut.
//!
//! pipec reads the graph in one topological order (Kahn's, ties broken by node number) and
//! plans contiguous ranges of it; a cut after the first j nodes carries every edge from those
//! nodes to later ones. PipeDream's optimizer plans over the graph's antichain states
//! instead: each is a downset of the graph, and a stage is the difference of two nested
//! downsets. Every prefix of pipec's order is a downset, so pipec searches a subset of the
//! splits PipeDream can choose (for a chain, the same set).

use std::ops::Range;

use pipec_grammar::spec::Link;

use crate::partition::{auto, AutoPlan, LayerChain, Machines, WeightSync};

/// A layer profile in PipeDream's `graph.txt` format, as a chain in topological order.
#[derive(Debug, Clone, PartialEq)]
pub struct PipeDreamNode {
    pub id: String,
    pub description: String,
    pub forward_ms: f64,
    pub backward_ms: f64,
    /// Output bytes for the profiled minibatch (a node with several outputs, such as
    /// GNMT's LSTMs, lists them; they are summed).
    pub activation_size: f64,
    pub parameter_size: f64,
    /// The nodes this node's output feeds, as indices into the topological order.
    pub successors: Vec<usize>,
}

/// Bytes crossing a cut after each position of the topological order, for the profiled
/// minibatch: every node before the cut whose output feeds a node after it counts once (a
/// cut inside a residual block carries the block's input and its current activation).
/// Entry j − 1 is the cut after the first j nodes.
pub fn pipedream_cut_bytes(nodes: &[PipeDreamNode]) -> Vec<f64> {
    (1..=nodes.len())
        .map(|j| nodes[..j].iter().filter(|n| n.successors.iter().any(|&s| s >= j)).map(|n| n.activation_size).sum())
        .collect()
}

/// Parses PipeDream's profile: node lines `nodeN -- desc -- forward_compute_time=..,
/// backward_compute_time=.., activation_size=.., parameter_size=..` and edge lines
/// `\tnodeA -- nodeB`. Returns the nodes in topological order.
pub fn parse_pipedream_profile(text: &str) -> Result<Vec<PipeDreamNode>, String> {
    let mut nodes: Vec<PipeDreamNode> = Vec::new();
    let mut edges: Vec<(String, String)> = Vec::new();
    for (lineno, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if line.starts_with('\t') || line.starts_with(' ') {
            let parts: Vec<&str> = line.trim().split(" -- ").collect();
            if parts.len() != 2 {
                return Err(format!("line {}: expected an edge `nodeA -- nodeB`", lineno + 1));
            }
            edges.push((parts[0].trim().to_string(), parts[1].trim().to_string()));
            continue;
        }
        let parts: Vec<&str> = line.splitn(3, " -- ").collect();
        if parts.len() != 3 {
            return Err(format!("line {}: expected `nodeN -- description -- costs`", lineno + 1));
        }
        // `key=value` pairs; a value may be a list `[a; b]` (GNMT's LSTMs), which is summed
        let get = |key: &str| -> Result<f64, String> {
            let start =
                parts[2].find(&format!("{key}=")).ok_or_else(|| format!("line {}: missing `{key}`", lineno + 1))?
                    + key.len()
                    + 1;
            let rest = parts[2][start..].trim_start();
            let value = match rest.strip_prefix('[') {
                Some(list) => list.split(']').next().unwrap_or(""),
                None => rest.split(',').next().unwrap_or(""),
            };
            value
                .split([',', ';'])
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(|v| v.parse::<f64>().map_err(|e| format!("line {}: `{key}`: {e}", lineno + 1)))
                .sum::<Result<f64, String>>()
        };
        nodes.push(PipeDreamNode {
            id: parts[0].trim().to_string(),
            description: parts[1].trim().to_string(),
            forward_ms: get("forward_compute_time")?,
            backward_ms: get("backward_compute_time")?,
            activation_size: get("activation_size")?,
            parameter_size: get("parameter_size")?,
            successors: Vec::new(),
        });
    }
    // Topological order (Kahn), ties broken by node number so the order is deterministic.
    let index: std::collections::HashMap<&str, usize> =
        nodes.iter().enumerate().map(|(i, n)| (n.id.as_str(), i)).collect();
    let mut indegree = vec![0usize; nodes.len()];
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (a, b) in &edges {
        let (Some(&ia), Some(&ib)) = (index.get(a.as_str()), index.get(b.as_str())) else {
            return Err(format!("edge {a} -- {b} names an unknown node"));
        };
        out[ia].push(ib);
        indegree[ib] += 1;
    }
    let indegree_before = indegree.clone();
    let number =
        |i: usize| nodes[i].id.trim_start_matches(|c: char| !c.is_ascii_digit()).parse::<u64>().unwrap_or(u64::MAX);
    let mut ready: std::collections::BTreeSet<(u64, usize)> =
        (0..nodes.len()).filter(|&i| indegree[i] == 0).map(|i| (number(i), i)).collect();
    let mut order = Vec::with_capacity(nodes.len());
    while let Some(first) = ready.iter().next().copied() {
        ready.remove(&first);
        order.push(first.1);
        for &j in &out[first.1] {
            indegree[j] -= 1;
            if indegree[j] == 0 {
                ready.insert((number(j), j));
            }
        }
    }
    if order.len() != nodes.len() {
        return Err("the profile's graph has a cycle".into());
    }
    let mut position = vec![0usize; nodes.len()];
    for (p, &i) in order.iter().enumerate() {
        position[i] = p;
    }
    Ok(order
        .into_iter()
        .map(|i| {
            let mut n = nodes[i].clone();
            n.successors = out[i].iter().map(|&j| position[j]).collect();
            // The input source is data loading, not a layer: PipeDream's optimizer gives it
            // no time, memory or parameters (it always sits on the first stage).
            if indegree_before[i] == 0 && n.description.starts_with("Input") {
                n.forward_ms = 0.0;
                n.backward_ms = 0.0;
                n.parameter_size = 0.0;
            }
            // nor to the unused `__getitem__` outputs it drops (GNMT's LSTMs' extra states)
            if out[i].is_empty() && n.description.starts_with("__getitem__") {
                n.forward_ms = 0.0;
                n.backward_ms = 0.0;
                n.parameter_size = 0.0;
            }
            n
        })
        .collect())
}

/// PipeDream's objective, written from `optimizer_graph_hierarchical.py` (run with
/// `--activation_compression_ratio 1`, so transfers count): the time per minibatch of a
/// plan whose stage `s` holds the chain's layers `ranges[s]` on `replicas[s]` devices,
/// devices given out in order. Each stage takes
/// (compute + 4(m−1)·|w| / (B·m)) / m, every stage but the first also 2·a/(B·m) for its
/// input and, if not last, for its output (PipeDream charges the first stage no transfer:
/// its output is charged to the second); the slowest stage is the plan's time.
///
/// PipeDream solves a two-level cluster one level at a time and prices a level-2 stage
/// with its level-1 solution; a flat layout whose stages straddle servers has no such
/// price. Here a stage syncs at the bandwidth of the slowest link its devices span and a
/// transfer at the slowest link between it and the neighbouring device, which is
/// PipeDream's formula on one level and its level-2 formula for stages that take whole
/// servers.
pub fn pipedream_price(
    chain: &LayerChain,
    ranges: &[Range<usize>],
    replicas: &[usize],
    devices_per_server: usize,
    bandwidths: (f64, f64),
) -> f64 {
    let per = devices_per_server.max(1);
    let bandwidth = |a: usize, b: usize| if a / per == b / per { bandwidths.0 } else { bandwidths.1 };
    let mut first = 0;
    let mut slowest: f64 = 0.0;
    for (s, (range, &m)) in ranges.iter().zip(replicas).enumerate() {
        let mf = m as f64;
        let compute: f64 = chain.times[range.clone()].iter().sum();
        let params: f64 = chain.parameter_bytes[range.clone()].iter().sum();
        let last = first + m - 1;
        let sync = 4.0 * (mf - 1.0) * params / (bandwidth(first, last) * mf);
        let mut time = (compute + sync) / mf;
        if s > 0 {
            time = time.max(2.0 * chain.cut_bytes[range.start - 1] / (bandwidth(first - 1, last) * mf));
            if s + 1 < ranges.len() {
                time = time.max(2.0 * chain.cut_bytes[range.end - 1] / (bandwidth(first, last + 1) * mf));
            }
        }
        slowest = slowest.max(time);
        first += m;
    }
    slowest
}

/// The chain `auto` plans over, per minibatch of the profile (PipeDream plans per
/// minibatch): forward + backward time, parameter bytes, the bytes crossing each cut, and
/// per layer its weights, gradients and one optimizer copy plus its outputs for the
/// minibatch as memory.
pub fn chain(nodes: &[PipeDreamNode]) -> LayerChain {
    LayerChain {
        names: nodes.iter().map(|n| n.description.clone()).collect(),
        times: nodes.iter().map(|n| (n.forward_ms + n.backward_ms) / 1e3).collect(),
        parameter_bytes: nodes.iter().map(|n| n.parameter_size).collect(),
        cut_bytes: pipedream_cut_bytes(nodes),
        memory_bytes: nodes.iter().map(|n| 3.0 * n.parameter_size + n.activation_size).collect(),
    }
}

/// Plans a chain the way PipeDream's optimizer is run against it: `servers` ×
/// `devices_per_server` devices, bandwidths inside and between servers, PipeDream's weight
/// synchronisation, no latency and no memory limit (PipeDream's default).
pub fn plan_like_pipedream(
    chain: &LayerChain,
    devices_per_server: usize,
    servers: usize,
    bandwidths: (f64, f64),
) -> Option<AutoPlan> {
    let machines = Machines {
        nodes: servers,
        per_node: devices_per_server,
        memory_capacity: f64::INFINITY,
        intra: Link::new(bandwidths.0, 0.0),
        inter: Link::new(bandwidths.1, 0.0),
    };
    auto(&chain.input(&machines, WeightSync::PipeDream))
}

/// One run of PipeDream's optimizer as `run_pipedream.py` recorded it in
/// `tests/reference/pipedream-profiles/pipedream-plans.json`: the profile, the cluster
/// (devices per server, servers, bandwidths inside and between) and, when it finished,
/// PipeDream's plan.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRun {
    pub model: String,
    pub cluster: String,
    /// The profile planned, relative to the profiles' directory.
    pub profile: String,
    pub per_server: usize,
    pub servers: usize,
    pub bandwidths: (f64, f64),
    pub plan: Option<RecordedPlan>,
}

/// What PipeDream chose: its time per minibatch, its stages as (state range, devices), and
/// how long its optimizer took.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedPlan {
    pub time_s: f64,
    pub stages: Vec<(Range<usize>, usize)>,
    pub optimizer_seconds: f64,
}

impl RecordedPlan {
    /// The devices per stage, `15-1` style.
    pub fn notation(&self) -> String {
        self.stages.iter().map(|(_, d)| d.to_string()).collect::<Vec<_>>().join("-")
    }
}

/// Reads `pipedream-plans.json`.
pub fn recorded_runs(json: &str) -> Result<Vec<RecordedRun>, String> {
    use serde_json::Value;
    let v: Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let list = |v: &Value, what: &str| v.as_array().cloned().ok_or_else(|| format!("`{what}` is not a list"));
    let int = |v: &Value| v.as_u64().map(|x| x as usize).ok_or_else(|| format!("{v} is not a count"));
    let num = |v: &Value| v.as_f64().ok_or_else(|| format!("{v} is not a number"));
    let text = |v: &Value| v.as_str().map(str::to_string).ok_or_else(|| format!("{v} is not a string"));
    let clusters = list(&v["clusters"], "clusters")?;
    let mut runs = Vec::new();
    for r in list(&v["runs"], "runs")? {
        let c = clusters
            .iter()
            .find(|c| c["name"] == r["cluster"])
            .ok_or_else(|| format!("run on an unrecorded cluster {}", r["cluster"]))?;
        let machines = list(&c["machines"], "machines")?.iter().map(int).collect::<Result<Vec<_>, _>>()?;
        let bandwidths = list(&c["bandwidths"], "bandwidths")?.iter().map(num).collect::<Result<Vec<_>, _>>()?;
        let (Some(&per_server), Some(&b1)) = (machines.first(), bandwidths.first()) else {
            return Err(format!("cluster {} has no level", c["name"]));
        };
        let model = text(&r["model"])?;
        let plan = if r["finished"] == Value::Bool(true) {
            let mut stages = Vec::new();
            for s in list(&r["stages"], "stages")? {
                let st = list(&s["states"], "states")?;
                let (Some(a), Some(b)) = (st.first(), st.get(1)) else {
                    return Err("a stage without its two states".into());
                };
                stages.push((int(a)?..int(b)?, int(&s["devices"])?));
            }
            Some(RecordedPlan {
                time_s: num(&r["time_ms"])? / 1e3,
                stages,
                optimizer_seconds: num(&r["optimizer_seconds"])?,
            })
        } else {
            None
        };
        runs.push(RecordedRun {
            profile: r["profile"].as_str().map(str::to_string).unwrap_or_else(|| format!("{model}/graph.txt")),
            model,
            cluster: text(&r["cluster"])?,
            per_server,
            servers: machines.get(1).copied().unwrap_or(1),
            bandwidths: (b1, bandwidths.get(1).copied().unwrap_or(b1)),
            plan,
        });
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipedream_profile_parses_in_topological_order() {
        let text = "node2 -- ReLU -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=100.0, parameter_size=0.000\nnode1 -- Conv -- forward_compute_time=3.0, backward_compute_time=4.0, activation_size=200.0, parameter_size=40.0\n\tnode1 -- node2\n";
        let nodes = parse_pipedream_profile(text).expect("parses");
        assert_eq!(nodes[0].id, "node1");
        assert_eq!(nodes[1].forward_ms, 1.0);
        assert!(parse_pipedream_profile("node1 -- x -- forward_compute_time=1\n").is_err());
    }
}
