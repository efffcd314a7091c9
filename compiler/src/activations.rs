//! What a transformer block keeps for its backward, tensor by tensor, and what each recompute
//! policy drops of it.
//!
//! A block's forward is listed as the tensors its backward reads, each with its size per
//! token, its precision, the operation that made it and the recompute module (Megatron-LM's
//! `--recompute-modules`) that drops it. The list is the fused kernels' (Transformer Engine
//! under Megatron-LM, and `torch.compile`'s per-block graphs): a norm fused with the product
//! after it keeps its input and its output (the product's input), a gated MLP's fused
//! activation keeps its input (gate and up outputs) and the down projection its input,
//! FlashAttention its queries, keys, values, output and each row's log-sum-exp. For GPT-3's
//! block with dropout this is Korthikanti et al. 2022's count (34·s·h + 5·a·s² bytes per
//! sample at 16-bit; tested in `cost.rs`).
//!
//! Policies: no recompute keeps everything; recompute by module drops what the named modules
//! make (their inputs stay); op-level selective recompute (torchtitan's) keeps the block's
//! input and the outputs of the saved operations the backward reads; full recompute keeps
//! the block's input only. What a policy drops comes back, one block of one microbatch at a
//! time, while that block's backward runs: its transient peak.

use pipec_plan::model::{BlockDims, MlpKind, ProjectionRole};

use crate::block_cost::Part;
use crate::kernels::Keeps;
use pipec_plan::vocab::{Attention, RecomputeModule, RecomputeOp};

/// The operation that made a kept tensor (op-level selective recompute saves by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Made {
    /// The block's input: every policy keeps it (the recompute's starting point).
    Input,
    /// The block's k-th matrix product (from 0) in its forward as an eager model runs them
    /// (queries, keys and values apart; a gated MLP's gate before its up projection).
    Product(usize),
    /// The fused attention kernel: its output and each row's log-sum-exp.
    Attention,
    /// Anything else (norms, rotary embeddings, activations, softmax, masks, the router's
    /// scores, the dispatch): cheap to recompute.
    Other,
}

/// Where in the block a kept tensor is made: a half's input (the block's, or the residual
/// sum between its attention and its MLP), or inside the attention half or the MLP half
/// (pipec's executor recomputes by halves: `BlockRecompute::executor_halves`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Within {
    Input,
    Attention,
    Mlp,
}

/// One tensor a block keeps for its backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Kept {
    pub name: &'static str,
    /// The recompute modules that drop it (empty: only a full recompute does).
    pub modules: &'static [RecomputeModule],
    pub made: Made,
    /// Bytes per sample on one tensor-parallel rank.
    pub bytes: f64,
    /// Bytes per sample of its gradient while the backward passes it (the MLP's
    /// intermediate tensors and the block's input, whose gradients are alive together at
    /// the block's widest point; 0 for the others, whose gradients are smaller).
    pub gradient: f64,
    /// Whether the backward reads it. A product's output it does not read (the output and
    /// down projections') is listed all the same: op-level recompute keeps what its policy
    /// names whether the backward reads it or not (torchtitan's policy saves every other
    /// `aten.mm` output by its count).
    pub read: bool,
    pub within: Within,
}

/// What a block's list depends on besides the block.
#[derive(Debug, Clone, Copy)]
pub struct BlockContext {
    /// Positions per sample.
    pub s: f64,
    /// Bytes per value of the activations.
    pub p: f64,
    /// Bytes per value a linear layer keeps of its input (FP8 with its scales under FP8
    /// training that keeps them so, else `p`).
    pub linear_input: f64,
    /// The tensor-parallel degree the block is split over (1: not split).
    pub t: f64,
    /// Sequence parallelism: the tensors outside the split products are split too.
    pub sp: bool,
    pub attention: Attention,
    /// Expert parallelism's degree.
    pub ep: usize,
    /// The block's dropout probability (0: no masks, no dropped copies).
    pub dropout: bool,
    /// What the engine's kernels keep beyond the operations' operands.
    pub keeps: Keeps,
}

