//! Running a plan as one process per device, over any [`Fabric`]: every rank executes only
//! its own device's stream; rank 0 gathers each step's metrics, writes the checkpoints
//! (every rank sends it its stages' shards) and gathers the final traces.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use pipec_plan::{checkpoint, DeviceId, Plan};

use crate::comm::fabric::{Fabric, ProcessEndpoint, TAG_AGREE, TAG_CKPT, TAG_GPUS, TAG_METRIC, TAG_STOP, TAG_TRACE};
use crate::interp::worker::{add_expert_tokens, ExpertTokens, HeldState};
use crate::run::agreement::{self, Fingerprint};
use crate::run::job::{self, BackendKind, Resume, RunError, RunOptions, RunReport, StepMetrics, ValidationMetrics};
use crate::run::stop::{self, Begin, StopVote};
use crate::run::threads::{run_workers, CheckpointSink, TIMELINE_LIMIT};

/// What rank 0 does with the job: each step's metrics as it gathers them, then the job's
/// report before the ranks part. The other ranks wait at the parting barrier until
/// `on_report` returns, so a launcher that ends the job as soon as one rank exits (mpirun
/// does, on a non-zero status) cannot cut rank 0's outputs short.
pub struct RankHooks<'h> {
    pub on_step: &'h mut dyn FnMut(&StepMetrics),
    pub on_report: &'h mut dyn FnMut(&RunReport),
}

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

/// The folder of a job's output directory under which `pipec launch --exec` has each
/// attempt's ranks record their failures (`pipec run --record-failures`).
pub const FAILURES_DIR: &str = "failures";

static FAILURES: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// Has `report_failure` also record each failure line in the folder `dir`. mpirun forwards
/// a rank's output through its own event loop, which a write to a host it can no longer
/// reach can block for minutes (a link down); the launcher reads this folder too, so it
/// learns of the failure from the ranks on its own host whatever mpirun does.
pub fn record_failures_in(dir: &std::path::Path) {
    let _ = FAILURES.set(dir.to_path_buf());
}

/// Prints a rank's failure the one way every rank does (`pipec run` prints the failures
/// that come before the fabric is up the same way), and records it where
/// [`record_failures_in`] says (one file per rank, written whole).
pub fn report_failure(info: Option<RankInfo>, e: &RunError) {
    let line = match info {
        Some(i) => format!("error: rank {} of {} (device {}): {e}", i.rank, i.size, i.device),
        None => format!("error: {e}"),
    };
    // the file first: stderr is a pipe whose reader (mpirun) may be blocked on a host it
    // cannot reach, and a write to it would then never return
    if let Some(dir) = FAILURES.get() {
        let name = match info {
            Some(i) => format!("rank-{}", i.rank),
            None => format!("process-{}", std::process::id()),
        };
        // best effort: the line goes to stderr too
        let _ = pipec_plan::output::write_atomic(&dir.join(format!("{name}.txt")), format!("{line}\n").as_bytes());
    }
    eprintln!("{line}");
}

/// What a rank's run ends with: the job's report on rank 0, this rank's own elsewhere; or
/// the failure, with the rank when it was known.
pub type RankOutcome = Result<(RankInfo, RunReport), (Option<RankInfo>, RunError)>;

