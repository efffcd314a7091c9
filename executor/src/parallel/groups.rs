//! The plan's device groups as the executor asks for them: a group's members, and which
//! replicas shard a stage's state together under ZeRO (expert parallelism and ZeRO both ask).

use pipec_plan::vocab::Sharding;
use pipec_plan::{DeviceId, GroupId, Plan, StageId};

use crate::error::{ExecError, Result};

/// The replica group of stage `s` that `device` belongs to under the plan's sharding, with
/// its position in it and its size; None when the stage is not sharded on that device. The
/// group is the devices at the device's tensor-parallel position in every replica of the
/// stage (the replicas' leaders without tensor parallelism).
pub(crate) fn shard_group(plan: &Plan, s: StageId, device: pipec_plan::DeviceId) -> Option<(GroupId, usize, usize)> {
    if plan.schedule.sharding == Sharding::None {
        return None;
    }
    let stage = plan.stages.get(s.0 as usize)?;
    let members: Vec<pipec_plan::DeviceId> = if stage.tensor_parallel.is_empty() {
        stage.replicas.clone()
    } else {
        let t = stage.tensor_parallel.iter().find_map(|g| g.iter().position(|d| *d == device))?;
        stage.tensor_parallel.iter().filter_map(|g| g.get(t).copied()).collect()
    };
    let rank = members.iter().position(|d| *d == device)?;
    if members.len() < 2 {
        return None;
    }
    let group = plan.groups.iter().find(|g| g.tie.is_none() && g.stage == s && g.devices == members)?;
    Some((group.id, rank, members.len()))
}

/// The devices of the plan's group `group`.
pub(crate) fn members(plan: &Plan, group: GroupId) -> Result<Vec<DeviceId>> {
    plan.groups
        .iter()
        .find(|g| g.id == group)
        .map(|g| g.devices.clone())
        .ok_or_else(|| ExecError::Plan(format!("the plan has no {group}")))
}