/// The list being built: the tensors so far and the block's products so far.
struct List {
    tensors: Vec<Kept>,
    products: usize,
    /// Where the tensors being listed are made.
    within: Within,
}

impl List {
    fn keep(&mut self, name: &'static str, modules: &'static [RecomputeModule], made: Made, bytes: f64) {
        self.tensors.push(Kept { name, modules, made, bytes, gradient: 0.0, read: true, within: self.within });
    }

    /// Keeps a tensor whose gradient of `gradient` bytes per sample is alive at the block's
    /// widest point of the backward.
    fn keep_wide(
        &mut self,
        name: &'static str,
        modules: &'static [RecomputeModule],
        made: Made,
        bytes: f64,
        gradient: f64,
    ) {
        self.tensors.push(Kept { name, modules, made, bytes, gradient, read: true, within: self.within });
    }

    /// The next matrix product, whose output the backward does not read, of `bytes` bytes
    /// per sample.
    fn unread_product(&mut self, name: &'static str, bytes: f64) {
        let made = self.product();
        self.tensors.push(Kept { name, modules: &[], made, bytes, gradient: 0.0, read: false, within: self.within });
    }

    /// The next matrix product.
    fn product(&mut self) -> Made {
        self.products += 1;
        Made::Product(self.products - 1)
    }
}

/// The tensors a transformer block keeps for its backward, per sample on one rank.
pub fn block_kept(b: &BlockDims, cx: &BlockContext) -> Vec<Kept> {
    use RecomputeModule::{Layernorm, Mlp, Moe, MoeAct, SharedExperts};
    let BlockContext { s, p, linear_input, t, sp, .. } = *cx;
    let h = b.d as f64;
    // outside the split products: whole per rank, split along the sequence with sequence
    // parallelism; inside them: split over the heads or the MLP's columns
    let seq = |values: f64, bytes: f64| s * values * bytes / if sp { t } else { 1.0 };
    let split = |values: f64, bytes: f64| s * values * bytes / t;
    let mut list = List { tensors: Vec::new(), products: 0, within: Within::Input };
    // the residual's gradient arrives and leaves at the block's input width
    list.keep_wide("block input", &[], Made::Input, seq(h, p), 2.0 * seq(h, p));
    list.within = Within::Attention;
    // a column-split product's input: its sequence share, or the gathered sequence where the
    // engine keeps that (at FP8 where it gathers FP8)
    let column_input = |values: f64| match (cx.keeps.gathered_inputs, cx.keeps.gathered_fp8) {
        (true, true) => s * values,
        (true, false) => s * values * linear_input,
        (false, _) => seq(values, linear_input),
    };
    list.keep("first norm's output", &[Layernorm], Made::Other, column_input(h));
    attention_kept(b, cx, &mut list);
    if cx.dropout {
        list.keep("attention's dropout mask", &[], Made::Other, seq(h, 1.0));
    }
    list.within = Within::Input;
    list.keep("second norm's input", &[], Made::Other, seq(h, p));
    list.within = Within::Mlp;
    list.keep("second norm's output", &[Layernorm], Made::Other, column_input(h));
    // an MLP's kept tensors per token it computes: the up projection's output (gate ‖ up,
    // the activation's input) and the activation's output (the down projection's input)
    let f = b.ff as f64;
    let mlp = |list: &mut List, rows: f64, up: &'static [RecomputeModule], act: &'static [RecomputeModule]| {
        if b.gated {
            let gate = list.product();
            list.keep_wide("gate projection's output", up, gate, split(rows * f, p), split(rows * f, p));
        }
        let made = list.product();
        list.keep_wide("up projection's output", up, made, split(rows * f, p), split(rows * f, p));
        // a composed gate's intermediates: SwiGLU's logistic of the gate and SiLU's output
        // (SiLU = gate · logistic(gate), then · up), GEGLU's GELU output
        let composed = match (cx.keeps.composed_gates, b.mlp) {
            (true, MlpKind::Swiglu) => &["the gate's logistic", "SiLU's output"][..],
            (true, MlpKind::Geglu) => &["GELU's output"][..],
            (false, _) | (true, MlpKind::Gelu | MlpKind::GeluTanh) => &[][..],
        };
        for name in composed {
            list.keep(name, act, Made::Other, split(rows * f, p));
        }
        list.keep_wide("activation's output", act, Made::Other, split(rows * f, linear_input), split(rows * f, p));
        // the down projection's output (whole on every rank before the row-parallel
        // reduction), not read by the backward
        list.unread_product("down projection's output", s * rows * h * p);
    };
    match b.moe {
        None => mlp(&mut list, 1.0, &[Mlp], &[Mlp]),
        Some(m) => {
            let ep = cx.ep.max(1);
            // the router's logits (fp32), scores (fp32) and chosen experts (64-bit), per token
            // on the rank (its sequence share with sequence parallelism)
            let router = list.product();
            let e = m.experts as f64;
            list.keep("router logits", &[Moe], router, seq(e, 4.0));
            list.keep("router scores and choices", &[Moe], Made::Other, seq(4.0 * e + 8.0 * m.top_k as f64, 1.0));
            // per token: the expert-token pairs this rank's experts compute (the busiest
            // device's share of its group's routed pairs under the routing assumption) and
            // the routed pairs of its own tokens, whose outputs the combine weighs
            let computed = m.busiest_device_pairs(s, ep) * ep as f64 / s.max(1.0);
            let routed = m.routed_pairs(s) / s.max(1.0);
            list.keep("dispatched rows", &[Moe], Made::Other, seq(computed * h, linear_input));
            mlp(&mut list, computed, &[Moe], &[MoeAct, Moe]);
            if cx.keeps.weights_in_activation {
                // the activation's output times each pair's weight (fp32, the router's): an
                // input of the activation, kept when the activation alone is recomputed
                list.keep("routed pairs' weights", &[Moe], Made::Other, seq(computed, 4.0));
            } else {
                list.keep("experts' outputs for the combine", &[Moe], Made::Other, seq(routed * h, p));
            }
            if m.shared > 0 {
                mlp(&mut list, m.shared as f64, &[SharedExperts, Moe], &[SharedExperts, Moe]);
            }
        }
    }
    if cx.dropout {
        list.keep("MLP's dropout mask", &[], Made::Other, seq(h, 1.0));
    }
    list.tensors
}

