//! Discrete-event simulation of instruction streams.
//!
//! Semantics (the executor's): each device has a compute engine, which runs its stream one
//! instruction at a time, and a communication engine beside it.
//! - A send is asynchronous: the sender goes on; the message occupies its link (one
//!   direction of one device pair) for α + n·β, after the link's earlier messages.
//! - A receive blocks until its message has arrived, and must match the first message not
//!   yet received on its link (in-order matching).
//! - A collective (`all_reduce ...`) starts on the communication engine and the device goes
//!   on: the engine takes a device's collectives one at a time, in the order they were
//!   started, and a collective begins once every member has started it and has nothing
//!   earlier on its engine; it then takes its kind's time (`CostModel::collective`) on every
//!   member. `wait` blocks until it has finished; only that wait (the exposed part) is time
//!   the device spends on the collective.
//!
//! The same engine, with unit costs, is the verifier's deadlock check.

use std::collections::{BTreeMap, HashMap, VecDeque};

use rustc_hash::FxHashMap;

use pipec_plan::plan::{reduced_in_buckets, GradientBucket};
use pipec_plan::{CollectiveKind, DeviceId, GroupId, Instr, MessageId, Phase, StageId};

/// How long things take.
pub trait CostModel {
    /// Seconds of a compute-like instruction on `device`.
    fn compute(&self, device: DeviceId, instr: &Instr) -> f64;
    /// Seconds `device` spends in line at `instr` on collectives the plan declares there
    /// beyond what its kind costs (for a collective instruction, before it starts it: the
    /// update's tensor-parallel sums at a `grad_norm` or `gradient_shard`; for an expert
    /// dispatch, the row counts exchanged before it); the default none.
    fn in_line(&self, _device: DeviceId, _instr: &Instr) -> f64 {
        0.0
    }
    /// Seconds for `bytes` from `from` to `to`.
    fn transfer(&self, from: DeviceId, to: DeviceId, bytes: u64) -> f64;
    /// Seconds of a collective of `kind` on `bytes` per member by `group`, whose simulated
    /// members are `members` (a cost model may know the group as larger: the strategy
    /// search simulates one pipeline replica of symmetric plans).
    fn collective(&self, kind: CollectiveKind, group: GroupId, members: &[DeviceId], bytes: u64) -> f64;
    /// The forward–backward pairs the plan overlaps ([`pipec_plan::schedule::Pairing`]:
    /// DualPipe's or Megatron-LM's combined 1F1B), if any (the default: none).
    fn pairing(&self) -> Option<pipec_plan::schedule::Pairing> {
        None
    }
    /// An overlapped pair ([`pipec_plan::schedule::overlapped_pair`]): the seconds
    /// `forward` and `backward` on `device` take as one unit with the all-to-alls the two
    /// post (`exchanged` seconds of them), or None where they run one after the other (the
    /// default).
    fn overlapped(&self, _device: DeviceId, _forward: &Instr, _backward: &Instr, _exchanged: f64) -> Option<f64> {
        None
    }
    /// [`overlapped`](Self::overlapped) with each all-to-all's seconds apart, in the order
    /// the two passes post them (`forward`'s dispatch and combine at each layer first to
    /// last; `backward`'s combine and dispatch gradients last to first): a cost model that
    /// pairs the exchanges layer by layer prices them so (the default: their sum).
    fn overlapped_exchanges(
        &self,
        device: DeviceId,
        (forward, backward): (&Instr, &Instr),
        (sent, returned): (&[f64], &[f64]),
    ) -> Option<f64> {
        self.overlapped(device, forward, backward, sent.iter().chain(returned).sum())
    }
    /// The gradient buckets of `stage` ([`pipec_plan::plan::StagePlan::gradient_buckets`]):
    /// its replica all-reduce right after its backward runs as one collective per bucket,
    /// each started when the backward reaches its `ready` fraction.
    fn gradient_buckets(&self, _stage: StageId) -> &[GradientBucket] {
        &[]
    }
}

/// One executed instruction.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub device: DeviceId,
    pub index: usize,
    pub start: f64,
    pub end: f64,
    pub phase: Phase,
    /// On the device's communication engine, beside its compute (a collective in flight):
    /// not time the device itself spends.
    pub background: bool,
    /// An expert-parallel all-to-all inside a pass: waited for at once, never on the
    /// communication engine, so not part of a collective's time in flight or exposed.
    pub all_to_all: bool,
}

