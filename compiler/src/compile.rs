//! The compiler driver: the readable list of passes from a checked spec to a verified,
//! simulated plan.
//!
//! ```text
//! Spec ─cost_model→ ModelCosts ─partition_layers→ Layout ─place→ Placement
//!      ─stage_figures→ StageFigures ─lower_streams→ Lowered (schedule::generate, lower,
//!      tensor-parallel copies) ─verify_lowered→ ─simulate_plan→ Timeline
//!      ─check_memory→ devices + diagnostics ─assemble→ Plan
//! ```
//!
//! [`compile`] is that list; each pass is a function from one type to the next, and the
//! result is one [`CompileResult`] (the plan, if any, and every diagnostic).

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::{Data, Optimizer, Partition, Recompute, Spec};
use pipec_plan::model::Source;
use pipec_plan::plan::{
    DataPlan, DevicePlan, DeviceSimulation, GroupPlan, LayerPlan, ModelPlan, OptimizerPlan, ScheduleInfo, Simulation,
    StagePlan, TrainingPlan, PLAN_VERSION,
};
use pipec_plan::schedule::{ChunkPlacement, Updates, WeightVersions};
use pipec_plan::vocab::{ReduceMode, ScheduleKind, SyncMode};
use pipec_plan::{DeviceId, GroupId, Instr, Phase, Plan, StageId};

use crate::cluster::{parameter_server_time, ring_allreduce_time, ClusterGraph};
use crate::cost::{analytic_costs, ApplyProfile, LayerCost, Profile};
use crate::ir::{self, Graph};
use crate::lower::{lower, LowerInput};
use crate::memory::{device_memory, human_bytes, StageBytes};
use crate::partition::{self, AutoInput, WeightSync};
use crate::schedule::{generate, send_gradients_first, Placement};
use crate::simulate::{simulate, utilisation, CostModel, Timeline};
use crate::verify::{verify, VerifyInput};

/// Options beyond the spec.
#[derive(Debug, Clone, Default)]
pub struct CompileOptions {
    /// Measured per-layer costs replacing the analytic ones.
    pub profile: Option<Profile>,
    /// Directory of the spec file (relative data paths are resolved against it).
    pub base_dir: Option<std::path::PathBuf>,
    /// The spec's text: a strategy with `auto` fields is searched as text (each candidate
    /// goes through the front end like a written spec).
    pub source: Option<std::sync::Arc<str>>,
}

/// A plan and what it was built from.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub plan: Plan,
    pub graph: Graph,
    pub timeline: Timeline,
}

/// What a compile produced: the plan when one could be built (also when it does not fit in
/// memory: the diagnostics then hold the errors), and every diagnostic about it.
#[derive(Debug, Clone)]
pub struct CompileResult {
    pub compiled: Option<Compiled>,
    pub diagnostics: Vec<Diagnostic>,
}

impl CompileResult {
    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(Diagnostic::is_error)
    }
    /// The plan when one was built (it may still not fit: see the diagnostics); the
    /// diagnostics otherwise.
    pub fn into_compiled(self) -> Result<Compiled, Vec<Diagnostic>> {
        self.compiled.ok_or(self.diagnostics)
    }
}

/// Compiles a checked spec: the passes in order. A pass that cannot go on ends the compile
/// with its diagnostics; the memory check reports problems with the plan it built.
pub fn compile(spec: &Spec, options: &CompileOptions) -> CompileResult {
    if let Some(auto) = &spec.strategy.auto {
        return crate::search::compile_auto(spec, options, auto);
    }
    let passes = || -> Result<(Compiled, Vec<Diagnostic>), Vec<Diagnostic>> {
        let model = cost_model(spec, options)?;
        let layout = partition_layers(spec, &model, None)?;
        let placement = place(spec, &layout, &model.cluster)?;
        check_ties(spec, &layout)?;
        let stages = stage_figures(spec, &model, &layout);
        let mut lowered = lower_streams(spec, &layout, &placement, &placement.replicas, &stages, model.precision);
        tensor_parallel_copies(&mut lowered, spec.strategy.tp.max(1));
        verify_lowered(spec, &placement, &lowered)?;
        let devices = model.cluster.devices();
        let simulated = simulate_plan(spec, &model, &layout, &stages, &lowered, &devices)?;
        let (devices, diagnostics) =
            check_memory(spec, &model, &placement, &stages, &lowered, simulated.bubble, &devices);
        let plan = assemble(spec, options, &model, layout, &placement, &stages, lowered, &simulated, devices);
        Ok((Compiled { plan, graph: model.graph, timeline: simulated.timeline }, diagnostics))
    };
    match passes() {
        Ok((compiled, diagnostics)) => CompileResult { compiled: Some(compiled), diagnostics },
        Err(diagnostics) => CompileResult { compiled: None, diagnostics },
    }
}

/// What a strategy costs at least, found without lowering, verifying or simulating it:
/// the bound the strategy search prunes with (`search`).
#[derive(Debug, Clone, PartialEq)]
pub struct Bound {
    /// No simulation of the strategy predicts a shorter step (a flush-free schedule's
    /// steady state included).
    pub step_s: f64,
    /// Whether the weights, gradients and optimizer state alone (and the workspace
    /// reserve) overflow some device: then no plan of the strategy fits.
    pub overflows: bool,
    /// The layout bounded: replicas per pipeline rank (PipeDream's planner's choice when
    /// the strategy leaves it to `partition: auto`).
    pub replicas: Vec<usize>,
}

