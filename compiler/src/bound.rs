//! What a strategy costs at least, without lowering, verifying or simulating it: the bounds
//! the strategy search prunes with (`search`), and the work its candidates share (`Memo`).

use std::collections::HashMap;

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::{Recompute, Spec};
use pipec_plan::vocab::{ScheduleKind, Sharding};
use pipec_plan::{DeviceId, Instr, MicrobatchId, StageId};

use crate::cluster::ClusterGraph;
use crate::figures::{stage_figures, StageFigures};
use crate::model::{cost_model, ModelCosts};
use crate::options::CompileOptions;
use crate::partition::{partition_layers, Layout, Partitions};
use crate::place::place;
use crate::plan_cost::PlanCost;
use crate::schedule::{generate, reads_backward_slots, Order, Placement, TaskKind};
use crate::simulate::CostModel;
use crate::streams::{backward_slots, runs_flush_free, sends_gradients_first};

/// What a strategy costs at least, found without lowering, verifying or simulating it:
/// the bound the strategy search prunes with (`search`).
#[derive(Debug, Clone, PartialEq)]
pub struct Bound {
    /// No simulation of the strategy predicts a shorter step (a flush-free schedule's
    /// steady state included); 0 when one of its stages alone overflows a device (found
    /// before it is placed).
    pub step_s: f64,
    /// Whether the weights, gradients and optimizer state with the activations the
    /// schedule keeps at once (counted from its order on one pipeline replica where the
    /// plan is symmetric and flushes, else one microbatch of one stage: the least any
    /// schedule keeps), the largest recompute unit, the buffers and the workspace reserve
    /// overflow some device: then no plan of the strategy fits.
    pub overflows: bool,
    /// Whether the least model state any ZeRO level leaves a device (ZeRO-3's share) with
    /// the least one microbatch keeps under any recompute choice, the buffers and the
    /// reserve overflows it: then no ZeRO level fits either, whatever its stages recompute.
    pub overflows_any_sharding: bool,
    /// Whether the model state at the strategy's own ZeRO level with the least one
    /// microbatch keeps under any recompute choice, inside the blocks too (its stage's input
    /// and a layer's backward transient), the buffers and the reserve overflows some device:
    /// then no recompute choice fits at this level (a ZeRO level above it may).
    pub overflows_any_recompute: bool,
    /// The layout bounded: replicas per pipeline rank (PipeDream's planner's choice when
    /// the strategy leaves it to `partition: auto`).
    pub replicas: Vec<usize>,
    /// Per stage, the memory headroom of the fullest device holding it by this bound's
    /// memory (never below the compiled plan's): the stages short of memory, which a
    /// candidate that does not fit without recompute may recompute alone.
    pub stage_headroom: Vec<f64>,
    /// Whether the activations were counted from the schedule's order (one pipeline
    /// replica of a symmetric plan, the memory pass's own count), not as one microbatch.
    pub walked: bool,
}

/// The lower bound of a checked spec's strategy: per device, the compute of every
/// microbatch of every stage it holds, with the same per-instruction costs the simulator
/// uses; for a flush schedule, plus the forwards (and cheapest transfers) of the stages
/// upstream of the device's first stage (they run before its first instruction, for its
/// first microbatch) and then the longer of the upstream backwards (they follow its last
/// instruction, for its last microbatch; not with a split backward, whose last instruction
/// may be a weight pass; less that weight pass where later stages send their gradients
/// first) and, when every stage it holds is replicated, the all-reduce of the stage its
/// last instruction belongs to; and no less than its communication engine's ZeRO-2/3
/// reduce-scatters. Its memory as [`Bound::overflows`] says.
pub fn lower_bound(spec: &Spec, options: &CompileOptions, memo: &mut Memo) -> Result<Bound, Vec<Diagnostic>> {
    let (model, layout) = memo.model_and_layout(spec, options)?;
    let model = &*model;
    let stages = stage_figures(spec, model, &layout);
    let capacity = model.cluster.memory;
    let reserve = crate::memory::workspace_reserve(capacity) as f64;
    let m = StageMemory { stages: &stages, recompute: &layout.recompute, reserve };
    let (kept, unit, buffer, beside, state) =
        (|s| m.kept(s), |s| m.unit(s), |s| m.buffer(s), |s| m.beside(s), |s| m.state(s));
    let (least_state, least_beside, least_beside_blocks) =
        (|s| m.least_state(s), |s| m.least_beside(s), |s| m.least_beside_blocks(s));
    // every stage is on some device: one stage too big for a device needs no placement to
    // tell (the bound's memory below, stage by stage) when no ZeRO level is to be derived
    // from it (whose bounds want this one's step)
    let n_stages = layout.ranges.len();
    let overflows_sharded = (0..n_stages).any(|s| least_state(s) + least_beside(s) > capacity);
    if (spec.strategy.sharding != Sharding::None || overflows_sharded)
        && (0..n_stages).any(|s| state(s) + beside(s) > capacity)
    {
        let overflows_any_recompute = (0..n_stages).any(|s| state(s) + least_beside_blocks(s) > capacity);
        return Ok(Bound {
            step_s: 0.0,
            overflows: true,
            overflows_any_sharding: overflows_sharded,
            overflows_any_recompute,
            replicas: layout.replicas,
            stage_headroom: (0..n_stages).map(|s| 1.0 - (state(s) + beside(s)) / capacity).collect(),
            walked: false,
        });
    }
    let placed = memo.placed(spec, &layout, &model.cluster)?;
    let cost = PlanCost::new(spec, model, &stages, HashMap::new());
    let kind = spec.strategy.schedule.kind;
    let split = kind.splits_backward();
    let passes = Passes::new(spec, &layout, &stages, &placed, &cost);
    let Passes { forward, upstream_backward, weight, backward, recompute, hop, .. } = &passes;
    let forward_hop: Vec<f64> = forward.iter().zip(hop).map(|(f, h)| f + h).collect();
    let backward_hop: Vec<f64> = upstream_backward.iter().zip(hop).map(|(b, h)| b + h).collect();
    let all_reduce = least_reductions(model, &stages, &placed, &cost);
    let scatters_each_microbatch = spec.strategy.sharding.level() >= 2
        && kind.updates(layout.replicas.len()) == pipec_plan::schedule::Updates::PerStep;
    let flush = !runs_flush_free(spec);
    let mut step_s: f64 = 0.0;
    let mut devices: Vec<DeviceMemory> = Vec::with_capacity(placed.bounded.len());
    let mut all_kept: f64 = 0.0;
    let cap = placed.view.as_ref().filter(|_| flush).and_then(|v| crate::schedule::in_flight_cap(kind, v));
    for (device, stage_counts) in &placed.bounded {
        let held: Vec<usize> = stage_counts.iter().map(|&(s, _)| s).collect();
        let mut load = 0.0;
        let mut held_state = 0.0;
        // the least the memory pass can find on the device beside its model state (the same
        // terms as `memory::device_memory`): one microbatch of one held stage kept for its
        // backward (every forward adds that much before anything is freed), the largest
        // recompute unit, the buffers
        let (mut one_microbatch, mut recompute_unit, mut buffers) = (0.0_f64, 0.0_f64, 0.0_f64);
        // DualPipe's pairs save at most their best saving once per forward
        let best_pair = held.iter().flat_map(|&f| held.iter().map(move |&b| (f, b)));
        let best_pair = best_pair.map(|(f, b)| passes.pair_saving(f, b)).fold(0.0_f64, f64::max);
        // ZeRO-3 on pipec's executor: a device holding one sharded stage gathers its whole
        // weights at least once a step, with nothing to hide it behind (a gather ahead is
        // of another stage; `PlanCost::with_stage_gathers`)
        if let [s] = held.as_slice() {
            load += stages.stage_gathers.get(*s).copied().unwrap_or(0.0);
        }
        for &(s, n) in stage_counts {
            load += n as f64 * (forward[s] + backward[s] + recompute[s] - best_pair);
            held_state += state(s);
            one_microbatch = one_microbatch.max(kept(s));
            recompute_unit = recompute_unit.max(unit(s));
            buffers = buffers.max(buffer(s));
        }
        let (head, tail) = if flush {
            head_and_tail(&held, (&forward_hop, &backward_hop), weight, &all_reduce, split)
        } else {
            (0.0, 0.0)
        };
        // the communication engine runs a device's collectives one at a time: under ZeRO-2
        // and 3 a replicated stage reduce-scatters every microbatch's gradients
        // (`lower::scatter_contribution`), each at least its bound's reduce-scatter
        let engine: f64 = if scatters_each_microbatch {
            stage_counts.iter().map(|&(s, n)| n as f64 * all_reduce[s].unwrap_or(0.0)).sum()
        } else {
            0.0
        };
        step_s = step_s.max(head + load + tail).max(engine);
        // every microbatch it runs kept at once, or as many as the schedule's generator
        // lets a device hold: the most its order keeps
        let every: f64 = stage_counts.iter().map(|&(s, n)| n as f64 * kept(s)).sum();
        let most = cap.map_or(every, |c| every.min(c as f64 * one_microbatch));
        all_kept = all_kept.max(held_state + recompute_unit + buffers + reserve + most);
        let least = held.iter().map(|&s| least_state(s)).sum::<f64>()
            + held.iter().map(|&s| least_beside(s)).fold(0.0, f64::max);
        let least_here = held_state + held.iter().map(|&s| least_beside_blocks(s)).fold(0.0, f64::max);
        devices.push(DeviceMemory {
            device: *device,
            held,
            state: held_state,
            least,
            least_here,
            one_microbatch,
            beside: one_microbatch + recompute_unit + buffers + reserve,
        });
    }
    let fits_one_microbatch = devices.iter().all(|d| d.state + d.beside <= capacity);
    // then, if one microbatch fits and all of them might not, the activations' peak as the
    // memory pass finds it in the streams, from the schedule's order (for the devices of the
    // pipeline replica whose order was walked; not for a flush-free pipeline, whose streams
    // are a steady state's)
    let in_flight = (flush && fits_one_microbatch && all_kept > capacity)
        // (the combined 1F1B's pairs hold what 1F1B holds: each pair's forward keeps layer by
        // layer what its backward frees, `memory::device_memory`)
        .then(|| memo.in_flight(&placed, kind, layout.replicas.len(), backward_slots(&stages.times)))
        .flatten();
    let overflows_any_recompute = devices.iter().any(|d| d.least_here > capacity);
    let (overflows, overflows_any_sharding, stage_headroom) =
        memory_verdict(devices, in_flight.as_deref(), &placed.ids, &kept, (capacity, n_stages));
    let walked = in_flight.is_some();
    Ok(Bound {
        step_s,
        overflows,
        overflows_any_sharding,
        overflows_any_recompute,
        replicas: layout.replicas,
        stage_headroom,
        walked,
    })
}

