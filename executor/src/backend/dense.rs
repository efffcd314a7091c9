//! The dense product `x · W` of every weight matrix (linear layers, transformer projections,
//! LSTM gates), with a backward that runs in the orientation the backend's kernel is fast in.
//!
//! Burn's own matmul backward takes the input gradient as `dy · Wᵀ` through a transposed
//! view of `W`. On the CPU (`flex`, i.e. the `gemm` crate) that is the one orientation whose
//! kernel repacks the whole weight on every call: at the benchmark model's 32-row
//! microbatches it ran 1.60–1.62 ms for 32 × 1024 · 1024 × 1024, against 0.46 ms for the
//! same numbers computed as `(W · dyᵀ)ᵀ` (and 0.79–0.90 ms for the forward `x · W`;
//! `pipec-bench kernels`). Nothing is copied or cached: the result is a transposed view,
//! which the next operation reads.
//! Gradients are Burn's own up to float rounding (the kernel sums in another order; tested),
//! and every schedule of a plan runs the same products, so pipelines still train to exactly
//! the single device's numbers.
//!
//! A backend picks its orientation in [`Kernels::input_grad`]; CUDA keeps Burn's. The
//! forward `x · W` is the plain product: a transposed copy of each weight, made at every
//! update so that `gemm` would stream `Wᵀ` instead of packing `W`, saved 0.06 ms of a
//! 1024 × 1024 forward at 32 rows and cost 2.5–3.5 ms a weight and update from memory
//! the passes had left cold (whole `pipec run`s 1.22–1.23 times as long with it, Xeon,
//! 2026-12-07; docs/benchmarks/cpu-kernels.md).
//!
//! The weight gradients `xᵀ · dy` are summed into the step's running sums inside the
//! backward ([`with_gradient_sums`]), or, for the input half of a split backward (a
//! zero-bubble schedule's, or a later stage's that sends its gradient first), kept as
//! operands and multiplied in its weight half ([`with_deferred_weight_gradients`],
//! [`add_deferred`]) — the same products into the same sums either way.
//!
//! Under ZeRO-3 a weight gathered per product ([`crate::parallel::zero::per_product`]) is a one-value
//! stand-in in the model: while [`with_gathered_weights`] names it, the product asks its
//! [`WholeWeight`] for the whole weight, and its backward keeps the gatherer
//! instead of the weight and asks again for the input gradient.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn::tensor::{Shape, Tensor, TensorMetadata, TensorPrimitive};
use std::any::Any;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::backend::gated::Gate;
use crate::backend::kernels::{attention_weights, forward_product, Kernels, Pooled, Softmaxed};
use crate::backend::pool::PoolWindow;
use crate::backend::rotary::Rotation;

impl<I: Kernels, C: CheckpointStrategy> Kernels for Autodiff<I, C> {
    fn sum_key(weight: &FloatTensor<Self>) -> Option<NodeId> {
        Some(weight.node.id)
    }

    fn carries_gradient(t: &FloatTensor<Self>) -> bool {
        !t.node.requirement.is_none()
    }

    fn pool_in_use(device: &Self::Device) -> Option<u64> {
        I::pool_in_use(device)
    }

    fn exchange(x: Tensor<Self, 2>, ex: &crate::backend::port::Exchange) -> crate::error::Result<Tensor<Self, 2>> {
        let x = x.into_primitive().tensor();
        let moved = crate::backend::port::move_rows(
            Tensor::<I, 2>::from_primitive(TensorPrimitive::Float(x.primitive.clone())),
            ex,
        )?
        .into_primitive()
        .tensor();
        Ok(wrapped(tracked::<I, C, _, 1>(ExchangeBackward, [&x], || ex.reversed(), moved)))
    }

    fn attention_softmax(
        scores: Tensor<Self, 4>,
        dh: usize,
        mask: Option<crate::backend::attention::Mask<'_>>,
    ) -> Tensor<Self, 4> {
        let s = scores.into_primitive().tensor();
        let p = I::attention_softmax(inner(&s.primitive), dh, mask).into_primitive().tensor();
        wrapped(tracked::<I, C, _, 1>(fused_backward::SoftmaxBackward { dh }, [&s], || p.clone(), p.clone()))
    }

