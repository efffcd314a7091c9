//! Checkpoints: `DIR/step-NNNNNN/` holding `model.safetensors` (every parameter, named
//! `layer{L}.p{slot}`, f32, readable by PyTorch's `safetensors`), `optimizer-s{K}.bin` (the
//! Burn record of stage K's optimizer state) and `state.json` (the next step to run, the
//! plan's name and layout). A checkpoint is written into a temporary directory and renamed
//! into place, and `DIR/latest` names the newest one, so a crash never leaves half of one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

/// One stage's saved state.
#[derive(Debug, Clone, Default)]
pub struct StageCheckpoint {
    /// (parameter id, shape, values).
    pub params: Vec<(u64, Vec<usize>, Vec<f32>)>,
    /// The optimizer record (Burn's binary record format).
    pub optimizer: Vec<u8>,
}

/// The parameter name of a deterministic parameter id (layer << 8 | slot).
pub fn param_name(id: u64) -> String {
    format!("layer{}.p{}", id >> 8, id & 0xff)
}

fn parse_name(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("layer")?;
    let (l, p) = rest.split_once(".p")?;
    Some((l.parse::<u64>().ok()? << 8) | p.parse::<u64>().ok()?)
}

/// Writes a checkpoint of `stages` (by stage index) taken after `completed_steps` steps.
pub fn write(dir: &Path, completed_steps: usize, plan_name: &str, partition: &str, stages: &HashMap<u32, StageCheckpoint>) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create `{}`: {e}", dir.display()))?;
    let name = format!("step-{completed_steps:06}");
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create `{}`: {e}", tmp.display()))?;
    // model.safetensors
    let mut order: Vec<(&u32, &StageCheckpoint)> = stages.iter().collect();
    order.sort_by_key(|(s, _)| **s);
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (_, st) in &order {
        for (id, shape, values) in &st.params {
            bytes.push((param_name(*id), shape.clone(), values.iter().flat_map(|v| v.to_le_bytes()).collect()));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, shape, b)| TensorView::new(Dtype::F32, shape.clone(), b).map(|v| (n.clone(), v)).map_err(|e| format!("{e}")))
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, None, &tmp.join("model.safetensors")).map_err(|e| format!("cannot write model.safetensors: {e}"))?;
    for (s, st) in &order {
        std::fs::write(tmp.join(format!("optimizer-s{s}.bin")), &st.optimizer).map_err(|e| format!("cannot write the optimizer state: {e}"))?;
    }
    let state = serde_json::json!({"format": 1, "completed_steps": completed_steps, "plan": plan_name, "partition": partition, "stages": order.iter().map(|(s, _)| **s).collect::<Vec<_>>()});
    std::fs::write(tmp.join("state.json"), serde_json::to_string_pretty(&state).unwrap_or_default()).map_err(|e| format!("cannot write state.json: {e}"))?;
    let final_dir = dir.join(&name);
    let _ = std::fs::remove_dir_all(&final_dir);
    std::fs::rename(&tmp, &final_dir).map_err(|e| format!("cannot move the checkpoint into place: {e}"))?;
    let latest_tmp = dir.join(format!(".latest.tmp{}", std::process::id()));
    std::fs::write(&latest_tmp, &name).map_err(|e| format!("cannot write `latest`: {e}"))?;
    std::fs::rename(&latest_tmp, dir.join("latest")).map_err(|e| format!("cannot write `latest`: {e}"))?;
    Ok(final_dir)
}

/// A loaded checkpoint.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    pub completed_steps: usize,
    pub params: HashMap<u64, (Vec<usize>, Vec<f32>)>,
    pub optimizers: HashMap<u32, Vec<u8>>,
}

/// Finds the checkpoint to resume from: a `step-N` directory, a directory with a `latest`
/// file, or a run directory holding `checkpoints/latest`.
pub fn locate(path: &Path) -> Result<PathBuf, String> {
    if path.join("state.json").is_file() {
        return Ok(path.to_path_buf());
    }
    for base in [path.to_path_buf(), path.join("checkpoints")] {
        if let Ok(name) = std::fs::read_to_string(base.join("latest")) {
            let dir = base.join(name.trim());
            if dir.join("state.json").is_file() {
                return Ok(dir);
            }
        }
    }
    Err(format!("no checkpoint found at `{}` (expected state.json, or a `latest` file)", path.display()))
}

/// Reads a checkpoint directory.
pub fn read(dir: &Path) -> Result<Loaded, String> {
    let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).map_err(|e| format!("cannot read state.json: {e}"))?).map_err(|e| format!("state.json: {e}"))?;
    let completed_steps = state.get("completed_steps").and_then(serde_json::Value::as_u64).ok_or("state.json has no completed_steps")? as usize;
    let bytes = std::fs::read(dir.join("model.safetensors")).map_err(|e| format!("cannot read model.safetensors: {e}"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| format!("model.safetensors: {e}"))?;
    let mut params = HashMap::new();
    for (name, view) in st.tensors() {
        let id = parse_name(&name).ok_or(format!("model.safetensors: unexpected tensor `{name}`"))?;
        if view.dtype() != Dtype::F32 {
            return Err(format!("model.safetensors: `{name}` is not f32"));
        }
        let values: Vec<f32> = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        params.insert(id, (view.shape().to_vec(), values));
    }
    let mut optimizers = HashMap::new();
    for s in state.get("stages").and_then(serde_json::Value::as_array).cloned().unwrap_or_default() {
        let s = s.as_u64().ok_or("state.json: bad stage")? as u32;
        let b = std::fs::read(dir.join(format!("optimizer-s{s}.bin"))).map_err(|e| format!("cannot read the optimizer state of stage {s}: {e}"))?;
        optimizers.insert(s, b);
    }
    Ok(Loaded { completed_steps, params, optimizers })
}