/// A candidate's memory terms per stage, as the bound reads them (bytes, as `f64`).
struct StageMemory<'a> {
    stages: &'a StageFigures,
    recompute: &'a [bool],
    reserve: f64,
}

impl StageMemory<'_> {
    /// One microbatch's kept tensors.
    fn kept(&self, s: usize) -> f64 {
        let b = &self.stages.bytes[s];
        (if self.recompute[s] { b.checkpoint_per_microbatch } else { b.activations_per_microbatch }) as f64
    }

    /// What a microbatch's backward holds beyond the kept tensors (a recomputed stage's
    /// largest unit, rebuilt; a layer's transient; the loss's backward).
    fn unit(&self, s: usize) -> f64 {
        self.stages.bytes[s].transient(self.recompute[s]) as f64
    }

    /// The messages in flight, ZeRO-3's gathered layers and ZeRO-2/3's whole gradients a
    /// reduce-scatter takes.
    fn buffer(&self, s: usize) -> f64 {
        let b = &self.stages.bytes[s];
        b.largest_message.saturating_mul(4).saturating_add(b.gathered_weights).saturating_add(b.scattered_gradients)
            as f64
    }

    /// What a device needs beside its model state for one of its stages at least: one
    /// microbatch kept, the stage's recompute unit, its buffers, the reserve.
    fn beside(&self, s: usize) -> f64 {
        self.kept(s) + self.unit(s) + self.buffer(s) + self.reserve
    }

    /// The stage's weights, gradients and optimizer state on a replica.
    fn state(&self, s: usize) -> f64 {
        let b = &self.stages.bytes[s];
        (b.weights + b.gradients + b.optimizer) as f64
    }

    /// The least model state any ZeRO level leaves a replica of the stage (ZeRO-3's share).
    fn least_state(&self, s: usize) -> f64 {
        let b = &self.stages.bytes[s];
        b.whole.sharded(Sharding::Parameters, b.replicas).total() as f64
    }

    /// With the least one microbatch of the stage keeps keeping everything or recomputing
    /// every forward (the sharded candidates derive their own partial recompute), its
    /// messages' buffers and the reserve.
    fn least_beside(&self, s: usize) -> f64 {
        let b = &self.stages.bytes[s];
        let kept = (b.activations_per_microbatch.saturating_add(b.transient(false)) as f64)
            .min(b.checkpoint_per_microbatch.saturating_add(b.transient(true)) as f64);
        kept + b.largest_message.saturating_mul(4) as f64 + self.reserve
    }

    /// The least under any recompute choice inside the blocks too: at least the stage's
    /// input, and beside it at least a layer's backward transient (a choice's unit rebuilt
    /// adds to it).
    fn least_beside_blocks(&self, s: usize) -> f64 {
        let b = &self.stages.bytes[s];
        (b.activations_per_microbatch.min(b.checkpoint_per_microbatch).saturating_add(b.transient(false))) as f64
            + b.largest_message.saturating_mul(4) as f64
            + self.reserve
    }
}

/// Whether some device overflows its memory (with the activations' peak the schedule's
/// order keeps where it was walked), whether one would under any ZeRO level, and each
/// stage's least headroom over the devices holding it.
fn memory_verdict(
    devices: Vec<DeviceMemory>,
    in_flight: Option<&InFlight>,
    ids: &[u32],
    kept: &dyn Fn(usize) -> f64,
    (capacity, n_stages): (f64, usize),
) -> (bool, bool, Vec<f64>) {
    let mut overflows = false;
    let mut overflows_any_sharding = false;
    let mut stage_headroom = vec![f64::INFINITY; n_stages];
    for d in devices {
        let mut beside = d.beside;
        let in_view = ids.binary_search(&(d.device as u32)).ok();
        if let Some((stages_held, frontier)) = in_flight.zip(in_view).and_then(|(f, i)| f.get(i)) {
            let peak = frontier
                .iter()
                .map(|counts| stages_held.iter().zip(counts).map(|(&s, &c)| c as f64 * kept(s)).sum::<f64>())
                .fold(0.0, f64::max);
            beside += (peak - d.one_microbatch).max(0.0);
        }
        overflows |= d.state + beside > capacity;
        overflows_any_sharding |= d.least > capacity;
        let headroom = 1.0 - (d.state + beside) / capacity;
        for &s in &d.held {
            stage_headroom[s] = stage_headroom[s].min(headroom);
        }
    }
    (overflows, overflows_any_sharding, stage_headroom)
}

