use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::{ConvOptions, ModuleOps};
use burn::tensor::{Distribution, Tensor, TensorPrimitive};

use super::{backward, backward_in_runs, forward};

fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<Flex, D> {
    <Flex as burn::tensor::backend::Backend>::seed(&Default::default(), seed);
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

fn prim<const D: usize>(t: &Tensor<Flex, D>) -> FlexTensor {
    t.clone().into_primitive().tensor()
}

fn tensor<const D: usize>(t: FlexTensor) -> Tensor<Flex, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// The largest difference of `a` from `b` over b's largest magnitude.
fn relative<const D: usize>(a: Tensor<Flex, D>, b: Tensor<Flex, D>) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let scale = b.clone().abs().max().into_scalar().max(1e-6);
    (a - b).abs().max().into_scalar() / scale
}

/// (input shape, C_out, kernel, stride, padding, dilation)
type Case = ([usize; 4], usize, [usize; 2], usize, usize, usize);

const CASES: [Case; 7] = [
    ([2, 3, 8, 8], 4, [3, 3], 1, 1, 1),
    ([3, 4, 9, 7], 5, [3, 3], 2, 1, 1),
    ([2, 6, 8, 8], 3, [1, 1], 2, 0, 1),
    ([1, 2, 10, 10], 2, [3, 2], 1, 2, 2),
    ([4, 8, 5, 5], 8, [5, 5], 1, 2, 1),
    ([2, 3, 4, 4], 2, [4, 4], 1, 0, 1),
    ([5, 16, 6, 6], 7, [3, 3], 3, 0, 1),
];

/// The forward and both gradients equal Burn's own convolution's on `flex` within float
/// rounding, with and without a bias, over strides, paddings, dilations, 1 × 1 and
/// rectangular kernels, kernels the size of the input.
#[test]
fn convolution_and_its_gradients_equal_burns() {
    for (i, &(shape, c_out, [kh, kw], stride, padding, dilation)) in CASES.iter().enumerate() {
        let seed = 10 * i as u64;
        let x = random(shape, seed);
        let w = random([c_out, shape[1], kh, kw], seed + 1);
        let b = random([c_out], seed + 2);
        let options = ConvOptions::new([stride; 2], [padding; 2], [dilation; 2], 1);
        for bias in [None, Some(prim(&b))] {
            let ours = tensor::<4>(forward(&prim(&x), &prim(&w), bias.as_ref(), &options).expect("taken"));
            let burns =
                tensor::<4>(<Flex as ModuleOps<Flex>>::conv2d(prim(&x), prim(&w), bias.clone(), options.clone()));
            let e = relative(ours.clone(), burns);
            assert!(e < 1e-5, "case {i} forward: {e}");
            let dy = random(ours.dims(), seed + 3);
            let (dx, dw) = backward(&prim(&x), &prim(&w), &prim(&dy), &options, (true, true)).expect("taken");
            let bx = Flex::conv2d_x_backward(prim(&x), prim(&w), prim(&dy), options.clone());
            let bw = Flex::conv2d_weight_backward(prim(&x), prim(&w), prim(&dy), options.clone());
            let ex = relative(tensor::<4>(dx.expect("asked")), tensor(bx));
            let ew = relative(tensor::<4>(dw.expect("asked")), tensor(bw));
            assert!(ex < 1e-5 && ew < 1e-5, "case {i} gradients: input {ex}, weight {ew}");
        }
    }
}

/// What is not asked for is not computed; a transposed (non-contiguous) input reads as its
/// values; groups are left to Burn.
#[test]
fn gradients_only_where_asked_any_layout_and_groups_left_to_burn() {
    let x = random([2, 5, 6, 4], 1);
    let xt = x.clone().swap_dims(2, 3).swap_dims(2, 3);
    let x_view = random([2, 5, 4, 6], 2).swap_dims(2, 3);
    let w = random([3, 5, 3, 3], 3);
    let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
    let contiguous = x_view.clone().reshape([2, 5, 6, 4]);
    let a = tensor::<4>(forward(&prim(&x_view), &prim(&w), None, &options).expect("taken"));
    let b = tensor::<4>(forward(&prim(&contiguous), &prim(&w), None, &options).expect("taken"));
    assert_eq!(relative(a, b), 0.0);
    let dy = random([2, 3, 6, 4], 4);
    let only_w = backward(&prim(&xt), &prim(&w), &prim(&dy), &options, (false, true)).expect("taken");
    assert!(only_w.0.is_none() && only_w.1.is_some());
    let only_x = backward(&prim(&x), &prim(&w), &prim(&dy), &options, (true, false)).expect("taken");
    assert!(only_x.0.is_some() && only_x.1.is_none());
    let grouped = ConvOptions::new([1, 1], [1, 1], [1, 1], 5);
    assert!(forward(&prim(&x), &prim(&random([5, 1, 3, 3], 5)), None, &grouped).is_none());
}

