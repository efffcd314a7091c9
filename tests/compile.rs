//! `pipec compile` end to end: every example spec compiles, with its IR dump and memory
//! table as golden snapshots; a model that cannot fit is rejected statically, and the same
//! model with recompute or more stages is accepted; no file is written on failure.

use std::path::{Path, PathBuf};
use std::process::Command;

use pipec_compiler::{compile, CompileOptions};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn pipec(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_pipec"))
        .args(args)
        .env("PIPEC_CPU_CALIBRATION", "off")
        .current_dir(root())
        .output()
        .expect("pipec runs")
}

#[test]
fn every_example_spec_compiles_with_golden_ir_and_memory() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("specs"))
        .expect("specs")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let tmp = tempfile::tempdir().expect("a temporary folder"); // removed at the end
    for path in files {
        let name = path.file_stem().and_then(|s| s.to_str()).expect("name").to_string();
        let out_dir = tmp.path().join(&name);
        for emit in ["ir", "memory"] {
            let out =
                pipec(&["compile", path.to_str().expect("path"), "-o", out_dir.to_str().expect("tmp"), "--emit", emit]);
            assert_eq!(out.status.code(), Some(0), "{name}: {}", String::from_utf8_lossy(&out.stderr));
            insta::assert_snapshot!(format!("{emit}__{name}"), String::from_utf8_lossy(&out.stdout));
        }
    }
}

fn compile_text(text: &str) -> pipec_compiler::CompileResult {
    let checked = pipec_grammar::check_source(text);
    let spec = checked.spec.expect("the spec itself is valid");
    compile(&spec, &CompileOptions::default())
}

#[test]
fn a_tie_across_stages_sums_the_copies_gradients_before_their_updates() {
    // GPT-2: the embedding on the first stage, the tied output layer on the last; with
    // 2-way data and tensor parallelism each tensor-parallel rank has its own tying group
    let text = std::fs::read_to_string(root().join("specs/gpt2.yaml")).expect("gpt2");
    let plan = compile_text(&text).into_compiled().expect("compiles").plan;
    let last = plan.layers.len() - 1;
    assert_eq!(plan.layers[last].tied, Some(0));
    let ties: Vec<&pipec_plan::plan::GroupPlan> = plan.groups.iter().filter(|g| g.tie.is_some()).collect();
    assert_eq!(ties.len(), 2, "one tying group per tensor-parallel rank");
    let first_and_last: Vec<u32> = ties.iter().flat_map(|g| g.devices.iter().map(|d| d.0)).collect();
    assert_eq!(first_and_last, vec![0, 2, 12, 14, 1, 3, 13, 15]);
    for g in &ties {
        assert_eq!(g.tie, Some([0, last]));
        for d in &g.devices {
            let stream = &plan.streams[d];
            let tail: Vec<String> = stream[stream.len() - 4..].iter().map(|i| i.to_string()).collect();
            // the wait for the replicas' all-reduce, then the tied sum (50,257 × 768 bf16
            // values) and its wait, then the update
            assert!(tail[0].starts_with("wait") && tail[0].ends_with("gradients"), "{d}: {tail:?}");
            let stage = stream[stream.len() - 1].stage();
            assert_eq!(tail[1], format!("all_reduce {stage} {} tied_gradient 77194752B", g.id));
            assert_eq!(tail[2], format!("wait {stage} {} tied_gradient", g.id));
            assert!(tail[3].starts_with("step"), "{d}: {tail:?}");
        }
    }
    // the copy lives on the last stage: its memory holds the projection's 38.6M weights
    assert_eq!(plan.stages[3].parameters, 50257 * 768);
    // an asynchronous schedule cannot keep two copies equal
    let tiny = std::fs::read_to_string(root().join("specs/gpt-tiny.yaml")).expect("gpt-tiny");
    let pipedream = tiny.replace("schedule: 1f1b", "schedule: pipedream");
    let err = compile_text(&pipedream).into_compiled().expect_err("refused");
    let e = err.iter().find(|d| d.code == "E0411").expect("E0411");
    assert!(e.message.contains("tied") && e.message.contains("pipedream"), "{}", e.message);
}

#[test]
fn a_model_that_cannot_fit_is_rejected_and_recompute_or_more_stages_fit() {
    let text = std::fs::read_to_string(root().join("tests/specs/too-big.yaml")).expect("spec");
    let c = compile_text(&text);
    assert!(c.compiled.is_some(), "a plan is built, and its memory reported");
    let err = c.diagnostics.iter().find(|d| d.code == "E0601").expect("E0601 reported");
    assert!(err.is_error());
    let help = err.help.clone().unwrap_or_default();
    assert!(help.contains("recompute: true") && help.contains("more pipeline stages"), "{help}");
    // the primary label is the strategy's layout, a second one the device memory
    assert_eq!(&text[err.span().range()], "\"1-1\"");
    assert!(err.labels.iter().any(|l| &text[l.span.range()] == "10GB"));

    let recompute = text.replace("  microbatches: 16\n", "  microbatches: 16\n  recompute: true\n");
    let c = compile_text(&recompute);
    assert!(!c.has_errors(), "{:?}", c.diagnostics);
    let four =
        text.replace("devices_per_node: 2", "devices_per_node: 4").replace("stages: \"1-1\"", "stages: straight");
    let c = compile_text(&four);
    assert!(!c.has_errors(), "{:?}", c.diagnostics);
    let onefb = text.replace("schedule: gpipe", "schedule: 1f1b");
    let c = compile_text(&onefb);
    assert!(!c.has_errors(), "1F1B keeps fewer microbatches in flight: {:?}", c.diagnostics);
}

#[test]
fn an_infeasible_plan_exits_1_and_writes_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let out_dir = dir.path().join("plan");
    let out = pipec(&["compile", "tests/specs/too-big.yaml", "-o", out_dir.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("E0601"));
    assert!(!out_dir.exists(), "nothing may be written for an infeasible plan");
}

#[test]
fn compile_writes_plan_pictures_and_trace() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = pipec(&["compile", "specs/1f1b.yaml", "-o", dir.path().to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    for f in ["plan.json", "timeline.svg", "memory.svg", "trace.json"] {
        assert!(dir.path().join(f).is_file(), "{f} missing");
    }
    let plan = pipec_plan::Plan::from_json(&std::fs::read_to_string(dir.path().join("plan.json")).expect("plan"))
        .expect("valid plan");
    assert_eq!(plan.partition, "1-1");
    assert!(plan.simulation.step_time_s > 0.0);
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("trace.json")).expect("trace")).expect("json");
    assert!(trace["traceEvents"].as_array().is_some_and(|e| e.len() > 10));
    let svg = std::fs::read_to_string(dir.path().join("timeline.svg")).expect("svg");
    assert!(svg.contains("bubble") && svg.starts_with("<svg"));
    // the memory chart's axes: titled, with byte values up the side (2 GiB devices)
    let memory = std::fs::read_to_string(dir.path().join("memory.svg")).expect("memory svg");
    assert!(memory.contains(">bytes per device<") && memory.contains(">device<"), "{memory}");
    let ticks = memory.matches(" GiB</text>").count() + memory.matches(" MiB</text>").count();
    assert!(ticks >= 2 && memory.contains(">0</text>"), "axis values: {memory}");
    // a plan that is not a plan is a clear error, not a panic
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"version\": 99}").expect("write");
    let out = pipec(&["run", bad.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("version 99"));
    let _ = Path::new("");
}