/// A flushed pipeline's least time on a device before its first pass and after its last:
/// the forwards (with their hops) upstream of its first stage, and the longer of the
/// upstream backwards less the last weight pass and the all-reduce of a replicated stage.
fn head_and_tail(
    held: &[usize],
    (forward_hop, backward_hop): (&[f64], &[f64]),
    weight: &[f64],
    all_reduce: &[Option<f64>],
    split: bool,
) -> (f64, f64) {
    let upstream = |v: &[f64]| held.iter().map(|&c| v[..c].iter().sum::<f64>()).fold(f64::INFINITY, f64::min);
    // the device's last instruction is a backward of a stage it holds; when every
    // stage it holds is replicated, that stage's all-reduce follows it
    let reduce = held.iter().map(|&c| all_reduce[c]).try_fold(f64::INFINITY, |m, a| a.map(|a| m.min(a))).unwrap_or(0.0);
    // with a split backward the last instruction may be a weight pass, after which
    // nothing upstream need wait; a stage that sends its gradient first runs its
    // last weight pass (`weight`, 0 for a whole backward) beside the upstream
    // backwards
    let drain = if split {
        0.0
    } else {
        held.iter().map(|&c| (backward_hop[..c].iter().sum::<f64>() - weight[c]).max(0.0)).fold(f64::INFINITY, f64::min)
    };
    (upstream(forward_hop), drain.max(reduce))
}

/// Per stage, the least time its gradient reduction leaves after its last backward (None
/// for a stage without replicas): a reduce-scatter, whatever the ZeRO level (the all-reduce
/// of stage 0 is one and an all-gather; the gradient shards of stages 1 to 3 are one), so
/// that the bound of a sharded strategy is never below its unsharded one's and the search
/// may derive the sharded ones from it.
fn least_reductions(
    model: &ModelCosts,
    stages: &StageFigures,
    placed: &Placed,
    cost: &PlanCost<'_>,
) -> Vec<Option<f64>> {
    let share = stages.expert_share();
    (0..stages.bytes.len())
        .map(|s| {
            let members = &placed.skeleton.replicas[s];
            (members.len() > 1).then(|| {
                // expert parallelism sums the routed experts' part over fewer members (or
                // none): the dense part's reduce-scatter is what is certain; with gradient
                // buckets only the last bucket's (the stage's first layers) starts after
                // the backward
                let bytes = match stages.buckets[s].last() {
                    Some(b) => (b.bytes as f64 * (1.0 - share[s])) as u64,
                    None => stages.bytes[s].whole.gradients.saturating_sub(stages.expert_gradients[s]),
                };
                let kind = pipec_plan::CollectiveKind::ReduceScatter;
                let scatter = model.cluster.shaped_collective_time(kind, placed.skeleton.shapes[s], bytes);
                scatter.min(cost.shaped_reduce_time(members, placed.skeleton.shapes[s], bytes))
            })
        })
        .collect()
}

/// Per device of one pipeline replica, the stages it holds (ascending) and the maximal
/// counts of their microbatches kept at once — a microbatch is kept from its forward to the
/// pass that frees it (its whole backward, or its weight pass when the backward is split),
/// as lowering frees it — over the order: the peak of any weighting of the counts (each
/// stage's bytes per microbatch) is the largest over these.
type InFlight = Vec<(Vec<usize>, Vec<Vec<u32>>)>;

/// The microbatches past which a schedule's counts in flight no longer change: a pipeline
/// that keeps one device per stage reaches its steady state within about two rounds of its
/// devices, whatever its chunks per device (measured on 2 to 9 devices: 1F1B and ZB-H1 at
/// one round, interleaved with 2 to 4 chunks and DualPipeV at two, ZB-V by 2.11 rounds),
/// after which each further microbatch repeats the steady state's peaks. Two rounds for
/// the schedules that settle in one and three for the others leave room to spare; the test
/// below holds the frontier equal to the whole order's on 2 to 16 devices.
fn saturation(kind: ScheduleKind, ranks: usize) -> usize {
    let rounds = match kind {
        ScheduleKind::OneFOneB
        | ScheduleKind::PipeDream
        | ScheduleKind::TwoBw
        | ScheduleKind::DpOnly
        | ScheduleKind::ZbH1 => 2,
        ScheduleKind::Gpipe
        | ScheduleKind::Interleaved
        | ScheduleKind::Chimera
        | ScheduleKind::Zbv
        | ScheduleKind::DualPipeV
        | ScheduleKind::DualPipe => 3,
    };
    rounds * ranks.max(1)
}

/// GPipe's counts in flight without its order: every device runs all its forwards before
/// any backward, so its one peak keeps every microbatch of every stage it holds (what
/// `in_flight` finds walking `schedule::gpipe`'s order; tested against it).
fn gpipe_in_flight(view: &Placement) -> InFlight {
    let mut counts: Vec<Vec<(usize, u32)>> = vec![Vec::new(); view.devices];
    for (s, (replicas, route)) in view.replicas.iter().zip(&view.route).enumerate() {
        for (d, n) in replicas.iter().zip(per_replica(replicas, route)) {
            if n > 0 {
                counts[d.0 as usize].push((s, n as u32));
            }
        }
    }
    counts
        .into_iter()
        .map(|mut held| {
            held.sort_unstable();
            let (stages, counts): (Vec<usize>, Vec<u32>) = held.into_iter().unzip();
            let frontier = if counts.is_empty() { Vec::new() } else { vec![counts] };
            (stages, frontier)
        })
        .collect()
}

/// 1F1B's counts in flight without its order, where each stage has a device of its own:
/// stage s of p keeps min(p − s, m) microbatches at its peak — its warm-up's p − s − 1
/// forwards and the first of its steady state's pairs (1F1B, PipeDream, 2BW). ZB-H1's
/// deferred weight halves hold each activation until its weight half runs, so every stage
/// keeps min(p, m), the first stage's. Tested against the walked orders; None for any other
/// view or schedule.
fn one_f_one_b_in_flight(kind: ScheduleKind, view: &Placement) -> Option<InFlight> {
    let p = view.stages();
    let peak: fn(usize, usize, usize) -> usize = match kind {
        ScheduleKind::OneFOneB | ScheduleKind::PipeDream | ScheduleKind::TwoBw => |p, s, m| (p - s).min(m),
        ScheduleKind::ZbH1 => |p, _, m| p.min(m),
        _ => return None,
    };
    if view.replicas.iter().any(|r| r.len() != 1) || view.devices != p {
        return None;
    }
    let mut out: InFlight = vec![(Vec::new(), Vec::new()); p];
    for (s, replicas) in view.replicas.iter().enumerate() {
        let d = replicas[0].0 as usize;
        if d >= p || !out[d].0.is_empty() {
            return None;
        }
        let peak = peak(p, s, view.microbatches) as u32;
        out[d] = (vec![s], if peak > 0 { vec![vec![peak]] } else { Vec::new() });
    }
    Some(out)
}

