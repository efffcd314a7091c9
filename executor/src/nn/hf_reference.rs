//! pipec's layers against `transformers`: tiny random Llama (grouped-query attention,
//! rotary embeddings, RMSNorm, SwiGLU) and GPT-2 (tanh GELU) models made by
//! `tests/reference/hf/make_reference.py` — their weights loaded through
//! `pipec_plan::hf::to_pipec`, their logits compared with the ones PyTorch computed.

use burn::prelude::*;
use pipec_plan::model::{MlpKind, Op};

use crate::nn::layers::{Act, StageModel};

type B = burn::backend::Flex;

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/hf").join(name)
}

/// The largest difference between pipec's logits for `layers` with the fixture's weights
/// and PyTorch's, relative to the largest logit.
fn logits_difference(name: &str, layers: &[Op]) -> f64 {
    logits_difference_as(name, layers, layers)
}

/// [`logits_difference`] of a model of `layers` holding the weights read for `read_as`.
fn logits_difference_as(name: &str, read_as: &[Op], layers: &[Op]) -> f64 {
    let dir = fixture(name);
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("fixture weights");
    let tensors = pipec_plan::hf::read_safetensors(&bytes).expect("safetensors");
    let values = pipec_plan::hf::to_pipec(read_as, &tensors).expect("every tensor maps");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("fixture")).expect("json");
    let ids: Vec<Vec<i64>> = serde_json::from_value(reference["input_ids"].clone()).expect("ids");
    let expected: Vec<f64> = serde_json::from_value(reference["logits"].clone()).expect("logits");
    let device = Default::default();
    let model = StageModel::<B>::new(layers, 0, 1, &device);
    let (model, missing) = crate::nn::params::set_params(model, |id, _| values.get(&id).map(|(_, v)| v.clone()));
    assert!(missing.is_empty(), "parameters without a value: {missing:?}");
    let (rows, seq) = (ids.len(), ids[0].len());
    let flat: Vec<i64> = ids.into_iter().flatten().collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [rows, seq]), &device);
    let got =
        match model.forward(Act::Tokens(tokens), false, &mut crate::nn::layers::Collected::default()).expect("forward")
        {
            // a language model's [batch, seq, vocab], a classifier's [batch, classes]
            Act::D3(out) => crate::nn::params::host_f32(out.into_data()).expect("values"),
            Act::D2(out) => crate::nn::params::host_f32(out.into_data()).expect("values"),
            other => panic!("logits of shape {:?}", other.dims()),
        };
    assert_eq!(got.len(), expected.len());
    let scale = expected.iter().fold(0.0_f64, |m, v| m.max(v.abs()));
    let d = got.iter().zip(&expected).map(|(g, e)| (f64::from(*g) - e).abs()).fold(0.0, f64::max) / scale;
    eprintln!("{name}: largest difference {d:.2e} of the largest logit ({scale:.3})");
    d
}

/// An embedding of 50 tokens, two copies of `block` on d = 16, a final RMSNorm and an
/// untied 16 → 50 head: the layers both Llama-family fixtures were written with.
fn llama_layers(block: Op) -> Vec<Op> {
    vec![
        Op::embedding(50, 16),
        block.clone(),
        block,
        Op::RmsNorm { dim: 16, eps: 1e-5 },
        Op::Linear { in_features: 16, out_features: 50, bias: false },
    ]
}

#[test]
fn a_llama_block_with_grouped_query_attention_and_rotary_embeddings_computes_what_transformers_does() {
    let block = Op::llama_block(16, 4, 2, 24);
    let layers = llama_layers(block);
    let d = logits_difference("llama-gqa", &layers);
    assert!(d < 1e-5, "pipec's logits differ from transformers' by {d:e} of the largest");
    // and the comparison can fail: without the rotary embeddings the logits differ
    let mut wrong = layers.clone();
    if let Op::TransformerBlock { rope, .. } = &mut wrong[1] {
        *rope = 0.0;
    }
    assert!(logits_difference("llama-gqa", &wrong) > 1e-2);
}

/// tests/reference/hf/qwen3 (transformers 4.57.6): 4 query heads and 2 key/value heads of 8
/// features on d = 16 (the query projection 16 → 32, the output 32 → 16), an RMSNorm over
/// each query and key head before the rotary embeddings.
#[test]
fn a_qwen3_block_with_its_own_head_size_and_query_key_norms_computes_what_transformers_does() {
    let mut block = Op::llama_block(16, 4, 2, 24);
    if let Op::TransformerBlock { head_dim, qk_norm, .. } = &mut block {
        (*head_dim, *qk_norm) = (8, true);
    }
    let layers = llama_layers(block);
    let d = logits_difference("qwen3", &layers);
    assert!(d < 1e-5, "pipec's logits differ from transformers' by {d:e} of the largest");
    // and the comparison can fail: the same weights without the query/key norms differ
    let mut plain = layers.clone();
    for op in &mut plain[1..3] {
        if let Op::TransformerBlock { qk_norm, .. } = op {
            *qk_norm = false;
        }
    }
    assert!(logits_difference_as("qwen3", &layers, &plain) > 1e-2);
}

