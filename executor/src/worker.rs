//! The interpreter: one worker per device executes its instruction stream, step after step,
//! with an exhaustive `match` on the instruction set. Nothing runs that the plan does not say.

use std::collections::HashMap;
use std::time::Instant;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{decay::WeightDecayConfig, Adam, AdamConfig, GradientsParams, Optimizer, Sgd, SgdConfig};
use burn::prelude::*;
use burn::tensor::activation;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ElementConversion;
use pipec_plan::model::Loss;
use pipec_plan::plan::OptimizerPlan;
use pipec_plan::{DeviceId, Instr, MicrobatchId, Plan, StageId};

use crate::data::{Dataset, Inputs, Targets};
use crate::layers::{Act, StageModel};
use pipec_plan::ReduceMode;

use crate::transport::{Endpoint, Message, Tag};

/// Everything a worker reports about one step.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    pub device: DeviceId,
    pub step: usize,
    /// (microbatch, loss) for every microbatch whose loss this device computed.
    pub losses: Vec<(u32, f32)>,
    /// (instruction index, start s, end s) from the step's start.
    pub trace: Vec<(usize, f64, f64)>,
    pub step_seconds: f64,
    /// Peak microbatches kept for the backward at once, per stage.
    pub peak_in_flight: HashMap<StageId, u32>,
    /// Peak weight versions alive at once (live + stashed), per stage.
    pub peak_versions: HashMap<StageId, u32>,
}

/// A stage's trainable state on a device.
pub(crate) struct StageState<B: AutodiffBackend> {
    pub model: Option<StageModel<B>>,
    /// Tensor parallelism: this device's rank, the group, and the parameters whose
    /// gradients are partial per rank.
    pub tp: Option<TpInfo>,
    pub optim: StageOptim<B>,
    /// Accumulated gradients, one flattened tensor per parameter in visiting order.
    acc: FlatGrads<B>,
    /// Microbatches that contributed to `acc` since the last step.
    contributions: usize,
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

impl<B: AutodiffBackend> StageState<B> {
    /// This device's (rank, group size) in the stage's tensor-parallel group; (0, 1) without.
    pub fn tp_shard(&self) -> (u32, u32) {
        self.tp.as_ref().map_or((0, 1), |t| (t.rank as u32, t.members.len() as u32))
    }
}

/// The optimizer of a stage.
pub(crate) enum StageOptim<B: AutodiffBackend> {
    Sgd(OptimizerAdaptor<Sgd<B::InnerBackend>, StageModel<B>, B>),
    Adam(OptimizerAdaptor<Adam, StageModel<B>, B>),
}

impl<B: AutodiffBackend> StageOptim<B> {
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
}

struct Collect<'a, B: AutodiffBackend> {
    grads: &'a mut B::Gradients,
    out: FlatGrads<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let g = param.val().grad_remove(self.grads).map(|g| {
            let n = g.shape().num_elements();
            g.reshape([n])
        });
        self.out.push(g);
    }
}

struct Register<'a, B: AutodiffBackend> {
    flat: &'a [Option<Tensor<B::InnerBackend, 1>>],
    scale: f64,
    next: usize,
    out: GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Register<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(Some(g)) = self.flat.get(self.next) {
            let shaped: Tensor<B::InnerBackend, D> = g.clone().reshape(param.shape());
            let shaped = if self.scale == 1.0 { shaped } else { shaped * self.scale };
            self.out.register::<B::InnerBackend, D>(param.id, shaped);
        }
        self.next += 1;
    }
}

/// One parameter: its id, shape and values.
pub(crate) type ParamValue = (ParamId, Vec<usize>, Vec<f32>);

/// Parameter ids and values of a model, in visiting order (for checkpoints); the first
/// parameter whose values could not be read back is an error, never an empty tensor.
pub(crate) struct Snapshot<B: Backend> {
    pub params: Vec<ParamValue>,
    error: Option<String>,
    _b: std::marker::PhantomData<B>,
}

impl<B: Backend> ModuleVisitor<B> for Snapshot<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        match host_f32(t.clone().into_data()) {
            Ok(values) => self.params.push((param.id, t.dims().to_vec(), values)),
            Err(e) => {
                self.error.get_or_insert_with(|| format!("parameter {}: {e}", param.id));
            }
        }
    }
}

