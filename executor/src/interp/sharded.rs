//! ZeRO on a stage's state: whole weights put back or released, the per-product stand-ins,
//! and a replica's shard saved to and cut from a checkpoint (the shards, layouts and gathers
//! themselves are `crate::parallel::zero`'s).

use pipec_plan::checkpoint;
use pipec_plan::{Plan, StageId};

use crate::backend::kernels::ExecBackend;
use crate::error::{ExecError, Result};
use crate::interp::stage::StageState;
use crate::nn::layers::StageModel;
use crate::parallel::optim::{StageOptim, Storage};
use crate::parallel::zero::{master_chunks, ShardParams};
use crate::{nn::params, parallel::reshard};
use burn::module::ParamId;
use std::collections::HashMap;

/// Puts whole weights (one vector per parameter, in the layout's order) into the stage's
/// model, under each parameter's shape.
pub(crate) fn restore_weights<B: ExecBackend>(st: &mut StageState<B>, whole: Vec<Vec<f32>>) -> Result<()> {
    let shard = st.shard.as_ref().ok_or(ExecError::Missing("the stage is not sharded"))?;
    // expert parallelism: another position's experts stay dropped (`experts::Holding`)
    let dropped = |k: usize| st.experts.as_ref().is_some_and(|h| h.elsewhere(k));
    let mut by_id: HashMap<u64, (Vec<usize>, Vec<f32>)> = shard
        .layout
        .params
        .iter()
        .zip(whole)
        .enumerate()
        .map(|(k, (p, v))| {
            if dropped(k) {
                (p.id, (crate::parallel::experts::dropped_shape(&p.shape), Vec::new()))
            } else if shard.per_product.get(k).copied().unwrap_or(false) {
                // gathered by its products: a one-value stand-in, as `release_weights` leaves
                (p.id, (vec![1; p.shape.len()], vec![0.0]))
            } else {
                (p.id, (p.shape.clone(), v))
            }
        })
        .collect();
    let model = st.model.take().ok_or(ExecError::Missing("the stage's model is in use"))?;
    let (model, missing) = params::replace_params(model, |id| by_id.remove(&id));
    st.model = Some(model);
    if let Some(id) = missing.first() {
        return Err(ExecError::Plan(format!("no gathered values for parameter {id}")));
    }
    if let Some(shard) = st.shard.as_mut() {
        shard.gathered = true;
    }
    Ok(())
}

/// ZeRO: puts every parameter's whole shape back into the stage's model (zeros for another
/// expert-parallel position's experts and for the stand-ins of weights gathered per
/// product), so that a checkpoint's whole weights load into it before this replica cuts its
/// shard of them.
pub(crate) fn unevict<B: ExecBackend>(st: &mut StageState<B>) -> Result<()> {
    let shard = st.shard.as_ref().ok_or(ExecError::Missing("the stage is not sharded"))?;
    let model = st.model.as_ref().ok_or(ExecError::Missing("the stage's model is in use"))?;
    let whole = params::snapshot::<B, _>(model)?
        .into_iter()
        .zip(&shard.layout.params)
        .map(|((_, _, v), p)| if v.len() == p.len { v } else { vec![0.0; p.len] })
        .collect();
    // (every parameter whole: the experts of every position, the weights gathered per
    // product too)
    let experts = st.experts.take();
    let per_product = st.shard.as_mut().map(|s| std::mem::take(&mut s.per_product));
    let restored = restore_weights(st, whole);
    st.experts = experts;
    if let (Some(shard), Some(per_product)) = (st.shard.as_mut(), per_product) {
        shard.per_product = per_product;
    }
    restored
}

/// ZeRO-3: drops the stage's whole weights after its update (one value each stands in until
/// the next gather); only the shard remains.
pub(crate) fn release_weights<B: ExecBackend>(st: &mut StageState<B>) -> Result<()> {
    let model = st.model.take().ok_or(ExecError::Missing("the stage's model is in use"))?;
    let (model, _) = params::replace_params(model, |_| None::<(Vec<usize>, Vec<f32>)>);
    st.model = Some(model);
    if let Some(shard) = st.shard.as_mut() {
        shard.gathered = false;
    }
    Ok(())
}

