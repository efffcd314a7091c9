//! How workers exchange tensors: point-to-point messages between devices and all-reduce over
//! a group. The interpreter only sees the [`Endpoint`] trait; [`in_process`] implements it
//! with channels between threads, and the MPI back end implements it between processes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipec_plan::{CollectiveKind, DeviceId, Precision, ReduceMode};

/// Identifies a point-to-point message: the plan's message identity, which both ends
/// compute from their instructions (`Instr::transfer`).
pub type Tag = pipec_plan::MessageId;

/// A tensor on the wire: its tag, shape and values.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub tag: Tag,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Why a transfer failed.
#[derive(Debug, Clone, PartialEq)]
pub enum TransportError {
    /// Nothing arrived within the timeout.
    Timeout {
        from: DeviceId,
        waited: Duration,
    },
    /// Another worker failed and the run is being stopped.
    Aborted,
    /// The peer is gone.
    Disconnected(DeviceId),
    /// The next message on the link is not the expected one.
    Mismatch {
        from: DeviceId,
        expected: Tag,
        got: Tag,
    },
    Other(String),
}

impl std::fmt::Display for TransportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransportError::Timeout { from, waited } => {
                write!(f, "nothing arrived from {from} within {:.0} s", waited.as_secs_f64())
            }
            TransportError::Aborted => write!(f, "stopped because another worker failed"),
            TransportError::Disconnected(d) => write!(f, "{d} disconnected"),
            TransportError::Mismatch { from, expected, got } => {
                write!(f, "expected the {expected} from {from}, got the {got} (out of order)")
            }
            TransportError::Other(s) => f.write_str(s),
        }
    }
}

/// One device's connection to the others.
pub trait Endpoint: Send {
    fn device(&self) -> DeviceId;
    /// Splits the endpoint into its point-to-point half and its collective half, each
    /// driven by its own thread (see `comm`): a collective in flight never holds up a
    /// message. Each half fails the other half's calls.
    fn split(self) -> (Self, Self)
    where
        Self: Sized;
    /// A handle that sends this device's point-to-point messages from the computing thread
    /// while another thread receives (one sender per link keeps each link's order).
    fn send_half(&self) -> Box<dyn SendHalf>;
    /// A handle that receives this device's point-to-point messages on the computing
    /// thread itself, taken from the endpoint (its own receives then fail), where the
    /// transport buffers every message without a posted receive: the in-process channels.
    /// None where receives must be posted ahead (MPI, TCP): a thread of `comm` posts them.
    fn recv_half(&mut self) -> Option<Box<dyn RecvHalf>> {
        None
    }
    /// Sends a point-to-point message (asynchronous: returns without waiting for the peer).
    fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError>;
    /// Receives the next point-to-point message from `from`, which must carry `tag`.
    fn recv(&mut self, from: DeviceId, tag: Tag) -> Result<Message, TransportError>;
    /// Collective traffic, kept apart from point-to-point messages.
    fn coll_send(&mut self, to: DeviceId, data: Vec<f32>) -> Result<(), TransportError>;
    fn coll_recv(&mut self, from: DeviceId) -> Result<Vec<f32>, TransportError>;

    /// Runs a collective of `kind` over `group` on this member's `data` and returns its
    /// result: the one place a transport handles each kind, on top of its collective
    /// traffic (`coll_send`, `coll_recv`), so every transport computes the same values in
    /// the same order. `AllReduce`: the sum, by a ring or a parameter server (`algorithm`);
    /// `ReduceScatter`: this member's chunk of the sum (ring); `AllGather`: every member's
    /// chunk, in member order (ring). A sum in bf16 or fp16 (`round`, [`Rounding`]) rounds
    /// the member's values and every partial sum to that type.
    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: &[DeviceId],
        mut data: Vec<f32>,
        algorithm: ReduceMode,
        round: Option<Rounding>,
    ) -> Result<Vec<f32>, TransportError> {
        match (kind, algorithm) {
            (CollectiveKind::AllReduce, ReduceMode::Ring) => {
                Ring { ep: self, group, round }.all_reduce(&mut data).map(|()| data)
            }
            (CollectiveKind::AllReduce, ReduceMode::ParameterServer) => {
                ps_all_reduce(self, group, &mut data, round).map(|()| data)
            }
            (CollectiveKind::ReduceScatter, _) => ring_reduce_scatter(self, group, data, round),
            (CollectiveKind::AllGather, _) => ring_all_gather(self, group, data),
            (CollectiveKind::AllToAll, _) => pairwise_all_to_all(self, group, data),
        }
    }

    /// An all-to-all of chunks of any size: `chunks[j]` goes to member j of `group`; the
    /// result's i-th chunk is what member i sent this one ([`pairwise_exchange`]).
    fn all_to_all_v(&mut self, group: &[DeviceId], chunks: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, TransportError> {
        pairwise_exchange(self, group, chunks)
    }
}

