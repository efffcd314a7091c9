use burn::backend::Flex;
use burn::tensor::{Tensor, TensorPrimitive};
use pipec_plan::rope::RopeScaling;
use proptest::prelude::*;
use std::sync::Arc;

use crate::backend::kernels::rotary;
use crate::backend::rotary::Rotation;

// the batch norm's tests' helpers: a seeded normal tensor, its values, the largest
// difference relative to the reference's largest magnitude
use crate::backend::flex_norm::tests::{off, random, values, A};

fn wrap<const D: usize>(t: burn::tensor::ops::FloatTensor<A>) -> Tensor<A, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Burn's operations (`crate::backend::rotary::forward`, the executor's rotary embeddings
/// before they were fused) traced by Burn's autodiff: the output and the input's gradient
/// for the output's gradient `dy`.
fn reference(x: &Tensor<A, 4>, dy: &Tensor<A, 4>, r: &Rotation) -> (Vec<f32>, Vec<f32>) {
    let x = x.clone().require_grad();
    let y: Tensor<A, 4> = wrap(crate::backend::rotary::forward::<A>(x.clone().into_primitive().tensor(), r));
    let g = (y.clone() * dy.clone()).sum().backward();
    (values(y), x.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32"))
}

/// The rotation (the autodiff node over `flex_rotary`) against [`reference`] on queries of
/// `[batch, heads, positions, dh]` at `positions` (of a sequence of `seq`).
fn equals_burns_autodiff(batch: usize, heads: usize, positions: &[usize], seq: usize, dh: usize, seed: u64) {
    let shape = [batch, heads, positions.len(), dh];
    let r = Arc::new(Rotation::new(10000.0, &RopeScaling::None, positions, seq, dh));
    let x = random(shape, seed, 0.0);
    let dy = random(shape, seed + 1, 0.0);
    let (y_ref, d_ref) = reference(&x, &dy, &r);
    let x = x.require_grad();
    let y = rotary(x.clone(), &r);
    assert!(off(&values(y.clone()), &y_ref) < 1e-6, "{shape:?}: output");
    let g = (y * dy).sum().backward();
    let d = x.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32");
    assert!(off(&d, &d_ref) < 1e-5, "{shape:?}: the gradient is off by {}", off(&d, &d_ref));
}

#[test]
fn the_fused_rotation_equals_burns_operations_and_their_autodiff() {
    // the kernel takes contiguous f32 of the table's positions and features (so the
    // comparisons below are of it), not others
    let r = Rotation::new(10000.0, &RopeScaling::None, &[0, 1, 2], 3, 8);
    let x = random([2, 3, 8], 0, 0.0).inner().into_primitive().tensor();
    assert!(super::forward(&x, &r).is_some());
    assert!(super::gradients(&x, &r).is_some());
    let other = random([2, 4, 8], 1, 0.0).inner().into_primitive().tensor();
    assert!(super::forward(&other, &r).is_none(), "another count of positions");
    equals_burns_autodiff(4, 4, &(0..64).collect::<Vec<_>>(), 64, 16, 1);
    // a context-parallel member's positions (the first and last quarters of 16)
    equals_burns_autodiff(2, 3, &[0, 1, 2, 3, 12, 13, 14, 15], 16, 32, 2);
}

/// Burn's operations' explicit gradient (`crate::backend::rotary::gradients`, what a backend
/// without a fused kernel runs) against Burn's autodiff of its forward.
#[test]
fn the_rotation_gradients_on_burns_operations_equal_their_autodiff() {
    let r = Rotation::new(500.0, &RopeScaling::None, &(0..5).collect::<Vec<_>>(), 5, 12);
    let x = random([3, 2, 5, 12], 7, 0.0);
    let dy = random([3, 2, 5, 12], 8, 0.0);
    let (_, d_ref) = reference(&x, &dy, &r);
    // on the inner backend, as the autodiff node runs it
    let d = crate::backend::rotary::gradients::<Flex>(dy.inner().into_primitive().tensor(), &r);
    let d = Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(d)).into_data().to_vec::<f32>().expect("f32");
    assert!(off(&d, &d_ref) < 1e-5, "off by {}", off(&d, &d_ref));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn any_shape_equals_burns(batch in 1usize..4, heads in 1usize..5, s in 1usize..40, half in 1usize..20, seed in 0u64..1000) {
        equals_burns_autodiff(batch, heads, &(0..s).collect::<Vec<_>>(), s, 2 * half, seed);
    }
}
