//! What each engine can run: one table of rows per engine, each row a capability with the
//! engine's own spelling of it and its source (a file and line at the release
//! `super::RELEASES` names, or a document). What a table has no row for, the engine does not
//! run; `refusals` holds a layout to the table and names, for each thing it lacks, the
//! nearest value it runs.
//!
//! Sources: Megatron-LM at tag core_v0.19.0 (`[M]`), torchtitan at tag v0.2.2 (`[T]`) with
//! the PyTorch 2.15.0 pipelining schedules it names (`[P]`), DeepSpeed's 0.19.8 sdist
//! (`[D]`); pipec's own rows cite this repository.

use crate::recompute::BlockRecompute;
use crate::vocab::{
    CpComm, Engine, Fp8Recipe, MoeDispatch, Precision, RecomputeOp, ReduceMode, ScheduleKind, Sharding,
};

use super::EngineTarget;

/// How many model chunks a schedule holds per device, as the engine runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunks {
    /// Exactly one.
    One,
    /// Two or more (interleaved 1F1B).
    AtLeastTwo,
    /// Exactly two (the V-shaped schedules).
    Two,
    /// Whatever the schedule allows in pipec.
    Any,
}

impl Chunks {
    fn admits(self, chunks: usize) -> bool {
        match self {
            Chunks::One => chunks == 1,
            Chunks::AtLeastTwo => chunks >= 2,
            Chunks::Two => chunks == 2,
            Chunks::Any => true,
        }
    }
}

/// How a strategy recomputes activations (the spec's `recompute`), as the tables see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecomputeKind {
    Off,
    /// Every stage recomputes its whole forward.
    Full,
    /// Some stages do, others not.
    SomeStages,
    /// Each block recomputes its attention core (Korthikanti et al.'s selective recompute),
    /// or recomputes inside the blocks otherwise (the spec's `recompute` as a mapping, whose
    /// parts the tables judge one by one: [`BlockRecomputePart`]).
    Selective,
}

/// A part of recompute inside the blocks (the spec's `recompute` as a mapping), as the
/// tables see it: an engine runs the mapping when it runs each of its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockRecomputePart {
    /// Named modules recomputed (`modules:`).
    Modules,
    /// torchtitan's op-level policy: every other matrix product's output and the attention
    /// kernel's kept, the rest recomputed (`ops: [alternate_matmul, attention]`).
    OpPolicy,
    /// Another list of kept operations (`ops:`).
    Ops,
    /// The first blocks of every chunk recomputed whole (`layers:`).
    FirstLayers,
    /// The kept tensors sent to host memory (`offload: true`).
    Offload,
}

impl BlockRecomputePart {
    /// torchtitan's op-level policy's kept operations, in its order.
    pub const OP_POLICY: [RecomputeOp; 2] = [RecomputeOp::AlternateMatmul, RecomputeOp::Attention];

    /// The parts of `b`, in the spec's order.
    pub fn of(b: &BlockRecompute) -> Vec<BlockRecomputePart> {
        let policy = b.ops.len() == Self::OP_POLICY.len() && Self::OP_POLICY.iter().all(|o| b.ops.contains(o));
        [
            (!b.modules.is_empty(), BlockRecomputePart::Modules),
            (!b.ops.is_empty() && policy, BlockRecomputePart::OpPolicy),
            (!b.ops.is_empty() && !policy, BlockRecomputePart::Ops),
            (b.layers > 0, BlockRecomputePart::FirstLayers),
            (b.offload, BlockRecomputePart::Offload),
        ]
        .into_iter()
        .filter_map(|(on, part)| on.then_some(part))
        .collect()
    }

    /// What an engine without this part does not run, in words.
    fn missing(self) -> &'static str {
        match self {
            BlockRecomputePart::Modules => "does not recompute named modules inside the blocks (`modules:`)",
            BlockRecomputePart::OpPolicy | BlockRecomputePart::Ops => {
                "does not keep a list of operations inside the blocks (`ops:`)"
            }
            BlockRecomputePart::FirstLayers => {
                "does not recompute only the first blocks of each stage whole (`layers:`)"
            }
            BlockRecomputePart::Offload => "has no activation offload in its configuration (`offload:`)",
        }
    }
}

/// One thing an engine can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// A pipeline schedule (`dp-only`: no pipeline) with the chunks per device it runs.
    Schedule(ScheduleKind, Chunks),
    /// A ZeRO level across data-parallel replicas; `with_pipeline`: also beside a pipeline.
    Sharding {
        level: Sharding,
        with_pipeline: bool,
    },
    TensorParallel,
    /// Megatron's sequence parallelism beside tensor parallelism.
    SequenceParallel,
    /// Tensor parallelism's collectives overlapped with computation.
    TpOverlap,
    /// Context parallelism exchanging keys and values so.
    ContextParallel(CpComm),
    ExpertParallel,
    /// Beside tensor parallelism, each routed expert split over the tensor-parallel ranks
    /// (expert tensor parallelism = tensor parallelism).
    SplitExperts,
    /// Beside tensor parallelism, each routed expert whole on one device, the tensor-parallel
    /// ranks folded into the expert-parallel group (expert tensor parallelism 1).
    WholeExperts,
    /// Expert parallelism's tokens sent once per destination node and forwarded over
    /// NVLink (DeepEP, HybridEP).
    DeepEpDispatch,
    /// Expert parallelism's all-to-alls overlapped with another microbatch's computation
    /// (Megatron-LM's combined 1F1B).
    EpOverlap,
    Recompute(RecomputeKind),
    /// A part of recompute inside the blocks.
    BlockRecompute(BlockRecomputePart),
    Precision(Precision),
    /// FP8 products with this scaling recipe (beside bf16).
    Fp8(Fp8Recipe),
    /// A bf16 or fp16 model trained without fp32 master weights (`optimizer.master_weights:
    /// false`).
    NoMasterWeights,
    /// Gradients accumulated and reduced in bf16 (`grad_precision: bf16`).
    Bf16Gradients,
    /// The optimizer's moments kept in bf16 (`optimizer.state_precision: bf16`).
    Bf16OptimizerState,
    /// Stages replicated unequally (PipeDream's `2-1-1`).
    UnevenReplicas,
    /// Asynchronous schedules or data parallelism (stale weights).
    Asynchronous,
    /// A parameter server in place of the all-reduce.
    ParameterServer,
    /// Any model pipec compiles; without this row, a decoder-only language model only
    /// (`super::gpt::GptShape`).
    AnyModel,
    /// DeepSeek-V3's multi-token prediction (`model.mtp`).
    MultiTokenPrediction,
    /// Any split of the transformer blocks over the pipeline's chunks, written layer by
    /// layer (Megatron-LM's `--pipeline-model-parallel-layout`).
    LayerLayout,
}

/// A rule between capabilities that an engine enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Constraint {
    /// The transformer blocks split evenly over the pipeline's stages (all chunks).
    EvenLayerSplit,
    /// The transformer blocks split evenly over the pipeline's stages (all chunks), the
    /// embedding and the loss each counted as one layer of the first and the last chunk
    /// where that makes the split even (`megatron_split`).
    EvenLayerSplitCountingEnds,
    /// Interleaved 1F1B: microbatches a multiple of the pipeline's depth.
    InterleavedMicrobatchesPerRank,
    /// At least as many microbatches as pipeline stages (a single-stage-per-rank schedule).
    MicrobatchesAtLeastStages,
    /// DualPipeV: at least twice as many microbatches as pipeline ranks.
    DualPipeVMicrobatches,
    /// Tensor parallelism always splits the sequence outside its products.
    SequenceParallelWithTp,
    /// Overlapping tensor parallelism's collectives needs sequence parallelism.
    TpOverlapNeedsSequenceParallel,
    /// Overlapping tensor parallelism's collectives needs the model compiled.
    TpOverlapNeedsCompile,
    /// Unsharded data parallelism only when it is the only parallelism.
    PlainDataParallelAlone,
    /// No tensor parallelism beside a pipeline from the configuration alone.
    NoTensorParallelWithPipeline,
    /// Expert parallelism divides the tensor- and data-parallel devices' product into
    /// whole groups (pipec's `ep` divides each stage's replicas: always met).
    ExpertGroupsWhole,
    /// Overlapping expert-parallel all-to-alls refuses full recompute (of every block, or of
    /// the first blocks of each stage).
    EpOverlapWithoutFullRecompute,
    /// Recompute inside the blocks is by module or by whole layers, not both at once.
    ModulesOrLayers,
}

/// A table row: a capability (or a constraint), what the engine calls it, from which
/// release (within the range pipec describes), and where that is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row<T> {
    pub engine: Engine,
    pub what: T,
    /// The engine's spelling: a flag, a configuration key or a class.
    pub runs_as: &'static str,
    /// The first release with it, when that is inside the covered range.
    pub since: Option<&'static str>,
    pub source: &'static str,
}

const fn row<T>(engine: Engine, what: T, runs_as: &'static str, source: &'static str) -> Row<T> {
    Row { engine, what, runs_as, since: None, source }
}

use Capability as C;
use Engine::{Deepspeed as DS, Megatron as MG, Pipec as PC, Torchtitan as TT};
use ScheduleKind as K;

/// What `pipec run` runs: every schedule and option the compiler plans
/// (`pipec_executor::caveats` lists where it runs one differently from how it is priced).
const PIPEC_SOURCE: &str = "executor/src/lib.rs (`run` interprets any verified plan's streams; `caveats` lists bf16/fp16 kernels, tp_overlap, an engine's sequence parallelism, ring context parallelism, overlapped expert exchanges and ZeRO-3 gathers run differently from their pricing)";

