//! `pipec run --nccl-check` on a CUDA build with NCCL: one communicator over every rank,
//! started on each rank's GPU over the job's fabric (`comm::nccl::bootstrap`), and checked
//! with an all-reduce on device buffers, then timed.
//!
//! This module uses `unsafe` for one call: NCCL's all-reduce on a buffer this module
//! allocated on the rank's GPU, queued on a stream of that GPU's context.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, DevicePtrMut};

use crate::comm::fabric::Fabric;
use crate::comm::nccl::bootstrap;
use crate::comm::nccl::library::{Communicator, DataType, NcclLibrary};

/// What the check measured.
#[derive(Debug, Clone)]
pub struct Checked {
    pub library: String,
    pub ranks: usize,
    pub bytes: usize,
    /// The mean time of one all-reduce of `bytes`, its algorithm bandwidth (bytes / time)
    /// and NCCL's bus bandwidth (`2 (n − 1) / n` × the algorithm's: nccl-tests' figures; 0
    /// on one rank, which moves nothing).
    pub seconds: f64,
    pub alg_gb_s: f64,
    pub bus_gb_s: f64,
}

/// Starts a communicator over every rank of `fabric` on GPU `ordinal` (the context made
/// current on this thread first, as NCCL's start needs) and checks it: an all-reduce of
/// each rank's `rank + 1` over 16 MiB must give `n (n + 1) / 2` everywhere; then times ten.
pub fn check<F: Fabric>(fabric: &F, ordinal: usize, timeout: Duration) -> Result<Checked, String> {
    let library = NcclLibrary::open()?;
    let context = crate::error::catch_quietly(|| CudaContext::new(ordinal))
        .map_err(|_| "the NVIDIA driver library cannot be loaded".to_string())?
        .map_err(|e| format!("GPU {ordinal} cannot be opened: {e:?}"))?;
    context.bind_to_thread().map_err(|e| format!("GPU {ordinal}'s context: {e:?}"))?;
    let comm = bootstrap::start(&library, fabric, timeout)?;
    // from here every failure aborts the communicator: a peer may be gone, and ending it
    // the orderly way would wait for that peer
    match checked(&library, &comm, fabric, &context, ordinal, timeout) {
        Ok(c) => Ok(c),
        Err(e) => {
            comm.abort();
            Err(e)
        }
    }
}

/// The check on a started communicator.
fn checked<F: Fabric>(
    library: &NcclLibrary,
    comm: &Communicator,
    fabric: &F,
    context: &std::sync::Arc<CudaContext>,
    ordinal: usize,
    timeout: Duration,
) -> Result<Checked, String> {
    let (rank, n) = (fabric.rank() as usize, fabric.size() as usize);
    let count = 4 << 20;
    let stream = context.new_stream().map_err(|e| format!("a stream on GPU {ordinal}: {e:?}"))?;
    let cuda = |what: &str, e: cudarc::driver::DriverError| format!("the NCCL check's {what} on GPU {ordinal}: {e:?}");
    let mut buffer = stream.clone_htod(&vec![(rank + 1) as f32; count]).map_err(|e| cuda("upload", e))?;
    let sum = |buffer: &mut CudaSlice<f32>| -> Result<(), String> {
        let (ptr, _sync) = buffer.device_ptr_mut(&stream);
        // SAFETY: one buffer of `count` f32 on this GPU, summed in place on its stream.
        unsafe {
            library.all_reduce(
                comm,
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                DataType::F32,
                stream.cu_stream().cast(),
            )
        }
    };
    // the stream's work is waited for with the communicator watched and a bound: a kernel
    // waiting on a dead peer never ends, where a stream's synchronize would wait with it
    let finished = |what: &str| -> Result<(), String> {
        let event = stream.record_event(None).map_err(|e| cuda(what, e))?;
        let begun = Instant::now();
        loop {
            if event.try_is_complete().map_err(|e| cuda(what, e))? {
                return Ok(());
            }
            if let Some(e) = library.failure(comm) {
                return Err(format!("NCCL failed during the check's {what}: {e}"));
            }
            if begun.elapsed() > timeout {
                return Err(format!("the check's {what} had not ended after {} s (a peer gone?)", timeout.as_secs()));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    };
    sum(&mut buffer)?;
    finished("first all-reduce")?;
    let back = stream.clone_dtoh(&buffer).map_err(|e| cuda("download", e))?;
    let want = (n * (n + 1) / 2) as f32;
    if let Some((i, v)) = back.iter().enumerate().find(|(_, v)| **v != want) {
        return Err(format!("NCCL's all-reduce on rank {rank} gave {v} at {i} where every rank's sum is {want}"));
    }
    let runs = 10;
    let started = Instant::now();
    for _ in 0..runs {
        sum(&mut buffer)?;
    }
    finished("timed all-reduces")?;
    let seconds = started.elapsed().as_secs_f64() / runs as f64;
    let bytes = count * 4;
    let alg = bytes as f64 / seconds / 1e9;
    let bus = 2.0 * (n - 1) as f64 / n as f64 * alg;
    Ok(Checked { library: library.describe(), ranks: n, bytes, seconds, alg_gb_s: alg, bus_gb_s: bus })
}
