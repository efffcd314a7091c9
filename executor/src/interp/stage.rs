//! A stage's trainable state on a device: its weights (a tensor-parallel shard, when the
//! stage is split), the running gradient sums, batch normalisation's statistics, stashed
//! weight versions, and its optimizer (with the checkpoint records it saves and loads).

use std::collections::HashMap;

use burn::module::Module;
use burn::prelude::*;
use pipec_plan::model::{crossing, Source};
use pipec_plan::{DeviceId, MicrobatchId, Plan};

use crate::backend::kernels::ExecBackend;
use crate::error::{ExecError, Result};
use crate::nn::block::Block;
use crate::nn::layers::{Layer, StageGraph, StageModel};
use crate::nn::params::{host_f32, layout, FlatGrads};
pub(crate) use crate::parallel::optim::{StageOptim, Want};

/// A stage's trainable state on a device.
pub(crate) struct StageState<B: ExecBackend> {
    pub model: Option<StageModel<B>>,
    /// Tensor parallelism: this device's rank, the group, and the parameters whose
    /// gradients are partial per rank.
    pub tp: Option<TpInfo>,
    pub optim: StageOptim<B>,
    /// Accumulated gradients, one flattened tensor per parameter in visiting order.
    pub(crate) acc: FlatGrads<B>,
    /// Microbatches that contributed to `acc` since the last step.
    pub(crate) contributions: usize,
    /// Batch normalisation: each microbatch forward's batch statistics (laid out as
    /// `StageModel::running_statistics`) until its gradient joins `acc`.
    pub(crate) forward_stats: HashMap<MicrobatchId, Tensor<B::InnerBackend, 1>>,
    /// The statistics of the microbatches whose gradients are in `acc`, summed, and how
    /// many microbatches they cover. They travel with the gradients (all-reduce, parameter
    /// server), so an update folds in the statistics of exactly the microbatches whose
    /// gradients it applies.
    pub(crate) stats: Option<Tensor<B::InnerBackend, 1>>,
    pub(crate) stats_count: f32,
    pub(crate) stash: HashMap<MicrobatchId, StageModel<B>>,
    /// This step's weight versions (index k: after k updates), for vertical sync.
    pub(crate) versions: Vec<StageModel<B>>,
    /// ZeRO: this replica's shard of the stage (None: the stage is not sharded).
    pub(crate) shard: Option<crate::parallel::zero::ShardState<B>>,
    /// Expert parallelism: which routed experts this member keeps (None: every parameter
    /// is kept whole on every replica).
    pub(crate) experts: Option<crate::parallel::experts::Holding>,
    /// The accumulated gradients' tensor-parallel partial sums and local ties are settled
    /// (`Worker::settle`), until they are cleared.
    pub(crate) settled: bool,
}

/// The weight of microbatch `mb`'s statistics under `running_stats: per_forward`, with `n`
/// microbatches per step: PyTorch folds microbatch k of the step (k = mb mod n) at its
/// forward, r ← (1 − m)·r + m·s_k, so after the step
/// r = (1 − m)ⁿ·r₀ + Σ_k m·(1 − m)^(n−1−k)·s_k: a weighted sum that travels with the
/// gradients (summed over replicas) like the plain one.
pub(crate) fn per_forward_weight(mb: MicrobatchId, n: usize) -> f32 {
    let n = n.max(1);
    let k = mb.0 as usize % n;
    let m = crate::nn::layers::BN_MOMENTUM;
    m * (1.0 - m).powi((n - 1 - k) as i32)
}

/// A device's place in a tensor-parallel group.
#[derive(Debug, Clone)]
pub(crate) struct TpInfo {
    pub rank: usize,
    pub members: Vec<DeviceId>,
    pub partial_ids: Vec<u64>,
}

impl<B: ExecBackend> StageState<B> {
    /// This device's (rank, group size) in the stage's tensor-parallel group; (0, 1) without.
    pub fn tp_shard(&self) -> (u32, u32) {
        self.tp.as_ref().map_or((0, 1), |t| (t.rank as u32, t.members.len() as u32))
    }

    /// The stage's current weights.
    pub fn model(&self) -> Result<&StageModel<B>> {
        self.model.as_ref().ok_or(ExecError::Missing("the stage's model is in use"))
    }

