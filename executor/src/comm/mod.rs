//! Transports and fabrics: how a device's messages and collectives reach another device's,
//! in one process (threads), over MPI or over TCP. Host buffers, but for NCCL's device
//! buffers (`nccl`); nothing here knows Burn.

pub mod exchanger;
pub mod fabric;
#[cfg(feature = "mpi")]
pub(crate) mod mpi_send;
#[cfg(feature = "mpi")]
pub mod mpi_transport;
pub mod nccl;
pub mod tcp;
pub mod transport;
