//! Discrete-event simulation of instruction streams.
//!
//! Semantics (the executor's): compute runs one instruction at a time per device; a send is
//! asynchronous (the sender goes on; the message arrives after α + n·β on the link level);
//! a receive blocks until its message has arrived, and must match the first message not yet
//! received on its link (in-order matching); an all-reduce blocks until every member of its
//! group has reached its matching call, then takes the ring (or parameter-server) time on
//! every member. The same engine, with unit costs, is the verifier's deadlock check.

use std::collections::{BTreeMap, HashMap, VecDeque};

use pipec_plan::{DeviceId, GroupId, Instr, MessageId, Phase};

/// How long things take.
pub trait CostModel {
    /// Seconds of a compute-like instruction on `device`.
    fn compute(&self, device: DeviceId, instr: &Instr) -> f64;
    /// Seconds for `bytes` from `from` to `to`.
    fn transfer(&self, from: DeviceId, to: DeviceId, bytes: u64) -> f64;
    /// Seconds of an all-reduce of `bytes` over `members`.
    fn all_reduce(&self, members: &[DeviceId], bytes: u64) -> f64;
}

/// One executed instruction.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub device: DeviceId,
    pub index: usize,
    pub start: f64,
    pub end: f64,
    pub phase: Phase,
}

/// Where execution got stuck.
#[derive(Debug, Clone, PartialEq)]
pub struct Stuck {
    /// For every device: the index of the next instruction (None when finished).
    pub next: BTreeMap<DeviceId, Option<usize>>,
    pub reason: String,
}

/// A finished simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    pub events: Vec<Event>,
    pub step_time: f64,
}

/// Message identity on a link: kind, stage, microbatch.
/// What a link carries, as both ends name it (None: a receive nothing can match).
fn message_key(i: &Instr) -> Option<(MessageId, u64)> {
    i.transfer().and_then(|t| t.id.map(|id| (id, t.bytes)))
}

/// A message on a link: (what, bytes), send time, arrival time.
type InFlight = ((MessageId, u64), f64, f64);
/// A member's arrival at a collective: (device, time, bytes, stage).
type Arrival = (DeviceId, f64, u64, u32);

