//! A transformer block's kernels on one rank, forward and backward, as Megatron-LM's block
//! runs them: layer norm, the attention's projections (one fused query-key-value product, or
//! multi-head latent attention's down and up products), the attention core (scores,
//! softmax, dropout, weighted sum; or one fused FlashAttention kernel), the output
//! projection, bias-dropout-add, layer norm, the MLP (or a mixture of experts: router,
//! dispatch, experts, combine, shared experts), bias-dropout-add. Each kernel is priced on
//! the resource it is bound by (`DeviceModel::matrix_time`, `vector_time`). Under FP8
//! training the blocks' products run at the device's FP8 rate, each operand cast to FP8 by
//! a memory-bound kernel first (Transformer Engine's and torchao's recipes).
//!
//! Beside the passes' seconds this prices what recompute runs again: the forward's seconds
//! per [`Part`] (recompute by module) and per product in an eager model's order (op-level
//! recompute, `activations::Made::Product`).

use pipec_plan::device::Function;
use pipec_plan::engine::performance::AttentionPass;
use pipec_plan::model::{BlockDims, MlpKind, Projection, ProjectionRole, ProjectionSplit, Router};
use pipec_plan::vocab::{Attention, RecomputeModule};

use crate::kernels::{CostContext, Kernels, Product};

/// A part of a block's forward, as recompute by module runs it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The two norms (and the query/key and latent norms).
    Norms,
    /// The attention's products before the core other than multi-head latent attention's up
    /// projections.
    AttentionProducts,
    /// Multi-head latent attention's up projections.
    LatentUp,
    /// The attention core.
    Core,
    /// The output projection and the residual adds.
    Output,
    /// A dense MLP.
    Mlp,
    /// The router, the dispatch and the combine.
    Routing,
    /// The routed experts' products.
    Experts,
    /// The routed experts' activation.
    ExpertsActivation,
    /// The shared experts.
    Shared,
}

impl Part {
    pub const COUNT: usize = 10;

    /// The parts a recompute module runs again.
    pub fn of_module(module: RecomputeModule) -> &'static [Part] {
        match module {
            RecomputeModule::CoreAttn => &[Part::Core],
            RecomputeModule::Mlp => &[Part::Mlp],
            RecomputeModule::MoeAct => &[Part::ExpertsActivation],
            RecomputeModule::Layernorm => &[Part::Norms],
            RecomputeModule::MlaUpProj => &[Part::LatentUp],
            RecomputeModule::Moe => &[Part::Routing, Part::Experts, Part::ExpertsActivation, Part::Shared],
            RecomputeModule::SharedExperts => &[Part::Shared],
        }
    }
}

/// A block's priced passes on one rank.
pub struct BlockPriced {
    pub forward: f64,
    pub backward: f64,
    /// The part of `backward` that is weight gradients.
    pub backward_weights: f64,
    /// The standard attention core's forward again (selective recompute, Korthikanti et al.).
    pub selective: f64,
    /// The attention core's share of the forward and of the backward.
    pub core: [f64; 2],
    /// The forward's seconds per part ([`Part`] as index).
    pub parts: [f64; Part::COUNT],
    /// The forward's seconds of each product in an eager model's order.
    pub products: Vec<f64>,
}

/// The forward, with the seconds of each part and product recorded as they are priced.
struct Forward<'a> {
    k: Kernels<'a>,
    parts: [f64; Part::COUNT],
    products: Vec<f64>,
}

