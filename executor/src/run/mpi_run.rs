//! Running a plan as one MPI process per device (`mpirun -np N pipec run SPEC --transport
//! mpi`, or Slurm's `srun --mpi=pmix`): MPI is brought up, then the rank runs its device
//! over the MPI fabric ([`crate::run::process_run`]).

use std::sync::Arc;

use mpi::traits::*;
use mpi::Threading;
use pipec_plan::Plan;

use crate::comm::mpi_transport::{abort_world, MpiFabric};
use crate::run::job::{validate, working_devices, RunError, RunOptions};
pub use crate::run::process_run::{report_failure, RankHooks, RankInfo, RankOutcome};

/// Runs this rank's device. Returns the job's report on rank 0, this rank's own elsewhere. A failure after
/// MPI is up aborts the whole job, so no rank waits forever.
pub fn run(plan: &Plan, options: &RunOptions, hooks: RankHooks<'_>) -> RankOutcome {
    validate(plan).map_err(|e| (None, e))?;
    let n_devices = working_devices(plan).len();
    if !launched() && n_devices > 1 {
        return Err((None, RunError::setup(format!("`--transport mpi` runs one process per device: start the plan's {n_devices} devices with `mpirun -np {n_devices} pipec run …` (see `pipec launch`)"))));
    }
    let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
        .ok_or((None, RunError::setup("MPI could not be initialised (is this process started by mpirun?)")))?;
    let world = universe.world();
    let up = || -> RankOutcome {
        let (rank, size) = (world.rank(), world.size());
        if threading != Threading::Multiple {
            return Err((
                None,
                RunError::setup(format!(
                    "rank {rank}: the MPI library grants thread level {threading:?}; pipec needs MPI_THREAD_MULTIPLE"
                )),
            ));
        }
        slurm_agrees(rank, size).map_err(|e| (None, RunError::setup(e)))?;
        let how = |n: usize| format!("run `mpirun -np {n}` (see `pipec launch`)");
        crate::run::process_run::run_rank(plan, options, hooks, Arc::new(MpiFabric::start(&world)), ("mpirun", &how))
    };
    match up() {
        Ok(done) => Ok(done),
        Err((info, e)) => {
            // Abort the job while MPI is still up: returning would drop `universe`, and
            // MPI_Finalize waits for every rank, a silent one included, before the abort.
            report_failure(info, &e);
            abort_world(&world, 1)
        }
    }
}

/// Under Slurm's `srun` (a task of a job step, not a process `mpirun` started), Slurm's
/// task number and count must be MPI's rank and size: otherwise the ranks were not wired
/// to Slurm's tasks (`srun` without `--mpi=pmix`, each task a world of its own).
fn slurm_agrees(rank: i32, size: i32) -> Result<(), String> {
    if std::env::var_os("OMPI_COMM_WORLD_RANK").is_some() {
        return Ok(());
    }
    let var = |name: &str| std::env::var(name).ok().and_then(|v| v.trim().parse::<i64>().ok());
    if let Some(task) = var("SLURM_PROCID").filter(|t| *t != i64::from(rank)) {
        return Err(format!("Slurm started this process as task {task} (SLURM_PROCID) but MPI made it rank {rank} of {size}: start the ranks with `srun --mpi=pmix` (see `pipec launch --slurm`)"));
    }
    if let Some(tasks) = var("SLURM_NTASKS").filter(|t| *t != i64::from(size)) {
        return Err(format!("Slurm's job step has {tasks} tasks (SLURM_NTASKS) but MPI's world has {size} ranks: start the ranks with `srun --mpi=pmix` (see `pipec launch --slurm`)"));
    }
    Ok(())
}

/// Whether this process was started by an MPI launcher (Open MPI's `mpirun`, or a PMI/PMIx
/// launcher such as Slurm's `srun`): without one, MPI would start a singleton world.
pub fn launched() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"].iter().any(|v| std::env::var_os(v).is_some())
}
