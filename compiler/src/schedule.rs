//! Schedules: one generator per schedule, each producing the compute order of every device
//! (forwards and backwards of (stage, microbatch) pairs). Communication is not the
//! generators' business: [`crate::lower`] inserts it in one pass from these orders.
//!
//! Stages here are the plan's stages (model chunks): `S = pipeline ranks × virtual stages`.
//! A [`Placement`] says which device runs each stage for each microbatch.

use pipec_plan::ScheduleKind;
use pipec_plan::{DeviceId, MicrobatchId, StageId};

/// The compute kinds a schedule orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TaskKind {
    Forward,
    /// Full backward.
    Backward,
    /// Zero-bubble: input gradient only.
    BackwardInput,
    /// Zero-bubble: weight gradient.
    BackwardWeight,
}

/// One compute task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Task {
    pub kind: TaskKind,
    pub stage: StageId,
    pub mb: MicrobatchId,
}

impl std::fmt::Display for Task {
    /// PyTorch's action notation: `0F3`, `1B2`, `0I1` (input gradient), `0W1` (weights).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let k = match self.kind {
            TaskKind::Forward => "F",
            TaskKind::Backward => "B",
            TaskKind::BackwardInput => "I",
            TaskKind::BackwardWeight => "W",
        };
        write!(f, "{}{k}{}", self.stage.0, self.mb.0)
    }
}

impl Task {
    fn new(kind: TaskKind, stage: usize, mb: usize) -> Self {
        Task { kind, stage: StageId(stage as u32), mb: MicrobatchId(mb as u32) }
    }
}

/// Which device runs each (stage, microbatch).
#[derive(Debug, Clone)]
pub struct Placement {
    /// replicas[stage] = devices holding a replica of the stage.
    pub replicas: Vec<Vec<DeviceId>>,
    /// route[stage][mb] = index into replicas[stage].
    pub route: Vec<Vec<u32>>,
    pub devices: usize,
    pub microbatches: usize,
}

impl Placement {
    pub fn stages(&self) -> usize {
        self.replicas.len()
    }
    pub fn device_of(&self, stage: usize, mb: usize) -> DeviceId {
        self.replicas[stage][self.route[stage][mb] as usize]
    }
    /// The microbatches a device runs for a stage, in order.
    pub fn local_microbatches(&self, stage: usize, device: DeviceId) -> Vec<usize> {
        (0..self.microbatches).filter(|&m| self.device_of(stage, m) == device).collect()
    }
    /// Stages a device holds, ascending.
    pub fn stages_of(&self, device: DeviceId) -> Vec<usize> {
        (0..self.stages()).filter(|&s| self.replicas[s].contains(&device)).collect()
    }
}

/// Per device, the ordered compute tasks.
pub type Order = Vec<Vec<Task>>;

/// The whole backward that the forward at `at` of a device's `tasks` opens an overlapped
/// pair with under `pairing` (DualPipe's, or Megatron-LM's combined 1F1B): the next task, a
/// whole backward that `pairing` pairs with the forward and that does not recompute
/// (`recomputed`: a recompute would run between them). The order's side of
/// `pipec_plan::schedule::overlapped_pair`, which finds the same pairs in the streams this
/// order lowers to.
pub(crate) fn paired_backward(
    tasks: &[Task],
    at: usize,
    recomputed: impl Fn(usize) -> bool,
    pairing: pipec_plan::schedule::Pairing,
) -> Option<&Task> {
    let f = tasks.get(at).filter(|f| f.kind == TaskKind::Forward)?;
    tasks.get(at + 1).filter(|b| {
        b.kind == TaskKind::Backward
            && pairing.pairs((f.stage, f.mb), (b.stage, b.mb))
            && !recomputed(b.stage.0 as usize)
    })
}

/// Generates the compute order of `kind` for a placement.
///
/// `backward_slots` is the plan's backward time in forwards, rounded (1 when they are equal,
/// about 2 for matrix layers); the schedules that pack passes by their length use it.
///
/// `combined`: Megatron-LM's combined 1F1B (`ep_overlap`): 1F1B and the interleaved schedule
/// run one more forward before their first backward, so that each forward of the 1F1B phase
/// and the backward after it are of different microbatches and run as one pair
/// (`schedules.py`'s `num_warmup_microbatches + 1`; without pipelining F0, F1 B0, F2 B1, …).
pub fn generate(
    kind: ScheduleKind,
    placement: &Placement,
    pipeline_ranks: usize,
    backward_slots: usize,
    combined: bool,
) -> Order {
    let extra = usize::from(combined && kind.combines_1f1b());
    match kind {
        ScheduleKind::Gpipe => gpipe(placement),
        ScheduleKind::OneFOneB | ScheduleKind::PipeDream | ScheduleKind::TwoBw | ScheduleKind::DpOnly => {
            one_f_one_b(placement, extra)
        }
        ScheduleKind::Interleaved => interleaved(placement, pipeline_ranks, extra),
        ScheduleKind::ZbH1 => zb_h1(placement),
        ScheduleKind::Zbv => zero_bubble(placement),
        ScheduleKind::DualPipeV => dualpipe_v(placement),
        ScheduleKind::DualPipe => dualpipe(placement),
        ScheduleKind::Chimera => chimera(placement, backward_slots),
    }
}

/// Whether `generate` reads its `backward_slots` for `kind` (only Chimera's concatenation
/// packs passes by their length; the others are unit-time orders).
pub fn reads_backward_slots(kind: ScheduleKind) -> bool {
    kind == ScheduleKind::Chimera
}

