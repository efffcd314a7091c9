//! Hugging Face weights in pipec's parameter layout: a `model.safetensors` of a Llama-family
//! (Llama, Mistral, Qwen2) or GPT-2 causal language model read into the values of each
//! pipec parameter id (layer << 8 | slot) of the model's layers. pipec fuses what
//! `transformers` keeps apart — the query, key and value projections into one [d, q + 2·kv]
//! weight, a gated MLP's gate and up projections into one [d, 2·ff] — and stores every
//! dense weight as [in, out] where `nn.Linear` stores [out, in]; GPT-2's `Conv1D` weights are
//! already [in, out].

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::Dtype;

use crate::checkpoint::{param_id as pid, Identity, Loaded};
use crate::model::Op;
use crate::plan::Plan;

/// A named tensor: its shape and its values in f32.
pub type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// pipec's parameters by id (layer << 8 | slot): shape and values.
pub type Weights = BTreeMap<u64, (Vec<usize>, Vec<f32>)>;

/// Every tensor of a safetensors file, in f32 (f32, bf16 and f16 files).
pub fn read_safetensors(bytes: &[u8]) -> Result<Tensors, String> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors file: {e}"))?;
    let mut out = Tensors::new();
    for (name, view) in st.tensors() {
        // batch normalisation's counter (int64 in torchvision's state_dict): pipec's
        // momentum is fixed, so nothing reads it
        if name.ends_with(".num_batches_tracked") {
            continue;
        }
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => return Err(format!("`{name}` is {other:?}; pipec reads f32, bf16 and f16 weights")),
        };
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// The tensors of a Hugging Face checkpoint folder: `model.safetensors`, or the shards a
/// `model.safetensors.index.json` lists. The index's `weight_map` is authoritative, as in
/// `transformers`: each tensor is taken from the shard it names (a shard may hold copies of
/// others' tensors, which are not read), and a tensor it names that its shard lacks is an
/// error. Every value must be finite: a NaN or an infinity is refused by the tensor's name
/// and position (it would otherwise surface steps later as a diverged loss, or never, in a
/// row no batch reads).
pub fn read_dir(dir: &Path) -> Result<Tensors, String> {
    let read = |name: &str| -> Result<Tensors, String> {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
        read_safetensors(&bytes).map_err(|e| format!("`{}`: {e}", path.display()))
    };
    let index = dir.join("model.safetensors.index.json");
    let out = if !index.exists() {
        read("model.safetensors")?
    } else {
        let text = std::fs::read_to_string(&index).map_err(|e| format!("cannot read `{}`: {e}", index.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("`{}` is not JSON: {e}", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .ok_or_else(|| format!("`{}` has no `weight_map`", index.display()))?;
        // each shard with the tensors the index assigns to it
        let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, file) in map {
            let f = file
                .as_str()
                .ok_or_else(|| format!("`{}` maps `{name}` to {file}, not a file name", index.display()))?;
            if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                return Err(format!("`{}` names a shard outside its folder: `{f}`", index.display()));
            }
            shards.entry(f).or_default().push(name);
        }
        let mut out = Tensors::new();
        for (f, names) in shards {
            let mut held = read(f)?;
            for name in names {
                let t = held
                    .remove(name)
                    .ok_or_else(|| format!("`{}` puts `{name}` in `{f}`, which has no such tensor", index.display()))?;
                out.insert(name.to_string(), t);
            }
        }
        out
    };
    for (name, (shape, values)) in &out {
        if let Some(k) = values.iter().position(|v| !v.is_finite()) {
            let what = if values[k].is_nan() { "NaN" } else { "an infinity" };
            let row = match shape.as_slice() {
                [_, cols, ..] if *cols > 0 => format!(" (row {} of {shape:?})", k / (values.len() / shape[0]).max(1)),
                _ => String::new(),
            };
            return Err(format!(
                "`{name}` holds {what} at value {k}{row}: the checkpoint is damaged (or was saved after its training diverged)"
            ));
        }
    }
    Ok(out)
}

/// A checkpoint of only the weights of a Hugging Face checkpoint folder, for `plan`'s
/// model: what `pipec run --init` starts from (step 0, no optimizer state), through the
/// resume path, so every layout — pipeline stages, tensor-parallel ranks, replicas — takes
/// its part of each weight.
///
/// All or nothing: every tensor of the checkpoint must be one the model uses (a 4-layer
/// checkpoint does not load into a 2-layer spec, nor q/k/v biases into blocks without
/// them), unless `partial`, which loads what the model uses and lists the rest in the
/// returned [`Conversion::unused`].
pub fn initial_weights(plan: &Plan, dir: &Path, partial: bool) -> Result<(Loaded, Conversion), String> {
    let ops = plan.model_ops();
    let mut conversion = convert(&ops, &read_dir(dir)?)?;
    if !partial && !conversion.unused.is_empty() {
        return Err(format!(
            "the checkpoint holds {} tensor(s) the model does not use: {}. A checkpoint of a larger model, or a layer option that differs from the checkpoint's config.json (biases, experts, a tied output layer)? Write the spec from its config.json (`pipec import`), or pass --init-partial to load the tensors the model uses and skip these",
            conversion.unused.len(),
            list_names(&conversion.unused, 6)
        ));
    }
    let values = std::mem::take(&mut conversion.weights);
    let mut identity = Identity::of(plan);
    // saved as one whole stage: every weight whole, on rank 0
    identity.stage_layers = vec![[0, ops.len()]];
    identity.stage_devices = Vec::new();
    identity.stateful = false;
    identity.plan = format!("the Hugging Face checkpoint `{}`", dir.display());
    let loaded = Loaded {
        completed_steps: 0,
        params: values.into_iter().map(|(id, v)| ((id, 0), v)).collect(),
        optimizers: Default::default(),
        tensor_parallel: Default::default(),
        identity: Some(identity),
        loss_scale: None,
        initial: conversion.initial.iter().cloned().collect(),
        zero: Default::default(),
    };
    Ok((loaded, conversion))
}

/// Up to `n` of `names`, quoted, and how many more.
pub fn list_names(names: &[String], n: usize) -> String {
    let mut text = names.iter().take(n).map(|s| format!("`{s}`")).collect::<Vec<_>>().join(", ");
    if names.len() > n {
        text.push_str(&format!(" and {} more", names.len() - n));
    }
    text
}

/// What a checkpoint's tensors became: pipec's parameters, the parameters left to pipec's
/// initial values (a fine-tuning head the checkpoint lacks, with the tensor each lacked),
/// and the checkpoint's tensors the model does not use, in name order.
#[derive(Debug, Clone, Default)]
pub struct Conversion {
    pub weights: Weights,
    pub initial: Vec<(u64, String)>,
    pub unused: Vec<String>,
    /// Tensors no model of pipec's reads, by name, with what they are (buffers and
    /// pre-training heads that checkpoints carry; `transformers` skips them too).
    pub ignored: Vec<(String, &'static str)>,
    /// How many of the checkpoint's tensors (and their values) were used.
    pub tensors_used: usize,
    pub values_used: usize,
}

/// What a tensor is when it is one that checkpoints carry and no model of pipec's reads.
fn never_used(name: &str) -> Option<&'static str> {
    if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") {
        Some("GPT-2's causal-mask buffers")
    } else if name.ends_with("rotary_emb.inv_freq") {
        Some("rotary embeddings' frequencies (computed, not learned)")
    } else if name.starts_with("cls.") {
        Some("BERT's pre-training heads (a fine-tuning model replaces them)")
    } else {
        None
    }
}

/// A checkpoint's tensors and the names a conversion read, so a tensor the model does not
/// use is known.
struct Source<'a> {
    tensors: &'a Tensors,
    read: std::cell::RefCell<std::collections::BTreeSet<String>>,
}

/// The values of every parameter of `layers` (a causal language model: an embedding, its
/// transformer blocks, a final norm and an output layer, in that order) from a Hugging Face
/// checkpoint's `tensors`, by pipec parameter id. A missing tensor or a shape that differs
/// is an error naming the tensor and both shapes, and so is a tensor the model does not use;
/// an output layer with no tensor of its own (tied embeddings) takes the embedding's table.
pub fn to_pipec(layers: &[Op], tensors: &Tensors) -> Result<Weights, String> {
    let c = convert(layers, tensors)?;
    if let Some((_, name)) = c.initial.first() {
        return Err(format!("the checkpoint has no tensor `{name}`"));
    }
    if !c.unused.is_empty() {
        return Err(format!("the model does not use {}", list_names(&c.unused, 6)));
    }
    Ok(c.weights)
}

/// [`to_pipec`], but a sequence classifier's head that the checkpoint lacks (a base or
/// pre-training checkpoint: no `classifier.*`) is left to pipec's initial values, and the
/// tensors the model does not use are listed rather than refused.
pub fn convert(layers: &[Op], tensors: &Tensors) -> Result<Conversion, String> {
    let src = Source { tensors, read: Default::default() };
    let (weights, initial) = convert_from(layers, &src)?;
    let read = src.read.into_inner();
    let (mut unused, mut ignored) = (Vec::new(), Vec::new());
    for name in tensors.keys().filter(|n| !read.contains(*n)) {
        match never_used(name) {
            Some(why) => ignored.push((name.clone(), why)),
            None => unused.push(name.clone()),
        }
    }
    let used: Vec<&(Vec<usize>, Vec<f32>)> = read.iter().filter_map(|n| tensors.get(n)).collect();
    Ok(Conversion {
        weights,
        initial,
        unused,
        ignored,
        tensors_used: used.len(),
        values_used: used.iter().map(|(_, v)| v.len()).sum(),
    })
}

