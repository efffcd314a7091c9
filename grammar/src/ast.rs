//! The typed spec: what lowering produces and every later phase reads. Every node keeps the
//! span of the YAML it came from where a later phase may need to point back at it.

use pipec_plan::model::{Loss, Op, Source};

use crate::span::Span;

/// A fully checked spec. Every field carries the span of the YAML it came from where a later
/// phase may need to point back at it.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub name: Option<String>,
    /// `engine:`: the engine the plan is for.
    pub engine: EngineChoice,
    pub model: Model,
    pub cluster: Cluster,
    pub strategy: Strategy,
    pub training: Training,
}

impl Spec {
    /// Whether the combined 1F1B's pairs (`ep_overlap`) run layer by layer, each layer's
    /// forward of one microbatch beside a layer's backward of the other, as Megatron-LM runs
    /// them (`model_chunk_schedule_plan.py`): a pair then holds about one microbatch's
    /// activations, its forward keeping what its backward frees. pipec's executor runs a
    /// pair's two passes one after the other, holding both.
    pub fn pairs_layer_by_layer(&self) -> bool {
        self.strategy.combined_1f1b() && self.engine.target.name != pipec_plan::vocab::Engine::Pipec
    }
    /// Whether a block's activations are split along the sequence outside the
    /// tensor-parallel products: `sequence_parallel` written, tensor parallelism, and an
    /// engine that runs it so (`KernelFamily::splits_sequence`; pipec's executor does not).
    /// The one rule the cost model, the memory model and the search read.
    pub fn sequence_split(&self) -> bool {
        self.strategy.sequence_parallel && self.strategy.tp > 1 && self.engine.family().splits_sequence()
    }

    /// What turns a step's samples/s into tokens/s per device of the cluster and MFU against
    /// its device's peak in the training precision, by the count of the engine the spec names;
    /// None for a model that is not a language model (`pipec_plan::flops`).
    pub fn utilization(&self) -> Option<pipec_plan::flops::Utilization> {
        let m = &self.model;
        let seq = pipec_plan::flops::language_model_tokens(&m.input, m.output_shape(), m.token_vocab(), m.loss)?;
        // multi-token prediction's layers count as the engines count them (Megatron-LM's
        // num_floating_point_operations: its blocks, projections and logits)
        let mtp = m.mtp.map(|p| p.layers(m.layers.iter().map(|l| &l.op))).unwrap_or_default();
        Some(pipec_plan::flops::Utilization::of_model(
            m.layers.iter().map(|l| (&l.op, l.tied)).chain(mtp.iter().map(|(op, _)| (op, None))),
            seq,
            self.engine.engine(),
            self.cluster.device_count(),
            Some(pipec_plan::flops::Peak::of(&self.cluster.device, self.training.precision)),
        ))
    }
}

/// The engine a spec names (`engine:`), at the release it resolved to.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineChoice {
    pub target: pipec_plan::engine::EngineTarget,
    /// The span of `engine:`'s value; None when the spec does not name an engine (pipec).
    pub span: Option<Span>,
    /// `compile: true` or `[model, ...]`: torchtitan compiles each block (`torch.compile`).
    pub compiled: bool,
    /// `compile: true` or `[..., loss]`: torchtitan compiles the loss too.
    pub loss_compiled: bool,
    /// `calibration: FILE` (`pipec calibrate --measured`), read, with its path as written.
    pub calibration: Option<(pipec_plan::engine::performance::CalibrationFile, String, Span)>,
    /// How fast the engine runs the kernels on the cluster's device (set once the cluster
    /// is lowered; the cluster's device model is already scaled by it).
    pub performance: Option<pipec_plan::engine::performance::Performance>,
}

impl EngineChoice {
    /// The kernels the engine runs.
    pub fn family(&self) -> pipec_plan::engine::performance::KernelFamily {
        pipec_plan::engine::performance::KernelFamily::of(self.target.name, self.compiled)
    }

    /// The cross-entropy the engine runs (`vocab_split`: tensor parallelism splits the
    /// logits over the vocabulary).
    pub fn cross_entropy(&self, vocab_split: bool) -> pipec_plan::engine::performance::CrossEntropy {
        self.family().cross_entropy(self.loss_compiled, vocab_split)
    }

