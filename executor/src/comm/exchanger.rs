//! A device's communication engine: two threads beside the worker's compute thread, one
//! for point-to-point messages and one for collectives, each taking its commands in the
//! order the stream issues them (what the simulator models as the device's communication
//! engine).
//!
//! - Sends are made by the worker itself (they only queue the message). Where the
//!   transport must post receives ahead (MPI, TCP), they are posted to the point-to-point
//!   thread ahead of the compute that needs them (as soon as every earlier message of the
//!   stream has been issued) and waited for when that compute comes. Where it buffers every
//!   message (the in-process channels), the worker takes each message itself when the
//!   compute comes ([`Comm::receives_directly`]): a message sent while the receiver
//!   computes then wakes no thread, and one that arrives while it waits wakes it directly,
//!   not a thread that wakes it (on a machine whose cores the workers fill, each wake-up
//!   could cost a preemption of the sender).
//! - A collective instruction hands its data to the collective thread and the worker
//!   computes on; its wait takes the result back. A tensor-parallel all-reduce inside a
//!   forward or backward goes through the same thread and is waited for at once, so every
//!   device's collectives keep one order.
//!
//! A transfer that fails fails the command that waits for it, or the step's fence. Each
//! thread records when it ran each instruction, for the measured trace; the fence reads
//! those records without waking the threads when they have finished every command sent
//! them (each wake-up costs, on a machine whose cores the workers fill).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use pipec_plan::{CollectiveKind, DeviceId, PassOp, PeerDim, ReduceMode};

use crate::comm::transport::{Endpoint, Message, RecvHalf, Rounding, SendHalf, Tag, TransportError};

/// (instruction code, start, end): seconds from the run's start.
pub type CommTrace = Vec<(usize, f64, f64)>;

enum P2p {
    Recv { from: DeviceId, tag: Tag, code: usize, reply: Sender<Result<Message, TransportError>> },
    Fence(Sender<(CommTrace, Option<TransportError>)>),
}

/// A collective to run on the collective thread: `kind` on `data` over `members`.
#[derive(Debug)]
pub struct Reduction {
    pub kind: CollectiveKind,
    pub members: Vec<DeviceId>,
    pub data: Vec<f32>,
    pub mode: ReduceMode,
    /// How its sums round (`transport::Rounding`; None: fp32).
    pub sum: Option<Rounding>,
    /// The instruction it is, in the trace (None: part of a compute instruction).
    pub code: Option<usize>,
}

enum Coll {
    Run(Reduction, Sender<Result<Vec<f32>, TransportError>>),
    /// An all-to-all of chunks of any size (expert parallelism's token exchange).
    Exchange {
        members: Vec<DeviceId>,
        chunks: Vec<Vec<f32>>,
        reply: Sender<Result<Vec<Vec<f32>>, TransportError>>,
    },
    Fence(Sender<(CommTrace, Option<TransportError>)>),
    /// The worker is done: the thread ends even while an [`Exchanger`] is still held (an
    /// autodiff graph a failed step left unconsumed keeps its exchanges' handles).
    Stop,
}

/// A handle that runs all-to-all exchanges on a device's collective thread, in order with
/// its other collectives: what an autodiff node's backward holds (expert parallelism).
#[derive(Clone)]
pub struct Exchanger(Thread<Coll>, Ledger);

/// What a communication thread has done since the worker last took its record: the
/// instructions it ran (the trace), its first failure, and how many commands it finished.
#[derive(Default)]
struct Done {
    trace: CommTrace,
    failed: Option<TransportError>,
    commands: usize,
}

/// The worker's side of one communication thread: its command queue, what it has done,
/// and how many commands were sent it (by the worker and the [`Exchanger`]s it handed out,
/// all on the worker's thread).
struct Thread<C> {
    tx: Sender<C>,
    done: Arc<Mutex<Done>>,
    issued: Arc<AtomicUsize>,
}

impl<C> Clone for Thread<C> {
    fn clone(&self) -> Self {
        Thread { tx: self.tx.clone(), done: self.done.clone(), issued: self.issued.clone() }
    }
}

