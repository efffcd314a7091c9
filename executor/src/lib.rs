//! pipec's executor: trains a compiled plan for real on Burn by interpreting every device's
//! instruction stream, one worker thread per device (or one process per device over MPI or
//! TCP, through the same [`transport::Endpoint`] trait). The only crate of pipec that links
//! Burn.

pub use pipec_plan::checkpoint;
// The layers, each importing only those below it (tests/architecture.rs holds the order):
// comm < error < backend < nn < parallel < interp < run.
pub mod backend;
pub mod comm;
pub mod error;
pub mod interp;
pub mod nn;
pub mod parallel;
pub mod run;

pub use backend::CpuBackend;
pub use comm::{fabric, transport};
pub use interp::data;
pub use interp::worker::HeldState;
pub use interp::worker::StepReport as WorkerStep;
pub use interp::worker::{add_expert_tokens, ExpertTokens};
pub use parallel::reshard::whole_weights;
pub use run::job::{
    caveats, cuda_available, gpu_placement, is_language_model, read_checkpoint, validate, working_devices, BackendKind,
    Placement, Resume, RunError, RunOptions, RunReport, StepMetrics, ValidationMetrics, MPI_STARTED,
};
pub use run::local::run;
#[cfg(feature = "wgpu")]
pub use run::local::run_wgpu;
pub use run::threads::{run_workers, CheckpointSink, TIMELINE_LIMIT};
pub use run::{calibrate, process_run, profile};
#[cfg(feature = "mpi")]
pub use {comm::mpi_transport, run::mpi_run};
