//! What a strategy costs at least, without lowering, verifying or simulating it: the bounds
//! the strategy search prunes with (`search`), and the work its candidates share (`Memo`).

use std::collections::HashMap;

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::{Recompute, Spec};
use pipec_plan::vocab::ScheduleKind;
use pipec_plan::{DeviceId, Instr, StageId};

use crate::cluster::ClusterGraph;
use crate::figures::stage_figures;
use crate::model::{cost_model, ModelCosts};
use crate::options::CompileOptions;
use crate::partition::{partition_layers, Layout, Partitions};
use crate::place::place;
use crate::plan_cost::PlanCost;
use crate::schedule::Placement;
use crate::simulate::CostModel;
use crate::streams::sends_gradients_first;

/// What a strategy costs at least, found without lowering, verifying or simulating it:
/// the bound the strategy search prunes with (`search`).
#[derive(Debug, Clone, PartialEq)]
pub struct Bound {
    /// No simulation of the strategy predicts a shorter step (a flush-free schedule's
    /// steady state included).
    pub step_s: f64,
    /// Whether the weights, gradients and optimizer state with one microbatch's activations
    /// of one stage, the buffers and the workspace reserve — the least any schedule keeps —
    /// overflow some device: then no plan of the strategy fits.
    pub overflows: bool,
    /// Whether what a device keeps beside its model state (one microbatch's activations,
    /// the buffers, the reserve) overflows it alone: then no ZeRO level fits either.
    pub overflows_any_sharding: bool,
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
    let placed = memo.placed(spec, &layout, &model.cluster)?;
    let stages = stage_figures(spec, model, &layout);
    let cost = PlanCost::new(spec, model, &stages, HashMap::new());
    let kind = spec.strategy.schedule.kind;
    let split = kind.splits_backward();
    // a later stage sends its gradient after its input-gradient pass
    let early_send = sends_gradients_first(spec, layout.replicas.len());
    let split_at = |s: usize| split || (early_send && s > 0);
    let mb = pipec_plan::MicrobatchId(0);
    let of = |ins: Instr| cost.compute(DeviceId(0), &ins);
    let n_stages = placed.replicas.len();
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
            let Some(&(a, b)) = placed.pairs.get(s) else { return 0.0 };
            cost.transfer(a, b, stages.output_bytes[s]).min(cost.transfer(b, a, stages.output_bytes[s]))
        })
        .map(|t| if t.is_finite() { t } else { 0.0 })
        .collect();
    let forward_hop: Vec<f64> = forward.iter().zip(&hop).map(|(f, h)| f + h).collect();
    let backward_hop: Vec<f64> = upstream_backward.iter().zip(&hop).map(|(b, h)| b + h).collect();
    // what a replicated stage's gradient reduction leaves after its last backward at
    // least: a reduce-scatter, whatever the ZeRO level (the all-reduce of stage 0 is one
    // and an all-gather; the gradient shards of stages 1 to 3 are one), so that the bound of
    // a sharded strategy is never below its unsharded one's and the search may derive the
    // sharded ones from it
    let all_reduce: Vec<Option<f64>> = (0..n_stages)
        .map(|s| {
            let members = &placed.replicas[s];
            (members.len() > 1).then(|| {
                let bytes = stages.bytes[s].whole.gradients;
                let kind = pipec_plan::CollectiveKind::ReduceScatter;
                let scatter = model.cluster.shaped_collective_time(kind, placed.shapes[s], bytes);
                scatter.min(cost.reduce_time(members, bytes))
            })
        })
        .collect();
    let flush = !(matches!(kind, ScheduleKind::PipeDream | ScheduleKind::TwoBw)
        && !spec.strategy.schedule.vertical_sync
        && spec.strategy.tp.max(1) == 1);
    let capacity = model.cluster.memory;
    let reserve = crate::memory::workspace_reserve(capacity) as f64;
    let mut step_s: f64 = 0.0;
    let mut overflows = false;
    let mut overflows_any_sharding = false;
    for stage_counts in &placed.holds {
        if stage_counts.is_empty() {
            continue;
        }
        let held: Vec<usize> = stage_counts.iter().map(|&(s, _)| s).collect();
        let mut load = 0.0;
        let mut state = 0.0;
        // the least the memory pass can find on the device beside its model state (the same
        // terms as `memory::device_memory`): one microbatch of one held stage kept for its
        // backward (every forward adds that much before anything is freed), the largest
        // recompute unit, the buffers
        let (mut one_microbatch, mut recompute_unit, mut buffers) = (0.0_f64, 0.0_f64, 0.0_f64);
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
            state += (b.weights + b.gradients + b.optimizer) as f64;
            let kept = if layout.recompute[s] { b.checkpoint_per_microbatch } else { b.activations_per_microbatch };
            one_microbatch = one_microbatch.max(kept as f64);
            if layout.recompute[s] {
                recompute_unit = recompute_unit.max(b.recompute_unit_peak as f64);
            }
            buffers = buffers.max(b.largest_message.saturating_mul(4).saturating_add(b.gathered_weights) as f64);
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
        let beside_state = one_microbatch + recompute_unit + buffers + reserve;
        overflows |= state + beside_state > capacity;
        overflows_any_sharding |= beside_state > capacity;
    }
    Ok(Bound { step_s, overflows, overflows_any_sharding, replicas: layout.replicas })
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

/// Work the candidates of one spec's strategy search share: the model's costs per
/// (tensor-parallel degree, microbatch size) — all a candidate's strategy changes in them —
/// and the balanced partitions of each; the placements (with what the bound reads of them)
/// per chunk placement, layout, degree and microbatch count. Only for specs that differ in
/// their strategy.
#[derive(Default)]
pub struct Memo {
    pub(crate) models: HashMap<(usize, usize), (std::rc::Rc<ModelCosts>, Partitions)>,
    placements: HashMap<PlaceKey, std::rc::Rc<Placed>>,
}

/// What a placement depends on: the schedule's chunk placement, the replicas per chunk,
/// the chunks, the tensor-parallel degree and the microbatches.
type PlaceKey = (pipec_plan::schedule::ChunkPlacement, Vec<usize>, usize, usize, usize);

/// What the bound reads of a placement, computed once per [`PlaceKey`] (not its routes,
/// which a large search's placements would fill memory with).
pub(crate) struct Placed {
    /// Per stage, the devices holding a replica.
    replicas: Vec<Vec<DeviceId>>,
    /// Per device, the stages it holds (ascending) and its microbatches of each.
    holds: Vec<Vec<(usize, usize)>>,
    /// Per stage boundary, the pair of devices on the fastest link between the two stages'
    /// replicas.
    pairs: Vec<(DeviceId, DeviceId)>,
    /// Per stage, its replica group's shape on the cluster.
    shapes: Vec<crate::cluster::GroupShape>,
}

impl Placed {
    fn new(placement: Placement, cluster: &ClusterGraph) -> Self {
        // one pass over the routes, not one per device
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
        let pairs = placement.replicas.windows(2).map(|w| closest_pair(cluster, &w[0], &w[1])).collect();
        let shapes = placement.replicas.iter().map(|r| cluster.group_shape(r)).collect();
        Placed { replicas: placement.replicas, holds, pairs, shapes }
    }
}

impl Memo {
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
        let placed = std::rc::Rc::new(Placed::new(place(spec, layout, cluster)?, cluster));
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

    /// A candidate's cost model (computed once per tensor-parallel degree and microbatch
    /// size) and its partitions.
    pub(crate) fn entry(
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
