//! What one device can do, as the cost model prices work: its matrix throughput per
//! precision, its vector (element-wise) throughput, its memory and memory bandwidth, the
//! fixed cost of a kernel launch, and how close to its peaks a kernel of a given size gets
//! (an efficiency curve per resource). Named presets carry datasheet figures; a spec may
//! override any of them, and `pipec calibrate` measures them on the user's own machine
//! (a device file, JSON of [`DeviceModel`]).
//!
//! Every figure below names its source. Peaks are dense (no structured sparsity), per GPU.
//! The efficiency curves and the launch cost are not datasheet figures: they are the few
//! constants the fidelity benchmark (`pipec-bench fidelity`, docs/benchmarks.md) fits once,
//! the same for every GPU preset and every row.

use serde::{Deserialize, Serialize};

use crate::vocab::{OptimizerKind, Precision};

/// How close to its peak a kernel gets, by its size: `peak · x / (x + half)` for a kernel of
/// `x` FLOPs (matrix) or bytes (memory). Small kernels cannot fill the device; large ones
/// approach `peak`. A saturating curve of two constants, measurable by a sweep of sizes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Curve {
    /// The efficiency of a kernel far larger than `half`, in (0, 1].
    pub peak: f64,
    /// The size at which a kernel reaches half of `peak`.
    pub half: f64,
}

impl Curve {
    /// No size effect: every kernel at `peak`.
    pub const FLAT: Curve = Curve { peak: 1.0, half: 0.0 };

    /// The efficiency of a kernel of size `x`.
    pub fn at(self, x: f64) -> f64 {
        if self.half <= 0.0 {
            return self.peak;
        }
        (self.peak * x / (x + self.half)).max(1e-6)
    }
}

/// Dense matrix-multiply throughput (FLOP/s) per input precision; 0 where the device has no
/// fast path for it (the next wider precision's rate applies).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatrixRates {
    pub fp32: f64,
    pub tf32: f64,
    pub bf16: f64,
    pub fp16: f64,
    pub fp8: f64,
}

impl MatrixRates {
    /// The same rate for every precision (a device described by one throughput).
    pub fn uniform(rate: f64) -> Self {
        MatrixRates { fp32: rate, tf32: rate, bf16: rate, fp16: rate, fp8: rate }
    }

    /// The rate of a product in `precision` (fp32 products run in fp32, not TF32: PyTorch's
    /// default since 1.12).
    pub fn of(self, precision: Precision) -> f64 {
        let rate = match precision {
            Precision::Fp32 => self.fp32,
            Precision::Bf16 => self.bf16,
            Precision::Fp16 => self.fp16,
        };
        if rate > 0.0 {
            rate
        } else {
            self.fp32
        }
    }
}

/// Measured element-wise rates (elements per second, at in-cache sizes) of the functions
/// whose cost is far from their FLOP count on some backends: a CPU evaluates `erf`, `exp`
/// and `tanh` one value at a time in a math library (`pipec calibrate` measured GELU 7×
/// slower than `exp` there). 0: not measured — the function is priced by its FLOPs at
/// the vector rate, as on the presets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Functions {
    /// `exp` (softmax, the cross-entropy's log-sum-exp).
    #[serde(default)]
    pub exp: f64,
    /// GELU, exact (erf) form.
    #[serde(default)]
    pub gelu: f64,
    /// GELU's tanh approximation.
    #[serde(default)]
    pub gelu_tanh: f64,
    /// SiLU x·σ(x) (SwiGLU's gate), and the logistic σ.
    #[serde(default)]
    pub silu: f64,
    /// tanh.
    #[serde(default)]
    pub tanh: f64,
    /// The gradients of GELU, GELU-tanh, SiLU and tanh as the backend's backward computes
    /// them (from their input and the incoming gradient), elements per second; 0: not
    /// measured — GELU's priced as its function again, tanh's and the logistic's by FLOPs.
    #[serde(default)]
    pub gelu_grad: f64,
    #[serde(default)]
    pub gelu_tanh_grad: f64,
    #[serde(default)]
    pub silu_grad: f64,
    #[serde(default)]
    pub tanh_grad: f64,
    /// A gated unit's activation act(gate)·up (SwiGLU's SiLU, GeGLU's GELU) as the backend
    /// runs it (the CPU executor's one fused kernel), elements of its output per second,
    /// and its gradient's (both halves'); 0: not measured — priced as the gate's function
    /// over the output's elements.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub silu_gated: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gelu_gated: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub silu_gated_grad: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gelu_gated_grad: f64,
    /// The cross-entropy over logits as the backend runs it (the CPU executor's one fused
    /// kernel: the maximum, exponentials and their sum, the softmax kept), logits per
    /// second, and its gradient's; 0: not measured — priced as `exp` over the logits, and
    /// the gradient by its FLOPs and bytes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cross_entropy: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cross_entropy_grad: f64,
}

/// Whether a rate is absent (not measured): it is then left out of a device file.
fn is_zero(rate: &f64) -> bool {
    *rate == 0.0
}

impl Functions {
    /// Every rate, in the order of the fields.
    pub fn rates(&self) -> [f64; 15] {
        let mut f = *self;
        f.rates_mut().map(|r| *r)
    }

    /// Every rate to set, in the order of the fields.
    pub fn rates_mut(&mut self) -> [&mut f64; 15] {
        let Functions {
            exp,
            gelu,
            gelu_tanh,
            silu,
            tanh,
            gelu_grad,
            gelu_tanh_grad,
            silu_grad,
            tanh_grad,
            silu_gated,
            gelu_gated,
            silu_gated_grad,
            gelu_gated_grad,
            cross_entropy,
            cross_entropy_grad,
        } = self;
        [
            exp,
            gelu,
            gelu_tanh,
            silu,
            tanh,
            gelu_grad,
            gelu_tanh_grad,
            silu_grad,
            tanh_grad,
            silu_gated,
            gelu_gated,
            silu_gated_grad,
            gelu_gated_grad,
            cross_entropy,
            cross_entropy_grad,
        ]
    }

    /// Whether nothing was measured.
    pub fn is_empty(&self) -> bool {
        *self == Functions::default()
    }
}

/// A function [`Functions`] can price.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Function {
    Exp,
    Gelu,
    GeluTanh,
    Silu,
    Tanh,
    /// A gated unit's activation over its output's elements: SiLU's (SwiGLU), GELU's
    /// (GeGLU).
    SiluGated,
    GeluGated,
    /// The cross-entropy over logits (its forward: the softmax and the loss; its gradient:
    /// the softmax minus the one-hot target).
    CrossEntropy,
}

impl Function {
    /// What a kernel measured as one piece is priced as on a device that has not measured
    /// it: a gated unit's activation as its gate's function, the cross-entropy as `exp`
    /// over the logits (and its gradient as `exp`'s, by FLOPs and bytes); None for the
    /// functions themselves.
    fn unmeasured(self) -> Option<Function> {
        match self {
            Function::SiluGated => Some(Function::Silu),
            Function::GeluGated => Some(Function::Gelu),
            Function::CrossEntropy => Some(Function::Exp),
            Function::Exp | Function::Gelu | Function::GeluTanh | Function::Silu | Function::Tanh => None,
        }
    }
}

