//! A plan as another engine's launch configuration (`pipec emit`): Megatron-LM's
//! `pretrain_gpt.py` arguments (the examples/ scripts' bash arrays, a plain argument list and
//! a Slurm script), torchtitan v0.2.2's TOML job configuration and its `torchrun` line,
//! DeepSpeed's `ds_config.json` and launcher line; in each folder what pipec predicts for
//! the run. Each configuration is a table of rows (a flag or key and the plan's value for
//! it): adding a field is one row. A plan the engine cannot run (its capability table's
//! refusals) or a model it does not describe is refused by name.

use std::fmt::Write as _;

use serde_json::json;

use super::capability::{refusals, Layout, RecomputeKind};
use super::gpt::GptShape;
use super::EngineTarget;
use crate::model::{MlpKind, NormKind};
use crate::plan::{Fp8Plan, OptimizerPlan};
use crate::rope::RopeScaling;
use crate::vocab::{Choice, CompileComponent, CpComm, Engine, Precision, ScheduleKind, Sharding};
use crate::Plan;

/// One emitted file: its name in the folder and its text.
pub type File = (String, String);

/// What every emitter reads of a plan: the layout, the model's shape, the batch, the cluster.
pub struct Run<'a> {
    pub plan: &'a Plan,
    pub layout: Layout,
    pub gpt: GptShape,
    pub seq: usize,
    pub world: usize,
    pub nodes: usize,
    pub per_node: usize,
    /// Samples per microbatch and microbatches per data-parallel replica per step.
    pub micro: usize,
    pub accumulation: usize,
}

