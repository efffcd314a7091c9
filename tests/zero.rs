//! ZeRO's sharding trained for real: each level (1 the optimizer state and master weights,
//! 2 also the gradients, 3 also the weights between steps) trains to one device's losses
//! and final weights on data parallelism, on a pipeline with replicated stages under 1F1B
//! and interleaved, with tensor parallelism, with batch normalisation and with weights tied
//! across stages; each replica really holds only its shard; a checkpoint written under any
//! level resumes under any other level, data-parallel degree or layout.

use std::path::{Path, PathBuf};
use std::time::Duration;

use pipec_compiler::{compile, CompileOptions};
use pipec_executor::{RunOptions, RunReport};
use pipec_plan::checkpoint;
use pipec_plan::Plan;

const SGD: &str = "{ kind: momentum, lr: 0.05, momentum: 0.9 }";
const ADAM: &str = "{ kind: adam, lr: 0.005, weight_decay: 0.01 }";
const MLP: &str = "  input: [16]\n  layers:\n    - linear(16, 32) -> relu\n    - repeat 4: linear(32, 32) -> relu\n    - linear(32, 4)\n";
/// Batch normalisation in a convolutional stem: the statistics travel with the gradient shards.
const BATCH_NORM: &str = "  input: [2, 6, 6]\n  layers:\n    - conv2d(2, 4, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n    - conv2d(4, 4, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n    - adaptive_avgpool2d -> flatten -> linear(4, 4)\n";
/// A language model whose output layer is tied to its embedding on another stage.
const TIED_LM: &str = "  input: [12]\n  layers:\n    - embedding(20, 16) as tokens\n    - transformer_block(d=16, heads=2, ff=32, causal=true)\n    - layernorm\n    - linear(16, 20, bias=false, tie=tokens)\n";

/// A spec of `model` on `devices` devices with `strategy` (its lines after `strategy:`).
fn spec(model: &str, devices: usize, strategy: &str, optimizer: &str, steps: usize) -> String {
    format!(
        "name: zero\nmodel:\n{model}  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n{strategy}\ntraining:\n  batch_size: 32\n  steps: {steps}\n  optimizer: {optimizer}\n  seed: 5\n  checkpoint: {{ every: {steps} }}\n  data: {{ kind: synthetic, samples: 96 }}\n"
    )
}

fn plan(text: &str) -> Plan {
    let checked = pipec_grammar::check_source(text);
    let s = checked.spec.unwrap_or_else(|| panic!("bad spec {:?}\n{text}", checked.diagnostics));
    compile(&s, &CompileOptions::default()).into_compiled().unwrap_or_else(|d| panic!("{d:?}\n{text}")).plan
}

/// Trains `p`, writing its checkpoints under `dir`.
fn train(p: &Plan, dir: &Path) -> RunReport {
    let options =
        RunOptions { timeout: Duration::from_secs(60), checkpoint_dir: Some(dir.to_path_buf()), ..Default::default() };
    pipec_executor::run(p, &options, &mut |_| {}).unwrap_or_else(|e| panic!("run failed: {e}"))
}

fn losses(r: &RunReport) -> Vec<f64> {
    r.steps.iter().map(|s| s.loss).collect()
}

/// The weights of the newest checkpoint under `dir`, by (parameter, tensor-parallel rank).
fn weights(dir: &Path) -> Vec<((u64, u32), Vec<f32>)> {
    let latest = std::fs::read_to_string(dir.join("latest")).expect("latest");
    let loaded = checkpoint::read(&dir.join(latest.trim())).expect("checkpoint");
    let mut out: Vec<((u64, u32), Vec<f32>)> = loaded.params.into_iter().map(|(k, (_, v))| (k, v)).collect();
    out.sort_by_key(|a| a.0);
    out
}

fn close(a: &[f32], b: &[f32]) -> bool {
    let scale = a.iter().fold(1e-6f32, |s, v| s.max(v.abs()));
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * scale)
}

