//! One process per device on Open MPI (`--features mpi`): the same plan gives exactly the
//! in-process losses; a failing or killed rank ends the job with a non-zero exit within a
//! bounded time; a wrong `-np` is an error on every rank, not a hang.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

fn pipec() -> &'static str {
    env!("CARGO_BIN_EXE_pipec")
}

/// `pipec`, planned with the specs' own device figures (no measurement of this machine's CPU).
fn pipec_command() -> Command {
    let mut c = Command::new(pipec());
    c.env("PIPEC_CPU_CALIBRATION", "off");
    c
}

const CHAIN: &str =
    "  layers:\n    - linear(16, 32) -> relu\n    - repeat 4: linear(32, 32) -> relu\n    - linear(32, 4)\n";

/// Residual blocks: a boundary inside a block carries two tensors in one message.
const RESIDUAL: &str = "  blocks:\n    res(n):\n      - linear(n, n) -> relu as h\n      - h -> linear(n, n) as g\n      - add(g, in) -> relu\n  layers:\n    - linear(16, 32) -> relu\n    - repeat 3: res(32)\n    - linear(32, 4)\n";

fn spec(stages: &str, devices: usize, steps: usize) -> String {
    spec_of(CHAIN, stages, devices, steps)
}

/// Batch normalisation in residual blocks on [2, 6, 6] images: a replicated stage
/// all-reduces the batch statistics with its gradients.
const BATCH_NORM: &str = "  input: [2, 6, 6]\n  blocks:\n    res(c):\n      - conv2d(c, c, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n      - conv2d(c, c, k=3, pad=1, bias=false) -> batchnorm2d as branch\n      - add(branch, in) -> relu\n  layers:\n    - conv2d(2, 4, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n    - repeat 2: res(4)\n    - adaptive_avgpool2d -> flatten -> linear(4, 4)\n";

/// A causal language model whose output layer is tied to its embedding: on two stages the
/// tied gradient is summed across the ranks (`tiedallreduce`).
const TIED_LM: &str = "  input: [12]\n  layers:\n    - embedding(20, 16) as tokens\n    - transformer_block(d=16, heads=2, ff=32, causal=true)\n    - layernorm\n    - linear(16, 20, bias=false, tie=tokens)\n";

/// A language model of mixture-of-experts blocks (a shared expert, a capacity, the
/// load-balancing loss): its aux loss and token counts gathered from every rank.
const MOE_LM: &str = "  input: [12]\n  layers:\n    - embedding(20, 16)\n    - repeat 2: transformer_block(d=16, heads=2, ff=32, causal=true, experts=4, top_k=2, shared_experts=1, capacity=1.0, aux_loss=0.01)\n    - layernorm\n    - linear(16, 20, bias=false)\n";

/// A spec training `model` (its `input` line, or `[16]`).
fn spec_of(model: &str, stages: &str, devices: usize, steps: usize) -> String {
    let input = if model.starts_with("  input:") { "" } else { "  input: [16]\n" };
    format!(
        "name: mpi-test\nmodel:\n{input}{model}  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n  stages: {stages}\n  schedule: 1f1b\n  microbatches: 8\ntraining:\n  batch_size: 32\n  steps: {steps}\n  optimizer: {{ kind: adam, lr: 0.005 }}\n  seed: 3\n  data: {{ kind: synthetic, samples: 96 }}\n"
    )
}

fn mpirun(np: usize, args: &[&str]) -> Output {
    Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string(), pipec()])
        .args(args)
        .output()
        .expect("mpirun runs")
}

fn losses(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["loss"].as_f64().expect("loss"))
        .collect()
}

/// A run's `metrics.jsonl`, a value per line.
fn metric_lines(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect()
}

