use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::ModuleOps;
use burn::tensor::{Distribution, Int, Tensor, TensorPrimitive};

use super::{backward, forward};
use crate::backend::pool::PoolWindow;

fn random(shape: [usize; 4], seed: u64) -> Tensor<Flex, 4> {
    <Flex as burn::tensor::backend::Backend>::seed(&Default::default(), seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

fn prim(t: &Tensor<Flex, 4>) -> FlexTensor {
    t.clone().into_primitive().tensor()
}

/// (input shape, kernel, stride, padding)
const CASES: [([usize; 4], usize, usize, usize); 6] = [
    ([2, 3, 8, 8], 2, 2, 0),
    ([1, 2, 7, 9], 2, 2, 0),
    ([1, 2, 7, 9], 3, 2, 1),
    ([3, 1, 5, 5], 3, 1, 1),
    ([2, 2, 6, 6], 2, 1, 0),
    ([1, 4, 9, 9], 3, 3, 0),
];

/// The pooled values, the indices and the input gradient equal flex's own, bit for bit,
/// over strides, overlapping windows and padding; ties keep the first largest value.
#[test]
fn pooling_equals_flexs_own() {
    for (i, &(shape, k, s, p)) in CASES.iter().enumerate() {
        // rounded to halves: ties in most windows
        let x = (random(shape, i as u64) * 2.0).round() / 2.0;
        let window = PoolWindow { kernel: [k; 2], stride: [s; 2], padding: [p; 2] };
        let (out, idx) = forward(&prim(&x), window).expect("taken");
        let flex = Flex::max_pool2d_with_indices(prim(&x), [k; 2], [s; 2], [p; 2], [1, 1], false);
        let as_f = |t: FlexTensor| Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(t)).into_data();
        let as_i = |t: FlexTensor| Tensor::<Flex, 4, Int>::from_primitive(t).into_data();
        assert_eq!(as_f(out.clone()), as_f(flex.output), "case {i}: values");
        assert_eq!(as_i(idx.clone()), as_i(flex.indices.clone()), "case {i}: indices");
        let dy = random(out.layout().shape().as_slice().try_into().expect("4-D"), 100 + i as u64);
        let ours = backward(shape, &prim(&dy), &idx).expect("taken");
        let theirs = Flex::max_pool2d_with_indices_backward(
            prim(&x),
            [k; 2],
            [s; 2],
            [p; 2],
            [1, 1],
            false,
            prim(&dy),
            flex.indices,
        );
        assert_eq!(as_f(ours), as_f(theirs.x_grad), "case {i}: gradient");
    }
}

/// An empty plane is left to flex (no division of the input into planes of no values).
#[test]
fn an_empty_plane_is_left_to_flex() {
    let empty = Tensor::<Flex, 4>::zeros([1, 2, 0, 4], &Default::default());
    let window = PoolWindow { kernel: [2; 2], stride: [2; 2], padding: [1; 2] };
    assert!(forward(&prim(&empty), window).is_none());
    let dy = Tensor::<Flex, 4>::zeros([1, 2, 1, 3], &Default::default());
    let idx: FlexTensor = Tensor::<Flex, 4, Int>::zeros([1, 2, 1, 3], &Default::default()).into_primitive();
    assert!(backward([1, 2, 0, 4], &prim(&dy), &idx).is_none());
}

/// Through autodiff (the executor's backend) a pool's input gradient is Burn's.
#[test]
fn the_autodiff_node_gives_burns_gradient() {
    type A = Autodiff<Flex>;
    let x = random([2, 3, 6, 6], 7);
    let window = PoolWindow { kernel: [2; 2], stride: [2; 2], padding: [0; 2] };
    let grad = |ours: bool| {
        let x = Tensor::<A, 4>::from_inner(x.clone()).require_grad();
        let y = if ours {
            crate::backend::kernels::max_pool(x.clone(), window)
        } else {
            burn::tensor::module::max_pool2d(x.clone(), [2, 2], [2, 2], [0, 0], [1, 1], false)
        };
        let grads = (y.clone() * y).sum().backward();
        x.grad(&grads).expect("tracked").into_data()
    };
    assert_eq!(grad(true), grad(false));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Over random shapes, windows, strides and paddings (at most half the window, as
    /// PyTorch allows), the values, indices and gradient equal flex's bit for bit.
    #[test]
    fn any_window_equals_flexs(
        (n, c) in (1usize..3, 1usize..4),
        (h, w) in (1usize..10, 1usize..10),
        k in 1usize..4,
        stride in 1usize..4,
        padding in 0usize..2,
        seed in 0u64..1000,
    ) {
        proptest::prop_assume!(2 * padding <= k && h + 2 * padding >= k && w + 2 * padding >= k);
        let x = (random([n, c, h, w], seed) * 2.0).round() / 2.0;
        let window = PoolWindow { kernel: [k; 2], stride: [stride; 2], padding: [padding; 2] };
        let (out, idx) = forward(&prim(&x), window).expect("taken");
        let flex = Flex::max_pool2d_with_indices(prim(&x), [k; 2], [stride; 2], [padding; 2], [1, 1], false);
        let as_f = |t: FlexTensor| Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(t)).into_data();
        let as_i = |t: FlexTensor| Tensor::<Flex, 4, Int>::from_primitive(t).into_data();
        proptest::prop_assert_eq!(as_f(out.clone()), as_f(flex.output));
        proptest::prop_assert_eq!(as_i(idx.clone()), as_i(flex.indices.clone()));
        let dy = random(out.layout().shape().as_slice().try_into().expect("4-D"), seed + 1);
        let ours = backward([n, c, h, w], &prim(&dy), &idx).expect("taken");
        let theirs = Flex::max_pool2d_with_indices_backward(
            prim(&x), [k; 2], [stride; 2], [padding; 2], [1, 1], false, prim(&dy), flex.indices,
        );
        proptest::prop_assert_eq!(as_f(ours), as_f(theirs.x_grad));
    }
}
