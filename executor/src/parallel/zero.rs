//! ZeRO in the executor: the replicas of a replicated stage shard its optimizer state and
//! master weights (stage 1), also its gradients (stage 2), and also its weights between
//! steps (stage 3).
//!
//! How a stage is cut ([`ShardLayout`]): each parameter's flattened values are cut into `d`
//! equal chunks, the last one padded with zeros, and replica `r` holds the `r`-th chunk of
//! every parameter, in visiting order — its segment. The `d` segments laid end to end are
//! what a reduce-scatter of the gradients takes (each replica ends with the sum of its own
//! segment) and what an all-gather of the weights gives back, so both collectives run on
//! equal chunks. The padding (at most `d − 1` values per parameter) is zero in the weights,
//! the gradients and every optimizer's state, so it stays zero. A stage with batch
//! normalisation appends its statistics to every segment: each replica gets their sum.
//!
//! Under expert parallelism the layout has two parts: the dense parameters cut so among
//! the stage's `d` replicas (part 0), and this member's own routed experts among the
//! replicas holding them (part 1); another position's experts are in neither (no chunk).
//! Each part has its own reduce-scatter and all-gather over its own replicas, and a
//! replica's segment is its part 0 chunks, then its part 1 chunks, then the statistics.
//!
//! The optimizer runs on the shard as on a module of its own ([`ShardParams`]: one flat
//! parameter per parameter of the stage, under the same id), so Burn's optimizers apply
//! the same element-wise update to the chunk that they apply to the whole tensor, and the
//! checkpoint records keep the ids the unsharded ones have.

use burn::module::{Module, Param, ParamId};
use burn::prelude::*;
use pipec_plan::vocab::Sharding;
use pipec_plan::{GroupId, Plan};

use crate::backend::kernels::ExecBackend;
use crate::error::{ExecError, Result};
use crate::nn::layers::StageModel;
use crate::nn::params;
pub(crate) use crate::parallel::groups::shard_group;
use crate::parallel::optim::{StageOptim, Storage};
pub(crate) use crate::parallel::zero_units::{gathers_per_product, zero3_gather, Zero3Gather};
use std::collections::HashMap;

/// One parameter of a sharded stage: its id, shape, value count, chunk length and the part
/// of the layout it is sharded in (None: another expert-parallel position's expert, which
/// this replica holds nothing of: chunk 0).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ShardParam {
    pub id: u64,
    pub shape: Vec<usize>,
    pub len: usize,
    pub chunk: usize,
    pub part: Option<usize>,
}

/// A group of replicas some of a stage's parameters are sharded over: its size and this
/// replica's rank in it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ShardPart {
    pub d: usize,
    pub rank: usize,
}

/// How a stage's parameters are cut among replicas (see the module's documentation): in
/// one part over the stage's `d` replicas, or, under expert parallelism, the dense
/// parameters in part 0 over the stage's replicas and this replica's routed experts in
/// part 1 over the replicas holding them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ShardLayout {
    /// Part 0's size and this replica's rank in it.
    pub d: usize,
    pub rank: usize,
    pub parts: Vec<ShardPart>,
    pub params: Vec<ShardParam>,
    /// Values of one replica's chunks (the sum of the chunk lengths).
    pub segment: usize,
}

impl ShardLayout {
    /// Every parameter's id and whole shape.
    pub fn whole_shapes(&self) -> Vec<(u64, Vec<usize>)> {
        self.params.iter().map(|p| (p.id, p.shape.clone())).collect()
    }

    /// The layout of parameters (id, shape) in visiting order among `d` replicas, for
    /// replica `rank`.
    pub fn new(params: &[(u64, Vec<usize>)], d: usize, rank: usize) -> Self {
        ShardLayout::split(params, &[ShardPart { d, rank }], |_| Some(0))
    }

