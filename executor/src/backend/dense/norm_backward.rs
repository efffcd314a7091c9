//! Batch normalisation in training and the row norms (layer normalisation, RMSNorm) as
//! autodiff nodes ([`Kernels::batch_norm`], [`Kernels::row_norm`] on `Autodiff`): the inner
//! backend's forward and, in the backward, its gradients ([`Kernels::batch_norm_grads`],
//! [`Kernels::row_norm_grads`]) from the statistics the forward used.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;

use super::tracked;
use crate::backend::kernels::{Kernels, Normalised, RowNormed};

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

/// [`Kernels::row_norm`] on an autodiff backend: the input, γ and (a layer norm's) β are the
/// node's parents; it keeps the input, γ and the rows' statistics, which it returns
/// untracked.
pub(super) fn row_norm<I: Kernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<I, C>>,
    gamma: FloatTensor<Autodiff<I, C>>,
    beta: Option<FloatTensor<Autodiff<I, C>>>,
    eps: f64,
) -> RowNormed<Autodiff<I, C>> {
    let (y, stats) =
        I::row_norm(x.primitive.clone(), gamma.primitive.clone(), beta.as_ref().map(|b| b.primitive.clone()), eps);
    let state = || RowState { x: x.primitive.clone(), gamma: gamma.primitive.clone(), stats: stats.clone() };
    let y = match &beta {
        Some(beta) => tracked::<I, C, _, 3>(RowNormBackward, [&x, &gamma, beta], state, y),
        None => tracked::<I, C, _, 2>(RowNormBackward, [&x, &gamma], state, y),
    };
    (y, <Autodiff<I, C> as AutodiffBackend>::from_inner(stats))
}

/// What a row norm's backward keeps.
#[derive(Debug, Clone)]
struct RowState<I: Backend> {
    x: FloatTensor<I>,
    gamma: FloatTensor<I>,
    stats: FloatTensor<I>,
}

/// The backward of [`row_norm`]: of a layer norm (three parents) or RMSNorm (two).
#[derive(Debug)]
struct RowNormBackward;

impl RowNormBackward {
    fn register<I: Kernels, const N: usize>(ops: Ops<RowState<I>, N>, grads: &mut Gradients) {
        let dy = grads.consume::<I>(&ops.node);
        let RowState { x, gamma, stats } = ops.state;
        let (dx, d_gamma, d_beta) = I::row_norm_grads(x, gamma, stats, dy, N == 3);
        for (to, g) in ops.parents.into_iter().zip([Some(dx), Some(d_gamma), d_beta]) {
            if let (Some(node), Some(g)) = (to, g) {
                grads.register::<I>(node.id, g);
            }
        }
    }
}

impl<I: Kernels> Backward<I, 3> for RowNormBackward {
    type State = RowState<I>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        Self::register(ops, grads);
    }
}

impl<I: Kernels> Backward<I, 2> for RowNormBackward {
    type State = RowState<I>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        Self::register(ops, grads);
    }
}