/// How many of a stage's microbatches each of its `replicas` runs, from its `route`.
fn per_replica(replicas: &[DeviceId], route: &[u32]) -> Vec<usize> {
    let mut counts = vec![0usize; replicas.len()];
    for &k in route {
        counts[k as usize] += 1;
    }
    counts
}

/// `view` with its microbatches cut to `saturation`'s (keeping interleaved's multiple of the
/// ranks), where every stage has one device and the schedule keeps a bounded number of
/// microbatches in flight (not GPipe's all of them): the in-flight frontier of the cut
/// order is the whole order's, at a fraction of the work (the 530B search's 2,520
/// microbatches per pipeline).
fn saturated(kind: ScheduleKind, view: &Placement, ranks: usize) -> Option<Placement> {
    let cap = saturation(kind, ranks);
    if kind == ScheduleKind::Gpipe || view.microbatches <= cap || view.replicas.iter().any(|r| r.len() != 1) {
        return None;
    }
    Some(Placement {
        replicas: view.replicas.clone(),
        route: vec![vec![0; cap]; view.stages()],
        devices: view.devices,
        microbatches: cap,
    })
}

fn in_flight(order: &Order) -> InFlight {
    let mut out = InFlight::with_capacity(order.len());
    for tasks in order {
        let mut held: Vec<usize> = tasks.iter().map(|t| t.stage.0 as usize).collect();
        held.sort_unstable();
        held.dedup();
        let mut now = vec![0u32; held.len()];
        // the counts at each local peak: after a run of forwards, before the next free
        let mut seen: Vec<Vec<u32>> = Vec::new();
        let mut rising = false;
        for t in tasks {
            let Ok(i) = held.binary_search(&(t.stage.0 as usize)) else { continue };
            match t.kind {
                TaskKind::Forward => {
                    now[i] += 1;
                    rising = true;
                }
                TaskKind::Backward | TaskKind::BackwardWeight => {
                    if std::mem::take(&mut rising) {
                        seen.push(now.clone());
                    }
                    now[i] = now[i].saturating_sub(1);
                }
                TaskKind::BackwardInput => {}
            }
        }
        if rising {
            seen.push(now);
        }
        // the Pareto frontier: a count dominated by another never gives the peak
        seen.sort_unstable_by(|a, b| b.iter().sum::<u32>().cmp(&a.iter().sum::<u32>()).then_with(|| b.cmp(a)));
        seen.dedup();
        let mut frontier: Vec<Vec<u32>> = Vec::new();
        for v in seen {
            if !frontier.iter().any(|f| f.iter().zip(&v).all(|(a, b)| a >= b)) {
                frontier.push(v);
            }
        }
        out.push((held, frontier));
    }
    out
}

/// One bounded device's memory by the bound: the stages it holds, its model state, the
/// least any ZeRO level and any recompute leave it (state and beside), one microbatch of
/// its held stages kept, and beside its state that microbatch, the largest recompute
/// unit, the buffers and the reserve.
struct DeviceMemory {
    device: usize,
    held: Vec<usize>,
    state: f64,
    least: f64,
    /// The model state at the strategy's own ZeRO level with the least any recompute
    /// choice keeps beside it (`Bound::overflows_any_recompute`).
    least_here: f64,
    one_microbatch: f64,
    beside: f64,
}

/// Per stage, one microbatch's passes as the simulator prices them (`PlanCost`), and the
/// cheapest hop to the next stage.
struct Passes {
    forward: Vec<f64>,
    /// The backward up to the stage's gradient for the stage before: its input-gradient
    /// pass where the backward is split (by the schedule, or by sending gradients first),
    /// else the whole backward.
    upstream_backward: Vec<f64>,
    /// What follows it: the weight pass of a split backward, else 0.
    weight: Vec<f64>,
    /// The whole backward (`upstream_backward` + `weight`).
    backward: Vec<f64>,
    /// The forward recomputed before the backward of a recomputed stage, else 0.
    recompute: Vec<f64>,
    /// The cheapest transfer of stage s's output to stage s + 1 (either direction: the
    /// gradient coming back is the same size).
    hop: Vec<f64>,
    /// DualPipe's overlapped pairs (`ScheduleKind::overlaps_pairs`): `pair[f][b]`, what a
    /// forward of stage f and a whole backward of stage b take as one unit (at least the
    /// forward), for a stage b that is not recomputed. Empty under other schedules.
    pair: Vec<Vec<Option<f64>>>,
    /// The plan's pairing (`Strategy::pairing`), None without pairs.
    pairing: Option<pipec_plan::schedule::Pairing>,
}

impl Passes {
    /// What pairing the forward of stage `f` with the whole backward of stage `b` saves
    /// (0 where they do not pair).
    fn pair_saving(&self, f: usize, b: usize) -> f64 {
        match self.pair.get(f).and_then(|row| row.get(b)).copied().flatten() {
            Some(both) => (self.forward[f] + self.recompute[b] + self.backward[b] - both).max(0.0),
            None => 0.0,
        }
    }
}

impl Passes {
    fn new(spec: &Spec, layout: &Layout, stages: &StageFigures, placed: &Placed, cost: &PlanCost) -> Passes {
        let split = spec.strategy.schedule.kind.splits_backward();
        // a later stage sends its gradient after its input-gradient pass
        let early_send = sends_gradients_first(spec, layout.replicas.len());
        let n = layout.ranges.len();
        let mb = MicrobatchId(0);
        // each pass with the all-to-alls it posts
        let of = |ins: Instr| cost.compute(DeviceId(0), &ins) + cost.exchanged(&ins);
        let stage = |s: usize| StageId(s as u32);
        let forward: Vec<f64> = (0..n).map(|s| of(Instr::Forward { stage: stage(s), mb })).collect();
        let (upstream_backward, weight): (Vec<f64>, Vec<f64>) = (0..n)
            .map(|s| {
                if split || (early_send && s > 0) {
                    (
                        of(Instr::BackwardInput { stage: stage(s), mb }),
                        of(Instr::BackwardWeight { stage: stage(s), mb }),
                    )
                } else {
                    (of(Instr::Backward { stage: stage(s), mb }), 0.0)
                }
            })
            .unzip();
        let backward = upstream_backward.iter().zip(&weight).map(|(b, w)| b + w).collect();
        let recompute = (0..n).map(|s| if layout.recompute[s] { forward[s] } else { 0.0 }).collect();
        let hop = (0..n)
            .map(|s| {
                let Some(&(a, b)) = placed.skeleton.pairs.get(s) else { return 0.0 };
                cost.transfer(a, b, stages.output_bytes[s]).min(cost.transfer(b, a, stages.output_bytes[s]))
            })
            .map(|t| if t.is_finite() { t } else { 0.0 })
            .collect();
        let pairing = spec.strategy.pairing();
        let pair = if let Some(pairing) = pairing {
            (0..n)
                .map(|f| {
                    (0..n)
                        .map(|b| {
                            let (fw, bw) =
                                (Instr::Forward { stage: stage(f), mb }, Instr::Backward { stage: stage(b), mb });
                            // a forward pairs with a backward of another microbatch
                            let other = (stage(b), MicrobatchId(1));
                            let paired = pairing.pairs((stage(f), mb), other) && !layout.recompute[b];
                            let exchanged = cost.exchanged(&fw) + cost.exchanged(&bw);
                            paired
                                .then(|| cost.overlapped(DeviceId(0), &fw, &bw, exchanged))
                                .flatten()
                                .map(|t| t.max(forward[f]))
                        })
                        .collect()
                })
                .collect()
        } else {
            Vec::new()
        };
        Passes { forward, upstream_backward, weight, backward, recompute, hop, pair, pairing }
    }
}

