//! The step loop of a run: one worker thread per device of this process, each running its
//! stream step after step (saving its stages when a checkpoint follows), and the calling
//! thread as the coordinator, which gathers each step's reports into metrics and the trace,
//! writes checkpoints, and on the first failure raises the abort flag every blocked
//! transfer polls.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::Instant;

use pipec_plan::{checkpoint, DeviceId, Plan};

use crate::backend::kernels::ExecBackend;
use crate::comm::transport::Endpoint;
use crate::error::ExecError;
use crate::interp::build::build_stages;
use crate::interp::checkpointing::{load_checkpoint, save_checkpoint};
use crate::interp::data::Dataset;
use crate::interp::worker::{add_expert_tokens, ExpertTokens};
use crate::interp::worker::{StepReport, Worker};
use crate::run::job::{is_language_model, Placement, RunError, RunOptions, RunReport, StepMetrics, ValidationMetrics};
use crate::run::stop::{Begin, StopGate};

/// The most timeline entries a run keeps (about 40 bytes each): a long run's trace keeps
/// its first steps in full.
pub const TIMELINE_LIMIT: usize = 2_000_000;

/// Where a step's checkpoint goes: given the completed steps and the stages this process
/// saved, it writes (or forwards) them and says where they landed.
/// Writes a checkpoint after `steps` completed steps from the stages' shards and fp16's loss
/// scale after the last of them (the same on every device), if the run scales its loss.
pub type CheckpointSink<'a> = dyn FnMut(usize, checkpoint::Shards, Option<pipec_plan::recipe::LossScale>) -> Result<Option<PathBuf>, ExecError>
    + 'a;

/// How many checkpoints the coordinator has written (or failed to write) in this run: a
/// worker about to hand over the copy of its n-th waits until n − 1 are (so at most one
/// copy of the state is in memory beside the model), and with `async: false` it waits after
/// handing it over until n are.
#[derive(Default)]
struct Written {
    count: std::sync::Mutex<usize>,
    done: std::sync::Condvar,
}

impl Written {
    fn finished(&self) {
        *self.count.lock().unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
        self.done.notify_all();
    }

    /// Waits until `n` checkpoints are written or the run is aborted: the seconds waited.
    fn wait_for(&self, n: usize, abort: &AtomicBool) -> f64 {
        let started = Instant::now();
        let mut count = self.count.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if *count >= n {
            return 0.0;
        }
        while *count < n && !abort.load(Ordering::Relaxed) {
            count = self
                .done
                .wait_timeout(count, std::time::Duration::from_millis(50))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        started.elapsed().as_secs_f64()
    }
}

/// What a worker thread tells the coordinator.
enum Event {
    Step(Box<StepReport>, Option<checkpoint::Shards>),
    /// A worker's shards of the last step before a stop (SIGINT/SIGTERM).
    Stopped(usize, DeviceId, checkpoint::Shards),
    Failed(RunError),
}

/// What every worker of a run shares.
struct Shared<'r> {
    plan: &'r Plan,
    data: &'r Dataset,
    loaded: Option<&'r checkpoint::Loaded>,
    gate: &'r StopGate,
    abort: &'r AtomicBool,
    /// Every worker's step times are measured from here.
    epoch: Instant,
    /// The steps this run trains (from a resumed checkpoint's on).
    steps: Range<usize>,
    /// Steps between checkpoints, when checkpoints are written.
    every: Option<usize>,
    /// A stop (SIGINT/SIGTERM) ends with a checkpoint of the last step it lets run: there is
    /// a checkpoint directory, whether or not the plan writes periodic ones.
    checkpoint_on_stop: bool,
    /// The checkpoints written so far, and whether a step waits for its own (`sync`) or
    /// only for the previous one.
    written: &'r Written,
    sync: bool,
    /// This process runs one device: its resident memory is the device's.
    alone: bool,
}

