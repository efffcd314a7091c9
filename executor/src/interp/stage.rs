//! A stage's trainable state on a device: its weights (a tensor-parallel shard, when the
//! stage is split), the running gradient sums, batch normalisation's statistics, stashed
//! weight versions, and its optimizer (with the checkpoint records it saves and loads).

use std::collections::HashMap;

use burn::module::{AutodiffModule, Module, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    decay::WeightDecayConfig, Adam, AdamConfig, AdamW, AdamWConfig, GradientsParams, Optimizer, Sgd, SgdConfig,
};
use burn::prelude::*;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use pipec_plan::checkpoint::ShardKey;
use pipec_plan::model::{crossing, Source};
use pipec_plan::plan::OptimizerPlan;
use pipec_plan::{DeviceId, MicrobatchId, Plan, StageId};

use crate::backend::dense::ExecBackend;
use crate::error::{ExecError, Result};
use crate::nn::layers::{StageGraph, StageModel};
use crate::nn::params::{copy_weights, host_f32, layout, take_weight_copies, to_optimizer_grads, FlatGrads};

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

/// The optimizer of a stage (of its model, or of a ZeRO replica's shard of it).
pub(crate) enum StageOptim<B: ExecBackend, M: AutodiffModule<B> = StageModel<B>> {
    Sgd(OptimizerAdaptor<Sgd<B::InnerBackend>, M, B>),
    Adam(OptimizerAdaptor<Adam, M, B>),
    /// With a rule when the weight decay skips some parameters (`decay_biases_and_norms:
    /// false`): the adaptor then decays nothing and the rule shrinks the others first.
    AdamW(OptimizerAdaptor<AdamW, M, B>, Option<DecayRule>),
}

/// AdamW's decoupled weight decay on some parameters only: each parameter in `decayed`
/// (the ones with two or more dimensions) shrinks by `1 − lr · weight_decay` before the Adam
/// step — the multiplication Burn's AdamW makes, so a rule that decays everything gives the
/// same values as Burn's own decay.
#[derive(Debug, Clone)]
pub(crate) struct DecayRule {
    weight_decay: f64,
    decayed: std::collections::HashSet<u64>,
}

impl DecayRule {
    fn apply<B: ExecBackend, M: AutodiffModule<B>>(&self, lr: f64, model: M, grads: &GradientsParams) -> M {
        struct Shrink<'a> {
            rule: &'a DecayRule,
            factor: f64,
            grads: &'a GradientsParams,
        }
        impl<B: ExecBackend> burn::module::ModuleMapper<B> for Shrink<'_> {
            fn map_float<const D: usize>(
                &mut self,
                param: burn::module::Param<Tensor<B, D>>,
            ) -> burn::module::Param<Tensor<B, D>> {
                let (id, tensor, _) = param.consume();
                // only a parameter the step updates: one with a gradient
                let updated = self.grads.get::<B::InnerBackend, D>(id).is_some();
                let tensor = if updated && self.rule.decayed.contains(&id.val()) {
                    Tensor::from_inner(tensor.inner().mul_scalar(self.factor)).require_grad()
                } else {
                    tensor
                };
                burn::module::Param::initialized(id, tensor)
            }
        }
        model.map(&mut Shrink { rule: self, factor: 1.0 - lr * self.weight_decay, grads })
    }
}

