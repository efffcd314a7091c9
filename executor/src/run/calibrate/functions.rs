//! The element-wise functions the cost model prices by their own rate (`Functions`): their
//! rates from the calibration's timings, and their gradients timed as the executor's
//! backward computes them.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Tensor};
use pipec_plan::device::Functions;

use super::{median_seconds, Point};
use crate::backend::gated::Gate;
use crate::backend::kernels::{Gelu, Kernels};

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
        silu_gated: rate("silu_gated"),
        gelu_gated: rate("gelu_gated"),
        silu_gated_grad: rate("silu_gated_grad"),
        gelu_gated_grad: rate("gelu_gated_grad"),
        cross_entropy: rate("cross_entropy"),
        cross_entropy_grad: rate("cross_entropy_grad"),
    }
}

/// The gradients of the functions [`Functions`] prices, as the executor's backward computes
/// them (through autodiff, from their input and the incoming gradient), on `elements`
/// values: each the median time of the function's forward and backward, less its forward
/// alone and less the same backward of the identity (the graph's walk, the gradient's
/// seed and its registration), so that what is left is the gradient's kernels.
pub fn function_gradients<B: AutodiffBackend + Kernels>(
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
    // (a gated unit's by its output's elements, half its input's: `Kernels::gated_grads`)
    let functions: [(&'static str, Function<B>, usize); 6] = [
        ("gelu_grad", &|t| crate::backend::kernels::gelu(t, Gelu::Erf), elements),
        ("gelu_tanh_grad", &|t| crate::backend::kernels::gelu(t, Gelu::Tanh), elements),
        ("silu_grad", &|t| activation::silu(t), elements),
        ("tanh_grad", &|t| t.tanh(), elements),
        ("silu_gated_grad", &|t| crate::backend::kernels::gated(t, Gate::Silu), elements / 2),
        ("gelu_gated_grad", &|t| crate::backend::kernels::gated(t, Gate::Gelu), elements / 2),
    ];
    let mut out: Vec<(&'static str, Point)> = functions
        .into_iter()
        .map(|(name, f, size)| {
            let seconds = (pass(f, true) - pass(f, false) - identity).max(1e-9);
            (name, Point { size: size as f64, seconds })
        })
        .collect();
    // the cross-entropy's by its logits, rows of `classes`, each row's class fixed: its
    // output is one value, so its backward is the logits' gradient alone, with no seed of
    // the input's size to take off (the identity's)
    let (rows, classes, labels) = loss_case(elements);
    let loss = |t: Tensor<B, 1>| crate::backend::kernels::cross_entropy(t.reshape([rows, classes]), labels.clone());
    let seconds = (pass(&loss, true) - pass(&loss, false)).max(1e-9);
    out.push(("cross_entropy_grad", Point { size: (rows * classes) as f64, seconds }));
    out
}

/// The cross-entropy timed on `elements` values: rows of 1,024 classes (fewer when there
/// are fewer values), as many rows as fill them, and each row's class (spread over them).
pub fn loss_case(elements: usize) -> (usize, usize, Vec<i64>) {
    let classes = elements.clamp(1, 1024);
    let rows = elements / classes;
    (rows, classes, (0..rows).map(|r| (r * 7 % classes) as i64).collect())
}
