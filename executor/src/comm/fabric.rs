//! One process per device: the message layer between the processes of a job (a
//! [`Fabric`]: Open MPI's, or pipec's own TCP one for launchers that give each process
//! `RANK`/`WORLD_SIZE`/`MASTER_ADDR` as torchrun does) and the [`Endpoint`] the
//! interpreter talks to on top of it.
//!
//! - Rank `i` runs the `i`-th device (by id) of the plan that has a stream. Device ids are
//!   node-major, so ranks placed host by host run one node's devices per host.
//! - A message is a header (bytes) and, for tensors, its f32 values, sent to a rank on a
//!   tag: one tag per class of traffic, so each (rank, tag) link keeps its order.
//!   Posting never waits for the receiver (the plan's verifier proves deadlock freedom for
//!   sends that do not block their sender); receiving waits, and ends at an abort or after
//!   the timeout.
//! - Collectives run the same ring (or parameter-server) algorithm as in process, over the
//!   collective tag: the same arithmetic in the same order, so every fabric gives the
//!   threaded run's losses bit for bit.
//! - Tensors on a GPU are copied to host memory before sending (messages hold host `f32`s).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use pipec_plan::{DeviceId, Payload, StageId};

use crate::comm::transport::{Endpoint, Message, SendHalf, Tag, TransportError};

pub const TAG_P2P: i32 = 10;
pub const TAG_COLL: i32 = 11;
pub const TAG_METRIC: i32 = 12;
pub const TAG_TRACE: i32 = 13;
pub const TAG_CKPT: i32 = 14;
/// Each rank's description of its run, and rank 0's verdict (`agreement`).
pub const TAG_AGREE: i32 = 15;
/// Before each step, rank 0's decision on stopping, and each other rank's stop request
/// (`run::stop`).
pub const TAG_STOP: i32 = 16;
/// A CUDA rank's GPU as it found it, and rank 0's verdict (`run::gpus`).
pub const TAG_GPUS: i32 = 17;
/// The start of an NCCL communicator: rank 0's unique id, each rank's report and rank 0's
/// verdict (`comm::nccl::bootstrap`).
pub const TAG_NCCL: i32 = 18;

/// The processes of a job and the messages between them.
pub trait Fabric: Send + Sync {
    /// This process's rank, and how many there are.
    fn rank(&self) -> i32;
    fn size(&self) -> i32;
    /// Queues a message for `dest` on `tag`: a header and, for a tensor, its values.
    /// Returns at once.
    fn post(&self, dest: i32, tag: i32, bytes: Vec<u8>, values: Option<Vec<f32>>) -> Result<(), TransportError>;
    /// The next message from `rank` on `tag` (with its values when `values`); waits until
    /// it comes, `abort` is raised (`Aborted`) or `timeout` has passed (naming `from`).
    fn receive(
        &self,
        rank: i32,
        tag: i32,
        values: bool,
        abort: &AtomicBool,
        timeout: Duration,
        from: DeviceId,
    ) -> Result<(Vec<u8>, Vec<f32>), TransportError>;
    /// Every rank reaches this point before any goes on.
    fn barrier(&self) -> Result<(), TransportError>;
    /// Sends everything posted so far before the process ends; nothing may be posted after.
    fn flush(&self);
    /// Ends the whole job after this rank failed.
    fn abort(&self, code: i32) -> !;
}

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
    let mut b = Vec::with_capacity(16 + 8 * shape.len());
    b.push(tag.map_or(COLLECTIVE_CODE, |t| t.payload.code()));
    b.extend_from_slice(&tag.map_or(0, |t| t.stage.0).to_le_bytes());
    b.extend_from_slice(&tag.map_or(0, |t| t.index).to_le_bytes());
    b.extend_from_slice(&(shape.len() as u32).to_le_bytes());
    for d in shape {
        b.extend_from_slice(&(*d as u64).to_le_bytes());
    }
    b
}

fn decode(b: &[u8], data: Vec<f32>) -> Result<Wire, TransportError> {
    let bad = || TransportError::Other("malformed message header".into());
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
    let mut shape = Vec::with_capacity(ndim.min(16));
    for _ in 0..ndim {
        let s = b.get(off..off + 8).ok_or_else(bad)?;
        shape.push(u64::from_le_bytes(s.try_into().map_err(|_| bad())?) as usize);
        off += 8;
    }
    if off != b.len() {
        return Err(bad());
    }
    Ok(Wire { tag: payload.map(|payload| Tag { payload, stage: StageId(stage), index: mb }), shape, data })
}

