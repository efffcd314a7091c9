//! Lowering a compute order to instruction streams: one pass inserts every load, send,
//! receive, all-reduce, weight stash/restore, free and optimizer step.
//!
//! Receives are placed right before the compute that consumes them. Sends are placed after
//! the compute that produces them, in the order the peer receives them: a link carries
//! messages in exactly its receiver's order (in-order matching, as NCCL and MPI do), and a
//! send is delayed only until the messages the peer needs earlier are ready.

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use pipec_plan::vocab::Sharding;
use pipec_plan::{CollectivePayload, DeviceId, GroupId, Instr, MessageId, MicrobatchId, Payload, StageId};

use crate::schedule::{paired_backward, Order, Placement, Task, TaskKind};

pub use pipec_plan::schedule::Updates;

/// What lowering needs besides the order.
#[derive(Debug, Clone)]
pub struct LowerInput<'a> {
    pub placement: &'a Placement,
    pub order: &'a Order,
    /// Output bytes per microbatch of each stage (the activation sent to the next stage,
    /// and the size of the gradient coming back).
    pub output_bytes: &'a [u64],
    /// Parameter-gradient bytes of each stage (what its all-reduce moves).
    pub gradient_bytes: &'a [u64],
    /// Weight bytes of each stage (what ZeRO's weight all-gather moves).
    pub weight_bytes: &'a [u64],
    /// ZeRO: what each replicated stage's replicas shard (a schedule with one update per
    /// step; the front end refuses it elsewhere).
    pub sharding: Sharding,
    /// group[stage] = the stage's replica group, when it has more than one replica.
    pub groups: &'a [Option<GroupId>],
    pub updates: Updates,
    /// Per stage: whether its forwards keep only their input (activation recompute).
    pub recompute: &'a [bool],
    /// PipeDream's vertical sync: every stage runs a microbatch's forward on the weight
    /// version the first stage used for it (unreplicated pipelines).
    pub vertical_sync: bool,
    /// Overlap gradient all-reduces with compute: a stage's all-reduce starts right after
    /// its last gradient contribution and is waited for right before its optimizer step;
    /// under per-microbatch updates (PipeDream, 2BW) the wait and the update move to the
    /// stage's next backward, so the forwards in between run while the replicas reduce (on
    /// the weights before that update). Without it, every all-reduce is waited for at once.
    pub overlap: bool,
    /// The overlapped pairs (DualPipe's, or Megatron-LM's combined 1F1B's): a forward
    /// followed by a whole backward it pairs with receives the backward's gradient first, so
    /// that the pair starts with both its inputs in (`pipec_plan::schedule::overlapped_pair`).
    pub pairing: Option<pipec_plan::schedule::Pairing>,
}

/// Builds every device's stream: per device its receives, loads, compute and updates
/// ([`device_stream`]), then the sends, each in its link's receive order ([`place_sends`]).
pub fn lower(input: &LowerInput<'_>) -> BTreeMap<DeviceId, Vec<Instr>> {
    let version_of = first_stage_versions(input);
    let mut link_order: HashMap<(DeviceId, DeviceId), VecDeque<MessageId>> = HashMap::default();
    let streams: Vec<Vec<Instr>> = input
        .order
        .iter()
        .enumerate()
        .map(|(d, tasks)| device_stream(input, DeviceId(d as u32), tasks, &version_of, &mut link_order))
        .collect();
    place_sends(input, streams, &link_order)
}

/// Vertical sync: the version stage 0 used for each microbatch = the updates (one per
/// backward) it had applied when the microbatch's forward started.
fn first_stage_versions(input: &LowerInput<'_>) -> HashMap<usize, u32> {
    let p = input.placement;
    let mut version_of: HashMap<usize, u32> = HashMap::default();
    if input.vertical_sync {
        let first = p.device_of(0, 0).0 as usize;
        let mut updates = 0u32;
        for t in &input.order[first] {
            match t.kind {
                TaskKind::Forward if t.stage.0 == 0 => {
                    version_of.insert(t.mb.0 as usize, updates);
                }
                TaskKind::Backward if t.stage.0 == 0 => updates += 1,
                _ => {}
            }
        }
    }

    version_of
}

