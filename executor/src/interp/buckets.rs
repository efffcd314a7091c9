//! Data-parallel gradient buckets (PyTorch DDP's, `bucket` in the strategy). Where the
//! plan's replica all-reduce of a stage with `gradient_buckets` directly follows the
//! stage's backward (`pipec_plan::plan::reduced_in_buckets`: the step's last gradient of
//! the stage), each bucket's gradients go to the communication thread as soon as they are
//! complete, so the last layers' sums run while the first layers' gradients compute:
//! - a whole backward: the stage runs its forward cut at the buckets' bounds (each segment
//!   after the first from a fresh leaf) and its backward segment by segment, from the last;
//! - a weight-gradient pass (a split backward): the put-off products bucket by bucket.
//!
//! The `Collective` instruction that follows takes the buckets in flight; its wait puts
//! every bucket's sums back, as one all-reduce would.
//!
//! Burn's autodiff has no per-parameter hook to start a reduction from inside one backward
//! pass, which is why the pass is cut; the cut changes no value (the gradient at a cut is
//! handed on whole, as a pipeline stage's is).

use std::collections::HashSet;

use burn::backend::autodiff::NodeId;
use std::ops::Range;

use burn::prelude::*;
use pipec_plan::{CollectiveKind, GroupId, MicrobatchId, PassOp, PeerDim, StageId};

use crate::backend::kernels::ExecBackend;
use crate::comm::transport::Tag;
use crate::error::{ExecError, Result};
use crate::interp::collectives::land_replica_sum;
use crate::interp::in_flight::BucketsInFlight;
use crate::interp::values::{grad_of, input_grad, Forwarded, Saved, WeightGrads};
use crate::interp::worker::Worker;
use crate::nn::layers::{Act, StageModel};
use crate::nn::params::{
    accumulate, add_deferred_into_sums, backward_into_sums, collect_grads, host_f32, layout, sum_keys,
};

/// An activation's gradient back on the autodiff backend (untracked).
pub(crate) fn tracked<B: ExecBackend>(g: Act<B::InnerBackend>) -> Result<Act<B>> {
    Ok(match g {
        Act::D2(t) => Act::D2(Tensor::from_inner(t)),
        Act::D3(t) => Act::D3(Tensor::from_inner(t)),
        Act::D4(t) => Act::D4(Tensor::from_inner(t)),
        other => {
            return Err(ExecError::Shape(format!("no gradient of shape {:?} crosses a bucket's bound", other.dims())))
        }
    })
}

impl<'a, B: ExecBackend> Worker<'a, B> {
    /// Where `stage`'s forward is cut (positions in its layers, rising): before each
    /// bucket's first layer but the stage's own. None without buckets, where its buckets
    /// are fed by a weight-gradient pass (which needs no cut), or while evaluating.
    pub(crate) fn bucket_cuts(&self, stage: StageId) -> Option<Vec<usize>> {
        if !self.transfers.segmented.contains(&stage) || self.progress.evaluating.is_some() {
            return None;
        }
        let firsts = self.bucket_firsts(stage).filter(|f| !f.is_empty())?;
        let mut cuts: Vec<usize> = firsts.into_iter().filter(|&c| c > 0).collect();
        cuts.sort_unstable();
        Some(cuts)
    }

    /// Where each of `stage`'s buckets begins (a position in its layers), in the plan's order
    /// (the last layers' first).
    pub(crate) fn bucket_firsts(&self, stage: StageId) -> Option<Vec<usize>> {
        let s = self.plan.stage(stage)?;
        Some(s.gradient_buckets.iter().map(|b| b.layers[0].saturating_sub(s.layers[0])).collect())
    }

    /// Each of `stage`'s buckets' parameters (positions in the stage's visiting order), in
    /// the plan's order (the last layers' first), from the layers of `model`.
    pub(crate) fn bucket_params(&self, stage: StageId, model: &StageModel<B>) -> Result<Vec<Range<usize>>> {
        let s = self.plan.stage(stage).ok_or(ExecError::Plan(format!("the plan has no {stage}")))?;
        let per_layer: Vec<usize> = model.layers.iter().map(|l| layout::<B, _>(l).len()).collect();
        let before = |l: usize| per_layer[..l.saturating_sub(s.layers[0]).min(per_layer.len())].iter().sum::<usize>();
        Ok(s.gradient_buckets.iter().map(|b| before(b.layers[0])..before(b.layers[1])).collect())
    }

