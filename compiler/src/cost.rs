//! The cost model: what each layer costs on one device, per microbatch.
//!
//! Every layer's forward and backward are decomposed into kernels — matrix products, and
//! memory-bound element-wise work (norms, softmax, activations, dropout, adds, embedding
//! gathers) — each priced on the resource it is bound by (`DeviceModel::matrix_time`,
//! `DeviceModel::vector_time`: the slower of its FLOPs at the device's rate for its
//! precision and kind, and its bytes at the memory bandwidth, each at the efficiency of a
//! kernel that size, plus a launch). A transformer block is Megatron-LM's: QKV projection,
//! attention (scores, softmax, dropout, weighted sum; or one fused FlashAttention kernel),
//! output projection, two layer norms, the MLP with its GeLU, two dropout-residual adds.
//!
//! Tensor parallelism divides only what it splits (`pipec_plan::model::tp_splits`, the rule
//! the executor builds by): a transformer block's products and attention, a column/row
//! pair of linear layers; every other layer runs whole on each rank. A split layer's
//! collectives (Megatron's all-reduces, or with sequence parallelism reduce-scatters and
//! all-gathers) are listed per pass for the plan's cost model to price on the group's link.
//!
//! Activation accounting follows what autograd keeps: the input of every operator with
//! weights or a non-linearity, a one-byte mask for dropout, nothing for `flatten`; for a
//! transformer block Korthikanti et al. 2022 (34·s·h + 5·a·s² bytes per sample at 16-bit,
//! (10 + 24/t)·s·h + 5·a·s²/t with tensor parallelism t, (34·s·h + 5·a·s²)/t with sequence
//! parallelism), the 5·a·s² attention core dropped by flash attention or selective
//! recompute. The optimizer step is priced as the memory traffic it is.

use pipec_plan::device::Function;
use pipec_plan::engine::performance::Convolution;
use pipec_plan::model::{Op, TpSplit};
use pipec_plan::vocab::{Attention, CpComm, Loss, OptimizerKind, Precision, RecomputeModule};
use pipec_plan::CollectiveKind;

use crate::activations::{block_kept, BlockContext, Kept, Made, Policy};
use crate::block_cost::{price_block, BlockPriced, Part};
use crate::ir::{Graph, OpNode};
pub use crate::kernels::CostContext;
use crate::kernels::{Keeps, Kernels};

/// What one layer costs, per microbatch of `microbatch_size` samples, on one
/// tensor-parallel rank.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCost {
    /// The whole layer's FLOPs per sample (all ranks together), for reports.
    pub forward_flops_per_sample: f64,
    pub backward_flops_per_sample: f64,
    /// The forward's kernels (and the spec's per-pass `overhead`).
    pub forward_s: f64,
    /// The backward's kernels (input and weight gradients).
    pub backward_s: f64,
    /// The part of `backward_s` that is weight gradients: what the weight pass of a split
    /// backward runs; the input pass runs the rest.
    pub backward_weights_s: f64,
    /// What selective recompute adds to the backward: the attention core's forward again.
    pub selective_s: f64,
    /// A transformer block's attention core (scores, softmax, weighted sum; or the fused
    /// kernel) in its forward and its backward: what a context-parallel ring's transfers
    /// run under.
    pub core_s: [f64; 2],
    /// The tensor-parallel collectives a forward and a backward wait for: (kind, bytes
    /// per member) over the layer's group.
    pub tp_forward: Vec<(CollectiveKind, u64)>,
    pub tp_backward: Vec<(CollectiveKind, u64)>,
    /// Expert parallelism: the all-to-alls a forward and a backward wait for (the dispatch
    /// and the combine; backward their gradients'), bytes per member over the layer's
    /// expert-parallel group.
    pub ep_forward: Vec<(CollectiveKind, u64)>,
    pub ep_backward: Vec<(CollectiveKind, u64)>,
    /// Context parallelism: a block's keys and values all-gathered over the group in a
    /// forward, their gradients reduce-scattered back in a backward (bytes per member: the
    /// gathered size); around the ring (`cp_comm: ring`) the backward passes the keys and
    /// values around again beside their gradients.
    pub cp_forward: Vec<(CollectiveKind, u64)>,
    pub cp_backward: Vec<(CollectiveKind, u64)>,
    /// One optimizer update of the layer's parameters on one rank (its memory traffic).
    pub update_s: f64,
    /// The layer's parameters, whole.
    pub parameters: u64,
    /// The parameters one tensor-parallel rank holds (of a mixture of experts, its
    /// expert-parallel share of the routed experts).
    pub shard_parameters: u64,
    /// The part of `shard_parameters` that is routed experts: their gradients are summed
    /// only over the replicas holding the same experts.
    pub expert_parameters: u64,
    /// Bytes of the parameters one rank holds, at the training precision.
    pub parameter_bytes: u64,
    /// Bytes kept for the backward, per sample, on one rank.
    pub activation_bytes_per_sample: u64,
    /// Those bytes tensor by tensor (a context-parallel member's share), what recompute
    /// policies choose from (`activations::Policy`).
    pub kept: Vec<Kept>,
    /// A transformer block's forward seconds per part (`block_cost::Part`) and per product
    /// in an eager model's order: what recompute by module or operation runs again.
    pub forward_parts: [f64; Part::COUNT],
    pub forward_products: Vec<f64>,
    /// The part of those that selective recompute drops (a block's attention core).
    pub attention_core_bytes_per_sample: u64,
    /// The part of those that is context parallelism's gathered keys and values (the
    /// all-gather keeps them; around the ring, 0).
    pub gathered_bytes_per_sample: u64,
    /// Bytes of the output, per sample (whole).
    pub output_bytes_per_sample: u64,
    /// The last layer only: bytes the loss keeps for its backward, per sample, on one rank
    /// (what the engine's cross-entropy keeps of the logits,
    /// `pipec_plan::engine::performance::CrossEntropy`; with the vocabulary split, this
    /// rank's part).
    pub loss_input_bytes_per_sample: u64,
    /// The last layer only: bytes the loss holds beside those at its widest point, per
    /// sample, on one rank (its fp32 copies and gradients).
    pub loss_transient_bytes_per_sample: u64,
}

impl LayerCost {
    /// Adds `other`'s work to this layer's: its passes, collectives, parameters and kept
    /// tensors (multi-token prediction's modules, priced with the output layer that runs
    /// them). The output this layer sends on stays its own.
    fn absorb(&mut self, other: LayerCost) {
        self.forward_flops_per_sample += other.forward_flops_per_sample;
        self.backward_flops_per_sample += other.backward_flops_per_sample;
        self.forward_s += other.forward_s;
        self.backward_s += other.backward_s;
        self.backward_weights_s += other.backward_weights_s;
        self.selective_s += other.selective_s;
        for (a, b) in self.core_s.iter_mut().zip(other.core_s) {
            *a += b;
        }
        self.tp_forward.extend(other.tp_forward);
        self.tp_backward.extend(other.tp_backward);
        self.ep_forward.extend(other.ep_forward);
        self.ep_backward.extend(other.ep_backward);
        self.cp_forward.extend(other.cp_forward);
        self.cp_backward.extend(other.cp_backward);
        self.update_s += other.update_s;
        self.parameters += other.parameters;
        self.shard_parameters += other.shard_parameters;
        self.expert_parameters += other.expert_parameters;
        self.parameter_bytes += other.parameter_bytes;
        self.activation_bytes_per_sample += other.activation_bytes_per_sample;
        self.kept.extend(other.kept);
        for (a, b) in self.forward_parts.iter_mut().zip(other.forward_parts) {
            *a += b;
        }
        self.forward_products.extend(other.forward_products);
        self.attention_core_bytes_per_sample += other.attention_core_bytes_per_sample;
        self.gathered_bytes_per_sample += other.gathered_bytes_per_sample;
        self.loss_input_bytes_per_sample += other.loss_input_bytes_per_sample;
        self.loss_transient_bytes_per_sample += other.loss_transient_bytes_per_sample;
    }

    /// Drops the parameters: a layer whose weights another holds (multi-token prediction's
    /// embedding lookup and output layer are the model's own).
    fn own_nothing(&mut self) {
        (self.parameters, self.shard_parameters, self.expert_parameters, self.parameter_bytes) = (0, 0, 0, 0);
        self.update_s = 0.0;
    }
}

/// Multi-token prediction's layers (`pipec_plan::model::Mtp::layers`) as nodes over the
/// model's positions, with whether each holds its own weights.
pub fn mtp_nodes(graph: &Graph, mtp: pipec_plan::model::Mtp) -> Vec<(OpNode, bool)> {
    let Some(&s) = graph.input_shape.first() else { return Vec::new() };
    let ops: Vec<&Op> = graph.ops().map(|(_, n)| &n.op).collect();
    mtp.layers(ops.iter().copied())
        .into_iter()
        .map(|(op, own)| {
            let (input, output) = match op {
                Op::Embedding { dim, .. } => (vec![s], vec![s, dim]),
                Op::Linear { in_features, out_features, .. } => (vec![s, in_features], vec![s, out_features]),
                Op::RmsNorm { dim, .. } => (vec![s, dim], vec![s, dim]),
                _ => {
                    let d = op.block_dims().map_or(0, |b| b.d);
                    (vec![s, d], vec![s, d])
                }
            };
            let node = OpNode {
                op,
                label: None,
                inputs: vec![pipec_plan::model::Source::Input],
                input_shape: input,
                output_shape: output,
                tied: None,
            };
            (node, own)
        })
        .collect()
}

fn numel(shape: &[usize]) -> f64 {
    shape.iter().product::<usize>() as f64
}

/// A device's share of a microbatch, in samples: with context parallelism 1/cp of every
/// sample's positions (queries; attention reads every key), which costs what 1/cp of the
/// samples would — each layer's work and what it keeps are per position, and a position's
/// attention over the whole sequence is the same on any member.
fn device_samples(cx: &CostContext<'_>) -> f64 {
    cx.microbatch.max(1) as f64 / cx.cp.max(1) as f64
}