/// The lower bound of a checked spec's strategy: per device, the compute of every
/// microbatch of every stage it holds, with the same per-instruction costs the simulator
/// uses; for a flush schedule, plus the forwards (and cheapest transfers) of the stages
/// upstream of the device's first stage (they run before its first instruction, for its
/// first microbatch) and then the longer of the upstream backwards (they follow its last
/// instruction, for its last microbatch; not with a split backward, whose last instruction
/// may be a weight pass; less that weight pass where later stages send their gradients
/// first) and, when every stage it holds is replicated, the all-reduce of the stage its
/// last instruction belongs to.
pub fn lower_bound(spec: &Spec, options: &CompileOptions, memo: &mut Memo) -> Result<Bound, Vec<Diagnostic>> {
    let (model, layout) = memo.model_and_layout(spec, options)?;
    let model = &*model;
    let placement = place(spec, &layout, &model.cluster)?;
    let stages = stage_figures(spec, model, &layout);
    let cost = PlanCost::new(spec, model, &layout, &stages, HashMap::new());
    let kind = spec.strategy.schedule.kind;
    let split = kind.splits_backward();
    // a later stage sends its gradient after its input-gradient pass
    let early_send = sends_gradients_first(spec, layout.replicas.len());
    let split_at = |s: usize| split || (early_send && s > 0);
    let mb = pipec_plan::MicrobatchId(0);
    let of = |ins: Instr| cost.compute(DeviceId(0), &ins);
    let n_stages = placement.stages();
    let forward: Vec<f64> = (0..n_stages).map(|s| of(Instr::Forward { stage: StageId(s as u32), mb })).collect();
    // what follows a stage's last backward upstream: the input-gradient pass
    let upstream_backward: Vec<f64> = (0..n_stages)
        .map(|s| {
            let stage = StageId(s as u32);
            if split_at(s) {
                of(Instr::BackwardInput { stage, mb })
            } else {
                of(Instr::Backward { stage, mb })
            }
        })
        .collect();
    // what a stage's last instruction may overlap of the upstream backwards: its weight pass
    let last_weight_pass: Vec<f64> = (0..n_stages)
        .map(|s| if early_send && s > 0 { of(Instr::BackwardWeight { stage: StageId(s as u32), mb }) } else { 0.0 })
        .collect();
    // the cheapest transfer of stage s's output to stage s + 1 (either direction: the
    // gradient coming back is the same size)
    let hop: Vec<f64> = (0..n_stages)
        .map(|s| {
            let (Some(from), Some(to)) = (placement.replicas.get(s), placement.replicas.get(s + 1)) else { return 0.0 };
            let (a, b) = closest_pair(&model.cluster, from, to);
            cost.transfer(a, b, stages.output_bytes[s]).min(cost.transfer(b, a, stages.output_bytes[s]))
        })
        .map(|t| if t.is_finite() { t } else { 0.0 })
        .collect();
    let forward_hop: Vec<f64> = forward.iter().zip(&hop).map(|(f, h)| f + h).collect();
    let backward_hop: Vec<f64> = upstream_backward.iter().zip(&hop).map(|(b, h)| b + h).collect();
    // a replicated stage's gradient all-reduce
    let all_reduce: Vec<Option<f64>> = (0..n_stages)
        .map(|s| {
            let members = &placement.replicas[s];
            (members.len() > 1).then(|| cost.reduce_time(members, stages.bytes[s].weights))
        })
        .collect();
    let flush = !(matches!(kind, ScheduleKind::PipeDream | ScheduleKind::TwoBw)
        && !spec.strategy.schedule.vertical_sync
        && spec.strategy.tp.max(1) == 1);
    let capacity = model.cluster.memory;
    let reserve = crate::memory::workspace_reserve(capacity) as f64;
    // per device, the stages it holds (ascending) and its microbatches of each: one pass
    // over the routes, not one per device
    let mut holds: Vec<Vec<(usize, usize)>> = vec![Vec::new(); placement.devices];
    for (s, (replicas, route)) in placement.replicas.iter().zip(&placement.route).enumerate() {
        let mut per_replica = vec![0usize; replicas.len()];
        for &k in route {
            per_replica[k as usize] += 1;
        }
        for (d, n) in replicas.iter().zip(per_replica) {
            let held = &mut holds[d.0 as usize];
            match held.last_mut() {
                // a Chimera stage whose down and up copies share the device
                Some((last, count)) if *last == s => *count += n,
                _ => held.push((s, n)),
            }
        }
    }
    let mut step_s: f64 = 0.0;
    let mut overflows = false;
    for stage_counts in &holds {
        if stage_counts.is_empty() {
            continue;
        }
        let held: Vec<usize> = stage_counts.iter().map(|&(s, _)| s).collect();
        let mut load = 0.0;
        let mut state = 0.0;
        for &(s, n) in stage_counts {
            let stage = StageId(s as u32);
            let n = n as f64;
            let backward = if split_at(s) {
                of(Instr::BackwardInput { stage, mb }) + of(Instr::BackwardWeight { stage, mb })
            } else {
                of(Instr::Backward { stage, mb })
            };
            let recompute = if layout.recompute[s] { forward[s] } else { 0.0 };
            load += n * (forward[s] + backward + recompute);
            let b = &stages.bytes[s];
            state += (2 * b.weights + b.optimizer) as f64;
        }
        let (head, tail) = if flush {
            let upstream = |v: &[f64]| held.iter().map(|&c| v[..c].iter().sum::<f64>()).fold(f64::INFINITY, f64::min);
            // the device's last instruction is a backward of a stage it holds; when every
            // stage it holds is replicated, that stage's all-reduce follows it
            let reduce =
                held.iter().map(|&c| all_reduce[c]).try_fold(f64::INFINITY, |m, a| a.map(|a| m.min(a))).unwrap_or(0.0);
            // with a split backward the last instruction may be a weight pass, after which
            // nothing upstream need wait; a stage that sends its gradient first runs its
            // last weight pass beside the upstream backwards
            let drain = if split {
                0.0
            } else {
                held.iter()
                    .map(|&c| (backward_hop[..c].iter().sum::<f64>() - last_weight_pass[c]).max(0.0))
                    .fold(f64::INFINITY, f64::min)
            };
            (upstream(&forward_hop), drain.max(reduce))
        } else {
            (0.0, 0.0)
        };
        step_s = step_s.max(head + load + tail);
        overflows |= state + reserve > capacity;
    }
    Ok(Bound { step_s, overflows, replicas: layout.replicas })
}

/// A pair of devices, one from each list, on the fastest link any such pair has (the same
/// device, the same node, or else any two): linear in the lists, for the bound's hops
/// between replicated stages.
fn closest_pair(cluster: &ClusterGraph, from: &[DeviceId], to: &[DeviceId]) -> (DeviceId, DeviceId) {
    let (Some(&a), Some(&b)) = (from.first(), to.first()) else { return (DeviceId(0), DeviceId(0)) };
    let devices: rustc_hash::FxHashSet<DeviceId> = from.iter().copied().collect();
    if let Some(&d) = to.iter().find(|d| devices.contains(d)) {
        return (d, d);
    }
    let nodes: rustc_hash::FxHashMap<u32, DeviceId> = from.iter().map(|&d| (cluster.node_of(d), d)).collect();
    to.iter().find_map(|&d| nodes.get(&cluster.node_of(d)).map(|&f| (f, d))).unwrap_or((a, b))
}

/// PipeDream's planner's layout: replicas per stage and the stages' layer ranges.
type PlannedLayout = (Vec<usize>, Vec<Range<usize>>);

/// The partitions of one cost model: balanced ones by the replicas of each chunk, and
/// PipeDream's planner's (replicas and ranges) by whether activations are recomputed.
#[derive(Default)]
struct Partitions {
    balanced: HashMap<Vec<usize>, Option<Vec<Range<usize>>>>,
    planned: HashMap<bool, Option<PlannedLayout>>,
}

/// Work the candidates of one spec's strategy search share: the model's costs per
/// (tensor-parallel degree, microbatch size) — all a candidate's strategy changes in them —
/// and the balanced partitions of each. Only for specs that differ in their strategy.
#[derive(Default)]
pub struct Memo {
    models: HashMap<(usize, usize), (std::rc::Rc<ModelCosts>, Partitions)>,
}

impl Memo {
    /// The cost model and the layout of a candidate.
    fn model_and_layout(
        &mut self,
        spec: &Spec,
        options: &CompileOptions,
    ) -> Result<(std::rc::Rc<ModelCosts>, Layout), Vec<Diagnostic>> {
        let (model, partitions) = self.entry(spec, options)?;
        let layout = partition_layers(spec, model, Some(partitions))?;
        Ok((model.clone(), layout))
    }

