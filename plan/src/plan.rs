//! The plan: everything the executor needs to train, and everything the compiler predicted.
//! Serialised as `plan.json` (format documented in docs/plan-format.md, versioned by
//! [`PLAN_VERSION`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::engine::EngineTarget;
use crate::instr::{DeviceId, GroupId, Instr, StageId};
use crate::model::{Loss, Op, Source};
use crate::recipe::Recipe;
use crate::vocab::{Attention, OptimizerKind, Precision, ReduceMode, ScheduleKind, Sharding, Task};

/// Bumped on every incompatible change of the format.
pub const PLAN_VERSION: u32 = 10;

/// A compiled training plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub version: u32,
    pub name: String,
    /// The engine the plan is for (the spec's `engine:`): the layout was checked against
    /// its capabilities (`crate::engine`). Absent: pipec itself.
    #[serde(default, skip_serializing_if = "EngineTarget::is_pipec")]
    pub engine: EngineTarget,
    /// How fast that engine runs the kernels on the plan's device, as the predictions priced
    /// them (`crate::engine::performance`). Absent: pipec itself, priced on its device's
    /// figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_performance: Option<crate::engine::performance::Performance>,
    pub model: ModelPlan,
    pub training: TrainingPlan,
    pub schedule: ScheduleInfo,
    /// PipeDream notation of the layout, e.g. `2-1-1`.
    pub partition: String,
    pub stages: Vec<StagePlan>,
    pub devices: Vec<DevicePlan>,
    /// Collective groups (replicas of one stage).
    pub groups: Vec<GroupPlan>,
    /// The cost-model inputs per layer.
    pub layers: Vec<LayerPlan>,
    /// One ordered instruction stream per device: the step's, or with `flush_free` the
    /// body every step but the last runs.
    pub streams: BTreeMap<DeviceId, Vec<Instr>>,
    /// The collectives each device's passes make inside themselves (tensor, context and
    /// expert parallelism's), per stage and kind of pass (`crate::in_pass`). Absent: none.
    #[serde(default, skip_serializing_if = "crate::in_pass::InPassTable::is_empty")]
    pub in_pass: crate::in_pass::InPassTable,
    /// Flush-free pipelining (PipeDream, 2BW): a run is one continuous pipeline —
    /// `prologue` once, `streams` (the body) every step, `epilogue` for the step that
    /// drains it (the last, and one a checkpoint follows). Microbatch numbers are relative
    /// to the step a segment belongs to: `m` in step t's segment is microbatch `t·N + m` of
    /// the run, so a body's numbers `N..` are the next step's first microbatches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_free: Option<FlushFree>,
    /// Validation (`training.recipe.validation`): each device's stream for one held-out
    /// batch, forward passes only (loads, receives, forwards, sends and frees), run after
    /// the steps the validation follows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<BTreeMap<DeviceId, Vec<Instr>>>,
    pub simulation: Simulation,
}

/// The segments of a flush-free pipeline besides its body (see `Plan::flush_free`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FlushFree {
    pub prologue: BTreeMap<DeviceId, Vec<Instr>>,
    pub epilogue: BTreeMap<DeviceId, Vec<Instr>>,
}

/// Which part of a flush-free pipeline an instruction is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    Prologue,
    Body,
    Epilogue,
}

/// An instruction's place in a step: the segment and the index in it, as one number
/// (the body's index itself, so plain plans' indices are unchanged).
pub fn instruction_code(segment: Segment, index: usize) -> usize {
    match segment {
        Segment::Body => index,
        Segment::Prologue => (1 << 40) + index,
        Segment::Epilogue => (2 << 40) + index,
    }
}

/// `stream` with every microbatch number moved by `by` (a flush-free segment's numbers
/// are relative to its step; `t·N` makes them the run's, `−t·N` relative again).
pub fn shift_microbatches(stream: &[Instr], by: i64) -> Vec<Instr> {
    stream.iter().map(|i| i.map_microbatch(|m| crate::MicrobatchId((i64::from(m.0) + by) as u32))).collect()
}

impl FlushFree {
    /// The streams of `steps` steps of the pipeline whose body is `body`, microbatches
    /// numbered across the run (`t·n + m`): prologue, body × (steps − 1), epilogue.
    pub fn unroll(
        &self,
        body: &BTreeMap<DeviceId, Vec<Instr>>,
        n: usize,
        steps: usize,
    ) -> BTreeMap<DeviceId, Vec<Instr>> {
        let shifted = |s: &[Instr], t: usize| shift_microbatches(s, (t * n) as i64);
        body.iter()
            .map(|(dev, b)| {
                let mut s: Vec<Instr> = self.prologue.get(dev).cloned().unwrap_or_default();
                for t in 0..steps.saturating_sub(1) {
                    s.extend(shifted(b, t));
                }
                if steps > 0 {
                    s.extend(shifted(self.epilogue.get(dev).map_or(&[][..], Vec::as_slice), steps - 1));
                }
                (*dev, s)
            })
            .collect()
    }
}

/// The model as the executor builds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelPlan {
    pub input: Vec<usize>,
    pub loss: Loss,
    /// The vocabulary when the input is token ids (first layer an embedding).
    pub token_vocab: Option<usize>,
    /// The attention kernel the cost model priced (the executor's CPU kernels compute the
    /// same values either way).
    #[serde(default = "standard_attention", skip_serializing_if = "is_standard")]
    pub attention: Attention,
    /// DeepSeek-V3's multi-token prediction after the last block (`model.mtp`), priced
    /// with the output layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtp: Option<crate::model::Mtp>,
}

fn standard_attention() -> Attention {
    Attention::Standard
}

fn is_standard(a: &Attention) -> bool {
    *a == Attention::Standard
}

fn fp32() -> Precision {
    Precision::Fp32
}

fn yes() -> bool {
    true
}
fn is_true(b: &bool) -> bool {
    *b
}
fn is_fp32(p: &Precision) -> bool {
    *p == Precision::Fp32
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn decay_all() -> bool {
    true
}

fn is_decay_all(b: &bool) -> bool {
    *b
}

/// Optimizer settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum OptimizerPlan {
    Sgd {
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    },
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        /// AdamW: decoupled weight decay (absent in plans written before it: Adam's).
        #[serde(default, skip_serializing_if = "is_false")]
        decoupled: bool,
        /// AdamW: whether the decay applies to one-dimensional parameters too (biases, norm
        /// gains and shifts); false is the usual rule for language models.
        #[serde(default = "decay_all", skip_serializing_if = "is_decay_all")]
        decay_biases_and_norms: bool,
    },
}