    /// The engine.
    pub fn engine(&self) -> pipec_plan::vocab::Engine {
        self.target.name
    }
}

/// The model: per-sample input shape, the flattened list of layers in a topological order
/// (each layer after every layer it reads), the loss.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    pub input: Vec<usize>,
    pub input_span: Span,
    pub layers: Vec<Layer>,
    pub layers_span: Span,
    pub loss: Loss,
    pub loss_span: Span,
    /// How transformer blocks compute attention (`model.attention`, default standard).
    pub attention: Attention,
    /// Labelled block calls: the layers each expanded into.
    pub groups: Vec<LayerGroup>,
    /// The blocks and named tensors the model defines (for the editor).
    pub names: Vec<NameDef>,
    /// DeepSeek-V3's multi-token prediction after the last transformer block (`model.mtp`).
    pub mtp: Option<pipec_plan::model::Mtp>,
    /// Where `model.mtp` is written (the model's span without it).
    pub mtp_span: Span,
}

impl Model {
    /// The model's parameters, a weight tied to an embedding counted once (at the
    /// embedding): what `pipec check`, `pipec compile` and the editor's hover say.
    pub fn parameters(&self) -> u64 {
        pipec_plan::model::model_parameters(self.layers.iter().map(|l| (&l.op, l.tied)))
    }

    /// "N parameters", with the active ones per token for a mixture of experts, and those
    /// of the multi-token-prediction modules apart.
    pub fn parameters_text(&self) -> String {
        let text = pipec_plan::model::parameters_text(self.layers.iter().map(|l| (&l.op, l.tied)));
        let mtp = self.mtp.map(|m| m.parameters_text(self.layers.iter().map(|l| &l.op))).unwrap_or_default();
        format!("{text}{mtp}")
    }

    /// The transformer block each multi-token-prediction module copies: the model's last
    /// (None without `model.mtp` or without a block).
    pub fn mtp_block(&self) -> Option<&Op> {
        self.mtp?;
        pipec_plan::model::Mtp::block(self.layers.iter().map(|l| &l.op))
    }
}

pub use pipec_plan::model::thousands;

/// The layers a labelled block call expanded into: `first..=last`.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerGroup {
    pub label: String,
    pub first: usize,
    pub last: usize,
    pub span: Span,
}

/// What a name in the model language refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameKind {
    Block,
    Tensor,
}

/// A block or a named tensor, where it is defined and what it is (its signature or shape).
#[derive(Debug, Clone, PartialEq)]
pub struct NameDef {
    pub name: String,
    pub kind: NameKind,
    pub span: Span,
    pub detail: String,
}

impl Model {
    /// The per-sample output shape of the last layer.
    pub fn output_shape(&self) -> &[usize] {
        self.layers.last().map(|l| l.output_shape.as_slice()).unwrap_or(&self.input)
    }
    /// The vocabulary size when the model starts with an embedding (its input is token ids).
    pub fn token_vocab(&self) -> Option<usize> {
        match self.layers.first().map(|l| &l.op) {
            Some(Op::Embedding { vocab, .. }) => Some(*vocab),
            _ => None,
        }
    }
}

/// One operator of the model after `repeat` expansion.
#[derive(Debug, Clone, PartialEq)]
pub struct Layer {
    pub op: Op,
    /// The `as` label; inside `repeat N` the i-th copy is `label.i`.
    pub label: Option<String>,
    /// The span of the call in the spec.
    pub span: Span,
    /// Where each input comes from (one per operand; a chain's layer reads the layer
    /// before it).
    pub inputs: Vec<Source>,
    /// The first input's shape.
    pub input_shape: Vec<usize>,
    pub output_shape: Vec<usize>,
    /// Weight tying (`tie=NAME`): the embedding layer whose table this output projection
    /// transposes.
    pub tied: Option<usize>,
}

impl Model {
    /// The model's trainable parameters, a tied weight counted once (what
    /// `sum(p.numel() for p in model.parameters())` gives in PyTorch).
    pub fn parameter_count(&self) -> u64 {
        self.layers.iter().filter(|l| l.tied.is_none()).map(|l| l.op.parameter_count()).sum()
    }

