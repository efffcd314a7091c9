//! A Hugging Face `config.json` becomes a spec (`pipec import`) — its `model` section written
//! as pipec layers (GPT-2, Llama, Mistral, Mixtral and Qwen2 families; BERT as a sequence
//! classifier), with a cluster, an `auto`
//! strategy and a training section to edit. Every field of the config that changes what
//! the model computes is either translated or refused by name; fields that do not (token
//! ids, dtype, versions, initialisation) are ignored, and the generic fields every saved
//! `PretrainedConfig` carries are ignored with a note when they have the value that changes
//! nothing. Configs saved by `transformers` 4.x and 5.x are read alike (5.x's `dtype` and
//! `rope_parameters` for 4.x's `torch_dtype` and `rope_theta`).

use serde_json::{Map, Value};

/// Fields no family's computation depends on.
const IGNORED: &[&str] = &[
    "_name_or_path",
    "architectures",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
    // transformers 5.x's name for `torch_dtype`
    "dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "pretraining_tp",
    "max_window_layers",
    "task_specific_params",
    "n_special",
    "predict_special_tokens",
    "summary_activation",
    "summary_first_dropout",
    "summary_proj_to_labels",
    "summary_type",
    "summary_use_proj",
    "reorder_and_upcast_attn",
    "tokenizer_class",
    "bos_token",
    "eos_token",
    "gradient_checkpointing",
    "label2id",
    "cls_token_id",
];

/// A field every `PretrainedConfig` carries (transformers 4.x and 5.x, `configuration_utils.py`)
/// whatever the model: `inert` says whether its value leaves the model's computation as it
/// is (then the field is ignored and listed in a note), `why` what another value would change.
struct Generic {
    key: &'static str,
    inert: fn(&Value) -> bool,
    why: &'static str,
}

fn any_value(_: &Value) -> bool {
    true
}

fn is_false(v: &Value) -> bool {
    v.as_bool() == Some(false)
}

fn is_zero(v: &Value) -> bool {
    v.as_u64() == Some(0)
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// The generic fields, in `PretrainedConfig`'s order. Output switches (`return_dict`,
/// `output_hidden_states`, ...), TorchScript and TensorFlow flags, generation defaults and
/// task names change nothing a training step computes; an encoder-decoder, cross-attention,
/// pruned heads or a chunked feed-forward do. `id2label`/`label2id`/`num_labels` define a
/// head only for a classifier (BERT, which reads them first); a causal LM has none.
const GENERIC: &[Generic] = &[
    Generic { key: "return_dict", inert: any_value, why: "" },
    Generic { key: "output_hidden_states", inert: any_value, why: "" },
    Generic { key: "output_attentions", inert: any_value, why: "" },
    Generic { key: "torchscript", inert: any_value, why: "" },
    Generic { key: "use_bfloat16", inert: any_value, why: "" },
    Generic { key: "tf_legacy_loss", inert: any_value, why: "" },
    Generic {
        key: "pruned_heads",
        inert: is_empty,
        why: "pruned heads remove attention heads from some layers, and pipec's blocks keep every head",
    },
    Generic {
        key: "chunk_size_feed_forward",
        inert: is_zero,
        why: "a chunked feed-forward is computed in pieces, which pipec's blocks do not do",
    },
    Generic {
        key: "is_encoder_decoder",
        inert: is_false,
        why: "an encoder-decoder model has an encoder and cross-attention that pipec does not import",
    },
    Generic { key: "is_decoder", inert: any_value, why: "" },
    Generic {
        key: "add_cross_attention",
        inert: is_false,
        why: "cross-attention is an encoder-decoder's, which pipec does not import",
    },
    Generic {
        key: "cross_attention_hidden_size",
        inert: Value::is_null,
        why: "cross-attention is an encoder-decoder's, which pipec does not import",
    },
    Generic {
        key: "tie_encoder_decoder",
        inert: is_false,
        why: "tying an encoder to a decoder belongs to an encoder-decoder model, which pipec does not import",
    },
    Generic { key: "id2label", inert: any_value, why: "" },
    Generic { key: "label2id", inert: any_value, why: "" },
    Generic { key: "num_labels", inert: any_value, why: "" },
    Generic { key: "problem_type", inert: any_value, why: "" },
    Generic { key: "finetuning_task", inert: any_value, why: "" },
    Generic { key: "prefix", inert: any_value, why: "" },
    Generic { key: "sep_token_id", inert: any_value, why: "" },
    Generic { key: "decoder_start_token_id", inert: any_value, why: "" },
    Generic { key: "max_length", inert: any_value, why: "" },
    Generic { key: "min_length", inert: any_value, why: "" },
    Generic { key: "do_sample", inert: any_value, why: "" },
    Generic { key: "early_stopping", inert: any_value, why: "" },
    Generic { key: "num_beams", inert: any_value, why: "" },
    Generic { key: "num_beam_groups", inert: any_value, why: "" },
    Generic { key: "diversity_penalty", inert: any_value, why: "" },
    Generic { key: "temperature", inert: any_value, why: "" },
    Generic { key: "top_k", inert: any_value, why: "" },
    Generic { key: "top_p", inert: any_value, why: "" },
    Generic { key: "typical_p", inert: any_value, why: "" },
    Generic { key: "repetition_penalty", inert: any_value, why: "" },
    Generic { key: "length_penalty", inert: any_value, why: "" },
    Generic { key: "no_repeat_ngram_size", inert: any_value, why: "" },
    Generic { key: "encoder_no_repeat_ngram_size", inert: any_value, why: "" },
    Generic { key: "bad_words_ids", inert: any_value, why: "" },
    Generic { key: "num_return_sequences", inert: any_value, why: "" },
    Generic { key: "output_scores", inert: any_value, why: "" },
    Generic { key: "return_dict_in_generate", inert: any_value, why: "" },
    Generic { key: "forced_bos_token_id", inert: any_value, why: "" },
    Generic { key: "forced_eos_token_id", inert: any_value, why: "" },
    Generic { key: "remove_invalid_values", inert: any_value, why: "" },
    Generic { key: "exponential_decay_length_penalty", inert: any_value, why: "" },
    Generic { key: "suppress_tokens", inert: any_value, why: "" },
    Generic { key: "begin_suppress_tokens", inert: any_value, why: "" },
];

/// A spec written from a config, and the notes to show beside it (fields ignored).
#[derive(Debug)]
pub struct Imported {
    pub spec: String,
    pub notes: Vec<String>,
}

/// What a written spec plans for (`pipec import --engine --nodes --devices-per-node
/// --device`): one node of eight H100s unless told, and the engine of [`default_engine`].
#[derive(Debug, Clone)]
pub struct Target {
    /// The engine the plan is priced for and `pipec emit` writes, as the spec's `engine:`
    /// says it (`torchtitan`, `{ name: torchtitan, compile: true }`); None: the model's
    /// default.
    pub engine: Option<String>,
    pub nodes: usize,
    pub devices_per_node: usize,
    /// A device preset's name (`pipec_plan::device::PRESETS`).
    pub device: String,
}

/// The engine an imported model is planned for unless told: for a decoder-only language
/// model torchtitan, eager (its job configurations' default), which trains the Hugging Face
/// architectures as PyTorch modules; for BERT, which torchtitan and Megatron-LM's GPT
/// training do not run, DeepSpeed over transformers' modules. pipec's own executor
/// (`--engine pipec`) is not the default: no run of it on a GPU preset is calibrated.
/// DeepSeek-V3 (dense blocks first, latent attention, DeepSeek's routing) is planned for
/// Megatron-LM, which runs it as published (`--moe-layer-freq`, `--multi-latent-attention`)
/// where torchtitan's llama3 flavours do not.
pub fn default_engine(family: &str) -> &'static str {
    match family {
        "bert" => "deepspeed",
        "deepseek_v3" => "megatron",
        _ => "torchtitan",
    }
}

impl Default for Target {
    fn default() -> Self {
        Target { engine: None, nodes: 1, devices_per_node: 8, device: "h100-sxm".into() }
    }
}

impl Target {
    /// The spec's `cluster` section: the device preset and the interconnect of the DGX
    /// system built of it (DGX H200's network is DGX H100's).
    fn section(&self) -> Result<String, String> {
        let names: Vec<&str> = pipec_plan::device::PRESETS.iter().map(|p| p.name).collect();
        if pipec_plan::device::preset(&self.device).is_none() {
            return Err(format!("--device `{}` is not a device preset (one of: {})", self.device, names.join(", ")));
        }
        let links = match self.device.as_str() {
            "v100-16gb" | "v100-32gb" => "dgx-v100",
            "a100-40gb" | "a100-80gb" => "dgx-a100",
            "h100-sxm" | "h200" => "dgx-h100",
            "b200" => "dgx-b200",
            other => {
                return Err(format!(
                    "--device `{other}`: no interconnect preset is built of it; import with a DGX device and edit the spec's `device` and `links`"
                ))
            }
        };
        if self.nodes == 0 || self.devices_per_node == 0 {
            return Err("--nodes and --devices-per-node must be at least 1".into());
        }
        Ok(format!(
            "cluster:\n  nodes: {}\n  devices_per_node: {}\n  device: {}\n  links: {links}\n",
            self.nodes, self.devices_per_node, self.device
        ))
    }
}