/// Trains `strategy` and `reference` (both on `model`); asserts the same losses and final
/// weights (relative 1e-5), and returns the sharded run's plan.
fn assert_trains_like(
    model: &str,
    optimizer: &str,
    (devices, strategy): (usize, &str),
    reference: (usize, &str),
) -> Plan {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("reference"), dir.path().join("sharded"));
    let expected = train(&plan(&spec(model, reference.0, reference.1, optimizer, 4)), &a);
    let p = plan(&spec(model, devices, strategy, optimizer, 4));
    assert!(p.streams.values().flatten().any(|i| matches!(i, pipec_plan::Instr::ShardStep { .. })), "{strategy}");
    let got = train(&p, &b);
    let (x, y) = (losses(&expected), losses(&got));
    assert_eq!(x.len(), y.len());
    for (step, (u, v)) in x.iter().zip(&y).enumerate() {
        assert!((u - v).abs() <= 1e-5 * u.abs().max(1e-6), "{strategy}: step {step}: {u} vs {v}\n{x:?}\n{y:?}");
    }
    assert!(y.last() < y.first(), "{strategy}: the loss did not fall: {y:?}");
    let (wa, wb) = (weights(&a), weights(&b));
    assert_eq!(wa.len(), wb.len(), "{strategy}: the checkpoints hold different parameters");
    for ((ka, va), (kb, vb)) in wa.iter().zip(&wb) {
        assert_eq!(ka, kb);
        assert!(
            close(va, vb),
            "{strategy}: final weights of {} differ: {:?} vs {:?}",
            checkpoint::param_name(ka.0),
            &va[..va.len().min(6)],
            &vb[..vb.len().min(6)]
        );
    }
    p
}

const ONE_DEVICE: (usize, &str) = (1, "  stages: \"1\"\n  schedule: gpipe\n  microbatches: 4");

#[test]
fn every_level_trains_like_one_device_under_data_parallelism() {
    for zero in 1..=3 {
        for optimizer in [SGD, ADAM] {
            let strategy = format!("  stages: \"4\"\n  schedule: dp-only\n  microbatches: 4\n  zero: {zero}");
            assert_trains_like(MLP, optimizer, (4, &strategy), ONE_DEVICE);
        }
    }
}

#[test]
fn every_level_trains_like_one_device_on_a_replicated_pipeline() {
    for zero in 1..=3 {
        for optimizer in [SGD, ADAM] {
            for schedule in ["1f1b", "{ kind: interleaved, virtual_stages: 2 }"] {
                let strategy = format!("  stages: \"2-2\"\n  schedule: {schedule}\n  microbatches: 4\n  zero: {zero}");
                assert_trains_like(MLP, optimizer, (4, &strategy), ONE_DEVICE);
            }
        }
    }
}

#[test]
fn every_level_composes_with_tensor_parallelism() {
    // the shards of each tensor-parallel rank are sharded again across its replicas: the
    // same weights, shard for shard, as the layout without ZeRO (whose losses equal one
    // device's in tests/training.rs), and the same losses as one device
    for zero in 1..=3 {
        let strategy = format!("  stages: \"2-2\"\n  tp: 2\n  schedule: 1f1b\n  microbatches: 4\n  zero: {zero}");
        let unsharded = (8, "  stages: \"2-2\"\n  tp: 2\n  schedule: 1f1b\n  microbatches: 4");
        assert_trains_like(MLP, ADAM, (8, &strategy), unsharded);
        let dir = tempfile::tempdir().expect("tempdir");
        let one = losses(&train(&plan(&spec(MLP, 1, ONE_DEVICE.1, ADAM, 4)), dir.path()));
        let got = losses(&train(&plan(&spec(MLP, 8, &strategy, ADAM, 4)), &dir.path().join("tp")));
        for (u, v) in one.iter().zip(&got) {
            assert!((u - v).abs() <= 1e-5 * u.abs(), "tp 2, zero {zero}: {one:?} vs {got:?}");
        }
    }
}

