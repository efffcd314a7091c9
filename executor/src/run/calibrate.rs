//! `pipec calibrate`: measures the device the executor runs on and fits the cost model's
//! device figures to it (`pipec_plan::device::DeviceModel`, the JSON a spec names with
//! `device: { file: ... }`).
//!
//! Three sweeps, each timed as the median of repeated runs after a warm-up, on the backend's
//! own kernels (the executor's dense product, Burn's element-wise add). A CPU runs each
//! kernel before returning; a GPU queues them, so there each timing is a burst of kernels
//! and one wait, divided by the burst (the wait for the device costs tens of µs, more than
//! a kernel). The sizes are each backend's own ([`Sweep::CPU`], [`Sweep::GPU`]): up to
//! where the rate levels off.
//! - the launch: the smallest element-wise kernel (one value);
//! - matrix products of growing size: their times fit `launch + (flops + half) / rate`, a
//!   line in the FLOPs (least squares), whose slope gives the fp32 `rate` and whose
//!   intercept beyond the launch gives the efficiency curve's `half` (the curve's peak is 1:
//!   the rate is what large products reach);
//! - element-wise adds of growing size: the same line in the bytes moved gives the memory
//!   bandwidth and its curve's `half`; the fastest add's elements per second are the
//!   vector rate.

use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Tensor};
use pipec_plan::device::{
    AttentionFit, AttentionRates, Curve, DeviceModel, Functions, MatrixRates, OptimizerRates, ProductTraffic,
    UpdateRate,
};

use crate::backend::dense::Kernels;

/// One measured point: a kernel's size (FLOPs or bytes) and its median seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub size: f64,
    pub seconds: f64,
}

