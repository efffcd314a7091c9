//! The spec's surface, as the user writes it in YAML, described as types for `schemars`.
//!
//! These types are never instantiated: the loader reads a spanned YAML tree and lowers it by
//! hand (see [`crate::spec`]) so that it can report every mistake at once. They exist to be
//! the single source of the spec's keys and their documentation: `pipec schema` prints the
//! JSON Schema made from them, the checker takes each section's allowed keys from it (for
//! "unknown key, did you mean ..."), and the language server takes hover text and
//! completions from it.
#![allow(dead_code)]

use pipec_plan::vocab::{
    Decay, Engine, Loss, OptimizerKind, Precision, ReduceMode, RunningStats, ScheduleKind, SyncMode, Task,
};
use schemars::JsonSchema;
use serde_json::Value as Json;

/// A pipec training-job spec: the model, the cluster it runs on, how the work is split
/// across devices, and how it trains.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "pipec spec")]
struct Spec {
    /// A name for the job, used in reports and output file names.
    name: Option<String>,
    engine: Option<EngineSpec>,
    model: Model,
    cluster: Cluster,
    strategy: StrategySpec,
    training: Training,
}

/// The training engine the plan is for: `pipec` (the default: `pipec run`), `megatron`
/// (Megatron-LM), `torchtitan` or `deepspeed`, or a mapping with `name` and `version`.
/// `pipec check`, `search` and `compare` hold the strategy to what that engine can run, and
/// `pipec emit` writes its launch configuration.
#[derive(JsonSchema)]
#[serde(untagged)]
enum EngineSpec {
    Name(Engine),
    Versioned(EngineFields),
}

/// An engine at a release.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct EngineFields {
    name: Engine,
    /// The engine's release, quoted: `"0.19"` (the newest 0.19 release pipec describes) or a
    /// whole one, `"0.19.8"`. Default: the newest pipec describes (docs/spec.md lists them).
    version: Option<String>,
    /// torchtitan only: what `torch.compile` compiles (its `[compile]` section): `true`,
    /// the model's blocks and the loss (torchtitan's default components); or a list,
    /// `[model]`, `[loss]`, `[model, loss]`. Compiled blocks are priced as torchtitan's
    /// compiled kernels, a compiled loss keeps the logits alone. Default false (eager).
    compile: Option<CompileSpec>,
    /// A calibration file (`pipec calibrate --measured`, relative to the spec): this
    /// engine's kernel efficiency on this device kind, fitted to one measured step of your
    /// own run. Default: pipec's fitted table (docs/benchmarks.md, "Step times").
    calibration: Option<String>,
}

/// The network to train: its per-sample input shape, its layers in order, and its loss.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Model {
    /// Shape of one input sample, without the batch dimension: `[784]`, `[3, 32, 32]`, or
    /// `[128]` (a sequence of 128 token ids) when the first layer is an `embedding`.
    input: Vec<u64>,
    /// The layers in order. Each item is a chain in the layer language,
    /// `linear(784, 1024) -> relu`, optionally naming its output (`linear(1024, 10) as head`),
    /// starting from a named tensor (`x -> conv2d(64, 64, k=1)`; `input` is the model's
    /// input), joining named tensors (`add(a, b) -> relu`, `concat(a, b, c)`), calling a
    /// block (`bottleneck(256, 64)`), or a repetition `repeat 6: linear(1024, 1024) -> relu`
    /// (also written as a mapping `- repeat 6: ...`). Layers: linear(in, out, bias=true),
    /// conv2d(in, out, k=3, stride=1, pad=0), maxpool2d(k, stride=k, pad=0),
    /// avgpool2d(k, stride=k, pad=0), adaptive_avgpool2d(size=1), batchnorm2d, flatten,
    /// relu, gelu, tanh, sigmoid, layernorm, dropout(p), embedding(vocab, d),
    /// transformer_block(d=, heads=, ff=).
    layers: Vec<LayerItem>,
    /// Reusable blocks, each `name(param, param=default)` mapped to its items (the same
    /// language as `layers`; `in` is the block's input, its last item's output is the
    /// block's output), e.g. `conv_bn(cin, cout, k=3): ["conv2d(cin, cout, k=k, pad=1) ->
    /// batchnorm2d -> relu"]`.
    blocks: Option<std::collections::BTreeMap<String, Vec<LayerItem>>>,
    /// How transformer blocks compute attention: `standard` (the scores materialised and
    /// kept for the backward) or `flash` (a fused kernel: nothing of size seq² kept, the
    /// backward recomputes the scores).
    attention: Option<pipec_plan::vocab::Attention>,
    /// The loss at the end of the model: `cross_entropy` (classification; the last layer's
    /// output size is the number of classes) or `mse` (regression).
    loss: Loss,
    /// DeepSeek-V3's multi-token prediction (a language model's): `depth` modules after the
    /// last transformer block, the k-th predicting the token k + 1 positions ahead, each one
    /// transformer block shaped as the last, with the model's embedding and output layer
    /// shared; `weight` scales their mean cross-entropy into the loss (default 0.1,
    /// Megatron-LM's). `mtp: 1` or `mtp: { depth: 1, weight: 0.1 }`. Planned and priced;
    /// `pipec run` does not train it.
    mtp: Option<MtpSpec>,
}