/// Refuses, before any worker starts, a placement whose backend cannot compute in a dtype
/// the plan rounds to: its products' (`amp::compute_dtype`) and its gradients'
/// (`grad_precision`) — bf16 on a GPU before Ampere, or on a driver without it — naming the
/// device and the dtype, where the first kernel would otherwise fail inside a worker.
fn backend_dtypes<B: ExecBackend>(plan: &Plan, placement: &Placement<B>) -> Result<(), RunError> {
    use burn::tensor::{backend::Backend, DType, FloatDType};
    let grads = match plan.training.grad_precision {
        pipec_plan::Precision::Fp32 => None,
        pipec_plan::Precision::Bf16 => Some(FloatDType::BF16),
        pipec_plan::Precision::Fp16 => Some(FloatDType::F16),
    };
    let needed =
        [(crate::backend::amp::compute_dtype(plan), "its products"), (grads, "its gradients (`grad_precision`)")];
    for (device, (on, name)) in placement {
        for (dtype, what) in needed.iter().filter_map(|(d, what)| d.map(|d| (d, what))) {
            if !<B as Backend>::supports_dtype(on, DType::from(dtype)) {
                return Err(RunError::setup(format!(
                    "{device} runs on {name}, which cannot compute in {dtype:?}, the dtype the plan rounds {what} to: compile it with `precision: fp32` (and `grad_precision: fp32`), or run it on a device with {dtype:?} arithmetic"
                )));
            }
        }
    }
    Ok(())
}

/// Runs the workers of `devices` on this process with the given endpoints; used by the
/// in-process transport (all devices) and by MPI (one device per process).
pub fn run_workers<B: ExecBackend, E: Endpoint + 'static>(
    plan: &Plan,
    options: &RunOptions,
    placement: &Placement<B>,
    endpoints: Vec<E>,
    abort: Arc<AtomicBool>,
    on_step: &mut dyn FnMut(&StepMetrics),
    sink: &mut CheckpointSink<'_>,
) -> Result<RunReport, RunError> {
    backend_dtypes::<B>(plan, placement)?;
    let data = Dataset::for_plan(plan).map_err(ExecError::Data)?;
    let loaded = options.resume.as_ref().map(|r| r.load(plan)).transpose().map_err(ExecError::Checkpoint)?;
    if let Some(l) = &loaded {
        l.check_fits(plan).map_err(ExecError::Checkpoint)?;
    }
    if let Some(dir) = &options.checkpoint_dir {
        checkpoint::clean_abandoned(dir);
    }
    let first_step = loaded.as_ref().map(|l| l.completed_steps).unwrap_or(0);
    let total_steps = options.steps.unwrap_or(plan.training.steps);
    if total_steps == 0 {
        return Err(RunError::setup("the run has 0 steps: nothing to train"));
    }
    if first_step >= total_steps {
        return Err(ExecError::Checkpoint(format!(
            "the checkpoint has completed {first_step} step(s) and this run is {total_steps} step(s) long: nothing is left to train (raise `--steps` or `training.steps`)"
        ))
        .into());
    }
    let gate = StopGate::new(options.stop.clone(), plan.flush_free.is_some(), options.vote.clone());
    let written = Written::default();
    let shared = Shared {
        plan,
        data: &data,
        loaded: loaded.as_deref(),
        gate: &gate,
        abort: &abort,
        epoch: Instant::now(),
        steps: first_step..total_steps,
        every: plan.training.checkpoint_every.filter(|_| options.checkpoint_dir.is_some()),
        checkpoint_on_stop: options.checkpoint_dir.is_some(),
        written: &written,
        sync: plan.training.checkpoint_sync,
        alone: endpoints.len() == 1,
    };
    let mut coordinator = Coordinator {
        plan,
        workers: endpoints.len(),
        pending: BTreeMap::new(),
        carry: BTreeMap::new(),
        aux_carry: BTreeMap::new(),
        first_error: None,
        samples: data.size(),
        checkpoints: shared.every.is_some(),
        stop_shards: Vec::new(),
        next_loss_scale: None,
        last_end: None,
        report: RunReport {
            placement: placement.iter().map(|(d, (_, name))| (*d, name.clone())).collect(),
            ..RunReport::default()
        },
    };
    let (tx, rx) = channel::<Event>();
    std::thread::scope(|scope| {
        let workers = endpoints.len();
        for (index, ep) in endpoints.into_iter().enumerate() {
            let (tx, shared) = (tx.clone(), &shared);
            let dev = placement.get(&ep.device()).map(|p| p.0.clone());
            scope.spawn(move || {
                // in-process workers each on a core of their own (`affinity`; one process
                // per device holds one worker, which it leaves where its launcher put it)
                super::affinity::pin(index, workers);
                work::<B, E>(shared, ep, dev, &tx)
            });
        }
        drop(tx);
        for ev in rx {
            match ev {
                Event::Failed(e) => coordinator.failed(e, &abort),
                Event::Step(r, ck) => {
                    if coordinator.step_done(*r, ck, on_step, sink, &abort) {
                        written.finished();
                    }
                }
                Event::Stopped(step, device, shards) => coordinator.stopped(step, device, shards, sink, &abort),
            }
        }
    });
    if let Some(e) = coordinator.first_error {
        return Err(e);
    }
    let mut report = coordinator.report;
    report.interrupted = gate.stopped() && report.steps.last().is_none_or(|s| s.step + 1 < total_steps);
    Ok(report)
}

