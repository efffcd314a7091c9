//! `pipec run --transport tcp`: processes started by hand with torchrun's variables
//! (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), as a container scheduler or a
//! Kubernetes training operator starts them; no MPI.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
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

/// A 3-device `2-1` pipeline of a small chain, `steps` steps.
fn spec(dir: &Path, steps: usize, extra: &str) -> PathBuf {
    let text = format!(
        "name: tcp\nmodel:\n  input: [16]\n  layers:\n    - linear(16, 32) -> relu\n    - repeat 2: linear(32, 32) -> relu\n    - linear(32, 4)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 3\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n  stages: \"2-1\"\n  schedule: 1f1b\n  microbatches: 4\ntraining:\n  batch_size: 32\n  steps: {steps}\n  optimizer: {{ kind: adam, lr: 0.005 }}\n  seed: 3\n{extra}  data: {{ kind: synthetic, samples: 96 }}\n"
    );
    let path = dir.join(format!("tcp-{steps}.yaml"));
    std::fs::write(&path, text).expect("spec");
    path
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0)).expect("bind").local_addr().expect("addr").port()
}

/// Starts rank `rank` of `size` with `args` after `pipec run SPEC --transport tcp`.
fn rank(spec: &Path, rank: usize, size: usize, port: u16, args: &[&str]) -> Child {
    pipec_command()
        .arg("run")
        .arg(spec)
        .args(["--transport", "tcp"])
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", size.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts")
}

