//! `pipec run`: compile (or load a plan.json) and train.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pipec_compiler::render::{human_time, trace_event};
use pipec_executor::process_run::RankHooks;
use pipec_executor::{BackendKind, Resume, RunOptions, StepMetrics};
use pipec_plan::{Phase, Plan};

use crate::compile_cmd::{compile_file, compile_file_with};
use crate::output::write_atomic;
use crate::run_speed::RunSpeed;
use crate::{Format, EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// The backends `--backend` accepts.
#[derive(Clone, Copy, Debug, clap::ValueEnum, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
}

/// How the workers talk.
#[derive(Clone, Copy, Debug, clap::ValueEnum, PartialEq, Eq)]
pub enum Transport {
    /// One thread per device in this process.
    Threads,
    /// One process per device, started by mpirun (cargo feature `mpi`).
    Mpi,
    /// One process per device, each started with torchrun's variables (`RANK`,
    /// `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), over pipec's own TCP connections.
    Tcp,
}

/// `pipec run`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// A spec (.yaml) or a compiled plan (plan.json).
    pub file: PathBuf,
    /// Output directory (default: out/<job name>).
    #[arg(short, long)]
    pub out: Option<PathBuf>,
    /// Steps to run (default: the spec's).
    #[arg(long)]
    pub steps: Option<usize>,
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    pub backend: Backend,
    /// Resume from a checkpoint (a run directory, a checkpoints directory or a step-N directory).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Start from a Hugging Face checkpoint's weights (a folder with `model.safetensors`
    /// or a sharded `model.safetensors.index.json`; GPT-2, Llama-family, Mixtral and BERT names,
    /// or a torchvision ResNet's), on any layout, with a fresh optimizer.
    #[arg(long, conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// With `--init`: load the tensors the model uses and skip (listing them) those it
    /// does not, instead of refusing a checkpoint that holds more than the model.
    #[arg(long, requires = "init")]
    pub init_partial: bool,
    /// Seconds a worker may wait for a message before the run is declared stuck.
    #[arg(long = "timeout", value_name = "TIMEOUT", default_value_t = 120)]
    pub timeout_s: u64,
    /// Seconds a SIGINT/SIGTERM gives the step in progress to end and the final
    /// checkpoint to be written; past them the run exits without it (Kubernetes' and
    /// Slurm's grace before SIGKILL are 30 s by default).
    #[arg(long = "stop-grace", value_name = "STOP_GRACE", default_value_t = 25)]
    pub stop_grace_s: u64,
    /// Threads in this process, one MPI process per device (under mpirun or srun), or one
    /// process per device over TCP (each started with torchrun's RANK, WORLD_SIZE,
    /// MASTER_ADDR, MASTER_PORT).
    #[arg(long, value_enum, default_value_t = Transport::Threads)]
    pub transport: Transport,
    /// Run a plan.json without verifying its streams first (its structure is still
    /// checked): for debugging the executor with a deliberately broken plan, which
    /// then fails at run time, within `--timeout`.
    #[arg(long = "no-verify", action = clap::ArgAction::SetFalse)]
    pub verify: bool,
    /// With `--backend cuda`: let several devices share a GPU when there are fewer GPUs
    /// than devices (each device otherwise gets its own GPU, and too few is an error).
    #[arg(long)]
    pub share_gpus: bool,
    /// With `--backend cuda` and one process per GPU (`--transport mpi` or `tcp`): start
    /// an NCCL communicator over every rank before training and check an all-reduce on
    /// each GPU (a build with `--features cuda,nccl`); any rank's failure or silence stops
    /// every rank within `--timeout`. The plan's collectives still travel through host memory.
    #[arg(long)]
    pub nccl_check: bool,
    /// With one process per device: a folder where a failing rank also writes its
    /// failure line (one file per rank). `pipec launch --exec` sets it for each attempt
    /// and watches it, since mpirun may not forward a rank's output while it waits on a
    /// host it cannot reach.
    #[arg(long)]
    pub record_failures: Option<PathBuf>,
    /// Colour in diagnostics (standard error is a terminal).
    #[arg(skip = std::io::IsTerminal::is_terminal(&std::io::stderr()))]
    pub color: bool,
}

/// Loads a plan: compiles a spec, or reads a plan.json.
pub fn load_plan(file: &Path, color: bool) -> Result<Plan, u8> {
    load_plan_checked(file, color, true)
}

/// [`load_plan`], optionally without verifying a plan.json's streams (`--no-verify`).
pub fn load_plan_checked(file: &Path, color: bool, verify: bool) -> Result<Plan, u8> {
    if file.extension().is_some_and(|e| e == "json") {
        let text = crate::check_cmd::read_text(file, crate::check_cmd::MAX_PLAN_BYTES, true).map_err(|e| {
            eprintln!("error: {e}");
            EXIT_USAGE
        })?;
        let plan = Plan::from_json(&text).map_err(|e| {
            eprintln!("error: `{}`: {e}", file.display());
            EXIT_DIAGNOSTICS
        })?;
        // a plan from a file may have been edited: verify it as a compile would
        let problems = if verify { pipec_compiler::verification::verify_plan(&plan) } else { plan.check() };
        if !problems.is_empty() {
            eprintln!("error: `{}` does not pass verification ({} problem(s)):", file.display(), problems.len());
            for p in problems.iter().take(8) {
                eprintln!("  - {p}");
            }
            return Err(EXIT_DIAGNOSTICS);
        }
        return Ok(plan);
    }
    compile_file(file, Format::Human, color, None).map(|(c, _)| c.plan)
}

/// A note when the plan is priced for a device of another kind than the backend's (an H100
/// plan trained on the CPU): its predicted times are that device's, not this run's. `device`
/// is the spec's device's name (a plan.json's from its MFU basis, where it has one).
fn device_note(plan: &Plan, device: Option<&str>, backend: BackendKind) -> Option<String> {
    let name = device.map(str::to_string).or_else(|| plan.simulation.mfu.as_ref().map(|m| m.peak.device.clone()))?;
    match (backend, pipec_plan::device::names_a_cpu(&name)) {
        (BackendKind::Cpu, false) => Some(format!(
            "note: the plan is priced for {name}, and this run is on the CPU: the predicted times below are that device's, not this machine's (a spec with `device: {{ kind: cpu, ... }}` is planned for this machine's CPU)"
        )),
        (BackendKind::Cuda, true) => Some(format!(
            "note: the plan is priced for a CPU ({name}), and this run is on a GPU: the predicted times below are the CPU's (a GPU preset or a `pipec calibrate --backend cuda` file prices the GPU)"
        )),
        (BackendKind::Cpu, true) | (BackendKind::Cuda, false) => None,
    }
}

