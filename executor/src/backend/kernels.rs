//! What the executor needs of a backend beyond Burn's ([`Kernels`]): its dense product in
//! the orientation its kernel is fast in, attention's softmax, the experts' exchange of rows
//! and the ring attention through the port; the CPU's and CUDA's choices. The autodiff
//! backend's implementation, with its backward operations, is `crate::backend::dense`.

use burn::backend::autodiff::NodeId;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{ConvOptions, FloatTensor, FloatTensorOps, IntTensor, ModuleOps};
use burn::tensor::{Tensor, TensorPrimitive};

use std::sync::Arc;

use crate::backend::gated::Gate;
pub use crate::backend::gelu::Gelu;
use crate::backend::pool::PoolWindow;
use crate::backend::rotary::Rotation;

/// Batch normalisation's output, mean and variance ([`Kernels::batch_norm`]).
pub type Normalised<B> = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

/// A row norm's output and its rows' statistics ([`Kernels::row_norm`]).
pub type RowNormed<B> = (FloatTensor<B>, FloatTensor<B>);

/// A mean cross-entropy [1] and the softmax of its logits ([`Kernels::cross_entropy`]).
pub type Softmaxed<B> = (FloatTensor<B>, FloatTensor<B>);

/// A row norm's gradients: of the input, the gain and (a layer norm's) the bias
/// ([`Kernels::row_norm_grads`]).
pub type RowNormGrads<B> = (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>);

/// What the executor needs of a backend beyond Burn's: its dense product.
pub trait Kernels: Backend {
    /// `a · b` for 2-D tensors (by default Burn's matmul).
    fn product(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(a, b)
    }

    /// `acc + a · b` for 2-D tensors, in `acc`'s buffer where the backend can.
    fn product_add(acc: FloatTensor<Self>, a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_add(acc, Self::product(a, b))
    }

