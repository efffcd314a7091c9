//! GELU's two forms on Burn's operations, for the backends without a kernel of their own
//! (the CubeCL backends; `flex_gelu` is the CPU's): the exact form is Burn's
//! `ActivationOps::gelu` and `gelu_backward`, the tanh approximation Burn's operations and
//! its explicit gradient.

use burn::prelude::*;
use burn::tensor::activation;
use burn::tensor::ops::{ActivationOps, FloatTensor};
use burn::tensor::{TensorMetadata, TensorPrimitive};

/// Which GELU: the exact x·Φ(x) (BERT's, `transformer_block`'s default) or the tanh
/// approximation 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (GPT-2's `gelu_new`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    Erf,
    Tanh,
}

/// GELU of `x` in `form` on Burn's operations.
pub fn forward<B: Backend>(x: FloatTensor<B>, form: Gelu) -> FloatTensor<B> {
    match form {
        Gelu::Erf => <B as ActivationOps<B>>::gelu(x),
        Gelu::Tanh => tanh_forward::<B>(x),
    }
}

/// [`forward`]'s gradient from its output's gradient `dy`.
pub fn gradients<B: Backend>(x: FloatTensor<B>, dy: FloatTensor<B>, form: Gelu) -> FloatTensor<B> {
    match form {
        Gelu::Erf => <B as ActivationOps<B>>::gelu_backward(x, dy),
        Gelu::Tanh => tanh_gradient::<B>(x, dy),
    }
}

/// √(2/π), the tanh approximation's scale.
pub(crate) const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The tanh approximation's cubic coefficient.
pub(crate) const CUBIC: f64 = 0.044_715;

fn tensor<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(t, [n].into())))
}

/// The tanh approximation of `x` (any shape), as Burn composes it.
pub fn tanh_forward<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let shape = x.shape();
    let x = tensor::<B>(x);
    let inner = (x.clone() + x.clone().powi_scalar(3) * CUBIC) * SQRT_2_OVER_PI;
    let y = x * (inner.tanh() + 1.0) * 0.5;
    B::float_reshape(y.into_primitive().tensor(), shape)
}

/// The tanh approximation's gradient from its output's gradient `dy`: with
/// 0.5·(1 + tanh(u)) = σ(2u), dy·(σ(2u) + x·σ(2u)·(1 − σ(2u))·2u′), u′ = √(2/π)·(1 +
/// 3·0.044715·x²).
pub fn tanh_gradient<B: Backend>(x: FloatTensor<B>, dy: FloatTensor<B>) -> FloatTensor<B> {
    let shape = x.shape();
    let (x, dy) = (tensor::<B>(x), tensor::<B>(dy));
    let x2 = x.clone() * x.clone();
    let u = (x.clone() + x.clone() * x2.clone() * CUBIC) * SQRT_2_OVER_PI;
    let s = activation::sigmoid(u * 2.0);
    let du = (x2 * (3.0 * CUBIC) + 1.0) * (2.0 * SQRT_2_OVER_PI);
    let d = dy * (s.clone() + x * s.clone() * (s.neg() + 1.0) * du);
    B::float_reshape(d.into_primitive().tensor(), shape)
}