/// Runs the spec at `spec_path` in one process into `threads` and as `devices` MPI ranks
/// into `mpi`; both must succeed.
fn run_in_process_and_over_mpi(spec_path: &Path, devices: usize, threads: &Path, mpi: &Path) {
    let out = pipec_command()
        .args(["run", spec_path.to_str().expect("p"), "-o", threads.to_str().expect("p")])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out =
        mpirun(devices, &["run", spec_path.to_str().expect("p"), "--transport", "mpi", "-o", mpi.to_str().expect("p")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

fn equal_to_in_process(stages: &str, devices: usize) {
    equal_to_in_process_for(CHAIN, stages, devices)
}

fn equal_to_in_process_for(model: &str, stages: &str, devices: usize) {
    equal_to_in_process_with(model, stages, devices, "1f1b")
}

/// [`equal_to_in_process_for`] under `schedule`.
fn equal_to_in_process_with(model: &str, stages: &str, devices: usize, schedule: &str) {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    let text = spec_of(model, stages, devices, 4)
        .replace("  seed: 3\n", "  seed: 3\n  checkpoint: { every: 4 }\n")
        .replace("schedule: 1f1b", &format!("schedule: {schedule}"));
    std::fs::write(&spec_path, text).expect("write");
    let threads = dir.path().join("threads");
    let out = pipec_command()
        .args(["run", spec_path.to_str().expect("p"), "-o", threads.to_str().expect("p")])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let mpi = dir.path().join("mpi");
    let out =
        mpirun(devices, &["run", spec_path.to_str().expect("p"), "--transport", "mpi", "-o", mpi.to_str().expect("p")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let (a, b) = (losses(&threads), losses(&mpi));
    assert_eq!(a.len(), 4);
    assert_eq!(a, b, "MPI losses differ from the in-process run");
    // and a mixture of experts' load-balancing loss and token counts
    let column = |run: &Path, key: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .expect("metrics")
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")[key].clone())
            .collect()
    };
    for key in ["aux_loss", "expert_tokens"] {
        assert_eq!(column(&threads, key), column(&mpi, key), "MPI's {key} differs from the in-process run");
    }
    // the measured trace covers every rank's every step
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(mpi.join("trace.json")).expect("trace")).expect("json");
    let seen: std::collections::BTreeSet<(u64, u64)> = trace["traceEvents"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| (e["tid"].as_u64().expect("tid"), e["args"]["step"].as_u64().expect("step")))
        .collect();
    assert_eq!(seen.len(), devices * 4, "every device's 4 steps: {seen:?}");
    // the same weights (and running statistics) at the end, bit for bit
    let weights =
        |run: &Path| std::fs::read(run.join("checkpoints/step-000004/model.safetensors")).expect("checkpoint");
    assert!(weights(&threads) == weights(&mpi), "MPI weights differ from the in-process run");
}

#[test]
fn four_rank_1f1b_equals_in_process_exactly() {
    equal_to_in_process("straight", 4);
}

#[test]
fn a_graph_model_over_mpi_equals_in_process_exactly() {
    // both cuts fall inside residual blocks: each boundary carries the block's input and
    // the branch's activation in one message (and both gradients back)
    equal_to_in_process_for(RESIDUAL, "straight\n  partition: [\"0..5\", \"5..9\", \"9..\"]", 3);
}

#[test]
fn batch_norm_with_a_replicated_stage_over_mpi_equals_in_process_exactly() {
    equal_to_in_process_for(BATCH_NORM, "\"2-1\"", 3);
}

#[test]
fn a_mixture_of_experts_over_mpi_equals_in_process_exactly() {
    equal_to_in_process_for(MOE_LM, "\"2-2\"", 4);
}

#[test]
fn expert_parallelism_over_mpi_equals_in_process_exactly() {
    // tokens exchanged between processes inside every pass: a pipeline of two stages, each
    // with an expert group of its two replicas; one stage over an expert group of four
    equal_to_in_process_for(MOE_LM, "\"2-2\"\n  ep: 2", 4);
    // with each expert split over tensor-parallel ranks (no biases, no balancing loss)
    let moe_tp = MOE_LM.replace(", capacity=1.0, aux_loss=0.01)", ", capacity=1.0, bias=false)");
    equal_to_in_process_for(&moe_tp, "\"2\"\n  tp: 2\n  ep: 2", 4);
    // and with ZeRO-2's shards beside the experts
    equal_to_in_process_for(MOE_LM, "\"2-2\"\n  ep: 2\n  zero: 2", 4);
    equal_to_in_process_for(MOE_LM, "\"4\"\n  ep: 2\n  zero: 3", 4);
    // experts under context parallelism: the capacity and the balancing loss count the
    // whole microbatch's tokens, the members' routing counts exchanged
    equal_to_in_process_for(MOE_LM, "\"1\"\n  cp: 2", 2);
    // and an expert group drawn from two context-parallel groups' members
    equal_to_in_process_with(MOE_LM, "\"2\"\n  cp: 2\n  ep: 4", 4, "gpipe");
    equal_to_in_process_with(MOE_LM, "\"4\"\n  ep: 4", 4, "gpipe");
    equal_to_in_process_with(MOE_LM, "\"2-2\"\n  ep: 2", 4, "dualpipev");
    equal_to_in_process_with(MOE_LM, "\"2-2\"\n  ep: 2", 4, "dualpipe");
}

/// Recompute inside the blocks over MPI: the collectives its backward makes again cross the
/// processes — expert parallelism's dispatch and combine, ZeRO-3's gathers, context
/// parallelism's keys and values, tensor parallelism's all-reduces — to the same numbers as
/// in one process.
#[test]
fn recompute_inside_the_blocks_over_mpi_equals_in_process_exactly() {
    equal_to_in_process_for(MOE_LM, "\"2-2\"\n  ep: 2\n  recompute: { modules: [moe_act] }", 4);
    equal_to_in_process_with(MOE_LM, "\"4\"\n  ep: 2\n  zero: 3\n  recompute: { layers: 1 }", 4, "gpipe");
    equal_to_in_process_for(TIED_LM, "\"1-1\"\n  cp: 2\n  recompute: { modules: [layernorm] }", 4);
    let moe_tp = MOE_LM.replace(", capacity=1.0, aux_loss=0.01)", ", capacity=1.0, bias=false)");
    equal_to_in_process_for(&moe_tp, "\"2\"\n  tp: 2\n  ep: 2\n  recompute: { ops: [matmul] }", 4);
}

#[test]
fn context_parallelism_over_mpi_equals_in_process_exactly() {
    // keys and values gathered between processes inside every attention (and their
    // gradients sent back): a pipeline of two stages, each split over two members
    // ("1-1" with cp 2: 4 devices), one stage over a group of three, and two data-parallel
    // replicas of a group of two
    equal_to_in_process_for(TIED_LM, "\"1-1\"\n  cp: 2", 4);
    equal_to_in_process_with(TIED_LM, "\"1\"\n  cp: 3", 3, "gpipe");
    equal_to_in_process_with(TIED_LM, "\"2\"\n  cp: 2", 4, "gpipe");
    // and around the ring (`cp_comm: ring`): blocks passed to the next member in the
    // forward, gathered and their gradients scattered back in the backward
    equal_to_in_process_for(TIED_LM, "\"1-1\"\n  cp: 2\n  cp_comm: ring", 4);
    equal_to_in_process_with(TIED_LM, "\"1\"\n  cp: 3\n  cp_comm: ring", 3, "gpipe");
}

#[test]
fn a_tied_language_model_over_mpi_equals_in_process_exactly() {
    equal_to_in_process_for(TIED_LM, "straight", 2);
}

#[test]
fn flush_free_pipedream_over_mpi_equals_in_process_exactly() {
    // one continuous pipeline across the four steps, the replicated first stage
    // all-reducing after every update
    equal_to_in_process_with(CHAIN, "\"2-1-1\"", 4, "pipedream");
}

#[test]
fn every_zero_level_over_mpi_equals_in_process_exactly() {
    // the reduce-scatters, the shards' updates and the weights' all-gathers on the MPI
    // transport, and the checkpoint joined from the shards over it
    for zero in 1..=3 {
        equal_to_in_process(&format!("\"2-2\"\n  zero: {zero}"), 4);
        // and each bucket's reduce-scatter started inside the backward
        equal_to_in_process(&format!("\"2-2\"\n  zero: {zero}\n  bucket: 1KiB"), 4);
    }
}

/// Each rank of a ZeRO-3 run reports the model state its device held and its resident
/// memory (from before its stages were built to the run's peak) beside the plan's figures.
#[test]
fn each_rank_of_a_zero_3_run_reports_its_memory_beside_the_prediction() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("\"4\"\n  zero: 3", 4, 2).replace("schedule: 1f1b", "schedule: dp-only"))
        .expect("write");
    let out_dir = dir.path().join("out");
    let out =
        mpirun(4, &["run", spec_path.to_str().expect("p"), "--transport", "mpi", "-o", out_dir.to_str().expect("p")]);
    // the report is rank 0's standard output
    let stderr = format!("{}{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let section = |title: &str| -> Vec<String> {
        stderr
            .lines()
            .skip_while(|l| !l.starts_with(title))
            .skip(1)
            .take_while(|l| l.starts_with("  d"))
            .map(str::to_string)
            .collect()
    };
    let resident = section("resident memory per process running one device");
    assert_eq!(resident.len(), 4, "one line per rank: {stderr}");
    for (d, line) in resident.iter().enumerate() {
        assert!(
            line.starts_with(&format!("  d{d} ")) && line.contains("predicted") && line.contains("measured/predicted"),
            "{line}"
        );
    }
    let held = section("model state held per device");
    assert_eq!(held.len(), 4, "{stderr}");
}

/// The training recipe over MPI: the global gradient norm summed over the ranks (with ZeRO's
/// shards and tensor-parallel shards), warm-up and cosine decay, shuffled epochs — the same
/// losses, norms, validation losses and weights as the in-process run, bit for bit.
#[test]
fn the_training_recipe_over_mpi_equals_in_process_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    for (i, (stages, devices)) in [("\"2-2\"\n  zero: 2", 4), ("\"1-1\"\n  tp: 2", 4)].into_iter().enumerate() {
        let spec_path = dir.path().join(format!("spec{i}.yaml"));
        let text = spec(stages, devices, 6).replace(
            "  seed: 3\n",
            "  seed: 3\n  lr_schedule: { warmup: 2, decay: cosine, min_lr: 0.0005 }\n  clip_grad_norm: 0.5\n  shuffle: true\n  validation: { every: 3, split: 0.34 }\n  checkpoint: { every: 6 }\n",
        );
        std::fs::write(&spec_path, text).expect("write");
        let (threads, mpi) = (dir.path().join(format!("threads{i}")), dir.path().join(format!("mpi{i}")));
        run_in_process_and_over_mpi(&spec_path, devices, &threads, &mpi);
        let lines = |run: &Path| -> Vec<(f64, f64, f64, Option<f64>)> {
            metric_lines(run)
                .iter()
                .map(|v| {
                    let (loss, norm) = (v["loss"].as_f64().expect("loss"), v["grad_norm"].as_f64().expect("norm"));
                    (loss, norm, v["lr"].as_f64().expect("lr"), v["val_loss"].as_f64())
                })
                .collect()
        };
        let (threads_lines, mpi_lines) = (lines(&threads), lines(&mpi));
        assert_eq!(threads_lines.iter().filter(|l| l.3.is_some()).count(), 2, "validation on steps 3 and 6");
        assert_eq!(threads_lines, mpi_lines, "{stages}");
        let weights =
            |run: &Path| std::fs::read(run.join("checkpoints/step-000006/model.safetensors")).expect("checkpoint");
        assert!(weights(&threads) == weights(&mpi), "{stages}: MPI weights differ from the in-process run");
    }
}