/// Every engine's capabilities.
pub const CAPABILITIES: &[Row<Capability>] = &[
    // pipec: everything its compiler plans
    row(PC, C::AnyModel, "pipec run", PIPEC_SOURCE),
    row(PC, C::Schedule(K::DpOnly, Chunks::Any), "dp-only", PIPEC_SOURCE),
    row(PC, C::Schedule(K::Gpipe, Chunks::Any), "gpipe", PIPEC_SOURCE),
    row(PC, C::Schedule(K::OneFOneB, Chunks::Any), "1f1b", PIPEC_SOURCE),
    row(PC, C::Schedule(K::Interleaved, Chunks::Any), "interleaved", PIPEC_SOURCE),
    row(PC, C::Schedule(K::PipeDream, Chunks::Any), "pipedream", PIPEC_SOURCE),
    row(PC, C::Schedule(K::TwoBw, Chunks::Any), "2bw", PIPEC_SOURCE),
    row(PC, C::Schedule(K::Chimera, Chunks::Any), "chimera", PIPEC_SOURCE),
    row(PC, C::Schedule(K::ZbH1, Chunks::Any), "zb-h1", PIPEC_SOURCE),
    row(PC, C::Schedule(K::Zbv, Chunks::Any), "zbv", PIPEC_SOURCE),
    row(PC, C::Schedule(K::DualPipeV, Chunks::Any), "dualpipev", PIPEC_SOURCE),
    row(PC, C::Schedule(K::DualPipe, Chunks::Any), "dualpipe", PIPEC_SOURCE),
    row(PC, C::Sharding { level: Sharding::None, with_pipeline: true }, "zero: 0", PIPEC_SOURCE),
    row(PC, C::Sharding { level: Sharding::Optimizer, with_pipeline: true }, "zero: 1", PIPEC_SOURCE),
    row(PC, C::Sharding { level: Sharding::Gradients, with_pipeline: true }, "zero: 2", PIPEC_SOURCE),
    row(PC, C::Sharding { level: Sharding::Parameters, with_pipeline: true }, "zero: 3", PIPEC_SOURCE),
    row(PC, C::TensorParallel, "tp", PIPEC_SOURCE),
    row(PC, C::SequenceParallel, "sequence_parallel (run and priced as tensor parallelism's all-reduces on whole activations)", PIPEC_SOURCE),
    row(PC, C::TpOverlap, "tp_overlap (run in line)", PIPEC_SOURCE),
    row(PC, C::ContextParallel(CpComm::AllGather), "cp_comm: all_gather", PIPEC_SOURCE),
    row(PC, C::ContextParallel(CpComm::Ring), "cp_comm: ring", PIPEC_SOURCE),
    row(PC, C::ExpertParallel, "ep", PIPEC_SOURCE),
    row(PC, C::SplitExperts, "ep beside tp (each expert split like the block)", PIPEC_SOURCE),
    row(PC, C::WholeExperts, "etp: 1 (`pipec run` runs it with `ep` at least twice `tp`, without ZeRO, and refuses it otherwise)", PIPEC_SOURCE),
    row(PC, C::DeepEpDispatch, "moe_dispatch: deepep (priced; run as an all-to-all)", PIPEC_SOURCE),
    row(PC, C::EpOverlap, "ep_overlap (the combined 1F1B order; a pair's passes run one after the other)", PIPEC_SOURCE),
    row(PC, C::Recompute(RecomputeKind::Full), "recompute: true", PIPEC_SOURCE),
    row(PC, C::Recompute(RecomputeKind::SomeStages), "recompute: [stages]", PIPEC_SOURCE),
    row(PC, C::Recompute(RecomputeKind::Selective), "recompute: selective", PIPEC_SOURCE),
    row(PC, C::BlockRecompute(BlockRecomputePart::Modules), "recompute: { modules: [...] } (run as the halves of each block they touch)", PIPEC_SOURCE),
    row(PC, C::BlockRecompute(BlockRecomputePart::OpPolicy), "recompute: { ops: [alternate_matmul, attention] } (run as both halves of each block)", PIPEC_SOURCE),
    row(PC, C::BlockRecompute(BlockRecomputePart::Ops), "recompute: { ops: [...] } (run as both halves of each block)", PIPEC_SOURCE),
    row(PC, C::BlockRecompute(BlockRecomputePart::FirstLayers), "recompute: { layers: N }", PIPEC_SOURCE),
    row(PC, C::BlockRecompute(BlockRecomputePart::Offload), "recompute: { offload: true } (planned and priced; `pipec run` refuses it)", PIPEC_SOURCE),
    row(PC, C::Precision(Precision::Fp32), "fp32", PIPEC_SOURCE),
    row(PC, C::Precision(Precision::Bf16), "bf16 (products in bf16, the rest fp32)", PIPEC_SOURCE),
    row(PC, C::Precision(Precision::Fp16), "fp16 (loss scaling; fp32 under async schedules)", PIPEC_SOURCE),
    row(PC, C::Fp8(Fp8Recipe::Delayed), "fp8: { recipe: delayed } (planned and priced; run in bf16, said before training)", PIPEC_SOURCE),
    row(PC, C::Fp8(Fp8Recipe::Tensorwise), "fp8: { recipe: tensorwise } (planned and priced; run in bf16, said before training)", PIPEC_SOURCE),
    row(PC, C::Fp8(Fp8Recipe::Rowwise), "fp8: { recipe: rowwise } (planned and priced; run in bf16, said before training)", PIPEC_SOURCE),
    row(PC, C::Fp8(Fp8Recipe::Blockwise), "fp8: { recipe: blockwise } (planned and priced; run in bf16, said before training)", PIPEC_SOURCE),
    row(PC, C::Fp8(Fp8Recipe::Mxfp8), "fp8: { recipe: mxfp8 } (planned and priced; run in bf16, said before training)", PIPEC_SOURCE),
    row(PC, C::Bf16Gradients, "grad_precision: bf16 (each microbatch's sum and each partial sum of the reduction rounded to bf16)", PIPEC_SOURCE),
    row(PC, C::Bf16OptimizerState, "optimizer: { state_precision: bf16 } (`pipec run` rounds the state to bf16 after each update)", PIPEC_SOURCE),
    row(PC, C::NoMasterWeights, "optimizer: { master_weights: false } (`pipec run` rounds the weights to their precision after each update)", PIPEC_SOURCE),
    row(PC, C::UnevenReplicas, "stages: \"2-1-1\"", PIPEC_SOURCE),
    row(PC, C::Asynchronous, "pipedream, 2bw, sync: asp/ssp", PIPEC_SOURCE),
    row(PC, C::ParameterServer, "reduce: ps", PIPEC_SOURCE),
    // Megatron-LM core_v0.19.0: pretrain_gpt.py
    row(MG, C::Schedule(K::DpOnly, Chunks::One), "--pipeline-model-parallel-size 1", "[M] megatron/core/pipeline_parallel/schedules.py:149-163"),
    row(MG, C::Schedule(K::OneFOneB, Chunks::One), "--pipeline-model-parallel-size N", "[M] megatron/core/pipeline_parallel/schedules.py:156-160"),
    row(MG, C::Schedule(K::Interleaved, Chunks::AtLeastTwo), "--num-virtual-stages-per-pipeline-rank V", "[M] megatron/training/arguments.py:893-946; schedules.py:1133-1153"),
    row(MG, C::Sharding { level: Sharding::None, with_pipeline: true }, "(DDP)", "[M] megatron/training/arguments.py:2968"),
    row(MG, C::Sharding { level: Sharding::Optimizer, with_pipeline: true }, "--use-distributed-optimizer", "[M] megatron/training/arguments.py:2997"),
    row(MG, C::Sharding { level: Sharding::Gradients, with_pipeline: true }, "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", "[M] megatron/training/arguments.py:1100-1164, 3023-3030"),
    row(MG, C::Sharding { level: Sharding::Parameters, with_pipeline: true }, "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params", "[M] megatron/training/arguments.py:1100-1164, 3023-3030"),
    row(MG, C::TensorParallel, "--tensor-model-parallel-size", "[M] megatron/core/transformer/transformer_config.py:1323-1345"),
    row(MG, C::SequenceParallel, "--sequence-parallel", "[M] megatron/training/arguments.py:1392-1402"),
    row(MG, C::TpOverlap, "--tp-comm-overlap", "[M] megatron/core/model_parallel_config.py:265; arguments.py:1401-1402"),
    row(MG, C::ContextParallel(CpComm::AllGather), "--context-parallel-size N --cp-comm-type allgather", "[M] megatron/training/arguments.py:1295-1298, 3054-3059"),
    row(MG, C::ContextParallel(CpComm::Ring), "--context-parallel-size N --cp-comm-type p2p", "[M] megatron/training/arguments.py:1295-1298, 3054-3059"),
    row(MG, C::ExpertParallel, "--expert-model-parallel-size N", "[M] megatron/training/arguments.py:568-569, 1600-1603; megatron/core/parallel_state.py:874-884"),
    row(MG, C::SplitExperts, "--expert-tensor-parallel-size = --tensor-model-parallel-size (the default)", "[M] megatron/training/arguments.py:587-588; megatron/core/parallel_state.py:871-892"),
    row(MG, C::WholeExperts, "--expert-tensor-parallel-size 1", "[M] megatron/core/parallel_state.py:871-892"),
    row(MG, C::LayerLayout, "--pipeline-model-parallel-layout \"Et|tt|…|tL\" (each chunk's layers, in model order)", "[M] megatron/training/arguments.py:893-917; megatron/core/transformer/pipeline_parallel_layer_layout.py:24-135, 283-321"),
    row(MG, C::MultiTokenPrediction, "--mtp-num-layers N --mtp-loss-scaling-factor W (on the last pipeline stage)", "[M] megatron/core/transformer/transformer_config.py:68-75; megatron/core/transformer/multi_token_prediction.py:897-1049"),
    row(MG, C::DeepEpDispatch, "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep", "[M] megatron/core/transformer/transformer_config.py:862-869"),
    row(MG, C::EpOverlap, "--overlap-moe-expert-parallel-comm", "[M] megatron/core/model_parallel_config.py:343; transformer_config.py:2669-2713; pipeline_parallel/schedules.py:751, 939-943"),
    row(MG, C::Recompute(RecomputeKind::Full), "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", "[M] megatron/core/transformer/transformer_config.py:1724-1761"),
    row(MG, C::Recompute(RecomputeKind::Selective), "--recompute-granularity selective (--recompute-modules core_attn, the default)", "[M] megatron/core/transformer/transformer_config.py:1763-1832"),
    row(MG, C::BlockRecompute(BlockRecomputePart::Modules), "--recompute-granularity selective --recompute-modules M…", "[M] megatron/core/transformer/transformer_config.py:1763-1832"),
    row(MG, C::BlockRecompute(BlockRecomputePart::FirstLayers), "--recompute-granularity full --recompute-method block --recompute-num-layers N", "[M] megatron/core/transformer/transformer_config.py:1724-1761"),
    row(MG, C::Precision(Precision::Fp32), "(neither --bf16 nor --fp16)", "[M] megatron/training/arguments.py:1171-1183"),
    row(MG, C::Precision(Precision::Bf16), "--bf16", "[M] megatron/training/arguments.py:1171-1183"),
    row(MG, C::Precision(Precision::Fp16), "--fp16", "[M] megatron/training/arguments.py:1171-1183"),
    row(MG, C::Bf16Gradients, "--grad-reduce-in-bf16 (without it --bf16 accumulates and reduces in fp32)", "[M] megatron/training/arguments.py:1181-1194, 2905-2906"),
    row(MG, C::Bf16OptimizerState, "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 (Adam and the distributed optimizer only)", "[M] megatron/training/arguments.py:3500-3517; megatron/core/optimizer/optimizer_config.py:430-436"),
    row(MG, C::Fp8(Fp8Recipe::Delayed), "--fp8-format hybrid --fp8-recipe delayed", "[M] megatron/core/transformer/transformer_config.py:566-590"),
    row(MG, C::Fp8(Fp8Recipe::Tensorwise), "--fp8-format hybrid --fp8-recipe tensorwise", "[M] megatron/core/transformer/transformer_config.py:566-590"),
    row(MG, C::Fp8(Fp8Recipe::Blockwise), "--fp8-format hybrid --fp8-recipe blockwise", "[M] megatron/core/transformer/transformer_config.py:566-590"),
    row(MG, C::Fp8(Fp8Recipe::Mxfp8), "--fp8-format hybrid --fp8-recipe mxfp8 (Blackwell)", "[M] megatron/core/transformer/transformer_config.py:566-590"),
    // torchtitan v0.2.2: its TOML job configuration
    row(TT, C::Schedule(K::DpOnly, Chunks::One), "pipeline_parallel_degree = 1", "[T] torchtitan/config/job_config.py:312-349"),
    row(TT, C::Schedule(K::OneFOneB, Chunks::One), "pipeline_parallel_schedule = \"1F1B\"", "[P] torch/distributed/pipelining/schedules.py:5220-5244; [T] torchtitan/distributed/pipeline_parallel.py:54-115"),
    row(TT, C::Schedule(K::Gpipe, Chunks::One), "pipeline_parallel_schedule = \"GPipe\"", "[P] torch/distributed/pipelining/schedules.py:5220-5244"),
    row(TT, C::Schedule(K::Interleaved, Chunks::AtLeastTwo), "pipeline_parallel_schedule = \"Interleaved1F1B\"", "[P] torch/distributed/pipelining/schedules.py:4120-4126, 5220-5244"),
    row(TT, C::Schedule(K::Zbv, Chunks::Two), "pipeline_parallel_schedule = \"ZBVZeroBubble\"", "[P] torch/distributed/pipelining/schedules.py:4480-4485, 5220-5244"),
    row(TT, C::Schedule(K::DualPipeV, Chunks::Two), "pipeline_parallel_schedule = \"DualPipeV\"", "[P] torch/distributed/pipelining/schedules.py:4690-4698; [T] torchtitan/distributed/dual_pipe_v.py:36-51"),
    row(TT, C::Sharding { level: Sharding::None, with_pipeline: true }, "data_parallel_replicate_degree = dp (alone: Constraint::PlainDataParallelAlone)", "[T] torchtitan/models/llama3/infra/parallelize.py:125-157"),
    row(TT, C::Sharding { level: Sharding::Gradients, with_pipeline: true }, "data_parallel_shard_degree = dp, fsdp_reshard_after_forward = \"never\"", "[T] torchtitan/config/job_config.py:312-349"),
    row(TT, C::Sharding { level: Sharding::Parameters, with_pipeline: true }, "data_parallel_shard_degree = dp (FSDP2)", "[T] torchtitan/distributed/parallel_dims.py:334-336; job_config.py:312-349"),
    row(TT, C::TensorParallel, "tensor_parallel_degree", "[T] torchtitan/models/llama3/infra/parallelize.py:181-233"),
    row(TT, C::SequenceParallel, "(always with tensor_parallel_degree > 1)", "[T] torchtitan/models/llama3/infra/parallelize.py:181-233"),
    row(TT, C::TpOverlap, "enable_async_tensor_parallel = true (with [compile] enable)", "[T] torchtitan/models/llama3/infra/parallelize.py:69-74; distributed/tensor_parallel.py:16-27"),
    row(TT, C::ContextParallel(CpComm::AllGather), "context_parallel_degree, context_parallel_rotate_method = \"allgather\"", "[T] torchtitan/distributed/context_parallel.py:52-77"),
    row(TT, C::ContextParallel(CpComm::Ring), "context_parallel_degree, context_parallel_rotate_method = \"alltoall\"", "[T] torchtitan/distributed/context_parallel.py:52-77"),
    row(TT, C::ExpertParallel, "expert_parallel_degree", "[T] torchtitan/distributed/parallel_dims.py:58-59, 136-138"),
    row(TT, C::SplitExperts, "expert_tensor_parallel_degree = tensor_parallel_degree", "[T] torchtitan/distributed/parallel_dims.py:58-59, 136-138"),
    row(TT, C::WholeExperts, "expert_tensor_parallel_degree = 1", "[T] torchtitan/distributed/parallel_dims.py:58-59, 136-138"),
    row(TT, C::DeepEpDispatch, "[parallelism] expert_parallel_comm_backend = \"deepep\"", "[T] torchtitan/config/job_config.py:474-482"),
    row(TT, C::Recompute(RecomputeKind::Full), "[activation_checkpoint] mode = \"full\"", "[T] torchtitan/config/job_config.py:651-715"),
    // its `selective` mode is this op-level policy (or every n-th block whole), never the
    // attention core alone: pipec's `recompute: selective` is refused, the policy its fix
    row(TT, C::BlockRecompute(BlockRecomputePart::OpPolicy), "[activation_checkpoint] mode = \"selective\", selective_ac_option = \"op\" (its policy's operations only)", "[T] torchtitan/config/job_config.py:651-715; distributed/activation_checkpoint.py:167-185"),
    row(TT, C::Precision(Precision::Fp32), "mixed_precision_param = \"float32\"", "[T] torchtitan/config/job_config.py:275-293"),
    row(TT, C::Precision(Precision::Bf16), "mixed_precision_param = \"bfloat16\"", "[T] torchtitan/config/job_config.py:275-293"),
    row(TT, C::Fp8(Fp8Recipe::Tensorwise), "[model] converters = [\"quantize.linear.float8\"]", "[T] torchtitan/config/job_config.py:731-754; components/quantization/float8.py:238"),
    row(TT, C::Fp8(Fp8Recipe::Rowwise), "[model] converters = [\"quantize.linear.float8\"], [quantize.linear.float8] recipe_name = \"rowwise\"", "[T] torchtitan/config/job_config.py:731-754; components/quantization/float8.py:238"),
    row(TT, C::Fp8(Fp8Recipe::Mxfp8), "[model] converters = [\"quantize.linear.mx\"] (Blackwell)", "[T] torchtitan/config/job_config.py:766-792; components/quantization/mx.py:171"),
    // DeepSpeed 0.19.8: ds_config.json and deepspeed.pipe
    row(DS, C::AnyModel, "deepspeed.initialize(model=...)", "[D] deepspeed/__init__.py:586-648"),
    row(DS, C::Schedule(K::DpOnly, Chunks::One), "(no PipelineModule)", "[D] deepspeed/runtime/pipe/schedule.py:11-327"),
    row(DS, C::Schedule(K::OneFOneB, Chunks::One), "deepspeed.pipe.PipelineModule (TrainSchedule)", "[D] deepspeed/runtime/pipe/schedule.py:189-210; runtime/pipe/module.py:116-133"),
    Row { since: Some("0.19.8"), ..row(DS, C::Schedule(K::DualPipeV, Chunks::Two), "deepspeed.pipe.DualPipeVModule", "[D] deepspeed/runtime/pipe/dualpipev.py:30, 94-107; schedule.py:327-360") },
    row(DS, C::Sharding { level: Sharding::None, with_pipeline: true }, "zero_optimization.stage = 0", "[D] deepspeed/runtime/zero/config.py:81-377"),
    row(DS, C::Sharding { level: Sharding::Optimizer, with_pipeline: true }, "zero_optimization.stage = 1", "[D] deepspeed/runtime/zero/config.py:81-377"),
    row(DS, C::Sharding { level: Sharding::Gradients, with_pipeline: false }, "zero_optimization.stage = 2", "[D] deepspeed/runtime/pipe/engine.py:76-77 (refused beside a pipeline)"),
    row(DS, C::Sharding { level: Sharding::Parameters, with_pipeline: false }, "zero_optimization.stage = 3", "[D] deepspeed/runtime/pipe/engine.py:76-77 (refused beside a pipeline)"),
    row(DS, C::TensorParallel, "tensor_parallel.autotp_size", "[D] deepspeed/runtime/tensor_parallel/config.py:38-152; runtime/engine.py:1019-1023"),
    row(DS, C::TpOverlap, "tensor_parallel.tp_overlap_comm = true", "[D] deepspeed/runtime/tensor_parallel/config.py:38-152"),
    Row { since: Some("0.19.4"), ..row(DS, C::ExpertParallel, "expert_parallel.autoep_size", "[D] deepspeed/module_inject/auto_ep_config.py:42-67, 105-180") },
    Row { since: Some("0.19.4"), ..row(DS, C::WholeExperts, "expert_parallel.expert_tensor_parallel_size = 1 (AutoEP's folding; other sizes refused)", "[D] deepspeed/module_inject/auto_ep_folding.py:110-125, 214-217") },
    row(DS, C::Recompute(RecomputeKind::Full), "activation_checkpointing (every layer through deepspeed.checkpointing.checkpoint)", "[D] deepspeed/runtime/activation_checkpointing/config.py:27-90"),
    row(DS, C::Precision(Precision::Fp32), "(neither bf16 nor fp16 enabled)", "[D] deepspeed/runtime/precision_config.py:41-160"),
    row(DS, C::Precision(Precision::Bf16), "bf16.enabled = true", "[D] deepspeed/runtime/precision_config.py:41-160; runtime/config.py:509-512"),
    row(DS, C::Precision(Precision::Fp16), "fp16.enabled = true", "[D] deepspeed/runtime/precision_config.py:41-160; runtime/config.py:509-512"),
];

