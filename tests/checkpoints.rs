//! Asynchronous checkpoints under `kill -9`: whenever a run dies — mid-step, while its
//! writer is writing, between a checkpoint's renames — the last published checkpoint
//! loads and resumes exactly.

mod common;
use common::steps;

use std::process::{Command, Stdio};
use std::time::Duration;

fn pipec() -> &'static str {
    env!("CARGO_BIN_EXE_pipec")
}

/// `pipec`, planned with the specs' own device figures (no measurement of this machine's CPU).
fn pipec_command() -> Command {
    let mut c = Command::new(pipec());
    c.env("PIPEC_CPU_CALIBRATION", "off");
    c
}

/// Two pipeline stages of a 128-wide chain with Adam; `checkpoint` is the training
/// section's checkpoint line (or nothing).
fn spec(checkpoint: &str) -> String {
    format!(
        "name: kills\nmodel:\n  input: [128]\n  layers:\n    - repeat 3: linear(128, 128) -> relu\n    - linear(128, 10)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n  stages: straight\n  schedule: 1f1b\n  microbatches: 4\ntraining:\n  batch_size: 32\n  steps: 100000\n  optimizer: {{ kind: adam, lr: 0.001 }}\n  seed: 5\n{checkpoint}  data: {{ kind: synthetic, samples: 256 }}\n"
    )
}

#[test]
fn twenty_kills_at_random_moments_leave_a_checkpoint_that_resumes_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    let reference_spec = dir.path().join("reference.yaml");
    std::fs::write(&reference_spec, spec("")).expect("write");
    let reference = dir.path().join("reference");
    let out = pipec_command()
        .arg("run")
        .arg(&reference_spec)
        .args(["--steps", "1500", "-o"])
        .arg(&reference)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let expected = steps(&reference);
    let spec_path = dir.path().join("kills.yaml");
    std::fs::write(&spec_path, spec("  checkpoint: { every: 1 }\n")).expect("write");
    let run = dir.path().join("run");
    let checkpoints = run.join("checkpoints");
    // a fixed sequence of moments: 30 ms to half a second after the start
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut published = Vec::new();
    for kill in 0..20 {
        let mut cmd = pipec_command();
        cmd.arg("run").arg(&spec_path).arg("-o").arg(&run);
        if checkpoints.join("latest").exists() {
            cmd.arg("--resume").arg(&run);
        }
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("starts");
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        std::thread::sleep(Duration::from_millis(30 + (seed >> 33) % 470));
        child.kill().expect("kill -9");
        let _ = child.wait();
        // the last published checkpoint, whole (every file against its checksum)
        let Ok(latest) = pipec_plan::checkpoint::locate_in(&run, None) else {
            assert!(published.is_empty(), "kill {kill}: the checkpoints published before are gone");
            continue;
        };
        let loaded = pipec_plan::checkpoint::read(&latest).unwrap_or_else(|e| panic!("kill {kill}: {e}"));
        let n = loaded.completed_steps;
        assert!(published.last().is_none_or(|p| n >= *p), "kill {kill}: went back from step {published:?} to {n}");
        assert!(n < expected.len(), "the reference run is too short for step {n}");
        published.push(n);
        // one step from it equals the uninterrupted run's step n
        let check = dir.path().join(format!("check-{kill}"));
        let out = pipec_command()
            .arg("run")
            .arg(&reference_spec)
            .arg("--resume")
            .arg(&latest)
            .args(["--steps", &(n + 1).to_string(), "-o"])
            .arg(&check)
            .output()
            .expect("runs");
        assert_eq!(out.status.code(), Some(0), "kill {kill}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(steps(&check), vec![expected[n]], "kill {kill}: resumed from step {n}");
    }
    // the kills landed at different steps, and training made progress through them
    published.dedup();
    assert!(published.len() >= 5, "{published:?}");
    eprintln!("checkpoints resumed after the kills: {published:?}");
}

/// Trains `text` in this process with checkpoints into a temporary folder: the steps'
/// metrics.
fn train(text: &str) -> Vec<pipec_executor::StepMetrics> {
    let s = pipec_grammar::check_source(text).spec.expect("valid");
    let p =
        pipec_compiler::compile(&s, &pipec_compiler::CompileOptions::default()).into_compiled().expect("compiles").plan;
    let dir = tempfile::tempdir().expect("tmp");
    let options =
        pipec_executor::RunOptions { checkpoint_dir: Some(dir.path().join("checkpoints")), ..Default::default() };
    pipec_executor::run(&p, &options, &mut |_| {}).expect("trains").steps
}

