//! How fast an engine runs a plan's kernels: the engine's performance profile.
//!
//! The same layout runs at different speeds on Megatron-LM with Transformer Engine, on
//! torchtitan eager or compiled, on DeepSpeed and on pipec's own executor: their kernels
//! differ (fused or not, Transformer Engine's GEMMs and attention or PyTorch's), and so does
//! the clock the devices hold. The cost model prices kernels on the device's figures
//! (`crate::device`: datasheet peaks and the efficiency curves shared by every GPU); an
//! engine's profile scales those curves' peaks by one constant, its kernel efficiency on
//! that device kind, which is the one constant fitted per engine × device kind
//! ([`CALIBRATED`], fitted on named rows of `bench/specs/published-2025/steps.csv` and
//! judged on the others), or measured from the user's own run (`pipec calibrate
//! --measured`, a [`CalibrationFile`]).
//!
//! pipec's own executor is priced on the device's own figures: `pipec calibrate` measures
//! them (a device file), so its profile's constant is 1.

use serde::{Deserialize, Serialize};

use crate::device::DeviceModel;
use crate::vocab::Engine;

/// The kernels an engine runs a model's layers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KernelFamily {
    /// pipec's executor (Burn): priced on the device file `pipec calibrate` measures.
    Pipec,
    /// Megatron-LM on Transformer Engine: fused GEMMs, cuDNN attention, fused norms.
    MegatronTe,
    /// torchtitan in eager PyTorch: every element-wise operation its own kernel.
    TorchEager,
    /// torchtitan with `torch.compile` on each block: element-wise work fused by Inductor.
    TorchCompiled,
    /// DeepSpeed over the model's own PyTorch modules, eager.
    Deepspeed,
}

impl KernelFamily {
    /// The family `engine` runs, compiled (`engine: { compile: true }`, torchtitan) or not.
    pub fn of(engine: Engine, compiled: bool) -> KernelFamily {
        match engine {
            Engine::Pipec => KernelFamily::Pipec,
            Engine::Megatron => KernelFamily::MegatronTe,
            Engine::Torchtitan if compiled => KernelFamily::TorchCompiled,
            Engine::Torchtitan => KernelFamily::TorchEager,
            Engine::Deepspeed => KernelFamily::Deepspeed,
        }
    }

    /// Words for reports.
    pub fn describe(self) -> &'static str {
        match self {
            KernelFamily::Pipec => "pipec's executor",
            KernelFamily::MegatronTe => "Megatron-LM on Transformer Engine",
            KernelFamily::TorchEager => "torchtitan, eager",
            KernelFamily::TorchCompiled => "torchtitan, compiled",
            KernelFamily::Deepspeed => "DeepSpeed, eager",
        }
    }
}

/// Which of a split product's backward passes an engine's tensor-parallel overlap
/// (`tp_overlap`) runs in steps against its collectives, beside every forward product and
/// the row-split products' input gradients, which all run so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OverlapSteps {
    /// A column-split product's input gradient, chunked against its reduce-scatter.
    pub column_input_grad: bool,
    /// A row-split product's weight gradient, chunked against its output gradient's
    /// all-gather.
    pub row_weight_grad: bool,
}

/// How an engine's cross-entropy holds a language model's logits: the implementation
/// whose tensors decide the last stage's loss memory (`KernelFamily::cross_entropy`). Each
/// is read from the code that runs it; none is fitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CrossEntropy {
    /// pipec's executor: the log-probabilities kept, their gradient and its cast made in
    /// the backward (`executor/src/interp/compute.rs`).
    #[default]
    Pipec,
    /// PyTorch eager, `F.cross_entropy(logits.float(), labels)` (torchtitan's loss before
    /// it is compiled, `torchtitan/components/loss.py`; train.py@9dec370 l.131-138, where
    /// compiling it was turned off): `log_softmax` keeps its fp32 output; the forward holds
    /// the logits and their fp32 copy beside it (the loop frees the logits only after the
    /// loss, `del pred`); the backward, `nll_loss`'s gradient (a dense fp32 tensor) and
    /// `log_softmax`'s beside the kept output, and the logits' freed block, which the
    /// caching allocator keeps reserved ([`LossBytes`]).
    Eager,
    /// PyTorch's loss parallel over a vocabulary split by tensor parallelism (torchtitan's
    /// default under `tp`; torch/distributed/tensor/parallel/loss.py): `_log_softmax`
    /// makes the shifted logits and the result as separate fp32 tensors, and the backward
    /// (`_nll_loss_and_log_softmax_backward`) a zero tensor, `exp(x)`, their sum and the
    /// product, three of them live at once beside the kept result and the logits' freed
    /// block, reserved.
    LossParallel,
    /// `torch.compile`d (torchtitan's `[compile] components` with `loss`): Inductor saves
    /// the logits and each row's log-sum-exp, and its backward writes the gradient at the
    /// logits' precision in one fused kernel.
    Compiled,
    /// Megatron-LM's `vocab_parallel_cross_entropy` and its native fusion
    /// (megatron/core/tensor_parallel/cross_entropy.py, fusions/fused_cross_entropy.py):
    /// the logits upcast once, the softmax made in place in that fp32 copy and kept, the
    /// gradient made in place in it and cast to the logits' precision. Transformer Engine's
    /// fused cross-entropy (in place on the logits) is refused by Megatron-Core since June
    /// 2026 (`cross_entropy_fusion_impl = 'te'`, model_parallel_config.py).
    Megatron,
    /// A Hugging Face model under DeepSpeed: transformers' `ForCausalLMLoss` upcasts the
    /// logits and calls `F.cross_entropy`, and the model's output keeps the logits while
    /// the training loop holds it through the backward.
    Transformers,
}

/// Bytes per logit (one vocabulary entry of one token, on this rank) that a cross-entropy
/// holds: `kept` from its forward to its backward, `transient` beside them at its widest
/// point (forward or backward; it runs before any layer's backward) — with the blocks that
/// PyTorch's caching allocator keeps reserved there and cannot use: a block freed in the
/// forward stays reserved (the allocator returns no segment to the device) and serves only
/// a request no larger than itself, so the lower-precision logits freed before the
/// backward (`del pred` in torchtitan's loop) sit beside the backward's fp32 gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossBytes {
    pub kept: f64,
    pub transient: f64,
}

impl CrossEntropy {
    /// What the loss holds when the logits are `precision` bytes each (the activations'
    /// precision): fp32 copies where the implementation upcasts, none under fp32 training
    /// (`.float()` of an fp32 tensor is the tensor).
    pub fn bytes(self, precision: f64) -> LossBytes {
        let (p, f) = (precision, precision.max(4.0));
        // the fp32 copy `.float()` makes of lower-precision logits
        let copy = if p < 4.0 { f } else { 0.0 };
        // the logits' block, freed before the backward, too small for its fp32 gradients
        let reserved = if p < f { p } else { 0.0 };
        let (kept, transient) = match self {
            CrossEntropy::Pipec => (f, f + p),
            // forward: the logits and their copy; backward: two fp32 gradients beside the
            // logits' reserved block
            CrossEntropy::Eager => (f, (p + copy).max(2.0 * f + reserved)),
            // forward: the logits, the copy and the shifted logits; backward: three beside
            // the logits' reserved block (the forward's three fp32 blocks serve them)
            CrossEntropy::LossParallel => (f, (p + copy + f).max(3.0 * f + reserved)),
            CrossEntropy::Compiled => (p, p),
            // the logits beside their upcast in the forward, the gradient's cast in the
            // backward; under fp32 the softmax is made in the logits themselves
            CrossEntropy::Megatron => (f, if p < 4.0 { p } else { 0.0 }),
            // the output's logits kept beside the log-probabilities; two fp32 gradients
            CrossEntropy::Transformers => (f + p, copy.max(2.0 * f)),
        };
        LossBytes { kept, transient }
    }
}

