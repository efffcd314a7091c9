//! A Megatron-LM launch — an examples/-style script (bash arrays of `pretrain_gpt.py`
//! arguments, `torchrun` with `--nproc_per_node`/`--nnodes`) or a plain argument list — as a
//! spec. The text is read as the shell would expand it for these purposes: comments and line
//! continuations dropped, `NAME=value` assignments substituted (`$NAME`, `${NAME}`,
//! `${NAME:-default}`), quotes removed and words split (the examples expand their arrays
//! unquoted, so `"--fp8-format hybrid"` is two words). Defaults are Megatron-LM 0.19's
//! (megatron/training/arguments.py at core_v0.19.0).

use std::collections::BTreeMap;

use pipec_plan::model::{MlpKind, NormKind};
use pipec_plan::vocab::{CpComm, Engine, MoeDispatch, Precision, ScheduleKind, Sharding};

use super::engine::{model_text, write_spec, AttentionFacts, ModelFacts, MoeFacts, RunFacts};

/// Flags that change nothing pipec plans or predicts (logging, checkpoints, data paths,
/// kernels' choice), read and left out silently.
const IGNORED: &[&str] = &[
    "--use-mcore-models",
    // the routed experts through Transformer Engine's grouped linear: how pipec prices
    // Megatron-LM's experts anyway (`KernelFamily::grouped_expert_gemm`)
    "--moe-grouped-gemm",
    "--init-method-std",
    "--attention-dropout",
    "--hidden-dropout",
    "--no-masked-softmax-fusion",
    "--no-position-embedding",
    "--rotary-percent",
    "--attention-backend",
    "--tokenizer-type",
    "--tokenizer-model",
    "--mock-data",
    "--data-path",
    "--data-cache-path",
    "--tiktoken-pattern",
    "--split",
    "--num-workers",
    "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files",
    "--log-interval",
    "--eval-iters",
    "--eval-interval",
    "--save-interval",
    "--save",
    "--load",
    "--tensorboard-dir",
    "--log-throughput",
    "--profile",
    "--profile-step-start",
    "--profile-step-end",
    "--ckpt-format",
    "--distributed-timeout-minutes",
    "--no-load-optim",
    "--no-load-rng",
    "--wandb-project",
    "--wandb-exp-name",
    "--manual-gc",
    "--empty-unused-memory-level",
    "--exit-duration-in-mins",
    "--cross-entropy-loss-fusion",
    "--no-rope-fusion",
    "--make-vocab-size-divisible-by",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--min-lr",
    "--lr-decay-style",
    "--lr-decay-iters",
    "--lr-decay-samples",
    "--lr-warmup-iters",
    "--lr-warmup-samples",
    "--lr-warmup-fraction",
    "--grad-reduce-in-bf16",
    "--moe-grouped-gemm",
    "--moe-router-load-balancing-type",
    "--moe-permute-fusion",
    "--num-workers",
    "--vocab-file",
    "--merge-file",
    "--nproc_per_node",
    "--nnodes",
    "--node_rank",
    "--master_addr",
    "--master_port",
    "--use-flash-attn",
    "--calculate-per-token-loss",
    "--no-gradient-accumulation-fusion",
];

/// The words of a launch script or argument list, expanded as the shell would for flags.
pub fn words(text: &str) -> Vec<String> {
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    let mut out = Vec::new();
    let joined = text.replace("\\\n", " ");
    for line in joined.lines() {
        let line = strip_comment(line);
        let trimmed = line.trim().trim_start_matches("export ").trim();
        // `NAME=value` (not an array): remembered for substitution
        if let Some((name, value)) = trimmed.split_once('=') {
            let plain = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if plain && !value.starts_with('(') && !value.contains(' ') {
                let v = expand(value, &vars);
                vars.insert(name.to_string(), unquote(&v));
                continue;
            }
        }
        // `NAME=( ...`: an array's items
        let items = match trimmed.split_once("=(") {
            Some((name, rest)) if name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') => rest.to_string(),
            _ => line,
        };
        let expanded = expand(&items, &vars);
        out.extend(expanded.split_whitespace().map(unquote).filter(|w| !w.is_empty()));
    }
    out
}

