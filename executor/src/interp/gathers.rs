//! ZeRO as the worker runs it: a replica's shard update, the stage gathers and their
//! prefetch, and the per-product gathers a pass installs for its products.

use std::collections::HashMap;

use pipec_plan::{Instr, StageId};

use crate::backend::kernels::ExecBackend;
use crate::comm::exchanger::Ticket;
use crate::comm::transport::TransportError;
use crate::error::{ExecError, Result};
use crate::interp::worker::Worker;

impl<B: ExecBackend> Worker<'_, B> {
    /// `ShardStep` (ZeRO): the update of this replica's shard from its reduced gradient
    /// shard (the sum over the replicas of every microbatch's mean scaled by 1/N, as the
    /// all-reduce gives the whole); batch normalisation's statistics, which every replica
    /// received summed, are folded in; at stage 3 the whole weights are dropped until the
    /// next pass gathers them.
    pub(crate) fn shard_step(&mut self, stage: StageId) -> Result<()> {
        let lr = self.learning_rate();
        let n_mb = self.plan.training.microbatches as f64;
        let unscale = self.unscale()?;
        let clip = if unscale.is_some() { self.clip_factor(stage)? } else { 1.0 };
        let st = self.state(stage)?;
        let shard = st.shard.as_mut().ok_or_else(|| ExecError::Plan(format!("{stage} is not sharded here")))?;
        let scale = clip * if shard.contributions > 0 { n_mb / shard.contributions as f64 } else { 1.0 };
        match unscale {
            Some(unscale) => shard.update(lr, scale * unscale)?,
            None => shard.skip(),
        }
        let release = shard.level == pipec_plan::vocab::Sharding::Parameters;
        let stats = std::mem::take(&mut shard.stats);
        let dev = self.dev.clone();
        let rule = self.plan.training.recipe.running_stats;
        let st = self.state(stage)?;
        st.set_statistics(&stats, &dev)?;
        st.fold_statistics(rule)?;
        st.clear_gradients();
        if release {
            crate::interp::sharded::release_weights(st)?;
        }
        Ok(())
    }

    /// ZeRO-3: drops the stage's whole weights (those its products do not gather themselves,
    /// `zero::per_product`) once nothing kept for a backward holds them —
    /// after a recomputed stage's forward (which keeps only its input) and after the free
    /// of a stage's last microbatch in flight — so that the next pass gathers them again
    /// (FSDP's free after forward and after backward, a stage being the unit). While a
    /// kept autodiff graph holds them they stay. Not while evaluating.
    pub(crate) fn release_unpinned(&mut self, stage: StageId) -> Result<()> {
        let gathered = self.stages.get(&stage).and_then(|s| s.shard.as_ref()).is_some_and(|shard| shard.gathered);
        if !gathered || !self.sharded_at_3(stage) || self.progress.evaluating.is_some() {
            return Ok(());
        }
        let pinned = self.passes.saved.iter().any(|((s, _), k)| *s == stage && !k.saved.is_nothing())
            || self.passes.pending_weight_grads.keys().any(|(s, _)| *s == stage);
        if pinned {
            return Ok(());
        }
        crate::interp::sharded::release_weights(self.state(stage)?)
    }

    /// ZeRO-3: gathers the stage's whole weights from the replicas' shards for a pass,
    /// unless they are still here (`release_unpinned` and the update drop them; nothing
    /// when the stage is not at stage 3) — those its products do not gather themselves
    /// (`zero::per_product`: the model holds stand-ins for them).
    pub(crate) fn gather_weights(&mut self, stage: StageId) -> Result<()> {
        let Some(shard) = self.stages.get(&stage).and_then(|s| s.shard.as_ref()) else { return Ok(()) };
        if shard.gathered {
            return Ok(());
        }
        let tickets = match self.zero3.prefetched.remove(&stage) {
            Some(tickets) => {
                self.zero3.prefetched_gathers += 1;
                tickets
            }
            None => self.start_gather(stage)?,
        };
        let gathered = tickets.into_iter().map(Ticket::wait).collect::<std::result::Result<Vec<_>, _>>()?;
        self.zero3.weight_gathers += 1;
        let st = self.state(stage)?;
        let shard = st.shard.as_ref().ok_or(ExecError::Missing("the stage's shard"))?;
        let whole = shard.layout.whole_of(&gathered, |k| !shard.per_product[k])?;
        drop(gathered);
        crate::interp::sharded::restore_weights(st, whole)
    }

    /// ZeRO-3 per product: the weights `model`'s products gather themselves
    /// (`zero::per_product`), by the autodiff node of their stand-ins in `model` (a pass's
    /// copy of the stage's), with the gatherer of the stage's current weights (built when
    /// the weights changed since the last). Empty for any other stage.
    pub(crate) fn gathered_weights(
        &mut self,
        stage: StageId,
        model: &crate::nn::layers::StageModel<B>,
    ) -> Result<crate::backend::dense::GatheredWeights<B::InnerBackend>> {
        let Some(shard) = self.stages.get(&stage).and_then(|s| s.shard.as_ref()) else { return Ok(HashMap::new()) };
        if !shard.per_product.contains(&true) {
            return Ok(HashMap::new());
        }
        let gatherer = match &shard.gatherer {
            Some(g) => g.clone(),
            None => {
                let members = crate::parallel::groups::members(self.plan, shard.group)?;
                let g =
                    crate::parallel::zero::Gatherer::new(shard, self.comm.exchanger(), members, self.transfers.reduce)?;
                let g = std::sync::Arc::new(g);
                self.state(stage)?.shard.as_mut().ok_or(ExecError::Missing("the stage's shard"))?.gatherer =
                    Some(g.clone());
                g
            }
        };
        let shard = self.stages.get(&stage).and_then(|s| s.shard.as_ref()).ok_or(ExecError::Missing("its shard"))?;
        let keys = crate::nn::params::sum_keys(model);
        Ok(keys
            .into_iter()
            .zip(&shard.layout.params)
            .zip(&shard.per_product)
            .filter_map(|((key, p), g)| {
                Some((key?, (gatherer.clone() as std::sync::Arc<dyn crate::backend::dense::WholeWeight<_>>, p.id)))
                    .filter(|_| *g)
            })
            .collect())
    }

    /// After a pass of `stage` (its result `done`): the weight its products kept gathered is
    /// dropped and their gathers counted; a gather that failed in it fails the pass.
    pub(crate) fn products_gathered<T>(&mut self, stage: StageId, done: Result<T>) -> Result<T> {
        let Some(g) = self.stages.get(&stage).and_then(|s| s.shard.as_ref()).and_then(|s| s.gatherer.clone()) else {
            return done;
        };
        g.drop_kept();
        self.zero3.product_gathers += g.take_gathers();
        let done = done?;
        match g.take_failure() {
            Some(e) => Err(ExecError::Transport(TransportError::Other(format!("a weight's all-gather failed: {e}")))),
            None => Ok(done),
        }
    }
}

