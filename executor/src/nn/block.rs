//! The transformer block: attention (grouped-query, rotary, causal, context-parallel through
//! the port), its MLPs or mixture of experts (expert-parallel through the port), pre- or
//! post-norm.

use burn::module::{Module, Param};
use burn::prelude::*;
use burn::tensor::activation;
use burn::tensor::IndexingUpdateOp;
use pipec_plan::checkpoint::{expert_slot, ROUTER_SLOT};
use pipec_plan::model::{
    MlpKind, Moe, NormKind, Op, Router, K_NORM_SLOT, LATENT_DOWN_SLOT, LATENT_KV_UP_SLOT, LATENT_NORMS_SLOT,
    LATENT_QUERY_SLOT, Q_NORM_SLOT, SINKS_SLOT,
};

use crate::backend::attention::{repeat_heads, Causal, MaskPositions};
use crate::backend::dropout::{AttentionDropout, DropMask, Site};
use crate::backend::gated::Gate;
use crate::backend::kernels::{self, attention_weights, Gelu, Kernels};
use crate::backend::rotary::Rotation;
use crate::error::{ExecError, Result};

use crate::nn::latent::Latent;
use crate::nn::parts::*;
use crate::nn::routing::choose_experts;

/// Where a block's queries, keys and values come from (one per block: the latent variant's
/// size does not matter).
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Projections<B: Backend> {
    /// Standard attention's one product, fused: [d, (heads + 2·kv_heads)·head_dim] (this
    /// rank's heads under tensor parallelism).
    Fused(Dense<B>),
    /// Multi-head latent attention's down and up projections (`kv_lora=`).
    Latent(Latent<B>),
}

/// A half of a transformer block ([`Block::half`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    Attention,
    Mlp,
}

/// A pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub norm1: Norm<B>,
    pub qkv: Projections<B>,
    /// Query and key norms (`qk_norm=true`): an RMSNorm over each head's features, before
    /// the rotary embeddings (Qwen3, OLMo 2); one gain shared by every head.
    pub q_norm: Option<Norm<B>>,
    pub k_norm: Option<Norm<B>>,
    /// Attention sinks (`sinks=true`, GPT-OSS): a learned logit per query head (this
    /// rank's) that joins every softmax and weighs no value.
    pub sinks: Option<Param<Tensor<B, 1>>>,
    pub proj: Dense<B>,
    pub norm2: Norm<B>,
    /// The MLPs: a dense block's one; a mixture of experts' routed experts, then its shared
    /// ones.
    pub mlps: Vec<Mlp<B>>,
    /// A mixture of experts' router: d → experts, no bias.
    pub router: Option<Dense<B>>,
    /// A mixture of experts' routing rule.
    #[module(skip)]
    pub moe: Option<Moe>,
    /// A mixture of experts' fixed bias per expert (`expert_bias=true`), added to the
    /// scores for the choice only: state, not a parameter (empty without one).
    #[module(skip)]
    pub expert_bias: Vec<f32>,
    /// The block's layer (what its experts' token counts are reported under).
    #[module(skip)]
    pub index: usize,
    /// Query heads (this rank's).
    pub heads: usize,
    /// Key/value heads (this rank's).
    #[module(skip)]
    pub kv_heads: usize,
    /// Each query and key head's size, and each value head's.
    #[module(skip)]
    pub qk_head: usize,
    #[module(skip)]
    pub v_head: usize,
    /// The features of each query and key head that rotary embeddings turn, its last ones:
    /// the whole head, or multi-head latent attention's rotary part.
    #[module(skip)]
    pub rotary: usize,
    /// Each position attends only to itself and earlier positions.
    #[module(skip)]
    pub causal: bool,
    /// Sliding-window attention (0: none): each position attends to itself and the
    /// `window − 1` positions before it.
    #[module(skip)]
    pub window: usize,
    #[module(skip)]
    pub mlp: MlpKind,
    /// Rotary embeddings' base θ (0: none).
    #[module(skip)]
    pub rope: f64,
    /// How the rotary frequencies are scaled.
    #[module(skip)]
    pub rope_scaling: pipec_plan::rope::RopeScaling,
    /// Each norm after its residual sum (BERT) instead of before its branch.
    #[module(skip)]
    pub post_norm: bool,
    /// Selective recompute: the attention core's scores and probabilities are not kept
    /// for the backward, which recomputes them ([`Kernels::attention_recomputed`]).
    #[module(skip)]
    pub recompute_core: bool,
    /// In training, dropout with this probability (`dropout=`; 0: none) on the attention's
    /// probabilities and on each half's output before its residual sum (GPT-2's `attn_pdrop`
    /// and `resid_pdrop`, BERT's attention and hidden dropouts).
    #[module(skip)]
    pub dropout: f64,
    /// Tensor parallelism: this rank and the group's size ((0, 1): the whole block). Each
    /// rank holds a run of the heads (where the probabilities' dropout mask is cut) and each
    /// MLP's rows of its down projection, whose bias rank 0 alone adds.
    #[module(skip)]
    pub tensor_parallel: (usize, usize),
    /// `etp: 1`: the routed experts whole, each on one rank of the expert group, this rank
    /// sending its run of the rows ([`Block::routed_over_group`]).
    #[module(skip)]
    pub whole_experts: bool,
}

