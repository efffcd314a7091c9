//! A stage's optimizer (of its model, or of a ZeRO replica's shard of it): SGD or AdamW
//! through Burn's optimizers, its records saved and merged for checkpoints.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    decay::WeightDecayConfig, Adam, AdamConfig, AdamW, AdamWConfig, GradientsParams, Optimizer, Sgd, SgdConfig,
};
use burn::prelude::*;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use pipec_plan::checkpoint::ShardKey;
use pipec_plan::plan::OptimizerPlan;
use pipec_plan::Precision;

use crate::backend::kernels::ExecBackend;
use crate::nn::layers::StageModel;
use crate::nn::params::to_optimizer_grads;

/// The optimizer of a stage (of its model, or of a ZeRO replica's shard of it), and the
/// precision its results are stored in.
pub(crate) struct StageOptim<B: ExecBackend, M: AutodiffModule<B> = StageModel<B>> {
    optim: Optim<B, M>,
    storage: Storage,
}

/// What a step's results are rounded to, as the engines store them (the executor keeps
/// f32 tensors and rounds their values): the weights to the training precision after each
/// update where the model has no fp32 master copy (`optimizer.master_weights: false`), the
/// optimizer's state (momentum, Adam's moments) to `optimizer.state_precision`. PyTorch's
/// optimizers update bf16 and fp16 tensors so: each step's arithmetic in fp32 from the
/// stored values, its result rounded once to the tensor's precision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Storage {
    /// The weights' precision, where they are rounded to one.
    pub weights: Option<Precision>,
    /// The optimizer state's precision, where it is rounded to one.
    pub state: Option<Precision>,
}

impl Storage {
    /// The storage `training` asks for.
    pub(crate) fn of(training: &pipec_plan::plan::TrainingPlan) -> Storage {
        let below_fp32 = |p: Precision| (p != Precision::Fp32).then_some(p);
        Storage {
            weights: below_fp32(training.precision).filter(|_| !training.master_weights),
            state: below_fp32(training.state_precision),
        }
    }
}

/// `values` rounded to the nearest value of `precision` (ties to even), kept as f32.
fn round_to(precision: Precision, values: &mut [f32]) {
    match precision {
        Precision::Fp32 => {}
        Precision::Bf16 => values.iter_mut().for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
        Precision::Fp16 => values.iter_mut().for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
    }
}

/// The optimizers Burn gives.
enum Optim<B: ExecBackend, M: AutodiffModule<B>> {
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

impl<B: ExecBackend, M: AutodiffModule<B>> Optim<B, M> {
    fn new(plan: &OptimizerPlan, params: &[(u64, Vec<usize>)]) -> Self {
        match *plan {
            OptimizerPlan::Sgd { momentum, weight_decay, .. } => {
                let mut c = SgdConfig::new();
                if momentum > 0.0 {
                    c = c.with_momentum(Some(MomentumConfig { momentum, dampening: 0.0, nesterov: false }));
                }
                if weight_decay > 0.0 {
                    c = c.with_weight_decay(Some(WeightDecayConfig { penalty: weight_decay as f32 }));
                }
                Optim::Sgd(c.init())
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
                Optim::AdamW(c.init(), rule)
            }
            OptimizerPlan::Adam { beta1, beta2, eps, weight_decay, decoupled: false, .. } => {
                let mut c =
                    AdamConfig::new().with_beta_1(beta1 as f32).with_beta_2(beta2 as f32).with_epsilon(eps as f32);
                if weight_decay > 0.0 {
                    c = c.with_weight_decay(Some(WeightDecayConfig { penalty: weight_decay as f32 }));
                }
                Optim::Adam(c.init())
            }
        }
    }