/// fp16 over MPI: the products in fp16, the loss scaled, the norm every update waits for
/// summed over the ranks — every step's loss, norm and scale, the final weights and the
/// scale a checkpoint keeps are the in-process run's, on a ZeRO-2 pipeline and on tensor
/// parallelism.
#[test]
fn fp16_with_loss_scaling_over_mpi_equals_in_process_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    for (i, (stages, devices)) in [("\"2-2\"\n  zero: 2", 4), ("\"1-1\"\n  tp: 2", 4)].into_iter().enumerate() {
        let spec_path = dir.path().join(format!("spec{i}.yaml"));
        let text = spec(stages, devices, 4)
            .replace("  seed: 3\n", "  seed: 3\n  precision: fp16\n  checkpoint: { every: 4 }\n");
        std::fs::write(&spec_path, text).expect("write");
        let (threads, mpi) = (dir.path().join(format!("threads{i}")), dir.path().join(format!("mpi{i}")));
        run_in_process_and_over_mpi(&spec_path, devices, &threads, &mpi);
        let lines = |run: &Path| -> Vec<(f64, f64, f64, bool)> {
            metric_lines(run)
                .iter()
                .map(|v| {
                    let (loss, norm) = (v["loss"].as_f64().expect("loss"), v["grad_norm"].as_f64().expect("norm"));
                    (loss, norm, v["loss_scale"].as_f64().expect("scale"), v["skipped"].as_bool().expect("skipped"))
                })
                .collect()
        };
        let (threads_lines, mpi_lines) = (lines(&threads), lines(&mpi));
        assert!(threads_lines.iter().all(|l| l.2 == 65536.0 && !l.3), "{threads_lines:?}");
        assert_eq!(threads_lines, mpi_lines, "{stages}");
        let file =
            |run: &Path, f: &str| std::fs::read(run.join("checkpoints/step-000004").join(f)).expect("checkpoint");
        assert!(file(&threads, "model.safetensors") == file(&mpi, "model.safetensors"), "{stages}: weights differ");
        let scale = |run: &Path| -> serde_json::Value {
            serde_json::from_slice::<serde_json::Value>(&file(run, "state.json")).expect("json")["loss_scale"].clone()
        };
        assert_eq!(scale(&threads), serde_json::json!({ "scale": 65536.0, "good_steps": 4 }));
        assert_eq!(scale(&threads), scale(&mpi), "{stages}");
    }
}