#[test]
fn every_level_reduces_in_gradient_buckets_like_one_device() {
    // 1 KiB buckets: each 32 × 32 layer (4,224 bytes of gradients) closes one. The buckets'
    // reduce-scatters start inside the backward (a whole one on the first stage, a weight
    // pass on later ones and under zero bubble), each replica keeping its chunks
    for zero in 1..=3 {
        for (devices, stages, schedule, optimizer) in [
            (4, "\"4\"", "dp-only", SGD),
            (4, "\"4\"", "dp-only", ADAM),
            (4, "\"2-2\"", "1f1b", ADAM),
            (4, "\"2-2\"", "zb-h1", SGD),
        ] {
            let strategy = format!(
                "  stages: {stages}\n  schedule: {schedule}\n  microbatches: 4\n  zero: {zero}\n  bucket: 1KiB"
            );
            let p = assert_trains_like(MLP, optimizer, (devices, &strategy), ONE_DEVICE);
            for s in &p.stages {
                assert!(s.gradient_buckets.len() >= 2, "{strategy}: {} has {:?}", s.id, s.gradient_buckets);
            }
        }
    }
    // the batch statistics travel after the last bucket's chunks
    let strategy = "  stages: \"2\"\n  schedule: dp-only\n  microbatches: 4\n  zero: 2\n  bucket: 1KiB";
    let wide = "  input: [2, 6, 6]\n  layers:\n    - conv2d(2, 8, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n    - conv2d(8, 16, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n    - adaptive_avgpool2d -> flatten -> linear(16, 4)\n";
    let p = assert_trains_like(wide, ADAM, (2, strategy), ONE_DEVICE);
    assert!(p.stages[0].gradient_buckets.len() >= 2, "{:?}", p.stages[0].gradient_buckets);
}

#[test]
fn a_stage_holding_both_ends_of_a_tie_reduces_its_shards_whole() {
    // the embedding's and the tied output layer's gradients are summed before either is
    // scattered, so a sharded stage holding both has no buckets (and still trains)
    let strategy = "  stages: \"2\"\n  schedule: dp-only\n  microbatches: 4\n  zero: 2\n  bucket: 1KiB";
    let p = plan(&spec(TIED_LM, 2, strategy, ADAM, 2));
    assert!(p.stages[0].gradient_buckets.is_empty(), "{:?}", p.stages[0].gradient_buckets);
    let unsharded = plan(&spec(TIED_LM, 2, &strategy.replace("\n  zero: 2", ""), ADAM, 2));
    assert!(unsharded.stages[0].gradient_buckets.len() >= 2, "{:?}", unsharded.stages[0].gradient_buckets);
}

#[test]
fn batch_statistics_and_tied_weights_travel_with_the_shards() {
    for zero in 1..=3 {
        let strategy = format!("  stages: \"2-1\"\n  schedule: 1f1b\n  microbatches: 4\n  zero: {zero}");
        assert_trains_like(BATCH_NORM, ADAM, (3, &strategy), ONE_DEVICE);
        // the embedding's stage and the tied projection's both replicated and sharded, and
        // a sharded stage tied to an unsharded one
        for stages in ["\"2-2\"", "\"2-1\""] {
            let devices = if stages == "\"2-2\"" { 4 } else { 3 };
            let strategy = format!("  stages: {stages}\n  schedule: 1f1b\n  microbatches: 4\n  zero: {zero}");
            // (SGD: the attention's key bias has no gradient but rounding, which Adam would
            // scale up to whole steps in every layout alike, and no weight comparison holds)
            let p = assert_trains_like(TIED_LM, SGD, (devices, &strategy), ONE_DEVICE);
            assert!(p.streams.values().flatten().any(|i| matches!(
                i,
                pipec_plan::Instr::Collective { payload: pipec_plan::CollectivePayload::TiedGradientShard, .. }
            )));
        }
    }
}

