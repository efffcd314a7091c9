//! The operator vocabulary shared by every phase: what a layer is, its shape rule and its
//! parameters. The front end resolves DSL calls into [`Op`]s, the compiler costs them and the
//! executor builds Burn modules from them.

use serde::{Deserialize, Serialize};

pub use crate::rope::RopeScaling;

pub use crate::vocab::{MlpKind, NormKind, Pooling, Router};

/// A mixture-of-experts block's router's parameter slot (after the dense block's 0..12; a
/// parameter's id is layer << 8 | slot, `checkpoint::param_id`).
pub const ROUTER_SLOT: u64 = 12;

/// The first parameter slot of a mixture-of-experts block's MLP `e` (its routed experts,
/// then its shared ones; four slots each: up weight and bias, down weight and bias).
pub fn expert_slot(e: usize) -> u64 {
    16 + 4 * e as u64
}

/// A block's query norm's and key norm's gain slots (`qk_norm=true`: an RMSNorm over each
/// head's features), after the router's.
pub const Q_NORM_SLOT: u64 = 13;
pub const K_NORM_SLOT: u64 = 14;

/// A block's attention sinks' slot (`sinks=true`: a logit per query head), the last before
/// the experts' (`checkpoint::expert_slot`).
pub const SINKS_SLOT: u64 = 15;

/// A mixture of experts' fixed bias per expert (`expert_bias=true`, DeepSeek-V3's
/// `e_score_correction_bias`), in the slot a dense block's down projection takes (a mixture
/// has none): state kept in checkpoints, not a parameter (nothing trains it).
pub const EXPERT_BIAS_SLOT: u64 = 10;

/// Multi-head latent attention's weights, in the slots standard attention's fused
/// projection and query/key norms take (a latent block has neither): the down projection
/// of the input to the queries' latent, the keys' and values' latent and the shared rotary
/// key, side by side, `[d, q_lora + kv_lora + rope_dim]` (DeepSeek's `q_a_proj` and
/// `kv_a_proj_with_mqa`, both of the same input, as one product)…
pub const LATENT_DOWN_SLOT: u64 = 2;
/// …the two latents' RMSNorm gains side by side, `[q_lora + kv_lora]` (`q_a_layernorm`,
/// `kv_a_layernorm`)…
pub const LATENT_NORMS_SLOT: u64 = 3;
/// …the queries from their latent, or from the input without one, `[q_lora or d, heads ·
/// (head_dim + rope_dim)]` (`q_b_proj`, `q_proj`)…
pub const LATENT_QUERY_SLOT: u64 = Q_NORM_SLOT;
/// …and the keys' parts without rotary embeddings and the values from their latent,
/// `[kv_lora, heads · (head_dim + v_head_dim)]`, head after head (`kv_b_proj`).
pub const LATENT_KV_UP_SLOT: u64 = K_NORM_SLOT;

/// The pattern of every operator without weights of its own: pools, joins, reshapes,
/// activations, dropout and sequence pooling — the one list of them, so that a new
/// weightless operator is added here once (a new operator of any kind is still a compile
/// error in every exhaustive match over [`Op`]).
macro_rules! weightless {
    () => {
        $crate::model::Op::MaxPool2d { .. }
            | $crate::model::Op::AvgPool2d { .. }
            | $crate::model::Op::AdaptiveAvgPool2d { .. }
            | $crate::model::Op::Add { .. }
            | $crate::model::Op::Concat { .. }
            | $crate::model::sizeless!()
    };
}
pub(crate) use weightless;

/// The pattern of every operator that takes none of the layer's sizes: the activations,
/// flattening, dropout and the sequence pool (weightless too: [`weightless!`] includes
/// them).
macro_rules! sizeless {
    () => {
        $crate::model::Op::Flatten
            | $crate::model::Op::Relu
            | $crate::model::Op::Gelu
            | $crate::model::Op::GeluTanh
            | $crate::model::Op::Tanh
            | $crate::model::Op::Sigmoid
            | $crate::model::Op::Dropout { .. }
            | $crate::model::Op::SeqPool { .. }
    };
}
pub(crate) use sizeless;

/// One operator of the model, with all its hyper-parameters resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[expect(
    clippy::large_enum_variant,
    reason = "a model holds one Op per layer, read in place: boxing the transformer block's 256 bytes would add an indirection to every match for no memory worth saving"
)]
pub enum Op {
    Linear {
        in_features: usize,
        out_features: usize,
        bias: bool,
    },
    Conv2d {
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        bias: bool,
    },
    MaxPool2d {
        kernel: usize,
        stride: usize,
        /// Implicit padding on each side (−∞ for max pooling; for average pooling the
        /// padded zeros count in the average, as PyTorch's default).
        #[serde(default)]
        padding: usize,
    },
    AvgPool2d {
        kernel: usize,
        stride: usize,
        #[serde(default)]
        padding: usize,
    },
    /// Average pooling to a fixed `size` × `size` output (1: global average pooling).
    AdaptiveAvgPool2d {
        size: usize,
    },
    /// Batch normalisation over the channels of a [channels, height, width] input: the
    /// statistics of the microbatch in training, the running statistics otherwise
    /// (eps 1e-5, momentum 0.1). Its running mean and variance are state, not parameters.
    BatchNorm2d {
        channels: usize,
    },
    /// Element-wise sum of `inputs` tensors of one shape (a residual connection).
    Add {
        inputs: usize,
    },
    /// Concatenation of `inputs` tensors along their first per-sample dimension (channels
    /// of a feature map, features of a vector).
    Concat {
        inputs: usize,
    },
    Flatten,
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    /// Layer normalisation over the last dimension (`dim` features).
    LayerNorm {
        dim: usize,
        #[serde(default = "default_eps", skip_serializing_if = "is_default_eps")]
        eps: f64,
    },
    Dropout {
        p: f64,
    },
    /// Token embedding: row `id` of a [vocab, dim] table per position. With `types` > 0 a
    /// second [types, dim] table of token types (BERT's segments) is added: position p's type
    /// is the number of `sep` tokens before p, at most `types − 1` (the type ids a Hugging
    /// Face tokenizer gives a pair `[CLS] A [SEP] B [SEP]`); without `sep`, type 0 everywhere.
    Embedding {
        vocab: usize,
        dim: usize,
        #[serde(default, skip_serializing_if = "is_zero")]
        types: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sep: Option<usize>,
    },
    /// A [sequence, d] input reduced over its positions to [d]: the first position (BERT's
    /// `[CLS]`) or the mean.
    SeqPool {
        how: Pooling,
    },
    /// Pre-norm transformer block: norm → multi-head self-attention → residual → norm → MLP →
    /// residual. With `causal`, position i attends to positions ≤ i only (a GPT-style
    /// decoder block). The fields after `causal` choose a Llama-style block: grouped-query
    /// attention, RMSNorm, a gated MLP, rotary position embeddings, no biases
    /// ([`Op::block_dims`] derives the sizes every phase uses).
    TransformerBlock {
        d_model: usize,
        heads: usize,
        d_ff: usize,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        causal: bool,
        /// Key and value heads (grouped-query attention: `heads` a multiple of it; 1 is
        /// multi-query attention); 0 means `heads`.
        #[serde(default, skip_serializing_if = "is_zero")]
        kv_heads: usize,
        #[serde(default = "layer_norm", skip_serializing_if = "is_layer_norm")]
        norm: NormKind,
        #[serde(default = "gelu", skip_serializing_if = "is_gelu")]
        mlp: MlpKind,
        /// Rotary position embeddings' base θ on queries and keys (0: none).
        #[serde(default, skip_serializing_if = "is_zero_f64")]
        rope: f64,
        /// How the rotary frequencies are scaled (Llama 3.1's, YaRN, linear, dynamic).
        #[serde(default, skip_serializing_if = "is_unscaled")]
        rope_scaling: RopeScaling,
        /// Biases on the output projection and the MLP's linear layers.
        #[serde(default = "yes", skip_serializing_if = "is_true")]
        bias: bool,
        /// Biases on the query, key and value projections.
        #[serde(default = "yes", skip_serializing_if = "is_true")]
        qkv_bias: bool,
        /// The norms' ε.
        #[serde(default = "default_eps", skip_serializing_if = "is_default_eps")]
        eps: f64,
        /// Post-norm (BERT, the original transformer): norm(x + attention(x)), then
        /// norm(h + mlp(h)), instead of x + attention(norm(x)) and h + mlp(norm(h)).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        post_norm: bool,
        /// A mixture of experts in place of the dense MLP.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        moe: Option<Moe>,
        /// Each head's query, key and value size, independent of d/heads (Qwen3's 128 on
        /// d = 2048 with 32 heads); 0: d/heads. Under multi-head latent attention, the part of
        /// each query and key head without rotary embeddings.
        #[serde(default, skip_serializing_if = "is_zero")]
        head_dim: usize,
        /// An RMSNorm over each head's queries and keys before the rotary embeddings, a gain per
        /// head feature for each (Qwen3, OLMo 2).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        qk_norm: bool,
        /// Sliding-window attention: each position attends to itself and the `window − 1`
        /// positions before it (Mistral, GPT-OSS's alternate layers); 0: every position.
        #[serde(default, skip_serializing_if = "is_zero")]
        window: usize,
        /// Attention sinks: a learned logit per head that joins every softmax's normaliser
        /// and takes no value (GPT-OSS).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        sinks: bool,
        /// Multi-head latent attention (DeepSeek-V2 and V3) in place of the query, key and
        /// value projections.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mla: Option<Mla>,
        /// Dropout's probability on the attention's probabilities and on each residual
        /// branch's output (GPT-2 and GPT-3: 0.1; the memory model keeps their masks).
        #[serde(default, skip_serializing_if = "is_zero_f64")]
        dropout: f64,
    },
    /// Root-mean-square normalisation over the last dimension: x / √(mean(x²) + ε) · gain.
    RmsNorm {
        dim: usize,
        #[serde(default = "default_eps", skip_serializing_if = "is_default_eps")]
        eps: f64,
    },
    /// GELU's tanh approximation (GPT-2's `gelu_new`).
    GeluTanh,
    /// Learned positional embedding: adds row p of a [max_len, dim] table to position p of a
    /// [sequence, dim] input (sequence ≤ max_len).
    PosEmbedding {
        max_len: usize,
        dim: usize,
    },
    /// One LSTM layer over a [sequence, input] input, giving every step's hidden state
    /// [sequence, hidden]; gates i, f, g, o with PyTorch's two biases, zero initial state.
    Lstm {
        input: usize,
        hidden: usize,
    },
}

fn is_zero(v: &usize) -> bool {
    *v == 0
}
fn is_unscaled(s: &RopeScaling) -> bool {
    *s == RopeScaling::None
}

fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}
fn is_false(v: &bool) -> bool {
    !*v
}
fn layer_norm() -> NormKind {
    NormKind::LayerNorm
}
fn is_layer_norm(n: &NormKind) -> bool {
    *n == NormKind::LayerNorm
}
fn gelu() -> MlpKind {
    MlpKind::Gelu
}
fn is_gelu(m: &MlpKind) -> bool {
    *m == MlpKind::Gelu
}
fn yes() -> bool {
    true
}
fn is_true(b: &bool) -> bool {
    *b
}
/// The norms' ε unless a spec says otherwise (PyTorch's `LayerNorm` default).
pub const DEFAULT_EPS: f64 = 1e-5;
fn default_eps() -> f64 {
    DEFAULT_EPS
}
fn is_default_eps(e: &f64) -> bool {
    *e == DEFAULT_EPS
}