/// Gradients reduced in bf16 (`grad_precision: bf16`) over MPI: every partial sum rounded
/// in the same ring order as in one process — every step's loss and the final weights
/// bit-identical — on replicas (all-reduce), with batch statistics beside the gradients
/// under ZeRO-2 (reduce-scatter), and in gradient buckets.
#[test]
fn gradients_reduced_in_bf16_over_mpi_equal_in_process_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    let cases = [(CHAIN, "\"4\"", 4), (BATCH_NORM, "\"2-1\"\n  zero: 2", 3), (CHAIN, "\"2-2\"\n  bucket: 1KiB", 4)];
    for (i, (model, stages, devices)) in cases.into_iter().enumerate() {
        let spec_path = dir.path().join(format!("spec{i}.yaml"));
        let text = spec_of(model, stages, devices, 4).replace(
            "  seed: 3\n",
            "  seed: 3\n  precision: bf16\n  grad_precision: bf16\n  checkpoint: { every: 4 }\n",
        );
        std::fs::write(&spec_path, text).expect("write");
        let (threads, mpi) = (dir.path().join(format!("threads{i}")), dir.path().join(format!("mpi{i}")));
        run_in_process_and_over_mpi(&spec_path, devices, &threads, &mpi);
        assert_eq!(losses(&threads), losses(&mpi), "{stages}");
        let weights =
            |run: &Path| std::fs::read(run.join("checkpoints/step-000004/model.safetensors")).expect("checkpoint");
        assert!(weights(&threads) == weights(&mpi), "{stages}: MPI weights differ from the in-process run");
    }
}

