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

/// How ZeRO-3 gathers an operator's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Zero3Gather {
    /// Each product gathers its own weight (`crate::parallel::zero::per_product`) unless the layer is tied.
    PerProduct,
    /// With the stage, for its passes; `large`: a weight of the model's size class (a
    /// convolution's, a positional table), which `pipec run`'s caveats (lib.rs) names.
    WithStage { large: bool },
    /// No weights.
    Nothing,
}

/// The one table of how ZeRO-3 gathers each operator's weights: a new operator is a
/// compile error here until it says.
pub(crate) fn zero3_gather(op: &pipec_plan::model::Op) -> Zero3Gather {
    use pipec_plan::model::Op;
    match op {
        Op::Linear { .. } | Op::Embedding { .. } | Op::Lstm { .. } => Zero3Gather::PerProduct,
        // a mixture of experts' tokens decide which experts run: its gathers would not pair
        Op::TransformerBlock { moe: None, .. } => Zero3Gather::PerProduct,
        Op::TransformerBlock { moe: Some(_), .. } => Zero3Gather::WithStage { large: true },
        Op::Conv2d { .. } | Op::PosEmbedding { .. } => Zero3Gather::WithStage { large: true },
        Op::BatchNorm2d { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => Zero3Gather::WithStage { large: false },
        Op::MaxPool2d { .. }
        | Op::AvgPool2d { .. }
        | Op::AdaptiveAvgPool2d { .. }
        | Op::Add { .. }
        | Op::Concat { .. }
        | Op::Flatten
        | Op::Relu
        | Op::Gelu
        | Op::Tanh
        | Op::Sigmoid
        | Op::Dropout { .. }
        | Op::SeqPool { .. }
        | Op::GeluTanh => Zero3Gather::Nothing,
    }
}
