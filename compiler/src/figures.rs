//! Per-stage figures: compute times, messages and bytes held: `Layout` → `StageFigures`.

use pipec_grammar::spec::Spec;
use pipec_plan::model::{Op, Source};
use pipec_plan::plan::GradientBucket;
use pipec_plan::CollectiveKind;

use crate::activations::{recompute_seconds, Policy};
use crate::cluster::ring_time;
use crate::memory::{ModelState, StageBytes};
use crate::model::ModelCosts;
use crate::partition::{chunk_replicas, Layout};

/// Per-stage figures: compute times, messages, bytes held.
pub(crate) struct StageFigures {
    /// (forward, backward) seconds per microbatch of the stage's kernels on one rank
    /// (selective recompute's attention cores in the backward).
    pub(crate) times: Vec<(f64, f64)>,
    /// (forward, backward) seconds per microbatch of the tensor-parallel collectives the
    /// stage's passes wait for (0 without tensor parallelism), ZeRO-3's gathers included.
    pub(crate) tp_times: Vec<(f64, f64)>,
    /// Seconds per microbatch a recompute of the stage waits for the same: its
    /// tensor-parallel collectives, and no ZeRO-3 gather where the engine's backward gathers
    /// for it (`zero3_gather_waits`).
    pub(crate) recompute_tp: Vec<f64>,
    /// Per stage, the seconds of its forward a backward runs again (recompute inside the
    /// blocks; part of `times`' backward), in a split backward's input half.
    pub(crate) rerun: Vec<f64>,
    /// Per stage, the seconds of its backward that are weight gradients
    /// (`LayerCost::backward_weights_s`): a split backward's weight pass; its input pass
    /// runs the rest of `times`' backward.
    pub(crate) weight_grads: Vec<f64>,
    /// (forward, backward) seconds per microbatch of the expert-parallel all-to-alls the
    /// stage's passes wait for (0 without expert parallelism).
    pub(crate) ep_times: Vec<(f64, f64)>,
    /// (forward, backward) seconds per microbatch of the context-parallel exchanges of keys
    /// and values the stage's passes wait for (0 without context parallelism).
    pub(crate) cp_times: Vec<(f64, f64)>,
    /// Bytes of the stage's routed experts' gradients one rank holds: summed over the
    /// replicas holding the same experts (`ep` apart), the rest over all of them.
    pub(crate) expert_gradients: Vec<u64>,
    /// Per stage, its expert-parallel degree: the strategy's `ep` for a stage with expert
    /// blocks, 1 for the others.
    pub(crate) expert_parallel: Vec<usize>,
    /// Per stage, its mixture-of-experts layers and the bytes per member of each
    /// all-to-all its passes post at them (`Instr::all_to_alls_of`); empty on a stage that
    /// is not expert-parallel.
    pub(crate) all_to_alls: Vec<Vec<pipec_plan::ExpertExchange>>,
    /// Seconds of one optimizer update of the stage's parameters (on one tensor-parallel rank).
    pub(crate) update: Vec<f64>,
    /// Output bytes per microbatch (what goes to the next stage).
    pub(crate) output_bytes: Vec<u64>,
    pub(crate) bytes: Vec<StageBytes>,
    /// Per stage, the buckets its gradient reduction runs in (empty where the stage
    /// reduces in one collective): [`gradient_buckets`].
    pub(crate) buckets: Vec<Vec<GradientBucket>>,
    /// Per stage, the seconds of one ZeRO-3 gather of the weights pipec's executor gathers
    /// whole with the stage, where the plan declares it (`pipec_plan::in_pass::stage_gathers`;
    /// the simulator prices each, `PlanCost::with_stage_gathers`): every weight of a stage
    /// with tensor or expert parallelism, else those its products do not gather themselves.
    /// 0 without ZeRO-3 and for the other engines, whose gathers are priced layer by layer.
    pub(crate) stage_gathers: Vec<f64>,
    /// Per stage, on pipec's executor, the seconds of its sum over the tensor-parallel
    /// group of the gradients that are partial on each rank (`pipec_plan::in_pass::
    /// tp_partial_values`: one all-reduce of their fp32 values, as the executor sums them);
    /// empty for the other engines and without tensor parallelism. The simulator prices it
    /// where the plan declares it (`PlanCost::with_update_sums`).
    pub(crate) update_sums: Vec<Vec<f64>>,
    /// On pipec's executor with tensor parallelism, the seconds of the sum of a stage's
    /// squared gradient norm over its group (one fp32 value; 0 otherwise).
    pub(crate) norm_sum: f64,
    /// Per stage, on pipec's executor with expert parallelism, each mixture's layer and the
    /// seconds of the exchange of its per-expert row counts before a dispatch (counted in
    /// `ep_times`' forward; the simulator prices each at the dispatch the plan lists).
    pub(crate) ep_counts: Vec<ByLayer>,
    /// Per stage, each layer that posts expert-parallel all-to-alls, first to last: its
    /// [`MoeParts`] (what Megatron-LM's combined 1F1B overlaps the exchanges with).
    pub(crate) moe_parts: Vec<Vec<MoeParts>>,
}

/// A mixture-of-experts layer's computation per microbatch on one rank, split as
/// Megatron-LM's combined 1F1B schedules it (megatron/core/models/common/
/// model_chunk_schedule_plan.py, `TransformerLayerSchedulePlan.run`): before the dispatch
/// (the attention, the norms, the router) and the MLP (the routed and shared experts and
/// their activation), in the forward and in the backward (with what recompute runs again).
/// The backward's split is the forward's, scaled: the layer's backward costs the same
/// multiple of its forward in each part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct MoeParts {
    pub(crate) attention: [f64; 2],
    pub(crate) mlp: [f64; 2],
}

/// Each stage's [`MoeParts`], layer by layer.
fn moe_parts(model: &ModelCosts, layout: &Layout, backward: impl Fn(usize) -> f64) -> Vec<Vec<MoeParts>> {
    use crate::block_cost::Part;
    layout
        .ranges
        .iter()
        .map(|r| {
            r.clone()
                .filter(|&i| !model.costs[i].ep_forward.is_empty())
                .map(|i| {
                    let c = &model.costs[i];
                    let parts = &c.forward_parts;
                    let mlp = parts[Part::Experts as usize]
                        + parts[Part::ExpertsActivation as usize]
                        + parts[Part::Shared as usize];
                    let mlp = mlp.min(c.forward_s);
                    let back = backward(i);
                    let share = if c.forward_s > 0.0 { mlp / c.forward_s } else { 0.0 };
                    MoeParts { attention: [c.forward_s - mlp, back * (1.0 - share)], mlp: [mlp, back * share] }
                })
                .collect()
        })
        .collect()
}

