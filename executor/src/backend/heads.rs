//! Attention heads in and out of the features ([`Kernels::heads`], [`Kernels::place_heads`])
//! on Burn's operations: the defaults, views where the backend can keep them
//! (`crate::backend::flex_heads` copies them on the CPU).
//!
//! Each is the other's gradient: the heads of a run of features, taken out head-major, are
//! put back into zeros of the features' width by the backward, and heads put back are taken
//! out again.
//!
//! [`Kernels::heads`]: crate::backend::kernels::Kernels::heads
//! [`Kernels::place_heads`]: crate::backend::kernels::Kernels::place_heads

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};

/// `heads` heads of `size` features from feature `start` of `x` [b, s, width], as
/// [b, heads, s, size].
pub fn take<B: Backend>(x: FloatTensor<B>, start: usize, heads: usize, size: usize) -> FloatTensor<B> {
    let x = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(x));
    let [b, s, _] = x.dims();
    x.narrow(2, start, heads * size).reshape([b, s, heads, size]).swap_dims(1, 2).into_primitive().tensor()
}

/// Heads `x` [b, heads, s, size] as features `start..start + heads·size` of zeros
/// [b, s, width].
pub fn place<B: Backend>(x: FloatTensor<B>, width: usize, start: usize) -> FloatTensor<B> {
    let dtype = x.dtype();
    let x = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
    let [b, h, s, d] = x.dims();
    let merged = x.swap_dims(1, 2).reshape([b, s, h * d]);
    if width == h * d {
        return merged.into_primitive().tensor();
    }
    let device = merged.device();
    let zeros = B::float_zeros(Shape::new([b, s, width]), &device, dtype.into());
    let zeros = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(zeros));
    zeros.slice_assign([0..b, 0..s, start..start + h * d], merged).into_primitive().tensor()
}