/// A tighter bound for a strategy [`lower_bound`] found to fit, before the search lowers and
/// simulates it: the schedule's own order run on one pipeline replica with the simulator's
/// pass costs and the cheapest hops, each pass starting when its device is free and its
/// input (the previous stage's activation, the next stage's gradient) has arrived — the
/// simulator's rules without its collectives, sends' link queues, loads and updates, which
/// only add time. Its bubble is the schedule's (zero-bubble V's unit-time order, ZeRO-2's
/// waits aside). A plan that is not symmetric runs whole; 0 for a flush-free steady state.
pub fn timeline_bound(spec: &Spec, options: &CompileOptions, memo: &mut Memo) -> Result<f64, Vec<Diagnostic>> {
    let (model, layout) = memo.model_and_layout(spec, options)?;
    let model = &*model;
    if runs_flush_free(spec) {
        return Ok(0.0);
    }
    let placed = memo.placed(spec, &layout, &model.cluster)?;
    // one pipeline replica when the plan is symmetric, else the whole placement
    let whole;
    let view = match placed.view.as_ref() {
        Some(v) => v,
        None => {
            whole = place(spec, &layout, &model.cluster)?;
            &whole
        }
    };
    let stages = stage_figures(spec, model, &layout);
    let cost = PlanCost::new(spec, model, &stages, HashMap::new());
    let passes = Passes::new(spec, &layout, &stages, &placed, &cost);
    let slots = backward_slots(&stages.times);
    let order =
        generate(spec.strategy.schedule.kind, view, layout.replicas.len(), slots, spec.strategy.combined_1f1b());
    Ok(run_order(&order, view, &passes))
}

/// The step of `order` under [`timeline_bound`]'s rules: each device runs its tasks in order.
fn run_order(order: &Order, view: &Placement, p: &Passes) -> f64 {
    let (n, m) = (view.stages(), view.microbatches);
    let at = |s: usize, mb: usize| s * m + mb;
    // when a forward's output, and a backward's gradient for the stage before, is computed
    let mut output = vec![f64::NAN; n * m];
    let mut gradient = vec![f64::NAN; n * m];
    let mut free = vec![0.0_f64; order.len()];
    let mut next = vec![0usize; order.len()];
    loop {
        let (mut progress, mut pending) = (false, false);
        for (d, tasks) in order.iter().enumerate() {
            while let Some(t) = tasks.get(next[d]) {
                let (s, mb) = (t.stage.0 as usize, t.mb.0 as usize);
                if s >= n || mb >= m {
                    return 0.0;
                }
                let input = match t.kind {
                    TaskKind::Forward if s == 0 => 0.0,
                    TaskKind::Forward => output[at(s - 1, mb)] + p.hop[s - 1],
                    TaskKind::Backward | TaskKind::BackwardInput if s + 1 == n => output[at(s, mb)],
                    TaskKind::Backward | TaskKind::BackwardInput => gradient[at(s + 1, mb)] + p.hop[s],
                    TaskKind::BackwardWeight => 0.0,
                };
                if input.is_nan() {
                    break;
                }
                // DualPipe's overlapped pair: the forward and the whole backward after it
                // start once both their inputs are in and take the pair's time (`p.pair` has
                // none for a recomputed backward, nor outside DualPipe)
                let paired_with =
                    p.pairing.and_then(|r| crate::schedule::paired_backward(tasks, next[d], |_| false, r));
                let paired = paired_with.and_then(|b| {
                    let both = p.pair.get(s)?.get(b.stage.0 as usize).copied().flatten()?;
                    Some((b.stage.0 as usize, b.mb.0 as usize, both))
                });
                if let Some((bs, bmb, both)) = paired {
                    if bs >= n || bmb >= m {
                        return 0.0;
                    }
                    let gradient_in =
                        if bs + 1 == n { output[at(bs, bmb)] } else { gradient[at(bs + 1, bmb)] + p.hop[bs] };
                    if gradient_in.is_nan() {
                        break;
                    }
                    let start = free[d].max(input).max(gradient_in);
                    output[at(s, mb)] = start + p.forward[s];
                    free[d] = start + both;
                    gradient[at(bs, bmb)] = free[d] - p.weight[bs];
                    next[d] += 2;
                    progress = true;
                    continue;
                }
                let start = free[d].max(input);
                free[d] = match t.kind {
                    TaskKind::Forward => {
                        output[at(s, mb)] = start + p.forward[s];
                        output[at(s, mb)]
                    }
                    TaskKind::BackwardInput => {
                        gradient[at(s, mb)] = start + p.recompute[s] + p.upstream_backward[s];
                        gradient[at(s, mb)]
                    }
                    // a whole backward, or one split by sending its gradient first
                    TaskKind::Backward => {
                        gradient[at(s, mb)] = start + p.recompute[s] + p.upstream_backward[s];
                        gradient[at(s, mb)] + p.weight[s]
                    }
                    TaskKind::BackwardWeight => start + p.weight[s],
                };
                next[d] += 1;
                progress = true;
            }
            pending |= next[d] < tasks.len();
        }
        if !pending {
            return free.iter().copied().fold(0.0, f64::max);
        }
        if !progress {
            // inputs that never come under these rules: no bound from them
            return 0.0;
        }
    }
}

/// A pair of devices, one from each list, on the fastest link any such pair has (the same
/// device, the same node, or else any two): linear in the lists, for the bound's hops
/// between replicated stages.
pub(crate) fn closest_pair(cluster: &ClusterGraph, from: &[DeviceId], to: &[DeviceId]) -> (DeviceId, DeviceId) {
    let (Some(&a), Some(&b)) = (from.first(), to.first()) else { return (DeviceId(0), DeviceId(0)) };
    let devices: rustc_hash::FxHashSet<DeviceId> = from.iter().copied().collect();
    if let Some(&d) = to.iter().find(|d| devices.contains(d)) {
        return (d, d);
    }
    let nodes: rustc_hash::FxHashMap<u32, DeviceId> = from.iter().map(|&d| (cluster.node_of(d), d)).collect();
    to.iter().find_map(|&d| nodes.get(&cluster.node_of(d)).map(|&f| (f, d))).unwrap_or((a, b))
}

/// What a candidate's model costs depend on among what the search changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct CostKey {
    tp: usize,
    microbatch_size: usize,
    ep_replicas: usize,
    cp: usize,
    /// (a ring prices attention's core and keeps other bytes than the all-gather)
    cp_comm: pipec_plan::vocab::CpComm,
    experts_whole: bool,
    recomputes_by_operation: bool,
    /// (FP8 products, their casts and what the blocks keep)
    fp8: Option<pipec_plan::plan::Fp8Plan>,
    /// (what the blocks keep, and their collectives)
    sequence_parallel: bool,
    /// (split products in steps)
    tp_overlap: bool,
}