/// A config read field by field: every field used or checked is marked, and what is left
/// is refused by name.
struct Config {
    fields: Map<String, Value>,
    used: std::collections::BTreeSet<String>,
    /// What a family's import says of the fields it read but does not write (printed).
    notes: Vec<String>,
}

impl Config {
    fn take(&mut self, key: &str) -> Option<&Value> {
        self.used.insert(key.to_string());
        self.fields.get(key).filter(|v| !v.is_null())
    }

    fn count(&mut self, key: &str) -> Result<usize, String> {
        self.count_or(key, None)
    }

    fn count_or(&mut self, key: &str, default: Option<usize>) -> Result<usize, String> {
        match self.take(key) {
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| n as usize)
                .ok_or_else(|| format!("`{key}` must be a positive integer, found {v}")),
            None => default.ok_or_else(|| format!("`{key}` is missing")),
        }
    }

    fn number_or(&mut self, key: &str, default: f64) -> Result<f64, String> {
        match self.take(key) {
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| format!("`{key}` must be a positive number, found {v}")),
            None => Ok(default),
        }
    }

    /// A probability in [0, 1) (`default`, transformers' own, when the config has none).
    fn probability_or(&mut self, key: &str, default: f64) -> Result<f64, String> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|p| (0.0..1.0).contains(p))
                .ok_or_else(|| format!("`{key}` must be a probability in [0, 1), found {v}")),
        }
    }

    /// A block's `dropout=` from the config's dropout of the attention's probabilities and
    /// of the residual branches (each `default`, transformers' own, when absent): pipec's
    /// blocks drop both with one probability, so where they differ the residual one is
    /// taken, and a note says so. The residual probability.
    fn block_dropout(&mut self, attention: &str, residual: &str, default: f64) -> Result<f64, String> {
        let (a, r) = (self.probability_or(attention, default)?, self.probability_or(residual, default)?);
        if a != r {
            self.notes.push(format!(
                "`{attention}: {a}` differs from `{residual}: {r}`: pipec's blocks drop the attention's probabilities and the residual branches' outputs with one probability, imported as `dropout={r}` for both (edit it to choose)"
            ));
        }
        Ok(r)
    }

    fn flag_or(&mut self, key: &str, default: bool) -> Result<bool, String> {
        match self.take(key) {
            Some(v) => v.as_bool().ok_or_else(|| format!("`{key}` must be true or false, found {v}")),
            None => Ok(default),
        }
    }

    /// A string field (absent: None); any other type is an error naming the field.
    fn text(&mut self, key: &str) -> Result<Option<String>, String> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(t)) => Ok(Some(t.clone())),
            Some(v) => Err(format!("`{key}` must be a string, found {v}")),
        }
    }

    /// A whole number of 0 or more (a token id, a window), absent: None; any other value is
    /// an error naming the field.
    fn index(&mut self, key: &str) -> Result<Option<u64>, String> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| format!("`{key}` must be a whole number, found {v}")),
        }
    }

    /// A field that must have one value (or be absent) for pipec to compute the same model.
    fn require(&mut self, key: &str, ok: impl Fn(&Value) -> bool, why: &str) -> Result<(), String> {
        match self.take(key) {
            Some(v) if !ok(v) => Err(format!("`{key}: {v}` is not supported: {why}")),
            _ => Ok(()),
        }
    }

    /// The generic fields the family did not read: each with a value that changes nothing
    /// is ignored (returned, for the note), one that changes the computation refused with
    /// why.
    fn generic(&mut self) -> Result<Vec<&'static str>, String> {
        let mut ignored = Vec::new();
        for g in GENERIC {
            if self.used.contains(g.key) {
                continue;
            }
            let Some(v) = self.fields.get(g.key) else { continue };
            if !v.is_null() && !(g.inert)(v) {
                return Err(format!("`{}: {v}` changes what the model computes: {}", g.key, g.why));
            }
            self.used.insert(g.key.to_string());
            ignored.push(g.key);
        }
        Ok(ignored)
    }

    /// Every field neither used nor ignorable: refused, all named at once.
    fn leftover(&self, family: &str) -> Result<(), String> {
        let left: Vec<&str> = self
            .fields
            .keys()
            .map(String::as_str)
            .filter(|k| !self.used.contains(*k) && !IGNORED.contains(k))
            .collect();
        if left.is_empty() {
            Ok(())
        } else {
            let (them, they) =
                if left.len() == 1 { ("this field", "it changes") } else { ("these fields", "they change") };
            Err(format!(
                "{them} of a `{family}` config: {}, which pipec's `{family}` import does not read, so it cannot tell \
                 whether {they} what the model computes and writes no spec. If {} only describe{} the checkpoint \
                 (not its layers), import a copy of config.json without {}",
                left.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "),
                if left.len() == 1 { "it" } else { "they" },
                if left.len() == 1 { "s" } else { "" },
                if left.len() == 1 { "it" } else { "them" },
            ))
        }
    }
}

/// The spec for a config's text, with notes on the fields it ignored.
pub fn import(text: &str, name: &str, seq: Option<usize>, target: &Target) -> Result<Imported, String> {
    let cluster = target.section()?;
    let fields = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return Err("not a JSON object".into()),
        Err(e) => return Err(format!("not JSON: {e}")),
    };
    let mut c = Config { fields, used: Default::default(), notes: Vec::new() };
    let family = c.text("model_type")?.ok_or("`model_type` is missing: which architecture is this?")?;
    let model = match family.as_str() {
        "gpt2" => gpt2(&mut c, seq)?,
        "llama" | "mistral" | "mixtral" | "qwen2" | "qwen3" | "qwen3_moe" => llama(&mut c, &family, seq)?,
        "bert" => bert(&mut c, seq)?,
        "deepseek_v3" => deepseek_v3(&mut c, seq)?,
        other => {
            return Err(format!(
                "`model_type: {other}` is not an architecture pipec imports (it imports gpt2, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, deepseek_v3 and bert)"
            ))
        }
    };
    let ignored = c.generic()?;
    c.leftover(&family)?;
    let engine = target.engine.as_deref().unwrap_or(default_engine(&family));
    let mut notes = std::mem::take(&mut c.notes);
    if !ignored.is_empty() {
        notes.push(format!(
            "ignored {} (they change nothing a training step computes): {}",
            if ignored.len() == 1 { "a generic field" } else { "generic fields" },
            ignored.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
        ));
    }
    let spec = format!(
        "# Imported by `pipec import` from a Hugging Face `{family}` config. The model computes what\n\
         # `transformers` computes for it; the engine, the cluster, the strategy and the training\n\
         # are a starting point to edit (`engine: pipec` plans for pipec's own executor).\n\
         name: {name}\n\
         engine: {engine}\n\
         {model}\
         \x20 # attention in fused kernels (no seq² scores kept), as transformers' default `sdpa`,\n\
         \x20 # torchtitan and Megatron-LM run it; the same values\n\
         \x20 attention: flash\n\
         {cluster}\
         strategy: auto\n\
         training:\n  batch_size: 64\n  steps: 1000\n  optimizer: {{ kind: adamw, lr: 0.0003, weight_decay: 0.1 }}\n  precision: bf16\n  data: {{ kind: synthetic }}\n"
    );
    // the importer never writes a spec that does not check (the model and name included)
    let checked = crate::check_source(&spec);
    if let Some(d) = checked.diagnostics.iter().find(|d| d.severity == crate::Severity::Error) {
        return Err(format!("the spec written from this config does not check: {} ({})", d.message, d.code));
    }
    Ok(Imported { spec, notes })
}

