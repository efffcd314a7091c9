//! The products and attentions a calibration times as the executor's layers run them, and
//! the models fitted to them.

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use pipec_plan::device::{AttentionFit, AttentionRates, Curve, ProductFit, Traffic};

use super::*;

/// Linear layers in each calibration stack: a stage's worth, so that large layers' weights
/// and their gradients' sums do not all stay in cache, as in a step.
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
/// between versions untimed), each backward run as a split backward's two halves. A point
/// is one product's FLOPs and a layer's forward, beside the layer's backward seconds (its
/// input, weight and bias gradients) and of those its weight half's (the weight gradient
/// added into the sum: [`gradient_fits`]). The CPU's device file fits
/// its matrix rate and the products' bandwidth to these: a layer's products cost what the
/// executor's layer costs in a step — its autodiff, bias, allocations and the traffic of
/// weights that do not stay in cache included — not what the bare kernel does.
pub fn layer_products<B: crate::backend::kernels::ExecBackend>(
    device: &B::Device,
    reps: usize,
    shapes: &[(usize, usize, usize)],
    at_point: &(dyn Fn() + Sync),
) -> Result<Vec<(Shape, Point, [f64; 2])>, String> {
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
                ("a calibration stack", &crate::run::profile::Reduce::Sum, true),
                input,
            )
            .map_err(|e| format!("timing {m}·{k}·{n} layers: {e}"))?;
            let per_layer = |ms: f64| ms / 1e3 / STACK as f64;
            let (forward, backward, weights) =
                (per_layer(passes.forward), per_layer(passes.backward), per_layer(passes.weights));
            Ok(((m, k, n), Point { size: 2.0 * (m * k * n) as f64, seconds: forward }, [backward, weights]))
        })
        .collect();
    points
}

/// The products' model ([`ProductFit`]: a rate, its curve's half, [`Traffic`]) closest to
/// `points` (FLOPs, operand bytes, seconds) in relative error, with its summed squared
/// relative error: a grid over the norms that combine compute and traffic
/// ([`NORMS`]), the cached bytes (none, or 32 KiB to 32 MiB in √2 steps), the halves (none,
/// or 10²–10¹⁰ FLOPs in quarter decades) and the bandwidths (1 GB/s to 1 TB/s in 12%
/// steps), the rate for each found by golden-section search (10⁸–10¹⁴ FLOP/s).
pub fn fit_products_with_traffic(points: &[(f64, f64, f64)], launch: f64) -> Option<(ProductFit, f64)> {
    if points.len() < 2 || points.iter().any(|&(f, b, t)| !(f > 0.0 && b >= 0.0 && t > 0.0 && t.is_finite())) {
        return None;
    }
    let error = |product: ProductFit| {
        points
            .iter()
            .map(|&(flops, bytes, seconds)| ((launch + product.seconds(flops, bytes, 1.0) - seconds) / seconds).powi(2))
            .sum::<f64>()
    };
    let cached = std::iter::once(0.0).chain((0..=20).map(|i| 32768.0 * 2f64.powf(i as f64 / 2.0)));
    let grid = NORMS.iter().flat_map(|&norm| cached.clone().map(move |cached| (norm, cached)));
    let mut best: Option<(ProductFit, f64)> = None;
    for (norm, cached) in grid {
        let halves = std::iter::once(0.0).chain((0..=32).map(|i| 1e2 * 10f64.powf(i as f64 / 4.0)));
        for half in halves {
            for b in 0..=60 {
                let traffic = Traffic { bandwidth: 1e9 * 10f64.powf(b as f64 / 20.0), cached, norm };
                // golden-section search of log10(rate)
                let g = (5f64.sqrt() - 1.0) / 2.0;
                let at = |x: f64| error(ProductFit { rate: 10f64.powf(x), half, traffic });
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
                if best.is_none_or(|b| e < b.1) {
                    best = Some((ProductFit { rate: 10f64.powf(x), half, traffic }, e));
                }
            }
        }
    }
    best
}

/// The norms a product's compute and traffic may combine by ([`Traffic::norm`]): added,
/// between, and the 2-norm. On the 2-core Xeon (2026-12-07) the layers' forwards of one
/// calibration each, refitted by a scratch program on a coarser grid, left a summed squared
/// relative error of 0.03 and 0.10 (one and two workers) fitted by 1 against 0.13 and 0.29
/// by 2: `gemm` packs the weight, then multiplies.
const NORMS: [f64; 3] = [1.0, 1.5, Traffic::OVERLAPPING];

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
    if let Some((fit, e)) = fit_products_with_traffic(&points, c.device.launch) {
        if e < roofline {
            c.device.matrix.fp32 = fit.rate;
            c.device.matrix_efficiency = Curve { peak: 1.0, half: fit.half };
            c.device.product_traffic = Some(fit.traffic);
        }
    }
}

/// The launches a gradient half must take to be fitted ([`gradient_fits`]).
const GRADIENT_LAUNCHES: f64 = 10.0;

/// The executor's input gradients and weight gradients, each fitted as products of their
/// own ([`fit_products_with_traffic`]) from the layers' split backwards (`[backward, weight
/// half]` per layer of `forwards`): the weight half is the weight gradient added into the
/// step's sum, the rest the input gradient with the bias's and the autodiff's work — in a
/// running step a dense layer's input gradient took 0.8 of its forward and its weight
/// gradient more than the backward beyond the forward (docs/benchmarks.md, "A split
/// backward priced as the executor splits it"). A layer whose half takes less than
/// [`GRADIENT_LAUNCHES`] launches is left out of that half's fit: so short a timing is
/// noise, and a fit in relative error would follow it (one 8·64·64 layer's 0.3 µs, under a
/// launch, once made the fit drop the compute and price the largest layers' weight
/// gradients at half their time). Each None with fewer than two layers left.
pub fn gradient_fits(
    forwards: &[(Shape, Point)],
    backwards: &[[f64; 2]],
    launch: f64,
) -> (Option<ProductFit>, Option<ProductFit>) {
    let fit = |half: &dyn Fn([f64; 2]) -> f64| {
        let points: Vec<(f64, f64, f64)> = forwards
            .iter()
            .zip(backwards)
            .map(|(&(shape, f), &b)| (f.size, product_bytes(shape), half(b)))
            .filter(|&(_, _, t)| t.is_finite() && t > (GRADIENT_LAUNCHES * launch).max(0.0))
            .collect();
        fit_products_with_traffic(&points, launch).map(|(fit, _)| fit)
    };
    (fit(&|[backward, weights]| backward - weights), fit(&|[_, weights]| weights))
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
pub fn attention_passes<B: crate::backend::kernels::ExecBackend>(
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
                let y = block
                    .attend(x.clone(), &crate::nn::parts::Collected::default())
                    .map_err(|e| format!("attention {b}·{s}·{heads}·{dh}: {e}"))?;
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