    /// A candidate's cost model (computed once per tensor-parallel degree and microbatch
    /// size) and its partitions.
    fn entry(
        &mut self,
        spec: &Spec,
        options: &CompileOptions,
    ) -> Result<&mut (std::rc::Rc<ModelCosts>, Partitions), Vec<Diagnostic>> {
        let key = (spec.strategy.tp.max(1), spec.training.batch_size / spec.strategy.microbatches.max(1));
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

/// The layout as the compiler resolves it: ranks of the pipeline, chunks per rank.
struct Layout {
    /// Replicas of each pipeline rank's stages.
    replicas: Vec<usize>,
    virtual_stages: usize,
    ranges: Vec<Range<usize>>,
    notation: String,
    /// Per stage: activation recompute.
    recompute: Vec<bool>,
}

/// The model as the later passes see it: the IR, per-layer costs, the cluster.
struct ModelCosts {
    graph: Graph,
    costs: Vec<LayerCost>,
    cluster: ClusterGraph,
    /// Bytes per value at the training precision.
    precision: usize,
    microbatch_size: usize,
    /// Optimizer-state bytes per parameter.
    optimizer_bytes_per_parameter: f64,
}

/// IR and cost model: `Spec` → `ModelCosts` (analytic costs, or a measured profile).
fn cost_model(spec: &Spec, options: &CompileOptions) -> Result<ModelCosts, Vec<Diagnostic>> {
    let precision = spec.training.precision.bytes();
    let graph = ir::lower(&spec.model, precision);
    let cluster = ClusterGraph::new(&spec.cluster);
    let microbatch_size = spec.training.batch_size / spec.strategy.microbatches.max(1);
    let tp = spec.strategy.tp.max(1);
    let mut costs = analytic_costs(&graph, cluster.throughput * tp as f64, spec.cluster.overhead, microbatch_size);
    if let Some(profile) = &options.profile {
        profile.apply(&mut costs, microbatch_size).map_err(|e| {
            vec![Diagnostic::error(
                "E0604",
                format!("the profile does not fit the model: {e}"),
                spec.model.layers_span,
                "this model",
            )
            .with_help("profile this spec with `pipec profile`")]
        })?;
    }
    let optimizer_bytes_per_parameter = optimizer_bytes_per_parameter(&spec.training.optimizer, precision);
    Ok(ModelCosts { graph, costs, cluster, precision, microbatch_size, optimizer_bytes_per_parameter })
}

/// Per-stage figures: compute times, messages, bytes held.
struct StageFigures {
    /// (forward, backward) seconds per microbatch.
    times: Vec<(f64, f64)>,
    /// Seconds of one optimizer update of the stage's parameters (on one tensor-parallel rank).
    update: Vec<f64>,
    /// Output bytes per microbatch (what goes to the next stage).
    output_bytes: Vec<u64>,
    bytes: Vec<StageBytes>,
}

/// Stage figures: `Layout` → `StageFigures`.
fn stage_figures(spec: &Spec, model: &ModelCosts, layout: &Layout) -> StageFigures {
    let (costs, graph, mb) = (&model.costs, &model.graph, model.microbatch_size as u64);
    let tp = spec.strategy.tp.max(1) as u64;
    let times = layout
        .ranges
        .iter()
        .map(|r| {
            let c = &costs[r.clone()];
            (c.iter().map(|c| c.forward_s).sum::<f64>(), c.iter().map(|c| c.backward_s).sum::<f64>())
        })
        .collect();
    let update =
        layout.ranges.iter().map(|r| costs[r.clone()].iter().map(|c| c.update_s).sum::<f64>() / tp as f64).collect();
    // byte counts saturate: a spec past pipec's limits is refused by the front end, and a
    // figure that saturates reads as "does not fit" rather than wrapping to a small one
    let output_bytes: Vec<u64> =
        layout.ranges.iter().map(|r| graph.cut_bytes_per_sample(r.end).saturating_mul(mb)).collect();
    let bytes = layout
        .ranges
        .iter()
        .zip(&output_bytes)
        .map(|(r, &output)| {
            let c = &costs[r.clone()];
            let parameters: u64 = c.iter().map(|c| c.parameters).sum();
            let input_bytes =
                if r.start == 0 { graph.source_bytes(Source::Input) } else { graph.cut_bytes_per_sample(r.start) }
                    .saturating_mul(mb);
            // the last stage also keeps the loss's input for its backward: the model's
            // output (a language model's [sequence, vocab] logits), not split by tp
            let loss_input = if r.end == costs.len() {
                costs.last().map_or(0, |c| c.output_bytes_per_sample).saturating_mul(mb)
            } else {
                0
            };
            StageBytes {
                parameters,
                weights: c.iter().map(|c| c.parameter_bytes).sum::<u64>() / tp,
                optimizer: (parameters as f64 / tp as f64 * model.optimizer_bytes_per_parameter) as u64,
                activations_per_microbatch: (c
                    .iter()
                    .fold(0u64, |a, c| a.saturating_add(c.activation_bytes_per_sample))
                    .saturating_mul(mb)
                    / tp)
                    .saturating_add(loss_input),
                input_per_microbatch: input_bytes,
                largest_message: input_bytes.max(output),
            }
        })
        .collect();
    StageFigures { times, update, output_bytes, bytes }
}

/// The streams and the collective groups they use.
struct Lowered {
    streams: BTreeMap<DeviceId, Vec<Instr>>,
    /// Every collective group with its stage and members (tensor-parallel shifted copies
    /// included), in id order.
    groups: BTreeMap<GroupId, (StageId, Vec<DeviceId>)>,
    /// The replica group of each stage's leaders (None: unreplicated, or asp).
    group_of: Vec<Option<GroupId>>,
    /// Weight-tying groups: the tied (embedding, output projection) layers each sums.
    ties: BTreeMap<GroupId, [usize; 2]>,
    /// A flush-free pipeline (`streams` is then its body).
    periodic: Option<crate::periodic::Periodic>,
    updates: Updates,
    /// Asynchronous data parallelism (a parameter server instead of replica groups).
    asp: bool,
    /// The groups whose simulated members are fewer than the devices they sum over (the
    /// strategy search simulates one pipeline replica of a symmetric plan): who the
    /// all-reduce's cost is for. Empty for a whole plan.
    summed_over: HashMap<GroupId, Vec<DeviceId>>,
    /// Per stage: activation recompute (the layout's).
    recompute: Vec<bool>,
}

impl Lowered {
    fn members(&self) -> HashMap<GroupId, Vec<DeviceId>> {
        self.groups.iter().map(|(g, (_, m))| (*g, m.clone())).collect()
    }

    /// The streams whose counts the memory check reads: a flush-free pipeline's over three
    /// steps (what is in flight across step boundaries), a step's otherwise.
    fn counted_streams(&self) -> std::borrow::Cow<'_, BTreeMap<DeviceId, Vec<Instr>>> {
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
fn lower_streams(
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
    let gradient_bytes: Vec<u64> = stages.bytes.iter().map(|b| b.weights).collect();
    let streams = if asp {
        crate::lower::lower_asp(placement, gradient_bytes[0], strategy.schedule.staleness)
    } else {
        let mut order = generate(kind, placement, ranks, backward_slots(&stages.times));
        if sends_gradients_first(spec, ranks) {
            send_gradients_first(&mut order);
        }
        lower(&LowerInput {
            placement,
            order: &order,
            output_bytes: &stages.output_bytes,
            gradient_bytes: &gradient_bytes,
            groups: &group_of,
            updates,
            recompute: &layout.recompute,
            vertical_sync: strategy.schedule.vertical_sync,
            overlap: strategy.overlap,
        })
    };
    // PipeDream and 2BW run as one continuous pipeline when they can (vertical sync and
    // tensor parallelism keep a flush per step)
    let flush_free = !asp
        && matches!(kind, ScheduleKind::PipeDream | ScheduleKind::TwoBw)
        && !strategy.schedule.vertical_sync
        && strategy.tp.max(1) == 1;
    let periodic = flush_free
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
    };
    tied_all_reduces(spec, layout, placement, summed, &mut lowered, precision);
    lowered
}

/// Whether a later stage sends its input gradient before it computes its weight gradients
/// (`schedule::send_gradients_first`): with `overlap` (the default), on a schedule that
/// updates once per step and does not split its backward already, without tensor
/// parallelism (whose backward runs segment by segment with its all-reduces).
fn sends_gradients_first(spec: &Spec, pipeline_ranks: usize) -> bool {
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    strategy.overlap
        && kind.updates(pipeline_ranks) == Updates::PerStep
        && !kind.splits_backward()
        && strategy.tp.max(1) == 1
}

/// The stage holding layer `i`.
fn stage_of(layout: &Layout, i: usize) -> usize {
    layout.ranges.iter().position(|r| r.contains(&i)).unwrap_or(0)
}

/// Weight tying across stages needs every copy to update together: a synchronous schedule.
fn check_ties(spec: &Spec, layout: &Layout) -> Result<(), Vec<Diagnostic>> {
    let kind = spec.strategy.schedule.kind;
    if kind.updates(layout.replicas.len()) == Updates::PerStep {
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
/// projection's stage, and on each of them, after the step's replica all-reduces, a
/// `tiedallreduce` followed by the optimizer steps of the tied stages (moved behind it).
/// Ties within one stage need no communication: the executor sums the two gradients.
fn tied_all_reduces(
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
        let bytes = (l.op.parameter_count() as usize * precision) as u64;
        let tied = [StageId(sa as u32), StageId(sb as u32)];
        for d in members {
            let Some(stream) = lowered.streams.get_mut(&d) else { continue };
            let held: Vec<StageId> = tied.iter().copied().filter(|s| stream.iter().any(|i| i.stage() == *s)).collect();
            let steps: Vec<Instr> = stream
                .iter()
                .filter(|i| matches!(i, Instr::OptimizerStep { stage } if held.contains(stage)))
                .cloned()
                .collect();
            stream.retain(|i| !matches!(i, Instr::OptimizerStep { stage } if held.contains(stage)));
            stream.push(Instr::TiedAllReduce { stage: held[0], group, bytes });
            stream.extend(steps);
        }
    }
}

/// Tensor parallelism: every member t of a TP group runs its leader's stream with peers and
/// replica groups shifted by t (rank t of a stage talks to rank t of its neighbours).
fn tensor_parallel_copies(lowered: &mut Lowered, tp: usize) {
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
            shifted.insert(*g, id);
        }
        for (leader, stream) in &leaders {
            let copy = stream.iter().map(|i| i.map_devices(shift, |g| shifted.get(&g).copied().unwrap_or(g))).collect();
            lowered.streams.insert(shift(*leader), copy);
        }
    }
}

/// Verification: a failure is a compiler bug, reported as E0603.
fn verify_lowered(spec: &Spec, placement: &Placement, lowered: &Lowered) -> Result<(), Vec<Diagnostic>> {
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    let groups = lowered.members();
    let violations: Vec<String> = match &lowered.periodic {
        Some(p) => crate::periodic::verify_periodic(
            p,
            placement,
            &groups,
            lowered.updates.every(lowered.asp),
            &lowered.recompute,
        ),
        None => verify(&VerifyInput {
            streams: &lowered.streams,
            placement,
            groups: &groups,
            recompute: &lowered.recompute,
            update_every: lowered.updates.every(lowered.asp),
            asp_staleness: lowered.asp.then_some(strategy.schedule.staleness),
            tp: strategy.tp.max(1),
        })
        .into_iter()
        .map(|v| v.message)
        .collect(),
    };
    if violations.is_empty() {
        return Ok(());
    }
    let mut text = String::new();
    for v in violations.iter().take(8) {
        text.push_str(&format!("\n- {v}"));
    }
    Err(vec![Diagnostic::error(
        "E0603",
        format!(
            "internal compiler error: the {} plan failed verification ({} problem(s)):{text}",
            kind.name(),
            violations.len()
        ),
        strategy.schedule.span,
        "while compiling this schedule",
    )
    .with_help("this is a bug in pipec, not in the spec; please report it with the spec")])
}

/// The simulated step: the timeline and each device's busy time and bubble.
struct Simulated {
    /// The step's timeline (a flush-free pipeline's: two steps, fill to drain, indices
    /// being `plan::instruction_code`s).
    timeline: Timeline,
    /// Seconds per step (a flush-free pipeline's steady state) and, flush-free, the first
    /// step's.
    step_time: f64,
    first_step: Option<f64>,
    /// (device, busy seconds, bubble fraction) for every device of the cluster.
    per_device: Vec<(DeviceId, f64, f64)>,
    /// Idle share of device-time over the step.
    bubble: f64,
    /// Per device: its all-reduces' seconds in flight and exposed, per step.
    collectives: BTreeMap<DeviceId, (f64, f64)>,
}

/// Simulation: streams + cost model → `Simulated`, with figures for `device_ids`.
fn simulate_plan(
    spec: &Spec,
    model: &ModelCosts,
    layout: &Layout,
    stages: &StageFigures,
    lowered: &Lowered,
    device_ids: &[DeviceId],
) -> Result<Simulated, Vec<Diagnostic>> {
    let sim_cost = PlanCost::new(spec, model, layout, stages, lowered.summed_over.clone());
    if let Some(p) = &lowered.periodic {
        let steady = crate::periodic::steady_state(p, &lowered.members(), &sim_cost).map_err(|e| {
            vec![Diagnostic::error(
                "E0603",
                format!("internal compiler error: the verified plan failed in simulation: {e}"),
                spec.strategy.schedule.span,
                "while compiling this schedule",
            )]
        })?;
        let per_device = device_ids
            .iter()
            .map(|d| {
                let busy = steady.busy.get(d).copied().unwrap_or(0.0);
                let idle = if steady.step_time > 0.0 { (1.0 - busy / steady.step_time).max(0.0) } else { 0.0 };
                (*d, busy, if p.body.get(d).is_some_and(|s| !s.is_empty()) { idle } else { 1.0 })
            })
            .collect();
        // the two-step timeline's events name their instruction by segment and index
        let mut timeline = steady.two_steps;
        let codes: HashMap<DeviceId, Vec<usize>> = p
            .body
            .iter()
            .map(|(d, body)| {
                let pro = p.segments.prologue.get(d).map_or(0, Vec::len);
                let epi = p.segments.epilogue.get(d).map_or(0, Vec::len);
                use pipec_plan::plan::{instruction_code, Segment};
                let codes = (0..pro)
                    .map(|i| instruction_code(Segment::Prologue, i))
                    .chain((0..body.len()).map(|i| instruction_code(Segment::Body, i)))
                    .chain((0..epi).map(|i| instruction_code(Segment::Epilogue, i)))
                    .collect();
                (*d, codes)
            })
            .collect();
        for e in &mut timeline.events {
            if let Some(c) = codes.get(&e.device).and_then(|c| c.get(e.index)) {
                e.index = *c;
            }
        }
        return Ok(Simulated {
            timeline,
            step_time: steady.step_time,
            first_step: Some(steady.first_step_time),
            per_device,
            bubble: steady.bubble,
            collectives: steady.collectives,
        });
    }
    let timeline = simulate(&lowered.streams, &lowered.members(), &sim_cost).map_err(|stuck| {
        vec![Diagnostic::error(
            "E0603",
            format!("internal compiler error: the verified plan deadlocked in simulation: {}", stuck.reason),
            spec.strategy.schedule.span,
            "while compiling this schedule",
        )]
    })?;
    let (per_device, bubble) = utilisation(&timeline, device_ids);
    let collectives = crate::simulate::collective_times(&timeline);
    Ok(Simulated { step_time: timeline.step_time, first_step: None, timeline, per_device, bubble, collectives })
}

/// Memory: per-device breakdowns from the streams, E0601/W0602, and the bubble warning.
fn check_memory(
    spec: &Spec,
    model: &ModelCosts,
    placement: &Placement,
    stages: &StageFigures,
    lowered: &Lowered,
    bubble: f64,
    device_ids: &[DeviceId],
) -> (Vec<DevicePlan>, Vec<Diagnostic>) {
    let strategy = &spec.strategy;
    let tp = strategy.tp.max(1);
    let cluster = &model.cluster;
    let weight_cap = strategy.schedule.kind.weight_versions().cap();
    let empty = Vec::new();
    let counted = lowered.counted_streams();
    let devices: Vec<DevicePlan> = device_ids
        .iter()
        .map(|&id| {
            // tensor-parallel followers hold a shard the size of their group leader's
            let leader = DeviceId(id.0 - id.0 % tp as u32);
            let stream = counted.get(&leader).unwrap_or(&empty);
            DevicePlan {
                id,
                node: cluster.node_of(id),
                stages: placement.stages_of(leader).into_iter().map(|s| StageId(s as u32)).collect(),
                memory: device_memory(stream, &stages.bytes, &lowered.recompute, weight_cap, cluster.memory),
                peak_in_flight: crate::memory::peak_in_flight(stream),
            }
        })
        .collect();
    let mut diagnostics = Vec::new();
    memory_diagnostics(spec, &devices, &stages.bytes, &lowered.recompute, placement, &mut diagnostics);
    if bubble > 0.5 && strategy.schedule.kind.is_pipeline() {
        diagnostics.push(
            Diagnostic::warning(
                "W0605",
                format!("the predicted bubble is {:.0}% of device time", bubble * 100.0),
                strategy.schedule.span,
                "this schedule",
            )
            .with_help(format!(
                "more microbatches (now {}) or a schedule with smaller bubbles (interleaved, zb-h1) would use the devices better",
                strategy.microbatches
            )),
        );
    }
    (devices, diagnostics)
}

/// Assembly: everything above → `Plan`.
#[allow(clippy::too_many_arguments)]
fn assemble(
    spec: &Spec,
    options: &CompileOptions,
    model: &ModelCosts,
    layout: Layout,
    placement: &Placement,
    stages: &StageFigures,
    lowered: Lowered,
    simulated: &Simulated,
    devices: Vec<DevicePlan>,
) -> Plan {
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    let tp = strategy.tp.max(1);
    let counted = lowered.counted_streams().into_owned();
    let layers: Vec<LayerPlan> = model
        .graph
        .ops()
        .zip(&model.costs)
        .enumerate()
        .map(|(index, ((_, node), c))| LayerPlan {
            index,
            op: node.op.clone(),
            label: node.label.clone(),
            inputs: (node.inputs != [Source::before(index)]).then(|| node.inputs.clone()),
            tied: node.tied,
            input_shape: node.input_shape.clone(),
            output_shape: node.output_shape.clone(),
            parameters: c.parameters,
            parameter_bytes: c.parameter_bytes,
            forward_flops_per_sample: c.forward_flops_per_sample,
            backward_flops_per_sample: c.backward_flops_per_sample,
            forward_s: c.forward_s,
            backward_s: c.backward_s,
            activation_bytes_per_sample: c.activation_bytes_per_sample,
            output_bytes_per_sample: c.output_bytes_per_sample,
        })
        .collect();
    let stage_plans: Vec<StagePlan> = layout
        .ranges
        .iter()
        .enumerate()
        .map(|(s, r)| StagePlan {
            id: StageId(s as u32),
            layers: [r.start, r.end],
            replicas: placement.replicas[s].clone(),
            route: placement.route[s].clone(),
            group: lowered.group_of[s],
            parameters: stages.bytes[s].parameters,
            forward_s: stages.times[s].0,
            backward_s: stages.times[s].1,
            update_s: stages.update[s],
            recompute: layout.recompute[s],
            activation_bytes_per_microbatch: if layout.recompute[s] {
                stages.bytes[s].input_per_microbatch
            } else {
                stages.bytes[s].activations_per_microbatch
            },
            output_bytes_per_microbatch: stages.output_bytes[s],
            tensor_parallel: if tp > 1 {
                placement.replicas[s].iter().map(|l| (0..tp as u32).map(|t| DeviceId(l.0 + t)).collect()).collect()
            } else {
                Vec::new()
            },
        })
        .collect();
    let ties = lowered.ties;
    let groups: Vec<GroupPlan> = lowered
        .groups
        .into_iter()
        .map(|(id, (stage, devices))| GroupPlan { id, stage, devices, tie: ties.get(&id).copied() })
        .collect();
    let (step_time, bubble) = (simulated.step_time, simulated.bubble);
    let simulation = Simulation {
        step_time_s: step_time,
        first_step_time_s: simulated.first_step,
        bubble_fraction: bubble,
        throughput_samples_per_s: if step_time > 0.0 { spec.training.batch_size as f64 / step_time } else { 0.0 },
        devices: simulated
            .per_device
            .iter()
            .map(|(d, busy, b)| {
                let (in_flight, exposed) = simulated.collectives.get(d).copied().unwrap_or((0.0, 0.0));
                DeviceSimulation {
                    id: *d,
                    busy_s: *busy,
                    bubble_fraction: *b,
                    peak_memory_bytes: devices[d.0 as usize].memory.total,
                    collective_s: in_flight,
                    exposed_collective_s: exposed,
                }
            })
            .collect(),
    };
    let weight_versions = match kind.weight_versions() {
        WeightVersions::One => 1,
        WeightVersions::Two => 2,
        WeightVersions::Stashed => devices
            .iter()
            .filter_map(|d| counted.get(&d.id))
            .flat_map(|s| crate::memory::peak_weight_versions(s).into_values())
            .max()
            .map_or(1, |v| v as usize + 1),
    };
    Plan {
        version: PLAN_VERSION,
        name: spec.name.clone().unwrap_or_else(|| "pipec-job".into()),
        model: ModelPlan {
            input: spec.model.input.clone(),
            loss: spec.model.loss,
            token_vocab: spec.model.token_vocab(),
        },
        training: training_plan(spec, model.microbatch_size, options),
        schedule: ScheduleInfo {
            kind,
            virtual_stages: layout.virtual_stages,
            synchronous: kind.is_synchronous(strategy.schedule.sync),
            weight_versions,
            reduce: strategy.schedule.reduce,
            staleness: lowered.asp.then_some(strategy.schedule.staleness),
        },
        partition: layout.notation,
        stages: stage_plans,
        devices,
        groups,
        layers,
        streams: lowered.streams,
        flush_free: lowered.periodic.map(|p| p.segments),
        simulation,
    }
}

fn optimizer_bytes_per_parameter(opt: &Optimizer, precision: usize) -> f64 {
    let states = opt.state_per_parameter() as f64 * 4.0;
    let master = if precision < 4 { 4.0 } else { 0.0 };
    states + master
}

fn training_plan(spec: &Spec, microbatch_size: usize, options: &CompileOptions) -> TrainingPlan {
    let t = &spec.training;
    let resolve = |p: &str| -> String {
        let path = std::path::Path::new(p);
        match (&options.base_dir, path.is_absolute()) {
            (Some(base), false) => base.join(path).display().to_string(),
            _ => p.to_string(),
        }
    };
    TrainingPlan {
        batch_size: t.batch_size,
        microbatches: spec.strategy.microbatches,
        microbatch_size,
        steps: t.steps,
        optimizer: match t.optimizer {
            Optimizer::Sgd { lr, momentum, weight_decay } => OptimizerPlan::Sgd { lr, momentum, weight_decay },
            Optimizer::Adam { lr, beta1, beta2, eps, weight_decay } => {
                OptimizerPlan::Adam { lr, beta1, beta2, eps, weight_decay }
            }
        },
        precision: t.precision,
        seed: t.seed,
        data: match &t.data {
            Data::Synthetic { task, samples } => DataPlan::Synthetic { task: *task, samples: *samples },
            Data::Csv { path, .. } => DataPlan::Csv { path: resolve(path) },
            Data::Npy { path, labels, .. } => {
                DataPlan::Npy { path: resolve(path), labels: labels.as_deref().map(resolve) }
            }
            Data::Text { path, .. } => DataPlan::Text { path: resolve(path) },
            Data::Tokens { path, dtype, .. } => DataPlan::Tokens { path: resolve(path), dtype: *dtype },
        },
        checkpoint_every: t.checkpoint.as_ref().map(|c| c.every),
        checkpoint_dir: t.checkpoint.as_ref().map(|c| c.dir.clone()),
    }
}

/// Partitioning: `ModelCosts` → `Layout` (explicit ranges, `balanced`, or PipeDream's
/// `auto`, which may also choose the replication). Partitions are looked up in and added
/// to `memo` when given (the strategy search's candidates of one cost model share them).
fn partition_layers(spec: &Spec, model: &ModelCosts, memo: Option<&mut Partitions>) -> Result<Layout, Vec<Diagnostic>> {
    let (graph, costs, cluster, opt_bytes) =
        (&model.graph, &model.costs, &model.cluster, model.optimizer_bytes_per_parameter);
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    let v = strategy.schedule.virtual_stages.max(1);
    let times: Vec<f64> = costs.iter().map(|c| c.forward_s + c.backward_s).collect();
    let replicas = strategy.replicas.clone();
    let ranks = replicas.len();
    let chunks = kind.chunk_placement();
    let chunk_replicas: Vec<usize> = (0..ranks * v).map(|c| replicas[chunks.rank_of_chunk(c, ranks)]).collect();
    let fail = |msg: String| {
        vec![Diagnostic::error("E0403", msg, strategy.partition_span, "partition")
            .with_help("use fewer stages or a deeper model")]
    };
    let (replicas, virtual_stages, ranges) = match &strategy.partition {
        Partition::Explicit(ranges) => (replicas, v, ranges.clone()),
        Partition::Auto if !strategy.layout_fixed && v == 1 && kind.auto_replicates() => {
            let tp = strategy.tp.max(1);
            let machines = cluster.device_count() / tp;
            let mb = spec.training.batch_size / strategy.microbatches.max(1);
            // a tensor-parallel member holds 1/tp of each layer's weights, optimizer state
            // and activations, and reduces 1/tp of its gradient
            let tp = tp as f64;
            let parameter_bytes: Vec<f64> = costs.iter().map(|c| c.parameter_bytes as f64 / tp).collect();
            let cut_bytes: Vec<f64> =
                (1..=costs.len()).map(|j| (graph.cut_bytes_per_sample(j) * mb as u64) as f64).collect();
            let in_flight = strategy.microbatches.min(machines).max(1) as f64;
            // activations: every microbatch in flight keeps its own, or with recompute one
            // microbatch's (its backward) plus each in-flight microbatch's stage input, at
            // most the largest cut (reserved below)
            // (the planner's stages are not known yet: only `recompute: true` counts here)
            let recompute_all = strategy.recompute == Recompute::All;
            let kept = if recompute_all { 1.0 } else { in_flight };
            let memory: Vec<f64> = costs
                .iter()
                .map(|c| {
                    (c.parameter_bytes as f64 * 2.0 + c.parameters as f64 * opt_bytes) / tp
                        + c.activation_bytes_per_sample as f64 * mb as f64 / tp * kept
                })
                .collect();
            let inputs =
                if recompute_all { cut_bytes.iter().fold(0.0, |m: f64, c| m.max(*c)) * in_flight } else { 0.0 };
            let input = AutoInput {
                layer_times: &times,
                parameter_bytes: &parameter_bytes,
                cut_bytes: &cut_bytes,
                memory_bytes: &memory,
                machines,
                machines_per_node: cluster.devices_per_node / strategy.tp.max(1),
                memory_capacity: cluster.memory - crate::memory::workspace_reserve(cluster.memory) as f64 - inputs,
                sync: WeightSync::PerStep { microbatches: strategy.microbatches },
                intra: cluster.intra,
                inter: cluster.inter,
            };
            let solve = || partition::auto(&input).map(|p| (p.replicas, p.ranges));
            let plan = match memo {
                Some(memo) => memo.planned.entry(recompute_all).or_insert_with(solve).clone(),
                None => solve(),
            };
            let (replicas, ranges) = plan.ok_or_else(|| {
                vec![Diagnostic::error(
                    "E0601",
                    "no partition of the model fits in device memory on this cluster",
                    strategy.layout_span,
                    format!("{} per device", human_bytes(cluster.memory as u64)),
                )
                .with_help("use larger devices, more devices, `recompute: true`, or fewer microbatches")]
            })?;
            (replicas, 1, ranges)
        }
        Partition::Auto | Partition::Balanced => {
            let solve = || partition::balanced(&times, &chunk_replicas).map(|(ranges, _)| ranges);
            let ranges = match memo {
                Some(memo) => memo.balanced.entry(chunk_replicas.clone()).or_insert_with(solve).clone(),
                None => solve(),
            }
            .ok_or_else(|| fail(format!("{} stages for {} layers", chunk_replicas.len(), times.len())))?;
            (replicas, v, ranges)
        }
    };
    // the stages `recompute` names exist (the front end checked a layout it knew)
    if let Some(s) = strategy.recompute.beyond(ranges.len()) {
        return Err(vec![pipec_grammar::recompute_beyond(s, ranges.len(), strategy.span, strategy.layout_span)]);
    }
    Ok(Layout {
        notation: notation(&replicas),
        recompute: strategy.recompute.per_stage(ranges.len()),
        replicas,
        virtual_stages,
        ranges,
    })
}

/// The devices most over capacity, with how much over, and how many more there are: a
/// message stays one line on a 1,024-device plan.
fn worst_few(over: &[&DevicePlan]) -> String {
    const SHOWN: usize = 3;
    let named: Vec<String> = over
        .iter()
        .take(SHOWN)
        .map(|d| format!("{} by {}", d.id, human_bytes(d.memory.total - d.memory.capacity)))
        .collect();
    match over.len().saturating_sub(SHOWN) {
        0 => named.join(", "),
        rest => format!("{} and {rest} more", named.join(", ")),
    }
}

fn notation(replicas: &[usize]) -> String {
    replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("-")
}

/// The plan's backward time in forward times, rounded to whole slots (at least 1).
fn backward_slots(stage_fb: &[(f64, f64)]) -> usize {
    let (f, b) = stage_fb.iter().fold((0.0, 0.0), |(f, b), &(sf, sb)| (f + sf, b + sb));
    if f > 0.0 && b.is_finite() {
        ((b / f).round() as usize).clamp(1, 8)
    } else {
        1
    }
}

/// Assigns devices: pipeline rank r's replicas get consecutive devices (a tensor-parallel
/// group of `tp` devices each, led by its first), so replicas and TP groups stay inside a
/// node when they can.
///
/// Placement: `Layout` → `Placement`.
fn place(spec: &Spec, layout: &Layout, cluster: &ClusterGraph) -> Result<Placement, Vec<Diagnostic>> {
    let strategy = &spec.strategy;
    place_chunks(strategy.schedule.kind.chunk_placement(), layout, strategy.tp.max(1), strategy.microbatches, cluster)
        .map_err(|msg| vec![Diagnostic::error("E0405", msg, strategy.schedule.span, "this schedule")])
}

fn place_chunks(
    chunks: ChunkPlacement,
    layout: &Layout,
    tp: usize,
    microbatches: usize,
    cluster: &ClusterGraph,
) -> Result<Placement, String> {
    let ranks = layout.replicas.len();
    let rank_devices = rank_devices(&layout.replicas, tp);
    let base = layout.replicas.iter().sum::<usize>() * tp;
    if base > cluster.device_count() {
        return Err(format!("the layout needs {base} devices, the cluster has {}", cluster.device_count()));
    }
    let stages = layout.ranges.len();
    let mut replicas = Vec::with_capacity(stages);
    let mut route = Vec::with_capacity(stages);
    if chunks == ChunkPlacement::Bidirectional {
        // R = the stages' (equal) replication: R pipeline pairs, pair q made of the q-th
        // replica device of every rank. In pair q, stage s's down copy runs on rank s's
        // device and its up copy on rank D−1−s's. Microbatches come in units of R·D (the last
        // may be smaller), dealt round-robin to the pairs; of each pair's share of a unit,
        // the first half goes down and the second half up.
        let pairs = layout.replicas[0].max(1);
        if layout.replicas.iter().any(|&r| r != pairs) {
            return Err("Chimera needs every stage replicated equally".into());
        }
        let unit = pairs * ranks;
        let copy = |m: usize| -> u32 {
            let unit_start = m - m % unit;
            let unit_len = unit.min(microbatches - unit_start);
            let (o, q) = (m - unit_start, (m - unit_start) % pairs);
            let share = (unit_len - q).div_ceil(pairs);
            (2 * q + usize::from(o / pairs >= share / 2)) as u32
        };
        for s in 0..stages {
            replicas.push((0..pairs).flat_map(|q| [rank_devices[s][q], rank_devices[ranks - 1 - s][q]]).collect());
            route.push((0..microbatches).map(copy).collect());
        }
    } else {
        for c in 0..stages {
            let devs = rank_devices[chunks.rank_of_chunk(c, ranks)].clone();
            let n = devs.len() as u32;
            route.push((0..microbatches as u32).map(|m| m % n).collect());
            replicas.push(devs);
        }
    }
    Ok(Placement { replicas, route, devices: cluster.device_count(), microbatches })
}

/// The devices of each pipeline rank's replicas (the tensor-parallel leaders): consecutive,
/// `tp` apart, rank after rank.
fn rank_devices(replicas: &[usize], tp: usize) -> Vec<Vec<DeviceId>> {
    let mut base = 0usize;
    let mut out = Vec::with_capacity(replicas.len());
    for &r in replicas {
        out.push((0..r).map(|j| DeviceId((base + j * tp) as u32)).collect());
        base += r * tp;
    }
    out
}

/// One pipeline replica of a symmetric plan: replica 0 of every pipeline rank (its
/// tensor-parallel leader), running its share of the microbatches (renumbered), with the
/// plan's device ids. What it simulates is exactly what every replica and every
/// tensor-parallel member of the whole plan does when the plan is symmetric: every rank on
/// the same number `r` of replicas, the microbatches a multiple of `r` (each replica, or
/// each of Chimera's pipeline pairs, then gets the same pattern: Chimera's last, partial
/// unit too), tensor-parallel groups inside a node, and
/// between any two ranks the same link for every replica. The simulator's costs are the
/// same on every device and collectives are costed over the whole group (`summed_over`),
/// so each replica's timeline is replica 0's. Returns the view and how many devices of the
/// plan each of its devices stands for, or None for a plan that is not symmetric (or is
/// its own one replica).
fn one_replica(
    spec: &Spec,
    layout: &Layout,
    placement: &Placement,
    cluster: &ClusterGraph,
) -> Option<(Placement, usize)> {
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    let tp = strategy.tp.max(1);
    let r = *layout.replicas.first()?;
    let ranks = layout.replicas.len();
    let chunks = kind.chunk_placement();
    let symmetric = r > 0
        && layout.replicas.iter().all(|&x| x == r)
        && cluster.devices_per_node.is_multiple_of(tp)
        && placement.microbatches.is_multiple_of(r)
        && !(kind == ScheduleKind::DpOnly && strategy.schedule.sync == SyncMode::Asp);
    if !symmetric || r * tp == 1 {
        return None;
    }
    let rd = rank_devices(&layout.replicas, tp);
    for a in 0..ranks {
        for b in a + 1..ranks {
            let level = cluster.level(rd[a][0], rd[b][0]);
            if (1..r).any(|q| cluster.level(rd[a][q], rd[b][q]) != level) {
                return None;
            }
        }
    }
    let one = Layout {
        recompute: layout.recompute.clone(),
        replicas: vec![1; ranks],
        virtual_stages: layout.virtual_stages,
        ranges: layout.ranges.clone(),
        notation: String::new(),
    };
    let mut view = place_chunks(chunks, &one, tp, placement.microbatches / r, cluster).ok()?;
    // rank i's one device is i·tp there: replica 0 of rank i here
    for replicas in &mut view.replicas {
        for d in replicas.iter_mut() {
            *d = rd[d.0 as usize / tp][0];
        }
    }
    Some((view, r * tp))
}

/// What the strategy search needs of a candidate: the figures of its compiled plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Figures {
    /// The simulated step (a flush-free schedule's steady state).
    pub step_s: f64,
    /// Idle share of the cluster's device-time.
    pub bubble: f64,
    /// The tightest memory headroom over the devices (negative: it does not fit).
    pub headroom: f64,
    /// The longest exposed all-reduce per step on any device.
    pub exposed_all_reduce_s: f64,
    /// No device is over its memory.
    pub fits: bool,
    /// Per stage: the tightest memory headroom of the devices holding it (what the search
    /// recomputes when a plan does not fit).
    pub stage_headroom: Vec<f64>,
}