/// `engine.compile`: on or off, or the components compiled.
#[derive(JsonSchema)]
#[serde(untagged)]
enum CompileSpec {
    On(bool),
    Components(Vec<pipec_plan::vocab::CompileComponent>),
}

/// `model.mtp`: the depth alone, or a mapping.
#[derive(JsonSchema)]
#[serde(untagged)]
enum MtpSpec {
    Depth(u64),
    Fields(MtpFields),
}

/// `model.mtp` as a mapping.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct MtpFields {
    /// Modules, each predicting one token further ahead (DeepSeek-V3: 1).
    depth: u64,
    /// Their mean cross-entropy's weight in the loss (default 0.1).
    weight: Option<f64>,
}

#[derive(JsonSchema)]
#[serde(untagged)]
enum LayerItem {
    /// A chain of layers joined by `->`.
    Chain(String),
    /// `repeat N: chain` written as a one-key mapping.
    Repeat(std::collections::BTreeMap<String, String>),
}

/// The machines: nodes, devices per node, what one device is, and the links between them.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Cluster {
    /// Number of nodes (servers).
    nodes: u64,
    /// Devices (GPUs or CPU workers) in each node.
    devices_per_node: u64,
    device: Device,
    links: LinksSpec,
}

/// One device. All devices of the cluster are alike: a preset's name (`a100-80gb`,
/// `h100-sxm`, `h100-nvl`, `h800`, `h200`, `h200-nvl`, `b200`, `gb200`, `mi300x`,
/// `v100-32gb`, ...: docs/spec.md lists their figures and sources), or a mapping.
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(clippy::large_enum_variant)] // a schema description, never built
enum Device {
    /// A device preset with its datasheet figures (docs/spec.md lists them).
    Preset(String),
    Described(DeviceFields),
}

/// A device described by its figures: a preset's with some overridden (`preset:`), a
/// calibrated device file's (`file:`), or only a memory and one throughput.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct DeviceFields {
    /// A device preset to start from; the keys below override its figures.
    preset: Option<String>,
    /// A device file written by `pipec calibrate` (relative to the spec), to start from.
    file: Option<String>,
    /// A free-form name for the device kind (`a100`, `cpu`), shown in reports.
    kind: Option<String>,
    /// The power cap the devices run at, with a unit: `500W` (with `preset` only; at most
    /// the preset's board power). Matrix and element-wise rates are taken at the clock the
    /// cap sustains, (power / board power)^(1/3) of the full one; the cap also names the
    /// device kind an engine's calibrated constant is for.
    power: Option<String>,
    /// Memory per device, with a unit: `16GiB`, `80GB`. Required without a preset or file.
    memory: Option<String>,
    /// Matrix-product throughput at every precision, with a unit: `312TFLOP/s`. Without a
    /// preset or file, the device's only figure: every FLOP runs at it, element-wise ones
    /// too, with no memory bound and no size effect.
    throughput: Option<String>,
    /// Element-wise (vector) throughput, with a unit: `19.5TFLOP/s`.
    vector: Option<String>,
    /// Device-memory bandwidth, with a unit: `2TB/s`. Element-wise work is bound by it.
    memory_bandwidth: Option<String>,
    /// What every kernel costs before any work (launch and dispatch), with a unit: `4us`.
    launch: Option<String>,
    /// Time every layer's forward pass costs beyond its kernels (its backward: twice that),
    /// with a unit: `20us`; default 0.
    overhead: Option<String>,
}

/// The interconnect: a preset's name (`dgx-a100`, `dgx-h100`, `hgx-h800`, `dgx-b200`,
/// `gb200-nvl72`, `dgx-v100`: docs/spec.md lists their figures), or
/// bandwidth and latency per level of the cluster's hierarchy.
#[derive(JsonSchema)]
#[serde(untagged)]
enum LinksSpec {
    /// An interconnect preset: the node's NVLink/NVSwitch and its InfiniBand NICs.
    Preset(String),
    Described(Links),
}

/// Bandwidth and latency per level of the cluster's hierarchy.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Links {
    /// Between devices of one node.
    intra_node: Link,
    /// Between nodes, per device: each device's share of the network, not the node's total
    /// (a DGX H100's is `400Gbps`, one ConnectX-7 per GPU). Past 800 Gb/s, the fastest
    /// adapter one device has, W0106 warns. Required when `nodes` is more than 1.
    inter_node: Option<Link>,
}

