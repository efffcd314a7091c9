//! Expert parallelism: a stage's replicas in groups of `ep` (`StagePlan::expert_parallel`),
//! the member at position j computing the j-th 1/ep of every block's routed experts on the
//! tokens the whole group routes to them. Tokens travel in two all-to-all exchanges inside
//! the block's forward — to their experts' members (dispatch) and back (combine) — and
//! their gradients the other way inside the backward: [`Kernels::exchange`] is an autodiff
//! node whose backward runs the reverse exchange on the device's collective thread.
//!
//! Without ZeRO a member keeps only its own experts' weights, gradients and optimizer
//! state ([`Holding`]): their gradients are summed over the replicas holding them, the
//! dense parameters' over all the stage's replicas, and a checkpoint joins every expert from
//! its group ([`join_experts`]). Beside ZeRO the same division holds: the dense
//! parameters' state is sharded over the stage's replicas and a member's own experts' over
//! the replicas holding them (`crate::parallel::zero::ShardLayout`'s two parts), each part reduced,
//! updated and gathered over its own replicas.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use pipec_plan::{DeviceId, Plan, StageId};

use crate::backend::port::{device_at, expert_ranks, replica_of, PeerGroup};

/// Who keeps a parameter of an expert-parallel stage (see [`Holding`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kept {
    /// Every replica: the stage's dense parameters, its routers and shared experts.
    Everywhere,
    /// This member and the replicas at its position in the other expert groups: one of
    /// the routed experts it computes.
    Here,
    /// Another position's members: a routed expert this member never computes.
    Elsewhere,
}

/// Expert parallelism's division of a stage's routed experts: the member at position p of
/// each expert group computes and keeps experts p·E/ep .. (p+1)·E/ep of every block; the
/// other experts' weights are never read here, and [`Holding::evict`] drops them. The
/// member and the replicas at its position in the other groups (its holders) alone update
/// them, their gradients summed only over those replicas — the plan's reduction of expert
/// gradients over their holders, and its memory figures' 1/ep of the experts' gradients and
/// optimizer state — and a checkpoint joins each expert from its holders
/// (`crate::interp::checkpointing`). Beside ZeRO (`sharded`) the holders shard their experts'
/// state among themselves (`crate::parallel::zero::ShardLayout`'s part 1).
#[derive(Clone, Debug)]
pub(crate) struct Holding {
    /// Per parameter of the stage, in visiting order: who keeps it.
    pub kept: Vec<Kept>,
    /// The replicas holding this member's experts, this device among them, in replica
    /// order (their tensor-parallel ranks of this device's rank).
    pub holders: Vec<DeviceId>,
    /// This member's position in its expert group.
    pub position: usize,
    /// Whether the stage is ZeRO-sharded on this device.
    pub sharded: bool,
}

/// The shape a dropped expert's parameter shaped `shape` takes: no rows.
pub(crate) fn dropped_shape(shape: &[usize]) -> Vec<usize> {
    let mut s = shape.to_vec();
    if let Some(first) = s.first_mut() {
        *first = 0;
    }
    s
}

/// The routed expert a parameter `id` of a stage belongs to, with its block's count of
/// routed experts (None: a dense parameter, a router, a shared expert).
pub(crate) fn routed_expert(plan: &Plan, id: u64) -> Option<(usize, usize)> {
    let (layer, slot) = ((id >> 8) as usize, id & 0xff);
    let moe = plan.layers.get(layer)?.op.block_dims()?.moe?;
    let first = pipec_plan::checkpoint::expert_slot(0);
    let e = usize::try_from(slot.checked_sub(first)? / 4).ok()?;
    (e < moe.experts).then_some((e, moe.experts))
}

