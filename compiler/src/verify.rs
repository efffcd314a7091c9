//! The static verifier. It runs on every compile; a failure is a bug in pipec's schedule
//! generators or lowering, never in the user's spec, and is reported as such with the
//! per-device grid of instructions.

use std::collections::{BTreeMap, HashMap, HashSet};

use rustc_hash::{FxHashMap, FxHashSet};

use pipec_plan::vocab::Sharding;
use pipec_plan::{Buffer, CollectiveKind, CollectivePayload, DeviceId, End, GroupId, Instr, MessageId, StageId};

use crate::schedule::Placement;
use crate::simulate::{simulate, UnitCost};

mod declared;

/// One verifier finding.
#[derive(Debug, Clone, PartialEq)]
pub struct Violation {
    pub device: Option<DeviceId>,
    pub index: Option<usize>,
    pub message: String,
}

fn v(device: DeviceId, index: usize, message: String) -> Violation {
    Violation { device: Some(device), index: Some(index), message }
}

/// What the verifier knows besides the streams.
#[derive(Debug, Clone)]
pub struct VerifyInput<'a> {
    pub streams: &'a BTreeMap<DeviceId, Vec<Instr>>,
    pub placement: &'a Placement,
    pub groups: &'a HashMap<GroupId, Vec<DeviceId>>,
    /// Per stage: whether its forwards keep only their input (activation recompute before
    /// the backward).
    pub recompute: &'a [bool],
    /// Local backwards per optimizer step: None = one step per stage after all of them
    /// (flush schedules); Some(1) = PipeDream's update per microbatch; Some(k) = 2BW.
    pub update_every: Option<usize>,
    /// Asynchronous data parallelism with a parameter server: the staleness bound.
    pub asp_staleness: Option<usize>,
    /// Tensor-parallel degree: member t of every group runs the leader's program with
    /// devices shifted by t; each of these `tp` programs is verified on its own.
    pub tp: usize,
    /// ZeRO: what the replicas of each replicated stage shard.
    pub sharding: Sharding,
    /// Gradient clipping by the global norm, or fp16's overflow check: every update waits
    /// for the norm (`grad_norm`), taken after every gradient of the device's stages is
    /// reduced.
    pub clipping: bool,
    /// Validation's streams: forwards only, each (stage, microbatch) once, no backward and
    /// no update.
    pub forward_only: bool,
    /// Per stage, its expert-parallel degree (1, or absent: none): groups of this many
    /// replicas (`ChunkPlacement::expert_group` of `chunks`) exchange tokens in all-to-alls
    /// inside every pass.
    pub expert_parallel: &'a [usize],
    /// How the schedule places its chunks (which replicas form an expert group).
    pub chunks: pipec_plan::schedule::ChunkPlacement,
    /// Per stage, the all-to-alls each of its passes posts (`StagePlan::all_to_alls`).
    pub all_to_alls: &'a [Vec<pipec_plan::ExpertExchange>],
    /// The expert groups among `groups`, with their stages.
    pub expert_groups: &'a BTreeMap<GroupId, StageId>,
    /// Context parallelism (1: none): every stage's replicas in groups of this many
    /// consecutive ones, member c running chunk-microbatch m·cp + c of each microbatch m
    /// its group runs, the members gathering keys and values inside every pass.
    pub context_parallel: usize,
    /// The collectives declared inside the passes (`pipec_plan::in_pass`), checked over
    /// every tensor-parallel rank together; None: not checked.
    pub in_pass: Option<&'a pipec_plan::in_pass::InPassTable>,
}

impl VerifyInput<'_> {
    /// Whether stage `s`'s replicas shard it (ZeRO on a replicated stage).
    fn sharded(&self, s: StageId) -> bool {
        self.sharding != Sharding::None && self.placement.replicas.get(s.0 as usize).is_some_and(|r| r.len() > 1)
    }
}

/// Checks every property; returns all violations found (empty = the plan is sound).
pub fn verify(input: &VerifyInput<'_>) -> Vec<Violation> {
    let mut out = Vec::new();
    if let Some(table) = input.in_pass {
        declared::check_declared(input, table, &mut out);
        declared::check_gathers(input, table, &mut out);
    }
    out.extend(verify_streams(&VerifyInput { in_pass: None, ..input.clone() }));
    out
}

/// [`verify`] but for the declarations inside passes.
fn verify_streams(input: &VerifyInput<'_>) -> Vec<Violation> {
    if input.tp > 1 {
        let mut out = Vec::new();
        for t in 0..input.tp as u32 {
            let shift = |d: &DeviceId| DeviceId(d.0 + t);
            let placement = Placement {
                replicas: input.placement.replicas.iter().map(|r| r.iter().map(shift).collect()).collect(),
                ..input.placement.clone()
            };
            let members: HashSet<DeviceId> = placement.replicas.iter().flatten().copied().collect();
            let streams: BTreeMap<DeviceId, Vec<Instr>> =
                input.streams.iter().filter(|(d, _)| members.contains(d)).map(|(d, s)| (*d, s.clone())).collect();
            // each rank's groups, and its part of a group over every device (the gradient
            // norm's): the ranks run the same programs shifted, so each part is checked alone
            let groups: HashMap<GroupId, Vec<DeviceId>> = input
                .groups
                .iter()
                .map(|(g, m)| (*g, m.iter().copied().filter(|d| members.contains(d)).collect::<Vec<_>>()))
                .filter(|(_, m)| !m.is_empty())
                .collect();
            out.extend(verify_streams(&VerifyInput {
                streams: &streams,
                placement: &placement,
                groups: &groups,
                tp: 1,
                ..input.clone()
            }));
        }
        // every device of a group runs a program: none is left without one
        for r in input.placement.replicas.iter().flatten() {
            for t in 0..input.tp as u32 {
                let d = DeviceId(r.0 + t);
                if input.streams.get(&d).is_none_or(Vec::is_empty) {
                    out.push(Violation {
                        device: Some(d),
                        index: None,
                        message: format!("{d} is in a tensor-parallel group but has no program"),
                    });
                }
            }
        }
        return out;
    }
    let mut out = Vec::new();
    check_unique(input, &mut out);
    check_compute(input, &mut out);
    check_dataflow(input, &mut out);
    if input.forward_only {
        // nothing is trained: no backward, collective or update at all
        for (dev, stream) in input.streams {
            for (i, ins) in stream.iter().enumerate() {
                let trains = ins.phase() != pipec_plan::Phase::Forward
                    && !matches!(ins.phase(), pipec_plan::Phase::Communication | pipec_plan::Phase::Memory);
                if trains {
                    out.push(v(*dev, i, format!("`{ins}` in a validation stream, which only runs forwards")));
                }
            }
        }
    } else {
        check_updates(input, &mut out);
    }
    check_p2p(input, &mut out);
    check_collectives(input, &mut out);
    check_expert_groups(input, &mut out);
    check_all_to_alls(input, &mut out);
    if let Some(s) = input.asp_staleness {
        check_parameter_server(input, s, &mut out);
    }
    if out.is_empty() {
        if let Err(stuck) = simulate(input.streams, input.groups, &UnitCost) {
            let (device, index) = stuck
                .next
                .iter()
                .find_map(|(d, i)| i.map(|i| (*d, i)))
                .map(|(d, i)| (Some(d), Some(i)))
                .unwrap_or((None, None));
            out.push(Violation {
                device,
                index,
                message: format!("{}\n{}", stuck.reason, grid(input.streams, &stuck.next)),
            });
        }
    }
    out
}

