//! The worker's compute instructions: forward, recompute and backward (whole or split),
//! each on a fresh-leaf copy of the stage's weights; a tensor-parallel stage differs only
//! in `run_forward` and `run_backward` (see `tensor_parallel`).

use burn::prelude::*;
use burn::tensor::ElementConversion;
use pipec_plan::model::Loss;
use pipec_plan::{MicrobatchId, StageId};

use crate::backend::kernels::ExecBackend;
use crate::comm::transport::{Message, Tag};
use crate::error::{ExecError, Result};
use crate::interp::data::Targets;
use crate::interp::values::{
    act_to_message, detach, dot, dot_with, input_grad, microbatch_copy, require_grad, Forwarded, Kept, Saved,
    WeightGrads,
};
use crate::interp::worker::{add_expert_tokens, StepReport, Worker};
use crate::nn::layers::{Act, StageModel};
use crate::nn::params::{
    accumulate, add_deferred_into_sums, backward_deferring, backward_into_sums, collect_grads, sum_keys, FlatGrads,
};
use crate::parallel::tensor_parallel::Boundary;

impl<'a, B: ExecBackend> Worker<'a, B> {
    /// `Forward`: runs the stage on a microbatch copy of its weights (the stashed version
    /// when the plan stashed one; vertical sync may pick an older version than the current
    /// one), reports the loss or keeps the output to send, and keeps what the backward needs.
    pub(crate) fn forward(&mut self, stage: StageId, mb: MicrobatchId, report: &mut StepReport) -> Result<()> {
        let x = self
            .passes
            .inputs
            .remove(&(stage, mb))
            .ok_or(ExecError::Missing("its input was not loaded or received"))?;
        let st = self.state(stage)?;
        let model = microbatch_copy(match st.stash.get(&mb) {
            Some(m) => m,
            None => st.model()?,
        });
        let gathered = self.gathered_weights(stage, &model)?;
        let f =
            crate::backend::dense::with_gathered_weights(gathered, || self.run_forward(stage, mb, &model, x.clone()))?;
        // the forward (not a recompute) records batch normalisation's statistics; validation
        // trains nothing
        if self.progress.evaluating.is_none() {
            self.state(stage)?.record_statistics(mb, f.stats);
        }
        if let Some(loss) = f.loss {
            let value = loss.into_scalar().elem::<f32>();
            if !value.is_finite() {
                return Err(ExecError::NonFinite(format!("the loss of microbatch {} is {value}", mb.0)));
            }
            report.losses.push((mb.0, value));
            if let (Some(_), Some(scores)) = (self.progress.evaluating, &f.scores) {
                if let Some(c) = self.correct(mb, scores)? {
                    report.correct.push(c);
                }
            }
        }
        if let Some(out) = &f.output {
            self.passes.outputs.insert((stage, mb), act_to_message(out, Tag::activation(stage, mb))?);
        }
        // the mixtures of experts' load-balancing losses and token counts (training only)
        if self.progress.evaluating.is_none() {
            if let Some(aux) = &f.aux {
                report.aux_losses.push((mb.0, aux.clone().into_scalar().elem::<f32>()));
            }
            for (layer, took) in &f.expert_tokens {
                add_expert_tokens(&mut report.expert_tokens, *layer, took);
            }
        }
        // with recompute only the input is kept (the last stage keeps its loss); the
        // `Recompute` instruction re-runs the forward, a tensor-parallel group's
        // all-reduces included
        let recompute = self.plan.stage(stage).is_some_and(|s| s.recompute);
        let keep_all = !recompute || stage == self.last_stage();
        // ZeRO-3: a recomputed forward keeps no weights either (the recompute gathers them
        // again), so that the stage's whole weights can be dropped between its passes
        let model =
            if keep_all || !self.sharded_at_3(stage) { model } else { crate::parallel::zero::released_copy(&model) };
        let kept = Kept {
            input: if recompute { detach(&x) } else { x },
            saved: if keep_all { f.saved } else { Saved::Nothing },
            model,
            aux: if keep_all { f.aux } else { None },
        };
        self.passes.saved.insert((stage, mb), kept);
        *self.passes.in_flight.entry(stage).or_insert(0) += 1;
        if !keep_all {
            // the graph just dropped, freed now rather than at the next backward
            crate::interp::values::release_dropped_graphs::<B>(&self.dev);
        }
        Ok(())
    }