    /// Whether every layer reads only the layer before it (no branches, skips or joins).
    pub fn is_chain(&self) -> bool {
        self.layers.iter().enumerate().all(|(i, l)| l.inputs == [Source::before(i)])
    }
}

/// One link level of the cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bytes per second, per device and direction.
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
    /// The share of `bandwidth` a collective's bus bandwidth reaches, in (0, 1].
    pub efficiency: f64,
}

impl Link {
    /// A link of `bandwidth` bytes/s and `latency` s that collectives use in full.
    pub fn new(bandwidth: f64, latency: f64) -> Link {
        Link { bandwidth, latency, efficiency: 1.0 }
    }
}

/// The cluster.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub nodes: usize,
    pub devices_per_node: usize,
    /// What one device can do (a preset's datasheet figures, a calibrated file's, or one
    /// throughput), as the cost model prices work.
    pub device: pipec_plan::device::DeviceModel,
    /// Bytes of memory per device (`device.memory`).
    pub memory: f64,
    pub memory_span: Span,
    /// Seconds every layer's forward costs beyond its kernels: framework work per pass (the
    /// spec's `overhead`, else the device file's measured figure; 0 unless given).
    pub overhead: f64,
    /// The same per layer backward: twice `overhead` where the spec writes it, else the
    /// device file's measured figure (`DeviceModel::layer_pass_backward`, twice its
    /// `layer_pass` where it has none).
    pub overhead_backward: f64,
    /// The span of `devices_per_node`, for "the cluster has N devices" labels.
    pub devices_span: Span,
    pub intra_node: Link,
    pub inter_node: Option<Link>,
    pub span: Span,
}

/// The most layers a model may expand to.
pub const MAX_LAYERS: usize = 1_000_000;
/// The largest cluster pipec plans.
pub const MAX_DEVICES: usize = 65_536;
/// The most (stage, microbatch) pairs a plan may have (one bound for specs and plan files).
pub use pipec_plan::plan::MAX_STAGE_MICROBATCHES;

impl Cluster {
    pub fn device_count(&self) -> usize {
        self.nodes * self.devices_per_node
    }

    /// The device as an engine's constant `factor` runs it
    /// ([`pipec_plan::engine::performance::scale_peaks`]); on a device `pipec calibrate`
    /// measured, the constant is the machine's speed, and the work per layer pass
    /// ([`overhead`](Self::overhead)) runs at it too.
    pub fn run_engine_at(&mut self, factor: f64) {
        let speed = pipec_plan::engine::performance::scale_peaks(&mut self.device, factor);
        if self.device.measured() {
            self.overhead /= speed;
            self.overhead_backward /= speed;
        }
    }
}

pub use pipec_plan::vocab::{Attention, Choice, OptimizerKind, Precision, ReduceMode, ScheduleKind, SyncMode, Task};

/// The schedule with its options.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    /// Model chunks per device (interleaved: ≥ 2; zbv: 2; others 1).
    pub virtual_stages: usize,
    pub sync: SyncMode,
    pub reduce: ReduceMode,
    pub staleness: usize,
    /// PipeDream's vertical sync.
    pub vertical_sync: bool,
    pub span: Span,
}

impl Schedule {
    /// `kind` with its default options: its default model chunks per device, synchronous
    /// ring all-reduce, no staleness, no vertical sync.
    pub fn new(kind: ScheduleKind, span: Span) -> Self {
        Schedule {
            kind,
            virtual_stages: kind.default_virtual_stages(),
            sync: SyncMode::Bsp,
            reduce: ReduceMode::Ring,
            staleness: 0,
            vertical_sync: false,
            span,
        }
    }
}

/// How layers are assigned to stages.
#[derive(Debug, Clone, PartialEq)]
pub enum Partition {
    Auto,
    Balanced,
    /// Half-open layer ranges, one per (virtual) stage, checked to cover every layer once.
    Explicit(Vec<std::ops::Range<usize>>),
}

