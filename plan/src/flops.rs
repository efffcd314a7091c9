//! What LLM trainers report beside samples/s: tokens/s per device and model FLOPs utilization
//! (MFU) — a model's training FLOPs per token, as the engine the plan is for counts them,
//! times the tokens each device trains per second, over the device's dense matrix peak.
//!
//! Two counts, written from their formulas (no code is shared with either engine):
//! - Megatron-LM's (`num_floating_point_operations`, megatron/training/training.py at tag
//!   core_v0.19.0, lines 390–902; the standard transformer's count is `transformer_flops`,
//!   line 549): every weight matrix a token passes — the attention's projections, the MLP's
//!   (3 with SwiGLU, 2 without: line 610), the `top_k` routed experts and the shared experts of
//!   a mixture of experts (lines 579, 818), the logit layer (line 833) — at 2 FLOPs a
//!   multiply-add, times 3 for the forward, the data gradient and the weight gradient; plus the
//!   attention core, `QKᵀ` and `softmax·V` over `s/2` keys for the causal mask (line 708).
//!   Megatron-LM counts the logit layer at the vocabulary padded to a multiple of 128 × TP
//!   (`padded_vocab_size`, line 837); pipec counts the model's own vocabulary.
//! - torchtitan's (`get_dense_model_nparams_and_flops` and `get_moe_model_nparams_and_flops`,
//!   torchtitan/models/utils.py at tag v0.2.2, lines 388 and 434): 6 × the parameters except
//!   the embedding tables (a mixture of experts: its router, its shared experts and `top_k /
//!   experts` of its routed experts; lines 461–492), plus `6 · L · H · (qk + v head) · T` for
//!   the attention core over every key, the causal mask not counted (lines 413–424; Llama 3's
//!   `2 · head_dim`, models/llama3/model/args.py line 67, is the `12·L·H·Q·T` of the PaLM
//!   paper).
//!
//! MFU is quoted against the device's dense matrix peak in the training precision, bf16 for
//! FP8 runs too: torchtitan's `get_peak_flops` (torchtitan/tools/utils.py line 77) has bf16
//! figures only and its metrics line (torchtitan/components/metrics.py line 428) divides by
//! it whatever `float8` says; Megatron-Bridge's tables print model TFLOP/s per GPU, which
//! readers divide by the same bf16 peak.

use serde::{Deserialize, Serialize};

use crate::device::DeviceModel;
use crate::model::{BlockDims, Op};
use crate::vocab::{Engine, Loss, Precision};

/// Whose count of a model's training FLOPs per token a report uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlopsCount {
    /// Megatron-LM's `num_floating_point_operations`: every weight matrix, the logit layer,
    /// the attention core halved for the causal mask.
    Megatron,
    /// torchtitan's `get_nparams_and_flops`: 6 × the non-embedding parameters plus the
    /// attention core over every key.
    Torchtitan,
}

impl FlopsCount {
    /// The count the engine a plan is for reports: torchtitan's for torchtitan, Megatron-LM's
    /// for Megatron-LM, for DeepSpeed (Megatron-DeepSpeed prints Megatron's TFLOPs) and for
    /// pipec itself.
    pub fn of_engine(engine: Engine) -> FlopsCount {
        match engine {
            Engine::Torchtitan => FlopsCount::Torchtitan,
            Engine::Megatron | Engine::Deepspeed | Engine::Pipec => FlopsCount::Megatron,
        }
    }

    /// The count's name in reports and plan.json.
    pub fn name(self) -> &'static str {
        match self {
            FlopsCount::Megatron => "megatron",
            FlopsCount::Torchtitan => "torchtitan",
        }
    }

    /// What the count counts, for a report's line.
    pub fn description(self) -> &'static str {
        match self {
            FlopsCount::Megatron => {
                "Megatron-LM's count: 6 × each product's multiply-adds, logits in, causal attention halved"
            }
            FlopsCount::Torchtitan => "torchtitan's count: 6 × non-embedding parameters + 12·L·H·Q·T",
        }
    }

    /// Training FLOPs per token (forward and backward) of a model whose layers are `layers`
    /// (each operator with the embedding it is tied to) on sequences of `seq` tokens; None when
    /// a layer is one the count does not cover (a convolution or a pooling layer).
    pub fn per_token<'a>(self, layers: impl Iterator<Item = (&'a Op, Option<usize>)>, seq: usize) -> Option<f64> {
        layers.map(|(op, tied)| self.layer(op, tied, seq)).sum()
    }

    /// One layer's share of [`FlopsCount::per_token`].
    fn layer(self, op: &Op, tied: Option<usize>, seq: usize) -> Option<f64> {
        match self {
            FlopsCount::Megatron => megatron_layer(op, seq),
            FlopsCount::Torchtitan => torchtitan_layer(op, tied, seq),
        }
    }
}