pub(crate) fn snapshot<B: Backend, M: Module<B>>(m: &M) -> Result<Vec<ParamValue>, String> {
    let mut s = Snapshot::<B> { params: Vec::new(), error: None, _b: std::marker::PhantomData };
    m.visit(&mut s);
    match s.error {
        Some(e) => Err(e),
        None => Ok(s.params),
    }
}

/// A worker: one device, its stages, its stream.
pub(crate) struct Worker<'a, B: AutodiffBackend, E: Endpoint> {
    pub device: DeviceId,
    pub plan: &'a Plan,
    pub stream: &'a [Instr],
    pub data: &'a Dataset,
    pub ep: E,
    pub dev: B::Device,
    pub stages: HashMap<StageId, StageState<B>>,
    pub reduce: ReduceMode,
    // per-step buffers
    inputs: HashMap<(StageId, MicrobatchId), Act<B>>,
    labels: HashMap<MicrobatchId, Targets>,
    saved: HashMap<(StageId, MicrobatchId), Kept<B>>,
    outputs: HashMap<(StageId, MicrobatchId), Message>,
    grads_in: HashMap<(StageId, MicrobatchId), Message>,
    input_grads: HashMap<(StageId, MicrobatchId), Message>,
    pending_weight_grads: HashMap<(StageId, MicrobatchId), FlatGrads<B>>,
    in_flight: HashMap<StageId, u32>,
}

/// A stage's weight gradients, one flat tensor per parameter (None: no gradient yet).
type FlatGrads<B> = Vec<Option<Tensor<<B as AutodiffBackend>::InnerBackend, 1>>>;

/// What a forward keeps for its microbatch's backward: the stage input (detached under
/// recompute), what the backward starts from, and the weights the forward used.
struct Kept<B: AutodiffBackend> {
    input: Act<B>,
    saved: Saved<B>,
    model: StageModel<B>,
}

/// A copy of a stage's weights that is a fresh autodiff leaf: every microbatch's forward
/// builds its own graph on its own copy (sharing the weights' storage, not their graph
/// nodes). Burn 0.21's graph memory management loses the input gradient of one microbatch
/// when several microbatch graphs share the weight nodes and are back-propagated one by one
/// (reproduced single-threaded; see ARCHITECTURE.md). The copy is also exactly what
/// weight stashing needs: the backward differentiates at the weights the forward used.
struct FreshLeaves;

impl<B: AutodiffBackend> ModuleMapper<B> for FreshLeaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, _) = param.consume();
        Param::initialized(id, tensor.detach().require_grad())
    }
}

fn microbatch_copy<B: AutodiffBackend>(model: &StageModel<B>) -> StageModel<B> {
    model.clone().map(&mut FreshLeaves)
}

/// What a forward kept for its backward.
enum Saved<B: AutodiffBackend> {
    /// The stage output (tracked).
    Output(Act<B>),
    /// The last stage's scaled loss (tracked) and its unscaled value.
    Loss(Tensor<B, 1>),
    /// Activation recompute: only the input is kept; the recompute fills this in.
    Nothing,
    /// A tensor-parallel stage: its forward segments, and (last stage) the loss computed
    /// on a leaf copy of the output.
    Tp(Vec<crate::tensor_parallel::Segment<B>>, Option<(Act<B>, Tensor<B, 1>)>),
}

fn host_to_act<B: Backend>(shape: &[usize], data: Vec<f32>, dev: &B::Device) -> Result<Act<B>, String> {
    let td = TensorData::new(data, shape.to_vec());
    Ok(match shape.len() {
        2 => Act::D2(Tensor::from_data(td, dev)),
        3 => Act::D3(Tensor::from_data(td, dev)),
        4 => Act::D4(Tensor::from_data(td, dev)),
        n => return Err(format!("cannot carry a rank-{n} activation")),
    })
}

/// The message a point-to-point instruction sends or receives (the plan's identity, the
/// same at both ends); an activation received by the first stage has none.
fn expected_message(ins: &Instr) -> Result<Tag, String> {
    ins.transfer().and_then(|t| t.id).ok_or_else(|| format!("`{ins}` names a message no stage sends"))
}

fn act_to_message<B: Backend>(a: &Act<B>, tag: Tag) -> Result<Message, String> {
    let data = match a {
        Act::D2(t) => t.clone().into_data(),
        Act::D3(t) => t.clone().into_data(),
        Act::D4(t) => t.clone().into_data(),
        Act::Tokens(_) => return Err("token ids cannot cross a stage boundary".into()),
    };
    let shape = data.shape.clone();
    let data = host_f32(data)?;
    Ok(Message { tag, shape: shape.to_vec(), data })
}

