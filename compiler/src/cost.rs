//! The cost model: per operator parameters, FLOPs, bytes kept for the backward and output
//! bytes; time = FLOPs / device throughput unless a measured profile replaces it.
//!
//! Activation accounting follows what autograd keeps: the input of every operator with
//! weights or a non-linearity, a one-byte mask for dropout, nothing for `flatten`; for a
//! transformer block the per-layer accounting of Korthikanti et al. 2022,
//! 34·s·h + 5·a·s² bytes per sample at 16-bit, scaled to the spec's precision.

use pipec_plan::model::Op;

use crate::ir::{Graph, OpNode};

/// What one layer costs, per microbatch of `microbatch_size` samples.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCost {
    pub forward_flops_per_sample: f64,
    pub backward_flops_per_sample: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    pub parameters: u64,
    pub parameter_bytes: u64,
    /// Bytes kept for the backward, per sample.
    pub activation_bytes_per_sample: u64,
    /// Bytes of the output, per sample.
    pub output_bytes_per_sample: u64,
}

fn numel(shape: &[usize]) -> f64 {
    shape.iter().product::<usize>() as f64
}

/// Forward FLOPs per sample.
pub fn forward_flops(node: &OpNode) -> f64 {
    let out = numel(&node.output_shape);
    let inp = numel(&node.input_shape);
    match node.op {
        Op::Linear { in_features, out_features, bias } => {
            let rows = inp / in_features as f64;
            rows * (2.0 * in_features as f64 * out_features as f64 + if bias { out_features as f64 } else { 0.0 })
        }
        Op::Conv2d { in_channels, kernel, .. } => out * 2.0 * in_channels as f64 * (kernel * kernel) as f64,
        Op::MaxPool2d { kernel, .. } | Op::AvgPool2d { kernel, .. } => out * (kernel * kernel) as f64,
        Op::Flatten => 0.0,
        Op::Relu | Op::Dropout { .. } => inp,
        Op::Gelu | Op::Tanh | Op::Sigmoid => 8.0 * inp,
        Op::LayerNorm { .. } => 5.0 * inp,
        Op::Embedding { .. } => out,
        Op::TransformerBlock { d_model, d_ff, .. } => {
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            let d = d_model as f64;
            let f = d_ff as f64;
            // QKV and output projections 8·s·d², scores and weighted sum 4·s²·d, MLP 4·s·d·f
            8.0 * s * d * d + 4.0 * s * s * d + 4.0 * s * d * f
        }
    }
}

/// Backward FLOPs per sample: input gradient plus weight gradient for operators with
/// weights (2× forward), the input gradient alone otherwise (1× forward).
pub fn backward_flops(node: &OpNode) -> f64 {
    let f = forward_flops(node);
    if node.op.parameter_count() > 0 && !matches!(node.op, Op::Embedding { .. }) {
        2.0 * f
    } else {
        f
    }
}

/// Bytes kept for the backward, per sample.
pub fn activation_bytes(node: &OpNode, precision_bytes: usize) -> u64 {
    let p = precision_bytes as f64;
    let inp = numel(&node.input_shape);
    let bytes = match node.op {
        Op::Flatten => 0.0,
        Op::Dropout { .. } => inp,         // one-byte mask
        Op::Embedding { .. } => inp * 8.0, // token ids
        Op::TransformerBlock { d_model, heads, .. } => {
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            (34.0 * s * d_model as f64 + 5.0 * heads as f64 * s * s) * p / 2.0
        }
        _ => inp * p,
    };
    bytes as u64
}

/// Costs every layer of the graph analytically.
pub fn analytic_costs(graph: &Graph, throughput: f64, microbatch_size: usize) -> Vec<LayerCost> {
    let p = graph.precision_bytes;
    graph
        .ops()
        .map(|(_, node)| {
            let ff = forward_flops(node);
            let bf = backward_flops(node);
            let params = node.op.parameter_count();
            LayerCost {
                forward_flops_per_sample: ff,
                backward_flops_per_sample: bf,
                forward_s: ff * microbatch_size as f64 / throughput,
                backward_s: bf * microbatch_size as f64 / throughput,
                parameters: params,
                parameter_bytes: params * p as u64,
                activation_bytes_per_sample: activation_bytes(node, p),
                output_bytes_per_sample: (numel(&node.output_shape) * p as f64) as u64,
            }
        })
        .collect()
}