    /// Each parameter's number of values, in visiting order (how the stage's gradients lie
    /// in a flat vector: `params::flatten_grads`, `unflatten`).
    pub(crate) fn parameter_sizes(&self) -> Result<Vec<usize>> {
        Ok(layout::<B, _>(self.model()?).iter().map(|(_, s)| s.iter().product()).collect())
    }

    pub(crate) fn clear_gradients(&mut self) {
        self.acc.iter_mut().for_each(|g| *g = None);
        self.contributions = 0;
        self.stats = None;
        self.stats_count = 0.0;
        self.settled = false;
    }

    /// Keeps one microbatch forward's batch statistics (none on a stage without batch
    /// normalisation) until its gradient is added.
    pub(crate) fn record_statistics(&mut self, mb: MicrobatchId, stats: Vec<Tensor<B, 1>>) {
        if !stats.is_empty() {
            self.forward_stats.insert(mb, Tensor::cat(stats, 0).inner());
        }
    }

    /// Adds microbatch `mb`'s statistics, times `weight`, to those of the gradients in `acc`.
    pub(crate) fn add_statistics(&mut self, mb: MicrobatchId, weight: f32) {
        if let Some(t) = self.forward_stats.remove(&mb) {
            let t = if weight == 1.0 { t } else { t * weight };
            self.stats = Some(match self.stats.take() {
                Some(s) => s + t,
                None => t,
            });
            self.stats_count += 1.0;
        }
    }

    /// The recorded statistics' sums and then their count, as they travel with the
    /// gradients; empty on a stage without batch normalisation.
    pub(crate) fn statistics_message(&self) -> Result<Vec<f32>> {
        let n = self.model()?.statistics_len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut v = match &self.stats {
            Some(t) => host_f32(t.clone().into_data())?,
            None => vec![0.0; n],
        };
        v.push(self.stats_count);
        Ok(v)
    }

    /// How many values `statistics_message` takes.
    pub(crate) fn statistics_message_len(&self) -> Result<usize> {
        let n = self.model()?.statistics_len();
        Ok(if n == 0 { 0 } else { n + 1 })
    }

    /// Takes statistics sums and count in `statistics_message`'s layout (summed over a group).
    pub(crate) fn set_statistics(&mut self, message: &[f32], dev: &B::Device) -> Result<()> {
        let Some((count, sums)) = message.split_last() else { return Ok(()) };
        self.stats = Some(Tensor::from_data(TensorData::new(sums.to_vec(), [sums.len()]), dev));
        self.stats_count = *count;
        Ok(())
    }

    /// Folds the recorded statistics into the running statistics. `per_update`: one update
    /// of their moving average with the mean over the microbatches recorded. `per_forward`:
    /// the statistics were added weighted by [`per_forward_weight`], and the running
    /// statistics decay once per microbatch — PyTorch's fold at every forward, in closed form.
    pub(crate) fn fold_statistics(&mut self, rule: pipec_plan::recipe::RunningStats) -> Result<()> {
        let (Some(sums), count) = (self.stats.take(), self.stats_count) else { return Ok(()) };
        if count > 0.0 {
            let model = self.model.as_mut().ok_or(ExecError::Missing("the stage's model is in use"))?;
            let sums = host_f32(sums.into_data())?;
            match rule {
                pipec_plan::recipe::RunningStats::PerUpdate => {
                    let mean: Vec<f32> = sums.into_iter().map(|x| x / count).collect();
                    model.fold_statistics(&mean)?;
                }
                pipec_plan::recipe::RunningStats::PerForward => {
                    let decay = (1.0 - crate::nn::layers::BN_MOMENTUM).powi(count as i32);
                    model.fold_weighted(decay, &sums)?;
                }
            }
        }
        self.stats_count = 0.0;
        Ok(())
    }

    /// One optimizer update from flat gradients, each scaled by `scale`.
    pub(crate) fn update(&mut self, lr: f64, flat: &[Option<Tensor<B::InnerBackend, 1>>], scale: f64) -> Result<()> {
        let model = self.model.take().ok_or(ExecError::Missing("the stage's model is in use"))?;
        self.model = Some(self.optim.update(lr, model, flat, scale));
        Ok(())
    }
}