/// The fused attention kernel an engine runs on a Hopper GPU: its published throughput by
/// pass, causal mask and sequence length, not fitted. The figures are Shah et al. 2024's
/// (FlashAttention-3, arXiv 2407.08608) on an H100 SXM5 at head dimension 128, 16k tokens a
/// batch (batch × sequence), bf16: Figure 5's forward without and with the causal mask,
/// Figure 6's backward (the paper's only backward figure, without the mask; causal blocks'
/// backward is priced at it). The paper counts a causal kernel's FLOPs as half the full
/// one's, as `BlockDims::computed_keys` does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionKernel {
    /// TFLOP/s at each of [`ATTENTION_SEQUENCES`]: the forward without the causal mask.
    pub forward: [f64; 6],
    /// The forward with the causal mask.
    pub forward_causal: [f64; 6],
    /// The backward (the published figure, without the mask), its FLOPs 2.5× the forward's.
    pub backward: [f64; 6],
    pub source: &'static str,
}

/// The sequence lengths the published attention figures are measured at.
pub const ATTENTION_SEQUENCES: [f64; 6] = [512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];

/// The H100 SXM's dense bf16 matrix rate the published attention figures are shares of
/// (TFLOP/s; `crate::device`'s preset).
const H100_DENSE_BF16_TFLOPS: f64 = 989.4;

/// A pass of an attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPass {
    Forward,
    Backward,
}

impl AttentionKernel {
    /// The kernel's sustained rate over the device's dense bf16 peak for `pass` over
    /// `sequence` positions: the published figures interpolated in log₂ of the sequence,
    /// held at the nearest end outside 512–16k.
    pub fn share(&self, pass: AttentionPass, causal: bool, sequence: f64) -> f64 {
        let figures = match (pass, causal) {
            (AttentionPass::Forward, false) => &self.forward,
            (AttentionPass::Forward, true) => &self.forward_causal,
            (AttentionPass::Backward, _) => &self.backward,
        };
        interpolate_log2(&ATTENTION_SEQUENCES, figures, sequence) / H100_DENSE_BF16_TFLOPS
    }
}

/// `ys` at `x`, linear in log₂ x between the points `xs` (ascending), the end values outside.
fn interpolate_log2(xs: &[f64; 6], ys: &[f64; 6], x: f64) -> f64 {
    let x = x.max(1.0).log2();
    let at = |i: usize| xs[i].log2();
    if x <= at(0) {
        return ys[0];
    }
    for i in 1..xs.len() {
        if x <= at(i) {
            let f = (x - at(i - 1)) / (at(i) - at(i - 1));
            return ys[i - 1] + f * (ys[i] - ys[i - 1]);
        }
    }
    ys[ys.len() - 1]
}

/// FlashAttention-2, which PyTorch's `scaled_dot_product_attention` runs on Hopper: 370
/// TFLOP/s forward at 8k without the mask, 333 with it, 318 backward.
pub const FLASH_ATTENTION_2: AttentionKernel = AttentionKernel {
    forward: [309.0, 350.0, 362.0, 368.0, 370.0, 370.0],
    forward_causal: [191.0, 260.0, 298.0, 319.0, 333.0, 335.0],
    backward: [214.0, 260.0, 291.0, 310.0, 318.0, 322.0],
    source: "Shah et al. 2024, FlashAttention-3 (arXiv 2407.08608), Figures 5 and 6: FlashAttention-2, head dimension 128, H100 SXM5",
};

/// cuDNN's fused attention, which Transformer Engine runs on Hopper: 600 TFLOP/s forward at
/// 8k without the mask, 529 with it, 518 backward.
pub const CUDNN_ATTENTION: AttentionKernel = AttentionKernel {
    forward: [497.0, 574.0, 617.0, 609.0, 600.0, 595.0],
    forward_causal: [315.0, 410.0, 484.0, 518.0, 529.0, 539.0],
    backward: [305.0, 408.0, 465.0, 499.0, 518.0, 516.0],
    source:
        "Shah et al. 2024, FlashAttention-3 (arXiv 2407.08608), Figures 5 and 6: cuDNN, head dimension 128, H100 SXM5",
};

/// The presets of Hopper GPUs, where the published attention kernels' figures hold.
const HOPPER: &[&str] = &["h100-sxm", "h100-pcie", "h100-nvl", "h800", "h200", "h200-nvl"];

impl KernelFamily {
    /// Whether the engine runs a rank's routed experts as one grouped kernel per projection
    /// (torchtitan's GroupedExperts: `torch._grouped_mm`, torchtitan/models/moe.py), priced
    /// at the size of the group; else one kernel per expert, each at its own size.
    /// Megatron-LM's grouped experts (`--moe-grouped-gemm`, TEGroupedMLP) run Transformer
    /// Engine's grouped linear, which on Hopper splits the input per expert (quantizing each
    /// expert's rows on their own under FP8) and launches one cuBLAS GEMM per expert on a
    /// pool of streams (transformer_engine/common/gemm/cublaslt_gemm.cu,
    /// `nvte_multi_tensor_gemm`: `multi_stream_cublas_gemm` unless
    /// `NVTE_USE_CUTLASS_GROUPED_GEMM=1`, which Megatron-Bridge's recipes do not set; its
    /// documentation's "Per-expert GEMMs"). pipec's executor and DeepSpeed-MoE run one
    /// expert after another.
    pub fn grouped_expert_gemm(self) -> bool {
        match self {
            KernelFamily::TorchEager | KernelFamily::TorchCompiled => true,
            KernelFamily::MegatronTe | KernelFamily::Pipec | KernelFamily::Deepspeed => false,
        }
    }

    /// Whether `sequence_parallel: true` splits a block's activations along the sequence
    /// outside the tensor-parallel products, with all-gathers and reduce-scatters in place of
    /// the all-reduces (Megatron-LM's `--sequence-parallel`, megatron/core/tensor_parallel/
    /// mappings.py; torchtitan's `SequenceParallel` norms): what the cost and memory models
    /// price when it is written. pipec's executor runs tensor parallelism's all-reduces on
    /// whole activations (`pipec_plan::in_pass` declares them), so for it the flag changes
    /// neither the collectives nor the activations, and is priced so. DeepSpeed does not
    /// run it (its capability table refuses it), and is counted as Megatron-DeepSpeed would.
    pub fn splits_sequence(self) -> bool {
        match self {
            KernelFamily::Pipec => false,
            KernelFamily::MegatronTe
            | KernelFamily::TorchEager
            | KernelFamily::TorchCompiled
            | KernelFamily::Deepspeed => true,
        }
    }

