//! pipec's executor: trains a compiled plan for real on Burn by interpreting every device's
//! instruction stream, one worker thread per device (or one MPI rank per device, through the
//! same [`transport::Endpoint`] trait). The only crate of pipec that links Burn.

pub use pipec_plan::checkpoint;
mod collectives;
pub mod comm;
mod compute;
pub mod data;
pub mod dense;
pub mod error;
mod flex_gemm;
mod flex_weights;
pub mod gpus;
pub mod layers;
#[cfg(feature = "mpi")]
pub mod mpi_run;
#[cfg(feature = "mpi")]
mod mpi_send;
#[cfg(feature = "mpi")]
pub mod mpi_transport;
mod params;
pub mod profile;
mod reshard;
pub mod rng;
mod stage;
pub mod tensor_parallel;
pub mod transport;
mod values;
mod worker;

use std::collections::{BTreeMap, HashMap};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dense::ExecBackend;
use burn::module::ParamId;
use pipec_plan::model::Op;
use pipec_plan::{DeviceId, Plan, StageId};

use crate::data::Dataset;
use crate::error::ExecError;
use crate::stage::{build_stages, StageState};
use crate::transport::Endpoint;
use crate::worker::{StepReport, Worker};

pub use worker::StepReport as WorkerStep;

/// Which Burn backend runs the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// Burn's `flex` CPU backend (pure Rust, nothing to install).
    Cpu,
    /// Burn's CUDA backend (cargo feature `cuda`).
    Cuda,
}

/// The start of the line rank 0 of an MPI job prints once every rank has started (`pipec
/// launch --exec` bounds the start-up until it comes).
pub const MPI_STARTED: &str = "mpi: started all";

/// The checkpoint a run resumes from.
#[derive(Debug, Clone)]
pub enum Resume {
    /// A step directory, or a directory with `latest`: read when the run starts.
    Dir(PathBuf),
    /// Already read and verified (`pipec run` reads it before it writes anything, so a
    /// checkpoint that does not load leaves the output folder as it was).
    Loaded(Arc<checkpoint::Loaded>),
}

impl From<PathBuf> for Resume {
    fn from(dir: PathBuf) -> Self {
        Resume::Dir(dir)
    }
}

impl Resume {
    /// Reads and verifies the checkpoint (once).
    pub fn load(&self) -> Result<Arc<checkpoint::Loaded>, String> {
        match self {
            Resume::Dir(p) => Ok(Arc::new(checkpoint::read(&checkpoint::locate(p)?)?)),
            Resume::Loaded(l) => Ok(l.clone()),
        }
    }
}

/// How to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Steps to run (default: the plan's).
    pub steps: Option<usize>,
    pub backend: BackendKind,
    /// How long a receive may wait before the run is declared stuck.
    pub timeout: Duration,
    /// Checkpoint directory (checkpoints are written when the plan asks for them).
    pub checkpoint_dir: Option<PathBuf>,
    /// Resume from this checkpoint.
    pub resume: Option<Resume>,
    /// Let several plan devices share one GPU when there are fewer GPUs than devices.
    pub share_gpus: bool,
    /// Set (by a SIGINT/SIGTERM handler) to stop at the next step boundary every worker
    /// agrees on; the run then returns what it trained with `RunReport::interrupted`.
    pub stop: Option<Arc<AtomicBool>>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            steps: None,
            backend: BackendKind::Cpu,
            timeout: Duration::from_secs(120),
            checkpoint_dir: None,
            resume: None,
            share_gpus: false,
            stop: None,
        }
    }
}

/// The CPU backend with autodiff.
pub type CpuBackend = burn::backend::Autodiff<burn::backend::Flex>;

/// What one training step measured.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    pub step: usize,
    /// Mean loss over the step's microbatches.
    pub loss: f64,
    /// Sum and count of the microbatch losses this process saw (for combining ranks).
    pub loss_sum: f64,
    pub loss_count: usize,
    pub step_seconds: f64,
    pub samples_per_s: f64,
    /// A language model's perplexity, exp(loss) (the loss is the mean next-token
    /// cross-entropy in nats).
    pub perplexity: Option<f64>,
}