/// Apart from collectives and optimizer steps (which asynchronous schedules repeat), an
/// instruction appears at most once in a stream; loads happen once per microbatch where
/// the first and last stages run it.
fn check_unique(input: &VerifyInput<'_>, out: &mut Vec<Violation>) {
    let p = input.placement;
    let last = p.stages().saturating_sub(1);
    let mut loads: FxHashMap<(u32, u32), usize> = FxHashMap::default();
    for (dev, stream) in input.streams {
        let mut seen: FxHashSet<&Instr> = FxHashSet::default();
        for (i, ins) in stream.iter().enumerate() {
            if matches!(
                ins,
                Instr::Collective { .. }
                    | Instr::WaitCollective { .. }
                    | Instr::OptimizerStep { .. }
                    | Instr::ShardStep { .. }
                    // a recompute posts its forward's again (`check_all_to_alls`)
                    | Instr::AllToAll { .. }
            ) {
                continue;
            }
            if !seen.insert(ins) {
                out.push(v(*dev, i, format!("`{ins}` appears twice on {dev}")));
            }
            if let Instr::LoadMicrobatch { stage, mb, inputs, labels } = ins {
                let s = stage.0 as usize;
                let want = (s == 0, s == last);
                if (*inputs, *labels) != want || (!want.0 && !want.1) {
                    out.push(v(
                        *dev,
                        i,
                        format!(
                            "`{ins}`: stage {stage} loads {}",
                            if want.0 || want.1 { "the wrong parts of the microbatch" } else { "nothing" }
                        ),
                    ));
                }
                if p.device_of(s, mb.0 as usize) != *dev {
                    out.push(v(
                        *dev,
                        i,
                        format!("`{ins}` on {dev}, but the microbatch runs on {}", p.device_of(s, mb.0 as usize)),
                    ));
                }
                *loads.entry((stage.0, mb.0)).or_insert(0) += 1;
            }
        }
    }
    let mut load_stages = vec![0];
    if last != 0 {
        load_stages.push(last);
    }
    for s in load_stages {
        for m in 0..p.microbatches {
            let n = loads.get(&(s as u32, m as u32)).copied().unwrap_or(0);
            if n != 1 {
                out.push(Violation {
                    device: Some(p.device_of(s, m)),
                    index: None,
                    message: format!("microbatch m{m} is loaded {n} time(s) for stage s{s}"),
                });
            }
        }
    }
}

/// Every (stage, microbatch) runs its forward once, on its routed device, before exactly one
/// backward (or one input-gradient pass followed by one weight-gradient pass) there.
fn check_compute(input: &VerifyInput<'_>, out: &mut Vec<Violation>) {
    let p = input.placement;
    #[derive(Default, Clone)]
    struct Seen {
        fwd: Vec<(DeviceId, usize)>,
        bwd: Vec<(DeviceId, usize)>,
        bwd_in: Vec<(DeviceId, usize)>,
        bwd_w: Vec<(DeviceId, usize)>,
    }
    let mut seen: FxHashMap<(u32, u32), Seen> = FxHashMap::default();
    for (dev, stream) in input.streams {
        for (i, ins) in stream.iter().enumerate() {
            let key = (ins.stage().0, ins.microbatch().map(|m| m.0).unwrap_or(0));
            let entry = seen.entry(key).or_default();
            match ins {
                Instr::Forward { .. } => entry.fwd.push((*dev, i)),
                Instr::Backward { .. } => entry.bwd.push((*dev, i)),
                Instr::BackwardInput { .. } => entry.bwd_in.push((*dev, i)),
                Instr::BackwardWeight { .. } => entry.bwd_w.push((*dev, i)),
                _ => {}
            }
        }
    }
    for s in 0..p.stages() {
        for m in 0..p.microbatches {
            let owner = p.device_of(s, m);
            let e = seen.remove(&(s as u32, m as u32)).unwrap_or_default();
            let what = format!("stage s{s} microbatch m{m}");
            if e.fwd.len() != 1 {
                out.push(Violation {
                    device: Some(owner),
                    index: None,
                    message: format!("{what}: {} forward(s), expected exactly 1", e.fwd.len()),
                });
                continue;
            }
            let (fdev, fi) = e.fwd[0];
            if fdev != owner {
                out.push(v(fdev, fi, format!("{what}: forward on {fdev}, but the placement routes it to {owner}")));
            }
            if input.forward_only {
                continue;
            }
            // one backward, or one input-gradient pass and then one weight-gradient pass (a
            // zero-bubble schedule, or a later stage sending its input gradient first)
            let (bdev, bi) = match (e.bwd.as_slice(), e.bwd_in.as_slice(), e.bwd_w.as_slice()) {
                ([whole], [], []) => *whole,
                ([], [input], [weight]) => {
                    if weight.0 != input.0 || weight.1 < input.1 {
                        out.push(v(
                            weight.0,
                            weight.1,
                            format!("{what}: weight gradient before its input gradient or on another device"),
                        ));
                    }
                    *input
                }
                _ => {
                    out.push(Violation {
                        device: Some(owner),
                        index: None,
                        message: format!(
                            "{what}: {} backward(s), {} input-gradient and {} weight-gradient pass(es); expected 1 backward, or 1 of each pass",
                            e.bwd.len(),
                            e.bwd_in.len(),
                            e.bwd_w.len()
                        ),
                    });
                    continue;
                }
            };
            if bdev != fdev || bi < fi {
                out.push(v(bdev, bi, format!("{what}: backward before its forward or on another device")));
            }
        }
    }
    for ((s, m), _) in seen {
        if s as usize >= p.stages() || m as usize >= p.microbatches {
            out.push(Violation {
                device: None,
                index: None,
                message: format!("an instruction names stage s{s} / microbatch m{m}, which does not exist"),
            });
        }
    }
}

