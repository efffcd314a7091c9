//! Schedule and lowering: `Placement` → `Lowered`. One replica group per replicated stage,
//! the compute order (`schedule::generate`), the instruction streams (`lower`), weight
//! tying across stages, and the tensor-parallel members' copies of their leaders' streams.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::schedule::Updates;
use pipec_plan::vocab::{ScheduleKind, Sharding, SyncMode};
use pipec_plan::{CollectivePayload, DeviceId, GroupId, Instr, StageId};

use crate::figures::StageFigures;
use crate::lower::{lower, LowerInput};
use crate::partition::Layout;
use crate::schedule::{generate, send_gradients_first, Placement};

/// The streams and the collective groups they use.
pub(crate) struct Lowered {
    pub(crate) streams: BTreeMap<DeviceId, Vec<Instr>>,
    /// Every collective group with its stage and members (tensor-parallel shifted copies
    /// included), in id order.
    pub(crate) groups: BTreeMap<GroupId, (StageId, Vec<DeviceId>)>,
    /// The replica group of each stage's leaders (None: unreplicated, or asp).
    pub(crate) group_of: Vec<Option<GroupId>>,
    /// Weight-tying groups: the tied (embedding, output projection) layers each sums.
    pub(crate) ties: BTreeMap<GroupId, [usize; 2]>,
    /// A flush-free pipeline (`streams` is then its body).
    pub(crate) periodic: Option<crate::periodic::Periodic>,
    pub(crate) updates: Updates,
    /// Asynchronous data parallelism (a parameter server instead of replica groups).
    pub(crate) asp: bool,
    /// The groups whose simulated members are fewer than the devices they sum over (the
    /// strategy search simulates one pipeline replica of a symmetric plan): who the
    /// all-reduce's cost is for. Empty for a whole plan.
    pub(crate) summed_over: HashMap<GroupId, Vec<DeviceId>>,
    /// Per stage: activation recompute (the layout's).
    pub(crate) recompute: Vec<bool>,
    /// Validation's forward-only streams for one held-out batch (`eval_streams`).
    pub(crate) eval: Option<BTreeMap<DeviceId, Vec<Instr>>>,
    /// Per stage: its expert-parallel degree (`StageFigures::expert_parallel`).
    pub(crate) expert_parallel: Vec<usize>,
    /// Per stage: the all-to-alls its passes post (`StageFigures::all_to_alls`).
    pub(crate) all_to_alls: Vec<Vec<pipec_plan::ExpertExchange>>,
    /// The expert-parallel groups among `groups` (tensor-parallel shifted copies included).
    pub(crate) expert_groups: BTreeSet<GroupId>,
    /// The collectives inside each device's passes (`crate::in_pass`).
    pub(crate) in_pass: pipec_plan::in_pass::InPassTable,
}

impl Lowered {
    pub(crate) fn members(&self) -> HashMap<GroupId, Vec<DeviceId>> {
        self.groups.iter().map(|(g, (_, m))| (*g, m.clone())).collect()
    }

    /// The expert groups with their stages (what the verifier reads).
    pub(crate) fn expert_group_stages(&self) -> BTreeMap<GroupId, StageId> {
        self.expert_groups.iter().filter_map(|g| Some((*g, self.groups.get(g)?.0))).collect()
    }

    /// The expert group of `stage` that `device` is in.
    fn expert_group_of(&self, stage: StageId, device: DeviceId) -> Option<GroupId> {
        self.expert_groups
            .iter()
            .copied()
            .find(|g| self.groups.get(g).is_some_and(|(s, m)| *s == stage && m.contains(&device)))
    }

    /// The streams whose counts the memory check reads: a flush-free pipeline's over three
    /// steps (what is in flight across step boundaries), a step's otherwise.
    pub(crate) fn counted_streams(&self) -> std::borrow::Cow<'_, BTreeMap<DeviceId, Vec<Instr>>> {
        match &self.periodic {
            Some(p) => std::borrow::Cow::Owned(crate::periodic::unroll(p, 3)),
            None => std::borrow::Cow::Borrowed(&self.streams),
        }
    }
}

