//! Partitioning: which contiguous layers each stage holds, and (for `auto`) how many workers
//! replicate each stage.
//!
//! - [`min_max_contiguous`]: the exact dynamic program behind `balanced`: split `n` layers
//!   into `k` contiguous non-empty stages minimising the slowest stage, for any stage cost
//!   that does not grow when a stage starts later. O(k·n·log n).
//! - [`partition_layers`]: the pass, `ModelCosts` → [`Layout`] (explicit ranges,
//!   `balanced`, or PipeDream's `auto`).
//! - [`auto`]: PipeDream's planner: the number of stages and the replication of each stage
//!   that minimise the time per microbatch on `machines` workers, counting compute, the
//!   weight synchronisation of replicated stages ([`WeightSync`]: pipec's all-reduce per
//!   step, or PipeDream's per-minibatch exchange amortised over the replicas) and the
//!   activation/gradient transfers at each cut, carried by the replicas that send or
//!   receive them over the link they use, and rejecting stages whose memory does not fit.
//!   It searches the bottleneck time by bisection and, for each candidate, finds the
//!   fewest machines that reach it with a dynamic program over the layers (and, on two
//!   levels, the position inside a node), so 1,000 layers × 1,024 workers plan in under a
//!   second (docs/benchmarks.md).

use std::ops::Range;

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::{Link, Partition, Recompute, ScheduleKind, Spec};

use crate::cluster::ring_allreduce_time;
use crate::memory::human_bytes;
use crate::model::ModelCosts;

/// Splits `n` items into `k` contiguous non-empty ranges minimising the maximum of
/// `cost(stage, start, end)`. `cost` must not increase as `start` grows (for fixed stage
/// and end). When, in addition, the stages are interchangeable (`uniform`: the optimum of
/// the first p items only grows with p), each cell is found by binary search, O(k·n·log n);
/// otherwise every split point is tried, O(k·n²). Returns the ranges and the optimal
/// maximum, or None when `k > n` or `k == 0`.
pub fn min_max_contiguous(
    n: usize,
    k: usize,
    uniform: bool,
    cost: impl Fn(usize, usize, usize) -> f64,
) -> Option<(Vec<Range<usize>>, f64)> {
    if k == 0 || k > n {
        return None;
    }
    // best[i] of stage j: optimum for the first i items in j+1 stages (two rows kept: stage
    // j reads only stage j−1's); choice[j·(n+1) + i]: start of stage j. Stage j ends at
    // most k−1−j items before the end (each later stage takes one), so no cell past that
    // is needed.
    let w = n + 1;
    let mut prev = vec![f64::INFINITY; w];
    let mut cur = vec![f64::INFINITY; w];
    let mut choice = vec![0u32; k * w];
    for (i, b) in prev.iter_mut().enumerate().take(n - (k - 1) + 1).skip(1) {
        *b = cost(0, 0, i);
    }
    for j in 1..k {
        cur.fill(f64::INFINITY);
        for i in (j + 1)..=(n - (k - 1 - j)) {
            let (mut best_v, mut best_p) = (f64::INFINITY, 0);
            if !uniform {
                for (p, &before) in prev.iter().enumerate().take(i).skip(j) {
                    let v = before.max(cost(j, p, i));
                    if v < best_v {
                        best_v = v;
                        best_p = p;
                    }
                }
            } else {
                // candidates p in [j, i-1]: max(best[j-1][p], cost(j, p, i)); the first term
                // grows with p, the second shrinks: the optimum sits at their crossing.
                let (mut lo, mut hi) = (j, i - 1);
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    if prev[mid] >= cost(j, mid, i) {
                        hi = mid;
                    } else {
                        lo = mid + 1;
                    }
                }
                best_p = lo;
                for p in [lo.saturating_sub(1).max(j), lo] {
                    let v = prev[p].max(cost(j, p, i));
                    if v < best_v {
                        best_v = v;
                        best_p = p;
                    }
                }
            }
            cur[i] = best_v;
            choice[j * w + i] = best_p as u32;
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    let mut ranges = vec![0..0; k];
    let mut end = n;
    for j in (0..k).rev() {
        let start = if j == 0 { 0 } else { choice[j * w + end] as usize };
        ranges[j] = start..end;
        end = start;
    }
    Some((ranges, prev[n]))
}

/// The stage time of `balanced`: compute per microbatch divided by the stage's replicas.
pub fn balanced(layer_times: &[f64], replicas: &[usize]) -> Option<(Vec<Range<usize>>, f64)> {
    let prefix = prefix_sums(layer_times);
    let uniform = replicas.windows(2).all(|w| w[0] == w[1]);
    min_max_contiguous(layer_times.len(), replicas.len(), uniform, |j, p, i| {
        (prefix[i] - prefix[p]) / replicas[j].max(1) as f64
    })
}

/// Prefix sums over the layers of their time, parameter bytes and memory, so any range's
/// total is one subtraction.
struct Prefixes {
    time: Vec<f64>,
    weights: Vec<f64>,
    memory: Vec<f64>,
}

/// Prefix sums: `out[i]` = sum of the first i values.
pub fn prefix_sums(values: &[f64]) -> Vec<f64> {
    let mut out = Vec::with_capacity(values.len() + 1);
    out.push(0.0);
    let mut acc = 0.0;
    for v in values {
        acc += v;
        out.push(acc);
    }
    out
}

/// How a replicated stage's weights are kept in step, which decides what its
/// synchronisation costs per unit of work (a microbatch; a minibatch for PipeDream).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightSync {
    /// pipec's synchronous schedules: one ring all-reduce of the stage's gradients per step
    /// of this many microbatches, spread over all of them.
    PerStep { microbatches: usize },
    /// PipeDream (its paper's §3.1 and `optimizer_graph_hierarchical.py`): every replica
    /// exchanges 4(m−1)/m·|w| bytes after each minibatch it trains, and trains one in m, so a
    /// stage of m replicas takes (compute + 4(m−1)·|w| / (B·m)) / m per minibatch.
    PipeDream,
}