/// This rank's part of the job, once its fabric is up (`launcher` names what starts the
/// processes and `how` says how to start n of them, for the error when their number is not
/// the plan's). Returns the job's report on rank 0 and this rank's own elsewhere (its steps'
/// metrics are its own share, and it says whether the job was stopped); on failure the
/// caller aborts the job, so no rank waits forever.
pub fn run_rank<F: Fabric + 'static>(
    plan: &Plan,
    options: &RunOptions,
    hooks: RankHooks<'_>,
    fabric: Arc<F>,
    (launcher, how): (&str, &dyn Fn(usize) -> String),
) -> RankOutcome {
    let RankHooks { on_step, on_report } = hooks;
    let (rank, size) = (fabric.rank(), fabric.size());
    let devices = job::working_devices(plan);
    if size as usize != devices.len() {
        return Err((
            None,
            RunError::setup(format!(
                "rank {rank}: the plan has {} devices with work but {launcher} started {size} processes; {}",
                devices.len(),
                how(devices.len())
            )),
        ));
    }
    let device = devices[rank as usize];
    let info = RankInfo { rank, size, device };
    if options.backend == BackendKind::Cpu {
        crate::backend::resident::check_host_memory(plan, &[device]).map_err(|e| (Some(info), RunError::setup(e)))?;
    }
    // the checkpoint is read once, here: the ranks compare what they start from
    let start =
        options.resume.as_ref().map(|r| r.load(plan)).transpose().map_err(|e| (Some(info), RunError::setup(e)))?;
    let steps = options.steps.unwrap_or(plan.training.steps);
    let mine = Fingerprint::of(plan, steps, start.as_deref()).map_err(|e| (Some(info), RunError::setup(e)))?;
    agree(fabric.as_ref(), &mine, &devices, options.timeout).map_err(|e| (Some(info), RunError::setup(e)))?;
    // a CUDA rank's GPU, judged with every other rank's before anything is allocated
    let gpu = match options.backend {
        BackendKind::Cuda => {
            Some(claim_gpu(fabric.as_ref(), plan, options, &devices).map_err(|e| (Some(info), RunError::setup(e)))?)
        }
        BackendKind::Cpu => None,
    };
    if options.nccl_check {
        check_nccl(fabric.as_ref(), gpu, options.timeout).map_err(|e| (Some(info), RunError::setup(e)))?;
    }
    let abort = Arc::new(AtomicBool::new(false));
    // a stop request (SIGINT/SIGTERM to any rank) is voted on before every step
    let vote = options.stop.is_some().then(|| {
        Arc::new(FabricVote {
            fabric: fabric.clone(),
            devices: devices.clone(),
            abort: abort.clone(),
            timeout: options.timeout,
            flush_free: plan.flush_free.is_some(),
            previous: std::sync::Mutex::new(None),
        }) as Arc<dyn StopVote>
    });
    let options = &RunOptions { resume: start.map(Resume::Loaded), vote, ..options.clone() };
    // every rank is up once all reach this barrier; `pipec launch --exec` waits for this
    // line to know the job started (its start-up bound)
    fabric.barrier().map_err(|e| (Some(info), RunError::setup(e.to_string())))?;
    if rank == 0 {
        eprintln!("{} {size} ranks", job::MPI_STARTED);
    }
    let endpoint = ProcessEndpoint::new(device, &devices, fabric.clone(), abort.clone(), options.timeout);
    let receive_bytes = |r: i32, tag: i32, abort: &AtomicBool| {
        fabric.receive(r, tag, false, abort, options.timeout, devices[r as usize]).map(|(b, _)| b)
    };
    // Every rank reports each step's figures to rank 0, which combines them.
    let mut gather = |m: &StepMetrics| {
        if rank == 0 {
            let theirs = (1..size).filter_map(|r| receive_bytes(r, TAG_METRIC, &abort).ok().map(|b| from_f64s(&b)));
            on_step(&combined_metrics(plan, m, theirs));
        } else {
            let _ = fabric.post(0, TAG_METRIC, f64s(&metric_numbers(m)), None);
        }
    };
    // Checkpoints: every rank sends its stages to rank 0, which writes one checkpoint.
    let ckpt_abort = abort.clone();
    let identity = checkpoint::Identity::of(plan);
    let mut sink = |steps: usize,
                    mut stages: checkpoint::Shards,
                    loss_scale: Option<pipec_plan::recipe::LossScale>|
     -> Result<Option<std::path::PathBuf>, crate::error::ExecError> {
        use crate::error::ExecError;
        if rank != 0 {
            let _ = fabric.post(0, TAG_CKPT, checkpoint::encode(&stages), None);
            return Ok(None);
        }
        for r in 1..size {
            // a transfer that fails keeps its kind: a wait ended by another failure is
            // secondary to it, and the root cause is what the rank reports
            let b = receive_bytes(r, TAG_CKPT, &ckpt_abort)?;
            for (s, st) in checkpoint::decode(&b).map_err(ExecError::Checkpoint)? {
                stages.entry(s).or_insert(st);
            }
        }
        match &options.checkpoint_dir {
            Some(dir) => {
                checkpoint::write(dir, steps, &identity, &stages, loss_scale).map(Some).map_err(ExecError::Checkpoint)
            }
            None => Ok(None),
        }
    };
    let report = match options.backend {
        BackendKind::Cpu => {
            let placement = [(device, (Default::default(), "cpu".to_string()))].into_iter().collect();
            run_workers::<crate::backend::CpuBackend, _>(
                plan,
                options,
                &placement,
                vec![endpoint],
                abort.clone(),
                &mut gather,
                &mut sink,
            )
        }
        BackendKind::Cuda => {
            let gpu = gpu.ok_or_else(|| RunError::setup("no GPU was claimed"));
            gpu.and_then(|gpu| run_cuda(plan, options, (device, gpu), endpoint, abort.clone(), &mut gather, &mut sink))
        }
    }
    .map_err(|e| (Some(info), e))?;
    // everything posted is sent before the ranks part: flush, then meet at a barrier
    if rank == 0 {
        let mut merged = report.clone();
        for r in 1..size {
            let b = receive_bytes(r, TAG_TRACE, &abort).map_err(|e| (Some(info), RunError::setup(e.to_string())))?;
            merge_traces(&mut merged, &from_f64s(&b));
        }
        // the job's outputs before the ranks part: the others wait at the barrier
        on_report(&merged);
        fabric.flush();
        fabric.barrier().map_err(|e| (Some(info), RunError::setup(e.to_string())))?;
        Ok((info, merged))
    } else {
        let _ = fabric.post(0, TAG_TRACE, f64s(&flat_traces(&report)), None);
        fabric.flush();
        fabric.barrier().map_err(|e| (Some(info), RunError::setup(e.to_string())))?;
        Ok((info, report))
    }
}