/// Schedule and lowering: `Placement` → `Lowered` (one replica group per replicated stage,
/// the compute order, the instruction streams). `summed` holds each stage's replicas, whose
/// gradients its all-reduce sums: `placement.replicas` for a whole plan, the whole plan's
/// for one replica of it (`one_replica`).
pub(crate) fn lower_streams(
    spec: &Spec,
    layout: &Layout,
    placement: &Placement,
    summed: &[Vec<DeviceId>],
    stages: &StageFigures,
    precision: usize,
) -> Lowered {
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    let asp = kind == ScheduleKind::DpOnly && strategy.schedule.sync == SyncMode::Asp;
    let ranks = layout.replicas.len();
    let updates = kind.updates(ranks);
    let mut groups = BTreeMap::new();
    let mut group_of = vec![None; placement.stages()];
    let mut summed_over = HashMap::new();
    if !asp {
        // the parameter server of asp takes the place of the replica group
        for (s, (replicas, summed)) in placement.replicas.iter().zip(summed).enumerate() {
            if summed.len() > 1 {
                let g = GroupId(groups.len() as u32);
                groups.insert(g, (StageId(s as u32), replicas.clone()));
                group_of[s] = Some(g);
                if summed != replicas {
                    summed_over.insert(g, summed.clone());
                }
            }
        }
    }
    let gradient_bytes: Vec<u64> = stages.bytes.iter().map(|b| b.whole.gradients).collect();
    let weight_bytes: Vec<u64> = stages.bytes.iter().map(|b| b.whole.weights).collect();
    let streams = if asp {
        crate::lower::lower_asp(placement, gradient_bytes[0], strategy.schedule.staleness)
    } else {
        let mut order = generate(kind, placement, ranks, backward_slots(&stages.times), strategy.combined_1f1b());
        if sends_gradients_first(spec, ranks) {
            send_gradients_first(&mut order);
        }
        lower(&LowerInput {
            placement,
            order: &order,
            output_bytes: &stages.output_bytes,
            gradient_bytes: &gradient_bytes,
            weight_bytes: &weight_bytes,
            sharding: strategy.sharding,
            groups: &group_of,
            updates,
            recompute: &layout.recompute,
            vertical_sync: strategy.schedule.vertical_sync,
            overlap: strategy.overlap,
            pairing: strategy.pairing(),
        })
    };
    let periodic = runs_flush_free(spec)
        .then(|| {
            crate::periodic::build(&crate::periodic::PeriodicInput {
                kind,
                placement,
                ranks,
                output_bytes: &stages.output_bytes,
                gradient_bytes: &gradient_bytes,
                groups: &group_of,
                updates,
                recompute: &layout.recompute,
                overlap: strategy.overlap,
            })
            .ok()
        })
        .flatten();
    let streams = match &periodic {
        Some(p) => p.body.clone(),
        None => streams,
    };
    let mut lowered = Lowered {
        streams,
        groups,
        group_of,
        ties: BTreeMap::new(),
        periodic,
        updates,
        asp,
        summed_over,
        recompute: layout.recompute.clone(),
        eval: None,
        expert_parallel: stages.expert_parallel.clone(),
        all_to_alls: stages.all_to_alls.clone(),
        expert_groups: BTreeSet::new(),
        in_pass: Default::default(),
    };
    tied_all_reduces(spec, layout, placement, summed, &mut lowered, precision);
    expert_all_to_alls(spec, placement, summed, &mut lowered);
    lowered
}