/// One device as the cost model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceModel {
    /// The preset's name, or a user's label.
    pub name: String,
    /// Bytes of device memory.
    pub memory: f64,
    pub matrix: MatrixRates,
    /// Element-wise throughput (FLOP/s) of the general-purpose cores, in fp32.
    pub vector: f64,
    /// Device-memory bandwidth (bytes/s); infinite where the spec gives none (element-wise
    /// work is then priced by its FLOPs alone).
    pub memory_bandwidth: f64,
    /// Seconds every kernel costs before any work (launch and framework dispatch).
    pub launch: f64,
    /// Matrix products' efficiency by their FLOPs.
    pub matrix_efficiency: Curve,
    /// Memory-bound kernels' efficiency by the bytes they move.
    pub memory_efficiency: Curve,
    /// Measured rates of element-wise functions (`pipec calibrate`); empty on the presets.
    #[serde(default, skip_serializing_if = "Functions::is_empty")]
    pub functions: Functions,
    /// The transport between the executor's workers as `pipec calibrate --concurrent N`
    /// measured it (N ≥ 2); a spec's link level reads it with `{ file: FILE }`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<MeasuredLink>,
    /// The executor's optimizer updates as `pipec calibrate` measured them (None on the
    /// presets: an update is priced as the memory traffic it is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerRates>,
    /// How a matrix product's operands move as training runs it, where `pipec calibrate`
    /// measured it (the CPU); None on the presets, whose products cost the slower of their
    /// compute and their memory traffic (the roofline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product_traffic: Option<Traffic>,
    /// An element-wise kernel's bytes beyond the cache, where `pipec calibrate` measured
    /// them moving slower than those within it (the CPU, [`Traffic`]); None: every byte at
    /// [`memory_bandwidth`](Self::memory_bandwidth) on its curve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_traffic: Option<Traffic>,
    /// Attention (its heads split from the projection, scores, softmax, weighted sum, the
    /// heads merged back) as the executor runs it, where `pipec calibrate` measured it (the
    /// CPU); None on the presets, whose attention is priced kernel by kernel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionRates>,
    /// The power cap the device runs at, W (`cluster.device: { preset, power: 500W }`);
    /// None: its full power. Its rates are already at the clock that cap sustains
    /// (`Preset::model_at`); the cap also names the device kind an engine's calibrated
    /// constant is for (`crate::engine::performance`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<f64>,
    /// Seconds of pipec's executor's own work per layer forward that
    /// its kernels do not show, as `pipec calibrate` fitted it on the CPU
    /// (`this_cpu::layer_overhead`); None on the presets. A spec on this device without an
    /// `overhead` of its own plans with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_pass: Option<f64>,
    /// The same per layer backward, where `pipec calibrate` measured it apart from the
    /// forward's; None: twice [`layer_pass`](Self::layer_pass).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_pass_backward: Option<f64>,
    /// Seconds of pipec's executor's own work a step beside its instructions, on each
    /// worker (the step's report and fence, the next step's start), as `pipec calibrate`
    /// measured it between the steps of its embedded run (`this_cpu::layer_overhead`):
    /// 21–34 µs a step on a 2-core Xeon, 5–8% of `specs/csv-classifier.yaml`'s step
    /// (docs/benchmarks.md, 2026-12-08). Every step of a plan on this device is that much
    /// longer; None (the presets): nothing is added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_pass: Option<f64>,
    /// The executor's weight gradients (a linear layer's, its bias's with it) as products
    /// of their own, where `pipec calibrate` timed them apart from the forwards (the CPU):
    /// the `gemm` kernel reads a weight gradient's left operand, the layer's input,
    /// transposed, and adds into the step's sum, 0.6–1.3 times a forward of the same size
    /// by shape from 32 · 256 · 256 up on a 2-core Xeon (docs/benchmarks.md, "The weight
    /// gradients timed as a step adds them"). None (the presets): a weight gradient
    /// is priced as any product of its size
    /// ([`weight_gradient_time`](Self::weight_gradient_time)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_gradient: Option<ProductFit>,
    /// The executor's input gradients (a linear layer's `dy · Wᵀ`, with the bias's gradient
    /// and the autodiff's work) as products of their own, where `pipec calibrate` timed the
    /// layers' backwards split (the CPU): 0.7–0.8 of a forward of the same size in a running
    /// step on a 2-core Xeon (docs/benchmarks.md, "A split backward priced as the executor
    /// splits it"). None (the presets, and device files measured before): an input gradient
    /// is priced as any product of its size
    /// ([`input_gradient_time`](Self::input_gradient_time)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_gradient: Option<ProductFit>,
    /// pipec's executor drawing synthetic data as training runs, as `pipec calibrate`
    /// measured it (the CPU); None on the presets, whose data loading is not priced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DrawRates>,
}

/// Seconds pipec's executor takes per value it draws for synthetic data
/// (`crate::plan::SampleDraw`): a normal input value (Box–Muller in f64), a token, a term of
/// the teacher's scores.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrawRates {
    pub feature: f64,
    pub token: f64,
    pub score: f64,
}

impl DrawRates {
    /// Seconds of a draw of `features` values, `tokens` tokens and `scores` score terms.
    pub fn seconds(&self, (features, tokens, scores): (usize, usize, usize)) -> f64 {
        features as f64 * self.feature + tokens as f64 * self.token + scores as f64 * self.score
    }

    fn is_valid(&self) -> bool {
        [self.feature, self.token, self.score].iter().all(|v| v.is_finite() && *v >= 0.0)
    }
}

/// Attention's forward and backward as `pipec calibrate` fits them over a sweep of shapes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionRates {
    pub forward: AttentionFit,
    pub backward: AttentionFit,
}

/// Seconds of one attention pass over `bh` heads (batch × heads) of `s` positions and `dh`
/// features each: `per_call + per_mac·bh·s²·dh + per_score·bh·s² + per_value·bh·s·dh` — a
/// fixed part, the products' multiply-adds, the scores' element-wise work and the head
/// copies.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionFit {
    pub per_call: f64,
    pub per_mac: f64,
    pub per_score: f64,
    pub per_value: f64,
}

impl AttentionFit {
    /// The terms a pass of `bh` heads of `s` positions and `dh` features is linear in.
    pub fn terms(bh: f64, s: f64, dh: f64) -> [f64; 4] {
        [1.0, bh * s * s * dh, bh * s * s, bh * s * dh]
    }

    /// Seconds of that pass.
    pub fn seconds(&self, bh: f64, s: f64, dh: f64) -> f64 {
        let [one, macs, scores, values] = Self::terms(bh, s, dh);
        self.per_call * one + self.per_mac * macs + self.per_score * scores + self.per_value * values
    }

    fn is_valid(&self) -> bool {
        [self.per_call, self.per_mac, self.per_score, self.per_value].iter().all(|v| v.is_finite() && *v >= 0.0)
    }
}

/// A kernel's traffic beyond the cache, as `pipec calibrate` fits it on the CPU.
/// - A product's operands ([`DeviceModel::product_traffic`], [`DeviceModel::weight_gradient`]),
///   fitted to stacks of layers run as a step runs them (weights and their gradients' sums
///   that do not all stay in cache): a product of `bytes` operands costs the
///   [`norm`](Self::norm) of its compute and `(bytes − cached) / bandwidth`; its first
///   `cached` bytes cost nothing.
/// - An element-wise kernel's bytes ([`DeviceModel::memory_traffic`]), fitted to the adds:
///   its first `cached` bytes move at the memory curve's rate, the rest at `bandwidth`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Traffic {
    /// Bytes per second beyond the cache.
    pub bandwidth: f64,
    /// Bytes held in cache.
    pub cached: f64,
    /// How a product's compute and this traffic combine: the `p` of their p-norm, from 1,
    /// where they add (the forward's `gemm` packs the weight before it multiplies: on the
    /// 2-core Xeon, 2026-12-07, 1 fitted the layers 3–5 times closer than 2), to 2, where they
    /// overlap in part (files written before then hold 2). An element-wise kernel's traffic
    /// ([`DeviceModel::memory_traffic`]) has no compute to combine with and keeps 2.
    #[serde(default = "Traffic::overlapping", skip_serializing_if = "Traffic::is_overlapping")]
    pub norm: f64,
}

impl Traffic {
    /// The norm of files written before the norm was fitted.
    pub const OVERLAPPING: f64 = 2.0;

    /// Traffic of `bandwidth` beyond `cached` bytes, combined with compute by the 2-norm.
    pub const fn new(bandwidth: f64, cached: f64) -> Traffic {
        Traffic { bandwidth, cached, norm: Self::OVERLAPPING }
    }

    fn overlapping() -> f64 {
        Self::OVERLAPPING
    }

    fn is_overlapping(norm: &f64) -> bool {
        *norm == Self::OVERLAPPING
    }

    /// `compute` and `traffic` seconds combined by the [`norm`](Self::norm).
    pub fn combine(&self, compute: f64, traffic: f64) -> f64 {
        if self.norm == Self::OVERLAPPING {
            compute.hypot(traffic)
        } else if self.norm == 1.0 {
            compute + traffic
        } else {
            (compute.powf(self.norm) + traffic.powf(self.norm)).powf(1.0 / self.norm)
        }
    }

    fn is_valid(&self) -> bool {
        self.bandwidth.is_finite()
            && self.bandwidth > 0.0
            && self.cached.is_finite()
            && self.cached >= 0.0
            && (1.0..=Self::OVERLAPPING).contains(&self.norm)
    }
}