/// The plan `pipec run` trains, and the name of the device it is priced for (None for a
/// plan.json): [`load_plan_checked`]'s, but a spec whose CPU device is written inline,
/// trained by threads on the CPU, is planned for this machine's CPU ([`crate::this_cpu`];
/// the spec's figures when the measurement fails or is switched off).
fn load_run_plan(args: &RunArgs) -> Result<(Plan, Option<String>), u8> {
    if args.file.extension().is_some_and(|e| e == "json") {
        return load_plan_checked(&args.file, args.color, args.verify).map(|p| (p, None));
    }
    let on_this_cpu = in_process_cpu(args) && !crate::this_cpu::switched_off();
    let mut device = None;
    let mut adjust = |spec: &mut pipec_grammar::spec::Spec| {
        // a plan the executor refuses is refused before this machine is measured (minutes,
        // where the cache does not hold it), with the spec's own figures
        let measure = on_this_cpu
            && crate::this_cpu::written_inline(&spec.cluster.device)
            && (crate::this_cpu::in_cache(spec.cluster.device_count()) || executor_would_run(spec));
        let cluster = &mut spec.cluster;
        if measure {
            match crate::this_cpu::this_cpu(cluster.device_count(), cluster.memory) {
                Ok(found) => {
                    eprintln!("{}", found.note());
                    if let Some(l) = found.device.link {
                        // the workers' in-process transport, on every level of this one machine
                        let link = pipec_grammar::ast::Link {
                            bandwidth: l.bandwidth,
                            latency: l.latency,
                            efficiency: l.efficiency,
                        };
                        cluster.intra_node = link;
                        if let Some(inter) = cluster.inter_node.as_mut() {
                            *inter = link;
                        }
                    }
                    // the executor's own work per layer pass, unless the spec says
                    if cluster.overhead == 0.0 {
                        (cluster.overhead, cluster.overhead_backward) = (found.overhead(), found.overhead_backward());
                    }
                    cluster.device = found.device;
                }
                Err(e) => {
                    eprintln!(
                        "warning: this machine's CPU could not be measured ({e}): planned with the spec's figures"
                    )
                }
            }
        }
        device = Some(cluster.device.name.clone());
    };
    let plan = compile_file_with(&args.file, Format::Human, args.color, None, &mut adjust).map(|(c, _)| c.plan)?;
    Ok((plan, device))
}