/// Each replica holds its shard: the optimizer's state per replica is 1/d of the whole
/// (counted from the checkpoint joined from the shards against an unsharded run's).
#[test]
fn a_checkpoint_under_any_level_resumes_under_any_other_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let layouts: [(usize, String); 5] = [
        (1, ONE_DEVICE.1.to_string()),
        (4, "  stages: \"2-2\"\n  schedule: 1f1b\n  microbatches: 4".to_string()),
        (4, "  stages: \"2-2\"\n  schedule: 1f1b\n  microbatches: 4\n  zero: 1".to_string()),
        (4, "  stages: \"4\"\n  schedule: dp-only\n  microbatches: 4\n  zero: 2".to_string()),
        (4, "  stages: \"2-2\"\n  schedule: 1f1b\n  microbatches: 4\n  zero: 3".to_string()),
    ];
    let with_every = |text: String| text.replace("checkpoint: { every: 6 }", "checkpoint: { every: 3 }");
    for (source, (sd, s)) in layouts.iter().enumerate() {
        let src_dir = dir.path().join(format!("source{source}"));
        let full = train(&plan(&with_every(spec(MLP, *sd, s, ADAM, 6))), &src_dir);
        let step3: PathBuf = src_dir.join("step-000003");
        for (target, (td, t)) in layouts.iter().enumerate() {
            let p = plan(&with_every(spec(MLP, *td, t, ADAM, 6)));
            let loaded = checkpoint::read(&step3).expect("checkpoint");
            let out = dir.path().join(format!("resumed{source}-{target}"));
            let options = RunOptions {
                timeout: Duration::from_secs(60),
                checkpoint_dir: Some(out),
                resume: Some(pipec_executor::Resume::Loaded(std::sync::Arc::new(loaded))),
                ..Default::default()
            };
            let resumed = pipec_executor::run(&p, &options, &mut |_| {}).expect("resumes");
            let (a, b) = (&losses(&full)[3..], losses(&resumed));
            assert_eq!(a.len(), b.len());
            for (u, v) in a.iter().zip(&b) {
                // the same layout continues bit for bit; another sums in another order
                let tolerance = if source == target { 0.0 } else { 1e-6 * u.abs() };
                assert!((u - v).abs() <= tolerance, "{s} → {t}: {a:?} vs {b:?}");
            }
        }
    }
}

/// Each replica holds only its shard, as the plan counts it: data parallelism over 4
/// devices, Adam in fp32, the state each device held at the end of the run against the
/// plan's figures for it (per parameter, a chunk is padded to a whole number of values, so
/// the two agree within the padding).
#[test]
fn each_replica_holds_the_state_the_plan_counts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let near = |measured: u64, predicted: u64| measured.abs_diff(predicted) <= 64 + predicted / 100;
    let mut whole_optimizer = 0;
    for zero in 0..=3 {
        // two microbatches per replica: a whole gradient and a shard at once under ZeRO-2 and 3
        let strategy = format!("  stages: \"4\"\n  schedule: dp-only\n  microbatches: 8\n  zero: {zero}");
        let p = plan(&spec(MLP, 4, &strategy, ADAM, 2));
        let report = train(&p, &dir.path().join(format!("z{zero}")));
        assert_eq!(report.held.len(), 4);
        for (d, held) in &report.held {
            let m = &p.devices[d.0 as usize].memory;
            let (w, g, o) = (held.weights * 4, held.gradients * 4, held.optimizer * 4);
            match zero {
                // stage 3 keeps the weights' fp32 shard as its master copy (the optimizer's,
                // in the executor's accounting); the plan counts it as the weights'
                3 => {
                    assert!(w < 64, "{d}: zero 3 holds {w} B of whole weights between steps");
                    assert!(near(o, m.weights + m.optimizer), "{d}: optimizer {o} B, plan {m:?}");
                    assert!(near(g, 4 * m.gradients + m.gradients), "{d}: gradients {g} B, plan {m:?}");
                }
                // stage 2 reduce-scatters each microbatch's whole gradient after its backward:
                // one whole gradient beside the shard at the peak (the plan counts the shard)
                2 => {
                    assert!(near(w, m.weights) && near(o, m.optimizer), "{d}: {held:?}, plan {m:?}");
                    assert!(near(g, 4 * m.gradients + m.gradients), "{d}: gradients {g} B, plan {m:?}");
                }
                _ => assert!(
                    near(w, m.weights) && near(g, m.gradients) && near(o, m.optimizer),
                    "{d}: {held:?}, plan {m:?}"
                ),
            }
            if zero == 0 {
                whole_optimizer = o;
            } else {
                // Adam's two moments and the fp32 master copy, a quarter each
                assert!(near(o, 3 * whole_optimizer / 2 / 4), "{d}: zero {zero}: {o} B of {whole_optimizer} B whole");
            }
        }
    }
}

