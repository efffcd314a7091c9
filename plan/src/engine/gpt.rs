//! A decoder-only language model's shape, as the engines' launch configurations describe
//! one (Megatron-LM's `--num-layers --hidden-size ...`, torchtitan's model flavours, a Hugging
//! Face `config.json`): read from a model's layers, or `None` when the model is not one.

use crate::model::{BlockDims, MlpKind, Moe, NormKind, Op};

/// The shape of an embedding → identical causal transformer blocks → final norm → output
/// layer model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptShape {
    pub vocab: usize,
    pub layers: usize,
    /// The block's sizes (hidden, heads, key-value heads, MLP width, norm, MLP kind, rotary
    /// base, biases, experts).
    pub block: BlockDims,
    /// A learned position table of this many positions (0: none; rotary or no position).
    pub positions: usize,
    /// The output layer's weights are the embedding table's.
    pub tied: bool,
    /// The output layer has a bias (the engines' output layers have none).
    pub head_bias: bool,
    /// Blocks of a mixture of experts' model that come first with a dense MLP (DeepSeek-V3's
    /// `first_k_dense_replace`, Megatron-LM's `--moe-layer-freq ([0]*k+[1]*n)`): how many,
    /// and their MLP's width; the blocks are otherwise `block`. 0: every block is `block`.
    pub dense: usize,
    pub dense_ff: usize,
    /// Blocks alternating a sliding window and full attention (GPT-OSS; Megatron-LM's
    /// `--window-attn-skip-freq N`, megatron/core/transformer/utils.py
    /// `is_layer_window_attention`): every `full_every`-th block counting from 1 attends
    /// fully, the others through `block.window`. 0: every block is `block`.
    pub full_every: usize,
}

/// The window of block `number` (from 1) of blocks with `window` where every
/// `full_every`-th attends fully (0: none does): Megatron-LM's `is_layer_window_attention`
/// (megatron/core/transformer/utils.py, `layer_number % N != 0` slides).
fn window_of(window: usize, full_every: usize, number: usize) -> usize {
    if full_every > 0 && number.is_multiple_of(full_every) {
        0
    } else {
        window
    }
}

/// The period of blocks alternating a sliding window and full attention: Some(N ≥ 2) where
/// block i (from 1) attends fully exactly when N divides i, and every other block has one
/// window ([`window_of`]); Some(0) where every block has the same window (or none); None
/// otherwise.
fn full_every(windows: &[usize]) -> Option<usize> {
    let first = *windows.first()?;
    if windows.iter().all(|&w| w == first) {
        return Some(0);
    }
    let window = windows.iter().copied().max().unwrap_or(0);
    let n = windows.iter().position(|&w| w == 0)? + 1;
    let regular = n >= 2 && windows.iter().enumerate().all(|(i, &w)| w == window_of(window, n, i + 1));
    regular.then_some(n)
}

impl GptShape {
    /// The shape of the model whose layers are `ops` in order (`tied`: the output layer
    /// shares the embedding's table), if it is a decoder-only language model.
    pub fn of(ops: &[Op], tied: bool) -> Option<GptShape> {
        let (vocab, d) = match ops.first()? {
            Op::Embedding { vocab, dim, types: 0, sep: None } => (*vocab, *dim),
            _ => return None,
        };
        let mut rest = &ops[1..];
        let positions = match rest.first() {
            Some(Op::PosEmbedding { max_len, dim }) if *dim == d => {
                rest = &rest[1..];
                *max_len
            }
            _ => 0,
        };
        // dropout layers carry no parameters: skipped where the engines put theirs
        let kept: Vec<&Op> = rest.iter().filter(|op| !matches!(op, Op::Dropout { .. })).collect();
        let blocks: Vec<BlockDims> = kept.iter().map_while(|op| op.block_dims()).collect();
        // windowed and full blocks alternating: compared with the window put back
        let windows: Vec<usize> = blocks.iter().map(|b| b.window).collect();
        let full_every = full_every(&windows)?;
        let window = windows.iter().copied().max().unwrap_or(0);
        let blocks: Vec<BlockDims> = blocks.into_iter().map(|b| BlockDims { window, ..b }).collect();
        let block = *blocks.last()?;
        // dense blocks first, then mixtures of experts otherwise the same
        let dense = blocks.iter().take_while(|b| b.moe.is_none()).count();
        let dense = if block.moe.is_some() { dense } else { 0 };
        let dense_ff = blocks.first().map_or(0, |b| b.ff);
        let as_dense = block.with_dense_mlp(dense_ff);
        let same = blocks[..dense].iter().all(|b| *b == as_dense) && blocks[dense..].iter().all(|b| *b == block);
        if !same || !block.causal || block.post_norm || block.d != d {
            return None;
        }
        let tail = &kept[blocks.len()..];
        let norm_ok = match (tail.first()?, block.norm) {
            (Op::LayerNorm { dim, .. }, NormKind::LayerNorm) | (Op::RmsNorm { dim, .. }, NormKind::RmsNorm) => {
                *dim == d
            }
            _ => false,
        };
        let head_bias = match tail.get(1)? {
            Op::Linear { in_features, out_features, bias } if *in_features == d && *out_features == vocab => *bias,
            _ => return None,
        };
        (norm_ok && tail.len() == 2).then_some(GptShape {
            vocab,
            layers: blocks.len(),
            block,
            positions,
            tied,
            head_bias,
            dense,
            dense_ff: if dense > 0 { dense_ff } else { 0 },
            full_every,
        })
    }

    /// Each block's sliding window (0: full attention), first to last.
    pub fn block_windows(&self) -> Vec<usize> {
        (1..=self.layers).map(|i| window_of(self.block.window, self.full_every, i)).collect()
    }

    /// The experts of every block (None: a dense MLP).
    pub fn moe(&self) -> Option<Moe> {
        self.block.moe
    }

    /// Whether the MLP is gated with SiLU (SwiGLU: Llama, Mixtral, DeepSeek).
    pub fn swiglu(&self) -> bool {
        self.block.mlp == MlpKind::Swiglu
    }
}