/// A rank's figures of one step, as numbers for rank 0 ([`combined_metrics`] reads them):
/// step, loss sum and count, seconds, validation (a flag and its four sums), checkpoint
/// wait, aux-loss sum and flag, checkpoint copy (negative: none after this step), then the
/// experts' token counts as (layer, experts, counts...) runs.
fn metric_numbers(m: &StepMetrics) -> Vec<f64> {
    let v = m.validation.map_or([0.0; 4], |v| v.sums);
    let has = f64::from(u8::from(m.validation.is_some()));
    [
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
        m.aux_sum,
        f64::from(u8::from(m.aux_loss.is_some())),
        m.checkpoint_copy_s.unwrap_or(-1.0),
    ]
    .into_iter()
    .chain(
        m.expert_tokens.iter().flat_map(|(layer, took)| {
            [*layer as f64, took.len() as f64].into_iter().chain(took.iter().map(|&t| t as f64))
        }),
    )
    .collect()
}

/// Rank 0's figures of a step, `m`, combined with the other ranks' ([`metric_numbers`]):
/// losses and validation summed, the slowest rank's seconds and checkpoint times, the
/// experts' token counts merged; what every rank has alike (the learning rate, the norm,
/// the loss scale) is rank 0's.
fn combined_metrics(plan: &Plan, m: &StepMetrics, theirs: impl Iterator<Item = Vec<f64>>) -> StepMetrics {
    let (mut sum, mut count, mut secs) = (m.loss_sum, m.loss_count as f64, m.step_seconds);
    let mut wait = m.checkpoint_wait_s;
    let mut copy = m.checkpoint_copy_s;
    // validation's sums, when this step was followed by one
    let mut validation = m.validation.map(|v| v.sums);
    let (mut aux, mut has_aux) = (m.aux_sum, m.aux_loss.is_some());
    let mut expert_tokens = m.expert_tokens.clone();
    for v in theirs.filter(|v| v.len() >= 13) {
        sum += v[1];
        count += v[2];
        secs = secs.max(v[3]);
        wait = wait.map(|w| w.max(v[9]));
        if v[4] != 0.0 {
            let total = validation.get_or_insert([0.0; 4]);
            total.iter_mut().zip(&v[5..9]).for_each(|(a, b)| *a += b);
        }
        aux += v[10];
        has_aux |= v[11] != 0.0;
        if v[12] >= 0.0 {
            copy = Some(copy.unwrap_or(0.0).max(v[12]));
        }
        merge_expert_tokens(&mut expert_tokens, &v[13..]);
    }
    let microbatches = plan.training.microbatches.max(1) as f64;
    let loss = if count > 0.0 { sum / count } else { f64::NAN };
    let language_model = job::is_language_model(plan);
    StepMetrics {
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
        loss_scale: m.loss_scale,
        skipped: m.skipped,
        epoch: m.epoch,
        validation: validation.map(|v| ValidationMetrics::of(v, language_model)),
        checkpoint_wait_s: wait,
        checkpoint_copy_s: copy,
        checkpoint_write_s: m.checkpoint_write_s,
        aux_sum: aux,
        aux_loss: has_aux.then(|| aux / microbatches),
        expert_tokens,
    }
}