/// The rotary embeddings: their base, 4.x's `rope_theta` or 5.x's `rope_parameters:
/// {rope_theta, rope_type}` (both: the same value), and, for a `rope_type` that scales the
/// frequencies (Llama 3.1's `llama3`, `yarn`, `linear`, `dynamic`), the block's
/// `rope_scaling=` arguments (", rope_scaling=llama3, rope_factor=8, …"). `positions` is the
/// config's `max_position_embeddings`, which `dynamic` scales beyond and YaRN's factor is
/// derived from where the config gives none.
fn rope(c: &mut Config, positions: usize) -> Result<(f64, String), String> {
    let mut theta = c.number_or("rope_theta", 10000.0)?;
    let written = c.fields.get("rope_theta").is_some_and(|v| !v.is_null());
    let mut args = String::new();
    for key in ["rope_parameters", "rope_scaling"] {
        let Some(v) = c.take(key).cloned() else { continue };
        let Value::Object(params) = v else { return Err(format!("`{key}` must be an object, found {v}")) };
        let kind = match params.get("rope_type").or_else(|| params.get("type")).and_then(Value::as_str) {
            Some(k @ ("default" | "linear" | "dynamic" | "yarn" | "llama3")) => k.to_string(),
            Some(other) => {
                return Err(format!(
                    "`{key}` with `rope_type: {other}` scales the rotary embeddings' frequencies in a way pipec does \
                     not run (it runs `default`, `linear`, `dynamic`, `yarn` and `llama3`)"
                ))
            }
            None => return Err(format!("`{key}` has no `rope_type`")),
        };
        let figure = |name: &str| -> Result<Option<f64>, String> {
            match params.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .map(Some)
                    .ok_or_else(|| format!("`{key}.{name}` must be a positive number, found {v}")),
            }
        };
        let needed = |name: &str| -> Result<f64, String> {
            figure(name)?.ok_or_else(|| format!("`{key}` with `rope_type: {kind}` needs `{name}`"))
        };
        // the keys each kind reads, beyond its type and base
        let reads: &[&str] = match kind.as_str() {
            "linear" => &["factor"],
            "dynamic" => &["factor"],
            "yarn" => &[
                "factor",
                "original_max_position_embeddings",
                "attention_factor",
                "beta_fast",
                "beta_slow",
                "mscale",
                "mscale_all_dim",
                "truncate",
            ],
            "llama3" => &["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
            _ => &[],
        };
        for (k, value) in &params {
            match k.as_str() {
                "rope_type" | "type" => {}
                "rope_theta" => {
                    let inner = value
                        .as_f64()
                        .filter(|x| x.is_finite() && *x > 0.0)
                        .ok_or_else(|| format!("`{key}.rope_theta` must be a positive number, found {value}"))?;
                    if written && inner != theta {
                        return Err(format!("`{key}.rope_theta` {inner} differs from `rope_theta` {theta}"));
                    }
                    theta = inner;
                }
                // dynamic scaling reads `max_position_embeddings`, not this; transformers keeps it
                "original_max_position_embeddings" if kind == "dynamic" => {}
                other if reads.contains(&other) => {}
                "partial_rotary_factor" => {
                    return Err(format!(
                        "`{key}.partial_rotary_factor` rotates only part of each head, and pipec rotates the whole head"
                    ))
                }
                other => {
                    return Err(format!(
                    "`{key}.{other}` changes the rotary embeddings of `rope_type: {kind}` in a way pipec does not run"
                ))
                }
            }
        }
        args = match kind.as_str() {
            "default" => String::new(),
            "linear" => format!(", rope_scaling=linear, rope_factor={}", number(needed("factor")?)),
            "dynamic" => {
                format!(", rope_scaling=dynamic, rope_factor={}, rope_original={positions}", number(needed("factor")?))
            }
            "llama3" => format!(
                ", rope_scaling=llama3, rope_factor={}, rope_low_freq={}, rope_high_freq={}, rope_original={}",
                number(needed("factor")?),
                number(needed("low_freq_factor")?),
                number(needed("high_freq_factor")?),
                number(needed("original_max_position_embeddings")?)
            ),
            _ => {
                // YaRN, as transformers 5 reads it: the pretrained context (4.x: the
                // config's), the factor (DeepSeek-V3: max_position_embeddings over it), the
                // attention factor from `mscale`/`mscale_all_dim` where given
                let original = figure("original_max_position_embeddings")?.unwrap_or(positions as f64);
                let factor = figure("factor")?.unwrap_or(positions as f64 / original);
                let mscale = |m: f64| pipec_plan::rope::yarn_mscale(factor, m);
                let attention = match (figure("attention_factor")?, figure("mscale")?, figure("mscale_all_dim")?) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) => mscale(m) / mscale(all),
                    (None, _, _) => mscale(1.0),
                };
                let truncate = match params.get("truncate") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => return Err(format!("`{key}.truncate` must be true or false, found {v}")),
                };
                format!(
                    ", rope_scaling=yarn, rope_factor={}, rope_original={}, rope_beta_fast={}, rope_beta_slow={}, rope_attention_factor={}{}",
                    number(factor),
                    number(original),
                    number(figure("beta_fast")?.unwrap_or(32.0)),
                    number(figure("beta_slow")?.unwrap_or(1.0)),
                    number(attention),
                    if truncate { "" } else { ", rope_truncate=false" }
                )
            }
        };
    }
    Ok((theta, args))
}

/// The training window: `--seq`, else the context length up to 4,096.
fn window(context: usize, seq: Option<usize>) -> Result<usize, String> {
    match seq {
        Some(s) if s > context => Err(format!("--seq {s} is longer than the model's context of {context} positions")),
        Some(0) => Err("--seq must be at least 1".into()),
        Some(s) => Ok(s),
        None => Ok(context.min(4096)),
    }
}

fn gpt2(c: &mut Config, seq: Option<usize>) -> Result<String, String> {
    let vocab = c.count("vocab_size")?;
    let d = c.count("n_embd")?;
    let layers = c.count("n_layer")?;
    let heads = c.count("n_head")?;
    let ff = c.count_or("n_inner", Some(4 * d))?;
    let positions = c.count("n_positions")?;
    c.count_or("n_ctx", Some(positions))?;
    let eps = c.number_or("layer_norm_epsilon", 1e-5)?;
    let act = c.text("activation_function")?.unwrap_or_else(|| "gelu_new".into());
    let mlp = match act.as_str() {
        "gelu_new" | "gelu_pytorch_tanh" => "gelu_tanh",
        "gelu" => "gelu",
        other => return Err(format!("`activation_function: {other}` is not supported (gelu_new or gelu)")),
    };
    let (block_eps, final_norm) = if eps == pipec_plan::model::DEFAULT_EPS {
        (String::new(), "layernorm".to_string())
    } else {
        (format!(", eps={}", number(eps)), format!("layernorm(eps={})", number(eps)))
    };
    // transformers' GPT2Config: 0.1 each
    let dropout = dropout_argument(c.block_dropout("attn_pdrop", "resid_pdrop", 0.1)?);
    let embd_pdrop = c.probability_or("embd_pdrop", 0.1)?;
    let embedding_dropout = if embd_pdrop > 0.0 { format!("\x20   - dropout({embd_pdrop})\n") } else { String::new() };
    c.require("tie_word_embeddings", |v| v.as_bool() != Some(false), "GPT-2's output layer is the embedding")?;
    c.require("scale_attn_weights", |v| v.as_bool() == Some(true), "pipec scales attention scores by 1/√head size")?;
    c.require(
        "scale_attn_by_inverse_layer_idx",
        |v| v.as_bool() == Some(false),
        "pipec's blocks scale no layer's scores by its depth",
    )?;
    c.require("add_cross_attention", |v| v.as_bool() == Some(false), "cross-attention is an encoder-decoder's")?;
    let seq = window(positions, seq)?;
    Ok(format!(
        "# GPT-2: {layers} blocks of d = {d} with {heads} heads, a tied {vocab}-token vocabulary.\n\
         model:\n  input: [{seq}]\n  layers:\n\
         \x20   - embedding({vocab}, {d}) as wte\n\
         \x20   - pos_embedding({positions}) as wpe\n\
         {embedding_dropout}\
         \x20   - repeat {layers}: transformer_block(d={d}, heads={heads}, ff={ff}, causal=true, mlp={mlp}{block_eps}{dropout})\n\
         \x20   - {final_norm}\n\
         \x20   - linear({d}, {vocab}, bias=false, tie=wte)\n\
         \x20 loss: cross_entropy\n"
    ))
}