/// Through autodiff (the executor's backend), a convolution with a bias trains as Burn's
/// own: the same output and the same gradients of the input, the weight and the bias.
#[test]
fn the_autodiff_node_gives_burns_gradients() {
    type A = Autodiff<Flex>;
    let lift = |t: &Tensor<Flex, 4>| Tensor::<A, 4>::from_inner(t.clone()).require_grad();
    let x = random([3, 4, 7, 7], 20);
    let w = random([6, 4, 3, 3], 21);
    let b = random([6], 22);
    let options = ConvOptions::new([2, 2], [1, 1], [1, 1], 1);
    let run = |ours: bool| {
        let (x, w) = (lift(&x), lift(&w));
        let b = Tensor::<A, 1>::from_inner(b.clone()).require_grad();
        let y = if ours {
            crate::backend::kernels::conv2d(x.clone(), w.clone(), Some(b.clone()), options.clone())
        } else {
            burn::tensor::module::conv2d(x.clone(), w.clone(), Some(b.clone()), options.clone())
        };
        let grads = (y.clone() * y.clone()).sum().backward();
        let g4 = |t: &Tensor<A, 4>| t.grad(&grads).expect("tracked");
        (y.inner(), g4(&x), g4(&w), b.grad(&grads).expect("tracked"))
    };
    let (ours, burns) = (run(true), run(false));
    assert!(relative(ours.0, burns.0) < 1e-5);
    assert!(relative(ours.1, burns.1) < 1e-5);
    assert!(relative(ours.2, burns.2) < 1e-5);
    assert!(relative(ours.3, burns.3) < 1e-5);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Over random shapes, strides, paddings and dilations whose output has a position, the
    /// forward and both gradients equal Burn's within float rounding.
    #[test]
    fn any_geometry_equals_burns(
        (n, c, c_out) in (1usize..3, 1usize..4, 1usize..4),
        (h, w) in (1usize..9, 1usize..9),
        (kh, kw) in (1usize..4, 1usize..4),
        stride in 1usize..3,
        padding in 0usize..2,
        dilation in 1usize..3,
        seed in 0u64..1000,
    ) {
        let fits = |size: usize, k: usize| size + 2 * padding > dilation * (k - 1);
        proptest::prop_assume!(fits(h, kh) && fits(w, kw));
        let x = random([n, c, h, w], seed);
        let wt = random([c_out, c, kh, kw], seed + 1);
        let options = ConvOptions::new([stride; 2], [padding; 2], [dilation; 2], 1);
        let ours = tensor::<4>(forward(&prim(&x), &prim(&wt), None, &options).expect("taken"));
        let burns = tensor::<4>(<Flex as ModuleOps<Flex>>::conv2d(prim(&x), prim(&wt), None, options.clone()));
        proptest::prop_assert!(relative(ours.clone(), burns) < 1e-5);
        let dy = random(ours.dims(), seed + 2);
        let (dx, dw) = backward(&prim(&x), &prim(&wt), &prim(&dy), &options, (true, true)).expect("taken");
        let bx = Flex::conv2d_x_backward(prim(&x), prim(&wt), prim(&dy), options.clone());
        let bw = Flex::conv2d_weight_backward(prim(&x), prim(&wt), prim(&dy), options.clone());
        proptest::prop_assert!(relative(tensor::<4>(dx.expect("asked")), tensor(bx)) < 1e-5);
        proptest::prop_assert!(relative(tensor::<4>(dw.expect("asked")), tensor(bw)) < 1e-5);
    }
}

/// The weight's gradient summed over runs of samples equals Burn's, summed as itself (the
/// patch matrix the smaller operand: `C·kh·kw` < `C_out`) and as its transpose (the larger),
/// one sample a run and the whole batch in one.
#[test]
fn the_weights_gradient_over_runs_of_samples_equals_burns_either_way_round() {
    // (input, C_out, kernel): a 1 × 1 kernel onto more channels, a 3 × 3 onto fewer
    for (i, (shape, c_out, k)) in [([4, 2, 6, 6], 8, 1), ([4, 3, 6, 6], 4, 3)].into_iter().enumerate() {
        let seed = 100 + 10 * i as u64;
        let (x, w) = (random(shape, seed), random([c_out, shape[1], k, k], seed + 1));
        let options = ConvOptions::new([1, 1], [k / 2; 2], [1, 1], 1);
        let y = tensor::<4>(forward(&prim(&x), &prim(&w), None, &options).expect("taken"));
        let dy = random(y.dims(), seed + 2);
        let bw = tensor::<4>(Flex::conv2d_weight_backward(prim(&x), prim(&w), prim(&dy), options.clone()));
        for limit in [1, usize::MAX] {
            let (dx, dw) =
                backward_in_runs(&prim(&x), &prim(&w), &prim(&dy), &options, (true, true), limit).expect("taken");
            let e = relative(tensor::<4>(dw.expect("asked")), bw.clone());
            assert!(e < 1e-5 && dx.is_some(), "case {i}, runs of {limit} values: weight {e}");
        }
    }
}