/// Runs the streams. `groups` maps a group id to its members.
pub fn simulate(
    streams: &BTreeMap<DeviceId, Vec<Instr>>,
    groups: &HashMap<GroupId, Vec<DeviceId>>,
    cost: &dyn CostModel,
) -> Result<Timeline, Stuck> {
    let devices: Vec<DeviceId> = streams.keys().copied().collect();
    let mut pc: HashMap<DeviceId, usize> = devices.iter().map(|d| (*d, 0)).collect();
    let mut clock: HashMap<DeviceId, f64> = devices.iter().map(|d| (*d, 0.0)).collect();
    // messages in flight per link, in send order: (key, send time, arrival time)
    let mut links: HashMap<(DeviceId, DeviceId), VecDeque<InFlight>> = HashMap::new();
    // collectives: per group, the k-th call's arrivals
    let mut calls_made: HashMap<(GroupId, DeviceId), usize> = HashMap::new();
    let mut waiting: HashMap<(GroupId, usize), Vec<Arrival>> = HashMap::new();
    let mut events = Vec::new();
    let mut queue: VecDeque<DeviceId> = devices.iter().copied().collect();
    let mut queued: HashMap<DeviceId, bool> = devices.iter().map(|d| (*d, true)).collect();
    let mut error: Option<String> = None;

    while let Some(dev) = queue.pop_front() {
        queued.insert(dev, false);
        let stream = &streams[&dev];
        loop {
            let i = pc[&dev];
            let Some(ins) = stream.get(i) else { break };
            let now = clock[&dev];
            match ins {
                Instr::SendActivation { peer, bytes, .. }
                | Instr::SendGradient { peer, bytes, .. }
                | Instr::PushGradient { peer, bytes, .. }
                | Instr::PushWeights { peer, bytes, .. } => {
                    let arrival = now + cost.transfer(dev, *peer, *bytes);
                    if let Some(key) = message_key(ins) {
                        links.entry((dev, *peer)).or_default().push_back((key, now, arrival));
                    }
                    events.push(Event { device: dev, index: i, start: now, end: now, phase: Phase::Communication });
                    if !queued.get(peer).copied().unwrap_or(true) {
                        queued.insert(*peer, true);
                        queue.push_back(*peer);
                    }
                }
                Instr::RecvActivation { peer, .. }
                | Instr::RecvGradient { peer, .. }
                | Instr::ApplyGradient { peer, .. }
                | Instr::PullWeights { peer, .. } => {
                    let want = message_key(ins);
                    let q = links.entry((*peer, dev)).or_default();
                    match q.front() {
                        None => break, // blocked: woken by the peer's next send
                        Some((key, sent, arrival)) => {
                            if Some(*key) != want {
                                error = Some(format!("{dev} receives `{ins}` but the next message from {peer} is a different one (out-of-order matching)"));
                                break;
                            }
                            // Only the transfer itself is communication; waiting for the peer
                            // to produce the message is idle time (bubble).
                            let done = now.max(*arrival);
                            let start = now.max(*sent);
                            q.pop_front();
                            events.push(Event {
                                device: dev,
                                index: i,
                                start: start.min(done),
                                end: done,
                                phase: Phase::Communication,
                            });
                            clock.insert(dev, done);
                        }
                    }
                }
                // a tied all-reduce's members hold different stages; a replica group's, one
                Instr::AllReduce { group, bytes, stage } | Instr::TiedAllReduce { group, bytes, stage } => {
                    let stage = if matches!(ins, Instr::AllReduce { .. }) { stage.0 } else { u32::MAX };
                    let Some(members) = groups.get(group) else {
                        error = Some(format!("{dev}: `{ins}` names an unknown group"));
                        break;
                    };
                    let k = *calls_made.get(&(*group, dev)).unwrap_or(&0);
                    let arrivals = waiting.entry((*group, k)).or_default();
                    if !arrivals.iter().any(|a| a.0 == dev) {
                        arrivals.push((dev, now, *bytes, stage));
                    }
                    if arrivals.len() < members.len() {
                        break; // blocked until every member arrives; the last one releases all
                    }
                    if arrivals.iter().any(|a| a.2 != *bytes || a.3 != stage) {
                        error =
                            Some(format!("group {group}: the members' collective call #{k} disagree (stage or size)"));
                        break;
                    }
                    let start = arrivals.iter().map(|a| a.1).fold(0.0, f64::max);
                    let end = start + cost.all_reduce(members, *bytes);
                    for &(m, _, _, _) in arrivals.iter() {
                        let mi = if m == dev { i } else { pc[&m] };
                        events.push(Event { device: m, index: mi, start, end, phase: Phase::Collective });
                        clock.insert(m, end);
                        *calls_made.entry((*group, m)).or_insert(0) += 1;
                        if m != dev {
                            *pc.get_mut(&m).expect("member") += 1;
                            if !queued.get(&m).copied().unwrap_or(true) {
                                queued.insert(m, true);
                                queue.push_back(m);
                            }
                        }
                    }
                    waiting.remove(&(*group, k));
                    *pc.get_mut(&dev).expect("device") += 1;
                    continue;
                }
                _ => {
                    let d = cost.compute(dev, ins);
                    events.push(Event { device: dev, index: i, start: now, end: now + d, phase: ins.phase() });
                    clock.insert(dev, now + d);
                }
            }
            *pc.get_mut(&dev).expect("device") += 1;
        }
        if error.is_some() {
            break;
        }
    }
    let finished = devices.iter().all(|d| pc[d] >= streams[d].len());
    if let Some(reason) = error.or_else(|| (!finished).then(|| "no device can make progress: every unfinished device waits for a message or a collective that never comes (deadlock)".to_string())) {
        let next = devices.iter().map(|d| (*d, (pc[d] < streams[d].len()).then_some(pc[d]))).collect();
        return Err(Stuck { next, reason });
    }
    let step_time = clock.values().copied().fold(0.0, f64::max);
    events.sort_by(|a, b| a.device.cmp(&b.device).then(a.start.total_cmp(&b.start)).then(a.index.cmp(&b.index)));
    Ok(Timeline { events, step_time })
}

/// Every compute and collective takes one unit; transfers are free.
#[derive(Debug, Clone, Copy)]
pub struct UnitCost;

impl CostModel for UnitCost {
    fn compute(&self, _: DeviceId, instr: &Instr) -> f64 {
        match instr.phase() {
            Phase::Forward | Phase::Backward | Phase::BackwardInput | Phase::BackwardWeight | Phase::Recompute => 1.0,
            _ => 0.0,
        }
    }
    fn transfer(&self, _: DeviceId, _: DeviceId, _: u64) -> f64 {
        0.0
    }
    fn all_reduce(&self, _: &[DeviceId], _: u64) -> f64 {
        0.0
    }
}

/// Per-device busy time (compute, optimizer and collectives) and the bubble fractions.
pub fn utilisation(t: &Timeline, devices: &[DeviceId]) -> (Vec<(DeviceId, f64, f64)>, f64) {
    let mut busy: HashMap<DeviceId, f64> = HashMap::new();
    for e in &t.events {
        if !matches!(e.phase, Phase::Communication | Phase::Memory) {
            *busy.entry(e.device).or_insert(0.0) += e.end - e.start;
        }
    }
    let per: Vec<(DeviceId, f64, f64)> = devices
        .iter()
        .map(|d| {
            let b = busy.get(d).copied().unwrap_or(0.0);
            let bubble = if t.step_time > 0.0 { 1.0 - b / t.step_time } else { 0.0 };
            (*d, b, bubble)
        })
        .collect();
    let total_busy: f64 = per.iter().map(|p| p.1).sum();
    let overall = if t.step_time > 0.0 && !devices.is_empty() {
        1.0 - total_busy / (t.step_time * devices.len() as f64)
    } else {
        0.0
    };
    (per, overall)
}
