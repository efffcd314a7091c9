//! The model and training features a plan uses that not every engine runs: today's attention
//! shapes, FP8 products, recompute by module or operation, activation offload. The compiler
//! plans and prices them all; `pipec run` reads this list from the plan before training and
//! refuses (or, for FP8, trains in bf16 and says so) what pipec's executor does not run, so
//! a plan never trains as something other than what it says without a word.

use std::fmt;

use crate::model::Op;
use crate::Plan;

/// One feature a plan can use beyond what every engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Feature {
    /// A transformer block's heads of a size other than d/heads (`head_dim=`).
    HeadSize,
    /// Query/key norms (`qk_norm=true`).
    QkNorm,
    /// Sliding-window attention (`window=`).
    SlidingWindow,
    /// Attention sinks (`sinks=true`).
    AttentionSinks,
    /// Multi-head latent attention (`kv_lora=`).
    LatentAttention,
    /// Dropout inside a transformer block (`dropout=`).
    BlockDropout,
    /// DeepSeek-V3's expert bias in the routing (`expert_bias=true`).
    ExpertBias,
    /// Recompute inside the blocks other than selective recompute's attention core
    /// (`recompute: { modules | ops }`).
    ModuleRecompute,
    /// The first blocks of every stage recomputed whole (`recompute: { layers: n }`).
    LayerRecompute,
    /// Activation offload (`recompute: { offload: true }`).
    ActivationOffload,
    /// FP8 products (`precision: fp8`).
    Fp8,
    /// Optimizer moments in a precision other than fp32 (`optimizer.state_precision`).
    OptimizerStatePrecision,
    /// A bf16 or fp16 model's weights kept without an fp32 master copy
    /// (`optimizer.master_weights: false`).
    NoMasterWeights,
    /// Routed experts whole on each device beside tensor parallelism (`etp: 1`).
    WholeExperts,
    /// DeepSeek-V3's multi-token prediction (`model.mtp`).
    MultiTokenPrediction,
}

impl Feature {
    /// Every feature, in documentation order.
    pub const ALL: &'static [Feature] = &[
        Feature::HeadSize,
        Feature::QkNorm,
        Feature::SlidingWindow,
        Feature::AttentionSinks,
        Feature::LatentAttention,
        Feature::BlockDropout,
        Feature::ExpertBias,
        Feature::ModuleRecompute,
        Feature::LayerRecompute,
        Feature::ActivationOffload,
        Feature::Fp8,
        Feature::OptimizerStatePrecision,
        Feature::NoMasterWeights,
        Feature::WholeExperts,
        Feature::MultiTokenPrediction,
    ];

    /// How a spec writes it, for messages.
    pub fn written(self) -> &'static str {
        match self {
            Feature::HeadSize => "a head size other than d/heads (`head_dim=`)",
            Feature::QkNorm => "query/key norms (`qk_norm=true`)",
            Feature::SlidingWindow => "sliding-window attention (`window=`)",
            Feature::AttentionSinks => "attention sinks (`sinks=true`)",
            Feature::LatentAttention => "multi-head latent attention (`kv_lora=`)",
            Feature::BlockDropout => "dropout inside a transformer block (`dropout=`)",
            Feature::ExpertBias => "an expert bias in the routing (`expert_bias=true`)",
            Feature::ModuleRecompute => {
                "recompute by module or operation inside the blocks (`recompute: { modules | ops }`)"
            }
            Feature::LayerRecompute => "the first blocks of every stage recomputed whole (`recompute: { layers: n }`)",
            Feature::ActivationOffload => "activation offload (`recompute: { offload: true }`)",
            Feature::Fp8 => "FP8 products (`precision: fp8`)",
            Feature::OptimizerStatePrecision => "optimizer moments below fp32 (`optimizer.state_precision`)",
            Feature::NoMasterWeights => "weights without an fp32 master copy (`optimizer.master_weights: false`)",
            Feature::WholeExperts => "experts whole beside tensor parallelism (`etp: 1`)",
            Feature::MultiTokenPrediction => "multi-token prediction (`model.mtp`)",
        }
    }

    /// The features one operator uses.
    pub fn of_op(op: &Op) -> Vec<Feature> {
        let Op::TransformerBlock { d_model, heads, head_dim, qk_norm, window, sinks, mla, dropout, moe, .. } = *op
        else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if head_dim != 0 && head_dim.saturating_mul(heads) != d_model {
            out.push(Feature::HeadSize);
        }
        if qk_norm {
            out.push(Feature::QkNorm);
        }
        if window > 0 {
            out.push(Feature::SlidingWindow);
        }
        if sinks {
            out.push(Feature::AttentionSinks);
        }
        if mla.is_some() {
            out.push(Feature::LatentAttention);
        }
        if dropout > 0.0 {
            out.push(Feature::BlockDropout);
        }
        if moe.is_some_and(|m| m.expert_bias) {
            out.push(Feature::ExpertBias);
        }
        out
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.written())
    }
}