    /// Whether a gated MLP's activation (SwiGLU, GEGLU) is built of separate autodiff
    /// operations that each keep their operands for the backward: pipec's executor on Burn,
    /// whose SwiGLU keeps the gate's logistic and SiLU's output beside the up projection's
    /// output, and whose GEGLU keeps GELU's output (measured on the device pool,
    /// `tests/cubecl.rs`). The other engines are counted as keeping the fused activation's
    /// input alone (Transformer Engine's and Inductor's fused kernels; PyTorch's eager SiLU
    /// also leaves its output to the product, which is not counted: not measured here).
    pub fn composes_gates(self) -> bool {
        match self {
            KernelFamily::Pipec => true,
            KernelFamily::MegatronTe
            | KernelFamily::TorchEager
            | KernelFamily::TorchCompiled
            | KernelFamily::Deepspeed => false,
        }
    }

    /// Whether a mixture of experts' routed activation applies the routing weights, so the
    /// combine only sums the experts' outputs and keeps none of them for the router's
    /// backward: Megatron-Core's memory-efficient permutation (v0.13, July 2025: "moving the
    /// probs multiplication from unpermutation to activation function of GroupedMLP";
    /// TEGroupedMLP's `bias_act_func` multiplies the activation's output by the permuted
    /// probabilities, megatron/core/transformer/moe/experts.py). The probabilities (fp32,
    /// one per routed pair) are kept instead. The others are counted as weighing the
    /// experts' outputs in the combine, which keeps them: pipec's executor (measured,
    /// `tests/cubecl.rs`), DeepSpeed-MoE; torchtitan's default `score_before_experts` weighs
    /// the dispatched rows before the experts and keeps the unweighed rows for the scores'
    /// gradient, the same bytes per routed pair at the activations' precision.
    pub fn weighs_routes_in_activation(self) -> bool {
        match self {
            KernelFamily::MegatronTe => true,
            KernelFamily::Pipec | KernelFamily::TorchEager | KernelFamily::TorchCompiled | KernelFamily::Deepspeed => {
                false
            }
        }
    }

    /// Whether ZeRO-3 under mixed precision keeps a rank's fp32 master shard as its only
    /// copy of its weights and gathers it cast to the training precision: FSDP2 over fp32
    /// parameters with `MixedPrecisionPolicy(param_dtype=bf16)` (torchtitan,
    /// torchtitan/distributed/parallel_dims.py and models/llama3/parallelize.py), and pipec's
    /// executor, whose ZeRO-3 shard is its fp32 master chunks (`executor/src/parallel/zero.rs`).
    /// The others keep a training-precision shard beside the fp32 master: Megatron-FSDP's
    /// model-weight and main-weight buffers, DeepSpeed ZeRO-3's low-precision and fp32
    /// partitions.
    pub fn shards_master_only(self) -> bool {
        match self {
            KernelFamily::Pipec | KernelFamily::TorchEager | KernelFamily::TorchCompiled => true,
            KernelFamily::MegatronTe | KernelFamily::Deepspeed => false,
        }
    }

    /// What the engine's FP8 training moves to cast a product's operands ([`Fp8Casts`]).
    /// Transformer Engine's fused `cast_transpose` reads the input once and writes the two
    /// FP8 copies (2 bytes a value), the output gradient alike, and keeps its FP8 weights
    /// from the step's first microbatch; pipec's executor and DeepSpeed are planned as it.
    /// torchao's Float8 linears (torchtitan) scale dynamically: per operand a max-abs
    /// reduction, then a cast writing both copies; the weights cast every forward. Their
    /// traffic as torchao's own roofline counts it (torchao/float8/roofline_utils.py,
    /// `get_tensor_memory_traffic_bytes` with dynamic scaling, @567cb46, the repository as of
    /// torchtitan's December 2024 runs): compiled (`model_torch_compile_limitations`), the
    /// input's and the output gradient's reduction fused with the operation before, and one
    /// more FP8 read (pytorch/pytorch#130015): 1 read and 3 bytes written a value, the
    /// weights 2 reads and 3 bytes; eager, nothing fused: 2 reads and 2 bytes each.
    pub fn fp8_casts(self) -> Fp8Casts {
        let te = CastTraffic { reads: 1.0, writes: 2.0 };
        match self {
            KernelFamily::MegatronTe | KernelFamily::Pipec | KernelFamily::Deepspeed => {
                Fp8Casts { input: te, grad_output: te, weights: None }
            }
            KernelFamily::TorchCompiled => {
                let fused = CastTraffic { reads: 1.0, writes: 3.0 };
                Fp8Casts { input: fused, grad_output: fused, weights: Some(CastTraffic { reads: 2.0, writes: 3.0 }) }
            }
            KernelFamily::TorchEager => {
                let unfused = CastTraffic { reads: 2.0, writes: 2.0 };
                Fp8Casts { input: unfused, grad_output: unfused, weights: Some(unfused) }
            }
        }
    }

    /// How the engine runs sequence parallelism's collectives around a block's split
    /// products ([`SequenceCollectives`]). PyTorch's DTensor (torchtitan's
    /// `SequenceParallel` norms and `PrepareModuleInput` to `Replicate`,
    /// torch/distributed/tensor/parallel/style.py) all-gathers a column-split product's input
    /// in the forward and autograd saves the gathered tensor for its weight gradient; under
    /// torchao's Float8 tensor parallelism (`Float8ColwiseParallel`, `Float8RowwiseParallel`,
    /// `PrepareFloat8ModuleInput`, torchao/float8/float8_tensor_parallel.py, which torchtitan
    /// applies with Float8 linears) the input is cast to FP8 before that all-gather, and the
    /// output gradient before the backward's all-gather, while the reduce-scatters carry the
    /// training precision. Megatron-LM gathers the input again for the weight gradient
    /// rather than keep it (megatron/core/tensor_parallel/layers.py,
    /// `LinearWithGradAccumulationAndAsyncCommunication.backward`) and is priced with its
    /// gathers in the training precision, as its calibration rows ran. pipec's executor and
    /// DeepSpeed do not split the sequence ([`Self::splits_sequence`]).
    pub fn sequence_collectives(self) -> SequenceCollectives {
        match self {
            KernelFamily::TorchEager | KernelFamily::TorchCompiled => {
                SequenceCollectives { keeps_gathered: true, fp8_gathers: true }
            }
            KernelFamily::MegatronTe | KernelFamily::Pipec | KernelFamily::Deepspeed => SequenceCollectives::default(),
        }
    }