/// Work the candidates of one spec's strategy search share: the model's costs per
/// (tensor-parallel degree, microbatch size, expert- and context-parallel degree, context
/// exchange, whole experts, recompute by operation, FP8, sequence parallelism and the
/// tensor-parallel overlap: [`CostKey`]) — all a candidate changes in them — and the
/// balanced partitions of each; the placements (with what the bound reads of them)
/// per chunk placement, layout, degree and microbatch count. Only for specs that differ in
/// their strategy.
#[derive(Default)]
pub struct Memo {
    pub(crate) models: rustc_hash::FxHashMap<CostKey, (std::rc::Rc<ModelCosts>, Partitions)>,
    placements: rustc_hash::FxHashMap<PlaceKey, std::rc::Rc<Placed>>,
    skeletons: rustc_hash::FxHashMap<SkeletonKey, std::rc::Rc<Skeleton>>,
    /// What a schedule's order keeps in flight on a view's devices, per view shape: the
    /// views of candidates that differ in data-parallel or tensor-parallel degree but give
    /// each replica as many microbatches are alike once their devices are numbered densely.
    in_flight: rustc_hash::FxHashMap<InFlightKey, std::rc::Rc<InFlight>>,
}

/// The schedule, the backward's length in forwards (Chimera's packing reads it), the
/// view's microbatches, its devices per stage and, unless each stage has one device (every
/// microbatch then takes it), its routes.
type InFlightKey = (ScheduleKind, usize, usize, Vec<Vec<DeviceId>>, Option<Vec<Vec<u32>>>);

/// What a placement depends on: the schedule's chunk placement, the replicas per chunk,
/// the chunks, the tensor-parallel degree and the microbatches.
type PlaceKey = (pipec_plan::schedule::ChunkPlacement, Vec<usize>, usize, usize, usize);

/// What a placement's devices depend on: [`PlaceKey`] without the microbatches.
type SkeletonKey = (pipec_plan::schedule::ChunkPlacement, Vec<usize>, usize, usize);

/// What the bound reads of a placement that does not depend on the microbatches, computed
/// once per [`SkeletonKey`] (not its routes, which a large search's placements would fill
/// memory with).
pub(crate) struct Skeleton {
    /// Per stage, the devices holding a replica.
    replicas: Vec<Vec<DeviceId>>,
    /// Per stage boundary, the pair of devices on the fastest link between the two stages'
    /// replicas.
    pairs: Vec<(DeviceId, DeviceId)>,
    /// Per stage, its replica group's shape on the cluster.
    shapes: Vec<crate::cluster::GroupShape>,
    /// Each rank's replica-0 device where the layout is symmetric
    /// (`place::symmetric_leaders`): where a pipeline replica stands for all.
    leaders: Option<Vec<DeviceId>>,
}

impl Skeleton {
    fn new(placement: &Placement, rank_replicas: &[usize], tp: usize, cluster: &ClusterGraph) -> Self {
        let pairs = placement.replicas.windows(2).map(|w| closest_pair(cluster, &w[0], &w[1])).collect();
        let shapes = placement.replicas.iter().map(|r| cluster.group_shape(r)).collect();
        let leaders = crate::place::symmetric_leaders(rank_replicas, tp, cluster);
        Skeleton { replicas: placement.replicas.clone(), pairs, shapes, leaders }
    }
}

/// What the bound reads of a placement, computed once per [`PlaceKey`].
pub(crate) struct Placed {
    skeleton: std::rc::Rc<Skeleton>,
    /// One pipeline replica of the placement (`one_replica`; the placement itself when it
    /// has no replicas), its devices numbered densely in the order of their ids, or None
    /// when the plan is not symmetric: where the bound walks the schedule's order.
    view: Option<Placement>,
    /// The plan's device id of each of the view's devices (ascending).
    ids: Vec<u32>,
    /// The devices whose figures the bound takes the largest of — the view's when there is
    /// one (every replica of a symmetric plan runs alike: `one_replica`), else every device
    /// that holds a stage — by id, each with the stages it holds (ascending) and its
    /// microbatches of each.
    bounded: Vec<(usize, Vec<(usize, usize)>)>,
}

impl Placed {
    /// From the view, or from the whole placement when there is none.
    fn new(skeleton: std::rc::Rc<Skeleton>, view: Option<Placement>, whole: Option<&Placement>) -> Self {
        // one pass over the routes, not one per device
        let mut holds: rustc_hash::FxHashMap<usize, Vec<(usize, usize)>> = Default::default();
        if let Some(source) = view.as_ref().or(whole) {
            for (s, (replicas, route)) in source.replicas.iter().zip(&source.route).enumerate() {
                for (d, n) in replicas.iter().zip(per_replica(replicas, route)) {
                    let held = holds.entry(d.0 as usize).or_default();
                    match held.last_mut() {
                        // a Chimera stage whose down and up copies share the device
                        Some((last, count)) if *last == s => *count += n,
                        _ => held.push((s, n)),
                    }
                }
            }
        }
        let (ids, view) = match view {
            Some(mut v) => {
                let mut ids: Vec<u32> = v.replicas.iter().flatten().map(|d| d.0).collect();
                ids.sort_unstable();
                ids.dedup();
                for d in v.replicas.iter_mut().flatten() {
                    d.0 = ids.binary_search(&d.0).unwrap_or(0) as u32;
                }
                v.devices = ids.len();
                (ids, Some(v))
            }
            None => (Vec::new(), None),
        };
        let mut bounded: Vec<(usize, Vec<(usize, usize)>)> = holds.into_iter().collect();
        bounded.sort_unstable_by_key(|(d, _)| *d);
        Placed { skeleton, view, ids, bounded }
    }
}

impl Memo {
    /// What `kind`'s order keeps in flight on each device of a placement's view.
    fn in_flight(
        &mut self,
        placed: &Placed,
        kind: ScheduleKind,
        ranks: usize,
        slots: usize,
    ) -> Option<std::rc::Rc<InFlight>> {
        let view = placed.view.as_ref()?;
        let routes = view.replicas.iter().any(|r| r.len() != 1).then(|| view.route.clone());
        let saturated = if routes.is_none() { saturated(kind, view, ranks) } else { None };
        let view = saturated.as_ref().unwrap_or(view);
        // an order that does not read the backward's length is the same for every length
        let key =
            (kind, slots * usize::from(reads_backward_slots(kind)), view.microbatches, view.replicas.clone(), routes);
        Some(
            self.in_flight
                .entry(key)
                .or_insert_with(|| {
                    std::rc::Rc::new(if kind == ScheduleKind::Gpipe {
                        gpipe_in_flight(view)
                    } else if let Some(counts) = one_f_one_b_in_flight(kind, view) {
                        counts
                    } else {
                        in_flight(&generate(kind, view, ranks, slots, false))
                    })
                })
                .clone(),
        )
    }

