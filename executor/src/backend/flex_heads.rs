//! Attention heads in and out of the features on Burn's `flex` backend, one copy of rows.
//!
//! On Burn's operations (`crate::backend::heads`) the heads are a view, `[b, s, heads,
//! size]` with its middle dimensions swapped, which the rotary embeddings and every reshape
//! then copy element by element through `flex`'s general strided path: in a `perf` profile
//! of `specs/llama-tiny.yaml` those copies (`to_contiguous`, `StridedIter`) took 15% of the
//! run, most of it the backward's reshape of the queries', keys' and values' gradients.
//! Here each head's row of `size` features is copied whole, in either direction.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, TensorData};

/// `t`'s contiguous `f32` values and its dimensions, if it has `D` of them.
fn values<const D: usize>(t: &FlexTensor) -> Option<(&[f32], [usize; D])> {
    let dims = <[usize; D]>::try_from(t.layout().shape().as_slice()).ok()?;
    let (start, end) = t.layout().contiguous_offsets()?;
    if t.dtype() != DType::F32 {
        return None;
    }
    Some((t.storage::<f32>().get(start..end)?, dims))
}

/// [`crate::backend::heads::take`]: `heads` heads of `size` from feature `start` of `x`
/// [b, s, width], as [b, heads, s, size]; None where Burn's operations should run.
pub(crate) fn take(x: &FlexTensor, start: usize, heads: usize, size: usize) -> Option<FlexTensor> {
    let (xs, [b, s, width]) = values::<3>(x)?;
    if start + heads * size > width || size == 0 {
        return None;
    }
    let mut out = Vec::with_capacity(b * heads * s * size);
    for bi in 0..b {
        for hi in 0..heads {
            for si in 0..s {
                let from = (bi * s + si) * width + start + hi * size;
                out.extend_from_slice(&xs[from..from + size]);
            }
        }
    }
    Some(FlexTensor::from_data(TensorData::new(out, [b, heads, s, size])))
}

/// [`crate::backend::heads::place`]: heads `x` [b, heads, s, size] as features
/// `start..start + heads·size` of zeros [b, s, width]; None where Burn's operations should
/// run.
pub(crate) fn place(x: &FlexTensor, width: usize, start: usize) -> Option<FlexTensor> {
    let (xs, [b, h, s, d]) = values::<4>(x)?;
    if start + h * d > width || d == 0 {
        return None;
    }
    let mut out = vec![0f32; b * s * width];
    for (k, row) in xs.chunks_exact(d).enumerate() {
        let (si, hi, bi) = (k % s, (k / s) % h, k / (s * h));
        let to = (bi * s + si) * width + start + hi * d;
        out[to..to + d].copy_from_slice(row);
    }
    Some(FlexTensor::from_data(TensorData::new(out, [b, s, width])))
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    /// Both ways, the copies equal Burn's operations exactly; a strided input is left to
    /// them.
    #[test]
    fn heads_taken_and_placed_equal_burns_operations() {
        let dev = Default::default();
        let x = Tensor::<Flex, 3>::random([2, 5, 3 * 4 + 2 * 4 + 2 * 3], Distribution::Default, &dev);
        let p = x.clone().into_primitive().tensor();
        for (start, heads, size) in [(0, 3, 4), (12, 2, 4), (20, 2, 3)] {
            let fast = super::take(&p, start, heads, size).expect("contiguous");
            let burn = crate::backend::heads::take::<Flex>(p.clone(), start, heads, size);
            let (a, b) = (Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(fast)), wrap4(burn));
            assert_eq!(a.dims(), b.dims());
            assert_eq!(a.clone().into_data(), b.into_data(), "take {start} {heads} {size}");
            let placed = super::place(&a.clone().into_primitive().tensor(), 26, start).expect("contiguous");
            let burn = crate::backend::heads::place::<Flex>(a.into_primitive().tensor(), 26, start);
            assert_eq!(wrap3(placed).into_data(), wrap3(burn).into_data(), "place {start} {heads} {size}");
        }
        let strided = x.swap_dims(0, 1).into_primitive().tensor();
        assert!(super::take(&strided, 0, 3, 4).is_none());
    }

    fn wrap4(t: burn::tensor::ops::FloatTensor<Flex>) -> Tensor<Flex, 4> {
        Tensor::from_primitive(TensorPrimitive::Float(t))
    }

    fn wrap3(t: burn::tensor::ops::FloatTensor<Flex>) -> Tensor<Flex, 3> {
        Tensor::from_primitive(TensorPrimitive::Float(t))
    }
}
