//! The worker's collectives, each handled here: a `Collective` instruction gathers what its
//! payload names of the stage and hands it to the communication engine's collective thread
//! (`comm`), which runs its kind over the group (`transport::Endpoint::collective`) while
//! this thread computes on; its `WaitCollective` takes the result back and puts it where the
//! payload says. The tensor-parallel sums inside a pass go through the same thread, waited
//! for at once, so each device's collectives keep one order.

use burn::prelude::*;
use pipec_plan::{CollectiveKind, CollectivePayload, DeviceId, GroupId, ReduceMode, StageId};

use crate::backend::kernels::ExecBackend;
use crate::comm::exchanger::{Reduction, Ticket};
use crate::comm::transport::Rounding;
use crate::error::{ExecError, Result};
use crate::interp::in_flight::{InFlight, Landing, ReplicaSum};
use crate::interp::stage::{
    set_tied_gradient, set_tied_gradient_shard, tied_gradient, tied_gradient_shard, StageState,
};
use crate::interp::worker::Worker;
use crate::nn::params::{flatten_grads, host_f32, layout, unflatten};
use crate::parallel::experts::Kept;
use crate::parallel::groups::members;

/// A collective in flight: its results to come (one per part of a sharded stage's data:
/// [`crate::parallel::zero::ShardLayout`]), and where they go.
/// Whether device `d` holds stage `s` (a replica, or a tensor-parallel member of one).
fn holds(s: &pipec_plan::plan::StagePlan, d: DeviceId) -> bool {
    s.replicas.contains(&d) || s.tensor_parallel.iter().any(|t| t.contains(&d))
}

/// The devices of the plan's collective group `group`, in member order.
fn not_sharded(stage: StageId) -> ExecError {
    ExecError::Plan(format!("{stage} is not sharded on this device"))
}

/// Where a collective's result goes, by payload.
impl<'a, B: ExecBackend> Worker<'a, B> {
    /// `Collective`: starts `kind` over `group` on what `payload` names of `stage`.
    pub(crate) fn start_collective(
        &mut self,
        kind: CollectiveKind,
        payload: CollectivePayload,
        stage: StageId,
        group: GroupId,
        code: usize,
    ) -> Result<()> {
        let members = members(self.plan, group)?;
        if self.transfers.collectives.contains_key(&(stage, group)) {
            return Err(ExecError::Plan(format!("{stage} starts a collective on {group} while its last is in flight")));
        }
        // a bucketed stage's backward started its buckets already
        if matches!(payload, CollectivePayload::Gradients | CollectivePayload::GradientShard) {
            if let Some(b) = self.take_buckets(stage) {
                let into = Landing::Buckets { buckets: b, members: members.len() };
                self.transfers.collectives.insert((stage, group), InFlight { payload, results: Vec::new(), into });
                return Ok(());
            }
        }
        if payload == CollectivePayload::Gradients {
            let (n, params) = (members.len(), self.state(stage)?.parameter_sizes()?.len());
            let sum = self.start_replica_sum(stage, members, 0..params, true, code)?;
            let into = Landing::Gradients { sum, members: n };
            self.transfers.collectives.insert((stage, group), InFlight { payload, results: Vec::new(), into });
            return Ok(());
        }
        // (a sharded stage's data comes in parts: `zero::ShardLayout`)
        let (parts, into) = match payload {
            CollectivePayload::Gradients => return Err(ExecError::Plan("gradients are summed above".into())),
            CollectivePayload::TiedGradient => self.tied_gradient_out(group, &members).map(|(d, i)| (vec![d], i))?,
            CollectivePayload::GradientShard => self.gradient_shard_out(stage)?,
            CollectivePayload::TiedGradientShard => self.tied_shard_out(group, &members).map(|(d, i)| (vec![d], i))?,
            CollectivePayload::Weights => {
                let shard = self.shard(stage)?;
                (shard.gather_inputs(|_| true)?, Landing::Weights)
            }
            CollectivePayload::GradNorm => (vec![vec![self.norm_share()? as f32]], Landing::GradNorm),
        };
        let round = self.gradient_rounding(parts.first().map_or(0, Vec::len), &into);
        let results = self.start_parts(stage, kind, members, parts, round, Some(code))?;
        self.transfers.collectives.insert((stage, group), InFlight { payload, results, into });
        Ok(())
    }