/// Every engine's constraints between capabilities.
pub const CONSTRAINTS: &[Row<Constraint>] = &[
    row(
        MG,
        Constraint::EvenLayerSplitCountingEnds,
        "(--num-layers + embedding + loss) % (PP·VPP) == 0, the ends counted by --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split",
        "[M] megatron/training/arguments.py:919-996; megatron/core/transformer/transformer_config.py:137-141",
    ),
    row(
        MG,
        Constraint::InterleavedMicrobatchesPerRank,
        "microbatch_group_size_per_vp_stage (default PP) ≤ M, M % PP == 0",
        "[M] megatron/core/pipeline_parallel/schedules.py:1133-1153",
    ),
    row(
        MG,
        Constraint::TpOverlapNeedsSequenceParallel,
        "--tp-comm-overlap needs --sequence-parallel",
        "[M] megatron/training/arguments.py:1401-1402",
    ),
    row(MG, Constraint::ExpertGroupsWhole, "world % (ETP·EP·PP) == 0", "[M] megatron/core/parallel_state.py:870-884"),
    row(
        MG,
        Constraint::EpOverlapWithoutFullRecompute,
        "--overlap-moe-expert-parallel-comm refuses --recompute-granularity full",
        "[M] megatron/core/transformer/transformer_config.py:2689-2699",
    ),
    row(
        MG,
        Constraint::ModulesOrLayers,
        "--recompute-granularity is selective (--recompute-modules) or full (--recompute-num-layers), one at a time",
        "[M] megatron/core/transformer/transformer_config.py:1724-1832",
    ),
    row(
        TT,
        Constraint::EvenLayerSplit,
        "pipeline_parallel_layers_per_stage: stages % PP == 0",
        "[T] torchtitan/distributed/pipeline_parallel.py:70-115, 236-300",
    ),
    row(
        TT,
        Constraint::InterleavedMicrobatchesPerRank,
        "Interleaved1F1B: n_microbatches % PP == 0",
        "[P] torch/distributed/pipelining/schedules.py:4120-4126",
    ),
    row(
        TT,
        Constraint::MicrobatchesAtLeastStages,
        "1F1B: n_microbatches ≥ stages",
        "[P] torch/distributed/pipelining/schedules.py:1440-1444",
    ),
    row(
        TT,
        Constraint::SequenceParallelWithTp,
        "norms are SequenceParallel() under TP",
        "[T] torchtitan/models/llama3/infra/parallelize.py:181-233",
    ),
    row(
        TT,
        Constraint::TpOverlapNeedsCompile,
        "async TP raises without `model` in [compile] components and [compile] enable",
        "[T] torchtitan/distributed/tensor_parallel.py:16-27 (maybe_enable_async_tp)",
    ),
    row(
        TT,
        Constraint::PlainDataParallelAlone,
        "DDP has not supported > 1D parallelism",
        "[T] torchtitan/models/llama3/infra/parallelize.py:125-157",
    ),
    row(
        TT,
        Constraint::ExpertGroupsWhole,
        "dp_shard·cp·tp / (etp·ep) whole",
        "[T] torchtitan/distributed/parallel_dims.py:58-59, 136-138",
    ),
    row(
        DS,
        Constraint::DualPipeVMicrobatches,
        "gradient_accumulation_steps ≥ 2·stages",
        "[D] deepspeed/runtime/pipe/dualpipev.py:94-107",
    ),
    row(
        DS,
        Constraint::NoTensorParallelWithPipeline,
        "PipelineModule's topology comes from the client's mpu, not ds_config",
        "[D] deepspeed/runtime/pipe/module.py:116-133; runtime/engine.py:1019-1023",
    ),
    row(
        DS,
        Constraint::MicrobatchesAtLeastStages,
        "TrainSchedule: steps = 2·(M+S−1), every stage busy only with M ≥ S",
        "[D] deepspeed/runtime/pipe/schedule.py:189-210",
    ),
];

