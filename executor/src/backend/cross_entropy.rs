//! The mean cross-entropy of a microbatch's logits with its classes, on Burn's operations:
//! the loss with the softmax its gradient needs, and that gradient
//! ([`Kernels::cross_entropy`]'s and [`Kernels::cross_entropy_grads`]' defaults;
//! `crate::backend::flex_cross_entropy` fuses them on the CPU).
//!
//! Over n rows of logits x with classes y, the loss is −(1/n)·Σ log softmax(x)[y]; its
//! gradient by the logits is (softmax(x) − onehot(y))·dy/n.
//!
//! [`Kernels::cross_entropy`]: crate::backend::kernels::Kernels::cross_entropy
//! [`Kernels::cross_entropy_grads`]: crate::backend::kernels::Kernels::cross_entropy_grads

use burn::tensor::activation;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData, TensorPrimitive};

fn tensor<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// The classes as an [n, 1] index tensor on `device`.
fn classes<B: Backend>(labels: &[i64], device: &B::Device) -> Tensor<B, 2, Int> {
    Tensor::from_data(TensorData::new(labels.to_vec(), [labels.len(), 1]), device)
}

/// The mean cross-entropy of `logits` [n, c] with each row's class: the loss [1] and the
/// softmax [n, c].
pub fn forward<B: Backend>(logits: FloatTensor<B>, labels: &[i64]) -> (FloatTensor<B>, FloatTensor<B>) {
    let logits = tensor::<B, 2>(logits);
    let logp = activation::log_softmax(logits.clone(), 1);
    let loss = logp.clone().gather(1, classes::<B>(labels, &logits.device())).mean().neg();
    (loss.into_primitive().tensor(), logp.exp().into_primitive().tensor())
}

/// The logits' gradient from the loss's `dy` [1]: (softmax − onehot)·dy/n.
pub fn gradients<B: Backend>(probs: FloatTensor<B>, labels: &[i64], dy: FloatTensor<B>) -> FloatTensor<B> {
    let probs = tensor::<B, 2>(probs);
    let [n, _] = probs.dims();
    let device = probs.device();
    let ones = Tensor::<B, 2>::ones([n, 1], &device).neg();
    let shifted = probs.scatter(1, classes::<B>(labels, &device), ones, IndexingUpdateOp::Add);
    let scale = tensor::<B, 1>(dy).reshape([1, 1]) / n.max(1) as f64;
    (shifted * scale).into_primitive().tensor()
}