/// Sends input gradients before weight gradients: every backward of a stage after the
/// first becomes its input half followed at once by its weight half (zero-bubble's split,
/// with nothing moved in between). Lowering sends the gradient after the input half, so the
/// previous stage starts its backward while this one computes its weight gradients; every
/// device runs the same work in the same order, and a receiver's input only comes sooner, so
/// no pass starts later (`compiler/tests/schedules.rs` checks the step against the closed
/// form and never above the unsplit one's). The first stage sends nothing and keeps its
/// backwards whole.
pub fn send_gradients_first(order: &mut Order) {
    for tasks in order.iter_mut() {
        let mut split = Vec::with_capacity(tasks.len() * 2);
        for t in tasks.drain(..) {
            if t.kind == TaskKind::Backward && t.stage.0 > 0 {
                split.push(Task { kind: TaskKind::BackwardInput, ..t });
                split.push(Task { kind: TaskKind::BackwardWeight, ..t });
            } else {
                split.push(t);
            }
        }
        *tasks = split;
    }
}

/// GPipe: every forward, then every backward (in microbatch order, as PyTorch does).
fn gpipe(p: &Placement) -> Order {
    let mut order = vec![Vec::new(); p.devices];
    for (d, tasks) in order.iter_mut().enumerate() {
        let dev = DeviceId(d as u32);
        for s in p.stages_of(dev) {
            for m in p.local_microbatches(s, dev) {
                tasks.push(Task::new(TaskKind::Forward, s, m));
            }
        }
        for s in p.stages_of(dev).into_iter().rev() {
            for m in p.local_microbatches(s, dev) {
                tasks.push(Task::new(TaskKind::Backward, s, m));
            }
        }
    }
    order
}

/// Workers from `stage` to the end of the pipeline, divided by the stage's replicas:
/// PipeDream's NOAM, the forwards a replica keeps in flight in steady state. For an
/// unreplicated pipeline it is `S − s`.
pub fn in_flight_target(p: &Placement, stage: usize) -> usize {
    let downstream: usize = (stage..p.stages()).map(|s| p.replicas[s].len()).sum();
    downstream.div_ceil(p.replicas[stage].len().max(1))
}

/// 1F1B with a flush (PipeDream-Flush / DAPPLE): `w` warm-up forwards, then alternate one
/// backward and one forward, then the remaining backwards. Also the order of the
/// asynchronous PipeDream schedules and of data parallelism (one stage: F, B, F, B, ...).
fn one_f_one_b(p: &Placement, extra: usize) -> Order {
    stage_by_stage(p, |s, local, tasks| {
        let warmup = (in_flight_target(p, s) + extra).min(local.len());
        let mut next_f = 0;
        let mut next_b = 0;
        while next_f < warmup {
            tasks.push(Task::new(TaskKind::Forward, s, local[next_f]));
            next_f += 1;
        }
        while next_b < local.len() {
            tasks.push(Task::new(TaskKind::Backward, s, local[next_b]));
            next_b += 1;
            if next_f < local.len() {
                tasks.push(Task::new(TaskKind::Forward, s, local[next_f]));
                next_f += 1;
            }
        }
    })
}

/// The order of a schedule that runs each stage a device holds to completion, one after the
/// other: `emit(stage, the device's microbatches of it, the device's task list)`.
fn stage_by_stage(p: &Placement, mut emit: impl FnMut(usize, &[usize], &mut Vec<Task>)) -> Order {
    let mut order = vec![Vec::new(); p.devices];
    for (d, tasks) in order.iter_mut().enumerate() {
        let dev = DeviceId(d as u32);
        for s in p.stages_of(dev) {
            emit(s, &p.local_microbatches(s, dev), tasks);
        }
    }
    order
}

/// Interleaved 1F1B (Megatron-LM): device d holds chunks d, d+D, d+2D, ...; microbatches
/// advance through the chunks in groups of D; warm-up (D−d−1)·2 + (V−1)·D forwards.
fn interleaved(p: &Placement, ranks: usize, extra: usize) -> Order {
    let d_count = ranks;
    let v = p.stages() / ranks.max(1);
    let mut order = vec![Vec::new(); p.devices];
    for (d, tasks) in order.iter_mut().enumerate() {
        let dev = DeviceId(d as u32);
        let chunks = p.stages_of(dev);
        if chunks.is_empty() {
            continue;
        }
        let rank = chunks[0] % d_count;
        // With data parallelism, a device runs its replica's share of the microbatches.
        let local = p.local_microbatches(chunks[0], dev);
        let n_local = local.len();
        let total = n_local * v;
        let group = d_count.min(n_local.max(1));
        let forward_at = |k: usize| -> Task {
            let chunk = (k / group) % v;
            let mb = (k / (group * v)) * group + k % group;
            Task::new(TaskKind::Forward, chunk * d_count + rank, local[mb])
        };
        let backward_at = |k: usize| -> Task {
            let chunk = v - 1 - (k / group) % v;
            let mb = (k / (group * v)) * group + k % group;
            Task::new(TaskKind::Backward, chunk * d_count + rank, local[mb])
        };
        let warmup = ((d_count - rank - 1) * 2 + (v - 1) * group + extra).min(total);
        for k in 0..warmup {
            tasks.push(forward_at(k));
        }
        let steady = total - warmup;
        for k in 0..steady {
            tasks.push(forward_at(warmup + k));
            tasks.push(backward_at(k));
        }
        for k in steady..total {
            tasks.push(backward_at(k));
        }
    }
    order
}

/// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): 1F1B with the backward
/// split into the input gradient (I) and the weight gradient (W). Stage s runs 1F1B's
/// warm-up, then F + I pairs; its first `s` weight passes are deferred (stage s idles
/// longest in the cool-down) and run at the end, filling the cool-down bubble. Peak
/// activation memory over the pipeline stays 1F1B's: stage s keeps (D − s) + s microbatches.
fn zb_h1(p: &Placement) -> Order {
    stage_by_stage(p, |s, local, tasks| {
        let n = local.len();
        let ranks_after = in_flight_target(p, s);
        let warmup = ranks_after.saturating_sub(1).min(n);
        // the stage's position in the pipeline (with equal replication, the stages after
        // it are the in-flight target's: S − s)
        let deferred = s;
        let mut next_w = 0;
        for &m in &local[..warmup] {
            tasks.push(Task::new(TaskKind::Forward, s, m));
        }
        for k in 0..n {
            if warmup + k < n {
                tasks.push(Task::new(TaskKind::Forward, s, local[warmup + k]));
            }
            tasks.push(Task::new(TaskKind::BackwardInput, s, local[k]));
            if k >= deferred {
                tasks.push(Task::new(TaskKind::BackwardWeight, s, local[next_w]));
                next_w += 1;
            }
        }
        while next_w < n {
            tasks.push(Task::new(TaskKind::BackwardWeight, s, local[next_w]));
            next_w += 1;
        }
    })
}

/// Zero-bubble V schedule (ZBV, with its V-shaped placement): a unit-time list
/// scheduler with the paper's priorities — input-gradient backward first (it unblocks the
/// previous stage), then a forward while the device's in-flight activations stay within
/// 1F1B's peak, then a deferred weight-gradient pass to fill what would be a bubble.
/// The most microbatches' activations (of any of its stages) `kind`'s order keeps on one
/// device at once, where its generator holds forwards back at a count: zero-bubble V's.
pub fn in_flight_cap(kind: ScheduleKind, p: &Placement) -> Option<usize> {
    (kind == ScheduleKind::Zbv).then(|| zbv_limit(p))
}

/// ZBV's bound on every device: 1F1B's peak — its first device's D whole-stage
/// microbatches, 2D of ZBV's half-size chunks (the paper's "1x" activation memory) — the
/// most any stage's 1F1B target asks (S − s chunks for stage s; a per-device S − s starves
/// the later devices: a fifth of the step idle, tested).
fn zbv_limit(p: &Placement) -> usize {
    (0..p.stages()).map(|s| in_flight_target(p, s)).max().unwrap_or(1)
}

fn zero_bubble(p: &Placement) -> Order {
    let most = zbv_limit(p);
    list_schedule(p, true, |_, _| most, Priority::ZeroBubble)
}

/// DualPipeV, as DeepSeek's reference implementation runs it (`dualpipe/dualpipev.py`,
/// `DualPipeV.step`): on R devices in a V, device r holds stage r (chunk 0, going down) and
/// stage 2R − 1 − r (chunk 1, coming back up; device 0's is the last stage). With n
/// microbatches per pipeline (at least 2R), in eight steps:
/// 1. 2(R − 1 − r) forwards of chunk 0;
/// 2. r + 1 times a forward of chunk 0 then of chunk 1;
/// 3. R − 1 − r times an input-gradient backward of chunk 1, its weight gradient, a forward
///    of chunk 1;
/// 4. n − 2R + r + 1 times a forward of chunk 0 with a backward of chunk 1, then a forward
///    of chunk 1 with a backward of chunk 0 (the pairs DualPipe overlaps);
/// 5. R − 1 − r times a backward of chunk 1, then a forward of chunk 1 with a backward of
///    chunk 0;
/// 6. r + 1 times a backward of chunk 1 then of chunk 0, the second half of them split
///    (input gradient now, weight gradient later; from the odd devices' chunk 1 and the
///    even devices' chunk 0 of the middle pair on);
/// 7. R − 1 − r times a deferred weight gradient, then a split backward of chunk 0;
/// 8. the r + 1 weight gradients left.
///
/// Each chunk's forwards and backwards take its microbatches in order; the deferred weight
/// gradients run first in, first out.
fn dualpipe_v(p: &Placement) -> Order {
    let stages = p.stages();
    let ranks = stages / 2;
    let mut order = vec![Vec::new(); p.devices];
    for (d, tasks) in order.iter_mut().enumerate() {
        let dev = DeviceId(d as u32);
        let Some(r) = p.stages_of(dev).first().copied().filter(|&s| s < ranks) else { continue };
        *tasks = dualpipe_steps(p, dev, [r, stages - 1 - r], ranks, r);
    }
    order
}

