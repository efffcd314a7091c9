//! The simulator's cost model for a plan: each instruction's time from its stage's figures,
//! the cluster's links, the reduction, and the tensor-parallel all-reduces inside passes.

use std::collections::HashMap;
use std::ops::Range;

use pipec_grammar::spec::Spec;
use pipec_plan::vocab::ReduceMode;
use pipec_plan::{CollectiveKind, DeviceId, GroupId, Instr, Phase};

use crate::cluster::{parameter_server_time, ring_allreduce_time, ClusterGraph};
use crate::figures::StageFigures;
use crate::ir::Graph;
use crate::model::ModelCosts;
use crate::partition::Layout;
use crate::simulate::CostModel;

/// Megatron tensor parallelism: two all-reduces of the layer's output per transformer block
/// or pair of linears in forward, two in backward. Returns per stage the bytes each
/// microbatch moves in TP all-reduces (forward, backward).
pub(crate) fn tp_allreduce_bytes(
    graph: &Graph,
    ranges: &[Range<usize>],
    microbatch_size: usize,
    precision: usize,
) -> Vec<u64> {
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
pub(crate) struct PlanCost<'a> {
    pub(crate) stage_fb: &'a [(f64, f64)],
    pub(crate) stage_update: &'a [f64],
    pub(crate) cluster: &'a ClusterGraph,
    pub(crate) reduce: ReduceMode,
    pub(crate) tp: usize,
    pub(crate) tp_bytes: Vec<u64>,
    /// `Lowered::summed_over`.
    pub(crate) summed_over: HashMap<GroupId, Vec<DeviceId>>,
}

impl<'a> PlanCost<'a> {
    /// The costs of a plan's instructions: its stages' times, the cluster's links, the
    /// reduction and the tensor-parallel all-reduces inside every pass.
    pub(crate) fn new(
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
    pub(crate) fn reduce_time(&self, members: &[DeviceId], bytes: u64) -> f64 {
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
    fn collective(&self, kind: CollectiveKind, group: GroupId, members: &[DeviceId], bytes: u64) -> f64 {
        let members = self.summed_over.get(&group).map_or(members, Vec::as_slice);
        match kind {
            CollectiveKind::AllReduce => self.reduce_time(members, bytes),
        }
    }
}
