//! The training recipe beside the optimizer — a learning-rate schedule (linear warm-up,
//! cosine decay to a floor), clipping of the global gradient norm, shuffled epochs and
//! validation on held-out data — on every schedule family and layout: each trains to one
//! device's losses, norms and validation figures with clipping that really clips, a resume
//! mid-schedule continues it exactly, and the metrics say the learning rate, the norm, the
//! epoch and the held-out loss and accuracy.

use std::path::Path;
use std::time::Duration;

use pipec_compiler::{compile, CompileOptions};
use pipec_executor::{RunOptions, RunReport};
use pipec_plan::Plan;

const MLP: &str =
    "  input: [16]\n  layers:\n    - linear(16, 32) -> relu\n    - repeat 4: linear(32, 32) -> relu\n    - linear(32, 4)\n";
const RECIPE: &str = "  lr_schedule: { warmup: 2, decay: cosine, min_lr: 0.0005 }\n  clip_grad_norm: 0.5\n  shuffle: true\n  validation: { every: 4, split: 0.34 }\n";
const ADAM: &str = "{ kind: adamw, lr: 0.005, weight_decay: 0.01 }";
const MOMENTUM: &str = "{ kind: momentum, lr: 0.05, momentum: 0.9 }";

fn spec(model: &str, devices: usize, strategy: &str, optimizer: &str, steps: usize) -> String {
    format!(
        "name: recipe\nmodel:\n{model}  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n{strategy}\ntraining:\n  batch_size: 32\n  steps: {steps}\n  optimizer: {optimizer}\n  seed: 5\n{RECIPE}  checkpoint: {{ every: 4 }}\n  data: {{ kind: synthetic, samples: 96 }}\n"
    )
}

fn plan(text: &str) -> Plan {
    let checked = pipec_grammar::check_source(text);
    let s = checked.spec.unwrap_or_else(|| panic!("bad spec {:?}\n{text}", checked.diagnostics));
    compile(&s, &CompileOptions::default()).into_compiled().unwrap_or_else(|d| panic!("{d:?}\n{text}")).plan
}

