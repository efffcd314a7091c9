//! The executor's side of checkpoints (the format is `pipec_plan::checkpoint`): a device's
//! stages saved as shards, and restored from any layout's checkpoint — each parameter and
//! its optimizer state from the saved stage and tensor-parallel ranks that held it, joined
//! and re-split for this stage's rank (`reshard`).

use std::collections::HashMap;

use burn::module::ParamId;
use pipec_plan::checkpoint;
use pipec_plan::{Plan, StageId};

use crate::backend::kernels::ExecBackend;
use crate::error::ExecError;
use crate::interp::stage::{self, StageState};
use crate::interp::worker::Worker;
use crate::{nn::layers, nn::params, parallel::reshard, parallel::tensor_parallel};

/// Restores every stage of this device from a checkpoint, whatever layout wrote it: each
/// parameter (and its optimizer state) from the saved stage and tensor-parallel ranks that
/// held it, joined and re-split for this stage's rank (`reshard`).
pub(crate) fn load_checkpoint<B: ExecBackend>(
    plan: &Plan,
    stages: &mut HashMap<StageId, StageState<B>>,
    loaded: &checkpoint::Loaded,
    dev: &B::Device,
) -> Result<(), ExecError> {
    let saved = reshard::SavedLayout::new(loaded, plan)?;
    for (id, st) in stages.iter_mut() {
        let (tp_rank, tp_size) = st.tp_shard();
        let stage = plan.stages.get(id.0 as usize).ok_or_else(|| ExecError::Plan(format!("the plan has no {id}")))?;
        let all = plan.model_ops();
        let layers = tensor_parallel::StageLayers {
            all: &all,
            range: stage.layers[0]..stage.layers[1],
            loss: plan.model.loss,
            whole_experts: plan.schedule.whole_experts,
        };
        let split = tensor_parallel::shardings(&layers, tp_size as usize)?;
        let to = |pid: u64| split.get(&pid).copied().unwrap_or(tensor_parallel::Sharding::Whole);
        let mut values: HashMap<u64, Vec<f32>> = HashMap::new();
        // expert parallelism: the routed experts this member keeps only; beside ZeRO every
        // replica takes its shard of every expert, from whole weights put back for it
        if st.shard.is_some() {
            crate::interp::sharded::unevict(st)?;
        }
        let elsewhere = |k: usize| st.experts.as_ref().is_some_and(|h| h.updates_alone() && h.elsewhere(k));
        let mut evicted = Vec::new();
        for (k, (pid, shape)) in params::layout::<B, _>(st.model()?).into_iter().enumerate() {
            if elsewhere(k) {
                evicted.push(pid);
                continue;
            }
            if let Some(v) = saved.values(pid, to(pid), tp_size, tp_rank, &shape)? {
                values.insert(pid, v);
            }
        }
        let model = st.model.take().ok_or(ExecError::Missing("the stage's model is in use"))?;
        let (model, mut missing) = params::set_params(model, |pid, _| values.remove(&pid));
        missing.retain(|pid| !loaded.initial.contains_key(pid) && !evicted.contains(pid));
        st.model = Some(model);
        load_running_statistics(st, &saved, tp_size, tp_rank)?;
        load_expert_biases(st, &saved, tp_size, tp_rank)?;
        if let Some(first) = missing.first() {
            return Err(ExecError::Checkpoint(format!(
                "model.safetensors lacks {} parameter(s) of stage {id} (e.g. `{}`)",
                missing.len(),
                checkpoint::param_name(*first)
            )));
        }
        // the optimizer state of this stage's parameters, from the saved stage and ranks
        // that held them
        let mut wants = Vec::new();
        for (pid, shape) in params::layout::<B, _>(st.model()?) {
            if evicted.contains(&pid) {
                continue;
            }
            let from = saved.saved(pid, tp_size, to(pid))?;
            wants.push(stage::Want {
                id: ParamId::from(pid),
                shape,
                saved: from,
                to: to(pid),
                tp: tp_size,
                rank: tp_rank,
            });
        }
        // a checkpoint that says its optimizer keeps state must hold every parameter's
        let complete = loaded.identity.as_ref().is_some_and(|i| i.stateful) && loaded.completed_steps > 0;
        st.optim
            .load(&loaded.optimizers, &wants, complete, dev)
            .map_err(|e| ExecError::Checkpoint(format!("stage {id}: {e}")))?;
        // ZeRO: the checkpoint holds the state whole; this replica keeps its shard of it
        if st.shard.is_some() {
            crate::interp::sharded::shard_loaded(st, plan, dev)?;
            // (the loaded weights gathered per product live on in the shard only)
            crate::interp::sharded::stand_in_per_product(st)?;
            if let Some(h) = &st.experts {
                st.model = st.model.take().map(|m| h.evict(m));
            }
        }
    }
    Ok(())
}