impl StageFigures {
    /// Per stage, the share of its gradient bytes (and, parameter for parameter, of every
    /// other per-parameter state) that is routed experts (0 without expert parallelism).
    pub(crate) fn expert_share(&self) -> Vec<f64> {
        self.expert_gradients
            .iter()
            .zip(&self.bytes)
            .map(|(&e, b)| if b.whole.gradients > 0 { e as f64 / b.whole.gradients as f64 } else { 0.0 })
            .collect()
    }

    /// Per stage, the gradient buckets the plan declares for pipec's executor to run:
    /// `buckets` under pipec (the spec's `bucket`), none under another `engine`, whose own
    /// buckets price the plan only.
    pub(crate) fn declared_buckets(&self, engine: pipec_plan::vocab::Engine) -> Vec<Vec<GradientBucket>> {
        if engine == pipec_plan::vocab::Engine::Pipec {
            self.buckets.clone()
        } else {
            vec![Vec::new(); self.buckets.len()]
        }
    }
}

/// The buckets a replicated stage's gradient reduction runs in: the layers from the stage's
/// end down, a bucket closed once it holds its size in bytes, a last one with the rest
/// (merged into the one before when it has no gradients); each ready when the backward has
/// passed its first layer (the layers' backward times, `backward`, from the end). Only
/// where every stage is updated once per step and the reduction is overlapped, and only
/// when there are two buckets or more. The size:
/// - under pipec's executor, the spec's `bucket` (PyTorch DDP's), where the executor runs
///   them: no tensor or expert parallelism; a stage that runs whole backwards a chain of
///   layers; under ZeRO, whose buckets are reduce-scattered into the gradient shard, no
///   stage holding both ends of a weight tie, whose two gradients are summed before any is
///   scattered. These are the plan's (`StageFigures::declared_buckets`).
/// - under another engine, the engine's own
///   ([`pipec_plan::engine::performance::gradient_buckets`]: FSDP's per layer, DDP's by
///   size, a written `bucket` for the size), which price the plan only.
fn gradient_buckets(
    spec: &Spec,
    model: &ModelCosts,
    layout: &Layout,
    replicas: &[u64],
    backward: impl Fn(usize) -> f64,
) -> Vec<Vec<GradientBucket>> {
    use pipec_plan::engine::performance::GradientBuckets;
    let st = &spec.strategy;
    let kind = st.schedule.kind;
    let engine = spec.engine.target.name;
    if !st.overlap || !kind.updates_per_step() || !kind.is_synchronous(st.schedule.sync) {
        return vec![Vec::new(); layout.ranges.len()];
    }
    let (costs, graph) = (&model.costs, &model.graph);
    let grad_bytes = model.grad_bytes as u64;
    layout
        .ranges
        .iter()
        .zip(replicas)
        .enumerate()
        .map(|(s, (r, &d))| {
            if d < 2 {
                return Vec::new();
            }
            let cap = if engine == pipec_plan::vocab::Engine::Pipec {
                // with `overlap` every later stage sends its input gradient before its
                // weight-gradient pass (`streams::sends_gradients_first`), which the executor
                // runs bucket by bucket; the first stage runs whole backwards (unless the
                // schedule splits them), which it cuts into segments: a chain of layers only
                let whole = s == 0 && !kind.splits_backward();
                let chain = r.clone().all(|i| graph.node(graph.op_at(i)).inputs == [Source::before(i)]);
                let tied_within = st.sharding != pipec_plan::vocab::Sharding::None
                    && spec.model.layers[r.clone()].iter().any(|l| l.tied.is_some_and(|a| r.contains(&a)));
                // the executor runs buckets without tensor or expert parallelism
                let runs = st.tp.max(1) == 1 && (chain || !whole) && !holds_experts(model, r) && !tied_within;
                match st.bucket {
                    Some(cap) if runs => cap,
                    _ => return Vec::new(),
                }
            } else {
                match pipec_plan::engine::performance::gradient_buckets(engine, st.sharding.level(), grad_bytes) {
                    GradientBuckets::Whole => return Vec::new(),
                    // each layer with weights closes its own
                    GradientBuckets::Layers => 1,
                    GradientBuckets::Bytes(b) => st.bucket.unwrap_or(b),
                }
            };
            let total_time: f64 = r.clone().map(&backward).sum();
            let mut out: Vec<GradientBucket> = Vec::new();
            let (mut end, mut bytes, mut done) = (r.end, 0u64, 0.0);
            for i in r.clone().rev() {
                let c = &costs[i];
                bytes = bytes.saturating_add(c.shard_parameters.saturating_mul(grad_bytes));
                done += backward(i);
                if bytes >= cap && i > r.start {
                    let ready = if total_time > 0.0 { (done / total_time).clamp(f64::MIN_POSITIVE, 1.0) } else { 1.0 };
                    out.push(GradientBucket { layers: [i, end], bytes, ready });
                    (end, bytes) = (i, 0);
                }
            }
            match out.last_mut() {
                // nothing left but layers without weights: the bucket before takes them,
                // and is ready with the whole pass
                Some(last) if bytes == 0 => {
                    last.layers[0] = r.start;
                    last.ready = 1.0;
                }
                _ => out.push(GradientBucket { layers: [r.start, end], bytes, ready: 1.0 }),
            }
            if out.len() < 2 {
                return Vec::new();
            }
            out
        })
        .collect()
}