    /// Starts `kind` on each of `parts`: the first over `members` (its sums rounded by
    /// `round`), the others — a sharded stage's experts' ([`crate::parallel::zero::ShardLayout`]) —
    /// over the replicas holding them. Returns their results, in order.
    pub(crate) fn start_parts(
        &self,
        stage: StageId,
        kind: CollectiveKind,
        members: Vec<DeviceId>,
        mut parts: Vec<Vec<f32>>,
        round: Option<Rounding>,
        code: Option<usize>,
    ) -> Result<Vec<Ticket<Vec<f32>>>> {
        let rest = parts.split_off(1.min(parts.len()));
        let first = parts.pop().unwrap_or_default();
        let mut results = vec![self.comm.start_reduction(Reduction {
            kind,
            members,
            data: first,
            mode: self.transfers.reduce,
            sum: round,
            code,
        })?];
        results.extend(self.start_expert_parts(stage, kind, rest, code)?);
        Ok(results)
    }

    /// Starts `kind` (a reduce-scatter of gradients, an all-gather of weights) on each of
    /// `data`, the parts of `stage`'s shard past the first — its experts' — over the
    /// replicas holding them (a part of one replica's: its data as it is).
    fn start_expert_parts(
        &self,
        stage: StageId,
        kind: CollectiveKind,
        data: Vec<Vec<f32>>,
        code: Option<usize>,
    ) -> Result<Vec<Ticket<Vec<f32>>>> {
        if data.is_empty() {
            return Ok(Vec::new());
        }
        let holders = self
            .stages
            .get(&stage)
            .and_then(|st| st.experts.as_ref())
            .map(|h| h.holders.clone())
            .ok_or_else(|| ExecError::Plan(format!("{stage}'s shard has an experts' part and no expert group")))?;
        let precision = self.plan.training.grad_precision;
        data.into_iter()
            .map(|d| {
                if holders.len() <= 1 {
                    return Ok(Ticket::ready(d));
                }
                let round = (kind == CollectiveKind::ReduceScatter)
                    .then(|| Rounding::of_gradients(precision, kind, d.len(), holders.len(), 0))
                    .flatten();
                Ok(self.comm.start_reduction(Reduction {
                    kind,
                    members: holders.clone(),
                    data: d,
                    mode: self.transfers.reduce,
                    sum: round,
                    code,
                })?)
            })
            .collect()
    }

    /// How a collective of `n` values of gradients sums in the plan's `grad_precision`: its
    /// gradients rounded, the batch statistics that travel with them (after each replica's segment of
    /// a reduce-scatter, after everything in an all-reduce) not. None for fp32 and for what
    /// is not gradients.
    fn gradient_rounding(&self, n: usize, into: &Landing) -> Option<Rounding> {
        let precision = self.plan.training.grad_precision;
        if precision == pipec_plan::Precision::Fp32 {
            return None;
        }
        let of = |kind, members, n_stats| Rounding::of_gradients(precision, kind, n, members, n_stats);
        match into {
            Landing::GradientShard { members, n_stats, .. } => of(CollectiveKind::ReduceScatter, *members, *n_stats),
            Landing::TiedGradient { .. } | Landing::TiedGradientShard { .. } => of(CollectiveKind::AllReduce, 1, 0),
            Landing::Gradients { .. } | Landing::Weights | Landing::GradNorm | Landing::Buckets { .. } => None,
        }
    }

    /// `WaitCollective`: waits for `stage`'s collective on `group` and puts its result back.
    pub(crate) fn wait_collective(&mut self, payload: CollectivePayload, stage: StageId, group: GroupId) -> Result<()> {
        let c =
            self.transfers.collectives.remove(&(stage, group)).filter(|c| c.payload == payload).ok_or_else(|| {
                ExecError::Plan(format!("no {payload} collective of {stage} on {group} is in flight"))
            })?;
        let results = c.results.into_iter().map(Ticket::wait).collect::<std::result::Result<Vec<_>, _>>()?;
        // (a collective of one part: its one result)
        let first = |results: Vec<Vec<f32>>| results.into_iter().next().unwrap_or_default();
        match c.into {
            Landing::Gradients { sum, members } => {
                let dev = self.dev.clone();
                let st = self.state(stage)?;
                land_replica_sum(st, sum, &dev)?;
                st.contributions *= members;
                Ok(())
            }
            Landing::TiedGradient { held } => {
                let (plan, data) = (self.plan, first(results));
                for (s, layer) in held {
                    set_tied_gradient(self.state(s)?, plan, layer, &data)?;
                }
                Ok(())
            }
            Landing::GradientShard { covered, members, n_stats } => {
                let (dev, precision) = (self.dev.clone(), self.plan.training.grad_precision);
                let st = self.state(stage)?;
                let shard = st.shard.as_mut().ok_or_else(|| not_sharded(stage))?;
                let segment = shard.layout.joined_segment(results, n_stats)?;
                shard.add_gradients(&segment, &dev, precision)?;
                shard.contributions += covered * members;
                Ok(())
            }
            Landing::TiedGradientShard { held } => {
                let (plan, dev, data) = (self.plan, self.dev.clone(), first(results));
                for (s, layer) in held {
                    let st = self.state(s)?;
                    match &st.shard {
                        Some(_) => set_tied_gradient_shard(st, plan, layer, &data, &dev)?,
                        None => set_tied_gradient(st, plan, layer, &data)?,
                    }
                }
                Ok(())
            }
            Landing::Weights => {
                let st = self.state(stage)?;
                let whole = st.shard.as_ref().ok_or_else(|| not_sharded(stage))?.layout.whole(&results)?;
                crate::interp::sharded::restore_weights(st, whole)
            }
            Landing::Buckets { buckets, members } => self.buckets_in(stage, buckets, members),
            Landing::GradNorm => {
                let sum = first(results)
                    .first()
                    .copied()
                    .ok_or(ExecError::Missing("the gradient norm's sum came back empty"))?;
                // (a NaN stays NaN: f64::max would make it 0, and fp16's overflow check
                // must see it)
                let sum = f64::from(sum);
                self.progress.grad_norm = Some(if sum.is_nan() { sum } else { sum.max(0.0).sqrt() });
                Ok(())
            }
        }
    }

