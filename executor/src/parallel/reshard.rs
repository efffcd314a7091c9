//! Resuming on another layout: where each parameter's saved values are (which saved stage
//! and tensor-parallel ranks hold it, split how) and how to turn them into what this
//! device's stage holds. Weights and optimizer state (momentum, Adam's moments: tensors of
//! the parameter's shape) go through the same two steps: the saved shards are joined into
//! the whole tensor (`tensor_parallel::unshard`) and this rank's shard is cut from it
//! (`tensor_parallel::shard`), so a checkpoint resumes under any tensor-parallel degree.

use std::collections::HashMap;

use pipec_plan::checkpoint::{self, Loaded, ShardKey};
use pipec_plan::Plan;

use crate::error::{ExecError, Result};
use crate::parallel::tensor_parallel::{shard, shard_shape, shardings, unshard, whole_shape, Sharding};

/// Where one parameter's saved values come from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Saved {
    /// Per saved tensor-parallel rank, in rank order, the optimizer files that may hold its
    /// state (one, when the checkpoint says which stage held it).
    pub files: Vec<Vec<ShardKey>>,
    /// How the saved ranks split it.
    pub from: Sharding,
}

/// A saved stage: its layer range, tensor-parallel degree and split parameters.
type SavedStage = (std::ops::Range<usize>, u32, HashMap<u64, Sharding>);

/// The saved layout of a checkpoint, for a plan of the same model.
pub(crate) struct SavedLayout<'a> {
    loaded: &'a Loaded,
    /// Per saved stage (None: the checkpoint does not record its layout).
    stages: Option<Vec<SavedStage>>,
}

impl<'a> SavedLayout<'a> {
    pub fn new(loaded: &'a Loaded, plan: &Plan) -> Result<Self> {
        let Some(identity) = &loaded.identity else { return Ok(SavedLayout { loaded, stages: None }) };
        let mut stages = Vec::with_capacity(identity.stage_layers.len());
        let all = plan.model_ops();
        for (s, [a, b]) in identity.stage_layers.iter().enumerate() {
            let degree = loaded.tp_size(s as u32);
            let layers = crate::parallel::tensor_parallel::StageLayers {
                all: &all,
                range: *a..*b,
                loss: plan.model.loss,
                whole_experts: identity.whole_experts,
            };
            let split = shardings(&layers, degree as usize).map_err(|e| {
                ExecError::Checkpoint(format!(
                    "the checkpoint's stage {s} (layers {a}..{b}) cannot be split {degree} ways: {e}"
                ))
            })?;
            stages.push((*a..*b, degree, split));
        }
        Ok(SavedLayout { loaded, stages: Some(stages) })
    }

    /// Where parameter `id` was saved. A checkpoint without its layout (format 2) is read
    /// as if saved with this plan's degree and split (`tp`, `to`).
    pub fn saved(&self, id: u64, tp: u32, to: Sharding) -> Result<Saved> {
        let layer = (id >> 8) as usize;
        match &self.stages {
            Some(stages) => {
                let (s, (_, degree, split)) =
                    stages.iter().enumerate().find(|(_, (r, _, _))| r.contains(&layer)).ok_or_else(|| {
                        ExecError::Checkpoint(format!("the checkpoint's stages do not hold layer {layer}"))
                    })?;
                Ok(Saved {
                    files: (0..*degree).map(|k| vec![ShardKey::whole(s as u32, k)]).collect(),
                    from: split.get(&id).copied().unwrap_or(Sharding::Whole),
                })
            }
            None => {
                let files = |k: u32| self.loaded.optimizers.keys().filter(|f| f.tp_rank == k).copied().collect();
                Ok(Saved { files: (0..tp).map(files).collect(), from: to })
            }
        }
    }

