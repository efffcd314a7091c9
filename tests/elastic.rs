//! `pipec launch --exec --elastic` over MPI on this machine: a rank killed mid-run is left
//! out, the spec is planned again for the devices left, and training resumes from the
//! newest checkpoint exactly as a fresh `--resume` of it on that plan would.

#![cfg(feature = "mpi")]

mod common;
use common::{replans, steps};

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn pipec() -> &'static str {
    env!("CARGO_BIN_EXE_pipec")
}

/// `pipec`, planned with the specs' own device figures (no measurement of this machine's CPU).
fn pipec_command() -> Command {
    let mut c = Command::new(pipec());
    c.env("PIPEC_CPU_CALIBRATION", "off");
    c
}

/// A 256-wide chain of 8 layers on one node of `devices` devices, checkpointed every 5
/// steps (wide enough that a step takes milliseconds, so a kill lands mid-run).
fn spec(stages: &str, devices: usize, steps: usize) -> String {
    format!(
        "name: elastic\nmodel:\n  input: [256]\n  layers:\n    - repeat 7: linear(256, 256) -> relu\n    - linear(256, 10)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: {devices}\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n  stages: {stages}\n  schedule: 1f1b\n  microbatches: 4\ntraining:\n  batch_size: 64\n  steps: {steps}\n  optimizer: {{ kind: adam, lr: 0.001 }}\n  seed: 5\n  checkpoint: {{ every: 5 }}\n  data: {{ kind: synthetic, samples: 256 }}\n"
    )
}

/// `pipec launch SPEC --exec --elastic EXTRA…` into `out`, started.
fn launch(spec: &Path, out: &Path, extra: &[&str]) -> Child {
    pipec_command()
        .arg("launch")
        .arg(spec)
        .arg("-o")
        .arg(out)
        .args(["--exec", "--elastic", "--timeout", "20"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("launch starts")
}

/// Kills (-9) the newest rank writing into `out` once `after` steps are in its metrics,
/// then waits for the launcher (at most 120 s): its output.
fn kill_a_rank_after(mut child: Child, out: &Path, after: usize) -> Output {
    let start = Instant::now();
    while steps(out).len() < after {
        if start.elapsed() > Duration::from_secs(120) || child.try_wait().expect("wait").is_some() {
            let _ = child.kill();
            let out = child.wait_with_output().expect("ended");
            panic!("no step {after} to kill at: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let pattern = format!("run .* -o {}", out.display());
    assert!(Command::new("pkill").args(["-9", "-n", "-f", &pattern]).status().expect("pkill").success(), "no rank");
    let waiter = std::thread::spawn(move || child.wait_with_output().expect("ended"));
    let start = Instant::now();
    while !waiter.is_finished() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = Command::new("pkill").args(["-9", "-f", &pattern]).status();
            panic!("the elastic job had not ended 120 s after the kill");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    waiter.join().expect("joined")
}

#[test]
fn a_killed_rank_is_left_out_and_training_resumes_on_the_devices_left_exactly() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("\"2-1-1\"", 4, 40)).expect("write");
    let out = dir.path().join("out");
    let run = kill_a_rank_after(launch(&spec_path, &out, &[]), &out, 7);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    // the re-plan: one device lost, the spec's 2-1-1 cannot run on 3, the search plans
    let events = replans(&out);
    assert_eq!(events.len(), 1, "{stderr}");
    let e = &events[0];
    assert_eq!(e["old_devices"], 4);
    assert!(e["new_devices"].as_u64().is_some_and(|n| (1..=3).contains(&n)), "{e}");
    assert_eq!(e["reason"], "lost");
    assert_eq!(e["devices"].as_array().map(Vec::len), Some(1), "{e}");
    assert!(e["searched_because"].as_str().is_some_and(|w| w.contains("E0402")), "{e}");
    assert!(e["predicted_step_s"].as_f64().is_some_and(|s| s > 0.0), "{e}");
    let resumed = e["resume_step"].as_u64().expect("resume step");
    assert!(resumed >= 5 && resumed.is_multiple_of(5) && resumed < 40, "{e}");
    assert!(stderr.contains("elastic: restart 1 of 3: lost d"), "{stderr}");
    // every step once, in order, the steps before the checkpoint from the first attempt
    let trained = steps(&out);
    assert_eq!(trained.iter().map(|s| s.0).collect::<Vec<_>>(), (0..40).collect::<Vec<_>>());
    // the steps from the checkpoint equal a fresh resume of it on the chosen plan
    let plan = out.join("elastic/plan-1.json");
    let ckpt = out.join(format!("checkpoints/step-{resumed:06}"));
    let fresh = dir.path().join("fresh");
    let np = e["new_devices"].as_u64().expect("devices").to_string();
    let again = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np, pipec(), "run"])
        .arg(&plan)
        .args(["--transport", "mpi", "--resume"])
        .arg(&ckpt)
        .arg("-o")
        .arg(&fresh)
        .output()
        .expect("mpirun");
    assert_eq!(again.status.code(), Some(0), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(trained[resumed as usize..].to_vec(), steps(&fresh));
    assert!(out.join("elastic/spec-1.yaml").is_file());
}

#[test]
fn an_elastic_job_stops_below_its_minimum_and_when_its_restarts_are_spent() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("straight", 2, 200)).expect("write");
    let out = dir.path().join("minimum");
    let run = kill_a_rank_after(launch(&spec_path, &out, &["--min-devices", "2"]), &out, 3);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(stderr.contains("1 device(s) are left after losing d"), "{stderr}");
    assert!(stderr.contains("fewer than the minimum of 2 (--min-devices)"), "{stderr}");
    let out = dir.path().join("budget");
    let run = kill_a_rank_after(launch(&spec_path, &out, &["--max-restarts", "0"]), &out, 3);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(stderr.contains("its 0 restart(s) are spent (--max-restarts)"), "{stderr}");
    assert!(replans(&out).is_empty(), "nothing was re-planned");
}

