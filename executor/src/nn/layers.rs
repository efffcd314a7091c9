//! The model's layers as Burn modules, built from the plan's operators with deterministic
//! initial weights (the same on every device and in every run), and their forward pass on
//! activations of any rank.

use burn::module::{Module, Param, ParamId};
use burn::prelude::*;
use burn::tensor::activation;
use burn::tensor::module::{adaptive_avg_pool2d, avg_pool2d, conv2d, embedding, max_pool2d};
use burn::tensor::ops::ConvOptions;
use burn::tensor::IndexingUpdateOp;
use pipec_plan::checkpoint::{expert_slot, ROUTER_SLOT};
use pipec_plan::model::{MlpKind, Moe, NormKind, Op, Pooling, Router, Source};

use crate::backend::attention::{repeat_heads, Causal};
use crate::backend::dense::attention_at;
use crate::backend::dense::Kernels;
use crate::backend::rng::Rng;
use crate::error::{ExecError, Result};

/// An activation flowing between layers: its rank varies along the model.
#[derive(Debug, Clone)]
pub enum Act<B: Backend> {
    /// Token ids [batch, seq].
    Tokens(Tensor<B, 2, Int>),
    D2(Tensor<B, 2>),
    D3(Tensor<B, 3>),
    D4(Tensor<B, 4>),
    /// Several tensors crossing one stage boundary together (a graph model's boundary:
    /// `pipec_plan::model::crossing`), in that order.
    Bundle(Vec<Act<B>>),
}

impl<B: Backend> Act<B> {
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Act::Tokens(t) => t.dims().to_vec(),
            Act::D2(t) => t.dims().to_vec(),
            Act::D3(t) => t.dims().to_vec(),
            Act::D4(t) => t.dims().to_vec(),
            Act::Bundle(parts) => parts.first().map(Act::dims).unwrap_or_default(),
        }
    }

    /// The tensors it carries: itself, or a bundle's parts.
    pub fn parts(self) -> Vec<Act<B>> {
        match self {
            Act::Bundle(parts) => parts,
            one => vec![one],
        }
    }

    /// One tensor as itself, several as a bundle.
    pub fn from_parts(mut parts: Vec<Act<B>>) -> Self {
        if parts.len() == 1 {
            parts.remove(0)
        } else {
            Act::Bundle(parts)
        }
    }
}

/// A stage of a graph model: which tensors each layer reads, which arrive at the stage
/// and which leave it (`pipec_plan::model::crossing` at its two ends).
#[derive(Debug, Clone)]
pub struct StageGraph {
    /// Per layer of the stage, its operands (model-wide sources).
    pub operands: Vec<Vec<Source>>,
    /// The global index of the stage's first layer.
    pub first: usize,
    /// What the stage receives, in order (the model's input on the first stage).
    pub inputs: Vec<Source>,
    /// What the stage sends on, in order (the model's output on the last stage).
    pub outputs: Vec<Source>,
}

fn param<B: Backend, const D: usize>(
    id: u64,
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    Param::initialized(ParamId::from(id), Tensor::from_data(TensorData::new(values, shape), device).require_grad())
}

/// Deterministic parameter ids: layer index and slot, so checkpoints and optimizer state are
/// portable between layouts.
pub(crate) use pipec_plan::checkpoint::param_id as pid;

/// The deterministic initial table of embedding layer `index` ([vocab, dim], row-major):
/// normal with standard deviation 1/√dim — the scale of the dense layers' weights, so a
/// token's embedding is not drowned by the blocks' outputs, and a tied output projection's
/// first scores have unit scale (GPT-2's 0.02 at its d = 768 is about the same); an output
/// projection tied to it starts from its transpose.
pub(crate) fn embedding_values(index: usize, seed: u64, vocab: usize, dim: usize) -> Vec<f32> {
    let std = 1.0 / (dim.max(1) as f32).sqrt();
    Rng::keyed(&[seed, 10, index as u64, 0]).normal_vec(vocab * dim).into_iter().map(|v| std * v).collect()
}

pub(crate) use pipec_plan::hf::transpose;

/// A dense projection (weight [in, out], optional bias).
#[derive(Module, Debug)]
pub struct Dense<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
}

/// The deterministic initial weight values of a dense projection ([in, out], row-major).
pub(crate) fn dense_values(layer: usize, slot: u64, seed: u64, fan_in: usize, fan_out: usize, gain: f64) -> Vec<f32> {
    let k = (gain * 3.0 / fan_in as f64).sqrt();
    let mut rng = Rng::keyed(&[seed, 10, layer as u64, slot]);
    rng.uniform_vec(fan_in * fan_out, k)
}

impl<B: Kernels> Dense<B> {
    // the layer's identity (index, slot, seed) keys its initial weights; the rest is its shape
    #[allow(clippy::too_many_arguments)]
    fn new(
        layer: usize,
        slot: u64,
        seed: u64,
        fan_in: usize,
        fan_out: usize,
        bias: bool,
        gain: f64,
        device: &B::Device,
    ) -> Self {
        Dense {
            weight: param(
                pid(layer, slot),
                dense_values(layer, slot, seed, fan_in, fan_out, gain),
                [fan_in, fan_out],
                device,
            ),
            bias: bias.then(|| param(pid(layer, slot + 1), vec![0.0; fan_out], [fan_out], device)),
        }
    }

    /// A dense projection from explicit values (a tensor-parallel shard).
    pub(crate) fn from_values(
        layer: usize,
        slot: u64,
        weight: Vec<f32>,
        shape: [usize; 2],
        bias: Option<Vec<f32>>,
        device: &B::Device,
    ) -> Self {
        Dense {
            weight: param(pid(layer, slot), weight, shape, device),
            bias: bias.map(|b| {
                let n = b.len();
                param(pid(layer, slot + 1), b, [n], device)
            }),
        }
    }

    /// x · W without the bias (a row-parallel partial sum).
    pub(crate) fn matmul_only(&self, x: Act<B>) -> Result<Act<B>> {
        Ok(match x {
            Act::D2(t) => Act::D2(B::dense(t, self.weight.val())),
            Act::D3(t) => {
                let [b, s, d] = t.dims();
                let y = B::dense(t.reshape([b * s, d]), self.weight.val());
                let out = y.dims()[1];
                Act::D3(y.reshape([b, s, out]))
            }
            other => return Err(ExecError::Shape(format!("a linear layer cannot take {:?}", other.dims()))),
        })
    }

    /// Adds the bias (after a row-parallel all-reduce).
    pub(crate) fn add_bias(&self, y: Act<B>) -> Act<B> {
        match (&self.bias, y) {
            (Some(b), Act::D2(t)) => Act::D2(t + b.val().unsqueeze::<2>()),
            (Some(b), Act::D3(t)) => Act::D3(t + b.val().unsqueeze::<3>()),
            (_, y) => y,
        }
    }