impl Event {
    /// An instruction that ran on the device itself from `start` to `end`.
    fn ran(device: DeviceId, index: usize, (start, end): (f64, f64), phase: Phase, all_to_all: bool) -> Event {
        Event { device, index, start, end, phase, background: false, all_to_all }
    }
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
    /// Per device, the seconds its overlapped pairs (DualPipe's) took less than their two
    /// passes one after the other: the all-to-alls they hid.
    pub overlapped: BTreeMap<DeviceId, f64>,
}

/// What a link carries, as both ends name it (None: a receive nothing can match).
fn message_key(i: &Instr) -> Option<(MessageId, u64)> {
    i.transfer().and_then(|t| t.id.map(|id| (id, t.bytes)))
}

/// A message on a link: (what, bytes), send time, arrival time.
type InFlight = ((MessageId, u64), f64, f64);
/// A collective: its group and its number among the group's collectives.
type CallKey = (GroupId, usize);

/// A member's start of a collective.
#[derive(Debug, Clone)]
struct Started {
    device: DeviceId,
    index: usize,
    at: f64,
    bytes: u64,
    kind: CollectiveKind,
    /// The stage a replica all-reduce sums (u32::MAX for a tied one: its members hold
    /// different stages).
    stage: u32,
    /// A bucketed gradient all-reduce: when each bucket's gradients are ready on this
    /// member, and its bytes (empty: the whole collective at `at`).
    buckets: Vec<(f64, u64)>,
}

/// The communication engines: who started what, in which order, and what has finished.
#[derive(Default)]
struct Engines {
    /// Per device, its started collectives not yet run, in start order.
    queue: FxHashMap<DeviceId, VecDeque<CallKey>>,
    started: FxHashMap<CallKey, Vec<Started>>,
    free_at: FxHashMap<DeviceId, f64>,
    /// When each collective ran: (begin, end).
    finished: FxHashMap<CallKey, (f64, f64)>,
    calls: FxHashMap<(GroupId, DeviceId), usize>,
    /// Per (device, group): the collective its next wait waits for.
    outstanding: FxHashMap<(DeviceId, GroupId), CallKey>,
}

impl Engines {
    /// Records `device`'s start of the next collective on `group`; returns its key.
    fn start(&mut self, group: GroupId, s: Started) -> CallKey {
        let k = self.calls.entry((group, s.device)).or_insert(0);
        let key = (group, *k);
        *k += 1;
        let device = s.device;
        self.started.entry(key).or_default().push(s);
        self.queue.entry(device).or_default().push_back(key);
        self.outstanding.insert((device, group), key);
        key
    }

    /// Runs every collective that can begin now (all members started it, nothing earlier
    /// on their engines), starting from the engines of `touched`. Returns the devices whose
    /// collectives finished (to wake), or an error when members disagree.
    fn run(
        &mut self,
        touched: Vec<DeviceId>,
        groups: &HashMap<GroupId, Vec<DeviceId>>,
        cost: &dyn CostModel,
        events: &mut Vec<Event>,
    ) -> Result<Vec<DeviceId>, String> {
        let mut work = touched;
        let mut woken = Vec::new();
        while let Some(d) = work.pop() {
            let Some(&key) = self.queue.get(&d).and_then(VecDeque::front) else { continue };
            let Some(members) = groups.get(&key.0) else {
                return Err(format!("{d} starts a collective on the unknown group {}", key.0));
            };
            let started = &self.started[&key];
            if started.len() < members.len() {
                continue;
            }
            if !members.iter().all(|m| self.queue.get(m).and_then(VecDeque::front) == Some(&key)) {
                continue;
            }
            if started
                .iter()
                .any(|a| (a.kind, a.bytes, a.stage) != (started[0].kind, started[0].bytes, started[0].stage))
            {
                return Err(format!(
                    "group {}: the members' collective call #{} disagree (kind, stage or size)",
                    key.0, key.1
                ));
            }
            let free = started.iter().map(|a| self.free_at.get(&a.device).copied().unwrap_or(0.0)).fold(0.0, f64::max);
            let (begin, end) = match started[0].buckets.len() {
                0 => {
                    let begin = started.iter().map(|a| a.at).fold(free, f64::max);
                    (begin, begin + cost.collective(started[0].kind, key.0, members, started[0].bytes))
                }
                // one collective per bucket, in order on the engine, each once every
                // member's backward has made it
                n => {
                    if started.iter().any(|a| a.buckets.len() != n) {
                        return Err(format!(
                            "group {}: the members' collective call #{} disagree (buckets)",
                            key.0, key.1
                        ));
                    }
                    let (mut begin, mut end) = (f64::INFINITY, free);
                    for k in 0..n {
                        let ready = started.iter().map(|a| a.buckets[k].0).fold(end, f64::max);
                        begin = begin.min(ready);
                        end = ready + cost.collective(started[0].kind, key.0, members, started[0].buckets[k].1);
                    }
                    (begin, end)
                }
            };
            for a in started {
                events.push(Event {
                    device: a.device,
                    index: a.index,
                    start: begin,
                    end,
                    phase: Phase::Collective,
                    background: true,
                    all_to_all: false,
                });
                self.free_at.insert(a.device, end);
                if let Some(q) = self.queue.get_mut(&a.device) {
                    q.pop_front();
                }
                work.push(a.device);
                woken.push(a.device);
            }
            self.finished.insert(key, (begin, end));
        }
        Ok(woken)
    }
}