/// ZeRO-3 with the stage as FSDP's unit for what its products do not gather themselves (here
/// the biases; the test after next has the linear weights): they are dropped once nothing
/// kept for a backward holds them and gathered again for the next pass. A recomputed stage
/// keeps only its forwards' inputs, so it gathers for every forward and every recompute —
/// 2 gathers per microbatch; a stage whose forwards keep their graphs (here the last,
/// which keeps its loss) gathers once a step, at its first pass — the first step too (a
/// step starts with the weights dropped, those built included). Both train like one device.
#[test]
fn zero_3_gathers_a_recomputed_stage_for_every_pass_and_drops_it_between() {
    let strategy = "  stages: \"2-2\"\n  schedule: gpipe\n  microbatches: 4\n  recompute: true\n  zero: 3";
    for optimizer in [SGD, ADAM] {
        assert_trains_like(MLP, optimizer, (4, strategy), ONE_DEVICE);
    }
    let p = plan(&spec(MLP, 4, strategy, ADAM, 2));
    let dir = tempfile::tempdir().expect("tempdir");
    let report = train(&p, dir.path());
    // 4 microbatches over 2 replicas: 2 per replica
    for s in &p.stages {
        let per_step = if s.id.0 == 0 { 2 * 2 } else { 1 };
        for d in &s.replicas {
            assert_eq!(report.weight_gathers.get(d), Some(&vec![per_step, per_step]), "{} on {d}", s.id);
        }
    }
    // without recompute the first stage keeps its graphs too: one gather a step
    let p = plan(&spec(MLP, 4, &strategy.replace("recompute: true", "recompute: false"), ADAM, 2));
    let report = train(&p, tempfile::tempdir().expect("tempdir").path());
    assert_eq!(report.weight_gathers.len(), 4);
    assert!(report.weight_gathers.values().all(|g| g == &vec![1, 1]), "{:?}", report.weight_gathers);
    // one stage per device: nothing to prefetch (the next pass is the same stage's)
    assert!(report.prefetched_gathers.values().all(|g| g == &vec![0, 0]), "{:?}", report.prefetched_gathers);
}

/// ZeRO-3's prefetch, the stage as the unit: on an interleaved pipeline each device holds
/// two chunks, and while one computes, the whole weights of the other, which the next pass
/// needs, are gathered on the communication thread. Trains like one device; every device
/// prefetched some of its gathers in each step, and a prefetched gather is still one gather.
#[test]
fn zero_3_prefetches_the_next_stages_weights_during_a_pass() {
    let strategy = "  stages: \"2-2\"\n  schedule: { kind: interleaved, virtual_stages: 2 }\n  microbatches: 4\n  recompute: true\n  zero: 3";
    for optimizer in [SGD, ADAM] {
        assert_trains_like(MLP, optimizer, (4, strategy), ONE_DEVICE);
    }
    let p = plan(&spec(MLP, 4, strategy, ADAM, 2));
    let report = train(&p, tempfile::tempdir().expect("tempdir").path());
    assert_eq!(report.prefetched_gathers.len(), 4, "{:?}", report.prefetched_gathers);
    for (d, prefetched) in &report.prefetched_gathers {
        let gathers = &report.weight_gathers[d];
        assert!(prefetched.iter().zip(gathers).all(|(p, g)| *p > 0 && p <= g), "{d}: {prefetched:?} of {gathers:?}");
    }
}

