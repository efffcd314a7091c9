//! What pricing a layer's kernels needs: the context of a cost model's layer (device,
//! precisions, parallel degrees, attention kernel, FP8) and the running sum of one pass's
//! kernels, each priced on the resource it is bound by (`DeviceModel::matrix_time`,
//! `vector_time`).

use pipec_plan::device::{DeviceModel, Function};
use pipec_plan::engine::performance::{CrossEntropy, KernelFamily, OverlapSteps};
use pipec_plan::plan::Fp8Plan;
use pipec_plan::vocab::{Attention, CpComm, Fp8Storage, Loss, OptimizerKind, Precision};

/// What pricing a layer needs besides the layer.
#[derive(Debug, Clone)]
pub struct CostContext<'a> {
    pub device: &'a DeviceModel,
    pub precision: Precision,
    /// The precision gradients are accumulated in (the optimizer reads them).
    pub grad_precision: Precision,
    /// The precision of the optimizer's moments.
    pub state_precision: Precision,
    /// Whether a low-precision model's optimizer updates fp32 master weights.
    pub master_weights: bool,
    pub optimizer: OptimizerKind,
    pub loss: Loss,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Expert-parallel degree in replicas: each replica holds 1/ep of every expert block's
    /// experts (split over its tensor-parallel ranks like the block, or whole on them).
    pub ep: usize,
    /// `etp: 1` beside tensor parallelism: each routed expert whole on one device, the
    /// group's ep · tp devices each dispatching its sequence share.
    pub whole_experts: bool,
    /// Context-parallel degree: each device computes 1/cp of every sequence's positions
    /// (the load-balanced split: an equal share of the causal attention work too).
    pub cp: usize,
    /// A block's activations split along the sequence outside its tensor-parallel products
    /// (`Spec::sequence_split`: written, and run so by the engine).
    pub sequence_parallel: bool,
    pub attention: Attention,
    /// How context parallelism exchanges keys and values (`cp_comm`).
    pub cp_comm: CpComm,
    /// Seconds a layer's forward costs beyond its kernels (its backward twice that): the
    /// spec's `overhead`, framework work per pass.
    pub overhead: f64,
    /// FP8 training: the blocks' products in FP8 (None without).
    pub fp8: Option<Fp8Plan>,
    /// The share of the matrix rate the engine's fused attention kernel sustains
    /// (`pipec_plan::engine::performance::AttentionKernel`); None: FlashAttention priced as
    /// the device's matrix products.
    pub fused_attention: Option<f64>,
    /// A mixture of experts' routed experts run as one grouped kernel per projection
    /// (torchtitan's `torch._grouped_mm`), not one kernel per expert
    /// (`pipec_plan::engine::performance::KernelFamily::grouped_expert_gemm`).
    pub grouped_experts: bool,
    /// The routed experts' FP8 products' share of a dense FP8 product's speed
    /// (`pipec_plan::engine::performance::Performance::experts`; 1 where none is fitted).
    pub experts_efficiency: f64,
    /// What the engine's kernels keep beyond the operations' operands.
    pub keeps: Keeps,
    /// Tensor parallelism's collectives overlapped with the products by ring exchange
    /// (`tp_overlap`), with the passes the engine runs in `tp` steps; None without.
    pub tp_overlap: Option<OverlapSteps>,
    /// The engine's cross-entropy: what a language model's loss holds.
    pub cross_entropy: Losses,
}

/// The engine's cross-entropy over whole logits and over a vocabulary split by tensor
/// parallelism (`pipec_plan::engine::performance::KernelFamily::cross_entropy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Losses {
    pub whole: CrossEntropy,
    pub split: CrossEntropy,
}

/// What an engine's kernels keep of a block beyond its operations' own operands: the answers
/// of `pipec_plan::engine::performance::KernelFamily` the kept list depends on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Keeps {
    /// A gated activation built of separate autodiff operations
    /// (`KernelFamily::composes_gates`): they keep its intermediate values too.
    pub composed_gates: bool,
    /// The routed experts' activation applies the routing weights
    /// (`KernelFamily::weighs_routes_in_activation`): the combine keeps no expert outputs,
    /// the activation keeps each routed pair's weight.
    pub weights_in_activation: bool,
}

impl Keeps {
    /// What `family` keeps.
    pub fn of(family: KernelFamily) -> Keeps {
        Keeps { composed_gates: family.composes_gates(), weights_in_activation: family.weighs_routes_in_activation() }
    }
}

impl CostContext<'_> {
    /// The devices a layer split `t` ways spreads its routed pairs over: the group's ep
    /// replicas, or with whole experts their ep · t ranks.
    pub fn load_members(&self, t: usize) -> usize {
        if self.whole_experts && t > 1 {
            self.ep.max(1) * t
        } else {
            self.ep.max(1)
        }
    }

    /// Bytes per value a block's linear layers keep of their inputs: FP8 and its scales
    /// where FP8 training keeps them so (Transformer Engine), else the activations' `p`.
    pub fn linear_input_bytes(&self, p: f64) -> f64 {
        match self.fp8 {
            Some(f) if f.activations == Fp8Storage::Fp8 => 1.0 + f.recipe.scale_bytes_per_value(),
            _ => p,
        }
    }

    /// The attention kernel the layers are priced as running: the spec's, except that a
    /// context-parallel ring (`cp_comm: ring`) computes each block's attention with the
    /// online softmax and keeps each row's log-sum-exp, never the [heads, seq, seq]
    /// probabilities — flash attention's memory, and its recompute in the backward. So does
    /// ring attention (Liu et al. 2023, blockwise), Transformer Engine's ring context
    /// parallelism (it runs on its flash and fused attention kernels), and pipec's executor
    /// (`executor/src/ring.rs`).
    pub fn attention_kernel(&self) -> Attention {
        if self.cp > 1 && self.cp_comm == CpComm::Ring {
            Attention::Flash
        } else {
            self.attention
        }
    }
}

