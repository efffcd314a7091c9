//! Gradient clipping by the norm of the whole model's gradient (`training.clip_grad_norm`,
//! as PyTorch's `clip_grad_norm_`): each device's share of the squared norm, the sum over
//! every device (the plan's `grad_norm` all-reduce under a schedule that updates every stage
//! once per step), and the factor each update scales its gradients by. Under an
//! asynchronous schedule each update clips by its own stage's gradient norm.
//!
//! Each gradient value is counted once over the whole plan: a stage's replicas hold the
//! same reduced gradient, so its first replica counts it (a ZeRO-sharded stage's replicas
//! each count their own chunks, which tile it; an expert-parallel stage's routed experts
//! are counted by the first of the replicas holding each); a tensor-parallel stage's ranks each count
//! the parameters they split, and rank 0 alone those every rank holds whole; a weight tied
//! across layers is counted at its embedding, not again at the projection.

use pipec_plan::StageId;

use crate::backend::kernels::ExecBackend;
use crate::error::{ExecError, Result};
use crate::interp::grad_norm::squared_norm;
use crate::interp::worker::Worker;

impl<B: ExecBackend> Worker<'_, B> {
    /// Settles a stage's accumulated gradients once before they are read whole: sums the
    /// tensor-parallel partial gradients over the group and the two copies of a weight tied
    /// within the stage.
    pub(crate) fn settle(&mut self, stage: StageId) -> Result<()> {
        if self.state(stage)?.settled {
            return Ok(());
        }
        self.sum_partial_gradients(stage)?;
        self.sum_local_ties(stage)?;
        self.state(stage)?.settled = true;
        Ok(())
    }

    /// This device's share of the squared global norm, over the stages it holds (settled
    /// first).
    pub(crate) fn norm_share(&mut self) -> Result<f64> {
        let mut held: Vec<StageId> = self.stages.keys().copied().collect();
        held.sort();
        let (plan, device) = (self.plan, self.device);
        let mut sum = 0.0;
        for s in held {
            self.settle(s)?;
            sum += squared_norm(self.state(s)?, plan, s, device, false)?;
        }
        Ok(sum)
    }

    /// The whole model's gradient norm this step (as the gradients are: scaled under fp16's
    /// loss scaling): summed over the devices by the plan's `grad_norm`; alone, this
    /// device's stages are the whole model.
    pub(crate) fn global_norm(&mut self) -> Result<f64> {
        if self.progress.grad_norm.is_none() && !self.progress.global_clip {
            self.progress.grad_norm = Some(self.norm_share()?.sqrt());
        }
        self.progress.grad_norm.ok_or(ExecError::Missing("the gradient norm was not summed before the update"))
    }

    /// fp16's dynamic loss scaling: the factor that unscales this step's gradients, or None
    /// when one of them (anywhere in the model) is not finite and the step's updates are
    /// skipped; 1 when the loss is not scaled.
    pub(crate) fn unscale(&mut self) -> Result<Option<f64>> {
        let Some(ls) = self.progress.loss_scale else { return Ok(Some(1.0)) };
        Ok(self.global_norm()?.is_finite().then(|| 1.0 / ls.scale))
    }

    /// The factor an update of `stage` scales its gradients by: 1 without clipping; the
    /// step's global factor under a schedule that sums the norm (`grad_norm`); otherwise the
    /// stage's own norm's (summed over its tensor-parallel group).
    pub(crate) fn clip_factor(&mut self, stage: StageId) -> Result<f64> {
        let Some(max) = self.plan.training.recipe.clip_grad_norm else { return Ok(1.0) };
        let plan = self.plan;
        if plan.training.recipe.clips_globally(plan.schedule.updates_every_step()) {
            // summed over the devices by the plan's `grad_norm`; alone, this device's stages
            // are the whole model
            let norm = self.global_norm()? / self.progress.loss_scale.map_or(1.0, |s| s.scale);
            return Ok(pipec_plan::recipe::clip_factor(max, norm));
        }
        let (plan, device) = (self.plan, self.device);
        let mut sum = squared_norm(self.state(stage)?, plan, stage, device, true)?;
        if let Some(tp) = self.state(stage)?.tp.clone() {
            let reduce = self.transfers.reduce;
            sum = f64::from(self.comm.in_pass_all_reduce(&tp.members, vec![sum as f32], reduce)?[0]);
        }
        Ok(pipec_plan::recipe::clip_factor(max, sum.sqrt()))
    }
}