/// One device's receives, loads, compute, stashes, frees and updates, in its order; the
/// messages it receives are appended to their link's receive order.
fn device_stream(
    input: &LowerInput<'_>,
    dev: DeviceId,
    tasks: &[Task],
    version_of: &HashMap<usize, u32>,
    link_order: &mut HashMap<(DeviceId, DeviceId), VecDeque<MessageId>>,
) -> Vec<Instr> {
    let p = input.placement;
    let last = p.stages() - 1;
    let st = |s: usize| StageId(s as u32);
    let mbid = |m: usize| MicrobatchId(m as u32);
    let mut owned: Vec<Instr> = Vec::new();
    let stream = &mut owned;
    let mut local_backwards: HashMap<usize, usize> = HashMap::default();
    // per stage: the stream position right after its latest gradient contribution
    let mut last_contribution: BTreeMap<usize, usize> = BTreeMap::new();
    // per stage: an update whose all-reduce is in flight (overlap with per-microbatch updates)
    let mut deferred: BTreeMap<usize, GroupId> = BTreeMap::new();
    let defer = input.overlap && !input.vertical_sync;
    // ZeRO stages 2 and 3: per stage, a reduce-scatter of a contribution still in flight
    let mut scattering: BTreeMap<usize, GroupId> = BTreeMap::new();
    // the gradient a pair's backward receives before its forward (`overlapped_pairs`)
    let mut received_early: Option<(usize, usize)> = None;
    type Links = HashMap<(DeviceId, DeviceId), VecDeque<MessageId>>;
    let recv_gradient = |stream: &mut Vec<Instr>, link_order: &mut Links, s: usize, m: usize| {
        if s < last {
            let peer = p.device_of(s + 1, m);
            stream.push(Instr::RecvGradient { peer, stage: st(s), mb: mbid(m), bytes: input.output_bytes[s] });
            link_order.entry((peer, dev)).or_default().push_back(MessageId::gradient(st(s + 1), mbid(m)));
        }
    };
    for (i, t) in tasks.iter().enumerate() {
        let (s, m) = (t.stage.0 as usize, t.mb.0 as usize);
        if matches!(t.kind, TaskKind::Backward | TaskKind::BackwardInput) {
            if let Some(group) = deferred.remove(&s) {
                update_after_reduce(stream, st(s), group);
            }
        }
        match t.kind {
            TaskKind::Forward => {
                if s == 0 || s == last {
                    stream.push(Instr::LoadMicrobatch { stage: st(s), mb: mbid(m), inputs: s == 0, labels: s == last });
                }
                if s > 0 {
                    let peer = p.device_of(s - 1, m);
                    stream.push(Instr::RecvActivation {
                        peer,
                        stage: st(s),
                        mb: mbid(m),
                        bytes: input.output_bytes[s - 1],
                    });
                    link_order.entry((peer, dev)).or_default().push_back(MessageId::activation(st(s - 1), mbid(m)));
                }
                // an overlapped pair's backward: its gradient too, before the pair starts
                let recomputed = |s: usize| input.recompute.get(s).copied().unwrap_or(false);
                let paired = input.pairing.and_then(|p| paired_backward(tasks, i, recomputed, p));
                if let Some(b) = paired {
                    let (bs, bm) = (b.stage.0 as usize, b.mb.0 as usize);
                    recv_gradient(stream, link_order, bs, bm);
                    received_early = Some((bs, bm));
                }
                if input.updates != Updates::PerStep {
                    stream.push(Instr::StashWeights {
                        stage: st(s),
                        mb: mbid(m),
                        version: version_of.get(&m).copied(),
                    });
                }
                stream.push(Instr::Forward { stage: st(s), mb: mbid(m) });
            }
            TaskKind::Backward | TaskKind::BackwardInput => {
                if received_early.take() != Some((s, m)) {
                    recv_gradient(stream, link_order, s, m);
                }
                if input.recompute.get(s).copied().unwrap_or(false) {
                    stream.push(Instr::Recompute { stage: st(s), mb: mbid(m) });
                }
                if t.kind == TaskKind::Backward {
                    if input.updates != Updates::PerStep {
                        stream.push(Instr::RestoreWeights { stage: st(s), mb: mbid(m) });
                    }
                    stream.push(Instr::Backward { stage: st(s), mb: mbid(m) });
                    stream.push(Instr::Free { stage: st(s), mb: mbid(m) });
                    scatter_contribution(input, stream, s, &mut scattering);
                    last_contribution.insert(s, stream.len());
                    let count = local_backwards.entry(s).or_insert(0);
                    *count += 1;
                    let update_now = match input.updates {
                        Updates::PerStep => false,
                        Updates::PerMicrobatch => true,
                        Updates::Every(k) => {
                            (*count).is_multiple_of(k.max(1)) || *count == p.local_microbatches(s, dev).len()
                        }
                    };
                    if update_now {
                        match input.groups[s] {
                            Some(group) => {
                                stream.push(Instr::all_reduce_gradients(st(s), group, input.gradient_bytes[s]));
                                if defer {
                                    deferred.insert(s, group);
                                } else {
                                    update_after_reduce(stream, st(s), group);
                                }
                            }
                            None => stream.push(Instr::OptimizerStep { stage: st(s) }),
                        }
                    }
                } else {
                    stream.push(Instr::BackwardInput { stage: st(s), mb: mbid(m) });
                }
            }
            TaskKind::BackwardWeight => {
                stream.push(Instr::BackwardWeight { stage: st(s), mb: mbid(m) });
                stream.push(Instr::Free { stage: st(s), mb: mbid(m) });
                scatter_contribution(input, stream, s, &mut scattering);
                last_contribution.insert(s, stream.len());
            }
        }
    }
    for (s, group) in deferred {
        update_after_reduce(stream, st(s), group);
    }
    if input.updates == Updates::PerStep {
        per_step_updates(input, dev, stream, &last_contribution, &mut scattering);
    }
    owned
}

