//! How the ranks of a job start one NCCL communicator together over pipec's own fabric
//! (MPI or TCP), so that no rank waits forever on another:
//!
//! 1. Rank 0 asks NCCL for the communicator's unique id and sends its 128 bytes to every
//!    rank (or, where NCCL could not make one, why: every rank stops with that message).
//! 2. Every rank starts its part of the communicator without blocking (NCCL's
//!    `blocking = 0` configuration) and polls it. A rank tells rank 0 that it has started,
//!    and reports as soon as its part is ready (with a digest of the id it used, which
//!    rank 0 compares with its own: the id is byte-equal on every rank or the communicator
//!    is refused) or has failed.
//! 3. Rank 0 gives the verdict as soon as it knows it: `go` once every rank is ready; `stop`
//!    at the first failure, or when a rank has said nothing within the timeout. A rank still
//!    waiting on NCCL (whose initialisation is collective, and never finishes where one rank
//!    failed) hears the verdict while it polls, aborts its part (`ncclCommAbort`) and stops
//!    with the verdict's words; a rank that hears nothing from rank 0 (rank 0 keeps the
//!    time: the others wait [`GRACE`] longer) aborts on its own. So any rank's failure or
//!    silence stops every rank within the timeout, and a failure stops them as soon as
//!    rank 0 hears of it.
//!
//! The protocol bounds its own waits; NCCL's calls themselves are trusted to return (a
//! non-blocking start returns at once, and `ncclCommAbort` ends what it started).
//!
//! The NCCL calls are behind [`Nccl`], so the protocol is tested without a GPU or the
//! library (`tests.rs`: a stand-in whose initialisation, like NCCL's, finishes only when every
//! rank has started it).

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use pipec_plan::DeviceId;
use sha2::{Digest, Sha256};

use crate::comm::fabric::{Fabric, TAG_NCCL};
use crate::comm::transport::TransportError;

/// The bytes of NCCL's `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// An NCCL communicator's unique id, as rank 0 made it.
pub type UniqueId = [u8; UNIQUE_ID_BYTES];

/// Where a rank's part of a communicator being started stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    Ready,
    Pending,
    Failed(String),
}

/// The NCCL calls the start of a communicator makes (the library, or a stand-in in tests).
pub trait Nccl {
    /// A rank's part of a communicator.
    type Comm;
    /// A new communicator's unique id (rank 0 only).
    fn unique_id(&self) -> Result<UniqueId, String>;
    /// Starts this rank's part of the communicator of `ranks` ranks without waiting for the
    /// others.
    fn start(&self, id: &UniqueId, ranks: usize, rank: usize) -> Result<Self::Comm, String>;
    /// Whether the part is ready, still starting, or failed.
    fn progress(&self, comm: &Self::Comm) -> Progress;
    /// Ends a part, started or not, without waiting for the other ranks (`ncclCommAbort`).
    fn abort(&self, comm: Self::Comm);
}

/// The messages of the start, on [`TAG_NCCL`]: the first byte says which.
const ID: u8 = 0;
const NO_ID: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;
const GO: u8 = 4;
const STOP: u8 = 5;
const STARTED: u8 = 6;

/// How long a rank sleeps between two polls of its part and its messages.
const POLL: Duration = Duration::from_millis(1);
/// How much longer than rank 0 another rank waits on its own part: rank 0 keeps the time
/// and names every rank in its verdict; a rank ends the wait itself only where rank 0 is gone.
const GRACE: Duration = Duration::from_secs(5);

fn message(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(1 + body.len());
    m.push(kind);
    m.extend_from_slice(body);
    m
}