fn convert_from(layers: &[Op], src: &Source<'_>) -> Result<(Weights, Vec<(u64, String)>), String> {
    let tensors = src.tensors;
    if let Some(prefix) =
        ["bert.", ""].into_iter().find(|p| tensors.contains_key(&format!("{p}embeddings.word_embeddings.weight")))
    {
        return bert_to_pipec(layers, src, prefix);
    }
    if tensors.contains_key("fc.weight") && tensors.contains_key("bn1.running_mean") {
        return torchvision_to_pipec(layers, src);
    }
    let gpt2 = tensors.contains_key("wte.weight") || tensors.contains_key("transformer.wte.weight");
    let prefix = if tensors.contains_key("transformer.wte.weight") { "transformer." } else { "" };
    let get = |name: &str, shape: &[usize]| lookup(src, name, shape);
    let same = |name: &str, shape: &[usize]| get(name, shape).map(|v| (shape.to_vec(), v.clone()));
    // an [out, in] weight as pipec's [in, out]
    let transposed = |values: &[f32], rows: usize, cols: usize| (vec![cols, rows], transpose(values, rows, cols));
    let mut out = BTreeMap::new();
    let mut block = 0usize;
    let mut embedding: Option<(usize, usize, Vec<f32>)> = None;
    let blocks = layers.iter().filter(|op| matches!(op, Op::TransformerBlock { .. })).count();
    for (i, op) in layers.iter().enumerate() {
        match op {
            Op::Embedding { vocab, dim, .. } => {
                let name = if gpt2 { format!("{prefix}wte.weight") } else { "model.embed_tokens.weight".into() };
                let v = get(&name, &[*vocab, *dim])?.clone();
                embedding = Some((*vocab, *dim, v.clone()));
                out.insert(pid(i, 0), (vec![*vocab, *dim], v));
            }
            Op::PosEmbedding { max_len, dim } if gpt2 => {
                out.insert(pid(i, 0), same(&format!("{prefix}wpe.weight"), &[*max_len, *dim])?);
            }
            // GPT-2's embedding dropout (`embd_pdrop`): no weights
            Op::Dropout { .. } if gpt2 && i > 0 && matches!(layers[i - 1], Op::PosEmbedding { .. }) => {}
            Op::TransformerBlock { .. } => {
                let b = op.block_dims().ok_or("not a block")?;
                let (d, f) = (b.d, b.ff);
                if gpt2 {
                    let h = format!("{prefix}h.{block}.");
                    out.insert(pid(i, 0), same(&format!("{h}ln_1.weight"), &[d])?);
                    out.insert(pid(i, 1), same(&format!("{h}ln_1.bias"), &[d])?);
                    out.insert(pid(i, 2), same(&format!("{h}attn.c_attn.weight"), &[d, 3 * d])?);
                    out.insert(pid(i, 3), same(&format!("{h}attn.c_attn.bias"), &[3 * d])?);
                    out.insert(pid(i, 4), same(&format!("{h}attn.c_proj.weight"), &[d, d])?);
                    out.insert(pid(i, 5), same(&format!("{h}attn.c_proj.bias"), &[d])?);
                    out.insert(pid(i, 6), same(&format!("{h}ln_2.weight"), &[d])?);
                    out.insert(pid(i, 7), same(&format!("{h}ln_2.bias"), &[d])?);
                    out.insert(pid(i, 8), same(&format!("{h}mlp.c_fc.weight"), &[d, f])?);
                    out.insert(pid(i, 9), same(&format!("{h}mlp.c_fc.bias"), &[f])?);
                    out.insert(pid(i, 10), same(&format!("{h}mlp.c_proj.weight"), &[f, d])?);
                    out.insert(pid(i, 11), same(&format!("{h}mlp.c_proj.bias"), &[d])?);
                } else {
                    let h = format!("model.layers.{block}.");
                    // the queries' and the attention output's widths: heads · head_dim (d
                    // unless the config gives its own `head_dim`)
                    let (kv, qw, aw) = (b.kv_width, b.q_width, b.attention_width);
                    out.insert(pid(i, 0), same(&format!("{h}input_layernorm.weight"), &[d])?);
                    if let Some(m) = b.mla {
                        for (slot, value) in
                            latent_to_pipec(&b, m, &|name, shape| get(&format!("{h}self_attn.{name}"), shape))?
                        {
                            out.insert(pid(i, slot), value);
                        }
                    } else {
                        // [out, in] projections side by side along `out`, then [in, out]
                        let q = get(&format!("{h}self_attn.q_proj.weight"), &[qw, d])?;
                        let k = get(&format!("{h}self_attn.k_proj.weight"), &[kv, d])?;
                        let v = get(&format!("{h}self_attn.v_proj.weight"), &[kv, d])?;
                        out.insert(pid(i, 2), transposed(&[q.as_slice(), k, v].concat(), qw + 2 * kv, d));
                    }
                    if b.qkv_bias && b.mla.is_none() {
                        let q = get(&format!("{h}self_attn.q_proj.bias"), &[qw])?;
                        let k = get(&format!("{h}self_attn.k_proj.bias"), &[kv])?;
                        let v = get(&format!("{h}self_attn.v_proj.bias"), &[kv])?;
                        out.insert(pid(i, 3), (vec![qw + 2 * kv], [q.as_slice(), k, v].concat()));
                    }
                    out.insert(pid(i, 4), transposed(get(&format!("{h}self_attn.o_proj.weight"), &[d, aw])?, d, aw));
                    // Qwen3's query and key norms over each head's features
                    if b.qk_norm {
                        for (slot, name) in
                            [(crate::model::Q_NORM_SLOT, "q_norm"), (crate::model::K_NORM_SLOT, "k_norm")]
                        {
                            out.insert(pid(i, slot), same(&format!("{h}self_attn.{name}.weight"), &[b.qk_head])?);
                        }
                    }
                    out.insert(pid(i, 6), same(&format!("{h}post_attention_layernorm.weight"), &[d])?);
                    if !b.gated {
                        return Err("a Llama-family checkpoint's MLP is gated: the block needs mlp=swiglu".into());
                    }
                    match b.moe {
                        None => {
                            let gate = get(&format!("{h}mlp.gate_proj.weight"), &[f, d])?;
                            let up = get(&format!("{h}mlp.up_proj.weight"), &[f, d])?;
                            out.insert(pid(i, 8), transposed(&[gate.as_slice(), up].concat(), 2 * f, d));
                            out.insert(
                                pid(i, 10),
                                transposed(get(&format!("{h}mlp.down_proj.weight"), &[d, f])?, d, f),
                            );
                        }
                        // DeepSeek-V3 and Qwen3-MoE: the router `mlp.gate` (DeepSeek's with its
                        // correction bias), per expert gate_proj, up_proj, down_proj, and
                        // DeepSeek's shared experts as one MLP `shared · ff` wide
                        Some(m) if !tensors.contains_key(&format!("{h}block_sparse_moe.gate.weight")) => {
                            let moe = format!("{h}mlp.");
                            let router = get(&format!("{moe}gate.weight"), &[m.experts, d])?;
                            out.insert(pid(i, crate::checkpoint::ROUTER_SLOT), transposed(router, m.experts, d));
                            // the fixed expert bias (`expert_bias=true`); without it, a bias
                            // of zeros (transformers' initial one) is read as none
                            let bias = format!("{moe}gate.e_score_correction_bias");
                            if m.expert_bias {
                                let values = get(&bias, &[m.experts])?;
                                out.insert(pid(i, crate::model::EXPERT_BIAS_SLOT), (vec![m.experts], values.to_vec()));
                            } else if tensors.contains_key(&bias) {
                                let values = get(&bias, &[m.experts])?;
                                if values.iter().any(|v| *v != 0.0) {
                                    return Err(format!(
                                        "`{bias}` is not zero: the block routes with an expert bias; write `expert_bias=true` on it (`pipec import` does from config.json's `topk_method: noaux_tc`)"
                                    ));
                                }
                            }
                            let mlp = |x: &str, rows: std::ops::Range<usize>, width: usize| -> Result<_, String> {
                                let gate = get(&format!("{x}gate_proj.weight"), &[width, d])?;
                                let up = get(&format!("{x}up_proj.weight"), &[width, d])?;
                                let down = get(&format!("{x}down_proj.weight"), &[d, width])?;
                                let n = rows.len();
                                let (gate, up) =
                                    (&gate[rows.start * d..rows.end * d], &up[rows.start * d..rows.end * d]);
                                let down: Vec<f32> = (0..d)
                                    .flat_map(|r| down[r * width + rows.start..r * width + rows.end].to_vec())
                                    .collect();
                                Ok((transposed(&[gate, up].concat(), 2 * n, d), transposed(&down, d, n)))
                            };
                            for e in 0..m.experts {
                                let (up, down) = mlp(&format!("{moe}experts.{e}."), 0..f, f)?;
                                let slot = crate::checkpoint::expert_slot(e);
                                out.insert(pid(i, slot), up);
                                out.insert(pid(i, slot + 2), down);
                            }
                            for s in 0..m.shared {
                                let (up, down) =
                                    mlp(&format!("{moe}shared_experts."), s * f..(s + 1) * f, m.shared * f)?;
                                let slot = crate::checkpoint::expert_slot(m.experts + s);
                                out.insert(pid(i, slot), up);
                                out.insert(pid(i, slot + 2), down);
                            }
                        }
                        // Mixtral: the router `gate`, and per expert w1 (gate), w3 (up), w2 (down)
                        Some(m) => {
                            let moe = format!("{h}block_sparse_moe.");
                            let router = get(&format!("{moe}gate.weight"), &[m.experts, d])?;
                            out.insert(pid(i, crate::checkpoint::ROUTER_SLOT), transposed(router, m.experts, d));
                            for e in 0..m.experts {
                                let x = format!("{moe}experts.{e}.");
                                let gate = get(&format!("{x}w1.weight"), &[f, d])?;
                                let up = get(&format!("{x}w3.weight"), &[f, d])?;
                                let slot = crate::checkpoint::expert_slot(e);
                                out.insert(pid(i, slot), transposed(&[gate.as_slice(), up].concat(), 2 * f, d));
                                out.insert(pid(i, slot + 2), transposed(get(&format!("{x}w2.weight"), &[d, f])?, d, f));
                            }
                        }
                    }
                }
                block += 1;
            }
            Op::LayerNorm { dim, .. } if gpt2 && block == blocks => {
                out.insert(pid(i, 0), same(&format!("{prefix}ln_f.weight"), &[*dim])?);
                out.insert(pid(i, 1), same(&format!("{prefix}ln_f.bias"), &[*dim])?);
            }
            Op::RmsNorm { dim, .. } if !gpt2 && block == blocks => {
                out.insert(pid(i, 0), same("model.norm.weight", &[*dim])?);
            }
            Op::Linear { in_features, out_features, bias: false } if i + 1 == layers.len() => {
                let w = match tensors.get("lm_head.weight") {
                    Some(_) => get("lm_head.weight", &[*out_features, *in_features])?.clone(),
                    None => match &embedding {
                        Some((vocab, dim, table)) if vocab == out_features && dim == in_features => table.clone(),
                        _ => return Err("the checkpoint has no `lm_head.weight` and no embedding to tie it to".into()),
                    },
                };
                out.insert(pid(i, 0), transposed(&w, *out_features, *in_features));
            }
            other => {
                return Err(format!(
                    "layer {i} (`{}`) has no counterpart in a Hugging Face {} checkpoint",
                    other.name(),
                    if gpt2 { "GPT-2" } else { "Llama-family" }
                ))
            }
        }
    }
    Ok((out, Vec::new()))
}

/// DeepSeek's rotary parts as its checkpoints store them (`rope_interleave`: the two
/// features of each rotated pair side by side) read in the order pipec turns them (the first
/// of every pair, then the second: Llama's `rotate_half`): row j of `n` comes from row
/// 2j for j < n/2, from row 2(j − n/2) + 1 after.
fn deinterleaved(j: usize, n: usize) -> usize {
    if j < n / 2 {
        2 * j
    } else {
        2 * (j - n / 2) + 1
    }
}

/// Rows `rows` (of `width` values each) of an [out, in] weight, each rotary part of
/// `rope` rows in it — at `first` and every `stride` rows after, `count` of them —
/// reordered from DeepSeek's interleaved pairs to pipec's halves (`to_pipec`) or back.
fn reorder_rotary(
    values: &[f32],
    width: usize,
    (first, stride, count, rope): (usize, usize, usize, usize),
    to_pipec: bool,
) -> Vec<f32> {
    let mut out = values.to_vec();
    for part in 0..count {
        let start = first + part * stride;
        for j in 0..rope {
            let (to, from) = if to_pipec { (j, deinterleaved(j, rope)) } else { (deinterleaved(j, rope), j) };
            out[(start + to) * width..(start + to + 1) * width]
                .copy_from_slice(&values[(start + from) * width..(start + from + 1) * width]);
        }
    }
    out
}

