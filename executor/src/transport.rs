//! How workers exchange tensors: point-to-point messages between devices and all-reduce over
//! a group. The interpreter only sees the [`Endpoint`] trait; [`in_process`] implements it
//! with channels between threads, and the MPI back end implements it between processes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipec_plan::{CollectiveKind, DeviceId, ReduceMode};

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
    /// Sends a point-to-point message (asynchronous: returns without waiting for the peer).
    fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError>;
    /// Receives the next point-to-point message from `from`, which must carry `tag`.
    fn recv(&mut self, from: DeviceId, tag: Tag) -> Result<Message, TransportError>;
    /// Collective traffic, kept apart from point-to-point messages.
    fn coll_send(&mut self, to: DeviceId, data: Vec<f32>) -> Result<(), TransportError>;
    fn coll_recv(&mut self, from: DeviceId) -> Result<Vec<f32>, TransportError>;

    /// Runs a collective of `kind` over `group` on `data`, in place: the one place a
    /// transport handles each kind, on top of its collective traffic (`coll_send`,
    /// `coll_recv`), so every transport computes the same values in the same order.
    /// `AllReduce`: every member ends with the sum, by a ring or a parameter server.
    fn collective(
        &mut self,
        kind: CollectiveKind,
        group: &[DeviceId],
        data: &mut [f32],
        algorithm: ReduceMode,
    ) -> Result<(), TransportError> {
        match (kind, algorithm) {
            (CollectiveKind::AllReduce, ReduceMode::Ring) => ring_all_reduce(self, group, data),
            (CollectiveKind::AllReduce, ReduceMode::ParameterServer) => ps_all_reduce(self, group, data),
        }
    }
}

/// The sending side of a device's point-to-point messages.
pub trait SendHalf: Send {
    fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError>;
}

fn chunk(len: usize, p: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / p;
    let extra = len % p;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Ring all-reduce: reduce-scatter then all-gather, 2(p−1) steps of n/p values each.
pub fn ring_all_reduce<E: Endpoint + ?Sized>(
    ep: &mut E,
    group: &[DeviceId],
    data: &mut [f32],
) -> Result<(), TransportError> {
    let p = group.len();
    if p <= 1 {
        return Ok(());
    }
    let me = group
        .iter()
        .position(|d| *d == ep.device())
        .ok_or_else(|| TransportError::Other(format!("{} is not in its all-reduce group", ep.device())))?;
    let next = group[(me + 1) % p];
    let prev = group[(me + p - 1) % p];
    let n = data.len();
    for step in 0..p - 1 {
        let send_i = (me + p - step) % p;
        let recv_i = (me + p - step - 1) % p;
        ep.coll_send(next, data[chunk(n, p, send_i)].to_vec())?;
        let incoming = ep.coll_recv(prev)?;
        for (d, x) in data[chunk(n, p, recv_i)].iter_mut().zip(incoming) {
            *d += x;
        }
    }
    for step in 0..p - 1 {
        let send_i = (me + 1 + p - step) % p;
        let recv_i = (me + p - step) % p;
        ep.coll_send(next, data[chunk(n, p, send_i)].to_vec())?;
        let incoming = ep.coll_recv(prev)?;
        data[chunk(n, p, recv_i)].copy_from_slice(&incoming);
    }
    Ok(())
}

/// A central parameter server (the group's first member): everyone sends, it sums in
/// member order and sends the result back.
pub fn ps_all_reduce<E: Endpoint + ?Sized>(
    ep: &mut E,
    group: &[DeviceId],
    data: &mut [f32],
) -> Result<(), TransportError> {
    let server = group[0];
    if ep.device() == server {
        for &m in &group[1..] {
            let part = ep.coll_recv(m)?;
            for (d, x) in data.iter_mut().zip(part) {
                *d += x;
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

    impl InProcessEndpoint {
        fn wait(&self, rx: &Receiver<Wire>, from: DeviceId) -> Result<Wire, TransportError> {
            let start = Instant::now();
            loop {
                if self.abort.load(Ordering::Relaxed) {
                    return Err(TransportError::Aborted);
                }
                match rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(w) => return Ok(w),
                    Err(RecvTimeoutError::Timeout) => {
                        if start.elapsed() > self.timeout {
                            return Err(TransportError::Timeout { from, waited: start.elapsed() });
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => return Err(TransportError::Disconnected(from)),
                }
            }
        }
    }

    impl Endpoint for InProcessEndpoint {
        fn device(&self) -> DeviceId {
            self.device
        }
        fn send_half(&self) -> Box<dyn SendHalf> {
            Box::new(InProcessSender { to_p2p: self.to_p2p.clone() })
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
            match self.wait(rx, from)? {
                Wire::P2p(m) if m.tag == tag => Ok(m),
                Wire::P2p(m) => Err(TransportError::Mismatch { from, expected: tag, got: m.tag }),
                Wire::Coll(_) => Err(TransportError::Other("a collective message on a point-to-point channel".into())),
            }
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
            match self.wait(rx, from)? {
                Wire::Coll(d) => Ok(d),
                Wire::P2p(_) => Err(TransportError::Other("a point-to-point message on a collective channel".into())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::in_process::connect;
    use super::*;
    use pipec_plan::{MicrobatchId, StageId};

    #[test]
    fn ring_and_ps_all_reduce_sum_identically_on_every_member() {
        for algorithm in [ReduceMode::Ring, ReduceMode::ParameterServer] {
            for p in 1..=5usize {
                let devices: Vec<DeviceId> = (0..p as u32).map(DeviceId).collect();
                let eps = connect(&devices, Arc::new(AtomicBool::new(false)), Duration::from_secs(10));
                let handles: Vec<_> = eps
                    .into_iter()
                    .enumerate()
                    .map(|(i, mut ep)| {
                        let group = devices.clone();
                        std::thread::spawn(move || {
                            let mut data: Vec<f32> = (0..7).map(|k| (i * 10 + k) as f32).collect();
                            ep.collective(CollectiveKind::AllReduce, &group, &mut data, algorithm).map(|_| data)
                        })
                    })
                    .collect();
                let results: Vec<Vec<f32>> =
                    handles.into_iter().map(|h| h.join().expect("thread").expect("all-reduce")).collect();
                let expected: Vec<f32> = (0..7).map(|k| (0..p).map(|i| (i * 10 + k) as f32).sum()).collect();
                for r in &results {
                    assert_eq!(r, &expected, "{algorithm:?} p={p}");
                }
            }
        }
    }

    #[test]
    fn receive_times_out_instead_of_hanging() {
        let devices = [DeviceId(0), DeviceId(1)];
        let mut eps = connect(&devices, Arc::new(AtomicBool::new(false)), Duration::from_millis(200));
        let err = eps[0].recv(DeviceId(1), Tag::activation(StageId(0), MicrobatchId(0))).expect_err("nothing was sent");
        assert!(matches!(err, TransportError::Timeout { .. }));
    }
}