impl OptimizerPlan {
    /// Every real-valued setting with its spec key.
    pub fn settings(&self) -> Vec<(&'static str, f64)> {
        match *self {
            OptimizerPlan::Sgd { lr, momentum, weight_decay } => {
                vec![("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)]
            }
            OptimizerPlan::Adam { lr, beta1, beta2, eps, weight_decay, .. } => {
                vec![("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", weight_decay)]
            }
        }
    }

    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerPlan::Sgd { lr, .. } | OptimizerPlan::Adam { lr, .. } => lr,
        }
    }

    /// Optimizer-state floats per parameter (momentum buffer, Adam moments).
    pub fn state_per_parameter(&self) -> usize {
        match *self {
            OptimizerPlan::Sgd { momentum: 0.0, .. } => 0,
            OptimizerPlan::Sgd { .. } => 1,
            OptimizerPlan::Adam { .. } => 2,
        }
    }

    /// The optimizer's kind as a spec names it (SGD with momentum is `momentum`).
    pub fn kind(&self) -> OptimizerKind {
        match *self {
            OptimizerPlan::Sgd { momentum: 0.0, .. } => OptimizerKind::Sgd,
            OptimizerPlan::Sgd { .. } => OptimizerKind::Momentum,
            OptimizerPlan::Adam { decoupled: false, .. } => OptimizerKind::Adam,
            OptimizerPlan::Adam { decoupled: true, .. } => OptimizerKind::AdamW,
        }
    }
}

/// Where the data comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DataPlan {
    /// Deterministic data from the seed; `samples` distinct samples (absent: a fresh batch
    /// every step).
    Synthetic {
        task: Task,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        samples: Option<usize>,
    },
    /// A CSV file (absolute path), one sample per row, label last.
    Csv { path: String },
    /// NPY features and labels (absolute paths).
    Npy { path: String, labels: Option<String> },
    /// A language model's tokens: a UTF-8 text file read character by character (the
    /// vocabulary is its distinct characters in code-point order), or cut into tokens by a
    /// Hugging Face `tokenizer.json` (absolute path), then into windows.
    Text {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tokenizer: Option<String>,
    },
    /// A classifier's images: a folder (absolute path) of one folder per class, PNG or
    /// JPEG, resized, centre-cropped and normalised (`crate::images`).
    Images {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resize: Option<usize>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        mean: Vec<f64>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        std: Vec<f64>,
    },
    /// A language model's tokens: a `.npy` array of integer ids, or a raw file of `dtype`
    /// little-endian integers, cut into windows.
    Tokens {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        dtype: Option<crate::vocab::TokenDtype>,
    },
}

/// The most values (every sample's inputs and outputs) of a finite synthetic data set that
/// pipec's executor draws once and keeps; a larger one, like an endless one, is drawn as
/// training runs.
pub const SYNTHETIC_KEPT_VALUES: usize = 64 << 20;

/// What pipec's executor draws for one sample of synthetic data as training runs: normal
/// input values, uniform tokens, and the terms of the teacher's scores (one per input value
/// and output) that make its label or target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleDraw {
    pub features: usize,
    pub tokens: usize,
    pub scores: usize,
}

/// Each sample's draw, where pipec's executor draws the samples of a synthetic data set of
/// `samples` distinct ones (None: endless) as training runs, for a model of `numel` input
/// values (token ids where `tokens`) and `outputs` output values; None where it draws them
/// once and keeps them ([`SYNTHETIC_KEPT_VALUES`]). A language model's sequences
/// (`language_model`) are drawn token by token, each one's successor, always.
pub fn synthetic_draw(
    samples: Option<usize>,
    (numel, outputs): (usize, usize),
    tokens: bool,
    language_model: bool,
) -> Option<SampleDraw> {
    if language_model {
        return Some(SampleDraw { features: 0, tokens: numel + 1, scores: 0 });
    }
    if samples.is_some_and(|n| n > 0 && n.saturating_mul(numel + outputs) <= SYNTHETIC_KEPT_VALUES) {
        return None;
    }
    let scores = numel * outputs;
    Some(match tokens {
        true => SampleDraw { features: 0, tokens: numel, scores },
        false => SampleDraw { features: numel, tokens: 0, scores },
    })
}

/// The training loop's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingPlan {
    pub batch_size: usize,
    /// Microbatches per step; with context parallelism each one's `context_parallel`
    /// sequence chunks are counted as microbatches of their own.
    pub microbatches: usize,
    /// Samples per microbatch (whole sequences).
    pub microbatch_size: usize,
    /// Context parallelism: each sample's sequence is cut into 2·cp equal chunks, and
    /// microbatch m·cp + c of a step holds chunks c and 2·cp − 1 − c of every sequence of
    /// the step's m-th batch slice of `microbatch_size` samples ([`context_positions`]).
    /// A stage's replicas then come in groups of cp consecutive ones (replica i at position
    /// i mod cp, running the chunk-microbatches c = i mod cp), whose attention layers
    /// gather the group's keys and values. 1: off.
    #[serde(default = "one_usize", skip_serializing_if = "is_one_usize")]
    pub context_parallel: usize,
    pub steps: usize,
    pub optimizer: OptimizerPlan,
    pub precision: Precision,
    /// The precision gradients are accumulated and reduced in.
    #[serde(default = "fp32", skip_serializing_if = "is_fp32")]
    pub grad_precision: Precision,
    pub seed: u64,
    pub data: DataPlan,
    pub checkpoint_every: Option<usize>,
    pub checkpoint_dir: Option<String>,
    /// Each step that checkpoints waits for its own write (`checkpoint.async: false`);
    /// otherwise only for the previous one's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checkpoint_sync: bool,
    /// The learning-rate schedule, gradient clipping and sample order.
    #[serde(default, skip_serializing_if = "Recipe::is_default")]
    pub recipe: Recipe,
    /// The Hugging Face folder `pipec run --init` started the weights from (an absolute
    /// path), so `pipec export` can carry its tokenizer and its config's token ids and
    /// context over; None for a run that started from pipec's initialisation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<String>,
    /// FP8 training: the blocks' matrix products in FP8 (`precision` is then bf16, what the
    /// rest runs in); None without.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<Fp8Plan>,
    /// The precision of the optimizer's moments (Megatron-LM's precision-aware optimizer:
    /// `--exp-avg-dtype`, `--exp-avg-sq-dtype`); fp32 unless the spec says otherwise.
    #[serde(default = "fp32", skip_serializing_if = "is_fp32")]
    pub state_precision: Precision,
    /// Whether a bf16 or fp16 plan's optimizer updates fp32 master weights (true unless the
    /// spec says `optimizer.master_weights: false`: the weights in the training precision
    /// alone, updated in place).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub master_weights: bool,
}

