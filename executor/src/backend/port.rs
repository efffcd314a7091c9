//! The port through which a pass reaches its peers: a device's group for a stage
//! ([`PeerGroup`]: expert parallelism's members, context parallelism's) and what a pass
//! asks of it — an exchange of rows ([`move_rows`], the all-to-all of expert
//! parallelism and its reverse in the backward), an all-gather of host values, a ring
//! pass (`crate::backend::ring`). Every exchange a pass makes is recorded
//! ([`PeerGroup::made`]) so the interpreter can hold it against the plan's instructions.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use pipec_plan::plan::StagePlan;
use pipec_plan::{DeviceId, PassOp, PeerDim, Plan, StageId, TokenExchange};

use crate::comm::exchanger::Exchanger;
use crate::error::{ExecError, Result};

/// A tensor's values on the host as f32 (what crosses a stage boundary or a collective).
pub(crate) fn host_f32(data: TensorData) -> Result<Vec<f32>> {
    data.convert::<f32>().into_vec::<f32>().map_err(|e| ExecError::Backend(format!("cannot read a tensor back: {e:?}")))
}

/// A device's group of peers for a stage (expert or context parallelism), and how to reach it.
#[derive(Clone, Debug)]
pub struct PeerGroup {
    pub members: Vec<DeviceId>,
    /// Which of the stage's groups it is (expert or context parallelism's): what the
    /// exchanges it makes inside passes are recorded over.
    pub over: PeerDim,
    /// This device's position: it computes experts `position · E/ep ..` of each block.
    pub position: usize,
    pub exchanger: Exchanger,
    /// The first exchange that failed inside a backward (which cannot return an error);
    /// the worker reports it after the backward.
    pub failed: Arc<Mutex<Option<ExecError>>>,
    /// Whether the exchanges are recorded for a backward (training). Validation's forwards
    /// exchange detached rows: a recorded exchange keeps its reverse (and the way to the
    /// group's collective thread) in a graph no backward consumes.
    pub tracked: bool,
    /// The all-to-alls the passes made, oldest first, until the plan's `AllToAll`
    /// instructions after each pass account for them ([`PeerGroup::account`]).
    pub made: Arc<Mutex<VecDeque<Made>>>,
}

/// An all-to-all a pass made: at its expert block `layer`, `exchange`, from `started` to
/// `ended` (what the run's trace shows for the plan's instruction).
#[derive(Clone, Copy, Debug)]
pub struct Made {
    pub layer: u32,
    pub exchange: TokenExchange,
    pub started: Instant,
    pub ended: Instant,
}

impl PeerGroup {
    /// The group of `device` for `stage` of `plan`, if the stage is expert-parallel: the
    /// replicas `ChunkPlacement::expert_group` puts it with (their tensor-parallel ranks of
    /// the same rank; with whole experts, `etp: 1`, every rank of them, replica by replica,
    /// this device at its replica's position times the ranks plus its rank).
    pub fn of(plan: &Plan, stage: StageId, device: DeviceId, exchanger: &Exchanger) -> Option<PeerGroup> {
        let s = plan.stage(stage)?;
        let ep = s.expert_parallel as usize;
        let mut group = PeerGroup::sized(plan, stage, device, exchanger, ep, PeerDim::Expert)?;
        let (i, rank) = replica_of(s, device)?;
        let ranks = expert_ranks(plan, s, i);
        if ranks > 1 {
            let (replicas, position) = plan.schedule.kind.chunk_placement().expert_group(i, ep);
            group.members = replicas
                .into_iter()
                .flat_map(|j| (0..ranks).map(move |r| (j, r)))
                .map(|(j, r)| device_at(s, j, r))
                .collect::<Option<_>>()?;
            group.position = position * ranks + rank;
        }
        Some(group)
    }