/// The exposed part of a collective that ran over `(begin, end)`, for a device that
/// started waiting for it at `now`: only the collective's own time is communication;
/// waiting for the other members to start it is idle time (bubble).
fn waited(device: DeviceId, index: usize, now: f64, (begin, end): (f64, f64)) -> Event {
    let end = now.max(end);
    Event {
        device,
        index,
        start: now.max(begin).min(end),
        end,
        phase: Phase::Collective,
        background: false,
        all_to_all: false,
    }
}

/// The point-to-point links: the messages in flight on each (one direction of a device
/// pair), in send order, and when each link is free again.
#[derive(Default)]
struct Links {
    queued: FxHashMap<(DeviceId, DeviceId), VecDeque<InFlight>>,
    free: FxHashMap<(DeviceId, DeviceId), f64>,
}

impl Links {
    /// A message of `bytes` sent at `now` on `link`: it leaves once the link's earlier
    /// messages have, and arrives its transfer time later.
    fn send(
        &mut self,
        cost: &dyn CostModel,
        link: (DeviceId, DeviceId),
        bytes: u64,
        now: f64,
        key: Option<(MessageId, u64)>,
    ) {
        let free = self.free.entry(link).or_insert(0.0);
        let begin = now.max(*free);
        let arrival = begin + cost.transfer(link.0, link.1, bytes);
        *free = arrival;
        if let Some(key) = key {
            self.queued.entry(link).or_default().push_back((key, begin, arrival));
        }
    }
}

