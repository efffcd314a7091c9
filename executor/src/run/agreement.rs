//! The ranks of a job agree on what they run before they train. A launcher that starts every
//! process itself (torchrun's variables, `pipec run --transport tcp`) gives each its own
//! command line, so one rank can be started with another spec, another `--steps`, or
//! without `--init`; left alone it would train to exit 0 with weights nobody asked for.
//!
//! Each rank describes its run as a [`Fingerprint`]: named parts, each the value itself when
//! it is short (`training.optimizer.lr = 0.01`) or a digest of it (`streams.d3 = 9f1c…`).
//! Rank 0 compares every other rank's with its own and sends each its verdict; any
//! difference stops every rank at start, naming the parts that differ and where.
//!
//! - **The plan's parts** are its JSON, flattened to leaves: everything that decides what is
//!   computed (model, training, schedule, partition, stages, devices, groups, and each
//!   device's streams as one digest per device). The cost model's inputs and the simulation
//!   (`layers`, `simulation`) decide nothing that runs, so they are left out.
//! - **The start**: pipec's initial values (from the plan's seed), or the checkpoint's step
//!   and a digest of every weight and optimizer record it holds (`--resume`, `--init`).
//!   The weights' digest is a CRC-32 (`crc32fast`, several GB/s): it is there to catch
//!   different files, not an adversary, and a cryptographic hash of a large model would
//!   take seconds on every rank.
//! - **The steps** the run trains.

use std::collections::BTreeMap;

use pipec_plan::checkpoint::Loaded;
use pipec_plan::Plan;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The longest value shown as itself; a longer one is shown by its digest.
const SHOWN: usize = 80;

/// What a rank runs, as named parts (see the module's notes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    parts: BTreeMap<String, String>,
}

/// A short hex digest of `bytes`.
fn digest(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// `value`'s leaves under `path` into `out`: scalars as their text, objects and arrays
/// entry by entry.
fn flatten(path: &str, value: &serde_json::Value, out: &mut BTreeMap<String, String>) {
    use serde_json::Value;
    let join = |k: &str| if path.is_empty() { k.to_string() } else { format!("{path}.{k}") };
    match value {
        Value::Object(m) => m.iter().for_each(|(k, v)| flatten(&join(k), v, out)),
        Value::Array(items) => {
            items.iter().enumerate().for_each(|(i, v)| flatten(&format!("{path}[{i}]"), v, out));
            out.insert(format!("{path}.len"), items.len().to_string());
        }
        Value::String(s) if s.len() > SHOWN => {
            out.insert(path.to_string(), format!("#{}", digest(s.as_bytes())));
        }
        other => {
            out.insert(path.to_string(), other.to_string());
        }
    }
}

impl Fingerprint {
    /// The fingerprint of running `plan` for `steps` steps from `start` (None: pipec's
    /// initial values).
    pub fn of(plan: &Plan, steps: usize, start: Option<&Loaded>) -> Result<Fingerprint, String> {
        let mut json = serde_json::to_value(plan).map_err(|e| format!("the plan as JSON: {e}"))?;
        let mut parts = BTreeMap::new();
        if let serde_json::Value::Object(m) = &mut json {
            // what the cost model and the simulation read, not what runs
            m.remove("layers");
            m.remove("simulation");
            // each device's instructions as one digest: a plan of 1,024 devices has millions
            for key in ["streams", "eval", "flush_free"] {
                if let Some(v) = m.remove(key) {
                    digest_streams(key, &v, &mut parts);
                }
            }
        }
        flatten("", &json, &mut parts);
        parts.insert("run.steps".into(), steps.to_string());
        parts.insert("run.start".into(), start_of(start));
        Ok(Fingerprint { parts })
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Fingerprint, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("a rank's description of its run is not readable: {e}"))
    }

    /// The parts that differ, as `part: A here, B there` lines (`here`, `there` name the
    /// ranks), the plan's before the run's.
    pub fn differences(&self, other: &Fingerprint, here: &str, there: &str) -> Vec<String> {
        let absent = "(absent)".to_string();
        let mut keys: Vec<&String> = self.parts.keys().chain(other.parts.keys()).collect();
        keys.sort();
        keys.dedup();
        keys.into_iter()
            .filter_map(|k| {
                let (a, b) = (self.parts.get(k).unwrap_or(&absent), other.parts.get(k).unwrap_or(&absent));
                (a != b).then(|| format!("{k}: {a} on {here}, {b} on {there}"))
            })
            .collect()
    }
}

/// One digest per device of a `streams`-shaped section (`{device: [instructions]}`, or
/// `flush_free`'s `{prologue: {...}, epilogue: {...}}`).
fn digest_streams(path: &str, value: &serde_json::Value, out: &mut BTreeMap<String, String>) {
    match value {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let p = format!("{path}.{k}");
                if v.is_object() {
                    digest_streams(&p, v, out);
                } else {
                    out.insert(p, format!("#{}", digest(v.to_string().as_bytes())));
                }
            }
        }
        other => {
            out.insert(path.to_string(), format!("#{}", digest(other.to_string().as_bytes())));
        }
    }
}