impl Holding {
    /// The division of `stage`'s parameters `params` (id and shape, in visiting order) on
    /// `device`: None where the stage is not expert-parallel or `device` does not hold it.
    pub fn of(plan: &Plan, stage: StageId, device: DeviceId, params: &[(u64, Vec<usize>)]) -> Option<Holding> {
        let s = plan.stage(stage)?;
        let ep = s.expert_parallel as usize;
        if ep <= 1 {
            return None;
        }
        let sharded = crate::parallel::groups::shard_group(plan, stage, device).is_some();
        let (i, rank) = replica_of(s, device)?;
        let placement = plan.schedule.kind.chunk_placement();
        // whole experts (`etp: 1`): the group's positions are its replicas' ranks
        let folded = expert_ranks(plan, s, i);
        let position = placement.expert_position(i, ep) * folded + rank % folded;
        let n = s.tensor_parallel.len().max(s.replicas.len());
        let holders: Vec<DeviceId> =
            placement.same_experts(i, n, ep).into_iter().map(|j| device_at(s, j, rank)).collect::<Option<_>>()?;
        let ep = ep * folded;
        let kept = params
            .iter()
            .map(|(id, _)| match routed_expert(plan, *id) {
                None => Kept::Everywhere,
                Some((e, experts)) if e / (experts / ep).max(1) == position => Kept::Here,
                Some(_) => Kept::Elsewhere,
            })
            .collect();
        Some(Holding { kept, holders, position, sharded })
    }

    /// The positions among `range` of the parameters kept as `kept`.
    pub fn positions(&self, range: std::ops::Range<usize>, kept: Kept) -> Vec<usize> {
        range.filter(|&k| self.kept.get(k) == Some(&kept)).collect()
    }

    /// `model` without the weights of the routed experts this member does not keep (each
    /// an empty tensor of no rows: nothing here reads them), so that its weights, like its
    /// gradients and optimizer state, are the stage's dense ones and its own experts'.
    pub fn evict<B: Backend, M: burn::module::Module<B>>(&self, model: M) -> M {
        struct Evict<'a> {
            kept: &'a [Kept],
            at: usize,
        }
        impl<B: Backend> burn::module::ModuleMapper<B> for Evict<'_> {
            fn map_float<const D: usize>(
                &mut self,
                param: burn::module::Param<Tensor<B, D>>,
            ) -> burn::module::Param<Tensor<B, D>> {
                let k = self.at;
                self.at += 1;
                if self.kept.get(k) != Some(&Kept::Elsewhere) {
                    return param;
                }
                let (id, tensor, _) = param.consume();
                let shape = dropped_shape(&tensor.dims());
                let empty = Tensor::<B, D>::from_data(TensorData::new(Vec::<f32>::new(), shape), &tensor.device());
                burn::module::Param::initialized(id, empty.require_grad())
            }
        }
        model.map(&mut Evict { kept: &self.kept, at: 0 })
    }

    /// Whether this device counts its experts' gradients in the global norm: the first of
    /// their holders (beside ZeRO each replica counts its chunks of every parameter).
    pub fn counts_experts(&self, device: DeviceId) -> bool {
        self.holders.first() == Some(&device)
    }

    /// Whether this member's experts are reduced and updated whole (without ZeRO), not as
    /// the shard's part 1.
    pub fn updates_alone(&self) -> bool {
        !self.sharded
    }

    /// Whether parameter `k` (its position in the stage's visiting order) is another
    /// position's routed expert, whose weights this member drops.
    pub fn elsewhere(&self, k: usize) -> bool {
        self.kept.get(k) == Some(&Kept::Elsewhere)
    }
}

/// A parameter's values and optimizer state as a checkpoint keeps them.
pub(crate) type SavedParam = (u64, Vec<usize>, Vec<f32>);
type Items = Vec<(burn::module::ParamId, crate::parallel::reshard::Item)>;

