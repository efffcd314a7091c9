//! Mixed precision: the matrix products of a `precision: bf16` or `fp16` plan computed in
//! that dtype, everything else in fp32; fp16's dynamic loss scaling.
//!
//! What runs in bf16 is what PyTorch's autocast and Megatron-LM run there: every dense
//! product `x · W` (linear layers, the transformer's projections and experts, LSTM gates) in
//! the forward and both products of its backward (`dy · Wᵀ` and `xᵀ · dy`), and attention's
//! two products (`q · kᵀ`, `P · v`) and theirs. Each operand is rounded to bf16 where it is
//! used and the product comes back as fp32, so:
//!
//! - the weights stay fp32 (the master copy every update changes), rounded to bf16 for each
//!   product, as Megatron's bf16 model copy of its fp32 main parameters;
//! - each weight gradient is a bf16 product summed over the microbatches and reduced in the
//!   plan's `grad_precision` (fp32 by default, as Megatron's `main_grad` with
//!   `accumulate_allreduce_grads_in_fp32`; bf16 rounds the sum after each microbatch and
//!   each partial sum of the reduction: `params::round_grads`, `transport::Rounding`);
//! - softmax, the norms, the losses, the element-wise operations, convolutions and the
//!   optimizer stay fp32 (autocast's fp32 list: softmax, norms, losses).
//!
//! The dtype is the running thread's: a worker enters it ([`Autocast::enter`]) for its
//! whole run, and both backends (`flex` and CUDA: Burn's tensors have bf16 and f16 on
//! each) compute the products in it. The activations kept for the backward stay fp32, which
//! the plan's memory figures (2-byte activations) do not count: `pipec run` says so.
//!
//! fp16's range is narrow (its smallest normal value is 6.1·10⁻⁵), so small gradients
//! vanish when a product rounds them; the loss is therefore scaled before the backward and
//! the gradients unscaled before the update ([`scales_loss`]; the scale's rule is
//! `pipec_plan::recipe::LossScale`, PyTorch's `GradScaler`). Every update waits for the
//! whole model's gradient norm (the plan's `grad_norm` all-reduce, which an fp16 plan has
//! even without clipping); a norm that is not finite skips the step's updates on every
//! device and halves the scale.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor};
use pipec_plan::{Plan, Precision};
use std::cell::Cell;

thread_local! {
    static COMPUTE: Cell<Option<FloatDType>> = const { Cell::new(None) };
}

/// The dtype the executor computes a plan's products in: bf16 for a `bf16` plan; fp16 for
/// an `fp16` plan that it can scale the loss of ([`scales_loss`]); fp32 (None: no rounding)
/// otherwise.
pub fn compute_dtype(plan: &Plan) -> Option<FloatDType> {
    match plan.training.precision {
        Precision::Bf16 => Some(FloatDType::BF16),
        Precision::Fp16 if scales_loss(plan) => Some(FloatDType::F16),
        Precision::Fp32 | Precision::Fp16 => None,
    }
}

/// Whether the run scales its loss dynamically (`pipec_plan::recipe::LossScale`): an
/// `fp16` plan under a schedule that updates every stage once per step, where every update
/// waits for the whole model's gradient norm and so every device sees an overflow anywhere
/// and skips the same steps. Under an asynchronous schedule the stages update on their own
/// clocks and could not agree, so there an `fp16` plan trains in fp32 (`pipec run` says so).
pub fn scales_loss(plan: &Plan) -> bool {
    plan.training.precision == Precision::Fp16 && plan.schedule.updates_every_step()
}

/// This thread computes its products in `dtype` (None: fp32) until the guard drops (then
/// in what it did before).
#[must_use = "the precision holds only while the guard lives"]
pub struct Autocast {
    before: Option<FloatDType>,
}

impl Autocast {
    pub fn enter(dtype: Option<FloatDType>) -> Self {
        Autocast { before: COMPUTE.with(|c| c.replace(dtype)) }
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        COMPUTE.with(|c| c.set(self.before));
    }
}

