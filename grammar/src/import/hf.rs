//! A Hugging Face `config.json` becomes a spec (`pipec import`) — its `model` section written
//! as pipec layers (GPT-2, Llama, Mistral, Mixtral and Qwen2 families; BERT as a sequence
//! classifier), with a cluster, an `auto`
//! strategy and a training section to edit. Every field of the config that changes what
//! the model computes is either translated or refused by name; fields that do not (token
//! ids, dtype, versions, initialisation) are ignored.

use serde_json::{Map, Value};

/// Fields no family's computation depends on.
const IGNORED: &[&str] = &[
    "_name_or_path",
    "architectures",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
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

/// A config read field by field: every field used or checked is marked, and what is left
/// is refused by name.
struct Config {
    fields: Map<String, Value>,
    used: std::collections::BTreeSet<String>,
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

    /// Every field neither used nor ignorable: refused, all named at once.
    fn leftover(&self) -> Result<(), String> {
        let left: Vec<&str> = self
            .fields
            .keys()
            .map(String::as_str)
            .filter(|k| !self.used.contains(*k) && !IGNORED.contains(k))
            .collect();
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "field(s) pipec does not know, so cannot promise the same model: {}",
                left.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
            ))
        }
    }
}

/// The spec for a config's text.
pub fn import(text: &str, name: &str, seq: Option<usize>) -> Result<String, String> {
    let fields = match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return Err("not a JSON object".into()),
        Err(e) => return Err(format!("not JSON: {e}")),
    };
    let mut c = Config { fields, used: Default::default() };
    let family = c.text("model_type")?.ok_or("`model_type` is missing: which architecture is this?")?;
    let model = match family.as_str() {
        "gpt2" => gpt2(&mut c, seq)?,
        "llama" | "mistral" | "mixtral" | "qwen2" => llama(&mut c, &family, seq)?,
        "bert" => bert(&mut c, seq)?,
        other => {
            return Err(format!(
                "`model_type: {other}` is not an architecture pipec imports (it imports gpt2, llama, mistral, mixtral, qwen2 and bert)"
            ))
        }
    };
    c.leftover()?;
    let spec = format!(
        "# Imported by `pipec import` from a Hugging Face `{family}` config. The model computes what\n\
         # `transformers` computes for it; the cluster, the strategy and the training are a\n\
         # starting point to edit.\n\
         name: {name}\n\
         {model}\
         cluster:\n  nodes: 1\n  devices_per_node: 8\n  device: h100-sxm\n  links: dgx-h100\n\
         strategy: auto\n\
         training:\n  batch_size: 64\n  steps: 1000\n  optimizer: {{ kind: adamw, lr: 0.0003, weight_decay: 0.1 }}\n  precision: bf16\n  data: {{ kind: synthetic }}\n"
    );
    // the importer never writes a spec that does not check (the model and name included)
    let checked = crate::check_source(&spec);
    if let Some(d) = checked.diagnostics.iter().find(|d| d.severity == crate::Severity::Error) {
        return Err(format!("the spec written from this config does not check: {} ({})", d.message, d.code));
    }
    Ok(spec)
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
    for k in ["attn_pdrop", "resid_pdrop", "embd_pdrop"] {
        c.require(k, |_| true, "")?;
    }
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
        "# GPT-2: {layers} blocks of d = {d} with {heads} heads, a tied {vocab}-token vocabulary. Dropout\n\
         # (attn/resid/embd_pdrop) is not applied inside pipec's blocks.\n\
         model:\n  input: [{seq}]\n  layers:\n\
         \x20   - embedding({vocab}, {d}) as wte\n\
         \x20   - pos_embedding({positions}) as wpe\n\
         \x20   - repeat {layers}: transformer_block(d={d}, heads={heads}, ff={ff}, causal=true, mlp={mlp}{block_eps})\n\
         \x20   - {final_norm}\n\
         \x20   - linear({d}, {vocab}, bias=false, tie=wte)\n\
         \x20 loss: cross_entropy\n"
    ))
}