/// Which stages recompute their activations in the backward pass (keeping only their
/// inputs) instead of keeping them: `recompute: false`, `true`, or a list of stage indices
/// (one per virtual stage for interleaved schedules).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Recompute {
    #[default]
    Off,
    All,
    /// These stages, ascending, without repeats.
    Stages(Vec<usize>),
    /// Selective (Korthikanti et al. 2022): every transformer block keeps all but its
    /// attention core (scores, softmax, dropout, weighted sum), which its backward
    /// recomputes; no stage recomputes its whole forward.
    Selective,
    /// Inside the transformer blocks: by module or by operation, the first blocks of every
    /// stage whole, activations offloaded to the host (`recompute: { modules: [...] }`).
    Blocks(BlockRecompute),
}

/// What every transformer block recomputes (`recompute` as a mapping).
pub use pipec_plan::plan::BlockRecompute;

impl Recompute {
    /// Whether stage `s` recomputes.
    pub fn stage(&self, s: usize) -> bool {
        match self {
            Recompute::Off => false,
            Recompute::All => true,
            Recompute::Stages(v) => v.binary_search(&s).is_ok(),
            Recompute::Selective | Recompute::Blocks(_) => false,
        }
    }
    /// Whether transformer blocks recompute their attention core (selective recompute).
    pub fn selective(&self) -> bool {
        *self == Recompute::Selective
    }
    /// What every transformer block recomputes inside a stage that does not recompute
    /// its whole forward: selective recompute's attention core, or the mapping's policy.
    pub fn within_blocks(&self) -> Option<BlockRecompute> {
        match self {
            Recompute::Selective => Some(BlockRecompute {
                modules: vec![pipec_plan::vocab::RecomputeModule::CoreAttn],
                ..BlockRecompute::default()
            }),
            Recompute::Blocks(b) => Some(b.clone()),
            Recompute::Off | Recompute::All | Recompute::Stages(_) => None,
        }
    }
    /// Per stage, for a plan of `stages` stages.
    pub fn per_stage(&self, stages: usize) -> Vec<bool> {
        (0..stages).map(|s| self.stage(s)).collect()
    }
    /// The stages named past the last of `stages` (what E0412 reports).
    pub fn beyond(&self, stages: usize) -> Option<usize> {
        match self {
            Recompute::Stages(v) => v.last().copied().filter(|&s| s >= stages),
            _ => None,
        }
    }
    /// The strategy text: `false`, `true` or `[0, 2]`.
    pub fn text(&self) -> String {
        match self {
            Recompute::Off => "false".into(),
            Recompute::All => "true".into(),
            Recompute::Selective => "selective".into(),
            Recompute::Blocks(b) => b.text(),
            Recompute::Stages(v) => {
                format!("[{}]", v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))
            }
        }
    }
}

/// Which strategy fields the search fills in, and what the user pins.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoStrategy {
    /// The layout (`stages`/`dp`/`pp`), the tensor-parallel degree, the schedule, the
    /// microbatch count and recompute: free (true) or as written.
    pub layout: bool,
    pub tp: bool,
    pub schedule: bool,
    pub microbatches: bool,
    pub recompute: bool,
    /// The expert-parallel degree (`ep`; searched only for a model with expert blocks).
    pub ep: bool,
    /// The context-parallel degree: searched only when written `cp: auto` (for a model
    /// that splits along its sequence, E0420), 1 when absent.
    pub cp: bool,
    /// How context parallelism exchanges keys and values: both tried on every
    /// context-parallel candidate when `cp_comm` is not written.
    pub cp_comm: bool,
    /// `sequence_parallel` not written: on for tensor parallelism under an engine that runs
    /// it (what the engines' recipes run beside TP).
    pub sequence_parallel: bool,
    /// `tp_overlap` not written: tried on and off beside sequence parallelism under an
    /// engine that overlaps tensor parallelism's collectives (never pipec's executor, which
    /// runs them in line).
    pub tp_overlap: bool,
    /// `moe_dispatch` not written: DeepEP tried beside the all-to-all under an engine that
    /// runs it (never pipec's executor, which runs it as an all-to-all).
    pub moe_dispatch: bool,
    /// `ep_overlap` not written: tried on and off where the schedule pairs passes, under an
    /// engine that overlaps the exchanges (never pipec's executor, which runs a pair's
    /// passes one after the other).
    pub ep_overlap: bool,
    /// `search.async`: the asynchronous schedules (stale weights) may be chosen.
    pub asynchronous: bool,
    /// `search.max_depth`: the most pipeline stages.
    pub max_depth: Option<usize>,
    /// `search.headroom`: the memory share every device must keep free.
    pub headroom: f64,
    /// `search.schedules`: only these schedules.
    pub schedules: Option<Vec<ScheduleKind>>,
}