    /// The backward passes the engine's `tp_overlap` chunks ([`OverlapSteps`]).
    /// Megatron-LM on Transformer Engine (Megatron-Bridge's H100 userbuffers
    /// configurations, comm_overlap.py): the row-split input gradients by ring exchange, the
    /// column-split ones and every weight gradient bulk-overlapped, whole. PyTorch's
    /// micro-pipelined TP under torchtitan's asynchronous TP
    /// (torch/_inductor/fx_passes/micro_pipeline_tp.py) fuses every all-gather with the
    /// products reading it and every product with the reduce-scatter after it, in the
    /// backward's graph too. pipec's executor runs the collectives in line (`pipec run` says
    /// so) and DeepSpeed has no such overlap: planned as Megatron-LM's.
    pub fn overlap_steps(self) -> OverlapSteps {
        match self {
            KernelFamily::TorchEager | KernelFamily::TorchCompiled => {
                OverlapSteps { column_input_grad: true, row_weight_grad: true }
            }
            KernelFamily::MegatronTe | KernelFamily::Pipec | KernelFamily::Deepspeed => OverlapSteps::default(),
        }
    }

    /// The cross-entropy the engine runs: `loss_compiled`, torchtitan's `[compile]
    /// components` include the loss; `vocab_split`, tensor parallelism splits the logits
    /// over the vocabulary.
    pub fn cross_entropy(self, loss_compiled: bool, vocab_split: bool) -> CrossEntropy {
        match self {
            KernelFamily::Pipec => CrossEntropy::Pipec,
            KernelFamily::MegatronTe => CrossEntropy::Megatron,
            KernelFamily::TorchEager | KernelFamily::TorchCompiled if loss_compiled => CrossEntropy::Compiled,
            KernelFamily::TorchEager | KernelFamily::TorchCompiled if vocab_split => CrossEntropy::LossParallel,
            KernelFamily::TorchEager | KernelFamily::TorchCompiled => CrossEntropy::Eager,
            KernelFamily::Deepspeed => CrossEntropy::Transformers,
        }
    }

    /// How the engine runs a 2-D convolution on `device` ([`Convolution`]): pipec's
    /// executor on the CPU lays the input's patches out as a matrix and multiplies it
    /// (`pipec_executor`'s `flex_conv`); the GPU engines and pipec's CUDA build run Burn's
    /// or cuDNN's convolutions, priced as one product.
    pub fn convolution(self, device: &DeviceModel) -> Convolution {
        match self {
            KernelFamily::Pipec if crate::device::names_a_cpu(&device.name) => Convolution::Patches,
            KernelFamily::Pipec
            | KernelFamily::MegatronTe
            | KernelFamily::TorchEager
            | KernelFamily::TorchCompiled
            | KernelFamily::Deepspeed => Convolution::Direct,
        }
    }

    /// The fused attention kernel this engine runs on `device`, where its throughput is
    /// published (Hopper GPUs); None: attention priced as the device's matrix products.
    pub fn attention(self, device: &DeviceModel) -> Option<AttentionKernel> {
        if !HOPPER.iter().any(|h| h.eq_ignore_ascii_case(&device.name)) {
            return None;
        }
        match self {
            KernelFamily::Pipec => None,
            KernelFamily::MegatronTe => Some(CUDNN_ATTENTION),
            KernelFamily::TorchEager | KernelFamily::TorchCompiled | KernelFamily::Deepspeed => Some(FLASH_ATTENTION_2),
        }
    }
}

/// How an engine's kernels run a 2-D convolution ([`KernelFamily::convolution`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Convolution {
    /// One product of the convolution's multiply-adds, reading its input and weights and
    /// writing its output (an implicit-GEMM or direct kernel).
    #[default]
    Direct,
    /// The input's patches copied out as a matrix [C·k², samples·positions] (im2col), one
    /// product of the weights by it, the output copied into place; the backward lays the
    /// patches out again for the weights' gradient and adds the patch matrix's gradient back
    /// into the input's (col2im).
    Patches,
}

/// What an engine's FP8 training moves to cast one operand to FP8 with tensorwise
/// scaling, per value: values read at the training precision and bytes written
/// ([`KernelFamily::fp8_casts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CastTraffic {
    pub reads: f64,
    pub writes: f64,
}

impl CastTraffic {
    /// Bytes moved per value cast from `p`-byte values.
    pub fn bytes(self, p: f64) -> f64 {
        self.reads * p + self.writes
    }
}

/// What an engine's FP8 training casts around a block's product: its input and the
/// backward's output gradient, each to a row-major and a column-major FP8 copy, and where
/// the engine casts them every pass, its weights.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fp8Casts {
    pub input: CastTraffic,
    pub grad_output: CastTraffic,
    /// None: the weights' FP8 copies are made once a step (or gathered in FP8), not priced.
    pub weights: Option<CastTraffic>,
}

/// How an engine runs sequence parallelism's collectives
/// ([`KernelFamily::sequence_collectives`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SequenceCollectives {
    /// The backward reuses a column-split product's gathered input for its weight gradient
    /// (else it gathers it again).
    pub keeps_gathered: bool,
    /// Under FP8 training with tensorwise scaling, the all-gathers carry FP8 values.
    pub fp8_gathers: bool,
}

/// How an engine cuts a replicated stage's gradient reduction so that it runs during the
/// backward: each part is reduced (all-reduced, or under ZeRO reduce-scattered) once the
/// backward has made its layers' gradients ([`gradient_buckets`]). Read from each engine's
/// code; none is fitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradientBuckets {
    /// One reduction after the stage's backward.
    Whole,
    /// One per layer: FSDP's units, each block sharded and reduced on its own.
    Layers,
    /// Buckets of about this many gradient bytes, the last layers' first.
    Bytes(u64),
}

/// The buckets `engine` reduces a stage's gradients in by default, under ZeRO level
/// `level` (0 to 3), of `grad_bytes` a gradient. pipec's own
/// executor buckets only where the spec writes `bucket` (PyTorch DDP's), so here it is
/// `Whole`.
/// - Megatron-LM: Megatron-FSDP (`zero` 2 and 3, `optim_grads`/`optim_grads_params`)
///   reduce-scatters each transformer layer's gradients after its backward, every
///   microbatch (megatron_fsdp.py, `grad_reduce_every_bprop`). Its DistributedDataParallel
///   (`zero` 0 and 1) is priced as one reduction after the stage's backward: Megatron-Core
///   buckets `max(40,000,000, 1,000,000 × dp)` parameters on the first pipeline rank's
///   first chunk (distributed_data_parallel.py), but the shared efficiency constants
///   (`crate::device`) were fitted on Megatron-LM's 2021–22 A100 rows priced that way, and
///   pricing the buckets needs them fitted again.
/// - torchtitan: FSDP2's `fully_shard` on every block (`zero` 3, and 2, which it runs
///   with `fsdp_reshard_after_forward = "never"`) reduce-scatters per block; its DDP
///   (`replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)`) buckets 100 MiB.
/// - DeepSpeed: `overlap_comm` is on by default only under ZeRO-3
///   (`DeepSpeedZeroConfig.overlap_comm_valid`), whose reductions then run in buckets of
///   `reduce_bucket_size`, 5e8 elements; without it, one reduction after the backward.
pub fn gradient_buckets(engine: Engine, level: u8, grad_bytes: u64) -> GradientBuckets {
    match engine {
        Engine::Pipec => GradientBuckets::Whole,
        Engine::Megatron if level >= 2 => GradientBuckets::Layers,
        Engine::Megatron => GradientBuckets::Whole,
        Engine::Torchtitan if level >= 2 => GradientBuckets::Layers,
        Engine::Torchtitan if level == 0 => GradientBuckets::Bytes(100 << 20),
        Engine::Torchtitan => GradientBuckets::Whole,
        Engine::Deepspeed if level >= 3 => GradientBuckets::Bytes(500_000_000u64.saturating_mul(grad_bytes)),
        Engine::Deepspeed => GradientBuckets::Whole,
    }
}

