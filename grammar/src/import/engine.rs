//! What the engine importers ([`super::megatron`], [`super::torchtitan`],
//! [`super::deepspeed`]) read from a launch configuration, and the one spec writer they
//! share: the model, the cluster, the layout as a written strategy, the training, and
//! `engine:`, with a header listing what the configuration asks that the spec cannot say.

use pipec_plan::model::{MlpKind, NormKind};
use pipec_plan::vocab::{Choice, CompileComponent, CpComm, Engine, Precision, ScheduleKind, Sharding};

/// A decoder-only language model as the engines describe one.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFacts {
    pub vocab: usize,
    pub layers: usize,
    pub d: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ff: usize,
    pub seq: usize,
    /// A learned position table's length (0: none).
    pub positions: usize,
    /// Rotary embeddings' base (0: none).
    pub rope: f64,
    pub norm: NormKind,
    pub eps: f64,
    pub mlp: MlpKind,
    pub bias: bool,
    pub qkv_bias: bool,
    pub tied: bool,
    pub moe: Option<MoeFacts>,
    pub attention: AttentionFacts,
    /// Multi-token prediction (Megatron-LM's `--mtp-num-layers`).
    pub mtp: Option<pipec_plan::model::Mtp>,
}

/// The attention's shape beyond heads and key/value heads (Default: standard attention of
/// d/heads features a head).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AttentionFacts {
    /// Each head's size when it is not d/heads (Megatron-LM's `--kv-channels`).
    pub head_dim: Option<usize>,
    /// An RMSNorm or LayerNorm over each head's queries and keys (`--qk-layernorm`).
    pub qk_norm: bool,
    /// A sliding window: each position sees itself and the `window − 1` before it (0: none).
    pub window: usize,
    /// With a window, every `full_every`-th layer (from 1) attends fully instead
    /// (`--window-attn-skip-freq N`; 0: every layer slides).
    pub full_every: usize,
    /// A learned logit per head in every softmax (`--softmax-type learnable`).
    pub sinks: bool,
    /// Multi-head latent attention (`--multi-latent-attention`).
    pub mla: Option<pipec_plan::model::Mla>,
    /// Llama 3.1's rotary scaling by this factor (low 1, high 4, original 8192:
    /// `--use-rope-scaling`).
    pub llama3_rope_factor: Option<f64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeFacts {
    pub experts: usize,
    pub top_k: usize,
    /// Shared experts (each `ff` wide).
    pub shared: usize,
    pub aux_loss: f64,
    pub sigmoid: bool,
    pub norm_topk: bool,
    pub capacity: f64,
    /// Blocks with a dense MLP `dense_ff` wide before the first mixture of experts.
    pub dense: usize,
    pub dense_ff: usize,
    /// `route_scale`, `route_groups`, `route_group_top`, `expert_bias`.
    pub scale: f64,
    pub groups: usize,
    pub group_top: usize,
    pub expert_bias: bool,
}