/// Forward FLOPs per sample of the whole layer.
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
        // every input element is summed once into its window's average
        Op::AdaptiveAvgPool2d { .. } => inp,
        // mean, variance, normalise, scale and shift
        Op::BatchNorm2d { .. } => 5.0 * inp,
        Op::Add { inputs } => (inputs.saturating_sub(1)) as f64 * out,
        Op::Flatten | Op::Concat { .. } => 0.0,
        Op::Relu | Op::Dropout { .. } => inp,
        Op::Gelu | Op::GeluTanh | Op::Tanh | Op::Sigmoid => 8.0 * inp,
        Op::LayerNorm { .. } => 5.0 * inp,
        // square, mean, reciprocal root, scale
        Op::RmsNorm { .. } => 4.0 * inp,
        // the row look-up, and the token-type row added to it
        Op::Embedding { types, .. } => out * if types > 0 { 2.0 } else { 1.0 },
        Op::PosEmbedding { .. } => inp,
        // the first position is a copy; the mean sums every element once
        Op::SeqPool { how } => match how {
            pipec_plan::model::Pooling::First => 0.0,
            pipec_plan::model::Pooling::Mean => inp,
        },
        Op::Lstm { input, hidden } => {
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            let (i, h) = (input as f64, hidden as f64);
            // per step: the gate pre-activations x·W_ih + h·W_hh (+ two biases), then the
            // gates' non-linearities and the cell and hidden updates (~30 per hidden unit)
            s * (2.0 * 4.0 * h * (i + h) + 2.0 * 4.0 * h + 30.0 * h)
        }
        Op::TransformerBlock { .. } => {
            let Some(blk) = node.op.block_dims() else { return 0.0 };
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            let (d, f, up) = (blk.d as f64, blk.ff as f64, blk.up_width as f64);
            // the attention's projections, 2·s·in·out each (GPT's block: QKV 6·s·d², output
            // 2·s·d²); scores and weighted sum over the attended keys, 2·s·keys·heads·(qk +
            // v head) (GPT's block: 4·s²·d); the MLP 2·s·d·up + 2·s·f·d; a mixture of experts:
            // the router 2·s·d·E and each token's active experts' MLPs
            let projections: f64 = blk.projections().iter().map(|p| 2.0 * s * p.input as f64 * p.output as f64).sum();
            let keys = blk.attended(s as usize) as f64;
            let core = 2.0 * s * keys * blk.heads as f64 * (blk.qk_head + blk.v_head) as f64;
            let (mlps, router) =
                blk.moe.map_or((1.0, 0.0), |m| (m.active_experts() as f64, 2.0 * s * d * m.experts as f64));
            projections + core + router + mlps * (2.0 * s * d * up + 2.0 * s * f * d)
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

/// Bytes kept for the backward, per sample, of the whole layer (one rank of no
/// tensor parallelism, standard attention, no dropout).
pub fn activation_bytes(node: &OpNode, precision_bytes: usize) -> u64 {
    let p = precision_bytes as f64;
    let cx = KeptContext {
        p,
        linear_input: p,
        t: 1,
        sp: false,
        attention: Attention::Standard,
        ep: 1,
        keeps: Keeps::default(),
    };
    kept_list(node, &cx).iter().filter(|k| k.read).map(|k| k.bytes).sum::<f64>() as u64
}

/// What the layers' kept tensors depend on besides the layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeptContext {
    pub(crate) p: f64,
    /// Bytes per value a block's linear layers keep of their inputs.
    pub(crate) linear_input: f64,
    /// The degree the layer is split over (1: replicated).
    pub(crate) t: usize,
    pub(crate) sp: bool,
    pub(crate) attention: Attention,
    pub(crate) ep: usize,
    /// `CostContext::keeps`.
    pub(crate) keeps: Keeps,
}

/// The tensors one rank keeps for the layer's backward, per sample: a transformer block's
/// as `activations::block_kept` lists them, any other layer's as one entry.
pub(crate) fn kept_list(node: &OpNode, cx: &KeptContext) -> Vec<Kept> {
    let one = |bytes: f64| {
        vec![Kept {
            name: "layer input",
            modules: &[],
            made: Made::Other,
            bytes,
            gradient: 0.0,
            read: true,
            within: crate::activations::Within::Input,
        }]
    };
    let inp = numel(&node.input_shape);
    let p = cx.p;
    match node.op {
        // the gradient passes through unchanged (add) or is sliced (concat, flatten)
        Op::Flatten | Op::Add { .. } | Op::Concat { .. } | Op::AdaptiveAvgPool2d { .. } | Op::SeqPool { .. } => {
            Vec::new()
        }
        // the table's gradient is the output gradient itself
        Op::PosEmbedding { .. } => Vec::new(),
        // per step: the input, the four gates, the cell state and its tanh, the hidden state
        Op::Lstm { input, hidden } => {
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            one(s * (input as f64 + 7.0 * hidden as f64) * p)
        }
        Op::Dropout { .. } => one(inp),         // one-byte mask
        Op::Embedding { .. } => one(inp * 8.0), // token ids
        Op::TransformerBlock { .. } => match node.op.block_dims() {
            Some(b) => {
                let block = BlockContext {
                    s: node.input_shape.first().copied().unwrap_or(1) as f64,
                    p,
                    linear_input: cx.linear_input,
                    t: cx.t.max(1) as f64,
                    sp: cx.sp,
                    attention: cx.attention,
                    ep: cx.ep,
                    dropout: b.dropout > 0.0,
                    keeps: cx.keeps,
                };
                block_kept(&b, &block)
            }
            None => Vec::new(),
        },
        _ => one(inp * p),
    }
}

/// Bytes one rank keeps for the backward per sample, and the part of them that is a
/// transformer block's attention core (what selective recompute drops).
fn kept_bytes(node: &OpNode, cx: &KeptContext) -> (f64, f64) {
    let list = kept_list(node, cx);
    let core = Policy::Modules(vec![RecomputeModule::CoreAttn]).split(&list).1;
    (Policy::None.split(&list).0, core)
}

/// A layer's forward and backward kernels, the selective-recompute addition, and the
/// attention core's part of the forward and the backward.
#[derive(Default)]
struct Priced {
    forward: f64,
    backward: f64,
    /// The part of `backward` that is weight gradients (`Kernels::weights`).
    backward_weights: f64,
    selective: f64,
    core: [f64; 2],
    /// A transformer block's forward by part and by product (what recompute runs again).
    block: Option<BlockPriced>,
}

/// Prices one layer's passes on one rank: `first` is the model's first layer, whose input
/// is data — its backward computes no input gradient (autograd skips it; so does the
/// executor); `last` adds the loss.
fn price(node: &OpNode, split: TpSplit, (first, last): (bool, bool), cx: &CostContext<'_>) -> Priced {
    let b = device_samples(cx);
    let mut core_s = [0.0; 2];
    let mut block = None;
    let p = cx.precision.bytes() as f64;
    let new = || Kernels::of(cx, p);
    let (mut fwd, mut bwd, mut sel) = (new(), new(), new());
    let inp = numel(&node.input_shape) * b;
    let out = numel(&node.output_shape) * b;
    let t = t_of(split, cx.tp);
    match node.op {
        Op::Linear { in_features, out_features, .. } => {
            let rows = inp / in_features as f64;
            let (i, o) = (in_features as f64, out_features as f64);
            let flops = 2.0 * rows * i * o / t;
            let values = rows * i / if split == TpSplit::Row { t } else { 1.0 }
                + i * o / t
                + rows * o / if matches!(split, TpSplit::Column | TpSplit::Vocab) { t } else { 1.0 };
            fwd.matrix(flops, values);
            // the input gradient (not for the model's input) and the weight gradient
            if !first {
                bwd.input_gradient(flops, values);
            }
            bwd.weight_gradient(flops, values);
        }
        Op::Conv2d { in_channels, out_channels, kernel, .. } => {
            let flops = forward_flops(node) * b;
            let weights = (in_channels * out_channels * kernel * kernel) as f64;
            match cx.convolution {
                Convolution::Direct => {
                    fwd.matrix(flops, inp + weights + out);
                    if !first {
                        bwd.matrix(flops, inp + weights + out);
                    }
                    bwd.weight_pass(|k| k.matrix(flops, inp + weights + out));
                }
                Convolution::Patches => {
                    // the patch matrix: C·k² values per output position per sample
                    let patches = out / out_channels as f64 * (in_channels * kernel * kernel) as f64;
                    let lay_out = |k: &mut Kernels| k.vector(0.0, 2.0 * patches, 0.0);
                    lay_out(&mut fwd);
                    fwd.matrix(flops, patches + weights + out);
                    fwd.vector(0.0, 2.0 * out, 0.0);
                    // the output's gradient as [C_out, samples·positions], the weights'
                    // gradient over the patches laid out again
                    bwd.vector(0.0, 2.0 * out, 0.0);
                    bwd.weight_pass(|k| {
                        lay_out(k);
                        k.matrix(flops, out + patches + weights);
                    });
                    if !first {
                        // the patches' gradient, added back into the input's
                        bwd.matrix(flops, weights + out + patches);
                        bwd.vector(patches, patches + 2.0 * inp, 0.0);
                    }
                }
            }
        }
        Op::Lstm { input, hidden } => {
            let steps = node.input_shape.first().copied().unwrap_or(1).max(1);
            let (i, h) = (input as f64, hidden as f64);
            for _ in 0..steps {
                fwd.matrix(2.0 * b * 4.0 * h * (i + h), b * (i + h) + 4.0 * h * (i + h) + 4.0 * h * b);
                fwd.vector(30.0 * h * b, 8.0 * h * b, 0.0);
                bwd.matrix(2.0 * b * 4.0 * h * (i + h), b * (i + h) + 4.0 * h * (i + h) + 4.0 * h * b);
                bwd.weight_pass(|k| {
                    k.matrix(2.0 * b * 4.0 * h * (i + h), b * (i + h) + 4.0 * h * (i + h) + 4.0 * h * b)
                });
                bwd.vector(30.0 * h * b, 12.0 * h * b, 0.0);
            }
        }
        Op::TransformerBlock { .. } => {
            let Some(blk) = node.op.block_dims() else {
                return Priced::default();
            };
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            let priced = price_block(&blk, s, t, b, cx);
            fwd.seconds += priced.forward;
            bwd.seconds += priced.backward;
            bwd.weights += priced.backward_weights;
            sel.seconds += priced.selective;
            core_s = priced.core;
            block = Some(priced);
        }
        _ => {
            // element-wise, normalisation, pooling, joins, embeddings: memory-bound
            let flops = forward_flops(node) * b;
            let bwd_flops = backward_flops(node) * b;
            let reads = match node.op {
                Op::Add { inputs } | Op::Concat { inputs } => inputs as f64 * out,
                Op::Embedding { .. } | Op::PosEmbedding { .. } => out,
                Op::BatchNorm2d { .. } => 2.0 * inp,
                _ => inp,
            };
            let mask = if matches!(node.op, Op::Dropout { .. }) { inp } else { 0.0 };
            let function = match node.op {
                Op::Gelu => Some(Function::Gelu),
                Op::GeluTanh => Some(Function::GeluTanh),
                Op::Sigmoid => Some(Function::Silu),
                Op::Tanh => Some(Function::Tanh),
                _ => None,
            };
            match function {
                // one function value per element (masks: dropout only, not here); the
                // gradient at its measured rate, else GELU's evaluating its function again
                // and tanh's and the logistic's reading their output
                Some(f) => {
                    fwd.function(f, inp, flops, reads + out);
                    bwd.function_grad(f, inp, bwd_flops, reads + 2.0 * out);
                }
                None if !matches!(node.op, Op::Flatten) => {
                    fwd.vector(flops, reads + out, mask);
                    bwd.vector(bwd_flops, reads + 2.0 * out, mask);
                }
                None => {}
            }
        }
    }
    if last && cx.loss == Loss::CrossEntropy {
        // the cross-entropy over this rank's logits, in fp32: forward the cast, maximum,
        // exponentials, their sum and the target's log-probability (about six passes);
        // backward softmax minus the one-hot target, scaled (three)
        let n = out / t_of(split, cx.tp);
        let fp32 = 4.0 / p;
        // (at the device's measured rates of the loss where it has them: the CPU executor's
        // fused kernel)
        fwd.function(Function::CrossEntropy, n, 8.0 * n, 6.0 * n * fp32);
        bwd.function_grad(Function::CrossEntropy, n, 3.0 * n, 3.0 * n * fp32);
    }
    Priced {
        forward: fwd.seconds + cx.overhead,
        backward: bwd.seconds + cx.overhead_backward,
        backward_weights: bwd.weights,
        selective: sel.seconds,
        core: core_s,
        block,
    }
}

/// The degree a split layer divides by (1 for a replicated one).
fn t_of(split: TpSplit, tp: usize) -> f64 {
    match split {
        TpSplit::Replicated => 1.0,
        _ => tp.max(1) as f64,
    }
}

/// The collectives a split layer's forward and backward wait for on one rank: Megatron's
/// all-reduces (a block: two each way; a pair: the row half's output forward, the column
/// half's input gradient backward), or with sequence parallelism a block's all-gathers and
/// reduce-scatters (two each forward; backward the gradients' two and two, and the two
/// inputs gathered again for the weight gradients, as Megatron-LM does rather than keep them).
type Collectives = Vec<(CollectiveKind, u64)>;

