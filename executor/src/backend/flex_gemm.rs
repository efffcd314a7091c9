//! The 2-D `f32` product on Burn's `flex` backend, written straight into a fresh buffer.
//!
//! `flex` multiplies through the `gemm` crate, but allocates every product's output with
//! `FlexTensor::empty`, which zero-fills a byte vector and then copies it into an aligned
//! allocation: a memset and a memmove of the whole output around every product (13–15% of a
//! CPU profile of the benchmark model's step; docs/benchmarks.md). This calls the same
//! kernel with the same strides on one thread, as flex does here, into an `f32` vector that the
//! kernel fills completely, and hands that vector to the tensor without a copy. The numbers
//! are flex's own, bit for bit (tested). [`product_add`] is the same call accumulating into a
//! sum's own buffer: how a microbatch's weight gradient joins the step's sum
//! (`dense::with_gradient_sums`).
//!
//! Every product here first sets the `gemm` crate's packing threshold for a left operand
//! ([`pack_left_operands`]): the kernel then copies a weight it would otherwise read with a
//! 4 KiB stride into contiguous panels. That made a 16–32-row forward `x · W` 1.5–1.8×
//! faster on an AVX2 machine and changes no result (packing moves values, not the order in
//! which they are summed; tested).
//!
//! This module uses `unsafe` because the `gemm` crate has no safe entry point; every
//! access it lets the kernel make is bounds-checked below first.
#![allow(unsafe_code)]

use burn::backend::flex::{FlexTensor, Layout};
use burn::tensor::{DType, TensorData};

/// `a · b` for 2-D `f32` tensors of any strides; `None` where flex's own product should run
/// (another dtype or rank, an empty side, mismatched inner dimensions, which flex reports).
pub(crate) fn product(a: &FlexTensor, b: &FlexTensor) -> Option<FlexTensor> {
    let operands = Operands::of(a, b)?;
    let [m, n] = operands.out;
    let len = m.checked_mul(n)?;
    let mut out: Vec<f32> = Vec::with_capacity(len);
    // SAFETY: `out` has room for exactly m × n values, and with `accumulate` false the kernel
    // writes every one of them without reading any (then they are initialised).
    unsafe {
        operands.run(out.as_mut_ptr(), false);
        out.set_len(len);
    }
    Some(FlexTensor::from_data(TensorData::new(out, [m, n])))
}

/// `acc + a · b` written into `acc`'s own buffer, where `acc` is a contiguous 2-D `f32`
/// tensor of the product's shape that nothing else holds; otherwise `acc` comes back
/// untouched. Summing a microbatch's weight gradient into the step's sum this way saves
/// writing the gradient out and reading it back for the addition.
pub(crate) fn product_add(mut acc: FlexTensor, a: &FlexTensor, b: &FlexTensor) -> Result<FlexTensor, FlexTensor> {
    let Some(operands) = Operands::of(a, b) else { return Err(acc) };
    let fits = acc.dtype() == DType::F32
        && acc.layout().is_contiguous()
        && acc.layout().start_offset() == 0
        && dims(acc.layout()) == Some(operands.out);
    if !fits {
        return Err(acc);
    }
    // None when the buffer is shared (a clone elsewhere must not see the sum change)
    let Some(out) = acc.try_storage_mut::<f32>() else { return Err(acc) };
    if out.len() != operands.out[0] * operands.out[1] {
        return Err(acc);
    }
    // SAFETY: `out` is `acc`'s own buffer of exactly m × n initialised values, held by
    // nobody else (`try_storage_mut`), which the kernel reads and writes.
    unsafe { operands.run(out.as_mut_ptr(), true) };
    Ok(acc)
}

