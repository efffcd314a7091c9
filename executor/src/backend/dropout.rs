//! Dropout masks that do not depend on the layout: each element of the whole tensor, as one
//! device holds it, has its own draw, at its row-major place in the tensor from the
//! microbatch's key ([`Rng::uniform_at`]). A device holding part of it (a tensor-parallel
//! rank's heads, a context-parallel member's positions) draws only its part's elements and
//! gets the values one device would; a backward draws the same mask again from the
//! description ([`Kernels::dropout`](crate::backend::kernels::Kernels::dropout) keeps no
//! mask, [`DropoutBackward`]).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::prelude::*;
use burn::tensor::TensorPrimitive;

use crate::backend::rng::Rng;

/// A dropout mask: which elements of a whole tensor one device keeps (each kept value
/// scaled by 1/(1 − p)), cut to a part of it.
#[derive(Debug, Clone)]
pub struct DropMask {
    /// The probability of dropping an element.
    pub p: f64,
    start: Rng,
    /// The whole tensor's dimensions.
    whole: Vec<usize>,
    /// Per dimension, the indices of the part this device holds, in its order.
    picks: Vec<Vec<usize>>,
}

impl DropMask {
    /// The mask drawn from `key` for the elements at `picks` (per dimension of `whole`,
    /// the indices held, in order).
    pub fn new(p: f64, key: &[u64], whole: Vec<usize>, picks: Vec<Vec<usize>>) -> Self {
        debug_assert_eq!(whole.len(), picks.len());
        debug_assert!(picks.iter().zip(&whole).all(|(ix, &n)| ix.iter().all(|&i| i < n)));
        DropMask { p, start: Rng::keyed(key), whole, picks }
    }

    /// The mask of a whole tensor of dimensions `whole`.
    pub fn whole(p: f64, key: &[u64], whole: Vec<usize>) -> Self {
        let picks = whole.iter().map(|&n| (0..n).collect()).collect();
        Self::new(p, key, whole, picks)
    }

    /// How many elements the part holds.
    pub fn len(&self) -> usize {
        self.picks.iter().map(Vec::len).product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The part's factors in row-major order of the picks: 0 for a dropped element, else
    /// 1/(1 − p).
    pub fn factors(&self) -> Vec<f32> {
        let keep = (1.0 / (1.0 - self.p)) as f32;
        let draw = |flat: u64| if self.start.uniform_at(flat) < self.p { 0.0 } else { keep };
        let Some((last, outer)) = self.picks.split_last() else { return vec![draw(0)] };
        // each dimension's stride in the whole tensor (the last one's is 1)
        let mut strides = vec![1u64; self.whole.len()];
        for d in (0..self.whole.len() - 1).rev() {
            strides[d] = strides[d + 1] * self.whole[d + 1] as u64;
        }
        // where each row of the last dimension starts in the whole tensor, in row-major order
        let mut starts = vec![0u64];
        for (picks, &stride) in outer.iter().zip(&strides) {
            starts = starts.iter().flat_map(|&s| picks.iter().map(move |&i| s + i as u64 * stride)).collect();
        }
        let mut out = Vec::with_capacity(self.len());
        for s in starts {
            out.extend(last.iter().map(|&i| draw(s + i as u64)));
        }
        out
    }

    /// The factors as a tensor of the part's shape, flattened.
    pub fn tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 1> {
        let n = self.len();
        Tensor::from_data(TensorData::new(self.factors(), [n]), device)
    }
}

/// Where a dropout is, each site drawing its own masks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// A `dropout` layer.
    Layer,
    /// A transformer block's attention probabilities.
    AttentionProbabilities,
    /// A transformer block's attention output, before its residual sum.
    AttentionOutput,
    /// A transformer block's MLP (or experts') output, before its residual sum.
    MlpOutput,
}

impl Site {
    /// The key of this site's mask in layer `layer` for a microbatch's dropout key (the
    /// run's seed, the step, the microbatch's number in it).
    pub fn key(self, (seed, step, microbatch): (u64, u64, u64), layer: usize) -> [u64; 5] {
        let site = match self {
            Site::Layer => 20,
            Site::AttentionProbabilities => 21,
            Site::AttentionOutput => 22,
            Site::MlpOutput => 23,
        };
        [seed, site, step, microbatch, layer as u64]
    }
}

/// A block's dropout of its attention probabilities: the whole microbatch's [batch, heads,
/// seq, seq] mask, cut to this rank's heads and to the queries and keys a pass holds (the
/// gathered keys, or a ring's block of them).
#[derive(Clone, Debug)]
pub struct AttentionDropout {
    pub p: f64,
    /// The mask's key ([`Site::AttentionProbabilities`]).
    pub key: [u64; 5],
    /// This rank's query heads (tensor parallelism gives each rank a run of them) and the
    /// whole block's count.
    pub heads: (std::ops::Range<usize>, usize),
}

impl AttentionDropout {
    /// The mask of queries at positions `queries` against keys at `keys`, of a sequence of
    /// `seq` positions, for `batch` samples.
    pub fn mask(&self, batch: usize, seq: usize, queries: Vec<usize>, keys: Vec<usize>) -> DropMask {
        let picks = vec![(0..batch).collect(), self.heads.0.clone().collect(), queries, keys];
        DropMask::new(self.p, &self.key, vec![batch, self.heads.1, seq, seq], picks)
    }
}

/// A dropout a pass applies, if any.
pub type Dropped = Option<std::sync::Arc<DropMask>>;

/// The backward of a dropout on a flattened tensor: the gradient times the mask, drawn
/// again.
#[derive(Debug)]
pub(crate) struct DropoutBackward {
    pub mask: std::sync::Arc<DropMask>,
}

impl<I: Backend> Backward<I, 1> for DropoutBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let mask = self.mask;
        burn::backend::autodiff::ops::unary::<I, _>(ops.parents, ops.node, grads, |dy| {
            let dy = Tensor::<I, 1>::from_primitive(TensorPrimitive::Float(dy));
            let dev = dy.device();
            (dy * mask.tensor(&dev)).into_primitive().tensor()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A part's factors are the whole mask's at its elements, whatever the cut; about p of
    /// them are dropped, the rest scaled by 1/(1 − p).
    #[test]
    fn a_part_of_a_mask_is_the_whole_masks_at_its_elements() {
        let whole = DropMask::whole(0.25, &[1, 2, 3], vec![2, 4, 6, 6]).factors();
        let picks = vec![vec![0, 1], vec![2, 3], vec![5, 0, 3], vec![0, 1, 2, 3, 4, 5]];
        let part = DropMask::new(0.25, &[1, 2, 3], vec![2, 4, 6, 6], picks.clone()).factors();
        let mut expected = Vec::new();
        for &b in &picks[0] {
            for &h in &picks[1] {
                for &q in &picks[2] {
                    for &k in &picks[3] {
                        expected.push(whole[((b * 4 + h) * 6 + q) * 6 + k]);
                    }
                }
            }
        }
        assert_eq!(part, expected);
        let big = DropMask::whole(0.25, &[9], vec![100, 100]).factors();
        let dropped = big.iter().filter(|&&f| f == 0.0).count() as f64 / big.len() as f64;
        assert!((dropped - 0.25).abs() < 0.02, "{dropped}");
        assert!(big.iter().all(|&f| f == 0.0 || (f - 4.0 / 3.0).abs() < 1e-6));
        assert_ne!(big, DropMask::whole(0.25, &[10], vec![100, 100]).factors(), "another key, another mask");
    }
}
