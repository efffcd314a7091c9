//! The forward product `x · W` of a weight on Burn's `flex` backend, from a transposed copy
//! of the weight once the weight has been used twice.
//!
//! The `gemm` kernel is fast when the weight is the operand it streams along the inner
//! dimension: the input gradient `(W · dyᵀ)ᵀ` reads the row-major `W` that way. The forward
//! `x · W` reads `W` across its rows instead, so `gemm` first packs it — a gather of 64-byte
//! pieces 4 KiB apart, on every forward (16% of a one-worker step on the benchmark model).
//! The same numbers come from `(Wᵀ · xᵀ)ᵀ` with a contiguous `Wᵀ`, which the kernel streams
//! like the input gradient's `W`: 32 × 1024 · 1024 × 1024 over a stage's four weights in
//! 0.94–1.27 ms instead of 1.40–1.79 ms packed (`pipec-bench kernels`, docs/benchmarks.md).
//!
//! A weight's transposed copy is made at its second forward (a weight used once per update,
//! as under PipeDream's per-microbatch updates, is never copied) and kept, per thread, for as
//! long as anything else holds that weight. An update ([`crate::interp::stage::StageOptim::update`])
//! takes the copies of the weights it replaces ([`take`]: nothing extra then holds them
//! while they are updated) and makes the new version's right after ([`copy_now`]), in the
//! replaced copy's buffer, so that every forward of the version runs from the copy and the
//! transposition runs inside the update — which a later pipeline stage does while it waits
//! for its next first input. A copy costs one transposition per weight and update (about a
//! millisecond for 1024 × 1024, repaid by two to four forwards from it) and the weight's size
//! in memory while it lives; [`release`] drops them all.
//!
//! The copy is only used where the two orientations run `gemm`'s same kernel path, so that
//! the result is the direct product's bit for bit (tested): a schedule's numbers do not
//! depend on which of a weight's forwards came first.

use burn::backend::flex::FlexTensor;
use burn::tensor::DType;
use std::cell::RefCell;

/// More rows than this and `gemm` packs the weight well on its own (equal times at 256 rows).
const MAX_ROWS: usize = 128;

/// `gemm` takes another kernel path for a one-row product and for products of at most
/// 16 × 16 outputs, which sum in another order in the two orientations.
fn same_kernel_path(rows: usize, cols: usize) -> bool {
    rows >= 2 && cols >= 2 && rows * cols > 16 * 16
}

/// A weight this thread has multiplied by once, or twice and more (then with its copy).
struct Entry {
    /// A clone of the weight: keeps its buffer alive (so its address names it) and unchanged
    /// (flex copies a shared buffer before writing).
    weight: FlexTensor,
    transposed: Option<FlexTensor>,
}

thread_local! {
    static COPIES: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
    /// Copies of replaced weights, nothing else holds, kept from [`take`] to [`copy_now`]
    /// across an update, which writes the new version's copy into one of them.
    static SPARES: RefCell<Vec<FlexTensor>> = const { RefCell::new(Vec::new()) };
}

/// `x · w` from `w`'s transposed copy, for a 2-D `f32` microbatch `x` and a contiguous 2-D
/// `f32` weight `w`; `None` where the direct product should run (the weight's first forward,
/// other shapes, layouts and dtypes).
pub(crate) fn product(x: &FlexTensor, w: &FlexTensor) -> Option<FlexTensor> {
    let &[rows, inner] = x.layout().shape().as_slice() else { return None };
    let (w_rows, cols) = whole_matrix(w)?;
    if x.dtype() != DType::F32 || inner != w_rows {
        return None;
    }
    if rows > MAX_ROWS || !same_kernel_path(rows, cols) {
        return None;
    }
    let wt = transposed(w)?;
    // (wᵀ · xᵀ)ᵀ: a transposed view of the product, as the input gradient's
    crate::backend::flex_gemm::product(&wt, &x.transpose(0, 1)).map(|yt| yt.transpose(0, 1))
}

/// `w`'s (rows, cols) if it is a contiguous 2-D `f32` matrix filling its buffer.
fn whole_matrix(w: &FlexTensor) -> Option<(usize, usize)> {
    let &[rows, cols] = w.layout().shape().as_slice() else { return None };
    let whole = w.layout().is_contiguous()
        && w.layout().start_offset() == 0
        && w.bytes().len() == rows * cols * std::mem::size_of::<f32>();
    (w.dtype() == DType::F32 && whole).then_some((rows, cols))
}

/// Drops this thread's entry for `w` (so that nothing here holds it while it is updated);
/// whether it had a transposed copy. The copy's buffer is kept for [`copy_now`] if nothing
/// else holds it.
pub(crate) fn take(w: &FlexTensor) -> bool {
    let taken = COPIES.with(|c| {
        let mut entries = c.borrow_mut();
        let at = entries.iter().position(|e| same_weight(&e.weight, w));
        at.and_then(|i| entries.swap_remove(i).transposed)
    });
    let Some(t) = taken else { return false };
    if t.is_unique() {
        SPARES.with(|s| s.borrow_mut().push(t));
    }
    true
}