    pub(crate) fn forward_act(&self, x: Act<B>) -> Result<Act<B>> {
        Ok(match x {
            Act::D2(t) => Act::D2(self.forward2(t)),
            Act::D3(t) => Act::D3(self.forward3(t)),
            other => return Err(ExecError::Shape(format!("a linear layer cannot take {:?}", other.dims()))),
        })
    }

    fn forward2(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = B::dense(x, self.weight.val());
        match &self.bias {
            Some(b) => y + b.val().unsqueeze::<2>(),
            None => y,
        }
    }

    fn forward3(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, s, d] = x.dims();
        let y = self.forward2(x.reshape([b * s, d]));
        let out = y.dims()[1];
        y.reshape([b, s, out])
    }
}

/// Normalisation over the last dimension: layer normalisation (a gain and a bias) or, with
/// no bias, RMSNorm (scaled only: x / √(mean(x²) + ε) · gain).
#[derive(Module, Debug)]
pub struct Norm<B: Backend> {
    pub gamma: Param<Tensor<B, 1>>,
    /// The layer norm's bias; None for RMSNorm.
    pub beta: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub eps: f64,
}

impl<B: Backend> Norm<B> {
    /// A norm of `kind`: its gain in `slot`, a layer norm's bias in `slot + 1`.
    pub(crate) fn of(kind: NormKind, layer: usize, slot: u64, dim: usize, eps: f64, device: &B::Device) -> Self {
        Norm {
            gamma: param(pid(layer, slot), vec![1.0; dim], [dim], device),
            beta: (kind == NormKind::LayerNorm).then(|| param(pid(layer, slot + 1), vec![0.0; dim], [dim], device)),
            eps,
        }
    }

    pub(crate) fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let mut shape = [1usize; D];
        shape[D - 1] = self.gamma.dims()[0];
        match &self.beta {
            Some(beta) => {
                let mean = x.clone().mean_dim(D - 1);
                let centered = x - mean;
                let var = centered.clone().powi_scalar(2).mean_dim(D - 1);
                let normed = centered / (var + self.eps).sqrt();
                normed * self.gamma.val().reshape(shape) + beta.val().reshape(shape)
            }
            None => {
                let ms = x.clone().powi_scalar(2).mean_dim(D - 1);
                x / (ms + self.eps).sqrt() * self.gamma.val().reshape(shape)
            }
        }
    }
}

/// A pre-norm transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub norm1: Norm<B>,
    /// Queries, keys and values fused: [d, (heads + 2·kv_heads)·head_dim] (this rank's heads
    /// under tensor parallelism).
    pub qkv: Dense<B>,
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
    /// The block's layer (what its experts' token counts are reported under).
    #[module(skip)]
    pub index: usize,
    /// Query heads (this rank's).
    pub heads: usize,
    /// Key/value heads (this rank's).
    #[module(skip)]
    pub kv_heads: usize,
    /// Each position attends only to itself and earlier positions.
    #[module(skip)]
    pub causal: bool,
    #[module(skip)]
    pub mlp: MlpKind,
    /// Rotary embeddings' base θ (0: none).
    #[module(skip)]
    pub rope: f64,
    /// Each norm after its residual sum (BERT) instead of before its branch.
    #[module(skip)]
    pub post_norm: bool,
    /// Selective recompute: the attention core's scores and probabilities are not kept
    /// for the backward, which recomputes them ([`Kernels::attention_recomputed`]).
    #[module(skip)]
    pub recompute_core: bool,
}

/// What a stage's forward collects beside its output.
#[derive(Debug)]
pub struct Collected<B: Backend> {
    /// Batch normalisation's batch statistics, in layer order (training only).
    pub stats: Vec<Tensor<B, 1>>,
    /// The mixture-of-experts blocks' load-balancing losses, weighted and summed (training,
    /// blocks with `aux_loss` > 0 only).
    pub aux: Option<Tensor<B, 1>>,
    /// Per mixture-of-experts block, its layer and the tokens each of its experts took.
    pub expert_tokens: Vec<(usize, Vec<u64>)>,
    /// Expert parallelism: the stage's group, with which the blocks exchange tokens.
    pub experts: Option<crate::backend::port::PeerGroup>,
    /// Context parallelism: the stage's group, whose keys and values attention gathers,
    /// and this member's positions.
    pub context: Option<crate::nn::context::Context>,
}

impl<B: Backend> Default for Collected<B> {
    fn default() -> Self {
        Collected { stats: Vec::new(), aux: None, expert_tokens: Vec::new(), experts: None, context: None }
    }
}

/// One MLP of a block: the up projection (gated: [d, 2·ff], the gate's columns then the
/// up's) and the down projection.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub fc1: Dense<B>,
    pub fc2: Dense<B>,
}

/// GELU's tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
pub(crate) fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let inner = (x.clone() + x.clone().powi_scalar(3) * 0.044715) * c;
    x * (inner.tanh() + 1.0) * 0.5
}

