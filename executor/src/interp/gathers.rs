//! ZeRO as the worker runs it: a replica's shard update, the stage gathers the plan
//! declares and their prefetch, and the per-product gathers a pass installs for its
//! products.

use std::collections::HashMap;

use pipec_plan::StageId;

use crate::backend::kernels::ExecBackend;
use crate::comm::exchanger::Ticket;
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

    /// ZeRO-3, before the pass at position `at` of the step, a pass of `stage`: the
    /// gathers of whole weights the plan declares there (`pipec_plan::in_pass::stage_gathers`)
    /// start — the stage's own, which the pass waits for, and that of the stage the
    /// device's next pass needs, which runs on the communication thread while this pass
    /// computes (FSDP's prefetch) — and the pass finds its stage's whole weights (those its
    /// products do not gather themselves, `zero::per_product`) here, gathered now or ahead.
    /// A declaration that leaves them missing, or gathers them while they are here, fails
    /// the pass: the plan is the program. A validation, for which the plan declares
    /// nothing, gathers what is missing.
    pub(crate) fn gather_weights(&mut self, stage: StageId, at: usize) -> Result<()> {
        let declared = self.zero3.declared.get(&at).cloned().unwrap_or_default();
        let mut own = None;
        for t in declared {
            let tickets = self.start_gather(t)?;
            if t == stage {
                if own.replace(tickets).is_some() {
                    return Err(ExecError::Plan(format!("ZeRO-3: the plan gathers {t}'s whole weights twice here")));
                }
            } else if self.zero3.prefetched.insert(t, tickets).is_some() {
                return Err(ExecError::Plan(format!("ZeRO-3: the plan gathers {t}'s whole weights ahead twice")));
            }
        }
        let gathered = self.stages.get(&stage).and_then(|s| s.shard.as_ref()).map(|shard| shard.gathered);
        let ahead = self.zero3.prefetched.remove(&stage);
        let tickets = match (gathered, own, ahead) {
            (None | Some(true), None, None) => return Ok(()),
            (Some(false), Some(t), None) => t,
            (Some(false), None, Some(t)) => {
                self.zero3.prefetched_gathers += 1;
                t
            }
            (Some(false), None, None) if self.progress.evaluating.is_some() => self.start_gather(stage)?,
            (gathered, own, ahead) => {
                let here = match gathered {
                    Some(true) => "here",
                    Some(false) => "not here",
                    None => "not sharded at ZeRO stage 3",
                };
                let declares = match (own.is_some(), ahead.is_some()) {
                    (true, true) => "a gather of them and one ahead",
                    (true, false) => "a gather of them",
                    (false, true) => "a gather of them ahead",
                    (false, false) => "no gather of them",
                };
                return Err(ExecError::Plan(format!(
                    "ZeRO-3: {stage}'s whole weights are {here} at this pass, where the plan declares {declares}"
                )));
            }
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
            Some(e) => Err(e.recorded_in("a weight's all-gather failed")),
            None => Ok(done),
        }
    }
}

impl<B: ExecBackend> Worker<'_, B> {
    /// ZeRO-3: starts the all-gather of `stage`'s whole weights from the replicas' shards.
    /// (one all-gather per part of the shard's layout: its experts' over their holders)
    /// Recorded in the ledger as one `zero` all-gather, as the plan declares it.
    fn start_gather(&self, stage: StageId) -> Result<Vec<Ticket<Vec<f32>>>> {
        let shard = self.stages.get(&stage).and_then(|s| s.shard.as_ref()).ok_or_else(|| {
            ExecError::Plan(format!("ZeRO-3: the plan gathers {stage}'s whole weights, which are not sharded here"))
        })?;
        let members = crate::parallel::groups::members(self.plan, shard.group)?;
        self.comm.ledger().record(pipec_plan::PassOp::AllGather, pipec_plan::PeerDim::Shard, &members);
        let parts = shard.gather_inputs(|k| !shard.per_product[k])?;
        self.start_parts(stage, pipec_plan::CollectiveKind::AllGather, members, parts, None, None)
    }
}