/// A DeepSeek block's multi-head latent attention tensors (`get(name, [out, in])` under its
/// `self_attn.`) as pipec's parameters by slot ([`crate::model::LATENT_DOWN_SLOT`] and the
/// others): `q_a_proj` (or `q_proj` without a query latent) and `kv_a_proj_with_mqa` side by
/// side, the two latent norms side by side, `q_b_proj`, `kv_b_proj`, `o_proj`; the rotary
/// parts de-interleaved.
fn latent_to_pipec<'a>(b: &crate::model::BlockDims, m: crate::model::Mla, get: &ByName<'a>) -> Result<Weights, String> {
    use crate::model::{LATENT_DOWN_SLOT, LATENT_KV_UP_SLOT, LATENT_NORMS_SLOT, LATENT_QUERY_SLOT};
    let (d, heads, qk) = (b.d, b.heads, b.qk_head);
    let w = b.latent().ok_or("not a latent block")?;
    let kv_a = reorder_rotary(
        get("kv_a_proj_with_mqa.weight", &[m.kv_lora + m.rope_dim, d])?,
        d,
        (m.kv_lora, 0, 1, m.rope_dim),
        true,
    );
    // each query head's rotary part: its last rope_dim rows of qk
    let query_rope = (qk - m.rope_dim, qk, heads, m.rope_dim);
    let ([q_in, q_width], [kv_in, kv_up], down_out) = (w.query, w.kv_up, w.down[1]);
    let (down_q, q_norm, query) = if m.q_lora > 0 {
        (
            get("q_a_proj.weight", &[m.q_lora, d])?.clone(),
            get("q_a_layernorm.weight", &[m.q_lora])?.clone(),
            reorder_rotary(get("q_b_proj.weight", &[q_width, q_in])?, q_in, query_rope, true),
        )
    } else {
        (Vec::new(), Vec::new(), reorder_rotary(get("q_proj.weight", &[q_width, q_in])?, q_in, query_rope, true))
    };
    let kv_norm = get("kv_a_layernorm.weight", &[m.kv_lora])?;
    Ok(Weights::from([
        (LATENT_DOWN_SLOT, (w.down.to_vec(), transpose(&[down_q, kv_a].concat(), down_out, d))),
        (LATENT_NORMS_SLOT, (vec![w.norms], [q_norm.as_slice(), kv_norm].concat())),
        (LATENT_QUERY_SLOT, (w.query.to_vec(), transpose(&query, q_width, q_in))),
        (LATENT_KV_UP_SLOT, (w.kv_up.to_vec(), transpose(get("kv_b_proj.weight", &[kv_up, kv_in])?, kv_up, kv_in))),
    ]))
}

/// A tensor's values by name and shape, or why not.
type ByName<'a> = dyn Fn(&str, &[usize]) -> Result<&'a Vec<f32>, String> + 'a;

/// A parameter's values by slot and shape, or why not.
type BySlot<'a> = dyn Fn(u64, &[usize]) -> Result<&'a Vec<f32>, String> + 'a;

/// [`latent_to_pipec`]'s inverse: a block's latent attention parameters (`weight(slot,
/// shape)`) as DeepSeek's tensors under `self_attn.` — by name, [out, in] and values, the
/// rotary parts interleaved again (`rope_interleave: true`, as its checkpoints are).
fn latent_from_pipec<'a>(
    b: &crate::model::BlockDims,
    m: crate::model::Mla,
    weight: &BySlot<'a>,
) -> Result<Tensors, String> {
    use crate::model::{LATENT_DOWN_SLOT, LATENT_KV_UP_SLOT, LATENT_NORMS_SLOT, LATENT_QUERY_SLOT};
    let (d, heads, qk) = (b.d, b.heads, b.qk_head);
    let w = b.latent().ok_or("not a latent block")?;
    let ([q_in, q_width], [kv_in, kv_up]) = (w.query, w.kv_up);
    let down = transpose(weight(LATENT_DOWN_SLOT, &w.down)?, w.down[0], w.down[1]);
    let norms = weight(LATENT_NORMS_SLOT, &[w.norms])?;
    let query = reorder_rotary(
        &transpose(weight(LATENT_QUERY_SLOT, &w.query)?, q_in, q_width),
        q_in,
        (qk - m.rope_dim, qk, heads, m.rope_dim),
        false,
    );
    let kv_a = reorder_rotary(&down[m.q_lora * d..], d, (m.kv_lora, 0, 1, m.rope_dim), false);
    let mut out = Tensors::new();
    let mut put = |name: &str, shape: Vec<usize>, values: Vec<f32>| {
        out.insert(name.to_string(), (shape, values));
    };
    if m.q_lora > 0 {
        put("q_a_proj.weight", vec![m.q_lora, d], down[..m.q_lora * d].to_vec());
        put("q_a_layernorm.weight", vec![m.q_lora], norms[..m.q_lora].to_vec());
        put("q_b_proj.weight", vec![q_width, q_in], query);
    } else {
        put("q_proj.weight", vec![q_width, q_in], query);
    }
    put("kv_a_proj_with_mqa.weight", vec![m.kv_lora + m.rope_dim, d], kv_a);
    put("kv_a_layernorm.weight", vec![m.kv_lora], norms[m.q_lora..].to_vec());
    put("kv_b_proj.weight", vec![kv_up, kv_in], transpose(weight(LATENT_KV_UP_SLOT, &w.kv_up)?, kv_in, kv_up));
    Ok(out)
}

/// Where a torchvision ResNet module comes in `state_dict` order: the stem (`conv1`, `bn1`),
/// then `layer1`..`layer4`, block by block (`conv1`, `bn1`, `conv2`, `bn2`, `conv3`, `bn3`,
/// then the shortcut's `downsample.0` and `downsample.1`), then `fc`: (stage, block,
/// position), where an even position in a stage is a convolution, an odd one its batch norm,
/// and stage 9 is `fc`. None for any other name.
fn torchvision_rank(module: &str) -> Option<(usize, usize, usize)> {
    let within = |part: &str| match part {
        "conv1" => Some(0),
        "bn1" => Some(1),
        "conv2" => Some(2),
        "bn2" => Some(3),
        "conv3" => Some(4),
        "bn3" => Some(5),
        "downsample.0" => Some(6),
        "downsample.1" => Some(7),
        _ => None,
    };
    match module {
        "fc" => Some((9, 0, 0)),
        m if !m.starts_with("layer") => within(m).filter(|&w| w < 2).map(|w| (0, 0, w)),
        m => {
            let rest = m.strip_prefix("layer")?;
            let (stage, rest) = rest.split_once('.')?;
            let (block, part) = rest.split_once('.')?;
            Some((stage.parse().ok()?, block.parse().ok()?, within(part)?))
        }
    }
}

/// A torchvision ResNet checkpoint's weights (`torchvision.models.resnet*`'s `state_dict`
/// names) for a pipec model that writes the same network in the same order: its
/// convolutions, batch norms and final `linear` matched one to one with the checkpoint's in
/// `state_dict` order (a block's shortcut after its second or third convolution), shapes
/// checked; batch normalisation's running statistics included.
fn torchvision_to_pipec(layers: &[Op], src: &Source<'_>) -> Result<(Weights, Vec<(u64, String)>), String> {
    let tensors = src.tensors;
    let mut modules: Vec<(usize, usize, usize, String)> = Vec::new();
    for name in tensors.keys() {
        let Some(module) = name.strip_suffix(".weight") else { continue };
        let (a, b, c) = torchvision_rank(module)
            .ok_or_else(|| format!("`{name}` is not a torchvision ResNet weight (conv1, bn1, layerN.M.…, fc)"))?;
        modules.push((a, b, c, module.to_string()));
    }
    modules.sort();
    let with_weights: Vec<(usize, &Op)> =
        layers.iter().enumerate().filter(|(_, op)| op.parameter_count() > 0).collect();
    if with_weights.len() != modules.len() {
        return Err(format!(
            "the model has {} layers with weights, the torchvision checkpoint {} modules (conv1, bn1, layerN.M.conv/bn/downsample, fc)",
            with_weights.len(),
            modules.len()
        ));
    }
    let get = |name: &str, shape: &[usize]| lookup(src, name, shape);
    let same = |name: &str, shape: &[usize]| get(name, shape).map(|v| (shape.to_vec(), v.clone()));
    let mut out = Weights::new();
    for ((i, op), (stage, _, position, m)) in with_weights.into_iter().zip(&modules) {
        let (fc, norm) = (*stage == 9, position % 2 == 1);
        match *op {
            Op::Conv2d { in_channels, out_channels, kernel, bias, .. } if !fc && !norm => {
                out.insert(pid(i, 0), same(&format!("{m}.weight"), &[out_channels, in_channels, kernel, kernel])?);
                if bias {
                    out.insert(pid(i, 1), same(&format!("{m}.bias"), &[out_channels])?);
                }
            }
            Op::BatchNorm2d { channels } if !fc && norm => {
                for (slot, part) in [(0, "weight"), (1, "bias"), (2, "running_mean"), (3, "running_var")] {
                    out.insert(pid(i, slot), same(&format!("{m}.{part}"), &[channels])?);
                }
            }
            Op::Linear { in_features, out_features, bias } if fc => {
                let w = get("fc.weight", &[out_features, in_features])?;
                out.insert(pid(i, 0), (vec![in_features, out_features], transpose(w, out_features, in_features)));
                if bias {
                    out.insert(pid(i, 1), same("fc.bias", &[out_features])?);
                }
            }
            _ => {
                return Err(format!(
                    "layer {i} (`{}`) meets the torchvision module `{m}`: the model's layers with weights must come in torchvision's order",
                    op.name()
                ))
            }
        }
    }
    Ok((out, Vec::new()))
}

/// A tensor of the checkpoint by name (marked as read), its shape checked: the error names the tensor and both
/// shapes.
fn lookup<'a>(src: &Source<'a>, name: &str, shape: &[usize]) -> Result<&'a Vec<f32>, String> {
    src.read.borrow_mut().insert(name.to_string());
    match src.tensors.get(name) {
        None => Err(format!("the checkpoint has no tensor `{name}` (expected shape {shape:?})")),
        Some((s, _)) if s != shape => {
            Err(format!("`{name}` has shape {s:?} in the checkpoint, the model's layer needs {shape:?}"))
        }
        Some((_, v)) => Ok(v),
    }
}