/// One device's worker thread: builds its stages (from the checkpoint, when resuming),
/// starts its communication threads and runs its steps; a failure (or a panic) raises the
/// abort flag and goes to the coordinator.
fn work<B: ExecBackend, E: Endpoint + 'static>(shared: &Shared<'_>, ep: E, dev: Option<B::Device>, tx: &Sender<Event>) {
    let (plan, device) = (shared.plan, ep.device());
    let fail = |step: Option<usize>, index: Option<usize>, error: ExecError| {
        let ins = index.and_then(|i| plan.instruction(device, i));
        RunError {
            device: Some(device),
            stage: ins.map(pipec_plan::Instr::stage),
            step,
            instruction: ins.map(ToString::to_string),
            error,
        }
    };
    // the worker computes on this thread; its communication threads run beside it in this
    // scope and end with it (on a failure, the abort flag stops any transfer they are
    // blocked in)
    let outcome = std::thread::scope(|comm_scope| {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| -> Result<(), RunError> {
            let dev = dev.ok_or_else(|| {
                fail(None, None, ExecError::Setup(format!("no compute device was assigned to {device}")))
            })?;
            // the plan's precision for every product this thread computes (crate::backend::amp)
            let _precision = crate::backend::amp::Autocast::enter(crate::backend::amp::compute_dtype(plan));
            // the process's memory before the device's stages exist
            let baseline = if shared.alone { crate::backend::resident::start() } else { None };
            let mut stages = build_stages::<B>(plan, device, &dev).map_err(|e| fail(None, None, e))?;
            if let Some(l) = shared.loaded {
                load_checkpoint(plan, &mut stages, l, &dev).map_err(|e| fail(None, None, e))?;
            }
            let comm = crate::comm::exchanger::Comm::start(comm_scope, ep, shared.epoch);
            let stream = &plan.streams[&device];
            let mut w = Worker::new(device, plan, stream, shared.data, comm, dev, stages, plan.schedule.reduce);
            // fp16: the loss scale a resumed run left off at, or GradScaler's first
            w.progress.loss_scale = crate::backend::amp::scales_loss(plan).then(|| {
                shared.loaded.and_then(|l| l.loss_scale).unwrap_or_else(pipec_plan::recipe::LossScale::initial)
            });
            w.progress.epoch = shared.epoch;
            run_steps(shared, &mut w, tx, &fail, baseline)
        }));
        if !matches!(outcome, Ok(Ok(()))) {
            shared.abort.store(true, Ordering::Relaxed);
        }
        outcome
    });
    let err = match outcome {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panicked".into());
            Some(fail(None, None, ExecError::Panic(msg)))
        }
    };
    if let Some(e) = err {
        shared.abort.store(true, Ordering::Relaxed);
        let _ = tx.send(Event::Failed(e));
    }
}