/// DeepSeek-V3's multi-token prediction (`model.mtp`; Liu et al. 2024, §2.2): `depth`
/// modules after the model's last transformer block, the k-th predicting the token k + 1
/// positions ahead. Each normalises the previous depth's hidden state (the model's, after
/// its final norm, for the first) and the embeddings of the tokens k positions on
/// (RMSNorms), projects their concatenation from 2·d to d, runs one transformer block
/// shaped as the model's last, normalises, and scores the vocabulary with the model's own
/// output layer (the embedding and the output layer are shared, not copied); its
/// cross-entropy joins the loss times `weight` / `depth` (Megatron-LM's
/// `--mtp-loss-scaling-factor`, averaged over the depths).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mtp {
    pub depth: usize,
    pub weight: f64,
}

impl Mtp {
    /// Megatron-LM's default loss weight (`mtp_loss_scaling_factor`, 0.1; DeepSeek-V3's
    /// report trained at 0.3 for its first 10T tokens, then 0.1).
    pub const DEFAULT_WEIGHT: f64 = 0.1;

    /// One module's layers in order, each with whether it holds its own weights: the
    /// lookup of the tokens k positions on (the model's embedding, shared), the two input
    /// norms (one over the joined 2·d features), the projection from 2·d to d, a copy of
    /// `block` (the model's last transformer block), the final norm, and the scores over
    /// the `vocab` tokens (the model's output layer, shared; the loss after it). None for
    /// an `block` that is not a transformer block.
    pub fn module_layers(block: &Op, vocab: usize) -> Option<Vec<(Op, bool)>> {
        let d = block.block_dims()?.d;
        Some(vec![
            (Op::Embedding { vocab, dim: d, types: 0, sep: None }, false),
            (Op::RmsNorm { dim: 2 * d, eps: DEFAULT_EPS }, true),
            (Op::Linear { in_features: 2 * d, out_features: d, bias: false }, true),
            (block.clone(), true),
            (Op::RmsNorm { dim: d, eps: DEFAULT_EPS }, true),
            (Op::Linear { in_features: d, out_features: vocab, bias: false }, false),
        ])
    }

    /// Every module's layers after the model's `ops` (a language model ending in its
    /// output layer, whose width is the vocabulary), in order, with whether each holds its
    /// own weights; empty where the model has no transformer block or output layer.
    pub fn layers<'a>(self, ops: impl DoubleEndedIterator<Item = &'a Op> + Clone) -> Vec<(Op, bool)> {
        let vocab = match ops.clone().next_back() {
            Some(Op::Linear { out_features, .. }) => *out_features,
            _ => return Vec::new(),
        };
        let one = Self::block(ops).and_then(|b| Self::module_layers(b, vocab)).unwrap_or_default();
        (0..self.depth).flat_map(|_| one.clone()).collect()
    }

    /// The parameters all depths add: each module's own layers' (a copy of `block`, the
    /// model's last transformer block, its norms and projection).
    pub fn parameters(self, block: &Op) -> u64 {
        let own: u64 = Self::module_layers(block, 0)
            .unwrap_or_default()
            .iter()
            .filter(|(_, own)| *own)
            .map(|(op, _)| op.parameter_count())
            .sum();
        self.depth as u64 * own
    }

    /// The block each module copies: the last transformer block of `ops`.
    pub fn block<'a>(ops: impl DoubleEndedIterator<Item = &'a Op>) -> Option<&'a Op> {
        ops.rev().find(|op| matches!(op, Op::TransformerBlock { .. }))
    }

    /// ", and N in D multi-token-prediction module(s)" for reports, beside the model's
    /// parameters (`parameters_text`); empty without a block.
    pub fn parameters_text<'a>(self, ops: impl DoubleEndedIterator<Item = &'a Op>) -> String {
        match Self::block(ops) {
            Some(block) => format!(
                ", and {} in {} multi-token-prediction module{}",
                thousands(self.parameters(block)),
                self.depth,
                if self.depth == 1 { "" } else { "s" }
            ),
            None => String::new(),
        }
    }
}

/// The position of `top_k` among `transformer_block`'s arguments (a shape error's label).
pub const MOE_TOP_K_ARG: usize = 13;

/// A transformer block's mixture-of-experts MLP (`experts=` on `transformer_block`): a
/// router (a linear gate without bias, `d → experts`) scores every token; the token goes
/// to its `top_k` best-scored experts — each an MLP of the block's kind and width `ff` —
/// and their outputs are summed weighted by the scores (renormalised over the chosen ones
/// with `norm_topk`); `shared` experts take every token, unweighted (DeepSeek-V3).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Moe {
    /// Routed experts.
    pub experts: usize,
    /// Experts each token goes to.
    pub top_k: usize,
    /// Experts every token goes through as well.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared: usize,
    /// Capacity factor: an expert takes at most ⌈capacity · tokens · top_k / experts⌉ of a
    /// microbatch's tokens, the later tokens (by position in the microbatch) beyond that
    /// dropped from it (they keep their other experts and the residual); 0: no limit.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub capacity: f64,
    pub router: Router,
    /// The chosen experts' weights divided by their sum (Mixtral, DeepSeek-V3).
    pub norm_topk: bool,
    /// The load-balancing loss's weight (Switch Transformer's α: α · E · Σᵢ fᵢ · Pᵢ, fᵢ the
    /// fraction of tokens routed to expert i, Pᵢ its mean router probability).
    pub aux_loss: f64,
    /// What the prediction assumes of the routing: the busiest expert takes `skew` times the
    /// mean share of the token choices, the others the rest equally (1: uniform). The
    /// executor routes by the scores whatever this says; it reports the counts it saw.
    #[serde(default = "one_f64", skip_serializing_if = "is_one_f64")]
    pub skew: f64,
    /// The chosen experts' weights times this, after any `norm_topk` (DeepSeek-V3's
    /// `routed_scaling_factor` 2.5, Megatron-LM's `--moe-router-topk-scaling-factor`).
    #[serde(default = "one_f64", skip_serializing_if = "is_one_f64")]
    pub scale: f64,
    /// Group-limited routing (DeepSeek-V2/V3, Megatron-LM's `--moe-router-num-groups` and
    /// `--moe-router-group-topk`): the experts in `groups` equal groups, each token choosing
    /// among the experts of its `group_top` best groups only, a group scored by the sum of
    /// its top_k / group_top best scores. 0: no groups.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub groups: usize,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub group_top: usize,
    /// A fixed bias per expert added to the scores for choosing the experts but not for
    /// weighting them (DeepSeek-V3's `e_score_correction_bias`, the auxiliary-loss-free
    /// balancing of arXiv 2408.15664; transformers keeps it fixed, Megatron-LM's
    /// `--moe-router-enable-expert-bias` with an update rate of 0).
    #[serde(default, skip_serializing_if = "is_false")]
    pub expert_bias: bool,
}

fn one_f64() -> f64 {
    1.0
}
fn is_one_f64(v: &f64) -> bool {
    *v == 1.0
}

/// The position of `skew` among `transformer_block`'s arguments (a shape error's label).
pub const MOE_SKEW_ARG: usize = 19;
/// The positions of `route_scale`, `route_groups` (`route_group_top` after it) and
/// `expert_bias` among `transformer_block`'s arguments.
pub const ROUTE_SCALE_ARG: usize = 38;
pub const ROUTE_GROUPS_ARG: usize = 39;
pub const EXPERT_BIAS_ARG: usize = 41;
/// The position of `rope_mscale_all_dim` among `transformer_block`'s arguments.
pub const MSCALE_ALL_DIM_ARG: usize = 42;

impl Moe {
    /// `experts` routed experts, `top_k` a token, with every other setting at the spec's
    /// default (a softmax router renormalised over the chosen, no shared experts, no
    /// capacity, loss, skew, scale, groups or bias): the base a literal updates.
    pub fn new(experts: usize, top_k: usize) -> Moe {
        Moe {
            experts,
            top_k,
            shared: 0,
            capacity: 0.0,
            router: Router::Softmax,
            norm_topk: true,
            aux_loss: 0.0,
            skew: 1.0,
            scale: 1.0,
            groups: 0,
            group_top: 0,
            expert_bias: false,
        }
    }

    /// The experts one token's MLP runs through: its routed ones and the shared ones.
    pub fn active_experts(&self) -> usize {
        self.top_k + self.shared
    }

    /// The most tokens one expert takes from a microbatch of `tokens` (all of them routed
    /// `top_k` ways) under the capacity factor, or None without a limit.
    pub fn expert_capacity(&self, tokens: usize) -> Option<usize> {
        (self.capacity > 0.0).then(|| {
            let c = (self.capacity * tokens as f64 * self.top_k as f64 / self.experts.max(1) as f64).ceil();
            (c as usize).clamp(1, tokens.max(1))
        })
    }

    /// Expert-token pairs one microbatch of `tokens` computes: the routed pairs (bounded by
    /// the capacity of every expert) and the shared experts' tokens.
    pub fn expert_tokens(&self, tokens: f64) -> f64 {
        self.routed_pairs(tokens) + tokens * self.shared as f64
    }

    /// The routed expert-token pairs of a microbatch of `tokens`, uniform routing: every
    /// token's `top_k` choices, bounded by every expert's capacity.
    pub fn routed_pairs(&self, tokens: f64) -> f64 {
        let routed = tokens * self.top_k as f64;
        match self.expert_capacity(tokens.round() as usize) {
            Some(c) => routed.min(c as f64 * self.experts as f64),
            None => routed,
        }
    }

    /// What is wrong with the routing's groups or bias, if anything: the groups must divide
    /// the experts, `group_top` be between 1 and `groups` and divide `top_k` (each chosen
    /// group scored by its top_k / group_top best experts, Megatron-LM's rule), the chosen
    /// groups hold at least `top_k` experts; the expert bias needs the sigmoid router
    /// (Megatron-LM's rule: softmax scores sum to one).
    pub fn routing_problem(&self) -> Option<String> {
        let (e, k, g, top) = (self.experts, self.top_k, self.groups, self.group_top);
        if self.expert_bias && self.router != Router::Sigmoid {
            return Some(
                "expert_bias=true biases sigmoid scores (DeepSeek-V3's auxiliary-loss-free balancing): it needs router=sigmoid".into(),
            );
        }
        if g == 0 && top == 0 {
            return None;
        }
        if g == 0 || !e.is_multiple_of(g) {
            return Some(format!("route_groups={g} must divide the experts={e} into equal groups"));
        }
        if top == 0 || top > g || k % top != 0 {
            return Some(format!(
                "route_group_top={top} must be between 1 and route_groups={g} and divide top_k={k} (each chosen group is scored by its top_k / route_group_top best experts)"
            ));
        }
        if top * (e / g) < k || k / top > e / g {
            return Some(format!("the {top} chosen groups of {} experts each cannot hold top_k={k} experts", e / g));
        }
        None
    }

    /// The largest `skew` routing allows: one expert chosen by every token, E / top_k times
    /// the mean share.
    pub fn max_skew(&self) -> f64 {
        self.experts.max(1) as f64 / self.top_k.max(1) as f64
    }