/// Stage figures: `Layout` → `StageFigures`.
pub(crate) fn stage_figures(spec: &Spec, model: &ModelCosts, layout: &Layout) -> StageFigures {
    let (costs, graph, mb) = (&model.costs, &model.graph, model.microbatch_size as u64);
    // what each layer keeps under the strategy's recompute inside the blocks, and what its
    // backward runs again
    let policies: Vec<Policy> = layout.ranges.iter().flat_map(|r| block_policies(spec, graph, r.clone())).collect();
    // what each layer's backward runs again of its forward, and the backward with it
    let again: Vec<f64> = policies
        .iter()
        .zip(costs)
        .map(|(p, c)| recompute_seconds(p, c.forward_s, &c.forward_parts, &c.forward_products))
        .collect();
    let backward: Vec<f64> = costs.iter().zip(&again).map(|(c, a)| c.backward_s + a).collect();
    let rerun: Vec<f64> = layout.ranges.iter().map(|r| again[r.clone()].iter().sum()).collect();
    let weight_grads: Vec<f64> =
        layout.ranges.iter().map(|r| costs[r.clone()].iter().map(|c| c.backward_weights_s).sum()).collect();
    let times: Vec<(f64, f64)> = layout
        .ranges
        .iter()
        .map(|r| (costs[r.clone()].iter().map(|c| c.forward_s).sum::<f64>(), backward[r.clone()].iter().sum()))
        .collect();
    let (tp_link, tp_times) = tp_figures(spec, model, layout, &policies);
    // each layer's backward's exchanges again: its attention's, its mixture of experts'
    let exchanged: Vec<[bool; 2]> = policies.iter().map(exchanges_again).collect();
    let (ep_times, cp_times, ranks) = group_exchange_times(spec, model, layout, &exchanged);
    let (update_sums, norm_sum, ep_counts) = pipec_in_line(spec, model, layout, (tp_link, &ranks));
    // the routing counts exchanged before each dispatch, a backward's dispatches again too
    let again = |l: &u32| exchanged.get(*l as usize).is_some_and(|e| e[1]);
    let ep_times: Vec<(f64, f64)> = ep_times
        .iter()
        .zip(&ep_counts)
        .map(|(&(f, b), counts)| {
            let rerun: f64 = counts.iter().filter(|(l, _)| again(l)).map(|(_, t)| t).sum();
            (f + counts.iter().map(|(_, t)| t).sum::<f64>(), b + rerun)
        })
        .collect();
    let (expert_parallel, all_to_alls, expert_gradients) = expert_figures(spec, model, layout, &exchanged);
    // ZeRO: each replica of a stage keeps (and updates) its 1/d share of what is sharded
    let stage_replicas: Vec<u64> = chunk_replicas(&layout.replicas, spec.strategy.schedule.kind, layout.ranges.len())
        .into_iter()
        .map(|d| d.max(1) as u64)
        .collect();
    let sharding = spec.strategy.sharding;
    let shard_optimizer = sharding.shards().0;
    let update = layout
        .ranges
        .iter()
        .zip(&stage_replicas)
        .map(|(r, &d)| {
            costs[r.clone()].iter().map(|c| c.update_s).sum::<f64>() / if shard_optimizer { d as f64 } else { 1.0 }
        })
        .collect();
    let (gather_waits, stage_gathers) =
        zero3_gather_waits(spec, model, layout, (&stage_replicas, &expert_parallel), &times);
    let recompute_tp: Vec<f64> = tp_times.iter().zip(&gather_waits).map(|(&(f, _), &(_, _, gr))| f + gr).collect();
    let tp_times: Vec<(f64, f64)> =
        tp_times.iter().zip(&gather_waits).map(|(&(f, b), &(gf, gb, _))| (f + gf, b + gb)).collect();
    // byte counts saturate: a spec past pipec's limits is refused by the front end, and a
    // figure that saturates reads as "does not fit" rather than wrapping to a small one
    // (a context-parallel member's tensors hold its 1/cp of every sample's positions)
    let cut_bytes = |j: usize| graph.cut_bytes_per_sample(j) / spec.strategy.cp.max(1) as u64;
    let output_bytes: Vec<u64> = layout.ranges.iter().map(|r| cut_bytes(r.end).saturating_mul(mb)).collect();
    let mut bytes: Vec<StageBytes> = layout
        .ranges
        .iter()
        .zip(&output_bytes)
        .zip(&stage_replicas)
        .map(|((r, &output), &d)| stage_bytes(spec, model, r.clone(), &policies, (output, d)))
        .collect();
    let buckets = gradient_buckets(spec, model, layout, &stage_replicas, |i| backward[i]);
    // ZeRO-2 keeps only the shard of the summed gradient, but each reduce-scatter takes the
    // whole gradient of what it carries: the stage's largest gradient bucket where it has
    // some (otherwise `Units`' default bucket)
    if sharding.level() == 2 {
        for (b, stage_buckets) in bytes.iter_mut().zip(&buckets) {
            if let Some(largest) = stage_buckets.iter().map(|x| x.bytes).max().filter(|_| b.replicas > 1) {
                b.scattered_gradients = largest;
            }
        }
    }
    StageFigures {
        moe_parts: moe_parts(model, layout, |i| backward[i]),
        times,
        tp_times,
        recompute_tp,
        rerun,
        weight_grads,
        ep_times,
        cp_times,
        expert_gradients,
        expert_parallel,
        all_to_alls,
        update,
        output_bytes,
        bytes,
        buckets,
        stage_gathers,
        update_sums,
        norm_sum,
        ep_counts,
    }
}

/// Per stage, expert parallelism's and context parallelism's (forward, backward) seconds, and
/// every replica's devices where there are such groups.
type GroupTimes = (Vec<(f64, f64)>, Vec<(f64, f64)>, Vec<Vec<pipec_plan::DeviceId>>);

