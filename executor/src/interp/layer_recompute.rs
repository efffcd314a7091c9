//! Recompute by layers (`recompute: { layers: n }`, Megatron-LM's `--recompute-num-layers`
//! with its `block` method): the first n transformer blocks of every stage run their
//! forward again in the backward, keeping nothing but the stage's input; the layers after
//! them keep their activations.
//!
//! The forward is cut after the stage's n-th block: the head before the cut runs untracked
//! (nothing kept for a backward), the tail runs from a leaf copy of the head's output and
//! keeps its graph. The backward runs the tail's backward to that leaf, the head's forward
//! again from the kept input at the weights the forward used (the same dropout keys), and
//! the head's backward from the leaf's gradient. Every weight's gradient is the one
//! backward's through the whole stage: the same products in the same order.
//!
//! The head exchanges nothing with other devices: `pipec_executor::validate` refuses recompute
//! by layers beside expert and context parallelism and ZeRO-3, whose collectives inside the
//! recomputed forward the plan does not declare for the backward.

use pipec_plan::{MicrobatchId, StageId};

use crate::backend::kernels::ExecBackend;
use crate::comm::transport::Tag;
use crate::error::{ExecError, Result};
use crate::interp::buckets::tracked;
use crate::interp::values::{
    detach, dot, dot_with, grad_of, input_grad, release_dropped_graphs, untracked_copy, Forwarded, Saved, WeightGrads,
};
use crate::interp::worker::Worker;
use crate::nn::layers::{Act, Collected, StageModel};
use crate::nn::params::{accumulate, backward_deferring, backward_into_sums, collect_grads, sum_keys, FlatGrads};
use crate::parallel::tensor_parallel::{fresh, Boundary, Segment};

impl<'a, B: ExecBackend> Worker<'a, B> {
    /// Where `stage`'s forward is cut for recompute by layers: after its n-th transformer
    /// block (a position in its layers; all its blocks when it has fewer). None without
    /// recompute by layers, on a stage that recomputes its whole forward or holds no block,
    /// and while evaluating (nothing is kept for a backward).
    pub(crate) fn recompute_cut(&self, stage: StageId) -> Option<usize> {
        let n = self.plan.schedule.block_recompute.as_ref().map_or(0, |b| b.layers);
        if n == 0 || self.progress.evaluating.is_some() {
            return None;
        }
        let s = self.plan.stage(stage).filter(|s| !s.recompute)?;
        let [first, end] = s.layers;
        let blocks = self.plan.layers.iter().filter(|l| (first..end).contains(&l.index) && l.op.block_dims().is_some());
        blocks.take(n).last().map(|l| l.index + 1 - first)
    }

    /// Runs the head of `model` (its layers before `cut`) on `x`, collecting into `side`.
    /// `untracked` (on this device): a forward that keeps nothing, each layer's output
    /// detached and what Burn still holds of the layer released before the next
    /// ([`release_dropped_graphs`]), so that it holds one layer's tensors at a time.
    fn run_head(
        model: &StageModel<B>,
        x: Act<B>,
        cut: usize,
        key: (u64, u64, u64),
        side: &mut Collected<B>,
        untracked: Option<&B::Device>,
    ) -> Result<Act<B>> {
        if model.graph.is_some() {
            return Err(ExecError::Plan("recompute by layers needs a chain of layers, not a graph".into()));
        }
        let head = model.layers.get(..cut).ok_or(ExecError::Plan(format!("no cut at layer {cut} of the stage")))?;
        head.iter().try_fold(x, |x, layer| {
            let y = layer.forward(x, true, key, side)?;
            Ok(match untracked {
                Some(dev) => {
                    let y = detach(&y);
                    release_dropped_graphs::<B>(dev);
                    y
                }
                None => y,
            })
        })
    }

    /// The forward of a stage cut at `cut` ([`Saved::Head`]): the head run untracked, the
    /// tail's graph kept. The load-balancing losses kept are the tail's, summed onto the
    /// head's value (untracked): the same value as the whole forward's, in the same order.
    pub(crate) fn forward_recomputing(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        model: &StageModel<B>,
        x: Act<B>,
        key: (u64, u64, u64),
        cut: usize,
    ) -> Result<Forwarded<B>> {
        // the head untracked (nothing held for a backward), the tail from a leaf copy of its
        // output, its load-balancing losses summed onto the head's
        let mut side = Collected::default();
        let head = Self::run_head(&untracked_copy(model), detach(&x), cut, key, &mut side, Some(&self.dev))?;
        let leaf = fresh(&head);
        drop(head);
        release_dropped_graphs::<B>(&self.dev);
        let mut out = leaf.clone();
        for layer in &model.layers[cut..] {
            out = layer.forward(out, true, key, &mut side)?;
        }
        let tail = Segment { leaf, out: out.clone(), boundary: Boundary::Complete };
        self.forwarded(stage, mb, out, side, move |loss, _| Saved::Head { cut, tail, loss })
    }

