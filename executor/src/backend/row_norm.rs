//! Layer normalisation and RMSNorm over the last dimension, on Burn's operations: the
//! forward with each row's statistics and its gradients ([`Kernels::row_norm`]'s and
//! [`Kernels::row_norm_grads`]' defaults; `crate::backend::flex_row_norm` fuses them on the
//! CPU).
//!
//! A row is the last dimension's values: with μ its mean (0 for RMSNorm) and
//! r = 1/√(mean((x − μ)²) + ε), the output is x̂·γ (+ β), x̂ = (x − μ)·r.
//!
//! [`Kernels::row_norm`]: crate::backend::kernels::Kernels::row_norm
//! [`Kernels::row_norm_grads`]: crate::backend::kernels::Kernels::row_norm_grads

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};

fn tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// `t` as [rows, d], d its last dimension.
fn rows<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 2> {
    let dims = t.shape().to_vec();
    let d = dims.last().copied().unwrap_or(1).max(1);
    let n = dims.iter().product::<usize>() / d;
    tensor::<B, 2>(B::float_reshape(t, Shape::new([n, d])))
}

/// The row norm of `x` (any rank) by γ (and β: a layer norm; none: RMSNorm): the output in
/// `x`'s shape, and each row's μ and r as [rows, 2].
pub fn forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: Option<FloatTensor<B>>,
    eps: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let x = rows::<B>(x);
    let d = x.dims()[1];
    let gamma = tensor::<B, 1>(gamma).reshape([1, d]);
    let (mean, centred) = if beta.is_some() {
        let mean = x.clone().mean_dim(1);
        (mean.clone(), x - mean)
    } else {
        (Tensor::zeros([x.dims()[0], 1], &x.device()), x)
    };
    let r = (centred.clone().powi_scalar(2).mean_dim(1) + eps).sqrt().recip();
    let normed = centred * r.clone() * gamma;
    let y = match beta {
        Some(b) => normed + tensor::<B, 1>(b).reshape([1, d]),
        None => normed,
    };
    (B::float_reshape(primitive(y), shape), primitive(Tensor::cat(vec![mean, r], 1)))
}

/// [`forward`]'s gradients from its output's gradient `dy`: with g = dy·γ, dx = r·(g −
/// mean(g) − x̂·mean(g·x̂)) (RMSNorm: without mean(g)), dγ = Σ dy·x̂ and dβ = Σ dy over the
/// rows: (dx in `x`'s shape, dγ, dβ where `beta`).
pub fn gradients<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    stats: FloatTensor<B>,
    dy: FloatTensor<B>,
    beta: bool,
) -> (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) {
    let shape = x.shape();
    let (x, dy, stats) = (rows::<B>(x), rows::<B>(dy), tensor::<B, 2>(stats));
    let [n, d] = x.dims();
    let (mean, r) = (stats.clone().slice([0..n, 0..1]), stats.slice([0..n, 1..2]));
    let x_hat = (x - mean) * r.clone();
    let g = dy.clone() * tensor::<B, 1>(gamma).reshape([1, d]);
    let dot = (g.clone() * x_hat.clone()).mean_dim(1);
    let centred = if beta { g.clone() - g.mean_dim(1) } else { g };
    let dx = (centred - x_hat.clone() * dot) * r;
    let d_gamma = (dy.clone() * x_hat).sum_dim(0).reshape([d]);
    let d_beta = beta.then(|| primitive(dy.sum_dim(0).reshape([d])));
    (B::float_reshape(primitive(dx), shape), primitive(d_gamma), d_beta)
}