/// The whole values of state `id` (of layer `layer`, `len` of them) that every
/// tensor-parallel rank holds alike, or an error naming `what` a checkpoint lacks.
fn whole_state(
    saved: &reshard::SavedLayout<'_>,
    (tp_size, tp_rank): (u32, u32),
    (id, layer, len): (u64, usize, usize),
    what: &str,
) -> Result<Vec<f32>, ExecError> {
    saved.values(id, tensor_parallel::Sharding::Whole, tp_size, tp_rank, &[len])?.ok_or_else(|| {
        ExecError::Checkpoint(format!(
            "model.safetensors lacks the {what} of layer {layer} (`{}`)",
            checkpoint::param_name(id)
        ))
    })
}

/// Mixtures of experts' fixed expert biases from a checkpoint (keyed like parameters; a
/// Hugging Face checkpoint's `e_score_correction_bias`), one per expert (the checkpoint's
/// reader refuses values that are not finite).
fn load_expert_biases<B: ExecBackend>(
    st: &mut StageState<B>,
    saved: &reshard::SavedLayout<'_>,
    tp_size: u32,
    tp_rank: u32,
) -> Result<(), ExecError> {
    let model = st.model.as_mut().ok_or(ExecError::Missing("the stage's model is in use"))?;
    for b in stage::biased_mixtures_mut(model) {
        let id = layers::state_id(b.index, pipec_plan::model::EXPERT_BIAS_SLOT);
        b.expert_bias = whole_state(saved, (tp_size, tp_rank), (id, b.index, b.expert_bias.len()), "expert bias")?;
    }
    Ok(())
}

/// Batch normalisation's running statistics from a checkpoint (keyed like parameters).
fn load_running_statistics<B: ExecBackend>(
    st: &mut StageState<B>,
    saved: &reshard::SavedLayout<'_>,
    tp_size: u32,
    tp_rank: u32,
) -> Result<(), ExecError> {
    let mut values = Vec::new();
    for bn in st.model()?.batch_norms() {
        let c = bn.running_mean.len();
        for slot in [layers::RUNNING_MEAN_SLOT, layers::RUNNING_VAR_SLOT] {
            let id = layers::state_id(bn.index, slot);
            let v = whole_state(saved, (tp_size, tp_rank), (id, bn.index, c), "running statistics")?;
            // a mean is any finite value, a variance a finite one of 0 or more
            let bad = |x: f32| !x.is_finite() || (slot == layers::RUNNING_VAR_SLOT && x < 0.0);
            if let Some(k) = v.iter().position(|x| bad(*x)) {
                let what = if slot == layers::RUNNING_VAR_SLOT { "running variance" } else { "running mean" };
                return Err(ExecError::Checkpoint(format!(
                    "the {what} of layer {} (`{}`) is {} at channel {k}: a variance is finite and at least 0, a mean finite (the checkpoint is damaged)",
                    bn.index,
                    checkpoint::param_name(id),
                    v[k]
                )));
            }
            values.extend_from_slice(&v)
        }
    }
    st.model.as_mut().ok_or(ExecError::Missing("the stage's model is in use"))?.set_running_statistics(&values)
}