    /// Under the routing assumption (`skew`), the routed pairs of a microbatch of `tokens`
    /// that the busiest expert takes and that each other expert takes: the busiest
    /// `skew` times the mean share of the choices (at most its capacity), the others the
    /// rest of the pairs equally.
    pub fn expert_loads(&self, tokens: f64) -> (f64, f64) {
        let e = self.experts.max(1) as f64;
        let pairs = self.routed_pairs(tokens);
        let mean = pairs / e;
        if self.experts <= 1 || self.skew <= 1.0 {
            return (mean, mean);
        }
        let wanted = self.skew * tokens * self.top_k as f64 / e;
        let busiest = match self.expert_capacity(tokens.round() as usize) {
            Some(c) => wanted.min(c as f64),
            None => wanted,
        }
        .clamp(mean, pairs);
        (busiest, (pairs - busiest).max(0.0) / (e - 1.0))
    }

    /// Under the routing assumption, the routed pairs of a microbatch of `tokens` that the
    /// busiest of `ep` devices computes, each holding `experts / ep` of the experts
    /// (one of them the busiest expert): the whole `routed_pairs` when `ep` is 1.
    pub fn busiest_device_pairs(&self, tokens: f64, ep: usize) -> f64 {
        let local = (self.experts / ep.max(1)).max(1) as f64;
        let (busiest, other) = self.expert_loads(tokens);
        busiest + (local - 1.0) * other
    }
}

/// Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1; DeepSeek-V3): queries
/// through a low-rank `q_lora` bottleneck (or projected directly when it is 0), keys and
/// values through one shared `kv_lora` latent (each normalised by an RMSNorm), each query and
/// key head the block's `head_dim` features without rotary embeddings and `rope_dim` with
/// them (the rotary key part shared by every head, projected from the input beside the
/// latent), each value head `v_head_dim` features.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mla {
    /// The queries' latent width (DeepSeek-V3: 1,536); 0: queries projected from the input.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub q_lora: usize,
    /// The keys' and values' latent width (DeepSeek-V3: 512).
    pub kv_lora: usize,
    /// Each query and key head's rotary part (DeepSeek-V3: 64).
    pub rope_dim: usize,
    /// Each value head's size (DeepSeek-V3: 128).
    pub v_head_dim: usize,
    /// YaRN's `mscale_all_dim` (DeepSeek-V3: 1; 0: none): under `rope_scaling=yarn` the
    /// softmax's scale is multiplied by (0.1 · mscale_all_dim · ln factor + 1)², as
    /// transformers' and Megatron-LM's latent attention do.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub mscale_all_dim: f64,
}

/// The positions of `transformer_block`'s attention-shape arguments (a shape error's label).
pub const HEAD_DIM_ARG: usize = 20;
pub const WINDOW_ARG: usize = 22;
pub const KV_LORA_ARG: usize = 24;
pub const ROPE_DIM_ARG: usize = 26;
/// The position of `transformer_block`'s `rope_scaling=` and the arguments after it
/// (`rope_factor`, `rope_original`, `rope_low_freq`, `rope_high_freq`, `rope_beta_fast`,
/// `rope_beta_slow`, `rope_attention_factor`, `rope_truncate`).
pub const ROPE_SCALING_ARG: usize = 29;

/// What a weight matrix of a block's attention does (its place in the forward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectionRole {
    /// Queries, keys and values in one product (standard attention).
    Qkv,
    /// Multi-head latent attention: the queries' latent, the keys' and values' latent and
    /// the shared rotary key part from the input, in one product (DeepSeek's `q_a_proj` and
    /// `kv_a_proj_with_mqa` read the same input; pipec's executor multiplies them as one,
    /// [`LATENT_DOWN_SLOT`]).
    LatentDown,
    /// The queries from the input (no query latent).
    Query,
    /// The queries from their latent.
    QueryUp,
    /// The keys (without rotary part) and values from their latent.
    KvUp,
    /// The heads' outputs back to the model width.
    Output,
}

/// Multi-head latent attention's weights as pipec holds them ([`LATENT_DOWN_SLOT`] and the
/// slots after it): each matrix's [in, out], the latents' norms' length. The one place
/// their sizes are derived ([`BlockDims::latent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentWeights {
    /// The input to both latents and the shared rotary key: [d, q_lora + kv_lora + rope_dim].
    pub down: [usize; 2],
    /// Both latents' RMSNorm gains side by side: q_lora + kv_lora.
    pub norms: usize,
    /// The queries from their latent, or from the input without one: [q_lora or d, q_width].
    pub query: [usize; 2],
    /// The keys' parts without rotary embeddings and the values, head after head:
    /// [kv_lora, heads · (head_dim + v_head_dim)].
    pub kv_up: [usize; 2],
}

/// How Megatron-style tensor parallelism splits one of a block's weight matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectionSplit {
    /// By output columns (heads).
    Column,
    /// By input rows, the outputs summed.
    Row,
    /// Whole on every rank (multi-head latent attention's down projections: Megatron-LM's
    /// `linear_q_down_proj` and `linear_kv_down_proj` are duplicated across the group).
    Replicated,
}

/// One weight matrix of a block's attention, `input × output`, in forward order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Projection {
    pub role: ProjectionRole,
    pub input: usize,
    pub output: usize,
    pub split: ProjectionSplit,
    /// Whether the product has a bias (the spec's `qkv_bias` for the query/key/value
    /// projections, `bias` for the output).
    pub bias: bool,
}

/// A transformer block's sizes, derived once from its arguments ([`Op::block_dims`]):
/// what the parameter count, the cost model, tensor parallelism and the executor read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockDims {
    pub d: usize,
    pub heads: usize,
    /// Key and value heads (under multi-head latent attention every query head has its own).
    pub kv_heads: usize,
    /// Each query, key and value head's size (`head_dim=`, else d/heads); under multi-head
    /// latent attention the query and key heads' part without rotary embeddings.
    pub head_dim: usize,
    /// Each query and key head's size in the attention's products (`head_dim`, and under
    /// multi-head latent attention its rotary part too).
    pub qk_head: usize,
    /// Each value head's size.
    pub v_head: usize,
    /// The queries' width: `heads · qk_head`.
    pub q_width: usize,
    /// The key (and the value) projection's width: `kv_heads · head_dim`.
    pub kv_width: usize,
    /// The fused query-key-value projection's width: `q_width + 2 · kv_width`.
    pub qkv_width: usize,
    /// The heads' outputs' width, the output projection's input: `heads · v_head`.
    pub attention_width: usize,
    pub qk_norm: bool,
    pub window: usize,
    pub sinks: bool,
    pub mla: Option<Mla>,
    pub dropout: f64,
    pub ff: usize,
    pub gated: bool,
    /// The first MLP projection's width: `2 · ff` when gated (gate ‖ up), else `ff`.
    pub up_width: usize,
    pub norm: NormKind,
    pub mlp: MlpKind,
    pub rope: f64,
    pub rope_scaling: RopeScaling,
    pub bias: bool,
    pub qkv_bias: bool,
    pub eps: f64,
    pub causal: bool,
    pub post_norm: bool,
    pub moe: Option<Moe>,
}

impl BlockDims {
    /// The block with a dense MLP `ff` wide in place of its own (DeepSeek-V3's dense first
    /// blocks beside its blocks of experts).
    pub fn with_dense_mlp(&self, ff: usize) -> BlockDims {
        BlockDims { moe: None, ff, up_width: if self.gated { 2 * ff } else { ff }, ..*self }
    }

    /// What the attention's softmax scale (1/√ of the query head's size) is multiplied by:
    /// latent attention's (0.1 · mscale_all_dim · ln factor + 1)² under YaRN
    /// ([`Mla::mscale_all_dim`]), else 1.
    pub fn softmax_multiplier(&self) -> f64 {
        match (self.mla, self.rope_scaling) {
            (Some(m), RopeScaling::Yarn { factor, .. }) if m.mscale_all_dim > 0.0 => {
                crate::rope::yarn_mscale(factor, m.mscale_all_dim).powi(2)
            }
            _ => 1.0,
        }
    }

    /// Parameters of one of its norms.
    pub fn norm_parameters(&self) -> usize {
        match self.norm {
            NormKind::LayerNorm => 2 * self.d,
            NormKind::RmsNorm => self.d,
        }
    }

    /// Multi-head latent attention's weights' sizes (None: standard attention).
    pub fn latent(&self) -> Option<LatentWeights> {
        self.mla.map(|m| LatentWeights {
            down: [self.d, m.q_lora.saturating_add(m.kv_lora).saturating_add(m.rope_dim)],
            norms: m.q_lora.saturating_add(m.kv_lora),
            query: [if m.q_lora > 0 { m.q_lora } else { self.d }, self.q_width],
            kv_up: [m.kv_lora, self.heads.saturating_mul(self.head_dim.saturating_add(m.v_head_dim))],
        })
    }

    /// The attention's weight matrices in forward order, as pipec's executor multiplies
    /// them: standard attention's fused query-key-value projection and output projection,
    /// or multi-head latent attention's down projection, its up projections (the queries
    /// from their latent or the input, the keys and values from theirs) and output
    /// projection.
    pub fn projections(&self) -> Vec<Projection> {
        use ProjectionRole::*;
        use ProjectionSplit::*;
        let p = |role, input, output, split, bias| Projection { role, input, output, split, bias };
        let output = p(Output, self.attention_width, self.d, Row, self.bias);
        match (self.mla, self.latent()) {
            (Some(m), Some(l)) => {
                // without a query latent the queries of the input first: the executor's order
                // (`executor::nn::latent::Latent`), which ZeRO-3's per-product gathers follow
                let down = p(LatentDown, l.down[0], l.down[1], Replicated, false);
                let (first, second) = match m.q_lora {
                    0 => (p(Query, l.query[0], l.query[1], Column, false), down),
                    _ => (down, p(QueryUp, l.query[0], l.query[1], Column, false)),
                };
                vec![first, second, p(KvUp, l.kv_up[0], l.kv_up[1], Column, false), output]
            }
            _ => vec![p(Qkv, self.d, self.qkv_width, Column, self.qkv_bias), output],
        }
    }

    /// The keys' and values' width per token, what context parallelism exchanges: standard
    /// attention's key and value projections (`2 · kv_width`), multi-head latent attention's
    /// keys and values after their up projection (every head's).
    pub fn kv_exchange_width(&self) -> usize {
        match self.mla {
            None => self.kv_width.saturating_mul(2),
            Some(_) => self.heads.saturating_mul(self.qk_head.saturating_add(self.v_head)),
        }
    }

    /// Parameters that tensor parallelism keeps whole on every rank: the norms' gains (and
    /// shifts), the row-split products' biases, the query/key norms' gains, multi-head
    /// latent attention's down projections and latent norms, and a mixture of experts'
    /// router (Megatron-LM's `TopKRouter` weight is not split; pipec's executor keeps it
    /// whole on every rank too).
    pub fn unsplit_parameters(&self) -> usize {
        let biases = if self.bias { 2 * self.d } else { 0 };
        let qk = if self.qk_norm { 2 * self.qk_head } else { 0 };
        let duplicated: usize = self
            .projections()
            .iter()
            .filter(|p| p.split == ProjectionSplit::Replicated)
            .map(|p| p.input.saturating_mul(p.output))
            .sum();
        let latents = self.mla.map_or(0, |m| m.q_lora + m.kv_lora);
        let router = self.moe.map_or(0, |m| self.d.saturating_mul(m.experts));
        2 * self.norm_parameters() + biases + qk + duplicated + latents + router
    }

