//! The operator vocabulary shared by every phase: what a layer is, its shape rule and its
//! parameters. The front end resolves DSL calls into [`Op`]s, the compiler costs them and the
//! executor builds Burn modules from them.

use serde::{Deserialize, Serialize};

/// One operator of the model, with all its hyper-parameters resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    Linear {
        in_features: usize,
        out_features: usize,
        bias: bool,
    },
    Conv2d {
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        bias: bool,
    },
    MaxPool2d {
        kernel: usize,
        stride: usize,
    },
    AvgPool2d {
        kernel: usize,
        stride: usize,
    },
    Flatten,
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    /// Layer normalisation over the last dimension (`dim` features).
    LayerNorm {
        dim: usize,
    },
    Dropout {
        p: f64,
    },
    Embedding {
        vocab: usize,
        dim: usize,
    },
    /// Pre-norm transformer block: LN → multi-head self-attention → residual → LN → MLP → residual.
    TransformerBlock {
        d_model: usize,
        heads: usize,
        d_ff: usize,
    },
}

/// Why an operator cannot take an input shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ShapeError {
    pub message: String,
    /// Index into the call's arguments that the mismatch is about, if any.
    pub argument: Option<usize>,
}

fn shape_err(message: String, argument: Option<usize>) -> ShapeError {
    ShapeError { message, argument }
}

/// Renders a per-sample shape as `[3, 32, 32]`.
pub fn fmt_shape(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(ToString::to_string).collect();
    format!("[{}]", parts.join(", "))
}