/// Per stage, the seconds a forward and a backward wait for the collectives inside them over
/// `size` consecutive replicas of its pipeline rank (consecutive tensor-parallel groups, so
/// inside a node when they fit): expert parallelism's all-to-alls and context parallelism's
/// key/value exchanges (again in the backward of a layer that runs its forward's again,
/// `exchanged`: `exchanges_again` of each layer).
fn group_exchange_times(spec: &Spec, model: &ModelCosts, layout: &Layout, exchanged: &[[bool; 2]]) -> GroupTimes {
    let costs = &model.costs;
    let tp = spec.strategy.tp.max(1);
    let ep = spec.strategy.ep_replicas();
    let cp = spec.strategy.cp.max(1);
    let chunks = spec.strategy.schedule.kind.chunk_placement();
    // (the devices of every replica only where there are groups to price)
    let ranks = if ep > 1 || cp > 1 { crate::place::rank_devices(&layout.replicas, tp) } else { Vec::new() };
    type Pick = fn(&crate::cost::LayerCost) -> [&[(CollectiveKind, u64)]; 2];
    // a collective over `members`: as the cluster prices it, except expert parallelism's
    // exchanges under DeepEP's dispatch (one copy per destination node), priced as the
    // simulator prices the plan's all-to-alls (`PlanCost::collective`)
    let deepep = crate::cluster::deepep_routing(spec);
    let exchange = |k: CollectiveKind, members: &[pipec_plan::DeviceId], bytes: u64| -> f64 {
        match deepep.filter(|_| k == CollectiveKind::AllToAll) {
            Some(routing) => model.cluster.node_forwarded_time(members, bytes, routing),
            None => model.cluster.collective_time(k, members, bytes),
        }
    };
    // an expert-parallel group's devices: its replicas' leaders, or with whole experts every
    // tensor-parallel rank of them (the ranks of a replica are consecutive)
    let whole_experts = spec.strategy.experts_whole();
    let group_devices = |leaders: &[pipec_plan::DeviceId]| -> Vec<pipec_plan::DeviceId> {
        if whole_experts {
            leaders.iter().flat_map(|&d| crate::place::tensor_parallel_devices(d, tp)).collect()
        } else {
            leaders.to_vec()
        }
    };
    // `again`: which of a layer's exchanges (its attention's 0, its experts' 1) these are
    let group_times = |size: usize, pick: Pick, ring: Option<usize>, expert: bool, again: usize| {
        // the part of a layer's exchange its attention core does not cover (a ring of
        // `ring` members overlaps cp − 1 of its cp blocks), or all of it
        let exposed = |comm: f64, core: f64| match ring {
            Some(n) => (comm - core * (n - 1) as f64 / n as f64).max(0.0),
            None => comm,
        };
        layout
            .ranges
            .iter()
            .enumerate()
            .map(|(c, r)| {
                let Some(m) = ranks.get(chunks.rank_of_chunk(c, ranks.len())).filter(|_| size > 1) else {
                    return (0.0, 0.0);
                };
                let leaders = &m[..size.min(m.len())];
                let members = if expert { group_devices(leaders) } else { leaders.to_vec() };
                let time =
                    |list: &[(CollectiveKind, u64)]| list.iter().map(|&(k, b)| exchange(k, &members, b)).sum::<f64>();
                let c = &costs[r.clone()];
                let forward = |c: &crate::cost::LayerCost| exposed(time(pick(c)[0]), c.core_s[0]);
                let rerun = |i: usize| exchanged.get(i).is_some_and(|e| e[again]);
                (
                    c.iter().map(forward).sum(),
                    r.clone()
                        .zip(c)
                        .map(|(i, c)| exposed(time(pick(c)[1]), c.core_s[1]) + if rerun(i) { forward(c) } else { 0.0 })
                        .sum(),
                )
            })
            .collect()
    };
    let ep_times = group_times(ep, |c| [&c.ep_forward, &c.ep_backward], None, true, 1);
    // around the ring (`cp_comm: ring`) a block's cp − 1 transfers run under the attention
    // over the cp − 1 blocks before each (Transformer Engine's ring attention): only what
    // that does not cover is waited for
    let ring = (spec.strategy.cp_comm == pipec_plan::vocab::CpComm::Ring).then_some(cp);
    let cp_times = group_times(cp, |c| [&c.cp_forward, &c.cp_backward], ring, false, 0);
    (ep_times, cp_times, ranks)
}

/// The tensor-parallel group's link and, per stage, the seconds a forward and a backward
/// wait for its layers' collectives (a backward's with those of the halves of its blocks
/// that pipec's executor runs again there, or of the blocks recomputed whole, `policies`).
fn tp_figures(
    spec: &Spec,
    model: &ModelCosts,
    layout: &Layout,
    policies: &[Policy],
) -> (pipec_grammar::spec::Link, Vec<(f64, f64)>) {
    let costs = &model.costs;
    // a tensor-parallel group is `tp` consecutive devices inside one node
    let tp = spec.strategy.tp.max(1);
    let tp_link = if tp <= model.cluster.devices_per_node { model.cluster.intra } else { model.cluster.inter };
    let tp_time =
        |list: &[(CollectiveKind, u64)]| list.iter().map(|&(k, b)| ring_time(k, tp_link, tp, b as f64)).sum::<f64>();
    // with `tp_overlap` (Megatron-LM's --tp-comm-overlap) a layer's collectives run under its
    // own pass, chunked against its products: only what the pass does not cover is exposed
    let overlap = spec.strategy.tp_overlap && tp > 1;
    let exposed = |comm: f64, pass: f64| if overlap { (comm - pass).max(0.0) } else { comm };
    let tp_times: Vec<(f64, f64)> = layout
        .ranges
        .iter()
        .map(|r| {
            let c = &costs[r.clone()];
            // a block's forward all-reduces: one after its attention, one after its MLP
            let again = |i: usize| match policies.get(i) {
                Some(Policy::Full) => 1.0,
                Some(Policy::Halves { halves, .. }) => 0.5 * (halves.attention as u8 + halves.mlp as u8) as f64,
                Some(Policy::None | Policy::Modules(_) | Policy::Ops(_)) | None => 0.0,
            };
            (
                c.iter().map(|c| exposed(tp_time(&c.tp_forward), c.forward_s)).sum(),
                r.clone()
                    .zip(c)
                    .map(|(i, c)| {
                        exposed(tp_time(&c.tp_backward), c.backward_s)
                            + again(i) * exposed(tp_time(&c.tp_forward), c.forward_s)
                    })
                    .sum(),
            )
        })
        .collect();
    (tp_link, tp_times)
}

/// Seconds by layer (each a mixture's).
type ByLayer = Vec<(u32, f64)>;

/// What pipec's executor runs in line beyond its passes' own collectives, per stage
/// (`StageFigures::update_sums`, `norm_sum`, `ep_counts`): nothing for the other engines.
/// `ranks`: every pipeline rank's devices, replica by replica, where there are groups.
fn pipec_in_line(
    spec: &Spec,
    model: &ModelCosts,
    layout: &Layout,
    (tp_link, ranks): (pipec_grammar::spec::Link, &[Vec<pipec_plan::DeviceId>]),
) -> (Vec<Vec<f64>>, f64, Vec<ByLayer>) {
    let (costs, graph) = (&model.costs, &model.graph);
    let (tp, ep) = (spec.strategy.tp.max(1), spec.strategy.ep_replicas());
    let chunks = spec.strategy.schedule.kind.chunk_placement();
    // pipec's executor sums a tensor-parallel stage's partial gradients (its norms', its
    // routers') at the update's side in one all-reduce of their fp32 values
    let pipec = spec.engine.family() == pipec_plan::engine::performance::KernelFamily::Pipec;
    let pipec_sums = tp > 1 && pipec;
    let update_sums: Vec<Vec<f64>> = if pipec_sums {
        let sum = |n: usize| ring_time(CollectiveKind::AllReduce, tp_link, tp, 4.0 * n as f64);
        layout
            .ranges
            .iter()
            // (a `tp` that does not divide a block is refused with the costs, E0405)
            .map(|r| model.tp_partial_values(r.clone(), spec.model.loss, (tp, ep), spec.strategy.experts_whole()))
            .map(|values| values.filter(|&n| n > 0).map(|n| vec![sum(n)]).unwrap_or_default())
            .collect()
    } else {
        vec![Vec::new(); layout.ranges.len()]
    };
    let norm_sum = if pipec_sums { ring_time(CollectiveKind::AllReduce, tp_link, tp, 4.0) } else { 0.0 };
    // pipec's executor exchanges each mixture's per-expert row counts over its group before
    // the dispatch, in every pass that dispatches (one all-to-all of an fp32 value per
    // expert): part of the forward's all-to-alls, priced at each dispatch the plan lists
    // (`PlanCost::with_ep_counts`)
    let ep_counts: Vec<ByLayer> = layout
        .ranges
        .iter()
        .enumerate()
        .map(|(c, r)| {
            let Some(m) = ranks.get(chunks.rank_of_chunk(c, ranks.len())).filter(|_| pipec && ep > 1) else {
                return Vec::new();
            };
            let members = &m[..ep.min(m.len())];
            r.clone()
                .filter(|&l| !costs[l].ep_forward.is_empty())
                .filter_map(|l| {
                    let experts = graph.node(graph.op_at(l)).op.moe()?.experts as u64;
                    Some((l as u32, model.cluster.collective_time(CollectiveKind::AllToAll, members, 4 * experts)))
                })
                .collect()
        })
        .collect();
    (update_sums, norm_sum, ep_counts)
}