/// The sending side of a device's point-to-point messages.
pub trait SendHalf: Send {
    fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError>;
}

/// The receiving side of a device's point-to-point messages, where the computing thread
/// receives them itself ([`Endpoint::recv_half`]).
pub trait RecvHalf: Send {
    /// The next point-to-point message from `from`, which must carry `tag`.
    fn recv(&mut self, from: DeviceId, tag: Tag) -> Result<Message, TransportError>;
}

fn chunk(len: usize, p: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / p;
    let extra = len % p;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// This member's position in `group`, and its ring neighbours (next, previous).
fn ring_position<E: Endpoint + ?Sized>(
    ep: &E,
    group: &[DeviceId],
) -> Result<(usize, DeviceId, DeviceId), TransportError> {
    let p = group.len();
    let me = group
        .iter()
        .position(|d| *d == ep.device())
        .ok_or_else(|| TransportError::Other(format!("{} is not in its collective's group", ep.device())))?;
    Ok((me, group[(me + 1) % p], group[(me + p - 1) % p]))
}

/// A reduction in bf16 or fp16: the gradients in each member's data and every partial sum
/// of them rounded by `to`, to nearest with ties to even, as NCCL's bf16 and fp16
/// reductions store each hop's sum in the buffer's type. The data is segments of `period`
/// values whose first `values` are gradients; the rest of each (batch statistics) adds in
/// fp32.
#[derive(Clone, Copy, Debug)]
pub struct Rounding {
    pub to: fn(f32) -> f32,
    pub values: usize,
    pub period: usize,
}

impl Rounding {
    /// The rounding of a sum in `precision` of data in segments of `period` values whose
    /// first `values` round; None for fp32 (exact f32 additions).
    pub fn of(precision: Precision, values: usize, period: usize) -> Option<Rounding> {
        let to: fn(f32) -> f32 = match precision {
            Precision::Fp32 => return None,
            Precision::Bf16 => |x| half::bf16::from_f32(x).to_f32(),
            Precision::Fp16 => |x| half::f16::from_f32(x).to_f32(),
        };
        Some(Rounding { to, values, period: period.max(1) })
    }

    /// A reduction of gradients in `precision`: `len` values, `n_stats` batch statistics
    /// after the gradients of each member's segment — the whole data for an all-reduce, each
    /// of the `members` segments of a reduce-scatter's input.
    pub fn of_gradients(
        precision: Precision,
        kind: CollectiveKind,
        len: usize,
        members: usize,
        n_stats: usize,
    ) -> Option<Rounding> {
        let period = if kind == CollectiveKind::ReduceScatter { len / members.max(1) } else { len };
        Rounding::of(precision, period.saturating_sub(n_stats), period)
    }

    /// Value `at` of the data: rounded when it is a gradient.
    fn at(self, at: usize, x: f32) -> f32 {
        if at % self.period < self.values {
            (self.to)(x)
        } else {
            x
        }
    }

    /// Rounds `data`'s own values (before they are summed).
    fn own(round: Option<Rounding>, data: &mut [f32]) {
        if let Some(r) = round {
            data.iter_mut().enumerate().for_each(|(i, x)| *x = r.at(i, *x));
        }
    }
}

/// One member's part in a ring over `group`: its endpoint, and how its sums round.
struct Ring<'a, E: Endpoint + ?Sized> {
    ep: &'a mut E,
    group: &'a [DeviceId],
    round: Option<Rounding>,
}

