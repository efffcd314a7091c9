//! pipec's benchmarks. `cargo run --release -p pipec-bench -- [planner|compiler|language-models|pipedream|megatron|executor|all]`.
//! Every number in docs/benchmarks.md comes from this program; each figure is the median of
//! several runs, printed with the machine's core count.

use std::time::{Duration, Instant};

use pipec_compiler::partition::{auto, balanced, AutoInput, WeightSync};
use pipec_compiler::pipedream::{self, parse_pipedream_profile, pipedream_price, plan_like_pipedream, recorded_runs};
use pipec_compiler::{compile, CompileOptions};
use pipec_executor::RunOptions;
use pipec_grammar::spec::Link;
use pipec_plan::Plan;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut last = None;
    let mut times = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let out = f();
        times.push(t.elapsed().as_secs_f64());
        last = Some(out);
    }
    (median(times), last.expect("reps > 0"))
}

fn plan_of(text: &str) -> Plan {
    let checked = pipec_grammar::check_source(text);
    let spec = checked.spec.unwrap_or_else(|| panic!("{:?}", checked.diagnostics));
    compile(&spec, &CompileOptions::default()).into_compiled().unwrap_or_else(|d| panic!("{d:?}")).plan
}

fn planner() {
    println!("## planner");
    // 1,000 layers with uneven costs, 1,024 workers on 128 nodes of 8
    let n = 1000;
    let times: Vec<f64> = (0..n).map(|i| 1e-3 * (1.0 + ((i * 7919) % 13) as f64 / 4.0)).collect();
    let params: Vec<f64> = (0..n).map(|i| 4.0e6 * (1.0 + (i % 5) as f64)).collect();
    let cuts: Vec<f64> = (0..n).map(|i| 2.0e6 * (1.0 + (i % 3) as f64)).collect();
    let memory: Vec<f64> = (0..n).map(|i| 5.0e7 * (1.0 + (i % 4) as f64)).collect();
    let input = AutoInput {
        layer_times: &times,
        parameter_bytes: &params,
        cut_bytes: &cuts,
        memory_bytes: &memory,
        machines: 1024,
        machines_per_node: 8,
        memory_capacity: 80e9,
        sync: WeightSync::PerStep { microbatches: 64 },
        intra: Link::new(300e9, 5e-6),
        inter: Link::new(25e9, 10e-6),
    };
    let (t, plan) = time(5, || auto(&input).expect("plans"));
    println!(
        "auto, 1000 layers x 1024 workers: {:.3} s ({} stages, {} workers used, bottleneck {:.3} ms/microbatch)",
        t,
        plan.ranges.len(),
        plan.replicas.iter().sum::<usize>(),
        plan.time_per_microbatch * 1e3
    );
    let (t, _) = time(5, || balanced(&times, &vec![1; 64]).expect("splits"));
    println!("balanced, 1000 layers into 64 stages: {:.4} s", t);
    let (t, _) = time(3, || balanced(&times, &(0..64).map(|i| 1 + i % 3).collect::<Vec<_>>()).expect("splits"));
    println!("balanced with uneven replication, 1000 layers into 64 stages: {:.4} s", t);
}

fn transformer_spec(
    devices_per_node: usize,
    nodes: usize,
    layers: usize,
    strategy: &str,
    mbs: usize,
    batch: usize,
) -> String {
    format!(
        "model:
  input: [256]
  layers:
    - embedding(32000, 1024)
    - repeat {layers}: transformer_block(d=1024, heads=16, ff=4096)
    - layernorm
    - flatten
    - linear(262144, 8)
  loss: cross_entropy
cluster:
  nodes: {nodes}
  devices_per_node: {devices_per_node}
  device: {{ kind: a100, memory: 80GB, throughput: 312TFLOP/s }}
  links:
    intra_node: {{ bandwidth: 600GB/s, latency: 3us }}
    inter_node: {{ bandwidth: 200Gbps, latency: 10us }}
strategy:
{strategy}
  microbatches: {mbs}
training:
  batch_size: {batch}
  steps: 10
  optimizer: {{ kind: adam, lr: 0.0001 }}
  precision: bf16
"
    )
}

fn compiler() {
    println!("## compiler (parse + check + IR + cost + partition + schedule + lowering + verify + simulate + memory)");
    // 32 pipeline stages x 128 microbatches, interleaved with 2 chunks per device
    let text = transformer_spec(8, 4, 62, "  pp: 32\n  schedule: { kind: interleaved, virtual_stages: 2 }", 128, 256);
    let (t, plan) = time(5, || plan_of(&text));
    let instrs: usize = plan.streams.values().map(Vec::len).sum();
    println!("interleaved, 32 stages x 2 chunks x 128 microbatches: {:.3} s for {} instructions (step {:.1} ms, bubble {:.1}%)", t, instrs, plan.simulation.step_time_s * 1e3, plan.simulation.bubble_fraction * 100.0);
    let text = transformer_spec(8, 128, 96, "  dp: 32\n  pp: 8\n  tp: 4\n  schedule: 1f1b", 256, 1024);
    let (t, plan) = time(5, || plan_of(&text));
    let instrs: usize = plan.streams.values().map(Vec::len).sum();
    println!("hybrid dp32 x pp8 x tp4 = 1024 devices, 96 transformer blocks, 256 microbatches: {:.3} s for {} instructions (step {:.1} ms, bubble {:.1}%)", t, instrs, plan.simulation.step_time_s * 1e3, plan.simulation.bubble_fraction * 100.0);
}