#[test]
fn run_trains_from_the_cli_and_writes_metrics() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = pipec(&["run", "specs/mlp-1f1b.yaml", "-o", dir.path().to_str().expect("path"), "--steps", "5"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).expect("metrics");
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
    assert_eq!(lines.len(), 5);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i);
        assert!(l["loss"].as_f64().is_some_and(f64::is_finite) && l["samples_per_s"].as_f64().is_some_and(|v| v > 0.0));
    }
    // the measured trace covers every step of the run, on one time axis
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("trace.json")).expect("trace")).expect("json");
    let events = trace["traceEvents"].as_array().expect("events");
    let mut steps: std::collections::BTreeMap<(u64, u64), (f64, f64)> = Default::default();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        let key = (e["tid"].as_u64().expect("tid"), e["args"]["step"].as_u64().expect("step"));
        let (ts, dur) = (e["ts"].as_f64().expect("ts"), e["dur"].as_f64().expect("dur"));
        let span = steps.entry(key).or_insert((f64::MAX, 0.0));
        *span = (span.0.min(ts), span.1.max(ts + dur));
    }
    for dev in [0u64, 1] {
        for k in 0..5u64 {
            assert!(steps.contains_key(&(dev, k)), "device {dev} step {k} missing from the trace");
        }
        for k in 1..5u64 {
            // a device's step starts after its previous step ended
            assert!(steps[&(dev, k)].0 >= steps[&(dev, k - 1)].1 - 1.0, "d{dev} step {k}: {steps:?}");
        }
    }
    assert_eq!(events.iter().filter(|e| e["ph"] == "i").count(), 10, "a marker per device and step");
    // asking for CUDA on a build without it is a clear error
    let out = pipec(&["run", "specs/mlp-1f1b.yaml", "-o", dir.path().to_str().expect("path"), "--backend", "cuda"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("CUDA"));
}

#[test]
fn the_residual_network_example_trains_with_batch_normalisation() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = pipec(&["run", "specs/resnet-small.yaml", "-o", dir.path().to_str().expect("path"), "--steps", "12"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).expect("metrics");
    let loss: Vec<f64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["loss"].as_f64().expect("loss"))
        .collect();
    assert_eq!(loss.len(), 12);
    // 2.64 at step 0, 2.24 by step 9 when this was written
    assert!(loss[9..].iter().all(|l| *l < 0.95 * loss[0]), "the loss did not fall: {loss:?}");
}

#[test]
fn the_tiny_gpt_learns_its_text_and_reports_perplexity() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = pipec(&["run", "specs/gpt-tiny.yaml", "-o", dir.path().to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).expect("metrics");
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(lines.len(), 50);
    let loss: Vec<f64> = lines.iter().map(|l| l["loss"].as_f64().expect("loss")).collect();
    for l in &lines {
        let (loss, ppl) = (l["loss"].as_f64().expect("loss"), l["perplexity"].as_f64().expect("perplexity"));
        assert!((ppl - loss.exp()).abs() <= 1e-9 * ppl, "{l}");
    }
    // the loss falls by at least 30% within the 50 steps (5.79 → about 2.9 when written)
    let best = loss.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(best <= 0.7 * loss[0], "{loss:?}");
    assert!(loss[40..].iter().all(|l| *l <= 0.7 * loss[0]), "{loss:?}");
}