    fn step(&mut self, lr: f64, model: M, grads: GradientsParams) -> M {
        match self {
            Optim::Sgd(o) => o.step(lr, model, grads),
            Optim::Adam(o) => o.step(lr, model, grads),
            Optim::AdamW(o, None) => o.step(lr, model, grads),
            Optim::AdamW(o, Some(rule)) => {
                let model = rule.apply(lr, model, &grads);
                o.step(lr, model, grads)
            }
        }
    }
}

/// `model` with every weight's values rounded to `precision`.
fn round_weights<B: ExecBackend, M: AutodiffModule<B>>(model: M, precision: Precision) -> M {
    struct Round(Precision);
    impl<B: ExecBackend> burn::module::ModuleMapper<B> for Round {
        fn map_float<const D: usize>(
            &mut self,
            param: burn::module::Param<Tensor<B, D>>,
        ) -> burn::module::Param<Tensor<B, D>> {
            let (id, tensor, _) = param.consume();
            let device = tensor.device();
            let data = tensor.inner().into_data();
            let shape = data.shape.clone();
            // the executor's weights are f32: anything else is a bug, not an input
            let mut values: Vec<f32> = data.convert::<f32>().into_vec().expect("a weight's values as f32");
            round_to(self.0, &mut values);
            let inner = Tensor::<B::InnerBackend, D>::from_data(TensorData::new(values, shape), &device);
            burn::module::Param::initialized(id, Tensor::from_inner(inner).require_grad())
        }
    }
    model.map(&mut Round(precision))
}

impl<B: ExecBackend, M: AutodiffModule<B>> StageOptim<B, M> {
    /// The optimizer of the parameters `params` (id and whole shape: a ZeRO shard's too),
    /// storing its results as `storage` says.
    pub fn new(plan: &OptimizerPlan, params: &[(u64, Vec<usize>)], storage: Storage) -> Self {
        StageOptim { optim: Optim::new(plan, params), storage }
    }

    pub(crate) fn step(&mut self, lr: f64, model: M, grads: GradientsParams) -> M {
        let model = self.optim.step(lr, model, grads);
        let model = match self.storage.weights {
            Some(precision) => round_weights(model, precision),
            None => model,
        };
        if let (Some(precision), Some(dev)) = (self.storage.state, model.devices().first()) {
            // the state is the optimizer's own: a failure to read it back is a bug
            if let Err(e) = self.round_state(precision, dev) {
                panic!("the optimizer's state does not round to {precision}: {e}");
            }
        }
        model
    }

    /// The optimizer's state (each tensor of it) rounded to `precision`.
    fn round_state(&mut self, precision: Precision, dev: &B::Device) -> std::result::Result<(), String> {
        let items = self
            .items()?
            .into_iter()
            .map(|(id, item)| {
                crate::parallel::reshard::map_tensors(std::slice::from_ref(&item), None, &|mut parts| {
                    let mut values = parts.pop().unwrap_or_default();
                    round_to(precision, &mut values);
                    Ok(values)
                })
                .map(|item| (id, item))
                .map_err(|e| e.to_string())
            })
            .collect::<std::result::Result<Vec<_>, String>>()?;
        self.load_items(items, dev)
    }

    /// One update of `model` from flat gradients (in visiting order), each scaled by
    /// `scale`.
    pub(crate) fn update(&mut self, lr: f64, model: M, flat: &[Option<Tensor<B::InnerBackend, 1>>], scale: f64) -> M {
        let grads = to_optimizer_grads(&model, flat, scale);
        self.step(lr, model, grads)
    }

