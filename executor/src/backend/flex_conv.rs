//! The 2-D convolution and its gradients on Burn's `flex` backend, as matrix products over
//! the input's patches (im2col).
//!
//! `flex` 0.21 runs a convolution's forward as tiled im2col products, but its gradients as
//! Burn's defaults: the input's a transposed convolution, the weight's a convolution of the
//! input by the output's gradient (a kernel the size of the output map). On a ResNet's
//! 32 × 32 maps those took 3–4 times the forward: 15 ms of a 19 ms forward and backward of
//! a 32 → 32-channel 3 × 3 convolution of 8 images, whose forward products are 151 MFLOP
//! (`specs/resnet-small.yaml`, `specs/cnn.yaml`; docs/benchmarks.md). Here the input's
//! patches of a run of samples are laid out once as a matrix `cols` [C·kh·kw, samples·L]
//! (L output positions each), and:
//! - the forward is `W · cols` ([C_out, C·kh·kw] · cols), plus the bias;
//! - the weight's gradient is `dY · colsᵀ`, the patches laid out again from the input (summed
//!   as its transpose `cols · dYᵀ` where the patch matrix is the larger operand: with its
//!   transposed view on the right the product took 1.8–2.4 times as long on the example
//!   CNNs' shapes);
//! - the input's gradient is `Wᵀ · dY`, each patch's column added back where it came from
//!   (col2im).
//!
//! Samples are taken in runs whose patch matrix holds at most [`PATCH_VALUES`] values. The
//! products are `crate::backend::flex_gemm`'s. The sums run in another order than Burn's
//! (tested against its convolution within float rounding); every layout of a plan runs
//! this kernel, so pipelines still train to the single device's numbers.

use burn::backend::flex::FlexTensor;
use burn::backend::Flex;
use burn::tensor::ops::{ConvOptions, FloatTensorOps};
use burn::tensor::{DType, Shape, TensorData};

use crate::backend::flex_gemm;

/// The most values of a run of samples' patch matrix (16 MiB of `f32`).
const PATCH_VALUES: usize = 1 << 22;

/// A convolution's sizes, checked: 4-D `f32` input and weight of matching channels, one
/// group, an output of at least one position.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    c_out: usize,
    kh: usize,
    kw: usize,
    ho: usize,
    wo: usize,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
}

impl Geometry {
    fn of(x: &FlexTensor, weight: &FlexTensor, options: &ConvOptions<2>) -> Option<Self> {
        if x.dtype() != DType::F32 || weight.dtype() != DType::F32 || options.groups != 1 {
            return None;
        }
        let (&[n, c, h, w], &[c_out, c_in, kh, kw]) =
            (x.layout().shape().as_slice(), weight.layout().shape().as_slice())
        else {
            return None;
        };
        let [stride, padding, dilation] = [options.stride, options.padding, options.dilation];
        if c_in != c || stride.contains(&0) || dilation.contains(&0) || [n, c, c_out, kh, kw].contains(&0) {
            return None;
        }
        let axis = |size: usize, k: usize, i: usize| {
            let span = dilation[i] * (k - 1) + 1;
            let padded = size + 2 * padding[i];
            (padded >= span).then(|| (padded - span) / stride[i] + 1)
        };
        let (ho, wo) = (axis(h, kh, 0)?, axis(w, kw, 1)?);
        Some(Geometry { n, c, h, w, c_out, kh, kw, ho, wo, stride, padding, dilation })
    }

    /// Rows of the patch matrix: C·kh·kw.
    fn patch(&self) -> usize {
        self.c * self.kh * self.kw
    }

    /// Output positions per sample.
    fn positions(&self) -> usize {
        self.ho * self.wo
    }

    /// How many samples a run takes whose patch matrix holds at most `limit` values (at
    /// least one sample).
    fn run(&self, limit: usize) -> usize {
        (limit / (self.patch() * self.positions()).max(1)).clamp(1, self.n)
    }

    /// The input row that output row `oh` reads at kernel row `ki`, if inside.
    fn source_row(&self, oh: usize, ki: usize) -> Option<usize> {
        let ih = (oh * self.stride[0] + ki * self.dilation[0]).checked_sub(self.padding[0])?;
        (ih < self.h).then_some(ih)
    }

