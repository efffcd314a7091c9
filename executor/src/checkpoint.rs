//! Checkpoints: `DIR/step-NNNNNN/` holding `model.safetensors` (every parameter, named
//! `layer{L}.p{slot}`, f32, readable by PyTorch's `safetensors`), `optimizer-s{K}.bin` (the
//! Burn record of stage K's optimizer state) and `state.json` (the next step to run, the
//! plan's name and layout). A tensor-parallel stage is saved as its shards: rank r's
//! parameters as `layer{L}.p{slot}.tp{r}` and its optimizer state as
//! `optimizer-s{K}-tp{r}.bin`, with the stage's degree in `state.json`'s
//! `tensor_parallel`, so it resumes on the same degree. A checkpoint is written into a temporary directory and renamed
//! into place, and `DIR/latest` names the newest one, so a crash never leaves half of one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

/// Parameter values keyed by (parameter id, tensor-parallel rank): shape and values.
pub type ParamValues = HashMap<(u64, u32), (Vec<usize>, Vec<f32>)>;

/// Which state a [`StageCheckpoint`] holds: a stage, or one tensor-parallel shard of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardKey {
    pub stage: u32,
    /// The rank in the stage's tensor-parallel group (0 without tensor parallelism).
    pub tp_rank: u32,
}

/// One stage's (or tensor-parallel shard's) saved state.
#[derive(Debug, Clone, Default)]
pub struct StageCheckpoint {
    /// (parameter id, shape, values).
    pub params: Vec<(u64, Vec<usize>, Vec<f32>)>,
    /// The optimizer record (Burn's binary record format).
    pub optimizer: Vec<u8>,
    /// The stage's tensor-parallel degree (1 without tensor parallelism).
    pub tp_size: u32,
}

/// The saved state of some stages, by shard.
pub type Shards = HashMap<ShardKey, StageCheckpoint>;

/// A parameter's name in `model.safetensors`.
fn stored_name(id: u64, key: ShardKey, tp_size: u32) -> String {
    if tp_size > 1 {
        format!("{}.tp{}", param_name(id), key.tp_rank)
    } else {
        param_name(id)
    }
}

fn optimizer_file(stage: u32, tp_rank: u32, tp_size: u32) -> String {
    if tp_size > 1 {
        format!("optimizer-s{stage}-tp{tp_rank}.bin")
    } else {
        format!("optimizer-s{stage}.bin")
    }
}