/// The end of a device's stream under one update per step: each held stage's gradient
/// reduction (started after its last contribution with overlap), its optimizer step or
/// ZeRO shard step, and the gathers of updated weights (ZeRO-1/2).
fn per_step_updates(
    input: &LowerInput<'_>,
    dev: DeviceId,
    stream: &mut Vec<Instr>,
    last_contribution: &BTreeMap<usize, usize>,
    scattering: &mut BTreeMap<usize, GroupId>,
) {
    let p = input.placement;
    let st = |s: usize| StageId(s as u32);
    // With overlap, each replicated stage's all-reduce (ZeRO-1: reduce-scatter) starts
    // right after its last gradient contribution (later positions first, so earlier
    // ones stay valid); the waits and optimizer steps follow at the end, in stage order
    // on every device. ZeRO-2 and 3 reduce-scattered every contribution already.
    let held = p.stages_of(dev);
    let whole = input.sharding.level() < 2;
    let reduce =
        if input.sharding == Sharding::None { CollectivePayload::Gradients } else { CollectivePayload::GradientShard };
    if input.overlap && whole {
        let mut starts: Vec<(usize, usize, GroupId)> = held
            .iter()
            .filter_map(|&s| {
                let at = last_contribution.get(&s).copied().unwrap_or(stream.len());
                input.groups[s].map(|group| (at, s, group))
            })
            .collect();
        starts.sort_by(|a, b| b.cmp(a));
        for (at, s, group) in starts {
            stream.insert(at, Instr::collective(reduce, st(s), group, input.gradient_bytes[s]));
        }
    }
    let mut gathers = Vec::new();
    for s in held {
        match input.groups[s] {
            Some(group) if input.sharding != Sharding::None => {
                if whole && !input.overlap {
                    stream.push(Instr::collective(reduce, st(s), group, input.gradient_bytes[s]));
                }
                if whole || scattering.remove(&s).is_some() {
                    stream.push(Instr::wait(reduce, st(s), group));
                }
                stream.push(Instr::ShardStep { stage: st(s) });
                // stages 1 and 2 gather the updated weights; their waits come last, so
                // each gather overlaps the device's other updates
                if input.sharding.level() < 3 {
                    stream.push(Instr::collective(CollectivePayload::Weights, st(s), group, input.weight_bytes[s]));
                    gathers.push((s, group));
                }
            }
            Some(group) => {
                if !input.overlap {
                    stream.push(Instr::all_reduce_gradients(st(s), group, input.gradient_bytes[s]));
                }
                stream.push(Instr::wait(CollectivePayload::Gradients, st(s), group));
                stream.push(Instr::OptimizerStep { stage: st(s) });
            }
            None => stream.push(Instr::OptimizerStep { stage: st(s) }),
        }
    }
    for (s, group) in gathers {
        stream.push(Instr::wait(CollectivePayload::Weights, st(s), group));
    }
}