impl<C> Thread<C> {
    /// A thread's queue and the record it keeps; the thread's side is `Log`.
    fn new(epoch: Instant) -> (Self, Receiver<C>, Log) {
        let (tx, rx) = channel();
        let done = Arc::new(Mutex::new(Done::default()));
        (Thread { tx, done: done.clone(), issued: Arc::new(AtomicUsize::new(0)) }, rx, Log { epoch, done })
    }

    fn send(&self, command: C) -> Result<(), TransportError> {
        self.issued.fetch_add(1, Ordering::SeqCst);
        self.tx.send(command).map_err(|_| gone())
    }

    /// The thread's record since the last fence and its first failure, once it has done
    /// everything sent it: read in place where it already has (no wake-up), else asked
    /// for behind its queue with `fence`.
    fn fence(
        &self,
        fence: impl FnOnce(Sender<(CommTrace, Option<TransportError>)>) -> C,
    ) -> Result<(CommTrace, Option<TransportError>), TransportError> {
        {
            let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
            if done.commands == self.issued.load(Ordering::SeqCst) {
                return Ok((std::mem::take(&mut done.trace), done.failed.clone()));
            }
        }
        let (reply, rx) = channel();
        self.send(fence(reply))?;
        rx.recv().map_err(|_| gone())
    }
}

/// One collective issued inside a pass: what it does, over which of the pass's groups,
/// and that group's members.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issued {
    pub op: PassOp,
    pub over: PeerDim,
    pub members: Vec<DeviceId>,
}

/// The collectives a device's passes issued (those the plan declares inside passes,
/// `pipec_plan::in_pass`), in the order they reach the collective thread: what the
/// interpreter holds against the plan's declaration of each pass.
#[derive(Clone, Debug, Default)]
pub struct Ledger(std::sync::Arc<std::sync::Mutex<Vec<Issued>>>);

impl Ledger {
    pub fn record(&self, op: PassOp, over: PeerDim, members: &[DeviceId]) {
        if let Ok(mut l) = self.0.lock() {
            l.push(Issued { op, over, members: members.to_vec() });
        }
    }

    /// What was issued since the last take, oldest first.
    pub fn take(&self) -> Vec<Issued> {
        self.0.lock().map(|mut l| std::mem::take(&mut *l)).unwrap_or_default()
    }
}

impl std::fmt::Debug for Exchanger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Exchanger")
    }
}

impl Exchanger {
    /// The record of the collectives issued inside passes.
    pub fn ledger(&self) -> &Ledger {
        &self.1
    }

    /// Sends `chunks[j]` to member j of `members` and returns what each member sent this
    /// one, in member order.
    pub fn exchange(&self, members: &[DeviceId], chunks: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, TransportError> {
        self.start(members, chunks)?.wait()
    }

    /// [`Exchanger::exchange`] started: the collective thread runs it while the caller
    /// computes, and the ticket gives its result.
    pub fn start(&self, members: &[DeviceId], chunks: Vec<Vec<f32>>) -> Result<Ticket<Vec<Vec<f32>>>, TransportError> {
        let (reply, rx) = channel();
        self.0.send(Coll::Exchange { members: members.to_vec(), chunks, reply })?;
        Ok(Ticket(rx))
    }

    /// Starts an all-gather of `data` over `members` (its result: each member's data in
    /// member order), queued behind what the worker started before it.
    pub fn start_all_gather(
        &self,
        members: &[DeviceId],
        data: Vec<f32>,
        mode: ReduceMode,
    ) -> Result<Ticket<Vec<f32>>, TransportError> {
        let (reply, rx) = channel();
        let kind = CollectiveKind::AllGather;
        let run = Coll::Run(Reduction { kind, members: members.to_vec(), data, mode, sum: None, code: None }, reply);
        self.0.send(run)?;
        Ok(Ticket(rx))
    }
}

/// A result the worker waits for.
pub struct Ticket<T>(Receiver<Result<T, TransportError>>);

impl<T> Ticket<T> {
    /// Blocks until the transfer is done.
    pub fn wait(self) -> Result<T, TransportError> {
        self.0.recv().unwrap_or_else(|_| Err(TransportError::Other("the communication thread stopped".into())))
    }