    /// The bytes of the device's memory pool that allocations hold now (CubeCL's in use and
    /// padding), for the run's measured device peak; None where the backend keeps no pool
    /// (the CPU, whose process memory is measured instead).
    fn pool_in_use(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// The key under which a weight's gradient is summed in place ([`with_gradient_sums`]):
    /// on an autodiff backend the weight's graph node; `None` elsewhere.
    fn sum_key(_weight: &FloatTensor<Self>) -> Option<NodeId> {
        None
    }

    /// Whether a backward through `t` reaches a tensor that needs a gradient: on an autodiff
    /// backend, a leaf that requires one or anything computed from one; `false` elsewhere.
    fn carries_gradient(_t: &FloatTensor<Self>) -> bool {
        false
    }

    /// `dy · wᵀ`, the input gradient of `x · w` (2-D), computed the way this backend runs it
    /// fastest (by default Burn's: through the transposed view of `w`).
    fn input_grad(dy: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::product(dy, Self::float_transpose(w))
    }

    /// `x · w` for a weight matrix `w` ([in, out]).
    fn dense(x: Tensor<Self, 2>, w: Tensor<Self, 2>) -> Tensor<Self, 2> {
        let (x, w) = (x.into_primitive().tensor(), w.into_primitive().tensor());
        Tensor::from_primitive(TensorPrimitive::Float(forward_product::<Self>(x, w)))
    }

    /// The rows of table `w` ([vocabulary, d]) that `ids` ([batch, seq]) name: [batch, seq,
    /// d] (Burn's embedding).
    fn embed(w: Tensor<Self, 2>, ids: Tensor<Self, 2, burn::tensor::Int>) -> Tensor<Self, 3> {
        burn::tensor::module::embedding(w, ids)
    }

    /// Expert parallelism's exchange of rows with the group ([`crate::backend::port::move_rows`]);
    /// on an autodiff backend its gradient is the reverse exchange, run in the backward.
    fn exchange(x: Tensor<Self, 2>, ex: &crate::backend::port::Exchange) -> crate::error::Result<Tensor<Self, 2>> {
        crate::backend::port::move_rows(x, ex)
    }

    /// Dropout on a flattened tensor: `x` times the mask's factors
    /// ([`crate::backend::dropout::DropMask`]); on an autodiff backend the backward draws the
    /// mask again rather than keeping it.
    fn dropout(x: Tensor<Self, 1>, mask: std::sync::Arc<crate::backend::dropout::DropMask>) -> Tensor<Self, 1> {
        let dev = x.device();
        x * mask.tensor(&dev)
    }

    /// A 2-D convolution of `x` [n, C, h, w] by `weight` [C_out, C/groups, kh, kw], plus
    /// `bias` [C_out] (by default Burn's).
    fn convolution(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        <Self as ModuleOps<Self>>::conv2d(x, weight, bias, options)
    }

    /// [`Kernels::convolution`]'s input and weight gradients from its output's gradient `dy`,
    /// each where `want` asks for it (by default Burn's).
    fn convolution_grads(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        options: ConvOptions<2>,
        want: (bool, bool),
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        burn_conv2d_grads::<Self>(x, weight, dy, options, want)
    }

    /// Batch normalisation in training of `x` [n, C, h, w] by its own per-channel mean and
    /// biased variance, `(x − mean)·γ/√(var + ε) + β`: (output, mean, variance), by
    /// default on Burn's operations (`crate::backend::norm`).
    fn batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> Normalised<Self> {
        crate::backend::norm::forward::<Self>(x, gamma, beta, eps)
    }

    /// [`Kernels::batch_norm`]'s gradients (dx, dγ, dβ) from its output's gradient `dy`,
    /// with the mean and variance it used (by default on Burn's operations).
    fn batch_norm_grads(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        stats: (FloatTensor<Self>, FloatTensor<Self>),
        dy: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        crate::backend::norm::gradients::<Self>(x, gamma, stats, dy, eps)
    }

    /// Layer normalisation (with `beta`) or RMSNorm (without) of `x` over its last
    /// dimension, scaled by γ: (output, each row's mean and 1/√(variance + ε) as [rows, 2];
    /// RMSNorm's mean 0), by default on Burn's operations (`crate::backend::row_norm`).
    fn row_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> RowNormed<Self> {
        crate::backend::row_norm::forward::<Self>(x, gamma, beta, eps)
    }

    /// [`Kernels::row_norm`]'s gradients (dx, dγ, dβ where `beta`) from its output's
    /// gradient `dy`, with the rows' statistics it kept (by default on Burn's operations).
    fn row_norm_grads(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        beta: bool,
    ) -> RowNormGrads<Self> {
        crate::backend::row_norm::gradients::<Self>(x, gamma, stats, dy, beta)
    }

    /// GELU of `x` in `form`, by default on Burn's operations (`crate::backend::gelu`).
    fn gelu_of(x: FloatTensor<Self>, form: Gelu) -> FloatTensor<Self> {
        crate::backend::gelu::forward::<Self>(x, form)
    }

    /// [`Kernels::gelu_of`]'s gradient from its output's gradient `dy`, by default on
    /// Burn's operations.
    fn gelu_of_grad(x: FloatTensor<Self>, dy: FloatTensor<Self>, form: Gelu) -> FloatTensor<Self> {
        crate::backend::gelu::gradients::<Self>(x, dy, form)
    }

    /// A gated MLP's activation act(gate)·up of the up projection's output `up` (its last
    /// dimension the gate's columns, then the up's): the output with half its last
    /// dimension, by default on Burn's operations (`crate::backend::gated`).
    fn gated(up: FloatTensor<Self>, gate: Gate) -> FloatTensor<Self> {
        crate::backend::gated::forward::<Self>(up, gate)
    }

    /// [`Kernels::gated`]'s gradient with respect to `up` from its output's gradient `dy`
    /// (by default on Burn's operations).
    fn gated_grads(up: FloatTensor<Self>, dy: FloatTensor<Self>, gate: Gate) -> FloatTensor<Self> {
        crate::backend::gated::gradients::<Self>(up, dy, gate)
    }

    /// `heads` attention heads of `size` features from feature `start` of `x`
    /// [b, s, width], head-major [b, heads, s, size] (by default a view on Burn's
    /// operations, `crate::backend::heads`).
    fn heads(x: FloatTensor<Self>, start: usize, heads: usize, size: usize) -> FloatTensor<Self> {
        crate::backend::heads::take::<Self>(x, start, heads, size)
    }

    /// Heads `x` [b, heads, s, size] as features `start..start + heads·size` of zeros
    /// [b, s, width]: [`Kernels::heads`]' gradient, and with the whole width the heads'
    /// merge (by default on Burn's operations).
    fn place_heads(x: FloatTensor<Self>, width: usize, start: usize) -> FloatTensor<Self> {
        crate::backend::heads::place::<Self>(x, width, start)
    }

    /// Queries or keys `x` [.., positions, dh] turned by the rotary embeddings' table `r`,
    /// by default on Burn's operations (`crate::backend::rotary`).
    fn rotary(x: FloatTensor<Self>, r: &Arc<Rotation>) -> FloatTensor<Self> {
        crate::backend::rotary::forward::<Self>(x, r)
    }

    /// [`Kernels::rotary`]'s gradient from its output's gradient `dy` (by default on Burn's
    /// operations).
    fn rotary_grads(dy: FloatTensor<Self>, r: &Rotation) -> FloatTensor<Self> {
        crate::backend::rotary::gradients::<Self>(dy, r)
    }

    /// The mean cross-entropy of `logits` [n, c] with each row's class `labels`: the loss
    /// [1] and the softmax [n, c] its gradient needs, by default on Burn's operations
    /// (`crate::backend::cross_entropy`).
    fn cross_entropy(logits: FloatTensor<Self>, labels: &Arc<Vec<i64>>) -> Softmaxed<Self> {
        crate::backend::cross_entropy::forward::<Self>(logits, labels)
    }

    /// [`Kernels::cross_entropy`]'s gradient by the logits from the loss's gradient `dy`
    /// [1], with the softmax it returned (by default on Burn's operations).
    fn cross_entropy_grads(probs: FloatTensor<Self>, labels: &[i64], dy: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::backend::cross_entropy::gradients::<Self>(probs, labels, dy)
    }

    /// Max pooling of `x` [n, C, h, w] by `window`: the pooled tensor and each output's
    /// largest value's offset in its input plane (by default Burn's).
    fn max_pool(x: FloatTensor<Self>, window: PoolWindow) -> Pooled<Self> {
        burn_max_pool::<Self>(x, window)
    }

    /// [`Kernels::max_pool`]'s input gradient from its output's gradient `dy` and its
    /// `indices` (by default Burn's).
    fn max_pool_grad(
        x: FloatTensor<Self>,
        window: PoolWindow,
        dy: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        burn_max_pool_grad::<Self>(x, window, dy, indices)
    }

    /// softmax(scores/√dh + the mask) over the keys of [batch, heads, queries, keys]
    /// attention scores (by default Burn's operations).
    fn attention_softmax(
        scores: Tensor<Self, 4>,
        dh: usize,
        mask: Option<crate::backend::attention::Mask<'_>>,
    ) -> Tensor<Self, 4> {
        crate::backend::attention::scores_softmax(scores, dh, mask)
    }

    /// The scores' gradient from [`Kernels::attention_softmax`]'s output `p` and its
    /// gradient `dp`: `p ⊙ (dp − rowsum(dp ⊙ p)) / √dh` (by default Burn's operations).
    fn attention_softmax_grad(p: Tensor<Self, 4>, dp: Tensor<Self, 4>, dh: usize) -> Tensor<Self, 4> {
        crate::backend::attention::scores_softmax_grad(p, dp, dh)
    }

    /// Context parallelism's ring attention ([`crate::backend::ring`]): this member's queries
    /// [b, h, s, dh] over the group's keys and values (with `sinks`, a logit per head [h]
    /// in every softmax), its own `k`, `v` [b, kv, s, dh] passed around the ring; an
    /// autodiff backend keeps only q, its own k and v, the sinks, the output and the rows'
    /// log-sum-exp. Without autodiff, the forward alone.
    fn ring_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        sinks: Option<Tensor<Self, 1>>,
        ring: &crate::backend::ring::Ring,
    ) -> crate::error::Result<Tensor<Self, 4>> {
        ring.forward(q, k, v, sinks).map(|(out, _)| out)
    }