/// Forward, data gradient and weight gradient (3), at 2 FLOPs a multiply-add: the factor on
/// one pass's multiply-adds (training.py lines 605 and 607).
const TRAINING_FLOPS_PER_MAC: f64 = 6.0;

/// Megatron-LM's count for one layer: a block's projections, MLPs and attention core, a
/// linear layer's (the logits') product; nothing for embeddings, norms and activations.
fn megatron_layer(op: &Op, seq: usize) -> Option<f64> {
    let six = TRAINING_FLOPS_PER_MAC;
    match *op {
        Op::TransformerBlock { .. } => {
            let b = op.block_dims()?;
            let projections: f64 = b.projections().iter().map(|p| p.input as f64 * p.output as f64).sum();
            let mlps = b.moe.map_or(1, |m| m.active_experts()) as f64;
            let mlp = mlps * (b.d as f64 * b.up_width as f64 + b.ff as f64 * b.d as f64);
            Some(six * (projections + mlp) + attention_core(&b, b.computed_keys(seq)))
        }
        Op::Linear { in_features, out_features, .. } => Some(six * in_features as f64 * out_features as f64),
        // the weight matrices an LSTM step multiplies, once per token
        Op::Lstm { .. } => Some(six * op.parameter_count() as f64),
        Op::Embedding { .. }
        | Op::PosEmbedding { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::Add { .. }
        | Op::Concat { .. }
        | crate::model::sizeless!() => Some(0.0),
        Op::Conv2d { .. }
        | Op::MaxPool2d { .. }
        | Op::AvgPool2d { .. }
        | Op::AdaptiveAvgPool2d { .. }
        | Op::BatchNorm2d { .. } => None,
    }
}

/// torchtitan's count for one layer: 6 × its parameters (a mixture of experts' active ones; an
/// embedding table and a weight tied to one not at all), plus a block's attention core over
/// every key.
fn torchtitan_layer(op: &Op, tied: Option<usize>, seq: usize) -> Option<f64> {
    let weights = match op {
        Op::Embedding { .. } | Op::PosEmbedding { .. } => 0.0,
        _ if tied.is_some() => 0.0,
        _ => TRAINING_FLOPS_PER_MAC * op.active_parameter_count() as f64,
    };
    let core = op.block_dims().map_or(0.0, |b| attention_core(&b, seq as f64));
    Some(weights + core)
}

/// The attention core's training FLOPs per token over `keys` keys per query: `QKᵀ` over the
/// query/key heads and `softmax·V` over the value heads, 6 FLOPs a multiply-add.
fn attention_core(b: &BlockDims, keys: f64) -> f64 {
    TRAINING_FLOPS_PER_MAC * (b.q_width as f64 + b.attention_width as f64) * keys
}

/// A language model's tokens per sample: its sequence length when it maps a [sequence] of
/// token ids to next-token scores [sequence, vocab] under cross-entropy; None for any other
/// model (then only samples/s is reported).
pub fn language_model_tokens(input: &[usize], output: &[usize], vocab: Option<usize>, loss: Loss) -> Option<usize> {
    if loss != Loss::CrossEntropy {
        return None;
    }
    crate::model::language_model_positions(input, output, vocab)
}

/// The peak MFU is quoted against: a device's dense matrix rate in the precision its values
/// train in (bf16 for FP8 training, whose non-FP8 work runs in bf16), and what it is, for the
/// report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peak {
    /// FLOP/s per device.
    pub flops_per_s: f64,
    /// The device model's name (a preset's, a spec's `kind`, a device file's).
    pub device: String,
    pub precision: Precision,
}

impl Peak {
    /// `device`'s peak for training in `precision`.
    pub fn of(device: &DeviceModel, precision: Precision) -> Peak {
        Peak { flops_per_s: device.matrix.of(precision), device: device.name.clone(), precision }
    }