    /// This device's shard of `stage`.
    fn shard(&mut self, stage: StageId) -> Result<&mut crate::parallel::zero::ShardState<B>> {
        self.state(stage)?.shard.as_mut().ok_or_else(|| not_sharded(stage))
    }

    /// ZeRO: the stage's accumulated gradients (and batch statistics), laid out for the
    /// replicas' reduce-scatter; taken, so the next backward accumulates afresh. Ties within
    /// the stage and tensor-parallel partial sums are settled first (the shard keeps no
    /// whole gradient to settle them on later).
    fn gradient_shard_out(&mut self, stage: StageId) -> Result<(Vec<Vec<f32>>, Landing)> {
        self.settle(stage)?;
        let st = self.state(stage)?;
        let stats = st.statistics_message()?;
        // each gradient taken out and dropped once its chunks are placed, so that no second
        // copy of the stage's gradients is held beside the input
        let mut acc = std::mem::take(&mut st.acc);
        let shard = st.shard.as_ref().ok_or_else(|| not_sharded(stage))?;
        let data = shard.layout.scatter_input_from(0..shard.layout.params.len(), &stats, |k| {
            acc.get_mut(k).and_then(Option::take).map(|t| host_f32(t.into_data())).transpose()
        })?;
        st.acc = acc;
        let landing =
            Landing::GradientShard { covered: st.contributions, members: shard.layout.d, n_stats: stats.len() };
        st.clear_gradients();
        Ok((data, landing))
    }

    /// ZeRO: this device's part of a tied weight's sum over `group` (in the embedding's
    /// [vocab, d] orientation): a sharded stage's replicas each contribute their chunk in
    /// place (zeros elsewhere), so their chunks tile its reduced gradient once; an
    /// unsharded stage's first holder contributes its whole gradient.
    fn tied_shard_out(&mut self, group: GroupId, members: &[DeviceId]) -> Result<(Vec<f32>, Landing)> {
        let plan = self.plan;
        let (mut sum, mut held) = (None::<Vec<f32>>, Vec::new());
        for (s, layer) in self.tied_layers(group)? {
            held.push((s.id, layer));
            let first = members.iter().copied().find(|d| holds(s, *d)) == Some(self.device);
            let st = self.state(s.id)?;
            let g = match &st.shard {
                Some(_) => tied_gradient_shard(st, plan, layer)?,
                None if first => tied_gradient(st, plan, layer)?,
                None => {
                    let n = tied_gradient(st, plan, layer)?.len();
                    vec![0.0; n]
                }
            };
            let sum = sum.get_or_insert_with(|| vec![0.0; g.len()]);
            sum.iter_mut().zip(&g).for_each(|(x, y)| *x += y);
        }
        let sum = sum.ok_or(ExecError::Plan(format!("{} holds no layer tied by {group}", self.device)))?;
        Ok((sum, Landing::TiedGradientShard { held }))
    }

