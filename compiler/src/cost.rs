//! The cost model: per operator parameters, FLOPs, bytes kept for the backward and output
//! bytes; time = FLOPs / device throughput unless a measured profile replaces it.
//!
//! Activation accounting follows what autograd keeps: the input of every operator with
//! weights or a non-linearity, a one-byte mask for dropout, nothing for `flatten`; for a
//! transformer block the per-layer accounting of Korthikanti et al. 2022,
//! 34·s·h + 5·a·s² bytes per sample at 16-bit, scaled to the spec's precision.

use pipec_plan::model::Op;

use crate::ir::{Graph, OpNode};

/// What one layer costs, per microbatch of `microbatch_size` samples.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCost {
    pub forward_flops_per_sample: f64,
    pub backward_flops_per_sample: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    /// One optimizer update of the layer's parameters. The analytic model leaves it at 0
    /// (memory-bound work the spec's FLOP rate says nothing about, and the closed forms of
    /// the schedules have no term for it); a profile measures it.
    pub update_s: f64,
    pub parameters: u64,
    pub parameter_bytes: u64,
    /// Bytes kept for the backward, per sample.
    pub activation_bytes_per_sample: u64,
    /// Bytes of the output, per sample.
    pub output_bytes_per_sample: u64,
}

fn numel(shape: &[usize]) -> f64 {
    shape.iter().product::<usize>() as f64
}

/// Forward FLOPs per sample.
pub fn forward_flops(node: &OpNode) -> f64 {
    let out = numel(&node.output_shape);
    let inp = numel(&node.input_shape);
    match node.op {
        Op::Linear { in_features, out_features, bias } => {
            let rows = inp / in_features as f64;
            rows * (2.0 * in_features as f64 * out_features as f64 + if bias { out_features as f64 } else { 0.0 })
        }
        Op::Conv2d { in_channels, kernel, .. } => out * 2.0 * in_channels as f64 * (kernel * kernel) as f64,
        Op::MaxPool2d { kernel, .. } | Op::AvgPool2d { kernel, .. } => out * (kernel * kernel) as f64,
        // every input element is summed once into its window's average
        Op::AdaptiveAvgPool2d { .. } => inp,
        // mean, variance, normalise, scale and shift
        Op::BatchNorm2d { .. } => 5.0 * inp,
        Op::Add { inputs } => (inputs.saturating_sub(1)) as f64 * out,
        Op::Flatten | Op::Concat { .. } => 0.0,
        Op::Relu | Op::Dropout { .. } => inp,
        Op::Gelu | Op::Tanh | Op::Sigmoid => 8.0 * inp,
        Op::LayerNorm { .. } => 5.0 * inp,
        Op::Embedding { .. } => out,
        Op::PosEmbedding { .. } => inp,
        Op::Lstm { input, hidden } => {
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            let (i, h) = (input as f64, hidden as f64);
            // per step: the gate pre-activations x·W_ih + h·W_hh (+ two biases), then the
            // gates' non-linearities and the cell and hidden updates (~30 per hidden unit)
            s * (2.0 * 4.0 * h * (i + h) + 2.0 * 4.0 * h + 30.0 * h)
        }
        Op::TransformerBlock { d_model, d_ff, .. } => {
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            let d = d_model as f64;
            let f = d_ff as f64;
            // QKV and output projections 8·s·d², scores and weighted sum 4·s²·d, MLP 4·s·d·f
            8.0 * s * d * d + 4.0 * s * s * d + 4.0 * s * d * f
        }
    }
}

/// Backward FLOPs per sample: input gradient plus weight gradient for operators with
/// weights (2× forward), the input gradient alone otherwise (1× forward).
pub fn backward_flops(node: &OpNode) -> f64 {
    let f = forward_flops(node);
    if node.op.parameter_count() > 0 && !matches!(node.op, Op::Embedding { .. }) {
        2.0 * f
    } else {
        f
    }
}

