//! A 2-D convolution as an autodiff node ([`Kernels::convolution`] on `Autodiff`): the inner
//! backend's forward and, in the backward, its gradients ([`Kernels::convolution_grads`]) and
//! the bias's, the output's gradient summed over the batch and the positions.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn::tensor::{Tensor, TensorPrimitive};

use super::tracked;
use crate::backend::kernels::Kernels;

/// [`Kernels::convolution`] on an autodiff backend: the input, the weight and the bias (if any)
/// are the node's parents; it keeps the input and the weight.
pub(super) fn conv2d<I: Kernels, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<I, C>>,
    weight: FloatTensor<Autodiff<I, C>>,
    bias: Option<FloatTensor<Autodiff<I, C>>>,
    options: ConvOptions<2>,
) -> FloatTensor<Autodiff<I, C>> {
    let out = I::convolution(
        x.primitive.clone(),
        weight.primitive.clone(),
        bias.as_ref().map(|b| b.primitive.clone()),
        options.clone(),
    );
    let state = || (x.primitive.clone(), weight.primitive.clone());
    let op = ConvBackward { options };
    match &bias {
        None => tracked::<I, C, _, 2>(op, [&x, &weight], state, out),
        Some(b) => tracked::<I, C, _, 3>(op, [&x, &weight, b], state, out),
    }
}

/// The backward of [`conv2d`].
#[derive(Debug)]
struct ConvBackward {
    options: ConvOptions<2>,
}

impl ConvBackward {
    /// Registers, from the output's gradient `dy`, the gradients of the parents that are
    /// tracked (`to`: the input, the weight, the bias).
    fn register<I: Kernels>(
        self,
        grads: &mut Gradients,
        dy: FloatTensor<I>,
        (x, weight): (FloatTensor<I>, FloatTensor<I>),
        [to_x, to_w, to_b]: [Option<NodeId>; 3],
    ) {
        if let Some(id) = to_b {
            let d = Tensor::<I, 4>::from_primitive(TensorPrimitive::Float(dy.clone()));
            let [n, c, h, w] = d.dims();
            let db = d.reshape([n, c, h * w]).sum_dim(2).sum_dim(0).reshape([c]);
            grads.register::<I>(id, db.into_primitive().tensor());
        }
        // the input half of a split backward puts the weight's gradient off to the weight
        // pass ([`put_off_convolution`])
        let to_w = match to_w {
            Some(id) if defers::<I>(id) => {
                put_off_convolution::<I>(id, (x.clone(), weight.clone(), dy.clone()), &self.options);
                None
            }
            to_w => to_w,
        };
        if to_x.is_none() && to_w.is_none() {
            return;
        }
        let (dx, dw) = I::convolution_grads(x, weight, dy, self.options, (to_x.is_some(), to_w.is_some()));
        for (id, g) in [(to_x, dx), (to_w, dw)] {
            if let (Some(id), Some(g)) = (id, g) {
                grads.register::<I>(id, g);
            }
        }
    }
}

impl<I: Kernels> Backward<I, 2> for ConvBackward {
    type State = (FloatTensor<I>, FloatTensor<I>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<I>(&ops.node);
        let [x, w] = ops.parents.map(|p| p.map(|n| n.id));
        self.register::<I>(grads, dy, ops.state, [x, w, None]);
    }
}

impl<I: Kernels> Backward<I, 3> for ConvBackward {
    type State = (FloatTensor<I>, FloatTensor<I>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<I>(&ops.node);
        self.register::<I>(grads, dy, ops.state, ops.parents.map(|p| p.map(|n| n.id)));
    }
}

/// Whether the installed backward puts weight `node`'s gradient off (the input half of a
/// split backward, [`super::with_deferred_weight_gradients`]).
fn defers<I: Backend>(node: NodeId) -> bool {
    super::LENT.with(|s| {
        matches!(s.borrow().as_ref().and_then(|b| b.downcast_ref::<super::Lent<I>>()), Some(super::Lent::Defer(keyed, _)) if keyed.contains(&node))
    })
}

/// Keeps a convolution's weight-gradient operands (its input, its weight, its output's
/// gradient) for the weight pass, where [`defers`] says so.
fn put_off_convolution<I: Backend>(
    node: NodeId,
    (x, weight, dy): (FloatTensor<I>, FloatTensor<I>, FloatTensor<I>),
    options: &ConvOptions<2>,
) {
    super::LENT.with(|s| {
        if let Some(super::Lent::Defer(_, deferred)) =
            s.borrow_mut().as_mut().and_then(|b| b.downcast_mut::<super::Lent<I>>())
        {
            deferred.0.push((node, super::PutOff::Convolution { x, weight, dy, options: options.clone() }));
        }
    });
}