    /// The layout of parameters (id, shape) in visiting order, parameter k sharded in part
    /// `part_of(k)` of `parts` (None: not held here).
    pub fn split(params: &[(u64, Vec<usize>)], parts: &[ShardPart], part_of: impl Fn(usize) -> Option<usize>) -> Self {
        let parts: Vec<ShardPart> = parts.iter().map(|p| ShardPart { d: p.d.max(1), rank: p.rank }).collect();
        let params: Vec<ShardParam> = params
            .iter()
            .enumerate()
            .map(|(k, (id, shape))| {
                let len: usize = shape.iter().product();
                let part = part_of(k).filter(|&i| i < parts.len());
                let chunk = part.map_or(0, |i| len.div_ceil(parts[i].d));
                ShardParam { id: *id, shape: shape.clone(), len, chunk, part }
            })
            .collect();
        let segment = params.iter().map(|p| p.chunk).sum();
        let first = parts.first().copied().unwrap_or(ShardPart { d: 1, rank: 0 });
        ShardLayout { d: first.d, rank: first.rank, parts, params, segment }
    }

    /// This replica's rank in the part parameter `k` is sharded in.
    pub fn rank_of(&self, k: usize) -> usize {
        self.params.get(k).and_then(|p| p.part).map_or(0, |i| self.parts[i].rank)
    }

    /// The positions of part `i`'s parameters, in visiting order.
    fn of_part(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        self.params.iter().enumerate().filter(move |(_, p)| p.part == Some(i)).map(|(k, _)| k)
    }

    /// The values of one replica's chunks in part `i`.
    #[cfg(test)]
    pub fn part_segment(&self, i: usize) -> usize {
        self.of_part(i).map(|k| self.params[k].chunk).sum()
    }

    /// Chunk `r` of parameter `k`'s whole values, padded with zeros to the chunk length.
    pub fn chunk(&self, k: usize, whole: &[f32], r: usize) -> Vec<f32> {
        let p = &self.params[k];
        let start = (r * p.chunk).min(whole.len());
        let end = ((r + 1) * p.chunk).min(whole.len());
        let mut out = whole[start..end].to_vec();
        out.resize(p.chunk, 0.0);
        out
    }

    /// Each part's reduce-scatter input: for each replica of the part in turn, its chunk of
    /// every parameter of the part (None: zeros), then (part 0 only) `stats`.
    #[cfg(test)]
    pub fn scatter_input(&self, whole: &[Option<Vec<f32>>], stats: &[f32]) -> Vec<Vec<f32>> {
        let all = self.scatter_input_from(0..self.params.len(), stats, |k| Ok(whole[k].clone()));
        all.expect("the values are given")
    }

    /// [`ShardLayout::scatter_input`] of the parameters in `range` (a gradient bucket's, or
    /// all), each parameter's whole values asked of `values` in turn and placed before the
    /// next is asked for (None: zeros), so that no more than one parameter's values are held
    /// beside the inputs being built: the inputs are allocated once at their size and
    /// written in place.
    pub fn scatter_input_from(
        &self,
        range: std::ops::Range<usize>,
        stats: &[f32],
        mut values: impl FnMut(usize) -> Result<Option<Vec<f32>>>,
    ) -> Result<Vec<Vec<f32>>> {
        // where each parameter's chunk starts within a replica's period of its part
        let mut offset = vec![0; self.params.len()];
        let mut period = vec![0; self.parts.len()];
        for (i, p) in period.iter_mut().enumerate() {
            for k in self.of_part(i).filter(|k| range.contains(k)) {
                offset[k] = *p;
                *p += self.params[k].chunk;
            }
        }
        let mut out: Vec<Vec<f32>> = (0..self.parts.len())
            .map(|i| {
                let stats = if i == 0 { stats } else { &[] };
                let mut buf = vec![0.0; self.parts[i].d * (period[i] + stats.len())];
                for r in 0..self.parts[i].d {
                    let at = r * (period[i] + stats.len()) + period[i];
                    buf[at..at + stats.len()].copy_from_slice(stats);
                }
                buf
            })
            .collect();
        for k in range {
            let (Some(i), Some(v)) = (self.params[k].part, values(k)?) else { continue };
            let (chunk, n_stats) = (self.params[k].chunk, if i == 0 { stats.len() } else { 0 });
            for r in 0..self.parts[i].d {
                let start = (r * chunk).min(v.len());
                let end = ((r + 1) * chunk).min(v.len());
                let at = r * (period[i] + n_stats) + offset[k];
                out[i][at..at + end - start].copy_from_slice(&v[start..end]);
            }
        }
        Ok(out)
    }

