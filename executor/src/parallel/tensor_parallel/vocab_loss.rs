//! Megatron-LM's vocabulary-parallel cross-entropy: the loss over scores split by tensor
//! parallelism along the vocabulary, computed without gathering them.

use burn::prelude::*;

use crate::backend::kernels::ExecBackend;
use crate::error::{ExecError, Result};
use crate::nn::layers::Act;
use crate::nn::params::host_f32;

/// Megatron-LM's vocabulary-parallel cross-entropy: the mean over every row of `logits`
/// (this rank's columns `first..` of the scores; [batch, seq, part] or [batch, part]) of
/// the cross-entropy with `classes`, computed without gathering the scores. Each rank
/// exchanges three per-row figures (its maximum, its sum of exponentials, the target's
/// score where it holds the target); every rank gets the whole loss, and the gradient of
/// its own scores: softmax minus the one-hot target, over the row count.
pub fn vocab_parallel_loss<B: ExecBackend>(
    logits: Act<B>,
    classes: &[i64],
    first: usize,
    rank: usize,
    tp: usize,
    reduce: &mut dyn FnMut(Vec<f32>) -> Result<Vec<f32>>,
) -> Result<Tensor<B, 1>> {
    let logits: Tensor<B, 2> = match logits {
        Act::D3(t) => {
            let [n, s, v] = t.dims();
            t.reshape([n * s, v])
        }
        Act::D2(t) => t,
        other => {
            return Err(ExecError::Shape(format!("the loss needs [batch, outputs] scores, got {:?}", other.dims())))
        }
    };
    let [rows, part] = logits.dims();
    if classes.len() != rows {
        return Err(ExecError::Data(format!("{} targets for {rows} rows of scores", classes.len())));
    }
    let device = logits.device();
    let column = |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [rows, 1]), &device);
    // the row's maximum over every rank: each in its own slot, summed, then the largest
    let local_max = host_f32(logits.clone().detach().max_dim(1).into_data())?;
    let mut slots = vec![0.0f32; rows * tp];
    for (i, m) in local_max.iter().enumerate() {
        slots[i * tp + rank] = *m;
    }
    let slots = reduce(slots)?;
    let max: Vec<f32> = slots.chunks(tp.max(1)).map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
    let shifted = logits - column(max);
    // the sum of exponentials over the whole row: the value summed over the ranks, the
    // gradient of this rank's own terms
    let local_sum = shifted.clone().exp().sum_dim(1);
    let total = column(reduce(host_f32(local_sum.clone().detach().into_data())?)?);
    let sum = local_sum.clone() + (total - local_sum.detach());
    // the target's shifted score, on the rank whose columns hold it
    let (mut index, mut held) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    for &c in classes {
        let local = c - first as i64;
        let inside = local >= 0 && (local as usize) < part;
        index.push(if inside { local } else { 0 });
        held.push(if inside { 1.0f32 } else { 0.0 });
    }
    let index = Tensor::<B, 2, Int>::from_data(TensorData::new(index, [rows, 1]), &device);
    let local_target = shifted.gather(1, index) * column(held);
    let target_total = column(reduce(host_f32(local_target.clone().detach().into_data())?)?);
    let target = local_target.clone() + (target_total - local_target.detach());
    Ok((sum.log() - target).mean())
}