    /// The optimizer's state (momentum, Adam moments) in Burn's binary record format.
    pub fn save(&self) -> std::result::Result<Vec<u8>, String> {
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        match &self.optim {
            Optim::Sgd(o) => recorder.record(o.to_record(), ()),
            Optim::Adam(o) => recorder.record(o.to_record(), ()),
            Optim::AdamW(o, _) => recorder.record(o.to_record(), ()),
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
        let placeholder = Optim::Sgd(SgdConfig::new().init());
        self.optim = match std::mem::replace(&mut self.optim, placeholder) {
            Optim::Sgd(o) => Optim::Sgd(o.load_record(record(bytes, dev)?)),
            Optim::Adam(o) => Optim::Adam(o.load_record(record(bytes, dev)?)),
            Optim::AdamW(o, rule) => Optim::AdamW(o.load_record(record(bytes, dev)?), rule),
        };
        Ok(())
    }

    /// The optimizer's state, each parameter's as a serialised record item (for ZeRO: the
    /// shards' states are joined, and a whole state cut, item by item).
    pub fn items(&self) -> std::result::Result<Vec<(ParamId, crate::parallel::reshard::Item)>, String> {
        fn items_of<R, V, B2: Backend>(
            record: R,
        ) -> std::result::Result<Vec<(ParamId, crate::parallel::reshard::Item)>, String>
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
        match &self.optim {
            Optim::Sgd(o) => items_of::<_, _, B>(o.to_record()),
            Optim::Adam(o) => items_of::<_, _, B>(o.to_record()),
            Optim::AdamW(o, _) => items_of::<_, _, B>(o.to_record()),
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
        let placeholder = Optim::Sgd(SgdConfig::new().init());
        self.optim = match std::mem::replace(&mut self.optim, placeholder) {
            Optim::Sgd(o) => Optim::Sgd(o.load_record(record_of(items, dev)?)),
            Optim::Adam(o) => Optim::Adam(o.load_record(record_of(items, dev)?)),
            Optim::AdamW(o, rule) => Optim::AdamW(o.load_record(record_of(items, dev)?), rule),
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
                    let joined = crate::parallel::reshard::map_tensors(&items, Some(&want.shape), &|parts| {
                        Ok(crate::parallel::tensor_parallel::shard(
                            &crate::parallel::tensor_parallel::unshard(&parts, from)?,
                            to,
                            tp,
                            rank,
                        ))
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
        let placeholder = Optim::Sgd(SgdConfig::new().init());
        self.optim = match std::mem::replace(&mut self.optim, placeholder) {
            Optim::Sgd(o) => Optim::Sgd(o.load_record(merged(files, wants, complete, dev)?)),
            Optim::Adam(o) => Optim::Adam(o.load_record(merged(files, wants, complete, dev)?)),
            Optim::AdamW(o, rule) => Optim::AdamW(o.load_record(merged(files, wants, complete, dev)?), rule),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_keeps_the_nearest_value_of_the_precision_ties_to_even() {
        // bf16 keeps 8 significant bits: 1 + 2^-8 is halfway between 1 and 1 + 2^-7
        let mut v = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 1.0 + 2f32.powi(-9), -2.5e-3];
        round_to(Precision::Bf16, &mut v);
        assert_eq!(v[..3], [1.0, 1.0 + 2f32.powi(-6), 1.0]);
        assert_eq!(v[3], half::bf16::from_f32(-2.5e-3).to_f32());
        // fp16 keeps 11 and overflows past 65,504
        let mut h = [1.0 + 2f32.powi(-11), 70000.0];
        round_to(Precision::Fp16, &mut h);
        assert_eq!(h[0], 1.0);
        assert!(h[1].is_infinite());
        let mut same = [0.1f32];
        round_to(Precision::Fp32, &mut same);
        assert_eq!(same, [0.1]);
    }

    /// An update writes a weight nothing else holds in place, and one held elsewhere (a
    /// clone of the model kept through the step) into new memory: why a step keeps its
    /// weight versions only where vertical sync reads them (`Worker::step`).
    #[test]
    fn an_update_writes_the_weights_in_place_unless_a_clone_holds_them() {
        use crate::backend::CpuBackend as B;
        use pipec_plan::model::Op;
        let dev = Default::default();
        let ops = [Op::Linear { in_features: 64, out_features: 64, bias: true }];
        let plan = pipec_plan::plan::OptimizerPlan::Sgd { lr: 0.1, momentum: 0.0, weight_decay: 0.0 };
        let weight_at = |m: &crate::nn::layers::StageModel<B>| {
            struct At(Vec<*const u8>);
            impl burn::module::ModuleVisitor<B> for At {
                fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
                    self.0.push(param.val().into_primitive().tensor().primitive.bytes().as_ptr());
                }
            }
            let mut at = At(Vec::new());
            m.visit(&mut at);
            at.0
        };
        for held in [false, true] {
            let model = crate::nn::layers::StageModel::<B>::new(&ops, 0, 1, &dev);
            let layout = crate::nn::params::layout::<B, _>(&model);
            let mut optim = StageOptim::<B, _>::new(&plan, &layout, Default::default());
            let flat: Vec<Option<Tensor<<B as burn::tensor::backend::AutodiffBackend>::InnerBackend, 1>>> =
                layout.iter().map(|(_, shape)| Some(Tensor::ones([shape.iter().product::<usize>()], &dev))).collect();
            let before = weight_at(&model);
            let clone = held.then(|| model.clone());
            let after = weight_at(&optim.update(0.1, model, &flat, 1.0));
            assert_eq!(before == after, !held, "held elsewhere: {held}");
            drop(clone);
        }
    }
}