pub use crate::recompute::{BlockRecompute, Halves, RunAgain};

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

/// FP8 training as a recipe runs it (`training.fp8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp8Plan {
    pub recipe: crate::vocab::Fp8Recipe,
    /// What a block's linear layers keep of their inputs for the weight gradient: FP8
    /// (Transformer Engine) or bf16 (torchao's `Float8Linear` keeps the high-precision input).
    pub activations: crate::vocab::Fp8Storage,
    /// Whether FP8 copies of every block weight (and of its transpose, which the backward's
    /// input gradient reads) are kept from a step's first microbatch to its update
    /// (Transformer Engine's weight cache, which Megatron-LM uses between microbatches);
    /// otherwise each is made for its product and dropped.
    pub weight_copies: bool,
    /// What ZeRO-3 gathers a block's weights in: FP8 (torchao's
    /// `enable_fsdp_float8_all_gather`, Megatron-LM's `--fp8-param-gather`) or bf16.
    pub gather: crate::vocab::Fp8Storage,
}

impl Fp8Plan {
    /// FP8 training with `recipe` as `engine`'s kernels run it, where a spec or an engine's
    /// configuration says no more: Transformer Engine's under Megatron-LM (and under pipec's
    /// and DeepSpeed's plans) — linear layers keeping their FP8 inputs, FP8 weight copies kept
    /// between microbatches; torchao's `Float8Linear` under torchtitan — the bf16 inputs
    /// kept, the weights cast every pass. Both gather bf16 weights under ZeRO-3.
    pub fn of_engine(engine: crate::vocab::Engine, recipe: crate::vocab::Fp8Recipe) -> Fp8Plan {
        use crate::vocab::{Engine, Fp8Storage};
        let torchao = match engine {
            Engine::Torchtitan => true,
            Engine::Megatron | Engine::Deepspeed | Engine::Pipec => false,
        };
        Fp8Plan {
            recipe,
            activations: if torchao { Fp8Storage::Bf16 } else { Fp8Storage::Fp8 },
            weight_copies: !torchao,
            gather: Fp8Storage::Bf16,
        }
    }
}

impl TrainingPlan {
    /// The learning rate of step `step` (from 0): the optimizer's, along the schedule.
    pub fn lr_at(&self, step: usize) -> f64 {
        let lr = self.optimizer.lr();
        self.recipe.lr_schedule.map_or(lr, |s| s.lr(lr, step))
    }
}

/// The schedule that produced the streams.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleInfo {
    pub kind: ScheduleKind,
    pub virtual_stages: usize,
    /// Whether training equals one-device training (no stale weights).
    pub synchronous: bool,
    /// Weight versions a stage may keep at once (1 for flush schedules).
    pub weight_versions: usize,
    /// How replicated stages sum their gradients (`ring` or `ps`).
    pub reduce: ReduceMode,
    /// Asynchronous data parallelism (parameter server): the staleness bound; None otherwise.
    #[serde(default)]
    pub staleness: Option<usize>,
    /// Megatron-LM's sequence parallelism beside tensor parallelism (the cost and memory
    /// model's accounting; the executor computes tensor parallelism's values).
    #[serde(default, skip_serializing_if = "is_false")]
    pub sequence_parallel: bool,
    /// Tensor parallelism's collectives overlapped with each layer's computation (the cost
    /// model's accounting; the executor runs them in line).
    #[serde(default, skip_serializing_if = "is_false")]
    pub tp_overlap: bool,
    /// How context parallelism exchanges keys and values (the cost and memory model's
    /// accounting; the executor all-gathers them). `all_gather` without context
    /// parallelism.
    #[serde(default, skip_serializing_if = "is_all_gather")]
    pub cp_comm: crate::vocab::CpComm,
    /// How expert parallelism dispatches tokens (the cost model's accounting; the executor
    /// runs an all-to-all). `all_to_all` without expert
    /// parallelism.
    #[serde(default, skip_serializing_if = "is_all_to_all")]
    pub moe_dispatch: crate::vocab::MoeDispatch,
    /// Megatron-LM's expert-parallel overlap (`--overlap-moe-expert-parallel-comm`): the
    /// 1F1B phase's forwards and backwards of different microbatches run as overlapped
    /// pairs (`crate::schedule::Pairing::OtherTask`), each one's all-to-alls under the
    /// other's computation (the cost model's accounting; the executor runs a pair's passes
    /// one after the other). False without expert parallelism.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ep_overlap: bool,
    /// Expert tensor parallelism 1 beside tensor parallelism (the spec's `etp: 1`): each
    /// routed expert whole on one device, a stage's `expert_parallel` replicas' tensor-parallel
    /// ranks forming one expert-parallel group of expert_parallel × tp devices (the cost
    /// model's accounting; the executor refuses it). False: experts split like the block.
    #[serde(default, skip_serializing_if = "is_false")]
    pub whole_experts: bool,
    /// ZeRO's sharding across each replicated stage's data-parallel replicas: the streams
    /// reduce-scatter its gradients (`gradient_shard`), update the shard (`step_shard`)
    /// and, at stages 1 and 2, all-gather the weights (`weights`); at stage 3 each pass
    /// gathers the weights it computes with.
    #[serde(default = "no_sharding", skip_serializing_if = "is_unsharded")]
    pub sharding: Sharding,
    /// What every transformer block recomputes by module or operation, of which first
    /// blocks whole, and whether it offloads (the spec's `recompute` mapping); None
    /// otherwise (selective recompute is each stage's `selective_recompute`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_recompute: Option<BlockRecompute>,
}