    /// A candidate's placement (`place::place`), with what the bound reads of it.
    pub(crate) fn placed(
        &mut self,
        spec: &Spec,
        layout: &Layout,
        cluster: &ClusterGraph,
    ) -> Result<std::rc::Rc<Placed>, Vec<Diagnostic>> {
        let s = &spec.strategy;
        let key = (
            s.schedule.kind.chunk_placement(),
            layout.replicas.clone(),
            layout.ranges.len(),
            s.tp.max(1),
            s.microbatches,
        );
        if let Some(p) = self.placements.get(&key) {
            return Ok(p.clone());
        }
        // the devices (and whether the layout can be placed at all) do not depend on the
        // microbatches; the routes are built only where no pipeline replica stands for all
        let skeleton_key = (key.0, key.1.clone(), key.2, key.3);
        let mut whole = None;
        let skeleton = match self.skeletons.get(&skeleton_key) {
            Some(k) => k.clone(),
            None => {
                let placement = place(spec, layout, cluster)?;
                let k = std::rc::Rc::new(Skeleton::new(&placement, &layout.replicas, s.tp, cluster));
                self.skeletons.insert(skeleton_key, k.clone());
                whole = Some(placement);
                k
            }
        };
        let view = skeleton
            .leaders
            .as_ref()
            .and_then(|leaders| crate::place::one_replica_of(spec, layout, s.microbatches, cluster, leaders))
            .map(|(view, _)| view);
        let unreplicated = layout.replicas.iter().all(|&r| r == 1) && s.tp.max(1) == 1;
        if view.is_none() && whole.is_none() {
            whole = Some(place(spec, layout, cluster)?);
        }
        let placed = std::rc::Rc::new(if view.is_none() && unreplicated {
            // the placement is its own pipeline replica
            Placed::new(skeleton, whole, None)
        } else {
            Placed::new(skeleton, view, whole.as_ref())
        });
        self.placements.insert(key, placed.clone());
        Ok(placed)
    }

    /// The cost model and the layout of a candidate.
    pub(crate) fn model_and_layout(
        &mut self,
        spec: &Spec,
        options: &CompileOptions,
    ) -> Result<(std::rc::Rc<ModelCosts>, Layout), Vec<Diagnostic>> {
        let (model, partitions) = self.entry(spec, options)?;
        let layout = partition_layers(spec, model, Some(partitions))?;
        Ok((model.clone(), layout))
    }

    /// A candidate's cost model (computed once per tensor-parallel degree, microbatch size
    /// and expert-parallel degree) and its partitions.
    pub(crate) fn entry(
        &mut self,
        spec: &Spec,
        options: &CompileOptions,
    ) -> Result<&mut (std::rc::Rc<ModelCosts>, Partitions), Vec<Diagnostic>> {
        let key = CostKey {
            tp: spec.strategy.tp.max(1),
            microbatch_size: spec.strategy.microbatch_size(spec.training.batch_size),
            ep_replicas: spec.strategy.ep_replicas(),
            cp: spec.strategy.cp.max(1),
            cp_comm: spec.strategy.cp_comm,
            experts_whole: spec.strategy.experts_whole(),
            recomputes_by_operation: crate::model::recomputes_by_operation(spec),
            fp8: spec.training.fp8,
            sequence_parallel: spec.strategy.sequence_parallel,
            tp_overlap: spec.strategy.tp_overlap,
        };
        Ok(match self.models.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert((std::rc::Rc::new(cost_model(spec, options)?), Partitions::default()))
            }
        })
    }
}