/// Whether the plan trains a language model (token ids in, [sequence, vocab] scores out,
/// cross-entropy with the next token).
pub fn is_language_model(plan: &Plan) -> bool {
    let out = plan.layers.last().map(|l| l.output_shape.as_slice()).unwrap_or_default();
    plan.model.loss == pipec_plan::Loss::CrossEntropy
        && pipec_plan::model::language_model_positions(&plan.model.input, out, plan.model.token_vocab).is_some()
}

/// What a run produced.
#[derive(Debug, Clone, Default)]
pub struct RunReport {
    pub steps: Vec<StepMetrics>,
    /// The last step's measured timeline: (device, instruction index, start s, end s).
    pub trace: Vec<(DeviceId, usize, f64, f64)>,
    /// Every step's measured timeline, from the start of the run: (device, step,
    /// instruction index, start s, end s); at most `TIMELINE_LIMIT` entries.
    pub timeline: Vec<(DeviceId, usize, usize, f64, f64)>,
    /// What each device's communication threads ran, beside its compute, in the same form
    /// (a receive from when it was posted to when its message arrived; an all-reduce while
    /// it was in flight); at most `TIMELINE_LIMIT` entries.
    pub comm_timeline: Vec<(DeviceId, usize, usize, f64, f64)>,
    /// Peak microbatches each device kept for the backward, per stage, over the run.
    pub peak_in_flight: BTreeMap<DeviceId, BTreeMap<StageId, u32>>,
    /// Peak weight versions alive per stage (live + stashed), over the run.
    pub peak_versions: BTreeMap<DeviceId, BTreeMap<StageId, u32>>,
    /// Checkpoints written.
    pub checkpoints: Vec<PathBuf>,
    /// Where each device of this process ran (`cpu`, `GPU 0`, ...).
    pub placement: Vec<(DeviceId, String)>,
    /// The run was stopped (`RunOptions::stop`) before its last step.
    pub interrupted: bool,
}

/// Where the workers of a run stop when asked to: a step boundary that no worker has
/// passed. Workers ask before each step, under one lock, so all of them run the same
/// steps: every step some worker has begun is finished by all, and none begins a later one.
/// A flush-free pipeline (PipeDream, 2BW) must end on a step that drains it, and a worker
/// that has already begun a step began it without draining; there the run stops one step
/// later, and that last step drains (its epilogue), so nothing is left in flight.
struct StopGate {
    flag: Option<Arc<AtomicBool>>,
    /// Whether the plan's steps leave microbatches in flight (a flush-free pipeline).
    flush_free: bool,
    /// (the highest step any worker has begun, the step no worker may begin)
    state: std::sync::Mutex<(Option<usize>, Option<usize>)>,
}

/// What a worker about to begin a step is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Begin {
    /// Run the step as planned.
    Run,
    /// Run it and drain the pipeline: it is the last step before a stop.
    RunLast,
    /// Stop before it.
    Stop,
}

impl StopGate {
    fn new(flag: Option<Arc<AtomicBool>>, flush_free: bool) -> Self {
        StopGate { flag, flush_free, state: std::sync::Mutex::new((None, None)) }
    }

    /// Whether a worker may begin `step`, and whether it is the last.
    fn begin(&self, step: usize) -> Begin {
        let mut s = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let asked = self.flag.as_ref().is_some_and(|f| f.load(Ordering::Relaxed));
        if asked && s.1.is_none() {
            let extra = usize::from(self.flush_free);
            s.1 = Some(s.0.map_or(step, |begun| begun + 1 + extra));
        }
        match s.1 {
            Some(stop) if step >= stop => return Begin::Stop,
            _ => {}
        }
        s.0 = Some(s.0.map_or(step, |begun| begun.max(step)));
        if s.1 == Some(step + 1) {
            Begin::RunLast
        } else {
            Begin::Run
        }
    }