    /// This rank's values of parameter (or state slot) `id`, of `shape` (this rank's shard
    /// when split as `to` over `tp` ranks); None when the checkpoint lacks it. Every saved
    /// part's shape must be the part of the whole tensor its rank held: the element count
    /// alone would take a weight stored transposed.
    pub fn values(&self, id: u64, to: Sharding, tp: u32, rank: u32, shape: &[usize]) -> Result<Option<Vec<f32>>> {
        let saved = self.saved(id, tp, to)?;
        let degree = saved.files.len() as u32;
        let whole = whole_shape(shape, to, tp as usize);
        let expected = shard_shape(&whole, saved.from, degree as usize);
        let mut parts = Vec::with_capacity(degree as usize);
        for k in 0..degree {
            match self.loaded.params.get(&(id, k)) {
                Some((stored, v)) => {
                    if *stored != expected {
                        let which = if degree > 1 { format!(" (tensor-parallel rank {k})") } else { String::new() };
                        return Err(ExecError::Checkpoint(format!(
                            "model.safetensors: `{}`{which} is stored as {stored:?}, and this model's needs {expected:?}",
                            checkpoint::param_name(id)
                        )));
                    }
                    parts.push(v.clone());
                }
                None => return Ok(None),
            }
        }
        let len: usize = shape.iter().product();
        let out = if degree == tp && saved.from == to {
            parts.swap_remove(rank as usize)
        } else {
            shard(&unshard(&parts, saved.from)?, to, tp as usize, rank as usize)
        };
        if out.len() != len {
            return Err(ExecError::Checkpoint(format!(
                "model.safetensors: `{}` has {} values for this rank, and this plan's model needs {len}",
                checkpoint::param_name(id),
                out.len()
            )));
        }
        Ok(Some(out))
    }
}

/// Every parameter of a checkpoint of `plan`'s model whole — its tensor-parallel shards
/// joined — by id, with its shape: what `pipec export` writes.
pub fn whole_weights(loaded: &Loaded, plan: &Plan) -> Result<pipec_plan::hf::Weights> {
    let saved = SavedLayout::new(loaded, plan)?;
    let ids: std::collections::BTreeSet<u64> = loaded.params.keys().map(|(id, _)| *id).collect();
    let mut out = std::collections::BTreeMap::new();
    for id in ids {
        let from = saved.saved(id, 1, Sharding::Whole)?;
        let Some((stored, _)) = loaded.params.get(&(id, 0)) else {
            return Err(ExecError::Checkpoint(format!(
                "model.safetensors has `{}` without its first tensor-parallel shard",
                checkpoint::param_name(id)
            )));
        };
        let whole = whole_shape(stored, from.from, from.files.len());
        let values = saved.values(id, Sharding::Whole, 1, 0, &whole)?.ok_or_else(|| {
            ExecError::Checkpoint(format!("model.safetensors lacks a shard of `{}`", checkpoint::param_name(id)))
        })?;
        out.insert(id, (whole, values));
    }
    Ok(out)
}

/// One parameter's optimizer state, serialised: Burn's record item as a CBOR value tree,
/// in which a tensor's values are one byte string (`TensorData::bytes`) — so taking a state
/// apart and putting it back costs a copy of its bytes, not a value per byte.
pub(crate) type Item = ciborium::Value;

/// The entry `key` of a CBOR map.
fn entry<'a>(v: &'a Item, key: &str) -> Option<&'a Item> {
    v.as_map()?.iter().find(|(k, _)| k.as_text() == Some(key)).map(|(_, v)| v)
}