    /// `Recompute`: re-runs the forward from the kept input at the weights the forward used
    /// (not the newest, if an update came between), with the same dropout masks.
    pub(crate) fn recompute(&mut self, stage: StageId, mb: MicrobatchId) -> Result<()> {
        let Kept { input, model, .. } =
            self.passes.saved.remove(&(stage, mb)).ok_or(ExecError::Missing("nothing is kept for this microbatch"))?;
        let x = if stage.0 == 0 { input } else { require_grad(input) };
        // ZeRO-3: the weights gathered for this pass (one version a step: the forward's)
        let model = if self.sharded_at_3(stage) {
            microbatch_copy(self.state(stage)?.model()?)
        } else {
            microbatch_copy(&model)
        };
        let gathered = self.gathered_weights(stage, &model)?;
        let f =
            crate::backend::dense::with_gathered_weights(gathered, || self.run_forward(stage, mb, &model, x.clone()))?;
        self.passes.saved.insert((stage, mb), Kept { input: x, saved: f.saved, model, aux: f.aux });
        Ok(())
    }

    /// Whether `stage` is sharded at ZeRO stage 3 on this device (its weights gathered for
    /// passes).
    pub(crate) fn sharded_at_3(&self, stage: StageId) -> bool {
        let shard = self.stages.get(&stage).and_then(|s| s.shard.as_ref());
        shard.is_some_and(|s| s.level == pipec_plan::vocab::Sharding::Parameters)
    }

    /// A stage's forward on `model`; the one place a tensor-parallel stage's forward differs.
    pub(crate) fn run_forward(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        model: &StageModel<B>,
        x: Act<B>,
    ) -> Result<Forwarded<B>> {
        let is_last = stage == self.last_stage();
        // validation: dropout off, batch normalisation on its running statistics
        let training = self.progress.evaluating.is_none();
        if let Some(tp) = self.state(stage)?.tp.clone() {
            let reduce = self.transfers.reduce;
            let comm = &self.comm;
            let mut sum = |v: Vec<f32>| -> Result<Vec<f32>> { Ok(comm.in_pass_all_reduce(&tp.members, v, reduce)?) };
            let mut side = self.side(stage, mb);
            // recompute inside the blocks: the halves run again untracked (not while evaluating)
            let again = self.run_again(stage, model);
            let untracked = again.as_ref().map(|_| crate::interp::values::untracked_copy(model));
            let dev = self.dev.clone();
            let release = move || crate::interp::values::release_dropped_graphs::<B>(&dev);
            let rerun = again.as_deref().zip(untracked.as_ref()).map(|(again, untracked)| {
                crate::parallel::tensor_parallel::Rerun { again, untracked, release: &release }
            });
            let segments =
                crate::parallel::tensor_parallel::forward(model, x, training, &mut sum, &mut side, rerun.as_ref())?;
            // the load-balancing losses' value, reported by one rank (each segment's graph
            // seeds its own backward)
            let aux = side.aux.take().filter(|_| tp.rank == 0);
            let stats = side.stats;
            let out = segments.last().map(|s| s.out.clone()).ok_or(ExecError::Missing("the stage has no layers"))?;
            if !is_last {
                return Ok(Forwarded {
                    saved: Saved::Tp(segments, None),
                    output: Some(out),
                    loss: None,
                    stats,
                    scores: None,
                    aux,
                    // every rank routes alike: one reports
                    expert_tokens: if tp.rank == 0 { side.expert_tokens } else { Vec::new() },
                });
            }
            let leaf = crate::parallel::tensor_parallel::fresh(&out);
            let loss = match model.layers.last() {
                // the scores are split over the vocabulary: Megatron's vocabulary-parallel loss
                Some(crate::nn::layers::Layer::VocabLinear(_)) => {
                    let part = leaf.dims().last().copied().unwrap_or(0);
                    let Some(Targets::Classes(classes)) = self.passes.labels.get(&mb) else {
                        return Err(ExecError::Missing("the class labels of this microbatch were not loaded"));
                    };
                    crate::parallel::tensor_parallel::vocab_parallel_loss(
                        leaf.clone(),
                        classes,
                        tp.rank * part,
                        tp.rank,
                        tp.members.len(),
                        &mut sum,
                    )?
                }
                _ => self.loss(mb, leaf.clone())?,
            };
            let reported = (tp.rank == 0).then(|| loss.clone());
            // a vocabulary-parallel layer's scores are split over the ranks: no accuracy
            let scores = match model.layers.last() {
                Some(crate::nn::layers::Layer::VocabLinear(_)) => None,
                _ => reported.as_ref().map(|_| leaf.clone()),
            };
            return Ok(Forwarded {
                saved: Saved::Tp(segments, Some((leaf, loss))),
                output: None,
                loss: reported,
                stats,
                scores,
                aux,
                expert_tokens: if tp.rank == 0 { side.expert_tokens } else { Vec::new() },
            });
        }
        if let Some(units) = self.recompute_units(stage, model) {
            return self.forward_in_pieces(stage, mb, model, x, units);
        }
        if let Some(cuts) = self.bucket_cuts(stage) {
            return self.forward_segmented(stage, mb, model, x, &cuts);
        }
        let mut side = self.side(stage, mb);
        let out = model.forward(x, training, &mut side)?;
        self.forwarded(stage, mb, out, side, |loss, out| match loss {
            Some(loss) => Saved::Loss(loss),
            None => Saved::Output(out.clone()),
        })
    }

