//! The two FLOP counts against hand-computed values and against published pairs of
//! tokens/s/GPU and TFLOP/s/GPU.

use super::*;
use crate::device::preset;
use crate::model::{MlpKind, Moe, NormKind};

/// A decoder-only language model as the importers write one: token embedding, `blocks`,
/// a final RMSNorm and an untied output projection to the vocabulary.
fn decoder(vocab: usize, d: usize, blocks: Vec<Op>) -> Vec<Op> {
    let mut layers = vec![Op::embedding(vocab, d)];
    layers.extend(blocks);
    layers.push(Op::RmsNorm { dim: d, eps: 1e-5 });
    layers.push(Op::Linear { in_features: d, out_features: vocab, bias: false });
    layers
}

/// Llama 3 8B (and 3.1 8B): 32 blocks, d 4,096, 32 heads, 8 key/value heads, SwiGLU 14,336,
/// vocabulary 128,256.
fn llama3_8b() -> Vec<Op> {
    decoder(128_256, 4096, vec![Op::llama_block(4096, 32, 8, 14_336); 32])
}

/// Llama 3 70B: 80 blocks, d 8,192, 64 heads, 8 key/value heads, SwiGLU 28,672.
fn llama3_70b() -> Vec<Op> {
    decoder(128_256, 8192, vec![Op::llama_block(8192, 64, 8, 28_672); 80])
}

/// Qwen3-30B-A3B: 48 blocks, d 2,048, 32 heads of 128 (queries 4,096 wide), 4 key/value
/// heads, query/key norms; 128 routed SwiGLU experts of 768, 8 per token, no shared expert;
/// vocabulary 151,936, untied.
fn qwen3_30b_a3b() -> Vec<Op> {
    let moe = Moe { aux_loss: 0.001, ..Moe::new(128, 8) };
    let block = Op::TransformerBlock {
        d_model: 2048,
        heads: 32,
        d_ff: 768,
        causal: true,
        kv_heads: 4,
        norm: NormKind::RmsNorm,
        mlp: MlpKind::Swiglu,
        rope: 1e6,
        rope_scaling: crate::rope::RopeScaling::None,
        bias: false,
        qkv_bias: false,
        eps: 1e-6,
        post_norm: false,
        moe: Some(moe),
        head_dim: 128,
        qk_norm: true,
        window: 0,
        sinks: false,
        mla: None,
        dropout: 0.0,
    };
    decoder(151_936, 2048, vec![block; 48])
}

fn per_token(count: FlopsCount, layers: &[Op], seq: usize) -> f64 {
    count.per_token(layers.iter().map(|op| (op, None)), seq).expect("a language model's layers are counted")
}

fn assert_close(got: f64, want: f64, tolerance: f64) {
    assert!((got / want - 1.0).abs() <= tolerance, "got {got:.6e}, want {want:.6e} (± {:.2}%)", tolerance * 100.0);
}

#[test]
fn megatron_counts_llama3_8b_by_hand() {
    // per token and block: projections 4096·(4096 + 2·1024) + 4096·4096 = 41,943,040;
    // SwiGLU 3·4096·14,336 = 176,160,768; logits 4096·128,256 = 525,336,576
    // 6·(32·(41,943,040 + 176,160,768) + 525,336,576) = 6·7,504,658,432 = 45,027,950,592
    // attention core, causal: 6·(4096 + 4096)·(8192/2)·32 = 6,442,450,944
    assert_eq!(per_token(FlopsCount::Megatron, &llama3_8b(), 8192), 51_470_401_536.0);
}

#[test]
fn torchtitan_counts_llama3_8b_by_hand() {
    // parameters without the embedding: 32·(2·4096 + 41,943,040 + 176,160,768) + 4096 +
    // 525,336,576 = 7,504,924,672 (8,030,261,248 in all less the 525,336,576 of the table)
    // 6·7,504,924,672 = 45,029,548,032; attention 6·32·32·(2·128)·8192 = 12,884,901,888
    assert_eq!(per_token(FlopsCount::Torchtitan, &llama3_8b(), 8192), 57_914_449_920.0);
}

#[test]
fn megatron_counts_only_the_active_experts_of_qwen3_30b_a3b() {
    // per block: projections 2048·(4096 + 2·512) + 4096·2048 = 18,874,368;
    // 8 experts · 3·2048·768 = 37,748,736 (the other 120 and the router not counted)
    // 6·(48·56,623,104 + 2048·151,936) = 6·3,029,073,920 = 18,174,443,520
    // attention core: 6·(4096 + 4096)·(4096/2)·48 = 4,831,838,208
    assert_eq!(per_token(FlopsCount::Megatron, &qwen3_30b_a3b(), 4096), 23_006_281_728.0);
}

#[test]
fn torchtitan_counts_only_the_active_experts_of_qwen3_30b_a3b() {
    // active parameters per block: norms 2·2048, projections 18,874,368, query/key norms
    // 2·128, router 2048·128 = 262,144, 8 experts 37,748,736: 56,889,600
    // 48·56,889,600 + 2048 + 311,164,928 = 3,041,867,776; ·6 = 18,251,206,656
    // attention: 6·48·32·(2·128)·4096 = 9,663,676,416
    assert_eq!(per_token(FlopsCount::Torchtitan, &qwen3_30b_a3b(), 4096), 27_914_883_072.0);
}