    fn stopped(&self) -> bool {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).1.is_some()
    }
}

/// Why a run failed: where, and what happened.
#[derive(Debug, Clone, PartialEq)]
pub struct RunError {
    pub device: Option<DeviceId>,
    pub stage: Option<StageId>,
    pub step: Option<usize>,
    pub instruction: Option<String>,
    pub error: ExecError,
}

impl From<ExecError> for RunError {
    fn from(error: ExecError) -> Self {
        RunError { device: None, stage: None, step: None, instruction: None, error }
    }
}

impl RunError {
    /// A run that could not start (MPI, backend, plan version).
    pub(crate) fn setup(message: impl Into<String>) -> Self {
        ExecError::Setup(message.into()).into()
    }
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.device, &self.instruction) {
            (Some(d), Some(i)) => write!(
                f,
                "device {d}{} failed at step {} on `{i}`: {}",
                self.stage.map(|s| format!(" (stage {s})")).unwrap_or_default(),
                self.step.unwrap_or(0),
                self.error
            ),
            (Some(d), None) => write!(f, "device {d} failed: {}", self.error),
            _ => self.error.fmt(f),
        }
    }
}

/// Whether a CUDA device can be used by this build.
pub fn cuda_available() -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        cuda::available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this pipec was built without CUDA support: rebuild with `cargo build --release --features cuda`".into())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    /// Checks for a driver and a device without letting cudarc panic.
    pub fn available() -> Result<(), String> {
        let lib = ["libcuda.so.1", "libcuda.so"].iter().any(|n| {
            std::path::Path::new("/usr/lib/x86_64-linux-gnu").join(n).exists()
                || std::path::Path::new("/usr/local/nvidia/lib64").join(n).exists()
                || std::path::Path::new("/usr/lib64").join(n).exists()
        });
        let dev = std::path::Path::new("/dev/nvidiactl").exists() || std::path::Path::new("/dev/nvidia0").exists();
        if lib && dev {
            Ok(())
        } else {
            Err("no CUDA device found (no NVIDIA driver library or device node); run with `--backend cpu`".into())
        }
    }

    /// The number of GPUs, asked of the driver once it is known to load.
    pub fn device_count() -> Result<usize, String> {
        available()?;
        // cudarc panics when the driver library cannot be loaded: that is an answer too
        let counted = crate::error::catch_quietly(cudarc::driver::CudaContext::device_count)
            .map_err(|_| "the NVIDIA driver library cannot be loaded; run with `--backend cpu`".to_string())?;
        match counted {
            Ok(n) if n > 0 => Ok(n as usize),
            Ok(_) => Err("the NVIDIA driver reports no CUDA device; run with `--backend cpu`".into()),
            Err(e) => Err(format!("the NVIDIA driver could not count the GPUs: {e:?}")),
        }
    }
}

/// The GPU each device of an in-process CUDA run gets (see `gpus`), for `run` and for
/// `pipec run` to print before training starts.
pub fn gpu_placement(plan: &Plan, options: &RunOptions) -> Result<Vec<(DeviceId, usize)>, RunError> {
    // the device count checks that CUDA is usable first (`cuda_available`)
    #[cfg(feature = "cuda")]
    let count = cuda::device_count().map_err(RunError::setup)?;
    #[cfg(not(feature = "cuda"))]
    let count = cuda_available().map(|()| 0).map_err(RunError::setup)?;
    gpus::in_process(&working_devices(plan), count, options.share_gpus).map_err(RunError::setup)
}

/// Where each device of a process runs: the backend's device and its name for the user.
pub type Placement<B> = BTreeMap<DeviceId, (burn::tensor::Device<B>, String)>;

/// The plan's devices that have a stream to run, in device order.
pub fn working_devices(plan: &Plan) -> Vec<DeviceId> {
    plan.streams.iter().filter(|(_, s)| !s.is_empty()).map(|(d, _)| *d).collect()
}