fn strip_comment(line: &str) -> String {
    let (mut quote, mut out) = (None, String::new());
    let mut prev = ' ';
    for c in line.chars() {
        match (c, quote) {
            ('#', None) if prev.is_whitespace() => break,
            ('"' | '\'', None) => quote = Some(c),
            (q, Some(open)) if q == open => quote = None,
            _ => {}
        }
        out.push(c);
        prev = c;
    }
    out
}

fn unquote(word: &str) -> String {
    word.chars().filter(|c| !matches!(c, '"' | '\'' | '(' | ')')).collect()
}

/// `$NAME`, `${NAME}` and `${NAME:-default}` substituted (unknown names: their default, or
/// left as written).
fn expand(text: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(inner) = after.strip_prefix('{') {
            let Some(end) = inner.find('}') else {
                out.push_str(&rest[at..]);
                return out;
            };
            let body = &inner[..end];
            let (name, default) = body.split_once(":-").map_or((body, None), |(n, d)| (n, Some(d)));
            match (vars.get(name), default) {
                (Some(v), _) => out.push_str(v),
                (None, Some(d)) => out.push_str(&unquote(d)),
                (None, None) => out.push_str(&format!("${{{body}}}")),
            }
            rest = &inner[end + 1..];
        } else {
            let len = after.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').count();
            match vars.get(&after[..len]) {
                Some(v) if len > 0 => out.push_str(v),
                _ => out.push_str(&rest[at..at + 1 + len]),
            }
            rest = &after[len..];
        }
    }
    out.push_str(rest);
    out
}

/// The flags of `words` with their values (None: a switch); the first value of a flag given
/// twice wins, as the examples' arrays never repeat one.
fn flags(words: &[String]) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    for (i, w) in words.iter().enumerate() {
        if !w.starts_with("--") {
            continue;
        }
        let value = words.get(i + 1).filter(|v| !v.starts_with("--")).cloned();
        out.entry(w.clone()).or_insert(value);
    }
    out
}

struct Args {
    flags: BTreeMap<String, Option<String>>,
    /// Every word after each flag up to the next flag (a list argument's values).
    lists: BTreeMap<String, Vec<String>>,
    used: std::collections::BTreeSet<String>,
}

/// Each flag's following words up to the next flag (`--recompute-modules core_attn mlp`).
fn lists(words: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for (i, w) in words.iter().enumerate().filter(|(_, w)| w.starts_with("--")) {
        let values = words[i + 1..].iter().take_while(|v| !v.starts_with("--")).cloned().collect();
        out.entry(w.clone()).or_insert(values);
    }
    out
}

impl Args {
    fn list(&mut self, name: &str) -> Vec<String> {
        self.used.insert(name.to_string());
        self.lists.get(name).cloned().unwrap_or_default()
    }
    fn has(&mut self, name: &str) -> bool {
        self.used.insert(name.to_string());
        self.flags.contains_key(name)
    }
    fn text(&mut self, name: &str) -> Option<String> {
        self.used.insert(name.to_string());
        self.flags.get(name).cloned().flatten()
    }
    fn count(&mut self, name: &str) -> Result<Option<usize>, String> {
        match self.text(name) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| format!("`{name} {v}`: not a whole number")),
        }
    }
    fn count_or(&mut self, name: &str, default: usize) -> Result<usize, String> {
        Ok(self.count(name)?.unwrap_or(default))
    }
    fn need(&mut self, name: &str) -> Result<usize, String> {
        self.count(name)?.ok_or_else(|| format!("`{name}` is missing: Megatron-LM requires it"))
    }
    fn number_or(&mut self, name: &str, default: f64) -> Result<f64, String> {
        match self.text(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("`{name} {v}`: not a number")),
        }
    }
}