    /// The (stage, layer)s of a weight-tying group's two layers that this device holds.
    fn tied_layers(&self, group: GroupId) -> Result<Vec<(&'a pipec_plan::plan::StagePlan, usize)>> {
        let plan = self.plan;
        let g = plan
            .groups
            .iter()
            .find(|g| g.id == group)
            .ok_or_else(|| ExecError::Plan(format!("the plan has no {group}")))?;
        let [a, b] = g.tie.ok_or_else(|| ExecError::Plan(format!("{group} is not a weight-tying group")))?;
        let stage_of = |layer: usize| plan.stages.iter().find(|s| (s.layers[0]..s.layers[1]).contains(&layer));
        let mut out = Vec::new();
        for layer in [a, b] {
            let s = stage_of(layer).ok_or_else(|| ExecError::Plan(format!("no stage holds layer {layer}")))?;
            if self.stages.contains_key(&s.id) {
                out.push((s, layer));
            }
        }
        Ok(out)
    }

    /// This device's share of a tied weight's sum over the copies in `group` (in the
    /// embedding's [vocab, d] orientation): the first member holding each tied stage
    /// contributes it, every member holding one takes the sum.
    fn tied_gradient_out(&mut self, group: GroupId, members: &[DeviceId]) -> Result<(Vec<f32>, Landing)> {
        let plan = self.plan;
        let mut sum: Option<Vec<f32>> = None;
        let mut held = Vec::new();
        for (s, layer) in self.tied_layers(group)? {
            held.push((s.id, layer));
            let first = members.iter().copied().find(|d| holds(s, *d));
            let g = tied_gradient(self.state(s.id)?, plan, layer)?;
            let sum = sum.get_or_insert_with(|| vec![0.0; g.len()]);
            if first == Some(self.device) {
                sum.iter_mut().zip(&g).for_each(|(x, y)| *x += y);
            }
        }
        let sum = sum.ok_or(ExecError::Plan(format!("{} holds no layer tied by {group}", self.device)))?;
        Ok((sum, Landing::TiedGradient { held }))
    }

    /// Sums, over the tensor-parallel group, the gradients that are partial on each rank,
    /// in one all-reduce of the ones this rank holds (an expert's bias only where it holds
    /// the expert: the same on every rank of the group, which shares its experts), in the
    /// parameters' order.
    pub(crate) fn sum_partial_gradients(&mut self, stage: StageId) -> Result<()> {
        let Some(tp) = self.state(stage)?.tp.clone() else { return Ok(()) };
        if tp.partial_ids.is_empty() {
            return Ok(());
        }
        let reduce = self.transfers.reduce;
        let dev = self.dev.clone();
        let st = self.stages.get_mut(&stage).ok_or(ExecError::Missing("no stage"))?;
        let ids = layout::<B, _>(st.model()?);
        let (mut held, mut values) = (Vec::new(), Vec::new());
        for (i, (id, _)) in ids.iter().enumerate() {
            if !tp.partial_ids.contains(id) {
                continue;
            }
            let Some(Some(t)) = st.acc.get(i) else { continue };
            held.push((i, t.dims()[0]));
            values.extend(host_f32(t.clone().into_data())?);
        }
        let summed = self.comm.in_pass_all_reduce(&tp.members, values, reduce)?;
        let mut at = 0;
        for (i, n) in held {
            let part = summed.get(at..at + n).ok_or_else(|| {
                ExecError::Plan("the tensor-parallel sum of partial gradients came back short".into())
            })?;
            st.acc[i] = Some(Tensor::from_data(TensorData::new(part.to_vec(), [n]), &dev));
            at += n;
        }
        Ok(())
    }
}

impl<B: ExecBackend> Worker<'_, B> {
    /// Starts the replicas' sums of the gradients of `stage`'s parameters `range` over
    /// `members` (the stage's replica group; its batch statistics too with `stats`), in the
    /// plan's `grad_precision`; `code`: the instruction the trace shows them under.
    pub(crate) fn start_replica_sum(
        &mut self,
        stage: StageId,
        members: Vec<DeviceId>,
        range: std::ops::Range<usize>,
        stats: bool,
        code: usize,
    ) -> Result<ReplicaSum> {
        let (precision, reduce) = (self.plan.training.grad_precision, self.transfers.reduce);
        let st = self.state(stage)?;
        let sizes = st.parameter_sizes()?;
        let (everywhere, here) = match st.experts.as_ref().filter(|h| h.updates_alone()) {
            Some(h) => (
                h.positions(range.clone(), Kept::Everywhere),
                Some((h.positions(range.clone(), Kept::Here), h.holders.clone())),
            ),
            None => (range.clone().collect(), None),
        };
        let (flat, n_stats) = gradient_message(st, &sizes, &everywhere, stats)?;
        let here = match here {
            // alone with its experts: nothing to sum them with
            Some((positions, holders)) if holders.len() > 1 && !positions.is_empty() => {
                Some((gradient_message(st, &sizes, &positions, false)?.0, positions, holders))
            }
            _ => None,
        };
        let n = members.len();
        let round = Rounding::of_gradients(precision, CollectiveKind::AllReduce, flat.len(), n, n_stats);
        let ticket = self.comm.start_reduction(all_reduce(members, flat, reduce, round, code))?;
        let here = match here {
            Some((flat, positions, holders)) => {
                let n = holders.len();
                let round = Rounding::of_gradients(precision, CollectiveKind::AllReduce, flat.len(), n, 0);
                let t = self.comm.start_reduction(all_reduce(holders, flat, reduce, round, code))?;
                Some((positions, t))
            }
            None => None,
        };
        Ok(ReplicaSum { everywhere: (everywhere, ticket), here, n_stats })
    }
}