/// One fitted constant: an engine's kernel efficiency on one device kind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibrated {
    pub family: KernelFamily,
    /// The device preset's name.
    pub device: &'static str,
    /// The power cap the rows ran at (None: full power).
    pub power: Option<f64>,
    /// The efficiency curves' peaks are multiplied by this.
    pub efficiency: f64,
    /// Where it comes from: the calibration rows it was fitted on (`run` names in
    /// `bench/specs/published-2025/steps.csv`), or why it is what it is.
    pub source: &'static str,
    /// The routed experts' products against the engine's dense products of their size
    /// ([`KernelFamily::grouped_expert_gemm`] says at which size: the group's or each
    /// expert's), in either precision: their seconds are divided by this. Where the engine
    /// runs one GEMM per expert, their FP8 products are priced at the bf16 rate: Transformer
    /// Engine's per-expert FP8 GEMMs, each expert's rows quantized with their own scales,
    /// fit no faster than bf16 (0.43 of the FP8 rate on the FP8 rows this was first fitted
    /// on, 0.86 of bf16's). The constant carries whatever else of an expert layer the model
    /// does not price too. 1 where no run of a mixture of experts on this kind is a
    /// calibration row.
    pub experts: f64,
    /// Where `experts` comes from (empty: it is 1, nothing fitted).
    pub experts_source: &'static str,
}

/// The constants fitted per engine × device kind. `pipec-bench steps` refits each on its
/// rows and `tests/fidelity.rs` fails when a constant here is not what its rows give, or
/// when the held-out rows are predicted past their bounds.
pub const CALIBRATED: &[Calibrated] = &[
    Calibrated {
        family: KernelFamily::MegatronTe,
        device: "a100-80gb",
        power: None,
        efficiency: 1.0,
        source: "1 by construction: the GPU presets' shared efficiency curves (crate::device) were fitted on Megatron-LM's A100 runs (bench/specs/published: Narayanan et al. 2021, Korthikanti et al. 2022)",
        experts: 1.0,
        experts_source: "",
    },
    Calibrated {
        family: KernelFamily::MegatronTe,
        device: "a100-40gb",
        power: None,
        efficiency: 1.0,
        source: "1 by construction: the shared efficiency curves were fitted on Megatron-LM's A100 runs",
        experts: 1.0,
        experts_source: "",
    },
    Calibrated {
        family: KernelFamily::MegatronTe,
        device: "h100-sxm",
        power: None,
        efficiency: 0.8702,
        source: "fitted on steps.csv's dense calibration row mb2511-h100-llama38b-fp8cs-8g (Megatron-Bridge's published H100 tables)",
        experts: 0.6569,
        experts_source: "fitted on steps.csv's mixture-of-experts calibration rows mb260201-h100-qwen330ba3b-fp8-16g, mb2606-h100-qwen330ba3b-fp8-16g, the dense constant held (Megatron-Bridge's published H100 tables)",
    },
    Calibrated {
        family: KernelFamily::TorchCompiled,
        device: "h100-sxm",
        power: Some(500.0),
        efficiency: 0.6410,
        source: "fitted on steps.csv's calibration rows tt24-t1-8b-8g-bf16-compile, tt24-t2-8b-fsdp8-cp1, tt24-t3-8b-128g-fp8-compile (torchtitan's December 2024 H100 benchmark, 500 W)",
        experts: 1.0,
        experts_source: "",
    },
    Calibrated {
        family: KernelFamily::TorchCompiled,
        device: "h200",
        power: None,
        efficiency: 0.7263,
        source: "fitted on steps.csv's calibration row tt25-trainy-h200-8b-32g (torchtitan's June 2025 H200 benchmark)",
        experts: 1.0,
        experts_source: "",
    },
    Calibrated {
        family: KernelFamily::TorchEager,
        device: "h100-sxm",
        power: Some(500.0),
        efficiency: 0.5900,
        source: "fitted on steps.csv's calibration row tt24-t1-8b-8g-bf16-eager (torchtitan's December 2024 H100 benchmark, 500 W)",
        experts: 1.0,
        experts_source: "",
    },
];

/// How fast the plan's engine runs its kernels on its device: what the cost model scales
/// the device's efficiency curves by, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Performance {
    pub family: KernelFamily,
    /// The device's efficiency curves' peaks are multiplied by this (a matrix product's
    /// peak at most 1).
    pub efficiency: f64,
    /// Whether `efficiency` was fitted or measured for this engine on this device kind;
    /// false: 1, no run of it on this device kind is known to pipec.
    pub calibrated: bool,
    /// Where `efficiency` comes from.
    pub source: String,
    /// The routed experts' products against the engine's dense products of their size:
    /// their seconds are divided by this ([`Calibrated::experts`]; 1: nothing fitted).
    #[serde(default = "unity")]
    pub experts: f64,
    /// Where `experts` comes from; None: it is 1, no run of a mixture of experts on this
    /// kind is calibrated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_source: Option<String>,
    /// torchtitan compiles the loss (`[compile] components` with `loss`): the cross-entropy
    /// `KernelFamily::cross_entropy` prices, and what `pipec emit` writes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub loss_compiled: bool,
}

fn unity() -> f64 {
    1.0
}

/// The fitted experts' constant of `family` on a device kind, and its source: the table's
/// entry for the kind (its power cap, else another), 1 and None where there is none.
fn experts_of(family: KernelFamily, device: &str, power: Option<f64>) -> (f64, Option<String>) {
    let of_device = |c: &&Calibrated| c.family == family && c.device.eq_ignore_ascii_case(device);
    let entry = CALIBRATED
        .iter()
        .filter(of_device)
        .find(|c| same_power(c.power, power))
        .or_else(|| CALIBRATED.iter().find(of_device));
    match entry {
        Some(c) if !c.experts_source.is_empty() => (c.experts, Some(c.experts_source.to_string())),
        Some(_) | None => (1.0, None),
    }
}