/// DualPipe, as DeepSeek's reference implementation runs it (`dualpipe/dualpipe.py`,
/// `DualPipe.step`): two pipelines of the D stages in opposite directions (stage s going
/// down on device s, coming up on device D − 1 − s; `ChunkPlacement::Halves`: with R
/// pipeline pairs side by side the microbatches dealt to the pairs in turn, the first half
/// of each pair's share down, the second up). A device's phase 0 is the direction in
/// which it is in the first half of the pipeline, and it runs DualPipeV's eight steps
/// ([`dualpipe_v`]) over its two directions with R = D/2 and its distance from the nearer
/// end as r, each direction's n = N/2 microbatches.
fn dualpipe(p: &Placement) -> Order {
    let d_stages = p.stages();
    let half = d_stages / 2;
    let mut order = vec![Vec::new(); p.devices];
    for (d, tasks) in order.iter_mut().enumerate() {
        let dev = DeviceId(d as u32);
        let held = p.stages_of(dev);
        if held.len() != 2 {
            continue;
        }
        // the device's down stage is the one whose down copy it holds (an even replica: a
        // pair's down copy, then its up copy)
        let down_copy = |s: usize| p.replicas[s].iter().position(|r| *r == dev).is_some_and(|i| i % 2 == 0);
        let Some(&down) = held.iter().find(|&&s| down_copy(s)) else { continue };
        let up = d_stages - 1 - down;
        let (r, chunk) = if down < half { (down, [down, up]) } else { (up, [up, down]) };
        *tasks = dualpipe_steps(p, dev, chunk, half, r);
    }
    order
}

/// One device's order as DualPipe's steps build it: each chunk's microbatches taken in
/// order by its forwards and its backwards, the deferred weight gradients first in, first out.
struct DualPipeOrder {
    chunk: [usize; 2],
    mbs: [Vec<usize>; 2],
    /// The next forward and backward of each chunk.
    next: [[usize; 2]; 2],
    deferred: std::collections::VecDeque<Task>,
    tasks: Vec<Task>,
}

impl DualPipeOrder {
    fn forward(&mut self, c: usize) {
        if let Some(&m) = self.mbs[c].get(self.next[0][c]) {
            self.tasks.push(Task::new(TaskKind::Forward, self.chunk[c], m));
        }
        self.next[0][c] += 1;
    }
    /// A backward of chunk `c`: whole, or (`split`) its input gradient now and its weight
    /// gradient deferred.
    fn backward(&mut self, c: usize, split: bool) {
        if let Some(&m) = self.mbs[c].get(self.next[1][c]) {
            if split {
                self.tasks.push(Task::new(TaskKind::BackwardInput, self.chunk[c], m));
                self.deferred.push_back(Task::new(TaskKind::BackwardWeight, self.chunk[c], m));
            } else {
                self.tasks.push(Task::new(TaskKind::Backward, self.chunk[c], m));
            }
        }
        self.next[1][c] += 1;
    }
    /// The oldest deferred weight gradient.
    fn weight(&mut self) {
        if let Some(t) = self.deferred.pop_front() {
            self.tasks.push(t);
        }
    }
}

/// The eight steps DualPipe and DualPipeV run on a device whose two chunks are `chunk`
/// (phase 0 first), `r` of R from the pipeline's end (see [`dualpipe_v`]).
fn dualpipe_steps(p: &Placement, dev: DeviceId, chunk: [usize; 2], ranks: usize, r: usize) -> Vec<Task> {
    let mbs = [p.local_microbatches(chunk[0], dev), p.local_microbatches(chunk[1], dev)];
    let n = mbs[0].len();
    let mut o = DualPipeOrder { chunk, mbs, next: [[0; 2]; 2], deferred: Default::default(), tasks: Vec::new() };
    let rest = ranks - 1 - r;
    for _ in 0..2 * rest {
        o.forward(0);
    }
    for _ in 0..=r {
        o.forward(0);
        o.forward(1);
    }
    for _ in 0..rest {
        o.backward(1, true);
        o.weight();
        o.forward(1);
    }
    for _ in 0..(n + r + 1).saturating_sub(2 * ranks) {
        o.forward(0);
        o.backward(1, false);
        o.forward(1);
        o.backward(0, false);
    }
    for _ in 0..rest {
        o.backward(1, false);
        o.forward(1);
        o.backward(0, false);
    }
    let (mut split, pairs) = (false, r + 1);
    let middle = pairs / 2;
    for i in 0..pairs {
        if i == middle && !r.is_multiple_of(2) {
            split = true;
        }
        o.backward(1, split);
        if i == middle && r.is_multiple_of(2) {
            split = true;
        }
        o.backward(0, split);
    }
    for _ in 0..rest {
        o.weight();
        o.backward(0, true);
    }
    while !o.deferred.is_empty() {
        o.weight();
    }
    o.tasks
}

/// Chimera: two pipelines in opposite directions over the same devices (stage s of the
/// down pipeline on device s, of the up pipeline on device D−1−s; with data parallelism R
/// such pairs side by side, see `compile::place`). Microbatches come in basic units of D
/// per pair (the last unit may be smaller), the first half of a unit going down, the
/// second half up. Each unit is a list schedule that runs the task furthest along its
/// microbatch's path first, with 1F1B's in-flight bound per stage copy: D−2 idle passes
/// per device with equal forward and backward times, the paper's basic unit. Units are then
/// concatenated ([`concatenate`]) so that the next unit's forwards fill the previous unit's
/// drain: with equal pass times that is seamless, (D−2)/(2N+D−2) for every N = kD.
/// `backward_slots` is the plan's backward time in forwards (rounded), which the
/// concatenation packs against.
fn chimera(p: &Placement, backward_slots: usize) -> Order {
    let d = p.stages().max(1);
    // with data parallelism, R pipeline pairs side by side: a unit is D microbatches per pair
    let pairs = (p.replicas.first().map_or(2, Vec::len) / 2).max(1);
    let mut units: Vec<Order> = Vec::new();
    let mut first = 0usize;
    // units with the same routes have the same order but for their microbatches' numbers:
    // scheduled once (a large search bounds Chimera on thousands of microbatches)
    let mut scheduled: rustc_hash::FxHashMap<Vec<Vec<u32>>, Order> = Default::default();
    while first < p.microbatches {
        let mbs: Vec<usize> = (first..(first + pairs * d).min(p.microbatches)).collect();
        first += mbs.len();
        let route: Vec<Vec<u32>> = p.route.iter().map(|r| mbs.iter().map(|&m| r[m]).collect()).collect();
        let mut unit = scheduled
            .entry(route)
            .or_insert_with_key(|route| {
                let sub = Placement {
                    replicas: p.replicas.clone(),
                    route: route.clone(),
                    devices: p.devices,
                    microbatches: mbs.len(),
                };
                list_schedule(&sub, false, |_, s| in_flight_target(&sub, s), Priority::BackwardFirst)
            })
            .clone();
        for t in unit.iter_mut().flatten() {
            t.mb = MicrobatchId(mbs[t.mb.0 as usize] as u32);
        }
        units.push(unit);
    }
    concatenate(p, &units, backward_slots.max(1), d + d / 2)
}