/// Runs the streams. `groups` maps a group id to its members.
pub fn simulate(
    streams: &BTreeMap<DeviceId, Vec<Instr>>,
    groups: &HashMap<GroupId, Vec<DeviceId>>,
    cost: &dyn CostModel,
) -> Result<Timeline, Stuck> {
    let devices: Vec<DeviceId> = streams.keys().copied().collect();
    let mut pc: FxHashMap<DeviceId, usize> = devices.iter().map(|d| (*d, 0)).collect();
    let mut clock: FxHashMap<DeviceId, f64> = devices.iter().map(|d| (*d, 0.0)).collect();
    let mut links = Links::default();
    let mut engines = Engines::default();
    // per device, its last backward or weight pass: (position, start, end)
    let mut last_backward: FxHashMap<DeviceId, (usize, f64, f64)> = FxHashMap::default();
    // per device, the overlapped pair its last forward opened: the forward's and the
    // backward's positions, what is left of the pair's time after the forward, and the
    // position of the pair's last all-to-all (those inside the pair are hidden in its time)
    let mut pair: FxHashMap<DeviceId, Pair> = FxHashMap::default();
    let mut overlapped: BTreeMap<DeviceId, f64> = BTreeMap::new();
    // about an event per instruction
    let mut events = Vec::with_capacity(streams.values().map(Vec::len).sum());
    let mut queue: VecDeque<DeviceId> = devices.iter().copied().collect();
    let mut queued: FxHashMap<DeviceId, bool> = devices.iter().map(|d| (*d, true)).collect();
    let mut error: Option<String> = None;
    let wake = |d: DeviceId, queue: &mut VecDeque<DeviceId>, queued: &mut FxHashMap<DeviceId, bool>| {
        if !queued.get(&d).copied().unwrap_or(true) {
            queued.insert(d, true);
            queue.push_back(d);
        }
    };

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
                    links.send(cost, (dev, *peer), *bytes, now, message_key(ins));
                    events.push(Event::ran(dev, i, (now, now), Phase::Communication, false));
                    wake(*peer, &mut queue, &mut queued);
                }
                Instr::RecvActivation { peer, .. }
                | Instr::RecvGradient { peer, .. }
                | Instr::ApplyGradient { peer, .. }
                | Instr::PullWeights { peer, .. } => {
                    let want = message_key(ins);
                    let q = links.queued.entry((*peer, dev)).or_default();
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
                            events.push(Event::ran(dev, i, (start.min(done), done), Phase::Communication, false));
                            clock.insert(dev, done);
                        }
                    }
                }
                Instr::Collective { kind, payload, stage, group, bytes } => {
                    if !groups.get(group).is_some_and(|m| m.contains(&dev)) {
                        error = Some(format!("{dev}: `{ins}` names a group it is not a member of"));
                        break;
                    }
                    let now = summed_in_line(cost, (dev, i, ins), now, (&mut events, &mut clock));
                    // a tied gradient's members hold different stages
                    let stage = if payload.crosses_stages() { u32::MAX } else { stage.0 };
                    let buckets = bucket_starts(cost, stream, i, last_backward.get(&dev).copied());
                    let started =
                        Started { device: dev, index: i, at: now, bytes: *bytes, kind: *kind, stage, buckets };
                    engines.start(*group, started);
                    match engines.run(vec![dev], groups, cost, &mut events) {
                        Ok(woken) => {
                            for d in woken {
                                wake(d, &mut queue, &mut queued);
                            }
                        }
                        Err(e) => {
                            error = Some(e);
                            break;
                        }
                    }
                }
                // inside its pass: the device waits for it (hidden inside an overlapped pair)
                Instr::AllToAll { .. } => {
                    let Some(t) = all_to_all_time((groups, cost), dev, ins) else {
                        error = Some(format!("{dev}: `{ins}` names a group it is not a member of"));
                        break;
                    };
                    match pair.get(&dev) {
                        Some(p) if p.forward < i && i <= p.last => *overlapped.entry(dev).or_insert(0.0) += t,
                        _ => {
                            events.push(Event::ran(dev, i, (now, now + t), Phase::Collective, true));
                            clock.insert(dev, now + t);
                        }
                    }
                }
                Instr::WaitCollective { group, .. } => {
                    let Some(key) = engines.outstanding.get(&(dev, *group)).copied() else {
                        error = Some(format!("{dev}: `{ins}` waits for a collective it never started"));
                        break;
                    };
                    let Some(&ran) = engines.finished.get(&key) else { break }; // woken when it finishes
                    engines.outstanding.remove(&(dev, *group));
                    let e = waited(dev, i, now, ran);
                    clock.insert(dev, e.end);
                    events.push(e);
                }
                _ => {
                    let mut d = cost.compute(dev, ins);
                    match pair.get(&dev) {
                        // the rest of an overlapped pair's time
                        Some(p) if p.backward == i => {
                            *overlapped.entry(dev).or_insert(0.0) += d - p.rest;
                            d = p.rest;
                        }
                        _ => {
                            if let Some(p) = open_pair((groups, cost), dev, stream, i, d) {
                                pair.insert(dev, p);
                            }
                        }
                    }
                    if let Instr::Backward { .. } | Instr::BackwardWeight { .. } = ins {
                        last_backward.insert(dev, (i, now, now + d));
                    }
                    events.push(Event::ran(dev, i, (now, now + d), ins.phase(), false));
                    clock.insert(dev, now + d);
                }
            }
            *pc.get_mut(&dev).expect("device") += 1;
        }
        if error.is_some() {
            break;
        }
    }
    if let Some(stuck) = stuck(streams, &devices, &pc, error, &engines) {
        return Err(stuck);
    }
    let step_time = clock.values().chain(engines.free_at.values()).copied().fold(0.0, f64::max);
    Ok(Timeline { events: by_device_then_start(events), step_time, overlapped })
}

