//! A gated MLP's activation, act(gate) ⊙ up, on Burn's operations: the forward and the up
//! projection's gradient ([`Kernels::gated`]'s and [`Kernels::gated_grads`]' defaults;
//! `crate::backend::flex_gated` fuses SwiGLU's on the CPU).
//!
//! The up projection's output holds, along its last dimension, the gate's f columns and then
//! the up's f: the output is act(gate)·up over f columns. With t = dy·up, the gradient is
//! act'(gate)·t for the gate's columns and act(gate)·dy for the up's.
//!
//! [`Kernels::gated`]: crate::backend::kernels::Kernels::gated
//! [`Kernels::gated_grads`]: crate::backend::kernels::Kernels::gated_grads

use burn::tensor::activation;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// SiLU, x·σ(x) (SwiGLU: Llama, Mistral, Qwen).
    Silu,
    /// GELU, exact (GEGLU).
    Gelu,
}

/// `t` as [rows, w], w its last dimension, with its shape.
fn rows<B: Backend>(t: FloatTensor<B>) -> (Tensor<B, 2>, Shape) {
    let shape = t.shape();
    let w = shape.as_slice().last().copied().unwrap_or(1).max(1);
    let n = shape.num_elements() / w;
    (Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(t, Shape::new([n, w])))), shape)
}

/// `shape` with its last dimension `w`.
fn with_last(shape: &Shape, w: usize) -> Shape {
    let mut dims = shape.as_slice().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = w;
    }
    Shape::from(dims)
}

/// act(gate)·up of `up` (any rank, its last dimension the gate's columns then the up's):
/// the output with half its last dimension. The halves as 2-D views: `flex` runs an
/// element-wise operation on a 2-D view row by row, on a 3-D view through its general
/// strided path, several times slower.
pub fn forward<B: Backend>(up: FloatTensor<B>, gate: Gate) -> FloatTensor<B> {
    let (x, shape) = rows::<B>(up);
    let f = x.dims()[1] / 2;
    let g = x.clone().narrow(1, 0, f);
    let a = match gate {
        Gate::Silu => activation::silu(g),
        Gate::Gelu => activation::gelu(g),
    };
    let y = a * x.narrow(1, f, f);
    B::float_reshape(y.into_primitive().tensor(), with_last(&shape, f))
}

/// [`forward`]'s gradient with respect to `up` from its output's gradient `dy`: the gate's
/// columns act'(gate)·dy·up, the up's act(gate)·dy, in `up`'s shape.
pub fn gradients<B: Backend>(up: FloatTensor<B>, dy: FloatTensor<B>, gate: Gate) -> FloatTensor<B> {
    let (x, shape) = rows::<B>(up);
    let (dy, _) = rows::<B>(dy);
    let f = x.dims()[1] / 2;
    let (g, u) = (x.clone().narrow(1, 0, f), x.narrow(1, f, f));
    let t = dy.clone() * u;
    let (a, d_gate) = match gate {
        Gate::Silu => {
            let s = activation::sigmoid(g.clone());
            let d = t.clone() * s.clone() + t * g.clone() * s.clone() * (s.clone().neg() + 1.0);
            (g * s, d)
        }
        Gate::Gelu => {
            let d = Tensor::from_primitive(TensorPrimitive::Float(B::gelu_backward(
                g.clone().into_primitive().tensor(),
                t.into_primitive().tensor(),
            )));
            (activation::gelu(g), d)
        }
    };
    let d_up = Tensor::cat(vec![d_gate, a * dy], 1);
    B::float_reshape(d_up.into_primitive().tensor(), shape)
}
