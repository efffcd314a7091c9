//! Checkpoints: `DIR/step-NNNNNN/` holding `model.safetensors` (every parameter, named
//! `layer{L}.p{slot}`, f32, readable by PyTorch's `safetensors`), `optimizer-s{K}.bin` (the
//! Burn record of stage K's optimizer state) and `state.json`: the completed steps, what the
//! checkpoint holds (the model's hash, the optimizer, the plan's name and layout) and the
//! SHA-256 and size of every other file. A tensor-parallel stage is saved as its shards:
//! rank r's parameters as `layer{L}.p{slot}.tp{r}` and its optimizer state as
//! `optimizer-s{K}-tp{r}.bin`, with the stage's degree in `state.json`'s
//! `tensor_parallel`, so it resumes on the same degree. A ZeRO-sharded stage is saved as
//! its replicas' shards, as each holds them — replica z's chunk of a parameter as
//! `layer{L}.p{slot}[.tp{r}].z{z}` (flat, the last chunk padded with zeros) and its
//! optimizer state over its chunks as `optimizer-s{K}[-tp{r}]-z{z}.bin` — with `state.json`'s
//! `zero` saying which chunk of which parameter each is; the reader joins the chunks, so
//! a checkpoint costs no collective and no per-parameter work to write, and resumes on any
//! layout. A checkpoint is written into a
//! temporary directory and renamed into place, and `DIR/latest` names the newest one, so a
//! crash never leaves half of one; temporary directories a killed run left behind are
//! removed by the next run that writes into `DIR`. Reading verifies every checksum before
//! anything is parsed, so a flipped byte or a file from another checkpoint is an error that
//! names the file. docs/checkpoints.md describes the format.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::Plan;
use safetensors::tensor::{Dtype, TensorView};
use sha2::{Digest, Sha256};

/// Parameter values keyed by (parameter id, tensor-parallel rank): shape and values.
pub type ParamValues = HashMap<(u64, u32), (Vec<usize>, Vec<f32>)>;

/// Which state a [`StageCheckpoint`] holds: a stage, one tensor-parallel shard of it, or
/// one ZeRO replica's shard of either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardKey {
    pub stage: u32,
    /// The rank in the stage's tensor-parallel group (0 without tensor parallelism).
    pub tp_rank: u32,
    /// ZeRO: the replica whose shard this is (0 for a whole state).
    pub zero_rank: u32,
}

impl ShardKey {
    /// The key of a whole (not ZeRO-sharded) state.
    pub fn whole(stage: u32, tp_rank: u32) -> ShardKey {
        ShardKey { stage, tp_rank, zero_rank: 0 }
    }
}

/// One stage's (or tensor-parallel shard's) saved state.
#[derive(Debug, Clone, Default)]
pub struct StageCheckpoint {
    /// (parameter id, shape, values); a ZeRO shard's are its chunks, `[chunk]` each.
    pub params: Vec<(u64, Vec<usize>, Vec<f32>)>,
    /// The optimizer record (Burn's binary record format); a ZeRO shard's is over its chunks.
    pub optimizer: Vec<u8>,
    /// The stage's tensor-parallel degree (1 without tensor parallelism).
    pub tp_size: u32,
    /// ZeRO: which chunk of which whole parameter each of `params` is (None: a whole state).
    pub zero: Option<Vec<Chunk>>,
}

/// One ZeRO chunk: chunk `index` of `of` of parameter `id`, whose whole shape is `shape`
/// (the chunks are the flattened values cut into `of` equal pieces, the last padded with
/// zeros; an expert's are cut among the replicas holding it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub id: u64,
    pub shape: Vec<usize>,
    pub index: u32,
    pub of: u32,
}

/// The saved state of some stages, by shard.
pub type Shards = HashMap<ShardKey, StageCheckpoint>;

/// A parameter's name in `model.safetensors` (a ZeRO chunk's with its replica).
fn stored_name(id: u64, key: ShardKey, tp_size: u32, zero: bool) -> String {
    let mut name = param_name(id);
    if tp_size > 1 {
        name += &format!(".tp{}", key.tp_rank);
    }
    if zero {
        name += &format!(".z{}", key.zero_rank);
    }
    name
}