/// Applies `f` to every f32 tensor inside a serialised record item, in the same order in
/// each of `items` (the saved ranks' states of one parameter); `f` gets each rank's values
/// and returns this rank's. The state of an optimizer is a record of tensors shaped like
/// its parameter (and counters, kept from the first rank); each tensor is reshaped to
/// `shape`, or keeps its own with None.
pub(crate) fn map_tensors(
    items: &[Item],
    shape: Option<&[usize]>,
    f: &dyn Fn(Vec<Vec<f32>>) -> Result<Vec<f32>>,
) -> Result<Item> {
    fn is_tensor(v: &Item) -> bool {
        matches!(entry(v, "bytes"), Some(Item::Bytes(_))) && entry(v, "shape").is_some() && entry(v, "dtype").is_some()
    }
    fn floats(v: &Item) -> Result<Vec<f32>> {
        let Some(Item::Bytes(bytes)) = entry(v, "bytes") else {
            return Err(ExecError::Checkpoint("an optimizer tensor has no values".into()));
        };
        if entry(v, "dtype").and_then(Item::as_text) != Some("F32") || !bytes.len().is_multiple_of(4) {
            return Err(ExecError::Checkpoint(format!("an optimizer tensor is not f32 ({:?})", entry(v, "dtype"))));
        }
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
    fn walk(items: &[&Item], shape: Option<&[usize]>, f: &dyn Fn(Vec<Vec<f32>>) -> Result<Vec<f32>>) -> Result<Item> {
        let first = items[0];
        if is_tensor(first) {
            let parts = items.iter().map(|v| floats(v)).collect::<Result<Vec<_>>>()?;
            let values = f(parts)?;
            let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
            let dims =
                shape.map(|shape| Item::Array(shape.iter().map(|&n| Item::Integer((n as u64).into())).collect()));
            let map = first.as_map().map(|m| {
                m.iter()
                    .map(|(k, v)| match k.as_text() {
                        Some("bytes") => (k.clone(), Item::Bytes(bytes.clone())),
                        Some("shape") => (k.clone(), dims.clone().unwrap_or_else(|| v.clone())),
                        _ => (k.clone(), v.clone()),
                    })
                    .collect()
            });
            return Ok(Item::Map(map.unwrap_or_default()));
        }
        match first {
            Item::Map(map) => {
                let mut out = Vec::with_capacity(map.len());
                for (k, v) in map {
                    let key = k.as_text().unwrap_or_default();
                    let children: Vec<&Item> = items.iter().map(|i| entry(i, key).unwrap_or(&Item::Null)).collect();
                    out.push((k.clone(), if v.is_null() { v.clone() } else { walk(&children, shape, f)? }));
                }
                Ok(Item::Map(out))
            }
            Item::Array(list) => {
                let mut out = Vec::with_capacity(list.len());
                for (j, v) in list.iter().enumerate() {
                    let children: Vec<&Item> =
                        items.iter().map(|i| i.as_array().and_then(|a| a.get(j)).unwrap_or(&Item::Null)).collect();
                    out.push(if v.is_null() { v.clone() } else { walk(&children, shape, f)? });
                }
                Ok(Item::Array(out))
            }
            other => Ok(other.clone()),
        }
    }
    let refs: Vec<&Item> = items.iter().collect();
    if refs.is_empty() {
        return Err(ExecError::Checkpoint("no saved optimizer state to reshard".into()));
    }
    walk(&refs, shape, f)
}

/// The f32 tensors inside a serialised record item, in the order [`map_tensors`] visits them.
pub(crate) fn tensor_values(item: &Item) -> Result<Vec<Vec<f32>>> {
    let found = std::cell::RefCell::new(Vec::new());
    map_tensors(std::slice::from_ref(item), None, &|mut parts| {
        let values = parts.pop().unwrap_or_default();
        found.borrow_mut().push(values);
        Ok(Vec::new())
    })?;
    Ok(found.into_inner())
}

/// `item` with its f32 tensors replaced by `values` (in [`tensor_values`]' order), each
/// shaped `shape`.
pub(crate) fn with_tensors(item: &Item, values: Vec<Vec<f32>>, shape: &[usize]) -> Result<Item> {
    let next = std::cell::RefCell::new(values.into_iter());
    map_tensors(std::slice::from_ref(item), Some(shape), &|_| {
        next.borrow_mut().next().ok_or_else(|| ExecError::Checkpoint("an optimizer state has too few tensors".into()))
    })
}

/// `item` (an optimizer's per-parameter record: Burn tags the state with its tensors' rank,
/// `{"V1": {"Rank2": …}}`) retagged for tensors of rank `rank` (a ZeRO chunk is flat: rank
/// 1; its whole parameter's rank is its shape's length).
pub(crate) fn with_rank(item: Item, rank: usize) -> Result<Item> {
    let Item::Map(mut outer) = item else {
        return Err(ExecError::Checkpoint("an optimizer state is not a record".into()));
    };
    for (_, version) in outer.iter_mut() {
        if let Item::Map(inner) = version {
            for (k, _) in inner.iter_mut() {
                if k.as_text().is_some_and(|t| t.starts_with("Rank")) {
                    *k = Item::Text(format!("Rank{rank}"));
                }
            }
        }
    }
    Ok(Item::Map(outer))
}