/// Everything `auto` needs to know about the layers and the machines.
#[derive(Debug, Clone)]
pub struct AutoInput<'a> {
    /// Forward + backward seconds per unit of work (microbatch), per layer.
    pub layer_times: &'a [f64],
    /// Parameter bytes per layer (what the weight synchronisation moves).
    pub parameter_bytes: &'a [f64],
    /// Bytes crossing a cut after each layer, per unit of work (activations forward; the
    /// gradient of the same size goes back).
    pub cut_bytes: &'a [f64],
    /// Memory a stage needs per layer regardless of replication: weights, gradients,
    /// optimizer state and activations for the in-flight microbatches.
    pub memory_bytes: &'a [f64],
    pub machines: usize,
    pub machines_per_node: usize,
    pub memory_capacity: f64,
    pub sync: WeightSync,
    /// The links inside a node and between nodes.
    pub intra: Link,
    pub inter: Link,
}

/// A profile as the planner reads it, one value per layer of a chain.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerChain {
    pub names: Vec<String>,
    /// Forward + backward seconds per unit of work.
    pub times: Vec<f64>,
    pub parameter_bytes: Vec<f64>,
    /// Bytes crossing the cut after each layer, per unit of work.
    pub cut_bytes: Vec<f64>,
    pub memory_bytes: Vec<f64>,
}

/// The machines a chain is planned on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Machines {
    pub nodes: usize,
    pub per_node: usize,
    pub memory_capacity: f64,
    pub intra: Link,
    pub inter: Link,
}

impl LayerChain {
    pub fn input(&self, machines: &Machines, sync: WeightSync) -> AutoInput<'_> {
        AutoInput {
            layer_times: &self.times,
            parameter_bytes: &self.parameter_bytes,
            cut_bytes: &self.cut_bytes,
            memory_bytes: &self.memory_bytes,
            machines: machines.nodes * machines.per_node,
            machines_per_node: machines.per_node,
            memory_capacity: machines.memory_capacity,
            sync,
            intra: machines.intra,
            inter: machines.inter,
        }
    }
}

