//! pipec's layers against `transformers`: tiny random Llama (grouped-query attention,
//! rotary embeddings, RMSNorm, SwiGLU) and GPT-2 (tanh GELU) models made by
//! `tests/reference/hf/make_reference.py` — their weights loaded through
//! `pipec_plan::hf::to_pipec`, their logits compared with the ones PyTorch computed.

use burn::prelude::*;
use pipec_plan::model::{MlpKind, Op};

use crate::layers::{Act, StageModel};

type B = burn::backend::Flex;

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/hf").join(name)
}

/// The largest difference between pipec's logits for `layers` with the fixture's weights
/// and PyTorch's, relative to the largest logit.
fn logits_difference(name: &str, layers: &[Op]) -> f64 {
    let dir = fixture(name);
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("fixture weights");
    let tensors = pipec_plan::hf::read_safetensors(&bytes).expect("safetensors");
    let values = pipec_plan::hf::to_pipec(layers, &tensors).expect("every tensor maps");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).expect("fixture")).expect("json");
    let ids: Vec<Vec<i64>> = serde_json::from_value(reference["input_ids"].clone()).expect("ids");
    let expected: Vec<f64> = serde_json::from_value(reference["logits"].clone()).expect("logits");
    let device = Default::default();
    let model = StageModel::<B>::new(layers, 0, 1, &device);
    let (model, missing) = crate::params::set_params(model, |id, _| values.get(&id).map(|(_, v)| v.clone()));
    assert!(missing.is_empty(), "parameters without a value: {missing:?}");
    let (rows, seq) = (ids.len(), ids[0].len());
    let flat: Vec<i64> = ids.into_iter().flatten().collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [rows, seq]), &device);
    let Act::D3(out) = model.forward(Act::Tokens(tokens), false, (0, 0, 0), &mut Vec::new()).expect("forward") else {
        panic!("logits are [batch, seq, vocab]")
    };
    let got = crate::params::host_f32(out.into_data()).expect("values");
    assert_eq!(got.len(), expected.len());
    let scale = expected.iter().fold(0.0_f64, |m, v| m.max(v.abs()));
    let d = got.iter().zip(&expected).map(|(g, e)| (f64::from(*g) - e).abs()).fold(0.0, f64::max) / scale;
    eprintln!("{name}: largest difference {d:.2e} of the largest logit ({scale:.3})");
    d
}

#[test]
fn a_llama_block_with_grouped_query_attention_and_rotary_embeddings_computes_what_transformers_does() {
    let block = Op::llama_block(16, 4, 2, 24);
    let layers = [
        Op::Embedding { vocab: 50, dim: 16 },
        block.clone(),
        block,
        Op::RmsNorm { dim: 16, eps: 1e-5 },
        Op::Linear { in_features: 16, out_features: 50, bias: false },
    ];
    let d = logits_difference("llama-gqa", &layers);
    assert!(d < 1e-5, "pipec's logits differ from transformers' by {d:e} of the largest");
    // and the comparison can fail: without the rotary embeddings the logits differ
    let mut wrong = layers.clone();
    if let Op::TransformerBlock { rope, .. } = &mut wrong[1] {
        *rope = 0.0;
    }
    assert!(logits_difference("llama-gqa", &wrong) > 1e-2);
}

#[test]
fn a_gpt2_block_with_the_tanh_gelu_computes_what_transformers_does() {
    let mut block = gpt_block();
    if let Op::TransformerBlock { mlp, .. } = &mut block {
        *mlp = MlpKind::GeluTanh;
    }
    let layers = |block: Op| {
        [
            Op::Embedding { vocab: 50, dim: 16 },
            Op::PosEmbedding { max_len: 32, dim: 16 },
            block.clone(),
            block,
            Op::LayerNorm { dim: 16 },
            Op::Linear { in_features: 16, out_features: 50, bias: false },
        ]
    };
    let d = logits_difference("gpt2", &layers(block));
    assert!(d < 1e-5, "pipec's logits differ from transformers' by {d:e} of the largest");
    // the exact (erf) GELU is measurably not GPT-2's
    assert!(logits_difference("gpt2", &layers(gpt_block())) > 1e-5);
}

fn gpt_block() -> Op {
    Op::block(16, 4, 64, true)
}