    /// This replica's segment — its chunks part by part (each part's in visiting order),
    /// then what follows them (the statistics) — cut into its chunk of each parameter (in
    /// visiting order; empty for one not held here) and the rest.
    pub fn split_segment<'a>(&self, segment: &'a [f32]) -> Result<(Vec<&'a [f32]>, &'a [f32])> {
        if segment.len() < self.segment {
            return Err(ExecError::Plan(format!(
                "a gradient shard of {} values for a segment of {}",
                segment.len(),
                self.segment
            )));
        }
        let mut chunks: Vec<&[f32]> = vec![&[]; self.params.len()];
        let mut at = 0;
        for i in 0..self.parts.len() {
            for k in self.of_part(i) {
                let n = self.params[k].chunk;
                chunks[k] = &segment[at..at + n];
                at += n;
            }
        }
        Ok((chunks, &segment[at..]))
    }

    /// A segment (see [`ShardLayout::split_segment`]) from this replica's chunk of each
    /// parameter (in visiting order) and what follows them.
    pub fn segment_of(&self, chunks: &[Vec<f32>], rest: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.segment + rest.len());
        for i in 0..self.parts.len() {
            for k in self.of_part(i) {
                out.extend_from_slice(chunks.get(k).map_or(&[][..], Vec::as_slice));
            }
        }
        out.extend_from_slice(rest);
        out
    }

    /// This replica's segment from its parts' reduce-scatter results (part 0's followed by
    /// `n_stats` statistics): the parts' chunks, then the statistics.
    pub fn joined_segment(&self, mut results: Vec<Vec<f32>>, n_stats: usize) -> Result<Vec<f32>> {
        let short = || ExecError::Plan("a reduce-scatter gave fewer values than its part's segment".into());
        let first = results.first_mut().ok_or_else(short)?;
        let stats = first.split_off(first.len().checked_sub(n_stats).ok_or_else(short)?);
        let mut out: Vec<f32> = results.concat();
        out.extend(stats);
        Ok(out)
    }

    /// Each part's all-gather input: this replica's chunk of each parameter of the part that
    /// `keep` names, asked of `chunk`, in visiting order (the others' chunks left out).
    pub fn part_inputs(
        &self,
        mut chunk: impl FnMut(usize) -> Result<Vec<f32>>,
        keep: impl Fn(usize) -> bool,
    ) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(self.parts.len());
        for i in 0..self.parts.len() {
            let mut v = Vec::new();
            for k in self.of_part(i).filter(|&k| keep(k)) {
                v.extend(chunk(k)?);
            }
            out.push(v);
        }
        Ok(out)
    }

    /// Every parameter's whole values from each part's all-gather of its replicas'
    /// segments (empty for a parameter not held here).
    pub fn whole(&self, gathered: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        self.whole_of(gathered, |_| true)
    }

    /// [`ShardLayout::whole`] from all-gathers of [`ShardLayout::part_inputs`]' inputs:
    /// the whole values of the parameters `keep` names (empty for the others).
    pub fn whole_of(&self, gathered: &[Vec<f32>], keep: impl Fn(usize) -> bool) -> Result<Vec<Vec<f32>>> {
        let mut out: Vec<Vec<f32>> = self.params.iter().map(|_| Vec::new()).collect();
        for (i, part) in self.parts.iter().enumerate() {
            let g = gathered.get(i).map_or(&[][..], Vec::as_slice);
            let kept: Vec<usize> = self.of_part(i).filter(|&k| keep(k)).collect();
            let n: usize = kept.iter().map(|&k| self.params[k].chunk).sum();
            if g.len() != part.d * n {
                return Err(ExecError::Plan(format!(
                    "{} gathered weight values for {} replicas' segments of {n}",
                    g.len(),
                    part.d
                )));
            }
            for r in 0..part.d {
                let mut at = r * n;
                for &k in &kept {
                    let c = self.params[k].chunk;
                    out[k].extend_from_slice(&g[at..at + c]);
                    at += c;
                }
            }
        }
        for (o, p) in out.iter_mut().zip(&self.params) {
            o.truncate(p.len);
        }
        Ok(out)
    }
}