/// Rotary position embeddings (RoFormer; Hugging Face's `rotate_half` layout) on
/// [batch, heads, seq, dh] queries or keys whose rows are at `positions` of the sequence
/// (0, 1, … but for a context-parallel member): features i and i + dh/2 of position p
/// rotate by p·θ^(−2i/dh).
pub(crate) fn rotary_at<B: Backend>(x: Tensor<B, 4>, theta: f64, positions: &[usize]) -> Tensor<B, 4> {
    let [_, _, s, dh] = x.dims();
    let half = dh / 2;
    let (mut cos, mut sin) = (Vec::with_capacity(s * dh), Vec::with_capacity(s * dh));
    for &p in positions {
        for j in 0..dh {
            let i = j % half;
            // in f64, rounded once, as the reference computes its angles in f32 from
            // inv_freq = 1/θ^(2i/dh)
            let inv_freq = (1.0 / theta.powf((2 * i) as f64 / dh as f64)) as f32;
            let angle = (p as f32 * inv_freq) as f64;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let dev = x.device();
    let cos = Tensor::<B, 2>::from_data(TensorData::new(cos, [s, dh]), &dev).unsqueeze::<4>();
    let sin = Tensor::<B, 2>::from_data(TensorData::new(sin, [s, dh]), &dev).unsqueeze::<4>();
    let first = x.clone().narrow(3, 0, half);
    let second = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![second.neg(), first], 3);
    x * cos + rotated * sin
}

impl<B: Kernels> Block<B> {
    /// The attention's context [batch, seq, heads·dh] from the fused QKV projection's output
    /// [batch, seq, (heads + 2·kv_heads)·dh]: rotary embeddings on queries and keys, each
    /// key/value head shared by `heads / kv_heads` query heads.
    pub(crate) fn attend(
        &self,
        qkv: Tensor<B, 3>,
        context: Option<&crate::nn::context::Context>,
    ) -> Result<Tensor<B, 3>> {
        let [b, s, width] = qkv.dims();
        let (h, kv) = (self.heads.max(1), self.kv_heads.max(1));
        let dh = width / (h + 2 * kv);
        let part = |start: usize, heads: usize| {
            qkv.clone().narrow(2, start * dh, heads * dh).reshape([b, s, heads, dh]).swap_dims(1, 2)
        };
        let (mut q, mut k, mut v) = (part(0, h), part(h, kv), part(h + kv, kv));
        // this member's positions (all of them without context parallelism), and the keys':
        // every member's, gathered, with context parallelism
        let at: Vec<usize> = context.map_or_else(|| (0..s).collect(), |c| c.positions(s));
        if self.rope != 0.0 {
            q = rotary_at(q, self.rope, &at);
            k = rotary_at(k, self.rope, &at);
        }
        if let Some(c) = context.filter(|c| c.ring) {
            // around the ring: only this member's keys and values are kept (crate::backend::ring)
            let ring = c.ring(s, self.causal, h / kv);
            let out = B::ring_attention(q, k, v, &ring)
                .map_err(|e| ExecError::Transport(crate::comm::transport::TransportError::Other(e)))?;
            return Ok(out.swap_dims(1, 2).reshape([b, s, h * dh]));
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
        // the causal mask at the true positions
        let causal: Causal = self.causal.then(|| std::sync::Arc::new((at, keys)));
        let context = if self.recompute_core {
            B::attention_recomputed(q, k, v, dh, causal)
        } else {
            crate::backend::amp::matmul(attention_at(q, k, dh, causal.as_ref().map(|m| (&m.0[..], &m.1[..]))), v)
        };
        Ok(context.swap_dims(1, 2).reshape([b, s, h * dh]))
    }

    /// The MLP's activation on the up projection's output (gated: act(gate) ⊙ up).
    pub(crate) fn activate(&self, up: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate_and_up = |up: Tensor<B, 3>| {
            let f = up.dims()[2] / 2;
            (up.clone().narrow(2, 0, f), up.narrow(2, f, f))
        };
        match self.mlp {
            MlpKind::Gelu => activation::gelu(up),
            MlpKind::GeluTanh => gelu_tanh(up),
            MlpKind::Swiglu => {
                let (gate, up) = gate_and_up(up);
                activation::silu(gate) * up
            }
            MlpKind::Geglu => {
                let (gate, up) = gate_and_up(up);
                activation::gelu(gate) * up
            }
        }
    }

    fn forward(&self, x: Tensor<B, 3>, training: bool, side: &mut Collected<B>) -> Result<Tensor<B, 3>> {
        if self.post_norm {
            let ctx = self.attend(self.qkv.forward3(x.clone()), side.context.as_ref())?;
            let h = self.norm1.forward(x + self.proj.forward3(ctx));
            let m = self.feed_forward(h.clone(), training, side)?;
            return Ok(self.norm2.forward(h + m));
        }
        let ctx = self.attend(self.qkv.forward3(self.norm1.forward(x.clone())), side.context.as_ref())?;
        let x = x + self.proj.forward3(ctx);
        let m = self.feed_forward(self.norm2.forward(x.clone()), training, side)?;
        Ok(x + m)
    }

    /// One MLP on [rows, d].
    fn mlp(&self, m: &Mlp<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let [rows, d] = x.dims();
        m.fc2.forward3(self.activate(m.fc1.forward3(x.reshape([1, rows, d])))).reshape([rows, d])
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
        let mut chosen = vec![0usize; t * k];
        let mut order: Vec<usize> = Vec::with_capacity(experts);
        for (token, row) in host.chunks_exact(experts).enumerate() {
            order.clear();
            order.extend(0..experts);
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            chosen[token * k..(token + 1) * k].copy_from_slice(&order[..k]);
        }
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

    /// Expert parallelism: the routed experts' outputs, weighted, at their tokens — each
    /// pair's input sent to the member of `group` computing its expert (this member's
    /// experts computed on the rows every member sent), and the outputs sent back. The
    /// members first tell each other how many rows of each expert they send.
    fn routed_over_group(
        &self,
        x: &Tensor<B, 2>,
        weights: &Tensor<B, 1>,
        by_expert: &[Vec<(usize, usize)>],
        k: usize,
        group: &crate::backend::port::PeerGroup,
    ) -> Result<Tensor<B, 2>> {
        let [t, d] = x.dims();
        let dev = x.device();
        let (ep, experts) = (group.members.len(), by_expert.len());
        let local = experts / ep.max(1);
        if local == 0 || local * ep != experts {
            return Err(ExecError::Plan(format!("{experts} experts do not divide over {ep} expert-parallel members")));
        }
        let ints = |v: Vec<usize>| {
            let n = v.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(v.into_iter().map(|i| i as i64).collect(), [n]), &dev)
        };
        let rows_of = |e: usize| by_expert[e].len();
        let send: Vec<usize> = (0..ep).map(|j| (j * local..(j + 1) * local).map(rows_of).sum()).collect();
        let counts: Vec<Vec<f32>> =
            (0..ep).map(|j| (j * local..(j + 1) * local).map(|e| rows_of(e) as f32).collect()).collect();
        let exchange_error = |e: String| ExecError::Transport(crate::comm::transport::TransportError::Other(e));
        let got = group.exchanger.exchange(&group.members, counts).map_err(ExecError::Transport)?;
        // from each member, the rows it sends each of this member's experts
        let from: Vec<Vec<usize>> = got.iter().map(|c| c.iter().map(|&v| v as usize).collect()).collect();
        if from.iter().any(|c| c.len() != local) {
            return Err(exchange_error("the expert group's members disagree on the experts each holds".into()));
        }
        let recv: Vec<usize> = from.iter().map(|c| c.iter().sum()).collect();
        // this member's pairs in expert order: member-major, as `send` counts them
        let pairs: Vec<(usize, usize)> = by_expert.iter().flatten().copied().collect();
        if pairs.is_empty() {
            return Err(ExecError::Shape("a microbatch routed no token to any expert".into()));
        }
        let tokens = ints(pairs.iter().map(|&(token, _)| token).collect());
        let layer = self.index as u32;
        let ex = crate::backend::port::Exchange {
            group: group.clone(),
            send,
            recv: recv.clone(),
            what: Some((layer, pipec_plan::TokenExchange::Dispatch)),
        };
        let x = if group.tracked { x.clone() } else { x.clone().detach() };
        let arrived = B::exchange(x.select(0, tokens.clone()), &ex).map_err(exchange_error)?;
        // this member's experts, each on its rows from every member (member-major there)
        let n_recv: usize = recv.iter().sum();
        let computed = if n_recv == 0 {
            arrived
        } else {
            let starts: Vec<usize> = recv.iter().scan(0, |s, &n| Some(std::mem::replace(s, *s + n))).collect();
            let (mut outputs, mut order) = (Vec::new(), Vec::with_capacity(n_recv));
            for l in 0..local {
                let rows: Vec<usize> = (0..ep)
                    .flat_map(|i| {
                        let start = starts[i] + from[i][..l].iter().sum::<usize>();
                        start..start + from[i][l]
                    })
                    .collect();
                if rows.is_empty() {
                    continue;
                }
                order.extend_from_slice(&rows);
                let m = &self.mlps[group.position * local + l];
                outputs.push(self.mlp(m, arrived.clone().select(0, ints(rows))));
            }
            // back into the order the rows arrived in
            let mut inverse = vec![0usize; n_recv];
            for (at, &row) in order.iter().enumerate() {
                inverse[row] = at;
            }
            Tensor::cat(outputs, 0).select(0, ints(inverse))
        };
        let computed = if group.tracked { computed } else { computed.detach() };
        let combine =
            crate::backend::port::Exchange { what: Some((layer, pipec_plan::TokenExchange::Combine)), ..ex.reversed() };
        let returned = B::exchange(computed, &combine).map_err(exchange_error)?;
        let slots = ints(pairs.iter().map(|&(token, j)| token * k + j).collect());
        let w = weights.clone().select(0, slots).reshape([pairs.len(), 1]);
        Ok(Tensor::<B, 2>::zeros([t, d], &dev).select_assign(0, tokens, returned * w, IndexingUpdateOp::Add))
    }

    /// Layer `index`'s block `op` — whole, or with `tp` > 1 one rank's shard of it: each
    /// weight is `slice(slot, the whole deterministic initial values)`, the rank's part.
    pub(crate) fn build(
        index: usize,
        op: &Op,
        seed: u64,
        device: &B::Device,
        slice: impl Fn(u64, Vec<f32>) -> Vec<f32>,
        tp: usize,
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
            qkv: dense(2, d, k.qkv_width, [d, qkv_w], k.qkv_bias.then_some(qkv_w), 1.0),
            proj: dense(4, d, d, [d / tp, d], k.bias.then_some(d), 1.0),
            norm2: Norm::of(k.norm, index, 6, d, k.eps, device),
            mlps: match k.moe {
                None => vec![Mlp {
                    fc1: dense(8, d, k.up_width, [d, up_w], k.bias.then_some(up_w), he),
                    fc2: dense(10, f, d, [f / tp, d], k.bias.then_some(d), 1.0),
                }],
                Some(m) => (0..m.experts + m.shared)
                    .map(|e| Mlp {
                        fc1: dense(expert_slot(e), d, k.up_width, [d, up_w], k.bias.then_some(up_w), he),
                        fc2: dense(expert_slot(e) + 2, f, d, [f / tp, d], k.bias.then_some(d), 1.0),
                    })
                    .collect(),
            },
            router: k.moe.map(|m| dense(ROUTER_SLOT, d, m.experts, [d, m.experts], None, 1.0)),
            moe: k.moe,
            index,
            heads: k.heads / tp,
            kv_heads: k.kv_heads / tp,
            causal: k.causal,
            mlp: k.mlp,
            rope: k.rope,
            post_norm: k.post_norm,
            recompute_core: false,
        })
    }
}