    /// Parameters of the attention besides its projections: query/key norms' gains, the
    /// sinks' logits, multi-head latent attention's two latent norms.
    pub fn attention_extra_parameters(&self) -> usize {
        let qk = if self.qk_norm { 2 * self.qk_head } else { 0 };
        let sinks = if self.sinks { self.heads } else { 0 };
        let latents = self.mla.map_or(0, |m| m.q_lora + m.kv_lora);
        qk + sinks + latents
    }

    /// The key positions one query attends to in a sequence of `s`, as models' FLOP counts
    /// take them (Megatron-LM's and PaLM's `s²` per sequence, causal or not): every
    /// position, at most the sliding window.
    pub fn attended(&self, s: usize) -> usize {
        if self.window > 0 {
            self.window.min(s)
        } else {
            s
        }
    }

    /// The mean number of keys a query's attention computes over in a sequence of `s` when a
    /// fused kernel skips what the mask hides: causal, s/2 (FlashAttention-2 skips the blocks
    /// above the diagonal, Dao 2023); causal in a window w, (s·w − w²/2)/s, the band below
    /// the diagonal; otherwise every position.
    pub fn computed_keys(&self, s: usize) -> f64 {
        let s_f = s as f64;
        match (self.causal, self.window) {
            (false, _) => s_f,
            (true, 0) => s_f / 2.0,
            (true, w) => {
                let w = w.min(s) as f64;
                (s_f * w - w * w / 2.0) / s_f.max(1.0)
            }
        }
    }
}

/// Where one of a layer's inputs comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// The model's input.
    Input,
    /// The output of the layer with this index.
    Layer(usize),
}

impl Source {
    /// The input of layer `index` in a chain: the previous layer's output.
    pub fn before(index: usize) -> Self {
        index.checked_sub(1).map_or(Source::Input, Source::Layer)
    }
}

/// The tensors crossing a cut after the first `cut` layers, given each layer's operands:
/// every tensor made before the cut (the model's input included) that a layer after it
/// reads, each once, the model's input first and then by producer. A stage whose layers
/// start at `cut` receives these; one ending there sends them.
pub fn crossing<'a>(operands: impl IntoIterator<Item = &'a [Source]>, cut: usize) -> Vec<Source> {
    let mut out = std::collections::BTreeSet::new();
    for ops in operands.into_iter().skip(cut) {
        for &s in ops {
            match s {
                Source::Layer(p) if p < cut => {
                    out.insert(s);
                }
                Source::Input if cut > 0 => {
                    out.insert(s);
                }
                _ => {}
            }
        }
    }
    out.into_iter().collect()
}

/// A language model's sequence length: the model takes a [sequence] of token ids from a
/// vocabulary of `vocab` and outputs [sequence, vocab] scores, one next-token prediction per
/// position. None for any other model.
pub fn language_model_positions(input: &[usize], output: &[usize], vocab: Option<usize>) -> Option<usize> {
    match (input, output, vocab) {
        ([seq], [s, v], Some(vocab)) if s == seq && *v == vocab => Some(*seq),
        _ => None,
    }
}

/// Why an operator cannot take an input shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ShapeError {
    pub message: String,
    /// Index into the call's arguments that the mismatch is about, if any.
    pub argument: Option<usize>,
    /// The shapes fit, but a size is past what pipec plans ([`MAX_DIM`],
    /// [`MAX_TENSOR_ELEMENTS`], [`MAX_LAYER_PARAMETERS`]).
    pub limit: bool,
}

fn shape_err(message: String, argument: Option<usize>) -> ShapeError {
    ShapeError { message, argument, limit: false }
}

fn limit_err(message: String) -> ShapeError {
    ShapeError { message, argument: None, limit: true }
}

/// The largest dimension, and the largest layer argument, pipec plans (2^32). Every size
/// computed from them is then exact in `f64` and in `u64`: nothing wraps.
pub const MAX_DIM: usize = 1 << 32;
/// The most elements one sample's tensor may have (2^40, about 1.1·10^12).
pub const MAX_TENSOR_ELEMENTS: u64 = 1 << 40;
/// The most parameters one layer may have (2^40).
pub const MAX_LAYER_PARAMETERS: u64 = 1 << 40;

/// The number of elements of a shape; None when it would not fit in `u64`.
pub fn elements(shape: &[usize]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64))
}

/// Whether pipec plans a tensor of this per-sample shape: every dimension at most
/// [`MAX_DIM`], at most [`MAX_TENSOR_ELEMENTS`] elements in all (checked, never wrapped).
pub fn check_shape(shape: &[usize]) -> Result<(), String> {
    if let Some(d) = shape.iter().find(|&&d| d > MAX_DIM) {
        return Err(format!("has a dimension of {d}, more than pipec plans (at most {MAX_DIM})"));
    }
    match elements(shape) {
        Some(n) if n <= MAX_TENSOR_ELEMENTS => Ok(()),
        Some(n) => Err(format!(
            "has {n} elements per sample ({}), more than pipec plans (at most {MAX_TENSOR_ELEMENTS})",
            fmt_shape(shape)
        )),
        None => Err(format!(
            "has more than 2^64 elements per sample ({}), more than pipec plans (at most {MAX_TENSOR_ELEMENTS})",
            fmt_shape(shape)
        )),
    }
}

/// Renders a per-sample shape as `[3, 32, 32]`.
/// A model's parameters from its layers' (operator, tied-to) pairs: a layer tied to an
/// embedding holds a copy of the embedding's table, counted once, at the embedding.
pub fn model_parameters<'a>(layers: impl Iterator<Item = (&'a Op, Option<usize>)>) -> u64 {
    layers.filter(|(_, tied)| tied.is_none()).map(|(op, _)| op.parameter_count()).fold(0, u64::saturating_add)
}

/// The parameters one token's computation uses ([`Op::active_parameter_count`]), a tied
/// weight counted once; None for a model without a mixture of experts (all are active).
pub fn active_parameters<'a>(layers: impl Iterator<Item = (&'a Op, Option<usize>)> + Clone) -> Option<u64> {
    layers.clone().any(|(op, _)| op.moe().is_some()).then(|| {
        layers
            .filter(|(_, tied)| tied.is_none())
            .map(|(op, _)| op.active_parameter_count())
            .fold(0, u64::saturating_add)
    })
}

/// "N parameters", with the active ones per token beside for a mixture of experts.
pub fn parameters_text<'a>(layers: impl Iterator<Item = (&'a Op, Option<usize>)> + Clone) -> String {
    let total = thousands(model_parameters(layers.clone()));
    match active_parameters(layers) {
        Some(active) => format!("{total} parameters ({} active per token)", thousands(active)),
        None => format!("{total} parameters"),
    }
}

/// `n` with thousands separators: `124,439,808`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

pub fn fmt_shape(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(ToString::to_string).collect();
    format!("[{}]", parts.join(", "))
}