/// A replica's shard of a stage as a module: one flat parameter per parameter of the stage
/// (its chunk), under the stage parameter's id.
#[derive(Module, Debug)]
pub(crate) struct ShardParams<B: Backend> {
    pub chunks: Vec<Param<Tensor<B, 1>>>,
}

impl<B: Backend> ShardParams<B> {
    /// The shard of chunks `values` (in the layout's order).
    pub fn new(layout: &ShardLayout, values: Vec<Vec<f32>>, dev: &B::Device) -> Self
    where
        B: burn::tensor::backend::AutodiffBackend,
    {
        let chunks = layout
            .params
            .iter()
            .zip(values)
            .map(|(p, v)| {
                let t = Tensor::<B, 1>::from_data(TensorData::new(v, [p.chunk]), dev).require_grad();
                Param::initialized(ParamId::from(p.id), t)
            })
            .collect();
        ShardParams { chunks }
    }
}

/// What a replica of a sharded stage keeps besides the stage's model.
pub(crate) struct ShardState<B: ExecBackend> {
    pub level: Sharding,
    pub group: GroupId,
    pub layout: ShardLayout,
    /// The master weights' chunks, and their optimizer.
    pub master: Option<ShardParams<B>>,
    pub optim: StageOptim<B, ShardParams<B>>,
    /// The reduced gradients' chunks summed since the last update (None: none yet).
    pub grad: Option<Vec<Tensor<B::InnerBackend, 1>>>,
    /// Microbatches whose gradients `grad` sums, over every replica.
    pub contributions: usize,
    /// Batch normalisation's statistics of those microbatches, summed, then their count
    /// (`StageState::statistics_message`'s layout); empty without batch normalisation.
    pub stats: Vec<f32>,
    /// Stage 3: whether the model holds the whole weights (gathered for this step's first
    /// pass, dropped at the update) — those not gathered per product.
    pub gathered: bool,
    /// Stage 3: the parameters (in the layout's order) gathered by each product that reads
    /// them rather than with the stage ([`per_product`]); the model holds a stand-in.
    pub per_product: Vec<bool>,
    /// Stage 3: what gathers them, for the current weights (None: not built yet, or the
    /// weights changed since).
    pub gatherer: Option<std::sync::Arc<Gatherer<B::InnerBackend>>>,
}