/// Bytes kept for the backward, per sample.
pub fn activation_bytes(node: &OpNode, precision_bytes: usize) -> u64 {
    let p = precision_bytes as f64;
    let inp = numel(&node.input_shape);
    let bytes = match node.op {
        // the gradient passes through unchanged (add) or is sliced (concat, flatten)
        Op::Flatten | Op::Add { .. } | Op::Concat { .. } | Op::AdaptiveAvgPool2d { .. } => 0.0,
        // the table's gradient is the output gradient itself
        Op::PosEmbedding { .. } => 0.0,
        // per step: the input, the four gates, the cell state and its tanh, the hidden state
        Op::Lstm { input, hidden } => {
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            s * (input as f64 + 7.0 * hidden as f64) * p
        }
        Op::Dropout { .. } => inp,         // one-byte mask
        Op::Embedding { .. } => inp * 8.0, // token ids
        Op::TransformerBlock { d_model, heads, .. } => {
            let s = node.input_shape.first().copied().unwrap_or(1) as f64;
            (34.0 * s * d_model as f64 + 5.0 * heads as f64 * s * s) * p / 2.0
        }
        _ => inp * p,
    };
    bytes as u64
}

/// Costs every layer of the graph analytically.
pub fn analytic_costs(graph: &Graph, throughput: f64, overhead: f64, microbatch_size: usize) -> Vec<LayerCost> {
    let p = graph.precision_bytes;
    graph
        .ops()
        .map(|(_, node)| {
            let ff = forward_flops(node);
            let bf = backward_flops(node);
            let params = node.op.parameter_count();
            LayerCost {
                forward_flops_per_sample: ff,
                backward_flops_per_sample: bf,
                forward_s: ff * microbatch_size as f64 / throughput + overhead,
                backward_s: bf * microbatch_size as f64 / throughput + 2.0 * overhead,
                update_s: 0.0,
                parameters: params,
                parameter_bytes: params * p as u64,
                activation_bytes_per_sample: activation_bytes(node, p),
                output_bytes_per_sample: (numel(&node.output_shape) * p as f64) as u64,
            }
        })
        .collect()
}

pub use pipec_plan::profile::{Profile, ProfiledLayer};

/// Applying a measured profile to the analytic costs.
pub trait ApplyProfile {
    /// Replaces analytic costs with measured ones, passes scaled linearly to the microbatch
    /// size.
    fn apply(&self, costs: &mut [LayerCost], microbatch_size: usize) -> Result<(), String>;
}

