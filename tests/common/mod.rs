//! What several integration tests read of a run's output folder. (Each test crate uses a
//! part of it.)
#![allow(dead_code)]

use std::path::Path;

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