impl<B: ExecBackend> ShardState<B> {
    /// Replica `rank` of `d`'s shard of a stage whose model holds the whole weights (as
    /// built, or as loaded from a checkpoint): its chunks of them, and a fresh optimizer.
    ///
    /// Under expert parallelism (`experts`: the member's division of the stage, and this
    /// device) the dense parameters are sharded over the stage's replicas and the member's
    /// own experts over the replicas holding them; the other experts not at all here.
    pub fn new(
        plan: &Plan,
        model: &StageModel<B>,
        group: GroupId,
        rank: usize,
        d: usize,
        experts: Option<(&crate::parallel::experts::Holding, pipec_plan::DeviceId)>,
        dev: &B::Device,
    ) -> Result<Self> {
        let params = params::layout::<B, _>(model);
        let layout = match experts {
            Some((h, device)) => {
                let at =
                    h.holders.iter().position(|d| *d == device).ok_or(ExecError::Missing("a holder of its experts"))?;
                let parts = [ShardPart { d, rank }, ShardPart { d: h.holders.len(), rank: at }];
                ShardLayout::split(&params, &parts, |k| match h.kept.get(k) {
                    Some(crate::parallel::experts::Kept::Here) => Some(1),
                    Some(crate::parallel::experts::Kept::Elsewhere) => None,
                    _ => Some(0),
                })
            }
            None => ShardLayout::new(&params, d, rank),
        };
        let master = master_chunks(&layout, model, dev)?;
        let optim = StageOptim::new(&plan.training.optimizer, &layout.whole_shapes(), Storage::of(&plan.training));
        let per_product = vec![false; layout.params.len()];
        Ok(ShardState {
            level: plan.schedule.sharding,
            group,
            layout,
            master: Some(master),
            optim,
            grad: None,
            contributions: 0,
            stats: Vec::new(),
            gathered: true,
            per_product,
            gatherer: None,
        })
    }

    /// Adds a reduce-scatter's result (this replica's segment: its chunks of the sum, then
    /// the replicas' batch statistics summed) to the gradient shard and its statistics.
    pub fn add_gradients(&mut self, segment: &[f32], dev: &B::Device, precision: pipec_plan::Precision) -> Result<()> {
        let (chunks, stats) = self.layout.split_segment(segment)?;
        let landed: Vec<Tensor<B::InnerBackend, 1>> =
            chunks.iter().map(|c| Tensor::from_data(TensorData::new(c.to_vec(), [c.len()]), dev)).collect();
        // accumulated in the plan's `grad_precision`
        let mut sum: crate::nn::params::FlatGrads<B> = match self.grad.take() {
            Some(sum) => sum.into_iter().zip(landed).map(|(a, b)| Some(a + b)).collect(),
            None => landed.into_iter().map(Some).collect(),
        };
        crate::nn::params::round_grads::<B>(&mut sum, precision);
        self.grad = Some(sum.into_iter().flatten().collect());
        if self.stats.is_empty() {
            self.stats = stats.to_vec();
        } else if self.stats.len() == stats.len() {
            self.stats.iter_mut().zip(stats).for_each(|(a, b)| *a += b);
        } else {
            return Err(ExecError::Plan("batch statistics of another size came with a gradient shard".into()));
        }
        Ok(())
    }

    /// The all-gathers' inputs, part by part ([`ShardLayout::part_inputs`]): the master
    /// chunks, on the host, of the parameters `keep` names (only those are copied).
    pub fn gather_inputs(&self, keep: impl Fn(usize) -> bool) -> Result<Vec<Vec<f32>>> {
        let master = self.master.as_ref().ok_or(ExecError::Missing("the stage's shard is in use"))?;
        let chunk = |k: usize| {
            let p = master.chunks.get(k).ok_or(ExecError::Missing("a chunk of the shard"))?;
            crate::nn::params::host_f32(p.val().into_data())
        };
        self.layout.part_inputs(chunk, keep)
    }

    /// Drops the gradient shard without an update (a step fp16's loss scaling skips).
    pub fn skip(&mut self) {
        self.grad = None;
        self.contributions = 0;
    }

    /// One update of the master chunks from the gradient shard, scaled by `scale`; clears
    /// the gradient shard.
    pub fn update(&mut self, lr: f64, scale: f64) -> Result<()> {
        let master = self.master.take().ok_or(ExecError::Missing("the stage's shard is in use"))?;
        // (a parameter this replica holds nothing of has no state to update)
        let flat: Vec<Option<Tensor<B::InnerBackend, 1>>> = match self.grad.take() {
            Some(g) => g.into_iter().zip(&self.layout.params).map(|(g, p)| (p.chunk > 0).then_some(g)).collect(),
            None => Vec::new(),
        };
        self.master = Some(self.optim.update(lr, master, &flat, scale));
        self.contributions = 0;
        // (a pass after the update gathers the new weights)
        self.gatherer = None;
        Ok(())
    }
}

