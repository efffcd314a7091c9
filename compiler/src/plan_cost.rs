//! The simulator's cost model for a plan: each instruction's time from its stage's figures
//! (its kernels, and the tensor-parallel collectives inside its passes), the cluster's
//! links for messages, and the collectives over their groups.

use std::collections::HashMap;

use pipec_grammar::spec::Spec;
use pipec_plan::vocab::ReduceMode;
use pipec_plan::{CollectiveKind, DeviceId, GroupId, Instr, Phase};

use crate::cluster::{parameter_server_time, ClusterGraph, GroupShape};
use crate::figures::StageFigures;
use crate::model::ModelCosts;
use crate::simulate::CostModel;

/// The simulator's cost model for a plan.
pub(crate) struct PlanCost<'a> {
    pub(crate) stage_fb: &'a [(f64, f64)],
    /// Per stage, the tensor-parallel collectives' seconds in a forward and a backward.
    pub(crate) stage_tp: &'a [(f64, f64)],
    /// `StageFigures::recompute_tp`.
    recompute_tp: &'a [f64],
    /// `StageFigures::rerun`: what of a backward runs its forward again.
    rerun: &'a [f64],
    /// `StageFigures::weight_grads`: what of a backward its weight pass runs.
    weight_grads: &'a [f64],
    /// Per stage, the expert-parallel all-to-alls' seconds in a forward and a backward.
    pub(crate) stage_ep: &'a [(f64, f64)],
    /// Per stage, the context-parallel exchanges' seconds in a forward and a backward.
    pub(crate) stage_cp: &'a [(f64, f64)],
    /// Expert parallelism: the replica groups whose gradient reductions (an all-reduce;
    /// under ZeRO a reduce-scatter, and the weights' all-gather) carry the stage's routed
    /// experts' part (this share of their bytes) only over the members holding the same
    /// experts (those, and their shape on the cluster).
    expert_groups: HashMap<GroupId, (f64, Vec<DeviceId>, GroupShape)>,
    ep: usize,
    /// `moe_dispatch: deepep`: the experts each token chooses (the all-to-alls are priced
    /// as DeepEP sends them, `ClusterGraph::node_forwarded_time`); None: plain all-to-alls.
    deepep: Option<crate::cluster::DeepEpRouting>,
    chunks: pipec_plan::schedule::ChunkPlacement,
    /// The overlapped forward–backward pairs: DualPipe's, or Megatron-LM's combined 1F1B
    /// under `ep_overlap` (`Strategy::pairing`).
    pairing: Option<pipec_plan::schedule::Pairing>,
    /// Per stage, its expert-parallel layers' computation split as the combined 1F1B
    /// overlaps it (`StageFigures::moe_parts`).
    moe_parts: &'a [Vec<crate::figures::MoeParts>],
    pub(crate) stage_update: &'a [f64],
    /// Per stage, its gradient buckets (`StageFigures::buckets`).
    buckets: &'a [Vec<pipec_plan::plan::GradientBucket>],
    pub(crate) cluster: &'a ClusterGraph,
    pub(crate) reduce: ReduceMode,
    pub(crate) tp: usize,
    /// `Lowered::summed_over`.
    pub(crate) summed_over: HashMap<GroupId, Vec<DeviceId>>,
    /// Each group's shape on the cluster, found at its first collective (a simulation
    /// prices a group's collectives many times).
    shapes: std::cell::RefCell<HashMap<GroupId, GroupShape>>,
    /// On pipec's executor, the seconds an instruction waits for collectives the plan
    /// declares at it beyond its stage's figures, by device and instruction: ZeRO-3's
    /// gathers of a stage's whole weights (`with_stage_gathers`), the tensor-parallel sums
    /// at the update's side (`with_update_sums`), the row counts exchanged before an
    /// expert dispatch (`with_ep_counts`).
    in_line: HashMap<(DeviceId, Instr), f64>,
    /// Seconds of a microbatch's load: pipec's executor drawing its synthetic samples as
    /// training runs, where the device measured that ([`load_seconds`]); else 0.
    load: f64,
}