/// What the executor will do differently from what the plan says, for the user to know.
pub fn caveats(plan: &Plan) -> Vec<String> {
    let mut out = Vec::new();
    if plan.training.precision != pipec_plan::Precision::Fp32 {
        out.push(format!(
            "the plan asks for {} but the executor trains in fp32 (its memory figures assume {})",
            plan.training.precision, plan.training.precision
        ));
    }
    out
}

/// Checks that this executor can run the plan.
pub fn validate(plan: &Plan) -> Result<(), RunError> {
    if plan.version != pipec_plan::plan::PLAN_VERSION {
        return Err(RunError::setup(format!("plan format version {} is not supported", plan.version)));
    }
    if let Some(problem) = plan.check().into_iter().next() {
        return Err(ExecError::Plan(format!("the plan is malformed: {problem}")).into());
    }
    // batch normalisation needs a variance per channel in every microbatch
    for l in &plan.layers {
        if let (Op::BatchNorm2d { .. }, [_, h, w]) = (&l.op, l.input_shape.as_slice()) {
            if plan.training.microbatch_size * h * w < 2 {
                return Err(RunError::setup(format!(
                    "layer {} `batchnorm2d` sees one value per channel in a microbatch of {} sample(s) at {h}×{w}: it cannot compute a batch variance (raise the microbatch size: fewer microbatches or a larger batch)",
                    l.index, plan.training.microbatch_size
                )));
            }
        }
    }
    let graph = plan.layers.iter().any(|l| l.inputs.is_some());
    if graph && plan.stages.iter().any(|s| s.tensor_parallel.iter().any(|g| g.len() > 1)) {
        return Err(RunError::setup(
            "tensor parallelism splits chains of layers; this model has branches or joins".to_string(),
        ));
    }
    let devices_in_stages: std::collections::BTreeSet<DeviceId> = plan
        .stages
        .iter()
        .flat_map(|s| s.replicas.iter().copied().chain(s.tensor_parallel.iter().flatten().copied()))
        .collect();
    let streamed: std::collections::BTreeSet<DeviceId> = working_devices(plan).into_iter().collect();
    if devices_in_stages != streamed {
        return Err(ExecError::Plan("the plan's stages and streams name different devices".into()).into());
    }
    Ok(())
}

/// Runs a plan in this process: one thread per device, channels between them.
pub fn run(plan: &Plan, options: &RunOptions, on_step: &mut dyn FnMut(&StepMetrics)) -> Result<RunReport, RunError> {
    validate(plan)?;
    match options.backend {
        BackendKind::Cpu => {
            let devices = working_devices(plan).into_iter().map(|d| (d, (Default::default(), "cpu".to_string())));
            run_in_process::<CpuBackend>(plan, options, devices.collect(), on_step)
        }
        BackendKind::Cuda => {
            let map = gpu_placement(plan, options)?;
            #[cfg(feature = "cuda")]
            {
                type B = burn::backend::Autodiff<burn::backend::Cuda>;
                let devices = map
                    .into_iter()
                    .map(|(d, g)| (d, (burn::backend::cuda::CudaDevice::new(g), format!("GPU {g}"))))
                    .collect();
                run_in_process::<B>(plan, options, devices, on_step)
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = map;
                Err(RunError::setup("CUDA support is not built in"))
            }
        }
    }
}

enum Event {
    Step(Box<StepReport>, Option<checkpoint::Shards>),
    Failed(RunError),
}