impl ScheduleInfo {
    /// Whether every stage updates once per step, all together (not PipeDream's, 2BW's or
    /// asynchronous data parallelism's own clocks): what a global gradient norm needs.
    pub fn updates_every_step(&self) -> bool {
        self.kind.updates_per_step() && self.staleness.is_none()
    }

    /// The forward–backward pairs the plan overlaps (DualPipe's, or Megatron-LM's combined
    /// 1F1B under `ep_overlap`), if any.
    pub fn pairing(&self) -> Option<crate::schedule::Pairing> {
        crate::schedule::Pairing::of(self.kind, self.ep_overlap)
    }
}

fn no_sharding() -> Sharding {
    Sharding::None
}

fn is_unsharded(s: &Sharding) -> bool {
    *s == Sharding::None
}

/// One pipeline stage (a virtual stage for interleaved schedules).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    pub id: StageId,
    /// Half-open layer range `[start, end)`.
    pub layers: [usize; 2],
    /// The devices holding a replica of this stage, one per replica.
    pub replicas: Vec<DeviceId>,
    /// route[mb] = index into `replicas` of the replica that runs microbatch mb.
    pub route: Vec<u32>,
    /// The collective group of the replicas (when there is more than one).
    pub group: Option<GroupId>,
    pub parameters: u64,
    pub forward_s: f64,
    pub backward_s: f64,
    /// One optimizer update of the stage's parameters (per tensor-parallel rank); only
    /// written when a profile measured it (the analytic cost model has no figure for it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub update_s: f64,
    /// Activation recompute: the forward keeps only the stage's input, and a `recompute`
    /// instruction rebuilds the rest before the backward.
    pub recompute: bool,
    /// Selective recompute: each transformer block's attention core is recomputed in its
    /// backward instead of kept (the cost and memory model's accounting).
    #[serde(default, skip_serializing_if = "is_false")]
    pub selective_recompute: bool,
    /// Bytes kept for the backward per microbatch (with recompute: the checkpointed inputs).
    pub activation_bytes_per_microbatch: u64,
    /// Bytes of the stage's output per microbatch (what is sent to the next stage).
    pub output_bytes_per_microbatch: u64,
    /// Megatron tensor parallelism: per replica, the devices that split the stage's layers
    /// (the replica's device first). Empty when the stage is not tensor-parallel. Every
    /// member runs the same stream with its peers shifted by its rank in the group; its
    /// forward and backward include the group's all-reduces.
    #[serde(default)]
    pub tensor_parallel: Vec<Vec<DeviceId>>,
    /// Expert parallelism: the stage's replicas form groups of this many consecutive ones
    /// (replica i in group i / ep at position i mod ep); the member at position j holds the
    /// j-th 1/ep of every expert block's routed experts, the group's members exchange the
    /// routed tokens in all-to-alls inside every forward, recompute and backward, and the
    /// stage's gradient all-reduce over `group` sums the routed experts' part only over the
    /// replicas at the same position. 1 (the default): every replica holds every expert.
    #[serde(default = "one_u32", skip_serializing_if = "is_one_u32")]
    pub expert_parallel: u32,
    /// Expert parallelism: seconds per microbatch of the all-to-alls inside a forward and a
    /// backward (part of what those passes wait for; `forward_s` and `backward_s` are the
    /// kernels).
    #[serde(default, skip_serializing_if = "is_zero_pair")]
    pub all_to_all_s: [f64; 2],
    /// Expert parallelism: the stage's mixture-of-experts layers, first to last, and the
    /// bytes per member of each all-to-all its passes post at each
    /// ([`Instr::all_to_alls_of`]). Empty without expert parallelism.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub all_to_alls: Vec<crate::instr::ExpertExchange>,
    /// Context parallelism: seconds per microbatch of the exchanges of keys and values
    /// inside a forward and a backward (part of what those passes wait for).
    #[serde(default, skip_serializing_if = "is_zero_pair")]
    pub context_s: [f64; 2],
    /// Data-parallel gradient buckets (PyTorch DDP's, `bucket` in the strategy), the last
    /// layers' first: the replica all-reduce that directly follows the stage's last
    /// backward (or weight-gradient pass) of a step ([`reduced_in_buckets`]) runs as one
    /// all-reduce per bucket, each started during that pass as soon as its layers'
    /// gradients are complete.
    /// Empty: one all-reduce after the backward.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gradient_buckets: Vec<GradientBucket>,
}

/// One bucket of a stage's gradients ([`StagePlan::gradient_buckets`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradientBucket {
    /// Half-open layer range `[start, end)` whose weight gradients it carries.
    pub layers: [usize; 2],
    /// Bytes it carries per member (its layers' share of the stage's gradient bytes).
    pub bytes: u64,
    /// The fraction of the stage's backward done when its gradients are complete (the
    /// cost model's backward time of the layers from the stage's end down to `layers[0]`).
    pub ready: f64,
}

/// What is wrong with a stage's gradient buckets (None: nothing): they must tile its layers
/// from the last down, each non-empty, with `ready` rising in (0, 1] to 1 at the last,
/// and only on a replicated stage without tensor or expert parallelism.
fn bucket_error(s: &StagePlan) -> Option<String> {
    let b = &s.gradient_buckets;
    if b.is_empty() {
        return None;
    }
    if s.replicas.len() < 2 || !s.tensor_parallel.is_empty() || s.expert_parallel > 1 {
        return Some("need a replicated stage without tensor or expert parallelism".into());
    }
    let mut end = s.layers[1];
    let mut ready = 0.0;
    for (k, x) in b.iter().enumerate() {
        if x.layers[1] != end || x.layers[0] >= x.layers[1] || !(x.ready > 0.0 && x.ready <= 1.0) || x.ready < ready {
            return Some(format!(
                "#{k} ({:?}, ready {}) does not continue the buckets down from layer {end}",
                x.layers, x.ready
            ));
        }
        (end, ready) = (x.layers[0], x.ready);
    }
    (end != s.layers[0] || ready != 1.0).then(|| {
        format!("stop at layer {end} (ready {ready}), not at the stage's first layer {} (ready 1)", s.layers[0])
    })
}