/// The figures `compile` would report for a checked spec, without the verifier and without
/// building the plan; for a symmetric plan from one pipeline replica (`one_replica`) —
/// exactly the whole plan's figures (tested against `compile`), at a fraction of the cost:
/// the GPT-3 search's candidates have up to 1,024 devices and 1,536 microbatches.
pub fn predict(spec: &Spec, options: &CompileOptions, memo: &mut Memo) -> Result<Figures, Vec<Diagnostic>> {
    let (model, layout) = memo.model_and_layout(spec, options)?;
    let model = &*model;
    let placement = place(spec, &layout, &model.cluster)?;
    check_ties(spec, &layout)?;
    let stages = stage_figures(spec, model, &layout);
    let (simulated_placement, stands_for) =
        one_replica(spec, &layout, &placement, &model.cluster).unwrap_or_else(|| (placement.clone(), 1));
    let mut lowered = lower_streams(spec, &layout, &simulated_placement, &placement.replicas, &stages, model.precision);
    let devices: Vec<DeviceId> = if stands_for == 1 {
        tensor_parallel_copies(&mut lowered, spec.strategy.tp.max(1));
        model.cluster.devices()
    } else {
        let mut d: Vec<DeviceId> = simulated_placement.replicas.iter().flatten().copied().collect();
        d.sort();
        d.dedup();
        d
    };
    let simulated = simulate_plan(spec, model, &layout, &stages, &lowered, &devices)?;
    let bubble = if lowered.periodic.is_some() || stands_for == 1 {
        // a steady state's bubble is over the devices that run, alike in every replica
        simulated.bubble
    } else {
        let busy: f64 = simulated.per_device.iter().map(|(_, b, _)| b).sum::<f64>() * stands_for as f64;
        let time = simulated.step_time * model.cluster.device_count() as f64;
        if time > 0.0 {
            1.0 - busy / time
        } else {
            0.0
        }
    };
    let (plans, diagnostics) = check_memory(spec, model, &simulated_placement, &stages, &lowered, bubble, &devices);
    let mut stage_headroom = vec![f64::INFINITY; layout.ranges.len()];
    for d in &plans {
        let Some(h) = d.memory.headroom() else { continue };
        for s in &d.stages {
            if let Some(x) = stage_headroom.get_mut(s.0 as usize) {
                *x = x.min(h);
            }
        }
    }
    Ok(Figures {
        stage_headroom,
        step_s: simulated.step_time,
        bubble,
        headroom: plans.iter().filter_map(|d| d.memory.headroom()).fold(f64::INFINITY, f64::min),
        exposed_all_reduce_s: simulated.collectives.values().map(|c| c.1).fold(0.0, f64::max),
        fits: !diagnostics.iter().any(Diagnostic::is_error),
    })
}