/// A 2-D convolution.
#[derive(Module, Debug)]
pub struct Conv<B: Backend> {
    pub weight: Param<Tensor<B, 4>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub stride: usize,
    #[module(skip)]
    pub padding: usize,
}

/// Batch normalisation over a [batch, C, H, W] activation, per channel.
///
/// In training it normalises with the microbatch's own statistics (biased variance) and
/// hands them (mean, unbiased variance; detached) to the caller, which folds them into the
/// running statistics once per optimizer update (see `StageState::fold_statistics`). The
/// running statistics are state, not parameters: the optimizer never sees them, a microbatch
/// copy carries them along, checkpoints keep them (`RUNNING_MEAN_SLOT`, `RUNNING_VAR_SLOT`).
#[derive(Module, Debug)]
pub struct BatchNorm<B: Backend> {
    pub gamma: Param<Tensor<B, 1>>,
    pub beta: Param<Tensor<B, 1>>,
    #[module(skip)]
    pub running_mean: Vec<f32>,
    #[module(skip)]
    pub running_var: Vec<f32>,
    /// The layer's global index.
    #[module(skip)]
    pub index: usize,
}

/// Batch normalisation's ε (PyTorch's default).
pub const BN_EPS: f64 = 1e-5;
/// How far one update moves the running statistics toward the new batch statistics
/// (PyTorch's default `momentum`).
pub const BN_MOMENTUM: f32 = 0.1;
/// Checkpoint slots of the running statistics (the parameters take slots 0 and 1).
pub const RUNNING_MEAN_SLOT: u64 = 2;
pub const RUNNING_VAR_SLOT: u64 = 3;

/// The checkpoint id of a state slot of layer `index` (the same scheme as its parameters').
pub fn state_id(index: usize, slot: u64) -> u64 {
    pid(index, slot)
}

impl<B: Backend> BatchNorm<B> {
    fn new(index: usize, channels: usize, device: &B::Device) -> Self {
        BatchNorm {
            gamma: param(pid(index, 0), vec![1.0; channels], [channels], device),
            beta: param(pid(index, 1), vec![0.0; channels], [channels], device),
            running_mean: vec![0.0; channels],
            running_var: vec![1.0; channels],
            index,
        }
    }

    /// Normalises `x`; in training, pushes [mean ‖ unbiased variance] (2·C values) to `stats`.
    fn forward(&self, x: Tensor<B, 4>, training: bool, stats: &mut Vec<Tensor<B, 1>>) -> Result<Tensor<B, 4>> {
        let [n, c, h, w] = x.dims();
        let per_channel = n * h * w;
        let (mean, var) = if training {
            if per_channel < 2 {
                return Err(ExecError::Shape(format!(
                    "batchnorm2d (layer {}) needs more than one value per channel in a microbatch to compute a variance, got {n}×{h}×{w} (raise the microbatch size)",
                    self.index
                )));
            }
            let mean = x.clone().mean_dim(0).mean_dim(2).mean_dim(3);
            let var = (x.clone() - mean.clone()).powi_scalar(2).mean_dim(0).mean_dim(2).mean_dim(3);
            let unbiased = var.clone().detach() * (per_channel as f64 / (per_channel - 1) as f64);
            stats.push(Tensor::cat(vec![mean.clone().detach().reshape([c]), unbiased.reshape([c])], 0));
            (mean, var)
        } else {
            let dev = x.device();
            let stat =
                |v: &[f32]| Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [c]), &dev).reshape([1, c, 1, 1]);
            (stat(&self.running_mean), stat(&self.running_var))
        };
        let normed = (x - mean) / (var + BN_EPS).sqrt();
        Ok(normed * self.gamma.val().reshape([1, c, 1, 1]) + self.beta.val().reshape([1, c, 1, 1]))
    }
}

