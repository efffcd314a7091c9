use burn::backend::Flex;
use burn::tensor::activation;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::backend::flex_norm::tests::{off, random, values, A};
use crate::backend::gelu::{tanh_forward, tanh_gradient, Gelu};
use crate::backend::kernels::gelu;

/// Burn's GELU of `form` (`activation::gelu`, or the tanh approximation composed of Burn's
/// operations, `crate::backend::gelu::tanh_forward`) traced by Burn's autodiff: the output
/// and the input's gradient for the output's gradient `dy`.
fn reference(x: &Tensor<A, 3>, dy: &Tensor<A, 3>, form: Gelu) -> (Vec<f32>, Vec<f32>) {
    let x = x.clone().require_grad();
    let y = match form {
        Gelu::Erf => activation::gelu(x.clone()),
        Gelu::Tanh => {
            Tensor::from_primitive(TensorPrimitive::Float(tanh_forward::<A>(x.clone().into_primitive().tensor())))
        }
    };
    let g = (y.clone() * dy.clone()).sum().backward();
    (values(y), x.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32"))
}

#[test]
fn both_gelus_equal_burns_and_its_autodiff() {
    for form in [Gelu::Erf, Gelu::Tanh] {
        for (shape, seed) in [([4, 64, 256], 1), ([3, 5, 7], 2)] {
            let x = random(shape, seed, 0.0) * 3.0;
            let dy = random(shape, seed + 1, 0.0);
            let (y_ref, d_ref) = reference(&x, &dy, form);
            let x = x.require_grad();
            let y: Tensor<A, 3> = gelu(x.clone(), form);
            assert!(off(&values(y.clone()), &y_ref) < 1e-6, "{form:?} {shape:?}: GELU");
            let g = (y * dy).sum().backward();
            let d = x.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32");
            // (the tanh form's autodiff runs 1 − tanh², the kernel σ(1 − σ): 1.1e-6 apart)
            assert!(off(&d, &d_ref) < 1e-5, "{form:?} {shape:?}: its gradient is off by {}", off(&d, &d_ref));
        }
        // the comparisons above are of the vectorized kernel: it takes any f32 shape
        let inner = random([2, 3, 4], 3, 0.0).inner().into_primitive().tensor();
        assert!(super::forward(&inner, form).is_some());
    }
}

/// The other backends' explicit gradient of the tanh approximation (Burn's operations) is
/// Burn's autodiff of its forward.
#[test]
fn the_tanh_approximations_explicit_gradient_is_burns_autodiff() {
    let x = random([4, 16, 32], 5, 0.0) * 3.0;
    let dy = random([4, 16, 32], 6, 0.0);
    let (_, d_ref) = reference(&x, &dy, Gelu::Tanh);
    let d = tanh_gradient::<Flex>(x.inner().into_primitive().tensor(), dy.inner().into_primitive().tensor());
    let d = Tensor::<Flex, 3>::from_primitive(TensorPrimitive::Float(d)).into_data().to_vec::<f32>().expect("f32");
    assert!(off(&d, &d_ref) < 1e-5, "off by {}", off(&d, &d_ref));
}