/// Megatron tensor parallelism: two all-reduces of the layer's output per transformer block
/// or pair of linears in forward, two in backward. Returns per stage the bytes each
/// microbatch moves in TP all-reduces (forward, backward).
fn tp_allreduce_bytes(graph: &Graph, ranges: &[Range<usize>], microbatch_size: usize, precision: usize) -> Vec<u64> {
    ranges
        .iter()
        .map(|r| {
            (r.start..r.end)
                .map(|i| {
                    let node = graph.node(graph.op_at(i));
                    let out = pipec_plan::model::elements(&node.output_shape)
                        .unwrap_or(u64::MAX)
                        .saturating_mul((precision * microbatch_size) as u64);
                    match node.op {
                        pipec_plan::model::Op::TransformerBlock { .. } => out.saturating_mul(2),
                        pipec_plan::model::Op::Linear { .. } => out / 2,
                        _ => 0,
                    }
                })
                .sum()
        })
        .collect()
}

/// The simulator's cost model for a plan.
struct PlanCost<'a> {
    stage_fb: &'a [(f64, f64)],
    stage_update: &'a [f64],
    cluster: &'a ClusterGraph,
    reduce: ReduceMode,
    tp: usize,
    tp_bytes: Vec<u64>,
    /// `Lowered::summed_over`.
    summed_over: HashMap<GroupId, Vec<DeviceId>>,
}