/// The events in the timeline's order — by device, then start, then index, ties in the
/// order they ran — as one stable sort by that key would give them, without its cost: the
/// events are split by device first (they come interleaved over the devices, each
/// device's nearly in order of its start, which the stable sort of each part finds in
/// linear time): the GPT-3 175B search simulates plans of 1,024 devices, whose sort was
/// two fifths of its instructions.
/// When `dev` starts collective `ins` (its `i`-th instruction), reached at `now`: after
/// what it sums in line first ([`CostModel::in_line`], an event of its own, the device's
/// clock moved past it).
fn summed_in_line(
    cost: &dyn CostModel,
    (dev, i, ins): (DeviceId, usize, &Instr),
    now: f64,
    (events, clock): (&mut Vec<Event>, &mut FxHashMap<DeviceId, f64>),
) -> f64 {
    let before = cost.in_line(dev, ins);
    if before <= 0.0 {
        return now;
    }
    events.push(Event::ran(dev, i, (now, now + before), Phase::Collective, false));
    clock.insert(dev, now + before);
    now + before
}

/// An all-to-all's seconds over its group, when `dev` is one of its members, with what
/// the pass exchanges in line before it ([`CostModel::in_line`]: a dispatch's row counts).
fn all_to_all_time(
    (groups, cost): (&HashMap<GroupId, Vec<DeviceId>>, &dyn CostModel),
    dev: DeviceId,
    ins: &Instr,
) -> Option<f64> {
    let Instr::AllToAll { group, bytes, .. } = ins else { return None };
    let members = groups.get(group).filter(|m| m.contains(&dev))?;
    Some(cost.collective(CollectiveKind::AllToAll, *group, members, *bytes) + cost.in_line(dev, ins))
}

/// The seconds of each all-to-all right after position `at` of `stream`, in the stream's
/// order, and the position of the last of them (one that names a group without `dev` stops
/// the run where it stands).
fn each_exchanged_after(
    priced: (&HashMap<GroupId, Vec<DeviceId>>, &dyn CostModel),
    dev: DeviceId,
    stream: &[Instr],
    at: usize,
) -> (Vec<f64>, usize) {
    let mut last = at;
    let mut each = Vec::new();
    while let Some(ins @ Instr::AllToAll { .. }) = stream.get(last + 1) {
        each.push(all_to_all_time(priced, dev, ins).unwrap_or(0.0));
        last += 1;
    }
    (each, last)
}

/// The overlapped pair (DualPipe) the forward at `i` of `stream`, taking `d` seconds alone,
/// opens: the seconds left of the pair after the forward (at least the forward with its own
/// exchanges), or None where the cost model runs the two one after the other.
fn open_pair(
    priced: (&HashMap<GroupId, Vec<DeviceId>>, &dyn CostModel),
    dev: DeviceId,
    stream: &[Instr],
    i: usize,
    d: f64,
) -> Option<Pair> {
    let j = pipec_plan::schedule::overlapped_pair(stream, i, priced.1.pairing()?)?;
    let (sent, _) = each_exchanged_after(priced, dev, stream, i);
    let (returned, last) = each_exchanged_after(priced, dev, stream, j);
    let both = priced.1.overlapped_exchanges(dev, (&stream[i], &stream[j]), (&sent, &returned))?;
    let forward_exchanges: f64 = sent.iter().sum();
    let rest = both.max(d + forward_exchanges) - d;
    Some(Pair { forward: i, backward: j, rest, last })
}

/// The buckets a collective at `i` of `stream` reduces in, each with its start: when the
/// backward just before it (`last`: its position, start and end) reaches the bucket's
/// `ready` fraction; none when the collective is not a bucketed reduction.
fn bucket_starts(cost: &dyn CostModel, stream: &[Instr], i: usize, last: Option<(usize, f64, f64)>) -> Vec<(f64, u64)> {
    match (reduced_in_buckets(stream, i), last) {
        (Some(b), Some((at, start, end))) if at == b => cost
            .gradient_buckets(stream[i].stage())
            .iter()
            .map(|x| (start + x.ready * (end - start), x.bytes))
            .collect(),
        _ => Vec::new(),
    }
}