/// `pipec compile` of GPT-2 small (`specs/gpt2.yaml`) and GPT-3 175B on 1,024 GPUs
/// (`bench/specs/gpt3-175b.yaml`): in process (check + compile), and as a whole process —
/// start, parse, check, compile, write plan.json, timeline.svg, memory.svg and trace.json —
/// with the `pipec` binary built beside this one (`cargo build --release -p pipec`).
fn language_models() {
    println!("## language models: compile time");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let pipec = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join("pipec")));
    for spec in ["specs/gpt2.yaml", "bench/specs/gpt3-175b.yaml"] {
        let path = root.join(spec);
        let text = std::fs::read_to_string(&path).expect("the spec");
        let (t, plan) = time(5, || plan_of(&text));
        let instrs: usize = plan.streams.values().map(Vec::len).sum();
        println!(
            "{spec}: in process {t:.3} s, {} devices, {instrs} instructions, predicted step {:.1} ms",
            plan.devices.len(),
            plan.simulation.step_time_s * 1e3
        );
        let Some(bin) = pipec.as_ref().filter(|b| b.is_file()) else {
            println!("  (no pipec binary beside this one: build it with `cargo build --release -p pipec`)");
            continue;
        };
        let out = std::env::temp_dir().join(format!("pipec-bench-lm-{}", std::process::id()));
        let mut runs = Vec::new();
        for _ in 0..7 {
            let t = Instant::now();
            let status = std::process::Command::new(bin)
                .arg("compile")
                .arg(&path)
                .arg("-o")
                .arg(&out)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .expect("pipec runs");
            assert!(status.success(), "pipec compile {spec} failed");
            runs.push(t.elapsed().as_secs_f64());
        }
        let bytes: u64 = std::fs::read_dir(&out)
            .map(|d| d.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum())
            .unwrap_or(0);
        let (lo, hi) = runs.iter().fold((f64::MAX, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        println!(
            "  whole process: median {:.3} s (min {lo:.3}, max {hi:.3}, 7 runs), {:.1} MB written",
            median(runs),
            bytes as f64 / 1e6
        );
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// pipec's `auto` against PipeDream's own optimizer on PipeDream's published profiles: the
/// plans PipeDream chose (`tests/reference/pipedream-profiles/pipedream-plans.json`, written
/// by `run_pipedream.py` there) against pipec's, both priced with PipeDream's objective.
fn pipedream() {
    println!("## PipeDream's published profiles: pipec's auto against PipeDream's optimizer");
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/reference/pipedream-profiles");
    let Ok(text) = std::fs::read_to_string(format!("{dir}/pipedream-plans.json")) else {
        println!("(skipped: {dir}/pipedream-plans.json not found)");
        return;
    };
    let runs = recorded_runs(&text).expect("pipedream-plans.json reads");
    println!("| profile | cluster | PipeDream's plan | PipeDream's time | its optimizer | pipec's plan | pipec predicted | priced by PipeDream | ratio | pipec planned in |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for run in runs {
        let (per_server, servers, bandwidths) = (run.per_server, run.servers, run.bandwidths);
        let nodes =
            parse_pipedream_profile(&std::fs::read_to_string(format!("{dir}/{}", run.profile)).expect("profile"))
                .expect("parses");
        let chain = pipedream::chain(&nodes);
        let (t, plan) = time(3, || plan_like_pipedream(&chain, per_server, servers, bandwidths).expect("plans"));
        let price = pipedream_price(&chain, &plan.ranges, &plan.replicas, per_server, bandwidths);
        let (theirs, their_time, their_seconds, ratio) = match &run.plan {
            Some(p) => (
                p.notation(),
                format!("{:.2} ms", p.time_s * 1e3),
                format!("{:.1} s", p.optimizer_seconds),
                format!("{:.3}", price / p.time_s),
            ),
            None => ("(did not finish)".into(), "-".into(), "-".into(), "-".into()),
        };
        println!(
            "| {} | {} | {theirs} | {their_time} | {their_seconds} | {} | {:.2} ms | {:.2} ms | {ratio} | {t:.4} s |",
            run.model,
            run.cluster,
            plan.notation(),
            plan.time_per_microbatch * 1e3,
            price * 1e3,
        );
    }
}

fn mlp_spec(devices: usize, stages: &str, schedule: &str, throughput: &str) -> String {
    format!(
        "model:
  input: [1024]
  layers:
    - repeat 8: linear(1024, 1024) -> relu
    - linear(1024, 10)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: {devices}
  device: {{ memory: 8GiB, throughput: {throughput} }}
  links:
    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}
strategy:
  stages: {stages}
  schedule: {schedule}
  microbatches: 8
training:
  batch_size: 256
  steps: 23
  optimizer: {{ kind: sgd, lr: 0.005 }}
  seed: 1234
  data: {{ kind: synthetic, samples: 1024 }}
"
    )
}

/// One traced instruction: device, instruction index, start and end (seconds).
type TraceEvent = (pipec_plan::DeviceId, usize, f64, f64);

fn run_steps(plan: &Plan) -> (f64, Vec<f64>, Vec<TraceEvent>) {
    let report =
        pipec_executor::run(plan, &RunOptions { timeout: Duration::from_secs(300), ..Default::default() }, &mut |_| {})
            .expect("runs");
    let timed: Vec<f64> = report.steps.iter().skip(3).map(|s| s.step_seconds).collect();
    (median(timed), report.steps.iter().map(|s| s.loss).collect(), report.trace)
}

fn executor() {
    println!("## executor (CPU, flex backend): 8 x Linear(1024) + ReLU, batch 256, 8 microbatches, 3 warm-up + 20 timed steps");
    // Calibrate the cost model with a measured profile of this machine, as a user would
    // with `pipec profile`.
    // `pipec profile` measures with as many concurrent copies as the plan has workers
    // sharing this machine: 1 for the single worker, 2 for the pipelines.
    let single = plan_of(&mlp_spec(1, "\"1\"", "gpipe", "50GFLOP/s"));
    let profiles: Vec<_> = (1..=2)
        .map(|threads| pipec_executor::profile::profile_cpu_concurrent(&single, threads, 2, 10).expect("profiles"))
        .collect();
    let with_profile = |text: &str| {
        let spec = pipec_grammar::check_source(text).spec.expect("valid");
        let workers = spec.cluster.device_count().clamp(1, 2);
        compile(&spec, &CompileOptions { profile: Some(profiles[workers - 1].clone()), ..CompileOptions::default() })
            .into_compiled()
            .expect("compiles")
            .plan
    };
    let one = with_profile(&mlp_spec(1, "\"1\"", "gpipe", "50GFLOP/s"));
    let (t1, l1, _) = run_steps(&one);
    println!("1 worker (8 microbatches accumulated): {:.4} s/step (predicted {:.4})", t1, one.simulation.step_time_s);
    for sched in ["1f1b", "gpipe"] {
        let two = with_profile(&mlp_spec(2, "\"1-1\"", sched, "50GFLOP/s"));
        let (t2, l2, trace) = run_steps(&two);
        let max_diff = l1.iter().zip(&l2).map(|(a, b)| (a - b).abs() / a.abs()).fold(0.0, f64::max);
        let busy: f64 = trace
            .iter()
            .filter(|(d, i, _, _)| {
                two.streams[d]
                    .get(*i)
                    .is_some_and(|x| !matches!(x.phase(), pipec_plan::Phase::Communication | pipec_plan::Phase::Memory))
            })
            .map(|t| t.3 - t.2)
            .sum();
        let step = trace.iter().map(|t| t.3).fold(0.0, f64::max);
        println!(
            "2 workers, {sched}: {:.4} s/step, speedup {:.2}x; predicted {:.4} s ({:+.1}% of measured); bubble measured {:.1}% predicted {:.1}%; max relative loss difference vs 1 worker {:.1e}",
            t2,
            t1 / t2,
            two.simulation.step_time_s,
            (two.simulation.step_time_s / t2 - 1.0) * 100.0,
            (1.0 - busy / (2.0 * step)) * 100.0,
            two.simulation.bubble_fraction * 100.0,
            max_diff
        );
    }
    // Interpreter and transport overhead: a model so small that compute is negligible.
    let tiny = "model:\n  input: [8]\n  layers:\n    - repeat 4: linear(8, 8)\n  loss: mse\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: { memory: 1GiB, throughput: 1GFLOP/s }\n  links:\n    intra_node: { bandwidth: 10GB/s, latency: 1us }\nstrategy:\n  stages: straight\n  schedule: 1f1b\n  microbatches: 64\ntraining:\n  batch_size: 64\n  steps: 23\n  optimizer: { kind: sgd, lr: 0.01 }\n  data: { kind: synthetic, task: regression }\n";
    let p = plan_of(tiny);
    let (t, _, _) = run_steps(&p);
    let per_device = p.streams.values().map(Vec::len).max().unwrap_or(1);
    println!("overhead: 2 workers x {} instructions per step on a 4 x Linear(8) model (1 sample per microbatch): {:.4} s/step = {:.1} µs per instruction, compute included", per_device, t, t / per_device as f64 * 1e6);
}

/// What checkpoints cost a step: the executor benchmark's model on two workers (1F1B) with
/// Adam (each checkpoint 8.4 M parameters, their two moments: 101 MB), 23 steps, without
/// checkpoints, then with one every 5 steps or every step, written while training goes on
/// (`async`, the default) or with each checkpointing step waiting for its write.
fn checkpoints() {
    println!("## checkpoints (CPU, flex backend): 8 x Linear(1024) + ReLU, Adam, 2 workers 1f1b, 23 steps");
    let text =
        mlp_spec(2, "\"1-1\"", "1f1b", "50GFLOP/s").replace("{ kind: sgd, lr: 0.005 }", "{ kind: adam, lr: 0.001 }");
    let mut baseline = None;
    for (label, checkpoint) in [
        ("no checkpoints", ""),
        ("every 5 steps, async", "  checkpoint: { every: 5 }\n"),
        ("every 5 steps, sync", "  checkpoint: { every: 5, async: false }\n"),
        ("every step, async", "  checkpoint: { every: 1 }\n"),
        ("every step, sync", "  checkpoint: { every: 1, async: false }\n"),
    ] {
        let plan = plan_of(&text.replace("  seed: 1234\n", &format!("  seed: 1234\n{checkpoint}")));
        let dir = std::env::temp_dir().join(format!("pipec-bench-checkpoints-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let options = RunOptions {
            timeout: Duration::from_secs(300),
            checkpoint_dir: (!checkpoint.is_empty()).then(|| dir.clone()),
            ..Default::default()
        };
        let start = Instant::now();
        let report = pipec_executor::run(&plan, &options, &mut |_| {}).expect("runs");
        let wall = start.elapsed().as_secs_f64();
        let written = report.checkpoints.len();
        let bytes = last_checkpoint_bytes(&report);
        let waited: f64 = report.steps.iter().filter_map(|s| s.checkpoint_wait_s).sum::<f64>() + 0.0;
        let _ = std::fs::remove_dir_all(&dir);
        let steps = report.steps.len() as f64;
        let base = *baseline.get_or_insert(wall);
        let per_checkpoint = if written > 0 {
            format!("; {:+.3} s per checkpoint", (wall - base) / written as f64)
        } else {
            String::new()
        };
        println!(
            "{label}: {:.3} s/step ({:+.1}% against none), {written} checkpoints of {:.0} MB, steps waited {:.2} s for writes{per_checkpoint}",
            wall / steps,
            (wall / base - 1.0) * 100.0,
            bytes as f64 / 1e6,
            waited
        );
    }
}

/// The bytes of a run's last checkpoint folder (0 without one).
fn last_checkpoint_bytes(report: &pipec_executor::RunReport) -> u64 {
    report
        .checkpoints
        .last()
        .and_then(|c| std::fs::read_dir(c).ok())
        .map(|d| d.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// What a checkpoint costs under each ZeRO level: `bench/specs/zero-mlp.yaml` (8 × linear(n, n),
/// Adam, 4 data-parallel replicas in one process) at n = 1024 and 2048 (8.4 M and 33.6 M
/// parameters), 8 steps with a checkpoint every 2 (4 checkpoints), `async: false`. Per
/// checkpoint: the longest copy on any device (`checkpoint_copy_s`: a ZeRO replica copies its
/// own shard) and the coordinator's write (`checkpoint_write_s`), medians; the first
/// checkpoint of each run is left out (its buffers are allocated fresh).
fn zero_checkpoints() {
    println!("## ZeRO checkpoints (CPU, flex backend): bench/specs/zero-mlp.yaml, 4 replicas, Adam, 8 steps, a checkpoint every 2");
    let base = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/specs/zero-mlp.yaml")).expect("spec");
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    for n in [1024, 2048] {
        let mut zero0 = None;
        for zero in 0..=3 {
            let text = base
                .replace("linear(1024, 1024)", &format!("linear({n}, {n})"))
                .replace("linear(1024, 16)", &format!("linear({n}, 16)"))
                .replace("input: [1024]", &format!("input: [{n}]"))
                .replace("memory: 4GiB", "memory: 16GiB")
                .replace("steps: 4", "steps: 8")
                .replace("  zero: 3", &format!("  zero: {zero}"))
                .replace("  seed: 5\n", "  seed: 5\n  checkpoint: { every: 2, async: false }\n");
            let plan = plan_of(&text);
            let dir = std::env::temp_dir().join(format!("pipec-bench-zero-checkpoints-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let options = RunOptions {
                timeout: Duration::from_secs(600),
                checkpoint_dir: Some(dir.clone()),
                ..Default::default()
            };
            let report = pipec_executor::run(&plan, &options, &mut |_| {}).expect("runs");
            let bytes = last_checkpoint_bytes(&report);
            let _ = std::fs::remove_dir_all(&dir);
            let copies: Vec<f64> = report.steps.iter().filter_map(|s| s.checkpoint_copy_s).skip(1).collect();
            let writes: Vec<f64> = report.steps.iter().filter_map(|s| s.checkpoint_write_s).skip(1).collect();
            let (copy, write) = (median(copies), median(writes));
            let total = copy + write;
            let against = *zero0.get_or_insert(total);
            println!(
                "n = {n}, zero {zero}: copy {copy:.3} s, write {write:.3} s, together {total:.3} s per checkpoint ({:.2}x zero 0), {:.0} MB",
                total / against,
                bytes as f64 / 1e6
            );
        }
    }
}

/// The products of a dense layer on the CPU backend, at the executor benchmark's shapes
/// (1024 × 1024 weight, a 32-row microbatch and the 256-row batch): the forward `x · W` (flex
/// under `gemm`'s default packing, and under pipec's, which a pipec product sets), the
/// input gradient in Burn's orientation `dy · Wᵀ` and in the one pipec's dense op uses on
/// `flex`, `(W · dyᵀ)ᵀ`, and the weight gradient `xᵀ · dy`; then one layer's forward and
/// backward through Burn's matmul and through pipec's op. Each product takes four weights in
/// turn (a stage's 16 MiB, which the cache does not keep between two uses of one, as in a
/// step); median of 120 after 12 warm-ups.
fn kernels() {
    use burn::tensor::{Distribution, Tensor};
    use pipec_executor::backend::kernels::Kernels;
    type B = pipec_executor::CpuBackend;
    type I = burn::backend::Flex;
    println!(
        "## kernels (CPU, flex backend, one thread): 1024 x 1024 weights, the products taking four in turn, median of 120 after 12 warm-ups"
    );
    let dev = Default::default();
    // four of every operand in turn: a stage's 16 MiB of weights, which the cache does not
    // keep between two uses of a weight, as in a training step
    let ms = |f: &mut dyn FnMut()| {
        for _ in 0..12 {
            f();
        }
        time(120, &mut *f).0 * 1e3
    };
    let weights: Vec<_> =
        (0..4).map(|_| Tensor::<I, 2>::random([1024, 1024], Distribution::Normal(0.0, 0.03), &dev)).collect();
    let turn = std::cell::Cell::new(0usize);
    let w = || {
        turn.set(turn.get() + 1);
        weights[turn.get() % weights.len()].clone()
    };
    for rows in [32usize, 256] {
        let x = Tensor::<I, 2>::random([rows, 1024], Distribution::Normal(0.0, 1.0), &dev);
        let dy = Tensor::<I, 2>::random([rows, 1024], Distribution::Normal(0.0, 1.0), &dev);
        let gflop = 2.0 * rows as f64 * 1024.0 * 1024.0 / 1e9;
        // pipec's product: flex's kernel without the zero-fill and copy of the output
        let ours = |a: Tensor<I, 2>, b: Tensor<I, 2>| {
            drop(I::product(a.into_primitive().tensor(), b.into_primitive().tensor()))
        };
        // flex's product as it runs without pipec: `gemm`'s default packing threshold (8)
        let default_packing = |a: Tensor<I, 2>, b: Tensor<I, 2>| {
            gemm::set_lhs_packing_threshold_single_thread(8);
            drop(a.matmul(b))
        };
        // (the lines after the first run under pipec's threshold, which its product sets)
        let products: [(&str, f64, &mut dyn FnMut()); 7] = [
            ("forward x . W, gemm's default packing", 1.0, &mut || default_packing(x.clone(), w())),
            ("forward x . W, pipec's product (packs W)", 1.0, &mut || ours(x.clone(), w())),
            ("input gradient dy . W^T (Burn)", 1.0, &mut || drop(dy.clone().matmul(w().transpose()))),
            ("input gradient (W . dy^T)^T (pipec)", 1.0, &mut || drop(w().matmul(dy.clone().transpose()).transpose())),
            ("the same, pipec's product", 1.0, &mut || ours(w(), dy.clone().transpose())),
            ("weight gradient x^T . dy", 1.0, &mut || drop(x.clone().transpose().matmul(dy.clone()))),
            ("the same, pipec's product", 1.0, &mut || ours(x.clone().transpose(), dy.clone())),
        ];
        for (name, count, f) in products {
            let t = ms(f);
            println!("{rows:>3} rows  {name:<42} {t:.3} ms  {:.0} GFLOP/s", count * gflop / t * 1e3);
        }
        let wa = Tensor::<B, 2>::from_inner(weights[0].clone()).require_grad();
        let xa = Tensor::<B, 2>::from_inner(x.clone()).require_grad();
        for (name, ours) in [("Burn's matmul", false), ("pipec's dense op", true)] {
            let t = ms(&mut || {
                let y = if ours { B::dense(xa.clone(), wa.clone()) } else { xa.clone().matmul(wa.clone()) };
                let g = burn::tensor::activation::relu(y).sum().backward();
                drop((xa.grad(&g), wa.grad(&g)));
            });
            println!("{rows:>3} rows  layer forward + backward, {name:<17} {t:.3} ms");
        }
    }
}

/// The example CNNs' convolutions, pools and batch norms on the CPU, forward and backward
/// through autodiff (`sum()` of the output as the loss): Burn's own (`flex`'s im2col
/// forward, Burn's default gradients: a transposed convolution and a convolution by the
/// output's gradient; `flex`'s pool; batch normalisation on Burn's operations) against
/// pipec's (`Kernels::convolution`, `Kernels::max_pool`, `Kernels::batch_norm`: the patch
/// matrix's products, one plane at a time, fused); median of 40 after 5 warm-ups, one
/// thread.
fn convolutions() {
    use burn::tensor::ops::ConvOptions;
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};
    use pipec_executor::backend::kernels::Kernels;
    use pipec_executor::backend::pool::PoolWindow;
    type B = pipec_executor::CpuBackend;
    println!("## convolutions (CPU, flex backend, one thread): forward + backward, median of 40 after 5 warm-ups");
    println!("| layer | input | Burn (ms) | pipec (ms) | Burn / pipec |");
    println!("|---|---|---|---|---|");
    let dev = Default::default();
    let ms = |f: &mut dyn FnMut()| {
        for _ in 0..5 {
            f();
        }
        time(40, &mut *f).0 * 1e3
    };
    let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let wrap = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
    // (what, input [n, c, h, w], C_out, kernel, stride, padding): resnet-small's and cnn.yaml's
    let convs = [
        ("3 x 3 conv, resnet-small res1", [8, 16, 32, 32], 16, 3, 1, 1),
        ("3 x 3 conv, stride 2, res2", [8, 16, 32, 32], 32, 3, 2, 1),
        ("1 x 1 conv, stride 2, res2 shortcut", [8, 16, 32, 32], 32, 1, 2, 0),
        ("3 x 3 conv, cnn.yaml's second", [8, 32, 32, 32], 32, 3, 1, 1),
        ("3 x 3 conv, 64 channels at 8 x 8", [8, 64, 8, 8], 64, 3, 1, 1),
    ];
    for (what, shape, c_out, k, stride, padding) in convs {
        let x = Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), &dev).require_grad();
        let w = Tensor::<B, 4>::random([c_out, shape[1], k, k], Distribution::Normal(0.0, 0.1), &dev).require_grad();
        let options = ConvOptions::new([stride; 2], [padding; 2], [1, 1], 1);
        let pass = |ours: bool| {
            let y = if ours {
                wrap(B::convolution(prim(x.clone()), prim(w.clone()), None, options.clone()))
            } else {
                burn::tensor::module::conv2d(x.clone(), w.clone(), None, options.clone())
            };
            let g = y.sum().backward();
            drop((x.grad(&g), w.grad(&g)));
        };
        let (burn, ours) = (ms(&mut || pass(false)), ms(&mut || pass(true)));
        println!("| {what} | {shape:?} | {burn:.3} | {ours:.3} | {:.2} |", burn / ours);
    }
    for (what, shape) in
        [("2 x 2 max pool, cnn.yaml's first", [8, 32, 32, 32]), ("2 x 2 max pool, its second", [8, 64, 16, 16])]
    {
        let x = Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), &dev).require_grad();
        let window = PoolWindow { kernel: [2, 2], stride: [2, 2], padding: [0, 0] };
        let pass = |ours: bool| {
            let y = if ours {
                wrap(B::max_pool(prim(x.clone()), window).0)
            } else {
                burn::tensor::module::max_pool2d(x.clone(), [2, 2], [2, 2], [0, 0], [1, 1], false)
            };
            drop(x.grad(&y.sum().backward()));
        };
        let (burn, ours) = (ms(&mut || pass(false)), ms(&mut || pass(true)));
        println!("| {what} | {shape:?} | {burn:.3} | {ours:.3} | {:.2} |", burn / ours);
    }
    // batch normalisation in training: Burn's operations through autodiff against the fused
    // kernel's node (`Kernels::batch_norm`)
    for (what, shape) in
        [("batch norm, resnet-small's first", [8, 16, 32, 32]), ("batch norm, its last", [8, 64, 8, 8])]
    {
        let x = Tensor::<B, 4>::random(shape, Distribution::Normal(1.0, 1.0), &dev).require_grad();
        let c = shape[1];
        let gamma = Tensor::<B, 1>::ones([c], &dev).require_grad();
        let beta = Tensor::<B, 1>::zeros([c], &dev).require_grad();
        let p1 = |t: Tensor<B, 1>| t.into_primitive().tensor();
        let pass = |ours: bool| {
            let (x_, g_, b_) = (prim(x.clone()), p1(gamma.clone()), p1(beta.clone()));
            let y = match ours {
                true => B::batch_norm(x_, g_, b_, 1e-5).0,
                false => pipec_executor::backend::norm::forward::<B>(x_, g_, b_, 1e-5).0,
            };
            let g = wrap(y).sum().backward();
            drop((x.grad(&g), gamma.grad(&g), beta.grad(&g)));
        };
        let (burn, ours) = (ms(&mut || pass(false)), ms(&mut || pass(true)));
        println!("| {what} | {shape:?} | {burn:.3} | {ours:.3} | {:.2} |", burn / ours);
    }
}

/// Point-to-point latency and bandwidth under `mpirun -np 2`: plain MPI send/receive of
/// byte buffers (osu_latency/osu_bw style ping-pong), then pipec's MPI endpoint moving the
/// same sizes as tensors (header, sender thread, polling receive).
#[cfg(feature = "mpi")]
fn mpi_pingpong() {
    use mpi::traits::*;
    use pipec_executor::fabric::ProcessEndpoint;
    use pipec_executor::mpi_transport::MpiFabric;
    use pipec_executor::transport::{Endpoint, Message};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Multiple).expect("MPI");
    let world = universe.world();
    let rank = world.rank();
    assert_eq!(world.size(), 2, "run under mpirun -np 2");
    let peer = world.process_at_rank(1 - rank);
    if rank == 0 {
        println!("## MPI point-to-point, 2 ranks on this machine (one-way time = round trip / 2)");
        println!(
            "| size | plain MPI latency | plain MPI bandwidth | pipec endpoint latency | pipec endpoint bandwidth |"
        );
        println!("|---|---|---|---|---|");
    }
    let devices = [pipec_plan::DeviceId(0), pipec_plan::DeviceId(1)];
    let me = devices[rank as usize];
    let other = devices[1 - rank as usize];
    let abort = Arc::new(AtomicBool::new(false));
    let mut ep = ProcessEndpoint::new(me, &devices, Arc::new(MpiFabric::start(&world)), abort, Duration::from_secs(60));
    let mut size = 64 * 1024;
    while size <= 64 * 1024 * 1024 {
        let iters = (256 * 1024 * 1024 / size).clamp(4, 200);
        let buf = vec![1u8; size];
        world.barrier();
        let t = Instant::now();
        for _ in 0..iters {
            if rank == 0 {
                peer.send_with_tag(&buf[..], 1);
                let _ = peer.receive_vec_with_tag::<u8>(1);
            } else {
                let (b, _) = peer.receive_vec_with_tag::<u8>(1);
                peer.send_with_tag(&b[..], 1);
            }
        }
        let plain = t.elapsed().as_secs_f64() / iters as f64 / 2.0;
        let floats = vec![1f32; size / 4];
        world.barrier();
        let t = Instant::now();
        for i in 0..iters {
            let tag = pipec_plan::MessageId::activation(pipec_plan::StageId(0), pipec_plan::MicrobatchId(i as u32));
            if rank == 0 {
                ep.send(other, Message { tag, shape: vec![floats.len()], data: floats.clone() }).expect("send"); // the clone is part of the measured cost, as in the executor
                let _ = ep.recv(other, tag).expect("recv");
            } else {
                let m = ep.recv(other, tag).expect("recv");
                ep.send(other, m).expect("send");
            }
        }
        let ours = t.elapsed().as_secs_f64() / iters as f64 / 2.0;
        if rank == 0 {
            println!(
                "| {} KiB | {:.1} µs | {:.2} GB/s | {:.1} µs | {:.2} GB/s |",
                size / 1024,
                plain * 1e6,
                size as f64 / plain / 1e9,
                ours * 1e6,
                size as f64 / ours / 1e9
            );
        }
        size *= 4;
    }
    world.barrier();
}

