//! Batch normalisation in training as an autodiff node ([`Kernels::batch_norm`] on
//! `Autodiff`): the inner backend's forward and, in the backward, its gradients
//! ([`Kernels::batch_norm_grads`]) from the statistics the forward used.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;

use super::tracked;
use crate::backend::kernels::{Kernels, Normalised};

/// [`Kernels::batch_norm`] on an autodiff backend: the input, γ and β are the node's
/// parents; it keeps the input, γ and the statistics, which it returns untracked.
pub(super) fn batch_norm<I: Kernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<I, C>>,
    gamma: FloatTensor<Autodiff<I, C>>,
    beta: FloatTensor<Autodiff<I, C>>,
    eps: f64,
) -> Normalised<Autodiff<I, C>> {
    let (y, mean, var) = I::batch_norm(x.primitive.clone(), gamma.primitive.clone(), beta.primitive.clone(), eps);
    let state =
        || NormState { x: x.primitive.clone(), gamma: gamma.primitive.clone(), mean: mean.clone(), var: var.clone() };
    let y = tracked::<I, C, _, 3>(NormBackward { eps }, [&x, &gamma, &beta], state, y);
    (y, <Autodiff<I, C> as AutodiffBackend>::from_inner(mean), <Autodiff<I, C> as AutodiffBackend>::from_inner(var))
}

/// What the backward keeps.
#[derive(Debug, Clone)]
struct NormState<I: Backend> {
    x: FloatTensor<I>,
    gamma: FloatTensor<I>,
    mean: FloatTensor<I>,
    var: FloatTensor<I>,
}

/// The backward of [`batch_norm`].
#[derive(Debug)]
struct NormBackward {
    eps: f64,
}

impl<I: Kernels> Backward<I, 3> for NormBackward {
    type State = NormState<I>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<I>(&ops.node);
        let NormState { x, gamma, mean, var } = ops.state;
        let (dx, d_gamma, d_beta) = I::batch_norm_grads(x, gamma, (mean, var), dy, self.eps);
        for (to, g) in ops.parents.into_iter().zip([dx, d_gamma, d_beta]) {
            if let Some(node) = to {
                grads.register::<I>(node.id, g);
            }
        }
    }
}
