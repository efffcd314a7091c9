//! Max pooling as an autodiff node ([`Kernels::max_pool`] on `Autodiff`): the inner
//! backend's pool and, in the backward, its input gradient ([`Kernels::max_pool_grad`])
//! from the indices the forward found.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::tracked;
use crate::backend::kernels::{Kernels, Pooled};
use crate::backend::pool::PoolWindow;

/// [`Kernels::max_pool`] on an autodiff backend: the input is the node's parent; it keeps
/// the input and the indices.
pub(super) fn max_pool<I: Kernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<I, C>>,
    window: PoolWindow,
) -> Pooled<Autodiff<I, C>> {
    let (out, indices) = I::max_pool(x.primitive.clone(), window);
    let state = || PoolState { x: x.primitive.clone(), indices: indices.clone() };
    (tracked::<I, C, _, 1>(PoolBackward { window }, [&x], state, out), indices.clone())
}

/// What the backward keeps.
#[derive(Debug, Clone)]
struct PoolState<I: Backend> {
    x: FloatTensor<I>,
    indices: IntTensor<I>,
}

/// The backward of [`max_pool`].
#[derive(Debug)]
struct PoolBackward {
    window: PoolWindow,
}

impl<I: Kernels> Backward<I, 1> for PoolBackward {
    type State = PoolState<I>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let PoolState { x, indices } = ops.state;
        let window = self.window;
        burn::backend::autodiff::ops::unary::<I, _>(ops.parents, ops.node, grads, |dy| {
            I::max_pool_grad(x, window, dy, indices)
        });
    }
}