/// Waits for every process (reading their output as it comes), at most `limit`: their
/// outputs, in order.
fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<Output> {
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let waiters: Vec<_> =
        children.into_iter().map(|c| std::thread::spawn(move || c.wait_with_output().expect("output"))).collect();
    let start = Instant::now();
    while !waiters.iter().all(|w| w.is_finished()) {
        if start.elapsed() > limit {
            for pid in &pids {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
            panic!("the ranks had not ended after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    waiters.into_iter().map(|w| w.join().expect("joined")).collect()
}

/// Three ranks of `spec` started on a free port, returned once they have trained three
/// steps, with their output folder. A rank that ends first fails the test with every rank's
/// words, unless its port was taken between `free_port` and its start (another test's):
/// then the ranks start again on another port, at most three times.
fn three_ranks_training(dir: &Path, spec: &Path) -> (Vec<Child>, PathBuf) {
    for attempt in 0..3 {
        let out = dir.join(format!("tcp-{attempt}"));
        let port = free_port();
        let mut ranks: Vec<Child> = (0..3).map(|r| rank(spec, r, 3, port, &["-o", out.to_str().expect("p")])).collect();
        let start = Instant::now();
        let ended = loop {
            if losses(&out).len() >= 3 {
                return (ranks, out);
            }
            let exited = ranks.iter_mut().any(|c| c.try_wait().ok().flatten().is_some());
            if exited || start.elapsed() > Duration::from_secs(60) {
                break exited;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for c in &mut ranks {
            let _ = c.kill();
        }
        let said: Vec<String> = ranks
            .into_iter()
            .map(|c| String::from_utf8_lossy(&c.wait_with_output().expect("output").stderr).into_owned())
            .collect();
        let taken = said.iter().any(|s| s.to_lowercase().contains("in use"));
        assert!(ended && taken, "no three steps (a rank ended: {ended}); the ranks said: {said:#?}");
    }
    panic!("three ports in a row were taken");
}

fn losses(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["loss"].as_f64())
        .collect()
}

#[test]
fn ranks_started_with_torchruns_variables_train_like_threads_and_resume_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec = spec(dir.path(), 6, "  checkpoint: { every: 3 }\n");
    let threads = dir.path().join("threads");
    let t = pipec_command().arg("run").arg(&spec).arg("-o").arg(&threads).output().expect("runs");
    assert_eq!(t.status.code(), Some(0), "{}", String::from_utf8_lossy(&t.stderr));
    // started in reverse order: the rendezvous waits for rank 0
    let out = dir.path().join("tcp");
    let o = out.to_str().expect("p");
    let port = free_port();
    let ranks: Vec<Child> = (0..3).rev().map(|r| rank(&spec, r, 3, port, &["-o", o])).collect();
    for (k, run) in wait_all(ranks, Duration::from_secs(120)).iter().enumerate() {
        assert_eq!(run.status.code(), Some(0), "rank {}: {}", 2 - k, String::from_utf8_lossy(&run.stderr));
    }
    assert_eq!(losses(&out), losses(&threads), "bit for bit the threaded run's losses");
    assert!(out.join("checkpoints/step-000003/state.json").is_file());
    // resumed over TCP from step 3: the last three steps again, exactly
    let resumed = dir.path().join("resumed");
    let (r, c) = (resumed.to_str().expect("p"), out.join("checkpoints/step-000003"));
    let port = free_port();
    let ranks: Vec<Child> =
        (0..3).map(|k| rank(&spec, k, 3, port, &["-o", r, "--resume", c.to_str().expect("p")])).collect();
    for run in wait_all(ranks, Duration::from_secs(120)) {
        assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
    }
    assert_eq!(losses(&resumed), losses(&threads)[3..].to_vec());
    // a resumed run's trace is its own, as in one process
    assert!(resumed.join("trace-from-step-3.json").is_file() && !resumed.join("trace.json").exists());
}

#[test]
fn a_killed_rank_ends_the_job_at_once_naming_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec = spec(dir.path(), 1_000_000, "");
    let out = dir.path().join("long");
    let o = out.to_str().expect("p");
    let port = free_port();
    // a receive timeout far longer than the test: the others must notice the closed
    // connection, not wait for the timeout
    let mut ranks: Vec<Child> = (0..3).map(|r| rank(&spec, r, 3, port, &["-o", o, "--timeout", "600"])).collect();
    let start = Instant::now();
    while losses(&out).len() < 3 {
        assert!(start.elapsed() < Duration::from_secs(60), "no steps after 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut victim = ranks.pop().expect("rank 2");
    victim.kill().expect("kill -9");
    let killed = Instant::now();
    let _ = victim.wait();
    let outputs = wait_all(ranks, Duration::from_secs(60));
    let took = killed.elapsed();
    for run in &outputs {
        assert_eq!(run.status.code(), Some(1));
    }
    let stderr: String = outputs.iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect();
    assert!(stderr.contains("rank 2 closed its connection"), "{stderr}");
    assert!(took < Duration::from_secs(30), "the job took {took:?} to end (receive timeout 600 s)");
}

#[test]
fn bad_variables_and_a_missing_rank_are_errors_that_say_what_to_set() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec = spec(dir.path(), 2, "");
    let run = |vars: &[(&str, &str)]| {
        let mut c = pipec_command();
        c.arg("run").arg(&spec).args(["--transport", "tcp", "-o"]).arg(dir.path().join("x"));
        for v in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            c.env_remove(v);
        }
        c.envs(vars.iter().copied()).output().expect("runs")
    };
    let err = |o: &Output| {
        assert_eq!(o.status.code(), Some(1));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    assert!(err(&run(&[("RANK", "0")])).contains("WORLD_SIZE is not set"));
    assert!(err(&run(&[("RANK", "0"), ("WORLD_SIZE", "2")])).contains("WORLD_SIZE is 2 but the plan has 3 devices"));
    // rank 1 alone: rank 0 never comes, and the rendezvous gives up at the start-up bound
    let port = free_port().to_string();
    let mut c = pipec_command();
    c.arg("run").arg(&spec).args(["--transport", "tcp", "--timeout", "2", "-o"]).arg(dir.path().join("y"));
    let o = c
        .env("RANK", "1")
        .env("WORLD_SIZE", "3")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .output()
        .expect("runs");
    let e = err(&o);
    assert!(
        e.contains(&format!("cannot reach rank 0 at 127.0.0.1:{port} (MASTER_ADDR, MASTER_PORT) within 2 s")),
        "{e}"
    );
    assert!(!dir.path().join("y").exists(), "nothing is written before the first step");
}

#[test]
fn ranks_that_run_different_things_all_stop_at_start_naming_the_difference() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec = spec(dir.path(), 2, "");
    let text = std::fs::read_to_string(&spec).expect("spec");
    let other_lr = dir.path().join("other-lr.yaml");
    std::fs::write(&other_lr, text.replace("lr: 0.005", "lr: 0.02")).expect("spec");
    let started = |specs: [&Path; 3], extra: [&[&str]; 3], out: &str| {
        let port = free_port();
        let o = dir.path().join(out);
        let o = o.to_str().expect("p").to_string();
        let ranks: Vec<Child> = (0..3)
            .map(|r| {
                let mut args = vec!["-o", o.as_str()];
                args.extend_from_slice(extra[r]);
                rank(specs[r], r, 3, port, &args)
            })
            .collect();
        let outputs = wait_all(ranks, Duration::from_secs(60));
        for run in &outputs {
            assert_eq!(run.status.code(), Some(1), "{}", String::from_utf8_lossy(&run.stderr));
        }
        assert!(losses(&dir.path().join(out)).is_empty(), "no step was trained");
        outputs.iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect::<Vec<_>>()
    };
    // rank 2 with another learning rate: every rank says so, naming the value on each
    let e = started([&spec, &spec, &other_lr], [&[], &[], &[]], "lr");
    for text in &e {
        assert!(text.contains("training.optimizer.lr: 0.005 on rank 0, 0.02 on rank 2"), "{text}");
    }
    // rank 1 with other --steps
    let e = started([&spec, &spec, &spec], [&[], &["--steps", "5"], &[]], "steps");
    assert!(e[0].contains("run.steps: 2 on rank 0, 5 on rank 1"), "{}", e[0]);
    // only rank 0 resumes from a checkpoint
    let first = dir.path().join("first");
    let one_step = one_step_spec(dir.path());
    let t = pipec_command().arg("run").arg(&one_step).arg("-o").arg(&first).output().expect("runs");
    assert_eq!(t.status.code(), Some(0), "{}", String::from_utf8_lossy(&t.stderr));
    let ckpt = first.join("checkpoints");
    let c = ckpt.to_str().expect("p");
    let e = started([&spec, &spec, &spec], [&["--resume", c], &[], &[]], "resume");
    assert!(
        e[1].contains("run.start: a checkpoint after step 1") && e[1].contains("pipec's initial values on rank 1"),
        "{}",
        e[1]
    );
}

/// The same model trained one step with a checkpoint after it.
fn one_step_spec(dir: &Path) -> PathBuf {
    spec(dir, 1, "  checkpoint: { every: 1 }\n")
}

#[test]
fn sigterm_to_one_rank_stops_every_rank_at_one_step_with_a_checkpoint_that_resumes_exactly() {
    // no periodic checkpoints: the stop's own is all the job has; the signal reaches one rank
    // only (a scheduler that signals one task), and the ranks' vote stops all three
    let dir = tempfile::tempdir().expect("tmp");
    let spec = spec(dir.path(), 100_000, "");
    let (ranks, out) = three_ranks_training(dir.path(), &spec);
    let signalled = Instant::now();
    let killed = Command::new("kill").args(["-TERM", &ranks[1].id().to_string()]).status().expect("kill");
    assert!(killed.success());
    let outputs = wait_all(ranks, Duration::from_secs(60));
    let took = signalled.elapsed();
    eprintln!("the stop took {:.3} s from SIGTERM to rank 1 to the last rank's exit", took.as_secs_f64());
    for (k, run) in outputs.iter().enumerate() {
        assert_eq!(run.status.code(), Some(1), "rank {k}: {}", String::from_utf8_lossy(&run.stderr));
    }
    let stderr = String::from_utf8_lossy(&outputs[0].stderr);
    let n = losses(&out).len();
    let (resume, last) =
        common::stop_checkpoint(&stderr, &out, n, "resume with (every rank, started as this job's were): ");
    assert!(resume.contains("--transport tcp"), "{resume}");
    assert_eq!(pipec_plan::checkpoint::read(&last).expect("whole").completed_steps, n);
    // resumed over TCP for three more steps, it equals a threaded run never stopped
    let total = (n + 3).to_string();
    let resumed = dir.path().join("resumed");
    let (r, c) = (resumed.to_str().expect("p"), last.to_str().expect("p"));
    let port = free_port();
    let ranks: Vec<Child> =
        (0..3).map(|k| rank(&spec, k, 3, port, &["-o", r, "--steps", &total, "--resume", c])).collect();
    for run in wait_all(ranks, Duration::from_secs(120)) {
        assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
    }
    let whole = dir.path().join("whole");
    let t = pipec_command().arg("run").arg(&spec).args(["--steps", &total, "-o"]).arg(&whole).output().expect("runs");
    assert_eq!(t.status.code(), Some(0), "{}", String::from_utf8_lossy(&t.stderr));
    let uninterrupted = losses(&whole);
    assert_eq!(losses(&out), uninterrupted[..n].to_vec(), "the stopped job's steps");
    assert_eq!(losses(&resumed), uninterrupted[n..].to_vec(), "the resumed job's steps");
}

#[test]
fn the_nccl_check_is_refused_where_it_cannot_run() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec = spec(dir.path(), 1, "");
    for extra in
        [&["--nccl-check"][..], &["--nccl-check", "--transport", "tcp"], &["--nccl-check", "--backend", "cuda"]]
    {
        let o = pipec_command()
            .arg("run")
            .arg(&spec)
            .args(extra)
            .arg("-o")
            .arg(dir.path().join("n"))
            .output()
            .expect("runs");
        assert_eq!(o.status.code(), Some(2), "{extra:?}");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            e.contains("`--nccl-check` starts NCCL between processes, one per GPU: it needs `--backend cuda` with `--transport mpi` or `--transport tcp`"),
            "{e}"
        );
        assert!(!dir.path().join("n").exists());
    }
}