/// Point-to-point latency and bandwidth of pipec's TCP fabric between two processes started
/// with torchrun's variables (`RANK=0|1 WORLD_SIZE=2 pipec-bench tcp-pingpong`): tensors
/// through the executor's endpoint, as `mpi-pingpong` measures MPI's.
fn tcp_pingpong() {
    use pipec_executor::comm::tcp::{Rendezvous, TcpFabric};
    use pipec_executor::fabric::ProcessEndpoint;
    use pipec_executor::transport::{Endpoint, Message};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let rv = Rendezvous::from_env().expect("RANK, WORLD_SIZE (2), MASTER_ADDR, MASTER_PORT");
    assert_eq!(rv.size, 2, "start two processes");
    let rank = rv.rank as usize;
    let fabric = Arc::new(TcpFabric::connect(&rv, Duration::from_secs(60)).expect("rendezvous"));
    let end = fabric.clone();
    let devices = [pipec_plan::DeviceId(0), pipec_plan::DeviceId(1)];
    let (me, other) = (devices[rank], devices[1 - rank]);
    let abort = Arc::new(AtomicBool::new(false));
    let mut ep = ProcessEndpoint::new(me, &devices, fabric, abort, Duration::from_secs(60));
    if rank == 0 {
        println!("## pipec's TCP fabric, 2 processes on this machine (one-way time = round trip / 2)");
        println!("| size | latency | bandwidth |");
        println!("|---|---|---|");
    }
    let mut size = 64 * 1024;
    while size <= 64 * 1024 * 1024 {
        let iters = (256 * 1024 * 1024 / size).clamp(4, 200);
        let floats = vec![1f32; size / 4];
        let t = Instant::now();
        for i in 0..iters {
            let tag = pipec_plan::MessageId::activation(pipec_plan::StageId(0), pipec_plan::MicrobatchId(i as u32));
            if rank == 0 {
                ep.send(other, Message { tag, shape: vec![floats.len()], data: floats.clone() }).expect("send");
                let _ = ep.recv(other, tag).expect("recv");
            } else {
                let m = ep.recv(other, tag).expect("recv");
                ep.send(other, m).expect("send");
            }
        }
        let one_way = t.elapsed().as_secs_f64() / iters as f64 / 2.0;
        if rank == 0 {
            println!("| {} KiB | {:.1} µs | {:.2} GB/s |", size / 1024, one_way * 1e6, size as f64 / one_way / 1e9);
        }
        size *= 4;
    }
    // the last reply leaves before either process ends
    pipec_executor::fabric::Fabric::barrier(&*end).expect("barrier");
}