/// ZeRO-3 per product: puts one-value stand-ins in the model for the weights its products
/// gather ([`per_product`]), once the shard has cut its chunks from them (as built, and
/// after a checkpoint's load); the other parameters stay as they are.
pub(crate) fn stand_in_per_product<B: ExecBackend>(st: &mut StageState<B>) -> Result<()> {
    let Some(shard) = st.shard.as_ref() else { return Ok(()) };
    let ids: std::collections::HashSet<u64> =
        shard.layout.params.iter().zip(&shard.per_product).filter(|(_, g)| **g).map(|(p, _)| p.id).collect();
    if ids.is_empty() {
        return Ok(());
    }
    let model = st.model.take().ok_or(ExecError::Missing("the stage's model is in use"))?;
    st.model = Some(params::stand_ins(model, &ids));
    Ok(())
}

/// ZeRO: this replica's shard of a stage as a checkpoint keeps it (`pipec_plan::checkpoint`:
/// one file set per replica, joined by the reader): its master chunks (flat, the last
/// padded with zeros) with which chunk of which parameter each is, its optimizer state over
/// them in Burn's record format, and (on the first replica only) the batch norms' running
/// statistics whole. Nothing is gathered: every replica saves what it holds, and the writes
/// cost what an unsharded stage's do.
pub(crate) fn saved_shard<B: ExecBackend>(
    st: &StageState<B>,
    id: StageId,
    tp_rank: u32,
    tp_size: u32,
) -> Result<(checkpoint::ShardKey, checkpoint::StageCheckpoint)> {
    let shard = st.shard.as_ref().ok_or(ExecError::Missing("the stage is not sharded"))?;
    let layout = &shard.layout;
    let master = shard.master.as_ref().ok_or(ExecError::Missing("the stage's shard is in use"))?;
    let (mut params, mut chunks) = (Vec::new(), Vec::new());
    for (k, p) in layout.params.iter().enumerate() {
        // (another expert-parallel position's expert: its holders save it)
        let Some(part) = p.part.map(|i| layout.parts[i]) else { continue };
        let chunk = master.chunks.get(k).ok_or(ExecError::Missing("a chunk of the shard"))?;
        params.push((p.id, vec![p.chunk], crate::nn::params::host_f32(chunk.val().into_data())?));
        chunks.push(checkpoint::Chunk { id: p.id, shape: p.shape.clone(), index: part.rank as u32, of: part.d as u32 });
    }
    if layout.rank == 0 {
        for (sid, shape, values) in crate::interp::stage::kept_state(st)? {
            chunks.push(checkpoint::Chunk { id: sid, shape: shape.clone(), index: 0, of: 1 });
            params.push((sid, shape, values));
        }
    }
    let optimizer = shard.optim.save().map_err(|e| ExecError::Checkpoint(format!("stage {id}: {e}")))?;
    let key = checkpoint::ShardKey { stage: id.0, tp_rank, zero_rank: layout.rank as u32 };
    Ok((key, checkpoint::StageCheckpoint { params, optimizer, tp_size, zero: Some(chunks) }))
}