/// A device's stages as checkpoint shards. A ZeRO-sharded stage's replica saves its own
/// shard as it holds it — its master chunks and its optimizer state over them — with no
/// collective and no per-parameter work; the reader joins the replicas' chunks
/// (`checkpoint::read`, [`crate::interp::sharded::join_saved`]), so a checkpoint resumes on any layout.
pub(crate) fn save_checkpoint<B: ExecBackend>(w: &mut Worker<'_, B>) -> Result<checkpoint::Shards, ExecError> {
    let mut out = HashMap::new();
    let mut ids: Vec<StageId> = w.stages.keys().copied().collect();
    ids.sort();
    for id in ids {
        let group = w.groups.experts.get(&id).cloned();
        let st = w.stages.get_mut(&id).ok_or(ExecError::Missing("the stage"))?;
        let (tp_rank, tp_size) = st.tp_shard();
        if st.shard.is_some() {
            let (key, saved) = crate::interp::sharded::saved_shard(st, id, tp_rank, tp_size)?;
            out.insert(key, saved);
            continue;
        }
        // replicas hold the same state: only the one whose copy is written copies it (an
        // expert group's members all take part in joining their experts)
        if st.experts.is_none() && !copies_for_its_replicas(w.plan, id, w.device, tp_rank) {
            continue;
        }
        let optimizer = match &st.experts {
            Some(h) if h.updates_alone() => Ok(Vec::new()),
            _ => st.optim.save(),
        };
        let mut optimizer = optimizer.map_err(|e| ExecError::Checkpoint(format!("stage {id}: {e}")))?;
        let mut params: Vec<crate::parallel::experts::SavedParam> = params::snapshot::<B, _>(st.model()?)?
            .into_iter()
            .map(|(pid, shape, v)| (ParamId::val(&pid), shape, v))
            .collect();
        // expert parallelism: each routed expert's weights and state from its holders, the
        // stage's optimizer state recorded whole by an optimizer of the whole stage's
        if let (Some(holding), Some(group)) = (&st.experts, &group) {
            let items = st.optim.items().map_err(ExecError::Checkpoint)?;
            let items = crate::parallel::experts::join_experts(group, holding, &mut params, items)?;
            let whole: Vec<(u64, Vec<usize>)> = params.iter().map(|(id, shape, _)| (*id, shape.clone())).collect();
            let mut optim = stage::StageOptim::<B>::new(&w.plan.training.optimizer, &whole, Default::default());
            optim.load_items(items, &w.dev).map_err(|e| ExecError::Checkpoint(format!("stage {id}: {e}")))?;
            optimizer = optim.save().map_err(|e| ExecError::Checkpoint(format!("stage {id}: {e}")))?;
        }
        params.extend(stage::kept_state(st)?);
        out.insert(
            checkpoint::ShardKey::whole(id.0, tp_rank),
            checkpoint::StageCheckpoint { params, optimizer, tp_size, zero: None },
        );
    }
    Ok(out)
}

/// Whether `device` is the replica of stage `id` (at tensor-parallel position `tp_rank`)
/// whose copy a checkpoint keeps: the lowest device among those holding the same state
/// (the run's coordinator keeps the first replica's, `run::first_replicas_shards`; under
/// asynchronous data parallelism it is the parameter server).
fn copies_for_its_replicas(plan: &pipec_plan::Plan, id: StageId, device: pipec_plan::DeviceId, tp_rank: u32) -> bool {
    let Some(stage) = plan.stages.get(id.0 as usize) else { return true };
    let holders: Vec<pipec_plan::DeviceId> = if stage.tensor_parallel.is_empty() {
        stage.replicas.clone()
    } else {
        stage.tensor_parallel.iter().filter_map(|g| g.get(tp_rank as usize).copied()).collect()
    };
    holders.iter().min().is_none_or(|first| *first == device)
}