/// A layer without weights; `index` is its global layer index (dropout masks use it).
#[derive(Module, Debug, Clone)]
pub struct Stateless {
    #[module(skip)]
    pub op: Op,
    #[module(skip)]
    pub index: usize,
}

/// An embedding table [vocab, d] (or a positional table [max_len, d]), with a token
/// embedding's optional token-type table.
#[derive(Module, Debug)]
pub struct Embed<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub types: Option<TokenTypes<B>>,
}

/// A token embedding's token-type (segment) table [types, d], BERT's: position p of a row
/// has the type "number of `sep` tokens before p", at most types − 1 (type 0 everywhere
/// without `sep`).
#[derive(Module, Debug)]
pub struct TokenTypes<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    #[module(skip)]
    pub sep: Option<usize>,
}

impl<B: Backend> TokenTypes<B> {
    /// Layer `index`'s table (slot 1), deterministic: 0.02·N(0, 1) as GPT-2's positions.
    pub(crate) fn new(
        index: usize,
        seed: u64,
        types: usize,
        dim: usize,
        sep: Option<usize>,
        device: &B::Device,
    ) -> Self {
        let mut rng = Rng::keyed(&[seed, 10, index as u64, 1]);
        let table = rng.normal_vec(types * dim).into_iter().map(|v| 0.02 * v).collect();
        TokenTypes { weight: param(pid(index, 1), table, [types, dim], device), sep }
    }

    /// Each position's type id for token ids [batch, seq].
    pub(crate) fn type_ids(&self, ids: &Tensor<B, 2, Int>) -> Result<Tensor<B, 2, Int>> {
        let [rows, seq] = ids.dims();
        let last = self.weight.dims()[0].saturating_sub(1) as i64;
        let mut types = vec![0i64; rows * seq];
        if let Some(sep) = self.sep {
            let host: Vec<i64> = ids
                .clone()
                .into_data()
                .convert::<i64>()
                .into_vec()
                .map_err(|e| ExecError::Shape(format!("token ids: {e:?}")))?;
            for (row, out) in host.chunks(seq).zip(types.chunks_mut(seq)) {
                let mut seen = 0i64;
                for (id, t) in row.iter().zip(out) {
                    *t = seen.min(last);
                    if *id == sep as i64 {
                        seen += 1;
                    }
                }
            }
        }
        Ok(Tensor::from_data(TensorData::new(types, [rows, seq]), &ids.device()))
    }

    /// `x` [batch, seq, d] plus each position's token-type row.
    pub(crate) fn add(&self, x: Tensor<B, 3>, ids: &Tensor<B, 2, Int>) -> Result<Tensor<B, 3>> {
        Ok(x + embedding(self.weight.val(), self.type_ids(ids)?))
    }
}

/// Rows `first..first + rows` of an embedding table: a tensor-parallel rank's part of the
/// vocabulary (a token-type table is whole on every rank).
#[derive(Module, Debug)]
pub struct VocabEmbed<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub first: usize,
    pub types: Option<TokenTypes<B>>,
}

impl<B: Backend> VocabEmbed<B> {
    pub(crate) fn new(
        index: usize,
        table: Vec<f32>,
        shape: [usize; 2],
        first: usize,
        types: Option<TokenTypes<B>>,
        device: &B::Device,
    ) -> Self {
        VocabEmbed { weight: param(pid(index, 0), table, shape, device), first, types }
    }

    /// The looked-up vectors of the ids this rank holds, zeros for the others (summed over
    /// the group, every id's vector).
    pub(crate) fn partial(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let rows = self.weight.dims()[0];
        let local = ids - self.first as i64;
        let held = local.clone().greater_equal_elem(0).bool_and(local.clone().lower_elem(rows as i64));
        let index = local.clamp(0, rows as i64 - 1);
        let mask = held.float().unsqueeze_dim::<3>(2);
        embedding(self.weight.val(), index) * mask
    }
}

/// One LSTM layer (PyTorch's gate order i, f, g, o and its two biases), weights stored as
/// [in, 4·hidden] and [hidden, 4·hidden] (the transpose of PyTorch's) like `Dense`.
#[derive(Module, Debug)]
pub struct Lstm<B: Backend> {
    pub w_ih: Param<Tensor<B, 2>>,
    pub w_hh: Param<Tensor<B, 2>>,
    pub b_ih: Param<Tensor<B, 1>>,
    pub b_hh: Param<Tensor<B, 1>>,
}

impl<B: Kernels> Lstm<B> {
    fn new(index: usize, seed: u64, input: usize, hidden: usize, device: &B::Device) -> Self {
        // PyTorch's initialisation: every weight and bias uniform in ±1/√hidden
        let k = 1.0 / (hidden as f64).sqrt();
        let mut rng = Rng::keyed(&[seed, 10, index as u64, 0]);
        let mut u = |n: usize| rng.uniform_vec(n, k);
        let (w_ih, w_hh, b_ih, b_hh) = (u(input * 4 * hidden), u(hidden * 4 * hidden), u(4 * hidden), u(4 * hidden));
        Lstm {
            w_ih: param(pid(index, 0), w_ih, [input, 4 * hidden], device),
            w_hh: param(pid(index, 1), w_hh, [hidden, 4 * hidden], device),
            b_ih: param(pid(index, 2), b_ih, [4 * hidden], device),
            b_hh: param(pid(index, 3), b_hh, [4 * hidden], device),
        }
    }

    /// [batch, seq, in] → every step's hidden state [batch, seq, hidden], from zero state.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [n, s, i] = x.dims();
        // (from the bias: under ZeRO-3 the weights may be one-value stand-ins, gathered by
        // their products)
        let h4 = self.b_ih.dims()[0];
        let hidden = h4 / 4;
        // the input's part of every step's gates at once
        let bias = (self.b_ih.val() + self.b_hh.val()).unsqueeze::<2>();
        let xw = B::dense(x.reshape([n * s, i]), self.w_ih.val()).reshape([n, s, h4]);
        let dev = xw.device();
        let mut h = Tensor::<B, 2>::zeros([n, hidden], &dev);
        let mut c = Tensor::<B, 2>::zeros([n, hidden], &dev);
        let mut outs = Vec::with_capacity(s);
        for t in 0..s {
            let gates = xw.clone().narrow(1, t, 1).reshape([n, h4]) + B::dense(h, self.w_hh.val()) + bias.clone();
            let gate = |k: usize| gates.clone().narrow(1, k * hidden, hidden);
            let (ig, fg, gg, og) = (
                activation::sigmoid(gate(0)),
                activation::sigmoid(gate(1)),
                gate(2).tanh(),
                activation::sigmoid(gate(3)),
            );
            c = fg * c + ig * gg;
            h = og * c.clone().tanh();
            outs.push(h.clone().unsqueeze_dim::<3>(1));
        }
        Tensor::cat(outs, 1)
    }
}