impl Op {
    /// The operator's DSL name.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Linear { .. } => "linear",
            Op::Conv2d { .. } => "conv2d",
            Op::MaxPool2d { .. } => "maxpool2d",
            Op::AvgPool2d { .. } => "avgpool2d",
            Op::AdaptiveAvgPool2d { .. } => "adaptive_avgpool2d",
            Op::BatchNorm2d { .. } => "batchnorm2d",
            Op::Add { .. } => "add",
            Op::Concat { .. } => "concat",
            Op::Flatten => "flatten",
            Op::Relu => "relu",
            Op::Gelu => "gelu",
            Op::Tanh => "tanh",
            Op::Sigmoid => "sigmoid",
            Op::LayerNorm { .. } => "layernorm",
            Op::RmsNorm { .. } => "rmsnorm",
            Op::GeluTanh => "gelu_tanh",
            Op::Dropout { .. } => "dropout",
            Op::Embedding { .. } => "embedding",
            Op::SeqPool { .. } => "seq_pool",
            Op::TransformerBlock { .. } => "transformer_block",
            Op::PosEmbedding { .. } => "pos_embedding",
            Op::Lstm { .. } => "lstm",
        }
    }

    /// Whether full activation recompute checkpoints this layer's input and rebuilds its
    /// activations as one unit (Megatron-LM's full recompute, one block at a time): the
    /// layers that hold many kernels' activations inside. Every other layer is rebuilt with
    /// the stage's run of small layers it belongs to.
    pub fn recompute_unit(&self) -> bool {
        match self {
            Op::TransformerBlock { .. } | Op::Lstm { .. } => true,
            weightless!()
            | Op::Linear { .. }
            | Op::Conv2d { .. }
            | Op::BatchNorm2d { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Embedding { .. }
            | Op::PosEmbedding { .. } => false,
        }
    }

    /// The operator's integer arguments (sizes, counts, kernel and padding).
    fn sizes(&self) -> Vec<usize> {
        match *self {
            Op::Linear { in_features, out_features, .. } => vec![in_features, out_features],
            Op::Conv2d { in_channels, out_channels, kernel, stride, padding, .. } => {
                vec![in_channels, out_channels, kernel, stride, padding]
            }
            Op::MaxPool2d { kernel, stride, padding } | Op::AvgPool2d { kernel, stride, padding } => {
                vec![kernel, stride, padding]
            }
            Op::AdaptiveAvgPool2d { size } => vec![size],
            Op::BatchNorm2d { channels } => vec![channels],
            Op::Add { inputs } | Op::Concat { inputs } => vec![inputs],
            Op::LayerNorm { dim, .. } | Op::RmsNorm { dim, .. } => vec![dim],
            Op::Embedding { vocab, dim, types, sep } => vec![vocab, dim, types, sep.unwrap_or(0)],
            Op::PosEmbedding { max_len, dim } => vec![max_len, dim],
            Op::Lstm { input, hidden } => vec![input, hidden],
            Op::TransformerBlock { d_model, heads, d_ff, kv_heads, head_dim, window, mla, .. } => {
                let m = mla.map_or([0; 4], |m| [m.q_lora, m.kv_lora, m.rope_dim, m.v_head_dim]);
                [d_model, heads, d_ff, kv_heads, head_dim, window].into_iter().chain(m).collect()
            }
            sizeless!() => Vec::new(),
        }
    }

    /// Whether pipec plans this operator on this input: arguments and input dimensions at
    /// most [`MAX_DIM`], the input at most [`MAX_TENSOR_ELEMENTS`], its parameters at most
    /// [`MAX_LAYER_PARAMETERS`].
    fn check_sizes(&self, input: &[usize]) -> Result<(), ShapeError> {
        if let Some(v) = self.sizes().into_iter().find(|&v| v > MAX_DIM) {
            return Err(limit_err(format!(
                "{} takes an argument of {v}, more than pipec plans (at most {MAX_DIM})",
                self.name()
            )));
        }
        check_shape(input).map_err(|m| limit_err(format!("its input {m}")))?;
        let p = self.parameter_count_wide();
        if p > u128::from(MAX_LAYER_PARAMETERS) {
            return Err(limit_err(format!(
                "{} would have {p} parameters, more than pipec plans in one layer (at most {MAX_LAYER_PARAMETERS})",
                self.name()
            )));
        }
        Ok(())
    }

    /// The per-sample output shape for a per-sample input shape (batch dimension excluded).
    /// Every size is checked against pipec's limits first, and the output after, so no
    /// arithmetic here or downstream wraps.
    pub fn output_shape(&self, input: &[usize]) -> Result<Vec<usize>, ShapeError> {
        self.check_sizes(input)?;
        let out = self.unchecked_output_shape(input)?;
        check_shape(&out).map_err(|m| limit_err(format!("its output {m}")))?;
        Ok(out)
    }

    fn unchecked_output_shape(&self, input: &[usize]) -> Result<Vec<usize>, ShapeError> {
        match *self {
            Op::Linear { in_features, out_features, .. } => match input.last() {
                Some(&d) if d == in_features => {
                    let mut out = input.to_vec();
                    if let Some(last) = out.last_mut() {
                        *last = out_features;
                    }
                    Ok(out)
                }
                Some(&d) => Err(shape_err(
                    format!("linear expects {in_features} input features but its input {} has {d}", fmt_shape(input)),
                    Some(0),
                )),
                None => Err(shape_err("linear needs an input with at least one dimension".into(), None)),
            },
            Op::Conv2d { in_channels, out_channels, kernel, stride, padding, .. } => {
                let [c, h, w] = input else {
                    return Err(shape_err(
                        format!("conv2d expects a [channels, height, width] input, got {}", fmt_shape(input)),
                        None,
                    ));
                };
                if *c != in_channels {
                    return Err(shape_err(
                        format!(
                            "conv2d expects {in_channels} input channels but its input {} has {c}",
                            fmt_shape(input)
                        ),
                        Some(0),
                    ));
                }
                let out = |x: usize| (x + 2 * padding).checked_sub(kernel).map(|v| v / stride.max(1) + 1);
                match (out(*h), out(*w)) {
                    (Some(oh), Some(ow)) if oh > 0 && ow > 0 => Ok(vec![out_channels, oh, ow]),
                    _ => Err(shape_err(
                        format!("conv2d kernel {kernel} is larger than its padded input {}", fmt_shape(input)),
                        Some(2),
                    )),
                }
            }
            Op::MaxPool2d { kernel, stride, padding } | Op::AvgPool2d { kernel, stride, padding } => {
                let [c, h, w] = input else {
                    return Err(shape_err(
                        format!("{} expects a [channels, height, width] input, got {}", self.name(), fmt_shape(input)),
                        None,
                    ));
                };
                if padding > 0 && 2 * padding > kernel {
                    return Err(shape_err(
                        format!("{} padding {padding} is more than half its window {kernel}", self.name()),
                        Some(2),
                    ));
                }
                if kernel == 0 || h + 2 * padding < kernel || w + 2 * padding < kernel {
                    return Err(shape_err(
                        format!("{} window {kernel} does not fit its padded input {}", self.name(), fmt_shape(input)),
                        Some(0),
                    ));
                }
                let s = stride.max(1);
                Ok(vec![*c, (h + 2 * padding - kernel) / s + 1, (w + 2 * padding - kernel) / s + 1])
            }
            Op::AdaptiveAvgPool2d { size } => match input {
                [c, h, w] if size >= 1 && *h >= size && *w >= size => Ok(vec![*c, size, size]),
                [_, _, _] => Err(shape_err(
                    format!(
                        "adaptive_avgpool2d to {size}×{size} needs an input at least that large, got {}",
                        fmt_shape(input)
                    ),
                    Some(0),
                )),
                _ => Err(shape_err(
                    format!("adaptive_avgpool2d expects a [channels, height, width] input, got {}", fmt_shape(input)),
                    None,
                )),
            },
            Op::BatchNorm2d { channels } => match input {
                [c, _, _] if *c == channels => Ok(input.to_vec()),
                [c, _, _] => Err(shape_err(
                    format!("batchnorm2d normalises {channels} channels but its input {} has {c}", fmt_shape(input)),
                    Some(0),
                )),
                _ => Err(shape_err(
                    format!("batchnorm2d expects a [channels, height, width] input, got {}", fmt_shape(input)),
                    None,
                )),
            },
            // a join's shape comes from all its inputs: see `join_shape`
            Op::Add { .. } | Op::Concat { .. } => Ok(input.to_vec()),
            Op::Flatten => Ok(vec![input.iter().product()]),
            Op::Relu | Op::Gelu | Op::GeluTanh | Op::Tanh | Op::Sigmoid | Op::Dropout { .. } => Ok(input.to_vec()),
            Op::LayerNorm { dim, .. } | Op::RmsNorm { dim, .. } => match input.last() {
                Some(&d) if d == dim => Ok(input.to_vec()),
                Some(&d) => Err(shape_err(
                    format!("layernorm normalises {dim} features but its input {} has {d}", fmt_shape(input)),
                    Some(0),
                )),
                None => Err(shape_err("layernorm needs an input with at least one dimension".into(), None)),
            },
            Op::Embedding { vocab, dim, types, sep } => match input {
                _ if sep.is_some() && types < 2 => Err(shape_err(
                    "a separator token (`sep`) only counts segments with `types` of 2 or more".into(),
                    Some(3),
                )),
                _ if sep.is_some_and(|s| s >= vocab) => Err(shape_err(
                    format!("the separator token {} is not in the vocabulary of {vocab}", sep.unwrap_or(0)),
                    Some(3),
                )),
                [seq] => Ok(vec![*seq, dim]),
                _ => Err(shape_err(
                    format!("embedding expects a [sequence] of token ids, got {}", fmt_shape(input)),
                    None,
                )),
            },
            Op::SeqPool { how } => match input {
                [_, d] => Ok(vec![*d]),
                _ => Err(shape_err(
                    format!("seq_pool({how}) expects a [sequence, features] input, got {}", fmt_shape(input)),
                    None,
                )),
            },
            Op::PosEmbedding { max_len, dim } => match input {
                [seq, d] if *d == dim && *seq <= max_len => Ok(input.to_vec()),
                [seq, d] if *d == dim => Err(shape_err(
                    format!("pos_embedding has {max_len} positions but its input {} has {seq}", fmt_shape(input)),
                    Some(0),
                )),
                _ => Err(shape_err(
                    format!("pos_embedding expects a [sequence, features] input, got {}", fmt_shape(input)),
                    None,
                )),
            },
            Op::Lstm { input: n_in, hidden } => match input {
                [seq, d] if *d == n_in => Ok(vec![*seq, hidden]),
                _ => Err(shape_err(
                    format!("lstm expects a [sequence, {n_in}] input, got {}", fmt_shape(input)),
                    Some(0),
                )),
            },
            Op::TransformerBlock { d_model, .. } => match input {
                [_, d] if *d == d_model => self.check_block().map(|()| input.to_vec()),
                _ => Err(shape_err(
                    format!("transformer_block expects a [sequence, {d_model}] input, got {}", fmt_shape(input)),
                    Some(0),
                )),
            },
        }
    }

    /// A transformer block's arguments against each other: heads dividing the width (unless
    /// `head_dim` is given), key/value heads dividing the heads, an even rotary size, the
    /// mixture of experts' `top_k` and `skew` in range, multi-head latent attention's sizes.
    fn check_block(&self) -> Result<(), ShapeError> {
        let Op::TransformerBlock { d_model, heads, kv_heads: written_kv, head_dim: written_head, causal, .. } = *self
        else {
            return Ok(());
        };
        let Some(b) = self.block_dims() else { return Ok(()) };
        let rotary_size = b.mla.map_or(b.head_dim, |m| m.rope_dim);
        if heads == 0 || (written_head == 0 && d_model % heads != 0) {
            return Err(shape_err(
                format!("d={d_model} is not divisible by heads={heads} (give `head_dim=` for heads of another size)"),
                Some(1),
            ));
        }
        if b.mla.is_some() && written_kv != 0 && written_kv != heads {
            return Err(shape_err(
                format!("multi-head latent attention gives each of the {heads} query heads its own key and value heads, so kv_heads={written_kv} does not apply"),
                Some(4),
            ));
        }
        if b.kv_heads == 0 || heads % b.kv_heads != 0 {
            return Err(shape_err(
                format!(
                    "heads={heads} is not a multiple of kv_heads={} (each key/value head serves a whole group of query heads)",
                    b.kv_heads
                ),
                Some(4),
            ));
        }
        if b.rope != 0.0 && rotary_size % 2 != 0 {
            let (what, arg) = match b.mla {
                Some(_) => ("the rotary part rope_dim", ROPE_DIM_ARG),
                None if written_head > 0 => ("the head size head_dim", HEAD_DIM_ARG),
                None => ("the head size d/heads", 7),
            };
            return Err(shape_err(
                format!("rotary position embeddings rotate pairs of features, but {what} = {rotary_size} is odd"),
                Some(arg),
            ));
        }
        if b.rope_scaling != RopeScaling::None {
            if b.rope == 0.0 {
                return Err(shape_err(
                    format!(
                        "rope_scaling={} scales rotary embeddings, but the block has none: give rope=θ",
                        b.rope_scaling.kind()
                    ),
                    Some(ROPE_SCALING_ARG),
                ));
            }
            if let Some(p) = b.rope_scaling.problem() {
                return Err(shape_err(format!("rope_scaling={}: {p}", b.rope_scaling.kind()), Some(ROPE_SCALING_ARG)));
            }
        }
        if let Some(m) = b.mla.filter(|m| m.kv_lora == 0 || m.v_head_dim == 0) {
            let (what, arg) = if m.kv_lora == 0 { ("kv_lora", KV_LORA_ARG) } else { ("v_head_dim", KV_LORA_ARG + 3) };
            return Err(shape_err(format!("multi-head latent attention needs a positive {what}"), Some(arg)));
        }
        if b.mla.is_some() && b.qk_norm {
            return Err(shape_err(
                "multi-head latent attention normalises its latents, not each head's queries and keys: qk_norm=true does not apply".to_string(),
                Some(HEAD_DIM_ARG + 1),
            ));
        }
        if b.window > 0 && !causal {
            return Err(shape_err(
                format!(
                    "a sliding window of {} attends to the positions before each one: it needs causal=true",
                    b.window
                ),
                Some(WINDOW_ARG),
            ));
        }
        if let Some(m) = self.moe().filter(|m| m.top_k == 0 || m.top_k > m.experts) {
            return Err(shape_err(
                format!(
                    "top_k={} must be between 1 and experts={} (each token goes to top_k of the experts)",
                    m.top_k, m.experts
                ),
                Some(MOE_TOP_K_ARG),
            ));
        }
        if let Some(m) = self.moe() {
            if let Some(problem) = m.routing_problem() {
                let arg = if m.expert_bias && m.router != Router::Sigmoid { EXPERT_BIAS_ARG } else { ROUTE_GROUPS_ARG };
                return Err(shape_err(problem, Some(arg)));
            }
        }
        if let Some(m) = b.mla.filter(|m| m.mscale_all_dim > 0.0) {
            if !matches!(b.rope_scaling, RopeScaling::Yarn { .. }) {
                return Err(shape_err(
                    format!(
                        "rope_mscale_all_dim={} scales the softmax by YaRN's factor, but the block has rope_scaling={}: it needs rope_scaling=yarn",
                        m.mscale_all_dim,
                        b.rope_scaling.kind()
                    ),
                    Some(MSCALE_ALL_DIM_ARG),
                ));
            }
        }
        if let Some(m) = self.moe().filter(|m| !(1.0..=m.max_skew()).contains(&m.skew)) {
            return Err(shape_err(
                format!(
                    "skew={} must be between 1 (uniform routing) and experts/top_k = {} (every token choosing the busiest expert)",
                    m.skew,
                    m.max_skew()
                ),
                Some(MOE_SKEW_ARG),
            ));
        }
        Ok(())
    }

    /// The parameter tensors the executor holds for this operator (what an optimizer
    /// update walks one by one).
    pub fn parameter_tensors(&self) -> usize {
        let norm = |kind: NormKind| if kind == NormKind::RmsNorm { 1 } else { 2 };
        match *self {
            Op::Linear { bias, .. } | Op::Conv2d { bias, .. } => 1 + usize::from(bias),
            Op::LayerNorm { .. } | Op::BatchNorm2d { .. } => 2,
            Op::RmsNorm { .. } | Op::PosEmbedding { .. } => 1,
            Op::Embedding { types, .. } => 1 + usize::from(types > 0),
            Op::Lstm { .. } => 4,
            Op::TransformerBlock { .. } => self.block_dims().map_or(0, |b| {
                // two norms; the attention's projections (and their biases), its query/key
                // norms, sinks and latent norms (one tensor of both latents' gains,
                // `LATENT_NORMS_SLOT`); per MLP (the experts' and the shared ones) its up and
                // down projections; a router
                let biases = |on: bool| usize::from(on);
                let mlps = b.moe.map_or(1, |m| m.experts + m.shared);
                let projections: usize = b.projections().iter().map(|p| 1 + biases(p.bias)).sum();
                let extra = 2 * usize::from(b.qk_norm) + usize::from(b.sinks) + usize::from(b.mla.is_some());
                2 * norm(b.norm) + projections + extra + mlps * (2 + 2 * biases(b.bias)) + usize::from(b.moe.is_some())
            }),
            _ => 0,
        }
    }

    /// Number of trainable parameters (saturating; an operator that passes
    /// [`Op::output_shape`] has at most [`MAX_LAYER_PARAMETERS`]).
    pub fn parameter_count(&self) -> u64 {
        u64::try_from(self.parameter_count_wide()).unwrap_or(u64::MAX)
    }

    /// The parameters one token's computation uses: a mixture-of-experts block counts its
    /// router and only `top_k` routed experts besides the shared ones; any other operator
    /// all of its parameters.
    pub fn active_parameter_count(&self) -> u64 {
        match self.block_dims().and_then(|b| b.moe.map(|m| (b, m))) {
            Some((b, m)) => u64::try_from(block_parameters(&b, m.active_experts(), m.experts)).unwrap_or(u64::MAX),
            None => self.parameter_count(),
        }
    }

    /// The parameters of a mixture-of-experts block's routed experts (what expert
    /// parallelism divides; the router and the shared experts are not among them); 0 for
    /// any other operator.
    pub fn routed_expert_parameter_count(&self) -> u64 {
        match self.block_dims().and_then(|b| b.moe.map(|m| (b, m))) {
            Some((b, m)) => {
                let whole = block_parameters(&b, m.experts + m.shared, m.experts);
                let rest = block_parameters(&b, m.shared, m.experts);
                u64::try_from(whole.saturating_sub(rest)).unwrap_or(u64::MAX)
            }
            None => 0,
        }
    }

    /// The parameter count in 128 bits, saturating: exact for any arguments up to
    /// [`MAX_DIM`], and never wrapping for any others (a plan file's).
    fn parameter_count_wide(&self) -> u128 {
        let u = |x: usize| x as u128;
        // Σ Π: a sum of products, saturating
        let sum_of = |terms: &[&[u128]]| {
            terms.iter().fold(0u128, |acc, t| acc.saturating_add(t.iter().fold(1u128, |p, &f| p.saturating_mul(f))))
        };
        match *self {
            Op::Linear { in_features, out_features, bias } => {
                sum_of(&[&[u(in_features), u(out_features)], &[u(out_features), u128::from(bias)]])
            }
            Op::Conv2d { in_channels, out_channels, kernel, bias, .. } => sum_of(&[
                &[u(in_channels), u(out_channels), u(kernel), u(kernel)],
                &[u(out_channels), u128::from(bias)],
            ]),
            Op::LayerNorm { dim, .. } => 2 * u(dim),
            Op::RmsNorm { dim, .. } => u(dim),
            Op::BatchNorm2d { channels } => 2 * u(channels),
            Op::Embedding { vocab, dim, types, .. } => sum_of(&[&[u(vocab), u(dim)], &[u(types), u(dim)]]),
            Op::PosEmbedding { max_len, dim } => sum_of(&[&[u(max_len), u(dim)]]),
            // W_ih [4h, in], W_hh [4h, h], b_ih and b_hh [4h] (PyTorch's layout)
            Op::Lstm { input, hidden } => {
                sum_of(&[&[4, u(hidden), u(input)], &[4, u(hidden), u(hidden)], &[8, u(hidden)]])
            }
            Op::TransformerBlock { .. } => match self.block_dims() {
                Some(b) => match b.moe {
                    Some(m) => block_parameters(&b, m.experts.saturating_add(m.shared), m.experts),
                    None => block_parameters(&b, 1, 0),
                },
                None => 0,
            },
            weightless!() => 0,
        }
    }

    /// A token embedding [vocab, dim] without token types.
    pub fn embedding(vocab: usize, dim: usize) -> Op {
        Op::Embedding { vocab, dim, types: 0, sep: None }
    }

    /// A layer norm over `dim` features with PyTorch's ε (1e-5).
    pub fn layer_norm(dim: usize) -> Op {
        Op::LayerNorm { dim, eps: DEFAULT_EPS }
    }

    /// A GPT-style transformer block (layer norms, GELU, biases, as many key/value heads as
    /// query heads, no rotary embeddings).
    pub fn block(d_model: usize, heads: usize, d_ff: usize, causal: bool) -> Op {
        Op::TransformerBlock {
            d_model,
            heads,
            d_ff,
            causal,
            kv_heads: 0,
            norm: NormKind::LayerNorm,
            mlp: MlpKind::Gelu,
            rope: 0.0,
            rope_scaling: RopeScaling::None,
            bias: true,
            qkv_bias: true,
            eps: DEFAULT_EPS,
            post_norm: false,
            moe: None,
            head_dim: 0,
            qk_norm: false,
            window: 0,
            sinks: false,
            mla: None,
            dropout: 0.0,
        }
    }

    /// A Llama-style decoder block: RMSNorm, grouped-query attention with `kv_heads`
    /// key/value heads, rotary embeddings of base 10,000, a SwiGLU MLP, no biases, ε 1e-5.
    pub fn llama_block(d_model: usize, heads: usize, kv_heads: usize, d_ff: usize) -> Op {
        let mut op = Op::block(d_model, heads, d_ff, true);
        if let Op::TransformerBlock { kv_heads: k, norm, mlp, rope, bias, qkv_bias, .. } = &mut op {
            (*k, *norm, *mlp, *rope, *bias, *qkv_bias) =
                (kv_heads, NormKind::RmsNorm, MlpKind::Swiglu, 10000.0, false, false);
        }
        op
    }

    /// A transformer block's mixture of experts; None for a dense block or any other
    /// operator.
    pub fn moe(&self) -> Option<Moe> {
        match self {
            Op::TransformerBlock { moe, .. } => *moe,
            _ => None,
        }
    }

    /// A transformer block's derived sizes; None for any other operator.
    pub fn block_dims(&self) -> Option<BlockDims> {
        let Op::TransformerBlock {
            d_model,
            heads,
            d_ff,
            causal,
            kv_heads,
            norm,
            mlp,
            rope,
            rope_scaling,
            bias,
            qkv_bias,
            eps,
            post_norm,
            moe,
            head_dim,
            qk_norm,
            window,
            sinks,
            mla,
            dropout,
        } = *self
        else {
            return None;
        };
        let head_dim = if head_dim == 0 { d_model / heads.max(1) } else { head_dim };
        // multi-head latent attention: every query head has its own key and value heads,
        // and each query and key head a rotary part beside the rest
        let kv_heads = match (mla, kv_heads) {
            (Some(_), _) | (None, 0) => heads,
            (None, k) => k,
        };
        let qk_head = head_dim.saturating_add(mla.map_or(0, |m| m.rope_dim));
        let v_head = mla.map_or(head_dim, |m| m.v_head_dim);
        let q_width = heads.saturating_mul(qk_head);
        let kv_width = kv_heads.saturating_mul(head_dim);
        let gated = mlp.gated();
        Some(BlockDims {
            d: d_model,
            heads,
            kv_heads,
            head_dim,
            qk_head,
            v_head,
            q_width,
            kv_width,
            qkv_width: q_width.saturating_add(kv_width.saturating_mul(2)),
            attention_width: heads.saturating_mul(v_head),
            qk_norm,
            window,
            sinks,
            mla,
            dropout,
            ff: d_ff,
            gated,
            up_width: if gated { d_ff.saturating_mul(2) } else { d_ff },
            norm,
            mlp,
            rope,
            rope_scaling,
            bias,
            qkv_bias,
            eps,
            causal,
            post_norm,
            moe,
        })
    }

    /// How many tensors the operator takes (joins take several).
    pub fn arity(&self) -> usize {
        match *self {
            Op::Add { inputs } | Op::Concat { inputs } => inputs,
            _ => 1,
        }
    }

    /// Numbers kept per layer that are state but not parameters (batch normalisation's
    /// running mean and variance): checkpointed, never trained.
    pub fn state_count(&self) -> u64 {
        match *self {
            Op::BatchNorm2d { channels } => 2 * channels as u64,
            _ => 0,
        }
    }

    /// The output shape of a join from its inputs' shapes; errors name every operand.
    pub fn join_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, ShapeError> {
        let all = || inputs.iter().map(|s| fmt_shape(s)).collect::<Vec<_>>().join(" and ");
        let first = inputs.first().copied().unwrap_or(&[]);
        match self {
            Op::Add { .. } => {
                if inputs.iter().all(|s| *s == first) {
                    Ok(first.to_vec())
                } else {
                    Err(shape_err(format!("add needs operands of one shape, got {}", all()), None))
                }
            }
            Op::Concat { .. } => {
                let rest_equal = inputs.iter().all(|s| s.len() == first.len() && !s.is_empty() && s[1..] == first[1..]);
                if !rest_equal {
                    return Err(shape_err(
                        format!("concat joins along the first dimension, so the others must agree; got {}", all()),
                        None,
                    ));
                }
                let mut out = first.to_vec();
                out[0] = inputs.iter().map(|s| s[0]).sum();
                Ok(out)
            }
            _ => self.output_shape(first),
        }
    }

    /// Whether the operator's input is integer token ids rather than features.
    pub fn takes_token_ids(&self) -> bool {
        matches!(self, Op::Embedding { .. })
    }
}

