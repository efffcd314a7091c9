//! Flush-free pipelining for the asynchronous schedules (PipeDream's 1F1B with weight
//! stashing, 2BW): instead of draining the pipeline at every step, a run is one continuous
//! pipeline — a **prologue** once (the warm-up forwards), a **body** per step (the steady
//! state: every device alternates forwards and backwards, including the next step's first
//! forwards), and an **epilogue** for the last step (its backwards drain the pipeline). A run
//! of K steps is `prologue, body × (K − 1), epilogue`.
//!
//! The three are cut from the continuous order itself: the schedule's generator orders
//! four steps' worth of microbatches (`4·N`) as one pipeline, `lower` turns it into
//! streams, and each device's stream is cut after the last instruction of each step's last
//! backward. Microbatch numbers become relative to the segment's step: `m` in step t's
//! segment is microbatch `t·N + m` of the run, so a body's forwards of the next step's
//! microbatches carry numbers `N ..`. Segments 1 and 2 must be equal once relabelled
//! (the schedule is periodic), segment 0 must end with that body (what precedes it is the
//! prologue), and segment 3 is the epilogue. [`unroll`] rebuilds the streams of K steps,
//! which the verifier checks for K = 1, 2, 3 like any plan (per-link order, exactly-once
//! compute, stash discipline, deadlock freedom); the same body repeats for longer runs.

use std::collections::{BTreeMap, HashMap};

use pipec_plan::plan::{shift_microbatches, FlushFree};
use pipec_plan::{DeviceId, GroupId, Instr, ScheduleKind};

use crate::lower::{lower, LowerInput, Updates};
use crate::schedule::{generate, Placement};
use crate::simulate::{simulate, CostModel, Timeline};
use crate::verify::{verify, VerifyInput};

/// A flush-free schedule's streams, microbatch numbers relative to each segment's step.
#[derive(Debug, Clone, PartialEq)]
pub struct Periodic {
    pub body: BTreeMap<DeviceId, Vec<Instr>>,
    /// The prologue and the epilogue (what a plan carries beside its body).
    pub segments: FlushFree,
    /// Microbatches per step.
    pub microbatches: usize,
}

/// What building the periodic streams needs: the step's placement and lowering settings.
pub struct PeriodicInput<'a> {
    pub kind: ScheduleKind,
    pub placement: &'a Placement,
    pub ranks: usize,
    pub output_bytes: &'a [u64],
    pub gradient_bytes: &'a [u64],
    pub groups: &'a [Option<GroupId>],
    pub updates: Updates,
    /// Per stage: activation recompute.
    pub recompute: &'a [bool],
    pub overlap: bool,
}

/// The placement of `steps` steps run as one pipeline: microbatch `t·N + m` goes where
/// microbatch m of a step goes.
pub fn repeated(p: &Placement, steps: usize) -> Placement {
    let n = p.microbatches;
    Placement {
        replicas: p.replicas.clone(),
        route: p.route.iter().map(|r| (0..n * steps).map(|g| r[g % n.max(1)]).collect()).collect(),
        devices: p.devices,
        microbatches: n * steps,
    }
}

/// Whether an instruction prepares a compute that follows it (it belongs to the next
/// segment when it comes after a cut), rather than finishing one before it.
fn prepares(i: &Instr) -> bool {
    !matches!(
        i,
        Instr::SendActivation { .. }
            | Instr::SendGradient { .. }
            | Instr::Free { .. }
            | Instr::Collective { .. }
            | Instr::OptimizerStep { .. }
    )
}

/// Builds the prologue, body and epilogue of an asynchronous schedule, or says why it is
/// not periodic.
pub fn build(input: &PeriodicInput<'_>) -> Result<Periodic, String> {
    let n = input.placement.microbatches;
    let four = repeated(input.placement, 4);
    let order = generate(input.kind, &four, input.ranks, 1, false);
    let streams = lower(&LowerInput {
        placement: &four,
        order: &order,
        output_bytes: input.output_bytes,
        gradient_bytes: input.gradient_bytes,
        // asynchronous schedules do not shard (the front end refuses `zero` with them)
        weight_bytes: input.gradient_bytes,
        sharding: pipec_plan::vocab::Sharding::None,
        groups: input.groups,
        updates: input.updates,
        recompute: input.recompute,
        vertical_sync: false,
        overlap: input.overlap,
        pairing: None,
    });
    let mut out = Periodic { body: BTreeMap::new(), segments: FlushFree::default(), microbatches: n };
    for (dev, stream) in streams {
        if stream.is_empty() {
            for part in [&mut out.segments.prologue, &mut out.body, &mut out.segments.epilogue] {
                part.insert(dev, Vec::new());
            }
            continue;
        }
        // cut after step k's last backward and what finishes it
        let mut cuts = Vec::with_capacity(3);
        for k in 1..4 {
            let last = stream
                .iter()
                .rposition(|i| {
                    matches!(i, Instr::Backward { .. } | Instr::BackwardWeight { .. })
                        && i.microbatch().is_some_and(|m| (m.0 as usize) < k * n)
                })
                .ok_or_else(|| format!("{dev} runs no backward of step {}", k - 1))?;
            let mut cut = last + 1;
            while cut < stream.len() && !prepares(&stream[cut]) {
                cut += 1;
            }
            // an all-reduce started there whose wait and update were deferred to the
            // stage's next backward (overlap) ends the step with them: no collective is in
            // flight between steps, so every step's segment is self-contained
            for ins in &stream[last + 1..cut] {
                if let Instr::Collective { payload, stage, group, .. } = *ins {
                    let wait = Instr::wait(payload, stage, group);
                    if let Some(at) = stream[cut..].iter().position(|x| *x == wait) {
                        let mut end = cut + at + 1;
                        if stream.get(end) == Some(&Instr::OptimizerStep { stage }) {
                            end += 1;
                        }
                        cut = cut.max(end);
                    }
                }
            }
            cuts.push(cut);
        }
        let seg = |a: usize, b: usize, k: i64| shift_microbatches(&stream[a..b], -k * n as i64);
        let (s0, s1, s2, s3) =
            (seg(0, cuts[0], 0), seg(cuts[0], cuts[1], 1), seg(cuts[1], cuts[2], 2), seg(cuts[2], stream.len(), 3));
        if s1 != s2 {
            return Err(format!("{} is not periodic on {dev}: its second and third steps differ", input.kind));
        }
        if !s0.ends_with(&s1) {
            return Err(format!("{} does not settle into its steady state within its first step on {dev}", input.kind));
        }
        out.segments.prologue.insert(dev, s0[..s0.len() - s1.len()].to_vec());
        out.body.insert(dev, s1);
        out.segments.epilogue.insert(dev, s3);
    }
    Ok(out)
}