pub(crate) fn require_grad<B: AutodiffBackend>(a: Act<B>) -> Act<B> {
    match a {
        Act::D2(t) => Act::D2(t.require_grad()),
        Act::D3(t) => Act::D3(t.require_grad()),
        Act::D4(t) => Act::D4(t.require_grad()),
        other => other,
    }
}

fn detach<B: AutodiffBackend>(a: &Act<B>) -> Act<B> {
    match a {
        Act::D2(t) => Act::D2(t.clone().detach()),
        Act::D3(t) => Act::D3(t.clone().detach()),
        Act::D4(t) => Act::D4(t.clone().detach()),
        Act::Tokens(t) => Act::Tokens(t.clone()),
    }
}

/// Σ(out ⊙ g): back-propagating it injects the received gradient `g` at the output.
fn dot_with<B: AutodiffBackend>(out: &Act<B>, g: &Message, dev: &B::Device) -> Result<Tensor<B, 1>, String> {
    let grad = host_to_act::<B>(&g.shape, g.data.clone(), dev)?;
    Ok(match (out, grad) {
        (Act::D2(o), Act::D2(g)) => (o.clone() * g).sum(),
        (Act::D3(o), Act::D3(g)) => (o.clone() * g).sum(),
        (Act::D4(o), Act::D4(g)) => (o.clone() * g).sum(),
        (o, g) => return Err(format!("gradient of shape {:?} does not fit the output {:?}", g.dims(), o.dims())),
    })
}

fn input_grad<B: AutodiffBackend>(x: &Act<B>, grads: &mut B::Gradients, tag: Tag) -> Result<Option<Message>, String> {
    let g = match x {
        Act::D2(t) => t.grad_remove(grads).map(|g| g.into_data()),
        Act::D3(t) => t.grad_remove(grads).map(|g| g.into_data()),
        Act::D4(t) => t.grad_remove(grads).map(|g| g.into_data()),
        Act::Tokens(_) => None,
    };
    match g {
        None => Ok(None),
        Some(d) => {
            let shape = d.shape.to_vec();
            Ok(Some(Message { tag, shape, data: host_f32(d)? }))
        }
    }
}