/// What `auto` chose.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoPlan {
    pub ranges: Vec<Range<usize>>,
    pub replicas: Vec<usize>,
    /// The bottleneck: predicted seconds per unit of work (microbatch) in steady state.
    pub time_per_microbatch: f64,
}

impl AutoPlan {
    pub fn notation(&self) -> String {
        self.replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("-")
    }
}

/// One stage's cost figures at a replica count (transfers before dividing by replicas).
struct StageParts {
    replicas: f64,
    compute: f64,
    weights: f64,
    sync: f64,
    sync_bandwidth: f64,
    input: f64,
    output: f64,
}

impl StageParts {
    fn time(&self) -> f64 {
        (self.compute / self.replicas + self.sync).max(self.input / self.replicas).max(self.output / self.replicas)
    }
}

impl AutoInput<'_> {
    /// The slowest link among the contiguous machines `a..=b`.
    fn span_link(&self, a: usize, b: usize) -> Link {
        let per = self.machines_per_node.max(1);
        if a / per == b / per {
            self.intra
        } else {
            self.inter
        }
    }

    /// Steady-state seconds per unit of work of layers `i..j` on the `m` machines from
    /// `first`, or None when the layers do not fit in one machine's memory.
    fn stage_time(&self, p: &Prefixes, i: usize, j: usize, first: usize, m: usize) -> Option<f64> {
        self.stage_parts(p, i, j, first, m).map(|s| s.time())
    }

    /// The parts of [`Self::stage_time`]:
    /// - compute and weight synchronisation: `compute / m + sync` (the replicas take turns;
    ///   the synchronisation does not overlap the compute);
    /// - the activations coming in and going out (and their gradients back) over the link
    ///   the stage's replicas use to the neighbouring stage, each replica carrying 1/m of
    ///   them; transfers overlap compute, so each is its own bound.
    fn stage_parts(&self, p: &Prefixes, i: usize, j: usize, first: usize, m: usize) -> Option<StageParts> {
        if p.memory[j] - p.memory[i] > self.memory_capacity {
            return None;
        }
        let n = self.layer_times.len();
        let replicas = m as f64;
        let weights = p.weights[j] - p.weights[i];
        let link = self.span_link(first, first + m - 1);
        let sync = match self.sync {
            WeightSync::PerStep { microbatches } => {
                ring_allreduce_time(link, m, weights as u64) / microbatches.max(1) as f64
            }
            WeightSync::PipeDream if m > 1 => 4.0 * (replicas - 1.0) * weights / (link.bandwidth * replicas) / replicas,
            WeightSync::PipeDream => 0.0,
        };
        let transfer = |bytes: f64, link: Link| 2.0 * (link.latency + bytes / link.bandwidth);
        Some(StageParts {
            replicas,
            compute: p.time[j] - p.time[i],
            weights,
            sync,
            sync_bandwidth: link.bandwidth,
            input: if i > 0 { transfer(self.cut_bytes[i - 1], self.span_link(first - 1, first + m - 1)) } else { 0.0 },
            output: if j < n { transfer(self.cut_bytes[j - 1], self.span_link(first, first + m)) } else { 0.0 },
        })
    }

    /// Visits every useful replica count (at most `left`) that runs layers `i..j` from
    /// machine `first` within `t`: the fewest, and, where node boundaries matter, the next
    /// few that leave the following stage a different position inside its node (more
    /// replicas at the same position only leave fewer machines).
    #[allow(clippy::too_many_arguments)]
    fn replica_counts(
        &self,
        p: &Prefixes,
        (i, j): (usize, usize),
        first: usize,
        left: usize,
        t: f64,
        phases: usize,
        mut visit: impl FnMut(usize),
    ) {
        let at_least = |x: f64| ((x / t) - 1e-12).ceil().max(1.0) as usize;
        // compute / m alone must fit: no fewer replicas can work
        let mut m = at_least(p.time[j] - p.time[i]);
        let mut found: Option<usize> = None;
        while m <= left {
            if found.is_some_and(|m0| m >= m0 + phases) {
                break;
            }
            let Some(parts) = self.stage_parts(p, i, j, first, m) else { return };
            if parts.time() <= t * (1.0 + 1e-12) {
                found.get_or_insert(m);
                visit(m);
                m += 1;
                continue;
            }
            if found.is_some() {
                m += 1;
                continue;
            }
            // Jump to the fewest replicas that could work: with more replicas the links
            // only get slower, each transfer needs transfer / t replicas, and
            match self.sync {
                // the all-reduce only grows: compute / (t − sync) replicas, none if the
                // all-reduce alone is over t
                WeightSync::PerStep { .. } if parts.sync >= t => return,
                WeightSync::PerStep { .. } => {
                    m = (m + 1).max(at_least(parts.compute * t / (t - parts.sync)));
                }
                // (compute + 4(m−1)|w|/(B·m)) / m ≥ (compute + 2|w|/B) / m once m ≥ 2
                WeightSync::PipeDream => {
                    m = (m + 1).max(at_least(parts.compute + 2.0 * parts.weights / parts.sync_bandwidth));
                }
            }
            m = m.max(at_least(parts.input)).max(at_least(parts.output));
        }
    }

    /// The fewest machines reaching bottleneck `t`, with the stages as (first layer,
    /// replicas). A dynamic program over (layers covered, machines used): on one level the
    /// fewest machines for a prefix dominate; on two levels a stage's links depend on where
    /// it starts inside a node, so the fewest machines are kept per position in the node
    /// (`phases` positions; 1 keeps only the fewest, exact on one level).
    fn cover(&self, p: &Prefixes, t: f64, phases: usize) -> Option<(usize, Vec<(usize, usize)>)> {
        let n = self.layer_times.len();
        const NONE: usize = usize::MAX;
        // fewest[j·phases + r]: fewest machines covering the first j layers with used %
        // phases == r (flat: `auto` calls this some 60 times per plan)
        let mut fewest = vec![NONE; (n + 1) * phases];
        let mut from = vec![(0usize, 0usize, 0usize); (n + 1) * phases];
        fewest[0] = 0;
        for i in 0..n {
            for r in 0..phases {
                let used = fewest[i * phases + r];
                if used >= self.machines {
                    continue;
                }
                let left = self.machines - used;
                for j in (i + 1)..=n {
                    // memory and compute only grow with more layers
                    if p.memory[j] - p.memory[i] > self.memory_capacity
                        || (p.time[j] - p.time[i]) / t > left as f64 * (1.0 + 1e-12)
                    {
                        break;
                    }
                    // every later stage needs at least its compute / t machines
                    let later = (p.time[n] - p.time[j]) / t * (1.0 - 1e-9);
                    let room = left as f64 - later;
                    if room < 1.0 - 1e-9 {
                        continue;
                    }
                    let (row, from_row) =
                        (&mut fewest[j * phases..(j + 1) * phases], &mut from[j * phases..(j + 1) * phases]);
                    self.replica_counts(p, (i, j), used, room.floor().max(1.0) as usize, t, phases, |m| {
                        let total = used + m;
                        let r2 = total % phases;
                        if total < row[r2] {
                            row[r2] = total;
                            from_row[r2] = (i, r, m);
                        }
                    });
                }
            }
        }
        let (best_r, &best) = fewest[n * phases..].iter().enumerate().min_by_key(|(_, &v)| v)?;
        if best > self.machines {
            return None;
        }
        let mut stages = Vec::new();
        let (mut j, mut r) = (n, best_r);
        while j > 0 {
            let (i, r_prev, m) = from[j * phases + r];
            stages.push((i, m));
            j = i;
            r = r_prev;
        }
        stages.reverse();
        Some((best, stages))
    }
}