#[test]
fn zero_with_tied_weights_and_batch_statistics_over_mpi_equals_in_process_exactly() {
    equal_to_in_process_for(TIED_LM, "\"2-2\"\n  zero: 2", 4);
    equal_to_in_process_for(BATCH_NORM, "\"2-1\"\n  zero: 3", 3);
    // ZeRO-3 on an interleaved pipeline that recomputes: each pass prefetches the other
    // chunk's whole weights on the communication thread, in step on every replica
    equal_to_in_process_with(
        CHAIN,
        "\"2-2\"\n  zero: 3\n  recompute: true",
        4,
        "{ kind: interleaved, virtual_stages: 2 }",
    );
}

#[test]
fn pipedream_2_1_1_with_replica_all_reduce_equals_in_process_exactly() {
    equal_to_in_process("\"2-1-1\"", 4);
}

#[test]
fn a_wrong_process_count_is_an_error_on_every_rank() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("straight", 4, 2)).expect("write");
    let start = Instant::now();
    let out = mpirun(
        3,
        &["run", spec_path.to_str().expect("p"), "--transport", "mpi", "-o", dir.path().join("o").to_str().expect("p")],
    );
    assert_ne!(out.status.code(), Some(0));
    assert!(start.elapsed() < Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("mpirun started 3 processes") && err.contains("-np 4"), "{err}");
}

#[test]
fn a_failing_rank_aborts_the_job_with_its_device_and_instruction() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("straight", 4, 3)).expect("write");
    let plan_dir = dir.path().join("plan");
    let out = pipec_command()
        .args(["compile", spec_path.to_str().expect("p"), "-o", plan_dir.to_str().expect("p")])
        .output()
        .expect("compiles");
    assert_eq!(out.status.code(), Some(0));
    // break the plan: device 1 never sends its first activation
    let mut plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plan_dir.join("plan.json")).expect("plan")).expect("json");
    let stream = plan["streams"]["1"].as_array_mut().expect("d1 stream");
    let i = stream.iter().position(|x| x["op"] == "send_activation").expect("a send");
    stream.remove(i);
    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, serde_json::to_string(&plan).expect("json")).expect("write");
    let start = Instant::now();
    // `pipec run` would refuse the plan statically; --no-verify lets the ranks run into it
    let out = mpirun(
        4,
        &[
            "run",
            broken.to_str().expect("p"),
            "--no-verify",
            "--transport",
            "mpi",
            "--timeout",
            "3",
            "-o",
            dir.path().join("o").to_str().expect("p"),
        ],
    );
    assert_ne!(out.status.code(), Some(0));
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank ") && err.contains("device d") && err.contains("recv_act"), "{err}");
}

#[test]
fn a_killed_rank_ends_the_job() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("straight", 2, 100000)).expect("write");
    let marker: PathBuf = dir.path().join("killme");
    let mut child = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "2",
            pipec(),
            "run",
            spec_path.to_str().expect("p"),
            "--transport",
            "mpi",
            "-o",
            marker.to_str().expect("p"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    std::thread::sleep(Duration::from_secs(3));
    let killed = Command::new("pkill").args(["-9", "-n", "-f", marker.to_str().expect("p")]).status().expect("pkill");
    assert!(killed.success(), "no rank to kill");
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            assert!(!status.success());
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the job did not end after a rank was killed");
        std::thread::sleep(Duration::from_millis(100));
    }
    // rank 0 appended every completed step as it came: the kill loses none of them
    let lines = std::fs::read_to_string(marker.join("metrics.jsonl")).unwrap_or_default();
    assert!(lines.lines().count() >= 1, "the completed steps' metrics were lost");
}