fn llama(c: &mut Config, family: &str, seq: Option<usize>) -> Result<String, String> {
    let vocab = c.count("vocab_size")?;
    let d = c.count("hidden_size")?;
    let dense_ff = c.count("intermediate_size")?;
    let layers = c.count("num_hidden_layers")?;
    let heads = c.count("num_attention_heads")?;
    let kv = c.count_or("num_key_value_heads", Some(heads))?;
    let positions = c.count("max_position_embeddings")?;
    let (theta, scaling) = rope(c, positions)?;
    let eps = c.number_or("rms_norm_eps", 1e-6)?;
    let tied = c.flag_or("tie_word_embeddings", false)?;
    let act = c.text("hidden_act")?.unwrap_or_else(|| "silu".into());
    if act != "silu" {
        return Err(format!("`hidden_act: {act}` is not supported: pipec's gated MLPs are SwiGLU (silu) and GeGLU"));
    }
    // each head's size: `head_dim` where the config gives one (Qwen3: 128 on d = 2048 with 32
    // heads), else hidden_size / num_attention_heads
    let head_dim = match c.index("head_dim")? {
        Some(h) if h > 0 => h as usize,
        Some(_) => return Err("`head_dim` must be a positive integer".into()),
        None if d % heads == 0 => d / heads,
        None => return Err(format!("`hidden_size` {d} is not a multiple of `num_attention_heads` {heads}")),
    };
    // Qwen3 normalises each head's queries and keys (an RMSNorm over the head's features)
    let qk_norm = matches!(family, "qwen3" | "qwen3_moe");
    c.require("attention_dropout", |v| v.as_f64() == Some(0.0), "pipec's blocks apply no attention dropout")?;
    c.require("mlp_bias", |v| v.as_bool() == Some(false), "pipec's gated MLPs have no biases")?;
    // Qwen2 always has query/key/value biases; Llama's `attention_bias` puts them on the
    // output projection too, which no pipec block has without the MLP's
    let qkv_bias = family == "qwen2";
    if !qkv_bias && c.flag_or("attention_bias", false)? {
        return Err(
            "`attention_bias: true` is not supported: biases on every attention projection but not the MLP's".into()
        );
    }
    let seq = window(positions, seq)?;
    let windows = layer_windows(c, family, layers, seq)?;
    let label = match family {
        "llama" => "Llama",
        "mistral" => "Mistral",
        "mixtral" => "Mixtral",
        "qwen3" => "Qwen3",
        "qwen3_moe" => "Qwen3-MoE",
        _ => "Qwen2",
    };
    // Mixtral: a softmax router over `num_local_experts` SwiGLU experts, the top
    // `num_experts_per_tok` per token with their weights renormalised, no token dropped
    let experts = if family == "mixtral" {
        let experts = c.count("num_local_experts")?;
        let top_k = c.count("num_experts_per_tok")?;
        if top_k > experts {
            return Err(format!("`num_experts_per_tok` {top_k} is more than `num_local_experts` {experts}"));
        }
        // `transformers` adds the load-balancing loss only with `output_router_logits`
        let coefficient = c.number_or("router_aux_loss_coef", 0.001)?;
        let aux = if c.flag_or("output_router_logits", false)? { coefficient } else { 0.0 };
        c.require("router_jitter_noise", |v| v.as_f64() == Some(0.0), "pipec's routers add no noise to the logits")?;
        Some((experts, top_k, aux, true))
    } else if family == "qwen3_moe" {
        qwen3_experts(c)?
    } else {
        None
    };
    // a mixture of experts' MLPs are `moe_intermediate_size` wide where the config says so
    // (Qwen3-MoE; its `intermediate_size` is the dense MLP's of `mlp_only_layers`, none here)
    let ff = if family == "qwen3_moe" { c.count("moe_intermediate_size")? } else { dense_ff };
    let mut args = format!("d={d}, heads={heads}, ff={ff}, causal=true");
    if kv != heads {
        args += &format!(", kv_heads={kv}");
    }
    if d % heads != 0 || head_dim != d / heads {
        args += &format!(", head_dim={head_dim}");
    }
    if qk_norm {
        args += ", qk_norm=true";
    }
    args += &format!(", norm=rmsnorm, mlp=swiglu, rope={}{scaling}, bias=false", number(theta));
    if qkv_bias {
        args += ", qkv_bias=true";
    }
    if let Some((experts, top_k, aux, norm_topk)) = experts {
        args += &format!(", experts={experts}, top_k={top_k}, aux_loss={}", number(aux));
        if !norm_topk {
            args += ", norm_topk=false";
        }
    }
    // the norms' ε, written only when not pipec's default
    let eps = (eps != pipec_plan::model::DEFAULT_EPS).then(|| format!("eps={}", number(eps)));
    if let Some(e) = &eps {
        args += &format!(", {e}");
    }
    let (table, final_norm, head) = lm_ends(vocab, d, tied, eps.as_deref());
    let gqa = if kv == heads { String::new() } else { format!(", {kv} key/value heads") };
    let gqa = if d % heads != 0 || head_dim != d / heads { format!("{gqa}, heads of {head_dim}") } else { gqa };
    let gqa = match experts {
        Some((e, k, _, _)) => format!("{gqa}, {e} experts ({k} per token)"),
        None => gqa,
    };
    let slide = match windows.iter().max() {
        Some(&w) if w > 0 => format!(", sliding windows of {w}"),
        _ => String::new(),
    };
    let blocks = block_lines(&windows, &args);
    Ok(format!(
        "# {label}: {layers} blocks of d = {d} with {heads} heads{gqa}{slide}, a {vocab}-token vocabulary{}.\n\
         model:\n  input: [{seq}]\n  layers:\n\
         \x20   - {table}\n\
         {blocks}\
         \x20   - {final_norm}\n\
         \x20   - {head}\n\
         \x20 loss: cross_entropy\n",
        if tied { " (tied)" } else { "" }
    ))
}

/// A Llama-family language model's layers around its blocks: the token embedding (named
/// `tokens` when the output layer is tied to it), the final RMSNorm (with the config's ε
/// where it is not pipec's default, `eps`: "eps=…") and the output layer.
fn lm_ends(vocab: usize, d: usize, tied: bool, eps: Option<&str>) -> (String, String, String) {
    let final_norm = eps.map_or_else(|| "rmsnorm".to_string(), |e| format!("rmsnorm({e})"));
    if tied {
        (
            format!("embedding({vocab}, {d}) as tokens"),
            final_norm,
            format!("linear({d}, {vocab}, bias=false, tie=tokens)"),
        )
    } else {
        (format!("embedding({vocab}, {d})"), final_norm, format!("linear({d}, {vocab}, bias=false) as lm_head"))
    }
}

/// Each layer's sliding window (0: full attention) over a training window of `seq`, as
/// transformers reads the config: Mistral and Mixtral attend in the last `sliding_window`
/// positions whenever it is set; Qwen2 and Qwen3 only with `use_sliding_window`, in the
/// layers `layer_types` lists as `sliding_attention` (transformers ≥ 4.53) or else from
/// layer `max_window_layers` on (28 when absent, their configs' default); Llama has no
/// window. A window at least the training window long is full attention, written as such.
fn layer_windows(c: &mut Config, family: &str, layers: usize, seq: usize) -> Result<Vec<usize>, String> {
    let listed = layer_types(c, layers)?;
    let qwen = matches!(family, "qwen2" | "qwen3" | "qwen3_moe");
    let slides = c.flag_or("use_sliding_window", matches!(family, "mistral" | "mixtral"))?;
    let from = if qwen { c.index("max_window_layers")?.map_or(28, |v| v as usize) } else { 0 };
    let sliding = listed.unwrap_or_else(|| (0..layers).map(|i| i >= from).collect());
    Ok(match c.index("sliding_window")? {
        Some(w) if slides && w > 0 && (w as usize) < seq => {
            sliding.iter().map(|&s| if s { w as usize } else { 0 }).collect()
        }
        _ => vec![0; layers],
    })
}

/// Whether each layer of `layer_types` (one per layer: `full_attention` or
/// `sliding_attention`) slides; absent: None.
fn layer_types(c: &mut Config, layers: usize) -> Result<Option<Vec<bool>>, String> {
    let Some(v) = c.take("layer_types") else { return Ok(None) };
    let kinds = v.as_array().ok_or_else(|| format!("`layer_types` must be a list, found {v}"))?;
    if kinds.len() != layers {
        return Err(format!("`layer_types` lists {} layers, and `num_hidden_layers` is {layers}", kinds.len()));
    }
    kinds
        .iter()
        .map(|kind| match kind.as_str() {
            Some("full_attention") => Ok(false),
            Some("sliding_attention") => Ok(true),
            _ => Err(format!("`layer_types` holds {kind}: pipec imports `full_attention` and `sliding_attention`")),
        })
        .collect::<Result<Vec<bool>, String>>()
        .map(Some)
}

/// The spec's block lines for layers with these sliding windows (0: none) and the blocks'
/// other arguments `args`: one `repeat` of the shortest repeating group of at most 8
/// layers (`repeat 12: a -> b` for windows alternating with full attention), else one
/// `repeat` per run of equal layers.
fn block_lines(windows: &[usize], args: &str) -> String {
    let block = |w: usize| {
        if w > 0 {
            format!("transformer_block({args}, window={w})")
        } else {
            format!("transformer_block({args})")
        }
    };
    let n = windows.len();
    let period = (1..=n.min(8))
        .filter(|&p| p == 1 || p < n)
        .find(|&p| n.is_multiple_of(p) && windows.iter().enumerate().all(|(i, w)| *w == windows[i % p]));
    if let Some(p) = period {
        let group: Vec<String> = windows[..p].iter().map(|&w| block(w)).collect();
        return format!("    - repeat {}: {}\n", n / p, group.join(" -> "));
    }
    let mut out = String::new();
    let mut i = 0;
    while i < n {
        let run = windows[i..].iter().take_while(|w| **w == windows[i]).count();
        out += &format!("    - repeat {run}: {}\n", block(windows[i]));
        i += run;
    }
    out
}

/// Qwen3-MoE's experts: a softmax router over `num_experts` SwiGLU experts, the top
/// `num_experts_per_tok` per token (renormalised with `norm_topk_prob`), in every block
/// (`decoder_sparse_step` 1, no `mlp_only_layers`), the load-balancing loss only with
/// `output_router_logits` as `transformers` adds it: (experts, top_k, aux_loss, norm_topk).
fn qwen3_experts(c: &mut Config) -> Result<Option<(usize, usize, f64, bool)>, String> {
    let experts = c.count("num_experts")?;
    let top_k = c.count("num_experts_per_tok")?;
    if top_k > experts {
        return Err(format!("`num_experts_per_tok` {top_k} is more than `num_experts` {experts}"));
    }
    let norm_topk = c.flag_or("norm_topk_prob", false)?;
    let coefficient = c.number_or("router_aux_loss_coef", 0.001)?;
    let aux = if c.flag_or("output_router_logits", false)? { coefficient } else { 0.0 };
    c.require("decoder_sparse_step", |v| v.as_u64() == Some(1), "pipec imports a mixture of experts in every block")?;
    c.require(
        "mlp_only_layers",
        |v| v.as_array().is_some_and(Vec::is_empty),
        "pipec imports a mixture of experts in every block",
    )?;
    Ok(Some((experts, top_k, aux, norm_topk)))
}