/// What a calibration measured and the device it fitted.
#[derive(Debug, Clone)]
pub struct Calibration {
    pub device: DeviceModel,
    /// Matrix products: (m, k, n), FLOPs and seconds.
    pub products: Vec<((usize, usize, usize), Point)>,
    /// Element-wise adds: elements, bytes and seconds.
    pub adds: Vec<(usize, Point)>,
    /// Element-wise functions: name, elements and seconds.
    pub functions: Vec<(&'static str, Point)>,
    /// Attention as the executor runs it (the CPU): shape, forward and backward seconds.
    pub attention: Vec<(AttentionShape, f64, f64)>,
}

/// The median of `reps` timings of `f` after `warmup` untimed runs.
fn median_seconds(warmup: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warmup {
        f();
    }
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// The line `seconds = slope · size + intercept` closest to the points in relative error
/// (least squares weighted by 1/seconds²: a 3 µs kernel counts as much as a 3 ms one).
pub fn fit_line(points: &[Point]) -> Option<(f64, f64)> {
    if points.len() < 2 || points.iter().any(|p| p.seconds.is_nan() || p.seconds <= 0.0 || !p.size.is_finite()) {
        return None;
    }
    let w = |p: &Point| 1.0 / (p.seconds * p.seconds);
    let sw: f64 = points.iter().map(w).sum();
    let mx = points.iter().map(|p| w(p) * p.size).sum::<f64>() / sw;
    let my = points.iter().map(|p| w(p) * p.seconds).sum::<f64>() / sw;
    let sxx: f64 = points.iter().map(|p| w(p) * (p.size - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| w(p) * (p.size - mx) * (p.seconds - my)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    Some((slope, my - slope * mx))
}

/// A resource's rate (size per second) and its efficiency curve's `half` from its points:
/// the fitted line's slope and its intercept beyond the launch; with too few or flat points,
/// the largest point's own rate and no size effect.
fn rate_and_half(points: &[Point], launch: f64) -> (f64, f64) {
    match fit_line(points) {
        Some((slope, intercept)) if slope > 0.0 => (1.0 / slope, ((intercept - launch) / slope).max(0.0)),
        _ => points.last().map_or((1e9, 0.0), |p| (p.size / p.seconds.max(1e-12), 0.0)),
    }
}

/// The sizes one calibration sweeps, and how many kernels each timing queues.
#[derive(Debug, Clone, Copy)]
pub struct Sweep {
    /// Matrix products (m, k, n): rows of a microbatch against square weights.
    pub products: &'static [(usize, usize, usize)],
    /// Element-wise adds: element counts.
    pub adds: &'static [usize],
    /// The elements each element-wise function is timed on.
    pub function_elements: usize,
    /// Kernels queued per timing (1 on a backend that runs each before returning).
    pub burst: usize,
}

impl Sweep {
    /// A CPU: products up to 128·1024·1024, adds up to 4 Mi elements, functions on 64 Ki
    /// elements (in cache, as a microbatch's activations mostly are), one kernel per timing.
    pub const CPU: Sweep = Sweep {
        products: &[
            (8, 64, 64),
            (16, 128, 128),
            (32, 256, 256),
            (32, 512, 512),
            (64, 512, 512),
            (512, 256, 256),
            (8, 1024, 1024),
            (16, 1024, 1024),
            (32, 1024, 1024),
            (64, 1024, 1024),
            (128, 1024, 1024),
        ],
        adds: &[1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20, 1 << 22],
        function_elements: 1 << 16,
        burst: 1,
    };
    /// A GPU: products up to 8192·4096·4096 and adds up to 64 Mi elements (an H100's rates
    /// level off there), functions on 16 Mi elements, 10 kernels per timing.
    pub const GPU: Sweep = Sweep {
        products: &[
            (64, 1024, 1024),
            (256, 1024, 1024),
            (1024, 1024, 1024),
            (2048, 2048, 2048),
            (4096, 4096, 4096),
            (8192, 4096, 4096),
        ],
        adds: &[1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24, 1 << 26],
        function_elements: 1 << 24,
        burst: 10,
    };
}

/// Measures the backend `B` on `device` over `sweep` and fits a device model holding
/// `memory` bytes, with `launch` the cost of one kernel (measured through autodiff, as the
/// executor runs its layers: [`autodiff_launch`]). `reps` timed runs per point (the median
/// kept). `at_point` runs before each point is timed (copies measuring at once meet there).
pub fn calibrate<B: Kernels>(
    device: &B::Device,
    memory: f64,
    reps: usize,
    (name, launch): (&str, f64),
    sweep: Sweep,
    at_point: &(dyn Fn() + Sync),
) -> Calibration {
    let reps = reps.max(3);
    let sync = || B::sync(device);
    let burst = sweep.burst.max(1);
    // the median seconds of one kernel: `burst` of them queued, then one wait (their
    // results kept until then: a lazy backend may skip what nothing holds)
    let per_kernel = |f: &dyn Fn() -> Box<dyn std::any::Any>| {
        at_point();
        median_seconds(2, reps, || {
            let kept: Vec<_> = (0..burst).map(|_| f()).collect();
            let _ = sync();
            drop(kept);
        }) / burst as f64
    };
    let products: Vec<((usize, usize, usize), Point)> = sweep
        .products
        .iter()
        .map(|&(m, k, n)| {
            let a = Tensor::<B, 2>::random([m, k], Distribution::Uniform(-1.0, 1.0), device);
            let b = Tensor::<B, 2>::random([k, n], Distribution::Uniform(-1.0, 1.0), device);
            let seconds = per_kernel(&|| {
                Box::new(Tensor::<B, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(B::product(
                    a.clone().into_primitive().tensor(),
                    b.clone().into_primitive().tensor(),
                ))))
            });
            ((m, k, n), Point { size: 2.0 * (m * k * n) as f64, seconds })
        })
        .collect();
    let adds: Vec<(usize, Point)> = sweep
        .adds
        .iter()
        .map(|&n| {
            let a = Tensor::<B, 1>::random([n], Distribution::Uniform(-1.0, 1.0), device);
            let b = Tensor::<B, 1>::random([n], Distribution::Uniform(-1.0, 1.0), device);
            let seconds = per_kernel(&|| Box::new(a.clone() + b.clone()));
            // two fp32 reads and one write per element
            (n, Point { size: 12.0 * n as f64, seconds })
        })
        .collect();
    // the functions the cost model prices by their own rate (`Functions`), as the backend
    // evaluates them (Burn's activations)
    let x = Tensor::<B, 1>::random([sweep.function_elements], Distribution::Uniform(-3.0, 3.0), device);
    let time = |f: &dyn Fn(Tensor<B, 1>) -> Tensor<B, 1>| per_kernel(&|| Box::new(f(x.clone())));
    use burn::tensor::activation;
    let functions: Vec<(&'static str, Point)> = [
        ("exp", time(&|t| t.exp())),
        ("gelu", time(&|t| activation::gelu(t))),
        ("gelu_tanh", time(&|t| crate::nn::layers::gelu_tanh(t))),
        ("silu", time(&|t| activation::silu(t))),
        ("tanh", time(&|t| t.tanh())),
    ]
    .into_iter()
    .map(|(name, seconds)| (name, Point { size: sweep.function_elements as f64, seconds }))
    .collect();
    fitted(name, memory, launch, products, adds, functions)
}

/// The device model the points give, with the points.
fn fitted(
    name: &str,
    memory: f64,
    launch: f64,
    products: Vec<((usize, usize, usize), Point)>,
    adds: Vec<(usize, Point)>,
    functions: Vec<(&'static str, Point)>,
) -> Calibration {
    let mut device = fit(name, memory, launch, &products.iter().map(|p| p.1).collect::<Vec<_>>(), &adds);
    device.functions = function_rates(&functions, launch);
    Calibration { device, products, adds, functions, attention: Vec::new() }
}

/// Each function's elements per second beyond the launch (0 for a name not measured).
pub fn function_rates(measured: &[(&str, Point)], launch: f64) -> Functions {
    let rate = |name: &str| {
        measured
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0.0, |(_, p)| p.size / (p.seconds - launch).max(p.seconds * 1e-3).max(1e-12))
    };
    Functions {
        exp: rate("exp"),
        gelu: rate("gelu"),
        gelu_tanh: rate("gelu_tanh"),
        silu: rate("silu"),
        tanh: rate("tanh"),
        gelu_grad: rate("gelu_grad"),
        gelu_tanh_grad: rate("gelu_tanh_grad"),
        silu_grad: rate("silu_grad"),
        tanh_grad: rate("tanh_grad"),
    }
}

/// The gradients of the functions [`Functions`] prices, as the executor's backward computes
/// them (through autodiff, from their input and the incoming gradient), on `elements`
/// values: each the median time of the function's forward and backward, less its forward
/// alone and less the same backward of the identity (the graph's walk, the gradient's
/// seed and its registration), so that what is left is the gradient's kernels.
pub fn function_gradients<B: AutodiffBackend>(
    device: &B::Device,
    elements: usize,
    reps: usize,
) -> Vec<(&'static str, Point)> {
    use burn::tensor::activation;
    let x = Tensor::<B, 1>::random([elements], Distribution::Uniform(-3.0, 3.0), device);
    let pass = |f: &dyn Fn(Tensor<B, 1>) -> Tensor<B, 1>, backward: bool| {
        median_seconds(2, reps.max(3), || {
            let t = x.clone().require_grad();
            let y = f(t.clone());
            if backward {
                let grads = y.sum().backward();
                let _ = t.grad(&grads);
            } else {
                let _ = y.sum();
            }
            let _ = B::sync(device);
        })
    };
    let identity = pass(&|t| t, true) - pass(&|t| t, false);
    type Function<'a, B> = &'a dyn Fn(Tensor<B, 1>) -> Tensor<B, 1>;
    let functions: [(&'static str, Function<B>); 4] = [
        ("gelu_grad", &|t| activation::gelu(t)),
        ("gelu_tanh_grad", &|t| crate::nn::layers::gelu_tanh(t)),
        ("silu_grad", &|t| activation::silu(t)),
        ("tanh_grad", &|t| t.tanh()),
    ];
    functions
        .into_iter()
        .map(|(name, f)| {
            let seconds = (pass(f, true) - pass(f, false) - identity).max(1e-9);
            (name, Point { size: elements as f64, seconds })
        })
        .collect()
}

/// The device model the measurements give: the launch as measured; each line's slope its
/// rate, its intercept beyond the launch its curve's `half` (none when the line's intercept
/// is below the launch).
pub fn fit(name: &str, memory: f64, launch: f64, products: &[Point], adds: &[(usize, Point)]) -> DeviceModel {
    let add_points: Vec<Point> = adds.iter().map(|a| a.1).collect();
    let (rate, matrix_half) = rate_and_half(products, launch);
    let (bandwidth, memory_half) = rate_and_half(&add_points, launch);
    // the fastest add's elements per second: element-wise work at its best, memory aside
    let vector = adds.iter().map(|(n, p)| *n as f64 / p.seconds.max(1e-12)).fold(0.0, f64::max);
    let vector = if vector > 0.0 { vector } else { rate };
    DeviceModel {
        name: name.to_string(),
        memory,
        // one fp32 path: bf16 and fp16 products fall back to its rate
        matrix: MatrixRates { fp32: rate, tf32: 0.0, bf16: 0.0, fp16: 0.0, fp8: 0.0 },
        vector,
        memory_bandwidth: bandwidth,
        launch,
        matrix_efficiency: Curve { peak: 1.0, half: matrix_half },
        memory_efficiency: Curve { peak: 1.0, half: memory_half },
        functions: Functions::default(),
        link: None,
        optimizer: None,
        product_traffic: None,
        attention: None,
    }
}

/// Linear layers in each calibration stack: a stage's worth, so that large layers' weights,
/// their transposed copies and their gradients' sums do not all stay in cache, as in a step.
const STACK: usize = 4;
/// Microbatches a stack's weights serve between two updates in a calibration.
const PER_VERSION: usize = 4;

/// A product's (m, k, n): rows of a microbatch, inner and output features.
pub type Shape = (usize, usize, usize);

/// The bytes an fp32 product (m, k, n) reads and writes: its two operands and its output.
pub fn product_bytes((m, k, n): (usize, usize, usize)) -> f64 {
    4.0 * (m * k + k * n + m * n) as f64
}

/// Each product of `shapes` as linear layers run in a step on `B`: a stack of [`STACK`]
/// layers of that product (k → n, then n → k, ...), x·W + b forward through autodiff and its
/// backward with the weight gradients added into the step's sums, [`PER_VERSION`]
/// microbatches per weight version (timed as `pipec profile` times a model; the updates
/// between versions, which on the CPU remake the weights' transposed copies, untimed). A
/// point is one product's FLOPs and a third of a layer's pass. The CPU's device file fits
/// its matrix rate and the products' bandwidth to these: a layer's products cost what the
/// executor's layer costs in a step — its autodiff, bias, allocations and the traffic of
/// weights that do not stay in cache included — not what the bare kernel does.
pub fn layer_products<B: crate::backend::dense::ExecBackend>(
    device: &B::Device,
    reps: usize,
    shapes: &[(usize, usize, usize)],
    at_point: &(dyn Fn() + Sync),
) -> Result<Vec<(Shape, Point)>, String> {
    use pipec_plan::model::Op;
    // a learning rate of zero: the updates do their work and keep the weights
    let sgd = pipec_plan::plan::OptimizerPlan::Sgd { lr: 0.0, momentum: 0.0, weight_decay: 0.0 };
    let points = shapes
        .iter()
        .map(|&(m, k, n)| {
            let ops: Vec<Op> = (0..STACK)
                .map(|i| {
                    let (a, b) = if i % 2 == 0 { (k, n) } else { (n, k) };
                    Op::Linear { in_features: a, out_features: b, bias: true }
                })
                .collect();
            let stack = crate::nn::layers::StageModel::<B>::new(&ops, 0, 1, device);
            at_point();
            let input = || {
                let x = Tensor::<B, 2>::random([m, k], Distribution::Uniform(-1.0, 1.0), device);
                crate::interp::values::require_grad(crate::nn::layers::Act::D2(x))
            };
            let passes = crate::run::profile::time_passes(
                stack,
                device,
                &sgd,
                (PER_VERSION, reps.max(PER_VERSION), PER_VERSION),
                "a calibration stack",
                input,
            )
            .map_err(|e| format!("timing {m}·{k}·{n} layers: {e}"))?;
            let seconds = (passes.forward + passes.backward) / 1e3 / (3 * STACK) as f64;
            Ok(((m, k, n), Point { size: 2.0 * (m * k * n) as f64, seconds }))
        })
        .collect();
    // (time_passes drops the weights' transposed copies before and after each stack)
    points
}

/// The products' model (matrix rate, its curve's `half`, [`ProductTraffic`]) closest to
/// `points` (FLOPs, operand bytes, seconds) in relative error, with its summed squared
/// relative error: a grid over the cached bytes (none, or 32 KiB to 32 MiB in √2 steps),
/// the halves (none, or 10²–10¹⁰ FLOPs in quarter decades) and the bandwidths (1 GB/s to
/// 1 TB/s in 12% steps), the rate for each found by golden-section search (10⁸–10¹⁴ FLOP/s).
pub fn fit_products_with_traffic(points: &[(f64, f64, f64)], launch: f64) -> Option<(f64, f64, ProductTraffic, f64)> {
    if points.len() < 2 || points.iter().any(|&(f, b, t)| !(f > 0.0 && b >= 0.0 && t > 0.0 && t.is_finite())) {
        return None;
    }
    let error = |rate: f64, half: f64, t: ProductTraffic| {
        points
            .iter()
            .map(|&(flops, bytes, seconds)| {
                let compute = (flops + half) / rate;
                let traffic = (bytes - t.cached).max(0.0) / t.bandwidth;
                ((launch + compute.hypot(traffic) - seconds) / seconds).powi(2)
            })
            .sum::<f64>()
    };
    let cached = std::iter::once(0.0).chain((0..=20).map(|i| 32768.0 * 2f64.powf(i as f64 / 2.0)));
    let mut best: Option<(f64, f64, ProductTraffic, f64)> = None;
    for cached in cached {
        let halves = std::iter::once(0.0).chain((0..=32).map(|i| 1e2 * 10f64.powf(i as f64 / 4.0)));
        for half in halves {
            for b in 0..=60 {
                let traffic = ProductTraffic { bandwidth: 1e9 * 10f64.powf(b as f64 / 20.0), cached };
                // golden-section search of log10(rate)
                let g = (5f64.sqrt() - 1.0) / 2.0;
                let at = |x: f64| error(10f64.powf(x), half, traffic);
                let (mut lo, mut hi) = (8.0, 14.0);
                let (mut x1, mut x2) = (hi - g * (hi - lo), lo + g * (hi - lo));
                let (mut e1, mut e2) = (at(x1), at(x2));
                while hi - lo > 1e-4 {
                    if e1 < e2 {
                        (hi, x2, e2) = (x2, x1, e1);
                        x1 = hi - g * (hi - lo);
                        e1 = at(x1);
                    } else {
                        (lo, x1, e1) = (x1, x2, e2);
                        x2 = lo + g * (hi - lo);
                        e2 = at(x2);
                    }
                }
                let (x, e) = if e1 < e2 { (x1, e1) } else { (x2, e2) };
                if best.is_none_or(|b| e < b.3) {
                    best = Some((10f64.powf(x), half, traffic, e));
                }
            }
        }
    }
    best
}

/// Refits `c`'s products with their traffic beyond the cache
/// ([`fit_products_with_traffic`]), kept where closer to the points than the roofline at
/// the adds' bandwidth (the fit already made).
pub fn fit_product_traffic(c: &mut Calibration) {
    let points: Vec<(f64, f64, f64)> =
        c.products.iter().map(|&(shape, p)| (p.size, product_bytes(shape), p.seconds)).collect();
    let roofline = c
        .products
        .iter()
        .map(|&(shape, p)| {
            let t = c.device.matrix_time(p.size, product_bytes(shape), pipec_plan::Precision::Fp32);
            ((t - p.seconds) / p.seconds.max(1e-12)).powi(2)
        })
        .sum::<f64>();
    if let Some((rate, half, traffic, e)) = fit_products_with_traffic(&points, c.device.launch) {
        if e < roofline {
            c.device.matrix.fp32 = rate;
            c.device.matrix_efficiency = Curve { peak: 1.0, half };
            c.device.product_traffic = Some(traffic);
        }
    }
}

/// An attention's (batch, positions, heads, head features) in a calibration.
pub type AttentionShape = (usize, usize, usize, usize);

/// The attention shapes the CPU calibration times: a few heads of short sequences up to
/// a tensor-parallel benchmark's 16 × 8 heads of 64 positions and 256-position sequences.
pub const ATTENTION_SHAPES: &[AttentionShape] = &[
    (1, 32, 2, 16),
    (4, 64, 4, 16),
    (2, 128, 4, 32),
    (4, 64, 8, 64),
    (1, 256, 8, 32),
    (4, 128, 2, 64),
    (16, 64, 8, 64),
    (2, 256, 4, 64),
];

/// Each shape's causal attention as the executor's transformer block runs it on `B`
/// (`Block::attend`: the heads split from a fused QKV projection's output, the scores,
/// the softmax, the weighted sum, the heads merged back), forward and backward through
/// autodiff: the medians of `reps`, in seconds (forward, backward).
pub fn attention_passes<B: crate::backend::dense::ExecBackend>(
    device: &B::Device,
    reps: usize,
    shapes: &[AttentionShape],
    at_point: &(dyn Fn() + Sync),
) -> Result<Vec<(AttentionShape, f64, f64)>, String> {
    shapes
        .iter()
        .map(|&(b, s, heads, dh)| {
            let op = pipec_plan::model::Op::block(heads * dh, heads, 4, true);
            let mut stage = crate::nn::layers::StageModel::<B>::new(std::slice::from_ref(&op), 0, 1, device);
            let Some(crate::nn::layers::Layer::Block(block)) = stage.layers.pop() else {
                return Err("a transformer block builds as a block".to_string());
            };
            let qkv = Tensor::<B, 3>::random([b, s, 3 * heads * dh], Distribution::Uniform(-1.0, 1.0), device);
            at_point();
            let (mut forward, mut backward) = (Vec::new(), Vec::new());
            for rep in 0..2 + reps.max(3) {
                let x = qkv.clone().require_grad();
                let t0 = Instant::now();
                let y = block.attend(x.clone(), None).map_err(|e| format!("attention {b}·{s}·{heads}·{dh}: {e}"))?;
                let total = y.sum();
                let _ = B::sync(device);
                let t1 = Instant::now();
                let grads = total.backward();
                let _ = x.grad(&grads);
                let _ = B::sync(device);
                if rep >= 2 {
                    forward.push((t1 - t0).as_secs_f64());
                    backward.push(t1.elapsed().as_secs_f64());
                }
            }
            Ok(((b, s, heads, dh), crate::run::profile::median(forward), crate::run::profile::median(backward)))
        })
        .collect()
}

/// The [`AttentionFit`] closest in relative error to `points` (shape, seconds) — least
/// squares on the fit's four terms, a term whose coefficient comes out negative dropped
/// and the rest solved again (so every coefficient is 0 or more); None without points.
pub fn fit_attention(points: &[(AttentionShape, f64)]) -> Option<AttentionFit> {
    let rows: Vec<([f64; 4], f64)> = points
        .iter()
        .filter(|(_, t)| *t > 0.0 && t.is_finite())
        .map(|&((b, s, h, dh), t)| (AttentionFit::terms((b * h) as f64, s as f64, dh as f64), t))
        .collect();
    if rows.is_empty() {
        return None;
    }
    let mut active = [true; 4];
    loop {
        let cols: Vec<usize> = (0..4).filter(|&j| active[j]).collect();
        // each term scaled to its largest relative value, for the normal equations' sake
        let scale: Vec<f64> =
            cols.iter().map(|&j| rows.iter().map(|(x, t)| x[j] / t).fold(0.0, f64::max).max(1e-300)).collect();
        let n = cols.len();
        let mut a = vec![vec![0.0; n + 1]; n];
        for (x, t) in &rows {
            let r: Vec<f64> = cols.iter().zip(&scale).map(|(&j, sc)| x[j] / t / sc).collect();
            for i in 0..n {
                for k in 0..n {
                    a[i][k] += r[i] * r[k];
                }
                a[i][n] += r[i];
            }
        }
        let solved = solve(a)?;
        let mut c = [0.0; 4];
        for ((&j, v), sc) in cols.iter().zip(&solved).zip(&scale) {
            c[j] = v / sc;
        }
        match (0..4).filter(|&j| active[j] && c[j] < 0.0).min_by(|&x, &y| c[x].total_cmp(&c[y])) {
            Some(j) => {
                active[j] = false;
                if !active.iter().any(|a| *a) {
                    return None;
                }
            }
            None => return Some(AttentionFit { per_call: c[0], per_mac: c[1], per_score: c[2], per_value: c[3] }),
        }
    }
}

/// Gaussian elimination with partial pivoting on an n × (n + 1) augmented matrix.
fn solve(mut a: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let n = a.len();
    for col in 0..n {
        let pivot = (col..n).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col].clone();
        for (row, r) in a.iter_mut().enumerate() {
            if row != col {
                let f = r[col] / pivot_row[col];
                for (x, p) in r.iter_mut().zip(&pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((0..n).map(|i| a[i][n] / a[i][i]).collect())
}

/// The attention rates `points` (shape, forward, backward) give, both passes fitted.
pub fn attention_rates(points: &[(AttentionShape, f64, f64)]) -> Option<AttentionRates> {
    let forward = fit_attention(&points.iter().map(|&(s, f, _)| (s, f)).collect::<Vec<_>>())?;
    let backward = fit_attention(&points.iter().map(|&(s, _, b)| (s, b)).collect::<Vec<_>>())?;
    Some(AttentionRates { forward, backward })
}

/// The executor's optimizer updates timed on `B`: for each optimizer, one update of a few
/// large tensors (4 × linear(1024, 1024): 4.2 M parameters in 8 tensors) and of many small
/// ones (64 × linear(16, 16): 17,408 in 128), each the median of `reps`, solved for the
/// seconds per tensor and per parameter ([`update_rate`]). An update is what a step's runs:
/// the gradients handed to Burn's optimizer, its step, and on the CPU the new weights'
/// transposed copies for the forwards (made after two forwards, as in training).
pub fn optimizer_rates<B: crate::backend::dense::ExecBackend>(device: &B::Device, reps: usize) -> OptimizerRates {
    use pipec_plan::model::Op;
    use pipec_plan::plan::OptimizerPlan;
    let chain = |n: usize, width: usize| vec![Op::Linear { in_features: width, out_features: width, bias: true }; n];
    let time = |plan: &OptimizerPlan, ops: &[Op]| -> Point {
        let mut model = Some(crate::nn::layers::StageModel::<B>::new(ops, 0, 1, device));
        let layout = crate::nn::params::layout::<B, _>(model.as_ref().expect("built"));
        let mut optim = crate::interp::stage::StageOptim::<B, crate::nn::layers::StageModel<B>>::new(plan, &layout);
        let flat: Vec<Option<Tensor<B::InnerBackend, 1>>> = layout
            .iter()
            .map(|(_, shape)| {
                let n = shape.iter().product::<usize>();
                Some(Tensor::random([n], Distribution::Uniform(-1e-3, 1e-3), device))
            })
            .collect();
        let params: usize = layout.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        // two forwards first, as a step runs them: on the CPU the weights then have their
        // transposed copies (`crate::backend::flex_weights`), which every update makes again
        let width = match ops.first() {
            Some(Op::Linear { in_features, .. }) => *in_features,
            _ => 1,
        };
        let x = Tensor::<B, 2>::random([8, width], Distribution::Uniform(-1.0, 1.0), device);
        for _ in 0..2 {
            if let Some(m) = &model {
                let _ = m.forward(crate::nn::layers::Act::D2(x.clone()), false, (0, 0, 0), &mut Default::default());
            }
        }
        let seconds = median_seconds(1, reps.max(3), || {
            if let Some(m) = model.take() {
                model = Some(optim.update(1e-3, m, &flat, 1.0));
            }
            let _ = B::sync(device);
        });
        B::release_weight_copies();
        Point { size: params as f64, seconds }
    };
    let rate = |plan: OptimizerPlan| {
        let few = time(&plan, &chain(4, 1024));
        let many = time(&plan, &chain(64, 16));
        update_rate((8, few), (128, many))
    };
    OptimizerRates {
        sgd: rate(OptimizerPlan::Sgd { lr: 1e-3, momentum: 0.0, weight_decay: 0.0 }),
        momentum: rate(OptimizerPlan::Sgd { lr: 1e-3, momentum: 0.9, weight_decay: 0.0 }),
        adam: rate(OptimizerPlan::Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            decay_biases_and_norms: true,
        }),
    }
}

/// The seconds per tensor `a` and per parameter `r` of an update from two timings, each
/// of (tensors, parameters in `size`): t = a · tensors + r · parameters, both at least 0.
pub fn update_rate((t1, p1): (usize, Point), (t2, p2): (usize, Point)) -> UpdateRate {
    let (t1, t2) = (t1 as f64, t2 as f64);
    let det = t1 * p2.size - t2 * p1.size;
    let (a, r) = if det.abs() > 0.0 {
        ((p1.seconds * p2.size - p2.seconds * p1.size) / det, (t1 * p2.seconds - t2 * p1.seconds) / det)
    } else {
        (0.0, p1.seconds / p1.size.max(1.0))
    };
    // a negative part is measurement noise: the other figure alone then explains both
    match (a >= 0.0, r >= 0.0) {
        (true, true) => UpdateRate { per_tensor: a, per_parameter: r },
        (false, _) => UpdateRate { per_tensor: 0.0, per_parameter: (p1.seconds + p2.seconds) / (p1.size + p2.size) },
        (true, false) => UpdateRate { per_tensor: (p1.seconds + p2.seconds) / (t1 + t2), per_parameter: 0.0 },
    }
}

/// The cost of one kernel as training runs it, through autodiff: a chain of `CHAIN`
/// one-value operations, forward and backward, over its `2 · CHAIN` kernels (the graph's
/// bookkeeping, the dispatch and the gradient's own kernels included).
pub fn autodiff_launch<B: burn::tensor::backend::AutodiffBackend>(device: &B::Device, reps: usize) -> f64 {
    const CHAIN: usize = 64;
    let x = Tensor::<B, 1>::ones([1], device).require_grad();
    let t = median_seconds(reps, reps.max(3), || {
        let mut y = x.clone();
        for _ in 0..CHAIN {
            y = y.clone() * 1.0001 + 0.5;
        }
        let grads = y.sum().backward();
        let _ = x.grad(&grads);
        // a queueing backend (a GPU) has run them too: one wait over the 4 · CHAIN kernels
        let _ = B::sync(device);
    });
    // each step of the chain is two operations (a scale and an add), each with a backward
    t / (4 * CHAIN) as f64
}

/// Calibrates the CPU backend (`flex`, as the executor's workers run it: one thread each),
/// the launch measured through autodiff as the executor trains.
pub fn calibrate_cpu(memory: f64, reps: usize) -> Result<Calibration, String> {
    calibrate_cpu_concurrent(memory, reps, 1)
}

/// Where copies measuring at once meet before each point: a barrier that a copy which
/// failed breaks, so that the others stop instead of waiting for it forever (as they would
/// at a `std::sync::Barrier`).
pub(crate) struct Meeting {
    /// (copies arrived at the current meeting, meetings held, broken)
    state: std::sync::Mutex<(usize, u64, bool)>,
    turned: std::sync::Condvar,
    copies: usize,
}

impl Meeting {
    pub(crate) fn new(copies: usize) -> Meeting {
        Meeting {
            state: std::sync::Mutex::new((0, 0, false)),
            turned: std::sync::Condvar::new(),
            copies: copies.max(1),
        }
    }

    /// Waits until every copy has arrived; false when one has failed (then at once).
    pub(crate) fn wait(&self) -> bool {
        let Ok(mut st) = self.state.lock() else { return false };
        if st.2 {
            return false;
        }
        st.0 += 1;
        if st.0 == self.copies {
            st.0 = 0;
            st.1 += 1;
            self.turned.notify_all();
            return true;
        }
        let held = st.1;
        while st.1 == held && !st.2 {
            st = match self.turned.wait(st) {
                Ok(st) => st,
                Err(_) => return false,
            };
        }
        !st.2
    }

    /// A copy failed: every waiting and later meeting returns false.
    pub(crate) fn break_off(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.2 = true;
        }
        self.turned.notify_all();
    }
}

/// Rounds of the CPU calibration's sweep, averaged point by point.
const ROUNDS: usize = 3;

/// [`calibrate_cpu`] with `threads` copies measuring at once, each point started together:
/// on the CPU a plan's devices are worker threads of one process sharing its cores, caches
/// and memory bus, so a device file for a plan of N devices on this machine is measured N
/// at a time. Each point's time is the mean of the copies' medians. A copy that fails
/// (panics) stops the others at their next meeting, and the calibration fails.
pub fn calibrate_cpu_concurrent(memory: f64, reps: usize, threads: usize) -> Result<Calibration, String> {
    let threads = threads.max(1);
    let meeting = Meeting::new(threads);
    let meet = || {
        if !meeting.wait() {
            panic!("another copy of the calibration failed");
        }
    };
    let one = || -> Result<Calibration, String> {
        meet();
        let launch = autodiff_launch::<crate::CpuBackend>(&Default::default(), reps.max(3));
        // the adds and functions as the kernels run them; the products as the executor's
        // layers run them in a step (the bare products are not timed)
        let kernels = Sweep { products: &[], ..Sweep::CPU };
        let c = calibrate::<burn::backend::Flex>(&Default::default(), memory, reps, ("", launch), kernels, &meet);
        let products = layer_products::<crate::CpuBackend>(&Default::default(), reps, Sweep::CPU.products, &meet)?;
        meet();
        let mut functions = c.functions;
        functions.extend(function_gradients::<crate::CpuBackend>(
            &Default::default(),
            Sweep::CPU.function_elements,
            reps,
        ));
        let attention = attention_passes::<crate::CpuBackend>(&Default::default(), reps, ATTENTION_SHAPES, &meet)?;
        meet();
        let optimizer = optimizer_rates::<crate::CpuBackend>(&Default::default(), reps);
        let mut c = fitted("", memory, launch, products, c.adds, functions);
        c.device.optimizer = Some(optimizer);
        c.attention = attention;
        Ok(c)
    };
    let guarded = || {
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(one));
        if !matches!(run, Ok(Ok(_))) {
            meeting.break_off();
        }
        run.ok()
    };
    // ROUNDS rounds of the whole sweep, every point then averaged over rounds and copies: a
    // calibration of this 2-core machine taken in one round moved its fitted product rate
    // by up to 6% from one minute to the next
    let mut all = Vec::new();
    for _ in 0..ROUNDS {
        let runs: Vec<Result<Calibration, String>> = if threads == 1 {
            guarded().into_iter().collect()
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads).map(|_| s.spawn(guarded)).collect();
                handles.into_iter().filter_map(|h| h.join().ok().flatten()).collect()
            })
        };
        if let Some(Err(e)) = runs.iter().find(|r| r.is_err()) {
            return Err(format!("the calibration failed: {e}"));
        }
        let runs: Vec<Calibration> = runs.into_iter().filter_map(Result::ok).collect();
        if runs.len() < threads {
            return Err(format!(
                "{} of the {threads} calibration copies failed (see the panic above)",
                threads - runs.len()
            ));
        }
        all.extend(runs);
    }
    let runs = all;
    let name = match threads {
        1 => "cpu (pipec calibrate)".to_string(),
        n => format!("cpu (pipec calibrate, {n} at once)"),
    };
    let mut c = mean_calibration(&runs, memory, &name);
    fit_product_traffic(&mut c);
    c.device.attention = attention_rates(&c.attention);
    Ok(c)
}

/// The calibration whose every point is the mean of `runs`' (same sweep), fitted again.
fn mean_calibration(runs: &[Calibration], memory: f64, name: &str) -> Calibration {
    let n = runs.len().max(1) as f64;
    let mean = |f: &dyn Fn(&Calibration) -> f64| runs.iter().map(f).sum::<f64>() / n;
    let Some(first) = runs.first() else {
        return fitted(name, memory, 0.0, vec![], vec![], vec![]);
    };
    let launch = mean(&|c| c.device.launch);
    let products: Vec<((usize, usize, usize), Point)> = (0..first.products.len())
        .map(|i| {
            (first.products[i].0, Point { size: first.products[i].1.size, seconds: mean(&|c| c.products[i].1.seconds) })
        })
        .collect();
    let adds: Vec<(usize, Point)> = (0..first.adds.len())
        .map(|i| (first.adds[i].0, Point { size: first.adds[i].1.size, seconds: mean(&|c| c.adds[i].1.seconds) }))
        .collect();
    let functions: Vec<(&'static str, Point)> = (0..first.functions.len())
        .map(|i| {
            let (f, p) = first.functions[i];
            (f, Point { size: p.size, seconds: mean(&|c| c.functions[i].1.seconds) })
        })
        .collect();
    let mut c = fitted(name, memory, launch, products, adds, functions);
    c.attention = (0..first.attention.len())
        .map(|i| (first.attention[i].0, mean(&|c| c.attention[i].1), mean(&|c| c.attention[i].2)))
        .collect();
    // the optimizer's figures, averaged over the copies that measured them
    let rates: Vec<OptimizerRates> = runs.iter().filter_map(|c| c.device.optimizer).collect();
    if !rates.is_empty() {
        let k = rates.len() as f64;
        let avg = |f: &dyn Fn(&OptimizerRates) -> UpdateRate| UpdateRate {
            per_tensor: rates.iter().map(|r| f(r).per_tensor).sum::<f64>() / k,
            per_parameter: rates.iter().map(|r| f(r).per_parameter).sum::<f64>() / k,
        };
        c.device.optimizer =
            Some(OptimizerRates { sgd: avg(&|r| r.sgd), momentum: avg(&|r| r.momentum), adam: avg(&|r| r.adam) });
    }
    c
}

/// Calibrates the first CUDA device.
#[cfg(feature = "cuda")]
pub fn calibrate_cuda(memory: f64, reps: usize) -> Calibration {
    let device = burn::backend::cuda::CudaDevice::new(0);
    let launch = autodiff_launch::<burn::backend::Autodiff<burn::backend::Cuda>>(&device, reps.max(3));
    let mut c = calibrate::<burn::backend::Cuda>(
        &device,
        memory,
        reps,
        ("cuda:0 (pipec calibrate)", launch),
        Sweep::GPU,
        &|| {},
    );
    c.device.optimizer = Some(optimizer_rates::<burn::backend::Autodiff<burn::backend::Cuda>>(&device, reps));
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_products_fit_finds_the_traffic_the_points_were_made_with() {
        // points from 2e11 FLOP/s reaching half of it at 1e6 FLOPs, operands beyond 1 MiB at
        // 1e10 B/s, a launch of 0.3 µs: the sweep's shapes
        let (rate, half, traffic, launch) = (2e11, 1e6, ProductTraffic { bandwidth: 1e10, cached: 1048576.0 }, 3e-7);
        let mut d = DeviceModel::uniform("truth", 1e9, rate);
        (d.matrix_efficiency, d.product_traffic, d.launch) = (Curve { peak: 1.0, half }, Some(traffic), launch);
        let points: Vec<(f64, f64, f64)> = Sweep::CPU
            .products
            .iter()
            .map(|&s| {
                let (f, b) = (2.0 * (s.0 * s.1 * s.2) as f64, product_bytes(s));
                (f, b, d.matrix_time(f, b, pipec_plan::Precision::Fp32))
            })
            .collect();
        let (r, h, t, e) = fit_products_with_traffic(&points, launch).expect("fits");
        assert!((r / rate - 1.0).abs() < 1e-3 && h == half && t == traffic && e < 1e-6, "{r} {h} {t:?} {e}");
        // points a product's compute alone explains: the roofline the first fit made fits
        // them exactly, and the refit keeps a model as close
        let compute = |s: (usize, usize, usize)| launch + (2.0 * (s.0 * s.1 * s.2) as f64 + half) / rate;
        let mut c = fitted(
            "compute",
            1e9,
            launch,
            Sweep::CPU
                .products
                .iter()
                .map(|&s| (s, Point { size: 2.0 * (s.0 * s.1 * s.2) as f64, seconds: compute(s) }))
                .collect(),
            vec![(1 << 10, Point { size: 12288.0, seconds: 1e-6 }), (1 << 20, Point { size: 1.2e7, seconds: 1e-4 })],
            vec![],
        );
        fit_product_traffic(&mut c);
        for &(s, p) in &c.products {
            let t = c.device.matrix_time(p.size, product_bytes(s), pipec_plan::Precision::Fp32);
            assert!((t / p.seconds - 1.0).abs() < 1e-3, "{s:?}: {t} against {}", p.seconds);
        }
    }

    #[test]
    fn the_attention_fit_recovers_its_terms_and_never_goes_negative() {
        let truth = AttentionFit { per_call: 2e-5, per_mac: 3e-11, per_score: 4e-9, per_value: 5e-9 };
        let at = |f: &AttentionFit, (b, s, h, dh): AttentionShape| f.seconds((b * h) as f64, s as f64, dh as f64);
        let points: Vec<(AttentionShape, f64)> = ATTENTION_SHAPES.iter().map(|&s| (s, at(&truth, s))).collect();
        let fit = fit_attention(&points).expect("fits");
        for (got, want) in [
            (fit.per_call, truth.per_call),
            (fit.per_mac, truth.per_mac),
            (fit.per_score, truth.per_score),
            (fit.per_value, truth.per_value),
        ] {
            assert!((got / want - 1.0).abs() < 1e-6, "{fit:?}");
        }
        // times that fall with the scores (a negative coefficient would fit them best): that
        // term is dropped, and the rest are fitted without it
        let falling: Vec<(AttentionShape, f64)> =
            points.iter().map(|&((b, s, h, dh), t)| ((b, s, h, dh), t - 4.5e-9 * (b * h * s * s) as f64)).collect();
        assert!(falling.iter().all(|p| p.1 > 0.0), "{falling:?}");
        let fit = fit_attention(&falling).expect("fits");
        assert!([fit.per_call, fit.per_mac, fit.per_value].iter().all(|c| *c > 0.0) && fit.per_score == 0.0, "{fit:?}");
        assert!(fit_attention(&[]).is_none());
    }

    #[test]
    fn the_executors_attention_is_timed_forward_and_backward() {
        let points =
            attention_passes::<crate::CpuBackend>(&Default::default(), 3, &[(1, 8, 2, 4), (2, 16, 2, 8)], &|| {})
                .expect("runs");
        assert_eq!(points.iter().map(|p| p.0).collect::<Vec<_>>(), vec![(1, 8, 2, 4), (2, 16, 2, 8)]);
        assert!(points.iter().all(|&(_, f, b)| f > 0.0 && b > 0.0 && f.is_finite() && b.is_finite()), "{points:?}");
    }

    #[test]
    fn a_functions_gradient_is_timed_beyond_its_forward() {
        let g = function_gradients::<crate::CpuBackend>(&Default::default(), 4096, 3);
        let names: Vec<&str> = g.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["gelu_grad", "gelu_tanh_grad", "silu_grad", "tanh_grad"]);
        assert!(g.iter().all(|(_, p)| p.size == 4096.0 && p.seconds > 0.0 && p.seconds.is_finite()), "{g:?}");
        let f = function_rates(&g, 0.0);
        assert!(f.gelu_grad > 0.0 && f.tanh_grad > 0.0 && f.gelu == 0.0, "{f:?}");
    }

    #[test]
    fn a_layers_products_are_timed_through_autodiff_one_product_a_point() {
        let points = layer_products::<crate::CpuBackend>(&Default::default(), 3, &[(8, 16, 32), (16, 64, 64)], &|| {})
            .expect("linear layers run");
        assert_eq!(points.iter().map(|p| p.0).collect::<Vec<_>>(), vec![(8, 16, 32), (16, 64, 64)]);
        for ((m, k, n), p) in points {
            assert_eq!(p.size, 2.0 * (m * k * n) as f64);
            assert!(p.seconds > 0.0 && p.seconds.is_finite(), "{p:?}");
        }
    }

    #[test]
    fn a_meeting_lets_copies_through_together_and_a_failed_copy_stops_the_others() {
        // three copies meet twice
        let meeting = Meeting::new(3);
        let passed: Vec<bool> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3).map(|_| s.spawn(|| meeting.wait() && meeting.wait())).collect();
            handles.into_iter().map(|h| h.join().expect("joins")).collect()
        });
        assert_eq!(passed, vec![true; 3]);
        // one of three fails before the meeting: the two waiting are let go, refused
        let meeting = Meeting::new(3);
        let waited: Vec<bool> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2).map(|_| s.spawn(|| meeting.wait())).collect();
            std::thread::sleep(std::time::Duration::from_millis(50));
            meeting.break_off();
            handles.into_iter().map(|h| h.join().expect("joins")).collect()
        });
        assert_eq!(waited, vec![false, false]);
        assert!(!meeting.wait(), "a broken meeting stays broken");
    }

    #[test]
    fn an_updates_rates_are_solved_from_two_timings() {
        // 50 µs per tensor and 2 ns per parameter: 8 tensors of 4.2 M, 128 of 17,408
        let t = |tensors: usize, params: f64| {
            (tensors, Point { size: params, seconds: tensors as f64 * 50e-6 + params * 2e-9 })
        };
        let r = update_rate(t(8, 4.2e6), t(128, 17_408.0));
        assert!((r.per_tensor - 50e-6).abs() < 1e-12 && (r.per_parameter - 2e-9).abs() < 1e-18, "{r:?}");
        // noise that makes one part negative: the other explains both timings on average
        let r = update_rate((8, Point { size: 4.2e6, seconds: 1e-3 }), (128, Point { size: 17_408.0, seconds: 1e-6 }));
        assert!(r.per_tensor == 0.0 && r.per_parameter > 0.0, "{r:?}");
    }

    #[test]
    fn the_plans_parameter_tensors_are_the_executors() {
        use pipec_plan::model::Op;
        let ops = [
            Op::Linear { in_features: 4, out_features: 3, bias: true },
            Op::Linear { in_features: 3, out_features: 4, bias: false },
            Op::LayerNorm { dim: 4, eps: 1e-5 },
            Op::RmsNorm { dim: 4, eps: 1e-5 },
            Op::Lstm { input: 4, hidden: 4 },
            Op::block(16, 2, 32, true),
            Op::llama_block(16, 4, 2, 24),
        ];
        for op in &ops {
            let model = crate::nn::layers::StageModel::<crate::CpuBackend>::new(
                std::slice::from_ref(op),
                0,
                1,
                &Default::default(),
            );
            let layout = crate::nn::params::layout::<crate::CpuBackend, _>(&model);
            assert_eq!(op.parameter_tensors(), layout.len(), "{op:?}");
        }
    }

    #[test]
    fn a_line_through_exact_points_is_found_and_gives_the_device_back() {
        // a device of 1e11 FLOP/s with half = 2e6 FLOPs, 10 GB/s with half = 1e5 bytes,
        // launching in 5 µs: its own times give it back
        let launch = 5e-6;
        let products: Vec<Point> =
            [1e5, 1e6, 1e7, 1e8].iter().map(|&f| Point { size: f, seconds: launch + (f + 2e6) / 1e11 }).collect();
        let adds: Vec<(usize, Point)> = [1000usize, 100_000, 1_000_000]
            .iter()
            .map(|&n| (n, Point { size: 12.0 * n as f64, seconds: launch + (12.0 * n as f64 + 1e5) / 1e10 }))
            .collect();
        let d = fit("test", 1e9, launch, &products, &adds);
        assert!((d.matrix.fp32 / 1e11 - 1.0).abs() < 1e-9, "{}", d.matrix.fp32);
        assert!((d.matrix_efficiency.half / 2e6 - 1.0).abs() < 1e-6, "{}", d.matrix_efficiency.half);
        assert!((d.memory_bandwidth / 1e10 - 1.0).abs() < 1e-9, "{}", d.memory_bandwidth);
        assert!((d.memory_efficiency.half / 1e5 - 1.0).abs() < 1e-6, "{}", d.memory_efficiency.half);
        // the fitted model prices the points as measured
        for p in &products {
            let t = d.matrix_time(p.size, 0.0, pipec_plan::Precision::Fp32);
            assert!((t / p.seconds - 1.0).abs() < 1e-6, "{t} vs {}", p.seconds);
        }
        assert!(DeviceModel::from_json(&serde_json::to_string(&d).expect("json")).is_ok());
        assert_eq!(fit_line(&products[..1]), None);
    }

    #[test]
    fn the_cpu_calibration_gives_a_device_file_the_front_end_reads() {
        let c = calibrate_cpu(4e9, 3).expect("calibrates");
        let d = &c.device;
        assert!(d.matrix.fp32 > 0.0 && d.memory_bandwidth > 0.0 && d.vector > 0.0 && d.launch > 0.0, "{d:?}");
        assert_eq!(c.products.len(), Sweep::CPU.products.len());
        assert_eq!(c.adds.len(), Sweep::CPU.adds.len());
        // every element-wise function the cost model prices by its own rate was measured
        let f = d.functions;
        assert_eq!(c.functions.len(), 9);
        let rates =
            [f.exp, f.gelu, f.gelu_tanh, f.silu, f.tanh, f.gelu_grad, f.gelu_tanh_grad, f.silu_grad, f.tanh_grad];
        assert!(rates.iter().all(|r| r.is_finite() && *r > 0.0), "{f:?}");
        // the products were fitted with their traffic beyond the cache, or the roofline
        // where that was closer: either way every figure is one a device file takes
        if let Some(t) = d.product_traffic {
            assert!(t.bandwidth > 0.0 && t.cached >= 0.0, "{t:?}");
        }
        // the executor's attention was timed over the sweep and fitted
        assert_eq!(c.attention.len(), ATTENTION_SHAPES.len());
        assert!(d.attention.is_some(), "{d:?}");
        let mut bad = d.clone();
        if let Some(a) = bad.attention.as_mut() {
            a.backward.per_score = -1.0;
        }
        assert!(DeviceModel::from_json(&serde_json::to_string(&bad).expect("json")).is_err());
        let back = DeviceModel::from_json(&serde_json::to_string(d).expect("json")).expect("a valid device file");
        assert!((back.functions.gelu / f.gelu - 1.0).abs() < 1e-12, "{:?}", back.functions);
        // a negative rate in a device file is refused
        let mut bad = d.clone();
        bad.functions.exp = -1.0;
        assert!(DeviceModel::from_json(&serde_json::to_string(&bad).expect("json")).is_err());
    }

    #[test]
    fn copies_measured_at_once_average_point_by_point_before_the_fit() {
        // two copies of a device, one twice as slow on every point: the mean device's
        // points are 1.5× the fast one's, and so is its fit (rates 1/1.5, launch 1.5×)
        let device = |k: f64| {
            let launch = k * 2e-6;
            let products = [1e6, 1e7, 1e8]
                .iter()
                .map(|&f| ((1, 1, 1), Point { size: f, seconds: k * (2e-6 + f / 1e11) }))
                .collect::<Vec<_>>();
            let adds =
                [1e4, 1e6].iter().map(|&b| (1usize, Point { size: b, seconds: k * (2e-6 + b / 1e10) })).collect();
            let functions = vec![("exp", Point { size: 65536.0, seconds: k * (2e-6 + 65536.0 / 1e9) })];
            fitted("x", 1e9, launch, products, adds, functions)
        };
        let (fast, slow) = (device(1.0), device(2.0));
        let mean = mean_calibration(&[fast.clone(), slow], 1e9, "two at once");
        assert_eq!(mean.device.name, "two at once");
        for (m, f) in mean.products.iter().zip(&fast.products) {
            assert!((m.1.seconds / f.1.seconds - 1.5).abs() < 1e-12, "{m:?} {f:?}");
        }
        assert!((fast.device.matrix.fp32 / mean.device.matrix.fp32 - 1.5).abs() < 1e-9);
        assert!((fast.device.memory_bandwidth / mean.device.memory_bandwidth - 1.5).abs() < 1e-9);
        assert!((mean.device.launch / fast.device.launch - 1.5).abs() < 1e-12);
        assert!((fast.device.functions.exp / mean.device.functions.exp - 1.5).abs() < 1e-9);
    }

    #[test]
    fn a_functions_rate_is_its_elements_over_its_time_beyond_the_launch() {
        let launch = 1e-6;
        let measured = [("exp", Point { size: 65536.0, seconds: launch + 65536.0 / 2.5e8 })];
        let f = function_rates(&measured, launch);
        assert!((f.exp / 2.5e8 - 1.0).abs() < 1e-9, "{}", f.exp);
        // what was not measured stays 0: priced by its FLOPs
        assert_eq!((f.gelu, f.gelu_tanh, f.silu, f.tanh), (0.0, 0.0, 0.0, 0.0));
    }
}