/// A BERT encoder's weights (`BertModel`, `BertForSequenceClassification` or a pre-training
/// checkpoint's `bert.*`): the embedding with its token types, positions and layer norm,
/// post-norm blocks, then the pooler and the classifier (the first and second `linear`
/// after the blocks); a classifier the checkpoint lacks is left to pipec's initial values.
/// Layer norms read `weight`/`bias` or the older `gamma`/`beta`.
fn bert_to_pipec(layers: &[Op], src: &Source<'_>, prefix: &str) -> Result<(Weights, Vec<(u64, String)>), String> {
    let tensors = src.tensors;
    let get = |name: &str, shape: &[usize]| lookup(src, name, shape);
    let same = |name: &str, shape: &[usize]| get(name, shape).map(|v| (shape.to_vec(), v.clone()));
    let transposed = |values: &[f32], rows: usize, cols: usize| (vec![cols, rows], transpose(values, rows, cols));
    let norm = |out: &mut Weights, i: usize, first: u64, name: &str, d: usize| -> Result<(), String> {
        let old = !tensors.contains_key(&format!("{name}.weight")) && tensors.contains_key(&format!("{name}.gamma"));
        let (w, b) = if old { ("gamma", "beta") } else { ("weight", "bias") };
        out.insert(pid(i, first), same(&format!("{name}.{w}"), &[d])?);
        out.insert(pid(i, first + 1), same(&format!("{name}.{b}"), &[d])?);
        Ok(())
    };
    let e = format!("{prefix}embeddings.");
    let mut out = Weights::new();
    let mut initial = Vec::new();
    let (mut block, mut linears) = (0usize, 0usize);
    for (i, op) in layers.iter().enumerate() {
        match op {
            Op::Embedding { vocab, dim, types, .. } => {
                out.insert(pid(i, 0), same(&format!("{e}word_embeddings.weight"), &[*vocab, *dim])?);
                let name = format!("{e}token_type_embeddings.weight");
                match (types, tensors.get(&name)) {
                    (0, Some((shape, _))) => {
                        return Err(format!(
                            "the checkpoint has token-type embeddings `{name}` {shape:?}: the embedding needs `types={}` (and `sep=` the [SEP] token's id)",
                            shape.first().copied().unwrap_or(2)
                        ))
                    }
                    (0, None) => {}
                    (t, _) => {
                        out.insert(pid(i, 1), same(&name, &[*t, *dim])?);
                    }
                }
            }
            Op::PosEmbedding { max_len, dim } => {
                out.insert(pid(i, 0), same(&format!("{e}position_embeddings.weight"), &[*max_len, *dim])?);
            }
            Op::LayerNorm { dim, .. } if block == 0 => norm(&mut out, i, 0, &format!("{e}LayerNorm"), *dim)?,
            Op::TransformerBlock { .. } => {
                let b = op.block_dims().ok_or("not a block")?;
                if !b.post_norm || b.norm != crate::model::NormKind::LayerNorm || !b.bias || b.kv_heads != b.heads {
                    return Err(format!(
                        "layer {i}: a BERT block is `transformer_block(d, heads, ff, post_norm=true, eps=1e-12)` (layer norms after the residual sums, biases, as many key/value heads as heads)"
                    ));
                }
                let (d, f) = (b.d, b.ff);
                let h = format!("{prefix}encoder.layer.{block}.");
                let q = get(&format!("{h}attention.self.query.weight"), &[d, d])?;
                let k = get(&format!("{h}attention.self.key.weight"), &[d, d])?;
                let v = get(&format!("{h}attention.self.value.weight"), &[d, d])?;
                out.insert(pid(i, 2), transposed(&[q.as_slice(), k, v].concat(), 3 * d, d));
                let q = get(&format!("{h}attention.self.query.bias"), &[d])?;
                let k = get(&format!("{h}attention.self.key.bias"), &[d])?;
                let v = get(&format!("{h}attention.self.value.bias"), &[d])?;
                out.insert(pid(i, 3), (vec![3 * d], [q.as_slice(), k, v].concat()));
                out.insert(pid(i, 4), transposed(get(&format!("{h}attention.output.dense.weight"), &[d, d])?, d, d));
                out.insert(pid(i, 5), same(&format!("{h}attention.output.dense.bias"), &[d])?);
                norm(&mut out, i, 0, &format!("{h}attention.output.LayerNorm"), d)?;
                out.insert(pid(i, 8), transposed(get(&format!("{h}intermediate.dense.weight"), &[f, d])?, f, d));
                out.insert(pid(i, 9), same(&format!("{h}intermediate.dense.bias"), &[f])?);
                out.insert(pid(i, 10), transposed(get(&format!("{h}output.dense.weight"), &[d, f])?, d, f));
                out.insert(pid(i, 11), same(&format!("{h}output.dense.bias"), &[d])?);
                norm(&mut out, i, 6, &format!("{h}output.LayerNorm"), d)?;
                block += 1;
            }
            Op::Linear { in_features, out_features, bias: true } if block > 0 && linears < 2 => {
                let (name, head) = if linears == 0 {
                    (format!("{prefix}pooler.dense"), false)
                } else {
                    ("classifier".to_string(), true)
                };
                linears += 1;
                let (w, b) = (format!("{name}.weight"), format!("{name}.bias"));
                if head && !tensors.contains_key(&w) && !tensors.contains_key(&b) {
                    initial.push((pid(i, 0), w));
                    initial.push((pid(i, 1), b));
                    continue;
                }
                out.insert(
                    pid(i, 0),
                    transposed(get(&w, &[*out_features, *in_features])?, *out_features, *in_features),
                );
                out.insert(pid(i, 1), same(&b, &[*out_features])?);
            }
            Op::Dropout { .. } | Op::SeqPool { .. } | Op::Tanh => {}
            other => {
                return Err(format!(
                    "layer {i} (`{}`) has no counterpart in a Hugging Face BERT checkpoint",
                    other.name()
                ))
            }
        }
    }
    Ok((out, initial))
}

/// Parameter `id` of a checkpoint's `weights`, its shape checked: the error names the
/// parameter and both shapes.
fn saved<'a>(weights: &'a Weights, id: u64, shape: &[usize]) -> Result<&'a Vec<f32>, String> {
    match weights.get(&id) {
        Some((s, v)) if s == shape => Ok(v),
        Some((s, _)) => {
            Err(format!("`{}` has shape {s:?}, the layer needs {shape:?}", crate::checkpoint::param_name(id)))
        }
        None => Err(format!("the checkpoint has no `{}`", crate::checkpoint::param_name(id))),
    }
}

/// The family a model exports as: its `config.json` and its tensors' names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Gpt2,
    Llama,
}

