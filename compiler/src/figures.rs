//! Per-stage figures: compute times, messages and bytes held: `Layout` → `StageFigures`.

use pipec_grammar::spec::Spec;
use pipec_plan::model::Source;

use crate::memory::StageBytes;
use crate::model::ModelCosts;
use crate::partition::Layout;

/// Per-stage figures: compute times, messages, bytes held.
pub(crate) struct StageFigures {
    /// (forward, backward) seconds per microbatch.
    pub(crate) times: Vec<(f64, f64)>,
    /// Seconds of one optimizer update of the stage's parameters (on one tensor-parallel rank).
    pub(crate) update: Vec<f64>,
    /// Output bytes per microbatch (what goes to the next stage).
    pub(crate) output_bytes: Vec<u64>,
    pub(crate) bytes: Vec<StageBytes>,
}

/// Stage figures: `Layout` → `StageFigures`.
pub(crate) fn stage_figures(spec: &Spec, model: &ModelCosts, layout: &Layout) -> StageFigures {
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
