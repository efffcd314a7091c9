//! Rotary position embeddings (RoFormer; Hugging Face's `rotate_half` layout) on Burn's
//! operations: the table of a sequence's positions, the rotation of queries or keys and its
//! gradient ([`Kernels::rotary`]'s and [`Kernels::rotary_grads`]' defaults;
//! `crate::backend::flex_rotary` fuses them on the CPU).
//!
//! Features i and i + dh/2 of position p turn by the angle p·f_i: with c and s the table's
//! cosines and sines, the output is x·c + rotate(x)·s, rotate(x) = (−x₂, x₁) of the halves.
//! The rotation is linear, so its gradient is the transposed map: dy·c + (d₂, −d₁) of
//! d = dy·s.
//!
//! [`Kernels::rotary`]: crate::backend::kernels::Kernels::rotary
//! [`Kernels::rotary_grads`]: crate::backend::kernels::Kernels::rotary_grads

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};

/// The cosines and sines of a run of positions, [positions, dh] each, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotation {
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
    /// The positions' count (the rotated tensors' second-to-last dimension).
    pub(crate) rows: usize,
    /// The rotated features (the last dimension), even.
    pub(crate) dh: usize,
}

impl Rotation {
    /// The table at `positions` of a sequence of `seq` positions (0, 1, … but for a
    /// context-parallel member) for `dh` features: f_i the scaling's inverse frequencies
    /// ([`pipec_plan::rope::RopeScaling::inv_freq`]: θ^(−2i/dh) unscaled), the cosines and
    /// sines times its attention factor (YaRN's).
    pub fn new(
        theta: f64,
        scaling: &pipec_plan::rope::RopeScaling,
        positions: &[usize],
        seq: usize,
        dh: usize,
    ) -> Self {
        let half = dh / 2;
        let inv_freq = scaling.inv_freq(theta, dh, seq);
        let scale = scaling.attention_factor();
        let (mut cos, mut sin) = (Vec::with_capacity(positions.len() * dh), Vec::with_capacity(positions.len() * dh));
        for &p in positions {
            for j in 0..dh {
                // the angle in f32, as the reference computes it from its f32 inv_freq
                let angle = f64::from(p as f32 * inv_freq[j % half]);
                cos.push((angle.cos() * scale) as f32);
                sin.push((angle.sin() * scale) as f32);
            }
        }
        Rotation { cos, sin, rows: positions.len(), dh }
    }

    /// The cosines and sines as [1, rows·dh] tensors on `device`.
    fn tables<B: Backend>(&self, device: &B::Device) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let row = |v: &[f32]| Tensor::<B, 2>::from_data(TensorData::new(v.to_vec(), [1, self.rows * self.dh]), device);
        (row(&self.cos), row(&self.sin))
    }
}

/// `t` [.., rows, dh] as [blocks, rows·dh], with its shape.
fn as_blocks<B: Backend>(t: FloatTensor<B>, r: &Rotation) -> (Tensor<B, 2>, Shape) {
    let shape = t.shape();
    let blocks = shape.num_elements() / (r.rows * r.dh).max(1);
    (Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(t, Shape::new([blocks, r.rows * r.dh])))), shape)
}

/// `x` [.., rows, dh] (queries or keys, the positions along its second-to-last dimension)
/// turned by `r`. In two dimensions: `flex` runs element-wise operations on 2-D views row
/// by row and broadcasts one shared row in one pass, where a 4-D view or a [rows, dh] table
/// broadcast over batch and heads takes its general strided path, several times slower.
pub fn forward<B: Backend>(x: FloatTensor<B>, r: &Rotation) -> FloatTensor<B> {
    let (x, shape) = as_blocks::<B>(x, r);
    let (cos, sin) = r.tables::<B>(&x.device());
    let [blocks, width] = x.dims();
    let half = r.dh / 2;
    let rows = x.clone().reshape([blocks * r.rows, r.dh]);
    let turned = Tensor::cat(vec![rows.clone().narrow(1, half, half).neg(), rows.narrow(1, 0, half)], 1);
    let y = x * cos + turned.reshape([blocks, width]) * sin;
    B::float_reshape(y.into_primitive().tensor(), shape)
}

/// [`forward`]'s gradient from its output's gradient `dy`: dy·c + (d₂, −d₁), d = dy·s.
pub fn gradients<B: Backend>(dy: FloatTensor<B>, r: &Rotation) -> FloatTensor<B> {
    let (dy, shape) = as_blocks::<B>(dy, r);
    let (cos, sin) = r.tables::<B>(&dy.device());
    let [blocks, width] = dy.dims();
    let half = r.dh / 2;
    let d = (dy.clone() * sin).reshape([blocks * r.rows, r.dh]);
    let turned = Tensor::cat(vec![d.clone().narrow(1, half, half), d.narrow(1, 0, half).neg()], 1);
    let dx = dy * cos + turned.reshape([blocks, width]);
    B::float_reshape(dx.into_primitive().tensor(), shape)
}
