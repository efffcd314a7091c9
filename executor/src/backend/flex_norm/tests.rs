use burn::backend::autodiff::Autodiff;
use burn::backend::Flex;
use burn::tensor::{Distribution, Tensor, TensorPrimitive};
use proptest::prelude::*;

use crate::backend::kernels::batch_norm;

pub(crate) type A = Autodiff<Flex>;

pub(crate) fn random<const D: usize>(shape: [usize; D], seed: u64, mean: f64) -> Tensor<A, D> {
    <Flex as burn::tensor::backend::Backend>::seed(&Default::default(), seed);
    Tensor::random(shape, Distribution::Normal(mean, 1.5), &Default::default())
}

pub(crate) fn values<const D: usize>(t: Tensor<A, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().expect("f32")
}

/// Largest difference of `a` from `b`, relative to `b`'s largest magnitude.
pub(crate) fn off(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-6f32, |s, v| s.max(v.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max) / scale
}

/// The fused batch norm (the autodiff node over `flex_norm`) against Burn's autodiff of
/// Burn's operations (`crate::backend::norm::forward`, the executor's batch norm before it
/// was fused): the same output, statistics and gradients of the input, γ and β within
/// float rounding, on `shape` with channels away from zero mean.
fn equals_burns_autodiff(shape: [usize; 4], seed: u64) {
    let c = shape[1];
    let x = random(shape, seed, 3.0).require_grad();
    let gamma = random([c], seed + 1, 1.0).require_grad();
    let beta = random([c], seed + 2, 0.0).require_grad();
    let dy = random(shape, seed + 3, 0.0);
    let floor = values(dy.clone()).iter().fold(0f32, |s, v| s.max(v.abs()));
    let p = |t: Tensor<A, 1>| t.into_primitive().tensor();
    let (y_ref, mean_ref, var_ref) = crate::backend::norm::forward::<A>(
        x.clone().into_primitive().tensor(),
        p(gamma.clone()),
        p(beta.clone()),
        1e-5,
    );
    let wrap4 = |t| Tensor::<A, 4>::from_primitive(TensorPrimitive::Float(t));
    let wrap1 = |t| Tensor::<A, 1>::from_primitive(TensorPrimitive::Float(t));
    let y_ref = wrap4(y_ref);
    let g = (y_ref.clone() * dy.clone()).sum().backward();
    let reference = [
        x.grad(&g).map(|t| t.into_data()),
        gamma.grad(&g).map(|t| t.into_data()),
        beta.grad(&g).map(|t| t.into_data()),
    ];

    let (y, mean, var) = batch_norm(x.clone(), gamma.clone(), beta.clone(), 1e-5);
    assert!(off(&values(y.clone()), &values(y_ref)) < 1e-5, "{shape:?}: output");
    assert!(off(&values(mean), &values(wrap1(mean_ref))) < 1e-6, "{shape:?}: mean");
    assert!(off(&values(var), &values(wrap1(var_ref))) < 1e-5, "{shape:?}: variance");
    let g = (y * dy).sum().backward();
    let ours = [
        x.grad(&g).map(|t| t.into_data()),
        gamma.grad(&g).map(|t| t.into_data()),
        beta.grad(&g).map(|t| t.into_data()),
    ];
    // γ's and β's gradients are sums over a channel of terms of the incoming gradient's
    // size: a sum that cancels to near zero is judged against the largest of those, not
    // itself (β's of [4, 1, 8, 3] at seed 308 was 3.4e-4 off relative to itself, proptest)
    for (what, (a, b)) in ["input", "γ", "β"].iter().zip(ours.into_iter().zip(reference)) {
        let (a, b) = (a.expect("a gradient"), b.expect("a gradient"));
        let (a, b) = (a.to_vec::<f32>().expect("f32"), b.to_vec::<f32>().expect("f32"));
        let scale = b.iter().fold(floor, |s, v| s.max(v.abs()));
        let off = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max) / scale;
        assert!(off < 2e-4, "{shape:?}: the {what}'s gradient is off by {off}");
    }
}

#[test]
fn the_fused_batch_norm_equals_burns_operations_and_their_autodiff() {
    for (i, shape) in [[8, 16, 32, 32], [2, 3, 5, 7], [1, 4, 3, 3], [5, 2, 1, 1]].into_iter().enumerate() {
        equals_burns_autodiff(shape, 10 * i as u64);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    /// Random shapes, odd and below the eight side-by-side sums included; four values a
    /// channel at least (two normalise to ±1 whatever they are: the input's gradient is
    /// zero, both sides' rounding alone).
    #[test]
    fn any_shape_equals_burns(n in 1usize..5, c in 1usize..6, h in 1usize..12, w in 1usize..12, seed in 0u64..1000) {
        prop_assume!(n * h * w >= 4);
        equals_burns_autodiff([n, c, h, w], seed);
    }
}
