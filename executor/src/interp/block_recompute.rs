//! Recompute inside a stage's transformer blocks (`recompute: { layers: n }`, `{ modules:
//! [...] }`, `{ ops: [...] }`): the stage's forward cut into pieces, each of which either
//! keeps its autodiff graph or keeps only its input and runs its forward again in the
//! backward.
//!
//! - By layers (Megatron-LM's `--recompute-num-layers` with its `block` method): each of the
//!   stage's first n transformer blocks is a piece run again.
//! - By module or operation: each block's halves (`Block::half`: the attention with its
//!   norm and residual sum, the MLP or mixture of experts likewise) that the policy
//!   recomputes anything of are pieces run again, from the half's input
//!   (`pipec_plan::plan::BlockRecompute::executor_halves`, which the plan's memory and
//!   step time count for this executor); `core_attn` is recomputed inside the attention
//!   kernel (`Kernels::attention_recomputed`).
//!
//! Every piece after the first starts from a leaf copy of the one before's output. A piece
//! run again runs untracked in the forward, keeping nothing but its input, and holding one
//! layer's tensors at a time ([`release_dropped_graphs`]). The backward runs the pieces
//! from the last: a kept piece's backward from its output's gradient; a piece run again
//! runs its forward again from its input at the weights the forward used (the same dropout
//! keys), then its backward. Each weight is used in one piece, so its gradient is the one
//! backward's through the whole stage: the same products in the same order.
//!
//! A piece run again makes its forward's collectives again inside the backward — ZeRO-3's
//! per-product gathers, context parallelism's key and value gathers, expert parallelism's
//! dispatch and combine — which the plan declares there (`pipec_plan::in_pass::declare`
//! reads the same `BlockRecompute::run_again`, and `Instr::all_to_alls_of` its
//! `ExpertExchange::again`).
//! With gradient buckets a kept run of units is also cut at each bucket's first layer, and
//! the step's last backward starts each bucket's reduction once the piece beginning there is
//! done (the plan declares it after that layer's units, recomputed or not).
//! A tensor-parallel stage runs its forward in segments of its own, a block's half each
//! (`parallel::tensor_parallel`), which run again the same way (a block recomputed whole by
//! its two halves). `pipec_executor::validate` refuses expert parallelism in a plan whose
//! `AllToAll` instructions do not list what the executor exchanges again (one made for
//! another engine).

use pipec_plan::{MicrobatchId, StageId};

use crate::backend::kernels::ExecBackend;
use crate::comm::transport::Tag;
use crate::error::{ExecError, Result};
use crate::interp::buckets::tracked;
use crate::interp::values::{
    carries_gradient, detach, dot, grad_of, input_grad, release_dropped_graphs, untracked_copy, Forwarded, Piece,
    Saved, Unit, WeightGrads,
};
use crate::interp::worker::Worker;

use crate::nn::block::Half;
use crate::nn::layers::{Act, Collected, Layer, StageModel};
use crate::nn::params::{accumulate, backward_deferring, backward_into_sums, collect_grads, sum_keys, FlatGrads};
use crate::parallel::tensor_parallel::fresh;

/// A stage's forward as units, each with whether it runs again in the backward, from what
/// each of its layers runs again (`again`): a layer whole, or a block's two halves where it
/// runs halves again. None where nothing runs again.
fn units_of(again: Vec<pipec_plan::plan::RunAgain>) -> Option<Vec<(Unit, bool)>> {
    use pipec_plan::plan::RunAgain;
    let mut units = Vec::with_capacity(again.len() * 2);
    for (k, again) in again.into_iter().enumerate() {
        match again {
            RunAgain::Nothing => units.push((Unit::Layer(k), false)),
            RunAgain::Whole => units.push((Unit::Layer(k), true)),
            RunAgain::Halves(h) => {
                units.push((Unit::Half(k, Half::Attention), h.attention));
                units.push((Unit::Half(k, Half::Mlp), h.mlp));
            }
        }
    }
    units.iter().any(|(_, again)| *again).then_some(units)
}

/// The layer whose first unit `unit` is: a layer whole, or a block's attention half.
fn first_of_layer(unit: Unit) -> Option<usize> {
    match unit {
        Unit::Layer(k) | Unit::Half(k, Half::Attention) => Some(k),
        Unit::Half(_, Half::Mlp) => None,
    }
}

/// Runs `unit` of `model` on `x`.
fn run_unit<B: ExecBackend>(model: &StageModel<B>, unit: Unit, x: Act<B>, side: &mut Collected<B>) -> Result<Act<B>> {
    let layer = |k: usize| model.layers.get(k).ok_or(ExecError::Plan(format!("the stage has no layer at {k}")));
    match unit {
        Unit::Layer(k) => layer(k)?.forward(x, true, side),
        Unit::Half(k, half) => match (layer(k)?, x) {
            (Layer::Block(b), Act::D3(t)) => Ok(Act::D3(b.half(half, t, true, side)?)),
            (_, x) => Err(ExecError::Shape(format!(
                "layer {k} is not a transformer block taking [batch, seq, d] (given {:?})",
                x.dims()
            ))),
        },
    }
}