fn llama(c: &mut Config, family: &str, seq: Option<usize>) -> Result<String, String> {
    let vocab = c.count("vocab_size")?;
    let d = c.count("hidden_size")?;
    let ff = c.count("intermediate_size")?;
    let layers = c.count("num_hidden_layers")?;
    let heads = c.count("num_attention_heads")?;
    let kv = c.count_or("num_key_value_heads", Some(heads))?;
    let positions = c.count("max_position_embeddings")?;
    let theta = c.number_or("rope_theta", 10000.0)?;
    let eps = c.number_or("rms_norm_eps", 1e-6)?;
    let tied = c.flag_or("tie_word_embeddings", false)?;
    let act = c.text("hidden_act")?.unwrap_or_else(|| "silu".into());
    if act != "silu" {
        return Err(format!("`hidden_act: {act}` is not supported: pipec's gated MLPs are SwiGLU (silu) and GeGLU"));
    }
    if d % heads != 0 {
        return Err(format!("`hidden_size` {d} is not a multiple of `num_attention_heads` {heads}"));
    }
    c.require(
        "head_dim",
        |v| v.as_u64() == Some((d / heads) as u64),
        "pipec's heads are hidden_size / num_attention_heads wide",
    )?;
    c.require("rope_scaling", |_| false, "scaled rotary embeddings (Llama 3.1's, YaRN) are not a pipec layer yet")?;
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
    // a sliding window at least the training window long attends to every earlier position
    let seq = window(positions, seq)?;
    let use_window = c.flag_or("use_sliding_window", matches!(family, "mistral" | "mixtral"))?;
    if let Some(w) = c.index("sliding_window")? {
        if use_window && (w as usize) < seq {
            return Err(format!(
                "`sliding_window: {w}` is shorter than the training window of {seq}: pipec's attention is full (use --seq {w} or less)"
            ));
        }
    }
    let label = match family {
        "llama" => "Llama",
        "mistral" => "Mistral",
        "mixtral" => "Mixtral",
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
        Some((experts, top_k, aux))
    } else {
        None
    };
    let mut args = format!("d={d}, heads={heads}, ff={ff}, causal=true");
    if kv != heads {
        args += &format!(", kv_heads={kv}");
    }
    args += &format!(", norm=rmsnorm, mlp=swiglu, rope={}, bias=false", number(theta));
    if qkv_bias {
        args += ", qkv_bias=true";
    }
    if let Some((experts, top_k, aux)) = experts {
        args += &format!(", experts={experts}, top_k={top_k}, aux_loss={}", number(aux));
    }
    // the norms' ε, written only when not pipec's default
    let eps = (eps != pipec_plan::model::DEFAULT_EPS).then(|| format!("eps={}", number(eps)));
    if let Some(e) = &eps {
        args += &format!(", {e}");
    }
    let final_norm = eps.map_or_else(|| "rmsnorm".to_string(), |e| format!("rmsnorm({e})"));
    let (table, head) = if tied {
        (format!("embedding({vocab}, {d}) as tokens"), format!("linear({d}, {vocab}, bias=false, tie=tokens)"))
    } else {
        (format!("embedding({vocab}, {d})"), format!("linear({d}, {vocab}, bias=false) as lm_head"))
    };
    let gqa = if kv == heads { String::new() } else { format!(", {kv} key/value heads") };
    let gqa = match experts {
        Some((e, k, _)) => format!("{gqa}, {e} experts ({k} per token)"),
        None => gqa,
    };
    Ok(format!(
        "# {label}: {layers} blocks of d = {d} with {heads} heads{gqa}, a {vocab}-token vocabulary{}.\n\
         model:\n  input: [{seq}]\n  layers:\n\
         \x20   - {table}\n\
         \x20   - repeat {layers}: transformer_block({args})\n\
         \x20   - {final_norm}\n\
         \x20   - {head}\n\
         \x20 loss: cross_entropy\n",
        if tied { " (tied)" } else { "" }
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
    let probability = |c: &mut Config, key: &str| -> Result<f64, String> {
        match c.take(key) {
            None => Ok(0.0),
            Some(v) => v
                .as_f64()
                .filter(|p| (0.0..1.0).contains(p))
                .ok_or_else(|| format!("`{key}` must be a probability in [0, 1), found {v}")),
        }
    };
    let hidden_dropout = probability(c, "hidden_dropout_prob")?;
    let classifier_dropout = match c.fields.get("classifier_dropout").filter(|v| !v.is_null()) {
        Some(_) => probability(c, "classifier_dropout")?,
        None => {
            c.used.insert("classifier_dropout".into());
            hidden_dropout
        }
    };
    c.require("attention_probs_dropout_prob", |_| true, "")?;
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
         # sequence classifier over {labels} classes (the [CLS] position through the pooler). Dropout\n\
         # inside the blocks (hidden and attention) is not applied.{sep_note}\n\
         model:\n  input: [{seq}]\n  layers:\n\
         \x20   - embedding({vocab}, {d}, types={types}{sep})\n\
         \x20   - pos_embedding({positions})\n\
         \x20   - layernorm(eps={e})\n\
         {}\
         \x20   - repeat {layers}: transformer_block(d={d}, heads={heads}, ff={ff}{mlp}, post_norm=true, eps={e})\n\
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
    fn numbers_are_written_as_a_spec_reads_them() {
        assert_eq!(number(10000.0), "10000");
        assert_eq!(number(500000.0), "500000");
        assert_eq!(number(1e-6), "1e-6");
        assert_eq!(number(1e-5), "1e-5");
    }

    #[test]
    fn a_mixtral_config_gives_expert_blocks_with_the_loss_transformers_adds() {
        let cfg = r#"{"model_type": "mixtral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
            "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "output_router_logits": false}"#;
        let spec = import(cfg, "x", None).expect("mixtral");
        assert!(spec.contains("experts=4, top_k=2, aux_loss=0,"), "{spec}");
        // the loss only where `transformers` adds it
        let spec =
            import(&cfg.replace(r#""output_router_logits": false"#, r#""output_router_logits": true"#), "x", None)
                .expect("with the loss");
        assert!(spec.contains("experts=4, top_k=2, aux_loss=2e-2,"), "{spec}");
        let checked = crate::check_source(&spec);
        assert!(!checked.has_errors(), "{:?}", checked.diagnostics);
        // noise on the router's logits, or more experts per token than there are, is refused
        let noisy = cfg.replace(r#""output_router_logits": false"#, r#""router_jitter_noise": 0.1"#);
        assert!(import(&noisy, "x", None).expect_err("jitter").contains("`router_jitter_noise: 0.1` is not supported"));
        let e = import(&cfg.replace(r#""num_experts_per_tok": 2"#, r#""num_experts_per_tok": 5"#), "x", None)
            .expect_err("top-k");
        assert!(e.contains("num_local_experts"), "{e}");
    }

    #[test]
    fn an_unknown_field_or_architecture_is_named() {
        let e = import(r#"{"model_type": "t5"}"#, "x", None).expect_err("t5");
        assert!(e.contains("`model_type: t5`"), "{e}");
        let cfg = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, "frobnicate": 1}"#;
        let e = import(cfg, "x", None).expect_err("unknown field");
        assert!(e.contains("`frobnicate`"), "{e}");
        let e = import(
            &cfg.replace(r#""frobnicate": 1"#, r#""rope_scaling": {"type": "linear", "factor": 2.0}"#),
            "x",
            None,
        )
        .expect_err("rope scaling");
        assert!(e.contains("`rope_scaling"), "{e}");
        let e = import(&cfg.replace(r#", "frobnicate": 1"#, ""), "x", Some(128)).expect_err("window");
        assert!(e.contains("--seq 128"), "{e}");
    }

    #[test]
    fn a_field_of_the_wrong_type_is_named_not_read_as_absent() {
        let llama = r#"{"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64"#;
        let e = import(&format!(r#"{llama}, "sliding_window": "4096"}}"#), "x", Some(32)).expect_err("window");
        assert!(e.contains("`sliding_window` must be a whole number, found \"4096\""), "{e}");
        let e = import(&format!(r#"{llama}, "hidden_act": 5}}"#), "x", None).expect_err("act");
        assert!(e.contains("`hidden_act` must be a string, found 5"), "{e}");
        let bert = r#"{"model_type": "bert", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64"#;
        let e = import(&format!(r#"{bert}, "sep_token_id": -1}}"#), "x", None).expect_err("sep");
        assert!(e.contains("`sep_token_id` must be a whole number, found -1"), "{e}");
        let e = import(&format!(r#"{bert}, "id2label": ["a", "b"]}}"#), "x", None).expect_err("labels");
        assert!(e.contains("`id2label` must map"), "{e}");
        let e = import(r#"{"model_type": 3}"#, "x", None).expect_err("type");
        assert!(e.contains("`model_type` must be a string"), "{e}");
    }

    #[test]
    fn a_written_spec_always_checks() {
        let cfg = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}"#;
        let spec = import(cfg, "llama-3.1-8b", None).expect("imports");
        assert!(!crate::check_source(&spec).has_errors());
    }
}
