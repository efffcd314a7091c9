//! What several integration tests read of a run's output folder. (Each test crate uses a
//! part of it.)
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// The lines of `metrics.jsonl` in `dir`, parsed (none when it is missing).
pub fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// (step, loss) of every step line in `dir`'s metrics (an elastic launcher's event lines
/// left out).
pub fn steps(dir: &Path) -> Vec<(u64, f64)> {
    metrics(dir).iter().filter_map(|l| Some((l["step"].as_u64()?, l["loss"].as_f64()?))).collect()
}

/// The elastic launcher's re-plan lines in `dir`'s metrics.
pub fn replans(dir: &Path) -> Vec<serde_json::Value> {
    metrics(dir).into_iter().filter(|l| l["event"] == "replan").collect()
}

/// Sends SIGTERM to `child` and waits for it to end: its output, and the time from the
/// signal to its exit.
pub fn sigterm_and_wait(child: Child) -> (Output, Duration) {
    let signalled = Instant::now();
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(killed.success());
    let out = child.wait_with_output().expect("ends");
    (out, signalled.elapsed())
}

/// What a run stopped by a signal after `done` completed steps into `dir` says on `stderr`:
/// the checkpoint of its last step holds it, and the resume command (the line after
/// `prefix`) names that checkpoint. The command, and the checkpoint's folder.
pub fn stop_checkpoint(stderr: &str, dir: &Path, done: usize, prefix: &str) -> (String, PathBuf) {
    let last = dir.join(format!("checkpoints/step-{done:06}"));
    assert!(stderr.contains(&format!("the checkpoint of step {} holds it", done - 1)), "{stderr}");
    let resume = stderr.lines().find_map(|l| l.strip_prefix(prefix)).expect("a resume command");
    assert!(resume.ends_with(&last.display().to_string()), "{resume}");
    (resume.to_string(), last)
}