impl ApplyProfile for Profile {
    fn apply(&self, costs: &mut [LayerCost], microbatch_size: usize) -> Result<(), String> {
        if self.layers.len() != costs.len() {
            return Err(format!("the profile has {} layers, the model has {}", self.layers.len(), costs.len()));
        }
        self.check()?;
        let scale = microbatch_size as f64 / self.batch_size as f64;
        for (c, l) in costs.iter_mut().zip(&self.layers) {
            c.forward_s = l.forward_ms / 1e3 * scale;
            c.backward_s = l.backward_ms / 1e3 * scale;
            // an update's work depends on the parameters, not on the microbatch
            c.update_s = l.update_ms / 1e3;
            c.activation_bytes_per_sample = l.activation_bytes / self.batch_size as u64;
            c.output_bytes_per_sample = l.output_bytes / self.batch_size as u64;
            c.parameter_bytes = l.parameter_bytes;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_plan::model::Source;

    fn node(op: Op, input: Vec<usize>) -> OpNode {
        let output = op.output_shape(&input).expect("valid shape");
        OpNode { op, label: None, inputs: vec![Source::Input], input_shape: input, output_shape: output, tied: None }
    }

    #[test]
    fn graph_layers_flops_and_activations() {
        // batch norm on [64, 56, 56]: 5 FLOPs per element forward (mean, variance,
        // normalise, scale, shift), twice that backward (it has weights); keeps its input
        let bn = node(Op::BatchNorm2d { channels: 64 }, vec![64, 56, 56]);
        let elems = 64.0 * 56.0 * 56.0;
        assert_eq!(forward_flops(&bn), 5.0 * elems);
        assert_eq!(backward_flops(&bn), 10.0 * elems);
        assert_eq!(activation_bytes(&bn, 4), 64 * 56 * 56 * 4);
        // a residual add of two [256, 56, 56] tensors: one add per element, nothing kept
        let add = node(Op::Add { inputs: 2 }, vec![256, 56, 56]);
        assert_eq!(forward_flops(&add), 256.0 * 56.0 * 56.0);
        assert_eq!(backward_flops(&add), 256.0 * 56.0 * 56.0);
        assert_eq!(activation_bytes(&add, 4), 0);
        // concat only moves memory; global average pooling sums every input element once
        let cat = node(Op::Concat { inputs: 4 }, vec![64, 28, 28]);
        assert_eq!((forward_flops(&cat), activation_bytes(&cat, 4)), (0.0, 0));
        let gap = node(Op::AdaptiveAvgPool2d { size: 1 }, vec![2048, 7, 7]);
        assert_eq!((forward_flops(&gap), activation_bytes(&gap, 4)), (2048.0 * 49.0, 0));
        // a padded 3x3/2 max pool on [64, 112, 112]: 9 comparisons per output element
        let pool = node(Op::MaxPool2d { kernel: 3, stride: 2, padding: 1 }, vec![64, 112, 112]);
        assert_eq!(forward_flops(&pool), 9.0 * 64.0 * 56.0 * 56.0);
    }

    #[test]
    fn language_model_layers_flops_and_activations() {
        // an LSTM step on [70, 400] → 1150: the gates' two matrix products (2·4h·(in + h)),
        // their biases (2·4h), ~30 element-wise operations per hidden unit; it keeps the
        // input, the four gates, the cell state, its tanh and the hidden state per step
        let lstm = node(Op::Lstm { input: 400, hidden: 1150 }, vec![70, 400]);
        let per_step = 2.0 * 4.0 * 1150.0 * (400.0 + 1150.0) + 2.0 * 4.0 * 1150.0 + 30.0 * 1150.0;
        assert_eq!(forward_flops(&lstm), 70.0 * per_step);
        assert_eq!(backward_flops(&lstm), 2.0 * 70.0 * per_step);
        assert_eq!(activation_bytes(&lstm, 2), 70 * (400 + 7 * 1150) * 2);
        // a positional embedding adds its table: one FLOP per element, nothing kept
        let pos = node(Op::PosEmbedding { max_len: 1024, dim: 768 }, vec![1024, 768]);
        assert_eq!((forward_flops(&pos), activation_bytes(&pos, 2)), (1024.0 * 768.0, 0));
        // GPT-2's output layer on 1024 positions: 2·768·50257 FLOPs per position
        let head = node(Op::Linear { in_features: 768, out_features: 50257, bias: false }, vec![1024, 768]);
        assert_eq!(forward_flops(&head), 1024.0 * 2.0 * 768.0 * 50257.0);
    }

    #[test]
    fn linear_flops_and_activations() {
        let n = node(Op::Linear { in_features: 1024, out_features: 1024, bias: false }, vec![1024]);
        assert_eq!(forward_flops(&n), 2.0 * 1024.0 * 1024.0);
        assert_eq!(backward_flops(&n), 4.0 * 1024.0 * 1024.0);
        assert_eq!(activation_bytes(&n, 4), 4096);
    }

    #[test]
    fn transformer_activations_follow_korthikanti() {
        // s = 512, h = 1024, a = 16 at 16-bit: 34·s·h + 5·a·s² bytes per sample
        let n = node(Op::TransformerBlock { d_model: 1024, heads: 16, d_ff: 4096, causal: false }, vec![512, 1024]);
        assert_eq!(activation_bytes(&n, 2), 34 * 512 * 1024 + 5 * 16 * 512 * 512);
        assert_eq!(activation_bytes(&n, 4), 2 * (34 * 512 * 1024 + 5 * 16 * 512 * 512));
    }
}