    /// Attention's core, softmax(q·kᵀ/√dh + the causal mask)·v on [batch, heads, seq, dh]
    /// (with `sinks`, a logit per head [heads] in every softmax:
    /// [`crate::backend::attention::sink_softmax`]), without keeping its scores and
    /// probabilities for the backward: an autodiff backend keeps q, k and v (which the graph
    /// holds anyway) and the sinks, and recomputes the probabilities in the backward —
    /// selective recompute (Korthikanti et al. 2022). With `drop`, the probabilities' dropout
    /// (its mask drawn again in the backward). Without autodiff there is nothing to keep: the
    /// plain computation.
    fn attention_recomputed(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        dh: usize,
        causal: crate::backend::attention::Causal,
        sinks: Option<Tensor<Self, 1>>,
        drop: &crate::backend::dropout::Dropped,
    ) -> Tensor<Self, 4> {
        let p = attention_weights(q, k, dh, causal.as_ref().map(|m| m.mask()), sinks);
        crate::backend::amp::matmul(dropped(p, drop), v)
    }
}

impl Kernels for burn::backend::Flex {
    fn product(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        // flex's kernel without its zero-fill and copy of the output (crate::backend::flex_gemm)
        crate::backend::flex_gemm::product(&a, &b).unwrap_or_else(|| Self::float_matmul(a, b))
    }