impl<E: Endpoint + ?Sized> Ring<'_, E> {
    /// The reduce-scatter half: p−1 steps of n/p values each, after which member `me`
    /// holds the complete sum of chunk `(me + 1) mod p` in place (each value and partial
    /// sum rounded).
    fn reduce_half(&mut self, data: &mut [f32]) -> Result<(), TransportError> {
        let (p, round) = (self.group.len(), self.round);
        let (me, next, prev) = ring_position(self.ep, self.group)?;
        let n = data.len();
        Rounding::own(round, data);
        for step in 0..p - 1 {
            let send_i = (me + p - step) % p;
            let recv_i = (me + p - step - 1) % p;
            self.ep.coll_send(next, data[chunk(n, p, send_i)].to_vec())?;
            let incoming = self.ep.coll_recv(prev)?;
            let range = chunk(n, p, recv_i);
            if incoming.len() != range.len() {
                return Err(TransportError::Other("members of a collective sent different sizes".into()));
            }
            let start = range.start;
            match round {
                None => data[range].iter_mut().zip(incoming).for_each(|(d, x)| *d += x),
                Some(r) => data[range]
                    .iter_mut()
                    .zip(incoming)
                    .enumerate()
                    .for_each(|(k, (d, x))| *d = r.at(start + k, *d + x)),
            }
        }
        Ok(())
    }

    /// The all-reduce: the reduce-scatter half, then the all-gather, 2(p−1) steps of n/p
    /// values each.
    fn all_reduce(&mut self, data: &mut [f32]) -> Result<(), TransportError> {
        let p = self.group.len();
        if p <= 1 {
            Rounding::own(self.round, data);
            return Ok(());
        }
        self.reduce_half(data)?;
        let (me, next, prev) = ring_position(self.ep, self.group)?;
        let n = data.len();
        for step in 0..p - 1 {
            let send_i = (me + 1 + p - step) % p;
            let recv_i = (me + p - step) % p;
            self.ep.coll_send(next, data[chunk(n, p, send_i)].to_vec())?;
            let incoming = self.ep.coll_recv(prev)?;
            data[chunk(n, p, recv_i)].copy_from_slice(&incoming);
        }
        Ok(())
    }
}

/// Ring all-reduce: reduce-scatter then all-gather, 2(p−1) steps of n/p values each.
pub fn ring_all_reduce<E: Endpoint + ?Sized>(
    ep: &mut E,
    group: &[DeviceId],
    data: &mut [f32],
) -> Result<(), TransportError> {
    Ring { ep, group, round: None }.all_reduce(data)
}

/// Ring reduce-scatter: the ring's first half, then member i's chunk (the i-th of p, the
/// first `n mod p` one value longer) handed to it by its neighbour: p steps in all, the
/// same sums in the same order as the all-reduce's.
pub fn ring_reduce_scatter<E: Endpoint + ?Sized>(
    ep: &mut E,
    group: &[DeviceId],
    mut data: Vec<f32>,
    round: Option<Rounding>,
) -> Result<Vec<f32>, TransportError> {
    let p = group.len();
    if p <= 1 {
        Rounding::own(round, &mut data);
        return Ok(data);
    }
    Ring { ep: &mut *ep, group, round }.reduce_half(&mut data)?;
    // member me holds chunk (me + 1) mod p complete: it belongs to its next neighbour
    let (me, next, prev) = ring_position(ep, group)?;
    let n = data.len();
    ep.coll_send(next, data[chunk(n, p, (me + 1) % p)].to_vec())?;
    let mine = ep.coll_recv(prev)?;
    if mine.len() != chunk(n, p, me).len() {
        return Err(TransportError::Other("members of a reduce-scatter sent different sizes".into()));
    }
    Ok(mine)
}

