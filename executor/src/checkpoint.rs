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

/// Serialises stage checkpoints for sending to another process.
pub fn encode(stages: &HashMap<u32, StageCheckpoint>) -> Vec<u8> {
    let mut b = Vec::new();
    let put = |b: &mut Vec<u8>, v: u64| b.extend_from_slice(&v.to_le_bytes());
    put(&mut b, stages.len() as u64);
    let mut order: Vec<(&u32, &StageCheckpoint)> = stages.iter().collect();
    order.sort_by_key(|(s, _)| **s);
    for (s, st) in order {
        put(&mut b, u64::from(*s));
        put(&mut b, st.params.len() as u64);
        for (id, shape, values) in &st.params {
            put(&mut b, *id);
            put(&mut b, shape.len() as u64);
            for d in shape {
                put(&mut b, *d as u64);
            }
            put(&mut b, values.len() as u64);
            for v in values {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        put(&mut b, st.optimizer.len() as u64);
        b.extend_from_slice(&st.optimizer);
    }
    b
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let s = self.b.get(self.at..self.at + n).ok_or("truncated checkpoint message")?;
        self.at += n;
        Ok(s)
    }
    fn u64(&mut self) -> Result<u64, String> {
        let s = self.take(8)?;
        Ok(u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]))
    }
}

/// The inverse of [`encode`].
pub fn decode(b: &[u8]) -> Result<HashMap<u32, StageCheckpoint>, String> {
    let mut c = Cursor { b, at: 0 };
    let mut out = HashMap::new();
    for _ in 0..c.u64()? {
        let s = u32::try_from(c.u64()?).map_err(|_| "bad stage in checkpoint message")?;
        let mut params = Vec::new();
        for _ in 0..c.u64()? {
            let id = c.u64()?;
            let mut shape = Vec::new();
            for _ in 0..c.u64()? {
                shape.push(c.u64()? as usize);
            }
            let nv = c.u64()? as usize;
            let raw = c.take(nv.checked_mul(4).ok_or("bad checkpoint message")?)?;
            params.push((id, shape, raw.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect()));
        }
        let no = c.u64()? as usize;
        let optimizer = c.take(no)?.to_vec();
        out.insert(s, StageCheckpoint { params, optimizer });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_checkpoints_round_trip_and_truncation_is_an_error() {
        let mut m = HashMap::new();
        m.insert(2, StageCheckpoint { params: vec![(513, vec![2, 2], vec![1.0, 2.0, 3.0, -4.5])], optimizer: vec![9, 8, 7] });
        m.insert(0, StageCheckpoint { params: vec![], optimizer: vec![] });
        let b = encode(&m);
        let back = decode(&b).expect("decodes");
        assert_eq!(back[&2].params, m[&2].params);
        assert_eq!(back[&2].optimizer, vec![9, 8, 7]);
        assert!(decode(&b[..b.len() - 1]).is_err());
        assert_eq!(param_name(513), "layer2.p1");
        assert_eq!(parse_name("layer2.p1"), Some(513));
    }
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