pub use pipec_plan::profile::{Profile, ProfiledLayer};

/// Applying a measured profile to the analytic costs.
pub trait ApplyProfile {
    /// Replaces analytic costs with measured ones, scaled linearly to the microbatch size.
    fn apply(&self, costs: &mut [LayerCost], microbatch_size: usize) -> Result<(), String>;
}

impl ApplyProfile for Profile {
    fn apply(&self, costs: &mut [LayerCost], microbatch_size: usize) -> Result<(), String> {
        if self.layers.len() != costs.len() {
            return Err(format!("the profile has {} layers, the model has {}", self.layers.len(), costs.len()));
        }
        if self.batch_size == 0 {
            return Err("the profile's batch_size is 0".into());
        }
        let scale = microbatch_size as f64 / self.batch_size as f64;
        for (c, l) in costs.iter_mut().zip(&self.layers) {
            c.forward_s = l.forward_ms / 1e3 * scale;
            c.backward_s = l.backward_ms / 1e3 * scale;
            c.activation_bytes_per_sample = l.activation_bytes / self.batch_size as u64;
            c.output_bytes_per_sample = l.output_bytes / self.batch_size as u64;
            c.parameter_bytes = l.parameter_bytes;
        }
        Ok(())
    }
}

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
    let number = |i: usize| nodes[i].id.trim_start_matches("node").parse::<u64>().unwrap_or(u64::MAX);
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
            n
        })
        .collect())
}

/// Converts a PipeDream profile (profiled at `profiled_batch` samples) to layer costs at
/// `microbatch_size` samples.
pub fn pipedream_costs(nodes: &[PipeDreamNode], profiled_batch: usize, microbatch_size: usize) -> Vec<LayerCost> {
    let scale = microbatch_size as f64 / profiled_batch as f64;
    nodes
        .iter()
        .map(|n| LayerCost {
            forward_flops_per_sample: 0.0,
            backward_flops_per_sample: 0.0,
            forward_s: n.forward_ms / 1e3 * scale,
            backward_s: n.backward_ms / 1e3 * scale,
            parameters: (n.parameter_size / 4.0) as u64,
            parameter_bytes: n.parameter_size as u64,
            activation_bytes_per_sample: (n.activation_size / profiled_batch as f64) as u64,
            output_bytes_per_sample: (n.activation_size / profiled_batch as f64) as u64,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(op: Op, input: Vec<usize>) -> OpNode {
        let output = op.output_shape(&input).expect("valid shape");
        OpNode { op, label: None, input_shape: input, output_shape: output }
    }

    #[test]
    fn linear_flops_and_activations() {
        let n = node(Op::Linear { in_features: 1024, out_features: 1024, bias: false }, vec![1024]);
        assert_eq!(forward_flops(&n), 2.0 * 1024.0 * 1024.0);
        assert_eq!(backward_flops(&n), 4.0 * 1024.0 * 1024.0);
        assert_eq!(activation_bytes(&n, 4), 4096);
    }

    #[test]
    fn transformer_activations_follow_korthikanti() {
        // s = 512, h = 1024, a = 16 at 16-bit: 34·s·h + 5·a·s² bytes per sample
        let n = node(Op::TransformerBlock { d_model: 1024, heads: 16, d_ff: 4096 }, vec![512, 1024]);
        assert_eq!(activation_bytes(&n, 2), 34 * 512 * 1024 + 5 * 16 * 512 * 512);
        assert_eq!(activation_bytes(&n, 4), 2 * (34 * 512 * 1024 + 5 * 16 * 512 * 512));
    }

    #[test]
    fn pipedream_profile_parses_in_topological_order() {
        let text = "node2 -- ReLU -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=100.0, parameter_size=0.000\nnode1 -- Conv -- forward_compute_time=3.0, backward_compute_time=4.0, activation_size=200.0, parameter_size=40.0\n\tnode1 -- node2\n";
        let nodes = parse_pipedream_profile(text).expect("parses");
        assert_eq!(nodes[0].id, "node1");
        assert_eq!(nodes[1].forward_ms, 1.0);
        assert!(parse_pipedream_profile("node1 -- x -- forward_compute_time=1\n").is_err());
    }
}