#[test]
fn a_synchronous_checkpoint_holds_the_next_step_and_neither_kind_changes_the_numbers() {
    let base = spec("").replace("steps: 100000", "steps: 6");
    let none = train(&base);
    assert!(none.iter().all(|m| m.checkpoint_wait_s.is_none()), "no checkpoints, no figure");
    let with = |c: &str| train(&base.replace("  seed: 5\n", &format!("  seed: 5\n{c}")));
    let sync = with("  checkpoint: { every: 2, async: false }\n");
    let waits: Vec<f64> = sync.iter().map(|m| m.checkpoint_wait_s.expect("figure")).collect();
    // after steps 1 and 3 (two and four completed) each worker waited for the write of
    // its copy before it began the next step; before each copy there was nothing to wait for
    for (k, w) in waits.iter().enumerate() {
        assert_eq!(*w > 0.0, k == 2 || k == 4, "step {k}: {waits:?}");
    }
    let asynchronous = with("  checkpoint: { every: 1 }\n");
    let loss = |v: &[pipec_executor::StepMetrics]| v.iter().map(|m| m.loss).collect::<Vec<_>>();
    assert_eq!(loss(&sync), loss(&none));
    assert_eq!(loss(&asynchronous), loss(&none));
}

#[test]
fn sigterm_writes_a_final_checkpoint_that_resumes_to_an_uninterrupted_runs_losses() {
    // a spec without periodic checkpoints: the stop's own checkpoint is all a preempted run has
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("stop.yaml");
    std::fs::write(&spec_path, spec("")).expect("write");
    let run = dir.path().join("run");
    let child = pipec_command()
        .arg("run")
        .arg(&spec_path)
        .arg("-o")
        .arg(&run)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    let start = std::time::Instant::now();
    while steps(&run).len() < 5 {
        assert!(start.elapsed() < Duration::from_secs(120), "no steps after 120 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (out, took) = common::sigterm_and_wait(child);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    eprintln!("the stop took {:.3} s from SIGTERM to the process's exit", took.as_secs_f64());
    assert!(took < Duration::from_secs(20), "the stop took {took:?}: {stderr}");
    let done = steps(&run);
    let n = done.len();
    assert!(done.iter().enumerate().all(|(i, (s, _))| *s == i as u64), "{done:?}");
    // the checkpoint of the last completed step, in the run's own `checkpoints` folder
    let (_, last) = common::stop_checkpoint(&stderr, &run, n, "resume with: ");
    assert!(stderr.contains("s after the stop request"), "{stderr}");
    assert_eq!(pipec_plan::checkpoint::read(&last).expect("whole").completed_steps, n);
    // resumed to step n + 4, it equals a run that was never stopped, loss for loss
    let total = (n + 4).to_string();
    let resumed = pipec_command()
        .arg("run")
        .arg(&spec_path)
        .args(["--steps", &total, "--resume"])
        .arg(&last)
        .arg("-o")
        .arg(&run)
        .output()
        .expect("runs");
    assert_eq!(resumed.status.code(), Some(0), "{}", String::from_utf8_lossy(&resumed.stderr));
    let whole = dir.path().join("whole");
    let uninterrupted =
        pipec_command().arg("run").arg(&spec_path).args(["--steps", &total, "-o"]).arg(&whole).output().expect("runs");
    assert_eq!(uninterrupted.status.code(), Some(0), "{}", String::from_utf8_lossy(&uninterrupted.stderr));
    assert_eq!(steps(&run), steps(&whole));
    assert_eq!(steps(&whole).len(), n + 4);
}

#[test]
fn a_stop_that_outlasts_its_grace_ends_the_run_saying_no_final_checkpoint_was_written() {
    // steps of seconds (4 products of 4096 × 1024 × 1024 each way), a grace of one second,
    // and the signal as a step begins: the step cannot end within the grace
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("slow.yaml");
    std::fs::write(
        &spec_path,
        "name: slow\nmodel:\n  input: [1024]\n  layers:\n    - repeat 4: linear(1024, 1024) -> relu\n    - linear(1024, 10)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 1\n  device: { memory: 8GiB, throughput: 10GFLOP/s }\n  links:\n    intra_node: { bandwidth: 10GB/s, latency: 5us }\nstrategy:\n  stages: \"1\"\n  schedule: gpipe\n  microbatches: 1\ntraining:\n  batch_size: 4096\n  steps: 1000\n  optimizer: { kind: sgd, lr: 0.01 }\n  data: { kind: synthetic, samples: 4096 }\n",
    )
    .expect("write");
    let run = dir.path().join("run");
    let child = pipec_command()
        .arg("run")
        .arg(&spec_path)
        .args(["--stop-grace", "1", "-o"])
        .arg(&run)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    let start = std::time::Instant::now();
    while steps(&run).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(300), "no step after 300 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    let first_step = start.elapsed();
    let (out, took) = common::sigterm_and_wait(child);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("did not end within 1 s of the stop request (--stop-grace)"), "{stderr}");
    assert!(took < Duration::from_secs(5), "exited {took:?} after the signal (the first step took {first_step:?})");
    // no checkpoint was published, and what was begun is left for the next run to remove
    assert!(pipec_plan::checkpoint::locate_in(&run, None).is_err());
    eprintln!("first step {first_step:?}; exited {took:?} after the signal");
}