/// One row of Table 1 of "Efficient Large-Scale Language Model Training on GPU Clusters
/// Using Megatron-LM" (Narayanan et al., 2021): the spec's name, hidden size, layers, the
/// paper's tensor- and pipeline-parallel degrees, GPUs, batch and measured teraFLOP/s per GPU.
struct MegatronRow {
    name: &'static str,
    hidden: f64,
    layers: f64,
    t: usize,
    p: usize,
    gpus: usize,
    batch: usize,
    tflops: f64,
}

const MEGATRON_TABLE_1: [MegatronRow; 10] = [
    MegatronRow { name: "1.7b", hidden: 2304.0, layers: 24.0, t: 1, p: 1, gpus: 32, batch: 512, tflops: 137.0 },
    MegatronRow { name: "3.6b", hidden: 3072.0, layers: 30.0, t: 2, p: 1, gpus: 64, batch: 512, tflops: 138.0 },
    MegatronRow { name: "7.5b", hidden: 4096.0, layers: 36.0, t: 4, p: 1, gpus: 128, batch: 512, tflops: 142.0 },
    MegatronRow { name: "18b", hidden: 6144.0, layers: 40.0, t: 8, p: 1, gpus: 256, batch: 1024, tflops: 135.0 },
    MegatronRow { name: "39b", hidden: 8192.0, layers: 48.0, t: 8, p: 2, gpus: 512, batch: 1536, tflops: 138.0 },
    MegatronRow { name: "76b", hidden: 10240.0, layers: 60.0, t: 8, p: 4, gpus: 1024, batch: 1792, tflops: 140.0 },
    MegatronRow { name: "145b", hidden: 12288.0, layers: 80.0, t: 8, p: 8, gpus: 1536, batch: 2304, tflops: 148.0 },
    MegatronRow { name: "310b", hidden: 16384.0, layers: 96.0, t: 8, p: 16, gpus: 1920, batch: 2160, tflops: 155.0 },
    MegatronRow { name: "530b", hidden: 20480.0, layers: 105.0, t: 8, p: 35, gpus: 2520, batch: 2520, tflops: 163.0 },
    MegatronRow { name: "1t", hidden: 25600.0, layers: 128.0, t: 8, p: 64, gpus: 3072, batch: 3072, tflops: 163.0 },
];