/// Transformer Engine's FP8 as Megatron-LM turns it on (TransformerConfig's `fp8`,
/// `fp8_recipe`, `fp8_param` at core_v0.19.0, transformer_config.py:566-590; the
/// `--fp8-param-gather` switch, arguments.py:1935): `--fp8-format e4m3|hybrid` with the bf16
/// weights it casts, the recipe `--fp8-recipe` (default `delayed`), FP8 inputs kept for the
/// backward and FP8 weight copies cached between microbatches (Transformer Engine's), the
/// gathers of a sharded optimizer in FP8 with `--fp8-param-gather`.
fn fp8(a: &mut Args, precision: Precision, sharding: Sharding) -> Result<Option<pipec_plan::plan::Fp8Plan>, String> {
    use pipec_plan::vocab::{Fp8Recipe, Fp8Storage};
    let Some(format) = a.text("--fp8-format") else {
        for f in ["--fp8-recipe", "--fp8-param-gather"] {
            if a.has(f) {
                return Err(format!("`{f}` without `--fp8-format`: Megatron-LM trains no FP8 without a format"));
            }
        }
        return Ok(None);
    };
    if !matches!(format.as_str(), "e4m3" | "hybrid") {
        return Err(format!("`--fp8-format {format}` is not one of Megatron-LM's formats (e4m3, hybrid)"));
    }
    if precision != Precision::Bf16 {
        return Err(format!(
            "`--fp8-format {format}` without `--bf16`: pipec plans FP8 products beside bf16 weights and activations"
        ));
    }
    let recipe = match a.text("--fp8-recipe").as_deref() {
        None | Some("delayed") => Fp8Recipe::Delayed,
        Some("tensorwise") => Fp8Recipe::Tensorwise,
        Some("blockwise") => Fp8Recipe::Blockwise,
        Some("mxfp8") => Fp8Recipe::Mxfp8,
        Some(other) => {
            return Err(format!("`--fp8-recipe {other}` has no pipec recipe (delayed, tensorwise, blockwise, mxfp8)"))
        }
    };
    let gather = if a.has("--fp8-param-gather") {
        if sharding == Sharding::None {
            // arguments.py:1058-1063
            return Err(
                "`--fp8-param-gather` needs the distributed optimizer or FSDP (Megatron-LM refuses it otherwise)"
                    .into(),
            );
        }
        Fp8Storage::Fp8
    } else {
        Fp8Storage::Bf16
    };
    Ok(Some(pipec_plan::plan::Fp8Plan { gather, ..pipec_plan::plan::Fp8Plan::of_engine(Engine::Megatron, recipe) }))
}

/// The spec's `recompute` for Megatron-LM's (transformer_config.py:1724-1832 at core_v0.19.0):
/// `selective` of the attention core (its default `--recompute-modules`), selective of other
/// modules `{ modules: [...] }`, full of the first N layers of each model chunk
/// (`--recompute-method block`) `{ layers: N }`, full of every layer `true`. `chunk`: the
/// layers of a model chunk.
fn recompute(a: &mut Args, chunk: usize) -> Result<String, String> {
    use pipec_plan::vocab::{Choice, RecomputeModule};
    let method = a.text("--recompute-method");
    let layers = a.count("--recompute-num-layers")?;
    let modules = a.list("--recompute-modules");
    Ok(match a.text("--recompute-granularity").as_deref() {
        None if a.has("--recompute-activations") => "selective".into(),
        None => "false".into(),
        Some("full") => match (method.as_deref(), layers) {
            (Some("block"), Some(n)) if n < chunk => format!("{{ layers: {n} }}"),
            _ => "true".into(),
        },
        Some("selective") if modules.is_empty() || modules == ["core_attn"] => "selective".into(),
        Some("selective") => {
            for m in &modules {
                if !<RecomputeModule as Choice>::ALL.iter().any(|r| r.name() == m) {
                    return Err(format!("`--recompute-modules {m}` is not a module pipec recomputes ({})", {
                        <RecomputeModule as Choice>::ALL.iter().map(|r| r.name()).collect::<Vec<_>>().join(", ")
                    }));
                }
            }
            format!("{{ modules: [{}] }}", modules.join(", "))
        }
        Some(other) => return Err(format!("`--recompute-granularity {other}` is not full or selective")),
    })
}