/// Makes `w`'s transposed copy now instead of at its second forward: for the new version of
/// a weight whose previous version had one, so that all its forwards run from the copy and
/// the transposition runs where the worker puts it (after the update, while a later stage
/// waits for its first input). Other matrices are left alone.
pub(crate) fn copy_now(w: &FlexTensor) {
    let Some((rows, cols)) = whole_matrix(w) else { return };
    COPIES.with(|c| {
        let mut entries = c.borrow_mut();
        if entries.iter().any(|e| same_weight(&e.weight, w) && e.transposed.is_some()) {
            return;
        }
        entries.retain(|e| !e.weight.is_unique() && !same_weight(&e.weight, w));
        // into the buffer of a replaced copy of the same shape where there is one
        let spare = SPARES.with(|s| {
            let mut spares = s.borrow_mut();
            let at = spares.iter().position(|t| t.layout().shape().as_slice() == [cols, rows]);
            at.map(|i| spares.swap_remove(i))
        });
        let reused = spare.and_then(|mut t| {
            transpose_into(w.storage::<f32>(), rows, cols, t.try_storage_mut::<f32>()?);
            Some(t)
        });
        let transposed = reused.unwrap_or_else(|| fresh_transpose(w, rows, cols));
        entries.push(Entry { weight: w.clone(), transposed: Some(transposed) });
    })
}

fn same_weight(a: &FlexTensor, b: &FlexTensor) -> bool {
    a.bytes().as_ptr() == b.bytes().as_ptr() && a.layout() == b.layout()
}

/// Drops this thread's transposed copies (they are only a speed-up: the next forwards make
/// them again).
pub(crate) fn release() {
    COPIES.with(|c| c.borrow_mut().clear());
    SPARES.with(|s| s.borrow_mut().clear());
}

/// How many weights this thread holds copies of.
#[cfg(test)]
fn copies() -> usize {
    COPIES.with(|c| c.borrow().iter().filter(|e| e.transposed.is_some()).count())
}

/// `w`'s transposed copy, made at its second forward.
fn transposed(w: &FlexTensor) -> Option<FlexTensor> {
    COPIES.with(|c| {
        let mut entries = c.borrow_mut();
        match entries.iter_mut().find(|e| same_weight(&e.weight, w)) {
            Some(entry) => {
                if entry.transposed.is_none() {
                    let [rows, cols] = [w.layout().shape()[0], w.layout().shape()[1]];
                    entry.transposed = Some(fresh_transpose(w, rows, cols));
                }
                entry.transposed.clone()
            }
            None => {
                // weights nothing else holds any more (replaced by an update) go first
                entries.retain(|e| !e.weight.is_unique());
                entries.push(Entry { weight: w.clone(), transposed: None });
                None
            }
        }
    })
}

/// The `cols × rows` transpose of a row-major `rows × cols` matrix. Bands of 8 source rows:
/// each output row gets 8 consecutive values per band while the band's rows stay in cache
/// (0.9–1.5 ms for 1024 × 1024 in a scratch program, against 4.6 ms for 32 × 32 tiles, whose
/// 4 KiB-apart writes share cache sets, and 5.2 ms for flex's own transposed copy).
fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    transpose_into(src, rows, cols, &mut out);
    out
}

/// [`transpose`] into `out` (`rows × cols` values).
fn transpose_into(src: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    for (b, band) in src.chunks(8 * cols).enumerate() {
        let first = b * 8;
        let n = band.len() / cols;
        for (j, row) in out.chunks_exact_mut(rows).enumerate() {
            for (k, v) in row[first..first + n].iter_mut().enumerate() {
                *v = band[k * cols + j];
            }
        }
    }
}