/// Restores every stage of this device from a checkpoint, whatever layout wrote it: each
/// parameter (and its optimizer state) from the saved stage and tensor-parallel ranks that
/// held it, joined and re-split for this stage's rank (`reshard`).
fn load_checkpoint<B: ExecBackend>(
    plan: &Plan,
    stages: &mut HashMap<StageId, StageState<B>>,
    loaded: &checkpoint::Loaded,
    dev: &B::Device,
) -> Result<(), ExecError> {
    let saved = reshard::SavedLayout::new(loaded, plan)?;
    for (id, st) in stages.iter_mut() {
        let (tp_rank, tp_size) = st.tp_shard();
        let stage = plan.stages.get(id.0 as usize).ok_or_else(|| ExecError::Plan(format!("the plan has no {id}")))?;
        let ops: Vec<_> = plan.layers[stage.layers[0]..stage.layers[1]].iter().map(|l| l.op.clone()).collect();
        let split = tensor_parallel::shardings(&ops, stage.layers[0], tp_size as usize)?;
        let to = |pid: u64| split.get(&pid).copied().unwrap_or(tensor_parallel::Sharding::Whole);
        let mut values: HashMap<u64, Vec<f32>> = HashMap::new();
        for (pid, shape) in params::layout::<B, _>(st.model()?) {
            if let Some(v) = saved.values(pid, to(pid), tp_size, tp_rank, &shape)? {
                values.insert(pid, v);
            }
        }
        let model = st.model.take().ok_or(ExecError::Missing("the stage's model is in use"))?;
        let (model, missing) = params::set_params(model, |pid, _| values.remove(&pid));
        st.model = Some(model);
        load_running_statistics(st, &saved, tp_size, tp_rank)?;
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
            match saved.values(id, tensor_parallel::Sharding::Whole, tp_size, tp_rank, &[c])? {
                Some(v) => values.extend_from_slice(&v),
                None => {
                    return Err(ExecError::Checkpoint(format!(
                        "model.safetensors lacks the running statistics of layer {} (`{}`)",
                        bn.index,
                        checkpoint::param_name(id)
                    )))
                }
            }
        }
    }
    st.model.as_mut().ok_or(ExecError::Missing("the stage's model is in use"))?.set_running_statistics(&values)
}

fn save_checkpoint<B: ExecBackend>(stages: &HashMap<StageId, StageState<B>>) -> Result<checkpoint::Shards, ExecError> {
    let mut out = HashMap::new();
    for (id, st) in stages {
        let mut params: Vec<(u64, Vec<usize>, Vec<f32>)> = params::snapshot::<B, _>(st.model()?)?
            .into_iter()
            .map(|(pid, shape, v)| (ParamId::val(&pid), shape, v))
            .collect();
        // batch normalisation's running statistics, beside the layer's parameters
        for bn in st.model()?.batch_norms() {
            let c = bn.running_mean.len();
            params.push((layers::state_id(bn.index, layers::RUNNING_MEAN_SLOT), vec![c], bn.running_mean.clone()));
            params.push((layers::state_id(bn.index, layers::RUNNING_VAR_SLOT), vec![c], bn.running_var.clone()));
        }
        let optimizer = st.optim.save().map_err(|e| ExecError::Checkpoint(format!("stage {id}: {e}")))?;
        let (tp_rank, tp_size) = st.tp_shard();
        out.insert(
            checkpoint::ShardKey { stage: id.0, tp_rank },
            checkpoint::StageCheckpoint { params, optimizer, tp_size },
        );
    }
    Ok(out)
}

/// The most timeline entries a run keeps (about 40 bytes each): a long run's trace keeps
/// its first steps in full.
pub const TIMELINE_LIMIT: usize = 2_000_000;

/// Where a step's checkpoint goes: given the completed steps and the stages this process
/// saved, it writes (or forwards) them and says where they landed.
pub type CheckpointSink<'a> = dyn FnMut(usize, checkpoint::Shards) -> Result<Option<PathBuf>, ExecError> + 'a;