/// The attention's kept tensors: queries, keys and values (multi-head latent attention's
/// latents, and its queries, keys and values from them), the query/key norms' inputs, the
/// core's (the probabilities, or FlashAttention's log-sum-exp) and its output.
fn attention_kept(b: &BlockDims, cx: &BlockContext, list: &mut List) {
    use RecomputeModule::{CoreAttn, MlaUpProj};
    let BlockContext { s, p, linear_input, t, sp, .. } = *cx;
    let seq = |values: f64, bytes: f64| s * values * bytes / if sp { t } else { 1.0 };
    let split = |values: f64, bytes: f64| s * values * bytes / t;
    let (qk, vh, heads, kv) = (b.qk_head as f64, b.v_head as f64, b.heads as f64, b.kv_heads as f64);
    for role in b.projections().iter().map(|p| p.role) {
        match (role, b.mla) {
            (ProjectionRole::Qkv, _) => {
                let q = list.product();
                list.keep("queries", &[], q, split(heads * qk, p));
                let k = list.product();
                list.keep("keys", &[], k, split(kv * qk, p));
                let v = list.product();
                list.keep("values", &[], v, split(kv * vh, p));
            }
            (ProjectionRole::LatentDown, Some(m)) => {
                let made = list.product();
                let values = 2.0 * (m.q_lora + m.kv_lora) as f64 + m.rope_dim as f64;
                list.keep("latents, their norms' outputs and the rotary key", &[], made, seq(values, p));
            }
            (ProjectionRole::Query | ProjectionRole::QueryUp, _) => {
                let made = list.product();
                list.keep("queries", &[MlaUpProj], made, split(heads * qk, p));
            }
            (ProjectionRole::KvUp, _) => {
                let made = list.product();
                list.keep("keys and values", &[MlaUpProj], made, split(heads * (qk + vh), p));
            }
            // the output projection, after the core
            (ProjectionRole::Output | ProjectionRole::LatentDown, _) => {}
        }
    }
    if b.qk_norm {
        list.keep("query and key norms' inputs", &[], Made::Other, split((heads + kv) * qk, p));
    }
    let keys = b.attended(s as usize) as f64;
    match cx.attention {
        // the probabilities (and with dropout their mask and the dropped copy), per query
        // one per key attended
        Attention::Standard => {
            list.keep("attention probabilities", &[CoreAttn], Made::Other, split(heads * keys, p));
            if cx.dropout {
                list.keep("attention dropout mask", &[CoreAttn], Made::Other, split(heads * keys, 1.0));
                list.keep("dropped attention probabilities", &[CoreAttn], Made::Other, split(heads * keys, p));
            }
        }
        Attention::Flash => list.keep("attention log-sum-exp", &[CoreAttn], Made::Attention, split(heads, 4.0)),
    }
    list.keep("attention output", &[], Made::Attention, split(heads * vh, linear_input));
    // the output projection's output (whole on every rank before the row-parallel
    // reduction), not read by the backward
    list.unread_product("output projection's output", s * b.d as f64 * p);
}