/// Whether the collective at `at` of `stream` is a replica gradient reduction (an
/// all-reduce, or ZeRO's reduce-scatter into the gradient shard) that the stage's backward
/// (or weight-gradient pass) just before it feeds (only sends, `Free`s of the stage and,
/// under ZeRO, the wait for the stage's previous reduce-scatter between): with
/// [`StagePlan::gradient_buckets`] it runs in buckets inside that pass. Returns the pass's
/// position. The one rule the simulator and the executor read.
pub fn reduced_in_buckets(stream: &[Instr], at: usize) -> Option<usize> {
    use crate::CollectivePayload::{GradientShard, Gradients};
    let Some(Instr::Collective { payload: payload @ (Gradients | GradientShard), stage, .. }) = stream.get(at) else {
        return None;
    };
    for k in (0..at).rev() {
        match stream[k] {
            Instr::Backward { stage: s, .. } | Instr::BackwardWeight { stage: s, .. } if s == *stage => return Some(k),
            Instr::Free { stage: s, .. } if s == *stage => {}
            Instr::WaitCollective { payload: p, stage: s, .. } if s == *stage && p == *payload => {}
            Instr::SendGradient { .. } | Instr::SendActivation { .. } => {}
            // the backward's own exchanges
            Instr::AllToAll { stage: s, .. } if s == *stage => {}
            _ => return None,
        }
    }
    None
}

/// The passes of `stream` that feed a bucketed replica reduction: each one's position with
/// the position of the collective it feeds ([`reduced_in_buckets`]), on a stage that
/// `has_buckets` says has gradient buckets. The one list the compiler's declaration, the
/// verifier and the executor read.
pub fn bucketed_passes(stream: &[Instr], has_buckets: impl Fn(StageId) -> bool) -> Vec<(usize, usize)> {
    (0..stream.len())
        .filter_map(|j| {
            let pass = reduced_in_buckets(stream, j)?;
            has_buckets(stream[j].stage()).then_some((pass, j))
        })
        .collect()
}

fn is_all_to_all(d: &crate::vocab::MoeDispatch) -> bool {
    *d == crate::vocab::MoeDispatch::AllToAll
}

fn is_all_gather(c: &crate::vocab::CpComm) -> bool {
    *c == crate::vocab::CpComm::AllGather
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}
fn one_usize() -> usize {
    1
}

fn is_one_usize(x: &usize) -> bool {
    *x == 1
}

/// The positions of a sequence of `seq` that context-parallel member `position` of `cp`
/// computes, in order: chunks `position` and 2·cp − 1 − `position` of 2·cp equal chunks
/// (Megatron-LM's load-balanced split: under a causal mask every member's attention
/// covers the same number of query–key pairs). All positions for cp = 1.
pub fn context_positions(seq: usize, cp: usize, position: usize) -> Vec<usize> {
    if cp <= 1 {
        return (0..seq).collect();
    }
    let chunk = seq / (2 * cp);
    let late = 2 * cp - 1 - position;
    (position * chunk..(position + 1) * chunk).chain(late * chunk..(late + 1) * chunk).collect()
}

fn one_u32() -> u32 {
    1
}
fn is_one_u32(x: &u32) -> bool {
    *x == 1
}
fn is_zero_pair(x: &[f64; 2]) -> bool {
    x[0] == 0.0 && x[1] == 0.0
}

/// Per-device memory, in bytes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub activations: u64,
    /// What a backward holds beyond the kept activations at its peak: a recomputed unit's
    /// tensors, the gradients at a block's widest point.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub transient: u64,
    /// Communication buffers (in-flight sends and receives).
    pub buffers: u64,
    /// The documented workspace reserve.
    pub workspace: u64,
    pub total: u64,
    pub capacity: u64,
}

impl MemoryBreakdown {
    /// The share of the capacity left free, 1 − total/capacity (None without a capacity).
    pub fn headroom(&self) -> Option<f64> {
        (self.capacity > 0).then(|| 1.0 - self.total as f64 / self.capacity as f64)
    }
}

/// One device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DevicePlan {
    pub id: DeviceId,
    pub node: u32,
    pub stages: Vec<StageId>,
    pub memory: MemoryBreakdown,
    /// Peak number of microbatches whose activations a stage keeps at once, per stage held.
    pub peak_in_flight: BTreeMap<StageId, u32>,
}

/// A collective group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupPlan {
    pub id: GroupId,
    pub stage: StageId,
    pub devices: Vec<DeviceId>,
    /// A weight-tying group: the embedding layer and the output projection whose tied
    /// weight its `tiedallreduce`s sum (its members hold either layer's stage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie: Option<[usize; 2]>,
    /// An expert-parallel group: the replicas of `stage` that exchange tokens in its
    /// passes' all-to-alls (`Instr::AllToAll`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub experts: bool,
}

/// Cost-model inputs of one layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerPlan {
    pub index: usize,
    pub op: Op,
    pub label: Option<String>,
    /// Where each operand comes from, when the layer does not simply read the layer before
    /// it (a join, or a branch starting from an earlier tensor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inputs: Option<Vec<Source>>,
    /// Weight tying: this output projection's weight is the transpose of the embedding
    /// table of that layer (a separate copy kept equal: both apply the summed gradient).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied: Option<usize>,
    pub input_shape: Vec<usize>,
    pub output_shape: Vec<usize>,
    pub parameters: u64,
    pub parameter_bytes: u64,
    pub forward_flops_per_sample: f64,
    pub backward_flops_per_sample: f64,
    /// Seconds per microbatch (analytic or measured).
    pub forward_s: f64,
    pub backward_s: f64,
    /// Bytes kept for the backward, per sample.
    pub activation_bytes_per_sample: u64,
    /// Bytes of the layer's output, per sample.
    pub output_bytes_per_sample: u64,
}

impl LayerPlan {
    /// The layer's operands: as listed, or the layer before it.
    pub fn operands(&self) -> Vec<Source> {
        self.inputs.clone().unwrap_or_else(|| vec![Source::before(self.index)])
    }
}

/// What the simulator predicted for one step.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Simulation {
    /// Predicted seconds per step (with `first_step_time_s`: the steady state of a
    /// flush-free pipeline, what PipeDream's optimizer predicts per minibatch).
    pub step_time_s: f64,
    /// A flush-free pipeline's first step, while it fills.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_step_time_s: Option<f64>,
    /// Idle share of device-time over the step.
    pub bubble_fraction: f64,
    pub throughput_samples_per_s: f64,
    /// A language model's tokens trained per second per device of the plan (what trainers
    /// print as tokens/s/GPU); absent for any other model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s_per_device: Option<f64>,
    /// A language model's model FLOPs utilization at the predicted step, by the count of the
    /// engine the plan is for (`crate::flops`); absent for any other model, or one with a
    /// layer the count does not cover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mfu: Option<crate::flops::Mfu>,
    pub devices: Vec<DeviceSimulation>,
}