impl<B: ExecBackend, M: AutodiffModule<B>> StageOptim<B, M> {
    /// The optimizer of the parameters `params` (id and whole shape: a ZeRO shard's too).
    pub fn new(plan: &OptimizerPlan, params: &[(u64, Vec<usize>)]) -> Self {
        match *plan {
            OptimizerPlan::Sgd { momentum, weight_decay, .. } => {
                let mut c = SgdConfig::new();
                if momentum > 0.0 {
                    c = c.with_momentum(Some(MomentumConfig { momentum, dampening: 0.0, nesterov: false }));
                }
                if weight_decay > 0.0 {
                    c = c.with_weight_decay(Some(WeightDecayConfig { penalty: weight_decay as f32 }));
                }
                StageOptim::Sgd(c.init())
            }
            OptimizerPlan::Adam {
                beta1, beta2, eps, weight_decay, decoupled: true, decay_biases_and_norms, ..
            } => {
                // Burn's AdamW decays by lr · weight_decay before the step, as torch's does;
                // its default decay is 1e-4, so it is always set
                let rule = (!decay_biases_and_norms && weight_decay > 0.0).then(|| DecayRule {
                    weight_decay,
                    decayed: params.iter().filter(|(_, shape)| shape.len() >= 2).map(|(id, _)| *id).collect(),
                });
                let c = AdamWConfig::new()
                    .with_beta_1(beta1 as f32)
                    .with_beta_2(beta2 as f32)
                    .with_epsilon(eps as f32)
                    .with_weight_decay(if rule.is_some() { 0.0 } else { weight_decay as f32 });
                StageOptim::AdamW(c.init(), rule)
            }
            OptimizerPlan::Adam { beta1, beta2, eps, weight_decay, decoupled: false, .. } => {
                let mut c =
                    AdamConfig::new().with_beta_1(beta1 as f32).with_beta_2(beta2 as f32).with_epsilon(eps as f32);
                if weight_decay > 0.0 {
                    c = c.with_weight_decay(Some(WeightDecayConfig { penalty: weight_decay as f32 }));
                }
                StageOptim::Adam(c.init())
            }
        }
    }

    pub(crate) fn step(&mut self, lr: f64, model: M, grads: GradientsParams) -> M {
        match self {
            StageOptim::Sgd(o) => o.step(lr, model, grads),
            StageOptim::Adam(o) => o.step(lr, model, grads),
            StageOptim::AdamW(o, None) => o.step(lr, model, grads),
            StageOptim::AdamW(o, Some(rule)) => {
                let model = rule.apply(lr, model, &grads);
                o.step(lr, model, grads)
            }
        }
    }

    /// One update of `model` from flat gradients (in visiting order), each scaled by
    /// `scale`. The weights' transposed copies (`crate::backend::flex_weights`) belong to the version
    /// being replaced: they are dropped first, so that nothing extra holds the weights while
    /// they are updated, and the new version's are made at once, so that its forwards all
    /// run from them and the transposition runs here, where a stage that waits for its
    /// first input after the update has the time (`pipec profile` times it as part of the
    /// update).
    pub(crate) fn update(&mut self, lr: f64, model: M, flat: &[Option<Tensor<B::InnerBackend, 1>>], scale: f64) -> M {
        let copied = take_weight_copies(&model);
        let grads = to_optimizer_grads(&model, flat, scale);
        let model = self.step(lr, model, grads);
        copy_weights(&model, &copied);
        model
    }

    /// The optimizer's state (momentum, Adam moments) in Burn's binary record format.
    pub fn save(&self) -> std::result::Result<Vec<u8>, String> {
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        match self {
            StageOptim::Sgd(o) => recorder.record(o.to_record(), ()),
            StageOptim::Adam(o) => recorder.record(o.to_record(), ()),
            StageOptim::AdamW(o, _) => recorder.record(o.to_record(), ()),
        }
        .map_err(|e| format!("cannot record the optimizer state: {e:?}"))
    }

    /// Replaces the optimizer's state with a record [`StageOptim::save`] wrote (a corrupt one
    /// is an error, not a panic).
    pub fn load_bytes(&mut self, bytes: &[u8], dev: &B::Device) -> std::result::Result<(), String> {
        fn record<R: Record<B2>, B2: Backend>(bytes: &[u8], dev: &B2::Device) -> std::result::Result<R, String> {
            let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
            crate::error::catch_quietly(|| recorder.load(bytes.to_vec(), dev))
                .map_err(|_| "the optimizer state is corrupt".to_string())?
                .map_err(|e| format!("the optimizer state is corrupt: {e:?}"))
        }
        let placeholder = StageOptim::Sgd(SgdConfig::new().init());
        *self = match std::mem::replace(self, placeholder) {
            StageOptim::Sgd(o) => StageOptim::Sgd(o.load_record(record(bytes, dev)?)),
            StageOptim::Adam(o) => StageOptim::Adam(o.load_record(record(bytes, dev)?)),
            StageOptim::AdamW(o, rule) => StageOptim::AdamW(o.load_record(record(bytes, dev)?), rule),
        };
        Ok(())
    }