/// ZeRO stages 2 and 3 keep only a gradient shard: every gradient contribution of a
/// replicated stage is reduce-scattered at once (the previous one's wait first, so one is
/// in flight per stage; with `overlap` the wait is put off until then, otherwise it follows
/// the start).
fn scatter_contribution(
    input: &LowerInput<'_>,
    stream: &mut Vec<Instr>,
    s: usize,
    in_flight: &mut BTreeMap<usize, GroupId>,
) {
    let Some(group) = input.groups[s] else { return };
    if input.sharding.level() < 2 || input.updates != Updates::PerStep {
        return;
    }
    let stage = StageId(s as u32);
    if let Some(g) = in_flight.remove(&s) {
        stream.push(Instr::wait(CollectivePayload::GradientShard, stage, g));
    }
    stream.push(Instr::collective(CollectivePayload::GradientShard, stage, group, input.gradient_bytes[s]));
    if input.overlap {
        in_flight.insert(s, group);
    } else {
        stream.push(Instr::wait(CollectivePayload::GradientShard, stage, group));
    }
}

/// Inserts every send right after the compute that produces its message, each link's in
/// the order its receiver takes them.
fn place_sends(
    input: &LowerInput<'_>,
    streams: Vec<Vec<Instr>>,
    link_order: &HashMap<(DeviceId, DeviceId), VecDeque<MessageId>>,
) -> BTreeMap<DeviceId, Vec<Instr>> {
    let last = input.placement.stages() - 1;
    let mut out: BTreeMap<DeviceId, Vec<Instr>> = BTreeMap::new();
    for (d, stream) in streams.into_iter().enumerate() {
        let dev = DeviceId(d as u32);
        let mut links: Vec<(DeviceId, VecDeque<MessageId>)> =
            link_order.iter().filter(|((from, _), _)| *from == dev).map(|((_, to), q)| (*to, q.clone())).collect();
        links.sort_by_key(|(to, _)| *to);
        let mut ready: HashSet<MessageId> = HashSet::default();
        let mut with_sends = Vec::with_capacity(stream.len() * 2);
        for ins in stream {
            let produced = match ins {
                Instr::Forward { stage, mb } if (stage.0 as usize) < last => Some(MessageId::activation(stage, mb)),
                Instr::Backward { stage, mb } | Instr::BackwardInput { stage, mb } if stage.0 > 0 => {
                    Some(MessageId::gradient(stage, mb))
                }
                _ => None,
            };
            with_sends.push(ins);
            if let Some(msg) = produced {
                ready.insert(msg);
                for (to, queue) in links.iter_mut() {
                    while let Some(front) = queue.front().copied() {
                        if !ready.contains(&front) {
                            break;
                        }
                        queue.pop_front();
                        // an activation is the sending stage's output; a gradient the size of
                        // the previous stage's output
                        let s = front.stage.0 as usize;
                        let bytes = match front.payload {
                            Payload::Activation => input.output_bytes[s],
                            _ => input.output_bytes[s.saturating_sub(1)],
                        };
                        with_sends.push(Instr::send(front, *to, bytes));
                    }
                }
            }
        }
        out.insert(dev, with_sends);
    }
    out
}