/// The ranks' vote on where to stop (SIGINT/SIGTERM may reach any of them, or only some):
/// rank 0 decides every step boundary ([`stop::decide`]) from its own request and those the
/// others sent at the boundary before, and sends the decision to every rank; each other
/// rank waits for it before its step and, unless it stops or this is the last step, sends
/// rank 0 whether it was asked to stop. No rank begins a step before rank 0 has decided it,
/// so all stop at the same boundary, having completed the same steps. Each step costs the
/// others one small message from rank 0, sent when rank 0 reaches the boundary.
struct FabricVote<F: Fabric> {
    fabric: Arc<F>,
    devices: Vec<DeviceId>,
    abort: Arc<AtomicBool>,
    timeout: std::time::Duration,
    flush_free: bool,
    /// Rank 0's decision at the boundary before (none before the first).
    previous: std::sync::Mutex<Option<Begin>>,
}

impl<F: Fabric> std::fmt::Debug for FabricVote<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FabricVote(rank {} of {})", self.fabric.rank(), self.fabric.size())
    }
}

impl<F: Fabric> StopVote for FabricVote<F> {
    fn before(&self, last: bool, asked: bool) -> Result<Begin, crate::error::ExecError> {
        let (rank, size) = (self.fabric.rank(), self.fabric.size());
        let receive = |r: i32| {
            self.fabric.receive(r, TAG_STOP, false, &self.abort, self.timeout, self.devices[r as usize]).map(|m| m.0)
        };
        if rank != 0 {
            let decision = Begin::from_byte(&receive(0)?).map_err(crate::error::ExecError::Plan)?;
            if decision != Begin::Stop && !last {
                self.fabric.post(0, TAG_STOP, vec![u8::from(asked)], None)?;
            }
            return Ok(decision);
        }
        let mut previous = self.previous.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut any = asked;
        if previous.is_some() {
            // every other rank's request from the boundary before (it began that step)
            for r in 1..size {
                any |= receive(r)? != [0];
            }
        }
        let decision = stop::decide(*previous, any, self.flush_free);
        *previous = Some(decision);
        for r in 1..size {
            self.fabric.post(r, TAG_STOP, vec![decision.byte()], None)?;
        }
        Ok(decision)
    }
}

/// Every rank sends rank 0 its [`Fingerprint`]; rank 0 compares them with its own and
/// sends each rank the verdict, so that ranks started with different specs, steps or
/// checkpoints all stop at start with the same message.
fn agree<F: Fabric>(
    fabric: &F,
    mine: &Fingerprint,
    devices: &[DeviceId],
    timeout: std::time::Duration,
) -> Result<(), String> {
    judged(fabric, TAG_AGREE, mine.encode(), devices, timeout, |theirs| {
        let mut decoded = Vec::new();
        for (r, b) in theirs {
            match Fingerprint::decode(&b) {
                Ok(f) => decoded.push((r, f)),
                Err(e) => return Some(e),
            }
        }
        agreement::verdict(mine, &decoded)
    })
}