/// The features a plan uses, each once, with the first layer (if any) that uses it.
pub fn used(plan: &Plan) -> Vec<(Feature, Option<usize>)> {
    let mut out: Vec<(Feature, Option<usize>)> = Vec::new();
    if plan.training.fp8.is_some() {
        out.push((Feature::Fp8, None));
    }
    if plan.training.state_precision != crate::Precision::Fp32 {
        out.push((Feature::OptimizerStatePrecision, None));
    }
    if !plan.training.master_weights {
        out.push((Feature::NoMasterWeights, None));
    }
    if plan.schedule.whole_experts {
        out.push((Feature::WholeExperts, None));
    }
    if plan.model.mtp.is_some() {
        out.push((Feature::MultiTokenPrediction, None));
    }
    if let Some(b) = &plan.schedule.block_recompute {
        // `{ modules: [core_attn] }` alone is selective recompute
        let selective = b.modules == [crate::vocab::RecomputeModule::CoreAttn] && b.ops.is_empty();
        if !selective && (!b.modules.is_empty() || !b.ops.is_empty()) {
            out.push((Feature::ModuleRecompute, None));
        }
        if b.layers > 0 {
            out.push((Feature::LayerRecompute, None));
        }
        if b.offload {
            out.push((Feature::ActivationOffload, None));
        }
    }
    for layer in &plan.layers {
        for f in Feature::of_op(&layer.op) {
            if !out.iter().any(|(g, _)| *g == f) {
                out.push((f, Some(layer.index)));
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_names_each_attention_feature_it_uses_once() {
        assert!(Feature::of_op(&Op::llama_block(4096, 32, 8, 14336)).is_empty());
        let mut op = Op::llama_block(2048, 32, 4, 768);
        if let Op::TransformerBlock { head_dim, qk_norm, window, sinks, .. } = &mut op {
            (*head_dim, *qk_norm, *window, *sinks) = (128, true, 128, true);
        }
        assert_eq!(
            Feature::of_op(&op),
            [Feature::HeadSize, Feature::QkNorm, Feature::SlidingWindow, Feature::AttentionSinks]
        );
        // head_dim written as d/heads is the standard shape
        if let Op::TransformerBlock { head_dim, .. } = &mut op {
            *head_dim = 64;
        }
        assert!(!Feature::of_op(&op).contains(&Feature::HeadSize));
        // DeepSeek's expert bias; its groups and scaled weights run everywhere
        let mut moe = Op::llama_block(2048, 32, 4, 768);
        if let Op::TransformerBlock { moe: m, .. } = &mut moe {
            *m = Some(crate::model::Moe {
                shared: 1,
                router: crate::model::Router::Sigmoid,
                scale: 2.5,
                groups: 4,
                group_top: 2,
                expert_bias: true,
                ..crate::model::Moe::new(8, 4)
            });
        }
        assert_eq!(Feature::of_op(&moe), [Feature::ExpertBias]);
        assert_eq!(Feature::ALL.len(), 15);
    }
}