/// Ring all-gather: p−1 steps, each member forwarding the chunk it last received; the
/// result is every member's chunk in member order.
pub fn ring_all_gather<E: Endpoint + ?Sized>(
    ep: &mut E,
    group: &[DeviceId],
    data: Vec<f32>,
) -> Result<Vec<f32>, TransportError> {
    let p = group.len();
    if p <= 1 {
        return Ok(data);
    }
    let (me, next, prev) = ring_position(ep, group)?;
    let mut chunks: Vec<Option<Vec<f32>>> = vec![None; p];
    chunks[me] = Some(data);
    for step in 0..p - 1 {
        let send_i = (me + p - step) % p;
        let recv_i = (me + p - step - 1) % p;
        ep.coll_send(next, chunks[send_i].clone().unwrap_or_default())?;
        chunks[recv_i] = Some(ep.coll_recv(prev)?);
    }
    Ok(chunks.into_iter().flatten().flatten().collect())
}

/// Pairwise exchange: `chunks[j]` is for member j of `group`; in step k = 1..p member `me`
/// sends the chunk of member me + k and receives from member me − k (mod p), so every pair
/// meets once and no member waits on a send. The result is the chunks addressed to `me`,
/// in member order (its own unmoved).
pub fn pairwise_exchange<E: Endpoint + ?Sized>(
    ep: &mut E,
    group: &[DeviceId],
    mut chunks: Vec<Vec<f32>>,
) -> Result<Vec<Vec<f32>>, TransportError> {
    let p = group.len();
    if chunks.len() != p {
        return Err(TransportError::Other(format!("an all-to-all over {p} members was given {} chunks", chunks.len())));
    }
    if p <= 1 {
        return Ok(chunks);
    }
    let (me, _, _) = ring_position(ep, group)?;
    let mut received: Vec<Vec<f32>> = vec![Vec::new(); p];
    received[me] = std::mem::take(&mut chunks[me]);
    for k in 1..p {
        let (to, from) = ((me + k) % p, (me + p - k) % p);
        ep.coll_send(group[to], std::mem::take(&mut chunks[to]))?;
        received[from] = ep.coll_recv(group[from])?;
    }
    Ok(received)
}

/// An all-to-all of equal chunks: member `me`'s data is p chunks (`chunk(n, p, j)`), the
/// j-th for member j; the result is the chunks addressed to `me`, in member order.
pub fn pairwise_all_to_all<E: Endpoint + ?Sized>(
    ep: &mut E,
    group: &[DeviceId],
    data: Vec<f32>,
) -> Result<Vec<f32>, TransportError> {
    let p = group.len().max(1);
    let n = data.len();
    let chunks: Vec<Vec<f32>> = (0..p).map(|j| data[chunk(n, p, j)].to_vec()).collect();
    let mine = chunk(n, p, ring_position(ep, group).map_or(0, |(me, _, _)| me)).len();
    let received = pairwise_exchange(ep, group, chunks)?;
    if received.iter().any(|c| c.len() != mine) {
        return Err(TransportError::Other("members of an all-to-all sent different sizes".into()));
    }
    Ok(received.into_iter().flatten().collect())
}

/// A central parameter server (the group's first member): everyone sends, it sums in
/// member order and sends the result back.
pub fn ps_all_reduce<E: Endpoint + ?Sized>(
    ep: &mut E,
    group: &[DeviceId],
    data: &mut [f32],
    round: Option<Rounding>,
) -> Result<(), TransportError> {
    let server = group[0];
    Rounding::own(round, data);
    if ep.device() == server {
        for &m in &group[1..] {
            let part = ep.coll_recv(m)?;
            match round {
                None => data.iter_mut().zip(part).for_each(|(d, x)| *d += x),
                Some(r) => data.iter_mut().zip(part).enumerate().for_each(|(k, (d, x))| *d = r.at(k, *d + x)),
            }
        }
        for &m in &group[1..] {
            ep.coll_send(m, data.to_vec())?;
        }
    } else {
        ep.coll_send(server, data.to_vec())?;
        let sum = ep.coll_recv(server)?;
        data.copy_from_slice(&sum);
    }
    Ok(())
}

