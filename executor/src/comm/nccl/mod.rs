//! NCCL between the ranks of a process-per-GPU job (`pipec run --nccl`): the start of one
//! communicator over pipec's own fabric ([`bootstrap`]: rank 0's unique id carried to every
//! rank, non-blocking initialisation, and `ncclCommAbort` on every rank when any rank fails
//! or falls silent), and, with the `nccl` feature, the library itself ([`library`]: found by
//! its usual names and paths at run time, its calls on device buffers). The check on a GPU
//! that `--nccl-check` runs is `run::nccl_check`.

pub mod bootstrap;
#[cfg(feature = "nccl")]
pub mod library;