/// Per-device predictions.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DeviceSimulation {
    pub id: DeviceId,
    pub busy_s: f64,
    pub bubble_fraction: f64,
    pub peak_memory_bytes: u64,
    /// Seconds per step the device's all-reduces are in flight on its communication engine.
    #[serde(default)]
    pub collective_s: f64,
    /// The part of `collective_s` the device waits for (not hidden behind its compute).
    #[serde(default)]
    pub exposed_collective_s: f64,
    /// Predicted seconds per step of the device's own instructions, by kind
    /// (`Phase::name`; a collective's time on the communication engine is not counted).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub by_phase: BTreeMap<String, f64>,
    /// Seconds per step the device's DualPipe pairs took less than their passes one after
    /// the other: the all-to-alls they hid under the other pass's computation.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub overlapped_s: f64,
}

impl Plan {
    /// The model's operators, in layer order.
    pub fn model_ops(&self) -> Vec<crate::model::Op> {
        self.layers.iter().map(|l| l.op.clone()).collect()
    }

    /// The instruction a step's `instruction_code` names on `device`.
    pub fn instruction(&self, device: DeviceId, code: usize) -> Option<&Instr> {
        let (segment, index) = (code >> 40, code & ((1 << 40) - 1));
        let stream = match (segment, &self.flush_free) {
            (0, _) => self.streams.get(&device),
            (1, Some(f)) => f.prologue.get(&device),
            (2, Some(f)) => f.epilogue.get(&device),
            _ => None,
        };
        stream.and_then(|s| s.get(index))
    }

    /// The plan's streams in text form, one instruction per line under a `device dN:` header.
    pub fn streams_text(&self) -> String {
        let mut out = String::new();
        let write = |out: &mut String, stream: &[Instr]| {
            for (i, ins) in stream.iter().enumerate() {
                out.push_str(&format!("  {i:4}  {ins}\n"));
            }
        };
        for (dev, stream) in &self.streams {
            match &self.flush_free {
                None => {
                    out.push_str(&format!("device {dev}:\n"));
                    write(&mut out, stream);
                }
                Some(f) => {
                    // microbatch numbers are relative to the segment's step
                    out.push_str(&format!("device {dev} prologue (once, before the first step):\n"));
                    write(&mut out, f.prologue.get(dev).map_or(&[][..], Vec::as_slice));
                    out.push_str(&format!("device {dev} body (every step but the one that drains):\n"));
                    write(&mut out, stream);
                    out.push_str(&format!(
                        "device {dev} epilogue (the step that drains: the last, one before a checkpoint):\n"
                    ));
                    write(&mut out, f.epilogue.get(dev).map_or(&[][..], Vec::as_slice));
                }
            }
        }
        out
    }

    /// A language model's tokens per sample (its sequence length: the model maps a sequence
    /// of token ids to next-token scores under cross-entropy), the factor from samples/s to
    /// tokens/s; None for any other model.
    pub fn tokens_per_sample(&self) -> Option<usize> {
        let out = self.layers.last().map(|l| l.output_shape.as_slice()).unwrap_or_default();
        crate::flops::language_model_tokens(&self.model.input, out, self.model.token_vocab, self.model.loss)
    }

    /// Multi-token prediction's layers after the model's (`crate::model::Mtp::layers`), with
    /// whether each holds its own weights; empty without.
    pub fn mtp_layers(&self) -> Vec<(crate::model::Op, bool)> {
        self.model.mtp.map(|m| m.layers(self.layers.iter().map(|l| &l.op))).unwrap_or_default()
    }

    /// What turns this plan's samples/s on `devices` devices into tokens/s per device and
    /// MFU against `peak` (None: not known), by the count of the engine the plan is for; None
    /// for a model that is not a language model.
    pub fn utilization(&self, devices: usize, peak: Option<crate::flops::Peak>) -> Option<crate::flops::Utilization> {
        let mtp = self.mtp_layers();
        Some(crate::flops::Utilization::of_model(
            self.layers.iter().map(|l| (&l.op, l.tied)).chain(mtp.iter().map(|(op, _)| (op, None))),
            self.tokens_per_sample()?,
            self.engine.name,
            devices,
            peak,
        ))
    }

    /// Throughput as a report writes it: samples/s, and for a language model tokens/s too.
    pub fn throughput_text(&self, samples_per_s: f64) -> String {
        match self.tokens_per_sample() {
            Some(seq) => format!("{:.1} samples/s ({:.0} tokens/s)", samples_per_s, samples_per_s * seq as f64),
            None => format!("{samples_per_s:.1} samples/s"),
        }
    }

    /// The tightest memory headroom over the devices with a capacity: 1 − used/capacity
    /// (infinite when no device states one).
    pub fn memory_headroom(&self) -> f64 {
        self.devices.iter().filter_map(|d| d.memory.headroom()).fold(f64::INFINITY, f64::min)
    }

    /// The stage by id.
    pub fn stage(&self, id: StageId) -> Option<&StagePlan> {
        self.stages.get(id.0 as usize).filter(|s| s.id == id)
    }

    /// Reads a plan from JSON, checking the version.
    pub fn from_json(text: &str) -> Result<Plan, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not a plan: {e}"))?;
        let version = v.get("version").and_then(serde_json::Value::as_u64).ok_or("not a plan: no `version`")?;
        if version != u64::from(PLAN_VERSION) {
            return Err(format!("plan format version {version} is not supported (this pipec reads version {PLAN_VERSION}); recompile the spec"));
        }
        serde_json::from_value(v).map_err(|e| format!("malformed plan: {e}"))
    }
}

/// The most (stage, microbatch) pairs a plan may hold, for specs and plan files alike:
/// bounds the instruction streams (about 8 instructions per pair) and the compile time (a
/// few seconds).
pub const MAX_STAGE_MICROBATCHES: usize = 1 << 20;