/// Runs the workers of `devices` on this process with the given endpoints; used by the
/// in-process transport (all devices) and by MPI (one device per process).
pub fn run_workers<B: ExecBackend, E: Endpoint + 'static>(
    plan: &Plan,
    options: &RunOptions,
    placement: &Placement<B>,
    endpoints: Vec<E>,
    abort: Arc<AtomicBool>,
    on_step: &mut dyn FnMut(&StepMetrics),
    sink: &mut CheckpointSink<'_>,
) -> Result<RunReport, RunError> {
    let data = Dataset::for_plan(plan).map_err(ExecError::Data)?;
    let loaded = options.resume.as_ref().map(Resume::load).transpose().map_err(ExecError::Checkpoint)?;
    if let Some(l) = &loaded {
        l.check_fits(plan).map_err(ExecError::Checkpoint)?;
    }
    if let Some(dir) = &options.checkpoint_dir {
        checkpoint::clean_abandoned(dir);
    }
    let first_step = loaded.as_ref().map(|l| l.completed_steps).unwrap_or(0);
    let total_steps = options.steps.unwrap_or(plan.training.steps);
    if total_steps == 0 {
        return Err(RunError::setup("the run has 0 steps: nothing to train"));
    }
    if first_step >= total_steps {
        return Err(ExecError::Checkpoint(format!(
            "the checkpoint has completed {first_step} step(s) and this run is {total_steps} step(s) long: nothing is left to train (raise `--steps` or `training.steps`)"
        ))
        .into());
    }
    let every = plan.training.checkpoint_every.filter(|_| options.checkpoint_dir.is_some());
    let reduce = plan.schedule.reduce;
    let (tx, rx) = channel::<Event>();
    let n_workers = endpoints.len();
    let gate = StopGate::new(options.stop.clone(), plan.flush_free.is_some());
    let gate = &gate;
    // every worker's step times are measured from here
    let epoch = Instant::now();
    let mut report = RunReport {
        placement: placement.iter().map(|(d, (_, name))| (*d, name.clone())).collect(),
        ..RunReport::default()
    };
    std::thread::scope(|scope| -> Result<(), RunError> {
        for ep in endpoints {
            let tx = tx.clone();
            let abort = abort.clone();
            let dev = placement.get(&ep.device()).map(|p| p.0.clone());
            let data = &data;
            let loaded = loaded.as_ref();
            scope.spawn(move || {
                let device = ep.device();
                let fail = |step: Option<usize>, index: Option<usize>, error: ExecError| {
                    let ins = index.and_then(|i| plan.instruction(device, i));
                    RunError {
                        device: Some(device),
                        stage: ins.map(pipec_plan::Instr::stage),
                        step,
                        instruction: ins.map(ToString::to_string),
                        error,
                    }
                };
                // the worker computes on this thread; its communication threads run beside
                // it in this scope and end with it (on a failure, the abort flag stops any
                // transfer they are blocked in)
                let outcome = std::thread::scope(|comm_scope| {
                    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| -> Result<(), RunError> {
                        let dev = dev.ok_or_else(|| {
                            fail(None, None, ExecError::Setup(format!("no compute device was assigned to {device}")))
                        })?;
                        let mut stages = build_stages::<B>(plan, device, &dev).map_err(|e| fail(None, None, e))?;
                        if let Some(l) = loaded {
                            load_checkpoint(plan, &mut stages, l, &dev).map_err(|e| fail(None, None, e))?;
                        }
                        let stream = &plan.streams[&device];
                        let comm = comm::Comm::start(comm_scope, ep, epoch);
                        let mut w = Worker::new(device, plan, stream, data, comm, dev.clone(), stages, reduce);
                        w.epoch = epoch;
                        // a flush-free pipeline starts empty, and is drained by the last step and
                        // by every step a checkpoint follows (a checkpoint holds nothing in flight)
                        let mut filled = false;
                        for step in first_step..total_steps {
                            let begin = gate.begin(step);
                            if abort.load(Ordering::Relaxed) || begin == Begin::Stop {
                                return Ok(());
                            }
                            let planned = step + 1 == total_steps || every.is_some_and(|k| (step + 1) % k == 0);
                            let drain = planned || begin == Begin::RunLast;
                            let segments = w.segments(filled, drain);
                            let r = w.step(step, &segments, drain).map_err(|(i, e)| fail(Some(step), Some(i), e))?;
                            filled = !drain;
                            // a checkpoint follows the steps that drain as planned, when
                            // checkpoints are on
                            let ckpt = if every.is_some() && planned {
                                Some(save_checkpoint(&w.stages).map_err(|e| fail(Some(step), None, e))?)
                            } else {
                                None
                            };
                            if tx.send(Event::Step(Box::new(r), ckpt)).is_err() {
                                return Ok(());
                            }
                        }
                        Ok(())
                    }));
                    if !matches!(outcome, Ok(Ok(()))) {
                        abort.store(true, Ordering::Relaxed);
                    }
                    outcome
                });
                let err = match outcome {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e),
                    Err(panic) => {
                        let msg = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "panicked".into());
                        Some(fail(None, None, ExecError::Panic(msg)))
                    }
                };
                if let Some(e) = err {
                    abort.store(true, Ordering::Relaxed);
                    let _ = tx.send(Event::Failed(e));
                }
            });
        }
        drop(tx);
        // The coordinator: gathers every worker's step, reports metrics, writes checkpoints.
        let mut pending: BTreeMap<usize, Vec<(StepReport, Option<checkpoint::Shards>)>> = BTreeMap::new();
        let mut carry: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
        let mut first_error: Option<RunError> = None;
        // Keep the root cause: a worker that was merely stopped reports less.
        let record = |first_error: &mut Option<RunError>, e: RunError| {
            abort.store(true, Ordering::Relaxed);
            if first_error.is_none()
                || (!e.error.is_secondary() && first_error.as_ref().is_some_and(|f| f.error.is_secondary()))
            {
                *first_error = Some(e);
            }
        };
        let mut last_done = Instant::now();
        for ev in rx {
            match ev {
                Event::Failed(e) => record(&mut first_error, e),
                Event::Step(r, ck) => {
                    let step = r.step;
                    let entry = pending.entry(step).or_default();
                    entry.push((*r, ck));
                    if entry.len() == n_workers {
                        let reports = pending.remove(&step).unwrap_or_default();
                        // a loss belongs to its microbatch's step: a flush-free step also
                        // computes the next step's first losses, kept for it
                        let n = plan.training.microbatches.max(1);
                        for (mb, l) in reports.iter().flat_map(|(r, _)| r.losses.iter()) {
                            carry.entry(*mb as usize / n).or_default().push(*l);
                        }
                        let losses: Vec<f32> = carry.remove(&step).unwrap_or_default();
                        carry.retain(|s, _| *s > step);
                        let loss_sum = losses.iter().map(|&l| f64::from(l)).sum::<f64>();
                        let loss = if losses.is_empty() { f64::NAN } else { loss_sum / losses.len() as f64 };
                        let now = Instant::now();
                        let wall = now.duration_since(last_done).as_secs_f64();
                        last_done = now;
                        let step_seconds = reports
                            .iter()
                            .map(|(r, _)| r.step_seconds)
                            .fold(0.0, f64::max)
                            .min(wall.max(f64::MIN_POSITIVE));
                        let m = StepMetrics {
                            step,
                            loss,
                            loss_sum,
                            loss_count: losses.len(),
                            step_seconds,
                            samples_per_s: plan.training.batch_size as f64 / step_seconds.max(1e-12),
                            perplexity: is_language_model(plan).then(|| loss.exp()),
                        };
                        on_step(&m);
                        report.steps.push(m);
                        report.trace = reports
                            .iter()
                            .flat_map(|(r, _)| r.trace.iter().map(move |t| (r.device, t.0, t.1, t.2)))
                            .collect();
                        for (r, _) in &reports {
                            let room = TIMELINE_LIMIT.saturating_sub(report.comm_timeline.len());
                            report
                                .comm_timeline
                                .extend(r.comm.iter().take(room).map(|t| (r.device, r.step, t.0, t.1, t.2)));
                        }
                        for (r, _) in &reports {
                            let room = TIMELINE_LIMIT.saturating_sub(report.timeline.len());
                            report.timeline.extend(
                                r.trace
                                    .iter()
                                    .take(room)
                                    .map(|t| (r.device, r.step, t.0, r.started + t.1, r.started + t.2)),
                            );
                        }
                        for (r, _) in &reports {
                            let e = report.peak_in_flight.entry(r.device).or_default();
                            for (s, n) in &r.peak_in_flight {
                                let p = e.entry(*s).or_insert(0);
                                *p = (*p).max(*n);
                            }
                            let v = report.peak_versions.entry(r.device).or_default();
                            for (s, n) in &r.peak_versions {
                                let p = v.entry(*s).or_insert(0);
                                *p = (*p).max(*n);
                            }
                        }
                        if reports.iter().any(|(_, c)| c.is_some()) {
                            // a shard from the stage's first replica (the lowest device):
                            // replicas of a synchronous stage hold the same state, and under
                            // asynchronous data parallelism the first replica is the
                            // parameter server, the only one whose optimizer state is live
                            let mut reports = reports;
                            reports.sort_by_key(|(r, _)| r.device);
                            let mut stages = HashMap::new();
                            for (_, c) in reports {
                                for (s, st) in c.unwrap_or_default() {
                                    stages.entry(s).or_insert(st);
                                }
                            }
                            match sink(step + 1, stages) {
                                Ok(Some(p)) => report.checkpoints.push(p),
                                Ok(None) => {}
                                Err(e) => record(&mut first_error, RunError { step: Some(step), ..e.into() }),
                            }
                        }
                    }
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    })?;
    report.interrupted = gate.stopped() && report.steps.last().is_none_or(|s| s.step + 1 < total_steps);
    Ok(report)
}

