//! Attention's softmax on Burn's `flex` backend, one pass per row of scores.
//!
//! Burn composes softmax(scores/√dh + mask) from a division, a broadcast add of the mask, a
//! maximum, a subtraction, an exponential, a sum and a division, and its gradient from as
//! many again, each a whole pass over the `[batch, heads, queries, keys]` scores; `flex`
//! runs the broadcast ones element by element through its strided iterator and the
//! exponential through a scalar `libm`. On `specs/gpt-tiny.yaml` those passes took most of
//! a transformer block's time (a block of 4 heads over 64 positions: 1.06 ms a forward
//! against 0.23 ms predicted; docs/benchmarks.md). Here each row is scaled, masked, its
//! maximum taken, exponentiated, summed and normalised in place, and the gradient
//! `P ⊙ (dP − rowsum(dP ⊙ P)) / √dh` is one pass too — the kernels the cost model prices.
//!
//! The arithmetic is the composition's, in the same order per element (the division by the
//! same `f32` √dh, the mask's -1e9 added, `exp(x − max)`, the division by the row's sum);
//! the exponential is `flex_exp`'s, vectorized, within 1 ulp of `libm`'s and 0 below e^-87.33,
//! and the row's maximum and sums run in 8 lanes (`flex_exp::max`, `flex_exp::sum`, `flex_exp::dot`): the
//! sums differ from Burn's in the last bits (tested against it within float rounding). Every layout of a plan runs this same kernel, so
//! pipelines still train to the single device's numbers bit for bit.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};

pub(crate) use crate::backend::attention::MASKED;
use crate::backend::attention::{hidden, Mask};
use crate::backend::flex_exp;

/// The (rows, queries, keys) of a 4-D `f32` `[batch, heads, queries, keys]` tensor.
fn rows(t: &FlexTensor) -> Option<(usize, usize, usize)> {
    let &[b, h, q, k] = t.layout().shape().as_slice() else { return None };
    (t.dtype() == DType::F32 && q > 0 && k > 0).then_some((b * h * q, q, k))
}

/// Where each row of a 4-D tensor's last dimension starts in its storage, in row-major
/// order of the rows, and the step between a row's values: read in place, whatever the
/// layout (the scores a batched product returns are often a transposed view).
fn row_starts(t: &FlexTensor) -> Option<(Vec<usize>, isize)> {
    let layout = t.layout();
    let (&[b, h, q, _], &[s0, s1, s2, s3]) = (layout.shape().as_slice(), layout.strides()) else {
        return None;
    };
    let base = layout.start_offset() as isize;
    let mut starts = Vec::with_capacity(b * h * q);
    for i in 0..b as isize {
        for j in 0..h as isize {
            for k in 0..q as isize {
                starts.push(usize::try_from(base + i * s0 + j * s1 + k * s2).ok()?);
            }
        }
    }
    Some((starts, s3))
}

/// Copies row `start`'s values of `data` at step `step` into `out` (false where the row
/// leaves the buffer).
fn read_row(data: &[f32], start: usize, step: isize, out: &mut [f32]) -> bool {
    let len = out.len();
    let last = start as isize + step * (len as isize - 1);
    if last < 0 || last as usize >= data.len() {
        return false;
    }
    if step == 1 {
        out.copy_from_slice(&data[start..start + len]);
    } else {
        for (j, o) in out.iter_mut().enumerate() {
            *o = data[(start as isize + step * j as isize) as usize];
        }
    }
    true
}

/// softmax(scores / divisor + mask) over the last dimension of `scores`; with a `mask`
/// (each query's and each key's position, the sliding window) a key its query does not see
/// gets [`MASKED`] first.
/// `None` for a dtype or shape this kernel does not take.
pub(crate) fn forward(scores: &FlexTensor, divisor: f32, mask: Option<Mask<'_>>) -> Option<FlexTensor> {
    let (n, sq, sk) = rows(scores)?;
    if mask.is_some_and(|m| m.queries.len() != sq || m.keys.len() != sk) {
        return None;
    }
    let (starts, step) = row_starts(scores)?;
    let input = scores.storage::<f32>();
    let mut out = vec![0f32; n * sk];
    for (r, (&start, y)) in starts.iter().zip(out.chunks_exact_mut(sk)).enumerate() {
        if !read_row(input, start, step, y) {
            return None;
        }
        for y in y.iter_mut() {
            *y /= divisor;
        }
        if let Some(m) = mask {
            let at = m.queries[r % sq];
            for (y, &key) in y.iter_mut().zip(m.keys) {
                *y += if hidden(at, key, m.window) { MASKED } else { 0.0 };
            }
        }
        let max = flex_exp::max(y);
        flex_exp::exp_shifted(y, max, flex_exp::EXP_UNDERFLOW);
        let sum = flex_exp::sum(y);
        for y in y.iter_mut() {
            *y /= sum;
        }
    }
    Some(FlexTensor::from_data(TensorData::new(out, scores.layout().shape().as_slice().to_vec())))
}