/// A recompute policy for a block (`strategy.recompute` on its stage).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Policy {
    /// Keep everything.
    #[default]
    None,
    /// Drop what these modules make.
    Modules(Vec<RecomputeModule>),
    /// Keep the input and the outputs of these operations the backward reads.
    Ops(Vec<RecomputeOp>),
    /// Keep the input only.
    Full,
    /// pipec's executor: keep each half's input; drop everything the `halves` recomputed
    /// make, and with `core` the attention core's tensors (recomputed in its kernel).
    Halves { halves: pipec_plan::plan::Halves, core: bool },
}

impl Policy {
    /// Whether the policy keeps `k`.
    pub fn keeps(&self, k: &Kept) -> bool {
        if !k.read && !matches!(self, Policy::Ops(_)) {
            return false;
        }
        match self {
            Policy::None => true,
            Policy::Modules(modules) => !k.modules.iter().any(|m| modules.contains(m)),
            Policy::Ops(ops) => match k.made {
                Made::Input => true,
                Made::Product(i) => {
                    ops.contains(&RecomputeOp::Matmul) || (ops.contains(&RecomputeOp::AlternateMatmul) && i % 2 == 0)
                }
                Made::Attention => ops.contains(&RecomputeOp::Attention),
                Made::Other => false,
            },
            Policy::Full => k.made == Made::Input,
            Policy::Halves { halves, core } => match k.within {
                Within::Input => true,
                Within::Attention => !(halves.attention || *core && k.modules.contains(&RecomputeModule::CoreAttn)),
                Within::Mlp => !halves.mlp,
            },
        }
    }

    /// Bytes per sample the policy keeps of `list`, and the bytes it drops (what comes back
    /// while the block's backward runs).
    pub fn split(&self, list: &[Kept]) -> (f64, f64) {
        list.iter().fold((0.0, 0.0), |(kept, dropped), k| {
            if self.keeps(k) {
                (kept + k.bytes, dropped)
            } else if k.read {
                (kept, dropped + k.bytes)
            } else {
                (kept, dropped)
            }
        })
    }
}