/// tests/reference/hf/mistral (transformers 4.57.6): the Llama block in a sliding window of
/// 4 — each of the 12 positions sees itself and the 3 before it.
#[test]
fn a_mistral_block_with_a_sliding_window_computes_what_transformers_does() {
    let mut block = Op::llama_block(16, 4, 2, 24);
    if let Op::TransformerBlock { window, .. } = &mut block {
        *window = 4;
    }
    let layers = llama_layers(block);
    let d = logits_difference("mistral", &layers);
    assert!(d < 1e-5, "pipec's logits differ from transformers' by {d:e} of the largest");
    // and the comparison can fail: the same weights attending to every earlier position differ
    let mut full = layers.clone();
    for op in &mut full[1..3] {
        if let Op::TransformerBlock { window, .. } = op {
            *window = 0;
        }
    }
    assert!(logits_difference_as("mistral", &layers, &full) > 1e-2);
}

/// tests/reference/hf/deepseek-v3 (transformers 4.57.6): multi-head latent attention — 4
/// heads whose queries come from a latent of 8 and whose keys and values from a latent of 8
/// and a shared rotary key of 4, each query and key head 4 features without rotary
/// embeddings and 4 with, values of 6 — its checkpoint's interleaved rotary parts read in
/// pipec's order, SwiGLU MLPs.
#[test]
fn a_deepseek_v3_block_with_multi_head_latent_attention_computes_what_transformers_does() {
    let mut block = Op::llama_block(16, 4, 4, 24);
    if let Op::TransformerBlock { head_dim, mla, .. } = &mut block {
        *head_dim = 4;
        *mla = Some(pipec_plan::model::Mla { q_lora: 8, kv_lora: 8, rope_dim: 4, v_head_dim: 6, mscale_all_dim: 0.0 });
    }
    let layers = llama_layers(block);
    let d = logits_difference("deepseek-v3", &layers);
    assert!(d < 1e-5, "pipec's logits differ from transformers' by {d:e} of the largest");
    // and the comparison can fail: without the rotary embeddings the logits differ
    let mut unturned = layers.clone();
    for op in &mut unturned[1..3] {
        if let Op::TransformerBlock { rope, .. } = op {
            *rope = 0.0;
        }
    }
    assert!(logits_difference_as("deepseek-v3", &layers, &unturned) > 1e-2);
}

/// tests/reference/hf/deepseek-v3-moe (transformers 4.57.6): DeepSeek-V3's latent attention
/// under YaRN (factor 4 over 8 positions; `mscale_all_dim` 1 scales the softmax by
/// (0.1 ln 4 + 1)²), a dense block, then a mixture of 8 experts of 8 with a shared one:
/// sigmoid scores, each token's 4 experts from its 2 best of 4 groups, their weights
/// renormalised and times 2.5 (the correction bias zero, as transformers initialises it).
#[test]
fn a_deepseek_v3_mixture_of_experts_with_group_limited_routing_computes_what_transformers_does() {
    use pipec_plan::model::{Mla, Moe, Router};
    use pipec_plan::rope::RopeScaling;
    let block = |ff: usize, moe: Option<Moe>, mscale_all_dim: f64| {
        let mut b = Op::llama_block(16, 4, 4, ff);
        if let Op::TransformerBlock { head_dim, mla, rope_scaling, moe: m, .. } = &mut b {
            *head_dim = 4;
            *mla = Some(Mla { q_lora: 8, kv_lora: 8, rope_dim: 4, v_head_dim: 6, mscale_all_dim });
            *rope_scaling = RopeScaling::Yarn {
                factor: 4.0,
                original: 8,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: 1.0,
                truncate: true,
            };
            *m = moe;
        }
        b
    };
    let routing = |groups: usize, scale: f64| Moe {
        shared: 1,
        router: Router::Sigmoid,
        scale,
        groups,
        group_top: if groups > 0 { 2 } else { 0 },
        ..Moe::new(8, 4)
    };
    let layers = |groups: usize, scale: f64, mscale: f64| {
        vec![
            Op::embedding(50, 16),
            block(24, None, mscale),
            block(8, Some(routing(groups, scale)), mscale),
            Op::RmsNorm { dim: 16, eps: 1e-5 },
            Op::Linear { in_features: 16, out_features: 50, bias: false },
        ]
    };
    let exact = layers(4, 2.5, 1.0);
    let d = logits_difference("deepseek-v3-moe", &exact);
    assert!(d < 1e-5, "pipec's logits differ from transformers' by {d:e} of the largest");
    // and the comparison can fail: without the groups, the scale or YaRN's softmax scale
    // the same weights give other logits
    for (what, other) in
        [("groups", layers(0, 2.5, 1.0)), ("scale", layers(4, 1.0, 1.0)), ("mscale", layers(4, 2.5, 0.0))]
    {
        let d = logits_difference_as("deepseek-v3-moe", &exact, &other);
        assert!(d > 1e-3, "without the {what}: {d:e}");
    }
}