/// The parallel layout and schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Strategy {
    /// Workers replicating each pipeline stage (PipeDream notation). With `partition: auto`
    /// this is the starting layout; the planner may choose another.
    pub replicas: Vec<usize>,
    /// Tensor-parallel degree inside each stage replica.
    pub tp: usize,
    pub schedule: Schedule,
    pub microbatches: usize,
    pub partition: Partition,
    pub recompute: Recompute,
    /// Overlap communication with compute (default true): all-reduces in flight while the
    /// device computes, and input gradients sent before the weight gradients are computed.
    pub overlap: bool,
    /// `bucket`: PyTorch DDP's gradient buckets — a replicated stage's all-reduce split into
    /// buckets of about this many bytes, each started during the step's last backward as
    /// its layers' gradients complete (None: one all-reduce after the backward).
    pub bucket: Option<u64>,
    /// Megatron's sequence parallelism (with `tp` > 1): the parts of a transformer block
    /// outside its tensor-parallel products (layer norms, dropout, residual adds) split along
    /// the sequence; each all-reduce becomes a reduce-scatter and an all-gather.
    pub sequence_parallel: bool,
    /// `tp_overlap` (with `tp` > 1): each layer's tensor-parallel collectives overlapped
    /// with its passes' computation (Megatron-LM's `--tp-comm-overlap`), as the cost model
    /// prices them.
    pub tp_overlap: bool,
    /// `cp_comm` (with `cp` > 1 or `cp: auto`): how the context-parallel members exchange
    /// keys and values, as the cost and memory model price it.
    pub cp_comm: pipec_plan::vocab::CpComm,
    /// `moe_dispatch` (with `ep` > 1): how expert parallelism sends tokens to the experts'
    /// devices, as the cost model prices it.
    pub moe_dispatch: pipec_plan::vocab::MoeDispatch,
    /// `ep_overlap` (with `ep` > 1, on a schedule that
    /// [combines 1F1B](pipec_plan::vocab::ScheduleKind::combines_1f1b)): Megatron-LM's
    /// expert-parallel overlap — one more forward before the first backward, then each
    /// forward and the backward after it (of another microbatch) as one overlapped pair,
    /// each one's all-to-alls under the other's computation.
    pub ep_overlap: bool,
    /// `zero`: what data-parallel replicas shard among themselves.
    pub sharding: pipec_plan::vocab::Sharding,
    /// `ep`: expert parallelism — every replicated stage's replicas in groups of `ep`
    /// consecutive ones, each holding `experts / ep` of every expert block's experts and
    /// exchanging tokens with the group's other members (1: every replica holds them all).
    pub ep: usize,
    /// `etp: 1` beside `tp` > 1: expert tensor parallelism 1 — each routed expert whole on
    /// one device, and the expert-parallel group of `ep` devices made of the tensor-parallel
    /// ranks of ep / tp consecutive replicas, each rank dispatching its sequence share
    /// (Megatron-LM's MoE parallel folding with `--expert-tensor-parallel-size 1`,
    /// torchtitan's `expert_tensor_parallel_degree = 1`). False (`etp` absent or equal to
    /// `tp`): each expert split over the tensor-parallel ranks like the rest of the block,
    /// `ep` counting replicas.
    pub whole_experts: bool,
    /// `cp`: context parallelism — each microbatch's sequence split over `cp` devices
    /// (Megatron-LM's load-balanced split: 2·cp chunks, member c holding
    /// chunks c and 2·cp − 1 − c), attention gathering the group's keys and values. Once
    /// lowered, `replicas` and `microbatches` count the group's members and the sequence
    /// chunks: a stage written with r replicas has r·cp, and m microbatches become m·cp
    /// chunk-microbatches, member c of a group running chunk c of each of its microbatches
    /// ([`Strategy::written_microbatches`]). 1: off.
    pub cp: usize,
    /// `strategy: auto`, or `auto` fields: what the compiler's strategy search chooses (the
    /// other fields then hold placeholders where they are free).
    pub auto: Option<AutoStrategy>,
    /// The span of the strategy's layout (`stages:` or `dp`/`pp`), for plan-level errors.
    pub layout_span: Span,
    /// Whether the user fixed the layout; with `partition: auto` and no layout the planner
    /// chooses the replication too.
    pub layout_fixed: bool,
    pub partition_span: Span,
    /// The span of the `microbatches` value (None when the key is absent: 1 microbatch).
    pub microbatches_span: Option<Span>,
    pub span: Span,
}