    /// A ticket whose result is already here.
    pub fn ready(value: T) -> Self {
        let (tx, rx) = channel();
        // the receiver is alive: the send cannot fail
        let _ = tx.send(Ok(value));
        Ticket(rx)
    }
}

/// The worker's handle on its communication threads (and its sends, which it makes itself:
/// they only queue the message).
pub struct Comm {
    p2p: Thread<P2p>,
    coll: Thread<Coll>,
    ledger: Ledger,
    sender: Box<dyn SendHalf>,
    /// The worker's own receiver, where the transport gives one.
    receiver: Option<Box<dyn RecvHalf>>,
    epoch: Instant,
    /// The sends (and direct receives) made on the worker's thread since the last fence.
    sent: CommTrace,
}

impl Drop for Comm {
    fn drop(&mut self) {
        // after whatever is queued: a finished worker's last collectives still run
        let _ = self.coll.tx.send(Coll::Stop);
    }
}

fn gone() -> TransportError {
    TransportError::Other("the communication thread stopped".into())
}

impl Comm {
    /// Starts the two threads in `scope`, driving the two halves of `ep`; times are
    /// measured from `epoch`. The threads end when the `Comm` is dropped.
    pub fn start<'scope, E: Endpoint + 'scope>(
        scope: &'scope std::thread::Scope<'scope, '_>,
        mut ep: E,
        epoch: Instant,
    ) -> Comm {
        let sender = ep.send_half();
        let receiver = ep.recv_half();
        let (p2p_ep, coll_ep) = ep.split();
        let (p2p, p2p_rx, p2p_log) = Thread::new(epoch);
        let (coll, coll_rx, coll_log) = Thread::new(epoch);
        scope.spawn(move || p2p_loop(p2p_ep, p2p_rx, p2p_log));
        scope.spawn(move || coll_loop(coll_ep, coll_rx, coll_log));
        Comm { p2p, coll, ledger: Ledger::default(), sender, receiver, epoch, sent: CommTrace::new() }
    }

    /// Whether the worker takes its messages itself ([`Comm::recv_now`]) rather than
    /// posting receives ahead ([`Comm::post_recv`]).
    pub fn receives_directly(&self) -> bool {
        self.receiver.is_some()
    }

    /// Receives the next message from `from`, which must carry `tag`, on the worker's
    /// thread (where [`Comm::receives_directly`]); traced under `code` from the call to
    /// the message's arrival, as a posted receive's wait is.
    pub fn recv_now(&mut self, from: DeviceId, tag: Tag, code: usize) -> Result<Message, TransportError> {
        let receiver =
            self.receiver.as_mut().ok_or(TransportError::Other("this transport's receives are posted ahead".into()))?;
        let t0 = since(self.epoch);
        let got = receiver.recv(from, tag);
        self.sent.push((code, t0, since(self.epoch)));
        got
    }

    /// Sends a message (queued: returns at once).
    pub fn send(&mut self, to: DeviceId, msg: Message, code: usize) -> Result<(), TransportError> {
        let t0 = since(self.epoch);
        self.sender.send(to, msg)?;
        self.sent.push((code, t0, since(self.epoch)));
        Ok(())
    }

    /// Posts the receive of the next message from `from`, which must carry `tag`.
    pub fn post_recv(&self, from: DeviceId, tag: Tag, code: usize) -> Result<Ticket<Message>, TransportError> {
        let (reply, rx) = channel();
        self.p2p.send(P2p::Recv { from, tag, code, reply })?;
        Ok(Ticket(rx))
    }

    /// Starts a collective of `kind` on `data` over `members`; `code` names the
    /// instruction in the trace (None: part of a compute instruction, not traced on its
    /// own).
    pub fn start_collective(
        &self,
        kind: CollectiveKind,
        members: Vec<DeviceId>,
        data: Vec<f32>,
        mode: ReduceMode,
        code: Option<usize>,
    ) -> Result<Ticket<Vec<f32>>, TransportError> {
        self.start_reduction(Reduction { kind, members, data, mode, sum: None, code })
    }

