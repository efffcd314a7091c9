//! Running a plan: worker threads and the coordinator, one process per device over a
//! fabric, MPI start-up, data sets, calibration and profiling, the ranks' agreement, GPU
//! placement.

pub(crate) mod affinity;
pub mod agreement;
pub mod calibrate;
pub mod gpus;
pub mod job;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi_run;
#[cfg(all(feature = "cuda", feature = "nccl"))]
pub mod nccl_check;
pub mod process_run;
pub mod profile;
pub mod stop;
pub mod tcp_run;
pub(crate) mod threads;