/// This replica's chunks of a model's whole weights.
pub(crate) fn master_chunks<B: ExecBackend>(
    layout: &ShardLayout,
    model: &StageModel<B>,
    dev: &B::Device,
) -> Result<ShardParams<B>> {
    let values = params::snapshot::<B, _>(model)?;
    if values.len() != layout.params.len() {
        return Err(ExecError::Plan(format!(
            "the stage has {} parameters and its shard layout {}",
            values.len(),
            layout.params.len()
        )));
    }
    let chunks = values.iter().enumerate().map(|(k, (_, _, v))| layout.chunk(k, v, layout.rank_of(k))).collect();
    Ok(ShardParams::new(layout, chunks, dev))
}

/// ZeRO-3: a copy of a stage's model without its weights (one value each stands in), for
/// what a recomputed forward keeps beside its input.
pub(crate) fn released_copy<B: ExecBackend>(model: &StageModel<B>) -> StageModel<B> {
    params::replace_params(model.clone(), |_| None::<(Vec<usize>, Vec<f32>)>).0
}

/// ZeRO-3's parameters gathered per product rather than with their stage: the weights of
/// the linear layers, of dense transformer blocks' projections (queries, keys and values,
/// output, MLP) and of LSTMs' gates, which nothing reads but
/// [`crate::backend::kernels::Kernels::dense`] (an LSTM's recurrent weight, read at every position,
/// stays gathered from one product to the next), and token embedding tables, which
/// nothing reads but [`crate::backend::kernels::Kernels::embed`]. Each product
/// then gathers its weight before it runs, in the forward, the recompute and (a product's,
/// not a lookup's: its gradient needs no table) again in the backward, and drops it after
/// (FSDP's unit is here one weight, the plan's one layer), so that the stage never holds
/// more than a product's weight whole; the stage's other parameters (norms, biases,
/// positional and token-type tables, convolutions, experts) are gathered with the stage
/// for its passes. Not either end of a tie (the tie's gradients are settled on
/// the tables' rows), and not a mixture of experts' (a member's tokens decide which
/// experts run, and the gathers of every replica must pair up).
pub(crate) fn per_product<B: ExecBackend>(plan: &Plan, model: &StageModel<B>, layout: &ShardLayout) -> Vec<bool> {
    use crate::nn::layers::Layer;
    let mut ids = std::collections::HashSet::new();
    for layer in &model.layers {
        match layer {
            Layer::Dense(d) => {
                ids.insert(d.weight.id);
            }
            Layer::Embedding(e) => {
                ids.insert(e.weight.id);
            }
            Layer::Lstm(l) => {
                ids.extend([l.w_ih.id, l.w_hh.id]);
            }
            Layer::Block(b) => {
                match &b.qkv {
                    crate::nn::block::Projections::Fused(p) => ids.insert(p.weight.id),
                    crate::nn::block::Projections::Latent(l) => {
                        let queries = l.input_queries.iter().chain(&l.latent_queries).map(|p| p.weight.id);
                        ids.extend(queries.chain([l.down.weight.id]));
                        ids.insert(l.kv_up.weight.id)
                    }
                };
                ids.insert(b.proj.weight.id);
                ids.extend(b.mlps.iter().flat_map(|m| [m.fc1.weight.id, m.fc2.weight.id]));
            }
            // gathered with the stage: small weights, weights read by more than a product
            // (a positional table, a convolution's), and tensor parallelism's shards (ZeRO-3
            // under tensor parallelism gathers whole stages)
            Layer::Conv(_)
            | Layer::Norm(_)
            | Layer::BatchNorm(_)
            | Layer::PosEmbedding(_)
            | Layer::Stateless(_)
            | Layer::ColumnLinear(_)
            | Layer::RowLinear(_)
            | Layer::ParallelBlock(_)
            | Layer::VocabEmbedding(_)
            | Layer::VocabLinear(_) => {}
        }
    }
    let of_layer = |id: u64| gathers_per_product(plan, (id >> 8) as usize);
    layout.params.iter().map(|p| ids.contains(&ParamId::from(p.id)) && of_layer(p.id) && p.shape.len() == 2).collect()
}

