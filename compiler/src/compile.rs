//! The compiler driver: the readable list of passes from a checked spec (with a concrete
//! strategy) to a verified, simulated plan.
//!
//! ```text
//! Spec ─model::cost_model→ ModelCosts ─partition::partition_layers→ Layout
//!      ─place::place→ Placement ─figures::stage_figures→ StageFigures
//!      ─streams::lower_streams→ Lowered (schedule::generate, lower, weight ties,
//!      tensor-parallel copies) ─verification::verify_lowered→
//!      ─simulation::simulate_plan→ Simulated ─fit::check_memory→ devices + diagnostics
//!      ─assemble::assemble→ Plan
//! ```
//!
//! [`compile`] is that list; each pass is a function from one type to the next, defined in
//! the module named for what it does, and the result is one [`CompileResult`] (the plan,
//! if any, and every diagnostic). A strategy with `auto` fields goes through the search
//! first (`crate::compile`, above both).

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::Plan;

use crate::assemble::assemble;
use crate::figures::stage_figures;
use crate::fit::check_memory;
use crate::ir::Graph;
use crate::model::cost_model;
use crate::partition::partition_layers;
use crate::place::place;
use crate::simulate::Timeline;
use crate::simulation::simulate_plan;
use crate::streams::{check_ties, clip_norm_all_reduces, eval_streams, lower_streams, tensor_parallel_copies};
use crate::verification::verify_lowered;

pub use crate::options::CompileOptions;

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

/// Compiles a checked spec whose strategy is concrete (no `auto` field: `crate::compile`
/// searches those first): the passes in order. A pass that cannot go on ends the compile
/// with its diagnostics; the memory check reports problems with the plan it built.
pub fn compile(spec: &Spec, options: &CompileOptions) -> CompileResult {
    let passes = || -> Result<(Compiled, Vec<Diagnostic>), Vec<Diagnostic>> {
        let model = cost_model(spec, options)?;
        let layout = partition_layers(spec, &model, None)?;
        let placement = place(spec, &layout, &model.cluster)?;
        check_ties(spec, &layout)?;
        let stages = stage_figures(spec, &model, &layout);
        let mut lowered = lower_streams(spec, &layout, &placement, &placement.replicas, &stages, model.precision);
        tensor_parallel_copies(&mut lowered, spec.strategy.tp.max(1));
        let whole: Vec<pipec_plan::DeviceId> =
            lowered.streams.iter().filter(|(_, s)| !s.is_empty()).map(|(d, _)| *d).collect();
        clip_norm_all_reduces(spec, &mut lowered, &whole);
        let declared = stages.declared_buckets(spec.engine.target.name);
        lowered.in_pass =
            crate::in_pass::in_pass_table(spec, &model.graph, (&layout.ranges, &declared), &placement, &lowered)?;
        if spec.training.recipe.validation.is_some() {
            lowered.eval = Some(eval_streams(spec, &placement, &stages, &lowered));
        }
        verify_lowered(spec, &placement, &lowered)?;
        let devices = model.cluster.devices();
        let simulated = simulate_plan(spec, &model, &stages, &lowered, &devices)?;
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

#[cfg(test)]
mod tests;