/// What a calibration measured of the transport between the executor's workers.
#[derive(Debug, Clone)]
pub struct LinkCalibration {
    /// The workers the all-reduces ran over.
    pub devices: usize,
    /// Point-to-point messages between two workers: bytes and one-way seconds.
    pub p2p: Vec<Point>,
    /// Ring all-reduces over `devices` workers: bytes per member and seconds.
    pub all_reduce: Vec<Point>,
    pub link: pipec_plan::device::MeasuredLink,
}

/// Values per message of the link sweep (4 KiB to 32 MiB).
const LINK_SIZES: &[usize] = &[1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23];

/// Measures the in-process transport `pipec run` uses between its worker threads (the
/// same channels and the same ring all-reduce, `transport::ring_all_reduce`):
/// point-to-point messages by ping-pong between two workers, then ring all-reduces over
/// `devices` workers of a gradient as the executor reduces one (read back from the CPU
/// backend, summed, made a tensor again), each the median of `reps` (every member's time,
/// the slowest counted). The link: the messages' line (latency, bandwidth), and the efficiency that
/// makes the cost model's ring formula give the all-reduces' measured bus bandwidth.
pub fn calibrate_links(devices: usize, reps: usize) -> LinkCalibration {
    use crate::comm::transport::{in_process, Endpoint};
    use pipec_plan::{vocab::ReduceMode, CollectiveKind, DeviceId};
    let devices = devices.max(2);
    let reps = reps.max(3);
    let ids: Vec<DeviceId> = (0..devices as u32).map(DeviceId).collect();
    let connect = || in_process::connect(&ids, Default::default(), std::time::Duration::from_secs(120)).into_iter();
    // one-way time of a message: half a round trip
    let p2p: Vec<Point> = LINK_SIZES
        .iter()
        .map(|&n| {
            let mut eps = connect();
            let (mut a, mut b) = (eps.next().expect("two endpoints"), eps.next().expect("two endpoints"));
            let echo = std::thread::spawn(move || {
                for _ in 0..reps + 1 {
                    let Ok(v) = b.coll_recv(DeviceId(0)) else { return };
                    if b.coll_send(DeviceId(0), v).is_err() {
                        return;
                    }
                }
            });
            // the messages made before the timing: a send moves what the worker computed
            let mut pool: Vec<Vec<f32>> = (0..reps + 1).map(|_| vec![1.0f32; n]).collect();
            let seconds = median_seconds(1, reps, || {
                let payload = pool.pop().unwrap_or_default();
                if a.coll_send(DeviceId(1), payload).is_ok() {
                    let _ = a.coll_recv(DeviceId(1));
                }
            }) / 2.0;
            let _ = echo.join();
            Point { size: (n * 4) as f64, seconds }
        })
        .collect();
    let all_reduce: Vec<Point> = LINK_SIZES
        .iter()
        .map(|&n| {
            let barrier = std::sync::Barrier::new(devices);
            let times: Vec<f64> = std::thread::scope(|s| {
                let handles: Vec<_> = connect()
                    .map(|mut ep| {
                        let (ids, barrier) = (&ids, &barrier);
                        s.spawn(move || {
                            // every member starts each one together, on a gradient as the
                            // executor holds it: read back from the backend, summed, made a
                            // tensor again
                            let dev = Default::default();
                            let grad = Tensor::<burn::backend::Flex, 1>::ones([n], &dev);
                            let mut t: Vec<f64> = (0..=reps)
                                .map(|_| {
                                    barrier.wait();
                                    let start = Instant::now();
                                    let data =
                                        crate::nn::params::host_f32(grad.clone().into_data()).unwrap_or_default();
                                    if let Ok(sum) =
                                        ep.collective(CollectiveKind::AllReduce, ids, data, ReduceMode::Ring, None)
                                    {
                                        let back = Tensor::<burn::backend::Flex, 1>::from_data(
                                            burn::tensor::TensorData::new(sum, [n]),
                                            &dev,
                                        );
                                        std::hint::black_box(back);
                                    }
                                    start.elapsed().as_secs_f64()
                                })
                                .skip(1)
                                .collect();
                            t.sort_by(f64::total_cmp);
                            t[t.len() / 2]
                        })
                    })
                    .collect();
                handles.into_iter().filter_map(|h| h.join().ok()).collect()
            });
            Point { size: (n * 4) as f64, seconds: times.into_iter().fold(0.0, f64::max) }
        })
        .collect();
    LinkCalibration { devices, link: fit_link(&p2p, &all_reduce, devices), p2p, all_reduce }
}