/// DeepSeek-V3 (transformers' `DeepseekV3ForCausalLM`): multi-head
/// latent attention in every block (`q_lora_rank`, `kv_lora_rank`, heads of
/// `qk_nope_head_dim` + `qk_rope_head_dim` features, values of `v_head_dim`; under YaRN the
/// softmax scaled by `mscale_all_dim`), dense SwiGLU MLPs in the first
/// `first_k_dense_replace` blocks, then mixtures of `n_routed_experts` of
/// `moe_intermediate_size` with `n_shared_experts` shared: sigmoid scores, a fixed
/// correction bias for the choice (`noaux_tc`), the top `num_experts_per_tok` among the
/// experts of the `topk_group` best of `n_group` groups (a group scored by its two best),
/// renormalised with `norm_topk_prob`, times `routed_scaling_factor`. The remote-code
/// config's fields that transformers does not read either are noted: the
/// multi-token-prediction module (`num_nextn_predict_layers`), the auxiliary loss
/// (`aux_loss_alpha`, `seq_aux`: transformers adds none), `ep_size` and the checkpoint's
/// FP8 storage (`quantization_config`).
fn deepseek_v3(c: &mut Config, seq: Option<usize>) -> Result<String, String> {
    let vocab = c.count("vocab_size")?;
    let d = c.count("hidden_size")?;
    let dense_ff = c.count("intermediate_size")?;
    let expert_ff = c.count("moe_intermediate_size")?;
    let layers = c.count("num_hidden_layers")?;
    let heads = c.count("num_attention_heads")?;
    c.require(
        "num_key_value_heads",
        |v| v.as_u64() == Some(heads as u64),
        "multi-head latent attention gives every query head its own key and value head",
    )?;
    let positions = c.count("max_position_embeddings")?;
    let yarn = c.fields.get("rope_scaling").or_else(|| c.fields.get("rope_parameters")).cloned();
    let (theta, scaling) = rope(c, positions)?;
    let eps = c.number_or("rms_norm_eps", 1e-6)?;
    let tied = c.flag_or("tie_word_embeddings", false)?;
    let act = c.text("hidden_act")?.unwrap_or_else(|| "silu".into());
    if act != "silu" {
        return Err(format!("`hidden_act: {act}` is not supported: DeepSeek-V3's MLPs are SwiGLU (silu)"));
    }
    c.require("attention_bias", |v| v.as_bool() == Some(false), "pipec's latent attention has no biases")?;
    c.require("attention_dropout", |v| v.as_f64() == Some(0.0), "pipec's blocks apply no attention dropout")?;
    c.require(
        "rope_interleave",
        |v| v.as_bool() == Some(true),
        "pipec reads DeepSeek's rotary parts interleaved, as its checkpoints store them",
    )?;
    // latent attention
    let q_lora = c.index("q_lora_rank")?.unwrap_or(0) as usize;
    let kv_lora = c.count("kv_lora_rank")?;
    let nope = c.count("qk_nope_head_dim")?;
    let rope_dim = c.count("qk_rope_head_dim")?;
    let v_head = c.count("v_head_dim")?;
    // transformers 4.5x saves the sizes it derives: each must be the one it derives
    c.require(
        "qk_head_dim",
        |v| v.as_u64() == Some((nope + rope_dim) as u64),
        "it is qk_nope_head_dim + qk_rope_head_dim",
    )?;
    c.require("head_dim", |v| v.as_u64() == Some(rope_dim as u64), "transformers sets it to qk_rope_head_dim")?;
    // the softmax's scale under YaRN (DeepseekV3Attention: × yarn_get_mscale(factor, mscale_all_dim)²)
    let mscale_all_dim = match &yarn {
        Some(Value::Object(p)) => match p.get("mscale_all_dim") {
            None | Some(Value::Null) => 0.0,
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| format!("`rope_scaling.mscale_all_dim` must be a number of 0 or more, found {v}"))?,
        },
        _ => 0.0,
    };
    if mscale_all_dim > 0.0 && yarn.as_ref().and_then(|p| p.get("factor")).and_then(Value::as_f64).is_none() {
        return Err(
            "`rope_scaling.mscale_all_dim` scales the softmax by YaRN's `factor`, which the config does not give"
                .into(),
        );
    }
    // the mixture of experts
    let experts = c.count("n_routed_experts")?;
    let top_k = c.count("num_experts_per_tok")?;
    let shared = c.index("n_shared_experts")?.unwrap_or(0) as usize;
    let groups = c.count_or("n_group", Some(1))?;
    let group_top = c.count_or("topk_group", Some(1))?;
    let scale = c.number_or("routed_scaling_factor", 1.0)?;
    let norm_topk = c.flag_or("norm_topk_prob", true)?;
    let dense = c.index("first_k_dense_replace")?.unwrap_or(0) as usize;
    if top_k > experts {
        return Err(format!("`num_experts_per_tok` {top_k} is more than `n_routed_experts` {experts}"));
    }
    if dense > layers {
        return Err(format!("`first_k_dense_replace` {dense} is more than `num_hidden_layers` {layers}"));
    }
    // transformers scores a group by its two best experts; pipec (as Megatron-LM) by its
    // top_k / topk_group best
    if groups > 1 && top_k != 2 * group_top {
        return Err(format!(
            "`num_experts_per_tok` {top_k} with `topk_group` {group_top}: transformers scores each group by its two best experts, pipec by its top_k / topk_group best, the same only when num_experts_per_tok is 2 × topk_group"
        ));
    }
    c.require(
        "moe_layer_freq",
        |v| v.as_u64() == Some(1),
        "pipec imports a mixture of experts in every block after the dense ones",
    )?;
    c.require(
        "topk_method",
        |v| v.as_str() == Some("noaux_tc"),
        "transformers' DeepSeek-V3 chooses experts by the biased sigmoid scores (`noaux_tc`) whatever this says",
    )?;
    c.require(
        "scoring_func",
        |v| v.as_str() == Some("sigmoid"),
        "transformers' DeepSeek-V3 scores experts with a sigmoid",
    )?;
    // the multi-token-prediction modules DeepSeek-V3 trains with (transformers' model has
    // none): planned and priced as Megatron-LM trains them
    let mtp = match c.take("num_nextn_predict_layers").cloned() {
        None => 0,
        Some(v) => v.as_u64().ok_or("`num_nextn_predict_layers` must be a whole number")? as usize,
    };
    if mtp > 0 {
        c.notes.push(format!(
            "`num_nextn_predict_layers: {mtp}` imported as `mtp: {mtp}` (DeepSeek-V3's multi-token prediction, with Megatron-LM's loss weight 0.1): planned and priced; transformers' DeepseekV3ForCausalLM and pipec's executor do not train it — remove the line to train next-token prediction only"
        ));
    }
    // read, not imported: what transformers' DeepseekV3ForCausalLM does not compute either
    for (key, why) in [
        ("aux_loss_alpha", "the auxiliary balancing loss (transformers adds none for DeepSeek-V3)"),
        ("seq_aux", "the auxiliary balancing loss (transformers adds none for DeepSeek-V3)"),
        ("ep_size", "the reference code's expert-parallel size for inference (the strategy sets pipec's)"),
        ("quantization_config", "the checkpoint's FP8 storage (the training's precision is `training.precision`)"),
        ("auto_map", "the reference code's classes"),
    ] {
        if c.take(key).is_some() {
            c.notes.push(format!("not imported: `{key}` — {why}"));
        }
    }
    let seq = window(positions, seq)?;
    let eps_arg = (eps != pipec_plan::model::DEFAULT_EPS).then(|| format!("eps={}", number(eps)));
    let mut attention = format!(
        "heads={heads}, head_dim={nope}, kv_lora={kv_lora}{}, rope_dim={rope_dim}, v_head_dim={v_head}",
        if q_lora > 0 { format!(", q_lora={q_lora}") } else { String::new() }
    );
    attention += &format!(", norm=rmsnorm, mlp=swiglu, rope={}{scaling}", number(theta));
    if mscale_all_dim > 0.0 {
        attention += &format!(", rope_mscale_all_dim={}", number(mscale_all_dim));
    }
    attention += ", bias=false";
    if let Some(e) = &eps_arg {
        attention += &format!(", {e}");
    }
    let block = |ff: usize, moe: &str| format!("transformer_block(d={d}, ff={ff}, causal=true, {attention}{moe})");
    let mut routing = format!(", experts={experts}, top_k={top_k}");
    if shared > 0 {
        routing += &format!(", shared_experts={shared}");
    }
    routing += ", router=sigmoid";
    if !norm_topk {
        routing += ", norm_topk=false";
    }
    if scale != 1.0 {
        routing += &format!(", route_scale={}", number(scale));
    }
    if groups > 1 {
        routing += &format!(", route_groups={groups}, route_group_top={group_top}");
    }
    routing += ", expert_bias=true";
    let mut blocks = String::new();
    if dense > 0 {
        blocks += &format!("    - repeat {dense}: {}\n", block(dense_ff, ""));
    }
    if layers > dense {
        blocks += &format!("    - repeat {}: {}\n", layers - dense, block(expert_ff, &routing));
    }
    let (table, final_norm, head) = lm_ends(vocab, d, tied, eps_arg.as_deref());
    Ok(format!(
        "# DeepSeek-V3: {layers} blocks of d = {d} with {heads} latent-attention heads, the first {dense} dense, then\n\
         # {experts} routed experts ({top_k} per token{}) and {shared} shared, a {vocab}-token vocabulary{}.\n\
         model:\n  input: [{seq}]\n  layers:\n\
         \x20   - {table}\n\
         {blocks}\
         \x20   - {final_norm}\n\
         \x20   - {head}\n\
         \x20 loss: cross_entropy\n\
         {}",
        if groups > 1 { format!(" from {group_top} of {groups} groups") } else { String::new() },
        if tied { " (tied)" } else { "" },
        if mtp > 0 { format!("  mtp: {mtp}\n") } else { String::new() }
    ))
}