/// The layout facts the tables judge: what a spec's strategy and a plan both say.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// Replicas per pipeline rank, as written (not counting context parallelism).
    pub replicas: Vec<usize>,
    pub tp: usize,
    pub cp: usize,
    /// Expert parallelism's devices per group (Megatron-LM's `--expert-model-parallel-size`).
    pub ep: usize,
    /// Expert tensor parallelism: `tp` (experts split like the block) or 1 (whole).
    pub etp: usize,
    pub schedule: ScheduleKind,
    pub virtual_stages: usize,
    /// Microbatches per step as written (each of `cp` chunks under context parallelism).
    pub microbatches: usize,
    pub synchronous: bool,
    pub reduce: ReduceMode,
    pub sharding: Sharding,
    pub sequence_parallel: bool,
    pub tp_overlap: bool,
    pub cp_comm: CpComm,
    pub moe_dispatch: MoeDispatch,
    /// Expert parallelism's all-to-alls overlapped in combined forward–backward pairs.
    pub ep_overlap: bool,
    pub recompute: RecomputeKind,
    /// Recompute inside the blocks (the spec's `recompute` as a mapping), judged part by
    /// part ([`BlockRecomputePart::of`]).
    pub block_recompute: Option<BlockRecompute>,
    pub precision: Precision,
    /// FP8 products' recipe, when the blocks' products are in FP8.
    pub fp8: Option<Fp8Recipe>,
    /// Whether a bf16 or fp16 model's optimizer updates fp32 master weights.
    pub master_weights: bool,
    /// The precision gradients are accumulated and reduced in.
    pub grad_precision: Precision,
    /// The precision of the optimizer's moments, and whether the optimizer is Adam.
    pub state_precision: Precision,
    pub adam: bool,
    /// Transformer blocks (0: not a transformer).
    pub blocks: usize,
    /// Transformer blocks of each model chunk in model order, where the partition is known
    /// (a plan's, or a spec's explicit one; None: the compiler balances it).
    pub chunk_blocks: Option<Vec<usize>>,
    /// Whether the model is a decoder-only language model the emitters describe.
    pub gpt: bool,
    /// Multi-token prediction's depth (`model.mtp`; 0: none).
    pub mtp: usize,
    /// Whether the engine compiles the model's blocks (torchtitan's `compile`).
    pub compiled: bool,
}

impl Layout {
    pub fn pp(&self) -> usize {
        self.replicas.len()
    }
    pub fn dp(&self) -> usize {
        self.replicas.iter().copied().max().unwrap_or(1)
    }
    fn uneven(&self) -> bool {
        self.replicas.iter().any(|&r| r != self.dp())
    }
}

/// The spec key a refusal is located at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    Layout,
    Schedule,
    Microbatches,
    Sharding,
    TensorParallel,
    SequenceParallel,
    TpOverlap,
    ContextParallel,
    CpComm,
    ExpertParallel,
    /// `etp`.
    ExpertTensorParallel,
    MoeDispatch,
    EpOverlap,
    Recompute,
    Precision,
    /// `training.optimizer` (its `master_weights`, `state_precision`).
    Optimizer,
    /// `training.grad_precision`.
    GradPrecision,
    Synchrony,
    Reduce,
    Model,
    /// `model.mtp`.
    Mtp,
}

impl Feature {
    /// The key in `strategy` (or `training`, for the precision; the spec's `model`).
    pub fn key(self) -> &'static str {
        match self {
            Feature::Layout => "stages",
            Feature::Schedule | Feature::Synchrony | Feature::Reduce => "schedule",
            Feature::Microbatches => "microbatches",
            Feature::Sharding => "zero",
            Feature::TensorParallel => "tp",
            Feature::SequenceParallel => "sequence_parallel",
            Feature::TpOverlap => "tp_overlap",
            Feature::ContextParallel => "cp",
            Feature::CpComm => "cp_comm",
            Feature::ExpertParallel => "ep",
            Feature::ExpertTensorParallel => "etp",
            Feature::MoeDispatch => "moe_dispatch",
            Feature::EpOverlap => "ep_overlap",
            Feature::Recompute => "recompute",
            Feature::Precision => "precision",
            Feature::Optimizer => "optimizer",
            Feature::GradPrecision => "grad_precision",
            Feature::Model => "model",
            Feature::Mtp => "mtp",
        }
    }
}

/// Something a layout asks that an engine does not run.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub feature: Feature,
    /// What is missing, in the engine's terms.
    pub message: String,
    /// The nearest value the engine runs, as a spec writes it at `feature`'s key.
    pub nearest: Option<String>,
    /// Where the engine says so (the row or constraint's source).
    pub source: &'static str,
}

/// The rows of `engine` at its release `target`.
fn supported(target: &EngineTarget) -> impl Iterator<Item = &'static Row<Capability>> + '_ {
    CAPABILITIES.iter().filter(move |r| r.engine == target.name && r.since.is_none_or(|since| target.at_least(since)))
}

/// The row that runs `what` on `target`, if any.
pub fn find(target: &EngineTarget, what: impl Fn(&Capability) -> bool) -> Option<&'static Row<Capability>> {
    supported(target).find(|r| what(&r.what))
}

/// The row running `schedule` with `chunks` per device on `target`.
pub fn schedule_row(target: &EngineTarget, schedule: ScheduleKind, chunks: usize) -> Option<&'static Row<Capability>> {
    find(target, |c| matches!(c, C::Schedule(k, n) if *k == schedule && n.admits(chunks)))
}

/// The schedules to offer for `kind`, nearest first.
fn schedule_preferences(kind: ScheduleKind) -> &'static [ScheduleKind] {
    match kind {
        K::DualPipe => &[K::DualPipeV, K::Zbv, K::Interleaved, K::OneFOneB],
        K::DualPipeV => &[K::Zbv, K::Interleaved, K::OneFOneB],
        K::Zbv => &[K::DualPipeV, K::Interleaved, K::OneFOneB],
        K::ZbH1 | K::Chimera | K::Gpipe | K::Interleaved | K::PipeDream | K::TwoBw => &[K::OneFOneB],
        K::OneFOneB | K::DpOnly => &[],
    }
}

/// A schedule as a spec writes it.
fn schedule_text(kind: ScheduleKind, chunks: usize) -> String {
    if kind == K::Interleaved {
        format!("{{ kind: interleaved, virtual_stages: {chunks} }}")
    } else {
        kind.name().to_string()
    }
}