fn tp_collectives(node: &OpNode, split: TpSplit, cx: &CostContext<'_>) -> (Collectives, Collectives) {
    // a rank's looked-up rows summed (forward); the output layer's three per-token sums
    // for the cross-entropy (maximum, sum of exponentials, target logit; fp32) forward, its
    // input gradient summed backward
    let vocab = |cx: &CostContext<'_>| {
        let b = device_samples(cx);
        let p = cx.precision.bytes() as f64;
        let bytes = |values: f64| (values * b * p) as u64;
        match node.op {
            Op::Embedding { .. } => (vec![(CollectiveKind::AllReduce, bytes(numel(&node.output_shape)))], Vec::new()),
            _ => {
                let rows = numel(&node.input_shape) / node.input_shape.last().copied().unwrap_or(1).max(1) as f64;
                let scalars = (rows * b * 4.0) as u64;
                (
                    vec![(CollectiveKind::AllReduce, scalars); 3],
                    vec![(CollectiveKind::AllReduce, bytes(numel(&node.input_shape)))],
                )
            }
        }
    };
    use CollectiveKind::{AllGather, AllReduce, ReduceScatter};
    if cx.tp <= 1 {
        return (Vec::new(), Vec::new());
    }
    let p = cx.precision.bytes() as f64;
    let b = device_samples(cx);
    let bytes = |values: f64| (values * b * p) as u64;
    // sequence parallelism: each all-gather at the bytes the engine gathers (FP8 under
    // torchao's Float8 tensor parallelism), and backward per column-split input its
    // gradient's reduce-scatter, after the output gradient's gather, and unless the engine
    // keeps the gathered input its gather again for the weight gradient
    let sequence = |values: f64, columns: usize| {
        let x = bytes(values);
        let g = (values * b * cx.sequence_gather_bytes(p)) as u64;
        let regather = if cx.sequence_collectives.keeps_gathered { 0 } else { columns };
        let backward: Collectives = std::iter::repeat_n([(AllGather, g), (ReduceScatter, x)], columns)
            .flatten()
            .chain(std::iter::repeat_n((AllGather, g), regather))
            .collect();
        (std::iter::repeat_n([(AllGather, g), (ReduceScatter, x)], columns).flatten().collect(), backward)
    };
    match split {
        // whole experts without shared ones (`etp: 1`): the routed experts take each rank's
        // sequence share as it is, so only the attention's gather and scatter remain
        TpSplit::Block if cx.sequence_parallel && cx.whole_experts && node.op.moe().is_some_and(|m| m.shared == 0) => {
            sequence(numel(&node.input_shape), 1)
        }
        TpSplit::Block => {
            let x = bytes(numel(&node.input_shape));
            if cx.sequence_parallel {
                sequence(numel(&node.input_shape), 2)
            } else {
                (vec![(AllReduce, x), (AllReduce, x)], vec![(AllReduce, x), (AllReduce, x)])
            }
        }
        TpSplit::Column => (Vec::new(), vec![(AllReduce, bytes(numel(&node.input_shape)))]),
        TpSplit::Vocab => vocab(cx),
        TpSplit::Row => (vec![(AllReduce, bytes(numel(&node.output_shape)))], Vec::new()),
        TpSplit::Replicated => (Vec::new(), Vec::new()),
    }
}

/// Expert parallelism's all-to-alls inside a mixture-of-experts block's passes, over its
/// `ep` members: forward the dispatch (each routed pair's input to its expert's member) and
/// the combine (the expert's output back); backward the gradients of both, the other way.
/// Bytes per member: what the busiest member receives under the routing assumption (each
/// sends its routed pairs' rows; uniform routing receives as many) — per tensor-parallel
/// rank its sequence share with sequence parallelism, all of its tokens without.
fn ep_collectives(node: &OpNode, sp: bool, t: usize, cx: &CostContext<'_>) -> (Collectives, Collectives) {
    let ep = cx.ep.max(1);
    let Some(m) = node.op.moe().filter(|_| ep > 1) else {
        return (Vec::new(), Vec::new());
    };
    let s = node.input_shape.first().copied().unwrap_or(1) as f64;
    let h = node.input_shape.last().copied().unwrap_or(1) as f64;
    // a member's tokens (context parallelism: its positions of the microbatch)
    let tokens = device_samples(cx) * s;
    // whole experts: each rank routes its sequence share over the group's ep · t devices
    let (tokens, n, share) = if cx.whole_experts && t > 1 {
        (tokens / t as f64, cx.load_members(t), 1.0)
    } else {
        (tokens, ep, if sp { t.max(1) as f64 } else { 1.0 })
    };
    let rows = m.routed_pairs(tokens).max(m.busiest_device_pairs(tokens, n) * n as f64);
    let bytes = (rows * h * cx.precision.bytes() as f64 / share) as u64;
    let both = vec![(CollectiveKind::AllToAll, bytes); 2];
    (both.clone(), both)
}

/// Context parallelism's exchanges inside a transformer block's passes, over its `cp`
/// members: forward the keys and values of the whole sequence all-gathered (each member
/// contributes its positions'), backward their gradients reduce-scattered back to the
/// members that computed them. Bytes per member: the gathered keys and values of the
/// microbatch on one tensor-parallel rank.
fn cp_collectives(node: &OpNode, t: usize, cx: &CostContext<'_>) -> (Collectives, Collectives) {
    let Some(blk) = node.op.block_dims().filter(|_| cx.cp > 1) else {
        return (Vec::new(), Vec::new());
    };
    let s = node.input_shape.first().copied().unwrap_or(1) as f64;
    let kv = blk.kv_exchange_width() as f64;
    let bytes = (cx.microbatch.max(1) as f64 * s * kv * cx.precision.bytes() as f64 / t.max(1) as f64) as u64;
    let mut forward = vec![(CollectiveKind::AllGather, bytes)];
    // a mixture of experts whose capacity or balancing loss counts the whole microbatch:
    // the members' routing counts (f32, per sample, chunk and expert) gathered as well
    if let Some(m) = blk.moe.filter(|m| m.capacity > 0.0 || m.aux_loss != 0.0) {
        let counts = cx.microbatch.max(1) * 2 * cx.cp * m.experts * 4;
        forward.push((CollectiveKind::AllGather, counts as u64));
    }
    let backward = match cx.cp_comm {
        CpComm::AllGather => vec![(CollectiveKind::ReduceScatter, bytes)],
        // the ring again in the backward: the keys and values a block at a time beside
        // their gradients going the other way (Transformer Engine's ring attention keeps
        // only the member's own)
        CpComm::Ring => vec![(CollectiveKind::AllGather, bytes), (CollectiveKind::ReduceScatter, bytes)],
    };
    (forward, backward)
}

/// Bytes a context-parallel member keeps per sample of what one device keeps (`kept`):
/// 1/cp of it (its positions), and with the all-gather a block's keys and values gathered
/// from the others (around the ring, only its own, which `kept` counts); and that gathered
/// part alone.
fn context_kept(kept: f64, node: &OpNode, p: f64, t: usize, cx: &CostContext<'_>) -> (f64, f64) {
    let cp = cx.cp.max(1) as f64;
    if cx.cp_comm == CpComm::Ring {
        return (kept / cp, 0.0);
    }
    let gathered = node.op.block_dims().map_or(0.0, |blk| {
        let s = node.input_shape.first().copied().unwrap_or(1) as f64;
        blk.kv_exchange_width() as f64 * s * p / t.max(1) as f64 * (1.0 - 1.0 / cp)
    });
    (kept / cp + gathered, gathered)
}

/// The parameters one rank holds, and the part of them that is routed experts: its
/// tensor-parallel shard of the layer, of a mixture of experts' routed experts only its
/// expert-parallel share (1/ep of them).
fn rank_parameters(op: &Op, split: TpSplit, tp: usize, ep: usize) -> (u64, u64) {
    let t = if split == TpSplit::Replicated { 1 } else { tp.max(1) } as u64;
    let experts_whole = op.routed_expert_parameter_count() / t;
    let experts = experts_whole / ep.max(1) as u64;
    (shard_parameters(op, split, tp).saturating_sub(experts_whole) + experts, experts)
}

/// The parameters one rank of a `tp`-way split holds.
fn shard_parameters(op: &Op, split: TpSplit, tp: usize) -> u64 {
    let whole = op.parameter_count();
    let t = tp.max(1) as u64;
    match (split, op) {
        (TpSplit::Replicated, _) => whole,
        (TpSplit::Block, Op::TransformerBlock { .. }) => {
            // the norms, the row-parallel biases and the duplicated products are whole
            let whole_part = op.block_dims().map_or(0, |b| b.unsplit_parameters()) as u64;
            whole_part + (whole - whole_part.min(whole)) / t
        }
        (TpSplit::Column | TpSplit::Vocab, Op::Linear { .. }) => whole / t,
        (TpSplit::Vocab, Op::Embedding { .. }) => whole / t,
        // a row-parallel layer's bias is whole on every rank
        (TpSplit::Row, Op::Linear { in_features, out_features, .. }) => {
            let w = (in_features * out_features) as u64;
            w / t + whole.saturating_sub(w)
        }
        _ => whole / t,
    }
}

/// Bytes one optimizer update moves per parameter: the weights (an fp32 master copy read
/// and written; under mixed precision the low-precision copy written too; without master
/// weights the low-precision weights alone, read and written), the gradient read, and the
/// state read and written (Adam: two moments, momentum: one).
pub fn update_bytes_per_parameter(
    optimizer: OptimizerKind,
    precision: Precision,
    grad: Precision,
    state: Precision,
    master: bool,
) -> f64 {
    let states = match optimizer {
        OptimizerKind::Adam | OptimizerKind::AdamW => 2.0,
        OptimizerKind::Momentum => 1.0,
        OptimizerKind::Sgd => 0.0,
    };
    let weights = match (precision, master) {
        (Precision::Fp32, _) => 8.0,
        (_, true) => 8.0 + precision.bytes() as f64,
        (_, false) => 2.0 * precision.bytes() as f64,
    };
    weights + grad.bytes() as f64 + states * 2.0 * state.bytes() as f64
}

/// Costs every layer of the graph analytically, on one rank of a `cx.tp`-way split.
pub fn analytic_costs(graph: &Graph, cx: &CostContext<'_>) -> Result<Vec<LayerCost>, String> {
    let p = graph.precision_bytes;
    let ops: Vec<Op> = graph.ops().map(|(_, node)| node.op.clone()).collect();
    let splits = pipec_plan::model::stage_tp_splits(&ops, 0..ops.len(), cx.loss, cx.tp)?;
    let count = ops.len();
    let update_bytes = update_bytes_per_parameter(
        cx.optimizer,
        cx.precision,
        cx.grad_precision,
        cx.state_precision,
        cx.master_weights,
    );
    let streamed = sequence_stream(&splits, cx.sequence_parallel);
    let mut costs: Vec<LayerCost> = graph
        .ops()
        .zip(&splits)
        .enumerate()
        .map(|(i, ((_, node), &split))| {
            layer_cost(node, (split, streamed[i]), (i == 0, i + 1 == count), (p, update_bytes), cx)
        })
        .collect();
    // multi-token prediction runs after the output layer's forward, on its stage, and shares
    // its weights: its modules are priced as part of that layer
    if let (Some(mtp), Some(head), Some(&head_split)) = (graph.mtp, costs.last_mut(), splits.last()) {
        for (node, own) in mtp_nodes(graph, mtp) {
            let split = match node.op {
                Op::TransformerBlock { .. } => TpSplit::Block,
                Op::Linear { .. } if !own => head_split,
                Op::Linear { .. } => TpSplit::Column,
                Op::Embedding { .. } if head_split == TpSplit::Vocab => TpSplit::Vocab,
                _ => TpSplit::Replicated,
            };
            let scores = matches!(node.op, Op::Linear { .. }) && !own;
            let mut c = layer_cost(&node, (split, false), (false, scores), (p, update_bytes), cx);
            if !own {
                c.own_nothing();
            }
            head.absorb(c);
        }
    }
    Ok(costs)
}