    fn product_add(acc: FloatTensor<Self>, a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::backend::flex_gemm::product_add(acc, &a, &b)
            .unwrap_or_else(|acc| Self::float_add(acc, Self::product(a, b)))
    }

    fn input_grad(dy: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        // (w · dyᵀ)ᵀ: the kernel streams w as it is laid out
        Self::float_transpose(Self::product(w, Self::float_transpose(dy)))
    }

    fn attention_softmax(
        scores: Tensor<Self, 4>,
        dh: usize,
        mask: Option<crate::backend::attention::Mask<'_>>,
    ) -> Tensor<Self, 4> {
        // one pass per row (crate::backend::flex_softmax), Burn's operations for what it does not take
        let divisor = (dh as f64).sqrt() as f32;
        match crate::backend::flex_softmax::forward(&scores.clone().into_primitive().tensor(), divisor, mask) {
            Some(p) => Tensor::from_primitive(TensorPrimitive::Float(p)),
            None => crate::backend::attention::scores_softmax(scores, dh, mask),
        }
    }

    fn attention_softmax_grad(p: Tensor<Self, 4>, dp: Tensor<Self, 4>, dh: usize) -> Tensor<Self, 4> {
        let divisor = (dh as f64).sqrt() as f32;
        let (pp, dpp) = (p.clone().into_primitive().tensor(), dp.clone().into_primitive().tensor());
        match crate::backend::flex_softmax::backward(&pp, &dpp, divisor) {
            Some(ds) => Tensor::from_primitive(TensorPrimitive::Float(ds)),
            None => crate::backend::attention::scores_softmax_grad(p, dp, dh),
        }
    }

    fn convolution(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        // products over the patches (crate::backend::flex_conv), flex's own for what it does not take
        crate::backend::flex_conv::forward(&x, &weight, bias.as_ref(), &options)
            .unwrap_or_else(|| <Self as ModuleOps<Self>>::conv2d(x, weight, bias, options))
    }

    fn convolution_grads(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        options: ConvOptions<2>,
        want: (bool, bool),
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        match crate::backend::flex_conv::backward(&x, &weight, &dy, &options, want) {
            Some(grads) => grads,
            None => burn_conv2d_grads::<Self>(x, weight, dy, options, want),
        }
    }

    fn batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> Normalised<Self> {
        // fused (crate::backend::flex_norm), Burn's operations for what it does not take
        crate::backend::flex_norm::forward(&x, &gamma, &beta, eps)
            .unwrap_or_else(|| crate::backend::norm::forward::<Self>(x, gamma, beta, eps))
    }

    fn batch_norm_grads(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        (mean, var): (FloatTensor<Self>, FloatTensor<Self>),
        dy: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        crate::backend::flex_norm::gradients(&x, &gamma, (&mean, &var), &dy, eps)
            .unwrap_or_else(|| crate::backend::norm::gradients::<Self>(x, gamma, (mean, var), dy, eps))
    }

    fn row_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> RowNormed<Self> {
        // fused (crate::backend::flex_row_norm), Burn's operations for what it does not take
        crate::backend::flex_row_norm::forward(&x, &gamma, beta.as_ref(), eps)
            .unwrap_or_else(|| crate::backend::row_norm::forward::<Self>(x, gamma, beta, eps))
    }

