//! Running a plan as one MPI process per device (`mpirun -np N pipec run SPEC --transport
//! mpi`). Every rank executes only its own device's stream; rank 0 gathers each step's
//! loss and the final step's trace and reports them.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;
use pipec_plan::{DeviceId, Plan};

use crate::mpi_transport::{receive_bytes, start_sender, MpiEndpoint, TAG_CKPT, TAG_METRIC, TAG_TRACE};
use crate::{run_workers, RunError, RunOptions, RunReport, StepMetrics};

/// What this rank is.
#[derive(Debug, Clone, Copy)]
pub struct RankInfo {
    pub rank: i32,
    pub size: i32,
    pub device: DeviceId,
}

fn f64s(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_f64s(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect()
}

/// Runs this rank's device. Returns the report on rank 0 (None elsewhere). On failure the
/// caller must abort the job ([`abort`]), so no rank waits forever.
pub fn run(
    plan: &Plan,
    options: &RunOptions,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<(RankInfo, Option<RunReport>), (Option<RankInfo>, RunError)> {
    crate::validate(plan).map_err(|e| (None, e))?;
    let n_devices = crate::working_devices(plan).len();
    if !launched() && n_devices > 1 {
        return Err((None, RunError::setup(format!("`--transport mpi` runs one process per device: start the plan's {n_devices} devices with `mpirun -np {n_devices} pipec run …` (see `pipec launch`)"))));
    }
    let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
        .ok_or((None, RunError::setup("MPI could not be initialised (is this process started by mpirun?)")))?;
    let world = universe.world();
    match run_rank(plan, options, on_step, &world, threading) {
        Ok(done) => Ok(done),
        Err((info, e)) => {
            // Abort the job while MPI is still up: returning would drop `universe`, and
            // MPI_Finalize waits for every rank, a silent one included, before the abort.
            report_failure(info, &e);
            abort_world(&world, 1)
        }
    }
}

/// Prints a rank's failure the one way every rank does (`pipec run` prints the failures
/// that come before MPI is up the same way).
pub fn report_failure(info: Option<RankInfo>, e: &RunError) {
    match info {
        Some(i) => eprintln!("error: rank {} of {} (device {}): {e}", i.rank, i.size, i.device),
        None => eprintln!("error: {e}"),
    }
}

/// This rank's part of the job, once MPI is up.
fn run_rank(
    plan: &Plan,
    options: &RunOptions,
    on_step: &mut dyn FnMut(&StepMetrics),
    world: &SimpleCommunicator,
    threading: Threading,
) -> Result<(RankInfo, Option<RunReport>), (Option<RankInfo>, RunError)> {
    let (rank, size) = (world.rank(), world.size());
    if threading != Threading::Multiple {
        return Err((
            None,
            RunError::setup(format!(
                "rank {rank}: the MPI library grants thread level {threading:?}; pipec needs MPI_THREAD_MULTIPLE"
            )),
        ));
    }
    let devices = crate::working_devices(plan);
    if size as usize != devices.len() {
        return Err((None, RunError::setup(format!("rank {rank}: the plan has {} devices with work but mpirun started {size} processes; run `mpirun -np {}` (see `pipec launch`)", devices.len(), devices.len()))));
    }
    slurm_agrees(rank, size).map_err(|e| (None, RunError::setup(e)))?;
    let device = devices[rank as usize];
    let info = RankInfo { rank, size, device };
    // every rank is up once all reach this barrier; `pipec launch --exec` waits for this
    // line to know the job started (its start-up bound)
    world.barrier();
    if rank == 0 {
        eprintln!("{} {size} ranks", crate::MPI_STARTED);
    }
    let abort = Arc::new(AtomicBool::new(false));
    let (outgoing, sender_thread) = start_sender(abort.clone());
    let endpoint = MpiEndpoint::new(device, &devices, outgoing.clone(), abort.clone(), options.timeout);
    // Every rank reports each step's (loss sum, loss count) to rank 0, which combines them.
    let timeout = options.timeout;
    let mut gather = |m: &StepMetrics| {
        if rank == 0 {
            let (mut sum, mut count, mut secs) = (m.loss_sum, m.loss_count as f64, m.step_seconds);
            let mut wait = m.checkpoint_wait_s;
            // validation's sums, when this step was followed by one
            let mut validation = m.validation.map(|v| v.sums);
            for r in 1..size {
                if let Ok(b) = receive_bytes(r, TAG_METRIC, &abort, timeout, devices[r as usize]) {
                    let v = from_f64s(&b);
                    if v.len() == 10 {
                        sum += v[1];
                        count += v[2];
                        secs = secs.max(v[3]);
                        wait = wait.map(|w| w.max(v[9]));
                        if v[4] != 0.0 {
                            let total = validation.get_or_insert([0.0; 4]);
                            total.iter_mut().zip(&v[5..9]).for_each(|(a, b)| *a += b);
                        }
                    }
                }
            }
            let loss = if count > 0.0 { sum / count } else { f64::NAN };
            let language_model = crate::is_language_model(plan);
            on_step(&StepMetrics {
                step: m.step,
                loss,
                loss_sum: sum,
                loss_count: count as usize,
                step_seconds: secs,
                samples_per_s: plan.training.batch_size as f64 / secs.max(1e-12),
                perplexity: language_model.then(|| loss.exp()),
                // the same on every rank: a function of the step, and the norm's sum
                lr: m.lr,
                grad_norm: m.grad_norm,
                epoch: m.epoch,
                validation: validation.map(|v| crate::ValidationMetrics::of(v, language_model)),
                checkpoint_wait_s: wait,
            });
        } else {
            let v = m.validation.map_or([0.0; 4], |v| v.sums);
            let has = f64::from(u8::from(m.validation.is_some()));
            let _ = outgoing.send((
                0,
                TAG_METRIC,
                f64s(&[
                    m.step as f64,
                    m.loss_sum,
                    m.loss_count as f64,
                    m.step_seconds,
                    has,
                    v[0],
                    v[1],
                    v[2],
                    v[3],
                    m.checkpoint_wait_s.unwrap_or(0.0),
                ]),
                None,
            ));
        }
    };
    // Checkpoints: every rank sends its stages to rank 0, which writes one checkpoint.
    let ckpt_out = outgoing.clone();
    let ckpt_abort = abort.clone();
    let identity = crate::checkpoint::Identity::of(plan);
    let mut sink = |steps: usize,
                    mut stages: crate::checkpoint::Shards|
     -> Result<Option<std::path::PathBuf>, crate::error::ExecError> {
        use crate::error::ExecError;
        if rank != 0 {
            let _ = ckpt_out.send((0, TAG_CKPT, crate::checkpoint::encode(&stages), None));
            return Ok(None);
        }
        for r in 1..size {
            // a transfer that fails keeps its kind: a wait ended by another failure is
            // secondary to it, and the root cause is what the rank reports
            let b = receive_bytes(r, TAG_CKPT, &ckpt_abort, timeout, devices[r as usize])?;
            for (s, st) in crate::checkpoint::decode(&b).map_err(ExecError::Checkpoint)? {
                stages.entry(s).or_insert(st);
            }
        }
        match &options.checkpoint_dir {
            Some(dir) => {
                crate::checkpoint::write(dir, steps, &identity, &stages).map(Some).map_err(ExecError::Checkpoint)
            }
            None => Ok(None),
        }
    };
    let report = match options.backend {
        crate::BackendKind::Cpu => {
            let placement = [(device, (Default::default(), "cpu".to_string()))].into_iter().collect();
            run_workers::<crate::CpuBackend, _>(
                plan,
                options,
                &placement,
                vec![endpoint],
                abort.clone(),
                &mut gather,
                &mut sink,
            )
        }
        crate::BackendKind::Cuda => run_cuda(plan, options, device, endpoint, abort.clone(), &mut gather, &mut sink),
    }
    .map_err(|e| (Some(info), e))?;
    drop(ckpt_out);
    // Everything queued must be sent before MPI is finalised: close the queue, join the
    // sender, then meet at a barrier.
    let finish = |outgoing: std::sync::mpsc::Sender<crate::mpi_transport::Outgoing>| {
        drop(outgoing);
        let _ = sender_thread.join();
    };
    if rank == 0 {
        let mut merged = report.clone();
        for r in 1..size {
            let b = receive_bytes(r, TAG_TRACE, &abort, timeout, devices[r as usize])
                .map_err(|e| (Some(info), RunError::setup(e.to_string())))?;
            merge_traces(&mut merged, &from_f64s(&b));
        }
        finish(outgoing);
        world.barrier();
        Ok((info, Some(merged)))
    } else {
        let _ = outgoing.send((0, TAG_TRACE, f64s(&flat_traces(&report)), None));
        finish(outgoing);
        world.barrier();
        Ok((info, None))
    }
}

/// A rank's traces, and what it measured of its device's memory, as numbers for rank 0:
/// the counts of the last step's trace, the communication timeline, the step timeline and
/// the device facts, then each (device facts: device, whether the model state was
/// measured, weights, gradients, optimizer, whether resident memory was, baseline, peak).
fn flat_traces(report: &RunReport) -> Vec<f64> {
    let devices: std::collections::BTreeSet<DeviceId> =
        report.held.keys().chain(report.resident.keys()).copied().collect();
    let mut flat: Vec<f64> = vec![
        report.trace.len() as f64,
        report.comm_timeline.len() as f64,
        report.timeline.len() as f64,
        devices.len() as f64,
    ];
    flat.extend(report.trace.iter().flat_map(|(d, i, s, e)| [f64::from(d.0), *i as f64, *s, *e]));
    let five = |(d, k, i, s, e): &(DeviceId, usize, usize, f64, f64)| [f64::from(d.0), *k as f64, *i as f64, *s, *e];
    flat.extend(report.comm_timeline.iter().flat_map(five));
    flat.extend(report.timeline.iter().flat_map(five));
    for d in devices {
        let h = report.held.get(&d);
        let r = report.resident.get(&d);
        flat.extend([
            f64::from(d.0),
            f64::from(u8::from(h.is_some())),
            h.map_or(0.0, |h| h.weights as f64),
            h.map_or(0.0, |h| h.gradients as f64),
            h.map_or(0.0, |h| h.optimizer as f64),
            f64::from(u8::from(r.is_some())),
            r.map_or(0.0, |r| r.baseline as f64),
            r.map_or(0.0, |r| r.peak as f64),
        ]);
    }
    flat
}

/// Rank 0 adds another rank's traces and device facts ([`flat_traces`]) to the run's
/// (timelines up to `TIMELINE_LIMIT`).
fn merge_traces(merged: &mut RunReport, v: &[f64]) {
    let count = |i: usize| v.get(i).map_or(0, |n| *n as usize);
    let body = &v[v.len().min(4)..];
    let n = count(0).min(body.len() / 4);
    let c = count(1).min((body.len() - 4 * n) / 5);
    let t = count(2).min((body.len() - 4 * n - 5 * c) / 5);
    let f = count(3).min((body.len() - 4 * n - 5 * c - 5 * t) / 8);
    let entry = |t: &[f64]| (DeviceId(t[0] as u32), t[1] as usize, t[2] as usize, t[3], t[4]);
    let (trace, rest) = body.split_at(4 * n);
    let (comm, rest) = rest.split_at(5 * c);
    let (timeline, rest) = rest.split_at(5 * t);
    for t in trace.chunks_exact(4) {
        merged.trace.push((DeviceId(t[0] as u32), t[1] as usize, t[2], t[3]));
    }
    for t in comm.chunks_exact(5) {
        if merged.comm_timeline.len() < crate::TIMELINE_LIMIT {
            merged.comm_timeline.push(entry(t));
        }
    }
    for t in timeline.chunks_exact(5) {
        if merged.timeline.len() < crate::TIMELINE_LIMIT {
            merged.timeline.push(entry(t));
        }
    }
    for x in rest[..8 * f].chunks_exact(8) {
        let d = DeviceId(x[0] as u32);
        if x[1] != 0.0 {
            let held = crate::HeldState { weights: x[2] as u64, gradients: x[3] as u64, optimizer: x[4] as u64 };
            merged.held.insert(d, held);
        }
        if x[5] != 0.0 {
            merged.resident.insert(d, crate::resident::Resident { baseline: x[6] as u64, peak: x[7] as u64 });
        }
    }
}

/// This rank's device on the GPU of its local rank. Activations and gradients are staged
/// through host memory (`transport::Message` holds host `f32`s), so any MPI works, CUDA-aware
/// or not.
#[allow(clippy::too_many_arguments)]
fn run_cuda(
    plan: &Plan,
    options: &RunOptions,
    device: DeviceId,
    endpoint: MpiEndpoint,
    abort: Arc<AtomicBool>,
    on_step: &mut dyn FnMut(&StepMetrics),
    sink: &mut crate::CheckpointSink<'_>,
) -> Result<RunReport, RunError> {
    crate::cuda_available().map_err(RunError::setup)?;
    #[cfg(feature = "cuda")]
    {
        type B = burn::backend::Autodiff<burn::backend::Cuda>;
        let gpus = crate::cuda::device_count().map_err(RunError::setup)?;
        let local = crate::gpus::local_rank_from_env().unwrap_or(0);
        let gpu = crate::gpus::for_local_rank(local, gpus, options.share_gpus).map_err(RunError::setup)?;
        let placement =
            [(device, (burn::backend::cuda::CudaDevice::new(gpu), format!("GPU {gpu}")))].into_iter().collect();
        run_workers::<B, _>(plan, options, &placement, vec![endpoint], abort, on_step, sink)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (plan, options, device, endpoint, abort, on_step, sink);
        Err(RunError::setup("CUDA support is not built in"))
    }
}

/// Ends the whole job (MPI_Abort) after a rank failed; a process whose MPI never started
/// or has already shut down just exits (MPI_Abort is not allowed then).
pub fn abort(code: i32) -> ! {
    if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
        abort_world(&SimpleCommunicator::world(), code)
    }
    std::process::exit(code)
}

/// How long MPI_Abort may take before this process exits on its own.
const ABORT_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// MPI_Abort, and this process's own exit if that does not end it within `ABORT_GRACE`:
/// with a peer unreachable (a network link down), Open MPI's abort waits on a daemon it
/// cannot reach, and the rank must not outlive its job.
fn abort_world(world: &SimpleCommunicator, code: i32) -> ! {
    std::thread::spawn(move || {
        std::thread::sleep(ABORT_GRACE);
        std::process::exit(code)
    });
    world.abort(code)
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