/// A causal language model of `layers` as a Hugging Face checkpoint: its `config.json`
/// and its tensors under `transformers`' names (the inverse of [`to_pipec`]); `tied` says
/// whether the output layer is tied to the embedding, `context` the model's window (a
/// Llama config's `max_position_embeddings`). A model that is not one of the two families'
/// shapes is an error naming the layer that is not.
pub fn from_pipec(
    layers: &[Op],
    tied: bool,
    context: usize,
    weights: &Weights,
) -> Result<(serde_json::Value, Tensors), String> {
    use serde_json::json;
    let blocks: Vec<crate::model::BlockDims> = layers.iter().filter_map(Op::block_dims).collect();
    let b =
        *blocks.last().ok_or("the model has no transformer block: only GPT-2, Llama-family and BERT models export")?;
    // DeepSeek-V3's dense first blocks (`first_k_dense_replace`): otherwise its blocks of experts
    let dense =
        if b.mla.is_some() && b.moe.is_some() { blocks.iter().take_while(|d| d.moe.is_none()).count() } else { 0 };
    let dense_ff = blocks.first().map_or(b.ff, |d| d.ff);
    let as_dense = b.with_dense_mlp(dense_ff);
    if blocks[..dense].iter().any(|d| *d != as_dense) || blocks[dense..].iter().any(|d| *d != b) {
        return Err("the model's blocks differ: a Hugging Face config describes one block repeated (DeepSeek-V3: dense blocks first, then one block of experts repeated)".into());
    }
    if let Some(m) = b.moe {
        // Mixtral's routing: a softmax over every expert, the top k renormalised, no
        // shared expert, no token dropped; DeepSeek-V3's (with latent attention): sigmoid
        // scores, groups scored by their two best (transformers' rule), no expert bias
        // held (transformers' buffer is written as zeros, what pipec computes)
        let mixtral = m.router == crate::model::Router::Softmax
            && m.norm_topk
            && m.shared == 0
            && m.capacity == 0.0
            && m.scale == 1.0
            && m.groups == 0;
        let deepseek = b.mla.is_some()
            && m.router == crate::model::Router::Sigmoid
            && m.capacity == 0.0
            && (m.groups == 0 || m.top_k == 2 * m.group_top);
        if !mixtral && !deepseek {
            return Err("the blocks are mixtures of experts that are neither Mixtral's (a softmax router, norm_topk=true, no shared experts, scale or groups) nor DeepSeek-V3's (latent attention, a sigmoid router, groups scored by their two best): no Hugging Face family to write them as".into());
        }
        if b.qk_norm {
            return Err("the blocks are mixtures of experts with query/key norms (Qwen3-MoE): its checkpoint names are not written yet, and Mixtral's have no query/key norms".into());
        }
    }
    if b.sinks {
        return Err(
            "the blocks have attention sinks (GPT-OSS's): its checkpoint names and its experts are not written yet"
                .into(),
        );
    }
    if b.post_norm {
        return bert_from_pipec(layers, &blocks, weights);
    }
    let family = match (b.norm, b.mlp, b.rope != 0.0) {
        (crate::model::NormKind::LayerNorm, crate::model::MlpKind::GeluTanh | crate::model::MlpKind::Gelu, false)
            if b.bias && b.qkv_bias && b.kv_heads == b.heads =>
        {
            Family::Gpt2
        }
        (crate::model::NormKind::RmsNorm, crate::model::MlpKind::Swiglu, true) if !b.bias => Family::Llama,
        _ => {
            return Err(
                "the blocks are neither GPT-2's (layernorm, gelu/gelu_tanh, biases) nor Llama's (rmsnorm, swiglu, rope, no MLP biases)"
                    .into(),
            )
        }
    };
    if family == Family::Gpt2 && b.window > 0 {
        return Err("the blocks attend in a sliding window, which GPT-2's have no field for".into());
    }
    let Some(Op::Embedding { vocab, dim, .. }) = layers.first().cloned() else {
        return Err("the model does not start with an embedding".into());
    };
    let weight = |id: u64, shape: &[usize]| saved(weights, id, shape);
    let mut out = Tensors::new();
    let mut put = |name: String, shape: Vec<usize>, values: Vec<f32>| {
        out.insert(name, (shape, values));
    };
    let (d, f) = (b.d, b.ff);
    let mut block = 0usize;
    let mut positions = None;
    let mut embd_pdrop = 0.0;
    for (i, op) in layers.iter().enumerate() {
        let id = |slot: u64| pid(i, slot);
        match (family, op) {
            (Family::Gpt2, Op::Embedding { .. }) => {
                put("transformer.wte.weight".into(), vec![vocab, dim], weight(id(0), &[vocab, dim])?.clone())
            }
            (Family::Llama, Op::Embedding { .. }) => {
                put("model.embed_tokens.weight".into(), vec![vocab, dim], weight(id(0), &[vocab, dim])?.clone())
            }
            // GPT-2's embedding dropout (`embd_pdrop`) after the positions
            (Family::Gpt2, Op::Dropout { p }) if i > 0 && matches!(layers[i - 1], Op::PosEmbedding { .. }) => {
                embd_pdrop = *p;
            }
            (Family::Gpt2, Op::PosEmbedding { max_len, dim }) => {
                positions = Some(*max_len);
                put("transformer.wpe.weight".into(), vec![*max_len, *dim], weight(id(0), &[*max_len, *dim])?.clone());
            }
            (Family::Gpt2, Op::TransformerBlock { .. }) => {
                let h = format!("transformer.h.{block}.");
                for (slot, name, shape) in [
                    (0, "ln_1.weight", vec![d]),
                    (1, "ln_1.bias", vec![d]),
                    (2, "attn.c_attn.weight", vec![d, 3 * d]),
                    (3, "attn.c_attn.bias", vec![3 * d]),
                    (4, "attn.c_proj.weight", vec![d, d]),
                    (5, "attn.c_proj.bias", vec![d]),
                    (6, "ln_2.weight", vec![d]),
                    (7, "ln_2.bias", vec![d]),
                    (8, "mlp.c_fc.weight", vec![d, f]),
                    (9, "mlp.c_fc.bias", vec![f]),
                    (10, "mlp.c_proj.weight", vec![f, d]),
                    (11, "mlp.c_proj.bias", vec![d]),
                ] {
                    put(format!("{h}{name}"), shape.clone(), weight(id(slot), &shape)?.clone());
                }
                block += 1;
            }
            (Family::Llama, Op::TransformerBlock { .. }) => {
                let h = format!("model.layers.{block}.");
                // this block's MLP: DeepSeek-V3's dense first blocks are their own width
                let (b, f) = if block < dense { (as_dense, dense_ff) } else { (b, f) };
                let (kv, qw, aw) = (b.kv_width, b.q_width, b.attention_width);
                put(format!("{h}input_layernorm.weight"), vec![d], weight(id(0), &[d])?.clone());
                put(format!("{h}post_attention_layernorm.weight"), vec![d], weight(id(6), &[d])?.clone());
                if let Some(m) = b.mla {
                    for (name, (shape, values)) in latent_from_pipec(&b, m, &|slot, shape| weight(id(slot), shape))? {
                        put(format!("{h}self_attn.{name}"), shape, values);
                    }
                } else {
                    // pipec's [in, out] as [out, in], then cut along `out`
                    let qkv = transpose(weight(id(2), &[d, qw + 2 * kv])?, d, qw + 2 * kv);
                    put(format!("{h}self_attn.q_proj.weight"), vec![qw, d], qkv[..qw * d].to_vec());
                    put(format!("{h}self_attn.k_proj.weight"), vec![kv, d], qkv[qw * d..(qw + kv) * d].to_vec());
                    put(format!("{h}self_attn.v_proj.weight"), vec![kv, d], qkv[(qw + kv) * d..].to_vec());
                }
                if b.qkv_bias && b.mla.is_none() {
                    let bias = weight(id(3), &[qw + 2 * kv])?;
                    put(format!("{h}self_attn.q_proj.bias"), vec![qw], bias[..qw].to_vec());
                    put(format!("{h}self_attn.k_proj.bias"), vec![kv], bias[qw..qw + kv].to_vec());
                    put(format!("{h}self_attn.v_proj.bias"), vec![kv], bias[qw + kv..].to_vec());
                }
                put(format!("{h}self_attn.o_proj.weight"), vec![d, aw], transpose(weight(id(4), &[aw, d])?, aw, d));
                if b.qk_norm {
                    for (slot, name) in [(crate::model::Q_NORM_SLOT, "q_norm"), (crate::model::K_NORM_SLOT, "k_norm")] {
                        put(
                            format!("{h}self_attn.{name}.weight"),
                            vec![b.qk_head],
                            weight(id(slot), &[b.qk_head])?.clone(),
                        );
                    }
                }
                match b.moe {
                    None => {
                        let up = transpose(weight(id(8), &[d, 2 * f])?, d, 2 * f);
                        put(format!("{h}mlp.gate_proj.weight"), vec![f, d], up[..f * d].to_vec());
                        put(format!("{h}mlp.up_proj.weight"), vec![f, d], up[f * d..].to_vec());
                        put(format!("{h}mlp.down_proj.weight"), vec![d, f], transpose(weight(id(10), &[f, d])?, f, d));
                    }
                    // DeepSeek-V3: `mlp.gate` with its correction bias (the expert bias, or
                    // zeros without one),
                    // the experts' gate/up/down projections, the shared experts as one MLP
                    Some(m) if b.mla.is_some() => {
                        let moe = format!("{h}mlp.");
                        let router =
                            transpose(weight(id(crate::checkpoint::ROUTER_SLOT), &[d, m.experts])?, d, m.experts);
                        put(format!("{moe}gate.weight"), vec![m.experts, d], router);
                        let bias = if m.expert_bias {
                            weight(id(crate::model::EXPERT_BIAS_SLOT), &[m.experts])?.to_vec()
                        } else {
                            vec![0.0; m.experts]
                        };
                        put(format!("{moe}gate.e_score_correction_bias"), vec![m.experts], bias);
                        let mlp = |slot: u64| -> Result<[Vec<f32>; 3], String> {
                            let up = transpose(weight(id(slot), &[d, 2 * f])?, d, 2 * f);
                            let down = transpose(weight(id(slot + 2), &[f, d])?, f, d);
                            Ok([up[..f * d].to_vec(), up[f * d..].to_vec(), down])
                        };
                        for e in 0..m.experts {
                            let [gate, up, down] = mlp(crate::checkpoint::expert_slot(e))?;
                            let x = format!("{moe}experts.{e}.");
                            put(format!("{x}gate_proj.weight"), vec![f, d], gate);
                            put(format!("{x}up_proj.weight"), vec![f, d], up);
                            put(format!("{x}down_proj.weight"), vec![d, f], down);
                        }
                        if m.shared > 0 {
                            // rows of the shared experts side by side, [shared · f, d]; the
                            // down projection's columns, [d, shared · f]
                            let w = m.shared * f;
                            let (mut gates, mut ups, mut downs) = (Vec::new(), Vec::new(), vec![0.0; d * w]);
                            for s in 0..m.shared {
                                let [gate, up, down] = mlp(crate::checkpoint::expert_slot(m.experts + s))?;
                                gates.extend(gate);
                                ups.extend(up);
                                for r in 0..d {
                                    downs[r * w + s * f..r * w + (s + 1) * f]
                                        .copy_from_slice(&down[r * f..(r + 1) * f]);
                                }
                            }
                            put(format!("{moe}shared_experts.gate_proj.weight"), vec![w, d], gates);
                            put(format!("{moe}shared_experts.up_proj.weight"), vec![w, d], ups);
                            put(format!("{moe}shared_experts.down_proj.weight"), vec![d, w], downs);
                        }
                    }
                    Some(m) => {
                        let moe = format!("{h}block_sparse_moe.");
                        let router =
                            transpose(weight(id(crate::checkpoint::ROUTER_SLOT), &[d, m.experts])?, d, m.experts);
                        put(format!("{moe}gate.weight"), vec![m.experts, d], router);
                        for e in 0..m.experts {
                            let (x, slot) = (format!("{moe}experts.{e}."), crate::checkpoint::expert_slot(e));
                            let up = transpose(weight(id(slot), &[d, 2 * f])?, d, 2 * f);
                            put(format!("{x}w1.weight"), vec![f, d], up[..f * d].to_vec());
                            put(format!("{x}w3.weight"), vec![f, d], up[f * d..].to_vec());
                            put(format!("{x}w2.weight"), vec![d, f], transpose(weight(id(slot + 2), &[f, d])?, f, d));
                        }
                    }
                }
                block += 1;
            }
            (Family::Gpt2, Op::LayerNorm { dim, .. }) if block == blocks.len() => {
                put("transformer.ln_f.weight".into(), vec![*dim], weight(id(0), &[*dim])?.clone());
                put("transformer.ln_f.bias".into(), vec![*dim], weight(id(1), &[*dim])?.clone());
            }
            (Family::Llama, Op::RmsNorm { dim, .. }) if block == blocks.len() => {
                put("model.norm.weight".into(), vec![*dim], weight(id(0), &[*dim])?.clone());
            }
            (_, Op::Linear { in_features, out_features, bias: false }) if i + 1 == layers.len() => {
                if !tied {
                    let w = transpose(weight(id(0), &[*in_features, *out_features])?, *in_features, *out_features);
                    put("lm_head.weight".into(), vec![*out_features, *in_features], w);
                } else if family == Family::Gpt2 {
                    // transformers ties GPT-2's output layer to `wte` and saves it once
                } else {
                    // a tied Llama-family checkpoint saves the table once too
                }
            }
            (_, other) => {
                return Err(format!("layer {i} (`{}`) has no place in a Hugging Face {family:?} model", other.name()))
            }
        }
    }
    let Some(Op::Linear { .. }) = layers.last() else {
        return Err("the model does not end with its output layer `linear(d, vocab, bias=false)`".into());
    };
    let config = match family {
        Family::Gpt2 => json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": vocab,
            "n_embd": d,
            "n_layer": blocks.len(),
            "n_head": b.heads,
            "n_inner": f,
            "n_positions": positions.ok_or("a GPT-2 model has a `pos_embedding`")?,
            "activation_function": if b.mlp == crate::model::MlpKind::GeluTanh { "gelu_new" } else { "gelu" },
            "layer_norm_epsilon": b.eps,
            // the blocks' one dropout drops the attention's probabilities and the residual
            // branches' outputs
            "attn_pdrop": b.dropout,
            "embd_pdrop": embd_pdrop,
            "resid_pdrop": b.dropout,
            "tie_word_embeddings": true,
            "torch_dtype": "float32",
        }),
        Family::Llama => {
            let mut c = json!({
                "architectures": [if b.qkv_bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
                "model_type": if b.qkv_bias { "qwen2" } else { "llama" },
                "vocab_size": vocab,
                "hidden_size": d,
                "intermediate_size": f,
                "num_hidden_layers": blocks.len(),
                "num_attention_heads": b.heads,
                "num_key_value_heads": b.kv_heads,
                "max_position_embeddings": context,
                "hidden_act": "silu",
                "rope_theta": b.rope,
                "rms_norm_eps": b.eps,
                "tie_word_embeddings": tied,
                "torch_dtype": "float32",
            });
            // a head size of its own (transformers' `head_dim`; d / heads otherwise); query
            // and key norms are Qwen3's (whose config's `head_dim` defaults to 128: always
            // written)
            if b.head_dim.saturating_mul(b.heads) != d || b.qk_norm {
                c["head_dim"] = json!(b.head_dim);
            }
            if b.qk_norm {
                c["architectures"] = json!(["Qwen3ForCausalLM"]);
                c["model_type"] = json!("qwen3");
                c["attention_bias"] = json!(b.qkv_bias);
            }
            if let Some(m) = b.moe.filter(|_| b.mla.is_none()) {
                c["architectures"] = json!(["MixtralForCausalLM"]);
                c["model_type"] = json!("mixtral");
                c["num_local_experts"] = json!(m.experts);
                c["num_experts_per_tok"] = json!(m.top_k);
                c["output_router_logits"] = json!(m.aux_loss != 0.0);
                c["router_aux_loss_coef"] = json!(m.aux_loss);
                c["router_jitter_noise"] = json!(0.0);
            } else if !b.qkv_bias {
                c["attention_bias"] = json!(false);
                c["mlp_bias"] = json!(false);
            }
            // multi-head latent attention: DeepSeek-V3's, every block dense
            // (`first_k_dense_replace`), the rotary parts interleaved as its checkpoints are
            if let Some(m) = b.mla {
                c["architectures"] = json!(["DeepseekV3ForCausalLM"]);
                c["model_type"] = json!("deepseek_v3");
                c["num_key_value_heads"] = json!(b.heads);
                c["q_lora_rank"] = if m.q_lora > 0 { json!(m.q_lora) } else { serde_json::Value::Null };
                c["kv_lora_rank"] = json!(m.kv_lora);
                c["qk_nope_head_dim"] = json!(b.head_dim);
                c["qk_rope_head_dim"] = json!(m.rope_dim);
                c["v_head_dim"] = json!(m.v_head_dim);
                c["first_k_dense_replace"] = json!(if b.moe.is_some() { dense } else { blocks.len() });
                c["rope_interleave"] = json!(true);
                c["attention_bias"] = json!(false);
                // its experts: transformers scores each of `n_group` groups by its two best
                // (checked above), one group of every expert limits nothing
                if let Some(moe) = b.moe {
                    c["intermediate_size"] = json!(dense_ff);
                    c["moe_intermediate_size"] = json!(b.ff);
                    c["n_routed_experts"] = json!(moe.experts);
                    c["num_experts_per_tok"] = json!(moe.top_k);
                    c["n_shared_experts"] = json!(moe.shared);
                    c["norm_topk_prob"] = json!(moe.norm_topk);
                    c["routed_scaling_factor"] = json!(moe.scale);
                    c["n_group"] = json!(moe.groups.max(1));
                    c["topk_group"] = json!(moe.group_top.max(1));
                }
                if m.mscale_all_dim > 0.0 {
                    if let Some((mut scaling, _)) = rope_scaling_config(&b.rope_scaling) {
                        scaling["mscale_all_dim"] = json!(m.mscale_all_dim);
                        c["rope_scaling"] = scaling;
                    }
                }
                if let Some(map) = c.as_object_mut() {
                    // transformers derives it from qk_rope_head_dim
                    map.remove("head_dim");
                    map.remove("mlp_bias");
                }
            }
            // a sliding window: Mistral's (a Llama block that slides), Mixtral's; Qwen2's and
            // Qwen3's only with `use_sliding_window`, from layer `max_window_layers` on
            if b.window > 0 {
                if b.qkv_bias || b.qk_norm {
                    c["use_sliding_window"] = json!(true);
                    c["max_window_layers"] = json!(0);
                } else if b.moe.is_none() {
                    c["architectures"] = json!(["MistralForCausalLM"]);
                    c["model_type"] = json!("mistral");
                }
                c["sliding_window"] = json!(b.window);
            }
            if let Some((scaling, positions)) =
                rope_scaling_config(&b.rope_scaling).filter(|_| c["rope_scaling"].is_null())
            {
                c["rope_scaling"] = scaling;
                // dynamic scaling rescales beyond the config's own context
                if let Some(p) = positions {
                    c["max_position_embeddings"] = json!(p);
                }
            }
            c
        }
    };
    Ok((config, out))
}