/// Every buffer is written before it is read, on the device that reads it; freed activations
/// are not read again. The last stage's forward computes the loss from the labels, which
/// seeds the gradient its backward starts from.
fn check_dataflow(input: &VerifyInput<'_>, out: &mut Vec<Violation>) {
    let last = StageId(input.placement.stages().saturating_sub(1) as u32);
    for (dev, stream) in input.streams {
        check_stream_dataflow(input, *dev, stream, last, out);
    }
}

fn check_stream_dataflow(
    input: &VerifyInput<'_>,
    dev: DeviceId,
    stream: &[Instr],
    last: StageId,
    out: &mut Vec<Violation>,
) {
    let dev = &dev;
    {
        let mut live: FxHashSet<Buffer> = FxHashSet::default();
        let mut stashed: FxHashSet<(StageId, pipec_plan::MicrobatchId)> = FxHashSet::default();
        let mut restored: FxHashSet<(StageId, pipec_plan::MicrobatchId)> = FxHashSet::default();
        let mut forwarded: FxHashSet<(StageId, pipec_plan::MicrobatchId)> = FxHashSet::default();
        let held: FxHashSet<StageId> = input.placement.stages_of(*dev).into_iter().map(|s| StageId(s as u32)).collect();
        // ZeRO: a replica holds its weight shard throughout; the whole weights are stale from
        // its shard's update until the gather lands (stages 1 and 2; at stage 3 every pass
        // gathers what it computes with)
        let gathers_after_update = input.sharding.level() < 3;
        for &stage in &held {
            live.insert(Buffer::Weights { stage });
            if input.sharded(stage) {
                live.insert(Buffer::WeightShard { stage });
            }
        }
        for (i, ins) in stream.iter().enumerate() {
            for b in ins.reads() {
                let ok = match b {
                    // the gradient buffers exist (zero) from the start; reading one before
                    // any contribution is caught by check_updates
                    Buffer::WeightGrad { stage } => held.contains(&stage),
                    // a tie of a sharded stage to an unsharded one sums shards with the
                    // unsharded stage's whole gradient
                    Buffer::GradShard { stage } => {
                        held.contains(&stage)
                            && (input.sharded(stage)
                                || matches!(ins, Instr::Collective { payload, .. } if payload.crosses_stages()))
                    }
                    _ => live.contains(&b),
                };
                if !ok {
                    out.push(v(*dev, i, format!("`{ins}` reads {b:?}, which is not available on {dev} at this point")));
                }
            }
            if let Instr::WaitCollective { payload: CollectivePayload::Weights, stage, .. } = ins {
                if live.contains(&Buffer::Weights { stage: *stage }) {
                    out.push(v(*dev, i, format!("`{ins}` gathers weights {stage} already holds whole")));
                }
            }
            if let Instr::ShardStep { stage } = ins {
                if gathers_after_update {
                    live.remove(&Buffer::Weights { stage: *stage });
                }
            }
            if let Instr::Free { stage, mb } = ins {
                live.remove(&Buffer::Saved { stage: *stage, mb: *mb });
            }
            if let Instr::WaitCollective { stage, group, .. } = ins {
                live.remove(&Buffer::InFlight { stage: *stage, group: *group });
            }
            if let Instr::RestoreWeights { stage, mb } = ins {
                if !forwarded.contains(&(*stage, *mb)) {
                    out.push(v(
                        *dev,
                        i,
                        format!(
                            "`{ins}` comes before the forward of {mb}: stashed weights are restored for the backward"
                        ),
                    ));
                }
                live.remove(&Buffer::Stash { stage: *stage, mb: *mb });
                restored.insert((*stage, *mb));
            }
            if let Instr::StashWeights { stage, mb, version } = ins {
                stashed.insert((*stage, *mb));
                if stream.get(i + 1) != Some(&Instr::Forward { stage: *stage, mb: *mb }) {
                    out.push(v(*dev, i, format!("`{ins}` must come right before the forward of {mb}")));
                }
                let applied =
                    stream[..i].iter().filter(|x| matches!(x, Instr::OptimizerStep { stage: s } if s == stage)).count()
                        as u32;
                if let Some(v_) = version {
                    if *v_ > applied {
                        out.push(v(
                            *dev,
                            i,
                            format!("`{ins}` asks for version {v_}, but only {applied} update(s) happened"),
                        ));
                    }
                }
            }
            if let Instr::Forward { stage, mb } = ins {
                forwarded.insert((*stage, *mb));
            }
            // Weight stashing: a backward uses the weights its forward used.
            if let Instr::Backward { stage, mb } = ins {
                if stashed.contains(&(*stage, *mb)) && !restored.contains(&(*stage, *mb)) {
                    out.push(v(
                        *dev,
                        i,
                        format!("`{ins}` runs before the weights stashed for its forward are restored"),
                    ));
                }
            }
            live.extend(ins.writes());
            if let Instr::Forward { stage, mb } = ins {
                if input.recompute.get(stage.0 as usize).copied().unwrap_or(false) {
                    // the forward keeps only its input; the recompute rebuilds what the
                    // backward needs
                    live.remove(&Buffer::Saved { stage: *stage, mb: *mb });
                }
            }
            if let Instr::Forward { stage, mb } = ins {
                if *stage == last {
                    if live.contains(&Buffer::Labels { mb: *mb }) {
                        live.insert(Buffer::OutputGrad { stage: *stage, mb: *mb });
                    } else {
                        out.push(v(
                            *dev,
                            i,
                            format!("`{ins}` computes the loss, but the labels of {mb} were never loaded on {dev}"),
                        ));
                    }
                }
            }
        }
        check_stream_end(input, *dev, &held, &live, out);
    }
}