#[test]
fn a_gpt2_block_with_the_tanh_gelu_computes_what_transformers_does() {
    let mut block = gpt_block();
    if let Op::TransformerBlock { mlp, .. } = &mut block {
        *mlp = MlpKind::GeluTanh;
    }
    let layers = |block: Op| {
        [
            Op::embedding(50, 16),
            Op::PosEmbedding { max_len: 32, dim: 16 },
            block.clone(),
            block,
            Op::layer_norm(16),
            Op::Linear { in_features: 16, out_features: 50, bias: false },
        ]
    };
    let d = logits_difference("gpt2", &layers(block));
    assert!(d < 1e-5, "pipec's logits differ from transformers' by {d:e} of the largest");
    // the exact (erf) GELU is measurably not GPT-2's
    assert!(logits_difference("gpt2", &layers(gpt_block())) > 1e-5);
}

/// A BERT sequence classifier as `pipec import` writes it: token types from the [SEP]
/// token, learned positions, the embedding's layer norm, post-norm blocks (exact GELU, ε
/// 1e-12), the first position pooled, the pooler (`linear` + `tanh`) and the classifier.
pub(crate) fn bert_layers(post_norm: bool, sep: Option<usize>) -> Vec<Op> {
    let mut block = Op::block(16, 4, 24, false);
    if let Op::TransformerBlock { post_norm: p, eps, .. } = &mut block {
        *p = post_norm;
        *eps = 1e-12;
    }
    vec![
        Op::Embedding { vocab: 50, dim: 16, types: 2, sep },
        Op::PosEmbedding { max_len: 32, dim: 16 },
        Op::LayerNorm { dim: 16, eps: 1e-12 },
        block.clone(),
        block,
        Op::SeqPool { how: pipec_plan::model::Pooling::First },
        Op::Linear { in_features: 16, out_features: 16, bias: true },
        Op::Tanh,
        Op::Linear { in_features: 16, out_features: 3, bias: true },
    ]
}

#[test]
fn a_bert_classifier_with_post_norm_blocks_and_token_types_computes_what_transformers_does() {
    let d = logits_difference("bert", &bert_layers(true, Some(2)));
    assert!(d < 1e-5, "pipec's logits differ from transformers' by {d:e} of the largest");
    // and the comparison can fail: pre-norm blocks, or every token of type 0
    assert!(logits_difference_as("bert", &bert_layers(true, Some(2)), &bert_layers(false, Some(2))) > 1e-2);
    assert!(logits_difference("bert", &bert_layers(true, None)) > 1e-3);
}

fn gpt_block() -> Op {
    Op::block(16, 4, 64, true)
}

/// The tiny Llama of `tests/reference/hf/rope-<kind>` (heads of 8 features, θ 10,000) with
/// its blocks' rotary frequencies scaled by `scaling`.
fn scaled_llama(scaling: pipec_plan::rope::RopeScaling) -> Vec<Op> {
    let mut block = Op::llama_block(32, 4, 2, 48);
    if let Op::TransformerBlock { rope_scaling, .. } = &mut block {
        *rope_scaling = scaling;
    }
    vec![
        Op::embedding(50, 32),
        block.clone(),
        block,
        Op::RmsNorm { dim: 32, eps: 1e-5 },
        Op::Linear { in_features: 32, out_features: 50, bias: false },
    ]
}

#[test]
fn scaled_rotary_embeddings_compute_what_transformers_does_for_each_rope_type() {
    use pipec_plan::rope::{yarn_mscale, RopeScaling};
    // each fixture's `rope_parameters` (tests/reference/hf/make_rope_reference.py)
    let kinds = [
        ("rope-llama3", RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original: 64 }),
        (
            "rope-yarn",
            RopeScaling::Yarn {
                factor: 4.0,
                original: 8,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: yarn_mscale(4.0, 1.0),
                truncate: true,
            },
        ),
        ("rope-linear", RopeScaling::Linear { factor: 2.0 }),
        // a context of 8 positions, run on 12: rescaled
        ("rope-dynamic", RopeScaling::Dynamic { factor: 4.0, max_positions: 8 }),
    ];
    for (name, scaling) in kinds {
        let d = logits_difference(name, &scaled_llama(scaling));
        assert!(d < 1e-5, "{name}: pipec's logits differ from transformers' by {d:e} of the largest");
        // and the scaling matters: unscaled, the logits differ
        let plain = logits_difference_as(name, &scaled_llama(scaling), &scaled_llama(RopeScaling::None));
        assert!(plain > 1e-3, "{name}: the unscaled model is as close ({plain:e})");
    }
}