/// Expert parallelism: one group per expert group of each expert-parallel stage's replicas
/// (`ChunkPlacement::expert_group`), and after every pass of such a stage the all-to-alls
/// it posts over its device's group ([`Instr::all_to_alls_of`]). One replica of a plan
/// (`summed` has more) stands for its first expert group: its group has the one member and
/// is priced over the whole group's devices (`Lowered::summed_over`).
fn expert_all_to_alls(spec: &Spec, placement: &Placement, summed: &[Vec<DeviceId>], lowered: &mut Lowered) {
    let chunks = spec.strategy.schedule.kind.chunk_placement();
    for (s, replicas) in placement.replicas.iter().enumerate() {
        let ep = lowered.expert_parallel.get(s).copied().unwrap_or(1);
        if ep <= 1 || lowered.all_to_alls.get(s).is_none_or(Vec::is_empty) {
            continue;
        }
        let of = |devices: &[DeviceId], i: usize| -> Option<Vec<DeviceId>> {
            chunks.expert_group(i, ep).0.into_iter().map(|j| devices.get(j).copied()).collect()
        };
        // each replica's group among the whole plan's replicas of the stage; a view of one
        // replica (fewer than those) gives each simulated replica a group of its own priced
        // over its whole group
        let whole = summed.get(s).filter(|w| !w.is_empty()).unwrap_or(replicas);
        let view = whole != replicas;
        let mut made: Vec<(Vec<DeviceId>, Option<Vec<DeviceId>>)> = Vec::new();
        // with whole experts (`etp: 1`) the group's devices are every tensor-parallel rank of
        // its replicas (consecutive after each leader), which its exchanges are priced over
        let (tp, folded) = (spec.strategy.tp, spec.strategy.experts_whole());
        let devices = |leaders: Vec<DeviceId>| -> Vec<DeviceId> {
            leaders.into_iter().flat_map(|d| crate::place::tensor_parallel_devices(d, tp)).collect()
        };
        for r in replicas {
            let Some(group) = whole.iter().position(|d| d == r).and_then(|k| of(whole, k)) else { continue };
            let members = if view { vec![*r] } else { group.clone() };
            if !made.iter().any(|(m, _)| *m == members) {
                let priced = if folded { Some(devices(group)) } else { view.then_some(group) };
                made.push((members, priced));
            }
        }
        for (members, sums) in made {
            let g = GroupId(lowered.groups.len() as u32);
            lowered.groups.insert(g, (StageId(s as u32), members));
            lowered.expert_groups.insert(g);
            if let Some(whole) = sums {
                lowered.summed_over.insert(g, whole);
            }
        }
    }
    if lowered.expert_groups.is_empty() {
        return;
    }
    let streams = std::mem::take(&mut lowered.streams);
    lowered.streams = streams.into_iter().map(|(d, stream)| (d, with_all_to_alls(lowered, d, stream))).collect();
}

/// `stream` of `device` with the all-to-alls each pass of an expert-parallel stage posts
/// right after it.
fn with_all_to_alls(lowered: &Lowered, device: DeviceId, stream: Vec<Instr>) -> Vec<Instr> {
    let mut out = Vec::with_capacity(stream.len());
    for ins in stream {
        let stage = ins.stage();
        let posted = match (lowered.all_to_alls.get(stage.0 as usize), lowered.expert_group_of(stage, device)) {
            (Some(layers), Some(group)) => Instr::all_to_alls_of(&ins, layers, group),
            _ => Vec::new(),
        };
        out.push(ins);
        out.extend(posted);
    }
    out
}

/// Whether PipeDream or 2BW runs as one continuous pipeline, its streams a steady state's,
/// rather than flushing every step (vertical sync and tensor parallelism keep a flush).
pub(crate) fn runs_flush_free(spec: &Spec) -> bool {
    let strategy = &spec.strategy;
    matches!(strategy.schedule.kind, ScheduleKind::PipeDream | ScheduleKind::TwoBw)
        && !strategy.schedule.vertical_sync
        && strategy.tp.max(1) == 1
}

/// Whether a later stage sends its input gradient before it computes its weight gradients
/// (`schedule::send_gradients_first`): with `overlap` (the default), on a schedule that
/// updates once per step and does not split its backward already, without tensor
/// parallelism (whose backward runs segment by segment with its all-reduces), nor the
/// combined 1F1B (`ep_overlap`), whose pairs are whole backwards.
pub(crate) fn sends_gradients_first(spec: &Spec, pipeline_ranks: usize) -> bool {
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    strategy.overlap
        && kind.updates(pipeline_ranks) == Updates::PerStep
        && !kind.splits_backward()
        && strategy.tp.max(1) == 1
        // the combined 1F1B pairs whole backwards (Megatron-LM's runs each layer's weight
        // gradient inside its backward's step)
        && !strategy.combined_1f1b()
}