/// One layer of a stage.
#[derive(Module, Debug)]
pub enum Layer<B: Backend> {
    Dense(Dense<B>),
    Conv(Conv<B>),
    Norm(Norm<B>),
    BatchNorm(BatchNorm<B>),
    Embedding(Embed<B>),
    /// A learned positional embedding table [max_len, d].
    PosEmbedding(Embed<B>),
    Lstm(Lstm<B>),
    Block(Block<B>),
    Stateless(Stateless),
    /// Tensor parallelism: a column-parallel shard (this rank's output features).
    ColumnLinear(Dense<B>),
    /// Tensor parallelism: a row-parallel shard (this rank's input features); its output is
    /// a partial sum completed by an all-reduce, then the (replicated) bias is added.
    RowLinear(Dense<B>),
    /// Tensor parallelism: a transformer block with this rank's heads and MLP columns.
    ParallelBlock(Block<B>),
    /// Tensor parallelism: this rank's rows of a language model's embedding table.
    VocabEmbedding(VocabEmbed<B>),
    /// Tensor parallelism: this rank's output columns of the model's output layer (its
    /// scores for its part of the vocabulary).
    VocabLinear(Dense<B>),
}

impl<B: Kernels> Layer<B> {
    /// Builds layer `index` of the model with its deterministic initial weights.
    pub fn new(index: usize, op: &Op, seed: u64, device: &B::Device) -> Self {
        let he = 2.0; // He initialisation for layers followed by ReLU-like activations
        match *op {
            Op::Linear { in_features, out_features, bias } => {
                Layer::Dense(Dense::new(index, 0, seed, in_features, out_features, bias, he, device))
            }
            Op::Conv2d { in_channels, out_channels, kernel, stride, padding, bias } => {
                let fan_in = in_channels * kernel * kernel;
                let k = (he * 3.0 / fan_in as f64).sqrt();
                let mut rng = Rng::keyed(&[seed, 10, index as u64, 0]);
                Layer::Conv(Conv {
                    weight: param(
                        pid(index, 0),
                        rng.uniform_vec(out_channels * fan_in, k),
                        [out_channels, in_channels, kernel, kernel],
                        device,
                    ),
                    bias: bias.then(|| param(pid(index, 1), vec![0.0; out_channels], [out_channels], device)),
                    stride,
                    padding,
                })
            }
            Op::LayerNorm { dim, eps } => Layer::Norm(Norm::of(NormKind::LayerNorm, index, 0, dim, eps, device)),
            Op::RmsNorm { dim, eps } => Layer::Norm(Norm::of(NormKind::RmsNorm, index, 0, dim, eps, device)),
            Op::BatchNorm2d { channels } => Layer::BatchNorm(BatchNorm::new(index, channels, device)),
            Op::Embedding { vocab, dim, types, sep } => Layer::Embedding(Embed {
                weight: param(pid(index, 0), embedding_values(index, seed, vocab, dim), [vocab, dim], device),
                types: (types > 0).then(|| TokenTypes::new(index, seed, types, dim, sep, device)),
            }),
            Op::PosEmbedding { max_len, dim } => {
                let mut rng = Rng::keyed(&[seed, 10, index as u64, 0]);
                let table = rng.normal_vec(max_len * dim).into_iter().map(|v| 0.02 * v).collect();
                Layer::PosEmbedding(Embed { weight: param(pid(index, 0), table, [max_len, dim], device), types: None })
            }
            Op::Lstm { input, hidden } => Layer::Lstm(Lstm::new(index, seed, input, hidden, device)),
            Op::TransformerBlock { .. } => match Block::build(index, op, seed, device, |_, w| w, 1) {
                Some(b) => Layer::Block(b),
                None => Layer::Stateless(Stateless { op: op.clone(), index }),
            },
            _ => Layer::Stateless(Stateless { op: op.clone(), index }),
        }
    }

    /// The forward pass. `mask_key` makes dropout masks depend on (step, microbatch) only;
    /// batch normalisation in training appends its batch statistics to `side.stats`, a
    /// mixture of experts its load-balancing loss and token counts (`Collected`).
    pub fn forward(
        &self,
        x: Act<B>,
        training: bool,
        mask_key: (u64, u64, u64),
        side: &mut Collected<B>,
    ) -> Result<Act<B>> {
        Ok(match (self, x) {
            (Layer::BatchNorm(bn), Act::D4(t)) => Act::D4(bn.forward(t, training, &mut side.stats)?),
            (Layer::Dense(d), Act::D2(t)) => Act::D2(d.forward2(t)),
            (Layer::Dense(d), Act::D3(t)) => Act::D3(d.forward3(t)),
            (Layer::Conv(c), Act::D4(t)) => Act::D4(conv2d(
                t,
                c.weight.val(),
                c.bias.as_ref().map(Param::val),
                ConvOptions::new([c.stride; 2], [c.padding; 2], [1, 1], 1),
            )),
            (Layer::Norm(n), Act::D2(t)) => Act::D2(n.forward(t)),
            (Layer::Norm(n), Act::D3(t)) => Act::D3(n.forward(t)),
            (Layer::Embedding(e), Act::Tokens(t)) => match &e.types {
                None => Act::D3(B::embed(e.weight.val(), t)),
                Some(types) => Act::D3(types.add(B::embed(e.weight.val(), t.clone()), &t)?),
            },
            (Layer::PosEmbedding(e), Act::D3(t)) => {
                let [_, s, d] = t.dims();
                let rows = match &side.context {
                    // context parallelism: the rows of this member's positions
                    Some(c) => {
                        let at: Vec<i64> = c.positions(s).into_iter().map(|p| p as i64).collect();
                        let dev = t.device();
                        e.weight.val().select(0, Tensor::<B, 1, Int>::from_data(TensorData::new(at, [s]), &dev))
                    }
                    None => e.weight.val().narrow(0, 0, s),
                };
                // as rows of s·d values: flex adds a broadcast row in one pass, where a
                // broadcast [1, s, d] went value by value (0.1 ms for gpt-tiny's 4 × 64 × 64)
                let b = t.dims()[0];
                Act::D3((t.reshape([b, s * d]) + rows.reshape([1, s * d])).reshape([b, s, d]))
            }
            (Layer::Lstm(l), Act::D3(t)) => Act::D3(l.forward(t)),
            (Layer::Block(b), Act::D3(t)) => Act::D3(b.forward(t, training, side)?),
            (Layer::Stateless(st), x) => stateless(&st.op, st.index, x, training, mask_key, side.context.as_ref())?,
            (Layer::ColumnLinear(d), x) => d.forward_act(x)?,
            (layer, x) => {
                return Err(ExecError::Shape(format!(
                    "layer {} cannot take an activation of shape {:?}",
                    layer_name(layer),
                    x.dims()
                )))
            }
        })
    }
}