impl<'a> PlanCost<'a> {
    /// The costs of a plan's instructions: its stages' times, the cluster's links, the
    /// reduction and the tensor-parallel all-reduces inside every pass.
    fn new(
        spec: &Spec,
        model: &'a ModelCosts,
        layout: &Layout,
        stages: &'a StageFigures,
        summed_over: HashMap<GroupId, Vec<DeviceId>>,
    ) -> Self {
        PlanCost {
            stage_fb: &stages.times,
            stage_update: &stages.update,
            cluster: &model.cluster,
            reduce: spec.strategy.schedule.reduce,
            tp: spec.strategy.tp.max(1),
            tp_bytes: tp_allreduce_bytes(&model.graph, &layout.ranges, model.microbatch_size, model.precision),
            summed_over,
        }
    }

    /// An all-reduce of `bytes` over `members`: a ring (or a parameter server) on the
    /// slowest link among them.
    fn reduce_time(&self, members: &[DeviceId], bytes: u64) -> f64 {
        let link = self.cluster.link(self.cluster.group_level(members)).unwrap_or(self.cluster.intra);
        match self.reduce {
            ReduceMode::Ring => ring_allreduce_time(link, members.len(), bytes),
            ReduceMode::ParameterServer => parameter_server_time(link, members.len(), bytes),
        }
    }
}