/// Seconds pipec's executor takes to draw one microbatch of the spec's synthetic data as
/// training runs (its inputs, or its labels: each draws the samples whole), at the device's
/// measured rates (`DeviceModel::data`, the CPU's `pipec calibrate`); 0 where the data come
/// from a file or are drawn once and kept (`pipec_plan::plan::synthetic_draw`), or the device
/// has no such rates.
pub(crate) fn load_seconds(spec: &Spec, device: &pipec_plan::device::DeviceModel, microbatch: usize) -> f64 {
    let (Some(rates), pipec_grammar::ast::Data::Synthetic { task, samples }) = (device.data, &spec.training.data)
    else {
        return 0.0;
    };
    let model = &spec.model;
    let vocab = model.token_vocab();
    let lm = pipec_plan::model::language_model_positions(&model.input, model.output_shape(), vocab).is_some()
        && *task == pipec_plan::Task::Classification;
    let values = (model.input.iter().product(), model.output_shape().iter().product());
    match pipec_plan::plan::synthetic_draw(*samples, values, vocab.is_some(), lm) {
        Some(d) => microbatch as f64 * rates.seconds((d.features, d.tokens, d.scores)),
        None => 0.0,
    }
}

impl<'a> PlanCost<'a> {
    /// The costs of a plan's instructions: its stages' figures, the cluster's links and the
    /// reduction.
    pub(crate) fn new(
        spec: &Spec,
        model: &'a ModelCosts,
        stages: &'a StageFigures,
        summed_over: HashMap<GroupId, Vec<DeviceId>>,
    ) -> Self {
        PlanCost {
            stage_fb: &stages.times,
            stage_tp: &stages.tp_times,
            recompute_tp: &stages.recompute_tp,
            rerun: &stages.rerun,
            weight_grads: &stages.weight_grads,
            stage_ep: &stages.ep_times,
            stage_cp: &stages.cp_times,
            expert_groups: HashMap::new(),
            ep: spec.strategy.ep_replicas(),
            deepep: crate::cluster::deepep_routing(spec),
            chunks: spec.strategy.schedule.kind.chunk_placement(),
            pairing: spec.strategy.pairing(),
            moe_parts: &stages.moe_parts,
            stage_update: &stages.update,
            buckets: &stages.buckets,
            cluster: &model.cluster,
            reduce: spec.strategy.schedule.reduce,
            tp: spec.strategy.tp.max(1),
            summed_over,
            shapes: Default::default(),
            in_line: HashMap::new(),
            load: load_seconds(spec, &model.cluster.device, model.microbatch_size),
        }
    }

    /// Prices ZeRO-3's gathers of stages' whole weights as pipec's executor runs them, where
    /// the plan declares them (`pipec_plan::in_pass::stage_gathers` over each device's
    /// `streams`; `stages.stage_gathers`, one gather's seconds; nothing for another engine,
    /// whose gathers the stage's figures price layer by layer): a pass gathering its own
    /// stage waits for the whole gather, and one whose weights were gathered ahead during
    /// the pass before waits for what that pass's computation did not cover.
    pub(crate) fn with_stage_gathers(
        mut self,
        streams: &std::collections::BTreeMap<DeviceId, Vec<Instr>>,
        stages: &StageFigures,
        recompute: &[bool],
    ) -> Self {
        let seconds = |s: pipec_plan::StageId| stages.stage_gathers.get(s.0 as usize).copied().unwrap_or(0.0);
        if stages.stage_gathers.iter().all(|g| *g <= 0.0) {
            return self;
        }
        let last = pipec_plan::StageId(stages.stage_gathers.len().saturating_sub(1) as u32);
        let sharded = |s: pipec_plan::StageId| stages.bytes.get(s.0 as usize).is_some_and(|b| b.replicas > 1);
        let recomputed = |s: pipec_plan::StageId| recompute.get(s.0 as usize).copied().unwrap_or(false);
        for (d, stream) in streams {
            let zero3 = pipec_plan::in_pass::zero3_stages(stream, sharded, recomputed, last);
            for g in pipec_plan::in_pass::stage_gathers(stream, &zero3) {
                let at = g.at as usize;
                let wait = if stream[at].stage() == g.stage {
                    (at, seconds(g.stage))
                } else {
                    // ahead: the pass it is for waits for what this pass did not cover
                    let Some(j) = pipec_plan::in_pass::next_reader(stream, at) else { continue };
                    (j, (seconds(g.stage) - self.compute(*d, &stream[at])).max(0.0))
                };
                *self.in_line.entry((*d, stream[wait.0].clone())).or_insert(0.0) += wait.1;
            }
        }
        self
    }

