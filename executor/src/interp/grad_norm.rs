//! Gradient norms for clipping: a stage's squared norm (tied weights counted once, experts
//! where they are kept) and the factor that clips one update.

use std::collections::HashSet;

use pipec_plan::{DeviceId, Plan, StageId};

use crate::backend::kernels::ExecBackend;
use crate::error::{ExecError, Result};
use crate::interp::stage::StageState;
use crate::nn::params::{host_f32, layout};
use crate::parallel::experts::Kept;

/// Whether `device` counts the gradient of `stage` whole: it runs the stage's first replica
/// (as its leader, or as a tensor-parallel member of it).
pub(crate) fn first_replica(plan: &Plan, stage: StageId, device: DeviceId) -> bool {
    plan.stages.get(stage.0 as usize).is_some_and(|s| {
        s.replicas.first() == Some(&device) || s.tensor_parallel.first().is_some_and(|g| g.contains(&device))
    })
}

/// The squared norm of the gradient `st` holds for the update, as this device counts it
/// (see the module's documentation; `every_replica`: each replica counts its stage whole,
/// for an asynchronous schedule's per-stage norm).
pub(crate) fn squared_norm<B: ExecBackend>(
    st: &StageState<B>,
    plan: &Plan,
    stage: StageId,
    device: DeviceId,
    every_replica: bool,
) -> Result<f64> {
    let first = every_replica || st.shard.is_some() || first_replica(plan, stage, device);
    // expert parallelism: the first holder of each routed expert counts it
    let alone = st.experts.as_ref().filter(|h| h.updates_alone());
    let counts_experts = every_replica || alone.is_some_and(|h| h.counts_experts(device));
    if !first && !counts_experts {
        return Ok(0.0);
    }
    let s = plan.stages.get(stage.0 as usize).ok_or_else(|| ExecError::Plan(format!("the plan has no {stage}")))?;
    let range = s.layers[0]..s.layers[1];
    // a projection tied to an embedding holds the embedding's gradient again
    let tied: HashSet<u64> = plan.layers[range.clone()]
        .iter()
        .filter(|l| l.tied.is_some())
        .map(|l| crate::nn::layers::pid(l.index, 0))
        .collect();
    let (rank, tp) = st.tp_shard();
    let split = if tp > 1 {
        let all = plan.model_ops();
        let layers = crate::parallel::tensor_parallel::StageLayers {
            all: &all,
            range,
            loss: plan.model.loss,
            whole_experts: plan.schedule.whole_experts,
        };
        crate::parallel::tensor_parallel::shardings(&layers, tp as usize)?
    } else {
        Default::default()
    };
    let n_mb = plan.training.microbatches as f64;
    type Grad<'a, T> = Option<&'a burn::tensor::Tensor<T, 1>>;
    let (ids, grads, contributions): (Vec<u64>, Vec<Grad<'_, B::InnerBackend>>, usize) = match &st.shard {
        Some(shard) => (
            shard.layout.params.iter().map(|p| p.id).collect(),
            shard.grad.as_ref().map_or_else(Vec::new, |g| g.iter().map(Some).collect()),
            shard.contributions,
        ),
        None => (
            layout::<B, _>(st.model()?).into_iter().map(|(id, _)| id).collect(),
            st.acc.iter().map(Option::as_ref).collect(),
            st.contributions,
        ),
    };
    let experts: std::collections::HashMap<u64, Kept> =
        alone.map(|h| ids.iter().copied().zip(h.kept.iter().copied()).collect()).unwrap_or_default();
    // a routed expert whole on one rank (`etp: 1`) is counted on that rank, as a split
    // parameter's part is on each (beside ZeRO this rank's chunks hold its experts only)
    let whole_expert =
        |id: u64| plan.schedule.whole_experts && crate::parallel::experts::routed_expert(plan, id).is_some();
    let counts = |id: u64| {
        let counted = match experts.get(&id) {
            None | Some(Kept::Everywhere) => first,
            Some(Kept::Here) => counts_experts,
            Some(Kept::Elsewhere) => false,
        };
        counted
            && !tied.contains(&id)
            && (rank == 0
                || whole_expert(id)
                || split.get(&id).is_some_and(|s| *s != crate::parallel::tensor_parallel::Sharding::Whole))
    };
    // the accumulated sums are of per-microbatch means scaled by 1/N: an update made from
    // fewer microbatches scales up to their mean (as the update itself does)
    let scale = if contributions > 0 { n_mb / contributions as f64 } else { 1.0 };
    sum_squares(&ids, &grads, counts, scale)
}

/// Σ (scale·g)² over the gradients `grads` of the parameters `ids` that `counts`: summed on
/// the device, one value read back (on an H100 the GPT-2 block benchmark's fp16 step, whose
/// loss scaling takes the norm every step, took 190.0 ms copying every gradient to the host
/// for it and 155.7 ms summing on the device; each tensor's squares and the tensors' sums
/// are in f32).
pub(crate) fn sum_squares<T: burn::tensor::backend::Backend>(
    ids: &[u64],
    grads: &[Option<&burn::tensor::Tensor<T, 1>>],
    counts: impl Fn(u64) -> bool,
    scale: f64,
) -> Result<f64> {
    let mut total: Option<burn::tensor::Tensor<T, 1>> = None;
    for (id, g) in ids.iter().zip(grads) {
        let Some(g) = g else { continue };
        if counts(*id) {
            let squares = (*g).clone().powi_scalar(2).sum();
            total = Some(match total {
                Some(t) => t + squares,
                None => squares,
            });
        }
    }
    let sum = match total {
        Some(t) => host_f32(t.into_data())?.first().copied().map_or(0.0, f64::from),
        None => 0.0,
    };
    Ok(sum * scale * scale)
}

/// The clipping factor of one update of a whole stage from `flat` (a parameter server's
/// update from one worker's gradient, scaled by `scale`); 1 without clipping.
pub(crate) fn factor_of<B: ExecBackend>(
    plan: &Plan,
    st: &StageState<B>,
    stage: StageId,
    flat: &[Option<burn::tensor::Tensor<B::InnerBackend, 1>>],
    scale: f64,
) -> Result<f64> {
    let Some(max) = plan.training.recipe.clip_grad_norm else { return Ok(1.0) };
    let s = plan.stages.get(stage.0 as usize).ok_or_else(|| ExecError::Plan(format!("the plan has no {stage}")))?;
    let tied: HashSet<u64> = plan.layers[s.layers[0]..s.layers[1]]
        .iter()
        .filter(|l| l.tied.is_some())
        .map(|l| crate::nn::layers::pid(l.index, 0))
        .collect();
    let ids: Vec<u64> = layout::<B, _>(st.model()?).into_iter().map(|(id, _)| id).collect();
    let grads: Vec<Option<&_>> = flat.iter().map(Option::as_ref).collect();
    let sum = sum_squares(&ids, &grads, |id| !tied.contains(&id), scale)?;
    Ok(pipec_plan::recipe::clip_factor(max, sum.sqrt()))
}