/// A block's scaled rotary frequencies as a config's `rope_scaling` (the form transformers
/// 4.x reads and 5.x converts into `rope_parameters`), and the context `dynamic` rescales
/// beyond; None unscaled.
fn rope_scaling_config(s: &crate::rope::RopeScaling) -> Option<(serde_json::Value, Option<usize>)> {
    use crate::rope::RopeScaling;
    use serde_json::json;
    match *s {
        RopeScaling::None => None,
        RopeScaling::Linear { factor } => Some((json!({"rope_type": "linear", "factor": factor}), None)),
        RopeScaling::Dynamic { factor, max_positions } => {
            Some((json!({"rope_type": "dynamic", "factor": factor}), Some(max_positions)))
        }
        RopeScaling::Yarn { factor, original, beta_fast, beta_slow, attention_factor, truncate } => Some((
            json!({
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": original,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "attention_factor": attention_factor,
                "truncate": truncate,
            }),
            None,
        )),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original } => Some((
            json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original,
            }),
            None,
        )),
    }
}

/// A BERT sequence classifier of `layers` (as `pipec import` writes it) under
/// `BertForSequenceClassification`'s names, with its `config.json`: the inverse of the BERT
/// part of [`to_pipec`]. `blocks` are its blocks' sizes, all alike ([`from_pipec`] checked).
fn bert_from_pipec(
    layers: &[Op],
    blocks: &[crate::model::BlockDims],
    weights: &Weights,
) -> Result<(serde_json::Value, Tensors), String> {
    use serde_json::json;
    let b = *blocks.first().ok_or("the model has no transformer block")?;
    let Some(Op::Embedding { vocab, dim, types, sep }) = layers.first().cloned() else {
        return Err("a BERT model starts with its embedding".into());
    };
    let weight = |id: u64, shape: &[usize]| saved(weights, id, shape).cloned();
    let mut out = Tensors::new();
    let (d, f) = (b.d, b.ff);
    let (mut block, mut linears, mut positions, mut labels) = (0usize, 0usize, None, None);
    for (i, op) in layers.iter().enumerate() {
        let id = |slot: u64| pid(i, slot);
        match op {
            Op::Embedding { .. } => {
                let e = "bert.embeddings.";
                out.insert(format!("{e}word_embeddings.weight"), (vec![vocab, dim], weight(id(0), &[vocab, dim])?));
                if types > 0 {
                    let t = weight(id(1), &[types, dim])?;
                    out.insert(format!("{e}token_type_embeddings.weight"), (vec![types, dim], t));
                }
            }
            Op::PosEmbedding { max_len, dim } => {
                positions = Some(*max_len);
                let table = weight(id(0), &[*max_len, *dim])?;
                out.insert("bert.embeddings.position_embeddings.weight".into(), (vec![*max_len, *dim], table));
            }
            Op::LayerNorm { dim, .. } if block == 0 => {
                out.insert("bert.embeddings.LayerNorm.weight".into(), (vec![*dim], weight(id(0), &[*dim])?));
                out.insert("bert.embeddings.LayerNorm.bias".into(), (vec![*dim], weight(id(1), &[*dim])?));
            }
            Op::TransformerBlock { .. } => {
                let h = format!("bert.encoder.layer.{block}.");
                let mut put = |name: &str, shape: Vec<usize>, values: Vec<f32>| {
                    out.insert(format!("{h}{name}"), (shape, values));
                };
                // pipec's fused [in, out] as [out, in], then cut along `out`
                let qkv = transpose(&weight(id(2), &[d, 3 * d])?, d, 3 * d);
                let bias = weight(id(3), &[3 * d])?;
                for (k, name) in ["query", "key", "value"].iter().enumerate() {
                    put(&format!("attention.self.{name}.weight"), vec![d, d], qkv[k * d * d..(k + 1) * d * d].to_vec());
                    put(&format!("attention.self.{name}.bias"), vec![d], bias[k * d..(k + 1) * d].to_vec());
                }
                put("attention.output.dense.weight", vec![d, d], transpose(&weight(id(4), &[d, d])?, d, d));
                put("attention.output.dense.bias", vec![d], weight(id(5), &[d])?);
                put("attention.output.LayerNorm.weight", vec![d], weight(id(0), &[d])?);
                put("attention.output.LayerNorm.bias", vec![d], weight(id(1), &[d])?);
                put("intermediate.dense.weight", vec![f, d], transpose(&weight(id(8), &[d, f])?, d, f));
                put("intermediate.dense.bias", vec![f], weight(id(9), &[f])?);
                put("output.dense.weight", vec![d, f], transpose(&weight(id(10), &[f, d])?, f, d));
                put("output.dense.bias", vec![d], weight(id(11), &[d])?);
                put("output.LayerNorm.weight", vec![d], weight(id(6), &[d])?);
                put("output.LayerNorm.bias", vec![d], weight(id(7), &[d])?);
                block += 1;
            }
            Op::Linear { in_features, out_features, bias: true } if block > 0 && linears < 2 => {
                let name = if linears == 0 { "bert.pooler.dense" } else { "classifier" };
                if linears == 1 {
                    labels = Some(*out_features);
                }
                linears += 1;
                let w = transpose(&weight(id(0), &[*in_features, *out_features])?, *in_features, *out_features);
                out.insert(format!("{name}.weight"), (vec![*out_features, *in_features], w));
                out.insert(format!("{name}.bias"), (vec![*out_features], weight(id(1), &[*out_features])?));
            }
            Op::Dropout { .. } | Op::SeqPool { .. } | Op::Tanh => {}
            other => return Err(format!("layer {i} (`{}`) has no place in a Hugging Face BERT model", other.name())),
        }
    }
    let labels = labels.ok_or("a BERT classifier ends with its pooler and its classifier, two `linear` layers")?;
    let mut config = json!({
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": d,
        "num_hidden_layers": blocks.len(),
        "num_attention_heads": b.heads,
        "intermediate_size": f,
        "hidden_act": if b.mlp == crate::model::MlpKind::GeluTanh { "gelu_new" } else { "gelu" },
        "max_position_embeddings": positions.ok_or("a BERT model has a `pos_embedding`")?,
        "type_vocab_size": types,
        "layer_norm_eps": b.eps,
        "hidden_dropout_prob": blocks[0].dropout,
        "attention_probs_dropout_prob": blocks[0].dropout,
        "position_embedding_type": "absolute",
        "num_labels": labels,
        "id2label": (0..labels).map(|k| (k.to_string(), json!(format!("LABEL_{k}")))).collect::<serde_json::Map<_, _>>(),
        "label2id": (0..labels).map(|k| (format!("LABEL_{k}"), json!(k))).collect::<serde_json::Map<_, _>>(),
        "torch_dtype": "float32",
    });
    if let Some(s) = sep {
        config["sep_token_id"] = json!(s);
    }
    Ok((config, out))
}

