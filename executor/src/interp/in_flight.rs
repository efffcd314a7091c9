//! What a device's worker holds in flight between a collective's start and its wait:
//! the collective's results to come and where they land (a stage's gradient sums, its
//! ZeRO shard, tied weights, gradient buckets), and which backwards reduce in buckets.

use std::collections::HashMap;
use std::ops::Range;

use pipec_plan::{CollectivePayload, GroupId, Instr, StageId};

use crate::comm::exchanger::Ticket;

/// A collective started by this worker: its payload, its results to come, where they land.
pub(crate) struct InFlight {
    pub(crate) payload: CollectivePayload,
    pub(crate) results: Vec<Ticket<Vec<f32>>>,
    pub(crate) into: Landing,
}

/// Where a collective's result goes when it is waited for.
pub(crate) enum Landing {
    /// The stage's gradient sums and batch statistics; `members` replicas contributed.
    Gradients { sum: ReplicaSum, members: usize },
    /// The tied weights of these (stage, layer)s this device holds, in the table's
    /// orientation.
    TiedGradient { held: Vec<(StageId, usize)> },
    /// ZeRO: this replica's segment of the reduce-scatter (its statistics, `n_stats`, after
    /// part 0's chunks), added to its gradient shard; each of the `members` replicas had
    /// reduced `covered` microbatches.
    GradientShard { covered: usize, members: usize, n_stats: usize },
    /// ZeRO: the tied weights' sums, in the table's orientation, for these (stage, layer)s:
    /// a sharded stage takes its chunk into its gradient shard, another the whole.
    TiedGradientShard { held: Vec<(StageId, usize)> },
    /// ZeRO stages 1 and 2: every replica's updated chunks, into the whole weights.
    Weights,
    /// Gradient clipping: the squared norm summed over every device.
    GradNorm,
    /// The stage's gradient buckets, started in its backward; `members` replicas.
    Buckets { buckets: BucketsInFlight, members: usize },
}

/// A replica all-reduce of a stage's gradients in flight (the whole stage's, or one
/// gradient bucket's `range`): the parameters every replica keeps over the stage's replicas,
/// the batch statistics after them (`n_stats`, with the stage's last bucket); under expert
/// parallelism ([`crate::parallel::experts::Holding`]) this member's routed experts over the replicas
/// holding them, whose sum is the same as over every replica (the others compute no
/// gradient of them), while the experts it does not keep stay without one.
pub(crate) struct ReplicaSum {
    pub(crate) everywhere: (Vec<usize>, Ticket<Vec<f32>>),
    pub(crate) here: Option<(Vec<usize>, Ticket<Vec<f32>>)>,
    pub(crate) n_stats: usize,
}

/// The results to come of one reduction per part of a shard's layout.
type PartResults = Vec<Ticket<Vec<f32>>>;

/// A bucketed stage's reduction in flight: per bucket, in start order, its result and the
/// parameters it carries (positions in the stage's visiting order); the last bucket's
/// values are followed by the stage's batch statistics (`n_stats` of them). Under ZeRO
/// each bucket is a reduce-scatter whose result is this replica's chunks of its
/// parameters; `covered` is then the microbatches its gradients summed (the stage's
/// accumulator is cleared as each bucket is taken).
pub(crate) struct BucketsInFlight {
    /// Under ZeRO: each bucket's reduce-scatters (one per part of the shard's layout) and
    /// its parameters.
    pub(crate) parts: Vec<(PartResults, Range<usize>)>,
    /// Without ZeRO: each bucket's replica sums.
    pub(crate) sums: Vec<ReplicaSum>,
    pub(crate) n_stats: usize,
    pub(crate) covered: usize,
}

impl BucketsInFlight {
    pub(crate) fn new() -> Self {
        BucketsInFlight { parts: Vec::new(), sums: Vec::new(), n_stats: 0, covered: 0 }
    }
}

/// The positions in `all` of the backwards whose stage's replica all-reduce runs in
/// buckets (`reduced_in_buckets`, on a stage with buckets), with the all-reduce's group.
pub(crate) fn bucketed_backwards(plan: &pipec_plan::Plan, all: &[Instr]) -> HashMap<usize, GroupId> {
    let has_buckets = |s| plan.stage(s).is_some_and(|s| !s.gradient_buckets.is_empty());
    pipec_plan::plan::bucketed_passes(all, has_buckets)
        .into_iter()
        .filter_map(|(pass, j)| {
            let Instr::Collective { group, .. } = &all[j] else { return None };
            Some((pass, *group))
        })
        .collect()
}