/// A worker's steps, each reported to the coordinator (with the stages' checkpoint shards
/// when one follows), until the last step, a stop, or another worker's failure.
fn run_steps<B: ExecBackend>(
    shared: &Shared<'_>,
    w: &mut Worker<'_, B>,
    tx: &Sender<Event>,
    fail: &dyn Fn(Option<usize>, Option<usize>, ExecError) -> RunError,
    baseline: Option<u64>,
) -> Result<(), RunError> {
    // a flush-free pipeline starts empty, and is drained by the last step and by every step
    // a checkpoint follows (a checkpoint holds nothing in flight)
    let mut filled = false;
    // the checkpoints this worker has handed over, and its wait for writes not yet reported
    let mut handed = 0;
    let mut waited = 0.0;
    for step in shared.steps.clone() {
        let begin = shared.gate.begin(step, step + 1 == shared.steps.end).map_err(|e| fail(Some(step), None, e))?;
        if shared.abort.load(Ordering::Relaxed) {
            return Ok(());
        }
        if begin == Begin::Stop {
            // every worker stops at this same step, each having completed the one before (a
            // flush-free pipeline drained by it): their states make a checkpoint of it, unless
            // a planned one holds it already or this run completed no step
            let held = shared.every.is_some_and(|k| step.is_multiple_of(k));
            if shared.checkpoint_on_stop && step > shared.steps.start && !held {
                shared.written.wait_for(handed, shared.abort);
                let shards = save_checkpoint(w).map_err(|e| fail(Some(step - 1), None, e))?;
                let _ = tx.send(Event::Stopped(step - 1, w.device, shards));
            }
            return Ok(());
        }
        let planned = step + 1 == shared.steps.end || shared.every.is_some_and(|k| (step + 1) % k == 0);
        // validation after every `every` steps and the last, on a drained pipeline
        let evaluate = shared.plan.eval.is_some()
            && shared.plan.training.recipe.validation.is_some_and(|v| {
                (step + 1).is_multiple_of(v.every) || step + 1 == shared.steps.end || begin == Begin::RunLast
            });
        let drain = planned || begin == Begin::RunLast || evaluate;
        let segments = w.segments(filled, drain);
        let mut r = w.step(step, &segments, drain).map_err(|(i, e)| fail(Some(step), Some(i), e))?;
        if evaluate {
            let mut sum = [0.0f64; 4];
            for batch in 0..shared.data.held_out_batches(shared.plan.training.batch_size) {
                let v = w.evaluate(step, batch).map_err(|(i, e)| fail(Some(step), Some(i), e))?;
                sum.iter_mut().zip(v).for_each(|(a, b)| *a += b);
            }
            r.validation = Some(sum);
        }
        if step + 1 == shared.steps.end {
            // the peak before counting the model state (which serialises the optimizer's)
            r.resident = baseline
                .zip(crate::backend::resident::peak())
                .map(|(baseline, peak)| crate::backend::resident::Resident { baseline, peak });
            r.held = Some(w.held_state().map_err(|e| fail(Some(step), None, e))?);
        }
        filled = !drain;
        // a checkpoint follows the steps that drain as planned, when checkpoints are on
        let ckpt = if shared.every.is_some() && planned {
            waited += shared.written.wait_for(handed, shared.abort);
            handed += 1;
            let copying = Instant::now();
            let shards = save_checkpoint(w).map_err(|e| fail(Some(step), None, e))?;
            r.checkpoint_copy_s = copying.elapsed().as_secs_f64();
            Some(shards)
        } else {
            None
        };
        let wait = ckpt.is_some() && shared.sync;
        r.checkpoint_wait_s = std::mem::take(&mut waited);
        if tx.send(Event::Step(Box::new(r), ckpt)).is_err() {
            return Ok(());
        }
        if wait {
            waited += shared.written.wait_for(handed, shared.abort);
        }
    }
    Ok(())
}

/// The coordinator's state: each step's reports until every worker has sent its own, then
/// the step's metrics, trace and checkpoint.
struct Coordinator<'r> {
    plan: &'r Plan,
    workers: usize,
    pending: BTreeMap<usize, Vec<(StepReport, Option<checkpoint::Shards>)>>,
    /// Losses computed ahead of their step (a flush-free step computes the next step's
    /// first losses), by step.
    carry: BTreeMap<usize, Vec<f32>>,
    /// The same for the mixtures of experts' load-balancing losses.
    aux_carry: BTreeMap<usize, Vec<f32>>,
    first_error: Option<RunError>,
    report: RunReport,
    /// The data set's distinct samples (None: endless), for the epoch count.
    samples: Option<usize>,
    /// Checkpoints are written in this run.
    checkpoints: bool,
    /// The workers' shards of the last step before a stop, as they come in.
    stop_shards: Vec<(DeviceId, checkpoint::Shards)>,
    /// The loss scale the last reported step left for the next (a stop's checkpoint holds it).
    next_loss_scale: Option<pipec_plan::recipe::LossScale>,
    /// The last reported step and when its last worker finished it (the run's clock).
    last_end: Option<(usize, f64)>,
}