    /// Prices the exchange of per-expert row counts pipec's executor runs in a pass before
    /// each expert dispatch, at each dispatch the plan lists after the pass (`stages.
    /// ep_counts`, by the mixture's layer; the plan declares the exchange in the pass's
    /// `in_pass` list, beside the dispatch and the combine). Nothing for the other engines.
    pub(crate) fn with_ep_counts(
        mut self,
        streams: &std::collections::BTreeMap<DeviceId, Vec<Instr>>,
        stages: &StageFigures,
    ) -> Self {
        if stages.ep_counts.iter().all(Vec::is_empty) {
            return self;
        }
        for (d, stream) in streams {
            for ins in stream {
                let Instr::AllToAll { stage, layer, exchange: pipec_plan::TokenExchange::Dispatch, .. } = ins else {
                    continue;
                };
                let counts = stages.ep_counts.get(stage.0 as usize).and_then(|c| c.iter().find(|(l, _)| l == layer));
                if let Some(&(_, seconds)) = counts {
                    *self.in_line.entry((*d, ins.clone())).or_insert(0.0) += seconds;
                }
            }
        }
        self
    }

    /// Prices the tensor-parallel sums pipec's executor runs at the update's side where the
    /// plan declares them (`pipec_plan::in_pass::update_sums_of`, the declaration's own rule
    /// over each device's `streams`, with `stages.update_sums`' seconds for each partial
    /// gradient and `stages.norm_sum`'s for a stage's squared norm under
    /// `clip_each_update`): the instruction that sums waits for them in line. Nothing for
    /// the other engines (their figures hold no sums).
    pub(crate) fn with_update_sums(
        mut self,
        streams: &std::collections::BTreeMap<DeviceId, Vec<Instr>>,
        stages: &StageFigures,
        clip_each_update: bool,
    ) -> Self {
        if stages.update_sums.iter().all(Vec::is_empty) && stages.norm_sum <= 0.0 {
            return self;
        }
        for (d, stream) in streams {
            // every tensor-parallel stage the device holds (one with no partial gradient
            // still sums its norm under `clip_each_update`)
            let mut partial = std::collections::BTreeMap::new();
            for s in stream.iter().map(Instr::stage) {
                partial.entry(s).or_insert_with(|| stages.update_sums.get(s.0 as usize).cloned().unwrap_or_default());
            }
            let norm = |_: pipec_plan::StageId| stages.norm_sum;
            for (i, sums) in pipec_plan::in_pass::update_sums_of(stream, &partial, &norm, clip_each_update) {
                let seconds: f64 = sums.iter().sum();
                if seconds > 0.0 {
                    *self.in_line.entry((*d, stream[i].clone())).or_insert(0.0) += seconds;
                }
            }
        }
        self
    }

    /// Prices each replica group's gradient reductions as expert parallelism runs them:
    /// the routed experts' part (`expert_share` of a stage's bytes: its routed experts'
    /// parameters over all it holds) only over the members holding the same experts.
    pub(crate) fn with_expert_groups(
        mut self,
        groups: &std::collections::BTreeMap<GroupId, (pipec_plan::StageId, Vec<DeviceId>)>,
        ties: &std::collections::BTreeMap<GroupId, [usize; 2]>,
        expert_share: &[f64],
    ) -> Self {
        if self.ep > 1 {
            self.expert_groups = groups
                .iter()
                .filter(|(g, _)| !ties.contains_key(g))
                .filter_map(|(g, (s, members))| {
                    let share = expert_share.get(s.0 as usize).copied().filter(|&b| b > 0.0)?;
                    // the members the group sums over (all replicas, for a one-replica view)
                    let members = self.summed_over.get(g).unwrap_or(members);
                    let same: Vec<DeviceId> = self
                        .chunks
                        .same_experts(0, members.len(), self.ep)
                        .into_iter()
                        .filter_map(|i| members.get(i).copied())
                        .collect();
                    let shape = self.cluster.group_shape(&same);
                    Some((*g, (share, same, shape)))
                })
                .collect();
        }
        self
    }

    /// An all-reduce of `bytes` over `members`, whose shape on the cluster is `shape`:
    /// NCCL's ring, hierarchical across nodes (`ClusterGraph::collective_time`), or a
    /// parameter server on the slowest link.
    pub(crate) fn shaped_reduce_time(&self, members: &[DeviceId], shape: GroupShape, bytes: u64) -> f64 {
        match self.reduce {
            ReduceMode::Ring => self.cluster.shaped_collective_time(CollectiveKind::AllReduce, shape, bytes),
            ReduceMode::ParameterServer => {
                let link = self.cluster.link(self.cluster.group_level(members)).unwrap_or(self.cluster.intra);
                parameter_server_time(link, members.len(), bytes)
            }
        }
    }
}

