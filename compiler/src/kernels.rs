//! What pricing a layer's kernels needs: the context of a cost model's layer (device,
//! precisions, parallel degrees, attention kernel, FP8) and the running sum of one pass's
//! kernels, each priced on the resource it is bound by (`DeviceModel::matrix_time`,
//! `vector_time`).

use pipec_plan::device::{DeviceModel, Function};
use pipec_plan::engine::performance::{
    AttentionKernel, AttentionPass, Convolution, CrossEntropy, Fp8Casts, KernelFamily, OverlapSteps,
    SequenceCollectives,
};
use pipec_plan::plan::Fp8Plan;
use pipec_plan::vocab::{Attention, CpComm, Fp8Recipe, Fp8Storage, Loss, OptimizerKind, Precision};

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
    /// Seconds a layer's forward costs beyond its kernels: the spec's `overhead` (or the
    /// device file's measured figure), framework work per pass.
    pub overhead: f64,
    /// The same per layer backward (the spec's `overhead` twice, or the device file's).
    pub overhead_backward: f64,
    /// FP8 training: the blocks' products in FP8 (None without).
    pub fp8: Option<Fp8Plan>,
    /// The engine's fused attention kernel's published rates
    /// (`pipec_plan::engine::performance::AttentionKernel`); None: FlashAttention priced as
    /// the device's matrix products.
    pub fused_attention: Option<AttentionKernel>,
    /// A mixture of experts' routed experts run as one grouped kernel per projection
    /// (torchtitan's `torch._grouped_mm`), not one kernel per expert
    /// (`pipec_plan::engine::performance::KernelFamily::grouped_expert_gemm`).
    pub grouped_experts: bool,
    /// The routed experts' products' share of a dense product's speed, where the engine runs
    /// one GEMM per expert FP8 ones at the bf16 rate
    /// (`pipec_plan::engine::performance::Performance::experts`; 1 where none is fitted).
    pub experts_efficiency: f64,
    /// What the engine's kernels keep beyond the operations' operands.
    pub keeps: Keeps,
    /// Tensor parallelism's collectives overlapped with the products by ring exchange
    /// (`tp_overlap`), with the passes the engine runs in `tp` steps; None without.
    pub tp_overlap: Option<OverlapSteps>,
    /// The engine's cross-entropy: what a language model's loss holds.
    pub cross_entropy: Losses,
    /// How the engine runs sequence parallelism's gathers and scatters.
    pub sequence_collectives: SequenceCollectives,
    /// What the engine's FP8 training moves to cast the products' operands.
    pub fp8_casts: Fp8Casts,
    /// How the engine runs a convolution on the device.
    pub convolution: Convolution,
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
    /// Under sequence parallelism a column-split product keeps its gathered input, the whole
    /// sequence, rather than its sequence share
    /// (`KernelFamily::sequence_collectives`: PyTorch's autograd saves it).
    pub gathered_inputs: bool,
    /// The gathered inputs kept are FP8 (torchao's Float8 tensor parallelism gathers FP8).
    pub gathered_fp8: bool,
}

impl Keeps {
    /// What `family` keeps.
    pub fn of(family: KernelFamily) -> Keeps {
        Keeps {
            composed_gates: family.composes_gates(),
            weights_in_activation: family.weighs_routes_in_activation(),
            gathered_inputs: false,
            gathered_fp8: false,
        }
    }
}

impl CostContext<'_> {
    /// Whether sequence parallelism's all-gathers carry FP8 values: where the engine gathers
    /// FP8 under tensorwise scaling.
    pub fn fp8_sequence_gathers(&self) -> bool {
        self.sequence_collectives.fp8_gathers && self.fp8.is_some_and(|f| f.recipe == Fp8Recipe::Tensorwise)
    }

    /// Bytes per value sequence parallelism's all-gathers carry: 1 where they carry FP8,
    /// else the training precision's `p`.
    pub fn sequence_gather_bytes(&self, p: f64) -> f64 {
        if self.fp8_sequence_gathers() {
            1.0
        } else {
            p
        }
    }

    /// What the engine's kernels keep of a block on a rank whose block is split along the
    /// sequence (`sp`): [`Keeps`] with the gathered inputs where the engine keeps them.
    pub fn keeps_of_block(&self, sp: bool) -> Keeps {
        let gathered = sp && self.sequence_collectives.keeps_gathered;
        Keeps { gathered_inputs: gathered, gathered_fp8: gathered && self.fp8_sequence_gathers(), ..self.keeps }
    }

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

    /// The share of the matrix rate the engine's fused attention kernel sustains in `pass`
    /// over a block's `sequence` positions, with the causal mask or not (its published
    /// figures, `AttentionKernel::share`); None where the engine has none on this device.
    /// Under context parallelism each member's kernel runs over its 1/cp of the queries
    /// (the ring's blocks, or the queries against the gathered keys), at that length's rate.
    pub fn attention_share(&self, pass: AttentionPass, causal: bool, sequence: f64) -> Option<f64> {
        self.fused_attention.map(|k| k.share(pass, causal, sequence / self.cp.max(1) as f64))
    }
}