/// The replicas of an expert-parallel group of `ep` (devices with `whole` experts beside
/// `tp` > 1: the tensor-parallel ranks of ep / tp replicas; else replicas).
pub fn expert_group_replicas(ep: usize, tp: usize, whole: bool) -> usize {
    if whole && tp > 1 {
        (ep / tp).max(1)
    } else {
        ep.max(1)
    }
}

impl Strategy {
    pub fn stage_count(&self) -> usize {
        self.replicas.len()
    }
    /// Whether routed experts are whole on each device with tensor parallelism around them
    /// (`etp: 1` beside `tp` > 1, [`Strategy::whole_experts`]).
    pub fn experts_whole(&self) -> bool {
        self.whole_experts && self.tp > 1
    }
    /// The expert tensor-parallel degree: 1 when experts are whole, else `tp`.
    pub fn etp(&self) -> usize {
        if self.experts_whole() {
            1
        } else {
            self.tp.max(1)
        }
    }
    /// The replicas of an expert-parallel group: `ep`, or with whole experts ep / tp (the
    /// group's `ep` devices are the tensor-parallel ranks of that many replicas).
    pub fn ep_replicas(&self) -> usize {
        expert_group_replicas(self.ep, self.tp, self.whole_experts)
    }
    pub fn devices_needed(&self) -> usize {
        self.replicas.iter().sum::<usize>() * self.tp
    }
    /// Context parallelism over `cp` devices, lowered as the plan runs it ([`Strategy::cp`]):
    /// each written replica becomes `cp` members and each microbatch `cp` chunk-microbatches.
    /// `replicas` and `microbatches` must be as written.
    pub fn split_sequences(&mut self, cp: usize) {
        let cp = cp.max(1);
        self.cp = cp;
        self.replicas.iter_mut().for_each(|r| *r *= cp);
        self.microbatches *= cp;
    }

    /// The microbatches the batch is split into, as written (`microbatches` counts each
    /// one's `cp` sequence chunks).
    pub fn written_microbatches(&self) -> usize {
        self.microbatches / self.cp.max(1)
    }
    /// The forward–backward pairs the strategy overlaps: DualPipe's, or Megatron-LM's
    /// combined 1F1B under `ep_overlap` with expert parallelism.
    pub fn pairing(&self) -> Option<pipec_plan::schedule::Pairing> {
        pipec_plan::schedule::Pairing::of(self.schedule.kind, self.ep_overlap && self.ep > 1)
    }
    /// Whether the order is Megatron-LM's combined 1F1B: one more forward before the first
    /// backward (`ep_overlap`).
    pub fn combined_1f1b(&self) -> bool {
        self.pairing() == Some(pipec_plan::schedule::Pairing::OtherTask)
    }
    /// Samples per microbatch of a batch of `batch` samples (each a whole sequence; with
    /// context parallelism a device computes its 1/cp of their tokens).
    pub fn microbatch_size(&self, batch: usize) -> usize {
        batch / self.written_microbatches().max(1)
    }
    /// The PipeDream notation of the layout (`2-1-1`).
    pub fn notation(&self) -> String {
        self.replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("-")
    }
}

/// The optimizer: the plan's settings, as the spec gives them.
pub use pipec_plan::plan::OptimizerPlan as Optimizer;