/// What a run starts from, as one line: pipec's initial values, or a checkpoint's step and
/// the digest of everything it holds.
fn start_of(start: Option<&Loaded>) -> String {
    let Some(l) = start else { return "pipec's initial values".into() };
    let mut crc = crc32fast::Hasher::new();
    let mut keys: Vec<&(u64, u32)> = l.params.keys().collect();
    keys.sort();
    for k in &keys {
        let (shape, values) = &l.params[k];
        crc.update(&k.0.to_le_bytes());
        crc.update(&k.1.to_le_bytes());
        shape.iter().for_each(|d| crc.update(&(*d as u64).to_le_bytes()));
        crc.update(bytemuck::cast_slice(values));
    }
    let mut shards: Vec<_> = l.optimizers.iter().collect();
    shards.sort_by_key(|(k, _)| (k.stage, k.tp_rank));
    for (k, bytes) in shards {
        crc.update(&k.stage.to_le_bytes());
        crc.update(&k.tp_rank.to_le_bytes());
        crc.update(bytes);
    }
    l.initial.keys().for_each(|id| crc.update(&id.to_le_bytes()));
    format!(
        "a checkpoint after step {} ({} tensors, {} optimizer records, digest {:08x})",
        l.completed_steps,
        keys.len(),
        l.optimizers.len(),
        crc.finalize()
    )
}

/// Rank 0's verdict on the other ranks' fingerprints: None when all agree, else the error
/// every rank reports (up to three ranks' differences, up to four parts each).
pub fn verdict(mine: &Fingerprint, theirs: &[(i32, Fingerprint)]) -> Option<String> {
    let mut lines = Vec::new();
    let mut ranks = 0;
    for (r, f) in theirs {
        let d = mine.differences(f, "rank 0", &format!("rank {r}"));
        if d.is_empty() {
            continue;
        }
        ranks += 1;
        if ranks <= 3 {
            let more = d.len().saturating_sub(4);
            let mut text = d.into_iter().take(4).collect::<Vec<_>>().join("; ");
            if more > 0 {
                text.push_str(&format!("; and {more} more"));
            }
            lines.push(format!("rank {r}: {text}"));
        }
    }
    if ranks == 0 {
        return None;
    }
    let others = if ranks > 3 { format!(" (and {} more ranks)", ranks - 3) } else { String::new() };
    Some(format!(
        "the ranks of this job do not run the same thing — {}{others}; start every rank with the same spec or plan.json, --steps, --init and --resume",
        lines.join(" | ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(pairs: &[(&str, &str)]) -> Fingerprint {
        Fingerprint { parts: pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect() }
    }

    #[test]
    fn flattening_names_every_leaf_and_digests_long_strings() {
        let v = serde_json::json!({"a": {"b": 1, "c": [2, 3]}, "d": "x".repeat(100)});
        let mut out = BTreeMap::new();
        flatten("", &v, &mut out);
        assert_eq!(out["a.b"], "1");
        assert_eq!(out["a.c[1]"], "3");
        assert_eq!(out["a.c.len"], "2");
        assert!(out["d"].starts_with('#') && out["d"].len() == 17, "{}", out["d"]);
    }

    #[test]
    fn the_verdict_names_the_ranks_and_parts_that_differ() {
        let a = fp(&[("training.optimizer.lr", "0.01"), ("run.steps", "30")]);
        let b = fp(&[("training.optimizer.lr", "0.02"), ("run.steps", "30")]);
        assert_eq!(verdict(&a, &[(1, a.clone()), (2, a.clone())]), None);
        let v = verdict(&a, &[(1, a.clone()), (2, b)]).expect("differs");
        assert!(v.contains("rank 2: training.optimizer.lr: 0.01 on rank 0, 0.02 on rank 2"), "{v}");
        assert!(!v.contains("rank 1:"), "{v}");
        let c = fp(&[("training.optimizer.lr", "0.01")]);
        let v = verdict(&a, &[(1, c)]).expect("differs");
        assert!(v.contains("run.steps: 30 on rank 0, (absent) on rank 1"), "{v}");
    }

    #[test]
    fn the_start_tells_initial_values_from_checkpoints_and_checkpoints_apart() {
        let mut l = Loaded {
            completed_steps: 0,
            params: Default::default(),
            optimizers: Default::default(),
            tensor_parallel: Default::default(),
            identity: None,
            loss_scale: None,
            initial: Default::default(),
            zero: Default::default(),
        };
        l.params.insert((1, 0), (vec![2], vec![1.0, 2.0]));
        let one = start_of(Some(&l));
        assert_ne!(one, start_of(None));
        l.params.insert((1, 0), (vec![2], vec![1.0, 2.5]));
        assert_ne!(one, start_of(Some(&l)), "one value differs");
    }
}