/// A ResNet of `layers` under torchvision's `state_dict` names (the inverse of the
/// torchvision part of [`to_pipec`]): the first convolution and batch norm are the stem's
/// `conv1`/`bn1`; each `add` closes a block, whose convolutions are `conv1`, `conv2`, ...
/// and whose shortcut — a convolution reading an earlier tensor than the layer before it
/// (`inputs` per layer, the plan's) — is `downsample.0`, its batch norm `downsample.1`; a
/// block with a shortcut (and the first) starts the next `layerN`; the last `linear` is
/// `fc`. `forwards` is written as each batch norm's `num_batches_tracked`.
pub fn torchvision_from_pipec(
    layers: &[Op],
    inputs: &[Option<Vec<crate::model::Source>>],
    weights: &Weights,
    forwards: u64,
) -> Result<Tensors, String> {
    let weight = |id: u64, shape: &[usize]| saved(weights, id, shape).cloned();
    // each block's layers with weights, between the `add`s; the stem is the first two
    let mut blocks: Vec<Vec<usize>> = vec![Vec::new()];
    for (i, op) in layers.iter().enumerate() {
        match op {
            Op::Add { .. } => blocks.push(Vec::new()),
            Op::Conv2d { .. } | Op::BatchNorm2d { .. } => blocks.last_mut().map_or((), |b| b.push(i)),
            Op::Linear { .. } if i + 1 == layers.len() || layers[i + 1..].iter().all(|o| o.parameter_count() == 0) => {}
            op if op.parameter_count() > 0 => {
                return Err(format!("layer {i} (`{}`) has no place in a torchvision ResNet", op.name()))
            }
            _ => {}
        }
    }
    let first = blocks.first_mut().ok_or("no layers")?;
    if first.len() < 2
        || !matches!(layers[first[0]], Op::Conv2d { .. })
        || !matches!(layers[first[1]], Op::BatchNorm2d { .. })
    {
        return Err("a torchvision ResNet starts with its stem: conv2d, then batchnorm2d".into());
    }
    let stem: Vec<usize> = first.drain(..2).collect();
    let mut names: Vec<(usize, String)> = vec![(stem[0], "conv1".into()), (stem[1], "bn1".into())];
    let (mut stage, mut block) = (0usize, 0usize);
    for (b, members) in blocks.iter().enumerate().filter(|(_, m)| !m.is_empty()) {
        let shortcut = |i: usize| {
            matches!(layers[i], Op::Conv2d { .. })
                && inputs.get(i).and_then(Option::as_ref).is_some_and(|s| s != &[crate::model::Source::before(i)])
        };
        if b == 0 || stage == 0 || members.iter().any(|&i| shortcut(i)) {
            stage += 1;
            block = 0;
        }
        let (mut conv, mut last) = (0usize, String::new());
        for &i in members {
            let name = match layers[i] {
                Op::Conv2d { .. } if shortcut(i) => "downsample.0".to_string(),
                Op::Conv2d { .. } => {
                    conv += 1;
                    format!("conv{conv}")
                }
                _ if last == "downsample.0" => "downsample.1".to_string(),
                _ => format!("bn{conv}"),
            };
            last.clone_from(&name);
            names.push((i, format!("layer{stage}.{block}.{name}")));
        }
        block += 1;
    }
    let fc =
        layers.iter().rposition(|op| matches!(op, Op::Linear { .. })).ok_or("a ResNet ends with its `linear` (fc)")?;
    names.push((fc, "fc".into()));
    let mut out = Tensors::new();
    for (i, name) in names {
        match layers[i] {
            Op::Conv2d { in_channels, out_channels, kernel, bias, .. } => {
                let shape = [out_channels, in_channels, kernel, kernel];
                out.insert(format!("{name}.weight"), (shape.to_vec(), weight(pid(i, 0), &shape)?));
                if bias {
                    out.insert(format!("{name}.bias"), (vec![out_channels], weight(pid(i, 1), &[out_channels])?));
                }
            }
            Op::BatchNorm2d { channels } => {
                for (slot, part) in [(0, "weight"), (1, "bias"), (2, "running_mean"), (3, "running_var")] {
                    out.insert(format!("{name}.{part}"), (vec![channels], weight(pid(i, slot), &[channels])?));
                }
                out.insert(format!("{name}.num_batches_tracked"), (Vec::new(), vec![forwards as f32]));
            }
            Op::Linear { in_features, out_features, bias } => {
                let w = transpose(&weight(pid(i, 0), &[in_features, out_features])?, in_features, out_features);
                out.insert(format!("{name}.weight"), (vec![out_features, in_features], w));
                if bias {
                    out.insert(format!("{name}.bias"), (vec![out_features], weight(pid(i, 1), &[out_features])?));
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// `tensors` as a safetensors file (f32; a batch norm's `num_batches_tracked`, a scalar,
/// as torchvision's int64).
pub fn write_safetensors(tensors: &Tensors) -> Result<Vec<u8>, String> {
    let counter = |n: &str| n.ends_with(".num_batches_tracked");
    let bytes: Vec<(&String, &Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, (s, v))| {
            let b = if counter(n) {
                v.iter().flat_map(|x| (*x as i64).to_le_bytes()).collect()
            } else {
                v.iter().flat_map(|x| x.to_le_bytes()).collect()
            };
            (n, s, b)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(n, s, b)| {
            let dtype = if counter(n) { Dtype::I64 } else { Dtype::F32 };
            safetensors::tensor::TensorView::new(dtype, s.to_vec(), b)
                .map(|v| (n.to_string(), v))
                .map_err(|e| format!("`{n}`: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(metadata)).map_err(|e| format!("cannot encode model.safetensors: {e}"))
}

/// `values` ([rows, cols], row-major) transposed to [cols, rows].
pub fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint's half-precision tensors read exactly: f16 (normal, subnormal, the largest)
    /// and bf16.
    #[test]
    fn half_precision_values_convert_exactly() {
        let bytes = |bits: &[u16]| bits.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>();
        let (f16, bf16) = (bytes(&[0x3c00, 0xc000, 0x3555, 0x0001, 0x7bff]), bytes(&[0x3f80, 0xc040]));
        let views = vec![
            ("a".to_string(), safetensors::tensor::TensorView::new(Dtype::F16, vec![5], &f16).expect("view")),
            ("b".to_string(), safetensors::tensor::TensorView::new(Dtype::BF16, vec![2], &bf16).expect("view")),
        ];
        let file = safetensors::serialize(views, None).expect("serialises");
        let t = read_safetensors(&file).expect("reads");
        assert_eq!(t["a"], (vec![5], vec![1.0, -2.0, 0.333_251_95, 5.960_464_5e-8, 65504.0]));
        assert_eq!(t["b"], (vec![2], vec![1.0, -3.0]));
    }

    /// A mixture of experts that is not Mixtral's is refused by name, not written as the
    /// dense family its attention and norms look like (its experts would be lost).
    #[test]
    fn a_mixture_of_experts_is_not_exported_as_a_dense_family() {
        let mut block = Op::llama_block(8, 2, 1, 16);
        if let Op::TransformerBlock { moe, .. } = &mut block {
            *moe = Some(crate::model::Moe { router: crate::model::Router::Sigmoid, ..crate::model::Moe::new(4, 2) });
        }
        let layers = [
            Op::embedding(11, 8),
            block,
            Op::RmsNorm { dim: 8, eps: crate::model::DEFAULT_EPS },
            Op::Linear { in_features: 8, out_features: 11, bias: false },
        ];
        let e = from_pipec(&layers, false, 6, &Weights::new()).expect_err("a mixture of experts");
        assert!(e.contains("neither Mixtral's"), "{e}");
    }

    /// Every family's export reads back into the same weights, names and shapes included:
    /// GPT-2 (tied), Llama with grouped-query attention, Qwen2 with query/key/value biases.
    #[test]
    fn export_and_import_are_inverses() {
        let llama = |with_qkv_bias: bool| {
            let mut b = Op::llama_block(8, 4, 2, 12);
            if let Op::TransformerBlock { qkv_bias, eps, .. } = &mut b {
                (*qkv_bias, *eps) = (with_qkv_bias, 1e-6);
            }
            b
        };
        let mixtral = {
            let mut b = llama(false);
            if let Op::TransformerBlock { moe, .. } = &mut b {
                *moe = Some(crate::model::Moe::new(3, 2));
            }
            b
        };
        // Qwen2's biases with heads of their own size: 4 heads of 4 on d = 8
        let wide_heads = {
            let mut b = llama(true);
            if let Op::TransformerBlock { head_dim, .. } = &mut b {
                *head_dim = 4;
            }
            b
        };
        // Mistral: Llama's block in a sliding window of 4
        let sliding = {
            let mut b = llama(false);
            if let Op::TransformerBlock { window, .. } = &mut b {
                *window = 4;
            }
            b
        };
        // DeepSeek-V3's multi-head latent attention, with a query latent and without: 4 heads
        // of 4 + 2 rotary features, values of 3
        let latent = |q_lora: usize| {
            let mut b = llama(false);
            if let Op::TransformerBlock { head_dim, mla, kv_heads, .. } = &mut b {
                (*head_dim, *kv_heads) = (4, 0);
                *mla = Some(crate::model::Mla { q_lora, kv_lora: 6, rope_dim: 2, v_head_dim: 3, mscale_all_dim: 0.0 });
            }
            b
        };
        // DeepSeek-V3's experts after a dense latent block: 4 of 6 wide, 2 per token from the
        // best of 2 groups, weights times 2.5, two shared experts (one MLP of 12 in its
        // checkpoint)
        let deepseek_moe = {
            let mut b = latent(5);
            if let Op::TransformerBlock { moe, d_ff, .. } = &mut b {
                *d_ff = 6;
                *moe = Some(crate::model::Moe {
                    shared: 2,
                    router: crate::model::Router::Sigmoid,
                    scale: 2.5,
                    groups: 2,
                    group_top: 1,
                    ..crate::model::Moe::new(4, 2)
                });
            }
            b
        };
        // GPT-2's dropouts: the embedding's after the positions, the blocks' one
        let mut gpt2_block = Op::block(8, 2, 16, true);
        if let Op::TransformerBlock { dropout, .. } = &mut gpt2_block {
            *dropout = 0.125;
        }
        let models: [(Vec<Op>, bool, &str, usize); 9] = [
            (
                vec![
                    Op::embedding(11, 8),
                    Op::PosEmbedding { max_len: 6, dim: 8 },
                    Op::Dropout { p: 0.25 },
                    gpt2_block.clone(),
                    gpt2_block,
                    Op::layer_norm(8),
                    Op::Linear { in_features: 8, out_features: 11, bias: false },
                ],
                true,
                "gpt2",
                28,
            ),
            (
                vec![
                    Op::embedding(11, 8),
                    llama(false),
                    Op::RmsNorm { dim: 8, eps: 1e-6 },
                    Op::Linear { in_features: 8, out_features: 11, bias: false },
                ],
                false,
                "llama",
                12,
            ),
            (
                vec![
                    Op::embedding(11, 8),
                    llama(true),
                    Op::RmsNorm { dim: 8, eps: 1e-6 },
                    Op::Linear { in_features: 8, out_features: 11, bias: false },
                ],
                true,
                "qwen2",
                14,
            ),
            (
                vec![
                    Op::embedding(11, 8),
                    mixtral,
                    Op::RmsNorm { dim: 8, eps: 1e-6 },
                    Op::Linear { in_features: 8, out_features: 11, bias: false },
                ],
                false,
                "mixtral",
                // embedding, two norms, q, k, v, o, the router, 3 × 3 experts' matrices, the
                // final norm, the output layer
                19,
            ),
            (
                vec![
                    Op::embedding(11, 8),
                    wide_heads,
                    Op::RmsNorm { dim: 8, eps: 1e-6 },
                    Op::Linear { in_features: 8, out_features: 11, bias: false },
                ],
                false,
                "qwen2",
                15,
            ),
            (
                vec![
                    Op::embedding(11, 8),
                    sliding,
                    Op::RmsNorm { dim: 8, eps: 1e-6 },
                    Op::Linear { in_features: 8, out_features: 11, bias: false },
                ],
                false,
                "mistral",
                12,
            ),
            (
                vec![
                    Op::embedding(11, 8),
                    latent(5),
                    Op::RmsNorm { dim: 8, eps: 1e-6 },
                    Op::Linear { in_features: 8, out_features: 11, bias: false },
                ],
                false,
                "deepseek_v3",
                // embedding, two norms, q_a, its norm, q_b, kv_a, its norm, kv_b, o, the
                // MLP's three, the final norm, the output layer
                15,
            ),
            (
                vec![
                    Op::embedding(11, 8),
                    latent(0),
                    Op::RmsNorm { dim: 8, eps: 1e-6 },
                    Op::Linear { in_features: 8, out_features: 11, bias: false },
                ],
                false,
                "deepseek_v3",
                13,
            ),
            (
                vec![
                    Op::embedding(11, 8),
                    latent(5),
                    deepseek_moe,
                    Op::RmsNorm { dim: 8, eps: 1e-6 },
                    Op::Linear { in_features: 8, out_features: 11, bias: false },
                ],
                false,
                "deepseek_v3",
                // the embedding; the dense block's 12; the expert block's two norms, seven
                // attention tensors, router and its bias, 4 × 3 experts', 3 shared; the final
                // norm and the output layer
                1 + 12 + 26 + 2,
            ),
        ];
        for (layers, tied, family, tensors) in models {
            // distinct values everywhere, so a swapped or transposed tensor shows
            let mut weights = Weights::new();
            let mut next = 0.0f32;
            let mut fill = |shape: Vec<usize>| {
                let n: usize = shape.iter().product();
                let v: Vec<f32> = (0..n).map(|i| next + i as f32 * 0.001).collect();
                next += 1.0;
                (shape, v)
            };
            for (i, op) in layers.iter().enumerate() {
                for (slot, shape) in param_shapes(op) {
                    weights.insert(pid(i, slot), fill(shape));
                }
            }
            if tied {
                // the output layer's copy of the table, as a pipec checkpoint holds it
                let table = weights[&pid(0, 0)].clone();
                let last = layers.len() - 1;
                weights.insert(pid(last, 0), (vec![8, 11], transpose(&table.1, 11, 8)));
            }
            let (config, hf) = from_pipec(&layers, tied, 6, &weights).expect("exports");
            assert_eq!(config["model_type"], family, "{config}");
            // a head size other than d / heads is written as transformers reads it
            let b = layers[layers.len() - 3].block_dims().expect("a block");
            let own = (b.head_dim * b.heads != b.d && b.mla.is_none()).then_some(b.head_dim);
            assert_eq!(config.get("head_dim").and_then(|h| h.as_u64()), own.map(|h| h as u64), "{config}");
            // multi-head latent attention writes DeepSeek's head sizes (and no `head_dim`)
            if let Some(m) = b.mla {
                assert_eq!(config["qk_rope_head_dim"], m.rope_dim, "{config}");
                assert_eq!(config["q_lora_rank"].as_u64(), (m.q_lora > 0).then_some(m.q_lora as u64), "{config}");
            }
            // and a sliding window as Mistral's `sliding_window`
            // experts as DeepSeek-V3's config describes them
            if let (Some(m), Some(_)) = (b.moe, b.mla) {
                assert_eq!(config["first_k_dense_replace"], 1, "{config}");
                assert_eq!(config["intermediate_size"], 12, "{config}");
                assert_eq!(config["moe_intermediate_size"], 6, "{config}");
                assert_eq!((config["n_group"].clone(), config["topk_group"].clone()), (json_n(m.groups), json_n(1)));
                assert_eq!(config["routed_scaling_factor"], 2.5, "{config}");
                assert_eq!(config["n_shared_experts"], 2, "{config}");
            }
            if family == "gpt2" {
                let p = |k: &str| config[k].as_f64();
                assert_eq!(
                    [p("embd_pdrop"), p("attn_pdrop"), p("resid_pdrop")],
                    [Some(0.25), Some(0.125), Some(0.125)]
                );
            }
            let window = (b.window > 0).then_some(b.window as u64);
            assert_eq!(config.get("sliding_window").and_then(|w| w.as_u64()), window, "{config}");
            assert_eq!(hf.len(), tensors, "{family}: {:?}", hf.keys().collect::<Vec<_>>());
            let back = to_pipec(&layers, &hf).expect("imports");
            assert_eq!(back, weights, "{family}");
        }
    }

    fn json_n(n: usize) -> serde_json::Value {
        serde_json::json!(n)
    }

    /// The shape of each of `op`'s parameters, by slot (the layers a Hugging Face family has).
    fn param_shapes(op: &Op) -> Vec<(u64, Vec<usize>)> {
        use crate::model::NormKind;
        let mut out = Vec::new();
        let mut put = |slot: u64, shape: Vec<usize>| out.push((slot, shape));
        match op {
            Op::Embedding { vocab, dim, .. } => put(0, vec![*vocab, *dim]),
            Op::PosEmbedding { max_len, dim } => put(0, vec![*max_len, *dim]),
            Op::LayerNorm { dim, .. } => {
                put(0, vec![*dim]);
                put(1, vec![*dim]);
            }
            Op::RmsNorm { dim, .. } => put(0, vec![*dim]),
            Op::Linear { in_features, out_features, .. } => put(0, vec![*in_features, *out_features]),
            Op::TransformerBlock { .. } => {
                let b = op.block_dims().expect("a block");
                put(0, vec![b.d]);
                put(6, vec![b.d]);
                if b.norm == NormKind::LayerNorm {
                    put(1, vec![b.d]);
                    put(7, vec![b.d]);
                }
                match b.latent() {
                    None => put(2, vec![b.d, b.qkv_width]),
                    Some(w) => {
                        put(crate::model::LATENT_DOWN_SLOT, w.down.to_vec());
                        put(crate::model::LATENT_NORMS_SLOT, vec![w.norms]);
                        put(crate::model::LATENT_QUERY_SLOT, w.query.to_vec());
                        put(crate::model::LATENT_KV_UP_SLOT, w.kv_up.to_vec());
                    }
                }
                put(4, vec![b.attention_width, b.d]);
                match b.moe {
                    None => {
                        put(8, vec![b.d, b.up_width]);
                        put(10, vec![b.ff, b.d]);
                    }
                    Some(m) => {
                        put(crate::checkpoint::ROUTER_SLOT, vec![b.d, m.experts]);
                        for e in 0..m.experts + m.shared {
                            put(crate::checkpoint::expert_slot(e), vec![b.d, b.up_width]);
                            put(crate::checkpoint::expert_slot(e) + 2, vec![b.ff, b.d]);
                        }
                    }
                }
                if b.qkv_bias && b.mla.is_none() {
                    put(3, vec![b.qkv_width]);
                }
                if b.qk_norm {
                    put(crate::model::Q_NORM_SLOT, vec![b.qk_head]);
                    put(crate::model::K_NORM_SLOT, vec![b.qk_head]);
                }
                if b.bias {
                    put(5, vec![b.d]);
                    put(9, vec![b.up_width]);
                    put(11, vec![b.d]);
                }
            }
            _ => {}
        }
        out
    }

    /// Every parameter of `layers` (a Hugging Face family's), each value distinct.
    fn distinct_weights(layers: &[Op]) -> Weights {
        let mut weights = Weights::new();
        for (i, op) in layers.iter().enumerate() {
            for (slot, shape) in param_shapes(op) {
                let n: usize = shape.iter().product();
                weights.insert(pid(i, slot), (shape, (0..n).map(|k| (i * 1000 + k) as f32 * 1e-3).collect()));
            }
        }
        weights
    }

    /// A Llama-family checkpoint's tensors (`blocks` blocks, q/k/v biases with `bias`), from
    /// pipec weights of distinct values.
    fn llama_tensors(blocks: usize, bias: bool) -> (Vec<Op>, Tensors) {
        let mut block = Op::llama_block(8, 4, 2, 12);
        if let Op::TransformerBlock { qkv_bias, .. } = &mut block {
            *qkv_bias = bias;
        }
        let mut layers = vec![Op::embedding(11, 8)];
        layers.extend(std::iter::repeat_n(block, blocks));
        layers.push(Op::RmsNorm { dim: 8, eps: 1e-6 });
        layers.push(Op::Linear { in_features: 8, out_features: 11, bias: false });
        let (_, tensors) = from_pipec(&layers, false, 16, &distinct_weights(&layers)).expect("exports");
        (layers, tensors)
    }

    /// Qwen3-MoE's checkpoint names (`mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/down_proj`,
    /// the query/key norms) read into the same weights as Mixtral's names for the same model.
    #[test]
    fn a_qwen3_moe_checkpoint_reads_under_its_own_names() {
        let block = |qk_norm: bool| {
            let mut b = Op::llama_block(8, 4, 2, 12);
            if let Op::TransformerBlock { moe, qk_norm: q, .. } = &mut b {
                *q = qk_norm;
                *moe = Some(crate::model::Moe::new(3, 2));
            }
            b
        };
        let layers = |qk_norm: bool| {
            vec![
                Op::embedding(11, 8),
                block(qk_norm),
                Op::RmsNorm { dim: 8, eps: 1e-6 },
                Op::Linear { in_features: 8, out_features: 11, bias: false },
            ]
        };
        let mut weights = distinct_weights(&layers(false));
        let (_, mixtral) = from_pipec(&layers(false), false, 16, &weights).expect("exports");
        let mut qwen: Tensors = mixtral
            .into_iter()
            .map(|(name, t)| {
                let name = name
                    .replace("block_sparse_moe.", "mlp.")
                    .replace(".w1.", ".gate_proj.")
                    .replace(".w3.", ".up_proj.")
                    .replace(".w2.", ".down_proj.");
                (name, t)
            })
            .collect();
        assert!(qwen.contains_key("model.layers.0.mlp.experts.2.down_proj.weight"));
        for (slot, name, base) in
            [(crate::model::Q_NORM_SLOT, "q_norm", 7.0f32), (crate::model::K_NORM_SLOT, "k_norm", 9.0)]
        {
            let values: Vec<f32> = (0..2).map(|k| base + k as f32).collect();
            qwen.insert(format!("model.layers.0.self_attn.{name}.weight"), (vec![2], values.clone()));
            weights.insert(pid(1, slot), (vec![2], values));
        }
        assert_eq!(to_pipec(&layers(true), &qwen).expect("reads"), weights);
    }

    #[test]
    fn tensors_the_model_does_not_use_are_named_not_dropped() {
        let (two, tensors) = llama_tensors(2, false);
        let one: Vec<Op> = two.iter().enumerate().filter(|(i, _)| *i != 2).map(|(_, op)| op.clone()).collect();
        // a 2-block checkpoint into a 1-block model: the second block's tensors are unused
        let c = convert(&one, &tensors).expect("converts");
        assert!(!c.unused.is_empty() && c.unused.iter().all(|n| n.starts_with("model.layers.1.")), "{:?}", c.unused);
        assert!(to_pipec(&one, &tensors).expect_err("strict").contains("model.layers.1."));
        assert!(convert(&two, &tensors).expect("converts").unused.is_empty());
        // q/k/v biases for blocks without them
        let (_, biased) = llama_tensors(1, true);
        let c = convert(&one, &biased).expect("converts");
        assert_eq!(
            c.unused,
            [
                "model.layers.0.self_attn.k_proj.bias",
                "model.layers.0.self_attn.q_proj.bias",
                "model.layers.0.self_attn.v_proj.bias"
            ]
        );
        // buffers no model reads are named apart, not refused
        let mut buffered = tensors.clone();
        buffered.insert("model.layers.0.self_attn.rotary_emb.inv_freq".into(), (vec![2], vec![1.0, 0.5]));
        let c = convert(&two, &buffered).expect("converts");
        assert!(c.unused.is_empty());
        assert_eq!(c.ignored.len(), 1);
    }

    #[test]
    fn the_index_decides_which_shard_a_tensor_comes_from_and_non_finite_values_are_refused() {
        let (layers, tensors) = llama_tensors(1, false);
        let dir = tempfile::tempdir().expect("tmp");
        let name = "model.embed_tokens.weight";
        // shard 1 holds the real table; shard 2 a stale copy, later in name order
        let mut first = tensors.clone();
        let second: Tensors = [(name.to_string(), (tensors[name].0.clone(), vec![9.0; tensors[name].1.len()]))].into();
        let mut map = serde_json::Map::new();
        for k in first.keys() {
            map.insert(k.clone(), "model-00001-of-00002.safetensors".into());
        }
        std::fs::write(dir.path().join("model-00001-of-00002.safetensors"), write_safetensors(&first).expect("w"))
            .expect("write");
        std::fs::write(dir.path().join("model-00002-of-00002.safetensors"), write_safetensors(&second).expect("w"))
            .expect("write");
        let index = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).expect("write");
        let read = read_dir(dir.path()).expect("reads");
        assert_eq!(read[name], tensors[name], "taken from the shard the index names");
        assert_eq!(to_pipec(&layers, &read).expect("converts").len(), to_pipec(&layers, &tensors).expect("c").len());
        // a NaN in a row of the table that no batch might read
        first.get_mut(name).expect("table").1[3 * 8 + 5] = f32::NAN;
        std::fs::write(dir.path().join("model-00001-of-00002.safetensors"), write_safetensors(&first).expect("w"))
            .expect("write");
        let e = read_dir(dir.path()).expect_err("NaN");
        assert!(e.contains(name) && e.contains("NaN at value 29 (row 3 of [11, 8])"), "{e}");
        // the index names a tensor its shard lacks
        let mut index = index;
        index["weight_map"]["lm_head.extra"] = "model-00002-of-00002.safetensors".into();
        std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).expect("write");
        assert!(read_dir(dir.path()).expect_err("lacks").contains("`lm_head.extra`"));
    }

    #[test]
    fn a_missing_tensor_or_a_wrong_shape_is_named() {
        let layers = [Op::embedding(4, 2), Op::Linear { in_features: 2, out_features: 4, bias: false }];
        let mut t = Tensors::new();
        let e = to_pipec(&layers, &t).expect_err("missing");
        assert!(e.contains("`model.embed_tokens.weight`"), "{e}");
        t.insert("model.embed_tokens.weight".into(), (vec![4, 3], vec![0.0; 12]));
        let e = to_pipec(&layers, &t).expect_err("shape");
        assert!(e.contains("[4, 3]") && e.contains("[4, 2]"), "{e}");
        // tied: the output layer takes the table, transposed
        t.insert("model.embed_tokens.weight".into(), (vec![4, 2], (0..8).map(|v| v as f32).collect()));
        let p = to_pipec(&layers, &t).expect("tied");
        assert_eq!(p[&pid(1, 0)], (vec![2, 4], vec![0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]));
    }
}