fn layer_name<B: Backend>(l: &Layer<B>) -> &'static str {
    match l {
        Layer::Dense(_) => "linear",
        Layer::Conv(_) => "conv2d",
        Layer::Norm(_) => "layernorm",
        Layer::BatchNorm(_) => "batchnorm2d",
        Layer::Embedding(_) => "embedding",
        Layer::PosEmbedding(_) => "pos_embedding",
        Layer::Lstm(_) => "lstm",
        Layer::Block(_) => "transformer_block",
        Layer::Stateless(st) => st.op.name(),
        Layer::ColumnLinear(_) | Layer::RowLinear(_) => "tensor-parallel linear",
        Layer::ParallelBlock(_) => "tensor-parallel transformer_block",
        Layer::VocabEmbedding(_) => "vocabulary-parallel embedding",
        Layer::VocabLinear(_) => "vocabulary-parallel linear",
    }
}

fn elementwise<B: Backend>(x: Act<B>, f: impl Fn(Tensor<B, 2>) -> Tensor<B, 2>) -> Result<Act<B>> {
    // Apply on a 2-D view and restore the shape.
    let dims = x.dims();
    type Restore<B> = Box<dyn Fn(Tensor<B, 2>) -> Act<B>>;
    let (flat, restore): (Tensor<B, 2>, Restore<B>) = match x {
        Act::D2(t) => (t, Box::new(Act::D2)),
        Act::D3(t) => {
            let [a, b, c] = t.dims();
            (t.reshape([a, b * c]), Box::new(move |y: Tensor<B, 2>| Act::D3(y.reshape([a, b, c]))))
        }
        Act::D4(t) => {
            let [a, b, c, d] = t.dims();
            (t.reshape([a, b * c * d]), Box::new(move |y: Tensor<B, 2>| Act::D4(y.reshape([a, b, c, d]))))
        }
        Act::Tokens(_) | Act::Bundle(_) => {
            return Err(ExecError::Shape(format!("an element-wise layer cannot take token ids or a bundle {dims:?}")))
        }
    };
    Ok(restore(f(flat)))
}

pub(crate) fn stateless<B: Backend>(
    op: &Op,
    index: usize,
    x: Act<B>,
    training: bool,
    key: (u64, u64, u64),
    context: Option<&crate::nn::context::Context>,
) -> Result<Act<B>> {
    match *op {
        Op::Relu => elementwise(x, activation::relu),
        Op::Gelu => elementwise(x, activation::gelu),
        Op::GeluTanh => elementwise(x, gelu_tanh),
        Op::Tanh => elementwise(x, activation::tanh),
        Op::Sigmoid => elementwise(x, activation::sigmoid),
        Op::Dropout { p } => {
            if !training || p == 0.0 {
                return Ok(x);
            }
            // context parallelism: the mask of the whole sequence, as one device draws it,
            // at this member's positions
            let positions = match (&x, context) {
                (Act::D3(t), Some(c)) => {
                    let [_, s, d] = t.dims();
                    Some((c.positions(s), s * c.cp, d))
                }
                _ => None,
            };
            elementwise(x, |t| {
                let [rows, cols] = t.dims();
                let mut rng = Rng::keyed(&[key.0, 20, key.1, key.2, index as u64]);
                let mut draw = || if rng.uniform() < p { 0.0 } else { (1.0 / (1.0 - p)) as f32 };
                let keep: Vec<f32> = match &positions {
                    Some((at, seq, d)) => (0..rows)
                        .flat_map(|_| {
                            let row: Vec<f32> = (0..seq * d).map(|_| draw()).collect();
                            at.iter().flat_map(move |&q| row[q * d..(q + 1) * d].to_vec()).collect::<Vec<_>>()
                        })
                        .collect(),
                    None => (0..rows * cols).map(|_| draw()).collect(),
                };
                let mask = Tensor::<B, 2>::from_data(TensorData::new(keep, [rows, cols]), &t.device());
                t * mask
            })
        }
        Op::Flatten => Ok(match x {
            Act::D2(t) => Act::D2(t),
            Act::D3(t) => {
                let [a, b, c] = t.dims();
                Act::D2(t.reshape([a, b * c]))
            }
            Act::D4(t) => {
                let [a, b, c, d] = t.dims();
                Act::D2(t.reshape([a, b * c * d]))
            }
            Act::Tokens(_) | Act::Bundle(_) => {
                return Err(ExecError::Shape("flatten cannot take token ids or a bundle".into()))
            }
        }),
        Op::MaxPool2d { kernel, stride, padding } => match x {
            Act::D4(t) => Ok(Act::D4(max_pool2d(t, [kernel; 2], [stride; 2], [padding; 2], [1, 1], false))),
            other => Err(ExecError::Shape(format!("maxpool2d needs [batch, C, H, W], got {:?}", other.dims()))),
        },
        // padded zeros count in the average (PyTorch's default)
        Op::AvgPool2d { kernel, stride, padding } => match x {
            Act::D4(t) => Ok(Act::D4(avg_pool2d(t, [kernel; 2], [stride; 2], [padding; 2], true, false))),
            other => Err(ExecError::Shape(format!("avgpool2d needs [batch, C, H, W], got {:?}", other.dims()))),
        },
        Op::AdaptiveAvgPool2d { size } => match x {
            Act::D4(t) => Ok(Act::D4(adaptive_avg_pool2d(t, [size; 2]))),
            other => {
                Err(ExecError::Shape(format!("adaptive_avgpool2d needs [batch, C, H, W], got {:?}", other.dims())))
            }
        },
        Op::SeqPool { how } => match x {
            Act::D3(t) => {
                let [b, _, d] = t.dims();
                Ok(Act::D2(match how {
                    Pooling::First => t.narrow(1, 0, 1).reshape([b, d]),
                    Pooling::Mean => t.mean_dim(1).reshape([b, d]),
                }))
            }
            other => Err(ExecError::Shape(format!("seq_pool needs [batch, seq, d], got {:?}", other.dims()))),
        },
        _ => Err(ExecError::Shape(format!("{} is not a stateless layer", op.name()))),
    }
}

/// The layers of one stage.
#[derive(Module, Debug)]
pub struct StageModel<B: Backend> {
    pub layers: Vec<Layer<B>>,
    /// A graph model's wiring (None: a chain, each layer reading the one before).
    #[module(skip)]
    pub graph: Option<StageGraph>,
}

impl<B: Kernels> StageModel<B> {
    /// Builds layers `range` of the model.
    pub fn new(ops: &[Op], first_index: usize, seed: u64, device: &B::Device) -> Self {
        StageModel {
            layers: ops.iter().enumerate().map(|(i, op)| Layer::new(first_index + i, op, seed, device)).collect(),
            graph: None,
        }
    }

