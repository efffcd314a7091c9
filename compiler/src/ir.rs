//! The compiler's IR: the model as a graph of operators (petgraph), with typed ids, inferred
//! shapes on nodes, tensor sizes on edges and a span side table pointing back at the spec.
//!
//! The model is a DAG: an operator may read several tensors (a join) and its output may
//! feed several operators (a residual connection, parallel branches). Operators are kept
//! in the spec's topological order, the order stages are cut in.

use std::fmt::{self, Write as _};

use petgraph::graph::{DiGraph, NodeIndex};
use pipec_grammar::spec::Model;
use pipec_grammar::Span;
use pipec_plan::model::{fmt_shape, Op, Source};

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
    /// The operands in order (the edges carry the same, without the model's input).
    pub inputs: Vec<Source>,
    /// The first operand's shape.
    pub input_shape: Vec<usize>,
    pub output_shape: Vec<usize>,
    /// Weight tying: the embedding whose table (transposed) this projection's weight is.
    pub tied: Option<usize>,
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
    /// DeepSeek-V3's multi-token prediction after the last block (`model.mtp`), priced with
    /// the output layer (`crate::cost::analytic_costs`).
    pub mtp: Option<pipec_plan::model::Mtp>,
    /// Per cut (0 to the operator count), the bytes per sample crossing it: what every
    /// candidate of a strategy search reads for its stage boundaries, computed once.
    cuts: Vec<u64>,
    /// The operators in topological order, as the plan crate's passes read them (every
    /// candidate of a strategy search reads them: kept once).
    op_list: Vec<Op>,
}

impl Graph {
    pub fn len(&self) -> usize {
        self.order.len()
    }
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
    /// The operators themselves in topological order.
    pub fn op_list(&self) -> &[Op] {
        &self.op_list
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
    /// topological order: every tensor made before the cut (the model's input included)
    /// that an operator after it reads, each counted once however many read it.
    pub fn cut_bytes_per_sample(&self, cut: usize) -> u64 {
        self.cuts.get(cut).copied().unwrap_or_else(|| self.crossing_bytes(cut))
    }
    fn crossing_bytes(&self, cut: usize) -> u64 {
        self.crossing(cut).iter().map(|&s| self.source_bytes(s)).sum()
    }
    /// The tensors crossing a cut after the first `cut` operators, in order (the model's
    /// input first, then producers by position).
    pub fn crossing(&self, cut: usize) -> Vec<Source> {
        pipec_plan::model::crossing(self.order.iter().map(|id| self.graph[id.0].inputs.as_slice()), cut)
    }
    /// Per-sample bytes of a tensor.
    pub fn source_bytes(&self, s: Source) -> u64 {
        let shape = match s {
            Source::Input => &self.input_shape,
            Source::Layer(i) => &self.graph[self.order[i].0].output_shape,
        };
        tensor_bytes(shape, self.precision_bytes)
    }
    /// Producers feeding `id`.
    pub fn inputs(&self, id: OpId) -> impl Iterator<Item = OpId> + '_ {
        self.graph.neighbors_directed(id.0, petgraph::Direction::Incoming).map(OpId)
    }
    /// Per operator in topological order: whether it is either end of a weight tie.
    pub fn tie_ends(&self) -> Vec<bool> {
        let mut tied = vec![false; self.len()];
        for (i, (_, node)) in self.ops().enumerate() {
            if let Some(t) = node.tied {
                tied[i] = true;
                if let Some(x) = tied.get_mut(t) {
                    *x = true;
                }
            }
        }
        tied
    }
    /// Per operator, the graph cut into stages `ranges`: whether its input carries a gradient
    /// within its stage (`pipec_plan::in_pass::Layers::tracked`): a stage's input past the
    /// first stage (received with its gradient to send back), a layer's output when its input
    /// does or it has weights; never the model's data.
    pub fn tracked_inputs(&self, ranges: &[std::ops::Range<usize>]) -> Vec<bool> {
        let n = self.len();
        let (mut tracked, mut carries) = (vec![false; n], vec![false; n]);
        for r in ranges {
            for i in r.clone() {
                let node = self.node(self.op_at(i));
                let t = node.inputs.iter().any(|s| match *s {
                    Source::Input => false,
                    Source::Layer(p) if p < r.start => true,
                    Source::Layer(p) => carries.get(p).copied().unwrap_or(true),
                });
                tracked[i] = t;
                carries[i] = t || node.op.parameter_count() > 0 || node.tied.is_some();
            }
        }
        tracked
    }
}

/// The bytes of one sample's tensor of `shape`, saturating (a checked spec's tensors are
/// far below: `pipec_plan::model::MAX_TENSOR_ELEMENTS`).
fn tensor_bytes(shape: &[usize], precision_bytes: usize) -> u64 {
    pipec_plan::model::elements(shape).unwrap_or(u64::MAX).saturating_mul(precision_bytes as u64)
}

/// Lowers the checked model to the IR.
pub fn lower(model: &Model, precision_bytes: usize) -> Graph {
    let mut graph = DiGraph::<OpNode, TensorEdge, u32>::default();
    let mut order = Vec::with_capacity(model.layers.len());
    let mut spans = Vec::with_capacity(model.layers.len());
    for layer in &model.layers {
        let n = graph.add_node(OpNode {
            op: layer.op.clone(),
            label: layer.label.clone(),
            inputs: layer.inputs.clone(),
            input_shape: layer.input_shape.clone(),
            output_shape: layer.output_shape.clone(),
            tied: layer.tied,
        });
        for s in &layer.inputs {
            if let Source::Layer(p) = *s {
                let from: NodeIndex<u32> = order.get(p).map(|o: &OpId| o.0).unwrap_or(n);
                let shape = graph[from].output_shape.clone();
                let bytes = tensor_bytes(&shape, precision_bytes);
                graph.add_edge(from, n, TensorEdge { shape, bytes_per_sample: bytes });
            }
        }
        spans.push(layer.span);
        order.push(OpId(n));
    }
    // The graph is built in topological order; check it stays a DAG as the DSL grows.
    debug_assert!(petgraph::algo::toposort(&graph, None).is_ok());
    let mut g = Graph {
        graph,
        order,
        spans,
        input_shape: model.input.clone(),
        precision_bytes,
        mtp: model.mtp,
        cuts: Vec::new(),
        op_list: Vec::new(),
    };
    g.cuts = cut_bytes(&g);
    g.op_list = g.ops().map(|(_, n)| n.op.clone()).collect();
    g
}

