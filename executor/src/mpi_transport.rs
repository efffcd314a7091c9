//! The MPI back end: one process per device, started by `mpirun`, talking over Open MPI
//! through the `mpi` crate (rsmpi). It implements the same [`Endpoint`] as the in-process
//! channels, so the interpreter is unchanged.
//!
//! - Rank `i` runs the `i`-th device (by id) of the plan that has a stream. Device ids are
//!   node-major, so with a hostfile whose hosts have `devices_per_node` slots each, the
//!   ranks of one host are the devices of one node.
//! - Point-to-point: one MPI message per tensor (a small header and the f32 values),
//!   all on one tag per class, so MPI's non-overtaking rule gives in-order links. Sends go
//!   through a sender thread that starts each one nonblocking (`mpi_send`), so they are
//!   asynchronous for the interpreter and for each other, as the plan assumes; receives
//!   poll (`MPI_Iprobe`) so they can time out and notice an abort.
//! - All-reduce: the same ring (or parameter-server) algorithm as in-process, over MPI
//!   point-to-point on its own tag: the same arithmetic in the same order, so an MPI run
//!   gives bit-identical losses.
//! - Tensors on a GPU are copied to host memory before sending (the executor's messages
//!   are host `f32` vectors); a CUDA-aware MPI or NCCL would send device buffers directly.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use pipec_plan::{DeviceId, Payload, StageId};

pub use crate::mpi_send::{start_sender, Outgoing};
use crate::transport::{Endpoint, Message, SendHalf, Tag, TransportError};

pub const TAG_P2P: i32 = 10;
pub const TAG_COLL: i32 = 11;
pub const TAG_METRIC: i32 = 12;
pub const TAG_TRACE: i32 = 13;
pub const TAG_CKPT: i32 = 14;

/// The header code of collective traffic (point-to-point messages carry their payload's
/// code, `Payload::code`).
const COLLECTIVE_CODE: u8 = 2;

/// A header or a whole message as it travels: its tag (None for collective traffic),
/// shape and values.
#[derive(Debug, Clone, PartialEq)]
struct Wire {
    tag: Option<Tag>,
    shape: Vec<usize>,
    data: Vec<f32>,
}

fn header(tag: Option<Tag>, shape: &[usize]) -> Vec<u8> {
    encode(tag, shape, &[])
}

fn encode(tag: Option<Tag>, shape: &[usize], data: &[f32]) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + 8 * shape.len() + 4 * data.len());
    b.push(tag.map_or(COLLECTIVE_CODE, |t| t.payload.code()));
    b.extend_from_slice(&tag.map_or(0, |t| t.stage.0).to_le_bytes());
    b.extend_from_slice(&tag.map_or(0, |t| t.index).to_le_bytes());
    b.extend_from_slice(&(shape.len() as u32).to_le_bytes());
    for d in shape {
        b.extend_from_slice(&(*d as u64).to_le_bytes());
    }
    for v in data {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

fn decode(b: &[u8]) -> Result<Wire, TransportError> {
    let bad = || TransportError::Other("malformed MPI message".into());
    let u32_at = |i: usize| b.get(i..i + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]])).ok_or_else(bad);
    let code = *b.first().ok_or_else(bad)?;
    let payload = match code {
        COLLECTIVE_CODE => None,
        c => Some(Payload::from_code(c).ok_or_else(bad)?),
    };
    let stage = u32_at(1)?;
    let mb = u32_at(5)?;
    let ndim = u32_at(9)? as usize;
    let mut off = 13;
    let mut shape = Vec::with_capacity(ndim);
    for _ in 0..ndim {
        let s = b.get(off..off + 8).ok_or_else(bad)?;
        shape.push(u64::from_le_bytes(s.try_into().map_err(|_| bad())?) as usize);
        off += 8;
    }
    let data = b[off..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok(Wire { tag: payload.map(|payload| Tag { payload, stage: StageId(stage), index: mb }), shape, data })
}

/// Receives a header and its tensor values (see [`Outgoing`]).
fn receive_tensor(
    rank: i32,
    tag: i32,
    abort: &AtomicBool,
    timeout: Duration,
    from: DeviceId,
) -> Result<Wire, TransportError> {
    let mut m = decode(&receive_bytes(rank, tag, abort, timeout, from)?)?;
    let world = SimpleCommunicator::world();
    let (values, _) = world.process_at_rank(rank).receive_vec_with_tag::<f32>(tag);
    m.data = values;
    Ok(m)
}