/// `strategy: auto` on the specs of Megatron-LM's Table 1 (bench/specs/megatron), and the
/// same search with the paper's (t, p, d) pinned. Throughput per GPU counts FLOPs the
/// paper's way, its Eq. (3): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per iteration with
/// activation recomputation (the paper's runs), 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
/// without; s = 2048, V = 51,200.
fn megatron() {
    use pipec_compiler::search::{search, SearchOptions};
    use pipec_grammar::spec::Recompute;
    println!("## megatron");
    println!("| model | GPUs | paper (t, p, d) | paper TFLOP/s per GPU (iteration) | pipec on the paper's (t, p, d) | auto's choice | auto's TFLOP/s per GPU (step) | search time |");
    println!("|---|---|---|---|---|---|---|---|");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/megatron");
    for row in &MEGATRON_TABLE_1 {
        let path = root.join(format!("gpt-{}.yaml", row.name));
        let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let (s, v, h, l) = (2048.0, 51200.0, row.hidden, row.layers);
        let b = row.batch as f64;
        // `share`: the part of the blocks whose forward is recomputed (stages hold about
        // equal numbers of blocks); the logits are never recomputed
        let flops = |share: f64| {
            72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))
                + share * 24.0 * b * s * l * h * h * (1.0 + s / (6.0 * h))
        };
        let per_gpu = |step: f64, share: f64| flops(share) / (step * row.gpus as f64) / 1e12;
        let best = |text: &str| {
            let checked = pipec_grammar::check_source(text);
            let spec = checked.spec.unwrap_or_else(|| panic!("{}: {:?}", row.name, checked.diagnostics));
            let auto = spec.strategy.auto.clone().expect("an auto strategy");
            let options = SearchOptions::from_spec(&spec, &auto);
            let started = Instant::now();
            let report = search(text, &spec, &CompileOptions::default(), &options);
            let seconds = started.elapsed().as_secs_f64();
            let ranked = report.ranked(options.headroom);
            let described = ranked.first().map(|&(i, p)| {
                let c = &report.candidates[i];
                let chunks = if c.chunks > 1 { format!(" ×{}", c.chunks) } else { String::new() };
                let zero = match c.sharding.level() {
                    0 => String::new(),
                    z => format!(", zero {z}"),
                };
                let what = format!(
                    "({}, {}, {}) {}{chunks}, {} mb{}{zero}",
                    c.tp,
                    c.pp(),
                    c.dp(),
                    c.schedule.name(),
                    c.microbatches,
                    match &c.recompute {
                        Recompute::Off => String::new(),
                        Recompute::All => ", recompute".into(),
                        Recompute::Stages(v) => format!(", recompute {} of {} stages", v.len(), c.pp() * c.chunks),
                        Recompute::Selective => ", selective recompute".into(),
                        Recompute::Blocks(b) => format!(", recompute {}", b.text()),
                    }
                );
                let share = match &c.recompute {
                    Recompute::Off => 0.0,
                    Recompute::All => 1.0,
                    Recompute::Stages(v) => v.len() as f64 / (c.pp() * c.chunks).max(1) as f64,
                    Recompute::Selective | Recompute::Blocks(_) => 0.0,
                };
                (what, p.step_s, share)
            });
            (described, seconds)
        };
        let (auto, seconds) = best(&source);
        let d = row.gpus / (row.t * row.p);
        let pinned = source.replace(
            "strategy: auto",
            &format!(
                "strategy: {{ dp: {d}, pp: {}, tp: {}, schedule: auto, microbatches: auto, recompute: auto }}",
                row.p, row.t
            ),
        );
        let (paper_plan, _) = best(&pinned);
        let paper_iteration = flops(1.0) / (row.tflops * 1e12 * row.gpus as f64);
        let shown = |b: &Option<(String, f64, f64)>| match b {
            Some((what, step, r)) => format!("{what}: {:.0} ({step:.2} s)", per_gpu(*step, *r)),
            None => "nothing fits".into(),
        };
        let (auto_what, auto_step) = match &auto {
            Some((what, step, r)) => (what.clone(), format!("{:.0} ({step:.2} s)", per_gpu(*step, *r))),
            None => ("nothing fits".into(), "-".into()),
        };
        println!(
            "| {} | {} | ({}, {}, {d}) | {:.0} ({paper_iteration:.2} s) | {} | {auto_what} | {auto_step} | {seconds:.2} s |",
            row.name.to_uppercase(),
            row.gpus,
            row.t,
            row.p,
            row.tflops,
            shown(&paper_plan),
        );
    }
}