impl Plan {
    /// Structural checks of a plan read from a file: every index in range, the layer
    /// chain's shapes consistent, stages covering the layers in order, routes and groups
    /// well-formed. A compiled plan passes them; a hand-edited one that does not is refused
    /// before anything runs. (The compiler's verifier then checks the streams' meaning.)
    /// The settings a spec's checker enforces, on the plan's fields (`crate::rules`): the
    /// same rules, so a hand-edited plan.json is held to its spec's standard.
    fn check_settings(&self) -> Vec<String> {
        use crate::rules::{inside_output_folder, optimizer_bound, training_minimum};
        let t = &self.training;
        let mut out = Vec::new();
        if let Err(e) = inside_output_folder(&self.name) {
            out.push(format!("name: {e} (the name is the default output folder)"));
        }
        if let Some(dir) = &t.checkpoint_dir {
            if let Err(e) = inside_output_folder(dir) {
                out.push(format!("training.checkpoint_dir: {e}"));
            }
        }
        let mut minimum = |key: &str, v: usize| {
            if (v as u64) < training_minimum(key) {
                out.push(format!("training.{key} must be at least {}, found {v}", training_minimum(key)));
            }
        };
        minimum("steps", t.steps);
        if let Some(every) = t.checkpoint_every {
            minimum("checkpoint_every", every);
        }
        if let DataPlan::Synthetic { samples: Some(n), .. } = t.data {
            minimum("samples", n);
        }
        for (key, v) in t.optimizer.settings() {
            let bound = optimizer_bound(key);
            if !bound.admits(v) {
                out.push(format!("training.optimizer.{key} must be {}, found {v}", bound.describe()));
            }
        }
        let finite = !matches!(t.data, DataPlan::Synthetic { samples: None, .. });
        for (key, problem) in t.recipe.problems(t.optimizer.lr(), finite) {
            out.push(format!("training.{key}: {problem}"));
        }
        out
    }