/// A transformer block's parameters with `mlps` copies of its MLP and a router to `routed`
/// experts (none for 0), in 128 bits, saturating.
fn block_parameters(b: &BlockDims, mlps: usize, routed: usize) -> u128 {
    let u = |x: usize| x as u128;
    let sum_of = |terms: &[&[u128]]| {
        terms.iter().fold(0u128, |acc, t| acc.saturating_add(t.iter().fold(1u128, |p, &f| p.saturating_mul(f))))
    };
    let (d, f, up) = (u(b.d), u(b.ff), u(b.up_width));
    let bias = u128::from(b.bias);
    // the attention's projections with their biases, and its other parameters
    let attention = b.projections().iter().fold(u(b.attention_extra_parameters()), |acc, p| {
        acc.saturating_add(u(p.input).saturating_mul(u(p.output))).saturating_add(u(p.output) * u128::from(p.bias))
    });
    // two norms, the attention, the router, and per MLP its up (and gate) and down
    // projections
    sum_of(&[
        &[2, u(b.norm_parameters())],
        &[attention],
        &[d, u(routed)],
        &[u(mlps), d, up],
        &[u(mlps), up, bias],
        &[u(mlps), f, d],
        &[u(mlps), d, bias],
    ])
}

/// How Megatron-style tensor parallelism splits a layer over the ranks of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpSplit {
    /// The whole layer on every rank (same time and memory as without tensor parallelism).
    Replicated,
    /// A linear layer split by its output columns (the first of a pair).
    Column,
    /// A linear layer split by its input rows (the second of a pair; its output summed).
    Row,
    /// A transformer block: heads and MLP columns split.
    Block,
    /// Megatron's vocabulary-parallel layers: a language model's embedding table split by
    /// rows (each rank looks up its part of the vocabulary; the outputs summed) and the
    /// output layer split by its output columns, its logits never gathered (the
    /// cross-entropy is computed over the split, per-token sums exchanged).
    Vocab,
}