/// Runs `layout` on `ranks` MPI processes with a checkpoint every 2 steps, checks that the
/// step-2 checkpoint holds `files`, resumes from it on MPI and asserts that the resumed
/// losses are the uninterrupted run's.
fn checkpoint_and_resume_over_mpi(layout: &str, ranks: usize, files: &[String]) {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    let text = spec(layout, ranks, 4).replace("  seed: 3\n", "  seed: 3\n  checkpoint: { every: 2 }\n");
    std::fs::write(&spec_path, text).expect("write");
    let spec_arg = spec_path.to_str().expect("p");
    let full = dir.path().join("full");
    let out = mpirun(ranks, &["run", spec_arg, "--transport", "mpi", "-o", full.to_str().expect("p")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let ckpt = full.join("checkpoints/step-000002");
    for f in files {
        assert!(ckpt.join(f).is_file(), "{f} missing from the checkpoint");
    }
    let resumed = dir.path().join("resumed");
    let resume = ["--resume", ckpt.to_str().expect("p"), "-o", resumed.to_str().expect("p")];
    let out = mpirun(ranks, &[&["run", spec_arg, "--transport", "mpi"][..], &resume[..]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(losses(&full)[2..].to_vec(), losses(&resumed));
}

#[test]
fn rank_0_writes_checkpoints_and_an_mpi_run_resumes_exactly() {
    let mut files: Vec<String> = (0..3).map(|s| format!("optimizer-s{s}.bin")).collect();
    files.extend(["model.safetensors".to_string(), "state.json".to_string()]);
    checkpoint_and_resume_over_mpi("\"2-1-1\"", 4, &files);
}

#[test]
fn tensor_parallel_over_mpi_equals_in_process_and_resumes_from_its_shards() {
    let layout = "\"1-1\"\n  tp: 2";
    equal_to_in_process(layout, 4);
    let files: Vec<String> = [(0, 0), (0, 1), (1, 0), (1, 1)].map(|(s, r)| format!("optimizer-s{s}-tp{r}.bin")).into();
    checkpoint_and_resume_over_mpi(layout, 4, &files);
}

#[test]
fn the_mpi_transport_outside_mpirun_says_how_to_start_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("straight", 2, 1)).expect("write");
    let out = pipec_command()
        .args(["run", spec_path.to_str().expect("p"), "--transport", "mpi", "-o"])
        .arg(dir.path().join("out"))
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("mpirun -np 2"), "{stderr}");
    assert!(!stderr.contains("MPI_Abort") && !stderr.contains("MPI_FINALIZE"), "{stderr}");
}

#[test]
fn a_silent_rank_stops_the_job_within_the_timeout_naming_device_and_instruction() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("straight", 2, 100000)).expect("write");
    let marker: PathBuf = dir.path().join("stopme");
    let child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", pipec(), "run"])
        .arg(&spec_path)
        .args(["--transport", "mpi", "--timeout", "4", "-o"])
        .arg(&marker)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    std::thread::sleep(Duration::from_secs(3));
    // the newest rank stops answering (it is not killed: its peers must notice the silence)
    let stopped =
        Command::new("pkill").args(["-STOP", "-n", "-f", marker.to_str().expect("p")]).status().expect("pkill");
    assert!(stopped.success(), "no rank to stop");
    let start = Instant::now();
    let out = std::thread::scope(|s| {
        let waiter = s.spawn(|| child.wait_with_output().expect("wait"));
        while !waiter.is_finished() {
            if start.elapsed() > Duration::from_secs(40) {
                // do not leave the stopped rank behind
                let _ = Command::new("pkill").args(["-KILL", "-f", marker.to_str().expect("p")]).status();
                panic!("the job did not stop within 40 s of a rank going silent (timeout 4 s)");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        waiter.join().expect("joined")
    });
    let _ = Command::new("pkill").args(["-KILL", "-f", marker.to_str().expect("p")]).status();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("nothing arrived from d") && stderr.contains("device d"), "{stderr}");
    assert!(!stderr.contains("after MPI_FINALIZE"), "{stderr}");
}

#[test]
fn a_threaded_tensor_parallel_checkpoint_resumes_over_mpi_without_tensor_parallelism() {
    // written by threads with `tp: 2` on 4 devices, resumed by 2 MPI ranks with `tp: 1`:
    // another transport and another tensor-parallel degree, the same losses as an
    // uninterrupted run of the new layout
    let dir = tempfile::tempdir().expect("tmp");
    let write = |name: &str, layout: &str, devices: usize| {
        let text = spec_of(CHAIN, layout, devices, 4).replace("  seed: 3\n", "  seed: 3\n  checkpoint: { every: 2 }\n");
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path
    };
    let tp2 = write("tp2.yaml", "\"1-1\"\n  tp: 2", 4);
    let plain = write("plain.yaml", "\"1-1\"", 2);
    let source = dir.path().join("source");
    let out = pipec_command()
        .args(["run", tp2.to_str().expect("p"), "-o", source.to_str().expect("p")])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let full = dir.path().join("full");
    let out = pipec_command()
        .args(["run", plain.to_str().expect("p"), "-o", full.to_str().expect("p")])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let resumed = dir.path().join("resumed");
    let ckpt = source.join("checkpoints/step-000002");
    let out = mpirun(
        2,
        &[
            "run",
            plain.to_str().expect("p"),
            "--transport",
            "mpi",
            "--resume",
            ckpt.to_str().expect("p"),
            "-o",
            resumed.to_str().expect("p"),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let (a, b) = (losses(&full)[2..].to_vec(), losses(&resumed));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "uninterrupted {a:?}, resumed {b:?}");
    }
}

/// The MLP of the stall report: 8 linear layers, 256 wide and up (every activation and
/// gradient message, 16 rows × 256–2048 floats, is above Open MPI's eager limits: 4 KiB
/// in shared memory, 64 KiB over TCP, so each send is a rendezvous).
const WIDE_CHAIN: &str = "  input: [256]\n  layers:\n    - linear(256, 512) -> relu\n    - linear(512, 1024) -> relu\n    - linear(1024, 2048) -> relu\n    - linear(2048, 1024) -> relu\n    - linear(1024, 512) -> relu\n    - linear(512, 256) -> relu\n    - linear(256, 128) -> relu\n    - linear(128, 10)\n";