impl<'a, B: AutodiffBackend, E: Endpoint> Worker<'a, B, E> {
    // the worker's parts, each one of the run's: a struct of them would only be unpacked here
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        device: DeviceId,
        plan: &'a Plan,
        stream: &'a [Instr],
        data: &'a Dataset,
        ep: E,
        dev: B::Device,
        stages: HashMap<StageId, StageState<B>>,
        reduce: ReduceMode,
    ) -> Self {
        Worker {
            device,
            plan,
            stream,
            data,
            ep,
            dev,
            stages,
            reduce,
            inputs: HashMap::new(),
            labels: HashMap::new(),
            saved: HashMap::new(),
            outputs: HashMap::new(),
            grads_in: HashMap::new(),
            input_grads: HashMap::new(),
            pending_weight_grads: HashMap::new(),
            in_flight: HashMap::new(),
        }
    }

    /// The forward of a tensor-parallel stage (see `tensor_parallel`), all-reducing over the
    /// group where Megatron does; on the last stage also the loss, on a leaf copy of the
    /// output.
    #[allow(clippy::type_complexity)]
    fn forward_tp(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        model: &StageModel<B>,
        x: Act<B>,
        key: (u64, u64, u64),
    ) -> Result<(Vec<crate::tensor_parallel::Segment<B>>, Option<(Act<B>, Tensor<B, 1>)>), String> {
        let tp = self.state(stage)?.tp.clone().ok_or("not tensor-parallel")?;
        let reduce = self.reduce;
        let ep = &mut self.ep;
        let mut sum = |mut v: Vec<f32>| -> Result<Vec<f32>, String> {
            ep.all_reduce(&tp.members, &mut v, reduce).map_err(|e| e.to_string())?;
            Ok(v)
        };
        let segments = crate::tensor_parallel::forward(model, x, true, key, &mut sum)?;
        let loss = if stage == self.last_stage() {
            let out = segments.last().map(|s| s.out.clone()).ok_or("no segments")?;
            let y = self.labels.get(&mb).ok_or("the labels of this microbatch were not loaded")?;
            let leaf = crate::tensor_parallel::fresh(&out);
            let loss = loss_of::<B>(self.plan.model.loss, leaf.clone(), y, &self.dev)?;
            Some((leaf, loss))
        } else {
            None
        };
        Ok((segments, loss))
    }

    /// The backward of a tensor-parallel stage, segment by segment (see
    /// `tensor_parallel`); returns the weight gradients and leaves the input gradient to send.
    fn backward_tp(&mut self, stage: StageId, mb: MicrobatchId, n_mb: f64) -> Result<FlatGrads<B>, String> {
        use crate::tensor_parallel::Boundary;
        let tp = self.state(stage)?.tp.clone().ok_or("not tensor-parallel")?;
        let size = tp.members.len() as f32;
        let reduce = self.reduce;
        let Kept { saved, model: used, .. } =
            self.saved.get(&(stage, mb)).ok_or("its forward's activations are missing")?;
        let Saved::Tp(segments, loss) = saved else { return Err("not a tensor-parallel forward".into()) };
        // clones share the forward's autodiff nodes, so gradients are found by them
        let (segments, loss, used) = (segments.clone(), loss.clone(), used.clone());
        // the gradient at the last segment's output
        let mut grad_out: Message = match loss {
            Some((leaf, l)) => {
                let mut grads = (l / n_mb).backward();
                input_grad::<B>(&leaf, &mut grads, Tag::gradient(stage, mb))?
                    .ok_or("no gradient reached the loss input")?
            }
            None => self.grads_in.remove(&(stage, mb)).ok_or("the gradient of its output was not received")?,
        };
        let mut flat: FlatGrads<B> = Vec::new();
        for (k, seg) in segments.iter().enumerate().rev() {
            let mut grads = dot_with::<B>(&seg.out, &grad_out, &self.dev)?.backward();
            let mut c = Collect::<B> { grads: &mut grads, out: Vec::new() };
            used.visit(&mut c);
            accumulate::<B>(&mut flat, c.out);
            if k == 0 && stage.0 == 0 {
                break;
            }
            let mut g = input_grad::<B>(&seg.leaf, &mut grads, Tag::gradient(stage, mb))?
                .ok_or("no gradient reached a segment input")?;
            match seg.boundary {
                Boundary::Complete => {}
                Boundary::Sum => self.ep.all_reduce(&tp.members, &mut g.data, reduce).map_err(|e| e.to_string())?,
                Boundary::SumResidual => {
                    self.ep.all_reduce(&tp.members, &mut g.data, reduce).map_err(|e| e.to_string())?;
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

    /// Sums, over the tensor-parallel group, the gradients that are partial on each rank.
    fn sum_partial_gradients(&mut self, stage: StageId) -> Result<(), String> {
        let Some(tp) = self.state(stage)?.tp.clone() else { return Ok(()) };
        if tp.partial_ids.is_empty() {
            return Ok(());
        }
        let reduce = self.reduce;
        let dev = self.dev.clone();
        let st = self.stages.get_mut(&stage).ok_or("no stage")?;
        let model = st.model.as_ref().ok_or("no model")?;
        let mut ids = Ids(Vec::new());
        model.visit(&mut ids);
        for (i, id) in ids.0.iter().enumerate() {
            if !tp.partial_ids.contains(id) {
                continue;
            }
            let Some(Some(t)) = st.acc.get(i) else { continue };
            let n = t.dims()[0];
            let mut v = host_f32(t.clone().into_data())?;
            self.ep.all_reduce(&tp.members, &mut v, reduce).map_err(|e| e.to_string())?;
            st.acc[i] = Some(Tensor::from_data(TensorData::new(v, [n]), &dev));
        }
        Ok(())
    }

    fn last_stage(&self) -> StageId {
        StageId(self.plan.stages.len().saturating_sub(1) as u32)
    }

    fn state(&mut self, s: StageId) -> Result<&mut StageState<B>, String> {
        self.stages.get_mut(&s).ok_or_else(|| format!("{} does not hold {s}", self.device))
    }

    /// Runs one step of the stream. On failure: the instruction index and the message.
    pub fn step(&mut self, step: usize) -> Result<StepReport, (usize, String)> {
        let start = Instant::now();
        let mut report = StepReport { device: self.device, step, ..Default::default() };
        for st in self.stages.values_mut() {
            st.versions = st.model.iter().cloned().collect();
        }
        let mut versions: HashMap<StageId, u32> = HashMap::new();
        for (index, ins) in self.stream.iter().enumerate() {
            let t0 = start.elapsed().as_secs_f64();
            self.exec(step, ins, &mut report).map_err(|e| (index, e))?;
            let t1 = start.elapsed().as_secs_f64();
            report.trace.push((index, t0, t1));
            for (s, n) in &self.in_flight {
                let p = report.peak_in_flight.entry(*s).or_insert(0);
                *p = (*p).max(*n);
            }
            for (s, st) in &self.stages {
                let v = versions.entry(*s).or_insert(0);
                *v = (*v).max(1 + st.stash.len() as u32);
            }
        }
        if !self.saved.is_empty() || !self.outputs.is_empty() || !self.input_grads.is_empty() {
            return Err((self.stream.len(), "buffers left over at the end of the step".into()));
        }
        report.peak_versions = versions;
        report.step_seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }

    fn exec(&mut self, step: usize, ins: &Instr, report: &mut StepReport) -> Result<(), String> {
        let t = &self.plan.training;
        let n_mb = t.microbatches as f64;
        match *ins {
            Instr::LoadMicrobatch { stage, mb, inputs, labels } => {
                let (x, y) = self.data.microbatch(step, mb.0 as usize, t.microbatch_size, t.batch_size);
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
            }
            Instr::RecvActivation { peer, stage, mb, .. } => {
                let msg = self.ep.recv(peer, expected_message(ins)?).map_err(|e| e.to_string())?;
                let act = require_grad(host_to_act::<B>(&msg.shape, msg.data, &self.dev)?);
                self.inputs.insert((stage, mb), act);
            }
            Instr::Forward { stage, mb } => {
                let x = self.inputs.remove(&(stage, mb)).ok_or("its input is missing")?;
                let key = (self.plan.training.seed, step as u64, u64::from(mb.0));
                let recompute = self.plan.training.recompute;
                let is_last = stage == self.last_stage();
                let st = self.state(stage)?;
                // the stashed weights when the plan stashed them (vertical sync may pick an
                // older version than the current one), else the current weights
                let base = match st.stash.get(&mb) {
                    Some(m) => m,
                    None => st.model.as_ref().ok_or("no model")?,
                };
                let model = microbatch_copy(base);
                if self.state(stage)?.tp.is_some() {
                    let (segments, loss) = self.forward_tp(stage, mb, &model, x.clone(), key)?;
                    if let Some((_, l)) = &loss {
                        if self.state(stage)?.tp_shard().0 == 0 {
                            report.losses.push((mb.0, l.clone().into_scalar().elem::<f32>()));
                        }
                    } else {
                        let out = segments.last().map(|s| s.out.clone()).ok_or("no segments")?;
                        self.outputs.insert((stage, mb), act_to_message(&out, Tag::activation(stage, mb))?);
                    }
                    // with recompute only the input is kept (the last stage keeps its loss,
                    // as without tensor parallelism); the group re-runs the forward, its
                    // all-reduces included, at `Recompute`
                    let saved = if recompute && !is_last {
                        Kept { input: detach(&x), saved: Saved::Nothing, model }
                    } else {
                        Kept { input: x, saved: Saved::Tp(segments, loss), model }
                    };
                    self.saved.insert((stage, mb), saved);
                    *self.in_flight.entry(stage).or_insert(0) += 1;
                    return Ok(());
                }
                let out = model.forward(x.clone(), true, key)?;
                let saved = if is_last {
                    let y = self.labels.get(&mb).ok_or("the labels of this microbatch were not loaded")?;
                    let loss = loss_of::<B>(self.plan.model.loss, out, y, &self.dev)?;
                    report.losses.push((mb.0, loss.clone().into_scalar().elem::<f32>()));
                    Saved::Loss(loss)
                } else {
                    self.outputs.insert((stage, mb), act_to_message(&out, Tag::activation(stage, mb))?);
                    if recompute {
                        Saved::Nothing
                    } else {
                        Saved::Output(out)
                    }
                };
                let x = if recompute { detach(&x) } else { x };
                self.saved.insert((stage, mb), Kept { input: x, saved, model });
                *self.in_flight.entry(stage).or_insert(0) += 1;
            }
            Instr::Recompute { stage, mb } => {
                let Kept { input: x, model, .. } =
                    self.saved.remove(&(stage, mb)).ok_or("nothing kept for this microbatch")?;
                let x = if stage.0 == 0 { x } else { require_grad(x) };
                let key = (self.plan.training.seed, step as u64, u64::from(mb.0));
                // the weights the forward used (not the newest, if an update came between)
                let model = microbatch_copy(&model);
                if self.state(stage)?.tp.is_some() {
                    let (segments, loss) = self.forward_tp(stage, mb, &model, x.clone(), key)?;
                    self.saved.insert((stage, mb), Kept { input: x, saved: Saved::Tp(segments, loss), model });
                    return Ok(());
                }
                let out = model.forward(x.clone(), true, key)?;
                let saved = if stage == self.last_stage() {
                    let y = self.labels.get(&mb).ok_or("labels missing")?;
                    Saved::Loss(loss_of::<B>(self.plan.model.loss, out, y, &self.dev)?)
                } else {
                    Saved::Output(out)
                };
                self.saved.insert((stage, mb), Kept { input: x, saved, model });
            }
            Instr::Backward { stage, mb } | Instr::BackwardInput { stage, mb } => {
                if let Some(Kept { saved: Saved::Tp(..), .. }) = self.saved.get(&(stage, mb)) {
                    let flat = self.backward_tp(stage, mb, n_mb)?;
                    let st = self.state(stage)?;
                    if matches!(ins, Instr::Backward { .. }) {
                        accumulate::<B>(&mut st.acc, flat);
                        st.contributions += 1;
                        st.stash.remove(&mb);
                    } else {
                        self.pending_weight_grads.insert((stage, mb), flat);
                    }
                    return Ok(());
                }
                let Kept { input: x, saved, model: used } =
                    self.saved.get(&(stage, mb)).ok_or("its forward's activations are missing")?;
                let target = match saved {
                    Saved::Loss(l) => l.clone() / n_mb,
                    Saved::Output(out) => {
                        let g =
                            self.grads_in.remove(&(stage, mb)).ok_or("the gradient of its output was not received")?;
                        dot_with::<B>(out, &g, &self.dev)?
                    }
                    Saved::Nothing => return Err("recompute was not run before the backward".into()),
                    Saved::Tp(..) => return Err("tensor-parallel stage".into()),
                };
                let mut grads = target.backward();
                if stage.0 > 0 {
                    let g = input_grad::<B>(x, &mut grads, Tag::gradient(stage, mb))?
                        .ok_or("no gradient reached the stage input")?;
                    self.input_grads.insert((stage, mb), g);
                }
                let mut c = Collect::<B> { grads: &mut grads, out: Vec::new() };
                used.visit(&mut c);
                let flat = c.out;
                if matches!(ins, Instr::Backward { .. }) {
                    let st = self.state(stage)?;
                    accumulate::<B>(&mut st.acc, flat);
                    st.contributions += 1;
                    st.stash.remove(&mb);
                } else {
                    // Burn's autodiff computes input and weight gradients in one pass; the
                    // weight part is applied when the plan's BackwardWeight comes.
                    self.pending_weight_grads.insert((stage, mb), flat);
                }
            }
            Instr::BackwardWeight { stage, mb } => {
                let flat =
                    self.pending_weight_grads.remove(&(stage, mb)).ok_or("the input-gradient pass did not run")?;
                let st = self.state(stage)?;
                accumulate::<B>(&mut st.acc, flat);
                st.contributions += 1;
            }
            Instr::Free { stage, mb } => {
                self.saved.remove(&(stage, mb)).ok_or("nothing to free")?;
                if let Some(c) = self.in_flight.get_mut(&stage) {
                    *c = c.saturating_sub(1);
                }
            }
            Instr::SendActivation { peer, stage, mb, .. } => {
                let msg = self.outputs.remove(&(stage, mb)).ok_or("the activation to send was not computed")?;
                self.ep.send(peer, msg).map_err(|e| e.to_string())?;
            }
            Instr::RecvGradient { peer, stage, mb, .. } => {
                let msg = self.ep.recv(peer, expected_message(ins)?).map_err(|e| e.to_string())?;
                self.grads_in.insert((stage, mb), msg);
            }
            Instr::SendGradient { peer, stage, mb, .. } => {
                let msg = self.input_grads.remove(&(stage, mb)).ok_or("the gradient to send was not computed")?;
                self.ep.send(peer, msg).map_err(|e| e.to_string())?;
            }
            Instr::AllReduce { stage, group, .. } => {
                let members = self
                    .plan
                    .groups
                    .iter()
                    .find(|g| g.id == group)
                    .map(|g| g.devices.clone())
                    .ok_or("unknown group")?;
                let reduce = self.reduce;
                let dev = self.dev.clone();
                let st = self.state(stage)?;
                let sizes: Vec<usize> = st.acc.iter().map(|g| g.as_ref().map(|t| t.dims()[0]).unwrap_or(0)).collect();
                let mut flat = flatten_grads::<B>(&st.acc)?;
                self.ep.all_reduce(&members, &mut flat, reduce).map_err(|e| e.to_string())?;
                let st = self.state(stage)?;
                let mut offset = 0;
                for (g, n) in st.acc.iter_mut().zip(sizes) {
                    if let Some(t) = g {
                        *t = Tensor::from_data(TensorData::new(flat[offset..offset + n].to_vec(), [n]), &dev);
                        offset += n;
                    }
                }
                st.contributions *= members.len();
            }
            Instr::StashWeights { stage, mb, version } => {
                let st = self.state(stage)?;
                let m = match version {
                    None => st.model.as_ref().ok_or("no model")?.clone(),
                    Some(v) => st.versions.get(v as usize).cloned().ok_or_else(|| {
                        format!("weight version {v} does not exist yet ({} so far)", st.versions.len())
                    })?,
                };
                st.stash.insert(mb, m);
            }
            Instr::RestoreWeights { stage, mb } => {
                // Burn's autodiff graph holds the exact weight tensors the forward used, so
                // the backward already differentiates at the stashed version; the stash is
                // what keeps that version alive (and counted) until then.
                let st = self.state(stage)?;
                if !st.stash.contains_key(&mb) {
                    return Err("no weights were stashed for this microbatch".into());
                }
            }
            Instr::PushGradient { peer, stage, .. } => {
                let st = self.state(stage)?;
                if st.contributions != 1 {
                    return Err(format!("{} microbatch gradients to push, expected one", st.contributions));
                }
                let flat = flatten_grads::<B>(&st.acc)?;
                st.acc.iter_mut().for_each(|g| *g = None);
                st.contributions = 0;
                let n = flat.len();
                self.ep
                    .send(peer, Message { tag: expected_message(ins)?, shape: vec![n], data: flat })
                    .map_err(|e| e.to_string())?;
            }
            Instr::ApplyGradient { peer, stage, .. } => {
                let msg = self.ep.recv(peer, expected_message(ins)?).map_err(|e| e.to_string())?;
                let lr = match self.plan.training.optimizer {
                    OptimizerPlan::Sgd { lr, .. } | OptimizerPlan::Adam { lr, .. } => lr,
                };
                let dev = self.dev.clone();
                let st = self.state(stage)?;
                let model = st.model.take().ok_or("no model")?;
                let mut sizes = Sizes(Vec::new());
                model.visit(&mut sizes);
                if sizes.0.iter().sum::<usize>() != msg.data.len() {
                    st.model = Some(model);
                    return Err(format!(
                        "a gradient of {} values for a stage of {} parameters",
                        msg.data.len(),
                        sizes.0.iter().sum::<usize>()
                    ));
                }
                let mut offset = 0;
                let flat: FlatGrads<B> = sizes
                    .0
                    .iter()
                    .map(|&n| {
                        let t = Tensor::from_data(TensorData::new(msg.data[offset..offset + n].to_vec(), [n]), &dev);
                        offset += n;
                        Some(t)
                    })
                    .collect();
                // one microbatch's gradient (its loss was scaled by 1/N): the update uses its mean
                let mut reg = Register::<B> { flat: &flat, scale: n_mb, next: 0, out: GradientsParams::new() };
                model.visit(&mut reg);
                let grads = reg.out;
                st.model = Some(st.optim.step(lr, model, grads));
            }
            Instr::PushWeights { peer, stage, .. } => {
                let st = self.state(stage)?;
                let model = st.model.as_ref().ok_or("no model")?;
                let values: Vec<f32> = snapshot::<B, _>(model)?.into_iter().flat_map(|(_, _, v)| v).collect();
                let n = values.len();
                self.ep
                    .send(peer, Message { tag: expected_message(ins)?, shape: vec![n], data: values })
                    .map_err(|e| e.to_string())?;
            }
            Instr::PullWeights { peer, stage, .. } => {
                let msg = self.ep.recv(peer, expected_message(ins)?).map_err(|e| e.to_string())?;
                let st = self.state(stage)?;
                let model = st.model.take().ok_or("no model")?;
                let mut loader = LoadFlat { values: &msg.data, offset: 0, ok: true };
                let model = model.map(&mut loader);
                let complete = loader.ok && loader.offset == msg.data.len();
                st.model = Some(model);
                if !complete {
                    return Err("the pulled weights do not fit the stage".into());
                }
            }
            Instr::OptimizerStep { stage } => {
                let lr = match self.plan.training.optimizer {
                    OptimizerPlan::Sgd { lr, .. } | OptimizerPlan::Adam { lr, .. } => lr,
                };
                self.sum_partial_gradients(stage)?;
                let st = self.state(stage)?;
                // Gradients are sums of per-microbatch means scaled by 1/N; an update made
                // from fewer microbatches (PipeDream) rescales to their mean.
                let scale = if st.contributions > 0 { n_mb / st.contributions as f64 } else { 1.0 };
                let model = st.model.take().ok_or("no model")?;
                let mut reg = Register::<B> { flat: &st.acc, scale, next: 0, out: GradientsParams::new() };
                model.visit(&mut reg);
                let grads = reg.out;
                st.model = Some(st.optim.step(lr, model, grads));
                st.acc.iter_mut().for_each(|g| *g = None);
                st.contributions = 0;
                if let Some(m) = st.model.clone() {
                    st.versions.push(m);
                }
            }
        }
        Ok(())
    }
}

/// Replaces a model's parameters, in visiting order, with values from a flat vector.
struct LoadFlat<'a> {
    values: &'a [f32],
    offset: usize,
    ok: bool,
}

impl<B: AutodiffBackend> ModuleMapper<B> for LoadFlat<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, _) = param.consume();
        let shape = tensor.dims();
        let n: usize = shape.iter().product();
        match self.values.get(self.offset..self.offset + n) {
            Some(v) => {
                self.offset += n;
                let t = Tensor::<B, D>::from_data(TensorData::new(v.to_vec(), shape.to_vec()), &tensor.device())
                    .require_grad();
                Param::initialized(id, t)
            }
            None => {
                self.ok = false;
                Param::initialized(id, tensor)
            }
        }
    }
}