impl Coordinator<'_> {
    /// A worker failed: stop everyone, and keep the root cause (a worker that was merely
    /// stopped reports less).
    fn failed(&mut self, e: RunError, abort: &AtomicBool) {
        abort.store(true, Ordering::Relaxed);
        if self.first_error.is_none()
            || (!e.error.is_secondary() && self.first_error.as_ref().is_some_and(|f| f.error.is_secondary()))
        {
            self.first_error = Some(e);
        }
    }

    /// A worker finished a step; once every worker has, the step is reported.
    fn step_done(
        &mut self,
        r: StepReport,
        ck: Option<checkpoint::Shards>,
        on_step: &mut dyn FnMut(&StepMetrics),
        sink: &mut CheckpointSink<'_>,
        abort: &AtomicBool,
    ) -> bool {
        let step = r.step;
        let entry = self.pending.entry(step).or_default();
        entry.push((r, ck));
        if entry.len() < self.workers {
            return false;
        }
        let reports = self.pending.remove(&step).unwrap_or_default();
        let mut m = self.metrics(step, &reports);
        self.merge_traces(&reports);
        let checkpointed = reports.iter().any(|(_, c)| c.is_some());
        self.next_loss_scale = reports.iter().find_map(|(r, _)| r.next_loss_scale);
        if checkpointed {
            // written before the step is reported, so its line says what the write took
            let loss_scale = self.next_loss_scale;
            let writing = Instant::now();
            match sink(step + 1, first_replicas_shards(reports), loss_scale) {
                Ok(Some(p)) => self.report.checkpoints.push(p),
                Ok(None) => {}
                Err(e) => self.failed(RunError { step: Some(step), ..e.into() }, abort),
            }
            m.checkpoint_write_s = Some(writing.elapsed().as_secs_f64());
        }
        on_step(&m);
        self.report.steps.push(m);
        checkpointed
    }

    /// A worker's shards of `step`, the last before a stop; once every worker's are in, the
    /// checkpoint of that step is written.
    fn stopped(
        &mut self,
        step: usize,
        device: DeviceId,
        shards: checkpoint::Shards,
        sink: &mut CheckpointSink<'_>,
        abort: &AtomicBool,
    ) {
        self.stop_shards.push((device, shards));
        if self.stop_shards.len() < self.workers {
            return;
        }
        match sink(step + 1, first_device_shards(std::mem::take(&mut self.stop_shards)), self.next_loss_scale) {
            Ok(Some(p)) => self.report.checkpoints.push(p),
            Ok(None) => {}
            Err(e) => self.failed(RunError { step: Some(step), ..e.into() }, abort),
        }
    }

    /// A step's metrics: its loss (a loss belongs to its microbatch's step), and its time:
    /// from its first worker's start, or the previous step's end if later, to its last
    /// worker's end.
    fn metrics(&mut self, step: usize, reports: &[(StepReport, Option<checkpoint::Shards>)]) -> StepMetrics {
        let plan = self.plan;
        let n = plan.training.microbatches.max(1);
        for (mb, l) in reports.iter().flat_map(|(r, _)| r.losses.iter()) {
            self.carry.entry(*mb as usize / n).or_default().push(*l);
        }
        let losses: Vec<f32> = self.carry.remove(&step).unwrap_or_default();
        self.carry.retain(|s, _| *s > step);
        for (mb, l) in reports.iter().flat_map(|(r, _)| r.aux_losses.iter()) {
            self.aux_carry.entry(*mb as usize / n).or_default().push(*l);
        }
        let aux: Vec<f32> = self.aux_carry.remove(&step).unwrap_or_default();
        self.aux_carry.retain(|s, _| *s > step);
        let mut expert_tokens = ExpertTokens::new();
        for (layer, took) in reports.iter().flat_map(|(r, _)| r.expert_tokens.iter()) {
            add_expert_tokens(&mut expert_tokens, *layer, took);
        }
        let aux_sum: f64 = aux.iter().map(|&a| f64::from(a)).sum();
        let loss_sum = losses.iter().map(|&l| f64::from(l)).sum::<f64>();
        let loss = if losses.is_empty() { f64::NAN } else { loss_sum / losses.len() as f64 };
        // from the step's first start to its last end over the devices (one clock: the
        // run's), not when the reports reached this thread, which can be long after; but
        // from the previous step's end where this one started before it (nothing holds a
        // worker done with a step from starting the next: a pipeline's last stage loads
        // its next labels while the first finishes its update), so that a step is the
        // time the run takes for it, as batch / samples per second says (cnn.yaml's steps
        // overlapped by 12 ms of their 68)
        let start = reports.iter().map(|(r, _)| r.started).fold(f64::INFINITY, f64::min);
        let end = reports.iter().map(|(r, _)| r.started + r.step_seconds).fold(0.0, f64::max);
        let start = match self.last_end {
            Some((last, at)) if last + 1 == step => start.max(at),
            _ => start,
        };
        self.last_end = Some((step, end));
        let step_seconds = (end - start).max(f64::MIN_POSITIVE);
        StepMetrics {
            step,
            loss,
            loss_sum,
            loss_count: losses.len(),
            step_seconds,
            samples_per_s: plan.training.batch_size as f64 / step_seconds.max(1e-12),
            perplexity: is_language_model(plan).then(|| loss.exp()),
            lr: plan.training.lr_at(step),
            grad_norm: reports.iter().find_map(|(r, _)| r.grad_norm),
            loss_scale: reports.iter().find_map(|(r, _)| r.loss_scale),
            skipped: reports.iter().any(|(r, _)| r.skipped),
            validation: reports.iter().any(|(r, _)| r.validation.is_some()).then(|| {
                let mut sum = [0.0f64; 4];
                for v in reports.iter().filter_map(|(r, _)| r.validation) {
                    sum.iter_mut().zip(v).for_each(|(a, b)| *a += b);
                }
                ValidationMetrics::of(sum, is_language_model(plan))
            }),
            epoch: self.samples.map(|n| ((step + 1) * plan.training.batch_size) as f64 / n as f64),
            checkpoint_wait_s: self
                .checkpoints
                .then(|| reports.iter().map(|(r, _)| r.checkpoint_wait_s).fold(0.0, f64::max)),
            checkpoint_copy_s: reports
                .iter()
                .any(|(_, c)| c.is_some())
                .then(|| reports.iter().map(|(r, _)| r.checkpoint_copy_s).fold(0.0, f64::max)),
            checkpoint_write_s: None,
            aux_sum,
            aux_loss: (!aux.is_empty()).then(|| aux_sum / n as f64),
            expert_tokens,
        }
    }

    /// The step's traces into the run's (the last step's in full, every step's timeline up
    /// to `TIMELINE_LIMIT`), and the peaks of microbatches in flight and weight versions.
    fn merge_traces(&mut self, reports: &[(StepReport, Option<checkpoint::Shards>)]) {
        let report = &mut self.report;
        report.trace =
            reports.iter().flat_map(|(r, _)| r.trace.iter().map(move |t| (r.device, t.0, t.1, t.2))).collect();
        for (r, _) in reports {
            let room = TIMELINE_LIMIT.saturating_sub(report.comm_timeline.len());
            report.comm_timeline.extend(r.comm.iter().take(room).map(|t| (r.device, r.step, t.0, t.1, t.2)));
            let room = TIMELINE_LIMIT.saturating_sub(report.timeline.len());
            report
                .timeline
                .extend(r.trace.iter().take(room).map(|t| (r.device, r.step, t.0, r.started + t.1, r.started + t.2)));
            if let Some(held) = r.held {
                report.held.insert(r.device, held);
            }
            if let Some(resident) = r.resident {
                report.resident.insert(r.device, resident);
            }
            if let Some(n) = r.weight_gathers {
                report.weight_gathers.entry(r.device).or_default().push(n);
            }
            if let Some(n) = r.prefetched_gathers {
                report.prefetched_gathers.entry(r.device).or_default().push(n);
            }
            if let Some(n) = r.product_gathers {
                report.product_gathers.entry(r.device).or_default().push(n);
            }
            for (peaks, of) in
                [(&mut report.peak_in_flight, &r.peak_in_flight), (&mut report.peak_versions, &r.peak_versions)]
            {
                let e = peaks.entry(r.device).or_default();
                for (s, n) in of {
                    let p = e.entry(*s).or_insert(0);
                    *p = (*p).max(*n);
                }
            }
        }
    }
}

/// The step's checkpoint: each stage's shard from its first replica (the lowest device):
/// replicas of a synchronous stage hold the same state, and under asynchronous data
/// parallelism the first replica is the parameter server, the only one whose optimizer
/// state is live.
fn first_replicas_shards(reports: Vec<(StepReport, Option<checkpoint::Shards>)>) -> checkpoint::Shards {
    first_device_shards(reports.into_iter().map(|(r, c)| (r.device, c.unwrap_or_default())).collect())
}

/// Each stage's shards from the first device (by id) that holds it: the devices' order,
/// not the order their shards came in, so every replica's copy is read alike.
fn first_device_shards(mut shards: Vec<(DeviceId, checkpoint::Shards)>) -> checkpoint::Shards {
    shards.sort_by_key(|(d, _)| *d);
    let mut stages = HashMap::new();
    for (s, st) in shards.into_iter().flat_map(|(_, c)| c) {
        stages.entry(s).or_insert(st);
    }
    stages
}