/// One link level of the α-β communication model.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Link {
    /// Bandwidth (β⁻¹) per device and direction, with a unit: `300GB/s`, `200Gbps`.
    /// Required without `file`.
    bandwidth: Option<String>,
    /// Latency per message (α), with a unit: `5us`, `1ms`. Required without `file`.
    latency: Option<String>,
    /// A device file from `pipec calibrate --concurrent N` (N ≥ 2), relative to the spec:
    /// the link between the executor's workers as measured (messages, and ring all-reduces
    /// over N); `bandwidth`, `latency` and `efficiency` written beside it override its figures.
    file: Option<String>,
    /// The share of `bandwidth` a collective's bus bandwidth reaches (NCCL's busbw over
    /// the line rate), in (0, 1]; default 1.
    efficiency: Option<f64>,
}

/// The strategy as written, or `auto`: the compiler searches every strategy (tensor
/// parallelism, pipeline depth × data parallelism, schedule, microbatches, recompute) and
/// compiles the fastest that fits.
#[derive(JsonSchema)]
#[serde(untagged)]
enum StrategySpec {
    Auto(AutoWord),
    Written(Box<Strategy>),
}

/// `auto`: the strategy search fills this in.
#[derive(JsonSchema)]
#[serde(rename_all = "snake_case")]
enum AutoWord {
    Auto,
}

/// A number, or `auto` (the strategy search chooses it).
#[derive(JsonSchema)]
#[serde(untagged)]
enum CountOrAuto {
    Count(u64),
    Auto(AutoWord),
}

/// A training precision, or `auto` (the strategy search chooses bf16 or FP8).
#[derive(JsonSchema)]
#[serde(untagged)]
enum PrecisionOrAuto {
    Precision(pipec_plan::vocab::TrainingPrecision),
    Auto(AutoWord),
}

/// `true`/`false`, a list of stage indices, a policy's name, a mapping of what every
/// transformer block recomputes, or `auto` (the strategy search chooses).
#[derive(JsonSchema)]
#[serde(untagged)]
enum RecomputeSpec {
    Flag(bool),
    Stages(Vec<u32>),
    Mode(RecomputeMode),
    Blocks(BlockRecomputeSpec),
    Auto(AutoWord),
}

/// What every transformer block recomputes in its backward instead of keeping.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct BlockRecomputeSpec {
    /// Megatron-LM's `recompute_modules`: `core_attn` (the attention core), `mlp` (a dense
    /// MLP), `moe_act` (the experts' activation), `layernorm` (the two norms' outputs),
    /// `mla_up_proj` (multi-head latent attention's up projections), `moe` (the whole
    /// mixture of experts), `shared_experts`. Their inputs stay kept.
    modules: Option<Vec<pipec_plan::vocab::RecomputeModule>>,
    /// Op-level selective recompute: keep only the outputs of these operations (and the
    /// block's input), recompute the rest — `matmul` (every product), `alternate_matmul`
    /// (every other product, as torchtitan's `selective_ac_option = "op"`), `attention` (the
    /// fused attention kernel). Exclusive with `modules`.
    ops: Option<Vec<pipec_plan::vocab::RecomputeOp>>,
    /// The first `layers` transformer blocks of every stage (of each model chunk) recompute
    /// their whole forward, keeping their input only (Megatron-LM's `recompute_num_layers`,
    /// method `block`); the others follow `modules` or `ops`.
    #[schemars(range(min = 1))]
    layers: Option<u64>,
    /// Offload every block's kept tensors to host memory after its forward and bring them
    /// back for its backward, the copies running beside the compute (default false).
    offload: Option<bool>,
}

/// A recompute policy by name.
#[derive(JsonSchema)]
#[serde(rename_all = "snake_case")]
enum RecomputeMode {
    /// Every transformer block recomputes only its attention core (scores, softmax,
    /// dropout, weighted sum) in the backward and keeps the rest (Korthikanti et al. 2022).
    Selective,
    /// Every stage recomputes its whole forward (the same as `true`).
    Full,
}

/// Constraints on the strategy search (with `auto` fields).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct SearchSpec {
    /// Allow the asynchronous schedules (`pipedream`, `2bw`: stale weights). Default false.
    #[serde(rename = "async")]
    asynchronous: Option<bool>,
    /// The most pipeline stages to consider.
    max_depth: Option<u64>,
    /// Memory every device must keep free, e.g. `15%`; default 10% (the allocator's reserve,
    /// CUDA's context and NCCL's buffers a GPU run holds beside the plan's figures); `0%`
    /// lets a plan fill its devices.
    headroom: Option<String>,
    /// Only these schedules.
    schedules: Option<Vec<ScheduleKind>>,
}