/// Why the run stopped before every stream ended, if it did: an error one device met, a
/// deadlock (no device can go on), or a collective started that never ran.
fn stuck(
    streams: &BTreeMap<DeviceId, Vec<Instr>>,
    devices: &[DeviceId],
    pc: &FxHashMap<DeviceId, usize>,
    error: Option<String>,
    engines: &Engines,
) -> Option<Stuck> {
    let finished = devices.iter().all(|d| pc[d] >= streams[d].len());
    let unfinished_collective = engines.queue.values().any(|q| !q.is_empty());
    if let Some(reason) = error.or_else(|| {
        (!finished).then(|| "no device can make progress: every unfinished device waits for a message or a collective that never comes (deadlock)".to_string())
    }).or_else(|| unfinished_collective.then(|| "a started collective never runs: its group's members start their collectives in different orders, or one never starts it (deadlock)".to_string())) {
        let next = devices.iter().map(|d| (*d, (pc[d] < streams[d].len()).then_some(pc[d]))).collect();
        return Some(Stuck { next, reason });
    }
    None
}

fn by_device_then_start(events: Vec<Event>) -> Vec<Event> {
    let total = events.len();
    let slots = events.iter().map(|e| e.device.0 as usize + 1).max().unwrap_or(0);
    let mut counts = vec![0usize; slots];
    for e in &events {
        counts[e.device.0 as usize] += 1;
    }
    let mut per_device: Vec<Vec<Event>> = counts.into_iter().map(Vec::with_capacity).collect();
    for e in events {
        per_device[e.device.0 as usize].push(e);
    }
    let mut out = Vec::with_capacity(total);
    for mut device_events in per_device {
        device_events.sort_by(|a, b| a.start.total_cmp(&b.start).then(a.index.cmp(&b.index)));
        out.append(&mut device_events);
    }
    out
}

/// DualPipe's overlapped pair a device's forward opened (`simulate`).
#[derive(Debug, Clone, Copy)]
struct Pair {
    forward: usize,
    backward: usize,
    /// The pair's time left after its forward's computation.
    rest: f64,
    /// The position of the last all-to-all the backward posts.
    last: usize,
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
    fn collective(&self, _: CollectiveKind, _: GroupId, _: &[DeviceId], _: u64) -> f64 {
        0.0
    }
}

/// Per device: seconds its all-reduces were in flight on its communication engine, and the
/// part of that the device waited for (exposed; the rest was hidden behind compute).
/// An expert-parallel all-to-all, waited for inside its pass, is neither (`pipec compile`
/// reports it apart), so exposed never exceeds in flight.
pub fn collective_times(t: &Timeline) -> BTreeMap<DeviceId, (f64, f64)> {
    let mut out: BTreeMap<DeviceId, (f64, f64)> = BTreeMap::new();
    for e in t.events.iter().filter(|e| e.phase == Phase::Collective && !e.all_to_all) {
        let entry = out.entry(e.device).or_insert((0.0, 0.0));
        if e.background {
            entry.0 += e.end - e.start;
        } else {
            entry.1 += e.end - e.start;
        }
    }
    out
}

