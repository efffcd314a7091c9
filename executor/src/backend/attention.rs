//! Attention's arithmetic shared by the kernels, the ring and the layers: the scaled,
//! optionally masked softmax of the scores and its gradient, the causal (and sliding-window)
//! mask by position, and grouped-query attention's repeated key and value heads.

use burn::prelude::*;
use burn::tensor::activation;

/// The score a masked key gets before the softmax: its weight comes out 0 (and its
/// gradient), without -∞ arithmetic.
pub(crate) const MASKED: f32 = -1e9;

/// Whether a query at position `query` does not see a key at `key`: the key is after it
/// (causal), or with a sliding window `window` > 0, `window` or more positions before it
/// (each position sees itself and the `window − 1` before it, as Mistral's and
/// transformers' sliding windows do).
pub(crate) fn hidden(query: usize, key: usize, window: usize) -> bool {
    key > query || (window > 0 && query - key >= window)
}

/// A causal mask by position, borrowed: each query's and each key's position in the
/// sequence (context parallelism: a member's queries against the gathered keys, in member
/// order) and the sliding window (0: none).
#[derive(Clone, Copy, Debug)]
pub struct Mask<'a> {
    pub queries: &'a [usize],
    pub keys: &'a [usize],
    pub window: usize,
}

/// A causal mask by position ([`Mask`]) that a backward keeps.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskPositions {
    pub queries: Vec<usize>,
    pub keys: Vec<usize>,
    pub window: usize,
}

impl MaskPositions {
    pub fn mask(&self) -> Mask<'_> {
        Mask { queries: &self.queries, keys: &self.keys, window: self.window }
    }
}

/// The mask a backward keeps (None: no mask).
pub type Causal = Option<std::sync::Arc<MaskPositions>>;

/// softmax(scores/√dh + the mask) over the keys of [batch, heads, queries, keys]
/// scores in Burn's operations ([`crate::backend::kernels::Kernels::attention_softmax`]'s default).
pub(crate) fn scores_softmax<B: Backend>(scores: Tensor<B, 4>, dh: usize, mask: Option<Mask<'_>>) -> Tensor<B, 4> {
    activation::softmax(scaled_and_masked(scores, dh, mask), 3)
}

/// scores/√dh + the mask, what the softmax takes.
fn scaled_and_masked<B: Backend>(scores: Tensor<B, 4>, dh: usize, mask: Option<Mask<'_>>) -> Tensor<B, 4> {
    let scores = scores / (dh as f64).sqrt();
    match mask {
        Some(mask) => {
            // as rows of [batch·heads, queries·keys] against the mask's one row: the CPU
            // backend's one-pass broadcast of a row ([1, 1, q, k] takes its strided path)
            let dev = scores.device();
            let [b, h, q, k] = scores.dims();
            let mask = additive_mask::<B>(mask, &dev).reshape([1, q * k]);
            (scores.reshape([b * h, q * k]) + mask).reshape([b, h, q, k])
        }
        None => scores,
    }
}

/// The attention weights with sinks (GPT-OSS; transformers' `eager_attention_forward` of
/// gpt_oss): softmax(scores/√dh + the mask) over the keys and one more logit per head, the
/// head's sink, whose share weighs no value — [batch, heads, queries, keys], each row
/// summing to 1 − its sink's share. In Burn's operations (tracked where `B` is).
pub(crate) fn sink_softmax<B: Backend>(
    scores: Tensor<B, 4>,
    dh: usize,
    mask: Option<Mask<'_>>,
    sinks: Tensor<B, 1>,
) -> Tensor<B, 4> {
    let [b, h, q, k] = scores.dims();
    let scores = scaled_and_masked(scores, dh, mask);
    let sink = sinks.reshape([1, h, 1, 1]).repeat_dim(0, b).repeat_dim(2, q);
    activation::softmax(Tensor::cat(vec![scores, sink], 3), 3).narrow(3, 0, k)
}

/// The sinks' gradient [heads] from [`sink_softmax`]'s probabilities `p` and their gradient
/// `dp`: each row's sink takes 1 − rowsum(p) of it and moves every key's weight against it,
/// so d sink = −Σ over the batch and the queries of (1 − rowsum(p)) · rowsum(dp ⊙ p).
pub(crate) fn sink_grad<B: Backend>(p: Tensor<B, 4>, dp: Tensor<B, 4>) -> Tensor<B, 1> {
    let h = p.dims()[1];
    let moved = (dp * p.clone()).sum_dim(3);
    let share = p.sum_dim(3).neg() + 1.0;
    (share * moved).neg().sum_dim(0).sum_dim(2).reshape([h])
}

/// The additive mask [1, 1, queries, keys] of `mask`'s queries and keys: a key its query
/// does not see ([`hidden`]) gets [`MASKED`], the rest 0.
pub(crate) fn additive_mask<B: Backend>(mask: Mask<'_>, dev: &B::Device) -> Tensor<B, 4> {
    let values: Vec<f32> = mask
        .queries
        .iter()
        .flat_map(|&qp| mask.keys.iter().map(move |&kp| if hidden(qp, kp, mask.window) { MASKED } else { 0.0 }))
        .collect();
    Tensor::<B, 2>::from_data(TensorData::new(values, [mask.queries.len(), mask.keys.len()]), dev).unsqueeze::<4>()
}

/// Keys or values [b, kv, s, dh] repeated for grouped-query attention: key/value head j
/// serves query heads j·g .. (j+1)·g, [b, kv·g, s, dh].
pub(crate) fn repeat_heads<B: Backend>(t: Tensor<B, 4>, g: usize) -> Tensor<B, 4> {
    if g == 1 {
        return t;
    }
    let [b, kv, s, dh] = t.dims();
    t.unsqueeze_dim::<5>(2).repeat_dim(2, g).reshape([b, kv * g, s, dh])
}

/// The scores' gradient from [`scores_softmax`]'s output `p` and its gradient `dp`,
/// `p ⊙ (dp − rowsum(dp ⊙ p)) / √dh`, in Burn's operations
/// ([`crate::backend::kernels::Kernels::attention_softmax_grad`]'s default).
pub(crate) fn scores_softmax_grad<B: Backend>(p: Tensor<B, 4>, dp: Tensor<B, 4>, dh: usize) -> Tensor<B, 4> {
    (p.clone() * (dp.clone() - (dp * p).sum_dim(3))) / (dh as f64).sqrt()
}