impl CostModel for PlanCost<'_> {
    fn compute(&self, _device: DeviceId, instr: &Instr) -> f64 {
        let s = instr.stage().0 as usize;
        let (f, b) = self.stage_fb.get(s).copied().unwrap_or((0.0, 0.0));
        let tp_comm =
            if self.tp > 1 { ring_allreduce_time(self.cluster.intra, self.tp, self.tp_bytes[s]) } else { 0.0 };
        match instr.phase() {
            Phase::Forward | Phase::Recompute => f + tp_comm,
            Phase::Backward => b + tp_comm,
            // the input gradient and the weight gradient each cost about one forward
            Phase::BackwardInput => b / 2.0 + tp_comm,
            Phase::BackwardWeight => b / 2.0,
            Phase::Optimizer => self.stage_update.get(s).copied().unwrap_or(0.0),
            _ => 0.0,
        }
    }
    fn transfer(&self, from: DeviceId, to: DeviceId, bytes: u64) -> f64 {
        self.cluster.p2p_time(from, to, bytes / self.tp as u64)
    }
    fn all_reduce(&self, group: GroupId, members: &[DeviceId], bytes: u64) -> f64 {
        self.reduce_time(self.summed_over.get(&group).map_or(members, Vec::as_slice), bytes)
    }
}