    /// The group of `size` replicas of `stage` that `device` is one of (None for a size of
    /// 1): the replicas `ChunkPlacement::expert_group` puts it with, their tensor-parallel
    /// ranks of the same rank (context parallelism's groups too, `crate::nn::context`).
    pub fn sized(
        plan: &Plan,
        stage: StageId,
        device: DeviceId,
        exchanger: &Exchanger,
        size: usize,
        over: PeerDim,
    ) -> Option<PeerGroup> {
        let s = plan.stage(stage)?;
        if size <= 1 {
            return None;
        }
        let (i, rank) = replica_of(s, device)?;
        let (group, position) = plan.schedule.kind.chunk_placement().expert_group(i, size);
        let members: Vec<DeviceId> = group.into_iter().map(|j| device_at(s, j, rank)).collect::<Option<_>>()?;
        Some(PeerGroup {
            members,
            over,
            position,
            exchanger: exchanger.clone(),
            failed: Default::default(),
            tracked: true,
            made: Default::default(),
        })
    }

    /// Every member's `values`, member after member (host values: context parallelism's
    /// routing counts, the ring's keys and values).
    pub fn all_gather(&self, values: Vec<f32>) -> Result<Vec<Vec<f32>>, crate::comm::transport::TransportError> {
        self.exchange(PassOp::AllGather, vec![values; self.members.len()])
    }

    /// Sends `chunks[j]` to member j and returns what each member sent this one: inside a
    /// pass, recorded as `op` over the group (the interpreter holds it against the plan's
    /// declaration of the pass).
    pub fn exchange(
        &self,
        op: PassOp,
        chunks: Vec<Vec<f32>>,
    ) -> Result<Vec<Vec<f32>>, crate::comm::transport::TransportError> {
        self.start(op, chunks)?.wait()
    }

    /// [`PeerGroup::exchange`] started on the collective thread.
    pub fn start(
        &self,
        op: PassOp,
        chunks: Vec<Vec<f32>>,
    ) -> Result<crate::comm::exchanger::Ticket<Vec<Vec<f32>>>, crate::comm::transport::TransportError> {
        self.exchanger.ledger().record(op, self.over, &self.members);
        self.exchanger.start(&self.members, chunks)
    }

    /// Checks the plan's all-to-all `ins` — `exchange` at `layer` — against the next one a
    /// pass made (the plan lists, after each pass, the all-to-alls it posts, in order), and
    /// returns that one.
    pub fn account(&self, ins: &pipec_plan::Instr, layer: u32, exchange: TokenExchange) -> Result<Made, String> {
        let made = self.made.lock().map_err(|_| "the expert group's record was poisoned".to_string())?.pop_front();
        match made {
            Some(m) if (m.layer, m.exchange) == (layer, exchange) => Ok(m),
            Some(m) => Err(format!(
                "the plan's `{ins}` is not the all-to-all its pass made next ({} at layer {})",
                m.exchange, m.layer
            )),
            None => Err(format!("the plan's `{ins}` is not an all-to-all its pass made (it made no more)")),
        }
    }

    /// The all-to-alls passes made that no `AllToAll` of the plan accounted for.
    pub fn unaccounted(&self) -> Vec<Made> {
        self.made.lock().map(|mut m| m.drain(..).collect()).unwrap_or_default()
    }

    /// Takes the failure an exchange inside a backward recorded, if any.
    pub fn take_failure(&self) -> Option<ExecError> {
        self.failed.lock().ok().and_then(|mut f| f.take())
    }
}

/// `device`'s replica of stage `s` (its index among the replicas) and its tensor-parallel
/// rank there (0 without tensor parallelism).
pub(crate) fn replica_of(s: &StagePlan, device: DeviceId) -> Option<(usize, usize)> {
    match s.replicas.iter().position(|d| *d == device) {
        Some(i) => Some((i, 0)),
        None => {
            s.tensor_parallel.iter().enumerate().find_map(|(i, g)| g.iter().position(|d| *d == device).map(|r| (i, r)))
        }
    }
}