    fn dropout(x: Tensor<Self, 1>, mask: std::sync::Arc<crate::backend::dropout::DropMask>) -> Tensor<Self, 1> {
        let x = x.into_primitive().tensor();
        let y = I::dropout(Tensor::<I, 1>::from_primitive(TensorPrimitive::Float(x.primitive.clone())), mask.clone())
            .into_primitive()
            .tensor();
        wrapped(tracked::<I, C, _, 1>(crate::backend::dropout::DropoutBackward { mask }, [&x], || (), y))
    }

    fn attention_recomputed(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        dh: usize,
        causal: crate::backend::attention::Causal,
        sinks: Option<Tensor<Self, 1>>,
        drop: &crate::backend::dropout::Dropped,
    ) -> Tensor<Self, 4> {
        let (q, k, v) = (q.into_primitive().tensor(), k.into_primitive().tensor(), v.into_primitive().tensor());
        let sinks = sinks.map(|s| s.into_primitive().tensor());
        let out = I::attention_recomputed(
            inner(&q.primitive),
            inner(&k.primitive),
            inner(&v.primitive),
            dh,
            causal.clone(),
            sinks.as_ref().map(|s| Tensor::<I, 1>::from_primitive(TensorPrimitive::Float(s.primitive.clone()))),
            drop,
        )
        .into_primitive()
        .tensor();
        let qkv = || (q.primitive.clone(), k.primitive.clone(), v.primitive.clone());
        let backward = AttentionBackward { dh, causal, drop: drop.clone() };
        match &sinks {
            None => wrapped(tracked::<I, C, _, 3>(backward, [&q, &k, &v], qkv, out)),
            Some(s) => {
                let state = || (qkv(), s.primitive.clone());
                wrapped(tracked::<I, C, _, 4>(backward, [&q, &k, &v, s], state, out))
            }
        }
    }

    fn ring_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        sinks: Option<Tensor<Self, 1>>,
        ring: &crate::backend::ring::Ring,
    ) -> crate::error::Result<Tensor<Self, 4>> {
        ring_backward::ring_attention(q, k, v, sinks, ring)
    }

    fn convolution(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: burn::tensor::ops::ConvOptions<2>,
    ) -> FloatTensor<Self> {
        conv_backward::conv2d::<I, C>(x, weight, bias, options)
    }

    fn max_pool(x: FloatTensor<Self>, window: PoolWindow) -> Pooled<Self> {
        pool_backward::max_pool::<I, C>(x, window)
    }

    fn batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        eps: f64,
    ) -> crate::backend::kernels::Normalised<Self> {
        norm_backward::batch_norm::<I, C>(x, gamma, beta, eps)
    }

    fn row_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: Option<FloatTensor<Self>>,
        eps: f64,
    ) -> crate::backend::kernels::RowNormed<Self> {
        norm_backward::row_norm::<I, C>(x, gamma, beta, eps)
    }

    fn gelu_of(x: FloatTensor<Self>, form: crate::backend::gelu::Gelu) -> FloatTensor<Self> {
        fused_backward::gelu::<I, C>(x, form)
    }

    fn gated(up: FloatTensor<Self>, gate: Gate) -> FloatTensor<Self> {
        fused_backward::gated::<I, C>(up, gate)
    }

    fn heads(x: FloatTensor<Self>, start: usize, heads: usize, size: usize) -> FloatTensor<Self> {
        fused_backward::heads::<I, C>(x, start, heads, size)
    }

    fn place_heads(x: FloatTensor<Self>, width: usize, start: usize) -> FloatTensor<Self> {
        fused_backward::place_heads::<I, C>(x, width, start)
    }

    fn rotary(x: FloatTensor<Self>, r: &Arc<Rotation>) -> FloatTensor<Self> {
        fused_backward::rotary::<I, C>(x, r)
    }

    fn cross_entropy(logits: FloatTensor<Self>, labels: &Arc<Vec<i64>>) -> Softmaxed<Self> {
        fused_backward::cross_entropy::<I, C>(logits, labels)
    }

    fn embed(w: Tensor<Self, 2>, ids: Tensor<Self, 2, burn::tensor::Int>) -> Tensor<Self, 3> {
        let w = w.into_primitive().tensor();
        // ZeRO-3: a table gathered for this lookup only; its backward needs none of it (the
        // gradient adds the output's rows into zeros of the table's shape, as Burn's does)
        let Some((g, id)) = gathered_weight::<I>(w.node.id) else {
            let w = Tensor::<Self, 2>::from_primitive(TensorPrimitive::Float(w));
            return burn::tensor::module::embedding(w, ids);
        };
        let table = g.get(id);
        let shape = table.shape().dims::<2>();
        let ids = ids.into_primitive();
        let out = I::embedding(table, ids.clone());
        wrapped(tracked::<I, C, _, 1>(EmbedBackward { shape }, [&w], || ids, out))
    }

    fn dense(x: Tensor<Self, 2>, w: Tensor<Self, 2>) -> Tensor<Self, 2> {
        let (x, w) = (x.into_primitive().tensor(), w.into_primitive().tensor());
        let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
        // ZeRO-3: a weight gathered for this product only
        let gathered = gathered_weight::<I>(w.node.id);
        let weight = match &gathered {
            Some((g, id)) => g.get(*id),
            None => w.primitive.clone(),
        };
        let y = match DenseBackward.prepare::<C>([x.node.clone(), w.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(mut prep) => {
                // x for the weight gradient, w (or its gatherer) for the input gradient, each
                // only if needed
                let x_state = w_tracked.then(|| prep.checkpoint(&x));
                let w_state = x_tracked.then(|| match gathered {
                    Some((g, id)) => Weight::Gathered(g, id),
                    None => Weight::Held(weight.clone()),
                });
                prep.finish((x_state, w_state), forward_product::<I>(x.primitive, weight))
            }
            OpsKind::UnTracked(prep) => prep.finish(forward_product::<I>(x.primitive, weight)),
        };
        Tensor::from_primitive(TensorPrimitive::Float(y))
    }
}