/// The kernels of one pass, priced on the device: seconds so far.
pub(crate) struct Kernels<'a> {
    pub(crate) device: &'a DeviceModel,
    pub(crate) precision: Precision,
    pub(crate) p: f64,
    pub(crate) seconds: f64,
    /// The part of `seconds` that is weight gradients: what a backward split into its input
    /// and weight passes (zero bubble, a later stage sending its gradient first) runs in the
    /// weight pass.
    pub(crate) weights: f64,
    /// Whether products with FP8 operands run at the device's FP8 rate (else at the training
    /// precision's: [`Self::at_training_rate`]).
    pub(crate) fp8_rate: bool,
    /// What casting the operands to FP8 moves (`CostContext::fp8_casts`).
    pub(crate) casts: Fp8Casts,
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

impl<'a> Kernels<'a> {
    /// No kernels yet, on `cx`'s device at its precision (`p` bytes a value).
    pub(crate) fn of(cx: &CostContext<'a>, p: f64) -> Self {
        Kernels {
            device: cx.device,
            precision: cx.precision,
            p,
            seconds: 0.0,
            weights: 0.0,
            fp8_rate: true,
            casts: cx.fp8_casts,
        }
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
    /// a column-major one the weight gradient reads), and its weights where the engine casts
    /// them every pass, each cast memory-bound at the engine's traffic ([`Fp8Casts`]).
    pub(crate) fn product(&mut self, product: Product, fp8: bool) {
        if !fp8 {
            return self.matrix(product.flops, product.values());
        }
        self.weight_cast(product);
        self.fp8_product(product);
    }
    /// An FP8 product after its weights' cast: its input's cast and the product.
    fn fp8_product(&mut self, product: Product) {
        let input = self.casts.input.bytes(self.p);
        self.seconds += self.device.vector_time(product.input, product.input * input);
        self.seconds += self.fp8_matrix_time(product.flops, product.values());
    }
    /// The weights' cast to FP8 where the engine casts them every pass.
    fn weight_cast(&mut self, product: Product) {
        if let Some(w) = self.casts.weights {
            self.seconds += self.device.vector_time(product.weights, product.weights * w.bytes(self.p));
        }
    }
    /// A product with FP8 operands of `flops` moving `values` values: at the FP8 rate, or
    /// inside [`Self::at_training_rate`] at the training precision's.
    fn fp8_matrix_time(&self, flops: f64, values: f64) -> f64 {
        if self.fp8_rate {
            self.device.fp8_matrix_time(flops, values * self.p)
        } else {
            self.device.matrix_time(flops, values * self.p, self.precision)
        }
    }
    /// Runs `kernels` with their FP8 products at the training precision's rate: FP8 operands
    /// (and their casts) that gain nothing from the FP8 rate.
    pub(crate) fn at_training_rate(&mut self, kernels: impl FnOnce(&mut Self)) {
        let rate = std::mem::replace(&mut self.fp8_rate, false);
        kernels(self);
        self.fp8_rate = rate;
    }
    /// A block's product run in `n` steps over its rows, each step's product a 1/n share
    /// of its input rows and output against the whole weights (tensor parallelism's
    /// communication overlapped by ring exchange: Transformer Engine's userbuffers, PyTorch's
    /// asynchronous TP), each priced at its own size.
    pub(crate) fn product_in_steps(&mut self, product: Product, fp8: bool, n: usize) {
        if n <= 1 || !fp8 {
            let step = product.step(n);
            for _ in 0..n.max(1) {
                self.product(step, fp8);
            }
            return;
        }
        // the weights cast once, the input step by step
        self.weight_cast(product);
        let step = product.step(n);
        for _ in 0..n {
            self.fp8_product(step);
        }
    }
    /// Runs `kernels` at `efficiency` of what they are priced at: their seconds divided by it.
    pub(crate) fn at_efficiency(&mut self, efficiency: f64, kernels: impl FnOnce(&mut Self)) {
        let (before, weights) = (self.seconds, self.weights);
        kernels(self);
        let efficiency = efficiency.max(f64::MIN_POSITIVE);
        self.seconds = before + (self.seconds - before) / efficiency;
        self.weights = weights + (self.weights - weights) / efficiency;
    }
    /// Runs `kernels` as weight-gradient work ([`Self::weights`]).
    pub(crate) fn weight_pass(&mut self, kernels: impl FnOnce(&mut Self)) {
        let before = self.seconds;
        kernels(self);
        self.weights += self.seconds - before;
    }
    /// A product's backward: its input gradient and its weight gradient, and under FP8
    /// training the output gradient's cast to FP8 (both layouts).
    pub(crate) fn gradients(&mut self, product: Product, fp8: bool) {
        if fp8 {
            self.grad_output_cast(product);
            let each = self.fp8_matrix_time(product.flops, product.values());
            self.seconds += each;
            self.weight_pass(|k| k.seconds += each);
        } else {
            self.input_gradient(product.flops, product.values());
            self.weight_gradient(product.flops, product.values());
        }
    }
    /// An input gradient's product of `flops` moving `values` values
    /// ([`DeviceModel::input_gradient_time`]).
    pub(crate) fn input_gradient(&mut self, flops: f64, values: f64) {
        self.seconds += self.device.input_gradient_time(flops, values * self.p, self.precision);
    }
    /// A weight gradient's product of `flops` moving `values` values
    /// ([`DeviceModel::weight_gradient_time`]).
    pub(crate) fn weight_gradient(&mut self, flops: f64, values: f64) {
        let seconds = self.device.weight_gradient_time(flops, values * self.p, self.precision);
        self.weight_pass(|k| k.seconds += seconds);
    }
    /// [`Self::gradients`] with the input gradient in `input` steps and the weight gradient
    /// in `weight` steps over the rows (a split product's passes chunked against their
    /// collectives under ring-exchange overlap), each step priced at its size; 1: whole.
    pub(crate) fn gradients_in_steps(&mut self, product: Product, fp8: bool, (input, weight): (usize, usize)) {
        if input <= 1 && weight <= 1 {
            return self.gradients(product, fp8);
        }
        if fp8 {
            self.grad_output_cast(product);
        }
        for (n, weights) in [(input, false), (weight, true)] {
            let step = product.step(n);
            for _ in 0..n.max(1) {
                if fp8 {
                    let seconds = self.fp8_matrix_time(step.flops, step.values());
                    if weights {
                        self.weight_pass(|k| k.seconds += seconds);
                    } else {
                        self.seconds += seconds;
                    }
                } else if weights {
                    self.weight_gradient(step.flops, step.values());
                } else {
                    self.input_gradient(step.flops, step.values());
                }
            }
        }
    }
    /// The output gradient's cast to FP8 (both layouts).
    fn grad_output_cast(&mut self, product: Product) {
        let bytes = self.casts.grad_output.bytes(self.p);
        self.seconds += self.device.vector_time(product.output, product.output * bytes);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole Float8 linear (its forward product and both gradients) against a bf16 one on
    /// the H100 preset at torchtitan's compiled constant, at the two shapes torchao's
    /// README measures (torchao/float8/README.md@567cb46: M, K, N = 4096, 8192, 16384 at 1.39×;
    /// 1024, 2048, 1024 at 0.80×). The model gives 1.56× and 1.10× (docs/benchmarks.md,
    /// "Step times"): above both, the FP8 products' own efficiency unpriced; with Transformer
    /// Engine's casts instead, 1.85× and 1.35×.
    #[test]
    fn a_float8_linears_speedup_at_torchaos_measured_shapes() {
        let mut device = pipec_plan::device::preset("h100-sxm").expect("preset").model();
        let compiled = pipec_plan::engine::performance::CALIBRATED
            .iter()
            .find(|c| c.family == KernelFamily::TorchCompiled && c.device == "h100-sxm")
            .expect("torchtitan's compiled constant on the H100");
        pipec_plan::engine::performance::scale_peaks(&mut device, compiled.efficiency);
        let speedup = |(m, k, n): (f64, f64, f64), family: KernelFamily| {
            let product = Product { flops: 2.0 * m * k * n, input: m * k, weights: k * n, output: m * n };
            let run = |fp8: bool| {
                let casts = family.fp8_casts();
                let mut kernels = Kernels {
                    device: &device,
                    precision: Precision::Bf16,
                    p: 2.0,
                    seconds: 0.0,
                    weights: 0.0,
                    fp8_rate: true,
                    casts,
                };
                kernels.product(product, fp8);
                kernels.gradients(product, fp8);
                kernels.seconds
            };
            run(false) / run(true)
        };
        let (large, small) = ((4096.0, 8192.0, 16384.0), (1024.0, 2048.0, 1024.0));
        let compiled = (speedup(large, KernelFamily::TorchCompiled), speedup(small, KernelFamily::TorchCompiled));
        assert!((compiled.0 - 1.56).abs() < 0.01 && (compiled.1 - 1.10).abs() < 0.01, "{compiled:?}");
        let te = (speedup(large, KernelFamily::MegatronTe), speedup(small, KernelFamily::MegatronTe));
        assert!((te.0 - 1.85).abs() < 0.01 && (te.1 - 1.35).abs() < 0.01, "{te:?}");
    }
}