/// A [`ReplicaSum`]'s sums back into `st`'s accumulator, the batch statistics into the
/// stage's (a routed expert this member does not keep never had a gradient: its weights
/// are not in any pass here).
pub(crate) fn land_replica_sum<B: ExecBackend>(st: &mut StageState<B>, sum: ReplicaSum, dev: &B::Device) -> Result<()> {
    let sizes = st.parameter_sizes()?;
    let (positions, ticket) = sum.everywhere;
    land_gradient_message(st, &sizes, &positions, ticket.wait()?, sum.n_stats, dev)?;
    if let Some((positions, ticket)) = sum.here {
        land_gradient_message(st, &sizes, &positions, ticket.wait()?, 0, dev)?;
    }
    Ok(())
}

/// The value counts `sizes` gives for the parameters at `positions`.
fn sizes_at(sizes: &[usize], positions: &[usize]) -> Result<Vec<usize>> {
    let beyond = || ExecError::Plan("gradients past the stage's parameters".into());
    positions.iter().map(|&k| sizes.get(k).copied().ok_or_else(beyond)).collect()
}

/// What a replica all-reduce of a stage's parameters at `positions` (in its visiting order)
/// carries: their sums, zeros where a parameter has none; a presence flag each, so that a
/// parameter none of the replicas reached (an expert no token chose) stays without a
/// gradient and the optimizer skips it as on one device, while the zeros keep the members'
/// values lined up; then, with `stats`, the stage's batch statistics. Returns the message
/// and the statistics' count.
fn gradient_message<B: ExecBackend>(
    st: &StageState<B>,
    sizes: &[usize],
    positions: &[usize],
    stats: bool,
) -> Result<(Vec<f32>, usize)> {
    let part = sizes_at(sizes, positions)?;
    let held: Vec<_> = positions.iter().map(|&k| st.acc.get(k).cloned().flatten()).collect();
    let mut flat = flatten_grads::<B>(&held, &part)?;
    flat.extend(held.iter().map(|g| if g.is_some() { 1.0 } else { 0.0 }));
    let mut n_stats = 0;
    if stats {
        let s = st.statistics_message()?;
        n_stats = s.len();
        flat.extend(s);
    }
    Ok((flat, n_stats))
}

/// A [`gradient_message`]'s sum back: the sums into the accumulator at `positions` (none
/// where no member had one), the `n_stats` batch statistics after them into the stage's.
fn land_gradient_message<B: ExecBackend>(
    st: &mut StageState<B>,
    sizes: &[usize],
    positions: &[usize],
    mut data: Vec<f32>,
    n_stats: usize,
    dev: &B::Device,
) -> Result<()> {
    let short = || ExecError::Missing("fewer gradients came back than were sent");
    let stats = data.split_off(data.len().checked_sub(n_stats).ok_or_else(short)?);
    st.set_statistics(&stats, dev)?;
    let part = sizes_at(sizes, positions)?;
    let present = data.split_off(data.len().checked_sub(part.len()).ok_or_else(short)?);
    if st.acc.len() < sizes.len() {
        st.acc.resize(sizes.len(), None);
    }
    for ((&k, g), p) in positions.iter().zip(unflatten::<B::InnerBackend>(&data, &part, dev)?).zip(present) {
        st.acc[k] = (p > 0.0).then_some(g);
    }
    Ok(())
}

/// The replicas' all-reduce of a flat gradient message, as instruction `code`.
fn all_reduce(
    members: Vec<DeviceId>,
    data: Vec<f32>,
    mode: ReduceMode,
    sum: Option<Rounding>,
    code: usize,
) -> Reduction {
    Reduction { kind: CollectiveKind::AllReduce, members, data, mode, sum, code: Some(code) }
}