/// One round of a judgement at start: every rank sends rank 0 `mine` (on `tag`); rank 0
/// judges the others' with `verdict` (its own it holds) and sends each rank the verdict
/// (empty: none), so that every rank goes on, or stops with the same message.
fn judged<F: Fabric>(
    fabric: &F,
    tag: i32,
    mine: Vec<u8>,
    devices: &[DeviceId],
    timeout: std::time::Duration,
    verdict: impl FnOnce(Vec<(i32, Vec<u8>)>) -> Option<String>,
) -> Result<(), String> {
    let never = AtomicBool::new(false);
    let (rank, size) = (fabric.rank(), fabric.size());
    if rank != 0 {
        fabric.post(0, tag, mine, None).map_err(|e| e.to_string())?;
        let (verdict, _) = fabric.receive(0, tag, false, &never, timeout, devices[0]).map_err(|e| e.to_string())?;
        return if verdict.is_empty() { Ok(()) } else { Err(String::from_utf8_lossy(&verdict).into_owned()) };
    }
    let mut theirs = Vec::new();
    for r in 1..size {
        let (b, _) = fabric.receive(r, tag, false, &never, timeout, devices[r as usize]).map_err(|e| e.to_string())?;
        theirs.push((r, b));
    }
    let verdict = verdict(theirs);
    let text = verdict.clone().unwrap_or_default().into_bytes();
    for r in 1..size {
        fabric.post(r, tag, text.clone(), None).map_err(|e| e.to_string())?;
    }
    match verdict {
        None => Ok(()),
        Some(why) => {
            // the verdicts leave before this rank's failure ends the job
            fabric.flush();
            Err(why)
        }
    }
}

/// `--nccl-check`: one NCCL communicator over every rank, started on each rank's GPU and
/// checked with an all-reduce (`comm::nccl`); rank 0 says what it measured.
fn check_nccl<F: Fabric>(fabric: &F, gpu: Option<usize>, timeout: std::time::Duration) -> Result<(), String> {
    #[cfg(all(feature = "cuda", feature = "nccl"))]
    {
        let ordinal = gpu.ok_or("`--nccl-check` needs `--backend cuda`")?;
        let c = crate::run::nccl_check::check(fabric, ordinal, timeout)?;
        if fabric.rank() == 0 {
            eprintln!(
                "{}: a communicator of {} rank(s) started; all-reduce of {} MiB on each GPU: {:.3} ms, algorithm bandwidth {:.1} GB/s, bus bandwidth {:.1} GB/s (rank 0; the plan's collectives still travel through host memory)",
                c.library,
                c.ranks,
                c.bytes >> 20,
                c.seconds * 1e3,
                c.alg_gb_s,
                c.bus_gb_s
            );
        }
        Ok(())
    }
    #[cfg(not(all(feature = "cuda", feature = "nccl")))]
    {
        let _ = (fabric, gpu, timeout);
        Err("this pipec was built without NCCL: `--nccl-check` needs `cargo build --release --features cuda,nccl` (with `mpi` for `--transport mpi`)".into())
    }
}

/// A CUDA rank's GPU: the one of its local rank among those it sees (`gpus::for_local_rank`),
/// what the driver says of it sent to rank 0, which refuses (for every rank alike) a rank
/// without one, two ranks on one GPU unless GPUs are shared, and a GPU with less memory
/// than the plan's peaks on it (`gpus::verdict`). Returns its index among the visible GPUs.
fn claim_gpu<F: Fabric>(fabric: &F, plan: &Plan, options: &RunOptions, devices: &[DeviceId]) -> Result<usize, String> {
    use crate::run::gpus::{self, Claim};
    let visible = gpus::visible_from_env();
    let found = job::gpu_count().and_then(|n| {
        let local = gpus::local_rank_from_env().unwrap_or(0);
        job::gpu_facts(gpus::for_local_rank(local, n, visible.as_deref(), options.share_gpus)?)
    });
    let mine = Claim { found, visible };
    let rank = fabric.rank();
    let peak = |r: i32| gpus::plan_peak(plan, devices[r as usize]);
    let who = |d: DeviceId| match devices.iter().position(|x| *x == d) {
        Some(r) => format!("rank {r} ({d})"),
        None => d.to_string(),
    };
    judged(fabric, TAG_GPUS, mine.encode(), devices, options.timeout, |theirs| {
        let mut claims = vec![(devices[0], peak(0), mine.clone())];
        for (r, b) in theirs {
            match Claim::decode(&b) {
                Ok(c) => claims.push((devices[r as usize], peak(r), c)),
                Err(e) => return Some(format!("rank {r}: {e}")),
            }
        }
        gpus::verdict(&claims, options.share_gpus, &who)
    })?;
    if let Some(w) = gpus::free_memory_warning(devices[rank as usize], peak(rank), &mine) {
        eprintln!("warning: rank {rank}: {w}");
    }
    mine.found.map(|g| g.ordinal)
}