/// What must hold when a device's stream ends: every sharded stage's whole weights
/// gathered again for the next step, and nothing a forward kept or stashed left behind.
fn check_stream_end(
    input: &VerifyInput<'_>,
    dev: DeviceId,
    held: &FxHashSet<StageId>,
    live: &FxHashSet<Buffer>,
    out: &mut Vec<Violation>,
) {
    let dev = &dev;
    // The next step computes with whole weights: every update's gather has landed.
    for stage in held {
        if input.sharded(*stage) && !live.contains(&Buffer::Weights { stage: *stage }) {
            out.push(Violation {
                device: Some(*dev),
                index: None,
                message: format!("{dev}: the weights of {stage} are not gathered after its shard's update"),
            });
        }
    }
    // Nothing the forwards kept may outlive the step.
    for b in live {
        match b {
            Buffer::Saved { stage, mb } => out.push(Violation {
                device: Some(*dev),
                index: None,
                message: format!("{dev}: the activations {stage} kept for {mb} are never freed"),
            }),
            Buffer::Stash { stage, mb } => out.push(Violation {
                device: Some(*dev),
                index: None,
                message: format!("{dev}: the weights {stage} stashed for {mb} are never restored for its backward"),
            }),
            _ => {}
        }
    }
}

/// Optimizer steps come after the last gradient contribution of their stage, and after the
/// stage's all-reduce (ZeRO: the reduce-scatters of every contribution) when it is
/// replicated; no gradient is left unapplied; a sharded stage updates its shard, an
/// unsharded one its whole weights.
/// A stage's gradient contributions since its last update, and how many of them a
/// finished replica reduction covers.
#[derive(Default, Clone, Copy)]
struct Pending {
    contributions: usize,
    reduced: usize,
}

/// An optimizer (or ZeRO shard) step at position `i` of `dev`'s stream: sharded as its
/// stage is, after the norm when clipping, applying the gradients it should (every `k`
/// microbatches' where the schedule says), after the replicas' reduction; `e` is the
/// stage's pending gradients, emptied.
fn check_optimizer_step(
    input: &VerifyInput<'_>,
    (dev, i, stream): (DeviceId, usize, &[Instr]),
    stage: StageId,
    (e, norm_taken, replicated): (&mut Pending, bool, &FxHashSet<u32>),
    out: &mut Vec<Violation>,
) {
    let (dev, stage) = (&dev, &stage);
    let ins = &stream[i];
    let shard = matches!(ins, Instr::ShardStep { .. });
    if shard != input.sharded(*stage) {
        out.push(v(
            *dev,
            i,
            format!(
                "`{ins}`: {stage} is {}sharded across its replicas",
                if input.sharded(*stage) { "" } else { "not " }
            ),
        ));
    }
    if input.clipping && !norm_taken {
        out.push(v(*dev, i, format!("`{ins}` updates before the gradient's norm is taken")));
    }
    if e.contributions == 0 {
        out.push(v(*dev, i, format!("`{ins}` applies no gradient")));
    }
    if let Some(k) = input.update_every {
        let later = stream[i + 1..].iter().any(
            |x| matches!(x, Instr::Backward { stage: s, .. } | Instr::BackwardWeight { stage: s, .. } if s == stage),
        );
        if e.contributions > k || (e.contributions < k && later) {
            out.push(v(
                *dev,
                i,
                format!("`{ins}` applies {} microbatches' gradients; this schedule updates every {k}", e.contributions),
            ));
        }
    }
    if replicated.contains(&stage.0) && e.reduced < e.contributions {
        out.push(v(*dev, i, format!("`{ins}` runs before the replicas' gradients are all-reduced")));
    }
    *e = Pending::default();
}

/// What must hold when a device's stream ends: every collective waited for, every
/// gradient applied, every held stage updated.
#[allow(clippy::type_complexity)]
fn check_updates_end(
    input: &VerifyInput<'_>,
    dev: DeviceId,
    (reducing, pending, steps): (
        &FxHashMap<StageId, (GroupId, CollectivePayload, usize)>,
        &FxHashMap<StageId, Pending>,
        &FxHashMap<StageId, usize>,
    ),
    out: &mut Vec<Violation>,
) {
    let dev = &dev;
    for (stage, (group, payload, _)) in reducing {
        out.push(Violation {
            device: Some(*dev),
            index: None,
            message: format!("{dev}: the collective of {stage} on {group} ({payload}) is never waited for"),
        });
    }
    for s in input.placement.stages_of(*dev) {
        let stage = StageId(s as u32);
        if pending.get(&stage).is_some_and(|e| e.contributions > 0) {
            out.push(Violation {
                device: Some(*dev),
                index: None,
                message: format!(
                    "{dev}: gradients of {stage} computed after its last optimizer step are never applied"
                ),
            });
        }
        if steps.get(&stage).copied().unwrap_or(0) == 0 {
            out.push(Violation {
                device: Some(*dev),
                index: None,
                message: format!("{dev}: {stage} is never updated"),
            });
        }
    }
}