impl<'a> Run<'a> {
    /// The run `plan` describes, or why `engine` cannot take it.
    pub fn of(plan: &'a Plan, engine: &EngineTarget) -> Result<Run<'a>, String> {
        // recompute inside the blocks is judged part by part (`BlockRecomputePart`): what
        // the tables let through each engine writes, never dropped
        let layout = plan.engine_layout();
        let refused = refusals(engine, &layout);
        if !refused.is_empty() {
            let why: Vec<String> = refused.iter().map(|r| format!("`{}`: {}", r.feature.key(), r.message)).collect();
            return Err(format!("{engine} cannot run this plan: {}", why.join("; ")));
        }
        let gpt = plan.gpt_shape().ok_or_else(|| {
            format!("{engine}'s launch configuration describes a decoder-only language model (embedding, identical causal transformer blocks, final norm, output layer); this plan's model is not one")
        })?;
        let world = plan.devices.len().max(1);
        let nodes = plan.devices.iter().map(|d| d.node).max().map_or(1, |n| n as usize + 1);
        let t = &plan.training;
        let laid_out = layout.dp() * layout.cp * layout.tp * layout.pp();
        if laid_out != world {
            return Err(format!("the plan's {world} devices are not its layout's {laid_out} (dp·cp·tp·pp)"));
        }
        let written = layout.microbatches.max(1);
        Ok(Run {
            seq: plan.model.input.first().copied().unwrap_or(1),
            nodes,
            per_node: world / nodes,
            micro: t.batch_size / written,
            accumulation: (written / layout.dp()).max(1),
            plan,
            world,
            layout,
            gpt,
        })
    }

    fn tokens_per_step(&self) -> usize {
        self.plan.training.batch_size * self.seq
    }
}

/// The files of `engine`'s configuration for `plan`, or why not.
pub fn emit(plan: &Plan, engine: &EngineTarget) -> Result<Vec<File>, String> {
    let run = Run::of(plan, engine)?;
    let mut files = match engine.name {
        Engine::Megatron => {
            megatron_shape(&run.gpt)?;
            megatron_mtp(&run)?;
            megatron(&run)
        }
        Engine::Torchtitan => torchtitan(&run)?,
        Engine::Deepspeed => deepspeed(&run),
        Engine::Pipec => {
            return Err(
                "`pipec emit` writes another engine's configuration: pipec runs plan.json itself (`pipec run`)".into()
            )
        }
    };
    files.push(("prediction.json".into(), prediction(&run, engine)));
    files.push(("NOTES.md".into(), notes(&run, engine)));
    Ok(files)
}

/// What pipec predicts for the run: the first measured step is held against it.
fn prediction(run: &Run<'_>, engine: &EngineTarget) -> String {
    let sim = &run.plan.simulation;
    let step = sim.step_time_s;
    let peaks: Vec<u64> = sim.devices.iter().map(|d| d.peak_memory_bytes).collect();
    // MFU by the count the engine prints (its log's line is held against it), of the peak the
    // plan was compiled for
    let mfu = run.plan.tokens_per_sample().and_then(|seq| {
        let mtp = run.plan.mtp_layers();
        let layers = run.plan.layers.iter().map(|l| (&l.op, l.tied)).chain(mtp.iter().map(|(op, _)| (op, None)));
        let peak = sim.mfu.as_ref().map(|m| m.peak.clone());
        let utilization = crate::flops::Utilization::of_model(layers, seq, engine.name, run.world, peak);
        utilization.mfu(sim.throughput_samples_per_s).map(|m| crate::flops::Mfu { fraction: round(m.fraction), ..m })
    });
    let mut value = json!({
        "engine": engine,
        "plan": run.plan.name,
        "world_size": run.world,
        "layout": {
            "tp": run.layout.tp, "pp": run.layout.pp(), "dp": run.layout.dp(), "cp": run.layout.cp, "ep": run.layout.ep, "etp": run.layout.etp,
            "chunk_blocks": run.layout.chunk_blocks,
            "virtual_stages": run.layout.virtual_stages, "schedule": run.layout.schedule,
            "microbatch_size": run.micro, "microbatches_per_replica": run.accumulation,
            "global_batch": run.plan.training.batch_size, "seq_length": run.seq,
            "zero": run.layout.sharding.level(), "recompute": written_recompute_name(run),
            "fp8": run.layout.fp8.map(|r| r.to_string()),
        },
        "step_time_s": round(step),
        "tokens_per_s_per_gpu": round(run.tokens_per_step() as f64 / step.max(1e-12) / run.world as f64),
        "bubble_fraction": round(sim.bubble_fraction),
        "peak_memory_bytes_per_rank": peaks,
        "fits": run.plan.devices.iter().all(|d| d.memory.total <= d.memory.capacity),
        "mfu": mfu,
        "source": "pipec's simulation of the plan (plan.json `simulation`); MFU by the engine's own FLOP count (pipec_plan::flops)",
    });
    // each block's sliding window (0: full attention), where a block has one: the engine
    // builds the same
    if run.gpt.block.window > 0 {
        value["block_windows"] = json!(run.gpt.block_windows());
    }
    // multi-token prediction's modules and where the engine builds them: with the loss, in
    // the last chunk
    if let Some(m) = run.plan.model.mtp {
        value["mtp"] =
            json!({ "depth": m.depth, "weight": m.weight, "chunk": run.plan.stages.len().saturating_sub(1) });
    }
    serde_json::to_string_pretty(&value).unwrap_or_default() + "\n"
}

/// Six significant digits: the golden files stay stable under last-bit changes.
fn round(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return 0.0;
    }
    let scale = 10f64.powi(5 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// The recompute the engine's configuration says, as its own parser reads it back
/// (`scripts/engine_check.py`): block recompute of whole layers is Megatron-LM's `full`
/// granularity, of modules or operations `selective`.
fn written_recompute_name(run: &Run<'_>) -> &'static str {
    match run.plan.schedule.block_recompute.as_ref() {
        Some(b) if b.layers > 0 => "full",
        Some(_) => "selective",
        None => recompute_name(run.layout.recompute),
    }
}

fn recompute_name(r: RecomputeKind) -> &'static str {
    match r {
        RecomputeKind::Off => "none",
        RecomputeKind::Full => "full",
        RecomputeKind::SomeStages => "stages",
        RecomputeKind::Selective => "selective",
    }
}

/// What is and is not carried over: what the engine adds by default that pipec does not
/// model, and what of the plan the configuration cannot say.
fn notes(run: &Run<'_>, engine: &EngineTarget) -> String {
    let mut out =
        format!("# {} for {engine}\n\nWritten by `pipec emit` from plan `{}`.\n\n", run.plan.name, run.plan.name);
    out.push_str("## Not modelled by pipec (the engine's defaults)\n\n");
    let adds: &[&str] = match engine.name {
        Engine::Megatron => &[
            "the vocabulary padded to a multiple of --make-vocab-size-divisible-by (set to 1 here, so none)",
            "fused kernels (rope, bias-gelu, masked softmax) and Transformer Engine's layers where installed",
            "the learning-rate schedule's warmup and decay (--lr-decay-style constant here)",
            "the data loader (--mock-data: synthetic tokens) and the tokenizer (NullTokenizer)",
        ],
        Engine::Torchtitan => &[
            "FSDP2's per-block prefetch and reshard policy, float8/compile when turned on",
            "torchtitan's pipeline split counts the embedding and output as layers unless first/last_stage_less_layers are 0 (set here)",
            "the learning-rate warmup (lr_scheduler.warmup_steps = 0 here)",
            "the dataset (c4_test) and the tokenizer at hf_assets_path",
        ],
        Engine::Deepspeed => &[
            "the training script: it builds the model (deepspeed.pipe.PipelineModule with num_stages and partition_method=\"uniform\" for a pipeline) and the data; ds_config.json holds the batch, precision, ZeRO and optimizer",
            "DeepSpeed's gradient bucketing (reduce_bucket_size) and communication overlap (overlap_comm)",
            "fp16's dynamic loss scaling parameters (DeepSpeed's defaults)",
        ],
        Engine::Pipec => &[],
    };
    for a in adds {
        let _ = writeln!(out, "- {a}");
    }
    out.push_str("\n## Not carried over from the plan\n\n");
    let mut lost = Vec::new();
    if run.gpt.head_bias {
        lost.push("the output layer's bias (the engine's output layer has none)".to_string());
    }
    if let OptimizerPlan::Adam { decoupled: false, weight_decay, .. } = run.plan.training.optimizer {
        if weight_decay > 0.0 {
            lost.push("Adam's L2 weight decay: the engines' Adam decouples it (AdamW)".into());
        }
    }
    if run.plan.model.attention != crate::vocab::Attention::Flash {
        lost.push("standard attention: the engine attends with fused (flash) kernels, which keep no score matrix (`model.attention: flash` prices that)".into());
    }
    if run.plan.training.recipe.lr_schedule.is_some() {
        lost.push("the spec's learning-rate schedule (a constant rate is written)".into());
    }
    lost.extend(fp8_not_said(run.plan.training.fp8, engine.name));
    if lost.is_empty() {
        lost.push("nothing of the layout, batch, model shape, precision or optimizer".into());
    }
    for l in lost {
        let _ = writeln!(out, "- {l}");
    }
    out
}

/// What of FP8 training's storage (`training.fp8`) the engine's configuration cannot say:
/// where the plan's differs from what the engine's kernels keep ([`Fp8Plan::of_engine`]).
/// Megatron-LM's arguments have no switch for Megatron-Core's
/// `disable_parameter_transpose_cache` (Megatron-Bridge sets it in its configuration), nor
/// torchtitan's for torchao's storage.
fn fp8_not_said(fp8: Option<Fp8Plan>, engine: Engine) -> Vec<String> {
    let Some(f) = fp8 else { return Vec::new() };
    let own = Fp8Plan::of_engine(engine, f.recipe);
    let (inputs, copies) = match engine {
        Engine::Megatron => (
            "Transformer Engine's linear layers keep the FP8 copies of their inputs",
            "Megatron-LM's arguments have no switch for Megatron-Core's `disable_parameter_transpose_cache` (Megatron-Bridge sets it in its configuration), so Transformer Engine keeps FP8 copies of the weights between microbatches",
        ),
        Engine::Torchtitan => (
            "torchao's Float8Linear keeps its bf16 input for the weight gradient",
            "torchao casts the weights every pass and keeps no FP8 copies",
        ),
        // (DeepSpeed's configuration has no FP8: refused before; pipec's plan is its own)
        Engine::Deepspeed | Engine::Pipec => return Vec::new(),
    };
    let mut lost = Vec::new();
    if f.activations != own.activations {
        lost.push(format!("`fp8.activations: {}`: {inputs}", f.activations.name()));
    }
    if f.weight_copies != own.weight_copies {
        lost.push(format!("`fp8.weight_copies: {}`: {copies}", f.weight_copies));
    }
    lost
}

/// A flag and its value (None: a switch).
type Arg = (&'static str, Option<String>);

fn flag(name: &'static str) -> Arg {
    (name, None)
}
fn arg(name: &'static str, value: impl ToString) -> Arg {
    (name, Some(value.to_string()))
}

/// Whether Megatron-LM's GPT model has this block: it gates with SiLU only (`--swiglu`), and
/// biases the query/key/value projection whenever the others (`--disable-bias-linear`,
/// `--add-qkv-bias`: [M] megatron/training/arguments.py).
fn megatron_shape(g: &GptShape) -> Result<(), String> {
    let b = &g.block;
    if b.mlp == MlpKind::Geglu {
        return Err("Megatron-LM has no GEGLU MLP (it gates with SiLU only: --swiglu)".into());
    }
    if b.bias && !b.qkv_bias {
        return Err("Megatron-LM biases the query/key/value projection whenever the other projections: a block with `bias=true, qkv_bias=false` has no flag".into());
    }
    // its rotary scaling is Llama 3.1's with 1, 4 and 8192 fixed (`--use-rope-scaling`,
    // rotary_pos_embedding.py's _apply_scaling), and none on a latent block (written with
    // `--rope-type rope`)
    match b.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Llama3 { low_freq_factor, high_freq_factor, original, .. }
            if low_freq_factor == 1.0 && high_freq_factor == 4.0 && original == 8192 && b.mla.is_none() => {}
        other => {
            return Err(format!(
                "Megatron-LM scales rotary embeddings as Llama 3.1 only (low 1, high 4, original 8192), and not on latent blocks: rope_scaling={} has no flag",
                other.kind()
            ))
        }
    }
    if b.dropout > 0.0 {
        return Err(
            "dropout inside the blocks: pipec writes Megatron-LM's --attention-dropout and --hidden-dropout as 0"
                .into(),
        );
    }
    if let Some(m) = b.moe.filter(|m| m.router == crate::model::Router::Sigmoid && !m.norm_topk && m.top_k > 1) {
        return Err(format!(
            "Megatron-LM divides sigmoid scores by their sum over the {} chosen experts (moe_utils.py): router=sigmoid with norm_topk=false has no flag",
            m.top_k
        ));
    }
    if b.qk_norm && b.norm != NormKind::RmsNorm {
        return Err("query/key norms under layer norms: Megatron-LM's --qk-layernorm normalises with the blocks' norm (LayerNorm here), pipec's are RMSNorms".into());
    }
    Ok(())
}

/// Whether Megatron-LM's multi-token prediction takes the plan's: rotary or no position
/// embeddings ([M] megatron/training/arguments.py:856-860), and one module at most beside
/// the combined 1F1B ([M] megatron/core/transformer/transformer_config.py:2709-2713).
fn megatron_mtp(run: &Run<'_>) -> Result<(), String> {
    let Some(m) = run.plan.model.mtp else { return Ok(()) };
    if run.gpt.positions > 0 {
        return Err("Megatron-LM's multi-token prediction takes rotary or no position embeddings, and this model learns a table of positions".into());
    }
    if run.layout.ep_overlap && run.layout.ep > 1 && m.depth > 1 {
        return Err(format!(
            "Megatron-LM's combined 1F1B (`ep_overlap`) takes one multi-token-prediction module at most, and the model has {}",
            m.depth
        ));
    }
    Ok(())
}

/// `pretrain_gpt.py`'s arguments, in the examples' groups.
pub fn megatron_args(run: &Run<'_>) -> Vec<(&'static str, Vec<Arg>)> {
    let (g, l, t) = (&run.gpt, &run.layout, &run.plan.training);
    let b = &g.block;
    let mut model = vec![
        arg("--num-layers", g.layers),
        arg("--hidden-size", b.d),
        arg("--ffn-hidden-size", if g.dense > 0 { g.dense_ff } else { b.ff }),
        arg("--num-attention-heads", b.heads),
    ];
    match b.mla {
        // multi-head latent attention (MLATransformerConfig): every head its own keys and
        // values, plain rotary embeddings (Megatron-LM's default for it is YaRN), unfused
        // (its fused rotary kernel takes YaRN only: transformer_config.py:2966)
        Some(m) => {
            model.push(flag("--multi-latent-attention"));
            if m.q_lora > 0 {
                model.push(arg("--q-lora-rank", m.q_lora));
            }
            model.extend([
                arg("--kv-lora-rank", m.kv_lora),
                arg("--qk-head-dim", b.head_dim),
                arg("--qk-pos-emb-head-dim", m.rope_dim),
                arg("--v-head-dim", m.v_head_dim),
                arg("--rope-type", "rope"),
                flag("--no-rope-fusion"),
            ]);
        }
        None => {
            if b.kv_heads != b.heads {
                model.extend([flag("--group-query-attention"), arg("--num-query-groups", b.kv_heads)]);
            }
            if b.head_dim * b.heads != b.d {
                model.push(arg("--kv-channels", b.head_dim));
            }
        }
    }
    if b.qk_norm {
        model.push(flag("--qk-layernorm"));
    }
    // Transformer Engine's window (L, 0): each query sees the L keys before it and itself
    if b.window > 0 {
        model.push(arg("--window-size", format!("{},0", b.window - 1)));
        // every N-th block attends fully (utils.py is_layer_window_attention: layer_number %
        // N != 0 slides)
        if g.full_every > 0 {
            model.push(arg("--window-attn-skip-freq", g.full_every));
        }
    }
    // a learned offset per head in every softmax: attention sinks
    if b.sinks {
        model.push(arg("--softmax-type", "learnable"));
    }
    model.extend([arg("--seq-length", run.seq), arg("--max-position-embeddings", g.positions.max(run.seq))]);
    model.push(match (g.positions, b.rope) {
        (p, _) if p > 0 => arg("--position-embedding-type", "learned_absolute"),
        (_, r) if r > 0.0 => arg("--position-embedding-type", "rope"),
        _ => arg("--position-embedding-type", "none"),
    });
    if b.rope > 0.0 {
        model.push(arg("--rotary-base", b.rope));
    }
    if let RopeScaling::Llama3 { factor, .. } = b.rope_scaling {
        model.extend([flag("--use-rope-scaling"), arg("--rope-scaling-factor", factor)]);
    }
    model.push(arg("--normalization", if b.norm == NormKind::RmsNorm { "RMSNorm" } else { "LayerNorm" }));
    model.push(arg("--norm-epsilon", b.eps));
    match b.mlp {
        MlpKind::Swiglu => model.push(flag("--swiglu")),
        MlpKind::GeluTanh => model.push(flag("--openai-gelu")),
        MlpKind::Gelu | MlpKind::Geglu => {}
    }
    if !b.bias {
        model.push(flag("--disable-bias-linear"));
        if b.qkv_bias {
            model.push(flag("--add-qkv-bias"));
        }
    }
    if !g.tied {
        model.push(flag("--untie-embeddings-and-output-weights"));
    }
    // multi-token prediction's modules after the last block, on the last pipeline stage
    // (transformer_config.py:68-75, multi_token_prediction.py)
    if let Some(m) = run.plan.model.mtp {
        model.extend([arg("--mtp-num-layers", m.depth), arg("--mtp-loss-scaling-factor", m.weight)]);
    }
    model.extend([
        arg("--attention-dropout", 0),
        arg("--hidden-dropout", 0),
        arg("--tokenizer-type", "NullTokenizer"),
        arg("--vocab-size", g.vocab),
        arg("--make-vocab-size-divisible-by", 1),
    ]);
    let mut moe = Vec::new();
    if let Some(m) = g.moe() {
        moe.extend([
            arg("--num-experts", m.experts),
            arg("--moe-router-topk", m.top_k),
            arg("--moe-ffn-hidden-size", b.ff),
            arg("--moe-router-load-balancing-type", if m.aux_loss > 0.0 { "aux_loss" } else { "none" }),
            arg("--moe-aux-loss-coeff", m.aux_loss),
            // the routed experts through Transformer Engine's grouped linear (a GEMM per
            // expert on Hopper), as the cost model prices them
            // (`KernelFamily::grouped_expert_gemm`; transformer_config.py:829), which
            // `--recompute-modules moe_act` needs
            flag("--moe-grouped-gemm"),
        ]);
        // DeepEP's dispatch is the flex dispatcher's (transformer_config.py:862-869)
        match l.moe_dispatch {
            crate::vocab::MoeDispatch::AllToAll => moe.push(arg("--moe-token-dispatcher-type", "alltoall")),
            crate::vocab::MoeDispatch::DeepEp => {
                moe.extend([arg("--moe-token-dispatcher-type", "flex"), arg("--moe-flex-dispatcher-backend", "deepep")])
            }
        }
        // the combined 1F1B's overlapped pairs (model_parallel_config.py:343)
        if l.ep_overlap && l.ep > 1 {
            moe.push(flag("--overlap-moe-expert-parallel-comm"));
        }
        if m.shared > 0 {
            moe.push(arg("--moe-shared-expert-intermediate-size", m.shared * b.ff));
        }
        // Megatron's router: top-k then a softmax over the chosen (pipec's norm_topk), or
        // a softmax over every expert first (--moe-router-pre-softmax); sigmoid scores
        // renormalised over the chosen (transformer_config.py:2284-2357)
        match m.router {
            crate::model::Router::Softmax if !m.norm_topk => moe.push(flag("--moe-router-pre-softmax")),
            crate::model::Router::Softmax => {}
            crate::model::Router::Sigmoid => moe.push(arg("--moe-router-score-function", "sigmoid")),
        }
        if m.capacity > 0.0 {
            moe.push(arg("--moe-expert-capacity-factor", m.capacity));
        }
        // DeepSeek-V3's routing (moe_utils.py's topk_routing_with_score_function: the
        // scaling after the renormalisation, groups scored by their top_k / group_topk
        // best; the expert bias on the sigmoid scores for the choice only, kept fixed as
        // pipec's is)
        // the dense blocks first (DeepSeek-V3's first_k_dense_replace; arguments.py's
        // moe_freq_type pattern); without, the default: a mixture of experts in every block
        if g.dense > 0 {
            moe.push(arg("--moe-layer-freq", format!("([0]*{}+[1]*{})", g.dense, g.layers - g.dense)));
        }
        if m.scale != 1.0 {
            moe.push(arg("--moe-router-topk-scaling-factor", m.scale));
        }
        if m.groups > 0 {
            moe.extend([arg("--moe-router-num-groups", m.groups), arg("--moe-router-group-topk", m.group_top)]);
        }
        if m.expert_bias {
            moe.extend([flag("--moe-router-enable-expert-bias"), arg("--moe-router-bias-update-rate", 0)]);
        }
    }
    let mut parallel = vec![
        arg("--tensor-model-parallel-size", l.tp),
        arg("--pipeline-model-parallel-size", l.pp()),
        arg("--context-parallel-size", l.cp),
        arg("--expert-model-parallel-size", l.ep),
        arg("--expert-tensor-parallel-size", l.etp),
    ];
    // the plan's chunks as Megatron-LM splits them: evenly, the embedding and the loss
    // counted as a layer of the first and last chunk where the plan's split is so; any other
    // split written layer by layer (its chunks give the virtual stages: arguments.py:893-917)
    let layout = l
        .chunk_blocks
        .as_deref()
        .filter(|c| l.pp() > 1 && super::capability::megatron_split(c).is_none())
        .map(|c| super::capability::megatron_layout(c, run.plan.model.mtp.map_or(0, |m| m.depth)));
    match layout {
        Some(text) => parallel.push(arg("--pipeline-model-parallel-layout", text)),
        None if l.schedule == ScheduleKind::Interleaved => {
            parallel.push(arg("--num-virtual-stages-per-pipeline-rank", l.virtual_stages))
        }
        None => {}
    }
    let ends = l.chunk_blocks.as_deref().and_then(super::capability::megatron_split).unwrap_or((false, false));
    if ends.0 {
        parallel.push(flag("--account-for-embedding-in-pipeline-split"));
    }
    if ends.1 {
        parallel.push(flag("--account-for-loss-in-pipeline-split"));
    }
    if l.cp > 1 {
        parallel.push(arg("--cp-comm-type", if l.cp_comm == CpComm::Ring { "p2p" } else { "allgather" }));
    }
    if l.sequence_parallel {
        parallel.push(flag("--sequence-parallel"));
    }
    if l.tp_overlap {
        parallel.push(flag("--tp-comm-overlap"));
    }
    match l.sharding {
        Sharding::None => {}
        Sharding::Optimizer => parallel.push(flag("--use-distributed-optimizer")),
        Sharding::Gradients | Sharding::Parameters => parallel.extend([
            flag("--use-megatron-fsdp"),
            arg(
                "--data-parallel-sharding-strategy",
                if l.sharding == Sharding::Gradients { "optim_grads" } else { "optim_grads_params" },
            ),
            arg("--ckpt-format", "fsdp_dtensor"),
        ]),
    }
    if l.dp() * l.cp > 1 {
        parallel.push(flag("--overlap-grad-reduce"));
        if l.sharding == Sharding::Optimizer {
            parallel.push(flag("--overlap-param-gather"));
        }
    }
    let mut training = vec![
        arg("--micro-batch-size", run.micro),
        arg("--global-batch-size", t.batch_size),
        arg("--train-iters", t.steps),
    ];
    // recompute inside the blocks (transformer_config.py:1724-1832 at core_v0.19.0): the
    // first layers of each stage whole, or named modules selectively; else the stages'
    let block = run.plan.schedule.block_recompute.as_ref();
    match (block, l.recompute) {
        (Some(b), _) if b.layers > 0 => training.extend([
            arg("--recompute-granularity", "full"),
            arg("--recompute-method", "block"),
            arg("--recompute-num-layers", b.layers),
        ]),
        (Some(b), _) if !b.modules.is_empty() && b.modules != [crate::vocab::RecomputeModule::CoreAttn] => training
            .extend([
                arg("--recompute-granularity", "selective"),
                arg("--recompute-modules", b.modules.iter().map(|m| m.name()).collect::<Vec<_>>().join(" ")),
            ]),
        (_, RecomputeKind::Full) => training.extend([
            arg("--recompute-granularity", "full"),
            arg("--recompute-method", "uniform"),
            arg("--recompute-num-layers", 1),
        ]),
        (_, RecomputeKind::Selective) => training.push(arg("--recompute-granularity", "selective")),
        (_, RecomputeKind::Off | RecomputeKind::SomeStages) => {}
    }
    match t.precision {
        Precision::Bf16 => training.push(flag("--bf16")),
        Precision::Fp16 => training.push(flag("--fp16")),
        Precision::Fp32 => {}
    }
    // Transformer Engine's FP8 (transformer_config.py:566-590; --fp8-param-gather:
    // arguments.py:1935 at core_v0.19.0)
    if let Some(f) = t.fp8 {
        training.extend([arg("--fp8-format", "hybrid"), arg("--fp8-recipe", f.recipe.name())]);
        if f.gather == crate::vocab::Fp8Storage::Fp8 {
            training.push(flag("--fp8-param-gather"));
        }
    }
    // gradients in bf16, the moments in bf16 (arguments.py:1181-1194, 2905, 3500-3517)
    if t.grad_precision == Precision::Bf16 && t.precision != Precision::Fp32 {
        training.push(flag("--grad-reduce-in-bf16"));
    }
    if t.state_precision == Precision::Bf16 {
        training.extend([
            flag("--use-precision-aware-optimizer"),
            arg("--exp-avg-dtype", "bf16"),
            arg("--exp-avg-sq-dtype", "bf16"),
        ]);
    }
    training.extend(optimizer_args(&t.optimizer));
    training.extend([
        arg("--clip-grad", t.recipe.clip_grad_norm.unwrap_or(0.0)),
        arg("--lr-decay-style", "constant"),
        arg("--seed", t.seed),
    ]);
    let data = vec![flag("--mock-data"), arg("--split", "100,0,0"), arg("--eval-iters", 0), arg("--log-interval", 1)];
    let mut groups = vec![("MODEL_ARGS", model)];
    if !moe.is_empty() {
        groups.push(("MOE_ARGS", moe));
    }
    groups.extend([("MODEL_PARALLEL_ARGS", parallel), ("TRAINING_ARGS", training), ("DATA_ARGS", data)]);
    groups
}

fn optimizer_args(o: &OptimizerPlan) -> Vec<Arg> {
    match *o {
        OptimizerPlan::Sgd { lr, momentum, weight_decay } => vec![
            arg("--optimizer", "sgd"),
            arg("--lr", lr),
            arg("--sgd-momentum", momentum),
            arg("--weight-decay", weight_decay),
        ],
        OptimizerPlan::Adam { lr, beta1, beta2, eps, weight_decay, .. } => vec![
            arg("--optimizer", "adam"),
            arg("--lr", lr),
            arg("--adam-beta1", beta1),
            arg("--adam-beta2", beta2),
            arg("--adam-eps", eps),
            arg("--weight-decay", weight_decay),
        ],
    }
}

/// A flag as the script writes it: a value with characters the shell reads (a
/// `--moe-layer-freq` pattern's brackets and stars) in double quotes; a list's values stay
/// words of their own (`--recompute-modules layernorm mlp`).
fn arg_text((name, value): &Arg) -> String {
    match value {
        Some(v) if v.chars().all(|c| c.is_ascii_alphanumeric() || "._,:/=+- ".contains(c)) => format!("{name} {v}"),
        Some(v) => format!("{name} \"{v}\""),
        None => name.to_string(),
    }
}

fn megatron(run: &Run<'_>) -> Vec<File> {
    let groups = megatron_args(run);
    let fsdp = matches!(run.layout.sharding, Sharding::Gradients | Sharding::Parameters);
    let mut sh = format!(
        "#!/bin/bash\n# {} on Megatron-LM core_v0.19 (megatron-core 0.19.2): pretrain_gpt.py, as its examples/ scripts run it.\n# Written by `pipec emit`; prediction.json holds what pipec predicts for this run.\n\n",
        run.plan.name
    );
    sh.push_str(if fsdp {
        "# Megatron-FSDP needs CUDA_DEVICE_MAX_CONNECTIONS unset (arguments.py:1100-1147)\nunset CUDA_DEVICE_MAX_CONNECTIONS\n"
    } else {
        "export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
    });
    let _ = writeln!(
        sh,
        "\nGPUS_PER_NODE={}\nNUM_NODES={}\nMASTER_ADDR=${{MASTER_ADDR:-localhost}}\nMASTER_PORT=${{MASTER_PORT:-6000}}\nNODE_RANK=${{NODE_RANK:-0}}\n",
        run.per_node, run.nodes
    );
    sh.push_str("DISTRIBUTED_ARGS=(\n    --nproc_per_node $GPUS_PER_NODE\n    --nnodes $NUM_NODES\n    --node_rank $NODE_RANK\n    --master_addr $MASTER_ADDR\n    --master_port $MASTER_PORT\n)\n");
    for (name, args) in &groups {
        let _ = writeln!(sh, "\n{name}=(");
        for a in args {
            let _ = writeln!(sh, "    {}", arg_text(a));
        }
        sh.push_str(")\n");
    }
    let expand: Vec<String> = groups.iter().map(|(n, _)| format!("${{{n}[@]}}")).collect();
    let _ = writeln!(sh, "\ntorchrun ${{DISTRIBUTED_ARGS[@]}} pretrain_gpt.py \\\n    {}", expand.join(" \\\n    "));
    let list: String = groups.iter().flat_map(|(_, args)| args.iter()).map(|a| arg_text(a) + "\n").collect();
    let sbatch = format!(
        "#!/bin/bash\n#SBATCH --job-name={}\n#SBATCH --nodes={}\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node={}\n#SBATCH --exclusive\n\n# one torchrun per node; train.sh is in this folder, run from Megatron-LM's checkout\nexport MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\nexport MASTER_PORT=6000\nsrun bash -c 'NODE_RANK=$SLURM_NODEID bash train.sh'\n",
        run.plan.name, run.nodes, run.per_node
    );
    vec![("train.sh".into(), sh), ("args.txt".into(), list), ("job.sbatch".into(), sbatch)]
}

/// torchtitan's llama3 model flavours (dim, layers, heads, kv heads, ffn width, rope θ),
/// from torchtitan/models/llama3/__init__.py:29-100 at v0.2.2 (the FFN widths computed by
/// llama3/model/model.py:330-336 from ffn_dim_multiplier and multiple_of); vocabulary 128256
/// (llama3/model/args.py:33), RMSNorm ε 1e-5, SwiGLU, no biases, untied output.
pub const LLAMA3_FLAVOURS: &[(&str, [usize; 5], f64)] = &[
    ("8B", [4096, 32, 32, 8, 14336], 500000.0),
    ("70B", [8192, 80, 64, 8, 28672], 500000.0),
    ("405B", [16384, 126, 128, 8, 53248], 500000.0),
];

/// torchtitan's vocabulary for its llama3 flavours.
pub const LLAMA3_VOCAB: usize = 128256;

fn llama3_flavour(g: &GptShape) -> Option<&'static str> {
    let b = &g.block;
    // llama3's attention: heads of d/heads, no query/key norms, window, sinks, latents or
    // dropout (a block with any of them is another model, not written as this one)
    let plain_attention =
        b.head_dim * b.heads == b.d && !b.qk_norm && b.window == 0 && !b.sinks && b.mla.is_none() && b.dropout == 0.0;
    let llama = b.norm == NormKind::RmsNorm
        && b.mlp == MlpKind::Swiglu
        && !b.bias
        && !b.qkv_bias
        && !g.tied
        && g.positions == 0
        && plain_attention;
    let dims = [b.d, g.layers, b.heads, b.kv_heads, b.ff];
    LLAMA3_FLAVOURS
        .iter()
        .find(|(_, d, rope)| llama && *d == dims && *rope == b.rope && g.vocab == LLAMA3_VOCAB && g.moe().is_none())
        .map(|(name, _, _)| *name)
}

/// torchtitan's name of a schedule.
fn torchtitan_schedule(kind: ScheduleKind) -> &'static str {
    match kind {
        ScheduleKind::Gpipe => "GPipe",
        ScheduleKind::Interleaved => "Interleaved1F1B",
        ScheduleKind::Zbv => "ZBVZeroBubble",
        ScheduleKind::DualPipeV => "DualPipeV",
        _ => "1F1B",
    }
}