/// The tensor-parallel ranks replica `i` of stage `s` brings to its expert group: all of
/// them with whole experts (`etp: 1`), else one (the group's members share a rank).
pub(crate) fn expert_ranks(plan: &Plan, s: &StagePlan, i: usize) -> usize {
    let tp = s.tensor_parallel.get(i).map_or(1, Vec::len);
    if plan.schedule.whole_experts && tp > 1 {
        tp
    } else {
        1
    }
}

/// The device of stage `s`'s replica `j` at tensor-parallel rank `rank`.
pub(crate) fn device_at(s: &StagePlan, j: usize, rank: usize) -> Option<DeviceId> {
    s.tensor_parallel.get(j).and_then(|g| g.get(rank)).copied().or(s.replicas.get(j).copied())
}

/// One exchange of rows: this member sends `send[j]` rows to member j and receives
/// `recv[i]` rows from member i (its gradient travels the other way). `what`: the plan's
/// name for it (an expert block's layer and exchange), recorded in the group when it is
/// made; None for context parallelism's gathers, which are not the plan's all-to-alls.
#[derive(Clone, Debug)]
pub struct Exchange {
    pub group: PeerGroup,
    pub send: Vec<usize>,
    pub recv: Vec<usize>,
    pub what: Option<(u32, TokenExchange)>,
    /// What the exchange does for the group: expert parallelism's all-to-all, context
    /// parallelism's gather (whose gradient is reduce-scattered back).
    pub op: PassOp,
}

impl Exchange {
    /// The same exchange the other way: its gradient's.
    pub fn reversed(&self) -> Exchange {
        Exchange {
            group: self.group.clone(),
            send: self.recv.clone(),
            recv: self.send.clone(),
            what: self.what.map(|(layer, e)| (layer, e.reversed())),
            op: match self.op {
                PassOp::AllGather => PassOp::ReduceScatter,
                PassOp::ReduceScatter => PassOp::AllGather,
                op @ (PassOp::AllReduce | PassOp::AllToAll | PassOp::RingPass) => op,
            },
        }
    }
}

/// An exchange with a group that brought what the members do not agree on (the wrong
/// number of values, other experts).
pub(crate) fn mismatch(what: String) -> ExecError {
    ExecError::Transport(crate::comm::transport::TransportError::Other(what))
}

/// Moves the rows of `x` ([rows, d], member-major as `ex.send` counts them) to their
/// members, returning the rows received, member-major as `ex.recv` counts them.
pub fn move_rows<B: Backend>(x: Tensor<B, 2>, ex: &Exchange) -> Result<Tensor<B, 2>> {
    let [rows, d] = x.dims();
    if rows != ex.send.iter().sum::<usize>() {
        return Err(ExecError::Plan(format!("an expert exchange of {rows} rows was told to send {:?}", ex.send)));
    }
    let device = x.device();
    let values = host_f32(x.into_data())?;
    let mut chunks = Vec::with_capacity(ex.send.len());
    let mut at = 0;
    for &n in &ex.send {
        chunks.push(values[at * d..(at + n) * d].to_vec());
        at += n;
    }
    let started = Instant::now();
    let got = ex.group.exchange(ex.op, chunks)?;
    let ended = Instant::now();
    for (i, (chunk, &n)) in got.iter().zip(&ex.recv).enumerate() {
        if chunk.len() != n * d {
            return Err(mismatch(format!(
                "member {} of the expert group sent {} values, {} rows of {d} were expected",
                ex.group.members[i],
                chunk.len(),
                n
            )));
        }
    }
    if let (Some((layer, exchange)), Ok(mut made)) = (ex.what, ex.group.made.lock()) {
        made.push_back(Made { layer, exchange, started, ended });
    }
    let n: usize = ex.recv.iter().sum();
    Ok(Tensor::from_data(TensorData::new(got.concat(), [n, d]), &device))
}