impl<'a> Forward<'a> {
    /// Runs `kernels` as part `part`.
    fn part(&mut self, part: Part, kernels: impl FnOnce(&mut Kernels<'a>)) {
        let before = self.k.seconds;
        kernels(&mut self.k);
        self.parts[part as usize] += self.k.seconds - before;
    }

    /// Runs a product of `part`, recording its seconds as the next products of an eager
    /// model in the given shares (a fused product of several eager ones: by their widths).
    fn product(&mut self, part: Part, product: Product, shares: &[f64], (fp8, steps): (bool, usize)) {
        let before = self.k.seconds;
        self.part(part, |k| k.product_in_steps(product, fp8, steps));
        let seconds = self.k.seconds - before;
        let whole: f64 = shares.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        self.products.extend(shares.iter().map(|s| seconds * s / whole));
    }
}

/// Prices block `b` of `s` positions per sample on one of `t` ranks, `samples` samples.
pub fn price_block(b: &BlockDims, s: f64, t: f64, samples: f64, cx: &CostContext<'_>) -> BlockPriced {
    let p = cx.precision.bytes() as f64;
    let fp8 = cx.fp8.is_some();
    let new = || Kernels::of(cx, p);
    let mut fwd = Forward { k: new(), parts: [0.0; Part::COUNT], products: Vec::new() };
    let (mut bwd, mut sel) = (new(), new());
    let (h, a) = (b.d as f64, b.heads as f64);
    let e = samples * s * h;
    let el = if cx.sequence_parallel { e / t } else { e };
    // one rank's heads' queries, keys, values and outputs (values per microbatch)
    let rows = samples * s / t;
    let (qk, vh) = (b.qk_head as f64, b.v_head as f64);
    let (q_values, k_values) = (rows * a * qk, rows * b.kv_heads as f64 * qk);
    let (v_values, o_values) = (rows * b.kv_heads as f64 * vh, rows * a * vh);
    let eatt = samples * (a / t) * s * s;
    let (score_flops, sum_flops) = (2.0 * samples * s * s * (a / t) * qk, 2.0 * samples * s * s * (a / t) * vh);
    // the attention core's forward (standard attention): scores, softmax (with the causal
    // mask), dropout, weighted sum
    let core = |k: &mut Kernels<'_>| {
        k.matrix(score_flops, q_values + k_values + eatt);
        k.function(Function::Exp, eatt, 5.0 * eatt, 2.0 * eatt);
        k.vector(2.0 * eatt, 2.0 * eatt, eatt);
        k.matrix(sum_flops, eatt + v_values + o_values);
    };
    // a split product under ring-exchange overlap runs in `t` steps
    let ring_steps = if cx.tp_overlap.is_some() { t as usize } else { 1 };
    let overlap = cx.tp_overlap.unwrap_or_default();
    // a split product's (input, weight) gradients in steps: a row-split one's input
    // gradient always (its output gradient's all-gather), a column-split one's input
    // gradient (its reduce-scatter) and a row-split one's weight gradient where the engine
    // runs them so
    let grad_steps = |split: ProjectionSplit| match split {
        ProjectionSplit::Replicated => (1, 1),
        ProjectionSplit::Column => (if overlap.column_input_grad { ring_steps } else { 1 }, 1),
        ProjectionSplit::Row => (ring_steps, if overlap.row_weight_grad { ring_steps } else { 1 }),
    };
    let steps = |p: &Projection| if p.split == ProjectionSplit::Replicated { 1 } else { ring_steps };
    // the attention's products, (FLOPs, values) each on one rank: a column-split one's
    // output and a row-split one's input are the rank's share, a duplicated one (multi-head
    // latent attention's down projections) runs whole on every rank
    let priced = |p: &Projection| {
        let (i, o) = (p.input as f64, p.output as f64);
        let split = if p.split == ProjectionSplit::Replicated { 1.0 } else { t };
        Product {
            flops: 2.0 * samples * s * i * o / split,
            input: samples * s * i / if p.split == ProjectionSplit::Row { t } else { 1.0 },
            weights: i * o / split,
            output: samples * s * o / if p.split == ProjectionSplit::Column { t } else { 1.0 },
        }
    };
    let projections = b.projections();
    // the element-wise work around the projections: query/key norms over the rank's
    // queries and keys, multi-head latent attention's latent norms (whole per rank)
    let head_norms = if b.qk_norm { q_values + k_values } else { 0.0 };
    let latents = b.mla.map_or(0.0, |m| samples * s * (m.q_lora + m.kv_lora) as f64);
    let tokens = samples * s;
    let mut mlp = Mlps::of(b, tokens, (cx.ep.max(1), cx.whole_experts), t, (cx.grouped_experts, cx.experts_efficiency));
    if b.moe.is_none() {
        mlp.steps = ring_steps;
        mlp.grad_steps = [grad_steps(ProjectionSplit::Column), grad_steps(ProjectionSplit::Row)];
    }
    // forward: LN, the attention's products, attention, projection, bias-dropout-add, LN,
    // MLP, add
    fwd.part(Part::Norms, |k| k.vector(5.0 * el, 2.0 * el, 0.0));
    for pr in projections.iter().filter(|p| p.role != ProjectionRole::Output) {
        let part = if matches!(pr.role, ProjectionRole::QueryUp | ProjectionRole::KvUp) {
            Part::LatentUp
        } else {
            Part::AttentionProducts
        };
        // an eager model's products: queries, keys and values apart
        let shares: Vec<f64> = match pr.role {
            ProjectionRole::Qkv => vec![b.q_width as f64, b.kv_width as f64, b.kv_width as f64],
            _ => vec![1.0],
        };
        fwd.product(part, priced(pr), &shares, (fp8, steps(pr)));
    }
    fwd.part(Part::Norms, |k| {
        for norms in [head_norms, latents].into_iter().filter(|&n| n > 0.0) {
            k.vector(4.0 * norms, 2.0 * norms, 0.0);
        }
    });
    // FlashAttention skips what the causal mask (and a sliding window) hides (Dao 2023):
    // the keys it computes over per query
    let keys = b.computed_keys(s as usize);
    let flash_flops = 2.0 * samples * s * keys * (a / t) * (qk + vh);
    let flash_values = q_values + k_values + v_values + o_values;
    // where the device measured the executor's attention (`pipec calibrate` on the CPU),
    // its fitted passes over this rank's heads replace the kernels
    let measured = cx.device.attention;
    let bh = samples * a / t;
    let fused = [AttentionPass::Forward, AttentionPass::Backward].map(|pass| cx.attention_share(pass, b.causal, s));
    fwd.part(Part::Core, |k| match (cx.attention_kernel(), measured) {
        (Attention::Standard, Some(m)) => k.seconds += m.forward.seconds(bh, s, qk),
        (Attention::Standard, None) => core(k),
        (Attention::Flash, _) => k.fused_attention(flash_flops, flash_values, fused[0]),
    });
    let core_forward = fwd.parts[Part::Core as usize];
    for pr in projections.iter().filter(|p| p.role == ProjectionRole::Output) {
        fwd.product(Part::Output, priced(pr), &[1.0], (fp8, steps(pr)));
    }
    fwd.part(Part::Output, |k| k.vector(3.0 * el, 3.0 * el, el));
    fwd.part(Part::Norms, |k| k.vector(5.0 * el, 2.0 * el, 0.0));
    mlp.forward(&mut fwd, fp8);
    fwd.part(Part::Output, |k| k.vector(3.0 * el, 3.0 * el, el));
    // backward: every product twice (input and weight gradients), the element-wise kernels
    // reading their input and the incoming gradient
    for pr in &projections {
        bwd.gradients_in_steps(priced(pr), fp8, grad_steps(pr.split));
    }
    for norms in [head_norms, latents].into_iter().filter(|&n| n > 0.0) {
        bwd.vector(8.0 * norms, 3.0 * norms, 0.0);
    }
    mlp.backward(&mut bwd, fp8);
    let before = bwd.seconds;
    match (cx.attention_kernel(), measured) {
        (Attention::Standard, Some(m)) => {
            bwd.seconds += m.backward.seconds(bh, s, qk);
            sel.seconds += m.forward.seconds(bh, s, qk);
        }
        (Attention::Standard, None) => {
            // the scores' product's two gradients and the weighted sum's two
            bwd.matrix(score_flops, eatt + q_values + k_values);
            bwd.matrix(score_flops, eatt + q_values + k_values);
            bwd.matrix(sum_flops, eatt + v_values + o_values);
            bwd.matrix(sum_flops, eatt + v_values + o_values);
            bwd.vector(4.0 * eatt, 3.0 * eatt, 0.0);
            bwd.vector(eatt, 2.0 * eatt, eatt);
            core(&mut sel);
        }
        // the fused backward recomputes the scores: 2.5× the forward's products (Dao et al.
        // 2022)
        (Attention::Flash, _) => bwd.fused_attention(2.5 * flash_flops, 2.0 * flash_values, fused[1]),
    }
    let core_backward = bwd.seconds - before;
    bwd.vector(8.0 * el, 3.0 * el, 0.0);
    bwd.vector(8.0 * el, 3.0 * el, 0.0);
    mlp.activation_backward(&mut bwd);
    bwd.vector(2.0 * el, 2.0 * el, el);
    bwd.vector(2.0 * el, 2.0 * el, el);
    BlockPriced {
        forward: fwd.k.seconds,
        backward: bwd.seconds,
        backward_weights: bwd.weights,
        selective: sel.seconds,
        core: [core_forward, core_backward],
        parts: fwd.parts,
        products: fwd.products,
    }
}

