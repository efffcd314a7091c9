//! The named choices a spec and a plan share: schedule, data-parallel sync and reduce modes,
//! precision, synthetic task, loss, optimizer kind, engine. Each is an enum defined once here, with
//! its spelling (the serde name, the spec's keyword, the plan file's value) and its
//! documentation; the front end lowers spec values into them with [`Choice::from_name`], the
//! JSON Schema is derived from them (feature `schema`), and an unknown value in a plan file is
//! a load error because serde knows only these names.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A closed set of named values.
pub trait Choice: Sized + Copy + PartialEq + 'static {
    /// Every value, in documentation order.
    const ALL: &'static [Self];
    /// The spelling in specs and plan files.
    fn name(self) -> &'static str;
    /// The value spelled `name`, if any.
    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.name() == name)
    }
}

/// Defines a [`Choice`] enum: each variant with its doc and its one spelling, used by serde,
/// the schema, `name()` and `Display` alike.
macro_rules! choice {
    ($(#[$meta:meta])* pub enum $ty:ident { $($(#[doc = $doc:literal])* $variant:ident = $text:tt,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
        pub enum $ty {
            $($(#[doc = $doc])* #[serde(rename = $text)] $variant,)+
        }
        impl $ty {
            /// The spelling in specs and plan files.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $text,)+
                }
            }
        }
        impl Choice for $ty {
            const ALL: &'static [Self] = &[$($ty::$variant),+];
            fn name(self) -> &'static str {
                $ty::name(self)
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

choice! {
    /// What a collective computes over its group (`Instr::Collective`). The verifier's
    /// buffer rules, the simulator's cost and both executor transports each handle a kind
    /// in one place (docs/plan-format.md).
    pub enum CollectiveKind {
        /// Every member ends with the sum of every member's values.
        AllReduce = "all_reduce",
        /// Every member ends with its own chunk of the sum (member i the i-th of the group's
        /// equal chunks; the first `len mod p` one value longer).
        ReduceScatter = "reduce_scatter",
        /// Every member ends with every member's chunk, in member order.
        AllGather = "all_gather",
        /// Member i's input is p equal chunks, the j-th for member j; every member ends with
        /// the chunks addressed to it, in member order (expert parallelism's dispatch and
        /// combine).
        AllToAll = "all_to_all",
    }
}

choice! {
    /// Expert parallelism's exchanges of tokens inside a mixture-of-experts block's passes
    /// (`Instr::AllToAll`): a forward (or recompute) dispatches each routed token to the
    /// member computing its expert and combines the outputs back; a backward sends the
    /// combine's gradient back to the experts, then the dispatch's to the tokens' members.
    pub enum TokenExchange {
        /// The routed tokens' rows to their experts' members.
        Dispatch = "dispatch",
        /// The experts' outputs back to the tokens' members.
        Combine = "combine",
        /// The outputs' gradients to the experts' members (the combine, reversed).
        CombineGrad = "combine_grad",
        /// The rows' gradients back to the tokens' members (the dispatch, reversed).
        DispatchGrad = "dispatch_grad",
    }
}

impl TokenExchange {
    /// What a pass posts at each mixture-of-experts layer, in order: a forward or a
    /// recompute dispatches then combines; an (input-gradient) backward runs the two in
    /// reverse. Empty for every other pass.
    pub fn of_pass(phase: crate::Phase) -> &'static [TokenExchange] {
        use crate::Phase;
        match phase {
            Phase::Forward | Phase::Recompute => &[TokenExchange::Dispatch, TokenExchange::Combine],
            Phase::Backward | Phase::BackwardInput => &[TokenExchange::CombineGrad, TokenExchange::DispatchGrad],
            _ => &[],
        }
    }

    /// The exchange that carries this one's gradient.
    pub fn reversed(self) -> TokenExchange {
        match self {
            TokenExchange::Dispatch => TokenExchange::DispatchGrad,
            TokenExchange::Combine => TokenExchange::CombineGrad,
            TokenExchange::CombineGrad => TokenExchange::Combine,
            TokenExchange::DispatchGrad => TokenExchange::Dispatch,
        }
    }
}

choice! {
    /// What a collective carries: its use in the plan, which says which buffers it reads
    /// and writes.
    pub enum CollectivePayload {
        /// A stage's weight gradients (and batch statistics), over the stage's replicas.
        Gradients = "gradients",
        /// A tied weight's gradient (an embedding and the projection tied to it), over every
        /// device holding a copy.
        TiedGradient = "tied_gradient",
        /// ZeRO: a stage's weight gradients reduce-scattered over its replicas, each
        /// replica adding its chunk of the sum to the gradient shard it keeps.
        GradientShard = "gradient_shard",
        /// ZeRO: a tied weight's gradient shards summed over every device holding a copy
        /// (each contributes its shard in place, each takes its own shard back).
        TiedGradientShard = "tied_gradient_shard",
        /// ZeRO stages 1 and 2: a stage's updated weight shards all-gathered over its
        /// replicas into the whole weights every replica computes with.
        Weights = "weights",
        /// Gradient clipping: each device's share of the squared norm of the whole model's
        /// gradient, summed over every device, before any update.
        GradNorm = "grad_norm",
    }
}

// What each schedule is (its constraints, placement, update cadence, weight versions) is
// described once, in `crate::schedule`.
choice! {
    /// Pipeline schedules pipec generates.
    pub enum ScheduleKind {
        /// GPipe: all forwards, then all backwards, one flush per step.
        Gpipe = "gpipe",
        /// 1F1B with a flush (PipeDream-Flush / DAPPLE): early backwards bound activation memory.
        OneFOneB = "1f1b",
        /// Interleaved 1F1B (Megatron): `virtual_stages` model chunks per device.
        Interleaved = "interleaved",
        /// PipeDream asynchronous 1F1B with weight stashing and vertical sync.
        PipeDream = "pipedream",
        /// PipeDream-2BW: double-buffered weights, one update every step.
        TwoBw = "2bw",
        /// Chimera: two pipelines in opposite directions (even number of stages).
        Chimera = "chimera",
        /// Zero-bubble ZB-H1: split backward into input and weight gradients.
        ZbH1 = "zb-h1",
        /// Zero-bubble V schedule: two chunks per device in a V shape.
        Zbv = "zbv",
        /// DualPipeV (DeepSeek's DualPipe cut in half, Sea AI Lab): two chunks per device in a
        /// V shape, a forward of one chunk paired with a backward of the other in the steady
        /// state, zero-bubble split backwards at the edges.
        DualPipeV = "dualpipev",
        /// DualPipe (DeepSeek-V3): two pipelines in opposite directions over the same devices,
        /// each taking half of the microbatches, a forward of one direction paired with a
        /// backward of the other in the steady state (even number of stages).
        DualPipe = "dualpipe",
        /// Data parallelism only: one stage, every device a replica.
        DpOnly = "dp-only",
    }
}

choice! {
    /// The training engine a plan is for (the spec's `engine:`): the capabilities `pipec check`,
    /// `search` and `compare` hold a layout to (`crate::engine`), and the launch
    /// configuration `pipec emit` writes.
    pub enum Engine {
        /// pipec's own executor (`pipec run`), the default.
        Pipec = "pipec",
        /// NVIDIA Megatron-LM: `pretrain_gpt.py` on Megatron Core.
        Megatron = "megatron",
        /// PyTorch's torchtitan (its TOML job configuration).
        Torchtitan = "torchtitan",
        /// Microsoft DeepSpeed (`ds_config.json` and the `deepspeed` launcher).
        Deepspeed = "deepspeed",
    }
}

#[allow(clippy::derivable_impls)] // the `choice!` macro writes the enum
impl Default for Engine {
    fn default() -> Self {
        Engine::Pipec
    }
}

choice! {
    /// A transformer block's normalisation (`norm=`).
    pub enum NormKind {
        /// Layer normalisation: centred and scaled, a gain and a bias per feature (GPT-2, BERT).
        LayerNorm = "layernorm",
        /// Root-mean-square normalisation: scaled only, a gain per feature (Llama, Mistral, Qwen).
        RmsNorm = "rmsnorm",
    }
}

choice! {
    /// How `pool` reduces a [sequence, d] input to [d] (a sequence classifier's summary).
    pub enum Pooling {
        /// The first position's vector (BERT's `[CLS]` token).
        First = "first",
        /// The mean over positions.
        Mean = "mean",
    }
}

choice! {
    /// A transformer block's MLP (`mlp=`): two linear layers around an activation, or a
    /// gated unit (three: act(x·W_gate) ⊙ (x·W_up), then W_down).
    pub enum MlpKind {
        /// GELU, exact (erf) form, as `torch.nn.GELU()`.
        Gelu = "gelu",
        /// GELU, tanh approximation (GPT-2's `gelu_new`, `GELU(approximate="tanh")`).
        GeluTanh = "gelu_tanh",
        /// SwiGLU: SiLU-gated (Llama, Mistral, Qwen).
        Swiglu = "swiglu",
        /// GeGLU: GELU-gated (exact form).
        Geglu = "geglu",
    }
}

impl MlpKind {
    /// Whether the MLP is gated (three weight matrices, the first one twice as wide).
    pub fn gated(self) -> bool {
        matches!(self, MlpKind::Swiglu | MlpKind::Geglu)
    }
}

choice! {
    /// How a mixture-of-experts router scores the experts (`router=`).
    pub enum Router {
        /// A softmax over the experts' logits (Switch, GShard, Mixtral).
        Softmax = "softmax",
        /// Each logit's sigmoid (DeepSeek-V3).
        Sigmoid = "sigmoid",
    }
}

choice! {
    /// Synchronous or asynchronous data parallelism (`dp-only`).
    pub enum SyncMode {
        /// Bulk-synchronous: gradients all-reduced every step.
        Bsp = "bsp",
        /// Asynchronous: a parameter server applies each worker's gradient as it arrives.
        Asp = "asp",
    }
}

choice! {
    /// How a replicated stage sums its gradients.
    pub enum ReduceMode {
        /// Ring all-reduce over the replicas.
        Ring = "ring",
        /// A central parameter server.
        ParameterServer = "ps",
    }
}

choice! {
    /// Numeric precision of weights and activations.
    pub enum Precision {
        /// 32-bit floating point.
        Fp32 = "fp32",
        /// bfloat16 (with an fp32 master copy of the weights).
        Bf16 = "bf16",
        /// IEEE half precision (with an fp32 master copy of the weights).
        Fp16 = "fp16",
    }
}

impl Precision {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::Fp16 => 2,
        }
    }
}

choice! {
    /// The training precision a spec names (`training.precision`): one of the value
    /// precisions, or FP8 training — bf16 mixed precision whose transformer blocks' matrix
    /// products take FP8 operands (Transformer Engine's and torchao's recipes: the first
    /// and last layers, the attention core, norms and optimizer stay in bf16 or fp32).
    pub enum TrainingPrecision {
        /// 32-bit floating point.
        Fp32 = "fp32",
        /// bfloat16 (with an fp32 master copy of the weights).
        Bf16 = "bf16",
        /// IEEE half precision (with an fp32 master copy of the weights).
        Fp16 = "fp16",
        /// bf16 mixed precision with the blocks' products in FP8 (`training.fp8` says how).
        Fp8 = "fp8",
    }
}

impl TrainingPrecision {
    /// The precision of weights and activations outside the FP8 products.
    pub fn values(self) -> Precision {
        match self {
            TrainingPrecision::Fp32 => Precision::Fp32,
            TrainingPrecision::Bf16 | TrainingPrecision::Fp8 => Precision::Bf16,
            TrainingPrecision::Fp16 => Precision::Fp16,
        }
    }
}

choice! {
    /// Where FP8 training keeps a tensor in FP8 or in bf16 (`training.fp8`'s `activations`
    /// and `gather`).
    pub enum Fp8Storage {
        /// One byte per value, with its scales.
        Fp8 = "fp8",
        /// The training precision's two bytes.
        Bf16 = "bf16",
    }
}

choice! {
    /// How a transformer block computes attention.
    pub enum Attention {
        /// Scores materialised: softmax and dropout on the `[heads, seq, seq]` matrix, which
        /// the backward keeps (the 5·a·s² term of Korthikanti et al. 2022's accounting).
        Standard = "standard",
        /// A fused kernel (FlashAttention): the scores never leave on-chip memory, nothing of
        /// size `seq²` is kept, and the backward recomputes them.
        Flash = "flash",
    }
}

choice! {
    /// How context parallelism exchanges a transformer block's keys and values among a
    /// group's members (`cp_comm`; Megatron-LM's `--cp-comm-type`).
    pub enum CpComm {
        /// Every member's keys and values gathered at once before attention and kept for
        /// the backward, whose gradients a reduce-scatter returns (the Llama 3 paper's form).
        AllGather = "all_gather",
        /// Passed around the group's ring a block at a time, each transfer hidden under the
        /// attention over the block before it; only the member's own keys and values are
        /// kept, and the backward passes them around again with their gradients (Megatron-
        /// LM's `p2p`, Transformer Engine's ring attention).
        Ring = "ring",
    }
}

// (`choice!` takes no attributes on its variants, so not `#[derive(Default)]`)
#[allow(clippy::derivable_impls)]
impl Default for MoeDispatch {
    fn default() -> Self {
        MoeDispatch::AllToAll
    }
}

choice! {
    /// How expert parallelism sends a token's routed copies to the experts' devices
    /// (`moe_dispatch`).
    pub enum MoeDispatch {
        /// One all-to-all over the expert-parallel group: a copy per routed expert, across
        /// nodes as within them.
        AllToAll = "all_to_all",
        /// DeepEP's (or HybridEP's) dispatch: a token crosses the network once per
        /// destination node and is forwarded to that node's chosen experts over NVLink; the
        /// combine reduces the same way back (Megatron-LM's `--moe-token-dispatcher-type
        /// flex`, torchtitan's `expert_parallel_comm_backend = "deepep"`). pipec's executor
        /// sends the same values as an all-to-all.
        DeepEp = "deepep",
    }
}

#[allow(clippy::derivable_impls)]
impl Default for CpComm {
    fn default() -> Self {
        CpComm::AllGather
    }
}

choice! {
    /// A part of a transformer block that recompute by module drops from what the forward
    /// keeps and recomputes in the backward (Megatron-LM's `--recompute-modules`, whose
    /// names these are): its inputs stay kept, what it makes from them does not.
    pub enum RecomputeModule {
        /// The attention core: scores, softmax, dropout, weighted sum (a fused kernel keeps
        /// only its output and each row's log-sum-exp, and recomputes the rest anyway).
        CoreAttn = "core_attn",
        /// The whole dense MLP (its up projection, activation and down projection) from its
        /// input.
        Mlp = "mlp",
        /// The experts' activation function: its output, the experts' down projection's input.
        MoeAct = "moe_act",
        /// The block's two norms: their outputs, the inputs of the products after them.
        Layernorm = "layernorm",
        /// Multi-head latent attention's up projections: the queries, keys and values from
        /// their latents.
        MlaUpProj = "mla_up_proj",
        /// The whole mixture of experts: the router, the dispatch, the experts and the
        /// combine, from the block's second norm's output.
        Moe = "moe",
        /// The shared experts.
        SharedExperts = "shared_experts",
    }
}

choice! {
    /// An operation whose outputs op-level selective recompute saves (everything else in a
    /// recomputed block is recomputed in its backward; torchtitan's `selective_ac_option =
    /// "op"` saves `alternate_matmul` and `attention`).
    pub enum RecomputeOp {
        /// Every matrix product's output.
        Matmul = "matmul",
        /// Every other matrix product's output, in the block's forward order (the first,
        /// third, ...): the others are recomputed.
        AlternateMatmul = "alternate_matmul",
        /// The fused attention kernel's output (and its log-sum-exp).
        Attention = "attention",
    }
}

choice! {
    /// What torchtitan compiles with `torch.compile` (`engine: { compile: [...] }`, its
    /// `[compile] components`).
    pub enum CompileComponent {
        /// Each transformer block: element-wise work fused by Inductor.
        Model = "model",
        /// The loss: the cross-entropy's upcast, softmax and gradient in fused kernels that
        /// keep the logits alone.
        Loss = "loss",
    }
}

impl CompileComponent {
    /// The components compiled where the model's blocks and (or) the loss are, in
    /// torchtitan's order: what `engine.compile` lists, the import writes and `emit` sets.
    pub fn compiled((model, loss): (bool, bool)) -> Vec<CompileComponent> {
        [(CompileComponent::Model, model), (CompileComponent::Loss, loss)]
            .into_iter()
            .filter_map(|(c, on)| on.then_some(c))
            .collect()
    }
}

choice! {
    /// How FP8 training scales each tensor before its FP8 product (`training.fp8.recipe`).
    pub enum Fp8Recipe {
        /// One scale per tensor from a history of earlier steps' maxima (Transformer Engine's
        /// `DelayedScaling`).
        Delayed = "delayed",
        /// One scale per tensor from its current maximum (Transformer Engine's
        /// `Float8CurrentScaling`, Megatron-LM's `tensorwise`, torchao's `tensorwise`).
        Tensorwise = "tensorwise",
        /// One scale per row (torchao's `rowwise`).
        Rowwise = "rowwise",
        /// DeepSeek-V3's blocks: activations 1 × 128, weights 128 × 128 (Transformer Engine's
        /// `Float8BlockScaling`, Megatron-LM's `blockwise`).
        Blockwise = "blockwise",
        /// MX block scaling: an 8-bit exponent per 32 values (`MXFP8BlockScaling`; Blackwell).
        Mxfp8 = "mxfp8",
    }
}

#[allow(clippy::derivable_impls)] // the `choice!` macro writes the enum
impl Default for Fp8Recipe {
    fn default() -> Self {
        Fp8Recipe::Tensorwise
    }
}

impl Fp8Recipe {
    /// Bytes of scales per FP8 value: a 4-byte scale per row of 128 (blockwise activations),
    /// per 32 values one byte (MX), or per tensor or row (negligible: 0).
    pub fn scale_bytes_per_value(self) -> f64 {
        match self {
            Fp8Recipe::Delayed | Fp8Recipe::Tensorwise | Fp8Recipe::Rowwise => 0.0,
            Fp8Recipe::Blockwise => 4.0 / 128.0,
            Fp8Recipe::Mxfp8 => 1.0 / 32.0,
        }
    }
}

choice! {
    /// What data-parallel replicas shard among themselves (ZeRO's stages; FSDP's
    /// `SHARD_GRAD_OP` is `gradients`, `FULL_SHARD` is `parameters`). Each level keeps the
    /// levels before it: with `d` replicas, `optimizer` keeps 1/d of the optimizer state and
    /// master weights (Megatron-LM's distributed optimizer: gradients reduce-scattered, the
    /// shard updated, the weights all-gathered; the same bytes on the wire as an
    /// all-reduce); `gradients` also keeps only the gradient shard; `parameters` also keeps
    /// only a weight shard, gathering a layer's weights before its forward and again before
    /// its backward.
    pub enum Sharding {
        /// Every replica holds everything (ZeRO stage 0).
        None = "none",
        /// ZeRO stage 1: optimizer state and master weights.
        Optimizer = "optimizer",
        /// ZeRO stage 2: also gradients.
        Gradients = "gradients",
        /// ZeRO stage 3 (FSDP): also parameters.
        Parameters = "parameters",
    }
}

impl Sharding {
    /// ZeRO's stage number (0 to 3).
    pub fn level(self) -> u8 {
        match self {
            Sharding::None => 0,
            Sharding::Optimizer => 1,
            Sharding::Gradients => 2,
            Sharding::Parameters => 3,
        }
    }

    /// The level of ZeRO stage `n`.
    pub fn of_level(n: u64) -> Option<Sharding> {
        Sharding::ALL.iter().copied().find(|s| u64::from(s.level()) == n)
    }

    /// Whether the optimizer state, gradients and weights are sharded.
    pub fn shards(self) -> (bool, bool, bool) {
        (self.level() >= 1, self.level() >= 2, self.level() >= 3)
    }
}

choice! {
    /// When batch normalisation's running statistics move (`training.running_stats`).
    pub enum RunningStats {
        /// Once per optimizer update, toward the mean of the statistics of the microbatches
        /// it covers: the same on every layout.
        PerUpdate = "per_update",
        /// At every forward, in the step's microbatch order, as `nn.BatchNorm2d` does
        /// under gradient accumulation on one device (synchronous schedules).
        PerForward = "per_forward",
    }
}

#[allow(clippy::derivable_impls)] // the `choice!` macro writes the enum
impl Default for RunningStats {
    fn default() -> Self {
        RunningStats::PerUpdate
    }
}

choice! {
    /// How the learning rate falls after the warm-up (`training.lr_schedule.decay`).
    pub enum Decay {
        /// Stays at the optimizer's `lr`.
        Constant = "constant",
        /// Falls linearly to `min_lr` at `decay_steps`.
        Linear = "linear",
        /// Falls along half a cosine to `min_lr` at `decay_steps`.
        Cosine = "cosine",
    }
}

choice! {
    /// The task of synthetic data.
    pub enum Task {
        /// Labels from a fixed random teacher (class indices).
        Classification = "classification",
        /// Real-valued targets.
        Regression = "regression",
    }
}

choice! {
    /// The integer type of a raw token file (little-endian, no header).
    pub enum TokenDtype {
        /// 2 bytes per token (vocabularies up to 65,536, e.g. GPT-2's 50,257).
        Uint16 = "uint16",
        /// 4 bytes per token.
        Uint32 = "uint32",
    }
}

choice! {
    /// The loss at the end of the model.
    pub enum Loss {
        /// Softmax cross-entropy over class scores; the last layer's output size is the
        /// number of classes. On a language model's [sequence, vocab] logits, the mean over
        /// positions of the cross-entropy with the next token.
        CrossEntropy = "cross_entropy",
        /// Mean squared error (regression).
        Mse = "mse",
    }
}

choice! {
    /// The optimizer as the spec names it.
    pub enum OptimizerKind {
        /// Plain SGD.
        Sgd = "sgd",
        /// SGD with momentum (0.9 unless given).
        Momentum = "momentum",
        /// Adam, weight decay added to the gradient (`torch.optim.Adam`).
        Adam = "adam",
        /// Adam with decoupled weight decay: the weights shrink by `lr · weight_decay` before
        /// the Adam step (`torch.optim.AdamW`, Loshchilov and Hutter 2019).
        AdamW = "adamw",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trips<C: Choice + Serialize + for<'de> Deserialize<'de> + fmt::Debug>() {
        for &c in C::ALL {
            let json = serde_json::to_string(&c).expect("a choice serialises");
            assert_eq!(json, format!("\"{}\"", c.name()));
            assert_eq!(serde_json::from_str::<C>(&json).expect("and reads back"), c);
            assert_eq!(C::from_name(c.name()), Some(c));
        }
        assert!(serde_json::from_str::<C>("\"no-such-value\"").is_err());
        assert_eq!(C::from_name("no-such-value"), None);
    }

    #[test]
    fn every_choice_has_one_spelling_for_serde_and_name() {
        round_trips::<ScheduleKind>();
        round_trips::<SyncMode>();
        round_trips::<ReduceMode>();
        round_trips::<Precision>();
        round_trips::<Task>();
        round_trips::<Loss>();
        round_trips::<OptimizerKind>();
        round_trips::<Engine>();
        round_trips::<RecomputeModule>();
        round_trips::<RecomputeOp>();
        round_trips::<CompileComponent>();
        round_trips::<Fp8Recipe>();
        round_trips::<TrainingPrecision>();
        round_trips::<Fp8Storage>();
        assert_eq!(ScheduleKind::OneFOneB.to_string(), "1f1b");
        assert_eq!(ReduceMode::ParameterServer.name(), "ps");
    }
}

choice! {
    /// What a collective inside a pass does (`crate::in_pass`): one of the plan's collective
    /// kinds, or a ring pass (context parallelism's ring: each member sends to the next
    /// and receives from the one before).
    pub enum PassOp {
        /// Every member ends with the sum (tensor parallelism's `g` and `f`).
        AllReduce = "all_reduce",
        /// Every member ends with every member's values (context parallelism's keys and values).
        AllGather = "all_gather",
        /// Every member ends with the sum of its own part (the gathered keys' gradients).
        ReduceScatter = "reduce_scatter",
        /// Member i sends its j-th part to member j (expert parallelism's exchanges).
        AllToAll = "all_to_all",
        /// To the next member, from the one before (context parallelism's ring).
        RingPass = "ring_pass",
    }
}

choice! {
    /// The group a collective inside a pass runs over, relative to the device and stage of
    /// the pass: the stage's tensor-parallel group of the device's replica, the replicas
    /// (at the device's tensor-parallel rank) its context- or expert-parallel group holds,
    /// or every replica of the stage (ZeRO's shard, the gradients' reduction).
    pub enum PeerDim {
        /// The tensor-parallel ranks of the device's replica.
        Tensor = "tp",
        /// The context-parallel group of the device's replica.
        Context = "cp",
        /// The expert-parallel group of the device's replica.
        Expert = "ep",
        /// The replicas sharing the stage's ZeRO shard (ZeRO-3's weight gathers).
        Shard = "zero",
        /// The replicas reducing the stage's gradients (the reductions of its gradient
        /// buckets: DDP's all-reduces, ZeRO's reduce-scatters into the shards).
        Data = "dp",
    }
}