fn elementwise(op: &Op) -> bool {
    matches!(op, Op::Relu | Op::Gelu | Op::GeluTanh | Op::Tanh | Op::Sigmoid)
}

/// Each layer's split over `tp` ranks, the one rule the executor builds by and the cost
/// model prices by: a linear layer followed (through element-wise layers only) by a linear
/// layer whose input it feeds becomes a column/row pair; transformer blocks split their
/// heads; every other layer is replicated. Errors when a block cannot be split `tp` ways.
pub fn tp_splits(ops: &[Op], tp: usize) -> Result<Vec<TpSplit>, String> {
    let mut out = vec![TpSplit::Replicated; ops.len()];
    if tp <= 1 {
        return Ok(out);
    }
    let mut i = 0;
    while i < ops.len() {
        match ops[i] {
            Op::Linear { out_features, .. } if out_features % tp == 0 => {
                let mut j = i + 1;
                while j < ops.len() && elementwise(&ops[j]) {
                    j += 1;
                }
                if let Some(Op::Linear { in_features, .. }) = ops.get(j) {
                    if *in_features == out_features {
                        out[i] = TpSplit::Column;
                        out[j] = TpSplit::Row;
                        i = j + 1;
                        continue;
                    }
                }
            }
            Op::TransformerBlock { d_model, heads, d_ff, .. } => {
                let kv = ops[i].block_dims().map_or(heads, |b| b.kv_heads);
                if [heads, d_model, d_ff, kv].iter().any(|n| !n.is_multiple_of(tp)) {
                    let kv_text = if kv == heads { String::new() } else { format!(", kv_heads={kv}") };
                    let kv_rule = if kv == heads { "" } else { ", kv_heads" };
                    return Err(format!("transformer_block(d={d_model}, heads={heads}{kv_text}, ff={d_ff}) cannot be split {tp} ways (heads{kv_rule} and ff must be multiples of tp)"));
                }
                out[i] = TpSplit::Block;
            }
            _ => {}
        }
        i += 1;
    }
    Ok(out)
}

/// Each layer's split in the stage of layers `range` of the whole model `ops` trained with
/// `loss`: [`tp_splits`] within the stage, and Megatron's vocabulary-parallel layers — the
/// model's first layer when it is an embedding, and its last when it is a linear layer
/// not paired with another — under a cross-entropy loss, when `tp` divides the
/// vocabulary (the classes).
pub fn stage_tp_splits(
    ops: &[Op],
    range: std::ops::Range<usize>,
    loss: Loss,
    tp: usize,
) -> Result<Vec<TpSplit>, String> {
    let stage = ops.get(range.clone()).ok_or_else(|| format!("layers {range:?} are not in the model"))?;
    let mut out = tp_splits(stage, tp)?;
    if tp <= 1 || loss != Loss::CrossEntropy {
        return Ok(out);
    }
    if let (0, Some(Op::Embedding { vocab, .. })) = (range.start, stage.first()) {
        if vocab % tp == 0 {
            out[0] = TpSplit::Vocab;
        }
    }
    // (the whole model's split read only for its last stage: every stage's split is asked
    // for each candidate of a search)
    let whole_last = if range.end == ops.len() { tp_splits(ops, tp)?.last().copied() } else { None };
    if let (true, Some(Op::Linear { out_features, .. }), Some(TpSplit::Replicated)) =
        (range.end == ops.len(), stage.last(), whole_last)
    {
        if out_features % tp == 0 && out.last() == Some(&TpSplit::Replicated) {
            let last = out.len() - 1;
            out[last] = TpSplit::Vocab;
        }
    }
    Ok(out)
}