/// A bound on any layout of a checked spec's strategy: every microbatch's compute (forward,
/// backward, recomputed forward) spread evenly over the devices. What the strategy search
/// ranks a layout PipeDream's planner has not laid out yet by (no per-device load is
/// below the average; the tensor-parallel all-reduces inside passes only add).
pub fn work_bound(spec: &Spec, options: &CompileOptions, memo: &mut Memo) -> Result<f64, Vec<Diagnostic>> {
    let model = memo.entry(spec, options)?.0.clone();
    // (the stages are not known yet: a list of recomputed stages counts as none)
    let recompute = if spec.strategy.recompute == Recompute::All { 1.0 } else { 0.0 };
    let per_microbatch: f64 = model.costs.iter().map(|c| c.forward_s * (1.0 + recompute) + c.backward_s).sum();
    let machines = (model.cluster.device_count() / spec.strategy.tp.max(1)).max(1);
    Ok(per_microbatch * spec.strategy.microbatches as f64 / machines as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(kind: ScheduleKind, ranks: usize, v: usize, m: usize) -> Placement {
        let chunks = kind.chunk_placement();
        let stages = ranks * v;
        let replicas = (0..stages).map(|c| vec![DeviceId(chunks.rank_of_chunk(c, ranks) as u32)]).collect();
        Placement { replicas, route: vec![vec![0; m]; stages], devices: ranks, microbatches: m }
    }

    /// The cut order's frontier is the whole order's, for every schedule the cut applies
    /// to, beyond the cut by a little and up to three times it.
    #[test]
    fn the_cut_order_keeps_the_whole_orders_counts_in_flight() {
        let kinds = [
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::PipeDream, 1),
            (ScheduleKind::ZbH1, 1),
            (ScheduleKind::Interleaved, 2),
            (ScheduleKind::Interleaved, 3),
            (ScheduleKind::Interleaved, 4),
            (ScheduleKind::Zbv, 2),
            (ScheduleKind::DualPipeV, 2),
        ];
        let mut checked = 0;
        for (kind, v) in kinds {
            for ranks in 2..=16 {
                let cap = saturation(kind, ranks);
                // interleaved's microbatches are a multiple of the ranks; the others' any
                let odd = if kind == ScheduleKind::Interleaved { cap + ranks } else { cap + ranks / 2 + 1 };
                for m in [odd, cap + ranks, 2 * cap + 3 * ranks, 4 * cap] {
                    let whole = view(kind, ranks, v, m);
                    let cut = saturated(kind, &whole, ranks).expect("cut past the saturation");
                    assert_eq!(cut.microbatches, cap);
                    for slots in [1, 2, 3] {
                        // and the combined 1F1B's (`ep_overlap`), one forward longer
                        for combined in [false, true] {
                            assert_eq!(
                                in_flight(&generate(kind, &cut, ranks, slots, combined)),
                                in_flight(&generate(kind, &whole, ranks, slots, combined)),
                                "{kind:?} on {ranks} ranks, {v} chunks each, {m} microbatches, backward {slots} forwards, combined {combined}"
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 8 * 15 * 4 * 3);
        // GPipe keeps every microbatch, and a view with several devices per stage is routed:
        // neither is cut
        assert!(saturated(ScheduleKind::Gpipe, &view(ScheduleKind::Gpipe, 4, 1, 100), 4).is_none());
        // GPipe's frontier without its order is the order's
        for (ranks, m) in [(1, 1), (2, 3), (4, 8), (7, 20)] {
            let v = view(ScheduleKind::Gpipe, ranks, 1, m);
            assert_eq!(gpipe_in_flight(&v), in_flight(&generate(ScheduleKind::Gpipe, &v, ranks, 2, false)));
        }
        let mut routed = view(ScheduleKind::OneFOneB, 4, 1, 100);
        routed.replicas[0].push(DeviceId(4));
        assert!(saturated(ScheduleKind::OneFOneB, &routed, 4).is_none());
    }

    #[test]
    fn one_f_one_b_s_counts_in_flight_without_its_order_are_the_orders() {
        let mut checked = 0;
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::PipeDream, ScheduleKind::TwoBw, ScheduleKind::ZbH1] {
            for ranks in 1..=16usize {
                for m in [1, 2, ranks.saturating_sub(1).max(1), ranks, ranks + 1, 2 * ranks + 3] {
                    let v = view(kind, ranks, 1, m);
                    for slots in [1, 2, 3] {
                        assert_eq!(
                            one_f_one_b_in_flight(kind, &v),
                            Some(in_flight(&generate(kind, &v, ranks, slots, false))),
                            "{kind:?} on {ranks} ranks, {m} microbatches, backward {slots} forwards"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 4 * 16 * 6 * 3);
        // ZB-H1's last stage keeps as many as its first, unlike 1F1B's
        let zb = one_f_one_b_in_flight(ScheduleKind::ZbH1, &view(ScheduleKind::ZbH1, 4, 1, 8)).expect("ZB-H1");
        let one = one_f_one_b_in_flight(ScheduleKind::OneFOneB, &view(ScheduleKind::OneFOneB, 4, 1, 8)).expect("1F1B");
        assert_eq!((zb[3].1.clone(), one[3].1.clone()), (vec![vec![4]], vec![vec![1]]));
        // not for another schedule, nor a stage with several devices
        assert_eq!(one_f_one_b_in_flight(ScheduleKind::Interleaved, &view(ScheduleKind::Interleaved, 4, 2, 8)), None);
        let mut routed = view(ScheduleKind::OneFOneB, 4, 1, 8);
        routed.replicas[0].push(DeviceId(4));
        assert_eq!(one_f_one_b_in_flight(ScheduleKind::OneFOneB, &routed), None);
    }
}

#[cfg(test)]
mod combined_1f1b_tests {
    use std::collections::HashMap;

    use pipec_plan::{DeviceId, Instr, MicrobatchId, StageId};

    use crate::plan_cost::PlanCost;
    use crate::simulate::CostModel;

    /// A stage of two mixture-of-experts blocks under Megatron-LM's combined 1F1B: its pairs
    /// overlap each layer's exchanges phase by phase with the other pass's parts.
    #[test]
    fn the_combined_1f1b_overlaps_each_layers_exchanges_with_the_other_passs_parts() {
        let text = "model:
  input: [64]
  layers:
    - embedding(50, 64)
    - repeat 2: transformer_block(64, 4, 128, experts=4, top_k=2)
    - linear(64, 50, bias=false)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: 2
  device: h100-sxm
  links: dgx-h100
strategy:
  dp: 2
  schedule: 1f1b
  microbatches: 4
  ep: 2
  ep_overlap: true
training:
  batch_size: 8
  steps: 1
  optimizer: { kind: sgd, lr: 0.1 }
";
        let spec = pipec_grammar::check_source(text).spec.expect("checks");
        let (model, layout) =
            super::Memo::default().model_and_layout(&spec, &crate::CompileOptions::default()).expect("compiles");
        let stages = crate::figures::stage_figures(&spec, &model, &layout);
        let cost = PlanCost::new(&spec, &model, &stages, HashMap::new());
        let parts = &stages.moe_parts[0];
        assert_eq!(parts.len(), 2, "two expert blocks");
        let (f, b) = (
            Instr::Forward { stage: StageId(0), mb: MicrobatchId(1) },
            Instr::Backward { stage: StageId(0), mb: MicrobatchId(0) },
        );
        let whole = cost.compute(DeviceId(0), &f) + cost.compute(DeviceId(0), &b);
        // the parts are the stage's: the blocks' attention and MLP inside its passes
        let computed: f64 = parts.iter().map(|p| p.attention[0] + p.mlp[0] + p.attention[1] + p.mlp[1]).sum();
        assert!(parts.iter().all(|p| p.mlp[0] > 0.0 && p.attention[0] > 0.0 && p.mlp[1] > p.mlp[0]));
        assert!(computed < whole, "the embedding and the output are not paired");
        let pair = |sent: &[f64], returned: &[f64]| {
            cost.overlapped_exchanges(DeviceId(0), (&f, &b), (sent, returned)).expect("a pair")
        };
        // nothing exchanged: the two passes, nothing hidden, nothing added
        assert!((pair(&[0.0; 4], &[0.0; 4]) - whole).abs() < 1e-12 * whole);
        // exchanges far longer than any part: each phase is its exchanges, the rest of the
        // computation on top (a whole overlap would have given the exchanges alone)
        let long = 1.0;
        let all = pair(&[long; 4], &[long; 4]);
        assert!((all - (8.0 * long + whole - computed)).abs() < 1e-9, "{all}");
        // the forward's k-th layer with the backward's k-th from the last, each pair as
        // `layer_pair` issues it; a pair without exchanges is its four parts one after the
        // other
        let (x, y) = (parts[0], parts[1]);
        let sent = [x.attention[0] * 0.5, x.mlp[0] * 3.0, 0.0, 0.0];
        let returned = [y.attention[0] * 2.0, y.mlp[1] * 0.25, 0.0, 0.0];
        let by_hand = crate::plan_cost::layer_pair(&x, &y, [sent[0], sent[1]], [returned[0], returned[1]])
            + x.attention[1]
            + x.mlp[1]
            + y.attention[0]
            + y.mlp[0]
            + (whole - computed);
        let got = pair(&sent, &returned);
        assert!((got - by_hand).abs() < 1e-12 * by_hand, "{got} against {by_hand}");
        // never less than the longer of the two sums, never more than one after the other
        let exchanged: f64 = sent.iter().chain(&returned).sum();
        assert!(got >= whole.max(exchanged) && got <= whole + exchanged);
        // an exchange the layers do not pair (a fifth) runs after them
        let odd = pair(&[0.0, 0.0, 0.0, 0.0, 0.5], &[0.0; 4]);
        assert!((odd - whole - 0.5).abs() < 1e-9);
    }

    /// One layer pair by hand, in Megatron-LM's order on its two streams: the forward's
    /// attention 1 and MLP 1, the backward's attention 2 and MLP 2, the forward's dispatch
    /// 3 and nothing else exchanged. Compute: attention 0–1, the backward's MLP 1–3; the
    /// dispatch 1–4; the forward's MLP waits for it, 4–5; the backward's attention 5–7. The
    /// phases taken apart (each its longer side: 1 + max(2 + 1, 3) + 2) would give 6.
    #[test]
    fn a_layer_pairs_forward_mlp_waits_for_its_own_dispatch() {
        use crate::figures::MoeParts;
        let f = MoeParts { attention: [1.0, 0.0], mlp: [1.0, 0.0] };
        let b = MoeParts { attention: [0.0, 2.0], mlp: [0.0, 2.0] };
        let pair = |forward, backward| crate::plan_cost::layer_pair(&f, &b, forward, backward);
        assert_eq!(pair([3.0, 0.0], [0.0, 0.0]), 7.0);
        // nothing exchanged: the four parts one after the other
        assert_eq!(pair([0.0; 2], [0.0; 2]), 6.0);
        // exchanges far longer than the parts: the four one after the other, each waiting
        // for the part before it on the other stream
        assert_eq!(pair([10.0; 2], [10.0; 2]), 1.0f64.max(10.0) + 10.0 + 10.0 + 10.0);
        // the backward's dispatch waits for its MLP's input gradient (1–2) and runs 2–3,
        // beside the MLPs (1–4): hidden; the backward's attention 4–6
        assert_eq!(pair([0.0; 2], [0.0, 1.0]), 6.0);
    }
}