/// How the training work is split across devices.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Strategy {
    /// PipeDream notation: one number per pipeline stage, the number of workers replicating
    /// that stage (`"2-1-1"`: three stages, the first on two workers). `straight`: one
    /// unreplicated stage per device. Quote a single number (`"4"`: one stage on four
    /// workers, i.e. data parallelism). Exclusive with `dp`/`pp`.
    stages: Option<String>,
    /// Data-parallel degree: replicas of every pipeline stage; `auto`: searched.
    dp: Option<CountOrAuto>,
    /// Pipeline-parallel degree: number of pipeline stages; `auto`: searched.
    pp: Option<CountOrAuto>,
    /// Tensor-parallel degree (Megatron-style) inside each stage replica; `auto`: searched.
    tp: Option<CountOrAuto>,
    /// The pipeline schedule: a name, or a mapping with `kind` and its options; `auto`:
    /// searched.
    schedule: Option<ScheduleSpec>,
    /// Microbatches per step: the global batch is split into this many, and a replicated
    /// stage receives them round-robin (with `dp: 2`, each pipeline replica gets half);
    /// `auto`: searched.
    microbatches: Option<CountOrAuto>,
    /// How layers are assigned to stages: `auto` (PipeDream's dynamic program; also picks
    /// the replication), `balanced` (contiguous split minimising the slowest stage), or a
    /// list with one entry per stage of layer ranges: `"0..4"` (end excluded), `"4..=7"`
    /// (end included), `"stem..head"` (labels), `"8.."` (to the end).
    partition: Option<PartitionSpec>,
    /// Recompute activations in the backward pass: `true` (or `full`: every stage keeps
    /// only its inputs), `false`, a list of stage indices (e.g. `[0, 1]`), `selective`
    /// (every transformer block recomputes only its attention core), or a mapping of what
    /// every block recomputes (`{ modules: [core_attn, mlp] }`, `{ ops: [alternate_matmul,
    /// attention] }`, `{ layers: 4 }`, `offload: true`); `auto`: searched.
    recompute: Option<RecomputeSpec>,
    /// Megatron's sequence parallelism (needs `tp` > 1): a transformer block's layer norms,
    /// dropout and residual adds split along the sequence over the tensor-parallel group,
    /// each all-reduce a reduce-scatter and an all-gather. Default false.
    sequence_parallel: Option<bool>,
    /// Overlap each tensor-parallel collective with its layer's computation (Megatron-LM's
    /// `--tp-comm-overlap` through Transformer Engine; needs `tp` > 1): the plan prices only
    /// the part of a layer's collectives its passes do not cover. A planning option: the
    /// executor runs them in line (`pipec run` says so). Default false.
    tp_overlap: Option<bool>,
    /// ZeRO's sharding across data-parallel replicas (needs a replicated stage): 0 nothing
    /// (default); 1 the optimizer state and master weights (Megatron-LM's distributed
    /// optimizer); 2 also the gradients; 3 also the weights (FSDP's full sharding).
    #[schemars(range(min = 0, max = 3))]
    zero: Option<u8>,
    /// Expert parallelism (a model with `experts=` blocks): each stage's replicas in groups
    /// of `ep` consecutive ones, each member holding `experts / ep` of every block's experts;
    /// tokens travel to their experts' member and back in all-to-alls inside every pass, and
    /// an expert's gradient is summed over the replicas holding it. Divides every stage's
    /// replicas and every block's experts. Default 1; `auto`: searched.
    ep: Option<CountOrAuto>,
    /// Expert tensor parallelism beside `tp` > 1: `tp` (the default: each routed expert split
    /// over the tensor-parallel ranks like the block, `ep` counting replicas) or 1 (each
    /// expert whole on one device; the expert-parallel group's `ep` devices are the
    /// tensor-parallel ranks of ep / tp replicas, so `ep` is a multiple of `tp`, and each
    /// rank dispatches its sequence share: needs `sequence_parallel`). Megatron-LM's
    /// `--expert-tensor-parallel-size`, torchtitan's `expert_tensor_parallel_degree`. A
    /// planning choice: the executor refuses `etp: 1` beside `tp` > 1.
    #[schemars(range(min = 1))]
    etp: Option<usize>,
    /// Context parallelism (a language model of transformer blocks): each microbatch's
    /// sequence split over `cp` devices, 2·cp chunks with member c holding chunks c and
    /// 2·cp − 1 − c (balanced causal work); each attention gathers the group's keys and
    /// values, and the members' gradients are summed with the data-parallel replicas'. The
    /// layout uses `cp` times the devices. Divides the sequence into 2·cp equal chunks.
    /// Default 1; `auto`: searched.
    cp: Option<CountOrAuto>,
    /// How context parallelism exchanges keys and values (Megatron-LM's `--cp-comm-type`):
    /// `all_gather` (the default: gathered at once, kept for the backward, their gradients
    /// reduce-scattered) or `ring` (passed around the group a block at a time under the
    /// attention over the block before, only the member's own kept; the backward passes
    /// them around again with their gradients). Needs `cp` > 1 or `cp: auto`. A planning
    /// choice: the executor all-gathers (`pipec run` says so).
    cp_comm: Option<pipec_plan::vocab::CpComm>,
    /// How expert parallelism sends tokens to the experts' devices: `all_to_all` (the
    /// default: one copy per routed expert, across nodes as within) or `deepep` (DeepEP or
    /// HybridEP: a token crosses the network once per destination node and is forwarded to
    /// that node's experts over NVLink; Megatron-LM's flex dispatcher, torchtitan's
    /// `expert_parallel_comm_backend = "deepep"`). Needs `ep` > 1. A planning choice: the
    /// executor runs an all-to-all (the same values, sent a copy per expert).
    moe_dispatch: Option<pipec_plan::vocab::MoeDispatch>,
    /// Megatron-LM's expert-parallel overlap (`--overlap-moe-expert-parallel-comm`; needs
    /// `ep` > 1 and `1f1b`, `dp-only` or `interleaved`): the order runs one more forward
    /// before the first backward, then each forward with the backward after it (of an
    /// earlier microbatch) as one pair whose all-to-alls run under the other pass's
    /// computation. Megatron-LM runs a pair layer by layer and holds what 1F1B holds; pipec's
    /// executor runs the order but a pair's passes one after the other, holding one more
    /// microbatch (`pipec run` says so). Default false.
    ep_overlap: Option<bool>,
    /// Constraints on the strategy search, when fields are `auto` (or `strategy: auto`).
    search: Option<SearchSpec>,
    /// Overlap communication with compute (default true): a replicated stage's all-reduce
    /// starts right after its last backward of the step and is waited for only before its
    /// optimizer step; under `pipedream`/`2bw` the next forwards run while it is in flight
    /// (on the weights before that update); under a schedule with one update per step, a
    /// stage after the first sends its input gradient before it computes its weight
    /// gradients. `false` waits for every all-reduce at once and runs every backward as one
    /// pass, as the schedules' papers do.
    overlap: Option<bool>,
    /// PyTorch DDP's gradient buckets: `25MiB` (DDP's default), any size of at least
    /// 1KiB, or `none` (the default). A replicated stage's gradient all-reduce after its
    /// last backward of the step is split into buckets of about that size, the last layers'
    /// first, each started during that backward as soon as its layers' gradients are
    /// complete, so the reduction overlaps the backward; under `zero` each bucket is a
    /// reduce-scatter into the gradient shards. Applies to stages of a chain of layers
    /// without tensor or expert parallelism, with `overlap: true`; `pipec compile` lists
    /// the bucketed stages.
    bucket: Option<String>,
}