/// Every parameter's id, in visiting order.
struct Ids(Vec<u64>);

impl<B: AutodiffBackend> ModuleVisitor<B> for Ids {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.id.val());
    }
}

/// Every parameter's element count, in visiting order.
struct Sizes(Vec<usize>);

impl<B: AutodiffBackend> ModuleVisitor<B> for Sizes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.shape().num_elements());
    }
}

/// A tensor's values on the host as f32 (what crosses a stage boundary or a collective).
pub(crate) fn host_f32(data: TensorData) -> Result<Vec<f32>, String> {
    data.convert::<f32>().into_vec::<f32>().map_err(|e| format!("cannot read a tensor back: {e:?}"))
}

/// The present gradients of `acc`, concatenated in parameter order (what an all-reduce or a
/// push to the parameter server moves).
fn flatten_grads<B: AutodiffBackend>(acc: &[Option<Tensor<B::InnerBackend, 1>>]) -> Result<Vec<f32>, String> {
    let mut flat = Vec::new();
    for t in acc.iter().flatten() {
        flat.extend(host_f32(t.clone().into_data())?);
    }
    Ok(flat)
}

fn accumulate<B: AutodiffBackend>(acc: &mut FlatGrads<B>, flat: FlatGrads<B>) {
    if acc.len() < flat.len() {
        acc.resize(flat.len(), None);
    }
    for (a, g) in acc.iter_mut().zip(flat) {
        *a = match (a.take(), g) {
            (Some(x), Some(y)) => Some(x + y),
            (x, None) => x,
            (None, y) => y,
        };
    }
}

/// The mean loss of a microbatch (tracked).
fn loss_of<B: AutodiffBackend>(loss: Loss, out: Act<B>, y: &Targets, dev: &B::Device) -> Result<Tensor<B, 1>, String> {
    let Act::D2(logits) = out else {
        return Err(format!("the loss needs a [batch, outputs] output, got {:?}", out.dims()));
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
        _ => Err("the targets do not fit the loss".into()),
    }
}

/// Builds the state of the stages a device holds.
pub(crate) fn build_stages<B: AutodiffBackend>(
    plan: &Plan,
    device: DeviceId,
    dev: &B::Device,
) -> Result<HashMap<StageId, StageState<B>>, String> {
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
            _ => (StageModel::<B>::new(&ops, s.layers[0], plan.training.seed, dev), None),
        };
        out.insert(
            s.id,
            StageState {
                model: Some(model),
                tp,
                optim: StageOptim::new(&plan.training.optimizer),
                acc: Vec::new(),
                contributions: 0,
                stash: HashMap::new(),
                versions: Vec::new(),
            },
        );
    }
    Ok(out)
}
