//! Megatron tensor parallelism inside a stage. Linear layers are paired — a column-parallel
//! layer (each rank its slice of the output features), element-wise layers, then a
//! row-parallel layer (each rank its slice of the input features) whose partial sums are
//! all-reduced (Megatron's `g`) — and transformer blocks split their attention heads and MLP
//! columns the same way. Other layers run replicated on every rank.
//!
//! Megatron's `f` (identity forward, all-reduce of the gradient in backward) needs
//! communication in the middle of the backward pass, which Burn's autodiff cannot pause
//! for. So a tensor-parallel stage's forward is cut into segments at every `f` point
//! (the input of a column-parallel layer or of a block half): each segment starts from a
//! fresh leaf, and the backward runs segment by segment, all-reducing the gradient at each
//! leaf over the group before handing it to the segment before. For a block half the leaf
//! also feeds the residual, whose share of the gradient is already complete on every rank:
//! it is counted once (`all-reduce(g) − (tp − 1)·grad_out`). Layer norms that feed a
//! column-parallel layer receive partial weight gradients, summed over the group before
//! the optimizer step. Shards are slices of the full deterministic initial weights, so a
//! tensor-parallel run computes what one device computes.

use crate::backend::kernels::{ExecBackend, Kernels};
use burn::prelude::*;
use pipec_plan::model::Op;

use crate::error::{ExecError, Result};
use crate::nn::block::Half;
use crate::nn::layers::{
    dense_values, embedding_values, stateless, Act, Block, Dense, Layer, StageModel, TokenTypes, VocabEmbed,
};
use crate::nn::params::host_f32;
use pipec_plan::model::Loss;

pub use pipec_plan::model::TpSplit as Split;

/// One stage's layers within the whole model, and the model's loss: what a stage's split
/// depends on (the vocabulary-parallel layers are the model's first and last).
#[derive(Debug, Clone)]
pub struct StageLayers<'a> {
    pub all: &'a [Op],
    pub range: std::ops::Range<usize>,
    pub loss: Loss,
    /// Each routed expert whole on one rank (`etp: 1`, `ScheduleInfo::whole_experts`), not
    /// split like the block: its parameters are whole, and only its holder has them.
    pub whole_experts: bool,
}

impl<'a> StageLayers<'a> {
    /// The stage's operators.
    pub fn ops(&self) -> &'a [Op] {
        self.all.get(self.range.clone()).unwrap_or_default()
    }

    /// Each layer's split (`pipec_plan::model::stage_tp_splits`, the rule the compiler's
    /// cost model reads too); errors when a block cannot be split `tp` ways.
    pub fn splits(&self, tp: usize) -> Result<Vec<Split>> {
        pipec_plan::model::stage_tp_splits(self.all, self.range.clone(), self.loss, tp).map_err(ExecError::Plan)
    }
}

/// How one parameter is laid out over a tensor-parallel group of `tp` ranks: the single
/// definition that building a stage, resharding a checkpoint and resharding the optimizer
/// state share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// The whole tensor on every rank.
    Whole,
    /// A [rows, cols] tensor (row-major) split by columns: rank r holds columns
    /// `r·cols/tp .. (r+1)·cols/tp` of every row (a column-parallel weight; its bias with
    /// `rows` 1).
    Columns { rows: usize, cols: usize },
    /// `tp` contiguous chunks of the row-major values (a row-parallel weight: its rows).
    Rows,
    /// A [rows, w₀ + w₁ + w₂] tensor of three column parts side by side — a QKV projection
    /// (widths d, kv, kv), a gated MLP's gate and up projections (f, f, 0); its bias with
    /// `rows` 1: rank r holds, of each part, its columns `r·w/tp .. (r+1)·w/tp`.
    Parts { rows: usize, widths: [usize; 3] },
}

/// The dimension of a tensor of `dims` dimensions that `s` splits: a row-parallel weight's
/// rows (the first), a column-parallel one's columns (the last); None for a whole tensor.
fn split_axis(dims: usize, s: Sharding) -> Option<usize> {
    match s {
        Sharding::Whole => None,
        Sharding::Rows => (dims > 0).then_some(0),
        Sharding::Columns { .. } | Sharding::Parts { .. } => dims.checked_sub(1),
    }
}

