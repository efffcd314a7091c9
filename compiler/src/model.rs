//! The model as the passes after the front end see it: the IR, per-layer costs (analytic,
//! or a measured profile), the cluster: `Spec` → `ModelCosts`.

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::{Spec, Training};

use crate::cluster::ClusterGraph;
use crate::cost::{analytic_costs, ApplyProfile, CostContext, LayerCost};
use crate::ir::{self, Graph};
use crate::kernels::{Keeps, Losses};
use crate::options::CompileOptions;

/// The model as the later passes see it: the IR, per-layer costs, the cluster.
pub(crate) struct ModelCosts {
    pub(crate) graph: Graph,
    pub(crate) costs: Vec<LayerCost>,
    pub(crate) cluster: ClusterGraph,
    /// Bytes per value at the training precision.
    pub(crate) precision: usize,
    /// Bytes per gradient value (the precision gradients are accumulated and reduced in).
    pub(crate) grad_bytes: usize,
    pub(crate) microbatch_size: usize,
    /// Optimizer-state bytes per parameter.
    pub(crate) optimizer_bytes_per_parameter: f64,
    /// Per stage's layers, the values of the tensor-parallel partial gradients pipec's
    /// executor sums at the update (`in_pass::tp_partial_values`; None where `tp` does not
    /// divide a block): the same for every candidate of a search that cuts the stage so.
    tp_partials: std::cell::RefCell<rustc_hash::FxHashMap<(usize, usize), Option<usize>>>,
}

impl ModelCosts {
    /// The values of the partial gradients of layers `r` split `tp` ways beside expert
    /// parallelism `ep` (`in_pass::tp_partial_values`; `whole_experts`: `etp: 1`), computed
    /// once per range.
    pub(crate) fn tp_partial_values(
        &self,
        r: std::ops::Range<usize>,
        loss: pipec_plan::model::Loss,
        (tp, ep): (usize, usize),
        whole_experts: bool,
    ) -> Option<usize> {
        *self.tp_partials.borrow_mut().entry((r.start, r.end)).or_insert_with(|| {
            pipec_plan::in_pass::tp_partial_values(self.graph.op_list(), r, loss, (tp, ep), whole_experts).ok()
        })
    }
}

/// How the spec's engine runs sequence parallelism's collectives: under an op-level policy
/// (`recompute: { ops: [...] }`, torchtitan's selective checkpointing) a gathered input is
/// not among the kept outputs (the policy keeps products, attention and reduce-scatters:
/// `_save_list`, torchtitan/parallelisms/parallelize_llama.py@9dec370, today
/// torchtitan/distributed/activation_checkpoint.py), so the backward's
/// recompute gathers it again, whatever the engine keeps otherwise.
fn sequence_collectives(spec: &Spec) -> pipec_plan::engine::performance::SequenceCollectives {
    let mut collectives = spec.engine.family().sequence_collectives();
    collectives.keeps_gathered &= !recomputes_by_operation(spec);
    collectives
}

/// Whether the spec recomputes inside the blocks by operation (`recompute: { ops: [...] }`),
/// the one recompute choice the model's costs depend on ([`sequence_collectives`]).
pub(crate) fn recomputes_by_operation(spec: &Spec) -> bool {
    matches!(&spec.strategy.recompute, pipec_grammar::ast::Recompute::Blocks(b) if !b.ops.is_empty())
}

/// What the spec's engine moves to cast FP8 operands: with FSDP's FP8 all-gather
/// (`fp8.gather: fp8`, torchao's `enable_fsdp_float8_all_gather`) the weights are cast on
/// their shard before the gather, not priced per pass.
fn fp8_casts(spec: &Spec) -> pipec_plan::engine::performance::Fp8Casts {
    let mut casts = spec.engine.family().fp8_casts();
    if spec.training.fp8.is_some_and(|f| f.gather == pipec_plan::vocab::Fp8Storage::Fp8) {
        casts.weights = None;
    }
    casts
}

/// IR and cost model: `Spec` → `ModelCosts` (analytic costs, or a measured profile).
pub(crate) fn cost_model(spec: &Spec, options: &CompileOptions) -> Result<ModelCosts, Vec<Diagnostic>> {
    let precision = spec.training.precision.bytes();
    let graph = ir::lower(&spec.model, precision);
    let cluster = ClusterGraph::new(&spec.cluster);
    let microbatch_size = spec.strategy.microbatch_size(spec.training.batch_size);
    let cx = CostContext {
        device: &cluster.device,
        precision: spec.training.precision,
        grad_precision: spec.training.grad_precision,
        state_precision: spec.training.state_precision,
        master_weights: spec.training.master_weights,
        optimizer: spec.training.optimizer.kind(),
        loss: spec.model.loss,
        microbatch: microbatch_size,
        tp: spec.strategy.tp.max(1),
        ep: spec.strategy.ep_replicas(),
        whole_experts: spec.strategy.experts_whole(),
        cp: spec.strategy.cp.max(1),
        sequence_parallel: spec.sequence_split(),
        attention: spec.model.attention,
        cp_comm: spec.strategy.cp_comm,
        overhead: spec.cluster.overhead,
        overhead_backward: spec.cluster.overhead_backward,
        fp8: spec.training.fp8,
        fused_attention: spec.engine.family().attention(&cluster.device),
        grouped_experts: spec.engine.family().grouped_expert_gemm(),
        experts_efficiency: spec.engine.performance.as_ref().map_or(1.0, |p| p.experts),
        keeps: Keeps::of(spec.engine.family()),
        tp_overlap: (spec.strategy.tp_overlap && spec.strategy.tp > 1).then(|| spec.engine.family().overlap_steps()),
        cross_entropy: Losses { whole: spec.engine.cross_entropy(false), split: spec.engine.cross_entropy(true) },
        sequence_collectives: sequence_collectives(spec),
        fp8_casts: fp8_casts(spec),
        convolution: spec.engine.family().convolution(&cluster.device),
    };
    let mut costs = analytic_costs(&graph, &cx).map_err(|e| {
        vec![Diagnostic::error("E0405", e, spec.strategy.span, "tensor parallelism")
            .with_help("choose a `tp` that divides every transformer block's heads, width and MLP width")]
    })?;
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
    let optimizer_bytes_per_parameter = optimizer_bytes_per_parameter(&spec.training);
    let grad_bytes = spec.training.grad_precision.bytes();
    Ok(ModelCosts {
        graph,
        costs,
        cluster,
        precision,
        grad_bytes,
        microbatch_size,
        optimizer_bytes_per_parameter,
        tp_partials: Default::default(),
    })
}

/// A parameter's model state in bytes: its weight at the training precision, its gradient
/// at the gradient precision and its optimizer state (with the fp32 master copy under mixed
/// precision).
pub(crate) fn state_bytes_per_parameter(spec: &Spec) -> f64 {
    let precision = spec.training.precision.bytes();
    precision as f64 + spec.training.grad_precision.bytes() as f64 + optimizer_bytes_per_parameter(&spec.training)
}

/// Optimizer-state bytes per parameter: its moments (or momentum buffer) in their
/// precision, and under mixed precision the fp32 master weights (unless the spec keeps
/// the weights in the training precision alone, `optimizer.master_weights: false`).
pub(crate) fn optimizer_bytes_per_parameter(training: &Training) -> f64 {
    let states = training.optimizer.state_per_parameter() as f64 * training.state_precision.bytes() as f64;
    let master = if training.precision.bytes() < 4 && training.master_weights { 4.0 } else { 0.0 };
    states + master
}