/// Receives the next message with `tag` from `rank`, polling so that an abort or a
/// timeout ends the wait.
pub fn receive_bytes(
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

/// A device's connection to the others over MPI.
pub struct MpiEndpoint {
    device: DeviceId,
    rank_of: HashMap<DeviceId, i32>,
    outgoing: Sender<Outgoing>,
    abort: Arc<AtomicBool>,
    timeout: Duration,
}

impl std::fmt::Debug for MpiEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiEndpoint({})", self.device)
    }
}

impl MpiEndpoint {
    pub fn new(
        device: DeviceId,
        devices: &[DeviceId],
        outgoing: Sender<Outgoing>,
        abort: Arc<AtomicBool>,
        timeout: Duration,
    ) -> Self {
        MpiEndpoint {
            device,
            rank_of: devices.iter().enumerate().map(|(r, d)| (*d, r as i32)).collect(),
            outgoing,
            abort,
            timeout,
        }
    }

    fn rank(&self, d: DeviceId) -> Result<i32, TransportError> {
        self.rank_of.get(&d).copied().ok_or(TransportError::Disconnected(d))
    }
}

/// A rank's point-to-point sends, for the computing thread: the sender thread's queue.
struct MpiSender {
    rank_of: HashMap<DeviceId, i32>,
    outgoing: Sender<Outgoing>,
}

impl SendHalf for MpiSender {
    fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError> {
        let r = self.rank_of.get(&to).copied().ok_or(TransportError::Disconnected(to))?;
        self.outgoing
            .send((r, TAG_P2P, header(Some(msg.tag), &msg.shape), Some(msg.data)))
            .map_err(|_| TransportError::Disconnected(to))
    }
}

impl Endpoint for MpiEndpoint {
    fn device(&self) -> DeviceId {
        self.device
    }
    fn send_half(&self) -> Box<dyn SendHalf> {
        Box::new(MpiSender { rank_of: self.rank_of.clone(), outgoing: self.outgoing.clone() })
    }
    /// Both halves talk to the same MPI world (initialised with `MPI_THREAD_MULTIPLE`);
    /// messages and collectives travel on different tags.
    fn split(self) -> (Self, Self) {
        let other = MpiEndpoint {
            device: self.device,
            rank_of: self.rank_of.clone(),
            outgoing: self.outgoing.clone(),
            abort: self.abort.clone(),
            timeout: self.timeout,
        };
        (self, other)
    }
    fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError> {
        let r = self.rank(to)?;
        self.outgoing
            .send((r, TAG_P2P, header(Some(msg.tag), &msg.shape), Some(msg.data)))
            .map_err(|_| TransportError::Disconnected(to))
    }
    fn recv(&mut self, from: DeviceId, tag: Tag) -> Result<Message, TransportError> {
        let r = self.rank(from)?;
        let m = receive_tensor(r, TAG_P2P, &self.abort, self.timeout, from)?;
        let got =
            m.tag.ok_or_else(|| TransportError::Other("a collective message on the point-to-point tag".into()))?;
        if got != tag {
            return Err(TransportError::Mismatch { from, expected: tag, got });
        }
        Ok(Message { tag: got, shape: m.shape, data: m.data })
    }
    fn coll_send(&mut self, to: DeviceId, data: Vec<f32>) -> Result<(), TransportError> {
        let r = self.rank(to)?;
        self.outgoing
            .send((r, TAG_COLL, header(None, &[data.len()]), Some(data)))
            .map_err(|_| TransportError::Disconnected(to))
    }
    fn coll_recv(&mut self, from: DeviceId) -> Result<Vec<f32>, TransportError> {
        let r = self.rank(from)?;
        Ok(receive_tensor(r, TAG_COLL, &self.abort, self.timeout, from)?.data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_plan::MicrobatchId;

    #[test]
    fn messages_round_trip() {
        let tag = Tag::gradient(StageId(7), MicrobatchId(3));
        let b = encode(Some(tag), &[2, 3], &[1.0, -2.5, 3.0, 0.0, 5.5, 6.25]);
        let m = decode(&b).expect("decodes");
        assert_eq!(m.tag, Some(tag));
        assert_eq!(m.shape, vec![2, 3]);
        assert_eq!(m.data, vec![1.0, -2.5, 3.0, 0.0, 5.5, 6.25]);
        assert!(decode(&b[..5]).is_err());
    }
}