    /// [`Comm::start_collective`] with its sums rounded (gradients reduced in the plan's
    /// `grad_precision`).
    pub fn start_reduction(&self, r: Reduction) -> Result<Ticket<Vec<f32>>, TransportError> {
        let (reply, rx) = channel();
        self.coll.send(Coll::Run(r, reply))?;
        Ok(Ticket(rx))
    }

    /// Runs a collective of `kind` on `data` over `members` and waits for it.
    pub fn collective(
        &self,
        kind: CollectiveKind,
        members: &[DeviceId],
        data: Vec<f32>,
        mode: ReduceMode,
        code: Option<usize>,
    ) -> Result<Vec<f32>, TransportError> {
        self.start_collective(kind, members.to_vec(), data, mode, code)?.wait()
    }

    /// A handle on this device's collective thread for all-to-all exchanges.
    pub fn exchanger(&self) -> Exchanger {
        Exchanger(self.coll.clone(), self.ledger.clone())
    }

    /// The record of the collectives issued inside passes.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// A tensor-parallel all-reduce inside a pass, or inside an instruction of the update's
    /// side (`pipec_plan::in_pass::update_sums`), over `members` (recorded in the
    /// [`Ledger`]), waited for.
    pub fn in_pass_all_reduce(
        &self,
        members: &[DeviceId],
        data: Vec<f32>,
        mode: ReduceMode,
    ) -> Result<Vec<f32>, TransportError> {
        self.ledger.record(PassOp::AllReduce, PeerDim::Tensor, members);
        self.collective(CollectiveKind::AllReduce, members, data, mode, None)
    }

    /// Waits until everything issued so far is done; returns what both threads ran since
    /// the last fence, or the first transfer that failed.
    pub fn fence(&mut self) -> Result<CommTrace, TransportError> {
        let (mut trace, e1) = self.p2p.fence(P2p::Fence)?;
        let (more, e2) = self.coll.fence(Coll::Fence)?;
        if let Some(e) = e1.or(e2) {
            return Err(e);
        }
        trace.extend(more);
        trace.append(&mut self.sent);
        Ok(trace)
    }
}

fn since(epoch: Instant) -> f64 {
    epoch.elapsed().as_secs_f64()
}

/// A communication thread's side of its record ([`Done`]), shared with the worker: a
/// command is counted done once its transfer has run and been recorded, before its result
/// is sent back, so the worker never reads a record short of a result it holds. The first
/// transfer that failed fails every later command.
struct Log {
    epoch: Instant,
    done: Arc<Mutex<Done>>,
}

impl Log {
    fn record(&self) -> std::sync::MutexGuard<'_, Done> {
        self.done.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs a transfer unless an earlier one failed, tracing it under `code` (if any).
    fn run<T>(
        &self,
        code: Option<usize>,
        transfer: impl FnOnce() -> Result<T, TransportError>,
    ) -> Result<T, TransportError> {
        let earlier = self.record().failed.clone();
        let (got, span) = match earlier {
            Some(e) => (Err(e), None),
            None => {
                let t0 = since(self.epoch);
                let got = transfer();
                (got, code.map(|code| (code, t0, since(self.epoch))))
            }
        };
        let mut done = self.record();
        done.trace.extend(span);
        if let (Err(e), None) = (&got, &done.failed) {
            done.failed = Some(e.clone());
        }
        done.commands += 1;
        got
    }