fn optimizer_file(key: ShardKey, tp_size: u32, zero: bool) -> String {
    let mut name = format!("optimizer-s{}", key.stage);
    if tp_size > 1 {
        name += &format!("-tp{}", key.tp_rank);
    }
    if zero {
        name += &format!("-z{}", key.zero_rank);
    }
    name + ".bin"
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
        put(&mut b, u64::from(k.zero_rank));
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
        match &st.zero {
            None => put(&mut b, 0),
            Some(chunks) => {
                put(&mut b, 1);
                put(&mut b, chunks.len() as u64);
                for c in chunks {
                    put(&mut b, c.id);
                    put(&mut b, u64::from(c.index));
                    put(&mut b, u64::from(c.of));
                    put(&mut b, c.shape.len() as u64);
                    c.shape.iter().for_each(|&d| put(&mut b, d as u64));
                }
            }
        }
    }
    b
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).ok_or("truncated checkpoint message")?;
        let s = self.b.get(self.at..end).ok_or("truncated checkpoint message")?;
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
        let zero_rank = u32::try_from(c.u64()?).map_err(|_| "bad shard in checkpoint message")?;
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
        let small = |v: u64| u32::try_from(v).map_err(|_| "bad chunk in checkpoint message");
        let zero = match c.u64()? {
            0 => None,
            _ => {
                let n = c.u64()?;
                let mut chunks = Vec::new();
                for _ in 0..n {
                    let (id, index, of) = (c.u64()?, small(c.u64()?)?, small(c.u64()?)?);
                    let rank = c.u64()?;
                    if rank > 16 {
                        return Err("bad chunk shape in checkpoint message".into());
                    }
                    let shape = (0..rank).map(|_| c.u64().map(|d| d as usize)).collect::<Result<Vec<_>, _>>()?;
                    chunks.push(Chunk { id, shape, index, of });
                }
                Some(chunks)
            }
        };
        out.insert(ShardKey { stage, tp_rank, zero_rank }, StageCheckpoint { params, optimizer, tp_size, zero });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_identity() -> Identity {
        Identity {
            plan: "p".into(),
            partition: "1-1".into(),
            model_hash: "ab".repeat(32),
            optimizer: "adam".into(),
            stateful: true,
            stage_layers: vec![[0, 1], [1, 2]],
            stage_devices: vec![vec![0], vec![1]],
            whole_experts: false,
        }
    }

    /// A checkpoint of two stages with a parameter each, in a fresh directory.
    fn two_stage_checkpoint(tag: &str) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("pipec-ckpt-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut m = HashMap::new();
        for s in 0..2u32 {
            let params = vec![(u64::from(s) << 8, vec![2], vec![1.0 + s as f32, 2.0])];
            m.insert(
                ShardKey::whole(s, 0),
                StageCheckpoint { params, optimizer: vec![s as u8; 64], tp_size: 1, zero: None },
            );
        }
        let at = write(&dir, 3, &test_identity(), &m, None).expect("written");
        (dir, at)
    }

    #[test]
    fn a_flipped_byte_or_a_swapped_file_is_an_error_naming_the_file() {
        let (dir, at) = two_stage_checkpoint("flip");
        assert!(read(&at).is_ok());
        let model = at.join("model.safetensors");
        let mut b = std::fs::read(&model).expect("read");
        let n = b.len();
        b[n - 3] ^= 0x40;
        std::fs::write(&model, &b).expect("write");
        let e = read(&at).expect_err("a flipped byte is caught");
        assert!(e.starts_with("model.safetensors does not match its checksum"), "{e}");
        b[n - 3] ^= 0x40;
        std::fs::write(&model, &b).expect("write");
        // the optimizer states of the two stages swapped
        let (a, c) = (at.join("optimizer-s0.bin"), at.join("optimizer-s1.bin"));
        let (x, y) = (std::fs::read(&a).expect("a"), std::fs::read(&c).expect("c"));
        std::fs::write(&a, y).expect("w");
        std::fs::write(&c, x).expect("w");
        let e = read(&at).expect_err("swapped files are caught");
        assert!(e.starts_with("optimizer-s0.bin does not match its checksum"), "{e}");
        // a truncated file
        std::fs::write(&a, [0u8; 3]).expect("w");
        let e = read(&at).expect_err("truncation is caught");
        assert!(e.contains("optimizer-s0.bin has 3 bytes, state.json records 64"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn state_json_values_are_checked_one_by_one() {
        let (dir, at) = two_stage_checkpoint("state");
        let state_path = at.join("state.json");
        let good: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&state_path).expect("s")).expect("j");
        for (key, value, expect) in [
            (
                "completed_steps",
                serde_json::json!(-3),
                "`completed_steps` must be a whole number of steps ≥ 0, found -3",
            ),
            ("completed_steps", serde_json::json!("5"), "`completed_steps` must be a whole number"),
            ("format", serde_json::json!(9), "checkpoint format 9 is not one this pipec reads"),
            ("tensor_parallel", serde_json::json!({"0": 0}), "bad tensor-parallel degree 0 for stage 0"),
            (
                "loss_scale",
                serde_json::json!({"scale": 0, "good_steps": 3}),
                "`loss_scale` must hold a finite `scale` above 0",
            ),
            ("loss_scale", serde_json::json!({"scale": 1024}), "and a whole `good_steps`"),
        ] {
            let mut bad = good.clone();
            bad[key] = value;
            std::fs::write(&state_path, bad.to_string()).expect("w");
            let e = read(&at).expect_err(key);
            assert!(e.contains(expect), "{key}: {e}");
        }
        let mut bad = good.clone();
        bad["files"].as_object_mut().expect("files").remove("optimizer-s1.bin");
        std::fs::write(&state_path, bad.to_string()).expect("w");
        assert!(read(&at).expect_err("unlisted").contains("no checksum for optimizer-s1.bin"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn abandoned_temporary_checkpoints_are_removed() {
        let (dir, _) = two_stage_checkpoint("tmp");
        let stale = dir.join(".step-000009.tmp4000000");
        std::fs::create_dir_all(stale.join("x")).expect("mkdir");
        std::fs::write(dir.join(".latest.tmp4000000"), "step-000009").expect("w");
        let own = dir.join(format!(".step-000010.tmp{}", std::process::id()));
        std::fs::create_dir_all(&own).expect("mkdir");
        clean_abandoned(&dir);
        assert!(!stale.exists() && !dir.join(".latest.tmp4000000").exists());
        assert!(own.exists() && dir.join("step-000003").exists() && dir.join("latest").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn rewriting_a_step_keeps_it_whole_and_a_dangling_latest_falls_back_to_the_newest() {
        let (dir, at) = two_stage_checkpoint("rewrite");
        let m = HashMap::from([(
            ShardKey::whole(0, 0),
            StageCheckpoint { params: vec![(0, vec![1], vec![7.0])], optimizer: vec![], tp_size: 1, zero: None },
        )]);
        // step 3 again (a resumed run re-training it): replaced whole, nothing left aside
        write(&dir, 3, &test_identity(), &m, None).expect("rewritten");
        assert_eq!(read(&at).expect("reads").params.len(), 1);
        write(&dir, 2, &test_identity(), &m, None).expect("written");
        let left: Vec<String> =
            std::fs::read_dir(&dir).expect("dir").flatten().map(|e| e.file_name().to_string_lossy().into()).collect();
        assert!(left.iter().all(|n| !n.contains(".tmp")), "{left:?}");
        // `latest` names a step that is not there (killed between moving it aside and
        // moving its replacement in): the newest whole one is found
        std::fs::write(dir.join("latest"), "step-000009").expect("w");
        assert_eq!(locate_in(&dir, None).expect("found"), at);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn stage_checkpoints_round_trip_and_truncation_is_an_error() {
        let mut m = HashMap::new();
        let k = ShardKey::whole;
        m.insert(
            k(2, 1),
            StageCheckpoint {
                params: vec![(513, vec![2, 2], vec![1.0, 2.0, 3.0, -4.5])],
                optimizer: vec![9, 8, 7],
                tp_size: 2,
                zero: None,
            },
        );
        m.insert(k(0, 0), StageCheckpoint { params: vec![], optimizer: vec![], tp_size: 1, zero: None });
        let b = encode(&m);
        let back = decode(&b).expect("decodes");
        assert_eq!(back[&k(2, 1)].params, m[&k(2, 1)].params);
        assert_eq!(back[&k(2, 1)].optimizer, vec![9, 8, 7]);
        assert_eq!(back[&k(2, 1)].tp_size, 2);
        assert_eq!(back[&k(0, 0)].tp_size, 1);
        assert!(decode(&b[..b.len() - 1]).is_err());
        assert_eq!(param_name(513), "layer2.p1");
        assert_eq!(parse_name("layer2.p1"), Some((513, 0, None)));
        assert_eq!(stored_name(513, k(2, 1), 2, false), "layer2.p1.tp1");
        assert_eq!(parse_name("layer2.p1.tp1"), Some((513, 1, None)));
        assert_eq!(stored_name(513, ShardKey { stage: 2, tp_rank: 1, zero_rank: 3 }, 2, true), "layer2.p1.tp1.z3");
        assert_eq!(parse_name("layer2.p1.tp1.z3"), Some((513, 1, Some(3))));
        assert_eq!(parse_name("layer2.p1.z0"), Some((513, 0, Some(0))));
        assert_eq!(parse_name("layer2.p1.tpx"), None);
    }

    #[test]
    fn zero_shards_are_written_as_each_replica_holds_them_and_read_back_whole() {
        let dir = std::env::temp_dir().join(format!("pipec-ckpt-zero-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // a [5]-parameter and a [2, 2]-parameter cut among 2 replicas (chunks of 3 and 2,
        // the first padded), and a statistic whole on replica 0
        let chunk = |id: u64, shape: Vec<usize>, index: u32| Chunk { id, shape, index, of: 2 };
        let mut m = HashMap::new();
        for z in 0..2u32 {
            let (a, b) =
                if z == 0 { (vec![1.0, 2.0, 3.0], vec![10.0, 11.0]) } else { (vec![4.0, 5.0, 0.0], vec![12.0, 13.0]) };
            let mut params = vec![(1, vec![3], a), (2, vec![2], b)];
            let mut chunks = vec![chunk(1, vec![5], z), chunk(2, vec![2, 2], z)];
            if z == 0 {
                params.push((3, vec![2], vec![0.5, 0.25]));
                chunks.push(Chunk { id: 3, shape: vec![2], index: 0, of: 1 });
            }
            m.insert(
                ShardKey { stage: 0, tp_rank: 0, zero_rank: z },
                StageCheckpoint { params, optimizer: vec![z as u8; 8], tp_size: 1, zero: Some(chunks) },
            );
        }
        let at = write(&dir, 4, &test_identity(), &m, None).expect("written");
        assert!(at.join("optimizer-s0-z1.bin").is_file() && !at.join("optimizer-s0.bin").exists());
        let l = read(&at).expect("reads");
        assert_eq!(l.params[&(1, 0)], (vec![5], vec![1.0, 2.0, 3.0, 4.0, 5.0]));
        assert_eq!(l.params[&(2, 0)], (vec![2, 2], vec![10.0, 11.0, 12.0, 13.0]));
        assert_eq!(l.params[&(3, 0)], (vec![2], vec![0.5, 0.25]));
        assert_eq!(l.optimizers[&ShardKey { stage: 0, tp_rank: 0, zero_rank: 1 }], vec![1; 8]);
        assert_eq!(l.zero[&ShardKey { stage: 0, tp_rank: 0, zero_rank: 1 }].len(), 2);
        // through a process's message as well
        assert_eq!(
            decode(&encode(&m)).expect("decodes")[&ShardKey { stage: 0, tp_rank: 0, zero_rank: 1 }].zero,
            m[&ShardKey { stage: 0, tp_rank: 0, zero_rank: 1 }].zero
        );
        // a replica's chunk missing: named, not read as a short parameter
        let mut state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(at.join("state.json")).expect("s")).expect("j");
        state["zero"]["chunks"]["0"]["layer0.p1.z1"]["index"] = serde_json::json!(0);
        std::fs::write(at.join("state.json"), state.to_string()).expect("w");
        let e = read(&at).expect_err("two chunks 0");
        assert!(e.contains("the ZeRO chunks of `layer0.p1` are [0, 0], not all of 0 to 1"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tensor_parallel_shards_are_written_and_read_back_by_rank() {
        let dir = std::env::temp_dir().join(format!("pipec-ckpt-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut m = HashMap::new();
        let k = ShardKey::whole;
        m.insert(
            k(0, 0),
            StageCheckpoint { params: vec![(1, vec![2], vec![1.0, 2.0])], optimizer: vec![1], tp_size: 1, zero: None },
        );
        m.insert(
            k(1, 0),
            StageCheckpoint { params: vec![(256, vec![1], vec![3.0])], optimizer: vec![2], tp_size: 2, zero: None },
        );
        m.insert(
            k(1, 1),
            StageCheckpoint { params: vec![(256, vec![1], vec![4.0])], optimizer: vec![3], tp_size: 2, zero: None },
        );
        let at = write(&dir, 5, &test_identity(), &m, None).expect("written");
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

/// The deterministic id of layer `layer`'s parameter slot `slot` (layer << 8 | slot): what
/// checkpoints, optimizer state and Hugging Face weights are keyed by, on every layout.
pub fn param_id(layer: usize, slot: u64) -> u64 {
    ((layer as u64) << 8) | slot
}

/// A mixture-of-experts block's router's parameter slot (`model::ROUTER_SLOT`).
pub use crate::model::ROUTER_SLOT;

/// The first parameter slot of a mixture-of-experts block's MLP `e` (`model::expert_slot`).
pub use crate::model::expert_slot;

/// The most experts (routed and shared) a block's 256 parameter slots hold.
pub const MAX_EXPERTS: usize = 60;

/// The parameter name of a deterministic parameter id (layer << 8 | slot).
pub fn param_name(id: u64) -> String {
    format!("layer{}.p{}", id >> 8, id & 0xff)
}

/// The parameter id and tensor-parallel rank of a stored name, and a ZeRO chunk's replica.
fn parse_name(name: &str) -> Option<(u64, u32, Option<u32>)> {
    let rest = name.strip_prefix("layer")?;
    let (rest, zero) = match rest.rsplit_once(".z") {
        Some((r, z)) => (r, Some(z.parse::<u32>().ok()?)),
        None => (rest, None),
    };
    let (l, p) = rest.split_once(".p")?;
    let (p, rank) = match p.split_once(".tp") {
        Some((p, r)) => (p, r.parse::<u32>().ok()?),
        None => (p, 0),
    };
    Some(((l.parse::<u64>().ok()? << 8) | p.parse::<u64>().ok()?, rank, zero))
}

/// The checkpoint format this pipec writes; it reads this one, format 3 (the same without
/// ZeRO shards) and format 2 (the same files without identity or checksums, which then go
/// unchecked).
pub const FORMAT: u64 = 4;

/// What a checkpoint holds, apart from the values: checked when a run resumes from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The name of the plan that wrote it (informational).
    pub plan: String,
    /// The layout that wrote it, in PipeDream notation (informational).
    pub partition: String,
    /// SHA-256 of the model's definition (input shape, loss, every layer's operator): the
    /// same for every layout of one model.
    pub model_hash: String,
    /// The optimizer whose state the `optimizer-*.bin` files hold (`sgd` or `adam`).
    pub optimizer: String,
    /// Whether that state is more than the weights (momentum or Adam moments): such state is
    /// saved per stage, so it resumes only on the same stages.
    pub stateful: bool,
    /// Each stage's layer range `[start, end)`, by stage index.
    pub stage_layers: Vec<[usize; 2]>,
    /// The devices holding each stage (replicas and tensor-parallel members), by stage
    /// index; empty when the checkpoint does not say.
    pub stage_devices: Vec<Vec<u32>>,
    /// Each routed expert saved whole by every tensor-parallel rank (`etp: 1`), not split
    /// like the block (`experts_whole` in state.json; absent: false).
    pub whole_experts: bool,
}

/// Layers whose devices a resume changes: the weights and optimizer state to move.
#[derive(Debug, Clone, PartialEq)]
pub struct Move {
    /// Half-open layer range.
    pub layers: [usize; 2],
    pub from: Vec<u32>,
    pub to: Vec<u32>,
    /// Bytes the devices in `to` that did not hold these layers must receive (weights,
    /// optimizer state, running statistics).
    pub bytes: u64,
}

/// What resuming `plan` from a checkpoint whose identity is `saved` moves between devices:
/// one entry per run of layers with the same old and new devices (unmoved runs included,
/// with 0 bytes).
pub fn reshard(saved: &Identity, plan: &Plan) -> Result<Vec<Move>, String> {
    if saved.stage_devices.len() != saved.stage_layers.len() || saved.stage_devices.is_empty() {
        return Err("the checkpoint does not record which devices held its stages".into());
    }
    let want = Identity::of(plan);
    let holders = |id: &Identity, layer: usize| -> Vec<u32> {
        id.stage_layers
            .iter()
            .zip(&id.stage_devices)
            .find(|([a, b], _)| (*a..*b).contains(&layer))
            .map(|(_, d)| d.clone())
            .unwrap_or_default()
    };
    let state_floats: u64 = match plan.training.optimizer {
        crate::plan::OptimizerPlan::Adam { .. } => 2,
        crate::plan::OptimizerPlan::Sgd { momentum, .. } => u64::from(momentum > 0.0),
    };
    let mut moves: Vec<Move> = Vec::new();
    for (i, layer) in plan.layers.iter().enumerate() {
        let (from, to) = (holders(saved, i), holders(&want, i));
        let receivers = to.iter().filter(|d| !from.contains(d)).count() as u64;
        // weights and optimizer state, and state that is not trained (running statistics, f32)
        let bytes = receivers * (layer.parameter_bytes * (1 + state_floats) + 4 * layer.op.state_count());
        match moves.last_mut() {
            Some(m) if m.from == from && m.to == to => {
                m.layers[1] = i + 1;
                m.bytes += bytes;
            }
            _ => moves.push(Move { layers: [i, i + 1], from, to, bytes }),
        }
    }
    Ok(moves)
}

impl Identity {
    pub fn of(plan: &Plan) -> Identity {
        let ops: Vec<&crate::model::Op> = plan.layers.iter().map(|l| &l.op).collect();
        let definition = serde_json::json!({ "model": plan.model, "layers": ops }).to_string();
        let (optimizer, stateful) = match plan.training.optimizer {
            crate::plan::OptimizerPlan::Sgd { momentum, .. } => ("sgd", momentum > 0.0),
            crate::plan::OptimizerPlan::Adam { decoupled: false, .. } => ("adam", true),
            crate::plan::OptimizerPlan::Adam { decoupled: true, .. } => ("adamw", true),
        };
        Identity {
            plan: plan.name.clone(),
            partition: plan.partition.clone(),
            model_hash: sha256_hex(definition.as_bytes()),
            optimizer: optimizer.to_string(),
            stateful,
            stage_layers: plan.stages.iter().map(|s| s.layers).collect(),
            stage_devices: plan
                .stages
                .iter()
                .map(|s| {
                    let mut d: Vec<u32> =
                        s.replicas.iter().chain(s.tensor_parallel.iter().flatten()).map(|d| d.0).collect();
                    d.sort_unstable();
                    d.dedup();
                    d
                })
                .collect(),
            whole_experts: plan.schedule.whole_experts,
        }
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Removes the temporary directories and files a killed run left in `dir` (those of this
/// process's id are its own and kept).
pub fn clean_abandoned(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let own = format!(".tmp{}", std::process::id());
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let abandoned = (name.starts_with(".step-") || name.starts_with(".latest"))
            && name.contains(".tmp")
            && !name.ends_with(&own);
        if abandoned {
            let p = e.path();
            let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        }
    }
}

/// The folder of the checkpoint taken after `completed_steps` steps: `step-NNNNNN`.
pub fn step_dir_name(completed_steps: usize) -> String {
    format!("step-{completed_steps:06}")
}

/// Writes a checkpoint of `stages` (by shard) taken after `completed_steps` steps.
pub fn write(
    dir: &Path,
    completed_steps: usize,
    identity: &Identity,
    stages: &Shards,
    loss_scale: Option<crate::recipe::LossScale>,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create `{}`: {e}", dir.display()))?;
    let name = step_dir_name(completed_steps);
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create `{}`: {e}", tmp.display()))?;
    let mut order: Vec<(&ShardKey, &StageCheckpoint)> = stages.iter().collect();
    order.sort_by_key(|(k, _)| **k);
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    // ZeRO: each sharded stage's replicas and, per stored chunk, what it is
    let mut zero = serde_json::Map::new();
    for (k, st) in &order {
        let chunks = st.zero.as_ref();
        if let Some(chunks) = chunks {
            if chunks.len() != st.params.len() {
                return Err(format!(
                    "stage {}: {} chunks described for {} saved",
                    k.stage,
                    chunks.len(),
                    st.params.len()
                ));
            }
        }
        for (n, (id, shape, values)) in st.params.iter().enumerate() {
            let name = stored_name(*id, **k, st.tp_size, chunks.is_some());
            if let Some(c) = chunks.map(|c| &c[n]) {
                let entry = zero.entry(k.stage.to_string()).or_insert_with(|| serde_json::json!({}));
                entry[&name] = serde_json::json!({ "index": c.index, "of": c.of, "shape": c.shape });
            }
            bytes.push((name, shape.clone(), f32_bytes(values)));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, shape, b)| {
            TensorView::new(Dtype::F32, shape.clone(), b).map(|v| (n.clone(), v)).map_err(|e| format!("{e}"))
        })
        .collect::<Result<_, _>>()?;
    let model = safetensors::serialize(views, None).map_err(|e| format!("cannot encode model.safetensors: {e}"))?;
    let mut files: Vec<(String, &[u8])> = vec![("model.safetensors".to_string(), &model)];
    for (k, st) in &order {
        files.push((optimizer_file(**k, st.tp_size, st.zero.is_some()), &st.optimizer));
    }
    // a ZeRO stage's replicas, by tensor-parallel rank
    let mut zero_replicas: std::collections::BTreeMap<(u32, u32), Vec<u32>> = Default::default();
    for (k, st) in &order {
        if st.zero.is_some() {
            zero_replicas.entry((k.stage, k.tp_rank)).or_default().push(k.zero_rank);
        }
    }
    let mut sums = serde_json::Map::new();
    for (file, contents) in &files {
        write_synced(&tmp.join(file), contents).map_err(|e| format!("cannot write {file}: {e}"))?;
        sums.insert(file.clone(), serde_json::json!({ "sha256": sha256_hex(contents), "bytes": contents.len() }));
    }
    let mut stage_ids: Vec<u32> = order.iter().map(|(k, _)| k.stage).collect();
    stage_ids.dedup();
    let tensor_parallel: serde_json::Map<String, serde_json::Value> = order
        .iter()
        .filter(|(_, st)| st.tp_size > 1)
        .map(|(k, st)| (k.stage.to_string(), serde_json::Value::from(st.tp_size)))
        .collect();
    let mut state = serde_json::json!({
        "format": FORMAT,
        "completed_steps": completed_steps,
        "plan": identity.plan,
        "partition": identity.partition,
        "model_hash": identity.model_hash,
        "optimizer": identity.optimizer,
        "optimizer_stateful": identity.stateful,
        "stage_layers": identity.stage_layers,
        "stage_devices": identity.stage_devices,
        "stages": stage_ids,
        "tensor_parallel": tensor_parallel,
        "files": sums,
    });
    if identity.whole_experts {
        state["experts_whole"] = serde_json::Value::Bool(true);
    }
    if !zero.is_empty() {
        let replicas: serde_json::Map<String, serde_json::Value> = zero_replicas
            .iter()
            .map(|((stage, tp), ranks)| (format!("{stage}.{tp}"), serde_json::json!(ranks)))
            .collect();
        state["zero"] = serde_json::json!({ "replicas": replicas, "chunks": zero });
    }
    if let Some(ls) = loss_scale {
        state["loss_scale"] = serde_json::json!({ "scale": ls.scale, "good_steps": ls.good_steps });
    }
    write_synced(&tmp.join("state.json"), serde_json::to_string_pretty(&state).unwrap_or_default().as_bytes())
        .map_err(|e| format!("cannot write state.json: {e}"))?;
    sync_dir(&tmp);
    // a checkpoint of the same step from an earlier run is moved aside, not removed first:
    // until the new one is in place the old one stays whole under a name `locate_in` skips
    let final_dir = dir.join(&name);
    let aside = dir.join(format!(".{name}.old.tmp{}", std::process::id()));
    let replaced = final_dir.exists() && std::fs::rename(&final_dir, &aside).is_ok();
    std::fs::rename(&tmp, &final_dir).map_err(|e| format!("cannot move the checkpoint into place: {e}"))?;
    let latest_tmp = dir.join(format!(".latest.tmp{}", std::process::id()));
    write_synced(&latest_tmp, name.as_bytes()).map_err(|e| format!("cannot write `latest`: {e}"))?;
    std::fs::rename(&latest_tmp, dir.join("latest")).map_err(|e| format!("cannot write `latest`: {e}"))?;
    sync_dir(dir);
    if replaced {
        let _ = std::fs::remove_dir_all(&aside);
    }
    Ok(final_dir)
}

/// f32 values as their little-endian bytes.
fn f32_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Writes a file and flushes it to the disk (a checkpoint is published only once its files
/// would survive a machine's crash, not only a process's).
fn write_synced(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(contents)?;
    f.sync_all()
}

/// Flushes a directory's entries (the renames into it) to the disk, where the platform can.
fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
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
    /// What it holds (None for a format-2 checkpoint, which does not say).
    pub identity: Option<Identity>,
    /// fp16's dynamic loss scale after its last step (a run that scaled its loss).
    pub loss_scale: Option<crate::recipe::LossScale>,
    /// Parameters it leaves at pipec's initial values (a fine-tuning head that a Hugging
    /// Face base checkpoint lacks), with the name of the tensor each lacked; every other
    /// parameter must be in it.
    pub initial: std::collections::BTreeMap<u64, String>,
    /// ZeRO: the chunks each replica's optimizer file (in `optimizers`, under its
    /// `zero_rank`) holds the state of; the executor joins them into whole states before it
    /// loads. `params` holds the joined weights already.
    pub zero: HashMap<ShardKey, Vec<Chunk>>,
}

impl Loaded {
    /// The tensor-parallel degree stage `stage` was saved with.
    pub fn tp_size(&self, stage: u32) -> u32 {
        self.tensor_parallel.get(&stage).copied().unwrap_or(1)
    }

    /// Whether this checkpoint can resume `plan`: the same model and optimizer.
    pub fn check_fits(&self, plan: &Plan) -> Result<(), String> {
        let Some(saved) = &self.identity else { return Ok(()) };
        let want = Identity::of(plan);
        if saved.model_hash != want.model_hash {
            return Err(format!(
                "state.json: the checkpoint holds another model (model_hash {}…, this plan's model is {}…): resume with the spec that wrote it (plan `{}`)",
                short(&saved.model_hash),
                short(&want.model_hash),
                saved.plan
            ));
        }
        if saved.optimizer != want.optimizer {
            return Err(format!(
                "state.json: the checkpoint holds `{}` optimizer state and this plan trains with `{}`",
                saved.optimizer, want.optimizer
            ));
        }
        // another layout is fine for a synchronous schedule: weights and optimizer state are
        // keyed by parameter (layer and slot) and each stage takes its parameters' entries
        // wherever they were, re-split for another tensor-parallel degree. An asynchronous
        // schedule's updates depend on its layout (how stale each stage's weights are), so
        // continuing one exactly needs the layout that wrote the checkpoint.
        if !plan.schedule.synchronous
            && (saved.stage_layers != want.stage_layers
                || (!saved.stage_devices.is_empty() && saved.stage_devices != want.stage_devices))
        {
            return Err(format!(
                "state.json: the checkpoint was written by layout `{}` and this plan's asynchronous `{}` schedule would continue it on `{}`: its weight staleness depends on the layout, so resume it on `{}` (or with a synchronous schedule, which resumes on any layout)",
                saved.partition, plan.schedule.kind, want.partition, saved.partition
            ));
        }
        Ok(())
    }
}

/// Finds the checkpoint to resume from: a `step-N` directory, a directory with a `latest`
/// file, or a run directory holding `checkpoints/latest`.
pub fn locate(path: &Path) -> Result<PathBuf, String> {
    locate_in(path, None)
}

/// [`locate`], also looking in the run directory's `checkpoint_dir` (the spec's
/// `training.checkpoint.dir`).
pub fn locate_in(path: &Path, checkpoint_dir: Option<&str>) -> Result<PathBuf, String> {
    if path.join("state.json").is_file() {
        return Ok(path.to_path_buf());
    }
    let mut bases = vec![path.to_path_buf()];
    bases.extend(checkpoint_dir.map(|d| path.join(d)));
    bases.push(path.join("checkpoints"));
    for base in bases {
        if let Ok(name) = std::fs::read_to_string(base.join("latest")) {
            let dir = base.join(name.trim());
            if dir.join("state.json").is_file() {
                return Ok(dir);
            }
            // `latest` names a step being replaced (a process killed between two renames):
            // the newest whole checkpoint beside it
            if let Some(newest) = newest_step(&base) {
                return Ok(newest);
            }
        }
    }
    Err(format!("no checkpoint found at `{}` (expected state.json, or a `latest` file)", path.display()))
}

/// The newest `step-N` directory in `base` that holds a `state.json`.
fn newest_step(base: &Path) -> Option<PathBuf> {
    std::fs::read_dir(base)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n: usize = name.strip_prefix("step-")?.parse().ok()?;
            e.path().join("state.json").is_file().then(|| (n, e.path()))
        })
        .max_by_key(|(n, _)| *n)
        .map(|(_, p)| p)
}

/// The steps a checkpoint has completed, from its `state.json` alone.
pub fn completed_steps(dir: &Path) -> Result<usize, String> {
    let text = std::fs::read_to_string(dir.join("state.json")).map_err(|e| format!("cannot read state.json: {e}"))?;
    let state: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("state.json: {e}"))?;
    steps_in(&state)
}

/// `state.json`'s `completed_steps`, checked: a whole number of steps ≥ 0.
fn steps_in(state: &serde_json::Value) -> Result<usize, String> {
    match state.get("completed_steps") {
        None => Err("state.json has no `completed_steps`".into()),
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or(format!("state.json: `completed_steps` must be a whole number of steps ≥ 0, found {v}")),
    }
}

/// The largest `state.json` read (it lists stages and files, never values).
const MAX_STATE_BYTES: u64 = 16 << 20;

/// Where a checkpoint's files come from: a directory, or (fuzzing, tests) memory.
pub type Source<'a> = dyn Fn(&str) -> Result<Vec<u8>, String> + 'a;

/// The first characters of a hash, for a message (any text, never split inside a character).
fn short(hash: &str) -> String {
    hash.chars().take(12).collect()
}

/// Reads a file of the checkpoint and, when `state.json` records one, checks its size and
/// SHA-256 before anything parses it.
fn read_verified(
    source: &Source<'_>,
    file: &str,
    sums: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Result<Vec<u8>, String> {
    let expected = match sums {
        None => None,
        Some(sums) => {
            let entry = sums.get(file).ok_or(format!("state.json lists no checksum for {file}"))?;
            let sha = entry.get("sha256").and_then(serde_json::Value::as_str);
            let bytes = entry.get("bytes").and_then(serde_json::Value::as_u64);
            match (sha, bytes) {
                (Some(s), Some(b)) => Some((s.to_string(), b)),
                _ => return Err(format!("state.json: the entry of {file} needs `sha256` and `bytes`")),
            }
        }
    };
    let contents = source(file)?;
    let size = contents.len() as u64;
    if let Some((_, bytes)) = &expected {
        if size != *bytes {
            return Err(format!(
                "{file} has {size} bytes, state.json records {bytes}: the file is truncated or was replaced"
            ));
        }
    }
    if let Some((sha, _)) = expected {
        let got = sha256_hex(&contents);
        if got != sha {
            return Err(format!(
                "{file} does not match its checksum (sha256 {}…, state.json records {}…): the file was changed or comes from another checkpoint",
                short(&got),
                short(&sha)
            ));
        }
    }
    Ok(contents)
}

/// Reads a checkpoint directory: every file verified against `state.json`, every value
/// checked for type and range, every problem an error naming the file.
pub fn read(dir: &Path) -> Result<Loaded, String> {
    let state_path = dir.join("state.json");
    let size = std::fs::metadata(&state_path).map_err(|e| format!("cannot read state.json: {e}"))?.len();
    if size > MAX_STATE_BYTES {
        return Err(format!("state.json has {size} bytes; a checkpoint's state.json is far smaller"));
    }
    read_from(&|file: &str| std::fs::read(dir.join(file)).map_err(|e| format!("cannot read {file}: {e}")))
}

/// [`read`] over any source of the checkpoint's files.
pub fn read_from(source: &Source<'_>) -> Result<Loaded, String> {
    let state_bytes = source("state.json")?;
    if state_bytes.len() as u64 > MAX_STATE_BYTES {
        return Err(format!("state.json has {} bytes; a checkpoint's state.json is far smaller", state_bytes.len()));
    }
    let state: serde_json::Value = serde_json::from_slice(&state_bytes).map_err(|e| format!("state.json: {e}"))?;
    let format = state.get("format").and_then(serde_json::Value::as_u64);
    if !matches!(format, Some(2) | Some(3) | Some(FORMAT)) {
        return Err(format!(
            "state.json: checkpoint format {} is not one this pipec reads (2 to {FORMAT})",
            state.get("format").map_or("(missing)".to_string(), ToString::to_string)
        ));
    }
    let completed_steps = steps_in(&state)?;
    let text = |key: &str| -> Result<String, String> {
        state
            .get(key)
            .and_then(serde_json::Value::as_str)
            .map(str::to_string)
            .ok_or(format!("state.json has no `{key}`"))
    };
    let (identity, sums) = if matches!(format, Some(3) | Some(FORMAT)) {
        let identity = Identity {
            plan: text("plan")?,
            partition: text("partition")?,
            model_hash: text("model_hash")?,
            optimizer: text("optimizer")?,
            stateful: state
                .get("optimizer_stateful")
                .and_then(serde_json::Value::as_bool)
                .ok_or("state.json has no `optimizer_stateful`")?,
            stage_layers: state
                .get("stage_layers")
                .and_then(|v| serde_json::from_value::<Vec<[usize; 2]>>(v.clone()).ok())
                .ok_or("state.json: `stage_layers` must be a list of [start, end) layer ranges")?,
            stage_devices: match state.get("stage_devices") {
                None => Vec::new(),
                Some(v) => serde_json::from_value::<Vec<Vec<u32>>>(v.clone())
                    .map_err(|_| "state.json: `stage_devices` must be a list of device-id lists")?,
            },
            whole_experts: match state.get("experts_whole") {
                None => false,
                Some(v) => v.as_bool().ok_or("state.json: `experts_whole` must be true or false")?,
            },
        };
        let sums = state.get("files").and_then(serde_json::Value::as_object).ok_or("state.json has no `files`")?;
        (Some(identity), Some(sums))
    } else {
        (None, None)
    };
    let bytes = read_verified(source, "model.safetensors", sums)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| format!("model.safetensors: {e}"))?;
    let zero_chunks = state.get("zero").and_then(|z| z.get("chunks"));
    let mut params = HashMap::new();
    // ZeRO chunks by (parameter, tensor-parallel rank)
    let mut chunks: HashMap<(u64, u32), Vec<Piece>> = HashMap::new();
    let mut zero: HashMap<ShardKey, Vec<Chunk>> = HashMap::new();
    for (name, view) in st.tensors() {
        let (id, tp_rank, zero_rank) =
            parse_name(&name).ok_or(format!("model.safetensors: unexpected tensor `{name}`"))?;
        if view.dtype() != Dtype::F32 {
            return Err(format!("model.safetensors: `{name}` is {:?}, pipec writes and reads f32", view.dtype()));
        }
        let values: Vec<f32> =
            view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(format!("model.safetensors: `{name}` holds a non-finite value ({}) at element {i}", values[i]));
        }
        let Some(z) = zero_rank else {
            params.insert((id, tp_rank), (view.shape().to_vec(), values));
            continue;
        };
        let (stage, c) = zero_chunk(zero_chunks, &name, id)?;
        zero.entry(ShardKey { stage, tp_rank, zero_rank: z }).or_default().push(c.clone());
        chunks.entry((id, tp_rank)).or_default().push((c.index, c.of, c.shape, values));
    }
    for ((id, tp_rank), mut pieces) in chunks {
        params.insert((id, tp_rank), join_chunks(id, &mut pieces)?);
    }
    for list in zero.values_mut() {
        list.sort_by_key(|c| c.id);
    }
    let mut tensor_parallel = HashMap::new();
    if let Some(tp) = state.get("tensor_parallel").and_then(serde_json::Value::as_object) {
        for (s, n) in tp {
            let s: u32 = s.parse().map_err(|_| format!("state.json: bad stage `{s}` in tensor_parallel"))?;
            let n = n
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|&n| (1..=4096).contains(&n))
                .ok_or(format!("state.json: bad tensor-parallel degree {n} for stage {s}"))?;
            tensor_parallel.insert(s, n);
        }
    }
    let replicas = zero_replicas(&state)?;
    let mut optimizers = HashMap::new();
    for s in state.get("stages").and_then(serde_json::Value::as_array).cloned().unwrap_or_default() {
        let s = s.as_u64().and_then(|s| u32::try_from(s).ok()).ok_or(format!("state.json: bad stage {s}"))?;
        let n = tensor_parallel.get(&s).copied().unwrap_or(1);
        for r in 0..n {
            match replicas.get(&(s, r)) {
                None => {
                    let key = ShardKey::whole(s, r);
                    optimizers.insert(key, read_verified(source, &optimizer_file(key, n, false), sums)?);
                }
                Some(ranks) => {
                    for &z in ranks {
                        let key = ShardKey { stage: s, tp_rank: r, zero_rank: z };
                        optimizers.insert(key, read_verified(source, &optimizer_file(key, n, true), sums)?);
                        zero.entry(key).or_default();
                    }
                }
            }
        }
    }
    let loss_scale = match state.get("loss_scale") {
        None => None,
        Some(v) => Some(loss_scale_in(v)?),
    };
    Ok(Loaded {
        completed_steps,
        params,
        optimizers,
        tensor_parallel,
        identity,
        loss_scale,
        initial: Default::default(),
        zero,
    })
}

/// The replicas of each ZeRO-sharded (stage, tensor-parallel rank), from `state.json`.
fn zero_replicas(state: &serde_json::Value) -> Result<HashMap<(u32, u32), Vec<u32>>, String> {
    let mut out = HashMap::new();
    let Some(z) = state.get("zero") else { return Ok(out) };
    let bad = |what: &str| format!("state.json: `zero.replicas` {what}");
    let map = z.get("replicas").and_then(serde_json::Value::as_object).ok_or_else(|| bad("is missing"))?;
    for (key, ranks) in map {
        let (s, t) = key.split_once('.').ok_or_else(|| bad(&format!("has the key `{key}`, not `stage.rank`")))?;
        let (s, t) = (s.parse::<u32>(), t.parse::<u32>());
        let (Ok(s), Ok(t)) = (s, t) else { return Err(bad(&format!("has the key `{key}`, not `stage.rank`"))) };
        let ranks: Vec<u32> = serde_json::from_value(ranks.clone())
            .map_err(|_| bad(&format!("of `{key}` must be a list of replica numbers")))?;
        if ranks.is_empty() || ranks.len() > 65_536 {
            return Err(bad(&format!("of `{key}` lists {} replicas", ranks.len())));
        }
        out.insert((s, t), ranks);
    }
    Ok(out)
}

/// What `state.json` says the stored ZeRO chunk `name` (of parameter `id`) is: its stage
/// and its place in the whole parameter.
fn zero_chunk(chunks: Option<&serde_json::Value>, name: &str, id: u64) -> Result<(u32, Chunk), String> {
    let not = || format!("state.json: `zero.chunks` does not describe the stored chunk `{name}`");
    let chunks = chunks.and_then(serde_json::Value::as_object).ok_or_else(not)?;
    for (stage, entries) in chunks {
        let Some(e) = entries.get(name) else { continue };
        let stage: u32 = stage.parse().map_err(|_| format!("state.json: bad stage `{stage}` in zero.chunks"))?;
        let number = |k: &str| e.get(k).and_then(serde_json::Value::as_u64).and_then(|v| u32::try_from(v).ok());
        let shape: Option<Vec<usize>> = e.get("shape").and_then(|v| serde_json::from_value(v.clone()).ok());
        return match (number("index"), number("of"), shape) {
            (Some(index), Some(of), Some(shape)) if index < of && shape.len() <= 16 => {
                Ok((stage, Chunk { id, shape, index, of }))
            }
            _ => Err(format!("state.json: the chunk `{name}` needs an `index` below `of` and a `shape`")),
        };
    }
    Err(not())
}

/// A stored ZeRO chunk: its index, the chunk count, the whole shape and its values.
type Piece = (u32, u32, Vec<usize>, Vec<f32>);

/// A parameter's whole values from its ZeRO chunks (every one of 0..of, each the same
/// length, enough for the shape; the padding beyond it dropped).
fn join_chunks(id: u64, pieces: &mut [Piece]) -> Result<(Vec<usize>, Vec<f32>), String> {
    let name = param_name(id);
    pieces.sort_by_key(|p| p.0);
    let (of, shape) = (pieces[0].1, pieces[0].2.clone());
    let len: usize = shape.iter().product();
    let chunk = len.div_ceil(of.max(1) as usize);
    let whole = pieces.iter().enumerate().all(|(k, p)| p.0 as usize == k && p.1 == of && p.2 == shape);
    if !whole || pieces.len() != of as usize {
        let have: Vec<u32> = pieces.iter().map(|p| p.0).collect();
        return Err(format!("model.safetensors: the ZeRO chunks of `{name}` are {have:?}, not all of 0 to {}", of - 1));
    }
    if let Some(p) = pieces.iter().find(|p| p.3.len() != chunk) {
        return Err(format!("model.safetensors: a ZeRO chunk of `{name}` holds {} values, not {chunk}", p.3.len()));
    }
    let mut values: Vec<f32> = Vec::with_capacity(chunk * of as usize);
    for p in pieces.iter() {
        values.extend_from_slice(&p.3);
    }
    values.truncate(len);
    Ok((shape, values))
}

/// `state.json`'s `loss_scale`, checked: a finite scale above 0 and a whole count of steps.
fn loss_scale_in(v: &serde_json::Value) -> Result<crate::recipe::LossScale, String> {
    let scale = v.get("scale").and_then(serde_json::Value::as_f64).filter(|s| s.is_finite() && *s > 0.0);
    let good = v.get("good_steps").and_then(serde_json::Value::as_u64).and_then(|n| u32::try_from(n).ok());
    match (scale, good) {
        (Some(scale), Some(good_steps)) => Ok(crate::recipe::LossScale { scale, good_steps }),
        _ => Err(format!(
            "state.json: `loss_scale` must hold a finite `scale` above 0 and a whole `good_steps`, found {v}"
        )),
    }
}