    fn row_norm_grads(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        beta: bool,
    ) -> RowNormGrads<Self> {
        crate::backend::flex_row_norm::gradients(&x, &gamma, &stats, &dy, beta)
            .unwrap_or_else(|| crate::backend::row_norm::gradients::<Self>(x, gamma, stats, dy, beta))
    }

    fn gelu_of(x: FloatTensor<Self>, form: Gelu) -> FloatTensor<Self> {
        // vectorized (crate::backend::flex_gelu), Burn's operations for what it does not take
        crate::backend::flex_gelu::forward(&x, form).unwrap_or_else(|| crate::backend::gelu::forward::<Self>(x, form))
    }

    fn gelu_of_grad(x: FloatTensor<Self>, dy: FloatTensor<Self>, form: Gelu) -> FloatTensor<Self> {
        crate::backend::flex_gelu::gradients(&x, &dy, form)
            .unwrap_or_else(|| crate::backend::gelu::gradients::<Self>(x, dy, form))
    }

    fn gated(up: FloatTensor<Self>, gate: Gate) -> FloatTensor<Self> {
        // fused (crate::backend::flex_gated), Burn's operations for what it does not take
        crate::backend::flex_gated::forward(&up, gate)
            .unwrap_or_else(|| crate::backend::gated::forward::<Self>(up, gate))
    }

    fn gated_grads(up: FloatTensor<Self>, dy: FloatTensor<Self>, gate: Gate) -> FloatTensor<Self> {
        crate::backend::flex_gated::gradients(&up, &dy, gate)
            .unwrap_or_else(|| crate::backend::gated::gradients::<Self>(up, dy, gate))
    }

    fn heads(x: FloatTensor<Self>, start: usize, heads: usize, size: usize) -> FloatTensor<Self> {
        // one copy of rows (crate::backend::flex_heads), Burn's view for what it does not take
        crate::backend::flex_heads::take(&x, start, heads, size)
            .unwrap_or_else(|| crate::backend::heads::take::<Self>(x, start, heads, size))
    }

    fn place_heads(x: FloatTensor<Self>, width: usize, start: usize) -> FloatTensor<Self> {
        crate::backend::flex_heads::place(&x, width, start)
            .unwrap_or_else(|| crate::backend::heads::place::<Self>(x, width, start))
    }

    fn rotary(x: FloatTensor<Self>, r: &Arc<Rotation>) -> FloatTensor<Self> {
        // fused (crate::backend::flex_rotary), Burn's operations for what it does not take
        crate::backend::flex_rotary::forward(&x, r).unwrap_or_else(|| crate::backend::rotary::forward::<Self>(x, r))
    }

    fn rotary_grads(dy: FloatTensor<Self>, r: &Rotation) -> FloatTensor<Self> {
        crate::backend::flex_rotary::gradients(&dy, r)
            .unwrap_or_else(|| crate::backend::rotary::gradients::<Self>(dy, r))
    }

    fn cross_entropy(logits: FloatTensor<Self>, labels: &Arc<Vec<i64>>) -> Softmaxed<Self> {
        // fused (crate::backend::flex_cross_entropy), Burn's operations for what it does not take
        crate::backend::flex_cross_entropy::forward(&logits, labels)
            .unwrap_or_else(|| crate::backend::cross_entropy::forward::<Self>(logits, labels))
    }

    fn cross_entropy_grads(probs: FloatTensor<Self>, labels: &[i64], dy: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::backend::flex_cross_entropy::gradients(&probs, labels, &dy)
            .unwrap_or_else(|| crate::backend::cross_entropy::gradients::<Self>(probs, labels, dy))
    }

    fn max_pool(x: FloatTensor<Self>, window: PoolWindow) -> Pooled<Self> {
        // one plane at a time (crate::backend::flex_pool), flex's own for what it does not take
        crate::backend::flex_pool::forward(&x, window).unwrap_or_else(|| burn_max_pool::<Self>(x, window))
    }

    fn max_pool_grad(
        x: FloatTensor<Self>,
        window: PoolWindow,
        dy: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let shape = x.layout().shape().as_slice();
        match <[usize; 4]>::try_from(shape).ok().and_then(|s| crate::backend::flex_pool::backward(s, &dy, &indices)) {
            Some(dx) => dx,
            None => burn_max_pool_grad::<Self>(x, window, dy, indices),
        }
    }
}