/// Whether a bf16 run reduces its gradients in bf16 (`--grad-reduce-in-bf16`; without it
/// `--bf16` accumulates and reduces in fp32, arguments.py:1181-1194) and keeps Adam's
/// moments in bf16 (`--use-precision-aware-optimizer` with `--exp-avg-dtype` and
/// `--exp-avg-sq-dtype` bf16, arguments.py:3500-3517). pipec keeps both moments in one
/// precision: other dtypes are refused, not dropped (they change the memory).
fn reduced_and_kept(a: &mut Args, precision: Precision) -> Result<(bool, bool), String> {
    let grad = a.has("--grad-reduce-in-bf16") && precision != Precision::Fp32;
    if !a.has("--use-precision-aware-optimizer") {
        for f in ["--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-grads-dtype", "--main-params-dtype"] {
            let _ = a.text(f);
        }
        return Ok((grad, false));
    }
    let dtype = |a: &mut Args, f: &str| a.text(f).unwrap_or_else(|| "fp32".into());
    let (first, second) = (dtype(a, "--exp-avg-dtype"), dtype(a, "--exp-avg-sq-dtype"));
    let (grads, params) = (dtype(a, "--main-grads-dtype"), dtype(a, "--main-params-dtype"));
    if params != "fp32" {
        return Err(format!("`--main-params-dtype {params}`: pipec keeps fp32 master weights under Megatron-LM"));
    }
    match (first.as_str(), second.as_str()) {
        ("fp32", "fp32") => Ok((grad || grads == "bf16", false)),
        ("bf16", "bf16") => Ok((grad || grads == "bf16", true)),
        _ => Err(format!(
            "`--exp-avg-dtype {first} --exp-avg-sq-dtype {second}`: pipec keeps both of Adam's moments in one precision (`state_precision`: fp32 or bf16)"
        )),
    }
}

/// The spec a Megatron-LM launch describes; `world` when the text does not give the GPUs
/// (`--nproc_per_node` × `--nnodes`).
pub fn import(text: &str, name: &str, world: Option<usize>) -> Result<String, String> {
    let words = words(text);
    let mut a = Args { flags: flags(&words), lists: lists(&words), used: Default::default() };
    if a.flags.is_empty() {
        return Err("no `--flag` arguments: not a Megatron-LM argument list or launch script".into());
    }
    let model = model(&mut a)?;
    let run = run(&mut a, &model, world)?;
    let mut dropped: Vec<String> = Vec::new();
    for (flag, value) in &a.flags {
        if !a.used.contains(flag) && !IGNORED.contains(&flag.as_str()) {
            dropped.push(value.as_ref().map_or_else(|| flag.clone(), |v| format!("{flag} {v}")));
        }
    }
    write_spec(Engine::Megatron, "a Megatron-LM launch", name, &model_text(&model), &run, &dropped)
}