/// The stage holding layer `i`.
pub(crate) fn stage_of(layout: &Layout, i: usize) -> usize {
    layout.ranges.iter().position(|r| r.contains(&i)).unwrap_or(0)
}

/// Weight tying across stages needs every copy to update together: a synchronous schedule.
pub(crate) fn check_ties(spec: &Spec, layout: &Layout) -> Result<(), Vec<Diagnostic>> {
    let kind = spec.strategy.schedule.kind;
    if kind.updates_per_step() {
        return Ok(());
    }
    for (b, l) in spec.model.layers.iter().enumerate() {
        let Some(a) = l.tied else { continue };
        if stage_of(layout, a) != stage_of(layout, b) {
            return Err(vec![Diagnostic::error(
                "E0411",
                format!(
                    "layer {b} is tied to the embedding (layer {a}) on another stage, and `{}` updates each stage on its own clock, so the two copies would drift apart",
                    kind.name()
                ),
                spec.strategy.schedule.span,
                "an asynchronous schedule",
            )
            .with_label(l.span, "tied here")
            .with_help("use a synchronous schedule (gpipe, 1f1b, interleaved, ...), or a partition that keeps the embedding and the tied layer on one stage")]);
        }
    }
    Ok(())
}

/// Weight tying across stages: a group of every device holding the embedding's or the tied
/// projection's stage, and on each of them, after the step's replica all-reduces, an
/// all-reduce of the tied gradient and its wait, followed by the optimizer steps of the
/// tied stages (moved behind them, with ZeRO's weight gathers that follow them). Under ZeRO
/// the tied gradient is summed shard by shard (`TiedGradientShard`).
/// Ties within one stage need no communication: the executor sums the two gradients.
pub(crate) fn tied_all_reduces(
    spec: &Spec,
    layout: &Layout,
    placement: &Placement,
    summed: &[Vec<DeviceId>],
    lowered: &mut Lowered,
    precision: usize,
) {
    let union = |a: &[DeviceId], b: &[DeviceId]| -> Vec<DeviceId> {
        let mut members = a.to_vec();
        members.extend(b.iter().filter(|d| !a.contains(d)));
        members
    };
    for (b, l) in spec.model.layers.iter().enumerate() {
        let Some(a) = l.tied else { continue };
        let (sa, sb) = (stage_of(layout, a), stage_of(layout, b));
        if sa == sb {
            continue;
        }
        let members = union(&placement.replicas[sa], &placement.replicas[sb]);
        let group = GroupId(lowered.groups.len() as u32);
        let sums = union(&summed[sa], &summed[sb]);
        if sums != members {
            lowered.summed_over.insert(group, sums);
        }
        lowered.groups.insert(group, (StageId(sb as u32), members.clone()));
        lowered.ties.insert(group, [a, b]);
        // with the vocabulary split over tensor parallelism, each rank's shard
        let tp = spec.strategy.tp.max(1);
        let ops: Vec<_> = spec.model.layers.iter().map(|l| l.op.clone()).collect();
        let vocab_split = pipec_plan::model::stage_tp_splits(&ops, 0..ops.len(), spec.model.loss, tp)
            .is_ok_and(|s| s.get(a) == Some(&pipec_plan::model::TpSplit::Vocab));
        let shard = if vocab_split { tp } else { 1 };
        let bytes = (l.op.parameter_count() as usize * precision / shard) as u64;
        let tied = [StageId(sa as u32), StageId(sb as u32)];
        let sharded = |s: usize| spec.strategy.sharding != Sharding::None && lowered.group_of[s].is_some();
        let payload = if sharded(sa) || sharded(sb) {
            CollectivePayload::TiedGradientShard
        } else {
            CollectivePayload::TiedGradient
        };
        for d in members {
            let Some(stream) = lowered.streams.get_mut(&d) else { continue };
            let held: Vec<StageId> = tied.iter().copied().filter(|s| stream.iter().any(|i| i.stage() == *s)).collect();
            // the updates of the tied stages, and the gathers of the weights they update
            let update = |i: &Instr| {
                held.contains(&i.stage())
                    && matches!(
                        i,
                        Instr::OptimizerStep { .. }
                            | Instr::ShardStep { .. }
                            | Instr::Collective { payload: CollectivePayload::Weights, .. }
                            | Instr::WaitCollective { payload: CollectivePayload::Weights, .. }
                    )
            };
            let steps: Vec<Instr> = stream.iter().filter(|i| update(i)).cloned().collect();
            stream.retain(|i| !update(i));
            stream.push(Instr::collective(payload, held[0], group, bytes));
            stream.push(Instr::wait(payload, held[0], group));
            stream.extend(steps);
        }
    }
}