/// The loss function at the end of the model (defined with the other named choices).
pub use crate::vocab::Loss;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_language_models_embedding_and_output_layer_split_over_the_vocabulary() {
        use TpSplit::{Block, Replicated, Vocab};
        let gpt = [
            Op::embedding(128, 64),
            Op::PosEmbedding { max_len: 64, dim: 64 },
            Op::block(64, 4, 256, true),
            Op::layer_norm(64),
            Op::Linear { in_features: 64, out_features: 128, bias: false },
        ];
        let splits = |range, loss, tp| stage_tp_splits(&gpt, range, loss, tp).expect("splits");
        assert_eq!(splits(0..5, Loss::CrossEntropy, 2), [Vocab, Replicated, Block, Replicated, Vocab]);
        // a stage sees the model's first and last layers only where it holds them
        assert_eq!(splits(0..2, Loss::CrossEntropy, 4), [Vocab, Replicated]);
        assert_eq!(splits(2..5, Loss::CrossEntropy, 4), [Block, Replicated, Vocab]);
        assert_eq!(splits(1..4, Loss::CrossEntropy, 4), [Replicated, Block, Replicated]);
        // not under another loss, not without tensor parallelism, not when tp does not divide
        assert_eq!(splits(0..5, Loss::Mse, 2), [Replicated, Replicated, Block, Replicated, Replicated]);
        assert_eq!(splits(0..5, Loss::CrossEntropy, 1), [Replicated; 5]);
        let odd = [Op::embedding(130, 64), Op::Linear { in_features: 64, out_features: 130, bias: false }];
        assert_eq!(stage_tp_splits(&odd, 0..2, Loss::CrossEntropy, 4).expect("splits"), [Replicated; 2]);
        // the second of a column/row pair stays a row-parallel layer
        let mlp = [
            Op::Linear { in_features: 8, out_features: 16, bias: true },
            Op::Relu,
            Op::Linear { in_features: 16, out_features: 4, bias: true },
        ];
        assert_eq!(
            stage_tp_splits(&mlp, 0..3, Loss::CrossEntropy, 2).expect("splits"),
            [TpSplit::Column, Replicated, TpSplit::Row]
        );
        assert!(stage_tp_splits(&mlp, 2..4, Loss::CrossEntropy, 2).is_err());
    }

    #[test]
    fn conv_and_pool_shapes() {
        let conv = Op::Conv2d { in_channels: 3, out_channels: 64, kernel: 3, stride: 1, padding: 1, bias: true };
        assert_eq!(conv.output_shape(&[3, 32, 32]), Ok(vec![64, 32, 32]));
        let pool = Op::MaxPool2d { kernel: 2, stride: 2, padding: 0 };
        assert_eq!(pool.output_shape(&[64, 32, 32]), Ok(vec![64, 16, 16]));
        assert_eq!(Op::Flatten.output_shape(&[64, 16, 16]), Ok(vec![16384]));
        assert_eq!(conv.parameter_count(), 3 * 64 * 9 + 64);
    }

    #[test]
    fn sizes_past_the_limits_are_errors_never_wrapped() {
        // 17 × 1085102592571150096 wraps to 16 in 64 bits: it was planned as 16 features
        let wraps = [17, 1_085_102_592_571_150_096];
        assert_eq!(elements(&wraps), None);
        assert!(check_shape(&wraps).is_err());
        let e = Op::Flatten.output_shape(&wraps).expect_err("past the limits");
        assert!(e.limit && e.message.contains("1085102592571150096"), "{}", e.message);
        // within every dimension's limit, past the element limit
        let e = Op::Flatten.output_shape(&[1 << 21, 1 << 21]).expect_err("2^42 elements");
        assert!(e.limit && e.message.contains("4398046511104 elements"), "{}", e.message);
        // parameters: exact in 128 bits, past the limit an error; the count saturates
        let huge = Op::Linear { in_features: 1 << 32, out_features: 1 << 32, bias: true };
        assert!(huge.output_shape(&[1 << 32]).expect_err("2^64 parameters").limit);
        assert_eq!(huge.parameter_count(), u64::MAX);
        let forged = Op::Conv2d {
            in_channels: usize::MAX,
            out_channels: usize::MAX,
            kernel: usize::MAX,
            stride: 1,
            padding: usize::MAX,
            bias: true,
        };
        assert_eq!(forged.parameter_count(), u64::MAX);
        assert!(forged.output_shape(&[3, 8, 8]).expect_err("arguments past 2^32").limit);
        // the largest sizes still plan
        let wide = Op::Linear { in_features: 1 << 20, out_features: 1 << 20, bias: false };
        assert_eq!(wide.output_shape(&[1 << 20]), Ok(vec![1 << 20]));
        assert_eq!(wide.parameter_count(), 1 << 40);
    }

    #[test]
    fn linear_mismatch_names_both_sizes() {
        let l = Op::Linear { in_features: 100, out_features: 10, bias: true };
        let e = l.output_shape(&[784]).expect_err("mismatch");
        assert!(e.message.contains("100") && e.message.contains("784"));
    }

    #[test]
    fn joins_name_every_operand_shape() {
        let add = Op::Add { inputs: 2 };
        assert_eq!(add.join_shape(&[&[64, 8, 8], &[64, 8, 8]]), Ok(vec![64, 8, 8]));
        let e = add.join_shape(&[&[64, 8, 8], &[32, 8, 8]]).expect_err("mismatch");
        assert!(e.message.contains("[64, 8, 8]") && e.message.contains("[32, 8, 8]"), "{}", e.message);
        let cat = Op::Concat { inputs: 3 };
        assert_eq!(cat.join_shape(&[&[64, 8, 8], &[32, 8, 8], &[16, 8, 8]]), Ok(vec![112, 8, 8]));
        assert!(cat.join_shape(&[&[64, 8, 8], &[32, 4, 4]]).is_err());
    }

    #[test]
    fn padded_pools_and_batchnorm() {
        // ResNet's stem pool: 3x3, stride 2, padding 1 on 112x112 gives 56x56
        let pool = Op::MaxPool2d { kernel: 3, stride: 2, padding: 1 };
        assert_eq!(pool.output_shape(&[64, 112, 112]), Ok(vec![64, 56, 56]));
        assert!(Op::MaxPool2d { kernel: 2, stride: 2, padding: 2 }.output_shape(&[1, 8, 8]).is_err());
        assert_eq!(Op::AdaptiveAvgPool2d { size: 1 }.output_shape(&[2048, 7, 7]), Ok(vec![2048, 1, 1]));
        let bn = Op::BatchNorm2d { channels: 64 };
        assert_eq!(bn.parameter_count(), 128);
        assert_eq!(bn.state_count(), 128);
        assert!(bn.output_shape(&[32, 8, 8]).is_err());
    }

    #[test]
    fn transformer_block_parameters() {
        let t = Op::block(512, 8, 2048, false);
        // 12·d² + 13·d (the usual count with biases and two layer norms), d_ff = 4d
        assert_eq!(t.parameter_count(), 12 * 512 * 512 + 13 * 512);
    }

    /// A Llama-family block as Meta's and Mistral's model cards count it: two RMSNorm gains,
    /// q and o d×d, k and v d×(kv·head) each, three d×ff MLP matrices, no biases.
    fn llama_block(d: usize, heads: usize, kv_heads: usize, ff: usize, qkv_bias: bool) -> Op {
        let mut b = Op::llama_block(d, heads, kv_heads, ff);
        if let Op::TransformerBlock { qkv_bias: q, .. } = &mut b {
            *q = qkv_bias;
        }
        b
    }

    #[test]
    fn encoder_pieces_count_and_shape_as_bert() {
        // bert-base's embeddings: words, two token types, 512 positions, the layer norm
        let emb = Op::Embedding { vocab: 30522, dim: 768, types: 2, sep: Some(102) };
        assert_eq!(emb.parameter_count(), 30522 * 768 + 2 * 768);
        assert_eq!(emb.output_shape(&[128]).expect("ids"), vec![128, 768]);
        // a separator needs at least two types, and must be a token of the vocabulary
        let e = Op::Embedding { vocab: 100, dim: 8, types: 0, sep: Some(3) }.output_shape(&[4]).expect_err("no types");
        assert!(e.message.contains("`types` of 2 or more"), "{}", e.message);
        let e = Op::Embedding { vocab: 100, dim: 8, types: 2, sep: Some(100) }.output_shape(&[4]).expect_err("range");
        assert!(e.message.contains("not in the vocabulary of 100"), "{}", e.message);
        // a post-norm block has the parameters of a pre-norm one
        let mut block = Op::block(768, 12, 3072, false);
        let pre = block.parameter_count();
        if let Op::TransformerBlock { post_norm, .. } = &mut block {
            *post_norm = true;
        }
        assert_eq!(block.parameter_count(), pre);
        assert_eq!(pre, 7_087_872);
        for how in [Pooling::First, Pooling::Mean] {
            assert_eq!(Op::SeqPool { how }.output_shape(&[128, 768]).expect("pooled"), vec![768]);
            assert!(Op::SeqPool { how }.output_shape(&[768]).is_err());
        }
    }

    #[test]
    fn llama_family_block_parameters() {
        // Llama-2-7B: 32 of these make 6,476,267,520 of its 6,738,415,616
        assert_eq!(llama_block(4096, 32, 32, 11008, false).parameter_count(), 202_383_360);
        // Mistral-7B and Llama-3-8B: 8 key/value heads of 128
        assert_eq!(llama_block(4096, 32, 8, 14336, false).parameter_count(), 218_112_000);
        // Qwen2-0.5B: the query, key and value biases (896 + 2·128)
        assert_eq!(llama_block(896, 14, 2, 4864, true).parameter_count(), 14_912_384);
        let b = llama_block(4096, 32, 8, 14336, false).block_dims().expect("a block");
        assert_eq!((b.head_dim, b.kv_width, b.qkv_width, b.up_width), (128, 1024, 6144, 28672));
        // the shape rules: a key/value head per whole group of query heads, an even head size
        assert_eq!(llama_block(64, 4, 2, 128, false).output_shape(&[16, 64]), Ok(vec![16, 64]));
        assert_eq!(llama_block(64, 4, 3, 128, false).output_shape(&[16, 64]).expect_err("4 % 3").argument, Some(4));
        assert_eq!(llama_block(20, 4, 4, 40, false).output_shape(&[16, 20]).expect_err("odd").argument, Some(7));
        // tensor parallelism needs the key/value heads divisible too
        let two = [llama_block(64, 4, 2, 128, false)];
        assert!(tp_splits(&two, 2).is_ok());
        assert!(tp_splits(&two, 4).expect_err("2 kv heads over 4").contains("kv_heads=2"));
    }

    /// A block with today's attention shapes set through the variant's fields.
    fn shaped(mut op: Op, set: impl FnOnce(&mut usize, &mut bool, &mut usize, &mut bool, &mut Option<Mla>)) -> Op {
        if let Op::TransformerBlock { head_dim, qk_norm, window, sinks, mla, .. } = &mut op {
            set(head_dim, qk_norm, window, sinks, mla);
        }
        op
    }

    #[test]
    fn todays_attention_shapes_count_as_their_models_do() {
        // Qwen3-8B's block: 32 heads of 128 on d = 4096 (8 key/value heads), query/key norms
        // of 128 each: 36 of these, the untied embedding and output (151,936 × 4,096 each)
        // and the final norm make its 8,190,735,360 parameters
        let qwen = shaped(Op::llama_block(4096, 32, 8, 12288), |h, qk, _, _, _| (*h, *qk) = (128, true));
        assert_eq!(36 * qwen.parameter_count() + 2 * 151_936 * 4096 + 4096, 8_190_735_360);
        // Qwen3-30B-A3B: 128-wide heads on d = 2048 (not d/heads = 64), 128 experts of 768,
        // 8 per token: 48 blocks and the two untied 151,936 × 2,048 tables make 30.5B
        let mut moe = shaped(Op::llama_block(2048, 32, 4, 768), |h, qk, _, _, _| (*h, *qk) = (128, true));
        if let Op::TransformerBlock { moe: m, .. } = &mut moe {
            *m = Some(Moe::new(128, 8));
        }
        let b = moe.block_dims().expect("a block");
        assert_eq!((b.head_dim, b.q_width, b.kv_width, b.attention_width), (128, 4096, 512, 4096));
        assert_eq!(48 * moe.parameter_count() + 2 * 151_936 * 2048 + 2048, 30_532_122_624);
        assert_eq!(moe.output_shape(&[4096, 2048]), Ok(vec![4096, 2048]));
        // DeepSeek-V3's multi-head latent attention: 187,107,328 parameters a block (query
        // latent 7,168 × 1,536 and its norm, 1,536 × 128 × 192 up; key/value latent and
        // rotary key 7,168 × 576 and its norm, 512 × 128 × 256 up; output 128 × 128 × 7,168)
        let mla = Mla { q_lora: 1536, kv_lora: 512, rope_dim: 64, v_head_dim: 128, mscale_all_dim: 0.0 };
        let dense = |ff| shaped(Op::llama_block(7168, 128, 0, ff), |h, _, _, _, m| (*h, *m) = (128, Some(mla)));
        let attention = dense(18432).parameter_count() - 3 * 7168 * 18432 - 2 * 7168;
        assert_eq!(attention, 187_107_328);
        let b = dense(18432).block_dims().expect("a block");
        assert_eq!((b.kv_heads, b.qk_head, b.v_head, b.q_width, b.attention_width), (128, 192, 128, 24576, 16384));
        assert_eq!(b.projections().len(), 4, "the down projection, two up projections, the output");
        // Moonlight-16B-A3B: no query latent, 16 heads: queries projected directly
        let moonlight = shaped(Op::llama_block(2048, 16, 0, 11264), |h, _, _, _, m| {
            (*h, *m) = (128, Some(Mla { q_lora: 0, kv_lora: 512, rope_dim: 64, v_head_dim: 128, mscale_all_dim: 0.0 }))
        });
        let attention = moonlight.parameter_count() - 3 * 2048 * 11264 - 2 * 2048;
        assert_eq!(attention, 2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048);
        // sinks: a logit per head (GPT-OSS); a sliding window changes no parameter
        let plain = shaped(Op::llama_block(2880, 64, 8, 2880), |h, _, _, _, _| *h = 64);
        let sinks = shaped(plain.clone(), |h, _, w, s, _| (*h, *w, *s) = (64, 128, true));
        assert_eq!(sinks.parameter_count(), plain.parameter_count() + 64);
        assert_eq!(sinks.parameter_tensors(), plain.parameter_tensors() + 1);
        // a head size independent of d/heads lifts the divisibility rule, not the rotary one
        let odd = shaped(Op::llama_block(2880, 64, 8, 2880), |h, _, _, _, _| *h = 63);
        assert_eq!(odd.output_shape(&[16, 2880]).expect_err("odd head").argument, Some(HEAD_DIM_ARG));
        assert!(plain.output_shape(&[16, 2880]).is_ok(), "64 heads of 64 on d = 2880 (GPT-OSS)");
        // without it, d/heads = 45 cannot be rotated
        assert!(Op::llama_block(2880, 64, 8, 2880).block_dims().is_some_and(|b| b.head_dim == 45));
        assert_eq!(Op::llama_block(2880, 64, 8, 2880).output_shape(&[16, 2880]).expect_err("45").argument, Some(7));
    }

    #[test]
    fn a_window_and_the_causal_mask_bound_the_keys_a_fused_kernel_computes() {
        let block = |causal, window| {
            let mut op = Op::llama_block(64, 4, 4, 128);
            if let Op::TransformerBlock { causal: c, window: w, .. } = &mut op {
                (*c, *w) = (causal, window);
            }
            op.block_dims().expect("a block")
        };
        assert_eq!(block(false, 0).computed_keys(4096), 4096.0);
        assert_eq!(block(true, 0).computed_keys(4096), 2048.0);
        // the band of 128 below the diagonal: 4096·128 − 128²/2 entries
        assert_eq!(block(true, 128).computed_keys(4096), (4096.0 * 128.0 - 8192.0) / 4096.0);
        // a window as long as the sequence is the causal mask
        assert_eq!(block(true, 4096).computed_keys(4096), 2048.0);
        assert_eq!((block(true, 128).attended(4096), block(true, 0).attended(4096)), (128, 4096));
    }

    #[test]
    fn language_model_layers() {
        // PyTorch's nn.LSTM(400, 1150): 4·1150·(400 + 1150) weights and two biases of 4·1150
        let lstm = Op::Lstm { input: 400, hidden: 1150 };
        assert_eq!(lstm.parameter_count(), 4 * 1150 * 400 + 4 * 1150 * 1150 + 2 * 4 * 1150);
        assert_eq!(lstm.output_shape(&[70, 400]), Ok(vec![70, 1150]));
        assert!(lstm.output_shape(&[70, 300]).is_err());
        let pos = Op::PosEmbedding { max_len: 1024, dim: 768 };
        assert_eq!(pos.parameter_count(), 786_432);
        assert_eq!(pos.output_shape(&[512, 768]), Ok(vec![512, 768]));
        assert!(pos.output_shape(&[2048, 768]).expect_err("too long").message.contains("1024 positions"));
    }
}