fn digest(id: &UniqueId) -> [u8; 32] {
    Sha256::digest(id).into()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A duration as the words `1.5 s`.
fn secs(d: Duration) -> String {
    format!("{} s", (d.as_secs_f64() * 10.0).round() / 10.0)
}

/// What a rank received on the start's tag: a message, nothing yet, or an error.
enum Heard {
    Message(Vec<u8>),
    Nothing,
}

/// The next message from `rank`, without waiting (`patience` zero) or for at most `patience`.
fn hear<F: Fabric>(fabric: &F, rank: i32, patience: Duration) -> Result<Heard, String> {
    let never = AtomicBool::new(false);
    match fabric.receive(rank, TAG_NCCL, false, &never, patience, DeviceId(rank as u32)) {
        Ok((b, _)) => Ok(Heard::Message(b)),
        Err(TransportError::Timeout { .. }) => Ok(Heard::Nothing),
        Err(e) => Err(format!("rank {rank}: {e}")),
    }
}

fn post<F: Fabric>(fabric: &F, rank: i32, bytes: Vec<u8>) -> Result<(), String> {
    fabric.post(rank, TAG_NCCL, bytes, None).map_err(|e| format!("NCCL's start could not reach rank {rank}: {e}"))
}

/// A failing rank's last word: `kind` and `why` to each of `ranks` (as far as they can be
/// reached), sent before the rank's failure ends the job.
fn tell<F: Fabric>(fabric: &F, ranks: std::ops::Range<i32>, kind: u8, why: &str) {
    for r in ranks {
        let _ = post(fabric, r, message(kind, why.as_bytes()));
    }
    fabric.flush();
}

/// Starts this rank's part of one communicator over every rank of `fabric` and returns it
/// once every rank's part is ready; otherwise every rank returns an error (each started part
/// aborted), within `timeout`.
pub fn start<N: Nccl, F: Fabric>(nccl: &N, fabric: &F, timeout: Duration) -> Result<N::Comm, String> {
    if fabric.rank() == 0 {
        lead(nccl, fabric, timeout)
    } else {
        follow(nccl, fabric, timeout)
    }
}

/// Rank 0: makes the id, starts its own part, hears every rank and gives the verdict.
fn lead<N: Nccl, F: Fabric>(nccl: &N, fabric: &F, timeout: Duration) -> Result<N::Comm, String> {
    let size = fabric.size();
    let begun = Instant::now();
    let id = match nccl.unique_id() {
        Ok(id) => id,
        Err(e) => {
            let why = format!("NCCL could not make the communicator's unique id on rank 0: {e}");
            tell(fabric, 1..size, NO_ID, &why);
            return Err(why);
        }
    };
    for r in 1..size {
        if let Err(e) = post(fabric, r, message(ID, &id)) {
            // the ranks that have the id are told to stop rather than wait on NCCL
            let why = format!("NCCL's communicator did not start: {e}");
            tell(fabric, 1..r, STOP, &why);
            return Err(why);
        }
    }
    let expected = digest(&id);
    let mut comm = None;
    let mut failures: BTreeMap<i32, String> = BTreeMap::new();
    match nccl.start(&id, size as usize, 0) {
        Ok(c) => comm = Some(c),
        Err(e) => {
            failures.insert(0, e);
        }
    }
    let mut own_ready = false;
    let mut ready: Vec<bool> = (0..size).map(|r| r == 0).collect();
    // the ranks that have started their part (and wait on NCCL), told apart from the silent
    let mut started: Vec<bool> = (0..size).map(|r| r == 0).collect();
    while failures.is_empty() && !(own_ready && ready.iter().all(|r| *r)) {
        if let Some(c) = &comm {
            if !own_ready {
                match nccl.progress(c) {
                    Progress::Ready => own_ready = true,
                    Progress::Pending => {}
                    Progress::Failed(e) => {
                        failures.insert(0, e);
                    }
                }
            }
        }
        for r in 1..size {
            if ready[r as usize] || failures.contains_key(&r) {
                continue;
            }
            match hear(fabric, r, Duration::ZERO) {
                Ok(Heard::Nothing) => {}
                Ok(Heard::Message(m)) => match m.split_first() {
                    Some((&STARTED, _)) => started[r as usize] = true,
                    Some((&READY, d)) if d == expected => ready[r as usize] = true,
                    Some((&READY, _)) => {
                        failures.insert(r, "it started NCCL with another unique id than rank 0 sent".into());
                    }
                    Some((&FAILED, why)) => {
                        failures.insert(r, text(why));
                    }
                    _ => {
                        failures.insert(r, "its report of NCCL's start is malformed".into());
                    }
                },
                Err(e) => {
                    failures.insert(r, e);
                }
            }
        }
        if failures.is_empty() && begun.elapsed() > timeout {
            let ranks = |f: &dyn Fn(usize) -> bool| -> Vec<String> {
                (0..size as usize).filter(|r| f(*r)).map(|r| r.to_string()).collect()
            };
            let silent = ranks(&|r| !started[r] && !ready[r]);
            let waiting = ranks(&|r| if r == 0 { !own_ready } else { started[r] && !ready[r] });
            let mut what = Vec::new();
            if !silent.is_empty() {
                what.push(format!("rank(s) {} said nothing", silent.join(", ")));
            }
            if !waiting.is_empty() {
                what.push(format!("rank(s) {} started their part and it did not finish", waiting.join(", ")));
            }
            failures.insert(-1, format!("{} within {}", what.join("; "), secs(timeout)));
        }
        if failures.is_empty() {
            std::thread::sleep(POLL);
        }
    }
    if failures.is_empty() {
        // every rank is told; a rank that cannot be is named, and this rank's part ended
        let lost: Vec<String> = (1..size).filter_map(|r| post(fabric, r, message(GO, &[])).err()).collect();
        return match (comm, lost.is_empty()) {
            (Some(c), true) => Ok(c),
            (Some(c), false) => {
                nccl.abort(c);
                Err(lost.join("; "))
            }
            (None, _) => Err("rank 0 has no NCCL communicator".to_string()),
        };
    }
    let why = failures
        .iter()
        .map(|(r, e)| if *r < 0 { e.clone() } else { format!("rank {r}: {e}") })
        .collect::<Vec<_>>()
        .join("; ");
    let why = format!("NCCL's communicator did not start: {why}");
    tell(fabric, 1..size, STOP, &why);
    if let Some(c) = comm {
        nccl.abort(c);
    }
    Err(why)
}

/// Every other rank: takes the id, starts its part, reports, and follows rank 0's verdict.
fn follow<N: Nccl, F: Fabric>(nccl: &N, fabric: &F, timeout: Duration) -> Result<N::Comm, String> {
    let (rank, size) = (fabric.rank(), fabric.size());
    let silent = |d: Duration| format!("rank 0 said nothing of NCCL's start within {}", secs(d));
    let malformed = || {
        let why = "rank 0's NCCL unique id is malformed".to_string();
        tell(fabric, 0..1, FAILED, &why);
        Err(why)
    };
    let id: UniqueId = match hear(fabric, 0, timeout)? {
        Heard::Nothing => return Err(silent(timeout)),
        Heard::Message(m) => match m.split_first() {
            Some((&ID, id)) => match id.try_into() {
                Ok(id) => id,
                Err(_) => return malformed(),
            },
            Some((&NO_ID, why)) => return Err(text(why)),
            _ => return malformed(),
        },
    };
    // this rank's clock starts with the id, after rank 0's: rank 0 always judges first
    let begun = Instant::now();
    let comm = match nccl.start(&id, size as usize, rank as usize) {
        Ok(c) => c,
        Err(e) => {
            tell(fabric, 0..1, FAILED, &e);
            return Err(format!("NCCL's communicator did not start on rank {rank}: {e}"));
        }
    };
    if let Err(e) = post(fabric, 0, message(STARTED, &[])) {
        nccl.abort(comm);
        return Err(e);
    }
    let stop = |comm: N::Comm, why: String| {
        nccl.abort(comm);
        Err(why)
    };
    let verdict = |m: Vec<u8>| match m.split_first() {
        Some((&GO, _)) => Ok(()),
        Some((&STOP, why)) => Err(text(why)),
        _ => Err("rank 0's verdict on NCCL's start is malformed".to_string()),
    };
    // poll the part, listening for rank 0's verdict (a failure elsewhere) meanwhile
    loop {
        match nccl.progress(&comm) {
            Progress::Ready => break,
            Progress::Pending => {}
            Progress::Failed(e) => {
                tell(fabric, 0..1, FAILED, &e);
                nccl.abort(comm);
                return Err(format!("NCCL's communicator did not start on rank {rank}: {e}"));
            }
        }
        match hear(fabric, 0, Duration::ZERO) {
            Ok(Heard::Nothing) => {}
            Ok(Heard::Message(m)) => {
                return match verdict(m) {
                    Ok(()) => stop(comm, "rank 0 said go before this rank's NCCL part was ready".into()),
                    Err(why) => stop(comm, why),
                }
            }
            Err(e) => return stop(comm, e),
        }
        if begun.elapsed() > timeout + GRACE {
            let why = format!(
                "this rank's NCCL part did not start within {}, and rank 0 gave no verdict",
                secs(timeout + GRACE)
            );
            tell(fabric, 0..1, FAILED, &why);
            nccl.abort(comm);
            return Err(format!("rank {rank}: {why}"));
        }
        std::thread::sleep(POLL);
    }
    if let Err(e) = post(fabric, 0, message(READY, &digest(&id))) {
        return stop(comm, e);
    }
    let left = (timeout + GRACE).saturating_sub(begun.elapsed()).max(POLL);
    match hear(fabric, 0, left) {
        Ok(Heard::Message(m)) => match verdict(m) {
            Ok(()) => Ok(comm),
            Err(why) => stop(comm, why),
        },
        Ok(Heard::Nothing) => {
            let why = format!("rank 0 gave no verdict on NCCL's start within {}", secs(timeout + GRACE));
            tell(fabric, 0..1, FAILED, &why);
            stop(comm, why)
        }
        Err(e) => stop(comm, e),
    }
}

#[cfg(test)]
mod tests;