fn run_in_process<B: ExecBackend>(
    plan: &Plan,
    options: &RunOptions,
    placement: Placement<B>,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<RunReport, RunError> {
    let devices = working_devices(plan);
    let abort = Arc::new(AtomicBool::new(false));
    let endpoints = transport::in_process::connect(&devices, abort.clone(), options.timeout);
    let dir = options.checkpoint_dir.clone();
    let identity = checkpoint::Identity::of(plan);
    let mut sink = |steps: usize, stages: checkpoint::Shards| match &dir {
        Some(d) => checkpoint::write(d, steps, &identity, &stages).map(Some).map_err(ExecError::Checkpoint),
        None => Ok(None),
    };
    run_workers::<B, _>(plan, options, &placement, endpoints, abort, on_step, &mut sink)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked() -> Arc<AtomicBool> {
        Arc::new(AtomicBool::new(false))
    }

    #[test]
    fn a_stop_ends_a_flushed_run_at_the_first_step_no_worker_began() {
        let flag = asked();
        let gate = StopGate::new(Some(flag.clone()), false);
        assert_eq!(gate.begin(0), Begin::Run);
        assert_eq!(gate.begin(1), Begin::Run);
        flag.store(true, Ordering::Relaxed);
        // a worker still at step 0 finishes the steps another has begun (the last), and no more
        assert_eq!(gate.begin(1), Begin::RunLast);
        assert_eq!(gate.begin(2), Begin::Stop);
        assert!(gate.stopped());
    }

    #[test]
    fn a_stop_drains_a_flush_free_pipeline_on_the_step_after_the_last_begun() {
        let flag = asked();
        let gate = StopGate::new(Some(flag.clone()), true);
        assert_eq!(gate.begin(0), Begin::Run);
        assert_eq!(gate.begin(1), Begin::Run);
        flag.store(true, Ordering::Relaxed);
        // step 1 was begun without draining: step 2 drains, every worker runs it as the last
        assert_eq!(gate.begin(1), Begin::Run);
        assert_eq!(gate.begin(2), Begin::RunLast);
        assert_eq!(gate.begin(2), Begin::RunLast);
        assert_eq!(gate.begin(3), Begin::Stop);
    }
}
