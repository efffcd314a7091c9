//! The interpreter: one worker per device executes its instruction stream, step after step,
//! with an exhaustive `match` on the instruction set. Nothing runs that the plan does not say.
//! Each instruction is one method below; a tensor-parallel stage differs only in how its
//! forward and backward run (`run_forward`, `run_backward`, see `tensor_parallel`).

use std::collections::HashMap;
use std::time::Instant;

use crate::dense::ExecBackend;
use burn::backend::autodiff::NodeId;
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{decay::WeightDecayConfig, Adam, AdamConfig, GradientsParams, Optimizer, Sgd, SgdConfig};
use burn::prelude::*;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::activation;
use burn::tensor::ElementConversion;
use pipec_plan::checkpoint::ShardKey;
use pipec_plan::model::{crossing, Loss, Source};
use pipec_plan::plan::OptimizerPlan;
use pipec_plan::plan::{instruction_code, Segment as StreamSegment};
use pipec_plan::{DeviceId, GroupId, Instr, MicrobatchId, Plan, ReduceMode, StageId};
use std::collections::BTreeMap;

use crate::comm::{Comm, CommTrace, Ticket};
use crate::data::{Dataset, Inputs, Targets};
use crate::dense::Deferred;
use crate::error::{ExecError, Result};
use crate::layers::{Act, StageGraph, StageModel};
use crate::params::{
    accumulate, add_deferred_into_sums, backward_deferring, backward_into_sums, collect_grads, copy_weights,
    flatten_grads, host_f32, layout, set_params, snapshot, sum_keys, take_weight_copies, to_optimizer_grads, unflatten,
    FlatGrads,
};
use crate::tensor_parallel::{Boundary, Segment};
use crate::transport::{Message, Tag};

/// Everything a worker reports about one step.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    pub device: DeviceId,
    pub step: usize,
    /// (microbatch, loss) for every microbatch whose loss this device computed.
    pub losses: Vec<(u32, f32)>,
    /// (instruction index, start s, end s) from the step's start.
    pub trace: Vec<(usize, f64, f64)>,
    /// What the communication threads ran during the step: (instruction index, start s,
    /// end s) from the start of the run.
    pub comm: CommTrace,
    /// When the step started, in seconds from the start of the run (of this process).
    pub started: f64,
    pub step_seconds: f64,
    /// Peak microbatches kept for the backward at once, per stage.
    pub peak_in_flight: HashMap<StageId, u32>,
    /// Peak weight versions alive at once (live + stashed), per stage.
    pub peak_versions: HashMap<StageId, u32>,
}

/// A stage's trainable state on a device.
pub(crate) struct StageState<B: ExecBackend> {
    pub model: Option<StageModel<B>>,
    /// Tensor parallelism: this device's rank, the group, and the parameters whose
    /// gradients are partial per rank.
    pub tp: Option<TpInfo>,
    pub optim: StageOptim<B>,
    /// Accumulated gradients, one flattened tensor per parameter in visiting order.
    acc: FlatGrads<B>,
    /// Microbatches that contributed to `acc` since the last step.
    contributions: usize,
    /// Batch normalisation: each microbatch forward's batch statistics (laid out as
    /// `StageModel::running_statistics`) until its gradient joins `acc`.
    forward_stats: HashMap<MicrobatchId, Tensor<B::InnerBackend, 1>>,
    /// The statistics of the microbatches whose gradients are in `acc`, summed, and how
    /// many microbatches they cover. They travel with the gradients (all-reduce, parameter
    /// server), so an update folds in the statistics of exactly the microbatches whose
    /// gradients it applies.
    stats: Option<Tensor<B::InnerBackend, 1>>,
    stats_count: f32,
    stash: HashMap<MicrobatchId, StageModel<B>>,
    /// This step's weight versions (index k: after k updates), for vertical sync.
    versions: Vec<StageModel<B>>,
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

    fn clear_gradients(&mut self) {
        self.acc.iter_mut().for_each(|g| *g = None);
        self.contributions = 0;
        self.stats = None;
        self.stats_count = 0.0;
    }

    /// Keeps one microbatch forward's batch statistics (none on a stage without batch
    /// normalisation) until its gradient is added.
    fn record_statistics(&mut self, mb: MicrobatchId, stats: Vec<Tensor<B, 1>>) {
        if !stats.is_empty() {
            self.forward_stats.insert(mb, Tensor::cat(stats, 0).inner());
        }
    }

    /// Adds microbatch `mb`'s statistics to those of the gradients in `acc`.
    fn add_statistics(&mut self, mb: MicrobatchId) {
        if let Some(t) = self.forward_stats.remove(&mb) {
            self.stats = Some(match self.stats.take() {
                Some(s) => s + t,
                None => t,
            });
            self.stats_count += 1.0;
        }
    }

    /// The recorded statistics' sums and then their count, as they travel with the
    /// gradients; empty on a stage without batch normalisation.
    fn statistics_message(&self) -> Result<Vec<f32>> {
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
    fn statistics_message_len(&self) -> Result<usize> {
        let n = self.model()?.statistics_len();
        Ok(if n == 0 { 0 } else { n + 1 })
    }

    /// Takes statistics sums and count in `statistics_message`'s layout (summed over a group).
    fn set_statistics(&mut self, message: &[f32], dev: &B::Device) -> Result<()> {
        let Some((count, sums)) = message.split_last() else { return Ok(()) };
        self.stats = Some(Tensor::from_data(TensorData::new(sums.to_vec(), [sums.len()]), dev));
        self.stats_count = *count;
        Ok(())
    }

    /// Folds the recorded statistics into the running statistics: one update of their
    /// moving average with the mean over the microbatches recorded.
    fn fold_statistics(&mut self) -> Result<()> {
        let (Some(sums), count) = (self.stats.take(), self.stats_count) else { return Ok(()) };
        if count > 0.0 {
            let mean: Vec<f32> = host_f32(sums.into_data())?.into_iter().map(|x| x / count).collect();
            self.model.as_mut().ok_or(ExecError::Missing("the stage's model is in use"))?.fold_statistics(&mean)?;
        }
        self.stats_count = 0.0;
        Ok(())
    }

    /// One optimizer update from flat gradients, each scaled by `scale`.
    fn update(&mut self, lr: f64, flat: &[Option<Tensor<B::InnerBackend, 1>>], scale: f64) -> Result<()> {
        let model = self.model.take().ok_or(ExecError::Missing("the stage's model is in use"))?;
        self.model = Some(self.optim.update(lr, model, flat, scale));
        Ok(())
    }
}

/// The optimizer of a stage.
pub(crate) enum StageOptim<B: ExecBackend> {
    Sgd(OptimizerAdaptor<Sgd<B::InnerBackend>, StageModel<B>, B>),
    Adam(OptimizerAdaptor<Adam, StageModel<B>, B>),
}

impl<B: ExecBackend> StageOptim<B> {
    pub fn new(plan: &OptimizerPlan) -> Self {
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
            OptimizerPlan::Adam { beta1, beta2, eps, weight_decay, .. } => {
                let mut c =
                    AdamConfig::new().with_beta_1(beta1 as f32).with_beta_2(beta2 as f32).with_epsilon(eps as f32);
                if weight_decay > 0.0 {
                    c = c.with_weight_decay(Some(WeightDecayConfig { penalty: weight_decay as f32 }));
                }
                StageOptim::Adam(c.init())
            }
        }
    }