/// The kernels of one pass, priced on the device: seconds so far.
pub(crate) struct Kernels<'a> {
    pub(crate) device: &'a DeviceModel,
    pub(crate) precision: Precision,
    pub(crate) p: f64,
    pub(crate) seconds: f64,
}

/// A matrix product: its FLOPs and the values it reads (its input and weights) and writes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Product {
    pub(crate) flops: f64,
    pub(crate) input: f64,
    pub(crate) weights: f64,
    pub(crate) output: f64,
}

impl Product {
    fn values(&self) -> f64 {
        self.input + self.weights + self.output
    }

    /// One of `n` steps over the product's rows: a 1/n share of its FLOPs, input and
    /// output against the whole weights.
    fn step(&self, n: usize) -> Product {
        let n = n.max(1) as f64;
        Product { flops: self.flops / n, input: self.input / n, weights: self.weights, output: self.output / n }
    }
}

impl Kernels<'_> {
    /// A matrix product of `flops` moving `values` values.
    pub(crate) fn matrix(&mut self, flops: f64, values: f64) {
        self.seconds += self.device.matrix_time(flops, values * self.p, self.precision);
    }
    /// FlashAttention's fused kernel of `flops` moving `values` values: at the engine's
    /// attention kernel's published rate where it has one (`share`), else as a product.
    pub(crate) fn fused_attention(&mut self, flops: f64, values: f64, share: Option<f64>) {
        match share {
            Some(share) => {
                self.seconds += self.device.fused_attention_time(flops, values * self.p, self.precision, share)
            }
            None => self.matrix(flops, values),
        }
    }
    /// A block's product: at the training precision, or under FP8 training with FP8
    /// operands — its input cast first to FP8 twice (a row-major copy for this product and
    /// a column-major one the weight gradient reads; Transformer Engine's `cast_transpose`),
    /// one memory-bound kernel reading the input and writing two bytes per value.
    pub(crate) fn product(&mut self, product: Product, fp8: bool) {
        if !fp8 {
            return self.matrix(product.flops, product.values());
        }
        self.seconds += self.device.vector_time(product.input, product.input * (self.p + 2.0));
        self.seconds += self.device.fp8_matrix_time(product.flops, product.values() * self.p);
    }
    /// A block's product run in `n` steps over its rows, each step's product a 1/n share
    /// of its input rows and output against the whole weights (tensor parallelism's
    /// communication overlapped by ring exchange: Transformer Engine's userbuffers, PyTorch's
    /// asynchronous TP), each priced at its own size.
    pub(crate) fn product_in_steps(&mut self, product: Product, fp8: bool, n: usize) {
        let step = product.step(n);
        for _ in 0..n.max(1) {
            self.product(step, fp8);
        }
    }
    /// Runs `kernels` at `efficiency` of what they are priced at: their seconds divided by it.
    pub(crate) fn at_efficiency(&mut self, efficiency: f64, kernels: impl FnOnce(&mut Self)) {
        let before = self.seconds;
        kernels(self);
        self.seconds = before + (self.seconds - before) / efficiency.max(f64::MIN_POSITIVE);
    }
    /// A product's backward: its input gradient and its weight gradient, and under FP8
    /// training the output gradient's cast to FP8 (both layouts).
    pub(crate) fn gradients(&mut self, product: Product, fp8: bool) {
        if fp8 {
            self.seconds += self.device.vector_time(product.output, product.output * (self.p + 2.0));
            self.seconds += 2.0 * self.device.fp8_matrix_time(product.flops, product.values() * self.p);
        } else {
            self.matrix(product.flops, product.values());
            self.matrix(product.flops, product.values());
        }
    }
    /// [`Self::gradients`] with the input gradient in `input` steps and the weight gradient
    /// in `weight` steps over the rows (a split product's passes chunked against their
    /// collectives under ring-exchange overlap), each step priced at its size; 1: whole.
    pub(crate) fn gradients_in_steps(&mut self, product: Product, fp8: bool, (input, weight): (usize, usize)) {
        if input <= 1 && weight <= 1 {
            return self.gradients(product, fp8);
        }
        if fp8 {
            self.seconds += self.device.vector_time(product.output, product.output * (self.p + 2.0));
        }
        for n in [input, weight] {
            let step = product.step(n);
            for _ in 0..n.max(1) {
                if fp8 {
                    self.seconds += self.device.fp8_matrix_time(step.flops, step.values() * self.p);
                } else {
                    self.matrix(step.flops, step.values());
                }
            }
        }
    }
    /// An element-wise kernel of `flops` moving `values` values and `mask` one-byte values.
    pub(crate) fn vector(&mut self, flops: f64, values: f64, mask: f64) {
        self.seconds += self.device.vector_time(flops, values * self.p + mask);
    }
    /// An element-wise kernel applying `f` to `elements` values ([`DeviceModel::function_time`]).
    pub(crate) fn function(&mut self, f: Function, elements: f64, flops: f64, values: f64) {
        self.seconds += self.device.function_time(f, elements, flops, values * self.p);
    }
    /// `f`'s gradient over `elements` values ([`DeviceModel::function_grad_time`]).
    pub(crate) fn function_grad(&mut self, f: Function, elements: f64, flops: f64, values: f64) {
        self.seconds += self.device.function_grad_time(f, elements, flops, values * self.p);
    }
}
