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

use burn::tensor::{Distribution, Tensor};
use pipec_plan::device::{Curve, DeviceModel, MatrixRates, OptimizerRates, UpdateRate};

use crate::backend::gated::Gate;
use crate::backend::kernels::{self, Kernels};

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
    /// Per product of [`products`](Self::products) timed as the executor's layers run it
    /// (the CPU), the layer's split backward: its seconds (its input, weight and bias
    /// gradients) and its weight half's; empty where the bare products were timed.
    pub backward: Vec<[f64; 2]>,
}

/// The median of `reps` timings of `f` after `warmup` untimed runs.
fn median_seconds(warmup: usize, reps: usize, f: impl FnMut()) -> f64 {
    median_seconds_after(warmup, reps, || (), f)
}

/// [`median_seconds`] with `before` run untimed ahead of each timed run.
fn median_seconds_after(warmup: usize, reps: usize, mut before: impl FnMut(), mut f: impl FnMut()) -> f64 {
    for _ in 0..warmup {
        f();
    }
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            before();
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Bytes written between timed updates so that an update finds its tensors where a step's
/// passes leave them: out of the caches. On the Xeon of docs/benchmarks.md an SGD-like pass
/// over a 4 MiB matrix (`w -= 0.01 · g`, a scratch program) took 0.29 ms after 8–32 MiB had
/// been written, 0.36 ms after 64 MiB and 0.47–0.51 ms after 128–512 MiB.
const EVICT_BYTES: usize = 256 << 20;

/// Writes one byte of every cache line of `buffer` (a new value each call).
fn evict(buffer: &mut [u8], round: &mut u8) {
    *round = round.wrapping_add(1);
    for b in buffer.iter_mut().step_by(64) {
        *b = *round;
    }
    std::hint::black_box(&buffer[0]);
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
    let mut functions: Vec<(&'static str, Point)> = [
        ("exp", time(&|t| t.exp())),
        ("gelu", time(&|t| kernels::gelu(t, kernels::Gelu::Erf))),
        ("gelu_tanh", time(&|t| kernels::gelu(t, kernels::Gelu::Tanh))),
        ("silu", time(&|t| activation::silu(t))),
        ("tanh", time(&|t| t.tanh())),
    ]
    .into_iter()
    .map(|(name, seconds)| (name, Point { size: sweep.function_elements as f64, seconds }))
    .collect();
    // a gated unit's activation as the executor runs it (`Kernels::gated`), by its output's
    // elements: the gate's half of the input, then the up's
    let both = Tensor::<B, 1>::random([2 * sweep.function_elements], Distribution::Uniform(-3.0, 3.0), device);
    for (name, gate) in [("silu_gated", Gate::Silu), ("gelu_gated", Gate::Gelu)] {
        let seconds = per_kernel(&|| Box::new(crate::backend::kernels::gated(both.clone(), gate)));
        functions.push((name, Point { size: sweep.function_elements as f64, seconds }));
    }
    // the cross-entropy as the executor runs it (`Kernels::cross_entropy`), by its logits
    let (rows, classes, labels) = loss_case(sweep.function_elements);
    let logits = x.clone().reshape([rows, classes]);
    let seconds = per_kernel(&|| Box::new(crate::backend::kernels::cross_entropy(logits.clone(), labels.clone())));
    functions.push(("cross_entropy", Point { size: (rows * classes) as f64, seconds }));
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
    Calibration { device, products, adds, functions, attention: Vec::new(), backward: Vec::new() }
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
        // one fp32 path: bf16 and fp16 products fall back to its rate
        matrix: MatrixRates { fp32: rate, tf32: 0.0, bf16: 0.0, fp16: 0.0, fp8: 0.0 },
        vector,
        memory_bandwidth: bandwidth,
        launch,
        matrix_efficiency: Curve { peak: 1.0, half: matrix_half },
        memory_efficiency: Curve { peak: 1.0, half: memory_half },
        ..DeviceModel::uniform(name, memory, rate)
    }
}