    pub fn check(&self) -> Vec<String> {
        let mut out = self.in_pass.check();
        let t = &self.training;
        if let Some(problem) = self.engine.problem() {
            out.push(format!("engine: {problem}"));
        }
        if self.model.input.is_empty() || self.model.input.contains(&0) {
            out.push(format!("model.input {:?} must be non-empty with every dimension ≥ 1", self.model.input));
        } else if let Err(m) = crate::model::check_shape(&self.model.input) {
            out.push(format!("model.input {m}"));
        }
        // the layer graph: operands defined before use, shapes consistent
        for (i, l) in self.layers.iter().enumerate() {
            if l.index != i {
                out.push(format!("layers[{i}] has index {}", l.index));
            }
            let operands = l.operands();
            if operands.len() != l.op.arity() {
                out.push(format!(
                    "layer {i} ({}) takes {} input(s), the plan gives {}",
                    l.op.name(),
                    l.op.arity(),
                    operands.len()
                ));
                break;
            }
            let mut shapes: Vec<&[usize]> = Vec::with_capacity(operands.len());
            for s in &operands {
                match *s {
                    Source::Input => shapes.push(&self.model.input),
                    Source::Layer(p) if p < i => shapes.push(&self.layers[p].output_shape),
                    Source::Layer(p) => {
                        out.push(format!("layer {i} reads layer {p}, which does not come before it"));
                    }
                }
            }
            if shapes.len() != operands.len() {
                break;
            }
            match l.op.join_shape(&shapes) {
                Ok(next) if next == l.output_shape && shapes[0] == l.input_shape.as_slice() => {}
                Ok(next) => {
                    out.push(format!(
                        "layer {i} ({}) maps {:?} to {next:?}, but the plan says {:?} → {:?}",
                        l.op.name(),
                        shapes[0],
                        l.input_shape,
                        l.output_shape
                    ));
                    break;
                }
                Err(e) => {
                    out.push(format!("layer {i} ({}): {}", l.op.name(), e.message));
                    break;
                }
            }
        }
        if self.layers.is_empty() {
            out.push("the plan has no layers".into());
        }
        // every collective carries what its kind can
        for (d, stream) in &self.streams {
            if let Some(ins) =
                stream.iter().find(|i| matches!(i, Instr::Collective { kind, payload, .. } if !payload.takes(*kind)))
            {
                out.push(format!("{d}: `{ins}`: a collective of that kind cannot carry that payload"));
            }
        }
        // every all-to-all over an expert group of its stage that has the device
        let expert_groups: BTreeMap<GroupId, &GroupPlan> =
            self.groups.iter().filter(|g| g.experts).map(|g| (g.id, g)).collect();
        for (d, stream) in &self.streams {
            let stray = stream.iter().find(|i| match i {
                Instr::AllToAll { stage, group, .. } => {
                    expert_groups.get(group).is_none_or(|g| g.stage != *stage || !g.devices.contains(d))
                }
                _ => false,
            });
            if let Some(ins) = stray {
                out.push(format!("{d}: `{ins}`: not an expert group of that stage with {d} in it"));
            }
        }
        // the token vocabulary is the first layer's, when that is an embedding
        let vocab = match self.layers.first().map(|l| &l.op) {
            Some(Op::Embedding { vocab, .. }) => Some(*vocab),
            _ => None,
        };
        if self.model.token_vocab != vocab {
            let shown = |v: Option<usize>| v.map_or("none".to_string(), |v| v.to_string());
            out.push(format!(
                "model.token_vocab is {}, and the first layer's vocabulary is {} (it must be the embedding's, or absent without one)",
                shown(self.model.token_vocab),
                shown(vocab)
            ));
        }
        for l in &self.layers {
            if let Some(a) = l.tied {
                let fits = match (self.layers.get(a).map(|e| &e.op), &l.op) {
                    (Some(Op::Embedding { vocab, dim, .. }), Op::Linear { in_features, out_features, bias: false }) => {
                        a < l.index && vocab == out_features && dim == in_features
                    }
                    _ => false,
                };
                if !fits {
                    out.push(format!(
                        "layer {} is tied to layer {a}, which is not an earlier embedding of its transposed shape (or it has a bias)",
                        l.index
                    ));
                }
            }
        }
        // training
        if t.batch_size == 0
            || t.microbatches == 0
            || !t.batch_size.is_multiple_of((t.microbatches / t.context_parallel.max(1)).max(1))
            || t.context_parallel == 0
            || !t.microbatches.is_multiple_of(t.context_parallel.max(1))
            || t.microbatch_size.checked_mul(t.microbatches / t.context_parallel.max(1)) != Some(t.batch_size)
        {
            out.push(format!(
                "training: batch_size {} must split into {} microbatches of {} (context parallelism {})",
                t.batch_size, t.microbatches, t.microbatch_size, t.context_parallel
            ));
        }
        out.extend(self.check_settings());
        // no tensor of a microbatch beyond 2^32 elements (16 GiB in fp32)
        let elements = |shape: &[usize]| shape.iter().try_fold(t.microbatch_size.max(1), |a, &d| a.checked_mul(d));
        let mut shapes =
            std::iter::once(self.model.input.as_slice()).chain(self.layers.iter().map(|l| l.output_shape.as_slice()));
        if shapes.any(|s| elements(s).is_none_or(|e| e > 1 << 32)) {
            out.push(format!("a microbatch of {} samples makes tensors of more than 2^32 elements", t.microbatch_size));
        }
        // stages
        if self.stages.is_empty() {
            out.push("the plan has no stages".into());
        }
        if self.stages.len().saturating_mul(t.microbatches) > MAX_STAGE_MICROBATCHES {
            out.push(format!(
                "{} stages × {} microbatches is more than pipec runs ({MAX_STAGE_MICROBATCHES})",
                self.stages.len(),
                t.microbatches
            ));
            return out;
        }
        let n_dev = self.devices.len();
        let mut next_layer = 0;
        for (i, s) in self.stages.iter().enumerate() {
            if s.id.0 as usize != i {
                out.push(format!("stages[{i}] has id {}", s.id));
            }
            let [a, b] = s.layers;
            if a != next_layer || b <= a || b > self.layers.len() {
                out.push(format!("stage {i} covers layers [{a}, {b}), expected a non-empty range starting at {next_layer} within the {} layers", self.layers.len()));
            }
            next_layer = b;
            if s.replicas.is_empty() || s.replicas.iter().any(|d| d.0 as usize >= n_dev) {
                out.push(format!(
                    "stage {i}: replicas {:?} must be non-empty devices of the plan's {n_dev}",
                    s.replicas.iter().map(|d| d.0).collect::<Vec<_>>()
                ));
            }
            if s.route.len() != t.microbatches || s.route.iter().any(|&r| r as usize >= s.replicas.len()) {
                out.push(format!(
                    "stage {i}: its route must name a replica for each of the {} microbatches",
                    t.microbatches
                ));
            }
            if let Some(g) = s.group {
                if !self.groups.iter().any(|x| x.id == g && x.stage == s.id) {
                    out.push(format!("stage {i}: its group {g} is not a group of this stage in the plan"));
                }
            }
            if !s.tensor_parallel.is_empty() {
                let size = s.tensor_parallel[0].len();
                let ok = s.tensor_parallel.len() == s.replicas.len()
                    && size >= 2
                    && s.tensor_parallel.iter().zip(&s.replicas).all(|(g, r)| {
                        g.len() == size && g.first() == Some(r) && g.iter().all(|d| (d.0 as usize) < n_dev)
                    });
                if !ok {
                    out.push(format!("stage {i}: each replica needs a tensor-parallel group of one size, led by the replica's device"));
                }
            }
            let ep = s.expert_parallel as usize;
            // groups of consecutive replicas, or of one direction's copies across pipeline pairs
            let groupable =
                if self.schedule.kind.chunk_placement().paired() { s.replicas.len() / 2 } else { s.replicas.len() };
            if ep == 0 || !groupable.is_multiple_of(ep) {
                out.push(format!(
                    "stage {i}: expert_parallel = {ep} must be at least 1 and divide its {} replicas",
                    s.replicas.len()
                ));
            } else if ep > 1 {
                let range = s.layers[0].min(s.layers[1])..s.layers[1].min(self.layers.len());
                let experts: Vec<usize> =
                    self.layers[range].iter().filter_map(|l| l.op.moe()).map(|m| m.experts).collect();
                if experts.is_empty() || experts.iter().any(|e| e % ep != 0) {
                    out.push(format!("stage {i}: expert_parallel = {ep} must divide the experts of its expert blocks (it has {experts:?})"));
                }
            }
            if let Some(why) = bucket_error(s) {
                out.push(format!("stage {i}: gradient_buckets {why}"));
            }
        }
        if next_layer != self.layers.len() && !self.stages.is_empty() {
            out.push(format!("the stages cover layers [0, {next_layer}) of {}", self.layers.len()));
        }
        // devices and groups
        for (i, d) in self.devices.iter().enumerate() {
            if d.id.0 as usize != i {
                out.push(format!("devices[{i}] has id {}", d.id));
            }
        }
        let mut group_ids = std::collections::BTreeSet::new();
        for g in &self.groups {
            if !group_ids.insert(g.id)
                || g.devices.len() < 2
                || g.devices.iter().any(|d| d.0 as usize >= n_dev)
                || g.stage.0 as usize >= self.stages.len()
            {
                out.push(format!(
                    "group {}: needs a unique id, a stage of the plan and at least two of its devices",
                    g.id
                ));
            }
        }
        // streams: every index in range (a flush-free body's next-step microbatches too)
        let mb_limit = if self.flush_free.is_some() { 2 * t.microbatches } else { t.microbatches };
        let segments = self.flush_free.iter().flat_map(|f| f.prologue.iter().chain(&f.epilogue));
        for (dev, stream) in self.streams.iter().chain(segments).chain(self.eval.iter().flatten()) {
            if dev.0 as usize >= n_dev {
                out.push(format!("a stream for {dev}, which the plan does not have"));
                continue;
            }
            for (k, ins) in stream.iter().enumerate() {
                let bad_stage = ins.stage().0 as usize >= self.stages.len();
                let bad_mb = ins.microbatch().is_some_and(|m| m.0 as usize >= mb_limit);
                let bad_peer = ins.peer().is_some_and(|p| p.0 as usize >= n_dev);
                let bad_group = ins.group().is_some_and(|g| !group_ids.contains(&g));
                if bad_stage || bad_mb || bad_peer || bad_group {
                    out.push(format!(
                        "{dev}[{k}] `{ins}` names a stage, microbatch, device or group the plan does not have"
                    ));
                    break;
                }
            }
        }
        out
    }
}