    /// The optimizer's state, each parameter's as a serialised record item (for ZeRO: the
    /// shards' states are joined, and a whole state cut, item by item).
    pub fn items(&self) -> std::result::Result<Vec<(ParamId, crate::parallel::reshard::Item)>, String> {
        fn items_of<R, V, B2: Backend>(record: R) -> std::result::Result<Vec<(ParamId, crate::parallel::reshard::Item)>, String>
        where
            R: IntoIterator<Item = (ParamId, V)>,
            V: Record<B2>,
            V::Item<FullPrecisionSettings>: serde::Serialize,
        {
            let mut out = record
                .into_iter()
                .map(|(id, v)| {
                    crate::parallel::reshard::Item::serialized(&v.into_item::<FullPrecisionSettings>())
                        .map(|item| (id, item))
                        .map_err(|e| format!("cannot record the optimizer state: {e}"))
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            out.sort_by_key(|(id, _)| id.val());
            Ok(out)
        }
        match self {
            StageOptim::Sgd(o) => items_of::<_, _, B>(o.to_record()),
            StageOptim::Adam(o) => items_of::<_, _, B>(o.to_record()),
            StageOptim::AdamW(o, _) => items_of::<_, _, B>(o.to_record()),
        }
    }

    /// Replaces the optimizer's state with `items` (as `items` gives them).
    pub fn load_items(
        &mut self,
        items: Vec<(ParamId, crate::parallel::reshard::Item)>,
        dev: &B::Device,
    ) -> std::result::Result<(), String> {
        fn record_of<R, V, B2: Backend>(
            items: Vec<(ParamId, crate::parallel::reshard::Item)>,
            dev: &B2::Device,
        ) -> std::result::Result<R, String>
        where
            R: FromIterator<(ParamId, V)>,
            V: Record<B2>,
            V::Item<FullPrecisionSettings>: serde::de::DeserializeOwned,
        {
            items
                .into_iter()
                .map(|(id, item)| {
                    let item: V::Item<FullPrecisionSettings> =
                        item.deserialized().map_err(|e| format!("an optimizer state does not read back: {e}"))?;
                    Ok((id, V::from_item(item, dev)))
                })
                .collect()
        }
        let placeholder = StageOptim::Sgd(SgdConfig::new().init());
        *self = match std::mem::replace(self, placeholder) {
            StageOptim::Sgd(o) => StageOptim::Sgd(o.load_record(record_of(items, dev)?)),
            StageOptim::Adam(o) => StageOptim::Adam(o.load_record(record_of(items, dev)?)),
            StageOptim::AdamW(o, rule) => StageOptim::AdamW(o.load_record(record_of(items, dev)?), rule),
        };
        Ok(())
    }

    /// Restores this stage's optimizer state from the records `save` wrote — of any stages
    /// and tensor-parallel ranks. The state is kept per parameter (Burn's record maps each
    /// parameter id to its momentum or moments, and pipec's parameter ids name the layer and
    /// slot), so each wanted parameter's entry is taken from the saved stage that held it;
    /// saved under another tensor-parallel split, the entries of every saved rank are
    /// joined and re-split like the weights (`reshard::map_tensors`). Burn panics on some
    /// malformed records; that is caught and reported as a corrupt state.
    ///
    /// With `complete` (the checkpoint says its optimizer keeps state: momentum or Adam's
    /// moments), every wanted parameter must have its entry: a missing file or entry is an
    /// error, never a silent reset of that parameter's state (which a checkpoint whose
    /// optimizer files were exchanged between stages, or whose `state.json` lost a stage,
    /// used to give, with losses 1e-3 off).
    pub fn load(
        &mut self,
        files: &HashMap<ShardKey, Vec<u8>>,
        wants: &[Want],
        complete: bool,
        dev: &B::Device,
    ) -> std::result::Result<(), String> {
        // R: Burn's optimizer record, a map from parameter id to that parameter's state V
        fn merged<R, V, B2: Backend>(
            files: &HashMap<ShardKey, Vec<u8>>,
            wants: &[Want],
            complete: bool,
            dev: &B2::Device,
        ) -> std::result::Result<R, String>
        where
            R: Record<B2> + IntoIterator<Item = (ParamId, V)> + FromIterator<(ParamId, V)>,
            V: Record<B2>,
            V::Item<FullPrecisionSettings>: serde::Serialize + serde::de::DeserializeOwned,
        {
            let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
            let mut decoded: HashMap<ShardKey, HashMap<ParamId, V>> = HashMap::new();
            let mut out = Vec::new();
            for want in wants {
                let mut parts: Vec<V> = Vec::with_capacity(want.saved.files.len());
                for candidates in &want.saved.files {
                    let mut found = None;
                    for key in candidates {
                        if !decoded.contains_key(key) {
                            let Some(bytes) = files.get(key) else { continue };
                            let shown = format!("the optimizer state of stage {} (rank {})", key.stage, key.tp_rank);
                            let rec: R = crate::error::catch_quietly(|| recorder.load(bytes.clone(), dev))
                                .map_err(|_| format!("{shown} is corrupt"))?
                                .map_err(|e| format!("{shown} is corrupt: {e:?}"))?;
                            decoded.insert(*key, rec.into_iter().collect());
                        }
                        if let Some(v) = decoded.get_mut(key).and_then(|m| m.remove(&want.id)) {
                            found = Some(v);
                            break;
                        }
                    }
                    match found {
                        Some(v) => parts.push(v),
                        None if complete => {
                            let name = pipec_plan::checkpoint::param_name(want.id.val());
                            let held = candidates.iter().filter(|k| files.contains_key(k)).count();
                            let place = match candidates.as_slice() {
                                [k] if held == 0 => {
                                    format!(
                                        "state.json lists no optimizer state of stage {} (rank {})",
                                        k.stage, k.tp_rank
                                    )
                                }
                                [k] => format!(
                                    "the optimizer state of stage {} (rank {}) has no entry for it",
                                    k.stage, k.tp_rank
                                ),
                                _ => "no saved optimizer file has an entry for it".to_string(),
                            };
                            return Err(format!(
                                "no optimizer state for `{name}`: {place} (the checkpoint is incomplete, or its optimizer files were exchanged)"
                            ));
                        }
                        None => break, // no state saved (plain SGD keeps none)
                    }
                }
                if parts.len() != want.saved.files.len() {
                    continue;
                }
                let direct = parts.len() == want.tp as usize && want.saved.from == want.to;
                let state = if direct {
                    parts.swap_remove(want.rank as usize)
                } else {
                    let items = parts
                        .into_iter()
                        .map(|v| crate::parallel::reshard::Item::serialized(&v.into_item::<FullPrecisionSettings>()))
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .map_err(|e| format!("the optimizer state cannot be resharded: {e}"))?;
                    let (from, to, tp, rank) = (want.saved.from, want.to, want.tp as usize, want.rank as usize);
                    let joined = crate::parallel::reshard::map_tensors(&items, &want.shape, &|parts| {
                        Ok(crate::parallel::tensor_parallel::shard(&crate::parallel::tensor_parallel::unshard(&parts, from)?, to, tp, rank))
                    })
                    .map_err(|e| e.to_string())?;
                    let item: V::Item<FullPrecisionSettings> = joined
                        .deserialized()
                        .map_err(|e| format!("the resharded optimizer state does not read back: {e}"))?;
                    V::from_item(item, dev)
                };
                out.push((want.id, state));
            }
            Ok(out.into_iter().collect())
        }
        let placeholder = StageOptim::Sgd(SgdConfig::new().init());
        *self = match std::mem::replace(self, placeholder) {
            StageOptim::Sgd(o) => StageOptim::Sgd(o.load_record(merged(files, wants, complete, dev)?)),
            StageOptim::Adam(o) => StageOptim::Adam(o.load_record(merged(files, wants, complete, dev)?)),
            StageOptim::AdamW(o, rule) => StageOptim::AdamW(o.load_record(merged(files, wants, complete, dev)?), rule),
        };
        Ok(())
    }
}

/// A parameter whose optimizer state a resume wants: where it was saved, and how this
/// device's stage splits it.
pub(crate) struct Want {
    pub id: ParamId,
    /// The parameter's shape on this rank.
    pub shape: Vec<usize>,
    pub saved: crate::parallel::reshard::Saved,
    pub to: crate::parallel::tensor_parallel::Sharding,
    pub tp: u32,
    pub rank: u32,
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

/// Whether layer `layer`'s attention core is recomputed in its backward rather than kept:
/// its stage's selective recompute, or flash attention's memory (nothing of size seq² kept;
/// computed unfused).
pub(crate) fn recomputes_attention_core(plan: &Plan, layer: usize) -> bool {
    plan.model.attention == pipec_plan::Attention::Flash
        || plan.stages.iter().any(|s| s.selective_recompute && (s.layers[0]..s.layers[1]).contains(&layer))
}

pub(crate) fn build_stages<B: ExecBackend>(
    plan: &Plan,
    device: DeviceId,
    dev: &B::Device,
) -> Result<HashMap<StageId, StageState<B>>> {
    let mut out = HashMap::new();
    for s in &plan.stages {
        if !s.replicas.contains(&device) && !s.tensor_parallel.iter().any(|g| g.contains(&device)) {
            continue;
        }
        let all = plan.model_ops();
        let layers =
            crate::parallel::tensor_parallel::StageLayers { all: &all, range: s.layers[0]..s.layers[1], loss: plan.model.loss };
        let ops = layers.ops();
        let (model, tp) = match s.tensor_parallel.iter().find(|g| g.contains(&device)) {
            Some(group) if group.len() > 1 => {
                let rank = group.iter().position(|d| *d == device).unwrap_or(0);
                let model =
                    crate::parallel::tensor_parallel::build_stage::<B>(&layers, plan.training.seed, dev, rank, group.len())?;
                let partial_ids = crate::parallel::tensor_parallel::partial_parameter_ids(&layers, group.len())?;
                (model, Some(TpInfo { rank, members: group.clone(), partial_ids }))
            }
            _ => {
                let mut model = StageModel::<B>::new(ops, s.layers[0], plan.training.seed, dev);
                model.graph = stage_graph(plan, s.layers[0], s.layers[1]);
                (model, None)
            }
        };
        // a projection tied to an embedding starts as the transpose of its table
        let mut model = model;
        model.recompute_attention_cores(plan);
        for l in &plan.layers[s.layers[0]..s.layers[1]] {
            let (Some(a), pipec_plan::model::Op::Linear { in_features: dim, out_features: vocab, .. }) =
                (l.tied, &l.op)
            else {
                continue;
            };
            let table = crate::nn::layers::embedding_values(a, plan.training.seed, *vocab, *dim);
            let mut weight = crate::nn::layers::transpose(&table, *vocab, *dim);
            // a vocabulary-parallel rank's columns: the transpose of its rows of the table
            if let Some(t) = &tp {
                let split = crate::parallel::tensor_parallel::shardings(&layers, t.members.len())?;
                if let Some(s) = split.get(&crate::nn::layers::pid(l.index, 0)) {
                    weight = crate::parallel::tensor_parallel::shard(&weight, *s, t.members.len(), t.rank);
                }
            }
            let id = crate::nn::layers::pid(l.index, 0);
            let mut weight = Some(weight);
            model = crate::nn::params::set_params(model, |p, _| if p == id { weight.take() } else { None }).0;
        }
        let params = layout::<B, _>(&model);
        let optim = StageOptim::new(&plan.training.optimizer, &params);
        let experts = crate::parallel::experts::Holding::of(plan, s.id, device, &params);
        // (a ZeRO-sharded stage's shards are cut from the whole weights first)
        let model = match &experts {
            Some(h) if !h.sharded => h.evict(model),
            _ => model,
        };
        out.insert(
            s.id,
            StageState {
                model: Some(model),
                tp,
                optim,
                acc: Vec::new(),
                contributions: 0,
                forward_stats: HashMap::new(),
                stats: None,
                stats_count: 0.0,
                stash: HashMap::new(),
                versions: Vec::new(),
                shard: None,
                experts,
                settled: false,
            },
        );
        if let Some((group, rank, d)) = crate::parallel::zero::shard_group(plan, s.id, device) {
            let st = out.get_mut(&s.id).ok_or(ExecError::Missing("the stage just built"))?;
            let experts = st.experts.as_ref().map(|h| (h, device));
            let mut shard = crate::parallel::zero::ShardState::new(plan, st.model()?, group, rank, d, experts, dev)?;
            // ZeRO-3: the linear weights gathered by their products (not beside tensor or
            // expert parallelism, whose stages are gathered whole)
            if shard.level == pipec_plan::vocab::Sharding::Parameters && st.tp.is_none() && st.experts.is_none() {
                shard.per_product = crate::parallel::zero::per_product(plan, st.model()?, &shard.layout);
            }
            st.shard = Some(shard);
            crate::parallel::zero::stand_in_per_product(st)?;
            if let Some(h) = &st.experts {
                st.model = st.model.take().map(|m| h.evict(m));
            }
        }
    }
    Ok(out)
}
