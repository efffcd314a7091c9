//! pipec's compiler: from a checked spec to a verified, simulated plan. One module per
//! phase; [`compile::compile`] lists the passes in order.

pub mod activations;
pub mod assemble;
pub mod block_cost;
pub mod bound;
pub mod cluster;
pub mod compile;
pub mod cost;
pub mod fidelity;
pub mod figures;
pub mod fit;
pub mod in_pass;
pub mod ir;
pub mod kernels;
pub mod lower;
pub mod memory;
pub mod model;
pub mod options;
pub mod partition;
pub mod periodic;
pub mod pipedream;
pub mod place;
pub mod plan_cost;
pub mod predict;
pub mod render;
pub mod schedule;
pub mod search;
pub mod simulate;
pub mod simulation;
pub mod streams;
pub mod verification;
pub mod verify;

pub use compile::{CompileResult, Compiled};
pub use options::CompileOptions;

use pipec_grammar::spec::Spec;

/// Compiles a checked spec: a strategy with `auto` fields is searched first and the winner
/// compiled (`search::compile_auto`); a concrete one goes straight through the passes
/// (`compile::compile`). The one entry point, above both.
/// What compiling a checked spec would report without running the strategy search or
/// building the whole plan (`pipec check` and the editor add it to the front end's): the
/// partition's, placement's and weight ties' errors (E0411), and the memory check's E0601
/// and W0602 and the bubble's W0605, from one pipeline replica of a symmetric plan
/// (`predict::predict`). Empty for a strategy with `auto` fields (only a search decides
/// those).
pub fn check_plan(spec: &Spec, options: &CompileOptions) -> Vec<pipec_grammar::diagnostic::Diagnostic> {
    if spec.strategy.auto.is_some() {
        return Vec::new();
    }
    let predicted = |spec: &Spec| match predict::predict(spec, options, &mut bound::Memo::default()) {
        Ok(f) => f.diagnostics,
        Err(d) => d,
    };
    // `precision: auto`: the diagnostics of the roomier precision (bf16's unless FP8's plan
    // fits where bf16's does not, or keeps the headroom where bf16's does not), as
    // `compile` chooses
    use search::room;
    match search::precision_choices(spec) {
        (Some(fp8), _) => {
            let bf16 = predicted(&search::with_precision(spec, None));
            if room(&bf16) == 2 {
                return bf16;
            }
            let fp8 = predicted(&search::with_precision(spec, Some(fp8)));
            if room(&fp8) > room(&bf16) {
                fp8
            } else {
                bf16
            }
        }
        (None, _) => predicted(spec),
    }
}

pub fn compile(spec: &Spec, options: &CompileOptions) -> CompileResult {
    match &spec.strategy.auto {
        Some(auto) => search::compile_auto(spec, options, auto),
        // a written strategy beside `precision: auto`: compiled in each precision
        None if spec.training.precision_search.is_some() => search::compile_precision(spec, options),
        None => compile::compile(spec, options),
    }
}