/// A product as `pipec calibrate` measures the executor's on the CPU: of `flops` moving
/// `bytes`, the launch plus its compute, at `rate` on an efficiency curve that reaches half
/// of it at `half` FLOPs, and its operands' `traffic` beyond the cache, combined by the
/// traffic's norm. The
/// device's own products take this form where it has [`DeviceModel::product_traffic`], its
/// weight gradients where it has [`DeviceModel::weight_gradient`], and `pipec calibrate`
/// fits both by it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProductFit {
    /// fp32 FLOP/s.
    pub rate: f64,
    /// FLOPs at which the rate is half reached.
    pub half: f64,
    pub traffic: Traffic,
}

impl ProductFit {
    /// Seconds beyond the launch of a product of `flops` moving `bytes`, its curve's peak at
    /// `speed` times the rate.
    pub fn seconds(&self, flops: f64, bytes: f64, speed: f64) -> f64 {
        let compute = flops / (self.rate * Curve { peak: speed, half: self.half }.at(flops));
        self.traffic.combine(compute, (bytes - self.traffic.cached).max(0.0) / self.traffic.bandwidth)
    }

    fn is_valid(&self) -> bool {
        self.rate.is_finite() && self.rate > 0.0 && self.half.is_finite() && self.half >= 0.0 && self.traffic.is_valid()
    }
}

/// Measured optimizer updates, per optimizer (AdamW priced as Adam).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerRates {
    pub sgd: UpdateRate,
    pub momentum: UpdateRate,
    pub adam: UpdateRate,
}

/// One optimizer's update: seconds per parameter tensor (its kernels' launches and the
/// framework's work per tensor) and per parameter.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateRate {
    pub per_tensor: f64,
    pub per_parameter: f64,
}

impl OptimizerRates {
    /// The rate of `kind`'s update.
    pub fn of(&self, kind: OptimizerKind) -> UpdateRate {
        match kind {
            OptimizerKind::Sgd => self.sgd,
            OptimizerKind::Momentum => self.momentum,
            OptimizerKind::Adam | OptimizerKind::AdamW => self.adam,
        }
    }
}

/// A link as measured between workers: point-to-point messages fitted as
/// `latency + bytes / bandwidth`, ring all-reduces as the cost model's
/// `2(p−1)·latency + 2(p−1)/p · bytes / (bandwidth · efficiency)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredLink {
    /// Bytes per second of a point-to-point message.
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
    /// The all-reduce's bus bandwidth over `bandwidth`, in (0, 1].
    pub efficiency: f64,
}

/// Whether a device model's name is a CPU's: a spec's `kind: cpu`, or a device file `pipec
/// calibrate` measured on the CPU backend (named `cpu (pipec calibrate…)`).
pub fn names_a_cpu(name: &str) -> bool {
    name.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("cpu"))
}

impl DeviceModel {
    /// Whether its figures are a machine's own as `pipec calibrate` measured them on the
    /// CPU (a device file with the products' measured operand traffic), not a datasheet's.
    pub fn measured(&self) -> bool {
        names_a_cpu(&self.name) && self.product_traffic.is_some()
    }

    /// Seconds of pipec's executor's own work per layer forward and per layer backward
    /// ([`layer_pass`](Self::layer_pass), [`layer_pass_backward`](Self::layer_pass_backward):
    /// twice the forward's where the backward's was not measured apart; 0 where neither was).
    pub fn layer_overheads(&self) -> (f64, f64) {
        let forward = self.layer_pass.unwrap_or(0.0);
        (forward, self.layer_pass_backward.unwrap_or(2.0 * forward))
    }

    /// Seconds of the executor's own work a step beside its instructions
    /// ([`step_pass`](Self::step_pass); 0 where it was not measured).
    pub fn step_overhead(&self) -> f64 {
        self.step_pass.unwrap_or(0.0)
    }

    /// Seconds of a weight gradient's product of `flops` moving `bytes` in `precision`: where
    /// the device measured the executor's ([`weight_gradient`](Self::weight_gradient)), as
    /// that fit prices it (at the precision's rate against fp32's); elsewhere
    /// [`matrix_time`](Self::matrix_time).
    pub fn weight_gradient_time(&self, flops: f64, bytes: f64, precision: Precision) -> f64 {
        self.gradient_time(self.weight_gradient, flops, bytes, precision)
    }

    /// [`weight_gradient_time`](Self::weight_gradient_time) for an input gradient's product,
    /// by [`input_gradient`](Self::input_gradient) where the device measured it.
    pub fn input_gradient_time(&self, flops: f64, bytes: f64, precision: Precision) -> f64 {
        self.gradient_time(self.input_gradient, flops, bytes, precision)
    }

    /// A gradient's product priced by `fit` (at the precision's rate against fp32's), else
    /// as any product of its size.
    fn gradient_time(&self, fit: Option<ProductFit>, flops: f64, bytes: f64, precision: Precision) -> f64 {
        match fit {
            Some(w) if flops > 0.0 || bytes > 0.0 => {
                self.launch
                    + w.seconds(flops, bytes, self.matrix.of(precision) / self.matrix.fp32.max(f64::MIN_POSITIVE))
            }
            Some(_) => 0.0,
            None => self.matrix_time(flops, bytes, precision),
        }
    }

    /// The executor's own work on this machine `speed` times as fast as `pipec calibrate`
    /// measured it: the element-wise and function rates, the launch, the products' and
    /// element-wise kernels' bytes beyond the cache, attention, the optimizer's updates, the
    /// work per layer pass and the synthetic draws. Not the efficiency curves' peaks, which
    /// [`crate::engine::performance::scale_peaks`] scales, nor the link between workers.
    pub fn run_faster(&mut self, speed: f64) {
        // every field named: a new figure says here whether it is the executor's own work
        let DeviceModel {
            name: _,
            memory: _,
            matrix: _,
            vector,
            memory_bandwidth: _,
            launch,
            matrix_efficiency: _,
            memory_efficiency: _,
            functions,
            link: _,
            optimizer,
            product_traffic,
            memory_traffic,
            attention,
            power: _,
            layer_pass,
            layer_pass_backward,
            step_pass,
            weight_gradient,
            input_gradient,
            data,
        } = self;
        let mut rates = vec![vector];
        rates.extend(functions.rates_mut());
        rates.extend([product_traffic, memory_traffic].into_iter().flatten().map(|t| &mut t.bandwidth));
        for ProductFit { rate, half: _, traffic } in [weight_gradient, input_gradient].into_iter().flatten() {
            rates.extend([rate, &mut traffic.bandwidth]);
        }
        for rate in rates {
            *rate *= speed;
        }
        let mut seconds: Vec<&mut f64> = vec![launch];
        if let Some(OptimizerRates { sgd, momentum, adam }) = optimizer {
            for u in [sgd, momentum, adam] {
                seconds.extend([&mut u.per_tensor, &mut u.per_parameter]);
            }
        }
        if let Some(AttentionRates { forward, backward }) = attention {
            for f in [forward, backward] {
                seconds.extend([&mut f.per_call, &mut f.per_mac, &mut f.per_score, &mut f.per_value]);
            }
        }
        if let Some(DrawRates { feature, token, score }) = data {
            seconds.extend([feature, token, score]);
        }
        seconds.extend(layer_pass.iter_mut().chain(layer_pass_backward.iter_mut()).chain(step_pass.iter_mut()));
        for s in seconds {
            *s /= speed;
        }
    }

    /// A device known only by one throughput: every kernel's FLOPs at that rate, no memory
    /// bound, no size effect, no launch cost (what a spec's `throughput` alone says).
    pub fn uniform(name: &str, memory: f64, throughput: f64) -> Self {
        DeviceModel {
            name: name.to_string(),
            memory,
            matrix: MatrixRates::uniform(throughput),
            vector: throughput,
            memory_bandwidth: f64::INFINITY,
            launch: 0.0,
            matrix_efficiency: Curve::FLAT,
            memory_efficiency: Curve::FLAT,
            functions: Functions::default(),
            link: None,
            optimizer: None,
            product_traffic: None,
            memory_traffic: None,
            attention: None,
            power: None,
            layer_pass: None,
            layer_pass_backward: None,
            step_pass: None,
            weight_gradient: None,
            input_gradient: None,
            data: None,
        }
    }