/// Layer pairs × positions in a node² up to which `auto` keeps the fewest machines per
/// position inside a node on two levels (densenet-121's 430 layers on servers of 8:
/// 1.2·10⁷); beyond, only per prefix.
const EXACT_ALIGNMENT_BUDGET: usize = 20_000_000;

/// PipeDream-style planning. Returns None when no layout fits in memory.
pub fn auto(input: &AutoInput<'_>) -> Option<AutoPlan> {
    let n = input.layer_times.len();
    if n == 0 || input.machines == 0 {
        return None;
    }
    let prefixes = Prefixes {
        time: prefix_sums(input.layer_times),
        weights: prefix_sums(input.parameter_bytes),
        memory: prefix_sums(input.memory_bytes),
    };
    // Bisection on the bottleneck time between a lower bound (perfect split over all
    // machines) and an upper bound that is always reachable if anything is.
    let total = prefixes.time[n];
    let mut lo = total / input.machines as f64 * 0.5;
    let mut hi = total.max(f64::MIN_POSITIVE);
    // Communication or sync may dominate: grow hi until feasible.
    let mut grow = 0;
    while input.cover(&prefixes, hi, 1).is_none() {
        hi *= 2.0;
        grow += 1;
        if grow > 60 {
            return None;
        }
    }
    // Per position in a node when the work stays small; beyond, the fewest machines per
    // prefix alone (1,000 layers on 1,024 machines).
    let per = input.machines_per_node.max(1);
    let phases =
        if per >= input.machines || (n * n / 2).saturating_mul(per * per) > EXACT_ALIGNMENT_BUDGET { 1 } else { per };
    for _ in 0..64 {
        let mid = 0.5 * (lo + hi);
        if input.cover(&prefixes, mid, phases).is_some() {
            hi = mid;
        } else {
            lo = mid;
        }
        if hi - lo <= hi * 1e-7 {
            break;
        }
    }
    let (_, stages) = input.cover(&prefixes, hi, phases)?;
    let mut ranges = Vec::new();
    let mut replicas = Vec::new();
    let mut first = 0;
    let mut bottleneck: f64 = 0.0;
    for (k, &(i, m)) in stages.iter().enumerate() {
        let j = stages.get(k + 1).map(|s| s.0).unwrap_or(n);
        let time = input.stage_time(&prefixes, i, j, first, m)?;
        bottleneck = bottleneck.max(time);
        ranges.push(i..j);
        replicas.push(m);
        first += m;
    }
    Some(AutoPlan { ranges, replicas, time_per_microbatch: bottleneck })
}