/// A BERT encoder (`BertModel`, `BertForMaskedLM`, `BertForSequenceClassification`, ...) as
/// a sequence classifier: token, token-type and position embeddings with their layer norm,
/// post-norm blocks, the first position ([CLS]) pooled through the pooler (`linear` +
/// `tanh`), then the classifier over `num_labels` (or `id2label`'s) classes — what
/// `BertForSequenceClassification` computes. A pre-training checkpoint's heads are not
/// imported; `pipec run --init` leaves a classifier it lacks to pipec's initialisation.
fn bert(c: &mut Config, seq: Option<usize>) -> Result<String, String> {
    let vocab = c.count("vocab_size")?;
    let d = c.count("hidden_size")?;
    let layers = c.count("num_hidden_layers")?;
    let heads = c.count("num_attention_heads")?;
    let ff = c.count("intermediate_size")?;
    let positions = c.count("max_position_embeddings")?;
    let types = c.count_or("type_vocab_size", Some(2))?;
    let eps = c.number_or("layer_norm_eps", 1e-12)?;
    let act = c.text("hidden_act")?.unwrap_or_else(|| "gelu".into());
    let mlp = match act.as_str() {
        "gelu" => "",
        "gelu_new" | "gelu_pytorch_tanh" => ", mlp=gelu_tanh",
        other => return Err(format!("`hidden_act: {other}` is not supported (gelu or gelu_new)")),
    };
    if d % heads != 0 {
        return Err(format!("`hidden_size` {d} is not a multiple of `num_attention_heads` {heads}"));
    }
    let labels = match c.take("id2label") {
        Some(Value::Object(m)) if !m.is_empty() => m.len(),
        Some(Value::Object(_)) | None => c.count_or("num_labels", Some(2))?,
        Some(v) => return Err(format!("`id2label` must map class ids to names, found {v}")),
    };
    c.used.insert("num_labels".into());
    // transformers' BertConfig: 0.1 each; the classifier's is the hidden one unless given
    let hidden_dropout = c.block_dropout("attention_probs_dropout_prob", "hidden_dropout_prob", 0.1)?;
    let block_dropout = dropout_argument(hidden_dropout);
    let classifier_dropout = c.probability_or("classifier_dropout", hidden_dropout)?;
    c.require(
        "position_embedding_type",
        |v| v.as_str() == Some("absolute"),
        "pipec's positions are learned absolute embeddings",
    )?;
    c.require("is_decoder", |v| v.as_bool() == Some(false), "a BERT decoder attends causally with cross-attention")?;
    c.require("add_cross_attention", |v| v.as_bool() == Some(false), "cross-attention is an encoder-decoder's")?;
    c.require("chunk_size_feed_forward", |v| v.as_u64() == Some(0), "pipec does not chunk the feed-forward")?;
    c.require(
        "problem_type",
        |v| v.as_str() == Some("single_label_classification"),
        "pipec's classifier trains with cross-entropy over single labels",
    )?;
    let sep = match c.index("sep_token_id")? {
        Some(s) if (s as usize) < vocab => format!(", sep={s}"),
        Some(s) => return Err(format!("`sep_token_id` {s} is not in the vocabulary of {vocab}")),
        None => String::new(),
    };
    let seq = window(positions, seq)?;
    let e = number(eps);
    let dropout = |p: f64| if p > 0.0 { format!("    - dropout({p})\n") } else { String::new() };
    let sep_note = if sep.is_empty() {
        "\n# For sentence pairs give the embedding `sep=` the [SEP] token's id (102 in bert-base-uncased's\n\
         # vocabulary): positions after the first [SEP] then have token type 1, as the tokenizer gives them."
    } else {
        ""
    };
    Ok(format!(
        "# BERT: {layers} post-norm blocks of d = {d} with {heads} heads, a {vocab}-token vocabulary, as a\n\
         # sequence classifier over {labels} classes (the [CLS] position through the pooler).{sep_note}\n\
         model:\n  input: [{seq}]\n  layers:\n\
         \x20   - embedding({vocab}, {d}, types={types}{sep})\n\
         \x20   - pos_embedding({positions})\n\
         \x20   - layernorm(eps={e})\n\
         {}\
         \x20   - repeat {layers}: transformer_block(d={d}, heads={heads}, ff={ff}{mlp}, post_norm=true, eps={e}{block_dropout})\n\
         \x20   - seq_pool(first)\n\
         \x20   - linear({d}, {d}) as pooler\n\
         \x20   - tanh\n\
         {}\
         \x20   - linear({d}, {labels}) as classifier\n\
         \x20 loss: cross_entropy\n",
        dropout(hidden_dropout),
        dropout(classifier_dropout),
    ))
}

/// A block's `, dropout=p` argument (nothing for 0).
fn dropout_argument(p: f64) -> String {
    if p > 0.0 {
        format!(", dropout={p}")
    } else {
        String::new()
    }
}