/// A published row: its id, the model, its sequence, tokens/s/GPU and TFLOP/s/GPU.
type PublishedRow = (&'static str, fn() -> Vec<Op>, usize, f64, f64);

/// Megatron-Bridge's performance tables print tokens/s/GPU and model TFLOP/s/GPU, both from
/// Megatron-LM's count: their ratio is its FLOPs per token. Rows of
/// NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (and -archive.md) as
/// /work/research/published-runs-2025.csv transcribed them: (row, tokens/s/GPU, TFLOP/s/GPU).
#[test]
fn megatron_count_reproduces_megatron_bridge_rows() {
    let rows: [PublishedRow; 5] = [
        ("mb2509_h100_llama38b_na_8g", llama3_8b, 8192, 14_079.0, 725.0),
        ("mb2511_gb300_llama38b_fp8cs_8g", llama3_8b, 8192, 37_556.0, 1933.0),
        ("mb2604_h100_llama370b_fp8_64g", llama3_70b, 8192, 1633.0, 734.0),
        ("mb2606_h100_llama370b_fp8_32g", llama3_70b, 4096, 1638.0, 710.0),
        ("mb2604_gb300_qwen330ba3b_mxfp8_8g", qwen3_30b_a3b, 4096, 31_470.0, 724.0),
    ];
    for (row, model, seq, tokens, tflops) in rows {
        let published = tflops * 1e12 / tokens;
        let ours = per_token(FlopsCount::Megatron, &model(), seq);
        // the tables round TFLOP/s to the unit: 0.5 in 710 is 0.07%
        assert!((ours / published - 1.0).abs() < 0.01, "{row}: {ours:.4e} against {published:.4e}");
    }
}

/// torchtitan's Llama 3.1 8B benchmark (benchmarks/llama3_h100_202412_torchtitan.md at
/// v0.2.2, Table 1): FSDP on 8 H100s, 5,762 tokens/s/GPU eager, 6,667 compiled; the page
/// says these reach "33% to 39% MFU" against the H100 SXM's 989 TFLOP/s.
#[test]
fn torchtitan_mfu_matches_its_published_llama3_8b_figures() {
    let h100 = preset("h100-sxm").expect("preset").model();
    let basis = Utilization {
        tokens_per_sample: 8192,
        devices: 8,
        formula: FlopsCount::Torchtitan,
        flops_per_token: Some(per_token(FlopsCount::Torchtitan, &llama3_8b(), 8192)),
        peak: Some(Peak::of(&h100, Precision::Bf16)),
    };
    for (tokens_per_gpu, published) in [(5762.0, 0.33), (6667.0, 0.39)] {
        let samples_per_s = tokens_per_gpu * 8.0 / 8192.0;
        assert_close(basis.tokens_per_s_per_device(samples_per_s), tokens_per_gpu, 1e-12);
        let mfu = basis.mfu(samples_per_s).expect("an LM on a known device").fraction;
        assert!((mfu - published).abs() < 0.01, "{tokens_per_gpu} tokens/s/GPU: MFU {mfu:.4}, published {published}");
    }
}

#[test]
fn each_engine_reports_its_own_count() {
    assert_eq!(FlopsCount::of_engine(Engine::Torchtitan), FlopsCount::Torchtitan);
    for engine in [Engine::Megatron, Engine::Deepspeed, Engine::Pipec] {
        assert_eq!(FlopsCount::of_engine(engine), FlopsCount::Megatron);
    }
}

#[test]
fn fp8_training_is_quoted_against_the_bf16_peak() {
    // FP8 training's value precision is bf16 (`TrainingPlan::precision`)
    let peak = Peak::of(&preset("h100-sxm").expect("preset").model(), Precision::Bf16);
    assert_eq!(peak.flops_per_s, 989.4e12);
    assert_eq!(peak.text(), "989.4 TFLOP/s, h100-sxm's dense bf16 peak");
}

#[test]
fn a_tied_output_projection_is_a_parameter_once_and_a_product_always() {
    let mut layers: Vec<(Op, Option<usize>)> = llama3_8b().into_iter().map(|op| (op, None)).collect();
    let last = layers.len() - 1;
    layers[last].1 = Some(0);
    let count = |c: FlopsCount| c.per_token(layers.iter().map(|(op, t)| (op, *t)), 8192).expect("counted");
    // torchtitan subtracts the shared table with the embedding; Megatron-LM counts the logits
    assert_eq!(count(FlopsCount::Torchtitan), 57_914_449_920.0 - 6.0 * 525_336_576.0);
    assert_eq!(count(FlopsCount::Megatron), 51_470_401_536.0);
}

#[test]
fn a_convolution_is_outside_both_counts() {
    let conv = Op::Conv2d { in_channels: 3, out_channels: 8, kernel: 3, stride: 1, padding: 1, bias: true };
    assert_eq!(FlopsCount::Megatron.per_token([(&conv, None)].into_iter(), 1), None);
    assert!(FlopsCount::Torchtitan.per_token([(&conv, None)].into_iter(), 1).is_some());
}

#[test]
fn a_cpu_device_is_known_by_its_name() {
    let peak = |device: &str| Peak { flops_per_s: 1.0, device: device.into(), precision: Precision::Fp32 };
    assert!(peak("cpu").is_cpu() && peak("CPU").is_cpu() && peak("cpu (pipec calibrate)").is_cpu());
    assert!(!peak("h100-sxm").is_cpu() && !peak("cuda:0 (pipec calibrate)").is_cpu());
}

#[test]
fn a_simulation_written_before_tokens_per_device_and_mfu_reads_back() {
    let old =
        serde_json::json!({"step_time_s": 1.0, "bubble_fraction": 0.0, "throughput_samples_per_s": 8.0, "devices": []});
    let sim: crate::plan::Simulation = serde_json::from_value(old).expect("an older plan's simulation");
    assert_eq!((sim.tokens_per_s_per_device, sim.mfu), (None, None));
}
