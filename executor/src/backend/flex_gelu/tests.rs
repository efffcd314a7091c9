use burn::tensor::activation;
use burn::tensor::Tensor;

use crate::backend::flex_norm::tests::{off, random, values, A};
use crate::backend::kernels::erf_gelu;

#[test]
fn gelu_equals_burns_and_its_autodiff() {
    for (shape, seed) in [([4, 64, 256], 1), ([3, 5, 7], 2)] {
        let x = random(shape, seed, 0.0) * 3.0;
        let dy = random(shape, seed + 1, 0.0);
        let reference = x.clone().require_grad();
        let y_ref = activation::gelu(reference.clone());
        let g = (y_ref.clone() * dy.clone()).sum().backward();
        let d_ref = reference.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32");
        let x = x.require_grad();
        let y: Tensor<A, 3> = erf_gelu(x.clone());
        assert!(off(&values(y.clone()), &values(y_ref)) < 1e-6, "{shape:?}: GELU");
        let g = (y * dy).sum().backward();
        let d = x.grad(&g).expect("a gradient").to_data().to_vec::<f32>().expect("f32");
        assert!(off(&d, &d_ref) < 1e-6, "{shape:?}: its gradient is off by {}", off(&d, &d_ref));
    }
    // the comparisons above are of the vectorized kernel: it takes any f32 shape
    let inner = random([2, 3, 4], 3, 0.0).inner().into_primitive().tensor();
    assert!(super::forward(&inner).is_some());
}