fn check_updates(input: &VerifyInput<'_>, out: &mut Vec<Violation>) {
    let replicated: FxHashSet<u32> =
        (0..input.placement.stages()).filter(|&s| input.placement.replicas[s].len() > 1).map(|s| s as u32).collect();
    for (dev, stream) in input.streams {
        let mut pending: FxHashMap<StageId, Pending> = FxHashMap::default();
        let mut steps: FxHashMap<StageId, usize> = FxHashMap::default();
        // per stage: its collective in flight (started, not yet waited for): group, payload
        // and the contributions it covers
        let mut reducing: FxHashMap<StageId, (GroupId, CollectivePayload, usize)> = FxHashMap::default();
        // gradient clipping: the norm of the gradients as they now are was summed
        let mut norm_taken = false;
        let held: Vec<StageId> = input.placement.stages_of(*dev).into_iter().map(|s| StageId(s as u32)).collect();
        for (i, ins) in stream.iter().enumerate() {
            // the norm reads every held stage's gradient: nothing runs beside it
            let beside_norm = reducing.values().any(|r| r.1 == CollectivePayload::GradNorm)
                && matches!(
                    ins,
                    Instr::Backward { .. }
                        | Instr::BackwardWeight { .. }
                        | Instr::OptimizerStep { .. }
                        | Instr::ShardStep { .. }
                        | Instr::Collective { .. }
                );
            if beside_norm {
                out.push(v(*dev, i, format!("`{ins}` runs while the gradient norm is being summed")));
            }
            // nothing touches what a stage's collective carries while it is in flight: a
            // backward may run while its gradients are reduce-scattered (the start took
            // them) or its weights gathered (after the update, which the backward precedes)
            let touches = match ins {
                Instr::Backward { .. } | Instr::BackwardWeight { .. } => reducing
                    .get(&ins.stage())
                    .is_some_and(|r| !matches!(r.1, CollectivePayload::GradientShard | CollectivePayload::Weights)),
                Instr::OptimizerStep { .. }
                | Instr::ShardStep { .. }
                | Instr::PushGradient { .. }
                | Instr::Collective { .. } => reducing.contains_key(&ins.stage()),
                _ => false,
            };
            if touches {
                out.push(v(
                    *dev,
                    i,
                    format!("`{ins}` touches the gradient of {} while a collective on it is in flight", ins.stage()),
                ));
            }
            match ins {
                Instr::Backward { stage, .. } | Instr::BackwardWeight { stage, .. } => {
                    pending.entry(*stage).or_default().contributions += 1;
                    norm_taken = false;
                }
                Instr::Collective { payload: CollectivePayload::GradNorm, stage, group, .. } => {
                    if !reducing.is_empty() {
                        out.push(v(
                            *dev,
                            i,
                            format!("`{ins}` takes the gradient norm while a collective is in flight"),
                        ));
                    }
                    for s in &held {
                        let e = pending.get(s).copied().unwrap_or_default();
                        if e.contributions == 0 || (replicated.contains(&s.0) && e.reduced < e.contributions) {
                            out.push(v(
                                *dev,
                                i,
                                format!("`{ins}` takes the gradient norm before the gradients of {s} are complete and reduced"),
                            ));
                        }
                    }
                    reducing.insert(*stage, (*group, CollectivePayload::GradNorm, 0));
                }
                Instr::PushGradient { stage, .. } => {
                    let e = pending.entry(*stage).or_default();
                    if e.contributions != 1 {
                        out.push(v(
                            *dev,
                            i,
                            format!(
                                "`{ins}` pushes {} microbatches' gradients; the parameter server takes one at a time",
                                e.contributions
                            ),
                        ));
                    }
                    *e = Pending::default();
                }
                Instr::ApplyGradient { stage, .. } | Instr::PullWeights { stage, .. } => {
                    *steps.entry(*stage).or_insert(0) += 1;
                }
                Instr::Collective { payload, stage, group, .. } => {
                    if norm_taken && *payload != CollectivePayload::Weights {
                        out.push(v(*dev, i, format!("`{ins}` changes a gradient after its norm was taken")));
                    }
                    let e = pending.entry(*stage).or_default();
                    let sharded_payload = matches!(
                        payload,
                        CollectivePayload::GradientShard
                            | CollectivePayload::TiedGradientShard
                            | CollectivePayload::Weights
                    );
                    if sharded_payload != input.sharded(*stage) && !payload.crosses_stages() {
                        out.push(v(
                            *dev,
                            i,
                            format!(
                                "`{ins}`: {stage} is {}sharded across its replicas",
                                if input.sharded(*stage) { "" } else { "not " }
                            ),
                        ));
                    }
                    if *payload == CollectivePayload::Weights {
                        // gathers the updated shards: nothing is reduced
                    } else if e.contributions == 0 || (payload.reduces_replicas() && e.reduced >= e.contributions) {
                        out.push(v(*dev, i, format!("`{ins}` reduces gradients before any were computed")));
                    }
                    reducing.insert(*stage, (*group, *payload, e.contributions));
                }
                Instr::WaitCollective { payload, stage, group } => match reducing.remove(stage) {
                    Some((g, p, covers)) if g == *group && p == *payload => {
                        if payload.reduces_replicas() {
                            pending.entry(*stage).or_default().reduced = covers;
                        }
                        if *payload == CollectivePayload::GradNorm {
                            norm_taken = true;
                        }
                    }
                    _ => out.push(v(
                        *dev,
                        i,
                        format!("`{ins}` waits for a collective of {stage} on {group} that is not in flight"),
                    )),
                },
                Instr::OptimizerStep { stage } | Instr::ShardStep { stage } => {
                    let e = pending.entry(*stage).or_default();
                    check_optimizer_step(input, (*dev, i, stream), *stage, (e, norm_taken, &replicated), out);
                    *steps.entry(*stage).or_insert(0) += 1;
                }
                _ => {}
            }
        }
        check_updates_end(input, *dev, (&reducing, &pending, &steps), out);
    }
}