pub fn run(args: RunArgs) -> u8 {
    if args.steps == Some(0) {
        eprintln!("error: `--steps 0` trains nothing: give at least 1");
        return EXIT_USAGE;
    }
    if args.nccl_check && (args.backend != Backend::Cuda || args.transport == Transport::Threads) {
        eprintln!("error: `--nccl-check` starts NCCL between processes, one per GPU: it needs `--backend cuda` with `--transport mpi` or `--transport tcp`");
        return EXIT_USAGE;
    }
    let (mut plan, device) = match load_run_plan(&args) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let backend = backend_kind(args.backend);
    // in one process on CUDA, the GPUs are placed and judged once, here, and the run uses
    // that placement
    let mut gpus = None;
    if backend == BackendKind::Cuda && args.transport == Transport::Threads {
        let options = RunOptions { share_gpus: args.share_gpus, ..RunOptions::default() };
        match pipec_executor::gpu_placement(&plan, &options) {
            Ok((map, warnings)) => {
                let shown: Vec<String> = map.iter().map(|(d, g)| format!("{d} → GPU {g}")).collect();
                eprintln!("devices: {}", shown.join(", "));
                for w in warnings {
                    eprintln!("warning: {w}");
                }
                gpus = Some(map);
            }
            Err(e) => {
                eprintln!("error: {e}");
                return EXIT_USAGE;
            }
        }
    } else if backend == BackendKind::Cuda {
        if let Err(e) = pipec_executor::cuda_available() {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    }
    if let Err(e) =
        executor_runs_its_features(&plan).and_then(|()| pipec_executor::validate(&plan).map_err(|e| e.to_string()))
    {
        eprintln!("error: cannot run this plan: {e}");
        return EXIT_DIAGNOSTICS;
    }
    for c in pipec_executor::caveats(&plan) {
        eprintln!("warning: {c}");
    }
    if let Some(note) = device_note(&plan, device.as_deref(), backend) {
        eprintln!("{note}");
    }
    let dir = args.out.clone().unwrap_or_else(|| PathBuf::from("out").join(&plan.name));
    // the checkpoint to resume from, read and verified before anything is written
    let (resume, first_step) = match resolve_resume(&args, &plan) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    // the run's plan.json remembers the --init folder, for `pipec export` to carry its
    // tokenizer and config fields over
    if let Some(init) = &args.init {
        plan.training.init_from =
            Some(std::path::absolute(init).unwrap_or_else(|_| init.clone()).display().to_string());
    }
    // the output folder is made when the first step is done: refuse now one that cannot be
    // (it, or the nearest part of its path that exists, is a file)
    if let Some(blocking) = dir.ancestors().find(|a| a.exists()).filter(|a| !a.is_dir()) {
        eprintln!("error: cannot write into `{}`: `{}` is a file", dir.display(), blocking.display());
        return EXIT_USAGE;
    }
    if args.transport == Transport::Mpi {
        return run_mpi(&plan, &args, resume, &dir, first_step);
    }
    if args.transport == Transport::Tcp {
        return run_as_rank(&plan, &args, resume, &dir, first_step, pipec_executor::run::tcp_run::run);
    }
    let steps = args.steps.unwrap_or(plan.training.steps);
    let watch = StopWatch::start(Duration::from_secs(args.stop_grace_s.max(1)));
    let options = RunOptions { stop: Some(watch.stop.clone()), resume, gpus, ..run_options(&plan, &args, &dir) };
    // nothing is written until the first step is done: a run that fails before it (a
    // checkpoint that does not load, bad data) leaves the output folder as it was
    let mut metrics = MetricsLog::new(&dir, first_step, &plan, backend);
    let bar = indicatif::ProgressBar::new(steps as u64);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {msg} ETA {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let quiet = bar.is_hidden();
    eprintln!(
        "{}: training {} step(s) of {} on {} worker(s) ({} backend)",
        plan.name,
        steps,
        plan.schedule.kind,
        pipec_executor::working_devices(&plan).len(),
        if backend == BackendKind::Cpu { "cpu (flex)" } else { "cuda" }
    );
    if let Some(from) = args.resume.as_ref().filter(|_| first_step > 0) {
        eprintln!(
            "resuming from {} at step {first_step} (steps are numbered from 0); earlier traces are kept, this run's is {}",
            from.display(),
            trace_file(first_step)
        );
    }
    let speed = RunSpeed::of(&plan, backend);
    if let Some(line) = speed.basis_line() {
        eprintln!("{line}");
    }
    let mut on_step = |m: &StepMetrics| {
        metrics.append(m);
        bar.set_position(m.step as u64 + 1);
        bar.set_message(bar_message(m, steps, &speed));
        if quiet {
            print_step(m, steps, &speed);
        }
    };
    let result = pipec_executor::run(&plan, &options, &mut on_step);
    let stop_took = watch.finish();
    bar.finish_and_clear();
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_DIAGNOSTICS;
        }
    };
    // Measured trace of every step, in the compiler's trace format (none when a stop
    // request came before the first step: then nothing was written at all).
    let trace_name = trace_file(first_step);
    if !report.steps.is_empty() {
        if let Err(e) = write_measured_trace(&dir.join(&trace_name), &plan, &report, "pipec run (measured, every step)")
        {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    }
    let (measured_bubble, measured_step) = measured_bubble(&plan, &report.trace);
    let timed: Vec<f64> = report.steps.iter().skip(1).map(|s| s.step_seconds).collect();
    let median = median(&timed).unwrap_or(measured_step);
    if let (Some(first), Some(last)) = (report.steps.first(), report.steps.last()) {
        println!("loss {:.6} (step {}) -> {:.6} (step {})", first.loss, first.step, last.loss, last.step);
    }
    print_expert_tokens(&report.steps);
    println!(
        "step time: measured {} (median after the first step), predicted {}; bubble: measured {:.1}%, predicted {:.1}%",
        human_time(median),
        human_time(plan.simulation.step_time_s),
        measured_bubble * 100.0,
        plan.simulation.bubble_fraction * 100.0
    );
    if let Some(note) = shared_cores(in_process_cpu(&args), plan.devices.len(), crate::this_cpu::cores()) {
        println!("{note}");
    }
    let kinds = time_by_kind(&plan, &report);
    if !kinds.is_empty() {
        println!("time per step by instruction kind, all devices (measured: the median step after the first; a receive counts its wait):");
        for (kind, predicted, measured) in &kinds {
            let ratio = if *predicted > 0.0 { format!("{:.2}×", measured / predicted) } else { "-".into() };
            println!(
                "  {kind:<20} predicted {:>11}  measured {:>11}  {ratio}",
                human_time(*predicted),
                human_time(*measured)
            );
        }
    }
    print_memory(&plan, &report);
    for c in &report.checkpoints {
        println!("checkpoint {}", c.display());
    }
    println!("wrote {}/{{plan.json, metrics.jsonl, {trace_name}}}", dir.display());
    if report.interrupted {
        print_interrupted(&report, &args, steps, first_step, stop_took);
        return EXIT_DIAGNOSTICS;
    }
    EXIT_OK
}

/// The model state each device held and, for a process that ran one device, its resident
/// memory, each beside the plan's figures.
fn print_memory(plan: &Plan, report: &pipec_executor::RunReport) {
    if !report.held.is_empty() {
        println!("model state held per device at the end (measured, f32 values × 4 B; the plan's figure in brackets):");
        for (d, held) in &report.held {
            let Some(m) = plan.devices.get(d.0 as usize).map(|x| &x.memory) else { continue };
            let b = |values: u64| pipec_compiler::memory::human_bytes(values.saturating_mul(4));
            let p = pipec_compiler::memory::human_bytes;
            println!(
                "  {d:<4} weights {} ({})  gradients {} ({})  optimizer {} ({})",
                b(held.weights),
                p(m.weights),
                b(held.gradients),
                p(m.gradients),
                b(held.optimizer),
                p(m.optimizer)
            );
        }
    }
    let pools: Vec<_> = report.held.iter().filter_map(|(d, h)| Some((d, h.pool_peak?))).collect();
    if !pools.is_empty() {
        println!("device memory per device (measured: the most its memory pool held for live tensors, sampled after each instruction; predicted: the plan's peak without its workspace reserve, which the pool does not hold):");
        for (d, measured) in pools {
            let Some(m) = plan.devices.get(d.0 as usize).map(|x| &x.memory) else { continue };
            let p = pipec_compiler::memory::human_bytes;
            let predicted = m.total.saturating_sub(m.workspace);
            println!(
                "  {d:<4} measured {}  predicted {}  measured/predicted {:.2}",
                p(measured),
                p(predicted),
                measured as f64 / predicted.max(1) as f64
            );
        }
    }
    if !report.weight_gathers.is_empty() {
        let prefetched = |d: &pipec_plan::DeviceId| report.prefetched_gathers.get(d).and_then(|p| p.last()).copied();
        let last: Vec<String> = report
            .weight_gathers
            .iter()
            .filter_map(|(d, g)| {
                g.last().map(|n| match prefetched(d) {
                    Some(p) if p > 0 => format!("{d} {n} ({p} prefetched)"),
                    _ => format!("{d} {n}"),
                })
            })
            .collect();
        println!(
            "ZeRO-3 gathers of whole stage weights in the last step (one for each pass that found them dropped; prefetched: started during the pass before, for another stage): {}",
            last.join(", ")
        );
        let by_product: Vec<String> = report
            .product_gathers
            .iter()
            .filter_map(|(d, g)| g.last().filter(|n| **n > 0).map(|n| format!("{d} {n}")))
            .collect();
        if !by_product.is_empty() {
            println!(
                "ZeRO-3 gathers of single weights by the products reading them in the last step (each linear or LSTM weight and token table before its product in a forward, a product's again in its backward): {}",
                by_product.join(", ")
            );
        }
    }
    if !report.resident.is_empty() {
        println!("resident memory per process running one device (measured: from before its stages were built to the run's peak; predicted: the plan's total without its workspace reserve):");
        for (d, r) in &report.resident {
            let Some(m) = plan.devices.get(d.0 as usize).map(|x| &x.memory) else { continue };
            let predicted = m.total.saturating_sub(m.workspace);
            let p = pipec_compiler::memory::human_bytes;
            println!(
                "  {d:<4} measured {} (peak {} from {})  predicted {}  measured/predicted {:.2}",
                p(r.growth()),
                p(r.peak),
                p(r.baseline),
                p(predicted),
                r.growth() as f64 / predicted.max(1) as f64
            );
        }
    }
}

/// The job of the current process when each device is a process (`--transport mpi` or
/// `tcp`): runs this rank's device with `run`; rank 0 appends each step's metrics and
/// writes the trace. A failure after the ranks met has already ended the job (`run` aborts
/// it); one before is reported here.
fn run_as_rank(plan: &Plan, args: &RunArgs, resume: Option<Resume>, dir: &Path, first_step: usize, run: RankRun) -> u8 {
    // a failing rank also writes its line where `pipec launch` looks (mpirun may be too
    // blocked to forward it)
    if let Some(record) = &args.record_failures {
        pipec_executor::process_run::record_failures_in(record);
    }
    let steps = args.steps.unwrap_or(plan.training.steps);
    // a signal to any rank stops the job at a step boundary the ranks vote on, with a
    // checkpoint of it (mpirun and torchrun forward SIGINT/SIGTERM to every rank)
    let watch = StopWatch::start(Duration::from_secs(args.stop_grace_s.max(1)));
    let options = RunOptions { stop: Some(watch.stop.clone()), resume, ..run_options(plan, args, dir) };
    // rank 0 alone gets each step's metrics, and appends them as they come
    let mut metrics = MetricsLog::new(dir, first_step, plan, backend_kind(args.backend));
    // the step lines never wait for stderr's reader (`progress`)
    // (finished by rank 0's report, or after the run on the others)
    let lines = std::cell::RefCell::new(Some(crate::progress::Lines::stderr()));
    let line = |text: String| {
        if let Some(l) = lines.borrow().as_ref() {
            l.line(text);
        }
    };
    let finish = || {
        if let Some(l) = lines.borrow_mut().take() {
            l.finish();
        }
    };
    let speed = RunSpeed::of(plan, backend_kind(args.backend));
    if let Some(text) = speed.basis_line() {
        line(text);
    }
    let mut on_step = |m: &StepMetrics| {
        metrics.append(m);
        if let Some(text) = step_line(m, steps, &speed) {
            line(text);
        }
    };
    let transport = if args.transport == Transport::Tcp { "tcp" } else { "mpi" };
    // rank 0's outputs, written before the ranks part (the others wait for them)
    let mut code = EXIT_OK;
    let mut on_report = |report: &pipec_executor::RunReport| {
        finish();
        let stop_took = watch.finish();
        print_memory(plan, report);
        for c in &report.checkpoints {
            println!("checkpoint {}", c.display());
        }
        // a stop first: mpirun ends the job shortly after it forwards the signal, and the
        // resume command matters more than the trace
        if report.interrupted {
            print_interrupted(report, args, steps, first_step, stop_took);
            code = EXIT_DIAGNOSTICS;
        }
        let trace_name = trace_file(first_step);
        let source = format!("pipec run --transport {transport} (measured, every step)");
        if !report.steps.is_empty() {
            if let Err(e) = write_measured_trace(&dir.join(&trace_name), plan, report, &source) {
                eprintln!("error: {e}");
                code = EXIT_USAGE;
                return;
            }
        }
        println!("wrote {}/{{plan.json, metrics.jsonl, {trace_name}}}", dir.display());
    };
    let result = run(plan, &options, RankHooks { on_step: &mut on_step, on_report: &mut on_report });
    watch.finish();
    if result.is_ok() {
        finish();
    }
    match result {
        Ok((info, _)) if info.rank == 0 => code,
        // the other ranks end as rank 0 does: a stopped job exits non-zero everywhere
        Ok((_, report)) if report.interrupted => EXIT_DIAGNOSTICS,
        Ok(_) => EXIT_OK,
        Err((info, e)) => {
            pipec_executor::process_run::report_failure(info, &e);
            EXIT_DIAGNOSTICS
        }
    }
}

/// How a rank runs its device: `pipec_executor::mpi_run::run` or `run::tcp_run::run`.
type RankRun = fn(&Plan, &RunOptions, RankHooks<'_>) -> pipec_executor::process_run::RankOutcome;

#[cfg(feature = "mpi")]
fn run_mpi(plan: &Plan, args: &RunArgs, resume: Option<Resume>, dir: &Path, first_step: usize) -> u8 {
    run_as_rank(plan, args, resume, dir, first_step, pipec_executor::mpi_run::run)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_plan: &Plan, _args: &RunArgs, _resume: Option<Resume>, _dir: &Path, _first_step: usize) -> u8 {
    eprintln!("error: this pipec was built without MPI support: rebuild with `cargo build --release --features mpi` (needs Open MPI and clang), or use `--transport tcp` with torchrun's variables");
    EXIT_USAGE
}

/// Whether the run's devices are worker threads of this process on this machine's CPU.
fn in_process_cpu(args: &RunArgs) -> bool {
    args.backend == Backend::Cpu && args.transport == Transport::Threads
}

/// A note where a run's in-process CPU workers (one thread per device) outnumber this
/// machine's cores: they take turns, and a worker waiting in an exchange for a peer that is
/// not running waits out that peer's turn, which the prediction does not count (it prices
/// each worker's kernels at the rate measured with all of them at once).
fn shared_cores(in_process_cpu: bool, workers: usize, cores: usize) -> Option<String> {
    (in_process_cpu && workers > cores).then(|| {
        format!(
            "note: {workers} workers took turns on {cores} core(s): the measured step includes their waits for one another's turn, which the prediction does not count"
        )
    })
}

fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    Some(s[s.len() / 2])
}

/// Idle share of device time in the measured step: 1 − Σ busy / (devices × step).
pub fn measured_bubble(plan: &Plan, trace: &[(pipec_plan::DeviceId, usize, f64, f64)]) -> (f64, f64) {
    let step = trace.iter().map(|t| t.3).fold(0.0, f64::max);
    let devices: std::collections::BTreeSet<_> = trace.iter().map(|t| t.0).collect();
    let busy: f64 = trace
        .iter()
        .filter(|(d, i, _, _)| {
            plan.instruction(*d, *i).is_some_and(|ins| !matches!(ins.phase(), Phase::Communication | Phase::Memory))
        })
        .map(|t| t.3 - t.2)
        .sum();
    if step <= 0.0 || devices.is_empty() {
        return (0.0, step);
    }
    (1.0 - busy / (step * devices.len() as f64), step)
}

/// The name of a run's measured trace: `trace.json` for a run from step 0, and for a run
/// resumed at a later step one of its own (`trace-from-step-N.json`), so that the earlier
/// runs' traces in the same folder are kept.
fn trace_file(first_step: usize) -> String {
    if first_step == 0 {
        "trace.json".to_string()
    } else {
        format!("trace-from-step-{first_step}.json")
    }
}

/// The command that resumes an interrupted run from checkpoint `checkpoint`: the same spec
/// or plan, output folder, steps and backend.
fn resume_command(args: &RunArgs, checkpoint: &Path) -> String {
    let quote = |p: &Path| {
        let s = p.display().to_string();
        if s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-+:=".contains(c)) {
            s
        } else {
            format!("'{}'", s.replace('\'', "'\\''"))
        }
    };
    let mut line = format!("pipec run {}", quote(&args.file));
    if let Some(out) = &args.out {
        line += &format!(" --out {}", quote(out));
    }
    if let Some(steps) = args.steps {
        line += &format!(" --steps {steps}");
    }
    if args.backend == Backend::Cuda {
        line += " --backend cuda";
    }
    match args.transport {
        Transport::Threads => {}
        // every rank again, started as this job's were (mpirun, torchrun's variables)
        Transport::Mpi => line += " --transport mpi",
        Transport::Tcp => line += " --transport tcp",
    }
    line + &format!(" --resume {}", quote(checkpoint))
}