    /// What a forward of `stage` hands on from its output `out` and what it collected: on
    /// the last stage its loss (and the scores validation reads), else the output to send;
    /// `saved` makes what the backward starts from, given the loss (None on another stage).
    pub(crate) fn forwarded(
        &self,
        stage: StageId,
        mb: MicrobatchId,
        out: Act<B>,
        side: crate::nn::layers::Collected<B>,
        saved: impl FnOnce(Option<Tensor<B, 1>>, &Act<B>) -> Saved<B>,
    ) -> Result<Forwarded<B>> {
        let crate::nn::layers::Collected { stats, aux, expert_tokens, .. } = side;
        if stage == self.last_stage() {
            let loss = self.loss(mb, out.clone())?;
            let saved = saved(Some(loss.clone()), &out);
            Ok(Forwarded { saved, output: None, loss: Some(loss), stats, scores: Some(out), aux, expert_tokens })
        } else {
            let saved = saved(None, &out);
            Ok(Forwarded { saved, output: Some(out), loss: None, stats, scores: None, aux, expert_tokens })
        }
    }

    /// A classifier's correct predictions among a microbatch's (the class of the highest
    /// score against the label; a language model's at every position), and their number;
    /// None for a regression.
    pub(crate) fn correct(&self, mb: MicrobatchId, scores: &Act<B>) -> Result<Option<(f64, f64)>> {
        let Some(Targets::Classes(labels)) = self.passes.labels.get(&mb) else { return Ok(None) };
        let values = crate::nn::params::host_f32(match scores {
            Act::D2(t) => t.clone().inner().into_data(),
            Act::D3(t) => t.clone().inner().into_data(),
            _ => return Ok(None),
        })?;
        let classes = scores.dims().last().copied().unwrap_or(1).max(1);
        if values.len() != labels.len() * classes {
            return Ok(None);
        }
        let correct = values
            .chunks_exact(classes)
            .zip(labels)
            .filter(|(row, &label)| {
                let best = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(c, _)| c);
                best as i64 == label
            })
            .count();
        Ok(Some((correct as f64, labels.len() as f64)))
    }

    /// What a pass of `stage` on microbatch `mb` collects into (`Collected`), with its
    /// expert-parallel and context-parallel groups and, when training, its dropout key.
    pub(crate) fn side(&self, stage: StageId, mb: MicrobatchId) -> crate::nn::layers::Collected<B> {
        crate::nn::layers::Collected {
            experts: self.experts_for(stage),
            context: self.context_for(stage),
            mask_key: self.progress.evaluating.is_none().then(|| self.mask_key(mb)),
            ..Default::default()
        }
    }

    /// This device's expert-parallel group for `stage`, its exchanges recorded for a
    /// backward only when training (not while evaluating).
    pub(crate) fn experts_for(&self, stage: StageId) -> Option<crate::backend::port::PeerGroup> {
        self.groups.experts.get(&stage).map(|g| self.tracked(g))
    }

    /// This device's context-parallel group for `stage`, its gather recorded for a backward
    /// only when training (not while evaluating).
    pub(crate) fn context_for(&self, stage: StageId) -> Option<crate::nn::context::Context> {
        self.groups
            .contexts
            .get(&stage)
            .map(|c| crate::nn::context::Context { group: self.tracked(&c.group), ..c.clone() })
    }

    /// `group`, its exchanges recorded for a backward only when training.
    fn tracked(&self, group: &crate::backend::port::PeerGroup) -> crate::backend::port::PeerGroup {
        crate::backend::port::PeerGroup { tracked: self.progress.evaluating.is_none(), ..group.clone() }
    }

    /// The first failure of an expert or context-parallel exchange inside a backward of
    /// `stage` (a backward cannot return one; the exchange records it).
    pub(crate) fn exchange_failure(&self, stage: StageId) -> Result<()> {
        let failure = self
            .groups
            .experts
            .get(&stage)
            .and_then(crate::backend::port::PeerGroup::take_failure)
            .or_else(|| self.groups.contexts.get(&stage).and_then(crate::nn::context::Context::take_failure));
        match failure {
            Some(e) => Err(e.recorded_in(&format!("an exchange with the group in the backward of {stage} failed"))),
            None => Ok(()),
        }
    }

    /// What a microbatch's backward starts from for its loss `l`: `l / N` (the step's mean
    /// over its N microbatches), times fp16's loss scale when the loss is scaled (a power of
    /// two: every gradient is exactly the scale times its unscaled value until a product
    /// rounds it).
    pub(crate) fn backward_seed(&self, l: Tensor<B, 1>, n_mb: f64) -> Tensor<B, 1> {
        let l = l / n_mb;
        match self.progress.loss_scale {
            Some(s) => l * s.scale,
            None => l,
        }
    }

    /// What the backward of a part of `stage`'s forward ending at `out` starts from: the
    /// gradient `grad_out` the part after it handed back, else (the stage's last part) the
    /// seed of its `loss` on the last stage or the gradient received at its output.
    pub(crate) fn seed_at(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        out: &Act<B>,
        grad_out: Option<Act<B>>,
        loss: Option<&Tensor<B, 1>>,
    ) -> Result<Tensor<B, 1>> {
        let n_mb = self.plan.training.microbatches as f64;
        match (grad_out, loss) {
            (Some(g), _) => dot(out, g),
            (None, Some(l)) => Ok(self.backward_seed(l.clone(), n_mb)),
            (None, None) => {
                let g = self
                    .passes
                    .grads_in
                    .remove(&(stage, mb))
                    .ok_or(ExecError::Missing("the gradient of its output was not received"))?;
                dot_with::<B>(out, &g, &self.dev)
            }
        }
    }

    /// The mean loss of a microbatch's output (tracked).
    pub(crate) fn loss(&self, mb: MicrobatchId, out: Act<B>) -> Result<Tensor<B, 1>> {
        let y =
            self.passes.labels.get(&mb).ok_or(ExecError::Missing("the labels of this microbatch were not loaded"))?;
        loss_of::<B>(self.plan.model.loss, out, y, &self.dev)
    }

    /// A microbatch's backward: leaves the input gradient to send (every stage but the
    /// first) and returns the weight gradients not yet summed. The dense weights' gradients
    /// are added straight into the stage's sums inside the pass (`dense::with_gradient_sums`)
    /// or, for the input half of a split backward (`split`), put off to its weight half
    /// (`dense::with_deferred_weight_gradients`); the rest are Burn's.
    pub(crate) fn run_backward(&mut self, stage: StageId, mb: MicrobatchId, split: bool) -> Result<WeightGrads<B>> {
        let n_mb = self.plan.training.microbatches as f64;
        let kept =
            self.passes.saved.get(&(stage, mb)).ok_or(ExecError::Missing("its forward's activations are missing"))?;
        let target = match &kept.saved {
            // (an exchange inside these backwards records its failure too: checked after them)
            Saved::Tp(..) => {
                let grads = self.backward_tp(stage, mb, n_mb)?;
                self.exchange_failure(stage)?;
                return Ok(WeightGrads::all(grads));
            }
            Saved::Segmented(..) if split => {
                return Err(ExecError::Plan(format!("{stage} has gradient buckets and a split backward")))
            }
            Saved::Segmented(..) => {
                let grads = self.backward_segments(stage, mb, None)?;
                self.exchange_failure(stage)?;
                return Ok(grads);
            }
            Saved::Pieces { .. } => return self.backward_in_pieces(stage, mb, split, None),
            Saved::Loss(l) => self.backward_seed(l.clone(), n_mb),
            Saved::Output(out) => {
                let g = self
                    .passes
                    .grads_in
                    .remove(&(stage, mb))
                    .ok_or(ExecError::Missing("the gradient of its output was not received"))?;
                dot_with::<B>(out, &g, &self.dev)?
            }
            Saved::Nothing => return Err(ExecError::Missing("recompute was not run before the backward")),
        };
        // the stage's load-balancing losses, weighted as the microbatch's loss is
        let target = match &kept.aux {
            Some(aux) => target + self.backward_seed(aux.clone(), n_mb),
            None => target,
        };
        let keys = sum_keys(&kept.model);
        let (mut grads, deferred) = if split {
            let (grads, deferred) = backward_deferring::<B>(&keys, || target.backward());
            (grads, Some((keys, deferred)))
        } else {
            (backward_into_sums::<B>(&mut self.state(stage)?.acc, &keys, || target.backward()), None)
        };
        // an exchange inside the backward records its failure instead of returning it
        self.exchange_failure(stage)?;
        let kept =
            self.passes.saved.get(&(stage, mb)).ok_or(ExecError::Missing("its forward's activations are missing"))?;
        if stage.0 > 0 {
            let g = input_grad::<B>(&kept.input, &mut grads, Tag::gradient(stage, mb))?
                .ok_or(ExecError::Missing("no gradient reached the stage input"))?;
            self.passes.input_grads.insert((stage, mb), g);
        }
        Ok(WeightGrads { rest: collect_grads(&kept.model, &mut grads), deferred })
    }

    /// The backward of a tensor-parallel stage, segment by segment (see
    /// `tensor_parallel`); returns the weight gradients and leaves the input gradient to send.
    pub(crate) fn backward_tp(&mut self, stage: StageId, mb: MicrobatchId, n_mb: f64) -> Result<FlatGrads<B>> {
        let tp = self.state(stage)?.tp.clone().ok_or(ExecError::Plan(format!("{stage} is not tensor-parallel")))?;
        let size = tp.members.len() as f32;
        let reduce = self.transfers.reduce;
        let Kept { saved, model: used, .. } =
            self.passes.saved.get(&(stage, mb)).ok_or(ExecError::Missing("its forward's activations are missing"))?;
        let Saved::Tp(segments, loss) = saved else {
            return Err(ExecError::Plan(format!("{stage}'s forward was not tensor-parallel")));
        };
        // clones share the forward's autodiff nodes, so gradients are found by them
        let (segments, loss, used) = (segments.clone(), loss.clone(), used.clone());
        // the gradient at the last segment's output
        let mut grad_out: Message = match loss {
            Some((leaf, l)) => {
                let mut grads = self.backward_seed(l, n_mb).backward();
                input_grad::<B>(&leaf, &mut grads, Tag::gradient(stage, mb))?
                    .ok_or(ExecError::Missing("no gradient reached the loss input"))?
            }
            None => self
                .passes
                .grads_in
                .remove(&(stage, mb))
                .ok_or(ExecError::Missing("the gradient of its output was not received"))?,
        };
        let mut flat: FlatGrads<B> = Vec::new();
        for (k, seg) in segments.iter().enumerate().rev() {
            // a block's half run again (recompute inside the blocks), its all-reduce again too
            let (out, aux) = match seg.rerun {
                Some((layer, half)) => {
                    let (Some(crate::nn::layers::Layer::ParallelBlock(b)), Act::D3(t)) =
                        (used.layers.get(layer), seg.leaf.clone())
                    else {
                        return Err(ExecError::Plan(format!("layer {layer} of {stage} is not a block to run again")));
                    };
                    let mut side = self.side(stage, mb);
                    let comm = &self.comm;
                    let mut sum =
                        |v: Vec<f32>| -> Result<Vec<f32>> { Ok(comm.in_pass_all_reduce(&tp.members, v, reduce)?) };
                    let out = crate::parallel::tensor_parallel::run_half(b, half, t, &mut sum, &mut side)?;
                    (Act::D3(out), side.aux.take())
                }
                None => (seg.out.clone(), seg.aux.clone()),
            };
            // every rank makes the whole load-balancing loss, whose gradient the group sums
            // (the router's, partial, and the segment input's): each seeds 1/size of it
            let target = dot_with::<B>(&out, &grad_out, &self.dev)?;
            let target = match aux {
                Some(a) => target + self.backward_seed(a / f64::from(size), n_mb),
                None => target,
            };
            let mut grads = target.backward();
            accumulate::<B>(&mut flat, collect_grads(&used, &mut grads));
            if k == 0 && stage.0 == 0 {
                break;
            }
            let mut g = input_grad::<B>(&seg.leaf, &mut grads, Tag::gradient(stage, mb))?
                .ok_or(ExecError::Missing("no gradient reached a segment input"))?;
            if seg.boundary != Boundary::Complete {
                let sum = |data| self.comm.in_pass_all_reduce(&tp.members, data, reduce);
                g.data = sum(std::mem::take(&mut g.data))?;
                if seg.boundary == Boundary::SumResidual {
                    // the residual's share was counted on every rank: keep it once
                    for (x, r) in g.data.iter_mut().zip(&grad_out.data) {
                        *x -= (size - 1.0) * r;
                    }
                }
            }
            if k == 0 {
                self.passes.input_grads.insert((stage, mb), g);
            } else {
                grad_out = g;
            }
        }
        Ok(flat)
    }

    /// Adds one microbatch's weight gradients (and its forward's batch statistics) to the
    /// stage's accumulator.
    pub(crate) fn add_gradient(&mut self, stage: StageId, mb: MicrobatchId, grads: WeightGrads<B>) -> Result<()> {
        let precision = self.plan.training.grad_precision;
        let st = self.state(stage)?;
        if let Some((keys, deferred)) = grads.deferred {
            add_deferred_into_sums::<B>(&mut st.acc, &keys, deferred);
        }
        accumulate::<B>(&mut st.acc, grads.rest);
        crate::nn::params::round_grads::<B>(&mut st.acc, precision);
        self.count_contribution(stage, mb)
    }

    /// Adds microbatch `mb`'s batch statistics to the stage's and counts its gradient in.
    pub(crate) fn count_contribution(&mut self, stage: StageId, mb: MicrobatchId) -> Result<()> {
        let weight = match self.plan.training.recipe.running_stats {
            pipec_plan::recipe::RunningStats::PerUpdate => 1.0,
            pipec_plan::recipe::RunningStats::PerForward => {
                crate::interp::stage::per_forward_weight(mb, self.plan.training.microbatches)
            }
        };
        let st = self.state(stage)?;
        st.add_statistics(mb, weight);
        st.contributions += 1;
        Ok(())
    }
}