fn model(a: &mut Args) -> Result<ModelFacts, String> {
    let d = a.need("--hidden-size")?;
    let heads = a.need("--num-attention-heads")?;
    let swiglu = a.has("--swiglu");
    // arguments.py:1280-1290: 4h, or with SwiGLU int(4h·2/3 / 64)·64
    let ff_default = if swiglu { (4 * d * 2 / 3) / 64 * 64 } else { 4 * d };
    let gqa = a.has("--group-query-attention");
    let groups = a.count_or("--num-query-groups", heads)?;
    let seq = a.need("--seq-length")?;
    let positions = a.count_or("--max-position-embeddings", seq)?;
    let kind = a.text("--position-embedding-type").unwrap_or_else(|| "learned_absolute".into());
    let rope = match kind.as_str() {
        "rope" => a.number_or("--rotary-base", 10000.0)?,
        "learned_absolute" | "none" => 0.0,
        other => {
            return Err(format!(
                "`--position-embedding-type {other}` is not a pipec position embedding (learned_absolute, rope, none)"
            ))
        }
    };
    let norm = match a.text("--normalization").as_deref() {
        None | Some("LayerNorm") => NormKind::LayerNorm,
        Some("RMSNorm") => NormKind::RmsNorm,
        Some(other) => return Err(format!("`--normalization {other}` is not LayerNorm or RMSNorm")),
    };
    let bias = !a.has("--disable-bias-linear");
    let mlp = if swiglu {
        MlpKind::Swiglu
    } else if a.has("--openai-gelu") {
        MlpKind::GeluTanh
    } else {
        MlpKind::Gelu
    };
    let layers = a.need("--num-layers")?;
    let moe = match a.count("--num-experts")? {
        None => None,
        Some(experts) => Some(MoeFacts {
            dense: dense_first(a, layers)?,
            dense_ff: a.count_or("--ffn-hidden-size", ff_default)?,
            experts,
            top_k: a.count_or("--moe-router-topk", 2)?,
            shared: match a.count("--moe-shared-expert-intermediate-size")? {
                None => 0,
                Some(w) => w / a.count("--moe-ffn-hidden-size")?.unwrap_or(ff_default).max(1),
            },
            aux_loss: a.number_or("--moe-aux-loss-coeff", 0.0)?,
            sigmoid: a.text("--moe-router-score-function").as_deref() == Some("sigmoid"),
            norm_topk: !a.has("--moe-router-pre-softmax"),
            capacity: a.number_or("--moe-expert-capacity-factor", 0.0)?,
            scale: a.number_or("--moe-router-topk-scaling-factor", 1.0)?,
            groups: a.count("--moe-router-num-groups")?.unwrap_or(0),
            group_top: a.count("--moe-router-group-topk")?.unwrap_or(0),
            expert_bias: expert_bias(a)?,
        }),
    };
    let attention = attention(a, d, heads)?;
    if attention.full_every > 0 {
        let n = attention.full_every;
        if !layers.is_multiple_of(n) || moe.as_ref().is_some_and(|m| m.dense > 0) {
            return Err(format!(
                "`--window-attn-skip-freq {n}` over {layers} layers{}: pipec's engine specs repeat whole groups of {n} blocks (write the layers in a spec by hand)",
                if moe.as_ref().is_some_and(|m| m.dense > 0) { " after dense ones" } else { "" }
            ));
        }
    }
    let dense_ff = a.count_or("--ffn-hidden-size", ff_default)?;
    let ff = match &moe {
        Some(_) => a.count("--moe-ffn-hidden-size")?.unwrap_or(dense_ff),
        None => dense_ff,
    };
    Ok(ModelFacts {
        vocab: a.count("--vocab-size")?.ok_or(
            "`--vocab-size` is missing: pipec needs the vocabulary (Megatron reads it from the tokenizer otherwise)",
        )?,
        layers,
        d,
        heads,
        kv_heads: if gqa { groups } else { heads },
        ff,
        seq,
        positions: if rope == 0.0 && kind == "learned_absolute" { positions } else { 0 },
        rope,
        norm,
        eps: a.number_or("--norm-epsilon", 1e-5)?,
        mlp,
        bias,
        qkv_bias: bias || a.has("--add-qkv-bias"),
        tied: !a.has("--untie-embeddings-and-output-weights"),
        moe,
        attention,
        // multi-token prediction's modules (transformer_config.py:68-75: the weight 0.1
        // unless given)
        mtp: match a.count("--mtp-num-layers")? {
            None | Some(0) => None,
            Some(depth) => Some(pipec_plan::model::Mtp {
                depth,
                weight: a.number_or("--mtp-loss-scaling-factor", pipec_plan::model::Mtp::DEFAULT_WEIGHT)?,
            }),
        },
    })
}

/// `--moe-layer-freq`: a mixture of experts in every block (1, the default), or the dense
/// blocks first and experts in the rest (`([0]*k+[1]*n)`, k + n the layers); any other
/// pattern is refused by name.
fn dense_first(a: &mut Args, layers: usize) -> Result<usize, String> {
    let Some(text) = a.text("--moe-layer-freq") else { return Ok(0) };
    if text.trim() == "1" {
        return Ok(0);
    }
    // the script's words lose the pattern's outer parentheses with its quotes
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let bare = compact.strip_prefix('(').and_then(|r| r.strip_suffix(')')).unwrap_or(&compact);
    let parsed = bare
        .strip_prefix("[0]*")
        .and_then(|r| r.split_once("+[1]*"))
        .and_then(|(k, n)| Some((k.parse::<usize>().ok()?, n.parse::<usize>().ok()?)));
    match parsed {
        Some((k, n)) if k + n == layers => Ok(k),
        Some((k, n)) => Err(format!("`--moe-layer-freq {text}` lists {} layers, and `--num-layers` is {layers}", k + n)),
        None => Err(format!(
            "`--moe-layer-freq {text}`: pipec reads a mixture of experts in every block (1) or dense blocks first (`([0]*k+[1]*n)`)"
        )),
    }
}