#[cfg(feature = "cuda")]
impl Kernels for burn::backend::Cuda {
    fn pool_in_use(device: &Self::Device) -> Option<u64> {
        cube_pool_in_use::<burn_cubecl::cubecl::cuda::CudaRuntime>(device)
    }
}

#[cfg(feature = "wgpu")]
impl Kernels for burn::backend::Wgpu {
    fn pool_in_use(device: &Self::Device) -> Option<u64> {
        cube_pool_in_use::<burn::backend::wgpu::WgpuRuntime>(device)
    }
}

/// What a CubeCL runtime's memory pool on `device` holds for live allocations now.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn cube_pool_in_use<R: burn_cubecl::cubecl::Runtime>(device: &R::Device) -> Option<u64> {
    let usage = R::client(device).memory_usage().ok()?;
    Some(usage.bytes_in_use.saturating_add(usage.bytes_padding))
}

/// The backends the executor trains on: autodiff over a backend with [`Kernels`].
pub trait ExecBackend: AutodiffBackend<InnerBackend: Kernels> + Kernels {}

impl<B: AutodiffBackend<InnerBackend: Kernels> + Kernels> ExecBackend for B {}

/// A 2-D convolution through [`Kernels::convolution`]: `x` [n, C, h, w] by `weight`
/// [C_out, C/groups, kh, kw], plus `bias` [C_out].
pub(crate) fn conv2d<B: Kernels>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    options: ConvOptions<2>,
) -> Tensor<B, 4> {
    let p = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let bias = bias.map(|b| b.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(B::convolution(p(x), p(weight), bias, options)))
}

/// A max pool's output and each output's largest value's offset in its input plane.
pub type Pooled<B> = (FloatTensor<B>, IntTensor<B>);

/// [`Kernels::batch_norm`] on tensors: (output, mean, variance).
pub(crate) fn batch_norm<B: Kernels>(
    x: Tensor<B, 4>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>) {
    let (y, mean, var) = B::batch_norm(
        x.into_primitive().tensor(),
        gamma.into_primitive().tensor(),
        beta.into_primitive().tensor(),
        eps,
    );
    let wrap1 = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t));
    (Tensor::from_primitive(TensorPrimitive::Float(y)), wrap1(mean), wrap1(var))
}

/// [`Kernels::row_norm`] on tensors: the output alone (layer normalisation with `beta`,
/// RMSNorm without).
pub(crate) fn row_norm<B: Kernels, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Option<Tensor<B, 1>>,
    eps: f64,
) -> Tensor<B, D> {
    let p = |t: Tensor<B, 1>| t.into_primitive().tensor();
    let (y, _) = B::row_norm(x.into_primitive().tensor(), p(gamma), beta.map(p), eps);
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// [`Kernels::gelu_of`] on tensors.
pub(crate) fn gelu<B: Kernels, const D: usize>(x: Tensor<B, D>, form: Gelu) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::gelu_of(x.into_primitive().tensor(), form)))
}

/// [`Kernels::gated`] on tensors.
pub(crate) fn gated<B: Kernels, const D: usize>(up: Tensor<B, D>, gate: Gate) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::gated(up.into_primitive().tensor(), gate)))
}

/// [`Kernels::cross_entropy`] on tensors: the mean loss of `logits` [n, c] with each row's
/// class.
pub(crate) fn cross_entropy<B: Kernels>(logits: Tensor<B, 2>, labels: Vec<i64>) -> Tensor<B, 1> {
    let (loss, _) = B::cross_entropy(logits.into_primitive().tensor(), &Arc::new(labels));
    Tensor::from_primitive(TensorPrimitive::Float(loss))
}

/// [`Kernels::heads`] on tensors: `heads` heads of `size` from feature `start` of `x`
/// [b, s, width], as [b, heads, s, size].
pub(crate) fn heads<B: Kernels>(x: Tensor<B, 3>, start: usize, heads: usize, size: usize) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::heads(x.into_primitive().tensor(), start, heads, size)))
}