#[derive(JsonSchema)]
#[serde(untagged)]
enum ScheduleSpec {
    Auto(AutoWord),
    Name(ScheduleKind),
    Options(ScheduleOptions),
}

/// A schedule with options.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct ScheduleOptions {
    kind: ScheduleKind,
    /// interleaved: model chunks (virtual stages) per device, at least 2.
    virtual_stages: Option<u64>,
    /// dp-only: `bsp` (synchronous, all-reduce every step) or `asp` (asynchronous,
    /// bounded staleness).
    sync: Option<SyncMode>,
    /// dp-only with bsp: `ring` all-reduce or a central `ps` (parameter server).
    reduce: Option<ReduceMode>,
    /// dp-only with asp: a worker pulls the parameter server's weights after every
    /// `staleness + 1` of its microbatches (default 1).
    staleness: Option<u64>,
    /// pipedream: vertical sync — every stage runs a microbatch's forward on the weight
    /// version the first stage used for it (unreplicated stages).
    vertical_sync: Option<bool>,
}

#[derive(JsonSchema)]
#[serde(untagged)]
enum PartitionSpec {
    Mode(PartitionMode),
    /// One entry per stage: a range string or a list of them.
    Explicit(Vec<StageRanges>),
}

#[derive(JsonSchema)]
#[serde(rename_all = "snake_case")]
enum PartitionMode {
    Auto,
    Balanced,
}

#[derive(JsonSchema)]
#[serde(untagged)]
enum StageRanges {
    One(String),
    Many(Vec<String>),
}

/// The training loop.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Training {
    /// Global batch size (samples per optimizer step, over all replicas).
    batch_size: u64,
    /// Number of optimizer steps.
    steps: u64,
    optimizer: Optimizer,
    /// Numeric precision of weights and activations: `fp32`, `bf16` or `fp16`; or `fp8`:
    /// bf16 mixed precision with the transformer blocks' matrix products in FP8 (`fp8` says
    /// how); or `auto`: the strategy search chooses bf16 or FP8 (FP8 where the engine runs
    /// FP8 products and the device has an FP8 rate).
    precision: Option<PrecisionOrAuto>,
    /// How FP8 training runs (with `precision: fp8`, or `auto` if the search chooses FP8);
    /// the defaults are Transformer Engine's as Megatron-LM runs it.
    fp8: Option<Fp8Spec>,
    /// The precision gradients are accumulated and reduced in: `fp32` (the default:
    /// Megatron-LM's, under `bf16`/`fp16`) or the training precision.
    grad_precision: Option<Precision>,
    /// Seed of the parameter initialisation and the synthetic data.
    seed: Option<u64>,
    data: Option<DataSpec>,
    checkpoint: Option<Checkpoint>,
    lr_schedule: Option<LrSchedule>,
    /// Clip the gradient's global norm (over every stage, tensor-parallel shard and
    /// replica) to this value before each update, as PyTorch's `clip_grad_norm_`.
    clip_grad_norm: Option<f64>,
    /// Draw a finite data set's samples in a new order every epoch (from the seed), rather
    /// than in file order.
    shuffle: Option<bool>,
    validation: Option<ValidationSpec>,
    /// When batch normalisation's running statistics move: `per_update` (the default: once
    /// per optimizer update, toward the mean of its microbatches' statistics, the same on
    /// every layout) or `per_forward` (at every forward in the step's microbatch order, as
    /// `nn.BatchNorm2d` under gradient accumulation; synchronous schedules).
    running_stats: Option<RunningStats>,
}

