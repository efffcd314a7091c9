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
    let got = match model
        .forward(Act::Tokens(tokens), false, (0, 0, 0), &mut crate::nn::layers::Collected::default())
        .expect("forward")
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