/// ZeRO-3 per product ([`per_product`]): a stage's weights each gathered whole from the
/// replicas' chunks when a product needs it. Every replica runs the same products in the
/// same order, so their all-gathers pair up. The gathered weight is kept until another is
/// asked for (a product reusing it is then no second gather), and while it is used the
/// next one is gathered ahead (FSDP's prefetch): the next weight in the stage's order in a
/// forward, the one before in a backward (a pass that moves down the order). After each
/// pass [`Gatherer::drop_kept`] drops both. Built for one version of the weights: the
/// backward of a forward gathers the weights that forward used.
pub(crate) struct Gatherer<I: burn::tensor::backend::Backend> {
    exchanger: crate::comm::exchanger::Exchanger,
    members: Vec<pipec_plan::DeviceId>,
    mode: pipec_plan::ReduceMode,
    layout: ShardLayout,
    /// This replica's chunk of each weight gathered per product, by parameter id, with the
    /// weight's position in the layout and in `order`.
    chunks: HashMap<u64, (usize, usize, Tensor<I, 1>)>,
    /// The weights gathered per product, in the layout's (the forward's) order.
    order: Vec<u64>,
    kept: std::sync::Mutex<Kept<I>>,
    /// The first gather that failed (a product cannot return it: the pass checks after).
    failure: std::sync::Mutex<Option<ExecError>>,
    gathers: std::sync::atomic::AtomicU32,
}

/// What a [`Gatherer`] holds between products: the last weight gathered, where it is in
/// the order, and the gather started ahead of the next product.
struct Kept<I: burn::tensor::backend::Backend> {
    weight: Option<(u64, burn::tensor::ops::FloatTensor<I>)>,
    at: Option<usize>,
    ahead: Option<(u64, crate::comm::exchanger::Ticket<Vec<f32>>)>,
}

impl<I: burn::tensor::backend::Backend> std::fmt::Debug for Gatherer<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gatherer of {} weights", self.chunks.len())
    }
}

impl<I: burn::tensor::backend::Backend> crate::backend::dense::WholeWeight<I> for Gatherer<I> {
    /// Weight `id` whole, in its shape: the one kept, or all-gathered now. A gather that
    /// fails is recorded ([`Gatherer::take_failure`]) and gives zeros.
    fn get(&self, id: u64) -> burn::tensor::ops::FloatTensor<I> {
        let mut kept = self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((k, w)) = kept.weight.as_ref() {
            if *k == id {
                return w.clone();
            }
        }
        // (the kept one goes first: no more than this one and the next are held whole)
        kept.weight = None;
        let ahead = kept.ahead.take().and_then(|(k, t)| (k == id).then_some(t));
        let at = self.chunks.get(&id).map(|(_, at, _)| *at);
        // the next weight of the pass: down the order after a later one (a backward) or
        // from the end, up it otherwise
        let down = match (kept.at, at) {
            (Some(before), Some(at)) => before > at,
            (None, Some(at)) => at + 1 == self.order.len() && at > 0,
            _ => false,
        };
        kept.at = at;
        let next = at.and_then(|at| if down { at.checked_sub(1) } else { Some(at + 1) });
        let w = ahead.map_or_else(|| self.start(id), Ok).and_then(|t| {
            // (started ahead before this one is waited for: the two overlap)
            if let Some(&n) = next.and_then(|n| self.order.get(n)) {
                kept.ahead = self.start(n).ok().map(|t| (n, t));
            }
            self.land(id, t)
        });
        let w = match w {
            Ok(w) => w,
            Err(e) => {
                let mut failure = self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                failure.get_or_insert(e);
                let shape = self.chunks.get(&id).map_or(vec![1, 1], |(k, _, _)| self.layout.params[*k].shape.clone());
                let dev = self.chunks.values().next().map(|(_, _, c)| c.device()).unwrap_or_default();
                return Tensor::<I, 2>::zeros([shape[0], shape[1]], &dev).into_primitive().tensor();
            }
        };
        kept.weight = Some((id, w.clone()));
        w
    }
}