/// The cost and memory model against published runs (bench/specs/published; the bounds are
/// tests/fidelity.rs's): per row, the published figure, the prediction and the error.
fn fidelity() {
    use pipec_compiler::fidelity::{predict_source, read_published, relative_error};
    println!("## fidelity");
    let folder = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/published");
    let table = std::fs::read_to_string(folder.join("published.csv")).expect("bench/specs/published/published.csv");
    let rows = read_published(&table).expect("the published table");
    println!("| spec | published step (s) | pipec (s) | error | published state / activations (GiB) | pipec (GiB) | errors | predict time |");
    println!("|---|---|---|---|---|---|---|---|");
    let (mut steps, mut memory) = (Vec::new(), Vec::new());
    for row in &rows {
        let source = std::fs::read_to_string(folder.join(&row.spec)).expect("the row's spec");
        let started = Instant::now();
        let p = match predict_source(&source, Some(&folder)) {
            Ok(p) => p,
            Err(e) => {
                println!("| {} | did not compile: {e} |", row.spec);
                continue;
            }
        };
        let seconds = started.elapsed().as_secs_f64();
        let opt = |v: Option<f64>, digits: usize| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
        let step = row.step_s.map(|s| relative_error(p.step_s, s));
        steps.extend(step);
        let state = row.model_state_gib.map(|s| relative_error(p.model_state_gib, s));
        let act = row.activations_gib.map(|s| relative_error(p.activations_gib, s));
        memory.extend(state.iter().chain(act.iter()).copied());
        let pct = |e: Option<f64>| e.map_or("-".to_string(), |e| format!("{:+.1}%", e * 100.0));
        println!(
            "| {} | {} | {:.3} | {} | {} / {} | {:.2} / {:.2} | {} / {} | {:.0} ms |",
            row.spec.trim_end_matches(".yaml"),
            opt(row.step_s, 3),
            p.step_s,
            pct(step),
            opt(row.model_state_gib, 2),
            opt(row.activations_gib, 2),
            p.model_state_gib,
            p.activations_gib,
            pct(state),
            pct(act),
            seconds * 1e3,
        );
    }
    let summary = |v: &[f64]| {
        let mean = v.iter().map(|e| e.abs()).sum::<f64>() / v.len().max(1) as f64;
        let worst = v.iter().map(|e| e.abs()).fold(0.0, f64::max);
        let bias = v.iter().sum::<f64>() / v.len().max(1) as f64;
        format!(
            "{} rows: mean |error| {:.2}%, worst {:.2}%, mean {:+.2}%",
            v.len(),
            mean * 100.0,
            worst * 100.0,
            bias * 100.0
        )
    };
    println!();
    println!("iteration times: {}", summary(&steps));
    println!("memory figures: {}", summary(&memory));
}