fn toml_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => format!("\"{s}\""),
        other => other.to_string(),
    }
}

/// torchtitan v0.2.2's TOML sections as rows (section, key, value).
pub fn torchtitan_rows(run: &Run<'_>, flavour: &str) -> Vec<(&'static str, &'static str, serde_json::Value)> {
    let (l, t) = (&run.layout, &run.plan.training);
    let (lr, beta1, beta2, eps, wd) = match t.optimizer {
        OptimizerPlan::Adam { lr, beta1, beta2, eps, weight_decay, .. } => (lr, beta1, beta2, eps, weight_decay),
        OptimizerPlan::Sgd { lr, weight_decay, .. } => (lr, 0.9, 0.999, 1e-8, weight_decay),
    };
    let sharded = matches!(l.sharding, Sharding::Gradients | Sharding::Parameters);
    let dp = l.dp();
    let pipelined = l.pp() > 1;
    // torchtitan's op-level policy, written in the spec as its operations
    // its op-level policy, the one recompute inside the blocks its table runs
    let op_level = run.plan.schedule.block_recompute.is_some();
    let mut rows = vec![
        ("job", "dump_folder", json!("./outputs")),
        ("job", "description", json!(format!("{} (pipec emit)", run.plan.name))),
        ("model", "name", json!("llama3")),
        ("model", "flavor", json!(flavour)),
        ("optimizer", "name", json!("AdamW")),
        ("optimizer", "lr", json!(lr)),
        ("optimizer", "beta1", json!(beta1)),
        ("optimizer", "beta2", json!(beta2)),
        ("optimizer", "eps", json!(eps)),
        ("optimizer", "weight_decay", json!(wd)),
        ("lr_scheduler", "warmup_steps", json!(0)),
        // per data-parallel rank: a pipeline's microbatches, or the accumulated ones
        ("training", "local_batch_size", json!(if pipelined { t.batch_size / dp } else { run.micro })),
        ("training", "global_batch_size", json!(t.batch_size)),
        ("training", "seq_len", json!(run.seq)),
        ("training", "max_norm", json!(t.recipe.clip_grad_norm.unwrap_or(0.0))),
        ("training", "steps", json!(t.steps)),
        (
            "training",
            "mixed_precision_param",
            json!(if t.precision == Precision::Bf16 { "bfloat16" } else { "float32" }),
        ),
        ("training", "dataset", json!("c4_test")),
        ("parallelism", "data_parallel_replicate_degree", json!(if sharded { 1 } else { dp })),
        ("parallelism", "data_parallel_shard_degree", json!(if sharded { dp } else { 1 })),
        (
            "parallelism",
            "fsdp_reshard_after_forward",
            json!(if l.sharding == Sharding::Gradients { "never" } else { "default" }),
        ),
        ("parallelism", "tensor_parallel_degree", json!(l.tp)),
        ("parallelism", "enable_async_tensor_parallel", json!(l.tp_overlap)),
        ("parallelism", "pipeline_parallel_degree", json!(l.pp())),
        ("parallelism", "pipeline_parallel_schedule", json!(torchtitan_schedule(l.schedule))),
        ("parallelism", "pipeline_parallel_microbatch_size", json!(run.micro)),
        ("parallelism", "context_parallel_degree", json!(l.cp)),
        (
            "parallelism",
            "context_parallel_rotate_method",
            json!(if l.cp_comm == CpComm::Ring { "alltoall" } else { "allgather" }),
        ),
        ("parallelism", "expert_parallel_degree", json!(l.ep)),
        ("parallelism", "expert_tensor_parallel_degree", json!(l.etp)),
    ];
    if l.ep > 1 && l.moe_dispatch == crate::vocab::MoeDispatch::DeepEp {
        rows.push(("parallelism", "expert_parallel_comm_backend", json!("deepep")));
    }
    if pipelined {
        rows.extend([
            (
                "parallelism",
                "pipeline_parallel_layers_per_stage",
                json!(run.gpt.layers / (l.pp() * l.virtual_stages.max(1))),
            ),
            ("parallelism", "pipeline_parallel_first_stage_less_layers", json!(0)),
            ("parallelism", "pipeline_parallel_last_stage_less_layers", json!(0)),
        ]);
    }
    rows.push((
        "activation_checkpoint",
        "mode",
        json!(match (l.recompute, op_level) {
            (_, true) | (RecomputeKind::Selective, _) => "selective",
            (RecomputeKind::Full | RecomputeKind::SomeStages, false) => "full",
            (RecomputeKind::Off, false) => "none",
        }),
    ));
    if l.recompute == RecomputeKind::Selective || op_level {
        rows.push(("activation_checkpoint", "selective_ac_option", json!("op")));
    }
    // `torch.compile` on each block (`engine: { compile: [model] }`), which asynchronous
    // TP needs too, and on the loss (`[loss]`): what the plan priced
    let performance = run.plan.engine_performance.as_ref();
    let model =
        l.tp_overlap || performance.is_some_and(|p| p.family == super::performance::KernelFamily::TorchCompiled);
    let loss = performance.is_some_and(|p| p.loss_compiled);
    rows.push(("compile", "enable", json!(model || loss)));
    if model || loss {
        let components: Vec<&str> = CompileComponent::compiled((model, loss)).into_iter().map(Choice::name).collect();
        rows.push(("compile", "components", json!(components)));
    }
    // torchao's FP8 (job_config.py:731-792 at v0.2.2): the converter beside the model's
    // name, its settings in a section of their own
    if let Some(f) = t.fp8 {
        let converter =
            if f.recipe == crate::vocab::Fp8Recipe::Mxfp8 { "quantize.linear.mx" } else { "quantize.linear.float8" };
        let at = rows.iter().rposition(|r| r.0 == "model").map_or(0, |i| i + 1);
        rows.insert(at, ("model", "converters", json!([converter])));
        if converter == "quantize.linear.float8" {
            let gather = f.gather == crate::vocab::Fp8Storage::Fp8;
            rows.push(("quantize.linear.float8", "enable_fsdp_float8_all_gather", json!(gather)));
            rows.push(("quantize.linear.float8", "precompute_float8_dynamic_scale_for_fsdp", json!(gather)));
            if f.recipe == crate::vocab::Fp8Recipe::Rowwise {
                rows.push(("quantize.linear.float8", "recipe_name", json!("rowwise")));
            }
        }
    }
    rows
}