    /// Reads a device file (JSON of this type), checking every figure.
    pub fn from_json(text: &str) -> Result<DeviceModel, String> {
        let d: DeviceModel = serde_json::from_str(text).map_err(|e| format!("not a device file: {e}"))?;
        let m = &d.matrix;
        let positive = [d.memory, m.fp32, d.vector, d.memory_bandwidth];
        let mut non_negative =
            vec![m.tf32, m.bf16, m.fp16, m.fp8, d.launch, d.matrix_efficiency.half, d.memory_efficiency.half];
        non_negative.extend(d.functions.rates());
        if positive.iter().any(|v| v.is_nan() || *v <= 0.0) || non_negative.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(
                "every figure must be positive (memory, fp32 and vector rates, bandwidth) or not negative".into()
            );
        }
        for c in [d.matrix_efficiency, d.memory_efficiency] {
            if !(c.peak > 0.0 && c.peak <= 1.0) {
                return Err(format!("an efficiency's peak must be in (0, 1], found {}", c.peak));
            }
        }
        if let Some(l) = d.link {
            if !(l.bandwidth > 0.0
                && l.latency >= 0.0
                && l.latency.is_finite()
                && l.efficiency > 0.0
                && l.efficiency <= 1.0)
            {
                return Err(format!(
                    "the link needs a positive bandwidth, a latency of 0 or more and an efficiency in (0, 1], found {l:?}"
                ));
            }
        }
        for (what, t) in [("products'", d.product_traffic), ("element-wise kernels'", d.memory_traffic)] {
            if let Some(t) = t.filter(|t| !t.is_valid()) {
                return Err(format!(
                    "the {what} traffic needs a positive bandwidth, cached bytes of 0 or more and a norm in [1, 2], found {t:?}"
                ));
            }
        }
        if let Some(a) = d.attention {
            if !(a.forward.is_valid() && a.backward.is_valid()) {
                return Err(format!("the attention's figures must be finite and not negative, found {a:?}"));
            }
        }
        if let Some(r) = d.data.filter(|r| !r.is_valid()) {
            return Err(format!("the synthetic data's draw needs finite seconds of 0 or more per value, found {r:?}"));
        }
        for (what, fit) in [("weight", d.weight_gradient), ("input", d.input_gradient)] {
            if let Some(w) = fit.filter(|w| !w.is_valid()) {
                return Err(format!(
                    "the {what} gradients' fit needs a positive rate and bandwidth and a half and cached bytes of 0 or more, found {w:?}"
                ));
            }
        }
        for (what, s) in
            [("layer backward", d.layer_pass_backward), ("layer pass", d.layer_pass), ("step", d.step_pass)]
        {
            if s.is_some_and(|s| !(s.is_finite() && s >= 0.0)) {
                return Err(format!("the executor's work per {what} must be finite and not negative, found {s:?}"));
            }
        }
        if let Some(o) = d.optimizer {
            if [o.sgd, o.momentum, o.adam].iter().any(|r| {
                !(r.per_tensor.is_finite()
                    && r.per_tensor >= 0.0
                    && r.per_parameter.is_finite()
                    && r.per_parameter >= 0.0)
            }) {
                return Err(format!("the optimizer's rates must be finite and not negative, found {o:?}"));
            }
        }
        Ok(d)
    }

    /// Seconds of one `kind` update of `parameters` in `tensors` tensors, each parameter
    /// moving `bytes_per_parameter` through memory: at the measured rate where the device
    /// file has one, else that memory traffic.
    pub fn update_time(&self, kind: OptimizerKind, tensors: usize, parameters: f64, bytes_per_parameter: f64) -> f64 {
        if parameters <= 0.0 {
            return 0.0;
        }
        match self.optimizer.map(|o| o.of(kind)) {
            Some(r) => tensors as f64 * r.per_tensor + parameters * r.per_parameter,
            None => self.memory_time(parameters * bytes_per_parameter),
        }
    }

    /// Seconds of a matrix product of `flops` reading and writing `bytes`, in `precision`,
    /// plus a launch: the slower of its compute and its memory traffic, or, with a measured
    /// [`product_traffic`](Self::product_traffic), its compute and its traffic beyond the
    /// cache combined by that traffic's norm.
    pub fn matrix_time(&self, flops: f64, bytes: f64, precision: Precision) -> f64 {
        self.product_time(flops, bytes, self.matrix.of(precision))
    }

    /// Seconds of a fused attention kernel of `flops` moving `bytes` in `precision` that
    /// sustains `share` of the device's matrix rate (a published kernel's throughput,
    /// `crate::engine::performance::AttentionKernel`), or its memory traffic, the slower.
    pub fn fused_attention_time(&self, flops: f64, bytes: f64, precision: Precision, share: f64) -> f64 {
        if flops <= 0.0 && bytes <= 0.0 {
            return 0.0;
        }
        let rate = self.matrix.of(precision) * share;
        self.launch + (flops / rate).max(self.memory_time(bytes))
    }

    /// [`matrix_time`](Self::matrix_time) of a product with FP8 operands: at the FP8 rate
    /// (the bf16 one on a device without FP8 products).
    pub fn fp8_matrix_time(&self, flops: f64, bytes: f64) -> f64 {
        let rate = if self.matrix.fp8 > 0.0 { self.matrix.fp8 } else { self.matrix.of(Precision::Bf16) };
        self.product_time(flops, bytes, rate)
    }

    /// A product of `flops` moving `bytes` at `rate` FLOP/s at its size's efficiency.
    fn product_time(&self, flops: f64, bytes: f64, rate: f64) -> f64 {
        if flops <= 0.0 && bytes <= 0.0 {
            return 0.0;
        }
        match self.product_traffic {
            Some(traffic) => {
                let product = ProductFit { rate, half: self.matrix_efficiency.half, traffic };
                self.launch + product.seconds(flops, bytes, self.matrix_efficiency.peak)
            }
            None => self.launch + (flops / (rate * self.matrix_efficiency.at(flops))).max(self.memory_time(bytes)),
        }
    }

    /// Seconds of an element-wise kernel of `flops` moving `bytes`: the slower of its vector
    /// work and its memory traffic, plus a launch.
    pub fn vector_time(&self, flops: f64, bytes: f64) -> f64 {
        if flops <= 0.0 && bytes <= 0.0 {
            return 0.0;
        }
        self.launch + (flops / self.vector).max(self.memory_time(bytes))
    }

    /// Seconds of an element-wise kernel applying `function` to `elements` values (`flops`
    /// in all), moving `bytes`: with a measured rate for the function, its elements at that
    /// rate (the measured kernel's whole work) or its memory traffic, the slower; without,
    /// as [`vector_time`](Self::vector_time) prices its FLOPs.
    pub fn function_time(&self, function: Function, elements: f64, flops: f64, bytes: f64) -> f64 {
        let f = &self.functions;
        let rate = match function {
            Function::Exp => f.exp,
            Function::Gelu => f.gelu,
            Function::GeluTanh => f.gelu_tanh,
            Function::Silu => f.silu,
            Function::Tanh => f.tanh,
            Function::SiluGated => f.silu_gated,
            Function::GeluGated => f.gelu_gated,
            Function::CrossEntropy => f.cross_entropy,
        };
        match function.unmeasured().filter(|_| rate <= 0.0) {
            Some(f) => self.function_time(f, elements, flops, bytes),
            None => self.at_rate(rate, elements, flops, bytes),
        }
    }

    /// Seconds of `function`'s gradient over `elements` values (`flops` in all), moving
    /// `bytes`: at its measured gradient rate where there is one, else as GELU's function
    /// again (its gradient evaluates it) and the others' FLOPs ([`vector_time`](Self::vector_time)).
    pub fn function_grad_time(&self, function: Function, elements: f64, flops: f64, bytes: f64) -> f64 {
        let f = &self.functions;
        let rate = match function {
            Function::Exp => 0.0,
            Function::Gelu => f.gelu_grad,
            Function::GeluTanh => f.gelu_tanh_grad,
            Function::Silu => f.silu_grad,
            Function::Tanh => f.tanh_grad,
            Function::SiluGated => f.silu_gated_grad,
            Function::GeluGated => f.gelu_gated_grad,
            Function::CrossEntropy => f.cross_entropy_grad,
        };
        if let Some(f) = function.unmeasured().filter(|_| rate <= 0.0) {
            return self.function_grad_time(f, elements, flops, bytes);
        }
        match function {
            Function::Gelu | Function::GeluTanh if rate <= 0.0 => self.function_time(function, elements, flops, bytes),
            _ => self.at_rate(rate, elements, flops, bytes),
        }
    }

    /// `elements` at `rate` or the memory traffic, the slower, plus a launch; without a
    /// rate, the FLOPs at the vector rate.
    fn at_rate(&self, rate: f64, elements: f64, flops: f64, bytes: f64) -> f64 {
        if rate <= 0.0 || elements <= 0.0 {
            return self.vector_time(flops, bytes);
        }
        self.launch + (elements / rate).max(self.memory_time(bytes))
    }

    /// Seconds to move `bytes` through device memory at the efficiency of a kernel that
    /// size; with a measured [`memory_traffic`](Self::memory_traffic), the bytes beyond its
    /// cache at its bandwidth.
    pub fn memory_time(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 || !self.memory_bandwidth.is_finite() {
            return 0.0;
        }
        let (within, beyond) = match self.memory_traffic {
            Some(t) => (bytes.min(t.cached), (bytes - t.cached).max(0.0) / t.bandwidth),
            None => (bytes, 0.0),
        };
        within / (self.memory_bandwidth * self.memory_efficiency.at(bytes)) + beyond
    }
}