#[test]
fn an_elastic_launch_needs_checkpoints_and_a_spec() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    std::fs::write(&spec_path, spec("straight", 2, 4).replace("  checkpoint: { every: 5 }\n", "")).expect("write");
    let run = launch(&spec_path, &dir.path().join("out"), &[]).wait_with_output().expect("ends");
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("training.checkpoint: { every: N }"));
    let run = pipec_command().args(["launch", "x.yaml", "--elastic"]).output().expect("runs");
    assert_eq!(run.status.code(), Some(2), "--elastic without --exec is a usage error");
}

/// A stand-in for Slurm's `srun` on a two-node allocation `n[1-2]` (none is installed
/// here): it logs its arguments and starts the tasks on Open MPI with the variables srun
/// gives them, and reports a task that a signal ended as srun does (`srun: error: n2: task
/// 3: Killed`, the node from `--ntasks-per-node`).
fn fake_srun(dir: &Path) -> std::path::PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("mkdir");
    let log = bin.join("srun.log");
    let script = format!(
        r#"#!/bin/sh
echo "$@" >> "{log}"
n=1; ppn=1
while [ $# -gt 0 ]; do case "$1" in --ntasks=*) n=${{1#--ntasks=}}; shift ;; --ntasks-per-node=*) ppn=${{1#--ntasks-per-node=}}; shift ;; --*) shift ;; *) break ;; esac; done
{{ mpirun --allow-run-as-root --oversubscribe -np "$n" sh -c 'export SLURM_PROCID=$OMPI_COMM_WORLD_RANK SLURM_LOCALID=$OMPI_COMM_WORLD_LOCAL_RANK SLURM_NTASKS=$OMPI_COMM_WORLD_SIZE; unset OMPI_COMM_WORLD_RANK; exec "$@"' task "$@"; echo $? > "{log}.status"; }} 2>&1 | while IFS= read -r line; do
  case "$line" in
    *"process rank "*"exited on signal"*) r=$(echo "$line" | sed -E 's/.*process rank ([0-9]+) .*/\1/'); echo "srun: error: n$((r / ppn + 1)): task $r: Killed" >&2 ;;
    *) printf '%s\n' "$line" >&2 ;;
  esac
done
exit $(cat "{log}.status")
"#,
        log = log.display()
    );
    let path = bin.join("srun");
    std::fs::write(&path, script).expect("write");
    assert!(Command::new("chmod").arg("+x").arg(&path).status().expect("chmod").success());
    bin
}

#[test]
fn under_slurm_a_node_with_a_killed_task_is_excluded_and_the_job_goes_on() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec_path = dir.path().join("spec.yaml");
    let text = spec("\"2-1-1\"", 2, 40).replace("  nodes: 1\n", "  nodes: 2\n").replace(
        "    intra_node: { bandwidth: 10GB/s, latency: 5us }\n",
        "    intra_node: { bandwidth: 10GB/s, latency: 5us }\n    inter_node: { bandwidth: 1GB/s, latency: 20us }\n",
    );
    std::fs::write(&spec_path, text).expect("write");
    let bin = fake_srun(dir.path());
    let out = dir.path().join("out");
    let child = pipec_command()
        .arg("launch")
        .arg(&spec_path)
        .arg("-o")
        .arg(&out)
        .args(["--slurm", "--exec", "--elastic", "--timeout", "20"])
        .env("PATH", format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default()))
        .env("SLURM_JOB_NODELIST", "n[1-2]")
        .env("SLURM_JOB_NUM_NODES", "2")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("launch starts");
    let run = kill_a_rank_after(child, &out, 7);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    // the newest rank is task 3, on n2: n2 leaves whole, and the second step excludes it
    let calls = std::fs::read_to_string(bin.join("srun.log")).expect("log");
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls[0].starts_with("--nodes=2 --ntasks=4 --ntasks-per-node=2 "), "{}", calls[0]);
    assert!(calls[1].starts_with("--nodes=1 ") && calls[1].contains("--exclude=n2"), "{}", calls[1]);
    assert!(stderr.contains("lost d3 (rank 3), and with it host n2;"), "{stderr}");
    let e = replans(&out).into_iter().next().expect("re-planned");
    assert_eq!((e["old_devices"].as_u64(), e["new_devices"].as_u64().map(|n| n <= 2)), (Some(4), Some(true)), "{e}");
    assert_eq!(steps(&out).iter().map(|s| s.0).collect::<Vec<_>>(), (0..40).collect::<Vec<_>>());
}