/// Everything `target` cannot run of `layout`, each with the nearest value it runs.
pub fn refusals(target: &EngineTarget, layout: &Layout) -> Vec<Refusal> {
    let mut out = Vec::new();
    model_and_schedule(target, layout, &mut out);
    sharding_and_parallelism(target, layout, &mut out);
    recompute_and_precision(target, layout, &mut out);
    constraints(target, layout, &mut out);
    out
}

fn refuse(out: &mut Vec<Refusal>, feature: Feature, message: String, nearest: Option<String>, source: &'static str) {
    out.push(Refusal { feature, message, nearest, source });
}

/// The source of a refusal with no row to cite: the table itself, whose rows cite theirs.
fn covered(_target: &EngineTarget) -> &'static str {
    "no row of its capability table (docs/engines.md lists every row with its source)"
}

fn model_and_schedule(target: &EngineTarget, l: &Layout, out: &mut Vec<Refusal>) {
    let e = target.name;
    if !l.gpt && find(target, |c| *c == C::AnyModel).is_none() {
        refuse(out, Feature::Model, format!("{e} trains decoder-only language models here (an embedding, identical causal transformer blocks, a final norm and an output layer); this model is not one"), None, covered(target));
    }
    if l.mtp > 0 && find(target, |c| *c == C::MultiTokenPrediction).is_none() {
        refuse(
            out,
            Feature::Mtp,
            format!("{e} {} has no multi-token prediction", target.version),
            None,
            covered(target),
        );
    }
    if l.uneven() && find(target, |c| *c == C::UnevenReplicas).is_none() {
        let even = vec![l.dp().to_string(); l.pp()].join("-");
        refuse(
            out,
            Feature::Layout,
            format!(
                "{e} replicates every pipeline stage equally (one data-parallel degree); `{}` does not",
                l.replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("-")
            ),
            Some(format!("\"{even}\"")),
            covered(target),
        );
    }
    if !l.synchronous && find(target, |c| *c == C::Asynchronous).is_none() {
        let nearest = schedule_preferences(l.schedule).first().map(|k| k.name().to_string());
        refuse(
            out,
            Feature::Synchrony,
            format!("{e} trains synchronously only: `{}` updates with stale weights", l.schedule),
            nearest,
            covered(target),
        );
    } else if schedule_row(target, l.schedule, l.virtual_stages).is_none() {
        let nearest = schedule_preferences(l.schedule).iter().find_map(|&k| {
            let chunks = if k.default_virtual_stages() > 1 { l.virtual_stages.max(2) } else { 1 };
            schedule_row(target, k, chunks).map(|_| schedule_text(k, chunks))
        });
        let runs: Vec<&str> = supported(target)
            .filter_map(|r| if let C::Schedule(k, _) = r.what { Some(k.name()) } else { None })
            .collect();
        let lacks = match find(target, |c| matches!(c, C::Schedule(k, _) if *k == l.schedule)) {
            Some(r) => format!(
                "{e} runs `{}` only with other chunks per device ({}), not {}",
                l.schedule, r.runs_as, l.virtual_stages
            ),
            None => format!("{e} {} has no `{}` schedule (it runs {})", target.version, l.schedule, runs.join(", ")),
        };
        refuse(out, Feature::Schedule, lacks, nearest, covered(target));
    }
    if l.reduce == ReduceMode::ParameterServer && find(target, |c| *c == C::ParameterServer).is_none() {
        refuse(
            out,
            Feature::Reduce,
            format!("{e} reduces gradients with NCCL collectives, not a parameter server"),
            None,
            covered(target),
        );
    }
}

fn sharding_and_parallelism(target: &EngineTarget, l: &Layout, out: &mut Vec<Refusal>) {
    let e = target.name;
    let pipelined = l.pp() > 1;
    let runs = |level: Sharding| {
        find(
            target,
            |c| matches!(c, C::Sharding { level: s, with_pipeline } if *s == level && (*with_pipeline || !pipelined)),
        )
    };
    if l.dp() * l.cp > 1 && runs(l.sharding).is_none() {
        let nearest = [Sharding::Optimizer, Sharding::None, Sharding::Gradients, Sharding::Parameters]
            .into_iter()
            .find(|&s| runs(s).is_some())
            .map(|s| s.level().to_string());
        let beside = if pipelined
            && find(target, |c| matches!(c, C::Sharding { level, .. } if *level == l.sharding)).is_some()
        {
            " beside a pipeline"
        } else {
            ""
        };
        let source = find(target, |c| matches!(c, C::Sharding { level, .. } if *level == l.sharding))
            .map_or(covered(target), |r| r.source);
        refuse(
            out,
            Feature::Sharding,
            format!("{e} does not run ZeRO stage {}{beside}", l.sharding.level()),
            nearest,
            source,
        );
    }
    // the `etp` that splits experts like the block
    let split_experts = l.tp.to_string();
    let needs = [
        (l.tp > 1, C::TensorParallel, Feature::TensorParallel, "tensor parallelism", "1"),
        (
            l.sequence_parallel,
            C::SequenceParallel,
            Feature::SequenceParallel,
            "Megatron's sequence parallelism",
            "false",
        ),
        (l.tp_overlap, C::TpOverlap, Feature::TpOverlap, "overlapped tensor-parallel collectives", "false"),
        (l.ep > 1, C::ExpertParallel, Feature::ExpertParallel, "expert parallelism", "1"),
        (
            l.ep > 1 && l.tp > 1 && l.etp == 1,
            C::WholeExperts,
            Feature::ExpertTensorParallel,
            "experts whole beside tensor parallelism (expert tensor parallelism 1)",
            &split_experts,
        ),
        (
            l.ep > 1 && l.tp > 1 && l.etp > 1,
            C::SplitExperts,
            Feature::ExpertTensorParallel,
            "experts split over the tensor-parallel ranks (expert tensor parallelism = tensor parallelism)",
            "1",
        ),
        (
            l.ep > 1 && l.moe_dispatch == MoeDispatch::DeepEp,
            C::DeepEpDispatch,
            Feature::MoeDispatch,
            "DeepEP dispatch",
            "all_to_all",
        ),
        (
            l.ep > 1 && l.ep_overlap,
            C::EpOverlap,
            Feature::EpOverlap,
            "expert-parallel all-to-alls overlapped with another microbatch's computation",
            "false",
        ),
    ];
    for (asked, capability, feature, what, off) in needs {
        if asked && find(target, |c| *c == capability).is_none() {
            refuse(out, feature, format!("{e} {} has no {what}", target.version), Some(off.into()), covered(target));
        }
    }
    if l.cp > 1 && find(target, |c| *c == C::ContextParallel(l.cp_comm)).is_none() {
        let other = find(target, |c| matches!(c, C::ContextParallel(_)));
        match other {
            Some(r) => refuse(
                out,
                Feature::CpComm,
                format!("{e} does not exchange context parallelism's keys and values as `{}`", l.cp_comm),
                match r.what {
                    C::ContextParallel(c) => Some(c.name().into()),
                    _ => None,
                },
                covered(target),
            ),
            None => refuse(
                out,
                Feature::ContextParallel,
                format!("{e} has no context parallelism (splitting each sequence over devices)"),
                Some("1".into()),
                covered(target),
            ),
        }
    }
}

fn recompute_and_precision(target: &EngineTarget, l: &Layout, out: &mut Vec<Refusal>) {
    let e = target.name;
    block_recompute(target, l, out);
    let judged = l.recompute != RecomputeKind::Off && l.block_recompute.is_none();
    if judged && find(target, |c| *c == C::Recompute(l.recompute)).is_none() {
        let what = match l.recompute {
            RecomputeKind::SomeStages => "recomputes every stage or none, not a list of stages",
            RecomputeKind::Selective => "has no selective recompute of the attention core",
            RecomputeKind::Full | RecomputeKind::Off => "does not recompute activations",
        };
        // selective recompute's nearest inside the blocks: the engine's op-level policy
        // (torchtitan's `selective`), else its full recompute
        let policy = find(target, |c| *c == C::BlockRecompute(BlockRecomputePart::OpPolicy)).is_some();
        let nearest = match l.recompute {
            RecomputeKind::Selective if policy => Some("{ ops: [alternate_matmul, attention] }".to_string()),
            RecomputeKind::Selective | RecomputeKind::SomeStages | RecomputeKind::Full | RecomputeKind::Off => {
                find(target, |c| *c == C::Recompute(RecomputeKind::Full)).map(|_| "true".to_string())
            }
        };
        refuse(out, Feature::Recompute, format!("{e} {what}"), nearest, covered(target));
    }
    if let Some(recipe) = l.fp8.filter(|r| find(target, |c| *c == C::Fp8(*r)).is_none()) {
        let runs: Vec<&str> = <Fp8Recipe as crate::vocab::Choice>::ALL
            .iter()
            .filter(|&&r| find(target, |c| *c == C::Fp8(r)).is_some())
            .map(|r| r.name())
            .collect();
        if runs.is_empty() {
            // no FP8 at all: bf16 is the nearest precision
            refuse(
                out,
                Feature::Precision,
                format!("{e} has no FP8 training in its configuration"),
                Some("bf16".into()),
                covered(target),
            );
        } else {
            let what = format!(
                "{e} does not train FP8 with the {} recipe (it runs {}: `fp8: {{ recipe: ... }}`)",
                recipe.name(),
                runs.join(", ")
            );
            refuse(out, Feature::Precision, what, None, covered(target));
        }
    }
    if !l.master_weights && find(target, |c| *c == C::NoMasterWeights).is_none() {
        refuse(
            out,
            Feature::Optimizer,
            format!("{e} keeps fp32 master weights for its optimizer under {} (`master_weights: false` is not in its configuration)", l.precision),
            None,
            covered(target),
        );
    }
    if l.grad_precision == Precision::Bf16
        && l.precision != Precision::Fp32
        && find(target, |c| *c == C::Bf16Gradients).is_none()
    {
        refuse(
            out,
            Feature::GradPrecision,
            format!("{e} accumulates and reduces gradients in fp32 under {} (`grad_precision: bf16` is not in its configuration)", l.precision),
            Some("fp32".into()),
            covered(target),
        );
    }
    if l.state_precision != Precision::Fp32 {
        match find(target, |c| *c == C::Bf16OptimizerState) {
            None => refuse(
                out,
                Feature::Optimizer,
                format!("{e} keeps its optimizer's moments in fp32 (`state_precision: {}` is not in its configuration)", l.state_precision),
                None,
                covered(target),
            ),
            // Megatron-LM's precision-aware optimizer is Adam's, over the distributed optimizer
            Some(r) if target.name == Engine::Megatron && (!l.adam || l.sharding == Sharding::None) => refuse(
                out,
                Feature::Optimizer,
                format!("{e} keeps an optimizer's moments in {} with Adam over its distributed optimizer only (`zero: 1` or more)", l.state_precision),
                None,
                r.source,
            ),
            Some(_) => {}
        }
    }
    if find(target, |c| *c == C::Precision(l.precision)).is_none() {
        let nearest =
            [Precision::Bf16, Precision::Fp32].into_iter().find(|&p| find(target, |c| *c == C::Precision(p)).is_some());
        refuse(
            out,
            Feature::Precision,
            format!("{e} does not train in {}", l.precision),
            nearest.map(|p| p.name().into()),
            covered(target),
        );
    }
}