#[test]
fn pipedream_vgg16_profile_plans_on_4_by_4() {
    // PipeDream's published profile (MIT), kept in the repository
    let profile = root().join("tests/reference/pipedream-profiles/vgg16/graph.txt");
    let out = pipec(&[
        "plan-profile",
        profile.to_str().expect("path"),
        "--nodes",
        "4",
        "--devices-per-node",
        "4",
        "--intra",
        "8GB/s",
        "--inter",
        "10Gbps",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("41 layers"), "{text}");
    // planned with PipeDream's weight synchronisation: the convolutions on 13 GPUs across the
    // servers, the fully connected layers on the last server (docs/benchmarks.md)
    assert!(text.contains("weight sync: PipeDream's"), "{text}");
    let notation = text.lines().find_map(|l| l.strip_prefix("partition: ")).expect("a partition line");
    assert_eq!(notation, "13-2-1", "{text}");
    assert!(text.contains("predicted time per minibatch: 49.18 ms"), "{text}");
    // bad flags are errors, not panics
    let out = pipec(&[
        "plan-profile",
        profile.to_str().expect("path"),
        "--devices-per-node",
        "4",
        "--intra",
        "8GiB",
        "--inter",
        "10Gbps",
    ]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn profile_then_compile_with_the_measured_costs() {
    let dir = tempfile::tempdir().expect("tmp");
    let prof = dir.path().join("profile.json");
    let out = pipec(&["profile", "specs/mlp-1f1b.yaml", "-o", prof.to_str().expect("path"), "--reps", "3"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // by default as many concurrent copies as the plan's 2 devices (on 2+ cores)
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!("with {} concurrent worker(s)", cores.min(2))));
    let solo = dir.path().join("solo.json");
    let out = pipec(&[
        "profile",
        "specs/mlp-1f1b.yaml",
        "-o",
        solo.to_str().expect("path"),
        "--reps",
        "2",
        "--concurrent",
        "1",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("with 1 concurrent worker(s)") && solo.is_file());
    // no copies, or more than a machine could start: a usage error, nothing written
    let bad = dir.path().join("bad.json");
    for n in ["0", "100000", "-1"] {
        let out = pipec(&["profile", "specs/mlp-1f1b.yaml", "-o", bad.to_str().expect("path"), "--concurrent", n]);
        assert_eq!(out.status.code(), Some(2), "--concurrent {n}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!bad.exists(), "--concurrent {n}");
    }
    let p: pipec_plan::profile::Profile =
        serde_json::from_str(&std::fs::read_to_string(&prof).expect("profile")).expect("a profile");
    assert_eq!(p.layers.len(), 7);
    assert_eq!(p.batch_size, 16);
    assert!(p.layers.iter().all(|l| l.forward_ms > 0.0 && l.backward_ms > 0.0));
    assert!(p.layers[0].parameter_bytes == (64 * 128 + 128) * 4);
    let plan_dir = dir.path().join("plan");
    let out = pipec(&[
        "compile",
        "specs/mlp-1f1b.yaml",
        "--profile",
        prof.to_str().expect("path"),
        "-o",
        plan_dir.to_str().expect("path"),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let plan =
        pipec_plan::Plan::from_json(&std::fs::read_to_string(plan_dir.join("plan.json")).expect("plan")).expect("plan");
    let expected: f64 = p.layers.iter().map(|l| l.forward_ms).sum::<f64>() / 1e3;
    let got: f64 = plan.layers.iter().map(|l| l.forward_s).sum();
    assert!((got - expected).abs() < 1e-9, "the plan uses the measured times: {got} vs {expected}");
    // every layer with weights has an update time, and a stage's is the sum of its layers'
    for l in p.layers.iter().filter(|l| l.parameter_bytes > 0) {
        assert!(l.update_ms > 0.0, "layer {} ({}) has no update time", l.index, l.name);
    }
    for s in &plan.stages {
        let expected: f64 = p.layers[s.layers[0]..s.layers[1]].iter().map(|l| l.update_ms).sum::<f64>() / 1e3;
        assert!((s.update_s - expected).abs() < 1e-12, "stage {}: {} vs {expected}", s.id.0, s.update_s);
    }
    // a profile of another model is rejected with a diagnostic
    let out = pipec(&[
        "compile",
        "specs/1f1b.yaml",
        "--profile",
        prof.to_str().expect("path"),
        "-o",
        plan_dir.to_str().expect("path"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("E0604"));
}

#[test]
fn out_of_memory_on_many_devices_names_the_worst_three_and_counts_the_rest() {
    let text = "model:\n  input: [256]\n  layers:\n    - repeat 64: linear(256, 256) -> relu\n  loss: mse\ncluster:\n  nodes: 8\n  devices_per_node: 8\n  device: { memory: 64KiB, throughput: 1TFLOP/s }\n  links:\n    intra_node: { bandwidth: 100GB/s, latency: 1us }\n    inter_node: { bandwidth: 10GB/s, latency: 5us }\nstrategy:\n  stages: straight\n  schedule: gpipe\n  microbatches: 8\ntraining:\n  batch_size: 64\n  steps: 1\n  optimizer: { kind: adam, lr: 0.001 }\n";
    let c = compile_text(text);
    let d = c.diagnostics.iter().find(|d| d.code == "E0601").expect("out of memory");
    assert!(d.message.contains("(64 device(s) over capacity: d"), "{}", d.message);
    assert!(d.message.ends_with(" and 61 more)"), "{}", d.message);
    assert_eq!(d.message.matches(" by ").count(), 3, "{}", d.message);
    assert!(d.message.len() < 200, "{} characters: {}", d.message.len(), d.message);
}

/// A spec with `strategy: auto`, or with some fields `auto`, compiled as text.
fn compile_auto(text: &str) -> pipec_compiler::CompileResult {
    let spec = pipec_grammar::check_source(text).spec.expect("the spec itself is valid");
    compile(&spec, &CompileOptions { source: Some(text.into()), ..CompileOptions::default() })
}

/// `hybrid.yaml`'s model and cluster (16 GPUs in 2 nodes) with `strategy` replaced.
fn hybrid_with(strategy: &str) -> String {
    let text = std::fs::read_to_string(root().join("specs/hybrid.yaml")).expect("hybrid");
    let start = text.find("\nstrategy:").expect("a strategy") + 1;
    let end = text.find("\ntraining:").expect("training") + 1;
    format!("{}{strategy}\n{}", &text[..start], &text[end..])
}

#[test]
fn strategy_auto_compiles_the_searchs_best_and_offers_it_as_a_fix() {
    let text = hybrid_with("strategy: auto");
    let r = compile_auto(&text);
    assert!(!r.has_errors(), "{:?}", r.diagnostics);
    let note = r.diagnostics.iter().find(|d| d.code == "W0606").expect("the choice is reported");
    let fix = note.fix.as_ref().expect("a quick fix writes the choice");
    let plan = r.compiled.expect("a plan").plan;
    // the same as `pipec search` on the spec
    let spec = pipec_grammar::check_source(&text).spec.expect("valid");
    let report = pipec_compiler::search::search(
        &text,
        &spec,
        &CompileOptions::default(),
        &pipec_compiler::search::SearchOptions::default(),
    );
    let (i, best) = report.ranked(0.0)[0];
    assert_eq!(plan.simulation.step_time_s, best.step_s);
    assert_eq!(fix.replacement, report.candidates[i].strategy());
    // the fix applied: a written strategy that compiles to the same plan without searching
    let fixed = format!("{}{}{}", &text[..fix.span.start], fix.replacement, &text[fix.span.end..]);
    let again = compile_text(&fixed);
    assert!(again.diagnostics.iter().all(|d| d.code != "W0606"), "no search once written");
    assert_eq!(again.compiled.expect("plan").plan.simulation.step_time_s, best.step_s);
}

#[test]
fn auto_fields_keep_what_the_user_wrote_and_the_search_constraints() {
    let text = hybrid_with(
        "strategy:\n  tp: 2\n  schedule: auto\n  microbatches: auto\n  recompute: false\n  search: { max_depth: 2, headroom: \"50%\", schedules: [gpipe, 1f1b] }",
    );
    let r = compile_auto(&text);
    assert!(!r.has_errors(), "{:?}", r.diagnostics);
    let plan = r.compiled.expect("a plan").plan;
    assert!(plan.stages.iter().all(|s| s.tensor_parallel.iter().all(|g| g.len() == 2)), "tp stays 2");
    assert!(plan.stages.len() <= 2, "at most 2 pipeline stages: {}", plan.stages.len());
    assert!(matches!(plan.schedule.kind.name(), "gpipe" | "1f1b"), "{}", plan.schedule.kind.name());
    assert!(plan.stages.iter().all(|s| !s.recompute));
    assert!(plan.memory_headroom() >= 0.5);
    // a model too big for the devices: no strategy fits
    let small = hybrid_with("strategy: auto").replace("memory: 80GB", "memory: 64MB");
    assert_ne!(small, hybrid_with("strategy: auto"), "the spec names its memory");
    let r = compile_auto(&small);
    let e = r.diagnostics.iter().find(|d| d.code == "E0607").expect("nothing fits");
    assert!(e.message.contains("no strategy fits"), "{}", e.message);
}

/// `pipec search` on a spec whose strategy is `auto` with pinned fields keeps them and its
/// `search:` constraints; a flag overrides a constraint.
#[test]
fn pipec_search_keeps_an_auto_strategys_pins_and_flags_override_them() {
    let text = hybrid_with(
        "strategy:\n  tp: 2\n  schedule: auto\n  microbatches: auto\n  recompute: false\n  search: { max_depth: 2, schedules: [gpipe, 1f1b] }",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pinned.yaml");
    std::fs::write(&path, &text).expect("write");
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["search", path.to_str().expect("utf-8"), "--format", "json", "--top", "50"];
        args.extend_from_slice(extra);
        let out = pipec(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("json")
    };
    let listed = |v: &serde_json::Value| -> Vec<serde_json::Value> {
        std::iter::once(v["best"].clone()).chain(v["runner_ups"].as_array().cloned().unwrap_or_default()).collect()
    };
    let pinned = run(&[]);
    for p in listed(&pinned) {
        assert_eq!(p["tp"], 2, "{p}");
        assert!(p["pp"].as_u64().is_some_and(|pp| pp <= 2), "{p}");
        assert!(matches!(p["schedule"].as_str(), Some("gpipe" | "1f1b")), "{p}");
        assert_eq!(p["recompute"], false, "{p}");
    }
    // --schedules replaces the spec's list; the pins stay
    let zb = run(&["--schedules", "zb-h1"]);
    for p in listed(&zb) {
        assert_eq!(p["schedule"], "zb-h1", "{p}");
        assert_eq!(p["tp"], 2, "{p}");
    }
}

/// A device's per-pass `overhead` adds to every layer's forward once and its backward
/// twice, whatever the microbatch size; so the strategy search no longer splits the batch
/// into one-sample microbatches for free.
#[test]
fn a_per_pass_overhead_costs_every_layer_and_steers_the_search_to_larger_microbatches() {
    let base = hybrid_with("strategy:\n  stages: \"8-8\"\n  schedule: 1f1b\n  microbatches: 16");
    let with = base.replace("throughput: 312TFLOP/s", "throughput: 312TFLOP/s, overhead: 1ms");
    assert_ne!(base, with);
    let (a, b) = (compile_text(&base), compile_text(&with));
    let (a, b) = (a.compiled.expect("plan").plan, b.compiled.expect("plan").plan);
    for (x, y) in a.layers.iter().zip(&b.layers) {
        assert!((y.forward_s - x.forward_s - 1e-3).abs() < 1e-12, "{} vs {}", y.forward_s, x.forward_s);
        assert!((y.backward_s - x.backward_s - 2e-3).abs() < 1e-12);
    }
    for y in &b.stages {
        let layers: f64 = b.layers[y.layers[0]..y.layers[1]].iter().map(|l| l.forward_s).sum();
        assert!((y.forward_s - layers).abs() < 1e-9, "a stage costs the sum of its layers");
    }
    let microbatches = |text: &str| -> usize {
        let r = compile_auto(
            &text.replace("strategy:\n  stages: \"8-8\"\n  schedule: 1f1b\n  microbatches: 16", "strategy: auto"),
        );
        r.compiled.expect("a plan").plan.training.microbatches
    };
    let (free, costly) = (microbatches(&base), microbatches(&with));
    assert!(costly < free, "with a per-pass overhead the search picks fewer microbatches: {costly} vs {free}");
}

/// ZB-H1 on unequally replicated stages (a layout PipeDream's planner may pick, e.g. "2-2-4"):
/// stage s still defers its first s weight passes — stage 0 none, so each of its weight
/// passes follows its input-gradient pass — and the plan verifies.
#[test]
fn zb_h1_on_unequal_replication_defers_weight_passes_by_stage_position() {
    let text = hybrid_with("strategy:\n  stages: \"2-2-4\"\n  tp: 2\n  schedule: zb-h1\n  microbatches: 16");
    let r = compile_text(&text);
    assert!(!r.has_errors(), "{:?}", r.diagnostics);
    let plan = r.compiled.expect("a plan").plan;
    let first = &plan.streams[&pipec_plan::DeviceId(0)];
    let computes: Vec<&pipec_plan::Instr> = first
        .iter()
        .filter(|i| matches!(i, pipec_plan::Instr::BackwardInput { .. } | pipec_plan::Instr::BackwardWeight { .. }))
        .collect();
    assert!(!computes.is_empty());
    for pair in computes.chunks(2) {
        assert!(
            matches!(
                pair,
                [pipec_plan::Instr::BackwardInput { mb: a, .. }, pipec_plan::Instr::BackwardWeight { mb: b, .. }] if a == b
            ),
            "stage 0 defers no weight pass: {pair:?}"
        );
    }
}

/// `partition: auto` with no stages written lets PipeDream's planner lay out the devices,
/// so a cluster with more devices than the model has layers is not an error (E0403 is for
/// a written layout): the planner replicates stages instead.
#[test]
fn the_planner_lays_out_more_devices_than_layers() {
    let text = "model:
  input: [64]
  layers:
    - linear(64, 256) -> relu
    - linear(256, 256) -> relu
    - linear(256, 10)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: 8
  device: { memory: 2GiB, throughput: 20GFLOP/s }
  links:
    intra_node: { bandwidth: 10GB/s, latency: 5us }
strategy:
  schedule: 1f1b
  microbatches: 8
  partition: auto
training:
  batch_size: 64
  steps: 1
  optimizer: { kind: sgd, lr: 0.05 }
";
    let r = compile_text(text);
    assert!(!r.has_errors(), "{:?}", r.diagnostics);
    let plan = r.compiled.expect("a plan").plan;
    assert!(plan.stages.len() <= 3, "at most one stage per layer: {}", plan.partition);
    let devices: usize = plan.stages.iter().map(|s| s.replicas.len()).sum();
    assert_eq!(devices, 8, "every device used: {}", plan.partition);
    // a written layout deeper than the model is still an error
    let written = text.replace("  partition: auto\n", "  stages: straight\n  partition: auto\n");
    let checked = pipec_grammar::check_source(&written);
    assert!(checked.diagnostics.iter().any(|d| d.code == "E0403"), "{:?}", checked.diagnostics);
}

/// `pipec compile` says which stages recompute their forward.
#[test]
fn the_compile_summary_names_the_recomputed_stages() {
    let text = std::fs::read_to_string(root().join("specs/invalid/recompute-stage-out-of-range.yaml"))
        .expect("spec")
        .replace("recompute: [0, 3]", "recompute: [1]");
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = dir.path().join("recompute.yaml");
    std::fs::write(&spec, text).expect("write");
    let out = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", dir.path().join("out").to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // the summary goes to standard error when the plan is written to a folder
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let stage = |s: &str| text.lines().find(|l| l.trim_start().starts_with(s)).unwrap_or_default().to_string();
    assert!(!stage("s0:").contains("recomputed"), "{text}");
    assert!(stage("s1:").contains("forward recomputed before the backward"), "{text}");
}

/// A profile's update times are each stage's optimizer step in the simulation: on one
/// device a step is N·(F + B) + U, and a two-stage GPipe step grows by the first stage's
/// update alone (that stage finishes last; the second stage's update overlaps the first
/// stage's last backward).
#[test]
fn the_simulated_step_includes_the_profiled_updates() {
    let spec = |stages: &str, devices: usize| {
        format!(
            "model:\n  input: [64]\n  layers:\n    - repeat 4: linear(64, 64)\n  loss: mse\ncluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ memory: 1GiB, throughput: 1TFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n  stages: \"{stages}\"\n  schedule: gpipe\n  microbatches: 4\ntraining:\n  batch_size: 32\n  steps: 1\n  optimizer: {{ kind: sgd, lr: 0.1 }}\n"
        )
    };
    let profile = |update_ms: [f64; 4]| pipec_plan::profile::Profile {
        version: 1,
        batch_size: 8,
        backend: "test".into(),
        layers: (0..4)
            .map(|i| pipec_plan::profile::ProfiledLayer {
                index: i,
                name: "linear".into(),
                forward_ms: 1.0,
                backward_ms: 2.0,
                update_ms: update_ms[i],
                activation_bytes: 2048,
                output_bytes: 2048,
                parameter_bytes: 65 * 64 * 4,
            })
            .collect(),
    };
    let step = |text: &str, update_ms: [f64; 4]| {
        let spec = pipec_grammar::check_source(text).spec.expect("valid");
        let c = compile(&spec, &CompileOptions { profile: Some(profile(update_ms)), ..CompileOptions::default() });
        let compiled = c.compiled.expect("a plan");
        (compiled.plan.simulation.step_time_s, compiled.plan.stages.iter().map(|s| s.update_s).collect::<Vec<_>>())
    };
    let updates = [0.5, 0.25, 0.125, 0.0625];
    // one device: 4 microbatches of 4 ms forward and 8 ms backward, then one update
    let (one, stage_updates) = step(&spec("1", 1), updates);
    assert_eq!(stage_updates, vec![0.9375e-3]);
    assert!((one - (4.0 * 12.0 + 0.9375) / 1e3).abs() < 1e-12, "{one}");
    let (none, stage_updates) = step(&spec("1", 1), [0.0; 4]);
    assert_eq!(stage_updates, vec![0.0]);
    assert!((none - 48e-3).abs() < 1e-12, "{none}");
    // two stages: the first stage's update (0.75 ms) is added, the second's is hidden
    let (with, stage_updates) = step(&spec("1-1", 2), updates);
    assert_eq!(stage_updates, vec![0.75e-3, 0.1875e-3]);
    let (without, _) = step(&spec("1-1", 2), [0.0; 4]);
    assert!((with - without - 0.75e-3).abs() < 1e-12, "{with} against {without}");
}

/// A small mixture-of-experts language model (2 blocks of 4 experts, top 2) on one node of
/// 4 devices with 10 GB/s, 5 µs links: data parallelism over 4, expert-parallel degree `ep`.
fn experts_on_four(ep: usize) -> String {
    format!(
        "model:
  input: [8]
  layers:
    - embedding(50, 16)
    - repeat 2: transformer_block(16, 2, 32, experts=4, top_k=2)
    - linear(16, 50, bias=false)
  loss: cross_entropy
cluster:
  nodes: 1
  devices_per_node: 4
  device: {{ memory: 8GiB, throughput: 1TFLOP/s }}
  links:
    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}
strategy:
  dp: 4
  schedule: dp-only
  microbatches: 4
  ep: {ep}
training:
  batch_size: 8
  steps: 1
  optimizer: {{ kind: sgd, lr: 0.1 }}
  data: synthetic
"
    )
}

#[test]
fn expert_parallelism_holds_a_share_of_the_experts_and_sums_their_gradients_over_the_replicas_holding_them() {
    let plan = |ep: usize| compile_text(&experts_on_four(ep)).into_compiled().expect("compiles").plan;
    let (one, two, four) = (plan(1), plan(2), plan(4));
    // the model's routed experts and the rest, in fp32 gradient bytes
    let experts: u64 = one.layers.iter().map(|l| l.op.routed_expert_parameter_count()).sum();
    let dense: u64 = one.layers.iter().map(|l| l.op.parameter_count()).sum::<u64>() - experts;
    assert!(experts > 0 && dense > 0);
    let (x, d) = (4.0 * experts as f64, 4.0 * dense as f64);
    // each device holds its share of the experts' weights (fp32)
    for (p, ep) in [(&one, 1u64), (&two, 2), (&four, 4)] {
        assert_eq!(p.devices[0].memory.weights, 4 * (dense + experts / ep), "ep {ep}");
        let s = &p.stages[0];
        assert_eq!(s.expert_parallel as u64, ep);
        assert_eq!(s.all_to_all_s[0] > 0.0, ep > 1, "ep {ep}: {:?}", s.all_to_all_s);
    }
    // the gradient all-reduce: the dense part over the 4 replicas, the experts' over the
    // replicas holding the same ones — 4, 2, or none
    let ring =
        |p: f64, bytes: f64| if p < 2.0 { 0.0 } else { 2.0 * (p - 1.0) * 5e-6 + 2.0 * (p - 1.0) / p * bytes / 10e9 };
    for (p, expected) in [(&one, ring(4.0, d + x)), (&two, ring(4.0, d) + ring(2.0, x / 2.0)), (&four, ring(4.0, d))] {
        let got = p.simulation.devices[0].collective_s;
        assert!((got - expected).abs() < 1e-12, "{got} vs {expected}");
    }
    // the all-to-alls: 4 per block per microbatch (dispatch and combine, each way), of each
    // member's microbatch of 2 samples of 8 tokens, 2 choices each (fp32 rows of 16), p − 1
    // sends of a 1/p chunk each; the forward's also the row counts pipec's executor
    // exchanges before each dispatch (an fp32 value per expert, 4)
    let bytes = 2.0 * 8.0 * 2.0 * 16.0 * 4.0;
    let a2a = |p: f64, bytes: f64| (p - 1.0) * (5e-6 + bytes / p / 10e9);
    for (p, members) in [(&two, 2.0), (&four, 4.0)] {
        let s = &p.stages[0];
        let counts = 2.0 * a2a(members, 4.0 * 4.0);
        assert!((s.all_to_all_s[1] - 2.0 * 2.0 * a2a(members, bytes)).abs() < 1e-15, "{:?}", s.all_to_all_s);
        assert!((s.all_to_all_s[0] - s.all_to_all_s[1] - counts).abs() < 1e-15, "{:?}", s.all_to_all_s);
    }
    // what expert parallelism saves in the all-reduce it pays in all-to-alls
    assert!(four.simulation.devices[0].collective_s < one.simulation.devices[0].collective_s);
}

#[test]
fn zero_beside_expert_parallelism_shards_the_experts_over_the_replicas_holding_them() {
    let plan = |zero: u8| {
        let text = experts_on_four(2)
            .replace("{ kind: sgd, lr: 0.1 }", "{ kind: momentum, lr: 0.1, momentum: 0.9 }")
            .replace("  ep: 2\n", &format!("  ep: 2\n  zero: {zero}\n"));
        compile_text(&text).into_compiled().expect("compiles").plan
    };
    let one = plan(0);
    let experts: u64 = one.layers.iter().map(|l| l.op.routed_expert_parameter_count()).sum();
    let dense: u64 = one.layers.iter().map(|l| l.op.parameter_count()).sum::<u64>() - experts;
    // fp32 weights, gradients and momentum: a device holds every dense parameter and half
    // of the experts; ZeRO cuts the dense part over the 4 replicas and the experts' over
    // the 2 replicas holding the same ones
    let (d, x) = (4 * dense, 4 * experts / 2);
    let sharded = d.div_ceil(4) + x.div_ceil(2);
    for zero in [1u8, 2] {
        let p = plan(zero);
        let m = &p.devices[0].memory;
        assert_eq!(m.weights, d + x, "zero {zero}");
        // the momentum's shard and, training in fp32, the master weights' shard
        assert_eq!(m.optimizer, 2 * sharded, "zero {zero}");
        assert_eq!(m.gradients, if zero == 2 { sharded } else { d + x }, "zero {zero}");
        // each microbatch's reduce-scatter and the step's all-gather of the weights: the
        // dense part over 4 replicas, the experts' over 2 (ring: p − 1 latencies, (p − 1)/p
        // of the bytes)
        let ring = |p: f64, bytes: f64| (p - 1.0) * 5e-6 + (p - 1.0) / p * bytes / 10e9;
        let expected = 2.0 * (ring(4.0, d as f64) + ring(2.0, x as f64));
        let got = p.simulation.devices[0].collective_s;
        assert!((got - expected).abs() < 1e-12, "zero {zero}: {got} vs {expected}");
    }
    // ZeRO-3 shards the weights the same way: the dense part over 4, the experts' over 2
    let p = plan(3);
    let m = &p.devices[0].memory;
    assert_eq!((m.weights, m.gradients, m.optimizer), (sharded, sharded, sharded), "zero 3");
    // ... and gathers each layer's weights before its passes: the experts over the 2
    // replicas holding them, the rest over 4 (the weights' all-gather after the update
    // is gone, the step's gradients still reduce-scatter as at zero 2)
    let forward = |p: &pipec_plan::Plan| p.simulation.devices[0].by_phase.get("forward").copied().unwrap_or(0.0);
    assert!(forward(&p) > forward(&plan(2)), "zero 3 waits for gathers in its forwards");
}

#[test]
fn pipec_run_says_that_dualpipes_and_the_combined_1f1bs_overlap_of_all_to_alls_runs_in_line() {
    // the plan hides each pair's all-to-alls (DualPipe's overlap); the executor does not
    let text = std::fs::read_to_string(root().join("specs/moe-tiny.yaml")).expect("spec");
    let plan = |schedule: &str| {
        let t = text.replace("  schedule: 1f1b\n", &format!("  schedule: {schedule}\n"));
        compile_text(&t).into_compiled().unwrap_or_else(|d| panic!("{schedule}: {d:?}")).plan
    };
    for schedule in ["dualpipev", "dualpipe"] {
        let caveats = pipec_executor::caveats(&plan(schedule));
        assert!(caveats.iter().any(|c| c.contains(schedule) && c.contains("all-to-alls in line")), "{caveats:?}");
    }
    assert!(!pipec_executor::caveats(&plan("1f1b")).iter().any(|c| c.contains("all-to-alls in line")));
    // Megatron-LM's combined 1F1B (`ep_overlap`): the executor runs its order, not its overlap
    let one_stage = text.replace("  stages: \"2-2\"\n", "  stages: \"4\"\n");
    let overlapped = compile_text(&one_stage.replace("  ep: 2\n", "  ep: 2\n  ep_overlap: true\n"))
        .into_compiled()
        .unwrap_or_else(|d| panic!("ep_overlap: {d:?}"))
        .plan;
    let caveats = pipec_executor::caveats(&overlapped);
    assert!(caveats.iter().any(|c| c.contains("`ep_overlap`") && c.contains("all-to-alls in line")), "{caveats:?}");
}

#[test]
fn weights_without_a_master_copy_drop_four_bytes_a_parameter_and_fsdp2_shards_the_master_alone() {
    // a bf16 Adam plan under ZeRO-3 on 2 replicas, each holding half the parameters
    let base = "ENGINEmodel:\n  input: [64]\n  layers:\n    - embedding(512, 64)\n    - repeat 2: transformer_block(d=64, heads=4, ff=256, causal=true)\n    - layernorm\n    - linear(64, 512, bias=false)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: { memory: 1GiB, throughput: 1TFLOP/s }\n  links:\n    intra_node: { bandwidth: 100GB/s, latency: 1us }\nstrategy:\n  dp: 2\n  schedule: SCHEDULE\n  microbatches: 2\n  zero: 3\ntraining:\n  batch_size: 4\n  steps: 1\n  precision: bf16\n  grad_precision: GRADS\n  optimizer: { kind: adam, lr: 0.001OPTIONS }\n";
    let compiled = |engine: &str, options: &str| {
        let schedule = if engine.is_empty() { "1f1b" } else { "dp-only" };
        // torchtitan 0.2.2 reduces FSDP's gradients in fp32 only
        let grads = if engine.contains("torchtitan") { "fp32" } else { "bf16" };
        let text = base
            .replace("ENGINE", engine)
            .replace("SCHEDULE", schedule)
            .replace("OPTIONS", options)
            .replace("GRADS", grads);
        let plan = compile_text(&text).into_compiled().unwrap_or_else(|e| panic!("{engine}{options}: {e:?}")).plan;
        (plan, if grads == "fp32" { 4 } else { 2 })
    };
    let state = |engine: &str, options: &str| {
        let (plan, grad_bytes) = compiled(engine, options);
        let m = &plan.devices[0].memory;
        let parameters: u64 = plan.stages.iter().map(|s| s.parameters).sum();
        let shard = parameters.div_ceil(2);
        assert_eq!(m.gradients, shard * grad_bytes, "gradients, sharded");
        (m.weights as f64 / shard as f64, m.optimizer as f64 / shard as f64)
    };
    let near = |(w, o): (f64, f64), (ew, eo): (f64, f64), what: &str| {
        assert!((w - ew).abs() < 0.01 && (o - eo).abs() < 0.01, "{what}: weights {w}, optimizer {o} bytes a parameter");
    };
    // Megatron-FSDP keeps a bf16 shard beside the fp32 master, which the optimizer state
    // holds with Adam's two fp32 moments; bf16 moments (`state_precision`) halve those
    let megatron = "engine: megatron\n";
    near(state(megatron, ""), (2.0, 12.0), "megatron");
    near(state(megatron, ", state_precision: bf16"), (2.0, 8.0), "megatron, bf16 moments");
    // FSDP2 (torchtitan) and pipec's executor: the fp32 master shard is the weights
    near(state("engine: torchtitan\n", ""), (4.0, 8.0), "torchtitan");
    near(state("", ""), (4.0, 8.0), "pipec");
    near(state("", ", state_precision: bf16"), (4.0, 4.0), "pipec, bf16 moments");
    // the weights in bf16 alone (NeMo AutoModel's recipes): 8 bytes a parameter in all
    near(state("", ", state_precision: bf16, master_weights: false"), (2.0, 4.0), "no master");
    // which pipec's executor does not train: `pipec run` refuses the plan before training
    let (plan, _) = compiled("", ", master_weights: false");
    assert!(!plan.training.master_weights);
    let used = pipec_plan::features::used(&plan);
    assert!(used.iter().any(|(f, _)| *f == pipec_plan::features::Feature::NoMasterWeights), "{used:?}");
}

/// `etp: 1`: each routed expert whole on a device, the tensor-parallel ranks folded into the
/// expert-parallel group. The plan says so (for `pipec run` to refuse, and for the engines'
/// `--expert-tensor-parallel-size 1`); the groups are drawn from ep / tp replicas, and a
/// device holds the same bytes of experts as with them split over the ranks of as many
/// replicas (`ep: 8, etp: 1` beside `tp: 2`: one whole expert of 8; `ep: 4`: halves of two).
#[test]
fn whole_experts_fold_the_tensor_parallel_ranks_into_the_expert_groups() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/moe-tiny.yaml"))
        .expect("example")
        .replace("devices_per_node: 4", "devices_per_node: 8");
    let with = |strategy: &str| {
        let start = text.find("strategy:").expect("strategy");
        let end = text.find("training:").expect("training");
        format!("{}strategy:\n  dp: 4\n  tp: 2\n  sequence_parallel: true\n  schedule: dp-only\n  microbatches: 4\n{strategy}{}", &text[..start], &text[end..])
    };
    let plan_of = |strategy: &str| compile_text(&with(strategy)).into_compiled().expect("compiles").plan;
    let (whole, split) = (plan_of("  ep: 8\n  etp: 1\n"), plan_of("  ep: 2\n"));
    assert!(whole.schedule.whole_experts && !split.schedule.whole_experts);
    let used = pipec_plan::features::used(&whole);
    assert!(used.iter().any(|(f, _)| *f == pipec_plan::features::Feature::WholeExperts), "{used:?}");
    assert!(!pipec_plan::features::used(&split).iter().any(|(f, _)| *f == pipec_plan::features::Feature::WholeExperts));
    // groups of ep / tp = 4 replicas (their 8 devices), against 2 replicas split
    assert_eq!(whole.stages[0].expert_parallel, 4);
    assert_eq!(split.stages[0].expert_parallel, 2);
    // a device's weights: its whole expert against `ep: 4`'s halves of two (the same
    // bytes) and `ep: 2`'s halves of four (more)
    let experts_whole = plan_of("  ep: 4\n");
    assert_eq!(whole.devices[0].memory.weights, experts_whole.devices[0].memory.weights);
    assert!(split.devices[0].memory.weights > whole.devices[0].memory.weights);
    // the engines are told: Megatron-LM's group of 8 devices, experts whole
    let layout = whole.engine_layout();
    assert_eq!((layout.ep, layout.etp, layout.tp), (8, 1, 2));
}

/// A group of whole experts (`etp: 1`) already holds every tensor-parallel rank: the
/// copies of the leaders' streams for rank 1 exchange over that same group, not over the
/// devices one further on (which crossed into the next node). So the compiled plan's step
/// is the search's prediction of it (one replica standing for the others): each group of
/// 4 devices inside a node, the nodes joined by a slow link.
#[test]
fn whole_experts_exchange_inside_their_group_on_every_tensor_parallel_rank() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/moe-tiny.yaml"))
        .expect("example")
        .replace("nodes: 1\n  devices_per_node: 4", "nodes: 2\n  devices_per_node: 4")
        .replace(
            "    intra_node: { bandwidth: 10GB/s, latency: 5us }",
            "    intra_node: { bandwidth: 10GB/s, latency: 5us }\n    inter_node: { bandwidth: 100MB/s, latency: 50us }",
        );
    let start = text.find("strategy:").expect("strategy");
    let end = text.find("training:").expect("training");
    let text = format!(
        "{}strategy:\n  dp: 4\n  tp: 2\n  sequence_parallel: true\n  schedule: dp-only\n  microbatches: 4\n  ep: 4\n  etp: 1\n{}",
        &text[..start],
        &text[end..]
    );
    let plan = compile_text(&text).into_compiled().expect("compiles").plan;
    let spec = pipec_grammar::check_source(&text).spec.expect("valid");
    let predicted = pipec_compiler::predict::predict(&spec, &CompileOptions::default(), &mut Default::default())
        .expect("predicted")
        .step_s;
    let compiled = plan.simulation.step_time_s;
    assert!((compiled - predicted).abs() <= 1e-9 * predicted, "compiled {compiled} s, predicted {predicted} s");
}

/// DeepSeek-V3's multi-token prediction (`model.mtp`) is priced with the output layer,
/// whose stage runs it: one more copy of the last transformer block, the projection from
/// 2·d to d and three norms (their parameters, `Mtp::parameters`), their FLOPs and a second
/// pass through the output layer and the loss (its logits kept too); on a later stage than
/// the embedding, a copy of the embedding's table. The first stage does not change, and
/// `pipec run` refuses the plan before training.
#[test]
fn multi_token_prediction_adds_a_block_a_projection_and_a_second_loss_to_the_last_stage() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/llama-tiny.yaml"))
        .expect("example")
        .replacen("  partition: balanced\n", "  partition: [\"0..2\", \"2..5\"]\n", 1);
    let with = text.replacen("  loss: cross_entropy\n", "  loss: cross_entropy\n  mtp: 1\n", 1);
    assert_ne!(with, text);
    let plan = |t: &str| compile_text(t).into_compiled().expect("compiles").plan;
    let (without, with) = (plan(&text), plan(&with));
    let block = &without.layers[2].op;
    let own = pipec_plan::model::Mtp { depth: 1, weight: 0.1 }.parameters(block);
    // d = 64: the block's 45,440 and 3·64 + 2·64² of its own
    assert_eq!(own, block.parameter_count() + 3 * 64 + 2 * 64 * 64);
    let head = |p: &pipec_plan::Plan| p.layers.last().cloned().expect("a head");
    assert_eq!(head(&with).parameters - head(&without).parameters, own);
    assert_eq!(with.stages[0].parameters, without.stages[0].parameters);
    let embedding = without.layers[0].parameters;
    assert_eq!(with.stages[1].parameters - without.stages[1].parameters, own + embedding);
    // FLOPs: the block's, the projection's and the output layer's again (64 positions)
    let (s, d, vocab) = (64.0, 64.0, 512.0);
    let expected = without.layers[2].forward_flops_per_sample + 2.0 * s * 2.0 * d * d + 2.0 * s * d * vocab;
    let added = head(&with).forward_flops_per_sample - head(&without).forward_flops_per_sample;
    assert!(added >= expected && added <= expected * 1.02, "added {added}, expected {expected}");
    // the second logits are kept for the loss's backward; the step is longer
    assert!(with.devices[1].memory.activations > without.devices[1].memory.activations);
    assert!(with.simulation.step_time_s > without.simulation.step_time_s);
    assert_eq!(with.devices[0].memory.total, without.devices[0].memory.total);
    let used = pipec_plan::features::used(&with);
    assert!(used.iter().any(|(f, _)| *f == pipec_plan::features::Feature::MultiTokenPrediction), "{used:?}");
    // MFU counts the module as the engines do: its block, projection and logits (6 FLOPs a
    // multiply-add's two: at least the projection's and the logits' 6·(2d² + d·vocab) a token)
    let per_token = |p: &pipec_plan::Plan| p.simulation.mfu.as_ref().map(|m| m.flops_per_token).expect("an MFU");
    let counted = per_token(&with) - per_token(&without);
    assert!(counted > 6.0 * (2.0 * d * d + d * vocab), "{counted}");
}

/// ZeRO-3 under activation recompute: the engines' backward gathers a layer's weights once
/// for its recompute and its backward (FSDP2's and Megatron-FSDP's hooks), so a recompute
/// waits for no gather and the backward's hide behind recompute and backward both; pipec's
/// executor gathers for every pass, a recompute as a forward. On a slow link between the
/// replicas a forward waits for its gathers: a Megatron-LM recompute costs well under a
/// forward, pipec's about as much as one.
#[test]
fn under_recompute_zero_3_gathers_once_for_the_recompute_and_the_backward_on_the_engines() {
    let base = "ENGINEmodel:\n  input: [64]\n  layers:\n    - embedding(512, 256)\n    - repeat 4: transformer_block(d=256, heads=4, ff=1024, causal=true)\n    - layernorm\n    - linear(256, 512, bias=false)\n  loss: cross_entropy\ncluster:\n  nodes: 2\n  devices_per_node: 1\n  device: { memory: 1GiB, throughput: 1TFLOP/s }\n  links:\n    intra_node: { bandwidth: 100GB/s, latency: 1us }\n    inter_node: { bandwidth: 0.1GB/s, latency: 10us }\nstrategy:\n  dp: 2\n  schedule: SCHEDULE\n  microbatches: 2\n  zero: 3\n  recompute: true\ntraining:\n  batch_size: 4\n  steps: 1\n  precision: bf16\n  optimizer: { kind: adam, lr: 0.001 }\n";
    let phases = |engine: &str, schedule: &str| {
        let text = base.replace("ENGINE", engine).replace("SCHEDULE", schedule);
        let plan = compile_text(&text).into_compiled().unwrap_or_else(|e| panic!("{engine}: {e:?}")).plan;
        let d = &plan.simulation.devices[0];
        let at = |p: &str| d.by_phase.get(p).copied().unwrap_or(0.0);
        (at("forward"), at("recompute"), at("backward"))
    };
    let (forward, recompute, backward) = phases("engine: megatron\n", "dp-only");
    assert!(forward > 1.5 * recompute, "the forward waits for its gathers: {forward} against {recompute}");
    // without recompute the backward hides its gathers behind less compute
    let no_recompute =
        base.replace("  recompute: true\n", "").replace("ENGINE", "engine: megatron\n").replace("SCHEDULE", "dp-only");
    let plan = compile_text(&no_recompute).into_compiled().expect("compiles").plan;
    let without = plan.simulation.devices[0].by_phase.get("backward").copied().unwrap_or(0.0);
    assert!(
        backward <= without + 1e-9,
        "recompute's compute hides the backward's gathers: {backward} against {without}"
    );
    // pipec's executor gathers again for a recompute (the stage's whole gather, priced
    // where the plan declares it, may sit on either pass)
    let (forward, recompute, _) = phases("", "1f1b");
    assert!(recompute >= 0.99 * forward, "{forward} against {recompute}");
}

/// Multi-token prediction under expert parallelism: each module's block exchanges its
/// tokens with its experts like the model's, run with the output layer on the last stage,
/// so the output layer's dispatch carries every module's tokens (two modules twice one's).
#[test]
fn multi_token_prediction_exchanges_every_modules_tokens_with_its_experts() {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/moe-tiny.yaml")).expect("example");
    let head_exchange = |mtp: &str| -> u64 {
        let t = text.replacen("  loss: cross_entropy\n", &format!("  loss: cross_entropy\n  mtp: {mtp}\n"), 1);
        let plan = compile_text(&t).into_compiled().expect("compiles").plan;
        let head = (plan.layers.len() - 1) as u32;
        let bytes: Vec<u64> = plan
            .streams
            .values()
            .flatten()
            .filter_map(|i| match i {
                pipec_plan::Instr::AllToAll { layer, bytes, .. } if *layer == head => Some(*bytes),
                _ => None,
            })
            .collect();
        assert!(!bytes.is_empty() && bytes.iter().all(|b| *b == bytes[0]), "{bytes:?}");
        bytes[0]
    };
    let (one, two) = (head_exchange("1"), head_exchange("{ depth: 2 }"));
    assert!(one > 0);
    assert_eq!(two, 2 * one);
}

/// A language model of two transformer blocks of width `d` (`block`: the rest of their
/// arguments) over a 50-token vocabulary, sequences of `input`, on two CPU devices, with
/// the `strategy` mapping's lines given.
fn two_blocks(input: usize, d: usize, block: &str, strategy: &str) -> String {
    format!(
        "name: lm\nmodel:\n  input: [{input}]\n  layers:\n    - embedding(50, {d})\n    - repeat 2: transformer_block(d={d}, {block})\n    - layernorm\n    - linear({d}, 50)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: {{ kind: cpu, memory: 4GiB, throughput: 40GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 1GB/s, latency: 5us }}\nstrategy:\n{strategy}training:\n  batch_size: 4\n  steps: 1\n  optimizer: {{ kind: sgd, lr: 0.1 }}\n"
    )
}

/// The plan `text` compiles to (`what`: named when it does not).
fn compiled_plan(text: &str, what: &str) -> pipec_plan::Plan {
    compile_text(text).into_compiled().unwrap_or_else(|d| panic!("{what}: {d:?}")).plan
}

/// Under context parallelism a block whose backward runs its attention's forward again
/// (recompute by layers, or pipec's executor running the attention half again) exchanges its
/// keys and values again there: each such block's backward context time grows by its
/// forward's (the executor's own exchanges are held to the plan's declaration in
/// tests/training.rs). Recompute of the MLP half alone exchanges nothing again.
#[test]
fn a_block_run_again_in_the_backward_exchanges_its_keys_and_values_again() {
    let spec = |recompute: &str| {
        two_blocks(
            256,
            64,
            "heads=4, ff=128, causal=true",
            &format!("  stages: \"1\"\n  cp: 2\n  schedule: gpipe\n  microbatches: 1\n  recompute: {recompute}\n"),
        )
    };
    let context = |recompute: &str| compiled_plan(&spec(recompute), recompute).stages[0].context_s;
    let [forward, backward] = context("false");
    assert!(forward > 0.0 && backward > 0.0, "{forward} {backward}");
    // both blocks whole, or both attention halves: two blocks' forwards again
    for again in ["{ layers: 2 }", "{ modules: [layernorm] }"] {
        let [f, b] = context(again);
        assert_eq!(f, forward, "{again}");
        assert!(
            (b - (backward + forward)).abs() <= 1e-12 * backward.max(1.0),
            "{again}: {b} against {backward} + {forward}"
        );
    }
    // one block whole: half of it
    let [_, b] = context("{ layers: 1 }");
    assert!((b - (backward + forward / 2.0)).abs() <= 1e-12 * backward.max(1.0), "{b}");
    // the MLP alone: nothing again
    assert_eq!(context("{ modules: [mlp] }"), [forward, backward]);
}

/// Under expert parallelism a block whose backward runs its mixture of experts' forward again
/// dispatches and combines again there: the plan's `AllToAll` instructions list those
/// exchanges before the gradients' (`ExpertExchange::again`) and the stage's backward
/// exchange time grows by its forward's; recompute of the attention core alone exchanges
/// nothing again.
#[test]
fn a_mixture_run_again_in_the_backward_dispatches_and_combines_again() {
    let spec = |recompute: &str| {
        two_blocks(
            64,
            32,
            "heads=4, ff=64, causal=true, experts=4, top_k=2",
            &format!("  stages: \"2\"\n  ep: 2\n  schedule: gpipe\n  microbatches: 2\n  recompute: {recompute}\n"),
        )
    };
    let plan = |recompute: &str| compiled_plan(&spec(recompute), recompute);
    let kept = plan("false");
    let [forward, backward] = kept.stages[0].all_to_all_s;
    assert!(forward > 0.0 && backward > 0.0 && kept.stages[0].all_to_alls.iter().all(|x| !x.again));
    let count = |p: &pipec_plan::Plan| {
        p.streams.values().flatten().filter(|i| matches!(i, pipec_plan::Instr::AllToAll { .. })).count()
    };
    for again in ["{ modules: [moe_act] }", "{ layers: 2 }"] {
        let p = plan(again);
        assert!(p.stages[0].all_to_alls.iter().all(|x| x.again), "{again}");
        let [f, b] = p.stages[0].all_to_all_s;
        assert_eq!(f, forward, "{again}");
        assert!((b - (backward + forward)).abs() <= 1e-12 * backward, "{again}: {b} against {backward} + {forward}");
        // each backward posts each layer's dispatch and combine again: half as many again
        // as a forward and a backward post
        assert_eq!(2 * count(&p), 3 * count(&kept), "{again}");
    }
    let core = plan("{ modules: [core_attn] }");
    assert_eq!((core.stages[0].all_to_all_s, count(&core)), ([forward, backward], count(&kept)));
}

/// pipec's executor runs a block recomputed whole by layers (`layers: n`) again as one piece
/// keeping its input, but on a tensor-parallel stage by its two halves, each keeping its
/// input: there the plan counts what recompute of both halves keeps (as an operation list
/// does for the executor), elsewhere less.
#[test]
fn a_tensor_parallel_block_recomputed_whole_keeps_both_halves_inputs() {
    let spec = |stages: &str, recompute: &str| {
        two_blocks(
            64,
            32,
            "heads=4, ff=64, causal=true",
            &format!("  stages: {stages}\n  schedule: gpipe\n  microbatches: 1\n  recompute: {recompute}\n"),
        )
    };
    let kept = |stages: &str, recompute: &str| {
        compiled_plan(&spec(stages, recompute), recompute).stages[0].activation_bytes_per_microbatch
    };
    let tp = "\"1\"\n  tp: 2";
    assert_eq!(kept(tp, "{ layers: 2 }"), kept(tp, "{ ops: [matmul] }"));
    assert!(kept("straight", "{ layers: 2 }") < kept("straight", "{ ops: [matmul] }"));
}