/// FP8 training's recipe and what it keeps in FP8.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Fp8Spec {
    /// How each tensor is scaled before its FP8 product: `tensorwise` (the default: one
    /// scale per tensor from its current maximum; Transformer Engine's current scaling,
    /// torchao's tensorwise), `delayed` (from a history of earlier maxima), `rowwise`,
    /// `blockwise` (DeepSeek-V3's 1×128 activation and 128×128 weight blocks) or `mxfp8`
    /// (Blackwell's MX blocks of 32).
    recipe: Option<pipec_plan::vocab::Fp8Recipe>,
    /// What the blocks' linear layers keep of their inputs for the weight gradients: `fp8`
    /// (Transformer Engine keeps the FP8 copy it multiplied) or `bf16` (torchao's
    /// `Float8Linear`, as torchtitan runs it, keeps the bf16 input). Default: the engine's
    /// (`bf16` under torchtitan, else `fp8`).
    activations: Option<pipec_plan::vocab::Fp8Storage>,
    /// Keep FP8 copies of every block weight (and its transpose) from a step's first
    /// microbatch to its update, as Transformer Engine does between Megatron-LM's
    /// microbatches: two bytes per weight. `false`: each copy is made for its product and
    /// dropped (torchao). Default: the engine's (false under torchtitan, else true).
    weight_copies: Option<bool>,
    /// What `zero: 3` gathers the blocks' weights in: `bf16` (the default) or `fp8`
    /// (torchao's `enable_fsdp_float8_all_gather`, Megatron-LM's `--fp8-param-gather`):
    /// half the bytes gathered and held.
    gather: Option<pipec_plan::vocab::Fp8Storage>,
}

/// Evaluation on held-out data: the last `split` of a finite data set is never trained on,
/// and every `every` steps (and after the last) the model's loss (and accuracy or
/// perplexity) over its whole batches goes to `metrics.jsonl`.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct ValidationSpec {
    /// Evaluate after every this many steps (and after the last).
    every: u64,
    /// The share of the data set held out, in (0, 1): its last samples.
    split: f64,
}

/// The learning rate over the steps: a linear warm-up from 0 to the optimizer's `lr`, then
/// a decay to `min_lr` at `decay_steps` (Hugging Face's schedules with warm-up).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct LrSchedule {
    /// Steps of linear warm-up (step t of it uses lr·t/warmup). Default 0.
    warmup: Option<u64>,
    /// `constant` (the default), `linear` or `cosine`.
    decay: Option<Decay>,
    /// The step at which the decay reaches `min_lr`. Default: `steps`.
    decay_steps: Option<u64>,
    /// The floor of the decay. Default 0.
    min_lr: Option<f64>,
}

/// The optimizer and its hyper-parameters.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Optimizer {
    /// `sgd`, `momentum` (SGD with momentum 0.9 unless given) or `adam`.
    kind: OptimizerKind,
    /// Learning rate.
    lr: f64,
    /// sgd/momentum: momentum factor.
    momentum: Option<f64>,
    /// L2 weight decay.
    weight_decay: Option<f64>,
    /// adam: β₁.
    beta1: Option<f64>,
    /// adam: β₂.
    beta2: Option<f64>,
    /// adam: ε.
    eps: Option<f64>,
    /// The precision the optimizer keeps its state in (Adam's moments, the momentum buffer):
    /// `fp32` (the default) or `bf16` (Megatron-LM's precision-aware optimizer,
    /// `--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`); the master weights stay fp32.
    state_precision: Option<Precision>,
    /// Under `bf16` or `fp16` training: whether the optimizer updates fp32 master weights
    /// (true, the default: Megatron-LM, torchtitan's FSDP2 over fp32 parameters, DeepSpeed)
    /// or the weights in the training precision in place, with no fp32 copy (false: a
    /// model built in bf16 and sharded as it is, as NeMo AutoModel's recipes do).
    master_weights: Option<bool>,
    /// adamw: whether `weight_decay` also shrinks the one-dimensional parameters — biases
    /// and the norms' gains and shifts. Default true (one parameter group, as
    /// `torch.optim.AdamW(model.parameters())`); false is the usual rule for language models.
    decay_biases_and_norms: Option<bool>,
}