/// The shape of one rank's shard of a tensor of shape `whole` split as `s` over `tp` ranks.
pub fn shard_shape(whole: &[usize], s: Sharding, tp: usize) -> Vec<usize> {
    let mut out = whole.to_vec();
    if let Some(a) = split_axis(out.len(), s) {
        out[a] /= tp.max(1);
    }
    out
}

/// The whole tensor's shape from one rank's `shard` shape ([`shard_shape`]'s inverse).
pub fn whole_shape(shard: &[usize], s: Sharding, tp: usize) -> Vec<usize> {
    let mut out = shard.to_vec();
    if let Some(a) = split_axis(out.len(), s) {
        out[a] *= tp.max(1);
    }
    out
}

/// Rank `rank`'s shard of the whole tensor `full`.
pub fn shard(full: &[f32], s: Sharding, tp: usize, rank: usize) -> Vec<f32> {
    let tp = tp.max(1);
    match s {
        Sharding::Whole => full.to_vec(),
        Sharding::Columns { rows, cols } => {
            let part = cols / tp;
            (0..rows).flat_map(|r| full[r * cols + rank * part..r * cols + (rank + 1) * part].iter().copied()).collect()
        }
        Sharding::Rows => {
            let part = full.len() / tp;
            full[rank * part..(rank + 1) * part].to_vec()
        }
        Sharding::Parts { rows, widths } => {
            let width: usize = widths.iter().sum();
            let mut out = Vec::with_capacity(rows * width / tp);
            for r in 0..rows {
                let mut offset = r * width;
                for w in widths {
                    let part = w / tp;
                    let start = offset + rank * part;
                    out.extend_from_slice(&full[start..start + part]);
                    offset += w;
                }
            }
            out
        }
    }
}

/// The whole tensor from every rank's shard, in rank order: the inverse of `shard`.
pub fn unshard(parts: &[Vec<f32>], s: Sharding) -> Result<Vec<f32>> {
    let tp = parts.len();
    let bad = || ExecError::Checkpoint(format!("{tp} tensor-parallel shards of unequal or unexpected sizes"));
    let n = parts.first().map_or(0, Vec::len);
    if tp == 0 || parts.iter().any(|p| p.len() != n) {
        return Err(bad());
    }
    if s == Sharding::Whole {
        return Ok(parts[0].clone());
    }
    // where `shard` takes each value of each rank from
    let positions: Vec<f32> = (0..n * tp).map(|i| i as f32).collect();
    let mut full = vec![f32::NAN; n * tp];
    for (rank, part) in parts.iter().enumerate() {
        let from = shard(&positions, s, tp, rank);
        if from.len() != n {
            return Err(bad());
        }
        for (i, v) in from.iter().zip(part) {
            full[*i as usize] = *v;
        }
    }
    Ok(full)
}