/// The same depth at 256 wide: every message (16 × 256 floats, 16 KiB) still a rendezvous
/// in shared memory, and checkpoints a tenth the size, so it can run several times.
const NARROW_CHAIN: &str =
    "  input: [256]\n  layers:\n    - repeat 7: linear(256, 256) -> relu\n    - linear(256, 10)\n";

/// A straight 1F1B pipeline of `model` over MPI with a checkpoint after every step: before
/// the sender thread made its sends nonblocking, a rank's blocking send of its checkpoint
/// shard to rank 0 held up its next activation, whose receiver was itself blocked, and the
/// job stalled right after the first checkpoint (22 of 26 runs of the reported case on 4
/// ranks; here before the fix, 2 of 2 runs of each test's first configuration, each
/// ending at the 20 s timeout).
fn pipeline_with_checkpoints_every_step(model: &str, ranks: usize, steps: usize) {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    let text = format!(
        "name: stall\nmodel:\n{model}  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: {ranks}\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n  stages: straight\n  schedule: 1f1b\n  microbatches: 4\ntraining:\n  batch_size: 64\n  steps: {steps}\n  optimizer: {{ kind: adam, lr: 0.001 }}\n  seed: 5\n  checkpoint: {{ every: 1 }}\n  data: {{ kind: synthetic, samples: 256 }}\n"
    );
    std::fs::write(&spec_path, text).expect("write");
    let out = dir.path().join("out");
    let start = Instant::now();
    let run = mpirun(
        ranks,
        &[
            "run",
            spec_path.to_str().expect("p"),
            "--transport",
            "mpi",
            "--timeout",
            "20",
            "-o",
            out.to_str().expect("p"),
        ],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "stalled or failed after {:?}: {stderr}", start.elapsed());
    assert_eq!(losses(&out).len(), steps);
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).expect("latest");
    assert_eq!(latest.trim(), format!("step-{steps:06}"));
}

#[test]
fn a_four_stage_pipeline_checkpointing_every_step_does_not_stall() {
    // the reported configuration, then two more runs of the narrow model
    pipeline_with_checkpoints_every_step(WIDE_CHAIN, 4, 40);
    for _ in 0..2 {
        pipeline_with_checkpoints_every_step(NARROW_CHAIN, 4, 20);
    }
}

#[test]
fn an_eight_stage_pipeline_checkpointing_every_step_does_not_stall() {
    // (the narrow model did not stall on 8 ranks before the fix; the wide one did, 2 of 2)
    for _ in 0..2 {
        pipeline_with_checkpoints_every_step(WIDE_CHAIN, 8, 6);
    }
}

/// A stand-in for Slurm's `srun` (none is installed here): it logs its arguments, then starts
/// the command on `--ntasks` Open MPI ranks, each with the variables `srun` gives a task
/// (`SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`) and without `mpirun`'s own
/// `OMPI_COMM_WORLD_RANK`, as a PMIx-launched task has; `swap` numbers the tasks backwards,
/// as a step whose tasks were not wired to MPI's ranks would.
fn fake_srun(dir: &Path, swap: bool) -> PathBuf {
    let bin = dir.join(if swap { "swapped" } else { "bin" });
    std::fs::create_dir_all(&bin).expect("mkdir");
    let procid = if swap { "$((OMPI_COMM_WORLD_SIZE - 1 - OMPI_COMM_WORLD_RANK))" } else { "$OMPI_COMM_WORLD_RANK" };
    let script = format!(
        "#!/bin/sh\necho \"$@\" > \"{log}\"\nn=1\nwhile [ $# -gt 0 ]; do case \"$1\" in --ntasks=*) n=${{1#--ntasks=}}; shift ;; --*) shift ;; *) break ;; esac; done\nexec mpirun --allow-run-as-root --oversubscribe -np \"$n\" sh -c 'export SLURM_PROCID={procid} SLURM_LOCALID=$OMPI_COMM_WORLD_LOCAL_RANK SLURM_NTASKS=$OMPI_COMM_WORLD_SIZE; unset OMPI_COMM_WORLD_RANK; exec \"$@\"' task \"$@\"\n",
        log = bin.join("srun.log").display()
    );
    let path = bin.join("srun");
    std::fs::write(&path, script).expect("write");
    assert!(Command::new("chmod").arg("+x").arg(&path).status().expect("chmod").success());
    bin
}

