//! The layer catalogue: each DSL layer's signature and documentation, and the resolution of a
//! parsed call (`conv2d(3, 64, k=3, pad=1)`) into an [`Op`] with every argument checked.

use pipec_plan::model::{MlpKind, Moe, NormKind, Op, Pooling, Router};
use pipec_plan::vocab::Choice;

use crate::dsl::{ArgValue, LayerCall, Rel};

/// The kind of value an argument takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ArgKind {
    /// A positive integer.
    Count,
    /// A non-negative integer.
    Size,
    /// A probability in [0, 1).
    Prob,
    /// `true` or `false`.
    Bool,
    /// A non-negative number (0 often meaning "none").
    NonNegative,
    /// A positive number.
    Positive,
    /// A block's norm: `layernorm` or `rmsnorm` (the index into `NormKind::ALL`).
    Norm,
    /// A block's MLP: `gelu`, `gelu_tanh`, `swiglu` or `geglu` (the index into `MlpKind::ALL`).
    Mlp,
    /// A pooling over positions: `first` or `mean` (the index into `Pooling::ALL`).
    Pooling,
    /// A mixture-of-experts router: `softmax` or `sigmoid` (the index into `Router::ALL`).
    Router,
    /// How rotary frequencies are scaled: `none`, `linear`, `dynamic`, `yarn` or `llama3` (the
    /// index into `pipec_plan::rope::KINDS`).
    RopeScaling,
}

/// One parameter of a layer: its name, aliases, kind and default (None = required).
#[derive(Debug, Clone, Copy)]
pub struct Param {
    pub name: &'static str,
    pub aliases: &'static [&'static str],
    pub kind: ArgKind,
    pub default: Option<f64>,
}

/// One layer of the catalogue.
#[derive(Debug, Clone, Copy)]
pub struct LayerDoc {
    pub name: &'static str,
    pub signature: &'static str,
    pub doc: &'static str,
    pub params: &'static [Param],
}

const fn p(name: &'static str, kind: ArgKind, default: Option<f64>) -> Param {
    Param { name, aliases: &[], kind, default }
}