/// Per stage, the seconds its forward, its backward and its recompute wait for ZeRO-3's
/// weight gathers (none unless weights are sharded over replicas), and the seconds of one
/// gather of what pipec's executor gathers with the stage (`StageFigures::stage_gathers`).
/// ZeRO-3 gathers each layer's weights before its forward and again before its backward,
/// the next layer's while one computes (FSDP's prefetch): a pass waits for its first
/// layer's gather, which nothing hides, and for whatever of the others its compute cannot
/// hide — at least max(g₁, G − C + c_last) for gathers g (G in all) and computes c (C in
/// all) in the pass's order, the bound a one-ahead prefetch meets. Under activation
/// recompute the engines' backward gather serves the recompute too: FSDP2's pre-forward
/// hook returns at once in the backward (`TrainingState.PRE_BACKWARD`,
/// torch/distributed/fsdp/_fully_shard/_fsdp_state.py), Megatron-FSDP's finds the weights
/// its pre-backward hook gathered ("In activation recomputation case, we need to cancel
/// forward prefetch", megatron_fsdp.py), DeepSpeed's finds them available; so a recompute
/// waits for no gather, and a layer's gather hides behind the next layer's recompute and
/// backward. pipec's executor gathers that way only the weights its products gather
/// themselves (`in_pass::zero3_gather`, none beside tensor or expert parallelism), again
/// for a recompute; the rest it gathers whole with the stage where the plan declares,
/// which the simulator prices.
fn zero3_gather_waits(
    spec: &Spec,
    model: &ModelCosts,
    layout: &Layout,
    (stage_replicas, expert_parallel): (&[u64], &[usize]),
    times: &[(f64, f64)],
) -> (Vec<(f64, f64, f64)>, Vec<f64>) {
    let (costs, tp, ep) = (&model.costs, spec.strategy.tp.max(1), spec.strategy.ep_replicas());
    let shard_weights = spec.strategy.sharding.shards().2;
    let pipec = spec.engine.family() == pipec_plan::engine::performance::KernelFamily::Pipec;
    let graph = &model.graph;
    let tied = graph.tie_ends();
    // what the declaration pass reads of the stages (`in_pass::declare`'s layers), only
    // where pipec's executor may gather per product
    let (ops, tracked): (&[Op], Vec<bool>) = if shard_weights && pipec {
        (graph.op_list(), graph.tracked_inputs(&layout.ranges))
    } else {
        (&[], Vec::new())
    };
    let within = spec.strategy.recompute.within_blocks();
    let layers = pipec_plan::in_pass::Layers {
        ops,
        tied: &tied,
        tracked: &tracked,
        loss: spec.model.loss,
        within: within.as_ref(),
    };
    let layout_ranges = layout.ranges.len();
    let recomputed: &[bool] = &layout.recompute;
    let dp_link =
        |d: usize| if d * tp <= model.cluster.devices_per_node { model.cluster.intra } else { model.cluster.inter };
    let mut whole = Vec::with_capacity(layout.ranges.len());
    let waits = layout
        .ranges
        .iter()
        .enumerate()
        .zip(stage_replicas)
        .zip(times)
        .map(|(((s, r), &d), &(forward, backward))| {
            if !shard_weights || d < 2 {
                whole.push(0.0);
                return (0.0, 0.0, 0.0);
            }
            // under expert parallelism a layer's routed experts are gathered from the d / ep
            // replicas holding them (nothing to gather when each holds its own whole)
            let holders = (d as usize / ep).max(1);
            let link = dp_link(d as usize);
            // a layer's bytes gathered over every replica, and its routed experts' over their holders
            let parts = |c: &crate::cost::LayerCost| {
                let share = if c.shard_parameters > 0 && ep > 1 {
                    c.expert_parameters as f64 / c.shard_parameters as f64
                } else {
                    0.0
                };
                // (pipec's executor gathers the fp32 master values of its shards)
                let bytes = if pipec { c.shard_parameters as f64 * 4.0 } else { c.parameter_bytes as f64 };
                if holders > 1 {
                    (bytes * (1.0 - share), bytes * share)
                } else {
                    (bytes * (1.0 - share), 0.0)
                }
            };
            let gathered = |(dense, experts): (f64, f64)| {
                let ring =
                    |n: usize, b: f64| if b > 0.0 { ring_time(CollectiveKind::AllGather, link, n, b) } else { 0.0 };
                ring(d as usize, dense) + ring(holders, experts)
            };
            let gather = |c: &crate::cost::LayerCost| if c.parameter_bytes == 0 { 0.0 } else { gathered(parts(c)) };
            // what pipec's executor gathers with the stage (the rule of its declarations)
            let layout = pipec_plan::in_pass::Layout {
                tp,
                cp: spec.strategy.cp.max(1),
                ring: spec.strategy.cp_comm == pipec_plan::vocab::CpComm::Ring,
                ep: expert_parallel.get(s).copied().unwrap_or(1),
                zero3: true,
                inside: !recomputed.get(s).copied().unwrap_or(false),
            };
            let with_stage = |i: usize| {
                let op = &graph.node(graph.op_at(i)).op;
                pipec && !pipec_plan::in_pass::gathered_per_product(op, tied[i], layout)
            };
            // pipec's executor gathers product by product only the weight matrices its
            // products read (`in_pass::product_gathers`, in the order the plan declares)
            if pipec && layout.per_product() {
                let in_order = |kind| {
                    let stage = (kind, s == 0, s + 1 == layout_ranges);
                    let list = pipec_plan::in_pass::product_gathers(&layers, r.clone(), layout, stage);
                    list.unwrap_or_default().iter().map(|&(_, v)| gathered((4.0 * v as f64, 0.0))).collect::<Vec<_>>()
                };
                let matrices = |i: usize| {
                    pipec_plan::in_pass::product_weight_values(&graph.node(graph.op_at(i)).op).iter().sum::<u64>()
                };
                // the rest (norms, biases, and layers gathered whole) with the stage
                let rest: f64 = r
                    .clone()
                    .map(|i| {
                        if with_stage(i) {
                            parts(&costs[i]).0
                        } else {
                            costs[i].shard_parameters.saturating_sub(matrices(i)) as f64 * 4.0
                        }
                    })
                    .sum();
                whole.push(gathered((rest, 0.0)));
                let last_forward = costs[r.clone()].last().map_or(0.0, |c| c.forward_s);
                let last_backward = costs[r.clone()].first().map_or(0.0, |c| c.backward_s);
                let exposed = |gathers: Vec<f64>, compute: f64, last: f64| {
                    let first = gathers.first().copied().unwrap_or(0.0);
                    first.max(gathers.iter().sum::<f64>() - compute + last)
                };
                let forward_wait = exposed(in_order(pipec_plan::in_pass::PassKind::Forward), forward, last_forward);
                return (
                    forward_wait,
                    exposed(in_order(pipec_plan::in_pass::PassKind::Backward), backward, last_backward),
                    forward_wait,
                );
            }
            // one gather of the stage's whole weights (and one of its experts')
            let sum = r
                .clone()
                .filter(|&i| with_stage(i))
                .map(|i| parts(&costs[i]))
                .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
            whole.push(gathered(sum));
            let layer_gather = |i: usize| if with_stage(i) { 0.0 } else { gather(&costs[i]) };
            let total: f64 = r.clone().map(layer_gather).sum();
            let exposed = |mut order: Box<dyn Iterator<Item = usize> + '_>, compute: f64, last: f64| {
                let first = order.find_map(|i| Some(layer_gather(i)).filter(|g| *g > 0.0)).unwrap_or(0.0);
                first.max(total - compute + last)
            };
            let last_forward = costs[r.clone()].last().map_or(0.0, |c| c.forward_s);
            let last_backward = costs[r.clone()].first().map_or(0.0, |c| c.backward_s);
            let forward_wait = exposed(Box::new(r.clone()), forward, last_forward);
            if recomputed.get(s).copied().unwrap_or(false) && !pipec {
                // the backward's gathers, behind each layer's recompute and backward
                let first = costs[r.clone()].first().map_or(0.0, |c| c.forward_s + c.backward_s);
                return (forward_wait, exposed(Box::new(r.clone().rev()), forward + backward, first), 0.0);
            }
            (forward_wait, exposed(Box::new(r.clone().rev()), backward, last_backward), forward_wait)
        })
        .collect();
    (waits, whole)
}