fn train(p: &Plan, dir: &Path, resume: Option<&Path>) -> RunReport {
    let options = RunOptions {
        timeout: Duration::from_secs(60),
        checkpoint_dir: Some(dir.to_path_buf()),
        resume: resume.map(|r| pipec_executor::Resume::Dir(r.to_path_buf())),
        ..Default::default()
    };
    pipec_executor::run(p, &options, &mut |_| {}).unwrap_or_else(|e| panic!("run failed: {e}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * a.abs().max(1e-6)
}

const ONE_DEVICE: (usize, &str) = (1, "  stages: \"1\"\n  schedule: gpipe\n  microbatches: 4");

/// Every synchronous schedule family, a replicated layout, ZeRO and tensor parallelism:
/// the same losses and global norms as one device, with warm-up and cosine decay, clipping
/// that clips (the norms are above 0.5) and shuffled epochs; the metrics carry the
/// schedule's learning rate and the epoch.
#[test]
fn every_layout_trains_like_one_device_with_the_recipe() {
    let layouts: [(usize, &str); 8] = [
        (4, "  stages: straight\n  schedule: gpipe\n  microbatches: 4"),
        (3, "  stages: straight\n  schedule: 1f1b\n  microbatches: 8"),
        (2, "  stages: straight\n  schedule: { kind: interleaved, virtual_stages: 2 }\n  microbatches: 4"),
        (2, "  stages: straight\n  schedule: zb-h1\n  microbatches: 4"),
        (4, "  stages: straight\n  schedule: chimera\n  microbatches: 8"),
        (4, "  stages: \"2-2\"\n  schedule: 1f1b\n  microbatches: 4\n  zero: 2"),
        (4, "  stages: \"1-1\"\n  tp: 2\n  schedule: 1f1b\n  microbatches: 4"),
        (4, "  stages: \"4\"\n  schedule: dp-only\n  microbatches: 4"),
    ];
    for optimizer in [ADAM, MOMENTUM] {
        let dir = tempfile::tempdir().expect("tempdir");
        let reference = train(&plan(&spec(MLP, ONE_DEVICE.0, ONE_DEVICE.1, optimizer, 8)), dir.path(), None);
        let norms: Vec<f64> = reference.steps.iter().map(|s| s.grad_norm.expect("a norm")).collect();
        assert!(norms.iter().filter(|n| **n > 0.5).count() >= 4, "the clipping clips: {norms:?}");
        let peak = if optimizer == MOMENTUM { 0.05 } else { 0.005 };
        for (step, m) in reference.steps.iter().enumerate() {
            // warm-up over 2 steps, then a cosine to 0.0005 at step 8 (the run's steps)
            let s = step as f64;
            let want = if step < 2 {
                peak * s / 2.0
            } else {
                0.0005 + (peak - 0.0005) * 0.5 * (1.0 + (std::f64::consts::PI * (s - 2.0) / 6.0).cos())
            };
            assert!((m.lr - want).abs() < 1e-12, "step {step}: lr {} against {want}", m.lr);
            // 96 samples, 32 held out: 64 to train on, 2 steps an epoch
            assert!((m.epoch.expect("an epoch") - (step + 1) as f64 / 2.0).abs() < 1e-12);
            // validation after steps 3 and 7 (every 4, and the last)
            assert_eq!(m.validation.is_some(), step == 3 || step == 7, "step {step}");
        }
        for (i, (devices, strategy)) in layouts.iter().enumerate() {
            let got = train(&plan(&spec(MLP, *devices, strategy, optimizer, 8)), &dir.path().join(i.to_string()), None);
            for (a, b) in reference.steps.iter().zip(&got.steps) {
                assert!(close(a.loss, b.loss), "{strategy}: step {}: {} vs {}", a.step, a.loss, b.loss);
                let (x, y) = (a.grad_norm.expect("a norm"), b.grad_norm.expect("a norm"));
                assert!(close(x, y), "{strategy}: step {}: norm {x} vs {y}", a.step);
                match (a.validation, b.validation) {
                    (None, None) => {}
                    (Some(u), Some(v)) => assert!(
                        close(u.loss, v.loss) && u.accuracy == v.accuracy,
                        "{strategy}: step {}: validation {u:?} vs {v:?}",
                        a.step
                    ),
                    other => panic!("{strategy}: step {}: validation {other:?}", a.step),
                }
            }
            let last = got.steps.last().expect("steps");
            assert!(last.loss < got.steps[0].loss, "{strategy}: the loss did not fall");
        }
    }
}

/// A resume from the middle of the warm-up-and-decay continues the schedule, the sample
/// order and the clipping exactly: the same losses and norms as the uninterrupted run.
#[test]
fn a_resume_mid_schedule_continues_it_exactly() {
    for (devices, strategy) in [ONE_DEVICE, (4, "  stages: \"2-2\"\n  schedule: 1f1b\n  microbatches: 4\n  zero: 1")] {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = plan(&spec(MLP, devices, strategy, ADAM, 8));
        let full = train(&p, &dir.path().join("full"), None);
        let resumed = train(&p, &dir.path().join("resumed"), Some(&dir.path().join("full/step-000004")));
        assert_eq!(resumed.steps.first().map(|s| s.step), Some(4));
        for (a, b) in full.steps[4..].iter().zip(&resumed.steps) {
            assert_eq!(
                (a.loss, a.grad_norm, a.lr, a.validation.map(|v| v.loss)),
                (b.loss, b.grad_norm, b.lr, b.validation.map(|v| v.loss)),
                "{strategy}: step {}",
                a.step
            );
        }
    }
}

/// Shuffling draws every sample once per epoch in an order of its own: the run differs
/// from the one in file order, and two epochs of 96 samples in batches of 32 are 6 steps.
#[test]
fn shuffled_epochs_differ_from_file_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = spec(MLP, 1, ONE_DEVICE.1, ADAM, 6);
    let shuffled = train(&plan(&text), &dir.path().join("a"), None);
    let ordered = train(&plan(&text.replace("  shuffle: true\n", "")), &dir.path().join("b"), None);
    // 96 samples, 32 held out for validation: 64 to train on, 2 steps an epoch
    assert_eq!(shuffled.steps.last().and_then(|s| s.epoch), Some(3.0));
    assert_ne!(
        shuffled.steps.iter().map(|s| s.loss).collect::<Vec<_>>(),
        ordered.steps.iter().map(|s| s.loss).collect::<Vec<_>>()
    );
}

/// Under an asynchronous schedule each update clips by its own stage's norm: no global
/// norm is summed (none reported), and training still converges.
#[test]
fn pipedream_clips_each_stage_by_its_own_norm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = plan(&spec(MLP, 4, "  stages: \"2-1-1\"\n  schedule: pipedream\n  microbatches: 4", ADAM, 8));
    assert!(!p
        .streams
        .values()
        .flatten()
        .any(|i| matches!(i, pipec_plan::Instr::Collective { payload: pipec_plan::CollectivePayload::GradNorm, .. })));
    let r = train(&p, dir.path(), None);
    assert!(r.steps.iter().all(|s| s.grad_norm.is_none()));
    assert!(r.steps.last().expect("steps").loss < r.steps[0].loss);
}

/// Validation runs forwards only, with dropout off and batch normalisation on its running
/// statistics: a model with both gives one device's held-out loss on a pipeline with a
/// replicated stage (the statistics folded from the replicas); evaluating after the same
/// training gives the same loss whatever comes later (no dropout mask is drawn, nothing is
/// trained).
#[test]
fn validation_evaluates_with_running_statistics_and_no_dropout() {
    let model = "  input: [2, 6, 6]\n  layers:\n    - conv2d(2, 4, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n    - dropout(0.3)\n    - conv2d(4, 4, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n    - adaptive_avgpool2d -> flatten -> linear(4, 4)\n";
    let dir = tempfile::tempdir().expect("tempdir");
    let one = train(&plan(&spec(model, 1, ONE_DEVICE.1, ADAM, 8)), &dir.path().join("one"), None);
    let piped = train(
        &plan(&spec(model, 3, "  stages: \"2-1\"\n  schedule: 1f1b\n  microbatches: 4", ADAM, 8)),
        &dir.path().join("piped"),
        None,
    );
    let held = |r: &RunReport| -> Vec<f64> { r.steps.iter().filter_map(|s| s.validation.map(|v| v.loss)).collect() };
    let (a, b) = (held(&one), held(&piped));
    assert_eq!(a.len(), 2);
    assert!(a.iter().zip(&b).all(|(x, y)| close(*x, *y)), "{a:?} vs {b:?}");
    // the first 4 of the 8 steps (the same schedule: it decays over 8 steps), evaluated
    let text = spec(model, 1, ONE_DEVICE.1, ADAM, 8)
        .replace("  steps: 8\n", "  steps: 4\n")
        .replace("min_lr: 0.0005 }", "min_lr: 0.0005, decay_steps: 8 }");
    let four = train(&plan(&text), &dir.path().join("four"), None);
    assert_eq!(held(&four), vec![a[0]]);
}