/// A block's MLP work on one rank: its products — an up and a down product per MLP (a
/// mixture of experts: per expert this rank holds, the routed pairs it takes from every
/// member of its expert-parallel group under the routing assumption, the busiest expert
/// among them; then the shared experts) — its activation, and a mixture of experts'
/// routing.
struct Mlps<'a> {
    b: &'a BlockDims,
    /// Per MLP: its up and down products, whether it is a shared expert's.
    products: Vec<([Product; 2], bool)>,
    /// The activation's elements of the routed experts (or the dense MLP) and of the shared
    /// experts, on this rank.
    activation: [f64; 2],
    tokens: f64,
    /// The routed expert-token pairs this rank's tokens make (dispatched, combined).
    routed: f64,
    /// The routed experts' products' efficiency against dense products of their size (the
    /// engine's fitted `experts` constant; 1 where none is fitted).
    routed_efficiency: f64,
    /// The routed experts run one GEMM per expert (not grouped): under FP8 at the training
    /// precision's rate ([`Mlps::run`]).
    per_expert: bool,
    /// The steps a dense MLP's split products run in (tensor parallelism's ring-exchange
    /// overlap; 1 without), and their (input, weight) gradients' (up, then down).
    steps: usize,
    grad_steps: [(usize, usize); 2],
}

