//! The command line as a user meets it: exit codes, JSON diagnostics, explain, bad input.

use std::path::Path;
use std::process::{Command, Output};

fn pipec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipec"))
        .args(args)
        .env("PIPEC_CPU_CALIBRATION", "off")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("pipec runs")
}

#[test]
fn check_exit_codes() {
    assert_eq!(pipec(&["check", "specs/mlp-1f1b.yaml"]).status.code(), Some(0));
    assert_eq!(pipec(&["check", "specs/invalid/bad-loss.yaml"]).status.code(), Some(1));
    assert_eq!(pipec(&["check", "specs/does-not-exist.yaml"]).status.code(), Some(2));
    assert_eq!(pipec(&["check"]).status.code(), Some(2));
    assert_eq!(pipec(&["check", "--format", "xml", "specs/mlp-1f1b.yaml"]).status.code(), Some(2));
    // a directory and a binary file are I/O errors, not panics
    assert_eq!(pipec(&["check", "specs"]).status.code(), Some(2));
}

#[test]
fn json_lines_have_the_documented_fields() {
    let out = pipec(&["check", "--format", "json", "specs/invalid/many-errors.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let lines: Vec<serde_json::Value> =
        text.lines().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect();
    assert_eq!(lines.len(), 4, "{text}");
    for d in &lines {
        for key in ["file", "code", "severity", "message", "help", "labels"] {
            assert!(d.get(key).is_some(), "missing {key} in {d}");
        }
        let label = &d["labels"][0];
        for key in ["label", "line", "column", "end_line", "end_column", "byte_start", "byte_end"] {
            assert!(label.get(key).is_some(), "missing labels[0].{key} in {d}");
        }
    }
    let unknown = lines.iter().find(|d| d["code"] == "E0102").expect("E0102 reported");
    assert_eq!(unknown["labels"][0]["line"], 24);
    assert_eq!(unknown["labels"][0]["column"], 3);
    assert_eq!(unknown["fix"]["replacement"], "microbatches");
}

#[test]
fn several_files_at_once_report_the_worst_exit() {
    let out = pipec(&["check", "specs/mlp-1f1b.yaml", "specs/invalid/bad-loss.yaml", "specs/gpipe.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    let (report, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // the verdicts are the report (standard output), the diagnostics go to standard error
    assert!(report.contains("specs/mlp-1f1b.yaml: ok") && err.contains("E0105"), "{report}\n{err}");
    assert!(report.contains("specs/invalid/bad-loss.yaml: 1 error(s)") && !report.contains("E0105"), "{report}");
}

/// A command's standard error, then its standard output: progress and diagnostics, then the
/// report.
fn both_streams(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout))
}

/// The text of a run's standard output and standard error.
fn streams(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `pipec compile` says when the all-to-alls it hides under overlapped pairs are priced for
/// an engine that overlaps them while the plan is for pipec's executor, which runs them in
/// line (`pipec run` repeats it): DualPipeV on the tiny mixture of experts under pipec, and
/// the combined 1F1B (`ep_overlap`) under pipec and under Megatron-LM, which runs it.
#[test]
fn compile_says_when_hidden_all_to_alls_run_in_line_on_pipecs_executor() {
    let dir = tempfile::tempdir().expect("tmp");
    // (without its data: the text file lies beside the example, not the copy)
    let text = std::fs::read_to_string("specs/moe-tiny.yaml")
        .expect("example")
        .replace("  data: { kind: text, path: data/architecture.txt }\n", "");
    let one_stage = text.replace("  stages: \"2-2\"\n", "  stages: \"4\"\n");
    let overlapped = one_stage.replace("  ep: 2\n", "  ep: 2\n  ep_overlap: true\n");
    let cases = [
        ("dualpipev", text.replace("  schedule: 1f1b\n", "  schedule: dualpipev\n"), true),
        ("ep_overlap", overlapped.clone(), true),
        ("ep_overlap, megatron", format!("engine: megatron\n{overlapped}"), false),
    ];
    for (what, spec, in_line) in cases {
        let path = dir.path().join("spec.yaml");
        std::fs::write(&path, &spec).expect("write");
        let out = dir.path().join("out");
        let (report, err) =
            streams(&pipec(&["compile", path.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8")]));
        let line =
            report.lines().find(|l| l.starts_with("all-to-all on")).unwrap_or_else(|| panic!("{what}: {report}{err}"));
        assert!(line.contains("hidden by its overlapped pairs"), "{what}: {line}");
        assert_eq!(line.contains("pipec's executor runs them in line"), in_line, "{what}: {line}");
    }
}

#[test]
fn reports_go_to_standard_output_and_diagnostics_to_standard_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let plan = dir.path().join("plan");
    // `pipec compile x.yaml > report.txt` keeps the report
    let (report, err) = streams(&pipec(&["compile", "specs/mlp-1f1b.yaml", "-o", plan.to_str().expect("utf-8")]));
    assert!(report.contains("predicted step") && report.contains("wrote "), "{report}");
    assert!(!err.contains("predicted step"), "{err}");
    // with --emit, standard output carries the emitted form alone and the report moves aside
    let (emitted, err) =
        streams(&pipec(&["compile", "specs/mlp-1f1b.yaml", "-o", plan.to_str().expect("utf-8"), "--emit", "memory"]));
    assert!(emitted.starts_with("device ") && !emitted.contains("predicted step"), "{emitted}");
    assert!(err.contains("predicted step"), "{err}");
    // a diagnostic stays on standard error
    let (report, err) = streams(&pipec(&["compile", "specs/invalid/bad-loss.yaml"]));
    assert!(report.is_empty() && err.contains("E0105"), "{report}\n{err}");
    // the tie is mentioned only for a model that has one
    let (report, _) = streams(&pipec(&["compile", "specs/mlp-1f1b.yaml", "-o", plan.to_str().expect("utf-8")]));
    assert!(!report.contains("tied"), "{report}");
    let (report, _) = streams(&pipec(&["compile", "specs/gpt2.yaml", "-o", plan.to_str().expect("utf-8")]));
    assert!(report.contains("a weight tied to an embedding counted once"), "{report}");
    // a language model's throughput in tokens too, in compile and compare
    assert!(report.lines().any(|l| l.starts_with("predicted step") && l.contains(" tokens/s)")), "{report}");
    let (table, _) = streams(&pipec(&["compare", "specs/gpt-tiny.yaml"]));
    assert!(table.lines().next().is_some_and(|h| h.contains("samples/s") && h.contains("tokens/s")), "{table}");
    let (table, _) = streams(&pipec(&["compare", "specs/mlp-1f1b.yaml"]));
    assert!(!table.contains("tokens/s"), "{table}");
}

#[test]
fn a_128_device_plan_reads_in_lines_that_do_not_grow_with_the_devices() {
    // Mixtral on 16 × 8 H100: DualPipeV over two ranks of 64 replicas, expert parallelism
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("plan");
    let compiled = pipec(&["compile", "tests/specs/mixtral-128-dualpipev.yaml", "-o", out.to_str().expect("utf-8")]);
    let (report, err) = streams(&compiled);
    assert_eq!(compiled.status.code(), Some(0), "{err}");
    // identical devices are one row, and a stage names its devices as a range
    assert!(report.contains("  s0: layers 0..9 on d0–d63 (64 devices) "), "{report}");
    assert!(report.lines().all(|l| !l.contains("d0,d1,d2")), "{report}");
    let rows: Vec<&str> =
        report.lines().skip_while(|l| !l.starts_with("device ")).skip(1).take_while(|l| l.starts_with('d')).collect();
    assert_eq!(rows.len(), 2, "{report}");
    assert!(rows[0].starts_with("d0–d63 (64 devices) ") && rows[1].starts_with("d64–d127 (64 devices) "), "{report}");
    // exposed never more than in flight: the all-to-alls are reported apart
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("plan.json")).expect("plan")).expect("json");
    for d in plan["simulation"]["devices"].as_array().expect("devices") {
        let (flight, exposed) =
            (d["collective_s"].as_f64().expect("s"), d["exposed_collective_s"].as_f64().expect("s"));
        assert!(exposed <= flight + 1e-12, "{}: {exposed} s exposed, {flight} s in flight", d["id"]);
    }
    assert!(report.lines().any(|l| l.starts_with("all-to-all on d")), "{report}");
    // the timeline: each device one row (a V's device holds two stages), every colour in the legend
    let timeline = std::fs::read_to_string(out.join("timeline.svg")).expect("timeline");
    let rows: Vec<&str> = timeline.lines().filter(|l| l.starts_with(r#"<text x="8""#)).collect();
    let mut unique = rows.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(rows.len(), unique.len(), "{rows:?}");
    assert!(rows.len() >= 2, "{rows:?}");
    for colour in ["#9c755f", "#b07aa1", "#f28e2b"] {
        let drawn = timeline.lines().filter(|l| l.contains(&format!("fill=\"{colour}\""))).count();
        // drawn in the chart and once in the legend
        assert!(drawn >= 2, "{colour} is drawn {drawn} time(s)");
    }
    assert!(timeline.contains(">all-to-all (expert parallelism)</text>"));
    // memory.svg: a bar per group of identical devices, labelled with its devices, titled axes
    let memory = std::fs::read_to_string(out.join("memory.svg")).expect("memory");
    assert!(memory.contains(">d0–d63 (64 devices)</text>") && memory.contains(">d64–d127 (64 devices)</text>"));
    assert!(memory.contains("128 devices in 2 bars of identical devices"));
    assert!(memory.contains(">bytes per device<") && memory.contains(">device<"));
}

#[test]
fn help_names_what_each_command_does() {
    let (help, _) = streams(&pipec(&["import", "--help"]));
    for word in ["Mixtral", "--nodes", "--devices-per-node", "--device", "5.x"] {
        assert!(help.contains(word), "{word}: {help}");
    }
    let (help, _) = streams(&pipec(&["search", "--help"]));
    assert!(help.contains("the same report as one JSON") && !help.contains("per diagnostic"), "{help}");
    // the cluster size from the command line
    let (spec, err) = streams(&pipec(&["import", "tests/import/llama-3-8b.json", "--nodes", "16", "--device", "h200"]));
    assert!(
        spec.contains("cluster:\n  nodes: 16\n  devices_per_node: 8\n  device: h200\n  links: dgx-h100\n"),
        "{spec}{err}"
    );
    let out = pipec(&["import", "tests/import/llama-3-8b.json", "--device", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--device `tpu` is not a device preset"));
}

#[test]
fn explain_prints_explanations() {
    let out = pipec(&["explain", "E0402"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("2-1-1"));
    assert_eq!(pipec(&["explain", "E9999"]).status.code(), Some(2));
    let list = pipec(&["explain", "--list"]);
    assert!(String::from_utf8_lossy(&list.stdout).lines().count() >= 30);
}

#[test]
fn schema_command_matches_committed_file() {
    let out = pipec(&["schema"]);
    let committed = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("schema/pipec.schema.json"))
        .expect("schema file");
    assert_eq!(String::from_utf8_lossy(&out.stdout), committed);
}

#[test]
fn run_says_what_bf16_and_fp16_compute_in() {
    let dir = tempfile::tempdir().expect("temp dir");
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/mlp-1f1b.yaml"))
        .expect("default spec");
    for (precision, says) in [
        ("bf16", "warning: under bf16 the executor computes every matrix product (dense layers, attention) in bf16 from fp32 master weights"),
        ("fp16", "warning: under fp16 the executor computes every matrix product (dense layers, attention) in fp16 from fp32 master weights, with dynamic loss scaling"),
        ("fp16-async", "warning: the plan asks for fp16 but the executor trains in fp32: fp16 needs dynamic loss scaling, and under an asynchronous schedule"),
    ] {
        let (precision, schedule) = match precision.split_once('-') {
            Some((p, _)) => (p, "pipedream"),
            None => (precision, "1f1b"),
        };
        let text = text
            .replace("  seed: 7\n", &format!("  seed: 7\n  precision: {precision}\n"))
            .replace("schedule: 1f1b", &format!("schedule: {schedule}"));
        assert!(text.contains(&format!("precision: {precision}")));
        let spec = dir.path().join(format!("{precision}-{schedule}.yaml"));
        std::fs::write(&spec, text).expect("write spec");
        let out_dir = dir.path().join(format!("{precision}-{schedule}"));
        let out = pipec(&[
            "run",
            spec.to_str().expect("utf-8 path"),
            "--steps",
            "2",
            "--out",
            out_dir.to_str().expect("utf-8 path"),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
    }
}

/// fp16's loss scaling at the command line: a regression whose scaled gradients overflow
/// prints each skipped step with the scale it overflowed at and the next, and
/// metrics.jsonl has every step's scale and whether it was skipped.
#[test]
fn run_prints_the_steps_fp16_loss_scaling_skips() {
    let dir = tempfile::tempdir().expect("temp dir");
    let rows: String = (0..96)
        .map(|i| {
            let x: Vec<f64> = (0..4).map(|k| (((i * 7 + k * 13) % 17) as f64 - 8.0) / 8.0).collect();
            format!("{},{},{},{},{}\n", x[0], x[1], x[2], x[3], 300.0 + 10.0 * x[0] - 5.0 * x[2])
        })
        .collect();
    std::fs::write(dir.path().join("big.csv"), rows).expect("csv");
    let spec = dir.path().join("fp16.yaml");
    std::fs::write(
        &spec,
        "model:\n  input: [4]\n  layers:\n    - linear(4, 16) -> relu\n    - linear(16, 1)\n  loss: mse\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: { memory: 1GiB, throughput: 10GFLOP/s }\n  links:\n    intra_node: { bandwidth: 10GB/s, latency: 5us }\nstrategy:\n  stages: straight\n  schedule: 1f1b\n  microbatches: 4\ntraining:\n  batch_size: 32\n  steps: 4\n  optimizer: { kind: sgd, lr: 0.00001 }\n  precision: fp16\n  seed: 5\n  data: { kind: csv, path: big.csv }\n",
    )
    .expect("spec");
    let out_dir = dir.path().join("out");
    let out = pipec(&["run", spec.to_str().expect("utf-8 path"), "--out", out_dir.to_str().expect("utf-8 path")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("skipped: a gradient overflowed at loss scale 65536 (now 32768)"), "{stderr}");
    assert!(stderr.contains("skipped: a gradient overflowed at loss scale 32768 (now 16384)"), "{stderr}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(out_dir.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    let scales: Vec<(f64, bool)> = lines
        .iter()
        .map(|v| (v["loss_scale"].as_f64().expect("scale"), v["skipped"].as_bool().expect("skipped")))
        .collect();
    assert_eq!(scales, vec![(65536.0, true), (32768.0, true), (16384.0, true), (8192.0, true)]);
}

#[test]
fn a_zero_plan_trains_to_the_same_losses_and_shows_the_state_each_replica_holds() {
    let dir = tempfile::tempdir().expect("temp dir");
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/data-parallel.yaml"))
        .expect("data-parallel spec");
    let losses = |zero: &str| {
        let spec = dir.path().join(format!("zero{zero}.yaml"));
        let text = text.replace("  microbatches: 4\n", &format!("  microbatches: 4\n  zero: {zero}\n"));
        std::fs::write(&spec, text).expect("write spec");
        let out_dir = dir.path().join(format!("out{zero}"));
        let out =
            pipec(&["run", spec.to_str().expect("utf-8"), "--steps", "3", "--out", out_dir.to_str().expect("utf-8")]);
        // the report (standard output) after the progress (standard error)
        let stderr = both_streams(&out);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl")).expect("metrics");
        let losses: Vec<f64> = metrics
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["loss"].as_f64().expect("loss"))
            .collect();
        (losses, stderr)
    };
    let (whole, stderr) = losses("0");
    let held = |stderr: &str| -> Vec<String> {
        stderr
            .lines()
            .skip_while(|l| !l.starts_with("model state held"))
            .skip(1)
            .take_while(|l| l.starts_with("  d"))
            .map(str::to_string)
            .collect()
    };
    let unsharded = held(&stderr);
    assert_eq!(unsharded.len(), 4, "{stderr}");
    for zero in ["1", "2", "3"] {
        let (sharded, stderr) = losses(zero);
        for (a, b) in whole.iter().zip(&sharded) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "zero {zero}: {whole:?} vs {sharded:?}");
        }
        // each replica's optimizer state (Adam's moments and the master weights' shard) is
        // a quarter of the whole and the plan's figure, printed in brackets beside it
        let lines = held(&stderr);
        assert_eq!(lines.len(), 4, "{stderr}");
        for line in &lines {
            let optimizer = line.split("optimizer ").nth(1).expect("an optimizer column");
            let (measured, predicted) = optimizer.split_once(" (").expect("measured (predicted)");
            if zero == "1" {
                assert_eq!(format!("{measured})"), predicted, "{line}");
            }
            assert!(!unsharded[0].contains(&format!("optimizer {measured} ")), "{line} against {}", unsharded[0]);
        }
        // linear layers only: every weight is gathered as the plan gathers it, per layer, and
        // the run has nothing to say about ZeRO-3
        assert!(!stderr.contains("under `zero: 3` the executor gathers"), "{stderr}");
        // the stage's biases gathered once a step (the data-parallel stage keeps its graphs
        // from its first forward to its last backward), on each of the 4 devices, and each
        // of its 3 linear weights before its product in the microbatch's forward and again
        // in its backward
        let gathers = stderr.lines().find(|l| l.starts_with("ZeRO-3 gathers of whole"));
        let by_product = stderr.lines().find(|l| l.starts_with("ZeRO-3 gathers of single"));
        match zero {
            "3" => {
                assert!(gathers.is_some_and(|l| l.ends_with(": d0 1, d1 1, d2 1, d3 1")), "{stderr}");
                assert!(by_product.is_some_and(|l| l.ends_with(": d0 6, d1 6, d2 6, d3 6")), "{stderr}");
            }
            _ => assert!(gathers.is_none() && by_product.is_none(), "{stderr}"),
        }
    }
}

/// The H100 calibration recorded in bench/specs/gpu/ (docs/benchmarks.md, "On an NVIDIA
/// H100"): a device file the front end reads, whose model prices the large products and adds
/// `pipec calibrate --backend cuda` measured there (its log, quoted here) within 5%, and which
/// the GPU benchmark's specs compile against.
#[test]
fn the_recorded_h100_calibration_prices_what_was_measured_and_compiles_the_gpu_specs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let file = root.join("bench/specs/gpu/h100-burn-cuda.json");
    let d = pipec_plan::device::DeviceModel::from_json(&std::fs::read_to_string(&file).expect("the device file"))
        .expect("a valid device file");
    // (m·k·n, measured µs) and (elements, measured µs) from the calibration's log
    for (flops, measured) in
        [(2.0 * 2048f64.powi(3), 422.7), (2.0 * 4096f64.powi(3), 2838.5), (2.0 * 8192.0 * 4096.0 * 4096.0, 5527.5)]
    {
        let t = d.matrix_time(flops, 0.0, pipec_plan::Precision::Fp32) * 1e6;
        assert!((t / measured - 1.0).abs() < 0.05, "{flops:e} FLOPs: priced {t:.1} µs, measured {measured} µs");
    }
    for (elements, measured) in [(1u64 << 24, 84.4), (1u64 << 26, 293.8)] {
        let t = (d.launch + d.memory_time(12.0 * elements as f64)) * 1e6;
        assert!((t / measured - 1.0).abs() < 0.05, "{elements} adds: priced {t:.1} µs, measured {measured} µs");
    }
    let dir = tempfile::tempdir().expect("temp dir");
    for name in ["mlp", "gpt2-blocks", "resnet50-res3"] {
        let text = std::fs::read_to_string(root.join(format!("bench/specs/gpu/{name}.yaml"))).expect("spec");
        let line = text.lines().find(|l| l.trim_start().starts_with("device:")).expect("a device line").to_string();
        let spec = dir.path().join(format!("{name}.yaml"));
        let named = format!("  device: {{ file: {} }}", file.display());
        std::fs::write(&spec, text.replace(&line, &named)).expect("write spec");
        let out =
            pipec(&["compile", spec.to_str().expect("utf-8"), "-o", dir.path().join(name).to_str().expect("utf-8")]);
        assert_eq!(out.status.code(), Some(0), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn calibrate_writes_a_device_file_a_spec_can_name_and_refuses_bad_flags() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("cpu.json");
    let out = pipec(&["calibrate", "-o", file.to_str().expect("utf-8"), "--reps", "3", "--memory", "4GiB"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("fp32 products") && stderr.contains("wrote"), "{stderr}");
    let device: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("the device file")).expect("json");
    assert_eq!(device["memory"].as_f64(), Some(4.0 * 1024.0 * 1024.0 * 1024.0));
    assert!(device["matrix"]["fp32"].as_f64().is_some_and(|r| r > 0.0), "{device}");
    // a spec naming it checks clean and compiles
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/mlp-1f1b.yaml"))
        .expect("default spec");
    let line = text.lines().find(|l| l.trim_start().starts_with("device:")).expect("a device line").to_string();
    let spec = dir.path().join("calibrated.yaml");
    std::fs::write(&spec, text.replace(&line, "  device: { file: cpu.json }")).expect("write spec");
    let out = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", dir.path().join("out").to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // with the executor's own work per layer pass, which a spec on the file plans with
    // unless it writes its own `overhead`: set to 1 ms forward and 3 ms backward here, every
    // layer's forward is 1 ms longer than with `overhead: 0s`, its backward 3 ms
    for field in ["layer_pass", "layer_pass_backward"] {
        let pass = device[field].as_f64();
        assert!(pass.is_some_and(|s| s.is_finite() && s >= 0.0), "{field}: {device}");
    }
    assert!(stderr.contains("the executor's own work per layer pass"), "{stderr}");
    let mut set = device.clone();
    set["layer_pass"] = serde_json::json!(1e-3);
    set["layer_pass_backward"] = serde_json::json!(3e-3);
    std::fs::write(dir.path().join("set.json"), set.to_string()).expect("write");
    let stage0 = |device_line: &str| -> (f64, f64, f64) {
        std::fs::write(&spec, text.replace(&line, device_line)).expect("write spec");
        let out_dir = dir.path().join("passes");
        let out = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", out_dir.to_str().expect("utf-8")]);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let plan: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out_dir.join("plan.json")).expect("plan")).expect("json");
        let s = &plan["stages"][0];
        let layers = s["layers"][1].as_f64().unwrap_or(0.0) - s["layers"][0].as_f64().unwrap_or(0.0);
        (s["forward_s"].as_f64().unwrap_or(f64::NAN), s["backward_s"].as_f64().unwrap_or(f64::NAN), layers)
    };
    let (fwd, bwd, layers) = stage0("  device: { file: set.json }");
    let (fwd0, bwd0, _) = stage0("  device: { file: set.json, overhead: 0s }");
    assert!(layers >= 1.0, "{layers}");
    assert!((fwd - fwd0 - 1e-3 * layers).abs() < 1e-9, "{fwd} against {fwd0} over {layers} layers");
    assert!((bwd - bwd0 - 3e-3 * layers).abs() < 1e-9, "{bwd} against {bwd0}");
    // the spec's own figure wins, twice its own a backward
    let (fwd5, bwd5, _) = stage0("  device: { file: set.json, overhead: 5ms }");
    assert!((fwd5 - fwd0 - 5e-3 * layers).abs() < 1e-9, "{fwd5} against {fwd0}");
    assert!((bwd5 - bwd0 - 10e-3 * layers).abs() < 1e-9, "{bwd5} against {bwd0}");
    // measured two at a time, as a plan of two devices shares this machine: named so
    let two = dir.path().join("two.json");
    let out = pipec(&["calibrate", "-o", two.to_str().expect("utf-8"), "--reps", "3", "--concurrent", "2"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let device: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&two).expect("the device file")).expect("json");
    assert_eq!(device["name"].as_str(), Some("cpu (pipec calibrate, 2 at once)"), "{device}");
    assert!(device["matrix"]["fp32"].as_f64().is_some_and(|r| r > 0.0), "{device}");
    // with the link between its two workers, which a spec's link level names
    let link = &device["link"];
    assert!(link["bandwidth"].as_f64().is_some_and(|b| b > 0.0), "{device}");
    assert!(link["efficiency"].as_f64().is_some_and(|e| e > 0.0 && e <= 1.0), "{device}");
    let intra = text.lines().find(|l| l.trim_start().starts_with("intra_node:")).expect("a link line").to_string();
    let linked =
        text.replace(&line, "  device: { file: two.json }").replace(&intra, "    intra_node: { file: two.json }");
    std::fs::write(&spec, &linked).expect("write spec");
    let out = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", dir.path().join("out").to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // a device file without a link measurement: a located error naming the command that
    // makes one
    std::fs::write(&spec, text.replace(&intra, "    intra_node: { file: cpu.json }")).expect("write spec");
    let out = pipec(&["check", spec.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("has no link measurement") && stderr.contains("--concurrent 2"), "{stderr}");
    // bad flags: a usage error, nothing written
    let bad = dir.path().join("bad.json");
    for args in [&["--concurrent", "0"][..], &["--concurrent", "lots"], &["--backend", "cuda", "--concurrent", "2"]] {
        let mut all = vec!["calibrate", "-o", bad.to_str().expect("utf-8"), "--reps", "3"];
        all.extend_from_slice(args);
        let out = pipec(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!bad.exists(), "{args:?}");
    }
    for memory in ["lots", "0GiB", "8GB/s"] {
        let out = pipec(&["calibrate", "-o", bad.to_str().expect("utf-8"), "--reps", "3", "--memory", memory]);
        assert_eq!(out.status.code(), Some(2), "{memory}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("error:"), "{memory}");
    }
    assert!(!bad.exists());
    // an output path under a file: refused, nothing left behind
    let under = file.join("x.json");
    let out = pipec(&["calibrate", "-o", under.to_str().expect("utf-8"), "--reps", "3"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read_to_string(&file).expect("still there").contains("fp32"));
}

#[test]
fn mixtral_with_expert_parallelism_reports_its_all_to_alls_and_a_small_one_trains() {
    let dir = tempfile::tempdir().expect("tmp");
    // Mixtral 8x7B on 8 DGX H100 with ep 8 (t 2, 4 interleaved stages, 8 replicas): one
    // expert per block on each replica, split over its two ranks: 1/8 of the routed
    // experts' weights
    let plan = dir.path().join("plan");
    let compiled = pipec(&["compile", "bench/specs/mixtral-8x7b-ep8.yaml", "-o", plan.to_str().expect("utf-8")]);
    let report = both_streams(&compiled);
    assert_eq!(compiled.status.code(), Some(0), "{report}");
    assert!(
        report.contains("expert parallelism: ep 8 — each replica holds 1, split over its 2 tensor-parallel ranks, of every block's 8 experts, tokens reach them in all-to-alls inside every pass; an expert's gradient is summed over the 1 replica(s) holding it"),
        "{report}"
    );
    assert!(
        report.lines().any(|l| l.starts_with("all-to-all on d") && l.contains("per step inside its passes")),
        "{report}"
    );
    assert!(report.lines().any(|l| l.starts_with("d0") && l.contains("1.75 GiB")), "{report}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plan.join("plan.json")).expect("plan")).expect("json");
    assert_eq!(json["stages"][1]["expert_parallel"], 8);
    assert!(json["stages"][1]["all_to_all_s"][0].as_f64().is_some_and(|t| t > 0.0));
    // a small one trains, each member keeping its own experts as the plan counts them (no
    // caveat), and with tensor parallelism inside each expert too
    let tiny = dir.path().join("tiny.yaml");
    std::fs::write(
        &tiny,
        "model:\n  input: [8]\n  layers:\n    - embedding(50, 16)\n    - transformer_block(16, 2, 32, experts=4)\n    - linear(16, 50, bias=false)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: { memory: 1GiB, throughput: 1GFLOP/s }\n  links:\n    intra_node: { bandwidth: 1GB/s, latency: 5us }\nstrategy:\n  dp: 2\n  schedule: dp-only\n  microbatches: 2\n  ep: 2\ntraining:\n  batch_size: 4\n  steps: 1\n  optimizer: { kind: sgd, lr: 0.1 }\n  data: synthetic\n",
    )
    .expect("spec");
    let out = dir.path().join("run");
    let run = pipec(&["run", tiny.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{said}");
    assert!(!said.contains("under `ep: 2`"), "{said}");
    assert!(out.join("metrics.jsonl").exists());
    let text = std::fs::read_to_string(&tiny).expect("spec");
    let with_tp = text
        .replace("devices_per_node: 2", "devices_per_node: 4")
        .replace("  ep: 2\n", "  ep: 2\n  tp: 2\n")
        .replace("experts=4)", "experts=4, bias=false)");
    std::fs::write(&tiny, with_tp).expect("spec");
    let out = dir.path().join("run-tp");
    let run = pipec(&["run", tiny.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{said}");
    assert!(!said.contains("under `ep: 2`"), "{said}");
    assert!(out.join("metrics.jsonl").exists());
}

/// specs/moe-tiny.yaml — a character-level language model of 8 experts (top 2) and a shared
/// expert per block on a text file, 2 stages × 2 replicas with `ep: 2` — trains as one
/// device does under 1F1B, DualPipeV and DualPipe: every step's loss and load-balancing
/// loss within 1e-5, the tokens each expert took exactly, the final weights (every expert
/// joined from the member keeping it) within 1e-5; and both fall.
#[test]
fn the_tiny_mixture_of_experts_trains_with_expert_parallelism_as_one_device_does() {
    let dir = tempfile::tempdir().expect("tmp");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("specs/moe-tiny.yaml"))
        .expect("spec")
        .replace(
            "path: data/architecture.txt",
            &format!("path: {}", root.join("specs/data/architecture.txt").display()),
        )
        .replace("steps: 30", "steps: 20")
        .replace("  seed: 5\n", "  seed: 5\n  checkpoint: { every: 20 }\n");
    let one = text
        .replace("stages: \"2-2\"", "stages: \"1\"")
        .replace("  ep: 2\n", "")
        .replace("devices_per_node: 4", "devices_per_node: 1");
    type Weights = std::collections::BTreeMap<(u64, u32), Vec<f32>>;
    let metrics = |name: &str, spec: &str| -> (Vec<serde_json::Value>, Weights) {
        let path = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, spec).expect("spec");
        let out = dir.path().join(name);
        let run = pipec(&["run", path.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8")]);
        assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
        let steps = std::fs::read_to_string(out.join("metrics.jsonl"))
            .expect("metrics")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        let saved = pipec_plan::checkpoint::read(&out.join("checkpoints/step-000020")).expect("a checkpoint");
        (steps, saved.params.into_iter().map(|(k, (_, v))| (k, v)).collect())
    };
    let (reference, whole) = metrics("one", &one);
    let number = |v: &serde_json::Value, key: &str| v[key].as_f64().expect(key);
    let mut ep = Vec::new();
    for schedule in ["1f1b", "dualpipev", "dualpipe"] {
        let (steps, weights) = metrics(schedule, &text.replace("schedule: 1f1b", &format!("schedule: {schedule}")));
        assert_eq!(steps.len(), 20);
        for (a, b) in reference.iter().zip(&steps) {
            for key in ["loss", "aux_loss"] {
                let (x, y) = (number(a, key), number(b, key));
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs(),
                    "{schedule} step {}: {key} {x} on one device, {y} with ep",
                    a["step"]
                );
            }
            assert_eq!(a["expert_tokens"], b["expert_tokens"], "{schedule} step {}", a["step"]);
        }
        assert_eq!(weights.keys().collect::<Vec<_>>(), whole.keys().collect::<Vec<_>>(), "{schedule}");
        for (k, a) in &whole {
            let b = &weights[k];
            // the difference's norm against the tensor's (Adam's steps on the few values whose
            // gradients nearly cancel follow the float sums' order most)
            assert_eq!(a.len(), b.len(), "{schedule}: parameter {k:?}");
            let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
            let off = norm(&mut a.iter().zip(b).map(|(x, y)| f64::from(x - y)));
            let relative = off / norm(&mut a.iter().map(|x| f64::from(*x))).max(1e-12);
            assert!(relative <= 1e-5, "{schedule}: parameter {k:?} differs by {relative} of its norm");
        }
        if schedule == "1f1b" {
            ep = steps;
        }
    }
    // the first four steps' mean against the last four's (one step's is noisy)
    let mean = |steps: &[serde_json::Value], key: &str| steps.iter().map(|s| number(s, key)).sum::<f64>() / 4.0;
    for key in ["loss", "aux_loss"] {
        let (first, last) = (mean(&ep[..4], key), mean(&ep[16..], key));
        assert!(last < first, "{key}: {first} in the first four steps, {last} in the last four");
    }
}

#[test]
fn a_mixture_of_experts_compiles_with_its_memory_and_run_refuses_what_it_cannot_train_writing_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec = "bench/specs/mixtral-8x7b.yaml";
    let checked = pipec(&["check", spec]);
    assert_eq!(checked.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&checked.stdout)
        .contains("ok, 46,702,792,704 parameters (12,879,925,248 active per token)"));
    // Mixtral 8x7B on 8 DGX H100: t 8, 4 interleaved stages, 2 replicas sharing the
    // optimizer state — it fits, and the report counts every expert's weights: a device
    // holds 2 of 8 chunks of 32 blocks (≈ 11.7B parameters) over 8 tensor-parallel ranks
    // in bf16, 2.73 GiB
    let plan = dir.path().join("plan");
    let compiled = pipec(&["compile", spec, "-o", plan.to_str().expect("utf-8")]);
    let report = both_streams(&compiled);
    assert_eq!(compiled.status.code(), Some(0), "{report}");
    assert!(report.contains("model: 46,702,792,704 parameters (12,879,925,248 active per token)"), "{report}");
    assert!(
        report.contains(
            "mixture of experts: routing assumed uniform — each of the 8 experts takes 1/8 of the tokens' 2 choices"
        ),
        "{report}"
    );
    let d0 = report.lines().find(|l| l.starts_with("d0")).expect("d0's memory");
    assert!(d0.contains("2.73 GiB"), "{d0}");
    // on this machine's CPU the 64 devices' model state (about a terabyte) is refused before
    // anything is allocated or written, not left to the kernel's out-of-memory killer
    let out = dir.path().join("run");
    let run = pipec(&["run", spec, "-o", out.to_str().expect("utf-8")]);
    assert_eq!(run.status.code(), Some(1));
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(said.contains("of model state (weights, gradients, optimizer) by the plan"), "{said}");
    assert!(said.contains("the run would be killed for memory"), "{said}");
    assert!(!out.exists());
    // the executor splits experts with the load-balancing loss over tensor-parallel ranks
    // (tests/training.rs): with it, the same plan is refused for its memory alone
    let balanced = dir.path().join("balanced.yaml");
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(spec)).expect("mixtral");
    std::fs::write(&balanced, text.replace("top_k=2)", "top_k=2, aux_loss=0.01)")).expect("spec");
    let run = pipec(&["run", balanced.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8")]);
    assert_eq!(run.status.code(), Some(1));
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(said.contains("the run would be killed for memory") && !said.contains("(a mixture of experts)"), "{said}");
    assert!(!out.exists());
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/llama-tiny.yaml"))
        .expect("llama-tiny")
        .replace("rope=10000, bias=false)", "rope=10000, bias=false, experts=4, top_k=2, aux_loss=0.01)")
        .replace(": data/", &format!(": {}/", Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/data").display()));
    // a tiny Llama with expert blocks trains: each step's load-balancing loss and the tokens
    // each block's experts took are in metrics.jsonl and on the console
    let aux = dir.path().join("aux.yaml");
    std::fs::write(&aux, text).expect("spec");
    let run = pipec(&["run", aux.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8"), "--steps", "2"]);
    let said = both_streams(&run);
    assert_eq!(run.status.code(), Some(0), "{said}");
    assert!(said.contains("load-balancing loss"), "{said}");
    // and the routing as it happened: each expert's share of the run's tokens, per block
    assert!(said.contains("tokens each expert took over the run"), "{said}");
    let shares: Vec<&str> = said.lines().filter(|l| l.starts_with("  layer ")).collect();
    assert_eq!(shares.len(), 2, "{said}");
    assert!(shares.iter().all(|l| l.matches('%').count() == 4 && l.ends_with("×)")), "{said}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
    for line in metrics.lines() {
        let m: serde_json::Value = serde_json::from_str(line).expect("json");
        assert!(m["aux_loss"].as_f64().is_some_and(|a| a > 0.0), "{line}");
        // blocks 1 and 2 (layers), four experts each, two choices of 16·64 tokens
        let tokens = m["expert_tokens"].as_object().expect("expert_tokens");
        assert_eq!(tokens.keys().collect::<Vec<_>>(), ["1", "2"], "{line}");
        for took in tokens.values() {
            let took: Vec<u64> = serde_json::from_value(took.clone()).expect("counts");
            assert_eq!((took.len(), took.iter().sum::<u64>()), (4, 2 * 16 * 64), "{line}");
        }
    }
}

#[test]
fn run_prints_predicted_and_measured_time_by_instruction_kind() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/mlp-1f1b.yaml");
    let out_dir = dir.path().join("out");
    let out = pipec(&["run", spec.to_str().expect("utf-8"), "--steps", "3", "--out", out_dir.to_str().expect("utf-8")]);
    let stderr = both_streams(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("time per step by instruction kind"), "{stderr}");
    // the plan's prediction per kind is what the table shows, and the run measured each
    let plan: pipec_plan::Plan =
        pipec_plan::Plan::from_json(&std::fs::read_to_string(out_dir.join("plan.json")).expect("plan")).expect("plan");
    for kind in ["forward", "backward", "send/receive", "optimizer"] {
        let row =
            stderr.lines().find(|l| l.trim_start().starts_with(kind)).unwrap_or_else(|| panic!("{kind}: {stderr}"));
        assert!(row.contains("predicted") && row.contains("measured"), "{row}");
        let predicted: f64 = plan.simulation.devices.iter().filter_map(|d| d.by_phase.get(kind)).sum();
        if kind == "forward" {
            assert!(predicted > 0.0, "the plan prices its forwards");
        }
    }
}

#[test]
fn run_verifies_a_plan_file_and_refuses_an_edited_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/mlp-1f1b.yaml");
    let compiled = dir.path().join("compiled");
    let out = pipec(&["compile", spec.to_str().expect("utf-8 path"), "-o", compiled.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(compiled.join("plan.json")).expect("plan")).expect("json");
    // (edit, what the error names)
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let edits: Vec<(Edit, &str)> = vec![
        (Box::new(|p| p["streams"]["0"].as_array_mut().expect("stream").reverse()), "before its forward"),
        (Box::new(|p| p["stages"][0]["layers"] = serde_json::json!([3, 1])), "covers layers [3, 1)"),
        (Box::new(|p| p["training"]["batch_size"] = serde_json::json!(0)), "batch_size 0"),
        (Box::new(|p| p["model"]["input"] = serde_json::json!([0])), "model.input"),
        (Box::new(|p| p["stages"][1]["route"] = serde_json::json!([7])), "route"),
        // every setting a spec's checker enforces holds for a plan file too
        (Box::new(|p| p["training"]["checkpoint_every"] = serde_json::json!(0)), "checkpoint_every must be at least 1"),
        (Box::new(|p| p["training"]["steps"] = serde_json::json!(0)), "training.steps must be at least 1, found 0"),
        (
            Box::new(|p| p["training"]["optimizer"]["lr"] = serde_json::json!(-0.1)),
            "optimizer.lr must be larger than 0",
        ),
        (
            Box::new(|p| {
                p["training"]["optimizer"] =
                    serde_json::json!({"kind": "sgd", "lr": 0.1, "momentum": -0.5, "weight_decay": 0.0})
            }),
            "optimizer.momentum must be in [0, 1), found -0.5",
        ),
        (
            Box::new(|p| {
                p["training"]["data"] = serde_json::json!({"kind": "synthetic", "task": "classification", "samples": 0})
            }),
            "training.samples must be at least 1",
        ),
        (Box::new(|p| p["stages"][0]["group"] = serde_json::json!(99)), "is not a group of this stage"),
        (Box::new(|p| p["name"] = serde_json::json!("../escaped")), "climbs out of the output folder"),
        (Box::new(|p| p["training"]["checkpoint_dir"] = serde_json::json!("/tmp/abs")), "is absolute"),
    ];
    for (i, (edit, expect)) in edits.iter().enumerate() {
        let mut p = plan.clone();
        edit(&mut p);
        let file = dir.path().join(format!("edited-{i}.json"));
        std::fs::write(&file, p.to_string()).expect("write");
        let out_dir = dir.path().join(format!("out-{i}"));
        let out = pipec(&[
            "run",
            file.to_str().expect("utf-8 path"),
            "--steps",
            "1",
            "-o",
            out_dir.to_str().expect("utf-8 path"),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "edit {i}: {stderr}");
        assert!(stderr.contains("does not pass verification") && stderr.contains(expect), "edit {i}: {stderr}");
        assert!(!stderr.contains("panicked"), "edit {i}: {stderr}");
        assert!(!out_dir.exists(), "edit {i}: nothing is written for a refused plan");
    }
    // --no-verify skips the stream verifier (not the structural check): the reversed
    // streams then fail at run time, naming the device and instruction
    let out = pipec(&[
        "run",
        dir.path().join("edited-0.json").to_str().expect("utf-8 path"),
        "--no-verify",
        "--timeout",
        "2",
        "--steps",
        "1",
        "-o",
        dir.path().join("nv").to_str().expect("utf-8 path"),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("device d") && !stderr.contains("does not pass verification"), "{stderr}");
    let out = pipec(&[
        "run",
        dir.path().join("edited-1.json").to_str().expect("utf-8 path"),
        "--no-verify",
        "--steps",
        "1",
        "-o",
        dir.path().join("nv1").to_str().expect("utf-8 path"),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("covers layers [3, 1)"), "the structure is checked even so");
    // the unedited plan runs
    let out = pipec(&[
        "run",
        compiled.join("plan.json").to_str().expect("utf-8 path"),
        "--steps",
        "1",
        "-o",
        dir.path().join("ok").to_str().expect("utf-8 path"),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn compare_lists_every_schedule_fastest_first_and_says_why_one_does_not_apply() {
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/mlp-1f1b.yaml");
    let out = pipec(&["compare", spec.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(rows.len(), 11, "{text}");
    for s in [
        "gpipe",
        "1f1b",
        "interleaved",
        "zb-h1",
        "zbv",
        "dualpipev",
        "dualpipe",
        "chimera",
        "pipedream",
        "2bw",
        "dp-only",
    ] {
        assert!(rows.iter().any(|r| r.starts_with(s) || r.contains(&format!("kind: {s}"))), "{s} missing:\n{text}");
    }
    // planned rows come first, in order of step time; then the ones that do not apply
    let dp = rows.iter().position(|r| r.starts_with("dp-only")).expect("dp-only row");
    assert_eq!(dp, rows.len() - 1);
    assert!(rows[dp].contains("n/a") && rows[dp].contains("runs the whole model as one stage"), "{}", rows[dp]);
    let seconds = |r: &str| {
        let (v, unit) =
            (r[42..].split_whitespace().next().expect("step"), r[42..].split_whitespace().nth(1).expect("unit"));
        let v: f64 = v.parse().expect("number");
        v * match unit {
            "s" => 1.0,
            "ms" => 1e-3,
            "µs" => 1e-6,
            other => panic!("unit {other}"),
        }
    };
    let steps: Vec<f64> = rows[..dp].iter().map(|r| seconds(r)).collect();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
    // the row of the spec's own schedule is the plan `pipec compile` makes
    let row = rows.iter().find(|r| r.starts_with("1f1b ")).expect("1f1b row");
    assert!(row.contains("452.5 µs") && row.contains("15.9%"), "{row}");
    // JSON lines for scripts: the same numbers, one object per schedule
    let out = pipec(&["compare", spec.to_str().expect("utf-8 path"), "--format", "json"]);
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(lines.len(), 11);
    let ob = lines.iter().find(|l| l["schedule"] == "1f1b").expect("1f1b");
    assert!(
        (ob["step_time_s"].as_f64().expect("step") - 452.5e-6).abs() < 1e-7
            && ob["synchronous"] == true
            && ob["fits"] == true,
        "{ob}"
    );
    assert!(lines.iter().any(|l| l["schedule"] == "dp-only" && l["not_applicable"].is_string()));
    // a microbatch sweep: every schedule with each count; a count that does not divide
    // the batch is not applicable, with the check's reason
    let out = pipec(&["compare", spec.to_str().expect("utf-8 path"), "--microbatches", "8,5", "--format", "json"]);
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(lines.len(), 22);
    let gpipe5 = lines.iter().find(|l| l["schedule"] == "gpipe" && l["microbatches"] == 5).expect("gpipe at 5");
    assert!(
        gpipe5["not_applicable"].as_str().is_some_and(|w| w.contains("not divisible into 5 microbatches")),
        "{gpipe5}"
    );
    let ob8 = lines.iter().find(|l| l["schedule"] == "1f1b" && l["microbatches"] == 8).expect("1f1b at 8");
    // 1F1B's bubble shrinks with more microbatches: (D−1)/(D−1+N) with free transfers
    assert!(
        ob8["bubble_fraction"].as_f64().expect("bubble") < ob["bubble_fraction"].as_f64().expect("bubble"),
        "{ob8} vs {ob}"
    );
    // a sweep needs a `microbatches` key to vary
    let dir = tempfile::tempdir().expect("temp dir");
    let no_key = dir.path().join("no-key.yaml");
    std::fs::write(&no_key, std::fs::read_to_string(&spec).expect("spec").replace("  microbatches: 4\n", ""))
        .expect("write");
    let out = pipec(&["compare", no_key.to_str().expect("utf-8 path"), "--microbatches", "2,4"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs a `microbatches` key"));
    // a spec with errors is not compared
    let bad = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/invalid/bad-loss.yaml");
    let out = pipec(&["compare", bad.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("E0105"));
}

#[test]
fn zero_steps_is_a_usage_error_not_a_run_that_trains_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out_dir = dir.path().join("out");
    let out = pipec(&["run", "specs/mlp-1f1b.yaml", "--steps", "0", "-o", out_dir.to_str().expect("utf-8 path")]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`--steps 0` trains nothing"));
    assert!(!out_dir.exists(), "nothing is written");
}

#[test]
fn an_endless_or_binary_input_is_refused_after_its_first_bytes() {
    for args in [["run", "/dev/zero"], ["check", "/dev/zero"], ["compile", "/dev/zero"]] {
        let out = pipec(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("it is not a text file"), "{args:?}: {stderr}");
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let not_json = dir.path().join("plan.json");
    std::fs::write(&not_json, "name: a yaml spec\n").expect("write");
    let out = pipec(&["run", not_json.to_str().expect("utf-8 path")]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("it is not JSON"));
}

/// One LSP frame.
fn frame(body: &str) -> Vec<u8> {
    format!("Content-Length: {}\r\n\r\n{body}", body.len()).into_bytes()
}

/// The JSON bodies of the frames `pipec lsp` wrote.
fn lsp_replies(stdout: &[u8]) -> Vec<serde_json::Value> {
    let text = String::from_utf8_lossy(stdout);
    text.split("Content-Length: ")
        .filter_map(|part| part.split_once("\r\n\r\n"))
        .filter_map(|(_, body)| serde_json::from_str(body.trim_end()).ok())
        .collect()
}

fn lsp_session(input: &[u8]) -> (Option<i32>, Vec<serde_json::Value>) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_pipec"))
        .arg("lsp")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("pipec lsp starts");
    child.stdin.take().expect("stdin").write_all(input).expect("write");
    let out = child.wait_with_output().expect("ends");
    (out.status.code(), lsp_replies(&out.stdout))
}

const LSP_INIT: &str = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"capabilities":{}}}"#;
const LSP_INITIALIZED: &str = r#"{"jsonrpc":"2.0","method":"initialized","params":{}}"#;

#[test]
fn the_language_server_answers_malformed_input_with_errors_and_keeps_serving() {
    let mut input = [frame(LSP_INIT), frame(LSP_INITIALIZED)].concat();
    input.extend(frame("{this is not json"));
    input.extend(b"Content-Length: 12x\r\n\r\n");
    input.extend(b"Content-Length: 2\r\n\r\n\xff\xfe");
    let open = r#"{"jsonrpc":"2.0","method":"textDocument/didOpen","params":{"textDocument":{"uri":"file:///t/s.yaml","languageId":"yaml","version":1,"text":"strategy:\n  schedule: 1f1b\n"}}}"#;
    input.extend(frame(open));
    let hover = r#"{"jsonrpc":"2.0","id":7,"method":"textDocument/hover","params":{"textDocument":{"uri":"file:///t/s.yaml"},"position":{"line":1,"character":13}}}"#;
    input.extend(frame(hover));
    input.extend(frame(r#"{"jsonrpc":"2.0","id":8,"method":"shutdown"}"#));
    input.extend(frame(r#"{"jsonrpc":"2.0","method":"exit"}"#));
    let (code, replies) = lsp_session(&input);
    assert_eq!(code, Some(0), "shutdown then exit: {replies:?}");
    assert!(replies.iter().all(|r| r["jsonrpc"] == "2.0"), "every reply is JSON-RPC 2.0: {replies:?}");
    let errors: Vec<i64> =
        replies.iter().filter_map(|r| r["error"]["code"].as_i64()).filter(|&c| c == -32700).collect();
    assert_eq!(errors.len(), 3, "one parse error per bad frame: {replies:?}");
    let hovered = replies.iter().find(|r| r["id"] == 7).expect("the hover after the bad frames is answered");
    assert!(hovered["result"]["contents"]["value"].as_str().is_some_and(|v| v.contains("1f1b")), "{hovered}");
}

#[test]
fn the_language_server_exits_with_1_without_shutdown() {
    let input = [frame(LSP_INIT), frame(LSP_INITIALIZED), frame(r#"{"jsonrpc":"2.0","method":"exit"}"#)].concat();
    assert_eq!(lsp_session(&input).0, Some(1));
    // the client going away (stdin closed) without shutdown
    assert_eq!(lsp_session(&[frame(LSP_INIT), frame(LSP_INITIALIZED)].concat()).0, Some(1));
}

/// A spec whose `depth` blocks each call the next (`b0` holds the one layer).
fn nested_blocks_spec(depth: usize) -> String {
    let mut text = String::from("name: deep\nmodel:\n  input: [8]\n  blocks:\n    b0(n):\n      - linear(n, n)\n");
    for i in 1..depth {
        text.push_str(&format!("    b{i}(n):\n      - b{}(n)\n", i - 1));
    }
    text.push_str(&format!("  layers:\n    - b{}(8)\n    - linear(8, 2)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 1\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n  stages: straight\n  schedule: gpipe\n  microbatches: 1\ntraining:\n  batch_size: 4\n  steps: 1\n  optimizer: {{ kind: sgd, lr: 0.1 }}\n  data: {{ kind: synthetic, samples: 8 }}\n", depth - 1));
    text
}

#[test]
fn five_thousand_nested_blocks_are_a_diagnostic_in_check_and_in_the_language_server() {
    // they overflowed the stack: `pipec check` aborted and `pipec lsp` died
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = dir.path().join("deep.yaml");
    let text = nested_blocks_spec(5000);
    std::fs::write(&spec, &text).expect("write");
    let out = pipec(&["check", spec.to_str().expect("utf-8"), "--format", "json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("\"E0313\""), "{stdout}");
    let open = serde_json::json!({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {"uri": "file:///t/deep.yaml", "languageId": "yaml", "version": 1, "text": text}}});
    let hover = r#"{"jsonrpc":"2.0","id":7,"method":"textDocument/hover","params":{"textDocument":{"uri":"file:///t/deep.yaml"},"position":{"line":0,"character":1}}}"#;
    let input = [
        frame(LSP_INIT),
        frame(LSP_INITIALIZED),
        frame(&open.to_string()),
        frame(hover),
        frame(r#"{"jsonrpc":"2.0","id":8,"method":"shutdown"}"#),
        frame(r#"{"jsonrpc":"2.0","method":"exit"}"#),
    ]
    .concat();
    let (code, replies) = lsp_session(&input);
    assert_eq!(code, Some(0), "the server ended badly: {replies:?}");
    let published = replies.iter().find(|r| r["method"] == "textDocument/publishDiagnostics").expect("diagnostics");
    assert!(published.to_string().contains("E0313"), "{published}");
    assert!(replies.iter().any(|r| r["id"] == 7), "the hover after the deep spec is answered");
}

#[test]
fn a_hand_edited_plan_or_profile_is_refused_with_the_field_not_a_panic() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let plan_dir = dir.path().join("plan");
    let spec = root.join("specs/transformer.yaml");
    let out = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", plan_dir.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let mut plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(plan_dir.join("plan.json")).expect("plan")).expect("json");
    // a token vocabulary that is not the embedding's (1000) made a worker panic in Burn's
    // gather on synthetic token data
    for vocab in [serde_json::json!(4000), serde_json::json!(3), serde_json::Value::Null] {
        plan["model"]["token_vocab"] = vocab.clone();
        let edited = dir.path().join("edited.json");
        std::fs::write(&edited, plan.to_string()).expect("write");
        let out = pipec(&[
            "run",
            edited.to_str().expect("utf-8"),
            "--steps",
            "1",
            "-o",
            dir.path().join("o").to_str().expect("utf-8"),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "token_vocab {vocab}: {stderr}");
        assert!(stderr.contains("token_vocab") && !stderr.contains("panicked"), "token_vocab {vocab}: {stderr}");
    }
    // a profile whose times are -1 predicted a 0.0 µs step
    let layers = plan["layers"].as_array().expect("layers").len();
    let profile = serde_json::json!({
        "version": 1,
        "batch_size": 8,
        "backend": "cpu",
        "layers": (0..layers).map(|i| serde_json::json!({
            "index": i, "name": "layer", "forward_ms": -1.0, "backward_ms": -1.0, "update_ms": 0.0,
            "activation_bytes": 0, "output_bytes": 0, "parameter_bytes": 0
        })).collect::<Vec<_>>()
    });
    let bad = dir.path().join("profile.json");
    std::fs::write(&bad, profile.to_string()).expect("write");
    let out = pipec(&[
        "compile",
        spec.to_str().expect("utf-8"),
        "--profile",
        bad.to_str().expect("utf-8"),
        "-o",
        dir.path().join("c").to_str().expect("utf-8"),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("forward_ms -1") && stderr.contains("finite and not negative"), "{stderr}");
    assert!(!dir.path().join("c").exists(), "nothing is written");
}

#[test]
fn a_search_that_chooses_nothing_names_the_real_reason() {
    // each used to say "no strategy fits in device memory"
    let out = pipec(&["search", "specs/mlp-1f1b.yaml", "--max-depth", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--max-depth must be at least 1"), "{stderr}");
    let out = pipec(&["search", "specs/mlp-1f1b.yaml", "--schedules", "pipedream"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("`pipedream` is asynchronous") && stdout.contains("--async"), "{stdout}");
    assert!(!stdout.contains("fits in device memory"), "{stdout}");
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = dir.path().join("tp3.yaml");
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/mlp-1f1b.yaml"))
        .expect("spec")
        .replace("devices_per_node: 2", "devices_per_node: 8")
        .replace("  stages: \"1-1\"", "  stages: auto\n  tp: 3");
    std::fs::write(&spec, text).expect("write");
    let out = pipec(&["search", spec.to_str().expect("utf-8"), "--format", "json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let why = report["none_because"].as_str().expect("a reason");
    assert!(why.starts_with("no valid strategy") && why.contains("tp = 3 does not divide"), "{why}");
    let out = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", dir.path().join("o").to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("E0607") && stderr.contains("does not divide"), "{stderr}");
    assert!(!stderr.contains("fits in device memory"), "{stderr}");
    // Mixtral 8x7B on one node of 8 H100s: how much its state takes and how many nodes would
    // hold it
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/specs/mixtral-8x7b.yaml"))
        .expect("mixtral");
    let (head, rest) = text.split_once("strategy:").expect("strategy");
    let (_, training) = rest.split_once("training:").expect("training");
    let one_node = dir.path().join("mixtral-1.yaml");
    std::fs::write(&one_node, format!("{}strategy: auto\ntraining:{training}", head.replace("nodes: 8", "nodes: 1")))
        .expect("write");
    let out = pipec(&["search", one_node.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("no strategy fits in device memory on this cluster: the model's weights, gradients and optimizer state take 782.92 GiB (46,702,792,704 parameters × 18 B); the 8 devices hold ")
            && said.contains("at least 2 nodes of 8 devices hold it sharded over every device (ZeRO-3), before activations"),
        "{said}"
    );
}

/// `specs/mlp-1f1b.yaml` with `steps` steps and a checkpoint every 2 steps into `ckpts/`.
fn checkpointing_spec(dir: &Path, steps: usize) -> std::path::PathBuf {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/mlp-1f1b.yaml"))
        .expect("spec")
        .replace("  steps: 30\n", &format!("  steps: {steps}\n  checkpoint: {{ every: 2, dir: ckpts }}\n"));
    let path = dir.join("spec.yaml");
    std::fs::write(&path, text).expect("write");
    path
}

/// The steps in a run's `metrics.jsonl`: its complete lines (a run still writing may have
/// a last line without its newline yet).
fn metric_steps(run: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["step"].as_u64().expect("step"))
        .collect()
}

#[test]
fn resume_finds_the_specs_checkpoint_dir_keeps_earlier_metrics_and_a_failed_resume_touches_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = checkpointing_spec(dir.path(), 4);
    let run = dir.path().join("run");
    let (s, r) = (spec.to_str().expect("utf-8"), run.to_str().expect("utf-8"));
    assert_eq!(pipec(&["run", s, "-o", r]).status.code(), Some(0));
    assert_eq!(metric_steps(&run), vec![0, 1, 2, 3]);
    // a resume that finds nothing fails before anything is written
    let out = pipec(&["run", s, "-o", r, "--resume", dir.path().join("nowhere").to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(metric_steps(&run), vec![0, 1, 2, 3], "a failed resume leaves the metrics alone");
    // the run directory names the checkpoint: found under the spec's `checkpoint.dir`
    let first_trace = std::fs::read(run.join("trace.json")).expect("trace");
    let out = pipec(&["run", s, "-o", r, "--resume", r, "--steps", "6"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(metric_steps(&run), vec![0, 1, 2, 3, 4, 5], "earlier steps kept, resumed ones appended");
    // the banner says it resumed, and the first run's trace is kept beside the resumed one's
    assert!(stderr.contains(&format!("resuming from {r} at step 4")), "{stderr}");
    assert_eq!(std::fs::read(run.join("trace.json")).expect("trace"), first_trace);
    let resumed: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("trace-from-step-4.json")).expect("resumed trace"))
            .expect("json");
    // every compute track is named, by its device
    let names: Vec<&str> = resumed["traceEvents"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["name"] == "thread_name" && e["pid"] == 0)
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(
        !names.is_empty() && names.iter().all(|n| n.starts_with("device ") && n.ends_with(" compute")),
        "{names:?}"
    );
}

/// Every file of a run folder (recursively) with its bytes.
fn folder_contents(dir: &Path) -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.insert(p.strip_prefix(dir).expect("inside").to_path_buf(), std::fs::read(&p).expect("read"));
            }
        }
    }
    out
}

#[test]
fn a_resume_from_a_corrupt_checkpoint_leaves_the_output_folder_byte_for_byte() {
    // the reported case: 8 steps into `run`, 4 into `half`, a byte of `half`'s weights
    // flipped, then `--resume half -o run` (it truncated run's metrics to 4 lines and
    // rewrote its plan.json)
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = checkpointing_spec(dir.path(), 8);
    let (run, half) = (dir.path().join("run"), dir.path().join("half"));
    let s = spec.to_str().expect("utf-8");
    assert_eq!(pipec(&["run", s, "-o", run.to_str().expect("utf-8")]).status.code(), Some(0));
    let out = pipec(&["run", s, "-o", half.to_str().expect("utf-8"), "--steps", "4"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let weights = half.join("ckpts/step-000004/model.safetensors");
    let mut bytes = std::fs::read(&weights).expect("weights");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&weights, bytes).expect("write");
    let before = folder_contents(&run);
    assert_eq!(metric_steps(&run).len(), 8);
    let out = pipec(&["run", s, "-o", run.to_str().expect("utf-8"), "--resume", half.to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("model.safetensors"), "the error names the damaged file: {stderr}");
    assert!(folder_contents(&run) == before, "a failed resume changed the output folder");
    // a checkpoint of another model fails the same way, before anything is written
    let other = dir.path().join("other.yaml");
    let text = std::fs::read_to_string(&spec).expect("spec").replace("relu", "gelu");
    std::fs::write(&other, text).expect("write");
    let out = pipec(&[
        "run",
        other.to_str().expect("utf-8"),
        "-o",
        run.to_str().expect("utf-8"),
        "--resume",
        run.to_str().expect("utf-8"),
    ]);
    assert_ne!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(folder_contents(&run) == before, "a resume that does not fit changed the output folder");
    // an output folder under a file is refused before anything runs
    let under_file = run.join("metrics.jsonl").join("sub");
    let out = pipec(&["run", s, "-o", under_file.to_str().expect("utf-8"), "--steps", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is a file") && !stderr.contains("training"), "{stderr}");
    assert!(folder_contents(&run) == before);
}

/// A small PipeDream "2-1-1" pipeline under `schedule` (flush-free: its steps leave
/// microbatches in flight), `steps` long.
fn flush_free_spec(dir: &Path, schedule: &str, steps: usize) -> std::path::PathBuf {
    let text = format!(
        "name: flush-free\nmodel:\n  input: [32]\n  layers:\n    - linear(32, 64) -> relu\n    - repeat 4: linear(64, 64) -> relu\n    - linear(64, 4)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 4\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n  stages: \"2-1-1\"\n  schedule: {schedule}\n  microbatches: 8\ntraining:\n  batch_size: 64\n  steps: {steps}\n  optimizer: {{ kind: momentum, lr: 0.01 }}\n  seed: 2\n  data: {{ kind: synthetic, samples: 256 }}\n"
    );
    let path = dir.join(format!("{schedule}.yaml"));
    std::fs::write(&path, text).expect("write");
    path
}

#[test]
fn sigterm_stops_a_flush_free_pipeline_at_a_drained_step_boundary() {
    // under PipeDream and 2BW a step leaves microbatches in flight; a stop used to end the
    // workers mid-pipeline ("d3 disconnected", no trace.json) about 3 times in 4 when the
    // signal came early
    let dir = tempfile::tempdir().expect("temp dir");
    for schedule in ["pipedream", "2bw"] {
        let spec = flush_free_spec(dir.path(), schedule, 100000);
        for (round, wait_for_steps) in [0usize, 1, 1, 3].into_iter().enumerate() {
            let run = dir.path().join(format!("{schedule}-{round}"));
            let mut child = Command::new(env!("CARGO_BIN_EXE_pipec"))
                .env("PIPEC_CPU_CALIBRATION", "off")
                .args(["run", spec.to_str().expect("utf-8"), "-o", run.to_str().expect("utf-8")])
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("starts");
            // the signal handlers are in place once it says it is training
            let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stderr.take().expect("stderr")));
            let mut stderr = String::new();
            for line in lines.by_ref() {
                let line = line.expect("utf-8");
                stderr.push_str(&line);
                stderr.push('\n');
                if line.contains("training") {
                    break;
                }
            }
            let start = std::time::Instant::now();
            while metric_steps(&run).len() < wait_for_steps {
                assert!(start.elapsed() < std::time::Duration::from_secs(60), "no steps after 60 s");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
            assert!(killed.success());
            for line in lines {
                stderr.push_str(&line.expect("utf-8"));
                stderr.push('\n');
            }
            let status = child.wait().expect("ends");
            assert_eq!(status.code(), Some(1), "{schedule}, round {round}: {stderr}");
            assert!(stderr.contains("interrupted: stopped after "), "{schedule}, round {round}: {stderr}");
            assert!(!stderr.contains("disconnected"), "{schedule}, round {round}: {stderr}");
            let steps = metric_steps(&run);
            assert!(steps.iter().enumerate().all(|(i, &s)| s == i as u64), "{steps:?}");
            if !steps.is_empty() {
                assert!(run.join("trace.json").is_file(), "{schedule}, round {round}: no trace.json");
            }
        }
    }
}

#[test]
fn sigterm_stops_at_a_step_boundary_and_keeps_every_completed_step() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = checkpointing_spec(dir.path(), 100000);
    let run = dir.path().join("run");
    let child = Command::new(env!("CARGO_BIN_EXE_pipec"))
        .env("PIPEC_CPU_CALIBRATION", "off")
        .args(["run", spec.to_str().expect("utf-8"), "-o", run.to_str().expect("utf-8")])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starts");
    // wait for a few steps on disk, then ask it to stop
    let start = std::time::Instant::now();
    while metric_steps(&run).len() < 3 {
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "no steps after 60 s");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(killed.success());
    let out = child.wait_with_output().expect("ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("interrupted: stopped after "), "{stderr}");
    // the exact command that resumes it, from its last checkpoint
    let resume = stderr.lines().find_map(|l| l.strip_prefix("resume with: ")).expect("a resume command");
    assert!(resume.starts_with(&format!("pipec run {} --out {} --resume ", spec.display(), run.display())), "{resume}");
    let last = Path::new(resume.rsplit(' ').next().expect("a path"));
    assert!(last.is_dir() && last.join("state.json").is_file(), "{resume}");
    let steps = metric_steps(&run);
    assert!(steps.len() >= 3 && steps.iter().enumerate().all(|(i, &s)| s == i as u64), "{steps:?}");
    assert!(run.join("trace.json").is_file());
    let leftovers: Vec<_> = std::fs::read_dir(&run)
        .expect("dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn compile_resume_shows_which_layers_move_between_devices_and_how_many_bytes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = checkpointing_spec(dir.path(), 2);
    let run = dir.path().join("run");
    let out = pipec(&["run", spec.to_str().expect("utf-8"), "-o", run.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    // the same model on three stages instead of two
    let three = dir.path().join("three.yaml");
    let text = std::fs::read_to_string(&spec)
        .expect("spec")
        .replace("stages: \"1-1\"", "stages: \"1-1-1\"")
        .replace("devices_per_node: 2", "devices_per_node: 3");
    std::fs::write(&three, text).expect("write");
    let out = pipec(&[
        "compile",
        three.to_str().expect("utf-8"),
        "-o",
        dir.path().join("c").to_str().expect("utf-8"),
        "--resume",
        run.to_str().expect("utf-8"),
    ]);
    let stderr = both_streams(&out);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("(step 2, layout `1-1`) onto `1-1-1`"), "{stderr}");
    assert!(
        stderr.contains("d0 -> d0  stays") && stderr.contains("d1 -> d2") && stderr.contains("KiB to move"),
        "{stderr}"
    );
}

#[test]
fn compare_shows_the_flush_free_schedules_steady_state_without_a_bubble() {
    // D uniform stages, free communication: PipeDream and 2BW keep every device busy in
    // their steady state; 1F1B, whose later stages send their input gradient before their
    // weight pass, idles 2(D − 1)/(3N + 2(D − 1)) of each step (linear layers: B = 2F,
    // B_in = F; compiler/tests/schedules.rs). A free `flatten` reads the input, so that the
    // first linear layer computes its input gradient as the others do and the stages are equal
    let dir = tempfile::tempdir().expect("tmp");
    for d in [2usize, 4, 8] {
        let n = 2 * d;
        let text = format!(
            "model:\n  input: [64]\n  layers:\n    - flatten\n    - repeat {layers}: linear(64, 64)\n  loss: mse\ncluster:\n  nodes: 1\n  devices_per_node: {d}\n  device: {{ memory: 64GiB, throughput: 1GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 1000000TB/s, latency: 0us }}\nstrategy:\n  stages: straight\n  schedule: 1f1b\n  microbatches: {n}\ntraining:\n  batch_size: {batch}\n  steps: 1\n  optimizer: {{ kind: sgd, lr: 0.1 }}\n",
            layers = 2 * d,
            batch = 4 * n
        );
        let path = dir.path().join(format!("uniform{d}.yaml"));
        std::fs::write(&path, text).expect("write");
        let out = pipec(&["compare", path.to_str().expect("path"), "--format", "json"]);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let rows: Vec<serde_json::Value> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("json")).collect();
        let row = |s: &str| rows.iter().find(|r| r["schedule"] == s).unwrap_or_else(|| panic!("{s}: {rows:?}"));
        for s in ["pipedream", "2bw"] {
            let r = row(s);
            assert_eq!(r["steady_state"], true, "{r}");
            assert!(r["bubble_fraction"].as_f64().expect("bubble") <= 0.01, "D={d} {s}: {r}");
            assert!(r["first_step_time_s"].as_f64() > r["step_time_s"].as_f64(), "D={d} {s}: {r}");
        }
        // the trade-off is visible: PipeDream stashes versions, 2BW keeps two, 1F1B one
        assert!(row("pipedream")["weight_versions"].as_u64() >= Some(2), "{rows:?}");
        assert_eq!(row("2bw")["weight_versions"], 2);
        assert_eq!(row("1f1b")["weight_versions"], 1);
        let f = row("1f1b");
        let closed = 2.0 * (d as f64 - 1.0) / (3.0 * n as f64 + 2.0 * (d as f64 - 1.0));
        assert!((f["bubble_fraction"].as_f64().expect("bubble") - closed).abs() < 1e-6, "D={d}: {f}");
        assert!(f.get("steady_state").is_none());
    }
}

/// `pipec check` means it will compile: every example spec that checks clean compiles
/// without an error that needs no search (a search that finds nothing, E0607, is the only
/// error left to `compile`); and a plan-level rule (E0411, a weight tied across stages
/// under an asynchronous schedule) comes from `check` too, with the front end's errors.
#[test]
fn check_is_clean_only_when_compile_finds_nothing_without_a_search() {
    let dir = tempfile::tempdir().expect("temp dir");
    let codes = |out: &Output| -> Vec<String> {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|d| d["severity"] == "error")
            .filter_map(|d| d["code"].as_str().map(str::to_string))
            .collect()
    };
    let mut specs: Vec<std::path::PathBuf> = std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs"))
        .expect("specs")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    specs.sort();
    assert!(specs.len() >= 15);
    for spec in &specs {
        let path = spec.to_str().expect("utf-8");
        let checked = pipec(&["check", path, "--format", "json"]);
        if checked.status.code() != Some(0) {
            continue;
        }
        let out = dir.path().join(spec.file_stem().expect("name"));
        let compiled = pipec(&["compile", path, "-o", out.to_str().expect("utf-8"), "--format", "json"]);
        if compiled.status.code() != Some(0) {
            let errors = codes(&compiled);
            assert!(
                errors.iter().all(|c| c == "E0607"),
                "{path}: check was clean and compile says {errors:?}\n{}",
                String::from_utf8_lossy(&compiled.stderr)
            );
        }
    }
    // the model's size where a user looks: GPT-2 small's published count, its tied output
    // layer counted once, in `check` and in `compile`
    let checked = pipec(&["check", "specs/gpt2.yaml"]);
    assert!(String::from_utf8_lossy(&checked.stdout).contains("ok, 124,439,808 parameters"));
    let out = dir.path().join("gpt2");
    let compiled = pipec(&["compile", "specs/gpt2.yaml", "-o", out.to_str().expect("utf-8")]);
    assert!(String::from_utf8_lossy(&compiled.stdout).contains("model: 124,439,808 parameters"));
    // a tied language model on two PipeDream stages: the plan-level error from `check`
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/gpt-tiny.yaml")).expect("gpt-tiny");
    let bad = dir.path().join("tied-pipedream.yaml");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/data/");
    let text = text.replace("path: data/", &format!("path: {}", data.display()));
    std::fs::write(&bad, text.replace("schedule: 1f1b", "schedule: pipedream")).expect("write");
    let checked = pipec(&["check", bad.to_str().expect("utf-8"), "--format", "json"]);
    assert_eq!(codes(&checked), vec!["E0411".to_string()], "{}", String::from_utf8_lossy(&checked.stdout));
}

#[test]
fn import_writes_specs_that_check_clean_with_the_published_parameter_counts() {
    // the config.json files of the published checkpoints (tests/import/), and their
    // parameter counts as the model cards and `transformers` give them
    let dir = tempfile::tempdir().expect("temp dir");
    for (config, parameters) in [
        ("llama-2-7b", "6,738,415,616"),
        ("mistral-7b", "7,241,732,096"),
        // and 12,879,925,248 active per token (two of eight experts)
        ("mixtral-8x7b", "46,702,792,704"),
        ("llama-3-8b", "8,030,261,248"),
        ("gpt2-medium", "354,823,168"),
        ("qwen2-0.5b", "494,032,768"),
        // query/key norms, and heads of 128 on d = 2048 with 32 heads (not d/heads = 64);
        // 3,353,032,704 active per token (eight of 128 experts)
        ("qwen3-8b", "8,190,735,360"),
        ("qwen3-30b-a3b", "30,532,122,624"),
        // BertModel's 109,482,240 and a two-class classifier, 768·2 + 2
        ("bert-base-uncased", "109,483,778"),
    ] {
        let spec = dir.path().join(format!("{config}.yaml"));
        let out = pipec(&[
            "import",
            &format!("tests/import/{config}.json"),
            "-o",
            spec.to_str().expect("utf-8 path"),
            "--name",
            config,
        ]);
        assert!(out.status.success(), "{config}: {}", String::from_utf8_lossy(&out.stderr));
        let out = pipec(&["check", spec.to_str().expect("utf-8 path")]);
        let said = both_streams(&out);
        assert!(out.status.success(), "{config}: {said}");
        assert!(said.contains(&format!("ok, {parameters} parameters")), "{config}: {said}");
    }
    // the same checkpoints' configs as transformers 5 saves them (`dtype`, `rope_parameters`,
    // `layer_types`, and in two of them every generic field of `PretrainedConfig`): the same
    // spec as the 4.x config, and the generic fields named in a note
    for (config, parameters) in [
        ("llama-2-7b", "6,738,415,616"),
        ("mistral-7b", "7,241,732,096"),
        ("llama-3-8b", "8,030,261,248"),
        // Qwen2.5-7B's published count
        ("qwen2.5-7b", "7,615,616,512"),
    ] {
        let spec = dir.path().join(format!("{config}-5.yaml"));
        let out = pipec(&[
            "import",
            &format!("tests/import/transformers-5/{config}.json"),
            "-o",
            spec.to_str().expect("utf-8 path"),
            "--name",
            config,
        ]);
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{config}: {said}");
        if matches!(config, "mistral-7b" | "qwen2.5-7b") {
            assert!(said.contains("note: ") && said.contains("`return_dict`, "), "{config}: {said}");
        }
        let four = dir.path().join(format!("{config}.yaml"));
        if four.exists() {
            let same = std::fs::read_to_string(&four).expect("4.x spec");
            assert_eq!(std::fs::read_to_string(&spec).expect("5.x spec"), same, "{config}");
        }
        let out = pipec(&["check", spec.to_str().expect("utf-8 path")]);
        let said = both_streams(&out);
        assert!(said.contains(&format!("ok, {parameters} parameters")), "{config}: {said}");
    }
    // Llama 3.1's scaled rotary embeddings import as the block's `rope_scaling=llama3`, and
    // the spec checks with Llama 3.1 8B's parameter count (that of Llama 3 8B)
    let scaled = dir.path().join("llama-3.1.json");
    let text = std::fs::read_to_string("tests/import/transformers-5/llama-3-8b.json").expect("config");
    let llama3 = r#""factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_type": "llama3""#;
    let text = text.replace("\"rope_theta\": 500000.0,\n    \"rope_type\": \"default\"", llama3);
    assert!(text.contains("llama3"));
    std::fs::write(&scaled, text).expect("write");
    let spec = dir.path().join("llama-3.1.yaml");
    let out = pipec(&["import", scaled.to_str().expect("utf-8"), "-o", spec.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let written = std::fs::read_to_string(&spec).expect("spec");
    assert!(
        written.contains(
            "rope=500000, rope_scaling=llama3, rope_factor=8, rope_low_freq=1, rope_high_freq=4, rope_original=8192"
        ),
        "{written}"
    );
    let out = pipec(&["check", spec.to_str().expect("utf-8")]);
    assert!(both_streams(&out).contains("ok, 8,030,261,248 parameters"), "{}", both_streams(&out));
    // a scaling without the figures its kind needs is refused naming the figure
    let bare = dir.path().join("bare.json");
    let text = std::fs::read_to_string("tests/import/llama-3-8b.json").expect("config");
    std::fs::write(&bare, text.replace("\"rope_scaling\": null", "\"rope_scaling\": {\"rope_type\": \"llama3\"}"))
        .expect("write");
    let out = pipec(&["import", bare.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs `factor`"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // a field that would change the model is refused by name, and nothing is written
    let bad = dir.path().join("scaled.json");
    let text = std::fs::read_to_string("tests/import/llama-3-8b.json").expect("config");
    std::fs::write(&bad, text.replace("\"rope_scaling\": null", "\"rope_scaling\": {\"rope_type\": \"longrope\"}"))
        .expect("write");
    let target = dir.path().join("scaled.yaml");
    let out = pipec(&["import", bad.to_str().expect("utf-8"), "-o", target.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`rope_scaling"));
    assert!(!target.exists());
}

/// `pipec run SPEC --init INIT --out OUT` (and `extra` flags), asserting it succeeds.
fn run_from_hugging_face(spec: &Path, init: &Path, out: &Path, extra: &[&str]) {
    let mut args = vec![
        "run",
        spec.to_str().expect("utf-8"),
        "--init",
        init.to_str().expect("utf-8"),
        "--out",
        out.to_str().expect("utf-8"),
    ];
    args.extend_from_slice(extra);
    let o = pipec(&args);
    assert!(o.status.success(), "{}: {}", spec.display(), String::from_utf8_lossy(&o.stderr));
}

/// `pipec export` of the run's checkpoint into `exported`: the same tensor names as
/// `expected` (torch's state after the step), each within 1e-5 of its largest value.
fn export_equals(name: &str, run: &Path, exported: &Path, expected: &pipec_plan::hf::Tensors) {
    let out =
        pipec(&["export", run.join("checkpoints").to_str().expect("utf-8"), "-o", exported.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    let got = pipec_plan::hf::read_dir(exported).expect("exported");
    assert_eq!(got.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>(), "{name}");
    for (tensor, (shape, want)) in expected {
        let (got_shape, values) = &got[tensor];
        assert_eq!(got_shape, shape, "{name}: {tensor}");
        let scale = want.iter().fold(0.0_f32, |m, v| m.max(v.abs()));
        let worst = values.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0_f32, f32::max);
        assert!(worst <= 1e-5 * scale, "{name}: {tensor} differs from torch's by {worst:e} (largest value {scale})");
    }
}

/// Each step's loss in a run folder's `metrics.jsonl`.
fn run_losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["loss"].as_f64().expect("loss"))
        .collect()
}

/// The mean next-token cross-entropy of a fixture's logits over its rows, concatenated
/// and followed by token 7 (what pipec's windows of a token file of those rows train on).
fn fixture_loss(fixture: &Path, vocab: usize) -> (Vec<u16>, usize, f64) {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("reference.json")).expect("fixture")).expect("json");
    let ids: Vec<Vec<u16>> = serde_json::from_value(reference["input_ids"].clone()).expect("ids");
    let logits: Vec<f64> = serde_json::from_value(reference["logits"].clone()).expect("logits");
    let seq = ids[0].len();
    let mut tokens: Vec<u16> = ids.concat();
    tokens.push(7);
    let mut loss = 0.0;
    for (p, row) in logits.chunks(vocab).enumerate() {
        let target = usize::from(tokens[p + 1]);
        let max = row.iter().fold(f64::MIN, |m, v| m.max(*v));
        let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        loss += lse - row[target];
    }
    (tokens, seq, loss / (ids.len() * seq) as f64)
}

/// Trains the spec `{name}-{devices}.yaml` (`model`, a spec's `model:` section, with
/// `optimizer`) from `--init fixture` on one device and on a two-stage pipeline with tensor
/// parallelism 2, each on the token file `tokens` written into `dir`; each first loss is
/// `expected` within 1e-5.
fn starts_at_loss_on_any_layout(
    dir: &Path,
    name: &str,
    model: &str,
    optimizer: &str,
    fixture: &Path,
    tokens: &[u16],
    expected: f64,
) {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(dir.join("tokens.bin"), bytes).expect("tokens");
    for (devices, layout) in [(1, "stages: \"1\""), (4, "stages: \"1-1\"\n  tp: 2")] {
        let spec = format!(
            "name: {name}\n{model}\
             cluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ kind: cpu, memory: 2GiB, throughput: 20GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\n\
             strategy:\n  {layout}\n  schedule: 1f1b\n  microbatches: 2\n\
             training:\n  batch_size: 2\n  steps: 2\n  optimizer: {optimizer}\n  data: {{ kind: tokens, path: tokens.bin, dtype: uint16 }}\n"
        );
        let path = dir.join(format!("{name}-{devices}.yaml"));
        std::fs::write(&path, spec).expect("spec");
        let out_dir = dir.join(format!("out-{devices}"));
        run_from_hugging_face(&path, fixture, &out_dir, &[]);
        let loss = run_losses(&out_dir)[0];
        assert!(
            (loss - expected).abs() <= 1e-5 * expected,
            "{layout}: pipec's first loss {loss}, transformers' {expected}"
        );
    }
}

#[test]
fn a_llama_3_1_config_with_scaled_rotary_embeddings_imports_and_trains_from_init_at_transformers_loss() {
    // tests/reference/hf/rope-llama3: a tiny Llama whose config has Llama 3.1's
    // `rope_type: llama3` (its context scaled down so the scaling changes the logits), saved
    // by transformers 5
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf/rope-llama3");
    let (tokens, seq, expected) = fixture_loss(&fixture, 50);
    let dir = tempfile::tempdir().expect("temp dir");
    let imported = dir.path().join("imported.yaml");
    let out = pipec(&[
        "import",
        fixture.join("config.json").to_str().expect("utf-8"),
        "--seq",
        &seq.to_string(),
        "-o",
        imported.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&imported).expect("spec");
    assert!(
        text.contains("rope_scaling=llama3, rope_factor=8, rope_low_freq=1, rope_high_freq=4, rope_original=64"),
        "{text}"
    );
    // the imported model, trained on the fixture's rows on one device and on two pipeline
    // stages with tensor parallelism
    let model: String = text
        .lines()
        .skip_while(|l| !l.starts_with("model:"))
        .take_while(|l| l.starts_with("model:") || l.starts_with(' '))
        .map(|l| format!("{l}\n"))
        .collect();
    starts_at_loss_on_any_layout(
        dir.path(),
        "llama31",
        &model,
        "{ kind: adamw, lr: 0.001 }",
        &fixture,
        &tokens,
        expected,
    );
    // exported, the config keeps the scaling: imported back, the same blocks
    let spec = std::fs::read_to_string(dir.path().join("llama31-1.yaml"))
        .expect("spec")
        .replace("steps: 2", "steps: 2\n  checkpoint: { every: 2, dir: checkpoints }");
    std::fs::write(dir.path().join("train.yaml"), spec).expect("spec");
    let run = dir.path().join("trained");
    run_from_hugging_face(&dir.path().join("train.yaml"), &fixture, &run, &[]);
    let exported = dir.path().join("exported");
    let out = pipec(&[
        "export",
        run.join("checkpoints/step-000002").to_str().expect("utf-8"),
        "-o",
        exported.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let config = std::fs::read_to_string(exported.join("config.json")).expect("config");
    assert!(config.contains("\"rope_type\": \"llama3\""), "{config}");
    let out = pipec(&["import", exported.join("config.json").to_str().expect("utf-8"), "--seq", &seq.to_string()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let block = |t: &str| t.lines().find(|l| l.contains("transformer_block(")).map(str::trim).map(String::from);
    assert_eq!(block(&String::from_utf8_lossy(&out.stdout)), block(&text));
}

#[test]
fn a_run_initialised_from_a_hugging_face_checkpoint_starts_at_transformers_loss_on_any_layout() {
    // tests/reference/hf/llama-gqa: a tiny random Llama (grouped-query attention, rotary
    // embeddings, SwiGLU) and the logits transformers computed for two rows of token ids.
    // The token file holds both rows and one more token, so pipec's two windows are those
    // rows; their loss at step 0 is the cross-entropy of transformers' logits.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf/llama-gqa");
    let (tokens, seq, expected) = fixture_loss(&fixture, 50);
    let dir = tempfile::tempdir().expect("temp dir");
    let model = format!(
        "model:\n  input: [{seq}]\n  layers:\n    - embedding(50, 16)\n    - repeat 2: transformer_block(d=16, heads=4, ff=24, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false)\n    - rmsnorm\n    - linear(16, 50, bias=false) as lm_head\n  loss: cross_entropy\n"
    );
    starts_at_loss_on_any_layout(
        dir.path(),
        "init",
        &model,
        "{ kind: adamw, lr: 0.001, weight_decay: 0.1 }",
        &fixture,
        &tokens,
        expected,
    );
    // export: trained 2 steps on the tensor-parallel pipeline, the checkpoint exported, a
    // run initialised from the export on one device starts at the loss the pipeline's third
    // step had (every step trains on the same two windows)
    let spec = std::fs::read_to_string(dir.path().join("init-4.yaml"))
        .expect("spec")
        .replace("steps: 2", "steps: 3\n  checkpoint: { every: 2, dir: checkpoints }");
    std::fs::write(dir.path().join("train.yaml"), spec).expect("spec");
    let run = dir.path().join("trained");
    run_from_hugging_face(&dir.path().join("train.yaml"), &fixture, &run, &[]);
    let losses = run_losses(&run);
    let exported = dir.path().join("exported");
    let out = pipec(&[
        "export",
        run.join("checkpoints/step-000002").to_str().expect("utf-8"),
        "-o",
        exported.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // the --init folder's config fields come along: its token ids and its context of 32
    // positions, not the training window
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exported.join("config.json")).expect("config")).expect("json");
    assert_eq!((config["bos_token_id"].as_u64(), config["eos_token_id"].as_u64()), (Some(1), Some(2)), "{config}");
    assert_eq!(config["max_position_embeddings"].as_u64(), Some(32), "{config}");
    // its config imports back into the same model
    let out = pipec(&["import", exported.join("config.json").to_str().expect("utf-8"), "--seq", "12"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains(
        "transformer_block(d=16, heads=4, ff=24, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false)"
    ));
    let again = dir.path().join("again");
    run_from_hugging_face(&dir.path().join("init-1.yaml"), &exported, &again, &["--steps", "1"]);
    let loss = run_losses(&again)[0];
    assert!(
        (loss - losses[2]).abs() <= 1e-5 * losses[2],
        "from the export {loss}, the pipeline's step 2 {}",
        losses[2]
    );
    assert!((losses[2] - expected).abs() > 1e-3, "training changed the weights");
    // exporting over an existing folder is refused and leaves it as it was
    let out = pipec(&[
        "export",
        run.join("checkpoints/step-000002").to_str().expect("utf-8"),
        "-o",
        exported.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    // an --init folder's tokenizer files are carried into the export
    let init = dir.path().join("with-tokenizer");
    std::fs::create_dir_all(&init).expect("folder");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), init.join(f)).expect("copy");
    }
    let tokenizer = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/data/bpe-512.json")).expect("bpe");
    std::fs::write(init.join("tokenizer.json"), &tokenizer).expect("write");
    std::fs::write(init.join("tokenizer_config.json"), "{\"bos_token\": \"<s>\"}\n").expect("write");
    let tokenized = dir.path().join("tokenized");
    run_from_hugging_face(&dir.path().join("train.yaml"), &init, &tokenized, &["--steps", "2"]);
    let exported = dir.path().join("exported-with-tokenizer");
    let out = pipec(&[
        "export",
        tokenized.join("checkpoints").to_str().expect("utf-8"),
        "-o",
        exported.to_str().expect("utf-8"),
    ]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && said.contains("tokenizer.json, tokenizer_config.json from "), "{said}");
    assert_eq!(std::fs::read(exported.join("tokenizer.json")).expect("tokenizer"), tokenizer);
    // a checkpoint whose shapes are not the model's is refused, naming the tensor
    let spec = std::fs::read_to_string(dir.path().join("init-1.yaml")).expect("spec").replace("ff=24", "ff=32");
    std::fs::write(dir.path().join("wrong.yaml"), spec).expect("spec");
    let out = pipec(&[
        "run",
        dir.path().join("wrong.yaml").to_str().expect("utf-8"),
        "--init",
        fixture.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("model.layers.0.mlp.gate_proj.weight") && said.contains("[24, 16]") && said.contains("[32, 16]"),
        "{said}"
    );
}

#[test]
fn one_optimizer_step_equals_torchs_adamw_and_sgd_on_transformers_models() {
    // tests/reference/hf/{llama-gqa,gpt2,mixtral,qwen3,mistral,deepseek-v3,deepseek-v3-moe}/after-{adamw,sgd}.safetensors: the weights
    // after one step of torch.optim.AdamW (no decay on biases and norms) and of SGD with
    // momentum and weight decay, on the fixture's two rows as one batch; pipec trains the
    // same step from the same weights, on one device and on a 2-stage pipeline with tensor
    // parallelism 2 (the mixture of experts: a 2-stage pipeline, and 2 data-parallel
    // replicas), and exports what it trained
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf");
    let dir = tempfile::tempdir().expect("temp dir");
    let llama = "    - embedding(50, 16)\n    - repeat 2: transformer_block(d=16, heads=4, ff=24, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false)\n    - rmsnorm\n    - linear(16, 50, bias=false) as lm_head";
    let gpt2 = "    - embedding(50, 16) as wte\n    - pos_embedding(32)\n    - repeat 2: transformer_block(d=16, heads=4, ff=64, causal=true, mlp=gelu_tanh)\n    - layernorm\n    - linear(16, 50, bias=false, tie=wte)";
    let mixtral = "    - embedding(50, 16)\n    - repeat 2: transformer_block(d=16, heads=4, ff=24, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false, experts=4, top_k=2)\n    - rmsnorm\n    - linear(16, 50, bias=false) as lm_head";
    let qwen3 = "    - embedding(50, 16)\n    - repeat 2: transformer_block(d=16, heads=4, ff=24, causal=true, kv_heads=2, head_dim=8, qk_norm=true, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false)\n    - rmsnorm\n    - linear(16, 50, bias=false) as lm_head";
    let mistral = "    - embedding(50, 16)\n    - repeat 2: transformer_block(d=16, heads=4, ff=24, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false, window=4)\n    - rmsnorm\n    - linear(16, 50, bias=false) as lm_head";
    let deepseek = "    - embedding(50, 16)\n    - repeat 2: transformer_block(d=16, heads=4, ff=24, causal=true, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false, head_dim=4, kv_lora=8, q_lora=8, rope_dim=4, v_head_dim=6)\n    - rmsnorm\n    - linear(16, 50, bias=false) as lm_head";
    // DeepSeek-V3 with experts: a dense latent block, then 8 experts and a shared one, 4 per
    // token from the 2 best of 4 groups, weights times 2.5, under YaRN with mscale_all_dim
    let latent = "causal=true, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false, head_dim=4, kv_lora=8, q_lora=8, rope_dim=4, v_head_dim=6, rope_scaling=yarn, rope_factor=4, rope_original=8, rope_attention_factor=1, rope_mscale_all_dim=1";
    let deepseek_moe = format!("    - embedding(50, 16)\n    - transformer_block(d=16, heads=4, ff=24, {latent})\n    - transformer_block(d=16, heads=4, ff=8, {latent}, experts=8, top_k=4, shared_experts=1, router=sigmoid, route_scale=2.5, route_groups=4, route_group_top=2)\n    - rmsnorm\n    - linear(16, 50, bias=false) as lm_head");
    let dense_layouts = [(1, "stages: \"1\""), (4, "stages: \"1-1\"\n  tp: 2")];
    let expert_layouts =
        [(1, "stages: \"1\""), (2, "stages: \"1-1\""), (2, "stages: \"2\""), (4, "stages: \"1-1\"\n  tp: 2")];
    let optimizers = [
        ("after-adamw", "{ kind: adamw, lr: 0.01, eps: 0.0001, weight_decay: 0.1, decay_biases_and_norms: false }"),
        ("after-sgd", "{ kind: momentum, lr: 0.05, momentum: 0.9, weight_decay: 0.1 }"),
    ];
    for (model, layers, layouts) in [
        ("llama-gqa", llama, &dense_layouts[..]),
        ("gpt2", gpt2, &dense_layouts),
        ("mixtral", mixtral, &expert_layouts),
        ("qwen3", qwen3, &dense_layouts),
        ("mistral", mistral, &dense_layouts),
        ("deepseek-v3", deepseek, &dense_layouts),
        ("deepseek-v3-moe", deepseek_moe.as_str(), &expert_layouts),
    ] {
        let fixture = root.join(model);
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture.join("reference.json")).expect("fixture"))
                .expect("json");
        let ids: Vec<Vec<u16>> = serde_json::from_value(reference["input_ids"].clone()).expect("ids");
        let mut tokens: Vec<u16> = ids.concat();
        tokens.push(7);
        let data = dir.path().join(format!("{model}.bin"));
        std::fs::write(&data, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).expect("tokens");
        for (after, optimizer) in optimizers {
            // the Mistral fixture's AdamW has eps 1e-3 (make_reference.py says why)
            let optimizer =
                if model == "mistral" { optimizer.replace("eps: 0.0001", "eps: 0.001") } else { optimizer.to_string() };
            let expected = pipec_plan::hf::read_safetensors(
                &std::fs::read(fixture.join(format!("{after}.safetensors"))).expect("fixture"),
            )
            .expect("safetensors");
            for &(devices, layout) in layouts {
                let name = format!("{model}-{after}-{devices}-{}", layout.len());
                let spec = format!(
                    "name: {name}\nmodel:\n  input: [12]\n  layers:\n{layers}\n  loss: cross_entropy\n\
                     cluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ kind: cpu, memory: 2GiB, throughput: 20GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\n\
                     strategy:\n  {layout}\n  schedule: 1f1b\n  microbatches: 2\n\
                     training:\n  batch_size: 2\n  steps: 1\n  checkpoint: {{ every: 1, dir: checkpoints }}\n  optimizer: {optimizer}\n  data: {{ kind: tokens, path: {}, dtype: uint16 }}\n",
                    data.display()
                );
                let path = dir.path().join(format!("{name}.yaml"));
                std::fs::write(&path, spec).expect("spec");
                let run = dir.path().join(&name);
                run_from_hugging_face(&path, &fixture, &run, &[]);
                export_equals(&name, &run, &dir.path().join(format!("{name}-hf")), &expected);
            }
        }
    }
}

#[test]
fn the_tiny_llama_trains_through_its_bpe_tokenizer_on_a_pipeline() {
    // specs/llama-tiny.yaml: grouped-query attention, rotary embeddings, RMSNorm, SwiGLU, a
    // byte-level BPE tokenizer (specs/data/bpe-512.json), 2 stages under 1F1B
    let dir = tempfile::tempdir().expect("temp dir");
    let out = pipec(&["run", "specs/llama-tiny.yaml", "--steps", "15", "--out", dir.path().to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let losses = run_losses(dir.path());
    assert_eq!(losses.len(), 15);
    // ln 512 ≈ 6.24 is a uniform guess over the tokenizer's vocabulary; it learns well below
    assert!(losses[14] < 0.85 * losses[0], "{losses:?}");

    // a language model's speed in tokens too (64-token windows), in metrics.jsonl and the log;
    // the log numbers steps from 0, as metrics.jsonl does
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).expect("metrics");
    for (n, line) in metrics.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        assert_eq!(v["step"].as_u64(), Some(n as u64));
        let (samples, tokens) =
            (v["samples_per_s"].as_f64().expect("samples"), v["tokens_per_s"].as_f64().expect("tokens"));
        assert!((tokens - 64.0 * samples).abs() <= 1e-9 * tokens, "{line}");
        // per device of the 2, and MFU against the CPU's 40 GFLOP/s the spec states, by
        // Megatron-LM's count (789,504 FLOPs per token: compile_reports_tokens_per_device_and_mfu…)
        let per_device = v["tokens_per_s_per_device"].as_f64().expect("tokens per device");
        assert!((per_device - tokens / 2.0).abs() <= 1e-9 * tokens, "{line}");
        let mfu = v["mfu"].as_f64().expect("mfu");
        assert!((mfu - per_device * 789_504.0 / 40e9).abs() <= 1e-9 * mfu, "{line}");
    }
    let log = String::from_utf8_lossy(&out.stderr);
    let first = log.lines().find(|l| l.starts_with("step ")).expect("a step line");
    assert!(first.starts_with("step     0 ") && first.contains(" tokens/s") && first.contains(" MFU "), "{log}");
    assert!(log.contains("MFU (measured, per device of the run): Megatron-LM's count"), "{log}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("loss "), "the report is on standard output");
    // its export loads as a model and a tokenizer: the data's tokenizer.json comes along with
    // a tokenizer_config.json naming the generic fast tokenizer
    let spec = std::fs::read_to_string("specs/llama-tiny.yaml").expect("spec");
    let saving = dir.path().join("saving.yaml");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/data");
    std::fs::write(
        &saving,
        spec.replace(": data/", &format!(": {}/", data.display()))
            .replace("  steps: ", "  checkpoint: { every: 1, dir: checkpoints }\n  steps: "),
    )
    .expect("spec");
    let run = dir.path().join("saved");
    let saved = pipec(&["run", saving.to_str().expect("utf-8"), "--steps", "1", "-o", run.to_str().expect("utf-8")]);
    assert!(saved.status.success(), "{}", both_streams(&saved));
    let exported = dir.path().join("exported");
    let out =
        pipec(&["export", run.join("checkpoints").to_str().expect("utf-8"), "-o", exported.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", both_streams(&out));
    assert_eq!(
        std::fs::read(exported.join("tokenizer.json")).expect("tokenizer"),
        std::fs::read(data.join("bpe-512.json")).expect("bpe")
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exported.join("tokenizer_config.json")).expect("config"))
            .expect("json");
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
}

#[test]
fn text_trains_from_a_folder_or_a_pattern_of_files_through_a_model_folders_tokenizer() {
    // specs/llama-tiny.yaml with its text split over two files in a folder and its
    // tokenizer.json in a model folder (the one `--init` takes)
    let dir = tempfile::tempdir().expect("tmp");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("specs/data/architecture.txt")).expect("text");
    let (first, second) = text.split_at(text.len() / 2);
    let corpus = dir.path().join("corpus");
    std::fs::create_dir_all(&corpus).expect("folder");
    std::fs::write(corpus.join("part-1.txt"), first).expect("write");
    std::fs::write(corpus.join("part-2.txt"), second).expect("write");
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).expect("folder");
    std::fs::copy(root.join("specs/data/bpe-512.json"), model.join("tokenizer.json")).expect("copy");
    let spec = std::fs::read_to_string(root.join("specs/llama-tiny.yaml")).expect("spec");
    for path in ["corpus", "corpus/part-*.txt"] {
        let written = dir.path().join("spec.yaml");
        std::fs::write(
            &written,
            spec.replace(
                "path: data/architecture.txt, tokenizer: data/bpe-512.json",
                &format!("path: {path}, tokenizer: model"),
            ),
        )
        .expect("spec");
        let checked = pipec(&["check", written.to_str().expect("utf-8")]);
        assert!(checked.status.success(), "{path}: {}", both_streams(&checked));
        let out = dir.path().join("run");
        let run = pipec(&["run", written.to_str().expect("utf-8"), "--steps", "2", "-o", out.to_str().expect("utf-8")]);
        assert!(run.status.success(), "{path}: {}", both_streams(&run));
        assert_eq!(run_losses(&out).len(), 2);
    }
    // a model folder without a tokenizer.json is named
    std::fs::remove_file(model.join("tokenizer.json")).expect("remove");
    let checked = pipec(&["check", dir.path().join("spec.yaml").to_str().expect("utf-8")]);
    assert!(String::from_utf8_lossy(&checked.stderr).contains("the model folder `model` has no tokenizer.json"));
}

#[test]
fn a_json_lines_file_trains_through_its_token_cache() {
    // specs/llama-tiny.yaml's text as JSON Lines records (one paragraph a record, under
    // `body`), cut by its tokenizer with `.` between records
    let dir = tempfile::tempdir().expect("tmp");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("specs/data/architecture.txt")).expect("text");
    let records: String = text
        .split("\n\n")
        .filter(|p| !p.trim().is_empty())
        .map(|p| serde_json::json!({ "body": p, "source": "ARCHITECTURE.md" }).to_string() + "\n")
        .collect();
    std::fs::write(dir.path().join("train.jsonl"), records).expect("write");
    std::fs::copy(root.join("specs/data/bpe-512.json"), dir.path().join("tokenizer.json")).expect("copy");
    let spec = std::fs::read_to_string(root.join("specs/llama-tiny.yaml")).expect("spec").replace(
        "{ kind: text, path: data/architecture.txt, tokenizer: data/bpe-512.json }",
        "{ kind: jsonl, path: train.jsonl, field: body, tokenizer: tokenizer.json, eot: \".\" }",
    );
    let written = dir.path().join("spec.yaml");
    std::fs::write(&written, &spec).expect("spec");
    let checked = pipec(&["check", written.to_str().expect("utf-8")]);
    assert!(checked.status.success(), "{}", both_streams(&checked));
    let out = dir.path().join("run");
    let run = pipec(&["run", written.to_str().expect("utf-8"), "--steps", "3", "-o", out.to_str().expect("utf-8")]);
    let said = both_streams(&run);
    assert!(run.status.success(), "{said}");
    assert!(said.contains("note: tokenized `") && said.contains(".pipec-tokens/train-"), "{said}");
    assert_eq!(run_losses(&out).len(), 3);
    let plan = std::fs::read_to_string(out.join("plan.json")).expect("plan");
    assert!(plan.contains(".pipec-tokens/train-") && plan.contains("\"dtype\": \"uint32\""), "{plan}");
    // without an end-of-text token the tokenizer has, the records' separator is asked for
    std::fs::write(&written, spec.replace(", eot: \".\"", "")).expect("spec");
    let checked = pipec(&["check", written.to_str().expect("utf-8"), "--format", "json"]);
    assert!(String::from_utf8_lossy(&checked.stdout).contains("name the one to put between records with `eot:`"));
}

#[test]
fn a_parquet_file_and_a_datasets_folder_train_and_a_parquet_file_given_as_tokens_is_refused() {
    // tests/records (pyarrow's): specs/llama-tiny.yaml's text as Parquet records and as a
    // `datasets` save_to_disk folder, and token ids as a Parquet list column
    let dir = tempfile::tempdir().expect("tmp");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // copied, as the token caches are written beside the data
    let records = dir.path().join("records");
    std::fs::create_dir_all(records.join("dataset")).expect("folder");
    for file in [
        "text.parquet",
        "ids.parquet",
        "dataset/state.json",
        "dataset/dataset_info.json",
        "dataset/data-00000-of-00002.arrow",
        "dataset/data-00001-of-00002.arrow",
    ] {
        std::fs::copy(root.join("tests/records").join(file), records.join(file)).expect("copy");
    }
    let tokenizer = root.join("specs/data/bpe-512.json");
    let spec = std::fs::read_to_string(root.join("specs/llama-tiny.yaml")).expect("spec");
    let data = [
        format!(
            "{{ kind: parquet, path: {}/text.parquet, column: body, tokenizer: {}, eot: \".\" }}",
            records.display(),
            tokenizer.display()
        ),
        format!(
            "{{ kind: arrow, path: {}/dataset, column: body, tokenizer: {}, eot: \".\" }}",
            records.display(),
            tokenizer.display()
        ),
        format!("{{ kind: parquet, path: {}/ids.parquet, column: input_ids }}", records.display()),
    ];
    for (i, d) in data.iter().enumerate() {
        let written = dir.path().join(format!("spec-{i}.yaml"));
        std::fs::write(
            &written,
            spec.replace("{ kind: text, path: data/architecture.txt, tokenizer: data/bpe-512.json }", d),
        )
        .expect("spec");
        let checked = pipec(&["check", written.to_str().expect("utf-8")]);
        assert!(checked.status.success(), "{d}: {}", both_streams(&checked));
        let out = dir.path().join(format!("run-{i}"));
        let run = pipec(&["run", written.to_str().expect("utf-8"), "--steps", "2", "-o", out.to_str().expect("utf-8")]);
        assert!(run.status.success(), "{d}: {}", both_streams(&run));
        assert_eq!(run_losses(&out).len(), 2);
    }
    assert!(records.join(".pipec-tokens").is_dir());
    // the same Parquet file as raw token ids: refused by name, not trained on its bytes
    let written = dir.path().join("as-tokens.yaml");
    let as_tokens = format!("{{ kind: tokens, path: {}/text.parquet, dtype: uint16 }}", records.display());
    std::fs::write(
        &written,
        spec.replace("{ kind: text, path: data/architecture.txt, tokenizer: data/bpe-512.json }", &as_tokens)
            .replace("embedding(512,", "embedding(65536,")
            .replace("linear(64, 512", "linear(64, 65536"),
    )
    .expect("spec");
    let checked = pipec(&["check", written.to_str().expect("utf-8"), "--format", "json"]);
    let said = String::from_utf8_lossy(&checked.stdout);
    assert_eq!(checked.status.code(), Some(1), "{said}");
    assert!(
        said.contains("text.parquet` is a Parquet file, not a raw token file") && said.contains("kind: parquet"),
        "{said}"
    );
}

#[test]
fn a_residual_network_trains_from_an_image_folder() {
    // specs/resnet-images.yaml: specs/data/shapes (256 PNGs in 4 classes), resized,
    // centre-cropped and normalised, on a 2-stage 1F1B pipeline with batch normalisation
    let dir = tempfile::tempdir().expect("temp dir");
    let out = pipec(&["run", "specs/resnet-images.yaml", "--out", dir.path().to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let losses = run_losses(dir.path());
    assert_eq!(losses.len(), 40);
    // ln 4 ≈ 1.39 is a guess; the four patterns are told apart
    let last: f64 = losses[35..].iter().sum::<f64>() / 5.0;
    assert!(last < 0.5 * losses[0], "{losses:?}");
}

#[test]
fn a_bert_classifier_trains_one_step_as_torch_does_and_exports_to_transformers_names() {
    // tests/reference/hf/bert: a tiny random BertForSequenceClassification (post-norm
    // blocks, token types from the [SEP] token 2, the pooler, 3 classes), two rows with their
    // labels, the logits, and the weights after one step of AdamW and of SGD with momentum.
    // pipec's spec is what `pipec import` writes for its config (with `sep=2`); it starts at
    // torch's loss and takes the same step, on one device and on a 2-stage pipeline with
    // tensor parallelism 2, and exports under transformers' names.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf/bert");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("reference.json")).expect("fixture")).expect("json");
    let ids: Vec<Vec<u32>> = serde_json::from_value(reference["input_ids"].clone()).expect("ids");
    let labels: Vec<usize> = serde_json::from_value(reference["labels"].clone()).expect("labels");
    let logits: Vec<f64> = serde_json::from_value(reference["logits"].clone()).expect("logits");
    let mut expected_loss = 0.0;
    for (row, label) in logits.chunks(3).zip(&labels) {
        let max = row.iter().fold(f64::MIN, |m, v| m.max(*v));
        expected_loss += max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln() - row[*label];
    }
    expected_loss /= 2.0;
    let dir = tempfile::tempdir().expect("temp dir");
    let mut csv = (0..12).map(|k| format!("t{k},")).collect::<String>() + "label\n";
    for (row, label) in ids.iter().zip(&labels) {
        csv += &format!("{},{label}\n", row.iter().map(ToString::to_string).collect::<Vec<_>>().join(","));
    }
    std::fs::write(dir.path().join("pairs.csv"), csv).expect("csv");
    let imported = pipec(&["import", fixture.join("config.json").to_str().expect("utf-8"), "--seq", "12"]);
    assert!(imported.status.success(), "{}", String::from_utf8_lossy(&imported.stderr));
    let text = String::from_utf8_lossy(&imported.stdout).into_owned();
    let model = &text[text.find("model:").expect("model")..text.find("cluster:").expect("cluster")];
    assert!(model.contains("embedding(50, 16, types=2)") && model.contains("post_norm=true, eps=1e-12"), "{model}");
    let model = model.replace("types=2)", "types=2, sep=2)");
    let optimizers = [
        ("after-adamw", "{ kind: adamw, lr: 0.01, eps: 0.0001, weight_decay: 0.1, decay_biases_and_norms: false }"),
        ("after-sgd", "{ kind: momentum, lr: 0.05, momentum: 0.9, weight_decay: 0.1 }"),
    ];
    for (after, optimizer) in optimizers {
        let expected = pipec_plan::hf::read_safetensors(
            &std::fs::read(fixture.join(format!("{after}.safetensors"))).expect("fixture"),
        )
        .expect("safetensors");
        for (devices, layout) in [(1, "stages: \"1\""), (4, "stages: \"1-1\"\n  tp: 2")] {
            let name = format!("bert-{after}-{devices}");
            let spec = format!(
                "name: {name}\n{model}\
                 cluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ kind: cpu, memory: 2GiB, throughput: 20GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\n\
                 strategy:\n  {layout}\n  schedule: 1f1b\n  microbatches: 2\n\
                 training:\n  batch_size: 2\n  steps: 1\n  checkpoint: {{ every: 1, dir: checkpoints }}\n  optimizer: {optimizer}\n  data: {{ kind: csv, path: pairs.csv }}\n"
            );
            let path = dir.path().join(format!("{name}.yaml"));
            std::fs::write(&path, spec).expect("spec");
            let run = dir.path().join(&name);
            run_from_hugging_face(&path, &fixture, &run, &[]);
            let loss = run_losses(&run)[0];
            eprintln!("{name}: pipec {loss}, torch {expected_loss}");
            assert!(
                (loss - expected_loss).abs() <= 1e-5 * expected_loss,
                "{name}: pipec's loss {loss}, torch's {expected_loss}"
            );
            let exported = dir.path().join(format!("{name}-hf"));
            export_equals(&name, &run, &exported, &expected);
            // the exported config imports back into the same model
            let again = pipec(&["import", exported.join("config.json").to_str().expect("utf-8"), "--seq", "12"]);
            assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
            let again = String::from_utf8_lossy(&again.stdout).into_owned();
            assert!(again.contains(model.as_str()), "{again}");
        }
    }
}

#[test]
fn init_loads_all_or_nothing_unless_partial_which_lists_what_it_skipped() {
    // the 2-block GPT-2 fixture into a 1-block spec: refused by default, naming the second
    // block's tensors; with --init-partial it trains and says what it skipped
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf/gpt2");
    let dir = tempfile::tempdir().expect("temp dir");
    let imported = pipec(&["import", fixture.join("config.json").to_str().expect("utf-8"), "--seq", "8"]);
    assert!(imported.status.success(), "{}", String::from_utf8_lossy(&imported.stderr));
    let text = String::from_utf8_lossy(&imported.stdout).replace("repeat 2:", "repeat 1:");
    let model = &text[text.find("model:").expect("model")..text.find("cluster:").expect("cluster")];
    let spec = format!(
        "name: shorter\n{model}cluster:\n  nodes: 1\n  devices_per_node: 1\n  device: {{ kind: cpu, memory: 2GiB, throughput: 20GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\n\
         strategy:\n  stages: straight\n  schedule: gpipe\n  microbatches: 1\n\
         training:\n  batch_size: 2\n  steps: 1\n  optimizer: {{ kind: adamw, lr: 0.01 }}\n  data: {{ kind: synthetic, samples: 4 }}\n"
    );
    let path = dir.path().join("shorter.yaml");
    std::fs::write(&path, spec).expect("spec");
    let (spec, init) = (path.to_str().expect("utf-8"), fixture.to_str().expect("utf-8"));
    let run = dir.path().join("run");
    let out = pipec(&["run", spec, "--init", init, "-o", run.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("tensor(s) the model does not use: `transformer.h.1.") && said.contains("--init-partial"),
        "{said}"
    );
    assert!(!run.exists(), "nothing written");
    let out = pipec(&["run", spec, "--init", init, "--init-partial", "-o", run.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("note: --init-partial skipped 12 tensor(s) the model does not use: `transformer.h.1."),
        "{said}"
    );
    assert!(said.contains("init: ") && said.contains("into the model's"), "{said}");
    // --init-partial alone is a usage error
    assert_eq!(pipec(&["run", spec, "--init-partial"]).status.code(), Some(2));
}

#[test]
fn a_bert_classifier_fine_tunes_from_a_checkpoint_without_its_head() {
    // a base checkpoint (BertModel's tensors, no `classifier.*`): the encoder and pooler
    // come from it, the classifier from pipec's initialisation, and the run says so; a
    // checkpoint that lacks an encoder tensor is still refused, naming it
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf/bert");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut tensors = pipec_plan::hf::read_dir(&fixture).expect("fixture");
    tensors.retain(|name, _| !name.starts_with("classifier."));
    let base = dir.path().join("base");
    std::fs::create_dir(&base).expect("dir");
    std::fs::write(base.join("model.safetensors"), pipec_plan::hf::write_safetensors(&tensors).expect("write"))
        .expect("write");
    let imported = pipec(&["import", fixture.join("config.json").to_str().expect("utf-8"), "--seq", "12"]);
    let text = String::from_utf8_lossy(&imported.stdout).replace("types=2)", "types=2, sep=2)");
    let model = &text[text.find("model:").expect("model")..text.find("cluster:").expect("cluster")];
    let spec = format!(
        "name: tune\n{model}cluster:\n  nodes: 1\n  devices_per_node: 2\n  device: {{ kind: cpu, memory: 2GiB, throughput: 20GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\n\
         strategy:\n  stages: \"1-1\"\n  schedule: 1f1b\n  microbatches: 2\n\
         training:\n  batch_size: 4\n  steps: 30\n  optimizer: {{ kind: adamw, lr: 0.01 }}\n  data: {{ kind: synthetic, samples: 16 }}\n"
    );
    let path = dir.path().join("tune.yaml");
    std::fs::write(&path, spec).expect("spec");
    let run = dir.path().join("run");
    let out = pipec(&[
        "run",
        path.to_str().expect("utf-8"),
        "--init",
        base.to_str().expect("utf-8"),
        "--out",
        run.to_str().expect("utf-8"),
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains(
            "has no `classifier.weight`, `classifier.bias`: the classifier starts from pipec's initial values"
        ),
        "{said}"
    );
    let losses = run_losses(&run);
    assert!(losses[29] < 0.5 * losses[0], "{losses:?}");
    // without the pooler the checkpoint is not this model's
    tensors.retain(|name, _| !name.starts_with("bert.pooler."));
    std::fs::write(base.join("model.safetensors"), pipec_plan::hf::write_safetensors(&tensors).expect("write"))
        .expect("write");
    let out = pipec(&["run", path.to_str().expect("utf-8"), "--init", base.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bert.pooler.dense.weight"));
}

#[test]
fn a_torchvision_resnet_trains_one_step_as_torch_does_with_its_running_statistics() {
    // tests/reference/hf/resnet: a torchvision ResNet (BasicBlock, narrowed by torchvision's
    // own `_make_layer`) with random batch-norm weights and running statistics, four 40×40
    // images, and the state after one step of AdamW (no decay on biases and norms) and one of
    // SGD with momentum and weight decay, each over two microbatches of two (gradient
    // accumulation: nn.BatchNorm2d moves its running
    // statistics at each forward). pipec loads it under torchvision's names and takes the
    // same step with `running_stats: per_forward` on one device, on a 2-stage pipeline and
    // on two replicas: every weight and running statistic equal to torch's.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf/resnet");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("reference.json")).expect("fixture")).expect("json");
    let torch_loss = reference["train_loss"].as_f64().expect("loss");
    let inputs = pipec_plan::hf::read_safetensors(&std::fs::read(fixture.join("inputs.safetensors")).expect("inputs"))
        .expect("safetensors");
    let (images, labels) = (&inputs["images"].1, &inputs["labels"].1);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut csv = String::new();
    for (row, label) in images.chunks(3 * 40 * 40).zip(labels) {
        let cells: Vec<String> = row.iter().map(|v| format!("{v:?}")).collect();
        csv += &format!("{},{}\n", cells.join(","), *label as usize);
    }
    std::fs::write(dir.path().join("images.csv"), csv).expect("csv");
    let model = "model:\n  input: [3, 40, 40]\n  blocks:\n\
                 \x20   basic(c):\n\
                 \x20     - conv2d(c, c, k=3, pad=1, bias=false) -> batchnorm2d -> relu\n\
                 \x20     - conv2d(c, c, k=3, pad=1, bias=false) -> batchnorm2d as branch\n\
                 \x20     - add(branch, in) -> relu\n\
                 \x20   down(cin, cout):\n\
                 \x20     - conv2d(cin, cout, k=3, stride=2, pad=1, bias=false) -> batchnorm2d -> relu\n\
                 \x20     - conv2d(cout, cout, k=3, pad=1, bias=false) -> batchnorm2d as branch\n\
                 \x20     - in -> conv2d(cin, cout, k=1, stride=2, bias=false) -> batchnorm2d as shortcut\n\
                 \x20     - add(branch, shortcut) -> relu\n\
                 \x20 layers:\n\
                 \x20   - conv2d(3, 8, k=7, stride=2, pad=3, bias=false) -> batchnorm2d -> relu -> maxpool2d(3, stride=2, pad=1)\n\
                 \x20   - basic(8)\n\
                 \x20   - down(8, 16)\n\
                 \x20   - down(16, 16)\n\
                 \x20   - down(16, 16)\n\
                 \x20   - adaptive_avgpool2d -> flatten -> linear(16, 5)\n\
                 \x20 loss: cross_entropy\n";
    // (AdamW's eps is 1e-2 here: make_reference.py says why)
    let optimizers = [
        ("after-adamw", "{ kind: adamw, lr: 0.01, eps: 0.01, weight_decay: 0.1, decay_biases_and_norms: false }"),
        ("after-sgd", "{ kind: momentum, lr: 0.05, momentum: 0.9, weight_decay: 0.1 }"),
    ];
    let layouts = [
        ("one-device", 1, "stages: \"1\"", "per_forward"),
        ("pipeline", 2, "stages: \"1-1\"", "per_forward"),
        ("replicas", 2, "stages: \"2\"", "per_forward"),
        ("one-device", 1, "stages: \"1\"", "per_update"),
    ];
    for ((label, devices, layout, rule), (step, optimizer)) in
        layouts.iter().flat_map(|l| optimizers.iter().map(move |o| (*l, *o)))
    {
        let after = pipec_plan::hf::read_safetensors(
            &std::fs::read(fixture.join(format!("{step}.safetensors"))).expect("after"),
        )
        .expect("safetensors");
        let name = format!("resnet-{label}-{rule}-{step}");
        let spec = format!(
            "name: {name}\n{model}\
             cluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ kind: cpu, memory: 2GiB, throughput: 20GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\n\
             strategy:\n  {layout}\n  schedule: 1f1b\n  microbatches: 2\n\
             training:\n  batch_size: 4\n  steps: 1\n  running_stats: {rule}\n  checkpoint: {{ every: 1, dir: checkpoints }}\n  optimizer: {optimizer}\n  data: {{ kind: csv, path: images.csv }}\n"
        );
        let path = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, spec).expect("spec");
        let run = dir.path().join(&name);
        run_from_hugging_face(&path, &fixture, &run, &[]);
        let loss = run_losses(&run)[0];
        assert!((loss - torch_loss).abs() <= 1e-5 * torch_loss, "{name}: pipec's loss {loss}, torch's {torch_loss}");
        let plan = pipec_plan::plan::Plan::from_json(&std::fs::read_to_string(run.join("plan.json")).expect("plan"))
            .expect("plan");
        let want = pipec_plan::hf::to_pipec(&plan.model_ops(), &after).expect("torchvision names");
        let saved = pipec_plan::checkpoint::read(
            &pipec_plan::checkpoint::locate_in(&run.join("checkpoints"), None).expect("a checkpoint"),
        )
        .expect("reads");
        let mut running_off = 0.0_f32;
        for (id, (shape, values)) in &want {
            let (got_shape, got) = &saved.params[&(*id, 0)];
            assert_eq!(got_shape, shape, "{name}: {}", pipec_plan::checkpoint::param_name(*id));
            let scale = values.iter().fold(0.0_f32, |m, v| m.max(v.abs()));
            let worst = got.iter().zip(values).map(|(a, b)| (a - b).abs()).fold(0.0_f32, f32::max);
            if id & 0xff >= 2 && rule == "per_update" {
                // batch normalisation's running statistics, slots 2 and 3
                running_off = running_off.max(worst / scale);
                continue;
            }
            assert!(
                worst <= 1e-5 * scale,
                "{name}: {} differs from torch's by {worst:e} (largest {scale})",
                pipec_plan::checkpoint::param_name(*id)
            );
        }
        eprintln!("{name}: loss {loss} (torch {torch_loss}), {} tensors compared, running statistics per_update off by {running_off:e}", want.len());
        if rule == "per_update" {
            // one fold toward the mean of the two microbatches' statistics is not torch's two
            assert!(running_off > 1e-4, "{name}: the running statistics agree with torch's to {running_off:e}");
            continue;
        }
        // and back under torchvision's names: every tensor of torch's state after the step
        export_equals(&name, &run, &dir.path().join(format!("{name}-torchvision")), &after);
    }
    // a negative running variance is a damaged checkpoint, refused by its name
    let mut tensors = pipec_plan::hf::read_dir(&fixture).expect("fixture");
    tensors.get_mut("bn1.running_var").expect("bn1").1[2] = -0.5;
    let damaged = dir.path().join("damaged");
    std::fs::create_dir(&damaged).expect("dir");
    std::fs::write(damaged.join("model.safetensors"), pipec_plan::hf::write_safetensors(&tensors).expect("w"))
        .expect("write");
    let spec = dir.path().join("resnet-one-device-per_forward-after-sgd.yaml");
    let out = pipec(&["run", spec.to_str().expect("utf-8"), "--init", damaged.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("the running variance of layer 1") && said.contains("-0.5 at channel 2"), "{said}");
}

#[test]
fn compile_lists_a_stages_gradient_buckets() {
    // the executor benchmark's MLP on two replicas with 4 MiB buckets: a bucket per layer,
    // the last layers' first (the output layer rides with the last hidden one)
    let dir = tempfile::tempdir().expect("tmp");
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/specs/ddp-buckets.yaml");
    let out = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", dir.path().to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("gradients reduced in 8 buckets during the last backward (4.04 MiB, 4.00 MiB,"), "{said}");
    // under ZeRO-2 every microbatch's gradients are reduce-scattered, bucket by bucket
    let text = std::fs::read_to_string(&spec).expect("spec");
    let sharded = dir.path().join("zero-2.yaml");
    std::fs::write(&sharded, text.replacen("strategy:\n", "strategy:\n  zero: 2\n", 1)).expect("write");
    let out =
        pipec(&["compile", sharded.to_str().expect("utf-8"), "-o", dir.path().join("z").to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("gradients reduce-scattered in 8 buckets during every backward (4.04 MiB,"), "{said}");
    assert!(said.contains("gradient reduce-scatters and weight all-gathers on d"), "{said}");
}

#[test]
fn compile_states_each_context_parallel_members_positions() {
    // 512-token windows over 2 members: chunks of 128, member 0 holding the first and the
    // last, member 1 the two in the middle; the plan counts each chunk as a microbatch
    let dir = tempfile::tempdir().expect("tmp");
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/specs/context-parallel.yaml");
    let out = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", dir.path().to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("context parallelism: cp 2 — each of the 1 microbatches is 2 chunk-microbatches"), "{said}");
    assert!(said.contains("1 microbatches of 8 (2 chunk-microbatches of cp 2)"), "{said}");
    assert!(said.contains("positions 0..128 and 384..512 (c = 0), 128..256 and 256..384 (c = 1)"), "{said}");
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("plan.json")).expect("plan")).expect("json");
    assert_eq!(plan["training"]["context_parallel"], 2);
    assert_eq!(plan["training"]["microbatches"], 2);
    // the keys and values gathered in every forward, their gradients sent back
    let context = &plan["stages"][0]["context_s"];
    assert!(context[0].as_f64().is_some_and(|f| f > 0.0) && context[1] == context[0], "{context}");
}

#[test]
fn run_refuses_what_the_executor_does_not_run_and_compile_plans_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = dir.path().join("qwen-like.yaml");
    let text = "model:\n  input: [16]\n  layers:\n    - embedding(50, 32)\n    - transformer_block(32, 4, 64, causal=true, kv_heads=2, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false, head_dim=16, qk_norm=true, window=8, sinks=true)\n    - transformer_block(32, 4, 64, causal=true, kv_lora=16, rope_dim=4, rope=10000, dropout=0.1)\n    - transformer_block(32, 4, 64, causal=true, experts=4, top_k=2, router=sigmoid, route_scale=2, route_groups=2, route_group_top=1, expert_bias=true)\n    - rmsnorm\n    - linear(32, 50, bias=false)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: { memory: 1GiB, throughput: 1GFLOP/s }\n  links:\n    intra_node: { bandwidth: 1GB/s, latency: 5us }\nstrategy:\n  stages: \"1\"\n  cp: 2\n  cp_comm: ring\n  schedule: gpipe\n  microbatches: 1\n  recompute: { modules: [mlp], layers: 1, offload: true }\ntraining:\n  batch_size: 4\n  steps: 1\n  precision: bf16\n  optimizer: { kind: sgd, lr: 0.1, master_weights: false }\n  data: synthetic\n";
    std::fs::write(&spec, text).expect("spec");
    let out = dir.path().join("plan");
    let compiled = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8")]);
    assert_eq!(compiled.status.code(), Some(0), "{}", String::from_utf8_lossy(&compiled.stderr));
    let run = pipec(&["run", spec.to_str().expect("utf-8"), "-o", dir.path().join("run").to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{said}");
    assert!(said.contains("activation offload (`recompute: { offload: true }`)"), "{said}");
    // weights without a master copy run, rounded after each update, and the run says how
    let refused = said.lines().find(|l| l.contains("does not run")).unwrap_or_default();
    assert!(!refused.contains("master_weights"), "{said}");
    assert!(
        said.contains("note: weights without an fp32 master copy (`optimizer.master_weights: false`): pipec's executor rounds them to their precision after each update"),
        "{said}"
    );
    // a head size of its own, query/key norms, sliding windows and multi-head latent
    // attention run (tests/training.rs; the qwen3, mistral and deepseek-v3 fixtures), and so
    // do sinks, around the ring too (attention_sinks_...), and DeepSeek's group-limited routing
    // and scaled weights (the deepseek-v3-moe fixture) and its expert bias
    // (a_deepseek_expert_bias_...), and so does recompute by layers, module or operation
    // (recompute_by_... in tests/training.rs)
    for runs in [
        "`dropout=`",
        "`sinks=true`",
        "`expert_bias=true`",
        "`head_dim=`",
        "`qk_norm=true`",
        "`window=`",
        "`kv_lora=`",
        "`route_groups=`",
        "`route_scale=`",
        "layers: n",
        "modules | ops",
    ] {
        assert!(!said.contains(runs), "{runs}: {said}");
    }
    assert!(!dir.path().join("run").join("metrics.jsonl").exists(), "nothing trained");
}

/// A Llama 3 8B config imported and searched on H100s: the winner keeps the default memory
/// headroom (the allocator's reserve, CUDA's context and NCCL's buffers a GPU run holds
/// beside the plan's figures) — on 16 × 8 H100, on one node of 8, and on two, where a winner
/// without it fills all but 8% of the devices. Planned for torchtitan (the import's default engine),
/// the 16 × 8 search predicts an MFU inside the published bf16 range of 35–55% and picks
/// what practitioners run at that size: FSDP or data parallelism, tensor parallelism at most
/// 2, no pipeline. Planned for pipec's own executor, the step is priced on the preset's
/// datasheet and says it is not calibrated.
#[test]
fn an_imported_llama_3_8b_searched_on_h100s_keeps_the_default_memory_headroom_at_a_published_mfu() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = dir.path().join("llama-3-8b.yaml");
    let out = pipec(&["import", "tests/import/llama-3-8b.json", "--seq", "8192", "-o", spec.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let imported = std::fs::read_to_string(&spec).expect("the spec");
    assert!(imported.contains("\nengine: torchtitan\n") && imported.contains("\n  attention: flash\n"), "{imported}");
    let default = pipec_plan::rules::DEFAULT_MEMORY_HEADROOM;
    let search = |text: &str, nodes: usize, batch: usize, extra: &[&str]| -> serde_json::Value {
        let text = text
            .replace("  nodes: 1\n", &format!("  nodes: {nodes}\n"))
            .replace("batch_size: 64", &format!("batch_size: {batch}"));
        std::fs::write(&spec, text).expect("write");
        let mut args = vec!["search", spec.to_str().expect("utf-8"), "--format", "json"];
        args.extend_from_slice(extra);
        let out = pipec(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        report["best"].clone()
    };
    let headroom = |best: &serde_json::Value| best["memory_headroom"].as_f64().expect("a winner's headroom");
    for (nodes, batch) in [(16, 1024), (16, 64), (1, 16), (1, 64), (2, 64)] {
        let h = headroom(&search(&imported, nodes, batch, &[]));
        assert!(h >= default, "{nodes} × 8 H100, batch {batch}: headroom {h}");
    }
    let without = headroom(&search(&imported, 2, 64, &["--headroom", "0"]));
    assert!(without < default, "without the default the winner keeps {without}");
    let best = search(&imported, 16, 1024, &[]);
    let mfu = best["mfu"]["fraction"].as_f64().expect("an MFU");
    assert!((0.35..=0.55).contains(&mfu), "MFU {mfu}: {best}");
    let (tp, pp) = (best["tp"].as_u64().expect("tp"), best["pp"].as_u64().expect("pp"));
    assert!(tp <= 2 && pp == 1, "tp {tp}, pp {pp}: {best}");
    // an engine's own launch configuration names its engine: `--engine` is refused beside it
    let out = pipec(&["import", "tests/engines/published/megatron-llama3-8b-fp8.sh", "--engine", "torchtitan"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--engine chooses the engine of a Hugging Face config"));
    // pipec's executor on an H100 preset: priced, and said to be uncalibrated
    std::fs::write(&spec, imported.replace("engine: torchtitan", "engine: pipec")).expect("write");
    let out = pipec(&["search", spec.to_str().expect("utf-8")]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("priced as pipec's executor runs its kernels: efficiency × 1.0000 (not calibrated)"),
        "{said}"
    );
}

/// `pipec calibrate --measured`: one measured step of a spec's own run (a number, or an
/// engine's log) fits its engine's constant on its device kind; a spec naming the file is
/// then predicted at that step, and another layout of the same engine and device kind is
/// priced with the same constant. A file for another engine or device is refused.
#[test]
fn calibrate_measured_fits_the_engine_to_one_step_and_specs_name_the_file() {
    let dir = tempfile::tempdir().expect("tmp");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/specs/published-2025");
    let spec = root.join("tt24-t1-8b-8g-bf16-eager.yaml");
    // `pipec calibrate --measured SPEC ARGS -o OUT`
    let calibrate = |spec: &Path, args: &[&str], out: &Path| {
        let mut all =
            vec!["calibrate", "--measured", spec.to_str().expect("utf-8"), "-o", out.to_str().expect("utf-8")];
        all.extend_from_slice(args);
        pipec(&all)
    };
    let file = dir.path().join("eager.json");
    let out = calibrate(&spec, &["--step", "3.1s"], &file);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).expect("written")).expect("json");
    assert_eq!(written["format"], "pipec-engine-calibration-1");
    assert_eq!(written["family"], "torch-eager");
    assert_eq!(written["power"], 500.0);
    // the spec, pointed at the file, is predicted at the measured step
    let text = std::fs::read_to_string(&spec)
        .expect("spec")
        .replace("engine: torchtitan", &format!("engine: {{ name: torchtitan, calibration: {} }}", file.display()));
    let pointed = dir.path().join("pointed.yaml");
    std::fs::write(&pointed, &text).expect("write");
    let plan_dir = dir.path().join("plan");
    let out = pipec(&["compile", pointed.to_str().expect("utf-8"), "-o", plan_dir.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let plan: serde_json::Value =
        serde_json::from_slice(&std::fs::read(plan_dir.join("plan.json")).expect("plan")).expect("json");
    let step = plan["simulation"]["step_time_s"].as_f64().expect("step");
    assert!((step / 3.1 - 1.0).abs() < 0.01, "predicted {step} s after calibrating to 3.1 s");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(report.contains("priced as torchtitan, eager runs its kernels: efficiency × "), "{report}");
    assert!(plan["engine_performance"]["source"].as_str().expect("source").contains("3.1"));
    // a torchtitan log: tps per device turned into a step by the spec's batch (16 × 8192 on 8)
    let log = dir.path().join("train.log");
    std::fs::write(
        &log,
        "step:  1  loss: 12.0  tps: 900\nstep: 10  loss: 9.0  tps: 5,762\nstep: 20  loss: 8.0  tps: 5,762\n",
    )
    .expect("log");
    let from_log = dir.path().join("log.json");
    let out = calibrate(&spec, &["--log", log.to_str().expect("utf-8")], &from_log);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let read: serde_json::Value = serde_json::from_slice(&std::fs::read(&from_log).expect("written")).expect("json");
    let measured = read["measured"]["step_s"].as_f64().expect("step");
    assert!((measured - 16.0 * 8192.0 / (5762.0 * 8.0)).abs() < 1e-9, "{measured}");
    // the file is for torchtitan eager on a 500 W H100: a compiled run refuses it
    let other = std::fs::read_to_string(root.join("tt24-t1-8b-8g-bf16-compile.yaml")).expect("spec").replace(
        "engine: { name: torchtitan, compile: [model] }",
        &format!("engine: {{ name: torchtitan, compile: [model], calibration: {} }}", file.display()),
    );
    let wrong = dir.path().join("wrong.yaml");
    std::fs::write(&wrong, other).expect("write");
    let out = pipec(&["check", wrong.to_str().expect("utf-8")]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not for this run"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // nothing to fit from: no step, an unreadable log, a step no efficiency reaches
    for args in [vec!["--step", "-2"], vec!["--log", "/nonexistent/log"], vec!["--step", "0.001"]] {
        let bad = dir.path().join("bad.json");
        let out = calibrate(&spec, &args, &bad);
        assert!(!out.status.success(), "{args:?}");
        assert!(!bad.exists(), "{args:?}: nothing written");
        if args[1] == "0.001" {
            let said = String::from_utf8_lossy(&out.stderr);
            assert!(said.contains("is the step of this spec's layout and batch?"), "{said}");
        }
    }
    // on a device file `pipec calibrate` measured (its kernels at their measured rates), a
    // run faster than any efficiency reaches says to measure the device again
    let mut cpu = pipec_plan::device::DeviceModel::uniform("cpu (pipec calibrate)", 4e9, 1e11);
    cpu.memory_bandwidth = 1e10;
    cpu.product_traffic = Some(pipec_plan::device::Traffic::new(1e10, 1e6));
    std::fs::write(dir.path().join("cpu.json"), serde_json::to_string(&cpu).expect("json")).expect("write");
    let readme = std::fs::read_to_string("specs/mlp-1f1b.yaml").expect("spec");
    let line = readme.lines().find(|l| l.trim_start().starts_with("device:")).expect("a device line");
    let on_file = dir.path().join("on-file.yaml");
    std::fs::write(&on_file, readme.replace(line, "  device: { file: cpu.json }")).expect("write");
    let bad = dir.path().join("bad.json");
    let out = calibrate(&on_file, &["--step", "1ns"], &bad);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("measure the device again (`pipec calibrate`"), "{said}");
    assert!(!bad.exists());
    // where the executor's own work per layer pass is most of the step, a run 10% faster
    // than the file's prediction fits: the constant is the machine's speed, and every
    // figure the file measured runs at it, not the products alone
    cpu.layer_pass = Some(2e-4);
    std::fs::write(dir.path().join("cpu.json"), serde_json::to_string(&cpu).expect("json")).expect("write");
    let step = |spec: &Path, out: &str| {
        let plan = compiled_plan(spec, &dir.path().join(out));
        plan["simulation"]["step_time_s"].as_f64().expect("step")
    };
    let before = step(&on_file, "before");
    let fitted = dir.path().join("fitted.json");
    let out = calibrate(&on_file, &["--step", &format!("{}", 0.9 * before)], &fitted);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let named = dir.path().join("named.yaml");
    let text = std::fs::read_to_string(&on_file).expect("spec").replace(
        "name: mlp-1f1b",
        &format!("name: mlp-1f1b\nengine: {{ name: pipec, calibration: {} }}", fitted.display()),
    );
    std::fs::write(&named, text).expect("write");
    let after = step(&named, "after");
    assert!((after / (0.9 * before) - 1.0).abs() < 1e-3, "{before} → {after}");
}

/// The llama-tiny spec with `edit` applied, its data paths made absolute, written into `dir`.
fn llama_tiny_variant(dir: &Path, name: &str, edit: impl Fn(String) -> String) -> std::path::PathBuf {
    let spec = std::fs::read_to_string("specs/llama-tiny.yaml").expect("spec");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/data");
    let path = dir.join(name);
    std::fs::write(&path, edit(spec.replace(": data/", &format!(": {}/", data.display())))).expect("spec");
    path
}

/// `pipec compile --emit plan`'s plan.json as JSON.
fn compiled_plan(spec: &Path, out: &Path) -> serde_json::Value {
    let run = pipec(&["compile", spec.to_str().expect("utf-8"), "--emit", "plan", "-o", out.to_str().expect("utf-8")]);
    assert!(run.status.success(), "{}", both_streams(&run));
    serde_json::from_slice(&run.stdout).expect("plan.json")
}

#[test]
fn compile_reports_tokens_per_device_and_mfu_for_a_language_model_only() {
    let dir = tempfile::tempdir().expect("temp dir");
    // llama-tiny: d 64, 4 heads of 16, 2 key/value heads, SwiGLU 172, vocabulary 512, 64
    // tokens, 2 blocks, on 2 CPU devices of 40 GFLOP/s. Megatron-LM's count per token:
    // blocks 2·6·(64·(64 + 2·32) + 64·64 + 3·64·172) = 543,744; logits 6·64·512 = 196,608;
    // causal attention 2·6·(64 + 64)·64/2 = 49,152: 789,504
    let plan = compiled_plan(Path::new("specs/llama-tiny.yaml"), &dir.path().join("megatron"));
    let sim = &plan["simulation"];
    let mfu = &sim["mfu"];
    assert_eq!(mfu["formula"], "megatron", "{sim}");
    assert_eq!(mfu["flops_per_token"].as_f64(), Some(789_504.0));
    assert_eq!(mfu["peak"], serde_json::json!({"flops_per_s": 40e9, "device": "cpu", "precision": "fp32"}));
    let samples = sim["throughput_samples_per_s"].as_f64().expect("samples/s");
    let per_device = sim["tokens_per_s_per_device"].as_f64().expect("tokens/s per device");
    assert!((per_device - samples * 64.0 / 2.0).abs() <= 1e-9 * per_device, "{sim}");
    let fraction = mfu["fraction"].as_f64().expect("fraction");
    assert!((fraction - per_device * 789_504.0 / 40e9).abs() <= 1e-9 * fraction, "{sim}");
    // the summary names the count and the peak
    let human = pipec(&["compile", "specs/llama-tiny.yaml", "-o", dir.path().join("h").to_str().expect("utf-8")]);
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains(&format!(
            "per device: {per_device:.0} tokens/s, MFU {:.1}% (Megatron-LM's count",
            fraction * 100.0
        )),
        "{text}"
    );
    assert!(text.contains("789.5 kFLOP per token; of 40.0 GFLOP/s, cpu's dense fp32 peak)"), "{text}");

    // for torchtitan, torchtitan's count: 6 × the non-embedding parameters (2·(2·64 + 12,288
    // + 33,024) + 64 + 32,768 = 123,712) + 6·2·4·(16 + 16)·64 = 742,272 + 98,304 = 840,576
    let torchtitan = llama_tiny_variant(dir.path(), "tt.yaml", |s| format!("engine: torchtitan\n{s}"));
    let plan = compiled_plan(&torchtitan, &dir.path().join("torchtitan"));
    assert_eq!(plan["simulation"]["mfu"]["formula"], "torchtitan");
    assert_eq!(plan["simulation"]["mfu"]["flops_per_token"].as_f64(), Some(840_576.0));

    // an MLP classifier: samples/s only
    let plan = compiled_plan(Path::new("specs/mlp-1f1b.yaml"), &dir.path().join("mlp"));
    assert!(plan["simulation"].get("mfu").is_none() && plan["simulation"].get("tokens_per_s_per_device").is_none());
}

#[test]
fn a_run_on_another_kind_of_device_than_the_plans_shows_no_mfu() {
    // a plan for H100s run on the CPU backend: the CPU's peak is not the plan's
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = llama_tiny_variant(dir.path(), "h100.yaml", |s| {
        s.replace("{ kind: cpu, memory: 4GiB, throughput: 40GFLOP/s }", "h100-sxm")
    });
    let run = dir.path().join("run");
    let out = pipec(&["run", spec.to_str().expect("utf-8"), "--steps", "1", "-o", run.to_str().expect("utf-8")]);
    assert!(out.status.success(), "{}", both_streams(&out));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("MFU not shown: the peak of this run's CPU is not known (the plan describes h100-sxm"),
        "{log}"
    );
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics");
    let v: serde_json::Value = serde_json::from_str(metrics.lines().next().expect("a step")).expect("json");
    assert!(v["tokens_per_s_per_device"].as_f64().is_some() && v.get("mfu").is_none(), "{v}");
}

#[test]
fn compare_and_search_report_tokens_per_device_and_mfu_for_a_language_model() {
    // llama-tiny: 64 tokens a sample, 2 devices, 789,504 FLOPs per token by Megatron-LM's
    // count (compile_reports_tokens_per_device_and_mfu…), a 40 GFLOP/s CPU
    let consistent = |v: &serde_json::Value, samples_per_s: f64| {
        let per_device = v["tokens_per_s_per_device"].as_f64().expect("tokens/s per device");
        let fraction = v["mfu"]["fraction"].as_f64().expect("mfu");
        (per_device - samples_per_s * 64.0 / 2.0).abs() <= 1e-9 * per_device
            && (fraction - per_device * 789_504.0 / 40e9).abs() <= 1e-9 * fraction
            && v["mfu"]["formula"] == "megatron"
    };
    let out = pipec(&["compare", "specs/llama-tiny.yaml", "--format", "json"]);
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    let planned: Vec<&serde_json::Value> = lines.iter().filter(|l| l["step_time_s"].is_number()).collect();
    assert!(!planned.is_empty());
    for l in planned {
        assert!(consistent(l, l["throughput_samples_per_s"].as_f64().expect("samples/s")), "{l}");
    }
    let (table, _) = streams(&pipec(&["compare", "specs/llama-tiny.yaml"]));
    assert!(table.lines().next().is_some_and(|h| h.contains("tokens/s/dev") && h.contains("MFU")), "{table}");
    assert!(table.lines().last().is_some_and(|l| l.starts_with("MFU: Megatron-LM's count")), "{table}");
    let (table, _) = streams(&pipec(&["compare", "specs/mlp-1f1b.yaml"]));
    assert!(!table.contains("MFU"), "{table}");

    let out = pipec(&["search", "specs/llama-tiny.yaml", "--format", "json", "--top", "3"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let best = &report["best"];
    assert!(consistent(best, best["throughput_samples_per_s"].as_f64().expect("samples/s")), "{best}");
    for r in report["runner_ups"].as_array().expect("runner-ups") {
        assert!(consistent(r, r["throughput_samples_per_s"].as_f64().expect("samples/s")), "{r}");
    }
    let (text, _) = streams(&pipec(&["search", "specs/llama-tiny.yaml"]));
    let best_line = text.lines().find(|l| l.starts_with("best: ")).expect("best");
    assert!(best_line.contains(" tokens/s/device, MFU "), "{text}");
    assert!(text.lines().any(|l| l.starts_with("MFU: Megatron-LM's count")), "{text}");
}

#[test]
fn a_cpu_run_of_a_spec_with_an_inline_cpu_is_planned_for_this_machines_cached_calibration() {
    // README's example: its device is written inline (`kind: cpu, throughput: 20GFLOP/s`)
    let dir = tempfile::tempdir().expect("tmp");
    let cache = dir.path().join("cache");
    std::fs::create_dir_all(&cache).expect("folder");
    // this machine's calibration for two workers, as an earlier run would have cached it
    // (a measured device stands in for the measurement, which takes minutes in a debug build)
    let mut device = pipec_plan::device::DeviceModel::from_json(
        &std::fs::read_to_string("bench/specs/gpu/h100-burn-cuda.json").expect("a device file"),
    )
    .expect("device");
    device.name = "cpu (pipec calibrate, cached)".into();
    device.link = Some(pipec_plan::device::MeasuredLink { bandwidth: 2e9, latency: 40e-6, efficiency: 0.5 });
    let file = pipec_executor::calibrate::cache_file(&cache, &pipec_executor::calibrate::cpu_name(), 2);
    // with the executor's work per layer pass measured as 30 µs, and per step as 20 µs
    let cached_with = |overhead: f64, step: f64| {
        let d = pipec_plan::device::DeviceModel {
            layer_pass: Some(overhead),
            layer_pass_backward: Some(2.0 * overhead),
            step_pass: Some(step),
            ..device.clone()
        };
        serde_json::to_string(&d).expect("json")
    };
    let cached = |overhead: f64| cached_with(overhead, 20e-6);
    std::fs::write(&file, cached(30e-6)).expect("cache");
    let run = |spec: &str, switch: Option<&str>, out: &str| -> (String, serde_json::Value) {
        let mut c = Command::new(env!("CARGO_BIN_EXE_pipec"));
        c.args(["run", spec, "--steps", "2", "-o"])
            .arg(dir.path().join(out))
            .env("PIPEC_CACHE_DIR", &cache)
            .env_remove("PIPEC_CPU_CALIBRATION")
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        if let Some(v) = switch {
            c.env("PIPEC_CPU_CALIBRATION", v);
        }
        let o = c.output().expect("runs");
        let said = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "{said}");
        let plan = std::fs::read_to_string(dir.path().join(out).join("plan.json")).expect("plan");
        (said, serde_json::from_str(&plan).expect("json"))
    };
    let (said, this) = run("specs/mlp-1f1b.yaml", None, "this");
    assert!(said.contains("planned and predicted for this machine's CPU"), "{said}");
    assert!(said.contains("30.0 µs of the executor's work a layer pass and 20.0 µs a step"), "{said}");
    // the overhead is the spec's `overhead`: a layer's forward, twice its backward (the
    // first stage holds four layers)
    std::fs::write(&file, cached(0.0)).expect("cache");
    let (_, bare) = run("specs/mlp-1f1b.yaml", None, "bare");
    std::fs::write(&file, cached(30e-6)).expect("cache");
    let stage = |p: &serde_json::Value, k: &str| p["stages"][0][k].as_f64().expect("figure");
    assert_eq!(this["stages"][0]["layers"], serde_json::json!([0, 4]));
    assert!((stage(&this, "forward_s") - stage(&bare, "forward_s") - 4.0 * 30e-6).abs() < 1e-12);
    assert!((stage(&this, "backward_s") - stage(&bare, "backward_s") - 8.0 * 30e-6).abs() < 1e-12);
    // the work per step lengthens every step by itself, and nothing else
    std::fs::write(&file, cached_with(30e-6, 1e-3)).expect("cache");
    let (_, stepped) = run("specs/mlp-1f1b.yaml", None, "stepped");
    std::fs::write(&file, cached(30e-6)).expect("cache");
    let step = |p: &serde_json::Value| p["simulation"]["step_time_s"].as_f64().expect("step");
    assert!((step(&stepped) - step(&this) - (1e-3 - 20e-6)).abs() < 1e-12, "{} {}", step(&stepped), step(&this));
    assert_eq!(stepped["stages"], this["stages"]);
    assert!(said.contains(&format!("measured before, from {}", file.display())), "{said}");
    // nothing is measured when the cache holds this machine
    assert!(!said.contains("measuring this machine's CPU"), "{said}");
    // switched off: the spec's own figures, and no note
    let (said, spec) = run("specs/mlp-1f1b.yaml", Some("off"), "spec");
    assert!(!said.contains("this machine's CPU"), "{said}");
    assert!((step(&this) / step(&spec) - 1.0).abs() > 0.05, "{} and {}", step(&this), step(&spec));
    // the spec's memory figure is kept
    assert_eq!(this["devices"][0]["memory"]["capacity"], spec["devices"][0]["memory"]["capacity"]);
    // a plan priced for a GPU and trained on the CPU says whose times it predicts
    let (said, _) = run("bench/specs/gpu/mlp.yaml", None, "gpu");
    assert!(said.contains("note: the plan is priced for") && said.contains("not this machine's"), "{said}");
    assert!(!said.contains("planned and predicted for this machine's CPU"), "{said}");
}

/// The compile report says how many experts a device holds: with experts whole beside
/// tensor parallelism (`etp: 1`, 4 replicas × 2 ranks one group of 8), one of the 8 on each
/// device; split over the ranks (`ep: 2`), 4 a replica, halves on each rank. `pipec run`
/// trains the whole experts; over one replica's ranks (`ep` equal to `tp`) it refuses them
/// before it measures this machine's CPU for the spec's inline CPU device.
#[test]
fn the_compile_report_counts_each_devices_experts_whole_or_split() {
    let dir = tempfile::tempdir().expect("tmp");
    let text = std::fs::read_to_string("specs/moe-tiny.yaml")
        .expect("example")
        .replace("devices_per_node: 4", "devices_per_node: 8")
        .replace("path: data/", &format!("path: {}/specs/data/", env!("CARGO_MANIFEST_DIR")))
        .replace(
            "  stages: \"2-2\"\n  schedule: 1f1b\n  microbatches: 8\n  ep: 2\n",
            "  dp: 4\n  tp: 2\n  sequence_parallel: true\n  schedule: dp-only\n  microbatches: 8\n",
        );
    assert!(text.contains("tp: 2"), "{text}");
    for (strategy, said) in [
        ("  ep: 8\n  etp: 1\n", "expert parallelism: ep 8 (experts whole: `etp: 1`) — each device holds 1 of every block's 8 experts"),
        ("  ep: 2\n", "expert parallelism: ep 2 — each replica holds 4, split over its 2 tensor-parallel ranks, of every block's 8 experts"),
    ] {
        let spec = dir.path().join("moe.yaml");
        std::fs::write(&spec, text.replace("  microbatches: 8\n", &format!("  microbatches: 8\n{strategy}"))).expect("write");
        let out = pipec(&["compile", spec.to_str().expect("utf-8"), "-o", dir.path().join("out").to_str().expect("utf-8")]);
        let report = both_streams(&out);
        assert!(report.contains(said), "{report}");
        if strategy.contains("etp") {
            let run = |spec: &Path, calibration: Option<&str>| {
                let mut c = Command::new(env!("CARGO_BIN_EXE_pipec"));
                c.args(["run", spec.to_str().expect("utf-8"), "--steps", "2", "-o"])
                    .arg(dir.path().join("run"))
                    .env_remove("PIPEC_CPU_CALIBRATION")
                    .env("PIPEC_CACHE_DIR", dir.path().join("cache"));
                if let Some(v) = calibration {
                    c.env("PIPEC_CPU_CALIBRATION", v);
                }
                c.output().expect("pipec runs")
            };
            let trained = run(&spec, Some("off"));
            let said = both_streams(&trained);
            assert_eq!(trained.status.code(), Some(0), "{said}");
            // each device holds the model state the plan says (its routers whole on each
            // rank, its one whole expert of every block)
            for d in 0..8 {
                let prefix = format!("d{d} ");
                let line = said.lines().map(str::trim).find(|l| l.starts_with(&format!("{prefix}weights "))).expect("held");
                // "weights A (B)", "gradients A (B)", "optimizer A (B)": measured A, the plan's B
                for part in line[prefix.len()..].split("  ") {
                    let (_, figures) = part.split_once(' ').expect("a name and its figures");
                    let (measured, plan) = figures.split_once(" (").expect("measured (plan)");
                    assert_eq!(measured, plan.trim_end_matches(')'), "{line}");
                }
            }
            // over one replica's ranks: refused before this machine's CPU is measured for
            // the spec's inline CPU device (minutes, the first time: here an empty cache)
            let folded = dir.path().join("folded.yaml");
            std::fs::write(&folded, std::fs::read_to_string(&spec).expect("spec").replace("  ep: 8\n", "  ep: 2\n"))
                .expect("write");
            let refused = run(&folded, None);
            let said = both_streams(&refused);
            assert_eq!(refused.status.code(), Some(1), "{said}");
            assert!(said.contains("groups of two replicas or more"), "{said}");
            assert!(!said.contains("measuring this machine's CPU"), "{said}");
            assert!(!dir.path().join("cache").exists(), "nothing measured, nothing cached");
        }
    }
}

/// `pipec compile` says what recompute inside the blocks runs again: for pipec's executor,
/// which halves of each block (and the first blocks whole).
#[test]
fn compile_says_what_the_executor_runs_again() {
    let dir = tempfile::tempdir().expect("temp dir");
    let spec = dir.path().join("rc.yaml");
    let text = "name: rc\nmodel:\n  input: [16]\n  layers:\n    - embedding(50, 32)\n    - repeat 2: transformer_block(d=32, heads=4, ff=64, causal=true)\n    - layernorm\n    - linear(32, 50)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 1\n  device: { kind: cpu, memory: 1GiB, throughput: 10GFLOP/s }\n  links:\n    intra_node: { bandwidth: 1GB/s, latency: 5us }\nstrategy:\n  stages: \"1\"\n  schedule: gpipe\n  microbatches: 1\n  recompute: { modules: [core_attn, mlp], layers: 1 }\ntraining:\n  batch_size: 4\n  steps: 1\n  optimizer: { kind: sgd, lr: 0.1 }\n";
    std::fs::write(&spec, text).expect("spec");
    let out =
        pipec(&["compile", spec.to_str().expect("utf-8"), "-o", dir.path().join("plan").to_str().expect("utf-8")]);
    let said = both_streams(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(
        said.contains("recompute inside the blocks `{ modules: [core_attn, mlp], layers: 1 }`: pipec's executor runs again in each backward the first 1 block(s) of every stage whole, then each block's MLP half (its norm, MLP or experts and residual sum) from its input, the attention core inside its kernel"),
        "{said}"
    );
}

/// DeepSeek-V3's expert bias (`expert_bias=true`, its `e_score_correction_bias`): read from
/// a Hugging Face checkpoint, added to the sigmoid scores for the choice only, held fixed
/// (nothing trains it), kept in pipec's checkpoints and written back by `pipec export`. A
/// copy of the deepseek-v3-moe fixture whose bias is not zero routes otherwise than its
/// zeros, and trains to one device's numbers on a pipeline, on replicas and under tensor
/// parallelism; without `expert_bias=true` its bias is refused, naming the key.
#[test]
fn a_deepseek_expert_bias_is_read_routed_with_kept_fixed_and_written_back() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf/deepseek-v3-moe");
    let dir = tempfile::tempdir().expect("temp dir");
    let biased = dir.path().join("biased");
    std::fs::create_dir(&biased).expect("dir");
    std::fs::copy(fixture.join("config.json"), biased.join("config.json")).expect("config");
    let mut tensors =
        pipec_plan::hf::read_safetensors(&std::fs::read(fixture.join("model.safetensors")).expect("fixture"))
            .expect("safetensors");
    let key = "model.layers.1.mlp.gate.e_score_correction_bias";
    assert_eq!(tensors.get(key).map(|(_, v)| v.clone()), Some(vec![0.0; 8]), "the fixture's bias is zeros");
    let bias = vec![0.3f32, -0.2, 0.1, -0.4, 0.25, 0.0, -0.1, 0.15];
    tensors.insert(key.to_string(), (vec![8], bias.clone()));
    std::fs::write(biased.join("model.safetensors"), pipec_plan::hf::write_safetensors(&tensors).expect("write"))
        .expect("model");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("reference.json")).expect("fixture")).expect("json");
    let ids: Vec<Vec<u16>> = serde_json::from_value(reference["input_ids"].clone()).expect("ids");
    let mut tokens: Vec<u16> = ids.concat();
    tokens.push(7);
    let data = dir.path().join("tokens.bin");
    std::fs::write(&data, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).expect("tokens");
    let latent = "causal=true, norm=rmsnorm, mlp=swiglu, rope=10000, bias=false, head_dim=4, kv_lora=8, q_lora=8, rope_dim=4, v_head_dim=6, rope_scaling=yarn, rope_factor=4, rope_original=8, rope_attention_factor=1, rope_mscale_all_dim=1";
    let spec = |name: &str, devices: usize, layout: &str, expert_bias: bool| {
        let path = dir.path().join(format!("{name}.yaml"));
        let text = format!(
            "name: {name}\nmodel:\n  input: [12]\n  layers:\n    - embedding(50, 16)\n    - transformer_block(d=16, heads=4, ff=24, {latent})\n    - transformer_block(d=16, heads=4, ff=8, {latent}, experts=8, top_k=4, shared_experts=1, router=sigmoid, route_scale=2.5, route_groups=4, route_group_top=2, expert_bias={expert_bias})\n    - rmsnorm\n    - linear(16, 50, bias=false) as lm_head\n  loss: cross_entropy\n\
             cluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ kind: cpu, memory: 2GiB, throughput: 20GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\n\
             strategy:\n  {layout}\n  schedule: 1f1b\n  microbatches: 2\n\
             training:\n  batch_size: 2\n  steps: 3\n  checkpoint: {{ every: 3, dir: checkpoints }}\n  optimizer: {{ kind: adamw, lr: 0.01, weight_decay: 0.1 }}\n  data: {{ kind: tokens, path: {}, dtype: uint16 }}\n",
            data.display()
        );
        std::fs::write(&path, text).expect("spec");
        path
    };
    // without `expert_bias=true` a bias that is not zero is refused, naming the key
    let plain = spec("plain", 1, "stages: \"1\"", false);
    let out = pipec(&[
        "run",
        plain.to_str().expect("utf-8"),
        "--init",
        biased.to_str().expect("utf-8"),
        "--out",
        dir.path().join("plain").to_str().expect("utf-8"),
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains(key) && said.contains("expert_bias=true"), "{said}");
    // a bias that is not finite is refused, naming the tensor and the value
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).expect("dir");
    std::fs::copy(fixture.join("config.json"), broken.join("config.json")).expect("config");
    let mut nan = bias.clone();
    nan[5] = f32::NAN;
    tensors.insert(key.to_string(), (vec![8], nan));
    std::fs::write(broken.join("model.safetensors"), pipec_plan::hf::write_safetensors(&tensors).expect("write"))
        .expect("model");
    let out = pipec(&[
        "run",
        spec("broken", 1, "stages: \"1\"", true).to_str().expect("utf-8"),
        "--init",
        broken.to_str().expect("utf-8"),
        "--out",
        dir.path().join("broken-run").to_str().expect("utf-8"),
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains(key) && said.contains("NaN at value 5"), "{said}");
    // the bias routes otherwise than the fixture's zeros
    let zeros = dir.path().join("zeros");
    run_from_hugging_face(&spec("zeros", 1, "stages: \"1\"", true), &fixture, &zeros, &[]);
    let one = dir.path().join("one");
    run_from_hugging_face(&spec("one", 1, "stages: \"1\"", true), &biased, &one, &[]);
    let (with, without) = (run_losses(&one), run_losses(&zeros));
    assert_eq!(with.len(), 3);
    assert!(with.iter().zip(&without).all(|(a, b)| a != b), "{with:?} against {without:?}");
    // every layout trains to one device's numbers
    for (k, (devices, layout)) in
        [(2, "stages: \"1-1\""), (2, "stages: \"2\""), (4, "stages: \"1-1\"\n  tp: 2")].into_iter().enumerate()
    {
        let run = dir.path().join(format!("layout{k}"));
        run_from_hugging_face(&spec(&format!("layout{k}"), devices, layout, true), &biased, &run, &[]);
        let got = run_losses(&run);
        let apart = got.iter().zip(&with).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
        assert!(apart < 1e-5, "{layout}: {got:?} against one device's {with:?}");
        // kept fixed through three AdamW steps with weight decay, and written back
        let exported = dir.path().join(format!("layout{k}-hf"));
        let out = pipec(&[
            "export",
            run.join("checkpoints").to_str().expect("utf-8"),
            "-o",
            exported.to_str().expect("utf-8"),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let written = pipec_plan::hf::read_dir(&exported).expect("exported");
        assert_eq!(written.get(key).map(|(_, v)| v.clone()), Some(bias.clone()), "{layout}");
    }
}