const fn pa(name: &'static str, aliases: &'static [&'static str], kind: ArgKind, default: Option<f64>) -> Param {
    Param { name, aliases, kind, default }
}

/// Every layer the DSL knows.
pub const LAYERS: &[LayerDoc] = &[
    LayerDoc {
        name: "linear",
        signature: "linear(in, out, bias=true, tie=NAME)",
        doc: "Fully connected layer on the last dimension: y = x·Wᵀ + b. `tie=NAME` (with `bias=false`) makes W the embedding table whose output is named NAME, as GPT-2's output layer: the two copies apply the same summed gradient, across stages too.",
        params: &[p("in", ArgKind::Count, None), p("out", ArgKind::Count, None), p("bias", ArgKind::Bool, Some(1.0))],
    },
    LayerDoc {
        name: "conv2d",
        signature: "conv2d(in, out, k, stride=1, pad=0, bias=true)",
        doc: "2-D convolution over a [channels, height, width] input with a square k×k kernel.",
        params: &[
            p("in", ArgKind::Count, None),
            p("out", ArgKind::Count, None),
            pa("k", &["kernel"], ArgKind::Count, None),
            p("stride", ArgKind::Count, Some(1.0)),
            pa("pad", &["padding"], ArgKind::Size, Some(0.0)),
            p("bias", ArgKind::Bool, Some(1.0)),
        ],
    },
    LayerDoc {
        name: "maxpool2d",
        signature: "maxpool2d(k, stride=k, pad=0)",
        doc: "2-D max pooling with a k×k window, padded by `pad` on each side (at most k/2).",
        params: &[
            pa("k", &["kernel"], ArgKind::Count, None),
            p("stride", ArgKind::Count, Some(0.0)),
            pa("pad", &["padding"], ArgKind::Size, Some(0.0)),
        ],
    },
    LayerDoc {
        name: "avgpool2d",
        signature: "avgpool2d(k, stride=k, pad=0)",
        doc: "2-D average pooling with a k×k window, padded by `pad` zeros on each side (counted in the average).",
        params: &[
            pa("k", &["kernel"], ArgKind::Count, None),
            p("stride", ArgKind::Count, Some(0.0)),
            pa("pad", &["padding"], ArgKind::Size, Some(0.0)),
        ],
    },
    LayerDoc {
        name: "adaptive_avgpool2d",
        signature: "adaptive_avgpool2d(size=1)",
        doc: "Average pooling to a size×size output whatever the input's height and width; size 1 is global average pooling.",
        params: &[p("size", ArgKind::Count, Some(1.0))],
    },
    LayerDoc {
        name: "batchnorm2d",
        signature: "batchnorm2d [(c)]",
        doc: "Batch normalisation over the channels of a [channels, height, width] input (c is inferred when omitted). In training it uses each microbatch's statistics; its running mean and variance are state (docs/spec.md says how microbatches, replicas and recompute update them).",
        params: &[p("c", ArgKind::Count, Some(0.0))],
    },
    LayerDoc { name: "flatten", signature: "flatten", doc: "Flattens the per-sample shape to one dimension.", params: &[] },
    LayerDoc { name: "relu", signature: "relu", doc: "Rectified linear unit, max(x, 0).", params: &[] },
    LayerDoc { name: "gelu", signature: "gelu", doc: "Gaussian error linear unit, exact (erf) form, as `torch.nn.GELU()`.", params: &[] },
    LayerDoc {
        name: "gelu_tanh",
        signature: "gelu_tanh",
        doc: "GELU's tanh approximation, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))): GPT-2's `gelu_new`.",
        params: &[],
    },
    LayerDoc { name: "tanh", signature: "tanh", doc: "Hyperbolic tangent.", params: &[] },
    LayerDoc { name: "sigmoid", signature: "sigmoid", doc: "Logistic sigmoid.", params: &[] },
    LayerDoc {
        name: "layernorm",
        signature: "layernorm [(d, eps=1e-5)]",
        doc: "Layer normalisation over the last dimension (d is inferred when omitted; BERT's ε is 1e-12).",
        params: &[p("d", ArgKind::Count, Some(0.0)), p("eps", ArgKind::Positive, Some(pipec_plan::model::DEFAULT_EPS))],
    },
    LayerDoc {
        name: "rmsnorm",
        signature: "rmsnorm [(d, eps=1e-5)]",
        doc: "Root-mean-square normalisation over the last dimension, x / √(mean(x²) + eps) · gain (Llama's final norm; d is inferred when omitted).",
        params: &[p("d", ArgKind::Count, Some(0.0)), p("eps", ArgKind::Positive, Some(pipec_plan::model::DEFAULT_EPS))],
    },
    LayerDoc {
        name: "dropout",
        signature: "dropout(p)",
        doc: "Zeroes each element with probability p during training.",
        params: &[p("p", ArgKind::Prob, None)],
    },
    LayerDoc {
        name: "embedding",
        signature: "embedding(vocab, d, types=0, sep=NONE)",
        doc: "Token embedding: a [sequence] of token ids in 0..vocab becomes [sequence, d]. `types=2` adds a token-type (segment) embedding as BERT's: position p's type is the number of `sep` tokens before p (at most types − 1), the type ids a Hugging Face tokenizer gives a pair `[CLS] A [SEP] B [SEP]`; without `sep`, type 0 everywhere.",
        params: &[
            p("vocab", ArgKind::Count, None),
            p("d", ArgKind::Count, None),
            pa("types", &["type_vocab_size"], ArgKind::Size, Some(0.0)),
            // -1: no separator
            p("sep", ArgKind::Size, Some(-1.0)),
        ],
    },
    LayerDoc {
        name: "seq_pool",
        signature: "seq_pool(first|mean)",
        doc: "Reduces a [sequence, d] input to [d] over its positions: `first` keeps the first position (BERT's [CLS] token; its pooler is `linear(d, d)` then `tanh`), `mean` averages them.",
        params: &[p("how", ArgKind::Pooling, None)],
    },
    LayerDoc {
        name: "pos_embedding",
        signature: "pos_embedding [(max_len)]",
        doc: "Learned positional embedding: adds a learned vector per position to a [sequence, d] input (GPT-2's `wpe`). The table has max_len rows (the sequence length when omitted).",
        params: &[p("max_len", ArgKind::Count, Some(0.0))],
    },
    LayerDoc {
        name: "transformer_block",
        signature: "transformer_block(d, heads, ff, causal=false, kv_heads=heads, norm=layernorm, mlp=gelu, rope=0, bias=true, qkv_bias=bias, eps=1e-5, post_norm=false, experts=0, top_k=2, shared_experts=0, capacity=0, router=softmax, norm_topk=true, aux_loss=0, skew=1, head_dim=d/heads, qk_norm=false, window=0, sinks=false, kv_lora=0, q_lora=0, rope_dim=0, v_head_dim=head_dim, dropout=0, rope_scaling=none, rope_factor=1, rope_original=0, rope_low_freq=1, rope_high_freq=4, rope_beta_fast=32, rope_beta_slow=1, rope_attention_factor=0, rope_truncate=true, route_scale=1, route_groups=0, route_group_top=0, expert_bias=false, rope_mscale_all_dim=0)",
        doc: "Pre-norm transformer block on [sequence, d]: self-attention with `heads` heads and an MLP of width `ff`, each with a residual connection. `causal=true` lets each position attend only to itself and earlier positions (a GPT decoder block). A Llama-style block: `kv_heads` key/value heads shared by groups of query heads (grouped-query attention; 1 is multi-query), `norm=rmsnorm`, `mlp=swiglu` (or `geglu`; `gelu_tanh` is GPT-2's GELU), `rope=θ` rotary position embeddings of base θ on queries and keys, `bias=false` (no biases on the projections; `qkv_bias=true` keeps the query/key/value ones, as Qwen2), `eps` the norms' ε. `post_norm=true` puts each norm after its residual sum (BERT): norm(x + attention(x)), then norm(h + mlp(h)). `experts=E` makes the MLP a mixture of experts (Mixtral, DeepSeek): a router (a linear gate without bias, d → E; `router=softmax` or `sigmoid`) sends each token to its `top_k` best-scored experts, each an MLP like the dense one, and sums their outputs weighted by the scores (divided by their sum with `norm_topk=true`); `shared_experts` more experts take every token; `capacity=c` lets an expert take at most ⌈c · tokens · top_k / E⌉ of a microbatch's tokens, dropping the later tokens beyond it (0: none dropped); `aux_loss` is the load-balancing loss's weight (Switch Transformer's α; 0, the default, adds none); `skew=f` is what the prediction assumes of the routing: the busiest expert takes f times the mean share of the choices (1, the default: uniform; at most experts/top_k). DeepSeek-V3's routing: `route_scale=s` multiplies the chosen experts' weights by s (after `norm_topk`; `routed_scaling_factor` 2.5); `route_groups=G, route_group_top=g` split the experts into G equal groups and let each token choose only among the experts of its g best groups, a group scored by the sum of its top_k/g best scores (`n_group` 8, `topk_group` 4); `expert_bias=true` adds a fixed bias per expert to the sigmoid scores when choosing, not when weighting (`e_score_correction_bias`, auxiliary-loss-free balancing). Today's attention shapes: `head_dim=n` gives each head n features whatever d/heads is (Qwen3: 128 on d=2048 with 32 heads); `qk_norm=true` normalises each head's queries and keys (an RMSNorm, a gain per head feature, before the rotary embeddings: Qwen3, OLMo 2); `window=w` is sliding-window attention (each position attends to itself and the w − 1 before it; needs `causal=true`); `sinks=true` adds a learned logit per head to every softmax's normaliser (GPT-OSS). `kv_lora=r` makes the attention DeepSeek's multi-head latent attention: keys and values come from a shared latent of r features (and a rotary key part of `rope_dim` features shared by the heads), queries from a latent of `q_lora` features (0: from the input); each query and key head has `head_dim` features without rotary embeddings and `rope_dim` with them, each value head `v_head_dim` (DeepSeek-V3: kv_lora=512, q_lora=1536, head_dim=128, rope_dim=64, v_head_dim=128). `dropout=p` drops the attention's probabilities and each residual branch's output with probability p in training (GPT-2's and GPT-3's 0.1, BERT's; each mask drawn by place in the whole microbatch, so every layout drops what one device drops). `rope_scaling=` scales the rotary frequencies for a context longer than the pretrained one, as Hugging Face's `rope_type`s: `linear` (every frequency over `rope_factor`), `dynamic` (NTK: the base raised once the sequence is longer than `rope_original`), `yarn` (frequencies that turn fewer than `rope_beta_slow` times over `rope_original` positions divided by `rope_factor`, more than `rope_beta_fast` times kept, a ramp between; cosines and sines times `rope_attention_factor`, 0: 0.1·ln(factor) + 1; `rope_truncate` rounds the ramp's ends; with `kv_lora`, `rope_mscale_all_dim=m` multiplies the softmax's scale by (0.1·m·ln(factor) + 1)², DeepSeek's `mscale_all_dim`) or `llama3` (Llama 3.1: wavelengths above rope_original/rope_low_freq divided by `rope_factor`, below rope_original/rope_high_freq kept, blended between; Llama 3.1: rope_factor=8, rope_low_freq=1, rope_high_freq=4, rope_original=8192).",
        params: &[
            pa("d", &["d_model"], ArgKind::Count, None),
            p("heads", ArgKind::Count, None),
            pa("ff", &["d_ff"], ArgKind::Count, None),
            p("causal", ArgKind::Bool, Some(0.0)),
            p("kv_heads", ArgKind::Size, Some(0.0)),
            p("norm", ArgKind::Norm, Some(0.0)),
            p("mlp", ArgKind::Mlp, Some(0.0)),
            pa("rope", &["rope_theta"], ArgKind::NonNegative, Some(0.0)),
            p("bias", ArgKind::Bool, Some(1.0)),
            // -1: as `bias`
            p("qkv_bias", ArgKind::Bool, Some(-1.0)),
            p("eps", ArgKind::Positive, Some(pipec_plan::model::DEFAULT_EPS)),
            p("post_norm", ArgKind::Bool, Some(0.0)),
            p("experts", ArgKind::Size, Some(0.0)),
            p("top_k", ArgKind::Size, Some(2.0)),
            p("shared_experts", ArgKind::Size, Some(0.0)),
            p("capacity", ArgKind::NonNegative, Some(0.0)),
            p("router", ArgKind::Router, Some(0.0)),
            p("norm_topk", ArgKind::Bool, Some(1.0)),
            p("aux_loss", ArgKind::NonNegative, Some(0.0)),
            p("skew", ArgKind::Positive, Some(1.0)),
            p("head_dim", ArgKind::Size, Some(0.0)),
            p("qk_norm", ArgKind::Bool, Some(0.0)),
            pa("window", &["sliding_window"], ArgKind::Size, Some(0.0)),
            p("sinks", ArgKind::Bool, Some(0.0)),
            pa("kv_lora", &["kv_lora_rank"], ArgKind::Size, Some(0.0)),
            pa("q_lora", &["q_lora_rank"], ArgKind::Size, Some(0.0)),
            pa("rope_dim", &["qk_rope_head_dim"], ArgKind::Size, Some(0.0)),
            p("v_head_dim", ArgKind::Size, Some(0.0)),
            p("dropout", ArgKind::Prob, Some(0.0)),
            p("rope_scaling", ArgKind::RopeScaling, Some(0.0)),
            pa("rope_factor", &["factor"], ArgKind::Positive, Some(1.0)),
            pa("rope_original", &["original_max_position_embeddings"], ArgKind::Size, Some(0.0)),
            pa("rope_low_freq", &["low_freq_factor"], ArgKind::Positive, Some(1.0)),
            pa("rope_high_freq", &["high_freq_factor"], ArgKind::Positive, Some(4.0)),
            pa("rope_beta_fast", &["beta_fast"], ArgKind::Positive, Some(32.0)),
            pa("rope_beta_slow", &["beta_slow"], ArgKind::Positive, Some(1.0)),
            // 0: YaRN's 0.1·ln(factor) + 1
            pa("rope_attention_factor", &["attention_factor"], ArgKind::NonNegative, Some(0.0)),
            pa("rope_truncate", &["truncate"], ArgKind::Bool, Some(1.0)),
            pa("route_scale", &["routed_scaling_factor"], ArgKind::Positive, Some(1.0)),
            pa("route_groups", &["n_group"], ArgKind::Size, Some(0.0)),
            pa("route_group_top", &["topk_group"], ArgKind::Size, Some(0.0)),
            p("expert_bias", ArgKind::Bool, Some(0.0)),
            pa("rope_mscale_all_dim", &["mscale_all_dim"], ArgKind::NonNegative, Some(0.0)),
        ],
    },
    LayerDoc {
        name: "lstm",
        signature: "lstm(in, hidden)",
        doc: "One LSTM layer over a [sequence, in] input; outputs every step's hidden state, [sequence, hidden]. Stack layers by repeating it.",
        params: &[p("in", ArgKind::Count, None), p("hidden", ArgKind::Count, None)],
    },
];

/// The joins: calls that take named tensors instead of the tensor flowing into them.
pub const JOINS: &[LayerDoc] = &[
    LayerDoc {
        name: "add",
        signature: "add(a, b, ...)",
        doc: "Element-wise sum of two or more named tensors of one shape (a residual connection). Must start its item.",
        params: &[],
    },
    LayerDoc {
        name: "concat",
        signature: "concat(a, b, ...)",
        doc: "Concatenation of two or more named tensors along their first dimension (channels of a feature map). Must start its item.",
        params: &[],
    },
];

/// Looks a layer up by name.
pub fn layer_doc(name: &str) -> Option<&'static LayerDoc> {
    LAYERS.iter().find(|l| l.name == name)
}