/// Channels between threads of one process.
pub mod in_process {
    use super::*;

    enum Wire {
        P2p(Message),
        Coll(Vec<f32>),
    }

    /// A device's end of the in-process transport.
    pub struct InProcessEndpoint {
        device: DeviceId,
        to_p2p: HashMap<DeviceId, Sender<Wire>>,
        to_coll: HashMap<DeviceId, Sender<Wire>>,
        from_p2p: HashMap<DeviceId, Receiver<Wire>>,
        from_coll: HashMap<DeviceId, Receiver<Wire>>,
        abort: Arc<AtomicBool>,
        timeout: Duration,
    }

    impl std::fmt::Debug for InProcessEndpoint {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "InProcessEndpoint({})", self.device)
        }
    }

    /// Endpoints for `devices`, fully connected. `abort` stops every blocked receive.
    pub fn connect(devices: &[DeviceId], abort: Arc<AtomicBool>, timeout: Duration) -> Vec<InProcessEndpoint> {
        let mut eps: Vec<InProcessEndpoint> = devices
            .iter()
            .map(|&d| InProcessEndpoint {
                device: d,
                to_p2p: HashMap::new(),
                to_coll: HashMap::new(),
                from_p2p: HashMap::new(),
                from_coll: HashMap::new(),
                abort: abort.clone(),
                timeout,
            })
            .collect();
        for i in 0..devices.len() {
            for j in 0..devices.len() {
                // p2p and collective traffic of each link travel on separate channels, so a
                // collective never meets an activation queued before it
                let (tx, rx) = channel();
                let (ctx, crx) = channel();
                eps[j].from_p2p.insert(devices[i], rx);
                eps[j].from_coll.insert(devices[i], crx);
                eps[i].to_p2p.insert(devices[j], tx);
                eps[i].to_coll.insert(devices[j], ctx);
            }
        }
        eps
    }

    /// A device's point-to-point senders, for the computing thread.
    struct InProcessSender {
        to_p2p: HashMap<DeviceId, Sender<Wire>>,
    }

    impl SendHalf for InProcessSender {
        fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError> {
            send_p2p(&self.to_p2p, to, msg)
        }
    }

    /// Queues `msg` on the point-to-point channel to `to`.
    fn send_p2p(to_p2p: &HashMap<DeviceId, Sender<Wire>>, to: DeviceId, msg: Message) -> Result<(), TransportError> {
        to_p2p
            .get(&to)
            .ok_or(TransportError::Disconnected(to))?
            .send(Wire::P2p(msg))
            .map_err(|_| TransportError::Disconnected(to))
    }

    /// Waits for the next item on `rx` from `from`, until `abort` is set or `timeout` has
    /// passed. A message already there is taken at once, without a system call; for `poll`
    /// the channel is polled (yielding the core between looks) before the thread sleeps on
    /// it ([`POLL`]).
    fn wait(
        rx: &Receiver<Wire>,
        from: DeviceId,
        abort: &AtomicBool,
        timeout: Duration,
        poll: Duration,
    ) -> Result<Wire, TransportError> {
        let start = Instant::now();
        loop {
            match rx.try_recv() {
                Ok(w) => return Ok(w),
                Err(std::sync::mpsc::TryRecvError::Empty) if start.elapsed() < poll => std::thread::yield_now(),
                // empty past the poll, or disconnected: the blocking wait says which
                Err(_) => break,
            }
        }
        loop {
            if abort.load(Ordering::Relaxed) {
                return Err(TransportError::Aborted);
            }
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(w) => return Ok(w),
                Err(RecvTimeoutError::Timeout) => {
                    if start.elapsed() > timeout {
                        return Err(TransportError::Timeout { from, waited: start.elapsed() });
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(TransportError::Disconnected(from)),
            }
        }
    }

    /// The next point-to-point message on `rx`, which must carry `tag` (`poll`: [`wait`]).
    fn recv_p2p(
        rx: &Receiver<Wire>,
        from: DeviceId,
        tag: Tag,
        abort: &AtomicBool,
        timeout: Duration,
        poll: Duration,
    ) -> Result<Message, TransportError> {
        match wait(rx, from, abort, timeout, poll)? {
            Wire::P2p(m) if m.tag == tag => Ok(m),
            Wire::P2p(m) => Err(TransportError::Mismatch { from, expected: tag, got: m.tag }),
            Wire::Coll(_) => Err(TransportError::Other("a collective message on a point-to-point channel".into())),
        }
    }

    /// A device's point-to-point receivers, for the computing thread: a message a peer
    /// sends while this device computes waits in its channel, waking no thread.
    struct InProcessReceiver {
        from_p2p: HashMap<DeviceId, Receiver<Wire>>,
        abort: Arc<AtomicBool>,
        timeout: Duration,
    }

    /// How long a computing thread, or a collective thread, polls for a message before it
    /// sleeps on the channel. A sleeping receiver must be woken by the sender, and Linux
    /// then runs it on the sender's core (wake-affine), preempting the sender while another
    /// core may be idle: on this 2-core machine a worker sending a gradient to the worker
    /// waiting for it lost its core for 55–64 µs at a time (`specs/mlp-1f1b.yaml`'s trace),
    /// and a collective thread woken by its peer's waited 370–400 µs
    /// (`specs/csv-classifier.yaml`, docs/benchmarks.md 2026-12-08). A receiver still polling
    /// takes the message on its own core; MPI's shared-memory receives poll too.
    const POLL: Duration = Duration::from_micros(200);

    impl RecvHalf for InProcessReceiver {
        fn recv(&mut self, from: DeviceId, tag: Tag) -> Result<Message, TransportError> {
            let rx = self.from_p2p.get(&from).ok_or(TransportError::Disconnected(from))?;
            recv_p2p(rx, from, tag, &self.abort, self.timeout, POLL)
        }
    }

    impl Endpoint for InProcessEndpoint {
        fn device(&self) -> DeviceId {
            self.device
        }
        fn send_half(&self) -> Box<dyn SendHalf> {
            Box::new(InProcessSender { to_p2p: self.to_p2p.clone() })
        }
        fn recv_half(&mut self) -> Option<Box<dyn RecvHalf>> {
            Some(Box::new(InProcessReceiver {
                from_p2p: std::mem::take(&mut self.from_p2p),
                abort: self.abort.clone(),
                timeout: self.timeout,
            }))
        }
        fn split(mut self) -> (Self, Self) {
            let coll = InProcessEndpoint {
                device: self.device,
                to_p2p: HashMap::new(),
                to_coll: std::mem::take(&mut self.to_coll),
                from_p2p: HashMap::new(),
                from_coll: std::mem::take(&mut self.from_coll),
                abort: self.abort.clone(),
                timeout: self.timeout,
            };
            (self, coll)
        }
        fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError> {
            send_p2p(&self.to_p2p, to, msg)
        }
        fn recv(&mut self, from: DeviceId, tag: Tag) -> Result<Message, TransportError> {
            let rx = self.from_p2p.get(&from).ok_or(TransportError::Disconnected(from))?;
            recv_p2p(rx, from, tag, &self.abort, self.timeout, Duration::ZERO)
        }
        fn coll_send(&mut self, to: DeviceId, data: Vec<f32>) -> Result<(), TransportError> {
            self.to_coll
                .get(&to)
                .ok_or(TransportError::Disconnected(to))?
                .send(Wire::Coll(data))
                .map_err(|_| TransportError::Disconnected(to))
        }
        fn coll_recv(&mut self, from: DeviceId) -> Result<Vec<f32>, TransportError> {
            let rx = self.from_coll.get(&from).ok_or(TransportError::Disconnected(from))?;
            match wait(rx, from, &self.abort, self.timeout, POLL)? {
                Wire::Coll(d) => Ok(d),
                Wire::P2p(_) => Err(TransportError::Other("a point-to-point message on a collective channel".into())),
            }
        }
    }
}

#[cfg(test)]
mod tests;