/// The update of a replicated stage once its all-reduce is in: wait for it, then step.
fn update_after_reduce(stream: &mut Vec<Instr>, stage: StageId, group: GroupId) {
    stream.push(Instr::wait(CollectivePayload::Gradients, stage, group));
    stream.push(Instr::OptimizerStep { stage });
}

/// Asynchronous data parallelism (`dp-only` with `sync: asp`) with a parameter server on
/// the stage's first replica. Every worker runs forward and backward on its microbatches
/// and pushes each microbatch's gradient to the server; the server applies the gradients in
/// a fixed round-robin order (round j: every worker's j-th gradient, its own first), one
/// update each; after every `staleness + 1` rounds, and at the end of the step, it pushes
/// its weights to every other worker, which pulls them after the same number of its own
/// microbatches. A worker therefore computes with weights at most
/// `(staleness + 1) × workers − 1` updates old; the server's own worker uses the newest.
pub fn lower_asp(p: &Placement, gradient_bytes: u64, staleness: usize) -> BTreeMap<DeviceId, Vec<Instr>> {
    let stage = StageId(0);
    let workers = p.replicas[0].clone();
    let server = workers[0];
    let every = staleness + 1;
    let local: Vec<Vec<usize>> = workers.iter().map(|w| p.local_microbatches(0, *w)).collect();
    let n_local = local.iter().map(Vec::len).max().unwrap_or(0);
    let mut out: BTreeMap<DeviceId, Vec<Instr>> = (0..p.devices).map(|d| (DeviceId(d as u32), Vec::new())).collect();
    let rounds_end = |j: usize| (j + 1).is_multiple_of(every) || j + 1 == n_local;
    let mut round = 0u32;
    for j in 0..n_local {
        for (wi, w) in workers.iter().enumerate() {
            let Some(&m) = local[wi].get(j) else { continue };
            let mb = MicrobatchId(m as u32);
            let s = out.get_mut(w).expect("device");
            s.push(Instr::LoadMicrobatch { stage, mb, inputs: true, labels: true });
            s.push(Instr::Forward { stage, mb });
            s.push(Instr::Backward { stage, mb });
            s.push(Instr::Free { stage, mb });
            s.push(Instr::PushGradient { peer: server, stage, mb, bytes: gradient_bytes });
        }
        let ps = out.get_mut(&server).expect("server");
        for (wi, w) in workers.iter().enumerate() {
            if let Some(&m) = local[wi].get(j) {
                ps.push(Instr::ApplyGradient { peer: *w, stage, mb: MicrobatchId(m as u32), bytes: gradient_bytes });
            }
        }
        if rounds_end(j) {
            for w in workers.iter().skip(1) {
                out.get_mut(&server).expect("server").push(Instr::PushWeights {
                    peer: *w,
                    stage,
                    round,
                    bytes: gradient_bytes,
                });
                out.get_mut(w).expect("worker").push(Instr::PullWeights {
                    peer: server,
                    stage,
                    round,
                    bytes: gradient_bytes,
                });
            }
            round += 1;
        }
    }
    out
}

/// The compute tasks of a stream, in order (the inverse of lowering, for tests and exports).
pub fn compute_order(stream: &[Instr]) -> Vec<Task> {
    stream
        .iter()
        .filter_map(|i| {
            let kind = match i {
                Instr::Forward { .. } => TaskKind::Forward,
                Instr::Backward { .. } => TaskKind::Backward,
                Instr::BackwardInput { .. } => TaskKind::BackwardInput,
                Instr::BackwardWeight { .. } => TaskKind::BackwardWeight,
                _ => return None,
            };
            Some(Task { kind, stage: i.stage(), mb: i.microbatch()? })
        })
        .collect()
}