    fn step(&mut self, lr: f64, model: StageModel<B>, grads: GradientsParams) -> StageModel<B> {
        match self {
            StageOptim::Sgd(o) => o.step(lr, model, grads),
            StageOptim::Adam(o) => o.step(lr, model, grads),
        }
    }

    /// One update of `model` from flat gradients (in visiting order), each scaled by
    /// `scale`. The weights' transposed copies (`crate::flex_weights`) belong to the version
    /// being replaced: they are dropped first, so that nothing extra holds the weights while
    /// they are updated, and the new version's are made at once, so that its forwards all
    /// run from them and the transposition runs here, where a stage that waits for its
    /// first input after the update has the time (`pipec profile` times it as part of the
    /// update).
    pub(crate) fn update(
        &mut self,
        lr: f64,
        model: StageModel<B>,
        flat: &[Option<Tensor<B::InnerBackend, 1>>],
        scale: f64,
    ) -> StageModel<B> {
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
        }
        .map_err(|e| format!("cannot record the optimizer state: {e:?}"))
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
                        .map(|v| serde_json::to_value(v.into_item::<FullPrecisionSettings>()))
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .map_err(|e| format!("the optimizer state cannot be resharded: {e}"))?;
                    let (from, to, tp, rank) = (want.saved.from, want.to, want.tp as usize, want.rank as usize);
                    let joined = crate::reshard::map_tensors(&items, &want.shape, &|parts| {
                        Ok(crate::tensor_parallel::shard(&crate::tensor_parallel::unshard(&parts, from)?, to, tp, rank))
                    })
                    .map_err(|e| e.to_string())?;
                    let item: V::Item<FullPrecisionSettings> = serde_json::from_value(joined)
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
    pub saved: crate::reshard::Saved,
    pub to: crate::tensor_parallel::Sharding,
    pub tp: u32,
    pub rank: u32,
}

/// A worker: one device, its stages, its stream.
pub(crate) struct Worker<'a, B: ExecBackend> {
    pub device: DeviceId,
    pub plan: &'a Plan,
    pub stream: &'a [Instr],
    pub data: &'a Dataset,
    pub comm: Comm,
    pub dev: B::Device,
    pub stages: HashMap<StageId, StageState<B>>,
    pub reduce: ReduceMode,
    /// The start of the run: step reports say when each step started from it.
    pub epoch: Instant,
    // per-step buffers
    inputs: HashMap<(StageId, MicrobatchId), Act<B>>,
    labels: HashMap<MicrobatchId, Targets>,
    saved: HashMap<(StageId, MicrobatchId), Kept<B>>,
    outputs: HashMap<(StageId, MicrobatchId), Message>,
    grads_in: HashMap<(StageId, MicrobatchId), Message>,
    input_grads: HashMap<(StageId, MicrobatchId), Message>,
    /// Split backwards' weight halves to come (`BackwardWeight`).
    pending_weight_grads: HashMap<(StageId, MicrobatchId), WeightGrads<B>>,
    in_flight: HashMap<StageId, u32>,
    /// Receives posted ahead, by position in the step.
    posted: HashMap<usize, Ticket<Message>>,
    /// All-reduces in flight, per stage.
    reductions: HashMap<StageId, Reduction>,
}

/// One backward's weight gradients, not yet in the stage's running sums.
struct WeightGrads<B: ExecBackend> {
    /// The gradients Burn's autodiff handed back, flat in visiting order.
    rest: FlatGrads<B>,
    /// The dense weights' gradients a split backward's input half put off.
    deferred: Option<PutOff<B>>,
}

/// Weight gradients put off ([`Deferred`]), with the stage's parameter keys they are summed
/// under (`params::sum_keys`).
type PutOff<B> = (Vec<Option<NodeId>>, Deferred<<B as burn::tensor::backend::AutodiffBackend>::InnerBackend>);

impl<B: ExecBackend> WeightGrads<B> {
    fn all(rest: FlatGrads<B>) -> Self {
        WeightGrads { rest, deferred: None }
    }
}

/// A stage's all-reduce in flight: the sum to come, and how to unpack it.
struct Reduction {
    sum: Ticket<Vec<f32>>,
    sizes: Vec<usize>,
    n_stats: usize,
    members: usize,
    group: GroupId,
}

/// Whether an instruction sends a message (issued when the compute reaches it) or
/// receives one (posted ahead).
fn sends(ins: &Instr) -> bool {
    ins.transfer().is_some_and(|t| t.end == pipec_plan::End::Send)
}
fn receives(ins: &Instr) -> bool {
    ins.transfer().is_some_and(|t| t.end == pipec_plan::End::Recv)
}

/// What a forward keeps for its microbatch's backward: the stage input (detached under
/// recompute), what the backward starts from, and the weights the forward used.
struct Kept<B: ExecBackend> {
    input: Act<B>,
    saved: Saved<B>,
    model: StageModel<B>,
}

/// What a forward kept for its backward.
enum Saved<B: ExecBackend> {
    /// The stage output (tracked).
    Output(Act<B>),
    /// The last stage's loss (tracked).
    Loss(Tensor<B, 1>),
    /// Activation recompute: only the input is kept; the recompute fills this in.
    Nothing,
    /// A tensor-parallel stage: its forward segments, and (last stage) the loss computed
    /// on a leaf copy of the output.
    Tp(Vec<Segment<B>>, Option<(Act<B>, Tensor<B, 1>)>),
}

/// What a stage's forward produced.
struct Forwarded<B: ExecBackend> {
    /// What the backward starts from.
    saved: Saved<B>,
    /// The output to send to the next stage (every stage but the last).
    output: Option<Act<B>>,
    /// The loss this device reports (the last stage; on one rank of a tensor-parallel group).
    loss: Option<Tensor<B, 1>>,
    /// Batch normalisation's statistics of this microbatch, in layer order.
    stats: Vec<Tensor<B, 1>>,
}

/// A copy of a stage's weights that is a fresh autodiff leaf: every microbatch's forward
/// builds its own graph on its own copy (sharing the weights' storage, not their graph
/// nodes). Burn 0.21's graph memory management loses the input gradient of one microbatch
/// when several microbatch graphs share the weight nodes and are back-propagated one by one
/// (reproduced single-threaded; see ARCHITECTURE.md). The copy is also exactly what
/// weight stashing needs: the backward differentiates at the weights the forward used.
struct FreshLeaves;