#[derive(JsonSchema)]
#[serde(untagged)]
enum DataSpec {
    Name(DataKind),
    // boxed: the mapping's fields outweigh the name (clippy's large_enum_variant); the
    // schema is the same
    Options(Box<Data>),
}

#[derive(JsonSchema)]
#[serde(rename_all = "snake_case")]
enum DataKind {
    Synthetic,
}

/// Where the training data comes from.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Data {
    /// `synthetic` (deterministic from the seed), `csv`, `npy`, `images` (a folder of one
    /// folder per class, PNG or JPEG, or a CIFAR-10 batch file), or a language model's `text` (UTF-8, one token per
    /// character or a tokenizer's; a file, a folder of `.txt` files or a pattern such as
    /// `corpus/*.txt`), `jsonl` (JSON Lines records' `field`, an end-of-text token
    /// between records), `parquet` or `arrow` (a text or token-id `column`; `arrow` also
    /// takes a `datasets` save_to_disk folder) or `tokens` (token ids: `.npy`, or raw
    /// with `dtype`). A data file's
    /// first bytes are checked: a Parquet, Arrow, NPY or JSON Lines file given as another
    /// kind is refused naming what it is.
    kind: DataFileKind,
    /// synthetic: `classification` (labels from a fixed random teacher) or `regression`.
    task: Option<Task>,
    /// synthetic: number of distinct samples in the data set (batches cycle through it).
    samples: Option<u64>,
    /// csv/npy: path of the features file, relative to the spec. CSV: one sample per row,
    /// the last column is the label (class index or regression target).
    path: Option<String>,
    /// npy: path of the labels file (the features file holds the inputs).
    labels: Option<String>,
    /// tokens: the integer type of a raw token file (`uint16` or `uint32`); a `.npy` file
    /// says its own.
    dtype: Option<pipec_plan::TokenDtype>,
    /// text, jsonl: a Hugging Face `tokenizer.json` (BPE, Unigram or WordPiece), or a model
    /// folder holding one, relative to the spec, that cuts the text into tokens; without it,
    /// one token per character.
    tokenizer: Option<String>,
    /// jsonl: the field of each record (a JSON object per line) that holds its text
    /// (default `text`).
    field: Option<String>,
    /// parquet, arrow: the column that holds each record's text, or its token ids (a list
    /// of integers, taken as they are) (default `text`).
    column: Option<String>,
    /// jsonl, parquet, arrow: the tokenizer's token put between records (default: its end-of-text token,
    /// `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>`, `<|im_end|>` or `[SEP]`, the
    /// first it has); without a tokenizer a newline is.
    eot: Option<String>,
    /// images: the shorter side after resizing, before the centre crop to the model's input
    /// (default: the input's longer side).
    resize: Option<u64>,
    /// images: per-channel mean subtracted from values in [0, 1] (default 0).
    mean: Option<Vec<f64>>,
    /// images: per-channel standard deviation divided by (default 1).
    std: Option<Vec<f64>>,
}

#[derive(JsonSchema)]
#[serde(rename_all = "snake_case")]
enum DataFileKind {
    Synthetic,
    Csv,
    Npy,
    Text,
    Tokens,
    Images,
    Jsonl,
    Parquet,
    Arrow,
}

/// Checkpointing during `pipec run`.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
struct Checkpoint {
    /// Write a checkpoint every this many steps.
    every: u64,
    /// Directory for checkpoints, relative to the run's output directory.
    dir: Option<String>,
    /// Write each checkpoint while training goes on (the default): the step hands a copy
    /// of the state to the writer and continues; a step that must checkpoint while the
    /// previous write is unfinished waits for it. `false`: the step waits for its own write.
    #[serde(rename = "async")]
    asynchronous: Option<bool>,
}

/// The JSON Schema of the spec (draft 2020-12).
pub fn json_schema() -> Json {
    let schema = schemars::schema_for!(Spec);
    let mut json = serde_json::to_value(&schema).unwrap_or(Json::Null);
    strip_formats(&mut json);
    json
}

/// The schema as pretty JSON text, exactly as committed in `schema/pipec.schema.json`.
pub fn json_schema_text() -> String {
    let mut s = serde_json::to_string_pretty(&json_schema()).unwrap_or_default();
    s.push('\n');
    s
}

/// schemars marks integers with `format: uint64`, which strict validators reject; the
/// `minimum: 0` it also emits says the same thing.
fn strip_formats(v: &mut Json) {
    match v {
        Json::Object(map) => {
            if map
                .get("format")
                .and_then(Json::as_str)
                .is_some_and(|f| f.starts_with("uint") || f.starts_with("int") || f == "double")
            {
                map.remove("format");
            }
            map.values_mut().for_each(strip_formats);
        }
        Json::Array(items) => items.iter_mut().for_each(strip_formats),
        _ => {}
    }
}

/// What the schema says about the object at a key path (`["strategy", "schedule"]`).
#[derive(Debug, Clone, Default)]
pub struct ObjectDoc {
    /// The allowed keys, in schema order, each with its description.
    pub keys: Vec<(String, String)>,
}

