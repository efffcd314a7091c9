use burn::tensor::Tensor;
use proptest::prelude::*;

use crate::backend::kernels::row_norm;

// the batch norm's tests' helpers: a seeded normal tensor, its values, the largest
// difference relative to the reference's largest magnitude
use crate::backend::flex_norm::tests::{off, random, values, A};

/// The executor's norms before they were fused, on Burn's operations traced by Burn's
/// autodiff: a layer norm with `beta`, RMSNorm without.
fn composite<const D: usize>(
    x: Tensor<A, D>,
    gamma: Tensor<A, 1>,
    beta: Option<Tensor<A, 1>>,
    eps: f64,
) -> Tensor<A, D> {
    let mut shape = [1usize; D];
    shape[D - 1] = gamma.dims()[0];
    match beta {
        Some(beta) => {
            let mean = x.clone().mean_dim(D - 1);
            let centered = x - mean;
            let var = centered.clone().powi_scalar(2).mean_dim(D - 1);
            let normed = centered / (var + eps).sqrt();
            normed * gamma.reshape(shape) + beta.reshape(shape)
        }
        None => {
            let ms = x.clone().powi_scalar(2).mean_dim(D - 1);
            x / (ms + eps).sqrt() * gamma.reshape(shape)
        }
    }
}

/// The fused row norm (the autodiff node over `flex_row_norm`) against Burn's autodiff of
/// the composite: the same output and gradients of the input, γ and β within float
/// rounding, on `shape` with rows away from zero mean; a layer norm with `layer`, RMSNorm
/// without.
fn equals_burns_autodiff<const D: usize>(shape: [usize; D], seed: u64, layer: bool) {
    let d = shape[D - 1];
    let x = random(shape, seed, 3.0).require_grad();
    let gamma = random([d], seed + 1, 1.0).require_grad();
    let beta = layer.then(|| random([d], seed + 2, 0.0).require_grad());
    let dy = random(shape, seed + 3, 0.0);
    let grads = |y: Tensor<A, D>| {
        let g = (y * dy.clone()).sum().backward();
        [
            x.grad(&g).map(|t| t.into_data()),
            gamma.grad(&g).map(|t| t.into_data()),
            beta.as_ref().and_then(|b| b.grad(&g)).map(|t| t.into_data()),
        ]
    };
    let y_ref = composite(x.clone(), gamma.clone(), beta.clone(), 1e-5);
    let reference = grads(y_ref.clone());
    let y = row_norm(x.clone(), gamma.clone(), beta.clone(), 1e-5);
    assert!(off(&values(y.clone()), &values(y_ref)) < 1e-5, "{shape:?}: output");
    let ours = grads(y);
    for (what, (a, b)) in ["input", "γ", "β"].iter().zip(ours.into_iter().zip(reference)) {
        match (a, b) {
            (Some(a), Some(b)) => {
                let (a, b) = (a.to_vec::<f32>().expect("f32"), b.to_vec::<f32>().expect("f32"));
                assert!(off(&a, &b) < 2e-4, "{shape:?}: the {what}'s gradient is off by {}", off(&a, &b));
            }
            (None, None) => assert!(!layer && *what == "β", "{shape:?}: no gradient of the {what}"),
            _ => panic!("{shape:?}: the {what}'s gradient on one side only"),
        }
    }
}

#[test]
fn the_fused_row_norms_equal_burns_operations_and_their_autodiff() {
    // the kernel takes contiguous f32 rows (so the comparisons below are of it), not others
    let inner = |t: Tensor<A, 2>| t.inner().into_primitive().tensor();
    let (x, gamma) =
        (inner(random([3, 8], 0, 0.0)), inner(random([1, 8], 1, 0.0)).reshape(burn::tensor::Shape::new([8])));
    assert!(super::forward(&x, &gamma, Some(&gamma), 1e-5).is_some());
    assert!(super::forward(&x, &gamma, None, 1e-5).is_some());
    let short = inner(random([1, 7], 2, 0.0)).reshape(burn::tensor::Shape::new([7]));
    assert!(super::forward(&x, &short, None, 1e-5).is_none(), "a gain of another length");
    for layer in [true, false] {
        equals_burns_autodiff([16, 64, 512], 1, layer);
        equals_burns_autodiff([2, 4, 7, 33], 2, layer);
        equals_burns_autodiff([5, 9], 3, layer);
    }
}

/// Burn's operations' forward and explicit gradients (`crate::backend::row_norm`, what a
/// backend without a fused kernel runs) against the same autodiff of the composite.
#[test]
fn the_row_norms_on_burns_operations_equal_their_autodiff() {
    use burn::tensor::TensorPrimitive;
    for layer in [true, false] {
        let x = random([6, 3, 40], 7, 2.0);
        let gamma = random([40], 8, 1.0);
        let beta = layer.then(|| random([40], 9, 0.0));
        let dy = random([6, 3, 40], 10, 0.0);
        let p1 = |t: Tensor<A, 1>| t.into_primitive().tensor();
        let (y, stats) = crate::backend::row_norm::forward::<A>(
            x.clone().into_primitive().tensor(),
            p1(gamma.clone()),
            beta.clone().map(p1),
            1e-5,
        );
        let y = Tensor::<A, 3>::from_primitive(TensorPrimitive::Float(y));
        let y_ref = composite(x.clone(), gamma.clone(), beta.clone(), 1e-5);
        assert!(off(&values(y), &values(y_ref)) < 1e-5, "layer {layer}: output");
        let (dx, d_gamma, d_beta) = crate::backend::row_norm::gradients::<A>(
            x.clone().into_primitive().tensor(),
            p1(gamma.clone()),
            stats,
            dy.clone().into_primitive().tensor(),
            layer,
        );
        let (xr, gr, br) = (x.require_grad(), gamma.require_grad(), beta.map(|b| b.require_grad()));
        let g = (composite(xr.clone(), gr.clone(), br.clone(), 1e-5) * dy).sum().backward();
        let data = |t: Option<burn::tensor::TensorData>| t.expect("a gradient").to_vec::<f32>().expect("f32");
        let dx = Tensor::<A, 3>::from_primitive(TensorPrimitive::Float(dx));
        assert!(off(&values(dx), &data(xr.grad(&g).map(|t| t.into_data()))) < 2e-4, "layer {layer}: input");
        let d_gamma = Tensor::<A, 1>::from_primitive(TensorPrimitive::Float(d_gamma));
        assert!(off(&values(d_gamma), &data(gr.grad(&g).map(|t| t.into_data()))) < 2e-4, "layer {layer}: γ");
        match (d_beta, br) {
            (Some(db), Some(br)) => {
                let db = Tensor::<A, 1>::from_primitive(TensorPrimitive::Float(db));
                assert!(off(&values(db), &data(br.grad(&g).map(|t| t.into_data()))) < 2e-4, "β");
            }
            (None, None) => assert!(!layer),
            _ => panic!("layer {layer}: β's gradient on one side only"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    /// Random shapes, rows shorter than the eight side-by-side sums included; four values
    /// a row at least (two normalise to ±1 whatever they are: the input's gradient is zero,
    /// both sides' rounding alone).
    #[test]
    fn any_shape_equals_burns(rows in 1usize..40, d in 4usize..70, layer in any::<bool>(), seed in 0u64..1000) {
        equals_burns_autodiff([rows, d], seed, layer);
    }
}