/// The two operands of a product, checked: 2-D `f32`, matching inner dimensions, nothing
/// empty, and every element their layouts address inside their buffers.
struct Operands<'a> {
    /// (buffer, offset of the first element, row stride, column stride)
    a: (&'a [f32], usize, isize, isize),
    b: (&'a [f32], usize, isize, isize),
    k: usize,
    /// the product's shape [m, n]
    out: [usize; 2],
}

impl<'a> Operands<'a> {
    fn of(a: &'a FlexTensor, b: &'a FlexTensor) -> Option<Self> {
        if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
            return None;
        }
        let (la, lb) = (a.layout(), b.layout());
        let ([m, k], [kb, n]) = (dims(la)?, dims(lb)?);
        if k != kb || m == 0 || n == 0 || k == 0 {
            return None;
        }
        let (sa, sb) = (a.storage::<f32>(), b.storage::<f32>());
        Some(Operands {
            a: (sa, in_bounds(la, sa.len())?, la.strides()[0], la.strides()[1]),
            b: (sb, in_bounds(lb, sb.len())?, lb.strides()[0], lb.strides()[1]),
            k,
            out: [m, n],
        })
    }

    /// `out := a · b`, or `out := out + a · b` with `accumulate`, on one thread (as flex
    /// runs it without its `rayon` feature, which pipec leaves off: a device is a thread).
    ///
    /// # Safety
    /// `out` must point to m × n `f32`s laid out row-major that nothing else accesses during
    /// the call, initialised if `accumulate`.
    unsafe fn run(&self, out: *mut f32, accumulate: bool) {
        pack_left_operands();
        // SAFETY: as the caller guarantees
        unsafe { self.call(out, accumulate) }
    }

    /// [`Self::run`] under whatever packing threshold `gemm` has now.
    ///
    /// # Safety
    /// As for [`Self::run`].
    unsafe fn call(&self, out: *mut f32, accumulate: bool) {
        let ([m, n], (sa, a_off, a_rs, a_cs), (sb, b_off, b_rs, b_cs)) = (self.out, self.a, self.b);
        // SAFETY: the operands' offsets and strides were checked against their buffers'
        // lengths (`of`), the buffers outlive the call and are only read; `out` is as the
        // caller guarantees, and the kernel writes exactly its m × n elements (column stride 1,
        // row stride n), reading them only with `read_dst`.
        unsafe {
            gemm::gemm(
                m,
                n,
                self.k,
                out,
                1,
                n as isize,
                accumulate,
                sa.as_ptr().add(a_off),
                a_cs,
                a_rs,
                sb.as_ptr().add(b_off),
                b_cs,
                b_rs,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
}

/// How wide (in the kernel's column blocks) a product must be before `gemm` packs its left
/// operand; `gemm`'s default is 8 on one thread.
const LEFT_PACKING_THRESHOLD: usize = 1;

/// Has `gemm` pack a left operand that its kernel would read more than once. The setting is
/// the `gemm` crate's and process-wide (flex's own products follow it too); it is stored
/// before each of pipec's products, so nothing that changes it in between can slow them, and
/// it changes speed only.
///
/// `gemm` turns a row-major product around so that it writes columns, which makes a
/// row-major weight `W` of the forward `x · W` its left operand, read in place, column by
/// column: 16 floats from every row, a 4 KiB stride apart, and all of it again for each
/// block of 6 (AVX2) or more columns of the microbatch. By default it packs that operand
/// into contiguous panels only when the microbatch has more than 8 such blocks (48 rows on
/// AVX2), so at the benchmark's 32 rows every forward read its weight strided 6 times. Packed,
/// the forward of a 32 × 1024 · 1024 × 1024 product took 1.41–1.45 ms instead of
/// 2.43–2.56 ms, 16 rows 0.94–1.03 instead of 1.53–1.60 ms, 8 rows 0.95–1.00 instead of
/// 1.32–1.59 ms; 64 rows and more were packed already (docs/benchmarks.md).
fn pack_left_operands() {
    gemm::set_lhs_packing_threshold_single_thread(LEFT_PACKING_THRESHOLD);
}

fn dims(layout: &Layout) -> Option<[usize; 2]> {
    match layout.shape().as_slice() {
        &[r, c] => Some([r, c]),
        _ => None,
    }
}

/// The start offset, if every element the layout addresses lies in a buffer of `len`.
fn in_bounds(layout: &Layout, len: usize) -> Option<usize> {
    let start = isize::try_from(layout.start_offset()).ok()?;
    let (mut lo, mut hi) = (start, start);
    for (&extent, &stride) in layout.shape().iter().zip(layout.strides()) {
        let span = stride.checked_mul(isize::try_from(extent.checked_sub(1)?).ok()?)?;
        if span < 0 {
            lo = lo.checked_add(span)?;
        } else {
            hi = hi.checked_add(span)?;
        }
    }
    (lo >= 0 && usize::try_from(hi).ok()? < len).then_some(layout.start_offset())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::ops::FloatTensorOps;
    use burn::tensor::{Distribution, Shape, Tensor, TensorPrimitive};

    /// A seeded normal `f32` matrix on flex.
    pub(crate) fn random(shape: [usize; 2], seed: u64) -> FlexTensor {
        <Flex as burn::tensor::backend::Backend>::seed(&Default::default(), seed);
        Tensor::<Flex, 2>::random(shape, Distribution::Normal(0.0, 1.0), &Default::default()).into_primitive().tensor()
    }

    /// A matrix's values in row-major order.
    pub(crate) fn values(t: FlexTensor) -> Vec<f32> {
        Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(t)).into_data().to_vec::<f32>().expect("f32")
    }

    /// Flex's own product of the same views, and ours: the same numbers, bit for bit.
    fn same_as_flex(a: FlexTensor, b: FlexTensor, what: &str) {
        let ours = product(&a, &b).unwrap_or_else(|| panic!("{what}: not taken"));
        assert!(ours.is_contiguous(), "{what}");
        let shape = ours.layout().shape().clone();
        let flex = Flex::float_matmul(a, b);
        assert_eq!(&shape, flex.layout().shape(), "{what}");
        let (ours, flex) = (values(ours), values(flex));
        assert!(ours.iter().zip(&flex).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}");
    }

    #[test]
    fn the_product_is_flexs_bit_for_bit_for_every_layout() {
        let t = |x| Flex::float_transpose(x);
        for (m, k, n) in [(1, 1, 1), (1, 7, 3), (5, 48, 40), (32, 1024, 64), (33, 17, 129)] {
            let what = format!("{m}×{k}·{k}×{n}");
            same_as_flex(random([m, k], 1), random([k, n], 2), &format!("{what}, contiguous"));
            same_as_flex(t(random([k, m], 3)), random([k, n], 4), &format!("{what}, lhs transposed"));
            same_as_flex(random([m, k], 5), t(random([n, k], 6)), &format!("{what}, rhs transposed"));
            same_as_flex(t(random([k, m], 7)), t(random([n, k], 8)), &format!("{what}, both transposed"));
        }
        // views that start inside their buffer, and a column stride > 1
        let big = random([40, 60], 9);
        let a = Flex::float_slice(big.clone(), &[(3..8).into(), (10..30).into()]);
        let b = Flex::float_slice(big, &[(5..25).into(), (1..60).into()]);
        assert!(!a.is_contiguous() && a.layout().start_offset() > 0);
        same_as_flex(a, b.clone(), "narrowed views");
        let every_other =
            Flex::float_slice(random([20, 40], 10), &[burn::tensor::Slice::new(0, None, 2), (0..20).into()]);
        same_as_flex(every_other, b.clone(), "every other row");
        let flipped = Flex::float_flip(random([5, 20], 11), &[0, 1]);
        same_as_flex(flipped, b, "negative strides");
    }

    #[test]
    fn the_sum_is_added_in_place_as_flex_would_add_it() {
        let t = |x| Flex::float_transpose(x);
        for (m, k, n) in [(1, 1, 1), (24, 16, 40), (1024, 32, 96)] {
            let what = format!("{m}×{k}·{k}×{n}");
            let (a, b) = (t(random([k, m], 22)), random([k, n], 23));
            let acc = random([m, n], 24);
            let flex = Flex::float_add(acc.clone(), Flex::float_matmul(a.clone(), b.clone()));
            let unique = FlexTensor::from_data(TensorData::new(values(acc), [m, n])); // held by nobody else
            let at = unique.bytes().as_ptr();
            let ours = product_add(unique, &a, &b).unwrap_or_else(|_| panic!("{what}: not taken"));
            assert_eq!(ours.bytes().as_ptr(), at, "{what}: written in place");
            let (ours, flex) = (values(ours), values(flex));
            assert!(ours.iter().zip(&flex).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}");
        }
        // a sum another tensor shares, or of another shape, comes back untouched
        let shared = random([3, 2], 25);
        let back = product_add(shared.clone(), &random([3, 4], 26), &random([4, 2], 27)).expect_err("shared");
        assert_eq!(values(back), values(shared));
        let other = FlexTensor::from_data(TensorData::new(vec![0f32; 6], [2, 3]));
        assert!(product_add(other, &random([3, 4], 29), &random([4, 2], 30)).is_err());
    }

    /// The packing threshold decides where `gemm` copies an operand, not what it sums: the
    /// same products under `gemm`'s default and under pipec's threshold, bit for bit (the
    /// benchmark's shapes and odd ones, every operand layout, with and without a sum).
    #[test]
    fn packing_the_left_operand_changes_no_result() {
        let t = |x| Flex::float_transpose(x);
        let shapes =
            [(32, 1024, 1024), (1024, 1024, 32), (1024, 32, 1024), (8, 512, 700), (33, 1000, 99), (700, 300, 8)];
        for (i, (m, k, n)) in shapes.into_iter().enumerate() {
            let seed = 40 + 10 * i as u64;
            let lhs = [random([m, k], seed), t(random([k, m], seed + 1))];
            let rhs = [random([k, n], seed + 2), t(random([n, k], seed + 3))];
            for (a, b) in lhs.iter().flat_map(|a| rhs.iter().map(move |b| (a, b))) {
                let operands = Operands::of(a, b).expect("taken");
                let under = |threshold: usize, accumulate: bool| {
                    gemm::set_lhs_packing_threshold_single_thread(threshold);
                    let mut out: Vec<f32> = (0..m * n).map(|j| j as f32 * 0.25).collect();
                    // SAFETY: `out` holds m × n initialised values nothing else touches.
                    unsafe { operands.call(out.as_mut_ptr(), accumulate) };
                    out
                };
                for accumulate in [false, true] {
                    let (default, packed) = (under(8, accumulate), under(LEFT_PACKING_THRESHOLD, accumulate));
                    let what = format!(
                        "{m}×{k}·{k}×{n}, strides {:?} {:?}, sum {accumulate}",
                        a.layout().strides(),
                        b.layout().strides()
                    );
                    assert!(default.iter().zip(&packed).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}");
                }
            }
        }
        // and pipec's products set pipec's threshold, whatever was set before
        gemm::set_lhs_packing_threshold_single_thread(8);
        drop(product(&random([2, 3], 90), &random([3, 2], 91)));
        assert_eq!(gemm::get_lhs_packing_threshold_single_thread(), LEFT_PACKING_THRESHOLD);
    }

    #[test]
    fn every_output_element_is_written() {
        // a freed buffer of NaNs of the output's size is what the allocator hands out next
        for _ in 0..20 {
            drop(std::hint::black_box(vec![f32::NAN; 64 * 96]));
            let y = product(&random([64, 30], 12), &random([30, 96], 13)).expect("taken");
            assert!(values(y).iter().all(|v| v.is_finite()));
        }
    }

    #[test]
    fn other_cases_are_left_to_flex() {
        let two = random([3, 4], 14);
        // another rank, an empty side, mismatched inner dimensions, another dtype
        let three = Flex::float_reshape(random([2, 6], 15), Shape::new([1, 3, 4]));
        assert!(product(&three, &random([4, 2], 16)).is_none());
        assert!(product(&Flex::float_reshape(random([1, 0], 17), Shape::new([0, 3])), &two).is_none());
        assert!(product(&two, &random([3, 4], 18)).is_none());
        let double = Flex::float_cast(two.clone(), burn::tensor::FloatDType::F64);
        assert!(product(&double, &random([4, 2], 19)).is_none());
        // a layout that claims more than its buffer holds is refused, not read
        let lying = FlexTensor::new(
            burn::tensor::Bytes::from_elems(vec![0f32; 12]),
            Layout::new(Shape::new([3, 5]), vec![5, 1], 0),
            DType::F32,
        );
        assert!(product(&lying, &random([5, 2], 20)).is_none());
        let past_the_end = FlexTensor::new(
            burn::tensor::Bytes::from_elems(vec![0f32; 12]),
            Layout::new(Shape::new([3, 4]), vec![4, 1], 1),
            DType::F32,
        );
        assert!(product(&past_the_end, &random([4, 2], 21)).is_none());
    }
}