/// A rank's traces, and what it measured of its device's memory, as numbers for rank 0:
/// the counts of the last step's trace, the communication timeline, the step timeline and
/// the device facts, then each (device facts: device, whether the model state was
/// measured, weights, gradients, optimizer, whether resident memory was, baseline, peak,
/// whether a device pool was measured, its peak).
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
            f64::from(u8::from(h.and_then(|h| h.pool_peak).is_some())),
            h.and_then(|h| h.pool_peak).map_or(0.0, |p| p as f64),
        ]);
    }
    flat
}

/// The numbers of one device's facts in [`flat_traces`].
const FACTS: usize = 10;

/// Rank 0 adds another rank's traces and device facts ([`flat_traces`]) to the run's
/// (timelines up to `TIMELINE_LIMIT`).
fn merge_traces(merged: &mut RunReport, v: &[f64]) {
    let count = |i: usize| v.get(i).map_or(0, |n| *n as usize);
    let body = &v[v.len().min(4)..];
    let n = count(0).min(body.len() / 4);
    let c = count(1).min((body.len() - 4 * n) / 5);
    let t = count(2).min((body.len() - 4 * n - 5 * c) / 5);
    let f = count(3).min((body.len() - 4 * n - 5 * c - 5 * t) / FACTS);
    let entry = |t: &[f64]| (DeviceId(t[0] as u32), t[1] as usize, t[2] as usize, t[3], t[4]);
    let (trace, rest) = body.split_at(4 * n);
    let (comm, rest) = rest.split_at(5 * c);
    let (timeline, rest) = rest.split_at(5 * t);
    for t in trace.chunks_exact(4) {
        merged.trace.push((DeviceId(t[0] as u32), t[1] as usize, t[2], t[3]));
    }
    for t in comm.chunks_exact(5) {
        if merged.comm_timeline.len() < TIMELINE_LIMIT {
            merged.comm_timeline.push(entry(t));
        }
    }
    for t in timeline.chunks_exact(5) {
        if merged.timeline.len() < TIMELINE_LIMIT {
            merged.timeline.push(entry(t));
        }
    }
    for x in rest[..FACTS * f].chunks_exact(FACTS) {
        let d = DeviceId(x[0] as u32);
        if x[1] != 0.0 {
            let pool_peak = (x[8] != 0.0).then_some(x[9] as u64);
            let held = HeldState { weights: x[2] as u64, gradients: x[3] as u64, optimizer: x[4] as u64, pool_peak };
            merged.held.insert(d, held);
        }
        if x[5] != 0.0 {
            merged.resident.insert(d, crate::backend::resident::Resident { baseline: x[6] as u64, peak: x[7] as u64 });
        }
    }
}

/// This rank's device on the GPU it claimed (`claim_gpu`). Activations and gradients are
/// staged through host memory (`transport::Message` holds host `f32`s), so any fabric works
/// (an MPI need not be CUDA-aware).
fn run_cuda<F: Fabric + 'static>(
    plan: &Plan,
    options: &RunOptions,
    (device, gpu): (DeviceId, usize),
    endpoint: ProcessEndpoint<F>,
    abort: Arc<AtomicBool>,
    on_step: &mut dyn FnMut(&StepMetrics),
    sink: &mut CheckpointSink<'_>,
) -> Result<RunReport, RunError> {
    job::cuda_available().map_err(RunError::setup)?;
    #[cfg(feature = "cuda")]
    {
        type B = burn::backend::Autodiff<burn::backend::Cuda>;
        let placement =
            [(device, (burn::backend::cuda::CudaDevice::new(gpu), format!("GPU {gpu}")))].into_iter().collect();
        run_workers::<B, _>(plan, options, &placement, vec![endpoint], abort, on_step, sink)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (plan, options, device, gpu, endpoint, abort, on_step, sink);
        Err(RunError::setup("CUDA support is not built in"))
    }
}

/// Adds a rank's expert token counts, sent as (layer, experts, counts...) runs, to `into`.
fn merge_expert_tokens(into: &mut ExpertTokens, mut runs: &[f64]) {
    while let [layer, n, rest @ ..] = runs {
        let n = (*n as usize).min(rest.len());
        let took: Vec<u64> = rest[..n].iter().map(|&t| t as u64).collect();
        add_expert_tokens(into, *layer as usize, &took);
        runs = &rest[n..];
    }
}