/// The backward of a table lookup whose table was gathered for it (ZeRO-3 per product): the
/// table's gradient, zeros of its `shape` with each output row added into the row its id
/// names (Burn's `embedding_backward`, which reads only the table's shape).
#[derive(Debug)]
struct EmbedBackward {
    shape: [usize; 2],
}

/// An autodiff tensor's inner values as a 4-dimensional tensor of the inner backend.
fn inner<I: Backend>(t: &FloatTensor<I>) -> Tensor<I, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(t.clone()))
}

/// A primitive as a tensor of `D` dimensions.
fn wrapped<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// `out`, which `op`'s forward computed from `inputs`, on the autodiff backend: where any
/// of `inputs` is tracked, `op`'s backward keeps `state()` (computed only then).
fn tracked<I: Kernels, C: CheckpointStrategy, O: Backward<I, N>, const N: usize>(
    op: O,
    inputs: [&FloatTensor<Autodiff<I, C>>; N],
    state: impl FnOnce() -> O::State,
    out: FloatTensor<I>,
) -> FloatTensor<Autodiff<I, C>> {
    match op.prepare::<C>(inputs.map(|t| t.node.clone())).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish(state(), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

impl<I: Kernels> Backward<I, 1> for EmbedBackward {
    type State = burn::tensor::ops::IntTensor<I>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let ids = ops.state;
        let [to_w] = ops.parents;
        let dy = grads.consume::<I>(&ops.node);
        if let Some(node) = to_w {
            let [n, s] = ids.shape().dims::<2>();
            let [rows, d] = self.shape;
            let dtype = dy.dtype();
            let dy = I::float_reshape(dy, Shape::new([n * s, d]));
            let ids = I::int_reshape(ids, Shape::new([n * s]));
            let zeros = I::float_zeros(Shape::new([rows, d]), &I::float_device(&dy), dtype.into());
            grads.register::<I>(node.id, I::float_select_add(zeros, 0, ids, dy));
        }
    }
}

/// What a dense product's backward keeps for its input gradient: the weight, or under
/// ZeRO-3 per product what gathers it again.
#[derive(Clone, Debug)]
enum Weight<I: Backend> {
    Held(FloatTensor<I>),
    Gathered(std::sync::Arc<dyn WholeWeight<I>>, u64),
}

/// The backward of `x · w`: `dy · wᵀ` (through [`Kernels::input_grad`]) and `xᵀ · dy`.
#[derive(Debug)]
struct DenseBackward;

impl<I: Kernels> Backward<I, 2> for DenseBackward {
    type State = (Option<NodeId>, Option<Weight<I>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let (x, w) = ops.state;
        let x: Option<FloatTensor<I>> = x.map(|x| checkpointer.retrieve_node_output(x));
        let [to_x, to_w] = ops.parents;
        let dy = grads.consume::<I>(&ops.node);
        if let Some(node) = to_x {
            let w = match w.expect("the input is tracked, so its weight was kept") {
                Weight::Held(w) => w,
                Weight::Gathered(g, id) => g.get(id),
            };
            grads.register::<I>(node.id, crate::backend::amp::mixed::<I>(dy.clone(), w, I::input_grad));
        }
        if let Some(node) = to_w {
            let xt = I::float_transpose(x.expect("the weight is tracked, so its input was kept"));
            if let Some(dw) = add_to_sum::<I>(node.id, xt, dy) {
                grads.register::<I>(node.id, dw);
            }
        }
    }
}

/// The backward of [`Kernels::attention_recomputed`]: the probabilities P recomputed from
/// q and k (and the sinks, [`crate::backend::attention::sink_softmax`]: a sink weighs no
/// value, so the scores' gradient keeps its form), then dV = Pᵀ·dO, dS = P ⊙ (dO·vᵀ −
/// rowsum(dO·vᵀ ⊙ P)) (the softmax's backward over the scaled scores; a masked position's P
/// is 0, so is its dS), dQ = dS·k, dK = dSᵀ·q ([`Kernels::attention_softmax_grad`] divides
/// by √dh), and the sinks' gradient ([`crate::backend::attention::sink_grad`]). With
/// dropout (mask M drawn again), P ⊙ M stands for P in dV and dO·vᵀ ⊙ M for dO·vᵀ. Three
/// parents (q, k, v) without sinks, four with them.
#[derive(Debug)]
struct AttentionBackward {
    dh: usize,
    causal: crate::backend::attention::Causal,
    drop: crate::backend::dropout::Dropped,
}

type Qkv<I> = (FloatTensor<I>, FloatTensor<I>, FloatTensor<I>);

impl AttentionBackward {
    /// Registers, from the output's gradient `d_out`, the gradients of the parents that are
    /// tracked (`to`: q, k, v, the sinks).
    fn register<I: Kernels>(
        &self,
        grads: &mut Gradients,
        d_out: FloatTensor<I>,
        (q, k, v): Qkv<I>,
        sinks: Option<FloatTensor<I>>,
        [to_q, to_k, to_v, to_sinks]: [Option<NodeId>; 4],
    ) {
        let t = |p: FloatTensor<I>| Tensor::<I, 4>::from_primitive(TensorPrimitive::Float(p));
        let (q, k, v) = (t(q), t(k), t(v));
        let sinks = sinks.map(|s| Tensor::<I, 1>::from_primitive(TensorPrimitive::Float(s)));
        let d_out = t(d_out);
        let mask = self.causal.as_ref().map(|m| m.mask());
        let p = attention_weights(q.clone(), k.clone(), self.dh, mask, sinks);
        // the dropout's factors [b, h, q, k], drawn again
        let factors = self.drop.as_ref().map(|m| m.tensor::<I>(&p.device()).reshape(p.dims()));
        let dropped = |t: Tensor<I, 4>| match &factors {
            Some(f) => t * f.clone(),
            None => t,
        };
        if let Some(id) = to_v {
            let pd = dropped(p.clone());
            grads.register::<I>(
                id,
                crate::backend::amp::matmul(pd.swap_dims(2, 3), d_out.clone()).into_primitive().tensor(),
            );
        }
        if to_q.is_none() && to_k.is_none() && to_sinks.is_none() {
            return;
        }
        let dp = dropped(crate::backend::amp::matmul(d_out, v.swap_dims(2, 3)));
        if let Some(id) = to_sinks {
            grads.register::<I>(
                id,
                crate::backend::attention::sink_grad(p.clone(), dp.clone()).into_primitive().tensor(),
            );
        }
        let ds = I::attention_softmax_grad(p, dp, self.dh);
        if let Some(id) = to_q {
            grads.register::<I>(id, crate::backend::amp::matmul(ds.clone(), k).into_primitive().tensor());
        }
        if let Some(id) = to_k {
            grads.register::<I>(id, crate::backend::amp::matmul(ds.swap_dims(2, 3), q).into_primitive().tensor());
        }
    }
}

impl<I: Kernels> Backward<I, 3> for AttentionBackward {
    type State = Qkv<I>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<I>(&ops.node);
        let [q, k, v] = ops.parents.map(|p| p.map(|n| n.id));
        self.register::<I>(grads, d_out, ops.state, None, [q, k, v, None]);
    }
}