/// The parameter id of a tied layer's weight (an embedding table, or the projection tied
/// to one).
pub(crate) fn tied_weight(plan: &Plan, layer: usize) -> Result<u64> {
    let table = plan.layers.get(layer).and_then(|l| l.tied).unwrap_or(layer);
    match plan.layers.get(table).map(|l| &l.op) {
        Some(pipec_plan::model::Op::Embedding { .. }) => Ok(crate::nn::layers::pid(layer, 0)),
        _ => Err(ExecError::Plan(format!("layer {layer} is not tied to an embedding"))),
    }
}

/// Where a tied layer's weight sits among the stage's parameters, and the [vocabulary, d]
/// shape of the table rows it holds (a vocabulary-parallel rank holds its part).
fn tied_param<B: ExecBackend>(st: &StageState<B>, plan: &Plan, layer: usize) -> Result<(usize, usize, usize)> {
    let id = tied_weight(plan, layer)?;
    // a sharded stage's layout (under ZeRO-3 the model holds no whole weights between steps)
    let params = match &st.shard {
        Some(shard) => shard.layout.params.iter().map(|p| (p.id, p.shape.clone())).collect(),
        None => layout::<B, _>(st.model()?),
    };
    let k = params
        .iter()
        .position(|(p, _)| *p == id)
        .ok_or_else(|| ExecError::Plan(format!("layer {layer}'s weight is not on this stage")))?;
    let &[rows, cols] = params[k].1.as_slice() else {
        return Err(ExecError::Plan(format!("layer {layer}'s tied weight is not a matrix")));
    };
    // a projection holds the table transposed: [d, vocabulary]
    Ok(if plan.layers[layer].tied.is_some() { (k, cols, rows) } else { (k, rows, cols) })
}

/// The accumulated gradient of a tied weight in the table's [vocab, d] orientation (zeros
/// when none has accumulated).
pub(crate) fn tied_gradient<B: ExecBackend>(st: &StageState<B>, plan: &Plan, layer: usize) -> Result<Vec<f32>> {
    let (k, vocab, dim) = tied_param(st, plan, layer)?;
    let g = match st.acc.get(k) {
        Some(Some(t)) => host_f32(t.clone().into_data())?,
        _ => return Ok(vec![0.0; vocab * dim]),
    };
    Ok(if plan.layers[layer].tied.is_some() { crate::nn::layers::transpose(&g, dim, vocab) } else { g })
}

/// ZeRO: this replica's chunk of a tied weight's reduced gradient in place in the whole
/// weight's values (zeros elsewhere), in the table's [vocab, d] orientation.
pub(crate) fn tied_gradient_shard<B: ExecBackend>(st: &StageState<B>, plan: &Plan, layer: usize) -> Result<Vec<f32>> {
    let (k, vocab, dim) = tied_param(st, plan, layer)?;
    let shard = st.shard.as_ref().ok_or(ExecError::Missing("the stage is not sharded"))?;
    let p = &shard.layout.params[k];
    let mut whole = vec![0.0; p.len];
    if let Some(g) = shard.grad.as_ref().and_then(|g| g.get(k)) {
        let start = shard.layout.rank_of(k) * p.chunk;
        for (x, v) in whole.iter_mut().skip(start).zip(host_f32(g.clone().into_data())?) {
            *x = v;
        }
    }
    Ok(if plan.layers[layer].tied.is_some() { crate::nn::layers::transpose(&whole, dim, vocab) } else { whole })
}

/// ZeRO: replaces this replica's chunk of a tied weight's gradient shard with its chunk of
/// `g` (the whole sum, in the table's orientation).
pub(crate) fn set_tied_gradient_shard<B: ExecBackend>(
    st: &mut StageState<B>,
    plan: &Plan,
    layer: usize,
    g: &[f32],
    dev: &B::Device,
) -> Result<()> {
    let (k, whole) = tied_values(st, plan, layer, g)?;
    let shard = st.shard.as_mut().ok_or(ExecError::Missing("the stage is not sharded"))?;
    let chunk = shard.layout.chunk(k, &whole, shard.layout.rank_of(k));
    let layout = &shard.layout;
    let grad = shard.grad.get_or_insert_with(|| {
        layout
            .params
            .iter()
            .map(|p| Tensor::from_data(TensorData::new(vec![0.0f32; p.chunk], [p.chunk]), dev))
            .collect()
    });
    let n = chunk.len();
    grad[k] = Tensor::from_data(TensorData::new(chunk, [n]), dev);
    Ok(())
}