/// Training data.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    /// `samples`: distinct samples cycled through (absent: a fresh batch every step).
    Synthetic {
        task: Task,
        samples: Option<usize>,
    },
    Csv {
        path: String,
        span: Span,
    },
    Npy {
        path: String,
        labels: Option<String>,
        span: Span,
    },
    /// A language model's text: its characters, or the tokens of a Hugging Face
    /// `tokenizer.json` (relative to the spec).
    Text {
        path: String,
        tokenizer: Option<String>,
        span: Span,
    },
    /// A classifier's image folder (one folder per class), with its transform.
    Images {
        path: String,
        resize: Option<usize>,
        /// Where `resize` is written.
        resize_span: Option<Span>,
        mean: Vec<f64>,
        std: Vec<f64>,
        span: Span,
    },
    /// A language model's token ids (`dtype` for a raw file, None for `.npy`).
    Tokens {
        path: String,
        dtype: Option<pipec_plan::TokenDtype>,
        span: Span,
    },
    /// A language model's text in a file of records — JSON Lines, Parquet or Arrow
    /// (`pipec_plan::datafile::Records`): `field` names the text's field or column (or, in
    /// Parquet and Arrow, a column of token ids), `tokenizer` cuts the text (absent:
    /// characters), `eot` is the token put between records.
    Records {
        format: pipec_plan::datafile::RecordFormat,
        path: String,
        field: String,
        tokenizer: Option<String>,
        eot: Option<String>,
        span: Span,
    },
}

impl Data {
    /// A JSON Lines file's records, its paths resolved against `base`.
    pub fn records(&self, base: &std::path::Path) -> Option<pipec_plan::datafile::Records> {
        match self {
            Data::Records { format, path, field, tokenizer, eot, .. } => {
                Some(records(base, *format, path, field, tokenizer, eot))
            }
            _ => None,
        }
    }
}

/// The records of `kind: jsonl`, `parquet` or `arrow` data, its paths resolved against `base`.
pub fn records(
    base: &std::path::Path,
    format: pipec_plan::datafile::RecordFormat,
    path: &str,
    field: &str,
    tokenizer: &Option<String>,
    eot: &Option<String>,
) -> pipec_plan::datafile::Records {
    pipec_plan::datafile::Records {
        format,
        path: base.join(path),
        field: field.to_string(),
        tokenizer: tokenizer.as_ref().map(|t| base.join(t)),
        eot: eot.clone(),
    }
}

/// Checkpointing.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub every: usize,
    pub dir: String,
    /// `async` (default true): training goes on while a checkpoint is written.
    pub asynchronous: bool,
}

/// `training.precision: auto`: the precision the strategy search chooses, bf16 or FP8.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrecisionSearch {
    /// The `auto` value, which the search's choice replaces.
    pub span: Span,
    /// FP8 training as the spec's `fp8` mapping says (its defaults where absent).
    pub fp8: pipec_plan::plan::Fp8Plan,
}

/// The training set-up.
#[derive(Debug, Clone, PartialEq)]
pub struct Training {
    pub batch_size: usize,
    pub batch_span: Span,
    pub steps: usize,
    pub optimizer: Optimizer,
    pub precision: Precision,
    /// The precision gradients are accumulated and reduced in: fp32 under bf16/fp16 unless
    /// the spec says otherwise (Megatron-LM's default), the training precision otherwise.
    pub grad_precision: Precision,
    /// FP8 training (`precision: fp8`, with `training.fp8`): `precision` is then bf16, what
    /// everything outside the blocks' FP8 products runs in.
    pub fp8: Option<pipec_plan::plan::Fp8Plan>,
    /// `precision: auto`: the strategy search chooses between bf16 (what `precision` and
    /// `fp8` say until it has) and FP8 training as `fp8` says.
    pub precision_search: Option<PrecisionSearch>,
    /// The optimizer moments' precision (`optimizer.state_precision`; fp32 by default).
    pub state_precision: Precision,
    /// Whether a bf16 or fp16 model keeps fp32 master weights for the optimizer to update
    /// (`optimizer.master_weights`; true by default); false: the weights exist in the
    /// training precision only and the optimizer updates them in place.
    pub master_weights: bool,
    pub seed: u64,
    pub data: Data,
    pub checkpoint: Option<Checkpoint>,
    /// The learning-rate schedule, gradient clipping and sample order.
    pub recipe: pipec_plan::recipe::Recipe,
}