impl Op {
    /// The operator's DSL name.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Linear { .. } => "linear",
            Op::Conv2d { .. } => "conv2d",
            Op::MaxPool2d { .. } => "maxpool2d",
            Op::AvgPool2d { .. } => "avgpool2d",
            Op::Flatten => "flatten",
            Op::Relu => "relu",
            Op::Gelu => "gelu",
            Op::Tanh => "tanh",
            Op::Sigmoid => "sigmoid",
            Op::LayerNorm { .. } => "layernorm",
            Op::Dropout { .. } => "dropout",
            Op::Embedding { .. } => "embedding",
            Op::TransformerBlock { .. } => "transformer_block",
        }
    }

    /// The per-sample output shape for a per-sample input shape (batch dimension excluded).
    pub fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, ShapeError> {
        match *self {
            Op::Linear { in_features, out_features, .. } => match input.last() {
                Some(&d) if d == in_features => {
                    let mut out = input.to_vec();
                    if let Some(last) = out.last_mut() {
                        *last = out_features;
                    }
                    Ok(out)
                }
                Some(&d) => Err(shape_err(
                    format!("linear expects {in_features} input features but its input {} has {d}", fmt_shape(input)),
                    Some(0),
                )),
                None => Err(shape_err("linear needs an input with at least one dimension".into(), None)),
            },
            Op::Conv2d { in_channels, out_channels, kernel, stride, padding, .. } => {
                let [c, h, w] = input else {
                    return Err(shape_err(
                        format!("conv2d expects a [channels, height, width] input, got {}", fmt_shape(input)),
                        None,
                    ));
                };
                if *c != in_channels {
                    return Err(shape_err(
                        format!(
                            "conv2d expects {in_channels} input channels but its input {} has {c}",
                            fmt_shape(input)
                        ),
                        Some(0),
                    ));
                }
                let out = |x: usize| (x + 2 * padding).checked_sub(kernel).map(|v| v / stride.max(1) + 1);
                match (out(*h), out(*w)) {
                    (Some(oh), Some(ow)) if oh > 0 && ow > 0 => Ok(vec![out_channels, oh, ow]),
                    _ => Err(shape_err(
                        format!("conv2d kernel {kernel} is larger than its padded input {}", fmt_shape(input)),
                        Some(2),
                    )),
                }
            }
            Op::MaxPool2d { kernel, stride } | Op::AvgPool2d { kernel, stride } => {
                let [c, h, w] = input else {
                    return Err(shape_err(
                        format!("{} expects a [channels, height, width] input, got {}", self.name(), fmt_shape(input)),
                        None,
                    ));
                };
                if kernel == 0 || *h < kernel || *w < kernel {
                    return Err(shape_err(
                        format!("{} window {kernel} does not fit its input {}", self.name(), fmt_shape(input)),
                        Some(0),
                    ));
                }
                let s = stride.max(1);
                Ok(vec![*c, (h - kernel) / s + 1, (w - kernel) / s + 1])
            }
            Op::Flatten => Ok(vec![input.iter().product()]),
            Op::Relu | Op::Gelu | Op::Tanh | Op::Sigmoid | Op::Dropout { .. } => Ok(input.to_vec()),
            Op::LayerNorm { dim } => match input.last() {
                Some(&d) if d == dim => Ok(input.to_vec()),
                Some(&d) => Err(shape_err(
                    format!("layernorm normalises {dim} features but its input {} has {d}", fmt_shape(input)),
                    Some(0),
                )),
                None => Err(shape_err("layernorm needs an input with at least one dimension".into(), None)),
            },
            Op::Embedding { dim, .. } => match input {
                [seq] => Ok(vec![*seq, dim]),
                _ => Err(shape_err(
                    format!("embedding expects a [sequence] of token ids, got {}", fmt_shape(input)),
                    None,
                )),
            },
            Op::TransformerBlock { d_model, heads, .. } => match input {
                [_, d] if *d == d_model => {
                    if heads == 0 || d_model % heads != 0 {
                        Err(shape_err(format!("d={d_model} is not divisible by heads={heads}"), Some(1)))
                    } else {
                        Ok(input.to_vec())
                    }
                }
                _ => Err(shape_err(
                    format!("transformer_block expects a [sequence, {d_model}] input, got {}", fmt_shape(input)),
                    Some(0),
                )),
            },
        }
    }

    /// Number of trainable parameters.
    pub fn parameter_count(&self) -> u64 {
        let u = |x: usize| x as u64;
        match *self {
            Op::Linear { in_features, out_features, bias } => {
                u(in_features) * u(out_features) + if bias { u(out_features) } else { 0 }
            }
            Op::Conv2d { in_channels, out_channels, kernel, bias, .. } => {
                u(in_channels) * u(out_channels) * u(kernel) * u(kernel) + if bias { u(out_channels) } else { 0 }
            }
            Op::LayerNorm { dim } => 2 * u(dim),
            Op::Embedding { vocab, dim } => u(vocab) * u(dim),
            Op::TransformerBlock { d_model, d_ff, .. } => {
                let d = u(d_model);
                let f = u(d_ff);
                // two layer norms, QKV + output projection, two MLP linears (all with bias)
                2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
            }
            Op::MaxPool2d { .. }
            | Op::AvgPool2d { .. }
            | Op::Flatten
            | Op::Relu
            | Op::Gelu
            | Op::Tanh
            | Op::Sigmoid
            | Op::Dropout { .. } => 0,
        }
    }

    /// Whether the operator's input is integer token ids rather than features.
    pub fn takes_token_ids(&self) -> bool {
        matches!(self, Op::Embedding { .. })
    }
}

/// The loss function at the end of the model (defined with the other named choices).
pub use crate::vocab::Loss;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_and_pool_shapes() {
        let conv = Op::Conv2d { in_channels: 3, out_channels: 64, kernel: 3, stride: 1, padding: 1, bias: true };
        assert_eq!(conv.output_shape(&[3, 32, 32]), Ok(vec![64, 32, 32]));
        let pool = Op::MaxPool2d { kernel: 2, stride: 2 };
        assert_eq!(pool.output_shape(&[64, 32, 32]), Ok(vec![64, 16, 16]));
        assert_eq!(Op::Flatten.output_shape(&[64, 16, 16]), Ok(vec![16384]));
        assert_eq!(conv.parameter_count(), 3 * 64 * 9 + 64);
    }

    #[test]
    fn linear_mismatch_names_both_sizes() {
        let l = Op::Linear { in_features: 100, out_features: 10, bias: true };
        let e = l.output_shape(&[784]).expect_err("mismatch");
        assert!(e.message.contains("100") && e.message.contains("784"));
    }

    #[test]
    fn transformer_block_parameters() {
        let t = Op::TransformerBlock { d_model: 512, heads: 8, d_ff: 2048 };
        // 12·d² + 13·d (the usual count with biases and two layer norms), d_ff = 4d
        assert_eq!(t.parameter_count(), 12 * 512 * 512 + 13 * 512);
    }
}