impl<I: Kernels> Backward<I, 4> for AttentionBackward {
    type State = (Qkv<I>, FloatTensor<I>);

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let d_out = grads.consume::<I>(&ops.node);
        let (qkv, sinks) = ops.state;
        self.register::<I>(grads, d_out, qkv, Some(sinks), ops.parents.map(|p| p.map(|n| n.id)));
    }
}

/// The backward of an expert exchange: the gradient's rows back to the members they came
/// from (the state is the reversed exchange). A backward cannot fail: a failed exchange
/// records its error in the group (the worker reports it after the backward) and passes
/// zeros on.
#[derive(Debug)]
struct ExchangeBackward;

impl<I: Kernels> Backward<I, 1> for ExchangeBackward {
    type State = crate::backend::port::Exchange;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let ex = ops.state;
        burn::backend::autodiff::ops::unary::<I, _>(ops.parents, ops.node, grads, |dy| {
            let dy = Tensor::<I, 2>::from_primitive(TensorPrimitive::Float(dy));
            let (device, d) = (dy.device(), dy.dims()[1]);
            let rows: usize = ex.recv.iter().sum();
            let moved = crate::backend::port::move_rows(dy, &ex).unwrap_or_else(|e| {
                if let Ok(mut failed) = ex.group.failed.lock() {
                    failed.get_or_insert(e);
                }
                Tensor::zeros([rows, d], &device)
            });
            moved.into_primitive().tensor()
        });
    }
}