/// Runs `units` of `model` on `x`; `untracked` (on this device): each unit's output
/// detached and what Burn still holds of it released before the next, so that it holds one
/// unit's tensors at a time.
fn run_units<B: ExecBackend>(
    model: &StageModel<B>,
    units: &[Unit],
    x: Act<B>,
    side: &mut Collected<B>,
    untracked: Option<&B::Device>,
) -> Result<Act<B>> {
    units.iter().try_fold(x, |x, &unit| {
        let y = run_unit(model, unit, x, side)?;
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

impl<'a, B: ExecBackend> Worker<'a, B> {
    /// What each layer of `stage` (`model`'s) runs again in its backward under the plan's
    /// recompute inside the blocks (`BlockRecompute::run_again`, its blocks whole or
    /// tensor-parallel). None without it, on a stage that recomputes its whole forward, for
    /// a graph of layers, and while evaluating (nothing is kept for a backward).
    pub(crate) fn run_again(&self, stage: StageId, model: &StageModel<B>) -> Option<Vec<pipec_plan::plan::RunAgain>> {
        let policy = self.plan.schedule.block_recompute.as_ref()?;
        if self.progress.evaluating.is_some() || model.graph.is_some() {
            return None;
        }
        self.plan.stage(stage).filter(|s| !s.recompute)?;
        let blocks: Vec<bool> =
            model.layers.iter().map(|l| matches!(l, Layer::Block(_) | Layer::ParallelBlock(_))).collect();
        Some(policy.run_again(&blocks))
    }

    /// `stage`'s forward as units ([`units_of`]) under the plan's recompute inside the
    /// blocks ([`Worker::run_again`]); None where nothing runs again.
    pub(crate) fn recompute_units(&self, stage: StageId, model: &StageModel<B>) -> Option<Vec<(Unit, bool)>> {
        units_of(self.run_again(stage, model)?)
    }

    /// The forward of a stage cut into pieces ([`Saved::Pieces`]). The load-balancing
    /// losses are summed in the forward's order, each piece's onto the value of those
    /// before it (untracked), so that each piece's own are seeded in its own backward.
    pub(crate) fn forward_in_pieces(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        model: &StageModel<B>,
        x: Act<B>,
        units: Vec<(Unit, bool)>,
    ) -> Result<Forwarded<B>> {
        // where the stage's gradient buckets begin (the step's last backward starts each)
        let cuts = self.bucket_cuts(stage).unwrap_or_default();
        let untracked = untracked_copy(model);
        // ZeRO-3: the untracked copy's products gather their weights too
        let gathered = self.gathered_weights(stage, &untracked)?;
        let mut side = self.side(stage, mb);
        let (mut pieces, mut starts) = (Vec::new(), Vec::new());
        let mut cur = x;
        let mut rest = units.as_slice();
        let cut_before = |u: &Unit| first_of_layer(*u).is_some_and(|k| cuts.contains(&k));
        while let Some(&(first, again)) = rest.first() {
            // a unit run again is a piece of its own (its input kept, one unit's tensors
            // back at a time in the backward); units kept run as one piece up to a gradient
            // bucket's first layer
            let kept = rest[1..].iter().take_while(|(u, a)| !*a && !cut_before(u)).count();
            let n = if again { 1 } else { 1 + kept };
            let run: Vec<Unit> = rest[..n].iter().map(|(u, _)| *u).collect();
            rest = &rest[n..];
            starts.push(first_of_layer(first));
            side.aux = side.aux.take().map(|a| a.detach());
            if again {
                let out = crate::backend::dense::with_more_gathered_weights(gathered.clone(), || {
                    run_units(&untracked, &run, detach(&cur), &mut side, Some(&self.dev))
                })?;
                side.aux = side.aux.take().map(|a| a.detach());
                pieces.push(Piece::Again { input: cur, units: run });
                cur = fresh(&out);
                release_dropped_graphs::<B>(&self.dev);
            } else {
                let out = run_units(model, &run, cur.clone(), &mut side, None)?;
                pieces.push(Piece::Kept { leaf: cur, out: out.clone(), aux: side.aux.clone() });
                // a leaf carries a gradient where the output did (not after layers without
                // weights on the first stage, as the plan's declarations count it)
                cur = match (rest.is_empty(), carries_gradient(&out)) {
                    (true, _) => out,
                    (false, true) => fresh(&out),
                    (false, false) => detach(&out),
                };
            }
        }
        // the stage's output: a kept piece's, or a leaf after a piece run again (its
        // backward starts from the gradient there)
        if matches!(pieces.last(), Some(Piece::Again { .. })) {
            pieces.push(Piece::Kept { leaf: cur.clone(), out: cur.clone(), aux: None });
            starts.push(None);
        }
        side.aux = side.aux.map(|a| a.detach());
        self.forwarded(stage, mb, cur, side, move |loss, _| Saved::Pieces { pieces, starts, loss })
    }

    /// The backward of a stage cut into pieces, from the last: a kept piece's backward, a
    /// piece run again's forward again and its backward. Leaves the input gradient to send.
    /// With `split` (the input half of a split backward) the dense weights' gradients are
    /// put off to the weight half, the last piece's first. With `reduce` (the step's last
    /// gradient of a stage with gradient buckets, its reduction over that group to follow)
    /// the gradients go into the stage's sums as each piece finishes, and each bucket's
    /// reduction starts once the piece beginning at its first layer is done
    /// (`crate::interp::buckets`).
    pub(crate) fn backward_in_pieces(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        split: bool,
        reduce: Option<(pipec_plan::GroupId, usize)>,
    ) -> Result<WeightGrads<B>> {
        let n_mb = self.plan.training.microbatches as f64;
        let kept =
            self.passes.saved.get(&(stage, mb)).ok_or(ExecError::Missing("its forward's activations are missing"))?;
        let Saved::Pieces { pieces, starts, loss } = &kept.saved else {
            return Err(ExecError::Plan(format!("{stage}'s forward was not cut for recompute")));
        };
        // clones share the forward's autodiff nodes, so gradients are found by them
        let (pieces, starts, loss, used) = (pieces.clone(), starts.clone(), loss.clone(), kept.model.clone());
        // each bucket's first layer (a position in the stage) and parameters
        let buckets: Vec<(usize, std::ops::Range<usize>)> = match reduce {
            Some(_) => {
                let firsts = self.bucket_firsts(stage).ok_or(ExecError::Plan(format!("the plan has no {stage}")))?;
                firsts.into_iter().zip(self.bucket_params(stage, &used)?).collect()
            }
            None => Vec::new(),
        };
        let mut started = 0;
        let keys = sum_keys(&used);
        // ZeRO-3: the products of what runs again gather their weights again, as in the forward
        let gathered = self.gathered_weights(stage, &used)?;
        let mut flat: FlatGrads<B> = Vec::new();
        let mut put_off = None;
        // the gradient at the output of the piece being run back
        let mut grad_out: Option<Act<B>> = None;
        // set at a cut no gradient crosses: nothing before it carries one, so the pieces
        // before it run no backward (their buckets still start)
        let mut settled = false;
        for (k, piece) in pieces.iter().enumerate().rev() {
            if !settled {
                let (target, leaf) = match piece {
                    Piece::Kept { leaf, out, aux } => {
                        let target = self.seed_at(stage, mb, out, grad_out.take(), loss.as_ref())?;
                        let target = match aux {
                            Some(aux) => target + self.backward_seed(aux.clone(), n_mb),
                            None => target,
                        };
                        (target, leaf)
                    }
                    Piece::Again { input, units } => {
                        let g = grad_out.take().ok_or(ExecError::Missing("no gradient reached a recomputed piece"))?;
                        let mut side = self.side(stage, mb);
                        let out = crate::backend::dense::with_gathered_weights(gathered.clone(), || {
                            run_units(&used, units, input.clone(), &mut side, None)
                        })?;
                        self.exchange_failure(stage)?;
                        let target = dot(&out, g)?;
                        let target = match side.aux.take() {
                            Some(aux) => target + self.backward_seed(aux, n_mb),
                            None => target,
                        };
                        (target, input)
                    }
                };
                let mut grads = self.pass(stage, &keys, split, &mut put_off, target)?;
                match reduce {
                    Some(_) => accumulate::<B>(&mut self.state(stage)?.acc, collect_grads(&used, &mut grads)),
                    None => accumulate::<B>(&mut flat, collect_grads(&used, &mut grads)),
                }
                if k > 0 && !carries_gradient(leaf) {
                    settled = true;
                } else if k > 0 {
                    let g =
                        grad_of(leaf, &mut grads).ok_or(ExecError::Missing("no gradient reached a recompute cut"))?;
                    grad_out = Some(tracked::<B>(g)?);
                } else if stage.0 > 0 {
                    let g = input_grad::<B>(leaf, &mut grads, Tag::gradient(stage, mb))?
                        .ok_or(ExecError::Missing("no gradient reached the stage input"))?;
                    self.passes.input_grads.insert((stage, mb), g);
                }
            }
            // the bucket beginning where this piece begins is complete
            let bucket = starts.get(k).copied().flatten().and_then(|at| buckets.iter().find(|(first, _)| *first == at));
            if let (Some((group, code)), Some((_, params))) = (reduce, bucket) {
                if k == 0 {
                    self.count_contribution(stage, mb)?;
                }
                self.start_bucket(stage, group, params.clone(), k == 0, code)?;
                started += 1;
            }
        }
        if started != buckets.len() {
            return Err(ExecError::Plan(format!(
                "{stage}'s recompute pieces began {started} of its {} gradient buckets",
                buckets.len()
            )));
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