/// The mean loss of a microbatch (tracked).
pub(crate) fn loss_of<B: ExecBackend>(loss: Loss, out: Act<B>, y: &Targets, dev: &B::Device) -> Result<Tensor<B, 1>> {
    // a language model's [batch, seq, vocab] scores: the mean over every position of the
    // cross-entropy with its next token
    let out = match (loss, out) {
        (Loss::CrossEntropy, Act::D3(t)) => {
            let [n, s, v] = t.dims();
            Act::D2(t.reshape([n * s, v]))
        }
        (_, out) => out,
    };
    let Act::D2(logits) = out else {
        return Err(ExecError::Shape(format!("the loss needs a [batch, outputs] output, got {:?}", out.dims())));
    };
    let [n, c] = logits.dims();
    match (loss, y) {
        (Loss::CrossEntropy, Targets::Classes(classes)) => {
            if classes.len() != n {
                return Err(ExecError::Data(format!("{} classes for {n} rows of logits", classes.len())));
            }
            Ok(crate::backend::kernels::cross_entropy(logits, classes.clone()))
        }
        (Loss::Mse, Targets::Values(values)) => {
            let target = Tensor::<B, 2>::from_data(TensorData::new(values.clone(), [n, c]), dev);
            Ok((logits - target).powi_scalar(2).mean())
        }
        _ => Err(ExecError::Data(format!("the targets do not fit the `{loss}` loss"))),
    }
}