/// The link of [`calibrate_links`]' points: the messages' line gives the latency and the
/// bandwidth (the largest message's rate where the line is flat); the largest all-reduce
/// gives the bus bandwidth — its `2(p−1)/p · bytes` over its time less the ring's
/// `2(p−1)` latencies — whose share of the bandwidth is the efficiency (the bandwidth
/// raised to the bus bandwidth where it is the larger). The largest, not a line through
/// all: on a CPU the all-reduces leave the caches as they grow (an 8 MiB one ran at 2.5×
/// the rate of a 32 MiB one here), and the reductions that matter are the gradients'.
pub fn fit_link(p2p: &[Point], all_reduce: &[Point], devices: usize) -> pipec_plan::device::MeasuredLink {
    let largest_rate = |ps: &[Point]| ps.last().map_or(1e9, |p| p.size / p.seconds.max(1e-12));
    let (bandwidth, latency) = match fit_line(p2p) {
        Some((slope, intercept)) if slope > 0.0 => (1.0 / slope, intercept.max(0.0)),
        _ => (largest_rate(p2p), p2p.first().map_or(0.0, |p| p.seconds)),
    };
    let p = devices.max(2) as f64;
    let bus = all_reduce
        .iter()
        .max_by(|a, b| a.size.total_cmp(&b.size))
        .map(|q| {
            let wire = (q.seconds - 2.0 * (p - 1.0) * latency).max(q.seconds / 2.0);
            2.0 * (p - 1.0) / p * q.size / wire.max(1e-12)
        })
        .unwrap_or(bandwidth);
    let bandwidth = bandwidth.max(bus);
    pipec_plan::device::MeasuredLink { bandwidth, latency, efficiency: (bus / bandwidth).clamp(1e-9, 1.0) }
}

