//! What a run is asked and what it reports: the backend, the options, the step metrics and
//! the report, the plan's refusals (`validate`, `caveats`), and the devices that work and
//! their GPUs. The runs themselves: `local` (one process), `process_run` (one per device).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use pipec_plan::checkpoint;
use pipec_plan::model::Op;
use pipec_plan::{DeviceId, Plan, StageId};

use crate::error::ExecError;
use crate::interp::worker::{ExpertTokens, HeldState};
use crate::{backend, interp, parallel};

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
    /// Reads and verifies the checkpoint (once), its ZeRO shards joined for `plan`'s
    /// optimizer ([`read_checkpoint`]).
    pub fn load(&self, plan: &Plan) -> Result<Arc<checkpoint::Loaded>, String> {
        match self {
            Resume::Dir(p) => Ok(Arc::new(read_checkpoint(&checkpoint::locate(p)?, &plan.training.optimizer)?)),
            Resume::Loaded(l) if l.zero.is_empty() => Ok(l.clone()),
            Resume::Loaded(l) => {
                let mut joined = (**l).clone();
                interp::sharded::join_saved(&mut joined, &plan.training.optimizer).map_err(|e| e.to_string())?;
                Ok(Arc::new(joined))
            }
        }
    }
}

/// Reads and verifies a checkpoint directory (`checkpoint::read`), a ZeRO-sharded stage's
/// replicas' optimizer states joined into the whole state an unsharded stage saves, for
/// the optimizer `optimizer` (the kind the checkpoint's identity names).
pub fn read_checkpoint(
    dir: &std::path::Path,
    optimizer: &pipec_plan::plan::OptimizerPlan,
) -> Result<checkpoint::Loaded, String> {
    let mut loaded = checkpoint::read(dir)?;
    interp::sharded::join_saved(&mut loaded, optimizer).map_err(|e| e.to_string())?;
    Ok(loaded)
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
    /// With one process per GPU: start an NCCL communicator over every rank before training
    /// and check an all-reduce on each GPU (`comm::nccl`).
    pub nccl_check: bool,
    /// On CUDA in one process: the GPU of each device, already placed and judged by
    /// [`gpu_placement`] (`pipec run` does so to print it before compiling the workers);
    /// None: placed and judged at the start of the run.
    pub gpus: Option<GpuMap>,
    /// Set (by a SIGINT/SIGTERM handler) to stop at the next step boundary every worker
    /// agrees on; the run then returns what it trained with `RunReport::interrupted`.
    pub stop: Option<Arc<AtomicBool>>,
    /// How the processes of a process-per-device job agree on the step to stop at (set by
    /// `process_run`); none in one process, whose workers share a lock.
    pub vote: Option<Arc<dyn super::stop::StopVote>>,
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
            nccl_check: false,
            gpus: None,
            stop: None,
            vote: None,
        }
    }
}

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
    /// The step's learning rate (the plan's schedule).
    pub lr: f64,
    /// Gradient clipping by the global norm (or fp16's overflow check): the gradient's norm
    /// before clipping (unscaled; not finite on a step fp16's loss scaling skipped).
    pub grad_norm: Option<f64>,
    /// fp16's dynamic loss scaling: the scale the step's loss was multiplied by, and whether
    /// its updates were skipped (a gradient was not finite).
    pub loss_scale: Option<f64>,
    pub skipped: bool,
    /// Epochs of a finite data set drawn by the end of the step.
    pub epoch: Option<f64>,
    /// Validation after this step (`training.validation`).
    pub validation: Option<ValidationMetrics>,
    /// With checkpoints on: the longest any device waited for checkpoint writes before
    /// reporting this step (asynchronous: for the previous write, before handing over this
    /// step's copy; `async: false`: for the previous step's own write).
    pub checkpoint_wait_s: Option<f64>,
    /// With a checkpoint after this step: the longest any device took to copy its state
    /// for it (a ZeRO replica: its own shard), and how long the coordinator (rank 0 of a
    /// process job, which first receives the other ranks' copies) took to write it.
    pub checkpoint_copy_s: Option<f64>,
    pub checkpoint_write_s: Option<f64>,
    /// The mixtures of experts' load-balancing loss (weighted by their `aux_loss`, summed
    /// over the blocks, averaged over the step's microbatches), where a block weighs it;
    /// `aux_sum` is its sum over the microbatches this process saw (for combining ranks).
    pub aux_loss: Option<f64>,
    pub aux_sum: f64,
    /// Per mixture-of-experts block (by layer), the tokens each expert took in the step.
    pub expert_tokens: ExpertTokens,
}