/// Whether a layer's backward under `policy` runs its forward's exchanges again: its
/// attention's (context parallelism's keys and values) and its mixture of experts'
/// (the dispatch and the combine). A block recomputed whole (`layers: n`), pipec's executor
/// by halves, Megatron-LM's `moe` module; not its `moe_act` or `mlp` (no exchange), nor
/// torchtitan's op-level policy (which saves the all-to-alls' outputs).
fn exchanges_again(policy: &Policy) -> [bool; 2] {
    match policy {
        Policy::Full => [true, true],
        Policy::Halves { halves, .. } => [halves.attention, halves.mlp],
        Policy::Modules(m) => [false, m.contains(&pipec_plan::vocab::RecomputeModule::Moe)],
        Policy::None | Policy::Ops(_) => [false, false],
    }
}

fn expert_figures(
    spec: &Spec,
    model: &ModelCosts,
    layout: &Layout,
    exchanged: &[[bool; 2]],
) -> (Vec<usize>, Vec<Vec<pipec_plan::ExpertExchange>>, Vec<u64>) {
    let (costs, ep) = (&model.costs, spec.strategy.ep_replicas());
    let expert_parallel: Vec<usize> =
        layout.ranges.iter().map(|r| if holds_experts(model, r) { ep } else { 1 }).collect();
    let all_to_alls: Vec<Vec<pipec_plan::ExpertExchange>> = layout
        .ranges
        .iter()
        .zip(&expert_parallel)
        .map(|(r, &ep)| {
            r.clone()
                .filter(|_| ep > 1)
                .filter_map(|l| {
                    // the dispatch and the combine carry as many bytes, each way; a layer
                    // that runs several mixtures (the output layer with multi-token
                    // prediction's modules) exchanges all of theirs
                    let all = &costs[l].ep_forward;
                    let bytes = all.iter().map(|&(_, b)| b).sum::<u64>() / 2;
                    let again = exchanged.get(l).is_some_and(|e| e[1]);
                    (!all.is_empty()).then_some(pipec_plan::ExpertExchange { layer: l as u32, bytes, again })
                })
                .collect()
        })
        .collect();
    let expert_gradients: Vec<u64> = layout
        .ranges
        .iter()
        .map(|r| {
            costs[r.clone()].iter().map(|c| c.expert_parameters).sum::<u64>().saturating_mul(model.grad_bytes as u64)
        })
        .collect();
    (expert_parallel, all_to_alls, expert_gradients)
}

/// Each layer of the stage `range`'s recompute policy inside the blocks: the strategy's
/// (selective recompute's attention core, or its mapping's modules or operations), the
/// mapping's first `layers` blocks of the stage whole; a layer that is not a transformer
/// block keeps everything (a stage recomputing its whole forward is `Recompute::stage`'s).
fn block_policies(spec: &Spec, graph: &crate::ir::Graph, range: std::ops::Range<usize>) -> Vec<Policy> {
    let Some(within) = spec.strategy.recompute.within_blocks() else {
        return vec![Policy::None; range.len()];
    };
    // pipec's executor recomputes by halves of a block (`BlockRecompute::executor_halves`)
    let halves = within.executor_halves();
    let pipec = spec.engine.family() == pipec_plan::engine::performance::KernelFamily::Pipec;
    let (by_halves, tp) = (pipec && halves.any(), spec.strategy.tp);
    let mut blocks = 0usize;
    range
        .map(|i| {
            if !matches!(graph.node(graph.op_at(i)).op, Op::TransformerBlock { .. }) {
                return Policy::None;
            }
            blocks += 1;
            if blocks <= within.layers && pipec && tp > 1 {
                // a tensor-parallel stage of pipec's executor runs a whole block again by its
                // halves, each its segment's input kept
                Policy::Halves { halves: pipec_plan::plan::Halves { attention: true, mlp: true }, core: false }
            } else if blocks <= within.layers {
                Policy::Full
            } else if by_halves {
                Policy::Halves { halves, core: within.recomputes_core() }
            } else if !within.modules.is_empty() {
                Policy::Modules(within.modules.clone())
            } else if !within.ops.is_empty() {
                Policy::Ops(within.ops.clone())
            } else {
                Policy::None
            }
        })
        .collect()
}