impl Performance {
    /// The profile of `family` on `device`: the fitted constant for its device kind, else
    /// the device's own figures.
    pub fn of(family: KernelFamily, device: &DeviceModel) -> Performance {
        if family == KernelFamily::Pipec {
            // a device file is what `pipec calibrate` measured of pipec's kernels; a preset
            // is a datasheet, on which no run of pipec's executor is calibrated
            return match crate::device::preset(&device.name) {
                None => Performance {
                    family,
                    efficiency: 1.0,
                    calibrated: true,
                    source: "the device's own figures (a device file is what `pipec calibrate` measured of pipec's kernels)".into(),
                    experts: 1.0,
                    experts_source: None,
                    loss_compiled: false,
                    },
                Some(_) => Performance {
                    family,
                    efficiency: 1.0,
                    calibrated: false,
                    source: format!(
                        "{} is a preset (datasheet peaks and the shared curves fitted on Megatron-LM's A100 runs), not a measurement of pipec's executor; `pipec calibrate --backend cuda` measures it",
                        device_kind(device)
                    ),
                    experts: 1.0,
                    experts_source: None,
                    loss_compiled: false,
                    },
            };
        }
        let of_device = |c: &&Calibrated| c.family == family && c.device.eq_ignore_ascii_case(&device.name);
        let exact = CALIBRATED.iter().filter(of_device).find(|c| same_power(c.power, device.power));
        // the constant is the engine's kernel efficiency at the clock its rows sustained; a
        // power cap's clock is priced on its own (`DevicePreset::model_at`), so a constant
        // fitted at one cap carries to the same device at another
        let other_power = CALIBRATED.iter().find(of_device);
        let (experts, experts_source) = experts_of(family, &device.name, device.power);
        match (exact, other_power) {
            (Some(c), _) => Performance {
                family,
                efficiency: c.efficiency,
                calibrated: true,
                source: c.source.to_string(),
                experts,
                experts_source,
                loss_compiled: false,
            },
            (None, Some(c)) => Performance {
                family,
                efficiency: c.efficiency,
                calibrated: true,
                source: format!(
                    "{}; fitted on {}, carried to {}: the power cap's sustained clock is priced on its own",
                    c.source,
                    kind_text(c.device, c.power),
                    device_kind(device)
                ),
                experts,
                experts_source,
                loss_compiled: false,
            },
            (None, None) => Performance {
                family,
                efficiency: 1.0,
                calibrated: false,
                source: format!(
                    "no run of {} on {} is in pipec's table; the device's figures as they are (`pipec calibrate --measured` fits this from one measured step)",
                    family.describe(),
                    device_kind(device)
                ),
                experts,
                experts_source,
                loss_compiled: false,
            },
        }
    }

    /// The line reports print: "priced as ENGINE runs its kernels: efficiency × E — SOURCE".
    pub fn text(&self) -> String {
        let how = if self.calibrated { "" } else { " (not calibrated)" };
        let experts = match &self.experts_source {
            Some(source) => format!("; routed experts' products × {:.4} of that — {source}", self.experts),
            None => String::new(),
        };
        format!(
            "priced as {} runs its kernels: efficiency × {:.4}{how} — {}{experts}",
            self.family.describe(),
            self.efficiency,
            self.source
        )
    }

    /// The profile a calibration file gives.
    pub fn from_file(file: &CalibrationFile, path: &str) -> Performance {
        let (experts, experts_source) = experts_of(file.family, &file.device, file.power);
        Performance {
            experts,
            experts_source,
            loss_compiled: false,
            family: file.family,
            efficiency: file.efficiency,
            calibrated: true,
            source: format!(
                "{path}: fitted to a measured step of {:.4} s ({})",
                file.measured.step_s, file.measured.source
            ),
        }
    }
}

/// Scales a device's efficiency peaks by `factor`, to at most [`peak_cap`]. On a device
/// `pipec calibrate` measured ([`DeviceModel::measured`]) the constant is the machine's
/// speed against its calibration, and the rest of the executor's measured work runs that
/// much faster too ([`DeviceModel::run_faster`], by the factor as the products' peak took
/// it): on a 2-core CPU a pipeline's products are a quarter of its step, and a step 9%
/// under its prediction was out of the products' reach (docs/benchmarks.md). Returns that
/// factor as the products' peak took it (`factor`, or less at the cap).
pub fn scale_peaks(device: &mut DeviceModel, factor: f64) -> f64 {
    let cap = peak_cap(device);
    let before = device.matrix_efficiency.peak;
    device.matrix_efficiency.peak = (before * factor).min(cap);
    device.memory_efficiency.peak = (device.memory_efficiency.peak * factor).min(cap);
    let taken = if before > 0.0 { device.matrix_efficiency.peak / before } else { factor };
    if device.measured() {
        device.run_faster(taken);
    }
    taken
}

/// The highest peak an engine's constant scales `device`'s efficiency curves to: 1 (a
/// datasheet's rate) on a preset; on a device file `pipec calibrate` measured
/// ([`DeviceModel::measured`]) 4/3, since its peak of 1 is the rate one measurement found
/// on a machine whose speed varies from run to run (a 2-core CPU's steps by up to a third,
/// docs/benchmarks.md) and a measured step may be faster.
pub fn peak_cap(device: &DeviceModel) -> f64 {
    if device.measured() {
        4.0 / 3.0
    } else {
        1.0
    }
}

fn same_power(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(x), Some(y)) => (x - y).abs() < 0.5,
        (None, Some(_)) | (Some(_), None) => false,
    }
}

/// `h100-sxm`, or `h100-sxm at 500 W`.
pub fn device_kind(device: &DeviceModel) -> String {
    kind_text(&device.name, device.power)
}

/// A device kind in words: its name, and its power cap where it has one.
fn kind_text(name: &str, power: Option<f64>) -> String {
    match power {
        Some(w) => format!("{name} at {w:.0} W"),
        None => name.to_string(),
    }
}

/// What `pipec calibrate --measured` writes and `engine: { calibration: FILE }` reads: an
/// engine's kernel efficiency on one device kind, fitted to one measured step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalibrationFile {
    /// Always [`CALIBRATION_FORMAT`]: a file of another kind is refused.
    pub format: String,
    pub family: KernelFamily,
    /// The device kind it was measured on: the preset's name and its power cap.
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<f64>,
    pub efficiency: f64,
    pub measured: Measured,
}

/// The step a calibration was fitted to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measured {
    /// The spec whose layout ran.
    pub spec: String,
    /// The measured seconds per step.
    pub step_s: f64,
    /// What the step was read from (a number given, or a log file and its lines).
    pub source: String,
    /// What pipec predicted for the spec before the fit.
    pub predicted_before_s: f64,
}

/// The `format` of a calibration file.
pub const CALIBRATION_FORMAT: &str = "pipec-engine-calibration-1";

/// The largest efficiency factor a calibration may give: kernels faster than 4× the
/// shared curves' peak would be a misread step, not a faster engine.
pub const MAX_EFFICIENCY: f64 = 4.0;

impl CalibrationFile {
    /// Reads a calibration file, checking its kind and figures.
    pub fn from_json(text: &str) -> Result<CalibrationFile, String> {
        let kind: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not a calibration file (not JSON: {e})"))?;
        let format = kind.get("format").and_then(|f| f.as_str()).unwrap_or("");
        if format != CALIBRATION_FORMAT {
            return Err(format!(
                "not a calibration file: its `format` is {}, expected \"{CALIBRATION_FORMAT}\" (write one with `pipec calibrate --measured`)",
                if format.is_empty() { "missing".to_string() } else { format!("\"{format}\"") }
            ));
        }
        let file: CalibrationFile = serde_json::from_value(kind).map_err(|e| format!("not a calibration file: {e}"))?;
        if !(file.efficiency.is_finite() && file.efficiency > 0.0 && file.efficiency <= MAX_EFFICIENCY) {
            return Err(format!("its efficiency {} is not in (0, {MAX_EFFICIENCY}]", file.efficiency));
        }
        if !(file.measured.step_s.is_finite() && file.measured.step_s > 0.0) {
            return Err(format!("its measured step {} is not a positive number of seconds", file.measured.step_s));
        }
        if let Some(w) = file.power {
            if !(w.is_finite() && w > 0.0) {
                return Err(format!("its power {w} is not a positive number of watts"));
            }
        }
        Ok(file)
    }