    /// Selective recompute (or flash attention's memory): the transformer blocks of the
    /// layers the plan says so of ([`recomputes_attention_core`]) recompute
    /// their attention core in the backward instead of keeping it.
    pub fn recompute_attention_cores(&mut self, plan: &pipec_plan::Plan) {
        for layer in &mut self.layers {
            if let Layer::Block(b) | Layer::ParallelBlock(b) = layer {
                b.recompute_core = recomputes_attention_core(plan, b.index);
            }
        }
    }

    /// The stage's batch normalisation layers, in order.
    pub fn batch_norms(&self) -> impl Iterator<Item = &BatchNorm<B>> {
        self.layers.iter().filter_map(|l| match l {
            Layer::BatchNorm(bn) => Some(bn),
            _ => None,
        })
    }

    /// How many values the stage's batch statistics (and running statistics) take: per
    /// batch normalisation layer, a mean and a variance per channel.
    pub fn statistics_len(&self) -> usize {
        self.batch_norms().map(|bn| 2 * bn.running_mean.len()).sum()
    }

    /// The running statistics, per batch normalisation layer [mean ‖ variance].
    pub fn running_statistics(&self) -> Vec<f32> {
        self.batch_norms().flat_map(|bn| bn.running_mean.iter().chain(&bn.running_var).copied()).collect()
    }

    /// Replaces the running statistics with `values` (as `running_statistics` lays them out).
    pub fn set_running_statistics(&mut self, values: &[f32]) -> Result<()> {
        self.update_running(values, |_, new| new)
    }

    /// One update of the running statistics toward `mean_stats` (batch statistics averaged
    /// over the microbatches the update covers, laid out as `running_statistics`):
    /// running ← (1 − momentum)·running + momentum·batch.
    pub fn fold_statistics(&mut self, mean_stats: &[f32]) -> Result<()> {
        self.update_running(mean_stats, |old, new| (1.0 - BN_MOMENTUM) * old + BN_MOMENTUM * new)
    }

    /// running ← decay·running + `weighted` (statistics already weighted and summed).
    pub fn fold_weighted(&mut self, decay: f32, weighted: &[f32]) -> Result<()> {
        self.update_running(weighted, |old, new| decay * old + new)
    }

    fn update_running(&mut self, values: &[f32], f: impl Fn(f32, f32) -> f32) -> Result<()> {
        if values.len() != self.statistics_len() {
            return Err(ExecError::Shape(format!(
                "{} batch-normalisation statistics for a stage that keeps {}",
                values.len(),
                self.statistics_len()
            )));
        }
        let mut rest = values;
        for layer in &mut self.layers {
            if let Layer::BatchNorm(bn) = layer {
                let c = bn.running_mean.len();
                let (mean, tail) = rest.split_at(c);
                let (var, tail) = tail.split_at(c);
                for (r, v) in bn.running_mean.iter_mut().zip(mean) {
                    *r = f(*r, *v);
                }
                for (r, v) in bn.running_var.iter_mut().zip(var) {
                    *r = f(*r, *v);
                }
                rest = tail;
            }
        }
        Ok(())
    }

    /// The stage's forward; batch normalisation layers in training append their batch
    /// statistics to `side.stats`, in layer order (and mixtures of experts their losses and
    /// counts, `Collected`).
    pub fn forward(
        &self,
        mut x: Act<B>,
        training: bool,
        mask_key: (u64, u64, u64),
        side: &mut Collected<B>,
    ) -> Result<Act<B>> {
        let Some(g) = &self.graph else {
            for layer in &self.layers {
                x = layer.forward(x, training, mask_key, side)?;
            }
            return Ok(x);
        };
        // every tensor by its source: what arrived, then each layer's output
        let arrived = x.parts();
        if arrived.len() != g.inputs.len() {
            return Err(ExecError::Shape(format!(
                "the stage expects {} input tensor(s), got {}",
                g.inputs.len(),
                arrived.len()
            )));
        }
        let mut env: std::collections::HashMap<Source, Act<B>> = g.inputs.iter().copied().zip(arrived).collect();
        for (k, (layer, operands)) in self.layers.iter().zip(&g.operands).enumerate() {
            let mut args = Vec::with_capacity(operands.len());
            for s in operands {
                args.push(env.get(s).cloned().ok_or(ExecError::Missing("a layer's operand is not on this stage"))?);
            }
            let out = match layer {
                Layer::Stateless(st) if matches!(st.op, Op::Add { .. } | Op::Concat { .. }) => join(&st.op, args)?,
                _ => {
                    let x = args.into_iter().next().ok_or(ExecError::Missing("a layer has no operand"))?;
                    layer.forward(x, training, mask_key, side)?
                }
            };
            env.insert(Source::Layer(g.first + k), out);
        }
        let mut outs = Vec::with_capacity(g.outputs.len());
        for s in &g.outputs {
            outs.push(env.get(s).cloned().ok_or(ExecError::Missing("a tensor the stage sends on is not on it"))?);
        }
        Ok(Act::from_parts(outs))
    }
}

/// `add` (element-wise sum) or `concat` (along the first per-sample dimension).
fn join<B: Backend>(op: &Op, args: Vec<Act<B>>) -> Result<Act<B>> {
    macro_rules! joined {
        ($variant:ident) => {{
            let mut ts = Vec::with_capacity(args.len());
            for a in args {
                match a {
                    Act::$variant(t) => ts.push(t),
                    other => {
                        return Err(ExecError::Shape(format!(
                            "{} operands differ in rank: {:?}",
                            op.name(),
                            other.dims()
                        )))
                    }
                }
            }
            match op {
                Op::Add { .. } => {
                    let mut it = ts.into_iter();
                    let first = it.next().ok_or(ExecError::Missing("a join has no operand"))?;
                    Act::$variant(it.fold(first, |acc, t| acc + t))
                }
                _ => Act::$variant(Tensor::cat(ts, 1)),
            }
        }};
    }
    Ok(match args.first() {
        Some(Act::D2(_)) => joined!(D2),
        Some(Act::D3(_)) => joined!(D3),
        Some(Act::D4(_)) => joined!(D4),
        _ => return Err(ExecError::Shape(format!("{} takes feature tensors", op.name()))),
    })
}

/// Whether layer `layer`'s attention core is recomputed in its backward rather than kept:
/// its stage's selective recompute, or flash attention's memory (nothing of size seq² kept;
/// computed unfused).
pub(crate) fn recomputes_attention_core(plan: &pipec_plan::Plan, layer: usize) -> bool {
    plan.model.attention == pipec_plan::Attention::Flash
        || plan.stages.iter().any(|s| s.selective_recompute && (s.layers[0]..s.layers[1]).contains(&layer))
}