/// Published 2025–26 step times (bench/specs/published-2025/steps.csv): each engine ×
/// device kind's constant refitted on its calibration rows beside the table's, then every
/// row predicted with the table's constants, the held-out half summarised.
fn steps() {
    use pipec_compiler::fidelity::{read_steps, refit_all, relative_error, Half, StepSpec};
    println!("## steps");
    let folder = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/published-2025");
    let table = std::fs::read_to_string(folder.join("steps.csv")).expect("bench/specs/published-2025/steps.csv");
    let rows = read_steps(&table).expect("the step table");
    let specs: Vec<StepSpec> = rows
        .iter()
        .map(|r| {
            let source = std::fs::read_to_string(folder.join(&r.spec)).expect("the row's spec");
            StepSpec::check(&source, Some(&folder)).unwrap_or_else(|e| panic!("{}: {e}", r.spec))
        })
        .collect();
    println!(
        "| engine kernels | device | table's constant | refitted | experts' constant | refitted | calibration rows |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in refit_all(&rows, &specs) {
        let fitted = |f: Result<f64, String>| f.map_or_else(|e| e, |v| format!("{v:.4}"));
        println!(
            "| {} | {} | {:.4} | {} | {:.4} | {} | {} |",
            r.kind.0.describe(),
            r.kind.1,
            r.table.efficiency,
            fitted(r.fitted),
            r.table.experts,
            r.fitted_experts.map_or_else(|| "1 (not fitted)".to_string(), fitted),
            r.calibration.iter().map(|&i| rows[i].spec.trim_end_matches(".yaml")).collect::<Vec<_>>().join(", ")
        );
    }
    println!();
    println!("| spec | half | MoE | FP8 | published step (s) | pipec (s) | error |");
    println!("|---|---|---|---|---|---|---|");
    let (mut held, mut calibration) = (Vec::new(), Vec::new());
    for (row, spec) in rows.iter().zip(&specs) {
        let predicted = spec.step(None).unwrap_or_else(|e| panic!("{}: {e}", row.spec));
        let error = relative_error(predicted, row.step_s);
        match row.half {
            Half::Calibration => calibration.push(error),
            Half::HeldOut => held.push(error),
        }
        let yes = |b: bool| if b { "yes" } else { "no" };
        println!(
            "| {} | {} | {} | {} | {:.3} | {:.3} | {:+.1}% |",
            row.spec.trim_end_matches(".yaml"),
            match row.half {
                Half::Calibration => "calibration",
                Half::HeldOut => "held-out",
            },
            yes(row.moe),
            yes(row.fp8),
            row.step_s,
            predicted,
            error * 100.0
        );
    }
    let summary = |v: &[f64]| {
        let mean = v.iter().map(|e| e.abs()).sum::<f64>() / v.len().max(1) as f64;
        let worst = v.iter().map(|e| e.abs()).fold(0.0, f64::max);
        format!("{} rows: mean |error| {:.2}%, worst {:.2}%", v.len(), mean * 100.0, worst * 100.0)
    };
    println!();
    println!("calibration half: {}", summary(&calibration));
    println!("held-out half: {}", summary(&held));
}

/// The allocator the `pipec` binary uses, so the executor numbers are the binary's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("tcp-pingpong") {
        tcp_pingpong();
        return;
    }
    #[cfg(feature = "mpi")]
    if std::env::args().nth(1).as_deref() == Some("mpi-pingpong") {
        mpi_pingpong();
        return;
    }
    let what = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    println!("# pipec benchmarks ({} cores)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0));
    if what == "planner" || what == "all" {
        planner();
    }
    if what == "compiler" || what == "all" {
        compiler();
    }
    if what == "language-models" || what == "all" {
        language_models();
    }
    if what == "pipedream" || what == "all" {
        pipedream();
    }
    if what == "megatron" || what == "all" {
        megatron();
    }
    if what == "kernels" || what == "all" {
        kernels();
    }
    if what == "convolutions" || what == "all" {
        convolutions();
    }
    if what == "executor" || what == "all" {
        executor();
    }
    if what == "checkpoints" || what == "all" {
        checkpoints();
    }
    if what == "zero-checkpoints" || what == "all" {
        zero_checkpoints();
    }
    if what == "steps" || what == "all" {
        steps();
    }
    if what == "fidelity" || what == "all" {
        fidelity();
    }
}