/// A checkpoint's view of an expert-parallel stage: every member's own routed experts —
/// their weights in `params` (this member's snapshot, in visiting order) and their
/// optimizer state beside `items` (this member's optimizer state) — gathered over its
/// expert group, whose members together hold every expert once. Returns the optimizer
/// state of the whole stage; `params` then holds every expert's weights.
pub(crate) fn join_experts(
    group: &PeerGroup,
    holding: &Holding,
    params: &mut [SavedParam],
    items: Items,
) -> crate::error::Result<Items> {
    use crate::error::ExecError;
    let bad = |what: &str| ExecError::Checkpoint(format!("an expert group's checkpoint message {what}"));
    let mine: std::collections::HashMap<u64, crate::parallel::reshard::Item> =
        items.into_iter().map(|(id, item)| (id.val(), item)).collect();
    // this member's experts: id, shape, values, then the optimizer's state if it has one
    // (its record without its tensors, as bytes, then the tensors)
    let mut out = Vec::new();
    let here: Vec<&SavedParam> =
        params.iter().zip(&holding.kept).filter(|(_, k)| **k == Kept::Here).map(|(p, _)| p).collect();
    put(&mut out, here.len());
    for (id, shape, values) in &here {
        put(&mut out, *id as usize);
        put(&mut out, shape.len());
        shape.iter().for_each(|&n| put(&mut out, n));
        put(&mut out, values.len());
        out.extend_from_slice(values);
        match mine.get(id) {
            Some(item) => {
                let tensors = crate::parallel::reshard::tensor_values(item)?;
                let skeleton = crate::parallel::reshard::with_tensors(item, vec![Vec::new(); tensors.len()], &[0])?;
                let mut text = Vec::new();
                ciborium::into_writer(&skeleton, &mut text).map_err(|e| ExecError::Checkpoint(e.to_string()))?;
                put(&mut out, 1);
                put(&mut out, text.len());
                out.extend(text.iter().map(|&b| f32::from(b)));
                put(&mut out, tensors.len());
                for t in tensors {
                    put(&mut out, t.len());
                    out.extend(t);
                }
            }
            None => put(&mut out, 0),
        }
    }
    let gathered = group.all_gather(out).map_err(ExecError::Transport)?;
    let index: std::collections::HashMap<u64, usize> =
        params.iter().enumerate().map(|(k, (id, _, _))| (*id, k)).collect();
    // the state this member keeps (none of another position's experts), then the others'
    let mut joined: Items = mine
        .into_iter()
        .filter(|(id, _)| index.get(id).is_none_or(|&k| holding.kept.get(k) != Some(&Kept::Elsewhere)))
        .map(|(id, item)| (burn::module::ParamId::from(id), item))
        .collect();
    for (j, message) in gathered.iter().enumerate() {
        if j == holding.position {
            continue;
        }
        let mut at = message.iter().copied();
        let mut take = |n: usize| -> crate::error::Result<Vec<f32>> {
            let v: Vec<f32> = at.by_ref().take(n).collect();
            if v.len() == n {
                Ok(v)
            } else {
                Err(bad("ends early"))
            }
        };
        let count = get(&mut take)?;
        for _ in 0..count {
            let id = get(&mut take)? as u64;
            let rank = get(&mut take)?;
            let shape = (0..rank).map(|_| get(&mut take)).collect::<crate::error::Result<Vec<usize>>>()?;
            let n = get(&mut take)?;
            let values = take(n)?;
            let k = *index.get(&id).ok_or_else(|| bad(&format!("names parameter {id}, which the stage lacks")))?;
            if holding.kept.get(k) != Some(&Kept::Elsewhere) || shape.iter().product::<usize>() != n {
                return Err(bad(&format!("does not fit parameter {id}")));
            }
            params[k] = (id, shape.clone(), values);
            if get(&mut take)? == 1 {
                let len = get(&mut take)?;
                let text: Vec<u8> = take(len)?.into_iter().map(|b| b as u8).collect();
                let skeleton: crate::parallel::reshard::Item =
                    ciborium::from_reader(text.as_slice()).map_err(|e| bad(&format!("is unreadable: {e}")))?;
                let tensors = (0..get(&mut take)?)
                    .map(|_| {
                        let n = get(&mut take)?;
                        take(n)
                    })
                    .collect::<crate::error::Result<Vec<_>>>()?;
                let item = crate::parallel::reshard::with_tensors(&skeleton, tensors, &shape)?;
                joined.push((burn::module::ParamId::from(id), item));
            }
        }
    }
    joined.sort_by_key(|(id, _)| id.val());
    Ok(joined)
}

/// Appends `n` as four 16-bit values (each exact in an f32).
fn put(out: &mut Vec<f32>, n: usize) {
    let n = n as u64;
    out.extend((0..4).map(|i| ((n >> (16 * i)) & 0xffff) as f32));
}

/// The number [`put`] wrote, from `take`.
fn get(take: &mut dyn FnMut(usize) -> crate::error::Result<Vec<f32>>) -> crate::error::Result<usize> {
    let parts = take(4)?;
    Ok(parts.iter().enumerate().fold(0u64, |n, (i, &p)| n | ((p as u64) << (16 * i))) as usize)
}