/// Which layers run on each rank's share of the sequence under sequence parallelism: the
/// replicated layers between the blocks and the output layer (a language model's final
/// norm), whose input and output the engines keep split along the sequence (Megatron-LM's
/// `final_layernorm` on the scattered hidden states, torchtitan's `SequenceParallel` norm).
fn sequence_stream(splits: &[TpSplit], sequence_parallel: bool) -> Vec<bool> {
    (0..splits.len())
        .map(|i| {
            sequence_parallel
                && splits[i] == TpSplit::Replicated
                && splits[..i].contains(&TpSplit::Block)
                && splits[i + 1..]
                    .iter()
                    .find(|&&s| s != TpSplit::Replicated)
                    .is_some_and(|&s| matches!(s, TpSplit::Block | TpSplit::Vocab))
        })
        .collect()
}

/// One layer's costs on one rank: `node` split `split` (`streamed`: on the rank's share of
/// the sequence, [`sequence_stream`]), (`first`, `last`) its place in the model, `p` bytes a
/// value, `update_bytes` an update's bytes per parameter.
fn layer_cost(
    node: &OpNode,
    (split, streamed): (TpSplit, bool),
    (first, last): (bool, bool),
    (p, update_bytes): (usize, f64),
    cx: &CostContext<'_>,
) -> LayerCost {
    let mut priced = price(node, split, (first, last), cx);
    // the share of its rows a rank keeps of the layer's input: its sequence share in the
    // sequence-parallel stream, and of the output layer's input under sequence parallelism
    // unless the engine keeps the gathered input for the weight gradient (Megatron-LM keeps
    // its share and gathers again in the backward; torchtitan keeps the gathered input)
    let gathered_input = split == TpSplit::Vocab
        && matches!(node.op, Op::Linear { .. })
        && cx.sequence_parallel
        && !cx.sequence_collectives.keeps_gathered;
    let rows = if streamed || gathered_input { cx.tp.max(1) as f64 } else { 1.0 };
    if streamed {
        priced.forward /= rows;
        priced.backward /= rows;
        priced.backward_weights /= rows;
        priced.selective /= rows;
    }
    let (tp_forward, tp_backward) = tp_collectives(node, split, cx);
    let t = if split == TpSplit::Replicated { 1 } else { cx.tp };
    let sp = cx.sequence_parallel && split == TpSplit::Block;
    let (ep_forward, ep_backward) = ep_collectives(node, sp, t, cx);
    let params = node.op.parameter_count();
    let (shard, experts) = rank_parameters(&node.op, split, cx.tp, cx.ep);
    let kept_cx = KeptContext {
        p: p as f64,
        linear_input: cx.linear_input_bytes(p as f64),
        t,
        sp,
        attention: cx.attention_kernel(),
        ep: cx.load_members(t),
        keeps: cx.keeps_of_block(sp),
    };
    let cp = cx.cp.max(1) as f64;
    // a context-parallel member keeps 1/cp of every tensor (its positions)
    let list: Vec<Kept> =
        kept_list(node, &kept_cx).into_iter().map(|k| Kept { bytes: k.bytes / cp / rows, ..k }).collect();
    let (kept, core) = kept_bytes(node, &kept_cx);
    let (cp_forward, cp_backward) = cp_collectives(node, t, cx);
    let (kept, gathered) = context_kept(kept / rows, node, p as f64, t, cx);
    let core = core / cp;
    let update_s = cx.device.update_time(cx.optimizer, node.op.parameter_tensors(), shard as f64, update_bytes);
    // the last layer's outputs on this rank (split over the vocabulary, or whole), and what
    // the engine's cross-entropy holds of each; another loss is counted as pipec's executor
    // holds its input
    let logits = if last {
        numel(&node.output_shape) / if split == TpSplit::Vocab { cx.tp.max(1) as f64 } else { 1.0 } / cp
    } else {
        0.0
    };
    let loss = match (cx.loss, split) {
        (Loss::CrossEntropy, TpSplit::Vocab) if cx.tp > 1 => cx.cross_entropy.split,
        (Loss::CrossEntropy, _) => cx.cross_entropy.whole,
        (Loss::Mse, _) => pipec_plan::engine::performance::CrossEntropy::Pipec,
    }
    .bytes(p as f64);
    LayerCost {
        forward_flops_per_sample: forward_flops(node),
        backward_flops_per_sample: backward_flops(node),
        forward_s: priced.forward,
        backward_s: priced.backward,
        backward_weights_s: priced.backward_weights,
        selective_s: priced.selective,
        core_s: priced.core,
        tp_forward,
        tp_backward,
        ep_forward,
        ep_backward,
        cp_forward,
        cp_backward,
        update_s,
        parameters: params,
        shard_parameters: shard,
        expert_parameters: experts,
        parameter_bytes: shard * p as u64,
        activation_bytes_per_sample: kept as u64,
        kept: list,
        forward_parts: priced.block.as_ref().map_or([0.0; Part::COUNT], |b| b.parts),
        forward_products: priced.block.map_or_else(Vec::new, |b| b.products),
        attention_core_bytes_per_sample: core as u64,
        gathered_bytes_per_sample: gathered as u64,
        output_bytes_per_sample: (numel(&node.output_shape) * p as f64 / cp) as u64,
        loss_input_bytes_per_sample: (loss.kept * logits) as u64,
        loss_transient_bytes_per_sample: (loss.transient * logits) as u64,
    }
}

pub use pipec_plan::profile::{Profile, ProfiledLayer};

/// Applying a measured profile to the analytic costs.
pub trait ApplyProfile {
    /// Replaces analytic costs with measured ones, passes scaled linearly to the microbatch
    /// size.
    fn apply(&self, costs: &mut [LayerCost], microbatch_size: usize) -> Result<(), String>;
}