/// Heads `x` [b, heads, s, size] merged into features [b, s, heads·size]
/// ([`Kernels::place_heads`] over the whole width).
pub(crate) fn merge_heads<B: Kernels>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [_, h, _, d] = x.dims();
    Tensor::from_primitive(TensorPrimitive::Float(B::place_heads(x.into_primitive().tensor(), h * d, 0)))
}

/// [`Kernels::rotary`] on tensors.
pub(crate) fn rotary<B: Kernels, const D: usize>(x: Tensor<B, D>, r: &Arc<Rotation>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::rotary(x.into_primitive().tensor(), r)))
}

/// Max pooling through [`Kernels::max_pool`] ([n, C, h, w] by `window`).
pub(crate) fn max_pool<B: Kernels>(x: Tensor<B, 4>, window: PoolWindow) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::max_pool(x.into_primitive().tensor(), window).0))
}

/// Burn's max pool.
fn burn_max_pool<B: Backend>(x: FloatTensor<B>, PoolWindow { kernel, stride, padding }: PoolWindow) -> Pooled<B> {
    let pooled = B::max_pool2d_with_indices(x, kernel, stride, padding, [1, 1], false);
    (pooled.output, pooled.indices)
}

/// Burn's gradient of a max pool's input.
fn burn_max_pool_grad<B: Backend>(
    x: FloatTensor<B>,
    PoolWindow { kernel, stride, padding }: PoolWindow,
    dy: FloatTensor<B>,
    indices: IntTensor<B>,
) -> FloatTensor<B> {
    B::max_pool2d_with_indices_backward(x, kernel, stride, padding, [1, 1], false, dy, indices).x_grad
}

/// Burn's gradients of a 2-D convolution's input and weight, each where `want` asks.
fn burn_conv2d_grads<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    dy: FloatTensor<B>,
    options: ConvOptions<2>,
    (want_x, want_w): (bool, bool),
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    let dx = want_x.then(|| B::conv2d_x_backward(x.clone(), weight.clone(), dy.clone(), options.clone()));
    (dx, want_w.then(|| B::conv2d_weight_backward(x, weight, dy, options)))
}

/// Attention weights softmax(q·kᵀ/√dh) over [batch, heads, seq, dh] queries and keys; with
/// a `mask` (each query's and each key's position in the sequence — context parallelism: a
/// member's queries against the gathered keys, in member order — and the sliding window), a
/// key its query does not see gets weight 0 (its score is pushed to -1e9 first, which leaves the same softmax and gradient
/// as removing it, without -∞ arithmetic).
pub(crate) fn attention_at<B: Kernels>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    dh: usize,
    mask: Option<crate::backend::attention::Mask<'_>>,
) -> Tensor<B, 4> {
    B::attention_softmax(crate::backend::amp::matmul(q, k.swap_dims(2, 3)), dh, mask)
}

/// `x` after the dropout `mask` (its factors in row-major order, the part's), if any.
pub(crate) fn dropped<B: Kernels, const D: usize>(
    x: Tensor<B, D>,
    mask: &crate::backend::dropout::Dropped,
) -> Tensor<B, D> {
    let Some(mask) = mask else { return x };
    let dims = x.dims();
    let n = dims.iter().product::<usize>();
    B::dropout(x.reshape([n]), mask.clone()).reshape(dims)
}

/// [`attention_at`], or with `sinks` (a logit per head [heads] in every softmax) the
/// weights of [`crate::backend::attention::sink_softmax`].
pub(crate) fn attention_weights<B: Kernels>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    dh: usize,
    mask: Option<crate::backend::attention::Mask<'_>>,
    sinks: Option<Tensor<B, 1>>,
) -> Tensor<B, 4> {
    match sinks {
        Some(sinks) => {
            crate::backend::attention::sink_softmax(crate::backend::amp::matmul(q, k.swap_dims(2, 3)), dh, mask, sinks)
        }
        None => attention_at(q, k, dh, mask),
    }
}

/// `x · w` in a forward pass: [`Kernels::product`] in fp32; in a low precision
/// ([`crate::backend::amp`]) the product of the rounded operands.
pub(crate) fn forward_product<I: Kernels>(x: FloatTensor<I>, w: FloatTensor<I>) -> FloatTensor<I> {
    crate::backend::amp::mixed::<I>(x, w, I::product)
}
