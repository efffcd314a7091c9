//! The executor's CubeCL path (the one a GPU runs: Burn's generic kernels, host staging,
//! integer and boolean tensors, every device on its own device client) trained on Burn's
//! wgpu backend over whatever Vulkan driver the machine has — in CI Mesa's software one
//! (lavapipe) — against the CPU's losses, step by step. Built only with `--features wgpu`
//! (scripts/test.sh); `pipec run` has no wgpu backend.
#![cfg(feature = "wgpu")]

use std::time::Duration;

use pipec_compiler::{compile, CompileOptions};
use pipec_executor::{RunOptions, RunReport};
use pipec_plan::Plan;

const STEPS: usize = 3;

/// A spec of `specs/`, its data read from there, with `edits` (text → replacement) made.
fn spec(name: &str, edits: &[(&str, &str)]) -> Plan {
    let mut text = std::fs::read_to_string(format!("specs/{name}.yaml")).expect("the spec");
    text = text.replace("path: data/", "path: specs/data/").replace("tokenizer: data/", "tokenizer: specs/data/");
    for (from, to) in edits {
        assert!(text.contains(from), "{name}: {from:?} is not in the spec");
        text = text.replace(from, to);
    }
    let checked = pipec_grammar::check_source(&text);
    let s = checked.spec.unwrap_or_else(|| panic!("{name}: {:?}", checked.diagnostics));
    compile(&s, &CompileOptions::default()).into_compiled().unwrap_or_else(|d| panic!("{name}: {d:?}")).plan
}

fn options() -> RunOptions {
    RunOptions { steps: Some(STEPS), timeout: Duration::from_secs(120), ..Default::default() }
}

fn losses(r: &RunReport) -> Vec<f64> {
    r.steps.iter().map(|s| s.loss).collect()
}

/// Trains `plan` on the CPU and on wgpu and holds every step's loss within `tolerance`
/// (relative).
fn equal_on_wgpu(name: &str, plan: &Plan, tolerance: f64) {
    let cpu = pipec_executor::run(plan, &options(), &mut |_| {}).unwrap_or_else(|e| panic!("{name} on the CPU: {e}"));
    let gpu = pipec_executor::run_wgpu(plan, &options(), &mut |_| {}).unwrap_or_else(|e| panic!("{name} on wgpu: {e}"));
    let (a, b) = (losses(&cpu), losses(&gpu));
    assert_eq!(a.len(), STEPS, "{name}");
    assert_eq!(a.len(), b.len(), "{name}");
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / x.abs().max(1e-6)).fold(0.0, f64::max);
    eprintln!("{name}: worst relative difference {worst:.2e} over {STEPS} steps");
    assert!(worst <= tolerance, "{name}: the CPU's losses {a:?}, wgpu's {b:?} ({worst:.2e} > {tolerance:.0e})");
}

#[test]
fn a_pipeline_of_gpt_blocks_with_a_tied_embedding_trains_to_the_cpus_numbers() {
    equal_on_wgpu("gpt-tiny", &spec("gpt-tiny", &[]), 1e-4);
}

#[test]
fn tensor_and_context_parallel_gpt_blocks_train_to_the_cpus_numbers() {
    let tp = spec("gpt-tiny", &[("stages: \"1-1\"", "stages: \"1\"\n  tp: 2")]);
    equal_on_wgpu("gpt-tiny tp 2", &tp, 1e-4);
    let ring = spec("gpt-tiny", &[("stages: \"1-1\"", "stages: \"1\"\n  cp: 2\n  cp_comm: ring")]);
    equal_on_wgpu("gpt-tiny cp 2 ring", &ring, 1e-4);
}

#[test]
fn experts_over_an_expert_parallel_pipeline_train_to_the_cpus_numbers() {
    equal_on_wgpu("moe-tiny", &spec("moe-tiny", &[]), 1e-4);
}

#[test]
fn convolutions_and_batch_norms_train_to_the_cpus_numbers() {
    equal_on_wgpu("resnet-small", &spec("resnet-small", &[]), 1e-3);
}

#[test]
fn zero_3_data_parallelism_trains_to_the_cpus_numbers() {
    let zero = spec(
        "data-parallel",
        &[("devices_per_node: 4", "devices_per_node: 2"), ("stages: \"4\"", "stages: \"2\"\n  zero: 3")],
    );
    equal_on_wgpu("data-parallel zero 3", &zero, 1e-5);
}

/// A dtype the device cannot compute in is refused before any worker starts, naming it;
/// where the driver has it, the run trains near fp32.
#[test]
fn a_plan_in_a_dtype_the_device_lacks_is_a_setup_error_naming_it() {
    let bf16 = spec("gpt-tiny", &[("  seed: 11", "  seed: 11\n  precision: bf16")]);
    match pipec_executor::run_wgpu(&bf16, &options(), &mut |_| {}) {
        Err(e) => {
            let why = e.to_string();
            assert!(e.device.is_none() && e.step.is_none(), "a worker's failure, not a setup error: {why}");
            assert!(why.contains("BF16") && why.contains("precision: fp32"), "{why}");
            eprintln!("bf16 refused: {why}");
        }
        Ok(r) => {
            let fp32 = pipec_executor::run(&bf16, &options(), &mut |_| {}).expect("the CPU");
            let (a, b) = (losses(&fp32), losses(&r));
            assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 2e-2 * x.abs()), "{a:?} vs {b:?}");
            eprintln!("bf16 trained: {a:?} on the CPU, {b:?} on wgpu");
        }
    }
}