    /// The forward of a bucketed stage, cut at `cuts` (`StageModel::forward_segments`).
    pub(crate) fn forward_segmented(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        model: &StageModel<B>,
        x: Act<B>,
        cuts: &[usize],
    ) -> Result<Forwarded<B>> {
        let mut side = self.side(stage, mb);
        let segments = crate::parallel::tensor_parallel::forward_segments(model, x, cuts, true, &mut side)?;
        if side.aux.is_some() {
            return Err(ExecError::Plan(format!("{stage} has gradient buckets and a load-balancing loss")));
        }
        let out = segments.last().map(|s| s.out.clone()).ok_or(ExecError::Missing("the stage has no layers"))?;
        self.forwarded(stage, mb, out, side, move |loss, _| Saved::Segmented(segments, loss))
    }

    /// The backward of a segmented stage, segment by segment from the last, each
    /// segment's weight gradients added into the stage's sums as it finishes; leaves the
    /// input gradient to send. With `reduce` (the step's last gradient of the stage, its
    /// all-reduce over that group to follow), the microbatch's batch statistics are added
    /// too and each bucket's sums start their all-reduce as soon as its segment is done.
    pub(crate) fn backward_segments(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        reduce: Option<(GroupId, usize)>,
    ) -> Result<WeightGrads<B>> {
        let kept =
            self.passes.saved.get(&(stage, mb)).ok_or(ExecError::Missing("its forward's activations are missing"))?;
        let Saved::Segmented(segments, loss) = &kept.saved else {
            return Err(ExecError::Plan(format!("{stage}'s forward did not run in buckets")));
        };
        let (segments, loss, used) = (segments.clone(), loss.clone(), kept.model.clone());
        let keys = sum_keys(&used);
        // segment k (forward order) is the plan's bucket n − 1 − k (the last layers' first)
        let buckets = self.bucket_params(stage, &used)?;
        if buckets.len() != segments.len() {
            return Err(ExecError::Plan(format!("{stage}: {} segments for {} buckets", segments.len(), buckets.len())));
        }
        let params = |k: usize| buckets[buckets.len() - 1 - k].clone();
        let mut grad_out: Option<Act<B>> = None;
        for k in (0..segments.len()).rev() {
            let seg = &segments[k];
            let target = self.seed_at(stage, mb, &seg.out, grad_out.take(), loss.as_ref())?;
            let st = self.state(stage)?;
            let mut grads = backward_into_sums::<B>(&mut st.acc, &keys, || target.backward());
            accumulate::<B>(&mut st.acc, collect_grads(&used, &mut grads));
            if k > 0 {
                let g =
                    grad_of(&seg.leaf, &mut grads).ok_or(ExecError::Missing("no gradient reached a bucket's bound"))?;
                grad_out = Some(tracked::<B>(g)?);
            } else if stage.0 > 0 {
                let g = input_grad::<B>(&seg.leaf, &mut grads, Tag::gradient(stage, mb))?
                    .ok_or(ExecError::Missing("no gradient reached the stage input"))?;
                self.passes.input_grads.insert((stage, mb), g);
            }
            if let Some((group, code)) = reduce {
                if k == 0 {
                    self.count_contribution(stage, mb)?;
                }
                self.start_bucket(stage, group, params(k), k == 0, code)?;
            }
        }
        Ok(WeightGrads::all(Vec::new()))
    }

    /// The weight-gradient pass of a split backward (zero bubble, or a later stage that sends
    /// its input gradient first) when it is the stage's last gradient of the step: the put-off
    /// products bucket by bucket, the last layers' first, each bucket's all-reduce over
    /// `group` started as soon as its products are summed.
    pub(crate) fn weight_pass_in_buckets(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        grads: WeightGrads<B>,
        group: GroupId,
        code: usize,
    ) -> Result<()> {
        let st = self.state(stage)?;
        accumulate::<B>(&mut st.acc, grads.rest);
        let model = st.model()?.clone();
        let buckets = self.bucket_params(stage, &model)?;
        let (keys, mut deferred) = grads.deferred.unwrap_or_default();
        let n = buckets.len();
        for (i, range) in buckets.into_iter().enumerate() {
            let last = i + 1 == n;
            let part = if last {
                std::mem::take(&mut deferred)
            } else {
                let held: HashSet<NodeId> =
                    keys.get(range.clone()).unwrap_or_default().iter().flatten().copied().collect();
                deferred.take(&held)
            };
            add_deferred_into_sums::<B>(&mut self.state(stage)?.acc, &keys, part);
            if last {
                self.count_contribution(stage, mb)?;
            }
            self.start_bucket(stage, group, range, last, code)?;
        }
        Ok(())
    }

