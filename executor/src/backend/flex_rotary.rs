//! Rotary position embeddings on Burn's `flex` backend, fused.
//!
//! On Burn's operations (`crate::backend::rotary`) a rotation makes six passes over the
//! queries or keys — the halves narrowed out, one negated, the two joined, each multiplied
//! by its table and the products summed — and Burn's autodiff about as many again for the
//! backward: `specs/llama-tiny.yaml`'s block took 1.42 ms forward and 1.83 ms backward in
//! `pipec profile`, 1.21 and 1.62 without rotary embeddings (docs/benchmarks.md). Here each row is read once and its
//! rotation written, in either direction: x·c + rotate(x)·s forward, and the transposed map
//! dy·c + (d₂, −d₁) of d = dy·s backward, the products in the order of Burn's operations
//! (tested against them).

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};

use crate::backend::rotary::Rotation;

/// `t`'s values, contiguous `f32` of [.., rows, dh] as `r`'s; None otherwise.
fn blocks<'a>(t: &'a FlexTensor, r: &Rotation) -> Option<&'a [f32]> {
    let dims = t.layout().shape().as_slice();
    let n = t.layout().num_elements();
    let fits = dims.len() >= 2 && dims[dims.len() - 2] == r.rows && dims[dims.len() - 1] == r.dh;
    if t.dtype() != DType::F32 || !t.layout().is_contiguous() || !fits || !r.dh.is_multiple_of(2) || n == 0 {
        return None;
    }
    let values = t.storage::<f32>();
    (values.len() >= n).then_some(&values[..n])
}

/// Each row of `t` and its table's cosines and sines, in `t`'s order, written by `turn`
/// into a tensor of `t`'s shape; None where Burn's operations should run.
fn each_row(t: &FlexTensor, r: &Rotation, turn: impl Fn(&[f32], &[f32], &[f32], &mut [f32])) -> Option<FlexTensor> {
    let t = t.to_contiguous();
    let xs = blocks(&t, r)?;
    let mut out = vec![0f32; xs.len()];
    let table = r.cos.chunks_exact(r.dh).zip(r.sin.chunks_exact(r.dh));
    for (x, o) in xs.chunks_exact(r.rows * r.dh).zip(out.chunks_exact_mut(r.rows * r.dh)) {
        for ((row, o), (c, s)) in x.chunks_exact(r.dh).zip(o.chunks_exact_mut(r.dh)).zip(table.clone()) {
            turn(row, c, s, o);
        }
    }
    Some(FlexTensor::from_data(TensorData::new(out, t.layout().shape().to_vec())))
}

/// `x` [.., rows, dh] turned by `r`: x·c + rotate(x)·s.
pub(crate) fn forward(x: &FlexTensor, r: &Rotation) -> Option<FlexTensor> {
    let half = r.dh / 2;
    each_row(x, r, |x, c, s, o| {
        for j in 0..half {
            o[j] = x[j] * c[j] + -x[j + half] * s[j];
            o[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
        }
    })
}

/// [`forward`]'s gradient from its output's gradient `dy`: dy·c + (d₂, −d₁), d = dy·s.
pub(crate) fn gradients(dy: &FlexTensor, r: &Rotation) -> Option<FlexTensor> {
    let half = r.dh / 2;
    each_row(dy, r, |g, c, s, o| {
        for j in 0..half {
            o[j] = g[j] * c[j] + g[j + half] * s[j + half];
            o[j + half] = g[j + half] * c[j + half] + -(g[j] * s[j]);
        }
    })
}

#[cfg(test)]
mod tests;