/// Navigates the schema by key path.
#[derive(Debug, Clone)]
pub struct SchemaIndex {
    root: Json,
}

impl Default for SchemaIndex {
    fn default() -> Self {
        SchemaIndex { root: json_schema() }
    }
}

impl SchemaIndex {
    fn resolve<'a>(&'a self, mut s: &'a Json) -> &'a Json {
        for _ in 0..16 {
            match s.get("$ref").and_then(Json::as_str) {
                Some(r) => {
                    let name = r.rsplit('/').next().unwrap_or("");
                    match self.root.get("$defs").and_then(|d| d.get(name)) {
                        Some(t) => s = t,
                        None => return s,
                    }
                }
                None => return s,
            }
        }
        s
    }

    /// All alternatives of a schema node (anyOf/oneOf flattened, refs resolved).
    fn alternatives<'a>(&'a self, s: &'a Json) -> Vec<&'a Json> {
        let s = self.resolve(s);
        let mut out = Vec::new();
        for key in ["anyOf", "oneOf"] {
            if let Some(alts) = s.get(key).and_then(Json::as_array) {
                for a in alts {
                    out.extend(self.alternatives(a));
                }
            }
        }
        if out.is_empty() {
            out.push(s);
        }
        out
    }

    /// The schema of the value at `path` (each element a mapping key; list items are
    /// entered transparently).
    pub fn node_at(&self, path: &[&str]) -> Option<&Json> {
        let mut cur = &self.root;
        for key in path {
            let mut next = None;
            for alt in self.alternatives(cur) {
                if let Some(p) = alt.get("properties").and_then(|p| p.get(*key)) {
                    next = Some(p);
                    break;
                }
            }
            cur = next?;
        }
        Some(cur)
    }

    /// The keys a mapping at `path` may have, or None when the value there is no mapping.
    pub fn object_at(&self, path: &[&str]) -> Option<ObjectDoc> {
        let node = self.node_at(path)?;
        for alt in self.alternatives(node) {
            if let Some(props) = alt.get("properties").and_then(Json::as_object) {
                let keys = props.iter().map(|(k, v)| (k.clone(), self.description(v).unwrap_or_default())).collect();
                return Some(ObjectDoc { keys });
            }
        }
        None
    }

    /// The description of a schema node, following refs.
    pub fn description(&self, s: &Json) -> Option<String> {
        if let Some(d) = s.get("description").and_then(Json::as_str) {
            return Some(d.to_string());
        }
        let r = self.resolve(s);
        if let Some(d) = r.get("description").and_then(Json::as_str) {
            return Some(d.to_string());
        }
        for alt in self.alternatives(s) {
            if let Some(d) = alt.get("description").and_then(Json::as_str) {
                return Some(d.to_string());
            }
        }
        None
    }

    /// The documentation of the key at `path`.
    pub fn doc_at(&self, path: &[&str]) -> Option<String> {
        self.node_at(path).and_then(|n| self.description(n))
    }

    /// The allowed scalar values (enum constants) at `path`, with their docs.
    pub fn values_at(&self, path: &[&str]) -> Vec<(String, String)> {
        let Some(node) = self.node_at(path) else { return Vec::new() };
        let mut out = Vec::new();
        // a list's values are its items' (`recompute.modules: [core_attn, mlp]`)
        let alternatives = self.alternatives(node).into_iter().flat_map(|alt| match alt.get("items") {
            Some(items) => self.alternatives(items),
            None => vec![alt],
        });
        for alt in alternatives {
            if let Some(values) = alt.get("enum").and_then(Json::as_array) {
                for v in values.iter().filter_map(Json::as_str) {
                    out.push((v.to_string(), String::new()));
                }
            }
            if let Some(c) = alt.get("const").and_then(Json::as_str) {
                out.push((c.to_string(), self.description(alt).unwrap_or_default()));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_finds_keys_and_docs() {
        let idx = SchemaIndex::default();
        let strategy = idx.object_at(&["strategy"]).expect("strategy is an object");
        assert!(strategy.keys.iter().any(|(k, _)| k == "microbatches"));
        let sched = idx.object_at(&["strategy", "schedule"]).expect("schedule options");
        assert!(sched.keys.iter().any(|(k, _)| k == "virtual_stages"));
        assert!(idx.doc_at(&["cluster", "device", "memory"]).is_some_and(|d| d.contains("GiB")));
        let names: Vec<String> = idx.values_at(&["strategy", "schedule"]).into_iter().map(|v| v.0).collect();
        assert!(names.contains(&"1f1b".to_string()) && names.contains(&"zb-h1".to_string()));
        // a list's values are its items'
        let modules: Vec<String> =
            idx.values_at(&["strategy", "recompute", "modules"]).into_iter().map(|v| v.0).collect();
        assert!(modules.contains(&"core_attn".to_string()) && modules.contains(&"moe_act".to_string()), "{modules:?}");
    }
}
