//! The mean cross-entropy of a microbatch's logits on Burn's `flex` backend, fused.
//!
//! On Burn's operations (`crate::backend::cross_entropy`, the executor's loss before this)
//! the forward's log-softmax makes about six passes over the logits, and Burn's autodiff
//! scatters the classes' gradient into a zero tensor of the logits' shape and runs the
//! log-softmax's backward (about six more): on `specs/llama-tiny.yaml` (256 rows of 512
//! logits a microbatch, 2-core Xeon) the last stage's forward took 1.89 ms a microbatch in
//! `pipec run`'s trace against 1.26 ms for its layers alone in `pipec profile`, where the
//! loss is priced as one pass of exponentials, 0.27 ms (docs/benchmarks.md). Here the
//! forward reads each row for its maximum, then writes its exponentials (`flex_exp`'s,
//! vectorized; its softmax once divided by their sum, kept for the backward); the backward
//! writes softmax − onehot, scaled, in one pass. The sums run in `f64`, in another order
//! than Burn's (the loss equal within float rounding, tested); every layout of a plan runs
//! this kernel, so pipelines still train to the single device's numbers.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};

/// A contiguous `f32` [n, c] tensor's values with n, c; None otherwise.
fn matrix(t: &FlexTensor) -> Option<(usize, usize, &[f32])> {
    let &[n, c] = t.layout().shape().as_slice() else { return None };
    if t.dtype() != DType::F32 || !t.layout().is_contiguous() || n == 0 || c == 0 {
        return None;
    }
    let values = t.storage::<f32>();
    (values.len() >= n * c).then_some((n, c, &values[..n * c]))
}

/// The classes as row offsets, each within `c`; None if one is not.
fn offsets(labels: &[i64], c: usize) -> Option<Vec<usize>> {
    labels.iter().map(|&y| usize::try_from(y).ok().filter(|&y| y < c)).collect()
}

/// The mean cross-entropy of `logits` [n, c] with each row's class: the loss [1] and the
/// softmax [n, c]; None where Burn's operations should run (another dtype or layout, a
/// class out of range).
pub(crate) fn forward(logits: &FlexTensor, labels: &[i64]) -> Option<(FlexTensor, FlexTensor)> {
    let logits = logits.to_contiguous();
    let (n, c, xs) = matrix(&logits)?;
    let classes = offsets(labels, c).filter(|o| o.len() == n)?;
    let mut probs = Vec::with_capacity(n * c);
    let mut total = 0f64;
    for (row, &y) in xs.chunks_exact(c).zip(&classes) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let start = probs.len();
        probs.extend_from_slice(row);
        crate::backend::flex_exp::exp_shifted(&mut probs[start..], m, crate::backend::flex_exp::EXP_UNDERFLOW);
        let sum: f64 = probs[start..].iter().map(|&e| f64::from(e)).sum();
        let inv = (1.0 / sum) as f32;
        for p in &mut probs[start..] {
            *p *= inv;
        }
        total += sum.ln() - f64::from(row[y] - m);
    }
    let loss = FlexTensor::from_data(TensorData::new(vec![(total / n as f64) as f32], [1]));
    Some((loss, FlexTensor::from_data(TensorData::new(probs, [n, c]))))
}

/// The logits' gradient from the loss's `dy` [1]: (softmax − onehot)·dy/n; None where
/// Burn's operations should run.
pub(crate) fn gradients(probs: &FlexTensor, labels: &[i64], dy: &FlexTensor) -> Option<FlexTensor> {
    let probs = probs.to_contiguous();
    let (n, c, ps) = matrix(&probs)?;
    let classes = offsets(labels, c).filter(|o| o.len() == n)?;
    let dy = dy.to_contiguous();
    if dy.dtype() != DType::F32 || dy.layout().num_elements() != 1 {
        return None;
    }
    let scale = dy.storage::<f32>().first().copied()? / n as f32;
    let mut d = Vec::with_capacity(n * c);
    for (row, &y) in ps.chunks_exact(c).zip(&classes) {
        let start = d.len();
        d.extend(row.iter().map(|&p| p * scale));
        d[start + y] -= scale;
    }
    Some(FlexTensor::from_data(TensorData::new(d, [n, c])))
}

#[cfg(test)]
mod tests;