/// The held-out data's figures after a step: its mean loss, and a classifier's accuracy
/// (a language model's over its tokens) and a language model's perplexity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ValidationMetrics {
    pub loss: f64,
    pub accuracy: Option<f64>,
    pub perplexity: Option<f64>,
    /// The raw sums (loss, microbatches, correct, predictions), which ranks add up.
    pub sums: [f64; 4],
}

impl ValidationMetrics {
    /// From summed loss, microbatches, correct predictions and predictions.
    pub fn of(sums: [f64; 4], language_model: bool) -> Self {
        let loss = if sums[1] > 0.0 { sums[0] / sums[1] } else { f64::NAN };
        ValidationMetrics {
            loss,
            accuracy: (sums[3] > 0.0).then(|| sums[2] / sums[3]),
            perplexity: language_model.then(|| loss.exp()),
            sums,
        }
    }
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
    /// ZeRO-3: per device, the all-gathers of its stages' whole weights in each step, and
    /// how many of them were prefetched during the pass before.
    pub weight_gathers: BTreeMap<DeviceId, Vec<u32>>,
    pub prefetched_gathers: BTreeMap<DeviceId, Vec<u32>>,
    /// ZeRO-3: per device, the all-gathers of single weights by the products reading them
    /// in each step.
    pub product_gathers: BTreeMap<DeviceId, Vec<u32>>,
    /// Checkpoints written.
    pub checkpoints: Vec<PathBuf>,
    /// Where each device of this process ran (`cpu`, `GPU 0`, ...).
    pub placement: Vec<(DeviceId, String)>,
    /// The run was stopped (`RunOptions::stop`) before its last step.
    pub interrupted: bool,
    /// The model state each device held at the end of the run (measured).
    pub held: BTreeMap<DeviceId, HeldState>,
    /// The resident memory of each process that ran one device (Linux; one MPI rank, or a
    /// one-device plan): before its stages were built and at its peak.
    pub resident: BTreeMap<DeviceId, backend::resident::Resident>,
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
pub(super) mod cuda {
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