/// Writes the measured trace of a run as a Chrome trace to `path` (atomically): every
/// step's instructions on one time axis from the start of the run (each event's `args.step`
/// says which step), and a marker where each step starts on each device. Streamed event by
/// event: a long run's timeline holds up to `TIMELINE_LIMIT` entries per track, which as one
/// JSON value had taken about 1.3 KB an event (60 MB more peak memory after 1,600 steps of
/// `specs/csv-classifier.yaml`, 2026-12-07).
fn write_measured_trace(
    path: &std::path::Path,
    plan: &Plan,
    report: &pipec_executor::RunReport,
    source: &str,
) -> Result<(), String> {
    crate::output::write_atomic_with(path, &mut |w| measured_trace(w, plan, report, source))
}

/// [`write_measured_trace`]'s text, written to `w`.
fn measured_trace(
    w: &mut dyn std::io::Write,
    plan: &Plan,
    report: &pipec_executor::RunReport,
    source: &str,
) -> std::io::Result<()> {
    let mut first = true;
    let mut event = |w: &mut dyn std::io::Write, e: &serde_json::Value| -> std::io::Result<()> {
        w.write_all(if first { b"{\"traceEvents\":[" } else { b"," })?;
        first = false;
        serde_json::to_writer(&mut *w, e).map_err(std::io::Error::other)
    };
    let mut step_marks: std::collections::BTreeMap<(pipec_plan::DeviceId, usize), f64> = Default::default();
    let mut compute_rows = std::collections::BTreeSet::new();
    for (dev, step, index, start, end) in &report.timeline {
        compute_rows.insert(dev.0);
        if let Some(ins) = plan.instruction(*dev, *index) {
            let mut e = trace_event(*dev, ins, *start, *end);
            e["args"] = serde_json::json!({ "step": step });
            event(w, &e)?;
            let mark = step_marks.entry((*dev, *step)).or_insert(*start);
            *mark = mark.min(*start);
        }
    }
    // the communication threads' work: a second process track, one row per device
    let mut comm_rows = std::collections::BTreeSet::new();
    for (dev, step, index, start, end) in &report.comm_timeline {
        if let Some(ins) = plan.instruction(*dev, *index) {
            let mut e = trace_event(*dev, ins, *start, *end);
            e["pid"] = serde_json::json!(1);
            e["args"] = serde_json::json!({ "step": step });
            event(w, &e)?;
            comm_rows.insert(dev.0);
        }
    }
    // every track named: the compute process, one row per device, and the communication
    // threads' beside them
    event(w, &serde_json::json!({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "compute"}}))?;
    for d in compute_rows {
        event(
            w,
            &serde_json::json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": format!("device {d} compute")}}),
        )?;
    }
    if !comm_rows.is_empty() {
        event(w, &serde_json::json!({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "communication"}}))?;
        for d in comm_rows {
            event(
                w,
                &serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": d, "args": {"name": format!("device {d} communication")}}),
            )?;
        }
    }
    for ((dev, step), at) in step_marks {
        event(
            w,
            &serde_json::json!({"name": format!("step {step}"), "ph": "i", "s": "t", "pid": 0, "tid": dev.0, "ts": at * 1e6}),
        )?;
    }
    let truncated = report.timeline.len() >= pipec_executor::TIMELINE_LIMIT;
    let other = serde_json::json!({"source": source, "plan": plan.name, "truncated": truncated});
    write!(w, "],\"displayTimeUnit\":\"ms\",\"otherData\":{other}}}")
}