/// The low precision this thread computes its products in, if any.
pub(crate) fn dtype() -> Option<FloatDType> {
    COMPUTE.with(Cell::get)
}

/// `product(a, b)` on primitives: the operands rounded to this thread's low precision and
/// the result returned as fp32, or `product` itself when the thread computes in fp32.
pub(crate) fn mixed<B: Backend>(
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    product: impl FnOnce(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    match dtype() {
        None => product(a, b),
        Some(low) => B::float_cast(product(B::float_cast(a, low), B::float_cast(b, low)), FloatDType::F32),
    }
}

/// `a.matmul(b)` on tensors (tracked: the casts are in the graph, so the gradients come back
/// through the same rounding as fp32), in this thread's precision.
pub(crate) fn matmul<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    match dtype() {
        None => a.matmul(b),
        Some(low) => a.cast(low).matmul(b.cast(low)).cast(FloatDType::F32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, TensorData};

    type B = burn::backend::Flex;

    fn values<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
        t.into_data().convert::<f32>().to_vec().expect("f32 values")
    }

    /// Under bf16 a product is the fp32 product of the bf16-rounded operands (as a bf16
    /// kernel accumulating in fp32 gives it, then rounded to bf16), not the fp32 product: it
    /// differs from fp32 by about bf16's rounding, and equals the product of the operands
    /// rounded by hand to within the last rounding of the result.
    #[test]
    fn bf16_products_round_their_operands_and_return_fp32() {
        let dev = Default::default();
        let a = Tensor::<B, 2>::random([16, 64], Distribution::Normal(0.0, 1.0), &dev);
        let b = Tensor::<B, 2>::random([64, 8], Distribution::Normal(0.0, 1.0), &dev);
        let exact = values(a.clone().matmul(b.clone()));
        let rounded = |t: Tensor<B, 2>| t.cast(FloatDType::BF16).cast(FloatDType::F32);
        let by_hand = values(rounded(a.clone()).matmul(rounded(b.clone())));
        let mixed = {
            let _g = Autocast::enter(Some(FloatDType::BF16));
            matmul(a.clone(), b.clone())
        };
        assert_eq!(mixed.dtype(), burn::tensor::DType::F32);
        let mixed = values(mixed);
        let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max) / scale;
        // a bf16 result keeps 8 bits: within 2⁻⁸ of the hand-rounded product's scale
        assert!(worst(&mixed, &by_hand) <= 1.0 / 256.0, "{}", worst(&mixed, &by_hand));
        // and it is not the fp32 product: the rounding is real
        assert!(worst(&mixed, &exact) > 1e-5, "{}", worst(&mixed, &exact));
        // after the guard, fp32 again: the exact product
        assert_eq!(values(matmul(a, b)), exact);
    }

    /// The gradients through a bf16 product reach fp32 leaves as fp32, near the fp32 ones.
    #[test]
    fn bf16_product_gradients_are_fp32_and_near_the_exact_ones() {
        type A = crate::backend::CpuBackend;
        let dev = Default::default();
        let a = Tensor::<A, 2>::random([8, 32], Distribution::Normal(0.0, 1.0), &dev).require_grad();
        let w = Tensor::<A, 2>::from_data(
            TensorData::new((0..32 * 4).map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0).collect(), [32, 4]),
            &dev,
        )
        .require_grad();
        let exact = a.clone().matmul(w.clone()).sum().backward();
        let mixed = {
            let _g = Autocast::enter(Some(FloatDType::BF16));
            matmul(a.clone(), w.clone()).sum().backward()
        };
        let (ge, gm) = (w.grad(&exact).expect("a gradient"), w.grad(&mixed).expect("a gradient"));
        assert_eq!(gm.dtype(), burn::tensor::DType::F32);
        let (ge, gm) = (ge.into_data().to_vec::<f32>().expect("f32"), gm.into_data().to_vec::<f32>().expect("f32"));
        let scale = ge.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = ge.iter().zip(&gm).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max) / scale;
        assert!(worst > 0.0 && worst < 1e-2, "{worst}");
    }
}