impl PlanCost<'_> {
    /// Seconds of the all-to-alls a pass posts, from its stage's figures (what the
    /// simulator prices from the plan's own `AllToAll` instructions; the bounds read this).
    pub(crate) fn exchanged(&self, instr: &Instr) -> f64 {
        let (f, b) = self.stage_ep.get(instr.stage().0 as usize).copied().unwrap_or((0.0, 0.0));
        match instr.phase() {
            Phase::Forward | Phase::Recompute => f,
            Phase::Backward | Phase::BackwardInput => b,
            _ => 0.0,
        }
    }
}

impl PlanCost<'_> {
    /// An instruction's kernels and the collectives inside it, from its stage's figures.
    fn kernels(&self, instr: &Instr) -> f64 {
        if let Instr::LoadMicrobatch { .. } = instr {
            return self.load;
        }
        let s = instr.stage().0 as usize;
        let (f, b) = self.stage_fb.get(s).copied().unwrap_or((0.0, 0.0));
        let (tp_f, tp_b) = self.stage_tp.get(s).copied().unwrap_or((0.0, 0.0));
        let (cp_f, cp_b) = self.stage_cp.get(s).copied().unwrap_or((0.0, 0.0));
        let rerun = self.rerun.get(s).copied().unwrap_or(0.0).min(b);
        let weights = self.weight_grads.get(s).copied().unwrap_or(0.0).min(b - rerun).max(0.0);
        // (expert parallelism's all-to-alls are the plan's own instructions after the pass)
        let (tp_f, tp_b) = (tp_f + cp_f, tp_b + cp_b);
        match instr.phase() {
            Phase::Forward => f + tp_f,
            Phase::Recompute => f + cp_f + self.recompute_tp.get(s).copied().unwrap_or(0.0),
            Phase::Backward => b + tp_b,
            // the weight pass runs the weight gradients' kernels; the input pass everything
            // else: the input gradients, the backward of what has no weights (attention's
            // core, norms, activations, the loss), what recompute inside the blocks runs
            // again, and the collectives that complete the input gradient
            Phase::BackwardInput => b - weights + tp_b,
            Phase::BackwardWeight => weights,
            Phase::Optimizer => self.stage_update.get(s).copied().unwrap_or(0.0),
            _ => 0.0,
        }
    }
}

/// One expert layer of a forward paired with one of a backward as Megatron-LM's combined
/// 1F1B issues them (`TransformerLayerSchedulePlan.run`, megatron/core/models/common/
/// model_chunk_schedule_plan.py at d98e8a64): the compute stream runs the forward's
/// attention, the backward's MLP (its input gradient, then its weights'), the forward's MLP
/// and the backward's attention; the communication stream the backward's combine, the
/// forward's dispatch, the backward's dispatch and the forward's combine; each in order, and
/// each waiting for what it reads: the backward's MLP for its combine, the forward's
/// dispatch for its attention (the router), the backward's dispatch for its MLP's input
/// gradient, the forward's MLP for its dispatch, its combine for its MLP, the backward's
/// attention for its dispatch. Returns when both streams are done; the next layer pair
/// reads what this one's last steps make. `forward`: the forward's (dispatch, combine);
/// `backward`: the backward's (combine, dispatch), seconds. The MLP's backward is taken as
/// half its input gradient and half its weights'.
pub(crate) fn layer_pair(
    f: &crate::figures::MoeParts,
    b: &crate::figures::MoeParts,
    [dispatch, combine]: [f64; 2],
    [combine_grad, dispatch_grad]: [f64; 2],
) -> f64 {
    let (attention, mlp, mlp_back, attention_back) = (f.attention[0], f.mlp[0], b.mlp[1], b.attention[1]);
    // the backward's combine beside the forward's attention
    let start = attention.max(combine_grad);
    let dispatched = start + dispatch;
    let input_grad = start + mlp_back / 2.0;
    let dispatched_grad = dispatched.max(input_grad) + dispatch_grad;
    let mlp_done = (start + mlp_back).max(dispatched) + mlp;
    let combined = dispatched_grad.max(mlp_done) + combine;
    let attention_done = mlp_done.max(dispatched_grad) + attention_back;
    combined.max(attention_done)
}