    /// The fence's answer: the trace since the last one, and the first failure.
    fn fence(&self) -> (CommTrace, Option<TransportError>) {
        let mut done = self.record();
        done.commands += 1;
        (std::mem::take(&mut done.trace), done.failed.clone())
    }
}

fn p2p_loop<E: Endpoint>(mut ep: E, rx: Receiver<P2p>, log: Log) {
    for cmd in rx {
        match cmd {
            P2p::Recv { from, tag, code, reply } => {
                let _ = reply.send(log.run(Some(code), || ep.recv(from, tag)));
            }
            P2p::Fence(reply) => {
                let _ = reply.send(log.fence());
            }
        }
    }
}

fn coll_loop<E: Endpoint>(mut ep: E, rx: Receiver<Coll>, log: Log) {
    for cmd in rx {
        match cmd {
            Coll::Run(Reduction { kind, members, data, mode, sum, code }, reply) => {
                let _ = reply.send(log.run(code, || ep.collective(kind, &members, data, mode, sum)));
            }
            Coll::Exchange { members, chunks, reply } => {
                let _ = reply.send(log.run(None, || ep.all_to_all_v(&members, chunks)));
            }
            Coll::Fence(reply) => {
                let _ = reply.send(log.fence());
            }
            Coll::Stop => break,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::transport::in_process::connect;
    use pipec_plan::{MicrobatchId, StageId};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Duration;

    /// An in-process endpoint whose receives are posted ahead, as a process transport's
    /// are (it gives no `recv_half`): the path MPI and TCP take, on channels.
    struct Posted(crate::comm::transport::in_process::InProcessEndpoint);

    impl Endpoint for Posted {
        fn device(&self) -> DeviceId {
            self.0.device()
        }
        fn split(self) -> (Self, Self) {
            let (a, b) = self.0.split();
            (Posted(a), Posted(b))
        }
        fn send_half(&self) -> Box<dyn SendHalf> {
            self.0.send_half()
        }
        fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError> {
            self.0.send(to, msg)
        }
        fn recv(&mut self, from: DeviceId, tag: Tag) -> Result<Message, TransportError> {
            self.0.recv(from, tag)
        }
        fn coll_send(&mut self, to: DeviceId, data: Vec<f32>) -> Result<(), TransportError> {
            self.0.coll_send(to, data)
        }
        fn coll_recv(&mut self, from: DeviceId) -> Result<Vec<f32>, TransportError> {
            self.0.coll_recv(from)
        }
    }

    /// A collective in flight does not hold up point-to-point messages, and receives posted
    /// early complete when their messages come.
    #[test]
    fn a_collective_in_flight_does_not_hold_up_messages() {
        let devices = [DeviceId(0), DeviceId(1)];
        let mut eps = connect(&devices, Arc::new(AtomicBool::new(false)), Duration::from_secs(10)).into_iter();
        let (e0, e1) = (Posted(eps.next().expect("d0")), Posted(eps.next().expect("d1")));
        let epoch = Instant::now();
        let tag = Tag::activation(StageId(0), MicrobatchId(0));
        std::thread::scope(|s| {
            let mut c0 = Comm::start(s, e0, epoch);
            let c1 = Comm::start(s, e1, epoch);
            assert!(!c1.receives_directly());
            // d0 starts an all-reduce that d1 joins only after the message has gone through
            let sum = c0
                .start_collective(
                    CollectiveKind::AllReduce,
                    devices.to_vec(),
                    vec![1.0, 2.0],
                    ReduceMode::Ring,
                    Some(7),
                )
                .expect("start");
            let posted = c1.post_recv(DeviceId(0), tag, 3).expect("post");
            c0.send(DeviceId(1), Message { tag, shape: vec![1], data: vec![5.0] }, 2).expect("send");
            assert_eq!(posted.wait().expect("message").data, vec![5.0]);
            let other = c1
                .collective(CollectiveKind::AllReduce, &devices, vec![10.0, 20.0], ReduceMode::Ring, Some(7))
                .expect("joins");
            assert_eq!(sum.wait().expect("sum"), vec![11.0, 22.0]);
            assert_eq!(other, vec![11.0, 22.0]);
            let trace = c0.fence().expect("fence");
            assert!(trace.iter().any(|t| t.0 == 7) && trace.iter().any(|t| t.0 == 2), "{trace:?}");
        });
    }

    /// The fence reads a collective thread's record in place once every command sent it is
    /// done (nothing more is sent it), and waits behind its queue for one still running,
    /// whose span it then holds.
    #[test]
    fn the_fence_wakes_no_thread_that_has_finished_and_waits_for_one_that_has_not() {
        let devices = [DeviceId(0), DeviceId(1)];
        let mut eps = connect(&devices, Arc::new(AtomicBool::new(false)), Duration::from_secs(10)).into_iter();
        let (e0, e1) = (eps.next().expect("d0"), eps.next().expect("d1"));
        let sum = |c: &Comm, code| {
            c.start_collective(CollectiveKind::AllReduce, devices.to_vec(), vec![1.0], ReduceMode::Ring, Some(code))
        };
        std::thread::scope(|s| {
            let mut c0 = Comm::start(s, e0, Instant::now());
            let mut c1 = Comm::start(s, e1, Instant::now());
            // both done and waited for: read in place
            let (a, b) = (sum(&c0, 4).expect("start"), sum(&c1, 4).expect("start"));
            assert_eq!((a.wait().expect("sum"), b.wait().expect("sum")), (vec![2.0], vec![2.0]));
            let sent = c0.coll.issued.load(Ordering::SeqCst);
            let trace = c0.fence().expect("fence");
            assert_eq!(trace.iter().map(|t| t.0).collect::<Vec<_>>(), vec![4]);
            assert_eq!(c0.coll.issued.load(Ordering::SeqCst), sent, "nothing sent to a finished thread");
            assert_eq!(c1.fence().expect("fence").len(), 1);
            // d0's collective waits for d1, which joins only after d0's fence began: the
            // fence goes behind the queue and returns with the collective's span
            let pending = sum(&c0, 9).expect("start");
            let joiner = s.spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                let got = sum(&c1, 9).expect("start").wait();
                (got, c1)
            });
            let trace = c0.fence().expect("fence");
            assert_eq!(trace.iter().map(|t| t.0).collect::<Vec<_>>(), vec![9], "{trace:?}");
            assert!(trace[0].2 - trace[0].1 > 0.03, "the span covers the wait for d1: {trace:?}");
            assert_eq!(pending.wait().expect("sum"), vec![2.0]);
            let (got, _c1) = joiner.join().expect("joiner");
            assert_eq!(got.expect("sum"), vec![2.0]);
        });
    }

    #[test]
    fn a_failed_receive_is_reported_by_the_wait_and_the_fence() {
        let devices = [DeviceId(0), DeviceId(1)];
        let mut eps = connect(&devices, Arc::new(AtomicBool::new(false)), Duration::from_millis(100)).into_iter();
        let e0 = Posted(eps.next().expect("d0"));
        std::thread::scope(|s| {
            let mut c0 = Comm::start(s, e0, Instant::now());
            let t = c0.post_recv(DeviceId(1), Tag::activation(StageId(0), MicrobatchId(0)), 0).expect("post");
            assert!(matches!(t.wait(), Err(TransportError::Timeout { .. })));
            assert!(c0.fence().is_err());
        });
    }

    /// In process the worker takes its messages itself: in order, traced, a message of
    /// another tag is an error, and a silent peer times out.
    #[test]
    fn direct_receives_take_messages_in_order_and_time_out() {
        let devices = [DeviceId(0), DeviceId(1)];
        let mut eps = connect(&devices, Arc::new(AtomicBool::new(false)), Duration::from_millis(100)).into_iter();
        let (e0, e1) = (eps.next().expect("d0"), eps.next().expect("d1"));
        let (a, b) = (Tag::activation(StageId(0), MicrobatchId(0)), Tag::activation(StageId(0), MicrobatchId(1)));
        std::thread::scope(|s| {
            let mut c0 = Comm::start(s, e0, Instant::now());
            let mut c1 = Comm::start(s, e1, Instant::now());
            assert!(c1.receives_directly());
            c0.send(DeviceId(1), Message { tag: a, shape: vec![1], data: vec![1.0] }, 0).expect("send");
            c0.send(DeviceId(1), Message { tag: b, shape: vec![1], data: vec![2.0] }, 1).expect("send");
            assert_eq!(c1.recv_now(DeviceId(0), a, 5).expect("first").data, vec![1.0]);
            assert!(matches!(c1.recv_now(DeviceId(0), a, 6), Err(TransportError::Mismatch { .. })));
            assert!(matches!(c1.recv_now(DeviceId(0), b, 7), Err(TransportError::Timeout { .. })));
            let trace = c1.fence().expect("fence");
            assert_eq!(trace.iter().map(|t| t.0).collect::<Vec<_>>(), vec![5, 6, 7], "{trace:?}");
        });
    }
}