/// Seconds of a block's forward that `policy` runs again in its backward: the parts of the
/// recomputed modules, the forward but its kept products (and the attention, if kept), or
/// the whole forward. `parts` and `products` are the forward's seconds by part and by
/// product (`block_cost`).
pub fn recompute_seconds(policy: &Policy, forward: f64, parts: &[f64; Part::COUNT], products: &[f64]) -> f64 {
    match policy {
        Policy::None => 0.0,
        Policy::Modules(modules) => {
            let mut covered: Vec<Part> = modules.iter().flat_map(|m| Part::of_module(*m).iter().copied()).collect();
            covered.sort_by_key(|p| *p as usize);
            covered.dedup();
            covered.iter().map(|p| parts[*p as usize]).sum()
        }
        Policy::Ops(ops) => {
            let kept_products: f64 = products
                .iter()
                .enumerate()
                .filter(|&(i, _)| {
                    ops.contains(&RecomputeOp::Matmul) || (ops.contains(&RecomputeOp::AlternateMatmul) && i % 2 == 0)
                })
                .map(|(_, s)| s)
                .sum();
            let attention = if ops.contains(&RecomputeOp::Attention) { parts[Part::Core as usize] } else { 0.0 };
            (forward - kept_products - attention).max(0.0)
        }
        Policy::Full => forward,
        Policy::Halves { halves, core } => {
            // the norms split between the halves (each runs one of the two)
            let of =
                |ps: &[Part]| ps.iter().map(|p| parts[*p as usize]).sum::<f64>() + 0.5 * parts[Part::Norms as usize];
            let attention = of(&[Part::AttentionProducts, Part::LatentUp, Part::Core, Part::Output]);
            let mlp = of(&[Part::Mlp, Part::Routing, Part::Experts, Part::ExpertsActivation, Part::Shared]);
            let first = match (halves.attention, *core) {
                (true, _) => attention,
                (false, true) => parts[Part::Core as usize],
                (false, false) => 0.0,
            };
            first + if halves.mlp { mlp } else { 0.0 }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_plan::engine::performance::KernelFamily;
    use pipec_plan::model::Op;

    fn cx(t: f64, sp: bool, attention: Attention, dropout: bool) -> BlockContext {
        BlockContext { s: 512.0, p: 2.0, linear_input: 2.0, t, sp, attention, ep: 1, dropout, keeps: Keeps::default() }
    }

    fn total(list: &[Kept]) -> f64 {
        list.iter().filter(|k| k.read).map(|k| k.bytes).sum()
    }

    #[test]
    fn gpt3s_block_keeps_korthikantis_count() {
        // s = 512, h = 1024, a = 16, 16-bit, dropout: 34·s·h + 5·a·s² bytes per sample
        let b = Op::block(1024, 16, 4096, false).block_dims().expect("block");
        let (sh, as2) = (512.0 * 1024.0, 16.0 * 512.0 * 512.0);
        assert_eq!(total(&block_kept(&b, &cx(1.0, false, Attention::Standard, true))), 34.0 * sh + 5.0 * as2);
        // tensor parallelism t: (10 + 24/t)·s·h + 5·a·s²/t; with sequence parallelism all over t
        let t = 8.0;
        assert_eq!(
            total(&block_kept(&b, &cx(t, false, Attention::Standard, true))),
            (10.0 + 24.0 / t) * sh + 5.0 * as2 / t
        );
        assert_eq!(total(&block_kept(&b, &cx(t, true, Attention::Standard, true))), (34.0 * sh + 5.0 * as2) / t);
        // selective recompute (the core) drops the 5·a·s²
        let list = block_kept(&b, &cx(t, true, Attention::Standard, true));
        let (kept, dropped) = Policy::Modules(vec![RecomputeModule::CoreAttn]).split(&list);
        assert_eq!((kept, dropped), (34.0 * sh / t, 5.0 * as2 / t));
    }

    #[test]
    fn under_sequence_parallelism_pytorch_keeps_the_gathered_inputs_of_the_column_products() {
        // GPT-3's block, t = 8 with sequence parallelism: Megatron-LM keeps each norm's output
        // as its sequence share (and gathers it again for the weight gradients); PyTorch's
        // autograd keeps the gathered input, the whole sequence, at FP8 under torchao's
        // Float8 tensor parallelism
        let b = Op::block(1024, 16, 4096, false).block_dims().expect("block");
        let (t, sh) = (8.0, 512.0 * 1024.0);
        let of = |gathered_inputs: bool, gathered_fp8: bool| {
            let keeps = Keeps { gathered_inputs, gathered_fp8, ..Keeps::default() };
            let list = block_kept(&b, &BlockContext { keeps, ..cx(t, true, Attention::Flash, false) });
            let norms: Vec<f64> = list.iter().filter(|k| k.name.ends_with("norm's output")).map(|k| k.bytes).collect();
            (total(&list), norms)
        };
        let (megatron, shares) = of(false, false);
        let (pytorch, gathered) = of(true, false);
        let (float8, fp8) = of(true, true);
        assert_eq!(shares, vec![2.0 * sh / t; 2]);
        assert_eq!(gathered, vec![2.0 * sh; 2]);
        assert_eq!(fp8, vec![sh; 2]);
        assert_eq!(pytorch - megatron, 2.0 * 2.0 * sh * (1.0 - 1.0 / t));
        assert_eq!(pytorch - float8, 2.0 * sh);
        // without sequence parallelism nothing changes: every rank holds the whole input
        let whole = |keeps| total(&block_kept(&b, &BlockContext { keeps, ..cx(t, false, Attention::Flash, false) }));
        assert_eq!(whole(Keeps { gathered_inputs: true, ..Keeps::default() }), whole(Keeps::default()));
    }

    #[test]
    fn weights_in_the_activation_keep_one_fp32_weight_a_pair_in_place_of_the_experts_outputs() {
        // Qwen3-30B-A3B's block (128 experts of 768, 8 a token), one rank: a combine that
        // weighs keeps the 8 routed outputs of 2048 a token (bf16); Megatron-Core's weighted
        // activation keeps 8 fp32 weights instead, and drops them with the whole MoE
        let mut op = Op::llama_block(2048, 32, 4, 768);
        if let Op::TransformerBlock { moe, .. } = &mut op {
            *moe = Some(pipec_plan::model::Moe::new(128, 8));
        }
        let b = op.block_dims().expect("block");
        let s = 4096.0;
        let of = |weights_in_activation| {
            let keeps = Keeps { weights_in_activation, ..Keeps::default() };
            block_kept(&b, &BlockContext { s, keeps, ..cx(1.0, false, Attention::Flash, false) })
        };
        let (combine, weighed) = (of(false), of(true));
        assert_eq!(total(&combine) - total(&weighed), s * 8.0 * (2048.0 * 2.0 - 4.0));
        assert!(weighed.iter().all(|k| k.name != "experts' outputs for the combine"));
        let weights = weighed.iter().find(|k| k.name == "routed pairs' weights").expect("kept");
        assert_eq!((weights.bytes, weights.modules), (s * 8.0 * 4.0, &[RecomputeModule::Moe][..]));
        // recomputing the activation alone keeps the weights: they are its input
        let (kept, _) = Policy::Modules(vec![RecomputeModule::MoeAct]).split(&weighed);
        let (kept_moe, _) = Policy::Modules(vec![RecomputeModule::Moe]).split(&weighed);
        assert!(kept - kept_moe >= s * 8.0 * 4.0);
        // the engines: Megatron-LM weighs in the activation, the others in the combine
        assert!(Keeps::of(KernelFamily::MegatronTe).weights_in_activation);
        for family in
            [KernelFamily::Pipec, KernelFamily::TorchEager, KernelFamily::TorchCompiled, KernelFamily::Deepspeed]
        {
            assert!(!Keeps::of(family).weights_in_activation, "{family:?}");
        }
    }

    #[test]
    fn torchtitans_op_policy_keeps_the_alternate_products_and_the_attention() {
        // Llama 3.1 8B's block, flash attention, bf16: its input, the query and value
        // products (first and third), the attention's output and log-sum-exp, the gate
        // (fifth product) and the down projection (seventh: kept by its count though the
        // backward does not read it); the keys, output and up projections and every norm
        // and activation are recomputed
        let b = Op::llama_block(4096, 32, 8, 14336).block_dims().expect("block");
        let list = block_kept(&b, &BlockContext { s: 8192.0, ..cx(1.0, false, Attention::Flash, false) });
        let policy = Policy::Ops(vec![RecomputeOp::AlternateMatmul, RecomputeOp::Attention]);
        let (kept, _) = policy.split(&list);
        let per_token = 2.0 * (4096.0 + 4096.0 + 1024.0 + 4096.0 + 14336.0 + 4096.0) + 32.0 * 4.0;
        assert_eq!(kept, 8192.0 * per_token);
        // a full recompute keeps the input alone; no recompute everything
        assert_eq!(Policy::Full.split(&list).0, 8192.0 * 2.0 * 4096.0);
        assert_eq!(Policy::None.split(&list).0, total(&list));
    }

    #[test]
    fn pipecs_executor_keeps_the_inputs_of_the_halves_it_recomputes() {
        // Llama 3.1 8B's block, standard attention, bf16, 8192 positions: the MLP half run
        // again keeps its input (the residual sum, 2·h a token) and the attention half's
        // tensors; both halves keep the two halves' inputs alone
        let b = Op::llama_block(4096, 32, 8, 14336).block_dims().expect("block");
        let s = 8192.0;
        let list = block_kept(&b, &BlockContext { s, ..cx(1.0, false, Attention::Standard, false) });
        let halves = |attention, mlp| pipec_plan::plan::Halves { attention, mlp };
        let inputs = 2.0 * s * 2.0 * 4096.0;
        assert_eq!(Policy::Halves { halves: halves(true, true), core: false }.split(&list).0, inputs);
        let attention_half: f64 =
            list.iter().filter(|k| k.read && k.within == Within::Attention).map(|k| k.bytes).sum();
        let mlp_half: f64 = list.iter().filter(|k| k.read && k.within == Within::Mlp).map(|k| k.bytes).sum();
        assert_eq!(Policy::Halves { halves: halves(false, true), core: false }.split(&list).0, inputs + attention_half);
        assert_eq!(Policy::Halves { halves: halves(true, false), core: false }.split(&list).0, inputs + mlp_half);
        // the MLP half holds the gate, up and activation outputs (3·ff a token, bf16)
        assert_eq!(mlp_half, s * 2.0 * (4096.0 + 3.0 * 14336.0));
        // the core recomputed in the kernel drops the probabilities from the attention half
        let (with_core, _) = Policy::Halves { halves: halves(false, true), core: true }.split(&list);
        let probabilities = list.iter().find(|k| k.name == "attention probabilities").expect("kept").bytes;
        assert_eq!(with_core, inputs + attention_half - probabilities);
        // each policy of modules holds at least what the halves the executor runs again
        // hold: a half runs again wherever the policy drops anything of it
        use RecomputeModule::*;
        for modules in [vec![Mlp], vec![Layernorm], vec![CoreAttn, Mlp], vec![MlaUpProj], vec![CoreAttn, Layernorm]] {
            let policy = pipec_plan::plan::BlockRecompute { modules: modules.clone(), ..Default::default() };
            let pipec = Policy::Halves { halves: policy.executor_halves(), core: policy.recomputes_core() };
            let (megatron, _) = Policy::Modules(modules.clone()).split(&list);
            assert!(pipec.split(&list).0 <= megatron, "{modules:?}");
        }
        // and runs at least as much again
        let mut parts = [0.0; Part::COUNT];
        for (i, p) in parts.iter_mut().enumerate() {
            *p = (i + 1) as f64;
        }
        let forward: f64 = parts.iter().sum();
        for modules in [vec![Mlp], vec![Layernorm], vec![CoreAttn], vec![MoeAct], vec![CoreAttn, Layernorm]] {
            let policy = pipec_plan::plan::BlockRecompute { modules: modules.clone(), ..Default::default() };
            let pipec = Policy::Halves { halves: policy.executor_halves(), core: policy.recomputes_core() };
            let again = recompute_seconds(&pipec, forward, &parts, &[]);
            assert!(again >= recompute_seconds(&Policy::Modules(modules.clone()), forward, &parts, &[]), "{modules:?}");
            assert!(again <= forward, "{modules:?}");
        }
    }
}