    /// Whether this file is for `family` on `device` (its preset and power cap); Err says
    /// what differs.
    pub fn matches(&self, family: KernelFamily, device: &DeviceModel) -> Result<(), String> {
        if self.family != family {
            return Err(format!(
                "it calibrates {}, and the spec's engine runs {}",
                self.family.describe(),
                family.describe()
            ));
        }
        if !self.device.eq_ignore_ascii_case(&device.name) || !same_power(self.power, device.power) {
            return Err(format!(
                "it was measured on {}, and the spec's devices are {}",
                kind_text(&self.device, self.power),
                device_kind(device)
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::preset;

    /// The attention kernels' rates are the published figures at the measured sequences,
    /// between them in log₂ of the sequence, and the end figures outside; a pass and a
    /// mask read their own figure.
    #[test]
    fn attention_kernels_sustain_their_published_rate_at_each_sequence() {
        use AttentionPass::{Backward, Forward};
        let tflops = |k: &AttentionKernel, pass, causal, s: f64| k.share(pass, causal, s) * 989.4;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let fa2 = FLASH_ATTENTION_2;
        assert!(close(tflops(&fa2, Forward, false, 8192.0), 370.0));
        assert!(close(tflops(&fa2, Forward, true, 8192.0), 333.0));
        assert!(close(tflops(&fa2, Backward, true, 8192.0), 318.0));
        assert!(close(tflops(&fa2, Backward, false, 4096.0), 310.0));
        // halfway between 4k and 8k in log₂: halfway between their figures
        assert!(close(tflops(&fa2, Forward, true, 4096.0 * 2f64.sqrt()), (319.0 + 333.0) / 2.0));
        // outside the figures: the nearest end's
        assert!(close(tflops(&fa2, Forward, true, 32768.0), 335.0));
        assert!(close(tflops(&fa2, Forward, true, 128.0), 191.0));
        let cudnn = CUDNN_ATTENTION;
        assert!(close(tflops(&cudnn, Forward, false, 8192.0), 600.0));
        assert!(close(tflops(&cudnn, Forward, true, 4096.0), 518.0));
        assert!(close(tflops(&cudnn, Backward, true, 4096.0), 499.0));
        // the masked forward is the slower, and cuDNN the faster kernel, at every sequence
        for s in ATTENTION_SEQUENCES {
            assert!(tflops(&fa2, Forward, true, s) < tflops(&fa2, Forward, false, s));
            assert!(tflops(&cudnn, Backward, false, s) > tflops(&fa2, Backward, false, s));
        }
        // only Hopper presets have them, and pipec's own executor none
        let h100 = preset("h100-sxm").expect("preset").model();
        assert_eq!(KernelFamily::MegatronTe.attention(&h100), Some(CUDNN_ATTENTION));
        assert_eq!(KernelFamily::TorchCompiled.attention(&h100), Some(FLASH_ATTENTION_2));
        assert_eq!(KernelFamily::Pipec.attention(&h100), None);
        assert_eq!(KernelFamily::MegatronTe.attention(&preset("a100-80gb").expect("preset").model()), None);
    }

    /// Each engine's cross-entropy, counted tensor by tensor from its code (the variants'
    /// docs): bytes per logit kept and held beside them, under bf16 and fp32 training.
    #[test]
    fn fp8_casts_move_what_each_engines_code_moves() {
        // bf16 operands: Transformer Engine's cast_transpose reads 2 bytes and writes 2 a
        // value; torchao's compiled dynamic scaling 5 (its roofline's 2 + 2·1 + 1), its
        // weights 7 (the reduction's read too), eager 6 each
        let p = 2.0;
        let te = KernelFamily::MegatronTe.fp8_casts();
        assert_eq!((te.input.bytes(p), te.grad_output.bytes(p), te.weights), (4.0, 4.0, None));
        let compiled = KernelFamily::TorchCompiled.fp8_casts();
        assert_eq!((compiled.input.bytes(p), compiled.grad_output.bytes(p)), (5.0, 5.0));
        assert_eq!(compiled.weights.map(|w| w.bytes(p)), Some(7.0));
        let eager = KernelFamily::TorchEager.fp8_casts();
        assert_eq!((eager.input.bytes(p), eager.weights.map(|w| w.bytes(p))), (6.0, Some(6.0)));
        for family in [KernelFamily::Pipec, KernelFamily::Deepspeed] {
            assert_eq!(family.fp8_casts(), te, "{family:?}");
        }
        // sequence parallelism: PyTorch keeps the gathered inputs and gathers FP8
        let torch = KernelFamily::TorchCompiled.sequence_collectives();
        assert!(torch.keeps_gathered && torch.fp8_gathers);
        assert_eq!(KernelFamily::MegatronTe.sequence_collectives(), SequenceCollectives::default());
    }

    #[test]
    fn each_cross_entropy_holds_what_its_code_makes() {
        let at = |c: CrossEntropy, p: f64| {
            let b = c.bytes(p);
            (b.kept, b.transient)
        };
        // bf16 logits: 2 bytes; their fp32 copy, the log-probabilities, the gradients: 4
        assert_eq!(at(CrossEntropy::Pipec, 2.0), (4.0, 6.0));
        // the bf16 logits' block stays reserved beside the backward's fp32 gradients
        assert_eq!(at(CrossEntropy::Eager, 2.0), (4.0, 10.0), "the two fp32 gradients and the logits' block");
        assert_eq!(at(CrossEntropy::LossParallel, 2.0), (4.0, 14.0), "three fp32 tensors and the logits' block");
        assert_eq!(at(CrossEntropy::Compiled, 2.0), (2.0, 2.0), "the logits, and their gradient");
        assert_eq!(at(CrossEntropy::Megatron, 2.0), (4.0, 2.0), "the softmax in place, the gradient's cast");
        assert_eq!(at(CrossEntropy::Transformers, 2.0), (6.0, 8.0), "the output's logits kept too");
        // fp32 training: `.float()` copies nothing
        assert_eq!(at(CrossEntropy::Eager, 4.0), (4.0, 8.0));
        assert_eq!(at(CrossEntropy::LossParallel, 4.0), (4.0, 12.0));
        assert_eq!(at(CrossEntropy::Megatron, 4.0), (4.0, 0.0));
        assert_eq!(at(CrossEntropy::Compiled, 4.0), (4.0, 4.0));
        // which engine runs which
        use KernelFamily as F;
        assert_eq!(F::TorchCompiled.cross_entropy(false, true), CrossEntropy::LossParallel);
        assert_eq!(F::TorchCompiled.cross_entropy(false, false), CrossEntropy::Eager);
        assert_eq!(F::TorchEager.cross_entropy(true, true), CrossEntropy::Compiled);
        assert_eq!(F::MegatronTe.cross_entropy(false, true), CrossEntropy::Megatron);
        assert_eq!(F::Deepspeed.cross_entropy(false, false), CrossEntropy::Transformers);
        assert_eq!(F::Pipec.cross_entropy(true, true), CrossEntropy::Pipec);
    }

    #[test]
    fn a_fitted_constant_scales_the_peaks_of_its_device_kind_only() {
        let a100 = preset("a100-80gb").expect("preset").model();
        let p = Performance::of(KernelFamily::MegatronTe, &a100);
        assert!(p.calibrated && p.efficiency == 1.0, "{p:?}");
        let h100 = preset("h100-sxm").expect("preset").model_at(500.0);
        let q = Performance::of(KernelFamily::Deepspeed, &h100);
        assert!(!q.calibrated && q.source.contains("h100-sxm at 500 W"), "{q:?}");
        // a constant fitted at a power cap carries to the device at full power, saying so
        let full = preset("h100-sxm").expect("preset").model();
        let (capped, carried) =
            (Performance::of(KernelFamily::TorchCompiled, &h100), Performance::of(KernelFamily::TorchCompiled, &full));
        assert!(capped.calibrated && carried.calibrated, "{carried:?}");
        assert_eq!(capped.efficiency, carried.efficiency);
        assert!(carried.source.contains("fitted on h100-sxm at 500 W, carried to h100-sxm"), "{carried:?}");
        assert!(!capped.source.contains("carried"), "{capped:?}");
        let mut d = preset("h100-sxm").expect("preset").model();
        let before = d.matrix_efficiency.peak;
        scale_peaks(&mut d, 0.5);
        assert!((d.matrix_efficiency.peak - before * 0.5).abs() < 1e-12);
        scale_peaks(&mut d, 100.0);
        assert_eq!(d.matrix_efficiency.peak, 1.0, "a product's efficiency is at most 1");
        // a device `pipec calibrate` measured may run faster than it was measured
        let mut cpu = DeviceModel::uniform("cpu (pipec calibrate)", 1e9, 1e11);
        assert_eq!(peak_cap(&cpu), 1.0, "figures alone are not a measurement");
        cpu.product_traffic = Some(crate::device::Traffic::new(1e10, 1e6));
        cpu.layer_pass = Some(12e-6);
        scale_peaks(&mut cpu, 1.2);
        assert!((cpu.matrix_efficiency.peak - 1.2).abs() < 1e-12);
        // the rest of the executor's measured work runs as much faster
        assert!((cpu.vector - 1.2e11).abs() < 1.0 && (cpu.layer_pass.expect("kept") - 10e-6).abs() < 1e-15, "{cpu:?}");
        let taken = scale_peaks(&mut cpu, 2.0);
        assert_eq!(cpu.matrix_efficiency.peak, 4.0 / 3.0);
        assert!((taken - 4.0 / 3.0 / 1.2).abs() < 1e-12, "{taken}");
        // by the factor the peak took, to the cap
        assert!((cpu.product_traffic.expect("kept").bandwidth - 1e10 * 4.0 / 3.0).abs() < 1.0, "{cpu:?}");
        // a preset's other figures are its datasheet's
        let (mut h, bare) = (preset("h100-sxm").expect("preset").model(), preset("h100-sxm").expect("preset").model());
        scale_peaks(&mut h, 0.8);
        assert_eq!((h.vector, h.launch), (bare.vector, bare.launch));
    }

    #[test]
    fn every_fitted_constant_names_a_preset_and_its_source() {
        for c in CALIBRATED {
            assert!(preset(c.device).is_some(), "{c:?}");
            assert!(c.efficiency > 0.0 && c.efficiency <= MAX_EFFICIENCY, "{c:?}");
            assert!(!c.source.is_empty());
            assert!(c.experts > 0.0 && c.experts <= MAX_EFFICIENCY, "{c:?}");
            // a fitted experts' constant names its rows; an unfitted one is 1
            assert_eq!(c.experts_source.is_empty(), c.experts == 1.0, "{c:?}");
        }
    }

    #[test]
    fn the_experts_constant_travels_with_its_kind_and_into_calibration_files() {
        let h100 = preset("h100-sxm").expect("preset").model();
        let megatron = Performance::of(KernelFamily::MegatronTe, &h100);
        let table = CALIBRATED
            .iter()
            .find(|c| c.family == KernelFamily::MegatronTe && c.device == "h100-sxm")
            .expect("Megatron-LM's H100 constants");
        assert_eq!(megatron.experts, table.experts);
        assert!(megatron.experts < 1.0, "{megatron:?}");
        assert!(megatron.text().contains("routed experts' products ×"), "{}", megatron.text());
        // a kind with no FP8 mixture of experts calibrated: 1, and the report says nothing
        let titan = Performance::of(KernelFamily::TorchCompiled, &h100);
        assert_eq!((titan.experts, titan.experts_source.as_deref()), (1.0, None));
        assert!(!titan.text().contains("experts"));
        // a user's calibration file fits the kernel efficiency; the experts' constant of its
        // kind stays the table's
        let file = CalibrationFile {
            format: CALIBRATION_FORMAT.into(),
            family: KernelFamily::MegatronTe,
            device: "h100-sxm".into(),
            power: None,
            efficiency: 0.7,
            measured: Measured {
                spec: "a.yaml".into(),
                step_s: 9.0,
                source: "--step 9".into(),
                predicted_before_s: 8.0,
            },
        };
        let from = Performance::from_file(&file, "m.json");
        assert_eq!((from.efficiency, from.experts), (0.7, table.experts));
        // a plan written before the constant existed reads as 1
        let mut old = serde_json::to_value(&titan).expect("serialises");
        old.as_object_mut().expect("an object").remove("experts");
        let read: Performance = serde_json::from_value(old).expect("reads");
        assert_eq!(read.experts, 1.0);
    }

    #[test]
    fn a_calibration_file_is_checked_for_its_kind_and_figures() {
        let good = CalibrationFile {
            format: CALIBRATION_FORMAT.into(),
            family: KernelFamily::TorchEager,
            device: "h100-sxm".into(),
            power: Some(500.0),
            efficiency: 0.6,
            measured: Measured {
                spec: "a.yaml".into(),
                step_s: 2.8,
                source: "--step 2.8".into(),
                predicted_before_s: 1.5,
            },
        };
        let text = serde_json::to_string(&good).expect("json");
        assert_eq!(CalibrationFile::from_json(&text), Ok(good.clone()));
        assert!(CalibrationFile::from_json("{\"format\": \"pipec-plan\"}").expect_err("kind").contains("format"));
        assert!(CalibrationFile::from_json("[1, 2").expect_err("json").contains("not JSON"));
        let bad = text.replace("0.6", "-1");
        assert!(CalibrationFile::from_json(&bad).expect_err("efficiency").contains("efficiency"));
        let h100 = preset("h100-sxm").expect("preset");
        assert_eq!(good.matches(KernelFamily::TorchEager, &h100.model_at(500.0)), Ok(()));
        assert!(good.matches(KernelFamily::TorchEager, &h100.model()).expect_err("power").contains("500 W"));
        assert!(good.matches(KernelFamily::TorchCompiled, &h100.model_at(500.0)).is_err());
    }
}