/// The experts' up and down products as one grouped product each: their FLOPs and values
/// summed.
fn group_products(experts: &[[Product; 2]]) -> [Product; 2] {
    let sum = |i: usize| {
        experts.iter().fold(Product { flops: 0.0, input: 0.0, weights: 0.0, output: 0.0 }, |a, p| Product {
            flops: a.flops + p[i].flops,
            input: a.input + p[i].input,
            weights: a.weights + p[i].weights,
            output: a.output + p[i].output,
        })
    };
    [sum(0), sum(1)]
}

impl<'a> Mlps<'a> {
    /// `(grouped, efficiency)`: whether the rank's routed experts run as one grouped kernel
    /// per projection, priced at the size of the group (torchtitan's `torch._grouped_mm`),
    /// or as one kernel per expert, each at its own size (Transformer Engine's grouped
    /// linear on Hopper, one cuBLAS GEMM per expert: `KernelFamily::grouped_expert_gemm`);
    /// and the share of a dense FP8 product's speed the routed FP8 products run at (the
    /// engine's fitted `experts` constant; 1 where none is fitted).
    /// `ep`: the expert-parallel replicas, and whether each routed expert is whole on a
    /// device (`etp: 1`: the rank's sequence share of the tokens dispatched over the group's
    /// ep · t devices) rather than split over the `t` ranks.
    fn of(
        b: &'a BlockDims,
        tokens: f64,
        (ep, whole): (usize, bool),
        t: f64,
        (grouped, efficiency): (bool, f64),
    ) -> Mlps<'a> {
        let (h, f, up) = (b.d as f64, b.ff as f64, b.up_width as f64);
        let split = |rows: f64, t: f64| {
            [
                Product { flops: 2.0 * rows * h * up / t, input: rows * h, weights: h * up / t, output: rows * up / t },
                Product { flops: 2.0 * rows * f * h / t, input: rows * f / t, weights: f * h / t, output: rows * h },
            ]
        };
        let mlp = |rows: f64| split(rows, t);
        let (products, activation, routed) = match b.moe {
            Some(m) => {
                let (routed_tokens, ep, et) =
                    if whole && t > 1.0 { (tokens / t, ep * t as usize, 1.0) } else { (tokens, ep, t) };
                let (busiest, other) = m.expert_loads(routed_tokens);
                let local = (m.experts / ep).max(1);
                let routed: Vec<[Product; 2]> = std::iter::once(split(busiest * ep as f64, et))
                    .chain(std::iter::repeat_n(split(other * ep as f64, et), local - 1))
                    .collect();
                let routed = if grouped { vec![group_products(&routed)] } else { routed };
                let products = routed
                    .into_iter()
                    .map(|p| (p, false))
                    .chain(std::iter::repeat_n((mlp(tokens), true), m.shared))
                    .collect();
                let routed_pairs = m.busiest_device_pairs(routed_tokens, ep) * ep as f64;
                (products, [routed_pairs * f / et, tokens * m.shared as f64 * f / t], m.routed_pairs(tokens))
            }
            None => (vec![(mlp(tokens), false)], [tokens * f / t, 0.0], 0.0),
        };
        let routed_efficiency = if b.moe.is_some() { efficiency } else { 1.0 };
        let per_expert = b.moe.is_some() && !grouped;
        Mlps {
            b,
            products,
            activation,
            tokens,
            routed,
            routed_efficiency,
            per_expert,
            steps: 1,
            grad_steps: [(1, 1); 2],
        }
    }

    /// Runs an MLP's products `kernels` as the engine runs them: the routed experts' at the
    /// engine's fitted constant of dense products of their size (1 for the shared experts
    /// and the dense MLP), and where they run one GEMM per expert, their FP8 products at the
    /// training precision's rate. Transformer Engine's grouped linear on Hopper quantizes
    /// each expert's rows on their own and runs each expert's FP8 GEMM of a few thousand
    /// rows (`KernelFamily::grouped_expert_gemm`); Megatron-Bridge's FP8 mixture-of-experts
    /// calibration rows fit them at 0.43 of the FP8 rate, 0.86 of the bf16 one: no faster
    /// than bf16 (docs/benchmarks.md, "Steps"). So the one constant holds for their bf16
    /// products too, which were priced as dense ones before and ran too fast on every
    /// held-out bf16 mixture-of-experts row.
    fn run(&self, k: &mut Kernels<'_>, shared: bool, fp8: bool, kernels: impl FnOnce(&mut Kernels<'_>)) {
        if shared {
            return kernels(k);
        }
        let efficiency = self.routed_efficiency;
        if fp8 && self.per_expert {
            k.at_training_rate(|k| k.at_efficiency(efficiency, kernels));
        } else {
            k.at_efficiency(efficiency, kernels);
        }
    }

    fn function(&self) -> Function {
        match self.b.mlp {
            MlpKind::Gelu => Function::Gelu,
            MlpKind::GeluTanh => Function::GeluTanh,
            MlpKind::Geglu => Function::GeluGated,
            MlpKind::Swiglu => Function::SiluGated,
        }
    }

    /// The activation's FLOPs and values over `elements` (a gated unit: the gate's
    /// activation times the up projection).
    fn activation_work(&self, elements: f64) -> (f64, f64) {
        if self.b.gated {
            (12.0 * elements, 3.0 * elements)
        } else {
            (10.0 * elements, 2.0 * elements)
        }
    }

    /// A mixture of experts' routing: the router's product, its scores (softmax or sigmoid)
    /// and top-k choice over fp32 logits, the dispatch (a gather of each routed pair's
    /// input) and the combine (the weighted sum back to each token).
    fn routing(&self, k: &mut Kernels<'_>, backward: bool) {
        let Some(m) = self.b.moe else { return };
        let (h, ex, tokens, routed) = (self.b.d as f64, m.experts as f64, self.tokens, self.routed);
        let fp32 = 4.0 / k.p;
        let passes = if backward { 2 } else { 1 };
        for _ in 0..passes {
            k.matrix(2.0 * tokens * h * ex, tokens * h + h * ex + tokens * ex * fp32);
        }
        let scores = match m.router {
            Router::Softmax => Function::Exp,
            Router::Sigmoid => Function::Silu,
        };
        k.function(scores, tokens * ex, 6.0 * tokens * ex, 3.0 * tokens * ex * fp32);
        k.vector(0.0, 2.0 * routed * h, 0.0);
        k.vector(2.0 * routed * h, 2.0 * routed * h + tokens * h, 0.0);
    }

    /// The forward: the routing, then per group of MLPs (the routed experts or the dense
    /// MLP, then the shared experts) their up products, activation and down products, each
    /// MLP its own kernels; an eager model's products recorded as the router, the gate, the
    /// up and the down projection.
    fn forward(&self, fwd: &mut Forward<'_>, fp8: bool) {
        let moe = self.b.moe.is_some();
        if moe {
            let before = fwd.k.seconds;
            fwd.part(Part::Routing, |k| self.routing(k, false));
            fwd.products.push(fwd.k.seconds - before);
        }
        let part = |shared: bool| match (moe, shared) {
            (false, _) => Part::Mlp,
            (true, false) => Part::Experts,
            (true, true) => Part::Shared,
        };
        let up_shares: &[f64] = if self.b.gated { &[1.0, 1.0] } else { &[1.0] };
        for shared in [false, true] {
            let group: Vec<&[Product; 2]> =
                self.products.iter().filter(|(_, s)| *s == shared).map(|(p, _)| p).collect();
            if group.is_empty() {
                continue;
            }
            let before = fwd.k.seconds;
            for pair in &group {
                fwd.part(part(shared), |k| self.run(k, shared, fp8, |k| k.product_in_steps(pair[0], fp8, self.steps)));
            }
            let up_seconds = fwd.k.seconds - before;
            let whole: f64 = up_shares.iter().sum();
            fwd.products.extend(up_shares.iter().map(|s| up_seconds * s / whole));
            let elements = self.activation[usize::from(shared)];
            let (flops, values) = self.activation_work(elements);
            let act_part = if moe && !shared { Part::ExpertsActivation } else { part(shared) };
            fwd.part(act_part, |k| k.function(self.function(), elements, flops, values));
            let before = fwd.k.seconds;
            for pair in &group {
                fwd.part(part(shared), |k| self.run(k, shared, fp8, |k| k.product_in_steps(pair[1], fp8, self.steps)));
            }
            fwd.products.push(fwd.k.seconds - before);
        }
    }

    /// The backward's products (each twice: input and weight gradients) and routing.
    fn backward(&self, bwd: &mut Kernels<'_>, fp8: bool) {
        for (pair, shared) in &self.products {
            self.run(bwd, *shared, fp8, |k| k.gradients_in_steps(pair[0], fp8, self.grad_steps[0]));
            self.run(bwd, *shared, fp8, |k| k.gradients_in_steps(pair[1], fp8, self.grad_steps[1]));
        }
        self.routing(bwd, true);
    }

    /// The activation's gradient over every MLP's elements.
    fn activation_backward(&self, bwd: &mut Kernels<'_>) {
        let elements: f64 = self.activation.iter().sum();
        let (flops, values) = self.activation_work(elements);
        bwd.function_grad(self.function(), elements, flops, values + elements);
    }
}
