//! The fused kernels' autodiff nodes: attention's softmax, GELU, a gated MLP's activation,
//! the rotary embeddings, the attention heads taken out of the features and put back, and
//! the cross-entropy ([`Kernels::attention_softmax`], [`Kernels::gelu_of`],
//! [`Kernels::gated`], [`Kernels::rotary`], [`Kernels::heads`], [`Kernels::place_heads`],
//! [`Kernels::cross_entropy`] on `Autodiff`): the inner backend's forward and, in the
//! backward, its gradient ([`Kernels::attention_softmax_grad`], [`Kernels::gelu_of_grad`],
//! [`Kernels::gated_grads`], [`Kernels::rotary_grads`], each other for the heads,
//! [`Kernels::cross_entropy_grads`]).

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

use super::tracked;
use crate::backend::gated::Gate;
use crate::backend::gelu::Gelu;
use crate::backend::kernels::{Kernels, Softmaxed};
use crate::backend::rotary::Rotation;

/// The backward of [`Kernels::attention_softmax`]: the scores' gradient from the kept
/// probabilities ([`Kernels::attention_softmax_grad`]).
#[derive(Debug)]
pub(super) struct SoftmaxBackward {
    pub(super) dh: usize,
}

impl<I: Kernels> Backward<I, 1> for SoftmaxBackward {
    type State = FloatTensor<I>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let t = |p: FloatTensor<I>| Tensor::<I, 4>::from_primitive(TensorPrimitive::Float(p));
        let p = ops.state;
        let dh = self.dh;
        unary::<I, _>(ops.parents, ops.node, grads, |dp| {
            I::attention_softmax_grad(t(p), t(dp), dh).into_primitive().tensor()
        });
    }
}

/// [`Kernels::gelu_of`] on an autodiff backend: its input is the node's parent, and what
/// it keeps.
pub(super) fn gelu<I: Kernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<I, C>>,
    form: Gelu,
) -> FloatTensor<Autodiff<I, C>> {
    let y = I::gelu_of(x.primitive.clone(), form);
    tracked::<I, C, _, 1>(GeluBackward { form }, [&x], || x.primitive.clone(), y)
}

/// The backward of [`gelu`].
#[derive(Debug)]
struct GeluBackward {
    form: Gelu,
}

impl<I: Kernels> Backward<I, 1> for GeluBackward {
    type State = FloatTensor<I>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, form) = (ops.state, self.form);
        unary::<I, _>(ops.parents, ops.node, grads, |dy| I::gelu_of_grad(x, dy, form));
    }
}

/// [`Kernels::gated`] on an autodiff backend: the up projection's output is the node's
/// parent, and what it keeps.
pub(super) fn gated<I: Kernels, C: CheckpointStrategy>(
    up: FloatTensor<Autodiff<I, C>>,
    gate: Gate,
) -> FloatTensor<Autodiff<I, C>> {
    let y = I::gated(up.primitive.clone(), gate);
    tracked::<I, C, _, 1>(GatedBackward { gate }, [&up], || up.primitive.clone(), y)
}

/// The backward of [`gated`].
#[derive(Debug)]
struct GatedBackward {
    gate: Gate,
}

impl<I: Kernels> Backward<I, 1> for GatedBackward {
    type State = FloatTensor<I>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (up, gate) = (ops.state, self.gate);
        unary::<I, _>(ops.parents, ops.node, grads, |dy| I::gated_grads(up, dy, gate));
    }
}

/// [`Kernels::rotary`] on an autodiff backend: the queries or keys are the node's parent;
/// it keeps the table alone (the rotation is linear).
pub(super) fn rotary<I: Kernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<I, C>>,
    r: &Arc<Rotation>,
) -> FloatTensor<Autodiff<I, C>> {
    let y = I::rotary(x.primitive.clone(), r);
    tracked::<I, C, _, 1>(RotaryBackward, [&x], || r.clone(), y)
}

/// The backward of [`rotary`].
#[derive(Debug)]
struct RotaryBackward;

impl<I: Kernels> Backward<I, 1> for RotaryBackward {
    type State = Arc<Rotation>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let table = ops.state;
        unary::<I, _>(ops.parents, ops.node, grads, |dy| I::rotary_grads(dy, &table));
    }
}

/// [`Kernels::heads`] on an autodiff backend: the features are the node's parent; its
/// backward puts the heads' gradient back in their place ([`Kernels::place_heads`]).
pub(super) fn heads<I: Kernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<I, C>>,
    start: usize,
    heads: usize,
    size: usize,
) -> FloatTensor<Autodiff<I, C>> {
    let width = x.primitive.shape().dims::<3>()[2];
    let y = I::heads(x.primitive.clone(), start, heads, size);
    tracked::<I, C, _, 1>(HeadsBackward::Taken { width, start }, [&x], || (), y)
}

/// [`Kernels::place_heads`] on an autodiff backend: its backward takes the heads' gradient
/// out again ([`Kernels::heads`]).
pub(super) fn place_heads<I: Kernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<I, C>>,
    width: usize,
    start: usize,
) -> FloatTensor<Autodiff<I, C>> {
    let [_, heads, _, size] = x.primitive.shape().dims::<4>();
    let y = I::place_heads(x.primitive.clone(), width, start);
    tracked::<I, C, _, 1>(HeadsBackward::Placed { start, heads, size }, [&x], || (), y)
}

/// The backward of [`heads`] and [`place_heads`]: each is the other's gradient.
#[derive(Debug)]
enum HeadsBackward {
    /// The heads were taken from features of `width` at `start`.
    Taken { width: usize, start: usize },
    /// `heads` heads of `size` were placed at feature `start`.
    Placed { start: usize, heads: usize, size: usize },
}

impl<I: Kernels> Backward<I, 1> for HeadsBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        unary::<I, _>(ops.parents, ops.node, grads, |dy| match self {
            HeadsBackward::Taken { width, start } => I::place_heads(dy, width, start),
            HeadsBackward::Placed { start, heads, size } => I::heads(dy, start, heads, size),
        });
    }
}

/// [`Kernels::cross_entropy`] on an autodiff backend: the logits are the node's parent; it
/// keeps the softmax and the classes, and returns the softmax untracked.
pub(super) fn cross_entropy<I: Kernels, C: CheckpointStrategy>(
    logits: FloatTensor<Autodiff<I, C>>,
    labels: &Arc<Vec<i64>>,
) -> Softmaxed<Autodiff<I, C>> {
    let (loss, probs) = I::cross_entropy(logits.primitive.clone(), labels);
    let state = || (probs.clone(), labels.clone());
    let loss = tracked::<I, C, _, 1>(CrossEntropyBackward, [&logits], state, loss);
    (loss, <Autodiff<I, C> as AutodiffBackend>::from_inner(probs))
}

/// The backward of [`cross_entropy`].
#[derive(Debug)]
struct CrossEntropyBackward;

impl<I: Kernels> Backward<I, 1> for CrossEntropyBackward {
    type State = (FloatTensor<I>, Arc<Vec<i64>>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (probs, labels) = ops.state;
        unary::<I, _>(ops.parents, ops.node, grads, |dy| I::cross_entropy_grads(probs, &labels, dy));
    }
}