/// `--moe-router-enable-expert-bias`: pipec's expert bias is fixed (transformers keeps
/// it so), Megatron-LM's moves by `--moe-router-bias-update-rate` (1e-3 by default) after
/// every step; only a rate of 0 is read.
fn expert_bias(a: &mut Args) -> Result<bool, String> {
    if !a.has("--moe-router-enable-expert-bias") {
        return Ok(false);
    }
    let rate = a.number_or("--moe-router-bias-update-rate", 1e-3)?;
    if rate != 0.0 {
        return Err(format!("`--moe-router-enable-expert-bias` with `--moe-router-bias-update-rate {rate}` moves the bias after every step; pipec's expert bias is fixed (write the rate as 0)"));
    }
    Ok(true)
}

/// The attention's shape (core_v0.19.0's TransformerConfig and MLATransformerConfig):
/// `--kv-channels` (each head's size, else hidden/heads), `--qk-layernorm`, `--window-size
/// L,0` (TE's window: each query sees the L keys before it and itself: pipec's window L + 1),
/// `--softmax-type learnable` (a learned offset per head: attention sinks), and
/// `--multi-latent-attention` with its ranks and head sizes (arguments.py's defaults: kv
/// rank 32, query and key heads 128 + 64 rotary, values 128, no query latent), and
/// `--use-rope-scaling` (Llama 3.1's, `--rope-scaling-factor`, 8 by default). A window
/// that also looks ahead, the skip pattern of alternating windows, the fixed offset and
/// YaRN on a latent block are refused by name.
fn attention(a: &mut Args, d: usize, heads: usize) -> Result<AttentionFacts, String> {
    let head_dim = a.count("--kv-channels")?.filter(|&h| h * heads != d);
    let window = match a.text("--window-size") {
        None => 0,
        Some(w) => {
            let parts: Vec<&str> = w.trim_matches(|c| c == '(' || c == ')').split(',').map(str::trim).collect();
            match parts.as_slice() {
                [left, "0"] => match left.parse::<i64>() {
                    Ok(-1) => 0,
                    Ok(l) if l >= 0 => l as usize + 1,
                    _ => return Err(format!("`--window-size {w}`: the left size must be a whole number or -1")),
                },
                _ => {
                    return Err(format!(
                        "`--window-size {w}` looks ahead of each position: pipec's windows are causal (L,0)"
                    ))
                }
            }
        }
    };
    // every N-th layer attends fully (utils.py is_layer_window_attention); without a window
    // it changes nothing
    let full_every = match a.text("--window-attn-skip-freq") {
        None => 0,
        Some(_) if window == 0 => 0,
        Some(f) => match f.trim().parse::<usize>() {
            Ok(n) if n >= 2 => n,
            // every layer full: no window anywhere
            Ok(1) => 1,
            Ok(_) | Err(_) => {
                return Err(format!(
                    "`--window-attn-skip-freq {f}`: pipec reads a whole number N (every N-th layer attends fully), not a list pattern (write the layers in a spec by hand)"
                ))
            }
        },
    };
    let sinks = match a.text("--softmax-type").as_deref() {
        None | Some("vanilla") => false,
        Some("learnable") => true,
        Some(other) => {
            return Err(format!("`--softmax-type {other}` is not pipec's: vanilla, or learnable (attention sinks)"))
        }
    };
    let mla = if a.has("--multi-latent-attention") {
        if a.text("--rope-type").as_deref().unwrap_or("yarn") != "rope" {
            return Err("multi-head latent attention with YaRN (`--rope-type yarn`, Megatron-LM's default for it): its softmax scale is not pipec's; write `--rope-type rope`".into());
        }
        Some(pipec_plan::model::Mla {
            q_lora: a.count("--q-lora-rank")?.unwrap_or(0),
            kv_lora: a.count_or("--kv-lora-rank", 32)?,
            rope_dim: a.count_or("--qk-pos-emb-head-dim", 64)?,
            v_head_dim: a.count_or("--v-head-dim", 128)?,
            mscale_all_dim: 0.0,
        })
    } else {
        None
    };
    let head_dim = match mla {
        Some(_) => Some(a.count_or("--qk-head-dim", 128)?),
        None => head_dim,
    };
    let llama3_rope_factor =
        if a.has("--use-rope-scaling") { Some(a.number_or("--rope-scaling-factor", 8.0)?) } else { None };
    let (window, full_every) = if full_every == 1 { (0, 0) } else { (window, full_every) };
    Ok(AttentionFacts {
        head_dim,
        qk_norm: a.has("--qk-layernorm"),
        window,
        full_every,
        sinks,
        mla,
        llama3_rope_factor,
    })
}