impl CostModel for PlanCost<'_> {
    fn compute(&self, device: DeviceId, instr: &Instr) -> f64 {
        self.kernels(instr) + self.in_line(device, instr)
    }
    fn in_line(&self, device: DeviceId, instr: &Instr) -> f64 {
        if self.in_line.is_empty() {
            return 0.0;
        }
        self.in_line.get(&(device, instr.clone())).copied().unwrap_or(0.0)
    }
    /// DualPipe's pair: the two passes' computations one after the other, and their
    /// expert-parallel all-to-alls beside them on the other's computation (DeepSeek-V3
    /// overlaps a chunk's dispatch and combine with the other chunk's attention and MLP):
    /// the longer of the two.
    fn overlapped(&self, device: DeviceId, forward: &Instr, backward: &Instr, exchanged: f64) -> Option<f64> {
        self.pairing?;
        let whole = self.compute(device, forward) + self.compute(device, backward);
        Some(whole.max(exchanged))
    }
    /// Megatron-LM's combined 1F1B overlaps the two passes layer by layer
    /// (`TransformerLayerSchedulePlan.run`, megatron/core/models/common/
    /// model_chunk_schedule_plan.py): the k-th expert layer of the forward with the k-th of
    /// the backward (last to first), on a compute and a communication stream
    /// ([`layer_pair`]); what the layers do not pair (other layers, the tensor-parallel
    /// collectives, layers beyond the shorter pass's) runs one after the other. DualPipe's pairs keep
    /// [`overlapped`](CostModel::overlapped)'s whole overlap (DeepSeek-V3 tunes its
    /// communication's SMs until the exchanges hide).
    fn overlapped_exchanges(
        &self,
        device: DeviceId,
        (forward, backward): (&Instr, &Instr),
        (sent, returned): (&[f64], &[f64]),
    ) -> Option<f64> {
        let exchanged: f64 = sent.iter().chain(returned).sum();
        if self.pairing? != pipec_plan::schedule::Pairing::OtherTask {
            return self.overlapped(device, forward, backward, exchanged);
        }
        let parts = |i: &Instr| self.moe_parts.get(i.stage().0 as usize).map_or(&[][..], Vec::as_slice);
        let (f_layers, b_layers) = (parts(forward), parts(backward));
        // each layer's two exchanges: the forward's (dispatch, combine) first to last, the
        // backward's (combine, dispatch) last to first
        let pairs = f_layers.len().min(b_layers.len()).min(sent.len() / 2).min(returned.len() / 2);
        let mut paired = 0.0;
        let (mut computed, mut hidden) = (0.0, 0.0);
        for k in 0..pairs {
            let (f, b) = (&f_layers[k], &b_layers[b_layers.len() - 1 - k]);
            let (forward, backward) = ([sent[2 * k], sent[2 * k + 1]], [returned[2 * k], returned[2 * k + 1]]);
            paired += layer_pair(f, b, forward, backward);
            computed += f.attention[0] + f.mlp[0] + b.attention[1] + b.mlp[1];
            hidden += forward.iter().chain(&backward).sum::<f64>();
        }
        let whole = self.compute(device, forward) + self.compute(device, backward);
        Some(paired + (whole - computed).max(0.0) + (exchanged - hidden).max(0.0))
    }
    fn pairing(&self) -> Option<pipec_plan::schedule::Pairing> {
        self.pairing
    }
    fn transfer(&self, from: DeviceId, to: DeviceId, bytes: u64) -> f64 {
        self.cluster.p2p_time(from, to, bytes / self.tp as u64)
    }
    fn collective(&self, kind: CollectiveKind, group: GroupId, members: &[DeviceId], bytes: u64) -> f64 {
        let members = self.summed_over.get(&group).map_or(members, Vec::as_slice);
        if let (CollectiveKind::AllToAll, Some(routing)) = (kind, self.deepep) {
            return self.cluster.node_forwarded_time(members, bytes, routing);
        }
        let shape = *self.shapes.borrow_mut().entry(group).or_insert_with(|| self.cluster.group_shape(members));
        let time = |members: &[DeviceId], shape: GroupShape, bytes: u64| match kind {
            CollectiveKind::AllReduce => self.shaped_reduce_time(members, shape, bytes),
            _ => self.cluster.shaped_collective_time(kind, shape, bytes),
        };
        match self.expert_groups.get(&group).filter(|_| kind != CollectiveKind::AllToAll) {
            // the dense part over the group, then the experts' over the members holding the
            // same ones (`ep` apart)
            Some((share, same, same_shape)) => {
                let experts = ((bytes as f64 * share).round() as u64).min(bytes);
                time(members, shape, bytes - experts) + time(same, *same_shape, experts)
            }
            None => time(members, shape, bytes),
        }
    }
    fn gradient_buckets(&self, stage: pipec_plan::StageId) -> &[pipec_plan::plan::GradientBucket] {
        self.buckets.get(stage.0 as usize).map_or(&[], Vec::as_slice)
    }
}