/// The layout and training a launch configuration gives.
#[derive(Debug, Clone, PartialEq)]
pub struct RunFacts {
    pub world: usize,
    pub tp: usize,
    pub pp: usize,
    pub cp: usize,
    /// Expert parallelism's devices per group.
    pub ep: usize,
    /// Expert tensor parallelism: the tensor-parallel degree (experts split like the
    /// block) or 1 (whole).
    pub etp: usize,
    /// Megatron-LM's uneven split: the embedding and the loss counted as a layer of the
    /// first and last chunk (`--account-for-embedding-in-pipeline-split`,
    /// `--account-for-loss-in-pipeline-split`).
    pub split_ends: (bool, bool),
    /// Megatron-LM's split written layer by layer (`--pipeline-model-parallel-layout`): the
    /// blocks of each chunk in model order.
    pub chunk_blocks: Option<Vec<usize>>,
    pub schedule: ScheduleKind,
    pub virtual_stages: usize,
    pub sharding: Sharding,
    pub sequence_parallel: bool,
    pub tp_overlap: bool,
    pub cp_comm: CpComm,
    /// How expert parallelism dispatches tokens.
    pub moe_dispatch: pipec_plan::vocab::MoeDispatch,
    /// Megatron-LM's expert-parallel overlap (`--overlap-moe-expert-parallel-comm`).
    pub ep_overlap: bool,
    /// `true`, `false` or `selective`.
    pub recompute: String,
    pub precision: Precision,
    /// FP8 products (beside `precision: bf16`): the recipe and what the engine keeps and
    /// gathers in FP8.
    pub fp8: Option<pipec_plan::plan::Fp8Plan>,
    /// Gradients accumulated and reduced in bf16 (Megatron-LM's `--grad-reduce-in-bf16`).
    pub grad_bf16: bool,
    /// The optimizer's moments in bf16 (Megatron-LM's precision-aware optimizer).
    pub state_bf16: bool,
    pub micro: usize,
    pub global: usize,
    pub steps: usize,
    /// `adamw` or `sgd`, with (lr, beta1, beta2, eps, weight_decay) or (lr, momentum, _, _, weight_decay).
    pub optimizer: (&'static str, [f64; 5]),
    pub clip: Option<f64>,
    pub seed: u64,
    /// torchtitan's `[compile]`: the model's blocks, the loss (`engine.compile`).
    pub compile: (bool, bool),
}

impl RunFacts {
    /// The data-parallel degree: the devices left by the model's parallelism.
    pub fn dp(&self) -> Result<usize, String> {
        let model = self.tp * self.pp * self.cp;
        if model == 0 || !self.world.is_multiple_of(model) {
            return Err(format!("the world size {} is not a multiple of tp·pp·cp = {model}", self.world));
        }
        Ok(self.world / model)
    }
}

/// Numbers as a spec writes them (no trailing `.0`, no exponent for the usual ones).
pub fn number(x: f64) -> String {
    if x == x.trunc() && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

/// The model section of `m`.
pub fn model_text(m: &ModelFacts) -> String {
    let args = block_args(m, m.ff, true);
    let eps = (m.eps != pipec_plan::model::DEFAULT_EPS).then(|| format!("eps={}", number(m.eps)));
    let norm = if m.norm == NormKind::RmsNorm { "rmsnorm" } else { "layernorm" };
    let final_norm = eps.map_or_else(|| norm.to_string(), |e| format!("{norm}({e})"));
    let (table, head) = if m.tied {
        (
            format!("embedding({}, {}) as tokens", m.vocab, m.d),
            format!("linear({}, {}, bias=false, tie=tokens)", m.d, m.vocab),
        )
    } else {
        (format!("embedding({}, {})", m.vocab, m.d), format!("linear({}, {}, bias=false)", m.d, m.vocab))
    };
    let positions = if m.positions > 0 { format!("    - pos_embedding({})\n", m.positions) } else { String::new() };
    // a mixture of experts' dense blocks first (`--moe-layer-freq ([0]*k+[1]*n)`)
    let dense = m.moe.as_ref().map_or(0, |e| e.dense.min(m.layers));
    let blocks = match m.moe.as_ref().filter(|_| dense > 0) {
        Some(e) => format!(
            "    - repeat {dense}: transformer_block({})\n    - repeat {}: transformer_block({args})\n",
            block_args(m, e.dense_ff, false),
            m.layers - dense
        ),
        None if m.attention.full_every > 0 => {
            // N − 1 windowed blocks, then one attending fully
            let n = m.attention.full_every;
            let full = ModelFacts { attention: AttentionFacts { window: 0, ..m.attention.clone() }, ..m.clone() };
            let mut group = vec![format!("transformer_block({args})"); n - 1];
            group.push(format!("transformer_block({})", block_args(&full, m.ff, true)));
            format!("    - repeat {}: {}\n", m.layers / n, group.join(" -> "))
        }
        None => format!("    - repeat {}: transformer_block({args})\n", m.layers),
    };
    // the engines attend with fused (flash) kernels: Megatron-LM's --attention-backend auto,
    // torchtitan's SDPA (a Hugging Face model's section, DeepSpeed's, writes its own)
    let mtp = match m.mtp {
        None => String::new(),
        Some(p) if p.weight == pipec_plan::model::Mtp::DEFAULT_WEIGHT => format!("  mtp: {}\n", p.depth),
        Some(p) => format!("  mtp: {{ depth: {}, weight: {} }}\n", p.depth, p.weight),
    };
    format!(
        "model:\n  attention: flash\n  input: [{}]\n  layers:\n    - {table}\n{positions}{blocks}    - {final_norm}\n    - {head}\n  loss: cross_entropy\n{mtp}",
        m.seq
    )
}

/// A block's arguments: its MLP `ff` wide, with the mixture of experts (`moe`) or dense.
fn block_args(m: &ModelFacts, ff: usize, moe: bool) -> String {
    let mut args = format!("d={}, heads={}, ff={ff}, causal=true", m.d, m.heads);
    if m.kv_heads != m.heads {
        args += &format!(", kv_heads={}", m.kv_heads);
    }
    if m.norm == NormKind::RmsNorm {
        args += ", norm=rmsnorm";
    }
    if m.mlp != MlpKind::Gelu {
        args += &format!(", mlp={}", m.mlp.name());
    }
    if m.rope > 0.0 {
        args += &format!(", rope={}", number(m.rope));
    }
    if !m.bias {
        args += ", bias=false";
        if m.qkv_bias {
            args += ", qkv_bias=true";
        }
    }
    let a = &m.attention;
    if let Some(f) = a.llama3_rope_factor {
        args += &format!(
            ", rope_scaling=llama3, rope_factor={}, rope_low_freq=1, rope_high_freq=4, rope_original=8192",
            number(f)
        );
    }
    if let Some(h) = a.head_dim {
        args += &format!(", head_dim={h}");
    }
    if a.qk_norm {
        args += ", qk_norm=true";
    }
    if a.window > 0 {
        args += &format!(", window={}", a.window);
    }
    if a.sinks {
        args += ", sinks=true";
    }
    if let Some(l) = a.mla {
        args += &format!(", kv_lora={}", l.kv_lora);
        if l.q_lora > 0 {
            args += &format!(", q_lora={}", l.q_lora);
        }
        args += &format!(", rope_dim={}, v_head_dim={}", l.rope_dim, l.v_head_dim);
    }
    if let Some(e) = m.moe.as_ref().filter(|_| moe) {
        args += &format!(", experts={}, top_k={}", e.experts, e.top_k);
        if e.shared > 0 {
            args += &format!(", shared_experts={}", e.shared);
        }
        args += &format!(", aux_loss={}", number(e.aux_loss));
        if e.sigmoid {
            args += ", router=sigmoid";
        }
        if !e.norm_topk {
            args += ", norm_topk=false";
        }
        if e.capacity > 0.0 {
            args += &format!(", capacity={}", number(e.capacity));
        }
        if e.scale != 1.0 {
            args += &format!(", route_scale={}", number(e.scale));
        }
        if e.groups > 0 {
            args += &format!(", route_groups={}, route_group_top={}", e.groups, e.group_top);
        }
        if e.expert_bias {
            args += ", expert_bias=true";
        }
    }
    if m.eps != pipec_plan::model::DEFAULT_EPS {
        args += &format!(", eps={}", number(m.eps));
    }
    args
}

/// The cluster, strategy and training sections of `r` (H100 nodes of up to 8 GPUs: the
/// engines' configurations do not say which devices).
pub fn run_text(r: &RunFacts) -> Result<String, String> {
    let dp = r.dp()?;
    let per_node = r.world.min(8);
    if !r.world.is_multiple_of(per_node) {
        return Err(format!("{} GPUs are not whole nodes of 8", r.world));
    }
    let schedule = match r.schedule {
        ScheduleKind::Interleaved => format!("{{ kind: interleaved, virtual_stages: {} }}", r.virtual_stages),
        k => k.name().to_string(),
    };
    let mut strategy = format!("  dp: {dp}\n  pp: {}\n  tp: {}\n  schedule: {schedule}\n", r.pp, r.tp);
    if !r.global.is_multiple_of(r.micro.max(1)) {
        return Err(format!("the global batch {} is not a multiple of the microbatch {}", r.global, r.micro));
    }
    strategy += &format!("  microbatches: {}\n", r.global / r.micro.max(1));
    if r.sharding != Sharding::None {
        strategy += &format!("  zero: {}\n", r.sharding.level());
    }
    if r.recompute != "false" {
        strategy += &format!("  recompute: {}\n", r.recompute);
    }
    if r.sequence_parallel && r.tp > 1 {
        strategy += "  sequence_parallel: true\n";
    }
    if r.tp_overlap && r.tp > 1 {
        strategy += "  tp_overlap: true\n";
    }
    if r.cp > 1 {
        strategy += &format!("  cp: {}\n", r.cp);
        if r.cp_comm != CpComm::AllGather {
            strategy += &format!("  cp_comm: {}\n", r.cp_comm.name());
        }
    }
    if r.ep > 1 {
        strategy += &format!("  ep: {}\n", r.ep);
        if r.tp > 1 && r.etp == 1 && !r.sequence_parallel {
            return Err(format!(
                "experts whole (expert tensor parallelism 1) beside tensor parallelism {} without sequence parallelism: pipec plans whole experts with each rank dispatching its sequence share (Megatron-LM's MoE layer refuses tensor parallelism without sequence parallelism)",
                r.tp
            ));
        } else if r.tp > 1 && r.etp == 1 {
            strategy += "  etp: 1\n";
        } else if r.etp != r.tp {
            return Err(format!(
                "expert tensor parallelism {} beside tensor parallelism {}: pipec plans experts split like the block or whole (1)",
                r.etp, r.tp
            ));
        }
        if r.moe_dispatch != pipec_plan::vocab::MoeDispatch::AllToAll {
            strategy += &format!("  moe_dispatch: {}\n", r.moe_dispatch);
        }
        if r.ep_overlap {
            strategy += "  ep_overlap: true\n";
        }
    }
    let (kind, [lr, a, b, eps, wd]) = r.optimizer;
    let state = if r.state_bf16 { ", state_precision: bf16" } else { "" };
    let optimizer = if kind == "sgd" {
        format!("{{ kind: sgd, lr: {}, momentum: {}, weight_decay: {}{state} }}", number(lr), number(a), number(wd))
    } else {
        format!(
            "{{ kind: adamw, lr: {}, beta1: {}, beta2: {}, eps: {}, weight_decay: {}{state} }}",
            number(lr),
            number(a),
            number(b),
            eps,
            number(wd)
        )
    };
    let clip = r.clip.filter(|c| *c > 0.0).map_or(String::new(), |c| format!("  clip_grad_norm: {}\n", number(c)));
    let fp8 = r.fp8.as_ref().map_or(String::new(), |f| {
        format!(
            "  fp8: {{ recipe: {}, activations: {}, weight_copies: {}, gather: {} }}\n",
            f.recipe.name(),
            f.activations.name(),
            f.weight_copies,
            f.gather.name()
        )
    });
    let grad = if r.grad_bf16 { "  grad_precision: bf16\n" } else { "" };
    Ok(format!(
        "cluster:\n  nodes: {}\n  devices_per_node: {per_node}\n  device: h100-sxm\n  links: dgx-h100\n\
         strategy:\n{strategy}\
         training:\n  batch_size: {}\n  steps: {}\n  optimizer: {optimizer}\n  precision: {}\n{grad}{fp8}  seed: {}\n  data: {{ kind: synthetic }}\n{clip}",
        r.world / per_node,
        r.global,
        r.steps.max(1),
        if r.fp8.is_some() { "fp8" } else { r.precision.name() },
        r.seed
    ))
}

/// `spec` with the partition Megatron-LM runs when it counts the embedding and (or) the
/// loss as a layer (`run.split_ends`) or is given a layout (`run.chunk_blocks`): an
/// explicit list of the chunks' layers.
fn with_counted_split(spec: &str, run: &RunFacts) -> Result<String, String> {
    use pipec_plan::engine::capability::{chunk_ranges, counted_split};
    let Some(model) = crate::check_source(spec).spec.map(|s| s.model) else {
        return Err(format!("the spec written from this configuration does not check\n{spec}"));
    };
    let starts: Vec<usize> =
        model.layers.iter().enumerate().filter(|(_, l)| l.op.block_dims().is_some()).map(|(i, _)| i).collect();
    let chunks = run.pp * run.virtual_stages.max(1);
    let counts = match &run.chunk_blocks {
        Some(counts) if counts.iter().sum::<usize>() == starts.len() => counts.clone(),
        Some(counts) => {
            return Err(format!(
                "the pipeline layout places {} transformer blocks, the model has {}",
                counts.iter().sum::<usize>(),
                starts.len()
            ))
        }
        None => counted_split(starts.len(), chunks, run.split_ends).ok_or_else(|| {
            format!("{} transformer blocks do not split evenly over {chunks} pipeline chunks with the embedding and the loss counted so", starts.len())
        })?,
    };
    let list: Vec<String> = chunk_ranges(&starts, model.layers.len(), &counts)
        .iter()
        .map(|r| format!("\"{}..{}\"", r.start, r.end))
        .collect();
    Ok(spec.replacen("strategy:\n", &format!("strategy:\n  partition: [{}]\n", list.join(", ")), 1))
}

/// The whole spec: a header naming the source and what was not carried over, then the
/// sections; checked before it is returned (an importer never writes a spec that does not
/// check, the engine's capabilities included).
pub fn write_spec(
    engine: Engine,
    source: &str,
    name: &str,
    model: &str,
    run: &RunFacts,
    dropped: &[String],
) -> Result<String, String> {
    let mut header = format!("# Imported by `pipec import` from {source}: the layout, batch, model and optimizer it\n# describes, checked against {engine}'s capabilities.\n");
    if !dropped.is_empty() {
        header += "# Not carried over (pipec's spec cannot say it yet, or it changes no layout):\n";
        for d in dropped {
            header += &format!("#   {d}\n");
        }
    }
    let engine_line = match run.compile {
        (false, false) => engine.to_string(),
        compile => {
            let parts: Vec<&str> = CompileComponent::compiled(compile).into_iter().map(Choice::name).collect();
            format!("{{ name: {engine}, compile: [{}] }}", parts.join(", "))
        }
    };
    let mut spec = format!("{header}name: {name}\nengine: {engine_line}\n{model}{}", run_text(run)?);
    if run.split_ends != (false, false) || run.chunk_blocks.is_some() {
        spec = with_counted_split(&spec, run)?;
    }
    let checked = crate::check_source(&spec);
    if let Some(d) = checked.diagnostics.iter().find(|d| d.is_error()) {
        return Err(format!(
            "the spec written from this configuration does not check: {} ({})\n{spec}",
            d.message, d.code
        ));
    }
    Ok(spec)
}