/// Bytes per sample a layer keeps under `policy` — its listed tensors the policy keeps, and
/// a context-parallel member's gathered keys and values unless the block recomputes whole —
/// and the bytes per sample alive in its backward beyond them: what the policy dropped
/// (recomputed) and the gradients at the block's widest point (the list walked once).
fn kept_and_peak(c: &crate::cost::LayerCost, policy: &Policy) -> (u64, u64) {
    if c.kept.is_empty() {
        return (c.activation_bytes_per_sample, 0);
    }
    // (a block or attention half run again keeps its input alone)
    let gathered = if exchanges_again(policy)[0] { 0 } else { c.gathered_bytes_per_sample };
    let (kept, dropped) = policy.split(&c.kept);
    let gradients: f64 = c.kept.iter().map(|k| k.gradient).sum();
    ((kept as u64).saturating_add(gathered), (dropped + gradients) as u64)
}

/// The bytes a stage (layers `r`) needs, independent of the schedule, given each layer's
/// recompute policy, the stage's output message and its replicas.
fn stage_bytes(
    spec: &Spec,
    model: &ModelCosts,
    r: std::ops::Range<usize>,
    policies: &[Policy],
    (output, d): (u64, u64),
) -> StageBytes {
    let (costs, graph, mb) = (&model.costs, &model.graph, model.microbatch_size as u64);
    let (tp, cp, ep) = (spec.strategy.tp.max(1), spec.strategy.cp.max(1), spec.strategy.ep_replicas());
    let cut_bytes = |j: usize| graph.cut_bytes_per_sample(j) / spec.strategy.cp.max(1) as u64;
    let c = &costs[r.clone()];
    // multi-token prediction on a later stage than the embedding keeps a copy of its table
    // (Megatron-LM's last stage builds its own, kept equal to the first stage's by an
    // all-reduce of their gradients, as tied embeddings are)
    let copy = costs
        .first()
        .filter(|_| graph.mtp.is_some() && r.start > 0 && r.end == costs.len())
        .map_or((0, 0, 0), |e| (e.parameters, e.shard_parameters, e.parameter_bytes));
    let parameters: u64 = c.iter().map(|c| c.parameters).sum::<u64>() + copy.0;
    let shard: u64 = c.iter().map(|c| c.shard_parameters).sum::<u64>() + copy.1;
    let input_bytes = if r.start == 0 { graph.source_bytes(Source::Input) / cp as u64 } else { cut_bytes(r.start) }
        .saturating_mul(mb);
    // the last stage also keeps what the loss needs for its backward (what the engine's
    // cross-entropy keeps of a language model's [sequence, vocab] logits; split by tp over
    // the vocabulary)
    let loss_layer = costs.last().filter(|_| r.end == costs.len());
    let loss_input = loss_layer.map_or(0, |c| c.loss_input_bytes_per_sample).saturating_mul(mb);
    // each layer's bytes kept and its backward's peak under its policy, walked once
    let (kept_bytes, peaks): (Vec<u64>, Vec<u64>) = r.clone().map(|i| kept_and_peak(&costs[i], &policies[i])).unzip();
    let kept = |i: usize| kept_bytes[i - r.start];
    // activation recompute checkpoints the input of every recompute unit — the stage input,
    // and each transformer block's or LSTM's input (Megatron-LM's full recompute, one block
    // at a time) — and rebuilds one unit's activations at a time
    let unit = |i: usize| graph.node(graph.op_at(i)).op.recompute_unit();
    // the layers after the stage's last block (a language model's final norm and output
    // layer) are in no checkpoint: the engines wrap each block alone (Megatron-LM's
    // `TransformerBlock` checkpoints its layers and runs `final_layernorm` after them;
    // torchtitan's and DeepSpeed's checkpoint wrappers take the blocks), so those layers keep
    // what they keep without recompute, beside the checkpoints until the backward
    let tail = r.clone().rev().find(|&i| unit(i)).map_or(r.end, |u| u + 1);
    let starts: Vec<usize> = (r.start..tail).filter(|&i| i == r.start || unit(i)).collect();
    let tail_kept = (tail..r.end).fold(0u64, |a, j| a.saturating_add(kept(j))).saturating_mul(mb);
    let checkpoint: u64 = starts
        .iter()
        .map(|&i| {
            if i == r.start {
                input_bytes
            } else {
                // with sequence parallelism a block's input is kept split along the sequence
                let split =
                    spec.sequence_split() && matches!(graph.node(graph.op_at(i)).op, Op::TransformerBlock { .. });
                (cut_bytes(i) / if split { tp as u64 } else { 1 }).saturating_mul(mb)
            }
        })
        .fold(0u64, u64::saturating_add)
        .saturating_add(tail_kept);
    let unit_peak = starts
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let end = starts.get(k + 1).copied().unwrap_or(tail);
            (i..end).fold(0u64, |a, j| a.saturating_add(kept(j))).saturating_mul(mb)
        })
        .max()
        .unwrap_or(0);
    // what one microbatch's backward holds beyond what is kept: the layer's recomputed
    // tensors and its gradients at the widest point, the largest of the stage's
    let transient = peaks.iter().copied().max().unwrap_or(0).saturating_mul(mb);
    // the loss's widest point beside what it keeps (its fp32 copies and gradients, the
    // engine's cross-entropy's), one loss's at a time: multi-token prediction's each keep
    // their own
    let losses = 1 + graph.mtp.map_or(0, |m| m.depth) as u64;
    let loss_backward = loss_layer.map_or(0, |c| c.loss_transient_bytes_per_sample).saturating_mul(mb) / losses;
    let whole = ModelState {
        weights: c.iter().map(|c| c.parameter_bytes).sum::<u64>() + copy.2,
        gradients: shard.saturating_mul(model.grad_bytes as u64),
        optimizer: (shard as f64 * model.optimizer_bytes_per_parameter) as u64,
        master: if model.precision >= 4 { shard.saturating_mul(4) } else { 0 },
    };
    // under expert parallelism the routed experts' state is sharded over the replicas
    // holding the same experts only
    let experts: u64 = c.iter().map(|c| c.expert_parameters).sum();
    let stage_ep = if holds_experts(model, &r) { ep } else { 1 };
    let mut held = whole.sharded_by_expert(spec.strategy.sharding, d, experts, shard, stage_ep as u64);
    // FSDP2 (and pipec's executor) under ZeRO-3 and mixed precision: the fp32 master shard
    // is the rank's weights, no training-precision shard beside it (4 bytes a parameter of
    // the optimizer state's counted as weights instead, the 2 bytes dropped)
    let master_only = sharding_level_3(spec)
        && model.precision < 4
        && spec.training.master_weights
        && spec.engine.family().shards_master_only();
    if master_only {
        let fp32 = held.weights / model.precision.max(1) as u64 * 4;
        held.optimizer = held.optimizer.saturating_sub(fp32);
        held.weights = fp32;
    }
    let whole_policy = |i: usize| policies[i] == Policy::None;
    let units = Units::of(spec, model, r.clone(), d);
    StageBytes {
        parameters,
        weights: held.weights.saturating_add(units.fp8_copies),
        gradients: held.gradients,
        optimizer: held.optimizer,
        gathered_weights: units.gathered,
        // set below, once the buckets are known
        scattered_gradients: units.scattered,
        activations_per_microbatch: r
            .clone()
            .fold(0u64, |a, i| a.saturating_add(kept(i)))
            .saturating_mul(mb)
            .saturating_add(loss_input),
        whole,
        replicas: d,
        // the attention cores the layers keep (what selective recompute would drop)
        attention_core_per_microbatch: r
            .clone()
            .filter(|&i| whole_policy(i))
            .fold(0u64, |a, i| a.saturating_add(costs[i].attention_core_bytes_per_sample))
            .saturating_mul(mb),
        gathered_kv_per_microbatch: c
            .iter()
            .fold(0u64, |a, c| a.saturating_add(c.gathered_bytes_per_sample))
            .saturating_mul(mb),
        checkpoint_per_microbatch: checkpoint.saturating_add(loss_input),
        recompute_unit_peak: unit_peak,
        backward_transient: transient,
        loss_transient: loss_backward,
        largest_message: input_bytes.max(output),
    }
}