/// Concatenates the units of a unit schedule (Chimera's "direct concatenation"): every
/// device runs each unit's tasks in that unit's order, a forward taking one slot and a
/// backward `backward_slots`; whenever a device is free it starts the ready task of the
/// earliest unit that has one. A later unit's forward waits while the device holds
/// `max_in_flight` microbatches' activations, unless it belongs to the device's oldest
/// unfinished unit — the oldest unit is never held back, so this always completes.
fn concatenate(p: &Placement, units: &[Order], backward_slots: usize, max_in_flight: usize) -> Order {
    let stages = p.stages();
    let mut finish = Finish::new(stages, p.microbatches);
    let mut next = vec![vec![0usize; units.len()]; p.devices];
    let mut busy_until = vec![0usize; p.devices];
    let mut in_flight = vec![0usize; p.devices];
    let mut order: Order = vec![Vec::new(); p.devices];
    let total: usize = units.iter().map(|o| o.iter().map(Vec::len).sum::<usize>()).sum();
    let mut placed = 0;
    let mut time = 0usize;
    // every slot starts at least one task somewhere until all are placed
    let horizon = (backward_slots + 1) * (total + stages + 1);
    let active: Vec<usize> = (0..p.devices).filter(|&d| units.iter().any(|u| !u[d].is_empty())).collect();
    while placed < total && time <= horizon {
        for &dev in &active {
            if busy_until[dev] > time {
                continue;
            }
            let oldest = (0..units.len()).find(|&u| next[dev][u] < units[u][dev].len());
            for u in 0..units.len() {
                let Some(&task) = units[u][dev].get(next[dev][u]) else { continue };
                let (s, m) = (task.stage.0 as usize, task.mb.0 as usize);
                let ready = is_ready(&finish, &task, time, stages, false);
                let room = task.kind != TaskKind::Forward || in_flight[dev] < max_in_flight || Some(u) == oldest;
                if !(ready && room) {
                    continue;
                }
                let cost = if task.kind == TaskKind::Forward {
                    in_flight[dev] += 1;
                    1
                } else {
                    in_flight[dev] = in_flight[dev].saturating_sub(1);
                    backward_slots
                };
                busy_until[dev] = time + cost;
                finish.insert((task.kind, s, m), time + cost);
                next[dev][u] += 1;
                order[dev].push(task);
                placed += 1;
                break;
            }
        }
        time += 1;
    }
    order // complete: the verifier would report any task missing
}

/// When each started task finishes, by (kind, stage, microbatch): a dense table (the list
/// schedulers look tasks up for every free device at every slot), in 32-bit slots (a
/// schedule's slots number its tasks times a pass's few slots at most).
struct Finish {
    stages: usize,
    microbatches: usize,
    at: Vec<u32>,
}

impl Finish {
    fn new(stages: usize, microbatches: usize) -> Self {
        Finish { stages, microbatches, at: vec![u32::MAX; 4 * stages * microbatches] }
    }
    fn slot(&self, (k, s, m): (TaskKind, usize, usize)) -> usize {
        let kind = match k {
            TaskKind::Forward => 0,
            TaskKind::Backward => 1,
            TaskKind::BackwardInput => 2,
            TaskKind::BackwardWeight => 3,
        };
        (kind * self.stages + s) * self.microbatches + m
    }
    fn insert(&mut self, task: (TaskKind, usize, usize), finish: usize) {
        let i = self.slot(task);
        if let Some(x) = self.at.get_mut(i) {
            *x = u32::try_from(finish).unwrap_or(u32::MAX - 1);
        }
    }
    fn get(&self, task: &(TaskKind, usize, usize)) -> Option<usize> {
        self.at.get(self.slot(*task)).filter(|f| **f != u32::MAX).map(|&f| f as usize)
    }
    #[cfg(test)]
    fn started(&self, task: (TaskKind, usize, usize)) -> bool {
        self.get(&task).is_some()
    }
}

