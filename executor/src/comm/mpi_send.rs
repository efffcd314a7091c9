//! Nonblocking MPI sends that own their buffers, and the sender thread that drives them.
//!
//! Every message a rank sends goes through one sender thread. It used to call `MPI_Send`,
//! which for a message above the MPI's eager limit (Open MPI: 4 KiB in shared memory,
//! 64 KiB over TCP) returns only once the receiver has posted the matching receive. One
//! blocked send then held up every message queued behind it: after a checkpoint, rank 2's
//! shard for rank 0 sat in front of its next activation for rank 3, rank 0 collected
//! shards in rank order and waited on rank 1, whose activation for rank 2 waited on rank
//! 2's receive thread, which waited on rank 3's gradient, which needed the activation
//! stuck behind the shard — a cycle, and the job stalled (docs/multi-host.md). The plan's
//! verifier proves deadlock freedom for sends that never block the sender; this thread now
//! gives exactly that: it starts each message with `MPI_Isend` and keeps the request and
//! its buffer until MPI reports it done, so no send waits for any other, whatever the
//! message sizes and eager limits. Messages to one rank on one tag still arrive in the
//! order they were started (MPI's non-overtaking rule holds for nonblocking sends).
//!
//! This module uses `unsafe` for one thing: taking back the buffer of a finished send.
//! rsmpi ties a request to a borrowed buffer; a buffer that must outlive the function
//! that starts the send is leaked into a `'static` slice for the request, and freed
//! (`Box::from_raw`) only after `MPI_Test` has said the request is complete, when MPI no
//! longer reads it and the request, its only other holder, is gone.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use mpi::datatype::Equivalence;
use mpi::request::{Request, StaticScope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

/// Work for the sender thread: (destination rank, tag, header bytes, tensor values). The
/// values travel as a second MPI message of f32 (no copy into bytes); MPI's
/// non-overtaking rule keeps it right behind its header.
pub type Outgoing = (i32, i32, Vec<u8>, Option<Vec<f32>>);

/// One nonblocking send and the buffer it reads.
struct OwnedSend<T: Equivalence + 'static> {
    /// `None` once the send is complete and its buffer freed.
    request: Option<Request<'static, [T]>>,
}

impl<T: Equivalence + 'static> OwnedSend<T> {
    /// Starts sending `data` to `dest` with `tag`; returns at once.
    fn start(world: &SimpleCommunicator, dest: i32, tag: i32, data: Vec<T>) -> Self {
        let buf: &'static [T] = Box::leak(data.into_boxed_slice());
        OwnedSend { request: Some(world.process_at_rank(dest).immediate_send_with_tag(StaticScope, buf, tag)) }
    }

    /// Whether the send is complete; a complete send's buffer is freed.
    fn done(&mut self) -> bool {
        let Some(request) = self.request.take() else { return true };
        match request.test_with_data() {
            Ok((_, data)) => {
                // SAFETY: `data` is the slice `start` leaked from a `Box<[T]>`; the request
                // is complete, so MPI no longer reads it, and the request (consumed by the
                // test) was its only other holder.
                drop(unsafe { Box::from_raw(std::ptr::from_ref(data).cast_mut()) });
                true
            }
            Err(request) => {
                self.request = Some(request);
                false
            }
        }
    }
}

impl<T: Equivalence + 'static> Drop for OwnedSend<T> {
    /// A send still in flight when the thread gives up (the job is aborting): MPI may still
    /// read its buffer, so both are left alone (rsmpi panics on dropping a live request).
    fn drop(&mut self) {
        if let Some(request) = self.request.take() {
            std::mem::forget(request);
        }
    }
}

/// A message's sends: its header, and its values when it has any.
struct InFlight(OwnedSend<u8>, Option<OwnedSend<f32>>);

impl InFlight {
    fn done(&mut self) -> bool {
        let header = self.0.done();
        let values = self.1.as_mut().is_none_or(OwnedSend::done);
        header && values
    }
}

/// Starts the sender thread; returns its queue and its handle. The thread ends once every
/// sender of the queue is dropped and everything queued has been sent (or, when `abort` is
/// raised, without waiting for sends that may never be received); join it before MPI is
/// finalised.
pub fn start_sender(abort: Arc<AtomicBool>) -> (Sender<Outgoing>, std::thread::JoinHandle<()>) {
    let (tx, rx) = channel::<Outgoing>();
    let handle = std::thread::spawn(move || send_loop(&rx, &abort));
    (tx, handle)
}

/// How long the thread waits for new work while sends are in flight before it asks MPI
/// again whether they are done.
const POLL: Duration = Duration::from_micros(50);

fn send_loop(rx: &Receiver<Outgoing>, abort: &AtomicBool) {
    let world = SimpleCommunicator::world();
    let start = |(dest, tag, bytes, values): Outgoing| {
        InFlight(OwnedSend::start(&world, dest, tag, bytes), values.map(|v| OwnedSend::start(&world, dest, tag, v)))
    };
    let mut in_flight: Vec<InFlight> = Vec::new();
    let mut open = true;
    let mut idle_polls = 0u32;
    while open || !in_flight.is_empty() {
        // start everything queued; wait for work only as long as nothing is in flight
        // (or, with sends in flight, a poll interval, so that new work starts at once)
        loop {
            let next = if in_flight.is_empty() {
                rx.recv().map_err(|_| TryRecvError::Disconnected)
            } else if idle_polls < 200 {
                rx.try_recv()
            } else {
                rx.recv_timeout(POLL).map_err(|e| match e {
                    RecvTimeoutError::Timeout => TryRecvError::Empty,
                    RecvTimeoutError::Disconnected => TryRecvError::Disconnected,
                })
            };
            match next {
                Ok(msg) => {
                    in_flight.push(start(msg));
                    idle_polls = 0;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let before = in_flight.len();
        in_flight.retain_mut(|m| !m.done());
        if in_flight.len() < before {
            idle_polls = 0;
        } else {
            idle_polls = idle_polls.saturating_add(1);
            if idle_polls < 200 {
                std::thread::yield_now();
            }
        }
        if abort.load(Ordering::Relaxed) && !open {
            // the job is failing: a peer may never receive what is left
            break;
        }
    }
}