    /// The backward of a stage whose forward was cut ([`Saved::Head`]): the tail's to the
    /// cut, the head's forward again and its backward; leaves the input gradient to send.
    /// With `split` (the input half of a split backward) the dense weights' gradients of
    /// both are put off to the weight half, the tail's first.
    pub(crate) fn backward_recomputing(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        split: bool,
    ) -> Result<WeightGrads<B>> {
        let n_mb = self.plan.training.microbatches as f64;
        let kept =
            self.passes.saved.get(&(stage, mb)).ok_or(ExecError::Missing("its forward's activations are missing"))?;
        let Saved::Head { cut, tail, loss } = &kept.saved else {
            return Err(ExecError::Plan(format!("{stage}'s forward was not cut for recompute")));
        };
        let (cut, tail, loss) = (*cut, tail.clone(), loss.clone());
        let (input, used, aux) = (kept.input.clone(), kept.model.clone(), kept.aux.clone());
        let keys = sum_keys(&used);
        // the tail, from the loss or the gradient received at the stage's output
        let target = match loss {
            Some(l) => self.backward_seed(l, n_mb),
            None => {
                let g = self
                    .passes
                    .grads_in
                    .remove(&(stage, mb))
                    .ok_or(ExecError::Missing("the gradient of its output was not received"))?;
                dot_with::<B>(&tail.out, &g, &self.dev)?
            }
        };
        let target = match aux {
            Some(aux) => target + self.backward_seed(aux, n_mb),
            None => target,
        };
        let mut flat: FlatGrads<B> = Vec::new();
        let mut put_off = None;
        let mut grads = self.pass(stage, &keys, split, &mut put_off, target)?;
        accumulate::<B>(&mut flat, collect_grads(&used, &mut grads));
        let at_cut = grad_of(&tail.leaf, &mut grads).ok_or(ExecError::Missing("no gradient reached the cut"))?;
        drop((grads, tail));
        // the head again, from the kept input at the forward's weights
        let mut side = Collected::default();
        let head = Self::run_head(&used, input.clone(), cut, self.mask_key(mb), &mut side, None)?;
        let target = dot(&head, tracked::<B>(at_cut)?)?;
        let target = match side.aux.take() {
            Some(aux) => target + self.backward_seed(aux, n_mb),
            None => target,
        };
        let mut grads = self.pass(stage, &keys, split, &mut put_off, target)?;
        accumulate::<B>(&mut flat, collect_grads(&used, &mut grads));
        if stage.0 > 0 {
            let g = input_grad::<B>(&input, &mut grads, Tag::gradient(stage, mb))?
                .ok_or(ExecError::Missing("no gradient reached the stage input"))?;
            self.passes.input_grads.insert((stage, mb), g);
        }
        Ok(WeightGrads { rest: flat, deferred: put_off.map(|d| (keys, d)) })
    }

    /// One backward from `target`: the dense weights' gradients added into the stage's
    /// sums, or with `split` put off into `put_off`; Burn's gradients of the rest returned.
    fn pass(
        &mut self,
        stage: StageId,
        keys: &[Option<burn::backend::autodiff::NodeId>],
        split: bool,
        put_off: &mut Option<crate::backend::dense::Deferred<B::InnerBackend>>,
        target: burn::tensor::Tensor<B, 1>,
    ) -> Result<B::Gradients> {
        let grads = if split {
            let (grads, deferred) = backward_deferring::<B>(keys, || target.backward());
            match put_off {
                Some(d) => d.append(deferred),
                None => *put_off = Some(deferred),
            }
            grads
        } else {
            backward_into_sums::<B>(&mut self.state(stage)?.acc, keys, || target.backward())
        };
        // an exchange inside the backward records its failure instead of returning it
        self.exchange_failure(stage)?;
        Ok(grads)
    }
}