#[cfg(test)]
mod link_tests {
    use super::*;

    #[test]
    fn the_link_fit_recovers_the_figures_that_made_the_points() {
        // 5 µs per message at 8 GB/s; four workers' all-reduces at a 2 GB/s bus bandwidth
        let (latency, bandwidth, bus, p) = (5e-6, 8e9, 2e9, 4.0);
        let sizes = [4e3, 6.4e4, 1e6, 8e6, 3.2e7];
        let p2p: Vec<Point> = sizes.iter().map(|&b| Point { size: b, seconds: latency + b / bandwidth }).collect();
        let ring = |b: f64| 2.0 * (p - 1.0) * latency + 2.0 * (p - 1.0) / p * b / bus;
        let all_reduce: Vec<Point> = sizes.iter().map(|&b| Point { size: b, seconds: ring(b) }).collect();
        let l = fit_link(&p2p, &all_reduce, 4);
        assert!((l.latency - latency).abs() < 1e-9, "{l:?}");
        assert!((l.bandwidth / bandwidth - 1.0).abs() < 1e-6, "{l:?}");
        assert!((l.efficiency - 0.25).abs() < 1e-6, "{l:?}");
        // messages that cost no more as they grow (moved, not copied): the largest one's
        // rate, and an all-reduce faster than that raises the bandwidth to its own
        let flat: Vec<Point> = sizes.iter().map(|&b| Point { size: b, seconds: 2e-6 }).collect();
        let l = fit_link(&flat, &all_reduce, 4);
        assert!((l.bandwidth / (3.2e7 / 2e-6) - 1.0).abs() < 1e-6 && l.efficiency < 1.0, "{l:?}");
        let slow: Vec<Point> = sizes.iter().map(|&b| Point { size: b, seconds: b / 1e8 }).collect();
        // (the messages' line has no latency: the largest all-reduce's 6 latencies count
        // as its wire time, 0.1% of it)
        let l = fit_link(&slow, &all_reduce, 4);
        assert!((l.bandwidth / bus - 1.0).abs() < 2e-3 && l.efficiency == 1.0, "{l:?}");
    }
}
