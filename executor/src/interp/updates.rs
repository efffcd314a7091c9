//! The updates a worker runs: a parameter server's gradient applied and its weights pulled,
//! tied weights' local sums, and a stage's optimizer step.

use pipec_plan::StageId;

use crate::backend::kernels::ExecBackend;
use crate::error::{ExecError, Result};
use crate::interp::stage::{set_tied_gradient, tied_gradient};
use crate::interp::worker::Worker;
use crate::nn::params::{set_params, unflatten, FlatGrads};

impl<B: ExecBackend> Worker<'_, B> {
    /// `ApplyGradient` (parameter server): one microbatch's gradient for the whole stage;
    /// its loss was scaled by 1/N, so the update uses its mean.
    pub(crate) fn apply_gradient(&mut self, stage: StageId, values: &[f32]) -> Result<()> {
        let plan = self.plan;
        let lr = self.learning_rate();
        let n_mb = self.plan.training.microbatches as f64;
        let dev = self.dev.clone();
        let st = self.state(stage)?;
        let sizes = st.parameter_sizes()?;
        let n_stats = st.statistics_message_len()?;
        let Some(split) = values.len().checked_sub(n_stats) else {
            return Err(ExecError::Plan("the parameter server sent a gradient that does not fit".into()));
        };
        let (values, stats) = values.split_at(split);
        let flat: FlatGrads<B> = unflatten::<B::InnerBackend>(values, &sizes, &dev)
            .map_err(|e| ExecError::Plan(format!("the parameter server sent a gradient that does not fit: {e}")))?
            .into_iter()
            .map(Some)
            .collect();
        let clip = crate::interp::grad_norm::factor_of(plan, st, stage, &flat, n_mb)?;
        st.update(lr, &flat, n_mb * clip)?;
        st.set_statistics(stats, &dev)?;
        st.fold_statistics(plan.training.recipe.running_stats)
    }

    /// `PullWeights`: replaces the stage's weights with the parameter server's, in visiting order.
    pub(crate) fn pull_weights(&mut self, stage: StageId, values: &[f32]) -> Result<()> {
        let st = self.state(stage)?;
        let n_stats = st.model()?.statistics_len();
        let Some(split) = values.len().checked_sub(n_stats) else {
            return Err(ExecError::Plan("the pulled weights do not fit the stage".into()));
        };
        let (values, running) = values.split_at(split);
        let model = st.model.take().ok_or(ExecError::Missing("the stage's model is in use"))?;
        let mut offset = 0;
        let (mut model, missing) = set_params(model, |_, shape| {
            let n: usize = shape.iter().product();
            let v = values.get(offset..offset + n)?.to_vec();
            offset += n;
            Some(v)
        });
        let set = model.set_running_statistics(running);
        st.model = Some(model);
        set?;
        if !missing.is_empty() || offset != values.len() {
            return Err(ExecError::Plan(format!(
                "the pulled weights ({} values) do not fit the stage ({offset} values read, {} parameter(s) short)",
                values.len(),
                missing.len()
            )));
        }
        Ok(())
    }

    /// Ties within one stage: the embedding's and the projection's gradients summed, both
    /// copies taking the sum (before the update, after any all-reduce).
    pub(crate) fn sum_local_ties(&mut self, stage: StageId) -> Result<()> {
        let plan = self.plan;
        let Some(s) = plan.stages.get(stage.0 as usize) else { return Ok(()) };
        let range = s.layers[0]..s.layers[1];
        for l in &plan.layers[range.clone()] {
            let Some(a) = l.tied.filter(|a| range.contains(a)) else { continue };
            let st = self.state(stage)?;
            let mut g = tied_gradient(st, plan, a)?;
            g.iter_mut().zip(tied_gradient(st, plan, l.index)?).for_each(|(x, y)| *x += y);
            set_tied_gradient(st, plan, a, &g)?;
            set_tied_gradient(st, plan, l.index, &g)?;
        }
        Ok(())
    }

    /// `OptimizerStep`: the update from the accumulated gradients. Gradients are sums of
    /// per-microbatch means scaled by 1/N; an update made from fewer microbatches
    /// (PipeDream) rescales to their mean.
    pub(crate) fn optimizer_step(&mut self, stage: StageId) -> Result<()> {
        let lr = self.learning_rate();
        let n_mb = self.plan.training.microbatches as f64;
        self.settle(stage)?;
        // fp16: the factor that unscales the gradients, or None to skip the update
        let unscale = self.unscale()?;
        let clip = if unscale.is_some() { self.clip_factor(stage)? } else { 1.0 };
        let rule = self.plan.training.recipe.running_stats;
        let st = self.state(stage)?;
        let scale = clip * if st.contributions > 0 { n_mb / st.contributions as f64 } else { 1.0 };
        let acc = std::mem::take(&mut st.acc);
        if let Some(unscale) = unscale {
            st.update(lr, &acc, scale * unscale)?;
        }
        st.fold_statistics(rule)?;
        st.clear_gradients();
        // numbered versions are kept from the step's first (`Worker::step`) where a
        // stream stashes them, and nowhere else
        if let Some(m) = st.model.clone().filter(|_| !st.versions.is_empty()) {
            st.versions.push(m);
        }
        Ok(())
    }
}