fn memory_diagnostics(
    spec: &Spec,
    devices: &[DevicePlan],
    stage_bytes: &[StageBytes],
    recompute: &[bool],
    placement: &Placement,
    out: &mut Vec<Diagnostic>,
) {
    let strategy = &spec.strategy;
    let worst = devices.iter().max_by(|a, b| {
        (a.memory.total as f64 / a.memory.capacity.max(1) as f64)
            .total_cmp(&(b.memory.total as f64 / b.memory.capacity.max(1) as f64))
    });
    let Some(worst) = worst else { return };
    let m = &worst.memory;
    let share = m.total as f64 / m.capacity.max(1) as f64;
    let breakdown = format!(
        "weights {} + gradients {} + optimizer {} + activations {} + buffers {} + workspace {} = {}",
        human_bytes(m.weights),
        human_bytes(m.gradients),
        human_bytes(m.optimizer),
        human_bytes(m.activations),
        human_bytes(m.buffers),
        human_bytes(m.workspace),
        human_bytes(m.total)
    );
    // the devices over capacity, the most over first
    let mut over: Vec<&DevicePlan> = devices.iter().filter(|d| d.memory.total > d.memory.capacity).collect();
    over.sort_by_key(|d| (std::cmp::Reverse(d.memory.total - d.memory.capacity), d.id));
    if !over.is_empty() {
        // What would fit: recompute keeps only stage inputs; 1F1B bounds in-flight
        // microbatches; a larger device by the missing amount.
        let mut ideas = Vec::new();
        if worst.stages.iter().any(|s| !recompute.get(s.0 as usize).copied().unwrap_or(false)) {
            let held_acts: u64 = m.activations;
            let saved: u64 = worst
                .stages
                .iter()
                .map(|s| {
                    stage_bytes[s.0 as usize].input_per_microbatch
                        * u64::from(worst.peak_in_flight.get(s).copied().unwrap_or(1))
                })
                .sum::<u64>()
                + worst.stages.iter().map(|s| stage_bytes[s.0 as usize].activations_per_microbatch).max().unwrap_or(0);
            let with = m.total - held_acts + saved;
            ideas.push(format!("`recompute: true` ({} on {})", human_bytes(with), worst.id));
        }
        if strategy.schedule.kind == ScheduleKind::Gpipe {
            ideas.push(
                "`schedule: 1f1b` (keeps at most one microbatch per later stage in flight instead of all)".to_string(),
            );
        }
        let per_stage_weights: u64 = worst.stages.iter().map(|s| stage_bytes[s.0 as usize].weights).sum();
        if per_stage_weights > 0 && placement.stages() < spec.model.layers.len() {
            ideas.push(format!("more pipeline stages (now {}), so each device holds fewer layers", placement.stages()));
        }
        ideas.push(format!("a device with at least {}", human_bytes(m.total)));
        out.push(
            Diagnostic::error(
                "E0601",
                format!(
                    "device {} needs {} but has {} ({} device(s) over capacity: {})",
                    worst.id,
                    human_bytes(m.total),
                    human_bytes(m.capacity),
                    over.len(),
                    worst_few(&over)
                ),
                strategy.layout_span,
                format!(
                    "device {} holds {}",
                    worst.id,
                    worst.stages.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
                ),
            )
            .with_label(spec.cluster.memory_span, format!("{} per device", human_bytes(m.capacity)))
            .with_help(format!("{breakdown}. What would fit: {}", ideas.join("; "))),
        );
    } else if share > 0.9 {
        out.push(
            Diagnostic::warning(
                "W0602",
                format!("device {} uses {:.0}% of its memory", worst.id, share * 100.0),
                strategy.layout_span,
                format!("{} of {}", human_bytes(m.total), human_bytes(m.capacity)),
            )
            .with_label(spec.cluster.memory_span, "device memory")
            .with_help(breakdown),
        );
    }
}

/// Per-device summary for the command line: (device, stages, replicas of its first stage).
pub fn device_rows(plan: &Plan) -> Vec<(DeviceId, Vec<StageId>, usize)> {
    plan.devices
        .iter()
        .map(|d| {
            (
                d.id,
                d.stages.clone(),
                d.stages.first().and_then(|s| plan.stage(*s)).map(|s| s.replicas.len()).unwrap_or(0),
            )
        })
        .collect()
}