/// ZeRO-3 gathers each linear and LSTM weight and token embedding table for the product
/// reading it (FSDP's unit, the plan's layer; an LSTM's recurrent weight stays gathered
/// from one position's product to the next): in every forward, recompute and backward, a weight is
/// all-gathered before its product, the next one's gathered ahead while it runs, and both
/// dropped after the pass, so the stage's model holds one-value stand-ins for them and only
/// its biases and norms travel in the stage's gather. Each pass of a stage with n such
/// weights (a transformer block has 4, an LSTM 2) runs n gathers — a backward too, although the first
/// stage's lowest one needs none (a first layer's product needs no weight for an input
/// gradient, a lookup none for its table's gradient): the gather started ahead for it runs
/// unused, on every replica alike. (The later stage's backward is split; its input half is
/// the pass that reads the weights, its weight half reads none.) Trains like one device,
/// with and without recompute.
#[test]
fn zero_3_gathers_each_linear_weight_for_the_product_reading_it() {
    use pipec_plan::model::Op;
    use pipec_plan::Instr;
    let untied_lm = TIED_LM.replace(", tie=tokens", "");
    let lstm_lm = "  input: [12]\n  layers:\n    - embedding(20, 16)\n    - lstm(16, 16)\n    - lstm(16, 16)\n    - linear(16, 20)\n";
    for (model, optimizers) in [(MLP, [SGD, ADAM]), (untied_lm.as_str(), [SGD, SGD]), (lstm_lm, [SGD, ADAM])] {
        for recompute in [false, true] {
            let strategy =
                format!("  stages: \"2-2\"\n  schedule: gpipe\n  microbatches: 4\n  recompute: {recompute}\n  zero: 3");
            for optimizer in optimizers {
                assert_trains_like(model, optimizer, (4, &strategy), ONE_DEVICE);
            }
            let p = plan(&spec(model, 4, &strategy, optimizers[1], 2));
            let report = train(&p, tempfile::tempdir().expect("tempdir").path());
            for s in &p.stages {
                let weights: usize = (s.layers[0]..s.layers[1])
                    .map(|l| match p.layers[l].op {
                        Op::Linear { .. } | Op::Embedding { .. } => 1,
                        Op::Lstm { .. } => 2,
                        Op::TransformerBlock { .. } => 4,
                        _ => 0,
                    })
                    .sum();
                assert!(weights > 0, "{}", s.id);
                for d in &s.replicas {
                    let passes = p.streams[d]
                        .iter()
                        .filter(|i| {
                            i.stage() == s.id
                                && matches!(
                                    i,
                                    Instr::Forward { .. }
                                        | Instr::Recompute { .. }
                                        | Instr::Backward { .. }
                                        | Instr::BackwardInput { .. }
                                )
                        })
                        .count();
                    let per_step = (passes * weights) as u32;
                    assert_eq!(report.product_gathers.get(d), Some(&vec![per_step, per_step]), "{} on {d}", s.id);
                }
            }
        }
    }
    // the run says where it still gathers a stage's weights whole: not for linear layers,
    // blocks and an untied embedding, but for both ends of a tie (and beside tensor
    // parallelism)
    let says = |model: &str, strategy: &str| {
        let p = plan(&spec(model, 4, strategy, ADAM, 2));
        pipec_executor::caveats(&p).iter().any(|c| c.starts_with("under `zero: 3` the executor gathers"))
    };
    let dp = "  stages: \"4\"\n  schedule: dp-only\n  microbatches: 4\n  zero: 3";
    assert!(!says(MLP, dp));
    assert!(!says(&untied_lm, dp));
    assert!(says(TIED_LM, dp));
    assert!(says(MLP, "  stages: \"2\"\n  schedule: dp-only\n  microbatches: 4\n  tp: 2\n  zero: 3"));
}