    /// Whether the device model describes a CPU: a spec's `kind: cpu`, or a device file `pipec
    /// calibrate` measured on the CPU backend (named `cpu (pipec calibrate…)`).
    pub fn is_cpu(&self) -> bool {
        crate::device::names_a_cpu(&self.device)
    }

    /// "989.4 TFLOP/s, h100-sxm's dense bf16 peak".
    pub fn text(&self) -> String {
        format!("{}, {}'s dense {} peak", flop_rate(self.flops_per_s), self.device, self.precision)
    }
}

/// A rate in FLOP/s with an SI prefix: `989.4 TFLOP/s`, `40.0 GFLOP/s`.
pub fn flop_rate(r: f64) -> String {
    format!("{}FLOP/s", si(r))
}

/// A count with an SI prefix and one decimal: `51.5 G`.
fn si(v: f64) -> String {
    let prefixes = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    match prefixes.iter().find(|(scale, _)| v.abs() >= *scale) {
        Some((scale, p)) => format!("{:.1} {p}", v / scale),
        None => format!("{v:.1} "),
    }
}

/// Model FLOPs utilization of a step: the model's training FLOPs per token (one count) times
/// the tokens each device trains per second, over the device's peak.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mfu {
    /// The share of the peak, in [0, ∞) (past 1 the prediction or the peak is wrong).
    pub fraction: f64,
    pub formula: FlopsCount,
    /// Training FLOPs per token under `formula`.
    pub flops_per_token: f64,
    pub peak: Peak,
}

impl Mfu {
    /// "MFU 41.2% (Megatron-LM's count: …, 51.5 GFLOP per token; of 989.4 TFLOP/s, h100-sxm's
    /// dense bf16 peak)".
    pub fn text(&self) -> String {
        format!("MFU {:.1}% ({})", self.fraction * 100.0, self.basis_text())
    }

    /// What the fraction counts: "Megatron-LM's count: …, 51.5 GFLOP per token; of 989.4
    /// TFLOP/s, h100-sxm's dense bf16 peak".
    pub fn basis_text(&self) -> String {
        format!("{}, {}FLOP per token; of {}", self.formula.description(), si(self.flops_per_token), self.peak.text())
    }
}

/// What turns a step's time into tokens/s per device and MFU for one model on one cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Utilization {
    /// Tokens each sample trains (the sequence length).
    pub tokens_per_sample: usize,
    /// The devices the step runs on.
    pub devices: usize,
    pub formula: FlopsCount,
    /// None when the count does not cover a layer of the model.
    pub flops_per_token: Option<f64>,
    /// None when the peak of the device that ran is not known.
    pub peak: Option<Peak>,
}

impl Utilization {
    /// The basis for a language model of `layers` (each operator with the embedding it is
    /// tied to) training `tokens_per_sample` tokens a sample on `devices` devices of `peak`,
    /// by the count `engine` reports.
    pub fn of_model<'a>(
        layers: impl Iterator<Item = (&'a Op, Option<usize>)>,
        tokens_per_sample: usize,
        engine: Engine,
        devices: usize,
        peak: Option<Peak>,
    ) -> Utilization {
        let formula = FlopsCount::of_engine(engine);
        let flops_per_token = formula.per_token(layers, tokens_per_sample);
        Utilization { tokens_per_sample, devices, formula, flops_per_token, peak }
    }

    /// Tokens per second per device at `samples_per_s`.
    pub fn tokens_per_s_per_device(&self, samples_per_s: f64) -> f64 {
        samples_per_s * self.tokens_per_sample as f64 / self.devices.max(1) as f64
    }

    /// MFU at `samples_per_s`; None without a FLOP count or a peak.
    pub fn mfu(&self, samples_per_s: f64) -> Option<Mfu> {
        let (flops_per_token, peak) = (self.flops_per_token?, self.peak.clone()?);
        let achieved = flops_per_token * self.tokens_per_s_per_device(samples_per_s);
        let fraction = if peak.flops_per_s > 0.0 { achieved / peak.flops_per_s } else { 0.0 };
        Some(Mfu { fraction, formula: self.formula, flops_per_token, peak })
    }
}

#[cfg(test)]
mod tests;