/// Whether task `t` may start at slot `now`: its forward input and, for a backward, its own
/// forward and the next stage's gradient (the input-gradient pass when `split`) are done.
fn is_ready(done: &Finish, t: &Task, now: usize, stages: usize, split: bool) -> bool {
    let (s, m) = (t.stage.0 as usize, t.mb.0 as usize);
    let fin = |k: TaskKind, s: usize| done.get(&(k, s, m)).is_some_and(|f| f <= now);
    match t.kind {
        TaskKind::Forward => s == 0 || fin(TaskKind::Forward, s - 1),
        TaskKind::Backward | TaskKind::BackwardInput => {
            fin(TaskKind::Forward, s)
                && (s + 1 == stages || fin(if split { TaskKind::BackwardInput } else { TaskKind::Backward }, s + 1))
        }
        TaskKind::BackwardWeight => fin(TaskKind::BackwardInput, s),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Priority {
    BackwardFirst,
    ZeroBubble,
}

/// A deterministic unit-time list scheduler: forward and each backward half take one slot,
/// a full backward two. At every slot each free device starts the best ready task.
/// `limit(dev, stage)` bounds the microbatches in flight (forward done, activations not yet
/// freed) per device (zero-bubble) or per stage instance (others).
///
/// Event-driven: a task enters its device's pending queue when the last task it depends on
/// starts (its release is when they all finish), and its ready set once the slot reaches
/// that release; a free device takes the best ready task the in-flight bound allows. The
/// order is the one scanning every task of the device at every slot would give — ranks are
/// unique per device, ties broken as that scan did (stage, microbatch, kind) — at a cost
/// linear in the tasks instead of quadratic.
fn list_schedule(p: &Placement, split: bool, limit: impl Fn(DeviceId, usize) -> usize, priority: Priority) -> Order {
    use std::cmp::Reverse;
    use std::collections::{BTreeSet, BinaryHeap};
    let stages = p.stages();
    let n = p.microbatches;
    // finish time of each task, when started
    let mut done = Finish::new(stages, n);
    let backward = if split { TaskKind::BackwardInput } else { TaskKind::Backward };
    let kind_index = |k: TaskKind| match k {
        TaskKind::Forward => 0u8,
        TaskKind::Backward | TaskKind::BackwardInput => 1,
        TaskKind::BackwardWeight => 2,
    };
    // lower rank = higher priority; ties broken by microbatch, then by the later stage
    // (drains the pipeline first)
    let rank = |k: TaskKind, s: usize, m: usize| -> u64 {
        match priority {
            // Chimera: the task whose microbatch is furthest along its whole
            // forward-and-backward path first — it frees the devices after it soonest, which
            // interleaves the two directions as Chimera's schedule does (its bubble for N = D).
            Priority::BackwardFirst => {
                let progress = if k == TaskKind::Forward { s } else { 2 * stages - 1 - s };
                ((2 * stages - progress) as u64) << 24 | m as u64
            }
            // Zero-bubble: input gradients, then forwards, then weight passes; oldest
            // microbatch first.
            Priority::ZeroBubble => {
                let class = match k {
                    TaskKind::Backward | TaskKind::BackwardInput => 0u64,
                    TaskKind::Forward => 1,
                    TaskKind::BackwardWeight => 2,
                };
                class << 48 | (m as u64) << 16 | (stages - s) as u64
            }
        }
    };
    // what a task waits for
    let prerequisites = |k: TaskKind, s: usize, m: usize| -> [Option<(TaskKind, usize, usize)>; 2] {
        match k {
            TaskKind::Forward => [(s > 0).then(|| (TaskKind::Forward, s - 1, m)), None],
            TaskKind::Backward | TaskKind::BackwardInput => {
                [Some((TaskKind::Forward, s, m)), (s + 1 < stages).then(|| (backward, s + 1, m))]
            }
            TaskKind::BackwardWeight => [Some((TaskKind::BackwardInput, s, m)), None],
        }
    };
    // what may wait for a task
    let dependents = |k: TaskKind, s: usize, m: usize| -> [Option<(TaskKind, usize, usize)>; 2] {
        match k {
            TaskKind::Forward => [(s + 1 < stages).then(|| (TaskKind::Forward, s + 1, m)), Some((backward, s, m))],
            TaskKind::Backward => [(s > 0).then(|| (backward, s - 1, m)), None],
            TaskKind::BackwardInput => [(s > 0).then(|| (backward, s - 1, m)), Some((TaskKind::BackwardWeight, s, m))],
            TaskKind::BackwardWeight => [None, None],
        }
    };
    type Key = (u64, usize, usize, u8, TaskKind);
    let key = |k: TaskKind, s: usize, m: usize| -> Key { (rank(k, s, m), s, m, kind_index(k), k) };
    let mut pending: Vec<BinaryHeap<Reverse<(usize, Key)>>> = vec![BinaryHeap::new(); p.devices];
    let mut ready: Vec<BTreeSet<Key>> = vec![BTreeSet::new(); p.devices];
    for m in 0..n {
        pending[p.device_of(0, m).0 as usize].push(Reverse((0, key(TaskKind::Forward, 0, m))));
    }
    let active: Vec<usize> = (0..p.devices).filter(|&d| !p.stages_of(DeviceId(d as u32)).is_empty()).collect();
    let mut order = vec![Vec::new(); p.devices];
    let mut busy_until = vec![0usize; p.devices];
    let mut in_flight: rustc_hash::FxHashMap<(usize, usize), usize> = Default::default(); // (device, stage or MAX) -> count
    let total_tasks = stages * n * if split { 3 } else { 2 };
    let mut scheduled = 0usize;
    let mut time = 0usize;
    let cost = |k: TaskKind| if k == TaskKind::Backward { 2 } else { 1 };
    let flight_key = |d: usize, s: usize| if priority == Priority::ZeroBubble { (d, usize::MAX) } else { (d, s) };
    while scheduled < total_tasks {
        for &d in &active {
            if busy_until[d] > time {
                continue;
            }
            while let Some(&Reverse((release, k))) = pending[d].peek() {
                if release > time {
                    break;
                }
                pending[d].pop();
                ready[d].insert(k);
            }
            let dev = DeviceId(d as u32);
            let chosen = ready[d].iter().copied().find(|&(_, s, _, _, k)| {
                k != TaskKind::Forward || in_flight.get(&flight_key(d, s)).copied().unwrap_or(0) < limit(dev, s)
            });
            let Some(chosen) = chosen else { continue };
            ready[d].remove(&chosen);
            let (_, s, m, _, k) = chosen;
            let fin = time + cost(k);
            done.insert((k, s, m), fin);
            busy_until[d] = fin;
            order[d].push(Task::new(k, s, m));
            scheduled += 1;
            match k {
                TaskKind::Forward => *in_flight.entry(flight_key(d, s)).or_insert(0) += 1,
                TaskKind::Backward | TaskKind::BackwardWeight => {
                    if let Some(c) = in_flight.get_mut(&flight_key(d, s)) {
                        *c = c.saturating_sub(1);
                    }
                }
                TaskKind::BackwardInput => {}
            }
            // the tasks this one was the last to start for: pending from when all finish
            for (dk, ds, dm) in dependents(k, s, m).into_iter().flatten() {
                let release = prerequisites(dk, ds, dm)
                    .into_iter()
                    .flatten()
                    .try_fold(0usize, |r, t| done.get(&t).map(|f| r.max(f)));
                if let Some(release) = release {
                    pending[p.device_of(ds, dm).0 as usize].push(Reverse((release, key(dk, ds, dm))));
                }
            }
        }
        time += 1;
        if time > 64 * (total_tasks + 4) {
            break; // cannot happen for a valid placement; the verifier reports what is missing
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The list scheduler as first written: every free device scans every task it holds at
    /// every slot. The reference the event-driven scheduler must reproduce.
    fn scan_reference(
        p: &Placement,
        split: bool,
        limit: impl Fn(DeviceId, usize) -> usize,
        priority: Priority,
    ) -> Order {
        use std::collections::HashMap;
        let stages = p.stages();
        let n = p.microbatches;
        // finish time of each task, when done
        let mut done = Finish::new(stages, n);
        // per device: the stages it holds and their microbatches, in order
        let local: Vec<Vec<(usize, Vec<usize>)>> = (0..p.devices)
            .map(|d| {
                let dev = DeviceId(d as u32);
                p.stages_of(dev).into_iter().map(|s| (s, p.local_microbatches(s, dev))).collect()
            })
            .collect();
        let mut order = vec![Vec::new(); p.devices];
        let mut busy_until = vec![0usize; p.devices];
        let mut in_flight: HashMap<(usize, usize), usize> = HashMap::new(); // (device, stage or MAX) -> count
        let total_tasks = stages * n * if split { 3 } else { 2 };
        let mut scheduled = 0usize;
        let mut time = 0usize;
        let cost = |k: TaskKind| if k == TaskKind::Backward { 2 } else { 1 };
        let ready = |done: &Finish, t: &Task, now: usize| is_ready(done, t, now, stages, split);
        while scheduled < total_tasks {
            for d in 0..p.devices {
                if busy_until[d] > time {
                    continue;
                }
                let dev = DeviceId(d as u32);
                let mut candidates: Vec<(u64, Task)> = Vec::new();
                for (s, mbs) in &local[d] {
                    let s = *s;
                    for &m in mbs {
                        let kinds: &[TaskKind] = if split {
                            &[TaskKind::Forward, TaskKind::BackwardInput, TaskKind::BackwardWeight]
                        } else {
                            &[TaskKind::Forward, TaskKind::Backward]
                        };
                        for &k in kinds {
                            let t = Task::new(k, s, m);
                            if done.started((k, s, m)) || !ready(&done, &t, time) {
                                continue;
                            }
                            let key = if priority == Priority::ZeroBubble { (d, usize::MAX) } else { (d, s) };
                            if k == TaskKind::Forward && in_flight.get(&key).copied().unwrap_or(0) >= limit(dev, s) {
                                continue;
                            }
                            // lower rank = higher priority; ties broken by microbatch, then by
                            // the later stage (drains the pipeline first)
                            let class = match (priority, k) {
                                (_, TaskKind::Backward) | (_, TaskKind::BackwardInput) => 0,
                                (_, TaskKind::Forward) => 1,
                                (_, TaskKind::BackwardWeight) => 2,
                            };
                            // Zero-bubble: oldest microbatch first. Chimera: the task whose
                            // microbatch is furthest along its whole forward-and-backward path
                            // first — it frees the devices after it soonest, which interleaves the
                            // two directions as Chimera's schedule does (its bubble for N = D).
                            let rank = match priority {
                                Priority::BackwardFirst => {
                                    let progress = if k == TaskKind::Forward { s } else { 2 * stages - 1 - s };
                                    ((2 * stages - progress) as u64) << 24 | m as u64
                                }
                                Priority::ZeroBubble => (class as u64) << 48 | (m as u64) << 16 | (stages - s) as u64,
                            };
                            candidates.push((rank, t));
                        }
                    }
                }
                // A deferred weight pass must not wait forever: once nothing else is ready it runs.
                if let Some(&(_, t)) = candidates.iter().min_by_key(|c| c.0) {
                    let (s, m) = (t.stage.0 as usize, t.mb.0 as usize);
                    let fin = time + cost(t.kind);
                    done.insert((t.kind, s, m), fin);
                    busy_until[d] = fin;
                    order[d].push(t);
                    scheduled += 1;
                    let key = if priority == Priority::ZeroBubble { (d, usize::MAX) } else { (d, s) };
                    match t.kind {
                        TaskKind::Forward => *in_flight.entry(key).or_insert(0) += 1,
                        TaskKind::Backward | TaskKind::BackwardWeight => {
                            if let Some(c) = in_flight.get_mut(&key) {
                                *c = c.saturating_sub(1);
                            }
                        }
                        TaskKind::BackwardInput => {}
                    }
                }
            }
            time += 1;
            if time > 64 * (total_tasks + 4) {
                break; // cannot happen for a valid placement; the verifier reports what is missing
            }
        }
        order
    }

    proptest::proptest! {
        /// The event-driven list scheduler gives the scan's order on every placement shape
        /// the schedules use: replicated stages, several chunks per device, Chimera's down
        /// and up copies, split and whole backwards, both priorities, tight in-flight bounds.
        #[test]
        fn the_event_driven_list_scheduler_equals_the_scan(
            ranks in 1usize..6,
            chunks in 1usize..3,
            replicas in 1usize..4,
            per_replica in 1usize..7,
            split: bool,
            chimera_priority: bool,
            bound in 1usize..5,
        ) {
            let stages = ranks * chunks;
            let microbatches = replicas * per_replica;
            let p = Placement {
                // chunk c on rank c % ranks; rank r's replicas r·R .. r·R + R
                replicas: (0..stages)
                    .map(|c| (0..replicas).map(|q| DeviceId(((c % ranks) * replicas + q) as u32)).collect())
                    .collect(),
                route: vec![(0..microbatches as u32).map(|m| m % replicas as u32).collect(); stages],
                devices: ranks * replicas + 1,
                microbatches,
            };
            let priority = if chimera_priority { Priority::BackwardFirst } else { Priority::ZeroBubble };
            let limit = |d: DeviceId, s: usize| bound + (d.0 as usize + s) % 2;
            let got = list_schedule(&p, split, limit, priority);
            let want = scan_reference(&p, split, limit, priority);
            proptest::prop_assert_eq!(text(&got), text(&want));
        }
    }

    fn straight(stages: usize, microbatches: usize) -> Placement {
        Placement {
            replicas: (0..stages).map(|s| vec![DeviceId(s as u32)]).collect(),
            route: vec![vec![0; microbatches]; stages],
            devices: stages,
            microbatches,
        }
    }

    fn text(order: &Order) -> Vec<String> {
        order.iter().map(|ts| ts.iter().map(ToString::to_string).collect::<Vec<_>>().join(" ")).collect()
    }

    #[test]
    fn one_f_one_b_matches_pytorch_order() {
        // torch.distributed.pipelining Schedule1F1B, 4 ranks, 8 microbatches (runtime order)
        let order = text(&one_f_one_b(&straight(4, 8), 0));
        assert_eq!(order[0], "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7");
        assert_eq!(order[3], "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7");
    }

    #[test]
    fn the_combined_1f1b_runs_one_more_forward_and_pairs_each_forward_with_an_earlier_backward() {
        use pipec_plan::schedule::Pairing;
        // Megatron-LM's combined_1f1b_schedule_for_no_pipelining, 4 microbatches: F0, then
        // B0 with F1, B1 with F2, B2 with F3, then B3
        let one = generate(ScheduleKind::DpOnly, &straight(1, 4), 1, 1, true);
        assert_eq!(text(&one)[0], "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3");
        let pairs: Vec<String> = (0..one[0].len())
            .filter_map(|i| {
                paired_backward(&one[0], i, |_| false, Pairing::OtherTask).map(|b| format!("{}+{b}", one[0][i]))
            })
            .collect();
        assert_eq!(pairs, ["0F1+0B0", "0F2+0B1", "0F3+0B2"]);
        // without `ep_overlap` the forward's own backward follows it: no pair
        let plain = generate(ScheduleKind::DpOnly, &straight(1, 4), 1, 1, false);
        assert_eq!(text(&plain)[0], "0F0 0B0 0F1 0B1 0F2 0B2 0F3 0B3");
        assert!((0..8).all(|i| paired_backward(&plain[0], i, |_| false, Pairing::OtherTask).is_none()));
        // a pipeline: every stage's warm-up one forward longer (the last stage's 1F1B phase
        // too), the interleaved schedule's as `schedules.py` counts it (+1)
        let piped = text(&generate(ScheduleKind::OneFOneB, &straight(2, 4), 2, 1, true));
        assert_eq!(piped, ["0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3", "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3"]);
        // schedules without the 1F1B phase keep their order
        let g = |c| text(&generate(ScheduleKind::Gpipe, &straight(2, 3), 2, 1, c));
        assert_eq!(g(true), g(false));
    }

    #[test]
    fn gpipe_matches_pytorch_order() {
        let order = text(&gpipe(&straight(2, 3)));
        assert_eq!(order[0], "0F0 0F1 0F2 0B0 0B1 0B2");
    }

    #[test]
    fn interleaved_matches_megatron_and_pytorch_order() {
        // 2 ranks, 2 chunks each (stages 0..4, stage s on rank s % 2), 4 microbatches
        let p = Placement {
            replicas: (0..4).map(|s| vec![DeviceId((s % 2) as u32)]).collect(),
            route: vec![vec![0; 4]; 4],
            devices: 2,
            microbatches: 4,
        };
        let order = text(&interleaved(&p, 2, 0));
        assert_eq!(order[0], "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3");
        assert_eq!(order[1], "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3");
    }
}
