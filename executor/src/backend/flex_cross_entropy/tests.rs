use burn::backend::Flex;
use burn::tensor::{activation, Int, Tensor, TensorData, TensorPrimitive};
use proptest::prelude::*;

use crate::backend::kernels::cross_entropy;

// the batch norm's tests' helpers: a seeded normal tensor, its values, the largest
// difference relative to the reference's largest magnitude
use crate::backend::flex_norm::tests::{off, random, values, A};

/// Classes 0, 7, 14, … modulo `c` for `n` rows.
fn classes(n: usize, c: usize) -> Vec<i64> {
    (0..n).map(|i| ((i * 7) % c) as i64).collect()
}

/// The executor's loss before it was fused, Burn's log-softmax and gather traced by Burn's
/// autodiff: the loss and the logits' gradient for the loss's gradient `dy`.
fn reference(logits: &Tensor<A, 2>, labels: &[i64], dy: f32) -> (f32, Vec<f32>) {
    let x = logits.clone().require_grad();
    let [n, _] = x.dims();
    let index = Tensor::<A, 2, Int>::from_data(TensorData::new(labels.to_vec(), [n, 1]), &Default::default());
    let loss = activation::log_softmax(x.clone(), 1).gather(1, index).mean().neg();
    let g = (loss.clone() * dy).sum().backward();
    (values(loss)[0], x.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32"))
}

/// The cross-entropy (the autodiff node over `flex_cross_entropy`) against [`reference`] on
/// `n` rows of `c` logits.
fn equals_burns_autodiff(n: usize, c: usize, seed: u64) {
    let logits = random([n, c], seed, 0.0);
    let labels = classes(n, c);
    let (loss_ref, d_ref) = reference(&logits, &labels, 0.7);
    let x = logits.require_grad();
    let loss = cross_entropy(x.clone(), labels);
    let value = values(loss.clone())[0];
    assert!((value - loss_ref).abs() <= 1e-6 * loss_ref.abs().max(1.0), "[{n}, {c}]: loss {value} against {loss_ref}");
    let g = (loss * 0.7).sum().backward();
    let d = x.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32");
    assert!(off(&d, &d_ref) < 1e-5, "[{n}, {c}]: the gradient is off by {}", off(&d, &d_ref));
}

#[test]
fn the_fused_cross_entropy_equals_burns_operations_and_their_autodiff() {
    // the kernel takes contiguous f32 logits and classes in range (so the comparisons below
    // are of it), not a class past the logits
    let x = random([3, 5], 0, 0.0).inner().into_primitive().tensor();
    assert!(super::forward(&x, &[0, 4, 2]).is_some());
    assert!(super::forward(&x, &[0, 5, 2]).is_none(), "a class out of range");
    assert!(super::forward(&x, &[0, 1]).is_none(), "a class short");
    equals_burns_autodiff(256, 512, 1);
    equals_burns_autodiff(1, 1, 2);
    // logits far apart: the softmax's largest entry alone is not 0
    let wide = random([4, 9], 3, 0.0) * 40.0;
    let (loss_ref, _) = reference(&wide, &classes(4, 9), 1.0);
    let loss = values(cross_entropy(wide, classes(4, 9)))[0];
    assert!((loss - loss_ref).abs() <= 1e-5 * loss_ref.abs().max(1.0), "wide logits: {loss} against {loss_ref}");
}

/// Burn's operations' loss and explicit gradient (`crate::backend::cross_entropy`, what a
/// backend without a fused kernel runs) against Burn's autodiff of the log-softmax.
#[test]
fn the_cross_entropy_on_burns_operations_equals_its_autodiff() {
    let logits = random([12, 30], 7, 0.0);
    let labels = classes(12, 30);
    let (loss_ref, d_ref) = reference(&logits, &labels, 1.3);
    let inner = logits.inner().into_primitive().tensor();
    let (loss, probs) = crate::backend::cross_entropy::forward::<Flex>(inner, &labels);
    let loss =
        Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(loss)).into_data().to_vec::<f32>().expect("f32");
    assert!((loss[0] - loss_ref).abs() <= 1e-6 * loss_ref.abs(), "loss {} against {loss_ref}", loss[0]);
    let dy = Tensor::<Flex, 1>::from_data(TensorData::new(vec![1.3f32], [1]), &Default::default());
    let d = crate::backend::cross_entropy::gradients::<Flex>(probs, &labels, dy.into_primitive().tensor());
    let d = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(d)).into_data().to_vec::<f32>().expect("f32");
    assert!(off(&d, &d_ref) < 1e-5, "off by {}", off(&d, &d_ref));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn any_shape_equals_burns(n in 1usize..40, c in 1usize..300, seed in 0u64..1000) {
        equals_burns_autodiff(n, c, seed);
    }
}