/// ZeRO: after a checkpoint is loaded into a sharded stage (whole weights in its model,
/// whole optimizer state in its model's optimizer), this replica's shard of both: the
/// master chunks, and each parameter's state cut to its chunk.
pub(crate) fn shard_loaded<B: ExecBackend>(st: &mut StageState<B>, plan: &Plan, dev: &B::Device) -> Result<()> {
    let model = st.model.as_ref().ok_or(ExecError::Missing("the stage's model is in use"))?;
    let shard = st.shard.as_mut().ok_or(ExecError::Missing("the stage is not sharded"))?;
    shard.master = Some(master_chunks(&shard.layout, model, dev)?);
    // (the weights gathered per product are gathered from the loaded chunks)
    shard.gatherer = None;
    let index: HashMap<u64, usize> = shard.layout.params.iter().enumerate().map(|(k, p)| (p.id, k)).collect();
    let mut cut = Vec::new();
    for (id, item) in st.optim.items().map_err(ExecError::Checkpoint)? {
        let k = *index.get(&id.val()).ok_or_else(|| ExecError::Checkpoint(format!("no parameter {id} here")))?;
        let layout = &shard.layout;
        // (another expert-parallel position's expert: no state here)
        if layout.params[k].part.is_none() {
            continue;
        }
        let chunk =
            reshard::map_tensors(std::slice::from_ref(&item), Some(&[layout.params[k].chunk]), &|mut parts| {
                Ok(layout.chunk(k, &parts.pop().unwrap_or_default(), layout.rank_of(k)))
            })?;
        cut.push((id, reshard::with_rank(chunk, 1)?));
    }
    shard.optim.load_items(cut, dev).map_err(ExecError::Checkpoint)?;
    // the whole state lives on only in the shards
    st.optim = StageOptim::new(&plan.training.optimizer, &[], Storage::of(&plan.training));
    Ok(())
}

/// A checkpoint's ZeRO shards' optimizer states joined into the whole states an unsharded
/// stage saves (`optimizer-s{K}[-tp{r}].bin`, under [`checkpoint::ShardKey::whole`]): each
/// parameter's state from its chunks in order, the padding dropped. The reader joined the
/// weights already; after this the checkpoint loads like any other, on any layout. The
/// records are decoded and encoded on the CPU backend (bytes either way).
pub fn join_saved(loaded: &mut checkpoint::Loaded, optimizer: &pipec_plan::plan::OptimizerPlan) -> Result<()> {
    type C = crate::backend::CpuBackend;
    if loaded.zero.is_empty() {
        return Ok(());
    }
    let dev = Default::default();
    let bad = |what: String| ExecError::Checkpoint(what);
    // each (stage, tensor-parallel rank)'s replicas' shards
    type Replicas = Vec<(checkpoint::ShardKey, Vec<checkpoint::Chunk>)>;
    let mut groups: std::collections::BTreeMap<(u32, u32), Replicas> = Default::default();
    for (key, chunks) in std::mem::take(&mut loaded.zero) {
        groups.entry((key.stage, key.tp_rank)).or_default().push((key, chunks));
    }
    // each (stage, tensor-parallel rank)'s whole shapes and joined optimizer items
    let mut states: std::collections::BTreeMap<(u32, u32), JoinedState> = Default::default();
    for ((stage, tp_rank), shards) in groups {
        // every replica's items, by parameter: whole shape, chunk count, (chunk index, item)
        type Pieces = (Vec<usize>, u32, Vec<(u32, reshard::Item)>);
        let mut by_param: std::collections::BTreeMap<u64, Pieces> = Default::default();
        let mut shapes: std::collections::BTreeMap<u64, Vec<usize>> = Default::default();
        for (key, chunks) in shards {
            let bytes = loaded
                .optimizers
                .remove(&key)
                .ok_or_else(|| bad(format!("stage {stage}: replica {}'s optimizer state is missing", key.zero_rank)))?;
            let flat: Vec<(u64, Vec<usize>)> = chunks.iter().map(|c| (c.id, vec![chunk_len(c)])).collect();
            let mut shard_optim = StageOptim::<C, ShardParams<C>>::new(optimizer, &flat, Storage::default());
            shard_optim
                .load_bytes(&bytes, &dev)
                .map_err(|e| bad(format!("stage {stage}, replica {}: {e}", key.zero_rank)))?;
            let of_id: HashMap<u64, &checkpoint::Chunk> = chunks.iter().map(|c| (c.id, c)).collect();
            for c in &chunks {
                shapes.insert(c.id, c.shape.clone());
            }
            for (pid, item) in shard_optim.items().map_err(ExecError::Checkpoint)? {
                let c = of_id.get(&pid.val()).ok_or_else(|| {
                    bad(format!(
                        "stage {stage}: replica {}'s optimizer holds a parameter it saved no chunk of",
                        key.zero_rank
                    ))
                })?;
                by_param.entry(c.id).or_insert_with(|| (c.shape.clone(), c.of, Vec::new())).2.push((c.index, item));
            }
        }
        let mut joined = Vec::new();
        for (pid, (shape, of, mut pieces)) in by_param {
            pieces.sort_by_key(|(i, _)| *i);
            if pieces.len() != of as usize || pieces.iter().enumerate().any(|(k, (i, _))| *i as usize != k) {
                return Err(bad(format!(
                    "stage {stage}: the optimizer state of `{}` is in {} of its {of} chunks",
                    checkpoint::param_name(pid),
                    pieces.len()
                )));
            }
            let len: usize = shape.iter().product();
            let items: Vec<reshard::Item> = pieces.into_iter().map(|(_, item)| item).collect();
            let whole = reshard::map_tensors(&items, Some(&shape), &|parts| {
                let mut v: Vec<f32> = parts.into_iter().flatten().collect();
                v.truncate(len);
                Ok(v)
            })?;
            joined.push((pid, reshard::with_rank(whole, shape.len())?));
        }
        states.insert((stage, tp_rank), JoinedState { shapes, items: joined.into_iter().collect() });
    }
    if loaded.identity.as_ref().is_some_and(|i| i.whole_experts) {
        share_whole_experts(&mut states, &mut loaded.params);
    }
    for ((stage, tp_rank), state) in states {
        let whole_shapes: Vec<(u64, Vec<usize>)> = state.shapes.into_iter().collect();
        let items: Vec<(ParamId, reshard::Item)> =
            state.items.into_iter().map(|(id, i)| (ParamId::from(id), i)).collect();
        let mut whole = StageOptim::<C, StageModel<C>>::new(optimizer, &whole_shapes, Storage::default());
        whole.load_items(items, &dev).map_err(|e| bad(format!("stage {stage}: {e}")))?;
        let bytes = whole.save().map_err(|e| bad(format!("stage {stage}: {e}")))?;
        loaded.optimizers.insert(checkpoint::ShardKey::whole(stage, tp_rank), bytes);
    }
    Ok(())
}