    /// What the driver says of GPU `ordinal` (its UUID, name and memory), before anything
    /// is allocated on it.
    pub fn gpu(ordinal: usize) -> Result<crate::run::gpus::Gpu, String> {
        available()?;
        let opened = crate::error::catch_quietly(|| cudarc::driver::CudaContext::new(ordinal))
            .map_err(|_| "the NVIDIA driver library cannot be loaded; run with `--backend cpu`".to_string())?
            .map_err(|e| format!("GPU {ordinal} cannot be opened: {e:?}"))?;
        let asked = |what: &str, e: cudarc::driver::DriverError| format!("GPU {ordinal}'s {what}: {e:?}");
        let name = opened.name().map_err(|e| asked("name", e))?;
        let uuid = opened.uuid().map_err(|e| asked("UUID", e))?.bytes.map(|b| b as u8);
        let (free, total) = opened.mem_get_info().map_err(|e| asked("memory", e))?;
        Ok(crate::run::gpus::Gpu {
            ordinal,
            uuid: crate::run::gpus::uuid_text(uuid),
            name,
            total: total as u64,
            free: free as u64,
        })
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

/// Each device's GPU: its index among the GPUs this process sees.
pub type GpuMap = Vec<(DeviceId, usize)>;

/// The GPU each device of an in-process CUDA run gets (see `gpus`), for `run` and for
/// `pipec run` to print before training starts, with warnings for the user (a GPU with less
/// memory free than the plan's peak on it); refused where the plan's peaks do not fit the
/// GPUs' memory (`gpus::verdict`), before anything is allocated.
pub fn gpu_placement(plan: &Plan, options: &RunOptions) -> Result<(GpuMap, Vec<String>), RunError> {
    // the device count checks that CUDA is usable first (`cuda_available`)
    #[cfg(feature = "cuda")]
    let count = cuda::device_count().map_err(RunError::setup)?;
    #[cfg(not(feature = "cuda"))]
    let count = cuda_available().map(|()| 0).map_err(RunError::setup)?;
    let map = super::gpus::in_process(&working_devices(plan), count, options.share_gpus).map_err(RunError::setup)?;
    let visible = super::gpus::visible_from_env();
    let claims: Vec<(DeviceId, u64, super::gpus::Claim)> = map
        .iter()
        .map(|&(d, ordinal)| {
            let found = gpu_facts(ordinal);
            (d, super::gpus::plan_peak(plan, d), super::gpus::Claim { found, visible: visible.clone() })
        })
        .collect();
    if let Some(why) = super::gpus::verdict(&claims, options.share_gpus, &|d| d.to_string()) {
        return Err(RunError::setup(why));
    }
    let warnings = claims.iter().filter_map(|(d, peak, claim)| super::gpus::free_memory_warning(*d, *peak, claim));
    Ok((map, warnings.collect()))
}

/// What the driver says of GPU `ordinal` (`cuda::gpu`); an error without CUDA support.
pub fn gpu_facts(ordinal: usize) -> Result<super::gpus::Gpu, String> {
    #[cfg(feature = "cuda")]
    {
        cuda::gpu(ordinal)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        cuda_available().and_then(|()| Err("CUDA support is not built in".into()))
    }
}

/// The GPU count of this process's view, for a rank choosing its GPU; an error without CUDA.
pub fn gpu_count() -> Result<usize, String> {
    #[cfg(feature = "cuda")]
    {
        cuda::device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        cuda_available().map(|()| 0)
    }
}

/// Where each device of a process runs: the backend's device and its name for the user.
pub type Placement<B> = BTreeMap<DeviceId, (burn::tensor::Device<B>, String)>;

/// The plan's devices that have a stream to run, in device order.
pub fn working_devices(plan: &Plan) -> Vec<DeviceId> {
    plan.streams.iter().filter(|(_, s)| !s.is_empty()).map(|(d, _)| *d).collect()
}

/// Whether a `zero: 3` plan has large weights the executor gathers with their stage, whole
/// for its passes, rather than each for the product reading it (`zero::gathers_per_product`):
/// every parameter of a stage with tensor or expert parallelism, and the weights of any
/// layer with weight matrices or tables that the rule leaves out (positional embeddings,
/// convolutions, mixtures of experts, both ends of a tie). Norms and biases, gathered with
/// the stage too, are small.
fn whole_stage_gathers(plan: &Plan) -> bool {
    plan.stages.iter().any(|s| {
        s.tensor_parallel.iter().any(|g| g.len() > 1)
            || s.expert_parallel > 1
            || (s.layers[0]..s.layers[1]).any(|l| {
                let large = plan.layers.get(l).is_some_and(|l| {
                    matches!(
                        parallel::zero::zero3_gather(&l.op),
                        parallel::zero::Zero3Gather::PerProduct
                            | parallel::zero::Zero3Gather::WithStage { large: true }
                    )
                });
                large && !parallel::zero::gathers_per_product(plan, l)
            })
    })
}

/// What the executor will do differently from what the plan says, for the user to know.
pub fn caveats(plan: &Plan) -> Vec<String> {
    let mut out = Vec::new();
    match plan.training.precision {
        pipec_plan::Precision::Fp32 => {}
        pipec_plan::Precision::Bf16 => out.push(
            "under bf16 the executor computes every matrix product (dense layers, attention) in bf16 from fp32 master weights, as autocast does, and sums gradients in the plan's `grad_precision`; the rest (norms, softmax, losses, convolutions) runs in fp32 and the activations kept for the backward are fp32, so its memory is above the plan's bf16 figures"
                .to_string(),
        ),
        pipec_plan::Precision::Fp16 if backend::amp::scales_loss(plan) => out.push(
            "under fp16 the executor computes every matrix product (dense layers, attention) in fp16 from fp32 master weights, with dynamic loss scaling (PyTorch's GradScaler: from 65536, halved and the step skipped on every device when a gradient is not finite, doubled after 2000 finite steps; metrics.jsonl has each step's `loss_scale` and `skipped`), and sums gradients in the plan's `grad_precision`; the rest (norms, softmax, losses, convolutions) runs in fp32 and the activations kept for the backward are fp32, so its memory is above the plan's fp16 figures"
                .to_string(),
        ),
        pipec_plan::Precision::Fp16 => out.push(
            "the plan asks for fp16 but the executor trains in fp32: fp16 needs dynamic loss scaling, and under an asynchronous schedule the stages update on their own clocks, so they could not skip the same steps (its memory figures assume fp16)"
                .to_string(),
        ),
    }
    if plan.schedule.tp_overlap {
        out.push(
            "under `tp_overlap` the plan hides each layer's tensor-parallel collectives under its passes (Megatron-LM's --tp-comm-overlap), but the executor runs them in line: its steps take their whole time"
                .to_string(),
        );
    }
    // for pipec's own executor the plan prices what runs: tensor parallelism's all-reduces
    // (`KernelFamily::splits_sequence`; torchtitan's compiled or eager kernels alike)
    let priced_split = pipec_plan::engine::performance::KernelFamily::of(plan.engine.name, false).splits_sequence();
    if plan.schedule.sequence_parallel
        && priced_split
        && plan.stages.iter().any(|s| s.tensor_parallel.iter().any(|g| g.len() > 1))
    {
        out.push(
            "under `sequence_parallel` the plan prices Megatron-LM's all-gathers and reduce-scatters and keeps a block's activations outside attention and MLP split along the sequence, but the executor runs tensor parallelism's all-reduces (what the plan's `in_pass` declares) on whole activations: its collectives and its activation memory are those of tensor parallelism alone"
                .to_string(),
        );
    }
    if plan.schedule.cp_comm == pipec_plan::vocab::CpComm::Ring {
        out.push(
            "under `cp_comm: ring` the executor passes each block of keys and values on while it computes with it, as the plan prices, but its backward gathers the blocks and scatters their gradients in line, where the plan hides them under the attention's backward"
                .to_string(),
        );
    }
    if let Some(pairing) = plan.schedule.pairing().filter(|_| plan.stages.iter().any(|s| s.expert_parallel > 1)) {
        let (under, whose) = match pairing {
            pipec_plan::schedule::Pairing::OtherStage => (format!("`{}`", plan.schedule.kind), "DeepSeek-V3's overlap"),
            pipec_plan::schedule::Pairing::OtherTask => {
                ("`ep_overlap`".to_string(), "Megatron-LM's combined 1F1B, whose order the executor runs")
            }
        };
        out.push(format!(
            "under {under} the plan hides each forward-backward pair's all-to-alls under the other pass's computation ({whose}), but the executor runs a pair's two passes one after the other with their all-to-alls in line: its steps take their whole time"
        ));
    }
    if plan.schedule.sharding == pipec_plan::vocab::Sharding::Parameters && whole_stage_gathers(plan) {
        out.push(
            "under `zero: 3` the executor gathers each linear and LSTM weight and token embedding table for the product reading it, as the plan gathers each layer, but the weights of positional embeddings, convolutions, mixtures of experts and both ends of a tie, and every weight of a stage with tensor or expert parallelism, with their stage, whole for its passes, dropping them once no kept graph holds them (a recomputed stage after every pass; otherwise after its last backward of the step): its peak holds those whole where the plan counts one layer's"
                .to_string(),
        );
    }
    out
}

/// Refuses recompute inside the blocks (`recompute: { layers: n }`, `{ modules: [...] }`,
/// `{ ops: [...] }`: `crate::interp::block_recompute`; `core_attn` alone is recomputed in
/// the attention kernel and runs everywhere) beside what it does not run with yet: expert
/// parallelism in a plan whose `AllToAll` instructions do not list the dispatch and combine
/// the executor's backward runs again (one for another engine) and a model with branches or
/// joins (the cut needs a chain of layers).
fn block_recompute_runs_here(plan: &Plan) -> Result<(), RunError> {
    let Some(policy) = plan.schedule.block_recompute.as_ref() else { return Ok(()) };
    let what = match (policy.layers > 0, policy.executor_halves().any()) {
        (false, false) => return Ok(()),
        (true, _) => "the first blocks of every stage (`recompute: { layers: n }`)",
        (false, true) if policy.ops.is_empty() => "by module (`recompute: { modules: [...] }`)",
        (false, true) => "by operation (`recompute: { ops: [...] }`)",
    };
    let refuse = |why: &str| Err(RunError::setup(format!("the executor recomputes {what} only {why} yet")));
    if plan.layers.iter().any(|l| l.inputs.is_some()) {
        return refuse("in a chain of layers (this model has branches or joins)");
    }
    // expert parallelism: the plan lists the dispatch and combine a backward runs again
    // where this executor runs them again (a plan for another engine lists that engine's)
    for s in plan.stages.iter().filter(|s| s.expert_parallel > 1 && !s.recompute) {
        let ops: Vec<&pipec_plan::model::Op> = (s.layers[0]..s.layers[1])
            .filter_map(|i| plan.layers.iter().find(|l| l.index == i))
            .map(|l| &l.op)
            .collect();
        let again = policy.run_again(&ops.iter().map(|op| op.block_dims().is_some()).collect::<Vec<_>>());
        let runs = |k: usize| again.get(k).is_some_and(|a| a.halves().mlp);
        if s.all_to_alls.iter().any(|x| runs((x.layer as usize).saturating_sub(s.layers[0])) != x.again) {
            return refuse(
                "beside expert parallelism in a plan for `engine: pipec` (this plan's engine runs the policy's exchanges again elsewhere than the executor would)",
            );
        }
    }
    Ok(())
}

/// Checks that this executor can run the plan.
pub fn validate(plan: &Plan) -> Result<(), RunError> {
    if plan.version != pipec_plan::plan::PLAN_VERSION {
        return Err(RunError::setup(format!("plan format version {} is not supported", plan.version)));
    }
    if let Some(problem) = plan.check().into_iter().next() {
        return Err(ExecError::Plan(format!("the plan is malformed: {problem}")).into());
    }
    for l in &plan.layers {
        let Some(m) = l.op.block_dims().and_then(|b| b.moe) else { continue };
        let refuse = |why: String| Err(RunError::setup(format!("layer {} (a mixture of experts): {why}", l.index)));
        if m.experts + m.shared > pipec_plan::checkpoint::MAX_EXPERTS {
            return refuse(format!(
                "the executor holds at most {} experts per block (routed and shared), this one has {}",
                pipec_plan::checkpoint::MAX_EXPERTS,
                m.experts + m.shared
            ));
        }
    }
    block_recompute_runs_here(plan)?;
    // (`ep` equal to `tp`: one replica's ranks, an expert group the plan does not make)
    let split = |s: &pipec_plan::plan::StagePlan| s.tensor_parallel.iter().any(|g| g.len() > 1);
    if plan.schedule.whole_experts && plan.stages.iter().any(|s| split(s) && s.expert_parallel <= 1) {
        return Err(RunError::setup(
            "the executor runs experts whole beside tensor parallelism (`etp: 1`) over expert groups of two replicas or more (`ep` at least twice `tp`) yet".to_string(),
        ));
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