    /// Starts one bucket's reduction: an all-reduce of its parameters' sums (zeros where a
    /// parameter has none, with a presence flag each, as `gradients_out` sends them), or on
    /// a sharded stage (ZeRO) a reduce-scatter of them into the replicas' chunks, which
    /// takes them from the accumulator; after the last bucket's, the stage's batch
    /// statistics.
    pub(crate) fn start_bucket(
        &mut self,
        stage: StageId,
        group: GroupId,
        range: Range<usize>,
        last: bool,
        code: usize,
    ) -> Result<()> {
        let members = crate::parallel::groups::members(self.plan, group)?;
        let op = if self.state(stage)?.shard.is_none() { PassOp::AllReduce } else { PassOp::ReduceScatter };
        self.comm.ledger().record(op, PeerDim::Data, &members);
        let st = self.state(stage)?;
        if st.shard.is_none() {
            let sum = self.start_replica_sum(stage, members, range, last, code)?;
            self.transfers.buckets.entry(stage).or_insert_with(BucketsInFlight::new).sums.push(sum);
            return Ok(());
        }
        let (kind, flat, n_stats, covered) = {
            let stats = if last { st.statistics_message()? } else { Vec::new() };
            let mut acc = std::mem::take(&mut st.acc);
            let shard = st.shard.as_ref().ok_or(ExecError::Missing("the stage's shard"))?;
            let parts = shard.layout.scatter_input_from(range.clone(), &stats, |k| {
                acc.get_mut(k).and_then(Option::take).map(|t| host_f32(t.into_data())).transpose()
            })?;
            st.acc = acc;
            let covered = if last { st.contributions } else { 0 };
            if last {
                st.clear_gradients();
            }
            (CollectiveKind::ReduceScatter, parts, stats.len(), covered)
        };
        // summed in the plan's `grad_precision` (the statistics after the gradients in fp32)
        let precision = self.plan.training.grad_precision;
        let n = flat.first().map_or(0, Vec::len);
        let round = crate::comm::transport::Rounding::of_gradients(precision, kind, n, members.len(), n_stats);
        let tickets = self.start_parts(stage, kind, members, flat, round, Some(code))?;
        let b = self.transfers.buckets.entry(stage).or_insert_with(BucketsInFlight::new);
        b.parts.push((tickets, range));
        b.n_stats += n_stats;
        b.covered += covered;
        Ok(())
    }

    /// The buckets `stage`'s backward started, for its `Collective` instruction.
    pub(crate) fn take_buckets(&mut self, stage: StageId) -> Option<BucketsInFlight> {
        self.transfers.buckets.remove(&stage)
    }

    /// Every bucket's sums back into the stage's accumulator (`members` replicas
    /// contributed), the batch statistics after the last.
    pub(crate) fn buckets_in(&mut self, stage: StageId, b: BucketsInFlight, members: usize) -> Result<()> {
        let (dev, precision) = (self.dev.clone(), self.plan.training.grad_precision);
        let st = self.state(stage)?;
        if let Some(shard) = st.shard.as_mut() {
            // this replica's chunks of every bucket, laid out as one reduce-scatter of the
            // whole stage would have returned them: its segment, then the statistics
            let n = b.parts.len();
            let layout = &shard.layout;
            let mut chunks: Vec<Option<Vec<f32>>> = vec![None; layout.params.len()];
            let mut stats = Vec::new();
            for (i, (tickets, range)) in b.parts.into_iter().enumerate() {
                // each part's result: its parameters' chunks in the bucket, in visiting
                // order; the statistics after part 0's in the last bucket
                for (part, ticket) in tickets.into_iter().enumerate() {
                    let mut data = ticket.wait()?;
                    let ks: Vec<usize> = range.clone().filter(|&k| layout.params[k].part == Some(part)).collect();
                    let values: usize = ks.iter().map(|&k| layout.params[k].chunk).sum();
                    let last = i + 1 == n && part == 0;
                    if data.len() != values + if last { b.n_stats } else { 0 } {
                        return Err(ExecError::Plan(format!(
                            "a gradient bucket's reduce-scatter gave {} values for {values} of chunks",
                            data.len()
                        )));
                    }
                    if last {
                        stats = data.split_off(values);
                    }
                    let mut at = 0;
                    for k in ks {
                        let len = layout.params[k].chunk;
                        chunks[k] = Some(data[at..at + len].to_vec());
                        at += len;
                    }
                }
                // a parameter of no part (another position's expert) has no chunk
                for k in range.filter(|&k| layout.params[k].part.is_none()) {
                    chunks[k] = Some(Vec::new());
                }
            }
            let chunks = chunks
                .into_iter()
                .map(|c| c.ok_or(ExecError::Plan(format!("{stage}'s buckets do not cover its parameters"))))
                .collect::<Result<Vec<_>>>()?;
            let segment = layout.segment_of(&chunks, &stats);
            shard.add_gradients(&segment, &dev, precision)?;
            shard.contributions += b.covered * members;
            return Ok(());
        }
        for sum in b.sums {
            land_replica_sum(st, sum, &dev)?;
        }
        st.contributions *= members;
        Ok(())
    }
}