/// Per-device busy time (compute, optimizer and the exposed part of collectives) and the
/// bubble fractions.
pub fn utilisation(t: &Timeline, devices: &[DeviceId]) -> (Vec<(DeviceId, f64, f64)>, f64) {
    let mut busy: FxHashMap<DeviceId, f64> = FxHashMap::default();
    for e in &t.events {
        if !e.background && !matches!(e.phase, Phase::Communication | Phase::Memory) {
            *busy.entry(e.device).or_insert(0.0) += e.end - e.start;
        }
    }
    let per: Vec<(DeviceId, f64, f64)> = devices
        .iter()
        .map(|d| {
            let b = busy.get(d).copied().unwrap_or(0.0);
            // (summed event lengths can pass the step by rounding: never below 0)
            let bubble = if t.step_time > 0.0 { (1.0 - b / t.step_time).max(0.0) } else { 0.0 };
            (*d, b, bubble)
        })
        .collect();
    let total_busy: f64 = per.iter().map(|p| p.1).sum();
    let overall = if t.step_time > 0.0 && !devices.is_empty() {
        (1.0 - total_busy / (t.step_time * devices.len() as f64)).max(0.0)
    } else {
        0.0
    };
    (per, overall)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_plan::{CollectivePayload, MicrobatchId};

    /// Forward 4 s, backward 10 s, a collective one second per byte; stage 0's gradients
    /// in buckets of 3 bytes (ready at 40% of the backward) and 5 bytes (ready at its end).
    struct Buckets(Vec<GradientBucket>);
    impl CostModel for Buckets {
        fn compute(&self, _: DeviceId, instr: &Instr) -> f64 {
            match instr.phase() {
                Phase::Forward => 4.0,
                Phase::Backward => 10.0,
                _ => 0.0,
            }
        }
        fn transfer(&self, _: DeviceId, _: DeviceId, _: u64) -> f64 {
            0.0
        }
        fn collective(&self, _: CollectiveKind, _: GroupId, _: &[DeviceId], bytes: u64) -> f64 {
            bytes as f64
        }
        fn gradient_buckets(&self, _: StageId) -> &[GradientBucket] {
            &self.0
        }
    }

    fn replica_streams(between: Option<Instr>) -> BTreeMap<DeviceId, Vec<Instr>> {
        let (stage, mb, group) = (StageId(0), MicrobatchId(0), GroupId(0));
        let mut s = vec![Instr::Forward { stage, mb }, Instr::Backward { stage, mb }, Instr::Free { stage, mb }];
        s.extend(between);
        s.extend([
            Instr::collective(CollectivePayload::Gradients, stage, group, 8),
            Instr::wait(CollectivePayload::Gradients, stage, group),
            Instr::OptimizerStep { stage },
        ]);
        (0..2).map(|d| (DeviceId(d), s.clone())).collect()
    }

    proptest::proptest! {
        /// Split by device, then sorted: the order one stable sort by (device, start,
        /// index) gives, ties (equal starts and indices) in the order the events ran.
        #[test]
        fn events_split_by_device_come_in_the_stable_sorts_order(
            raw in proptest::collection::vec((0u32..5, 0u8..6, 0usize..4), 0..200),
        ) {
            let events: Vec<Event> = raw
                .iter()
                .enumerate()
                .map(|(n, &(device, start, index))| Event {
                    device: DeviceId(device),
                    index,
                    start: f64::from(start),
                    // tells apart events whose key is the same
                    end: n as f64,
                    phase: Phase::Forward,
                    background: false,
                    all_to_all: false,
                })
                .collect();
            let mut sorted = events.clone();
            sorted.sort_by(|a, b| a.device.cmp(&b.device).then(a.start.total_cmp(&b.start)).then(a.index.cmp(&b.index)));
            proptest::prop_assert_eq!(by_device_then_start(events), sorted);
        }
    }

    #[test]
    fn bucketed_reduction_overlaps_the_backward_in_closed_form() {
        let groups: HashMap<GroupId, Vec<DeviceId>> = [(GroupId(0), vec![DeviceId(0), DeviceId(1)])].into();
        let buckets = vec![
            GradientBucket { layers: [1, 2], bytes: 3, ready: 0.4 },
            GradientBucket { layers: [0, 1], bytes: 5, ready: 1.0 },
        ];
        let run = |cost: &Buckets, between| simulate(&replica_streams(between), &groups, cost).expect("runs").step_time;
        // one all-reduce after the backward: 4 + 10 + 8
        assert_eq!(run(&Buckets(Vec::new()), None), 22.0);
        // the first bucket runs over [8, 11] inside the backward, the second from its end
        // at 14 to 19
        assert_eq!(run(&Buckets(buckets.clone()), None), 19.0);
        // a first bucket longer than the rest of the backward delays the second: 8 + 7, + 5
        let slow = vec![GradientBucket { bytes: 7, ..buckets[0] }, GradientBucket { bytes: 1, ..buckets[1] }];
        assert_eq!(run(&Buckets(slow), None), 16.0);
        // not right after the backward (a forward between): one all-reduce, 4 + 10 + 4 + 8
        let forward = Instr::Forward { stage: StageId(0), mb: MicrobatchId(1) };
        assert_eq!(run(&Buckets(buckets.clone()), Some(forward)), 26.0);
        // after a weight pass (free here) that follows the backward: the buckets are ready
        // at once, 14 + 3 + 5
        let weight = Instr::BackwardWeight { stage: StageId(0), mb: MicrobatchId(0) };
        assert_eq!(run(&Buckets(buckets), Some(weight)), 22.0);
    }
}
