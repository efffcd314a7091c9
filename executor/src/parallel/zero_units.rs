//! Which operators' weights ZeRO-3 gathers per product, with the stage, or not at all: one
//! table over every operator.

use pipec_plan::Plan;

/// Whether plan layer `layer`'s weights are of the kinds ZeRO-3 gathers per product
/// (`crate::parallel::zero::per_product`): a linear layer, a token embedding, an LSTM or a transformer block
/// without experts, and neither end of a tie (a tied layer nor the table another is tied
/// to). The one statement of that rule: the executor's layout and `pipec run`'s caveat
/// both read it.
pub(crate) fn gathers_per_product(plan: &Plan, layer: usize) -> bool {
    let Some(l) = plan.layers.get(layer) else { return false };
    let tied = l.tied.is_some() || plan.layers.iter().any(|t| t.tied == Some(layer));
    !tied && zero3_gather(&l.op) == Zero3Gather::PerProduct
}

pub(crate) use pipec_plan::in_pass::{zero3_gather, Zero3Gather};