/// tests/reference/hf/gpt-oss-attention (transformers 4.57.6's `eager_attention_forward` of
/// gpt_oss): the attention core with sinks — 4 query heads on 2 key/value heads of 8, 6
/// positions, causal in a window of 3, sinks of both signs — gives transformers' output and
/// the gradients of its queries, keys, values and sinks, with the probabilities kept and
/// recomputed in the backward (selective recompute, flash attention).
#[test]
fn gpt_oss_attention_sinks_compute_what_transformers_does_forward_and_backward() {
    type A = burn::backend::Autodiff<B>;
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("gpt-oss-attention").join("reference.json")).expect("fixture"),
    )
    .expect("json");
    let values = |key: &str| -> Vec<f32> { serde_json::from_value(reference[key].clone()).expect(key) };
    let (b, h, kv, s, dh) = (2, 4, 2, 6, 8);
    let dev = Default::default();
    let mut op = Op::llama_block(16, h, kv, 24);
    if let Op::TransformerBlock { head_dim, window, sinks, rope, .. } = &mut op {
        (*head_dim, *window, *sinks, *rope) = (dh, 3, true, 0.0);
    }
    // [batch, heads, seq, dh] as the fused projection's [batch, seq, heads·dh]
    let heads_last = |v: Vec<f32>, heads: usize| {
        Tensor::<A, 4>::from_data(TensorData::new(v, [b, heads, s, dh]), &dev).swap_dims(1, 2).reshape([
            b,
            s,
            heads * dh,
        ])
    };
    let back = |t: Tensor<A, 3>, heads: usize| -> Vec<f32> {
        let t = Tensor::<A, 3>::from_inner(t.inner());
        t.reshape([b, s, heads, dh]).swap_dims(1, 2).into_data().to_vec::<f32>().expect("f32")
    };
    let close = |got: &[f32], want: &[f32], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        assert!(worst <= 1e-5 * scale, "{what}: differs by {worst} (largest {scale})");
    };
    let run = |recompute: bool, sinks: Vec<f32>| {
        let mut block = super::block::Block::<A>::build(0, &op, 0, &dev, |_, w| w, (1, 0), false).expect("a block");
        block.recompute_core = recompute;
        let id = pipec_plan::checkpoint::param_id(0, pipec_plan::model::SINKS_SLOT);
        block.sinks = Some(crate::nn::parts::param(id, sinks, [h], &dev));
        let qkv =
            Tensor::cat(vec![heads_last(values("q"), h), heads_last(values("k"), kv), heads_last(values("v"), kv)], 2)
                .detach()
                .require_grad();
        let out = block.attend(qkv.clone(), &crate::nn::parts::Collected::default()).expect("attends");
        let weights = Tensor::<A, 3>::from_data(TensorData::new(values("weights"), [b, s, h * dh]), &dev);
        let grads = (out.clone() * weights).sum().backward();
        let dqkv = Tensor::<A, 3>::from_inner(qkv.grad(&grads).expect("a gradient"));
        let part = |start: usize, heads: usize| back(dqkv.clone().narrow(2, start * dh, heads * dh), heads);
        let dsinks = block.sinks.as_ref().expect("sinks").val().grad(&grads).expect("the sinks' gradient");
        let got = out.into_data().to_vec::<f32>().expect("f32");
        (got, part(0, h), part(h, kv), part(h + kv, kv), dsinks.into_data().to_vec::<f32>().expect("f32"))
    };
    for recompute in [false, true] {
        let what = |t: &str| format!("{t} ({})", if recompute { "recomputed" } else { "kept" });
        let (out, dq, dk, dv, dsinks) = run(recompute, values("sinks"));
        close(&out, &values("out"), &what("the output"));
        close(&dq, &values("dq"), &what("dq"));
        close(&dk, &values("dk"), &what("dk"));
        close(&dv, &values("dv"), &what("dv"));
        close(&dsinks, &values("dsinks"), &what("the sinks' gradient"));
    }
    // and the comparison can fail: sinks at 0 give another output
    let (out, ..) = run(false, vec![0.0; h]);
    let worst = out.iter().zip(values("out")).fold(0f32, |m, (g, w)| m.max((g - w).abs()));
    assert!(worst > 1e-2, "{worst}");
}