impl<B: ExecBackend> ModuleMapper<B> for FreshLeaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, _) = param.consume();
        Param::initialized(id, tensor.detach().require_grad())
    }
}

fn microbatch_copy<B: ExecBackend>(model: &StageModel<B>) -> StageModel<B> {
    model.clone().map(&mut FreshLeaves)
}

/// An activation from the wire. A bundle (several tensors crossing one boundary) travels
/// as one message of shape `[0, k, rank₁, dims₁…, rank₂, dims₂…]` — no tensor has a zero
/// dimension — with the parts' values one after another.
fn host_to_act<B: Backend>(shape: &[usize], data: Vec<f32>, dev: &B::Device) -> Result<Act<B>> {
    if shape.first() == Some(&0) {
        let bad = || ExecError::Shape(format!("a malformed bundle header {shape:?}"));
        let k = *shape.get(1).ok_or_else(bad)?;
        let (mut pos, mut offset) = (2usize, 0usize);
        let mut parts = Vec::with_capacity(k.min(64));
        for _ in 0..k {
            let rank = *shape.get(pos).ok_or_else(bad)?;
            let dims = shape.get(pos + 1..pos + 1 + rank).ok_or_else(bad)?;
            let n: usize = dims.iter().product();
            let values = data.get(offset..offset + n).ok_or_else(bad)?.to_vec();
            parts.push(host_to_act::<B>(dims, values, dev)?);
            pos += 1 + rank;
            offset += n;
        }
        if pos != shape.len() || offset != data.len() {
            return Err(bad());
        }
        return Ok(Act::Bundle(parts));
    }
    let td = TensorData::new(data, shape.to_vec());
    Ok(match shape.len() {
        2 => Act::D2(Tensor::from_data(td, dev)),
        3 => Act::D3(Tensor::from_data(td, dev)),
        4 => Act::D4(Tensor::from_data(td, dev)),
        n => return Err(ExecError::Shape(format!("cannot carry a rank-{n} activation"))),
    })
}

/// An activation's wire form: its shape (a bundle's header) and values.
fn act_to_host<B: Backend>(a: &Act<B>) -> Result<(Vec<usize>, Vec<f32>)> {
    let data = match a {
        Act::D2(t) => t.clone().into_data(),
        Act::D3(t) => t.clone().into_data(),
        Act::D4(t) => t.clone().into_data(),
        Act::Tokens(_) => return Err(ExecError::Shape("token ids cannot cross a stage boundary".into())),
        Act::Bundle(parts) => {
            let mut shape = vec![0, parts.len()];
            let mut values = Vec::new();
            for p in parts {
                let (s, v) = act_to_host(p)?;
                shape.push(s.len());
                shape.extend(s);
                values.extend(v);
            }
            return Ok((shape, values));
        }
    };
    let shape = data.shape.to_vec();
    Ok((shape, host_f32(data)?))
}

/// The message a point-to-point instruction sends or receives (the plan's identity, the
/// same at both ends); an activation received by the first stage has none.
fn expected_message(ins: &Instr) -> Result<Tag> {
    ins.transfer().and_then(|t| t.id).ok_or_else(|| ExecError::Plan(format!("`{ins}` names a message no stage sends")))
}

fn act_to_message<B: Backend>(a: &Act<B>, tag: Tag) -> Result<Message> {
    let (shape, data) = act_to_host(a)?;
    Ok(Message { tag, shape, data })
}

pub(crate) fn require_grad<B: ExecBackend>(a: Act<B>) -> Act<B> {
    match a {
        Act::D2(t) => Act::D2(t.require_grad()),
        Act::D3(t) => Act::D3(t.require_grad()),
        Act::D4(t) => Act::D4(t.require_grad()),
        Act::Bundle(parts) => Act::Bundle(parts.into_iter().map(require_grad).collect()),
        other => other,
    }
}

fn detach<B: ExecBackend>(a: &Act<B>) -> Act<B> {
    match a {
        Act::D2(t) => Act::D2(t.clone().detach()),
        Act::D3(t) => Act::D3(t.clone().detach()),
        Act::D4(t) => Act::D4(t.clone().detach()),
        Act::Tokens(t) => Act::Tokens(t.clone()),
        Act::Bundle(parts) => Act::Bundle(parts.iter().map(detach).collect()),
    }
}

/// Σ(out ⊙ g): back-propagating it injects the received gradient `g` at the output.
fn dot_with<B: ExecBackend>(out: &Act<B>, g: &Message, dev: &B::Device) -> Result<Tensor<B, 1>> {
    dot(out, host_to_act::<B>(&g.shape, g.data.clone(), dev)?)
}

fn dot<B: ExecBackend>(out: &Act<B>, grad: Act<B>) -> Result<Tensor<B, 1>> {
    Ok(match (out, grad) {
        (Act::D2(o), Act::D2(g)) => (o.clone() * g).sum(),
        (Act::D3(o), Act::D3(g)) => (o.clone() * g).sum(),
        (Act::D4(o), Act::D4(g)) => (o.clone() * g).sum(),
        (Act::Bundle(os), Act::Bundle(gs)) if os.len() == gs.len() => {
            let mut total: Option<Tensor<B, 1>> = None;
            for (o, g) in os.iter().zip(gs) {
                let d = dot(o, g)?;
                total = Some(match total {
                    Some(t) => t + d,
                    None => d,
                });
            }
            total.ok_or(ExecError::Missing("an empty bundle"))?
        }
        (o, g) => {
            return Err(ExecError::Shape(format!(
                "gradient of shape {:?} does not fit the output {:?}",
                g.dims(),
                o.dims()
            )))
        }
    })
}

/// The gradient that reached an input (a bundle's parts each: zeros where none reached one).
fn grad_of<B: ExecBackend>(x: &Act<B>, grads: &mut B::Gradients) -> Option<Act<B::InnerBackend>> {
    match x {
        Act::D2(t) => t.grad_remove(grads).map(Act::D2),
        Act::D3(t) => t.grad_remove(grads).map(Act::D3),
        Act::D4(t) => t.grad_remove(grads).map(Act::D4),
        Act::Tokens(_) => None,
        Act::Bundle(parts) => {
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                out.push(match grad_of(p, grads) {
                    Some(g) => g,
                    None => match p {
                        Act::D2(t) => Act::D2(t.clone().inner().zeros_like()),
                        Act::D3(t) => Act::D3(t.clone().inner().zeros_like()),
                        Act::D4(t) => Act::D4(t.clone().inner().zeros_like()),
                        _ => return None,
                    },
                });
            }
            Some(Act::Bundle(out))
        }
    }
}

fn input_grad<B: ExecBackend>(x: &Act<B>, grads: &mut B::Gradients, tag: Tag) -> Result<Option<Message>> {
    match grad_of(x, grads) {
        None => Ok(None),
        Some(g) => Ok(Some(act_to_message(&g, tag)?)),
    }
}