impl<I: burn::tensor::backend::Backend> Gatherer<I> {
    /// The gatherer of `shard`'s weights gathered per product, at their current values.
    pub fn new<B: ExecBackend<InnerBackend = I>>(
        shard: &ShardState<B>,
        exchanger: crate::comm::exchanger::Exchanger,
        members: Vec<pipec_plan::DeviceId>,
        mode: pipec_plan::ReduceMode,
    ) -> Result<Self> {
        let master = shard.master.as_ref().ok_or(ExecError::Missing("the stage's shard is in use"))?;
        let (mut chunks, mut order) = (HashMap::new(), Vec::new());
        for (k, _) in shard.per_product.iter().enumerate().filter(|(_, g)| **g) {
            let chunk = master.chunks.get(k).ok_or(ExecError::Missing("a chunk of the shard"))?;
            let id = shard.layout.params[k].id;
            chunks.insert(id, (k, order.len(), chunk.val().inner()));
            order.push(id);
        }
        Ok(Gatherer {
            exchanger,
            members,
            mode,
            layout: shard.layout.clone(),
            chunks,
            order,
            kept: std::sync::Mutex::new(Kept { weight: None, at: None, ahead: None }),
            failure: std::sync::Mutex::new(None),
            gathers: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// Starts the all-gather of weight `id`.
    fn start(&self, id: u64) -> Result<crate::comm::exchanger::Ticket<Vec<f32>>> {
        let (_, _, chunk) =
            self.chunks.get(&id).ok_or_else(|| ExecError::Plan(format!("{id} is not gathered per product")))?;
        let values = params::host_f32(chunk.clone().into_data())?;
        self.gathers.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.exchanger.ledger().record(pipec_plan::PassOp::AllGather, pipec_plan::PeerDim::Shard, &self.members);
        Ok(self.exchanger.start_all_gather(&self.members, values, self.mode)?)
    }

    /// Weight `id` whole from its all-gather.
    fn land(
        &self,
        id: u64,
        ticket: crate::comm::exchanger::Ticket<Vec<f32>>,
    ) -> Result<burn::tensor::ops::FloatTensor<I>> {
        let (k, _, chunk) =
            self.chunks.get(&id).ok_or_else(|| ExecError::Plan(format!("{id} is not gathered per product")))?;
        let gathered = ticket.wait()?;
        let mut whole = self.layout.whole_of(&[gathered], |j| j == *k)?;
        let p = &self.layout.params[*k];
        let values = std::mem::take(&mut whole[*k]);
        Ok(Tensor::<I, 2>::from_data(TensorData::new(values, [p.shape[0], p.shape[1]]), &chunk.device())
            .into_primitive()
            .tensor())
    }

    /// Drops the weight kept since the last gather and the one gathered ahead (after each
    /// pass; a gather started ahead and not used still runs, on every replica alike).
    pub fn drop_kept(&self) {
        *self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
            Kept { weight: None, at: None, ahead: None };
    }

    /// The first gather that failed since the last call.
    pub fn take_failure(&self) -> Option<ExecError> {
        self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }

    /// How many gathers were started since the last call (one ahead and then not used
    /// included).
    pub fn take_gathers(&self) -> u32 {
        self.gathers.swap(0, std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests;
