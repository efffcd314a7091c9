//! Batch normalisation in training and its gradients on Burn's `flex` backend, fused.
//!
//! On Burn's operations (`crate::backend::norm`) the forward makes ten passes over the
//! activation (the mean, the centred copy, its square, their mean, the scaled copy, the
//! shifted output) and its backward through autodiff about twenty: ResNet-small's batch
//! norms took 1.5–2 times their price as the memory traffic of one read and one write
//! (docs/benchmarks.md). Here each channel's planes are read twice for its statistics
//! (the mean, then the mean square of the distance to it, in `f64`) and once more for the
//! output; the backward reads the input and the output's gradient twice, once for the two
//! per-channel sums (Σ dy, Σ dy·x̂) and once for the input's gradient. The sums run in
//! another order than Burn's (tested against its operations within float rounding); every
//! layout of a plan runs this kernel, so pipelines still train to the single device's
//! numbers.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};

/// A contiguous `f32` [n, c, h, w] tensor's sizes and values, with per-channel `f32`
/// tensors of c values; None for anything else.
fn planes<'a>(x: &'a FlexTensor, per_channel: &[&FlexTensor]) -> Option<([usize; 4], &'a [f32])> {
    let &[n, c, h, w] = x.layout().shape().as_slice() else { return None };
    let ok = |t: &FlexTensor| t.dtype() == DType::F32 && t.layout().num_elements() == c;
    if x.dtype() != DType::F32 || !x.layout().is_contiguous() || n * h * w == 0 || !per_channel.iter().all(|t| ok(t)) {
        return None;
    }
    Some(([n, c, h, w], x.storage::<f32>()))
}

/// A per-channel tensor's values (contiguous copy where it is a view).
fn values(t: &FlexTensor) -> Vec<f32> {
    t.to_contiguous().storage::<f32>().to_vec()
}

fn vector(v: Vec<f32>) -> FlexTensor {
    let n = v.len();
    FlexTensor::from_data(TensorData::new(v, [n]))
}

/// The planes of channel `ch` of a contiguous [n, c, hw] tensor.
fn channel(v: &[f32], [n, c, hw]: [usize; 3], ch: usize) -> impl Iterator<Item = &[f32]> {
    (0..n).map(move |s| &v[(s * c + ch) * hw..][..hw])
}

/// The sum of `f` over the values of `planes`, paired value by value with those of `with`,
/// in `f64`, eight running sums side by side (one chain of dependent adds would take a cycle
/// or four per value).
fn sum_of<'a>(
    planes: impl Iterator<Item = &'a [f32]>,
    with: impl Iterator<Item = &'a [f32]>,
    f: impl Fn(f32, f32) -> f64,
) -> f64 {
    let (mut lanes, mut rest) = ([0f64; 8], 0f64);
    for (a, b) in planes.zip(with) {
        let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
        rest += ac.remainder().iter().zip(bc.remainder()).map(|(&u, &v)| f(u, v)).sum::<f64>();
        for (a8, b8) in ac.zip(bc) {
            for ((l, &u), &v) in lanes.iter_mut().zip(a8).zip(b8) {
                *l += f(u, v);
            }
        }
    }
    lanes.iter().sum::<f64>() + rest
}

/// `(x − mean)·γ/√(var + ε) + β` with `x`'s per-channel mean and biased variance:
/// (output, mean, variance); None where flex's operations should run.
pub(crate) fn forward(
    x: &FlexTensor,
    gamma: &FlexTensor,
    beta: &FlexTensor,
    eps: f64,
) -> Option<(FlexTensor, FlexTensor, FlexTensor)> {
    let x = x.to_contiguous();
    let ([n, c, h, w], xs) = planes(&x, &[gamma, beta])?;
    let (gamma, beta) = (values(gamma), values(beta));
    let (hw, count) = (h * w, (n * h * w) as f64);
    let dims = [n, c, hw];
    let (mut mean, mut var) = (Vec::with_capacity(c), Vec::with_capacity(c));
    for ch in 0..c {
        let plane = || channel(xs, dims, ch);
        let m = sum_of(plane(), plane(), |v, _| f64::from(v)) / count;
        let d = sum_of(plane(), plane(), |v, _| (f64::from(v) - m).powi(2)) / count;
        mean.push(m as f32);
        var.push(d as f32);
    }
    // as Burn's operations compute it: the centred value times γ/√(var + ε), plus β
    let scale: Vec<f32> = gamma.iter().zip(&var).map(|(g, v)| g / (v + eps as f32).sqrt()).collect();
    let mut y = Vec::with_capacity(xs.len());
    for (i, inp) in xs.chunks_exact(hw).enumerate() {
        let ch = i % c;
        let (m, k, b) = (mean[ch], scale[ch], beta[ch]);
        y.extend(inp.iter().map(|&v| (v - m) * k + b));
    }
    Some((FlexTensor::from_data(TensorData::new(y, [n, c, h, w])), vector(mean), vector(var)))
}

/// [`forward`]'s gradients (dx, dγ, dβ) from its output's gradient `dy`, with the mean and
/// variance it used (`crate::backend::norm::gradients` says how); None where flex's
/// operations should run.
pub(crate) fn gradients(
    x: &FlexTensor,
    gamma: &FlexTensor,
    (mean, var): (&FlexTensor, &FlexTensor),
    dy: &FlexTensor,
    eps: f64,
) -> Option<(FlexTensor, FlexTensor, FlexTensor)> {
    let (x, dy) = (x.to_contiguous(), dy.to_contiguous());
    let ([n, c, h, w], xs) = planes(&x, &[gamma, mean, var])?;
    let (_, dys) = planes(&dy, &[gamma])?;
    if dy.layout().shape().as_slice() != [n, c, h, w] {
        return None;
    }
    let (gamma, mean, var) = (values(gamma), values(mean), values(var));
    let (hw, count) = (h * w, (n * h * w) as f64);
    let dims = [n, c, hw];
    let inv_std: Vec<f32> = var.iter().map(|v| 1.0 / (v + eps as f32).sqrt()).collect();
    let (mut d_gamma, mut d_beta) = (Vec::with_capacity(c), Vec::with_capacity(c));
    for ch in 0..c {
        let (m, k) = (mean[ch], inv_std[ch]);
        let (inputs, grads) = (|| channel(xs, dims, ch), || channel(dys, dims, ch));
        let sum = sum_of(grads(), grads(), |d, _| f64::from(d));
        let dot = sum_of(inputs(), grads(), |v, d| f64::from(d) * f64::from((v - m) * k));
        d_beta.push(sum as f32);
        d_gamma.push(dot as f32);
    }
    let mut dx = Vec::with_capacity(xs.len());
    for (i, (xp, dp)) in xs.chunks_exact(hw).zip(dys.chunks_exact(hw)).enumerate() {
        let ch = i % c;
        let (m, k) = (mean[ch], inv_std[ch]);
        let scale = gamma[ch] * k / count as f32;
        let (db, dg, nf) = (d_beta[ch], d_gamma[ch], count as f32);
        dx.extend(xp.iter().zip(dp).map(|(&v, &d)| (d * nf - db - (v - m) * k * dg) * scale));
    }
    Some((FlexTensor::from_data(TensorData::new(dx, [n, c, h, w])), vector(d_gamma), vector(d_beta)))
}

#[cfg(test)]
pub(crate) mod tests;