/// One line of `metrics.jsonl`.
fn metrics_line(m: &StepMetrics, speed: &RunSpeed) -> serde_json::Value {
    let mut line = serde_json::json!({"step": m.step, "loss": m.loss, "step_time_s": m.step_seconds, "samples_per_s": m.samples_per_s});
    speed.add_to(m, &mut line);
    if let Some(p) = m.perplexity {
        line["perplexity"] = p.into();
    }
    line["lr"] = m.lr.into();
    if let Some(g) = m.grad_norm {
        line["grad_norm"] = g.into();
    }
    if let Some(s) = m.loss_scale {
        line["loss_scale"] = s.into();
        line["skipped"] = m.skipped.into();
    }
    if let Some(e) = m.epoch {
        line["epoch"] = e.into();
    }
    if let Some(w) = m.checkpoint_wait_s {
        line["checkpoint_wait_s"] = w.into();
    }
    if let Some(c) = m.checkpoint_copy_s {
        line["checkpoint_copy_s"] = c.into();
    }
    if let Some(w) = m.checkpoint_write_s {
        line["checkpoint_write_s"] = w.into();
    }
    if let Some(a) = m.aux_loss {
        line["aux_loss"] = a.into();
    }
    if !m.expert_tokens.is_empty() {
        // per mixture-of-experts block (its layer), the tokens each expert took
        line["expert_tokens"] = m
            .expert_tokens
            .iter()
            .map(|(layer, took)| (layer.to_string(), took.clone().into()))
            .collect::<serde_json::Map<String, serde_json::Value>>()
            .into();
    }
    if let Some(v) = &m.validation {
        line["val_loss"] = v.loss.into();
        if let Some(a) = v.accuracy {
            line["val_accuracy"] = a.into();
        }
        if let Some(p) = v.perplexity {
            line["val_perplexity"] = p.into();
        }
    }
    line
}

/// What a stopped run says (on stderr): how many steps it completed, how long after the
/// stop request it ended, which checkpoint holds its last step, and the exact command that
/// resumes it.
fn print_interrupted(
    report: &pipec_executor::RunReport,
    args: &RunArgs,
    steps: usize,
    first_step: usize,
    stop_took: Option<f64>,
) {
    let done = report.steps.last().map_or(first_step, |s| s.step + 1);
    let took = stop_took.map(|s| format!(", {s:.2} s after the stop request")).unwrap_or_default();
    let saved = match report.checkpoints.last() {
        Some(c) if c.file_name().is_some_and(|n| *n == *pipec_plan::checkpoint::step_dir_name(done)) => {
            format!("; the checkpoint of step {} holds it", done.saturating_sub(1))
        }
        _ => String::new(),
    };
    eprintln!(
        "error: interrupted: stopped after {done} of {steps} steps{took} (steps are numbered from 0: the last done was step {}; every completed step is in metrics.jsonl{saved})",
        done.saturating_sub(1),
    );
    if let Some(c) = report.checkpoints.last() {
        let how = match args.transport {
            Transport::Threads => "",
            Transport::Mpi | Transport::Tcp => " (every rank, started as this job's were)",
        };
        eprintln!("resume with{how}: {}", resume_command(args, c));
    }
}