/// The argument of `call` that gave its layer's parameter `param` (by position or by name),
/// if the call gave it.
pub fn argument_of(call: &LayerCall, param: usize) -> Option<&crate::dsl::Arg> {
    let doc = layer_doc(&call.name)?;
    let p = doc.params.get(param)?;
    call.args.iter().filter(|a| a.key.is_none()).nth(param).or_else(|| {
        call.args.iter().find(|a| a.key.as_ref().is_some_and(|(k, _)| k == p.name || p.aliases.contains(&k.as_str())))
    })
}

/// A problem with a call's arguments: diagnostic code, message and relative span.
#[derive(Debug, Clone, PartialEq)]
pub struct CallError {
    pub code: &'static str,
    pub message: String,
    pub label: String,
    pub span: Rel,
    pub help: Option<String>,
}

/// Resolves a parsed call into an operator. `input` is the per-sample shape reaching the
/// layer when known (used for `layernorm` without arguments).
pub fn resolve_call(call: &LayerCall, input: Option<&[usize]>) -> Result<Op, Vec<CallError>> {
    resolve_call_warning(call, input).map(|(op, _)| op)
}

/// [`resolve_call`], with the warnings about arguments that do not apply (W0314): a
/// mixture of experts' settings on a block without `experts=`.
pub fn resolve_call_warning(call: &LayerCall, input: Option<&[usize]>) -> Result<(Op, Vec<CallError>), Vec<CallError>> {
    let Some(doc) = layer_doc(&call.name) else {
        let names = LAYERS.iter().map(|l| l.name);
        let help = match crate::diagnostic::did_you_mean(&call.name, names) {
            Some(s) => format!("did you mean `{s}`?"),
            None => format!("known layers: {}", LAYERS.iter().map(|l| l.name).collect::<Vec<_>>().join(", ")),
        };
        return Err(vec![CallError {
            code: "E0302",
            message: format!("unknown layer `{}`", call.name),
            label: "not a layer pipec knows".into(),
            span: call.name_span,
            help: Some(help),
        }]);
    };
    let mut errors = Vec::new();
    let mut values: Vec<Option<(f64, Rel)>> = vec![None; doc.params.len()];
    // arguments given with a bad value: reported once, not again as missing
    let mut invalid = vec![false; doc.params.len()];
    let mut positional = 0usize;
    for arg in &call.args {
        let slot = match &arg.key {
            None => {
                let s = positional;
                positional += 1;
                if s >= doc.params.len() {
                    errors.push(CallError {
                        code: "E0303",
                        message: format!("`{}` takes {} argument(s), got more", doc.name, doc.params.len()),
                        label: "extra argument".into(),
                        span: arg.span,
                        help: Some(format!("signature: {}", doc.signature)),
                    });
                    continue;
                }
                s
            }
            Some((key, kspan)) => {
                match doc.params.iter().position(|p| p.name == key || p.aliases.contains(&key.as_str())) {
                    Some(s) => s,
                    None => {
                        let names = doc.params.iter().map(|p| p.name);
                        let help = match crate::diagnostic::did_you_mean(key, names) {
                            Some(s) => format!("did you mean `{s}`? signature: {}", doc.signature),
                            None => format!("signature: {}", doc.signature),
                        };
                        errors.push(CallError {
                            code: "E0303",
                            message: format!("`{}` has no argument `{key}`", doc.name),
                            label: "unknown argument".into(),
                            span: *kspan,
                            help: Some(help),
                        });
                        continue;
                    }
                }
            }
        };
        let param = doc.params[slot];
        if values[slot].is_some() {
            errors.push(CallError {
                code: "E0303",
                message: format!("argument `{}` of `{}` is given twice", param.name, doc.name),
                label: "given again here".into(),
                span: arg.span,
                help: Some(format!("signature: {}", doc.signature)),
            });
            continue;
        }
        match check_value(param, &arg.value) {
            Ok(v) => values[slot] = Some((v, arg.value_span)),
            Err(why) => {
                invalid[slot] = true;
                errors.push(CallError {
                    code: "E0303",
                    message: format!("argument `{}` of `{}` {why}", param.name, doc.name),
                    label: format!("found `{}`", arg.value),
                    span: arg.value_span,
                    help: Some(format!("signature: {}", doc.signature)),
                });
            }
        }
    }
    for (i, param) in doc.params.iter().enumerate() {
        if values[i].is_none() && !invalid[i] && param.default.is_none() {
            errors.push(CallError {
                code: "E0303",
                message: format!("`{}` is missing its argument `{}`", doc.name, param.name),
                label: format!("needs `{}`", param.name),
                span: call.span,
                help: Some(format!("signature: {}", doc.signature)),
            });
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let mut warnings = Vec::new();
    // multi-head latent attention's sizes without its latent: they would be ignored
    let kv_lora = pipec_plan::model::KV_LORA_ARG;
    if doc.name == "transformer_block" && values[kv_lora].is_none_or(|(r, _)| r == 0.0) {
        let latent = (kv_lora + 1..kv_lora + 4).chain([pipec_plan::model::MSCALE_ALL_DIM_ARG]);
        for (i, param) in latent.map(|i| (i, &doc.params[i])) {
            if let Some((_, span)) = values[i] {
                warnings.push(CallError {
                    code: "W0314",
                    message: format!(
                        "`{}` applies only to multi-head latent attention, and this block has none",
                        param.name
                    ),
                    label: "ignored without `kv_lora=`".into(),
                    span,
                    help: Some(
                        "add `kv_lora=R` (the keys' and values' latent width) to make the attention multi-head latent attention, or remove it"
                            .into(),
                    ),
                });
            }
        }
    }
    // a mixture of experts' settings without experts: they would be ignored
    if doc.name == "transformer_block" && values[12].is_none_or(|(e, _)| e == 0.0) {
        let moe = (13..=pipec_plan::model::MOE_SKEW_ARG)
            .chain(pipec_plan::model::ROUTE_SCALE_ARG..=pipec_plan::model::EXPERT_BIAS_ARG);
        for (i, param) in moe.map(|i| (i, &doc.params[i])) {
            if let Some((_, span)) = values[i] {
                warnings.push(CallError {
                    code: "W0314",
                    message: format!("`{}` applies only to a mixture of experts, and this block has none", param.name),
                    label: "ignored without `experts=`".into(),
                    span,
                    help: Some(
                        "add `experts=E` (the number of experts) to make the MLP a mixture of experts, or remove it"
                            .into(),
                    ),
                });
            }
        }
    }
    // a rotary scaling's figures that its kind does not read: they would be ignored
    if doc.name == "transformer_block" {
        let first = pipec_plan::model::ROPE_SCALING_ARG;
        let kind = values[first].map_or(0, |(k, _)| k as usize);
        let kind_name = pipec_plan::rope::KINDS.get(kind).copied().unwrap_or("none");
        // which of rope_factor … rope_truncate each kind reads
        let reads: [bool; 8] = match kind_name {
            "linear" => [true, false, false, false, false, false, false, false],
            "dynamic" => [true, true, false, false, false, false, false, false],
            "yarn" => [true, true, false, false, true, true, true, true],
            "llama3" => [true, true, true, true, false, false, false, false],
            _ => [false; 8],
        };
        for (k, param) in doc.params.iter().enumerate().skip(first + 1).take(8) {
            if let (Some((_, span)), false) = (values[k], reads[k - first - 1]) {
                warnings.push(CallError {
                    code: "W0314",
                    message: format!("`{}` does not apply to `rope_scaling={kind_name}`", param.name),
                    label: "ignored".into(),
                    span,
                    help: Some(
                        "rope_factor: every kind; rope_original: dynamic, yarn and llama3; rope_low_freq and rope_high_freq: llama3; rope_beta_fast, rope_beta_slow, rope_attention_factor and rope_truncate: yarn"
                            .into(),
                    ),
                });
            }
        }
    }
    let get = |i: usize| values[i].map(|v| v.0).or(doc.params[i].default).unwrap_or(0.0);
    let n = |i: usize| get(i) as usize;
    let b = |i: usize| get(i) != 0.0;
    let op = match doc.name {
        "linear" => Op::Linear { in_features: n(0), out_features: n(1), bias: b(2) },
        "conv2d" => {
            Op::Conv2d { in_channels: n(0), out_channels: n(1), kernel: n(2), stride: n(3), padding: n(4), bias: b(5) }
        }
        "maxpool2d" => Op::MaxPool2d { kernel: n(0), stride: if n(1) == 0 { n(0) } else { n(1) }, padding: n(2) },
        "avgpool2d" => Op::AvgPool2d { kernel: n(0), stride: if n(1) == 0 { n(0) } else { n(1) }, padding: n(2) },
        "adaptive_avgpool2d" => Op::AdaptiveAvgPool2d { size: n(0) },
        "batchnorm2d" => {
            let channels = if n(0) == 0 { input.and_then(|s| s.first().copied()).unwrap_or(0) } else { n(0) };
            Op::BatchNorm2d { channels }
        }
        "flatten" => Op::Flatten,
        "relu" => Op::Relu,
        "gelu" => Op::Gelu,
        "gelu_tanh" => Op::GeluTanh,
        "tanh" => Op::Tanh,
        "sigmoid" => Op::Sigmoid,
        "layernorm" => {
            let dim = if n(0) == 0 { input.and_then(|s| s.last().copied()).unwrap_or(0) } else { n(0) };
            Op::LayerNorm { dim, eps: get(1) }
        }
        "rmsnorm" => {
            let dim = if n(0) == 0 { input.and_then(|s| s.last().copied()).unwrap_or(0) } else { n(0) };
            Op::RmsNorm { dim, eps: get(1) }
        }
        "dropout" => Op::Dropout { p: get(0) },
        "embedding" => Op::Embedding { vocab: n(0), dim: n(1), types: n(2), sep: (get(3) >= 0.0).then(|| n(3)) },
        "seq_pool" => Op::SeqPool { how: Pooling::ALL[n(0)] },
        "transformer_block" => Op::TransformerBlock {
            d_model: n(0),
            heads: n(1),
            d_ff: n(2),
            causal: b(3),
            kv_heads: n(4),
            norm: NormKind::ALL[n(5)],
            mlp: MlpKind::ALL[n(6)],
            rope: get(7),
            rope_scaling: rope_scaling(&get),
            bias: b(8),
            qkv_bias: if get(9) < 0.0 { b(8) } else { b(9) },
            eps: get(10),
            post_norm: b(11),
            moe: (n(12) > 0).then(|| Moe {
                experts: n(12),
                top_k: n(pipec_plan::model::MOE_TOP_K_ARG),
                shared: n(14),
                capacity: get(15),
                router: Router::ALL[n(16)],
                norm_topk: b(17),
                aux_loss: get(18),
                skew: get(pipec_plan::model::MOE_SKEW_ARG),
                scale: get(pipec_plan::model::ROUTE_SCALE_ARG),
                groups: n(pipec_plan::model::ROUTE_GROUPS_ARG),
                group_top: n(pipec_plan::model::ROUTE_GROUPS_ARG + 1),
                expert_bias: b(pipec_plan::model::EXPERT_BIAS_ARG),
            }),
            head_dim: n(pipec_plan::model::HEAD_DIM_ARG),
            qk_norm: b(21),
            window: n(pipec_plan::model::WINDOW_ARG),
            sinks: b(23),
            mla: (n(kv_lora) > 0).then(|| pipec_plan::model::Mla {
                kv_lora: n(kv_lora),
                q_lora: n(kv_lora + 1),
                rope_dim: n(pipec_plan::model::ROPE_DIM_ARG),
                // the value heads as large as the query and key heads' part without
                // rotary embeddings unless given
                v_head_dim: match n(kv_lora + 3) {
                    0 => {
                        let heads = n(1).max(1);
                        match n(pipec_plan::model::HEAD_DIM_ARG) {
                            0 => n(0) / heads,
                            h => h,
                        }
                    }
                    v => v,
                },
                mscale_all_dim: get(pipec_plan::model::MSCALE_ALL_DIM_ARG),
            }),
            dropout: get(kv_lora + 4),
        },
        "pos_embedding" => {
            let (seq, dim) = match input {
                Some([seq, dim]) => (*seq, *dim),
                _ => (0, 0),
            };
            Op::PosEmbedding { max_len: if n(0) == 0 { seq } else { n(0) }, dim }
        }
        "lstm" => Op::Lstm { input: n(0), hidden: n(1) },
        other => {
            return Err(vec![CallError {
                code: "E0302",
                message: format!("layer `{other}` has no lowering"),
                label: String::new(),
                span: call.name_span,
                help: None,
            }])
        }
    };
    Ok((op, warnings))
}

/// A block's `rope_scaling=` and the figures after it (`ROPE_SCALING_ARG` on).
fn rope_scaling(get: &dyn Fn(usize) -> f64) -> pipec_plan::rope::RopeScaling {
    use pipec_plan::rope::{yarn_mscale, RopeScaling};
    let at = |k: usize| get(pipec_plan::model::ROPE_SCALING_ARG + k);
    let (factor, original) = (at(1), at(2) as usize);
    match pipec_plan::rope::KINDS.get(at(0) as usize).copied() {
        Some("linear") => RopeScaling::Linear { factor },
        Some("dynamic") => RopeScaling::Dynamic { factor, max_positions: original },
        Some("yarn") => RopeScaling::Yarn {
            factor,
            original,
            beta_fast: at(5),
            beta_slow: at(6),
            attention_factor: if at(7) > 0.0 { at(7) } else { yarn_mscale(factor, 1.0) },
            truncate: at(8) != 0.0,
        },
        Some("llama3") => RopeScaling::Llama3 { factor, low_freq_factor: at(3), high_freq_factor: at(4), original },
        _ => RopeScaling::None,
    }
}

fn check_value(param: Param, v: &ArgValue) -> Result<f64, String> {
    let max = pipec_plan::model::MAX_DIM as i64;
    match (param.kind, v) {
        (ArgKind::Count | ArgKind::Size, ArgValue::Int(i)) if *i > max => {
            Err(format!("is {i}, more than pipec plans (at most {max})"))
        }
        (ArgKind::Count, ArgValue::Int(i)) if *i >= 1 => Ok(*i as f64),
        (ArgKind::Count, _) => Err("must be a positive integer".into()),
        (ArgKind::Size, ArgValue::Int(i)) if *i >= 0 => Ok(*i as f64),
        (ArgKind::Size, _) => Err("must be a non-negative integer".into()),
        (ArgKind::Prob, ArgValue::Float(f)) if (0.0..1.0).contains(f) => Ok(*f),
        (ArgKind::Prob, ArgValue::Int(0)) => Ok(0.0),
        (ArgKind::Prob, _) => Err("must be a probability in [0, 1)".into()),
        (ArgKind::Bool, ArgValue::Ident(s)) if s == "true" => Ok(1.0),
        (ArgKind::Bool, ArgValue::Ident(s)) if s == "false" => Ok(0.0),
        (ArgKind::Bool, _) => Err("must be `true` or `false`".into()),
        (ArgKind::NonNegative, ArgValue::Int(i)) if *i >= 0 => Ok(*i as f64),
        (ArgKind::NonNegative, ArgValue::Float(f)) if f.is_finite() && *f >= 0.0 => Ok(*f),
        (ArgKind::NonNegative, _) => Err("must be a non-negative number".into()),
        (ArgKind::Positive, ArgValue::Int(i)) if *i > 0 => Ok(*i as f64),
        (ArgKind::Positive, ArgValue::Float(f)) if f.is_finite() && *f > 0.0 => Ok(*f),
        (ArgKind::Positive, _) => Err("must be a positive number".into()),
        (ArgKind::Norm, ArgValue::Ident(s)) if NormKind::from_name(s).is_some() => {
            Ok(NormKind::ALL.iter().position(|k| k.name() == s).unwrap_or(0) as f64)
        }
        (ArgKind::Norm, _) => Err(format!("must be one of {}", names(NormKind::ALL))),
        (ArgKind::Mlp, ArgValue::Ident(s)) if MlpKind::from_name(s).is_some() => {
            Ok(MlpKind::ALL.iter().position(|k| k.name() == s).unwrap_or(0) as f64)
        }
        (ArgKind::Mlp, _) => Err(format!("must be one of {}", names(MlpKind::ALL))),
        (ArgKind::Pooling, ArgValue::Ident(s)) if Pooling::from_name(s).is_some() => {
            Ok(Pooling::ALL.iter().position(|k| k.name() == s).unwrap_or(0) as f64)
        }
        (ArgKind::Pooling, _) => Err(format!("must be one of {}", names(Pooling::ALL))),
        (ArgKind::Router, ArgValue::Ident(s)) if Router::from_name(s).is_some() => {
            Ok(Router::ALL.iter().position(|k| k.name() == s).unwrap_or(0) as f64)
        }
        (ArgKind::Router, _) => Err(format!("must be one of {}", names(Router::ALL))),
        (ArgKind::RopeScaling, ArgValue::Ident(s)) if pipec_plan::rope::KINDS.contains(&s.as_str()) => {
            Ok(pipec_plan::rope::KINDS.iter().position(|k| k == s).unwrap_or(0) as f64)
        }
        (ArgKind::RopeScaling, _) => Err(format!(
            "must be one of {}",
            pipec_plan::rope::KINDS.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// `a`, `b` or `c`: a choice's spellings for a message.
fn names<C: Choice>(all: &[C]) -> String {
    let v: Vec<String> = all.iter().map(|c| format!("`{}`", c.name())).collect();
    match v.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => v.join(""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dsl::parse_layer_item;

    fn op(text: &str) -> Result<Op, Vec<CallError>> {
        let item = parse_layer_item(text).expect("parses");
        resolve_call(&item.chain[0], Some(&[3, 32, 32]))
    }

    #[test]
    fn positional_keyword_and_alias_arguments() {
        assert_eq!(
            op("conv2d(3, 64, kernel=3, padding=1)"),
            Ok(Op::Conv2d { in_channels: 3, out_channels: 64, kernel: 3, stride: 1, padding: 1, bias: true })
        );
        assert_eq!(op("maxpool2d(2)"), Ok(Op::MaxPool2d { kernel: 2, stride: 2, padding: 0 }));
        assert_eq!(op("maxpool2d(3, stride=2, pad=1)"), Ok(Op::MaxPool2d { kernel: 3, stride: 2, padding: 1 }));
        assert_eq!(op("batchnorm2d"), Ok(Op::BatchNorm2d { channels: 3 }));
        assert_eq!(op("layernorm"), Ok(Op::layer_norm(32)));
    }

    #[test]
    fn argument_errors_are_all_reported() {
        let errs = op("linear(10, 0, bais=true, 4)").expect_err("bad");
        let msgs: Vec<&str> = errs.iter().map(|e| e.message.as_str()).collect();
        assert!(msgs.iter().any(|m| m.contains("`out`") && m.contains("positive")), "{msgs:?}");
        assert!(msgs.iter().any(|m| m.contains("`bais`")), "{msgs:?}");
        assert!(errs.iter().any(|e| e.help.as_deref().is_some_and(|h| h.contains("`bias`"))));
        let errs = op("dropout(1.5)").expect_err("bad");
        assert_eq!(errs[0].span, (8, 11));
        let errs = op("lineer(1, 2)").expect_err("bad");
        assert_eq!(errs[0].code, "E0302");
        assert_eq!(errs[0].help.as_deref(), Some("did you mean `linear`?"));
    }
}