/// The kernel-size efficiency and launch cost every GPU preset shares: the constants the
/// fidelity benchmark fits once against published A100 runs (docs/benchmarks.md, "Fidelity");
/// not datasheet figures.
pub const GPU_MATRIX_EFFICIENCY: Curve = Curve { peak: 0.75, half: 1.0e10 };
pub const GPU_MEMORY_EFFICIENCY: Curve = Curve { peak: 0.70, half: 2.0e6 };
pub const GPU_LAUNCH: f64 = 4.0e-6;

const GB: f64 = 1e9;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const T: f64 = 1e12;

/// A named device preset: its figures and where they come from.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    pub name: &'static str,
    /// The datasheet the figures come from.
    pub source: &'static str,
    /// GiB of memory.
    pub memory_gib: f64,
    /// Dense matrix TFLOP/s: fp32, tf32, bf16, fp16, fp8 (0: no fast path).
    pub matrix_tflops: [f64; 5],
    /// Element-wise fp32 TFLOP/s.
    pub vector_tflops: f64,
    /// Memory bandwidth, GB/s.
    pub memory_gbps: f64,
    /// The board's maximum power (the datasheet's TDP), W: the clock the rates assume.
    pub tdp_w: f64,
}

/// The device presets a spec can name (`cluster.device: a100-80gb`).
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "v100-16gb",
        tdp_w: 300.0,
        source: "NVIDIA Tesla V100 datasheet (SXM2): 15.7 TFLOP/s fp32, 125 TFLOP/s fp16 tensor, 900 GB/s HBM2",
        memory_gib: 16.0,
        matrix_tflops: [15.7, 0.0, 0.0, 125.0, 0.0],
        vector_tflops: 15.7,
        memory_gbps: 900.0,
    },
    Preset {
        name: "v100-32gb",
        tdp_w: 300.0,
        source: "NVIDIA Tesla V100 datasheet (SXM2): 15.7 TFLOP/s fp32, 125 TFLOP/s fp16 tensor, 900 GB/s HBM2",
        memory_gib: 32.0,
        matrix_tflops: [15.7, 0.0, 0.0, 125.0, 0.0],
        vector_tflops: 15.7,
        memory_gbps: 900.0,
    },
    Preset {
        name: "a100-40gb",
        tdp_w: 400.0,
        source: "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB): 19.5 fp32, 156 tf32, 312 bf16/fp16 TFLOP/s, 1,555 GB/s HBM2",
        memory_gib: 40.0,
        matrix_tflops: [19.5, 156.0, 312.0, 312.0, 0.0],
        vector_tflops: 19.5,
        memory_gbps: 1555.0,
    },
    Preset {
        name: "a100-80gb",
        tdp_w: 400.0,
        source: "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 19.5 fp32, 156 tf32, 312 bf16/fp16 TFLOP/s, 2,039 GB/s HBM2e",
        memory_gib: 80.0,
        matrix_tflops: [19.5, 156.0, 312.0, 312.0, 0.0],
        vector_tflops: 19.5,
        memory_gbps: 2039.0,
    },
    Preset {
        name: "h100-sxm",
        tdp_w: 700.0,
        source: "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 67 fp32, 494.7 tf32, 989.4 bf16/fp16, 1,978.9 fp8 TFLOP/s dense, 3.35 TB/s HBM3, 80 GB",
        memory_gib: 80.0,
        matrix_tflops: [67.0, 494.7, 989.4, 989.4, 1978.9],
        vector_tflops: 67.0,
        memory_gbps: 3350.0,
    },
    Preset {
        name: "h100-pcie",
        tdp_w: 350.0,
        source: "NVIDIA H100 Tensor Core GPU datasheet (PCIe): 51 fp32, 378 tf32, 756 bf16/fp16, 1,513 fp8 TFLOP/s dense, 2 TB/s HBM2e, 80 GB",
        memory_gib: 80.0,
        matrix_tflops: [51.0, 378.0, 756.0, 756.0, 1513.0],
        vector_tflops: 51.0,
        memory_gbps: 2000.0,
    },
    Preset {
        name: "h100-nvl",
        tdp_w: 400.0,
        source: "NVIDIA H100 Tensor Core GPU datasheet (H100 NVL, per GPU): 60 fp32, 835 tf32, 1,671 bf16/fp16, 3,341 fp8 TFLOP/s with sparsity (half of each dense), 94 GB HBM3 at 3.9 TB/s",
        memory_gib: 94.0,
        matrix_tflops: [60.0, 417.5, 835.5, 835.5, 1670.5],
        vector_tflops: 60.0,
        memory_gbps: 3900.0,
    },
    Preset {
        name: "h800",
        tdp_w: 700.0,
        source: "NVIDIA H800 Tensor Core GPU datasheet (SXM5): 67 fp32, 989 tf32, 1,979 bf16/fp16, 3,958 fp8 TFLOP/s with sparsity (half of each dense), 80 GB HBM3 at 3.35 TB/s; NVLink 400 GB/s",
        memory_gib: 80.0,
        matrix_tflops: [67.0, 494.7, 989.4, 989.4, 1978.9],
        vector_tflops: 67.0,
        memory_gbps: 3350.0,
    },
    Preset {
        name: "h200",
        tdp_w: 700.0,
        source: "NVIDIA H200 Tensor Core GPU datasheet (SXM): H100 SXM's compute, 141 GB HBM3e at 4.8 TB/s",
        memory_gib: 141.0,
        matrix_tflops: [67.0, 494.7, 989.4, 989.4, 1978.9],
        vector_tflops: 67.0,
        memory_gbps: 4800.0,
    },
    Preset {
        name: "h200-nvl",
        tdp_w: 600.0,
        source: "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL): 60 fp32, 835 tf32, 1,671 bf16/fp16, 3,341 fp8 TFLOP/s with sparsity (half of each dense), 141 GB HBM3e at 4.8 TB/s",
        memory_gib: 141.0,
        matrix_tflops: [60.0, 417.5, 835.5, 835.5, 1670.5],
        vector_tflops: 60.0,
        memory_gbps: 4800.0,
    },
    Preset {
        name: "b200",
        tdp_w: 1000.0,
        source: "NVIDIA DGX B200 datasheet, per GPU (72 PFLOP/s fp8 training for 8 GPUs, sparse): 2,250 bf16/fp16, 4,500 fp8, 1,100 tf32 TFLOP/s dense; 180 GB HBM3e at 8 TB/s; fp32 from the HGX B200 listing (75 TFLOP/s)",
        memory_gib: 180.0,
        matrix_tflops: [75.0, 1100.0, 2250.0, 2250.0, 4500.0],
        vector_tflops: 75.0,
        memory_gbps: 8000.0,
    },
    Preset {
        name: "gb200",
        tdp_w: 1200.0,
        source: "NVIDIA GB200 NVL72 datasheet, per Blackwell GPU (the rack's 72): 720 PFLOP/s fp8, 360 bf16/fp16, 180 tf32 with sparsity (half of each dense), 5,760 TFLOP/s fp32; 13.4 TB HBM3e at 576 TB/s (186 GB at 8 TB/s each)",
        memory_gib: 186.0,
        matrix_tflops: [80.0, 1250.0, 2500.0, 2500.0, 5000.0],
        vector_tflops: 80.0,
        memory_gbps: 8000.0,
    },
    Preset {
        name: "mi300x",
        tdp_w: 750.0,
        source: "AMD Instinct MI300X datasheet: 163.4 fp32 matrix, 653.7 tf32, 1,307.4 bf16/fp16, 2,614.9 fp8 TFLOP/s dense, 81.7 fp32 vector; 192 GB HBM3 at 5.3 TB/s",
        memory_gib: 192.0,
        matrix_tflops: [163.4, 653.7, 1307.4, 1307.4, 2614.9],
        vector_tflops: 81.7,
        memory_gbps: 5300.0,
    },
];