/// PipeDream's planner's layout: replicas per stage and the stages' layer ranges.
pub(crate) type PlannedLayout = (Vec<usize>, Vec<Range<usize>>);

/// The partitions of one cost model: balanced ones by the replicas of each chunk, and
/// PipeDream's planner's (replicas and ranges) by whether activations are recomputed.
#[derive(Default)]
pub(crate) struct Partitions {
    pub(crate) balanced: rustc_hash::FxHashMap<Vec<usize>, Option<Vec<Range<usize>>>>,
    pub(crate) planned: rustc_hash::FxHashMap<bool, Option<PlannedLayout>>,
}

/// The layout as the compiler resolves it: ranks of the pipeline, chunks per rank.
pub(crate) struct Layout {
    /// Replicas of each pipeline rank's stages.
    pub(crate) replicas: Vec<usize>,
    pub(crate) virtual_stages: usize,
    pub(crate) ranges: Vec<Range<usize>>,
    pub(crate) notation: String,
    /// Per stage: activation recompute.
    pub(crate) recompute: Vec<bool>,
}

/// The replicas of each of `n` chunks (stages), from the replicas of each pipeline rank
/// and where `kind` places its chunks.
pub(crate) fn chunk_replicas(replicas: &[usize], kind: ScheduleKind, n: usize) -> Vec<usize> {
    let (chunks, ranks) = (kind.chunk_placement(), replicas.len());
    (0..n).map(|c| if ranks == 0 { 1 } else { replicas[chunks.rank_of_chunk(c, ranks)] }).collect()
}