/// The scores' gradient from the softmax's output `p` and its gradient `dp`:
/// `p ⊙ (dp − rowsum(dp ⊙ p)) / divisor` (a masked key's `p` is 0, so is its gradient).
pub(crate) fn backward(p: &FlexTensor, dp: &FlexTensor, divisor: f32) -> Option<FlexTensor> {
    let (n, _, sk) = rows(p)?;
    if dp.layout().shape() != p.layout().shape() || dp.dtype() != DType::F32 {
        return None;
    }
    let ((p_rows, p_step), (dp_rows, dp_step)) = (row_starts(p)?, row_starts(dp)?);
    let (ps, dps) = (p.storage::<f32>(), dp.storage::<f32>());
    let mut out = vec![0f32; n * sk];
    let mut pr = vec![0f32; sk];
    for ((&p_at, &dp_at), ds) in p_rows.iter().zip(&dp_rows).zip(out.chunks_exact_mut(sk)) {
        if !read_row(ps, p_at, p_step, &mut pr) || !read_row(dps, dp_at, dp_step, ds) {
            return None;
        }
        let dot = flex_exp::dot(&pr, ds);
        for (ds, &p) in ds.iter_mut().zip(&pr) {
            *ds = p * (*ds - dot) / divisor;
        }
    }
    Some(FlexTensor::from_data(TensorData::new(out, p.layout().shape().as_slice().to_vec())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    type B = Flex;

    fn random(shape: [usize; 4], seed: u64) -> Tensor<B, 4> {
        <B as burn::tensor::backend::Backend>::seed(&Default::default(), seed);
        Tensor::random(shape, Distribution::Normal(0.0, 3.0), &Default::default())
    }

    fn values(t: Tensor<B, 4>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().expect("f32")
    }

    fn ours(scores: Tensor<B, 4>, dh: usize, mask: Option<Mask<'_>>) -> Tensor<B, 4> {
        let p = forward(&scores.into_primitive().tensor(), (dh as f64).sqrt() as f32, mask).expect("taken");
        Tensor::from_primitive(TensorPrimitive::Float(p))
    }

    /// Equal within float rounding of the row sums (relative to the largest value).
    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}");
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= 2e-6 * scale, "{what}: element {i}: {x} against Burn's {y}");
        }
    }

    #[test]
    fn the_one_pass_softmax_is_burns_and_a_masked_key_weighs_exactly_zero() {
        let positions: Vec<usize> = (0..6).collect();
        // a context-parallel member's queries (positions 1, 2, 7, 8, 9, 11) against keys in
        // member order
        let (queries, keys) = (vec![1, 2, 7, 8, 9, 11], vec![5, 0, 9, 3, 1, 11]);
        let mask = |queries, keys, window| Some(Mask { queries, keys, window });
        for (what, causal) in [
            ("no mask", None),
            ("causal", mask(&positions[..], &positions[..], 0)),
            ("a member's", mask(&queries[..], &keys[..], 0)),
            ("a sliding window of 3", mask(&positions[..], &positions[..], 3)),
            ("a member's in a window of 4", mask(&queries[..], &keys[..], 4)),
        ] {
            let scores = random([2, 3, 6, 6], 1);
            let p = values(ours(scores.clone(), 8, causal));
            close(&p, &values(crate::backend::attention::scores_softmax(scores.clone(), 8, causal)), what);
            // the scores as a transposed view are read in place, to the same numbers
            let view = scores.clone().swap_dims(2, 3).swap_dims(2, 3);
            assert_eq!(values(ours(view, 8, causal)), p, "{what}: a view");
            for (r, row) in p.chunks(6).enumerate() {
                let total: f32 = row.iter().sum();
                assert!((total - 1.0).abs() < 1e-6, "{what}: row {r} sums to {total}");
                if let Some(m) = causal {
                    let at = m.queries[r % 6];
                    for (j, w) in row.iter().enumerate() {
                        let kp = m.keys[j];
                        if kp > at || (m.window > 0 && at - kp >= m.window) {
                            assert_eq!(*w, 0.0, "{what}: row {r}, key {j} is masked");
                        } else {
                            assert!(*w > 0.0, "{what}: row {r}, key {j} is seen");
                        }
                    }
                }
            }
        }
        // a transposed view (not contiguous) is read through its strides
        let scores = random([1, 2, 5, 5], 2);
        let transposed = scores.clone().swap_dims(2, 3);
        close(
            &values(ours(transposed.clone(), 4, None)),
            &values(crate::backend::attention::scores_softmax(transposed, 4, None)),
            "transposed",
        );
    }

    #[test]
    fn the_one_pass_gradient_is_burns_through_autodiff() {
        type A = Autodiff<Flex>;
        let positions: Vec<usize> = (0..5).collect();
        let window = |window| Some(Mask { queries: &positions[..], keys: &positions[..], window });
        for causal in [None, window(0), window(2)] {
            let scores = random([2, 2, 5, 5], 3);
            let weights = random([2, 2, 5, 5], 4);
            // Burn's composition through autodiff
            let s = Tensor::<A, 4>::from_inner(scores.clone()).require_grad();
            let p = crate::backend::attention::scores_softmax(s.clone(), 16, causal);
            let grads = (p.clone() * Tensor::<A, 4>::from_inner(weights.clone())).sum().backward();
            let burns = s.grad(&grads).expect("a gradient");
            // this kernel's, from the probabilities and their gradient (the weights)
            let divisor = 4.0f32;
            let ds = backward(&p.inner().into_primitive().tensor(), &weights.into_primitive().tensor(), divisor)
                .expect("taken");
            close(&values(Tensor::from_primitive(TensorPrimitive::Float(ds))), &values(burns), "the scores' gradient");
        }
    }

    #[test]
    fn other_shapes_and_dtypes_are_left_to_burn() {
        let t = Tensor::<B, 3>::zeros([2, 3, 4], &Default::default()).into_primitive().tensor();
        assert!(forward(&t, 1.0, None).is_none(), "not 4-D");
        let scores = random([1, 1, 3, 3], 5);
        let short = [0usize, 1];
        assert!(
            forward(&scores.into_primitive().tensor(), 1.0, Some(Mask { queries: &short, keys: &short, window: 0 }))
                .is_none(),
            "a mask of another size"
        );
    }
}
