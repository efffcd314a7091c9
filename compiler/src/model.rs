//! The model as the passes after the front end see it: the IR, per-layer costs (analytic,
//! or a measured profile), the cluster: `Spec` → `ModelCosts`.

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::{Optimizer, Spec};

use crate::cluster::ClusterGraph;
use crate::cost::{analytic_costs, ApplyProfile, LayerCost};
use crate::ir::{self, Graph};
use crate::options::CompileOptions;

/// The model as the later passes see it: the IR, per-layer costs, the cluster.
pub(crate) struct ModelCosts {
    pub(crate) graph: Graph,
    pub(crate) costs: Vec<LayerCost>,
    pub(crate) cluster: ClusterGraph,
    /// Bytes per value at the training precision.
    pub(crate) precision: usize,
    pub(crate) microbatch_size: usize,
    /// Optimizer-state bytes per parameter.
    pub(crate) optimizer_bytes_per_parameter: f64,
}

/// IR and cost model: `Spec` → `ModelCosts` (analytic costs, or a measured profile).
pub(crate) fn cost_model(spec: &Spec, options: &CompileOptions) -> Result<ModelCosts, Vec<Diagnostic>> {
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

pub(crate) fn optimizer_bytes_per_parameter(opt: &Optimizer, precision: usize) -> f64 {
    let states = opt.state_per_parameter() as f64 * 4.0;
    let master = if precision < 4 { 4.0 } else { 0.0 };
    states + master
}