/// Validation's streams for one held-out batch (`training.validation`): per device its
/// forwards in (microbatch, stage) order — each waits only for pairs earlier in that order,
/// so none waits in a cycle — each followed by a free, lowered as a step's are (loads,
/// receives right before, sends after), without updates; tensor-parallel members run their
/// leader's, shifted.
pub(crate) fn eval_streams(
    spec: &Spec,
    placement: &Placement,
    stages: &StageFigures,
    lowered: &Lowered,
) -> BTreeMap<DeviceId, Vec<Instr>> {
    let n = placement.stages();
    let mut order: crate::schedule::Order = vec![Vec::new(); placement.devices];
    for m in 0..placement.microbatches {
        for s in 0..n {
            let d = placement.device_of(s, m).0 as usize;
            order[d].push(crate::schedule::Task {
                kind: crate::schedule::TaskKind::Forward,
                stage: StageId(s as u32),
                mb: pipec_plan::MicrobatchId(m as u32),
            });
        }
    }
    let zeros = vec![0; n];
    let streams = lower(&LowerInput {
        placement,
        order: &order,
        output_bytes: &stages.output_bytes,
        gradient_bytes: &zeros,
        weight_bytes: &zeros,
        sharding: Sharding::None,
        groups: &vec![None; n],
        updates: Updates::PerStep,
        recompute: &vec![false; n],
        vertical_sync: false,
        overlap: false,
        pairing: None,
    });
    let tp = spec.strategy.tp.max(1) as u32;
    let mut out = BTreeMap::new();
    // the leaders' streams (the others are empty until their leader's is copied to them)
    for (d, stream) in streams.into_iter().filter(|(_, s)| !s.is_empty()) {
        let mut eval = Vec::with_capacity(stream.len() * 2);
        for ins in stream {
            match ins {
                // a step's updates: nothing to update
                Instr::OptimizerStep { .. } => {}
                Instr::Forward { stage, mb } => {
                    eval.push(ins);
                    eval.push(Instr::Free { stage, mb });
                }
                other => eval.push(other),
            }
        }
        for t in 0..tp {
            let shifted = eval.iter().map(|i| i.map_devices(|x| DeviceId(x.0 + t), |g| g)).collect();
            // each forward's all-to-alls over the member's expert group
            let d = DeviceId(d.0 + t);
            out.insert(d, with_all_to_alls(lowered, d, shifted));
        }
    }
    out
}

