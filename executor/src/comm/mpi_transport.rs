//! The MPI fabric: one process per device, started by `mpirun` (or a PMIx launcher such as
//! Slurm's `srun`), talking over Open MPI through the `mpi` crate (rsmpi).
//!
//! - A message is one MPI message of header bytes and, for a tensor, a second of its f32
//!   values, on the message's tag: MPI's non-overtaking rule keeps each (rank, tag) link in
//!   order and the values right behind their header. Sends go through a sender thread that
//!   starts each one nonblocking (`mpi_send`), so posting never waits for the receiver;
//!   receives poll (`MPI_Iprobe`) so they can time out and notice an abort.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use pipec_plan::DeviceId;

use crate::comm::fabric::Fabric;
use crate::comm::mpi_send::{start_sender, Outgoing};
use crate::comm::transport::TransportError;

/// Receives the next message with `tag` from `rank`, polling so that an abort or a
/// timeout ends the wait.
fn receive_bytes(
    rank: i32,
    tag: i32,
    abort: &AtomicBool,
    timeout: Duration,
    from: DeviceId,
) -> Result<Vec<u8>, TransportError> {
    let world = SimpleCommunicator::world();
    let process = world.process_at_rank(rank);
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if process.immediate_probe_with_tag(tag).is_some() {
            let (bytes, _) = process.receive_vec_with_tag::<u8>(tag);
            return Ok(bytes);
        }
        spins += 1;
        if spins < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
            if abort.load(Ordering::Relaxed) {
                return Err(TransportError::Aborted);
            }
            if start.elapsed() > timeout {
                return Err(TransportError::Timeout { from, waited: start.elapsed() });
            }
        }
    }
}

/// This process's place in the MPI world (initialised with `MPI_THREAD_MULTIPLE`) and its
/// sender thread.
pub struct MpiFabric {
    rank: i32,
    size: i32,
    outgoing: Mutex<Option<Sender<Outgoing>>>,
    sender: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl MpiFabric {
    /// Starts the sender thread on the world `MPI_Init` made.
    pub fn start(world: &SimpleCommunicator) -> Self {
        let (outgoing, sender) = start_sender(Arc::new(AtomicBool::new(false)));
        MpiFabric {
            rank: world.rank(),
            size: world.size(),
            outgoing: Mutex::new(Some(outgoing)),
            sender: Mutex::new(Some(sender)),
        }
    }
}

impl Fabric for MpiFabric {
    fn rank(&self) -> i32 {
        self.rank
    }
    fn size(&self) -> i32 {
        self.size
    }
    fn post(&self, dest: i32, tag: i32, bytes: Vec<u8>, values: Option<Vec<f32>>) -> Result<(), TransportError> {
        let gone = || TransportError::Other("the MPI sender has stopped".into());
        let queue = self.outgoing.lock().map_err(|_| gone())?;
        queue.as_ref().ok_or_else(gone)?.send((dest, tag, bytes, values)).map_err(|_| gone())
    }
    fn receive(
        &self,
        rank: i32,
        tag: i32,
        values: bool,
        abort: &AtomicBool,
        timeout: Duration,
        from: DeviceId,
    ) -> Result<(Vec<u8>, Vec<f32>), TransportError> {
        let bytes = receive_bytes(rank, tag, abort, timeout, from)?;
        let data = if values {
            SimpleCommunicator::world().process_at_rank(rank).receive_vec_with_tag::<f32>(tag).0
        } else {
            Vec::new()
        };
        Ok((bytes, data))
    }
    fn barrier(&self) -> Result<(), TransportError> {
        SimpleCommunicator::world().barrier();
        Ok(())
    }
    /// Closes the sender's queue and waits until it has sent everything (before MPI is
    /// finalised).
    fn flush(&self) {
        if let Ok(mut q) = self.outgoing.lock() {
            q.take();
        }
        let handle = self.sender.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
    fn abort(&self, code: i32) -> ! {
        abort(code)
    }
}

/// Ends the whole job (MPI_Abort) after a rank failed; a process whose MPI never started
/// or has already shut down just exits (MPI_Abort is not allowed then).
pub fn abort(code: i32) -> ! {
    if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
        abort_world(&SimpleCommunicator::world(), code)
    }
    std::process::exit(code)
}

/// How long MPI_Abort may take before this process exits on its own.
const ABORT_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// MPI_Abort, and this process's own exit if that does not end it within `ABORT_GRACE`:
/// with a peer unreachable (a network link down), Open MPI's abort waits on a daemon it
/// cannot reach, and the rank must not outlive its job.
pub(crate) fn abort_world(world: &SimpleCommunicator, code: i32) -> ! {
    std::thread::spawn(move || {
        std::thread::sleep(ABORT_GRACE);
        std::process::exit(code)
    });
    world.abort(code)
}