/// How a run answers SIGINT and SIGTERM: the first sets the stop flag the workers check at
/// step boundaries (the run stops at the next one all agree on, writes a checkpoint of that
/// step, keeps what it trained, and exits non-zero), notes when it came, and bounds the stop:
/// a run whose step in progress and final checkpoint have not ended `grace` after it exits,
/// saying so, before a scheduler's SIGKILL would end it unannounced (a checkpoint cut short
/// leaves only its temporary folder, which the next run removes). A second SIGINT ends the
/// process at once.
struct StopWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    asked: std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl StopWatch {
    fn start(grace: Duration) -> StopWatch {
        use signal_hook::consts::{SIGINT, SIGTERM};
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{Arc, Mutex, PoisonError};
        let watch = StopWatch {
            stop: Arc::new(AtomicBool::new(false)),
            asked: Arc::new(Mutex::new(None)),
            done: Arc::new(AtomicBool::new(false)),
        };
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) else {
            eprintln!("warning: SIGINT and SIGTERM cannot be caught here: a stop ends the run without a checkpoint");
            return watch;
        };
        let (stop, asked, done) = (watch.stop.clone(), watch.asked.clone(), watch.done.clone());
        std::thread::spawn(move || {
            for signal in signals.forever() {
                if stop.load(Ordering::SeqCst) {
                    if signal == SIGINT {
                        std::process::exit(130);
                    }
                    continue;
                }
                // when, noted before the workers can see the flag
                let at = std::time::Instant::now();
                *asked.lock().unwrap_or_else(PoisonError::into_inner) = Some(at);
                stop.store(true, Ordering::SeqCst);
                let done = done.clone();
                std::thread::spawn(move || {
                    while at.elapsed() < grace {
                        if done.load(Ordering::SeqCst) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    eprintln!(
                        "error: interrupted: the step in progress and the final checkpoint did not end within {} s of the stop request (--stop-grace); exiting without a final checkpoint: resume from the last periodic one",
                        grace.as_secs()
                    );
                    std::process::exit(i32::from(EXIT_DIAGNOSTICS));
                });
            }
        });
        watch
    }

    /// The run has returned: the bound no longer applies. The seconds from the stop
    /// request to now, when one came.
    fn finish(&self) -> Option<f64> {
        self.done.store(true, std::sync::atomic::Ordering::SeqCst);
        self.asked.lock().unwrap_or_else(std::sync::PoisonError::into_inner).map(|at| at.elapsed().as_secs_f64())
    }
}

/// The checkpoint `--resume` names (a step directory, a checkpoint directory, or a run
/// directory, where the spec's `checkpoint.dir` is looked in too), read and verified
/// (checksums, shapes against the plan's model), and the step it resumes at; an error
/// before anything is written when there is none or it does not load.
fn resolve_resume(args: &RunArgs, plan: &Plan) -> Result<(Option<Resume>, usize), String> {
    if let Some(dir) = &args.init {
        // the weights alone, as a step-0 checkpoint of one whole stage: every layout takes
        // its part of each weight the way a resume does, and the optimizer starts fresh
        let (loaded, c) = pipec_plan::hf::initial_weights(plan, dir, args.init_partial)
            .map_err(|e| format!("--init `{}`: {e}", dir.display()))?;
        eprintln!(
            "init: {} tensors ({} values) from `{}` into the model's {} parameters",
            c.tensors_used,
            c.values_used,
            dir.display(),
            loaded.params.len()
        );
        if !c.unused.is_empty() {
            eprintln!(
                "note: --init-partial skipped {} tensor(s) the model does not use: {}",
                c.unused.len(),
                pipec_plan::hf::list_names(&c.unused, 12)
            );
        }
        let mut kinds: Vec<&str> = c.ignored.iter().map(|(_, why)| *why).collect();
        kinds.dedup();
        for why in kinds {
            let names: Vec<String> = c.ignored.iter().filter(|(_, w)| *w == why).map(|(n, _)| n.clone()).collect();
            eprintln!(
                "note: not loaded, as no model of pipec's reads them: {why}: {}",
                pipec_plan::hf::list_names(&names, 3)
            );
        }
        if !loaded.initial.is_empty() {
            let names: Vec<String> = loaded.initial.values().map(|n| format!("`{n}`")).collect();
            eprintln!(
                "note: `{}` has no {}: the classifier starts from pipec's initial values (fine-tuning a base checkpoint)",
                dir.display(),
                names.join(", ")
            );
        }
        return Ok((Some(Resume::Loaded(std::sync::Arc::new(loaded))), 0));
    }
    let Some(p) = &args.resume else { return Ok((None, 0)) };
    let found = pipec_executor::checkpoint::locate_in(p, plan.training.checkpoint_dir.as_deref())?;
    let loaded = pipec_executor::read_checkpoint(&found, &plan.training.optimizer)
        .map_err(|e| format!("checkpoint `{}`: {e}", found.display()))?;
    loaded.check_fits(plan).map_err(|e| format!("checkpoint `{}`: {e}", found.display()))?;
    let first = loaded.completed_steps;
    let steps = args.steps.unwrap_or(plan.training.steps);
    if first >= steps {
        return Err(format!(
            "the checkpoint has completed {first} step(s) and this run is {steps} step(s) long: nothing is left to train (raise `--steps` or `training.steps`)"
        ));
    }
    Ok((Some(Resume::Loaded(std::sync::Arc::new(loaded))), first))
}

/// `metrics.jsonl`, one line per step, appended and flushed as each step completes, so a
/// killed or failed run keeps every completed step's line. A fresh run starts it empty; a
/// resumed run keeps the lines of the steps before the checkpoint and the events (an
/// elastic launcher's re-plans), and drops the rest.
/// Nothing is written before the first step is done: then the output folder is made, the
/// plan written (`plan.json`) and the log opened, so a run that fails before training
/// anything leaves an existing run's files as they were. Under MPI only rank 0 writes.
struct MetricsLog {
    dir: PathBuf,
    plan_text: String,
    first_step: usize,
    /// Each line's speed beside samples/s (a language model's tokens/s and MFU).
    speed: RunSpeed,
    file: Option<std::fs::File>,
    failed: bool,
}

impl MetricsLog {
    fn new(dir: &Path, first_step: usize, plan: &Plan, backend: BackendKind) -> MetricsLog {
        let plan_text = pipec_plan::output::json_text(plan).unwrap_or_default();
        MetricsLog {
            dir: dir.to_path_buf(),
            plan_text,
            first_step,
            speed: RunSpeed::of(plan, backend),
            file: None,
            failed: false,
        }
    }

    fn open(&mut self) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("cannot create `{}`: {e}", self.dir.display()))?;
        write_atomic(&self.dir.join("plan.json"), self.plan_text.as_bytes())?;
        let path = self.dir.join("metrics.jsonl");
        let kept: String = match std::fs::read_to_string(&path) {
            Ok(text) => text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<serde_json::Value>(l).ok().is_some_and(|v| {
                        v["event"].is_string() || v["step"].as_u64().is_some_and(|s| (s as usize) < self.first_step)
                    })
                })
                .map(|l| format!("{l}\n"))
                .collect(),
            Err(_) => String::new(),
        };
        write_atomic(&path, kept.as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;
        self.file = Some(file);
        Ok(())
    }

    fn append(&mut self, m: &StepMetrics) {
        if self.file.is_none() && !self.failed {
            if let Err(e) = self.open() {
                eprintln!("warning: {e}; the metrics are not saved");
                self.failed = true;
            }
        }
        if let Some(f) = &mut self.file {
            // one write a line: a launcher may append its record while this run ends
            let _ = pipec_plan::output::write_line(f, &metrics_line(m, &self.speed).to_string());
            let _ = f.flush();
        }
    }
}