/// The step's running weight-gradient sums, keyed by weight ([`Kernels::sum_key`]).
pub(crate) type Sums<I> = HashMap<NodeId, Option<FloatTensor<I>>>;

/// Weight gradients a split backward's input pass put off ([`with_deferred_weight_gradients`]):
/// per keyed weight, what its gradient is computed from, in the order the backward reached
/// them. [`add_deferred`] computes them.
pub(crate) struct Deferred<I: Backend>(Vec<(NodeId, PutOff<I>)>);

/// What one weight's put-off gradient is computed from.
enum PutOff<I: Backend> {
    /// A dense product's: `xᵀ · dy`.
    Product(FloatTensor<I>, FloatTensor<I>),
    /// A convolution's ([`Kernels::convolution_grads`]): its input, its weight (for the
    /// shape) and its output's gradient.
    Convolution { x: FloatTensor<I>, weight: FloatTensor<I>, dy: FloatTensor<I>, options: ConvOptions<2> },
}

impl<I: Backend> Default for Deferred<I> {
    fn default() -> Self {
        Deferred(Vec::new())
    }
}

impl<I: Backend> std::fmt::Debug for Deferred<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} deferred weight gradient(s)", self.0.len())
    }
}

impl<I: Backend> Deferred<I> {
    /// Takes out the products of the weights in `keys` (each weight's in their order),
    /// leaving the others' (a weight pass run bucket by bucket).
    pub(crate) fn take(&mut self, keys: &HashSet<NodeId>) -> Deferred<I> {
        let (taken, kept) = std::mem::take(&mut self.0).into_iter().partition(|(n, _)| keys.contains(n));
        self.0 = kept;
        Deferred(taken)
    }

    /// Appends the products `later` put off (a backward run in two passes, the later
    /// pass's after the earlier's: the order the backward reached them).
    pub(crate) fn append(&mut self, later: Deferred<I>) {
        self.0.extend(later.0);
    }