fn torchtitan(run: &Run<'_>) -> Result<Vec<File>, String> {
    let flavour = llama3_flavour(&run.gpt).ok_or_else(|| {
        let names: Vec<&str> = LLAMA3_FLAVOURS.iter().map(|(n, _, _)| *n).collect();
        format!("torchtitan 0.2.2 names its models by flavour; this model is none of llama3's ({}: torchtitan/models/llama3/__init__.py:29-100)", names.join(", "))
    })?;
    let rows = torchtitan_rows(run, flavour);
    let mut toml = format!("# {} for torchtitan v0.2.2, written by `pipec emit`\n", run.plan.name);
    let mut section = "";
    for (s, key, value) in &rows {
        if *s != section {
            let _ = write!(toml, "\n[{s}]\n");
            section = s;
        }
        let value = match value {
            serde_json::Value::Array(items) => {
                format!("[{}]", items.iter().map(toml_value).collect::<Vec<_>>().join(", "))
            }
            v => toml_value(v),
        };
        let _ = writeln!(toml, "{key} = {value}");
    }
    let launch = format!(
        "#!/bin/bash\n# {name} on torchtitan v0.2.2 (its run_train.sh's torchrun line), one per node\ntorchrun --nnodes {nodes} --nproc_per_node {g} --rdzv_backend c10d --rdzv_endpoint \"${{MASTER_ADDR:-localhost}}:${{MASTER_PORT:-29500}}\" \\\n    --local-ranks-filter 0 --role rank --tee 3 \\\n    -m torchtitan.train --job.config_file job.toml\n",
        name = run.plan.name,
        nodes = run.nodes,
        g = run.per_node
    );
    Ok(vec![("job.toml".into(), toml), ("launch.sh".into(), launch)])
}

