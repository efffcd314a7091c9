//! Layer normalisation and RMSNorm over the last dimension on Burn's `flex` backend, fused.
//!
//! On Burn's operations (`crate::backend::row_norm`, and the executor's norms before this)
//! the forward makes about ten passes over the activation — the mean, the centred copy, its
//! square, their mean, the scaled copy, the gain's product and the bias's sum, each of the
//! last two broadcasting a [1, d] vector over the rows through `flex`'s general strided
//! path — and its backward through autodiff about twenty: a transformer classifier's layer
//! norm of 1,024 rows of 512 took 1.1 ms forward and 3.2 ms backward on a 2-core Xeon,
//! 2.2 and 3.2 times its price as the traffic of one read and one write
//! (docs/benchmarks.md). Here each row is read twice for its statistics (the mean, then the
//! mean square of the distance to it, in `f64`; in cache) and once more for the output; the
//! backward reads each row of the input and the output's gradient twice, once for the
//! row's two sums (Σ g, Σ g·x̂ with g = dy·γ) and once for the input's gradient, adding into
//! the gain's and bias's gradients as it goes. The sums run in another order than Burn's
//! (tested against its operations within float rounding); every layout of a plan runs this
//! kernel, so pipelines still train to the single device's numbers.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};

/// A contiguous `f32` tensor's row length d (its last dimension), rows and values, where
/// every tensor of `per_column` holds d `f32` values; None for anything else.
fn rows<'a>(x: &'a FlexTensor, per_column: &[&FlexTensor]) -> Option<(usize, usize, &'a [f32])> {
    let dims = x.layout().shape().as_slice();
    let d = *dims.last()?;
    let ok = |t: &FlexTensor| t.dtype() == DType::F32 && t.layout().num_elements() == d;
    if x.dtype() != DType::F32 || !x.layout().is_contiguous() || d == 0 || !per_column.iter().all(|t| ok(t)) {
        return None;
    }
    let values = x.storage::<f32>();
    let n = x.layout().num_elements() / d;
    (values.len() >= n * d && n > 0).then_some((d, n, &values[..n * d]))
}

/// A per-column tensor's values (contiguous copy where it is a view).
fn values(t: &FlexTensor) -> Vec<f32> {
    t.to_contiguous().storage::<f32>().to_vec()
}

/// The sum of `f` over `a` paired with `b`, in `f64`, eight running sums side by side.
fn sum_of(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f64) -> f64 {
    let (mut lanes, (ac, bc)) = ([0f64; 8], (a.chunks_exact(8), b.chunks_exact(8)));
    let rest: f64 = ac.remainder().iter().zip(bc.remainder()).map(|(&u, &v)| f(u, v)).sum();
    for (a8, b8) in ac.zip(bc) {
        for ((l, &u), &v) in lanes.iter_mut().zip(a8).zip(b8) {
            *l += f(u, v);
        }
    }
    lanes.iter().sum::<f64>() + rest
}

/// A row's μ (0 without `centre`) and r = 1/√(mean((x − μ)²) + ε).
fn statistics(row: &[f32], centre: bool, eps: f64) -> (f32, f32) {
    let d = row.len() as f64;
    let mean = if centre { sum_of(row, row, |v, _| f64::from(v)) / d } else { 0.0 };
    let var = sum_of(row, row, |v, _| (f64::from(v) - mean).powi(2)) / d;
    (mean as f32, (1.0 / (var + eps).sqrt()) as f32)
}

/// The row norm of `x` by γ (and β: a layer norm; none: RMSNorm), as Burn's operations
/// compute it — ((x − μ)·r)·γ (+ β): (output in `x`'s shape, each row's μ and r as
/// [rows, 2]); None where Burn's operations should run.
pub(crate) fn forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: Option<&FlexTensor>,
    eps: f64,
) -> Option<(FlexTensor, FlexTensor)> {
    let x = x.to_contiguous();
    let per_column: Vec<&FlexTensor> = std::iter::once(gamma).chain(beta).collect();
    let (d, n, xs) = rows(&x, &per_column)?;
    let gamma = values(gamma);
    let beta = beta.map(values);
    let mut y = Vec::with_capacity(n * d);
    let mut stats = Vec::with_capacity(2 * n);
    for row in xs.chunks_exact(d) {
        let (m, r) = statistics(row, beta.is_some(), eps);
        stats.extend([m, r]);
        match &beta {
            Some(b) => y.extend(row.iter().zip(&gamma).zip(b).map(|((&v, &g), &b)| (v - m) * r * g + b)),
            None => y.extend(row.iter().zip(&gamma).map(|(&v, &g)| (v - m) * r * g)),
        }
    }
    let shape = x.layout().shape().to_vec();
    Some((FlexTensor::from_data(TensorData::new(y, shape)), FlexTensor::from_data(TensorData::new(stats, [n, 2]))))
}

/// [`forward`]'s gradients (dx, dγ, dβ where `beta`) from its output's gradient `dy`, with
/// the rows' statistics it kept (`crate::backend::row_norm::gradients` says how); None
/// where Burn's operations should run.
pub(crate) fn gradients(
    x: &FlexTensor,
    gamma: &FlexTensor,
    stats: &FlexTensor,
    dy: &FlexTensor,
    beta: bool,
) -> Option<(FlexTensor, FlexTensor, Option<FlexTensor>)> {
    let (x, dy, stats) = (x.to_contiguous(), dy.to_contiguous(), stats.to_contiguous());
    let (d, n, xs) = rows(&x, &[gamma])?;
    let (_, _, dys) = rows(&dy, &[gamma])?;
    if dy.layout().shape() != x.layout().shape()
        || stats.dtype() != DType::F32
        || stats.layout().num_elements() != 2 * n
    {
        return None;
    }
    let (gamma, stats) = (values(gamma), stats.storage::<f32>());
    let (mut dx, mut d_gamma, mut d_beta) = (Vec::with_capacity(n * d), vec![0f64; d], vec![0f64; d]);
    let mut g = vec![0f32; d];
    for ((row, grad), st) in xs.chunks_exact(d).zip(dys.chunks_exact(d)).zip(stats.chunks_exact(2)) {
        let (m, r) = (st[0], st[1]);
        for ((gi, &dyi), &gm) in g.iter_mut().zip(grad).zip(&gamma) {
            *gi = dyi * gm;
        }
        let mean_g = if beta { (sum_of(&g, &g, |v, _| f64::from(v)) / d as f64) as f32 } else { 0.0 };
        let dot = (sum_of(&g, row, |gi, v| f64::from(gi) * f64::from((v - m) * r)) / d as f64) as f32;
        dx.extend(g.iter().zip(row).map(|(&gi, &v)| (gi - mean_g - (v - m) * r * dot) * r));
        for (((dg, db), &dyi), &v) in d_gamma.iter_mut().zip(d_beta.iter_mut()).zip(grad).zip(row) {
            *dg += f64::from(dyi * ((v - m) * r));
            *db += f64::from(dyi);
        }
    }
    let column = |v: Vec<f64>| FlexTensor::from_data(TensorData::new(v.into_iter().map(|s| s as f32).collect(), [d]));
    let shape = x.layout().shape().to_vec();
    Some((FlexTensor::from_data(TensorData::new(dx, shape)), column(d_gamma), beta.then(|| column(d_beta))))
}

#[cfg(test)]
mod tests;
