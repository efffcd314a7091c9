//! Max pooling and its gradient on Burn's `flex` backend.
//!
//! `flex` 0.21 pools through its 3-D kernel, whose inner loop keeps its running maximum and
//! index on the stack: 2.2 ms for a 2 × 2 pool of an [8, 32, 32, 32] input, 8 ns a value
//! read, 36 times its memory-bound price (`specs/cnn.yaml`; docs/benchmarks.md). This is the
//! same scan — each window's values in row-major order, the first largest kept (a NaN never
//! replaces it, as in flex) — one input plane at a time, with the same output and the same
//! indices (each window's largest value's offset in its plane, `i64`), so flex's own
//! backward reads them too; its gradient adds each output's gradient at its index.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};

use crate::backend::pool::PoolWindow as Window;

/// The output size along `axis` of an input of `size` values, if at least one window fits.
fn out(window: &Window, size: usize, axis: usize) -> Option<usize> {
    let padded = size + 2 * window.padding[axis];
    (window.kernel[axis] > 0 && window.stride[axis] > 0 && padded >= window.kernel[axis])
        .then(|| (padded - window.kernel[axis]) / window.stride[axis] + 1)
}

/// The input positions `lo..hi` along `axis` (of `size` values) that output `o` reads.
fn span(window: &Window, o: usize, size: usize, axis: usize) -> (usize, usize) {
    let start = o * window.stride[axis];
    let lo = start.saturating_sub(window.padding[axis]).min(size);
    let hi = (start + window.kernel[axis]).saturating_sub(window.padding[axis]).min(size);
    (lo, hi)
}

/// The pooled [n, c, ho, wo] `f32` tensor and its indices; None where flex's own should run
/// (another dtype or rank, an empty plane, a window that fits nowhere).
pub(crate) fn forward(x: &FlexTensor, window: Window) -> Option<(FlexTensor, FlexTensor)> {
    let &[n, c, h, w] = x.layout().shape().as_slice() else { return None };
    if x.dtype() != DType::F32 || h * w == 0 {
        return None;
    }
    let (ho, wo) = (out(&window, h, 0)?, out(&window, w, 1)?);
    let x = x.to_contiguous();
    let xs = x.storage::<f32>();
    let outputs = n * c * ho * wo;
    let (mut out, mut indices) = (Vec::with_capacity(outputs), Vec::with_capacity(outputs));
    let planes = xs.chunks_exact(h * w).take(n * c);
    if window == HALVING {
        for plane in planes {
            halve(plane, [w, ho, wo], &mut out, &mut indices);
        }
        return Some(pooled(out, indices, [n, c, ho, wo]));
    }
    let rows: Vec<(usize, usize)> = (0..ho).map(|oh| span(&window, oh, h, 0)).collect();
    let cols: Vec<(usize, usize)> = (0..wo).map(|ow| span(&window, ow, w, 1)).collect();
    for plane in planes {
        for &(h0, h1) in &rows {
            for &(w0, w1) in &cols {
                if h0 >= h1 || w0 >= w1 {
                    // a window wholly in the padding (flex's answer)
                    out.push(f32::NEG_INFINITY);
                    indices.push(-1i64);
                    continue;
                }
                // the window's first value, then any larger one after it in row-major order
                let (mut at, mut best) = (h0 * w + w0, plane[h0 * w + w0]);
                for ih in h0..h1 {
                    let row = ih * w;
                    for (iw, &v) in plane[row + w0..row + w1].iter().enumerate() {
                        if v > best {
                            (at, best) = (row + w0 + iw, v);
                        }
                    }
                }
                out.push(best);
                indices.push(at as i64);
            }
        }
    }
    Some(pooled(out, indices, [n, c, ho, wo]))
}

fn pooled(out: Vec<f32>, indices: Vec<i64>, shape: [usize; 4]) -> (FlexTensor, FlexTensor) {
    (FlexTensor::from_data(TensorData::new(out, shape)), FlexTensor::from_data(TensorData::new(indices, shape)))
}

/// The CNNs' pool: 2 × 2 windows, stride 2, no padding.
const HALVING: Window = Window { kernel: [2, 2], stride: [2, 2], padding: [0, 0] };

/// [`HALVING`]'s scan of one plane `w` wide into `ho` × `wo` outputs: each window's four
/// values in row-major order, the first largest kept, as the general scan keeps it, without
/// its per-window bounds (an [8, 32, 32, 32] input: 0.39 ms in the general scan).
fn halve(plane: &[f32], [w, ho, wo]: [usize; 3], out: &mut Vec<f32>, indices: &mut Vec<i64>) {
    for oh in 0..ho {
        let (top, bottom) = (&plane[2 * oh * w..][..2 * wo], &plane[(2 * oh + 1) * w..][..2 * wo]);
        for (ow, (t, b)) in top.chunks_exact(2).zip(bottom.chunks_exact(2)).enumerate() {
            let first = 2 * oh * w + 2 * ow;
            let (mut at, mut best) = (first, t[0]);
            for (v, i) in [(t[1], first + 1), (b[0], first + w), (b[1], first + w + 1)] {
                if v > best {
                    (at, best) = (i, v);
                }
            }
            out.push(best);
            indices.push(at as i64);
        }
    }
}

/// The input's gradient [n, c, h, w] (`shape`) from the output's `dy` and [`forward`]'s
/// `indices`; None where flex's own should run.
pub(crate) fn backward(shape: [usize; 4], dy: &FlexTensor, indices: &FlexTensor) -> Option<FlexTensor> {
    let [n, c, h, w] = shape;
    let out_shape = dy.layout().shape().as_slice().to_vec();
    if dy.dtype() != DType::F32 || indices.dtype() != DType::I64 || indices.layout().shape().as_slice() != out_shape {
        return None;
    }
    let &[dn, dc, ho, wo] = out_shape.as_slice() else { return None };
    if (dn, dc) != (n, c) || h * w == 0 || ho * wo == 0 {
        return None;
    }
    let (dy, indices) = (dy.to_contiguous(), indices.to_contiguous());
    let (ds, is) = (dy.storage::<f32>(), indices.storage::<i64>());
    let mut dx = vec![0.0f32; n * c * h * w];
    for ((plane, grads), at) in dx.chunks_exact_mut(h * w).zip(ds.chunks_exact(ho * wo)).zip(is.chunks_exact(ho * wo)) {
        for (&g, &i) in grads.iter().zip(at) {
            // an index outside the plane (none from `forward`) adds nowhere
            if let Some(d) = usize::try_from(i).ok().and_then(|i| plane.get_mut(i)) {
                *d += g;
            }
        }
    }
    Some(FlexTensor::from_data(TensorData::new(dx, shape)))
}

#[cfg(test)]
mod tests;