/// Partitioning: `ModelCosts` → `Layout` (explicit ranges, `balanced`, or PipeDream's
/// `auto`, which may also choose the replication). Partitions are looked up in and added
/// to `memo` when given (the strategy search's candidates of one cost model share them).
pub(crate) fn partition_layers(
    spec: &Spec,
    model: &ModelCosts,
    memo: Option<&mut Partitions>,
) -> Result<Layout, Vec<Diagnostic>> {
    let (graph, costs, cluster, opt_bytes) =
        (&model.graph, &model.costs, &model.cluster, model.optimizer_bytes_per_parameter);
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    let v = strategy.schedule.virtual_stages.max(1);
    let times: Vec<f64> = costs.iter().map(|c| c.forward_s + c.backward_s).collect();
    let replicas = strategy.replicas.clone();
    let ranks = replicas.len();
    let chunk_replicas: Vec<usize> = chunk_replicas(&replicas, kind, ranks * v);
    let fail = |msg: String| {
        vec![Diagnostic::error("E0403", msg, strategy.partition_span, "partition")
            .with_help("use fewer stages or a deeper model")]
    };
    let (replicas, virtual_stages, ranges) = match &strategy.partition {
        Partition::Explicit(ranges) => (replicas, v, ranges.clone()),
        Partition::Auto if !strategy.layout_fixed && v == 1 && kind.auto_replicates() => {
            let tp = strategy.tp.max(1);
            let machines = cluster.device_count() / tp;
            let mb = strategy.microbatch_size(spec.training.batch_size);
            // a tensor-parallel member holds its shard of each layer's weights, optimizer
            // state and activations (the cost model's per-rank figures), and reduces its
            // shard's gradient
            let grad = model.grad_bytes as f64;
            let parameter_bytes: Vec<f64> = costs.iter().map(|c| c.shard_parameters as f64 * grad).collect();
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
                    c.parameter_bytes as f64
                        + c.shard_parameters as f64 * (grad + opt_bytes)
                        + c.activation_bytes_per_sample as f64 * mb as f64 * kept
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
            let solve = || auto(&input).map(|p| (p.replicas, p.ranges));
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
        // an engine that splits a language model's blocks evenly runs its own split
        Partition::Auto | Partition::Balanced => match engine_split(spec, graph, ranks * v) {
            Some(ranges) => (replicas, v, ranges),
            None => {
                let solve = || balanced(&times, &chunk_replicas).map(|(ranges, _)| ranges);
                let ranges = match memo {
                    Some(memo) => memo.balanced.entry(chunk_replicas.clone()).or_insert_with(solve).clone(),
                    None => solve(),
                }
                .ok_or_else(|| fail(format!("{} stages for {} layers", chunk_replicas.len(), times.len())))?;
                (replicas, v, ranges)
            }
        },
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

/// The chunks of a language model's layers (more than one) as the spec's engine runs them
/// when it splits the transformer blocks evenly (`capability::block_split`): each chunk its
/// share of the blocks, the layers before the first block in the first chunk, every other
/// layer with the block before it. None for pipec's executor, another model, or blocks that
/// do not split so (the engine's tables then refuse the plan).
fn engine_split(spec: &Spec, graph: &crate::ir::Graph, chunks: usize) -> Option<Vec<Range<usize>>> {
    use pipec_plan::engine::capability;
    let split = capability::block_split(spec.engine.target.name)?;
    let ops = graph.op_list();
    let tied = spec.model.layers.iter().any(|l| l.tied.is_some());
    pipec_plan::engine::gpt::GptShape::of(ops, tied)?;
    let starts: Vec<usize> =
        ops.iter().enumerate().filter(|(_, op)| op.block_dims().is_some()).map(|(i, _)| i).collect();
    let counts = capability::split_blocks(starts.len(), chunks, split).filter(|_| chunks > 1)?;
    Some(capability::chunk_ranges(&starts, ops.len(), &counts))
}

pub(crate) fn notation(replicas: &[usize]) -> String {
    replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("-")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every contiguous split into k non-empty ranges, by brute force.
    fn brute_force(times: &[f64], replicas: &[usize]) -> f64 {
        fn go(times: &[f64], replicas: &[usize], start: usize, stage: usize) -> f64 {
            let n = times.len();
            let k = replicas.len();
            if stage == k - 1 {
                return times[start..].iter().sum::<f64>() / replicas[stage] as f64;
            }
            let mut best = f64::INFINITY;
            for end in (start + 1)..=(n - (k - stage - 1)) {
                let here = times[start..end].iter().sum::<f64>() / replicas[stage] as f64;
                best = best.min(here.max(go(times, replicas, end, stage + 1)));
            }
            best
        }
        go(times, replicas, 0, 0)
    }

    proptest! {
        #[test]
        fn balanced_is_optimal_and_covers_every_layer_once(
            times in proptest::collection::vec(0.01f64..10.0, 1..12),
            replicas in proptest::collection::vec(1usize..4, 1..6),
        ) {
            prop_assume!(replicas.len() <= times.len());
            let (ranges, value) = balanced(&times, &replicas).expect("k <= n");
            // contiguous, non-empty, covering 0..n in order
            prop_assert_eq!(ranges.len(), replicas.len());
            prop_assert_eq!(ranges[0].start, 0);
            prop_assert_eq!(ranges.last().map(|r| r.end), Some(times.len()));
            for w in ranges.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            for r in &ranges {
                prop_assert!(r.start < r.end);
            }
            // the reported value is the real bottleneck of the ranges, and optimal
            let actual = ranges.iter().zip(&replicas).map(|(r, &m)| times[r.clone()].iter().sum::<f64>() / m as f64).fold(0.0f64, f64::max);
            prop_assert!((actual - value).abs() <= 1e-9 * value.max(1.0));
            let optimum = brute_force(&times, &replicas);
            prop_assert!((value - optimum).abs() <= 1e-9 * optimum.max(1.0), "dp {} vs brute force {}", value, optimum);
        }

        #[test]
        fn auto_uses_at_most_the_machines_and_covers_every_layer(
            times in proptest::collection::vec(0.01f64..10.0, 1..10),
            machines in 1usize..9,
        ) {
            let n = times.len();
            let zeros = vec![0.0; n];
            let input = AutoInput {
                layer_times: &times, parameter_bytes: &zeros, cut_bytes: &zeros, memory_bytes: &zeros,
                machines, machines_per_node: 4, memory_capacity: 1.0, sync: WeightSync::PerStep { microbatches: 8 },
                intra: Link::new(1e12, 0.0), inter: Link::new(1e12, 0.0),
            };
            let plan = auto(&input).expect("free communication always plans");
            prop_assert!(plan.replicas.iter().sum::<usize>() <= machines);
            prop_assert_eq!(plan.ranges[0].start, 0);
            prop_assert_eq!(plan.ranges.last().map(|r| r.end), Some(n));
            for w in plan.ranges.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            // with free communication the bottleneck reaches the best contiguous split
            // into any number of stages with any replication, up to the bisection precision;
            // it can never beat total/machines
            let total: f64 = times.iter().sum();
            prop_assert!(plan.time_per_microbatch >= total / machines as f64 * (1.0 - 1e-9));
        }
    }

    /// The best bottleneck over every contiguous partition and every replica count per
    /// stage (devices given out in order), by brute force with the planner's own stage cost.
    fn brute_force_auto(input: &AutoInput<'_>) -> f64 {
        let p = Prefixes {
            time: prefix_sums(input.layer_times),
            weights: prefix_sums(input.parameter_bytes),
            memory: prefix_sums(input.memory_bytes),
        };
        fn go(input: &AutoInput<'_>, p: &Prefixes, start: usize, first: usize) -> f64 {
            let n = input.layer_times.len();
            if start == n {
                return 0.0;
            }
            let mut best = f64::INFINITY;
            for end in start + 1..=n {
                for m in 1..=input.machines.saturating_sub(first) {
                    let Some(t) = input.stage_time(p, start, end, first, m) else { continue };
                    best = best.min(t.max(go(input, p, end, first + m)));
                }
            }
            best
        }
        go(input, &p, 0, 0)
    }

    proptest! {
        #[test]
        fn auto_matches_brute_force_on_small_cases(
            times in proptest::collection::vec(0.1f64..10.0, 1..6),
            params in proptest::collection::vec(0.0f64..4e9, 6),
            cuts in proptest::collection::vec(0.0f64..4e9, 6),
            machines in 1usize..6,
            per_node in 1usize..4,
            pipedream in proptest::bool::ANY,
        ) {
            let n = times.len();
            let zeros = vec![0.0; n];
            let sync = if pipedream { WeightSync::PipeDream } else { WeightSync::PerStep { microbatches: 4 } };
            let input = AutoInput {
                layer_times: &times, parameter_bytes: &params[..n], cut_bytes: &cuts[..n], memory_bytes: &zeros,
                machines, machines_per_node: per_node, memory_capacity: 1.0, sync,
                intra: Link::new(1e9, 0.0), inter: Link::new(2.5e8, 0.0),
            };
            let plan = auto(&input).expect("plans");
            let best = brute_force_auto(&input);
            // never better than the optimum (the reported time is the plan's real cost) ...
            prop_assert!(plan.time_per_microbatch >= best * (1.0 - 1e-9), "auto {} < brute force {}", plan.time_per_microbatch, best);
            // ... and on one level (or with every position in a node kept) the optimum
            if per_node >= machines || per_node == 1 {
                prop_assert!(plan.time_per_microbatch <= best * (1.0 + 1e-6), "auto {} ({}) vs brute force {}", plan.time_per_microbatch, plan.notation(), best);
            }
        }
    }

    #[test]
    fn auto_replicates_a_dominant_layer() {
        // one heavy layer without weights and three light ones with large weights on 4
        // machines: replicating the light layers would cost a slow all-reduce, so only the
        // heavy layer is replicated
        let times = [8.0, 1.0, 1.0, 1.0];
        let zeros = [0.0; 4];
        let params = [0.0, 1e10, 1e10, 1e10];
        let input = AutoInput {
            layer_times: &times,
            parameter_bytes: &params,
            cut_bytes: &zeros,
            memory_bytes: &zeros,
            machines: 4,
            machines_per_node: 4,
            memory_capacity: 1.0,
            sync: WeightSync::PerStep { microbatches: 8 },
            intra: Link::new(1e9, 0.0),
            inter: Link::new(1e9, 0.0),
        };
        // "3-1" gives max(8/3, 3) = 3; "2-2", "2-1-1" or four single stages are slower
        let plan = auto(&input).expect("plans");
        assert_eq!(plan.notation(), "3-1");
        assert!((plan.time_per_microbatch - 3.0).abs() < 1e-6, "{}", plan.time_per_microbatch);
    }

    #[test]
    fn auto_respects_memory() {
        let times = [1.0, 1.0];
        let zeros = [0.0; 2];
        let memory = [0.6, 0.6];
        let input = AutoInput {
            layer_times: &times,
            parameter_bytes: &zeros,
            cut_bytes: &zeros,
            memory_bytes: &memory,
            machines: 2,
            machines_per_node: 2,
            memory_capacity: 1.0,
            sync: WeightSync::PerStep { microbatches: 4 },
            intra: Link::new(1e12, 0.0),
            inter: Link::new(1e12, 0.0),
        };
        // both layers on one stage would need 1.2 > 1.0: two stages
        let plan = auto(&input).expect("plans");
        assert_eq!(plan.ranges.len(), 2);
        let mut input = input;
        input.machines = 1;
        assert!(auto(&input).is_none());
    }
}