/// Gradient clipping by the global norm, and fp16's overflow check (a schedule that updates
/// every stage once per step; `Recipe::needs_global_norm`): one group of every device with a stream, and on each, after its last gradient
/// reduction (and tie), the all-reduce of its share of the squared norm and its wait, before
/// its updates (which move behind them, with ZeRO's weight gathers). `whole` is every device
/// of the whole plan, whose sum the norm is when `lowered` is one replica of it. After the
/// tensor-parallel copies: every member of every group takes part in the one sum.
pub(crate) fn clip_norm_all_reduces(spec: &Spec, lowered: &mut Lowered, whole: &[DeviceId]) {
    let members: Vec<DeviceId> = lowered.streams.iter().filter(|(_, s)| !s.is_empty()).map(|(d, _)| *d).collect();
    let per_step = lowered.updates == Updates::PerStep && !lowered.asp;
    if !spec.training.recipe.sums_norm(spec.training.precision, per_step, members.len()) {
        return;
    }
    let group = GroupId(lowered.groups.len() as u32);
    lowered.groups.insert(group, (StageId(0), members.clone()));
    if whole != members.as_slice() {
        lowered.summed_over.insert(group, whole.to_vec());
    }
    let update = |i: &Instr| {
        matches!(
            i,
            Instr::OptimizerStep { .. }
                | Instr::ShardStep { .. }
                | Instr::Collective { payload: CollectivePayload::Weights, .. }
                | Instr::WaitCollective { payload: CollectivePayload::Weights, .. }
        )
    };
    for d in &members {
        let Some(stream) = lowered.streams.get_mut(d) else { continue };
        let stage = stream.iter().map(Instr::stage).min().unwrap_or_default();
        let tail: Vec<Instr> = stream.iter().filter(|i| update(i)).cloned().collect();
        stream.retain(|i| !update(i));
        stream.push(Instr::collective(CollectivePayload::GradNorm, stage, group, 4));
        stream.push(Instr::wait(CollectivePayload::GradNorm, stage, group));
        stream.extend(tail);
    }
}

/// Tensor parallelism: every member t of a TP group runs its leader's stream with peers and
/// replica groups shifted by t (rank t of a stage talks to rank t of its neighbours).
pub(crate) fn tensor_parallel_copies(lowered: &mut Lowered, tp: usize) {
    let leaders: Vec<(DeviceId, Vec<Instr>)> =
        lowered.streams.iter().filter(|(_, s)| !s.is_empty()).map(|(d, s)| (*d, s.clone())).collect();
    let base_groups: Vec<(GroupId, (StageId, Vec<DeviceId>))> =
        lowered.groups.iter().map(|(g, v)| (*g, v.clone())).collect();
    for t in 1..tp as u32 {
        let shift = |d: DeviceId| DeviceId(d.0 + t);
        let mut shifted: HashMap<GroupId, GroupId> = HashMap::new();
        for (g, (stage, members)) in &base_groups {
            let id = GroupId(lowered.groups.len() as u32);
            lowered.groups.insert(id, (*stage, members.iter().copied().map(shift).collect()));
            if let Some(tie) = lowered.ties.get(g).copied() {
                lowered.ties.insert(id, tie);
            }
            if lowered.expert_groups.contains(g) {
                lowered.expert_groups.insert(id);
            }
            if let Some(whole) = lowered.summed_over.get(g) {
                // a group already over every tensor-parallel rank (the expert-parallel
                // group of whole experts, `etp: 1`) is the copy's too; one over the
                // leaders is shifted to rank t's devices
                let spans_ranks = members.iter().all(|&m| whole.contains(&shift(m)));
                let whole = if spans_ranks { whole.clone() } else { whole.iter().copied().map(shift).collect() };
                lowered.summed_over.insert(id, whole);
            }
            shifted.insert(*g, id);
        }
        for (leader, stream) in &leaders {
            let copy = stream.iter().map(|i| i.map_devices(shift, |g| shifted.get(&g).copied().unwrap_or(g))).collect();
            lowered.streams.insert(shift(*leader), copy);
        }
    }
}

/// The plan's backward time in forward times, rounded to whole slots (at least 1).
pub(crate) fn backward_slots(stage_fb: &[(f64, f64)]) -> usize {
    let (f, b) = stage_fb.iter().fold((0.0, 0.0), |(f, b), &(sf, sb)| (f + sf, b + sb));
    if f > 0.0 && b.is_finite() {
        ((b / f).round() as usize).clamp(1, 8)
    } else {
        1
    }
}