/// Serialises stage checkpoints for sending to another process.
pub fn encode(stages: &Shards) -> Vec<u8> {
    let mut b = Vec::new();
    let put = |b: &mut Vec<u8>, v: u64| b.extend_from_slice(&v.to_le_bytes());
    put(&mut b, stages.len() as u64);
    let mut order: Vec<(&ShardKey, &StageCheckpoint)> = stages.iter().collect();
    order.sort_by_key(|(k, _)| **k);
    for (k, st) in order {
        put(&mut b, u64::from(k.stage));
        put(&mut b, u64::from(k.tp_rank));
        put(&mut b, u64::from(st.tp_size));
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
pub fn decode(b: &[u8]) -> Result<Shards, String> {
    let mut c = Cursor { b, at: 0 };
    let mut out = HashMap::new();
    for _ in 0..c.u64()? {
        let stage = u32::try_from(c.u64()?).map_err(|_| "bad stage in checkpoint message")?;
        let tp_rank = u32::try_from(c.u64()?).map_err(|_| "bad shard in checkpoint message")?;
        let tp_size = u32::try_from(c.u64()?).map_err(|_| "bad shard in checkpoint message")?;
        let mut params = Vec::new();
        for _ in 0..c.u64()? {
            let id = c.u64()?;
            let mut shape = Vec::new();
            for _ in 0..c.u64()? {
                shape.push(c.u64()? as usize);
            }
            let nv = c.u64()? as usize;
            let raw = c.take(nv.checked_mul(4).ok_or("bad checkpoint message")?)?;
            params.push((
                id,
                shape,
                raw.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect(),
            ));
        }
        let no = c.u64()? as usize;
        let optimizer = c.take(no)?.to_vec();
        out.insert(ShardKey { stage, tp_rank }, StageCheckpoint { params, optimizer, tp_size });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_checkpoints_round_trip_and_truncation_is_an_error() {
        let mut m = HashMap::new();
        let k = |stage, tp_rank| ShardKey { stage, tp_rank };
        m.insert(
            k(2, 1),
            StageCheckpoint {
                params: vec![(513, vec![2, 2], vec![1.0, 2.0, 3.0, -4.5])],
                optimizer: vec![9, 8, 7],
                tp_size: 2,
            },
        );
        m.insert(k(0, 0), StageCheckpoint { params: vec![], optimizer: vec![], tp_size: 1 });
        let b = encode(&m);
        let back = decode(&b).expect("decodes");
        assert_eq!(back[&k(2, 1)].params, m[&k(2, 1)].params);
        assert_eq!(back[&k(2, 1)].optimizer, vec![9, 8, 7]);
        assert_eq!(back[&k(2, 1)].tp_size, 2);
        assert_eq!(back[&k(0, 0)].tp_size, 1);
        assert!(decode(&b[..b.len() - 1]).is_err());
        assert_eq!(param_name(513), "layer2.p1");
        assert_eq!(parse_name("layer2.p1"), Some((513, 0)));
        assert_eq!(stored_name(513, k(2, 1), 2), "layer2.p1.tp1");
        assert_eq!(parse_name("layer2.p1.tp1"), Some((513, 1)));
        assert_eq!(parse_name("layer2.p1.tpx"), None);
    }

    #[test]
    fn tensor_parallel_shards_are_written_and_read_back_by_rank() {
        let dir = std::env::temp_dir().join(format!("pipec-ckpt-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut m = HashMap::new();
        let k = |stage, tp_rank| ShardKey { stage, tp_rank };
        m.insert(
            k(0, 0),
            StageCheckpoint { params: vec![(1, vec![2], vec![1.0, 2.0])], optimizer: vec![1], tp_size: 1 },
        );
        m.insert(k(1, 0), StageCheckpoint { params: vec![(256, vec![1], vec![3.0])], optimizer: vec![2], tp_size: 2 });
        m.insert(k(1, 1), StageCheckpoint { params: vec![(256, vec![1], vec![4.0])], optimizer: vec![3], tp_size: 2 });
        let at = write(&dir, 5, "p", "1-1", &m).expect("written");
        assert!(at.join("optimizer-s1-tp1.bin").is_file() && at.join("optimizer-s0.bin").is_file());
        let l = read(&locate(&dir).expect("latest")).expect("read");
        assert_eq!(l.completed_steps, 5);
        assert_eq!(l.params[&(1, 0)].1, vec![1.0, 2.0]);
        assert_eq!(l.params[&(256, 0)].1, vec![3.0]);
        assert_eq!(l.params[&(256, 1)].1, vec![4.0]);
        assert_eq!(l.optimizers[&k(1, 1)], vec![3]);
        assert_eq!(l.tp_size(1), 2);
        assert_eq!(l.tp_size(0), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The parameter name of a deterministic parameter id (layer << 8 | slot).
pub fn param_name(id: u64) -> String {
    format!("layer{}.p{}", id >> 8, id & 0xff)
}

/// The parameter id and tensor-parallel rank of a stored name.
fn parse_name(name: &str) -> Option<(u64, u32)> {
    let rest = name.strip_prefix("layer")?;
    let (l, p) = rest.split_once(".p")?;
    let (p, rank) = match p.split_once(".tp") {
        Some((p, r)) => (p, r.parse::<u32>().ok()?),
        None => (p, 0),
    };
    Some(((l.parse::<u64>().ok()? << 8) | p.parse::<u64>().ok()?, rank))
}

/// Writes a checkpoint of `stages` (by shard) taken after `completed_steps` steps.
pub fn write(
    dir: &Path,
    completed_steps: usize,
    plan_name: &str,
    partition: &str,
    stages: &Shards,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create `{}`: {e}", dir.display()))?;
    let name = format!("step-{completed_steps:06}");
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create `{}`: {e}", tmp.display()))?;
    // model.safetensors
    let mut order: Vec<(&ShardKey, &StageCheckpoint)> = stages.iter().collect();
    order.sort_by_key(|(k, _)| **k);
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (k, st) in &order {
        for (id, shape, values) in &st.params {
            bytes.push((
                stored_name(*id, **k, st.tp_size),
                shape.clone(),
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, shape, b)| {
            TensorView::new(Dtype::F32, shape.clone(), b).map(|v| (n.clone(), v)).map_err(|e| format!("{e}"))
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, None, &tmp.join("model.safetensors"))
        .map_err(|e| format!("cannot write model.safetensors: {e}"))?;
    for (k, st) in &order {
        std::fs::write(tmp.join(optimizer_file(k.stage, k.tp_rank, st.tp_size)), &st.optimizer)
            .map_err(|e| format!("cannot write the optimizer state: {e}"))?;
    }
    let mut stage_ids: Vec<u32> = order.iter().map(|(k, _)| k.stage).collect();
    stage_ids.dedup();
    let tensor_parallel: serde_json::Map<String, serde_json::Value> = order
        .iter()
        .filter(|(_, st)| st.tp_size > 1)
        .map(|(k, st)| (k.stage.to_string(), serde_json::Value::from(st.tp_size)))
        .collect();
    let state = serde_json::json!({"format": 2, "completed_steps": completed_steps, "plan": plan_name, "partition": partition, "stages": stage_ids, "tensor_parallel": tensor_parallel});
    std::fs::write(tmp.join("state.json"), serde_json::to_string_pretty(&state).unwrap_or_default())
        .map_err(|e| format!("cannot write state.json: {e}"))?;
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
    /// By (parameter id, tensor-parallel rank).
    pub params: ParamValues,
    pub optimizers: HashMap<ShardKey, Vec<u8>>,
    /// The tensor-parallel degree of each stage saved with one above 1.
    pub tensor_parallel: HashMap<u32, u32>,
}

impl Loaded {
    /// The tensor-parallel degree stage `stage` was saved with.
    pub fn tp_size(&self, stage: u32) -> u32 {
        self.tensor_parallel.get(&stage).copied().unwrap_or(1)
    }
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
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("state.json")).map_err(|e| format!("cannot read state.json: {e}"))?,
    )
    .map_err(|e| format!("state.json: {e}"))?;
    let completed_steps =
        state.get("completed_steps").and_then(serde_json::Value::as_u64).ok_or("state.json has no completed_steps")?
            as usize;
    let bytes =
        std::fs::read(dir.join("model.safetensors")).map_err(|e| format!("cannot read model.safetensors: {e}"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| format!("model.safetensors: {e}"))?;
    let mut params = HashMap::new();
    for (name, view) in st.tensors() {
        let key = parse_name(&name).ok_or(format!("model.safetensors: unexpected tensor `{name}`"))?;
        if view.dtype() != Dtype::F32 {
            return Err(format!("model.safetensors: `{name}` is not f32"));
        }
        let values: Vec<f32> =
            view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        params.insert(key, (view.shape().to_vec(), values));
    }
    let mut tensor_parallel = HashMap::new();
    if let Some(tp) = state.get("tensor_parallel").and_then(serde_json::Value::as_object) {
        for (s, n) in tp {
            let s: u32 = s.parse().map_err(|_| format!("state.json: bad stage `{s}` in tensor_parallel"))?;
            let n = n
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|&n| n >= 1)
                .ok_or("state.json: bad tensor-parallel degree")?;
            tensor_parallel.insert(s, n);
        }
    }
    let mut optimizers = HashMap::new();
    for s in state.get("stages").and_then(serde_json::Value::as_array).cloned().unwrap_or_default() {
        let s = s.as_u64().and_then(|s| u32::try_from(s).ok()).ok_or("state.json: bad stage")?;
        let n = tensor_parallel.get(&s).copied().unwrap_or(1);
        for r in 0..n {
            let b = std::fs::read(dir.join(optimizer_file(s, r, n)))
                .map_err(|e| format!("cannot read the optimizer state of stage {s}: {e}"))?;
            optimizers.insert(ShardKey { stage: s, tp_rank: r }, b);
        }
    }
    Ok(Loaded { completed_steps, params, optimizers, tensor_parallel })
}