/// Megatron-LM's split of the transformer blocks over its model chunks (`chunk_blocks`, in
/// model order): evenly, or with the embedding and (or) the loss counted as one layer of the
/// first and last chunk (`--account-for-embedding-in-pipeline-split`,
/// `--account-for-loss-in-pipeline-split`). Which ends the split counts, None when no such
/// split gives these chunks.
pub fn megatron_split(chunk_blocks: &[usize]) -> Option<(bool, bool)> {
    let k = chunk_blocks.len();
    if k <= 1 {
        return Some((false, false));
    }
    let total: usize = chunk_blocks.iter().sum();
    [(false, false), (true, false), (false, true), (true, true)]
        .into_iter()
        .find(|&ends| chunk_counts(total, k, ends).as_deref() == Some(chunk_blocks))
}

/// The blocks of each chunk (model order; chunk c on rank c mod `pp`, virtual stage c div
/// `pp`) when Megatron-LM is given the first and (or) the last rank's blocks
/// (`--decoder-first-pipeline-num-layers`, `--decoder-last-pipeline-num-layers`): the other
/// ranks share the rest evenly, and each rank's blocks split evenly over its `vpp` chunks
/// ([M] megatron/core/transformer/transformer_block.py:97-175); or why Megatron-LM refuses it.
pub fn megatron_uneven_ranks(
    blocks: usize,
    pp: usize,
    vpp: usize,
    (first, last): (Option<usize>, Option<usize>),
) -> Result<Vec<usize>, String> {
    let (pp, vpp) = (pp.max(1), vpp.max(1));
    let given = first.unwrap_or(0) + last.unwrap_or(0);
    let left = pp.saturating_sub(usize::from(first.is_some()) + usize::from(last.is_some()));
    let rest = blocks
        .checked_sub(given)
        .ok_or_else(|| format!("the first and last ranks' {given} blocks are more than the model's {blocks}"))?;
    let middle = match left {
        0 if rest == 0 => 0,
        0 => return Err(format!("{rest} blocks are left with no rank to take them")),
        n if rest.is_multiple_of(n) => rest / n,
        n => return Err(format!("the {rest} blocks left do not divide over the {n} other ranks")),
    };
    let per_rank: Vec<usize> = (0..pp)
        .map(|r| match (r, first, last) {
            (0, Some(f), _) => f,
            (r, _, Some(l)) if r + 1 == pp => l,
            _ => middle,
        })
        .collect();
    if let Some(r) = per_rank.iter().position(|b| !b.is_multiple_of(vpp)) {
        return Err(format!("rank {r}'s {} blocks do not divide over its {vpp} virtual stages", per_rank[r]));
    }
    Ok((0..pp * vpp).map(|c| per_rank[c % pp] / vpp).collect())
}

/// Megatron-LM's `--pipeline-model-parallel-layout` for chunks of `chunk_blocks` blocks in
/// model order, `mtp` multi-token-prediction modules with the loss in the last: `E` the
/// embedding, `t` a block, `m` a module, `L` the loss, `|` between chunks
/// (pipeline_parallel_layer_layout.py:283-321; chunk c on rank c mod PP).
pub fn megatron_layout(chunk_blocks: &[usize], mtp: usize) -> String {
    let last = chunk_blocks.len().saturating_sub(1);
    chunk_blocks
        .iter()
        .enumerate()
        .map(|(c, &n)| {
            let (first, end) =
                (if c == 0 { "E" } else { "" }, if c == last { "m".repeat(mtp) + "L" } else { String::new() });
            format!("{first}{}{end}", "t".repeat(n))
        })
        .collect::<Vec<_>>()
        .join("|")
}

/// The blocks of each chunk and the multi-token-prediction modules of a Megatron-LM layout
/// (`megatron_layout`'s language, with its `(…)*n` and `x*n` repetitions and cosmetic
/// commas), or why pipec cannot plan it: the embedding must open the first chunk and the
/// loss close the last, the modules sit in the last chunk, after its blocks.
pub fn parse_megatron_layout(text: &str) -> Result<(Vec<usize>, usize), String> {
    let unrolled = unroll_layout(&text.replace([',', ' ', '"', '\''], ""))?;
    let chunks: Vec<&str> = unrolled.split('|').collect();
    let last = chunks.len() - 1;
    let mut blocks = Vec::with_capacity(chunks.len());
    let mut mtp = 0;
    for (c, chunk) in chunks.iter().enumerate() {
        let mut body = *chunk;
        if c == 0 {
            body = body.strip_prefix('E').ok_or("the layout's first chunk must open with the embedding (`E`)")?;
        }
        if c == last {
            body = body.strip_suffix('L').ok_or("the layout's last chunk must close with the loss (`L`)")?;
            let modules = body.len() - body.trim_end_matches('m').len();
            mtp = modules;
            body = &body[..body.len() - modules];
        }
        if let Some(bad) = body.chars().find(|&ch| ch != 't') {
            return Err(format!(
                "`{bad}` in the layout's chunk {c} (`{chunk}`): pipec plans the embedding first, blocks (`t`), then the multi-token-prediction modules (`m`) and the loss (`L`) in the last chunk"
            ));
        }
        blocks.push(body.len());
    }
    Ok((blocks, mtp))
}

/// A layout with its repetitions written out as Megatron-LM does, in two passes: first
/// every `(…)*n` (`(ab|)*2` as `ab|ab|`), then every `x*n` (`t*3` as `ttt`); at most a
/// million layers.
fn unroll_layout(text: &str) -> Result<String, String> {
    const MOST: usize = 1 << 20;
    let count = |chars: &[char], i: &mut usize| -> Result<usize, String> {
        let start = *i;
        while *i < chars.len() && chars[*i].is_ascii_digit() {
            *i += 1;
        }
        let n: String = chars[start..*i].iter().collect();
        n.parse::<usize>().map_err(|_| format!("`*{n}` in the layout is not a repeat count"))
    };
    let grown = |out: &String| {
        if out.len() > MOST {
            Err(format!("the layout unrolls past {MOST} layers"))
        } else {
            Ok(())
        }
    };
    // `(…)*n`
    let chars: Vec<char> = text.chars().collect();
    let (mut once, mut i) = (String::new(), 0);
    while i < chars.len() {
        if chars[i] == '(' {
            let close = chars[i..].iter().position(|&c| c == ')').ok_or("an unclosed `(` in the layout")? + i;
            let inner: String = chars[i + 1..close].iter().collect();
            i = close + 1;
            if chars.get(i) != Some(&'*') {
                return Err("`(…)` in the layout needs a repeat count: `(tt|)*30`".into());
            }
            i += 1;
            let n = count(&chars, &mut i)?;
            if inner.len().saturating_mul(n) > MOST {
                return Err(format!("the layout unrolls past {MOST} layers"));
            }
            once += &inner.repeat(n);
        } else {
            once.push(chars[i]);
            i += 1;
        }
        grown(&once)?;
    }
    // `x*n`
    let chars: Vec<char> = once.chars().collect();
    let (mut out, mut i) = (String::new(), 0);
    while i < chars.len() {
        if chars[i] == '*' {
            i += 1;
            let n = count(&chars, &mut i)?;
            let x = out.pop().ok_or("`*` with nothing before it in the layout")?;
            if n > MOST {
                return Err(format!("the layout unrolls past {MOST} layers"));
            }
            out.extend(std::iter::repeat_n(x, n));
        } else {
            out.push(chars[i]);
            i += 1;
        }
        grown(&out)?;
    }
    Ok(out)
}

/// Recompute inside the blocks, part by part: each part the engine lacks is refused, with
/// the nearest it runs as the fix ([`nearest_block_recompute`]).
fn block_recompute(target: &EngineTarget, l: &Layout, out: &mut Vec<Refusal>) {
    let e = target.name;
    let Some(b) = &l.block_recompute else { return };
    let runs = |part: BlockRecomputePart| find(target, |c| *c == C::BlockRecompute(part)).is_some();
    // a policy of its own operations is run where any list is
    let runs_part = |part: BlockRecomputePart| {
        runs(part) || (part == BlockRecomputePart::OpPolicy && runs(BlockRecomputePart::Ops))
    };
    let inside: Vec<&str> = [
        (BlockRecomputePart::Modules, "named modules (`modules:`)"),
        (BlockRecomputePart::OpPolicy, "its op-level policy (`ops: [alternate_matmul, attention]`)"),
        (BlockRecomputePart::FirstLayers, "the first blocks of each stage whole (`layers:`)"),
    ]
    .into_iter()
    .filter(|(p, _)| runs(*p))
    .map(|(_, words)| words)
    .collect();
    let refused: Vec<BlockRecomputePart> = BlockRecomputePart::of(b).into_iter().filter(|p| !runs_part(*p)).collect();
    let nearest = nearest_block_recompute(target, b, &refused);
    for part in refused {
        let instead = match inside.as_slice() {
            [] => "; it recomputes whole layers or none".to_string(),
            runs => format!("; inside the blocks it recomputes {}", runs.join(" or ")),
        };
        let why = match part {
            BlockRecomputePart::Ops if runs(BlockRecomputePart::OpPolicy) => {
                "keeps only its op-level policy's operations (`alternate_matmul`, `attention`), not another list"
                    .to_string()
            }
            BlockRecomputePart::Ops | BlockRecomputePart::OpPolicy if !inside.is_empty() => {
                format!("recomputes {}, not a list of operations", inside.join(" or "))
            }
            BlockRecomputePart::Modules
            | BlockRecomputePart::OpPolicy
            | BlockRecomputePart::Ops
            | BlockRecomputePart::FirstLayers
            | BlockRecomputePart::Offload => format!("{}{instead}", part.missing()),
        };
        refuse(out, Feature::Recompute, format!("{e} {why}"), nearest.clone(), covered(target));
    }
}

