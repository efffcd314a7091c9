//! The compiler's IR: the model as a graph of operators (petgraph), with typed ids, inferred
//! shapes on nodes, tensor sizes on edges and a span side table pointing back at the spec.
//!
//! The DSL writes chains today, so lowering produces a path; the IR itself is a DAG (an
//! operator may have several inputs and outputs), and every pass walks it in topological
//! order, so residual branches need no change below the front end.

use std::fmt::{self, Write as _};

use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use pipec_grammar::spec::Model;
use pipec_grammar::Span;
use pipec_plan::model::{fmt_shape, Op};

/// Identifies an operator in the IR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId(NodeIndex<u32>);

impl OpId {
    pub fn index(self) -> usize {
        self.0.index()
    }
}

/// One operator node.
#[derive(Debug, Clone, PartialEq)]
pub struct OpNode {
    pub op: Op,
    pub label: Option<String>,
    pub input_shape: Vec<usize>,
    pub output_shape: Vec<usize>,
}

/// One edge: the tensor flowing from producer to consumer.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorEdge {
    pub shape: Vec<usize>,
    /// Bytes per sample at the spec's precision.
    pub bytes_per_sample: u64,
}

/// The model graph.
#[derive(Debug, Clone)]
pub struct Graph {
    graph: DiGraph<OpNode, TensorEdge, u32>,
    /// Operators in topological order (the order stages are cut in).
    order: Vec<OpId>,
    /// Span side table: `spans[op.index()]` is where the operator was written.
    spans: Vec<Span>,
    pub input_shape: Vec<usize>,
    pub precision_bytes: usize,
}

impl Graph {
    pub fn len(&self) -> usize {
        self.order.len()
    }
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
    /// Operators in topological order.
    pub fn ops(&self) -> impl Iterator<Item = (OpId, &OpNode)> + '_ {
        self.order.iter().map(move |&id| (id, &self.graph[id.0]))
    }
    pub fn node(&self, id: OpId) -> &OpNode {
        &self.graph[id.0]
    }
    /// The i-th operator in topological order.
    pub fn op_at(&self, i: usize) -> OpId {
        self.order[i]
    }
    pub fn span(&self, id: OpId) -> Span {
        self.spans.get(id.index()).copied().unwrap_or_default()
    }
    /// Bytes per sample that cross a cut placed after the first `cut` operators in
    /// topological order (every edge from the prefix into the suffix).
    pub fn cut_bytes_per_sample(&self, cut: usize) -> u64 {
        let position: std::collections::HashMap<OpId, usize> =
            self.order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        self.graph
            .edge_references()
            .filter(|e| {
                let a = position[&OpId(e.source())];
                let b = position[&OpId(e.target())];
                a < cut && b >= cut
            })
            .map(|e| e.weight().bytes_per_sample)
            .sum()
    }
    /// Producers feeding `id`.
    pub fn inputs(&self, id: OpId) -> impl Iterator<Item = OpId> + '_ {
        self.graph.neighbors_directed(id.0, petgraph::Direction::Incoming).map(OpId)
    }
}

/// Lowers the checked model to the IR.
pub fn lower(model: &Model, precision_bytes: usize) -> Graph {
    let mut graph = DiGraph::<OpNode, TensorEdge, u32>::default();
    let mut order = Vec::with_capacity(model.layers.len());
    let mut spans = Vec::with_capacity(model.layers.len());
    let mut prev: Option<NodeIndex<u32>> = None;
    for layer in &model.layers {
        let n = graph.add_node(OpNode {
            op: layer.op.clone(),
            label: layer.label.clone(),
            input_shape: layer.input_shape.clone(),
            output_shape: layer.output_shape.clone(),
        });
        if let Some(p) = prev {
            let shape = graph[p].output_shape.clone();
            let bytes = shape.iter().product::<usize>() as u64 * precision_bytes as u64;
            graph.add_edge(p, n, TensorEdge { shape, bytes_per_sample: bytes });
        }
        spans.push(layer.span);
        order.push(OpId(n));
        prev = Some(n);
    }
    // The graph is built in topological order; check it stays a DAG as the DSL grows.
    debug_assert!(petgraph::algo::toposort(&graph, None).is_ok());
    Graph { graph, order, spans, input_shape: model.input.clone(), precision_bytes }
}

impl fmt::Display for Graph {
    /// The textual IR dump (`pipec compile --emit ir`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "input {}", fmt_shape(&self.input_shape))?;
        let index: std::collections::HashMap<OpId, usize> =
            self.order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        for (i, (id, node)) in self.ops().enumerate() {
            let mut args = String::new();
            let ins: Vec<String> = self.inputs(id).map(|p| format!("%{}", index[&p])).collect();
            let ins = if ins.is_empty() { "input".to_string() } else { ins.join(", ") };
            let _ = write!(args, "{}", op_args(&node.op));
            let label = node.label.as_ref().map(|l| format!("  @{l}")).unwrap_or_default();
            writeln!(
                f,
                "%{i} = {}{args}({ins}) : {} -> {}{label}",
                node.op.name(),
                fmt_shape(&node.input_shape),
                fmt_shape(&node.output_shape)
            )?;
        }
        Ok(())
    }
}

fn op_args(op: &Op) -> String {
    match op {
        Op::Linear { in_features, out_features, bias } => {
            format!("[{in_features}x{out_features}{}]", if *bias { ", bias" } else { "" })
        }
        Op::Conv2d { in_channels, out_channels, kernel, stride, padding, bias } => {
            format!(
                "[{in_channels}->{out_channels}, k={kernel}, s={stride}, p={padding}{}]",
                if *bias { ", bias" } else { "" }
            )
        }
        Op::MaxPool2d { kernel, stride } | Op::AvgPool2d { kernel, stride } => format!("[k={kernel}, s={stride}]"),
        Op::LayerNorm { dim } => format!("[{dim}]"),
        Op::Dropout { p } => format!("[p={p}]"),
        Op::Embedding { vocab, dim } => format!("[{vocab}x{dim}]"),
        Op::TransformerBlock { d_model, heads, d_ff } => format!("[d={d_model}, heads={heads}, ff={d_ff}]"),
        Op::Flatten | Op::Relu | Op::Gelu | Op::Tanh | Op::Sigmoid => String::new(),
    }
}