/// A GPU's memory is measured on its device's pool (sampled after every instruction) and
/// reported beside the plan's peak: on wgpu every device has a figure, at least the weights
/// its stages hold and at most the plan's peak without its workspace reserve; on the CPU
/// none (its process memory is measured instead).
#[test]
fn each_device_reports_its_memory_pools_peak_beside_the_plans() {
    let plan = spec("gpt-tiny", &[]);
    let gpu = pipec_executor::run_wgpu(&plan, &options(), &mut |_| {}).expect("wgpu");
    assert_eq!(gpu.held.len(), 2, "{:?}", gpu.held);
    for (d, held) in &gpu.held {
        let pool = held.pool_peak.unwrap_or_else(|| panic!("{d}: no pool figure"));
        let m = &plan.devices[d.0 as usize].memory;
        let predicted = m.total - m.workspace;
        eprintln!(
            "{d}: pool peak {pool} B, the plan's peak without its workspace {predicted} B ({:.2})",
            pool as f64 / predicted as f64
        );
        assert!(pool >= 4 * held.weights, "{d}: the pool held {pool} B, less than its weights' {} B", 4 * held.weights);
        assert!(pool <= predicted, "{d}: the pool held {pool} B, more than the plan's {predicted} B");
    }
    let cpu = pipec_executor::run(&plan, &options(), &mut |_| {}).expect("the CPU");
    assert!(cpu.held.values().all(|h| h.pool_peak.is_none()), "{:?}", cpu.held);
}

/// Every example spec sized for a CPU (those of `specs/` with `kind: cpu` devices), trained
/// 2 steps on wgpu: each device's memory pool peak (CubeCL's bytes in use, sampled after
/// every instruction: weights, gradients, optimizer state, kept activations, transients) is
/// at most the plan's peak without its workspace reserve — the model counts at least what
/// the executor holds. Recompute inside the blocks too: by layers, by module and by
/// operation (`BlockRecompute::executor_halves`, which the plan counts for this executor).
#[test]
fn every_cpu_example_specs_devices_hold_at_most_the_plans_peak() {
    let mut worst = (String::new(), 0.0f64);
    let balanced = "  partition: balanced\n";
    let recompute = |policy: &'static str| -> &'static str {
        Box::leak(format!("{balanced}  recompute: {policy}\n").into_boxed_str())
    };
    // moe-tiny's experts on every replica (expert parallelism does not run beside recompute
    // inside the blocks yet)
    let moe = |policy: &'static str| -> Vec<(&'static str, &'static str)> {
        vec![("  ep: 2\n", Box::leak(format!("  recompute: {policy}\n").into_boxed_str()))]
    };
    for (name, edits) in [
        ("1f1b", vec![]),
        ("cnn", vec![]),
        ("csv-classifier", vec![]),
        ("data-parallel", vec![]),
        ("gpt-tiny", vec![]),
        // dropout inside the blocks: no mask kept (each backward draws it again)
        ("gpt-tiny", vec![("causal=true)", "causal=true, dropout=0.1)")]),
        ("llama-tiny", vec![]),
        ("llama-tiny", vec![(balanced, recompute("{ modules: [mlp] }"))]),
        ("llama-tiny", vec![(balanced, recompute("{ modules: [core_attn, layernorm] }"))]),
        ("llama-tiny", vec![(balanced, recompute("{ ops: [matmul, attention] }"))]),
        ("llama-tiny", vec![(balanced, recompute("{ layers: 1 }"))]),
        ("mlp-1f1b", vec![]),
        ("moe-tiny", vec![]),
        ("moe-tiny", moe("{ modules: [moe_act] }")),
        ("resnet-images", vec![]),
        ("resnet-small", vec![]),
        ("transformer", vec![]),
    ] {
        let plan = spec(name, &edits);
        let name = match edits.first() {
            Some((_, to)) => format!("{name} ({})", to.trim().rsplit('\n').next().unwrap_or_default().trim()),
            None => name.to_string(),
        };
        let name = name.as_str();
        let gpu = pipec_executor::run_wgpu(&plan, &RunOptions { steps: Some(2), ..options() }, &mut |_| {})
            .unwrap_or_else(|e| panic!("{name} on wgpu: {e}"));
        assert_eq!(gpu.held.len(), plan.devices.len(), "{name}: {:?}", gpu.held);
        for (d, held) in &gpu.held {
            let pool = held.pool_peak.unwrap_or_else(|| panic!("{name} {d}: no pool figure"));
            let m = &plan.devices[d.0 as usize].memory;
            let predicted = m.total - m.workspace;
            let share = pool as f64 / predicted as f64;
            eprintln!("{name} {d}: pool peak {pool} B, the plan's {predicted} B without its workspace ({share:.3})");
            assert!(pool <= predicted, "{name} {d}: the pool held {pool} B, more than the plan's {predicted} B");
            if share > worst.1 {
                worst = (format!("{name} {d}"), share);
            }
        }
    }
    eprintln!("closest to the plan's peak: {} at {:.3}", worst.0, worst.1);
}
