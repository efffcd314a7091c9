//! Attention's arithmetic shared by the kernels, the ring and the layers: the scaled,
//! optionally causal softmax of the scores and its gradient, the causal mask by position,
//! and grouped-query attention's repeated key and value heads.

use burn::prelude::*;
use burn::tensor::activation;

/// The score a masked key gets before the softmax: its weight comes out 0 (and its
/// gradient), without -∞ arithmetic.
pub(crate) const MASKED: f32 = -1e9;

/// A causal mask as each query's and each key's position in the sequence (None: no mask).
pub type Causal = Option<std::sync::Arc<(Vec<usize>, Vec<usize>)>>;

/// softmax(scores/√dh + the causal mask) over the keys of [batch, heads, queries, keys]
/// scores in Burn's operations ([`crate::backend::kernels::Kernels::attention_softmax`]'s default).
pub(crate) fn scores_softmax<B: Backend>(
    scores: Tensor<B, 4>,
    dh: usize,
    causal: Option<(&[usize], &[usize])>,
) -> Tensor<B, 4> {
    let scores = scores / (dh as f64).sqrt();
    let scores = match causal {
        Some((queries, keys)) => {
            let dev = scores.device();
            scores + causal_mask::<B>(queries, keys, &dev)
        }
        None => scores,
    };
    activation::softmax(scores, 3)
}

/// The additive causal mask [1, 1, queries, keys] of queries and keys at these positions:
/// a key after its query gets [`MASKED`], the rest 0.
pub(crate) fn causal_mask<B: Backend>(queries: &[usize], keys: &[usize], dev: &B::Device) -> Tensor<B, 4> {
    let masked = MASKED;
    let mask: Vec<f32> =
        queries.iter().flat_map(|&qp| keys.iter().map(move |&kp| if kp > qp { masked } else { 0.0 })).collect();
    Tensor::<B, 2>::from_data(TensorData::new(mask, [queries.len(), keys.len()]), dev).unsqueeze::<4>()
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