/// A device's connection to the others through a fabric.
pub struct ProcessEndpoint<F: Fabric> {
    device: DeviceId,
    rank_of: HashMap<DeviceId, i32>,
    fabric: Arc<F>,
    abort: Arc<AtomicBool>,
    timeout: Duration,
}

impl<F: Fabric> std::fmt::Debug for ProcessEndpoint<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessEndpoint({})", self.device)
    }
}

impl<F: Fabric> ProcessEndpoint<F> {
    /// `devices`: the job's devices by rank.
    pub fn new(
        device: DeviceId,
        devices: &[DeviceId],
        fabric: Arc<F>,
        abort: Arc<AtomicBool>,
        timeout: Duration,
    ) -> Self {
        ProcessEndpoint {
            device,
            rank_of: devices.iter().enumerate().map(|(r, d)| (*d, r as i32)).collect(),
            fabric,
            abort,
            timeout,
        }
    }

    fn rank(&self, d: DeviceId) -> Result<i32, TransportError> {
        self.rank_of.get(&d).copied().ok_or(TransportError::Disconnected(d))
    }

    fn receive(&self, from: DeviceId, tag: i32) -> Result<Wire, TransportError> {
        let (bytes, values) = self.fabric.receive(self.rank(from)?, tag, true, &self.abort, self.timeout, from)?;
        decode(&bytes, values)
    }
}

/// A rank's point-to-point sends, for the computing thread.
struct FabricSender<F: Fabric> {
    rank_of: HashMap<DeviceId, i32>,
    fabric: Arc<F>,
}

impl<F: Fabric> SendHalf for FabricSender<F> {
    fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError> {
        let r = self.rank_of.get(&to).copied().ok_or(TransportError::Disconnected(to))?;
        self.fabric.post(r, TAG_P2P, header(Some(msg.tag), &msg.shape), Some(msg.data))
    }
}

impl<F: Fabric + 'static> Endpoint for ProcessEndpoint<F> {
    fn device(&self) -> DeviceId {
        self.device
    }
    fn send_half(&self) -> Box<dyn SendHalf> {
        Box::new(FabricSender { rank_of: self.rank_of.clone(), fabric: self.fabric.clone() })
    }
    /// Both halves use the same fabric; messages and collectives travel on different tags.
    fn split(self) -> (Self, Self) {
        let other = ProcessEndpoint {
            device: self.device,
            rank_of: self.rank_of.clone(),
            fabric: self.fabric.clone(),
            abort: self.abort.clone(),
            timeout: self.timeout,
        };
        (self, other)
    }
    fn send(&mut self, to: DeviceId, msg: Message) -> Result<(), TransportError> {
        self.fabric.post(self.rank(to)?, TAG_P2P, header(Some(msg.tag), &msg.shape), Some(msg.data))
    }
    fn recv(&mut self, from: DeviceId, tag: Tag) -> Result<Message, TransportError> {
        let m = self.receive(from, TAG_P2P)?;
        let got =
            m.tag.ok_or_else(|| TransportError::Other("a collective message on the point-to-point tag".into()))?;
        if got != tag {
            return Err(TransportError::Mismatch { from, expected: tag, got });
        }
        Ok(Message { tag: got, shape: m.shape, data: m.data })
    }
    fn coll_send(&mut self, to: DeviceId, data: Vec<f32>) -> Result<(), TransportError> {
        self.fabric.post(self.rank(to)?, TAG_COLL, header(None, &[data.len()]), Some(data))
    }
    fn coll_recv(&mut self, from: DeviceId) -> Result<Vec<f32>, TransportError> {
        Ok(self.receive(from, TAG_COLL)?.data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_plan::MicrobatchId;

    #[test]
    fn headers_round_trip_and_a_bad_one_is_an_error() {
        let tag = Tag::gradient(StageId(7), MicrobatchId(3));
        let b = header(Some(tag), &[2, 3]);
        let m = decode(&b, vec![1.0, -2.5]).expect("decodes");
        assert_eq!(m.tag, Some(tag));
        assert_eq!(m.shape, vec![2, 3]);
        assert_eq!(m.data, vec![1.0, -2.5]);
        assert!(decode(&b[..5], vec![]).is_err());
        assert!(decode(&[b.as_slice(), &[0]].concat(), vec![]).is_err());
        assert_eq!(decode(&header(None, &[4]), vec![]).expect("decodes").tag, None);
    }
}