/// Whether layers `r` hold routed experts (a mixture-of-experts block, or multi-token
/// prediction's copy of one priced with the output layer).
fn holds_experts(model: &ModelCosts, r: &std::ops::Range<usize>) -> bool {
    model.costs.get(r.clone()).is_some_and(|c| c.iter().any(|c| c.expert_parameters > 0))
}

/// Whether the stage's weights are sharded (ZeRO-3, FSDP).
fn sharding_level_3(spec: &Spec) -> bool {
    spec.strategy.sharding.shards().2
}

/// What sharding and FP8 weight copies add to a stage's memory, unit by unit.
struct Units {
    /// ZeRO-3 (FSDP) gathers each transformer block as a unit — the block computing and
    /// the next one prefetched (FSDP2's `reshard_after_forward`) — and the stage's other
    /// layers as one more unit held whole for its whole forward and backward (torchtitan's
    /// and Hugging Face's wrapping: a unit per block, the rest with the root); 0 otherwise.
    gathered: u64,
    /// ZeRO-2 and 3: the unsharded gradients one reduce-scatter holds at once — under
    /// ZeRO-3 a block's (in the training precision, and cast to the reduction's) beside the
    /// other unit's, which its backward keeps to the end; under ZeRO-2 a bucket's (the
    /// stage's largest gradient bucket is set by `gradient_buckets` where it has some);
    /// 0 otherwise.
    scattered: u64,
    /// FP8 training that keeps FP8 copies of the blocks' weights (each and its transpose,
    /// a byte a value) between microbatches: the held blocks' copies.
    fp8_copies: u64,
}

impl Units {
    fn of(spec: &Spec, model: &ModelCosts, r: std::ops::Range<usize>, d: u64) -> Units {
        let (costs, graph) = (&model.costs, &model.graph);
        let block = |i: usize| matches!(graph.node(graph.op_at(i)).op, Op::TransformerBlock { .. });
        let p = model.precision as u64;
        let fp8 = spec.training.fp8;
        // a block's weights as gathered: in FP8 when the recipe gathers them so
        let gathered_block = |i: usize| match fp8 {
            Some(f) if f.gather == pipec_plan::vocab::Fp8Storage::Fp8 => costs[i].parameter_bytes / p.max(1),
            _ => costs[i].parameter_bytes,
        };
        let largest_block = r.clone().filter(|&i| block(i)).map(gathered_block).max().unwrap_or(0);
        let largest_block_parameters =
            r.clone().filter(|&i| block(i)).map(|i| costs[i].shard_parameters).max().unwrap_or(0);
        let rest: u64 = r.clone().filter(|&i| !block(i)).map(|i| costs[i].parameter_bytes).sum();
        let rest_parameters: u64 = r.clone().filter(|&i| !block(i)).map(|i| costs[i].shard_parameters).sum();
        let block_parameters: u64 = r.clone().filter(|&i| block(i)).map(|i| costs[i].shard_parameters).sum();
        let sharding = spec.strategy.sharding;
        let replicated = d > 1;
        let copies_kept = fp8.is_some_and(|f| f.weight_copies);
        let grad = model.grad_bytes as u64;
        let gathered =
            if sharding.shards().2 && replicated { largest_block.saturating_mul(2).saturating_add(rest) } else { 0 };
        let scattered = match sharding.level() {
            3 if replicated => {
                // the block's gradients in the training precision and their copy in the
                // reduction's, and the other unit's held in the training precision
                largest_block_parameters
                    .saturating_mul(p + if grad == p { 0 } else { grad })
                    .saturating_add(rest_parameters.saturating_mul(p))
            }
            2 if replicated => {
                // Megatron-LM's default bucket: max(40M, 1M · dp) parameters
                // (`DistributedDataParallelConfig.bucket_size`)
                let bucket = (40_000_000u64).max(1_000_000 * d);
                bucket.min(block_parameters + rest_parameters).saturating_mul(grad)
            }
            _ => 0,
        };
        // FP8 copies of the blocks' weights: of every held block, or under ZeRO-3 of the
        // gathered ones
        let fp8_copies = match (copies_kept, sharding.shards().2 && replicated) {
            (false, _) => 0,
            (true, false) => block_parameters.saturating_mul(2),
            (true, true) => largest_block_parameters.saturating_mul(4),
        };
        Units { gathered, scattered, fp8_copies }
    }
}