/// The executor's options for `pipec run`'s arguments, on either transport.
fn run_options(plan: &Plan, args: &RunArgs, dir: &Path) -> RunOptions {
    RunOptions {
        steps: Some(args.steps.unwrap_or(plan.training.steps)),
        backend: backend_kind(args.backend),
        timeout: Duration::from_secs(args.timeout_s.max(1)),
        // the spec's checkpoint folder, else `checkpoints` in the run's: a stop writes its
        // final checkpoint there even when the spec asks for no periodic ones
        checkpoint_dir: Some(dir.join(plan.training.checkpoint_dir.as_deref().unwrap_or("checkpoints"))),
        resume: None,
        share_gpus: args.share_gpus,
        nccl_check: args.nccl_check,
        gpus: None,
        stop: None,
        vote: None,
    }
}

fn backend_kind(b: Backend) -> BackendKind {
    match b {
        Backend::Cpu => BackendKind::Cpu,
        Backend::Cuda => BackendKind::Cuda,
    }
}

/// A mixture of experts' routing as it happened: per block, each expert's share of the
/// tokens it took over the run, and the busiest expert against the mean (the skew the
/// prediction's uniform routing does not see).
fn print_expert_tokens(steps: &[StepMetrics]) {
    let mut total = pipec_executor::ExpertTokens::new();
    for (layer, took) in steps.iter().flat_map(|s| s.expert_tokens.iter()) {
        pipec_executor::add_expert_tokens(&mut total, *layer, took);
    }
    if total.is_empty() {
        return;
    }
    println!("tokens each expert took over the run, per mixture-of-experts block (the busiest against the mean):");
    for (layer, took) in &total {
        let all = took.iter().sum::<u64>().max(1) as f64;
        let shares: Vec<String> = took.iter().map(|&t| format!("{:.1}%", 100.0 * t as f64 / all)).collect();
        let busiest = took.iter().copied().max().unwrap_or(0) as f64 / (all / took.len().max(1) as f64);
        println!("  layer {layer}: {} ({busiest:.2}×)", shares.join(" "));
    }
}

/// Prints a step's loss and speed: the first three steps, every tenth and the last of `steps`.
fn print_step(m: &StepMetrics, steps: usize, speed: &RunSpeed) {
    if let Some(line) = step_line(m, steps, speed) {
        eprintln!("{line}");
    }
}

/// The line a step prints, for the first three, every tenth, the last, those with a
/// validation and those fp16's loss scaling skipped.
fn step_line(m: &StepMetrics, steps: usize, speed: &RunSpeed) -> Option<String> {
    if m.step < 3 || (m.step + 1).is_multiple_of(10) || m.step + 1 == steps || m.validation.is_some() || m.skipped {
        let perplexity = m.perplexity.map(|p| format!("  perplexity {p:.2}")).unwrap_or_default();
        let perplexity = match m.aux_loss {
            Some(a) => format!("{perplexity}  load-balancing loss {a:.6}"),
            None => perplexity,
        };
        let validation = m
            .validation
            .map(|v| {
                let mut s = format!("  validation loss {:.6}", v.loss);
                if let Some(a) = v.accuracy {
                    s.push_str(&format!(" accuracy {:.1}%", a * 100.0));
                }
                s
            })
            .unwrap_or_default();
        let validation = match (m.loss_scale, m.skipped) {
            (Some(scale), true) => {
                format!(
                    "{validation}  skipped: a gradient overflowed at loss scale {scale} (now {})",
                    scale * pipec_plan::recipe::LossScale::BACKOFF
                )
            }
            _ => validation,
        };
        Some(format!(
            "step {:>5}  loss {:.6}{perplexity}  {:.1} ms  {}{validation}",
            m.step,
            m.loss,
            m.step_seconds * 1e3,
            speed.text(m)
        ))
    } else {
        None
    }
}

/// The progress bar's message after a step: the step's number as the log and
/// metrics.jsonl write it (from 0) against the last one's, its loss and speed.
fn bar_message(m: &StepMetrics, steps: usize, speed: &RunSpeed) -> String {
    format!("step {}/{} loss {:.5} {}", m.step, steps.saturating_sub(1), m.loss, speed.text(m))
}

/// Per instruction kind: the plan's predicted seconds per step and the run's measured ones,
/// each summed over the devices (measured: the median over the steps after the first that
/// the timeline holds, or the first when it is the only one).
pub fn time_by_kind(plan: &Plan, report: &pipec_executor::RunReport) -> Vec<(&'static str, f64, f64)> {
    use std::collections::BTreeMap;
    let mut per_step: BTreeMap<usize, BTreeMap<&'static str, f64>> = BTreeMap::new();
    for &(device, step, code, start, end) in &report.timeline {
        if let Some(i) = plan.instruction(device, code) {
            *per_step.entry(step).or_default().entry(i.phase().name()).or_insert(0.0) += (end - start).max(0.0);
        }
    }
    let first = per_step.keys().next().copied();
    let later: Vec<&BTreeMap<&str, f64>> =
        per_step.iter().filter(|(s, _)| Some(**s) != first || per_step.len() == 1).map(|(_, m)| m).collect();
    Phase::ALL
        .iter()
        .map(|p| p.name())
        .filter_map(|kind| {
            // (+ 0.0: an empty sum is −0.0)
            let predicted: f64 = plan.simulation.devices.iter().filter_map(|d| d.by_phase.get(kind)).sum::<f64>() + 0.0;
            let measured = median(&later.iter().map(|m| m.get(kind).copied().unwrap_or(0.0)).collect::<Vec<_>>());
            let measured = measured.unwrap_or(0.0);
            (predicted > 0.0 || measured > 0.0).then_some((kind, predicted, measured))
        })
        .collect()
}

/// Whether pipec's executor runs the plan of `spec` as written (its features, and
/// `pipec_executor::validate`); true for a spec that does not compile, whose compile reports
/// why.
fn executor_would_run(spec: &pipec_grammar::spec::Spec) -> bool {
    match pipec_compiler::compile(spec, &pipec_compiler::CompileOptions::default()).into_compiled() {
        Ok(c) => {
            pipec_plan::features::used(&c.plan).iter().all(|(f, _)| !refused(*f))
                && pipec_executor::validate(&c.plan).is_ok()
        }
        Err(_) => true,
    }
}

/// Refuses a plan that uses a feature pipec's executor does not run
/// (`pipec_plan::features`): the plan was made for another engine, or to be priced, and
/// training it here would train something else.
fn executor_runs_its_features(plan: &Plan) -> Result<(), String> {
    use pipec_plan::features::used;
    let features = used(plan);
    for (f, _) in &features {
        if let Some(note) = feature_note(*f, plan) {
            eprintln!("{note}");
        }
    }
    let refused: Vec<String> = features
        .into_iter()
        .filter(|(f, _)| refused(*f))
        .map(|(f, layer)| match layer {
            Some(l) => format!("{f} at layer {l}"),
            None => format!("{f}"),
        })
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    Err(format!(
        "pipec's executor does not run {} yet; the plan's figures are for an engine that does (compile it with `pipec compile` to see them)",
        refused.join(", ")
    ))
}