    /// How many weight gradients wait here.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

/// What a backward on this thread does with the weight gradients of keyed weights.
enum Lent<I: Backend> {
    /// Adds each into its running sum at once.
    Sums(Sums<I>),
    /// Keeps its operands for later, for the weights in the set.
    Defer(HashSet<NodeId>, Deferred<I>),
}

thread_local! {
    /// This thread's [`Lent`] while a backward runs (type-erased: one per backend).
    static LENT: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
    /// The weights gathered per product while a pass runs ([`with_gathered_weights`]).
    static GATHERED: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// The port's side of ZeRO-3's per-product gathers: a weight whole, by parameter id, for
/// one product (the parallel layer's gatherer, `crate::parallel::zero::Gatherer`, gathers it
/// from the replicas' shards; a failed gather is recorded there and gives zeros).
pub(crate) trait WholeWeight<I: Backend>: Send + Sync + std::fmt::Debug {
    fn get(&self, id: u64) -> FloatTensor<I>;
}

/// ZeRO-3 per product: the stand-ins (by autodiff node) whose products gather their weight,
/// and from what (by parameter id).
pub(crate) type GatheredWeights<I> = HashMap<NodeId, (std::sync::Arc<dyn WholeWeight<I>>, u64)>;

/// Runs `pass` (a forward or a recompute) with `weights` installed on this thread: a dense
/// product of one of those stand-ins gathers the whole weight for itself (the backward
/// needs nothing installed: each product's keeps its gatherer). Uninstalled after, also if
/// the pass panics.
pub(crate) fn with_gathered_weights<I: Backend, R>(weights: GatheredWeights<I>, pass: impl FnOnce() -> R) -> R {
    struct Installed;
    impl Drop for Installed {
        fn drop(&mut self) {
            GATHERED.with(|s| s.borrow_mut().take());
        }
    }
    if weights.is_empty() {
        return pass();
    }
    GATHERED.with(|s| *s.borrow_mut() = Some(Box::new(weights)));
    let _installed = Installed;
    pass()
}

/// Runs `pass` with `more` stand-ins' gatherers beside those installed on this thread (a
/// pass that runs part of its forward on another copy of the weights: recompute inside the
/// blocks runs it untracked); what was installed is restored after, also if it panics.
pub(crate) fn with_more_gathered_weights<I: Backend, R>(more: GatheredWeights<I>, pass: impl FnOnce() -> R) -> R {
    struct Restore(Option<Box<dyn Any>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0.take();
            GATHERED.with(|s| *s.borrow_mut() = before);
        }
    }
    if more.is_empty() {
        return pass();
    }
    let before = GATHERED.with(|s| s.borrow_mut().take());
    let mut all: GatheredWeights<I> =
        before.as_ref().and_then(|b| b.downcast_ref::<GatheredWeights<I>>()).cloned().unwrap_or_default();
    all.extend(more);
    GATHERED.with(|s| *s.borrow_mut() = Some(Box::new(all)));
    let _restore = Restore(before);
    pass()
}

/// The gatherer of the weight whose stand-in is `node`, while a pass names it.
fn gathered_weight<I: Backend>(node: NodeId) -> Option<(std::sync::Arc<dyn WholeWeight<I>>, u64)> {
    GATHERED.with(|s| s.borrow().as_ref()?.downcast_ref::<GatheredWeights<I>>()?.get(&node).cloned())
}

/// Runs `backward` with `lent` installed on this thread, and takes it back (also if the
/// backward panics).
fn with_lent<I: Backend, R>(lent: Lent<I>, backward: impl FnOnce() -> R) -> (R, Option<Lent<I>>) {
    /// Uninstalls what was lent even if the backward panics.
    struct Installed;
    impl Drop for Installed {
        fn drop(&mut self) {
            LENT.with(|s| s.borrow_mut().take());
        }
    }
    LENT.with(|s| *s.borrow_mut() = Some(Box::new(lent)));
    let installed = Installed;
    let out = backward();
    let lent = LENT.with(|s| s.borrow_mut().take()).and_then(|b| b.downcast::<Lent<I>>().ok()).map(|b| *b);
    drop(installed);
    (out, lent)
}

/// Runs `backward` with `sums` installed on this thread: the dense product's backward adds
/// the weight gradient `xᵀ · dy` of every weight keyed there straight into its sum
/// ([`Kernels::product_add`]: on `flex` the kernel accumulates into the sum's buffer)
/// instead of handing it to Burn's gradients, so a microbatch's gradient of a 1024 × 1024
/// weight is never written out, read back and added. Weights not keyed (and every other
/// op's gradients) go through Burn's gradients as before. Returns the sums, 2-D where a
/// product touched them.
pub(crate) fn with_gradient_sums<I: Backend, R>(sums: Sums<I>, backward: impl FnOnce() -> R) -> (R, Sums<I>) {
    let (out, lent) = with_lent(Lent::<I>::Sums(sums), backward);
    let sums = match lent {
        Some(Lent::Sums(sums)) => sums,
        _ => Sums::<I>::new(),
    };
    (out, sums)
}

/// Runs `backward` as the input half of a split backward (zero-bubble's `BackwardInput`):
/// the dense product's backward computes the input gradient but only keeps the operands of
/// the weight gradient of every weight in `keys`, which [`add_deferred`] adds into the sums
/// later (the plan's `BackwardWeight`). The weight products are the backward's largest
/// share that nothing downstream waits for; a stage that sends its input gradient before
/// computing them lets the previous stage start its backward that much sooner. Other
/// gradients go through Burn's as usual.
pub(crate) fn with_deferred_weight_gradients<I: Backend, R>(
    keys: impl IntoIterator<Item = NodeId>,
    backward: impl FnOnce() -> R,
) -> (R, Deferred<I>) {
    let keyed = keys.into_iter().collect();
    let (out, lent) = with_lent(Lent::<I>::Defer(keyed, Deferred::default()), backward);
    let deferred = match lent {
        Some(Lent::Defer(_, deferred)) => deferred,
        _ => Deferred::default(),
    };
    (out, deferred)
}

/// Adds the weight gradients `deferred` kept into `sums` (the weights must be keyed there),
/// in the order the backward reached them: the same products and sums as when a whole
/// backward adds them ([`with_gradient_sums`]), so a split backward's numbers are the
/// unsplit one's bit for bit. Returns the sums.
pub(crate) fn add_deferred<I: Kernels>(mut sums: Sums<I>, deferred: Deferred<I>) -> Sums<I> {
    for (node, put_off) in deferred.0 {
        let sum = sums.get_mut(&node).and_then(Option::take);
        let new = match put_off {
            PutOff::Product(xt, dy) => sum_product::<I>(sum, xt, dy),
            PutOff::Convolution { x, weight, dy, options } => {
                let Some(dw) = I::convolution_grads(x, weight, dy, options, (false, true)).1 else {
                    sums.insert(node, sum);
                    continue;
                };
                // the sums hold it flat, as the step's gradients are (Burn's gradient, added)
                let n = dw.shape().num_elements();
                let dw = I::float_reshape(dw, Shape::new([n]));
                match sum {
                    Some(sum) => I::float_add(sum, dw),
                    None => dw,
                }
            }
        };
        sums.insert(node, Some(new));
    }
    sums
}

/// `sum + xt · dy`, in `sum`'s buffer where the backend can; `xt · dy` for the first.
fn sum_product<I: Kernels>(sum: Option<FloatTensor<I>>, xt: FloatTensor<I>, dy: FloatTensor<I>) -> FloatTensor<I> {
    match sum {
        Some(sum) => {
            let shape = Shape::new([xt.shape().dims::<2>()[0], dy.shape().dims::<2>()[1]]);
            let sum = I::float_reshape(sum, shape);
            match crate::backend::amp::dtype() {
                None => I::product_add(sum, xt, dy),
                // a low-precision product, summed in fp32
                Some(_) => I::float_add(sum, crate::backend::amp::mixed::<I>(xt, dy, I::product)),
            }
        }
        None => crate::backend::amp::mixed::<I>(xt, dy, I::product),
    }
}

/// Adds `xt · dy` into the installed sum of weight `node`, or keeps the operands when the
/// installed backward defers it; gives the product back when nothing is installed for it.
fn add_to_sum<I: Kernels>(node: NodeId, xt: FloatTensor<I>, dy: FloatTensor<I>) -> Option<FloatTensor<I>> {
    // the sum is taken out while the product runs, so no borrow of the thread-local spans it;
    // deferred, the operands are moved into the list and nothing is left to compute
    let mut operands = Some((xt, dy));
    let slot = LENT.with(|s| {
        let mut s = s.borrow_mut();
        match s.as_mut()?.downcast_mut::<Lent<I>>()? {
            Lent::Sums(sums) => sums.get_mut(&node).map(Option::take),
            Lent::Defer(keyed, deferred) => {
                if keyed.contains(&node) {
                    deferred.0.extend(operands.take().map(|(xt, dy)| (node, PutOff::Product(xt, dy))));
                }
                None
            }
        }
    });
    let (xt, dy) = operands?;
    let Some(sum) = slot else { return Some(crate::backend::amp::mixed::<I>(xt, dy, I::product)) };
    let new = sum_product::<I>(sum, xt, dy);
    LENT.with(|s| {
        if let Some(Lent::Sums(sums)) = s.borrow_mut().as_mut().and_then(|b| b.downcast_mut::<Lent<I>>()) {
            sums.insert(node, Some(new));
        }
    });
    None
}

mod conv_backward;
mod fused_backward;
mod norm_backward;
mod pool_backward;
mod ring_backward;
#[cfg(test)]
mod tests;