impl<'a, B: ExecBackend> Worker<'a, B> {
    // the worker's parts, each one of the run's: a struct of them would only be unpacked here
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        device: DeviceId,
        plan: &'a Plan,
        stream: &'a [Instr],
        data: &'a Dataset,
        comm: Comm,
        dev: B::Device,
        stages: HashMap<StageId, StageState<B>>,
        reduce: ReduceMode,
    ) -> Self {
        Worker {
            device,
            plan,
            stream,
            data,
            comm,
            dev,
            stages,
            reduce,
            epoch: Instant::now(),
            inputs: HashMap::new(),
            labels: HashMap::new(),
            saved: HashMap::new(),
            outputs: HashMap::new(),
            grads_in: HashMap::new(),
            input_grads: HashMap::new(),
            pending_weight_grads: HashMap::new(),
            in_flight: HashMap::new(),
            posted: HashMap::new(),
            reductions: HashMap::new(),
        }
    }

    /// The segments step `step` runs: the plan's stream; for a flush-free pipeline the
    /// prologue first when the pipeline is empty (`filled` false), then the body, or the
    /// epilogue when the step must leave it empty (`drain`).
    pub fn segments(&self, filled: bool, drain: bool) -> Vec<(StreamSegment, &'a [Instr])> {
        let Some(f) = &self.plan.flush_free else { return vec![(StreamSegment::Body, self.stream)] };
        let of = |m: &'a BTreeMap<DeviceId, Vec<Instr>>| m.get(&self.device).map_or(&[][..], Vec::as_slice);
        let mut out = Vec::with_capacity(2);
        if !filled {
            out.push((StreamSegment::Prologue, of(&f.prologue)));
        }
        out.push(if drain { (StreamSegment::Epilogue, of(&f.epilogue)) } else { (StreamSegment::Body, self.stream) });
        out
    }

    /// Runs one step: its `segments` (see `segments`), each instruction's microbatch made
    /// absolute (`step·N + m`). With `drained`, nothing may be left in flight afterwards.
    /// On failure: the instruction's `instruction_code` and the error.
    pub fn step(
        &mut self,
        step: usize,
        segments: &[(StreamSegment, &[Instr])],
        drained: bool,
    ) -> std::result::Result<StepReport, (usize, ExecError)> {
        let start = Instant::now();
        let started = start.duration_since(self.epoch).as_secs_f64();
        let mut report = StepReport { device: self.device, step, started, ..Default::default() };
        for st in self.stages.values_mut() {
            st.versions = st.model.iter().cloned().collect();
        }
        let base = (step * self.plan.training.microbatches) as u32;
        let mut versions: HashMap<StageId, u32> = HashMap::new();
        let all: Vec<(usize, Instr)> = segments
            .iter()
            .flat_map(|(segment, stream)| {
                stream.iter().enumerate().map(move |(index, ins)| {
                    (instruction_code(*segment, index), ins.map_microbatch(|m| MicrobatchId(base + m.0)))
                })
            })
            .collect();
        // the next message instruction not yet handed to the communication thread
        let mut issued = 0;
        let mut last = 0;
        for (at, (code, ins)) in all.iter().enumerate() {
            last = *code;
            // post the receives up to the next send: messages keep the stream's order, and a
            // send is issued when the compute reaches it
            while let Some((c, next)) = all.get(issued) {
                if sends(next) {
                    break;
                }
                if receives(next) {
                    let tag = expected_message(next).map_err(|e| (*c, e))?;
                    let peer = next.peer().unwrap_or(self.device);
                    let ticket = self.comm.post_recv(peer, tag, *c).map_err(|e| (*c, e.into()))?;
                    self.posted.insert(issued, ticket);
                }
                issued += 1;
            }
            if sends(ins) {
                issued = at + 1;
            }
            let t0 = start.elapsed().as_secs_f64();
            self.exec(ins, *code, at, &mut report).map_err(|e| (*code, e))?;
            let t1 = start.elapsed().as_secs_f64();
            report.trace.push((*code, t0, t1));
            for (s, n) in &self.in_flight {
                let p = report.peak_in_flight.entry(*s).or_insert(0);
                *p = (*p).max(*n);
            }
            for (s, st) in &self.stages {
                let v = versions.entry(*s).or_insert(0);
                *v = (*v).max(1 + st.stash.len() as u32);
            }
        }
        report.comm = self.comm.fence().map_err(|e| (last, e.into()))?;
        if !self.reductions.is_empty() || !self.posted.is_empty() {
            return Err((
                last,
                ExecError::Missing("an all-reduce or a receive is left in flight at the end of the step"),
            ));
        }
        if drained
            && (!self.saved.is_empty()
                || !self.outputs.is_empty()
                || !self.input_grads.is_empty()
                || self.stages.values().any(|st| !st.forward_stats.is_empty()))
        {
            return Err((last, ExecError::Missing("buffers are left over at the end of the step")));
        }
        report.peak_versions = versions;
        report.step_seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }

    /// The message posted for the receive at position `at` of the step.
    fn received(&mut self, at: usize) -> Result<Message> {
        Ok(self.posted.remove(&at).ok_or(ExecError::Missing("the receive was not posted"))?.wait()?)
    }

    fn exec(&mut self, ins: &Instr, code: usize, at: usize, report: &mut StepReport) -> Result<()> {
        match *ins {
            Instr::LoadMicrobatch { stage, mb, inputs, labels } => self.load_microbatch(stage, mb, inputs, labels),
            Instr::RecvActivation { stage, mb, .. } => {
                let msg = self.received(at)?;
                let act = require_grad(host_to_act::<B>(&msg.shape, msg.data, &self.dev)?);
                self.inputs.insert((stage, mb), act);
                Ok(())
            }
            Instr::Forward { stage, mb } => self.forward(stage, mb, report),
            Instr::Recompute { stage, mb } => self.recompute(stage, mb),
            Instr::Backward { stage, mb } => {
                let grads = self.run_backward(stage, mb, false)?;
                self.add_gradient(stage, mb, grads)?;
                // the stashed version has served its backward
                self.state(stage)?.stash.remove(&mb);
                Ok(())
            }
            Instr::BackwardInput { stage, mb } => {
                // the input gradients, and every gradient but the dense weights' products,
                // which wait for the plan's BackwardWeight
                let grads = self.run_backward(stage, mb, true)?;
                self.pending_weight_grads.insert((stage, mb), grads);
                Ok(())
            }
            Instr::BackwardWeight { stage, mb } => {
                let grads = self
                    .pending_weight_grads
                    .remove(&(stage, mb))
                    .ok_or(ExecError::Missing("the input-gradient pass of this microbatch did not run"))?;
                self.add_gradient(stage, mb, grads)
            }
            Instr::Free { stage, mb } => {
                self.saved.remove(&(stage, mb)).ok_or(ExecError::Missing("nothing is kept for this microbatch"))?;
                if let Some(c) = self.in_flight.get_mut(&stage) {
                    *c = c.saturating_sub(1);
                }
                Ok(())
            }
            Instr::SendActivation { peer, stage, mb, .. } => {
                let msg = self.outputs.remove(&(stage, mb));
                self.send(peer, msg, code, "the activation to send was not computed")
            }
            Instr::RecvGradient { stage, mb, .. } => {
                let msg = self.received(at)?;
                self.grads_in.insert((stage, mb), msg);
                Ok(())
            }
            Instr::SendGradient { peer, stage, mb, .. } => {
                let msg = self.input_grads.remove(&(stage, mb));
                self.send(peer, msg, code, "the gradient to send was not computed")
            }
            Instr::AllReduce { stage, group, .. } => self.start_all_reduce(stage, group, code),
            Instr::WaitAllReduce { stage, group } => self.wait_all_reduce(stage, group),
            Instr::TiedAllReduce { group, .. } => self.tied_all_reduce(group, code),
            Instr::StashWeights { stage, mb, version } => {
                let st = self.state(stage)?;
                let m = match version {
                    None => st.model()?.clone(),
                    Some(v) => st.versions.get(v as usize).cloned().ok_or_else(|| {
                        ExecError::Plan(format!("weight version {v} does not exist yet ({} so far)", st.versions.len()))
                    })?,
                };
                st.stash.insert(mb, m);
                Ok(())
            }
            Instr::RestoreWeights { stage, mb } => {
                // Burn's autodiff graph holds the exact weight tensors the forward used, so
                // the backward already differentiates at the stashed version; the stash is
                // what keeps that version alive (and counted) until then.
                if !self.state(stage)?.stash.contains_key(&mb) {
                    return Err(ExecError::Missing("no weights were stashed for this microbatch"));
                }
                Ok(())
            }
            Instr::PushGradient { peer, stage, .. } => {
                self.sum_local_ties(stage)?;
                let st = self.state(stage)?;
                if st.contributions != 1 {
                    return Err(ExecError::Plan(format!(
                        "{} microbatch gradients to push, expected one",
                        st.contributions
                    )));
                }
                let mut flat = flatten_grads::<B>(&st.acc)?;
                flat.extend(st.statistics_message()?);
                st.clear_gradients();
                let n = flat.len();
                Ok(self.comm.send(peer, Message { tag: expected_message(ins)?, shape: vec![n], data: flat }, code)?)
            }
            Instr::ApplyGradient { stage, .. } => {
                let msg = self.received(at)?;
                self.apply_gradient(stage, &msg.data)
            }
            Instr::PushWeights { peer, stage, .. } => {
                let model = self.state(stage)?.model()?;
                let mut values: Vec<f32> = snapshot::<B, _>(model)?.into_iter().flat_map(|(_, _, v)| v).collect();
                values.extend(model.running_statistics());
                let n = values.len();
                Ok(self.comm.send(peer, Message { tag: expected_message(ins)?, shape: vec![n], data: values }, code)?)
            }
            Instr::PullWeights { stage, .. } => {
                let msg = self.received(at)?;
                self.pull_weights(stage, &msg.data)
            }
            Instr::OptimizerStep { stage } => self.optimizer_step(stage),
        }
    }

    /// Sends a computed message; `missing` says what was not computed.
    fn send(&mut self, peer: DeviceId, msg: Option<Message>, code: usize, missing: &'static str) -> Result<()> {
        Ok(self.comm.send(peer, msg.ok_or(ExecError::Missing(missing))?, code)?)
    }

    fn last_stage(&self) -> StageId {
        StageId(self.plan.stages.len().saturating_sub(1) as u32)
    }

    fn state(&mut self, s: StageId) -> Result<&mut StageState<B>> {
        self.stages.get_mut(&s).ok_or_else(|| ExecError::Plan(format!("{} does not hold {s}", self.device)))
    }

    /// The dropout key of a microbatch's forward (the same at its recompute): its step and
    /// number in the step, from its number in the run.
    fn mask_key(&self, mb: MicrobatchId) -> (u64, u64, u64) {
        let n = self.plan.training.microbatches.max(1) as u64;
        (self.plan.training.seed, u64::from(mb.0) / n, u64::from(mb.0) % n)
    }

    fn learning_rate(&self) -> f64 {
        match self.plan.training.optimizer {
            OptimizerPlan::Sgd { lr, .. } | OptimizerPlan::Adam { lr, .. } => lr,
        }
    }

    fn load_microbatch(&mut self, stage: StageId, mb: MicrobatchId, inputs: bool, labels: bool) -> Result<()> {
        let t = &self.plan.training;
        // `mb` is the microbatch's number in the run: step·N + its number in the step
        let n = t.microbatches.max(1);
        let (x, y) = self.data.microbatch(mb.0 as usize / n, mb.0 as usize % n, t.microbatch_size, t.batch_size);
        if inputs {
            let mut shape = vec![t.microbatch_size];
            shape.extend(&self.plan.model.input);
            let act = match x {
                Inputs::Features(v) => host_to_act::<B>(&shape, v, &self.dev)?,
                Inputs::Tokens(v) => Act::Tokens(Tensor::from_data(TensorData::new(v, shape), &self.dev)),
            };
            self.inputs.insert((stage, mb), act);
        }
        if labels {
            self.labels.insert(mb, y);
        }
        Ok(())
    }

    /// `Forward`: runs the stage on a microbatch copy of its weights (the stashed version
    /// when the plan stashed one; vertical sync may pick an older version than the current
    /// one), reports the loss or keeps the output to send, and keeps what the backward needs.
    fn forward(&mut self, stage: StageId, mb: MicrobatchId, report: &mut StepReport) -> Result<()> {
        let x = self.inputs.remove(&(stage, mb)).ok_or(ExecError::Missing("its input was not loaded or received"))?;
        let st = self.state(stage)?;
        let model = microbatch_copy(match st.stash.get(&mb) {
            Some(m) => m,
            None => st.model()?,
        });
        let f = self.run_forward(stage, mb, &model, x.clone(), self.mask_key(mb))?;
        // the forward (not a recompute) records batch normalisation's statistics
        self.state(stage)?.record_statistics(mb, f.stats);
        if let Some(loss) = f.loss {
            let value = loss.into_scalar().elem::<f32>();
            if !value.is_finite() {
                return Err(ExecError::NonFinite(format!("the loss of microbatch {} is {value}", mb.0)));
            }
            report.losses.push((mb.0, value));
        }
        if let Some(out) = &f.output {
            self.outputs.insert((stage, mb), act_to_message(out, Tag::activation(stage, mb))?);
        }
        // with recompute only the input is kept (the last stage keeps its loss); the
        // `Recompute` instruction re-runs the forward, a tensor-parallel group's
        // all-reduces included
        let recompute = self.plan.stage(stage).is_some_and(|s| s.recompute);
        let kept = Kept {
            input: if recompute { detach(&x) } else { x },
            saved: if recompute && stage != self.last_stage() { Saved::Nothing } else { f.saved },
            model,
        };
        self.saved.insert((stage, mb), kept);
        *self.in_flight.entry(stage).or_insert(0) += 1;
        Ok(())
    }

    /// `Recompute`: re-runs the forward from the kept input at the weights the forward used
    /// (not the newest, if an update came between), with the same dropout masks.
    fn recompute(&mut self, stage: StageId, mb: MicrobatchId) -> Result<()> {
        let Kept { input, model, .. } =
            self.saved.remove(&(stage, mb)).ok_or(ExecError::Missing("nothing is kept for this microbatch"))?;
        let x = if stage.0 == 0 { input } else { require_grad(input) };
        let model = microbatch_copy(&model);
        let f = self.run_forward(stage, mb, &model, x.clone(), self.mask_key(mb))?;
        self.saved.insert((stage, mb), Kept { input: x, saved: f.saved, model });
        Ok(())
    }

    /// A stage's forward on `model`; the one place a tensor-parallel stage's forward differs.
    fn run_forward(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        model: &StageModel<B>,
        x: Act<B>,
        key: (u64, u64, u64),
    ) -> Result<Forwarded<B>> {
        let is_last = stage == self.last_stage();
        if let Some(tp) = self.state(stage)?.tp.clone() {
            let reduce = self.reduce;
            let comm = &self.comm;
            let mut sum = |v: Vec<f32>| -> Result<Vec<f32>> { Ok(comm.all_reduce(&tp.members, v, reduce, None)?) };
            let mut stats = Vec::new();
            let segments = crate::tensor_parallel::forward(model, x, true, key, &mut sum, &mut stats)?;
            let out = segments.last().map(|s| s.out.clone()).ok_or(ExecError::Missing("the stage has no layers"))?;
            if !is_last {
                return Ok(Forwarded { saved: Saved::Tp(segments, None), output: Some(out), loss: None, stats });
            }
            let leaf = crate::tensor_parallel::fresh(&out);
            let loss = self.loss(mb, leaf.clone())?;
            let reported = (tp.rank == 0).then(|| loss.clone());
            return Ok(Forwarded {
                saved: Saved::Tp(segments, Some((leaf, loss))),
                output: None,
                loss: reported,
                stats,
            });
        }
        let mut stats = Vec::new();
        let out = model.forward(x, true, key, &mut stats)?;
        if is_last {
            let loss = self.loss(mb, out)?;
            Ok(Forwarded { saved: Saved::Loss(loss.clone()), output: None, loss: Some(loss), stats })
        } else {
            Ok(Forwarded { saved: Saved::Output(out.clone()), output: Some(out), loss: None, stats })
        }
    }

    /// The mean loss of a microbatch's output (tracked).
    fn loss(&self, mb: MicrobatchId, out: Act<B>) -> Result<Tensor<B, 1>> {
        let y = self.labels.get(&mb).ok_or(ExecError::Missing("the labels of this microbatch were not loaded"))?;
        loss_of::<B>(self.plan.model.loss, out, y, &self.dev)
    }

    /// A microbatch's backward: leaves the input gradient to send (every stage but the
    /// first) and returns the weight gradients not yet summed. The dense weights' gradients
    /// are added straight into the stage's sums inside the pass (`dense::with_gradient_sums`)
    /// or, for the input half of a split backward (`split`), put off to its weight half
    /// (`dense::with_deferred_weight_gradients`); the rest are Burn's.
    fn run_backward(&mut self, stage: StageId, mb: MicrobatchId, split: bool) -> Result<WeightGrads<B>> {
        let n_mb = self.plan.training.microbatches as f64;
        let kept = self.saved.get(&(stage, mb)).ok_or(ExecError::Missing("its forward's activations are missing"))?;
        let target = match &kept.saved {
            Saved::Tp(..) => return self.backward_tp(stage, mb, n_mb).map(WeightGrads::all),
            Saved::Loss(l) => l.clone() / n_mb,
            Saved::Output(out) => {
                let g = self
                    .grads_in
                    .remove(&(stage, mb))
                    .ok_or(ExecError::Missing("the gradient of its output was not received"))?;
                dot_with::<B>(out, &g, &self.dev)?
            }
            Saved::Nothing => return Err(ExecError::Missing("recompute was not run before the backward")),
        };
        let keys = sum_keys(&kept.model);
        let (mut grads, deferred) = if split {
            let (grads, deferred) = backward_deferring::<B>(&keys, || target.backward());
            (grads, Some((keys, deferred)))
        } else {
            (backward_into_sums::<B>(&mut self.state(stage)?.acc, &keys, || target.backward()), None)
        };
        let kept = self.saved.get(&(stage, mb)).ok_or(ExecError::Missing("its forward's activations are missing"))?;
        if stage.0 > 0 {
            let g = input_grad::<B>(&kept.input, &mut grads, Tag::gradient(stage, mb))?
                .ok_or(ExecError::Missing("no gradient reached the stage input"))?;
            self.input_grads.insert((stage, mb), g);
        }
        Ok(WeightGrads { rest: collect_grads(&kept.model, &mut grads), deferred })
    }

    /// The backward of a tensor-parallel stage, segment by segment (see
    /// `tensor_parallel`); returns the weight gradients and leaves the input gradient to send.
    fn backward_tp(&mut self, stage: StageId, mb: MicrobatchId, n_mb: f64) -> Result<FlatGrads<B>> {
        let tp = self.state(stage)?.tp.clone().ok_or(ExecError::Plan(format!("{stage} is not tensor-parallel")))?;
        let size = tp.members.len() as f32;
        let reduce = self.reduce;
        let Kept { saved, model: used, .. } =
            self.saved.get(&(stage, mb)).ok_or(ExecError::Missing("its forward's activations are missing"))?;
        let Saved::Tp(segments, loss) = saved else {
            return Err(ExecError::Plan(format!("{stage}'s forward was not tensor-parallel")));
        };
        // clones share the forward's autodiff nodes, so gradients are found by them
        let (segments, loss, used) = (segments.clone(), loss.clone(), used.clone());
        // the gradient at the last segment's output
        let mut grad_out: Message = match loss {
            Some((leaf, l)) => {
                let mut grads = (l / n_mb).backward();
                input_grad::<B>(&leaf, &mut grads, Tag::gradient(stage, mb))?
                    .ok_or(ExecError::Missing("no gradient reached the loss input"))?
            }
            None => self
                .grads_in
                .remove(&(stage, mb))
                .ok_or(ExecError::Missing("the gradient of its output was not received"))?,
        };
        let mut flat: FlatGrads<B> = Vec::new();
        for (k, seg) in segments.iter().enumerate().rev() {
            let mut grads = dot_with::<B>(&seg.out, &grad_out, &self.dev)?.backward();
            accumulate::<B>(&mut flat, collect_grads(&used, &mut grads));
            if k == 0 && stage.0 == 0 {
                break;
            }
            let mut g = input_grad::<B>(&seg.leaf, &mut grads, Tag::gradient(stage, mb))?
                .ok_or(ExecError::Missing("no gradient reached a segment input"))?;
            match seg.boundary {
                Boundary::Complete => {}
                Boundary::Sum => {
                    g.data = self.comm.all_reduce(&tp.members, std::mem::take(&mut g.data), reduce, None)?;
                }
                Boundary::SumResidual => {
                    g.data = self.comm.all_reduce(&tp.members, std::mem::take(&mut g.data), reduce, None)?;
                    for (x, r) in g.data.iter_mut().zip(&grad_out.data) {
                        *x -= (size - 1.0) * r;
                    }
                }
            }
            if k == 0 {
                self.input_grads.insert((stage, mb), g);
            } else {
                grad_out = g;
            }
        }
        Ok(flat)
    }

    /// Adds one microbatch's weight gradients (and its forward's batch statistics) to the
    /// stage's accumulator.
    fn add_gradient(&mut self, stage: StageId, mb: MicrobatchId, grads: WeightGrads<B>) -> Result<()> {
        let st = self.state(stage)?;
        if let Some((keys, deferred)) = grads.deferred {
            add_deferred_into_sums::<B>(&mut st.acc, &keys, deferred);
        }
        accumulate::<B>(&mut st.acc, grads.rest);
        st.add_statistics(mb);
        st.contributions += 1;
        Ok(())
    }

    /// `AllReduce`: hands the stage's accumulated gradients (and batch statistics) to the
    /// collective thread, which sums them over the stage's data-parallel group while this
    /// thread computes on.
    fn start_all_reduce(&mut self, stage: StageId, group: GroupId, code: usize) -> Result<()> {
        let members = self
            .plan
            .groups
            .iter()
            .find(|g| g.id == group)
            .map(|g| g.devices.clone())
            .ok_or_else(|| ExecError::Plan(format!("the plan has no {group}")))?;
        if self.reductions.contains_key(&stage) {
            return Err(ExecError::Plan(format!("{stage} starts an all-reduce while its last one is in flight")));
        }
        let reduce = self.reduce;
        let st = self.state(stage)?;
        let sizes: Vec<usize> = st.acc.iter().flatten().map(|t| t.dims()[0]).collect();
        let mut flat = flatten_grads::<B>(&st.acc)?;
        let stats = st.statistics_message()?;
        let n_stats = stats.len();
        flat.extend(stats);
        let n = members.len();
        let sum = self.comm.start_all_reduce(members, flat, reduce, Some(code))?;
        self.reductions.insert(stage, Reduction { sum, sizes, n_stats, members: n, group });
        Ok(())
    }

    /// `WaitAllReduce`: takes the sum back into the stage's accumulator.
    fn wait_all_reduce(&mut self, stage: StageId, group: GroupId) -> Result<()> {
        let r = self
            .reductions
            .remove(&stage)
            .filter(|r| r.group == group)
            .ok_or_else(|| ExecError::Plan(format!("no all-reduce of {stage} on {group} is in flight")))?;
        let mut flat = r.sum.wait()?;
        let dev = self.dev.clone();
        let st = self.state(stage)?;
        if flat.len() < r.n_stats {
            return Err(ExecError::Missing("fewer gradients came back than were sent"));
        }
        let stats = flat.split_off(flat.len() - r.n_stats);
        st.set_statistics(&stats, &dev)?;
        let mut summed = unflatten::<B::InnerBackend>(&flat, &r.sizes, &dev)?.into_iter();
        for g in st.acc.iter_mut().flatten() {
            *g = summed.next().ok_or(ExecError::Missing("fewer gradients came back than were sent"))?;
        }
        st.contributions *= r.members;
        Ok(())
    }

    /// `ApplyGradient` (parameter server): one microbatch's gradient for the whole stage;
    /// its loss was scaled by 1/N, so the update uses its mean.
    fn apply_gradient(&mut self, stage: StageId, values: &[f32]) -> Result<()> {
        let lr = self.learning_rate();
        let n_mb = self.plan.training.microbatches as f64;
        let dev = self.dev.clone();
        let st = self.state(stage)?;
        let sizes: Vec<usize> = layout::<B, _>(st.model()?).iter().map(|(_, s)| s.iter().product()).collect();
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
        st.update(lr, &flat, n_mb)?;
        st.set_statistics(stats, &dev)?;
        st.fold_statistics()
    }

    /// `PullWeights`: replaces the stage's weights with the parameter server's, in visiting order.
    fn pull_weights(&mut self, stage: StageId, values: &[f32]) -> Result<()> {
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

    /// `TiedAllReduce`: sums the tied weight's gradient over the copies in `group` (in the
    /// embedding's [vocab, d] orientation): the first member holding each tied stage
    /// contributes it, every member holding one takes the sum.
    fn tied_all_reduce(&mut self, group: GroupId, code: usize) -> Result<()> {
        let g = self
            .plan
            .groups
            .iter()
            .find(|g| g.id == group)
            .ok_or_else(|| ExecError::Plan(format!("the plan has no {group}")))?;
        let [a, b] = g.tie.ok_or_else(|| ExecError::Plan(format!("{group} is not a weight-tying group")))?;
        let members = g.devices.clone();
        let plan = self.plan;
        let holds = |s: &pipec_plan::plan::StagePlan, d: DeviceId| {
            s.replicas.contains(&d) || s.tensor_parallel.iter().any(|t| t.contains(&d))
        };
        let stage_of = |layer: usize| plan.stages.iter().find(|s| (s.layers[0]..s.layers[1]).contains(&layer));
        let mut sum: Option<Vec<f32>> = None;
        let mut mine = Vec::new();
        for layer in [a, b] {
            let s = stage_of(layer).ok_or_else(|| ExecError::Plan(format!("no stage holds layer {layer}")))?;
            if !self.stages.contains_key(&s.id) {
                continue;
            }
            mine.push((s.id, layer));
            let first = members.iter().copied().find(|d| holds(s, *d));
            let g = tied_gradient(self.state(s.id)?, plan, layer)?;
            let sum = sum.get_or_insert_with(|| vec![0.0; g.len()]);
            if first == Some(self.device) {
                sum.iter_mut().zip(&g).for_each(|(x, y)| *x += y);
            }
        }
        let sum = sum.ok_or(ExecError::Plan(format!("{} holds no layer tied by {group}", self.device)))?;
        let sum = self.comm.all_reduce(&members, sum, self.reduce, Some(code))?;
        for (s, layer) in mine {
            set_tied_gradient(self.state(s)?, plan, layer, &sum)?;
        }
        Ok(())
    }

    /// Ties within one stage: the embedding's and the projection's gradients summed, both
    /// copies taking the sum (before the update, after any all-reduce).
    fn sum_local_ties(&mut self, stage: StageId) -> Result<()> {
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
    fn optimizer_step(&mut self, stage: StageId) -> Result<()> {
        let lr = self.learning_rate();
        let n_mb = self.plan.training.microbatches as f64;
        self.sum_partial_gradients(stage)?;
        self.sum_local_ties(stage)?;
        let st = self.state(stage)?;
        let scale = if st.contributions > 0 { n_mb / st.contributions as f64 } else { 1.0 };
        let acc = std::mem::take(&mut st.acc);
        st.update(lr, &acc, scale)?;
        st.fold_statistics()?;
        st.clear_gradients();
        if let Some(m) = st.model.clone() {
            st.versions.push(m);
        }
        Ok(())
    }

    /// Sums, over the tensor-parallel group, the gradients that are partial on each rank.
    fn sum_partial_gradients(&mut self, stage: StageId) -> Result<()> {
        let Some(tp) = self.state(stage)?.tp.clone() else { return Ok(()) };
        if tp.partial_ids.is_empty() {
            return Ok(());
        }
        let reduce = self.reduce;
        let dev = self.dev.clone();
        let st = self.stages.get_mut(&stage).ok_or(ExecError::Missing("no stage"))?;
        let ids = layout::<B, _>(st.model()?);
        for (i, (id, _)) in ids.iter().enumerate() {
            if !tp.partial_ids.contains(id) {
                continue;
            }
            let Some(Some(t)) = st.acc.get(i) else { continue };
            let n = t.dims()[0];
            let v = host_f32(t.clone().into_data())?;
            let v = self.comm.all_reduce(&tp.members, v, reduce, None)?;
            st.acc[i] = Some(Tensor::from_data(TensorData::new(v, [n]), &dev));
        }
        Ok(())
    }
}

/// The weight of a tied layer (an embedding table, or the projection tied to one) and its
/// table's [vocab, d] shape.
fn tied_weight(plan: &Plan, layer: usize) -> Result<(u64, usize, usize)> {
    let table = plan.layers.get(layer).and_then(|l| l.tied).unwrap_or(layer);
    match plan.layers.get(table).map(|l| &l.op) {
        Some(pipec_plan::model::Op::Embedding { vocab, dim }) => Ok((crate::layers::pid(layer, 0), *vocab, *dim)),
        _ => Err(ExecError::Plan(format!("layer {layer} is not tied to an embedding"))),
    }
}

/// The accumulated gradient of a tied weight in the table's [vocab, d] orientation (zeros
/// when none has accumulated).
fn tied_gradient<B: ExecBackend>(st: &StageState<B>, plan: &Plan, layer: usize) -> Result<Vec<f32>> {
    let (id, vocab, dim) = tied_weight(plan, layer)?;
    let k = layout::<B, _>(st.model()?)
        .iter()
        .position(|(p, _)| *p == id)
        .ok_or_else(|| ExecError::Plan(format!("layer {layer}'s weight is not on this stage")))?;
    let g = match st.acc.get(k) {
        Some(Some(t)) => host_f32(t.clone().into_data())?,
        _ => return Ok(vec![0.0; vocab * dim]),
    };
    Ok(if plan.layers[layer].tied.is_some() { crate::layers::transpose(&g, dim, vocab) } else { g })
}

/// Replaces a tied weight's accumulated gradient with `g` (in the table's orientation).
fn set_tied_gradient<B: ExecBackend>(st: &mut StageState<B>, plan: &Plan, layer: usize, g: &[f32]) -> Result<()> {
    let (id, vocab, dim) = tied_weight(plan, layer)?;
    let k = layout::<B, _>(st.model()?)
        .iter()
        .position(|(p, _)| *p == id)
        .ok_or_else(|| ExecError::Plan(format!("layer {layer}'s weight is not on this stage")))?;
    let values = if plan.layers[layer].tied.is_some() { crate::layers::transpose(g, vocab, dim) } else { g.to_vec() };
    if st.acc.len() <= k {
        st.acc.resize(k + 1, None);
    }
    let dev = st.model()?.devices().into_iter().next().ok_or(ExecError::Missing("the stage has no device"))?;
    st.acc[k] = Some(Tensor::from_data(TensorData::new(values, [vocab * dim]), &dev));
    Ok(())
}

/// The mean loss of a microbatch (tracked).
fn loss_of<B: ExecBackend>(loss: Loss, out: Act<B>, y: &Targets, dev: &B::Device) -> Result<Tensor<B, 1>> {
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
            let labels = Tensor::<B, 2, Int>::from_data(TensorData::new(classes.clone(), [n, 1]), dev);
            let logp = activation::log_softmax(logits, 1);
            Ok(logp.gather(1, labels).mean().neg())
        }
        (Loss::Mse, Targets::Values(values)) => {
            let target = Tensor::<B, 2>::from_data(TensorData::new(values.clone(), [n, c]), dev);
            Ok((logits - target).powi_scalar(2).mean())
        }
        _ => Err(ExecError::Data(format!("the targets do not fit the `{loss}` loss"))),
    }
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
        let ops: Vec<_> = plan.layers[s.layers[0]..s.layers[1]].iter().map(|l| l.op.clone()).collect();
        let (model, tp) = match s.tensor_parallel.iter().find(|g| g.contains(&device)) {
            Some(group) if group.len() > 1 => {
                let rank = group.iter().position(|d| *d == device).unwrap_or(0);
                let model = crate::tensor_parallel::build_stage::<B>(
                    &ops,
                    s.layers[0],
                    plan.training.seed,
                    dev,
                    rank,
                    group.len(),
                )?;
                let partial_ids = crate::tensor_parallel::partial_parameter_ids(&ops, s.layers[0], group.len())?;
                (model, Some(TpInfo { rank, members: group.clone(), partial_ids }))
            }
            _ => {
                let mut model = StageModel::<B>::new(&ops, s.layers[0], plan.training.seed, dev);
                model.graph = stage_graph(plan, s.layers[0], s.layers[1]);
                (model, None)
            }
        };
        // a projection tied to an embedding starts as the transpose of its table
        let mut model = model;
        for l in &plan.layers[s.layers[0]..s.layers[1]] {
            let (Some(a), pipec_plan::model::Op::Linear { in_features: dim, out_features: vocab, .. }) =
                (l.tied, &l.op)
            else {
                continue;
            };
            let table = crate::layers::embedding_values(a, plan.training.seed, *vocab, *dim);
            let weight = crate::layers::transpose(&table, *vocab, *dim);
            let id = crate::layers::pid(l.index, 0);
            let mut weight = Some(weight);
            model = crate::params::set_params(model, |p, _| if p == id { weight.take() } else { None }).0;
        }
        out.insert(
            s.id,
            StageState {
                model: Some(model),
                tp,
                optim: StageOptim::new(&plan.training.optimizer),
                acc: Vec::new(),
                contributions: 0,
                forward_stats: HashMap::new(),
                stats: None,
                stats_count: 0.0,
                stash: HashMap::new(),
                versions: Vec::new(),
            },
        );
    }
    Ok(out)
}