    /// The output columns `lo..hi` that read inside the input at kernel column `kj`, and
    /// the input column the first of them reads (each next one `stride` further).
    fn columns(&self, kj: usize) -> (usize, usize, usize) {
        let inside = |ow: usize| {
            (ow * self.stride[1] + kj * self.dilation[1]).checked_sub(self.padding[1]).filter(|&iw| iw < self.w)
        };
        let Some(lo) = (0..self.wo).find(|&ow| inside(ow).is_some()) else { return (0, 0, 0) };
        let hi = (lo..self.wo).take_while(|&ow| inside(ow).is_some()).count() + lo;
        (lo, hi, inside(lo).unwrap_or(0))
    }

    /// Calls `f(patch offset, input offset, count, input step)` for each run of a patch row
    /// that reads inside samples `first..first + m` of a contiguous [n, c, h, w] input: the
    /// patch matrix is [C·kh·kw, m·L], row (ci, ki, kj), column (sample, oh, ow); what no run
    /// names is padding.
    fn runs(&self, first: usize, m: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
        let (l, cols) = (self.positions(), m * self.positions());
        for ci in 0..self.c {
            for ki in 0..self.kh {
                for kj in 0..self.kw {
                    let row = ((ci * self.kh + ki) * self.kw + kj) * cols;
                    let (lo, hi, iw0) = self.columns(kj);
                    if lo >= hi {
                        continue;
                    }
                    for s in 0..m {
                        let plane = ((first + s) * self.c + ci) * self.h * self.w;
                        for oh in 0..self.ho {
                            if let Some(ih) = self.source_row(oh, ki) {
                                f(row + s * l + oh * self.wo + lo, plane + ih * self.w + iw0, hi - lo, self.stride[1]);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The patch matrix of samples `first..first + m` of `x` (contiguous [n, c, h, w]):
    /// [C·kh·kw, m·L], row (ci, ki, kj), column (sample, oh, ow); zeros in the padding.
    fn im2col(&self, x: &[f32], first: usize, m: usize) -> Vec<f32> {
        // each value written once, in order: no zeroed buffer to write over (zeroing the
        // matrix first took longer than laying it out, docs/benchmarks.md)
        let mut out = Vec::with_capacity(self.patch() * m * self.positions());
        let zeros = |out: &mut Vec<f32>, count: usize| out.resize(out.len() + count, 0.0);
        for ci in 0..self.c {
            for ki in 0..self.kh {
                for kj in 0..self.kw {
                    let (lo, hi, iw0) = self.columns(kj);
                    for s in 0..m {
                        let plane = ((first + s) * self.c + ci) * self.h * self.w;
                        for oh in 0..self.ho {
                            match self.source_row(oh, ki).filter(|_| lo < hi) {
                                None => zeros(&mut out, self.wo),
                                Some(ih) => {
                                    let from = plane + ih * self.w + iw0;
                                    zeros(&mut out, lo);
                                    if self.stride[1] == 1 {
                                        out.extend_from_slice(&x[from..from + hi - lo]);
                                    } else {
                                        out.extend((0..hi - lo).map(|t| x[from + t * self.stride[1]]));
                                    }
                                    zeros(&mut out, self.wo - hi);
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// Adds the patch matrix's gradient `dcols` [C·kh·kw, m·L] of samples `first..first + m`
    /// back into `dx` (contiguous [n, c, h, w]) where each value came from.
    fn col2im(&self, dcols: &[f32], first: usize, m: usize, dx: &mut [f32]) {
        self.runs(first, m, |from, to, count, step| {
            let src = &dcols[from..from + count];
            if step == 1 {
                dx[to..to + count].iter_mut().zip(src).for_each(|(d, v)| *d += v);
            } else {
                for (t, v) in src.iter().enumerate() {
                    dx[to + t * step] += v;
                }
            }
        });
    }
}

/// A 2-D `f32` tensor of `shape` owning `v`.
fn matrix(v: Vec<f32>, shape: [usize; 2]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(v, shape))
}

/// The weight [C_out, C, kh, kw] as the matrix [C_out, C·kh·kw].
fn weight_matrix(weight: &FlexTensor, g: &Geometry) -> FlexTensor {
    Flex::float_reshape(weight.to_contiguous(), Shape::new([g.c_out, g.patch()]))
}

/// `conv2d(x, weight) + bias`; None where `flex`'s own should run (another dtype, groups).
pub(crate) fn forward(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: Option<&FlexTensor>,
    options: &ConvOptions<2>,
) -> Option<FlexTensor> {
    let g = Geometry::of(x, weight, options)?;
    let bias = match bias {
        Some(b) if b.dtype() != DType::F32 || b.layout().num_elements() != g.c_out => return None,
        Some(b) => Some(b.to_contiguous()),
        None => None,
    };
    let bias = bias.as_ref().map(|b| b.storage::<f32>());
    let (x, w) = (x.to_contiguous(), weight_matrix(weight, &g));
    let (xs, l) = (x.storage::<f32>(), g.positions());
    // [n, C_out, L] filled in order, run after run
    let mut out = Vec::with_capacity(g.n * g.c_out * l);
    let run = g.run(PATCH_VALUES);
    for first in (0..g.n).step_by(run) {
        let m = run.min(g.n - first);
        let cols = matrix(g.im2col(xs, first, m), [g.patch(), m * l]);
        let y = flex_gemm::product(&w, &cols)?;
        let ys = y.storage::<f32>();
        for s in 0..m {
            for co in 0..g.c_out {
                let from = &ys[co * m * l + s * l..][..l];
                match bias {
                    Some(b) => out.extend(from.iter().map(|v| v + b[co])),
                    None => out.extend_from_slice(from),
                }
            }
        }
    }
    Some(FlexTensor::from_data(TensorData::new(out, [g.n, g.c_out, g.ho, g.wo])))
}

/// The input's and the weight's gradients (each where asked for) from the output's
/// gradient `dy` [n, C_out, ho, wo]; None where `flex`'s own should run.
pub(crate) fn backward(
    x: &FlexTensor,
    weight: &FlexTensor,
    dy: &FlexTensor,
    options: &ConvOptions<2>,
    want: (bool, bool),
) -> Option<(Option<FlexTensor>, Option<FlexTensor>)> {
    backward_in_runs(x, weight, dy, options, want, PATCH_VALUES)
}

/// [`backward`] over runs of samples whose patch matrix holds at most `limit` values.
fn backward_in_runs(
    x: &FlexTensor,
    weight: &FlexTensor,
    dy: &FlexTensor,
    options: &ConvOptions<2>,
    (want_x, want_w): (bool, bool),
    limit: usize,
) -> Option<(Option<FlexTensor>, Option<FlexTensor>)> {
    let g = Geometry::of(x, weight, options)?;
    if dy.dtype() != DType::F32 || dy.layout().shape().as_slice() != [g.n, g.c_out, g.ho, g.wo] {
        return None;
    }
    let (x, w, dy) = (x.to_contiguous(), weight_matrix(weight, &g), dy.to_contiguous());
    let (xs, dys, l) = (x.storage::<f32>(), dy.storage::<f32>(), g.positions());
    let wt = Flex::float_transpose(w);
    let mut dx = want_x.then(|| vec![0.0f32; g.n * g.c * g.h * g.w]);
    let mut dw: Option<FlexTensor> = None;
    // the weight's gradient summed as its transpose [C·kh·kw, C_out] = cols · dᵀ where the
    // patch matrix is the larger operand
    let transposed = g.patch() >= g.c_out;
    let run = g.run(limit);
    for first in (0..g.n).step_by(run) {
        let m = run.min(g.n - first);
        // this run's output gradient as [C_out, m·L]
        let mut d = Vec::with_capacity(g.c_out * m * l);
        for co in 0..g.c_out {
            for s in 0..m {
                d.extend_from_slice(&dys[((first + s) * g.c_out + co) * l..][..l]);
            }
        }
        let d = matrix(d, [g.c_out, m * l]);
        if want_w {
            // the larger of the patch matrix and the output's gradient is read as the
            // row-major left operand (the patch matrix's transposed view as the right one
            // made the product take 1.8–2.4 times as long)
            let cols = matrix(g.im2col(xs, first, m), [g.patch(), m * l]);
            let (a, b) = match transposed {
                true => (cols, Flex::float_transpose(d.clone())),
                false => (d.clone(), Flex::float_transpose(cols)),
            };
            dw = Some(match dw.take() {
                None => flex_gemm::product(&a, &b)?,
                Some(acc) => flex_gemm::product_add(acc, &a, &b).ok()?,
            });
        }
        if let Some(dx) = dx.as_mut() {
            let dcols = flex_gemm::product(&wt, &d)?;
            g.col2im(dcols.storage::<f32>(), first, m, dx);
        }
    }
    let dx = dx.map(|v| FlexTensor::from_data(TensorData::new(v, [g.n, g.c, g.h, g.w])));
    // the weight's gradient as [C_out, C·kh·kw] (summed as its transpose where `transposed`)
    let dw = dw.map(|t| if transposed { Flex::float_transpose(t).to_contiguous() } else { t });
    let dw = dw.map(|t| Flex::float_reshape(t, Shape::new([g.c_out, g.c, g.kh, g.kw])));
    Some((dx, dw))
}

#[cfg(test)]
mod tests;