/// One (stage, tensor-parallel rank)'s joined state: every parameter's whole shape, and
/// the optimizer's item of each it updates.
struct JoinedState {
    shapes: std::collections::BTreeMap<u64, Vec<usize>>,
    items: std::collections::BTreeMap<u64, reshard::Item>,
}

/// Whole experts (`etp: 1`): a routed expert lives whole on one tensor-parallel rank, so
/// the shards of that rank alone hold it. An unsharded stage's checkpoint holds every
/// expert of its group at each rank (`crate::parallel::experts::join_experts`); the same
/// here: a parameter one rank of a stage lacks is another rank's whole expert, copied to
/// it with its optimizer state.
fn share_whole_experts(
    states: &mut std::collections::BTreeMap<(u32, u32), JoinedState>,
    params: &mut pipec_plan::checkpoint::ParamValues,
) {
    let keys: Vec<(u32, u32)> = states.keys().copied().collect();
    for &(stage, to) in &keys {
        for &(_, from) in keys.iter().filter(|(s, r)| *s == stage && *r != to) {
            let source: Vec<(u64, Vec<usize>, Option<reshard::Item>)> = {
                let (held, there) = (&states[&(stage, to)], &states[&(stage, from)]);
                there
                    .shapes
                    .iter()
                    .filter(|(id, _)| !held.shapes.contains_key(id))
                    .map(|(id, shape)| (*id, shape.clone(), there.items.get(id).cloned()))
                    .collect()
            };
            for (id, shape, item) in source {
                if let Some(values) = params.get(&(id, from)).cloned() {
                    params.insert((id, to), values);
                }
                if let Some(state) = states.get_mut(&(stage, to)) {
                    state.shapes.insert(id, shape);
                    state.items.extend(item.map(|i| (id, i)));
                }
            }
        }
    }
}

/// A chunk's length: the whole parameter's values cut into `of` equal pieces.
fn chunk_len(c: &checkpoint::Chunk) -> usize {
    c.shape.iter().product::<usize>().div_ceil(c.of.max(1) as usize)
}