/// A number as a spec writes it: integers without a fraction, others in Rust's shortest form.
fn number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        format!("{x:e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepseek_v3_imports_with_its_latent_attention_dense_blocks_and_routing() {
        // DeepSeek-V3's config.json as deepseek-ai publishes it (tests/import/deepseek-v3.json)
        let cfg = include_str!("../../../tests/import/deepseek-v3.json");
        let imported = import(cfg, "v3", None, &Target::default()).expect("imports");
        let spec = &imported.spec;
        assert!(spec.contains("engine: megatron"), "{spec}");
        let attention = "heads=128, head_dim=128, kv_lora=512, q_lora=1536, rope_dim=64, v_head_dim=128, norm=rmsnorm, mlp=swiglu, rope=10000, rope_scaling=yarn, rope_factor=40, rope_original=4096, rope_beta_fast=32, rope_beta_slow=1, rope_attention_factor=1, rope_mscale_all_dim=1, bias=false, eps=1e-6";
        assert!(
            spec.contains(&format!("- repeat 3: transformer_block(d=7168, ff=18432, causal=true, {attention})\n")),
            "{spec}"
        );
        assert!(
            spec.contains(&format!("- repeat 58: transformer_block(d=7168, ff=2048, causal=true, {attention}, experts=256, top_k=8, shared_experts=1, router=sigmoid, route_scale=2.5e0, route_groups=8, route_group_top=4, expert_bias=true)\n")),
            "{spec}"
        );
        assert!(spec.contains("- linear(7168, 129280, bias=false) as lm_head"), "{spec}");
        // the multi-token-prediction module is planned (transformers has none: said so)
        assert!(spec.contains("\n  loss: cross_entropy\n  mtp: 1\n"), "{spec}");
        let notes = imported.notes.join("\n");
        assert!(notes.contains("`num_nextn_predict_layers: 1` imported as `mtp: 1`"), "{notes}");
        // the plan's model: 671B parameters as DeepSeek reports (without the 14B of the
        // multi-token-prediction module), 37B active per token
        let checked = crate::check_source(spec);
        let s = checked.spec.expect("checks");
        let total = s.model.parameter_count() as f64 / 1e9;
        assert!((total - 671.0).abs() < 1.0, "{total}");
        // what pipec computes otherwise than transformers is refused by name
        let refused = |from: &str, to: &str| {
            assert!(cfg.contains(from), "{from}");
            import(&cfg.replacen(from, to, 1), "v3", None, &Target::default()).expect_err(to)
        };
        assert!(refused(r#""topk_method": "noaux_tc""#, r#""topk_method": "greedy""#).contains("`topk_method"));
        assert!(refused(r#""topk_group": 4"#, r#""topk_group": 2"#).contains("two best experts"));
        assert!(refused(r#""moe_layer_freq": 1"#, r#""moe_layer_freq": 2"#).contains("`moe_layer_freq"));
        assert!(refused(r#""scoring_func": "sigmoid""#, r#""scoring_func": "softmax""#).contains("`scoring_func"));
        assert!(refused(r#""num_key_value_heads": 128"#, r#""num_key_value_heads": 8"#).contains("own key and value"));
        assert!(refused(r#""rope_theta": 10000"#, r#""rope_theta": 10000, "rope_interleave": false"#)
            .contains("interleaved"));
        // without YaRN the softmax keeps its plain scale; one group is no group
        let start = cfg.find(r#""rope_scaling": {"#).expect("rope_scaling");
        let end = start + cfg[start..].find('}').expect("its end") + 1;
        let plain = format!("{}\"rope_scaling\": null{}", &cfg[..start], &cfg[end..]);
        let spec = import(&plain, "v3", None, &Target::default()).expect("imports").spec;
        assert!(!spec.contains("rope_scaling") && !spec.contains("rope_mscale_all_dim"), "{spec}");
        let ungrouped = cfg.replacen(r#""n_group": 8"#, r#""n_group": 1"#, 1).replacen(
            r#""topk_group": 4"#,
            r#""topk_group": 1"#,
            1,
        );
        let spec = import(&ungrouped, "v3", None, &Target::default()).expect("imports").spec;
        assert!(!spec.contains("route_groups") && spec.contains("expert_bias=true"), "{spec}");
    }

    #[test]
    fn numbers_are_written_as_a_spec_reads_them() {
        assert_eq!(number(10000.0), "10000");
        assert_eq!(number(500000.0), "500000");
        assert_eq!(number(1e-6), "1e-6");
        assert_eq!(number(1e-5), "1e-5");
    }

    /// GPT-2's and BERT's dropouts: the blocks' `dropout=` (the attention's probabilities
    /// and the residual branches), GPT-2's embedding dropout after the positions, each at
    /// transformers' 0.1 when the config has none; differing attention and residual
    /// probabilities take the residual one, with a note.
    #[test]
    fn gpt2_and_bert_configs_give_blocks_their_dropout() {
        let gpt2 =
            r#"{"model_type": "gpt2", "vocab_size": 100, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}"#;
        let imported = import(gpt2, "x", None, &Target::default()).expect("gpt2");
        let spec = imported.spec;
        assert!(spec.contains("as wpe\n    - dropout(0.1)\n    - repeat 2: transformer_block("), "{spec}");
        assert!(spec.contains("mlp=gelu_tanh, dropout=0.1)"), "{spec}");
        assert!(imported.notes.is_empty(), "{:?}", imported.notes);
        let none = gpt2.replace(
            r#""n_positions": 64"#,
            r#""n_positions": 64, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0"#,
        );
        let spec = import(&none, "x", None, &Target::default()).expect("gpt2").spec;
        assert!(!spec.contains("dropout"), "{spec}");
        let differ =
            gpt2.replace(r#""n_positions": 64"#, r#""n_positions": 64, "attn_pdrop": 0.0, "resid_pdrop": 0.2"#);
        let imported = import(&differ, "x", None, &Target::default()).expect("gpt2");
        assert!(imported.spec.contains("dropout=0.2)"), "{}", imported.spec);
        assert!(
            imported.notes.iter().any(|n| n.contains("`attn_pdrop: 0` differs from `resid_pdrop: 0.2`")),
            "{:?}",
            imported.notes
        );
        let bad = gpt2.replace(r#""n_positions": 64"#, r#""n_positions": 64, "resid_pdrop": 1.5"#);
        let Err(e) = import(&bad, "x", None, &Target::default()) else { panic!("a probability of 1.5 is refused") };
        assert!(e.contains("`resid_pdrop` must be a probability"), "{e}");
        let bert = r#"{"model_type": "bert", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64}"#;
        let spec = import(bert, "x", None, &Target::default()).expect("bert").spec;
        assert!(spec.contains("post_norm=true, eps=1e-12, dropout=0.1)"), "{spec}");
        assert_eq!(spec.matches("- dropout(0.1)").count(), 2, "the embeddings' and the classifier's: {spec}");
        let checked = crate::check_source(&spec);
        assert!(!checked.has_errors(), "{:?}", checked.diagnostics);
    }

    #[test]
    fn a_mixtral_config_gives_expert_blocks_with_the_loss_transformers_adds() {
        let cfg = r#"{"model_type": "mixtral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
            "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "output_router_logits": false}"#;
        let spec = import(cfg, "x", None, &Target::default()).expect("mixtral").spec;
        assert!(spec.contains("experts=4, top_k=2, aux_loss=0,"), "{spec}");
        // the loss only where `transformers` adds it
        let spec = import(
            &cfg.replace(r#""output_router_logits": false"#, r#""output_router_logits": true"#),
            "x",
            None,
            &Target::default(),
        )
        .expect("with the loss")
        .spec;
        assert!(spec.contains("experts=4, top_k=2, aux_loss=2e-2,"), "{spec}");
        let checked = crate::check_source(&spec);
        assert!(!checked.has_errors(), "{:?}", checked.diagnostics);
        // noise on the router's logits, or more experts per token than there are, is refused
        let noisy = cfg.replace(r#""output_router_logits": false"#, r#""router_jitter_noise": 0.1"#);
        assert!(import(&noisy, "x", None, &Target::default())
            .expect_err("jitter")
            .contains("`router_jitter_noise: 0.1` is not supported"));
        let e = import(
            &cfg.replace(r#""num_experts_per_tok": 2"#, r#""num_experts_per_tok": 5"#),
            "x",
            None,
            &Target::default(),
        )
        .expect_err("top-k");
        assert!(e.contains("num_local_experts"), "{e}");
    }

    #[test]
    fn an_unknown_field_or_architecture_is_named() {
        let e = import(r#"{"model_type": "t5"}"#, "x", None, &Target::default()).expect_err("t5");
        assert!(e.contains("`model_type: t5`"), "{e}");
        let cfg = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, "frobnicate": 1}"#;
        let e = import(cfg, "x", None, &Target::default()).expect_err("unknown field");
        assert!(e.contains("`frobnicate`"), "{e}");
        let e = import(
            &cfg.replace(r#""frobnicate": 1"#, r#""rope_scaling": {"type": "longrope", "factor": 2.0}"#),
            "x",
            None,
            &Target::default(),
        )
        .expect_err("rope scaling");
        assert!(e.contains("`rope_scaling"), "{e}");
        let e =
            import(&cfg.replace(r#", "frobnicate": 1"#, ""), "x", Some(128), &Target::default()).expect_err("window");
        assert!(e.contains("--seq 128"), "{e}");
    }

    #[test]
    fn a_field_of_the_wrong_type_is_named_not_read_as_absent() {
        let llama = r#"{"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64"#;
        let e = import(&format!(r#"{llama}, "sliding_window": "4096"}}"#), "x", Some(32), &Target::default())
            .expect_err("window");
        assert!(e.contains("`sliding_window` must be a whole number, found \"4096\""), "{e}");
        let e = import(&format!(r#"{llama}, "hidden_act": 5}}"#), "x", None, &Target::default()).expect_err("act");
        assert!(e.contains("`hidden_act` must be a string, found 5"), "{e}");
        let bert = r#"{"model_type": "bert", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64"#;
        let e = import(&format!(r#"{bert}, "sep_token_id": -1}}"#), "x", None, &Target::default()).expect_err("sep");
        assert!(e.contains("`sep_token_id` must be a whole number, found -1"), "{e}");
        let e =
            import(&format!(r#"{bert}, "id2label": ["a", "b"]}}"#), "x", None, &Target::default()).expect_err("labels");
        assert!(e.contains("`id2label` must map"), "{e}");
        let e = import(r#"{"model_type": 3}"#, "x", None, &Target::default()).expect_err("type");
        assert!(e.contains("`model_type` must be a string"), "{e}");
    }

    #[test]
    fn a_written_spec_always_checks() {
        let cfg = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}"#;
        let spec = import(cfg, "llama-3.1-8b", None, &Target::default()).expect("imports").spec;
        assert!(!crate::check_source(&spec).has_errors());
    }

    const LLAMA: &str = r#""model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64"#;

    #[test]
    fn transformers_5_dtype_and_default_rope_parameters_read_as_4_x_fields() {
        let four = import(
            &format!(r#"{{{LLAMA}, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}}"#),
            "x",
            None,
            &Target::default(),
        )
        .expect("4.x")
        .spec;
        let five = import(
            &format!(r#"{{{LLAMA}, "rope_parameters": {{"rope_theta": 500000.0, "rope_type": "default"}}, "dtype": "bfloat16"}}"#),
            "x",
            None,
            &Target::default(),
        )
        .expect("5.x")
        .spec;
        assert!(five.contains("rope=500000"), "{five}");
        assert_eq!(four, five);
        // both spellings must agree
        let e = import(
            &format!(r#"{{{LLAMA}, "rope_theta": 10000.0, "rope_parameters": {{"rope_theta": 500000.0, "rope_type": "default"}}}}"#),
            "x",
            None,
            &Target::default(),
        )
        .expect_err("two thetas");
        assert!(e.contains("`rope_parameters.rope_theta` 500000 differs from `rope_theta` 10000"), "{e}");
    }

    #[test]
    fn scaled_rope_types_import_as_the_blocks_rope_scaling() {
        let with = |params: &str| {
            import(
                &format!(r#"{{{LLAMA}, "rope_parameters": {{"rope_theta": 500000.0, {params}}}}}"#),
                "x",
                Some(16),
                &Target::default(),
            )
        };
        let spec = |params: &str| with(params).unwrap_or_else(|e| panic!("{params}: {e}")).spec;
        // Llama 3.1's
        let llama3 = spec(
            r#""rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192"#,
        );
        assert!(
            llama3.contains("rope=500000, rope_scaling=llama3, rope_factor=8, rope_low_freq=1, rope_high_freq=4, rope_original=8192"),
            "{llama3}"
        );
        assert!(spec(r#""rope_type": "linear", "factor": 2.0"#).contains("rope_scaling=linear, rope_factor=2,"));
        // dynamic scales beyond the config's own context (LLAMA's 64 positions)
        assert!(spec(r#""rope_type": "dynamic", "factor": 2.0"#)
            .contains("rope_scaling=dynamic, rope_factor=2, rope_original=64"));
        // YaRN's attention factor, 0.1·ln(4) + 1, and from DeepSeek's mscale pair
        let yarn = spec(r#""rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16"#);
        assert!(yarn.contains("rope_scaling=yarn, rope_factor=4, rope_original=16, rope_beta_fast=32, rope_beta_slow=1, rope_attention_factor=1.1386294361"), "{yarn}");
        let deepseek = spec(
            r#""rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0, "truncate": false"#,
        );
        assert!(deepseek.contains("rope_attention_factor=1, rope_truncate=false"), "{deepseek}");
        // a figure a kind needs, another kind's key, and a kind pipec does not run, each named
        let e = with(r#""rope_type": "llama3", "factor": 8.0"#).expect_err("incomplete");
        assert!(e.contains("needs `low_freq_factor`"), "{e}");
        let e = with(r#""rope_type": "linear", "factor": 2.0, "beta_fast": 8"#).expect_err("foreign key");
        assert!(e.contains("`rope_parameters.beta_fast` changes the rotary embeddings of `rope_type: linear`"), "{e}");
        let e = with(r#""rope_type": "longrope", "factor": 2.0"#).expect_err("longrope");
        assert!(
            e.contains("`rope_type: longrope` scales the rotary embeddings' frequencies in a way pipec does not run"),
            "{e}"
        );
        let e = with(r#""rope_type": "default", "factor": 2"#).expect_err("extra key");
        assert!(e.contains("`rope_parameters.factor` changes the rotary embeddings"), "{e}");
    }

    #[test]
    fn generic_fields_that_change_nothing_are_ignored_with_a_note_and_the_others_refused_with_why() {
        let generic = r#""return_dict": true, "output_hidden_states": false, "output_attentions": false,
            "chunk_size_feed_forward": 0, "problem_type": null, "is_encoder_decoder": false,
            "tie_encoder_decoder": false, "pruned_heads": {}, "torchscript": false, "use_bfloat16": false,
            "tf_legacy_loss": false, "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1}"#;
        let imported =
            import(&format!("{{{LLAMA}, {generic}}}"), "x", None, &Target::default()).expect("generic fields");
        assert_eq!(imported.notes.len(), 1, "{:?}", imported.notes);
        for key in ["return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "pruned_heads", "id2label"] {
            assert!(imported.notes[0].contains(&format!("`{key}`")), "{key}: {:?}", imported.notes);
        }
        assert!(!imported.spec.contains("return_dict"));
        for (field, why) in [
            (r#""chunk_size_feed_forward": 64"#, "`chunk_size_feed_forward: 64` changes what the model computes"),
            (r#""is_encoder_decoder": true"#, "`is_encoder_decoder: true` changes what the model computes"),
            (r#""pruned_heads": {"0": [1]}"#, "`pruned_heads: {\"0\":[1]}` changes what the model computes"),
        ] {
            let e = import(&format!("{{{LLAMA}, {field}}}"), "x", None, &Target::default()).expect_err(field);
            assert!(e.contains(why), "{e}");
        }
        // an unknown field is named without reading as if the model were unsupported
        let e =
            import(&format!(r#"{{{LLAMA}, "frobnicate": 1}}"#), "x", None, &Target::default()).expect_err("unknown");
        assert!(e.contains("this field of a `llama` config: `frobnicate`"), "{e}");
        assert!(!e.contains("cannot promise the same model"), "{e}");
    }

    #[test]
    fn sliding_windows_become_each_blocks_window_and_layer_types_say_which() {
        let qwen = r#""model_type": "qwen2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64"#;
        // planned for pipec's executor: torchtitan and Megatron-LM train identical blocks (E0702)
        let pipec = Target { engine: Some("pipec".into()), ..Target::default() };
        let spec = |cfg: &str| import(cfg, "x", None, &pipec).expect("imports").spec;
        let blocks = |spec: &str| -> Vec<String> {
            spec.lines().filter(|l| l.contains("transformer_block")).map(|l| l.trim().to_string()).collect()
        };
        let full = format!(
            r#"{{{qwen}, "use_sliding_window": true, "layer_types": ["full_attention", "full_attention"], "sliding_window": 16}}"#
        );
        let plain = spec(&full);
        assert!(!plain.contains("window="), "{plain}");
        // without `use_sliding_window` Qwen2 attends fully whatever the layer types say
        let unused = full
            .replace(r#""use_sliding_window": true, "#, "")
            .replace(r#"["full_attention", "#, r#"["sliding_attention", "#);
        assert!(!spec(&unused).contains("window="), "{unused}");
        // one full and one sliding layer: a run of each
        let mixed = spec(&full.replace(r#""full_attention"]"#, r#""sliding_attention"]"#));
        let lines = blocks(&mixed);
        assert_eq!(lines.len(), 2, "{mixed}");
        assert!(lines[0].starts_with("- repeat 1: transformer_block(") && !lines[0].contains("window"), "{mixed}");
        assert!(lines[1].starts_with("- repeat 1: ") && lines[1].ends_with(", window=16)"), "{mixed}");
        assert!(mixed.contains("sliding windows of 16"), "{mixed}");
        // alternating over 4 layers (GPT-OSS's pattern): two groups of a sliding and a full
        // block
        let four = qwen.replace(r#""num_hidden_layers": 2"#, r#""num_hidden_layers": 4"#);
        let alternating = spec(&format!(
            r#"{{{four}, "use_sliding_window": true, "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"], "sliding_window": 16}}"#
        ));
        let lines = blocks(&alternating);
        assert_eq!(lines.len(), 1, "{alternating}");
        let (sliding_block, full_block) = lines[0].split_once(" -> ").expect("a group of two blocks");
        assert!(sliding_block.starts_with("- repeat 2: transformer_block(") && sliding_block.ends_with(", window=16)"));
        assert!(full_block.starts_with("transformer_block(") && !full_block.contains("window"), "{alternating}");
        // Mistral slides in every layer by default; a window as long as the training window
        // is full attention
        let mistral = four.replace("qwen2", "mistral");
        let every = spec(&format!(r#"{{{mistral}, "sliding_window": 16}}"#));
        assert_eq!(blocks(&every).len(), 1, "{every}");
        assert!(blocks(&every)[0].starts_with("- repeat 4: ") && every.contains("window=16)"), "{every}");
        assert!(!spec(&format!(r#"{{{mistral}, "sliding_window": 64}}"#)).contains("window="));
        // Qwen2's older configs: `use_sliding_window` from layer `max_window_layers` on, runs
        // of equal layers
        let older =
            spec(&format!(r#"{{{four}, "use_sliding_window": true, "max_window_layers": 1, "sliding_window": 16}}"#));
        let lines = blocks(&older);
        assert_eq!(lines.len(), 2, "{older}");
        assert!(lines[0].starts_with("- repeat 1: ") && !lines[0].contains("window"), "{older}");
        assert!(lines[1].starts_with("- repeat 3: ") && lines[1].ends_with(", window=16)"), "{older}");
        let e = import(
            &full.replace(r#"["full_attention", "full_attention"]"#, r#"["full_attention"]"#),
            "x",
            None,
            &Target::default(),
        )
        .expect_err("count");
        assert!(e.contains("`layer_types` lists 1 layers"), "{e}");
    }

    #[test]
    fn the_cluster_is_the_one_asked_for_with_its_dgx_interconnect() {
        let cfg = format!("{{{LLAMA}}}");
        let cluster =
            Target { engine: Some("megatron".into()), nodes: 16, devices_per_node: 8, device: "a100-80gb".into() };
        let spec = import(&cfg, "x", None, &cluster).expect("cluster").spec;
        assert!(
            spec.contains("  nodes: 16\n  devices_per_node: 8\n  device: a100-80gb\n  links: dgx-a100\n"),
            "{spec}"
        );
        assert!(spec.contains("\nengine: megatron\n"), "{spec}");
        // the engines' fused attention, by default torchtitan's
        let spec = import(&cfg, "x", None, &Target::default()).expect("default").spec;
        assert!(spec.contains("\nengine: torchtitan\n") && spec.contains("\n  attention: flash\n"), "{spec}");
        let e =
            import(&cfg, "x", None, &Target { device: "h100".into(), ..Target::default() }).expect_err("not a preset");
        assert!(e.contains("--device `h100` is not a device preset (one of: "), "{e}");
        let e = import(&cfg, "x", None, &Target { device: "mi300x".into(), ..Target::default() })
            .expect_err("no interconnect");
        assert!(e.contains("no interconnect preset"), "{e}");
    }
}