/// `w`'s transpose in a new tensor.
fn fresh_transpose(w: &FlexTensor, rows: usize, cols: usize) -> FlexTensor {
    let t = transpose(w.storage::<f32>(), rows, cols);
    FlexTensor::from_data(burn::tensor::TensorData::new(t, [cols, rows]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::flex_gemm::tests::{random, values};
    use burn::backend::Flex;
    use burn::tensor::ops::FloatTensorOps;
    use burn::tensor::TensorData;

    #[test]
    fn the_transpose_is_the_transpose() {
        for (rows, cols) in [(1, 1), (3, 5), (8, 8), (9, 17), (64, 3), (1024, 1024)] {
            let src: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let t = transpose(&src, rows, cols);
            for i in 0..rows {
                for j in 0..cols {
                    assert_eq!(t[j * rows + i], src[i * cols + j], "{rows}×{cols} at ({i}, {j})");
                }
            }
        }
    }

    /// The copy's product is the direct product bit for bit wherever it is used, from the
    /// second forward on; the first forward, and shapes outside the same kernel path, are
    /// left to the direct product.
    #[test]
    fn from_the_second_forward_the_copy_gives_the_same_bits() {
        release();
        let shapes = [(32, 1024, 1024), (2, 300, 129), (128, 64, 96), (5, 700, 70), (100, 33, 1000), (16, 17, 17)];
        let mut weights = Vec::new(); // held, as a stage holds its weights
        for (i, (rows, inner, cols)) in shapes.into_iter().enumerate() {
            let w = random([inner, cols], 60 + i as u64);
            weights.push(w.clone());
            let direct = values(Flex::float_matmul(random([rows, inner], 70 + i as u64), w.clone()));
            let x = random([rows, inner], 70 + i as u64);
            assert!(product(&x, &w).is_none(), "the first forward runs the direct product");
            let ours = product(&x, &w).unwrap_or_else(|| panic!("{rows}×{inner}·{inner}×{cols}: not taken"));
            let what = format!("{rows}×{inner}·{inner}×{cols}");
            assert!(values(ours).iter().zip(&direct).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}");
        }
        assert_eq!(copies(), shapes.len());
        release();
        assert_eq!(copies(), 0);
    }

    #[test]
    fn other_shapes_and_layouts_are_left_to_the_direct_product() {
        release();
        let w = random([64, 64], 80);
        for x in [random([1, 64], 81), random([129, 64], 82), random([4, 64], 83)] {
            // one row, more rows than MAX_ROWS, at most 16 × 16 outputs (4 × 64 = 256)
            for _ in 0..3 {
                assert!(product(&x, &w).is_none(), "{:?}", x.layout().shape());
            }
        }
        let x = random([32, 64], 84);
        let view = Flex::float_transpose(random([64, 64], 85)); // a transposed view
        let narrowed = Flex::float_slice(random([80, 64], 86), &[(0..64).into(), (0..64).into()]);
        let double = Flex::float_cast(random([64, 64], 87), burn::tensor::FloatDType::F64);
        for w in [view, narrowed, double] {
            for _ in 0..3 {
                assert!(product(&x, &w).is_none());
            }
        }
        assert!(product(&random([32, 63], 88), &w).is_none(), "mismatched inner dimensions");
        assert_eq!(copies(), 0);
    }

    /// A weight replaced by a new version (nothing else holds the old one) loses its copy at
    /// the next new weight; one still held elsewhere keeps it.
    #[test]
    fn copies_live_as_long_as_their_weights() {
        release();
        let x = random([32, 48], 90);
        let (old, kept) = (random([48, 40], 91), random([48, 40], 92));
        for w in [&old, &kept] {
            drop(product(&x, w));
            drop(product(&x, w));
        }
        assert_eq!(copies(), 2);
        drop(old);
        let new = FlexTensor::from_data(TensorData::new(vec![0.5f32; 48 * 40], [48, 40]));
        drop(product(&x, &new));
        assert_eq!(copies(), 1, "the old weight's copy went, the held one's stayed");
        drop(product(&x, &kept));
        assert_eq!(copies(), 1);
        release();
    }

    /// After an update the new version's copy is made at once, in the buffer of the replaced
    /// version's copy, and its first forward already runs from it, with the direct
    /// product's bits; a weight used once (no copy) gets none.
    #[test]
    fn an_update_makes_the_new_versions_copy_in_the_old_ones_buffer() {
        release();
        let x = random([32, 96], 100);
        let old = random([96, 80], 101);
        drop(product(&x, &old));
        drop(product(&x, &old));
        let at = copy_address(&old).expect("a copy from the second forward");
        assert!(take(&old), "the old version had a copy");
        assert_eq!(copies(), 0);
        drop(old);
        let new = random([96, 80], 102);
        copy_now(&new);
        assert_eq!(copies(), 1);
        assert_eq!(copy_address(&new), Some(at), "written into the replaced copy's buffer");
        assert_eq!(SPARES.with(|s| s.borrow().len()), 0);
        let direct = values(Flex::float_matmul(x.clone(), new.clone()));
        let first = product(&x, &new).expect("the first forward runs from the copy");
        assert!(values(first).iter().zip(&direct).all(|(a, b)| a.to_bits() == b.to_bits()));
        // used once: nothing to renew
        let once = random([96, 80], 103);
        drop(product(&x, &once));
        assert!(!take(&once));
        assert!(!take(&random([96, 80], 104)), "never seen");
        release();
        assert_eq!(copies(), 0);
    }

    /// Where the new version's copy lives.
    fn copy_address(w: &FlexTensor) -> Option<*const u8> {
        COPIES.with(|c| {
            c.borrow()
                .iter()
                .find(|e| same_weight(&e.weight, w))
                .and_then(|e| e.transposed.as_ref())
                .map(|t| t.bytes().as_ptr())
        })
    }
}