/// Expert and context parallelism: the members of an expert-parallel group exchange tokens
/// in all-to-alls inside every forward, recompute and input-gradient backward of their
/// expert stages, and a context-parallel group's members gather keys and values inside
/// every pass of every stage, matched by order on each member's communication engine. So
/// every member of a group runs those passes in the same order: the same stage and kind of
/// pass at each position, on its k-th microbatch of the stage when the others run theirs
/// (context parallelism: on its own chunk of the same microbatch, member c on chunk c).
fn check_expert_groups(input: &VerifyInput<'_>, out: &mut Vec<Violation>) {
    let p = input.placement;
    let cp = input.context_parallel.max(1);
    if cp > 1 {
        // chunk c of every microbatch on the member at position c of its group
        for s in 0..p.stages() {
            for m in 0..p.microbatches {
                let d = p.device_of(s, m);
                let at = p.replicas[s].iter().position(|r| *r == d);
                if at.is_none_or(|i| i % cp != m % cp) {
                    out.push(Violation {
                        device: Some(d),
                        index: None,
                        message: format!(
                            "{}: chunk-microbatch {m} (chunk {} of microbatch {}) runs on {d}, which is not at position {} of a context-parallel group of {cp}",
                            StageId(s as u32),
                            m % cp,
                            m / cp,
                            m % cp
                        ),
                    });
                }
            }
        }
        check_groups_in_step(input, out, &|_| cp, true, "context-parallel exchange");
    }
    // expert groups (beside context-parallel ones: their members may run chunks of
    // different microbatches, matched by their place in each member's run)
    let ep_of = |s: usize| input.expert_parallel.get(s).copied().unwrap_or(1).max(1);
    check_groups_in_step(input, out, &ep_of, false, "expert-parallel all-to-all");
}

/// Expert parallelism's all-to-alls: right after every pass of an expert-parallel stage
/// stand exactly the all-to-alls it posts (`Instr::all_to_alls_of`) over its device's
/// expert group, which is the group of the stage's replicas `ChunkPlacement::expert_group`
/// puts the device in; no all-to-all stands anywhere else; and every member of a group
/// posts the same all-to-alls (stage, layer, exchange, size) in the same order.
fn check_all_to_alls(input: &VerifyInput<'_>, out: &mut Vec<Violation>) {
    let p = input.placement;
    let ep_of = |s: StageId| input.expert_parallel.get(s.0 as usize).copied().unwrap_or(1);
    // (stage, device) → its expert group, whose members are checked against the placement
    let mut group_of: FxHashMap<(StageId, DeviceId), GroupId> = FxHashMap::default();
    for (g, stage) in input.expert_groups {
        // (verifying one tensor-parallel rank: the other ranks' groups are not there)
        let Some(members) = input.groups.get(g).filter(|m| !m.is_empty()) else { continue };
        let replicas = p.replicas.get(stage.0 as usize).map_or(&[][..], Vec::as_slice);
        let want: Option<Vec<DeviceId>> = replicas.iter().position(|d| *d == members[0]).and_then(|i| {
            input.chunks.expert_group(i, ep_of(*stage)).0.into_iter().map(|j| replicas.get(j).copied()).collect()
        });
        if want.as_ref() != Some(members) {
            out.push(Violation {
                device: None,
                index: None,
                message: format!(
                    "{g}: {stage}'s expert group {members:?} is not one the stage's replicas form ({want:?})"
                ),
            });
            continue;
        }
        for d in members {
            group_of.insert((*stage, *d), *g);
        }
    }
    type Posted = (StageId, u32, pipec_plan::TokenExchange, u64);
    let mut posted: BTreeMap<GroupId, BTreeMap<DeviceId, Vec<(Posted, usize)>>> = BTreeMap::new();
    for (dev, stream) in input.streams {
        let mut i = 0;
        while i < stream.len() {
            let ins = &stream[i];
            i += 1;
            if let Instr::AllToAll { .. } = ins {
                out.push(v(*dev, i - 1, format!("`{ins}` is not posted by the pass before it")));
                continue;
            }
            let stage = ins.stage();
            let Some(layers) = input.all_to_alls.get(stage.0 as usize).filter(|l| ep_of(stage) > 1 && !l.is_empty())
            else {
                continue;
            };
            if pipec_plan::TokenExchange::of_pass(ins.phase()).is_empty() {
                continue;
            }
            let Some(&group) = group_of.get(&(stage, *dev)) else {
                out.push(v(
                    *dev,
                    i - 1,
                    format!("`{ins}` exchanges tokens, but {dev} is in no expert group of {stage}"),
                ));
                continue;
            };
            for (k, want) in Instr::all_to_alls_of(ins, layers, group).iter().enumerate() {
                match stream.get(i) {
                    Some(got) if got == want => {
                        if let Instr::AllToAll { stage, layer, exchange, bytes, .. } = *got {
                            posted
                                .entry(group)
                                .or_default()
                                .entry(*dev)
                                .or_default()
                                .push(((stage, layer, exchange, bytes), i));
                        }
                        i += 1;
                    }
                    got => {
                        let found = got.map_or("nothing".to_string(), |g| format!("`{g}`"));
                        out.push(v(*dev, i, format!("`{ins}` posts `{want}` (its all-to-all {k}) next, not {found}")));
                        break;
                    }
                }
            }
        }
    }
    for (group, members) in &posted {
        let Some((first, reference)) = members.iter().next() else { continue };
        for (d, mine) in members.iter().skip(1) {
            let at = (0..reference.len().max(mine.len()))
                .find(|&k| reference.get(k).map(|r| r.0) != mine.get(k).map(|m| m.0));
            if let Some(k) = at {
                let index = mine.get(k).map_or(input.streams.get(d).map_or(0, Vec::len), |m| m.1);
                out.push(v(
                    *d,
                    index,
                    format!("{group}: all-to-all {k} of {d} is {:?}, where {first} posts {:?}: the group's members must post the same ones in the same order", mine.get(k).map(|m| m.0), reference.get(k).map(|r| r.0)),
                ));
            }
        }
    }
}

