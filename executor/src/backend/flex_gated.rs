//! SwiGLU's and GEGLU's activations, act(gate) ⊙ up, on Burn's `flex` backend, fused.
//!
//! On Burn's operations (`crate::backend::gated`) the forward makes five passes over the up
//! projection's output — the gate's half narrowed out, its logistic, SiLU's product, the up
//! half's product — each over a strided view of every other half-row, and Burn's autodiff
//! about ten for the backward: `specs/llama-tiny.yaml`'s block (4 × 64 rows, SwiGLU of
//! 2 × 172) took 1.42 ms forward in `pipec profile`, no less than the same block with an
//! ungated GELU MLP of that width (1.46 ms), whose GELU is priced at 0.69 ms and SwiGLU's
//! SiLU at 0.19 (docs/benchmarks.md). Here the forward reads each row once and writes the
//! output, the backward reads each row and its output's gradient once and writes the up
//! projection's gradient: with s = σ(g) and t = dy·u, SwiGLU's gate columns t·s + t·g·s·(1 −
//! s), its up's g·s·dy; GEGLU's t·(Φ(g) + g·φ(g)) and g·Φ(g)·dy. The logistic is 1/(1 + e^−g)
//! and Φ, φ are `flex_exp`'s, vectorized (before, SwiGLU's logistic was `flex`'s, a branch on
//! the sign and `libm`'s `expf` per value: the gradient ran 1.6 times the forward in a block;
//! GEGLU ran on Burn's operations); the products run in the order Burn's autodiff runs them
//! (tested against it within float rounding), and every layout of a plan runs this kernel,
//! so pipelines still train to the single device's numbers.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};

use crate::backend::flex_exp;
use crate::backend::gated::Gate;

/// A contiguous `f32` tensor of an even last dimension 2f: (f, its values); None otherwise.
fn halves(t: &FlexTensor) -> Option<(usize, &[f32])> {
    let w = *t.layout().shape().as_slice().last()?;
    if t.dtype() != DType::F32 || !t.layout().is_contiguous() || w == 0 || !w.is_multiple_of(2) {
        return None;
    }
    let n = t.layout().num_elements();
    let values = t.storage::<f32>();
    (values.len() >= n).then_some((w / 2, &values[..n]))
}

/// act(gate)·up of `up` (its last dimension the gate's f columns then the up's f): the
/// output with last dimension f; None where Burn's operations should run (another dtype or
/// an odd width).
pub(crate) fn forward(up: &FlexTensor, gate: Gate) -> Option<FlexTensor> {
    let up = up.to_contiguous();
    let (f, xs) = halves(&up)?;
    let mut y = vec![0f32; xs.len() / 2];
    for (row, out) in xs.chunks_exact(2 * f).zip(y.chunks_exact_mut(f)) {
        let (g, u) = row.split_at(f);
        match gate {
            Gate::Silu => flex_exp::silu_gated(g, u, out),
            Gate::Gelu => flex_exp::gelu_gated(g, u, out),
        }
    }
    let mut shape = up.layout().shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = f;
    }
    Some(FlexTensor::from_data(TensorData::new(y, shape)))
}

/// [`forward`]'s gradient with respect to `up` from its output's gradient `dy`, in `up`'s
/// shape; None where Burn's operations should run.
pub(crate) fn gradients(up: &FlexTensor, dy: &FlexTensor, gate: Gate) -> Option<FlexTensor> {
    let (up, dy) = (up.to_contiguous(), dy.to_contiguous());
    let (f, xs) = halves(&up)?;
    let dys = dy.storage::<f32>();
    if dy.dtype() != DType::F32 || dy.layout().num_elements() * 2 != xs.len() || dys.len() * 2 < xs.len() {
        return None;
    }
    let mut d_up = vec![0f32; xs.len()];
    for ((row, grad), out) in xs.chunks_exact(2 * f).zip(dys.chunks_exact(f)).zip(d_up.chunks_exact_mut(2 * f)) {
        let ((g, u), (d_gate, d_u)) = (row.split_at(f), out.split_at_mut(f));
        match gate {
            Gate::Silu => flex_exp::silu_gated_grad(g, u, grad, d_gate, d_u),
            Gate::Gelu => flex_exp::gelu_gated_grad(g, u, grad, d_gate, d_u),
        }
    }
    Some(FlexTensor::from_data(TensorData::new(d_up, up.layout().shape().to_vec())))
}

#[cfg(test)]
mod tests;