impl Preset {
    /// The preset as a device model, with the shared efficiency curves and launch cost.
    pub fn model(&self) -> DeviceModel {
        let [fp32, tf32, bf16, fp16, fp8] = self.matrix_tflops.map(|t| t * T);
        DeviceModel {
            name: self.name.to_string(),
            memory: self.memory_gib * GIB,
            matrix: MatrixRates { fp32, tf32, bf16, fp16, fp8 },
            vector: self.vector_tflops * T,
            memory_bandwidth: self.memory_gbps * GB,
            launch: GPU_LAUNCH,
            matrix_efficiency: GPU_MATRIX_EFFICIENCY,
            memory_efficiency: GPU_MEMORY_EFFICIENCY,
            // no measured functions, link, optimizer, traffic, attention or power figures
            ..DeviceModel::uniform("", 0.0, 0.0)
        }
    }

    /// The preset as a device model capped at `watts` (`cluster.device: { preset, power }`):
    /// its matrix and element-wise rates at the clock that power sustains
    /// ([`sustained_clock`]); memory bandwidth unchanged (the memory's clock is not the
    /// one a power cap lowers).
    pub fn model_at(&self, watts: f64) -> DeviceModel {
        let mut d = self.model();
        let clock = sustained_clock(watts, self.tdp_w);
        let m = &mut d.matrix;
        for rate in [&mut m.fp32, &mut m.tf32, &mut m.bf16, &mut m.fp16, &mut m.fp8, &mut d.vector] {
            *rate *= clock;
        }
        d.power = Some(watts);
        d
    }
}

/// The share of its full clock a device capped at `watts` of its `tdp` sustains under
/// load: `(watts / tdp)^(1/3)`, at most 1. Dynamic power goes as C·V²·f and voltage
/// scales with frequency under dynamic voltage and frequency scaling, so power goes
/// about as f³ (Weste and Harris, *CMOS VLSI Design*, §5.1 on dynamic power); an H100
/// SXM capped at 500 W of its 700 W runs at 0.894 of its clock. A first-order model: the
/// engine's calibrated constant (`crate::engine::performance`) is fitted on runs at
/// their own caps and takes up what it misses.
pub fn sustained_clock(watts: f64, tdp: f64) -> f64 {
    if !(watts > 0.0 && tdp > 0.0) {
        return 1.0;
    }
    (watts / tdp).min(1.0).cbrt()
}

/// The preset named `name`.
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

/// A node's interconnect: the link between its devices and, per device, its share of the
/// node's network interfaces. `efficiency` is the share of the link a collective's bus
/// bandwidth reaches (NCCL's busbw over the line rate).
#[derive(Debug, Clone, Copy)]
pub struct LinkPreset {
    pub name: &'static str,
    pub source: &'static str,
    /// Within a node, per device and direction: (GB/s, latency s, bus-bandwidth efficiency).
    pub intra: (f64, f64, f64),
    /// Between nodes, per device and direction (the node's NICs over its devices).
    pub inter: (f64, f64, f64),
}

impl LinkPreset {
    /// A node of devices on one switched link (NVSwitch) with a network adapter per device
    /// (InfiniBand): `intra` and `inter` GB/s per device and direction, at the latencies
    /// (3 µs within the node, 6 µs between nodes) and efficiencies every preset shares.
    const fn switched(name: &'static str, source: &'static str, intra: f64, inter: f64) -> LinkPreset {
        LinkPreset { name, source, intra: (intra, 3e-6, 0.75), inter: (inter, 6e-6, 0.9) }
    }
}

/// A figure with the source it comes from.
#[derive(Debug, Clone, Copy)]
pub struct Sourced {
    pub bytes_per_s: f64,
    pub source: &'static str,
}

/// The fastest network adapter one device has: the bound past which an `inter_node`
/// bandwidth, which is per device, is taken for a node's total (W0106).
pub const FASTEST_NIC: Sourced = Sourced {
    bytes_per_s: 100e9,
    source: "800 Gb/s, NVIDIA ConnectX-8 SuperNIC's datasheet port speed (one per GPU in GB300 systems; DGX H100 and B200 have 400 Gb/s ConnectX-7s)",
};

/// The interconnect presets a spec can name (`cluster.links: dgx-a100`). Line rates are the
/// datasheets' (each preset's `source`); the efficiencies are measured shares: within a node
/// 0.75, NCCL's all-reduce bus bandwidth on NVSwitch (nccl-tests on DGX A100 reach about
/// 230 GB/s of the 300 GB/s line rate at large messages; the fidelity benchmark's fit agrees);
/// between nodes 0.9, InfiniBand's payload share after encoding and headers (HDR's 200 Gb/s
/// carries about 23 GB/s of data in perftest's ib_write_bw).
pub const LINK_PRESETS: &[LinkPreset] = &[
    LinkPreset::switched("dgx-v100", "NVIDIA DGX-2: NVSwitch, 300 GB/s NVLink per V100 (150 GB/s each way); 8 × 100 Gb/s EDR InfiniBand for 16 GPUs", 150.0, 6.25),
    LinkPreset::switched("dgx-a100", "NVIDIA DGX A100 (and Selene): NVSwitch, 600 GB/s NVLink per A100 (300 GB/s each way); 8 × 200 Gb/s HDR InfiniBand compute NICs, one per GPU", 300.0, 25.0),
    LinkPreset::switched("dgx-h100", "NVIDIA DGX H100: NVSwitch, 900 GB/s NVLink per H100 (450 GB/s each way); 8 × 400 Gb/s NDR InfiniBand (ConnectX-7), one per GPU", 450.0, 50.0),
    LinkPreset::switched("hgx-h800", "NVIDIA H800 datasheet: NVLink 400 GB/s per GPU (200 GB/s each way) through NVSwitch; DeepSeek-V3 technical report (arXiv 2412.19437) §3.1: 8 × 400 Gb/s InfiniBand per node of 8 H800, one NIC per GPU", 200.0, 50.0),
    LinkPreset::switched("dgx-b200", "NVIDIA DGX B200: NVLink 5, 1.8 TB/s per B200 (900 GB/s each way); 8 × 400 Gb/s ConnectX-7 NICs, one per GPU", 900.0, 50.0),
    LinkPreset::switched("gb200-nvl72", "NVIDIA GB200 NVL72 datasheet: NVLink 5 (fifth-generation NVLink), 1.8 TB/s per GPU (900 GB/s each way) across the rack's 72 GPUs (one NVLink domain: `devices_per_node: 72`); a 400 Gb/s ConnectX-7 NIC per GPU between racks", 900.0, 50.0),
];

/// The interconnect preset named `name`.
pub fn link_preset(name: &str) -> Option<&'static LinkPreset> {
    LINK_PRESETS.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

/// A figure for a table: `1,978.9`, `67`; `—` for none.
fn figure(v: f64) -> String {
    if v <= 0.0 {
        return "—".into();
    }
    // two decimals at most, trailing zeros dropped
    let hundredths = (v * 100.0).round() as u64;
    let digits = crate::model::thousands(hundredths / 100);
    match hundredths % 100 {
        0 => digits,
        f if f % 10 == 0 => format!("{digits}.{}", f / 10),
        f => format!("{digits}.{f:02}"),
    }
}

/// The table of device presets docs/spec.md shows (a test holds the two equal): every
/// preset's memory, dense matrix rates, vector rate, bandwidth and source.
pub fn presets_table() -> String {
    let mut out = String::from(
        "| preset | memory (GiB) | fp32 | tf32 | bf16 | fp16 | fp8 | vector fp32 | memory bandwidth (GB/s) | source |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for p in PRESETS {
        let [fp32, tf32, bf16, fp16, fp8] = p.matrix_tflops;
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            p.name,
            figure(p.memory_gib),
            figure(fp32),
            figure(tf32),
            figure(bf16),
            figure(fp16),
            figure(fp8),
            figure(p.vector_tflops),
            figure(p.memory_gbps),
            p.source
        ));
    }
    out
}