impl ApplyProfile for Profile {
    fn apply(&self, costs: &mut [LayerCost], microbatch_size: usize) -> Result<(), String> {
        if self.layers.len() != costs.len() {
            return Err(format!("the profile has {} layers, the model has {}", self.layers.len(), costs.len()));
        }
        self.check()?;
        let scale = microbatch_size as f64 / self.batch_size as f64;
        for (c, l) in costs.iter_mut().zip(&self.layers) {
            c.forward_s = l.forward_ms / 1e3 * scale;
            // the weight gradients keep their analytic share of the measured backward
            let weights = if c.backward_s > 0.0 { c.backward_weights_s / c.backward_s } else { 0.0 };
            c.backward_s = l.backward_ms / 1e3 * scale;
            c.backward_weights_s = weights * c.backward_s;
            // an update's work depends on the parameters, not on the microbatch
            c.update_s = l.update_ms / 1e3;
            c.activation_bytes_per_sample = l.activation_bytes / self.batch_size as u64;
            let output = l.output_bytes / self.batch_size as u64;
            if c.output_bytes_per_sample > 0 {
                // the loss keeps what the analytic model says, scaled as the output measured
                let scaled = |b: u64| (b as f64 * output as f64 / c.output_bytes_per_sample as f64) as u64;
                c.loss_input_bytes_per_sample = scaled(c.loss_input_bytes_per_sample);
                c.loss_transient_bytes_per_sample = scaled(c.loss_transient_bytes_per_sample);
            }
            c.output_bytes_per_sample = output;
            c.parameter_bytes = l.parameter_bytes;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_plan::device::DeviceModel;
    use pipec_plan::engine::performance::{KernelFamily, OverlapSteps};
    use pipec_plan::model::Source;

    /// An fp32 SGD context on `device`: microbatch 4, cross-entropy, nothing split or
    /// overlapped, standard attention; tests override what they vary.
    fn context(device: &DeviceModel) -> CostContext<'_> {
        CostContext {
            device,
            precision: Precision::Fp32,
            grad_precision: Precision::Fp32,
            state_precision: Precision::Fp32,
            master_weights: true,
            optimizer: OptimizerKind::Sgd,
            loss: Loss::CrossEntropy,
            microbatch: 4,
            tp: 1,
            ep: 1,
            whole_experts: false,
            cp: 1,
            sequence_parallel: false,
            attention: Attention::Standard,
            cp_comm: CpComm::AllGather,
            overhead: 0.0,
            overhead_backward: 0.0,
            fp8: None,
            fused_attention: None,
            grouped_experts: false,
            experts_efficiency: 1.0,
            keeps: Keeps::default(),
            cross_entropy: Default::default(),
            tp_overlap: None,
            sequence_collectives: Default::default(),
            fp8_casts: pipec_plan::engine::performance::KernelFamily::MegatronTe.fp8_casts(),
            convolution: Default::default(),
        }
    }

    /// [`kept_bytes`] of `n` at `p` bytes a value on one of `t` ranks.
    fn kept_at(n: &OpNode, p: f64, t: usize, sp: bool, attention: Attention, ep: usize) -> (f64, f64) {
        kept_bytes(n, &KeptContext { p, linear_input: p, t, sp, attention, ep, keeps: Keeps::default() })
    }

    fn node(op: Op, input: Vec<usize>) -> OpNode {
        let output = op.output_shape(&input).expect("valid shape");
        OpNode { op, label: None, inputs: vec![Source::Input], input_shape: input, output_shape: output, tied: None }
    }

    #[test]
    fn graph_layers_flops_and_activations() {
        // batch norm on [64, 56, 56]: 5 FLOPs per element forward (mean, variance,
        // normalise, scale, shift), twice that backward (it has weights); keeps its input
        let bn = node(Op::BatchNorm2d { channels: 64 }, vec![64, 56, 56]);
        let elems = 64.0 * 56.0 * 56.0;
        assert_eq!(forward_flops(&bn), 5.0 * elems);
        assert_eq!(backward_flops(&bn), 10.0 * elems);
        assert_eq!(activation_bytes(&bn, 4), 64 * 56 * 56 * 4);
        // a residual add of two [256, 56, 56] tensors: one add per element, nothing kept
        let add = node(Op::Add { inputs: 2 }, vec![256, 56, 56]);
        assert_eq!(forward_flops(&add), 256.0 * 56.0 * 56.0);
        assert_eq!(backward_flops(&add), 256.0 * 56.0 * 56.0);
        assert_eq!(activation_bytes(&add, 4), 0);
        // concat only moves memory; global average pooling sums every input element once
        let cat = node(Op::Concat { inputs: 4 }, vec![64, 28, 28]);
        assert_eq!((forward_flops(&cat), activation_bytes(&cat, 4)), (0.0, 0));
        let gap = node(Op::AdaptiveAvgPool2d { size: 1 }, vec![2048, 7, 7]);
        assert_eq!((forward_flops(&gap), activation_bytes(&gap, 4)), (2048.0 * 49.0, 0));
        // a padded 3x3/2 max pool on [64, 112, 112]: 9 comparisons per output element
        let pool = node(Op::MaxPool2d { kernel: 3, stride: 2, padding: 1 }, vec![64, 112, 112]);
        assert_eq!(forward_flops(&pool), 9.0 * 64.0 * 56.0 * 56.0);
    }

    #[test]
    fn language_model_layers_flops_and_activations() {
        // an LSTM step on [70, 400] → 1150: the gates' two matrix products (2·4h·(in + h)),
        // their biases (2·4h), ~30 element-wise operations per hidden unit; it keeps the
        // input, the four gates, the cell state, its tanh and the hidden state per step
        let lstm = node(Op::Lstm { input: 400, hidden: 1150 }, vec![70, 400]);
        let per_step = 2.0 * 4.0 * 1150.0 * (400.0 + 1150.0) + 2.0 * 4.0 * 1150.0 + 30.0 * 1150.0;
        assert_eq!(forward_flops(&lstm), 70.0 * per_step);
        assert_eq!(backward_flops(&lstm), 2.0 * 70.0 * per_step);
        assert_eq!(activation_bytes(&lstm, 2), 70 * (400 + 7 * 1150) * 2);
        // a positional embedding adds its table: one FLOP per element, nothing kept
        let pos = node(Op::PosEmbedding { max_len: 1024, dim: 768 }, vec![1024, 768]);
        assert_eq!((forward_flops(&pos), activation_bytes(&pos, 2)), (1024.0 * 768.0, 0));
        // GPT-2's output layer on 1024 positions: 2·768·50257 FLOPs per position
        let head = node(Op::Linear { in_features: 768, out_features: 50257, bias: false }, vec![1024, 768]);
        assert_eq!(forward_flops(&head), 1024.0 * 2.0 * 768.0 * 50257.0);
    }

    #[test]
    fn linear_flops_and_activations() {
        let n = node(Op::Linear { in_features: 1024, out_features: 1024, bias: false }, vec![1024]);
        assert_eq!(forward_flops(&n), 2.0 * 1024.0 * 1024.0);
        assert_eq!(backward_flops(&n), 4.0 * 1024.0 * 1024.0);
        assert_eq!(activation_bytes(&n, 4), 4096);
    }

    #[test]
    fn a_llama_blocks_flops_count_its_narrower_keys_and_its_third_mlp_matrix() {
        let block = Op::llama_block(4096, 32, 8, 14336);
        let (s, d, f, kv) = (8192.0, 4096.0, 14336.0, 1024.0);
        // Q and O 2·s·d² each, K and V 2·s·d·kv each, scores and weighted sum 4·s²·d, the
        // gate, up and down products 2·s·d·f each: the model card's 2 × parameters per
        // token for the products, plus attention
        let expected = 2.0 * s * d * (d + 2.0 * kv) + 2.0 * s * d * d + 4.0 * s * s * d + 3.0 * 2.0 * s * d * f;
        assert_eq!(forward_flops(&node(block.clone(), vec![8192, 4096])), expected);
        assert_eq!(expected - 4.0 * s * s * d, 2.0 * s * (block.parameter_count() - 2 * 4096) as f64);
    }

    #[test]
    fn the_models_first_layer_computes_no_input_gradient() {
        // a FLOP-rate device: a linear layer's backward is its two products, the first
        // layer's (whose input is data) only the weight gradient's; a convolution's too
        let device = DeviceModel::uniform("x", 1e9, 1e9);
        let cx = context(&device);
        let linear = node(Op::Linear { in_features: 64, out_features: 32, bias: true }, vec![64]);
        let conv = node(
            Op::Conv2d { in_channels: 3, out_channels: 8, kernel: 3, stride: 1, padding: 1, bias: true },
            vec![3, 16, 16],
        );
        for layer in [linear, conv] {
            let later = price(&layer, TpSplit::Replicated, (false, false), &cx);
            let first = price(&layer, TpSplit::Replicated, (true, false), &cx);
            assert!((later.backward - 2.0 * later.forward).abs() < 1e-15, "{}", later.backward);
            assert!((first.backward - later.forward).abs() < 1e-15, "{}", first.backward);
            assert_eq!(first.forward, later.forward);
            // the weight gradient is the weight pass of a split backward: half of a later
            // layer's backward, all of the first's
            assert!((later.backward_weights - later.forward).abs() < 1e-15, "{}", later.backward_weights);
            assert_eq!(first.backward_weights, first.backward);
        }
    }

    /// A split backward's weight pass is the weight gradients' products alone: a block's
    /// attention core, norms, activation and the loss stay in its input pass, which so
    /// carries more than half the backward; an LSTM's recurrent products split in two.
    #[test]
    fn a_split_backwards_weight_pass_is_its_weight_gradients() {
        let device = DeviceModel::uniform("x", 1e9, 1e9);
        let cx = context(&device);
        let block = node(Op::block(64, 4, 256, true), vec![64, 64]);
        let b = price(&block, TpSplit::Replicated, (false, false), &cx);
        // the block's four products (QKV, output, up, down): 2·64·(3·64 + 64 + 2·256) FLOPs a
        // position, its weight gradients the same at the uniform rate
        let products = 4.0 * 64.0 * 2.0 * 64.0 * (3.0 * 64.0 + 64.0 + 2.0 * 256.0) / 1e9;
        assert!((b.backward_weights - products).abs() < 1e-9 * products, "{} against {products}", b.backward_weights);
        assert!(b.backward > 2.0 * b.backward_weights, "{} against {}", b.backward, b.backward_weights);
        let lstm = node(Op::Lstm { input: 16, hidden: 32 }, vec![8, 16]);
        let l = price(&lstm, TpSplit::Replicated, (false, false), &cx);
        let step_products = 2.0 * 4.0 * 4.0 * 32.0 * 48.0 / 1e9;
        assert!((l.backward_weights - 8.0 * step_products).abs() < 1e-9 * l.backward_weights, "{}", l.backward_weights);
        // the loss is all input pass
        let head = node(Op::Linear { in_features: 64, out_features: 32, bias: false }, vec![64]);
        let (plain, with_loss) = (
            price(&head, TpSplit::Replicated, (false, false), &cx),
            price(&head, TpSplit::Replicated, (false, true), &cx),
        );
        assert!(with_loss.backward > plain.backward);
        assert_eq!(with_loss.backward_weights, plain.backward_weights);
    }

    /// pipec's executor on the CPU runs a convolution over its patch matrix
    /// (`KernelFamily::convolution`): on a device whose products are priced by their
    /// compute alone and whose memory by its bytes, the forward is the product plus the
    /// patch matrix laid out (written and read: C·k² values per output position) plus the
    /// output copied; a 3 × 3 convolution's patches are 9 times a 1 × 1's.
    #[test]
    fn the_executors_cpu_convolution_pays_for_its_patch_matrix() {
        let mut device = DeviceModel::uniform("cpu", 1e9, 1e10);
        device.memory_bandwidth = 1e10;
        let direct = context(&device);
        let patches = CostContext { convolution: Convolution::Patches, ..context(&device) };
        let conv = |k: usize| {
            node(
                Op::Conv2d { in_channels: 4, out_channels: 8, kernel: k, stride: 1, padding: k / 2, bias: false },
                vec![4, 16, 16],
            )
        };
        let p = 4.0; // fp32
        let samples = direct.microbatch as f64;
        for k in [1, 3] {
            let n = conv(k);
            let (a, b) = (
                price(&n, TpSplit::Replicated, (false, false), &direct),
                price(&n, TpSplit::Replicated, (false, false), &patches),
            );
            let (values, out) = (samples * 256.0 * (4 * k * k) as f64, samples * 8.0 * 256.0);
            let copies = (2.0 * values + 2.0 * out) * p / 1e10;
            // the products' FLOPs cost what they did (a FLOP-rate device)
            assert!(
                (b.forward - a.forward - copies).abs() < 1e-12 * b.forward.max(1.0),
                "k {k}: {} {}",
                b.forward,
                a.forward
            );
            assert!(b.backward > a.backward + copies, "k {k}");
        }
        let per_k = |k: usize| {
            let n = conv(k);
            price(&n, TpSplit::Replicated, (false, false), &patches).forward
                - price(&n, TpSplit::Replicated, (false, false), &direct).forward
        };
        let out_copies = 2.0 * samples * 8.0 * 256.0 * p / 1e10;
        assert!(((per_k(3) - out_copies) / (per_k(1) - out_copies) - 9.0).abs() < 1e-9);
        // the family answers so on the CPU only, for pipec's executor only
        use pipec_plan::engine::performance::KernelFamily;
        let h100 = pipec_plan::device::preset("h100-sxm").expect("a preset").model();
        assert_eq!(KernelFamily::Pipec.convolution(&device), Convolution::Patches);
        assert_eq!(KernelFamily::Pipec.convolution(&h100), Convolution::Direct);
        assert_eq!(KernelFamily::TorchEager.convolution(&device), Convolution::Direct);
    }

    #[test]
    fn a_measured_function_rate_prices_its_elements_and_an_unmeasured_one_its_flops() {
        // a CPU-like device: 1e10 FLOP/s element-wise, 1e10 B/s, 1 µs launch
        let mut device = DeviceModel::uniform("cpu", 1e9, 1e10);
        (device.memory_bandwidth, device.launch) = (1e10, 1e-6);
        let cx = context;
        let gelu = node(Op::Gelu, vec![1000]);
        let elements = 4.0 * 1000.0;
        // unmeasured: 8 FLOPs per element at the vector rate, beside 8 bytes per element
        let flops = price(&gelu, TpSplit::Replicated, (false, false), &cx(&device));
        assert!((flops.forward - (1e-6 + 8.0 * elements / 1e10)).abs() < 1e-15, "{}", flops.forward);
        // measured at 3.8e7 elements/s (this machine's erf-based GELU): its elements at that
        // rate, forward and backward (GELU's gradient evaluates it again)
        device.functions.gelu = 3.8e7;
        let measured = price(&gelu, TpSplit::Replicated, (false, false), &cx(&device));
        assert!((measured.forward - (1e-6 + elements / 3.8e7)).abs() < 1e-15, "{}", measured.forward);
        assert!((measured.backward - (1e-6 + elements / 3.8e7)).abs() < 1e-15, "{}", measured.backward);
        // tanh's gradient reads its output: only its forward takes the measured rate
        device.functions.tanh = 5e7;
        let tanh = price(&node(Op::Tanh, vec![1000]), TpSplit::Replicated, (false, false), &cx(&device));
        assert!((tanh.forward - (1e-6 + elements / 5e7)).abs() < 1e-15, "{}", tanh.forward);
        assert!(tanh.backward < 1e-5, "{}", tanh.backward);
        // measured gradients (`pipec calibrate` times them through autodiff) price the
        // backwards: GELU's at its own rate instead of its function's, tanh's too
        (device.functions.gelu_grad, device.functions.tanh_grad) = (2.5e7, 8e7);
        let measured = price(&gelu, TpSplit::Replicated, (false, false), &cx(&device));
        assert!((measured.backward - (1e-6 + elements / 2.5e7)).abs() < 1e-15, "{}", measured.backward);
        let tanh = price(&node(Op::Tanh, vec![1000]), TpSplit::Replicated, (false, false), &cx(&device));
        assert!((tanh.backward - (1e-6 + elements / 8e7)).abs() < 1e-15, "{}", tanh.backward);
        // and a block's MLP activation: its backward grows by the GELU gradient's time
        // over its 4 × 64 × 256 values, beyond GELU's function time
        let block = node(Op::block(64, 4, 256, true), vec![64, 64]);
        let with_grad = price(&block, TpSplit::Replicated, (false, false), &cx(&device));
        device.functions.gelu_grad = 0.0;
        let without = price(&block, TpSplit::Replicated, (false, false), &cx(&device));
        let ef = 4.0 * 64.0 * 256.0;
        let expected = ef / 2.5e7 - ef / 3.8e7;
        assert!(
            ((with_grad.backward - without.backward) / expected - 1.0).abs() < 1e-9,
            "{} {}",
            with_grad.backward,
            without.backward
        );
        assert_eq!(with_grad.forward, without.forward);
        // the executor's attention measured as a whole replaces its kernels: a fit of a
        // fixed 0.5 s forward and 0.25 s backward adds exactly that to a block beside a fit
        // of nothing, and leaves flash attention alone
        let zero = pipec_plan::device::AttentionFit { per_call: 0.0, per_mac: 0.0, per_score: 0.0, per_value: 0.0 };
        let fixed = |f: f64| pipec_plan::device::AttentionFit { per_call: f, ..zero };
        let with = |device: &DeviceModel, fit: Option<(f64, f64)>, attention: Attention| {
            let mut d = device.clone();
            d.attention =
                fit.map(|(f, b)| pipec_plan::device::AttentionRates { forward: fixed(f), backward: fixed(b) });
            price(&block, TpSplit::Replicated, (false, false), &CostContext { attention, ..cx(&d) })
        };
        let (none, some) = (
            with(&device, Some((0.0, 0.0)), Attention::Standard),
            with(&device, Some((0.5, 0.25)), Attention::Standard),
        );
        assert!(
            (some.forward - none.forward - 0.5).abs() < 1e-12 && (some.backward - none.backward - 0.25).abs() < 1e-12
        );
        assert!((some.selective - none.selective - 0.5).abs() < 1e-12, "selective recompute runs the forward again");
        let kernels = with(&device, None, Attention::Standard);
        assert!(kernels.forward > none.forward, "without a fit the scores' kernels are priced");
        let flash = |fit| with(&device, fit, Attention::Flash).forward;
        assert_eq!(flash(Some((0.5, 0.25))), flash(None));
        // a block's softmax and GELU take the measured rates: slower than by their FLOPs
        let block = node(Op::block(64, 4, 256, true), vec![64, 64]);
        device.functions.exp = 2.7e8;
        let slow = price(&block, TpSplit::Replicated, (false, false), &cx(&device));
        device.functions = Default::default();
        let fast = price(&block, TpSplit::Replicated, (false, false), &cx(&device));
        assert!(slow.forward > fast.forward && slow.backward > fast.backward);
    }

    /// An engine's fused attention runs at its published rate for the queries a call
    /// computes: a context-parallel member's 1/cp of the sequence, so a member of cp 4 over
    /// 8192 positions sustains the kernel's rate at 2048, and its core costs more than a
    /// quarter of the whole sequence's.
    #[test]
    fn a_context_parallel_members_attention_runs_at_its_queries_rate() {
        use pipec_plan::engine::performance::{AttentionPass, CUDNN_ATTENTION};
        let device = DeviceModel::uniform("x", 1e12, 1e12);
        let cx = |cp: usize| CostContext {
            precision: Precision::Bf16,
            microbatch: 4,
            cp,
            attention: Attention::Flash,
            fused_attention: Some(CUDNN_ATTENTION),
            ..context(&device)
        };
        for pass in [AttentionPass::Forward, AttentionPass::Backward] {
            assert_eq!(cx(4).attention_share(pass, true, 8192.0), Some(CUDNN_ATTENTION.share(pass, true, 2048.0)));
            assert_eq!(cx(1).attention_share(pass, true, 8192.0), Some(CUDNN_ATTENTION.share(pass, true, 8192.0)));
        }
        let n = node(Op::llama_block(4096, 32, 8, 14336), vec![8192, 4096]);
        let (whole, member) = (
            price(&n, TpSplit::Replicated, (false, false), &cx(1)),
            price(&n, TpSplit::Replicated, (false, false), &cx(4)),
        );
        assert!(member.core[0] > whole.core[0] / 4.0 * 1.05, "{:?} against {:?}", member.core, whole.core);
    }

    #[test]
    fn context_parallelism_prices_a_members_positions_and_gathers_keys_and_values() {
        // Llama's block (grouped keys and values: 8 of 32 heads), 8192 positions, bf16, on
        // a uniform device (one rate, no size effect): a member of cp 4 computes its 2048
        // queries against all 8192 keys — exactly what a quarter of the samples would cost
        let device = DeviceModel::uniform("x", 1e12, 1e12);
        let cx = |microbatch: usize, cp: usize, attention: Attention| CostContext {
            precision: Precision::Bf16,
            optimizer: OptimizerKind::Adam,
            microbatch,
            cp,
            attention,
            ..context(&device)
        };
        let n = node(Op::llama_block(4096, 32, 8, 14336), vec![8192, 4096]);
        for attention in [Attention::Standard, Attention::Flash] {
            let whole = price(&n, TpSplit::Replicated, (false, false), &cx(4, 1, attention));
            let member = price(&n, TpSplit::Replicated, (false, false), &cx(4, 4, attention));
            let one_sample = price(&n, TpSplit::Replicated, (false, false), &cx(1, 1, attention));
            assert!((member.forward - one_sample.forward).abs() <= 1e-12 * whole.forward);
            assert!((member.backward - whole.backward / 4.0).abs() <= 1e-9 * whole.backward);
        }
        // forward: the keys and values of the whole sequence gathered (8 heads of 128, both,
        // bf16, 4 samples); backward their gradients reduce-scattered back
        let kv = (4 * 8192 * 2 * 8 * 128 * 2) as u64;
        assert_eq!(
            cp_collectives(&n, 1, &cx(4, 4, Attention::Flash)),
            (vec![(CollectiveKind::AllGather, kv)], vec![(CollectiveKind::ReduceScatter, kv)])
        );
        assert_eq!(cp_collectives(&n, 1, &cx(4, 1, Attention::Flash)), (Vec::new(), Vec::new()));
        // a mixture of experts whose capacity counts the whole microbatch also gathers the
        // members' routing counts: f32 per sample, chunk (2·cp of them) and expert
        let moe = |capacity: f64, aux_loss: f64| {
            let mut op = Op::llama_block(4096, 32, 8, 14336);
            if let Op::TransformerBlock { moe, .. } = &mut op {
                *moe = Some(pipec_plan::model::Moe { capacity, aux_loss, ..pipec_plan::model::Moe::new(8, 2) });
            }
            node(op, vec![8192, 4096])
        };
        let counts = (4 * 2 * 4 * 8 * 4) as u64;
        for (capacity, aux) in [(1.25, 0.0), (0.0, 0.01)] {
            assert_eq!(
                cp_collectives(&moe(capacity, aux), 1, &cx(4, 4, Attention::Flash)).0,
                vec![(CollectiveKind::AllGather, kv), (CollectiveKind::AllGather, counts)]
            );
        }
        assert_eq!(
            cp_collectives(&moe(0.0, 0.0), 1, &cx(4, 4, Attention::Flash)).0,
            vec![(CollectiveKind::AllGather, kv)]
        );
        // memory per sample: a quarter of one device's, and the other members' keys and values
        let (kept, _) = kept_at(&n, 2.0, 1, false, Attention::Flash, 1);
        let gathered = (8192 * 2 * 8 * 128 * 2) as f64 * 0.75;
        assert_eq!(context_kept(kept, &n, 2.0, 1, &cx(4, 4, Attention::Flash)), (kept / 4.0 + gathered, gathered));
        assert_eq!(context_kept(kept, &n, 2.0, 1, &cx(4, 1, Attention::Flash)), (kept, 0.0));
        // around the ring: only the member's own keys and values kept, and the backward
        // passes them around again beside their gradients
        let ring = CostContext { cp_comm: CpComm::Ring, ..cx(4, 4, Attention::Flash) };
        assert_eq!(context_kept(kept, &n, 2.0, 1, &ring), (kept / 4.0, 0.0));
        assert_eq!(
            cp_collectives(&n, 1, &ring),
            (
                vec![(CollectiveKind::AllGather, kv)],
                vec![(CollectiveKind::AllGather, kv), (CollectiveKind::ReduceScatter, kv)]
            )
        );
        // the ring's blocks keep each row's log-sum-exp, not the probabilities: a ring over
        // standard attention is priced and kept as flash attention (and the all-gather not)
        let ring_of = |attention| CostContext { cp_comm: CpComm::Ring, ..cx(4, 4, attention) };
        assert_eq!(ring_of(Attention::Standard).attention_kernel(), Attention::Flash);
        assert_eq!(cx(4, 4, Attention::Standard).attention_kernel(), Attention::Standard);
        assert_eq!(cx(4, 1, Attention::Standard).attention_kernel(), Attention::Standard);
        let at = |c: &CostContext| price(&n, TpSplit::Replicated, (false, false), c);
        let (standard_ring, flash_ring) = (at(&ring_of(Attention::Standard)), at(&ring_of(Attention::Flash)));
        assert_eq!((standard_ring.forward, standard_ring.backward), (flash_ring.forward, flash_ring.backward));
        assert!(at(&cx(4, 4, Attention::Standard)).forward != flash_ring.forward);
        // the attention core: part of each pass, what the ring's transfers run under
        for attention in [Attention::Standard, Attention::Flash] {
            let priced = price(&n, TpSplit::Replicated, (false, false), &cx(4, 4, attention));
            assert!(priced.core[0] > 0.0 && priced.core[0] < priced.forward, "{attention:?}");
            assert!(priced.core[1] > 0.0 && priced.core[1] < priced.backward, "{attention:?}");
        }
    }

    #[test]
    fn expert_parallelism_divides_the_experts_and_prices_their_all_to_alls() {
        // Mixtral's block: 8 SwiGLU experts of 3 · 4096 · 14336 parameters each
        let mut op = Op::llama_block(4096, 32, 8, 14336);
        let moe = |skew: f64| pipec_plan::model::Moe { skew, ..pipec_plan::model::Moe::new(8, 2) };
        if let Op::TransformerBlock { moe: m, .. } = &mut op {
            *m = Some(moe(1.0));
        }
        let expert = 3 * 4096 * 14336u64;
        assert_eq!(op.routed_expert_parameter_count(), 8 * expert);
        let whole = op.parameter_count();
        assert_eq!(rank_parameters(&op, TpSplit::Replicated, 1, 1), (whole, 8 * expert));
        // ep 8: one expert per member; with tp 2 half of it
        assert_eq!(rank_parameters(&op, TpSplit::Replicated, 1, 8), (whole - 7 * expert, expert));
        let (tp2, experts) = rank_parameters(&op, TpSplit::Block, 2, 8);
        assert_eq!(experts, expert / 2);
        assert_eq!(tp2, shard_parameters(&op, TpSplit::Block, 2) - 8 * expert / 2 + expert / 2);

        // a uniform device (every FLOP at one rate, no size effect, no memory bound)
        let device = DeviceModel::uniform("x", 1e12, 1e12);
        let cx = |ep: usize| CostContext {
            precision: Precision::Bf16,
            optimizer: OptimizerKind::Adam,
            microbatch: 1,
            ep,
            attention: Attention::Flash,
            ..context(&device)
        };
        let n = node(op.clone(), vec![4096, 4096]);
        // dispatch and combine, forward and backward: each member's 4096 tokens' 2 choices,
        // a bf16 row of 4096 each
        let rows = 4096.0 * 2.0;
        let a2a = (rows * 4096.0 * 2.0) as u64;
        let (f, b) = ep_collectives(&n, false, 1, &cx(8));
        assert_eq!(f, vec![(CollectiveKind::AllToAll, a2a); 2]);
        assert_eq!(b, f);
        assert_eq!(ep_collectives(&n, false, 1, &cx(1)), (Vec::new(), Vec::new()));
        // beside context parallelism 2 (microbatches of 2 samples): a member routes its
        // half of the positions, the same 4096 tokens
        let cp2 = CostContext { microbatch: 2, cp: 2, ..cx(8) };
        assert_eq!(ep_collectives(&n, false, 1, &cp2), (f.clone(), f.clone()));
        // uniform routing: each member computes its expert on the group's tokens for it —
        // as many expert-token pairs as without expert parallelism, the same time here
        let (one, eight) = (
            price(&n, TpSplit::Replicated, (false, false), &cx(1)),
            price(&n, TpSplit::Replicated, (false, false), &cx(8)),
        );
        assert!((one.forward - eight.forward).abs() < 1e-12 * one.forward, "{} vs {}", one.forward, eight.forward);
        assert!((one.backward - eight.backward).abs() < 1e-12 * one.backward);
        // the busiest expert at twice the mean share: under ep 8 its member computes twice
        // the pairs (its expert's products doubled, and its activation's elements: the
        // 0.1%), without expert parallelism the same total
        if let Op::TransformerBlock { moe: m, .. } = &mut op {
            *m = Some(moe(2.0));
        }
        let skewed = node(op.clone(), vec![4096, 4096]);
        let mlp_forward = 2.0 * rows * 3.0 * 4096.0 * 14336.0 / 1e12;
        let ep_skewed = price(&skewed, TpSplit::Replicated, (false, false), &cx(8));
        let added = ep_skewed.forward - eight.forward;
        assert!(added > mlp_forward && added < 1.001 * mlp_forward, "{added} vs {mlp_forward}");
        let local_skewed = price(&skewed, TpSplit::Replicated, (false, false), &cx(1));
        assert!((local_skewed.forward - one.forward).abs() < 1e-9 * one.forward);
        // and receives twice the rows: the all-to-all's bytes follow the busiest member
        let (f, _) = ep_collectives(&skewed, false, 1, &cx(8));
        assert_eq!(f[0].1, 2 * a2a);
        // it also keeps twice the expert values and dispatched rows; under uniform routing a
        // member keeps what it would without expert parallelism: the rows its expert takes
        // are as many as its own tokens' pairs, and its own tokens' outputs come back for
        // the combine either way
        let kept = |n: &OpNode, ep| kept_at(n, 2.0, 1, false, Attention::Flash, ep).0;
        assert!(kept(&skewed, 8) > kept(&n, 8));
        assert_eq!(kept(&n, 8), kept(&n, 1));
    }

    #[test]
    fn routed_experts_run_as_one_grouped_kernel_or_one_kernel_per_expert() {
        // Qwen3-30B-A3B's block over ep 8 on an H100: 16 experts a device, each a few
        // thousand rows. One kernel per expert (Transformer Engine's cuBLAS GEMM per expert)
        // prices each at its own size's efficiency with a launch each: slower than one
        // grouped kernel over the same rows (torch._grouped_mm), the FLOPs the same
        let mut op = Op::llama_block(2048, 32, 4, 768);
        if let Op::TransformerBlock { moe, .. } = &mut op {
            *moe = Some(pipec_plan::model::Moe::new(128, 8));
        }
        let device = pipec_plan::device::preset("h100-sxm").expect("a preset").model();
        let cx = |grouped: bool| CostContext {
            precision: Precision::Bf16,
            optimizer: OptimizerKind::Adam,
            microbatch: 1,
            ep: 8,
            attention: Attention::Flash,
            grouped_experts: grouped,
            ..context(&device)
        };
        let n = node(op, vec![4096, 2048]);
        let at = |grouped| price(&n, TpSplit::Replicated, (false, false), &cx(grouped));
        let experts = |c: &Priced| c.block.as_ref().map_or(0.0, |b| b.parts[Part::Experts as usize]);
        let (one, each) = (at(true), at(false));
        assert!(experts(&each) > 1.1 * experts(&one), "{} against {}", experts(&each), experts(&one));
        assert!(each.backward > one.backward);
        assert_eq!(
            one.block.as_ref().map(|b| b.parts[Part::Core as usize]),
            each.block.as_ref().map(|b| b.parts[Part::Core as usize])
        );
    }

    #[test]
    fn the_engines_experts_constant_prices_the_routed_experts_products_and_per_expert_fp8_at_the_bf16_rate() {
        // Qwen3-30B-A3B's block: 128 experts of 768, 8 per token; on a uniform device, the
        // routed experts' products at a fitted share of a dense product's speed
        let mut op = Op::llama_block(2048, 32, 4, 768);
        if let Op::TransformerBlock { moe, .. } = &mut op {
            *moe = Some(pipec_plan::model::Moe::new(128, 8));
        }
        let device = DeviceModel::uniform("x", 1e12, 1e12);
        let fp8 = pipec_plan::plan::Fp8Plan {
            recipe: pipec_plan::vocab::Fp8Recipe::Tensorwise,
            activations: pipec_plan::vocab::Fp8Storage::Fp8,
            weight_copies: true,
            gather: pipec_plan::vocab::Fp8Storage::Bf16,
        };
        let cx = |efficiency: f64, fp8: Option<pipec_plan::plan::Fp8Plan>| CostContext {
            precision: Precision::Bf16,
            optimizer: OptimizerKind::Adam,
            microbatch: 1,
            ep: 8,
            attention: Attention::Flash,
            experts_efficiency: efficiency,
            fp8,
            ..context(&device)
        };
        let n = node(op.clone(), vec![4096, 2048]);
        let at = |efficiency, fp8| price(&n, TpSplit::Replicated, (false, false), &cx(efficiency, fp8));
        let (whole, quarter) = (at(1.0, Some(fp8)), at(0.25, Some(fp8)));
        // the routed experts' products (and their FP8 casts) take 4× their seconds: 3× more
        let part = |c: &Priced, p: Part| c.block.as_ref().map_or(0.0, |b| b.parts[p as usize]);
        let experts = part(&whole, Part::Experts);
        assert!(experts > 0.0);
        assert!((part(&quarter, Part::Experts) - 4.0 * experts).abs() < 1e-9 * experts);
        assert!((quarter.forward - whole.forward - 3.0 * experts).abs() < 1e-9 * whole.forward);
        assert!(quarter.backward > whole.backward);
        // nothing else moves: the attention, the routing, the activation
        for p in [Part::AttentionProducts, Part::Core, Part::Routing, Part::ExpertsActivation, Part::Norms] {
            assert_eq!(part(&quarter, p), part(&whole, p), "{p:?}");
        }
        // in the training precision it acts alike
        let (bf16, bf16_quarter) = (at(1.0, None), at(0.25, None));
        let experts = part(&bf16, Part::Experts);
        assert!((part(&bf16_quarter, Part::Experts) - 4.0 * experts).abs() < 1e-9 * experts);
        assert_eq!(part(&bf16_quarter, Part::AttentionProducts), part(&bf16, Part::AttentionProducts));
        // a dense block has no routed experts for it to act on
        let dense = node(Op::llama_block(2048, 32, 4, 768), vec![4096, 2048]);
        let priced = |g| price(&dense, TpSplit::Replicated, (false, false), &cx(g, Some(fp8)));
        assert_eq!(priced(0.25).forward, priced(1.0).forward);
        // one GEMM per expert: their FP8 products run at the bf16 rate, the dense FP8
        // products at the FP8 rate; grouped (one kernel), the experts' at the FP8 rate too
        let mut fast = device.clone();
        fast.matrix.fp8 = 4e12;
        let on = |device: &DeviceModel, grouped: bool| {
            let cx = CostContext { grouped_experts: grouped, device, ..cx(1.0, Some(fp8)) };
            price(&n, TpSplit::Replicated, (false, false), &cx)
        };
        let (slow_each, fast_each) = (on(&device, false), on(&fast, false));
        assert_eq!(part(&fast_each, Part::Experts), part(&slow_each, Part::Experts));
        assert!(part(&fast_each, Part::AttentionProducts) < part(&slow_each, Part::AttentionProducts));
        assert!(part(&on(&fast, true), Part::Experts) < part(&on(&device, true), Part::Experts));
    }

    #[test]
    fn fp8_casts_cost_what_the_engine_moves() {
        use pipec_plan::engine::performance::KernelFamily;
        // a Llama block in FP8 on a device whose casts are bound by its memory: torchao's
        // compiled casts move more than Transformer Engine's (the weights every forward, one
        // byte more a value), eager ones more still; the products themselves alike
        let mut device = DeviceModel::uniform("x", 1e12, 1e12);
        device.memory_bandwidth = 1e11;
        let fp8 = pipec_plan::plan::Fp8Plan {
            recipe: pipec_plan::vocab::Fp8Recipe::Tensorwise,
            activations: pipec_plan::vocab::Fp8Storage::Bf16,
            weight_copies: false,
            gather: pipec_plan::vocab::Fp8Storage::Bf16,
        };
        let n = node(Op::llama_block(4096, 32, 8, 14336), vec![4096, 4096]);
        let at = |family: KernelFamily| {
            let cx = CostContext {
                precision: Precision::Bf16,
                optimizer: OptimizerKind::Adam,
                microbatch: 1,
                attention: Attention::Flash,
                fp8: Some(fp8),
                fp8_casts: family.fp8_casts(),
                ..context(&device)
            };
            price(&n, TpSplit::Replicated, (false, false), &cx)
        };
        let (te, compiled, eager) =
            (at(KernelFamily::MegatronTe), at(KernelFamily::TorchCompiled), at(KernelFamily::TorchEager));
        // forward, bytes beyond Transformer Engine's: compiled 7 a weight and 1 an input
        // value, eager 6 and 2 — the weights and inputs come out of the two differences
        let (c, e) = ((compiled.forward - te.forward) * 1e11, (eager.forward - te.forward) * 1e11);
        let (weights, inputs) = ((2.0 * c - e) / 8.0, (7.0 * e - 6.0 * c) / 8.0);
        let parameters = n.op.parameter_count() as f64;
        assert!((weights / parameters - 1.0).abs() < 0.001, "{weights} against {parameters}");
        // the products' inputs: 4096 rows of the block's width three times (attention's
        // products, the output projection, the MLP's up products) and of the MLP's once
        let rows = 4096.0;
        assert!((inputs / (rows * (3.0 * 4096.0 + 14336.0)) - 1.0).abs() < 0.001, "{inputs}");
        // backward: the output gradient's cast, 1 byte a value more compiled, 2 eager
        let (c, e) = (compiled.backward - te.backward, eager.backward - te.backward);
        assert!(c > 0.0 && (e / c - 2.0).abs() < 1e-9, "{c} {e}");
    }

    #[test]
    fn sequence_parallel_collectives_are_the_engines() {
        use pipec_plan::engine::performance::SequenceCollectives;
        // a Llama block on t = 8 with sequence parallelism: forward a gather and a scatter
        // around each half; backward each half's output-gradient gather and input-gradient
        // scatter, and on Megatron-LM the two inputs gathered again
        let device = DeviceModel::uniform("x", 1e12, 1e12);
        let fp8 = |recipe| pipec_plan::plan::Fp8Plan {
            recipe,
            activations: pipec_plan::vocab::Fp8Storage::Bf16,
            weight_copies: false,
            gather: pipec_plan::vocab::Fp8Storage::Bf16,
        };
        let cx = |sequence_collectives, fp8| CostContext {
            precision: Precision::Bf16,
            optimizer: OptimizerKind::Adam,
            microbatch: 1,
            tp: 8,
            sequence_parallel: true,
            attention: Attention::Flash,
            sequence_collectives,
            fp8,
            ..context(&device)
        };
        let n = node(Op::llama_block(4096, 32, 8, 14336), vec![8192, 4096]);
        let x = 8192 * 4096 * 2;
        use CollectiveKind::{AllGather as Ag, ReduceScatter as Rs};
        let megatron = SequenceCollectives::default();
        let torch = pipec_plan::engine::performance::KernelFamily::TorchCompiled.sequence_collectives();
        let tensorwise = Some(fp8(pipec_plan::vocab::Fp8Recipe::Tensorwise));
        let (f, b) = tp_collectives(&n, TpSplit::Block, &cx(megatron, tensorwise));
        assert_eq!(f, vec![(Ag, x), (Rs, x), (Ag, x), (Rs, x)]);
        assert_eq!(b, vec![(Ag, x), (Rs, x), (Ag, x), (Rs, x), (Ag, x), (Ag, x)]);
        // PyTorch keeps the gathered inputs: no gather again
        let (f, b) = tp_collectives(&n, TpSplit::Block, &cx(torch, None));
        assert_eq!(f, vec![(Ag, x), (Rs, x), (Ag, x), (Rs, x)]);
        assert_eq!(b, f);
        // torchao's Float8 tensor parallelism gathers FP8 under tensorwise scaling, both ways
        let (f, b) = tp_collectives(&n, TpSplit::Block, &cx(torch, tensorwise));
        assert_eq!(f, vec![(Ag, x / 2), (Rs, x), (Ag, x / 2), (Rs, x)]);
        assert_eq!(b, f);
        let rowwise = Some(fp8(pipec_plan::vocab::Fp8Recipe::Rowwise));
        assert_eq!(tp_collectives(&n, TpSplit::Block, &cx(torch, rowwise)).0[0], (Ag, x));
    }

    #[test]
    fn whole_experts_beside_tensor_parallelism_are_priced_as_megatron_folds_them() {
        // Qwen3-235B's block: 128 experts of 1536, 8 per token, no shared expert; tp 2 with
        // sequence parallelism, 4 expert-parallel replicas: split, each rank holds halves of
        // 32 experts; whole (`etp: 1`), 16 whole experts over the group's 8 devices
        let mut op = Op::llama_block(4096, 64, 4, 1536);
        if let Op::TransformerBlock { moe, .. } = &mut op {
            *moe = Some(pipec_plan::model::Moe::new(128, 8));
        }
        let device = DeviceModel::uniform("x", 1e12, 1e12);
        let cx = |whole: bool| CostContext {
            precision: Precision::Bf16,
            optimizer: OptimizerKind::Adam,
            microbatch: 1,
            tp: 2,
            ep: 4,
            whole_experts: whole,
            sequence_parallel: true,
            attention: Attention::Flash,
            ..context(&device)
        };
        let n = node(op.clone(), vec![4096, 4096]);
        let (split, whole) = (cx(false), cx(true));
        // the same bytes of experts per rank either way: halves of 32 experts, or 16 whole
        // ones, 1/8 of the block's
        assert_eq!(rank_parameters(&op, TpSplit::Block, 2, 4).1, op.routed_expert_parameter_count() / 8);
        // the tensor-parallel collectives: no gather and scatter around whole experts
        let (f, b) = tp_collectives(&n, TpSplit::Block, &split);
        assert_eq!((f.len(), b.len()), (4, 6));
        let (f, b) = tp_collectives(&n, TpSplit::Block, &whole);
        assert_eq!((f.len(), b.len()), (2, 3));
        assert_eq!(f[0].0, CollectiveKind::AllGather);
        // a block with a shared expert keeps its gather and scatter (the shared expert is
        // split like the block)
        let mut shared = op.clone();
        if let Op::TransformerBlock { moe: Some(m), .. } = &mut shared {
            m.shared = 1;
        }
        let (f, _) = tp_collectives(&node(shared, vec![4096, 4096]), TpSplit::Block, &whole);
        assert_eq!(f.len(), 4);
        // the all-to-alls: each rank sends its sequence share's routed rows either way
        assert_eq!(ep_collectives(&n, true, 2, &split), ep_collectives(&n, true, 2, &whole));
        // the same FLOPs on a uniform device, whole-width products on half the rows
        let (p_split, p_whole) =
            (price(&n, TpSplit::Block, (false, false), &split), price(&n, TpSplit::Block, (false, false), &whole));
        assert!((p_split.forward - p_whole.forward).abs() < 1e-9 * p_split.forward);
        assert_eq!(split.load_members(2), 4);
        assert_eq!(whole.load_members(2), 8);
        assert_eq!(whole.load_members(1), 4);
        // under a skewed routing the busiest of 8 devices holding 16 experts each takes a
        // larger share than the busiest of 4 replicas holding 32: its rank keeps more
        if let Op::TransformerBlock { moe: Some(m), .. } = &mut op {
            m.skew = 4.0;
        }
        let skewed = node(op, vec![4096, 4096]);
        let kept = |ep| kept_at(&skewed, 2.0, 2, true, Attention::Flash, ep).0;
        assert!(kept(whole.load_members(2)) > kept(split.load_members(2)));
    }

    #[test]
    fn a_mixture_of_experts_block_counts_its_active_experts_and_what_routing_keeps() {
        // Mixtral 8x7B's block: 8 SwiGLU experts of width 14,336, 2 per token
        let Op::TransformerBlock { moe, .. } = &mut Op::llama_block(4096, 32, 8, 14336) else { unreachable!() };
        assert!(moe.is_none());
        let moe_block = |experts: usize, top_k: usize, capacity: f64| {
            let mut b = Op::llama_block(4096, 32, 8, 14336);
            if let Op::TransformerBlock { moe, .. } = &mut b {
                *moe = Some(pipec_plan::model::Moe {
                    capacity,
                    aux_loss: 0.01,
                    ..pipec_plan::model::Moe::new(experts, top_k)
                });
            }
            b
        };
        let mixtral = moe_block(8, 2, 0.0);
        let (s, d, f) = (4096.0, 4096.0, 14336.0);
        let dense = forward_flops(&node(Op::llama_block(4096, 32, 8, 14336), vec![4096, 4096]));
        let moe = forward_flops(&node(mixtral.clone(), vec![4096, 4096]));
        // one more SwiGLU MLP per token (three products of 2·s·d·f) and the router's 2·s·d·E
        assert_eq!(moe - dense, 3.0 * 2.0 * s * d * f + 2.0 * s * d * 8.0);
        // the products are twice the parameters a token uses, as for a dense block
        assert_eq!(moe - 4.0 * s * s * d, 2.0 * s * (mixtral.active_parameter_count() - 2 * 4096) as f64);
        assert_eq!(mixtral.parameter_count() - mixtral.active_parameter_count(), 6 * 3 * 4096 * 14336);
        // kept per token beyond the dense block: the second expert's MLP values its backward
        // reads (gate, up and the activation's output: 3·f; the down projection's output is
        // not read), both dispatched inputs, both experts' outputs (the combine's gradient
        // with respect to the scores reads them), the router's fp32 logits and scores (4·E
        // bytes each) and the two chosen indices (8 bytes each)
        let p = 2.0;
        let kept = |op: &Op| kept_at(&node(op.clone(), vec![4096, 4096]), p, 1, false, Attention::Flash, 1).0;
        let extra = s * (3.0 * f * p + 2.0 * d * p + 2.0 * d * p + 4.0 * 8.0 + 4.0 * 8.0 + 8.0 * 2.0);
        assert_eq!(kept(&mixtral) - kept(&Op::llama_block(4096, 32, 8, 14336)), extra);
        // a capacity factor of 0.5 bounds every expert at half its uniform share: half the
        // routed pairs computed and kept
        let m = mixtral.moe().expect("moe");
        assert_eq!(m.expert_tokens(4096.0), 8192.0);
        let half = moe_block(8, 2, 0.5).moe().expect("moe");
        assert_eq!(half.expert_capacity(4096), Some(512));
        assert_eq!(half.expert_tokens(4096.0), 4096.0);
        assert!(kept(&moe_block(8, 2, 0.5)) < kept(&mixtral));
    }

    #[test]
    fn transformer_activations_follow_korthikanti() {
        // GPT-3's block with its dropout of 0.1: s = 512, h = 1024, a = 16 at 16-bit,
        // 34·s·h + 5·a·s² bytes per sample
        let mut op = Op::block(1024, 16, 4096, false);
        if let Op::TransformerBlock { dropout, .. } = &mut op {
            *dropout = 0.1;
        }
        let n = node(op, vec![512, 1024]);
        let (sh, as2): (u64, u64) = (512 * 1024, 16 * 512 * 512);
        assert_eq!(activation_bytes(&n, 2), 34 * sh + 5 * as2);
        // at 32-bit the values double and the one-byte dropout masks do not
        assert_eq!(activation_bytes(&n, 4), 2 * (32 * sh + 4 * as2) + 2 * sh + as2);
        // tensor parallelism t: (10 + 24/t)·s·h + 5·a·s²/t; with sequence parallelism all
        // of it over t; flash attention keeps each row's log-sum-exp (a fp32 values per
        // position) instead of the 5·a·s² core, which selective recompute drops
        let t: u64 = 8;
        let kept = |sp, attention| kept_at(&n, 2.0, t as usize, sp, attention, 1);
        assert_eq!(
            kept(false, Attention::Standard),
            ((10 * sh + 24 * sh / t + 5 * as2 / t) as f64, (5 * as2 / t) as f64)
        );
        assert_eq!(kept(true, Attention::Standard).0, ((34 * sh + 5 * as2) / t) as f64);
        let lse = (512 * 16 * 4 / t) as f64;
        assert_eq!(kept(true, Attention::Flash), ((34 * sh / t) as f64 + lse, lse));
        // without dropout: no masks, no dropped copy (32·s·h + 2·a·s²)
        let plain = node(Op::block(1024, 16, 4096, false), vec![512, 1024]);
        assert_eq!(activation_bytes(&plain, 2), 32 * sh + 2 * as2);
    }

    /// `tp_overlap`: tensor parallelism's collectives overlapped by ring exchange, each split
    /// product of a dense block runs in `tp` steps of a `tp`th of its rows against the whole
    /// weights (Transformer Engine's userbuffers ring exchange, PyTorch's asynchronous TP),
    /// each step priced at its size; the row-split products' input gradients too. On the
    /// H100's curves the steps of Llama 3 70B's products at TP 4 cost more than the whole
    /// products; the replicated parts (norms, the attention core) do not change.
    #[test]
    fn ring_exchange_overlap_runs_each_split_product_in_steps() {
        fn cx(device: &DeviceModel, overlap: Option<OverlapSteps>) -> CostContext<'_> {
            CostContext {
                precision: Precision::Bf16,
                optimizer: OptimizerKind::Adam,
                microbatch: 1,
                tp: 4,
                sequence_parallel: true,
                attention: Attention::Flash,
                tp_overlap: overlap,
                ..context(device)
            }
        }
        let device = pipec_plan::device::preset("h100-sxm").expect("a preset").model();
        let n = node(Op::llama_block(8192, 64, 8, 28672), vec![8192, 8192]);
        let at = |overlap| price(&n, TpSplit::Block, (false, false), &cx(&device, overlap));
        let megatron = Some(KernelFamily::MegatronTe.overlap_steps());
        let (whole, steps) = (at(None), at(megatron));
        let part = |c: &Priced, p: Part| c.block.as_ref().map_or(0.0, |b| b.parts[p as usize]);
        for p in [Part::AttentionProducts, Part::Output, Part::Mlp] {
            assert!(part(&steps, p) > part(&whole, p), "{p:?}: {} against {}", part(&steps, p), part(&whole, p));
        }
        for p in [Part::Norms, Part::Core] {
            assert_eq!(part(&steps, p), part(&whole, p), "{p:?}");
        }
        assert!(steps.backward > whole.backward);
        // PyTorch's micro-pipelined TP also runs the column-split products' input gradients
        // (their reduce-scatter) and the row-split ones' weight gradients in steps
        let torch = at(Some(KernelFamily::TorchCompiled.overlap_steps()));
        assert_eq!(torch.forward, steps.forward);
        assert!(torch.backward > steps.backward, "{} against {}", torch.backward, steps.backward);
        // in steps no product is cheaper than the whole: on a uniform device, the same
        let uniform = DeviceModel::uniform("x", 1e12, 1e12);
        let flat = |overlap| price(&n, TpSplit::Block, (false, false), &cx(&uniform, overlap));
        let (a, b) = (flat(None), flat(megatron));
        assert!(b.forward >= a.forward && b.forward < 1.05 * a.forward, "{} against {}", b.forward, a.forward);
    }
}