#[test]
fn launch_slurm_starts_the_ranks_through_srun_and_a_miswired_step_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("\"2-1\"", 3, 4)).expect("write");
    let path = |bin: &Path| format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    // printed without --exec
    let printed = pipec_command().arg("launch").arg(&spec_path).arg("--slurm").output().expect("runs");
    let line = String::from_utf8_lossy(&printed.stdout);
    assert!(
        line.starts_with(
            "srun --nodes=1 --ntasks=3 --ntasks-per-node=3 --distribution=block --mpi=pmix --kill-on-bad-exit=1 "
        ),
        "{line}"
    );
    assert!(line.contains(" run ") && line.contains("--transport mpi"), "{line}");
    // an allocation with fewer nodes than the plan's cluster
    let short = pipec_command()
        .arg("launch")
        .arg(&spec_path)
        .arg("--slurm")
        .env("SLURM_JOB_NUM_NODES", "0")
        .output()
        .expect("runs");
    assert_eq!(short.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&short.stderr).contains("this Slurm allocation has 0 (SLURM_JOB_NUM_NODES)"));
    // run through the stand-in: the same losses as the threaded run
    let bin = fake_srun(dir.path(), false);
    let out = dir.path().join("slurm");
    let run = pipec_command()
        .arg("launch")
        .arg(&spec_path)
        .args(["--slurm", "--exec", "-o"])
        .arg(&out)
        .env("PATH", path(&bin))
        .output()
        .expect("runs");
    assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(std::fs::read_to_string(bin.join("srun.log")).expect("log").starts_with("--nodes=1 --ntasks=3 "));
    let threads = dir.path().join("threads");
    let t = pipec_command().arg("run").arg(&spec_path).arg("-o").arg(&threads).output().expect("runs");
    assert_eq!(t.status.code(), Some(0), "{}", String::from_utf8_lossy(&t.stderr));
    assert_eq!(losses(&out), losses(&threads));
    // tasks numbered otherwise than MPI's ranks: refused, naming both
    let swapped = fake_srun(dir.path(), true);
    let run = pipec_command()
        .arg("launch")
        .arg(&spec_path)
        .args(["--slurm", "--exec", "-o"])
        .arg(dir.path().join("swapped-out"))
        .env("PATH", path(&swapped))
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(stderr.contains("(SLURM_PROCID) but MPI made it rank"), "{stderr}");
}

#[test]
fn gradient_buckets_over_mpi_equal_in_process_exactly() {
    // each bucket's all-reduce started from inside the first stage's backward, on the MPI
    // transport; batch statistics after the last bucket
    equal_to_in_process("\"2-2\"\n  bucket: 1KiB", 4);
    equal_to_in_process_with(
        "  input: [2, 6, 6]\n  layers:\n    - conv2d(2, 8, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n    - conv2d(8, 8, k=3, pad=1) -> relu\n    - adaptive_avgpool2d -> flatten -> linear(8, 4)\n",
        "\"2\"\n  bucket: 1KiB",
        2,
        "dp-only",
    );
}

#[test]
fn sigterm_to_mpirun_stops_every_rank_at_one_step_with_a_checkpoint_that_resumes_exactly() {
    // mpirun forwards the signal to every rank and ends the job soon after the first exits:
    // the ranks vote on the step, and rank 0's checkpoint and lines come before they part
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("\"2-1\"", 3, 100_000)).expect("write");
    let spec_arg = spec_path.to_str().expect("p");
    let out = dir.path().join("mpi");
    let child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "3", pipec()])
        .args(["run", spec_arg, "--transport", "mpi", "-o", out.to_str().expect("p")])
        .env("PIPEC_CPU_CALIBRATION", "off")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    let metrics = out.join("metrics.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 3 {
        assert!(start.elapsed() < Duration::from_secs(120), "no steps after 120 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (run, took) = common::sigterm_and_wait(child);
    eprintln!("the stop took {:.3} s from SIGTERM to mpirun's exit", took.as_secs_f64());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_ne!(run.status.code(), Some(0), "{stderr}");
    let n = losses(&out).len();
    let (resume, last) =
        common::stop_checkpoint(&stderr, &out, n, "resume with (every rank, started as this job's were): ");
    assert!(resume.contains("--transport mpi"), "{resume}");
    // resumed on MPI for three more steps, it equals a threaded run never stopped
    let total = (n + 3).to_string();
    let resumed = dir.path().join("resumed");
    let (r, c) = (resumed.to_str().expect("p"), last.to_str().expect("p"));
    let again = mpirun(3, &["run", spec_arg, "--transport", "mpi", "--steps", &total, "--resume", c, "-o", r]);
    assert_eq!(again.status.code(), Some(0), "{}", String::from_utf8_lossy(&again.stderr));
    let whole = dir.path().join("whole");
    let t = pipec_command().args(["run", spec_arg, "--steps", &total, "-o"]).arg(&whole).output().expect("runs");
    assert_eq!(t.status.code(), Some(0), "{}", String::from_utf8_lossy(&t.stderr));
    let uninterrupted = losses(&whole);
    assert_eq!(losses(&out), uninterrupted[..n].to_vec(), "the stopped job's steps");
    assert_eq!(losses(&resumed), uninterrupted[n..].to_vec(), "the resumed job's steps");
}
