//! Transports and fabrics: how a device's messages and collectives reach another device's,
//! in one process (threads), over MPI or over TCP. Host buffers; nothing here knows Burn.

pub mod transport;
pub mod fabric;
pub mod exchanger;
pub mod tcp;
#[cfg(feature = "mpi")]
pub(crate) mod mpi_send;
#[cfg(feature = "mpi")]
pub mod mpi_transport;