/// The executor's optimizer updates timed on `B`: for each optimizer, one update of a few
/// large tensors (4 × linear(1024, 1024): 4.2 M parameters in 8 tensors) and of many small
/// ones (64 × linear(16, 16): 17,408 in 128), each the median of `reps`, solved for the
/// seconds per tensor and per parameter ([`update_rate`]). An update is what a step's runs:
/// the gradients handed to Burn's optimizer and its step, each update timed after
/// [`EVICT_BYTES`] of host memory were written, as a step's passes leave the update's
/// tensors out of the caches (a GPU's own memory is not touched).
pub fn optimizer_rates<B: crate::backend::kernels::ExecBackend>(device: &B::Device, reps: usize) -> OptimizerRates {
    use pipec_plan::model::Op;
    use pipec_plan::plan::OptimizerPlan;
    let chain = |n: usize, width: usize| vec![Op::Linear { in_features: width, out_features: width, bias: true }; n];
    let buffer = std::cell::RefCell::new(vec![0u8; EVICT_BYTES]);
    let time = |plan: &OptimizerPlan, ops: &[Op]| -> Point {
        let mut model = Some(crate::nn::layers::StageModel::<B>::new(ops, 0, 1, device));
        let layout = crate::nn::params::layout::<B, _>(model.as_ref().expect("built"));
        let mut optim = crate::interp::stage::StageOptim::<B, crate::nn::layers::StageModel<B>>::new(
            plan,
            &layout,
            Default::default(),
        );
        let flat: Vec<Option<Tensor<B::InnerBackend, 1>>> = layout
            .iter()
            .map(|(_, shape)| {
                let n = shape.iter().product::<usize>();
                Some(Tensor::random([n], Distribution::Uniform(-1e-3, 1e-3), device))
            })
            .collect();
        let params: usize = layout.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        let mut round = 0u8;
        let before = || evict(&mut buffer.borrow_mut(), &mut round);
        let seconds = median_seconds_after(1, reps.max(3), before, || {
            if let Some(m) = model.take() {
                model = Some(optim.update(1e-3, m, &flat, 1.0));
            }
            let _ = B::sync(device);
        });
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
        let launch = autodiff_launch::<crate::backend::CpuBackend>(&Default::default(), reps.max(3));
        // the adds and functions as the kernels run them; the products as the executor's
        // layers run them in a step (the bare products are not timed)
        let kernels = Sweep { products: &[], ..Sweep::CPU };
        let c = calibrate::<burn::backend::Flex>(&Default::default(), memory, reps, ("", launch), kernels, &meet);
        let (products, backward): (Vec<_>, Vec<_>) =
            layer_products::<crate::backend::CpuBackend>(&Default::default(), reps, Sweep::CPU.products, &meet)?
                .into_iter()
                .map(|(shape, forward, backward)| ((shape, forward), backward))
                .unzip();
        meet();
        let mut functions = c.functions;
        functions.extend(function_gradients::<crate::backend::CpuBackend>(
            &Default::default(),
            Sweep::CPU.function_elements,
            reps,
        ));
        let attention =
            attention_passes::<crate::backend::CpuBackend>(&Default::default(), reps, ATTENTION_SHAPES, &meet)?;
        meet();
        let optimizer = optimizer_rates::<crate::backend::CpuBackend>(&Default::default(), reps);
        meet();
        let data = draw_rates(reps);
        let mut c = fitted("", memory, launch, products, c.adds, functions);
        c.backward = backward;
        c.device.optimizer = Some(optimizer);
        c.device.data = Some(data);
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
                // each copy on a core of its own, as the run's workers are (`affinity`)
                let handles: Vec<_> = (0..threads)
                    .map(|i| {
                        s.spawn(move || {
                            super::affinity::pin(i, threads);
                            guarded()
                        })
                    })
                    .collect();
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
    (c.device.input_gradient, c.device.weight_gradient) = gradient_fits(&c.products, &c.backward, c.device.launch);
    fit_memory_traffic(&mut c);
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
    c.backward = (0..first.backward.len()).map(|i| [0, 1].map(|h| mean(&|c| c.backward[i][h]))).collect();
    c.attention = (0..first.attention.len())
        .map(|i| (first.attention[i].0, mean(&|c| c.attention[i].1), mean(&|c| c.attention[i].2)))
        .collect();
    // the synthetic data's draws, averaged over the copies that measured them
    let draws: Vec<pipec_plan::device::DrawRates> = runs.iter().filter_map(|c| c.device.data).collect();
    if !draws.is_empty() {
        let k = draws.len() as f64;
        let avg = |f: &dyn Fn(&pipec_plan::device::DrawRates) -> f64| draws.iter().map(f).sum::<f64>() / k;
        c.device.data = Some(pipec_plan::device::DrawRates {
            feature: avg(&|r| r.feature),
            token: avg(&|r| r.token),
            score: avg(&|r| r.score),
        });
    }
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

mod adds;
mod draws;
mod functions;
mod link;
mod products;
pub use adds::*;
pub use draws::*;
pub use functions::*;
pub use link::*;
pub use products::*;

#[cfg(test)]
mod tests;

/// This CPU's name (`/proc/cpuinfo`'s model name, else the architecture) and logical CPU
/// count: what a cached calibration of this machine is kept under.
pub fn cpu_name() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name").map(|r| r.trim_start_matches([' ', '\t', ':']).to_string()))
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    format!("{model} × {cpus}")
}

/// What the calibration measures and fits, revised when either changes (2: the element-wise
/// kernels' bytes beyond the cache, [`fit_memory_traffic`], and the synthetic data's draws;
/// 3: the products fitted to the layers' forwards, their weight gradients apart,
/// `gradient_fits`; 4: the layers' weight gradients added into their sums in every
/// timed pass, as a step adds them, where passes after the first update had made them apart;
/// 5: the optimizer updates timed from memory out of the caches, [`EVICT_BYTES`]; 6: the
/// products' compute and traffic combined by a fitted norm, `Traffic::norm`; 7: a gated
/// unit's activation and the cross-entropy timed as the executor runs them, with their
/// gradients; 8: the kernels it times changed speed, their exponentials and GELU vectorized,
/// `crate::backend::flex_exp`, both GELUs timed as the executor runs them, `Kernels::gelu_of`;
/// 9: the layers' backwards timed split, their input and weight gradients fitted apart,
/// [`gradient_fits`]; 10: each copy, and each end of the link, on a core of its own, as the
/// run's workers are, `super::affinity`).
const MEASURES: u32 = 10;

/// The file under `dir` that keeps the calibration of `workers` workers on the CPU `cpu`
/// (`pipec run`'s cache of this machine): named by FNV-1a of the CPU's name, the worker count,
/// this version and [`MEASURES`], so another machine, worker count, version or measurement
/// measures again.
pub fn cache_file(dir: &std::path::Path, cpu: &str, workers: usize) -> std::path::PathBuf {
    let key = format!("{cpu}|{workers}|{}|{MEASURES}", env!("CARGO_PKG_VERSION"));
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    dir.join(format!("cpu-{workers}w-{hash:016x}.json"))
}
