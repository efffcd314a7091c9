//! Context parallelism's ring attention as an autodiff node ([`Kernels::ring_attention`] on
//! `Autodiff`): the forward around the ring ([`Ring::forward`]) and, in the backward, the
//! ring's backward ([`Ring::backward`]) from what the node keeps.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::{inner, tracked, wrapped};
use crate::backend::kernels::Kernels;
use crate::backend::ring::Ring;

/// [`Kernels::ring_attention`] on an autodiff backend: the queries, this member's keys and
/// values, and the heads' sinks (if any) are the node's parents.
pub(super) fn ring_attention<I: Kernels, C: CheckpointStrategy>(
    q: Tensor<Autodiff<I, C>, 4>,
    k: Tensor<Autodiff<I, C>, 4>,
    v: Tensor<Autodiff<I, C>, 4>,
    sinks: Option<Tensor<Autodiff<I, C>, 1>>,
    ring: &Ring,
) -> crate::error::Result<Tensor<Autodiff<I, C>, 4>> {
    // validation's forwards pass detached keys and values (as `Context::gather`)
    let (q, k, v) = if ring.group.tracked { (q, k, v) } else { (q.detach(), k.detach(), v.detach()) };
    let (q, k, v) = (q.into_primitive().tensor(), k.into_primitive().tensor(), v.into_primitive().tensor());
    let sinks = sinks.map(|s| s.into_primitive().tensor());
    let plain =
        |s: &FloatTensor<Autodiff<I, C>>| Tensor::<I, 1>::from_primitive(TensorPrimitive::Float(s.primitive.clone()));
    let (out, lse) =
        ring.forward(inner::<I>(&q.primitive), inner(&k.primitive), inner(&v.primitive), sinks.as_ref().map(plain))?;
    let (out, lse) = (out.into_primitive().tensor(), lse.into_primitive().tensor());
    let state = || RingState {
        q: q.primitive.clone(),
        k: k.primitive.clone(),
        v: v.primitive.clone(),
        sinks: sinks.as_ref().map(|s| s.primitive.clone()),
        out: out.clone(),
        lse,
        ring: ring.clone(),
    };
    Ok(wrapped(match &sinks {
        None => tracked::<I, C, _, 3>(RingBackward, [&q, &k, &v], state, out.clone()),
        Some(s) => tracked::<I, C, _, 4>(RingBackward, [&q, &k, &v, s], state, out.clone()),
    }))
}

/// What [`Kernels::ring_attention`]'s backward keeps: the queries, this member's keys and
/// values, the sinks, the output and its rows' log-sum-exp (never another member's keys or
/// values).
#[derive(Debug, Clone)]
struct RingState<I: burn::tensor::backend::Backend> {
    q: FloatTensor<I>,
    k: FloatTensor<I>,
    v: FloatTensor<I>,
    sinks: Option<FloatTensor<I>>,
    out: FloatTensor<I>,
    lse: FloatTensor<I>,
    ring: Ring,
}

/// The backward of [`Kernels::ring_attention`] ([`Ring::backward`]); an exchange that fails
/// is recorded for the worker (a backward cannot return an error) and the gradients are
/// zeros.
#[derive(Debug)]
struct RingBackward;

impl RingBackward {
    /// Registers the gradients of the node's parents (q, k, v and the sinks, where it has
    /// them).
    fn register<I: Kernels>(
        state: RingState<I>,
        d_out: FloatTensor<I>,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let t = |p: FloatTensor<I>| Tensor::<I, 4>::from_primitive(TensorPrimitive::Float(p));
        let RingState { q, k, v, sinks, out, lse, ring } = state;
        let (q, k, v) = (t(q), t(k), t(v));
        let sinks = sinks.map(|s| Tensor::<I, 1>::from_primitive(TensorPrimitive::Float(s)));
        let zeros = (q.zeros_like(), k.zeros_like(), v.zeros_like(), sinks.as_ref().map(|s| s.zeros_like()));
        let (dq, dk, dv, d_sinks) = ring.backward(q, k, v, sinks, t(out), t(lse), t(d_out)).unwrap_or_else(|e| {
            if let Ok(mut failed) = ring.group.failed.lock() {
                failed.get_or_insert(e);
            }
            zeros
        });
        let four = [dq, dk, dv].map(|g| Some(g.into_primitive().tensor()));
        let all = four.into_iter().chain(std::iter::once(d_sinks.map(|g| g.into_primitive().tensor())));
        for (node, g) in parents.iter().zip(all) {
            if let (Some(node), Some(g)) = (node, g) {
                grads.register::<I>(*node, g);
            }
        }
    }
}

impl<I: Kernels> Backward<I, 3> for RingBackward {
    type State = RingState<I>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<I>(&ops.node);
        Self::register(ops.state, d_out, &ops.parents.map(|p| p.map(|n| n.id)), grads);
    }
}

impl<I: Kernels> Backward<I, 4> for RingBackward {
    type State = RingState<I>;

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<I>(&ops.node);
        Self::register(ops.state, d_out, &ops.parents.map(|p| p.map(|n| n.id)), grads);
    }
}