impl<B: ExecBackend> Worker<'_, B> {
    /// ZeRO-3: starts the all-gather of `stage`'s whole weights from the replicas' shards.
    /// (one all-gather per part of the shard's layout: its experts' over their holders)
    fn start_gather(&self, stage: StageId) -> Result<Vec<Ticket<Vec<f32>>>> {
        let shard =
            self.stages.get(&stage).and_then(|s| s.shard.as_ref()).ok_or(ExecError::Missing("the stage's shard"))?;
        let members = crate::parallel::groups::members(self.plan, shard.group)?;
        let parts = shard.gather_inputs(|k| !shard.per_product[k])?;
        self.start_parts(stage, pipec_plan::CollectiveKind::AllGather, members, parts, None, None)
    }

    /// ZeRO-3's prefetch of what a stage gathers whole (FSDP's unit prefetch, with the stage
    /// as the unit; the weights gathered per product are gathered ahead by their
    /// `zero::Gatherer`): while the pass
    /// at position `at` of the step computes, the whole weights of the stage the device's
    /// next pass needs are gathered on its communication thread, when that is another stage
    /// sharded at stage 3 whose weights are not here and nothing between the two passes
    /// touches it (no update, no collective). Every replica of that stage runs the same
    /// program, so each starts the gather at the same point of its communication order.
    /// Not while evaluating.
    pub(crate) fn prefetch_weights(&mut self, at: usize) -> Result<()> {
        // (the look-ahead only where some stage here is sharded at level 3)
        if self.progress.evaluating.is_some() || !self.stages.keys().any(|s| self.sharded_at_3(*s)) {
            return Ok(());
        }
        let Some(current) = self.progress.step_instrs.get(at).map(Instr::stage) else { return Ok(()) };
        let needs_weights = |i: &Instr| {
            matches!(
                i,
                Instr::Forward { .. } | Instr::Recompute { .. } | Instr::Backward { .. } | Instr::BackwardInput { .. }
            )
        };
        let Some(j) = (at + 1..self.progress.step_instrs.len()).find(|&j| needs_weights(&self.progress.step_instrs[j]))
        else {
            return Ok(());
        };
        let next = self.progress.step_instrs[j].stage();
        let gathered = self.stages.get(&next).and_then(|s| s.shard.as_ref()).is_none_or(|shard| shard.gathered);
        if next == current || gathered || !self.sharded_at_3(next) || self.zero3.prefetched.contains_key(&next) {
            return Ok(());
        }
        // the weights must be those the pass finds: nothing in between updates the stage
        let quiet = self.progress.step_instrs[at + 1..j].iter().all(|i| {
            i.stage() != next
                || matches!(
                    i.phase(),
                    pipec_plan::Phase::Communication | pipec_plan::Phase::Memory | pipec_plan::Phase::BackwardWeight
                ) && !matches!(i, Instr::StashWeights { .. } | Instr::RestoreWeights { .. })
        });
        if quiet {
            let tickets = self.start_gather(next)?;
            self.zero3.prefetched.insert(next, tickets);
        }
        Ok(())
    }
}