/// The streams of `steps` steps, microbatches numbered `t·N + m` across the run.
pub fn unroll(p: &Periodic, steps: usize) -> BTreeMap<DeviceId, Vec<Instr>> {
    p.segments.unroll(&p.body, p.microbatches, steps)
}

/// Verifies the unrolled streams of 1, 2 and 3 steps; the violations' messages, if any.
pub fn verify_periodic(
    p: &Periodic,
    placement: &Placement,
    groups: &HashMap<GroupId, Vec<DeviceId>>,
    update_every: Option<usize>,
    recompute: &[bool],
) -> Vec<String> {
    let mut out = Vec::new();
    for k in 1..=3 {
        let streams = unroll(p, k);
        let run = repeated(placement, k);
        let violations = verify(&VerifyInput {
            streams: &streams,
            placement: &run,
            groups,
            recompute,
            update_every,
            asp_staleness: None,
            tp: 1,
            // asynchronous schedules do not shard, and clip each stage's update by its own norm
            sharding: pipec_plan::vocab::Sharding::None,
            clipping: false,
            forward_only: false,
            // asynchronous schedules are not expert-parallel (the front end's E0419)
            expert_parallel: &[],
            all_to_alls: &[],
            expert_groups: &BTreeMap::new(),
            chunks: pipec_plan::schedule::ChunkPlacement::RoundRobin,
            context_parallel: 1,
            in_pass: None,
        });
        out.extend(violations.into_iter().map(|v| format!("unrolled over {k} step(s): {}", v.message)));
    }
    out
}

/// The steady state of a flush-free schedule under a cost model: the time one step's body
/// adds to a run (PipeDream's time per minibatch), the idle share of device-time in it, and
/// the first step's time (with the pipeline filling); per device, the busy time one step's
/// body adds; and the timeline of a two-step run (fill, one steady step, drain).
#[derive(Debug, Clone, PartialEq)]
pub struct SteadyState {
    pub step_time: f64,
    pub bubble: f64,
    pub first_step_time: f64,
    pub busy: BTreeMap<DeviceId, f64>,
    /// Per device, what one step's body adds to its all-reduces' time in flight and exposed.
    pub collectives: BTreeMap<DeviceId, (f64, f64)>,
    pub two_steps: Timeline,
}

/// Simulates 1, 2 and 3 steps: the difference of the last two is one steady step.
pub fn steady_state(
    p: &Periodic,
    groups: &HashMap<GroupId, Vec<DeviceId>>,
    cost: &dyn CostModel,
) -> Result<SteadyState, String> {
    let run = |k: usize| -> Result<Timeline, String> {
        simulate(&unroll(p, k), groups, cost).map_err(|s| format!("the unrolled schedule deadlocks: {}", s.reason))
    };
    let (one, two, three) = (run(1)?, run(2)?, run(3)?);
    let busy = |t: &Timeline| -> BTreeMap<DeviceId, f64> {
        let mut out: BTreeMap<DeviceId, f64> = BTreeMap::new();
        for e in &t.events {
            if !e.background && !matches!(e.phase, pipec_plan::Phase::Communication | pipec_plan::Phase::Memory) {
                *out.entry(e.device).or_insert(0.0) += e.end - e.start;
            }
        }
        out
    };
    let (b2, b3) = (busy(&two), busy(&three));
    let per_device: BTreeMap<DeviceId, f64> =
        b3.iter().map(|(d, b)| (*d, b - b2.get(d).copied().unwrap_or(0.0))).collect();
    let (c2, c3) = (crate::simulate::collective_times(&two), crate::simulate::collective_times(&three));
    let collectives = c3
        .iter()
        .map(|(d, (f, e))| {
            let (f2, e2) = c2.get(d).copied().unwrap_or((0.0, 0.0));
            (*d, (f - f2, e - e2))
        })
        .collect();
    let step_time = three.step_time - two.step_time;
    let devices = p.body.values().filter(|s| !s.is_empty()).count().max(1) as f64;
    let total: f64 = per_device.values().sum();
    let bubble = if step_time > 0.0 { 1.0 - total / (step_time * devices) } else { 0.0 };
    Ok(SteadyState {
        step_time,
        bubble: bubble.max(0.0),
        first_step_time: one.step_time,
        busy: per_device,
        collectives,
        two_steps: two,
    })
}
