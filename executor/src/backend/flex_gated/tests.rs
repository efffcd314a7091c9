use burn::backend::Flex;
use burn::tensor::{Tensor, TensorPrimitive};
use proptest::prelude::*;

use crate::backend::gated::Gate;
use crate::backend::kernels::gated;

// the batch norm's tests' helpers: a seeded normal tensor, its values, the largest
// difference relative to the reference's largest magnitude
use crate::backend::flex_norm::tests::{off, random, values, A};

fn wrap<const D: usize>(t: burn::tensor::ops::FloatTensor<A>) -> Tensor<A, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Burn's operations (`crate::backend::gated::forward`, the executor's gated activations
/// before SwiGLU's was fused) traced by Burn's autodiff: the output and the up projection's
/// gradient for the output's gradient `dy`.
fn reference<const D: usize>(up: &Tensor<A, D>, dy: &Tensor<A, D>, gate: Gate) -> (Vec<f32>, Vec<f32>) {
    let up = up.clone().require_grad();
    let y: Tensor<A, D> = wrap(crate::backend::gated::forward::<A>(up.clone().into_primitive().tensor(), gate));
    let g = (y.clone() * dy.clone()).sum().backward();
    (values(y), up.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32"))
}

/// The gated activation (the autodiff node over `flex_gated`) against [`reference`] on an
/// up projection's output of `shape` (its last dimension 2f).
fn equals_burns_autodiff<const D: usize>(shape: [usize; D], seed: u64, gate: Gate) {
    let mut out = shape;
    out[D - 1] /= 2;
    let up = random(shape, seed, 0.5);
    let dy = random(out, seed + 1, 0.0);
    let (y_ref, d_ref) = reference(&up, &dy, gate);
    let up = up.require_grad();
    let y = gated(up.clone(), gate);
    assert_eq!(y.dims(), out, "{shape:?}: the output's shape");
    assert!(off(&values(y.clone()), &y_ref) < 1e-6, "{gate:?} {shape:?}: output");
    let g = (y * dy).sum().backward();
    let d = up.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32");
    assert!(off(&d, &d_ref) < 1e-5, "{gate:?} {shape:?}: the gradient is off by {}", off(&d, &d_ref));
}

#[test]
fn the_fused_swiglu_and_geglu_equal_burns_operations_and_their_autodiff() {
    // the kernel takes SwiGLU's and GEGLU's contiguous f32 rows of an even width (so the
    // comparisons below are of it), not an odd width
    let inner = |t: Tensor<A, 2>| t.inner().into_primitive().tensor();
    let up = inner(random([3, 8], 0, 0.0));
    assert!(super::forward(&up, Gate::Silu).is_some());
    assert!(super::forward(&up, Gate::Gelu).is_some());
    assert!(super::forward(&inner(random([3, 7], 1, 0.0)), Gate::Silu).is_none(), "an odd width");
    let dy = inner(random([3, 4], 2, 0.0));
    assert!(super::gradients(&up, &dy, Gate::Silu).is_some());
    assert!(super::gradients(&up, &inner(random([3, 8], 3, 0.0)), Gate::Silu).is_none(), "a gradient of another shape");
    for gate in [Gate::Silu, Gate::Gelu] {
        equals_burns_autodiff([4, 64, 344], 1, gate);
        equals_burns_autodiff([5, 2], 2, gate);
    }
}

/// Burn's operations' explicit gradient (`crate::backend::gated::gradients`, what a backend
/// without a fused kernel runs) against Burn's autodiff of its forward.
#[test]
fn the_gated_gradients_on_burns_operations_equal_their_autodiff() {
    for gate in [Gate::Silu, Gate::Gelu] {
        let up = random([6, 3, 40], 7, 0.5);
        let dy = random([6, 3, 20], 8, 0.0);
        let (_, d_ref) = reference(&up, &dy, gate);
        // on the inner backend, as the autodiff node runs it (Burn's autodiff backend has a
        // GELU gradient of its own, not `flex`'s)
        let inner = |t: Tensor<A, 3>| t.inner().into_primitive().tensor();
        let d = crate::backend::gated::gradients::<Flex>(inner(up), inner(dy), gate);
        let d = Tensor::<Flex, 3>::from_primitive(TensorPrimitive::Float(d)).into_data().to_vec::<f32>().expect("f32");
        assert!(off(&d, &d_ref) < 1e-5, "{gate:?}: off by {}", off(&d, &d_ref));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn any_shape_equals_burns(rows in 1usize..40, f in 1usize..70, silu in any::<bool>(), seed in 0u64..1000) {
        equals_burns_autodiff([rows, 2 * f], seed, if silu { Gate::Silu } else { Gate::Gelu });
    }
}
