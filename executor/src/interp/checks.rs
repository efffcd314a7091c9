//! The interpreter's debug checks of a pass (on in debug builds and so in every test): the
//! tensors it left are on the worker's device, and the collectives it issued inside itself
//! are those the plan declares for it (`pipec_plan::in_pass`; first ZeRO-3's gathers of
//! whole weights declared at its position), in order, over the same members.

use crate::backend::kernels::ExecBackend;
use crate::error::{ExecError, Result};
use crate::interp::worker::Worker;
use pipec_plan::{Instr, PassOp, PeerDim};

impl<B: ExecBackend> Worker<'_, B> {
    /// Debug builds: every tensor a pass left for its microbatch (its stage's input, what
    /// its backward starts from, the weights) and the stage's weights are on this worker's
    /// device. A tensor of another device reaching a kernel is no error on CubeCL (it reads
    /// whatever the other client's buffer index holds here), so a mix-up is found here,
    /// at the pass that made it, not as wrong numbers steps later.
    pub(super) fn check_on_device(&self, ins: &Instr) -> Result<()> {
        let stage = ins.stage();
        let mut found: Vec<B::Device> = Vec::new();
        if let Some(mb) = ins.microbatch() {
            found.extend(self.passes.inputs.get(&(stage, mb)).map(|a| a.devices()).unwrap_or_default());
            found.extend(self.passes.saved.get(&(stage, mb)).map(|k| k.devices()).unwrap_or_default());
        }
        if let Some(model) = self.stages.get(&stage).and_then(|s| s.model.as_ref()) {
            found.extend(burn::module::Module::devices(model));
        }
        match found.into_iter().find(|d| *d != self.dev) {
            Some(other) => Err(ExecError::Backend(format!(
                "`{ins}` left a tensor on {other:?}, not on this worker's device {:?}",
                self.dev
            ))),
            None => Ok(()),
        }
    }

    /// `issued` (what `ins`, a pass of `kind` at position `at` of the step, issued inside
    /// itself) against what the plan declares for it — the list of a pass feeding its
    /// stage's bucketed reduction where it is one.
    pub(super) fn check_declared(
        &mut self,
        ins: &Instr,
        (kind, at): (pipec_plan::in_pass::PassKind, usize),
        issued: &[crate::comm::exchanger::Issued],
    ) -> Result<()> {
        let stage = ins.stage();
        let reduces = self.transfers.bucketed.get(&at).copied();
        let declared = self.plan.in_pass.of(self.device, stage, kind, reduces.is_some());
        let mut want = Vec::with_capacity(declared.len());
        // ZeRO-3's gathers of whole weights the pass starts first (its stage's, then ahead)
        for t in self.zero3.declared.get(&at).into_iter().flatten() {
            let shard = self.stages.get(t).and_then(|s| s.shard.as_ref()).ok_or(ExecError::Missing("its shard"))?;
            let members = crate::parallel::groups::members(self.plan, shard.group)?;
            want.push(crate::comm::exchanger::Issued { op: PassOp::AllGather, over: PeerDim::Shard, members });
        }
        for e in declared {
            let members = match e.over {
                pipec_plan::PeerDim::Tensor => self.state(stage)?.tp.as_ref().map(|t| t.members.clone()),
                pipec_plan::PeerDim::Context => self.groups.contexts.get(&stage).map(|c| c.group.members.clone()),
                pipec_plan::PeerDim::Expert => self.groups.experts.get(&stage).map(|g| g.members.clone()),
                pipec_plan::PeerDim::Shard => match self.stages.get(&stage).and_then(|s| s.shard.as_ref()) {
                    Some(shard) => Some(crate::parallel::groups::members(self.plan, shard.group)?),
                    None => None,
                },
                pipec_plan::PeerDim::Data => match reduces {
                    Some(group) => Some(crate::parallel::groups::members(self.plan, group)?),
                    None => None,
                },
            };
            let members = members.ok_or_else(|| {
                ExecError::Plan(format!(
                    "`{ins}`: the plan declares {e}, but this device is in no such group of {stage}"
                ))
            })?;
            want.push(crate::comm::exchanger::Issued { op: e.op, over: e.over, members });
        }
        if want.as_slice() == issued {
            return Ok(());
        }
        let say = |l: &[crate::comm::exchanger::Issued]| {
            let parts: Vec<String> = l.iter().map(|i| format!("{} {}", i.over, i.op)).collect();
            if parts.is_empty() {
                "nothing".to_string()
            } else {
                parts.join(", ")
            }
        };
        Err(ExecError::Plan(format!(
            "`{ins}` issued {} inside the pass, where the plan declares {}",
            say(issued),
            say(&want)
        )))
    }
}