/// How every split parameter of a stage's layers is laid out over `tp` ranks, by parameter
/// id; a parameter not listed is whole on every rank.
pub fn shardings(layers: &StageLayers<'_>, tp: usize) -> Result<std::collections::HashMap<u64, Sharding>> {
    let mut out = std::collections::HashMap::new();
    if tp <= 1 {
        return Ok(out);
    }
    let first = layers.range.start;
    let id = |k: usize, slot: u64| crate::nn::layers::pid(first + k, slot);
    for (k, (op, split)) in layers.ops().iter().zip(layers.splits(tp)?).enumerate() {
        match (split, op) {
            // an embedding table's rows: contiguous chunks of the vocabulary
            (Split::Vocab, Op::Embedding { .. }) => {
                out.insert(id(k, 0), Sharding::Rows);
            }
            (Split::Column | Split::Vocab, Op::Linear { in_features, out_features, .. }) => {
                out.insert(id(k, 0), Sharding::Columns { rows: *in_features, cols: *out_features });
                out.insert(id(k, 1), Sharding::Columns { rows: 1, cols: *out_features });
            }
            (Split::Row, Op::Linear { .. }) => {
                out.insert(id(k, 0), Sharding::Rows);
            }
            (Split::Block, Op::TransformerBlock { .. }) => {
                let Some(b) = op.block_dims() else { continue };
                match b.latent() {
                    None => {
                        let qkv = [b.q_width, b.kv_width, b.kv_width];
                        out.insert(id(k, 2), Sharding::Parts { rows: b.d, widths: qkv });
                        out.insert(id(k, 3), Sharding::Parts { rows: 1, widths: qkv });
                    }
                    // multi-head latent attention: the up projections by heads (the down
                    // projection and the latents' norms whole)
                    Some(w) => {
                        for (slot, [rows, cols]) in [
                            (pipec_plan::model::LATENT_QUERY_SLOT, w.query),
                            (pipec_plan::model::LATENT_KV_UP_SLOT, w.kv_up),
                        ] {
                            out.insert(id(k, slot), Sharding::Columns { rows, cols });
                        }
                    }
                }
                out.insert(id(k, 4), Sharding::Rows);
                // the sinks: a logit per query head, each rank its heads'
                if b.sinks {
                    out.insert(id(k, pipec_plan::model::SINKS_SLOT), Sharding::Rows);
                }
                let (up, up_bias) = if b.gated {
                    (
                        Sharding::Parts { rows: b.d, widths: [b.ff, b.ff, 0] },
                        Sharding::Parts { rows: 1, widths: [b.ff, b.ff, 0] },
                    )
                } else {
                    (Sharding::Columns { rows: b.d, cols: b.ff }, Sharding::Columns { rows: 1, cols: b.ff })
                };
                // a dense block's one MLP, or each expert's (its up projection's bias split
                // like the projection, its down projection's whole)
                match b.moe {
                    None => {
                        out.insert(id(k, 8), up);
                        out.insert(id(k, 9), up_bias);
                        out.insert(id(k, 10), Sharding::Rows);
                    }
                    Some(m) => {
                        // (whole routed experts: their parameters whole, like a norm's)
                        let first = if layers.whole_experts { m.experts } else { 0 };
                        for e in first..m.experts + m.shared {
                            let slot = pipec_plan::checkpoint::expert_slot(e);
                            out.insert(id(k, slot), up);
                            out.insert(id(k, slot + 1), up_bias);
                            out.insert(id(k, slot + 2), Sharding::Rows);
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Builds this rank's shard of a stage's layers.
pub fn build_stage<B: Kernels>(
    layers: &StageLayers<'_>,
    seed: u64,
    device: &B::Device,
    rank: usize,
    tp: usize,
) -> Result<StageModel<B>> {
    let (ops, first, whole_experts) = (layers.ops(), layers.range.start, layers.whole_experts);
    let splits = layers.splits(tp)?;
    let layout = shardings(layers, tp)?;
    let at =
        |index: usize, slot: u64| layout.get(&crate::nn::layers::pid(index, slot)).copied().unwrap_or(Sharding::Whole);
    let mut layers = Vec::with_capacity(ops.len());
    for (k, (op, split)) in ops.iter().zip(&splits).enumerate() {
        let index = first + k;
        let layer = match (split, op) {
            (Split::Column | Split::Vocab, Op::Linear { in_features, out_features, bias }) => {
                let w = dense_values(index, 0, seed, *in_features, *out_features, 2.0);
                let part = out_features / tp;
                let dense = Dense::from_values(
                    index,
                    0,
                    shard(&w, at(index, 0), tp, rank),
                    [*in_features, part],
                    bias.then(|| vec![0.0; part]),
                    device,
                );
                if *split == Split::Vocab {
                    Layer::VocabLinear(dense)
                } else {
                    Layer::ColumnLinear(dense)
                }
            }
            (Split::Vocab, Op::Embedding { vocab, dim, types, sep }) => {
                let part = vocab / tp;
                let table = shard(&embedding_values(index, seed, *vocab, *dim), at(index, 0), tp, rank);
                let types = (*types > 0).then(|| TokenTypes::new(index, seed, *types, *dim, *sep, device));
                Layer::VocabEmbedding(VocabEmbed::new(index, table, [part, *dim], rank * part, types, device))
            }
            (Split::Row, Op::Linear { in_features, out_features, bias }) => {
                let w = dense_values(index, 0, seed, *in_features, *out_features, 2.0);
                let part = in_features / tp;
                Layer::RowLinear(Dense::from_values(
                    index,
                    0,
                    shard(&w, at(index, 0), tp, rank),
                    [part, *out_features],
                    bias.then(|| vec![0.0; *out_features]),
                    device,
                ))
            }
            (Split::Block, Op::TransformerBlock { .. }) => {
                let slice = |slot: u64, w: Vec<f32>| shard(&w, at(index, slot), tp, rank);
                match Block::build(index, op, seed, device, slice, (tp, rank), whole_experts) {
                    Some(b) => Layer::ParallelBlock(b),
                    None => Layer::new(index, op, seed, device),
                }
            }
            _ => Layer::new(index, op, seed, device),
        };
        layers.push(layer);
    }
    Ok(StageModel { layers, graph: None })
}

/// Parameter ids (layer << 8 | slot) whose gradients are partial on each rank and must be
/// summed over the group (`pipec_plan::in_pass::tp_partial_ids`, the rule the plan's
/// declaration of those sums reads too).
pub fn partial_parameter_ids(layers: &StageLayers<'_>, tp: usize) -> Result<Vec<u64>> {
    pipec_plan::in_pass::tp_partial_ids(layers.all, layers.range.clone(), layers.loss, tp, layers.whole_experts)
        .map_err(ExecError::Plan)
}

/// How a segment's input gradient is completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    /// The stage input, not followed by a split layer: the gradient is already complete.
    Complete,
    /// Megatron's `f`: sum the gradient over the group.
    Sum,
    /// `f` on a leaf that also feeds a residual: sum, then count the residual once.
    SumResidual,
}

/// One segment of a tensor-parallel forward.
#[derive(Debug, Clone)]
pub struct Segment<B: Backend> {
    pub leaf: Act<B>,
    pub out: Act<B>,
    pub boundary: Boundary,
    /// A block's half (its layer, a position in the stage) the segment is, run untracked in
    /// the forward and again in the backward (recompute inside the blocks): `out` holds no
    /// graph.
    pub rerun: Option<(usize, Half)>,
    /// The load-balancing loss a mixture of experts' half made in the segment's graph (its
    /// backward adds it to the target; a half run again makes it again).
    pub aux: Option<Tensor<B, 1>>,
}

impl<B: Backend> Segment<B> {
    /// A segment run once, making no load-balancing loss.
    fn plain(leaf: Act<B>, out: Act<B>, boundary: Boundary) -> Self {
        Segment { leaf, out, boundary, rerun: None, aux: None }
    }
}

/// Recompute inside the blocks of a tensor-parallel stage: what each layer (a position in
/// the stage) runs again (`BlockRecompute::run_again`), the stage's weights untracked for
/// the forward of those, and what releases Burn's hold on an untracked half.
pub struct Rerun<'a, B: Backend> {
    pub again: &'a [pipec_plan::plan::RunAgain],
    pub untracked: &'a StageModel<B>,
    pub release: &'a dyn Fn(),
}

impl<B: Backend> Rerun<'_, B> {
    /// Whether layer `k` runs its `half` again.
    /// (a block run again whole: its two halves, each its segment)
    fn runs(&self, k: usize, half: Half) -> bool {
        let halves = self.again.get(k).map(|a| a.halves()).unwrap_or_default();
        match half {
            Half::Attention => halves.attention,
            Half::Mlp => halves.mlp,
        }
    }
}

/// One half of tensor-parallel block `b` on `x` (its attention, or its MLP or experts, with
/// the residual sum): what a segment of a block is, and what its backward runs again.
pub fn run_half<B: ExecBackend>(
    b: &Block<B>,
    half: Half,
    x: Tensor<B, 3>,
    reduce: &mut dyn FnMut(Vec<f32>) -> Result<Vec<f32>>,
    side: &mut crate::nn::layers::Collected<B>,
) -> Result<Tensor<B, 3>> {
    match half {
        Half::Attention => attention_half(b, x, reduce, side),
        Half::Mlp => mlp_half(b, x, reduce, true, side),
    }
}

/// Sums a tensor over the group (the forward all-reduce `g`): the value becomes the sum,
/// the gradient passes through unchanged.
fn g<B: ExecBackend>(partial: Act<B>, reduce: &mut dyn FnMut(Vec<f32>) -> Result<Vec<f32>>) -> Result<Act<B>> {
    fn host<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Result<Vec<f32>> {
        host_f32(t.clone().into_data())
    }
    Ok(match partial {
        Act::D2(t) => {
            let full = Tensor::<B, 2>::from_data(TensorData::new(reduce(host(&t)?)?, t.dims()), &t.device());
            Act::D2(t.clone() + (full - t.detach()))
        }
        Act::D3(t) => {
            let full = Tensor::<B, 3>::from_data(TensorData::new(reduce(host(&t)?)?, t.dims()), &t.device());
            Act::D3(t.clone() + (full - t.detach()))
        }
        other => return Err(ExecError::Shape(format!("cannot all-reduce {:?}", other.dims()))),
    })
}

/// A leaf copy of an activation (same values, new autodiff node).
pub fn fresh<B: ExecBackend>(a: &Act<B>) -> Act<B> {
    match a {
        Act::D2(t) => Act::D2(t.clone().detach().require_grad()),
        Act::D3(t) => Act::D3(t.clone().detach().require_grad()),
        Act::D4(t) => Act::D4(t.clone().detach().require_grad()),
        Act::Tokens(t) => Act::Tokens(t.clone()),
        Act::Bundle(parts) => Act::Bundle(parts.iter().map(fresh).collect()),
    }
}

fn attention_half<B: ExecBackend>(
    b: &Block<B>,
    x: Tensor<B, 3>,
    reduce: &mut dyn FnMut(Vec<f32>) -> Result<Vec<f32>>,
    side: &crate::nn::layers::Collected<B>,
) -> Result<Tensor<B, 3>> {
    // pre-norm: x + attention(norm(x)); post-norm: x + attention(x), normed by the caller
    let input = if b.post_norm { x.clone() } else { b.norm1.forward(x.clone()) };
    let ctx = b.attend(b.queries_keys_values(input)?, side)?;
    let a = b.proj.add_bias(g(b.proj.matmul_only(Act::D3(ctx))?, reduce)?);
    match a {
        // the dropout after the sum, on the whole output every rank holds
        Act::D3(a) => Ok(x + b.branch_dropout(Half::Attention, a, side)),
        _ => Err(ExecError::Shape(
            "the attention projection of a tensor-parallel block must give [batch, seq, d]".into(),
        )),
    }
}

fn mlp_half<B: ExecBackend>(
    b: &Block<B>,
    h: Tensor<B, 3>,
    reduce: &mut dyn FnMut(Vec<f32>) -> Result<Vec<f32>>,
    training: bool,
    side: &mut crate::nn::layers::Collected<B>,
) -> Result<Tensor<B, 3>> {
    let input = if b.post_norm { h.clone() } else { b.norm2.forward(h.clone()) };
    if b.moe.is_some() {
        // every rank routes alike (the router is whole); each expert's columns then rows on
        // this rank give a partial output, weighted and summed, then summed over the group
        // (experts without biases, no load-balancing loss: `lib::validate`)
        return match g(Act::D3(b.feed_forward(input, training, side)?), reduce)? {
            Act::D3(m) => Ok(h + b.branch_dropout(Half::Mlp, m, side)),
            _ => Err(ExecError::Shape("the experts of a tensor-parallel block must give [batch, seq, d]".into())),
        };
    }
    let mlp = match b.mlps.as_slice() {
        [mlp] => mlp,
        _ => return Err(ExecError::Plan("a dense transformer block has one MLP".into())),
    };
    let up = match mlp.fc1.forward_act(Act::D3(input))? {
        Act::D3(t) => b.activate(t),
        _ => {
            return Err(ExecError::Shape(
                "the first MLP layer of a tensor-parallel block must give [batch, seq, features]".into(),
            ))
        }
    };
    let m = mlp.fc2.add_bias(g(mlp.fc2.matmul_only(Act::D3(up))?, reduce)?);
    match m {
        Act::D3(m) => Ok(h + b.branch_dropout(Half::Mlp, m, side)),
        _ => Err(ExecError::Shape("the MLP of a tensor-parallel block must give [batch, seq, d]".into())),
    }
}

/// A post-norm block's norm on a residual sum `leaf` (replicated on every rank) as a segment
/// of its own, whose input gradient is complete; the next segment's leaf.
fn post_norm_segment<B: ExecBackend>(
    segments: &mut Vec<Segment<B>>,
    norm: &crate::nn::layers::Norm<B>,
    leaf: Act<B>,
) -> Result<Act<B>> {
    let Act::D3(t) = leaf.clone() else {
        return Err(ExecError::Shape("a transformer block's residual sum must be [batch, seq, d]".into()));
    };
    let out = Act::D3(norm.forward(t));
    segments.push(Segment::plain(leaf, out.clone(), Boundary::Complete));
    Ok(fresh(&out))
}

/// Block `b`'s `half` at layer `k` on `t`: untracked (and whether so) where `rerun` runs
/// it again in the backward.
fn half_of<B: ExecBackend>(
    rerun: Option<&Rerun<'_, B>>,
    (k, half): (usize, Half),
    b: &Block<B>,
    t: Tensor<B, 3>,
    reduce: &mut dyn FnMut(Vec<f32>) -> Result<Vec<f32>>,
    side: &mut crate::nn::layers::Collected<B>,
) -> Result<(Tensor<B, 3>, bool)> {
    let Some(r) = rerun.filter(|r| r.runs(k, half)) else { return Ok((run_half(b, half, t, reduce, side)?, false)) };
    let Some(Layer::ParallelBlock(untracked)) = r.untracked.layers.get(k) else {
        return Err(ExecError::Plan(format!("layer {k} of the stage is not a tensor-parallel block")));
    };
    let out = run_half(untracked, half, t.detach(), reduce, side)?.detach();
    (r.release)();
    Ok((out, true))
}

/// The forward of a tensor-parallel stage, cut into segments at every `f` point; with
/// `rerun`, the blocks' halves it names run untracked (their segments keep their input).
pub fn forward<B: ExecBackend>(
    model: &StageModel<B>,
    x: Act<B>,
    training: bool,
    reduce: &mut dyn FnMut(Vec<f32>) -> Result<Vec<f32>>,
    side: &mut crate::nn::layers::Collected<B>,
    rerun: Option<&Rerun<'_, B>>,
) -> Result<Vec<Segment<B>>> {
    // the stage's load-balancing losses, summed and detached, left in `side.aux`
    let mut reported: Option<Tensor<B, 1>> = None;
    let mut segments = Vec::new();
    let mut leaf = x.clone();
    let mut cur = x;
    let mut applied = 0usize; // layers applied since `leaf`
    let mut boundary = Boundary::Complete;
    let cut = |segments: &mut Vec<Segment<B>>,
               leaf: &mut Act<B>,
               cur: &mut Act<B>,
               applied: &mut usize,
               boundary: &mut Boundary,
               next: Boundary| {
        if *applied > 0 {
            segments.push(Segment::plain(leaf.clone(), cur.clone(), *boundary));
            *leaf = fresh(cur);
            *cur = leaf.clone();
        }
        *boundary = next;
        *applied = 0;
    };
    for (k, layer) in model.layers.iter().enumerate() {
        match layer {
            Layer::ColumnLinear(d) => {
                cut(&mut segments, &mut leaf, &mut cur, &mut applied, &mut boundary, Boundary::Sum);
                cur = d.forward_act(cur)?;
            }
            Layer::RowLinear(d) => {
                cur = d.add_bias(g(d.matmul_only(cur)?, reduce)?);
            }
            // this rank's rows of the table looked up, the others' summed in
            Layer::VocabEmbedding(e) => {
                let Act::Tokens(ids) = cur else {
                    return Err(ExecError::Shape("a vocabulary-parallel embedding needs token ids".into()));
                };
                cur = g(Act::D3(e.partial(ids.clone())), reduce)?;
                // the token types after the sum: the table is whole on every rank, and so
                // is its gradient
                if let (Some(types), Act::D3(t)) = (&e.types, &cur) {
                    cur = Act::D3(types.add(t.clone(), &ids)?);
                }
            }
            // this rank's logits: the loss is computed over the split (`vocab_parallel_loss`)
            Layer::VocabLinear(d) => {
                cut(&mut segments, &mut leaf, &mut cur, &mut applied, &mut boundary, Boundary::Sum);
                cur = d.forward_act(cur)?;
            }
            Layer::ParallelBlock(b) => {
                cut(&mut segments, &mut leaf, &mut cur, &mut applied, &mut boundary, Boundary::SumResidual);
                let Act::D3(t) = cur.clone() else {
                    return Err(ExecError::Shape("a transformer block needs [batch, seq, d]".into()));
                };
                let (h, again) = half_of(rerun, (k, Half::Attention), b, t, reduce, side)?;
                let h = Act::D3(h);
                segments.push(Segment {
                    leaf: leaf.clone(),
                    out: h.clone(),
                    boundary,
                    rerun: again.then_some((k, Half::Attention)),
                    aux: None,
                });
                leaf = fresh(&h);
                // post-norm: the norm of the residual sum is its own segment, replicated,
                // so the residual correction above sees the gradient at the sum itself
                if b.post_norm {
                    leaf = post_norm_segment(&mut segments, &b.norm1, leaf)?;
                }
                let Act::D3(t) = leaf.clone() else {
                    return Err(ExecError::Shape(
                        "a transformer block's attention half must give [batch, seq, d]".into(),
                    ));
                };
                let (y, again) = match training {
                    true => half_of(rerun, (k, Half::Mlp), b, t, reduce, side)?,
                    false => (mlp_half(b, t, reduce, false, side)?, false),
                };
                let y = Act::D3(y);
                // the experts' load-balancing loss: its value for the report, its graph for
                // the segment's backward (a half run again makes it again there)
                let made = side.aux.take();
                if let Some(a) = &made {
                    let a = a.clone().detach();
                    reported = Some(reported.map_or(a.clone(), |r| r + a));
                }
                // The residual correction needs the gradient at the block's own output, so
                // the segment ends there; what follows starts from a leaf whose gradient is
                // already complete (the block output is replicated).
                segments.push(Segment {
                    leaf: leaf.clone(),
                    out: y.clone(),
                    boundary: Boundary::SumResidual,
                    rerun: again.then_some((k, Half::Mlp)),
                    aux: made.filter(|_| !again),
                });
                leaf = fresh(&y);
                if b.post_norm {
                    leaf = post_norm_segment(&mut segments, &b.norm2, leaf)?;
                }
                cur = leaf.clone();
                boundary = Boundary::Complete;
                applied = 0;
                continue;
            }
            Layer::Stateless(st) => cur = stateless(&st.op, st.index, cur, side)?,
            other => cur = other.forward(cur, training, side)?,
        }
        applied += 1;
    }
    segments.push(Segment::plain(leaf, cur, boundary));
    side.aux = reported;
    Ok(segments)
}

/// The forward of a chain of layers cut before each layer in `cuts` (positions in
/// `layers`, rising, none 0): each segment after the first starts from a fresh leaf
/// copy of the one before's output, so each segment's backward runs on its own (a
/// stage's gradient buckets, `compute::backward_segments`).
pub fn forward_segments<B: ExecBackend>(
    model: &StageModel<B>,
    x: Act<B>,
    cuts: &[usize],
    training: bool,
    side: &mut crate::nn::layers::Collected<B>,
) -> Result<Vec<Segment<B>>> {
    if model.graph.is_some() {
        return Err(ExecError::Plan("gradient buckets need a chain of layers, not a graph".into()));
    }
    let mut segments = Vec::with_capacity(cuts.len() + 1);
    let (mut leaf, mut cur) = (x.clone(), x);
    for (k, layer) in model.layers.iter().enumerate() {
        if cuts.contains(&k) {
            segments.push(Segment::plain(leaf, cur.clone(), Boundary::Complete));
            leaf = fresh(&cur);
            cur = leaf.clone();
        }
        cur = layer.forward(cur, training, side)?;
    }
    segments.push(Segment::plain(leaf, cur, Boundary::Complete));
    Ok(segments)
}

mod vocab_loss;
pub use vocab_loss::vocab_parallel_loss;

#[cfg(test)]
mod tests;