/// Where a tied layer's weight sits among the stage's parameters, and `g` (a whole tied
/// gradient in the table's orientation) in that weight's orientation.
fn tied_values<B: ExecBackend>(st: &StageState<B>, plan: &Plan, layer: usize, g: &[f32]) -> Result<(usize, Vec<f32>)> {
    let (k, vocab, dim) = tied_param(st, plan, layer)?;
    if g.len() != vocab * dim {
        return Err(ExecError::Plan(format!(
            "layer {layer}'s tied gradient has {} values, not {}",
            g.len(),
            vocab * dim
        )));
    }
    Ok((k, if plan.layers[layer].tied.is_some() { crate::nn::layers::transpose(g, vocab, dim) } else { g.to_vec() }))
}

/// Replaces a tied weight's accumulated gradient with `g` (in the table's orientation).
pub(crate) fn set_tied_gradient<B: ExecBackend>(
    st: &mut StageState<B>,
    plan: &Plan,
    layer: usize,
    g: &[f32],
) -> Result<()> {
    let (k, values) = tied_values(st, plan, layer, g)?;
    if st.acc.len() <= k {
        st.acc.resize(k + 1, None);
    }
    let dev = st.model()?.devices().into_iter().next().ok_or(ExecError::Missing("the stage has no device"))?;
    let n = values.len();
    st.acc[k] = Some(Tensor::from_data(TensorData::new(values, [n]), &dev));
    Ok(())
}

/// Builds the state of the stages a device holds.
/// The wiring of layers `a..b` of a graph model (None for a chain: each layer reads the one
/// before, one tensor crosses each boundary).
pub(crate) fn stage_graph(plan: &Plan, a: usize, b: usize) -> Option<StageGraph> {
    if plan.layers.iter().all(|l| l.inputs.is_none()) {
        return None;
    }
    let operands: Vec<Vec<Source>> = plan.layers.iter().map(|l| l.operands()).collect();
    let slices = || operands.iter().map(Vec::as_slice);
    let n = plan.layers.len();
    Some(StageGraph {
        operands: operands[a..b].to_vec(),
        first: a,
        inputs: if a == 0 { vec![Source::Input] } else { crossing(slices(), a) },
        outputs: if b == n { vec![Source::Layer(n - 1)] } else { crossing(slices(), b) },
    })
}

/// The state a stage keeps beside its parameters, keyed like them: batch normalisation's
/// running statistics and mixtures of experts' fixed expert biases (every tensor-parallel
/// rank holds them whole).
pub(crate) fn kept_state<B: ExecBackend>(
    st: &StageState<B>,
) -> Result<Vec<crate::parallel::experts::SavedParam>, ExecError> {
    let mut out = Vec::new();
    for b in biased_mixtures(st.model()?) {
        out.push((
            crate::nn::layers::state_id(b.index, pipec_plan::model::EXPERT_BIAS_SLOT),
            vec![b.expert_bias.len()],
            b.expert_bias.clone(),
        ));
    }
    for bn in st.model()?.batch_norms() {
        let c = bn.running_mean.len();
        out.push((
            crate::nn::layers::state_id(bn.index, crate::nn::layers::RUNNING_MEAN_SLOT),
            vec![c],
            bn.running_mean.clone(),
        ));
        out.push((
            crate::nn::layers::state_id(bn.index, crate::nn::layers::RUNNING_VAR_SLOT),
            vec![c],
            bn.running_var.clone(),
        ));
    }
    Ok(out)
}

/// The stage's mixtures of experts with a fixed expert bias (`expert_bias=true`), in order.
pub(crate) fn biased_mixtures<B: Backend>(model: &StageModel<B>) -> impl Iterator<Item = &Block<B>> {
    model.layers.iter().filter_map(|l| match l {
        Layer::Block(b) | Layer::ParallelBlock(b) if !b.expert_bias.is_empty() => Some(b),
        _ => None,
    })
}

/// [`biased_mixtures`], to set their biases.
pub(crate) fn biased_mixtures_mut<B: Backend>(model: &mut StageModel<B>) -> impl Iterator<Item = &mut Block<B>> {
    model.layers.iter_mut().filter_map(|l| match l {
        Layer::Block(b) | Layer::ParallelBlock(b) if !b.expert_bias.is_empty() => Some(b),
        _ => None,
    })
}