/// Validation under ZeRO-3: the held-out forwards gather their weights as training's do —
/// per product for the linear weights and the untied token table, with the stage for the
/// rest — on every replica alike, and give one device's validation losses and accuracies
/// (a transformer LM on a `"2-2"` 1F1B pipeline).
#[test]
fn validation_under_zero_3_equals_one_device() {
    let model = TIED_LM.replace(", tie=tokens", "");
    let validated = |(devices, strategy): (usize, &str)| {
        let text = spec(&model, devices, strategy, SGD, 4)
            .replace("  seed: 5\n", "  seed: 5\n  validation: { every: 2, split: 0.5 }\n");
        let r = train(&plan(&text), tempfile::tempdir().expect("tempdir").path());
        let gathers = r.product_gathers.values().flatten().sum::<u32>();
        (
            r.steps.iter().filter_map(|s| s.validation.as_ref().map(|v| (v.loss, v.accuracy))).collect::<Vec<_>>(),
            gathers,
        )
    };
    let (one, _) = validated(ONE_DEVICE);
    let (got, gathers) = validated((4, "  stages: \"2-2\"\n  schedule: 1f1b\n  microbatches: 4\n  zero: 3"));
    assert!(gathers > 0);
    assert_eq!(one.len(), 2, "validation after steps 2 and 4");
    assert_eq!(one.len(), got.len());
    for ((a, x), (b, y)) in one.iter().zip(&got) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "validation loss {a} on one device, {b} under ZeRO-3");
        assert_eq!(x, y, "validation accuracy");
    }
}