/// The groups of `size_of(stage)` replicas (`ChunkPlacement::expert_group`) run the passes
/// of their stages whose groups have more than one member in the same order: the same
/// stage and kind of pass at each position, on the same microbatch (`chunked`: context
/// parallelism's chunks of one) or else on each member's k-th microbatch of the stage.
fn check_groups_in_step(
    input: &VerifyInput<'_>,
    out: &mut Vec<Violation>,
    size_of: &dyn Fn(usize) -> usize,
    chunked: bool,
    exchange: &str,
) {
    let p = input.placement;
    let cp = input.context_parallel.max(1);
    // (stage, microbatch) → its position among the microbatches its replica runs (context
    // parallelism: the microbatch whose chunk it is)
    let local: FxHashMap<(usize, usize), usize> = (0..p.stages())
        .filter(|&s| size_of(s) > 1)
        .flat_map(|s| {
            let mut seen: FxHashMap<DeviceId, usize> = FxHashMap::default();
            (0..p.microbatches)
                .map(|m| {
                    let k = seen.entry(p.device_of(s, m)).or_insert(0);
                    *k += 1;
                    ((s, m), if chunked { m / cp } else { *k - 1 })
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let exchanges = |d: DeviceId| -> Vec<(usize, (StageId, u8, usize))> {
        let Some(stream) = input.streams.get(&d) else { return Vec::new() };
        stream
            .iter()
            .enumerate()
            .filter_map(|(i, ins)| {
                let (stage, mb, kind) = match *ins {
                    Instr::Forward { stage, mb } => (stage, mb, 0),
                    Instr::Recompute { stage, mb } => (stage, mb, 1),
                    Instr::Backward { stage, mb } | Instr::BackwardInput { stage, mb } => (stage, mb, 2),
                    _ => return None,
                };
                let s = stage.0 as usize;
                (size_of(s) > 1)
                    .then(|| (i, (stage, kind, local.get(&(s, mb.0 as usize)).copied().unwrap_or(usize::MAX))))
            })
            .collect()
    };
    let mut checked: FxHashSet<Vec<DeviceId>> = FxHashSet::default();
    for s in (0..p.stages()).filter(|&s| size_of(s) > 1) {
        for i in 0..p.replicas[s].len() {
            let (indices, _) = input.chunks.expert_group(i, size_of(s));
            let Some(group) = indices.iter().map(|&j| p.replicas[s].get(j).copied()).collect::<Option<Vec<DeviceId>>>()
            else {
                out.push(Violation {
                    device: None,
                    index: None,
                    message: format!("{}: its replicas do not form groups of {}", StageId(s as u32), size_of(s)),
                });
                continue;
            };
            if !checked.insert(group.clone()) {
                continue;
            }
            let Some((&first, rest)) = group.split_first() else { continue };
            let reference = exchanges(first);
            for &d in rest {
                let mine = exchanges(d);
                let at = (0..reference.len().max(mine.len()))
                    .find(|&k| reference.get(k).map(|r| r.1) != mine.get(k).map(|m| m.1));
                if let Some(k) = at {
                    let index = mine.get(k).map_or(input.streams.get(&d).map_or(0, Vec::len), |m| m.0);
                    let what = |x: Option<&(usize, (StageId, u8, usize))>, dev: DeviceId| {
                        x.and_then(|x| input.streams.get(&dev).and_then(|st| st.get(x.0)))
                            .map_or("nothing".to_string(), |ins| format!("`{ins}`"))
                    };
                    out.push(v(
                        d,
                        index,
                        format!(
                            "{exchange} {k} of {d} comes from {}, where {first} (its group's first member) runs {}: the group's members must run their passes in the same order",
                            what(mine.get(k), d),
                            what(reference.get(k), first)
                        ),
                    ));
                }
            }
        }
    }
}

/// Each send has exactly one receive with the same peer, tag and size, and every link
/// delivers in the order its receiver expects.
fn check_p2p(input: &VerifyInput<'_>, out: &mut Vec<Violation>) {
    type Key = (MessageId, u64);
    let mut sends: FxHashMap<(DeviceId, DeviceId), Vec<(Key, usize)>> = FxHashMap::default();
    let mut recvs: FxHashMap<(DeviceId, DeviceId), Vec<(Key, usize)>> = FxHashMap::default();
    for (dev, stream) in input.streams {
        for (i, ins) in stream.iter().enumerate() {
            let Some(t) = ins.transfer() else { continue };
            let Some(id) = t.id else {
                out.push(v(*dev, i, format!("`{ins}`: the first stage receives no activation")));
                continue;
            };
            match t.end {
                End::Send => sends.entry((*dev, t.peer)).or_default().push(((id, t.bytes), i)),
                End::Recv => recvs.entry((t.peer, *dev)).or_default().push(((id, t.bytes), i)),
            }
        }
    }
    let mut links: Vec<(DeviceId, DeviceId)> = sends.keys().chain(recvs.keys()).copied().collect();
    links.sort();
    links.dedup();
    for link in links {
        let s = sends.get(&link).cloned().unwrap_or_default();
        let r = recvs.get(&link).cloned().unwrap_or_default();
        let name = |(id, bytes): &Key| format!("{id} ({bytes} B)");
        let sent: FxHashMap<Key, usize> = s.iter().fold(FxHashMap::default(), |mut m, (k, _)| {
            *m.entry(*k).or_insert(0) += 1;
            m
        });
        let received: FxHashMap<Key, usize> = r.iter().fold(FxHashMap::default(), |mut m, (k, _)| {
            *m.entry(*k).or_insert(0) += 1;
            m
        });
        let mut ok = true;
        for (k, i) in &s {
            if received.get(k).copied().unwrap_or(0) != 1 || sent[k] != 1 {
                out.push(v(
                    link.0,
                    *i,
                    format!(
                        "{} sends the {} to {} {} time(s), which receives it {} time(s)",
                        link.0,
                        name(k),
                        link.1,
                        sent[k],
                        received.get(k).copied().unwrap_or(0)
                    ),
                ));
                ok = false;
            }
        }
        for (k, i) in &r {
            if !sent.contains_key(k) {
                out.push(v(
                    link.1,
                    *i,
                    format!("{} waits for the {} from {}, which never sends it", link.1, name(k), link.0),
                ));
                ok = false;
            }
        }
        if ok {
            for (pos, ((ks, si), (kr, ri))) in s.iter().zip(&r).enumerate() {
                if ks != kr {
                    out.push(Violation {
                        device: Some(link.1),
                        index: Some(*ri),
                        message: format!("link {}→{}: message #{pos} is sent as the {} (instruction {si}) but received as the {} (out of order)", link.0, link.1, name(ks), name(kr)),
                    });
                    break;
                }
            }
        }
    }
}

/// The parameter server applies gradients in the fixed round-robin order (round j: every
/// worker's j-th microbatch, in worker order) and pushes weights after exactly the rounds
/// the staleness bound allows; each worker pulls them after the same number of its own
/// microbatches, before its next forward.
fn check_parameter_server(input: &VerifyInput<'_>, staleness: usize, out: &mut Vec<Violation>) {
    let p = input.placement;
    let workers = &p.replicas[0];
    let every = staleness + 1;
    let local: Vec<Vec<usize>> = workers.iter().map(|w| p.local_microbatches(0, *w)).collect();
    let n_local = local.iter().map(Vec::len).max().unwrap_or(0);
    let server = workers[0];
    let mut expected = Vec::new();
    for j in 0..n_local {
        for (wi, w) in workers.iter().enumerate() {
            if let Some(&m) = local[wi].get(j) {
                expected.push((*w, m as u32));
            }
        }
    }
    // rounds end after these many rounds of applies
    let round_ends: Vec<usize> =
        (0..n_local).filter(|j| (j + 1) % every == 0 || j + 1 == n_local).map(|j| j + 1).collect();
    let applied_after =
        |rounds: usize| -> usize { (0..rounds).map(|j| local.iter().filter(|l| l.len() > j).count()).sum() };
    if let Some(stream) = input.streams.get(&server) {
        let mut applied = 0usize;
        for (i, ins) in stream.iter().enumerate() {
            match ins {
                Instr::ApplyGradient { peer, mb, .. } => {
                    if expected.get(applied) != Some(&(*peer, mb.0)) {
                        out.push(v(
                            server,
                            i,
                            format!(
                                "`{ins}`: the server applies gradients in round-robin order; expected {:?}",
                                expected.get(applied)
                            ),
                        ));
                    }
                    applied += 1;
                }
                Instr::PushWeights { round, .. } => {
                    let want = round_ends.get(*round as usize).map(|&r| applied_after(r));
                    if want != Some(applied) {
                        out.push(v(
                            server,
                            i,
                            format!("`{ins}` after {applied} applied gradients; round {round} ends after {want:?}"),
                        ));
                    }
                }
                _ => {}
            }
        }
    }
    for (wi, w) in workers.iter().enumerate().skip(1) {
        let Some(stream) = input.streams.get(w) else { continue };
        let mut forwards = 0usize;
        let mut pushed = 0usize;
        for (i, ins) in stream.iter().enumerate() {
            match ins {
                Instr::Forward { .. } => forwards += 1,
                Instr::PushGradient { .. } => pushed += 1,
                Instr::PullWeights { round, .. } => {
                    let want = round_ends.get(*round as usize).map(|&r| r.min(local[wi].len()));
                    if want != Some(forwards) || want != Some(pushed) {
                        out.push(v(*w, i, format!("`{ins}` after {forwards} forwards and {pushed} pushes; round {round} ends after {want:?} of this worker's microbatches")));
                    }
                }
                _ => {}
            }
        }
    }
}

/// Every member of a group issues the same collectives in the same order.
fn check_collectives(input: &VerifyInput<'_>, out: &mut Vec<Violation>) {
    // per group and member, its collectives in order: (what, stage, bytes, instruction index)
    type Call = ((CollectiveKind, CollectivePayload), StageId, u64, usize);
    type Calls = BTreeMap<DeviceId, Vec<Call>>;
    let mut calls: FxHashMap<GroupId, Calls> = FxHashMap::default();
    for (dev, stream) in input.streams {
        for (i, ins) in stream.iter().enumerate() {
            if let Instr::Collective { kind, payload, stage, group, bytes } = ins {
                // a tied gradient's members hold different stages: only sizes must agree
                let stage = if payload.crosses_stages() { StageId(u32::MAX) } else { *stage };
                let what = (*kind, *payload);
                match input.groups.get(group) {
                    Some(members) if members.contains(dev) => {
                        calls.entry(*group).or_default().entry(*dev).or_default().push((what, stage, *bytes, i))
                    }
                    _ => out.push(v(*dev, i, format!("`{ins}`: {dev} is not a member of {group}"))),
                }
            }
        }
    }
    for (group, members) in input.groups {
        let per = calls.get(group).cloned().unwrap_or_default();
        let calls_of = |m: &DeviceId| -> Vec<(String, StageId, u64)> {
            per.get(m)
                .map(|c| c.iter().map(|x| (format!("{} {}", x.0 .0, x.0 .1), x.1, x.2)).collect())
                .unwrap_or_default()
        };
        let reference = calls_of(&members[0]);
        for m in members {
            let mine = calls_of(m);
            if mine != reference {
                out.push(Violation {
                    device: Some(*m),
                    index: None,
                    message: format!(
                        "{group}: {m} issues {} collective(s) {:?}, {} issues {:?}",
                        mine.len(),
                        mine,
                        members[0],
                        reference
                    ),
                });
            }
        }
    }
}

/// The per-device grid of instructions with the stuck one of each device marked `>>`.
pub fn grid(streams: &BTreeMap<DeviceId, Vec<Instr>>, next: &BTreeMap<DeviceId, Option<usize>>) -> String {
    let mut out = String::new();
    for (dev, stream) in streams {
        let at = next.get(dev).copied().flatten();
        out.push_str(&format!("{dev}:"));
        let lo = at.map(|a| a.saturating_sub(3)).unwrap_or(stream.len().saturating_sub(2));
        let hi = at.map(|a| (a + 3).min(stream.len())).unwrap_or(stream.len());
        if lo > 0 {
            out.push_str(" …");
        }
        for (i, ins) in stream.iter().enumerate().take(hi).skip(lo) {
            if Some(i) == at {
                out.push_str(&format!(" >>[{i}] {ins}<<"));
            } else {
                out.push_str(&format!(" [{i}] {ins}"));
            }
        }
        if at.is_none() {
            out.push_str(" (finished)");
        }
        out.push('\n');
    }
    out
}