fn run(a: &mut Args, m: &ModelFacts, world: Option<usize>) -> Result<RunFacts, String> {
    let per_node = a.count("--nproc_per_node")?;
    let nodes = a.count("--nnodes")?;
    let world = match (world, per_node, nodes) {
        (Some(w), _, _) => w,
        (None, Some(g), n) => g * n.unwrap_or(1),
        (None, None, _) => {
            return Err("the GPU count is not in the text (`--nproc_per_node`, `--nnodes`): give --gpus".into())
        }
    };
    let tp = a.count_or("--tensor-model-parallel-size", 1)?;
    let pp = a.count_or("--pipeline-model-parallel-size", 1)?;
    // a split written layer by layer: its chunks give the virtual stages (arguments.py:893-917)
    let laid_out = match a.text("--pipeline-model-parallel-layout") {
        None => None,
        Some(text) => {
            let (blocks, mtp) = pipec_plan::engine::capability::parse_megatron_layout(&text)
                .map_err(|e| format!("`--pipeline-model-parallel-layout {text}`: {e}"))?;
            if !blocks.len().is_multiple_of(pp.max(1)) {
                return Err(format!(
                    "`--pipeline-model-parallel-layout` has {} chunks, not a multiple of the pipeline's {pp} stages",
                    blocks.len()
                ));
            }
            // multi-token prediction's modules as the layout places them and the flag counts
            // them (pipeline_parallel_layer_layout.py:104-107)
            if mtp != m.mtp.map_or(0, |p| p.depth) {
                return Err(format!(
                    "`--pipeline-model-parallel-layout` places {mtp} multi-token-prediction modules, `--mtp-num-layers` {}",
                    m.mtp.map_or(0, |p| p.depth)
                ));
            }
            Some(blocks)
        }
    };
    let vpp = match (
        &laid_out,
        a.count("--num-virtual-stages-per-pipeline-rank")?,
        a.count("--num-layers-per-virtual-pipeline-stage")?,
    ) {
        (Some(blocks), _, _) => blocks.len() / pp.max(1),
        (None, Some(v), _) => v,
        (None, None, Some(k)) => m.layers / pp.max(1) / k.max(1),
        (None, None, None) => 1,
    };
    // the first and (or) the last rank's blocks given, the rest shared evenly
    let ends = (a.count("--decoder-first-pipeline-num-layers")?, a.count("--decoder-last-pipeline-num-layers")?);
    let laid_out = match (laid_out, ends) {
        (Some(blocks), (None, None)) => Some(blocks),
        (None, (None, None)) => None,
        (Some(_), _) => {
            return Err("`--pipeline-model-parallel-layout` beside `--decoder-first/last-pipeline-num-layers`: Megatron-LM takes one of them".into())
        }
        (None, ends) => Some(
            pipec_plan::engine::capability::megatron_uneven_ranks(m.layers, pp, vpp, ends)
                .map_err(|e| format!("`--decoder-first/last-pipeline-num-layers`: {e}"))?,
        ),
    };
    let recompute = recompute(a, m.layers / (pp * vpp).max(1))?;
    let sharding = if a.has("--use-megatron-fsdp") {
        match a.text("--data-parallel-sharding-strategy").as_deref() {
            Some("no_shard") => Sharding::None,
            Some("optim") => Sharding::Optimizer,
            Some("optim_grads") => Sharding::Gradients,
            _ => Sharding::Parameters,
        }
    } else if a.has("--use-distributed-optimizer") {
        Sharding::Optimizer
    } else {
        Sharding::None
    };
    let precision = if a.has("--bf16") {
        Precision::Bf16
    } else if a.has("--fp16") {
        Precision::Fp16
    } else {
        Precision::Fp32
    };
    let fp8 = fp8(a, precision, sharding)?;
    let (grad_bf16, state_bf16) = reduced_and_kept(a, precision)?;
    let micro = a.need("--micro-batch-size")?;
    let cp = a.count_or("--context-parallel-size", 1)?;
    let dp = world / (tp * pp * cp).max(1);
    let optimizer = match a.text("--optimizer").as_deref() {
        None | Some("adam") => (
            "adamw",
            [
                a.number_or("--lr", 1e-4)?,
                a.number_or("--adam-beta1", 0.9)?,
                a.number_or("--adam-beta2", 0.999)?,
                a.number_or("--adam-eps", 1e-8)?,
                a.number_or("--weight-decay", 0.01)?,
            ],
        ),
        Some("sgd") => (
            "sgd",
            [
                a.number_or("--lr", 1e-4)?,
                a.number_or("--sgd-momentum", 0.9)?,
                0.0,
                0.0,
                a.number_or("--weight-decay", 0.01)?,
            ],
        ),
        Some(other) => return Err(format!("`--optimizer {other}` is not adam or sgd")),
    };
    Ok(RunFacts {
        compile: (false, false),
        world,
        tp,
        pp,
        cp,
        ep: a.count_or("--expert-model-parallel-size", 1)?,
        // arguments.py:587-588: the tensor-parallel degree unless written
        etp: a.count_or("--expert-tensor-parallel-size", tp)?,
        // arguments.py:985-996: the embedding and the loss counted as layers of the split
        split_ends: (a.has("--account-for-embedding-in-pipeline-split"), a.has("--account-for-loss-in-pipeline-split")),
        chunk_blocks: laid_out,
        schedule: if pp == 1 {
            ScheduleKind::DpOnly
        } else if vpp > 1 {
            ScheduleKind::Interleaved
        } else {
            ScheduleKind::OneFOneB
        },
        virtual_stages: vpp,
        sharding,
        sequence_parallel: a.has("--sequence-parallel"),
        tp_overlap: a.has("--tp-comm-overlap"),
        // the flex dispatcher's DeepEP and HybridEP send a token once per node
        // (transformer_config.py:862-869); any other dispatcher exchanges a copy per expert
        moe_dispatch: match (
            a.text("--moe-token-dispatcher-type").as_deref(),
            a.text("--moe-flex-dispatcher-backend").as_deref(),
        ) {
            (Some("flex"), Some("deepep" | "hybridep")) => MoeDispatch::DeepEp,
            _ => MoeDispatch::AllToAll,
        },
        ep_overlap: a.has("--overlap-moe-expert-parallel-comm"),
        cp_comm: if a.text("--cp-comm-type").as_deref() == Some("p2p") { CpComm::Ring } else { CpComm::AllGather },
        recompute,
        precision,
        fp8,
        grad_bf16,
        state_bf16,
        micro,
        // arguments.py:674-688: mbs·DP without a global batch
        global: a.count("--global-batch-size")?.unwrap_or(micro * dp),
        steps: match a.count("--train-iters")? {
            Some(s) => s,
            None => a
                .count("--train-samples")?
                .map_or(1, |s| s / a.count("--global-batch-size").ok().flatten().unwrap_or(micro * dp).max(1)),
        },
        optimizer,
        clip: Some(a.number_or("--clip-grad", 1.0)?),
        seed: a.count_or("--seed", 1234)? as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_is_read_as_the_shell_expands_it() {
        let script = "GPUS=8 # eight\nNODES=${SLURM_NNODES:-\"2\"}\nA=(\n    --nproc_per_node $GPUS\n    --nnodes $NODES \\\n    \"--fp8-format hybrid\"\n#    --bf16\n)\ntorchrun ${A[@]} x.py\n";
        let w = words(script);
        assert_eq!(
            w,
            ["--nproc_per_node", "8", "--nnodes", "2", "--fp8-format", "hybrid", "torchrun", "${A[@]}", "x.py"]
        );
    }
}