/// Whether pipec's executor refuses a plan using `f`.
fn refused(f: pipec_plan::features::Feature) -> bool {
    use pipec_plan::features::Feature;
    match f {
        // a head size other than d/heads, query/key norms and sliding windows run
        // (tests/training.rs; the qwen3 and mistral fixtures against transformers), and so
        // do sinks (GPT-OSS's attention core in transformers: the gpt-oss-attention
        // fixture), around context parallelism's ring too
        Feature::HeadSize | Feature::QkNorm | Feature::SlidingWindow | Feature::AttentionSinks => false,
        // a block's dropout runs, its masks drawn by position as one device's, around
        // context parallelism's ring too (tests/training.rs)
        Feature::BlockDropout => false,
        // multi-head latent attention runs (the deepseek-v3 fixture against transformers)
        Feature::LatentAttention => false,
        // recompute by layers, module or operation runs (tests/training.rs); the layouts it
        // does not run beside are refused by `pipec_executor::validate`
        Feature::LayerRecompute | Feature::ModuleRecompute => false,
        // weights without a master copy and optimizer state below fp32 run, and FP8 trains
        // in bf16 ([`feature_note`] says how)
        Feature::OptimizerStatePrecision | Feature::NoMasterWeights | Feature::Fp8 => false,
        // the fixed expert bias runs (choice only; kept in checkpoints, read from and
        // written to DeepSeek-V3's `e_score_correction_bias`)
        Feature::ExpertBias => false,
        // whole experts beside tensor parallelism run (tests/training.rs), each rank
        // dispatching its share of the rows over the replicas' ranks; beside ZeRO they are
        // refused by `pipec_executor::validate`
        Feature::WholeExperts => false,
        Feature::ActivationOffload | Feature::MultiTokenPrediction => true,
    }
}

/// What `pipec run` says of a feature the executor runs otherwise than the plan prices it.
fn feature_note(f: pipec_plan::features::Feature, plan: &Plan) -> Option<String> {
    use pipec_plan::features::Feature;
    match f {
        // each update's results rounded to their precision (the executor's optimizer
        // storage), held as f32
        Feature::OptimizerStatePrecision | Feature::NoMasterWeights => Some(format!(
            "note: {}: pipec's executor rounds them to their precision after each update and holds them as f32, so its numbers are that precision's and its memory for them twice the plan's",
            f.written()
        )),
        // the plan's precision is bf16 around the FP8 products: the executor trains
        // everything in bf16 and says so
        Feature::Fp8 => Some(format!(
            "warning: the plan's blocks multiply in FP8 ({} scaling), but pipec's executor has no FP8 products: it trains them in bf16, so its steps and memory differ from the plan's",
            plan.training.fp8.map_or("", |f| f.recipe.name())
        )),
        Feature::HeadSize
        | Feature::QkNorm
        | Feature::SlidingWindow
        | Feature::AttentionSinks
        | Feature::LatentAttention
        | Feature::BlockDropout
        | Feature::ExpertBias
        | Feature::ModuleRecompute
        | Feature::LayerRecompute
        | Feature::ActivationOffload
        | Feature::WholeExperts
        | Feature::MultiTokenPrediction => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{measured_trace, shared_cores};

    /// A trace streamed to its writer is one JSON document: every timed instruction of the
    /// compute and communication tracks, the tracks' names and one step marker per device
    /// and step, each where the plan says.
    #[test]
    fn the_measured_trace_is_streamed_as_one_json_document_of_every_event() {
        let source = "name: t\nmodel:\n  input: [8]\n  layers:\n    - linear(8, 8) -> relu\n    - linear(8, 2)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: 2\n  device: { kind: cpu, memory: 1GiB, throughput: 1TFLOP/s }\n  links:\n    intra_node: { bandwidth: 10GB/s, latency: 5us }\nstrategy:\n  stages: \"1-1\"\n  schedule: 1f1b\n  microbatches: 2\ntraining:\n  batch_size: 8\n  steps: 3\n  optimizer: { kind: sgd, lr: 0.01 }\n  data: { kind: synthetic, task: classification, samples: 16 }\n";
        let spec = pipec_grammar::check::check_source(source).spec.expect("checks");
        let plan = pipec_compiler::compile(&spec, &pipec_compiler::CompileOptions::default())
            .into_compiled()
            .expect("compiles")
            .plan;
        let mut report = pipec_executor::RunReport::default();
        for step in 0..3 {
            for (dev, stream) in &plan.streams {
                for index in 0..stream.len() {
                    let at = step as f64 + index as f64 * 1e-3;
                    report.timeline.push((*dev, step, index, at, at + 5e-4));
                }
                report.comm_timeline.push((*dev, step, 0, step as f64, step as f64 + 1e-4));
            }
        }
        let mut out = Vec::new();
        measured_trace(&mut out, &plan, &report, "a test").expect("written");
        let trace: serde_json::Value = serde_json::from_slice(&out).expect("one JSON document");
        let events = trace["traceEvents"].as_array().expect("events");
        let count = |ph: &str, pid: u64| events.iter().filter(|e| e["ph"] == ph && e["pid"] == pid).count();
        assert_eq!(count("X", 0), report.timeline.len());
        assert_eq!(count("X", 1), report.comm_timeline.len());
        assert_eq!(count("M", 0), 1 + plan.streams.len(), "the compute process and its rows");
        assert_eq!(count("M", 1), 1 + plan.streams.len(), "the communication process and its rows");
        assert_eq!(count("i", 0), 3 * plan.streams.len(), "a marker per device and step");
        let first = &events[0];
        let (dev, step, index, start, end) = report.timeline[0];
        assert_eq!(first["name"], plan.instruction(dev, index).expect("an instruction").to_string());
        assert_eq!(
            (first["args"]["step"].as_u64(), first["tid"].as_u64()),
            (Some(step as u64), Some(u64::from(dev.0)))
        );
        assert!((first["ts"].as_f64().expect("ts") - start * 1e6).abs() < 1e-6);
        assert!((first["dur"].as_f64().expect("dur") - (end - start) * 1e6).abs() < 1e-6);
        assert_eq!(trace["otherData"]["source"], "a test");
        assert_eq!(trace["otherData"]["truncated"], false);
    }

    #[test]
    fn a_note_says_when_the_workers_outnumber_the_cores() {
        assert!(shared_cores(true, 4, 2).is_some_and(|n| n.contains("4 workers took turns on 2 core(s)")));
        assert_eq!(shared_cores(true, 2, 2), None);
        // over MPI or TCP, or on a GPU, the processes or devices are not this count
        assert_eq!(shared_cores(false, 4, 2), None);
    }
}