/// The nearest recompute the engine runs to `b` without its `refused` parts: the mapping
/// with those parts dropped where anything is left (`{ layers: 2, offload: true }` →
/// `{ layers: 2 }`), else what the engine runs inside the blocks (torchtitan's op-level
/// policy; Megatron-LM's selective recompute of the attention core), else its full
/// recompute (`true`).
fn nearest_block_recompute(
    target: &EngineTarget,
    b: &BlockRecompute,
    refused: &[BlockRecomputePart],
) -> Option<String> {
    use BlockRecomputePart as P;
    let mut kept = b.clone();
    for part in refused {
        match part {
            P::Modules => kept.modules.clear(),
            P::OpPolicy | P::Ops => kept.ops.clear(),
            P::FirstLayers => kept.layers = 0,
            P::Offload => kept.offload = false,
        }
    }
    let runs = |what: Capability| find(target, |c| *c == what).is_some();
    if kept != BlockRecompute::default() {
        Some(kept.text())
    } else if runs(C::BlockRecompute(P::OpPolicy)) {
        Some("{ ops: [alternate_matmul, attention] }".into())
    } else if runs(C::BlockRecompute(P::Modules)) && runs(C::Recompute(RecomputeKind::Selective)) {
        Some("selective".into())
    } else {
        find(target, |c| *c == C::Recompute(RecomputeKind::Full)).map(|_| "true".to_string())
    }
}

/// How an engine splits a language model's transformer blocks over its pipeline's chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockSplit {
    /// The same number of blocks in every chunk.
    Even,
    /// Evenly, the embedding and (or) the loss counted as a layer of the first and last
    /// chunk where that divides ([`megatron_split`]).
    CountingEnds,
}

/// How `engine` splits a language model's transformer blocks over its pipeline's chunks,
/// from its constraints (None: as the plan partitions them).
pub fn block_split(engine: Engine) -> Option<BlockSplit> {
    CONSTRAINTS.iter().filter(|r| r.engine == engine).find_map(|r| match r.what {
        Constraint::EvenLayerSplit => Some(BlockSplit::Even),
        Constraint::EvenLayerSplitCountingEnds => Some(BlockSplit::CountingEnds),
        Constraint::InterleavedMicrobatchesPerRank
        | Constraint::MicrobatchesAtLeastStages
        | Constraint::DualPipeVMicrobatches
        | Constraint::SequenceParallelWithTp
        | Constraint::TpOverlapNeedsSequenceParallel
        | Constraint::TpOverlapNeedsCompile
        | Constraint::PlainDataParallelAlone
        | Constraint::NoTensorParallelWithPipeline
        | Constraint::ExpertGroupsWhole
        | Constraint::EpOverlapWithoutFullRecompute
        | Constraint::ModulesOrLayers => None,
    })
}

/// The blocks of each of `chunks` chunks as `split` runs `blocks` of them: every chunk the
/// same, or with the ends counted the first (last) one fewer; the first even split of
/// (none, both, the loss, the embedding) counted. None when no chunk split gives every
/// chunk a block.
pub fn split_blocks(blocks: usize, chunks: usize, split: BlockSplit) -> Option<Vec<usize>> {
    if chunks == 0 {
        return None;
    }
    let ends: &[(bool, bool)] = match split {
        BlockSplit::Even => &[(false, false)],
        BlockSplit::CountingEnds => &[(false, false), (true, true), (false, true), (true, false)],
    };
    ends.iter().find_map(|&ends| counted_split(blocks, chunks, ends))
}

/// The blocks of each of `chunks` chunks when Megatron-LM counts the embedding and (or)
/// the loss (`ends`) as a layer of the first and last chunk: None when that does not divide
/// or leaves a chunk without a block.
pub fn counted_split(blocks: usize, chunks: usize, ends: (bool, bool)) -> Option<Vec<usize>> {
    chunk_counts(blocks, chunks, ends)
        .filter(|counts| counts.iter().all(|&c| c >= 1) && counts.iter().sum::<usize>() == blocks)
}

/// Megatron-LM's arithmetic: `blocks` and the counted ends (`ends`: the embedding, the loss)
/// divided equally over `chunks`, the first (last) chunk one block fewer for each end it
/// counts; None when they do not divide.
fn chunk_counts(blocks: usize, chunks: usize, (embedding, loss): (bool, bool)) -> Option<Vec<usize>> {
    let (e, l) = (usize::from(embedding), usize::from(loss));
    let n = blocks + e + l;
    if chunks == 0 || !n.is_multiple_of(chunks) {
        return None;
    }
    let per = n / chunks;
    Some(
        (0..chunks)
            .map(|i| per.saturating_sub(if i == 0 { e } else { 0 }).saturating_sub(if i + 1 == chunks { l } else { 0 }))
            .collect(),
    )
}

/// The layer ranges of chunks holding `counts` blocks each, of a model of `layers` layers
/// whose blocks are at `starts`: the layers before the first block in the first chunk, every
/// other layer with the block before it, except that a last chunk without blocks holds the
/// layers after the last block (Megatron-LM's `…|L` and `…|mL`: the final norm and the
/// output layer).
pub fn chunk_ranges(starts: &[usize], layers: usize, counts: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut ranges = Vec::with_capacity(counts.len());
    let (mut begin, mut seen) = (0, 0);
    for (i, c) in counts.iter().enumerate() {
        seen += c;
        let end = match (i + 1 == counts.len(), starts.get(seen)) {
            (true, _) => layers,
            (false, Some(&next)) => next,
            // only chunks without blocks after this one: the last block's layer ends it
            (false, None) => starts.last().map_or(layers, |&b| (b + 1).max(begin)),
        };
        ranges.push(begin..end);
        begin = end;
    }
    ranges
}

/// What the layout's chunks hold, for a refusal of its split.
fn uneven(l: &Layout) -> String {
    match &l.chunk_blocks {
        Some(v) => format!(
            "the partition's chunks hold {} blocks",
            v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        ),
        None => "they do not divide".to_string(),
    }
}