/// One MLP of a block: the up projection (gated: [d, 2·ff], the gate's columns then the
/// up's) and the down projection.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub fc1: Dense<B>,
    pub fc2: Dense<B>,
}

impl<B: Kernels> Block<B> {
    /// The queries, keys and values of the normalised input [batch, seq, d], side by side:
    /// [batch, seq, heads·qk_head | kv_heads·qk_head | kv_heads·v_head] (this rank's heads).
    pub(crate) fn queries_keys_values(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>> {
        match &self.qkv {
            Projections::Fused(p) => Ok(p.forward3(x)),
            Projections::Latent(l) => l.queries_keys_values(x, self.heads.max(1)),
        }
    }

    /// The attention probabilities' dropout of a pass whose rank holds `h` query heads; None
    /// while evaluating or without dropout.
    fn attention_dropout(&self, side: &Collected<B>, h: usize) -> Option<AttentionDropout> {
        let key = side.mask_key.filter(|_| self.dropout > 0.0)?;
        let (rank, size) = self.tensor_parallel;
        let key = Site::AttentionProbabilities.key(key, self.index);
        Some(AttentionDropout { p: self.dropout, key, heads: (rank * h..(rank + 1) * h, size * h) })
    }

    /// A half's output [batch, seq, d] (whole on every tensor-parallel rank) after its
    /// dropout: the whole sequence's mask at this context-parallel member's positions.
    pub(crate) fn branch_dropout(&self, half: Half, f: Tensor<B, 3>, side: &Collected<B>) -> Tensor<B, 3> {
        let Some(key) = side.mask_key.filter(|_| self.dropout > 0.0) else { return f };
        let site = match half {
            Half::Attention => Site::AttentionOutput,
            Half::Mlp => Site::MlpOutput,
        };
        let (whole, picks) = crate::nn::context::Context::sequence_cut(side.context.as_ref(), f.dims());
        let mask = DropMask::new(self.dropout, &site.key(key, self.index), whole, picks);
        crate::backend::kernels::dropped(f, &Some(std::sync::Arc::new(mask)))
    }

    /// The attention's context [batch, seq, heads·v_head] from the queries, keys and values
    /// [batch, seq, heads·qk_head | kv_heads·qk_head | kv_heads·v_head]
    /// ([`Block::queries_keys_values`]): rotary embeddings on queries and keys (their last
    /// `rotary` features), each key/value head shared by `heads / kv_heads` query heads; in
    /// training the probabilities' dropout, its mask cut to this rank's heads and this
    /// member's query positions (`side`: the context-parallel group and the dropout key).
    pub(crate) fn attend(&self, qkv: Tensor<B, 3>, side: &Collected<B>) -> Result<Tensor<B, 3>> {
        let context = side.context.as_ref();
        let [b, s, width] = qkv.dims();
        let (h, kv) = (self.heads.max(1), self.kv_heads.max(1));
        let (dh, vh) = (self.qk_head, self.v_head);
        if width != (h + kv) * dh + kv * vh {
            return Err(ExecError::Shape(format!(
                "a block of {h} query and {kv} key/value heads of {dh} (values of {vh}) takes {} query, key and value features, not {width}",
                (h + kv) * dh + kv * vh
            )));
        }
        let part = |start: usize, heads: usize, size: usize| kernels::heads(qkv.clone(), start, heads, size);
        let (mut q, mut k, mut v) = (part(0, h, dh), part(h * dh, kv, dh), part((h + kv) * dh, kv, vh));
        if let Some(n) = &self.q_norm {
            q = n.forward(q);
        }
        if let Some(n) = &self.k_norm {
            k = n.forward(k);
        }
        // this member's positions (all of them without context parallelism), and the keys':
        // every member's, gathered, with context parallelism
        let at: Vec<usize> = context.map_or_else(|| (0..s).collect(), |c| c.positions(s));
        if self.rope != 0.0 {
            // the whole sequence's length: every member's positions under context parallelism
            let seq = context.map_or(s, |c| s * c.cp);
            let (plain, turned) = (dh - self.rotary, self.rotary);
            let table = std::sync::Arc::new(Rotation::new(self.rope, &self.rope_scaling, &at, seq, turned));
            let turn = |t: Tensor<B, 4>| {
                if plain == 0 {
                    return kernels::rotary(t, &table);
                }
                let rotated = kernels::rotary(t.clone().narrow(3, plain, turned), &table);
                Tensor::cat(vec![t.narrow(3, 0, plain), rotated], 3)
            };
            q = turn(q);
            k = turn(k);
        }
        let sinks = self.sinks.as_ref().map(|s| s.val());
        if let Some(c) = context.filter(|c| c.ring) {
            // around the ring: only this member's keys and values are kept (crate::backend::ring)
            let mut ring = c.ring(s, self.causal, self.window, h / kv);
            ring.dropout = self.attention_dropout(side, h);
            let out = B::ring_attention(q, k, v, sinks, &ring)?;
            return Ok(kernels::merge_heads(out));
        }
        let keys = match context {
            Some(c) => {
                k = c.gather(k)?;
                v = c.gather(v)?;
                c.key_positions(s)
            }
            None => at.clone(),
        };
        if kv != h {
            k = repeat_heads(k, h / kv);
            v = repeat_heads(v, h / kv);
        }
        // the probabilities' dropout at this member's queries and the keys' positions
        let seq = context.map_or(s, |c| s * c.cp);
        let drop =
            self.attention_dropout(side, h).map(|d| std::sync::Arc::new(d.mask(b, seq, at.clone(), keys.clone())));
        // the causal mask (in the sliding window) at the true positions
        let causal: Causal =
            self.causal.then(|| std::sync::Arc::new(MaskPositions { queries: at, keys, window: self.window }));
        let context = if self.recompute_core {
            B::attention_recomputed(q, k, v, dh, causal, sinks, &drop)
        } else {
            let p = attention_weights(q, k, dh, causal.as_ref().map(|m| m.mask()), sinks);
            crate::backend::amp::matmul(crate::backend::kernels::dropped(p, &drop), v)
        };
        Ok(kernels::merge_heads(context))
    }

    /// The MLP's activation on the up projection's output (gated: act(gate) ⊙ up,
    /// [`Kernels::gated`]).
    pub(crate) fn activate(&self, up: Tensor<B, 3>) -> Tensor<B, 3> {
        match self.mlp {
            MlpKind::Gelu => kernels::gelu(up, Gelu::Erf),
            MlpKind::GeluTanh => kernels::gelu(up, Gelu::Tanh),
            MlpKind::Swiglu => kernels::gated(up, Gate::Silu),
            MlpKind::Geglu => kernels::gated(up, Gate::Gelu),
        }
    }

    pub(crate) fn forward(&self, x: Tensor<B, 3>, training: bool, side: &mut Collected<B>) -> Result<Tensor<B, 3>> {
        let h = self.half(Half::Attention, x, training, side)?;
        self.half(Half::Mlp, h, training, side)
    }

    /// One half of the block on its input [batch, seq, d]: pre-norm `x + f(norm(x))`,
    /// post-norm `norm(x + f(x))`, `f` the attention or the MLP part. The block is its
    /// attention half, then its MLP half; each is what recompute by module runs again
    /// (`pipec_plan::plan::BlockRecompute::executor_halves`).
    pub(crate) fn half(
        &self,
        half: Half,
        x: Tensor<B, 3>,
        training: bool,
        side: &mut Collected<B>,
    ) -> Result<Tensor<B, 3>> {
        let norm = match half {
            Half::Attention => &self.norm1,
            Half::Mlp => &self.norm2,
        };
        let input = if self.post_norm { x.clone() } else { norm.forward(x.clone()) };
        let f = match half {
            Half::Attention => self.proj.forward3(self.attend(self.queries_keys_values(input)?, side)?),
            Half::Mlp => self.feed_forward(input, training, side)?,
        };
        let f = self.branch_dropout(half, f, side);
        Ok(if self.post_norm { norm.forward(x + f) } else { x + f })
    }

    /// One MLP on [rows, d].
    /// One MLP on [rows, d]; under tensor parallelism this rank's part of its output, which
    /// the group's sum completes: rank 0 adds the down projection's bias, once, the others
    /// add it times 0, so that every rank that ran the MLP holds a gradient of it (zeros
    /// there) for the group's sum (`pipec_plan::in_pass::tp_partial_ids`).
    pub(crate) fn mlp(&self, m: &Mlp<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.mlp_of(m, x, false)
    }

    /// [`Block::mlp`] of an MLP split like the block, or of a `whole` one (a routed expert
    /// under `etp: 1`: every rank adds its bias, on the rows it computes).
    pub(crate) fn mlp_of(&self, m: &Mlp<B>, x: Tensor<B, 2>, whole: bool) -> Tensor<B, 2> {
        let [rows, d] = x.dims();
        let h = self.activate(m.fc1.forward3(x.reshape([1, rows, d])));
        // (a weight gathered per product is a one-value stand-in here: the width is h's)
        let width = h.dims()[2];
        let y = B::dense(h.reshape([rows, width]), m.fc2.weight.val());
        match &m.fc2.bias {
            Some(b) if self.tensor_parallel.0 > 0 && !whole => y + b.val().unsqueeze::<2>() * 0.0,
            Some(b) => y + b.val().unsqueeze::<2>(),
            None => y,
        }
    }

    /// The block's MLP part on the normalised [batch, seq, d]: its one MLP, or a mixture of
    /// experts — the router's scores (softmax or sigmoid), each token's `top_k` best-scored
    /// experts (the lower index first on a tie), their weights (divided by their sum with
    /// `norm_topk`), each expert on the tokens that chose it — at most its capacity, the
    /// earlier tokens of the microbatch first — summed back weighted, and the shared
    /// experts on every token. In training, a block with `aux_loss` > 0 adds its
    /// load-balancing loss α · E · Σᵢ fᵢ · Pᵢ to `side.aux` (fᵢ the fraction of the tokens
    /// that chose expert i, before any capacity drops them; Pᵢ the mean score of expert i);
    /// every mixture of experts records the tokens each expert took.
    pub(crate) fn feed_forward(
        &self,
        x: Tensor<B, 3>,
        training: bool,
        side: &mut Collected<B>,
    ) -> Result<Tensor<B, 3>> {
        let [b, s, d] = x.dims();
        let (Some(router), Some(moe)) = (&self.router, self.moe) else {
            let m = self.mlps.first().ok_or_else(|| ExecError::Shape("a transformer block without an MLP".into()))?;
            return Ok(self.mlp(m, x.reshape([b * s, d])).reshape([b, s, d]));
        };
        let (t, experts, k) = (b * s, moe.experts, moe.top_k);
        if self.mlps.len() != experts + moe.shared || k == 0 || k > experts {
            return Err(ExecError::Shape(format!(
                "a mixture of {experts} experts (top {k}) and {} shared has {} MLPs",
                moe.shared,
                self.mlps.len()
            )));
        }
        let x = x.reshape([t, d]);
        let dev = x.device();
        let logits = router.forward2(x.clone());
        let scores = match moe.router {
            Router::Softmax => activation::softmax(logits, 1),
            Router::Sigmoid => activation::sigmoid(logits),
        };
        let host = scores
            .clone()
            .into_data()
            .to_vec::<f32>()
            .map_err(|e| ExecError::Backend(format!("the router's scores: {e:?}")))?;
        let chosen = choose_experts(&host, &self.expert_bias, &moe);
        let ints = |v: Vec<i64>| {
            let n = v.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), &dev)
        };
        // per expert, the (token, choice) pairs that chose it, in token order
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); experts];
        for (i, &c) in chosen.iter().enumerate() {
            by_expert[c].push((i / k, i % k));
        }
        // context parallelism: the capacity and the balancing loss count the whole
        // microbatch's tokens, every member's chunks (`Context::route_whole`), and the
        // member's term is α · E · Σᵢ fᵢ · (its tokens' mean score of i), whose mean over the
        // members is the whole microbatch's loss
        let whole = match &side.context {
            Some(c) if moe.capacity > 0.0 || (training && moe.aux_loss > 0.0) => {
                let capacity = moe.expert_capacity(t * c.cp);
                Some(c.route_whole(&mut by_expert, b, s, capacity)?)
            }
            _ => None,
        };
        if training && moe.aux_loss > 0.0 {
            let chose: Vec<f32> = match &whole {
                Some(f) => f.clone(),
                None => by_expert.iter().map(|p| p.len() as f32 / t as f32).collect(),
            };
            let f = Tensor::<B, 2>::from_data(TensorData::new(chose, [1, experts]), &dev);
            let aux = (scores.clone().mean_dim(0) * f).sum() * (moe.aux_loss * experts as f64);
            side.aux = Some(match side.aux.take() {
                Some(a) => a + aux,
                None => aux,
            });
        }
        let picked = ints(chosen.iter().map(|&c| c as i64).collect()).reshape([t, k]);
        let mut weights = scores.gather(1, picked);
        if moe.norm_topk {
            weights = weights.clone() / weights.sum_dim(1);
        }
        if moe.scale != 1.0 {
            weights = weights * moe.scale;
        }
        let weights = weights.reshape([t * k]);
        // each expert's pairs, to its capacity (with context parallelism, cut already)
        if let (Some(c), None) = (moe.expert_capacity(t), &whole) {
            by_expert.iter_mut().for_each(|pairs| pairs.truncate(c));
        }
        let took: Vec<u64> = by_expert.iter().map(|pairs| pairs.len() as u64).collect();
        let mut out = match side.experts.clone() {
            Some(group) => self.routed_over_group(&x, &weights, &by_expert, k, &group)?,
            None => {
                // every expert here, on its pairs (an expert-parallel member keeps only its
                // own experts' weights: `crate::parallel::experts::Holding`)
                if self.mlps[..experts].iter().any(|m| m.fc1.weight.dims().contains(&0)) {
                    return Err(ExecError::Plan(format!(
                        "layer {}: this device keeps only its expert group's share of the experts, and was asked to compute them all",
                        self.index
                    )));
                }
                let mut out = Tensor::<B, 2>::zeros([t, d], &dev);
                for (m, pairs) in self.mlps.iter().zip(&by_expert).filter(|(_, pairs)| !pairs.is_empty()) {
                    let n = pairs.len();
                    let tokens = ints(pairs.iter().map(|&(token, _)| token as i64).collect());
                    let slots = ints(pairs.iter().map(|&(token, j)| (token * k + j) as i64).collect());
                    let y = self.mlp(m, x.clone().select(0, tokens.clone()));
                    let w = weights.clone().select(0, slots).reshape([n, 1]);
                    out = out.select_assign(0, tokens, y * w, IndexingUpdateOp::Add);
                }
                out
            }
        };
        for m in &self.mlps[experts..] {
            out = out + self.mlp(m, x.clone());
        }
        side.expert_tokens.push((self.index, took));
        Ok(out.reshape([b, s, d]))
    }

    /// Layer `index`'s block `op` — whole, or with `tp` > 1 rank `rank`'s shard of it: each
    /// weight is `slice(slot, the whole deterministic initial values)`, the rank's part
    /// (with `whole_experts`, `etp: 1`, the routed experts' whole).
    pub(crate) fn build(
        index: usize,
        op: &Op,
        seed: u64,
        device: &B::Device,
        slice: impl Fn(u64, Vec<f32>) -> Vec<f32>,
        (tp, rank): (usize, usize),
        whole_experts: bool,
    ) -> Option<Self> {
        let k = op.block_dims()?;
        let tp = tp.max(1);
        let he = 2.0;
        let (d, f) = (k.d, k.ff);
        let (qkv_w, up_w) = (k.qkv_width / tp, k.up_width / tp);
        let dense = |slot: u64, fan_in: usize, fan_out: usize, shape: [usize; 2], bias: Option<usize>, gain: f64| {
            let w = slice(slot, dense_values(index, slot, seed, fan_in, fan_out, gain));
            Dense::from_values(index, slot, w, shape, bias.map(|n| vec![0.0; n]), device)
        };
        Some(Block {
            norm1: Norm::of(k.norm, index, 0, d, k.eps, device),
            qkv: match (k.mla, k.latent()) {
                (Some(m), Some(w)) => {
                    // the down projection and the latents' norms whole on every rank, the
                    // up projections this rank's heads
                    let column =
                        |slot: u64, [rows, cols]: [usize; 2]| dense(slot, rows, cols, [rows, cols / tp], None, 1.0);
                    let queries = || column(LATENT_QUERY_SLOT, w.query);
                    Projections::Latent(Latent {
                        input_queries: (m.q_lora == 0).then(queries),
                        down: dense(LATENT_DOWN_SLOT, w.down[0], w.down[1], w.down, None, 1.0),
                        norms: param(pid(index, LATENT_NORMS_SLOT), vec![1.0; w.norms], [w.norms], device),
                        latent_queries: (m.q_lora > 0).then(queries),
                        kv_up: column(LATENT_KV_UP_SLOT, w.kv_up),
                        q_lora: m.q_lora,
                        kv_lora: m.kv_lora,
                        rope_dim: m.rope_dim,
                        head_dim: k.head_dim,
                        v_head: m.v_head_dim,
                        query_scale: k.softmax_multiplier(),
                    })
                }
                _ => Projections::Fused(dense(2, d, k.qkv_width, [d, qkv_w], k.qkv_bias.then_some(qkv_w), 1.0)),
            },
            q_norm: k.qk_norm.then(|| Norm::of(NormKind::RmsNorm, index, Q_NORM_SLOT, k.qk_head, k.eps, device)),
            k_norm: k.qk_norm.then(|| Norm::of(NormKind::RmsNorm, index, K_NORM_SLOT, k.qk_head, k.eps, device)),
            // the sinks start at 0 (each softmax's normaliser one more e^0); tensor
            // parallelism gives each rank its heads' sinks
            sinks: k.sinks.then(|| {
                let values = slice(SINKS_SLOT, vec![0.0; k.heads]);
                param(pid(index, SINKS_SLOT), values, [k.heads / tp], device)
            }),
            // the heads' outputs (heads · head_dim, this rank's) back to d
            proj: dense(4, k.attention_width, d, [k.attention_width / tp, d], k.bias.then_some(d), 1.0),
            norm2: Norm::of(k.norm, index, 6, d, k.eps, device),
            mlps: match k.moe {
                None => vec![Mlp {
                    fc1: dense(8, d, k.up_width, [d, up_w], k.bias.then_some(up_w), he),
                    fc2: dense(10, f, d, [f / tp, d], k.bias.then_some(d), 1.0),
                }],
                Some(m) => (0..m.experts + m.shared)
                    .map(|e| {
                        // a routed expert whole on this rank (`etp: 1`), or split like the block
                        let t = if whole_experts && e < m.experts { 1 } else { tp };
                        let up = k.up_width / t;
                        Mlp {
                            fc1: dense(expert_slot(e), d, k.up_width, [d, up], k.bias.then_some(up), he),
                            fc2: dense(expert_slot(e) + 2, f, d, [f / t, d], k.bias.then_some(d), 1.0),
                        }
                    })
                    .collect(),
            },
            router: k.moe.map(|m| dense(ROUTER_SLOT, d, m.experts, [d, m.experts], None, 1.0)),
            moe: k.moe,
            expert_bias: k.moe.filter(|m| m.expert_bias).map_or_else(Vec::new, |m| vec![0.0; m.experts]),
            index,
            heads: k.heads / tp,
            kv_heads: k.kv_heads / tp,
            qk_head: k.qk_head,
            v_head: k.v_head,
            rotary: k.mla.map_or(k.qk_head, |m| m.rope_dim),
            causal: k.causal,
            window: k.window,
            mlp: k.mlp,
            rope: k.rope,
            rope_scaling: k.rope_scaling,
            post_norm: k.post_norm,
            recompute_core: false,
            dropout: k.dropout,
            tensor_parallel: (rank, tp),
            whole_experts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `expert_bias`: added to the scores for the choice only. A bias that favours experts 6
    /// and 7 by far makes every token choose them, weighted by their own (unbiased) scores
    /// renormalised: the mixture's output is theirs, recomposed here from the router and
    /// the two experts' MLPs.
    #[test]
    fn the_expert_bias_chooses_the_experts_and_leaves_their_weights_alone() {
        type T = burn::backend::Flex;
        let dev = Default::default();
        let mut op = Op::llama_block(8, 2, 2, 4);
        if let Op::TransformerBlock { moe, .. } = &mut op {
            *moe = Some(Moe { router: Router::Sigmoid, expert_bias: true, ..Moe::new(8, 2) });
        }
        let mut block = Block::<T>::build(1, &op, 3, &dev, |_, v| v, (1, 0), false).expect("a block");
        assert_eq!(block.expert_bias, vec![0.0; 8], "zeros until a checkpoint says otherwise");
        let values: Vec<f32> = (0..5 * 8).map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0).collect();
        let x = Tensor::<T, 3>::from_data(TensorData::new(values, [1, 5, 8]), &dev);
        let run = |b: &Block<T>| {
            let y = b.feed_forward(x.clone(), false, &mut crate::nn::parts::Collected::default()).expect("runs");
            y.into_data().to_vec::<f32>().expect("f32")
        };
        let plain = run(&block);
        block.expert_bias = vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 10.0, 10.0];
        let biased = run(&block);
        let rows = x.clone().reshape([5, 8]);
        let scores = activation::sigmoid(block.router.as_ref().expect("a router").forward2(rows.clone()));
        let (s6, s7) = (scores.clone().narrow(1, 6, 1), scores.narrow(1, 7, 1));
        let sum = s6.clone() + s7.clone();
        let expected =
            block.mlp(&block.mlps[6], rows.clone()) * (s6 / sum.clone()) + block.mlp(&block.mlps[7], rows) * (s7 / sum);
        let expected = expected.into_data().to_vec::<f32>().expect("f32");
        let apart = biased.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(apart < 1e-6, "{apart:e}: {biased:?} against {expected:?}");
        assert!(plain.iter().zip(&biased).any(|(a, b)| (a - b).abs() > 1e-3), "the bias changes the choice");
    }
}