/// ZeRO-3's gathers of stages' whole weights are in the plan (`in_pass.gathers`, by
/// instruction) and are the program: on a recomputed GPipe pipeline, an interleaved one
/// (gathers ahead), zero-bubble's split backward and beside tensor parallelism, each
/// device's step runs exactly the gathers and prefetches its plan declares. A replica whose
/// declaration drops a gather, or starts one at another pass, is refused by the verifier;
/// a declaration every replica shares that leaves a pass's weights missing, or gathers
/// weights that are here, stops the run at that pass.
#[test]
fn zero_3_stage_gathers_are_declared_verified_and_held_to() {
    use pipec_plan::in_pass::StageGather;
    let layouts = [
        (4, "  stages: \"2-2\"\n  schedule: gpipe\n  microbatches: 4\n  recompute: true\n  zero: 3"),
        (4, "  stages: \"2-2\"\n  schedule: { kind: interleaved, virtual_stages: 2 }\n  microbatches: 4\n  recompute: true\n  zero: 3"),
        (4, "  stages: \"2-2\"\n  schedule: zb-h1\n  microbatches: 4\n  zero: 3"),
        (8, "  stages: \"2-2\"\n  tp: 2\n  schedule: 1f1b\n  microbatches: 4\n  recompute: true\n  zero: 3"),
    ];
    for (devices, strategy) in layouts {
        let what = strategy.replace('\n', ";");
        let p = plan(&spec(MLP, devices, strategy, ADAM, 2));
        assert!(pipec_compiler::verification::verify_plan(&p).is_empty(), "{what}");
        let report = train(&p, tempfile::tempdir().expect("tempdir").path());
        for (d, stream) in &p.streams {
            let declared = p.in_pass.gathers_of(*d);
            assert!(!declared.is_empty(), "{what}: {d} declares no gathers");
            let ahead = declared.iter().filter(|g| stream[g.at as usize].stage() != g.stage).count() as u32;
            let n = declared.len() as u32;
            assert_eq!(report.weight_gathers.get(d), Some(&vec![n, n]), "{what}: {d}");
            assert_eq!(report.prefetched_gathers.get(d), Some(&vec![ahead, ahead]), "{what}: {d}");
        }
        // one replica's declaration with a gather dropped, or started at another pass
        let d1 = pipec_plan::DeviceId(1);
        let own = |edit: &dyn Fn(&mut Vec<StageGather>)| -> Plan {
            let mut p = p.clone();
            let mut list = p.in_pass.gathers_of(d1).to_vec();
            edit(&mut list);
            p.in_pass.gathers.insert(d1, p.in_pass.gather_lists.len() as u32);
            p.in_pass.gather_lists.push(list);
            p
        };
        let stream = &p.streams[&d1];
        let moved = |l: &mut Vec<StageGather>| {
            let g = l[0];
            let other = (0..stream.len())
                .find(|&j| {
                    j != g.at as usize
                        && stream[j].stage() == g.stage
                        && pipec_plan::in_pass::reads_weights(&stream[j])
                        && !l.iter().any(|x| x.at as usize == j)
                })
                .expect("another pass of the stage");
            l[0].at = other as u32;
            l.sort_by_key(|x| x.at);
        };
        for (how, edited) in [
            (
                "dropped",
                own(&|l| {
                    l.pop();
                }),
            ),
            ("moved", own(&moved)),
        ] {
            let problems = pipec_compiler::verification::verify_plan(&edited);
            assert!(
                problems.iter().any(|m| m.contains("must issue the same ones in the same order")),
                "{what}, {how}: {problems:?}"
            );
        }
        // every replica without its first gather: verified, but its pass finds no weights
        let mut short = p.clone();
        for list in &mut short.in_pass.gather_lists {
            list.remove(0);
        }
        assert!(pipec_compiler::verification::verify_plan(&short).is_empty(), "{what}");
        let e = match pipec_executor::run(&short, &RunOptions::default(), &mut |_| {}) {
            Ok(_) => panic!("{what}: a plan declaring fewer gathers than its passes need trained"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("whole weights are not here at this pass, where the plan declares no gather"),
            "{what}: {e}"
        );
        // every device gathering once more, at its first stage's next pass that declares
        // no gather: the weights are here (or on their way)
        let mut twice = p.clone();
        for (d, stream) in &p.streams {
            let mut list = p.in_pass.gathers_of(*d).to_vec();
            let first = list[0];
            let j = (first.at as usize + 1..stream.len())
                .find(|&j| {
                    stream[j].stage() == first.stage
                        && pipec_plan::in_pass::reads_weights(&stream[j])
                        && !list.iter().any(|x| x.at as usize == j)
                })
                .expect("a pass finding the weights");
            list.push(StageGather { at: j as u32, stage: first.stage });
            list.sort_by_key(|x| x.at);
            twice.in_pass.insert_gathers(*d, list);
        }
        assert!(pipec_compiler::verification::verify_plan(&twice).is_empty(), "{what}");
        let e = match pipec_executor::run(&twice, &RunOptions::default(), &mut |_| {}) {
            Ok(_) => panic!("{what}: a plan gathering weights that are here trained"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("where the plan declares a gather of them"), "{what}: {e}");
    }
}

/// ZeRO-3 on every synchronous schedule that runs replicated stages, with and without
/// recompute: each trains like one device, and each device runs exactly the gathers of
/// whole weights its plan declares (a missing or extra one stops the run, so a rule that
/// misread a schedule's order would fail here) — V-shaped and bidirectional schedules
/// holding two stages a device, the zero-bubble ones splitting their backwards.
#[test]
fn zero_3_gathers_hold_on_every_synchronous_schedule() {
    let schedules = [
        "gpipe",
        "1f1b",
        "{ kind: interleaved, virtual_stages: 2 }",
        "zb-h1",
        "zbv",
        "dualpipev",
        "dualpipe",
        "chimera",
    ];
    for schedule in schedules {
        for recompute in [false, true] {
            let strategy = format!(
                "  stages: \"2-2\"\n  schedule: {schedule}\n  microbatches: 8\n  recompute: {recompute}\n  zero: 3"
            );
            let p = assert_trains_like(MLP, ADAM, (4, &strategy), ONE_DEVICE);
            let report = train(&p, tempfile::tempdir().expect("tempdir").path());
            for d in p.streams.keys() {
                let n = p.in_pass.gathers_of(*d).len() as u32;
                assert!(n > 0, "{schedule}, recompute {recompute}: {d} declares no gathers");
                assert!(
                    report.weight_gathers.get(d).is_some_and(|g| g.iter().all(|x| *x == n)),
                    "{schedule}, recompute {recompute}: {d} ran {:?}, declared {n}",
                    report.weight_gathers.get(d)
                );
            }
        }
    }
}