/// DeepSpeed's `ds_config.json`.
pub fn deepspeed_config(run: &Run<'_>) -> serde_json::Value {
    let (l, t) = (&run.layout, &run.plan.training);
    let optimizer = match t.optimizer {
        OptimizerPlan::Adam { lr, beta1, beta2, eps, weight_decay, .. } => {
            json!({"type": "AdamW", "params": {"lr": lr, "betas": [beta1, beta2], "eps": eps, "weight_decay": weight_decay}})
        }
        OptimizerPlan::Sgd { lr, momentum, weight_decay } => {
            json!({"type": "SGD", "params": {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}})
        }
    };
    let mut c = json!({
        "train_batch_size": t.batch_size,
        "train_micro_batch_size_per_gpu": run.micro,
        "gradient_accumulation_steps": run.accumulation,
        "steps_per_print": 1,
        "zero_optimization": {"stage": l.sharding.level()},
        "bf16": {"enabled": t.precision == Precision::Bf16},
        "fp16": {"enabled": t.precision == Precision::Fp16},
        "optimizer": optimizer,
        "gradient_clipping": t.recipe.clip_grad_norm.unwrap_or(0.0),
    });
    if l.pp() > 1 {
        c["pipeline"] = json!({"stages": l.pp(), "partition": "uniform", "schedule": if l.schedule == ScheduleKind::DualPipeV { "DualPipeV" } else { "TrainSchedule" }});
    }
    if l.tp > 1 {
        c["tensor_parallel"] = json!({"autotp_size": l.tp, "tp_overlap_comm": l.tp_overlap});
    }
    if l.ep > 1 {
        c["expert_parallel"] = json!({"enabled": true, "autoep_size": l.ep, "expert_tensor_parallel_size": l.etp});
    }
    if l.recompute == RecomputeKind::Full {
        c["activation_checkpointing"] = json!({"partition_activations": false, "number_checkpoints": run.gpt.layers});
    }
    c
}

fn deepspeed(run: &Run<'_>) -> Vec<File> {
    let config = serde_json::to_string_pretty(&deepspeed_config(run)).unwrap_or_default() + "\n";
    let launch = format!(
        "#!/bin/bash\n# {name} on DeepSpeed 0.19.8: train.py is your training script (deepspeed.initialize with this config;\n# for a pipeline, deepspeed.pipe.PipelineModule(num_stages={pp}, partition_method=\"uniform\"))\ndeepspeed --hostfile hostfile --num_nodes {nodes} --num_gpus {g} train.py --deepspeed --deepspeed_config ds_config.json\n",
        name = run.plan.name,
        pp = run.layout.pp(),
        nodes = run.nodes,
        g = run.per_node
    );
    vec![("ds_config.json".into(), config), ("launch.sh".into(), launch)]
}