/// The bytes per sample crossing every cut, in one pass: a tensor made by operator p (the
/// input: before operator 0) and last read by operator l crosses the cuts p + 1 ..= l
/// (`Graph::crossing`'s rule), so each adds its bytes there through a difference array.
fn cut_bytes(g: &Graph) -> Vec<u64> {
    let n = g.len();
    // per source (the input at 0, operator p at p + 1), the last operator reading it
    let mut last: Vec<Option<usize>> = vec![None; n + 1];
    for (i, (_, node)) in g.ops().enumerate() {
        for s in &node.inputs {
            let at = match *s {
                Source::Input => 0,
                Source::Layer(p) if p < i => p + 1,
                Source::Layer(_) => continue,
            };
            last[at] = Some(last[at].map_or(i, |l: usize| l.max(i)));
        }
    }
    let mut delta = vec![0i128; n + 2];
    for (at, l) in last.iter().enumerate() {
        let Some(l) = *l else { continue };
        let source = if at == 0 { Source::Input } else { Source::Layer(at - 1) };
        // the input crosses cuts 1 ..= l, operator p's output cuts p + 1 ..= l
        let first = at.max(1);
        if first <= l {
            let b = i128::from(g.source_bytes(source));
            delta[first] += b;
            delta[l + 1] -= b;
        }
    }
    let mut sum = 0i128;
    (0..=n)
        .map(|cut| {
            sum += delta[cut];
            u64::try_from(sum).unwrap_or(u64::MAX)
        })
        .collect()
}

impl fmt::Display for Graph {
    /// The textual IR dump (`pipec compile --emit ir`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "input {}", fmt_shape(&self.input_shape))?;
        for (i, (_, node)) in self.ops().enumerate() {
            let mut args = String::new();
            let ins: Vec<String> = node
                .inputs
                .iter()
                .map(|s| match s {
                    Source::Input => "input".to_string(),
                    Source::Layer(p) => format!("%{p}"),
                })
                .collect();
            let ins = ins.join(", ");
            let _ = write!(args, "{}", op_args(&node.op));
            let mut label = node.label.as_ref().map(|l| format!("  @{l}")).unwrap_or_default();
            if let Some(a) = node.tied {
                label.push_str(&format!("  tied to %{a}"));
            }
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
        Op::MaxPool2d { kernel, stride, padding } | Op::AvgPool2d { kernel, stride, padding } => {
            if *padding > 0 {
                format!("[k={kernel}, s={stride}, p={padding}]")
            } else {
                format!("[k={kernel}, s={stride}]")
            }
        }
        Op::AdaptiveAvgPool2d { size } => format!("[{size}x{size}]"),
        Op::BatchNorm2d { channels } => format!("[{channels}]"),
        Op::Add { .. } | Op::Concat { .. } => String::new(),
        Op::LayerNorm { dim, eps } => {
            if *eps == pipec_plan::model::DEFAULT_EPS {
                format!("[{dim}]")
            } else {
                format!("[{dim}, eps={eps}]")
            }
        }
        Op::SeqPool { how } => format!("[{how}]"),
        Op::RmsNorm { dim, eps } => {
            if *eps == pipec_plan::model::DEFAULT_EPS {
                format!("[{dim}]")
            } else {
                format!("[{dim}, eps={eps}]")
            }
        }
        Op::Dropout { p } => format!("[p={p}]"),
        Op::Embedding { vocab, dim, types, sep } => {
            let types = if *types > 0 { format!(", types={types}") } else { String::new() };
            let sep = sep.map(|s| format!(", sep={s}")).unwrap_or_default();
            format!("[{vocab}x{dim}{types}{sep}]")
        }
        Op::TransformerBlock { d_model, heads, d_ff, causal, .. } => {
            // the GPT block's arguments, then only what differs from it
            let mut extra = String::new();
            if let Some(b) = op.block_dims() {
                if b.kv_heads != b.heads {
                    extra += &format!(", kv_heads={}", b.kv_heads);
                }
                if b.norm != pipec_plan::model::NormKind::LayerNorm {
                    extra += &format!(", {}", b.norm);
                }
                if b.mlp != pipec_plan::model::MlpKind::Gelu {
                    extra += &format!(", {}", b.mlp);
                }
                if b.rope != 0.0 {
                    extra += &format!(", rope={}", b.rope);
                }
                if !b.bias {
                    extra += if b.qkv_bias { ", qkv bias only" } else { ", no bias" };
                }
                if b.post_norm {
                    extra += ", post-norm";
                }
            }
            format!("[d={d_model}, heads={heads}, ff={d_ff}{}{extra}]", if *causal { ", causal" } else { "" })
        }
        Op::PosEmbedding { max_len, dim } => format!("[{max_len}x{dim}]"),
        Op::Lstm { input, hidden } => format!("[{input}->{hidden}]"),
        Op::Flatten | Op::Relu | Op::Gelu | Op::GeluTanh | Op::Tanh | Op::Sigmoid => String::new(),
    }
}