fn constraints(target: &EngineTarget, l: &Layout, out: &mut Vec<Refusal>) {
    let e = target.name;
    let (pp, chunks) = (l.pp(), l.virtual_stages.max(1));
    let stages = pp * chunks;
    for r in CONSTRAINTS.iter().filter(|r| r.engine == e) {
        let broken = match r.what {
            Constraint::EvenLayerSplit => {
                let even = match &l.chunk_blocks {
                    Some(v) => v.iter().all(|&b| b == v[0]),
                    None => l.blocks.is_multiple_of(stages),
                };
                (l.gpt && pp > 1 && !even).then(|| {
                    (Feature::Layout, format!("{e} splits the {} transformer blocks evenly over {stages} pipeline stages; {}", l.blocks, uneven(l)), None)
                })
            }
            Constraint::EvenLayerSplitCountingEnds => {
                let even = match &l.chunk_blocks {
                    Some(v) => megatron_split(v).is_some(),
                    None => (0..=2).any(|ends| (l.blocks + ends).is_multiple_of(stages)),
                };
                // any other split written layer by layer where the engine takes a layout
                let laid_out = find(target, |c| *c == C::LayerLayout).is_some();
                (l.gpt && pp > 1 && !even && !laid_out).then(|| {
                    (
                        Feature::Layout,
                        format!("{e} splits the {} transformer blocks evenly over {stages} pipeline stages, counting the embedding and the loss as a layer each or not; {}", l.blocks, uneven(l)),
                        None,
                    )
                })
            }
            Constraint::InterleavedMicrobatchesPerRank => (l.schedule == K::Interleaved && !l.microbatches.is_multiple_of(pp)).then(|| {
                (Feature::Microbatches, format!("{e}'s interleaved schedule needs the microbatches ({}) to be a multiple of the pipeline's depth ({pp})", l.microbatches), Some(l.microbatches.next_multiple_of(pp).to_string()))
            }),
            Constraint::MicrobatchesAtLeastStages => (pp > 1 && chunks == 1 && l.microbatches < pp).then(|| {
                (Feature::Microbatches, format!("{e}'s `{}` needs at least one microbatch per stage ({pp}), not {}", l.schedule, l.microbatches), Some(pp.to_string()))
            }),
            Constraint::DualPipeVMicrobatches => (l.schedule == K::DualPipeV && l.microbatches < 2 * pp).then(|| {
                (Feature::Microbatches, format!("{e}'s DualPipeV needs at least 2·{pp} microbatches, not {}", l.microbatches), Some((2 * pp).to_string()))
            }),
            Constraint::SequenceParallelWithTp => (l.tp > 1 && !l.sequence_parallel).then(|| {
                (Feature::SequenceParallel, format!("{e} always splits the sequence outside the tensor-parallel products (sequence parallelism); the plan would price it without"), Some("true".into()))
            }),
            Constraint::TpOverlapNeedsSequenceParallel => (l.tp_overlap && !l.sequence_parallel).then(|| {
                (Feature::SequenceParallel, format!("{e} overlaps tensor-parallel collectives only with sequence parallelism"), Some("true".into()))
            }),
            Constraint::TpOverlapNeedsCompile => (l.tp_overlap && !l.compiled).then(|| {
                (Feature::TpOverlap, format!("{e} overlaps tensor-parallel collectives (async TP) only in a compiled model: name `compile: true` in `engine`, or run them in line"), Some("false".into()))
            }),
            Constraint::PlainDataParallelAlone => (l.dp() > 1 && l.sharding == Sharding::None && (pp > 1 || l.tp > 1 || l.cp > 1)).then(|| {
                (Feature::Sharding, format!("{e} runs unsharded data parallelism only as the only parallelism; beside a pipeline, tensor or context parallelism it shards (FSDP)"), Some("3".into()))
            }),
            Constraint::NoTensorParallelWithPipeline => (l.tp > 1 && pp > 1).then(|| {
                (Feature::TensorParallel, format!("{e}'s configuration sets tensor parallelism (AutoTP) or a pipeline, not both: together they need the training script's own topology"), Some("1".into()))
            }),
            Constraint::EpOverlapWithoutFullRecompute => {
                let full = matches!(l.recompute, RecomputeKind::Full | RecomputeKind::SomeStages)
                    || l.block_recompute.as_ref().is_some_and(|b| b.layers > 0);
                (l.ep_overlap && full).then(|| {
                    (Feature::EpOverlap, format!("{e} does not overlap expert-parallel all-to-alls beside full recompute (of every block or of the first blocks of each stage)"), Some("false".into()))
                })
            }
            Constraint::ModulesOrLayers => l.block_recompute.as_ref().filter(|b| !b.modules.is_empty() && b.layers > 0).map(|b| {
                // the modules alone: the selective granularity
                let modules = BlockRecompute { layers: 0, ..b.clone() };
                (Feature::Recompute, format!("{e}'s recompute granularity is selective (`modules:`) or full (`layers:`), not both"), Some(modules.text()))
            }),
            Constraint::ExpertGroupsWhole => None,
        };
        if let Some((feature, message, nearest)) = broken {
            refuse(out, feature, message, nearest, r.source);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::Choice;

    fn layout(schedule: ScheduleKind, chunks: usize) -> Layout {
        Layout {
            replicas: vec![2; 4],
            tp: 1,
            cp: 1,
            ep: 1,
            etp: 1,
            schedule,
            virtual_stages: chunks,
            microbatches: 8,
            synchronous: true,
            reduce: ReduceMode::Ring,
            sharding: Sharding::None,
            sequence_parallel: false,
            tp_overlap: false,
            cp_comm: CpComm::AllGather,
            moe_dispatch: MoeDispatch::AllToAll,
            ep_overlap: false,
            recompute: RecomputeKind::Off,
            block_recompute: None,
            precision: Precision::Bf16,
            fp8: None,
            master_weights: true,
            grad_precision: Precision::Fp32,
            state_precision: Precision::Fp32,
            adam: true,
            blocks: 16,
            chunk_blocks: None,
            gpt: true,
            mtp: 0,
            compiled: false,
        }
    }

    #[test]
    fn every_row_names_its_source_and_its_engines_spelling() {
        for r in CAPABILITIES {
            assert!(!r.source.is_empty() && !r.runs_as.is_empty(), "{r:?}");
            assert!(
                r.since.is_none_or(|s| EngineTarget::resolve(r.engine, Some(s)).is_ok()),
                "{r:?}: since outside the range"
            );
        }
        for r in CONSTRAINTS {
            assert!(r.source.starts_with('['), "{r:?}");
        }
    }

    #[test]
    fn pipec_runs_every_schedule_and_option_it_plans() {
        let pipec = EngineTarget::newest(Engine::Pipec);
        for &k in ScheduleKind::ALL {
            assert!(schedule_row(&pipec, k, k.default_virtual_stages()).is_some(), "{k}");
        }
        let mut l = layout(K::PipeDream, 1);
        l.synchronous = false;
        l.replicas = vec![2, 1, 1];
        l.sharding = Sharding::Parameters;
        l.reduce = ReduceMode::ParameterServer;
        l.recompute = RecomputeKind::SomeStages;
        l.gpt = false;
        assert_eq!(refusals(&pipec, &l), vec![]);
        l.recompute = RecomputeKind::Selective;
        l.block_recompute = Some(BlockRecompute {
            modules: vec![crate::vocab::RecomputeModule::Mlp],
            ops: vec![RecomputeOp::Matmul],
            layers: 1,
            offload: true,
        });
        assert_eq!(refusals(&pipec, &l), vec![]);
    }

    /// Recompute inside the blocks is judged part by part: each engine takes the parts its
    /// configuration writes (Megatron-LM modules or first layers, one at a time; torchtitan
    /// its op-level policy; DeepSpeed none), and a refusal names what the engine runs instead.
    #[test]
    fn recompute_inside_the_blocks_is_held_to_each_engine_part_by_part() {
        use crate::vocab::RecomputeModule;
        use BlockRecomputePart as P;
        let parts = |b: BlockRecompute| {
            let mut l = layout(K::OneFOneB, 1);
            l.recompute = RecomputeKind::Selective;
            l.block_recompute = Some(b);
            l
        };
        let modules = BlockRecompute { modules: vec![RecomputeModule::Mlp], ..Default::default() };
        let layers = BlockRecompute { layers: 2, ..Default::default() };
        let policy =
            BlockRecompute { ops: vec![RecomputeOp::Attention, RecomputeOp::AlternateMatmul], ..Default::default() };
        let matmuls = BlockRecompute { ops: vec![RecomputeOp::Matmul], ..Default::default() };
        let offload = BlockRecompute { offload: true, ..Default::default() };
        let both = BlockRecompute { layers: 1, ..modules.clone() };
        assert_eq!(P::of(&policy), [P::OpPolicy], "the policy's operations in any order");
        assert_eq!(P::of(&matmuls), [P::Ops]);
        assert_eq!(P::of(&both), [P::Modules, P::FirstLayers]);
        let refused = |engine: Engine, b: &BlockRecompute| refusals(&EngineTarget::newest(engine), &parts(b.clone()));
        for ok in [&modules, &layers] {
            assert_eq!(refused(Engine::Megatron, ok), vec![], "{}", ok.text());
        }
        let layers_offloaded = BlockRecompute { offload: true, ..layers.clone() };
        for (b, why, nearest) in [
            (&policy, "not a list of operations", "selective"),
            (&offload, "offload", "selective"),
            (&both, "not both", "{ modules: [mlp] }"),
            (&layers_offloaded, "offload", "{ layers: 2 }"),
        ] {
            let r = refused(Engine::Megatron, b);
            assert_eq!(r.len(), 1, "{}: {r:?}", b.text());
            assert!(r[0].message.contains(why) && r[0].feature == Feature::Recompute, "{}: {r:?}", b.text());
            assert_eq!(r[0].nearest.as_deref(), Some(nearest), "{}", b.text());
        }
        assert_eq!(refused(Engine::Torchtitan, &policy).iter().filter(|r| r.feature == Feature::Recompute).count(), 0);
        for b in [&modules, &layers, &matmuls, &offload] {
            let r: Vec<Refusal> =
                refused(Engine::Torchtitan, b).into_iter().filter(|r| r.feature == Feature::Recompute).collect();
            assert_eq!(r.len(), 1, "{}: {r:?}", b.text());
            assert!(r[0].message.contains("op-level policy"), "{r:?}");
            assert_eq!(r[0].nearest.as_deref(), Some("{ ops: [alternate_matmul, attention] }"));
        }
        for b in [&modules, &layers, &policy, &offload] {
            let r = refused(Engine::Deepspeed, b);
            assert_eq!(r.len(), 1, "{}: {r:?}", b.text());
            assert_eq!(r[0].nearest.as_deref(), Some("true"), "{r:?}");
        }
        // torchtitan's `selective` is its op-level policy, not the attention core alone
        let mut selective = layout(K::OneFOneB, 1);
        selective.recompute = RecomputeKind::Selective;
        let r = refusals(&EngineTarget::newest(Engine::Torchtitan), &selective);
        let r: Vec<&Refusal> = r.iter().filter(|r| r.feature == Feature::Recompute).collect();
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(r[0].nearest.as_deref(), Some("{ ops: [alternate_matmul, attention] }"));
        assert_eq!(refusals(&EngineTarget::newest(Engine::Megatron), &selective), vec![]);
        // Megatron-LM's expert-parallel overlap refuses full recompute of the first blocks too
        let mut overlapped = parts(layers.clone());
        overlapped.ep = 2;
        overlapped.ep_overlap = true;
        let r = refusals(&EngineTarget::newest(Engine::Megatron), &overlapped);
        assert!(r.iter().any(|r| r.feature == Feature::EpOverlap), "{r:?}");
        overlapped.block_recompute = Some(modules.clone());
        let r = refusals(&EngineTarget::newest(Engine::Megatron), &overlapped);
        assert!(!r.iter().any(|r| r.feature == Feature::EpOverlap), "{r:?}");
    }

    #[test]
    fn each_engine_refuses_what_it_lacks_with_the_nearest_it_runs() {
        let megatron = EngineTarget::newest(Engine::Megatron);
        assert_eq!(refusals(&megatron, &layout(K::OneFOneB, 1)), vec![]);
        assert_eq!(refusals(&megatron, &layout(K::Interleaved, 2)), vec![]);
        let chimera = refusals(&megatron, &layout(K::Chimera, 1));
        assert_eq!((chimera[0].feature, chimera[0].nearest.as_deref()), (Feature::Schedule, Some("1f1b")));
        let zbv = refusals(&megatron, &layout(K::Zbv, 2));
        assert_eq!(zbv[0].nearest.as_deref(), Some("{ kind: interleaved, virtual_stages: 2 }"));
        let titan = EngineTarget::newest(Engine::Torchtitan);
        assert_eq!(refusals(&titan, &layout(K::Zbv, 2)).len(), 1, "DDP beside a pipeline");
        let mut fsdp = layout(K::Zbv, 2);
        fsdp.sharding = Sharding::Parameters;
        assert_eq!(refusals(&titan, &fsdp), vec![]);
        let deepspeed = EngineTarget::newest(Engine::Deepspeed);
        let mut zero2 = layout(K::OneFOneB, 1);
        zero2.sharding = Sharding::Gradients;
        let r = refusals(&deepspeed, &zero2);
        assert_eq!((r[0].feature, r[0].nearest.as_deref()), (Feature::Sharding, Some("1")), "{r:?}");
        assert!(r[0].message.contains("beside a pipeline"));
        // DualPipeV arrived in 0.19.8
        let mut dualpipev = layout(K::DualPipeV, 2);
        dualpipev.microbatches = 8;
        assert_eq!(refusals(&deepspeed, &dualpipev), vec![]);
        let older = EngineTarget::resolve(Engine::Deepspeed, Some("0.19.7")).expect("covered");
        assert_eq!(refusals(&older, &dualpipev)[0].feature, Feature::Schedule);
    }
}