/// The table of interconnect presets docs/spec.md shows: per device and direction, within a
/// node and between nodes, bandwidth, latency and the collectives' share of it.
pub fn link_presets_table() -> String {
    let mut out = String::from(
        "| preset | within a node (GB/s, µs, efficiency) | between nodes (GB/s, µs, efficiency) | source |\n\
         |---|---|---|---|\n",
    );
    let level = |(gbps, latency, efficiency): (f64, f64, f64)| {
        format!("{}, {}, {}", figure(gbps), figure(latency * 1e6), efficiency)
    };
    for p in LINK_PRESETS {
        out.push_str(&format!("| `{}` | {} | {} | {} |\n", p.name, level(p.intra), level(p.inter), p.source));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_update_is_priced_at_the_measured_rate_where_there_is_one() {
        // 10 GB/s: 4 M Adam parameters of 28 bytes each take 11.2 ms as memory traffic
        let mut d = DeviceModel::uniform("x", 1e9, 1e12);
        d.memory_bandwidth = 1e10;
        let traffic = d.update_time(OptimizerKind::Adam, 8, 4e6, 28.0);
        assert!((traffic - 4e6 * 28.0 / 1e10).abs() < 1e-12, "{traffic}");
        // measured: 2 µs per tensor and 3 ns per parameter for Adam (AdamW the same), SGD
        // its own
        let rate = |t: f64, p: f64| UpdateRate { per_tensor: t, per_parameter: p };
        d.optimizer =
            Some(OptimizerRates { sgd: rate(1e-6, 1e-9), momentum: rate(1e-6, 2e-9), adam: rate(2e-6, 3e-9) });
        for kind in [OptimizerKind::Adam, OptimizerKind::AdamW] {
            assert!((d.update_time(kind, 8, 4e6, 28.0) - (8.0 * 2e-6 + 4e6 * 3e-9)).abs() < 1e-15);
        }
        assert!((d.update_time(OptimizerKind::Sgd, 8, 4e6, 12.0) - (8.0 * 1e-6 + 4e6 * 1e-9)).abs() < 1e-15);
        assert_eq!(d.update_time(OptimizerKind::Adam, 0, 0.0, 28.0), 0.0);
        // a device file with a negative rate is refused
        let mut bad = d.clone();
        bad.optimizer = Some(OptimizerRates { sgd: rate(-1.0, 0.0), momentum: rate(0.0, 0.0), adam: rate(0.0, 0.0) });
        let text = serde_json::to_string(&bad).expect("json");
        assert!(DeviceModel::from_json(&text).is_err_and(|e| e.contains("optimizer")));
    }

    #[test]
    fn element_wise_bytes_beyond_the_cache_and_the_data_draws_price_and_read_back() {
        let mut d = DeviceModel::uniform("cpu (pipec calibrate)", 1e9, 1e11);
        d.memory_bandwidth = 6e10;
        let within = d.memory_time(3e6);
        d.memory_traffic = Some(Traffic::new(2e10, 1e6));
        // the first MB at 60 GB/s, the other two at 20 GB/s
        assert!((d.memory_time(3e6) - (1e6 / 6e10 + 2e6 / 2e10)).abs() < 1e-15, "{}", d.memory_time(3e6));
        assert!(d.memory_time(3e6) > 2.0 * within);
        assert_eq!(d.memory_time(5e5), 5e5 / 6e10, "within the cache as before");
        d.data = Some(DrawRates { feature: 2.5e-8, token: 3e-9, score: 2.5e-10 });
        let draws = d.data.expect("set").seconds((3072, 0, 30720));
        assert!((draws - (3072.0 * 2.5e-8 + 30720.0 * 2.5e-10)).abs() < 1e-15);
        let back = DeviceModel::from_json(&serde_json::to_string(&d).expect("json")).expect("reads");
        assert_eq!((back.memory_traffic, back.data), (d.memory_traffic, d.data));
        for bad in [
            DeviceModel { memory_traffic: Some(Traffic::new(0.0, 1e6)), ..d.clone() },
            DeviceModel { data: Some(DrawRates { feature: -1e-9, token: 0.0, score: 0.0 }), ..d.clone() },
        ] {
            let text = serde_json::to_string(&bad).expect("json");
            assert!(DeviceModel::from_json(&text).is_err(), "{text}");
        }
    }

    /// A machine twice as fast as its calibration: every measured time halves, every
    /// measured rate doubles, the peaks, the memory's bandwidth and the link as they were;
    /// half as fast again is the file as it was.
    #[test]
    fn a_measured_machine_run_faster_halves_its_times_and_doubles_its_rates() {
        let mut d = DeviceModel::uniform("cpu (pipec calibrate)", 1e9, 1e11);
        d.memory_bandwidth = 5e10;
        d.launch = 6e-7;
        d.functions = Functions { exp: 4e8, silu: 2e8, tanh_grad: 6e7, ..Functions::default() };
        d.product_traffic = Some(Traffic::new(5e9, 7e5));
        d.memory_traffic = Some(Traffic::new(2e10, 8e5));
        let rate = |t: f64, p: f64| UpdateRate { per_tensor: t, per_parameter: p };
        d.optimizer =
            Some(OptimizerRates { sgd: rate(2e-6, 4e-9), momentum: rate(2e-6, 6e-9), adam: rate(3e-6, 8e-9) });
        let fit = AttentionFit { per_call: 3e-5, per_mac: 1e-11, per_score: 5e-9, per_value: 1e-8 };
        d.attention = Some(AttentionRates { forward: fit, backward: fit });
        d.layer_pass = Some(1e-5);
        d.layer_pass_backward = Some(6e-6);
        d.step_pass = Some(3e-5);
        d.data = Some(DrawRates { feature: 2.6e-8, token: 3e-9, score: 2.5e-10 });
        d.link = Some(MeasuredLink { bandwidth: 3e14, latency: 3e-5, efficiency: 1.0 });
        let gradients = ProductFit { rate: 1e11, half: 1e6, traffic: Traffic::new(1e10, 1e6) };
        (d.weight_gradient, d.input_gradient) = (Some(gradients), Some(ProductFit { rate: 2e11, ..gradients }));
        let mut fast = d.clone();
        fast.run_faster(2.0);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs();
        assert!(close(fast.vector, 2e11) && close(fast.functions.exp, 8e8) && close(fast.functions.tanh_grad, 1.2e8));
        assert!(close(fast.product_traffic.expect("kept").bandwidth, 1e10));
        assert!(close(fast.memory_traffic.expect("kept").bandwidth, 4e10));
        assert!(close(fast.launch, 3e-7) && close(fast.layer_pass.expect("kept"), 5e-6));
        assert!(close(fast.layer_pass_backward.expect("kept"), 3e-6) && close(fast.step_overhead(), 1.5e-5));
        assert!(close(fast.optimizer.expect("kept").adam.per_parameter, 4e-9));
        assert!(close(fast.attention.expect("kept").backward.per_mac, 5e-12));
        assert!(close(fast.data.expect("kept").feature, 1.3e-8));
        let (weight, input) = (fast.weight_gradient.expect("kept"), fast.input_gradient.expect("kept"));
        assert!(close(weight.rate, 2e11) && close(weight.traffic.bandwidth, 2e10) && weight.half == 1e6);
        assert!(close(input.rate, 4e11) && close(input.traffic.bandwidth, 2e10));
        let unmoved =
            |m: &DeviceModel| (m.memory_bandwidth, m.matrix, m.matrix_efficiency, m.memory_efficiency, m.link);
        assert_eq!(unmoved(&fast), unmoved(&d));
        fast.run_faster(0.5);
        assert!(close(fast.vector, d.vector) && close(fast.launch, d.launch));
        assert!(close(fast.data.expect("kept").score, 2.5e-10) && close(fast.layer_pass.expect("kept"), 1e-5));
    }

    /// A gated unit's activation, and the cross-entropy, are priced at their own measured
    /// rates, forward and backward, where a device file has them; without them, as before
    /// they were measured (the gate's function over the output's elements; `exp` over the
    /// logits). A file without them reads, and a negative one is refused.
    #[test]
    fn a_gated_activation_is_priced_at_its_own_rate_where_measured() {
        let mut d = DeviceModel::uniform("cpu (pipec calibrate)", 1e9, 1e11);
        d.memory_bandwidth = 1e12;
        d.launch = 1e-6;
        d.functions = Functions { silu: 2e8, silu_grad: 1e8, gelu: 5e7, ..Functions::default() };
        let (n, flops, bytes) = (1e6, 12e6, 12e6);
        let same = |a: f64, b: f64| (a - b).abs() <= 1e-15;
        assert!(same(
            d.function_time(Function::SiluGated, n, flops, bytes),
            d.function_time(Function::Silu, n, flops, bytes)
        ));
        assert!(same(
            d.function_grad_time(Function::SiluGated, n, flops, bytes),
            d.function_grad_time(Function::Silu, n, flops, bytes)
        ));
        assert!(same(
            d.function_time(Function::GeluGated, n, flops, bytes),
            d.function_time(Function::Gelu, n, flops, bytes)
        ));
        let text = serde_json::to_string(&d).expect("json");
        assert!(!text.contains("gated"), "unmeasured rates are left out: {text}");
        d.functions.silu_gated = 4e7;
        d.functions.silu_gated_grad = 2e7;
        assert!(same(d.function_time(Function::SiluGated, n, flops, bytes), 1e-6 + n / 4e7));
        assert!(same(d.function_grad_time(Function::SiluGated, n, flops, bytes), 1e-6 + n / 2e7));
        // the cross-entropy likewise: unmeasured, `exp` over the logits and its gradient by
        // FLOPs and bytes; measured, at its rates
        let e = Functions { exp: 4e8, ..d.functions };
        d.functions = e;
        assert!(same(
            d.function_time(Function::CrossEntropy, n, flops, bytes),
            d.function_time(Function::Exp, n, flops, bytes)
        ));
        assert!(same(d.function_grad_time(Function::CrossEntropy, n, flops, bytes), d.vector_time(flops, bytes)));
        d.functions.cross_entropy = 2e8;
        d.functions.cross_entropy_grad = 5e8;
        assert!(same(d.function_time(Function::CrossEntropy, n, flops, bytes), 1e-6 + n / 2e8));
        assert!(same(d.function_grad_time(Function::CrossEntropy, n, flops, bytes), 1e-6 + n / 5e8));
        let back = DeviceModel::from_json(&serde_json::to_string(&d).expect("json")).expect("reads back");
        assert_eq!(back.functions, d.functions);
        d.functions.gelu_gated_grad = -1.0;
        assert!(DeviceModel::from_json(&serde_json::to_string(&d).expect("json")).is_err());
    }

    #[test]
    fn a_device_files_work_per_layer_pass_reads_back_and_a_bad_one_is_refused() {
        let mut d = DeviceModel::uniform("cpu (pipec calibrate)", 1e9, 1e11);
        d.memory_bandwidth = 1e10;
        d.layer_pass = Some(4e-6);
        let back = DeviceModel::from_json(&serde_json::to_string(&d).expect("json")).expect("reads");
        assert_eq!(back.layer_pass, Some(4e-6));
        // a file written before it was measured has none
        let none = DeviceModel { layer_pass: None, ..d.clone() };
        let text = serde_json::to_string(&none).expect("json");
        assert!(!text.contains("layer_pass"), "{text}");
        assert_eq!(DeviceModel::from_json(&text).expect("reads").layer_pass, None);
        let text = serde_json::to_string(&DeviceModel { layer_pass: Some(-1e-6), ..d.clone() }).expect("json");
        assert!(DeviceModel::from_json(&text).is_err_and(|e| e.contains("layer pass")), "{text}");
        // the work per step alike: read back, absent from a file without it, never negative
        let stepped = DeviceModel { step_pass: Some(2.5e-5), ..d.clone() };
        let back = DeviceModel::from_json(&serde_json::to_string(&stepped).expect("json")).expect("reads");
        assert_eq!((back.step_pass, back.step_overhead()), (Some(2.5e-5), 2.5e-5));
        assert!(!serde_json::to_string(&d).expect("json").contains("step_pass"));
        assert_eq!(d.step_overhead(), 0.0);
        let text = serde_json::to_string(&DeviceModel { step_pass: Some(-1e-6), ..d.clone() }).expect("json");
        assert!(DeviceModel::from_json(&text).is_err_and(|e| e.contains("per step")), "{text}");
        // JSON has no infinity: out of range, not a device file
        let text = serde_json::to_string(&d).expect("json").replace("4e-6", "1e999");
        assert!(text.contains("1e999") && DeviceModel::from_json(&text).is_err(), "{text}");
    }

    use super::*;

    #[test]
    fn curves_saturate_and_flat_is_flat() {
        let c = Curve { peak: 0.8, half: 1e9 };
        assert!((c.at(1e9) - 0.4).abs() < 1e-12);
        assert!(c.at(1e15) > 0.7999 && c.at(1e15) <= 0.8);
        assert!(c.at(1e6) < 0.001);
        assert_eq!(Curve::FLAT.at(1.0), 1.0);
    }

    #[test]
    fn a_uniform_device_prices_flops_alone() {
        let d = DeviceModel::uniform("x", 1e9, 1e12);
        assert_eq!(d.matrix_time(2e12, 1e15, Precision::Bf16), 2.0);
        assert_eq!(d.vector_time(1e12, 1e15), 1.0);
    }

    #[test]
    fn docs_show_every_preset_as_the_source_defines_it() {
        let spec = include_str!("../../docs/spec.md");
        assert!(
            spec.contains(&presets_table()),
            "docs/spec.md's device table differs from PRESETS:\n{}",
            presets_table()
        );
        assert!(
            spec.contains(&link_presets_table()),
            "docs/spec.md's interconnect table differs from LINK_PRESETS:\n{}",
            link_presets_table()
        );
        assert_eq!(figure(1978.9), "1,978.9");
        assert_eq!(figure(67.0), "67");
        assert_eq!(figure(6.25), "6.25");
        assert_eq!(figure(0.0), "—");
    }

    #[test]
    fn presets_are_named_once_and_read_their_datasheets() {
        for (i, p) in PRESETS.iter().enumerate() {
            assert!(PRESETS[i + 1..].iter().all(|q| q.name != p.name), "{} twice", p.name);
            assert!(!p.source.is_empty());
        }
        let a100 = preset("A100-80GB").expect("a100").model();
        assert_eq!(a100.matrix.of(Precision::Bf16), 312e12);
        assert_eq!(a100.matrix.of(Precision::Fp32), 19.5e12);
        // V100 has no bf16 path: fp32's rate
        assert_eq!(preset("v100-32gb").expect("v100").model().matrix.of(Precision::Bf16), 15.7e12);
        assert_eq!(a100.memory, 80.0 * GIB);
        // a large product runs near the curve's peak, memory-bound when it moves more than
        // it computes
        let t = a100.matrix_time(1e13, 1e6, Precision::Bf16);
        let ideal = 1e13 / (312e12 * GPU_MATRIX_EFFICIENCY.peak);
        assert!(t > ideal && t < ideal * 1.01 + GPU_LAUNCH, "{t} vs {ideal}");
        assert!(a100.matrix_time(1e6, 1e9, Precision::Bf16) > 1e9 / 2039e9);
    }

    #[test]
    fn a_measured_products_traffic_combines_with_its_compute_by_its_norm_beyond_the_cache() {
        let mut d = DeviceModel::uniform("cpu", 1e9, 1e11);
        d.memory_bandwidth = 1e11;
        // the roofline: 1 ms of compute and 0.4 ms of traffic at 1e11 B/s take 1 ms
        assert!((d.matrix_time(1e8, 4e7, Precision::Fp32) - 1e-3).abs() < 1e-15);
        // with the products' traffic: (4e7 − 1e7 cached) bytes at 1e10 B/s take 3 ms,
        // beside 1 ms of compute: √(1² + 3²) ms
        d.product_traffic = Some(Traffic::new(1e10, 1e7));
        let t = d.matrix_time(1e8, 4e7, Precision::Fp32);
        assert!((t - 10f64.sqrt() * 1e-3).abs() < 1e-12, "{t}");
        // operands the cache holds cost nothing beyond the compute
        assert!((d.matrix_time(1e8, 5e6, Precision::Fp32) - 1e-3).abs() < 1e-15);
        // added where the fit found them added: 1 + 3 ms
        d.product_traffic = Some(Traffic { norm: 1.0, ..Traffic::new(1e10, 1e7) });
        assert!((d.matrix_time(1e8, 4e7, Precision::Fp32) - 4e-3).abs() < 1e-12);
        let json = serde_json::to_string(&d).expect("json");
        assert!(json.contains("\"norm\":1.0"), "{json}");
        assert_eq!(DeviceModel::from_json(&json).expect("reads").product_traffic, d.product_traffic);
        // a file written before the norm was fitted holds none: the 2-norm it was fitted by
        let old = json.replace(",\"norm\":1.0", "");
        assert_eq!(DeviceModel::from_json(&old).expect("reads").product_traffic, Some(Traffic::new(1e10, 1e7)));
        // a device file with a bandwidth of 0, or a norm outside [1, 2], is refused
        for traffic in [Traffic::new(0.0, 0.0), Traffic { norm: 0.5, ..Traffic::new(1e10, 0.0) }] {
            d.product_traffic = Some(traffic);
            assert!(DeviceModel::from_json(&serde_json::to_string(&d).expect("json")).is_err());
        }
    }
}
