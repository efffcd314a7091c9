//! One rank of a job that torchrun's variables describe (`pipec run --transport tcp`):
//! the rendezvous, then this process's device over the TCP fabric.

use std::sync::Arc;

use pipec_plan::Plan;

use crate::comm::fabric::Fabric;
use crate::comm::tcp::{Rendezvous, TcpFabric};
use crate::run::job::{validate, working_devices, RunError, RunOptions};
use crate::run::process_run::{report_failure, RankHooks, RankOutcome};

/// Runs this process's device of the job torchrun's variables describe (`pipec run
/// --transport tcp`): the rendezvous within the run's timeout, then the device over the
/// TCP fabric. Returns the job's report on rank 0, this rank's own elsewhere; a failure after the
/// rendezvous ends the whole job.
pub fn run(plan: &Plan, options: &RunOptions, hooks: RankHooks<'_>) -> RankOutcome {
    validate(plan).map_err(|e| (None, e))?;
    let rv = Rendezvous::from_env().map_err(|e| (None, RunError::setup(e)))?;
    let devices = working_devices(plan).len();
    if rv.size as usize != devices {
        return Err((
            None,
            RunError::setup(format!(
                "WORLD_SIZE is {} but the plan has {devices} devices with work: start {devices} processes, RANK 0 to {}",
                rv.size,
                devices.saturating_sub(1)
            )),
        ));
    }
    let fabric = Arc::new(TcpFabric::connect(&rv, options.timeout).map_err(|e| (None, RunError::setup(e)))?);
    let how = |n: usize| format!("start {n} processes, RANK 0 to {}", n - 1);
    match crate::run::process_run::run_rank(plan, options, hooks, fabric.clone(), ("the launcher", &how)) {
        Ok(done) => Ok(done),
        Err((info, e)) => {
            report_failure(info, &e);
            fabric.abort(1)
        }
    }
}
